"""The record of what a patch replaced, so that it can be restored exactly (attributes that were inherited or absent
are deleted again rather than copied in): the one mechanism behind every replacement the integrations make, for the
life of a patch (`patch()` / `unpatch()`) or for one block (`with PatchSet() as patches:`)."""

from __future__ import annotations

from types import TracebackType
from typing import Any, Optional

_MISSING = object()


class PatchSet:
    """Replacements made on objects (modules, classes, instances), undone in reverse order by `restore`. As a context
    manager, every replacement made in the block is undone when it exits, also when it raises."""

    def __init__(self) -> None:
        self._originals: list[tuple[Any, str, Any, Any]] = []  # (owner, name, original, replacement)

    def __bool__(self) -> bool:
        return bool(self._originals)

    def __len__(self) -> int:
        return len(self._originals)

    def __enter__(self) -> "PatchSet":
        return self

    def __exit__(
        self, kind: Optional[type], error: Optional[BaseException], traceback: Optional[TracebackType]
    ) -> None:
        self.restore()

    def replaced(self, owner: Any, name: str) -> bool:
        return any(o is owner and n == name for o, n, _, _ in self._originals)

    def replace(self, owner: Any, name: str, replacement: Any, *, stock: Any = _MISSING) -> None:
        """owner.name = replacement; a restore puts back what it held, or `stock` where given (what it held is a
        copy of our own patch: a module Unsloth generated from TRL's patched source)."""
        self._originals.append((owner, name, vars(owner).get(name, _MISSING) if stock is _MISSING else stock,
                                replacement))
        setattr(owner, name, replacement)

    def restore(self, keep: int = 0, *, leave_newer: bool = False) -> None:
        """Undo every replacement made after the first `keep` (by default all of them), newest first. With
        `leave_newer` (the end of a patch's life, `unpatch()`), an attribute that no longer holds the replacement was
        set again since, by someone else (Unsloth points trl.GRPOConfig at the config it generates): that newer value
        stays, as restoring ours would undo theirs, also where it wraps ours (Unsloth's fused head around the CPU
        log-prob fallback, on a GPU with trl 1.15), which then stays in that path. A block restores what was there
        before it, whatever the block set since (the KL in the reward appends its weight to the trainer's for one
        generation)."""
        while len(self._originals) > keep:
            owner, name, original, replacement = self._originals.pop()
            if leave_newer and vars(owner).get(name, _MISSING) is not replacement:
                continue
            if original is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, original)
