"""What a results file records of the machine and the checkout that wrote it."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import subprocess
from typing import Iterable, Optional

import torch


def hardware() -> str:
    """The CUDA card this process computes on, else 'CPU: MODEL, N cores, T torch threads' (the model name from
    /proc/cpuinfo where there is one): timings and float digits depend on it."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    try:
        with open("/proc/cpuinfo") as f:
            cpuinfo = f.read().splitlines()
    except OSError:
        cpuinfo = []
    cpu = next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")),
               platform.processor() or platform.machine())
    return f"CPU: {cpu}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads"


def installed_versions(packages: Iterable[str]) -> dict[str, str]:
    """{package: version} for each of `packages` that is installed, in their order."""
    found = {}
    for package in packages:
        try:
            found[package] = importlib.metadata.version(package.replace("_", "-"))
        except importlib.metadata.PackageNotFoundError:
            pass
    return found


def source_commit() -> Optional[str]:
    """The commit of this package's checkout, for a results JSON: $ADAPTIVE_KL_COMMIT where set (a copy of the tree
    without its git folder, as a GPU machine gets), else `git rev-parse HEAD` with "+changes" where tracked files
    differ from it; None outside a checkout."""
    if os.environ.get("ADAPTIVE_KL_COMMIT"):
        return os.environ["ADAPTIVE_KL_COMMIT"]
    checkout = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if not os.path.isdir(os.path.join(checkout, ".git")):  # an installed wheel, or a copy of the tree
        return None
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=checkout, capture_output=True, text=True, timeout=30)
        changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=checkout,
                                 capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if head.returncode != 0:
        return None
    return head.stdout.strip() + ("+changes" if changed.stdout.strip() else "")
