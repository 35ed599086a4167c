"""Reading a run dir for `report`: its config, its summary and its rows, in one pass.

A run may still be being written: `traces.jsonl` is read up to its last newline (a row is one
`write()` that ends in a newline, so a tail without one is a row in flight or torn by a kill,
and is left out), and a missing `summary.json` means the run has not ended. Rows are not kept
as dicts: each one is taken apart at once into columns (for the figures) and a compact
encoding of its texts (for the page), every distinct string stored once, so a 100,000-row run
reads in about a second and the page carries each prompt once, not once per rollout.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import attrs
import orjson

__all__ = ["ReportError", "RunData", "load_run", "run_from_rows"]

# Row fields the report takes apart; any other field is kept and shown as it is.
_KNOWN = frozenset(
    ("id", "task", "rollout", "ok", "reward", "completion", "messages", "errors", "attempts",
     "timing", "usage", "finish_reason")
)  # fmt: skip
_TIMING = frozenset(("started", "finished", "duration"))
MIN_CAP = 200  # a text is never cut shorter than this, whatever the budget


class ReportError(ValueError):
    """A path that is not a run dir, or a file in it that cannot be read (CLI: exit 2)."""


def _number(value: object) -> float | None:
    """A finite float, or None for anything else (a missing field, a string, a NaN)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    number = float(value)
    return number if math.isfinite(number) else None


def _tokens(usage: object, name: str) -> int | None:
    if isinstance(usage, dict):
        value = usage.get(name)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


@attrs.define
class RunData:
    """One run, taken apart: its files' JSON, one list per row field, and the page's texts.

    Row columns hold one entry per whole row, in file order. Texts are indices into
    `strings` (-1: none); `messages`, `task_data` and `extra` hold indices too, or raw
    JSON (a message that is not a plain role/content pair, a non-string task field).
    """

    path: Path
    config: dict[str, Any] = attrs.Factory(dict)
    summary: dict[str, Any] | None = None
    label: str | None = None  # the name shown, when the dir's own name is not enough
    unreadable: list[int] = attrs.Factory(list)  # 1-based lines that are not a JSON object
    torn: bool = False  # a last line without its newline was left out
    # the texts, each distinct string once
    strings: list[str] = attrs.Factory(list)
    _index: dict[str, int] = attrs.Factory(dict)
    raw: list[Any] = attrs.Factory(list)  # raw JSON kept in the columns, cut once at the end
    cut: dict[int, int] = attrs.Factory(dict)  # string index -> its whole length, when cut
    # tasks, in order of first appearance
    task_keys: list[str] = attrs.Factory(list)
    task_data: list[list[Any]] = attrs.Factory(list)  # [[field, str index | [raw]], ...]
    _task_index: dict[str, int] = attrs.Factory(dict)
    # rows
    line: list[int] = attrs.Factory(list)
    id: list[int] = attrs.Factory(list)
    task: list[int] = attrs.Factory(list)
    rollout: list[int] = attrs.Factory(list)
    ok: list[bool] = attrs.Factory(list)
    reward: list[float | None] = attrs.Factory(list)
    attempts: list[int] = attrs.Factory(list)
    started: list[float | None] = attrs.Factory(list)  # seconds since the epoch
    finished: list[float | None] = attrs.Factory(list)
    duration: list[float | None] = attrs.Factory(list)
    error_types: list[list[str]] = attrs.Factory(list)
    errors: list[list[list[int]]] = attrs.Factory(list)  # [[type, message, attempt], ...]
    completion: list[int] = attrs.Factory(list)
    messages: list[list[Any]] = attrs.Factory(list)
    prompt_tokens: list[int | None] = attrs.Factory(list)
    completion_tokens: list[int | None] = attrs.Factory(list)
    finish_reason: list[int] = attrs.Factory(list)
    extra: list[dict[str, Any] | None] = attrs.Factory(list)

    @property
    def name(self) -> str:
        return self.label or self.path.name or str(self.path)

    def __len__(self) -> int:
        return len(self.line)

    def text(self, value: str) -> int:
        """The index of `value` in `strings`, adding it once."""
        index = self._index.get(value)
        if index is None:
            index = self._index[value] = len(self.strings)
            self.strings.append(value)
        return index

    def _keep_raw(self, value: Any) -> Any:
        self.raw.append(value)
        return value

    def _value(self, value: Any) -> Any:
        return self.text(value) if isinstance(value, str) else [self._keep_raw(value)]

    def _message(self, message: Any) -> Any:
        if (
            isinstance(message, dict)
            and len(message) == 2
            and isinstance(message.get("role"), str)
            and isinstance(message.get("content"), str)
        ):
            return [self.text(message["role"]), self.text(message["content"])]
        return self._keep_raw(message)

    def _task(self, task: Any) -> int:
        key = task.get("key") if isinstance(task, dict) else None
        key = key if isinstance(key, str) else json.dumps(key)
        index = self._task_index.get(key)
        if index is None:
            index = self._task_index[key] = len(self.task_keys)
            self.task_keys.append(key)
            data = task.get("data") if isinstance(task, dict) else None
            fields: list[Any] = []
            if isinstance(data, dict):
                for name, value in data.items():
                    if name == "prompt" and isinstance(value, list):
                        fields.append([name, {"messages": [self._message(m) for m in value]}])
                    else:
                        fields.append([name, self._value(value)])
            self.task_data.append(fields)
        return index

    def add_row(self, row: dict[str, Any], line: int) -> None:
        """Take one trace row apart into the columns; any field may be missing or odd."""
        self.line.append(line)
        self.id.append(self.text(str(row.get("id", ""))))
        self.task.append(self._task(row.get("task")))
        rollout = row.get("rollout")
        self.rollout.append(rollout if isinstance(rollout, int) else 0)
        self.ok.append(row.get("ok") is True)
        self.reward.append(_number(row.get("reward")))
        attempts = row.get("attempts")
        self.attempts.append(attempts if isinstance(attempts, int) else 0)
        timing = row.get("timing")
        timing = timing if isinstance(timing, dict) else {}
        self.started.append(_number(timing.get("started")))
        self.finished.append(_number(timing.get("finished")))
        self.duration.append(_number(timing.get("duration")))
        types: list[str] = []
        errors: list[list[int]] = []
        raw_errors = row.get("errors")
        for error in raw_errors if isinstance(raw_errors, list) else ():
            if not isinstance(error, dict):
                error = {"type": "?", "message": str(error)}
            kind = str(error.get("type", "?"))
            attempt = error.get("attempt")
            types.append(kind)
            errors.append([self.text(kind), self.text(str(error.get("message", ""))),
                           attempt if isinstance(attempt, int) else 0])  # fmt: skip
        self.error_types.append(types)
        self.errors.append(errors)
        completion = row.get("completion")
        self.completion.append(self.text(completion) if isinstance(completion, str) else -1)
        messages = row.get("messages")
        self.messages.append(
            [self._message(m) for m in messages] if isinstance(messages, list) else []
        )
        usage = row.get("usage")
        self.prompt_tokens.append(_tokens(usage, "prompt_tokens"))
        self.completion_tokens.append(_tokens(usage, "completion_tokens"))
        reason = row.get("finish_reason")
        self.finish_reason.append(self.text(reason) if isinstance(reason, str) else -1)
        extra = {k: v for k, v in row.items() if k not in _KNOWN}
        if usage is not None and (
            not isinstance(usage, dict) or set(usage) - {"prompt_tokens", "completion_tokens"}
        ):
            extra["usage"] = usage
        other_timing = {k: v for k, v in timing.items() if k not in _TIMING}
        if other_timing:
            extra["timing"] = other_timing
        self.extra.append(self._keep_raw(extra) if extra else None)

    def fit_texts(self, budget: int) -> int | None:
        """Cut the texts so that together they take about `budget` characters.

        Every text longer than one cap is cut to it (the shortest texts are never touched),
        the cap being the largest that fits the budget, and never under MIN_CAP. The cut
        texts' whole lengths go to `cut`. Returns the cap, or None when nothing was cut.
        """
        lengths = sorted(len(s) for s in self.strings)
        total = sum(lengths)
        for raw in self.raw:
            total += _raw_chars(raw)
        if total <= budget:
            return None
        cap = _water_level(lengths, budget)
        cap = max(cap, MIN_CAP)
        for index, value in enumerate(self.strings):
            if len(value) > cap:
                self.cut[index] = len(value)
                self.strings[index] = value[:cap]
        for raw in self.raw:
            _cut_raw(raw, cap)
        return cap


def _water_level(lengths: list[int], budget: int) -> int:
    """The largest cap c with sum(min(length, c)) <= budget (`lengths` sorted)."""
    remaining = budget
    for i, length in enumerate(lengths):
        share = remaining // (len(lengths) - i)
        if length > share:
            return share
        remaining -= length
    return lengths[-1] if lengths else 0


def _raw_chars(value: Any) -> int:
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(_raw_chars(v) for v in value.values())
    if isinstance(value, list):
        return sum(_raw_chars(v) for v in value)
    return 0


def _cut_raw(value: Any, cap: int) -> None:
    if not isinstance(value, dict | list):
        return
    items = value.items() if isinstance(value, dict) else enumerate(value)
    for key, item in list(items):
        if isinstance(item, str) and len(item) > cap:
            value[key] = f"{item[:cap]}… [cut: {len(item):,} characters in all]"
        elif isinstance(item, dict | list):
            _cut_raw(item, cap)


def _read_json(path: Path) -> dict[str, Any] | None:
    if not path.exists():
        return None
    try:
        value = orjson.loads(path.read_bytes())
    except (OSError, orjson.JSONDecodeError) as exc:
        raise ReportError(f"{path}: cannot read it as JSON ({exc})") from exc
    if not isinstance(value, dict):
        raise ReportError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


def read_lines(run: RunData, data: bytes) -> None:
    """Add the whole rows in `data` (a traces.jsonl's bytes) to `run`."""
    end = data.rfind(b"\n") + 1
    run.torn = bool(data[end:].strip())
    for number, line in enumerate(data[:end].split(b"\n"), 1):
        if not line.strip():
            continue
        try:
            row = orjson.loads(line)
        except orjson.JSONDecodeError:
            row = None
        if isinstance(row, dict):
            run.add_row(row, number)
        else:
            run.unreadable.append(number)


def load_run(path: str | Path) -> RunData:
    """Read the run dir at `path` (finished, or still being written)."""
    path = Path(path)
    if not path.is_dir():
        what = "is not a directory" if path.exists() else "does not exist"
        raise ReportError(
            f"RUN_DIR {str(path)!r} {what}: pass a run dir (<output-dir>/<run-name>, as "
            f"`trio-tasksets eval` prints it)"
        )
    traces = path / "traces.jsonl"
    if not traces.exists() and not (path / "config.json").exists():
        raise ReportError(
            f"RUN_DIR {str(path)!r} is not a run dir: it holds neither traces.jsonl nor "
            f"config.json (pass <output-dir>/<run-name>, as `trio-tasksets eval` prints it)"
        )
    run = RunData(path)
    run.config = _read_json(path / "config.json") or {}
    run.summary = _read_json(path / "summary.json")
    if traces.exists():
        try:
            data = traces.read_bytes()
        except OSError as exc:
            raise ReportError(f"{traces}: cannot read it ({exc})") from exc
        read_lines(run, data)
    return run


def run_from_rows(
    rows: list[dict[str, Any]],
    *,
    summary: dict[str, Any] | None = None,
    config: dict[str, Any] | None = None,
    path: str | Path = "run",
) -> RunData:
    """A RunData from rows in memory (as `Episode.to_row` gives them), for tests and tools."""
    run = RunData(Path(path), config=dict(config or {}), summary=summary)
    for line, row in enumerate(rows, 1):
        run.add_row(row, line)
    return run
