"""`@tt.tool`: a typed function with a docstring becomes a `tt.Tool` (name, description, JSON
schema of its arguments, and a call that validates them first).

The schema is built from the type hints at decoration; a hint it cannot express is a
TypeError there, naming the parameter, never a surprise at the first call. Supported: `int`,
`float`, `str`, `bool`, `list[X]` (and `tuple[X, ...]`, `set[X]`, `Sequence[X]`),
`dict[str, X]`, `Literal[...]`, `X | None` / `Optional[X]`, unions of these, attrs classes and
TypedDicts (nested objects), and `Annotated[X, "a description"]`. A parameter's description
comes from `Annotated`, or else from the docstring's `Args:` section (Google style) or
`:param name:` lines; the tool's description is the docstring's text before those.
"""

from __future__ import annotations

import collections.abc
import inspect
import math
import re
import types
import typing
from collections.abc import Awaitable, Callable
from typing import Any, Literal, TypeVar, overload

import attrs
import trio

from .._core.exceptions import ConfigTypeError, TrioTasksetsError

__all__ = ["Tool", "ToolArgumentError", "tool"]

F = TypeVar("F", bound=Callable[..., Any])

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # what OpenAI accepts as a function name


class ToolArgumentError(TrioTasksetsError, ValueError):
    """Arguments that do not fit a tool's schema; the message names the argument and says
    what was expected (a tool env shows it to the model)."""


# --- the kinds of values a schema describes -----------------------------------------------


class _Kind:
    """One node of a parameter's type: its JSON schema, and how to check (and convert) a
    decoded JSON value against it."""

    def schema(self) -> dict[str, Any]:
        raise NotImplementedError

    def check(self, value: Any, path: str) -> Any:
        raise NotImplementedError


def _describe(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"boolean {str(value).lower()}"
    if isinstance(value, int | float):
        return f"number {value!r}"
    if isinstance(value, str):
        shown = value if len(value) <= 40 else value[:37] + "..."
        return f"string {shown!r}"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def _wrong(path: str, expected: str, value: Any) -> ToolArgumentError:
    return ToolArgumentError(f"{path}: expected {expected}, got {_describe(value)}")


@attrs.frozen
class _Scalar(_Kind):
    type: type

    def schema(self) -> dict[str, Any]:
        return {"type": _JSON_TYPES[self.type]}

    def check(self, value: Any, path: str) -> Any:
        kind = self.type
        if kind is bool:
            if isinstance(value, bool):
                return value
            raise _wrong(path, "a boolean", value)
        if kind is str:
            if isinstance(value, str):
                return value
            raise _wrong(path, "a string", value)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise _wrong(path, "an integer" if kind is int else "a number", value)
        if kind is int:
            if isinstance(value, float):
                if not value.is_integer():  # JSON Schema: 3.0 is an integer, 3.5 is not
                    raise _wrong(path, "an integer", value)
                return int(value)
            return value
        if not math.isfinite(value):
            raise _wrong(path, "a finite number", value)
        return float(value)


_JSON_TYPES = {int: "integer", float: "number", str: "string", bool: "boolean"}


@attrs.frozen
class _Null(_Kind):
    def schema(self) -> dict[str, Any]:
        return {"type": "null"}

    def check(self, value: Any, path: str) -> Any:
        if value is not None:
            raise _wrong(path, "null", value)
        return None


@attrs.frozen
class _Any(_Kind):
    def schema(self) -> dict[str, Any]:
        return {}

    def check(self, value: Any, path: str) -> Any:
        return value


@attrs.frozen
class _Array(_Kind):
    items: _Kind
    into: Callable[[list[Any]], Any] = list

    def schema(self) -> dict[str, Any]:
        items = self.items.schema()
        return {"type": "array", "items": items} if items else {"type": "array"}

    def check(self, value: Any, path: str) -> Any:
        if not isinstance(value, list):
            raise _wrong(path, "an array", value)
        return self.into([self.items.check(v, f"{path}[{i}]") for i, v in enumerate(value)])


@attrs.frozen
class _Mapping(_Kind):
    values: _Kind

    def schema(self) -> dict[str, Any]:
        values = self.values.schema()
        return {"type": "object", "additionalProperties": values or True}

    def check(self, value: Any, path: str) -> Any:
        if not isinstance(value, dict):
            raise _wrong(path, "an object", value)
        return {k: self.values.check(v, f"{path}.{k}") for k, v in value.items()}


@attrs.frozen
class _Enum(_Kind):
    values: tuple[Any, ...]

    def schema(self) -> dict[str, Any]:
        kinds = {type(v) for v in self.values}
        out: dict[str, Any] = {"enum": list(self.values)}
        if len(kinds) == 1 and (kind := kinds.pop()) in _JSON_TYPES:
            out = {"type": _JSON_TYPES[kind], **out}
        return out

    def check(self, value: Any, path: str) -> Any:
        for allowed in self.values:
            if value == allowed and type(value) is type(allowed):
                return allowed
        choices = ", ".join(repr(v) for v in self.values)
        raise _wrong(path, f"one of {choices}", value)


@attrs.frozen
class _Union(_Kind):
    options: tuple[_Kind, ...]

    def schema(self) -> dict[str, Any]:
        return {"anyOf": [option.schema() for option in self.options]}

    def check(self, value: Any, path: str) -> Any:
        problems = []
        for option in self.options:
            try:
                return option.check(value, path)
            except ToolArgumentError as exc:
                problems.append(str(exc).partition(": expected ")[2].partition(", got")[0])
        raise _wrong(path, " or ".join(problems), value)


@attrs.frozen
class _Field:
    kind: _Kind
    required: bool
    description: str | None = None


@attrs.frozen
class _Object(_Kind):
    """An object with named fields: a tool's arguments, an attrs class, a TypedDict."""

    fields: dict[str, _Field]
    build: Callable[[dict[str, Any]], Any] = dict
    title: str | None = None

    def schema(self) -> dict[str, Any]:
        properties = {}
        for name, field in self.fields.items():
            schema = field.kind.schema()
            if field.description:
                schema = {**schema, "description": field.description}
            properties[name] = schema
        out: dict[str, Any] = {"type": "object", "properties": properties}
        required = [name for name, field in self.fields.items() if field.required]
        if required:
            out["required"] = required
        out["additionalProperties"] = False
        return out

    def check(self, value: Any, path: str) -> Any:
        if not isinstance(value, dict):
            raise _wrong(path, "an object", value)
        unknown = [name for name in value if name not in self.fields]
        if unknown:
            takes = ", ".join(self.fields) or "none"
            where = "" if path == "arguments" else f"{path}: "
            raise ToolArgumentError(
                f"{where}unexpected argument {unknown[0]!r} (it takes: {takes})"
            )
        out: dict[str, Any] = {}
        for name, field in self.fields.items():
            inner = name if path == "arguments" else f"{path}.{name}"
            if name not in value:
                if field.required:
                    raise ToolArgumentError(f"missing argument {inner!r}")
                continue
            out[name] = field.kind.check(value[name], inner)
        return self.build(out)


# --- from type hints to kinds -------------------------------------------------------------


_ARRAYS: dict[Any, Callable[[list[Any]], Any]] = {
    list: list,
    collections.abc.Sequence: list,
    collections.abc.Iterable: list,
    tuple: tuple,
    set: set,
    frozenset: frozenset,
}


def _kind_of(hint: Any, where: str) -> _Kind:
    """The kind a type hint describes, or TypeError naming `where` (the parameter)."""
    if hint is type(None) or hint is None:
        return _Null()
    if hint is Any:
        return _Any()
    if hint in _JSON_TYPES:
        return _Scalar(hint)
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Annotated:
        return _kind_of(args[0], where)
    if origin is Literal:
        if not all(isinstance(v, str | int | float | bool) or v is None for v in args):
            raise _refused(f"{where}: Literal values must be str, int, float, bool or None")
        return _Enum(tuple(args))
    if origin is typing.Union or origin is types.UnionType:
        return _Union(tuple(_kind_of(arg, where) for arg in args))
    if hint in _ARRAYS:
        return _Array(_Any(), _ARRAYS[hint])
    if origin in _ARRAYS:
        if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
            raise _refused(
                f"{where}: only tuple[X, ...] can be a tool argument (a JSON array of one "
                f"type), got {_name(hint)}; use list[X] or an attrs class"
            )
        return _Array(_kind_of(args[0], where) if args else _Any(), _ARRAYS[origin])
    if hint is dict or origin in (dict, collections.abc.Mapping):
        if args and args[0] is not str:
            raise _refused(
                f"{where}: a dict argument needs str keys (JSON objects), got {_name(hint)}"
            )
        return _Mapping(_kind_of(args[1], where) if args else _Any())
    if isinstance(hint, type) and attrs.has(hint):
        return _attrs_object(hint, where)
    if typing.is_typeddict(hint):
        return _typeddict_object(hint, where)
    raise _refused(
        f"{where}: a tool argument cannot be {_name(hint)}; use int, float, str, bool, "
        f"list[...], dict[str, ...], Literal[...], X | None, an attrs class or a TypedDict"
    )


def _refused(message: str) -> ConfigTypeError:
    """A function `@tt.tool` cannot make a tool of: a `ConfigTypeError` naming `fn`."""
    return ConfigTypeError(message, parameter="fn")


def _name(hint: Any) -> str:
    return getattr(hint, "__qualname__", None) or repr(hint)


def _attrs_object(cls: type, where: str) -> _Object:
    hints = typing.get_type_hints(cls, include_extras=True)
    fields: dict[str, _Field] = {}
    for field in attrs.fields(cls):
        if not field.init:
            continue
        hint = hints.get(field.name, field.type)
        if hint is None:
            raise _refused(f"{where}: attrs field {cls.__name__}.{field.name} has no type")
        name = field.alias or field.name
        fields[name] = _Field(
            _kind_of(hint, f"{where}.{name}"),
            required=field.default is attrs.NOTHING,
            description=_annotated_text(hint),
        )
    return _Object(fields, build=lambda values: cls(**values), title=cls.__name__)


def _typeddict_object(cls: Any, where: str) -> _Object:
    hints = typing.get_type_hints(cls, include_extras=True)
    required: frozenset[str] = getattr(cls, "__required_keys__", frozenset(hints))
    fields = {
        name: _Field(
            _kind_of(_strip_required(hint), f"{where}.{name}"),
            required=name in required,
            description=_annotated_text(hint),
        )
        for name, hint in hints.items()
    }
    return _Object(fields, title=cls.__name__)


def _strip_required(hint: Any) -> Any:
    while typing.get_origin(hint) in (typing.Required, typing.NotRequired):
        hint = typing.get_args(hint)[0]
    return hint


def _annotated_text(hint: Any) -> str | None:
    if typing.get_origin(hint) is typing.Annotated:
        for extra in typing.get_args(hint)[1:]:
            if isinstance(extra, str):
                return extra
    return None


# --- docstrings ---------------------------------------------------------------------------

_SECTION = re.compile(
    r"^\s*(Args|Arguments|Parameters|Returns|Return|Raises|Yields|Examples?|Notes?)\s*:?\s*$"
)
_SPHINX = re.compile(r"^\s*:param\s+(?:[^:]+\s)?(\w+)\s*:\s*(.*)$")
_GOOGLE_ARG = re.compile(r"^\s*(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$")


def _parse_doc(doc: str) -> tuple[str, dict[str, str]]:
    """(the description, {parameter: its description}) of a docstring."""
    lines = inspect.cleandoc(doc).splitlines()
    text: list[str] = []
    params: dict[str, str] = {}
    section: str | None = None
    current: str | None = None
    for line in lines:
        sphinx = _SPHINX.match(line)
        if sphinx:
            current = sphinx.group(1)
            params[current] = sphinx.group(2).strip()
            section = "sphinx"
            continue
        header = _SECTION.match(line)
        if header:
            section = header.group(1).lower()
            current = None
            continue
        if section is None:
            text.append(line)
        elif section in ("args", "arguments", "parameters"):
            found = _GOOGLE_ARG.match(line)
            if found and _indent(line) <= 4:
                current = found.group(1)
                params[current] = found.group(2).strip()
            elif current is not None and line.strip():
                params[current] = f"{params[current]} {line.strip()}".strip()
        elif section == "sphinx" and current is not None and line.strip():
            if line.lstrip().startswith(":"):
                current = None
            else:
                params[current] = f"{params[current]} {line.strip()}".strip()
    description = "\n".join(text).strip()
    return description, params


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


# --- the tool -----------------------------------------------------------------------------


@attrs.frozen(eq=False)
class Tool:
    """A function a model may call: its `name`, `description`, the JSON schema of its
    arguments (`parameters`) and the function itself (`fn`, async or sync).

    `schema` is the OpenAI ``tools`` entry. `await tool.call(arguments)` validates the
    decoded arguments against the schema first (a `ToolArgumentError` naming the argument,
    before the function runs), converts them (a float that is a whole number to an int,
    an object to its attrs class, an array to a tuple or set where the hint says so) and
    calls the function; a sync function runs inline in the trio thread (give blocking work
    to ``trio.to_thread.run_sync`` inside it). Build one with `@tt.tool`.
    """

    name: str
    description: str
    fn: Callable[..., Any] = attrs.field(repr=False)
    _arguments: _Object = attrs.field(repr=False, alias="arguments")

    @property
    def parameters(self) -> dict[str, Any]:
        """The JSON schema of the arguments object."""
        return self._arguments.schema()

    @property
    def schema(self) -> dict[str, Any]:
        """The tool as an OpenAI ``tools`` entry: ``{"type": "function", "function": {name,
        description, parameters}}``."""
        function: dict[str, Any] = {"name": self.name, "parameters": self.parameters}
        if self.description:
            function["description"] = self.description
        return {"type": "function", "function": function}

    def validate(self, arguments: object) -> dict[str, Any]:
        """The keyword arguments `arguments` (a decoded JSON object) stand for, checked
        and converted; `ToolArgumentError` when they do not fit the schema."""
        checked: dict[str, Any] = self._arguments.check(arguments, "arguments")
        return checked

    async def call(self, arguments: object) -> Any:
        """Validate `arguments`, then call the function with them (awaited if async)."""
        kwargs = self.validate(arguments)
        result = self.fn(**kwargs)
        if inspect.isawaitable(result):
            return await result
        await trio.lowlevel.checkpoint()
        return result

    async def __call__(self, **arguments: Any) -> Any:
        """`call` with keyword arguments: ``await add(a=1, b=2)``."""
        return await self.call(arguments)


@overload
def tool(fn: Callable[..., Any], /) -> Tool: ...
@overload
def tool(
    *, name: str | None = None, description: str | None = None
) -> Callable[[Callable[..., Any]], Tool]: ...
def tool(
    fn: Callable[..., Any] | None = None,
    /,
    *,
    name: str | None = None,
    description: str | None = None,
) -> Tool | Callable[[Callable[..., Any]], Tool]:
    """Turn a typed function (async or sync) with a docstring into a `tt.Tool`.

    ``@tt.tool`` or ``@tt.tool(name=..., description=...)``. The name defaults to the
    function's, the description to its docstring (before an ``Args:`` section, whose
    entries describe the parameters). Every parameter needs a type hint the schema can
    express (see the module); a parameter with a default is optional.

    Raises a `ConfigTypeError` (a `ConfigError` and a TypeError) here, at decoration,
    naming `fn` for anything it cannot express (a missing or unsupported hint,
    ``*args``/``**kwargs``, a positional-only parameter, a generator function) or `name`
    for a name OpenAI would refuse.
    """

    def build(function: Callable[..., Any]) -> Tool:
        return _build(function, name, description)

    if fn is not None:
        return build(fn)
    return build


def _build(fn: Callable[..., Any], name: str | None, description: str | None) -> Tool:
    if not callable(fn):
        raise _refused(f"@tt.tool decorates a function, got {type(fn).__name__}")
    if isinstance(fn, Tool):
        return fn
    tool_name = name if name is not None else getattr(fn, "__name__", "")
    if not _NAME.match(tool_name):
        raise ConfigTypeError(
            f"@tt.tool: a tool's {{name}} must be 1-64 letters, digits, '_' or '-', got "
            f"{tool_name!r}; pass name=...",
            parameter="name",
        )
    where = f"@tt.tool {tool_name}"
    if inspect.isasyncgenfunction(fn) or inspect.isgeneratorfunction(fn):
        raise _refused(f"{where}: a tool returns one value; it cannot be a generator function")
    try:
        hints = typing.get_type_hints(fn, include_extras=True)
    except Exception as exc:
        raise _refused(f"{where}: cannot read its type hints: {exc}") from exc
    doc_text, doc_params = _parse_doc(inspect.getdoc(fn) or "")
    fields: dict[str, _Field] = {}
    for param in inspect.signature(fn).parameters.values():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise _refused(f"{where}: *args and **kwargs cannot be tool arguments")
        if param.kind is param.POSITIONAL_ONLY:
            raise _refused(f"{where}: {param.name} is positional-only; tools take names")
        if param.name not in hints:
            raise _refused(f"{where}: parameter {param.name!r} needs a type hint")
        hint = hints[param.name]
        fields[param.name] = _Field(
            _kind_of(hint, f"{where}: parameter {param.name!r}"),
            required=param.default is param.empty,
            description=_annotated_text(hint) or doc_params.get(param.name),
        )
    text = description if description is not None else doc_text
    return Tool(name=tool_name, description=text, fn=fn, arguments=_Object(fields))


AnyTool = Tool | Callable[..., Awaitable[Any]] | Callable[..., Any]
