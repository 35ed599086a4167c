"""`tt.Policy` (SPEC 13) on trio's MockClock, against `testing.SimulatedEngine`: calls park
during an update (parked, not working time), `wait` / `keep` / `abort`, an aborted call
continued from its token ids equal to an uncut one, versions per reply and per row, a failed
or cancelled update leaving the engines resumed under the old version, updates in order,
`Staleness(policy=)` counting lag from a rollout's oldest token; `VLLMControl` over HTTP."""

from __future__ import annotations

import json
import random
from typing import Any, Literal

import attrs
import pytest
import trio
import trio.lowlevel
from chat_server import ChatServer
from helpers import free_port
from trio.testing import MockClock

import trio_tasksets as tt
from trio_tasksets._core.health import Health
from trio_tasksets._env.rollout_limits import Waits
from trio_tasksets._transport import CUT_SLOT, RequestCut
from trio_tasksets.testing import EOS, SimulatedEngine

PROMPT = [{"role": "user", "content": "count the stars tonight"}]


def context(engine: SimulatedEngine, policy: tt.Policy | None, **sampling: Any) -> tt.ModelContext:
    return tt.ModelContext(engine, "sim", tt.Sampling(**sampling), policy=policy)


async def chat_across_update(
    ctx: tt.ModelContext, policy: tt.Policy, *, at: float, version: int, mode: Any
) -> tt.Completion:
    """The reply of one `ctx.chat(PROMPT)`, started at once, with `policy.update(version,
    mode=mode)` made `at` seconds later, while it runs."""
    got: list[tt.Completion] = []

    async def call() -> None:
        got.append(await ctx.chat(PROMPT))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(call)
        await trio.sleep(at)
        await policy.update(version, mode=mode)
    (reply,) = got
    return reply


class Control:
    """An engine control that records its calls and fails where told."""

    def __init__(self, fail: str | None = None) -> None:
        self.log: list[tuple[str, str]] = []
        self.fail = fail
        self.version = "0"
        self.paused = False

    async def pause(self, mode: str) -> None:
        await trio.sleep(0.1)
        self.log.append(("pause", mode))
        self.paused = True
        if self.fail == "pause":
            raise RuntimeError("pause failed")

    async def resume(self) -> None:
        await trio.sleep(0.1)
        self.log.append(("resume", ""))
        self.paused = False

    async def set_version(self, version: str) -> None:
        await trio.sleep(0.1)
        self.log.append(("set_version", version))
        if self.fail == "set_version" and version != self.version:
            raise RuntimeError("set_version failed")
        self.version = version


def test_versions_are_strings_and_bad_arguments_are_named() -> None:
    assert tt.Policy(0).version == "0"
    assert tt.Policy("v7").version == "v7"
    with pytest.raises(tt.ConfigError) as caught:
        tt.Policy(True)
    assert caught.value.parameter == "version"
    with pytest.raises(tt.ConfigError) as caught:
        tt.Policy(0, engines=[object()])  # type: ignore[list-item]
    assert caught.value.parameter == "engines"
    with pytest.raises(tt.ConfigError) as caught:
        tt.ModelContext(tt.EchoClient(), "m", policy=object())  # type: ignore[arg-type]
    assert caught.value.parameter == "policy"
    with pytest.raises(tt.ConfigError) as caught:
        tt.Staleness(1, policy=object())  # type: ignore[arg-type]
    assert caught.value.parameter == "policy"
    with pytest.raises(tt.ConfigError) as caught:
        tt.VLLMControl("localhost:8000")
    assert caught.value.parameter == "base_url"
    assert tt.VLLMControl("http://h:1/v1").root == "http://h:1"
    assert tt.VLLMControl("http://h:1/").root == "http://h:1"


async def test_bad_update_arguments_are_refused_before_anything() -> None:
    policy = tt.Policy(0)
    with pytest.raises(tt.ConfigError) as caught:
        await policy.update(1, mode="drop")  # type: ignore[arg-type]
    assert caught.value.parameter == "mode"
    with pytest.raises(tt.ConfigError) as caught:
        await policy.update(1, load=42)  # type: ignore[arg-type]
    assert caught.value.parameter == "load"
    assert not policy.updating
    assert policy.version == "0"


async def test_wait_lets_calls_finish_and_parks_new_ones_as_waits(
    autojump_clock: MockClock,
) -> None:
    engine = SimulatedEngine(decode_time=0.01, mean_tokens=200, seed=1)
    policy = tt.Policy(0, engines=[engine])
    ctx = context(engine, policy)
    replies: dict[str, tt.Completion] = {}
    health = Health()
    waits = Waits()

    async def call(name: str) -> None:
        with tt.observe_calls(health), tt.observe_calls(waits):
            replies[name] = await ctx.chat(PROMPT)

    loaded: list[float] = []

    async def load() -> None:
        assert engine.paused == "wait"
        loaded.append(trio.current_time())
        await trio.sleep(1.0)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(call, "in flight")
        await trio.sleep(0.05)
        nursery.start_soon(lambda: policy.update(1, mode="wait", load=load))
        await trio.sleep(0.01)
        nursery.start_soon(call, "parked")
    assert [s.version for s in replies["in flight"].versions] == ["0"]
    assert [s.version for s in replies["parked"].versions] == ["1"]
    assert policy.version == "1"
    assert engine.version == "1"
    assert engine.paused is None
    assert policy.parked == 1
    # the parked call waited from the update's start to its end: a wait, not working time
    assert health.waited["policy"] >= 1.0
    assert waits.parked >= 1.0


async def test_keep_pauses_the_engine_with_calls_in_place(autojump_clock: MockClock) -> None:
    engine = SimulatedEngine(decode_time=0.01, mean_tokens=300, sigma=0.1, seed=2)
    policy = tt.Policy(0, engines=[engine])
    ctx = context(engine, policy)
    uncut = engine.reply_ids(engine.encode(PROMPT))
    waits = Waits()
    got: list[tt.Completion] = []

    async def call() -> None:
        with tt.observe_calls(waits):
            got.append(await ctx.chat(PROMPT))

    async def load() -> None:
        assert engine.paused == "keep"
        await trio.sleep(5.0)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(call)
        await trio.sleep(1.0)
        await policy.update("v1", mode="keep", load=load)
    (reply,) = got
    assert reply.tokens is not None
    assert reply.tokens.completion_ids == uncut
    # the engine's own spans: the tokens before the pause under "0", after under "v1"
    assert [s.version for s in reply.versions] == ["0", "v1"]
    assert reply.versions[0].start == 0
    assert reply.versions[-1].end == len(uncut)
    assert 90 <= reply.versions[0].end <= 101
    assert policy.cut == 0
    assert policy.restarted == 0
    assert waits.parked == pytest.approx(5.0 + 0.0, abs=0.01)  # the hold: a wait


@pytest.mark.parametrize("seed", range(3))
async def test_abort_cuts_and_continues_equal_to_an_uncut_call(
    autojump_clock: MockClock, seed: int
) -> None:
    # greedy decoding and unchanged weights: cut at 20 random points, continued from the
    # prompt plus the tokens it had, the reply is the uncut one, token for token
    engine = SimulatedEngine(decode_time=0.01, mean_tokens=400, sigma=0.5, seed=seed)
    policy = tt.Policy(0, engines=[engine])
    ctx = context(engine, policy, temperature=0)
    uncut = engine.reply_ids(engine.encode(PROMPT))
    rng = random.Random(seed)
    for round_ in range(20):
        cut_at = rng.uniform(0.0, len(uncut) * 0.01)
        reply = await chat_across_update(ctx, policy, at=cut_at, version=round_ + 1, mode="abort")
        assert reply.tokens is not None
        assert reply.tokens.completion_ids == uncut
        assert reply.tokens.completion_ids[-1] == EOS
        assert reply.finish_reason == "stop"
        assert reply.content == "".join(f"t{t} " for t in uncut)
        assert len(reply.tokens.completion_logprobs) == len(uncut)
        assert reply.versions[-1].end == len(uncut)
        assert reply.versions[0].start == 0
        assert {s.version for s in reply.versions} <= {str(round_), str(round_ + 1)}
    assert policy.discarded_tokens == 0
    assert policy.restarted == 0
    assert policy.cut >= 15  # (a cut at 0 s or after the reply ended cuts nothing)
    assert policy.kept_tokens > 0


async def test_an_aborted_call_keeps_its_own_length_limit(autojump_clock: MockClock) -> None:
    engine = SimulatedEngine(decode_time=0.01, mean_tokens=2000, sigma=0.01, seed=3)
    policy = tt.Policy(0, engines=[engine])
    ctx = context(engine, policy, max_tokens=150)
    reply = await chat_across_update(ctx, policy, at=0.505, version=1, mode="abort")
    assert reply.finish_reason == "length"
    assert reply.tokens is not None
    assert len(reply.tokens.completion_ids) == 150
    assert [(s.version, s.start, s.end) for s in reply.versions] == [("0", 0, 50), ("1", 50, 150)]


async def test_a_failed_update_resumes_the_engines_under_the_old_version(
    autojump_clock: MockClock,
) -> None:
    for fail in ("pause", "set_version", "load"):
        control = Control(fail=None if fail == "load" else fail)
        other = Control()
        policy = tt.Policy(0, engines=[other, control])

        async def load(fail: str = fail) -> None:
            if fail == "load":
                raise RuntimeError("load failed")

        with pytest.raises(RuntimeError, match=f"{fail} failed"):
            await policy.update(1, mode="keep", load=load)
        assert policy.version == "0"
        assert policy.updates == 0
        assert not policy.updating
        for engine in (control, other):
            assert not engine.paused, (fail, engine.log)
            assert engine.version == "0", (fail, engine.log)


async def test_an_update_cancelled_midway_leaves_no_engine_paused(
    autojump_clock: MockClock,
) -> None:
    control = Control()
    policy = tt.Policy(0, engines=[control])

    async def load() -> None:
        await trio.sleep_forever()

    with trio.move_on_after(1.0):
        await policy.update(1, mode="abort", load=load)
    assert not control.paused
    assert control.log[-1] == ("resume", "")
    assert policy.version == "0"
    assert not policy.updating


async def test_concurrent_updates_queue_in_order(autojump_clock: MockClock) -> None:
    control = Control()
    policy = tt.Policy(0, engines=[control])
    order: list[int] = []

    async def update(n: int) -> None:
        await policy.update(n, mode="wait", load=loader(n))

    def loader(n: int) -> Any:
        async def load() -> None:
            order.append(n)
            await trio.sleep(1.0)

        return load

    async with trio.open_nursery() as nursery:
        for n in range(1, 6):
            nursery.start_soon(update, n)
            await trio.lowlevel.checkpoint()
    assert order == [1, 2, 3, 4, 5]
    assert policy.version == "5"
    assert policy.updates == 5
    assert [v for what, v in control.log if what == "set_version"] == ["1", "2", "3", "4", "5"]


async def test_staleness_counts_lag_from_a_rollouts_oldest_token(
    autojump_clock: MockClock,
) -> None:
    engine = SimulatedEngine(decode_time=0.01, mean_tokens=1000, sigma=0.01, seed=4)
    policy = tt.Policy(0, engines=[engine])
    staleness = tt.Staleness(1, policy=policy)
    ctx = context(engine, policy)
    with pytest.raises(tt.ConfigError) as caught:
        staleness.advance()
    assert caught.value.parameter == "policy"
    done: dict[str, Any] = {}

    async def talker(_: object) -> str:
        await ctx.chat(PROMPT)  # ~10 s: its first tokens under version 0
        return "talker"

    async def thinker(_: object) -> str:
        await trio.sleep(2.5)  # no token until after two updates
        await ctx.chat([{"role": "user", "content": "short"}], max_tokens=5)
        return "thinker"

    async def run(name: str, fn: Any) -> None:
        done[name] = await staleness.run(fn)(None)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run, "talker", talker)
        nursery.start_soon(run, "thinker", thinker)
        await trio.sleep(1.0)
        await policy.update(1, mode="keep")
        await trio.sleep(0.5)
        await policy.update(2, mode="keep")  # the talker's oldest token is 2 behind
    assert done == {"talker": None, "thinker": "thinker"}
    assert staleness.version == 2
    assert staleness.cancelled == 1


async def test_rows_carry_spans_and_policy_versions(autojump_clock: MockClock) -> None:
    engine = SimulatedEngine(decode_time=0.01, mean_tokens=200, sigma=0.01, seed=5)
    policy = tt.Policy(0, engines=[engine])
    env = tt.Env(tt.EchoTaskset())
    ctx = context(engine, policy)
    task = next(iter(env.taskset.load()))
    group = tt.Group(task, [tt.RunSlot(task, rollout) for rollout in range(2)])
    episodes: list[tt.Episode] = []

    async def run_group() -> None:
        episodes.extend(await tt.run_group(env, group, lambda slot: env.run_slot(slot, ctx)))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run_group)
        await trio.sleep(1.0)
        await policy.update(1, mode="keep")
    rows = [episode.to_row() for episode in episodes]
    for row in rows:
        assert row["policy_versions"] == ["0", "1"]
        assert row["group_versions"] == ["0", "1"]
        assert [s["version"] for s in row["versions"][0]] == ["0", "1"]
        assert tt.Episode.from_row(row).to_row() == row


async def test_a_call_without_token_ids_starts_over_and_says_so(
    autojump_clock: MockClock,
) -> None:
    script = tt.testing.ScriptedClient(["an answer", "again"], delay=5.0)
    policy = tt.Policy(0)
    ctx = tt.ModelContext(script, "m", policy=policy)
    reply = await chat_across_update(ctx, policy, at=1.0, version=1, mode="abort")
    assert reply.content == "again"
    assert len(script.calls) == 2
    assert policy.restarted == 1
    assert policy.cut == 0
    assert [s.version for s in reply.versions] == ["1"]


class Unversioned(SimulatedEngine):
    """An engine that streams its tokens but reports no versions of its own."""

    async def chat(self, messages: list[dict[str, Any]], **kwargs: Any) -> tt.Completion:
        reply = await super().chat(messages, **kwargs)
        return attrs.evolve(reply, versions=[])


async def test_the_gate_splits_a_held_streamed_call_where_it_was_held(
    autojump_clock: MockClock,
) -> None:
    engine = Unversioned(decode_time=0.01, mean_tokens=300, sigma=0.01, seed=6)
    policy = tt.Policy(0, engines=[engine])
    ctx = context(engine, policy)
    reply = await chat_across_update(ctx, policy, at=1.0, version=1, mode="keep")
    assert reply.tokens is not None
    total = len(reply.tokens.completion_ids)
    assert [(s.version, s.start, s.end) for s in reply.versions] == [
        ("0", 0, 100),
        ("1", 100, total),
    ]


async def test_vllm_control_says_what_a_server_without_dev_mode_lacks(chat: Any) -> None:
    # the suite's fake OpenAI server has no /pause: the error names the fix
    async with tt.VLLMControl(chat.url) as control:
        assert control.root == chat.url.removesuffix("/v1")
        with pytest.raises(tt.ModelHTTPError, match="VLLM_SERVER_DEV_MODE=1") as caught:
            await control.pause("keep")
    assert caught.value.status == 404
    async with tt.VLLMControl(f"http://127.0.0.1:{free_port()}/v1", timeout=5) as closed:
        with pytest.raises(tt.ModelConnectionError, match="cannot reach"):
            await closed.resume()


async def test_complete_ids_sends_a_token_id_prompt_and_reads_the_ids_back() -> None:
    sent: list[dict[str, Any]] = []

    def answer(request: tt.Request) -> tt.Response:
        if request.method == "GET":  # the model's context, once (vLLM's max_model_len)
            models = {"data": [{"id": "m", "max_model_len": 512}]}
            return tt.Response(200, [], json.dumps(models).encode())
        if request.url.endswith("/inference/v1/generate"):  # no scale-out endpoints here
            return tt.Response(404, [], b'{"detail": "Not Found"}')
        sent.append(json.loads(request.body))
        body = {
            "choices": [{"text": "t7 t8 ", "token_ids": [7, 8], "finish_reason": "stop",
                         "logprobs": {"token_logprobs": [-0.5, -0.25]}}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 2},
        }  # fmt: skip
        return tt.Response(200, [], json.dumps(body).encode())

    http = tt.HTTPClient(handler=answer)
    async with tt.OpenAIClient("http://engine.invalid/v1", http_client=http) as client:
        reply = await client.complete_ids(
            [1, 2, 3], model="m", sampling=tt.Sampling(temperature=0, return_tokens=True)
        )
        await client.complete_ids([1, 2, 3, 4], model="m", sampling=tt.Sampling(max_tokens=5))
    # no max_tokens: to the context's end (the server's default would stop at 16)
    assert sent == [
        {"model": "m", "prompt": [1, 2, 3], "max_tokens": 509, "temperature": 0,
         "return_token_ids": True, "logprobs": 0},
        {"model": "m", "prompt": [1, 2, 3, 4], "max_tokens": 5, "return_token_ids": True},
    ]  # fmt: skip
    assert reply.content == "t7 t8 "
    assert reply.finish_reason == "stop"
    assert reply.tokens == tt.Tokens([], [7, 8], [-0.5, -0.25])


# --- vLLM's scale-out endpoints (render, generate with weight_versions), in memory -------------


class ScaleOut:
    """vLLM served with ``--enable-scale-out`` and ``VLLM_SERVER_DEV_MODE=1``, in memory (an
    `HTTPClient` handler on trio's clock) and as its own `EngineControl`: ``POST
    /v1/chat/completions/render`` (a message's ids: its words' lengths), ``POST
    /inference/v1/generate`` (token ids in, text and ids out, whole or streamed, a token each
    10 ms, the next id a function of the sequence so far: greedy and deterministic, with
    vLLM's ``weight_versions``, spans of the version current as each token was made), and
    pause (``keep`` holds the tokens, ``abort`` ends each request, its reply carrying the
    tokens made and ``finish_reason`` ``"abort"``), resume, set_version."""

    def __init__(self) -> None:
        self.version = "0"
        self.running = True
        self.changed = trio.Event()
        self.live: list[dict[str, bool]] = []
        self.paths: list[str] = []

    def _change(self) -> None:
        self.changed.set()
        self.changed = trio.Event()

    async def pause(self, mode: str) -> None:
        self.running = False
        if mode == "abort":
            for state in self.live:
                state["abort"] = True
        self._change()

    async def resume(self) -> None:
        self.running = True
        self._change()

    async def set_version(self, version: str) -> None:
        self.version = version

    async def handle(self, request: tt.Request) -> tt.Response:
        path = request.url.split("://", 1)[1].split("/", 1)[1]
        self.paths.append(path)
        body = json.loads(request.body or b"{}")
        if path == "v1/chat/completions/render":
            ids = [len(word) for m in body["messages"] for word in m["content"].split()]
            params = {"max_tokens": body.get("max_tokens"), "logprobs": 0}
            rendered = {"token_ids": ids, "sampling_params": params, "model": body["model"]}
            return tt.Response(200, [], json.dumps(rendered).encode())
        if path != "inference/v1/generate":
            return tt.Response(404, [], b'{"detail": "Not Found"}')
        if "token_ids" not in body:  # what an empty request gets: a validation error
            return tt.Response(400, [], b'{"error": {"message": "token_ids: Field required"}}')
        return await self._generate(body)

    async def _generate(self, body: dict[str, Any]) -> tt.Response:
        prompt = list(body["token_ids"])
        limit = body["sampling_params"].get("max_tokens") or 60
        out: list[int] = []
        spans: list[dict[str, Any]] = []
        state = {"abort": False}
        self.live.append(state)
        finish = "length"
        try:
            while len(out) < limit:
                while not self.running and not state["abort"]:
                    await self.changed.wait()
                if state["abort"]:
                    finish = "abort"
                    break
                await trio.sleep(0.01)
                if state["abort"]:
                    finish = "abort"
                    break
                seq = prompt + out  # the sequence so far: a continuation goes on alike
                out.append((7 * sum(seq) + len(seq)) % 97)
                if spans and spans[-1]["version"] == self.version:
                    spans[-1]["end"] = len(out)
                else:
                    spans.append({"version": self.version, "start": len(out) - 1, "end": len(out)})
        finally:
            self.live.remove(state)
        logprobs = [{"token": f"<{t}>", "logprob": -0.5} for t in out]
        usage = {"prompt_tokens": len(prompt), "completion_tokens": len(out)}
        choice = {"index": 0, "text": "".join(f"<{t}>" for t in out), "token_ids": out,
                  "logprobs": {"content": logprobs}, "finish_reason": finish,
                  "weight_versions": spans}  # fmt: skip
        if not body.get("stream"):
            whole = {"output_mode": "text", "prompt_token_ids": prompt, "choices": [choice],
                     "usage": usage}  # fmt: skip
            return tt.Response(200, [], json.dumps(whole).encode())
        events = []  # a token a chunk, as vLLM streams them; the spans in the last
        for i, token in enumerate(out):
            last = i == len(out) - 1
            piece = {"index": 0, "text": f"<{token}>", "token_ids": [token],
                     "logprobs": {"content": [logprobs[i]]},
                     "finish_reason": finish if last else None,
                     "weight_versions": spans if last else None}  # fmt: skip
            chunk: dict[str, Any] = {"output_mode": "text", "choices": [piece]}
            if i == 0:
                chunk["prompt_token_ids"] = prompt
            events.append(chunk)
        events.append({"output_mode": "text", "choices": [], "usage": usage})
        data = b"".join(b"data: %s\n\n" % json.dumps(e).encode() for e in events)
        return tt.Response(200, [], data + b"data: [DONE]\n\n")


STORY = [{"role": "user", "content": "tell me a story of the sea"}]


@pytest.mark.parametrize("mode", ["keep", "abort"])
async def test_governed_calls_carry_the_engine_s_own_spans_through_its_generate_endpoint(
    autojump_clock: MockClock, mode: Literal["keep", "abort"]
) -> None:
    """Where the server offers vLLM's generate endpoint (asked once), a governed call with
    token ids goes render -> generate, and its reply's spans are the engine's own: a whole
    (not streamed) call held by `keep` is split where the engine held it, which the gate
    cannot see; one cut by `abort` continues through generate from its prompt plus its ids,
    equal to an uncut call."""
    engine = ScaleOut()
    http = tt.HTTPClient(handler=engine.handle)
    sampling = tt.Sampling(max_tokens=100, temperature=0, return_tokens=True)
    async with tt.OpenAIClient("http://vllm.invalid/v1", http_client=http) as client:
        uncut = await client.chat_with_versions(STORY, model="m", sampling=sampling)
        assert uncut.versions == [tt.VersionSpan("0", 0, 100)]
        policy = tt.Policy(0, engines=[engine])
        ctx = tt.ModelContext(client, "m", sampling, policy=policy)
        got: list[tt.Completion] = []

        async def call() -> None:
            got.append(await ctx.chat(STORY))

        async with trio.open_nursery() as nursery:
            for _ in range(4):
                nursery.start_soon(call)
            await trio.sleep(0.405)  # 40 tokens made
            await policy.update(1, mode=mode)
    assert engine.paths.count("inference/v1/generate") == 1 + 1 + 4 + (4 if mode == "abort" else 0)
    assert engine.paths.count("v1/chat/completions") == 0  # (the probe, then generate only)
    assert len(got) == 4
    for reply in got:
        assert reply.tokens is not None
        assert uncut.tokens is not None
        assert reply.tokens.completion_ids == uncut.tokens.completion_ids
        assert reply.tokens.prompt_ids == uncut.tokens.prompt_ids
        assert reply.content == uncut.content
        assert reply.finish_reason == "length"
        assert [(s.version, s.start, s.end) for s in reply.versions] == [
            ("0", 0, 40),
            ("1", 40, 100),
        ]
    assert (policy.cut, policy.continued) == ((4, 4) if mode == "abort" else (0, 0))
    assert policy.discarded_tokens == policy.restarted == 0


async def test_a_streamed_generate_reply_equals_the_whole_one(autojump_clock: MockClock) -> None:
    engine = ScaleOut()
    http = tt.HTTPClient(handler=engine.handle)
    sampling = tt.Sampling(max_tokens=30, return_tokens=True)
    async with tt.OpenAIClient("http://vllm.invalid/v1", http_client=http) as client:
        whole = await client.chat_with_versions(STORY, model="m", sampling=sampling)
        streamed = await client.chat_with_versions(
            STORY, model="m", sampling=attrs.evolve(sampling, stream=True)
        )
        with pytest.raises(tt.ModelHTTPError) as caught:  # tools: the chat path (vLLM's
            await client.chat_with_versions(  # tool parser runs there), which it lacks
                STORY, model="m", sampling=sampling, tools=[{"type": "function"}]
            )
    assert caught.value.status == 404
    assert engine.paths[-1] == "v1/chat/completions"
    assert streamed.ttft is not None
    assert attrs.evolve(streamed, ttft=None, tpot=None) == whole
    assert whole.versions == [tt.VersionSpan("0", 0, 30)]
    assert whole.tokens is not None
    assert len(whole.tokens.completion_logprobs) == 30


async def test_the_generate_endpoint_is_asked_for_once_and_a_server_without_it_gets_chat(
    autojump_clock: MockClock,
) -> None:
    paths: list[str] = []

    def answer(request: tt.Request) -> tt.Response:
        paths.append(request.url.split("/", 3)[3])
        if not request.url.endswith("/v1/chat/completions"):
            return tt.Response(404, [], b'{"detail": "Not Found"}')
        body = {"choices": [{"message": {"role": "assistant", "content": "4"},
                             "finish_reason": "stop", "token_ids": [52]}],
                "prompt_token_ids": [1, 2], "usage": {"completion_tokens": 1}}  # fmt: skip
        return tt.Response(200, [], json.dumps(body).encode())

    http = tt.HTTPClient(handler=answer)
    async with tt.OpenAIClient("http://engine.invalid/v1", http_client=http) as client:
        sampling = tt.Sampling(max_tokens=8, return_tokens=True)
        ctx = tt.ModelContext(client, "m", sampling, policy=tt.Policy(0))
        replies = [await ctx.chat([{"role": "user", "content": "What is 1 + 2?"}]) for _ in "abc"]
        assert not await client.offers_generate()
    assert [reply.content for reply in replies] == ["4"] * 3
    assert [reply.versions for reply in replies] == [[tt.VersionSpan("0", 0, 1)]] * 3
    assert paths == ["inference/v1/generate"] + ["v1/chat/completions"] * 3


class Slot:
    """A `CutSlot`, as the gate's calls are."""

    def __init__(self) -> None:
        self.cut = False
        self.scope: trio.CancelScope | None = None


async def test_a_request_is_cut_through_its_own_cancel_scope(autojump_clock: MockClock) -> None:
    """The transport hands a request's own cancel scope to the caller's `CUT_SLOT` (how the
    gate cuts an `OpenAIClient` call without a cancel scope of its own): cancelling it ends
    the request with `RequestCut`, keeping what had streamed; a request begun once the slot
    is cut never goes out."""
    words = " ".join(["word"] * 100)
    body = json.dumps({"model": "sim", "stream": True,
                       "messages": [{"role": "user", "content": "talk"}]}).encode()  # fmt: skip
    headers = {"Content-Type": "application/json"}
    async with (
        ChatServer(token_delay=0.01, answer=lambda question: words) as server,
        tt.HTTPClient() as http,
    ):
        url = server.url + "/chat/completions"
        slot = Slot()
        pieces: list[bytes] = []
        caught: list[RequestCut] = []

        async def request() -> None:
            token = CUT_SLOT.set(slot)
            try:
                await http.request("POST", url, headers=headers, body=body, on_body=pieces.append)
            except RequestCut as exc:
                caught.append(exc)
            finally:
                CUT_SLOT.reset(token)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(request)
            await trio.sleep(0.5)  # about half the words have come
            assert slot.scope is not None
            slot.cut = True
            slot.scope.cancel()
        assert [str(exc) for exc in caught] == [f"{url}: cut by its caller"]
        assert slot.scope is None
        assert 10 < b"".join(pieces).count(b"word") < 90
        sent = len(server.requests)
        token = CUT_SLOT.set(slot)
        try:
            with pytest.raises(RequestCut):
                await http.request("POST", url, headers=headers, body=body)
        finally:
            CUT_SLOT.reset(token)
        assert len(server.requests) == sent


async def test_without_engines_abort_cuts_an_openai_call_through_its_request(
    autojump_clock: MockClock,
) -> None:
    """No engine to end the request: the gate cuts it through the request's own cancel
    scope (it has none of its own for an `OpenAIClient`); a whole reply brought nothing, so
    the call starts over under the new version, and says so."""
    engine = ScaleOut()
    http = tt.HTTPClient(handler=engine.handle)
    sampling = tt.Sampling(max_tokens=100, return_tokens=True)
    async with tt.OpenAIClient("http://vllm.invalid/v1", http_client=http) as client:
        policy = tt.Policy(0)
        ctx = tt.ModelContext(client, "m", sampling, policy=policy)
        got: list[tt.Completion] = []

        async def call() -> None:
            got.append(await ctx.chat(STORY))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(call)
            await trio.sleep(0.5)
            began = trio.current_time()
            await engine.set_version("1")  # (what a trainer's load would do)
            await policy.update(1, mode="abort")
            assert trio.current_time() == began  # cut at once
    [reply] = got
    assert (policy.cut, policy.restarted, policy.discarded_tokens) == (0, 1, 0)
    assert reply.versions == [tt.VersionSpan("1", 0, 100)]
    assert engine.live == []
