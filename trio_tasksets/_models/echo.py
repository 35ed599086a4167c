"""`EchoClient`: the built-in offline model (replies with the last user message)."""

from __future__ import annotations

from typing import Any

import trio

from .._core.exceptions import ConfigError
from .base import ClientDescription, Completion, ModelClientBase, Sampling, text_of, word_count

__all__ = ["EchoClient"]


class EchoClient(ModelClientBase):
    """The built-in offline model: replies with the text of the last ``user`` message
    (``""`` if there is none). Waits ``delay`` seconds (``trio.sleep``, so a MockClock
    controls it) and always checkpoints. Usage counts words: ``prompt_tokens`` over all
    message contents, ``completion_tokens`` over the reply. A negative ``delay`` raises
    `ConfigError`."""

    def __init__(self, delay: float = 0.0) -> None:
        if not delay >= 0:
            raise ConfigError(f"{{delay}} must be >= 0, got {delay!r}", parameter="delay")
        self.delay = delay

    def __repr__(self) -> str:
        return f"EchoClient(delay={self.delay!r})"

    def describe(self) -> ClientDescription:
        """No endpoint; it travels as ``{"type": "echo", "delay": ...}``."""
        return ClientDescription(travel={"type": "echo", "delay": float(self.delay)})

    # duplicates: ModelClient.chat's signature (with tools), which every client implements
    async def chat(
        self,
        messages: list[dict[str, Any]],
        *,
        model: str,
        sampling: Sampling,
        tools: list[dict[str, Any]] | None = None,
    ) -> Completion:
        """Echo the last user message; ``model``, ``sampling`` and ``tools`` are ignored (it
        never calls a tool, so a tool env's rollout with it ends after one turn)."""
        if self.delay > 0:
            await trio.sleep(self.delay)
        await trio.lowlevel.checkpoint()
        reply = ""
        for message in reversed(messages):
            if message.get("role") == "user":
                reply = text_of(message.get("content"))
                break
        prompt_tokens = sum(word_count(text_of(m.get("content"))) for m in messages)
        return Completion(
            content=reply,
            usage={"prompt_tokens": prompt_tokens, "completion_tokens": word_count(reply)},
            finish_reason="stop",
        )
