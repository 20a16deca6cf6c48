"""A plugin whose import fails: listing must survive it, get() must report it."""

raise ImportError("ddpad_toy_plugin.broken is broken on purpose")
