"""Unsloth integration (SPEC 5). The real generated UnslothGRPOTrainer runs in subprocesses (tests/unsloth_cpu.py),
since importing unsloth rewrites TRL for the whole process; `.ci/run` installs unsloth and sets
ADAPTIVE_KL_REQUIRE_UNSLOTH=1 so these cannot be skipped there. The anchor checks use a stand-in `unsloth` package
and run everywhere."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
HARNESS = ROOT / "tests" / "unsloth_cpu.py"
HAS_UNSLOTH = importlib.util.find_spec("unsloth") is not None
if os.environ.get("ADAPTIVE_KL_REQUIRE_UNSLOTH") == "1" and not HAS_UNSLOTH:
    raise RuntimeError("ADAPTIVE_KL_REQUIRE_UNSLOTH=1 but unsloth is not installed")
needs_unsloth = pytest.mark.skipif(not HAS_UNSLOTH, reason="unsloth not installed (CI installs it)")
METHODS = ["none", "clip", "sigmoid", "length_normalized", "dynamic", "sigmoid+length_normalized+dynamic",
           "k2/sequence_sum"]  # the last: clip with kl_estimator k2 and kl_reduction sequence_sum


def run_scenario(scenario: str, tmp_path: Path, extra_path: str = "") -> dict:
    """Run one harness scenario in a fresh process whose working directory holds its unsloth_compiled_cache."""
    output = tmp_path / f"{scenario}.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [extra_path, str(ROOT)])), "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, str(HARNESS), scenario, str(output)], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return json.loads(output.read_text())


@needs_unsloth
def test_import_first_gives_unsloth_config_the_fields(tmp_path) -> None:
    result = run_scenario("config", tmp_path)
    assert result["trainer_class"] == "UnslothGRPOTrainer"
    # Unsloth's generated config subclasses ours, and Unsloth renames it after the class it replaced (for pickle)
    assert result["is_ours_subclassed"] is True
    assert result["config_class"] == "unsloth_adaptive_kl.trl_patch.GRPOConfig"
    assert result["config_mro"][:3] == ["GRPOConfig", "GRPOConfig", "AdaptiveKLConfig"]
    assert result["restored_same_class"] is True
    assert (result["method"], result["threshold"]) == ("clip+dynamic", 0.5)
    assert result["restored"] == ["GRPOConfig", "clip+dynamic", 0.5]
    assert result["error"] == "kl_clip_threshold=-1.0 is invalid: allowed is a finite number > 0."


@needs_unsloth
def test_import_after_unsloth_raises_import_error(tmp_path) -> None:
    error = run_scenario("late_import", tmp_path)["error"]
    assert error.startswith("unsloth_adaptive_kl was imported after unsloth")
    assert "import unsloth_adaptive_kl\n    import unsloth" in error


@needs_unsloth
def test_generated_trainer_none_is_stock_and_methods_match_formula(tmp_path) -> None:
    results = run_scenario("losses", tmp_path)
    assert set(results) == {"grpo", "bnpo", "dr_grpo", "dapo"}
    for loss_type, entry in results.items():
        assert entry["none_loss"] == pytest.approx(entry["stock_loss"], rel=1e-6, abs=1e-7), loss_type
        assert entry["none_grad_diff"] <= 1e-6, loss_type
        for method in METHODS:
            part = entry[method]
            assert part["kl_part"] == pytest.approx(part["expected"], rel=1e-4, abs=1e-8), (loss_type, method)
            # SPEC 4: current_beta * adapted_kl is the KL part of the loss, without the GA factor (2 here)
            assert part["metric_product"] == pytest.approx(2 * part["kl_part"], rel=1e-4), (loss_type, method)
        assert entry["clip"]["kl_part"] < entry["none"]["kl_part"]
    assert results["grpo"]["length_normalized"]["kl_part"] == pytest.approx(results["grpo"]["none"]["kl_part"], rel=1e-6)
    assert results["dapo"]["length_normalized"]["kl_part"] != pytest.approx(results["dapo"]["none"]["kl_part"], rel=1e-3)


@needs_unsloth
def test_generated_trainer_dynamic_beta_metrics_and_no_recompiles(tmp_path) -> None:
    result = run_scenario("dynamic", tmp_path)
    assert result["trainer_class"] == "UnslothGRPOTrainer" and result["stock_beta"] == 0.04
    # decay 0.5 per step at reward 1.0; after step 4 (beta_schedule_steps) beta_min
    assert result["betas"] == pytest.approx([0.04, 0.02, 0.01, 0.005, 0.001, 0.001])
    assert result["final_beta"] == pytest.approx(0.001)
    assert result["raw_kl"] == result["adapted_kl"] and result["raw_kl"][0] == 0.0 and max(result["raw_kl"]) > 0
    assert len(result["sequence_kl"]) == 6
    # Beta changes every call: no new compiled graph through the hooks; stock Unsloth recompiles for each float beta.
    hooked, stock = result["graphs_hooked_beta_changes"], result["graphs_stock_beta_changes"]
    assert len(set(hooked)) == 1
    assert stock == [stock[0], stock[0] + 1, stock[0] + 2]


FAKE_RL = '''
import sys, types
import trl.trainer.grpo_trainer as grpo_trainer

def _patch_trl_rl_trainers(trainer_file="grpo_trainer"):
    """Stands in for a changed Unsloth: generates a trainer whose module lacks UnslothEfficientGRPO."""
    if MODE == "fail":
        return  # generation failed: TRL's trainer stays
    module = types.ModuleType("UnslothGRPOTrainer")
    module.UnslothGRPOTrainer = type("UnslothGRPOTrainer", (grpo_trainer.GRPOTrainer,), {"__module__": "UnslothGRPOTrainer"})
    sys.modules["UnslothGRPOTrainer"] = module
    grpo_trainer.GRPOTrainer = module.UnslothGRPOTrainer

def patch_trl_rl_trainers():
    _patch_trl_rl_trainers("grpo_trainer")
'''


@pytest.mark.parametrize("mode", ["changed", "fail"])
def test_changed_or_failed_unsloth_generation_is_loud(tmp_path, mode: str) -> None:
    fake = tmp_path / "fake"
    (fake / "unsloth" / "models").mkdir(parents=True)
    (fake / "unsloth" / "__init__.py").write_text("from .models import rl\nrl.patch_trl_rl_trainers()\n")
    (fake / "unsloth" / "models" / "__init__.py").write_text("")
    (fake / "unsloth" / "models" / "rl.py").write_text(f"MODE = {mode!r}\n" + FAKE_RL)
    script = textwrap.dedent("""
        import warnings
        import unsloth_adaptive_kl
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                import unsloth
                print("IMPORTED")
            except RuntimeError as error:
                print("ERROR", error)
        for warning in caught:
            print("WARNING", warning.message)
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(fake), str(ROOT)])}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    if mode == "changed":
        assert "ERROR unsloth_adaptive_kl: the anchor `UnslothEfficientGRPO` was not found" in result.stdout
        assert re.search(r"\(found unsloth(==[\w.]+| \(not installed\)), unsloth_zoo(==[\w.]+| \(not installed\)); "
                         r"supported unsloth<2026.11,>=2026.10.7\)", result.stdout)
    else:
        assert "IMPORTED" in result.stdout
        assert "WARNING Unsloth did not generate UnslothGRPOTrainer" in result.stdout
