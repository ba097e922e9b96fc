"""Run Unsloth's real generated GRPO trainer on CPU (a subprocess of tests/test_unsloth.py; not collected).

    python tests/unsloth_cpu.py SCENARIO OUTPUT_JSON
    python tests/unsloth_cpu.py SCENARIO,SCENARIO,... OUTPUT_JSON   # in turn, in this one process

Several scenarios in one process share its import of Unsloth, the trainer it generated and the losses inductor
compiled (tests/test_unsloth_loss.py's seven: 274 s in one process where a process each took 523, on a worker of 2
on 2 cores); OUTPUT_JSON then holds {scenario: {"result": ...}} or, for one that raised, {scenario: {"traceback":
...}}.

Unsloth's generated GRPO trainer has no CPU path (2026.10.7 and 2026.10.8 refuse a machine without an accelerator;
2026.10.9's CPU backend trains with TRL's own trainers and generates none): with UNSLOTH_ALLOW_CPU=1 Unsloth takes its
GPU code path, and since PatchFastRL then skips generation, `_patch_trl_rl_trainers("grpo_trainer")` is called here, as PatchFastRL would on a GPU.
UNSLOTH_COMPILE_DISABLE=1 turns off Unsloth's `_maybe_compile` helpers, whose guards recompile on every new chunk
shape (10-60 s each on CPU); the GRPO loss itself stays compiled (torch_compile_with_fallback ignores the flag).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import io
import json
import logging
import math
import os
import pickle
import sys
import time
import warnings
from typing import Any

os.environ.setdefault("UNSLOTH_ALLOW_CPU", "1")
os.environ.setdefault("UNSLOTH_COMPILE_DISABLE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("UNSLOTH_DISABLE_STATISTICS", "1")
# Unsloth's PrefixGrouper scores a group's completions as one stream whose position ids restart per completion, which
# only FastLanguageModel's attention reads (`prefix_seg_info`); on this harness's plain transformers model the
# completions after a group's first would be scored without their prompt (0.13-0.28 nats off a plain forward, kl 3.6e-3
# at policy == reference). A GPU run with FastLanguageModel takes the grouped path correctly.
os.environ.setdefault("UNSLOTH_GRPO_PREFIX_GROUPER", "0")

import torch  # noqa: E402
import torch._inductor.config  # noqa: E402

torch.set_num_threads(1)
# Unsloth's compiled loss becomes inductor's C++ kernels here (on a GPU, Triton's). Their vectorised form depends on
# the CPU: with AVX2 kernels (ATEN_CPU_CAPABILITY=avx2) stock Unsloth's bnpo loss came out 0.628 and the hooked one
# 0.437, where AVX-512 and scalar kernels both give 0.293 (torch 2.14.1). Scalar kernels are the same on every CPU.
torch._inductor.config.cpp.simdlen = 1

SCENARIO = sys.argv[1]
if SCENARIO == "late_import":  # unsloth first, then this package: the documented ImportError
    import unsloth  # noqa: F401
    import unsloth.models.rl as rl

    rl._patch_trl_rl_trainers("grpo_trainer")
    try:
        import unsloth_adaptive_kl  # noqa: F401
    except ImportError as error:
        result: dict[str, Any] = {"error": str(error)}
    else:
        result = {"error": None}
    with open(sys.argv[2], "w") as f:
        json.dump(result, f)
    sys.exit(0)

import unsloth_adaptive_kl  # noqa: E402  (first)

assert "unsloth" not in sys.modules and "unsloth_zoo" not in sys.modules
import unsloth  # noqa: E402,F401
import unsloth.models.rl as rl  # noqa: E402
import unsloth_zoo.rl_replacements as zoo_rl  # noqa: E402
import unsloth_zoo.temporary_patches.utils as zoo_utils  # noqa: E402

if "if UNSLOTH_COMPILE_DISABLE:" in inspect.getsource(zoo_utils.torch_compile_with_fallback):
    # unsloth_zoo 2026.10.9's torch_compile_with_fallback honours the flag too (2026.10.7's does not): keep the
    # GRPO loss compiled, as on a GPU, while the `_maybe_compile` helpers stay off.
    zoo_utils.UNSLOTH_COMPILE_DISABLE = False
# How the installed grpo_compute_loss reduces bnpo given num_items_in_batch, read here independently of the package.
BNPO_MICRO_BATCH = 'elif loss_type == "bnpo":\n' in inspect.getsource(zoo_rl.grpo_compute_loss)


class LogRecords(logging.Handler):
    """Keeps the messages a logger emits at `level` and above (warnings by default)."""

    def __init__(self, level: int = logging.WARNING) -> None:
        super().__init__(level)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


UNSLOTH_LOG = LogRecords()
if SCENARIO == "hook_failure":
    # A new Unsloth as this package would meet it: one anchor the integration looks for is no longer in the generated
    # source. Then Unsloth's own patch_trl_rl_trainers, as PatchFastRL calls it on a GPU, its try/except included.
    from unsloth_adaptive_kl.integrations import unsloth as unsloth_hook  # noqa: E402
    from unsloth_adaptive_kl.integrations.versions import UNSLOTH_KL_LINE  # noqa: E402
    from unsloth_zoo.log import logger as unsloth_logger  # noqa: E402

    unsloth_hook.UNSLOTH_ANCHORS = tuple(
        dataclasses.replace(anchor, text=anchor.text + "  # renamed") if anchor is UNSLOTH_KL_LINE else anchor
        for anchor in unsloth_hook.UNSLOTH_ANCHORS)
    unsloth_logger.addHandler(UNSLOTH_LOG)
    rl.patch_trl_rl_trainers()
    unsloth_logger.removeHandler(UNSLOTH_LOG)
else:
    rl._patch_trl_rl_trainers("grpo_trainer")

import trl  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import PrinterCallback, TrainerCallback, set_seed  # noqa: E402
from transformers.trainer_utils import IntervalStrategy  # noqa: E402

from unsloth_adaptive_kl.integrations.trainer_hooks import UNSLOTH_DEFAULTS  # noqa: E402
from unsloth_adaptive_kl.tools.selfcheck import absolute_loss, backward_grads, captured_inputs  # noqa: E402
from unsloth_adaptive_kl.tools.selfcheck import stock_unsloth, tiny_trainer  # noqa: E402
from unsloth_adaptive_kl.tools.selfcheck import loss_and_grads as selfcheck_loss_and_grads  # noqa: E402
from unsloth_adaptive_kl.tools import gpu_scenarios  # noqa: E402
from unsloth_adaptive_kl.tools.tiny import add_lora, build_tiny_model, build_tokenizer  # noqa: E402

from tests.test_trl_loss import policy_logps, shaped_by_hand  # noqa: E402  (the same plain forward pass as the TRL tests)
from tests.metric_definitions import REDUCE, by_definition  # noqa: E402  (docs/metrics.md, written out)
from tests.test_kl_in_reward import (  # noqa: E402  (the same advantage formula as the TRL tests)
    completion_kl_by_hand,
    expected_advantages,
    perturb_adapters,
    recording,
    scored_batch,
)

PROMPTS = ["ab:", "cde:", "fg:", "h:", "bad:", "ce:", "gh:", "abc:"]


@unsloth_adaptive_kl.register_kl_estimator("user_three_k2")
def user_three_k2(logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """A user's own estimator, registered by name as a user would: 3 * 0.5 * (logp - ref)^2."""
    return 1.5 * (logp - ref_logp) ** 2



@unsloth_adaptive_kl.register_beta_controller("test_counting_beta")
class CountingBeta(unsloth_adaptive_kl.core.controllers.ConstantBeta):
    """A constant beta recording each `step` call's completed_steps and the completions of its window."""

    def __init__(self, beta: float, config: Any) -> None:
        super().__init__(beta, config)
        self.calls: list[int] = []
        self.completions: list[Any] = []

    def step(self, completed_steps: int, window: Any = None) -> None:
        self.calls.append(completed_steps)
        self.completions.append(None if window is None else window.completions)


TOKENIZER = build_tokenizer()


def hash_reward(completions: list[str], **kwargs: Any) -> list[float]:
    return [1.0 if "#" in text else 0.1 * (len(text) % 5) for text in completions]


def constant_reward(completions: list[str], **kwargs: Any) -> list[float]:
    return [1.0] * len(completions)


class StepTimer(TrainerCallback):
    def __init__(self) -> None:
        self.times: list[float] = []

    def on_step_begin(self, *_: Any, **__: Any) -> None:
        self.start = time.perf_counter()

    def on_step_end(self, *_: Any, **__: Any) -> None:
        self.times.append(time.perf_counter() - self.start)


def make_trainer(output_dir: str, reward: Any = hash_reward, unset: tuple[str, ...] = (), tokenizer: Any = TOKENIZER,
                 prompts: tuple[str, ...] = tuple(PROMPTS), **overrides: Any) -> Any:
    """The harness's trainer on the tiny LoRA model; `unset` names settings left to the config's defaults."""
    settings: dict[str, Any] = dict(
        output_dir=output_dir, use_cpu=True, bf16=False, fp16=False, optim="adamw_torch", report_to="none",
        per_device_train_batch_size=4, num_generations=4, max_completion_length=8, max_steps=2, logging_steps=1,
        learning_rate=5e-3, beta=0.04, save_strategy="no", gradient_accumulation_steps=2, seed=0,
        disable_tqdm=True, loss_type="dapo", warmup_steps=0, epsilon_high=0.2, mask_truncated_completions=False,
    )
    settings.update(overrides)
    for name in unset:
        del settings[name]
    args = trl.GRPOConfig(**settings)
    set_seed(0)
    model = add_lora(build_tiny_model(tokenizer, seed=0), seed=0)
    for name in ("for_training", "for_inference"):  # what FastLanguageModel models have; a plain PEFT model lacks
        setattr(model, name, lambda *a, **k: None)
    model._unsloth_user_float32 = True  # keep Unsloth from switching fp16 on (it sees no bf16 on CPU)
    timer = StepTimer()
    trainer = trl.GRPOTrainer(model=model, processing_class=tokenizer, reward_funcs=[reward], args=args,
                              train_dataset=Dataset.from_dict({"prompt": list(prompts) * 4}), callbacks=[timer])
    trainer.remove_callback(PrinterCallback)
    trainer.step_timer = timer
    return trainer


def logged(trainer: Any, key: str) -> list[Any]:
    return [entry[key] for entry in trainer.state.log_history if key in entry]


def capture_inputs(trainer: Any) -> dict:
    return captured_inputs(trainer, "compute_loss")


def loss_and_grads(trainer: Any, inputs: dict) -> tuple[float, list[torch.Tensor]]:
    return selfcheck_loss_and_grads(trainer, "compute_loss", inputs)


def stock_loss_and_grads(trainer: Any, inputs: dict) -> tuple[float, list[torch.Tensor]]:
    with stock_unsloth(trainer):
        return loss_and_grads(trainer, inputs)


def stock_magnitude(trainer: Any, inputs: dict) -> float:
    """The magnitude a reordered-sum bound on stock Unsloth's loss needs: its loss with every advantage -|A|
    (`selfcheck.absolute_loss`; |loss| is not one: a group's advantages sum to 0, and the terms cancel)."""
    with stock_unsloth(trainer):
        return absolute_loss(trainer, "compute_loss", inputs)


def independent_kl_part(trainer: Any, inputs: dict) -> torch.Tensor:
    """beta * KL term / GA from the formulas of docs/methods.md and Unsloth's clamped k3 on a plain forward pass (log
    ratios within +/-1.5: no clamp acts, so the clamp order of the installed version does not matter here), times
    the importance ratio exp(logp - old) with use_bias_correction_kl (TRL's default: k3+)."""
    args = trainer.args
    trainer.model.train()
    logp = policy_logps(trainer.model, inputs)
    r = torch.clamp(inputs["ref_per_token_logps"] - logp, -20, 20)
    k = torch.clamp(torch.expm1(r) - r, -10, 10)
    if args.use_bias_correction_kl:  # times the importance ratio: 1 on-policy, but it carries k's own gradient
        k = k * torch.exp(logp - inputs.get("old_per_token_logps", logp.detach()))
    if args.kl_estimator == "k2":
        k = 0.5 * (logp - inputs["ref_per_token_logps"]) ** 2
    elif args.kl_estimator == "user_three_k2":
        k = 1.5 * (logp - inputs["ref_per_token_logps"]) ** 2
    elif args.kl_estimator == "k1_future":  # value k1, gradient G_t * grad logp_t, G_t = sum_{s >= t} m_s k1_s
        k1 = ((logp - inputs["ref_per_token_logps"]) * inputs["completion_mask"].float()).detach()
        to_go = torch.stack([k1[:, t:].sum(-1) for t in range(k1.size(1))], dim=-1)
        k = (logp - inputs["ref_per_token_logps"]).detach() + to_go * logp - (to_go * logp).detach()
    methods = args.kl_adaptation_method.split("+")
    k = shaped_by_hand(k, args)
    m = inputs["completion_mask"].float()
    sums, lengths = (k * m).sum(-1), m.sum(-1)
    if args.kl_reduction == "sequence_sum":
        term = sums.mean()
    elif "length_normalized" in methods or args.loss_type == "grpo":
        term = (sums / lengths.clamp(min=1)).mean()
    elif args.loss_type == "dr_grpo":
        term = sums.sum() / (k.size(0) * args.max_completion_length)
    elif args.loss_type == "bnpo" and BNPO_MICRO_BATCH:  # unsloth_zoo 2026.10.9: the micro-batch's token mean
        term = sums.sum() / lengths.sum()
    else:  # dapo and, in unsloth_zoo 2026.10.7, bnpo: num_items_in_batch / processes * GA / steps_per_generation
        term = sums.sum() / (inputs["num_items_in_batch"] * args.gradient_accumulation_steps / args.steps_per_generation)
        return args.beta * term
    return args.beta * term / args.gradient_accumulation_steps


def expected_metrics(trainer: Any, inputs: dict) -> dict[str, float]:
    """docs/metrics.md's adaptive_kl/* of one micro-batch: Unsloth's clamped k3 on a plain forward pass (its value:
    the importance ratio is 1 on-policy), raw_kl reduced as the installed loss_type reduces (dapo, and bnpo where
    unsloth_zoo normalises globally: num_items_in_batch / processes / steps_per_generation)."""
    args = trainer.args
    with torch.no_grad():
        logp = policy_logps(trainer.model, inputs)
    r = torch.clamp(inputs["ref_per_token_logps"] - logp, -20, 20)
    k = torch.clamp(torch.expm1(r) - r, -10, 10)
    normalizer = float(inputs["num_items_in_batch"]) / args.steps_per_generation
    reduce = {**REDUCE, "dr_grpo": lambda s, lengths: s.sum() / (s.numel() * args.max_completion_length),
              "dapo": lambda s, lengths: s.sum() / normalizer}
    raw = reduce["bnpo" if args.loss_type == "bnpo" and BNPO_MICRO_BATCH else
                 "dapo" if args.loss_type == "bnpo" else args.loss_type]
    adapted = reduce["length_normalized"] if "length_normalized" in args.kl_adaptation_method else raw
    return by_definition(k, inputs["completion_mask"], method=args.kl_adaptation_method, raw=raw, adapted=adapted,
                         beta=trainer.adaptive_kl.current_beta, clip=args.kl_clip_threshold, target=args.kl_target)


def stock_kl_by_hand(trainer: Any, inputs: dict) -> dict[str, Any]:
    """docs/metrics.md's Unsloth `kl`: the mean over completions (with a valid token) of each completion's token mean
    of its clamped k3, beside the token mean (TRL's) and the completions' lengths, which tell the two apart."""
    with torch.no_grad():
        logp = policy_logps(trainer.model, inputs)
    r = torch.clamp(inputs["ref_per_token_logps"] - logp, -20, 20)
    k, m = torch.clamp(torch.expm1(r) - r, -10, 10), inputs["completion_mask"].float()
    lengths = m.sum(-1)
    kept = lengths > 0
    return {"completion_mean": ((k * m).sum(-1)[kept] / lengths[kept]).mean().item(),
            "token_mean": ((k * m).sum() / m.sum()).item(), "lengths": lengths.tolist()}


def max_abs_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def max_abs(grads: list[torch.Tensor]) -> float:
    return max(g.abs().max().item() for g in grads)


def estimator_warnings(build: Any) -> tuple[Any, list[str]]:
    """What build() returns, and the KLEstimatorWarning messages it emitted (every one: filter 'always')."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        value = build()
    return value, [str(w.message) for w in caught if issubclass(w.category, unsloth_adaptive_kl.KLEstimatorWarning)]


def scenario_config(out: str) -> dict:
    args = trl.GRPOConfig(output_dir=out, use_cpu=True, kl_adaptation_method="dynamic+clip", kl_clip_threshold=0.5)
    guards = {}
    for label, fields in (("loss", {}), ("reward", {"kl_placement": "reward"}),
                          ("reward_k3", {"kl_placement": "reward", "kl_estimator": "k3"}),
                          ("loss_k1", {"kl_estimator": "k1"}), ("loss_k1_future", {"kl_estimator": "k1_future"})):
        built, messages = estimator_warnings(lambda: trl.GRPOConfig(output_dir=out, use_cpu=True, **fields))
        guards[label] = {"class": type(built).__name__, "estimator": built.estimator, "warnings": messages}
    restored = pickle.loads(pickle.dumps(args))
    try:
        trl.GRPOConfig(output_dir=out, use_cpu=True, kl_clip_threshold=-1.0)
        error = None
    except ValueError as caught:
        error = str(caught)
    unsloth_adaptive_kl.patch()  # again, once Unsloth generated its trainer: idempotent, not "imported after unsloth"
    # Unsloth's generation called again (PatchFastRL runs it for each model loaded; Unsloth answers "already patched"):
    # the hook's wrapper runs again on the same trainer, and the install must not hook it twice
    hook = unsloth_adaptive_kl.integrations.unsloth
    replaced, generated = len(hook._patches), sys.modules[trl.GRPOTrainer.__module__]
    rl._patch_trl_rl_trainers("grpo_trainer")
    # Unsloth's generated config masks truncated completions out for dapo unless told not to; the self-check's tiny
    # model seldom samples EOS, so its trainer says not to (else a batch can have no valid token)
    masks_truncated = {"unsloth_default": trl.GRPOConfig(output_dir=out, use_cpu=True,
                                                         loss_type="dapo").mask_truncated_completions,
                       "selfcheck": tiny_trainer(f"{out}/selfcheck").args.mask_truncated_completions}
    result = {
        "masks_truncated": masks_truncated,
        "stock_step": stock_step_bypass(trl.GRPOTrainer),
        "patched_again": unsloth_adaptive_kl.is_patched() and trl.GRPOTrainer.__name__ == "UnslothGRPOTrainer",
        "config_class": f"{type(args).__module__}.{type(args).__name__}", "config_mro": [c.__name__ for c in type(args).__mro__][:4],
        "trainer_class": trl.GRPOTrainer.__name__,
        "method": args.kl_adaptation_method, "threshold": args.kl_clip_threshold,
        "restored": [type(restored).__name__, restored.kl_adaptation_method, restored.kl_clip_threshold],
        "restored_same_class": type(restored) is type(args),
        "is_ours_subclassed": type(args) is not unsloth_adaptive_kl.GRPOConfig
        and issubclass(type(args), unsloth_adaptive_kl.GRPOConfig),
        "error": error, "guards": guards,
        "generated_again": {"loss": generated.UnslothEfficientGRPO.__qualname__,
                            "upstream": hook._AdaptiveEfficientGRPO.upstream.__qualname__,
                            "replacements_added": len(hook._patches) - replaced},
    }
    # unpatch() once Unsloth generated its trainer under the hooks: the generated config keeps the fields, which the
    # restored trainer no longer reads (said once), and patch() cannot hook that class again (said as such)
    # a wrapper set on a hooked method since (a user's or another library's, around ours): unpatch() leaves it
    trainer_class, hooked_step = trl.GRPOTrainer, trl.GRPOTrainer.prediction_step

    def users_prediction_step(self: Any, *args: Any, **kwargs: Any) -> Any:
        return hooked_step(self, *args, **kwargs)

    trainer_class.prediction_step = users_prediction_step
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        unsloth_adaptive_kl.unpatch()
        unsloth_adaptive_kl.unpatch()
    result["newer_kept"] = vars(trainer_class).get("prediction_step") is users_prediction_step
    result["unpatch_warnings"] = [str(w.message) for w in caught if "unpatch()" in str(w.message)]
    # the generated module's use_adapter, a copy of ours (taken from the patched TRL module when Unsloth generated it)
    result["use_adapter_after_unpatch"] = [generated.use_adapter is trl.trainer.utils.use_adapter,
                                           sys.modules["trl.trainer.grpo_trainer"].use_adapter
                                           is trl.trainer.utils.use_adapter]
    # trl's config names stay the config Unsloth generated (they were put back to TRL's own, beside Unsloth's trainer,
    # which then failed on a config without Unsloth's fields)
    result["trl_config_after_unpatch"] = [module.GRPOConfig is type(args) for module in (
        trl, trl.trainer, sys.modules["trl.trainer.grpo_trainer"], sys.modules["trl.trainer.grpo_config"])]
    try:
        unsloth_adaptive_kl.patch()
        result["patch_after_unpatch"] = None
    except ImportError as refused:
        result["patch_after_unpatch"] = str(refused)
    return result


def stock_step_bypass(trainer_class: type) -> dict:
    """Each name the integration replaced on the generated module and trainer class (its PatchSet's record), and
    those that are Unsloth's own object inside `stock_unsloth` and hooked again after it."""
    module, hook = sys.modules[trainer_class.__module__], unsloth_adaptive_kl.integrations.unsloth
    replaced = [(owner, name, original) for owner, name, original, _ in hook._patches._originals
                if owner is module or owner is trainer_class]
    from trl.trainer import utils as trl_utils

    from unsloth_adaptive_kl.integrations import patching, ref_sync

    def unsloths_own(owner: Any, name: str, original: Any) -> Any:
        if original is patching._MISSING:  # the generated class inherits it from Unsloth's _UnslothGRPOTrainer
            return next((vars(base)[name] for base in owner.__mro__[1:] if name in vars(base)), None)
        if original is ref_sync.use_reference:  # the module took TRL's name after this package patched TRL
            return trl_utils.use_adapter
        return original

    with stock_unsloth(object.__new__(trainer_class)):  # it reads the trainer's class only
        own = [name for owner, name, original in replaced if vars(owner).get(name) is unsloths_own(owner, name, original)]
    return {"replaced": sorted(name for _, name, _ in replaced), "unsloth_own_inside": sorted(own),
            "hooked_after": sorted(name for owner, name, original in replaced
                                   if vars(owner).get(name) is not unsloths_own(owner, name, original))}


def scenario_losses(out: str) -> dict:
    """Per loss_type: 'none' against stock Unsloth, and each method's KL part against the formula."""
    results: dict[str, Any] = {}
    for loss_type in ("grpo", "bnpo", "dr_grpo", "dapo"):
        trainer = make_trainer(f"{out}/{loss_type}", loss_type=loss_type, max_steps=1)
        inputs = capture_inputs(trainer)
        with torch.no_grad():  # a reference visibly different from the policy
            inputs["ref_per_token_logps"] = policy_logps(trainer.model, inputs) + torch.linspace(
                -1.5, 1.5, inputs["completion_ids"].numel()).view_as(inputs["completion_ids"])
        loss, grads = loss_and_grads(trainer, inputs)
        stock_loss, stock_grads = stock_loss_and_grads(trainer, inputs)
        entry: dict[str, Any] = {"none_loss": loss, "stock_loss": stock_loss,
                                 "none_grad_diff": max_abs_diff(grads, stock_grads),
                                 "stock_grad_max": max_abs(stock_grads), "stock_kl": trainer._metrics["train"]["kl"][-1]}
        entry["stock_magnitude"] = stock_magnitude(trainer, inputs)  # after the stock call's `kl` metric is read
        entry["stock_kl_by_hand"] = stock_kl_by_hand(trainer, inputs)
        trainer.beta = 0.0
        policy, policy_grads = loss_and_grads(trainer, inputs)
        trainer.beta = 0.04
        setups = [(method, method, "k3", "loss_type") for method in
                  ("none", "clip", "sigmoid", "length_normalized", "dynamic", "sigmoid+length_normalized+dynamic")]
        setups.append(("k2/sequence_sum", "clip", "k2", "sequence_sum"))
        setups.append(("user_three_k2", "none", "user_three_k2", "loss_type"))  # a user-registered estimator
        setups.append(("k1_future", "none", "k1_future", "loss_type"))  # the whole completion's KL gradient
        for label, method, estimator, reduction in setups:
            trainer.args.kl_adaptation_method, trainer.args.kl_estimator = method, estimator
            trainer.args.kl_reduction = reduction
            trainer.args.kl_clip_threshold, trainer.args.kl_target = 0.3, 0.2
            unsloth_adaptive_kl.integrations.trainer_hooks.attach_runtime(trainer)
            before = {key: len(values) for key, values in trainer._metrics["train"].items()}
            total, total_grads = loss_and_grads(trainer, inputs)
            kl_grads = [t - p for t, p in zip(total_grads, policy_grads)]
            expected = independent_kl_part(trainer, inputs)
            expected_grads = backward_grads(trainer, expected)
            entry[label] = {"kl_part": total - policy, "expected": expected.item(),
                             "grad_diff": max_abs_diff(kl_grads, expected_grads), "grad_max": max_abs(expected_grads),
                             "metric_product": trainer._metrics["train"]["adaptive_kl/current_beta"][-1]
                             * trainer._metrics["train"]["adaptive_kl/adapted_kl"][-1],
                             "kl_metric": trainer._metrics["train"]["kl"][-1]}
            if estimator == "k3" and reduction == "loss_type":  # every logged value and its definition
                entry[label]["metrics"] = {key: values[-1] for key, values in trainer._metrics["train"].items()
                                           if key.startswith("adaptive_kl/") and len(values) > before.get(key, 0)}
                entry[label]["expected_metrics"] = expected_metrics(trainer, inputs)
        results[loss_type] = entry
    return results


def scenario_dynamic(out: str) -> dict:
    import torch._dynamo.utils as dynamo_utils

    trainer = make_trainer(out, constant_reward, kl_adaptation_method="dynamic", dynamic_beta_decay=0.5,
                           beta_min=0.001, beta_schedule_steps=4, gradient_accumulation_steps=1, max_steps=6)
    graphs_after_step: list[int] = []

    class GraphCounter(TrainerCallback):
        def on_step_end(self, *_: Any, **__: Any) -> None:
            graphs_after_step.append(int(dynamo_utils.counters["stats"]["unique_graphs"]))

    trainer.add_callback(GraphCounter())
    trainer.train()
    result = {
        "betas": logged(trainer, "adaptive_kl/current_beta"), "final_beta": trainer.current_beta,
        "raw_kl": logged(trainer, "adaptive_kl/raw_kl"), "adapted_kl": logged(trainer, "adaptive_kl/adapted_kl"),
        "sequence_kl": logged(trainer, "adaptive_kl/sequence_kl"), "kl": logged(trainer, "kl"),
        "graphs_after_step": graphs_after_step, "step_seconds": trainer.step_timer.times,
        "trainer_class": type(trainer).__name__, "stock_beta": trainer.beta,
        "completed_steps": trainer.adaptive_kl.completed_steps,
        "loss_cache_entries": gpu_scenarios.loss_cache_entries(),  # before beta_recompiles compiles stock's too
    }
    # an evaluation of 4 batches feeds the controller nothing (Unsloth's generation puts the model back in training
    # mode: from its second batch on, model.training says training)
    trainer.evaluate(Dataset.from_dict({"prompt": list(PROMPTS)[:4]}))
    result["evaluated"] = {"final_beta": trainer.current_beta, "completed_steps": trainer.adaptive_kl.completed_steps}
    return {**result, **beta_recompiles(trainer, out)}


def beta_recompiles(trainer: Any, out: str) -> dict:
    """Compiled graphs after each loss call on fixed inputs while beta changes: through the hooks (live beta is
    not an input of the compiled region) and through stock Unsloth (beta is a Python float there)."""
    import torch._dynamo.utils as dynamo_utils

    def graphs() -> int:
        return int(dynamo_utils.counters["stats"]["unique_graphs"])

    inputs = capture_inputs(make_trainer(out + "/capture", kl_adaptation_method="dynamic", max_steps=1))
    hooked = []
    for beta in (0.04, 0.03, 0.02, 0.01):
        trainer.adaptive_kl.controller.value = beta
        loss_and_grads(trainer, inputs)
        hooked.append(graphs())
    stock = []
    with stock_unsloth(trainer):
        for beta in (0.04, 0.03, 0.02):
            trainer.beta = beta
            loss_and_grads(trainer, inputs)
            stock.append(graphs())
    trainer.beta = 0.04
    return {"graphs_hooked_beta_changes": hooked, "graphs_stock_beta_changes": stock}


def scenario_timing(out: str) -> dict:
    """Per variant (stock Unsloth with the hooks bypassed, and each method), interleaved over repeats with the same
    seed, after one untimed warm-up pass (first compiles): median seconds per optimizer step after the first, model
    forwards per step, and compiled graphs added during a run (recompiles; `dynamic` changes beta every step)."""
    import torch._dynamo.utils as dynamo_utils

    variants = ["stock", "none", "clip", "length_normalized", "dynamic"]
    results: dict[str, dict[str, list]] = {v: {"step_s": [], "forwards": [], "graphs_added": []} for v in variants}
    for repeat in range(1 + int(os.environ.get("ADAPTIVE_KL_BENCH_REPEATS", "3"))):
        for variant in variants[repeat % len(variants):] + variants[: repeat % len(variants)]:
            overrides = {} if variant == "stock" else {"kl_adaptation_method": variant, "reward_threshold": 0.0}
            trainer = make_trainer(f"{out}/{variant}{repeat}", max_steps=6, gradient_accumulation_steps=1,
                                   generation_kwargs={"min_new_tokens": 8}, **overrides)
            forwards, graphs = [0], [int(dynamo_utils.counters["stats"]["unique_graphs"])]
            trainer.model.get_base_model().register_forward_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))

            class Counter(TrainerCallback):
                def on_step_begin(self, *_: Any, **__: Any) -> None:
                    self.forwards = forwards[0]

                def on_step_end(self, *_: Any, **__: Any) -> None:
                    results[variant]["forwards"].append(forwards[0] - self.forwards)
                    graphs.append(int(dynamo_utils.counters["stats"]["unique_graphs"]))

            trainer.add_callback(Counter())
            with stock_unsloth(trainer) if variant == "stock" else contextlib.nullcontext():
                trainer.train()
            if repeat == 0:  # warm-up: compiles each variant's graphs once
                results[variant]["forwards"].clear()
                continue
            results[variant]["step_s"].extend(trainer.step_timer.times[1:])
            results[variant]["graphs_added"].append(graphs[-1] - graphs[0])
    return {variant: {"median_step_s": sorted(r["step_s"])[len(r["step_s"]) // 2],
                      "forwards_per_step": sorted(set(r["forwards"])),
                      "graphs_added_per_run": max(r["graphs_added"])} for variant, r in results.items()}


NO_OP_ADAPTATIONS = {
    # kl_clip_threshold above every per-token KL (unsloth_zoo caps it at 10, times an importance ratio <= e^0.3)
    "clip_above_every_kl": dict(kl_adaptation_method="clip", kl_clip_threshold=1e3),
    "dynamic_before_decay": dict(kl_adaptation_method="dynamic"),
}
# The kl_reduction that equals each loss_type's own reduction, where one exists for the installed version.
SAME_REDUCTION = {"grpo": "sequence_mean", "bnpo": "token_mean"}


def drift_inputs(trainer: Any, inputs: dict, off_policy: bool) -> dict:
    """Per-token log ratios ref - logp from -25 to 25 (so the [-20, 20] log-ratio clamp and the [-10, 10] KL clamp
    both act), and off-policy old log-probs 0.3 away from the policy's (importance ratios e^-0.3 to e^0.3)."""
    inputs = dict(inputs)
    with torch.no_grad():
        logp = policy_logps(trainer.model, inputs)
    ids = inputs["completion_ids"]
    inputs["ref_per_token_logps"] = logp + torch.linspace(-25.0, 25.0, ids.numel()).view_as(ids)
    if off_policy:
        inputs["old_per_token_logps"] = logp + torch.linspace(0.3, -0.3, ids.numel()).view_as(ids)
    return inputs


def scenario_drift(out: str) -> dict:
    """Adaptations that change nothing, through the hooked loss (the compiled loss with beta=0.0 plus the adapted
    term), against stock Unsloth's loss and gradients (the compiled loss with beta): every loss_type, on-policy and
    off-policy (num_iterations=2, so the importance ratio is not 1)."""
    results: dict[str, Any] = {"bnpo_rule": unsloth_adaptive_kl.integrations.unsloth._AdaptiveEfficientGRPO.bnpo_rule}
    for loss_type in ("grpo", "bnpo", "dr_grpo", "dapo"):
        for off_policy in (False, True):
            trainer = make_trainer(f"{out}/{loss_type}{off_policy}", loss_type=loss_type, max_steps=1,
                                   num_iterations=2 if off_policy else 1)
            inputs = drift_inputs(trainer, capture_inputs(trainer), off_policy)
            assert ("old_per_token_logps" in inputs) == off_policy
            stock_loss, stock_grads = stock_loss_and_grads(trainer, inputs)
            adaptations = dict(NO_OP_ADAPTATIONS)
            if loss_type in SAME_REDUCTION and not (loss_type == "bnpo" and results["bnpo_rule"] == "global"):
                adaptations["same_reduction"] = dict(kl_reduction=SAME_REDUCTION[loss_type])
            entry: dict[str, Any] = {"stock_loss": stock_loss, "stock_magnitude": stock_magnitude(trainer, inputs),
                                     "stock_grad_max": max_abs(stock_grads)}
            for label, settings in adaptations.items():
                for name, value in {"kl_adaptation_method": "none", "kl_reduction": "loss_type", **settings}.items():
                    setattr(trainer.args, name, value)
                unsloth_adaptive_kl.integrations.trainer_hooks.attach_runtime(trainer)
                loss, grads = loss_and_grads(trainer, inputs)
                entry[label] = {"loss": loss, "grad_diff": max_abs_diff(grads, stock_grads),
                                "max_kl": float(trainer._metrics["train"]["adaptive_kl/raw_kl"][-1])}
            results[f"{loss_type}/{'off' if off_policy else 'on'}_policy"] = entry
    results["rejected_tokens"] = rejected_tokens_drift(out)
    return results


def beside_stock(trainer: Any, inputs: dict, stock_grads: list[torch.Tensor], policy: float) -> dict[str, Any]:
    """`none` and the no-op adaptations through the hooked loss: each one's loss and its gradients' largest difference
    from stock Unsloth's (`stock_grads`); and clip's KL part (its loss minus `policy`, the loss at beta 0) beside the
    formula's."""
    entry: dict[str, Any] = {}
    for label, settings in {"none": {}, **NO_OP_ADAPTATIONS}.items():
        for name, value in {"kl_adaptation_method": "none", **settings}.items():
            setattr(trainer.args, name, value)
        unsloth_adaptive_kl.integrations.trainer_hooks.attach_runtime(trainer)
        loss, grads = loss_and_grads(trainer, inputs)
        entry[label] = {"loss": loss, "grad_diff": max_abs_diff(grads, stock_grads)}
    trainer.args.kl_adaptation_method, trainer.args.kl_clip_threshold = "clip", 0.3
    unsloth_adaptive_kl.integrations.trainer_hooks.attach_runtime(trainer)
    total, _ = loss_and_grads(trainer, inputs)
    entry["clip"] = {"kl_part": total - policy, "expected": independent_kl_part(trainer, inputs).item()}
    return entry


def scenario_policy_masks(out: str) -> dict:
    """What Unsloth applies to the policy term alone, beside an adapted KL: a fixed entropy_coef (grpo_accumulated_loss
    adds -entropy_coef * the entropy mean after the compiled loss this package hooks), the entropy mask
    (top_entropy_quantile) and the off-policy sequence mask (off_policy_mask_threshold 0.1; num_iterations=2), both
    of which the compiled loss multiplies the policy term by. No-op adaptations against stock Unsloth's loss
    and gradients with all three, and clip's KL part (total - the loss at beta 0, bonus and masks in both) against
    the formula over every valid token."""
    results: dict[str, Any] = {}
    for loss_type in ("grpo", "dapo"):
        trainer = make_trainer(f"{out}/{loss_type}", loss_type=loss_type, max_steps=1, entropy_coef=0.05,
                               top_entropy_quantile=0.5, off_policy_mask_threshold=0.1, num_iterations=2)
        inputs = capture_inputs(trainer)
        with torch.no_grad():  # a reference visibly different from the policy, as in scenario_losses
            logp = policy_logps(trainer.model, inputs)
        inputs["ref_per_token_logps"] = logp + torch.linspace(
            -1.5, 1.5, inputs["completion_ids"].numel()).view_as(inputs["completion_ids"])
        # two completions with a negative advantage, whose old log-probs sit 0.3 above the policy's (> the threshold:
        # they leave the policy term), and two with a positive one, whose old log-probs are the policy's
        inputs["advantages"] = torch.tensor([-0.9, 0.6, -0.3, 0.6]).to(inputs["advantages"])
        inputs["old_per_token_logps"] = logp + 0.3 * (inputs["advantages"] < 0).unsqueeze(-1)
        stock_loss, stock_grads = stock_loss_and_grads(trainer, inputs)
        trainer.entropy_coef = 0.0  # TRL's trainer holds the coefficient it was built with; Unsloth's loss reads it
        without_bonus, _ = stock_loss_and_grads(trainer, inputs)
        # the policy and KL terms' magnitude, every completion's (the bonus is one scalar added after): with every
        # advantage -|A| the off-policy mask would drop other completions than it does in the loss
        trainer.args.off_policy_mask_threshold = None
        magnitude = stock_magnitude(trainer, inputs)
        trainer.args.off_policy_mask_threshold = 0.1
        trainer.entropy_coef = 0.05
        trainer.beta = 0.0
        policy, _ = loss_and_grads(trainer, inputs)  # the policy term and the bonus
        without = {}  # the policy term without one mask or both, so that each is seen to act alone
        for label, quantile, threshold in (("entropy_mask", 1.0, 0.1), ("off_policy_mask", 0.5, None),
                                           ("masks", 1.0, None)):
            trainer.args.top_entropy_quantile, trainer.args.off_policy_mask_threshold = quantile, threshold
            without[label], _ = loss_and_grads(trainer, inputs)
        trainer.args.top_entropy_quantile, trainer.args.off_policy_mask_threshold = 0.5, 0.1
        trainer.beta = 0.04
        results[loss_type] = {"stock_loss": stock_loss, "stock_without_bonus": without_bonus, "policy": policy,
                              "policy_without": without, "stock_magnitude": magnitude,
                              "stock_grad_max": max_abs(stock_grads),
                              **beside_stock(trainer, inputs, stock_grads, policy)}
    return results


# The vLLM importance-sampling modes the scenario below takes: TRL's default, and a per-token one.
VLLM_IS_MODES = ("sequence_mask", "token_truncate")


def scenario_vllm_is_ratio(out: str) -> dict:
    """vLLM's importance-sampling correction (`vllm_importance_sampling_correction`, TRL's default): grpo_compute_loss
    takes the ratio of the old policy to vLLM's sampling log-probs and multiplies the policy term alone by it. vLLM
    cannot run on a CPU: the trainer is told it generated with vLLM (`use_vllm`) and the batch carries sampling
    log-probs where vLLM's generation step writes them. Per mode: the policy term with and without the ratio, no-op
    adaptations against stock Unsloth's loss and gradients, and clip's KL part against the formula (no ratio in it)."""
    results: dict[str, Any] = {}
    for loss_type in ("grpo", "dapo"):
        trainer = make_trainer(f"{out}/{loss_type}", loss_type=loss_type, max_steps=1, num_iterations=2)
        inputs = capture_inputs(trainer)
        ids = inputs["completion_ids"]
        with torch.no_grad():
            logp = policy_logps(trainer.model, inputs)
        inputs["ref_per_token_logps"] = logp + torch.linspace(-1.5, 1.5, ids.numel()).view_as(ids)
        inputs["old_per_token_logps"] = logp
        # per-token log ratios old - sampling from -0.15 to 0.15: every completion's sum within (log 0.5, log 3), the
        # sequence_mask bounds, and every token's within token_truncate's
        inputs["sampling_per_token_logps"] = logp - torch.linspace(-0.15, 0.15, ids.numel()).view_as(ids)
        inputs["advantages"] = torch.tensor([-0.9, 0.6, -0.3, 0.6]).to(inputs["advantages"])  # both signs
        # a trainer built without vLLM has the correction off, whatever the config says
        trainer.use_vllm = trainer.vllm_importance_sampling_correction = True
        for mode in VLLM_IS_MODES:
            trainer.args.vllm_importance_sampling_mode = mode
            trainer.args.kl_adaptation_method = "none"
            unsloth_adaptive_kl.integrations.trainer_hooks.attach_runtime(trainer)
            stock_loss, stock_grads = stock_loss_and_grads(trainer, inputs)
            trainer.beta = 0.0
            policy, _ = loss_and_grads(trainer, inputs)
            trainer.vllm_importance_sampling_correction = False
            unweighted_policy, _ = loss_and_grads(trainer, inputs)
            trainer.vllm_importance_sampling_correction, trainer.beta = True, 0.04
            results[f"{loss_type}/{mode}"] = {
                "stock_loss": stock_loss, "policy": policy, "unweighted_policy": unweighted_policy,
                "stock_magnitude": stock_magnitude(trainer, inputs), "stock_grad_max": max_abs(stock_grads),
                **beside_stock(trainer, inputs, stock_grads, policy)}
    return results


def rejected_tokens_drift(out: str) -> dict:
    """unsloth_zoo's rollout rejection (UNSLOTH_GRPO_ROLLOUT_RS, reached with vLLM or rollout log-probs as old):
    the hooked loss against the stock compiled loss, called directly with one real micro-batch's arguments plus
    `rollout_rs` and `rollout_logps_as_old`, which reject about half of the tokens."""
    shim = unsloth_adaptive_kl.integrations.unsloth._AdaptiveEfficientGRPO
    trainer = make_trainer(f"{out}/rs", loss_type="grpo", max_steps=1, num_iterations=2,
                           kl_adaptation_method="clip", kl_clip_threshold=1e3)
    recorded: list = []
    apply = shim.apply

    def record(*args):
        recorded.append(args)
        return apply(*args)

    shim.apply = record
    try:
        capture_inputs(trainer)  # one training step, through the shim
    finally:
        shim.apply = apply
    new, old, ref, sampling, lm_head, input_ids, mask, advantages, beta, scaler, n_chunks, kwargs, scale = recorded[0]
    rejecting = {**kwargs, "rollout_rs": [("token_k3", None, 0.01)], "rollout_logps_as_old": True}
    new = new.detach()
    old = new + torch.linspace(0.3, -0.3, new.numel()).view_as(new)
    ref = new + torch.linspace(-25.0, 25.0, new.numel()).view_as(new)
    with torch.no_grad():  # the magnitude of the stock loss's terms (stock_magnitude's, on this direct call)
        magnitude_args = (new, old, ref, sampling, lm_head, input_ids, mask, -advantages.abs(), beta, scaler, n_chunks,
                          rejecting, scale)
        results: dict[str, Any] = {"stock_magnitude": shim.upstream.apply(*magnitude_args)[0].item()}
    for label in ("stock", "hooked", "stock_without_rejection"):
        leaf = new.clone().requires_grad_(True)
        options = kwargs if label == "stock_without_rejection" else rejecting
        args = (leaf, old, ref, sampling, lm_head, input_ids, mask, advantages, beta, scaler, n_chunks, options, scale)
        if label != "hooked":
            loss = shim.upstream.apply(*args)[0]
        else:
            token = unsloth_adaptive_kl.integrations.unsloth._ACTIVE.set((trainer, []))
            try:
                loss = shim.apply(*args)[0]
            finally:
                unsloth_adaptive_kl.integrations.unsloth._ACTIVE.reset(token)
        loss.backward()
        results[label] = {"loss": loss.item(), "grad": leaf.grad.flatten().tolist()}
    log_ratio = torch.clamp(new - old, -20, 20)
    results["rejected_tokens_leave_kl"] = shim.rejected_tokens_leave_kl
    results["rejected_fraction"] = float(((torch.expm1(log_ratio) - log_ratio) > 0.01)[mask.bool()].float().mean())
    return results


def trainer_policy_logps(trainer: Any, batch: dict) -> torch.Tensor:
    """The policy's log-probs by the generated trainer's own forward, in its own (left-packed) layout."""
    input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    attention = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    return trainer._get_per_token_logps_and_entropies(trainer.model, input_ids, attention, batch["completion_ids"].size(1),
                                                      batch_size=input_ids.size(0))[0]


def scenario_reward(out: str) -> dict:
    """kl_placement='reward' in the generated trainer: the first batch's advantages against the formula (scale_rewards
    group and batch), the loss without its KL term, a short dynamic run, and its resume from a checkpoint."""
    results: dict[str, Any] = {}
    # group and batch with the reward placement's default estimator (k1); group_k3 with k3 named (it warns)
    for label, scale_rewards, estimator in (("group", "group", None), ("batch", "batch", None),
                                            ("group_k3", "group", "k3")):
        rewards: list[float] = []
        trainer, messages = estimator_warnings(lambda: make_trainer(
            f"{out}/{label}", recording(hash_reward, rewards), per_device_train_batch_size=8,
            gradient_accumulation_steps=1, max_steps=1, beta=0.5, scale_rewards=scale_rewards, kl_placement="reward",
            kl_reduction="sequence_sum", kl_estimator=estimator))
        perturb_adapters(trainer.model)
        batch = scored_batch(trainer, trainer_policy_logps)
        r = torch.tensor(rewards[:8], dtype=torch.float64)
        kl = completion_kl_by_hand(batch["policy_logps"], batch["ref_per_token_logps"], batch["completion_mask"],
                                   "sequence_sum", estimator or "k1")
        other = completion_kl_by_hand(batch["policy_logps"], batch["ref_per_token_logps"], batch["completion_mask"],
                                      "sequence_sum", "k1" if estimator else "k3")
        inputs = {key: value for key, value in batch.items() if key != "policy_logps"}
        inputs["num_items_in_batch"] = inputs["completion_mask"].sum()
        loss, _ = loss_and_grads(trainer, inputs)
        trainer.beta = 0.0
        loss_without_kl, _ = loss_and_grads(trainer, inputs)
        results[label] = {
            "advantages": batch["advantages"].tolist(), "estimator": trainer.adaptive_kl.config.estimator,
            "estimator_warnings": messages,
            "expected": expected_advantages(r, kl, 0.5, 4, scale_rewards).tolist(),
            "other_estimator": expected_advantages(r, other, 0.5, 4, scale_rewards).tolist(),
            "unpenalised": expected_advantages(r, torch.zeros_like(kl), 0.5, 4, scale_rewards).tolist(),
            "kl": kl.tolist(), "rewards": r.tolist(),
            "penalty_metric": logged(trainer, "adaptive_kl/reward_penalty"), "reward_metric": logged(trainer, "reward"),
            "loss": loss, "loss_without_kl": loss_without_kl, "kl_metric": logged(trainer, "kl"),
        }
    trainer = make_trainer(f"{out}/dynamic", constant_reward, gradient_accumulation_steps=1, max_steps=3, beta=1.0,
                           kl_placement="reward", kl_reduction="sequence_sum", kl_adaptation_method="dynamic",
                           dynamic_beta_decay=0.5)
    perturb_adapters(trainer.model)
    trainer.train()
    results["dynamic"] = {"betas": logged(trainer, "adaptive_kl/current_beta"), "final_beta": trainer.current_beta,
                          "penalties": logged(trainer, "adaptive_kl/reward_penalty"),
                          "sequence_kl": logged(trainer, "adaptive_kl/sequence_kl"), "reward": logged(trainer, "reward"),
                          "trainer_class": type(trainer).__name__}
    # the same run evaluated after every step: the evaluations score with the penalty and feed the controller nothing
    evaluated = make_trainer(f"{out}/evaluated", constant_reward, gradient_accumulation_steps=1, max_steps=3, beta=1.0,
                             kl_placement="reward", kl_reduction="sequence_sum", kl_adaptation_method="dynamic",
                             dynamic_beta_decay=0.5, per_device_eval_batch_size=4)
    perturb_adapters(evaluated.model)
    evaluated.eval_dataset = Dataset.from_dict({"prompt": list(PROMPTS)[:4]})
    evaluated.args.eval_strategy, evaluated.args.eval_steps = IntervalStrategy.STEPS, 1
    evaluated.train()
    results["evaluated"] = {"final_beta": evaluated.current_beta,
                            "completed_steps": evaluated.adaptive_kl.completed_steps,
                            "evaluations": sum("eval_loss" in entry for entry in evaluated.state.log_history)}
    # The controller moves once per optimizer step (two micro-batches each), from the batch scored for that step.
    trainer = make_trainer(f"{out}/counting", gradient_accumulation_steps=2, max_steps=3, beta=0.1,
                           kl_placement="reward", kl_adaptation_method="test_counting_beta")
    trainer.train()
    results["counting"] = {"calls": trainer.adaptive_kl.controller.calls,
                           "completions": trainer.adaptive_kl.controller.completions,
                           "per_device_train_batch_size": trainer.args.per_device_train_batch_size}
    # Resume: beta comes back from the checkpoint (the generated trainer's own save/load, hooked).
    settings = dict(gradient_accumulation_steps=1, max_steps=4, beta=1.0, kl_placement="reward",
                    kl_reduction="sequence_sum", kl_adaptation_method="dynamic", dynamic_beta_decay=0.5,
                    save_strategy="steps", save_steps=2)
    full = make_trainer(f"{out}/full", constant_reward, **settings)
    full.train()
    with open(f"{out}/full/checkpoint-2/adaptive_kl_state.json") as f:
        saved = json.load(f)
    resumed = make_trainer(f"{out}/resumed", constant_reward, **settings)
    resumed.train(resume_from_checkpoint=f"{out}/full/checkpoint-2")
    results["resume"] = {"saved_beta": saved["value"], "full_final": full.current_beta,
                         "resumed_betas": logged(resumed, "adaptive_kl/current_beta"),
                         "resumed_final": resumed.current_beta, "trainer_class": type(resumed).__name__}
    return results


def trainer_logps(trainer: Any, values: list[torch.Tensor], output: dict) -> torch.Tensor:
    """The trainer's own log-probs of a generated batch (in its layout) under the policy with its trainable tensors set to
    `values` by hand."""
    from tests.test_ref_sync import trainable_set_to

    ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)
    mask = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
    with torch.no_grad(), trainable_set_to(trainer.model, values):
        return trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, output["completion_ids"].size(1),
                                                          batch_size=ids.size(0))[0]


def scenario_ref_sync(out: str) -> dict:
    """Reference syncing in the generated trainer (16-bit base; its PEFT model has no "ref" adapter): a hard sync after
    steps 2 and 4 against no syncing, an alpha = 0.5 mix checked on the tensors, one generation after a sync (its
    reference log-probs, and the policy's weights, gradients and optimizer state around it), and a resume after a sync."""
    from tests.test_ref_sync import AfterSync

    hard = dict(sync_ref_model=True, ref_model_sync_steps=2, ref_model_mixup_alpha=1.0, max_steps=5)
    synced = make_trainer(f"{out}/synced", **hard)
    synced.train()
    stock = make_trainer(f"{out}/stock", max_steps=5)
    stock.train()
    results: dict[str, Any] = {"floor": {
        "trainer_class": type(synced).__name__, "has_ref_adapter": "ref" in synced.model.peft_config,
        "synced_raw": logged(synced, "adaptive_kl/raw_kl"), "stock_raw": logged(stock, "adaptive_kl/raw_kl"),
        "syncs": logged(synced, "adaptive_kl/ref_syncs"), "stock_syncs": logged(stock, "adaptive_kl/ref_syncs")}}

    mixed = make_trainer(f"{out}/mix", max_steps=3, sync_ref_model=True, ref_model_sync_steps=1, ref_model_mixup_alpha=0.5)
    recorder = AfterSync(mixed)
    mixed.add_callback(recorder)
    mixed.train()
    reference = mixed.adaptive_kl_reference.reference
    previous, exact = recorder.initial, []
    for step in recorder.steps:
        exact.append(all(torch.equal(0.5 * p + 0.5 * r, s) for p, r, s in zip(step["policy"], previous, step["reference"])))
        previous = step["reference"]
    results["mix"] = {"names": reference.names, "exact": exact,
                      "initial_is_policy": all(torch.equal(r, p) for r, p in zip(recorder.initial, recorder.initial_policy)),
                      "policy_reference_gap": max((p - r).abs().max().item() for p, r in zip(reference.policy, reference.tensors))}

    policy = reference.policy
    for p in policy:
        p.grad = torch.randn_like(p)
    weights, grads = [p.detach().clone() for p in policy], [p.grad.clone() for p in policy]
    optimizer_state = {k: {n: v.clone() for n, v in s.items()} for k, s in mixed.optimizer.state_dict()["state"].items()}
    mixed.model.train()
    output = mixed._generate_and_score_completions([{"prompt": prompt} for prompt in PROMPTS[:4]])
    state = mixed.optimizer.state_dict()["state"]
    ref_logps = output["ref_per_token_logps"]
    results["forward"] = {
        "weights_kept": all(torch.equal(a, p) for a, p in zip(weights, policy)),
        "grads_kept": all(torch.equal(a, p.grad) for a, p in zip(grads, policy)),
        "optimizer_kept": bool(state) and all(torch.equal(state[k][n], v) for k, s in optimizer_state.items() for n, v in s.items()),
        "gap_to_reference": (ref_logps - trainer_logps(mixed, reference.tensors, output)).abs().max().item(),
        "gap_to_policy": (ref_logps - trainer_logps(mixed, weights, output)).abs().max().item(),
    }

    settings = dict(max_steps=6, save_strategy="steps", save_steps=3, sync_ref_model=True, ref_model_sync_steps=2,
                    ref_model_mixup_alpha=0.5)
    full = make_trainer(f"{out}/full", **settings)
    full.train()
    resumed = make_trainer(f"{out}/resumed", **settings)
    resumed.train(resume_from_checkpoint=f"{out}/full/checkpoint-3")
    names = ("loss", "reward", "adaptive_kl/raw_kl", "adaptive_kl/ref_syncs")
    results["resume"] = {"full": {n: logged(full, n) for n in names}, "resumed": {n: logged(resumed, n) for n in names}}
    return results


def scenario_hook_failure(out: str) -> dict:
    """After this package's hook failed inside Unsloth's generation (above): what Unsloth logged, what the generated
    module's loss is, and what each setting gets when its trainer is built."""
    hook = unsloth_adaptive_kl.integrations.unsloth
    module = sys.modules[trl.GRPOTrainer.__module__]
    results: dict[str, Any] = {
        "trainer_class": trl.GRPOTrainer.__name__, "unsloth_log": UNSLOTH_LOG.messages,
        "efficient_grpo": module.UnslothEfficientGRPO.__qualname__,
        "hooked_methods": [name for name in ("compute_loss", "_generate_and_score_completions", "_save_checkpoint")
                           if hook._patches.replaced(trl.GRPOTrainer, name)],
    }
    adaptive = {"clip": dict(kl_adaptation_method="clip"), "dynamic": dict(kl_adaptation_method="dynamic"),
                "kl_in_reward": dict(kl_placement="reward"), "k2": dict(kl_estimator="k2"),
                "ref_sync": dict(sync_ref_model=True)}
    for label, settings in adaptive.items():
        try:
            make_trainer(f"{out}/{label}", max_steps=1, **settings)
        except Exception as error:
            results[label] = {"type": type(error).__name__, "message": str(error),
                              "notes": getattr(error, "__notes__", [])}
        else:
            results[label] = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = make_trainer(f"{out}/none", max_steps=1)
    trainer.train()
    results["none"] = {"warnings": [str(w.message) for w in caught if "without unsloth_adaptive_kl" in str(w.message)],
                       "has_adaptive_kl": hasattr(trainer, "adaptive_kl"), "steps": trainer.state.global_step,
                       "logged": sorted({key for entry in trainer.state.log_history for key in entry})}
    results["midway"] = failure_midway(out)
    return results


def failure_midway(out: str) -> dict:
    """Unsloth's generation called again (Unsloth: "already patched"), now with every anchor found and a hook that
    fails midway through the install, once it replaced the loss, the config's methods and four of the trainer's: what
    the hook holds replaced afterwards, what the generated module's loss is, and what `clip` gets at construction."""
    from unsloth_adaptive_kl.integrations import versions

    hook = unsloth_adaptive_kl.integrations.unsloth
    module = sys.modules[trl.GRPOTrainer.__module__]

    def failing(upstream: Any) -> Any:
        raise RuntimeError("the _save_checkpoint hook failed")

    hook.UNSLOTH_ANCHORS, wrap_save_checkpoint, hook.wrap_save_checkpoint = (versions.UNSLOTH_ANCHORS,
                                                                             hook.wrap_save_checkpoint, failing)
    try:
        rl._patch_trl_rl_trainers("grpo_trainer")
    except RuntimeError as error:
        raised = str(error)
    else:
        raised = None
    finally:
        hook.wrap_save_checkpoint = wrap_save_checkpoint
    try:
        make_trainer(f"{out}/midway", max_steps=1, kl_adaptation_method="clip")
    except Exception as error:
        clip = str(error)
    else:
        clip = None
    return {"raised": raised, "clip": clip, "efficient_grpo": module.UnslothEfficientGRPO.__qualname__,
            "replaced": [(owner.__name__, name) for owner, name, _, _ in hook._patches._originals]}


def scenario_settings(out: str) -> dict:
    """What Unsloth's generated config makes of what the user set (the warnings for explicit fields it changed, the
    values in effect), and the KL settings line one trainer logs at construction (nothing is trained)."""
    configs = {"dr_grpo_group": dict(loss_type="dr_grpo", scale_rewards="group", beta=0.04),
               "dr_grpo_true": dict(loss_type="dr_grpo", scale_rewards=True, beta=0.04),
               "dr_grpo_unset": dict(loss_type="dr_grpo", beta=0.04),
               "dr_grpo_none": dict(loss_type="dr_grpo", scale_rewards=None, beta=0.04),
               "grpo_beta_unset": dict(loss_type="grpo"),
               "dapo_explicit": dict(loss_type="dapo", beta=0.04),
               "sequence_clip": dict(loss_type="grpo", beta=0.04, importance_sampling_level="sequence",
                                     kl_adaptation_method="clip"),
               "adamw_flash": dict(loss_type="grpo", beta=0.04, optim="adamw_flash"),
               "adamw_flash_spelled": dict(loss_type="grpo", beta=0.04, optim=" AdamW_Flash ")}
    results: dict[str, Any] = {}
    for label, fields in configs.items():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                args = trl.GRPOConfig(output_dir=out, use_cpu=True, **fields)
            except ValueError as error:
                results[label] = {"error": str(error)}
                continue
        results[label] = {
            "warnings": [str(w.message) for w in caught if "Unsloth's generated" in str(w.message)],
            # each warning shown at the line that built the config (this file's), not inside the package
            "warned_here": [w.filename == __file__ for w in caught if "Unsloth's generated" in str(w.message)],
            "in_effect": {name: getattr(args, name) for name in ("beta", "scale_rewards", "mask_truncated_completions",
                                                                 "epsilon_high", "vllm_importance_sampling_correction")},
            "unsloth_defaults": getattr(args, UNSLOTH_DEFAULTS),
            "flash_marked": getattr(args, "_unsloth_flash_adamw", False),
        }
    printed = io.StringIO()  # an adapted setting prints its line, where a user looks
    with contextlib.redirect_stdout(printed):
        make_trainer(f"{out}/trainer", unset=("beta", "learning_rate", "seed", "warmup_steps", "optim"), loss_type="grpo",
                     kl_adaptation_method="clip")
    results["settings_lines"] = [line for line in printed.getvalue().splitlines()
                                 if line.startswith("adaptive_kl: KL settings")]
    return results


def scenario_pad_is_eos(out: str) -> dict:
    """The mask Unsloth's loss receives, on one step's batch, with pad = EOS (the KL lab's tokenizer) and with a pad
    token of its own, and the warnings each trainer's construction gives."""
    from unsloth_adaptive_kl.integrations import unsloth as hook

    results: dict[str, Any] = {}
    try:  # an adapted KL is refused at construction where pad = EOS
        make_trainer(f"{out}/refused", tokenizer=build_tokenizer("ab", pad_is_eos=True), prompts=("aab", "abb"),
                     kl_adaptation_method="clip")
    except ValueError as error:
        results["refused"] = str(error)
    upstream = hook._AdaptiveEfficientGRPO.apply.__func__
    for label, tokenizer, prompts in (("pad_is_eos", build_tokenizer("ab", pad_is_eos=True), ("aab", "abb")),
                                      ("own_pad", build_tokenizer("ab"), ("aab", "abb"))):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer = make_trainer(f"{out}/{label}", tokenizer=tokenizer, prompts=prompts, max_steps=1,
                                   gradient_accumulation_steps=1, max_completion_length=4)
        seen: list[tuple[list, list]] = []

        def apply(cls: Any, new: Any, old: Any, ref: Any, sampling: Any, lm_head: Any, input_ids: Any, mask: Any,
                  *args: Any, **kwargs: Any) -> Any:
            seen.append((input_ids.tolist(), mask.tolist()))
            return upstream(cls, new, old, ref, sampling, lm_head, input_ids, mask, *args, **kwargs)

        hook._AdaptiveEfficientGRPO.apply = classmethod(apply)
        try:
            trainer.train()
        finally:
            hook._AdaptiveEfficientGRPO.apply = classmethod(upstream)
        ids, mask = seen[0]
        first_eos = [row.index(tokenizer.eos_token_id) for row in ids if tokenizer.eos_token_id in row]
        results[label] = {
            "warnings": [str(w.message) for w in caught if "pad_token_id=" in str(w.message)],
            "eos_completions": len(first_eos),
            "eos_in_mask": sum(mask[r][t] for r, t in zip(
                [r for r, row in enumerate(ids) if tokenizer.eos_token_id in row], first_eos)),
            "letters_in_mask": sum(m for row, row_mask in zip(ids, mask) for token, m in zip(row, row_mask)
                                   if token != tokenizer.eos_token_id and token != tokenizer.pad_token_id),
            "letters": sum(1 for row in ids for token in row[:row.index(tokenizer.eos_token_id)
                                                             if tokenizer.eos_token_id in row else len(row)]),
        }
    return results


def logged_adaptive_metrics(trainer: Any) -> list[str]:
    """The adaptive_kl/* names the trainer logged (its log history: `_metrics` is emptied at each log)."""
    return sorted({key for entry in trainer.state.log_history for key in entry if key.startswith("adaptive_kl/")})


def scenario_sample_weights(out: str) -> dict:
    """UNSLOTH_GRPO_ZERO_VARIANCE_EXCLUDE=1 with dapo (Unsloth weights each completion of the loss): an adapted KL is
    refused at construction; `none` warns, trains a step, and on that step's batch (weights included) gives stock
    Unsloth's loss and gradients. With grpo, which Unsloth does not weight under exclusion alone, `clip` is built
    without a word of ours, trains a step on unweighted batches and logs its metrics. Before all that: a `clip` trainer
    built before the variable is set, trained after; and `clip` with beta = 0 built with it set."""
    results: dict[str, Any] = {}
    # built before the variable is set: Unsloth reads it when each batch is generated, so the loss meets the weights
    late = make_trainer(f"{out}/late", kl_adaptation_method="clip", max_steps=1)
    os.environ["UNSLOTH_GRPO_ZERO_VARIANCE_EXCLUDE"] = "1"
    try:
        late.train()
    except NotImplementedError as error:
        results["set_late"] = str(error)
    with warnings.catch_warnings(record=True) as caught:  # beta = 0: no KL to adapt, so nothing to refuse
        warnings.simplefilter("always")
        try:
            make_trainer(f"{out}/beta_zero", kl_adaptation_method="clip", beta=0.0)
        except NotImplementedError as error:
            results["beta_zero"] = str(error)
        else:
            results["beta_zero"] = [str(w.message) for w in caught if "per-completion loss weights" in str(w.message)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        unweighted = make_trainer(f"{out}/grpo", kl_adaptation_method="clip", kl_clip_threshold=0.05,
                                  loss_type="grpo", max_steps=1)
        weights = capture_inputs(unweighted).get("unsloth_sample_weight")  # trains the step
    results["grpo"] = {
        "ours": [str(w.message) for w in caught if "per-completion loss weights" in str(w.message)],
        "unsloth_ignores": any("ignored for loss_type=grpo" in str(w.message) for w in caught),
        "weights": weights,
        "adaptive_metrics": logged_adaptive_metrics(unweighted)}
    try:
        make_trainer(f"{out}/refused", kl_adaptation_method="clip")
    except NotImplementedError as error:
        results["refused"] = str(error)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = make_trainer(f"{out}/none", max_steps=1)
    results["warnings"] = [str(w.message) for w in caught if "per-completion loss weights" in str(w.message)]
    inputs = capture_inputs(trainer)
    results["weights"] = inputs["unsloth_sample_weight"].tolist()
    results["adaptive_metrics"] = logged_adaptive_metrics(trainer)
    results["logged_kl"] = any("kl" in entry for entry in trainer.state.log_history)
    loss, grads = loss_and_grads(trainer, inputs)
    stock_loss, stock_grads = stock_loss_and_grads(trainer, inputs)
    results.update(loss=loss, stock_loss=stock_loss, grad_diff=max_abs_diff(grads, stock_grads),
                   grad_max=max_abs(stock_grads))
    return results


def scenario_autocast_latch(out: str) -> dict:
    """When the lab's own run (one step through `trainer_lab.train_through`) latches Unsloth's GRPO autocast, and the
    precision it records; then the autocast Unsloth's real `_unsloth_grpo_autocast` chooses for the lab's model on a
    GPU, where its generated config has set the forced-float32 model's args to 'no' (no CPU run takes that branch),
    without and with `trainer_lab.unsloth_in_float32`'s latch, each trainer's recorded precision after the choice."""
    from types import SimpleNamespace

    from unsloth.models.rl_replacements import _unsloth_grpo_autocast

    from unsloth_adaptive_kl.tools import trainer_lab
    from unsloth_adaptive_kl.tools.trainer_lab import precision_of, unsloth_in_float32

    # the lab's own run latches it, before the first step: one step through train_through, the latch recorded
    latched_at: list[int] = []

    def recording(trainer: Any) -> None:
        unsloth_in_float32(trainer)
        latched_at.append(trainer.state.global_step)

    trainer_lab.unsloth_in_float32 = recording
    setting = next(s for s in trainer_lab.trainer_settings() if s.label == "k1 in the reward")
    run = trainer_lab.LabRun("unsloth", setting, trainer_lab.RECIPES["dr_grpo"], 0.5, 1, 0)
    tables = trainer_lab.reference_tables(trainer_lab.ENVIRONMENTS[run.environment],
                                          (*trainer_lab.TRAIN_PROMPTS, trainer_lab.HELD_OUT))
    row = trainer_lab.train_through(run, tables)
    trainer_lab.unsloth_in_float32 = unsloth_in_float32
    results: dict[str, Any] = {"lab_run": {"latched_at": latched_at, "precision": row["precision"]}}
    for label in ("upstream", "latched"):
        trainer = SimpleNamespace(args=SimpleNamespace(mixed_precision="no", bf16=False, fp16=False),
                                  model=SimpleNamespace(_unsloth_forced_float32=True))
        if label == "latched":
            unsloth_in_float32(trainer)
        enabled, dtype = _unsloth_grpo_autocast(trainer)
        results[label] = {"enabled": enabled, "dtype": str(dtype), "precision": precision_of(trainer)}
    return results


def scenario_nonfinite(out: str) -> dict:
    """Rule 13 at Unsloth's door, for `none` and `clip` on one captured batch: a NaN on a valid token of the reference
    or of the old policy's log-probs (the importance ratio's denominator) is the error naming the tensor; NaN and
    -inf on masked reference positions give the clean batch's loss and gradients."""
    results: dict[str, Any] = {}
    for method in ("none", "clip"):
        trainer = make_trainer(f"{out}/{method}", loss_type="bnpo", max_steps=1, kl_adaptation_method=method,
                               kl_clip_threshold=0.3)
        inputs = capture_inputs(trainer)
        masked = (inputs["completion_mask"] == 0).nonzero()  # the batch's padding (Unsloth masks pad tokens out)
        clean_loss, clean_grads = loss_and_grads(trainer, dict(inputs))
        ref = inputs["ref_per_token_logps"].clone()
        ref[tuple(masked[0])], ref[tuple(masked[-1])] = math.nan, -math.inf
        loss, grads = loss_and_grads(trainer, {**inputs, "ref_per_token_logps": ref})
        results[method] = {"masked": len(masked),
                           "masked_same": loss == clean_loss and all(map(torch.equal, grads, clean_grads))}
        for tensor in ("ref_per_token_logps", "old_per_token_logps"):
            bad = inputs["ref_per_token_logps"].clone()  # finite values (the ratio need not be 1 here), one NaN
            bad[1, 0] = math.nan
            try:
                loss_and_grads(trainer, {**inputs, tensor: bad})
                results[method][tensor] = "no error"
            except Exception as error:
                results[method][tensor] = f"{type(error).__name__}: {error}"
    return results


SCENARIOS = {"config": scenario_config, "pad_is_eos": scenario_pad_is_eos, "sample_weights": scenario_sample_weights, "losses": scenario_losses, "dynamic": scenario_dynamic, "timing": scenario_timing,
             "drift": scenario_drift, "policy_masks": scenario_policy_masks,
             "vllm_is_ratio": scenario_vllm_is_ratio, "reward": scenario_reward,
             "ref_sync": scenario_ref_sync, "hook_failure": scenario_hook_failure, "settings": scenario_settings,
             "autocast_latch": scenario_autocast_latch, "nonfinite": scenario_nonfinite}


def run_in_turn(names: list[str], folder: str) -> dict[str, dict[str, Any]]:
    """{name: {"result": ...}} for each scenario, run in turn; one that raises gives {"traceback": ...}, and the next
    still runs (its test reports the traceback, and each other test its own result)."""
    import traceback

    out: dict[str, dict[str, Any]] = {}
    for name in names:
        try:
            out[name] = {"result": SCENARIOS[name](f"{folder}/{name}_runs")}
        except Exception:  # noqa: BLE001  (reported to the scenario's own test)
            out[name] = {"traceback": traceback.format_exc()}
    return out


if __name__ == "__main__":
    folder = os.path.dirname(os.path.abspath(sys.argv[2]))
    names = SCENARIO.split(",")
    output = SCENARIOS[SCENARIO](f"{folder}/{SCENARIO}_runs") if len(names) == 1 else run_in_turn(names, folder)
    with open(sys.argv[2], "w") as f:
        json.dump(output, f, default=lambda value: None if isinstance(value, float) and math.isnan(value) else str(value))
