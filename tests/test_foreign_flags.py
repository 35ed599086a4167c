"""Flags from inspect_ai's `inspect eval` and verifiers' `vf-eval` (issue 35, item 9): a
usage error (exit 2) that says how this tool spells the flag, instead of a bare
"unrecognized arguments"; a flag both spell alike and mean alike is simply taken.

The command line runs in this process (`trio_tasksets._cli.main`).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from chat_server import ChatServer
from helpers import cli

# (the words, what the error line must say)
# duplicates: a table of other tools' flags and their hints: its rows are alike by design
HINTS = [
    # inspect eval
    (["--limit", "5"], "inspect eval's --limit: this tool spells it -n/--num-examples N"),
    (["--epochs", "3"], "inspect eval's --epochs: this tool spells it -r/--rollouts-per-example R"),
    (
        ["--max-samples", "8"],
        "inspect eval's --max-samples: this tool spells it -c/--max-concurrent",
    ),
    (["--max-tasks", "2"], "inspect eval's --max-tasks: one eval runs one taskset here"),
    (["--model-base-url", "http://h/v1"], "this tool spells it --base-url URL"),
    (["--log-dir", "logs"], "inspect eval's --log-dir: this tool spells it -o/--output-dir DIR"),
    (["--fail-on-error", "0.1"], "this tool spells it --max-failures N|FRACTION"),
    (["--retry-on-error", "2"], "this tool spells it --retries K"),
    (["--sample-shuffle"], "this tool spells it --shuffle"),
    (["--display", "plain"], "this tool spells it --no-dashboard"),
    (["--system-message", "be brief"], "this tool spells it --system-prompt TEXT"),
    # both
    (["--max-retries", "3"], "--retries K retries whole episodes"),
    (["-T", "0.7"], "vf-eval's temperature is --temperature T here, inspect eval's task"),
    (["--temp", "0.7"], "this tool spells it --temperature T"),
    # vf-eval
    (["--rollouts", "4"], "vf-eval's --rollouts: this tool spells it -r/--rollouts-per-example R"),
    (["--max-concurrent-requests", "8"], "this tool spells it -c/--max-concurrent"),
    (["--api-base-url", "http://h/v1"], "vf-eval's --api-base-url: this tool spells it --base-url"),
    (["-b", "http://h/v1"], "vf-eval's -b: this tool spells it --base-url URL"),
    (["-k", "MY_KEY"], "vf-eval's -k: this tool spells it --api-key-var VAR"),
    (["-t", "256"], "vf-eval's -t: this tool spells it --max-tokens N"),
    (["--save-dataset"], "every run is saved here"),
    (["-s"], "every run is saved here"),
    (["--shuffle-seed", "3"], "this tool spells it --seed S"),
    (["-R"], "vf-eval's -R: this tool spells it --resume"),
    (["--independent-scoring"], "scored alone by default here"),
    # verifiers' newer `eval`
    (["--num-tasks", "5"], "this tool spells it -n/--num-examples N"),
    (["--group-size", "4"], "this tool spells it -r/--rollouts-per-example R"),
    (["--client.base-url", "http://h/v1"], "this tool spells it --base-url URL"),
    (["--sampling.max_tokens", "64"], "this tool spells it --max-tokens N"),
    (["--env.agent.harness.id", "null"], "this tool spells it --env-args JSON"),
]


@pytest.mark.parametrize(("words", "hint"), HINTS, ids=[words[0] for words, _ in HINTS])
def test_a_foreign_flag_is_answered_with_this_tools_spelling(
    words: list[str], hint: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli("eval", "echo", *words) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: trio-tasksets eval")
    assert "unrecognized arguments" in err
    assert hint in err, err
    assert "did you mean" not in err  # the foreign hint, not a near spelling of ours


def test_every_foreign_flag_of_a_command_line_is_answered(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli("eval", "echo", "--limit", "5", "--epochs", "2", "--num-example", "3") == 2
    err = capsys.readouterr().err
    assert "unrecognized arguments: --limit 5 --epochs 2 --num-example 3" in err
    assert "-n/--num-examples N" in err
    assert "-r/--rollouts-per-example R" in err
    assert "did you mean --num-examples?" in err  # our own misspelt flag, as before


def test_a_hint_names_only_a_flag_the_command_has(capsys: pytest.CaptureFixture[str]) -> None:
    """`report` has no -n: inspect's --limit gets no hint pointing at one."""
    assert cli("report", "some-run", "--limit", "5") == 2
    err = capsys.readouterr().err
    assert "unrecognized arguments: --limit 5" in err
    assert "num-examples" not in err


def test_flags_spelt_and_meant_alike_are_taken(tmp_path: Path, chat: ChatServer) -> None:
    """-n, -r, -c, -m, --max-tokens, --temperature, --max-connections, -S and -o mean what
    inspect and vf-eval mean by them."""
    assert cli("eval", "echo", "-n", "2", "-r", "2", "-c", "4", "-m", "m", "--base-url",
               chat.url, "--max-tokens", "8", "--temperature", "0.5", "--max-connections", "4",
               "-S", '{"top_p": 0.9}', "-o", str(tmp_path), "--no-dashboard") == 0  # fmt: skip


def test_seed_without_shuffle_names_the_models_seed(capsys: pytest.CaptureFixture[str]) -> None:
    """inspect's --seed is the model's; here --seed seeds --shuffle."""
    assert cli("eval", "echo", "--seed", "42") == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]  # the error, below the usage
    assert "--seed does nothing without --shuffle" in line
    assert "--sampling-seed N" in line


def test_env_args_without_a_verifiers_env_names_taskset_args(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """vf-eval's --env-args are the env's arguments; here a taskset's own are -a."""
    assert cli("eval", "echo", "--env-args", '{"phrases": ["x"]}') == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--env-args applies to a verifiers env" in line
    assert "-a/--taskset-args JSON" in line
