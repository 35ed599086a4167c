"""Sandboxes (SPEC 14, issue 34; issue 36's F1-F3 and F12).

1. The conformance suite: every backend present (`local`, `bwrap`, `docker` where a daemon
   answers; each skips saying why where it cannot run) does what `tt.Sandbox` promises:
   exec with stdin, env, cwd, a timeout and the caller's deadline; output capped; files
   confined to the work folder; nothing it starts outlives the command; aclose.
2. The security list of issue 34, one test per point, against `bwrap`.
3. Under a real SIGKILL of ``python -m trio_tasksets eval`` (a ToolEnv whose tool's command
   starts a setsid daemon, a double fork and a nohup job): no process survives (F1, F2), and
   what the command can read holds no ``OPENAI_API_KEY`` (F3); the next start reaps what
   the killed eval left on disk.

The sandboxed commands' pids are their namespace's, so the tests find processes on the host
by a marker in their command line (`helpers.marked`).
"""

from __future__ import annotations

import functools
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import trio
from helpers import marked, missing

import trio_tasksets as tt
from trio_tasksets import sandboxes
from trio_tasksets.sandboxes import _state
from trio_tasksets.sandboxes._docker import docker_available

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the sandboxes need Linux")

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"
SHELL_ENV = str(FIXTURES / "shell_env.py")
BWRAP_MISSING = missing("bwrap", why="the bwrap sandbox")


@functools.cache
def _docker_missing() -> str | None:
    return docker_available() if sys.platform == "linux" else "not Linux"


BACKENDS: dict[str, tuple[Callable[..., Any], Callable[[], str | None]]] = {
    "local": (sandboxes.local, lambda: None),
    "bwrap": (sandboxes.bwrap, lambda: BWRAP_MISSING),
    # as bwrap runs for a user who is not root (here: root asking for uid 0): a bubblewrap
    # per command, its limits inside
    "bwrap-per-command": (lambda **o: sandboxes.bwrap(user=0, **o), lambda: BWRAP_MISSING),
    "docker": (lambda **o: sandboxes.docker("debian:stable-slim", **o), _docker_missing),
}


@pytest.fixture(params=sorted(BACKENDS))
def backend(request: pytest.FixtureRequest) -> Callable[..., Any]:
    make, why_not = BACKENDS[request.param]
    reason = why_not()
    if reason is not None:
        pytest.skip(f"{request.param}: {reason}")
    return make


@pytest.fixture
async def box(backend: Callable[..., Any]) -> AsyncIterator[tt.Sandbox]:
    async with sandboxes.open_sandbox(backend(timeout=20, grace=0.2)) as made:
        yield made


async def _none_left(token: str) -> None:
    with trio.fail_after(5):
        while marked(token):  # noqa: ASYNC110 (a process's state: no event to wait on)
            await trio.sleep(0.01)


# --- 1. conformance ---------------------------------------------------------------------------


async def test_exec_runs_a_string_with_sh_and_a_list_as_argv(box: tt.Sandbox) -> None:
    result = await box.exec("echo out; echo err >&2; exit 3")
    assert result == tt.ExecResult(3, b"out\n", b"err\n", False)
    assert isinstance(box, tt.Sandbox)
    listed = await box.exec(["printf", "%s|", "a b", "$HOME"])
    assert (listed.returncode, listed.stdout) == (0, b"a b|$HOME|")


async def test_exec_takes_stdin_env_and_cwd(box: tt.Sandbox) -> None:
    assert (await box.exec("cat", input=b"given")).stdout == b"given"
    big = os.urandom(1 << 20)  # more than a pipe holds: sent while the output is read
    assert (await box.exec(["cat"], input=big)).stdout == big
    assert (await box.exec("echo $MINE", env={"MINE": "1"})).stdout == b"1\n"
    await box.exec("mkdir -p sub/dir")
    assert (await box.exec("pwd", cwd="sub/dir")).stdout.endswith(b"/sub/dir\n")


async def test_the_command_sees_none_of_the_evals_environment(
    box: tt.Sandbox, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "sk-secret-F3")
    result = await box.exec(
        "env; tr '\\0' '\\n' < /proc/$PPID/environ; cat /proc/[0-9]*/environ; ls /proc"
    )
    assert b"sk-secret-F3" not in result.stdout + result.stderr
    # it sees its own processes only: no eval, no pytest
    pids = [p for p in result.stdout.split() if p.isdigit()]
    assert len(pids) < 10, pids


async def test_a_kill_signal_is_reported_as_subprocess_does(box: tt.Sandbox) -> None:
    assert (await box.exec("kill -KILL $$")).returncode == -signal.SIGKILL


async def test_a_timeout_kills_the_command_and_keeps_what_it_wrote(box: tt.Sandbox) -> None:
    with pytest.raises(sandboxes.ExecTimeoutError) as caught:
        await box.exec("echo early; trap '' TERM; sleep 60.9101", timeout=0.5)
    assert caught.value.result.stdout == b"early\n"
    assert caught.value.timeout == 0.5
    await _none_left("60.9101")


async def test_the_callers_deadline_cuts_the_timeout(box: tt.Sandbox) -> None:
    began = trio.current_time()
    with trio.move_on_after(1.0):
        with pytest.raises(sandboxes.ExecTimeoutError) as caught:
            await box.exec("sleep 60.9102", timeout=30)
        assert caught.value.timeout < 1.0
    assert trio.current_time() - began < 2.0
    await _none_left("60.9102")


async def test_a_cancelled_exec_kills_the_command(box: tt.Sandbox) -> None:
    async with trio.open_nursery() as nursery:
        nursery.start_soon(box.exec, "sleep 60.9103")
        with trio.fail_after(5):
            while not marked("60.9103"):  # noqa: ASYNC110
                await trio.sleep(0.01)
        nursery.cancel_scope.cancel()
    await _none_left("60.9103")


@pytest.mark.parametrize(
    "detach",
    ["setsid sleep {t} &", "(sleep {t} &);", "nohup sleep {t} >/dev/null 2>&1 &", "sleep {t} &"],
    ids=["setsid", "double fork", "nohup", "background"],
)
async def test_nothing_the_command_starts_outlives_the_box(
    backend: Callable[..., Any], detach: str
) -> None:
    """A detached process lives at most as long as its box (`local`: as its command, each
    command being a PID namespace of its own)."""
    token = f"60.92{abs(hash(detach)) % 100:02d}"
    async with sandboxes.open_sandbox(backend()) as box:
        with trio.fail_after(10):
            result = await box.exec(detach.format(t=token) + " echo done")
        assert result.stdout == b"done\n"
        if isinstance(backend(), type(sandboxes.local())):
            await _none_left(token)
    await _none_left(token)


async def test_output_is_capped_and_said_so(backend: Callable[..., Any]) -> None:
    async with sandboxes.open_sandbox(backend(max_output=100)) as small:
        result = await small.exec("head -c 100000 /dev/zero; echo x >&2")
    assert (len(result.stdout), result.stderr, result.truncated) == (100, b"x\n", True)


async def test_files_round_trip_inside_the_work_folder(box: tt.Sandbox) -> None:
    await box.write_file("a/b/c.txt", b"one")
    assert (await box.exec("cat a/b/c.txt")).stdout == b"one"
    await box.exec("echo two > made.txt")
    assert await box.read_file("made.txt") == b"two\n"
    await box.write_file("a/b/c.txt", b"2")
    assert await box.read_file("./a/b/c.txt") == b"2"
    with pytest.raises(FileNotFoundError):
        await box.read_file("missing.txt")


@pytest.mark.parametrize("path", ["../x", "a/../../x", "/etc/passwd", "/", ""])
async def test_a_file_path_cannot_leave_the_work_folder(box: tt.Sandbox, path: str) -> None:
    with pytest.raises(sandboxes.SandboxError):
        await box.write_file(path, b"x")
    with pytest.raises(sandboxes.SandboxError):
        await box.read_file(path)


async def test_a_symlink_made_in_the_box_is_not_followed(box: tt.Sandbox) -> None:
    await box.exec("ln -s /etc out; ln -s /etc/hostname host; mkdir d; ln -s .. d/up")
    for path in ("out/passwd", "host", "d/up/x"):
        with pytest.raises(sandboxes.SandboxError, match="symlink"):
            await box.read_file(path)
        with pytest.raises(sandboxes.SandboxError, match="symlink"):
            await box.write_file(path, b"x")


async def test_a_command_over_the_argument_limit_says_E2BIG(box: tt.Sandbox) -> None:
    """F12: the cause, not an ExceptionGroup."""
    with pytest.raises(sandboxes.SandboxError, match="E2BIG") as caught:
        await box.exec("echo " + "x" * 300_000)
    assert "131072" in str(caught.value)


async def test_aclose_is_idempotent_and_ends_the_box(backend: Callable[..., Any]) -> None:
    async with sandboxes.open_sandbox(backend()) as made:
        await made.write_file("f", b"x")
        await made.aclose()
        await made.aclose()
        with pytest.raises(sandboxes.SandboxError, match="closed"):
            await made.exec("true")


# --- factories ------------------------------------------------------------------------------


async def test_open_sandbox_takes_either_kind_of_factory() -> None:
    made: list[tt.Sandbox] = []

    async def awaitable() -> tt.Sandbox:
        box = await sandboxes.local()().__aenter__()  # a box whose owner closes it
        made.append(box)
        return box

    async with sandboxes.open_sandbox(awaitable) as box:
        assert (await box.exec("echo 1")).stdout == b"1\n"
    with pytest.raises(sandboxes.SandboxError, match="closed"):
        await made[0].exec("true")
    with pytest.raises(TypeError, match="sandbox"):
        async with sandboxes.open_sandbox(lambda: 3):
            pass


def test_backends_are_named_as_on_the_command_line() -> None:
    assert isinstance(sandboxes.parse("local"), type(sandboxes.local()))
    assert isinstance(sandboxes.parse("bwrap"), type(sandboxes.bwrap()))
    assert sandboxes.parse("docker:python:3.12-slim").image == "python:3.12-slim"  # type: ignore[attr-defined]
    assert sandboxes.parse("trio_tasksets.sandboxes:local") is sandboxes.local
    for bad, match in [
        ("docker:", "docker needs an image"),
        ("nope", "local, bwrap"),
        ("no_such_module_x:f", "cannot load"),
        ("trio_tasksets.sandboxes:__doc__", "not a sandbox factory"),
    ]:
        with pytest.raises(tt.ConfigError, match=match) as caught:
            sandboxes.parse(bad)
        assert caught.value.parameter == "sandbox"


def test_bad_options_are_named() -> None:
    cases: list[tuple[Callable[[], object], str]] = [
        (lambda: sandboxes.local(timeout=0), "timeout"),
        (lambda: sandboxes.local(memory=-1), "memory"),
        (lambda: sandboxes.local(max_output=-1), "max_output"),
        (lambda: sandboxes.local(bogus=1), "bogus"),
        (lambda: sandboxes.local(workdir="/no/such/dir"), "workdir"),
        (lambda: sandboxes.bwrap(hide="/home"), "hide"),
        (lambda: sandboxes.bwrap(root="/no/such/root"), "root"),
        (lambda: sandboxes.bwrap(tmp_size=0), "tmp_size"),
        (lambda: sandboxes.docker(""), "image"),
    ]
    for make, name in cases:
        with pytest.raises(tt.ConfigError) as caught:
            make()
        assert caught.value.parameter == name


async def test_docker_says_why_it_cannot_run_here() -> None:
    reason = _docker_missing()
    if reason is None:
        pytest.skip("a Docker daemon answers here: the conformance suite runs it")
    with pytest.raises(sandboxes.SandboxError, match="cannot run here"):
        async with sandboxes.open_sandbox(sandboxes.docker("debian:stable-slim")):
            pass


# --- 2. security, against bwrap ---------------------------------------------------------------

security = pytest.mark.skipif(BWRAP_MISSING is not None, reason=BWRAP_MISSING or "")


@pytest.fixture
async def bwrap_box() -> AsyncIterator[tt.Sandbox]:
    async with sandboxes.open_sandbox(sandboxes.bwrap(timeout=20)) as made:
        yield made


@security
async def test_the_box_reaches_no_network_not_even_127_0_0_1(bwrap_box: tt.Sandbox) -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        result = await bwrap_box.exec(
            ["/bin/bash", "-c", f"exec 3<>/dev/tcp/127.0.0.1/{port} && echo connected"]
        )
    assert result.returncode != 0
    assert b"connected" not in result.stdout
    interfaces = await bwrap_box.exec("cat /proc/net/dev")
    assert [line.split(b":")[0].strip() for line in interfaces.stdout.splitlines()[2:]] == [b"lo"]


@security
async def test_the_box_writes_nowhere_but_its_work_folder(
    bwrap_box: tt.Sandbox, tmp_path: Path
) -> None:
    target = tmp_path / "host-file"
    target.write_text("host")
    script = (
        f"echo x > {target}; echo x > /etc/tt-test; echo x > /usr/tt-test; echo x > /tt-test; "
        "echo x > /tmp/inside && echo x > /work/inside && echo ok"
    )
    result = await bwrap_box.exec(script)
    assert result.stdout == b"ok\n"
    assert target.read_text() == "host"
    for path in ("/etc/tt-test", "/usr/tt-test", "/tt-test", "/tmp/inside"):
        assert not await trio.Path(path).exists(), path
    assert await bwrap_box.read_file("inside") == b"x\n"


@security
async def test_the_box_cannot_see_or_signal_host_processes(bwrap_box: tt.Sandbox) -> None:
    host = subprocess.Popen(["sleep", "60.9301"])  # noqa: ASYNC220 (a host process to hide)
    try:
        result = await bwrap_box.exec(
            f"ls /proc | grep -c '^[0-9]'; kill -0 {host.pid} && echo reached; "
            "pkill -f 60.9301; echo done"
        )
        assert b"reached" not in result.stdout
        assert int(result.stdout.split()[0]) < 10
        assert host.poll() is None  # alive
    finally:
        host.kill()
        host.wait()


@security
async def test_a_fork_bomb_is_bounded_and_reported() -> None:
    async with sandboxes.open_sandbox(sandboxes.bwrap(processes=64, timeout=1.5)) as box:
        try:
            result = await box.exec(["/bin/bash", "-c", "b() { b | b & }; b; sleep 0.5; echo end"])
            said = result.stdout + result.stderr
        except sandboxes.ExecTimeoutError as exc:
            said = exc.result.stdout + exc.result.stderr
    assert b"fork" in said.lower() or b"resource temporarily unavailable" in said.lower()


@security
async def test_a_10_gb_file_is_bounded_and_reported() -> None:
    async with sandboxes.open_sandbox(sandboxes.bwrap(file_size=1 << 20)) as box:
        result = await box.exec("head -c 10G /dev/zero > big")
        size = len(await box.read_file("big"))
    assert result.returncode == -signal.SIGXFSZ
    assert size == 1 << 20


@security
async def test_1_gb_of_output_is_bounded_and_reported() -> None:
    factory = sandboxes.bwrap(max_output=1 << 16, output_limit=8 << 20, timeout=20)
    async with sandboxes.open_sandbox(factory) as box:
        with trio.fail_after(15):
            result = await box.exec("head -c 1G /dev/zero")
    assert result.truncated
    assert len(result.stdout) == 1 << 16
    assert b"output_limit" in result.stderr
    assert result.returncode == -signal.SIGKILL


@security
async def test_the_file_tools_cannot_escape_the_bwrap_work_folder(bwrap_box: tt.Sandbox) -> None:
    await bwrap_box.write_file("/work/ok.txt", b"ok")  # an absolute path inside is fine
    assert (await bwrap_box.exec("cat /work/ok.txt")).stdout == b"ok"
    await bwrap_box.exec("ln -s / root; ln -s /etc/passwd pw")
    for path in ("../../etc/passwd", "/etc/passwd", "/work/../etc/passwd", "root/etc/passwd", "pw"):
        with pytest.raises(sandboxes.SandboxError):
            await bwrap_box.read_file(path)
        with pytest.raises(sandboxes.SandboxError):
            await bwrap_box.write_file(path, b"x")


# --- 3. a SIGKILLed eval (F1, F2, F3) -----------------------------------------------------------


def _eval(tmp_path: Path, url: str, env: dict[str, str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [
            sys.executable, "-m", "trio_tasksets", "eval", f"{SHELL_ENV}:Sums",
            "--env-class", f"{SHELL_ENV}:ShellEnv", "-m", "m", "--base-url", url,
            "-n", "2", "-o", str(tmp_path), "--run-name", "r", "--no-dashboard",
        ],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT), "OPENAI_API_KEY": "sk-F3-secret", **env},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )  # fmt: skip


@pytest.mark.parametrize("box", ["local", "bwrap"])
def test_a_sigkilled_eval_leaves_no_process_and_its_leftovers_are_reaped(
    tmp_path: Path, box: str
) -> None:
    """F1, F2: the eval is SIGKILLed while its tool's command sleeps, having started a
    setsid daemon, a double fork and a nohup job: none of them survives. The next start
    reaps the owner folder the killed eval left."""
    if box == "bwrap" and BWRAP_MISSING:
        pytest.skip(BWRAP_MISSING)
    from chat_server import ChatServer

    token = f"61.{secrets.randbelow(10**6):06d}{box == 'bwrap':d}"  # (unique to this run)
    with ChatServer(tools=True) as server:
        process = _eval(
            tmp_path, server.url, {"TT_TEST_SHELL": f"detach:{token}", "TT_TEST_BOX": box}
        )
        try:
            for _ in range(3000):  # until the command and its three detached sleeps run
                if len([p for p in marked(f"sleep {token}") if _comm(p) == "sleep"]) >= 4:
                    break
                if process.poll() is not None:
                    pytest.fail(f"the eval ended early: {process.stderr.read().decode()}")  # type: ignore[union-attr]
                subprocess.run(["sleep", "0.01"], check=True)
            else:
                pytest.fail("the command's processes never all started")
            process.send_signal(signal.SIGKILL)
            process.wait()
        finally:
            process.kill()
            process.wait()
        for _ in range(1500):
            if not marked(token):
                break
            subprocess.run(["sleep", "0.01"], check=True)
        left = marked(token)
        assert not left, subprocess.run(
            ["ps", "-o", "pid,ppid,sid,stat,etimes,cmd", "-p", ",".join(map(str, left))],
            capture_output=True,
            text=True,
        ).stdout
    root = Path(tempfile.gettempdir()) / f"trio-tasksets-sandboxes-{os.getuid()}"
    _state.reap(root)  # (another start may have reaped it already: both are fine)
    assert not [f for f in root.iterdir() if f.name.startswith(f"{process.pid}-")]


def test_the_next_start_reaps_what_a_dead_owner_left(tmp_path: Path) -> None:
    """An owner folder whose process is gone (a pid with another start time) is removed,
    after running the cleanup of each leftover it notes (a container a docker box made)."""
    root = tmp_path / "root"
    dead = root / f"{os.getpid()}-1"  # this pid, but not this process's start time
    (dead / "leftovers").mkdir(parents=True)
    (dead / "bwrap-0" / "work").mkdir(parents=True)
    done = tmp_path / "cleaned"
    (dead / "leftovers" / "tt-x").write_text("\0".join(["touch", str(done)]))
    alive = root / _state.owner_folder().name
    alive.mkdir()
    assert _state.reap(root) == [dead.name]
    assert not dead.exists()
    assert done.exists()
    assert alive.exists()


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


@pytest.mark.parametrize("box", ["local", "bwrap"])
def test_the_command_reads_no_api_key_by_any_path(tmp_path: Path, box: str) -> None:
    """F3: the eval holds OPENAI_API_KEY; its tool's command reads every /proc/*/environ it
    can, its parent's and its own environment: the key is in none of them."""
    if box == "bwrap" and BWRAP_MISSING:
        pytest.skip(BWRAP_MISSING)
    from chat_server import ChatServer

    with ChatServer(tools=True) as server:
        process = _eval(tmp_path, server.url, {"TT_TEST_SHELL": "leak", "TT_TEST_BOX": box})
        _, stderr = process.communicate(timeout=120)
    assert process.returncode == 0, stderr.decode()
    rows = [json.loads(line) for line in (tmp_path / "r" / "traces.jsonl").read_text().splitlines()]
    answers = [m["content"] for row in rows for m in row["messages"] if m["role"] == "tool"]
    assert answers
    assert all("leaks=0" in answer for answer in answers), answers
    assert not any("sk-F3-secret" in answer for answer in answers)
