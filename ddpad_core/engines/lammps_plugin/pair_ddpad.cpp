// pair_style ddpad: a ddpad LAMMPS package (an AOTInductor .pt2 per rung of
// a cap ladder, built by `ddpad precompile ADAPTER --lammps`) as a LAMMPS
// pair style, run by libtorch's AOTIModelPackageLoader: no Python in the MD
// loop. Built and registered by `ddpad lammps build-plugin`.
//
//   pair_style ddpad PACKAGE.pt2|FOLDER
//   pair_coeff * * El1 El2 ...        (LAMMPS atom types to elements)
//
// Each step, on each rank: the pairs within the cutoff from LAMMPS's full
// neighbour list (ghost atoms' neighbours included: message passing reaches
// layers x cutoff), pruned to what the owned atoms' energy depends on (the
// edges of atoms within layers - 1 hops of an owned atom), the smallest
// rung that holds them (ranks need not agree: nothing compiles), and forces
// on local and ghost rows written back; LAMMPS sums ghost rows to their
// owners (newton on). Energy: the owned atoms'. Virial: sum of x (x) f over local
// and ghost rows (virial_fdotr_compute), exact for a translation-invariant
// energy.

#include "atom.h"
#include "comm.h"
#include "error.h"
#include "force.h"
#include "memory.h"
#include "neigh_list.h"
#include "neighbor.h"
#include "pair.h"
#include "update.h"

#include <ATen/Version.h>
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>
#include <torch/torch.h>

#include <algorithm>
#include <cstring>
#include <dirent.h>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <sys/stat.h>
#include <vector>

#ifndef DDPAD_LAMMPS_VERSION
#error "build with -DDDPAD_LAMMPS_VERSION=\"<the LAMMPS version the plugin is for>\" (ddpad lammps build-plugin does)"
#endif

namespace LAMMPS_NS {

namespace {

constexpr const char *FORMAT = "2";  // the package layout this plugin reads (metadata ddpad.lammps)

struct Rung {
  std::string path;
  int atoms = 0;  // rows, the reserved dead ones included
  int edges = 0;
  std::unique_ptr<torch::inductor::AOTIModelPackageLoader> loader;  // loaded on first use
};

std::vector<std::string> split(const std::string &text)
{
  std::istringstream in(text);
  std::vector<std::string> words;
  for (std::string w; in >> w;) words.push_back(w);
  return words;
}

std::string value(const std::unordered_map<std::string, std::string> &meta, const std::string &key,
                  const std::string &path)
{
  auto found = meta.find(key);
  if (found == meta.end())
    throw std::runtime_error(path + " has no '" + key + "' in its metadata: not a ddpad LAMMPS package (build "
                             "one with: ddpad precompile ADAPTER --lammps --model MODEL)");
  return found->second;
}

// The vector ISA a package needs, from the first word of AOTI_CPU_ISA, ranked
// against this CPU's (a package built for AVX512 dies of SIGILL elsewhere).
int isa_rank(const std::string &isa)
{
  if (isa.rfind("AVX512", 0) == 0) return 2;
  if (isa.rfind("AVX2", 0) == 0) return 1;
  return 0;
}

int cpu_rank()
{
  return isa_rank(at::get_cpu_capability());  // "AVX512", "AVX2", "DEFAULT", ...
}

}    // namespace

class PairDdpad : public Pair {
 public:
  explicit PairDdpad(LAMMPS *lmp) : Pair(lmp)
  {
    single_enable = 0;
    restartinfo = 0;
    one_coeff = 1;
    manybody_flag = 1;
    centroidstressflag = CENTROID_NOTAVAIL;
  }

  ~PairDdpad() override
  {
    if (allocated) {
      memory->destroy(setflag);
      memory->destroy(cutsq);
    }
  }

  void settings(int narg, char **arg) override;
  void coeff(int narg, char **arg) override;
  void init_style() override;
  double init_one(int, int) override { return cutoff; }
  void compute(int eflag, int vflag) override;

 private:
  std::vector<Rung> rungs;           // ascending by atoms
  std::vector<std::string> elements; // the packages' element indices
  std::vector<int64_t> species;      // per LAMMPS type (1-based): index into elements
  std::string adapter, dtype, source;
  double cutoff = 0.0;
  int layers = 1;
  int reserved = 2;
  std::vector<int64_t> senders, receivers;  // a step's pairs: LAMMPS indices, then package rows
  std::vector<int> hops, rows, row_of;       // hops from an owned atom; kept atoms' LAMMPS indices

  void read_rung(const std::string &path);
  void collect();
  void allocate();
  Rung &rung_for(int atoms, int edges);
};

void PairDdpad::read_rung(const std::string &path)
{
  auto meta = torch::inductor::AOTIModelPackageLoader::load_metadata_from_package(path, "model");
  if (value(meta, "ddpad.lammps", path) != FORMAT)
    throw std::runtime_error(path + " is a ddpad LAMMPS package of layout " + meta["ddpad.lammps"] +
                             "; this plugin reads layout " + FORMAT + ": rebuild the package or the plugin");
  std::string isa = meta.count("AOTI_CPU_ISA") ? meta["AOTI_CPU_ISA"] : "";
  if (isa_rank(isa) > cpu_rank())
    throw std::runtime_error(path + " was built for a CPU with " + isa + ", which this CPU lacks: build the "
                             "package on this machine (ddpad precompile ... --lammps)");
  if (meta.count("AOTI_DEVICE_KEY") && meta["AOTI_DEVICE_KEY"] != "cpu")
    throw std::runtime_error(path + " was built for " + meta["AOTI_DEVICE_KEY"] + "; this plugin runs CPU packages");
  Rung rung;
  rung.path = path;
  rung.atoms = std::stoi(value(meta, "ddpad.atoms", path));
  rung.edges = std::stoi(value(meta, "ddpad.edges", path));
  std::string name = value(meta, "ddpad.adapter", path), kind = value(meta, "ddpad.dtype", path);
  double cut = std::stod(value(meta, "ddpad.cutoff", path));
  auto els = split(value(meta, "ddpad.elements", path));
  if (value(meta, "ddpad.units", path) != "metal")
    throw std::runtime_error(path + " is in units " + meta["ddpad.units"] + "; pair_style ddpad runs units metal");
  if (rungs.empty()) {
    adapter = name, dtype = kind, cutoff = cut, elements = els;
    layers = std::stoi(value(meta, "ddpad.layers", path));
    reserved = std::stoi(value(meta, "ddpad.reserved", path));
  } else if (name != adapter || kind != dtype || cut != cutoff || els != elements) {
    throw std::runtime_error(path + " was built for another model than " + rungs.front().path +
                             " (adapter, dtype, cutoff or elements differ): one model's packages per folder");
  }
  rungs.push_back(std::move(rung));
}

void PairDdpad::settings(int narg, char **arg)
{
  if (narg != 1) error->all(FLERR, "Illegal pair_style ddpad command: pair_style ddpad PACKAGE.pt2|FOLDER");
  source = arg[0];
  std::vector<std::string> paths;
  struct stat info;
  if (stat(source.c_str(), &info) != 0)
    error->all(FLERR, "pair_style ddpad: {} does not exist (build packages with: ddpad precompile ADAPTER --lammps "
                      "--model MODEL --out {})", source, source);
  if (S_ISDIR(info.st_mode)) {
    if (DIR *dir = opendir(source.c_str())) {
      while (dirent *entry = readdir(dir)) {
        std::string name = entry->d_name;
        if (name.size() > 4 && name.compare(name.size() - 4, 4, ".pt2") == 0) paths.push_back(source + "/" + name);
      }
      closedir(dir);
    }
    if (paths.empty()) error->all(FLERR, "pair_style ddpad: folder {} holds no .pt2 package", source);
  } else {
    paths.push_back(source);
  }
  rungs.clear();
  try {
    for (const auto &path : paths) read_rung(path);
  } catch (const std::exception &exc) {
    error->all(FLERR, "pair_style ddpad: {}", exc.what());
  }
  std::sort(rungs.begin(), rungs.end(), [](const Rung &a, const Rung &b) {
    return a.atoms != b.atoms ? a.atoms < b.atoms : a.edges < b.edges;
  });
}

void PairDdpad::allocate()
{
  allocated = 1;
  int n = atom->ntypes + 1;
  memory->create(setflag, n, n, "pair:setflag");
  memory->create(cutsq, n, n, "pair:cutsq");
  for (int i = 0; i < n; i++)
    for (int j = 0; j < n; j++) setflag[i][j] = 0;
}

void PairDdpad::coeff(int narg, char **arg)
{
  if (!allocated) allocate();
  int ntypes = atom->ntypes;
  if (narg != 2 + ntypes || strcmp(arg[0], "*") != 0 || strcmp(arg[1], "*") != 0)
    error->all(FLERR, "pair_coeff for pair_style ddpad: pair_coeff * * followed by one element per atom type "
                      "({} types)", ntypes);
  species.assign(ntypes + 1, -1);
  std::string known;
  for (const auto &e : elements) known += (known.empty() ? "" : " ") + e;
  for (int t = 1; t <= ntypes; t++) {
    auto found = std::find(elements.begin(), elements.end(), std::string(arg[1 + t]));
    if (found == elements.end())
      error->all(FLERR, "pair_coeff: element {} (type {}) is not one the {} model knows ({})", arg[1 + t], t,
                 adapter, known);
    species[t] = found - elements.begin();
  }
  for (int i = 1; i <= ntypes; i++)
    for (int j = i; j <= ntypes; j++) setflag[i][j] = 1;
}

void PairDdpad::init_style()
{
  if (force->newton_pair == 0)
    error->all(FLERR, "pair_style ddpad needs newton on: it writes forces on ghost atoms, which LAMMPS sums to "
                      "their owners only with newton on (set 'newton on')");
  if (strcmp(update->unit_style, "metal") != 0)
    error->all(FLERR, "pair_style ddpad: the {} model runs in units metal (eV, Angstrom), not {}: set 'units "
                      "metal'", adapter, update->unit_style);
  if (atom->tag_enable == 0) error->all(FLERR, "pair_style ddpad needs atom IDs");
  // message passing: owned atoms see layers x cutoff deep, through ghost atoms
  double need = layers * cutoff + neighbor->skin;
  double ghost = std::max(comm->cutghostuser, cutoff + neighbor->skin);
  if (layers > 1 && ghost < need - 1e-9)
    error->all(FLERR, "pair_style ddpad: the {} model passes messages over {} layers of cutoff {:.6g} A: ghost "
                      "atoms must reach {:.6g} A (layers x cutoff + skin), LAMMPS's reach {:.6g} A: set "
                      "'comm_modify cutoff {:.6g}'", adapter, layers, cutoff, need, ghost, need + 1e-6);
  neighbor->add_request(this, NeighConst::REQ_FULL | NeighConst::REQ_GHOST);
}

Rung &PairDdpad::rung_for(int atoms, int edges)
{
  for (auto &rung : rungs)
    if (atoms + reserved <= rung.atoms && edges <= rung.edges) return rung;
  const Rung &top = rungs.back();
  error->one(FLERR, "pair_style ddpad: at step {} this rank needs {} atoms (local + ghost) and {} pairs, more than "
                    "the largest package takes ({}: {} atoms with {} reserved, {} edges): build a larger ladder "
                    "with 'ddpad precompile {} --lammps --model MODEL --rung {}:{}'",
             update->ntimestep, atoms, edges, top.path, top.atoms, reserved, top.edges, adapter,
             (atoms + reserved) * 5 / 4, edges * 5 / 4);
  return rungs.back();  // (not reached: error->one aborts)
}

void PairDdpad::collect()
{
  // the pairs within the cutoff over local and ghost atoms (both ways: a full list with ghost neighbours)
  double **x = atom->x;
  int nlocal = atom->nlocal, nall = nlocal + atom->nghost;
  senders.clear(), receivers.clear();
  double cut2 = cutoff * cutoff;
  for (int ii = 0; ii < list->inum + list->gnum; ii++) {
    int i = list->ilist[ii];
    int *jlist = list->firstneigh[i];
    for (int jj = 0; jj < list->numneigh[i]; jj++) {
      int j = jlist[jj] & NEIGHMASK;
      double dx = x[j][0] - x[i][0], dy = x[j][1] - x[i][1], dz = x[j][2] - x[i][2];
      if (dx * dx + dy * dy + dz * dz < cut2) senders.push_back(j), receivers.push_back(i);
    }
  }
  // keep what the owned atoms' energy depends on (ddpad.engines.lammps_package.GhostGraph.pruned):
  // the edges of atoms within layers - 1 hops of an owned atom (both ways: a model gathers on either
  // end), and the atoms they join; owned atoms' energies, and so every force, are the whole graph's
  hops.assign(nall, layers + 1);
  std::fill(hops.begin(), hops.begin() + nlocal, 0);
  for (int level = 1; level <= layers; level++)
    for (size_t n = 0; n < senders.size(); n++)
      if (hops[receivers[n]] == level - 1 && hops[senders[n]] > level) hops[senders[n]] = level;
  rows.clear(), row_of.assign(nall, -1);
  for (int i = 0; i < nall; i++)
    if (hops[i] <= layers) row_of[i] = static_cast<int>(rows.size()), rows.push_back(i);
  size_t kept = 0;
  for (size_t n = 0; n < senders.size(); n++)
    if (std::min(hops[senders[n]], hops[receivers[n]]) <= layers - 1)
      senders[kept] = row_of[senders[n]], receivers[kept] = row_of[receivers[n]], kept++;
  senders.resize(kept), receivers.resize(kept);
}

void PairDdpad::compute(int eflag, int vflag)
{
  ev_init(eflag, vflag);
  collect();
  double **x = atom->x, **f = atom->f;
  int *type = atom->type;
  int nlocal = atom->nlocal;
  int natoms = static_cast<int>(rows.size()), nedges = static_cast<int>(senders.size());
  Rung &rung = rung_for(natoms, nedges);
  try {
    if (!rung.loader)
      rung.loader = std::make_unique<torch::inductor::AOTIModelPackageLoader>(rung.path, "model", false, 1, -1);
    auto positions = torch::zeros({rung.atoms, 3}, torch::kFloat64);
    auto kinds = torch::zeros({rung.atoms}, torch::kInt64);
    auto pairs = torch::zeros({2, rung.edges}, torch::kInt64);
    auto p = positions.accessor<double, 2>();
    auto k = kinds.accessor<int64_t, 1>();
    auto e = pairs.accessor<int64_t, 2>();
    for (int r = 0; r < natoms; r++) {
      int i = rows[r];
      p[r][0] = x[i][0], p[r][1] = x[i][1], p[r][2] = x[i][2];
      k[r] = species[type[i]];
    }
    for (int n = 0; n < nedges; n++) e[0][n] = senders[n], e[1][n] = receivers[n];
    auto counts = torch::tensor({(int64_t) natoms, (int64_t) nedges, (int64_t) nlocal}, torch::kInt64);
    auto out = rung.loader->run({positions, kinds, pairs, counts});  // (float64: the package casts)
    auto forces = out[1].to(torch::kFloat64).contiguous();
    auto fa = forces.accessor<double, 2>();
    for (int r = 0; r < natoms; r++) {
      int i = rows[r];
      f[i][0] += fa[r][0], f[i][1] += fa[r][1], f[i][2] += fa[r][2];
    }
    if (eflag_global) eng_vdwl += out[0].to(torch::kFloat64).item<double>();
    if (eflag_atom) {
      auto energies = out[2].to(torch::kFloat64).contiguous();
      auto ea = energies.accessor<double, 1>();
      for (int i = 0; i < nlocal; i++) eatom[i] += ea[i];  // (owned atoms are the first rows)
    }
    if (vflag_atom) {  // local and ghost rows: compute stress/atom sums ghosts to owners (newton on)
      auto virials = out[3].to(torch::kFloat64).contiguous();
      auto va = virials.accessor<double, 2>();
      for (int r = 0; r < natoms; r++)
        for (int c = 0; c < 6; c++) vatom[rows[r]][c] += va[r][c];
    }
  } catch (const std::exception &exc) {
    error->one(FLERR, "pair_style ddpad: running {} at step {} failed: {}", rung.path, update->ntimestep,
               exc.what());
  }
  if (vflag_fdotr) virial_fdotr_compute();
}

}    // namespace LAMMPS_NS

// The plugin ABI LAMMPS's `plugin load` calls (docs.lammps.org/Developer_plugins.html):
// a record per style handed to the register function it passes in. LAMMPS
// loads ddpadplugin.so (loader.cpp), which opens this library with
// RTLD_DEEPBIND and calls ddpad_lammpsplugin_init.
extern "C" {
typedef void *(ddpad_plugin_factory)(void *);
typedef struct {
  const char *version;
  const char *style;
  const char *name;
  const char *info;
  const char *author;
  union {
    ddpad_plugin_factory *v1;
    void *v2;
  } creator;
  void *handle;
} ddpad_plugin_record;
typedef void (*ddpad_plugin_register)(ddpad_plugin_record *, void *);

static void *ddpad_pair_creator(void *lmp)
{
  return new LAMMPS_NS::PairDdpad(static_cast<LAMMPS_NS::LAMMPS *>(lmp));
}

void ddpad_lammpsplugin_init(void *lmp, void *handle, void *regfunc)
{
  ddpad_plugin_record plugin;
  plugin.version = DDPAD_LAMMPS_VERSION;
  plugin.style = "pair";
  plugin.name = "ddpad";
  plugin.info = "ddpad: a padded, ahead-of-time compiled MLIP package (ddpad precompile --lammps)";
  plugin.author = "ddpad";
  plugin.creator.v1 = &ddpad_pair_creator;
  plugin.handle = handle;
  (*reinterpret_cast<ddpad_plugin_register>(regfunc))(&plugin, lmp);
}
}
