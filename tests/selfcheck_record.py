"""A self-check run here against its committed record (docs/results/selfcheck.json, which docs/install.md shows, and
selfcheck_verl.json, docs/verl.md's): the record says what the self-check prints today."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]
# A measured figure of a self-check line (a loss, a gradient difference, a bound, seconds, a version): its digits
# depend on the machine and the versions; the rest of the line does not.
FIGURE = re.compile(r"\d+(?:\.\d+)*(?:e[-+]?\d+)?")


def run_self_check(tmp_path: Path) -> tuple[subprocess.CompletedProcess, dict]:
    """`python -m unsloth_adaptive_kl --json selfcheck.json` in tmp_path, on the CPU even where a GPU is visible (its
    lines name the device, and the committed records' is a CPU): the process and the record it wrote."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "",
           "ADAPTIVE_KL_COMMIT": "0123456"}  # as a copy of the tree without its git folder records it
    result = subprocess.run([sys.executable, "-m", "unsloth_adaptive_kl", "--json", "selfcheck.json"], cwd=tmp_path,
                            env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    record = json.loads((tmp_path / "selfcheck.json").read_text())
    out = result.stdout.splitlines()
    assert record["lines"] == [line for line in out if line in record["lines"]]  # as printed, in order
    assert record["lines"][0].startswith("unsloth_adaptive_kl self-check") and record["lines"][-1] == out[-1]
    assert record["command"] == "python -m unsloth_adaptive_kl --json selfcheck.json" and record["passed"]
    assert record["commit"] == "0123456"
    return result, record


def label(line: str) -> str:
    """'[ok] trl anchors: 22 of 22 found' -> 'trl anchors': what a line checks, whatever its outcome."""
    return re.sub(r"^\[\w+\] ", "", line).split(": ")[0]


def assert_like_the_record(record: dict, name: str) -> None:
    """With the same packages installed as docs/results/NAME records, the same checks in the same order and every
    line the same but its measured figures (anchor counts exactly); with fewer (the matrix's rows without Unsloth), a
    subset of its checks."""
    committed = json.loads((ROOT / "docs" / "results" / name).read_text())
    assert committed["command"] == f"python -m unsloth_adaptive_kl --json docs/results/{name}"
    assert committed["passed"] and committed["lines"][-1].startswith("self-check passed")
    if set(record["versions"]) != set(committed["versions"]):
        assert {label(line) for line in record["lines"]} <= {label(line) for line in committed["lines"]}
        return

    def shape(line: str) -> str:
        return line if label(line).endswith(" anchors") else FIGURE.sub("#", line)

    assert [shape(line) for line in record["lines"]] == [shape(line) for line in committed["lines"]]
