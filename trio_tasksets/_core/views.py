"""`View`: a read-only attribute that shows the attribute of the same name of one of the
instance's parts, where a class would otherwise write a property for each (an adaptive
window's ``min`` and ``max`` are its controller's, a client's ``timeout`` its call loop's).

    class AdaptiveWindow(Window):
        min = View[int]("controller", "the smallest size it takes")

reads ``window.controller.min``; assigning ``window.min`` raises ``AttributeError``, as a
property without a setter does.
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar, overload

__all__ = ["View"]

T = TypeVar("T")


class View(Generic[T]):
    """A read-only view of ``instance.<part>.<name>``, ``name`` being the attribute this
    view is bound to in its class."""

    def __init__(self, part: str, doc: str | None = None) -> None:
        self.part = part
        self.name = ""
        self.__doc__ = doc

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, instance: None, owner: type | None = None) -> View[T]: ...

    @overload
    def __get__(self, instance: object, owner: type | None = None) -> T: ...

    def __get__(self, instance: object | None, owner: type | None = None) -> View[T] | T:
        if instance is None:
            return self
        value: T = getattr(getattr(instance, self.part), self.name)
        return value

    def __set__(self, instance: object, value: Any) -> None:
        raise AttributeError(f"{self.name} is read-only: it shows {self.part}.{self.name}")
