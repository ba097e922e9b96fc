"""Name -> function registries: adding an estimator, shaping, reduction or beta controller is adding a decorated
function or class. The method registries (shapings, beta controllers) live here, so that the config's parser
(`config.parse_methods`), the adaptation and the controllers all read the same tables without importing each other."""

from __future__ import annotations

from typing import Any, Callable

# `kl_adaptation_method` names: per-token shapings (k -> k'), the length method, and beta controllers. Built-ins are
# registered by core/adaptation.py and core/controllers.py; users add theirs with the public decorators there.
SHAPINGS: dict[str, Callable[..., Any]] = {}
LENGTH_METHODS = ("length_normalized",)
BETA_CONTROLLERS: dict[str, Callable[..., Any]] = {}


def method_names() -> tuple[str, ...]:
    """Every `kl_adaptation_method` name, in application order: shapings, length normalisation, beta controllers."""
    return (*SHAPINGS, *LENGTH_METHODS, *BETA_CONTROLLERS)


NAME_RULE = "a new, non-empty name without surrounding spaces, other than 'None'"


def selectable(name: Any) -> bool:
    """Whether a registered `name` can be selected by a config: a non-empty string without surrounding whitespace
    (the config strips a method's), other than 'None' (a command line's None, read as unset)."""
    return isinstance(name, str) and bool(name) and name == name.strip() and name != "None"


def new_method_name(decorator: str, name: Any) -> str:
    """`name`, checked for a new `kl_adaptation_method`: `selectable`, without '+', not 'none', not taken by any
    method. A ValueError naming the decorator, the value and the names taken otherwise."""
    if not selectable(name) or "+" in name or name == "none" or name in method_names():
        raise ValueError(f"{decorator}({name!r}): allowed is {NAME_RULE}, without '+' and other than 'none' "
                         f"(taken: {', '.join(method_names())}).")
    return name
