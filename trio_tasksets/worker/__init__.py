"""The worker side: the seam a worker consumes (`TaskQueue`, its entries and answers) and
the worker loop over any queue (`consume`).

An eval chooses where its slots run through one `SlotBackend`; a worker chooses what it
consumes through one `TaskQueue`. `trio_tasksets.redis.RedisTaskQueue` is Redis's,
`trio_tasksets.testing.MemoryTaskQueue` one in memory, and `tests/test_queues.py` is the
conformance suite every queue must pass. `trio-tasksets worker` is `consume` over Redis.
"""

from .._core.exceptions import EntryRefused, MalformedEntry
from ._consumer import WorkerReport, consume, run_by, run_group_by
from ._queue import Finished, TaskEntry, TaskQueue, plain_task

__all__ = [
    "EntryRefused",
    "Finished",
    "MalformedEntry",
    "TaskEntry",
    "TaskQueue",
    "WorkerReport",
    "consume",
    "plain_task",
    "run_by",
    "run_group_by",
]
