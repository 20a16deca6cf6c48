// ddpadplugin.so: what LAMMPS's `plugin load` (or LAMMPS_PLUGIN_PATH) opens.
// It opens the pair style, libddpad_pair.so beside it, with RTLD_DEEPBIND,
// so that libtorch, loaded with it, binds its own symbols first. liblammps
// exports a reference BLAS (dgemm_, sgemm_, ...) and libtorch calls BLAS
// through interposable symbols: linked directly, every matrix product of a
// package ran on LAMMPS's reference dgemm (measured: a MACE step 0.55 s
// in lmp against 0.31 s for the same package in Python).

#include <cstdio>
#include <dlfcn.h>
#include <string>

extern "C" void lammpsplugin_init(void *lmp, void *handle, void *regfunc)
{
  Dl_info self;
  if (dladdr(reinterpret_cast<void *>(&lammpsplugin_init), &self) == 0 || self.dli_fname == nullptr) {
    std::fprintf(stderr, "ddpad: cannot tell where ddpadplugin.so lies; pair_style ddpad is not loaded\n");
    return;
  }
  std::string path(self.dli_fname);
  path = path.substr(0, path.rfind('/') + 1) + "libddpad_pair.so";
  void *pair = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL | RTLD_DEEPBIND);
  if (pair == nullptr) {
    std::fprintf(stderr, "ddpad: cannot load %s (%s); rebuild it with: ddpad lammps build-plugin --force\n",
                 path.c_str(), dlerror());
    return;
  }
  using Init = void (*)(void *, void *, void *);
  auto init = reinterpret_cast<Init>(dlsym(pair, "ddpad_lammpsplugin_init"));
  if (init == nullptr) {
    std::fprintf(stderr, "ddpad: %s has no ddpad_lammpsplugin_init; rebuild it with: ddpad lammps build-plugin "
                         "--force\n", path.c_str());
    return;
  }
  init(lmp, handle, regfunc);
}
