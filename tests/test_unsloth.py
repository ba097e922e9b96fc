"""Unsloth integration: the generated trainer's wiring (import order, generation, hooks, config, beta, the KL in
the reward, reference syncing) and the end-to-end lab guard; tests/test_unsloth_loss.py has its loss. The real
generated UnslothGRPOTrainer runs in subprocesses (tests/unsloth_runs.py), some scenarios in turn in one; the anchor
checks use a stand-in `unsloth` package and run everywhere."""

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

from unsloth_adaptive_kl.core.tolerance import float32_chain_tolerance

from .unsloth_runs import ROOT, needs_unsloth, run_scenario, scenarios_in_turn


# The scenarios that share one process (tests/unsloth_runs.py), in this order: the settings' warnings are said once a
# process, so theirs runs first. Those of the config and of a failed hook change what Unsloth generated, and the late
# import needs unsloth first: each has a process of its own.
scenario = scenarios_in_turn("settings", "dynamic", "reward", "ref_sync", "autocast_latch")


@needs_unsloth
def test_import_first_gives_unsloth_config_the_fields(tmp_path) -> None:
    result = run_scenario("config", tmp_path)
    assert result["trainer_class"] == "UnslothGRPOTrainer"
    # the self-check's trainer keeps truncated completions in the loss, where Unsloth's config would mask them out
    assert result["masks_truncated"] == {"unsloth_default": True, "selfcheck": False}
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
    assert result["newer_kept"] is True  # what was set over a hook since is not undone (the hook it wraps stays)
    assert result["use_adapter_after_unpatch"] == [True, True]  # TRL's own, where it held the package's copy
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


@needs_unsloth
def test_generated_trainer_dynamic_beta_metrics_and_no_recompiles(scenario) -> None:
    result = scenario("dynamic")
    assert result["trainer_class"] == "UnslothGRPOTrainer" and result["stock_beta"] == 0.04
    # the GPU check's probe that the hooked loss ran compiled (the harness keeps Unsloth's loss compiled, as a GPU does)
    assert result["loss_cache_entries"] >= 1
    # decay 0.5 per step at reward 1.0; after step 4 (beta_schedule_steps) beta_min
    assert result["betas"] == pytest.approx([0.04, 0.02, 0.01, 0.005, 0.001, 0.001])
    assert result["final_beta"] == pytest.approx(0.001)
    # an evaluation afterwards moves nothing (from its second batch on, Unsloth's generation left model.training True)
    assert result["evaluated"] == {"final_beta": result["final_beta"], "completed_steps": result["completed_steps"]} \
        and result["completed_steps"] == 6
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


def run_with_fake_unsloth(tmp_path: Path, mode: str, script: str) -> subprocess.CompletedProcess:
    """`script` in a child process whose `import unsloth` is a stand-in package running FAKE_RL in `mode`."""
    fake = tmp_path / "fake"
    (fake / "unsloth" / "models").mkdir(parents=True)
    (fake / "unsloth" / "__init__.py").write_text("from .models import rl\nrl.patch_trl_rl_trainers()\n")
    (fake / "unsloth" / "models" / "__init__.py").write_text("")
    rl = FAKE_RL.replace("_patch_trl_rl_trainers", "_generate_trainer") if mode == "renamed" else FAKE_RL
    (fake / "unsloth" / "models" / "rl.py").write_text(f"MODE = {mode!r}\n" + rl)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(fake), str(ROOT)])}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


@pytest.mark.parametrize("mode", ["changed", "fail", "renamed"])
def test_changed_or_failed_unsloth_generation_is_loud(tmp_path, mode: str) -> None:
    """A stand-in unsloth whose generation (called for each trainer file, GRPO's second) gives a trainer without the
    names the hook needs (changed), gives none (fail: one warning, for grpo_trainer alone), or whose generator is
    renamed (the hook cannot wrap it: the import fails naming it)."""
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
    result = run_with_fake_unsloth(tmp_path, mode, script)
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


def test_an_unpatch_after_an_unhooked_generation_leaves_patch_the_late_import_error(tmp_path) -> None:
    """unpatch(), then `import unsloth` (a stand-in that generates UnslothGRPOTrainer: no hook sees it), then unpatch()
    again: nothing had hooked that trainer, so no warning that it was generated while patched; patch() then refuses
    as for any late import (not the after-unpatch() refusal, which says the trainer was generated under the hooks)."""
    script = textwrap.dedent("""
        import warnings
        import unsloth_adaptive_kl
        unsloth_adaptive_kl.unpatch()
        import unsloth
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            unsloth_adaptive_kl.unpatch()
        for warning in caught:
            print("WARNING", warning.message)
        try:
            unsloth_adaptive_kl.patch()
        except ImportError as error:
            print("ERROR", error)
    """)
    lines = run_with_fake_unsloth(tmp_path, "changed", script).stdout.splitlines()
    assert [line for line in lines if line.startswith(("WARNING", "ERROR"))] == [
        "ERROR unsloth_adaptive_kl was imported after unsloth, which has already generated UnslothGRPOTrainer from "
        "TRL's GRPOTrainer, so the adaptive-KL fields and loss cannot reach it. Import unsloth_adaptive_kl first:"]


@needs_unsloth
def test_generated_trainer_kl_in_reward_advantages_loss_and_dynamic_beta(scenario) -> None:
    """kl_placement='reward' in Unsloth's generated trainer: advantages are the formula of r_i - beta * KL_i (summed
    KL per completion: the log-ratio k1 by default, k3 when named, which warns), the loss has no KL term, the stock
    reward metric is un-penalised, dynamic beta decays, and a resumed run takes beta back from its checkpoint."""
    results = scenario("reward")
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
    # evaluated after each of its 3 steps: the same beta at the end, 3 controller steps (it decayed 512 times further
    # when evaluation, run with model.training True by Unsloth's generation, was taken for training)
    assert results["evaluated"] == {"final_beta": pytest.approx(0.125), "completed_steps": 3, "evaluations": 3}
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
def test_generated_trainer_syncs_the_reference_of_its_peft_model(scenario) -> None:
    """sync_ref_model=True in Unsloth's generated trainer (which refuses it stock, and keeps no "ref" adapter)."""
    results = scenario("ref_sync")
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
def test_generated_config_changes_to_explicit_settings_warn_and_its_defaults_are_logged(scenario) -> None:
    """Unsloth's generated UnslothGRPOConfig rewrites some arguments before TRL's GRPOConfig sees them
    (unsloth/models/rl.py): an explicit scale_rewards True/'group' with dr_grpo becomes False, one warning naming the
    field, the value set and the value in effect; what it fills in for fields left unset (beta 0.001 for grpo,
    scale_rewards for dr_grpo, the DAPO paper's settings for an explicit dapo, vLLM's importance-sampling correction
    off) does not warn but is named in the settings line the trainer prints once at construction (an adapted setting),
    runtime fields included (learning rate, warmup, optimizer, weight decay, seed). The #6586 refusal holds on
    Unsloth's config too."""
    results = scenario("settings")
    for label, value_set in (("dr_grpo_group", "'group'"), ("dr_grpo_true", "True")):
        assert results[label]["warnings"] == [
            f"scale_rewards={value_set} was passed to Unsloth's generated UnslothGRPOConfig (set explicitly, or as its "
            "default by an argument parser such as TrlParser, which passes every field), which changed it to False: "
            "scale_rewards='none' is in effect."], label
        assert results[label]["in_effect"]["scale_rewards"] == "none"
        assert results[label]["warned_here"] == [True], label  # at the user's line that built the config
    troubleshooting = (ROOT / "docs" / "troubleshooting.md").read_text()  # the page quotes the first and the line
    assert f"```text\nUserWarning: {results['dr_grpo_group']['warnings'][0]}\n```" in troubleshooting
    assert f"```text\n{results['settings_lines'][0]}\n```" in troubleshooting
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
    # Unsloth's own flash AdamW: passed on as adamw_torch with the config marked, which its trainer reads: no warning,
    # however it is spelled (Unsloth strips and lower-cases the name before it compares)
    for label in ("adamw_flash", "adamw_flash_spelled"):
        assert results[label]["warnings"] == [] and results[label]["flash_marked"] is True, label
    dapo = results["dapo_explicit"]["in_effect"]
    assert (dapo["epsilon_high"], dapo["mask_truncated_completions"]) == (0.28, True)
    assert "beta" not in results["dr_grpo_group"]["unsloth_defaults"]  # set explicitly: neither warned nor noted
    assert results["sequence_clip"]["error"].startswith(
        "use_bias_correction_kl=True is invalid: allowed is False with importance_sampling_level='sequence'")
    assert "huggingface/trl#6586" in results["sequence_clip"]["error"]
    assert results["settings_lines"] == [
        "adaptive_kl: KL settings in effect for UnslothGRPOTrainer: beta=0.001 (Unsloth's default; TRL's is 0.0), "
        "kl_adaptation_method='clip', kl_estimator='k3' (unset: the placement's default), kl_placement='loss', "
        "kl_reduction='loss_type', kl_clip_threshold=1.0, loss_type='grpo', scale_rewards='group', num_iterations=1, "
        "importance_sampling_level='token', "
        "use_bias_correction_kl=True, steps_per_generation=2, gradient_accumulation_steps=2; Unsloth's other "
        "defaults that differ from TRL's: learning_rate=5e-05 (TRL's is 1e-06), warmup_steps=0.1 (TRL's is 0), "
        "optim='adamw_8bit' (TRL's is 'adamw_torch_fused'), weight_decay=0.001 (TRL's is 0.0), seed=3407 (TRL's is "
        "42), router_aux_loss_coef=0.0 (TRL's is None), generation_kwargs={} (TRL's is None), "
        "vllm_importance_sampling_correction=False (TRL's is True)"]


@needs_unsloth
def test_the_exact_settings_reach_the_optimum_through_unsloths_trainer(tmp_path) -> None:
    """The end-to-end guards through Unsloth's generated trainer (tests/test_trainer_lab.py has TRL's): the KL lab's
    command as a user runs it, with dr_grpo, 800 steps of 64 completions, k1 in the reward and k1_future in the loss
    (the package's loss-side KL inside Unsloth's compiled loss), one run each on its own core: each lands on pi*_beta
    within the TRL guard's tolerance, with an effective beta within 5 % of 0.5 (the lab's tokenizer has a pad token of
    its own: with pad = EOS Unsloth's loss drops every EOS, tests/test_unsloth_loss.py).

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
        assert row["precision"] == "fp32", row  # no autocast: the config's, nor Unsloth's own GRPO one


@needs_unsloth
def test_the_lab_keeps_its_model_out_of_unsloths_float16_autocast_on_a_gpu(scenario) -> None:
    """On a GPU the trainer lab flags its float32 model `_unsloth_forced_float32`, so that Unsloth's config does not
    switch it to bf16; Unsloth's GRPO steps then choose float16 autocast for it (its rule for Gemma3 on a T4), and the
    guard would train in unscaled float16 against float32's bounds. The lab latches the choice first: with it Unsloth's
    real `_unsloth_grpo_autocast` keeps autocast off, and the run records fp32 (fp16 without it)."""
    result = scenario("autocast_latch")
    assert result == {"lab_run": {"latched_at": [0], "precision": "fp32"},  # the lab's run latches before step 1
                      "upstream": {"enabled": True, "dtype": "torch.float16", "precision": "fp16"},
                      "latched": {"enabled": False, "dtype": "torch.bfloat16", "precision": "fp32"}}


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
