"""The version of ddpad (a module of its own: the bottom of the import order)."""

__version__ = "0.1.0"
