"""The version of ddpad and the install line its hints print (a module of its
own: the bottom of the import order)."""

__version__ = "0.1.0"

#: the torch every install line names: a model package's own torch
#: requirement can otherwise pull another release (or a CUDA wheel)
TORCH_PIN = "torch==2.13.0"


def install_command(extras: str) -> str:
    """The one install line ddpad's hints print: ``pip install torch==2.13.0
    -e '.[EXTRAS]'``, run in a clone of ddpad's repository (ddpad is not on
    the package index; the README installs it so)."""
    return f"pip install {TORCH_PIN} -e '.[{extras}]'"
