"""Integration with trl's `GRPOConfig` / `GRPOTrainer`: translate trainer tensors to the core and back.

`patch()` is the one place that changes TRL and `unpatch()` restores every stock object; both are idempotent.
Data flows one way: `_compute_loss` reads the per-token KL TRL computed (caught by `KLTermProbe`), the log-probs,
the mask and TRL's loss-type normalisers, and hands them to `grpo_loss.adapted_loss`, the decisions it shares with
the Unsloth integration, which drives the trainer's `AdaptiveKL` (`trainer.adaptive_kl`, the core object); the adapted
term goes back into the loss and the metrics into `trainer._metrics`. No extra forward pass is made.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import trl
import trl.trainer
import trl.trainer.callbacks as trl_callbacks
import trl.trainer.grpo_config as trl_grpo_config
import trl.trainer.grpo_trainer as trl_grpo_trainer
import trl.trainer.utils as trl_utils

from ..core.adaptation import KLTerm
from ..core.config import ADAPTIVE_KL_FIELDS, AdaptiveKLConfig, reject
from ..core.estimators import estimator_label
from ..core.numerics import masked_reference
from ..core.reductions import loss_type_reduction
from .grpo_loss import LossNormalisers, adapted_loss
from .patching import PatchSet
from .ref_sync import use_reference
from .trainer_hooks import (
    KLTermProbe,
    await_trainer,
    check_trainer_beta,
    check_trl_settings,
    configs_awaiting_a_trainer,
    current_beta,
    record_metrics,
    wrap_calculate_rewards,
    wrap_generate_and_score,
    wrap_init,
    wrap_load_optimizer_and_scheduler,
    wrap_prediction_step,
    wrap_save_checkpoint,
)
from .trl_cpu_fallback import ChunkedLogProbWithCPUFallback
from .versions import (
    TRL_ANCHORS,
    TRL_KERNEL_WITHOUT_CPU_PATH,
    TRL_KL_LINE,
    TRL_LOGPS_CALL,
    TRL_PADDED_LUSPO,
    TRL_REWARD_METRIC,
    Anchor,
    anchor_error,
    check_anchors,
    describe,
    generation_local,
    source,
)

StockGRPOConfig = trl_grpo_config.GRPOConfig
StockGRPOTrainer = trl_grpo_trainer.GRPOTrainer
# The stock methods the wrappers call, captured before any patching.
_stock_init = StockGRPOTrainer.__init__
_stock_compute_loss = StockGRPOTrainer._compute_loss
_stock_generate_and_score = StockGRPOTrainer._generate_and_score_completions
_stock_calculate_rewards = StockGRPOTrainer._calculate_rewards
_stock_save_checkpoint = StockGRPOTrainer._save_checkpoint
_stock_load_optimizer_and_scheduler = StockGRPOTrainer._load_optimizer_and_scheduler
_stock_prediction_step = StockGRPOTrainer.prediction_step


@dataclass
class GRPOConfig(AdaptiveKLConfig, StockGRPOConfig):
    # Unsloth pastes this class's docstring into the source it generates, so it must be set explicitly.
    __doc__ = (StockGRPOConfig.__doc__ or "") + "\n" + (AdaptiveKLConfig.__doc__ or "")

    def __post_init__(self) -> None:
        super().__post_init__()  # TRL's own, then the adaptive-KL fields, checked against this config's beta
        check_trl_settings(self, self)
        fields = self.adapted_fields()
        if is_patched():  # unpatch() names it, with the fields it holds then, while no patched trainer has taken it
            await_trainer(self)
        elif fields:  # after unpatch(): a trainer built now is stock and reads none of them
            warnings.warn(f"{', '.join(fields)} set while unsloth_adaptive_kl is unpatched (unpatch()): a GRPOTrainer "
                          "built now is trl's stock one, which reads none of the adaptive-KL fields. Call "
                          "unsloth_adaptive_kl.patch() before building the trainer.", UserWarning, stacklevel=3)

    def to_json_string(self) -> str:
        """TrainingArguments.to_json_string (what report_to="tensorboard" records when training begins), a callable
        `kl_estimator` written as its name (`estimator_label`): json cannot write a function (a TypeError at train
        begin)."""
        if not callable(self.kl_estimator):
            return super().to_json_string()
        with PatchSet() as patches:  # for this one call: the config's field, as its name
            patches.replace(self, "kl_estimator", estimator_label(self.kl_estimator))
            return super().to_json_string()


def reduce_stock_config(config: Any, protocol: int) -> Any:
    """pickle's (and copy's) reduction of an instance of trl's stock GRPOConfig, one built from a name bound before
    the import: pickle would find its class by name, trl.trainer.grpo_config.GRPOConfig, which is ours while patched,
    and refuse it (PicklingError, at the first checkpoint's training_args.bin). It is rebuilt from its attributes by
    `stock_config`; a subclass (ours, Unsloth's generated config, a user's) reduces as before."""
    if type(config) is not StockGRPOConfig:
        return object.__reduce_ex__(config, protocol)
    return stock_config, (dict(vars(config)),)


def wrap_stock_config_init(upstream: Callable) -> Callable:
    """trl's stock GRPOConfig.__init__: given an adaptive-KL field, the TypeError it raises anyway names the cause (a
    name bound to the stock class before the import) instead of the bare "unexpected keyword argument"."""

    @functools.wraps(upstream)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        fields = [name for name in kwargs if name in ADAPTIVE_KL_FIELDS]
        if fields:
            raise TypeError(
                f"GRPOConfig.__init__() got an unexpected keyword argument {fields[0]!r}: this GRPOConfig is trl's "
                "stock class, bound before `import unsloth_adaptive_kl` replaced trl.GRPOConfig (a `from trl import "
                "GRPOConfig` above the import, here or in a module imported first). Import unsloth_adaptive_kl "
                "first, or take the class after it (trl.GRPOConfig, unsloth_adaptive_kl.GRPOConfig).")
        upstream(self, *args, **kwargs)

    return __init__


def stock_config(attributes: dict[str, Any]) -> Any:
    """A stock GRPOConfig holding these attributes, as pickled by `reduce_stock_config` (no __post_init__ rerun)."""
    config = StockGRPOConfig.__new__(StockGRPOConfig)
    vars(config).update(attributes)
    return config


def _missing(anchor: Anchor) -> Callable[[], Exception]:
    """For an anchor found in the source at patch time but not reached while training."""
    return lambda: anchor_error("trl", anchor)


def _stock_function(name: str) -> Any:
    """The stock function an anchor names ('GRPOTrainer._compute_loss', 'SyncRefModelCallback._sync_target_model'),
    None if trl has no such one."""
    owner, _, attribute = name.partition(".")
    return getattr(StockGRPOTrainer if owner == "GRPOTrainer" else getattr(trl_callbacks, owner, None), attribute, None)


class _PolicyLogpsProbe:
    """Stands in for `trainer._get_per_token_logps_and_entropies` during one stock `_compute_loss` call: records the
    first (policy) call's log-probs (for a non-stock `kl_estimator`, and the non-finite check of both log-probs), and
    replaces the reference log-probs of `inputs` (a copy of the batch the stock loss reads) by
    `numerics.masked_reference` (valid positions keep the trainer's values exactly), before the stock KL line reads
    them."""

    def __init__(self, method: Any, inputs: dict, mask: torch.Tensor) -> None:
        self.method = method
        self.logps: list[torch.Tensor] = []
        self.inputs, self.mask = inputs, mask

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        output = self.method(*args, **kwargs)
        self.logps.append(output[0])
        if len(self.logps) == 1 and self.inputs.get("ref_per_token_logps") is not None:
            ref = self.inputs["ref_per_token_logps"]
            self.inputs["ref_per_token_logps"] = masked_reference(ref, output[0], self.mask)
        return output


def _stock_loss_and_kl(
    trainer: Any, model: Any, inputs: dict, keep_stock_term: bool, logps_probe: _PolicyLogpsProbe | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the stock `_compute_loss` with the KL-term probe (and the policy log-prob probe, when given) in place;
    return its loss and the per-token KL its KL line computed. Without `keep_stock_term` the loss has no KL term."""
    probe = KLTermProbe(trainer.beta, keep_stock_term=keep_stock_term)
    with PatchSet() as patches:  # for this one call: GRPOTrainer.beta, and its _get_per_token_logps_and_entropies
        patches.replace(trainer, "beta", probe)
        if logps_probe is not None:
            patches.replace(trainer, "_get_per_token_logps_and_entropies", logps_probe)
        loss = _stock_compute_loss(trainer, model, inputs)
    return loss, probe.single_capture(_missing(TRL_KL_LINE))


# Replaces trl.GRPOTrainer._compute_loss (wraps it; the loss is then its policy part + beta_t * adapted KL).
@functools.wraps(_stock_compute_loss)
def _compute_loss(self: Any, model: Any, inputs: dict) -> torch.Tensor:
    check_trainer_beta(self)
    if self.beta == 0.0:  # no KL term: stock, but a setting changed mid-run is refused as at every door
        self.adaptive_kl.check_settings(self.args)
        return _stock_compute_loss(self, model, inputs)
    config = self.adaptive_kl.config
    if config.kl_in_reward:  # beta * KL_i is in the advantages: the loss keeps the stock KL metric, not its term
        loss = _stock_loss_and_kl(self, model, inputs, keep_stock_term=False)[0]
        record_metrics(self, None)  # the optimizer step still ends here: the controller moves once per step
        return loss
    mask = inputs["completion_mask"]
    if "tool_mask" in inputs:
        mask = mask * inputs["tool_mask"]
    # The stock loss reads a copy of the batch whose masked reference log-probs are the policy's (see the probe).
    logps_probe = _PolicyLogpsProbe(self._get_per_token_logps_and_entropies, dict(inputs), mask)
    loss, kl = _stock_loss_and_kl(self, model, logps_probe.inputs, config.is_stock_kl, logps_probe)
    if not logps_probe.logps:
        raise _missing(TRL_LOGPS_CALL)()
    training = self.model.training
    normalisers = LossNormalisers(  # TRL divides by steps_per_generation in training only
        max_completion_length=self.max_completion_length, num_items_in_batch=inputs.get("num_items_in_batch"),
        num_processes=self.accelerator.num_processes,
        steps_per_generation=self.args.steps_per_generation if training else None,
        gradient_accumulation=self.current_gradient_accumulation_steps if training else 1,
    )
    loss, term = adapted_loss(self.adaptive_kl, loss, kl, logps_probe.logps[0], inputs["ref_per_token_logps"], mask,
                              normalisers, old_logps=inputs.get("old_per_token_logps"))
    if getattr(self, "_entropy_bonus_enabled", False) and not config.is_stock_kl:
        _policy_loss_with_term(self, term, normalisers.gradient_accumulation)
    record_metrics(self, term)
    return loss


def _policy_loss_with_term(trainer: Any, term: KLTerm, gradient_accumulation: int) -> None:
    """TRL's `policy_loss` metric (logged with the entropy bonus on) is the loss before the bonus, its KL term
    included; the stock call made it without one. Its last entry gets beta_t * adapted, as TRL scales and gathers its
    own term there: divided by the accumulation for dapo, cispo and vespo (`TRL_POLICY_LOSS_AFTER_DIVIDE`), not for
    the others, whose entry precedes the divide. One gather and one read per micro-batch, as TRL's own entry costs."""
    part = term.adapted.detach() * trainer.adaptive_kl.current_beta
    if loss_type_reduction(trainer.adaptive_kl.loss_type) == "token_sum_normalized":
        part = part / gradient_accumulation
    mode = "train" if trainer.model.training else "eval"
    trainer._metrics[mode]["policy_loss"][-1] += trainer.accelerator.gather(part).nanmean().item()


class BuiltBeforePatch:
    """`GRPOTrainer.adaptive_kl` on the class: an instance's own (`__init__` sets it) hides it, so it is read only for
    a trainer built before the patch (before `import unsloth_adaptive_kl`, or between `unpatch()` and `patch()`),
    whose patched methods would otherwise fail on a bare AttributeError. An AttributeError that says so."""

    def __get__(self, trainer: Any, owner: Optional[type] = None) -> Any:
        if trainer is None:
            return self
        raise AttributeError(
            f"adaptive_kl: this {type(trainer).__name__} was built before unsloth_adaptive_kl patched trl (it was "
            "imported after the trainer was built, or the trainer between unpatch() and patch()), so it has no "
            "adaptive KL for the patched GRPOTrainer's methods to drive. Build the trainer after "
            "`import unsloth_adaptive_kl`.")


def _refuse_padded_luspo(upstream: Callable) -> Callable:
    # Wraps GRPOTrainer.__init__ (after `wrap_init`). Where this trl reduces luspo by its padded, length-weighted mean
    # (TRL_PADDED_LUSPO), an adapted KL in the loss, reduced as later releases reduce luspo, would sit at another
    # scale than the trainer's own KL term: a setting that changes nothing would not train as stock. Refused before
    # training. (Unsloth's generated trainer, which reduces luspo by its own loss, is not a GRPOTrainer subclass: its
    # __init__ is hooked in integrations/unsloth.py.)
    @functools.wraps(upstream)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        upstream(self, *args, **kwargs)
        config = self.adaptive_kl.config
        if (self.loss_type == "luspo" and self.beta != 0.0 and not config.is_stock_kl and not config.kl_in_reward
                and TRL_PADDED_LUSPO in source(_stock_compute_loss)):
            adapted = ", ".join(config.adapted_fields())
            raise reject("loss_type", "luspo", f"another loss_type with {adapted} on {describe('trl')}: this trl's "
                         "luspo averages its loss over every position, padding included, each weighted by its "
                         "completion's length, and the adapted KL is reduced as later releases reduce luspo (the mean "
                         "over completions of each one's summed KL), at another scale than this trl's own KL term. "
                         "Upgrade trl (luspo's reduction changed in 1.10.0), put the KL in the reward "
                         f"(kl_placement='reward'), or leave {adapted} unset (this trl's own term)")

    return __init__


# Built once, so that patch() after unpatch() installs the very same objects.
_init = _refuse_padded_luspo(wrap_init(_stock_init))
_generate_and_score_completions = wrap_generate_and_score(_stock_generate_and_score, _missing(TRL_REWARD_METRIC))
_calculate_rewards = wrap_calculate_rewards(_stock_calculate_rewards, lambda name: anchor_error("trl", generation_local(name)))
_save_checkpoint = wrap_save_checkpoint(_stock_save_checkpoint)
_load_optimizer_and_scheduler = wrap_load_optimizer_and_scheduler(_stock_load_optimizer_and_scheduler)
_prediction_step = wrap_prediction_step(_stock_prediction_step)
_current_beta = property(current_beta)
_stock_config_init = wrap_stock_config_init(StockGRPOConfig.__init__)


def kernel_lacks_cpu_path() -> bool:
    """Whether the installed trl's chunked log-prob kernel is Triton-only (trl 1.15), so CPU needs the fallback."""
    return TRL_KERNEL_WITHOUT_CPU_PATH in inspect.getsource(trl_utils)


def stock_cpu_fallback(patches: PatchSet) -> None:
    """Give unpatched TRL the CPU log-prob path its kernel lacks (trl 1.15), through `patches`: the stock side of a
    tool's comparison, as stock trl 1.15 cannot run on a CPU at all without it. Restore `patches` before `patch()`,
    which takes the kernel it finds as its own fallback's upstream (the fallback would then call itself)."""
    if kernel_lacks_cpu_path():
        # trl.trainer.utils._ChunkedLogProbFunction: trl 1.15's Triton kernel has no CPU path.
        patches.replace(trl_utils, "_ChunkedLogProbFunction", ChunkedLogProbWithCPUFallback)


def _patch_points() -> list[tuple[Any, str, Any]]:
    points: list[tuple[Any, str, Any]] = [
        # trl.GRPOConfig (and its aliases; Unsloth reads trl.trainer.grpo_trainer.GRPOConfig) gains the fields.
        (trl, "GRPOConfig", GRPOConfig),
        (trl.trainer, "GRPOConfig", GRPOConfig),
        (trl_grpo_config, "GRPOConfig", GRPOConfig),
        (trl_grpo_trainer, "GRPOConfig", GRPOConfig),
        # object.__reduce_ex__, as trl's stock GRPOConfig inherits it: a stock config bound before the import (it
        # trains as `none`) pickles by its attributes, its class's name being ours now (above).
        (StockGRPOConfig, "__reduce_ex__", reduce_stock_config),
        # trl's stock GRPOConfig.__init__: an adaptive-KL field given to a name bound before the import is a TypeError
        # that says so.
        (StockGRPOConfig, "__init__", _stock_config_init),
        # GRPOTrainer.__init__: validates the settings and builds the beta controller; with sync_ref_model=True it
        # lifts TRL's refusal of PEFT models and syncs the reference itself (ref_sync).
        (StockGRPOTrainer, "__init__", _init),
        # GRPOTrainer._compute_loss: the adapted KL term (above).
        (StockGRPOTrainer, "_compute_loss", _compute_loss),
        # GRPOTrainer._generate_and_score_completions: reads the mean reward for the beta controller.
        (StockGRPOTrainer, "_generate_and_score_completions", _generate_and_score_completions),
        # GRPOTrainer._calculate_rewards: kl_placement="reward" adds the KL penalty column to the rewards.
        (StockGRPOTrainer, "_calculate_rewards", _calculate_rewards),
        # trl.trainer.utils.use_adapter, as GRPOTrainer._generate_and_score_completions calls it for a PEFT model's
        # reference forward: the synced reference after the first reference sync (ref_sync), else TRL's own.
        (trl_grpo_trainer, "use_adapter", use_reference),
        # GRPOTrainer._save_checkpoint / _load_optimizer_and_scheduler: the controller state and the synced
        # reference in checkpoints.
        (StockGRPOTrainer, "_save_checkpoint", _save_checkpoint),
        (StockGRPOTrainer, "_load_optimizer_and_scheduler", _load_optimizer_and_scheduler),
        # GRPOTrainer.prediction_step: an evaluation batch marked as such, so that it feeds no beta controller (the
        # model's mode does not say it: continuous batching generates with model.train()).
        (StockGRPOTrainer, "prediction_step", _prediction_step),
        # GRPOTrainer.current_beta, which stock trl has not: the live beta (trainer.beta stays the configured one).
        (StockGRPOTrainer, "current_beta", _current_beta),
        # GRPOTrainer.adaptive_kl, which stock trl has not: a trainer built before the patch says so (above).
        (StockGRPOTrainer, "adaptive_kl", BuiltBeforePatch()),
    ]
    if kernel_lacks_cpu_path():
        # trl.trainer.utils._ChunkedLogProbFunction: trl 1.15's Triton kernel has no CPU path.
        ChunkedLogProbWithCPUFallback.upstream = trl_utils._ChunkedLogProbFunction
        points.append((trl_utils, "_ChunkedLogProbFunction", ChunkedLogProbWithCPUFallback))
    return points


_patches = PatchSet()


def is_patched() -> bool:
    return bool(_patches)


def patch() -> None:
    """Install the adaptive KL into TRL in place. Idempotent."""
    if _patches:
        return
    if StockGRPOConfig.__module__ == __name__:  # the "stock" objects above were an earlier copy of this module's
        raise ImportError(
            "unsloth_adaptive_kl: trl is patched already, by an earlier import of this package (a reload, or its "
            "modules removed from sys.modules): the stock trl objects are out of this copy's reach, and patching "
            "again would wrap the adaptive trainer twice. Restart the Python process (in a notebook, the kernel) and "
            "import unsloth_adaptive_kl once.")
    check_anchors("trl", TRL_ANCHORS, _stock_function)
    for owner, name, replacement in _patch_points():
        _patches.replace(owner, name, replacement)


def _held_fields(config: Any) -> list[str]:
    """The adapted fields a config holds now; none for one set since to a value no trainer takes (a patched trainer
    refuses it when built), which unpatch() must not raise on."""
    try:
        return config.adapted_fields()
    except ValueError:
        return []


def unpatch(*, name_configs: bool = True) -> None:
    """Restore every stock TRL object the patch replaced, unless it was replaced again since (Unsloth's generated
    config). Idempotent. A live config built while patched that holds an adapted field now, and that no patched
    trainer has taken, is named (unless `name_configs` is False: a patch() rolled back): a trainer built from it now
    would be trl's stock one, which reads none of the fields."""
    waiting = configs_awaiting_a_trainer() if _patches and name_configs else []
    _patches.restore(leave_newer=True)
    held = [fields for fields in map(_held_fields, waiting) if fields]
    if held:
        settings = "; ".join(", ".join(fields) for fields in held)
        warnings.warn(f"unsloth_adaptive_kl.unpatch(): {len(held)} GRPOConfig{'s' * (len(held) > 1)} with "
                      f"adaptive-KL fields ({settings}), built while patched, not yet given to a GRPOTrainer: a "
                      "GRPOTrainer built from one now is trl's stock one, which reads none of the adaptive-KL fields. "
                      "Call unsloth_adaptive_kl.patch() before building the trainer.", UserWarning, stacklevel=3)
