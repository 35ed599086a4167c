"""Moved: the worker is `trio_tasksets.redis.worker`, its command `trio_tasksets.cli.worker`.

`python -m trio_tasksets.distributed worker|enqueue ...` still works (same as `trio-tasksets`).
"""

import sys

from .cli.main import main

if __name__ == "__main__":
    sys.exit(main())
