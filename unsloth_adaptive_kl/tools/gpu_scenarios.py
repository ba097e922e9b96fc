"""The scenarios of the GPU check (`python -m unsloth_adaptive_kl --gpu`, tools/gpucheck.py), and what they share.

Each scenario is a function of the saved tiny Llama's folder and a work folder returning its checks (`Check` lines);
those with a CPU equivalent also take a device ('cuda' or 'cpu') and a precision ('bf16', 'fp16' or 'fp32'), with
the GPU's as defaults, so that tests/test_gpucheck.py runs them on a CPU. A missing optional package is a FAIL line
naming what to install (`missing_packages`).
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import math
import os
import sys
from typing import Any, Callable, Optional, Sequence

import torch

from .selfcheck import Check, guarded

MAX_SEQ_LENGTH = 512  # the demo's FastLanguageModel max_seq_length; the tiny Llama has more positions
LORA_RANK = 8
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
CHAT_PROMPTS = [[{"role": "user", "content": text}] for text in
                ("What is 2 + 3?", "Name a colour.", "Spell cat.", "Count to 4.", "Say hi!", "Is 7 odd?",
                 "Add 10 and 5.", "Reverse ab.")]
INSTALL = {
    "unsloth": 'pip install "unsloth-adaptive-kl[unsloth] @ git+https://github.com/unsloth-adaptive-kl/unsloth-adaptive-kl"',
    "vllm": "pip install vllm (the build matching your torch; see Unsloth's install guide)",
    "bitsandbytes": "pip install bitsandbytes",
    "triton": "pip install triton (comes with torch's CUDA wheels)",
}
# NaN by definition where every length (or every summed KL) of a batch is equal (docs/metrics.md).
MAY_BE_NAN = {"adaptive_kl/length_kl_corr"}
REQUIRED = ("adaptive_kl/raw_kl", "adaptive_kl/adapted_kl", "adaptive_kl/current_beta")


# ----- shared pieces -------------------------------------------------------------------------------------------

def missing_packages(scenario: str, *modules: str) -> list[Check]:
    """A FAIL line per module of `modules` that is not installed, saying what to install."""
    return [Check(f"{scenario}: needs {module}", False, f"{module} is not installed: {INSTALL[module]}")
            for module in modules if importlib.util.find_spec(module) is None]


def unmet_needs(scenario: str, modules: Sequence[str], with_unsloth: bool) -> list[Check]:
    """`missing_packages`, else (`with_unsloth`: the scenario runs Unsloth in this process) `import_unsloth`'s lines:
    empty when the scenario can run."""
    return missing_packages(scenario, *modules) or (import_unsloth(scenario) if with_unsloth else [])


def native_precision() -> str:
    """'bf16' on a GPU with native bf16, else 'fp16' (a T4): the demo's rule (`demo.mixed_precision`)."""
    from .demo import mixed_precision

    return "bf16" if mixed_precision()["bf16"] else "fp16"


def precision_settings(device: str, precision: str) -> dict[str, Any]:
    """GRPOConfig flags for a device ('cuda' or 'cpu') and a precision ('bf16', 'fp16' or 'fp32')."""
    if precision not in ("bf16", "fp16", "fp32"):
        raise ValueError(f"precision={precision!r} is invalid: allowed is 'bf16', 'fp16' or 'fp32'")
    return {"use_cpu": device == "cpu", "bf16": precision == "bf16", "fp16": precision == "fp16"}


def load_policy(model_dir: str, backend: str, precision: str = "fp32", device: str = "cuda", rank: int = LORA_RANK,
                **unsloth_kwargs: Any) -> tuple[Any, Any]:
    """(LoRA policy of rank `rank`, tokenizer) from the saved model. 'trl': transformers in float32 (autocast does the
    rest) with PEFT's LoRA; 'unsloth': `FastLanguageModel` in 4-bit, computing in `precision` (bf16 or fp16), with
    Unsloth's LoRA (`unsloth_kwargs` go to `from_pretrained`, e.g. fast_inference=True); 'unsloth' on a CPU (the dry
    run): `FastLanguageModel` imported but, as it loads on CUDA only, the 'trl' model made acceptable to Unsloth's
    trainer (`tiny.as_unsloth_model`)."""
    if backend == "unsloth":
        from unsloth import FastLanguageModel

        if device == "cuda":
            dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
            model, tokenizer = FastLanguageModel.from_pretrained(model_dir, max_seq_length=MAX_SEQ_LENGTH,
                                                                 dtype=dtype, load_in_4bit=True, **unsloth_kwargs)
            model = FastLanguageModel.get_peft_model(model, r=rank, lora_alpha=2 * rank, target_modules=LORA_TARGETS,
                                                     random_state=0)
            return model, tokenizer
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .tiny import add_lora, as_unsloth_model

    model = add_lora(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), rank=rank)
    return (as_unsloth_model(model) if backend == "unsloth" else model), AutoTokenizer.from_pretrained(model_dir)


def chat_trainer(model_dir: str, work_dir: str, backend: str, device: str, precision: str,
                 policy: Optional[tuple[Any, Any]] = None, **overrides: Any) -> Any:
    """A GRPO trainer (whichever `trl.GRPOTrainer` is now) on the saved model and the chat prompts; `overrides` are
    GRPOConfig fields. `policy`: a (model, tokenizer) already loaded."""
    from .selfcheck import tiny_trainer

    model, tokenizer = policy or load_policy(model_dir, backend, precision, device)
    return tiny_trainer(work_dir, model=model, tokenizer=tokenizer, prompts=CHAT_PROMPTS,
                        **precision_settings(device, precision), **overrides)


def is_finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def logged_metrics(trainer: Any) -> list[dict[str, Any]]:
    """The `adaptive_kl/*` values of each logged step (`None` where the trainer logged a NaN average)."""
    return [{k: v for k, v in entry.items() if k.startswith("adaptive_kl/")}
            for entry in trainer.state.log_history if any(k.startswith("adaptive_kl/") for k in entry)]


def metric_problems(rows: list[dict[str, Any]], required: tuple[str, ...] = REQUIRED) -> list[str]:
    """What is wrong with logged `adaptive_kl/*` rows: none logged, a required key missing, a value not finite (NaN
    is allowed where it is NaN by definition, `MAY_BE_NAN`)."""
    if not rows:
        return ["no adaptive_kl metric logged"]
    problems = [f"step {i + 1}: {key} not logged" for i, row in enumerate(rows) for key in required if key not in row]
    problems += [f"step {i + 1}: {key}={value}" for i, row in enumerate(rows) for key, value in row.items()
                 if key not in MAY_BE_NAN and not is_finite(value)]
    return problems


def summary(row: dict[str, Any]) -> str:
    """'raw_kl 0.0012, adapted_kl 0.0011, current_beta 0.04' from one row of `logged_metrics`."""
    names = ("raw_kl", "adapted_kl", "current_beta", "reward_penalty", "ref_syncs")
    return ", ".join(f"{name} {row['adaptive_kl/' + name]:.4g}" for name in names
                     if is_finite(row.get("adaptive_kl/" + name)))


def trainable(model: Any) -> list[torch.Tensor]:
    return [p for p in model.parameters() if p.requires_grad]


def weights_finite(model: Any) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in trainable(model))


def train_check(name: str, trainer: Any, extra: Callable[[list[dict]], tuple[bool, str]] = lambda rows: (True, "")
                ) -> Check:
    """Train, then one line: every adaptive_kl metric finite, the weights finite, and `extra(rows)` (ok, detail)."""
    trainer.train()
    rows = logged_metrics(trainer)
    problems = metric_problems(rows)
    if not weights_finite(trainer.model):
        problems.append("a trained weight is not finite")
    ok, detail = extra(rows) if not problems else (False, "")
    steps = trainer.state.global_step
    measured = f"{steps} steps, last: {summary(rows[-1])}" if rows else f"{steps} steps"
    return Check(name, not problems and ok, "; ".join([measured, *problems, *([detail] if detail else [])]))


# ----- the scenarios -------------------------------------------------------------------------------------------

def trl_autocast(model_dir: str, work_dir: str, device: str = "cuda", precision: Optional[str] = None,
                 steps: int = 3) -> list[Check]:
    """TRL's GRPOTrainer in mixed precision (`precision`: the card's native one by default): a few steps of
    sigmoid+length_normalized+dynamic with a reward threshold every step passes, so beta decays at each step."""
    precision = precision or native_precision()
    trainer = chat_trainer(model_dir, work_dir, "trl", device, precision, max_steps=steps, beta=0.04,
                           kl_adaptation_method="sigmoid+length_normalized+dynamic", reward_threshold=-1.0,
                           dynamic_beta_decay=0.5, beta_schedule_steps=None)

    def beta_moves(rows: list[dict]) -> tuple[bool, str]:
        betas = [row["adaptive_kl/current_beta"] for row in rows]
        mixed = str(trainer.accelerator.mixed_precision)
        ok = (len(betas) == steps and all(later < earlier for earlier, later in zip(betas, betas[1:]))
              and mixed == {"fp32": "no"}.get(precision, precision))
        return ok, f"accelerate mixed_precision={mixed}, beta " + " -> ".join(f"{beta:.4g}" for beta in betas)

    return [train_check(f"TRL GRPOTrainer, {precision} autocast on {device}", trainer, beta_moves)]


class StepRecorder:
    """A TrainerCallback recording, before training and after each optimizer step, the GradScaler's scale (None
    without one) and a copy of the trainable weights: which steps changed them (a GradScaler skips a step whose
    gradients overflowed)."""

    def __init__(self, trainer: Any) -> None:
        from transformers import TrainerCallback

        recorder = self

        class Callback(TrainerCallback):
            def on_train_begin(self, *args: Any, **kwargs: Any) -> None:
                recorder.record()

            def on_step_end(self, *args: Any, **kwargs: Any) -> None:
                recorder.record()

        self.trainer, self.scales, self.weights = trainer, [], []
        trainer.add_callback(Callback())

    @property
    def scaler(self) -> Any:
        return getattr(self.trainer.accelerator, "scaler", None)

    def record(self) -> None:
        self.scales.append(None if self.scaler is None else float(self.scaler.get_scale()))
        self.weights.append(torch.cat([p.detach().float().flatten().cpu() for p in trainable(self.trainer.model)]))

    def applied_steps(self) -> int:
        return sum(not torch.equal(before, after) for before, after in zip(self.weights, self.weights[1:]))


def fp16_grad_scaler(model_dir: str, work_dir: str, backend: str = "trl", device: str = "cuda",
                     precision: str = "fp16", steps: int = 4) -> list[Check]:
    """Training in fp16 with accelerate's GradScaler (on a CPU, where accelerate has no fp16, the same code in fp32
    with no scaler): the scaler is there exactly when fp16 is on, its scale stays finite and positive, at least one
    step is applied (a scaler that skips every step trains nothing), the weights and metrics stay finite."""
    need = ("unsloth", "bitsandbytes") if backend == "unsloth" else ()
    name = f"{'TRL' if backend != 'unsloth' else 'Unsloth 4-bit' if device == 'cuda' else 'Unsloth'}, {precision}" + (
        " + GradScaler" if precision == "fp16" else " (no GradScaler)") + f" on {device}"
    failure = unmet_needs(name, need, backend == "unsloth")
    if failure:
        return failure
    trainer = chat_trainer(model_dir, work_dir, backend, device, precision, max_steps=steps, beta=0.04,
                           kl_adaptation_method="clip+length_normalized", kl_clip_threshold=0.5,
                           optim="adamw_torch", warmup_steps=0)
    recorder = StepRecorder(trainer)

    def scaler_ok(rows: list[dict]) -> tuple[bool, str]:
        wants_scaler = precision == "fp16" and device == "cuda"
        has_scaler = isinstance(recorder.scaler, torch.amp.GradScaler)
        scales = [scale for scale in recorder.scales if scale is not None]
        applied = recorder.applied_steps()
        ok = (has_scaler == wants_scaler and all(math.isfinite(s) and s > 0 for s in scales) and applied >= 1
              and len(recorder.weights) == steps + 1)
        scaler = "none" if recorder.scaler is None else type(recorder.scaler).__name__
        scale_text = " -> ".join(f"{s:g}" for s in scales) if scales else "none"
        return ok, f"GradScaler: {scaler}, scale {scale_text}, {applied} of {steps} optimizer steps applied"

    return [train_check(name, trainer, scaler_ok)]


def import_unsloth(name: str) -> list[Check]:
    """Import Unsloth (after this package) and make sure its GRPO trainer is generated and hooked; FAIL lines if
    not (selfcheck.generate_unsloth_trainer)."""
    from ..integrations import unsloth as unsloth_patch
    from .selfcheck import generate_unsloth_trainer

    error = generate_unsloth_trainer()
    if error is not None:
        return [Check(f"{name}: Unsloth trainer generated and hooked", False, error)]
    if unsloth_patch.generated_grpo_trainer() is None:
        return [Check(f"{name}: Unsloth trainer generated", False, "Unsloth fell back to TRL's trainer (see its log)")]
    return []


def compile_counters() -> dict[str, int]:
    """torch.compile's running totals: frames compiled, distinct graphs, Triton kernels generated by inductor."""
    from torch._dynamo.utils import counters
    from torch._inductor import metrics

    return {"frames": counters["frames"]["ok"], "graphs": counters["stats"]["unique_graphs"],
            "kernels": metrics.generated_kernel_count}


def loss_cache_entries() -> int:
    """torch.compile's cache entries on the chunk function of the Unsloth GRPO loss the hook calls (`accumulate_chunk`,
    nested in the generated `UnslothEfficientGRPO.forward`, compiled by `torch_compile_with_fallback`): 0 if the loss
    never ran compiled, which that wrapper's eager fallback would not say. Other compiled code in the step (generation,
    the log-prob scorers) does not count."""
    import inspect

    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    from ..integrations.unsloth import _AdaptiveEfficientGRPO

    forward = _AdaptiveEfficientGRPO.upstream.forward
    chunks = [code for code in forward.__code__.co_consts
              if inspect.iscode(code) and code.co_name == "accumulate_chunk"]
    if not chunks:
        raise RuntimeError("the generated UnslothEfficientGRPO.forward defines no accumulate_chunk: the check cannot "
                           "tell whether Unsloth's loss ran compiled")
    return sum(len(_debug_get_cache_entry_list(code)) for code in chunks)


def counter_change(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {key: after[key] - before[key] for key in before}


UNSLOTH_METHODS = ["none", "clip", "sigmoid", "length_normalized", "dynamic", "clip+length_normalized+dynamic",
                   "sigmoid+length_normalized"]


def use_method(trainer: Any, method: str, **fields: Any) -> None:
    """Switch a trainer to `method` with `fields`, the other fields only some methods read at their defaults (for
    `clip`, a threshold that some tokens of `comparison_inputs` pass)."""
    from ..core.config import FIELD_DEFAULTS, FIELD_READERS
    from ..integrations.trainer_hooks import attach_runtime

    settings = {name: default for name, default in FIELD_DEFAULTS.items() if name in FIELD_READERS}
    if "clip" in method.split("+"):
        settings["kl_clip_threshold"] = 0.2
    for field, value in {**settings, "kl_adaptation_method": method, **fields}.items():
        setattr(trainer.args, field, value)
    attach_runtime(trainer)


def method_check(name: str, trainer: Any, method: str, inputs: dict, compute: str = "compute_loss") -> list[Check]:
    """`method`'s loss and gradients on a captured batch (`compute`: the trainer's loss method name): finite, with
    finite `adaptive_kl/*` metrics."""
    from .selfcheck import loss_and_grads

    use_method(trainer, method)
    trainer._metrics["train"].clear()
    loss, grads = loss_and_grads(trainer, compute, inputs)
    row = {k: sum(v) / len(v) for k, v in trainer._metrics["train"].items() if k.startswith("adaptive_kl/") and v}
    problems = metric_problems([row]) + ([] if math.isfinite(loss) else [f"loss {loss}"])
    problems += [] if all(bool(torch.isfinite(g).all()) for g in grads) else ["a gradient is not finite"]
    return [Check(f"{name}: {method}", not problems, "; ".join([f"loss {loss:.6g}, {summary(row)}", *problems]))]


def no_recompile_check(name: str, trainer: Any, inputs: dict, compute: str = "compute_loss",
                       compiled: bool = True) -> list[Check]:
    """`dynamic` decaying beta three times on a captured batch: torch.compile's frame and graph counts must not
    move (the compiled loss gets a constant, and the KL term beta_t outside it). Where nothing is `compiled` (a CPU,
    where Unsloth's compile is off) the counts cannot move: the line is marked untested, beta's moves still checked."""
    from .selfcheck import loss_and_grads

    use_method(trainer, "dynamic", reward_threshold=-1.0, dynamic_beta_decay=0.5, beta_schedule_steps=None)
    loss_and_grads(trainer, compute, inputs)  # warm: the first call of this method may compile
    before, betas = compile_counters(), []
    for _ in range(3):
        trainer.adaptive_kl.step(mean_reward=1.0)  # a new generation batch whose reward passes: beta decays
        betas.append(trainer.adaptive_kl.current_beta)
        loss_and_grads(trainer, compute, inputs)
    change = counter_change(before, compile_counters())
    moved = len(set(betas)) == len(betas)
    return [Check(f"{name}: no recompile while beta moves", moved and change["frames"] == change["graphs"] == 0,
                  "beta " + " -> ".join(f"{b:.4g}" for b in betas)
                  + f": {change['frames']} frames compiled, {change['graphs']} new graphs"
                  + ("" if compiled else " (nothing is compiled here: the counts check nothing)"),
                  untested=not compiled)]


def unsloth_4bit(model_dir: str, work_dir: str, device: str = "cuda") -> list[Check]:
    """Unsloth's FastLanguageModel in 4-bit with LoRA through its generated trainer: the compiled loss on the first
    step (and which log-prob scorer it ran), `none` (and a clip no KL reaches) against stock Unsloth on the captured
    batch, each method of `UNSLOTH_METHODS` on it, and no recompile while beta moves. On a CPU (the dry run) the same
    code on the float32 model that `load_policy` gives there."""
    name = "Unsloth 4-bit + LoRA" if device == "cuda" else "Unsloth + LoRA (float32, dry run on the CPU)"
    failure = unmet_needs(name, ("unsloth", "bitsandbytes", "triton"), with_unsloth=True)
    if failure:
        return failure
    from .logprob_paths import counted_logprob_calls, describe
    from .selfcheck import captured_inputs, compare_with_stock, comparison_inputs, stock_unsloth

    torch.backends.cuda.matmul.allow_tf32 = False  # the summation bounds of the comparison are float32's
    precision = native_precision() if device == "cuda" else "fp32"
    trainer = chat_trainer(model_dir, work_dir, "unsloth", device, precision, optim="adamw_torch", warmup_steps=0)
    before = compile_counters()
    with counted_logprob_calls() as scorers:
        inputs = captured_inputs(trainer, "compute_loss")  # one training step: the first compile of the loss
    compiled, entries = counter_change(before, compile_counters()), loss_cache_entries()
    # On a CPU, Unsloth's compile is off (UNSLOTH_COMPILE_DISABLE, set with UNSLOTH_ALLOW_CPU by
    # selfcheck.generate_unsloth_trainer): the line reports what ran and checks nothing.
    checks = [Check(f"{name}: Unsloth's compiled loss runs (Triton)" if device == "cuda"
                    else f"{name}: Unsloth's loss runs (its compile is off on a CPU)",
                    device != "cuda" or (entries > 0 and compiled["kernels"] > 0),
                    f"the loss's chunk function compiled {entries} time(s); the first step compiled "
                    f"{compiled['graphs']} graphs, {compiled['kernels']} kernels in all ({precision}); "
                    f"log-probs: {describe(scorers)}")]
    checks += guarded(f"{name}: none == stock", lambda: compare_with_stock(
        f"{name} ({precision})", trainer, "compute_loss", lambda: stock_unsloth(trainer), inputs=inputs))
    compared = comparison_inputs(inputs)
    for method in UNSLOTH_METHODS:
        checks += guarded(f"{name}: {method}", lambda method=method: method_check(name, trainer, method, compared))
    checks += guarded(f"{name}: no recompile while beta moves",
                      lambda: no_recompile_check(name, trainer, compared, compiled=device == "cuda"))
    return checks


def unsloth_fp16_grad_scaler(model_dir: str, work_dir: str, device: str = "cuda", steps: int = 4) -> list[Check]:
    """`fp16_grad_scaler` on Unsloth's 4-bit model loaded in fp16 (on a CPU, the dry run: float32, no scaler)."""
    return fp16_grad_scaler(model_dir, work_dir, backend="unsloth", device=device,
                            precision="fp16" if device == "cuda" else "fp32", steps=steps)


def unsloth_guard(model_dir: str, work_dir: str, steps: Optional[int] = None) -> list[Check]:
    """The KL lab's end-to-end guard through Unsloth's generated trainer on this machine's device (its compiled loss
    and, on CUDA, its fused log-prob scorer): k1 in the reward and k1_future in the loss, dr_grpo, `trainer_lab.STEPS`
    steps of 64 completions, one seed, each run in its own worker process on the lab's model (not the saved tiny
    Llama). Each must end within `GUARD_TOLERANCE` of pi*_beta with an effective beta within `GUARD_BETA_TOLERANCE`
    of 0.5, the pad token's probability under 1e-12; each line names the log-prob scorers its run took. With fewer
    `steps` (the dry run) the figures are printed and only their finiteness is checked."""
    from . import trainer_lab

    name = "KL lab guard through Unsloth"
    failure = missing_packages(name, "unsloth")
    if failure:
        return failure
    steps = steps or trainer_lab.STEPS
    settings = [s for s in trainer_lab.trainer_settings() if s.label in ("k1 in the reward", "k1_future in the loss")]
    # spawned workers, as on a GPU (where forked ones could not use CUDA), so that the dry run starts them the same way
    table = trainer_lab.run_trainer_table("unsloth", settings, ["dr_grpo"], beta=0.5, steps=steps, seeds=[0],
                                          processes=len(settings), start_method="spawn")
    checks = []
    for row in table["rows"]:
        if "refused" in row:
            checks.append(Check(f"{name}: {row['setting']}", False, f"refused: {row['refused']}"))
            continue
        kl_opt, beta = row["train"]["kl_opt"], row["train"]["effective_beta"]
        finite = is_finite(kl_opt) and (beta is None or is_finite(beta))
        within = (kl_opt < trainer_lab.GUARD_TOLERANCE and beta is not None
                  and abs(beta - 0.5) <= trainer_lab.GUARD_BETA_TOLERANCE * 0.5 and row["pad_probability"] < 1e-12)
        bound = (f"bound {trainer_lab.GUARD_TOLERANCE}, beta within {trainer_lab.GUARD_BETA_TOLERANCE:.0%}"
                 if steps == trainer_lab.STEPS else f"{steps} of {trainer_lab.STEPS} steps: bound not checked")
        checks.append(Check(f"{name}: {row['setting']} (dr_grpo, {steps} steps)",
                            finite and (within or steps != trainer_lab.STEPS),
                            f"KL(pi||pi*) {kl_opt:.4g}, effective beta {beta if beta is None else f'{beta:.4g}'}, "
                            f"pad probability {row['pad_probability']:.2g} ({bound}); trained in "
                            f"{row.get('precision', 'a precision not recorded')}; log-probs: "
                            f"{row.get('logprob_path', 'not recorded')}"))
    return checks


def vllm_kl_in_reward(model_dir: str, work_dir: str, steps: int = 2) -> list[Check]:
    """Unsloth with `fast_inference=True`: vLLM generates, the KL is in the reward (GPU only)."""
    name = "vLLM fast_inference, kl_placement='reward'"
    failure = unmet_needs(name, ("unsloth", "bitsandbytes", "vllm"), with_unsloth=True)
    if failure:
        return failure
    precision = native_precision()
    model, tokenizer = load_policy(model_dir, "unsloth", precision, fast_inference=True, max_lora_rank=LORA_RANK,
                                   gpu_memory_utilization=0.3)
    engine, calls = model.vllm_engine, []
    upstream_generate = engine.generate

    def generate(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return upstream_generate(*args, **kwargs)

    engine.generate = generate
    trainer = chat_trainer(model_dir, work_dir, "unsloth", "cuda", precision, policy=(model, tokenizer),
                           max_steps=steps, beta=0.04, kl_placement="reward", kl_reduction="sequence_mean",
                           optim="adamw_torch", warmup_steps=0)

    def vllm_used(rows: list[dict]) -> tuple[bool, str]:
        penalties = [(row.get("adaptive_kl/reward_penalty"), row["adaptive_kl/current_beta"] *
                      row["adaptive_kl/adapted_kl"]) for row in rows]
        consistent = all(is_finite(p) and math.isclose(p, expected, rel_tol=1e-5, abs_tol=1e-12)
                         for p, expected in penalties)
        return (len(calls) > 0 and consistent,
                f"{len(calls)} vLLM generate calls (use_vllm={getattr(trainer, 'use_vllm', None)}), "
                f"reward_penalty == current_beta * adapted_kl: {consistent}")

    return [train_check(name, trainer, vllm_used)]


def ref_sync_8bit(model_dir: str, work_dir: str, backend: str = "unsloth", device: str = "cuda",
                  precision: Optional[str] = None, optim: str = "adamw_8bit", steps: int = 3) -> list[Check]:
    """The reference synced every 2 steps (alpha 0.5, optimizer reset) while `optim` (bitsandbytes' 8-bit AdamW on a
    GPU) trains: the sync count, the optimizer's state after the reset (8-bit again on the next step), finite
    weights and metrics."""
    name = f"reference sync with {optim}" + ("" if backend == "unsloth" else f" ({backend} on {device})")
    need = (["bitsandbytes"] if "8bit" in optim else []) + (["unsloth"] if backend == "unsloth" else [])
    failure = unmet_needs(name, need, backend == "unsloth")
    if failure:
        return failure
    if steps % 2 == 0:  # a sync, and its reset, at the last step would leave no optimizer state to check
        raise ValueError(f"steps={steps} is invalid: allowed is an odd number (the reference syncs every 2 steps)")
    precision = precision or native_precision()
    trainer = chat_trainer(model_dir, work_dir, backend, device, precision, max_steps=steps, beta=0.04, optim=optim,
                           warmup_steps=0, sync_ref_model=True, ref_model_sync_steps=2, ref_model_mixup_alpha=0.5,
                           ref_model_sync_reset_optimizer=True)
    last_sync = steps - 1

    def synced(rows: list[dict]) -> tuple[bool, str]:
        syncs = rows[-1].get("adaptive_kl/ref_syncs")
        optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
        dtypes = sorted({str(v.dtype).replace("torch.", "") for state in optimizer.state.values()
                         for v in state.values() if torch.is_tensor(v) and v.numel() > 1})
        eight_bit = "8bit" not in optim or "uint8" in dtypes
        # the reset at the last sync cleared the state: its step counts restarted there, one step ago (without it
        # they read `steps`)
        counts = sorted({int(state["step"]) for state in optimizer.state.values() if "step" in state})
        shown = "no" if syncs is None else f"{syncs:g}"
        return (syncs == steps // 2 and bool(dtypes) and eight_bit and counts == [1],
                f"{shown} syncs in {steps} steps, {type(optimizer).__name__} state dtypes "
                f"{', '.join(dtypes) or 'none'}, step counts {counts} after the reset at step {last_sync} "
                f"({steps} without it)")

    return [train_check(name, trainer, synced)]


def demo_model(model_dir: str, work_dir: str, backend: str = "unsloth", steps: int = 2,
               methods: str = "none,dynamic") -> list[Check]:
    """The demo's `--model` path (`demo.main`, its public entry point) on the saved model: exit code 0 and, for
    every method, `steps` rows with finite KL metrics."""
    from . import demo

    name = f"demo --model (backend {backend})"
    missing = missing_packages(name, *(["unsloth", "bitsandbytes"] if backend == "unsloth" else []))
    if missing:
        return missing
    output_dir = os.path.join(work_dir, "demo")
    argv = ["--model", model_dir, "--backend", backend, "--steps", str(steps), "--seeds", "1", "--methods", methods,
            "--output-dir", output_dir]
    errors = io.StringIO()
    with contextlib.redirect_stderr(errors):
        code = demo.main(argv)
    sys.stderr.write(errors.getvalue())
    failed = [line for line in errors.getvalue().splitlines() if line.startswith("FAILED")]
    path = os.path.join(output_dir, "metrics.json")
    rows = []
    if os.path.exists(path):
        with open(path) as f:  # the demo writes a metric never logged as null: NaN here, as it logged it
            rows = [{key: math.nan if value is None else value for key, value in row.items()} for row in json.load(f)]
    wanted = methods.split(",")
    counts = {method: sum(row["method"] == method for row in rows) for method in wanted}
    problems = [f"{method}: {count} of {steps} steps logged" for method, count in counts.items() if count != steps]
    problems += [f"{row['method']} step {row['step']}: {key}={row[key]}" for row in rows for key in REQUIRED
                 if not is_finite(row[key])]
    last = {m: [r for r in rows if r["method"] == m][-1] for m in wanted if counts.get(m)}
    measured = ", ".join(f"{m}: reward {r['reward']:.3g}, raw_kl {r['adaptive_kl/raw_kl']:.3g}, beta "
                         f"{r['adaptive_kl/current_beta']:.3g}" for m, r in last.items())
    return [Check(name, code == 0 and not problems,
                  "; ".join([f"exit {code}", measured, *failed, *problems]).strip("; "))]


SCENARIOS: dict[str, Callable[[str, str], list[Check]]] = {
    "trl-autocast": trl_autocast,
    "trl-fp16-scaler": fp16_grad_scaler,
    "unsloth-4bit": unsloth_4bit,
    "unsloth-fp16-scaler": unsloth_fp16_grad_scaler,
    "vllm-kl-in-reward": vllm_kl_in_reward,
    "ref-sync-8bit": ref_sync_8bit,
    "demo-model": demo_model,
    "unsloth-guard": unsloth_guard,
}
