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


def new_method_name(decorator: str, name: Any) -> str:
    """`name`, checked for a new `kl_adaptation_method`: a non-empty string without '+', not 'none', not taken by
    any method. A ValueError naming the decorator, the value and the names taken otherwise."""
    if not isinstance(name, str) or not name or "+" in name or name == "none" or name in method_names():
        raise ValueError(f"{decorator}({name!r}): allowed is a new, non-empty name without '+' other than 'none' "
                         f"(taken: {', '.join(method_names())}).")
    return name
