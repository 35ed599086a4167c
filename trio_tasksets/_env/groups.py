"""Groups: a task's rollouts as one unit of work, scored together.

`run_group(env, task, run_rollout, rollouts=r)` runs the `r` rollouts of one task in one
nursery and one cancel scope (a `fan_out`), so inside a windowed runner each live rollout
holds one place of the window (`-c` counts live rollouts) and the group's waiting rollouts
take freed places before the runner pulls a new task (`window.prioritized`, prefix-cache
friendly: an open group is finished before the next one opens). Once all of a group's
rollouts have started, the place its run holds (the runner's, which `fan_out` gives to the
group's rollouts one after the other) is lent to the window while the last ones finish, and
the last to end hands its place back (`fan_out`'s rule), so no place idles during a group's
tail. When every rollout is done,
`env.score_group(task, episodes)` runs once (it may set each episode's `reward` and
`advantage`); every episode gets the group's id (`Episode.group`).

An env without a `score_group` of its own (it keeps `Env.score_group`, which does nothing)
gets GRPO's advantage, as the group says (`Group.advantage`, `group_feed(advantage=)`,
`EvalConfig(advantage=)`, `--advantage`): `"mean"` (the default) sets each episode's
`advantage` to its reward minus the group's mean reward; `"std"` divides that by the
group's population standard deviation (`statistics.pstdev`), and a group whose rewards are
all equal (a standard deviation of 0) gets 0.0 everywhere; `"none"` leaves `advantage`
None. An env that defines `score_group` has full control: nothing is computed for it (a
`score_group` may call `group_advantages(episodes, how)` itself after changing rewards). A
failed group gets no advantage.

A rollout that still fails after its retries fails the group: the others are cancelled at
once (no straggler burns tokens) and awaited, and every episode of the group comes back
with `ok=False`: the failed one with its own errors, each other one with a
`GroupFailedError` naming the cause. A `score_group` that raises fails the group the same
way. Either way exactly one episode per rollout comes back: every dispatched rollout is
answered exactly once. An outside cancellation cancels the group and propagates (an
unfinished group leaves no episode: a resume re-runs it whole).
"""

from __future__ import annotations

import functools
import math
import operator
import statistics
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable
from typing import Any, Literal

import attrs
import trio

from .._core.exceptions import ConfigError, TrioTasksetsError
from .._core.runner import ResultRefused, SourceIterator, fan_out_placing
from .._core.window import Window, prioritized
from .._models.pool import sticky
from .env import (
    Env,
    Episode,
    EpisodeError,
    EpisodeTask,
    RunSlot,
    new_id,
    task_data,
    task_key,
    version_range,
)

__all__ = [
    "ADVANTAGES",
    "Advantage",
    "Group",
    "GroupFailedError",
    "OpenGroups",
    "cause_first",
    "check_advantage",
    "group_advantages",
    "group_feed",
    "group_slots",
    "run_group",
]

RunRollout = Callable[[RunSlot[Any]], Awaitable[Episode]]

Advantage = Literal["mean", "std", "none"]
"""How a group's advantages are computed when its env has no `score_group` of its own."""
ADVANTAGES: tuple[Advantage, ...] = ("mean", "std", "none")


def check_advantage(value: object, parameter: str = "advantage") -> Advantage:
    """`value` if it is one of `ADVANTAGES`; else a `ConfigError` naming `parameter`."""
    if value not in ADVANTAGES:
        raise ConfigError(
            f"{{{parameter}}} must be one of {', '.join(map(repr, ADVANTAGES))} (reward minus "
            f"the group mean; divided by the group's standard deviation; none), got {value!r}",
            parameter=parameter,
        )
    return value


def _advantage(group: Group, attribute: attrs.Attribute[Any], value: object) -> None:
    check_advantage(value, attribute.name)


def group_advantages(episodes: list[Episode], how: Advantage = "mean") -> None:
    """Set each episode's `advantage` from the group's rewards: `"mean"`, reward minus the
    group's mean (GRPO's); `"std"`, that divided by the group's population standard
    deviation (0.0 for every episode when the rewards are all equal); `"none"`: leave them
    as they are. Raises `ConfigError` naming `how` for another value."""
    check_advantage(how, "how")
    if how == "none" or not episodes:
        return
    rewards = [episode.reward for episode in episodes]
    if min(rewards) == max(rewards):  # no spread: exactly 0.0 (no rounding residue)
        for episode in episodes:
            episode.advantage = 0.0
        return
    mean = math.fsum(rewards) / len(rewards)
    scale = statistics.pstdev(rewards, mean) if how == "std" else 1.0
    for episode in episodes:
        episode.advantage = (episode.reward - mean) / scale


class GroupFailedError(TrioTasksetsError):
    """The type name on the rows of a failed group's other rollouts: the group failed
    because one rollout failed after its retries (or `score_group` raised)."""


@attrs.define(eq=False)
class Group:
    """The slots of one task's group, the group's id (shared by its rows), and how its
    advantages are computed when its env has no `score_group` of its own (`advantage`:
    ``"mean"``, ``"std"`` or ``"none"``; see the module docstring; another value raises a
    `ConfigError` naming ``advantage``)."""

    task: Any
    slots: list[RunSlot[Any]]
    id: str = attrs.Factory(new_id)  # 32 random hex digits
    opened: OpenGroups | None = None  # the runner's open groups, when it gates its pulls
    advantage: Advantage = attrs.field(default="mean", validator=_advantage, kw_only=True)


class OpenGroups:
    """The groups a runner has open and how many of their rollouts have no place yet:
    `gate(source)` pulls the next group only when the window's free places can take every
    open group's waiting rollouts and the next group's, so a freed place goes to an open
    group's waiting rollout before a new task is pulled, and several groups open in one step
    when they fit. Otherwise it waits until every open group's rollouts have a place, and the
    place the runner took for that pull is lent meanwhile (`Window.lend`), so the window
    stays full of live rollouts."""

    def __init__(self, window: Window | None) -> None:
        self.window = window
        self._unstarted: dict[Group, int] = {}
        self._waiting = 0  # the sum of _unstarted's counts
        self._changed = trio.lowlevel.ParkingLot()  # its waiters wake when a group closes

    def open(self, group: Group) -> None:
        group.opened = self
        self._unstarted[group] = len(group.slots)
        self._waiting += len(group.slots)

    def started(self, group: Group, count: int = 1) -> None:
        """`count` more of `group`'s rollouts have their places (they are about to run)."""
        left = self._unstarted.get(group)
        if left is not None:
            if left <= count:
                self.closed(group)
            else:
                self._unstarted[group] = left - count
                self._waiting -= count

    def closed(self, group: Group) -> None:
        left = self._unstarted.pop(group, None)
        if left is not None:
            self._waiting -= left
            if self._changed:
                self._changed.unpark_all()

    @property
    def waiting(self) -> int:
        """Rollouts of open groups with no place yet."""
        return self._waiting

    def _room(self, extra: int) -> bool:
        """Whether the free places take every open group's waiting rollouts and `extra` more
        (without a window nothing waits for a place)."""
        if self.window is None:
            return True
        limiter = self.window.limiter
        return self._waiting + extra <= limiter.total_tokens - limiter.borrowed_tokens

    async def _quiet(self) -> None:
        if self.window is None:
            await self._closed_all()
            return
        async with self.window.lend():
            await self._closed_all()

    async def _closed_all(self) -> None:
        while self._unstarted:
            await self._changed.park()

    def gate(self, source: AsyncIterable[Group]) -> AsyncIterator[Group]:
        """`source`'s groups, each pulled once no open group's rollout would wait for a place
        the new group takes: the group's rollouts beyond the first (which runs on the place
        the runner took for the pull) are expected to need as many places as the last one's.
        An iterator class, not a generator: closing it closes `source` exactly once, even
        before its first pull (`tt.first(0, ...)`, a cancel before the first pull)."""
        return _Gated(self, source)


class _Gated(SourceIterator[Group]):
    """What `OpenGroups.gate` returns."""

    def __init__(self, opened: OpenGroups, source: AsyncIterable[Group]) -> None:
        super().__init__(source)
        self._opened = opened
        self._expect = 0  # places the next group is expected to need beyond the pull's

    async def __anext__(self) -> Group:
        opened = self._opened
        if self._closed:
            raise StopAsyncIteration
        if opened._unstarted and not opened._room(self._expect):
            await opened._quiet()
        try:
            group = await self._iterator.__anext__()
        except StopAsyncIteration:
            await _close_shielded(self)
            raise
        self._expect = len(group.slots) - 1
        if opened._unstarted and not opened._room(self._expect):  # (larger than the last)
            await opened._quiet()
        opened.open(group)
        return group


async def _close_shielded(iterator: SourceIterator[Any]) -> None:
    """The source ended: close it at once (as a generator's `finally` would), shielded."""
    with trio.CancelScope(shield=True):
        await iterator.aclose()


def group_slots(slots: list[RunSlot[Any]], advantage: Advantage = "mean") -> list[Group]:
    """Planned slots as groups: each run of consecutive slots of one task (the same object,
    as `static_slots` plans a task's `-r` slots) is one group."""
    groups: list[Group] = []
    for slot in slots:
        if groups and groups[-1].task is slot.task:
            groups[-1].slots.append(slot)
        else:
            groups.append(Group(slot.task, [slot], advantage=advantage))
    return groups


def group_feed(
    tasks: AsyncIterable[Any],
    rollouts: int,
    window: Window | None,
    *,
    advantage: Advantage = "mean",
) -> AsyncIterator[Group]:
    """A feed of tasks as a feed of groups of `rollouts` slots each, for a runner over
    `window` (the same `tt.Window` the runner is given): the next task is pulled only once
    every open group's rollouts have started (`OpenGroups.gate`). Closing it closes `tasks`
    exactly once, on every path (even before its first pull).
    Run each group with `run_group`; an env without a `score_group` of its own gets each
    group's advantages as `advantage` says (``"mean"``: reward minus the group mean;
    ``"std"``: divided by the group's standard deviation; ``"none"``).

    Raises `ConfigError` naming `rollouts` unless it is an int >= 1, or `advantage` unless
    it is one of those three."""
    if isinstance(rollouts, bool) or not isinstance(rollouts, int) or rollouts < 1:
        raise ConfigError(
            f"{{rollouts}} must be an int >= 1, got {rollouts!r}", parameter="rollouts"
        )
    check_advantage(advantage)
    return OpenGroups(window).gate(_AsGroups(tasks, rollouts, advantage))


class _AsGroups(SourceIterator[Group]):
    """A feed of tasks as groups of `rollouts` slots each (an iterator class: closing it
    closes the tasks exactly once, even before its first pull)."""

    def __init__(self, tasks: AsyncIterable[Any], rollouts: int, advantage: Advantage) -> None:
        super().__init__(tasks)
        self._rollouts = rollouts
        self._advantage = advantage

    async def __anext__(self) -> Group:
        if self._closed:
            raise StopAsyncIteration
        try:
            task = await self._iterator.__anext__()
        except StopAsyncIteration:
            await _close_shielded(self)
            raise
        slots = [RunSlot(task, rollout) for rollout in range(self._rollouts)]
        return Group(task, slots, advantage=self._advantage)


def _cancelled(slot: RunSlot[Any], cause: str) -> Episode:
    task = slot.task
    return Episode(
        id=new_id(),
        task=EpisodeTask(key=task_key(task), data=task_data(task)),
        rollout=slot.rollout,
        errors=[EpisodeError(GroupFailedError.__name__, cause)],
    )


def _cause(episode: Episode) -> str:
    last = episode.errors[-1] if episode.errors else None
    what = f"{last.type}: {last.message}" if last is not None else "it was not ok"
    return (
        f"rollout {episode.rollout} of its group failed after {episode.attempts} attempt(s): {what}"
    )


_ok = operator.attrgetter("ok")  # a rollout not ok fails its group (no frame per rollout)
_errors = operator.attrgetter("errors")


async def run_group(env: Env[Any], group: Group, run_rollout: RunRollout) -> list[Episode]:
    """Run `group`'s rollouts (`run_rollout(slot)` each, e.g. `env.run_slot` with a model
    context) as one group; see the module docstring. Returns one episode per slot, in slot
    order, each with `group` set, and `advantage` as `group.advantage` says when `env` has
    no `score_group` of its own. `run_rollout` must not raise for an episode's own failure
    (`Env.run_slot` does not): it returns an episode with `ok=False`."""
    opened = group.opened
    # counted as each rollout is given its place, so the runner's next pull waits no longer
    placed = None if opened is None else functools.partial(opened.started, group)
    try:
        # with many endpoints, the whole group on one (the rollouts share the task's prefix)
        with sticky(("group", group.id)):
            if env.sandboxes is None:
                return await _run_group(env, group, run_rollout, placed)
            async with env.sandboxes.group():  # sandbox_scope="group": one box for them all
                return await _run_group(env, group, run_rollout, placed)
    finally:
        if opened is not None:
            opened.closed(group)  # ended, failed or cancelled: it waits for nothing more


async def _run_group(
    env: Env[Any],
    group: Group,
    run_rollout: RunRollout,
    placed: Callable[[int], None] | None,
) -> list[Episode]:
    try:
        with prioritized():  # a waiting rollout of this group goes before a new pull
            episodes: list[Episode] = await fan_out_placing(run_rollout, group.slots, placed, _ok)
    except ResultRefused as refused:
        return _failed(group, refused.result, refused.results)
    try:
        if type(env).score_group is Env.score_group:  # none of its own: the default
            group_advantages(episodes, group.advantage)
        else:
            await env.score_group(group.task, episodes)
    except Exception as exc:
        cause = f"score_group raised {type(exc).__name__}: {exc}"
        for episode in episodes:
            episode.ok = False
            episode.errors.append(EpisodeError(type(exc).__name__, cause))
    spread = version_range(s["version"] for e in episodes for spans in e.versions for s in spans)
    for episode in episodes:
        episode.group = group.id
        episode.group_versions = spread  # the policy versions the group spans
    return episodes


def _failed(group: Group, failed: Episode, done: list[Episode | None]) -> list[Episode]:
    """A failed group's episodes: the failed one with its own errors, every other one
    `ok=False` with a `GroupFailedError` naming the cause (one made for a rollout that was
    cancelled or never started, so that every rollout is answered)."""
    cause = _cause(failed)
    episodes = []
    for slot, episode in zip(group.slots, done, strict=True):
        if episode is None:  # cancelled (or never started): answered all the same
            episode = _cancelled(slot, f"cancelled: {cause}")
        elif episode is not failed:
            episode.ok = False
            episode.errors.append(EpisodeError(GroupFailedError.__name__, cause))
        episode.group = group.id
        episodes.append(episode)
    return episodes


def cause_first(episodes: list[Episode]) -> list[Episode]:
    """A group's episodes in the order to write them: those that failed on their own first
    (so a run's first error is the cause, not a `GroupFailedError`), then slot order."""
    if not any(map(_errors, episodes)):
        return episodes  # (the usual case: nothing to reorder)
    return sorted(
        episodes,
        key=lambda e: bool(e.errors) and e.errors[-1].type == GroupFailedError.__name__,
    )
