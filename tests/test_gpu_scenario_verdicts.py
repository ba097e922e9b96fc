"""The verdicts of the GPU check's scenarios (tools/gpu_scenarios.py) and the log-prob path probe
(tools/logprob_paths.py), on fakes: what a GPU run measures is replaced by figures chosen here, so that each
pass/fail condition is checked on both sides of its bound, including the CUDA-only conditions that the CPU runs of
tests/test_gpucheck.py cannot reach."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import sys
import types
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from unsloth_adaptive_kl.core.config import AdaptiveKLConfig
from unsloth_adaptive_kl.integrations import trainer_hooks
from unsloth_adaptive_kl.tools import demo, logprob_paths, selfcheck, trainer_lab
from unsloth_adaptive_kl.tools import gpu_scenarios as scenarios
from unsloth_adaptive_kl.tools.selfcheck import Check

REQUIRED_ROW = {"adaptive_kl/raw_kl": 0.1, "adaptive_kl/adapted_kl": 0.08, "adaptive_kl/current_beta": 0.04}


class CapturedTrainCheck:
    """scenarios.train_check replaced: records the trainer and the scenario's `extra` condition, trains nothing."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.trainer: Any = None
        self.extra: Callable[[list[dict]], tuple[bool, str]] = lambda rows: (True, "")
        monkeypatch.setattr(scenarios, "train_check", self)

    def __call__(self, name: str, trainer: Any, extra: Callable[[list[dict]], tuple[bool, str]]) -> Check:
        self.trainer, self.extra = trainer, extra
        return Check(name, True, "captured")

    def ok(self, rows: list[dict]) -> bool:
        return self.extra(rows)[0]


def fake_trainer(**attributes: Any) -> Any:
    trainer = types.SimpleNamespace(callbacks=[], **attributes)
    trainer.add_callback = trainer.callbacks.append
    return trainer


def test_metric_problems_flag_an_infinite_value() -> None:
    row = {**REQUIRED_ROW, "adaptive_kl/adapted_kl": float("inf")}
    assert scenarios.metric_problems([row]) == ["step 1: adaptive_kl/adapted_kl=inf"]


@pytest.mark.parametrize("key", ["adaptive_kl/raw_kl", "adaptive_kl/adapted_kl", "adaptive_kl/current_beta"])
def test_metric_problems_flag_each_required_metric_not_logged(key: str) -> None:
    row = {name: value for name, value in REQUIRED_ROW.items() if name != key}
    assert scenarios.metric_problems([REQUIRED_ROW, row]) == [f"step 2: {key} not logged"]


def test_train_check_reports_the_steps_and_the_last_rows_figures() -> None:
    """Two logged rows (and a row of other metrics, not counted): the line names the steps and the figures of the
    last row, each of raw_kl, adapted_kl, current_beta, reward_penalty and ref_syncs, then the condition's detail."""
    last = {"adaptive_kl/raw_kl": 0.25, "adaptive_kl/adapted_kl": 0.125, "adaptive_kl/current_beta": 0.02,
            "adaptive_kl/reward_penalty": 0.0025, "adaptive_kl/ref_syncs": 1.0, "adaptive_kl/length_kl_corr": math.nan}
    trainer = fake_trainer(model=torch.nn.Linear(2, 1), train=lambda: None, state=types.SimpleNamespace(
        log_history=[{"loss": 1.0}, REQUIRED_ROW, last], global_step=2))
    check = scenarios.train_check("t", trainer, lambda rows: (len(rows) == 2, "two rows"))
    assert check == Check("t", True, "2 steps, last: raw_kl 0.25, adapted_kl 0.125, current_beta 0.02, "
                                     "reward_penalty 0.0025, ref_syncs 1; two rows")


def test_train_check_fails_on_a_weight_that_is_not_finite_whatever_the_scenarios_condition() -> None:
    """Finite metrics, a condition that holds, one trained weight NaN: FAIL, saying so."""
    model = torch.nn.Linear(2, 1)
    with torch.no_grad():
        model.weight[0, 0] = float("nan")
    trainer = fake_trainer(model=model, train=lambda: None, state=types.SimpleNamespace(
        log_history=[REQUIRED_ROW], global_step=1))
    check = scenarios.train_check("t", trainer, lambda rows: (True, "fine"))
    assert not check.ok and "a trained weight is not finite" in check.detail


def test_precision_settings_and_the_native_precision(monkeypatch: pytest.MonkeyPatch) -> None:
    """The GRPOConfig flags per precision, worked out by hand; the native precision follows the demo's rule."""
    assert scenarios.precision_settings("cuda", "bf16") == {"use_cpu": False, "bf16": True, "fp16": False}
    assert scenarios.precision_settings("cuda", "fp16") == {"use_cpu": False, "bf16": False, "fp16": True}
    assert scenarios.precision_settings("cpu", "fp32") == {"use_cpu": True, "bf16": False, "fp16": False}
    with pytest.raises(ValueError, match=r"^precision='fp8' is invalid: allowed is 'bf16', 'fp16' or 'fp32'$"):
        scenarios.precision_settings("cuda", "fp8")
    monkeypatch.setattr(demo, "mixed_precision", lambda: {"bf16": True, "fp16": False})
    assert scenarios.native_precision() == "bf16"
    monkeypatch.setattr(demo, "mixed_precision", lambda: {"bf16": False, "fp16": True})
    assert scenarios.native_precision() == "fp16"


def test_trl_autocast_passes_only_if_beta_falls_at_every_step_in_the_precision_asked(
        monkeypatch: pytest.MonkeyPatch) -> None:
    captured = CapturedTrainCheck(monkeypatch)
    mixed = {"bf16": "bf16", "fp32": "no"}  # accelerate's name for each precision
    monkeypatch.setattr(scenarios, "chat_trainer", lambda *args, **kwargs: fake_trainer(
        accelerator=types.SimpleNamespace(mixed_precision=mixed[args[4]])))
    scenarios.trl_autocast("m", "w", device="cuda", precision="bf16", steps=3)

    def rows(*betas: float) -> list[dict]:
        return [{**REQUIRED_ROW, "adaptive_kl/current_beta": beta} for beta in betas]

    assert captured.ok(rows(0.04, 0.02, 0.01))
    assert not captured.ok(rows(0.04, 0.04, 0.02))  # beta held at a step
    assert not captured.ok(rows(0.04, 0.02))  # a step not logged
    captured.trainer.accelerator.mixed_precision = "no"  # accelerate ran in float32: not the autocast asked for
    assert not captured.ok(rows(0.04, 0.02, 0.01))
    scenarios.trl_autocast("m", "w", device="cpu", precision="fp32", steps=3)
    assert captured.ok(rows(0.04, 0.02, 0.01))


def test_the_step_recorder_counts_each_step_that_changed_the_weights() -> None:
    """Weights a, b, b, c: the first and third steps were applied, the second skipped (2, not 3 changes from a)."""
    trainer = fake_trainer(accelerator=types.SimpleNamespace(scaler=None), model=torch.nn.Linear(1, 1))
    recorder = scenarios.StepRecorder(trainer)
    a, b, c = torch.zeros(2), torch.ones(2), torch.full((2,), 2.0)
    recorder.weights = [a, b, b.clone(), c]
    assert recorder.applied_steps() == 2


def test_the_grad_scaler_scenario_fails_when_no_step_changed_the_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the CPU equivalent (fp32, no scaler), 2 steps: both skipped is a FAIL; the first applied passes."""
    captured = CapturedTrainCheck(monkeypatch)

    def verdict(changed_at: list[bool]) -> tuple[bool, str]:
        model = torch.nn.Linear(2, 1)
        trainer = fake_trainer(accelerator=types.SimpleNamespace(scaler=None), model=model)
        monkeypatch.setattr(scenarios, "chat_trainer", lambda *args, **kwargs: trainer)
        scenarios.fp16_grad_scaler("m", "w", backend="trl", device="cpu", precision="fp32", steps=len(changed_at))
        (callback,) = trainer.callbacks
        callback.on_train_begin()
        for changed in changed_at:
            if changed:
                with torch.no_grad():
                    model.bias += 1.0
            callback.on_step_end()
        return captured.extra([REQUIRED_ROW])

    ok, detail = verdict([False, False])
    assert not ok and "0 of 2 optimizer steps applied" in detail
    ok, detail = verdict([True, False])
    assert ok and "1 of 2 optimizer steps applied" in detail


@pytest.mark.parametrize(("precision", "scale", "records", "ok"), [
    ("fp16", 65536.0, 3, True),
    ("bf16", None, 3, True),  # no GradScaler without fp16
    ("fp16", None, 3, False),  # fp16 without a GradScaler
    ("bf16", 65536.0, 3, False),  # a GradScaler where none is wanted
    ("fp16", 0.0, 3, False),  # a scale that fell to 0
    ("fp16", math.inf, 3, False),
    ("fp16", 65536.0, 2, False),  # 2 steps asked, 1 recorded
], ids=["fp16-scaler", "bf16-none", "fp16-none", "bf16-scaler", "scale-0", "scale-inf", "a-step-missing"])
def test_the_grad_scaler_scenario_on_cuda_needs_a_scaler_exactly_with_fp16_and_a_finite_positive_scale(
        monkeypatch: pytest.MonkeyPatch, precision: str, scale: Any, records: int, ok: bool) -> None:
    """A fake CUDA run of 2 steps, each changing the weights, with a real GradScaler (its scale as given) or none."""
    captured = CapturedTrainCheck(monkeypatch)
    scaler = None if scale is None else torch.amp.GradScaler("cpu", init_scale=scale)
    model = torch.nn.Linear(2, 1)
    trainer = fake_trainer(accelerator=types.SimpleNamespace(scaler=scaler), model=model)
    monkeypatch.setattr(scenarios, "chat_trainer", lambda *args, **kwargs: trainer)
    scenarios.fp16_grad_scaler("m", "w", backend="trl", device="cuda", precision=precision, steps=2)
    (callback,) = trainer.callbacks
    callback.on_train_begin()
    for _ in range(records - 1):
        with torch.no_grad():
            model.bias += 1.0
        callback.on_step_end()
    assert captured.ok([REQUIRED_ROW]) is ok, captured.extra([REQUIRED_ROW])[1]


@pytest.mark.parametrize(("device", "name"), [("cuda", "Unsloth 4-bit, fp16 + GradScaler on cuda"),
                                              ("cpu", "Unsloth, fp32 (no GradScaler) on cpu")])
def test_the_unsloth_grad_scaler_scenario_runs_unsloth_in_fp16_on_cuda_and_in_float32_on_a_cpu(
        monkeypatch: pytest.MonkeyPatch, device: str, name: str) -> None:
    """Its needs unmet (Unsloth and bitsandbytes, Unsloth imported here): their FAIL line, under the scenario's name,
    and nothing trained."""
    needs = []

    def unmet_needs(scenario: str, modules: Any, with_unsloth: bool) -> list[Check]:
        needs.append((scenario, tuple(modules), with_unsloth))
        return [Check(scenario, False, "not installed")]

    monkeypatch.setattr(scenarios, "unmet_needs", unmet_needs)
    monkeypatch.setattr(scenarios, "chat_trainer", lambda *args, **kwargs: pytest.fail("nothing may train"))
    assert scenarios.unsloth_fp16_grad_scaler("m", "w", device=device) == [Check(name, False, "not installed")]
    assert needs == [(name, ("unsloth", "bitsandbytes"), True)]


def test_an_unsloth_scenario_fails_where_unsloth_did_not_generate_and_hook_its_trainer(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Every package installed: a scenario that runs Unsloth here needs its generated trainer, hooked; one that does
    not run Unsloth in its process never asks."""
    from unsloth_adaptive_kl.integrations import unsloth as unsloth_patch

    outcome: dict[str, Any] = {"error": "ImportError: no module named unsloth_compiled_cache", "generated": None}
    monkeypatch.setattr(scenarios, "missing_packages", lambda name, *modules: [])
    monkeypatch.setattr(selfcheck, "generate_unsloth_trainer", lambda: outcome["error"])
    monkeypatch.setattr(unsloth_patch, "generated_grpo_trainer", lambda: outcome["generated"])
    assert scenarios.unmet_needs("s", ["unsloth"], with_unsloth=False) == []
    assert scenarios.unmet_needs("s", ["unsloth"], with_unsloth=True) == [Check(
        "s: Unsloth trainer generated and hooked", False, "ImportError: no module named unsloth_compiled_cache")]
    outcome["error"] = None
    assert scenarios.unmet_needs("s", ["unsloth"], with_unsloth=True) == [Check(
        "s: Unsloth trainer generated", False, "Unsloth fell back to TRL's trainer (see its log)")]
    outcome["generated"] = type("UnslothGRPOTrainer", (), {})
    assert scenarios.unmet_needs("s", ["unsloth"], with_unsloth=True) == []


class FakeAdaptiveKL:
    def __init__(self, betas: list[float]) -> None:
        self.betas, self.current_beta = betas, None

    def step(self, mean_reward: float) -> None:
        self.current_beta = self.betas.pop(0)


def test_no_recompile_needs_beta_to_move_at_every_step_and_no_frame_or_graph_compiled(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(scenarios, "use_method", lambda trainer, method, **fields: None)
    monkeypatch.setattr(selfcheck, "loss_and_grads", lambda trainer, compute, inputs: (0.0, []))

    def verdict(betas: list[float], after: dict[str, int]) -> bool:
        counters = iter([{"frames": 3, "graphs": 2, "kernels": 9}, after])
        monkeypatch.setattr(scenarios, "compile_counters", lambda: next(counters))
        (check,) = scenarios.no_recompile_check("n", fake_trainer(adaptive_kl=FakeAdaptiveKL(betas)), {})
        return check.ok

    unchanged = {"frames": 3, "graphs": 2, "kernels": 9}
    assert verdict([0.02, 0.01, 0.005], unchanged)
    assert not verdict([0.02, 0.02, 0.02], unchanged)  # beta never moved: nothing was tested
    assert not verdict([0.02, 0.01, 0.005], {"frames": 4, "graphs": 2, "kernels": 9})
    assert not verdict([0.02, 0.01, 0.005], {"frames": 3, "graphs": 3, "kernels": 9})  # a new graph, no new frame


def fake_unsloth_4bit(monkeypatch: pytest.MonkeyPatch) -> Callable[..., tuple[list[Check], dict[str, list]]]:
    """unsloth_4bit with what it measures faked: run(entries, kernels, device, graphs) gives its checks (the first
    line real, the others faked away) and what it asked of the per-method and recompile checks."""
    seen: dict[str, list] = {"methods": [], "compiled": []}
    monkeypatch.setattr(scenarios, "missing_packages", lambda name, *modules: [])
    monkeypatch.setattr(scenarios, "import_unsloth", lambda name: [])
    monkeypatch.setattr(scenarios, "native_precision", lambda: "bf16")
    monkeypatch.setattr(scenarios, "chat_trainer", lambda *args, **kwargs: fake_trainer())
    monkeypatch.setattr(scenarios, "method_check", lambda name, trainer, method, inputs: seen["methods"].append(
        method) or [])
    monkeypatch.setattr(scenarios, "no_recompile_check", lambda name, trainer, inputs, compiled=True: seen[
        "compiled"].append(compiled) or [])
    monkeypatch.setattr(logprob_paths, "counted_logprob_calls", contextlib.contextmanager(lambda: iter([{}])))
    monkeypatch.setattr(selfcheck, "captured_inputs", lambda trainer, compute: {})
    monkeypatch.setattr(selfcheck, "compare_with_stock", lambda *args, **kwargs: [])
    monkeypatch.setattr(selfcheck, "comparison_inputs", lambda inputs: inputs)

    def run(entries: int, kernels: int, device: str = "cuda", graphs: int = 2) -> tuple[list[Check], dict[str, list]]:
        counters = iter([{"frames": 0, "graphs": 0, "kernels": 0}, {"frames": 1, "graphs": graphs, "kernels": kernels}])
        monkeypatch.setattr(scenarios, "compile_counters", lambda: next(counters))
        monkeypatch.setattr(scenarios, "loss_cache_entries", lambda: entries)
        for key in seen:
            seen[key].clear()
        return scenarios.unsloth_4bit("m", "w", device=device), seen

    return run


@pytest.fixture
def tf32_restored() -> Any:
    allow_tf32 = torch.backends.cuda.matmul.allow_tf32  # unsloth_4bit turns it off
    yield
    torch.backends.cuda.matmul.allow_tf32 = allow_tf32


def test_the_unsloth_4bit_first_step_on_cuda_must_compile_the_loss_and_triton_kernels(
        monkeypatch: pytest.MonkeyPatch, tf32_restored: None) -> None:
    """unsloth_4bit on a fake CUDA run: its first line passes only if the loss's own chunk function has a compiled
    cache entry and the step generated kernels (graphs elsewhere in the step, with the loss run eagerly, do not count;
    an entry without kernels: inductor generated nothing, the loss did not run as Triton). TF32 is off for the
    comparison with stock, and the recompile check is told that the loss is compiled."""
    run = fake_unsloth_4bit(monkeypatch)
    torch.backends.cuda.matmul.allow_tf32 = True
    checks, seen = run(1, 5)
    assert checks[0].ok and torch.backends.cuda.matmul.allow_tf32 is False and seen["compiled"] == [True]
    assert not run(1, 0)[0][0].ok and not run(0, 5)[0][0].ok  # graphs compiled, but not the loss's


def test_the_unsloth_4bit_dry_run_reports_its_uncompiled_float32_loss_and_checks_every_method(
        monkeypatch: pytest.MonkeyPatch, tf32_restored: None) -> None:
    """On a CPU Unsloth's compile is off: the first line passes with no compiled entry nor kernel (it reports what
    ran, in float32 whatever the card's precision would be), each of the 7 methods is checked once, and the recompile
    check is told that nothing is compiled."""
    checks, seen = fake_unsloth_4bit(monkeypatch)(0, 0, device="cpu", graphs=0)
    name = "Unsloth + LoRA (float32, dry run on the CPU)"
    assert checks[0].ok and checks[0].name == f"{name}: Unsloth's loss runs (its compile is off on a CPU)"
    assert checks[0].detail.startswith("the loss's chunk function compiled 0 time(s); the first step compiled 0 "
                                       "graphs, 0 kernels in all (fp32)"), checks[0].detail
    assert seen == {"methods": ["none", "clip", "sigmoid", "length_normalized", "dynamic",
                                "clip+length_normalized+dynamic", "sigmoid+length_normalized"], "compiled": [False]}


def guard_row(kl_opt: float, beta: Any, pad: float = 0.0) -> dict[str, Any]:
    return {"setting": "k1 in the reward", "train": {"kl_opt": kl_opt, "effective_beta": beta},
            "pad_probability": pad, "logprob_path": "fused"}


def guard_verdicts(monkeypatch: pytest.MonkeyPatch, rows: list[dict], steps: Any = None) -> list[bool]:
    monkeypatch.setattr(scenarios, "missing_packages", lambda name, *modules: [])
    monkeypatch.setattr(trainer_lab, "run_trainer_table", lambda *args, **kwargs: {"rows": rows})
    return [check.ok for check in scenarios.unsloth_guard("m", "w", steps=steps)]


def test_the_unsloth_guard_holds_each_run_to_the_labs_bounds(monkeypatch: pytest.MonkeyPatch) -> None:
    """The full run: within the KL bound, beta within GUARD_BETA_TOLERANCE (relative) of 0.5, the pad's probability
    under 1e-12; each bound crossed by a half of it fails, and so does a refused run."""
    tol, beta_tol = trainer_lab.GUARD_TOLERANCE, trainer_lab.GUARD_BETA_TOLERANCE
    good = guard_row(0.5 * tol, 0.5 * (1 + 0.5 * beta_tol))
    assert guard_verdicts(monkeypatch, [good, guard_row(0.5 * tol, 0.5 * (1 - 0.5 * beta_tol))]) == [True, True]
    assert guard_verdicts(monkeypatch, [
        guard_row(1.5 * tol, 0.5),  # the KL to the optimum too large
        guard_row(0.5 * tol, 0.5 * (1 + 1.5 * beta_tol)),  # beta off by 1.5 tolerances
        guard_row(0.5 * tol, 0.5 * (1 - 1.5 * beta_tol)),
        guard_row(0.5 * tol, None),  # no effective beta
        guard_row(0.5 * tol, 0.5, pad=1e-9),  # the pad token has some probability
        {"setting": "k1_future in the loss", "refused": "no"}]) == [False] * 6


def test_the_unsloth_guard_runs_the_two_placements_of_the_kl_with_dr_grpo_in_spawned_workers(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The lab's k1 in the reward and k1_future in the loss, dr_grpo, beta 0.5, one seed, a worker each, spawned (as
    CUDA needs); the full run's steps unless fewer are asked for."""
    calls = []

    def run_trainer_table(backend: str, settings: list, losses: list, **kwargs: Any) -> dict:
        calls.append((backend, [setting.label for setting in settings], losses, kwargs))
        return {"rows": []}

    monkeypatch.setattr(scenarios, "missing_packages", lambda name, *modules: [])
    monkeypatch.setattr(trainer_lab, "run_trainer_table", run_trainer_table)
    assert scenarios.unsloth_guard("m", "w") == scenarios.unsloth_guard("m", "w", steps=4) == []
    assert calls == [("unsloth", ["k1 in the reward", "k1_future in the loss"], ["dr_grpo"], {
        "beta": 0.5, "steps": steps, "seeds": [0], "processes": 2, "start_method": "spawn"})
        for steps in (trainer_lab.STEPS, 4)]


def test_the_unsloth_guard_dry_run_checks_only_that_its_figures_are_finite(monkeypatch: pytest.MonkeyPatch) -> None:
    tol = trainer_lab.GUARD_TOLERANCE
    assert guard_verdicts(monkeypatch, [guard_row(10 * tol, 0.9, pad=0.5)], steps=4) == [True]
    assert guard_verdicts(monkeypatch, [guard_row(10 * tol, None)], steps=4) == [True]  # no beta: nothing to check
    assert guard_verdicts(monkeypatch, [guard_row(math.nan, 0.5)], steps=4) == [False]
    assert guard_verdicts(monkeypatch, [guard_row(0.5 * tol, math.inf)], steps=4) == [False]


def test_vllm_kl_in_reward_needs_vllm_to_generate_and_the_penalty_to_be_beta_times_the_kl(
        monkeypatch: pytest.MonkeyPatch) -> None:
    captured = CapturedTrainCheck(monkeypatch)
    engine = types.SimpleNamespace(generate=lambda *args, **kwargs: "completions")
    monkeypatch.setattr(scenarios, "missing_packages", lambda name, *modules: [])
    monkeypatch.setattr(scenarios, "import_unsloth", lambda name: [])
    monkeypatch.setattr(scenarios, "native_precision", lambda: "bf16")
    monkeypatch.setattr(scenarios, "load_policy", lambda *args, **kwargs: (types.SimpleNamespace(
        vllm_engine=engine), None))
    monkeypatch.setattr(scenarios, "chat_trainer", lambda *args, **kwargs: fake_trainer(use_vllm=True))
    scenarios.vllm_kl_in_reward("m", "w")

    def rows(penalty_factor: float) -> list[dict]:
        return [{**REQUIRED_ROW, "adaptive_kl/reward_penalty": 0.04 * 0.08 * penalty_factor}]

    assert not captured.ok(rows(1.0))  # vLLM never generated
    assert engine.generate("prompts") == "completions"  # through the counting wrapper
    assert captured.ok(rows(1.0))
    assert not captured.ok(rows(1.001))  # 0.1 % off beta times the adapted KL


def test_the_reference_sync_scenario_needs_the_exact_sync_count_and_8bit_state(monkeypatch: pytest.MonkeyPatch) -> None:
    """3 steps, a sync every 2: exactly 1 sync, the optimizer's state 8-bit again after the reset, and its step count
    restarted there (1, not 3: a reset that did nothing kept the state)."""
    captured = CapturedTrainCheck(monkeypatch)
    monkeypatch.setattr(scenarios, "missing_packages", lambda name, *modules: [])
    state = {"step": 1, "state1": torch.zeros(4, dtype=torch.uint8), "absmax1": torch.ones(2)}
    optimizer = types.SimpleNamespace(state={"p": state})
    monkeypatch.setattr(scenarios, "chat_trainer", lambda *args, **kwargs: fake_trainer(optimizer=optimizer))
    scenarios.ref_sync_8bit("m", "w", backend="trl", device="cpu", precision="fp32", optim="adamw_8bit", steps=3)
    assert captured.ok([{**REQUIRED_ROW, "adaptive_kl/ref_syncs": 1.0}])
    assert not captured.ok([{**REQUIRED_ROW, "adaptive_kl/ref_syncs": 2.0}])
    assert not captured.ok([REQUIRED_ROW])
    state["step"] = 3  # the reset did nothing
    assert not captured.ok([{**REQUIRED_ROW, "adaptive_kl/ref_syncs": 1.0}])
    state["step"] = torch.tensor(1.0)  # torch's AdamW keeps its count as a tensor
    assert captured.ok([{**REQUIRED_ROW, "adaptive_kl/ref_syncs": 1.0}])
    state["state1"] = torch.zeros(4)  # a float32 state where an 8-bit one was asked for
    assert not captured.ok([{**REQUIRED_ROW, "adaptive_kl/ref_syncs": 1.0}])
    scenarios.ref_sync_8bit("m", "w", backend="trl", device="cpu", precision="fp32", optim="adamw_torch", steps=3)
    assert captured.ok([{**REQUIRED_ROW, "adaptive_kl/ref_syncs": 1.0}])
    optimizer.state["p"] = {"step": 1}  # a step counted, but no moment in the state
    assert not captured.ok([{**REQUIRED_ROW, "adaptive_kl/ref_syncs": 1.0}])
    optimizer.state["p"] = {"step": 1, "exp_avg": torch.zeros(4)}
    scenarios.ref_sync_8bit("m", "w", backend="trl", device="cpu", precision="fp32", optim="adamw_torch", steps=5)
    assert captured.ok([{**REQUIRED_ROW, "adaptive_kl/ref_syncs": 2.0}])  # at steps 2 and 4, the count restarted at 4
    assert not captured.ok([{**REQUIRED_ROW, "adaptive_kl/ref_syncs": 1.0}])


def test_the_reference_sync_scenario_refuses_an_even_step_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a sync every 2 steps, an even count syncs, and resets the optimizer, at its last step: no state would be
    left to check, so the scenario could never pass. It says so before any trainer is built."""
    monkeypatch.setattr(scenarios, "missing_packages", lambda name, *modules: [])
    monkeypatch.setattr(scenarios, "chat_trainer", lambda *args, **kwargs: pytest.fail("a trainer was built"))
    with pytest.raises(ValueError, match=r"^steps=4 is invalid: allowed is an odd number \(the reference syncs every "
                                         r"2 steps\)$"):
        scenarios.ref_sync_8bit("m", "w", backend="trl", device="cpu", precision="fp32", optim="adamw_torch", steps=4)


def test_the_demo_model_scenario_needs_exit_0_and_every_step_of_every_method(monkeypatch: pytest.MonkeyPatch,
                                                                             tmp_path: Path) -> None:
    run = {"code": 0, "rows": []}

    def main(argv: list[str]) -> int:
        folder = Path(argv[argv.index("--output-dir") + 1])
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "metrics.json").write_text(json.dumps(run["rows"]))
        return run["code"]

    monkeypatch.setattr(demo, "main", main)

    def rows(steps: dict[str, int]) -> list[dict]:
        return [{"method": method, "step": step, "reward": 0.5, **REQUIRED_ROW}
                for method, count in steps.items() for step in range(1, count + 1)]

    def verdict() -> bool:
        (check,) = scenarios.demo_model("m", str(tmp_path), backend="trl", steps=2, methods="none,dynamic")
        return check.ok

    run["rows"] = rows({"none": 2, "dynamic": 2})
    assert verdict()
    run["rows"] = rows({"none": 2, "dynamic": 1})
    assert not verdict()
    run.update(code=1, rows=rows({"none": 2, "dynamic": 2}))
    assert not verdict()
    run.update(code=0, rows=rows({"none": 2, "dynamic": 2}))
    run["rows"][3]["adaptive_kl/raw_kl"] = None  # written as null: a KL the demo never logged
    assert not verdict()


def test_use_method_sets_a_clip_threshold_for_every_method_that_clips(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(trainer_hooks, "attach_runtime", lambda trainer: None)
    default = next(f.default for f in dataclasses.fields(AdaptiveKLConfig) if f.name == "kl_clip_threshold")
    assert default != 0.2
    for method, threshold in (("clip", 0.2), ("clip+length_normalized+dynamic", 0.2), ("sigmoid", default)):
        trainer = fake_trainer(args=types.SimpleNamespace())
        scenarios.use_method(trainer, method)
        assert (trainer.args.kl_adaptation_method, trainer.args.kl_clip_threshold) == (method, threshold)


def test_method_check_fails_when_the_loss_or_any_gradient_is_not_finite(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(scenarios, "use_method", lambda trainer, method, **fields: None)
    metrics: dict[str, Any] = {"train": defaultdict(list)}
    gradients, loss = [torch.ones(2), torch.tensor([1.0, math.nan])], [0.5]

    def loss_and_grads(trainer: Any, compute: str, inputs: dict) -> tuple[float, list[torch.Tensor]]:
        for key, value in REQUIRED_ROW.items():
            metrics["train"][key].append(value)
        return loss[0], gradients

    monkeypatch.setattr(selfcheck, "loss_and_grads", loss_and_grads)
    (check,) = scenarios.method_check("n", fake_trainer(_metrics=metrics), "clip", {})
    assert not check.ok and "a gradient is not finite" in check.detail
    gradients[1] = torch.ones(2)
    assert scenarios.method_check("n", fake_trainer(_metrics=metrics), "clip", {})[0].ok
    metrics["train"]["adaptive_kl/adapted_kl"].append(math.nan)  # left by the method checked before: cleared
    assert scenarios.method_check("n", fake_trainer(_metrics=metrics), "clip", {})[0].ok
    loss[0] = math.nan
    (check,) = scenarios.method_check("n", fake_trainer(_metrics=metrics), "clip", {})
    assert not check.ok and check.detail.endswith("; loss nan")


def test_guarded_turns_an_exception_into_a_fail_line() -> None:
    def part() -> list[Check]:
        raise RuntimeError("CUDA error: out of memory")

    assert scenarios.guarded("x", part) == [Check("x", False, "RuntimeError: CUDA error: out of memory")]


# ----- logprob_paths ----------------------------------------------------------------------------------------------

@pytest.fixture
def fake_unsloth_zoo(monkeypatch: pytest.MonkeyPatch) -> types.SimpleNamespace:
    """unsloth_zoo's two scorers (each returning its arguments) and the fused op's counters, already non-zero."""
    rl_replacements = types.ModuleType("unsloth_zoo.rl_replacements")

    def chunked_hidden_states_selective_log_softmax(hidden_states: Any, lm_head: Any, index: Any, chunks: int = 4):
        return ("hidden", hidden_states, chunks)

    def chunked_selective_log_softmax(logits: Any, index: Any, temperature: float = 1.0):
        return ("logits", logits, temperature)

    rl_replacements.chunked_hidden_states_selective_log_softmax = chunked_hidden_states_selective_log_softmax
    rl_replacements.chunked_selective_log_softmax = chunked_selective_log_softmax
    fused_linear = types.ModuleType("unsloth_zoo.fused_losses.fused_linear")
    fused_linear.CALLS = {"ce": 1, "logprobs": 5, "logprobs_bwd": 4, "triton": 7, "torch": 0, "tiled": 2, "flash": 1}
    fused_losses = types.ModuleType("unsloth_zoo.fused_losses")
    fused_losses.fused_linear = fused_linear
    zoo = types.ModuleType("unsloth_zoo")
    zoo.rl_replacements, zoo.fused_losses = rl_replacements, fused_losses
    for name, module in (("unsloth_zoo", zoo), ("unsloth_zoo.rl_replacements", rl_replacements),
                         ("unsloth_zoo.fused_losses", fused_losses),
                         ("unsloth_zoo.fused_losses.fused_linear", fused_linear)):
        monkeypatch.setitem(sys.modules, name, module)
    return types.SimpleNamespace(rl=rl_replacements, calls=fused_linear.CALLS,
                                 originals=(chunked_hidden_states_selective_log_softmax, chunked_selective_log_softmax))


def test_counted_logprob_calls_counts_each_scorer_and_the_fused_ops_calls_made_in_the_block(
        fake_unsloth_zoo: types.SimpleNamespace) -> None:
    """3 per-chunk hidden-state calls and 2 logits calls in the block, answered by the scorers themselves (same
    signatures); the fused op's counters as their change over the block; the scorers restored after it."""
    import inspect

    zoo = fake_unsloth_zoo
    with logprob_paths.counted_logprob_calls() as counts:
        hidden = zoo.rl.chunked_hidden_states_selective_log_softmax
        assert inspect.signature(hidden) == inspect.signature(zoo.originals[0])
        assert [hidden(h, None, None, chunks=2) for h in "abc"] == [("hidden", h, 2) for h in "abc"]
        assert [zoo.rl.chunked_selective_log_softmax(x, None) for x in (1, 2)] == [("logits", 1, 1.0),
                                                                                   ("logits", 2, 1.0)]
        for key, added in (("logprobs", 2), ("logprobs_bwd", 2), ("triton", 3), ("tiled", 1)):
            zoo.calls[key] += added
    assert counts == {"chunked_hidden_states_selective_log_softmax": 3, "chunked_selective_log_softmax": 2,
                      "logprobs": 2, "logprobs_bwd": 2, "triton": 3, "torch": 0, "tiled": 1, "flash": 0}
    assert (zoo.rl.chunked_hidden_states_selective_log_softmax, zoo.rl.chunked_selective_log_softmax) == zoo.originals
    del zoo.calls["flash"]  # a kind this unsloth_zoo does not count: 0 calls, not 0 - 1
    with logprob_paths.counted_logprob_calls() as counts:
        zoo.calls["logprobs"] += 1
    assert (counts["logprobs"], counts["flash"], counts["triton"]) == (1, 0, 0)


def test_counted_logprob_calls_raises_where_the_fused_op_is_there_but_a_module_it_imports_is_missing(
        fake_unsloth_zoo: types.SimpleNamespace, monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the fused op's own module missing means "no fused op"; a module that it imports missing (triton, say) is
    a broken install, raised rather than counted as the op's absence, before any scorer is replaced."""
    def import_module(name: str) -> Any:
        raise ModuleNotFoundError("No module named 'triton'", name="triton")

    monkeypatch.setattr(logprob_paths, "importlib", types.SimpleNamespace(import_module=import_module))
    with pytest.raises(ModuleNotFoundError, match="triton"):
        with logprob_paths.counted_logprob_calls():
            pass
    rl = fake_unsloth_zoo.rl
    assert (rl.chunked_hidden_states_selective_log_softmax, rl.chunked_selective_log_softmax) == \
        fake_unsloth_zoo.originals


def test_counted_logprob_calls_counts_the_scorers_alone_where_unsloth_zoo_has_no_fused_op(
        fake_unsloth_zoo: types.SimpleNamespace, monkeypatch: pytest.MonkeyPatch) -> None:
    """unsloth_zoo 2026.10.7 has no fused_losses.fused_linear: the two scorers are counted, no fused count is made
    up, and the description says the op is absent."""
    monkeypatch.delitem(sys.modules, "unsloth_zoo.fused_losses.fused_linear")
    monkeypatch.delattr(sys.modules["unsloth_zoo.fused_losses"], "fused_linear")
    with logprob_paths.counted_logprob_calls() as counts:
        fake_unsloth_zoo.rl.chunked_hidden_states_selective_log_softmax("h", None, None)
    assert counts == {"chunked_hidden_states_selective_log_softmax": 1, "chunked_selective_log_softmax": 0}
    assert logprob_paths.describe(counts) == ("per-chunk log-softmax on the hidden states (1 calls); "
                                              "this unsloth_zoo has no fused linear log-prob op")


def test_describe_names_each_scorer_that_ran_with_its_counts() -> None:
    counts = {"logprobs": 2, "logprobs_bwd": 1, "triton": 0, "torch": 3, "tiled": 0, "flash": 2,
              "chunked_hidden_states_selective_log_softmax": 0, "chunked_selective_log_softmax": 4}
    assert logprob_paths.describe(counts) == (
        "fused linear log-probs on the hidden states (2 forward, 1 backward calls; kernel bodies: torch 3, flash 2); "
        "chunked selective log-softmax on logits (4 calls)")
    counts = {"logprobs": 0, "logprobs_bwd": 1, "chunked_hidden_states_selective_log_softmax": 6,
              "chunked_selective_log_softmax": 0}
    assert logprob_paths.describe(counts) == "per-chunk log-softmax on the hidden states (6 calls)"
    assert logprob_paths.describe({"logprobs": 0}) == "none of Unsloth's scorers ran"
    counts = {"logprobs": 3, "logprobs_bwd": 0, "triton": 0, "torch": 0, "tiled": 0, "flash": 0}  # no kernel counted
    assert logprob_paths.describe(counts) == ("fused linear log-probs on the hidden states (3 forward, 0 backward "
                                              "calls; kernel bodies: none counted)")
