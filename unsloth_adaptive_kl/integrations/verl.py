"""verl: adaptive KL in verl's actor loss and in its reward KL, switched on by configuration.

A thin translator between verl (0.9.x, the V1 trainer) and the core's `AdaptiveKL`. A verl user turns it on with

    VERL_USE_EXTERNAL_MODULES=unsloth_adaptive_kl.integrations.verl \\
    python -m verl.trainer.main_ppo ... trainer.v1.trainer_mode=adaptive_kl \\
        +adaptive_kl.kl_adaptation_method=clip+dynamic +adaptive_kl.kl_clip_threshold=0.5

(no `verl.plugins` entry point: verl logs a failing one at debug level only, so a missing anchor would pass
unseen). What acts where:

- The KL in the actor loss (`actor_rollout_ref.actor.use_kl_loss=True`, beta_0 = `actor.kl_loss_coef`): every
  actor worker runs `AdaptivePPOLoss`, which is verl's own `ppo_loss` with kl_loss_coef = beta_t and the adapted KL
  as its KL term: verl's per-token KL (`kl_penalty` with `kl_loss_type`, taken where ppo_loss computes it), shaped
  per token by the core (clip/sigmoid),
  aggregated by verl's own `agg_loss` with its global batch normalisation (`loss_agg_mode`; `length_normalized`:
  `seq-mean-token-mean`), so micro-batching and data parallelism keep verl's semantics. `none` is verl's stock loss
  bit for bit. Where the term is adapted, the core's pipeline makes it, with verl's `kl_loss_type` as its estimator:
  the log-probs in float32 with masked positions 0, checked, then verl's KL of them, shaped.
  beta_t comes from the driver's controller in the batch's meta info (`extra_info`), which verl hands to every mini-
  and micro-batch as non-tensor data: no extra call to the workers.
- The KL in the reward (`algorithm.use_kl_in_reward=True`, beta_0 = `algorithm.kl_ctrl.kl_coef`): our controller
  (`RewardKLController`) replaces verl's `kl_ctrl_in_reward`; verl's own `apply_kl_penalty` applies it (clip/sigmoid
  shape the per-token KL there) with verl's `algorithm.kl_penalty` as the estimator: keep verl's default `kl` (the
  log-ratio k1; `k1`, and either with a trailing '+', are the same value; any other warns, as the core's estimators
  that are not the log-ratio do in the reward). `dynamic` reads the batch's mean reward, `target` the batch's KL as
  `kl_target_measure` measures it (the core's `WindowKL`; a token mean by default) with `beta_min`/`beta_max`.
- `actor.kl_loss_type=kl` (k1) in the loss warns likewise (its expected gradient is zero on-policy).
- Both controllers and the step are saved in every verl checkpoint (`adaptive_kl.json` beside `data.pt`) and
  restored on resume: a resumed run uses the betas the uninterrupted run would have used.
- A NaN or +-inf log-prob on a valid (`response_mask`=1) token raises `NonFiniteLogProbError` naming verl's tensor:
  in the actor loss at the end of the actor update, in the driver (a worker whose sums say so counts its tokens and
  sends them with its process), and in the reward when the batch is penalised.
- Metrics: the core's `adaptive_kl/*` (docs/metrics.md) for the loss (`AdaptiveKL.record_sums`, once per actor
  update, from the core's sums row of every micro-batch of every worker, its KL as verl aggregates it) and, under
  `adaptive_kl/reward/`, the reward placement's for the reward (`AdaptiveKL.penalize`, once per batch), in verl's
  metrics dict, so its loggers get them.

The `adaptive_kl` block holds `AdaptiveKLConfig`'s fields; `adaptive_kl.reward.*` overrides any of them for the KL
in the reward. `kl_placement` is verl's own switches above and is not set here.

Importing this module imports verl and checks, in the installed source, every anchor it relies on: a missing one is
an `IncompatibleVersionError` naming it. It then makes verl's own trainers (the V1 base, the legacy `RayPPOTrainer`,
and every class derived from them) refuse a config holding an `adaptive_kl` block, which they would not read
(`patch()`; `unpatch()` undoes it).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import json
import logging
import math
import os
import re
import typing
import warnings
from types import SimpleNamespace
from typing import Any, Callable, Iterator, Optional

import torch

from ..core import AdaptiveKL, AdaptiveKLConfig, shape_kl, shapes_per_token
from ..core.adaptation import TokenKL, token_kl
from ..core.adaptive_kl import finite_mean_reward, kl_off_message
from ..core.config import (FIELD_DEFAULTS, K1_IN_LOSS, NOT_LOG_RATIO_IN_REWARD, STOCK_ESTIMATOR, EstimatorFields,
                           check_beta, check_whole, warn_estimator_issue)
from ..core.controllers import check_horizon
from ..core.errors import KLEstimatorWarning, reject
from ..core.numerics import (KINDS, NonFinite, found_in_check, masked_logps, masked_reference, nonfinite_error,
                             this_process)
from ..core.reductions import (agg_mode_of, kl_reduction, loss_type_of_agg_mode, loss_type_reduction,
                               reduction_left_as_is)
from ..core.shapings import clipped_tokens
from ..core.statistics import METRIC_PREFIX, NAMES, KLStatistics, check_logp_means
from ..core.statistics import local  # the driver's gather: it already holds every worker's values
from . import versions
from .patching import PatchSet

from verl.trainer.ppo import core_algos, ray_trainer  # noqa: E402  (verl: the integration's own extra)
from verl.trainer.ppo.v1 import trainer_base  # noqa: E402
from verl.trainer.ppo.v1.trainer_base import register_trainer  # noqa: E402
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.utils.metric import Metric, reduce_metrics  # noqa: E402
from verl.workers.config.actor import ActorConfig  # noqa: E402
from verl.workers.utils import losses  # noqa: E402

logger = logging.getLogger(__name__)

TRAINER_NAME = "adaptive_kl"
BETA_KEY = "adaptive_kl_beta"  # the loss beta in the batch's meta info / each micro-batch's non-tensor data
STATE_FILE = "adaptive_kl.json"
REWARD_METRIC = METRIC_PREFIX + "reward/"
# The worker's per-completion statistics, which the driver hands to the core; never logged.
STATS = "adaptive_kl_stats/"
# What the non-finite error calls verl's log-probs: the actor loss's, and the reward's.
LOSS_LOGPS = {"policy": "log_prob (the actor's forward)", "reference": "ref_log_prob", "old policy": "old_log_probs"}
REWARD_LOGPS = {"policy": "old_log_probs", "reference": "ref_log_prob"}


# ----- anchors ----------------------------------------------------------------------------------------------------


def check_anchors() -> None:
    """`IncompatibleVersionError` naming the first anchor missing from the installed verl; one
    `UntestedVersionWarning` for an untested verl whose anchors all hold."""
    versions.check_anchors("verl", versions.VERL_ANCHORS, versions.resolve_verl, where="verl.")


check_anchors()


# ----- configuration ----------------------------------------------------------------------------------------------

AGG_MODE_FIELD = "actor_rollout_ref.actor.loss_agg_mode"  # what an unknown aggregation mode's error names
# verl's own default for an actor config that does not set ppo_epochs
PPO_EPOCHS_DEFAULT = next(f.default for f in dataclasses.fields(ActorConfig) if f.name == "ppo_epochs")
_FIELDS = set(FIELD_DEFAULTS)
# Fields verl never reads, each with why: set to anything but its default, a ValueError (nothing silently does nothing).
NOT_READ_BY_VERL = {
    "ref_model_sync_kl": "the reference sync is TRL's (sync_ref_model); verl keeps its own reference model",
    "ref_model_sync_reset_optimizer": "the reference sync is TRL's (sync_ref_model); verl keeps its own reference "
                                      "model",
}
# Fields of the KL in the loss alone: verl's KL in the reward is `algorithm.kl_penalty`, subtracted from each token's
# reward, so a completion's penalty is beta_t * sum_t m k' whatever they say. Not inherited by the reward's config.
_REWARD_ESTIMATOR = "the estimator of the KL in the reward is verl's algorithm.kl_penalty: set that instead"
LOSS_ONLY = {
    "kl_estimator": _REWARD_ESTIMATOR,
    "kl_percentile": _REWARD_ESTIMATOR,
    "kl_percentile_scale": _REWARD_ESTIMATOR,
    "kl_reduction": "verl subtracts beta_t * k' from each token's reward, so a completion's penalty is always "
                    "beta_t * sum_t m k' (sequence_sum)",
}


def first_set(values: dict[str, Any], names: Any, also_default: tuple = ()) -> Optional[str]:
    """The first of `names` that `values` sets to something other than AdaptiveKLConfig's default (and than
    `also_default`, values that mean the default there), or None."""
    return next((name for name in names
                 if name in values and values[name] != FIELD_DEFAULTS[name] and values[name] not in also_default), None)


# AdaptiveKLConfig's fields that take None (annotated Optional)
NULLABLE = tuple(name for name, hint in typing.get_type_hints(AdaptiveKLConfig).items()
                 if type(None) in typing.get_args(hint))


def _plain(block: Any, where: str = "adaptive_kl") -> dict[str, Any]:
    """The block `where` as a dict; a value that is not a block of fields (`+adaptive_kl=clip`) is refused by name."""
    if block is None:
        return {}
    try:
        from omegaconf import OmegaConf

        if OmegaConf.is_config(block):
            block = OmegaConf.to_container(block, resolve=True)
    except ImportError:  # pragma: no cover - verl depends on omegaconf
        pass
    if not isinstance(block, dict):
        raise ValueError(f"{where}={block!r} is invalid: allowed is a block of AdaptiveKLConfig's fields, set one by "
                         f"one (+{where}.kl_adaptation_method=clip).")
    # Hydra reads `=None` as the text "None" (its None is `null`), where TRL's command line reads None for a field
    # that takes it: so does the block, for each (beta_schedule_steps=None was refused as "allowed is ... or None")
    return {name: None if name in NULLABLE and value == "None" else value for name, value in block.items()}


def _block(name: str, overrides: dict[str, Any]) -> str:
    """The block a field's value came from: `adaptive_kl.reward` where `reward` set it (`overrides`), else
    `adaptive_kl`."""
    return "adaptive_kl.reward" if name in overrides else "adaptive_kl"


def _reads(values: dict[str, Any], overrides: dict[str, Any]) -> Any:
    """`AdaptiveKLConfig.reads` of `values` (which fields its methods read), a kl_adaptation_method it cannot parse
    named with its block, as `_config` names a bad field."""
    config = AdaptiveKLConfig.unvalidated_from(SimpleNamespace(**values))
    try:
        config.kl_methods
    except ValueError as error:
        raise ValueError(f"{_block('kl_adaptation_method', overrides)}.{error}") from None
    return config.reads


def _config(values: dict[str, Any], overrides: dict[str, Any]) -> AdaptiveKLConfig:
    """AdaptiveKLConfig(**values), a bad value named with its block: `adaptive_kl.reward.` where `reward` set it
    (`overrides`), else `adaptive_kl.`. Its warnings are said once, in verl's terms: a field that has no effect with
    its block's prefix, k1 in the loss with verl's fixes (`VERL_BLOCK_FIELDS`: the core's would advise kl_placement,
    which verl refuses). What leaves beta where it is (`beta_held`) is not said here: the config knows no beta, and
    both configs are built whether their KL is on or off; each KL's controller says it (`verl_adaptive_kl`)."""
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        try:
            config = AdaptiveKLConfig(**values)
        except ValueError as error:
            name = str(error).split("=", 1)[0]
            if name not in values:  # not one field's error (a combination's): as the core words it
                raise
            raise ValueError(f"{_block(name, overrides)}.{error}") from None
    held = config.beta_held(None)
    for warning in said:
        message = str(warning.message)
        if message in held:
            continue
        if issubclass(warning.category, KLEstimatorWarning) and config.kl_placement == "loss":
            warn_estimator_issue(K1_IN_LOSS, config.kl_estimator, VERL_BLOCK_FIELDS, stacklevel=3)
        elif " has no effect: only " in message:
            if config.kl_estimator is None:  # the core names its placement's default, which verl does not use
                message = message.replace(f"the estimator in effect is {config.estimator!r}", VERL_OWN_ESTIMATOR)
            warnings.warn(f"{_block(message.split('=', 1)[0], overrides)}.{message}", warning.category, stacklevel=3)
        else:
            warnings.warn(warning.message, stacklevel=3)
    return config


def configs_from(block: Any, *, loss_on: bool = True, reward_on: bool = True
                 ) -> tuple[AdaptiveKLConfig, AdaptiveKLConfig]:
    """(loss config, reward config) from the `adaptive_kl` block: its fields for each config whose settings read them
    (the `LOSS_ONLY` ones for the loss alone), `reward.*` overriding them for the KL in the reward; a field that no
    config reads warns once. A ValueError names an unknown field, a bad value (with its block),
    `kl_placement`, a field verl never reads (`NOT_READ_BY_VERL`), a `LOSS_ONLY` field under `reward`, and a field
    set for a KL that is off (`loss_on`: actor.use_kl_loss, `reward_on`: algorithm.use_kl_in_reward), which would
    do nothing."""
    fields = _plain(block)
    reward_overrides = _plain(fields.pop("reward", None), "adaptive_kl.reward")
    for where, values in (("adaptive_kl", fields), ("adaptive_kl.reward", reward_overrides)):
        if "kl_placement" in values:
            raise ValueError(
                f"{where}.kl_placement={values['kl_placement']!r} is not used with verl: the KL acts in the loss with "
                "actor_rollout_ref.actor.use_kl_loss=True and in the reward with algorithm.use_kl_in_reward=True.")
        unknown = sorted(set(values) - _FIELDS)
        if unknown:
            raise ValueError(f"{where}: unknown field(s) {', '.join(unknown)}; allowed are AdaptiveKLConfig's fields: "
                             f"{', '.join(sorted(_FIELDS - {'kl_placement'}))}.")
        name = first_set(values, NOT_READ_BY_VERL)
        if name is not None:
            raise ValueError(f"{where}.{name}={values[name]!r} is not used with verl: {NOT_READ_BY_VERL[name]}.")
    name = first_set(reward_overrides, LOSS_ONLY, also_default=("sequence_sum",))  # kl_reduction: what verl does
    if name is not None:
        raise ValueError(f"adaptive_kl.reward.{name}={reward_overrides[name]!r} is not used with verl: "
                         f"{LOSS_ONLY[name]}.")
    shared = {name: value for name, value in fields.items() if name not in LOSS_ONLY}
    reward_fields = {**shared, **reward_overrides}
    # A shared field goes to the config that reads it; one that only the loss's reads, that neither reads, or that
    # `reward` overrides stays with the loss's, which says so if it does not read it. A field under `reward` is the
    # reward's.
    loss_reads, reward_reads = _reads(fields, {}), _reads(reward_fields, reward_overrides)
    loss = {name: value for name, value in fields.items()
            if loss_reads(name) or name in reward_overrides or not reward_reads(name)}
    reward = {name: value for name, value in reward_fields.items() if name in reward_overrides or reward_reads(name)}
    refuse_unused(fields, reward_overrides, set(reward) - set(reward_overrides), loss_on, reward_on)
    return _config(loss, {}), _config(reward, reward_overrides)


def refuse_unused(fields: dict[str, Any], reward_overrides: dict[str, Any], shared_with_reward: set[str],
                  loss_on: bool, reward_on: bool) -> None:
    """A ValueError for a field set (other than its default) for a KL that is off: under `reward` with
    algorithm.use_kl_in_reward=False, or at the top level where only the loss's config takes it (the reward's does not
    read it, `reward` overrides it, or the reward KL is off too) with actor.use_kl_loss=False."""
    name = first_set(reward_overrides, reward_overrides) if not reward_on else None
    if name is not None:
        raise ValueError(f"adaptive_kl.reward.{name}={reward_overrides[name]!r} acts on the KL in the reward, which "
                         "is off (algorithm.use_kl_in_reward=False): set algorithm.use_kl_in_reward=True, or leave "
                         "the adaptive_kl.reward block out.")
    if loss_on:
        return
    name = first_set(fields, [name for name in fields if not (reward_on and name in shared_with_reward)])
    if name is None:
        return
    if not reward_on:
        why = "the KL in the reward is off too (algorithm.use_kl_in_reward=False)"
    elif name in LOSS_ONLY:
        why = f"in the reward {LOSS_ONLY[name]}"
    elif name in reward_overrides:
        why = f"the KL in the reward takes adaptive_kl.reward.{name}={reward_overrides[name]!r}"
    else:
        why = "the settings of the KL in the reward do not read it"
    raise ValueError(f"adaptive_kl.{name}={fields[name]!r} acts on the KL in the actor loss, which is off "
                     f"(actor_rollout_ref.actor.use_kl_loss=False); {why}.")


def kl_agg_mode(config: AdaptiveKLConfig, loss_agg_mode: str) -> str:
    """verl's aggregation of the adapted KL: that of the core's `kl_reduction` for the loss type of `loss_agg_mode`
    (`kl_reduction`'s, length normalisation's, else `loss_agg_mode` itself). An unknown `loss_agg_mode` is a
    ValueError naming actor_rollout_ref.actor.loss_agg_mode and the allowed modes."""
    return agg_mode_of(kl_reduction(config, loss_type_of_agg_mode(loss_agg_mode, field=AGG_MODE_FIELD)),
                       field="adaptive_kl.kl_reduction")


# verl's names for the core's estimator guards, for KLEstimatorWarning's text: the KL in the actor loss
# is verl's `kl_loss_type` (unless `adaptive_kl.kl_estimator` replaces it), the KL in the reward verl's `kl_penalty`.
_VERL_FIELDS = dict(
    in_loss="actor_rollout_ref.actor.use_kl_loss=True", in_reward="algorithm.use_kl_in_reward=True",
    to_reward="algorithm.use_kl_in_reward=True with algorithm.kl_penalty=kl",
    loss_fix="+adaptive_kl.kl_estimator=k1_future (the whole completion's KL gradient), or "
             "actor_rollout_ref.actor.kl_loss_type=low_var_kl (k3, verl's default) or k2",
    reward_fix="algorithm.kl_penalty=kl (k1, verl's default)")
VERL_LOSS_FIELDS = EstimatorFields(estimator="actor_rollout_ref.actor.kl_loss_type", **_VERL_FIELDS)
VERL_REWARD_FIELDS = EstimatorFields(estimator="algorithm.kl_penalty", **_VERL_FIELDS)
VERL_BLOCK_FIELDS = EstimatorFields(estimator="adaptive_kl.kl_estimator", **_VERL_FIELDS)  # the estimator ours sets
# verl's kl_penalty / kl_loss_type values whose value is the log-ratio k1 ('+': the value of the base, k2's gradient).
VERL_LOG_RATIO = ("kl", "k1")
VERL_K3 = ("low_var_kl", "k3")  # verl's k3 (clamped), value and gradient: a '+' type takes k2's gradient


VERL_KL_TYPES = "kl, k1, abs, mse, k2, low_var_kl or k3, each also with a trailing '+' (verl's kl_penalty)"
# What a field that only an estimator of ours reads meets with `kl_estimator` unset: verl's own KL type.
VERL_OWN_ESTIMATOR = ("adaptive_kl.kl_estimator is unset, so verl's own KL type is in effect "
                      "(actor_rollout_ref.actor.kl_loss_type in the loss, algorithm.kl_penalty in the reward)")


def check_kl_type(field: str, value: Any) -> None:
    """verl's own `kl_penalty` of `value` on one token: a type verl does not compute (it raises NotImplementedError,
    at the first actor update or reward penalty) is refused here, before training, by its field."""
    try:
        core_algos.kl_penalty(torch.zeros(1, 1), torch.zeros(1, 1), kl_penalty=value)
    except (NotImplementedError, AttributeError, TypeError):
        raise reject(field, value, VERL_KL_TYPES) from None


def check_before_training(config: Any, loss_config: AdaptiveKLConfig, reward_config: AdaptiveKLConfig,
                          reward_block: dict[str, Any]) -> None:
    """What the trainer would otherwise find only after a rollout, refused by its verl field before training (and
    before verl's trainer is built, which would stop on a `kl_ctrl.type` it lacks with a bare NotImplementedError):
    `trainer.v1.sync.parameter_sync_step` other than 1 (the controllers move once per actor update), `ppo_epochs`,
    `kl_loss_type` and `kl_penalty` verl does not compute, a `target` horizon under which beta would
    reach 0 for good at n = data.train_batch_size x rollout.n completions a step (the core's `check_horizon`, at each
    KL's coefficient), and
    what this trainer would replace: verl's `kl_ctrl` beside the KL in the reward, its distillation loss beside the KL
    in the loss. `reward_block` is what the `adaptive_kl.reward` block set."""
    actor, algorithm = config.actor_rollout_ref.actor, config.algorithm
    on = {"loss": bool(actor.use_kl_loss), "reward": bool(algorithm.use_kl_in_reward)}
    # verl's sync mode runs parameter_sync_step actor updates (and reward penalties) per global step, on a slice of the
    # train batch each: the controllers would move that many times a global step, and no count would be verl's.
    sync_steps = (config.get("trainer", {}).get("v1", {}).get("sync") or {}).get("parameter_sync_step", 1)
    if sync_steps != 1:
        raise reject("trainer.v1.sync.parameter_sync_step", sync_steps,
                     f"1 under trainer.v1.trainer_mode={TRAINER_NAME} (one actor update per global step, which the "
                     "controllers move once per)")
    if on["loss"]:
        if config.get("distillation") is not None and config.distillation.get("enabled", False):
            raise ValueError("distillation.enabled=True is invalid with actor_rollout_ref.actor.use_kl_loss=True "
                             f"under trainer.v1.trainer_mode={TRAINER_NAME}: allowed is distillation.enabled=False, "
                             "or the KL in the reward alone (algorithm.use_kl_in_reward=True, use_kl_loss=False); "
                             "the adaptive actor loss is verl's ppo_loss, and would replace its distillation_ppo_loss.")
        epochs = actor.get("ppo_epochs", PPO_EPOCHS_DEFAULT)
        check_whole("actor_rollout_ref.actor.ppo_epochs", epochs, 1, "an integer >= 1")
        check_kl_type("actor_rollout_ref.actor.kl_loss_type", actor.kl_loss_type)
        # k3 named explicitly reads the trainer's own KL, as unset does (TRL's and Unsloth's are k3): here that is
        # kl_loss_type, which need not be k3
        if loss_config.kl_estimator == STOCK_ESTIMATOR and actor.kl_loss_type not in VERL_K3:
            raise ValueError(
                f"adaptive_kl.kl_estimator={STOCK_ESTIMATOR!r} is invalid with actor_rollout_ref.actor.kl_loss_type="
                f"{actor.kl_loss_type!r}: k3 means the trainer's own KL, which verl computes as kl_loss_type, so it "
                f"would train on {actor.kl_loss_type!r}. Allowed: kl_loss_type one of {', '.join(VERL_K3)} (verl's "
                "k3), or adaptive_kl.kl_estimator unset to adapt verl's kl_loss_type as it is.")
    if on["reward"]:
        check_kl_type("algorithm.kl_penalty", algorithm.get("kl_penalty", "kl"))
        kind = algorithm.kl_ctrl.get("type", "fixed")
        if kind != "fixed":  # verl's own controller would be replaced by ours, its target_kl and horizon unread
            raise ValueError(
                f"algorithm.kl_ctrl.type={kind!r} is invalid with trainer.v1.trainer_mode={TRAINER_NAME} and "
                "algorithm.use_kl_in_reward=True: allowed is 'fixed'. This package's controller takes the place "
                "of verl's kl_ctrl_in_reward; for a target KL (Ziegler et al.'s update, as verl's, but read on "
                "the batch's token-mean KL, where verl's reads the mean of each sequence's token mean) set "
                "+adaptive_kl.reward.kl_adaptation_method=target with "
                "+adaptive_kl.reward.kl_target=<target_kl> and +adaptive_kl.reward.kl_horizon=<horizon>, or "
                "leave trainer_mode unset for verl's own.")
    data, rollout = config.get("data"), config.actor_rollout_ref.get("rollout")
    if data is None or rollout is None or data.get("train_batch_size") is None or rollout.get("n") is None:
        return
    completions = int(data.train_batch_size) * int(rollout.n)
    for kl, settings in (("loss", loss_config), ("reward", reward_config)):
        if not on[kl] or "target" not in settings.kl_methods:
            continue
        try:
            check_horizon(settings, completions, actor.kl_loss_coef if kl == "loss" else algorithm.kl_ctrl.kl_coef)
        except ValueError as error:
            where = _block("kl_horizon", reward_block) if kl == "reward" else "adaptive_kl"
            raise ValueError(f"{where}.{str(error).rstrip('.')}; here n is data.train_batch_size x "
                             "actor_rollout_ref.rollout.n.") from None


def warn_verl_estimators(config: Any, loss_config: AdaptiveKLConfig) -> None:
    """The core's estimator guards in verl's terms (KLEstimatorWarning, once per process and setting): with
    `algorithm.use_kl_in_reward=True`, an `algorithm.kl_penalty` whose value is not the log-ratio ('kl'/'k1', with or
    without '+'); with `actor.use_kl_loss=True`, `actor.kl_loss_type` 'kl'/'k1' (no '+': '+' takes k2's gradient)
    where it is the KL of the loss (`adaptive_kl.kl_estimator` unset or 'k3'; a configured estimator replaces it and
    the core's own guard reads it)."""
    actor, algorithm = config.actor_rollout_ref.actor, config.algorithm
    if actor.use_kl_loss and loss_config.reads_trainer_kl and actor.kl_loss_type in VERL_LOG_RATIO:
        warn_estimator_issue(K1_IN_LOSS, actor.kl_loss_type, VERL_LOSS_FIELDS)
    if algorithm.use_kl_in_reward:
        kl_penalty = algorithm.get("kl_penalty", "kl")
        if (kl_penalty[:-1] if kl_penalty.endswith("+") else kl_penalty) not in VERL_LOG_RATIO:
            warn_estimator_issue(NOT_LOG_RATIO_IN_REWARD, kl_penalty, VERL_REWARD_FIELDS)


@contextlib.contextmanager
def said_by_config(config: AdaptiveKLConfig, *also: str) -> Iterator[None]:
    """Ignores `config`'s own warnings (a field with no effect for the placement, the estimator's), which `_config`
    said once in verl's terms, what leaves its beta where it is (`beta_held`, said by the controller), and the
    UserWarnings whose messages match the patterns `also`."""
    with warnings.catch_warnings():
        for message in (r".* has no effect: only ", *map(re.escape, config.beta_held(None)), *also):
            warnings.filterwarnings("ignore", message=message, category=UserWarning)
        warnings.filterwarnings("ignore", category=KLEstimatorWarning)
        yield


def verl_adaptive_kl(config: AdaptiveKLConfig, beta: float, coefficient: str, field: str, in_reward: bool = False,
                     overrides: Any = (), **kwargs: Any) -> AdaptiveKL:
    """The core's `AdaptiveKL` of `config` (the fields as the `field` block set them; `in_reward`: placed in the
    reward) at beta = verl's `coefficient`, whose beta-0 warning speaks verl's terms: the block's fields that would have
    no effect and the verl setting that turns the KL off (the core's names `beta` and, for the reward, the placement
    verl sets), as are its errors: a bad coefficient by its verl name, a bound it breaks (`beta_min`, `beta_max`) with
    it and the block that set the bound (`adaptive_kl.reward` for those in `overrides`, the fields the reward block
    set). The config's own warnings were said by `_config`, in verl's terms, and are not repeated; what leaves beta
    where it is (`beta_held`) is said here, once for each KL that is on, with its block and verl's coefficient."""
    check_beta(beta, coefficient)
    with said_by_config(config):
        placed = dataclasses.replace(config, kl_placement="reward") if in_reward else config
    fields = config.adapted_fields()
    if beta == 0.0 and fields:
        warnings.warn(kl_off_message([f"{field}.{setting}" for setting in fields], coefficient), UserWarning,
                      stacklevel=3)
    loss_type = kwargs.get("loss_type")
    unchanged = beta != 0.0 and loss_type is not None and reduction_left_as_is(
        placed, loss_type, prefix=f"{field}.",
        loss=f"{AGG_MODE_FIELD}={agg_mode_of(loss_type_reduction(loss_type))!r}")
    if unchanged:
        warnings.warn(unchanged, UserWarning, stacklevel=3)
    held = placed.beta_held(beta)
    with said_by_config(placed, re.escape(kl_off_message(placed.adapted_fields())),  # said in verl's terms
                        r".* has no effect: loss_type=.* already reduces the KL term", *map(re.escape, held)):
        try:
            akl = AdaptiveKL(placed, beta=beta, **kwargs)
        except ValueError as error:  # the core calls the coefficient `beta`, the block's fields by their own names
            bound = str(error).split("=", 1)[0]
            if bound in ("beta_min", "beta_max"):
                message = f"{_block(bound, overrides)}.{error} Here beta is {coefficient}={beta!r}."
                raise ValueError(message) from None
            raise
    for message in held:  # in verl's terms: the block that set the fields it names, and beta's verl name
        block = "adaptive_kl.reward" if any(re.search(rf"\b{name}\b", message) for name in overrides) else "adaptive_kl"
        warnings.warn(f"{block}: {message} Here beta is {coefficient}={beta!r}.", UserWarning, stacklevel=3)
    return akl


# ----- the KL in the actor loss (runs in every actor worker) -------------------------------------------------------


def verl_kl_penalty(logp: torch.Tensor, ref: torch.Tensor, mask: torch.Tensor, *, kl_type: str) -> torch.Tensor:
    """verl's per-token KL (`kl_penalty` of `kl_loss_type`) as the core's estimator (logp, ref, mask) -> k, taken of
    the log-probs the core masked (0 on masked positions on both sides, where every verl KL type is 0)."""
    return core_algos.kl_penalty(logprob=logp, ref_logprob=ref, kl_penalty=kl_type)


class AdaptivePPOLoss:
    """verl's `ppo_loss` with its KL term adapted; installed on the actor workers with `set_loss_fn`. Picklable: the
    driver builds it and Ray ships it once.

    loss = ppo_loss with kl_loss_coef = beta_t and its KL term agg_loss(shape(k), mask, mode, global batch info),
    k = verl's kl_penalty of `kl_loss_type` (or the configured `kl_estimator`) of the core's masked log-probs (the
    core's pipeline, `token_kl`), beta_t = the micro-batch's `adaptive_kl_beta` (the driver's controller), mode =
    `loss_agg_mode` (length_normalized: seq-mean-token-mean). ppo_loss's `kl_penalty` and `agg_loss` calls are
    replaced for the call, so the policy log-probs are padded once, by verl. Where nothing is shaped and verl's own
    KL term stands (`none`: `is_stock_kl`), the term is verl's own, bit for bit on the valid tokens: ppo_loss itself,
    its KL taken against the reference with masked positions set to the policy's (`masked_reference`: 0 there with a
    finite gradient, whatever the padding held), and the pipeline checks the log-probs and masks that KL for the
    statistics. A moving beta (`dynamic`, `target`) takes the pipeline's float32 term, as at every other door.

    Metrics, per micro-batch: verl's own `kl_loss` (the un-adapted KL: its stock meaning) and `kl_coef` (beta_t), and
    under `STATS` the core's sums row of the micro-batch (`KLStatistics`' fields in order) and the non-finite valid
    log-probs found, which the driver hands to the core (`AdaptiveKL.record_sums`, `NonFiniteLogProbError`)."""

    def __init__(self, actor_config: Any, config: AdaptiveKLConfig) -> None:
        self.config = config
        self.agg_mode = kl_agg_mode(config, actor_config.loss_agg_mode)
        self.verl_term = config.is_stock_kl
        # What the pipeline runs: the configured estimator, or where the config reads the trainer's own KL, verl's
        # kl_loss_type as the estimator.
        # (the config's warnings were said by the driver, in verl's terms: not again per worker)
        with said_by_config(config):
            self.pipeline_config = config if not config.reads_trainer_kl else dataclasses.replace(
                config, kl_estimator=functools.partial(verl_kl_penalty, kl_type=actor_config.kl_loss_type))
        # A copy sharing global_batch_info (which ppo_loss fills in), whose kl_loss_coef is beta_t.
        self.stock_config = copy.copy(actor_config)

    def __call__(self, model_output: Any, data: Any, dp_group: Any = None) -> tuple[torch.Tensor, dict[str, Any]]:
        beta = tu.get_non_tensor_data(data=data, key=BETA_KEY, default=None)
        if beta is None:  # the driver pushes beta_t with every actor update: without it the controller is not in use
            raise RuntimeError(
                f"adaptive_kl: the actor loss found no {BETA_KEY!r} in the micro-batch's non-tensor data: the adaptive "
                f"loss runs under trainer.v1.trainer_mode={TRAINER_NAME}, whose driver pushes the controller's beta_t "
                "with each actor update. Without it the loss would train at actor.kl_loss_coef, silently not "
                "adaptive.")
        object.__setattr__(self.stock_config, "kl_loss_coef", float(beta))
        kl = _LossKL(self)
        # Replaces verl's kl_penalty and agg_loss as verl.workers.utils.losses references them (ppo_loss calls them),
        # for this call only: ppo_loss's own KL becomes the adapted term.
        with PatchSet() as patches:
            patches.replace(losses, "kl_penalty", kl.per_token)
            patches.replace(losses, "agg_loss", kl.aggregate)
            # And verl's get_policy_loss_fn, as ppo_loss calls it: its policy loss, called before the KL term, is
            # verl's own; its old_log_prob is kept, so that the KL's check covers the importance ratio's denominator.
            patches.replace(losses, "get_policy_loss_fn", kl.policy_loss_fn)
            loss, metrics = losses.ppo_loss(self.stock_config, model_output, data, dp_group)
        if not self.verl_term:  # verl's kl_loss keeps its stock meaning: the un-adapted KL of kl_loss_type
            metrics["kl_loss"] = Metric(value=kl.raw if kl.stock is None else kl.stock,
                                        aggregation=metrics["kl_loss"].aggregation)
        metrics.update(kl.statistics())
        return loss, metrics


def micro_batch_entries(tokens: float, batch_info: dict[str, Any]) -> float:
    """How many entries one micro-batch's KL counts for in its sums row, `tokens` its valid tokens. verl's agg_loss
    divides a micro-batch's KL by the whole mini-batch's valid tokens (`batch_num_tokens`, over every data-parallel
    rank: every verl engine passes it) and multiplies it by dp_size (data parallelism averages the gradients); verl's
    metric is then the sum over the micro-batches, averaged over the ranks. So a micro-batch counts for dp_size times
    its share of the mini-batch's tokens (the shares of a mini-batch add up to 1 over all ranks), and
    raw_kl = sum raw / entries is verl's KL of each mini-batch, averaged over the mini-batches. Without
    batch_num_tokens (verl's per-micro-batch means): one entry per micro-batch, the core's count."""
    batch_tokens = batch_info.get("batch_num_tokens")
    if batch_tokens is None:
        return 1.0
    return tokens * int(batch_info.get("dp_size") or 1) / max(float(batch_tokens), 1.0)


class _LossKL:
    """verl's `kl_penalty` and `agg_loss` inside one `ppo_loss` call: the per-token KL ppo_loss computes is kept, and
    its aggregation becomes the adapted term (verl's own where nothing is adapted)."""

    def __init__(self, owner: AdaptivePPOLoss) -> None:
        self.owner = owner
        self.log_probs: tuple[torch.Tensor, torch.Tensor] | None = None
        self.old_log_prob: Optional[torch.Tensor] = None  # ppo_loss's old_log_prob, checked with the KL's log-probs
        self.verl_kld: Optional[torch.Tensor] = None
        self.stage: Optional[TokenKL] = None
        self.raw: Optional[torch.Tensor] = None  # verl's aggregation of the un-adapted KL, and of the adapted one
        self.adapted: Optional[torch.Tensor] = None
        self.kl_type = ""  # verl's kl_loss_type, as ppo_loss passes it
        self.stock: Optional[torch.Tensor] = None  # verl's kl_loss metric where an estimator replaces kl_loss_type
        self.batch_info: dict[str, Any] = {}

    def policy_loss_fn(self, loss_mode: str) -> Callable[..., Any]:
        """verl's `get_policy_loss_fn(loss_mode)`, its function called as it is, keeping the `old_log_prob` ppo_loss
        passes it."""
        upstream = core_algos.get_policy_loss_fn(loss_mode)

        def policy_loss(*args: Any, **kwargs: Any) -> Any:
            self.old_log_prob = kwargs.get("old_log_prob")
            return upstream(*args, **kwargs)

        return policy_loss

    def per_token(self, logprob: torch.Tensor, ref_logprob: torch.Tensor, kl_penalty: str) -> torch.Tensor:
        """ppo_loss's per-token KL: an empty stand-in, remembered so that its aggregation below is recognised, as
        the KL (verl's own term too) needs the mask, which only `agg_loss` receives."""
        self.log_probs, self.kl_type = (logprob, ref_logprob), kl_penalty
        self.verl_kld = logprob.new_empty(0)
        return self.verl_kld

    def aggregate(self, loss_mat: torch.Tensor, loss_mask: torch.Tensor, loss_agg_mode: str,
                  **batch_info: Any) -> torch.Tensor:
        """verl's agg_loss; for ppo_loss's KL term, the adapted KL (the core's pipeline: masked, checked, estimated,
        shaped) aggregated by verl's agg_loss with the global batch info ppo_loss passes, beside the un-adapted one
        for the metrics."""
        if loss_mat is not self.verl_kld:  # another of ppo_loss's terms (the entropy)
            return core_algos.agg_loss(loss_mat=loss_mat, loss_mask=loss_mask, loss_agg_mode=loss_agg_mode,
                                       **batch_info)
        owner, (logprob, ref_logprob) = self.owner, self.log_probs
        self.batch_info = batch_info
        if owner.verl_term:  # verl's own term, bit for bit on valid tokens; the pipeline masks it for the statistics
            # Replaces verl's kl_penalty(log_prob, ref_log_prob) in ppo_loss: masked positions compare the policy with
            # itself (k = 0 for every kl_loss_type), so a NaN or -inf there cannot reach the loss or its gradient.
            kld = core_algos.kl_penalty(logprob=logprob, ref_logprob=masked_reference(ref_logprob, logprob, loss_mask),
                                        kl_penalty=self.kl_type)
            with torch.no_grad():
                self.stage = token_kl(logprob, ref_logprob, loss_mask, owner.pipeline_config, per_token_kl=kld,
                                      old_logps=self.old_log_prob)
            self.adapted = core_algos.agg_loss(loss_mat=kld, loss_mask=loss_mask, loss_agg_mode=loss_agg_mode,
                                               **batch_info)
            self.raw = self.adapted.detach()
            return self.adapted
        self.stage = stage = token_kl(logprob, ref_logprob, loss_mask, owner.pipeline_config,
                                      old_logps=self.old_log_prob)
        # verl's agg_loss multiplies the loss by its mask and sums it per sequence: given the mask as float32,
        # converted once here for both aggregations, it does so faster than with verl's bool mask (~10 us a call on a
        # CPU at 8 x 1024, measured), with the same values (0/1; the counts exact).
        weights = loss_mask.float()
        self.raw = core_algos.agg_loss(loss_mat=stage.kl.detach(), loss_mask=weights, loss_agg_mode=loss_agg_mode,
                                       **batch_info)
        self.adapted = core_algos.agg_loss(loss_mat=stage.shaped, loss_mask=weights, loss_agg_mode=owner.agg_mode,
                                           **batch_info)
        if not owner.config.reads_trainer_kl:  # verl's kl_loss metric is of kl_loss_type, not of the estimator
            with torch.no_grad():
                self.stock = core_algos.agg_loss(
                    loss_mat=core_algos.kl_penalty(logprob=logprob, ref_logprob=ref_logprob, kl_penalty=self.kl_type),
                    loss_mask=loss_mask, loss_agg_mode=loss_agg_mode, **batch_info)
        return self.adapted

    def statistics(self) -> dict[str, list[float]]:
        """The core's sums row of the micro-batch (`KLStatistics`, its fields in order), from L_i, S_i and the
        micro-batch's scalars read to the host in one transfer (verl's own metrics synchronise every micro-batch
        already): raw and adapted are verl's aggregations, counting for `micro_batch_entries`; and, where a valid
        log-prob is non-finite, [tensor (its index in `KINDS`), process, tokens] for each: lists, which verl
        concatenates over micro-batches, workers and mini-batches."""
        stage, config = self.stage, self.owner.config
        with torch.no_grad():  # statistics only: no graph
            lengths = stage.valid.sum(-1, dtype=stage.kl.dtype)  # L_i and S_i as the core's kl_term takes them
            clipped = clipped_tokens(stage.kl, config, lengths)
            values = torch.cat([lengths, stage.kl.sum(-1), self.raw.view(1), self.adapted.view(1), clipped.view(1),
                                stage.check.sums]).tolist()
        count = len(lengths)
        raw, adapted, clipped, policy, reference, old = values[2 * count:]
        sums = KLStatistics.of_completions(
            values[:count], values[count:2 * count], entries=micro_batch_entries(sum(values[:count]), self.batch_info),
            raw=raw, adapted=adapted, clipped=clipped, policy_logps=policy, reference_logps=reference, old_logps=old)
        row = [getattr(sums, name) for name in NAMES]
        checked = (policy, reference, old)
        found = [] if all(map(math.isfinite, checked)) else found_in_check(stage.check, this_process())
        return {STATS + "sums": row,
                STATS + "nonfinite": [number for item in found
                                      for number in (KINDS.index(item.kind), item.process, item.tokens)]}


def raise_if_nonfinite(found: list[float], step: int) -> None:
    """`NonFiniteLogProbError` where the workers found non-finite valid log-probs in an actor update: `found` the
    [tensor, process, tokens] numbers `_LossKL.statistics` sent, which verl concatenates over micro-batches, workers
    and mini-batches; each tensor named as verl calls it, with the worker's process and its tokens."""
    tokens: dict[tuple[int, int], int] = {}
    for kind, process, count in zip(found[::3], found[1::3], found[2::3]):
        tokens[int(kind), int(process)] = tokens.get((int(kind), int(process)), 0) + int(count)
    if tokens:
        raise nonfinite_error(step, [NonFinite(f"verl's {LOSS_LOGPS[KINDS[kind]]}", KINDS[kind], process, count)
                                     for (kind, process), count in sorted(tokens.items())],
                              advice="check the actor's and the reference's forward in this precision, and the old "
                              "log-probs the rollout computed")


# ----- the KL in the reward (runs in the driver) -------------------------------------------------------------------


class RewardKLController:
    """Our controller in place of verl's `kl_ctrl_in_reward`: `value` is beta_t, and verl's `apply_kl_penalty`
    calls `update(current_kl=, n_steps=)` once per batch. `dynamic` reads the batch's mean reward (set by the trainer
    with `observe_rewards` before verl scores the batch); `target` reads the batch's KL as `penalize` measured it (the
    core's `WindowKL`, by `kl_target_measure`: sum of k over valid tokens / their count by default, token_mean),
    bounded by beta_min/beta_max."""

    def __init__(self, config: AdaptiveKLConfig, beta: float, field: str = "adaptive_kl.reward",
                 overrides: Any = (), loss_on: bool = True) -> None:
        # verl subtracts beta_t * k' from each valid token's reward, so a completion's penalty is beta_t * sum_t m k':
        # the core's KL_i in the reward under kl_reduction 'loss_type' or 'sequence_sum', the two `configs_from`
        # lets through. The core object is told the KL is in the reward, and its rules for that placement apply
        # (each step reads the batch scored since the last one). length_normalized is refused in verl's terms
        # (`field`: where the method was set; `loss_on`: whether the actor loss's KL, where it acts, is on): the
        # core's advice, kl_reduction='sequence_mean', is not verl's.
        if "length_normalized" in config.kl_methods:
            methods = "+".join(method for method in config.kl_methods if method != "length_normalized") or "none"
            if field != "adaptive_kl":
                advice = "."
            elif loss_on:
                advice = (f"; set +adaptive_kl.reward.kl_adaptation_method={methods} to keep length_normalized for "
                          "the KL in the actor loss alone.")
            else:
                advice = (f"; set adaptive_kl.kl_adaptation_method={methods}: length_normalized acts on the KL in "
                          "the actor loss alone, which is off (actor_rollout_ref.actor.use_kl_loss=False).")
            raise ValueError(
                f"{field}.kl_adaptation_method={config.kl_adaptation_method!r} is invalid with "
                "algorithm.use_kl_in_reward=True: allowed is methods without length_normalized there (verl's reward "
                "KL is the sum over each completion's tokens)" + advice)
        self.akl = verl_adaptive_kl(config, beta, "algorithm.kl_ctrl.kl_coef", field, overrides=overrides,
                                    in_reward=True, loss_type="bnpo")
        self._mean_reward: Optional[float] = None

    @property
    def value(self) -> float:
        return self.akl.current_beta

    @property
    def moves_beta(self) -> bool:
        return self.akl.moves_beta

    @property
    def config(self) -> AdaptiveKLConfig:
        return self.akl.config

    def observe_rewards(self, mean_reward: float) -> None:
        """The mean (un-penalised) reward of the batch about to be penalised, read as the core's every door reads
        it (a finite number; else a ValueError naming it, here rather than at `update`)."""
        self._mean_reward = finite_mean_reward(mean_reward)

    def penalize(self, kld: torch.Tensor, old: torch.Tensor, ref: torch.Tensor, mask: torch.Tensor
                 ) -> dict[str, float]:
        """The core's reward-placement metrics (`adaptive_kl/*`) of a batch whose per-token KL is verl's `kld` (of
        the log-probs `old` and `ref`, whose check it carries: the core raises `NonFiniteLogProbError` where a valid
        one is not finite), at the beta that penalises it; the batch's KL is kept for the next `update`."""
        # As `AdaptiveKL.reward_penalty` in a loop of your own: beta_t at this step, the batch's KL kept for `step`.
        term = self.akl.term(old, ref, mask, per_token_kl=kld, names=REWARD_LOGPS)
        _, metrics = self.akl.penalize(term, gather=local, train=True, completed_steps=self.akl.completed_steps)
        return metrics

    def update(self, current_kl: float, n_steps: int) -> None:
        """verl's call, once per batch: the controller's step from this batch's reward and the KL `penalize` kept.
        verl's `current_kl` (a mean of each sequence's token mean) and `n_steps` are not read: the core's window
        carries the batch's token mean and completion count."""
        mean_reward, self._mean_reward = self._mean_reward, None
        self.akl.step(mean_reward)

    def state_dict(self) -> dict[str, Any]:
        return self.akl.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.akl.load_state_dict(state)


def apply_adaptive_kl_penalty(data: Any, kl_ctrl: RewardKLController, kl_penalty: str = "kl") -> tuple[Any, dict]:
    """verl's own `apply_kl_penalty`, given the core's masked log-probs (float32, 0 on masked positions: a NaN or inf
    there, which verl multiplies by the mask, NaN * 0 being NaN, leaves the rewards finite) and, where a method shapes
    the per-token KL (clip/sigmoid), the shaped KL in place of its `kl_penalty`: token_level_rewards =
    token_level_scores - beta_t * shape(k), k verl's `kl_penalty` of those log-probs, and verl's metrics of the KL it
    subtracted; plus the core's reward-placement metrics under `adaptive_kl/reward/`. A non-finite `old_log_probs` or
    `ref_log_prob` on a valid token raises `NonFiniteLogProbError` before any reward is penalised."""
    mask = data.batch["response_mask"]
    old, ref = masked_logps(data.batch["old_log_probs"], data.batch["ref_log_prob"], mask)
    kld = core_algos.kl_penalty(old, ref, kl_penalty=kl_penalty)
    adaptive = kl_ctrl.penalize(kld, old, ref, mask)
    raw = {key: data.batch[key] for key in ("old_log_probs", "ref_log_prob")}  # the batch keeps its own after
    data.batch["old_log_probs"], data.batch["ref_log_prob"] = old, ref
    try:
        with PatchSet() as patches:
            if shapes_per_token(kl_ctrl.config):
                shaped = shape_kl(kld, kl_ctrl.config)  # every shaping maps a masked position's 0 to 0
                # Replaces verl's core_algos.kl_penalty, as apply_kl_penalty calls it (anchored), for this call only.
                patches.replace(core_algos, "kl_penalty", lambda *args, **kwargs: shaped)
            data, metrics = ray_trainer.apply_kl_penalty(data, kl_ctrl=kl_ctrl, kl_penalty=kl_penalty)
    finally:
        for key, value in raw.items():
            data.batch[key] = value
    metrics.update({REWARD_METRIC + key.removeprefix(METRIC_PREFIX): value for key, value in adaptive.items()})
    return data, metrics


# ----- the trainer (runs in the driver) ----------------------------------------------------------------------------


class AdaptiveKLTrainerMixin:
    """What the V1 trainer gains: the controllers, beta in each actor update's meta info, the adaptive loss on the
    actor workers, the reward controller, metrics and checkpoints. Mixed into a verl trainer class."""

    base_trainer_mode = "sync"

    def __init__(self, config: Any) -> None:
        from omegaconf import open_dict

        actor = config.actor_rollout_ref.actor
        loss_config, reward_config = configs_from(config.get("adaptive_kl"), loss_on=bool(actor.use_kl_loss),
                                                  reward_on=bool(config.algorithm.use_kl_in_reward))
        overrides = _plain(_plain(config.get("adaptive_kl")).get("reward"), "adaptive_kl.reward")
        check_before_training(config, loss_config, reward_config, overrides)
        self._reward_overrides = overrides
        with open_dict(config):  # verl's mode logic (replay buffer, checkpoints) keys on its own mode names
            config.trainer.v1.trainer_mode = self.base_trainer_mode
        super().__init__(config)
        warn_verl_estimators(config, loss_config)
        self.adaptive_kl_config = loss_config
        self.loss_kl: Optional[AdaptiveKL] = None
        if actor.use_kl_loss:
            # The update's per-completion statistics hold each completion once per PPO epoch: target's n counts it once.
            self.loss_kl = verl_adaptive_kl(
                loss_config, actor.kl_loss_coef, "actor_rollout_ref.actor.kl_loss_coef", "adaptive_kl",
                loss_type=loss_type_of_agg_mode(actor.loss_agg_mode, field=AGG_MODE_FIELD),
                num_iterations=actor.get("ppo_epochs", PPO_EPOCHS_DEFAULT))
            kl_agg_mode(loss_config, actor.loss_agg_mode)  # a kl_reduction verl cannot aggregate: now, not on a worker
        self.reward_kl: Optional[RewardKLController] = None
        if config.algorithm.use_kl_in_reward:
            self.reward_kl = RewardKLController(
                reward_config, beta=config.algorithm.kl_ctrl.kl_coef, overrides=overrides,
                field=_block("kl_adaptation_method", overrides),
                loss_on=bool(actor.use_kl_loss))
            self.kl_ctrl_in_reward = self.reward_kl
        if self.loss_kl is None and self.reward_kl is None:
            warnings.warn("adaptive_kl: neither actor_rollout_ref.actor.use_kl_loss nor algorithm.use_kl_in_reward is "
                          "on: there is no KL to adapt.", stacklevel=2)
        self._mean_reward: Optional[float] = None
        # The controllers that read the batch's mean reward (dynamic, a registered one), by the field that set their
        # method: where none does (a constant beta, target), the reward is not read, so a non-finite one trains as
        # under verl's own trainer.
        self._reward_readers = [
            f"{field}.kl_adaptation_method={akl.config.kl_adaptation_method!r}"
            for field, akl in (("adaptive_kl", self.loss_kl),
                               (_block("kl_adaptation_method", overrides), self.reward_kl and self.reward_kl.akl))
            if akl is not None and akl.reads_rewards]

    # -- setup: the adaptive loss on the actor workers
    def _setup(self) -> None:
        super()._setup()
        self._warn_if_schedule_after_run()
        if self.loss_kl is not None:
            from verl.utils.config import omega_conf_to_dataclass

            actor_config = omega_conf_to_dataclass(self.config.actor_rollout_ref.actor)
            self.actor_rollout_wg.set_loss_fn(AdaptivePPOLoss(actor_config, self.adaptive_kl_config))

    def _warn_if_schedule_after_run(self) -> None:
        """`dynamic`'s beta_schedule_steps at or past the run's last step (verl's total_training_steps, known once
        its dataloader is built) is said, for each KL's config, as TRL's trainer says it (`ScheduleCheck`)."""
        kls = ((self.loss_kl, "adaptive_kl"),
               (self.reward_kl and self.reward_kl.akl, _block("beta_schedule_steps", self._reward_overrides)))
        for akl, block in kls:
            if akl is None:  # that KL is off
                continue
            late = akl.config.schedule_after_run(akl.beta, self.total_training_steps, f"{block}.beta_schedule_steps")
            if late is not None:
                warnings.warn(late, UserWarning, stacklevel=3)

    # -- each step
    def _batch_mean_reward(self, batch: Any) -> Optional[float]:
        """The mean un-penalised sequence reward of the batch's real (non-padding) samples, as verl's
        critic/score/mean; None for a batch of padding alone, whose mean reward is undefined (the controllers then
        observe none: padding is not a reward)."""
        import transfer_queue as tq

        keep = [i for i, tag in enumerate(batch.tags) if not tag.get("is_padding", False)]
        if not keep:
            return None
        data = tq.kv_batch_get(keys=[batch.keys[i] for i in keep], partition_id=batch.partition_id,
                               select_fields=["rm_scores"])
        scores = data["rm_scores"]
        totals = torch.stack([row.sum() for row in scores.unbind()]) if scores.is_nested else scores.sum(-1)
        mean = float(totals.float().mean())
        if not math.isfinite(mean):  # here, before the update: the core would refuse it after, as mean_reward
            raise ValueError(f"adaptive_kl: the batch's mean reward (verl's critic/score/mean, rm_scores summed per "
                             f"sample) is {mean}: a reward returned NaN or +-inf for a sample; allowed are finite "
                             f"rewards where a beta controller reads them ({', '.join(self._reward_readers)}: dynamic "
                             "would decay on +inf at every step, and never on NaN).")
        return mean

    def _compute_advantage(self, batch: Any, metrics: dict) -> Any:
        if self._reward_readers:
            self._mean_reward = self._batch_mean_reward(batch)
        if self.reward_kl is None:
            return super()._compute_advantage(batch, metrics)
        if self._mean_reward is not None:
            self.reward_kl.observe_rewards(self._mean_reward)
        # Replaces verl's apply_kl_penalty (ray_trainer), as the V1 trainer module references it (anchored), for
        # this call only.
        with PatchSet() as patches:
            patches.replace(trainer_base, "apply_kl_penalty", apply_adaptive_kl_penalty)
            return super()._compute_advantage(batch, metrics)

    def _update_actor(self, batch: Any, metrics: dict) -> Any:
        if self.loss_kl is None:
            return super()._update_actor(batch, metrics)
        batch.extra_info[BETA_KEY] = self.loss_kl.current_beta
        stats: dict[str, list[float]] = {}

        def reduce_keeping_stats(output: dict) -> dict:
            """verl's reduce_metrics, which averages every list: the per-completion statistics reach the core whole."""
            for key in [key for key in output if key.startswith("actor/" + STATS)]:
                stats[key[len("actor/" + STATS):]] = output.pop(key)
            return reduce_metrics(output)

        # Replaces verl's reduce_metrics, as the V1 trainer module references it (anchored), for this call only.
        with PatchSet() as patches:
            patches.replace(trainer_base, "reduce_metrics", reduce_keeping_stats)
            batch = super()._update_actor(batch, metrics)
        batch.extra_info.pop(BETA_KEY, None)
        step = self.loss_kl.completed_steps + 1
        raise_if_nonfinite(stats["nonfinite"], step)
        # The update's sums: every micro-batch's row, over every worker, mini-batch and PPO epoch.
        rows = torch.tensor(stats["sums"], dtype=torch.float64).view(-1, len(NAMES)).tolist()
        update = sum((KLStatistics(*row) for row in rows), KLStatistics())
        # Refused, as the non-finite input above, before the reward is observed (a refused update leaves the run as it
        # was), naming verl's tensors; record_sums checks the same sums again under the core's names.
        check_logp_means([update], step, tuple(f"verl's {LOSS_LOGPS[kind]}" for kind in KINDS))
        if self._mean_reward is not None:
            self.loss_kl.observe_rewards(self._mean_reward)
        (logged,) = self.loss_kl.record_sums([update], train=True, completed_steps=step)
        metrics.update(logged)
        return batch

    # -- checkpoints
    def adaptive_kl_state(self) -> dict[str, Any]:
        return {"global_steps": self.global_steps,
                "loss": None if self.loss_kl is None else self.loss_kl.state_dict(),
                "reward": None if self.reward_kl is None else self.reward_kl.state_dict()}

    def load_adaptive_kl_state(self, state: dict[str, Any]) -> None:
        """Each controller's state from a checkpoint's `adaptive_kl.json`; a KL whose beta moves and whose state the
        checkpoint lacks (saved with that KL off, or set to null) warns, naming it: its controller restarts from its
        initial beta. What the core says of a loaded beta (a changed beta, a clamp) is said in verl's terms: which KL,
        beta's verl name, and how to restart that KL's controller alone."""
        kls = (("loss", self.loss_kl, "actor_rollout_ref.actor.kl_loss_coef"),
               ("reward", self.reward_kl and self.reward_kl.akl, "algorithm.kl_ctrl.kl_coef"))
        for name, target, coefficient in kls:
            if target is None or (state.get(name) is None and not target.moves_beta):
                continue
            if state.get(name) is None:
                warnings.warn(f"adaptive_kl: the checkpoint holds no controller state for the KL in the {name} (saved "
                              "with it off, or set to null): its controller restarts from its initial beta.",
                              stacklevel=2)
                continue
            with warnings.catch_warnings(record=True) as said:
                warnings.simplefilter("always")
                target.load_state_dict(state[name], without_state=f'set "{name}": null in the checkpoint\'s '
                                                                  f'{STATE_FILE}')
            for warning in said:  # the core's words, of a KL it cannot tell apart from the other one
                message = str(warning.message)
                if message.startswith("adaptive KL: "):
                    message = (f"adaptive_kl: the KL in the {name}: {message.removeprefix('adaptive KL: ')} Here beta "
                               f"is {coefficient}={target.beta!r}.")
                warnings.warn(message, warning.category, stacklevel=2)

    def _save_checkpoint(self) -> None:
        folder = os.path.join(self.config.trainer.default_local_dir, f"global_step_{self.global_steps}")
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, STATE_FILE), "w") as handle:  # before verl marks the checkpoint latest
            json.dump(self.adaptive_kl_state(), handle)
        super()._save_checkpoint()

    def _load_checkpoint(self) -> None:
        super()._load_checkpoint()
        if not self.global_steps:
            return
        trainer = self.config.trainer
        if trainer.resume_mode == "resume_path":
            folder = trainer.resume_from_path
        else:
            folder = os.path.join(trainer.default_local_dir, f"global_step_{self.global_steps}")
        if not os.path.isabs(folder):
            folder = os.path.join(os.getcwd(), folder)
        path = os.path.join(folder, STATE_FILE)
        if not os.path.exists(path):
            if any(target is not None and target.moves_beta for target in (self.loss_kl, self.reward_kl)):
                warnings.warn(f"adaptive_kl: {path} is missing: the controllers restart from their initial beta.",
                              stacklevel=2)
            return
        with open(path) as handle:
            self.load_adaptive_kl_state(json.load(handle))


@register_trainer(TRAINER_NAME)
class AdaptiveKLPPOTrainer(AdaptiveKLTrainerMixin, PPOTrainerSync):
    """verl's synchronous V1 trainer (`trainer.v1.trainer_mode=sync`) with adaptive KL; selected with
    `trainer.v1.trainer_mode=adaptive_kl`."""


# ----- the adaptive_kl block under verl's own trainers -------------------------------------------------------------


def refusing_the_block(init: Any) -> Any:
    """A trainer's `__init__(self, config, ...)` that first refuses a config holding an `adaptive_kl` block unless the
    trainer is ours: verl's own trainers read none of it, so a run that left out trainer.v1.trainer_mode=adaptive_kl
    (or set trainer.use_v1=False, verl's legacy trainer) would train without it, silently."""

    @functools.wraps(init)
    def __init__(self: Any, config: Any, *args: Any, **kwargs: Any) -> None:
        if not isinstance(self, AdaptiveKLTrainerMixin) and config.get("adaptive_kl") is not None:
            if isinstance(self, trainer_base.PPOTrainer):
                mode = config.get("trainer", {}).get("v1", {}).get("trainer_mode")
                which, allowed = f"verl's own trainer (trainer.v1.trainer_mode={mode!r})", ""
            else:  # main_ppo's legacy path
                which, allowed = "verl's legacy trainer (trainer.use_v1=False)", "trainer.use_v1=True with "
            raise ValueError(
                f"adaptive_kl: the config holds an adaptive_kl block, but {type(self).__name__} is {which}, which "
                f"reads none of it: allowed is {allowed}trainer.v1.trainer_mode={TRAINER_NAME}; or remove the block "
                "to train without adaptive KL.")
        init(self, config, *args, **kwargs)

    return __init__


_patches = PatchSet()


def refuse_in(cls: type) -> None:
    """Give `cls`'s own `__init__`, where it defines one, the refusal (`refusing_the_block`)."""
    if "__init__" in vars(cls) and not _patches.replaced(cls, "__init__"):
        _patches.replace(cls, "__init__", refusing_the_block(vars(cls)["__init__"]))


def refusing_subclasses(base: type) -> classmethod:
    """`base.__init_subclass__`: each class derived from it from now on gets the refusal in its own `__init__`."""

    def __init_subclass__(cls: type, **kwargs: Any) -> None:
        super(base, cls).__init_subclass__(**kwargs)
        refuse_in(cls)

    return classmethod(__init_subclass__)


def patch() -> None:
    """Make verl's own trainers refuse an `adaptive_kl` block (done on import). Idempotent."""
    if _patches:
        return
    # Replaces verl's PPOTrainer.__init__ (trainer/ppo/v1/trainer_base.py), the base of every V1 trainer, ours too,
    # and RayPPOTrainer.__init__ (trainer/ppo/ray_trainer.py, the legacy trainer's): each then runs as before. Their
    # subclasses' own __init__ too, those defined already and (through each base's __init_subclass__, which verl's do
    # not define) those defined later: verl's experimental OneStepOffRayTrainer and FullyAsyncTrainer never call the
    # base's __init__, and would train without the block, silently.
    for owner in (trainer_base.PPOTrainer, ray_trainer.RayPPOTrainer):
        refuse_in(owner)
        _patches.replace(owner, "__init_subclass__", refusing_subclasses(owner))
        subclasses = owner.__subclasses__()
        while subclasses:
            subclass = subclasses.pop()
            refuse_in(subclass)
            subclasses.extend(subclass.__subclasses__())


def unpatch() -> None:
    """Restore verl's own trainers' `__init__` and `__init_subclass__`. Idempotent; the registered trainer stays
    registered."""
    _patches.restore(leave_newer=True)


patch()
