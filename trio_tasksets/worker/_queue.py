"""The worker side's seam: a `TaskQueue`, what the worker loop (`trio_tasksets.worker`)
consumes.

An eval chooses where its slots run through one `SlotBackend`; a worker chooses what it
consumes through one `TaskQueue`. The loop (`consume`) owns everything that is the same
for every feed: the window, rebuilding each task for the user's env (refusing an entry
declared for another one), running a slot or a group, deadlines, publishing in batches,
keep-alive, draining on signals or a time limit, the dashboard and the metrics. A queue
owns only its transport: how an entry is claimed, answered and kept. So a second feed
backend beside Redis (`trio_tasksets.redis.RedisTaskQueue`) is one new package that
implements this protocol; `trio_tasksets.testing.MemoryTaskQueue` is one in memory, and
`tests/test_queues.py` is the conformance suite every queue must pass.

The guarantees a queue gives (the loop relies on each):

* **Claims only when asked.** `claims(build, room=room)` is an async iterator: each
  `__anext__` claims (at most `max(1, room())` entries, one read) only then, and never
  more; every entry claimed is yielded (after `stop()` too: none stranded). `room()` says
  how many more entries the worker's window takes now, so a window that frees several
  places at once costs one read.
* **Each claimed entry is handed to `build` once.** What `build` returns is yielded. If
  `build` raises `MalformedEntry` (`EntryRefused`: declared for another env), the queue
  acknowledges the entry without running it and records the reason where its producer
  reads it; an entry that holds no task at all is treated the same way and never yielded.
* **Answer and acknowledgement together.** `publish(batch)` records each `Finished`'s rows
  and acknowledges its entry atomically (never an acknowledged entry without its result),
  and returns once that is durable; it retries what is transient, so an episode is held,
  never dropped. Cancelled, it leaves the entries unacknowledged.
* **At least once.** An entry claimed and not acknowledged (its worker crashed, was killed
  or cancelled past its grace) is delivered again, to this consumer when it restarts under
  the same name or to another one once the queue considers the entry abandoned; the loop
  calls `keep_alive(held)` every `keep_alive_every` seconds so that a long episode's entry
  is not taken for abandoned.
* **A graceful stop.** `stop()` (sync, idempotent) ends `claims` at its next pull: no new
  read starts, a read in progress ends soon and what it claimed is still yielded.
  `close()`, awaited once the loop is done, releases what the queue holds (it may leave a
  consumer group); the loop bounds it in time.

An entry may carry a `deadline` (epoch seconds): the loop runs it under the time left and
answers one taken after it as a failed episode (`DeadlineExceededError`) without running
it. An entry may be a **group** (`group` set, `rollouts` > 1: a task's rollouts as one unit): the loop runs its
rollouts together on this worker (`trio_tasksets._env.groups.run_group`) and publishes all
their rows in one `Finished`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any, Protocol, TypeVar, runtime_checkable

import attrs

from .._core.exceptions import ConfigError, MalformedEntry
from .._core.tasksets import Task, Taskset
from .._env.env import Episode
from .._env.groups import Advantage, check_advantage
from .._env.spec import rebuild_task

__all__ = ["Finished", "TaskEntry", "TaskQueue", "plain_task"]

T = TypeVar("T")


def _positive(instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        name = attribute.name
        raise ConfigError(f"{{{name}}} must be an int >= 1, got {value!r}", parameter=name)


def _advantage(instance: object, attribute: attrs.Attribute[str], value: object) -> None:
    check_advantage(value, attribute.name)


def _rollout(instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        name = attribute.name
        raise ConfigError(f"{{{name}}} must be an int >= 0, got {value!r}", parameter=name)


@attrs.frozen
class TaskEntry:
    """One claimed entry, decoded: what the loop runs.

    `handle` is the queue's own (what it acknowledges: a Redis entry and its reply-to
    stream); the loop never looks inside it. `id` names the entry among those held (log
    lines, keep-alive). `key` and `data` are the task's (rebuilt by the env's taskset class,
    `task_from_data` or `tt.Task`); `rollout` the slot's rollout. A group entry (`group`, the
    id its rows share) runs `rollouts` rollouts, `rollout` .. `rollout + rollouts - 1`, as
    one group, its advantages computed as `advantage` says when the env has no
    `score_group` of its own (``"mean"``, ``"std"``, ``"none"``; another value raises a
    `ConfigError` naming ``advantage``). `declared` is the producer's `Declaration` as
    written (None: none), and `deadline` its deadline in epoch seconds (None: none).
    """

    handle: Any = attrs.field(eq=False, repr=False)
    id: str
    key: str
    data: dict[str, Any]
    rollout: int = attrs.field(default=0, validator=_rollout)
    rollouts: int = attrs.field(default=1, validator=_positive)
    group: str | None = None
    declared: str | None = None
    deadline: float | None = None
    advantage: Advantage = attrs.field(default="mean", validator=_advantage)


@attrs.frozen
class Finished:
    """An entry's answer: its episodes (one, or a group's, in rollout order), to publish
    and acknowledge together, and extra fields the worker adds (`consumer`, `in_flight`)."""

    entry: TaskEntry
    episodes: Sequence[Episode]
    meta: Mapping[str, str | int | float] = attrs.field(factory=dict)


@runtime_checkable
class TaskQueue(Protocol):
    """What a worker consumes (see the module docstring for the guarantees).

    `consumer` is this worker's name in the queue (on every row it publishes, as `worker`);
    `keep_alive_every` the seconds between two `keep_alive` calls (`math.inf`: none needed).
    """

    @property
    def consumer(self) -> str: ...

    @property
    def keep_alive_every(self) -> float: ...

    @property
    def stopping(self) -> bool: ...

    def describe(self) -> str:
        """What it consumes, for the worker's first log line."""
        ...

    def claims(
        self, build: Callable[[TaskEntry], T], *, room: Callable[[], int]
    ) -> AsyncIterator[T]: ...

    async def publish(self, batch: Sequence[Finished]) -> None: ...

    async def keep_alive(self, held: Sequence[TaskEntry]) -> None: ...

    def stop(self) -> None: ...

    async def close(self) -> None: ...


def plain_task(entry: TaskEntry) -> Task:
    """The `tt.Task` an entry holds, rebuilt by the one task decoder (`rebuild_task`, as
    a served request's and an env's tasks are); raises `MalformedEntry` unless its data is
    tt.Task-shaped."""
    try:
        task: Task = rebuild_task(Taskset, entry.key, entry.data)
    except (TypeError, ValueError) as exc:
        raise MalformedEntry(f"entry {entry.id}: {exc}") from None
    return task
