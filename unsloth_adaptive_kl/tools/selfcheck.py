"""`python -m unsloth_adaptive_kl`: the self-check a user runs on their own machine before a long run.

It reports the installed trl / transformers / torch / unsloth versions against the tested ranges (an untested
version is reported, not failed: the runs below check it on this machine), looks up every
source anchor the integrations rely on and whether the patches are in place, and, on a tiny in-process model on
this machine's device (CUDA when present, else CPU), compares the hooked loss with the stock trainer's: `none` and a
`clip` whose threshold no KL reaches must both give the stock loss and gradients, within the float32
summation bound. The core (`AdaptiveKL`, torch alone) is checked first against the hand-written k3 penalty; then,
when trl is installed, TRL; then, when Unsloth is installed, Unsloth is imported (after this package,
as users must) and its generated trainer is checked the same way. Exit code 0 only if every check holds.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shlex
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch

from ..integrations import versions
from ..integrations.patching import PatchSet
from ..core.tolerance import (EPS32, float32_chain_tolerance, k3_gradient_magnitude, k3_magnitude,
                              reordered_sum_tolerance)
from .machine import hardware, installed_versions, source_commit

VERSION_PACKAGES = ("trl", "transformers", "torch", "unsloth", "unsloth_zoo")  # reported against the tested ranges
PROMPTS = ["ab:", "cde:", "fg:", "h:", "bad:", "ce:", "gh:", "abc:"]
NO_OP_CLIP = dict(kl_adaptation_method="clip", kl_clip_threshold=1e6)  # above every per-token KL of the check


@dataclass
class Check:
    name: str
    ok: bool
    detail: str = ""
    untested: bool = False  # a version outside the tested range: reported, and proven by the runs below instead

    def line(self) -> str:
        status = "FAIL" if not self.ok else "untested" if self.untested else "ok"
        return f"[{status}] {self.name}" + (f": {self.detail}" if self.detail else "")


def version_checks() -> list[Check]:
    """Each package's version against its tested range with the core and each integration installed here: a version
    is untested where one of their CI rows never ran it (transformers 4.56.2 ran TRL's tests, not Unsloth's)."""
    here = versions.installed_integrations()
    return [Check(f"{package} version", True, versions.describe(package, here),
                  untested=versions.is_tested(package, here) is False) for package in VERSION_PACKAGES]


def anchor_checks(package: str, anchors: tuple, resolve: Callable[[str], Any]) -> list[Check]:
    missing = versions.missing_anchors(anchors, resolve)
    checks = [Check(f"{package} anchors", not missing, f"{len(anchors) - len(missing)} of {len(anchors)} found")]
    checks += [Check(f"{package} anchor missing", False, f"`{a.text}` in {a.function} ({a.reason})") for a in missing]
    return checks


def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def core_checks() -> list[Check]:
    """The core alone (no trainer): `AdaptiveKL` with `none` on random float32 log-probs (normal about -5) against the
    hand-written k3 penalty beta * mean_i (sum_t m (exp(r) - r - 1)) / L_i, r = ref - logp, of the same values in
    float64, value and gradient, within the float32 bound of the arithmetic: the value's 16 operations (k3's 5, exp
    counted twice; the 5 additions over 6 tokens; / L_i; the mean's 3 additions and division; beta), the gradient's 7
    (exp(r) - 1 from the forward's exp, times the upstream gradient, then beta, / 4 and / L_i)."""
    from ..core import AdaptiveKL

    generator = torch.Generator().manual_seed(0)
    logps = (torch.randn(4, 6, generator=generator) - 5.0).requires_grad_(True)
    ref = torch.randn(4, 6, generator=generator) - 5.0
    mask = (torch.arange(6)[None] < torch.tensor([[6], [3], [1], [5]])).float()
    term, _ = AdaptiveKL(None, beta=0.04).kl_loss(logps, ref, mask)
    (grad,) = torch.autograd.grad(term, logps)
    exact_logps = logps.detach().double().requires_grad_(True)
    r, weight = ref.double() - exact_logps, 0.04 / (4 * mask.double().sum(-1, keepdim=True))
    hand = 0.04 * (((torch.exp(r) - r - 1) * mask).sum(-1) / mask.sum(-1)).mean()
    (hand_grad,) = torch.autograd.grad(hand, exact_logps)
    bound = float32_chain_tolerance(16, float((weight * k3_magnitude(logps, ref) * mask).sum()))
    grad_bound = float32_chain_tolerance(7, weight * k3_gradient_magnitude(logps, ref) * mask)
    grad_diff = (grad.double() - hand_grad).abs()
    ok = abs(term.item() - hand.item()) <= bound and bool((grad_diff <= grad_bound).all())
    return [Check("core AdaptiveKL (torch alone): none == k3 formula", ok,
                  f"loss {term.item():.8g} vs {hand.item():.8g} (bound {bound:.2g}), max grad diff "
                  f"{grad_diff.max().item():.2g} (bound {grad_bound.max().item():.2g})")]


def length_reward(completions: list, **kwargs: Any) -> list[float]:
    """0.1 * (completion length mod 5): a reward that varies with what the policy samples (the comparisons do not
    rely on it: `comparison_inputs` sets the advantages). A conversational completion (a list of messages) is
    measured by its last message's content."""
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    return [0.1 * (len(text) % 5) for text in texts]


def tiny_trainer(output_dir: str, model: Any = None, tokenizer: Any = None, prompts: Optional[list] = None,
                 **overrides: Any) -> Any:
    """A GRPO trainer (whichever `trl.GRPOTrainer` is now: TRL's, or Unsloth's generated one) on a tiny LoRA model,
    built in-process unless `model` and `tokenizer` (e.g. a FastLanguageModel and its tokenizer) are given; `prompts`:
    the dataset's prompts (plain text or conversations), `PROMPTS` by default; `overrides`: GRPOConfig fields."""
    import trl
    from datasets import Dataset
    from transformers import PrinterCallback, set_seed

    from .tiny import add_lora, as_unsloth_model, build_tiny_model, build_tokenizer

    # mask_truncated_completions: TRL's default, which Unsloth's generated config turns on for loss_type='dapo': the
    # tiny Llama seldom samples EOS, so with it every completion of a batch can be truncated, masked out, and the
    # loss's gradient all zero (7 of 16 sampling seeds on a CPU).
    settings: dict[str, Any] = dict(
        output_dir=output_dir, use_cpu=device() == "cpu", bf16=False, fp16=False, report_to="none",
        per_device_train_batch_size=4, num_generations=4, max_completion_length=8, max_steps=1, logging_steps=1,
        learning_rate=5e-3, beta=0.04, save_strategy="no", seed=0, disable_tqdm=True, loss_type="dapo",
        mask_truncated_completions=False,
    )
    settings.update(overrides)
    set_seed(0)
    if model is None:
        tokenizer = build_tokenizer()
        model = as_unsloth_model(add_lora(build_tiny_model(tokenizer, seed=0), seed=0))
    trainer = trl.GRPOTrainer(model=model, processing_class=tokenizer, args=trl.GRPOConfig(**settings),
                              reward_funcs=[length_reward],
                              train_dataset=Dataset.from_dict({"prompt": PROMPTS if prompts is None else prompts}))
    trainer.remove_callback(PrinterCallback)
    return trainer


def captured_inputs(trainer: Any, compute: str) -> dict:
    """One real micro-batch of prepared inputs, from a training step (`compute`: the trainer's loss method name)."""
    captured: list = []
    upstream = getattr(type(trainer), compute)

    def capture(model: Any, inputs: dict, *args: Any, **kwargs: Any) -> Any:
        if not captured:
            captured.append({k: v.detach().clone() if torch.is_tensor(v) else v for k, v in inputs.items()})
        return upstream(trainer, model, inputs, *args, **kwargs)

    with PatchSet() as patches:
        patches.replace(trainer, compute, capture)
        trainer.train()
    return captured[0]


class MissingGradients(RuntimeError):
    """A trained parameter got no gradient, or every gradient is zero: a comparison would compare nothing."""


def backward_grads(trainer: Any, loss: torch.Tensor) -> list[torch.Tensor]:
    """Gradients the way training takes them: `backward()` into `.grad` (under Unsloth's reentrant gradient
    checkpointing `torch.autograd.grad` returns None for every LoRA parameter). Every trained parameter must get one
    and not all may be zero, so that comparing gradients cannot pass by comparing zeros; `.grad` is cleared after."""
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    for p in params:
        p.grad = None
    loss.backward()
    missing = sum(p.grad is None for p in params)
    if missing:
        raise MissingGradients(f"{missing} of {len(params)} trained parameters got no gradient")
    grads = [p.grad.detach().clone() for p in params]
    for p in params:
        p.grad = None
    if not any(torch.count_nonzero(g) > 0 for g in grads):
        raise MissingGradients("every gradient is zero")
    return grads


def loss_and_grads(trainer: Any, compute: str, inputs: dict) -> tuple[float, list[torch.Tensor]]:
    """The trainer's loss (`compute`: its loss method name) on `inputs`, and its gradients (`backward_grads`)."""
    trainer.model.train()
    loss = getattr(trainer, compute)(trainer.model, dict(inputs))
    return loss.item(), backward_grads(trainer, loss)


def absolute_loss(trainer: Any, compute: str, inputs: dict) -> float:
    """The magnitude a reordered-sum bound on the loss needs (`reordered_sum_tolerance`: sum |x| over its per-token
    terms, as the loss weighs them): the loss of `inputs` with every advantage -|A|, whose PPO-clip term
    max(rho, clip(rho)) |A| + beta * KL (KL >= 0, k3's) is >= each real term's |.|. |loss| is not: a group's
    advantages sum to 0, and the terms cancel."""
    trainer.model.train()
    with torch.no_grad():
        return getattr(trainer, compute)(trainer.model, {**inputs, "advantages": -inputs["advantages"].abs()}).item()


def comparison_inputs(inputs: dict) -> dict:
    """A copy of captured inputs in which both terms of the loss and their gradients are not zero: the reference
    log-probs moved by -1 to +1 nat across the tokens (at the first step the policy is the reference, and the KL 0),
    and the advantages spread from -1 to +1 across the completions (a tiny model's completions can all earn one
    reward: the CPU's first batch does, and each advantage is then 0, the policy term with it)."""
    ref, advantages = inputs["ref_per_token_logps"], inputs["advantages"]
    shift = torch.linspace(-1.0, 1.0, ref.numel(), device=ref.device).view_as(ref)
    spread = torch.linspace(-1.0, 1.0, advantages.numel(), device=advantages.device, dtype=advantages.dtype)
    return {**inputs, "ref_per_token_logps": ref + shift, "advantages": spread.view_as(advantages)}


def max_difference(grads: list[torch.Tensor], others: list[torch.Tensor]) -> float:
    """max |g - o| over every element of each pair of gradients."""
    return max((g - o).abs().max().item() for g, o in zip(grads, others))


def compare_with_stock(name: str, trainer: Any, compute: str, stock: Callable[[], Any],
                       inputs: Optional[dict] = None) -> list[Check]:
    """`none` and the no-op clip against the stock loss on one captured batch (`inputs`, or one captured here), as
    `comparison_inputs` moves it: both terms of the loss at work. Each bound is a reordered sum's rounding plus what
    stock differs from itself, run twice (0 on a CPU; a GPU's backward may add in a different order each run: no
    patch can beat that)."""
    inputs = comparison_inputs(captured_inputs(trainer, compute) if inputs is None else inputs)
    try:
        with stock():
            stock_loss, stock_grads = loss_and_grads(trainer, compute, inputs)
            again_loss, again_grads = loss_and_grads(trainer, compute, inputs)
            magnitude = absolute_loss(trainer, compute, inputs)
    except MissingGradients as error:
        return [Check(f"{name}: stock gradients", False, str(error))]
    aa_loss = abs(again_loss - stock_loss)
    aa_grad = max_difference(again_grads, stock_grads)
    aa = f", stock against itself: loss {aa_loss:.2g}, max grad diff {aa_grad:.2g}" if aa_loss or aa_grad else ""
    tokens = int(inputs["completion_mask"].sum())
    grad_scale = max(g.abs().max().item() for g in stock_grads)
    checks = [Check(f"{name}: stock gradients", True, f"max |grad| {grad_scale:.3g}")]
    # `none` is the stock loss itself; the no-op clip adds its (equal) KL term outside it, so under autocast the
    # backward through the model rounds that term's gradient at the autocast precision, not float32's
    autocast = "bf16" if trainer.args.bf16 else "fp16" if trainer.args.fp16 else None
    clip_eps = torch.finfo(torch.bfloat16 if autocast == "bf16" else torch.float16).eps if autocast else EPS32
    from ..integrations.trainer_hooks import attach_runtime

    for label, settings in (("none", {}), ("clip above every KL", NO_OP_CLIP)):
        for field, value in {"kl_adaptation_method": "none", **settings}.items():
            setattr(trainer.args, field, value)
        attach_runtime(trainer)
        trainer._metrics["train"].pop("adaptive_kl/adapted_kl", None)  # logged by this run, not an earlier one
        try:
            loss, grads = loss_and_grads(trainer, compute, inputs)
        except MissingGradients as error:
            checks.append(Check(f"{name}: {label} == stock", False, str(error)))
            continue
        loss_diff = abs(loss - stock_loss)
        grad_diff = max_difference(grads, stock_grads)
        grad_bound = 2 * reordered_sum_tolerance(tokens, grad_scale, EPS32 if label == "none" else clip_eps)
        ok = loss_diff <= reordered_sum_tolerance(tokens, magnitude) + aa_loss and grad_diff <= grad_bound + aa_grad
        logged = "adaptive_kl/adapted_kl" in trainer._metrics["train"]
        checks.append(Check(f"{name}: {label} == stock", ok and logged,
                            f"loss {loss:.6g} vs {stock_loss:.6g}, max grad diff {grad_diff:.2g}"
                            + (f" (bound {grad_bound:.2g}, a {autocast} backward)" if autocast and label != "none"
                               else "") + aa
                            + ("" if logged else ", adaptive_kl metrics not logged")))
    return checks


@contextlib.contextmanager
def stock_trl() -> Iterator[None]:
    from .. import patch, unpatch
    from ..integrations import trl as trl_patch

    unpatch()
    try:
        with PatchSet() as patches:  # restored before patch() installs its own fallback again
            trl_patch.stock_cpu_fallback(patches)
            yield
    finally:
        patch()


@contextlib.contextmanager
def stock_unsloth(trainer: Any) -> Iterator[None]:
    """Unsloth's own training step inside the block: every hook this package puts on one bypassed (the loss shim,
    the compute_loss, generation, reward and evaluation wrappers, the reference forward's adapter switch, the
    step-end check that the loss hook ran), so that a step run in it, generation included, is stock Unsloth's (the
    trainer keeps the settings its __init__ wrapper checked)."""
    from transformers import TrainerCallback

    from ..integrations import ref_sync
    from ..integrations.trainer_hooks import LossHookCheck

    module, cls = sys.modules[type(trainer).__module__], type(trainer)
    with PatchSet() as patches:
        patches.replace(module, "UnslothEfficientGRPO", module.UnslothEfficientGRPO.upstream)
        for name in ("compute_loss", "_generate_and_score_completions", "_calculate_rewards", "prediction_step"):
            patches.replace(cls, name, getattr(cls, name).__wrapped__)
        patches.replace(module, "use_adapter", ref_sync.stock_use_adapter)
        patches.replace(LossHookCheck, "on_step_end", TrainerCallback.on_step_end)  # stock steps skip the hook
        yield


def trl_checks(output_dir: str) -> list[Check]:
    try:
        from ..integrations import trl as trl_patch
    except ImportError as error:  # trl itself does not import (trl 0.27.0 under transformers 5 imports `weave`)
        return [Check("trl imports", False, str(versions.import_error("trl", error)))]

    checks = anchor_checks("trl", versions.TRL_ANCHORS, trl_patch._stock_function)
    checks.append(Check("trl patched", trl_patch.is_patched()))
    if all(check.ok for check in checks):
        checks += compare_with_stock(f"TRL GRPOTrainer on {device()}", tiny_trainer(output_dir), "_compute_loss", stock_trl)
    return checks


def generate_unsloth_trainer(output_dir: Optional[str] = None) -> Optional[str]:
    """Import Unsloth after this package, as users must; on a CPU-only machine with Unsloth's CPU switch and its
    trainer generation called directly, as Unsloth's PatchFastRL does on a GPU. Returns an error, or None."""
    from ..integrations import unsloth as unsloth_patch

    if device() == "cpu":
        os.environ.setdefault("UNSLOTH_ALLOW_CPU", "1")
        os.environ.setdefault("UNSLOTH_COMPILE_DISABLE", "1")
    if output_dir is not None:  # Unsloth writes its generated trainer to ./unsloth_compiled_cache unless told where
        os.environ.setdefault("UNSLOTH_COMPILE_LOCATION", os.path.join(output_dir, "unsloth_compiled_cache"))
    try:
        import unsloth  # noqa: F401
        import unsloth.models.rl as rl

        if unsloth_patch.generated_grpo_trainer() is None:
            rl._patch_trl_rl_trainers("grpo_trainer")
    except Exception as error:  # reported, and the exit code says so
        return f"{type(error).__name__}: {error}"
    return None


def unsloth_checks(output_dir: str) -> list[Check]:
    try:
        from ..integrations import unsloth as unsloth_patch
    except ImportError as error:  # Unsloth's integration hooks TRL's trainer: a trl that does not import stops it too
        return [Check("Unsloth trainer generated and hooked", False, str(versions.import_error("trl", error)))]

    error = generate_unsloth_trainer(output_dir)
    if error is not None:
        return [Check("Unsloth trainer generated and hooked", False, error)]
    generated = unsloth_patch.generated_grpo_trainer()
    if generated is None:
        return [Check("Unsloth trainer generated", False, "Unsloth fell back to TRL's trainer (see its warning)")]
    module = sys.modules[generated.__module__]
    hooked = module.__dict__.get("UnslothEfficientGRPO") is unsloth_patch._AdaptiveEfficientGRPO

    checks = anchor_checks("unsloth", versions.UNSLOTH_ANCHORS, unsloth_patch.anchor_resolver(generated))
    checks.append(Check("Unsloth trainer hooked", hooked))
    if all(check.ok for check in checks):
        trainer = tiny_trainer(output_dir + "/unsloth", optim="adamw_torch", warmup_steps=0)

        checks += compare_with_stock(f"Unsloth's generated trainer on {device()}", trainer, "compute_loss",
                                     lambda: stock_unsloth(trainer))
    return checks


def verl_checks(_: str) -> list[Check]:
    """verl's version and anchors, then the adaptive loss against verl's own `ppo_loss` on one micro-batch: `none`
    equals it (loss and gradient, exactly), and clip's KL part is beta * token-mean(min(k, threshold)) of verl's
    per-token KL k (low_var_kl)."""
    checks = [Check("verl version", True, versions.describe("verl"), untested=versions.is_tested("verl") is False)]
    checks += anchor_checks("verl", versions.VERL_ANCHORS, versions.resolve_verl)
    if not all(check.ok for check in checks):
        return checks
    from verl.trainer.ppo import core_algos
    from verl.workers.config import ActorConfig
    from verl.workers.utils.losses import ppo_loss
    from verl.workers.utils.padding import no_padding_2_padding

    from ..core import AdaptiveKLConfig
    from verl.utils import tensordict_utils as tu

    from ..integrations.verl import BETA_KEY, AdaptivePPOLoss
    from .tiny import verl_loss_and_grad, verl_micro_batch

    data, values, offsets = verl_micro_batch()
    settings = dict(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, kl_loss_coef=0.04,
                    kl_loss_type="low_var_kl", loss_agg_mode="token-mean", entropy_coeff=0.0)
    actor, without_kl = ActorConfig(**settings, use_kl_loss=True), ActorConfig(**settings, use_kl_loss=False)
    tu.assign_non_tensor(data, **{BETA_KEY: actor.kl_loss_coef})  # beta_t, as the driver pushes it each update

    def run(loss_fn: Callable[..., Any]) -> tuple[torch.Tensor, torch.Tensor]:
        loss, grad, _ = verl_loss_and_grad(loss_fn, data, values, offsets)
        return loss, grad

    stock_loss, stock_grad = run(lambda **kw: ppo_loss(actor, **kw))
    loss, grad = run(AdaptivePPOLoss(actor, AdaptiveKLConfig()))
    grad_diff = (grad - stock_grad).abs().max().item()
    checks.append(Check("verl ppo_loss: none == stock", torch.equal(loss, stock_loss) and grad_diff == 0,
                        f"loss {loss.item():.8g} vs {stock_loss.item():.8g}, max grad diff {grad_diff:.2g}"))
    threshold = 0.3
    clip = AdaptivePPOLoss(actor, AdaptiveKLConfig(kl_adaptation_method="clip", kl_clip_threshold=threshold))
    kl_part = run(clip)[0] - run(lambda **kw: ppo_loss(without_kl, **kw))[0]
    log_prob = no_padding_2_padding(torch.nested.nested_tensor_from_jagged(values, offsets), data)
    padded = data.select("response_mask", "ref_log_prob").to_padded_tensor()
    mask = padded["response_mask"].bool()
    k = core_algos.kl_penalty(log_prob, padded["ref_log_prob"], "low_var_kl")
    hand = 0.04 * k.clamp(max=threshold)[mask].sum() / mask.sum()
    checks.append(Check("verl ppo_loss: clip == beta * mean min(k, threshold)",
                        abs(kl_part.item() - hand.item()) <= 1e-6 * max(1.0, abs(hand.item())),
                        f"KL part {kl_part.item():.8g} vs {hand.item():.8g}"))
    return checks


def guarded(name: str, part: Callable[[], list[Check]]) -> list[Check]:
    """The checks of `part`, or one FAIL line with its exception: a failing part leaves the others' lines."""
    try:
        return part()
    except Exception as error:  # reported, and the exit code says so
        return [Check(name, False, f"{type(error).__name__}: {error}")]


def main(json_path: Optional[str] = None) -> int:
    """Print each check as it ends; 0 if every check holds, else 1. `json_path`: also write what was printed there,
    with the command, the date, the machine and the versions (docs/results/selfcheck.json is such a record)."""
    import tempfile

    start = time.perf_counter()
    torch.backends.cuda.matmul.allow_tf32 = False  # the summation bounds are float32's
    printed = [f"unsloth_adaptive_kl self-check (device: {device()})"]
    print(printed[0])
    checks = version_checks()
    for check in checks:
        printed.append(check.line())
        print(printed[-1], flush=True)
    with tempfile.TemporaryDirectory() as output_dir:
        # the core needs torch alone; the trainers' checks need their packages
        parts: list[tuple[str, Callable[[str], list[Check]]]] = [("the core's checks", lambda _: core_checks())]
        if importlib.util.find_spec("trl"):
            parts.append(("TRL's checks", trl_checks))
            if importlib.util.find_spec("unsloth"):
                parts.append(("Unsloth's checks", unsloth_checks))
        if importlib.util.find_spec("verl"):
            parts.append(("verl's checks", verl_checks))
        for name, part in parts:
            # a part that raises (an untested trainer version renamed an input, say) is one FAIL line, not the end
            for check in guarded(name, lambda: part(output_dir)):
                checks.append(check)
                printed.append(check.line())
                print(printed[-1], flush=True)
    failed = [check for check in checks if not check.ok]
    seconds = time.perf_counter() - start
    printed.append(f"self-check {'passed' if not failed else 'FAILED'}: {len(checks) - len(failed)} of {len(checks)} "
                   f"checks hold ({seconds:.0f} s)")
    print(printed[-1])
    if json_path:
        write_record(json_path, printed, passed=not failed)
    return 1 if failed else 0


def write_record(json_path: str, printed: list[str], passed: bool) -> None:
    """The run as JSON: the command that wrote it, the date, the commit (`source_commit`), the machine, the installed
    versions of the packages it checks, and its lines as printed (this package's lines only: a trainer's own banner
    and notices are not ours)."""
    record = {"command": shlex.join(["python", "-m", "unsloth_adaptive_kl", *sys.argv[1:]]),
              "date": time.strftime("%Y-%m-%d"), "commit": source_commit(),
              "hardware": hardware(), "versions": installed_versions((*VERSION_PACKAGES, "verl")), "passed": passed,
              "lines": printed}
    os.makedirs(os.path.dirname(json_path) or ".", exist_ok=True)
    with open(json_path, "w") as f:
        json.dump(record, f, indent=1)
        f.write("\n")
