"""`tt.ToolEnv`: the tool-calling loop (tools run through `fan_out`, on the eval's window).

Each turn sends the messages and the tools' schemas; the reply (its message as sent) is
appended, and its tool calls run concurrently through `tt.fan_out` (on the eval's window:
`-c` bounds them with everything else), each answered by a ``role: tool`` message with its
``tool_call_id``, in the order the model asked. The loop ends when a reply asks for no tool,
or at a limit (`max_turns`; `token_limit` summed over the rollout's usage): then the rollout
ends normally and is scored, and the row's `stop_reason` names the limit.

A tool that raises, times out (`tool_timeout`), is unknown, or gets arguments that are not
valid JSON for its schema answers the model with an error text (``Error: ...``); it is never
an episode failure. Cancellation (the eval stopped) and KeyboardInterrupt go through.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Iterable
from typing import Any, TypeVar

import attrs
import trio

from .._core.exceptions import ConfigError
from .._core.limits import report_progress
from .._core.runner import fan_out
from .._core.tasksets import Taskset
from .._models import ModelContext, ToolCall
from ..tools import Tool, ToolArgumentError, tool
from .env import Env, Message, chat_messages, note_rollout

__all__ = ["ToolEnv", "tool_answer_text"]

TaskT = TypeVar("TaskT")

STOP_MAX_TURNS = "max_turns"
STOP_TOKEN_LIMIT = "token_limit"


class ToolEnv(Env[TaskT]):
    """An env whose rollout is the tool-calling loop (see the module).

    `tools`: `tt.Tool`s, or typed functions (made tools with `tt.tool`); their names must be
    distinct. `max_turns` (>= 1) bounds the model calls of a rollout; `token_limit` (None or
    >= 1) the tokens its replies used in all (prompt + completion); `tool_timeout` (None or
    seconds > 0) each tool call. Other keyword arguments go to `tt.Env` (`reward`,
    `retries`, `rollout_timeout`). The completion scored is the last reply's text.

    Override `answer(call, tool)` to change how one call is answered, or `tool_text(value)`
    for how a tool's result becomes the text the model reads.

    A bad limit, or tools that share a name, raise a `ConfigError` naming the parameter.
    """

    def __init__(
        self,
        taskset: Taskset[TaskT, Any],
        tools: Iterable[Tool | Any],
        *,
        max_turns: int = 10,
        token_limit: int | None = None,
        tool_timeout: float | None = None,
        **env_kwargs: Any,
    ) -> None:
        super().__init__(taskset, **env_kwargs)
        if isinstance(max_turns, bool) or not isinstance(max_turns, int) or max_turns < 1:
            raise ConfigError(
                f"{{max_turns}} must be an int >= 1, got {max_turns!r}", parameter="max_turns"
            )
        if token_limit is not None and (
            isinstance(token_limit, bool) or not isinstance(token_limit, int) or token_limit < 1
        ):
            raise ConfigError(
                f"{{token_limit}} must be an int >= 1 or None, got {token_limit!r}",
                parameter="token_limit",
            )
        if tool_timeout is not None and (
            isinstance(tool_timeout, bool)
            or not isinstance(tool_timeout, int | float)
            or not math.isfinite(tool_timeout)
            or tool_timeout <= 0
        ):
            raise ConfigError(
                f"{{tool_timeout}} must be a number of seconds > 0 or None, got {tool_timeout!r}",
                parameter="tool_timeout",
            )
        self.max_turns = max_turns
        self.token_limit = token_limit
        self.tool_timeout = None if tool_timeout is None else float(tool_timeout)
        self.tools: dict[str, Tool] = {}
        for given in tools if not isinstance(tools, Tool) else [tools]:
            made = given if isinstance(given, Tool) else tool(given)
            if made.name in self.tools:
                raise ConfigError(
                    f"{{tools}}: two tools are named {made.name!r}; names must differ",
                    parameter="tools",
                )
            self.tools[made.name] = made
        self.schemas = [made.schema for made in self.tools.values()]

    async def rollout(self, task: TaskT, ctx: ModelContext) -> tuple[list[Message], str]:
        messages = chat_messages(task)
        tools = self.schemas or None
        turns = calls = used = 0
        stop: str | None = None
        completion = ""
        while True:
            reply = await ctx.chat(messages, tools=tools)
            turns += 1
            messages.append(reply.message)
            completion = reply.content
            used += _tokens(reply.usage)
            if not reply.tool_calls:
                break
            calls += len(reply.tool_calls)
            answers = await fan_out(
                [functools.partial(self._answer, call) for call in reply.tool_calls]
            )
            messages.extend(answers)
            if self.token_limit is not None and used >= self.token_limit:
                stop = STOP_TOKEN_LIMIT
                break
            if turns >= self.max_turns:
                stop = STOP_MAX_TURNS
                break
        note_rollout(stop_reason=stop, turns=turns, tool_calls=calls)
        return messages, completion

    async def _answer(self, call: ToolCall) -> Message:
        found = self.tools.get(call.name)
        if found is None:
            names = ", ".join(self.tools) or "none"
            text = f"Error: there is no tool named {call.name!r} (the tools: {names})"
        else:
            text = await self.answer(call, found)
        report_progress("tool")  # a call that finished is progress, for --stall-timeout
        return {"role": "tool", "tool_call_id": call.id, "content": text}

    async def answer(self, call: ToolCall, tool: Tool) -> str:
        """The text that answers one call of a known tool: its result (`tool_text`), or an
        ``Error: ...`` text for arguments that do not fit, a timeout, or an exception."""
        problem = call.arguments_error
        if problem is not None:
            return f"Error: {tool.name}: {problem}: {call.raw_arguments[:200]!r}"
        try:
            if self.tool_timeout is None:
                value = await tool.call(call.arguments)
            else:
                with trio.move_on_after(self.tool_timeout):
                    value = await tool.call(call.arguments)
                    return self.tool_text(value)
                return (
                    f"Error: {tool.name} timed out after {self.tool_timeout:g}s and was cancelled"
                )
        except ToolArgumentError as exc:
            return f"Error: {tool.name}: {exc}"
        except Exception as exc:
            return f"Error: {tool.name} raised {type(exc).__name__}: {exc}"
        return self.tool_text(value)

    def tool_text(self, value: Any) -> str:
        """How a tool's result reads to the model: a str as is, None as ``""``, anything
        else as JSON (attrs instances as their fields; what JSON cannot hold, as `str`)."""
        return tool_answer_text(value)


def tool_answer_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if value is None:
        return ""
    return json.dumps(value, default=_jsonable, ensure_ascii=False)


def _jsonable(value: Any) -> Any:
    if attrs.has(type(value)):
        return attrs.asdict(value)
    if isinstance(value, set | frozenset | tuple):
        return list(value)
    return str(value)


def _tokens(usage: dict[str, int]) -> int:
    if "prompt_tokens" in usage or "completion_tokens" in usage:
        return usage.get("prompt_tokens", 0) + usage.get("completion_tokens", 0)
    return usage.get("total_tokens", 0)
