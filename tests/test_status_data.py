"""An error's HTTP status is read from its data (`EpisodeError.status`, an exception's
`status`), never from its message: these tests word the messages without any "HTTP 401", so
a reading of the text would fail them."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
from trio.testing import MockClock

import trio_tasksets as tt
from trio_tasksets._cli.eval import _fix_for, eval_command
from trio_tasksets._cli.main import parser
from trio_tasksets._env.env import EpisodeError, EpisodeTask
from trio_tasksets._eval.run import dead_endpoint
from trio_tasksets._serve.errors import EnvServerError


class Few(tt.Taskset[tt.Task, tt.TasksetConfig]):
    def load(self) -> Iterable[tt.Task]:
        return [tt.Task(f"say {i}", answer=str(i)) for i in range(4)]


class Refusing(tt.EchoClient):
    """An endpoint at a URL that refuses every call with `status`, in words of its own."""

    base_url = "http://127.0.0.1:9/v1"

    def __init__(self, status: int) -> None:
        super().__init__()
        self.status = status

    def describe(self) -> tt.ClientDescription:
        return tt.ClientDescription(endpoints=(self.base_url,))

    async def chat(self, messages: list[dict[str, Any]], **kw: Any) -> tt.Completion:
        raise tt.ModelHTTPError("the endpoint said no", url=self.base_url, status=self.status)


def failed(message: str, status: int | None) -> tt.Episode:
    return tt.Episode(
        id="e", task=EpisodeTask("k", {}), rollout=0, ok=False, reward=0.0, completion="",
        messages=[], errors=[EpisodeError("ModelHTTPError", message, 1, status)],
    )  # fmt: skip


def test_a_dead_endpoint_is_told_by_the_status() -> None:
    assert dead_endpoint(failed("the endpoint said no", 401)) is not None
    assert dead_endpoint(failed("the endpoint said no", 403)) is not None
    assert dead_endpoint(failed("returned HTTP 401", None)) is None  # the text tells nothing
    assert dead_endpoint(failed("returned HTTP 401", 400)) is None


async def test_the_status_reaches_the_summary_and_stops_the_eval(
    autojump_clock: MockClock, tmp_path: Path
) -> None:
    ctx = tt.ModelContext(Refusing(401), "m")
    config = tt.EvalConfig(output_dir=str(tmp_path), run_name="r", dashboard=False)
    result = await tt.run_eval(tt.Env(Few()), ctx, config)
    assert result.summary["stopped"] == "dead_endpoint"
    first = json.loads((result.run_dir / "summary.json").read_text())["first_error"]
    assert (first["type"], first["message"], first["status"]) == (
        "ModelHTTPError", "the endpoint said no", 401,
    )  # fmt: skip


TOO_LARGE = "Request too large for m on tokens per min (TPM): Limit 20, Requested 24."


@pytest.mark.parametrize(
    ("error_type", "status", "fix", "message"),
    [("ModelHTTPError", 401, "export OPENAI_API_KEY", "the endpoint said no"),
     ("ModelHTTPError", 403, "export OPENAI_API_KEY", "the endpoint said no"),
     ("ModelHTTPError", 404, "check -m/--model", "the endpoint said no"),
     ("ModelHTTPError", 429, "rate-limiting", "the endpoint said no"),
     ("ModelHTTPError", 429, "a lower --max-tokens or shorter prompts", TOO_LARGE),
     ("ModelHTTPError", 503, "the model server failed", "the endpoint said no"),
     ("EnvServerError", 401, "the env server wants a bearer token", "the endpoint said no")],
)  # fmt: skip
def test_the_commands_fix_follows_the_status(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    error_type: str,
    status: int,
    fix: str,
    message: str,
) -> None:
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    monkeypatch.delenv("TT_SERVE_TOKEN", raising=False)
    command = eval_command(parser().parse_args(["eval", "echo"]))
    said = _fix_for(error_type, message, status, command, tmp_path)
    assert said is not None
    assert fix in said
    # The same words without the status: no status-specific fix.
    assert fix not in (
        _fix_for(error_type, f"{message} returned HTTP {status}", None, command, tmp_path) or ""
    )


def test_an_env_servers_error_carries_its_status() -> None:
    error = EnvServerError("refused", url="http://h", status=401)
    assert error.status == 401
    assert "401" not in str(error)
