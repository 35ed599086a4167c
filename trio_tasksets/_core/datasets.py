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
lines. A record without a prompt, or a line that is not a JSON object, is a `DatasetError`
naming the file, the line and the fix.

`follow=True` (JSONL only) makes the taskset a feed: `stream()` yields the file's records,
then waits for lines appended to it (checking every `poll` seconds) and never ends; a line
is taken once it is whole (ends in a newline). A file truncated in place (log rotation by
copy and truncate) is read again from its start.
"""

from __future__ import annotations

import csv
import json
import os
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol, TextIO

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
    "record_task",
]

HF_EXTRA = "pip install 'trio-tasksets[hf]'"
"""How to install what `HFTaskset` needs (the `datasets` library)."""

PROMPT_FIELDS = ("prompt", "question")  # tried in order when no prompt field is named


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


# --- JSONL ----------------------------------------------------------------------------------


def _positive_seconds(instance: object, attribute: attrs.Attribute[float], value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ConfigError(
            f"{{{attribute.name}}} must be a number of seconds > 0, got {value!r}",
            parameter=attribute.name,
        )


@attrs.define
class JsonlConfig(RecordFields):
    """A JSONL file: one JSON object per line (blank lines are skipped)."""

    path: str = ""
    follow: bool = False  # a feed: keep reading lines appended to the file
    poll: float = attrs.field(default=0.25, validator=_positive_seconds)


def _config(cls: type[Any], config: Any, fields: dict[str, Any]) -> Any:
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
        super().__init__(_config(JsonlConfig, config, fields))

    @property
    def streaming(self) -> bool:
        return self.config.follow

    def _path(self) -> Path:
        return Path(_checked_path(self.config.path, "JsonlTaskset"))

    def _open(self) -> TextIO:
        path = self._path()
        try:
            return path.open(encoding="utf-8")
        except OSError as exc:
            raise DatasetError(f"cannot read {path}: {exc.strerror or exc}") from exc

    def _task(self, line: str, number: int) -> Task | None:
        if not line.strip():
            return None
        where = f"{self.config.path}:{number}"
        try:
            record = json.loads(line)
        except ValueError as exc:
            raise DatasetError(f"{where}: not a JSON line ({exc})") from None
        if not isinstance(record, dict):
            raise DatasetError(f"{where}: a record must be a JSON object, got {line.strip()[:80]}")
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
        """`follow=True`: the file's records, then each whole line appended to it, forever.
        Otherwise the static tasks (the views applied)."""
        if not self.config.follow:
            for task in self:
                yield task
            return
        file = self._open()
        try:
            number = 0
            pending = ""
            while True:
                line = file.readline()
                if not line:
                    if _truncated(file):
                        file.seek(0)
                        number, pending = 0, ""
                        continue
                    await trio.sleep(self.config.poll)
                    continue
                if not line.endswith("\n"):  # a line still being written
                    pending += line
                    continue
                line, pending = pending + line, ""
                number += 1
                record = self._task(line, number)
                if record is not None:
                    yield record
                else:
                    await trio.lowlevel.checkpoint()
        finally:
            file.close()


def _truncated(file: TextIO) -> bool:
    """Whether the file is now shorter than where we read (truncated in place)."""
    try:
        return os.fstat(file.fileno()).st_size < file.tell()
    except OSError:
        return False


# --- CSV ------------------------------------------------------------------------------------


@attrs.define
class CsvConfig(RecordFields):
    """A CSV file whose first row names the columns (every value is a string)."""

    path: str = ""
    delimiter: str = ","


class CsvTaskset(_FromFile, Taskset[Task, CsvConfig]):
    """The rows of a CSV file as tasks, read lazily (module docstring). Reading (`load`)
    raises a `ConfigError` naming `path` when it is empty, and `DatasetError` for a file
    that cannot be read or a row that is not a task."""

    def __init__(self, config: CsvConfig | str | os.PathLike[str] | None = None,
                 /, **fields: Any) -> None:  # fmt: skip
        super().__init__(_config(CsvConfig, config, fields))

    def load(self) -> Iterator[Task]:
        """The rows as tasks, read as they are taken. Raises a `ConfigError` naming `path`
        when it is empty, `DatasetError` for a file that cannot be read or a bad row."""
        path = Path(_checked_path(self.config.path, "CsvTaskset"))
        try:
            file = path.open(encoding="utf-8", newline="")
        except OSError as exc:
            raise DatasetError(f"cannot read {path}: {exc.strerror or exc}") from exc
        return self._rows(file)

    def _rows(self, file: TextIO) -> Iterator[Task]:
        with file:
            reader = csv.DictReader(file, delimiter=self.config.delimiter)
            for row in reader:
                record = {k: v for k, v in row.items() if k is not None}
                if not any(record.values()):
                    continue
                answer = record.get(self.config.answer_field)
                if answer == "":
                    record.pop(self.config.answer_field)
                yield record_task(record, self.config, f"{self.config.path}:{reader.line_num}")


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
        super().__init__(_config(HFConfig, config, fields))

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
