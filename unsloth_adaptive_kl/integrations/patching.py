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
        self._originals: list[tuple[Any, str, Any]] = []

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
        return any(o is owner and n == name for o, n, _ in self._originals)

    def replace(self, owner: Any, name: str, replacement: Any) -> None:
        self._originals.append((owner, name, vars(owner).get(name, _MISSING)))
        setattr(owner, name, replacement)

    def restore(self, keep: int = 0) -> None:
        """Undo every replacement made after the first `keep` (by default all of them), newest first."""
        while len(self._originals) > keep:
            owner, name, original = self._originals.pop()
            if original is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, original)
