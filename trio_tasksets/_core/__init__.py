"""The core: the windowed runner and what it stands on, with no I/O beyond the source and
the runs. Its rooms, lowest first: `exceptions` (the tree's root) · `version`, `backoff`,
`window` · `adaptive` (the adaptive window and its controller), `runner`, `drain`,
`batching`, `limits`, `tasksets` · `sources`, `training`, `builtin`, `datasets`, `health`.
Every name users import is re-exported by `trio_tasksets`."""

__all__: list[str] = []  # its rooms are imported by module
