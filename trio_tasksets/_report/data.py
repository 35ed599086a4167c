"""Reading a run dir for `report`: its config, its summary and its rows, in one pass.

A run may still be being written: `traces.jsonl` is read up to its last newline (a row is one
`write()` that ends in a newline, so a tail without one is a row in flight or torn by a kill,
and is left out), and a missing `summary.json` means the run has not ended. Rows are not kept
as dicts: each one is taken apart at once into columns (for the figures) and a compact
encoding of its texts (for the page), every distinct string stored once, so a 100,000-row run
reads in about a second and the page carries each prompt once, not once per rollout.

The page's table holds at most `MAX_TABLE_ROWS` rows: a larger run's table is a `Sample`
(every k-th line and the failed rows, chosen as they are read, the page saying so), and the
rows it leaves out keep only the figures' numbers (floats in arrays: `Floats`), so memory
per row stays small and the page's size does not grow with the run.
"""

from __future__ import annotations

import json
import math
from array import array
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, overload

import attrs
import orjson

from .._core.exceptions import ConfigError

__all__ = ["MAX_TABLE_ROWS", "ReportError", "RunData", "Sample", "load_run", "run_from_rows"]

# Row fields the report takes apart; any other field is kept and shown as it is.
_KNOWN = frozenset(
    ("id", "task", "rollout", "ok", "reward", "completion", "messages", "errors", "attempts",
     "timing", "usage", "finish_reason", "turns", "tool_calls", "stop_reason", "metrics",
     "advantage")
)  # fmt: skip
_TIMING = frozenset(("started", "finished", "duration"))
_USAGE = frozenset(("prompt_tokens", "completion_tokens", "total_tokens"))
MIN_CAP = 100  # a text is never cut shorter than this, whatever the budget


def _plain(message: dict[str, Any]) -> bool:
    """A message that is a role and a content, its other fields empty (null, [], {}: how
    some servers send a reply with no tool call), shown as the plain pair."""
    return all(
        value is None or value == [] or value == {}
        for key, value in message.items()
        if key != "role" and key != "content"
    )


class ReportError(ConfigError):
    """A path that is not a run dir, or a file in it that cannot be read (a `ConfigError`,
    so a ValueError; CLI: exit 2)."""


def _number(value: object) -> float | None:
    """A finite float, or None for anything else (a missing field, a string, a NaN)."""
    if type(value) is float:
        return value if math.isfinite(value) else None
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    number = float(value)
    return number if math.isfinite(number) else None


def _count(value: object) -> int | None:
    return value if type(value) is int else None


def _other_fields(row: dict[str, Any], usage: Any, timing: dict[str, Any]) -> dict[str, Any]:
    """A row's fields that the columns do not hold, to show as they are."""
    other = {k: v for k, v in row.items() if k not in _KNOWN}
    metrics = row.get("metrics")
    if metrics:  # named metrics: shown with the row, and summed up by the figures
        other["metrics"] = metrics
    if usage is not None and (type(usage) is not dict or usage.keys() - _USAGE):
        other["usage"] = usage
    timing = {k: v for k, v in timing.items() if k not in _TIMING}
    if timing:
        other["timing"] = timing
    return other


class Floats(Sequence[float | None]):
    """A column of floats or None in 8 bytes a row (an array of doubles, NaN for None: a
    column never holds a NaN itself, `_number` makes it None), not a float object each: the
    figures' columns of a run of millions of rows."""

    __slots__ = ("_values",)

    def __init__(self, values: Iterable[float | None] = ()) -> None:
        self._values = array("d")
        for value in values:
            self.append(value)

    def append(self, value: float | None) -> None:
        self._values.append(math.nan if value is None else value)

    def __len__(self) -> int:
        return len(self._values)

    @overload
    def __getitem__(self, index: int) -> float | None: ...
    @overload
    def __getitem__(self, index: slice) -> list[float | None]: ...
    def __getitem__(self, index: int | slice) -> float | list[float | None] | None:
        if isinstance(index, slice):
            return [None if v != v else v for v in self._values[index]]
        value = self._values[index]
        return None if value != value else value

    def __iter__(self) -> Iterator[float | None]:
        for value in self._values:
            yield None if value != value else value


MAX_TABLE_ROWS = 50_000  # rows the page's table holds; a larger run's table is a sample
_EMPTY: list[Any] = []  # shared by the rows that have none (never changed)


@attrs.define
class Sample:
    """Which rows of a run larger than the table the table shows, decided as each is read:
    every `stride`-th row (an even sample of about half the table) and every failed row
    until `failed_room` of them are taken (the other half): at most `limit` rows."""

    limit: int
    lines: int  # the trace file's lines
    stride: int = 1
    failed_room: int = 0

    def __attrs_post_init__(self) -> None:
        half = max(self.limit // 2, 1)
        self.stride = max(-(-self.lines // half), 1)
        self.failed_room = self.limit - half

    def takes(self, line: int, ok: bool) -> bool:
        if line % self.stride == 0:
            return True
        if not ok and self.failed_room > 0:
            self.failed_room -= 1
            return True
        return False

    def describe(self, shown: int, rows: int) -> str:
        return (
            f"The table shows {shown:,} of the {rows:,} rows: every {self.stride:,}th line of "
            f"traces.jsonl, and its failed rows up to {self.limit - self.limit // 2:,}, in "
            f"file order; the figures count every row."
        )


@attrs.define
class RunData:
    """One run, taken apart: its files' JSON, one list per row field, and the page's texts.

    Row columns hold one entry per whole row, in file order. Texts are indices into
    `strings` (-1: none); a message is `[role, content]` indices, or its raw JSON when it is
    not a plain role/content pair. Task fields are columns too (`finish` builds them).
    """

    path: Path
    config: dict[str, Any] = attrs.Factory(dict)
    summary: dict[str, Any] | None = None
    label: str | None = None  # the name shown, when the dir's own name is not enough
    unreadable: list[int] = attrs.Factory(list)  # 1-based lines that are not a JSON object
    # A run of more rows than the table holds (`MAX_TABLE_ROWS`): which rows the table shows
    # (`table`: row indices, in file order), chosen as they are read by `sample`. The other
    # rows keep only what the figures need (no texts, no messages): None for a table of all.
    sample: Sample | None = None
    table: list[int] | None = None
    torn: bool = False  # a last line without its newline was left out
    # the texts, each distinct string once
    strings: list[str] = attrs.Factory(list)
    _index: dict[str, int] = attrs.Factory(dict)
    raw: list[Any] = attrs.Factory(list)  # raw JSON kept in the columns, cut once at the end
    cut: dict[int, int] = attrs.Factory(dict)  # string index -> its whole length, when cut
    cap: int | None = None  # the length texts were cut to, if any
    _raw_chars: int | None = None
    # tasks, in order of first appearance; fields: (name, "s" (string indices) or "j" (raw
    # JSON), one value per task (None: the task has no such field, or it is null))
    task_keys: list[str] = attrs.Factory(list)
    task_fields: list[tuple[str, str, list[Any]]] = attrs.Factory(list)
    _task_index: dict[str, int] = attrs.Factory(dict)
    _task_data: list[dict[str, Any] | None] = attrs.Factory(list)
    # rows
    line: list[int] = attrs.Factory(list)
    id: list[str] = attrs.Factory(list)
    task: list[int] = attrs.Factory(list)
    rollout: list[int] = attrs.Factory(list)
    ok: list[bool] = attrs.Factory(list)
    reward: Floats = attrs.Factory(Floats)
    attempts: list[int] = attrs.Factory(list)
    started: Floats = attrs.Factory(Floats)  # seconds since the epoch
    finished: Floats = attrs.Factory(Floats)
    duration: Floats = attrs.Factory(Floats)
    error_types: list[list[str]] = attrs.Factory(list)
    errors: list[list[list[int]]] = attrs.Factory(list)  # [[type, message, attempt], ...]
    completion: list[int] = attrs.Factory(list)
    messages: list[list[Any]] = attrs.Factory(list)
    prompt_tokens: list[int | None] = attrs.Factory(list)
    completion_tokens: list[int | None] = attrs.Factory(list)
    finish_reason: list[int] = attrs.Factory(list)
    group: list[str | None] = attrs.Factory(list)  # `--group`: the row's group id
    turns: list[int] = attrs.Factory(list)  # model replies of the row's attempt
    tool_calls: list[int] = attrs.Factory(list)
    stop_reason: list[int] = attrs.Factory(list)  # a string's index, or -1
    advantage: Floats = attrs.Factory(Floats)  # `--group`: set by a score_group
    extra: dict[int, dict[str, Any]] = attrs.Factory(dict)  # row index -> its other fields

    @property
    def name(self) -> str:
        return self.label or self.path.name or str(self.path)

    def __len__(self) -> int:
        return len(self.line)

    def text(self, value: str) -> int:
        """The index of `value` in `strings` (which `finish` lists), adding it once."""
        index = self._index
        return index.setdefault(value, len(index))

    def finish(self) -> None:
        """End the reading: list `strings`, and build `task_fields` from the tasks read (a
        field whose values are all strings or null becomes a column of string indices, any
        other a column of raw JSON)."""
        datas = self._task_data
        names = dict.fromkeys(k for data in datas if data for k in data)
        self.task_fields = []
        for name in names:
            values = [data.get(name) if data else None for data in datas]
            if all(v is None or type(v) is str for v in values):
                column = [None if v is None else self.text(v) for v in values]
                self.task_fields.append((name, "s", column))
            elif any(v is not None for v in values):
                self.raw.append(values)
                self.task_fields.append((name, "j", values))
        self.strings = list(self._index)  # in index order: a dict keeps insertion order

    def add_rows(self, numbered: Iterable[tuple[int, Any]]) -> None:
        """Take rows apart into the columns: (line number, decoded JSON) pairs, where any
        field may be missing or odd, and a value that is not an object is an unreadable line.
        One loop with its appends bound once: it runs once per row of a large run."""
        index = self._index
        text = index.setdefault  # text(s, len(index)): the index of s, adding it once
        tasks, task_keys, task_data = self._task_index, self.task_keys, self._task_data
        raw, extra = self.raw, self.extra
        add_line, add_id, add_task = self.line.append, self.id.append, self.task.append
        add_rollout, add_ok, add_reward = self.rollout.append, self.ok.append, self.reward.append
        add_attempts, add_types = self.attempts.append, self.error_types.append
        add_started, add_finished = self.started.append, self.finished.append
        add_duration, add_errors = self.duration.append, self.errors.append
        add_completion, add_messages = self.completion.append, self.messages.append
        add_prompt, add_generated = self.prompt_tokens.append, self.completion_tokens.append
        add_reason, add_group = self.finish_reason.append, self.group.append
        add_turns, add_calls = self.turns.append, self.tool_calls.append
        add_stop, add_advantage = self.stop_reason.append, self.advantage.append
        sample = self.sample
        table = self.table if self.table is not None or sample is None else []
        self.table = table
        for line, row in numbered:
            if type(row) is not dict:
                self.unreadable.append(line)
                continue
            get = row.get
            shown = sample is None or sample.takes(line, get("ok") is True)
            if not shown:
                self._add_figures_only(row)
                continue
            if table is not None:
                table.append(len(self.line))
            add_line(line)
            add_id(str(get("id", "")))
            task = get("task")
            key = task.get("key") if type(task) is dict else None
            if type(key) is not str:
                key = json.dumps(key)
            number = tasks.get(key)
            if number is None:
                number = tasks[key] = len(task_keys)
                task_keys.append(key)
                task_data.append(None)
            if task_data[number] is None:
                data = task.get("data") if type(task) is dict else None
                task_data[number] = data if type(data) is dict else None
            add_task(number)
            rollout = get("rollout")
            add_rollout(rollout if type(rollout) is int else 0)
            add_ok(get("ok") is True)
            add_reward(_number(get("reward")))
            attempts = get("attempts")
            add_attempts(attempts if type(attempts) is int else 0)
            timing = get("timing")
            if type(timing) is not dict:
                timing = {}
            add_started(_number(timing.get("started")))
            add_finished(_number(timing.get("finished")))
            add_duration(_number(timing.get("duration")))
            types: list[str] = []
            errors: list[list[int]] = []
            raw_errors = get("errors")
            if raw_errors and type(raw_errors) is list:
                for error in raw_errors:
                    if type(error) is not dict:
                        error = {"type": "?", "message": str(error)}
                    kind = str(error.get("type", "?"))
                    message = str(error.get("message", ""))
                    attempt = error.get("attempt")
                    types.append(kind)
                    errors.append([text(kind, len(index)), text(message, len(index)),
                                   attempt if type(attempt) is int else 0])  # fmt: skip
            add_types(types)
            add_errors(errors)
            completion = get("completion")
            add_completion(text(completion, len(index)) if type(completion) is str else -1)
            messages = get("messages")
            encoded: list[Any] = []
            if type(messages) is list:
                for message in messages:
                    if type(message) is dict and (len(message) == 2 or _plain(message)):
                        role, content = message.get("role"), message.get("content")
                        if type(role) is str and type(content) is str:
                            encoded.append([text(role, len(index)), text(content, len(index))])
                            continue
                    raw.append(message)  # not a plain role/content pair: kept as it is
                    encoded.append(message)
            add_messages(encoded)
            usage = get("usage")
            if type(usage) is dict:
                add_prompt(_count(usage.get("prompt_tokens")))
                add_generated(_count(usage.get("completion_tokens")))
            else:
                add_prompt(None)
                add_generated(None)
            reason = get("finish_reason")
            add_reason(text(reason, len(index)) if type(reason) is str else -1)
            group = get("group")
            add_group(group if type(group) is str else None)
            turns, calls, stop = get("turns"), get("tool_calls"), get("stop_reason")
            add_turns(turns if type(turns) is int else 0)
            add_calls(calls if type(calls) is int else 0)
            add_stop(text(stop, len(index)) if type(stop) is str else -1)
            add_advantage(_number(get("advantage")))
            if (
                row.keys() - _KNOWN
                or get("metrics")
                or timing.keys() - _TIMING
                or (usage is not None and (type(usage) is not dict or usage.keys() - _USAGE))
            ):
                extra[len(self.line) - 1] = other = _other_fields(row, usage, timing)
                raw.append(other)

    def _add_figures_only(self, row: dict[str, Any]) -> None:
        """A row the table does not show (`sample`): only the columns the figures read
        (its texts, messages, id and task data are not kept)."""
        get = row.get
        self.line.append(0)
        self.id.append("")
        task = get("task")
        key = task.get("key") if type(task) is dict else None
        if type(key) is not str:
            key = json.dumps(key)
        number = self._task_index.get(key)
        if number is None:
            number = self._task_index[key] = len(self.task_keys)
            self.task_keys.append(key)
            self._task_data.append(None)
        self.task.append(number)
        rollout, attempts = get("rollout"), get("attempts")
        self.rollout.append(rollout if type(rollout) is int else 0)
        self.ok.append(get("ok") is True)
        self.reward.append(_number(get("reward")))
        self.attempts.append(attempts if type(attempts) is int else 0)
        timing = get("timing")
        if type(timing) is not dict:
            timing = {}
        self.started.append(_number(timing.get("started")))
        self.finished.append(_number(timing.get("finished")))
        self.duration.append(_number(timing.get("duration")))
        errors = get("errors")
        kinds = _EMPTY
        if errors and type(errors) is list:
            kinds = [str(e.get("type", "?")) if type(e) is dict else "?" for e in errors]
        self.error_types.append(kinds)
        self.errors.append(_EMPTY)
        self.completion.append(-1)
        self.messages.append(_EMPTY)
        usage = get("usage")
        if type(usage) is dict:
            self.prompt_tokens.append(_count(usage.get("prompt_tokens")))
            self.completion_tokens.append(_count(usage.get("completion_tokens")))
        else:
            self.prompt_tokens.append(None)
            self.completion_tokens.append(None)
        self.finish_reason.append(-1)
        group = get("group")
        self.group.append(group if type(group) is str else None)
        turns, calls = get("turns"), get("tool_calls")
        self.turns.append(turns if type(turns) is int else 0)
        self.tool_calls.append(calls if type(calls) is int else 0)
        self.stop_reason.append(-1)
        self.advantage.append(_number(get("advantage")))
        metrics = get("metrics")
        if metrics and type(metrics) is dict:  # the figures sum up named metrics
            self.extra[len(self.line) - 1] = {"metrics": metrics}

    def fit_texts(self, budget: int) -> int | None:
        """Cut the texts so that together they take about `budget` characters.

        Every text longer than one cap is cut to it (the shortest texts are never touched),
        the cap being the largest that fits the budget, and never under MIN_CAP. The cut
        texts' whole lengths go to `cut`. Returns the cap (`self.cap`), None when nothing
        was cut. Called again with a smaller budget, it cuts further; never less.
        """
        lengths = sorted(map(len, self.strings))
        if self._raw_chars is None:  # their JSON's length: at least their texts' length
            self._raw_chars = sum(len(orjson.dumps(raw)) for raw in self.raw)
        if sum(lengths) + self._raw_chars <= budget:
            return self.cap
        cap = max(_water_level(lengths, budget), MIN_CAP)
        if self.cap is not None and cap >= self.cap:
            return self.cap
        for index, value in enumerate(self.strings):
            if len(value) > cap:
                self.cut.setdefault(index, len(value))
                self.strings[index] = value[:cap]
        for raw in self.raw:
            if len(orjson.dumps(raw)) > cap:  # else no text inside it is longer than the cap
                _cut_raw(raw, cap)
        self.cap = cap
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


def read_lines(run: RunData, lines: Iterable[bytes]) -> None:
    """Add the whole rows among `lines` (a traces.jsonl's lines, each with its newline) to
    `run`; a last line without its newline is a row being written, or torn: left out."""
    loads, error = orjson.loads, orjson.JSONDecodeError

    def decoded() -> Iterator[tuple[int, Any]]:
        for number, line in enumerate(lines, 1):
            if not line.endswith(b"\n"):
                run.torn = not line.isspace()
                return
            if not line.isspace():
                try:
                    yield number, loads(line)
                except error:
                    yield number, None

    run.add_rows(decoded())
    run.finish()


def load_run(path: str | Path, *, table_rows: int = MAX_TABLE_ROWS) -> RunData:
    """Read the run dir at `path` (finished, or still being written). A run of more than
    `table_rows` lines keeps texts for a sample of that many rows only (`Sample`)."""
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
            lines = _count_lines(traces)
            if lines > table_rows:  # the table shows a sample; the figures count every row
                run.sample = Sample(table_rows, lines)
            with traces.open("rb") as whole:  # line by line: a large run is never all in memory
                read_lines(run, whole)
        except OSError as exc:
            raise ReportError(f"{traces}: cannot read it ({exc})") from exc
    return run


def _count_lines(path: Path) -> int:
    count = 0
    with path.open("rb") as file:
        while chunk := file.read(1 << 20):
            count += chunk.count(b"\n")
    return count


def run_from_rows(
    rows: list[dict[str, Any]],
    *,
    summary: dict[str, Any] | None = None,
    config: dict[str, Any] | None = None,
    path: str | Path = "run",
) -> RunData:
    """A RunData from rows in memory (as `Episode.to_row` gives them), for tests and tools."""
    run = RunData(Path(path), config=dict(config or {}), summary=summary)
    run.add_rows(enumerate(rows, 1))
    run.finish()
    return run
