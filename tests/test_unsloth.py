"""Unsloth integration. The real generated UnslothGRPOTrainer runs in subprocesses (tests/unsloth_cpu.py),
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
import warnings
from pathlib import Path
from typing import Any

import pytest

from unsloth_adaptive_kl.core.tolerance import (float32_chain_tolerance, reordered_sum_tolerance,
                                                two_path_logp_tolerance)

from .metric_definitions import assert_metrics_match

ROOT = Path(__file__).parents[1]
HARNESS = ROOT / "tests" / "unsloth_cpu.py"
HAS_UNSLOTH = importlib.util.find_spec("unsloth") is not None
if os.environ.get("ADAPTIVE_KL_REQUIRE_UNSLOTH") == "1" and not HAS_UNSLOTH:
    raise RuntimeError("ADAPTIVE_KL_REQUIRE_UNSLOTH=1 but unsloth is not installed")
needs_unsloth = pytest.mark.skipif(not HAS_UNSLOTH, reason="unsloth not installed (CI installs it)")
METHODS = ["none", "clip", "sigmoid", "length_normalized", "dynamic", "sigmoid+length_normalized+dynamic",
           "k2/sequence_sum", "user_three_k2", "k1_future"]  # k2/sequence_sum: clip with kl_estimator k2 and
# kl_reduction sequence_sum; user_three_k2: an estimator the harness registers with register_kl_estimator
# (1.5 (logp - ref)^2); k1_future: value k1, gradient the KL-to-go G_t of each token (by hand in the harness)


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
    assert result["config_class"] == "unsloth_adaptive_kl.integrations.trl.GRPOConfig"
    assert result["config_mro"][:3] == ["GRPOConfig", "GRPOConfig", "AdaptiveKLConfig"]
    assert result["restored_same_class"] is True
    assert result["patched_again"] is True
    # generation called again: the hooked loss still wraps Unsloth's own, and nothing is replaced a second time
    assert result["generated_again"] == {"loss": "_AdaptiveEfficientGRPO", "upstream": "UnslothEfficientGRPO",
                                         "replacements_added": 0}
    assert (result["method"], result["threshold"]) == ("clip+dynamic", 0.5)
    # unpatch() after generation: once, in words; patch() then says why it cannot hook again (it said "imported after
    # unsloth", which was not so)
    assert result["unpatch_warnings"] == [
        "unsloth_adaptive_kl.unpatch(): Unsloth generated UnslothGRPOTrainer and UnslothGRPOConfig while this package "
        "was patched; the trainer is stock again, but the config class keeps the adaptive-KL fields, which it no "
        "longer reads (set one and nothing adapts). Start a new Python process for stock Unsloth."]
    assert result["trl_config_after_unpatch"] == [True] * 4
    assert result["patch_after_unpatch"] == (
        "unsloth_adaptive_kl.patch() after unpatch(): Unsloth generated UnslothGRPOTrainer while this package was "
        "patched, and unpatch() took its hooks off; they cannot be put back on that class. Start a new Python process "
        "to train with adaptive KL in Unsloth.")
    assert result["restored"] == ["GRPOConfig", "clip+dynamic", 0.5]
    assert result["error"] == "kl_clip_threshold=-1.0 is invalid: allowed is a finite number > 0."
    # stock_unsloth (the stock side of the self-check, the GPU scenarios and the cost benchmarks, whose whole steps
    # generate too): every hook on a training step is Unsloth's own object inside it; only those that act before or
    # between steps stay (the trainer is built; no checkpoint is saved or loaded in a timed step)
    stock_step = result["stock_step"]
    outside_a_step = {"__init__", "_save_checkpoint", "_load_optimizer_and_scheduler", "current_beta"}
    assert outside_a_step < set(stock_step["replaced"])
    assert stock_step["unsloth_own_inside"] == sorted(set(stock_step["replaced"]) - outside_a_step)
    assert stock_step["hooked_after"] == stock_step["replaced"]
    # The estimator defaults on Unsloth's generated config: k3 in the loss and k1 in the reward by default, silently; k3 named in
    # the reward and k1 in the loss warn once each, naming the field, its value and the fix; k1_future is silent
    guards = result["guards"]
    assert {entry["class"] for entry in guards.values()} == {result["config_class"].rsplit(".", 1)[-1]}
    assert {label: entry["estimator"] for label, entry in guards.items()} == {
        "loss": "k3", "reward": "k1", "reward_k3": "k3", "loss_k1": "k1", "loss_k1_future": "k1_future"}
    assert guards["loss"]["warnings"] == guards["reward"]["warnings"] == guards["loss_k1_future"]["warnings"] == []
    (reward_k3,) = set(guards["reward_k3"]["warnings"])
    assert reward_k3.startswith("kl_estimator='k3' with kl_placement='reward': a KL in the reward must be the log-ratio")
    assert reward_k3.endswith("Use kl_estimator='k1' (the reward placement's default: leave kl_estimator unset).")
    (loss_k1,) = set(guards["loss_k1"]["warnings"])
    assert loss_k1.startswith("kl_estimator='k1' with kl_placement='loss': the expected gradient of k1 is zero")


@needs_unsloth
def test_import_after_unsloth_raises_import_error(tmp_path) -> None:
    error = run_scenario("late_import", tmp_path)["error"]
    assert error.startswith("unsloth_adaptive_kl was imported after unsloth")
    assert "import unsloth_adaptive_kl\n    import unsloth" in error


# The harness's micro-batch: 4 completions of at most 8 tokens.
TOKENS = 4 * 8


@needs_unsloth
def test_generated_trainer_none_is_stock_and_methods_match_formula(tmp_path) -> None:
    results = run_scenario("losses", tmp_path)
    assert set(results) == {"grpo", "bnpo", "dr_grpo", "dapo"}
    for loss_type, entry in results.items():
        # `none` runs the stock compiled loss: the same operations, so equal up to summation order.
        # The bound's magnitude is the sum of the terms' |.| (stock_magnitude), not |loss|: advantages cancel.
        assert entry["stock_magnitude"] >= abs(entry["stock_loss"])
        loss_tolerance = reordered_sum_tolerance(TOKENS, entry["stock_magnitude"])
        assert abs(entry["none_loss"] - entry["stock_loss"]) <= loss_tolerance, loss_type
        # Gradients: each token's upstream gradient may round differently (2 EPS32 relative), and one parameter's
        # gradient sums TOKENS of them.
        assert entry["stock_grad_max"] > 0
        assert entry["none_grad_diff"] <= 2 * reordered_sum_tolerance(TOKENS, entry["stock_grad_max"]), loss_type
        for method in METHODS:
            part = entry[method]
            # The formula takes log-probs from a plain forward + log_softmax, Unsloth from its fused path: they
            # differ by <= logp_error per token (max logit < 20 for this tiny model, vocabulary 20). For log ratios
            # within +/-1.5 the KL's derivative |1 - e^r| and its second derivative e^r are below e^1.5 < 4.5, and
            # every reduction weights a token by at most beta (beta * max_completion_length for sequence_sum).
            logp_error = two_path_logp_tolerance(20.0, 20)
            weight = 0.04 * (8 if method == "k2/sequence_sum" else 1)
            assert abs(part["kl_part"] - part["expected"]) <= weight * 4.5 * logp_error, (loss_type, method)
            assert part["grad_max"] > 0
            # Its gradient: each of the TOKENS per-token terms moves by <= 4.5 * logp_error relative to the largest,
            # plus the reordering error of the two backward passes whose difference it is (total - policy).
            grad_tolerance = (TOKENS * 4.5 * logp_error * part["grad_max"]
                              + 4 * reordered_sum_tolerance(TOKENS, entry["stock_grad_max"]))
            assert part["grad_diff"] <= grad_tolerance, (loss_type, method, part["grad_diff"], grad_tolerance)
            # current_beta * adapted_kl is the KL part of the loss, without the GA factor (2 here)
            assert part["metric_product"] == pytest.approx(2 * part["kl_part"], rel=1e-4), (loss_type, method)
            # the stock `kl` metric whatever the method (the compiled loss, run with beta=0.0, reports 0): Unsloth's
            # mean over completions of their token mean of k3, eager or compiled on the same inputs (k3 of log ratios
            # within +/-1.5: a few tenths)
            assert entry["stock_kl"] > 0.05
            assert abs(part["kl_metric"] - entry["stock_kl"]) <= reordered_sum_tolerance(TOKENS, entry["stock_kl"])
            if "metrics" in part:  # each logged adaptive_kl/* value against docs/metrics.md's definition
                assert_metrics_match(part["metrics"], part["expected_metrics"], rel=1e-4, abs_=1e-6)
        assert sum("metrics" in entry[method] for method in METHODS) == 6, loss_type
        assert entry["clip"]["kl_part"] < entry["none"]["kl_part"]
    grpo = results["grpo"]
    # grpo already averages per completion: length normalisation sums the same terms in another order.
    assert abs(grpo["length_normalized"]["kl_part"] - grpo["none"]["kl_part"]) <= reordered_sum_tolerance(
        TOKENS, grpo["none"]["kl_part"])
    assert results["dapo"]["length_normalized"]["kl_part"] != pytest.approx(results["dapo"]["none"]["kl_part"], rel=1e-3)


@needs_unsloth
def test_no_op_adaptations_reproduce_stock_unsloth_loss_and_gradients(tmp_path) -> None:
    """The KL the adapted path shapes is the installed grpo_compute_loss's own (its clamps in its order,
    its masking, its rejected tokens), so adaptations that change nothing give stock Unsloth's loss and gradients,
    on-policy and off-policy, with per-token KL past the [-10, 10] clamp."""
    results = run_scenario("drift", tmp_path)
    rejected = results.pop("rejected_tokens")
    bnpo_rule = results.pop("bnpo_rule")
    assert set(results) == {f"{lt}/{policy}" for lt in ("grpo", "bnpo", "dr_grpo", "dapo") for policy in ("on_policy", "off_policy")}
    for case, entry in results.items():
        expected = {"clip_above_every_kl", "dynamic_before_decay"}
        if case.startswith("grpo") or (case.startswith("bnpo") and bnpo_rule == "micro_batch"):
            expected.add("same_reduction")
        assert set(entry) - {"stock_loss", "stock_magnitude", "stock_grad_max"} == expected, case
        assert entry["stock_grad_max"] > 0
        for label in expected:
            variant = entry[label]
            # Both bounds are below the issue's 1e-6 here (the terms' magnitude < 0.5, gradients < 0.05).
            assert entry["stock_magnitude"] >= abs(entry["stock_loss"])
            loss_tolerance = reordered_sum_tolerance(TOKENS, entry["stock_magnitude"])
            assert abs(variant["loss"] - entry["stock_loss"]) <= min(loss_tolerance, 1e-6), (case, label)
            grad_tolerance = 2 * reordered_sum_tolerance(TOKENS, entry["stock_grad_max"])
            assert variant["grad_diff"] <= min(grad_tolerance, 1e-6), (case, label)
            assert variant["max_kl"] > 5  # the reduced KL: most tokens sit at the clamp of 10
    # Rejected tokens: about half rejected; where the installed version drops them from the KL (2026.10.9) the
    # stock loss changes with them, and the hooked loss follows it either way.
    assert 0.3 < rejected["rejected_fraction"] < 0.7
    stock, hooked = rejected["stock"], rejected["hooked"]
    assert rejected["stock_magnitude"] >= abs(stock["loss"])
    assert abs(hooked["loss"] - stock["loss"]) <= reordered_sum_tolerance(TOKENS, rejected["stock_magnitude"])
    grad_scale = max(abs(g) for g in stock["grad"])
    assert grad_scale > 0
    assert max(abs(a - b) for a, b in zip(hooked["grad"], stock["grad"])) <= 2 * reordered_sum_tolerance(TOKENS, grad_scale)
    if rejected["rejected_tokens_leave_kl"]:
        assert stock["loss"] != pytest.approx(rejected["stock_without_rejection"]["loss"], rel=1e-3)


@needs_unsloth
def test_generated_trainer_dynamic_beta_metrics_and_no_recompiles(tmp_path) -> None:
    result = run_scenario("dynamic", tmp_path)
    assert result["trainer_class"] == "UnslothGRPOTrainer" and result["stock_beta"] == 0.04
    # decay 0.5 per step at reward 1.0; after step 4 (beta_schedule_steps) beta_min
    assert result["betas"] == pytest.approx([0.04, 0.02, 0.01, 0.005, 0.001, 0.001])
    assert result["final_beta"] == pytest.approx(0.001)
    # Step 1's policy is the reference (LoRA's B = 0), scored on two paths whose log-probs may round differently on
    # another CPU: its KL is 0 up to k3's four float32 operations (exp counted twice) on parts of magnitude <= 3
    # (e^d ~ 1, |d| ~ 0, 1); later steps' KL is above that.
    rounding = float32_chain_tolerance(4, 3.0)
    assert result["raw_kl"] == result["adapted_kl"] and 0 <= result["raw_kl"][0] <= rounding < max(result["raw_kl"])
    assert len(result["sequence_kl"]) == 6
    # Beta changes every call: no new compiled graph through the hooks; stock Unsloth recompiles for each float beta.
    hooked, stock = result["graphs_hooked_beta_changes"], result["graphs_stock_beta_changes"]
    assert len(set(hooked)) == 1
    assert stock == [stock[0], stock[0] + 1, stock[0] + 2]


@needs_unsloth
def test_hook_failure_inside_unsloths_generation_stops_adaptive_runs_before_training(tmp_path) -> None:
    """One anchor broken, then Unsloth's own patch_trl_rl_trainers() (as PatchFastRL calls it on a GPU), whose
    try/except swallows the hook's error: every adaptive setting fails at construction with that error; `none`
    trains as stock Unsloth, with a warning naming it. Then a second generation call whose install fails midway, past
    the anchors: what it had replaced is undone, and the first refusal stands."""
    from unsloth_adaptive_kl.integrations.unsloth import SWALLOWED_NOTE

    result = run_scenario("hook_failure", tmp_path)
    assert result["trainer_class"] == "UnslothGRPOTrainer"  # Unsloth generated its trainer; the hook failed on it
    logged = [message for message in result["unsloth_log"] if "grpo_trainer" in message]
    assert len(logged) == 1 and logged[0].startswith("Unsloth: Could not patch trl.trainer.grpo_trainer: ")
    # the generations of the trainer files after grpo_trainer's (rloo, sft, ...) are none of the hook's business
    assert [message for message in result["unsloth_log"] if "unsloth_adaptive_kl" in message] == logged
    original = logged[0].removeprefix("Unsloth: Could not patch trl.trainer.grpo_trainer: ")
    assert "the anchor `loss_i = loss_i + beta * kl_i  # renamed`" in original
    assert original.startswith("unsloth_adaptive_kl cannot patch unsloth_zoo==")  # grpo_compute_loss is unsloth_zoo's
    for label in ("clip", "dynamic", "kl_in_reward", "k2", "ref_sync"):
        assert result[label] == {"type": "IncompatibleVersionError", "message": original, "notes": [SWALLOWED_NOTE]}
    # What the failed install had replaced is undone: the generated module's own loss and methods
    assert result["efficient_grpo"] == "UnslothEfficientGRPO" and result["hooked_methods"] == []
    none = result["none"]
    assert len(none["warnings"]) == 1 and original in none["warnings"][0]
    assert none["steps"] == 1 and none["has_adaptive_kl"] is False
    assert "kl" in none["logged"] and not [key for key in none["logged"] if key.startswith("adaptive_kl/")]
    # A second generation whose install fails midway: what it replaced is undone, Unsloth's generator stays hooked,
    # the trainer keeps the refusal of the first failure, and `clip` is still refused with that first error.
    midway = result["midway"]
    assert midway["raised"] == "the _save_checkpoint hook failed"
    assert midway["efficient_grpo"] == "UnslothEfficientGRPO"
    assert midway["replaced"] == [["unsloth.models.rl", "_patch_trl_rl_trainers"], ["UnslothGRPOTrainer", "__init__"]]
    assert midway["clip"] == original


FAKE_RL = '''
import sys, types
import trl.trainer.grpo_trainer as grpo_trainer

def _patch_trl_rl_trainers(trainer_file="grpo_trainer"):
    """Stands in for a changed Unsloth: generates a GRPO trainer whose module lacks UnslothEfficientGRPO."""
    if MODE == "fail" or trainer_file != "grpo_trainer":
        return  # generation failed, or another trainer: TRL's GRPO trainer stays
    module = types.ModuleType("UnslothGRPOTrainer")
    module.UnslothGRPOTrainer = type("UnslothGRPOTrainer", (grpo_trainer.GRPOTrainer,), {"__module__": "UnslothGRPOTrainer"})
    sys.modules["UnslothGRPOTrainer"] = module
    grpo_trainer.GRPOTrainer = module.UnslothGRPOTrainer

def patch_trl_rl_trainers():
    for trainer_file in ("dpo_trainer", "grpo_trainer", "sft_trainer"):  # each of trl.trainer's, as Unsloth's does
        _patch_trl_rl_trainers(trainer_file)
'''


@pytest.mark.parametrize("mode", ["changed", "fail", "renamed"])
def test_changed_or_failed_unsloth_generation_is_loud(tmp_path, mode: str) -> None:
    """A stand-in unsloth whose generation (called for each trainer file, GRPO's second) gives a trainer without the
    names the hook needs (changed), gives none (fail: one warning, for grpo_trainer alone), or whose generator is
    renamed (the hook cannot wrap it: the import fails naming it)."""
    fake = tmp_path / "fake"
    (fake / "unsloth" / "models").mkdir(parents=True)
    (fake / "unsloth" / "__init__.py").write_text("from .models import rl\nrl.patch_trl_rl_trainers()\n")
    (fake / "unsloth" / "models" / "__init__.py").write_text("")
    rl = FAKE_RL.replace("_patch_trl_rl_trainers", "_generate_trainer") if mode == "renamed" else FAKE_RL
    (fake / "unsloth" / "models" / "rl.py").write_text(f"MODE = {mode!r}\n" + rl)
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
    warned = [line for line in result.stdout.splitlines() if line.startswith("WARNING")]
    if mode == "changed":
        assert "ERROR unsloth_adaptive_kl cannot patch unsloth" in result.stdout
        assert "the anchor `UnslothEfficientGRPO` (a name the integration hooks) was not found" in result.stdout
        assert re.search(r"unsloth(==[\w.]+| \(not installed\)) \(tested: unsloth>=2026\.10\.7,<=2026\.10\.9\)",
                         result.stdout)
        assert warned == []  # dpo_trainer's generation, before it, is none of the hook's business
    elif mode == "renamed":
        assert "ERROR unsloth_adaptive_kl cannot patch unsloth" in result.stdout
        # before any generation: the message names the module, not "Unsloth's generated trainer"
        assert ("the anchor `_patch_trl_rl_trainers` (the function that generates Unsloth's trainer) was not found in "
                "unsloth.models.rl." in result.stdout)
    else:
        assert "IMPORTED" in result.stdout
        assert len(warned) == 1 and warned[0].startswith("WARNING Unsloth did not generate UnslothGRPOTrainer")


@needs_unsloth
def test_generated_trainer_kl_in_reward_advantages_loss_and_dynamic_beta(tmp_path) -> None:
    """kl_placement='reward' in Unsloth's generated trainer: advantages are the formula of r_i - beta * KL_i (summed
    KL per completion: the log-ratio k1 by default, k3 when named, which warns), the loss has no KL term, the stock
    reward metric is un-penalised, dynamic beta decays, and a resumed run takes beta back from its checkpoint."""
    results = run_scenario("reward", tmp_path)
    for label in ("group", "batch", "group_k3"):
        entry = results[label]
        assert entry["estimator"] == ("k3" if label == "group_k3" else "k1")
        if label == "group_k3":
            assert {w.split(":")[0] for w in entry["estimator_warnings"]} == {
                "kl_estimator='k3' with kl_placement='reward'"}
        else:
            assert entry["estimator_warnings"] == []
        assert entry["advantages"] == pytest.approx(entry["expected"], abs=2e-4)
        assert max(abs(a - b) for a, b in zip(entry["expected"], entry["unpenalised"])) > 0.05
        # the other estimator's formula does not fit: the check tells k1 and k3 apart
        assert max(abs(a - b) for a, b in zip(entry["advantages"], entry["other_estimator"])) > 0.05
        assert entry["penalty_metric"][0] == pytest.approx(0.5 * sum(entry["kl"]) / 8, rel=1e-4)
        assert entry["reward_metric"][0] == pytest.approx(sum(entry["rewards"]) / 8, abs=1e-6)
        assert entry["loss"] == pytest.approx(entry["loss_without_kl"], rel=1e-6, abs=1e-9)
        assert entry["kl_metric"][0] > 0.01  # the stock `kl` metric is still logged
    dynamic = results["dynamic"]
    assert dynamic["trainer_class"] == "UnslothGRPOTrainer"
    assert dynamic["betas"] == pytest.approx([1.0, 0.5, 0.25]) and dynamic["final_beta"] == pytest.approx(0.125)
    assert dynamic["penalties"] == pytest.approx([b * kl for b, kl in zip(dynamic["betas"], dynamic["sequence_kl"])])
    assert dynamic["reward"] == pytest.approx([1.0] * 3, abs=1e-6)
    # three optimizer steps of two micro-batches: the controller is stepped three times, once per step (the scoring
    # of each generation batch moves nothing), each step reading its scored batch of 2 micro-batches' completions
    counting = results["counting"]
    assert counting["calls"] == [1, 2, 3]
    assert counting["completions"] == [2 * counting["per_device_train_batch_size"]] * 3
    # resumed at step 2 of 4: the checkpoint holds 1.0 * 0.5^2, the resumed steps penalise with 0.25 and 0.125
    resume = results["resume"]
    assert resume["trainer_class"] == "UnslothGRPOTrainer"
    assert resume["saved_beta"] == pytest.approx(0.25)
    assert resume["resumed_betas"][-2:] == pytest.approx([0.25, 0.125])
    assert resume["resumed_final"] == pytest.approx(resume["full_final"], rel=1e-12) == pytest.approx(0.0625)


@needs_unsloth
def test_generated_trainer_syncs_the_reference_of_its_peft_model(tmp_path) -> None:
    """sync_ref_model=True in Unsloth's generated trainer (which refuses it stock, and keeps no "ref" adapter)."""
    results = run_scenario("ref_sync", tmp_path)
    floor = results["floor"]
    assert floor["trainer_class"] == "UnslothGRPOTrainer" and floor["has_ref_adapter"] is False
    assert floor["synced_raw"][:2] == floor["stock_raw"][:2]  # the stock reference until the first sync
    # Hard syncs after steps 2 and 4: steps 3 and 5 score the reference with the very weights and path of the policy
    # (measured 4e-15 and 1e-15), the same steps unsynced 8e-4 and 2e-3. Step 1 (policy == stock reference, scored
    # with the adapter disabled) logs 3.7e-3 in this harness: Unsloth's own gap, see test_unsloth_ref_logps.py.
    assert max(floor["synced_raw"][2], floor["synced_raw"][4]) <= 1e-12
    assert min(floor["stock_raw"][2], floor["stock_raw"][4]) > 5e-4
    assert floor["syncs"] == [0.0, 1.0, 1.0, 2.0, 2.0] and floor["stock_syncs"] == []
    # alpha = 0.5 after every step: each LoRA factor of the reference is 0.5 * policy + 0.5 * previous, exactly
    mix = results["mix"]
    assert len(mix["names"]) == 28 and all(".lora_A.default." in n or ".lora_B.default." in n for n in mix["names"])
    assert mix["initial_is_policy"] is True and mix["exact"] == [True, True, True]
    assert mix["policy_reference_gap"] > 1e-3
    # one generation after the syncs: the reference log-probs are the synced reference's (the trainer's own log-prob
    # function with the reference set by hand: equal), not the policy's; the policy is left bit for bit as it was
    forward = results["forward"]
    assert forward["weights_kept"] and forward["grads_kept"] and forward["optimizer_kept"]
    assert forward["gap_to_reference"] <= 1e-6 < 1e-2 < forward["gap_to_policy"]
    # resumed from checkpoint-3 (after the sync of step 2; alpha = 0.5): steps 4-6 log what the uninterrupted run did
    resume = results["resume"]
    for name, values in resume["full"].items():
        assert resume["resumed"][name] == pytest.approx(values, rel=1e-6, abs=1e-9), name
    assert resume["full"]["adaptive_kl/ref_syncs"] == [0.0, 1.0, 1.0, 2.0, 2.0, 3.0]


@needs_unsloth
def test_generated_config_changes_to_explicit_settings_warn_and_its_defaults_are_logged(tmp_path) -> None:
    """Unsloth's generated UnslothGRPOConfig rewrites some arguments before TRL's GRPOConfig sees them
    (unsloth/models/rl.py): an explicit scale_rewards True/'group' with dr_grpo becomes False, one warning naming the
    field, the value set and the value in effect; what it fills in for fields left unset (beta 0.001 for grpo,
    scale_rewards for dr_grpo, the DAPO paper's settings for an explicit dapo, vLLM's importance-sampling correction
    off) does not warn but is named in the settings line the trainer prints once at construction (an adapted setting),
    runtime fields included (learning rate, warmup, optimizer, weight decay, seed). The #6586 refusal holds on
    Unsloth's config too."""
    results = run_scenario("settings", tmp_path)
    for label, value_set in (("dr_grpo_group", "'group'"), ("dr_grpo_true", "True")):
        assert results[label]["warnings"] == [
            f"scale_rewards={value_set} was set explicitly, but Unsloth's generated UnslothGRPOConfig changed it to "
            "False: scale_rewards='none' is in effect."], label
        assert results[label]["in_effect"]["scale_rewards"] == "none"
    unset = {"dr_grpo_unset": {"scale_rewards": "group"}, "grpo_beta_unset": {"beta": 0.0},
             "dapo_explicit": {"epsilon_high": None, "mask_truncated_completions": False}}
    for label, trl_defaults in unset.items():  # Unsloth's own defaults: no warning, recorded with TRL's default
        assert results[label]["warnings"] == [], label
        defaults = results[label]["unsloth_defaults"]
        assert {name: defaults[name] for name in trl_defaults} == trl_defaults, label
        assert defaults["vllm_importance_sampling_correction"] is True
        assert results[label]["in_effect"]["vllm_importance_sampling_correction"] is False
    assert results["dr_grpo_unset"]["in_effect"]["scale_rewards"] == "none"
    # scale_rewards=None, Unsloth's own advice to keep the scaling (troubleshooting.md repeats it): no warning
    assert results["dr_grpo_none"]["warnings"] == [] and results["dr_grpo_none"]["in_effect"]["scale_rewards"] == "group"
    assert "scale_rewards" not in results["dr_grpo_none"]["unsloth_defaults"]
    assert results["grpo_beta_unset"]["in_effect"]["beta"] == 0.001
    dapo = results["dapo_explicit"]["in_effect"]
    assert (dapo["epsilon_high"], dapo["mask_truncated_completions"]) == (0.28, True)
    assert "beta" not in results["dr_grpo_group"]["unsloth_defaults"]  # set explicitly: neither warned nor noted
    assert results["sequence_clip"]["error"].startswith(
        "use_bias_correction_kl=True is invalid: allowed is False with importance_sampling_level='sequence'")
    assert "huggingface/trl#6586" in results["sequence_clip"]["error"]
    assert results["settings_lines"] == [
        "adaptive_kl: KL settings in effect for UnslothGRPOTrainer: beta=0.001 (Unsloth's default; TRL's is 0.0), "
        "kl_adaptation_method='clip', kl_estimator='k3' (unset: the placement's default), kl_placement='loss', "
        "loss_type='grpo', scale_rewards='group', num_iterations=1, importance_sampling_level='token', "
        "use_bias_correction_kl=True, steps_per_generation=2, gradient_accumulation_steps=2; Unsloth's other "
        "defaults that differ from TRL's: learning_rate=5e-05 (TRL's is 1e-06), warmup_steps=0.1 (TRL's is 0), "
        "optim='adamw_8bit' (TRL's is 'adamw_torch_fused'), weight_decay=0.001 (TRL's is 0.0), seed=3407 (TRL's is "
        "42), router_aux_loss_coef=0.0 (TRL's is None), generation_kwargs={} (TRL's is None), "
        "vllm_importance_sampling_correction=False (TRL's is True)"]


def test_a_loss_keyword_the_generated_trainer_stops_passing_is_an_error_naming_it() -> None:
    """The installed grpo_compute_loss reads the keywords it reduces the loss by with defaults (loss_type 'grpo',
    num_processes 1, gradient accumulation 1, ...): where the generated compute_loss stops passing one (a rename),
    the adaptive loss raises IncompatibleVersionError naming it, instead of reducing the KL by a default the loss no
    longer uses. steps_per_generation may be absent (grpo_accumulated_loss sets it; None, as the installed loss reads
    it, where it does not). The real generated trainer passes every one: the scenarios above run through it."""
    from unsloth_adaptive_kl.integrations import unsloth as integration
    from unsloth_adaptive_kl.integrations.grpo_loss import LossNormalisers
    from unsloth_adaptive_kl.integrations.versions import IncompatibleVersionError

    passed = {"loss_type": "dapo", "max_completion_length": 16, "num_items_in_batch": 40.0,
              "current_gradient_accumulation_steps": 2, "num_processes": 4}
    assert integration._normalisers(passed, "micro_batch") == ("dapo", LossNormalisers(16, 40.0, 4, None, 2))
    assert integration._normalisers({**passed, "steps_per_generation": 8}, "micro_batch")[1].steps_per_generation == 8
    assert integration._normalisers({**passed, "loss_type": "bnpo"}, "global")[0] == "dapo"
    # no token count to divide by (None): bnpo keeps its own reduction under either rule
    assert integration._normalisers({**passed, "loss_type": "bnpo", "num_items_in_batch": None}, "global")[0] == "bnpo"
    assert integration._normalisers({**passed, "loss_type": "bnpo"}, "micro_batch")[0] == "bnpo"
    for name in passed:
        with pytest.raises(IncompatibleVersionError, match=rf"`{name} = `.*UnslothGRPOTrainer\.compute_loss"):
            integration._normalisers({key: value for key, value in passed.items() if key != name}, "micro_batch")


def test_a_generated_compute_loss_that_does_not_call_the_compiled_loss_once_is_an_error() -> None:
    """The generated compute_loss must reach the shim (`UnslothEfficientGRPO.apply`) once per call: where a changed
    Unsloth calls it zero or two times, the wrapper raises IncompatibleVersionError naming that call instead of
    logging a step without a KL term, or one of two. The shim sees the running trainer only inside the call: after it
    (here, after the error) `_ACTIVE` is unset again, so a later call of the shim outside compute_loss runs stock."""
    from types import SimpleNamespace

    from unsloth_adaptive_kl.integrations import unsloth as integration
    from unsloth_adaptive_kl.integrations.versions import IncompatibleVersionError

    seen: list = []

    def generated(self: Any, model: Any, inputs: int, return_outputs: bool = False, num_items_in_batch: Any = None
                  ) -> float:
        """Unsloth's compute_loss, as far as the wrapper sees it: `inputs` shim calls, each recording its term."""
        trainer, calls = integration._ACTIVE.get()
        seen.append(trainer)
        calls.extend([None] * inputs)
        return 0.5

    compute_loss, trainer = integration._wrap_compute_loss(generated), SimpleNamespace(beta=0.04)
    for shim_calls in (0, 2):
        with pytest.raises(IncompatibleVersionError, match=r"unsloth_zoo.*`UnslothEfficientGRPO\.apply\(` \(the "
                           r"compiled loss, which the adaptive loss wraps\) was not found in Unsloth's generated "
                           r"trainer: grpo_accumulated_loss"):
            compute_loss(trainer, None, shim_calls)
        assert integration._ACTIVE.get() is None
    assert seen == [trainer, trainer]


def test_at_beta_zero_the_loss_hook_returns_unsloths_loss_but_refuses_a_setting_changed_mid_run() -> None:
    """At beta 0 the wrapper hands the call to Unsloth's compute_loss untouched (no KL term: the shim is not active
    in it); on ccb0d5c that early return also skipped the settings check every other door makes, there too. Unchanged
    args: Unsloth's loss; kl_adaptation_method changed on the args after the trainer was built: refused, naming it."""
    from types import SimpleNamespace

    from unsloth_adaptive_kl import AdaptiveKL, AdaptiveKLConfig
    from unsloth_adaptive_kl.integrations import unsloth as integration

    active: list = []

    def generated(self: Any, model: Any, inputs: Any, return_outputs: bool = False, num_items_in_batch: Any = None
                  ) -> float:
        active.append(integration._ACTIVE.get())
        return 0.5

    args = AdaptiveKLConfig()
    trainer = SimpleNamespace(beta=0.0, args=args, adaptive_kl=AdaptiveKL(AdaptiveKLConfig(), beta=0.0))
    compute_loss = integration._wrap_compute_loss(generated)
    assert compute_loss(trainer, None, None) == 0.5 and active == [None]
    args.kl_adaptation_method = "clip"
    with pytest.raises(ValueError, match=r"^kl_adaptation_method changed from 'none' to 'clip' after the run started"):
        compute_loss(trainer, None, None)
    assert active == [None]


@needs_unsloth
def test_pad_equal_to_eos_masks_every_eos_out_of_unsloths_loss_and_warns(tmp_path) -> None:
    """Unsloth's loss receives the mask `completion_ids != pad_token_id` (TRL's includes each completion's EOS): with
    pad = EOS, on one step's batch, no completion's EOS is in it while every letter before it is; with a pad token of
    its own every EOS is. The trainer's construction says so, once, for pad = EOS only, and refuses an adapted KL
    there (`none` stays stock)."""
    results = run_scenario("pad_is_eos", tmp_path)
    same, own = results["pad_is_eos"], results["own_pad"]
    assert same["eos_completions"] > 0 and same["eos_in_mask"] == 0
    assert same["letters_in_mask"] == same["letters"] > 0
    assert own["eos_completions"] > 0 and own["eos_in_mask"] == own["eos_completions"]
    assert len(same["warnings"]) == 1 and same["warnings"][0].startswith(
        "pad_token_id=0 is the eos_token_id: Unsloth's GRPO loss masks every pad token out of the loss")
    assert results["refused"].startswith("pad_token_id=0 is invalid: allowed is a token other than the eos_token_id "
                                         "(0) with kl_adaptation_method='clip', kl_placement='loss': Unsloth's GRPO")
    assert own["warnings"] == []


@needs_unsloth
def test_unsloths_sample_weights_refuse_an_adapted_kl_at_construction_and_leave_none_stock(tmp_path) -> None:
    """With Unsloth's per-completion weights on, building the trainer with `clip` raises the documented error (the
    troubleshooting page's); `none` warns once, logs no adaptive_kl/* metric, and on a weighted batch its loss and
    gradients are stock Unsloth's exactly (the shim hands the call to Unsloth's own loss). Set only after a `clip`
    trainer was built, they stop its first loss call; with beta = 0 (no KL term) `clip` is built without a word."""
    results = run_scenario("sample_weights", tmp_path)
    troubleshooting = (ROOT / "docs" / "troubleshooting.md").read_text()
    assert f"NotImplementedError: {results['refused']}\n" in troubleshooting
    assert len(results["warnings"]) == 1 and "the loss stays stock Unsloth's" in results["warnings"][0]
    assert results["adaptive_metrics"] == [] and results["logged_kl"]  # the step logged, its KL stock Unsloth's
    assert len(results["weights"]) == 4 and any(weight > 0 for weight in results["weights"])  # the weights reach it
    assert results["loss"] == results["stock_loss"]
    # set only after a `clip` trainer was built: its first loss call stops the run, naming them
    assert results["set_late"] == (
        "Unsloth's per-completion loss weights (UNSLOTH_GRPO_ZERO_VARIANCE_EXCLUDE=1 or UNSLOTH_GRPO_LOSS_AGGREGATION="
        "prompt) reweight the loss's rows, which an adapted KL term does not follow: they were set after the trainer "
        "was built")
    assert results["beta_zero"] == []  # beta = 0: no KL term, so `clip` is neither refused nor warned about
    assert results["grad_diff"] == 0.0 and results["grad_max"] > 0
    grpo = results["grpo"]  # exclusion alone with grpo: Unsloth ignores it (and says so), so nothing is refused
    assert grpo["ours"] == [] and grpo["unsloth_ignores"] and grpo["weights"] is None
    assert "adaptive_kl/clip_fraction" in grpo["adaptive_metrics"]


@pytest.mark.parametrize(("mode", "weighted"), [
    (None, ()),
    ((True, False), ("bnpo", "dapo", "cispo", "vespo")),
    ((False, True), ("grpo", "sapo", "bnpo", "dapo", "cispo", "vespo", "dr_grpo")),
    ((True, True), ("grpo", "sapo", "bnpo", "dapo", "cispo", "vespo", "dr_grpo")),
])
def test_unsloths_weights_are_refused_only_where_unsloth_applies_them(mode, weighted) -> None:
    """Unsloth's `_unsloth_grpo_sample_weight` (2026.10.7-10.9, whose rule the anchors pin) weights with prompt-level
    aggregation for every loss type but luspo, with zero-variance exclusion alone for bnpo/dapo/cispo/vespo only."""
    from unsloth_adaptive_kl.integrations.unsloth import unsloth_weights_loss

    loss_types = ("grpo", "sapo", "bnpo", "dapo", "cispo", "vespo", "dr_grpo", "luspo")
    assert tuple(t for t in loss_types if unsloth_weights_loss(mode, t)) == weighted


@pytest.mark.parametrize("beta", [0.04, 0.0])
def test_the_pad_check_reads_a_processors_tokenizer_and_passes_one_without_pad_or_eos(beta: float) -> None:
    """The construction check of pad = EOS (`_check_unsupported`, run after the generated __init__), Unsloth's sample
    weights off (mode None): with a processor as processing_class it reads the tokenizer the processor holds (pad 0 =
    EOS 0: `clip` refused; with beta = 0 there is no KL term, so, as for the sample weights, only the stock warning
    about the EOS's policy gradient); a tokenizer with neither a pad nor an EOS token (None = None) has no EOS for
    Unsloth's mask to drop, so nothing is refused or warned."""
    from types import SimpleNamespace

    from unsloth_adaptive_kl import AdaptiveKLConfig
    from unsloth_adaptive_kl.integrations.unsloth import _check_unsupported
    from unsloth_adaptive_kl.tools.tiny import build_tokenizer

    def generated_init(self: Any, processing_class: Any) -> None:
        """What the generated __init__ (wrapped by `wrap_init`) leaves on the trainer, as far as the check reads it."""
        self.processing_class, self.beta, self.args = processing_class, beta, SimpleNamespace(loss_type="dapo")
        self.adaptive_kl = SimpleNamespace(config=AdaptiveKLConfig(kl_adaptation_method="clip"))

    init = _check_unsupported(generated_init, lambda: None)
    processor = SimpleNamespace(tokenizer=build_tokenizer("ab", pad_is_eos=True))
    if beta:
        with pytest.raises(ValueError, match=r"^pad_token_id=0 is invalid: allowed is a token other than the "
                                             r"eos_token_id \(0\) with kl_adaptation_method='clip'"):
            init(SimpleNamespace(), processor)
    else:
        with pytest.warns(UserWarning, match=r"^pad_token_id=0 is the eos_token_id: Unsloth's GRPO loss masks"):
            init(SimpleNamespace(), processor)
    tokenizer = build_tokenizer("ab")
    tokenizer.pad_token = tokenizer.eos_token = None
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id) == (None, None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        init(SimpleNamespace(), tokenizer)


@needs_unsloth
def test_the_exact_settings_reach_the_optimum_through_unsloths_trainer(tmp_path) -> None:
    """The end-to-end guards through Unsloth's generated trainer (tests/test_trainer_lab.py has TRL's): the KL lab's
    command as a user runs it, with dr_grpo, 800 steps of 64 completions, k1 in the reward and k1_future in the loss
    (the package's loss-side KL inside Unsloth's compiled loss), one run each on its own core: each lands on pi*_beta
    within the TRL guard's tolerance, with an effective beta within 5 % of 0.5 (the lab's tokenizer has a pad token of
    its own: with pad = EOS Unsloth's loss drops every EOS, test above).

    Unsloth's loss masks every pad token, so nothing in it would keep a sampled pad down; the guard once failed on
    another CPU because float differences let the pad's probability drift to 0.007. It cannot now on any machine: the
    pad's logit is a constant of the model's construction (`trainer_lab.bias_unit`: a fixed hidden coordinate read by
    a row of lm_head that receives exactly zero gradient), so its probability is 0 in float64 whatever the run does
    (tests/test_trainer_lab.py redraws every other weight and checks it)."""
    from .test_trainer_lab import TOLERANCE

    output = tmp_path / "guard.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "unsloth_adaptive_kl.tools.kl_lab", "--trainer", "unsloth", "--recipe", "dr_grpo",
               "--only", "k1 in the reward", "--only", "k1_future in the loss", "--seeds", "1", "--processes", "2",
               "--json", str(output)]
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    rows = json.loads(output.read_text())["trainers"]["unsloth"]["rows"]
    assert [row["setting"] for row in rows] == ["k1 in the reward", "k1_future in the loss"]
    for row in rows:
        assert row["train"]["kl_opt"] < TOLERANCE, row
        assert abs(row["train"]["effective_beta"] - 0.5) < 0.025, row
        assert row["pad_probability"] < 1e-12  # 1 - the letters' probabilities in float64: rounding alone
        # the scorer Unsloth's loss called, counted in the run (the GPU check's guard names it on CUDA)
        assert row["logprob_path"].startswith("fused linear log-probs on the hidden states ("), row


# What a user's `import unsloth` does on a machine without a GPU (no test switch set): troubleshooting.md's
# "Unsloth on a CPU" says what, per Unsloth release.
UNSLOTH_ON_A_CPU = textwrap.dedent('''
    import json
    import sys
    import unsloth_adaptive_kl
    try:
        import unsloth
    except NotImplementedError as error:
        json.dump({"error": str(error)}, open(sys.argv[1], "w"))
        raise SystemExit(0)
    import torch
    import trl
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer
    from unsloth_adaptive_kl.integrations.unsloth import generated_grpo_trainer
    from unsloth_adaptive_kl.tools.tiny import add_lora, build_tiny_model, build_tokenizer

    torch.set_num_threads(1)
    tokenizer = build_tokenizer()
    args = GRPOConfig(output_dir="out", use_cpu=True, bf16=False, report_to="none", disable_tqdm=True,
                      save_strategy="no", per_device_train_batch_size=8, num_generations=4, max_completion_length=8,
                      max_steps=2, logging_steps=1, learning_rate=5e-3, beta=0.04, kl_adaptation_method="clip")
    trainer = GRPOTrainer(model=add_lora(build_tiny_model(tokenizer)), processing_class=tokenizer,
                          reward_funcs=[lambda completions, **kw: [len(set(t)) / 8 for t in completions]], args=args,
                          train_dataset=Dataset.from_dict({"prompt": ["ab:", "cde:", "fg:", "h:"] * 8}))
    trainer.train()
    json.dump({"trainer": f"{type(trainer).__module__}.{type(trainer).__qualname__}",
               "is_trls": trl.GRPOTrainer is sys.modules["trl.trainer.grpo_trainer"].GRPOTrainer,
               "patched": unsloth_adaptive_kl.is_patched(), "generated": generated_grpo_trainer() is not None,
               "logged": [sorted(k for k in e if k.startswith("adaptive_kl/")) for e in trainer.state.log_history[:-1]]},
              open(sys.argv[1], "w"))
''')


@needs_unsloth
def test_unsloth_on_a_cpu_does_what_the_troubleshooting_page_says(tmp_path) -> None:
    """`import unsloth_adaptive_kl; import unsloth` with no GPU and no test switch: an Unsloth without a CPU backend
    (2026.10.7, 2026.10.8) raises the error the page quotes; one with it (`unsloth/_cpu_init.py`, 2026.10.9) generates
    no Unsloth trainer, and TRL's GRPOTrainer, patched, trains `clip` and logs its metrics."""
    script, output = tmp_path / "unsloth_on_a_cpu.py", tmp_path / "result.json"
    script.write_text(UNSLOTH_ON_A_CPU)
    env = {name: value for name, value in os.environ.items()
           if name not in ("UNSLOTH_ALLOW_CPU", "UNSLOTH_COMPILE_DISABLE", "UNSLOTH_DISABLE_CPU_FALLBACK")}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    result = subprocess.run([sys.executable, str(script), str(output)], cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    found = json.loads(output.read_text())
    page = (ROOT / "docs" / "troubleshooting.md").read_text()
    section = page[page.index("## Unsloth on a CPU"):]
    (quoted,) = re.findall(r"```text\n(.*?)\n```", section[:section.index("\n## ", 3)], re.S)
    if not (Path(importlib.util.find_spec("unsloth").origin).parent / "_cpu_init.py").exists():
        assert f"NotImplementedError: {found['error']}" == quoted
        return
    assert found["trainer"] == "trl.trainer.grpo_trainer.GRPOTrainer" and found["is_trls"]
    assert found["patched"] and not found["generated"]
    assert [("adaptive_kl/clip_fraction" in logged, "adaptive_kl/raw_kl" in logged) for logged in found["logged"]] == [
        (True, True)] * 2
