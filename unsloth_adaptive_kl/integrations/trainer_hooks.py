"""Wrappers shared by the TRL and Unsloth integrations, built around whichever upstream method they wrap, and TRL's
own fields and rules as this package reads them (Unsloth's config subclasses `trl.GRPOConfig`).

Each wrapper keeps the upstream signature and source visible (`functools.wraps`): Unsloth reads `inspect.getsource`
and `inspect.signature` of `trl.GRPOTrainer`'s methods to generate its trainer, and must see the stock ones.
"""

from __future__ import annotations

import enum
import functools
import json
import logging
import math
import os
import pickle
import sys
import warnings
import weakref
from typing import Any, Callable

import torch

from transformers import TrainerCallback, TrainingArguments
from transformers.trainer import TRAINER_STATE_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from transformers.utils import ADAPTER_SAFE_WEIGHTS_NAME, ADAPTER_WEIGHTS_NAME

from ..core.adaptation import neutral_where_empty
from ..core.adaptive_kl import AdaptiveKL
from ..core.config import FIELD_READERS, AdaptiveKLConfig, check_real, check_whole, is_real, reject
from ..core.controllers import check_horizon
from ..core.numerics import valid_positions
from ..core.reductions import REWARD_LOSS_TYPE_SETTING
from .patching import PatchSet
from .ref_sync import attach_reference_sync, reference_for_generation, warn_if_synced_reference_dropped
from .versions import GENERATION_LOCALS, TRL_LIGER_LOSS_CALL, UNSLOTH_LEFT_PAD_LOCAL, describe, source

logger = logging.getLogger(__name__)

STATE_FILE = "adaptive_kl_state.json"
AnchorError = Callable[[], Exception]
# TRL's own reference-sync fields (on trl.GRPOConfig), and beta, which this package's reference sync reads.
TRL_SYNC_FIELDS = ("sync_ref_model", "ref_model_sync_steps", "ref_model_mixup_alpha", "beta")
# TRL's fields in the settings line a trainer logs at construction (`log_settings`), after beta and the
# adaptive-KL ones.
LOGGED_TRL_FIELDS = ("loss_type", "scale_rewards", "num_iterations", "importance_sampling_level",
                     "use_bias_correction_kl", "steps_per_generation", "gradient_accumulation_steps")
# TrainingArguments' fields that move the optimisation, which Unsloth's generated config gives defaults of its own
# (learning rate 5e-5 against GRPO's 1e-6, seed 3407, warmup, 8-bit AdamW, weight decay): named in the settings line
# where they differ from TRL's.
RUNTIME_FIELDS = ("learning_rate", "lr_scheduler_type", "warmup_steps", "warmup_ratio", "optim", "weight_decay",
                  "max_grad_norm", "seed", "per_device_train_batch_size")
# The attribute on Unsloth's generated config that holds {field: TRL's default} for the fields the user left unset
# whose Unsloth default differs from TRL's (set by the Unsloth integration, read by `log_settings`).
UNSLOTH_DEFAULTS = "_adaptive_kl_unsloth_defaults"
TRL_6586 = "huggingface/trl#6586"
# The configs built while patched that no patched trainer has taken yet, by id (a TrainingArguments dataclass is
# unhashable); weak, so a config nothing holds leaves. unpatch() names those holding an adapted field then: a trainer
# built from one afterwards is trl's stock one, which reads none of the fields.
_AWAITING_A_TRAINER: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()


class KLTermProbe(float):
    """Stands in for beta during one call of the trainer's own loss function.

    It equals beta, so the stock `if beta != 0.0` branches behave as before. At the stock KL line (`... + beta *
    per_token_kl`) it records the per-token KL exactly as the trainer computed it, and the named locals of that
    function at that line (`read_locals`, e.g. Unsloth's rejected-token mask), and returns the stock product
    (`keep_stock_term`) or zeros (the adapted term is then added after the stock reduction instead)."""

    captured: list
    locals_at_kl_line: dict

    def __new__(cls, beta: float, keep_stock_term: bool, read_locals: tuple[str, ...] = ()) -> "KLTermProbe":
        probe = super().__new__(cls, beta)
        probe.keep_stock_term = keep_stock_term
        probe.read_locals = read_locals
        probe.captured = []
        probe.locals_at_kl_line = {}
        return probe

    def __mul__(self, other: Any) -> Any:
        if not isinstance(other, torch.Tensor):
            return float(self) * other
        self.captured.append(other)
        if self.read_locals:
            caller = sys._getframe(1).f_locals
            self.locals_at_kl_line = {name: caller.get(name) for name in self.read_locals}
        return float(self) * other if self.keep_stock_term else torch.zeros_like(other)

    # No __rmul__: `per_token_kl * beta` is Tensor.__mul__ taking the probe as a plain number, never reaching it; a
    # trainer that wrote its KL line that way records nothing, and `single_capture` says so.

    def single_capture(self, missing: AnchorError) -> torch.Tensor:
        """The one per-token KL recorded; `missing()` is raised when the KL line was not reached exactly once."""
        if len(self.captured) != 1:
            raise missing()
        return self.captured[0]


def check_trl_settings(args: Any, config: AdaptiveKLConfig) -> None:
    """TRL's own fields where this package gives them a rule, on a trainer config `args` (fields it lacks: TRL's
    defaults) beside its adaptive-KL settings `config`: raise ValueError naming the first bad field, its value and what
    is allowed. With the KL in the reward, `multi_objective_aggregation` must sum before normalising;
    `sync_ref_model` is a bool, and with it True, `ref_model_mixup_alpha` is in (0, 1], `ref_model_sync_steps` an
    integer >= 1 and beta != 0 (with syncing off nothing reads TRL's, so they are not checked; this package's
    `ref_model_sync_kl` and `ref_model_sync_reset_optimizer` must then be off). A non-stock KL built from the
    trainer's own per-token KL is refused where that KL carries a sequence-level weight (`sequence_weighted_kl`)."""
    if sequence_weighted_kl(args) and config.reads_trainer_kl and not config.kl_in_reward and not config.is_stock_kl:
        raise reject("use_bias_correction_kl", True,
                     f"False with importance_sampling_level='sequence' and adaptive KL (kl_adaptation_method="
                     f"{config.kl_adaptation_method!r}, kl_reduction={config.kl_reduction!r}, kl_estimator 'k3'): the "
                     "adapted KL is built from the trainer's own per-token KL, which the trainer multiplies by the "
                     "sequence-level importance ratio exp(mean_t log(pi/pi_old)) broadcast over the tokens, so its "
                     "gradient gains the spurious term (sum_t k_t) * grad(mean_t log pi_t) on every step, on-policy "
                     f"included ({TRL_6586}, open). Or importance_sampling_level='token', or a kl_estimator other "
                     "than 'k3' (computed from the log-probs, without the trainer's factor); "
                     "kl_adaptation_method='none' stays stock")
    aggregation = getattr(args, "multi_objective_aggregation", None)
    if config.kl_in_reward and aggregation not in (None, "sum_then_normalize"):
        raise reject("multi_objective_aggregation", aggregation,
                     "'sum_then_normalize' with kl_placement='reward' (the penalty is subtracted from the summed "
                     "reward before the group statistics)")
    syncing = getattr(args, "sync_ref_model", False)
    if not isinstance(syncing, bool):  # TRL reads it by truth: "False" (a string) would sync
        raise reject("sync_ref_model", syncing, "True or False")
    if not syncing:
        config.refuse_sync_settings("with sync_ref_model=False", "set sync_ref_model=True to sync the reference")
        return
    alpha, steps = getattr(args, "ref_model_mixup_alpha", 0.6), getattr(args, "ref_model_sync_steps", 512)
    check_real("ref_model_mixup_alpha", alpha, is_real(alpha) and 0 < alpha <= 1,
               "a number with 0 < x <= 1 with sync_ref_model=True")
    check_whole("ref_model_sync_steps", steps, 1, "an integer >= 1 with sync_ref_model=True")
    if getattr(args, "beta", None) == 0:
        raise reject("sync_ref_model", args.sync_ref_model,
                     "False with beta=0.0 (beta=0 turns the KL term off, so there is no reference to sync); set "
                     "beta > 0 to sync the reference")


def check_estimator_saves(config: AdaptiveKLConfig) -> None:
    """A callable `kl_estimator` must pickle: every checkpoint saves the trainer's config with it (training_args.bin),
    and a lambda or a local function would crash the first save, after training has started."""
    if not callable(config.kl_estimator):
        return
    try:
        pickle.dumps(config.kl_estimator)
    except (pickle.PicklingError, AttributeError, TypeError) as error:
        raise reject("kl_estimator", config.kl_estimator,
                     "a registered estimator's name (register_kl_estimator('my_kl') on a function, then "
                     "kl_estimator='my_kl') or a module-level function: every checkpoint pickles the trainer's config "
                     f"with it, and this one does not pickle ({type(error).__name__}: {error})") from None


def sequence_weighted_kl(args: Any) -> bool:
    """Whether the trainer's own per-token KL carries a sequence-level weight: with beta != 0,
    importance_sampling_level='sequence' and use_bias_correction_kl=True, TRL's `_compute_loss` (and unsloth_zoo's
    grpo_compute_loss alike) multiplies k3 by `coef_1`, the (B, 1) sequence-mean importance ratio, broadcast over the
    tokens: its gradient is neither the per-token correction nor the reverse-KL gradient (huggingface/trl#6586)."""
    return (getattr(args, "beta", 0.0) != 0.0 and getattr(args, "importance_sampling_level", "token") == "sequence"
            and bool(getattr(args, "use_bias_correction_kl", False)))


def checked_runtime(args: Any, beta: float, loss_type: str) -> AdaptiveKL:
    """The `AdaptiveKL` of a GRPOConfig's `args` at the trainer's `beta` and `loss_type`, its settings validated as a
    trainer is built (`AdaptiveKL` checks its fields against beta, `check_trl_settings` TRL's fields with them); a
    ValueError names the first bad one. The KL lab's prediction checks a config by it, with no trainer."""
    config = AdaptiveKLConfig.unvalidated_from(args)
    # TRL's num_iterations: the optimizer passes over each generation batch (target counts a completion once per batch)
    adaptive_kl = AdaptiveKL(config, beta, loss_type, num_iterations=args.num_iterations,
                             reference_sync=bool(getattr(args, "sync_ref_model", False)))
    check_trl_settings(args, config)
    return adaptive_kl


def attach_runtime(trainer: Any) -> AdaptiveKL:
    """Validate the trainer's adaptive-KL settings, once per trainer (`checked_runtime`, then what needs the trainer:
    its processes), and give the trainer its `AdaptiveKL` (`trainer.adaptive_kl`)."""
    adaptive_kl = checked_runtime(trainer.args, trainer.beta, trainer.loss_type)
    config = adaptive_kl.config
    check_target_horizon(trainer, config)
    check_estimator_saves(config)
    if config.is_stock_kl and sequence_weighted_kl(trainer.args):  # stock: kept as the trainer computes it
        warnings.warn(
            "importance_sampling_level='sequence' with use_bias_correction_kl=True: the trainer multiplies each "
            "token's KL by the sequence-level importance ratio broadcast over the tokens, so the KL gradient gains the "
            f"spurious term (sum_t k_t) * grad(mean_t log pi_t), on-policy included ({TRL_6586}, open). "
            "kl_adaptation_method='none' keeps it, as the stock trainer does; use_bias_correction_kl=False or "
            "importance_sampling_level='token' avoids it.",
            UserWarning,
            stacklevel=3,
        )
    trainer.adaptive_kl = adaptive_kl
    trainer._adaptive_kl_args_beta = getattr(trainer.args, "beta", None)  # read once, here, as the trainer reads it
    return adaptive_kl


def check_target_horizon(trainer: Any, config: AdaptiveKLConfig) -> None:
    """`target`'s horizon against a step's completions n, before training (the core's `check_horizon`, which the step
    would otherwise raise after its generation, forward and backward): with the KL in the loss, n =
    per_device_train_batch_size x gradient_accumulation_steps x processes / num_iterations (a completion counts once
    per generation batch); in the reward, n = generation_batch_size (the batch scored). Each completion is counted as
    if it had tokens (a step where some are masked out counts fewer)."""
    if "target" not in config.kl_methods:
        return
    args = trainer.args
    if config.kl_in_reward:
        completions, spelled = args.generation_batch_size, "generation_batch_size"
    else:
        completions = (args.per_device_train_batch_size * args.gradient_accumulation_steps
                       * trainer.accelerator.num_processes / args.num_iterations)
        spelled = "per_device_train_batch_size x gradient_accumulation_steps x processes / num_iterations"
    try:
        check_horizon(config, completions, trainer.beta)
    except ValueError as error:
        raise ValueError(f"{str(error).rstrip('.')}; here n is {spelled}.") from None


def log_settings(trainer: Any) -> None:
    """Say once per trainer construction the KL settings in effect (printed when a setting is adapted, as Unsloth
    prints its banner; logged at INFO for the stock KL), read from the trainer's own
    `args` after its construction (what Unsloth's generated config and the trainer made of the user's): beta, the
    adaptive-KL method, the estimator in effect (`AdaptiveKLConfig.estimator`), placement and reduction, the fields
    the method and the estimator read (`FIELD_READERS`: kl_clip_threshold for clip, ...), then `LOGGED_TRL_FIELDS`.
    A field the user left unset whose Unsloth default differs from TRL's is marked so (`UNSLOTH_DEFAULTS`), and the
    other such fields are listed after."""
    args, config = trainer.args, trainer.adaptive_kl.config
    unsloth_defaults = getattr(args, UNSLOTH_DEFAULTS, {})
    notes = {name: f"Unsloth's default; TRL's is {default!r}" for name, default in unsloth_defaults.items()}
    if config.kl_estimator is None:
        notes["kl_estimator"] = "unset: the placement's default"
    if config.kl_in_reward and config.kl_reduction == "loss_type":  # no loss to follow there
        notes["kl_reduction"] = f"in the reward: {REWARD_LOSS_TYPE_SETTING!r}, each completion's sum"
    elif config.kl_reduction == "loss_type" and "length_normalized" in config.kl_methods:
        notes["kl_reduction"] = "length_normalized: 'sequence_mean', each completion's mean"
    if args.beta != 0.0 and (config.kl_in_reward or not config.reads_trainer_kl):
        notes["use_bias_correction_kl"] = (f"not applied: the KL{' in the reward' if config.kl_in_reward else ''} is "
                                           f"{config.estimator!r} from the log-probs")
    settings = {"beta": args.beta, "kl_adaptation_method": config.kl_adaptation_method,
                "kl_estimator": config.estimator, "kl_placement": config.kl_placement,
                "kl_reduction": config.kl_reduction,
                **{name: getattr(config, name) for name in FIELD_READERS if config.reads(name)},
                **{name: getattr(args, name, None) for name in LOGGED_TRL_FIELDS}}

    def shown(name: str, value: Any) -> str:
        return f"{name}={value!r}" + (f" ({notes[name]})" if name in notes else "")

    line = (f"adaptive_kl: KL settings in effect for {type(trainer).__name__}: "
            + ", ".join(shown(name, value) for name, value in settings.items()))
    others = [f"{name}={plain(getattr(args, name, None))!r} (TRL's is {default!r})"
              for name, default in unsloth_defaults.items() if name not in settings]
    if others:
        line += "; Unsloth's other defaults that differ from TRL's: " + ", ".join(others)
    if config.is_stock_kl:
        logger.info(line)
    else:  # an adapted setting: shown where a user looks, as Unsloth shows its banner (INFO is hidden by default)
        print(line, flush=True)


def plain(value: Any) -> Any:
    """A config value as a user writes it: an enum (TrainingArguments' optim, lr_scheduler_type) as its value."""
    return value.value if isinstance(value, enum.Enum) else value


def check_loss_not_replaced(trainer_class: type, args: Any) -> bool:
    """Refuse, before anything is built, a non-stock setting where the installed trainer would never run the adapted
    loss: trl 1.9.1 - 1.13.0 with `use_liger_kernel=True` hand the whole loss to Liger's fused GRPO loss
    (`compute_liger_loss`), which computes its own beta * k3, so the adaptation, its metrics and the beta controller
    would silently do nothing, and with kl_placement="reward" the KL would be counted twice. `none` stays stock, and
    says it logs no adaptive_kl/ metric: True is returned then (the loss hook never runs)."""
    if args is None or not getattr(args, "use_liger_kernel", False) or getattr(args, "beta", 0.0) == 0.0:
        return False
    if TRL_LIGER_LOSS_CALL not in source(trainer_class.compute_loss):
        return False
    config = AdaptiveKLConfig.unvalidated_from(args)  # validated once, by `attach_runtime`
    syncing = bool(getattr(args, "sync_ref_model", False))
    if config.is_stock_kl and not syncing:
        warnings.warn(f"adaptive_kl: use_liger_kernel=True on {describe('trl')}: this trl hands the GRPO loss to "
                      "Liger's fused loss (GRPOTrainer.compute_liger_loss), which this package does not hook. "
                      "kl_adaptation_method='none' trains as stock; no adaptive_kl/ metric is logged.",
                      UserWarning, stacklevel=4)
        return True
    setting = (f"kl_adaptation_method={config.kl_adaptation_method!r}, kl_estimator={config.kl_estimator!r}, "
               f"kl_reduction={config.kl_reduction!r}, kl_placement={config.kl_placement!r}, "
               f"sync_ref_model={syncing}")
    raise ValueError(
        f"use_liger_kernel=True is invalid with adaptive KL ({setting}) on {describe('trl')}: this trl hands the "
        "GRPO loss to Liger's fused loss (GRPOTrainer.compute_liger_loss), which computes its own beta * k3 KL, so the "
        "adapted KL, its metrics and the beta controller would be silently dropped (and with kl_placement='reward' the "
        "KL counted twice). Allowed: use_liger_kernel=False, or trl>=1.14, where use_liger_kernel only swaps layer "
        "kernels and the loss keeps the adapted KL; kl_adaptation_method='none' with the stock estimator stays stock."
    )


def config_argument(args: tuple, kwargs: dict) -> Any:
    """The trainer config among a trainer's __init__ arguments, found by type (Unsloth wraps its generated __init__ as
    (self, *args, **kwargs)); None where none was passed (the trainer then builds a default, stock one)."""
    return next((value for value in (*args, *kwargs.values()) if isinstance(value, TrainingArguments)), None)


def await_trainer(config: Any) -> None:
    """Note a config built while patched until a patched trainer takes it (`wrap_init`)."""
    _AWAITING_A_TRAINER[id(config)] = config


def settle_configs(config_class: type) -> None:
    """Stop noting the configs of `config_class` (Unsloth's generated config, whose own unpatch() warning covers
    every instance)."""
    for key, config in list(_AWAITING_A_TRAINER.items()):
        if isinstance(config, config_class):
            _AWAITING_A_TRAINER.pop(key, None)


def configs_awaiting_a_trainer() -> list[Any]:
    """The live configs `await_trainer` noted that no patched trainer has taken, oldest first."""
    return list(_AWAITING_A_TRAINER.values())


def asks_for_adaptive_kl(args: Any) -> bool:
    """Whether a trainer config asks for anything this package does: a non-stock KL setting or reference syncing."""
    return not AdaptiveKLConfig.unvalidated_from(args).is_stock_kl or bool(getattr(args, "sync_ref_model", False))


def wrap_init(upstream: Callable) -> Callable:
    """__init__: validate the settings and build the beta controller before any training starts, and log the KL
    settings in effect (`log_settings`). With
    `sync_ref_model=True` (and beta != 0), the stock __init__ runs with it off, so that it neither refuses a PEFT model
    nor adds TRL's own sync callback; the trainer gets this package's syncing instead (`ref_sync`), for full and PEFT
    models alike."""

    @functools.wraps(upstream)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        config = config_argument(args, kwargs)
        loss_is_ligers = check_loss_not_replaced(type(self), config)
        syncing = bool(getattr(config, "sync_ref_model", False)) and getattr(config, "beta", 0.0) != 0.0
        with PatchSet() as patches:
            if syncing:  # the stock __init__ sees syncing off; the config says True again afterwards
                patches.replace(config, "sync_ref_model", False)
            upstream(self, *args, **kwargs)
        attach_runtime(self)
        if not loss_is_ligers:  # where Liger's loss is the stock one, the hook never runs, as said above
            self.add_callback(LossHookCheck(self))
        self.add_callback(ScheduleCheck(self))
        if syncing:
            attach_reference_sync(self)
        log_settings(self)
        _AWAITING_A_TRAINER.pop(id(config), None)  # taken: built without an error

    __init__.adaptive_kl_hooked = True  # type: ignore[attr-defined]  (what `hooked` looks for; wraps() carries it)
    return __init__


def hooked(trainer_class: type) -> bool:
    """Whether a trainer class still holds this package's hooks: a class of its MRO has the `wrap_init` __init__
    (unpatch() restores the stock one)."""
    return any(getattr(vars(cls).get("__init__"), "adaptive_kl_hooked", False) for cls in trainer_class.__mro__)


class _CallRecorder:
    """Stands in for `trainer._get_per_token_logps_and_entropies` during one generation: keeps the last call's
    arguments (the reference forward's, which comes last), so that forward can be replayed with the policy."""

    def __init__(self, method: Callable) -> None:
        self.method = method
        self.last_call: tuple[tuple, dict] | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.last_call = (args, kwargs)
        return self.method(*args, **kwargs)

    def replay_with(self, model: Any, missing: Callable[[], Exception]) -> torch.Tensor:
        """The log-probs of the last call's sequences under `model` (the policy), without gradient; `missing()` is
        raised when the generation made no log-prob call."""
        if self.last_call is None:
            raise missing()
        args, kwargs = self.last_call
        if args:
            args = (model, *args[1:])
        else:
            kwargs = {**kwargs, "model": model}
        with torch.no_grad():
            return self.method(*args, **kwargs)[0]


def _policy_logps(trainer: Any, found: dict, recorder: _CallRecorder, missing: Callable[[], Exception]) -> torch.Tensor:
    """The policy's log-probs of the sampled tokens: the trainer's old log-probs where it computed them, vLLM's
    sampling log-probs where present, otherwise one no-grad forward (the reference forward replayed with the policy)."""
    for name in ("old_per_token_logps", "sampling_per_token_logps"):
        if found[name] is not None:
            return found[name]
    return recorder.replay_with(trainer.model, missing)


def trl_layout(logps: torch.Tensor, caller: dict, width: int, missing: Callable[[str], Exception]) -> torch.Tensor:
    """Per-token log-probs in TRL's (B, width) layout, the layout of its completion mask. TRL's (and vLLM's sampling)
    log-probs are in it already; Unsloth's generated trainer keeps its reference and old log-probs left-packed,
    (B, width + max_left_pad), row i's completion starting at column max_left_pad - left_pad_i (`missing(name)` is
    raised when its left-padding local is absent)."""
    if logps.size(1) == width:
        return logps
    if UNSLOTH_LEFT_PAD_LOCAL not in caller:
        raise missing(UNSLOTH_LEFT_PAD_LOCAL)
    start = logps.size(1) - width - caller[UNSLOTH_LEFT_PAD_LOCAL].to(logps.device)
    return logps.gather(1, start[:, None] + torch.arange(width, device=logps.device)[None])


def wrap_calculate_rewards(upstream: Callable, missing_locals: Callable[[str], Exception]) -> Callable:
    """_calculate_rewards, for kl_placement="reward": the rewards it returns (all processes) gain a column,
    -beta_t * KL_i, which the trainer's weighted reward sum (its weight is 1 for the call, see
    `wrap_generate_and_score`) subtracts before the group statistics and advantages. KL_i comes from the caller's
    reference and policy log-probs; unscored completions (every reward NaN) stay unscored."""

    @functools.wraps(upstream)
    def _calculate_rewards(self: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        rewards_per_func = upstream(self, *args, **kwargs)
        scoring = getattr(self, "_adaptive_kl_scoring", None)
        if scoring is None:
            return rewards_per_func
        caller = sys._getframe(1).f_locals
        absent = [name for name in GENERATION_LOCALS if name not in caller]
        if absent:
            raise missing_locals(absent[0])
        found = {name: caller[name] for name in GENERATION_LOCALS}
        mask = found["completion_mask"] if found["tool_mask"] is None else found["completion_mask"] * found["tool_mask"]
        policy = _policy_logps(self, found, scoring["recorder"], lambda: missing_locals("ref_per_token_logps"))
        policy, ref = (trl_layout(logps, caller, mask.size(1), missing_locals)
                       for logps in (policy, found["ref_per_token_logps"]))
        # A non-finite log-prob on a valid token (vLLM's sampling log-probs, say) raises naming the tensor, in
        # `penalize`'s one transfer; masked positions may hold anything.
        source = next((name for name in ("old_per_token_logps", "sampling_per_token_logps") if found[name] is not None),
                      "a policy forward")
        term = self.adaptive_kl.term(policy, ref, mask, names={"policy": f"policy log-probs ({source})",
                                                               "reference": "reference log-probs (ref_per_token_logps)"})
        penalty, metrics = self.adaptive_kl.penalize(term, gather=self.accelerator.gather, train=scoring["train"],
                                                     completed_steps=self.state.global_step)
        # completions with tokens and a reward: TRL's baseline leaves the unscored ones out (they stay unscored)
        unscored = torch.isnan(rewards_per_func).all(dim=1)
        known = self.accelerator.gather(valid_positions(mask).sum(1)).to(unscored.device).masked_fill(unscored, 0)
        penalty = neutral_where_empty(penalty, known, scoring["group_size"])
        column = -penalty.to(rewards_per_func.device, rewards_per_func.dtype)
        column = column.masked_fill(unscored, math.nan)
        scoring.update(metrics=metrics, mean_penalty=-torch.nanmean(column).nan_to_num(0.0).item())
        self.reward_weights = torch.cat([self.reward_weights, self.reward_weights.new_ones(1)])
        return torch.cat([rewards_per_func, column[:, None]], dim=1)

    return _calculate_rewards


def wrap_generate_and_score(upstream: Callable, missing_reward_metric: AnchorError) -> Callable:
    """_generate_and_score_completions: read the global mean reward it appends to `_metrics["train"]["reward"]`
    (`missing_reward_metric()` is raised when it appended none). With kl_placement="reward" it scores with the KL
    penalty (`wrap_calculate_rewards`) and leaves the stock `reward` metric un-penalised: the mean penalty over the
    scored completions is added back to it."""

    @functools.wraps(upstream)
    def _generate_and_score_completions(self: Any, *args: Any, **kwargs: Any) -> Any:
        with reference_for_generation(self):  # the reference log-probs with the synced reference, once there is one
            return generate_and_score(self, *args, **kwargs)

    def generate_and_score(self: Any, *args: Any, **kwargs: Any) -> Any:
        mode = "train" if self.model.training else "eval"  # the bucket the trainer logs this batch's metrics in
        rewards = self._metrics[mode]["reward"]
        logged = len(rewards)
        runtime, train = self.adaptive_kl, training(self)
        if not (runtime.config.kl_in_reward and self.beta != 0.0):
            output = upstream(self, *args, **kwargs)
            if train:
                if len(rewards) != logged + 1:
                    raise missing_reward_metric()
                observe_mean_reward(runtime, rewards[-1])
            return output
        # the groups as the trainer forms them, by the mode it read before generating (generation may switch it)
        scoring = {"train": train, "recorder": _CallRecorder(self._get_per_token_logps_and_entropies),
                   "group_size": self.num_generations if mode == "train" else self.num_generations_eval}
        with PatchSet() as patches:  # for this one generation, on the trainer instance
            patches.replace(self, "_adaptive_kl_scoring", scoring)
            # GRPOTrainer._get_per_token_logps_and_entropies: recorded, so the reference forward can be replayed
            patches.replace(self, "_get_per_token_logps_and_entropies", scoring["recorder"])
            patches.replace(self, "reward_weights", self.reward_weights)  # _calculate_rewards appends the KL's weight
            output = upstream(self, *args, **kwargs)
        if "metrics" not in scoring:  # the patched _calculate_rewards never ran: the rewards carry no penalty
            raise RuntimeError(
                f"adaptive_kl: a generation of {type(self).__name__} scored its completions without the adaptive KL's "
                "reward hook (_calculate_rewards, which puts beta * KL into the rewards with kl_placement='reward'): "
                "an override of _calculate_rewards that does not call super() would train without the KL in the "
                "reward. Call super()._calculate_rewards(...) from the override, or set kl_placement='loss'.")
        if len(rewards) != logged + 1:
            raise missing_reward_metric()
        rewards[-1] += scoring["mean_penalty"]
        for name, value in scoring["metrics"].items():
            self._metrics[mode][name].append(value)
        if train:  # the un-penalised mean reward (the penalty was added back above)
            observe_mean_reward(runtime, rewards[-1])
        return output

    return _generate_and_score_completions


def observe_mean_reward(runtime: AdaptiveKL, mean_reward: float) -> None:
    """The trainer's logged mean reward of a training generation batch, to the controller. TRL logs NaN where no
    completion of the batch was scored (every reward function returned None for each, which TRL warns of, row by row):
    the batch has no mean reward, as a loop's `step(mean_reward=None)` has none, and `dynamic` does not decay on it.
    A controller that reads no reward (a constant beta, `target`) is handed none: a batch with an infinite reward
    trains as in the stock trainer. Where the controller reads it (`dynamic`, a registered one), +-inf (a reward
    function's) is refused, as the core refuses it at every door, in the trainer's words."""
    if not runtime.reads_rewards:
        return
    if math.isinf(mean_reward):
        raise ValueError(f"adaptive_kl: the generation batch's mean reward (the trainer's logged reward) is "
                         f"{mean_reward}: a reward function returned +-inf for a completion; allowed are finite "
                         f"rewards, or None for a completion a function does not score, where the beta controller "
                         f"reads them (kl_adaptation_method={runtime.config.kl_adaptation_method!r}: dynamic would "
                         "decay on +inf at every step).")
    if not math.isnan(mean_reward):
        runtime.observe_rewards(mean_reward)


class ScheduleCheck(TrainerCallback):
    """At the start of training: `dynamic`'s `beta_schedule_steps`, set where the run ends first (beta = beta_min
    from the step after it: no step trains at it with beta_schedule_steps >= max_steps), is said, as the reference
    sync's step is (`ReferenceSync.on_train_begin`). Its default (1000) is not: the reward alone decays beta then."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        late = self.trainer.adaptive_kl.config.schedule_after_run(self.trainer.beta, state.max_steps)
        if late is not None:
            warnings.warn(f"adaptive_kl: {late}", UserWarning, stacklevel=2)


class LossHookCheck(TrainerCallback):
    """After each optimizer step (`on_step_end`, training only): the step must have ended in the loss hook
    (`record_metrics`, which sets `adaptive_kl.completed_steps` to the step's number). A trainer subclass whose own
    `_compute_loss` / `compute_loss` does not call the patched one trains with the stock KL term, logs no
    `adaptive_kl/` metric and never moves beta: with an adapted setting (or reference syncing) that is an error,
    raised after the first such step; with the stock KL a warning, once (the loss is stock either way)."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """A trainer built while patched, trained after `unpatch()`: its class holds the stock methods again, so no
        step would reach the hook. Said before the first step (an error with an adapted setting), naming unpatch()."""
        if hooked(type(self.trainer)) or self.trainer.beta == 0.0:
            return
        message = (f"adaptive_kl: this {type(self.trainer).__name__} was built while unsloth_adaptive_kl was patched, "
                   "and unsloth_adaptive_kl.unpatch() has since restored the stock trainer: it would train with the "
                   "stock KL term, log no adaptive_kl/ metric and never move beta. Call unsloth_adaptive_kl.patch() "
                   "before train(), or build the trainer while patched.")
        self._refuse_or_warn(message)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        trainer, runtime = self.trainer, self.trainer.adaptive_kl
        if trainer.beta == 0.0 or runtime.completed_steps == state.global_step:
            return
        message = (f"adaptive_kl: optimizer step {state.global_step} of {type(trainer).__name__} ran without the "
                   "adaptive KL's loss hook (GRPOTrainer._compute_loss, in Unsloth's trainer its compute_loss): an "
                   "override of _compute_loss or compute_loss that does not call super() trains with the stock KL "
                   "term, logs no adaptive_kl/ metric and never moves beta. Call super()._compute_loss(model, inputs) "
                   "(or super().compute_loss(...)) from the override.")
        self._refuse_or_warn(message)

    def _refuse_or_warn(self, message: str) -> None:
        """`message` (the hook will not run) as an error with an adapted setting or reference syncing; with the stock
        KL a warning, once per trainer (the loss is stock either way)."""
        trainer, config = self.trainer, self.trainer.adaptive_kl.config
        if not config.is_stock_kl or getattr(trainer.args, "sync_ref_model", False):
            raise RuntimeError(f"{message} ({', '.join(config.adapted_fields() or ['sync_ref_model=True'])})")
        if not getattr(trainer, "_adaptive_kl_hook_warned", False):
            trainer._adaptive_kl_hook_warned = True
            warnings.warn(message + " With kl_adaptation_method='none' the loss is stock; only the metrics are "
                          "missing.", UserWarning, stacklevel=3)


def wrap_save_checkpoint(upstream: Callable) -> Callable:
    """_save_checkpoint: save the beta controller's state, and with syncing the reference, with every checkpoint:
    before the stock save, whose last act (`_push_from_checkpoint`, with `push_to_hub` and a checkpoint
    `hub_strategy`) uploads the folder as it then is."""

    @functools.wraps(upstream)
    def _save_checkpoint(self: Any, model: Any, trial: Any) -> None:
        folder = os.path.join(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        if self.args.should_save:
            os.makedirs(folder, exist_ok=True)
            with open(os.path.join(folder, STATE_FILE), "w") as f:
                json.dump(self.adaptive_kl.state_dict(), f)
        sync = getattr(self, "adaptive_kl_reference", None)
        if sync is not None:  # every process takes part (FSDP2 gathers the reference); the saving one writes
            sync.save(folder, write=self.args.should_save)
        upstream(self, model, trial)

    return _save_checkpoint


def wrap_load_optimizer_and_scheduler(upstream: Callable) -> Callable:
    """_load_optimizer_and_scheduler: restore the beta controller's state, and with syncing the reference, on
    resume; a checkpoint without the state file warns, naming it, where beta moves (beta restarts at its initial
    value; a constant beta loses nothing)."""

    @functools.wraps(upstream)
    def _load_optimizer_and_scheduler(self: Any, checkpoint: Any) -> None:
        upstream(self, checkpoint)
        if checkpoint is None:
            return
        warn_if_adapter_not_resumed(self, checkpoint)
        warn_if_inside_a_generation_batch(self, checkpoint)
        path = os.path.join(checkpoint, STATE_FILE)
        if os.path.exists(path):
            with open(path) as f:
                self.adaptive_kl.load_state_dict(json.load(f), without_state=f"delete {path} and resume again")
        elif self.adaptive_kl.moves_beta:
            # a checkpoint saved without this package, or a file lost: say so, as verl's integration does
            warnings.warn(f"adaptive_kl: {path} is missing: the controllers restart from their initial beta.",
                          UserWarning, stacklevel=2)
        sync = getattr(self, "adaptive_kl_reference", None)
        if sync is not None:
            sync.load(checkpoint)
        else:
            warn_if_synced_reference_dropped(checkpoint)

    return _load_optimizer_and_scheduler


def _holds_adapter(folder: str) -> bool:
    """Whether `folder` holds adapter weights, by the names transformers' resume looks for."""
    return any(os.path.isfile(os.path.join(folder, name)) for name in (ADAPTER_SAFE_WEIGHTS_NAME, ADAPTER_WEIGHTS_NAME))


# In transformers' Trainer._load_from_checkpoint since 5.24 (5.17 lacks it): a checkpoint's root adapter is loaded
# beside those of its sub-folders.
ROOT_ADAPTER_LOAD = 'resume_from_checkpoint, "default"'


def loads_only_adapter_subfolders() -> bool:
    """Whether the installed transformers resumes a PEFT model from a checkpoint's adapter sub-folders alone, where
    it has any (read in its source: `ROOT_ADAPTER_LOAD` absent)."""
    from transformers import Trainer

    return ROOT_ADAPTER_LOAD not in source(Trainer._load_from_checkpoint)


def warn_if_adapter_not_resumed(trainer: Any, checkpoint: str) -> None:
    """transformers' Trainer._load_from_checkpoint, for a PEFT model, loaded the adapters of a checkpoint's
    sub-folders where it had any, and then not the one at its root, before 5.24: TRL saves its "ref" adapter in a
    sub-folder (a PeftModel passed to GRPOTrainer with beta > 0), so the trained adapter was not resumed. Stock
    behaviour, said here. (DeepSpeed and FSDP load the checkpoint their own way, not through that branch.)"""
    try:
        from peft import PeftModel
    except ImportError:  # no PEFT: no adapter to leave out
        return
    model = trainer.accelerator.unwrap_model(trainer.model)
    if (not isinstance(model, PeftModel) or getattr(trainer, "is_deepspeed_enabled", False)
            or getattr(trainer, "is_fsdp_enabled", False) or not os.path.isdir(checkpoint)
            or not loads_only_adapter_subfolders()):
        return
    active = model.active_adapters
    subfolders = sorted(name for name in os.listdir(checkpoint) if _holds_adapter(os.path.join(checkpoint, name)))
    if subfolders and active[0] not in subfolders and _holds_adapter(checkpoint):
        warnings.warn(
            f"adaptive_kl: resuming from {checkpoint}, transformers loaded the adapters of its sub-folders "
            f"({', '.join(subfolders)}) but not the trained adapter {active[0]!r} at its root (Trainer."
            "_load_from_checkpoint; TRL saves its 'ref' adapter in a sub-folder when a PeftModel is passed with "
            "beta > 0): the policy restarts from the adapter it was built with. Pass the base model and peft_config= "
            "to the trainer instead of a PeftModel.", UserWarning, stacklevel=3)


def warn_if_inside_a_generation_batch(trainer: Any, checkpoint: str) -> None:
    """The trainer generates a batch every steps_per_generation x num_iterations micro-batches and does not checkpoint
    the rest of it (GRPOTrainer._prepare_inputs): resumed inside one, it generates a new batch at once, and the run
    differs from the uninterrupted one from there. Stock behaviour, said here."""
    path = os.path.join(checkpoint, TRAINER_STATE_NAME)
    if not os.path.isfile(path):
        return
    with open(path) as f:
        step = json.load(f).get("global_step", 0)
    every = trainer.args.steps_per_generation * getattr(trainer, "num_iterations", 1)
    micro_batches = step * trainer.args.gradient_accumulation_steps
    if micro_batches % every:
        warnings.warn(
            f"adaptive_kl: resuming at step {step}, inside a generation batch: the trainer generates one every {every} "
            f"micro-batches (steps_per_generation x num_iterations) and step {step} ends at micro-batch "
            f"{micro_batches}. The rest of that batch is not in the checkpoint, so a new one is generated at once and "
            "the run differs from the uninterrupted one from here (dynamic reads one batch more). Checkpoints at "
            f"steps whose micro-batch count is a multiple of {every} resume exactly.", UserWarning, stacklevel=3)


def check_trainer_beta(trainer: Any) -> None:
    """At each loss call: `trainer.beta` (which the trainer's own loss reads) must still be the beta the run's
    AdaptiveKL was built with, or 0 (every setting then computes the loss without a KL term, as the stock trainer).
    Set to another value later (a callback scheduling it), an adapted setting would go on multiplying its own beta_t
    and ignore it: refused. The stock KL term follows it, as in the stock trainer, and the metrics' beta does not: said
    once. `trainer.args.beta`, which the trainer reads once, when it is built (the stock trainer too), set later does
    nothing: refused where adaptive KL is on, said once otherwise."""
    config = trainer.adaptive_kl.config
    args_built, args_now = trainer._adaptive_kl_args_beta, getattr(trainer.args, "beta", None)
    if args_now != args_built and not getattr(trainer, "_adaptive_kl_args_beta_warned", False):
        # !r: whatever was set (a string from a callback's config) is named, not formatted as a number
        does_nothing = (f"the trainer read it once, when it was built with {args_built!r} (as the stock trainer "
                        "does), so a value set later does nothing")
        if not config.is_stock_kl:
            raise reject("trainer.args.beta", args_now,
                         f"{args_built!r}, the value the trainer was built with, while adaptive KL is on "
                         f"({', '.join(config.adapted_fields())}): {does_nothing}. To move beta during training use "
                         "kl_adaptation_method 'dynamic' or 'target'; to start from another, build the trainer with it")
        trainer._adaptive_kl_args_beta_warned = True
        warnings.warn(f"adaptive_kl: trainer.args.beta was set to {args_now!r} after the run started: {does_nothing}; "
                      "trainer.beta is what the stock loss reads.", UserWarning, stacklevel=3)
    built, now = trainer.adaptive_kl.beta, trainer.beta
    if now in (built, 0.0) or getattr(trainer, "_adaptive_kl_beta_warned", False):
        return
    if not config.is_stock_kl:
        raise reject("trainer.beta", now,
                     f"the beta the trainer was built with ({built:g}) while adaptive KL is on "
                     f"({', '.join(config.adapted_fields())}): trainer.beta was set after the run started, and the "
                     "adapted term multiplies the controller's beta, so the new value would be ignored. To move beta "
                     "during training use kl_adaptation_method 'dynamic' or 'target'; to start from another, build the "
                     "trainer with it")
    trainer._adaptive_kl_beta_warned = True
    warnings.warn(f"adaptive_kl: trainer.beta was set to {now:g} after the run started (built with {built:g}): the "
                  "trainer's own KL term uses it, as the stock trainer does, but adaptive_kl/current_beta goes on "
                  f"logging {built:g}, so current_beta * adapted_kl is no longer the loss's KL part.",
                  UserWarning, stacklevel=3)


EVALUATING = "_adaptive_kl_evaluating"  # set on a trainer for the length of one evaluation batch


def wrap_prediction_step(upstream: Callable) -> Callable:
    """prediction_step, where a trainer's evaluation scores a batch (its generation and its loss): the trainer is
    marked as evaluating for the call, which `training` reads. The model's mode does not say it: Unsloth's generation
    puts the model back in training mode (`FastLanguageModel.for_training`) after every generation, evaluation's
    included, and TRL's transformers continuous batching generates with `model.train()`."""

    @functools.wraps(upstream)
    def prediction_step(self: Any, *args: Any, **kwargs: Any) -> Any:
        with PatchSet() as patches:
            patches.replace(self, EVALUATING, True)
            return upstream(self, *args, **kwargs)

    return prediction_step


def training(trainer: Any) -> bool:
    """Whether the trainer's current batch trains (and so feeds the beta controller): its model in training mode,
    outside an evaluation batch (`wrap_prediction_step`)."""
    return bool(trainer.model.training) and not getattr(trainer, EVALUATING, False)


def current_beta(self: Any) -> float:
    """The beta multiplying the KL term in the next step (`trainer.beta` stays the configured value)."""
    return self.adaptive_kl.current_beta


def record_metrics(trainer: Any, term: Any) -> None:
    """Queue one micro-batch's adaptive-KL statistics (`term` None with the KL in the reward: the loss has no KL
    term, the step still ends here); at an optimizer-step boundary in training (every call in evaluation) log the
    queued micro-batches' metrics and move beta (like TRL's adaptive entropy controller: once per optimizer step,
    effective from the next step)."""
    trainer.adaptive_kl.check_settings(trainer.args)  # the args its config was copied from: changed, they would not act
    mode = "train" if trainer.model.training else "eval"  # the bucket the trainer logs its own loss metrics in
    logged = trainer.adaptive_kl.record(
        term, gather=trainer.accelerator.gather, train=training(trainer),
        end_of_step=trainer.accelerator.sync_gradients, completed_steps=trainer.state.global_step + 1,
    )
    for metrics in logged:
        for name, value in metrics.items():
            trainer._metrics[mode][name].append(value)
