"""Name -> function registries: adding an estimator, shaping or reduction is adding a decorated function."""

from __future__ import annotations

from typing import Callable, TypeVar

F = TypeVar("F", bound=Callable)


def registrar(table: dict[str, F]) -> Callable[[str], Callable[[F], F]]:
    """A decorator factory that stores the decorated function in `table` under the given name."""

    def register(name: str) -> Callable[[F], F]:
        def add(function: F) -> F:
            table[name] = function
            return function

        return add

    return register
