"""What a results file records of the machine that wrote it."""

from __future__ import annotations

import importlib.metadata
import os
import platform
from typing import Iterable

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
