"""The served path's wire format: run requests and model-client descriptions."""

from __future__ import annotations

import copy
import json
import math
from typing import Any

import attrs
import orjson
import trio

from .._core import batching
from .._core.backoff import FIRST, MODEL_RETRIES, MOST
from .._core.exceptions import ConfigError, TrioTasksetsError
from .._core.tasksets import Taskset
from .._env.env import RolloutLimits, RunSlot, task_data, task_key
from .._env.spec import TASK_FIELDS, TravelError, rebuild_task
from .._models import ClientDescription, ModelClient, ModelContext, Sampling, describe
from .._models.calls import TIMEOUT

TOKEN_VAR = "TT_SERVE_TOKEN"
"""The environment variable a spawned server reads its bearer token from, and the one an
eval with ``--server-url`` reads the remote server's token from."""

API_KEY_VAR = "TT_SERVE_API_KEY"
"""Where a spawned server finds the model's API key (the parent puts it in the child's env)."""

MAX_BODY_BYTES = 1 << 20
"""Request bodies (and WebSocket messages) larger than this get 413 (close code 1009)."""

MAX_DEPTH = 64
"""How deeply a run request may nest (objects and arrays): deeper is refused (422) before the
run starts, well inside what the row's encoders and the env's own recursion can take."""

MAX_ANSWER_BYTES = 64 << 20
"""The client's default limit on one message (or `POST /run` answer) from a server."""

READY_PREFIX = "serving on "
"""A server's first stdout line: this prefix, then its URL."""

WS_PATH = "/ws"
# Items per outgoing message, at most. Small enough that a window's runs go as several
# messages, so the client and the server work at the same time (a pipeline) rather than in
# turns on one message each; large enough to pay a message's fixed cost once per many runs.
WS_MAX_BATCH = 16


class WireError(TrioTasksetsError, ValueError):
    """A request that does not match the wire format; `field` is the dotted path at fault.
    `status` is the HTTP status it is answered with (422)."""

    status = 422

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field
        self.problem = problem


class Forbidden(WireError):
    """A well-formed request for something the server was not started to allow (403): the
    message names the flag that would allow it."""

    status = 403


def decode_json(data: bytes | str) -> object:
    """Decode a request's JSON with orjson; `ValueError` (orjson's `JSONDecodeError`) for
    anything that is not strict JSON: invalid UTF-8, lone surrogates, NaN, a number beyond a
    double's range, nesting over 1024 levels. (An integer beyond 64 bits becomes a float.)"""
    return orjson.loads(data)


def check_depth(value: object, field: str, limit: int = MAX_DEPTH) -> None:
    """`WireError` if `value` nests objects and arrays more than `limit` levels deep."""
    if not _nesting_within(value, limit):
        raise WireError(field, f"nests deeper than {limit} levels of objects and arrays")


def _nesting_within(value: object, budget: int) -> bool:
    kind = type(value)
    if kind is dict:
        items: Any = value.values()  # type: ignore[attr-defined]
    elif kind is list:
        items = value
    else:
        return True
    if budget <= 0:
        return False
    for item in items:
        kind = type(item)
        if (kind is dict or kind is list) and not _nesting_within(item, budget - 1):
            return False
    return True


# --- model client descriptions --------------------------------------------------------------


@attrs.frozen
class EchoSpec:
    """The offline echo model, rebuilt as `EchoClient(delay)`."""

    delay: float = 0.0


@attrs.frozen
class OpenAISpec:
    """An OpenAI-compatible endpoint. `api_key_var` asks for the server's key: it must be
    null (no key) or the variable the server was started with (``--api-key-var``); the
    server refuses any other, and any `base_url` it does not allow (``--allow-base-url``)."""

    base_url: str
    timeout: float = TIMEOUT
    max_retries: int = MODEL_RETRIES
    backoff: float = FIRST
    max_backoff: float = MOST
    api_key_var: str | None = None
    # many endpoints (`OpenAIClient([...])`): every one, `base_url` first; () for one
    base_urls: tuple[str, ...] = ()


ClientSpec = EchoSpec | OpenAISpec
_KINDS: dict[type[ClientSpec], str] = {EchoSpec: "echo", OpenAISpec: "openai"}  # ctx.client.type


def describe_client(client: ModelClient, *, api_key_var: str | None = None) -> ClientSpec:
    """The wire description of a model client, from what the client says of itself (its
    `ClientDescription.travel`); `TravelError` for one that cannot travel.

    A client that sends a key is described with `api_key_var` (the server reads the key
    from that variable); the key itself never goes on the wire, nor do its extra headers
    (a client that sends any cannot travel).
    """
    return _spec(describe(client), type(client).__name__, api_key_var)


def _spec(found: ClientDescription, name: str, api_key_var: str | None) -> ClientSpec:
    """`describe_client` of a client described as `found`, `name` its class's name."""
    travel = found.travel
    if travel is None:
        raise TravelError(
            f"model client {name} cannot travel to an env server (EchoClient and OpenAIClient "
            f"can); run in-process"
        )
    if found.headers:
        raise TravelError(
            f"the {name}'s custom headers ({', '.join(sorted(found.headers))}) cannot travel "
            f"to an env server; run in-process"
        )
    fields = dict(travel)
    if fields.get("type") == "openai":
        fields["api_key_var"] = api_key_var if found.api_key is not None else None
    try:
        return _parse_client(fields)
    except WireError as exc:
        raise TravelError(
            f"model client {name} describes itself as nothing the wire carries ({exc}); run "
            f"in-process"
        ) from None


# --- run requests: encode (client side) -----------------------------------------------------


def encode_run_request(
    slot: RunSlot[Any], ctx: ModelContext, *, api_key_var: str | None = None
) -> bytes:
    """The JSON body of `POST /run` for one slot; `TypeError` naming the task if its data
    is not JSON."""
    return RunRequestEncoder(api_key_var).encode(slot, ctx)


_ENCODER = json.JSONEncoder(ensure_ascii=False, allow_nan=False)  # json.dumps's, made once


def _dumps(value: object) -> bytes:
    return _ENCODER.encode(value).encode()


class RunRequestEncoder:
    """`encode_run_request` for many slots of the same model context: the context's JSON is
    made once and reused while the context is the same object with the same client
    description and `sampling.extra` (checked on every call; the rest is frozen)."""

    def __init__(self, api_key_var: str | None = None) -> None:
        self.api_key_var = api_key_var
        self._ctx: tuple[ModelContext, tuple[Any, ...], dict[str, Any], bytes] | None = None
        self._limits: tuple[RolloutLimits | None, bytes] = (None, b"")

    def _ctx_json(self, ctx: ModelContext) -> bytes:
        found = describe(ctx.client)
        # What the wire's client object is made of (the spec is made only when it changes).
        made_of = (found.travel, found.api_key is not None, found.headers)
        cached = self._ctx
        if (
            cached is not None
            and cached[0] is ctx
            and cached[1] == made_of
            and cached[2] == ctx.sampling.extra
        ):
            return cached[3]
        spec = _spec(found, type(ctx.client).__name__, self.api_key_var)
        fields = attrs.asdict(spec)
        if not fields.get("base_urls", True):
            del fields["base_urls"]  # one endpoint: the wire as before
        client = {"type": _KINDS[type(spec)], **fields}
        value = {"model": ctx.model, "sampling": attrs.asdict(ctx.sampling), "client": client}
        encoded = _dumps(value)
        self._ctx = (ctx, copy.deepcopy(made_of), copy.deepcopy(ctx.sampling.extra), encoded)
        return encoded

    def _limits_json(self, limits: RolloutLimits | None) -> bytes:
        """``,"limits":{...}`` for a slot's own limits (made once per limits object), or
        nothing."""
        cached = self._limits
        if cached[0] is not limits:
            fields = None if limits is None else limits.to_json()
            cached = self._limits = (limits, b',"limits":%b' % _dumps(fields) if fields else b"")
        return cached[1]

    def encode(self, slot: RunSlot[Any], ctx: ModelContext) -> bytes:
        """The JSON body of `POST /run` for `slot` under `ctx`; called in a trio task with
        a finite `trio.current_effective_deadline()`, it carries the seconds left as
        `time_left` (the server runs the episode under it), and the slot's own rollout
        limits (`RunSlot.limits`) as `limits` (the server runs it under them too)."""
        task = slot.task
        try:
            ctx_json = self._ctx_json(ctx)
            data = task_data(task)
            _check_ints(data)
            task_json = _dumps({"task": {"key": task_key(task), "data": data},
                                "rollout": slot.rollout})  # fmt: skip
        except (TypeError, ValueError) as exc:
            raise TypeError(
                f"task {task_key(task)!r}: its data or the sampling settings are not JSON, so "
                f"they cannot go to an env server: {exc}"
            ) from exc
        try:
            left = trio.current_effective_deadline() - trio.current_time()
        except RuntimeError:  # a sync caller, outside trio: no deadline
            left = math.inf
        limits = self._limits_json(slot.limits)
        if left != math.inf:
            left_json = b',"time_left":%r' % max(left, 0.0)
            return b'{"slot":%b,"ctx":%b%b%b}' % (task_json, ctx_json, left_json, limits)
        return b'{"slot":%b,"ctx":%b%b}' % (task_json, ctx_json, limits)


TIME_LEFT = "time_left"
"""The run request field holding the seconds the run has left (its caller's deadline)."""

LIMITS = "limits"
"""The run request field holding the caller's rollout limits (`tt.RolloutLimits.to_json`):
the server runs the slot under its env's own limits and these, each the tighter."""


def request_limits(body: object) -> RolloutLimits | None:
    """A decoded run request's `limits`, rebuilt: None when absent, else the same
    `tt.RolloutLimits` its caller sent (`WireError` naming the field otherwise)."""
    if type(body) is not dict:
        return None
    value = body.get(LIMITS)
    if value is None:
        return None
    try:
        return RolloutLimits.from_json(value)
    except ConfigError as exc:
        field = LIMITS if exc.parameter in (None, LIMITS) else f"{LIMITS}.{exc.parameter}"
        raise WireError(field, str(exc)) from None


def time_left(body: object) -> float | None:
    """A decoded run request's `time_left`: None when absent, else a finite number of
    seconds >= 0 (`WireError` naming the field otherwise)."""
    if type(body) is not dict:
        return None
    value = body.get(TIME_LEFT)
    if value is None:
        return None
    if type(value) not in (int, float) or not math.isfinite(value) or value < 0:
        shown = repr(value) if type(value) in (int, float) else _kind(value)
        raise WireError(TIME_LEFT, f"expected a number of seconds >= 0, got {shown}")
    return float(value)


# --- run requests: parse and validate (server side) ------------------------------------------


@attrs.frozen
class RunRequest:
    """A validated run request."""

    key: str
    data: dict[str, Any]
    rollout: int
    model: str
    sampling: Sampling
    client: ClientSpec
    limits: RolloutLimits | None = None


def _kind(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object" if isinstance(value, dict) else type(value).__name__


def _object(value: object, field: str, allowed: set[str] | None = None) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise WireError(field, f"expected an object, got {_kind(value)}")
    if allowed is not None:
        unknown = sorted(set(value) - allowed)
        if unknown:
            raise WireError(f"{field}.{unknown[0]}", "unknown field")
    return value


def _required(obj: dict[str, Any], name: str, field: str) -> Any:
    if name not in obj:
        raise WireError(f"{field}.{name}", "missing")
    return obj[name]


def _str(value: object, field: str, *, optional: bool = False) -> Any:
    if value is None and optional:
        return None
    if not isinstance(value, str):
        raise WireError(field, f"expected a string, got {_kind(value)}")
    return value


def _int(value: object, field: str, *, optional: bool = False, minimum: int | None = None) -> Any:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise WireError(field, f"expected an integer, got {_kind(value)}")
    if minimum is not None and value < minimum:
        raise WireError(field, f"must be >= {minimum}, got {value}")
    return value


def _number(
    value: object, field: str, *, optional: bool = False, minimum: float | None = None
) -> Any:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise WireError(field, f"expected a number, got {_kind(value)}")
    if not math.isfinite(value) or (minimum is not None and value < minimum):
        raise WireError(field, f"must be a finite number >= {minimum}, got {value}")
    return float(value)


def _task_fields(data: dict[str, Any], field: str) -> None:
    """`data` holds `tt.Task` fields of the right types."""
    _object(data, field, set(TASK_FIELDS))
    prompt = _required(data, "prompt", field)
    if isinstance(prompt, list):
        for i, message in enumerate(prompt):
            _object(message, f"{field}.prompt[{i}]")
    else:
        _str(prompt, f"{field}.prompt")
    _str(data.get("answer"), f"{field}.answer", optional=True)
    if data.get("info") is not None:
        _object(data["info"], f"{field}.info")
    _str(data.get("system_prompt"), f"{field}.system_prompt", optional=True)


def _parse_sampling(value: object) -> Sampling:
    field = "ctx.sampling"
    names = {"temperature", "max_tokens", "top_p", "seed", "extra", "return_tokens", "stream"}
    obj = _object(value, field, names)
    extra = obj.get("extra")
    flags = {name: obj.get(name, False) for name in ("return_tokens", "stream")}
    for name, flag in flags.items():
        if not isinstance(flag, bool):
            raise WireError(f"{field}.{name}", f"expected true or false, got {flag!r}")
    return Sampling(
        temperature=_number(obj.get("temperature"), f"{field}.temperature", optional=True),
        max_tokens=_int(obj.get("max_tokens"), f"{field}.max_tokens", optional=True),
        top_p=_number(obj.get("top_p"), f"{field}.top_p", optional=True),
        seed=_int(obj.get("seed"), f"{field}.seed", optional=True),
        extra={} if extra is None else _object(extra, f"{field}.extra"),
        return_tokens=flags["return_tokens"],
        stream=flags["stream"],
    )


def _parse_client(value: object) -> ClientSpec:
    field = "ctx.client"
    obj = _object(value, field)
    kind = _str(_required(obj, "type", field), f"{field}.type")
    if kind == "echo":
        _object(obj, field, {"type", "delay"})
        return EchoSpec(_number(obj.get("delay", 0.0), f"{field}.delay", minimum=0.0))
    if kind != "openai":
        raise WireError(f"{field}.type", f"expected 'echo' or 'openai', got {kind!r}")
    names = {"type", "base_url", "timeout", "max_retries", "backoff", "max_backoff", "api_key_var",
             "base_urls"}  # fmt: skip
    _object(obj, field, names)
    urls = obj.get("base_urls", [])
    if not isinstance(urls, list) or len(urls) > 64:
        raise WireError(f"{field}.base_urls", "expected a list of at most 64 URLs")
    base_urls = tuple(_str(url, f"{field}.base_urls[{i}]") for i, url in enumerate(urls))
    timeout = _number(obj.get("timeout", TIMEOUT), f"{field}.timeout", minimum=0.0)
    if timeout <= 0:
        raise WireError(f"{field}.timeout", f"must be > 0, got {timeout}")
    return OpenAISpec(
        base_url=_str(_required(obj, "base_url", field), f"{field}.base_url"),
        timeout=timeout,
        max_retries=_int(obj.get("max_retries", MODEL_RETRIES), f"{field}.max_retries", minimum=0),
        backoff=_number(obj.get("backoff", FIRST), f"{field}.backoff", minimum=0.0),
        max_backoff=_number(obj.get("max_backoff", MOST), f"{field}.max_backoff", minimum=0.0),
        api_key_var=_str(obj.get("api_key_var"), f"{field}.api_key_var", optional=True),
        base_urls=base_urls,
    )


_SLOT_FIELDS = frozenset({"task", "rollout"})
_TASK_REF_FIELDS = frozenset({"key", "data"})
# The nesting left for a value inside `slot.task.data` (the body, slot, task and data are 4).
_DATA_BUDGET = MAX_DEPTH - 4


def quick_slot(
    value: object, *, plain_tasks: bool = True
) -> tuple[str, dict[str, Any], int] | None:
    """The key, data and rollout of a well-formed ``slot`` field of a decoded run request, or
    None. A fast path for `parse_run_request`'s checks of the slot: it accepts only what they
    accept (exact JSON types, no unknown field), and for anything else (a bad field, or an
    unusual shape, or one nested too deeply) returns None, so that the caller runs
    `parse_run_request`, which decides and names the field."""
    if type(value) is not dict or not value.keys() <= _SLOT_FIELDS:
        return None
    task = value.get("task")
    rollout = value.get("rollout", 0)
    if type(task) is not dict or task.keys() != _TASK_REF_FIELDS:
        return None
    if type(rollout) is not int or rollout < 0:
        return None
    key, data = task["key"], task["data"]
    if type(key) is not str or type(data) is not dict:
        return None
    if not plain_tasks:
        return (key, data, rollout) if _nesting_within(data, _DATA_BUDGET + 1) else None
    if not data.keys() <= TASK_FIELDS:
        return None
    prompt = data.get("prompt")
    if type(prompt) is list:
        if not all(type(message) is dict for message in prompt):
            return None
        if not _nesting_within(prompt, _DATA_BUDGET):
            return None
    elif type(prompt) is not str:
        return None
    for name in ("answer", "system_prompt"):
        text = data.get(name)
        if text is not None and type(text) is not str:
            return None
    info = data.get("info")
    if info is not None and (type(info) is not dict or not _nesting_within(info, _DATA_BUDGET)):
        return None
    return key, data, rollout


def parse_run_request(body: object, *, plain_tasks: bool = True) -> RunRequest:
    """Check a decoded `POST /run` body against the wire format; `WireError` names the field.

    With `plain_tasks` (the taskset has no `task_from_data`), `slot.task.data` must hold
    `tt.Task` fields; otherwise it may be any object. Nothing may nest deeper than
    `MAX_DEPTH` levels.
    """
    check_depth(body, "body")
    top = _object(body, "body", {"slot", "ctx", TIME_LEFT, LIMITS})
    slot = _object(_required(top, "slot", "body"), "slot", {"task", "rollout"})
    task = _object(_required(slot, "task", "slot"), "slot.task", {"key", "data"})
    key = _str(_required(task, "key", "slot.task"), "slot.task.key")
    data = _object(_required(task, "data", "slot.task"), "slot.task.data")
    if plain_tasks:
        _task_fields(data, "slot.task.data")
    rollout = _int(slot.get("rollout", 0), "slot.rollout", minimum=0)
    ctx = _object(_required(top, "ctx", "body"), "ctx", {"model", "sampling", "client"})
    return RunRequest(
        key=key,
        data=data,
        rollout=rollout,
        model=_str(_required(ctx, "model", "ctx"), "ctx.model"),
        sampling=_parse_sampling(ctx.get("sampling", {})),
        client=_parse_client(_required(ctx, "client", "ctx")),
        limits=request_limits(top),
    )


def build_task(taskset_cls: type[Taskset[Any, Any]], key: str, data: dict[str, Any]) -> Any:
    """The task a request stands for: `taskset_cls.task_from_data(data, key)` when the
    taskset class defines it, else `tt.Task(**data, key=key)`; `WireError` if it fails."""
    try:
        return rebuild_task(taskset_cls, key, data)
    except (TypeError, ValueError, KeyError) as exc:
        raise WireError("slot.task.data", f"cannot build a task from it: {exc}") from exc


# --- numbers JSON carries exactly ------------------------------------------------------------


_INT_RANGE = (-(2**63), 2**64 - 1)  # what the server's JSON decoder (orjson) keeps exact


def _check_ints(value: object) -> None:
    """Refuse integers a served run would turn into floats (orjson: 64-bit at most)."""
    if isinstance(value, int) and not isinstance(value, bool):
        if not _INT_RANGE[0] <= value <= _INT_RANGE[1]:
            raise ValueError(f"the integer {value} is outside the 64-bit range JSON can carry")
    elif isinstance(value, dict):
        for item in value.values():
            _check_ints(item)
    elif isinstance(value, list | tuple):
        for item in value:
            _check_ints(item)


# --- batching ------------------------------------------------------------------------------


# The served path's WebSocket writers batch with the project's one helper (`batching`).
coalesce = batching.coalesce
