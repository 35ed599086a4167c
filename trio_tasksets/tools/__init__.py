"""Tools a model may call: `tt.tool` (a typed function becomes a `tt.Tool`) and the tools
the project ships (`shell`: a command in a sandbox, the current one or a `local` box per
call, nothing it starts outliving it; `read_file`, `write_file`, `list_dir`: files of the
rollout's sandbox, `tt.current_sandbox()`). `tt.ToolEnv` runs them; docs/agents.md shows
them together.

Rooms (private): `_schema` (`Tool`, `tool`, `ToolArgumentError`), `_shell`, `_files`.
"""

from ._files import list_dir, read_file, write_file
from ._schema import Tool, ToolArgumentError, tool
from ._shell import shell

__all__ = ["Tool", "ToolArgumentError", "list_dir", "read_file", "shell", "tool", "write_file"]
