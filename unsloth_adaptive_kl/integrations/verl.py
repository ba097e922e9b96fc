"""verl: adaptive KL in verl's actor loss and in its reward KL, switched on by configuration.

A thin translator between verl (0.9.x, the V1 trainer) and the core's `AdaptiveKL`. A verl user turns it on with

    VERL_USE_EXTERNAL_MODULES=unsloth_adaptive_kl.integrations.verl \\
    python -m verl.trainer.main_ppo ... trainer.v1.trainer_mode=adaptive_kl \\
        +adaptive_kl.kl_adaptation_method=clip+dynamic +adaptive_kl.kl_clip_threshold=0.5

(or, instead of the environment variable, a `verl.plugins` entry point naming this module). What acts where:

- The KL in the actor loss (`actor_rollout_ref.actor.use_kl_loss=True`, beta_0 = `actor.kl_loss_coef`): every
  actor worker runs `AdaptivePPOLoss`, which is verl's own `ppo_loss` with its KL term off, plus beta_t times the
  adapted KL: verl's per-token KL (`kl_penalty` with `kl_loss_type`), shaped per token by the core (clip/sigmoid),
  aggregated by verl's own `agg_loss` with its global batch normalisation (`loss_agg_mode`; `length_normalized`:
  `seq-mean-token-mean`), so micro-batching and data parallelism keep verl's semantics. `none` is verl's stock loss
  bit for bit. beta_t comes from the driver's controller in the batch's meta info (`extra_info`), which verl hands
  to every mini- and micro-batch as non-tensor data: no extra call to the workers.
- The KL in the reward (`algorithm.use_kl_in_reward=True`, beta_0 = `algorithm.kl_ctrl.kl_coef`): our controller
  (`RewardKLController`) replaces verl's `kl_ctrl_in_reward`; verl's own `apply_kl_penalty` applies it (clip/sigmoid
  shape the per-token KL there) with verl's `algorithm.kl_penalty` as the estimator: keep verl's default `kl` (the
  log-ratio k1; any other value warns, as the core's k3-family estimators in the reward do). `dynamic` reads the
  batch's mean reward, `target` verl's KL measure with `beta_min`/`beta_max`.
- `actor.kl_loss_type=kl` (k1) in the loss warns likewise (its expected gradient is zero on-policy).
- Both controllers and the step are saved in every verl checkpoint (`adaptive_kl.json` beside `data.pt`) and
  restored on resume: a resumed run uses the betas the uninterrupted run would have used.
- Metrics: `adaptive_kl/raw_kl`, `adaptive_kl/adapted_kl`, `adaptive_kl/current_beta` (the loss) and
  `adaptive_kl/reward/*` (the reward) in verl's metrics dict, so its loggers get them.

The `adaptive_kl` block holds `AdaptiveKLConfig`'s fields; `adaptive_kl.reward.*` overrides any of them for the KL
in the reward. `kl_placement` is verl's own switches above and is not set here.

Importing this module imports verl and checks, in the installed source, every anchor it relies on: a missing one is
an `IncompatibleVersionError` naming it.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import math
import os
import warnings
from typing import Any, Optional

import torch

from ..core import AdaptiveKL, AdaptiveKLConfig, WindowKL, estimate_kl, shape_kl, shapes_per_token
from ..core.config import K1_IN_LOSS, NOT_LOG_RATIO_IN_REWARD, EstimatorFields, warn_estimator_issue
from ..core.controllers import reads_step_kl
from . import versions
from .patching import PatchSet

from verl.trainer.ppo import core_algos, ray_trainer  # noqa: E402  (verl: the integration's own extra)
from verl.trainer.ppo.v1 import trainer_base  # noqa: E402
from verl.trainer.ppo.v1.trainer_base import register_trainer  # noqa: E402
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.utils.metric import AggregationType, Metric  # noqa: E402
from verl.workers.utils import losses  # noqa: E402
from verl.workers.utils.padding import no_padding_2_padding  # noqa: E402

logger = logging.getLogger(__name__)

TRAINER_NAME = "adaptive_kl"
BETA_KEY = "adaptive_kl_beta"  # the loss beta in the batch's meta info / each micro-batch's non-tensor data
STATE_FILE = "adaptive_kl.json"
METRIC = "adaptive_kl/"
REWARD_METRIC = "adaptive_kl/reward/"

# verl's loss_agg_mode -> the GRPO loss_type with the same reduction (the core validates the KL term against it).
LOSS_TYPE_OF_AGG_MODE = {
    "token-mean": "bnpo",
    "token-sum": "dapo",
    "seq-mean-token-mean": "grpo",
    "seq-mean-token-sum": "luspo",
    "seq-mean-token-sum-norm": "dr_grpo",
}
# The core's kl_reduction (and length normalisation) -> verl's aggregation of the adapted KL.
AGG_MODE_OF_KL_REDUCTION = {"sequence_mean": "seq-mean-token-mean", "token_mean": "token-mean",
                            "sequence_sum": "seq-mean-token-sum"}


# ----- anchors ----------------------------------------------------------------------------------------------------


def check_anchors() -> None:
    """`IncompatibleVersionError` naming the first anchor missing from the installed verl; one
    `UntestedVersionWarning` for an untested verl whose anchors all hold."""
    versions.check_anchors("verl", versions.VERL_ANCHORS, versions.resolve_verl, where="verl.")


check_anchors()


# ----- configuration ----------------------------------------------------------------------------------------------

_FIELDS = {f.name for f in dataclasses.fields(AdaptiveKLConfig)}


def _plain(block: Any) -> dict[str, Any]:
    if block is None:
        return {}
    try:
        from omegaconf import OmegaConf

        if OmegaConf.is_config(block):
            return OmegaConf.to_container(block, resolve=True)
    except ImportError:  # pragma: no cover - verl depends on omegaconf
        pass
    return dict(block)


def configs_from(block: Any) -> tuple[AdaptiveKLConfig, AdaptiveKLConfig]:
    """(loss config, reward config) from the `adaptive_kl` block: its fields for both, `reward.*` overriding them for
    the KL in the reward. Unknown fields and `kl_placement` are a ValueError naming them."""
    fields = _plain(block)
    reward_overrides = _plain(fields.pop("reward", None))
    for where, values in (("adaptive_kl", fields), ("adaptive_kl.reward", reward_overrides)):
        if "kl_placement" in values:
            raise ValueError(
                f"{where}.kl_placement is not used with verl: the KL acts in the loss with "
                "actor_rollout_ref.actor.use_kl_loss=True and in the reward with algorithm.use_kl_in_reward=True.")
        unknown = sorted(set(values) - _FIELDS)
        if unknown:
            raise ValueError(f"{where}: unknown field(s) {', '.join(unknown)}; allowed are AdaptiveKLConfig's fields: "
                             f"{', '.join(sorted(_FIELDS - {'kl_placement'}))}.")
    return AdaptiveKLConfig(**fields), AdaptiveKLConfig(**{**fields, **reward_overrides})


def kl_agg_mode(config: AdaptiveKLConfig, loss_agg_mode: str) -> str:
    """verl's aggregation of the adapted KL: `kl_reduction`'s, length normalisation's (each completion's mean
    per-token KL), else `loss_agg_mode`."""
    if config.kl_reduction in AGG_MODE_OF_KL_REDUCTION:
        return AGG_MODE_OF_KL_REDUCTION[config.kl_reduction]
    if "length_normalized" in config.kl_methods:
        return "seq-mean-token-mean"
    return loss_agg_mode


def _per_token_kl(config: AdaptiveKLConfig, log_prob: torch.Tensor, ref_log_prob: torch.Tensor,
                  mask: torch.Tensor, kl_type: str) -> torch.Tensor:
    """verl's own per-token KL (`kl_penalty` with its type) for the default estimator, else the configured one."""
    if config.estimator == "k3":  # the default: what the trainer computes
        return core_algos.kl_penalty(logprob=log_prob, ref_logprob=ref_log_prob, kl_penalty=kl_type)
    return estimate_kl(log_prob, ref_log_prob, mask.to(log_prob.dtype), config)


# verl's names for the estimator guards of the core (SPEC 3.12), for KLEstimatorWarning's text: the KL in the actor loss
# is verl's `kl_loss_type` (unless `adaptive_kl.kl_estimator` replaces it), the KL in the reward verl's `kl_penalty`.
_VERL_FIELDS = dict(
    in_loss="actor_rollout_ref.actor.use_kl_loss=True", in_reward="algorithm.use_kl_in_reward=True",
    to_reward="algorithm.use_kl_in_reward=True with algorithm.kl_penalty=kl",
    loss_fix="+adaptive_kl.kl_estimator=k1_future (the whole completion's KL gradient), or "
             "actor_rollout_ref.actor.kl_loss_type=low_var_kl (k3, verl's default) or k2",
    reward_fix="algorithm.kl_penalty=kl (k1, verl's default)")
VERL_LOSS_FIELDS = EstimatorFields(estimator="actor_rollout_ref.actor.kl_loss_type", **_VERL_FIELDS)
VERL_REWARD_FIELDS = EstimatorFields(estimator="algorithm.kl_penalty", **_VERL_FIELDS)
# verl's kl_penalty / kl_loss_type values whose value is the log-ratio k1 ('+': the value of the base, k2's gradient).
VERL_LOG_RATIO = ("kl", "k1")


def warn_verl_estimators(config: Any, loss_config: AdaptiveKLConfig) -> None:
    """The core's estimator guards in verl's terms (KLEstimatorWarning, once per process and setting): with
    `algorithm.use_kl_in_reward=True`, an `algorithm.kl_penalty` whose value is not the log-ratio ('kl'/'k1', with or
    without '+'); with `actor.use_kl_loss=True`, `actor.kl_loss_type` 'kl'/'k1' (no '+': '+' takes k2's gradient)
    where it is the KL of the loss (`adaptive_kl.kl_estimator` unset or 'k3'; a configured estimator replaces it and
    the core's own guard reads it)."""
    actor, algorithm = config.actor_rollout_ref.actor, config.algorithm
    if actor.use_kl_loss and loss_config.estimator == "k3" and actor.kl_loss_type in VERL_LOG_RATIO:
        warn_estimator_issue(K1_IN_LOSS, actor.kl_loss_type, VERL_LOSS_FIELDS)
    if algorithm.use_kl_in_reward:
        kl_penalty = algorithm.get("kl_penalty", "kl")
        if (kl_penalty[:-1] if kl_penalty.endswith("+") else kl_penalty) not in VERL_LOG_RATIO:
            warn_estimator_issue(NOT_LOG_RATIO_IN_REWARD, kl_penalty, VERL_REWARD_FIELDS)


# ----- the KL in the actor loss (runs in every actor worker) -------------------------------------------------------


class AdaptivePPOLoss:
    """verl's `ppo_loss` with its KL term replaced by beta_t times the adapted KL; installed on the actor workers
    with `set_loss_fn`. Picklable: the driver builds it and Ray ships it once.

    loss = ppo_loss(KL off) + beta_t * agg_loss(shape(k), mask, mode, global batch info), k = verl's
    kl_penalty(log_prob, ref_log_prob, kl_loss_type), beta_t = the micro-batch's `adaptive_kl_beta` (the driver's
    controller), mode = `loss_agg_mode` (length_normalized: seq-mean-token-mean). Where nothing is shaped and verl's
    own KL and aggregation apply (`none`, `dynamic`, `target`), that is verl's `ppo_loss` itself with
    kl_loss_coef = beta_t: nothing is recomputed."""

    def __init__(self, actor_config: Any, config: AdaptiveKLConfig) -> None:
        self.actor_config = actor_config
        self.config = config
        self.agg_mode = kl_agg_mode(config, actor_config.loss_agg_mode)
        self.verl_term = (not shapes_per_token(config) and config.estimator == "k3"
                          and self.agg_mode == actor_config.loss_agg_mode)
        # A copy sharing global_batch_info (which ppo_loss fills in): KL off for the adapted path, else beta_t.
        self.stock_config = copy.copy(actor_config)
        object.__setattr__(self.stock_config, "use_kl_loss", actor_config.use_kl_loss and self.verl_term)

    def __call__(self, model_output: Any, data: Any, dp_group: Any = None) -> tuple[torch.Tensor, dict[str, Any]]:
        config = self.actor_config
        beta = tu.get_non_tensor_data(data=data, key=BETA_KEY, default=None)
        beta = float(config.kl_loss_coef if beta is None else beta)
        object.__setattr__(self.stock_config, "kl_loss_coef", beta)
        loss, metrics = losses.ppo_loss(self.stock_config, model_output, data, dp_group)
        if not config.use_kl_loss:
            return loss, metrics
        kld = mask = None
        if not self.verl_term or reads_step_kl(self.config):
            # verl's own term: only the target's KL measure is needed here, so no graph
            with torch.set_grad_enabled(torch.is_grad_enabled() and not self.verl_term):
                log_prob = no_padding_2_padding(model_output["log_probs"], data)
                padded = data.select("response_mask", "ref_log_prob").to_padded_tensor()
                mask = padded["response_mask"].to(bool)
                kld = _per_token_kl(self.config, log_prob, padded["ref_log_prob"], mask, config.kl_loss_type)
        batch_info = self.stock_config.global_batch_info
        aggregation = _metric_aggregation(data, config)
        if self.verl_term:  # verl's kl_loss metric (a Metric holds floats: one copy per key)
            adapted = metrics["kl_loss"]
        else:
            raw = core_algos.agg_loss(loss_mat=kld.detach(), loss_mask=mask, loss_agg_mode=config.loss_agg_mode,
                                      **batch_info)
            shaped = shape_kl(kld, self.config)
            term = core_algos.agg_loss(loss_mat=shaped, loss_mask=mask, loss_agg_mode=self.agg_mode, **batch_info)
            loss = loss + term * beta  # as ppo_loss: policy_loss += kl_loss * config.kl_loss_coef
            metrics["kl_loss"] = Metric(value=raw, aggregation=aggregation)
            metrics["kl_coef"] = beta
            adapted = Metric(value=term, aggregation=aggregation)
        metrics[METRIC + "raw_kl"] = copy.deepcopy(metrics["kl_loss"])
        metrics[METRIC + "adapted_kl"] = copy.deepcopy(adapted)
        metrics[METRIC + "current_beta"] = beta
        if reads_step_kl(self.config):  # the step's KL, for the driver's controller (target, a registered one)
            detached = kld.detach()
            for measure, mode in (("token_mean", "token-mean"), ("sequence_sum", "seq-mean-token-sum")):
                value = core_algos.agg_loss(loss_mat=detached, loss_mask=mask, loss_agg_mode=mode, **batch_info)
                metrics[METRIC + "window_" + measure] = Metric(value=value, aggregation=aggregation)
        return loss, metrics


def _metric_aggregation(data: Any, config: Any) -> AggregationType:
    """As ppo_loss: SUM over micro-batches where the loss is normalised by the global batch, else MEAN."""
    if (data["dp_size"] > 1 or data["batch_num_tokens"] is not None or data["global_batch_size"] is not None
            or config.loss_scale_factor is not None):
        return AggregationType.SUM
    return AggregationType.MEAN


# ----- the KL in the reward (runs in the driver) -------------------------------------------------------------------


class RewardKLController:
    """Our controller in place of verl's `kl_ctrl_in_reward`: `value` is beta_t, and verl's `apply_kl_penalty`
    calls `update(current_kl=, n_steps=)` once per batch. `dynamic` reads the batch's mean reward (set by the trainer
    with `observe_rewards` before verl scores the batch); `target` reads verl's `current_kl` (the batch mean of each
    sequence's token-mean KL, verl's own measure) and n_steps, bounded by beta_min/beta_max."""

    def __init__(self, config: AdaptiveKLConfig, beta: float) -> None:
        if "length_normalized" in config.kl_methods:
            raise ValueError("adaptive_kl.reward: length_normalized acts on the KL in the loss; verl penalises the "
                             "reward per token.")
        self.akl = AdaptiveKL(config, beta=beta, loss_type="bnpo")
        self._mean_reward: Optional[float] = None
        self.sequence_sum = math.nan
        self.updates = 0

    @property
    def value(self) -> float:
        return self.akl.current_beta

    @property
    def config(self) -> AdaptiveKLConfig:
        return self.akl.config

    def observe_rewards(self, mean_reward: float) -> None:
        """The mean (un-penalised) reward of the batch about to be penalised."""
        self._mean_reward = float(mean_reward)

    def update(self, current_kl: float, n_steps: int) -> None:
        """verl's call, once per batch: the controller's step from this batch's KL and reward."""
        mean_reward, self._mean_reward = self._mean_reward, None
        self.akl.step(mean_reward, kl=WindowKL(token_mean=float(current_kl), sequence_sum=self.sequence_sum,
                                               completions=int(n_steps)))
        self.updates += 1

    def state_dict(self) -> dict[str, Any]:
        return self.akl.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.akl.load_state_dict(state)


def apply_adaptive_kl_penalty(data: Any, kl_ctrl: RewardKLController, kl_penalty: str = "kl"):
    """verl's `apply_kl_penalty` with the per-token KL shaped (clip/sigmoid); without shaping, verl's own function.
    token_level_rewards = token_level_scores - beta_t * shape(k) * mask; verl's metrics plus adaptive_kl/reward/*."""
    mask = data.batch["response_mask"]
    kld = core_algos.kl_penalty(data.batch["old_log_probs"], data.batch["ref_log_prob"], kl_penalty=kl_penalty)
    kld = kld * mask
    kl_ctrl.sequence_sum = float(kld.sum(-1).mean())
    beta = kl_ctrl.value
    shaped = shape_kl(kld, kl_ctrl.config)
    if shaped is kld:
        data, metrics = ray_trainer.apply_kl_penalty(data, kl_ctrl=kl_ctrl, kl_penalty=kl_penalty)
        adapted = metrics["actor/reward_kl_penalty"]
    else:
        shaped = shaped * mask
        data.batch["token_level_rewards"] = data.batch["token_level_scores"] - beta * shaped
        lengths = mask.sum(-1).clamp(min=1)
        current_kl = float((kld.sum(-1) / lengths).mean())  # verl's measure: mean of each sequence's token-mean
        adapted = float((shaped.sum(-1) / lengths).mean())
        kl_ctrl.update(current_kl=current_kl, n_steps=data.batch.batch_size[0])
        metrics = {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": beta}
    metrics.update({REWARD_METRIC + "raw_kl": metrics["actor/reward_kl_penalty"], REWARD_METRIC + "adapted_kl": adapted,
                    REWARD_METRIC + "current_beta": beta})
    return data, metrics


# ----- the trainer (runs in the driver) ----------------------------------------------------------------------------


class AdaptiveKLTrainerMixin:
    """What the V1 trainer gains: the controllers, beta in each actor update's meta info, the adaptive loss on the
    actor workers, the reward controller, metrics and checkpoints. Mixed into a verl trainer class."""

    base_trainer_mode = "sync"

    def __init__(self, config: Any) -> None:
        from omegaconf import open_dict

        loss_config, reward_config = configs_from(config.get("adaptive_kl"))
        with open_dict(config):  # verl's mode logic (replay buffer, checkpoints) keys on its own mode names
            config.trainer.v1.trainer_mode = self.base_trainer_mode
        super().__init__(config)
        actor = config.actor_rollout_ref.actor
        warn_verl_estimators(config, loss_config)
        self.adaptive_kl_config = loss_config
        self.loss_kl: Optional[AdaptiveKL] = None
        if actor.use_kl_loss:
            if config.get("distillation") is not None and config.distillation.get("enabled", False):
                raise ValueError("adaptive_kl: the KL in the loss with distillation is not supported.")
            self.loss_kl = AdaptiveKL(loss_config, beta=float(actor.kl_loss_coef),
                                      loss_type=LOSS_TYPE_OF_AGG_MODE.get(actor.loss_agg_mode, "bnpo"))
        self.reward_kl: Optional[RewardKLController] = None
        if config.algorithm.use_kl_in_reward:
            self.reward_kl = RewardKLController(reward_config, beta=float(config.algorithm.kl_ctrl.kl_coef))
            self.kl_ctrl_in_reward = self.reward_kl
        if self.loss_kl is None and self.reward_kl is None:
            warnings.warn("adaptive_kl: neither actor_rollout_ref.actor.use_kl_loss nor algorithm.use_kl_in_reward is "
                          "on: there is no KL to adapt.", stacklevel=2)
        self._mean_reward: Optional[float] = None

    # -- setup: the adaptive loss on the actor workers
    def _setup(self) -> None:
        super()._setup()
        if self.loss_kl is not None:
            from verl.utils.config import omega_conf_to_dataclass

            actor_config = omega_conf_to_dataclass(self.config.actor_rollout_ref.actor)
            self.actor_rollout_wg.set_loss_fn(AdaptivePPOLoss(actor_config, self.adaptive_kl_config))

    # -- each step
    def _batch_mean_reward(self, batch: Any) -> float:
        """The mean un-penalised sequence reward of the batch's real (non-padding) samples, as verl's
        critic/score/mean."""
        import transfer_queue as tq

        keep = [i for i, tag in enumerate(batch.tags) if not tag.get("is_padding", False)] or list(range(len(batch)))
        data = tq.kv_batch_get(keys=[batch.keys[i] for i in keep], partition_id=batch.partition_id,
                               select_fields=["rm_scores"])
        scores = data["rm_scores"]
        totals = torch.stack([row.sum() for row in scores.unbind()]) if scores.is_nested else scores.sum(-1)
        return float(totals.float().mean())

    def _compute_advantage(self, batch: Any, metrics: dict) -> Any:
        if self.loss_kl is not None or self.reward_kl is not None:
            self._mean_reward = self._batch_mean_reward(batch)
        if self.reward_kl is None:
            return super()._compute_advantage(batch, metrics)
        self.reward_kl.observe_rewards(self._mean_reward)
        # Replaces verl's apply_kl_penalty (ray_trainer), as the V1 trainer module references it (anchored), for
        # this call only.
        patches = PatchSet()
        patches.replace(trainer_base, "apply_kl_penalty", apply_adaptive_kl_penalty)
        try:
            return super()._compute_advantage(batch, metrics)
        finally:
            patches.restore()

    def _update_actor(self, batch: Any, metrics: dict) -> Any:
        if self.loss_kl is None:
            return super()._update_actor(batch, metrics)
        beta = self.loss_kl.current_beta
        batch.extra_info[BETA_KEY] = beta
        batch = super()._update_actor(batch, metrics)
        batch.extra_info.pop(BETA_KEY, None)
        for key in [key for key in metrics if key.startswith("actor/" + METRIC)]:
            metrics[key[len("actor/"):]] = metrics.pop(key)
        metrics[METRIC + "current_beta"] = beta
        window = None
        if reads_step_kl(self.adaptive_kl_config):
            completions = sum(not tag.get("is_padding", False) for tag in batch.tags)
            window = WindowKL(token_mean=float(metrics.pop(METRIC + "window_token_mean")),
                              sequence_sum=float(metrics.pop(METRIC + "window_sequence_sum")), completions=completions)
        self.loss_kl.step(self._mean_reward, kl=window)
        return batch

    # -- checkpoints
    def adaptive_kl_state(self) -> dict[str, Any]:
        return {"global_steps": self.global_steps,
                "loss": None if self.loss_kl is None else self.loss_kl.state_dict(),
                "reward": None if self.reward_kl is None else self.reward_kl.state_dict()}

    def load_adaptive_kl_state(self, state: dict[str, Any]) -> None:
        for name, target in (("loss", self.loss_kl), ("reward", self.reward_kl)):
            if target is not None and state.get(name) is not None:
                target.load_state_dict(state[name])

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
            warnings.warn(f"adaptive_kl: {path} is missing: the controllers restart from their initial beta.",
                          stacklevel=2)
            return
        with open(path) as handle:
            self.load_adaptive_kl_state(json.load(handle))


@register_trainer(TRAINER_NAME)
class AdaptiveKLPPOTrainer(AdaptiveKLTrainerMixin, PPOTrainerSync):
    """verl's synchronous V1 trainer (`trainer.v1.trainer_mode=sync`) with adaptive KL; selected with
    `trainer.v1.trainer_mode=adaptive_kl`."""
