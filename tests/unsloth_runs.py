"""How the Unsloth tests run Unsloth's real generated UnslothGRPOTrainer: in subprocesses (tests/unsloth_cpu.py),
since importing unsloth rewrites TRL for the whole process. `.ci/run` installs unsloth and sets
ADAPTIVE_KL_REQUIRE_UNSLOTH=1, so these cannot be skipped there."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
HARNESS = ROOT / "tests" / "unsloth_cpu.py"
HAS_UNSLOTH = importlib.util.find_spec("unsloth") is not None
if os.environ.get("ADAPTIVE_KL_REQUIRE_UNSLOTH") == "1" and not HAS_UNSLOTH:
    raise RuntimeError("ADAPTIVE_KL_REQUIRE_UNSLOTH=1 but unsloth is not installed")
needs_unsloth = pytest.mark.skipif(not HAS_UNSLOTH, reason="unsloth not installed (CI installs it)")


def run_scenario(scenario: str, tmp_path: Path) -> dict:
    """Run one harness scenario in a fresh process whose working directory holds its unsloth_compiled_cache."""
    output = tmp_path / f"{scenario}.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, str(HARNESS), scenario, str(output)], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return json.loads(output.read_text())
