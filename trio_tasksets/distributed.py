"""Moved: the worker is `trio_tasksets.redis._worker`, its command `trio_tasksets._cli.worker`.

`python -m trio_tasksets.distributed worker|enqueue ...` still works (same as `trio-tasksets`).
"""

import sys

from ._cli.main import main

if __name__ == "__main__":
    sys.exit(main())
