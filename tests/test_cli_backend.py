"""`eval` builds where its slots run (a backend) from its flags at its edge, then asks the
backend, not its own arguments, what acts where (in this process, the flags parsed as the
command parses them; a refusal as the user sees it, exit 2)."""

from __future__ import annotations

from pathlib import Path

import pytest

import trio_tasksets as tt
from trio_tasksets._cli.eval import eval_command
from trio_tasksets._cli.main import main, parser


def built(monkeypatch: pytest.MonkeyPatch, *flags: str) -> tt.EvalConfig:
    monkeypatch.setenv("TT_SERVE_TOKEN", "the-token")
    args = parser().parse_args(["eval", "echo", *flags])
    return eval_command(args).config


def refused(capsys: pytest.CaptureFixture[str], tmp_path: Path, *flags: str) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(["eval", "echo", "-o", str(tmp_path), *flags])
    assert exit_info.value.code == 2
    assert not any(tmp_path.iterdir())  # nothing written
    return capsys.readouterr().err


def test_the_flags_build_the_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    assert built(monkeypatch).backend == tt.InProcess()
    assert built(monkeypatch, "--serve", "--workers", "2").backend == tt.ServedBackend(workers=2)
    running = built(monkeypatch, "--server-url", "http://127.0.0.1:9").backend
    assert running == tt.ServedBackend(server_url="http://127.0.0.1:9", token="the-token")
    pytest.importorskip("hiredis")
    from trio_tasksets.redis import ViaBackend

    via = built(monkeypatch, "--via", "redis://127.0.0.1:9/0", "--stream", "s").backend
    assert via == ViaBackend("redis://127.0.0.1:9/0", stream="s")
    assert built(monkeypatch, "--via", "redis://127.0.0.1:9/0").backend == ViaBackend(
        "redis://127.0.0.1:9/0"
    )


@pytest.mark.parametrize(
    ("flags", "message"),
    [(["--serve", "--server-url", "http://h"],
      "--serve and --server-url: choose one (spawn a server, or use one)"),
     (["--via", "redis://h", "--serve"], "--via and --serve: choose one"),
     (["--via", "redis://h", "--server-url", "http://h"], "--via and --server-url: choose one"),
     (["--workers", "2"], "--workers applies to a spawned server: add --serve"),
     (["--workers", "0"], "--workers must be an integer >= 1, got 0"),
     (["--serve", "--workers", "0"], "--workers must be an integer >= 1, got 0"),
     (["--stream", "s"], "--stream names the workers' stream: it needs --via"),
     (["--via", "redis://h", "--workers", "2"],
      "--workers applies to a server spawned with --serve, not to --via"),
     (["--server-url", "http://h", "--workers", "2"],
      "--workers applies to a server spawned with --serve, not to --server-url"),
     (["--server-url", "ftp://h"], "--server-url must be an http:// or https:// URL"),
     (["--via", "http://h"], "--via: ")],
)  # fmt: skip
def test_contradicting_flags_are_usage_errors_naming_flags(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, flags: list[str], message: str
) -> None:
    if "--via" in flags and "--serve" not in flags and "--server-url" not in flags:
        pytest.importorskip("hiredis")
    assert message in refused(capsys, tmp_path, *flags)


@pytest.mark.parametrize(
    ("flags", "message"),
    [(["--serve", "--rpm", "60"], "--rpm with --serve: the model calls are made by the env "
      "server child, where this eval's limits cannot act; fix: drop --rpm, or run in-process "
      "(without --serve)"),
     (["--server-url", "http://h", "--stall-timeout", "5"],
      "--stall-timeout with --server-url: the episodes run in the env server, whose own "
      "--stall-timeout bounds them; fix: drop --stall-timeout here (start it with "
      "trio-tasksets serve)"),
     (["--server-url", "http://h", "--reward", "r.py:f"],
      "--reward with --server-url: the env server scores the episodes, with its own "
      "TASKSET's reward"),
     (["--via", "redis://h", "--reward", "r.py:f"],
      "--reward with --via: the workers score the episodes, with their own TASKSET's reward"),
     (["--via", "redis://h", "--working-limit", "5"],
      "--working-limit with --via: the episodes run in the workers")],
)  # fmt: skip
def test_what_acts_only_where_the_slots_run_is_asked_of_the_backend(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, flags: list[str], message: str
) -> None:
    if "--via" in flags:
        pytest.importorskip("hiredis")
    if "--rpm" in flags:
        flags = [*flags, "-m", "m", "--base-url", "http://127.0.0.1:9/v1"]
    assert message in refused(capsys, tmp_path, *flags)


def test_a_spawned_server_runs_the_evals_own_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """--serve sends the env (its spec): its per-rollout limits apply there, so they are kept."""
    config = built(monkeypatch, "--serve", "--rollout-timeout", "5")
    assert config.backend == tt.ServedBackend()
