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
from typing import Any

import pytest

ROOT = Path(__file__).parents[1]
HARNESS = ROOT / "tests" / "unsloth_cpu.py"
HAS_UNSLOTH = importlib.util.find_spec("unsloth") is not None
if os.environ.get("ADAPTIVE_KL_REQUIRE_UNSLOTH") == "1" and not HAS_UNSLOTH:
    raise RuntimeError("ADAPTIVE_KL_REQUIRE_UNSLOTH=1 but unsloth is not installed")
needs_unsloth = pytest.mark.skipif(not HAS_UNSLOTH, reason="unsloth not installed (CI installs it)")


def run_scenario(scenario: str, tmp_path: Path, timeout: int = 900) -> dict:
    """Run one harness scenario (or several, joined by commas) in a fresh process whose working directory holds its
    unsloth_compiled_cache."""
    output = tmp_path / f"{scenario.replace(',', '+')}.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, str(HARNESS), scenario, str(output)], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return json.loads(output.read_text())


class ScenariosInTurn:
    """Harness scenarios run in turn in one fresh process, at the first test that asks for one: each test reads its
    own scenario's result, or fails with that scenario's traceback (or the process's failure, which is not run
    again for the next test)."""

    def __init__(self, scenarios: tuple[str, ...], tmp_path_factory: pytest.TempPathFactory) -> None:
        self.scenarios, self.tmp_path_factory = scenarios, tmp_path_factory
        self.outcomes: dict[str, dict] | None = None

    def __call__(self, scenario: str) -> dict:
        assert scenario in self.scenarios, scenario
        if self.outcomes is None:
            folder = self.tmp_path_factory.mktemp("scenarios")
            try:
                self.outcomes = run_scenario(",".join(self.scenarios), folder, timeout=300 * len(self.scenarios))
            except (AssertionError, subprocess.TimeoutExpired) as error:
                failed = {"traceback": f"the process of {', '.join(self.scenarios)} failed:\n{error}"}
                self.outcomes = dict.fromkeys(self.scenarios, failed)
        outcome = self.outcomes[scenario]
        if "traceback" in outcome:
            pytest.fail(f"scenario {scenario} raised:\n{outcome['traceback']}", pytrace=False)
        return outcome["result"]


def scenarios_in_turn(*scenarios: str) -> Any:
    """A test module's `scenario` fixture: `scenarios`, in this order, in one process (`ScenariosInTurn`)."""

    @pytest.fixture(scope="module")
    def scenario(tmp_path_factory: pytest.TempPathFactory) -> ScenariosInTurn:
        return ScenariosInTurn(scenarios, tmp_path_factory)

    return scenario
