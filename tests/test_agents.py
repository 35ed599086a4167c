"""Agents (SPEC 9): whole replies, `tt.ToolEnv`, and tool calls on every path a reply travels.

Real parts: the fake OpenAI server (`tests/fixtures/chat_server.py`, tools mode: parallel
`add` calls in the OpenAI format) behind `tt.OpenAIClient`, the CLI in a subprocess, served
env servers (`--serve`), Redis workers (`--via`), a real /bin/sh for the shell tool. The
loop's own cases (each tool failure, each limit, timeouts, cancellation) run on
`ScriptedClient` and trio's MockClock.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import forkserver
import pytest
import trio
from trio.testing import MockClock

import trio_tasksets as tt
from trio_tasksets.testing import ScriptedClient, reply

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"
sys.path.insert(0, str(FIXTURES))

from calc_env import CalcEnv, Sums  # noqa: E402
from chat_server import ChatServer, Reply  # noqa: E402
from helpers import marked, needs, which  # noqa: E402
from redis_server import RedisServer  # noqa: E402

CALC = str(FIXTURES / "calc_env.py")


class One(tt.Taskset[tt.Task, tt.TasksetConfig]):
    def load(self) -> list[tt.Task]:
        return [tt.Task("What is 2 + 3?", answer="5")]


def ctx(client: tt.ModelClient) -> tt.ModelContext:
    return tt.ModelContext(client, "m")


async def run_one(env: tt.Env[Any], client: tt.ModelClient) -> tt.Episode:
    return await env.run_slot(tt.RunSlot(next(iter(env.taskset))), ctx(client))


@tt.tool
async def add(a: int, b: int) -> int:
    """Add."""
    return a + b


# --- whole replies ------------------------------------------------------------------------


def test_a_completion_keeps_its_message_and_parses_its_tool_calls() -> None:
    plain = tt.Completion("hi")
    assert plain.message == {"role": "assistant", "content": "hi"}
    assert plain.tool_calls == []
    message = {
        "role": "assistant",
        "content": None,
        "reasoning_content": "hm",
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}},
            {"id": "c2", "type": "function", "function": {"name": "add", "arguments": "{oops"}},
            {"id": "c3", "type": "function", "function": {"name": "add", "arguments": {"a": 2}}},
            "junk",
        ],
    }
    calls = tt.Completion("", message=message).tool_calls
    assert [(c.id, c.name, c.arguments) for c in calls] == [
        ("c1", "add", {"a": 1}),
        ("c2", "add", {}),
        ("c3", "add", {"a": 2}),
    ]
    assert calls[0].arguments_error is None
    assert calls[1].raw_arguments == "{oops"
    assert "not valid JSON" in (calls[1].arguments_error or "")
    assert calls[2].raw_arguments == '{"a": 2}'
    assert tt.ToolCall("x", "f", {}, "[1]").arguments_error == (
        "the arguments must be a JSON object, got list"
    )


async def test_openai_client_returns_the_whole_reply_and_sends_the_tools() -> None:
    with ChatServer(tools=True, parallel_calls=3) as server:
        async with tt.OpenAIClient(server.url, max_retries=0) as client:
            context = ctx(client)
            first = await context.chat(
                [{"role": "user", "content": "What is 2 + 3?"}],
                tools=[add.schema],
                temperature=0.5,
                tool_choice="auto",
            )
    assert server.requests[0]["tools"] == [add.schema]
    assert server.requests[0]["temperature"] == 0.5
    assert server.requests[0]["tool_choice"] == "auto"
    assert first.content == ""
    assert first.message["content"] is None
    assert first.message["reasoning_content"] == "I will call add."  # unknown fields kept
    assert first.finish_reason == "tool_calls"
    assert [(c.id, c.name, c.arguments) for c in first.tool_calls] == [
        ("call_0_0", "add", {"a": 2, "b": 3}),
        ("call_0_1", "add", {"a": 3, "b": 2}),
        ("call_0_2", "add", {"a": 2, "b": 3}),
    ]


async def test_a_client_without_tools_gets_a_clear_error() -> None:
    class Old:
        async def chat(
            self, messages: list[dict[str, Any]], *, model: str, sampling: tt.Sampling
        ) -> tt.Completion:
            return tt.Completion("x")

        async def aclose(self) -> None:
            pass

    with pytest.raises(TypeError, match="takes no `tools`"):
        await tt.ModelContext(Old(), "m").chat([], tools=[add.schema])
    assert (await tt.ModelContext(Old(), "m").chat([])).content == "x"


async def test_sampling_overrides_are_per_call() -> None:
    client = ScriptedClient("ok")
    context = tt.ModelContext(client, "m", tt.Sampling(temperature=1.0, extra={"stop": ["x"]}))
    await context.chat([], temperature=0.0, seed=3, logprobs=True)
    await context.chat([])
    assert client.calls[0].sampling == tt.Sampling(
        temperature=0.0, seed=3, extra={"stop": ["x"], "logprobs": True}
    )
    assert client.calls[1].sampling == context.sampling


# --- ScriptedClient -------------------------------------------------------------------------


async def test_scripted_client_answers_in_order_and_records_every_call() -> None:
    async def later(messages: list[dict[str, Any]], tools: Any) -> str:
        await trio.lowlevel.checkpoint()
        return f"saw {len(messages)} messages and {len(tools or [])} tools"

    client = ScriptedClient(["one", {"content": "two", "refusal": None}, later])
    assert (
        await client.chat([{"role": "user", "content": "a"}], model="m", sampling=tt.Sampling())
    ).content == "one"
    second = await client.chat([], model="m", sampling=tt.Sampling(), tools=[add.schema])
    assert second.message == {"role": "assistant", "content": "two", "refusal": None}
    third = await client.chat([{}, {}], model="m", sampling=tt.Sampling(), tools=[{}])
    assert third.content == "saw 2 messages and 1 tools"
    assert [c.messages for c in client.calls] == [[{"role": "user", "content": "a"}], [], [{}, {}]]
    assert client.calls[1].tools == [add.schema]
    with pytest.raises(tt.testing.ScriptExhausted, match="the script has 3 replies"):
        await client.chat([], model="m", sampling=tt.Sampling())


# --- the loop -------------------------------------------------------------------------------


async def test_the_tool_loop_answers_every_call_in_order() -> None:
    client = ScriptedClient(
        [
            reply(tool_calls=[("add", {"a": 2, "b": 3}), ("add", {"a": 3, "b": 2})]),
            reply("it is 5"),
        ]
    )
    episode = await run_one(tt.ToolEnv(One(), [add]), client)
    assert episode.ok, episode.errors
    assert (episode.reward, episode.turns, episode.tool_calls, episode.stop_reason) == (
        1.0, 2, 2, None
    )  # fmt: skip
    roles = [(m["role"], m.get("tool_call_id")) for m in episode.messages]
    assert roles == [
        ("user", None), ("assistant", None), ("tool", "call_0"), ("tool", "call_1"),
        ("assistant", None),
    ]  # fmt: skip
    assert [m["content"] for m in episode.messages[2:4]] == ["5", "5"]
    # the second turn sent the whole conversation, and the schemas every turn
    assert client.calls[1].messages == episode.messages[:4]
    assert client.calls[0].tools == client.calls[1].tools == [add.schema]


async def test_every_kind_of_tool_failure_answers_the_model_and_the_episode_goes_on(
    autojump_clock: MockClock,
) -> None:
    hung = trio.Event()

    @tt.tool
    async def boom(x: int) -> int:
        """Fails."""
        raise RuntimeError(f"no {x}")

    @tt.tool
    async def hang() -> str:
        """Never answers."""
        try:
            await trio.sleep_forever()
        finally:
            hung.set()  # cancelled at tool_timeout

    client = ScriptedClient(
        [
            reply(
                tool_calls=[
                    ("boom", {"x": 1}),
                    ("nope", {}),
                    ("add", '{"a": 1,'),
                    ("add", {"a": "one", "b": 2}),
                    ("add", {"a": 1}),
                    ("hang", {}),
                    ("add", {"a": 1, "b": 1}),
                ]
            ),
            reply("done"),
        ]
    )
    env = tt.ToolEnv(One(), [add, boom, hang], tool_timeout=5)
    start = trio.current_time()
    episode = await run_one(env, client)
    assert trio.current_time() - start == 5  # the calls ran concurrently; the hang was cut
    assert hung.is_set()
    assert episode.ok
    assert episode.errors == []
    answers = [m["content"] for m in episode.messages if m["role"] == "tool"]
    assert answers == [
        "Error: boom raised RuntimeError: no 1",
        "Error: there is no tool named 'nope' (the tools: add, boom, hang)",
        answers[2],
        "Error: add: a: expected an integer, got string 'one'",
        "Error: add: missing argument 'b'",
        "Error: hang timed out after 5s and was cancelled",
        "2",
    ]
    assert answers[2].startswith("Error: add: the arguments are not valid JSON")
    assert episode.tool_calls == 7
    assert episode.turns == 2


async def test_max_turns_ends_the_rollout_normally_and_it_is_scored() -> None:
    client = ScriptedClient(
        lambda messages, tools: reply("5?", tool_calls=[("add", {"a": 2, "b": 3})])
    )
    episode = await run_one(tt.ToolEnv(One(), [add], max_turns=3), client)
    assert episode.ok
    assert (episode.turns, episode.tool_calls, episode.stop_reason) == (3, 3, "max_turns")
    assert episode.reward == 1.0  # scored: "5?" holds the answer
    assert episode.messages[-1]["role"] == "tool"  # every call is answered
    assert len(client.calls) == 3


async def test_token_limit_sums_the_usage_of_the_rollout() -> None:
    step = reply(
        "",
        tool_calls=[("add", {"a": 1, "b": 1})],
        usage={"prompt_tokens": 30, "completion_tokens": 5},
    )
    client = ScriptedClient([step, step, step, reply("never")])
    episode = await run_one(tt.ToolEnv(One(), [add], token_limit=70), client)
    assert (episode.turns, episode.stop_reason, episode.reward) == (2, "token_limit", 0.0)
    assert episode.usage == {"prompt_tokens": 60, "completion_tokens": 10}
    assert episode.ok


async def test_the_limits_are_checked() -> None:
    cases: list[tuple[dict[str, Any], str]] = [
        ({"max_turns": 0}, "max_turns"),
        ({"max_turns": None}, "max_turns"),
        ({"token_limit": 0}, "token_limit"),
        ({"tool_timeout": -1}, "tool_timeout"),
        ({"max_answer_bytes": 0}, "max_answer_bytes"),
        ({"max_conversation_bytes": 1.5}, "max_conversation_bytes"),
    ]
    for kwargs, flag in cases:
        with pytest.raises(ValueError, match=flag):
            tt.ToolEnv(One(), [add], **kwargs)
    with pytest.raises(ValueError, match="two tools are named 'add'"):
        tt.ToolEnv(One(), [add, add])


@tt.tool
def echo(x: Any) -> Any:
    """Answers with its argument."""
    return x


async def test_deeply_nested_arguments_are_an_error_text_never_a_failed_episode() -> None:
    """F6 (issue 36): 100,000 levels of nesting (past the JSON decoder's own recursion bound)
    or 101 (past the bound, `MAX_ARGUMENT_DEPTH`), as text or as an object, over HTTP."""

    def nested(depth: int) -> str:
        return '{"x": ' + "[" * (depth - 1) + "]" * (depth - 1) + "}"

    calls = [
        {
            "id": "deep",
            "type": "function",
            "function": {"name": "echo", "arguments": nested(10**5)},
        },
        {"id": "over", "type": "function", "function": {"name": "echo", "arguments": nested(101)}},
        {"id": "edge", "type": "function", "function": {"name": "echo", "arguments": nested(100)}},
        {
            "id": "object",  # arguments sent as an object, as some servers do
            "type": "function",
            "function": {"name": "echo", "arguments": json.loads(nested(101))},
        },
        {
            # deeper than the request's encoder takes (orjson: 254 levels), shallower than
            # the reply's decoder (1,024): kept as sent, the next request could not be sent
            "id": "deeper",
            "type": "function",
            "function": {"name": "echo", "arguments": json.loads(nested(600))},
        },
    ]
    message = {"role": "assistant", "content": None, "tool_calls": calls}
    body = {"choices": [{"message": message, "finish_reason": "tool_calls"}], "usage": {}}
    with ChatServer() as server:
        server.script(Reply(body=body))
        async with tt.OpenAIClient(server.url, max_retries=0) as client:
            episode = await run_one(tt.ToolEnv(One(), [echo]), client)
    assert (episode.ok, episode.errors, episode.attempts, episode.turns) == (True, [], 1, 2)
    answers = {m["tool_call_id"]: m["content"] for m in episode.messages if m["role"] == "tool"}
    too_deep = "Error: echo: the arguments nest more than 100 levels deep: "
    for name in ("deep", "over", "object", "deeper"):
        assert answers[name].startswith(too_deep), answers[name][:100]
    assert answers["edge"] == "[" * 99 + "]" * 99  # 100 levels: decoded, the tool ran
    assert len(server.requests) == 2  # the second turn went out: no retry of the episode
    # the assistant message went back with its calls' arguments as text (OpenAI's form)
    (sent,) = [m for m in server.requests[1]["messages"] if m["role"] == "assistant"]
    assert all(isinstance(c["function"]["arguments"], str) for c in sent["tool_calls"])


async def test_a_tool_answer_utf8_cannot_hold_reaches_the_model_escaped() -> None:
    """F6 (issue 36): a lone surrogate in a tool's answer (or its error) never fails the
    encoding of the next request."""

    @tt.tool
    async def add(a: int, b: int) -> str:
        """Adds, with a stray half of a surrogate pair."""
        if a > b:
            raise ValueError("no \udc80 here")
        return f"{a + b} \ud800"

    with ChatServer(tools=True, parallel_calls=2) as server:
        async with tt.OpenAIClient(server.url, max_retries=0) as client:
            episode = await run_one(tt.ToolEnv(One(), [add]), client)
    assert (episode.ok, episode.errors, episode.attempts) == (True, [], 1)
    sent = [m["content"] for m in server.requests[1]["messages"] if m["role"] == "tool"]
    assert sent == ["5 \\ud800", "Error: add raised ValueError: no \\udc80 here"]


async def test_a_tool_answer_json_cannot_hold_is_an_error_text() -> None:
    """F6 (issue 36): a result that cannot become text (circular, nested past what the JSON
    encoder takes) answers the model with an error text; the episode goes on."""
    circular: list[Any] = []
    circular.append(circular)
    deep: list[Any] = []
    for _ in range(100_000):
        deep = [deep]

    @tt.tool
    def odd(which: str) -> Any:
        """A result JSON cannot hold."""
        return circular if which == "circular" else deep

    client = ScriptedClient(
        [reply(tool_calls=[("odd", {"which": "circular"}), ("odd", {"which": "deep"})]), "ok"]
    )
    episode = await run_one(tt.ToolEnv(One(), [odd]), client)
    assert (episode.ok, episode.errors) == (True, [])
    answers = [m["content"] for m in episode.messages if m["role"] == "tool"]
    assert answers == [
        "Error: odd: its answer cannot be read as text (ValueError: Circular reference detected)",
        answers[1],
    ]
    assert answers[1].startswith("Error: odd: its answer cannot be read as text (RecursionError")


async def test_a_tool_answer_is_cut_above_max_answer_bytes_saying_so() -> None:
    """F13 (issue 36): one tool answer is bounded (1 MiB by default), at a character's
    boundary, and the model reads that it was cut."""

    @tt.tool
    def big(n: int) -> str:
        """n bytes of answer (two-byte characters)."""
        return "é" * (n // 2)

    client = ScriptedClient([reply(tool_calls=[("big", {"n": 3 << 20}), ("big", {"n": 8})]), "ok"])
    episode = await run_one(tt.ToolEnv(One(), [big]), client)
    cut, whole = [m["content"] for m in episode.messages if m["role"] == "tool"]
    assert whole == "éééé"
    kept, note = cut.rsplit("\n", 1)
    assert kept == "é" * (1 << 19)  # 1 MiB exactly: 524,288 two-byte characters
    assert note == (
        "[cut: the answer has 3,145,728 bytes; the first 1,048,576 are shown (max_answer_bytes)]"
    )
    client = ScriptedClient([reply(tool_calls=[("big", {"n": 7})]), "ok"])
    episode = await run_one(tt.ToolEnv(One(), [big], max_answer_bytes=5), client)
    assert episode.messages[2]["content"] == (
        "éé\n[cut: the answer has 6 bytes; the first 5 are shown (max_answer_bytes)]"
    )  # (the third character would straddle the cut: dropped whole)
    client = ScriptedClient([reply(tool_calls=[("big", {"n": 3 << 20})]), "ok"])
    episode = await run_one(tt.ToolEnv(One(), [big], max_answer_bytes=None), client)
    assert len(episode.messages[2]["content"]) == 3 << 19  # no bound: the whole answer


async def test_the_conversation_is_bounded_by_max_conversation_bytes() -> None:
    """F13 (issue 36): two 50 MB answers made requests of 105 and 210 MB; now each answer is
    cut at 1 MiB and the rollout ends, scored, once its messages outgrow 8 MiB."""

    @tt.tool
    def big() -> str:
        """50 MB of answer."""
        return "x" * 50_000_000

    client = ScriptedClient(lambda messages, tools: reply("more", tool_calls=[("big", {})]))
    episode = await run_one(tt.ToolEnv(One(), [big], max_turns=100), client)
    assert (episode.ok, episode.stop_reason, episode.turns) == (True, "max_conversation_bytes", 8)
    sent = [len(json.dumps(call.messages)) for call in client.calls]
    assert max(sent) < 8 << 20  # no request carried more than the bound
    client = ScriptedClient(lambda messages, tools: reply("more", tool_calls=[("big", {})]))
    env = tt.ToolEnv(One(), [big], max_turns=100, max_conversation_bytes=3 << 20)
    episode = await run_one(env, client)
    assert (episode.stop_reason, episode.turns) == ("max_conversation_bytes", 3)


def test_a_tool_envs_limits_are_one_rollout_limits() -> None:
    env = tt.ToolEnv(One(), [add], max_turns=4, token_limit=100, rollout_timeout=9)
    assert env.rollout_limits == tt.RolloutLimits(rollout_timeout=9.0, max_turns=4, token_limit=100)
    assert (env.max_turns, env.token_limit, env.tool_timeout) == (4, 100, None)
    assert tt.ToolEnv(One(), [add]).rollout_limits == tt.RolloutLimits(max_turns=10)
    given = tt.RolloutLimits(token_limit=50, stall_timeout=5)
    whole = tt.ToolEnv(One(), [add], rollout_limits=given)
    assert whole.rollout_limits == tt.RolloutLimits(stall_timeout=5, max_turns=10, token_limit=50)
    for twice in ({"max_turns": 3}, {"tool_timeout": 1.0}, {"working_limit": 2.0}):
        with pytest.raises(tt.ConfigError, match="given") as raised:
            tt.ToolEnv(One(), [add], rollout_limits=given, **twice)
        assert raised.value.parameter == "rollout_limits"
    env.max_turns = 2  # each limit is an attribute too
    assert env.rollout_limits.max_turns == 2
    with pytest.raises(tt.ConfigError, match="max_turns"):
        env.max_turns = 0


async def test_a_slots_own_limits_tighten_the_tool_loops() -> None:
    client = ScriptedClient(
        lambda messages, tools: reply("5?", tool_calls=[("add", {"a": 2, "b": 3})])
    )
    env = tt.ToolEnv(One(), [add], max_turns=5)
    slot = tt.RunSlot(tt.Task("2+3?", answer="5"), limits=tt.RolloutLimits(max_turns=2))
    episode = await env.run_slot(slot, ctx(client))
    assert (episode.turns, episode.stop_reason) == (2, "max_turns")
    loose = tt.RunSlot(tt.Task("2+3?", answer="5"), limits=tt.RolloutLimits(max_turns=50))
    assert (await env.run_slot(loose, ctx(client))).turns == 5  # never loosened


async def test_tool_calls_run_on_the_evals_window(autojump_clock: MockClock) -> None:
    """-c bounds the tools too: 3 rollouts of 4 parallel calls each, window 2."""
    working = peak = 0

    @tt.tool
    async def slow() -> str:
        """Slow."""
        nonlocal working, peak
        working += 1
        peak = max(peak, working)
        await trio.sleep(1)
        working -= 1
        return "ok"

    def script(messages: list[dict[str, Any]], tools: Any) -> tt.Completion:
        if messages[-1]["role"] == "tool":
            return reply("5")
        return reply(tool_calls=[("slow", {})] * 4)

    env = tt.ToolEnv(One(), [slow])
    task = next(iter(One()))

    async def slots() -> Any:
        for rollout in range(3):
            yield tt.RunSlot(task, rollout)

    episodes = await tt.run_stream(
        slots(), lambda s: env.run_slot(s, ctx(ScriptedClient(script))), window=2
    )
    assert all(e.ok and e.tool_calls == 4 for e in episodes)
    assert peak == 2
    assert trio.current_time() == 6  # 12 calls, 2 at a time


async def test_finished_tool_calls_are_progress_for_the_stall_timeout(
    autojump_clock: MockClock,
) -> None:
    # One turn asks for three 3 s tool calls; at window 1 they run one after the other, so
    # 9 s pass between the two model replies while a tool call finishes every 3 s: a 5 s
    # stall timeout must not fire.
    @tt.tool
    async def slow() -> str:
        """Think for 3 s."""
        await trio.sleep(3)
        return "done"

    script = [reply(tool_calls=[("slow", {})] * 3), reply("5")]
    env = tt.ToolEnv(One(), [slow], stall_timeout=5)

    async def slots() -> Any:
        yield tt.RunSlot(next(iter(env.taskset)))

    [episode] = await tt.run_stream(
        slots(), lambda s: env.run_slot(s, ctx(ScriptedClient(script))), window=1
    )
    assert episode.ok, episode.errors
    assert episode.tool_calls == 3


async def test_a_cancelled_eval_cancels_the_tool_and_leaves_no_row(
    autojump_clock: MockClock, tmp_path: Path
) -> None:
    cancelled = trio.Event()

    @tt.tool
    async def wait() -> str:
        """Waits."""
        try:
            await trio.sleep(100)
        except trio.Cancelled:
            cancelled.set()
            raise
        return "late"

    env = tt.ToolEnv(One(), [wait])
    client = ScriptedClient([reply(tool_calls=[("wait", {})]), reply("5")])
    config = tt.EvalConfig(dashboard=False, output_dir=str(tmp_path), run_name="c")
    with trio.move_on_after(10):
        await tt.run_eval(env, ctx(client), config)
    assert cancelled.is_set()
    assert len(client.calls) == 1
    traces = tmp_path / "c" / "traces.jsonl"
    assert not traces.exists() or traces.read_text() == ""


@pytest.mark.skipif(sys.platform == "win32", reason="process groups are POSIX")
async def test_a_cancelled_eval_mid_shell_leaves_no_process(tmp_path: Path) -> None:
    shell = tt.tools.shell(cwd=tmp_path, timeout=60, grace=0.2)
    script = "trap '' TERM; sleep 60.7301 & echo started > child; wait"
    client = ScriptedClient([reply(tool_calls=[("shell", {"command": script})]), reply("5")])
    env = tt.ToolEnv(One(), [shell])
    config = tt.EvalConfig(dashboard=False, output_dir=str(tmp_path), run_name="s")
    with trio.move_on_after(1.0):
        await tt.run_eval(env, ctx(client), config)
    assert (tmp_path / "child").read_text() == "started\n"
    with trio.fail_after(5):
        while marked("60.7301"):  # noqa: ASYNC110 (a process's state: no event to wait on)
            await trio.sleep(0.01)


# --- a calculator solved in two turns, on every path ----------------------------------------


def comparable(rows: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    """What must agree between paths: each row's task, messages, reward and counts."""
    return sorted(
        (r["task"]["key"], r["rollout"], r["ok"], r["reward"], json.dumps(r["messages"]),
         r["turns"], r["tool_calls"], r["stop_reason"])
        for r in rows
    )  # fmt: skip


def check_calculator_rows(rows: list[dict[str, Any]], n: int) -> None:
    assert len(rows) == n
    for row in rows:
        assert row["ok"], row
        assert row["reward"] == 1.0, row
        assert (row["turns"], row["tool_calls"], row["stop_reason"]) == (2, 2, None)
        _user, asked, first, second, final = row["messages"]
        ids = [call["id"] for call in asked["tool_calls"]]
        assert ids == ["call_0_0", "call_0_1"]
        assert [first["tool_call_id"], second["tool_call_id"]] == ids
        assert (
            first["content"]
            == second["content"]
            == final["content"]
            == row["task"]["data"]["answer"]
        )
        assert asked["reasoning_content"] == "I will call add."


async def test_the_calculator_through_python(tmp_path: Path) -> None:
    with ChatServer(tools=True) as server:
        async with tt.OpenAIClient(server.url, max_retries=0) as client:
            config = tt.EvalConfig(
                num_examples=3, dashboard=False, output_dir=str(tmp_path), run_name="py"
            )
            result = await tt.run_eval(CalcEnv(Sums()), ctx(client), config)
    rows = [json.loads(line) for line in (result.run_dir / "traces.jsonl").read_text().splitlines()]
    check_calculator_rows(rows, 3)
    assert len(server.requests) == 6  # two turns each
    assert all(body["tools"][0]["function"]["name"] == "add" for body in server.requests)
    # resume reads them back whole
    episodes = [tt.Episode.from_row(row) for row in rows]
    assert [e.to_row() for e in episodes] == rows


def cli(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return forkserver.run(
        [sys.executable, "-m", "trio_tasksets", *args],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip


def trace(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "traces.jsonl").read_text().splitlines()]


def test_the_calculator_through_the_cli_in_process_and_served(tmp_path: Path) -> None:
    with ChatServer(tools=True) as server:
        base = [
            "eval", f"{CALC}:Sums", "--env-class", f"{CALC}:CalcEnv", "-m", "m",
            "--base-url", server.url, "-n", "4", "-o", str(tmp_path), "--no-dashboard",
        ]  # fmt: skip
        local = cli(tmp_path, *base, "--run-name", "local")
        assert local.returncode == 0, local.stderr
        served = cli(tmp_path, *base, "--run-name", "served", "--serve")
        assert served.returncode == 0, served.stderr
        # tasks that hold a tool round already: the calls travel in the request too
        base[1] = f"{CALC}:Continued"
        continued = cli(tmp_path, *base, "--run-name", "continued", "--serve")
        assert continued.returncode == 0, continued.stderr
    rows = trace(tmp_path / "local")
    check_calculator_rows(rows, 4)
    assert comparable(trace(tmp_path / "served")) == comparable(rows)
    for row in trace(tmp_path / "continued"):
        assert (row["ok"], row["reward"], row["turns"], row["tool_calls"]) == (True, 1.0, 1, 0)
        assert row["messages"][1]["tool_calls"][0]["id"] == "call_0_0"
        assert row["messages"][2]["tool_call_id"] == "call_0_0"
        assert row["messages"][3]["content"] == row["task"]["data"]["answer"]


@pytest.mark.parametrize("where", ["in process", "--serve"])
def test_a_fan_out_env_keeps_c_model_calls_in_flight(tmp_path: Path, where: str) -> None:
    """Best-of-4 over 6 tasks at -c 3: 3 model calls at once at the server, not 12, also
    when the rollouts run in an env server (each call takes 0.15 s: calls overlap)."""
    with ChatServer(delay=0.15) as server:
        done = cli(
            tmp_path, "eval", f"{CALC}:Sums", "--env-class", f"{CALC}:BestOf4", "-m", "m",
            "--base-url", server.url, "-c", "3", "-o", str(tmp_path), "--no-dashboard",
            "--run-name", "b", *(["--serve"] if where == "--serve" else []),
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert len(server.requests) == 24
        assert server.peak == 3


def test_the_calculator_via_redis_workers_gives_the_same_rows(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    redis_url = redis_server.url  # the session's: streams of this test's own
    tag = uuid.uuid4().hex[:8]
    tasks, more = f"{tag}:tasks", f"{tag}:more"
    with ChatServer(tools=True) as server:
        model = ["-m", "m", "--base-url", server.url]
        log = (tmp_path / "worker.log").open("wb")

        def worker(taskset: str, stream: str) -> subprocess.Popen[bytes]:
            return forkserver.popen(
                [sys.executable, "-m", "trio_tasksets", "worker", f"{CALC}:{taskset}",
                 "--env-class", f"{CALC}:CalcEnv", "--feed", redis_url, "--stream", stream,
                 "--group", "g", "--results", f"{stream}:results", "--no-dashboard", *model],
                stdout=subprocess.DEVNULL, stderr=log,
            )  # fmt: skip

        def via(taskset: str, stream: str, name: str) -> subprocess.CompletedProcess[str]:
            return cli(
                tmp_path, "eval", f"{CALC}:{taskset}", "--env-class", f"{CALC}:CalcEnv",
                *model, "-n", "3", "-o", str(tmp_path), "--no-dashboard", "--run-name", name,
                "--via", redis_url, "--stream", stream,
            )  # fmt: skip

        workers = [worker("Sums", tasks), worker("Continued", more)]
        try:
            done = via("Sums", tasks, "via")
            assert done.returncode == 0, done.stderr + (tmp_path / "worker.log").read_text()
            continued = via("Continued", more, "continued")
            assert continued.returncode == 0, continued.stderr
            local = cli(
                tmp_path, "eval", f"{CALC}:Sums", "--env-class", f"{CALC}:CalcEnv", *model,
                "-n", "3", "-o", str(tmp_path), "--no-dashboard", "--run-name", "local",
            )  # fmt: skip
            assert local.returncode == 0, local.stderr
        finally:
            for process in workers:
                process.terminate()
                process.wait(timeout=30)
            log.close()
    rows = trace(tmp_path / "via")
    check_calculator_rows(rows, 3)
    assert comparable(rows) == comparable(trace(tmp_path / "local"))
    # the tool round in the tasks' own messages went to the worker and back
    for row in trace(tmp_path / "continued"):
        assert (row["ok"], row["reward"], row["turns"]) == (True, 1.0, 1)
        assert row["messages"][2] == {"role": "tool", "tool_call_id": "call_0_0",
                                      "content": row["task"]["data"]["answer"]}  # fmt: skip


# --- the report -------------------------------------------------------------------------------


def test_the_report_shows_tool_calls_with_their_arguments_and_answers(tmp_path: Path) -> None:
    from trio_tasksets._report.data import run_from_rows

    row = tt.Episode(
        "e", tt.EpisodeTask("k", {"prompt": "p"}), 0, ok=True, reward=1.0, completion="5",
        messages=[
            {"role": "user", "content": "p"},
            reply(tool_calls=[("add", {"a": 2, "b": 3})]).message,
            {"role": "tool", "tool_call_id": "call_0", "content": "5"},
            {"role": "assistant", "content": "5", "tool_calls": None},
        ],
        turns=2, tool_calls=1, stop_reason="max_turns",
    ).to_row()  # fmt: skip
    run = run_from_rows([row])
    assert run.turns == [2]
    assert run.tool_calls == [1]
    assert run.strings[run.stop_reason[0]] == "max_turns"
    assert run.extra == {}  # no field left over
    messages = run.messages[0]
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == '{"a": 2, "b": 3}'
    assert messages[2] == {"role": "tool", "tool_call_id": "call_0", "content": "5"}
    assert isinstance(messages[3], list)  # an empty tool_calls field: shown as the plain pair
    html = tt.report(_run_dir(tmp_path, [row])).read_text()
    assert "tool call ${call && call.id}" in html  # the renderer of tool calls is on the page


def _run_dir(tmp_path: Path, rows: list[dict[str, Any]]) -> Path:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "traces.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run_dir


CHROMIUM = which("chromium")
CHROMEDRIVER = which("chromedriver")


@needs("chromium", "chromedriver", why="the report in a real browser")
async def test_in_chromium_an_expanded_row_shows_the_tool_calls(tmp_path: Path) -> None:
    assert CHROMIUM is not None
    assert CHROMEDRIVER is not None
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By

    client = ScriptedClient([reply(tool_calls=[("add", {"a": 2, "b": 3})]), reply("it is 5")])
    config = tt.EvalConfig(dashboard=False, output_dir=str(tmp_path), run_name="r")
    result = await tt.run_eval(tt.ToolEnv(One(), [add]), ctx(client), config)
    page = tt.report(result.run_dir).resolve().as_uri()
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                 f"--user-data-dir={tmp_path / 'profile'}"):  # fmt: skip
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = await trio.to_thread.run_sync(
        lambda: webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    )
    try:

        def look() -> tuple[str, list[Any]]:
            driver.get(page)
            driver.find_element(By.CSS_SELECTOR, "#table tbody tr.main button.expand").click()
            detail = driver.find_element(By.CSS_SELECTOR, "#table tr.detail")
            return detail.text, driver.get_log("browser")  # type: ignore[no-untyped-call]

        text, log = await trio.to_thread.run_sync(look)
    finally:
        await trio.to_thread.run_sync(driver.quit)
    assert [e for e in log if e["level"] == "SEVERE"] == []
    assert "tool call call_0: add" in text
    assert '"a": 2,\n  "b": 3' in text  # the arguments, as JSON
    assert "tool · answers call_0\n5" in text
    assert "turns\n2" in text
    assert "tool calls\n1" in text
