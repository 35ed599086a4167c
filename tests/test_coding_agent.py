"""`examples/coding_agent.py` (SPEC 14): a real agent that needs a box, offline with
`ScriptedClient` on the `local` and `bwrap` backends, and through the command line
(`--sandbox`, `--max-sandboxes`, in process and `--serve`) against the fake OpenAI server;
and how `--sandbox` travels (the env spec, a Redis declaration, a running server's health).
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import attrs
import forkserver
import pytest
import trio

import trio_tasksets as tt
from trio_tasksets._env.spec import Declaration, EnvSpec, SandboxSpec
from trio_tasksets._serve import EnvServerError, spawn_server

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "tests" / "fixtures"))

import coding_agent  # noqa: E402
from chat_server import ChatServer  # noqa: E402
from helpers import needs  # noqa: E402
from redis_server import RedisServer  # noqa: E402

EXAMPLE = str(ROOT / "examples" / "coding_agent.py")
BWRAP = needs("bwrap", why="the bwrap backend runs bubblewrap (apt-get install bubblewrap)")


async def run(env: tt.Env[Any], client: tt.ModelClient) -> list[tt.Episode]:
    ctx = tt.ModelContext(client, "m")

    async def slots() -> Any:
        for task in env.taskset:
            yield tt.RunSlot(task)

    return await tt.run_stream(slots(), lambda slot: env.run_slot(slot, ctx), window=4)


@pytest.mark.parametrize("backend", ["local", pytest.param("bwrap", marks=BWRAP)])
async def test_the_scripted_agent_passes_the_tests_in_its_box(backend: str) -> None:
    env = coding_agent.CodingAgent(
        coding_agent.CodingTasks(), sandbox=tt.sandboxes.parse(backend), max_sandboxes=2
    )
    with trio.fail_after(60):
        episodes = await run(env, coding_agent.scripted_model())
    assert [(e.task.key, e.ok, e.reward) for e in episodes] == [
        (key, True, 1.0) for key in ("fizzbuzz", "palindrome", "word_count", "fib")
    ]
    assert all(e.metrics == {"tests_ran": 1.0} for e in episodes)
    listing = episodes[0].messages[4]["content"]  # list_dir's answer: the file, no tests
    assert listing.split() == ["solution.py"]
    assert episodes[0].messages[5]["content"].strip() == "imported"  # the shell, in the box
    assert env.sandboxes is not None
    stats = env.sandboxes.admission.stats()
    assert (stats["made"], stats["alive"], stats["failed"]) == (4, 0, 0)
    assert stats["peak_alive"] <= 2


@BWRAP
async def test_a_wrong_answer_fails_the_tests_and_each_rollout_starts_clean() -> None:
    wrong = dict(coding_agent.ANSWERS, fib="def fib(n):\n    return n\n")
    env = coding_agent.CodingAgent(coding_agent.CodingTasks(), sandbox=tt.sandboxes.bwrap())
    with trio.fail_after(60):
        episodes = await run(env, coding_agent.scripted_model(wrong))
    rewards = {e.task.key: e.reward for e in episodes}
    assert rewards == {"fizzbuzz": 1.0, "palindrome": 1.0, "word_count": 1.0, "fib": 0.0}


# --- the command line ------------------------------------------------------------------------


def cli(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return forkserver.run(
        [sys.executable, "-m", "trio_tasksets", *args],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip


@pytest.mark.parametrize("where", ["in process", "--serve"])
def test_the_example_runs_from_the_cli_with_a_sandbox(tmp_path: Path, where: str) -> None:
    """Against an endpoint whose model writes no code: every rollout's reward makes its box
    (where the rollout runs: an env server makes it there), runs the tests, and fails them;
    the rows are ok, the boxes all gone."""
    with ChatServer() as server:
        done = cli(
            tmp_path, "eval", f"{EXAMPLE}:CodingTasks", "--env-class",
            f"{EXAMPLE}:CodingAgent", "--sandbox", "local", "--max-sandboxes", "1-2-4",
            "-m", "m", "--base-url", server.url, "-o", str(tmp_path), "--run-name", "r",
            "--no-dashboard", *(["--serve"] if where == "--serve" else []),
        )  # fmt: skip
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in (tmp_path / "r" / "traces.jsonl").read_text().splitlines()]
    assert len(rows) == 4
    assert all(row["ok"] and row["reward"] == 0.0 for row in rows)
    assert all(row["metrics"] == {"tests_ran": 1.0} for row in rows)
    config = json.loads((tmp_path / "r" / "config.json").read_text())
    assert config["sandbox"] == {"backend": "local", "scope": "rollout", "max_sandboxes": "1-2-4"}
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    if where == "in process":  # the boxes were made here, admitted by the window asked for
        boxes = summary["sandboxes"]
        found = (boxes["sandbox"], boxes["made"], boxes["alive"], boxes["failed"])
        assert found == ("local", 4, 0, 0)
        assert boxes["window_history"][0][1:] == [2, "start"]
        assert boxes["peak_alive"] <= 4
    else:  # made by the env server: counted there
        assert "sandboxes" not in summary


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["--sandbox", "kvm"], "--sandbox must be local, bwrap, docker:IMAGE"),
        (["--sandbox", "docker:"], "--sandbox must be local, bwrap, docker:IMAGE"),
        (["--sandbox", "local", "--max-sandboxes", "0"], "--max-sandboxes: N must be >= 1"),
        (["--sandbox", "local", "--max-sandboxes", "4-2-8"], "--max-sandboxes: MIN-START-MAX"),
        (["--max-sandboxes", "4"], "--max-sandboxes admits sandboxes, but the env makes none"),
        (["--sandbox", "nowhere_at_all:factory"], "--sandbox: cannot load"),
    ],
)
def test_bad_sandbox_flags_are_refused_before_any_work(
    tmp_path: Path, flags: list[str], said: str
) -> None:
    done = cli(
        tmp_path, "eval", "echo", "-m", "m", "--base-url", "http://127.0.0.1:9/v1", *flags,
        "-o", str(tmp_path), "--no-dashboard",
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert said in done.stderr
    assert not any(tmp_path.iterdir())  # nothing written


def test_via_the_worker_makes_the_sandbox_where_it_runs(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """`--via`: a worker started with `--sandbox local` runs the entries of an eval that asked
    for it, each rollout's box made on the worker; a worker without a sandbox refuses them
    (the eval fails loudly, naming the fix), never running them without a box."""
    tag = uuid.uuid4().hex[:8]
    with ChatServer() as server:
        model = ["-m", "m", "--base-url", server.url]
        env = [f"{EXAMPLE}:CodingTasks", "--env-class", f"{EXAMPLE}:CodingAgent"]
        log = (tmp_path / "worker.log").open("wb")

        def worker(stream: str, *flags: str) -> subprocess.Popen[bytes]:
            return forkserver.popen(
                [sys.executable, "-m", "trio_tasksets", "worker", *env, "--feed",
                 redis_server.url, "--stream", stream, "--group", "g", "--results",
                 f"{stream}:results", "--no-dashboard", *model, *flags],
                stdout=subprocess.DEVNULL, stderr=log,
            )  # fmt: skip

        def via(stream: str, name: str) -> subprocess.CompletedProcess[str]:
            return cli(
                tmp_path, "eval", *env, *model, "--sandbox", "local", "-n", "2", "-o",
                str(tmp_path), "--no-dashboard", "--run-name", name, "--via",
                redis_server.url, "--stream", stream, "--max-failures", "1",
            )  # fmt: skip

        workers = [worker(f"{tag}:boxed", "--sandbox", "local"), worker(f"{tag}:bare")]
        try:
            done = via(f"{tag}:boxed", "boxed")
            assert done.returncode == 0, done.stderr + (tmp_path / "worker.log").read_text()
            refused = via(f"{tag}:bare", "bare")
        finally:
            for process in workers:
                process.terminate()
                process.wait(timeout=30)
            log.close()
    rows = [json.loads(line) for line in (tmp_path / "boxed" / "traces.jsonl").open()]
    assert [(row["ok"], row["metrics"]) for row in rows] == [(True, {"tests_ran": 1.0})] * 2
    assert refused.returncode == 1
    assert "start the worker with --sandbox local" in refused.stderr


async def test_a_running_server_without_the_sandbox_asked_for_is_refused(tmp_path: Path) -> None:
    """`--server-url`: the server's health says which sandbox it makes; an eval that asks for
    one the server does not make fails before its first slot, naming the fix."""
    spec = EnvSpec(f"{EXAMPLE}:CodingTasks", {}, env_class=f"{EXAMPLE}:CodingAgent")
    boxed = attrs_evolve(spec, sandbox="local").build()
    with trio.fail_after(60):
        async with spawn_server(boxed) as server:
            async with tt.EnvClient(server.url, token=server.token) as client:
                assert (await client.health())["sandbox"] == "local"
            asks_bwrap = attrs_evolve(spec, sandbox="bwrap").build()
            config = tt.EvalConfig(
                num_examples=1, output_dir=str(tmp_path), run_name="r", dashboard=False,
                backend=tt.ServedBackend(server_url=server.url, token=server.token),
            )  # fmt: skip
            with pytest.RaisesGroup(
                pytest.RaisesExc(
                    EnvServerError, match="asks for --sandbox bwrap, but env server .* runs "
                    "with local: start the server with --sandbox bwrap",
                ),
                allow_unwrapped=True, flatten_subgroups=True,
            ):  # fmt: skip
                await tt.run_eval(asks_bwrap, tt.ModelContext(tt.EchoClient(), "m"), config)


# --- how it travels -------------------------------------------------------------------------


def test_the_sandbox_travels_in_the_env_spec_and_is_rebuilt_there() -> None:
    spec = EnvSpec(
        f"{EXAMPLE}:CodingTasks", {}, env_class=f"{EXAMPLE}:CodingAgent",
        sandbox=SandboxSpec.parse("local"), max_sandboxes=tt.AdaptiveBounds(1, 2, 8),
    )  # fmt: skip
    back = EnvSpec.from_json(spec.to_json())
    assert back == spec
    env = back.build()
    assert env.sandboxes is not None
    assert env.sandboxes.spec == SandboxSpec.parse("local")
    window = env.sandboxes.admission.window
    assert isinstance(window, tt.AdaptiveWindow)
    assert (window.min, window.size, window.max) == (1, 2, 8)
    again = EnvSpec.of(env)  # and back again, as a spawned server gets it
    assert (again.sandbox, again.max_sandboxes) == (spec.sandbox, spec.max_sandboxes)
    own = EnvSpec(f"{EXAMPLE}:CodingTasks", {}, env_class=f"{EXAMPLE}:CodingAgent").build()
    assert own.sandboxes is not None
    assert own.sandboxes.spec is None
    assert EnvSpec.of(own).sandbox is None  # rebuilt by the class where it goes


def test_a_worker_refuses_an_entry_declared_with_another_sandbox() -> None:
    spec = EnvSpec(f"{EXAMPLE}:CodingTasks", {}, env_class=f"{EXAMPLE}:CodingAgent")
    eval_side = Declaration.of(attrs_evolve(spec, sandbox="bwrap").build())
    assert eval_side.sandbox == "bwrap"
    assert Declaration.from_json(eval_side.to_json()) == eval_side
    none = Declaration.of(spec.build())
    local = Declaration.of(attrs_evolve(spec, sandbox="local").build())
    assert "but this worker has no sandbox: start the worker with --sandbox bwrap" in str(
        eval_side.differs(none)
    )
    assert "this worker has --sandbox local" in str(eval_side.differs(local))
    assert eval_side.differs(eval_side) is None
    assert none.differs(local) is None  # the eval asked for none: the worker's own is fine


def attrs_evolve(spec: EnvSpec, *, sandbox: str) -> EnvSpec:
    return attrs.evolve(spec, sandbox=SandboxSpec.parse(sandbox))
