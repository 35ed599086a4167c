"""The eval as a coordinator over Redis workers (`--via URL [--stream S]`).

`ViaBackend(url, stream="tasks")` is the eval's `SlotBackend` for it
(``EvalConfig(backend=ViaBackend(url, stream=S))``); `via_runner` is what it opens.

Each slot the eval's window lets run becomes one entry of the task stream (the task, its
rollout, the eval's `Declaration`, and a reply-to stream of this session's own); the slot
completes when a worker's result for that entry comes back on the reply-to stream. So the
eval's `-c` spans every worker: at most `-c` entries of this session are in the task stream
at any moment, since the enqueue that takes a freed place first deletes the answered ones.

* One row per slot: a slot completes on the first result for any of its entries; a second
  result (an entry reclaimed after a Redis outage longer than the workers' `--claim-idle`,
  or a slot re-enqueued after Redis lost its data) is counted and dropped.
* Redis restarted without its data (its `run_id` changed and this session's entries are
  gone): the slots still waiting are enqueued again.
* No worker answering: after `QUIET` seconds without a result, the dashboard (and the log)
  says why (no consumer group reads the stream, or none took a slot), and the eval waits.
* A worker that refuses a slot (another taskset, env, model or sampling) ends the eval with
  `ViaError` and the worker's reason.
* A group (``--group``: a task's rollouts) is one entry (the task, `group`: its id, `rollouts`: its
  size), run by one worker as a group and scored there (`score_group`); its answer is one
  result entry holding every row (`rows`), so the group comes back as a unit. While it is
  out, each of its rollouts holds a place of the eval's window (`fan_out`), so `-c` counts
  live rollouts across all workers.
* On the way out (done, Ctrl-C, an error) the session deletes its unanswered entries from
  the task stream, so no worker picks them up later, says how many a worker had already
  taken (their results go to the reply-to stream, which expires), and deletes the reply-to
  stream when nothing more can arrive on it.

Slots are enqueued in batches (one pipelined round trip for whatever is ready, which first
deletes the entries answered since the last one) and results read in batches
(`XREAD COUNT 1000 BLOCK`): two round trips per batch of slots.
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Iterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

import attrs
import orjson
import trio

from .._core.batching import take_ready
from .._core.exceptions import ConfigError, EvalConfigError, TrioTasksetsError
from .._core.runner import fan_out
from .._core.window import Window, prioritized
from .._env.backend import GroupRunner, SlotRunner, Track
from .._env.env import Env, Episode, OnComplete, RunSlot, complete_slot
from .._env.groups import Group
from .._models import ModelContext
from .._monitor import dashboard
from ._entries import (
    ADVANTAGE_FIELD,
    DEADLINE_FIELD,
    ENV_FIELD,
    GROUP_FIELD,
    REFUSED_FIELD,
    REPLY_FIELD,
    ROLLOUT_FIELD,
    ROLLOUTS_FIELD,
    ROWS_FIELD,
    TASK_FIELD,
    Declaration,
    Log,
    check_url,
    deadline_field,
    encode_task,
    redact,
    stderr_log,
)
from ._link import Link, loading, server_run_id, unusable
from ._resp import Command, Connection, RedisError, ReplyError, first_stream, run_id

__all__ = ["QUIET", "ViaBackend", "ViaError", "reach", "via_runner"]

QUIET = 10.0
"""Seconds without a result (slots waiting) before the dashboard says why."""
_WATCH_EVERY = 2.0  # seconds between checks of Redis (restart, workers, the reply TTL)
_BLOCK = 0.5  # the longest one read of the reply stream waits
_BATCH = 1000  # most entries per XADD pipeline or XREAD
_COALESCE = 0.001  # seconds between two reads of answers: a slot waits 0.5 ms more, on average
_REPLY_TTL_MS = 600_000  # the reply stream outlives a killed coordinator by 10 minutes
_CLEANUP_WITHIN = 5.0  # seconds the way out spends deleting what this session left
_LOG_EVERY = 60.0  # seconds between log lines repeating why no result comes


class ViaError(TrioTasksetsError, RuntimeError):
    """A slot a worker refused (its reason says what differs and how to fix it)."""


def _id(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


async def reach(url: str) -> str:
    """Redis's `run_id` at `url`; `EvalConfigError` naming ``via`` if it cannot be reached."""
    _check_via(None, None, url)
    try:
        return await server_run_id(url)
    except RedisError as exc:
        message, fix = unusable("{via}", url, exc)
        raise EvalConfigError(f"{message}; {fix}", parameter="via") from None


def _check_via(instance: object, attribute: attrs.Attribute[str] | None, value: str) -> None:
    try:
        check_url(value)  # a non-str is refused too, and said to be no Redis URL
    except ValueError as exc:
        raise EvalConfigError(f"{{via}}: {exc}", parameter="via") from None


def _check_stream(instance: object, attribute: attrs.Attribute[str], value: str) -> None:
    if not isinstance(value, str) or not value:
        raise EvalConfigError(
            f"{{stream}} must name a stream, e.g. tasks, got {value!r}", parameter="stream"
        )


@attrs.frozen
class ViaBackend:
    """Each slot as one entry of the Redis stream `stream` at `url`, run by whichever
    worker takes it (see the module docstring); the eval's window spans every worker.

    `reach` connects before any file is written (`EvalConfigError` naming ``via`` if Redis
    cannot be reached or refuses the login) and returns the backend with Redis's `run_id`,
    by which the coordinator notices a restart that lost its data.

    Built, it is valid: a `url` that is no Redis URL, or an empty `stream`, raises
    `EvalConfigError` naming ``via`` or ``stream``. The workers run the slots with their own
    env and model client: only the model's name and sampling go with each entry.
    """

    url: str = attrs.field(validator=_check_via)
    stream: str = attrs.field(default="tasks", validator=_check_stream)
    run_id: str | None = None
    quiet: float = QUIET
    watch_every: float = _WATCH_EVERY
    log: Log | None = attrs.field(default=None, eq=False, repr=False)

    @property
    def remote(self) -> bool:
        return True

    @property
    def settings(self) -> dict[str, object]:
        """What config.json records."""
        return {"via": self.url, "stream": self.stream}

    @property
    def parameter(self) -> str:
        return "via"

    @property
    def uses_env(self) -> bool:
        return False  # the workers', loaded from their own TASKSET

    @property
    def uses_client(self) -> bool:
        return False  # the workers call the model with their own endpoint and key

    def check(self, env: Env[Any], ctx: ModelContext) -> None:
        pass

    async def reach(self) -> ViaBackend:
        return attrs.evolve(self, run_id=await reach(self.url))

    def open(
        self, env: Env[Any], ctx: ModelContext, *, window: Window, progress: dashboard.Progress
    ) -> AbstractAsyncContextManager[SlotRunner]:
        return via_runner(
            env, ctx, url=self.url, stream=self.stream, progress=progress, run_id=self.run_id,
            log=self.log, quiet=self.quiet, watch_every=self.watch_every,
        )  # fmt: skip


async def _add(
    stream: str, answered: list[str], rows: list[dict[str, str]], redis: Connection, _attempt: int
) -> list[Any]:
    """Delete the answered entries, then add the new ones: in this order on the server, so
    the stream never holds more of this session's entries than its window."""
    commands: list[Command] = [("XDEL", stream, *answered)] if answered else []
    for fields in rows:
        commands.append(("XADD", stream, "*", *(part for pair in fields.items() for part in pair)))
    replies = await redis.pipeline(commands)
    return replies[1:] if answered else replies


async def _check(
    stream: str, reply: str, answered: list[str], redis: Connection, _attempt: int
) -> str:
    """Redis's run id; keep the reply stream alive; delete the answered entries."""
    commands: list[Command] = [("INFO", "server"), ("PEXPIRE", reply, _REPLY_TTL_MS)]
    if answered:
        commands.append(("XDEL", stream, *answered))
    replies = await redis.pipeline(commands)
    return run_id(replies[0], redis.address)


async def _groups(redis: Connection, stream: str) -> list[dict[str, Any]]:
    """The consumer groups of `stream` (none if it does not exist)."""
    try:
        groups = await redis.execute("XINFO", "GROUPS", stream)
    except ReplyError as exc:  # no such key; a LOADING Redis is retried by the Link
        if loading(exc):
            raise
        return []
    return [dict(zip(flat[::2], flat[1::2], strict=True)) for flat in groups]


async def _held(redis: Connection, stream: str, ids: list[str]) -> set[str]:
    """Those of `ids` pending in a group of `stream`: taken by a worker, not yet answered."""
    first, last = min(ids, key=_id), max(ids, key=_id)
    held: set[str] = set()
    for group in await _groups(redis, stream):
        rows = await redis.execute("XPENDING", stream, str(group["name"]), first, last, len(ids))
        held.update(str(row[0]) for row in rows)
    return held & set(ids)


async def _read(reply: str, last: str, redis: Connection, _attempt: int) -> Any:
    return first_stream(
        await redis.execute(
            "XREAD", "COUNT", _BATCH, "BLOCK", int(_BLOCK * 1000), "STREAMS", reply, last
        )
    )


@attrs.define(eq=False)
class _Slot:
    """A slot (or a group) on its way through the stream: its entry fields, the ids it was
    enqueued as (more than one after a re-enqueue), and its answer."""

    fields: dict[str, str]
    entries: list[str] = attrs.Factory(list)
    done: trio.Event = attrs.Factory(trio.Event)
    answer: dict[str, str] | None = None
    sent: bool = False


def _accepted(waiting: _Slot) -> dict[str, str]:
    """The answer of `waiting`; `ViaError` if the worker refused it."""
    answer = waiting.answer
    assert answer is not None
    if REFUSED_FIELD in answer:
        raise ViaError(
            f"worker {answer.get('consumer', '?')} refused a slot of this eval "
            f"(task {answer.get('key')!r}): {answer[REFUSED_FIELD]}"
        )
    return answer


def _group_rows(answer: dict[str, str], group: Group) -> list[Episode]:
    """A group's episodes from its answer, in slot order; `ViaError` if the answer is not
    the whole group (a worker that runs no groups answers one row)."""
    worker = answer.get("consumer", "?")
    raw = answer.get(ROWS_FIELD)
    if raw is None:
        raise ViaError(
            f"worker {worker} answered group {group.id} (task {answer.get('key')!r}) with one "
            f"row: it runs no groups; upgrade trio-tasksets on the workers"
        )
    episodes = [Episode.from_row(row) for row in orjson.loads(raw)]
    want = [slot.rollout for slot in group.slots]
    if sorted(e.rollout for e in episodes) != want:
        raise ViaError(
            f"worker {worker} answered group {group.id} with rollouts "
            f"{[e.rollout for e in episodes]}, not {want}"
        )
    return sorted(episodes, key=lambda e: e.rollout)


class _Coordinator:
    def __init__(
        self,
        env: Env[Any],
        ctx: ModelContext,
        url: str,
        stream: str,
        run_id: str,
        progress: dashboard.Progress,
        log: Log,
        quiet: float = QUIET,
        watch_every: float = _WATCH_EVERY,
    ) -> None:
        self.stream = stream
        # The same {hash tag} as the task stream (a suffix keeps it): one Redis Cluster slot.
        self.reply = f"{stream}:reply:{uuid.uuid4().hex[:12]}"
        self.url = url
        self._link = Link(url, read_timeout=_BLOCK + 10.0, log=log)
        self._declared = Declaration.of(env, ctx).to_json()
        self._any_data = getattr(type(env.taskset), "task_from_data", None) is not None
        self._progress = progress
        self._log = log
        self._run_id = run_id
        self._queue_in, self._queue = trio.open_memory_channel[_Slot](math.inf)
        self._waiting: dict[str, _Slot] = {}  # entry id -> its slot, until answered
        self._early: dict[str, dict[str, str]] = {}  # answers of ids not (yet) registered
        self._undeleted: list[str] = []  # answered entries not yet deleted from the stream
        self._last_answer = time.monotonic()
        self._quiet = quiet
        self._watch_every = watch_every
        self._why: str | None = None  # the reason last logged for no result coming
        self._logged_at = -math.inf
        self.reenqueued = 0

    # --- one slot, one group -------------------------------------------------------------

    def _fields(self, slot: RunSlot[Any]) -> dict[str, str]:
        fields = {
            TASK_FIELD: encode_task(slot.task, any_data=self._any_data).decode(),
            ROLLOUT_FIELD: str(slot.rollout),
            REPLY_FIELD: self.reply,
            ENV_FIELD: self._declared,
        }
        deadline = deadline_field()  # the deadline travels: the worker runs it in the time left
        if deadline is not None:
            fields[DEADLINE_FIELD] = deadline
        return fields

    async def run(
        self,
        slot: RunSlot[Any],
        *,
        on_complete: OnComplete | None = None,
    ) -> Episode:
        waiting = _Slot(self._fields(slot))
        self._queue_in.send_nowait(waiting)
        await waiting.done.wait()
        answer = _accepted(waiting)
        if ROWS_FIELD in answer:
            raise ViaError(f"a worker answered the slot of task {answer.get('key')!r} as a group")
        episode = Episode.from_row(orjson.loads(answer["row"]))
        return await complete_slot(slot, episode, on_complete)

    async def run_group(self, group: Group, track: Track) -> list[Episode]:
        """`group` as one entry, run by one worker (see `GroupRunner`)."""
        slots = group.slots
        first = slots[0].rollout
        if [slot.rollout for slot in slots] != list(range(first, first + len(slots))):
            raise ConfigError(
                f"{{group}} {group.id}: its rollouts must be consecutive", parameter="group"
            )
        fields = self._fields(slots[0])
        fields[GROUP_FIELD] = group.id
        fields[ROLLOUTS_FIELD] = str(len(slots))
        fields[ADVANTAGE_FIELD] = group.advantage  # the worker computes what the eval asked
        waiting = _Slot(fields)
        opened = group.opened
        answered: list[Episode] = []

        async def share(index: int) -> Episode:
            if opened is not None:
                opened.started(group)
            if not waiting.sent:  # the first rollout to hold a place enqueues the group
                waiting.sent = True
                self._queue_in.send_nowait(waiting)
            await waiting.done.wait()
            if not answered:
                answered.extend(_group_rows(_accepted(waiting), group))
            return await complete_slot(slots[index], answered[index], None)

        thunks = [
            functools.partial(track, slot, functools.partial(share, index))
            for index, slot in enumerate(slots)
        ]
        try:
            with prioritized():  # the group's waiting places before a new pull
                await fan_out(thunks)
        finally:
            if opened is not None:
                opened.closed(group)
        return answered

    def __call__(
        self,
        slot: RunSlot[Any],
        *,
        on_complete: OnComplete | None = None,
    ) -> Awaitable[Episode]:
        return self.run(slot, on_complete=on_complete)

    # --- the loops ------------------------------------------------------------------------

    async def send_loop(self) -> None:
        """Enqueue what is ready, one pipelined round trip per batch."""
        async for first in self._queue:
            batch = take_ready(self._queue, first, _BATCH)
            with self._answered() as answered:
                add = functools.partial(_add, self.stream, answered, [s.fields for s in batch])
                # Not abandoned on cancellation: the ids it added must be known, to delete them.
                what = f"enqueuing slots to {self.stream}"
                ids = await self._link.call(what, add, abandon=False)
            for slot, entry_id in zip(batch, ids, strict=True):
                self._register(slot, str(entry_id))

    @contextlib.contextmanager
    def _answered(self) -> Iterator[list[str]]:
        """The answered entries not yet deleted, taken for one call that deletes them (given
        back if it does not complete)."""
        answered, self._undeleted = self._undeleted, []
        try:
            yield answered
        except BaseException:
            self._undeleted[:0] = answered
            raise

    def _register(self, slot: _Slot, entry_id: str) -> None:
        slot.entries.append(entry_id)
        if slot.answer is not None:  # answered through an earlier entry meanwhile
            self._undeleted.append(entry_id)
            return
        answer = self._early.pop(entry_id, None)
        if answer is None:
            self._waiting[entry_id] = slot
            return
        self._take(slot, answer)  # answered before its enqueue returned: rare
        slot.done.set()

    def _take(self, slot: _Slot, answer: dict[str, str]) -> None:
        """`answer` is the slot's: its other entries (enqueued again after a Redis restart)
        are no longer needed."""
        slot.answer = answer
        for entry_id in slot.entries:
            if self._waiting.pop(entry_id, None) is not None:
                self._undeleted.append(entry_id)

    async def read_loop(self) -> None:
        """Read the reply stream and complete the slots answered. Their entries are deleted
        from the task stream by the next enqueue (before what it adds), the watch or the
        way out, whichever comes first."""
        last = "0-0"
        stream = self.stream
        while True:
            read = functools.partial(_read, self.reply, last)
            got = await self._link.call("reading results", read)
            if not got:
                continue
            if len(got) < _BATCH:
                # Let a few more answers come before the next read: results trickle in one by
                # one, and a round trip per batch costs less than one per answer.
                await trio.sleep(_COALESCE)
            last = got[-1][0]
            answered: list[_Slot] = []
            for _id, fields in got:
                if fields is None:
                    continue
                entry_id = fields.get("entry")
                if entry_id is None or fields.get("stream") != stream:
                    continue  # not an answer to an entry of the task stream
                self._undeleted.append(entry_id)
                slot = self._waiting.pop(entry_id, None)
                if slot is None:  # not registered yet, or answered already (a duplicate)
                    self._early[entry_id] = fields
                    continue
                self._take(slot, fields)
                answered.append(slot)
            for slot in answered:
                slot.done.set()
            if answered:
                self._last_answer = time.monotonic()
                self._progress.note = None

    async def watch_loop(self) -> None:
        """Every few seconds: keep the reply stream's TTL, notice a Redis that lost its data
        (and enqueue the lost slots again), and say why no result comes."""
        reply = self.reply
        while True:
            await trio.sleep(self._watch_every)

            with self._answered() as answered:  # those no enqueue took along
                check = functools.partial(_check, self.stream, reply, answered)
                run_id = await self._link.call("watching Redis", check)
            if run_id != self._run_id:
                self._run_id = run_id
                await self._recover()
            quiet = time.monotonic() - self._last_answer
            if self._waiting and quiet >= self._quiet:
                why = await self._why_quiet()
                waiting = len({id(s) for s in self._waiting.values()})
                note = f"no result for {quiet:.0f} s, {waiting} slots waiting: {why}"
                if why != self._why or time.monotonic() >= self._logged_at + _LOG_EVERY:
                    self._log(note)  # when the reason changes, and once a minute
                    self._why, self._logged_at = why, time.monotonic()
                self._progress.note = note
            else:
                self._why = None

    async def _recover(self) -> None:
        """Redis restarted: enqueue again the waiting slots whose entries it lost."""
        slots = {id(s): s for s in self._waiting.values()}.values()
        latest = [(slot, slot.entries[-1]) for slot in slots]
        stream = self.stream

        async def exists(redis: Connection, _attempt: int) -> list[bool]:
            commands = [
                ("XRANGE", stream, entry_id, entry_id, "COUNT", 1) for _, entry_id in latest
            ]
            return [bool(found) for found in await redis.pipeline(commands)]

        present = await self._link.call("checking entries after a Redis restart", exists)
        lost = [slot for (slot, _), here in zip(latest, present, strict=True) if not here]
        if lost:
            self._log(
                f"redis at {redact(self.url)} restarted without {len(lost)} waiting entries of "
                f"this eval: enqueued them again"
            )
            self.reenqueued += len(lost)
            for slot in lost:
                self._queue_in.send_nowait(slot)

    async def _why_quiet(self) -> str:
        stream = self.stream
        oldest = min(self._waiting, key=_id)

        async def look(redis: Connection, _attempt: int) -> tuple[list[dict[str, Any]], bool]:
            return await _groups(redis, stream), bool(await _held(redis, stream, [oldest]))

        groups, held = await self._link.call("looking for workers", look)
        if not groups:
            return (
                f"no worker reads {stream} (no consumer group); start one on this Redis, "
                f"reading stream {stream}"
            )
        consumers = sum(int(g.get("consumers", 0)) for g in groups)
        where = f"{consumers} consumers in {len(groups)} group(s) of {stream}"
        if held:
            return f"workers hold them ({where})"
        if all(_id(oldest) <= _id(str(g.get("last-delivered-id", "0-0"))) for g in groups):
            return (
                f"every group of {stream} starts after these entries ({where}), so no worker "
                f"will take them: create the group from the start (XGROUP CREATE ... 0)"
            )
        return f"no worker took one ({where}, none pulling: stopped, or busy with other work)"

    # --- the way out ----------------------------------------------------------------------

    async def close(self) -> None:
        """Delete this session's unanswered entries (no worker picks them up later), say
        what a worker had taken already, and delete the reply stream if nothing can come."""
        unanswered = sorted(self._waiting, key=_id)
        stream, reply = self.stream, self.reply
        answered = list(self._undeleted)

        async def clean(redis: Connection, _attempt: int) -> int:
            running = len(await _held(redis, stream, unanswered)) if unanswered else 0
            commands: list[Command] = []
            if unanswered or answered:
                commands.append(("XDEL", stream, *unanswered, *answered))
            if running:
                commands.append(("PEXPIRE", reply, _REPLY_TTL_MS))
            else:
                commands.append(("DEL", reply))
            await redis.pipeline(commands)
            return running

        try:
            with trio.move_on_after(_CLEANUP_WITHIN) as scope:
                running = await self._link.call("deleting this eval's entries", clean)
        finally:
            self._link.close()
        if scope.cancelled_caught:
            if unanswered:
                self._log(
                    f"redis at {redact(self.url)} unreachable: up to {len(unanswered)} "
                    f"unanswered slots of this eval may remain in {stream}"
                )
            return
        duplicates = len(self._early)  # answers to entries answered already
        if duplicates:
            self._log(f"dropped {duplicates} duplicate results (one row per slot)")
        if unanswered and not running:
            self._log(f"deleted {len(unanswered)} unanswered slots from {stream} (none taken)")
        elif unanswered:
            self._log(
                f"deleted {len(unanswered)} unanswered slots from {stream}, so no worker takes "
                f"them; {running} of them were running on workers, which finish them into "
                f"{reply} (nobody reads it; it expires in {_REPLY_TTL_MS // 60_000} min)"
            )


@asynccontextmanager
async def via_runner(
    env: Env[Any],
    ctx: ModelContext,
    *,
    url: str,
    stream: str,
    progress: dashboard.Progress,
    run_id: str | None = None,
    log: Log | None = None,
    quiet: float = QUIET,
    watch_every: float = _WATCH_EVERY,
) -> AsyncIterator[GroupRunner]:
    """What an eval runs each slot with over `--via`: one entry of `stream` per slot, its
    answer read from a reply stream of this session's own (see the module docstring).

    `run_id` is Redis's as `reach` found it (fetched now if None). Every `watch_every`
    seconds Redis is checked; after `quiet` seconds without a result `progress.note` (and
    the log, when the reason changes and once a minute) says why.
    """
    say = log if log is not None else stderr_log("eval over workers")
    if run_id is None:
        run_id = await reach(url)
    coordinator = _Coordinator(
        env, ctx, url, stream, run_id, progress, say, quiet=quiet, watch_every=watch_every
    )
    body_error: BaseException | None = None
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(coordinator.send_loop)
            nursery.start_soon(coordinator.read_loop)
            nursery.start_soon(coordinator.watch_loop)
            try:
                yield coordinator
            except BaseException as exc:
                body_error = exc  # re-raised below, bare (not in the nursery's group)
            finally:
                nursery.cancel_scope.cancel()
    finally:
        with trio.CancelScope(shield=True):
            await coordinator.close()
    if body_error is not None:
        try:
            raise body_error
        finally:
            body_error = None
