"""`Policy`: the policy version every governed model call runs under, and its updates while
rollouts are in flight; `EngineControl`, what an engine offers for an update, and
`VLLMControl`, vLLM's.

A `ModelContext(..., policy=p)` routes each call through `Policy.govern`, the gate:

- a call is *admitted* when no update is pending (else it parks, a `limits.parked("policy")`
  wait: neither working time nor a stall), its version and update count noted (and told
  to a `tt.Staleness` run: its oldest token); it runs as the transport's `CutSlot` when
  its client's requests can be cut there (`OpenAIClient.cut_in_transport`: the request's
  own cancel scope is the one an ``abort`` cancels, so the gate opens none: a call with
  no update costs a few set and context-variable operations and the version stamp), else
  in a cancel scope of its own;
- `update(version, mode=...)` makes new calls park from the moment it is called, queues
  behind earlier updates (a fair `trio.Lock`: in order), then by mode: ``wait`` drains the
  calls in flight, ``keep`` pauses the engines with them kept in place (their time is
  parked, told to each call's observers), ``abort`` has the engines end their requests
  (each reply comes back with the tokens made, ``finish_reason`` ``"abort"``) and cuts the
  calls still in flight through their cancel scopes (each keeping what its stream had
  brought, `stream.watch_reply`; without engines, at once); each cut call, after
  the update, continues from its prompt plus those token ids through the client's
  `TokenContinuation.complete_ids` until its own stop or length. Then `load()`, the
  engines' `set_version` and `resume`, the version changes, the stale runs of a
  `Staleness` go, and the parked calls go. A failure on the way leaves the engines resumed
  under the old version (shielded, bounded by `RESTORE_TIMEOUT`) and is raised; so does a
  cancellation mid-update.
- each reply carries `Completion.versions`: the engine's own spans where the client read
  them, else the gate's: the version it was admitted under, split where a ``keep`` update
  held a streamed call (at the tokens it had then), one span per piece of a continued
  reply.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

import attrs
import orjson
import trio

from .._core.exceptions import ConfigError, ConfigTypeError
from .._core.limits import CallObserver, current_observers, parked
from .._core.training import current_run
from .._transport import CUT_SLOT, HTTPClient, HTTPError, RequestCut, Timeouts
from .base import (
    Completion,
    ModelConnectionError,
    ModelHTTPError,
    Sampling,
    Tokens,
    VersionSpan,
    excerpt,
)
from .stream import ReplyWatch, pop_watch, push_watch

if TYPE_CHECKING:
    from .base import ModelContext

__all__ = [
    "ABORT_GRACE",
    "MODES",
    "RESTORE_TIMEOUT",
    "EngineControl",
    "Policy",
    "TokenContinuation",
    "VLLMControl",
    "join_spans",
]

MODES = ("wait", "keep", "abort")
RESTORE_TIMEOUT = 30.0
"""Seconds a failed or cancelled update spends, shielded, putting the engines back."""
ABORT_GRACE = 5.0
"""Seconds an ``abort`` update waits, once its engines have ended their requests (vLLM's
``/pause?mode=abort``: each reply comes back with ``finish_reason`` ``"abort"`` and the
tokens made), for those replies, before it cuts the calls still in flight itself."""


@runtime_checkable
class EngineControl(Protocol):
    """What an engine offers for a policy update (`VLLMControl` for vLLM): pause its
    generation (``mode`` "wait", "keep" or "abort", as `Policy.update`'s), resume it, and
    take a new version name for the tokens it makes from then on."""

    async def pause(self, mode: str) -> None: ...

    async def resume(self) -> None: ...

    async def set_version(self, version: str) -> None: ...


@runtime_checkable
class TokenContinuation(Protocol):
    """A client that continues a sequence from token ids (vLLM's ``/v1/completions`` with a
    token-id prompt): what an aborted call continues through."""

    async def complete_ids(
        self, prompt_ids: list[int], *, model: str, sampling: Sampling
    ) -> Completion: ...


def join_spans(spans: Iterable[VersionSpan]) -> list[VersionSpan]:
    """`spans` in order with neighbours of one version joined (and empty ones dropped,
    unless all are)."""
    joined: list[VersionSpan] = []
    empty: VersionSpan | None = None
    for span in spans:
        if span.end <= span.start:
            empty = empty or span
            continue
        if joined and joined[-1].version == span.version and joined[-1].end == span.start:
            joined[-1] = VersionSpan(span.version, joined[-1].start, span.end)
        else:
            joined.append(span)
    if not joined and empty is not None:
        return [empty]
    return joined


class _Call(ReplyWatch):
    """One admitted call: the version and update count it runs under, the observers of its
    task (told of a ``keep`` update's hold), the watch of its streamed reply (it is one:
    `ReplyWatch`), and how an ``abort`` cuts it: `cut`, and `scope`, the cancel scope to
    cancel: its own (a client that is not cut in its transport) or, for a client that is
    (`OpenAIClient`), the cancel scope of its request in flight, which the transport puts
    here (`CutSlot`), None between requests (a request begun once `cut` is set ends at
    once)."""

    __slots__ = ("cut", "index", "marks", "observers", "scope", "version")

    def __init__(self, version: str, index: int, observers: tuple[CallObserver, ...]) -> None:
        self.builder = None  # (ReplyWatch's, set here: every governed call makes one)
        self.attempts = 0
        self.version = version
        self.index = index
        self.observers = observers
        self.scope: trio.CancelScope | None = None
        self.marks: list[tuple[int, str]] | None = None  # (tokens made then, the new version)
        self.cut = False

    def spans(self, count: int) -> list[VersionSpan]:
        """The gate's spans over `count` output tokens."""
        if not self.marks:  # (every call but those a keep update held)
            return [_span(self.version, count)]
        spans, start, version = [], 0, self.version
        for at, new in self.marks:
            at = min(at, count)
            spans.append(VersionSpan(version, start, at))
            start, version = at, new
        spans.append(VersionSpan(version, start, count))
        return join_spans(spans)

    def made(self) -> int | None:
        """Output tokens a streamed call has received so far (None: not streamed)."""
        builder = self.builder
        return None if builder is None else len(builder.token_ids)


_SPANS: dict[tuple[str, int], VersionSpan] = {}


def _span(version: str, count: int) -> VersionSpan:
    """`VersionSpan(version, 0, count)`, one object per (version, count) (they are frozen):
    what nearly every call is stamped with, without building and checking a new one."""
    span = _SPANS.get((version, count))
    if span is None:
        if len(_SPANS) >= 4096:
            _SPANS.clear()
        span = _SPANS[version, count] = VersionSpan(version, 0, count)
    return span


def _version_text(value: object, name: str) -> str:
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise ConfigTypeError(f"{{{name}}} must be a str or an int, got {value!r}", parameter=name)
    text = str(value)
    if not text:
        raise ConfigError(f"{{{name}}} must not be empty", parameter=name)
    return text


def _output_count(completion: Completion) -> int:
    if completion.tokens is not None and completion.tokens.completion_ids:
        return len(completion.tokens.completion_ids)
    count = completion.usage.get("completion_tokens")
    return count if isinstance(count, int) else 0


class Policy:
    """The policy version every model call of a `ModelContext(..., policy=...)` runs under,
    and its updates (SPEC 13).

    - `version` (a str: ``Policy(0).version == "0"``), `updates` (how many landed),
      `updating` (an update is pending: new calls park).
    - `await update(version, mode=..., load=...)`: from the moment it is called new calls
      park; it waits its turn behind earlier updates (in order); then ``wait`` lets the
      calls in flight finish under the old version, ``keep`` pauses each engine with its
      calls kept in place, ``abort`` cuts the calls in flight, each keeping its tokens and
      continuing after the update from its prompt plus those token ids; then `load()` runs,
      the engines get the version and resume, `version` changes, and parked calls go.
    - Figures: `parked` (calls that waited for an update), `cut` and `continued` (calls
      an ``abort`` cut, and continued), `kept_tokens` (tokens a cut call had and kept),
      `restarted` and `discarded_tokens` (cut calls that could not continue, for want of a
      token-id prompt or a client that continues one, and started over).

    A `version` that is not a str or int, or `engines` that are not `EngineControl`s,
    raises a `ConfigError` naming it.
    """

    def __init__(self, version: str | int = 0, *, engines: Sequence[EngineControl] = ()) -> None:
        self._version = _version_text(version, "version")
        if isinstance(engines, str | bytes) or not isinstance(engines, Iterable):
            raise ConfigTypeError(
                f"{{engines}} must be a list of tt.EngineControl, got {engines!r}",
                parameter="engines",
            )
        engines = tuple(engines)
        for engine in engines:
            if not isinstance(engine, EngineControl):
                raise ConfigTypeError(
                    f"{{engines}} must hold tt.EngineControl objects (pause, resume, "
                    f"set_version), e.g. tt.VLLMControl(url); got {engine!r}",
                    parameter="engines",
                )
        self.engines: tuple[EngineControl, ...] = engines
        self._updates = 0
        self._pending = 0
        self._open = trio.Event()
        self._open.set()
        self._lock = trio.Lock()  # fair: updates go in the order they were called
        self._calls: set[_Call] = set()
        self._drained: trio.Event | None = None  # set when the last call in flight ends
        self._listeners: list[Callable[[], object]] = []
        self.parked = 0
        self.cut = 0
        self.continued = 0
        self.kept_tokens = 0
        self.restarted = 0
        self.discarded_tokens = 0

    def __repr__(self) -> str:
        return (
            f"Policy(version={self._version!r}, updates={self._updates}, "
            f"engines={len(self.engines)})"
        )

    @property
    def version(self) -> str:
        """The current policy version."""
        return self._version

    @property
    def updates(self) -> int:
        """How many updates have landed (what a `tt.Staleness` counts lag in)."""
        return self._updates

    @property
    def updating(self) -> bool:
        """Whether an update is pending (called and not finished): new calls park."""
        return self._pending > 0

    @property
    def in_flight(self) -> int:
        """Calls admitted and not finished."""
        return len(self._calls)

    def on_update(self, listener: Callable[[], object]) -> None:
        """Call `listener()` as each update lands (after the version changes, before the
        parked calls go): how a `tt.Staleness(policy=...)` follows it."""
        self._listeners.append(listener)

    def stats(self) -> dict[str, Any]:
        """The figures, as JSON."""
        return {
            "version": self._version,
            "updates": self._updates,
            "parked": self.parked,
            "cut": self.cut,
            "continued": self.continued,
            "kept_tokens": self.kept_tokens,
            "restarted": self.restarted,
            "discarded_tokens": self.discarded_tokens,
        }

    # --- updates ---------------------------------------------------------------------------

    async def update(
        self,
        version: str | int,
        *,
        mode: Literal["wait", "keep", "abort"] = "keep",
        load: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        """Move the policy to `version`, as the class says. Raises a `ConfigError` naming
        ``version``, ``mode`` or ``load`` for a bad one, before anything happens; what
        `load` or an engine raises (the engines then resumed under the old version, the
        version unchanged); and an engine's error resuming after a good update (the version
        then changed)."""
        new = _version_text(version, "version")
        if mode not in MODES:
            raise ConfigError(
                f"{{mode}} must be one of {', '.join(MODES)}, got {mode!r}", parameter="mode"
            )
        if load is not None and not callable(load):
            raise ConfigTypeError(
                f"{{load}} must be an async callable taking nothing, or None, got {load!r}",
                parameter="load",
            )
        self._pending += 1
        if self._pending == 1:
            self._open = trio.Event()
        try:
            async with self._lock:
                await self._apply(new, mode, load)
        finally:
            self._pending -= 1
            if self._pending == 0:
                self._open.set()

    async def _apply(self, new: str, mode: str, load: Callable[[], Awaitable[None]] | None) -> None:
        old = self._version
        paused: list[EngineControl] = []
        versioned: list[EngineControl] = []
        held: list[_Call] = []
        held_at = 0.0
        done = False
        failed: list[BaseException] = []
        try:
            if mode == "wait":
                await self._drain()
            for engine in self.engines:
                paused.append(engine)  # before the await: a pause cut short is undone too
                await engine.pause(mode)
            if mode == "abort":
                for call in self._calls:  # a request one begins from now on is cut at once
                    call.cut = True  # (it would wait for the paused engine until the grace)
                if self.engines:  # they end their requests: the replies bring their tokens
                    with trio.move_on_after(ABORT_GRACE):
                        await self._drain()
                for call in list(self._calls):  # the rest: cut here, keeping what streamed
                    call.cut = True
                    if call.scope is not None:
                        call.scope.cancel()
            if mode == "keep":
                held, held_at = list(self._calls), trio.current_time()
                for call in held:
                    for observer in call.observers:
                        observer.on_park("policy")
            if load is not None:
                await load()
            for engine in self.engines:
                versioned.append(engine)
                await engine.set_version(new)
            done = True
            self._version = new
            self._updates += 1
            for call in held:
                made = call.made()
                if made is not None:
                    call.marks = [*(call.marks or ()), (made, new)]
        finally:
            with trio.CancelScope(shield=True) as restoring:
                restoring.deadline = trio.current_time() + RESTORE_TIMEOUT
                if not done:
                    for engine in versioned:
                        await _try(engine.set_version(old), failed)
                for engine in paused:
                    await _try(engine.resume(), failed)
            seconds = trio.current_time() - held_at
            for call in held:
                for observer in call.observers:
                    observer.on_unpark("policy", seconds)
        if done:
            for listener in list(self._listeners):
                listener()
        if failed:
            raise failed[0]

    # --- the gate --------------------------------------------------------------------------

    async def _park(self) -> None:
        """Wait, as a `"policy"` wait, until no update is pending."""
        self.parked += 1
        with parked("policy"):
            while self._pending:
                await self._open.wait()

    def _enter(self) -> _Call:
        call = _Call(self._version, self._updates, current_observers())
        self._calls.add(call)
        live = current_run()
        if live is not None:
            live.note(call.index)
        return call

    def _release(self, call: _Call) -> None:
        self._calls.discard(call)
        if not self._calls and self._drained is not None:
            self._drained.set()

    async def _drain(self) -> None:
        """Return once no call is in flight."""
        while self._calls:
            self._drained = trio.Event()
            await self._drained.wait()
        self._drained = None

    async def govern(
        self, ctx: ModelContext, send: Callable[[], Awaitable[Completion]], sampling: Sampling
    ) -> Completion:
        """Run one model call of `ctx` under the policy (`ModelContext.chat` calls it): park
        while an update is pending, stamp the reply's versions, and continue it when an
        ``abort`` update cuts it. Raises what `send` raises.

        Each run of the call (the first, and each piece of a continued one) is admitted
        (parked while an update is pending) and watched (the call is a `ReplyWatch`); a
        client whose requests are cut in its transport (`cut_in_transport`) gets the call as
        its `CutSlot`, so the gate opens no cancel scope (the request's own is cut); any
        other runs in one of the gate's. One frame, no helper: each checkpoint of the call
        resumes every frame above it."""
        client: Any = ctx.client
        cut_in_transport = getattr(client, "cut_in_transport", False) is True
        pieces: list[_Piece] = []  # of a cut call: what each run made
        prompt_ids: list[int] = []
        while True:
            if self._pending:
                await self._park()
            call = self._enter()
            completion: Completion | None = None
            watching = push_watch(call)
            try:
                if cut_in_transport:
                    slot = CUT_SLOT.set(call)
                    try:
                        completion = await send()
                    except RequestCut:
                        pass
                    finally:
                        CUT_SLOT.reset(slot)
                else:
                    with trio.CancelScope() as call.scope:
                        completion = await send()
            finally:
                pop_watch(watching)
                self._release(call)
            if completion is not None and completion.finish_reason != "abort":
                if not pieces:
                    if cut_in_transport and not completion.versions:
                        # its replies are its own, made for this call: stamped in place
                        # (the list is the reply's own, empty; no copy of the reply)
                        completion.versions.extend(call.spans(_output_count(completion)))
                        return completion
                    return _stamped(completion, call)
                pieces.append(_Piece.of_reply(completion, call))
                self.continued += 1
                return _joined(pieces, prompt_ids, completion.finish_reason)
            piece = _Piece.of(completion, call)  # cut: what it had made
            if not pieces:
                if piece.prompt_ids is None or not isinstance(client, TokenContinuation):
                    self.restarted += 1  # nothing to continue from: start over
                    made = 0 if completion is None else _output_count(completion)
                    self.discarded_tokens += max(len(piece.ids), made)
                    continue
                prompt_ids = piece.prompt_ids
            self.cut += 1
            self.kept_tokens += len(piece.ids)
            pieces.append(piece)
            kept = [token for piece in pieces for token in piece.ids]
            left = None if sampling.max_tokens is None else sampling.max_tokens - len(kept)
            if left is not None and left <= 0:
                self.continued += 1
                return _joined(pieces, prompt_ids, "length")
            send = functools.partial(  # after the update: on from the prompt and its tokens
                client.complete_ids,
                prompt_ids + kept,
                model=ctx.model,
                sampling=attrs.evolve(sampling, max_tokens=left, return_tokens=True),
            )


async def _try(step: Awaitable[None], failed: list[BaseException]) -> None:
    try:
        await step
    except Exception as exc:
        failed.append(exc)


def _stamped(completion: Completion, call: _Call) -> Completion:
    """`completion` with its version spans: the engine's own if the client read them, else
    one span of the version the call was admitted under."""
    if completion.versions:
        return completion
    c = completion  # a copy with its spans (as attrs.evolve, without its generic cost)
    return Completion(
        c.content, c.usage, c.finish_reason, c.message, c.tool_calls, c.tokens,
        ttft=c.ttft, tpot=c.tpot, versions=call.spans(_output_count(c)),
    )  # fmt: skip


@attrs.frozen
class _Piece:
    """The tokens one run of a continued call made."""

    prompt_ids: list[int] | None
    ids: list[int]
    logprobs: list[float]
    text: str
    versions: list[VersionSpan]
    ttft: float | None = None

    @classmethod
    def of(cls, completion: Completion | None, call: _Call) -> _Piece:
        """A cut run: what its stream had brought, or the reply an engine ended
        (``finish_reason`` ``"abort"``)."""
        if completion is None:
            completion = call.partial()
        return cls.of_reply(completion, call)

    @classmethod
    def of_reply(cls, completion: Completion, call: _Call) -> _Piece:
        tokens = completion.tokens or Tokens()
        stamped = _stamped(completion, call)
        return cls(
            tokens.prompt_ids or None,
            list(tokens.completion_ids),
            list(tokens.completion_logprobs),
            completion.content,
            stamped.versions,
            completion.ttft,
        )


def _joined(pieces: list[_Piece], prompt_ids: list[int], finish: str | None) -> Completion:
    ids: list[int] = []
    logprobs: list[float] = []
    spans: list[VersionSpan] = []
    whole_logprobs = all(len(piece.logprobs) == len(piece.ids) for piece in pieces)
    for piece in pieces:
        offset = len(ids)
        spans.extend(
            VersionSpan(span.version, span.start + offset, span.end + offset)
            for span in piece.versions
        )
        ids.extend(piece.ids)
        logprobs.extend(piece.logprobs)
    text = "".join(piece.text for piece in pieces)
    return Completion(
        content=text,
        usage={
            "prompt_tokens": len(prompt_ids),
            "completion_tokens": len(ids),
            "total_tokens": len(prompt_ids) + len(ids),
        },
        finish_reason=finish,
        tokens=Tokens(list(prompt_ids), ids, logprobs if whole_logprobs else []),
        ttft=pieces[0].ttft,
        versions=join_spans(spans),
    )


# --- vLLM -------------------------------------------------------------------------------------


class VLLMControl:
    """A vLLM server's update endpoints (served with ``VLLM_SERVER_DEV_MODE=1``), over the
    project's HTTP transport: ``POST /pause?mode=``, ``POST /resume``, ``POST
    /update_weight_version`` (`EngineControl`), ``GET /is_paused`` and ``GET /weight_info``.

    `base_url` is the server's root or its ``/v1`` URL (either). ``http_client``: one of
    your own, left open; else one is made here and closed by `aclose` (or ``async with``).
    A bad `base_url` or `timeout` raises a `ConfigError` naming it; a call that gets no
    answer raises `ModelConnectionError`, one answered with an error status
    `ModelHTTPError` (a 404 says the server lacks ``VLLM_SERVER_DEV_MODE=1``)."""

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        timeout: float = 60.0,
        http_client: HTTPClient | None = None,
    ) -> None:
        if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
            raise ConfigError(
                f"{{base_url}} must be an http(s) URL of a vLLM server (its root or /v1), "
                f"got {base_url!r}",
                parameter="base_url",
            )
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout > 0:
            raise ConfigError(
                f"{{timeout}} must be > 0 seconds, got {timeout!r}", parameter="timeout"
            )
        self.root = base_url.rstrip("/").removesuffix("/v1").rstrip("/")
        self._headers = {"Content-Type": "application/json"}
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"
        self._owns_http = http_client is None
        self._http = http_client or HTTPClient(
            timeouts=Timeouts(connect=timeout, read=timeout, write=timeout, total=timeout)
        )

    def __repr__(self) -> str:
        return f"VLLMControl({self.root!r})"

    async def _call(self, method: str, path: str, body: object = None) -> Any:
        url = self.root + path
        data = b"" if body is None else orjson.dumps(body)
        try:
            response = await self._http.request(method, url, headers=self._headers, body=data)
        except HTTPError as exc:
            raise ModelConnectionError(f"cannot reach {url}: {exc.reason}", url=url) from exc
        if not 200 <= response.status <= 299:
            hint = (
                " (is the server started with VLLM_SERVER_DEV_MODE=1?)"
                if response.status == 404
                else ""
            )
            raise ModelHTTPError(
                f"{method} {url} returned HTTP {response.status}{hint}: "
                f"{excerpt(response.text) or '<empty body>'}",
                url=url,
                status=response.status,
                body=response.text,
            )
        try:
            return orjson.loads(response.body) if response.body else None
        except orjson.JSONDecodeError:
            return None

    async def pause(self, mode: str) -> None:
        """``POST /pause?mode=MODE`` (``keep`` freezes requests in place, ``abort`` ends
        them, ``wait`` drains them). Raises as the class says."""
        await self._call("POST", f"/pause?mode={mode}")

    async def resume(self) -> None:
        """``POST /resume``. Raises as the class says."""
        await self._call("POST", "/resume")

    async def set_version(self, version: str) -> None:
        """``POST /update_weight_version``: the tokens made from now on carry `version`
        (vLLM's ``weight_versions``). Raises as the class says."""
        await self._call("POST", "/update_weight_version", {"new_version": str(version)})

    async def is_paused(self) -> bool:
        """``GET /is_paused``. Raises as the class says."""
        answer = await self._call("GET", "/is_paused")
        return bool(isinstance(answer, dict) and answer.get("is_paused"))

    async def weight_info(self) -> dict[str, Any]:
        """``GET /weight_info`` (``weight_version``). Raises as the class says."""
        answer = await self._call("GET", "/weight_info")
        return answer if isinstance(answer, dict) else {}

    async def aclose(self) -> None:
        """Close the HTTP client if this object made it. Idempotent."""
        if self._owns_http:
            await self._http.aclose()

    async def __aenter__(self) -> VLLMControl:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()
