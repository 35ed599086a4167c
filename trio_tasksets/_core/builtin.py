"""Built-in tasksets for demos and tests: `echo` (static) and `echo-stream` (a live feed)."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Iterable

import attrs
import trio

from .tasksets import Task, Taskset, TasksetConfig

__all__ = ["BUILTIN", "EchoConfig", "EchoStreamConfig", "EchoStreamTaskset", "EchoTaskset"]

PHRASES = (
    "hello world",
    "ping",
    "trio tasksets",
    "structured concurrency",
    "the window is full",
    "pull only when freed",
    "fail fast",
    "close the source",
)


@attrs.define
class EchoConfig(TasksetConfig):
    phrases: tuple[str, ...] = PHRASES
    instruction: str = "Repeat exactly: "


def _echo_task(config: EchoConfig, phrase: str, index: int) -> Task:
    return Task(
        prompt=f"{config.instruction}{phrase}",
        answer=phrase,
        info={"index": index},
        key=f"echo:{index}",
    )


class EchoTaskset(Taskset[Task, EchoConfig]):
    """One echo task per phrase; the echo model answers each one correctly."""

    def load(self) -> Iterable[Task]:
        return [_echo_task(self.config, p, i) for i, p in enumerate(self.config.phrases)]


@attrs.define
class EchoStreamConfig(EchoConfig):
    gap: float = 0.1  # seconds between tasks: short, yet the dashboard visibly fills


class EchoStreamTaskset(Taskset[Task, EchoStreamConfig]):
    """A live feed: one echo task every `gap` seconds (default 0.1; set it with
    `-a '{"gap": 0.5}'`), cycling the phrases, never draining.

    Each task has its own key (`echo-stream:<n>`); only `-n` (or `take`) ends a run over it.
    """

    async def stream(self) -> AsyncIterator[Task]:
        phrases = itertools.cycle(self.config.phrases)
        for index in itertools.count():
            await trio.sleep(self.config.gap)
            task = _echo_task(self.config, next(phrases), index)
            yield attrs.evolve(task, key=f"echo-stream:{index}")


BUILTIN: dict[str, type[Taskset[Task, EchoConfig]]] = {
    "echo": EchoTaskset,
    "echo-stream": EchoStreamTaskset,  # type: ignore[dict-item]
}
