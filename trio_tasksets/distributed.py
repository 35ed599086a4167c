"""Moved: the worker is the command `trio-tasksets worker` (the Redis feed: `trio_tasksets.redis`).

`python -m trio_tasksets.distributed worker|enqueue ...` still works (same as `trio-tasksets`).
"""

import sys

from ._cli.main import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
