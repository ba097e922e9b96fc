"""The dependency versions this package is built and tested against, and the check made before patching.

`trl` is patched at named internal anchors, so a trl outside the range is an error; transformers and datasets
outside theirs only warn. The ranges are those the newest installable Unsloth release accepts.
"""

from __future__ import annotations

import importlib.metadata
import warnings

from packaging.specifiers import SpecifierSet
from packaging.version import Version

SUPPORTED = {
    "trl": SpecifierSet("==1.15.0"),
    "transformers": SpecifierSet(">=4.56.2,<=5.17.0"),
    "datasets": SpecifierSet(">=4.7.0,<5.0.0"),
    # Optional: checked when Unsloth generates its GRPO trainer (unsloth_patch).
    "unsloth": SpecifierSet(">=2026.10.7,<2026.11"),
}
REQUIRED = ("trl", "transformers", "datasets")


def installed_version(package: str) -> Version:
    return Version(importlib.metadata.version(package))


def check_versions() -> None:
    """Raise ImportError for an unsupported trl; warn for unsupported transformers/datasets."""
    for package in REQUIRED:
        supported = SUPPORTED[package]
        found = installed_version(package)
        if found in supported:
            continue
        message = (
            f"unsloth_adaptive_kl supports {package}{supported}, found {package}=={found}. "
            f"Install a supported version: pip install '{package}{supported}'."
        )
        if package == "trl":
            raise ImportError(message)
        warnings.warn(message, stacklevel=3)
