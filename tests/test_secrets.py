"""A URL's password is shown nowhere (issue 36, F11): a `--base-url http://user:pw@host/v1`
(the client never sends it) or an `--engine-metrics` URL is redacted in the `/metrics` labels, config.json, summary.json,
the rows, the report, the client's repr and the command's error lines, as Redis and proxy URLs
are (one helper, `redact_url`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
from chat_server import ChatServer
from helpers import cli

import trio_tasksets as tt
from trio_tasksets._core.health import Health
from trio_tasksets._monitor.metrics import Metrics
from trio_tasksets._serve.policy import ModelPolicy, normalize_base_url
from trio_tasksets._serve.wire import OpenAISpec
from trio_tasksets._transport import redact_url
from trio_tasksets.redis._entries import redact

SECRET = "s3cret-pw"
SUMS = str(Path(__file__).parent / "fixtures" / "calc_env.py") + ":Sums"


def with_password(url: str) -> str:
    return url.replace("http://", f"http://alice:{SECRET}@")


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("http://alice:pw@h:1/v1", "http://alice:***@h:1/v1"),
        ("--base-url=http://alice:pw@h/v1", "--base-url=http://alice:***@h/v1"),
        ("redis://:pw@127.0.0.1:6379/0", "redis://:***@127.0.0.1:6379/0"),
        ("http://u:p@ss@host/v1", "http://u:***@host/v1"),  # the last @ ends the userinfo
        ("see http://a:b@h and https://c:d@e/x", "see http://a:***@h and https://c:***@e/x"),
        ("http://alice@h/v1", "http://alice@h/v1"),  # no password: nothing to hide
        ("http://h/v1?x=a:b@c", "http://h/v1?x=a:b@c"),  # not userinfo
        ("http://127.0.0.1:8000/v1", "http://127.0.0.1:8000/v1"),
    ],
)
def test_redact_url(text: str, shown: str) -> None:
    assert redact_url(text) == shown
    assert redact(text) == shown  # Redis URLs: the same helper


def test_a_base_url_password_is_shown_nowhere(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with ChatServer() as one, ChatServer() as two:
        urls = [with_password(one.url), with_password(two.url)]
        metrics_urls = [url.removesuffix("/v1") + "/metrics" for url in urls]
        code = cli(
            "eval", SUMS, "-m", "sim", "--base-url", urls[0], "--base-url", urls[1],
            "--engine-metrics", metrics_urls[0], "--engine-metrics", metrics_urls[1],
            "-o", str(tmp_path), "--run-name", "run", "--no-dashboard",
        )  # fmt: skip
        assert code == 0, capsys.readouterr().err
        assert all(auth is None for auth in one.authorizations + two.authorizations)
        client = tt.OpenAIClient(urls)
        metrics = Metrics(Health(), endpoints=client.endpoint_stats)
        labels = metrics.text().decode()
        trio.run(client.aclose)
    run_dir = tmp_path / "run"
    html = tt.report(run_dir).read_text()
    shown = {
        "config.json": (run_dir / "config.json").read_text(),
        "summary.json": (run_dir / "summary.json").read_text(),
        "traces.jsonl": (run_dir / "traces.jsonl").read_text(),
        "report": html,
        "/metrics": labels,
        "repr": repr(client),
        "output": "".join(capsys.readouterr()),
    }
    assert [name for name, text in shown.items() if SECRET in text] == []
    assert f'"base_url": "{redact_url(urls[0])}"' in shown["config.json"]
    assert f'endpoint="{redact_url(urls[1])}"' in labels
    assert "alice:***@" in html


def test_a_failing_base_url_names_no_password(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from helpers import free_port

    url = f"http://alice:{SECRET}@127.0.0.1:{free_port()}/v1"  # nothing answers there
    code = cli(
        "eval", SUMS, "-n", "1", "-m", "sim", "--base-url", url, "--timeout", "5",
        "-o", str(tmp_path), "--run-name", "run", "--no-dashboard",
    )  # fmt: skip
    err = capsys.readouterr().err
    assert code == 1
    assert "nothing answers at --base-url http://alice:***@127.0.0.1:" in err
    assert SECRET not in err
    assert SECRET not in (tmp_path / "run" / "traces.jsonl").read_text()


def test_a_served_policy_compares_base_urls_redacted() -> None:
    """An eval's client sends its URL on redacted; the env server's own allowed URL, given
    with its password, still matches it."""
    assert normalize_base_url(f"HTTP://alice:{SECRET}@H:80/v1/") == "http://alice:***@h/v1"
    policy = ModelPolicy.from_flags([f"http://alice:{SECRET}@127.0.0.1:9/v1"], None, {})
    policy.check(OpenAISpec("http://alice:***@127.0.0.1:9/v1"))
