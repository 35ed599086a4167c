"""Dataset loaders: a JSONL file, a CSV file or a Hugging Face dataset as a taskset.

    tt.JsonlTaskset("data.jsonl")                   # or JsonlConfig(path=..., ...)
    tt.CsvTaskset("data.csv", prompt_field="q")
    tt.HFTaskset("openai/gsm8k", split="test")      # needs `datasets` (the `hf` extra)
    tt.JsonlTaskset("feed.jsonl", follow=True)      # a feed: follows a growing file

On the command line: `trio-tasksets eval data.jsonl`, `data.csv`, `hf:NAME[:SPLIT]`, with
`--prompt-field`, `--answer-field` and (JSONL) `--follow`.

Each record becomes a `tt.Task`: its prompt is the `prompt_field` (default: `prompt`, else
`question`; a string, or a list of chat messages), its answer the `answer_field` (default
`answer`; optional, made a string), and every other field of the record goes to `info`.
The task's key is the content hash of `tt.Task`, so a resume finds the same tasks.

Reading is lazy: `load()` is a generator that decodes one record per task it yields, so
`head(10)` (`-n 10`) of a 1 GB file decodes 10 records and reads little more than their
lines. A record without the prompt's field is a `DatasetError` naming the file, the line
and the fix (`prompt_field`), raised: the setting is wrong, not the record.

A record that cannot be read (a JSONL line that is not JSON, not UTF-8, nested deeper than
`MAX_DEPTH`, not an object, or holding a lone surrogate such as `"\\ud800"`, which is not
text; a CSV row that is not UTF-8 or has a field over `max_field` characters) fails its own
row, not the run: it becomes a task with an empty prompt whose episode fails at once (no
model call, no retry) with a `DatasetError` naming the file, the line and why
(`record_problem` tells such a task). The eval goes on, counts it among its failures, and
the row says why; `--resume` tries it again.

`follow=True` (JSONL only) makes the taskset a feed: `stream()` yields the file's records,
then waits for lines appended to it (checking every `poll` seconds) and never ends; a line
is taken once it is whole (ends in a newline). The file is followed by name, as `tail -F`
does, checked at every read: a file renamed or deleted and created again at its path (log
rotation by rename and create) is read to its end, then the new file from its start; a
file truncated in place (rotation by copy and truncate), even when written again before
the next read, is read again from its start, never from the middle of a line (its size,
and the bytes before the position read so far, are checked).
"""

from __future__ import annotations

import csv
import hashlib
import json
import os
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, BinaryIO, Protocol, TextIO

import attrs
import trio

from .exceptions import ConfigError, TrioTasksetsError
from .tasksets import Task, Taskset, TasksetConfig

__all__ = [
    "HF_EXTRA",
    "CsvConfig",
    "CsvTaskset",
    "DatasetError",
    "HFConfig",
    "HFTaskset",
    "JsonlConfig",
    "JsonlTaskset",
    "RecordFields",
    "check_record",
    "record_problem",
    "record_task",
]

HF_EXTRA = "pip install 'trio-tasksets[hf]'"
"""How to install what `HFTaskset` needs (the `datasets` library)."""

PROMPT_FIELDS = ("prompt", "question")  # tried in order when no prompt field is named
MAX_DEPTH = 100  # the deepest nesting of a record's JSON (deeper: an unreadable record)
UNREADABLE = "trio_tasksets.unreadable"  # the info key of a record that could not be read


class DatasetError(TrioTasksetsError, ValueError):
    """A record that cannot be a task (no prompt field, not a JSON object), or a dataset that
    cannot be read; the message names the file (and line) and the fix, and `parameter` the
    setting that fixes it, if one does (``prompt_field``)."""

    def __init__(self, message: str, *, parameter: str | None = None) -> None:
        super().__init__(message)
        self.parameter = parameter


@attrs.define
class RecordFields(TasksetConfig):
    """Which fields of a record are the prompt and the answer (the rest goes to `info`)."""

    prompt_field: str | None = None  # None: "prompt", else "question"
    answer_field: str = "answer"


def _checked_path(text: str, what: str) -> str:
    if not text:
        raise ConfigError(
            f"{what}: {{path}} is empty: name the file, e.g. path='data.jsonl'", parameter="path"
        )
    return os.fspath(text)


def record_task(record: Mapping[str, Any], fields: RecordFields, where: str) -> Task:
    """The task of one record (see the module docstring); `where` names it in errors."""
    name = fields.prompt_field
    if name is None:
        name = next((f for f in PROMPT_FIELDS if f in record), None)
    if name is None or name not in record:
        wanted = (
            f"field {fields.prompt_field!r}" if fields.prompt_field else "'prompt' or 'question'"
        )
        known = ", ".join(map(str, record)) or "none"
        raise DatasetError(
            f"{where}: the record has no {wanted} for the prompt (its fields: {known}); name "
            f"the prompt's field with prompt_field",
            parameter="prompt_field",
        )
    prompt = record[name]
    if isinstance(prompt, list) and all(isinstance(m, Mapping) for m in prompt):
        prompt = [dict(m) for m in prompt]
    elif not isinstance(prompt, str):
        prompt = str(prompt)
    answer = record.get(fields.answer_field)
    info = {k: v for k, v in record.items() if k not in (name, fields.answer_field)}
    return Task(prompt, answer=None if answer is None else str(answer), info=info)


def unreadable_record(where: str, why: str, raw: bytes) -> Task:
    """The task of a record that cannot be read (module docstring): its episode fails with a
    `DatasetError` saying `where` and `why`. Its key is its place and bytes' hash, so a
    resume owes it again."""
    digest = hashlib.sha256(where.encode() + b"\0" + raw).hexdigest()[:16]
    return Task("", info={UNREADABLE: f"{where}: {why}"}, key=f"unreadable-{digest}")


def record_problem(task: object) -> DatasetError | None:
    """The error of a task made from a record that could not be read (`unreadable_record`),
    None for any other task: an env fails such a task's episode with it, without calling
    the model (and through a served or Redis worker too: it is in the task's `info`)."""
    info = getattr(task, "info", None)
    if type(info) is dict and UNREADABLE in info:
        return DatasetError(str(info[UNREADABLE]))
    return None


def check_record(task: object) -> None:
    """Raise the `DatasetError` of a task made from a record that could not be read
    (`record_problem`); nothing for any other task."""
    problem = record_problem(task)
    if problem is not None:
        raise problem


def _too_deep(value: Any) -> bool:
    """Whether `value` nests lists and objects deeper than `MAX_DEPTH` (no recursion)."""
    level: list[Any] = [value]
    for _ in range(MAX_DEPTH):
        level = [
            item
            for node in level
            if isinstance(node, dict | list)
            for item in (node.values() if isinstance(node, dict) else node)
            if isinstance(item, dict | list)
        ]
        if not level:
            return False
    return True


def _decoded(line: bytes, where: str) -> dict[str, Any] | str:
    """A JSONL line's object, or why it is not one (for `unreadable_record`)."""
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as exc:
        return (
            f"the line is not UTF-8 ({exc.reason} at byte {exc.start + 1}): save the file as UTF-8"
        )
    try:
        record = json.loads(text)
    except RecursionError:
        return f"the record nests deeper than {MAX_DEPTH} levels"
    except ValueError as exc:
        return f"not a JSON line ({exc})"
    if not isinstance(record, dict):
        return f"a record must be a JSON object, got {text.strip()[:80]}"
    if text.count("[") + text.count("{") > MAX_DEPTH and _too_deep(record):
        return f"the record nests deeper than {MAX_DEPTH} levels"
    if "\\u" in text:  # an escape may spell a lone surrogate, which no file can encode
        try:
            json.dumps(record, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError as exc:
            char = exc.object[exc.start : exc.end].encode("unicode_escape").decode()
            return (
                f"the record holds a lone surrogate ({char}), which is not text: write the "
                f"character itself, or both halves of its surrogate pair"
            )
    return record


# --- JSONL ----------------------------------------------------------------------------------


def _positive_seconds(instance: object, attribute: attrs.Attribute[float], value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ConfigError(
            f"{{{attribute.name}}} must be a number of seconds > 0, got {value!r}",
            parameter=attribute.name,
        )


def _positive_count(instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(
            f"{{{attribute.name}}} must be an int >= 1, got {value!r}", parameter=attribute.name
        )


@attrs.define
class JsonlConfig(RecordFields):
    """A JSONL file: one JSON object per line (blank lines are skipped)."""

    path: str = ""
    follow: bool = False  # a feed: keep reading lines appended to the file
    poll: float = attrs.field(default=0.25, validator=_positive_seconds)


def _config_of(cls: type[Any], config: Any, fields: dict[str, Any]) -> Any:
    """`config` itself, or a config of `cls` built from a path (str or PathLike) and fields."""
    if isinstance(config, str | os.PathLike):
        return cls(path=os.fspath(config), **fields)
    if fields:
        base = config if config is not None else cls()
        return attrs.evolve(base, **fields)
    return config


class _PathConfig(Protocol):
    @property
    def path(self) -> str: ...


class _OfAFile(Protocol):
    @property
    def config(self) -> _PathConfig: ...


class _FromFile:
    """What a taskset read from the file at its config's `path` shares: that name."""

    @property
    def taskset_id(self: _OfAFile) -> str:
        """The file, as given: how runs name this taskset."""
        return self.config.path


class JsonlTaskset(_FromFile, Taskset[Task, JsonlConfig]):
    """The records of a JSONL file as tasks, read lazily (module docstring); with
    `follow=True`, a feed of the lines appended to it. A bad `poll` raises a `ConfigError`
    here; reading raises a `ConfigError` naming `path` when it is empty, and `DatasetError`
    for a file that cannot be read or a line that is not a task."""

    def __init__(self, config: JsonlConfig | str | os.PathLike[str] | None = None,
                 /, **fields: Any) -> None:  # fmt: skip
        super().__init__(_config_of(JsonlConfig, config, fields))

    @property
    def streaming(self) -> bool:
        return self.config.follow

    def _path(self) -> Path:
        return Path(_checked_path(self.config.path, "JsonlTaskset"))

    def _open(self) -> BinaryIO:
        path = self._path()
        try:
            return path.open("rb")
        except OSError as exc:
            raise DatasetError(f"cannot read {path}: {exc.strerror or exc}") from exc

    def _task(self, line: bytes, number: int) -> Task | None:
        if not line.strip():
            return None
        where = f"{self.config.path}:{number}"
        record = _decoded(line, where)
        if isinstance(record, str):
            return unreadable_record(where, record, line)
        return record_task(record, self.config, where)

    def load(self) -> Iterator[Task]:
        if self.config.follow:
            return iter(())
        return self._records()

    def _records(self) -> Iterator[Task]:
        with self._open() as file:
            for number, line in enumerate(file, 1):
                task = self._task(line, number)
                if task is not None:
                    yield task

    async def stream(self) -> AsyncIterator[Task]:
        """`follow=True`: the file's records, then each whole line appended to it, forever,
        following the file by name (module docstring). Otherwise the static tasks (the
        views applied)."""
        if not self.config.follow:
            for task in self:
                yield task
            return
        follower = _Follower(self._path(), self._open())
        try:
            while True:
                lines = follower.read()
                if lines is None:
                    await trio.sleep(self.config.poll)
                    continue
                for number, line in lines:
                    record = self._task(line, number)
                    if record is not None:
                        yield record
                await trio.lowlevel.checkpoint()
        finally:
            follower.close()


class _Follower:
    """A file followed by name (`JsonlTaskset(follow=True)`): its whole lines, numbered, as
    they are appended; each `read` checks the file first (rotated, deleted and created
    again, truncated, or rewritten since the last read: read from the start of the file
    now at the path)."""

    CHUNK = 1 << 20  # bytes read at once: a large file is taken a chunk at a time
    TAIL = 64  # bytes before the position kept to tell a rewritten file

    def __init__(self, path: Path, file: BinaryIO) -> None:
        self.path = path
        self._start(file)

    def _start(self, file: BinaryIO) -> None:
        self.file = file
        self.identity = _identity(os.fstat(file.fileno()))
        self.position = 0  # bytes of whole lines taken
        self.pending = b""  # the start of a line still being written
        self.tail = b""  # the last bytes taken (up to TAIL), ending at `position`
        self.number = 0

    def close(self) -> None:
        self.file.close()

    def _rewound(self) -> bool:
        """Whether the file was truncated (shorter than what was read) or rewritten (the
        bytes before the position changed): then it is read again from its start."""
        fd = self.file.fileno()
        read = self.position + len(self.pending)
        if os.fstat(fd).st_size < read:
            return True
        if self.tail and os.pread(fd, len(self.tail), self.position - len(self.tail)) != self.tail:
            return True
        return bool(self.pending) and os.pread(fd, len(self.pending), self.position) != self.pending

    def _replaced(self) -> BinaryIO | None:
        """The file now at the path, when it is another than the one read (renamed or
        deleted, and created again); None while it is the same, or none is there yet."""
        try:
            now = os.stat(self.path)
        except OSError:
            return None
        if _identity(now) == self.identity:
            return None
        try:
            return self.path.open("rb")
        except OSError:
            return None

    def read(self) -> list[tuple[int, bytes]] | None:
        """The whole lines appended since the last read (at most about a chunk's worth), with
        their line numbers; None when there are none yet."""
        if self._rewound():
            self.file.seek(0)
            self._start(self.file)
        data = self.file.read(self.CHUNK)
        if not data:
            replaced = self._replaced()
            if replaced is None:
                return None
            # The old file is read to its end: its last line, if it has no newline, is
            # taken as it is (nothing will finish it), then the new file from its start.
            last = [(self.number + 1, self.pending)] if self.pending.strip() else []
            self.file.close()
            self._start(replaced)
            return last
        data = self.pending + data
        cut = data.rfind(b"\n") + 1
        whole, self.pending = data[:cut], data[cut:]
        lines = []
        for line in whole[:-1].split(b"\n") if whole else ():
            self.number += 1
            lines.append((self.number, line + b"\n"))
        self.position += len(whole)
        self.tail = (self.tail + whole)[-self.TAIL :]
        return lines


def _identity(found: os.stat_result) -> tuple[int, int]:
    return (found.st_dev, found.st_ino)


# --- CSV ------------------------------------------------------------------------------------


@attrs.define
class CsvConfig(RecordFields):
    """A CSV file whose first row names the columns (every value is a string)."""

    path: str = ""
    delimiter: str = ","
    # the longest field read, in characters (Python's csv stops at 131,072 by default); the
    # csv module's limit is process-wide: reading raises it to this, never lowers it
    max_field: int = attrs.field(default=1 << 26, validator=_positive_count)


class CsvTaskset(_FromFile, Taskset[Task, CsvConfig]):
    """The rows of a CSV file as tasks, read lazily (module docstring). Reading (`load`)
    raises a `ConfigError` naming `path` when it is empty, and `DatasetError` for a file
    that cannot be read or a row that is not a task."""

    def __init__(self, config: CsvConfig | str | os.PathLike[str] | None = None,
                 /, **fields: Any) -> None:  # fmt: skip
        super().__init__(_config_of(CsvConfig, config, fields))

    def load(self) -> Iterator[Task]:
        """The rows as tasks, read as they are taken. Raises a `ConfigError` naming `path`
        when it is empty, `DatasetError` for a file that cannot be read or a row without
        the prompt's field; a row that cannot be read is an unreadable record (module
        docstring)."""
        path = Path(_checked_path(self.config.path, "CsvTaskset"))
        try:
            # surrogateescape: a byte that is not UTF-8 fails its row, not the whole file
            file = path.open(encoding="utf-8", errors="surrogateescape", newline="")
        except OSError as exc:
            raise DatasetError(f"cannot read {path}: {exc.strerror or exc}") from exc
        if csv.field_size_limit() < self.config.max_field:
            csv.field_size_limit(self.config.max_field)
        return self._rows(file)

    def _rows(self, file: TextIO) -> Iterator[Task]:
        with file:
            reader = csv.DictReader(file, delimiter=self.config.delimiter)
            while True:
                where = f"{self.config.path}:{reader.line_num + 1}"
                try:
                    row = next(reader)
                except StopIteration:
                    return
                except csv.Error as exc:
                    why = f"not a CSV row ({exc}; max_field sets the longest field)"
                    yield unreadable_record(where, why, str(exc).encode())
                    continue
                where = f"{self.config.path}:{reader.line_num}"
                record = {k: v for k, v in row.items() if k is not None}
                if not any(record.values()):
                    continue
                bad = _not_utf8(record)
                if bad is not None:
                    yield unreadable_record(where, bad, repr(record).encode(errors="replace"))
                    continue
                answer = record.get(self.config.answer_field)
                if answer == "":
                    record.pop(self.config.answer_field)
                yield record_task(record, self.config, where)


def _not_utf8(record: dict[str, Any]) -> str | None:
    """Why a CSV row read with surrogateescape is not UTF-8 (a field holds an escaped byte)."""
    for name, value in record.items():
        for text in (name, value) if isinstance(value, str) else (name,):
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as exc:
                byte = ord(text[exc.start]) - 0xDC00
                return f"the row is not UTF-8 (byte 0x{byte:02x} in field {name!r}): save the file as UTF-8"
    return None


# --- Hugging Face ---------------------------------------------------------------------------


@attrs.define
class HFConfig(RecordFields):
    """A Hugging Face dataset: a hub id or a local dataset folder (`load_dataset`'s path, or
    a folder written by `save_to_disk`), and its split."""

    name: str = ""
    split: str = "train"
    subset: str | None = None  # load_dataset's second argument (a configuration name)


def _datasets() -> Any:
    try:
        import datasets
    except ImportError as exc:
        raise DatasetError(
            f"HFTaskset reads Hugging Face datasets with the `datasets` library, which cannot "
            f"be imported ({type(exc).__name__}: {exc}); install it with {HF_EXTRA}"
        ) from exc
    return datasets


def _saved_to_disk(path: Path) -> bool:
    return path.is_dir() and any(
        (path / name).is_file() for name in ("dataset_info.json", "state.json", "dataset_dict.json")
    )


class HFTaskset(Taskset[Task, HFConfig]):
    """The records of a Hugging Face dataset split as tasks, read lazily: a hub or file
    dataset is opened with `load_dataset(..., streaming=True)` (records are fetched as they
    are taken), a `save_to_disk` folder with `load_from_disk` (memory-mapped). Reading
    raises a `ConfigError` naming `name` when it is empty, and `DatasetError` for a dataset
    that cannot be read or a record that is not a task."""

    def __init__(self, config: HFConfig | str | None = None, /, **fields: Any) -> None:
        if isinstance(config, str):
            config = HFConfig(name=config, **fields)
            fields = {}
        super().__init__(_config_of(HFConfig, config, fields))

    @property
    def taskset_id(self) -> str:
        """`hf:NAME:SPLIT`: how runs name this taskset."""
        return f"hf:{self.config.name}:{self.config.split}"

    def _records(self) -> Iterable[Mapping[str, Any]]:
        name, split = self.config.name, self.config.split
        if not name:
            raise ConfigError(
                "HFTaskset: {name} is empty: name the dataset, e.g. name='gsm8k'", parameter="name"
            )
        datasets = _datasets()
        try:
            if _saved_to_disk(Path(name)):
                found = datasets.load_from_disk(name)
            else:
                found = datasets.load_dataset(name, self.config.subset, split=split, streaming=True)
        except Exception as exc:
            raise DatasetError(
                f"cannot load dataset {name!r} (split {split!r}): {type(exc).__name__}: {exc}"
            ) from exc
        if isinstance(found, datasets.DatasetDict):
            if split not in found:
                raise DatasetError(
                    f"dataset {name} has no split {split!r} (its splits: {', '.join(found)}); "
                    f"name one as hf:{name}:SPLIT (split=)"
                )
            found = found[split]
        return found  # type: ignore[no-any-return]

    def load(self) -> Iterator[Task]:
        where = f"{self.config.name}[{self.config.split}]"
        for index, record in enumerate(self._records()):
            yield record_task(dict(record), self.config, f"{where} record {index}")


# --- the TASKSET argument -------------------------------------------------------------------

DATA_SUFFIXES: dict[str, type[Taskset[Any, Any]]] = {".jsonl": JsonlTaskset, ".csv": CsvTaskset}


def data_target(spec: str) -> tuple[type[Taskset[Any, Any]], dict[str, Any]] | None:
    """The loader a TASKSET argument names, with its config fields: `PATH.jsonl`,
    `PATH.csv`, `hf:NAME[:SPLIT]`; None for any other TASKSET."""
    if spec.startswith("hf:"):
        name, _, split = spec.removeprefix("hf:").partition(":")
        fields: dict[str, Any] = {"name": name}
        if split:
            fields["split"] = split
        return HFTaskset, fields
    suffix = Path(spec).suffix.lower()
    if suffix in DATA_SUFFIXES and ":" not in Path(spec).name:
        return DATA_SUFFIXES[suffix], {"path": spec}
    return None
