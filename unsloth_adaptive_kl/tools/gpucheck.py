"""`python -m unsloth_adaptive_kl --gpu`: the one-command check of the GPU paths, offline, in at most 25 minutes.

It builds a tiny Llama that every GPU path can run (hidden size 256, head_dim 64, 128 tokens, 1024 positions, a
character-level fast tokenizer with a chat template, pad != eos), saves it to a temporary folder, and runs each
scenario below on it in a fresh Python process (so that Unsloth is imported after this package, the TRL scenarios
see TRL's own trainer, and one crash or hang fails one scenario only). Each prints one line per check, `[ok]` or
`[FAIL]`, with what it measured or the error:

- `trl-autocast`: TRL's GRPOTrainer under bf16 autocast (fp16 where the card lacks native bf16), a few steps of
  `sigmoid+length_normalized+dynamic`: every `adaptive_kl/*` metric finite, beta moving;
- `trl-fp16-scaler`: TRL with fp16 and accelerate's GradScaler: the scale stays finite, steps are applied, the
  weights stay finite;
- `unsloth-4bit`: `FastLanguageModel.from_pretrained(dir, load_in_4bit=True)` + LoRA: `none` (and a clip no KL
  reaches) equal to stock Unsloth's loss and gradients on a captured batch, every method finite, no recompile while
  beta moves (torch._dynamo's counters), Unsloth's compiled loss generating Triton kernels;
- `unsloth-fp16-scaler`: the same GradScaler check on the 4-bit model loaded in fp16 (what a T4 runs);
- `vllm-kl-in-reward`: `fast_inference=True` (vLLM) generation with `kl_placement="reward"`;
- `ref-sync-8bit`: `sync_ref_model=True` with bitsandbytes' `adamw_8bit` and the optimizer reset;
- `demo-model`: the demo's `--model` path (tools/demo.py) on the saved model, a few steps.

A missing optional package (unsloth, vllm, bitsandbytes) is a FAIL line naming what to install. The exit code is 0
only if every check holds, 1 otherwise, and 2 without a CUDA GPU. Every scenario takes the model folder and a work
folder, and those with a CPU equivalent take a device and a precision as well: the test suite runs them on a CPU
(tests/test_gpucheck.py), so that this check does not rot between GPU runs.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import importlib.util
import io
import json
import math
import os
import subprocess
import sys
import time
from dataclasses import asdict
from typing import Any, Callable, Optional

import torch

from .selfcheck import Check

# The tiny Llama: head_dim = HIDDEN_SIZE / NUM_HEADS = 64 (vLLM's attention backends); hidden, intermediate and vocab
# sizes multiples of 64 (bitsandbytes' 4-bit blocks); positions beyond any sequence length used here.
HIDDEN_SIZE, NUM_HEADS, NUM_LAYERS, VOCAB_SIZE = 256, 4, 2, 128
MAX_SEQ_LENGTH = 512  # the demo's FastLanguageModel max_seq_length
MAX_POSITIONS = 1024
LORA_RANK = 8
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
CHAT_PROMPTS = [[{"role": "user", "content": text}] for text in
                ("What is 2 + 3?", "Name a colour.", "Spell cat.", "Count to 4.", "Say hi!", "Is 7 odd?",
                 "Add 10 and 5.", "Reverse ab.")]
BUDGET_S = 25 * 60  # the whole check
SCENARIO_TIMEOUT_S = 8 * 60  # one scenario, at most
INSTALL = {
    "unsloth": 'pip install "unsloth-adaptive-kl[unsloth]"',
    "vllm": "pip install vllm (the build matching your torch; see Unsloth's install guide)",
    "bitsandbytes": "pip install bitsandbytes",
    "triton": "pip install triton (comes with torch's CUDA wheels)",
}
# NaN by definition where every length (or every summed KL) of a batch is equal (docs/metrics.md).
MAY_BE_NAN = {"adaptive_kl/length_kl_corr"}
REQUIRED = ("adaptive_kl/raw_kl", "adaptive_kl/adapted_kl", "adaptive_kl/current_beta")


# ----- the tiny model ------------------------------------------------------------------------------------------

def save_tiny_llama(model_dir: str, seed: int = 0) -> Any:
    """Build the tiny Llama and its chat tokenizer, save both (safetensors) to `model_dir`; returns the model."""
    from .tiny import CHAT_ALPHABET, CHAT_TEMPLATE, build_tiny_model, build_tokenizer

    tokenizer = build_tokenizer(CHAT_ALPHABET, chat_template=CHAT_TEMPLATE, vocab_size=VOCAB_SIZE)
    model = build_tiny_model(tokenizer, hidden_size=HIDDEN_SIZE, num_layers=NUM_LAYERS, seed=seed,
                             num_heads=NUM_HEADS, max_position_embeddings=MAX_POSITIONS)
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    return model


def build_tiny_llama(model_dir: str) -> list[Check]:
    """Build and save the tiny Llama, then reload it from disk as every scenario does: shapes, tokenizer (fast,
    chat template, pad != eos, the config's ids) and weights (the same logits)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .tiny import CHAT_TEMPLATE

    built = save_tiny_llama(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    shape_ok = (config.hidden_size % 64 == 0 and head_dim == 64 and config.vocab_size % 64 == 0
                and config.max_position_embeddings >= MAX_SEQ_LENGTH)
    checks = [Check("tiny Llama: shapes every GPU path runs", shape_ok,
                    f"hidden {config.hidden_size}, head_dim {head_dim}, vocab {config.vocab_size}, "
                    f"max_position_embeddings {config.max_position_embeddings} (max_seq_length {MAX_SEQ_LENGTH})")]

    text = tokenizer.apply_chat_template(CHAT_PROMPTS[0], tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text).input_ids
    tokenizer_ok = (tokenizer.is_fast and tokenizer.chat_template == CHAT_TEMPLATE
                    and tokenizer.decode(ids) == text and tokenizer.pad_token_id != tokenizer.eos_token_id
                    and (config.pad_token_id, config.eos_token_id) == (tokenizer.pad_token_id, tokenizer.eos_token_id)
                    and tokenizer.padding_side == "left")
    checks.append(Check("tiny Llama: tokenizer reloads", tokenizer_ok,
                        f"{type(tokenizer).__name__} (fast: {tokenizer.is_fast}), pad {tokenizer.pad_token_id} "
                        f"!= eos {tokenizer.eos_token_id}, chat template round-trips: {tokenizer.decode(ids) == text}, "
                        f"padding {tokenizer.padding_side}"))

    probe = torch.tensor([ids])
    with torch.no_grad():
        diff = (model(probe).logits - built(probe).logits).abs().max().item()
    checks.append(Check("tiny Llama: weights reload", diff == 0.0, f"max logit difference {diff:.2g}"))
    return checks


# ----- shared pieces -------------------------------------------------------------------------------------------

def missing_packages(scenario: str, *modules: str) -> list[Check]:
    """A FAIL line per module of `modules` that is not installed, saying what to install."""
    return [Check(f"{scenario}: needs {module}", False, f"{module} is not installed: {INSTALL[module]}")
            for module in modules if importlib.util.find_spec(module) is None]


def native_precision() -> str:
    """'bf16' on a GPU with native bf16, else 'fp16' (a T4): the demo's rule (`demo.mixed_precision`)."""
    from .demo import mixed_precision

    return "bf16" if mixed_precision()["bf16"] else "fp16"


def precision_settings(device: str, precision: str) -> dict[str, Any]:
    """GRPOConfig flags for a device ('cuda' or 'cpu') and a precision ('bf16', 'fp16' or 'fp32')."""
    if precision not in ("bf16", "fp16", "fp32"):
        raise ValueError(f"precision={precision!r} is invalid: allowed is 'bf16', 'fp16' or 'fp32'")
    return {"use_cpu": device == "cpu", "bf16": precision == "bf16", "fp16": precision == "fp16"}


def load_policy(model_dir: str, backend: str, precision: str = "fp32", **unsloth_kwargs: Any) -> tuple[Any, Any]:
    """(LoRA policy, tokenizer) from the saved model. 'trl': transformers in float32 (autocast does the rest) with
    PEFT's LoRA; 'unsloth': `FastLanguageModel` in 4-bit, computing in `precision` (bf16 or fp16), with Unsloth's
    LoRA; `unsloth_kwargs` go to `from_pretrained` (e.g. fast_inference=True)."""
    if backend == "unsloth":
        from unsloth import FastLanguageModel

        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
        model, tokenizer = FastLanguageModel.from_pretrained(model_dir, max_seq_length=MAX_SEQ_LENGTH, dtype=dtype,
                                                             load_in_4bit=True, **unsloth_kwargs)
        model = FastLanguageModel.get_peft_model(model, r=LORA_RANK, lora_alpha=2 * LORA_RANK,
                                                 target_modules=LORA_TARGETS, random_state=0)
        return model, tokenizer
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .tiny import add_lora

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return add_lora(model, rank=LORA_RANK), AutoTokenizer.from_pretrained(model_dir)


def chat_trainer(model_dir: str, work_dir: str, backend: str, device: str, precision: str,
                 policy: Optional[tuple[Any, Any]] = None, **overrides: Any) -> Any:
    """A GRPO trainer (whichever `trl.GRPOTrainer` is now) on the saved model and the chat prompts; `overrides` are
    GRPOConfig fields. `policy`: a (model, tokenizer) already loaded."""
    from .selfcheck import tiny_trainer

    model, tokenizer = policy or load_policy(model_dir, backend, precision)
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
    name = f"{'Unsloth 4-bit' if backend == 'unsloth' else 'TRL'}, {precision}" + (
        " + GradScaler" if precision == "fp16" else " (no GradScaler)") + f" on {device}"
    missing = missing_packages(name, *need)
    if missing:
        return missing
    if backend == "unsloth":
        unsloth_failure = import_unsloth(name)
        if unsloth_failure:
            return unsloth_failure
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


def counter_change(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {key: after[key] - before[key] for key in before}


UNSLOTH_METHODS = ["none", "clip", "sigmoid", "length_normalized", "dynamic", "clip+length_normalized+dynamic",
                   "sigmoid+length_normalized"]


def guarded(name: str, part: Callable[[], list[Check]]) -> list[Check]:
    """The checks of `part`, or one FAIL line with its exception: a failing part leaves the others' lines."""
    try:
        return part()
    except Exception as error:  # reported, and the exit code says so
        return [Check(name, False, f"{type(error).__name__}: {error}")]


def use_method(trainer: Any, method: str, **fields: Any) -> None:
    """Switch a trainer to `method` (with a clip threshold that some tokens of `shifted_reference` pass)."""
    from ..integrations.trainer_hooks import attach_runtime

    for field, value in {"kl_adaptation_method": method, "kl_clip_threshold": 0.2, **fields}.items():
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


def no_recompile_check(name: str, trainer: Any, inputs: dict, compute: str = "compute_loss") -> list[Check]:
    """`dynamic` decaying beta three times on a captured batch: torch.compile's frame and graph counts must not
    move (the compiled loss gets a constant, and the KL term beta_t outside it)."""
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
                  + f": {change['frames']} frames compiled, {change['graphs']} new graphs")]


def unsloth_4bit(model_dir: str, work_dir: str) -> list[Check]:
    """Unsloth's FastLanguageModel in 4-bit with LoRA through its generated trainer (GPU only): the compiled loss on
    the first step, `none` (and a clip no KL reaches) against stock Unsloth on the captured batch, each method of
    `UNSLOTH_METHODS` on it, and no recompile while beta moves."""
    name = "Unsloth 4-bit + LoRA"
    missing = missing_packages(name, "unsloth", "bitsandbytes", "triton")
    if missing:
        return missing
    failure = import_unsloth(name)
    if failure:
        return failure
    from .selfcheck import captured_inputs, compare_with_stock, shifted_reference, stock_unsloth

    torch.backends.cuda.matmul.allow_tf32 = False  # the summation bounds of the comparison are float32's
    precision = native_precision()
    trainer = chat_trainer(model_dir, work_dir, "unsloth", "cuda", precision, optim="adamw_torch", warmup_steps=0)
    before = compile_counters()
    inputs = captured_inputs(trainer, "compute_loss")  # one training step: the first compile of the loss
    compiled = counter_change(before, compile_counters())
    checks = [Check(f"{name}: Unsloth's compiled loss runs (Triton)",
                    compiled["graphs"] > 0 and compiled["kernels"] > 0,
                    f"first step compiled {compiled['graphs']} graphs, {compiled['kernels']} Triton kernels "
                    f"({precision})")]
    checks += guarded(f"{name}: none == stock", lambda: compare_with_stock(
        f"{name} ({precision})", trainer, "compute_loss", lambda: stock_unsloth(trainer), inputs=inputs))
    shifted = shifted_reference(inputs)
    for method in UNSLOTH_METHODS:
        checks += guarded(f"{name}: {method}", lambda method=method: method_check(name, trainer, method, shifted))
    checks += guarded(f"{name}: no recompile while beta moves", lambda: no_recompile_check(name, trainer, shifted))
    return checks


def unsloth_fp16_grad_scaler(model_dir: str, work_dir: str) -> list[Check]:
    """`fp16_grad_scaler` on Unsloth's 4-bit model loaded in fp16 (GPU only)."""
    return fp16_grad_scaler(model_dir, work_dir, backend="unsloth")


def vllm_kl_in_reward(model_dir: str, work_dir: str, steps: int = 2) -> list[Check]:
    """Unsloth with `fast_inference=True`: vLLM generates, the KL is in the reward (GPU only)."""
    name = "vLLM fast_inference, kl_placement='reward'"
    missing = missing_packages(name, "unsloth", "bitsandbytes", "vllm")
    if missing:
        return missing
    failure = import_unsloth(name)
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
    missing = missing_packages(name, *(["bitsandbytes"] if "8bit" in optim else []),
                               *(["unsloth"] if backend == "unsloth" else []))
    if missing:
        return missing
    if backend == "unsloth":
        failure = import_unsloth(name)
        if failure:
            return failure
    precision = precision or native_precision()
    trainer = chat_trainer(model_dir, work_dir, backend, device, precision, max_steps=steps, beta=0.04, optim=optim,
                           warmup_steps=0, sync_ref_model=True, ref_model_sync_steps=2, ref_model_mixup_alpha=0.5,
                           ref_model_sync_reset_optimizer=True)

    def synced(rows: list[dict]) -> tuple[bool, str]:
        syncs = rows[-1].get("adaptive_kl/ref_syncs")
        optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
        dtypes = sorted({str(v.dtype).replace("torch.", "") for state in optimizer.state.values()
                         for v in state.values() if torch.is_tensor(v) and v.numel() > 1})
        eight_bit = "8bit" not in optim or "uint8" in dtypes
        shown = "no" if syncs is None else f"{syncs:g}"
        return (syncs == steps // 2 and bool(dtypes) and eight_bit,
                f"{shown} syncs in {steps} steps, {type(optimizer).__name__} state dtypes "
                f"{', '.join(dtypes) or 'none'}")

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
        with open(path) as f:
            rows = json.load(f)
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
}


# ----- running them --------------------------------------------------------------------------------------------

def run_scenario(name: str, model_dir: str, work_dir: str) -> list[Check]:
    """One scenario in this process; an exception becomes its FAIL line."""
    try:
        return SCENARIOS[name](model_dir, work_dir)
    except Exception as error:  # reported, and the exit code says so
        return [Check(name, False, f"{type(error).__name__}: {error}")]


def scenario_env(work_dir: str) -> dict[str, str]:
    """A scenario process's environment: offline, no telemetry, a fresh torch.compile cache (so that the compiled
    loss is really compiled, and measured, in this run), and this copy of the package first on the path (the process
    runs in `work_dir`, where Unsloth writes its generated code)."""
    package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
            "UNSLOTH_DISABLE_STATISTICS": "1", "TOKENIZERS_PARALLELISM": "false", "WANDB_DISABLED": "true",
            "TORCHINDUCTOR_CACHE_DIR": os.path.join(work_dir, "inductor_cache"), "PYTHONPATH": path}


def scenario_command(name: str, model_dir: str, work_dir: str, result_path: str) -> list[str]:
    """The command line of one scenario's process (`scenario_process`)."""
    return [sys.executable, "-m", "unsloth_adaptive_kl.tools.gpucheck", name, model_dir, work_dir, result_path]


def run_isolated(name: str, model_dir: str, work_dir: str, timeout: float) -> tuple[list[Check], str]:
    """A scenario in a fresh Python process (`scenario_command`): its checks, read back from the JSON it writes (a
    FAIL line if it crashed or ran out of time), and its log."""
    os.makedirs(work_dir, exist_ok=True)
    result_path, log_path = os.path.join(work_dir, "result.json"), os.path.join(work_dir, "log.txt")
    command = scenario_command(name, model_dir, work_dir, result_path)
    with open(log_path, "w") as log:
        try:
            code = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=scenario_env(work_dir),
                                  cwd=work_dir, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            code = None
    text = open(log_path, errors="replace").read()
    if os.path.exists(result_path):
        with open(result_path) as f:
            return [Check(**item) for item in json.load(f)], text
    last = next((line for line in reversed(text.splitlines()) if line.strip()), "no output")
    reason = f"timed out after {timeout:g} s" if code is None else f"the process exited {code}"
    return [Check(name, False, f"{reason}: {last}")], text


def environment_lines() -> list[str]:
    """The card and the versions this run used."""
    lines = []
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability(0)
        lines.append(f"card: {torch.cuda.get_device_name(0)} (compute capability {major}.{minor}), "
                     f"precision {native_precision()}, CUDA {torch.version.cuda}")
    found = []
    for package in ("unsloth_adaptive_kl", "torch", "transformers", "trl", "peft", "unsloth", "unsloth_zoo", "vllm",
                    "bitsandbytes", "triton"):
        try:
            found.append(f"{package}=={importlib.metadata.version(package.replace('_', '-'))}")
        except importlib.metadata.PackageNotFoundError:
            found.append(f"{package} (not installed)")
    return lines + ["versions: " + ", ".join(found)]


def parse_only(only: Optional[str]) -> list[str]:
    names = [n.strip() for n in (only or "").split(",") if n.strip()] or list(SCENARIOS)
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        raise SystemExit(f"--only: unknown scenario {', '.join(unknown)}; allowed: {', '.join(SCENARIOS)}")
    return names


Runner = Callable[[str, str, str, float], tuple[list[Check], str]]


def run_all(names: list[str], root: str, run: Runner = run_isolated, budget_s: float = BUDGET_S) -> list[Check]:
    """Build the tiny Llama under `root`, then each scenario of `names` through `run` (`run_isolated`: a fresh
    process each), printing each check as it comes and, for a failed scenario, the last lines of its log. A scenario
    is not run (a FAIL line says why) without a model or with less than 30 s of `budget_s` left."""
    start = time.perf_counter()
    checks: list[Check] = []

    def report(new: list[Check]) -> None:
        for check in new:
            checks.append(check)
            print(check.line(), flush=True)

    model_dir = os.path.join(root, "tiny-llama")
    try:
        report(build_tiny_llama(model_dir))
    except Exception as error:  # reported, and every scenario says it could not run
        report([Check("tiny Llama built and saved", False, f"{type(error).__name__}: {error}")])
    built = all(check.ok for check in checks)
    for name in names:
        left = budget_s - (time.perf_counter() - start)
        if not built:
            report([Check(name, False, "not run: the tiny model could not be built")])
        elif left < 30:
            report([Check(name, False, f"not run: the {budget_s:.0f}-second budget is spent")])
        else:
            new, log = run(name, model_dir, os.path.join(root, name), min(SCENARIO_TIMEOUT_S, left))
            report(new)
            if not all(check.ok for check in new):
                tail = log.splitlines()[-30:]
                print(f"    --- {name}: the last {len(tail)} lines of its log ---", *("    " + line for line in tail),
                      sep="\n", flush=True)
    return checks


def main(only: Optional[str] = None) -> int:
    """The GPU check: 2 without CUDA, else 0 if every check holds and 1 otherwise. `only`: comma-separated scenario
    names (all by default)."""
    import tempfile

    names = parse_only(only)
    if not torch.cuda.is_available():
        print(f"python -m unsloth_adaptive_kl --gpu needs a CUDA GPU: torch.cuda.is_available() is False here "
              f"(torch {torch.__version__}, CUDA build {torch.version.cuda or 'none'}). On a CPU, run "
              f"`python -m unsloth_adaptive_kl` (the self-check).")
        return 2
    start = time.perf_counter()
    print("unsloth_adaptive_kl GPU check", *environment_lines(), sep="\n", flush=True)
    with tempfile.TemporaryDirectory(prefix="adaptive_kl_gpucheck_") as root:
        checks = run_all(names, root)
    failed = [check for check in checks if not check.ok]
    print(f"GPU check {'passed' if not failed else 'FAILED'}: {len(checks) - len(failed)} of {len(checks)} checks "
          f"hold ({time.perf_counter() - start:.0f} s)")
    return 1 if failed else 0


def scenario_process(argv: list[str]) -> int:
    """`python -m unsloth_adaptive_kl.tools.gpucheck NAME MODEL_DIR WORK_DIR RESULT_JSON`: one scenario, its checks
    printed and written to RESULT_JSON."""
    parser = argparse.ArgumentParser(description="one scenario of the GPU check (run by `--gpu`)")
    for argument in ("name", "model_dir", "work_dir", "result"):
        parser.add_argument(argument)
    args = parser.parse_args(argv)
    checks = run_scenario(args.name, args.model_dir, args.work_dir)
    for check in checks:
        print(check.line(), flush=True)
    with open(args.result, "w") as f:
        json.dump([asdict(check) for check in checks], f)
    return 0


if __name__ == "__main__":
    sys.exit(scenario_process(sys.argv[1:]))
