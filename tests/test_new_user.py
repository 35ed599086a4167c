"""What a new user met first (issue 25): right token figures, an interval inside the rewards'
bounds, a file taskset named as typed, fix lines that point at something, `eval --via` needing
only what the coordinator uses, a module TASKSET from the current folder, a context-length 400
named, and a misspelt option answered with the close one.

The model server is the project's fake OpenAI server (`tests/fixtures/chat_server.py`, real
sockets on 127.0.0.1); the command line runs in this process (`trio_tasksets._cli.main`).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import forkserver
import pytest
import trio

import trio_tasksets as tt
from trio_tasksets._report.data import load_run
from trio_tasksets._report.figures import compute
from trio_tasksets._report.stats import mean_interval, reward_interval, wilson_interval

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"
if str(FIXTURES) not in sys.path:
    sys.path.insert(0, str(FIXTURES))

from chat_server import ChatServer  # noqa: E402
from helpers import cli, need  # noqa: E402
from redis_server import RedisServer  # noqa: E402

LIMIT = 60  # seconds: real sockets, so the real clock; a hang fails the test


@pytest.fixture(scope="module")
def server() -> Iterator[ChatServer]:
    with ChatServer() as chat:
        yield chat


def summary_of(run_dir: Path) -> dict[str, Any]:
    return json.loads((run_dir / "summary.json").read_text())  # type: ignore[no-any-return]


class Sums(tt.Taskset[tt.Task, tt.TasksetConfig]):
    def load(self) -> list[tt.Task]:
        return [tt.Task(f"What is {i} + 1?", answer=str(i + 1)) for i in range(8)]


async def eval_sums(server: ChatServer, tmp_path: Path) -> tt.EvalResult:
    """The 8 `Sums` against `server`, into ``tmp_path/r``."""
    ctx = tt.ModelContext(tt.OpenAIClient(server.url), "m")
    config = tt.EvalConfig(output_dir=str(tmp_path), run_name="r", dashboard=False)
    with trio.fail_after(LIMIT):
        return await tt.run_eval(tt.Env(Sums()), ctx, config)


# --- token figures ---------------------------------------------------------------------------


async def test_usage_sums_prompt_and_completion_tokens_only_and_the_report_agrees(
    server: ChatServer, tmp_path: Path
) -> None:
    """The server sends `total_tokens` too (as OpenAI and vLLM do): it is not added in."""
    result = await eval_sums(server, tmp_path)
    assert result.summary["usage"] == {"prompt_tokens": 80, "completion_tokens": 8}
    row = json.loads((result.run_dir / "traces.jsonl").read_text().splitlines()[0])
    assert row["usage"]["total_tokens"] == 11  # the row keeps what the server said
    figures = compute(load_run(result.run_dir))
    assert figures.mismatches == []
    html = tt.report(result.run_dir).read_text()
    assert "disagree" not in html
    assert "11.0 per rollout" in html  # (80 + 8) / 8, not (80 + 8 + 88) / 8


async def test_an_old_summary_that_summed_total_tokens_reads_right(
    server: ChatServer, tmp_path: Path
) -> None:
    run_dir = (await eval_sums(server, tmp_path)).run_dir
    summary = summary_of(run_dir)
    summary["usage"]["total_tokens"] = 88  # as versions before this fix wrote it
    (run_dir / "summary.json").write_text(json.dumps(summary))
    html = tt.report(run_dir).read_text()
    assert "disagree" not in html
    assert "11.0 per rollout" in html


# --- the reward interval ----------------------------------------------------------------------


def test_the_wilson_interval_matches_the_textbook_and_stays_in_bounds() -> None:
    low, high = wilson_interval(8, 10)
    assert (round(low, 4), round(high, 4)) == (0.4902, 0.9433)  # Wilson (1927), z = 1.96
    assert wilson_interval(10, 10)[1] == 1.0
    assert wilson_interval(0, 10)[0] == 0.0


def test_a_0_1_reward_interval_is_wilson_and_never_leaves_0_1() -> None:
    values = [1.0] * 9 + [0.0]
    naive = mean_interval(values, list(range(10)))
    assert naive is not None
    assert naive[1] > 1.0
    interval = reward_interval(values, list(range(10)))
    assert interval is not None
    assert interval.method == "wilson"
    assert 0.0 <= interval.low < 0.9 < interval.high <= 1.0
    assert (interval.low, interval.high) == pytest.approx(wilson_interval(9, 10))
    every = reward_interval([1.0] * 10, list(range(10)))
    assert every is not None
    assert every.high == 1.0
    assert every.low < 1.0


def test_a_clustered_0_1_interval_counts_a_tasks_agreeing_rollouts_as_less() -> None:
    # 10 tasks x 4 rollouts that agree within a task: 40 rewards worth about 10 draws.
    values = [float(t < 7) for t in range(10) for _ in range(4)]
    clusters = [t for t in range(10) for _ in range(4)]
    clustered = reward_interval(values, clusters)
    independent = reward_interval(values, list(range(40)))
    assert clustered is not None
    assert independent is not None
    assert clustered.high - clustered.low > independent.high - independent.low
    assert clustered.low >= 0.0
    assert clustered.high <= 1.0


def test_fractional_rewards_in_0_1_are_clipped_and_others_left_alone() -> None:
    values = [1.0, 1.0, 1.0, 0.5, 1.0, 1.0]
    naive = mean_interval(values, list(range(6)))
    clipped = reward_interval(values, list(range(6)))
    assert naive is not None
    assert naive[1] > 1.0
    assert clipped is not None
    assert clipped.method == "t, clipped to [0, 1]"
    assert (clipped.low, clipped.high) == (naive[0], 1.0)
    wide = reward_interval([3.0, -1.0, 2.0], [0, 1, 2])
    assert wide is not None
    assert wide.method == "t"
    assert (wide.low, wide.high) == mean_interval([3.0, -1.0, 2.0], [0, 1, 2])


def test_the_report_says_which_interval_it_shows(tmp_path: Path) -> None:
    ctx = tt.ModelContext(tt.EchoClient(), "echo")

    class Mostly(Sums):
        def reward(self, task: tt.Task, completion: str) -> float:
            return 0.0 if task.answer == "1" else 1.0

    config = tt.EvalConfig(output_dir=str(tmp_path), run_name="r", dashboard=False)
    run_dir = trio.run(tt.run_eval, tt.Env(Mostly()), ctx, config).run_dir
    html = tt.report(run_dir).read_text()
    assert "(wilson, 8 rewards" in html
    figures = compute(load_run(run_dir))
    assert figures.reward_ci is not None
    assert figures.reward_ci.high <= 1.0


# --- a file taskset's name ---------------------------------------------------------------------


def test_a_file_taskset_is_named_as_typed_in_summary_and_report(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_tasks.py").write_text(
        textwrap.dedent("""
        import trio_tasksets as tt

        class JsonlArith(tt.Taskset):
            def load(self):
                return [tt.Task("What is 1 + 1?", answer="2")]
        """)
    )
    assert cli("eval", "my_tasks.py:JsonlArith", "--run-name", "r", "--no-dashboard") == 0
    run_dir = tmp_path / "outputs" / "r"
    assert summary_of(run_dir)["taskset"] == "my_tasks.py:JsonlArith"
    config = json.loads((run_dir / "config.json").read_text())
    assert config["identity"]["taskset"] == "my_tasks.py:JsonlArith"
    html = tt.report(run_dir).read_text()
    assert "my_tasks.py:JsonlArith" in html
    assert "_trio_tasksets_user_" not in html
    # --resume without --run-name still finds it by that name
    assert cli("eval", "my_tasks.py:JsonlArith", "--resume", "--no-dashboard") == 0
    assert "resuming outputs/r" in capsys.readouterr().err


# --- fix lines that point at something --------------------------------------------------------


FAILING = """
import trio_tasksets as tt

class Missing(tt.Taskset):
    def load(self):
        return [tt.Task(p) for p in open("no-such-file.jsonl")]

class WrongType(tt.Taskset):
    async def stream(self):
        yield "not a task"
"""


@pytest.mark.parametrize(
    ("target", "extra", "message"),
    [("tasks.py:Missing", (), "FileNotFoundError: [Errno 2] No such file or directory"),
     ("tasks.py:WrongType", ("-n", "1"), "TypeError: tasks need a str `key`")],
)  # fmt: skip
def test_a_run_that_keeps_no_run_dir_points_at_no_traces(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    target: str,
    extra: tuple[str, ...],
    message: str,
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tasks.py").write_text(FAILING)
    assert cli("eval", target, *extra, "--run-name", "r", "--no-dashboard") == 1
    err = capsys.readouterr().err
    assert message in err
    assert not (tmp_path / "outputs").exists()
    assert "traces.jsonl" not in err
    assert "fix: run again with --debug for the traceback" in err


def test_sigterm_prints_of_planned_and_no_traces_when_none_are_kept(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from trio_tasksets._cli.eval import _print_summary

    run_dir = tmp_path / "r"
    summary = {"ok": 28, "finished": 28, "planned": 80, "interrupted": True,
               "reward_mean": 1.0, "rollouts_per_s": 3.0, "usage": {}}  # fmt: skip
    run_dir.mkdir()
    (run_dir / "traces.jsonl").write_text("{}\n")
    _print_summary(summary, run_dir)
    out = capsys.readouterr().out
    assert out.startswith("28/28 ok (28 of 80 planned), reward mean 1.000")
    assert f"traces in {run_dir}/traces.jsonl" in out
    _print_summary({**summary, "interrupted": False, "planned": 28}, run_dir)
    assert capsys.readouterr().out.startswith("28/28 ok, reward mean")
    (run_dir / "traces.jsonl").unlink()
    _print_summary({**summary, "ok": 0, "finished": 0}, run_dir)
    out = capsys.readouterr().out
    assert "traces.jsonl" not in out
    assert "no run dir was kept" in out


def test_a_run_stopped_early_says_of_how_many_planned(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = cli("eval", "echo", "-c", "1", "--echo-delay", "0.3", "--time-limit", "0.5",
               "-o", str(tmp_path), "--run-name", "r", "--no-dashboard")  # fmt: skip
    assert code == 0
    summary = summary_of(tmp_path / "r")
    out = capsys.readouterr().out
    assert summary["stopped"] == "time_limit"
    assert summary["finished"] < summary["planned"]
    assert out.startswith(
        f"{summary['ok']}/{summary['finished']} ok ({summary['finished']} of "
        f"{summary['planned']} planned)"
    )


# --- eval --via: only what the coordinator uses ---------------------------------------------------


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A redis-server of this module's own: its commands use the default stream names."""
    need("redis-server", why="eval --via against a real Redis")
    server = RedisServer.on_free_ports(tmp_path_factory.mktemp("redis"))
    server.start()
    try:
        yield server.url
    finally:
        server.stop()


def test_eval_via_needs_no_base_url_and_keeps_no_run_dir_without_workers(
    redis_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The documented `eval ... --via URL -m MODEL`: no --base-url asked for. With no worker,
    a stop (here --time-limit; Ctrl-C drains the same way) names no traces path."""
    code = cli("eval", "echo", "--via", redis_url, "--stream", f"s{uuid.uuid4().hex[:6]}",
               "-m", "Qwen/Qwen3-8B", "--time-limit", "0.5", "-o", str(tmp_path),
               "--run-name", "r", "--no-dashboard")  # fmt: skip
    captured = capsys.readouterr()
    assert "needs --base-url" not in captured.err
    assert code == 1  # no episode succeeded within the limit
    assert "no run dir was kept" in captured.out + captured.err
    assert "traces.jsonl" not in captured.out + captured.err
    assert not (tmp_path / "r").exists()


def test_eval_via_says_the_endpoint_options_are_the_workers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A --base-url given to an `eval --via` (as the docs once required) is said to be unused,
    and the eval goes on (here to an unreachable Redis: exit 2, no run dir)."""
    code = cli("eval", "echo", "--via", "redis://127.0.0.1:9/0", "-m", "m", "--base-url",
               "http://127.0.0.1:9/v1", "-o", str(tmp_path), "--no-dashboard")  # fmt: skip
    assert code == 2
    err = capsys.readouterr().err
    assert (
        "warning: --base-url with --via: the workers call the model with their own, so this "
        "eval does not use it" in err
    )
    assert "error: --via redis://127.0.0.1:9/0: cannot reach Redis" in err
    assert not any(tmp_path.iterdir())


def test_worker_defaults_are_what_eval_via_assumes(
    redis_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from trio_tasksets._cli.main import parser

    args = parser().parse_args(["worker", "--feed", redis_url])
    assert (args.stream, args.group, args.results) == ("tasks", "workers", "results")
    # A worker started with only --feed serves an eval --via that names no --stream.
    stream = "tasks"
    worker = forkserver.popen(
        [sys.executable, "-m", "trio_tasksets", "worker", "echo", "--feed", redis_url,
         "--time-limit", "30", "--no-dashboard"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=tmp_path,
    )  # fmt: skip
    try:
        code = cli("eval", "echo", "-n", "3", "--via", redis_url, "--time-limit", "25",
                   "-o", str(tmp_path), "--run-name", "v", "--no-dashboard")  # fmt: skip
        assert code == 0, capsys.readouterr().err
        assert summary_of(tmp_path / "v")["ok"] == 3
    finally:
        worker.send_signal(signal.SIGTERM)
        worker.wait(timeout=30)
    assert stream == "tasks"


# --- a module TASKSET from the current folder -----------------------------------------------------


def test_a_module_taskset_in_the_current_folder_names_the_module_and_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    (tmp_path / "my_tasks.py").write_text("import trio_tasksets as tt\n")
    assert cli("eval", "my_tasks:Class", "--no-dashboard") == 2
    err = capsys.readouterr().err
    line = next(line for line in err.splitlines() if ": error: " in line)
    assert "no module named 'my_tasks' on the import path" in line
    assert "my_tasks.py:Class" in line
    assert "PYTHONPATH=." in line
    assert "importlib" not in line


def test_a_module_taskset_nowhere_says_so_without_a_stdlib_frame(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    assert cli("eval", "nowhere_tasks:Class", "--no-dashboard") == 2
    line = next(x for x in capsys.readouterr().err.splitlines() if ": error: " in x)
    assert "no module named 'nowhere_tasks' on the import path" in line
    assert "importlib" not in line


# --- a context-length 400 ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "fix"),
    [((), "fix: the prompt alone (4 tokens) is longer than the server's context of 4 tokens"),
     (("--max-tokens", "100"), "fix: --max-tokens 100 plus the prompt is more than the "
      "server's context of 8 tokens: lower --max-tokens (at most 4 for these prompts)")],
)  # fmt: skip
def test_a_context_length_400_names_its_cause(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: tuple[str, ...], fix: str
) -> None:
    context = 4 if not extra else 8
    with ChatServer(context=context) as chat:
        code = cli("eval", "echo", "-n", "1", "-m", "m", "--base-url", chat.url, *extra,
                   "-o", str(tmp_path), "--no-dashboard")  # fmt: skip
    assert code == 1
    captured = capsys.readouterr()
    assert "returned HTTP 400 after 1 attempt: " in captured.out
    assert "This model's maximum context length is" in captured.out
    assert fix in captured.err


# --- a misspelt option ----------------------------------------------------------------------------


def test_a_misspelt_option_is_answered_with_the_close_one(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli("eval", "echo", "--num-example", "3") == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: trio-tasksets eval")
    assert "unrecognized arguments: --num-example 3 (did you mean --num-examples?)" in err
    assert cli("eval", "echo", "--frobnicate") == 2
    err = capsys.readouterr().err
    assert "unrecognized arguments: --frobnicate" in err
    assert "did you mean" not in err


# --- -S/--sampling-args, and options that do nothing with the echo model ---------------------


def test_sampling_args_reach_every_request_tools_and_response_format_included(
    server: ChatServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    extra = {"response_format": {"type": "json_object"}, "tools": tools, "stop": ["\n"],
             "max_tokens": 5, "logprobs": True}  # fmt: skip
    server.reset()
    code = cli("eval", "echo", "-n", "2", "-m", "m", "--base-url", server.url,
               "--temperature", "0.5", "-S", json.dumps(extra), "-o", str(tmp_path),
               "--run-name", "s", "--no-dashboard")  # fmt: skip
    assert code == 0, capsys.readouterr().err
    assert len(server.requests) == 2
    for body in server.requests:
        assert body["temperature"] == 0.5
        assert {k: body[k] for k in extra} == extra
    identity = json.loads((tmp_path / "s" / "config.json").read_text())["identity"]
    assert identity["sampling"]["max_tokens"] == 5  # a named field: --tpm reserves it
    assert identity["sampling"]["extra"] == {k: v for k, v in extra.items() if k != "max_tokens"}


@pytest.mark.parametrize(
    ("args", "message"),
    [(["-S", "{"], "-S/--sampling-args is not JSON"),
     (["-S", "[1]"], "-S/--sampling-args must be a JSON object"),
     (["-S", '{"stream": true}'], "-S/--sampling-args: 'stream' is set by the client"),
     (["-S", '{"temperature": 1}', "--temperature", "0"],
      "--temperature and -S/--sampling-args 'temperature' both set temperature"),
     (["-S", '{"max_tokens": "many"}'], "'max_tokens' must be a number")],
)  # fmt: skip
def test_bad_sampling_args_are_usage_errors(
    capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    code = cli("eval", "echo", "-m", "m", "--base-url", "http://127.0.0.1:9/v1", *args,
               "--no-dashboard")  # fmt: skip
    assert code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "args",
    [["--timeout", "5"], ["--max-tokens", "5"], ["--temperature", "0"], ["--top-p", "0.5"],
     ["--sampling-seed", "1"], ["-S", '{"stop": ["x"]}']],
)  # fmt: skip
def test_options_that_do_nothing_with_echo_are_refused_alike(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str]
) -> None:
    assert cli("eval", "echo", *args, "-o", str(tmp_path), "--no-dashboard") == 2
    err = capsys.readouterr().err
    assert (
        f"{args[0] if args[0] != '-S' else '-S/--sampling-args'} does nothing with the echo model"
        in err
    )
    assert "fix: drop" in err
    assert not tmp_path.joinpath("outputs").exists()


def test_eval_via_ctrl_c_with_no_workers_names_no_traces(redis_url: str, tmp_path: Path) -> None:
    """Ctrl-C on an `eval --via` that no worker serves: no traces path, one 'no run dir'."""
    import redis

    stream = f"s{uuid.uuid4().hex[:6]}"
    proc = forkserver.popen(
        [sys.executable, "-m", "trio_tasksets", "eval", "echo", "--via", redis_url, "--stream",
         stream, "-m", "Qwen/Qwen3-8B", "-o", str(tmp_path), "--run-name", "r",
         "--no-dashboard"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
    )  # fmt: skip
    deadline = time.monotonic() + 60
    with redis.Redis.from_url(redis_url) as inspect:  # it waits for workers: its entries are out
        while not inspect.exists(stream) or inspect.xlen(stream) == 0:
            assert proc.poll() is None, "the eval ended before it waited for workers"
            assert time.monotonic() < deadline
            time.sleep(0.02)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "traces.jsonl" not in out + err
    assert (out + err).count("no run dir was kept") >= 1
    assert not (tmp_path / "r").exists()
