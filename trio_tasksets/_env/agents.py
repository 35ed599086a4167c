"""`tt.ToolEnv`: the tool-calling loop (tools run through `fan_out`, on the eval's window).

Each turn sends the messages and the tools' schemas; the reply (its message as sent) is
appended, and its tool calls run concurrently through `tt.fan_out` (on the eval's window:
`-c` bounds them with everything else), each answered by a ``role: tool`` message with its
``tool_call_id``, in the order the model asked. The loop ends when a reply asks for no tool,
or at a limit (`max_turns`; `token_limit` summed over the rollout's usage): then the rollout
ends normally and is scored, and the row's `stop_reason` names the limit. The limits are the
env's `tt.RolloutLimits`, read for each attempt (`current_limits`: a served request's or a
queue entry's own limits tighten them).

A tool that raises, times out (`tool_timeout`), is unknown, or gets arguments that are not
valid JSON for its schema answers the model with an error text (``Error: ...``); it is never
an episode failure. Cancellation (the eval stopped) and KeyboardInterrupt go through.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable
from typing import Any, TypeVar

import attrs
import orjson
import trio

from .._core.exceptions import ConfigError
from .._core.limits import report_progress
from .._core.runner import fan_out
from .._core.tasksets import Taskset
from .._models import ModelContext, ToolCall
from ..tools import Tool, ToolArgumentError, tool
from .env import Env, Message, chat_messages, current_limits, note_rollout
from .rollout_limits import LimitAttribute, RolloutLimits

__all__ = ["ToolEnv", "model_text", "tool_answer_text"]

TaskT = TypeVar("TaskT")

STOP_MAX_TURNS = "max_turns"
STOP_TOKEN_LIMIT = "token_limit"
STOP_CONVERSATION_BYTES = "max_conversation_bytes"
DEFAULT_MAX_TURNS = 10
DEFAULT_MAX_ANSWER_BYTES = 1 << 20  # one tool answer, as the model reads it: 1 MiB
DEFAULT_MAX_CONVERSATION_BYTES = 8 << 20  # the messages a rollout sends: 8 MiB


class ToolEnv(Env[TaskT]):
    """An env whose rollout is the tool-calling loop (see the module).

    `tools`: `tt.Tool`s, or typed functions (made tools with `tt.tool`); their names must be
    distinct. `max_turns` (>= 1) bounds the model calls of a rollout; `token_limit` (None or
    >= 1) the tokens its replies used in all (prompt + completion); `tool_timeout` (None or
    seconds > 0) each tool call. They are the env's `rollout_limits` (a `tt.RolloutLimits`,
    with `tt.Env`'s), which may instead be given whole (`rollout_limits=`; its `max_turns`
    left None is 10: a tool loop always has a turn bound). Other keyword arguments go to
    `tt.Env` (`reward`, `retries`, `rollout_timeout`, ..., and `sandbox`, `sandbox_scope`,
    `max_sandboxes`: a box per rollout, in which `tt.tools.shell` and the file tools run).
    The completion scored is the last reply's text.

    `max_answer_bytes` (None or >= 1; 1 MiB by default) bounds one tool answer: a longer one
    is cut there (at a character's boundary) and says so in the text the model reads.
    `max_conversation_bytes` (None or >= 1; 8 MiB by default) bounds the messages a rollout
    sends: once they outgrow it, the rollout ends normally before the next model call, its
    row's `stop_reason` ``"max_conversation_bytes"``. A tool answer that cannot be encoded
    (a lone surrogate) reaches the model escaped (``\\ud800``).

    Raises `ConfigError` naming the parameter: a limit out of range or given twice (in
    `rollout_limits` and as a keyword argument), two tools of one name.

    Override `answer(call, tool)` to change how one call is answered, or `tool_text(value)`
    for how a tool's result becomes the text the model reads.

    A bad limit, or tools that share a name, raise a `ConfigError` naming the parameter.
    """

    rollout_limits: RolloutLimits = RolloutLimits(max_turns=DEFAULT_MAX_TURNS)
    max_turns: LimitAttribute[int | None] = LimitAttribute()
    token_limit: LimitAttribute[int | None] = LimitAttribute()
    tool_timeout: LimitAttribute[float | None] = LimitAttribute()

    def __init__(
        self,
        taskset: Taskset[TaskT, Any],
        tools: Iterable[Tool | Any],
        *,
        max_turns: int = DEFAULT_MAX_TURNS,
        token_limit: int | None = None,
        tool_timeout: float | None = None,
        max_answer_bytes: int | None = DEFAULT_MAX_ANSWER_BYTES,
        max_conversation_bytes: int | None = DEFAULT_MAX_CONVERSATION_BYTES,
        **env_kwargs: Any,
    ) -> None:
        super().__init__(taskset, **env_kwargs)
        self.max_answer_bytes = _bytes_bound(max_answer_bytes, "max_answer_bytes")
        self.max_conversation_bytes = _bytes_bound(max_conversation_bytes, "max_conversation_bytes")
        if env_kwargs.get("rollout_limits") is None:
            if max_turns is None:  # a tool loop always has a turn bound
                raise ConfigError(
                    "{max_turns} must be an int >= 1, got None", parameter="max_turns"
                )
            self.rollout_limits = attrs.evolve(
                self.rollout_limits, max_turns=max_turns, token_limit=token_limit,
                tool_timeout=tool_timeout,
            )  # fmt: skip
        else:
            keywords = (
                ("max_turns", max_turns, DEFAULT_MAX_TURNS),
                ("token_limit", token_limit, None),
                ("tool_timeout", tool_timeout, None),
            )
            named = [name for name, value, default in keywords if value != default]
            if named:
                raise ConfigError(
                    f"{{rollout_limits}} and {', '.join(named)} are both given: give each "
                    f"limit once, in rollout_limits or as a keyword argument",
                    parameter="rollout_limits",
                )
            if self.rollout_limits.max_turns is None:
                self.rollout_limits = attrs.evolve(self.rollout_limits, max_turns=DEFAULT_MAX_TURNS)
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
        limits = current_limits(self)
        max_turns = limits.max_turns or DEFAULT_MAX_TURNS
        token_limit = limits.token_limit
        turns = calls = used = 0
        sent = _size(messages)  # the conversation's bytes (max_conversation_bytes)
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
            sent += _size([reply.message, *answers])
            if token_limit is not None and used >= token_limit:
                stop = STOP_TOKEN_LIMIT
                break
            if turns >= max_turns:
                stop = STOP_MAX_TURNS
                break
            if self.max_conversation_bytes is not None and sent > self.max_conversation_bytes:
                stop = STOP_CONVERSATION_BYTES
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
        text = model_text(text, self.max_answer_bytes)
        report_progress("tool")  # a call that finished is progress, for --stall-timeout
        return {"role": "tool", "tool_call_id": call.id, "content": text}

    async def answer(self, call: ToolCall, tool: Tool) -> str:
        """The text that answers one call of a known tool: its result (`tool_text`), or an
        ``Error: ...`` text for arguments that do not fit, a timeout (the attempt's
        `tool_timeout`), or an exception."""
        problem = call.arguments_error
        if problem is not None:
            return f"Error: {tool.name}: {problem}: {call.raw_arguments[:200]!r}"
        timeout = current_limits(self).tool_timeout
        try:
            if timeout is None:
                value = await tool.call(call.arguments)
            else:
                with trio.move_on_after(timeout):
                    value = await tool.call(call.arguments)
                    return self._text(tool, value)
                return f"Error: {tool.name} timed out after {timeout:g}s and was cancelled"
        except ToolArgumentError as exc:
            return f"Error: {tool.name}: {exc}"
        except Exception as exc:
            return f"Error: {tool.name} raised {type(exc).__name__}: {exc}"
        return self._text(tool, value)

    def _text(self, tool: Tool, value: Any) -> str:
        try:
            return self.tool_text(value)
        except Exception as exc:  # (a value JSON cannot hold: circular, too deep)
            what = f"{type(exc).__name__}: {exc}"
            return f"Error: {tool.name}: its answer cannot be read as text ({what})"

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


def model_text(text: str, limit: int | None) -> str:
    """`text` as a tool answer the model reads: what UTF-8 cannot encode (a lone surrogate)
    escaped (``\\ud800``), and over `limit` bytes (None: no bound) cut there, at a
    character's boundary, with a line saying how much was cut."""
    try:
        data = text.encode()
    except UnicodeEncodeError:  # else the next request's encoding fails, not this answer
        text = text.encode("utf-8", "backslashreplace").decode()
        data = text.encode()
    if limit is None or len(data) <= limit:
        return text
    kept = data[:limit].decode("utf-8", "ignore")
    return (
        f"{kept}\n[cut: the answer has {len(data):,} bytes; the first {limit:,} are shown "
        f"(max_answer_bytes)]"
    )


def _size(messages: list[Message]) -> int:
    """The bytes `messages` take in a request body (about: JSON, without the separators)."""
    total = 0
    for message in messages:
        try:
            total += len(orjson.dumps(message, default=str))
        except TypeError:  # (what orjson refuses, e.g. a str UTF-8 cannot hold)
            total += len(repr(message))
    return total


def _bytes_bound(value: object, parameter: str) -> int | None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ConfigError(
            f"{{{parameter}}} must be an int >= 1 (bytes) or None (no bound), got {value!r}",
            parameter=parameter,
        )
    return value


def _tokens(usage: dict[str, int]) -> int:
    if "prompt_tokens" in usage or "completion_tokens" in usage:
        return usage.get("prompt_tokens", 0) + usage.get("completion_tokens", 0)
    return usage.get("total_tokens", 0)
