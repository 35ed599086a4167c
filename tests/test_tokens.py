"""Token ids and logprobs for training (SPEC 10): `Sampling(return_tokens=True)` asks an
OpenAI-compatible server for them as vLLM takes it, `Completion.tokens` carries them, and the
rows keep one entry per model call of the rollout.

The HTTP tests talk to the real test server (`tests/fixtures/chat_server.py` with
``tokens=True``: vLLM's `prompt_token_ids`, `choices[0].token_ids` and
`choices[0].logprobs.content[].logprob`) on 127.0.0.1.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import forkserver
import pytest
import trio

import trio_tasksets as tt
from trio_tasksets._models import Completion, ModelContext, OpenAIClient, Sampling, Tokens

FIXTURES = Path(__file__).resolve().parent / "fixtures"
if str(FIXTURES) not in sys.path:
    sys.path.insert(0, str(FIXTURES))

from chat_server import ChatServer, logprobs_of, prompt_text, token_ids_of  # noqa: E402


def test_return_tokens_asks_for_token_ids_and_logprobs() -> None:
    assert Sampling().to_request() == {}
    asked = Sampling(temperature=0.0, return_tokens=True).to_request()
    assert asked == {"temperature": 0.0, "return_token_ids": True, "logprobs": True}
    # extra is merged last, as for every field
    assert Sampling(return_tokens=True, extra={"logprobs": False}).to_request()["logprobs"] is False
    with pytest.raises(TypeError):
        Sampling(return_tokens="yes")  # type: ignore[arg-type]


def test_tokens_validate_their_parts() -> None:
    tokens = Tokens([1, 2], [3, 4], [-0.5, -0.25])
    assert Tokens.from_dict(tokens.to_dict()) == tokens
    assert Tokens.from_dict({"completion_ids": [7]}) == Tokens([], [7], [])
    with pytest.raises(ValueError, match="one logprob per completion token"):
        Tokens([], [1, 2, 3], [-0.1])
    with pytest.raises(TypeError, match="prompt_ids"):
        Tokens(["a"], [], [])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="completion_logprobs"):
        Tokens([], [], ["x"])  # type: ignore[list-item]


MESSAGES = [{"role": "user", "content": "What is 2 + 3?"}]


async def test_the_server_tokens_reach_the_completion() -> None:
    with ChatServer(tokens=True) as server:
        async with OpenAIClient(server.url) as client:
            plain = await client.chat(MESSAGES, model="m", sampling=Sampling())
            asked = await client.chat(MESSAGES, model="m", sampling=Sampling(return_tokens=True))
        bodies = list(server.requests)
    assert plain.tokens is None  # not asked, the server sends none
    assert "return_token_ids" not in bodies[0]
    assert bodies[1]["return_token_ids"] is True
    assert bodies[1]["logprobs"] is True
    assert asked.content == "5"
    assert asked.tokens == Tokens(
        prompt_ids=token_ids_of(prompt_text(MESSAGES)),
        completion_ids=token_ids_of("5"),
        completion_logprobs=logprobs_of("5"),
    )


class TwoTurns(tt.Env[tt.Task]):
    """Asks, then asks again with the first reply in the messages: two model calls."""

    async def rollout(self, task: tt.Task, ctx: ModelContext) -> tuple[list[dict[str, Any]], str]:
        messages: list[dict[str, Any]] = [{"role": "user", "content": str(task.prompt)}]
        first = await ctx.chat(messages)
        messages += [
            {"role": "assistant", "content": first.content},
            {"role": "user", "content": "What is 10 + 1?"},
        ]
        second = await ctx.chat(messages)
        return [*messages, {"role": "assistant", "content": second.content}], second.content


class Sums(tt.Taskset[tt.Task, tt.TasksetConfig]):
    def load(self) -> list[tt.Task]:
        return [tt.Task(prompt=f"What is {a} + 1?", answer="11") for a in (1, 4)]


async def test_rows_keep_every_model_call_s_tokens(tmp_path: Path) -> None:
    with ChatServer(tokens=True) as server:
        async with OpenAIClient(server.url) as client:
            ctx = ModelContext(client, "m", Sampling(return_tokens=True))
            config = tt.EvalConfig(output_dir=str(tmp_path), run_name="t", dashboard=False)
            result = await tt.run_eval(TwoTurns(Sums()), ctx, config)
        sent = [body["messages"] for body in server.requests]
    rows = [json.loads(line) for line in (result.run_dir / "traces.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    for row in rows:
        assert row["ok"], row["errors"]
        assert len(row["tokens"]) == 2  # one entry per model call, in call order
        first, second = row["tokens"]
        assert first["completion_ids"] == token_ids_of(row["messages"][1]["content"])
        assert second["completion_ids"] == token_ids_of(row["completion"])
        assert second["completion_logprobs"] == logprobs_of(row["completion"])
        asked = [m for m in sent if m[0]["content"] == row["messages"][0]["content"]]
        assert [t["prompt_ids"] for t in row["tokens"]] == [
            token_ids_of(prompt_text(m)) for m in asked
        ]
        # a row reads back as the same episode, tokens included
        assert tt.Episode.from_row(row).to_row() == row


async def test_a_server_without_tokens_leaves_rows_without_them(tmp_path: Path) -> None:
    with ChatServer() as server:  # an OpenAI-like server: ignores return_token_ids
        async with OpenAIClient(server.url) as client:
            ctx = ModelContext(client, "m", Sampling(return_tokens=True))
            config = tt.EvalConfig(output_dir=str(tmp_path), run_name="t", dashboard=False)
            result = await tt.run_eval(TwoTurns(Sums()), ctx, config)
    assert all(e.ok and e.tokens == [] for e in result.episodes)
    rows = (result.run_dir / "traces.jsonl").read_text().splitlines()
    assert all("tokens" not in json.loads(line) for line in rows)


def test_cli_return_tokens_writes_them_to_the_rows(tmp_path: Path) -> None:
    taskset = tmp_path / "sums.py"
    taskset.write_text(
        "import trio_tasksets as tt\n\n"
        "class Sums(tt.Taskset):\n"
        "    def load(self):\n"
        "        return [tt.Task(prompt='What is 2 + 3?', answer='5')]\n"
    )
    with ChatServer(tokens=True) as server:
        done = forkserver.run(
            [sys.executable, "-m", "trio_tasksets", "eval", f"{taskset}:Sums", "-m", "tiny",
             "--base-url", server.url, "--return-tokens", "--no-dashboard",
             "-o", str(tmp_path / "out"), "--run-name", "r"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert server.requests[0]["return_token_ids"] is True
    assert done.returncode == 0, done.stderr
    (row,) = [json.loads(x) for x in (tmp_path / "out/r/traces.jsonl").read_text().splitlines()]
    assert row["tokens"] == [
        {
            "prompt_ids": token_ids_of("user: What is 2 + 3?"),
            "completion_ids": token_ids_of("5"),
            "completion_logprobs": logprobs_of("5"),
        }
    ]
    saved = json.loads((tmp_path / "out/r/config.json").read_text())
    assert saved["identity"]["sampling"]["return_tokens"] is True


def test_completion_tokens_default_to_none() -> None:
    assert Completion("hi").tokens is None


async def test_echo_fills_no_tokens() -> None:
    reply = await tt.EchoClient().chat(
        MESSAGES, model="echo", sampling=Sampling(return_tokens=True)
    )
    await trio.lowlevel.checkpoint()
    assert reply.tokens is None


def test_return_tokens_travels_to_an_env_server() -> None:
    from trio_tasksets._serve.wire import WireError, encode_run_request, parse_run_request

    ctx = tt.ModelContext(tt.EchoClient(), "echo", Sampling(return_tokens=True))
    body = json.loads(encode_run_request(tt.RunSlot(tt.Task("x")), ctx))
    assert parse_run_request(body).sampling == ctx.sampling
    body["ctx"]["sampling"]["return_tokens"] = "yes"
    with pytest.raises(WireError) as caught:
        parse_run_request(body)
    assert caught.value.field == "ctx.sampling.return_tokens"


def test_rows_with_training_fields_read_back_from_an_env_server() -> None:
    episode = tt.Episode(
        id="e", task=tt.EpisodeTask("k", {"prompt": "p"}), rollout=0, ok=True, reward=1.0,
        tokens=[Tokens([1], [2], [-0.5]).to_dict()], group="g", advantage=0.5,
        policy_version=3, stale=True,
    )  # fmt: skip
    row = json.loads(json.dumps(episode.to_row()))
    back = tt.Episode._from_fresh_row(row)
    assert back == episode
    plain = tt.Episode(id="e", task=tt.EpisodeTask("k", {}), rollout=0)
    assert set(plain.to_row()) == {
        "id", "task", "rollout", "ok", "reward", "completion", "messages", "errors",
        "attempts", "timing", "usage", "finish_reason", "turns", "tool_calls", "stop_reason",
        "metrics",
    }  # fmt: skip
