"""verifiers v1 envs under the trio runner: `tt.aio.verifiers_env` (SPEC section 6b).

Real verifiers (installed by the test extra) against a real model server the tests start on
127.0.0.1 (`tests/fixtures/chat_server.py`: deterministic answers, plain JSON and SSE). The
taskset is `tests/fixtures/vf_arith.py` (20 sums, an exact-match `@vf.reward`), loaded by its
import name as verifiers loads tasksets; its default harness is an in-process one (one chat
turn over httpx through verifiers' interception), which keeps the tests fast; one test runs
verifiers' stock `null` harness in the `subprocess` runtime.

The reference is verifiers' own eval (`verifiers.v1.cli.eval.runner.run_eval`) on the same
server with the same window: every path here (Python, the CLI with and without `--serve`,
an asyncio host) must give the same reward and completion for every task. These tests talk to
a real server over real sockets, so they run on the real clock; every wait is bounded.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import socket
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import trio

import trio_tasksets as tt
from trio_tasksets import _cli as cli
from trio_tasksets._env.loading import load_object
from trio_tasksets._env.spec import EnvSpec

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"
if str(FIXTURES) not in sys.path:  # verifiers imports tasksets by name, as vf-eval does
    sys.path.insert(0, str(FIXTURES))

import helpers  # noqa: E402
from chat_server import ChatServer, reply_to  # noqa: E402

# verifiers takes 5 s of CPU to import: the tests import it (not the module, which every xdist
# worker collects), and they run on one worker, which starts their module's servers and
# verifiers' own eval (`reference`) once
pytestmark = [pytest.mark.usefixtures("vf"), pytest.mark.xdist_group("verifiers")]


@pytest.fixture(scope="session")
def vf() -> ModuleType:
    module: ModuleType = pytest.importorskip(
        "verifiers.v1", reason="needs verifiers: pip install -e '.[test]'"
    )
    return module


WINDOW = 4
ENV: dict[str, Any] = {"agent": {"runtime": {"type": "subprocess"}}}  # local, offline
MODEL = "test-model"
LIMIT = 120  # seconds: a hang fails the test instead of stalling the suite

Outcome = dict[str, tuple[float, str | None]]  # task key -> (reward, completion)


@pytest.fixture(scope="module")
def server() -> Iterator[ChatServer]:
    with ChatServer(delay=0.02) as chat:  # long enough for requests to overlap
        yield chat


@pytest.fixture(scope="module")
def reference(server: ChatServer, tmp_path_factory: pytest.TempPathFactory) -> Outcome:
    """verifiers' own eval of `vf_arith` on the same server, with the same window."""
    from verifiers.v1.cli.eval.runner import run_eval
    from verifiers.v1.configs.cli.eval import EvalConfig

    server.reset()
    config = EvalConfig.model_validate(
        {
            "env": {"taskset": {"id": "vf_arith"}, **ENV},
            "model": MODEL,
            "client": {"type": "eval", "base_url": server.url, "api_key_var": "TT_TEST_NO_KEY"},
            "max_concurrent": WINDOW,
            "push": False,
            "rich": None,
            "output_dir": str(tmp_path_factory.mktemp("vf-eval")),
        }
    )
    episodes = asyncio.run(run_eval(config))
    assert server.peak <= WINDOW
    outcome = {e.task.key: (e.traces[-1].reward, e.traces[-1].last_reply) for e in episodes}
    assert len(outcome) == 20
    assert all(e.ok for e in episodes)
    assert 0 < sum(r for r, _ in outcome.values()) < 20  # the server gets some sums wrong
    return outcome


def ctx(server: ChatServer | str, **kwargs: Any) -> tt.ModelContext:
    url = server if isinstance(server, str) else server.url
    return tt.ModelContext(tt.OpenAIClient(url, **kwargs), MODEL, tt.Sampling(temperature=0.25))


def config(tmp_path: Path, **kwargs: Any) -> tt.EvalConfig:
    kwargs.setdefault("max_concurrent", WINDOW)
    return tt.EvalConfig(output_dir=str(tmp_path), run_name="run", dashboard=False, **kwargs)


def rows(run_dir: Path) -> list[dict[str, Any]]:
    lines = (run_dir / "traces.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def outcome(run_rows: list[dict[str, Any]]) -> Outcome:
    return {row["task"]["key"]: (row["reward"], row["completion"]) for row in run_rows}


def subprocess_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(FIXTURES)])}


def python_c(script: str) -> subprocess.CompletedProcess[str]:
    """``python -c SCRIPT`` in `subprocess_env()`, its output captured."""
    return subprocess.run([sys.executable, "-c", script], env=subprocess_env(),
                          capture_output=True, text=True, timeout=LIMIT)  # fmt: skip


# --- Python: tt.run_eval ------------------------------------------------------------------------


async def test_verifiers_env_under_run_eval_equals_verifiers_own_eval(
    server: ChatServer, reference: Outcome, tmp_path: Path
) -> None:
    server.reset()
    env = tt.aio.verifiers_env("vf_arith", **ENV)
    with trio.fail_after(LIMIT):
        result = await tt.run_eval(env, ctx(server, api_key="sk-test"), config(tmp_path))
    written = rows(result.run_dir)
    assert outcome(written) == reference
    assert result.summary["ok"] == 20
    assert "anyio._backends._asyncio" in sys.modules  # imported first (anyio's pytest plugin)
    assert 2 <= server.peak <= WINDOW  # the window, and nothing beyond it, reached the server
    # What crossed over: the model name, the sampling and the API key reach the model server.
    assert {r["model"] for r in server.requests} == {MODEL}
    assert {r.get("temperature") for r in server.requests} == {0.25}
    assert set(server.authorizations) == {"Bearer sk-test"}
    # A row: verifiers' episode as tt fields.
    row = next(r for r in written if r["task"]["data"]["prompt"] == "What is 2 + 5?")
    assert row["ok"] is True
    assert row["errors"] == []
    assert (row["reward"], row["completion"]) == (1.0, "7")
    assert row["task"]["data"]["answer"] == "7"
    assert row["messages"] == [
        {"role": "system", "content": "Answer with the number only."},
        {"role": "user", "content": "What is 2 + 5?"},
        {"role": "assistant", "content": "7"},
    ]
    # verifiers' token usage and its per-reward breakdown reach the rows (issues 21, 25).
    assert row["usage"] == {"prompt_tokens": 10, "completion_tokens": 1}  # the server's
    assert row["metrics"] == {"exact": 1.0, "reply_chars": 1.0}
    assert result.summary["usage"] == {"prompt_tokens": 200, "completion_tokens": 20}
    assert result.summary["metrics"]["exact"]["mean"] == result.summary["reward_mean"]


def test_from_an_asyncio_host_equals_verifiers_own_eval(
    server: ChatServer, reference: Outcome, tmp_path: Path
) -> None:
    server.reset()

    async def main() -> tt.EvalResult:
        env = tt.aio.verifiers_env("vf_arith", **ENV)
        return await asyncio.wait_for(tt.aio.run_eval(env, ctx(server), config(tmp_path)), LIMIT)

    result = asyncio.run(main())
    assert outcome(rows(result.run_dir)) == reference
    assert server.peak <= WINDOW


async def test_an_env_instance_travels_as_its_config(
    server: ChatServer, reference: Outcome, tmp_path: Path, vf: ModuleType
) -> None:
    """What `--serve` and the worker do with an env: describe it (`EnvSpec`, plain JSON) and
    rebuild it by name in another process. An `Env` instance travels as its resolved config."""
    vf_env = vf.load_environment(vf.resolve_env_config({"taskset": {"id": "vf_arith"}, **ENV}))
    env = tt.aio.verifiers_env(vf_env)
    assert env.vf_env is vf_env
    spec = EnvSpec.of(env)
    assert json.loads(json.dumps(spec.config)) == spec.config
    rebuilt = spec.build(load_object(spec.taskset))
    assert type(rebuilt) is type(env)
    assert rebuilt.vf_env is not vf_env
    assert rebuilt.vf_env.config == vf_env.config
    server.reset()
    with trio.fail_after(LIMIT):
        result = await tt.run_eval(rebuilt, ctx(server), config(tmp_path, num_examples=5))
    written = outcome(rows(result.run_dir))
    assert written == {key: reference[key] for key in written}
    assert len(written) == 5


# --- the command line -------------------------------------------------------------------------


@pytest.mark.parametrize("serve", [False, True], ids=["in-process", "serve"])
def test_cli_vf_taskset_equals_verifiers_own_eval(
    server: ChatServer,
    reference: Outcome,
    tmp_path: Path,
    serve: bool,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("PYTHONPATH", subprocess_env()["PYTHONPATH"])  # for --serve's server
    server.reset()
    argv = ["eval", "vf:vf_arith", "--env-args", json.dumps(ENV), "-m", MODEL,
            "--base-url", server.url, "-c", str(WINDOW), "-o", str(tmp_path),
            "--run-name", "cli", "--no-dashboard"]  # fmt: skip
    assert cli.main([*argv, "--serve"] if serve else argv) == 0, capsys.readouterr().err
    assert "20/20 ok" in capsys.readouterr().out
    assert outcome(rows(tmp_path / "cli")) == reference
    assert server.peak <= WINDOW


def _closed_port_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}/v1"  # nothing listens there any more


def test_cli_an_env_whose_every_episode_fails_exits_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["eval", "vf:vf_arith", "--env-args", json.dumps(ENV), "-m", MODEL, "-n", "3",
            "--base-url", _closed_port_url(), "-o", str(tmp_path), "--run-name", "dead",
            "--no-dashboard"]  # fmt: skip
    assert cli.main(argv) == 1
    captured = capsys.readouterr()
    assert "0/3 ok" in captured.out
    assert "error: no episode succeeded" in captured.err  # loud, with the first error named
    assert "ProviderError: All connection attempts failed" in captured.out + captured.err
    written = rows(tmp_path / "dead")
    assert [r["ok"] for r in written] == [False] * 3
    assert [[e["type"] for e in r["errors"]] for r in written] == [["ProviderError"]] * 3


def test_cli_vf_taskset_honours_the_rollout_limit_flags(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--rollout-timeout` (and `--working-limit`, `--stall-timeout`) bound a vf: env's
    episodes as they bound any env's: a model slower than the bound fails each episode."""
    with ChatServer(delay=30) as slow:
        argv = ["eval", "vf:vf_arith", "--env-args", json.dumps(ENV), "-m", MODEL, "-n", "2",
                "--base-url", slow.url, "-o", str(tmp_path), "--run-name", "bounded",
                "--no-dashboard", "--rollout-timeout", "0.5", "--working-limit", "20",
                "--stall-timeout", "25"]  # fmt: skip
        assert cli.main(argv) == 1
    captured = capsys.readouterr()
    assert "0/2 ok" in captured.out
    written = rows(tmp_path / "bounded")
    assert [[e["type"] for e in r["errors"]] for r in written] == [["RolloutTimeoutError"]] * 2


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["echo", "--env-args", "{}"], "--env-args applies to a verifiers env"),
        (["vf:vf_arith"], "--base-url"),
        (
            ["vf:vf_arith", "--base-url", "http://127.0.0.1:9/v1", "--env-args", "[1]"],
            "JSON object",
        ),
        (["vf:vf_arith", "--base-url", "http://127.0.0.1:9/v1", "--env-args", "{"], "not JSON"),
        (["vf:no_such_taskset_xyz", "--base-url", "http://127.0.0.1:9/v1"], "not found"),
        (["vf:vf_arith", "--base-url", "http://127.0.0.1:9/v1", "--retries", "2"], "max_retries"),
    ],
)
def test_cli_vf_usage_errors_exit_2_before_any_run(
    args: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["eval", *args, "-m", MODEL, "-o", str(tmp_path), "--no-dashboard"])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


# --- streaming tasksets -------------------------------------------------------------------------


async def test_a_streaming_verifiers_taskset_runs_exactly_n_of_a_never_ending_feed(
    server: ChatServer, tmp_path: Path
) -> None:
    from vf_arith_stream import Pulls

    Pulls.pulled = Pulls.closed = 0
    env = tt.aio.verifiers_env("vf_arith_stream", **ENV)
    assert env.taskset.streaming
    with pytest.raises(tt.EvalConfigError, match="num_examples"):
        await tt.run_eval(env, ctx(server), config(tmp_path))
    assert Pulls.pulled == 0
    with trio.fail_after(LIMIT):
        result = await tt.run_eval(env, ctx(server), config(tmp_path, num_examples=3))
    written = rows(result.run_dir)
    assert (len(written), Pulls.pulled, Pulls.closed) == (3, 3, 1)
    assert sorted(r["task"]["data"]["idx"] for r in written) == [0, 1, 2]
    for row in written:
        expected = reply_to(row["task"]["data"]["prompt"])
        assert row["completion"] == expected
        assert row["reward"] == (1.0 if expected == row["task"]["data"]["answer"] else 0.0)


async def test_the_service_pattern_drives_a_streaming_verifiers_env(server: ChatServer) -> None:
    from vf_arith_stream import Pulls

    Pulls.pulled = Pulls.closed = 0
    env = tt.aio.verifiers_env("vf_arith_stream", **ENV)
    context = ctx(server)

    async def run(task: Any) -> tt.Episode:
        return await env.run_slot(tt.RunSlot(task), context)

    with trio.fail_after(LIMIT):
        async with env.serving(), env.taskset.channel() as tasks:
            episodes = await tt.run_stream(tt.take(tasks, 5), run, window=2)
    assert [e.ok for e in episodes] == [True] * 5
    assert (Pulls.pulled, Pulls.closed) == (5, 1)


# --- the stock harness ----------------------------------------------------------------------------


async def test_the_stock_null_harness_in_the_subprocess_runtime(
    server: ChatServer, tmp_path: Path
) -> None:
    """verifiers' own `null` harness: a uv script per rollout that streams (SSE)."""
    env = tt.aio.verifiers_env("vf_arith", agent={"harness": {"id": "null"}, **ENV["agent"]})
    server.reset()
    with trio.fail_after(300):  # the first run prepares the script's environment with uv
        result = await tt.run_eval(env, ctx(server), config(tmp_path, num_examples=3))
    written = rows(result.run_dir)
    failures = [e["message"] for r in written for e in r["errors"]]
    if failures and all("failed to prepare uv script" in m for m in failures):
        pytest.skip(f"the null harness cannot prepare its uv script here: {failures[0][:300]}")
    assert [r["ok"] for r in written] == [True] * 3, failures
    assert all(r["stream"] is True for r in server.requests)  # the stock harness streams
    for row in written:
        assert row["completion"] == reply_to(row["task"]["data"]["prompt"])


# --- refusals, the anyio case, the optional extra ------------------------------------------------


def test_bridge_env_refuses_a_verifiers_env_before_any_run(
    server: ChatServer, vf: ModuleType
) -> None:
    vf_env = vf.load_environment(vf.resolve_env_config({"taskset": {"id": "vf_arith"}, **ENV}))
    server.reset()
    with pytest.raises(TypeError, match=r"verifiers v1 Env.*tt\.aio\.verifiers_env\(env\)"):
        tt.aio.bridge_env(vf_env)

    class WrapsATaskset:
        taskset = vf_env.taskset

    with pytest.raises(TypeError, match=r"verifiers Taskset.*tt\.aio\.verifiers_env"):
        tt.aio.bridge_env(WrapsATaskset())
    assert server.requests == []


async def test_verifiers_env_refuses_what_verifiers_runs_itself(server: ChatServer) -> None:
    with pytest.raises(TypeError, match="target is a verifiers taskset id"):
        tt.aio.verifiers_env(42)
    with pytest.raises(ModuleNotFoundError, match="no_such_taskset_xyz"):
        tt.aio.verifiers_env("no_such_taskset_xyz")
    env = tt.aio.verifiers_env("vf_arith", **ENV)
    verifiers_env_class = type(env)
    assert verifiers_env_class(env.taskset, retries=tt.RetryPolicy()).retries == tt.RetryPolicy()
    with pytest.raises(ValueError, match=r"retries its episodes itself.*max_retries"):
        verifiers_env_class(env.taskset, retries=tt.RetryPolicy(2))
    with pytest.raises(TypeError, match="scores its episodes itself"):
        verifiers_env_class(env.taskset, reward=lambda task, completion: 1.0)
    echo = tt.ModelContext(tt.EchoClient(), MODEL)
    with pytest.raises(TypeError, match="OpenAI-compatible endpoint"):
        async with env.serving():
            await env.run_slot(tt.RunSlot(next(iter(env.taskset))), echo)


@pytest.mark.skipif(
    importlib.util.find_spec("trio_asyncio") is None, reason="bridge_env needs trio-asyncio"
)
def test_the_anyio_case_httpx_in_guest_mode_first_then_httpx_in_a_bridged_env(
    server: ChatServer, tmp_path: Path
) -> None:
    """anyio's asyncio backend imported before trio-asyncio, by httpx used in guest mode
    (`tt.aio.run_stream` from `asyncio.run`); then httpx inside a bridged env (on
    trio-asyncio's loop) still works. In a fresh process, so that the import order is the one
    under test."""
    script = textwrap.dedent(
        f"""
        import asyncio, json, sys
        import httpx, trio
        import trio_tasksets as tt

        URL = {server.url!r} + "/chat/completions"

        async def ask(i):  # asyncio code, as a verifiers harness does it
            body = {{"model": "m", "messages": [{{"role": "user", "content": f"What is {{i}} + 1?"}}]}}
            async with httpx.AsyncClient() as client:
                reply = await client.post(URL, json=body)
            return reply.json()["choices"][0]["message"]["content"]

        async def numbers():
            for i in range(2):
                yield i

        assert "anyio._backends._asyncio" not in sys.modules
        assert asyncio.run(tt.aio.run_stream(numbers(), ask, window=2)) == ["1", "2"]
        assert "anyio._backends._asyncio" in sys.modules and "trio_asyncio" not in sys.modules

        class AioEnv:
            taskset = tt.Taskset()

            async def run_slot(self, slot, ctx):
                episode = tt.Episode("e", tt.EpisodeTask(slot.task.key, {{}}), slot.rollout)
                episode.completion = await ask(slot.task.answer)
                episode.ok = True
                return episode

        async def main():
            env = tt.aio.bridge_env(AioEnv())
            tasks = [tt.Task("q", answer=str(i)) for i in range(3)]
            async with env.serving():
                ctx = tt.ModelContext(tt.EchoClient(), "m")
                return [(await env.run_slot(tt.RunSlot(t), ctx)).completion for t in tasks]

        print(json.dumps(trio.run(main)))
        """
    )
    done = python_c(script)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.splitlines()[-1]) == ["1", "2", "4"]


class HttpxAioEnv:
    """An asyncio env (on trio-asyncio's loop) whose run_slot asks the model with httpx."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.taskset = tt.Taskset[tt.Task, tt.TasksetConfig]()

    async def run_slot(self, slot: tt.RunSlot[tt.Task], ctx: Any) -> tt.Episode:
        import httpx

        body = {"model": MODEL, "messages": [{"role": "user", "content": slot.task.prompt}]}
        async with httpx.AsyncClient() as client:
            reply = await client.post(self.url + "/chat/completions", json=body)
        episode = tt.Episode("e", tt.EpisodeTask(slot.task.key, {}), slot.rollout, ok=True)
        episode.completion = reply.json()["choices"][0]["message"]["content"]
        return episode


@pytest.mark.skipif(
    importlib.util.find_spec("trio_asyncio") is None, reason="bridge_env needs trio-asyncio"
)
async def test_the_anyio_case_inside_pytest_httpx_in_a_bridged_env(server: ChatServer) -> None:
    """anyio's pytest plugin imports anyio's asyncio backend at start-up, before any test
    imports trio-asyncio: httpx inside a bridged env on trio-asyncio's loop works all the same."""
    assert "anyio._backends._asyncio" in sys.modules
    env = tt.aio.bridge_env(HttpxAioEnv(server.url))
    with trio.fail_after(LIMIT):
        async with env.serving():
            episode = await env.run_slot(tt.RunSlot(tt.Task("What is 2 + 2?")), ctx(server))
    assert (episode.ok, episode.completion) == (True, "4")


def test_importing_trio_tasksets_never_needs_verifiers(monkeypatch: pytest.MonkeyPatch) -> None:
    check = "import sys, trio_tasksets, trio_tasksets._cli\n" + (
        "assert not any(m.startswith('verifiers') for m in sys.modules)"
    )
    done = python_c(check)
    assert done.returncode == 0, done.stderr
    monkeypatch.setitem(sys.modules, "verifiers.v1", None)  # as if it were not installed
    with pytest.raises(ImportError, match=r"pip install 'trio-tasksets\[verifiers\]'"):
        tt.aio.verifiers_env("vf_arith")


def test_a_local_taskset_module_loads_from_the_current_folder_and_runs_are_named_by_it(
    server: ChatServer,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`vf:local_vf_tasks` finds ./local_vf_tasks.py without PYTHONPATH=. (as a file.py:Class
    taskset's folder is on the path while it loads); runs are named by the target, so a
    `--resume` without `--run-name` picks the run of the same verifiers taskset."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "local_vf_tasks.py").write_text(
        "from vf_arith import ArithTaskset, InProcessHarness\n\n"
        '__all__ = ["ArithTaskset", "InProcessHarness"]\n'
    )
    monkeypatch.chdir(work)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(work))])
    out = str(tmp_path / "out")
    common = ["--env-args", json.dumps(ENV), "-m", MODEL, "--base-url", server.url, "-n", "2",
              "-o", out, "--no-dashboard"]  # fmt: skip
    try:
        assert cli.main(["eval", "vf:local_vf_tasks", *common]) == 0, capsys.readouterr().err
        assert cli.main(["eval", "vf:vf_arith", *common]) == 0, capsys.readouterr().err
        names = sorted(p.name for p in Path(out).iterdir())
        assert [n.split("-")[0] for n in names] == ["local_vf_tasks", "vf_arith"]
        config = json.loads((Path(out) / names[0] / "config.json").read_text())
        assert config["identity"]["taskset"] == "vf:local_vf_tasks"
        capsys.readouterr()
        assert cli.main(["eval", "vf:local_vf_tasks", *common, "--resume"]) == 0
        assert f"resuming {out}/{names[0]}" in capsys.readouterr().err
    finally:
        sys.modules.pop("local_vf_tasks", None)


def test_cli_vf_over_workers_needs_no_base_url(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`eval vf:ID --via URL -m MODEL`: the workers call the model, so no --base-url is asked
    for (here the Redis is unreachable: that is the error, exit 2, before any run)."""
    argv = ["eval", "vf:vf_arith", "--env-args", json.dumps(ENV), "-m", MODEL, "--via",
            "redis://127.0.0.1:9/0", "-o", str(tmp_path), "--no-dashboard"]  # fmt: skip
    assert helpers.cli(*argv) == 2
    line = next(x for x in capsys.readouterr().err.splitlines() if ": error: " in x)
    assert "--base-url" not in line
    assert "--via redis://127.0.0.1:9/0: cannot reach Redis" in line
    assert not any(tmp_path.iterdir())
