"""`AdaptiveKL`: the trainer-agnostic adaptive-KL object that every loop drives (your own and each trainer
integration's). It holds the live beta (the controller) and turns per-token log-probs into the adapted KL term, the
reward penalty and the `adaptive_kl/*` metrics. Pure torch: it never imports a trainer.

One protocol, with two sets of doors onto it:
- each batch's KL is measured (`kl_loss` / `reward_penalty` in a loop of your own; `term` + `record` / `penalize` in
  a trainer integration) and, in training, its sums (`KLStatistics`) are kept for the step; an evaluation pass
  (`train=False`) returns its metrics and keeps nothing;
- each new generation batch's mean reward is observed (`step(mean_reward=...)` / `observe_rewards`);
- the controller moves exactly once per optimizer step (`step` / `record(..., end_of_step=True)`), in `_end_step`,
  from that step's KL: the sums of the batches it trained on, or with the KL in the reward, of the batch last scored.
"""

from __future__ import annotations

import math
import numbers
import warnings
from collections.abc import Mapping
from dataclasses import asdict
from typing import Any, Optional, Sequence

import torch

from .adaptation import KLTerm, kl_term, neutral_where_empty
from .config import (ADAPTIVE_KL_FIELDS, AdaptiveKLConfig, check_beta, check_real, check_whole, is_real, is_whole,
                     python_number, reject, settings_of)
from .controllers import WindowKL, check_controller_beta, controller_kind, make_beta_controller
from .estimators import check_per_token
from .numerics import LogpCheck
from .optimizer_steps import OptimizerSteps
from .reductions import (ReductionContext, check_completions_fit, check_divisors_given, kl_reduction,
                         loss_type_reduction, reduction_left_as_is, warn_unread_context)
from .shapings import check_zero_kept
from .statistics import (NAMES, NOT_NEGATIVE, Gather, KLStatistics, check_given_sums, device_sums,
                         gather_statistics, invalid_sum, local)

# What AdaptiveKL is built with besides its config, which the run validated and built its controller from
FIXED = ("beta", "loss_type", "num_iterations")
STATE_FORMAT = 7  # `state_dict()`'s format: 7 adds the beta the run was built with (`configured_beta`); 6 the old
# policy's log-prob sum to the step's sums (`old_logps`); 5 the step's rewards; 4 names the step's sums; 3 added the
# step's KL; 2 the kind; 1 none
# How a changed-beta resume's warning says to start from the new beta; a door whose checkpoint holds the state its own
# way replaces these words with its own.
RESUME_WITHOUT_STATE = "resume without the adaptive KL state"


def finite_mean_reward(mean_reward: Any) -> float:
    """A batch's mean reward as a float: a finite number (a one-element tensor or numpy array is one, both read by
    `item()`); else a ValueError naming it (`dynamic` would decay on +inf and never on NaN, silently; text, a bool or
    the rewards themselves are not a mean)."""
    try:  # a tensor's or an array's item() reads one element alike; several (the rewards) or a list fail here
        value = mean_reward.item() if hasattr(mean_reward, "item") else mean_reward
        reward = math.nan if isinstance(value, (str, bytes, bool)) else float(value)
    except (TypeError, ValueError, RuntimeError):
        reward = math.nan
    if not math.isfinite(reward):
        raise reject("mean_reward", mean_reward, "a finite number (the batch's mean reward), or None where "
                     "the step scored no new generation batch")
    return reward


def kl_off_message(fields: Sequence[str], coefficient: str = "beta") -> str:
    """The warning that the adapted `fields` do nothing at a KL coefficient of 0 (`coefficient`: its name where it was
    set)."""
    return (f"{', '.join(fields)} {'has' if len(fields) == 1 else 'have'} no effect: {coefficient}=0.0 turns the KL "
            f"term off. Set {coefficient} > 0 to regularise.")


class AdaptiveKL:
    """The adaptive KL of one training run: beta_t (`current_beta`, from the configured controller) times the
    adapted KL term, its metrics, and its checkpointable state.

    `AdaptiveKL(config, beta, loss_type, num_iterations=1)` validates as `AdaptiveKLConfig` does (the ValueError
    messages every integration's config raises): `config` the adaptive-KL fields (None: the defaults, i.e. `none`),
    `beta` the initial coefficient (finite, >= 0, >= beta_min), `loss_type` the GRPO loss whose reduction the KL term
    follows (grpo, bnpo, dr_grpo, dapo, cispo, vespo, sapo, luspo), `num_iterations` mu, the optimizer passes over each
    generation batch (a trainer's PPO-style epochs): `target` counts each generated completion once per batch whatever
    mu. `reference_sync`: whether the loop syncs the reference (a trainer's integration with sync_ref_model=True);
    without one, `ref_model_sync_kl` and `ref_model_sync_reset_optimizer` would do nothing and are refused.

    Per optimizer step of a loop: `kl_loss` (KL in the loss) or `reward_penalty` (KL in the reward) on each
    (micro-)batch, then `step(mean_reward=...)` once; `train=False` on an evaluation pass. `state_dict()` /
    `load_state_dict()` resume exactly.

    Nothing is read back from the device per micro-batch on the trainer path (`record`): each micro-batch's sums
    stay a device tensor until the optimizer step ends, where they are gathered over processes and transferred to the
    host once, for the metrics and the controller together."""

    def __init__(self, config: Optional[AdaptiveKLConfig], beta: float, loss_type: str = "grpo", *,
                 num_iterations: int = 1, reference_sync: bool = False) -> None:
        config = AdaptiveKLConfig() if config is None else config
        if not isinstance(config, AdaptiveKLConfig):
            raise TypeError(f"config must be an AdaptiveKLConfig (or None for the defaults), not {type(config).__name__}")
        check_beta(beta)  # given here (the config's own check takes None for "not known")
        config.validate_adaptive_kl(beta=beta)  # beta first, then the fields it bounds
        check_whole("num_iterations", num_iterations, 1, "an integer >= 1 (the optimizer passes over each generation "
                    "batch)")
        if not isinstance(reference_sync, bool):  # "no" is truthy: the sync fields it should refuse would pass
            raise reject("reference_sync", reference_sync, "True (the loop syncs the reference model) or False")
        if not reference_sync:
            config.refuse_sync_settings("without a reference sync", "AdaptiveKL syncs no reference itself: a "
                                        "trainer's integration does, with sync_ref_model=True")
        # whatever beta: at beta = 0 the term is 0, but kl_loss still reduces it (and its metrics) as loss_type does
        loss_type_reduction(loss_type)
        if beta != 0:
            unchanged = reduction_left_as_is(config, loss_type)
            if unchanged is not None:
                warnings.warn(unchanged, UserWarning, stacklevel=2)
        elif not config.is_stock_kl:
            warnings.warn(kl_off_message(config.adapted_fields()), UserWarning, stacklevel=2)
        self.config = config
        self._settings = settings_of(config)  # what the run was validated and built with (`check_settings`)
        self.beta = float(beta)
        self.loss_type = loss_type
        self.num_iterations = num_iterations
        check_per_token(config)
        check_zero_kept(config)
        self.controller = make_beta_controller(beta, config)
        _check_controller_fields(self.controller)
        self.completed_steps = 0  # optimizer steps the controller has seen
        self._queued: list[tuple[torch.Tensor, Optional[LogpCheck]]] = []  # trainer path: this step's device sums
        self._trained = KLStatistics()  # what the training batches of this step measured (the KL in the loss)
        self._scored: Optional[KLStatistics] = None  # the KL in the reward: the batch scored since the last step
        # The step's KL (token mean of the raw KL over every completion the step trained on, all processes; with the
        # KL in the reward, of the generation batch it trains on), which a KL-triggered reference sync reads; NaN
        # before the first.
        self.last_raw_kl = math.nan
        self.last_metrics: dict[str, float] = {}
        # The mean rewards of the generation batches observed since the last step: a step that trains on several
        # (a trainer's gradient accumulation over more generation batches than one) hands the controller their mean.
        self._rewards: list[float] = []
        self._held_warned = False  # a step held beta for want of its input and said so (once per run)
        self._optimizer_steps = OptimizerSteps()  # a loop of your own: did an optimizer step between its batches?
        self._unstepped_warned = False
        self._twice_warned = False
        self._warned_empty = False  # reward_penalty without group_size met a completion without tokens
        self._warned_gradless = False  # kl_loss, training with autograd on, returned a term without a gradient
        self._calls_since_optimizer = 0  # step() calls since the loop's optimizer last stepped
        self._stepped_twice: list[int] = []  # the step() calls between the last optimizer steps, each > 1

    def __setattr__(self, name: str, value: Any) -> None:
        """`beta`, `loss_type` and `num_iterations` are fixed once set (when the object is built): `akl.beta = 0.0`
        later changed nothing (the controller holds beta_t), and a new loss_type was used unchecked."""
        if name in FIXED and name in self.__dict__:
            raise AttributeError(
                f"AdaptiveKL.{name} is {getattr(self, name)!r}, fixed when the run's AdaptiveKL was built: to train "
                f"with {name}={value!r}, build a new AdaptiveKL with it and carry the step and a moving beta over with "
                "new.load_state_dict(old.state_dict()).")
        super().__setattr__(name, value)

    @property
    def reads_rewards(self) -> bool:
        """Whether the beta controller reads the batches' mean reward: `dynamic` does, and a registered controller may
        (it is handed them); a constant beta and `target` (which reads the KL) do not."""
        return controller_kind(self.controller) not in ("constant", "target")

    @property
    def moves_beta(self) -> bool:
        """Whether beta moves (`dynamic`, `target`, a registered controller): what a checkpoint without this object's
        state loses. A constant beta loses nothing, so a resume without it has nothing to say."""
        return controller_kind(self.controller) != "constant"

    @property
    def current_beta(self) -> float:
        """beta_t: the coefficient of the KL term (or the reward penalty) in the next step."""
        return self.controller.value

    # ----- a loop of your own -------------------------------------------------------------------------------------

    def kl_loss(
        self,
        logps: torch.Tensor,
        ref_logps: torch.Tensor,
        mask: torch.Tensor,
        *,
        per_token_kl: Optional[torch.Tensor] = None,
        max_completion_length: Optional[int] = None,
        token_normalizer: Optional[torch.Tensor | float] = None,
        gather: Optional[Gather] = None,
        train: bool = True,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """(beta_t * K, metrics) for one (micro-)batch, K the adapted KL term with autograd:
        k = the `kl_estimator` of (logps, ref_logps) per token (or `per_token_kl`, a KL you computed), shaped per token
        (clip/sigmoid), reduced as `loss_type` reduces the loss (or per `kl_reduction` / length normalisation).

        logps, ref_logps, mask: (B, T) policy and reference log-probs of the sampled tokens and the completion mask.
        max_completion_length: dr_grpo's divisor. token_normalizer: dapo/cispo/vespo's active-token count for this
        micro-batch. gather: a cross-process all-gather (e.g. `accelerator.gather`) for metrics over all processes.
        train: False on an evaluation pass, which the next `step` does not read (beta, `target` and a KL-triggered
        reference sync see only training batches). The metrics are floats under the `adaptive_kl/*` names (one host
        transfer). A mask that is not bool is read once more, to refuse entries other than 0 and 1 (pass a bool mask
        to skip it), and so is the mask where dr_grpo's `max_completion_length` is narrower than it, to refuse a
        completion longer than the cap.

        Numerics: computed in float32 whatever the dtype of the inputs (bf16/fp16 upcast, float64 rounded; the
        gradient flows back in the inputs' dtype); the returned term is float32. A NaN or +-inf in
        `logps` or `ref_logps` on a valid token raises `NonFiniteLogProbError` (a FloatingPointError and ValueError)
        naming the step, the tensor and how many tokens; masked positions may hold anything (their KL is 0, with a
        zero gradient). Log-probs averaging above 0.01 over the valid tokens raise ValueError naming the tensor and
        its mean: negative log-likelihoods passed for log-probs (`positive_logps`)."""
        self._check_batch_call(train, gather)
        if self.config.kl_in_reward:
            raise ValueError("kl_placement='reward' puts beta * KL into the rewards, not the loss: call "
                             "reward_penalty(...) on each generation batch instead of kl_loss(...).")
        check_batch(logps, ref_logps, mask, per_token_kl)
        check_estimator_read(self.config, per_token_kl)
        ctx = divisors(max_completion_length, token_normalizer)
        warn_unread_context(ctx, self.config, self.loss_type)
        reductions = self.loss_reductions()
        check_divisors_given(ctx, reductions.values(), "kl_loss")
        check_completions_fit(ctx, mask, reductions)
        if train:
            self._warn_if_unstepped("kl_loss")
        term = self.term(logps, ref_logps, mask, ctx=ctx, per_token_kl=per_token_kl, with_grad=True)
        (sums,) = gather_statistics([device_sums(term)], [term.check], step=self.completed_steps + 1,
                                    gather=gather or local)
        # the metrics first: they refuse a non-finite KL, and a refused batch must leave the step's sums as they were
        # (a loop that skips it would otherwise carry its inf into every later step)
        self.last_metrics = sums.metrics(beta=self.current_beta, config=self.config, step=self.completed_steps + 1)
        if train:
            trained = self._trained + sums
            self._check_window(trained.window(self.num_iterations))  # the step so far, before the loop's backward
            self._trained = trained
        loss = term.adapted * self.current_beta
        if train and torch.is_grad_enabled() and not loss.requires_grad and self.current_beta > 0:
            self._warn_gradless()
        return loss, self.last_metrics

    def _warn_gradless(self) -> None:
        """A training batch's term without a gradient (autograd on): added to the loss it regularises nothing. Said
        once per run; a KL measured on purpose runs under torch.no_grad() (as a hosted service's step KL is)."""
        if self._warned_gradless:
            return
        self._warned_gradless = True
        warnings.warn("adaptive KL: kl_loss(...) returned a KL term without a gradient: neither logps nor "
                      "per_token_kl requires grad (a .detach(), or log-probs computed under torch.no_grad()), so "
                      "adding it to the loss regularises nothing. Pass the policy's log-probs with autograd; to "
                      "measure the KL alone call kl_loss under torch.no_grad(), and pass train=False for an "
                      "evaluation batch.", UserWarning, stacklevel=3)

    def reward_penalty(
        self,
        logps: torch.Tensor,
        ref_logps: torch.Tensor,
        mask: torch.Tensor,
        *,
        per_token_kl: Optional[torch.Tensor] = None,
        gather: Optional[Gather] = None,
        train: bool = True,
        group_size: Optional[int] = None,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """(P, metrics) for the KL in the reward, as `kl_loss` returns (term, metrics): P_i = beta_t * KL_i per
        completion, without gradient, to subtract from each reward before the group statistics. KL_i = the estimator
        per token, shaped (clip/sigmoid), reduced per completion by `kl_reduction` ('sequence_sum' / 'loss_type':
        sum_t m k'; 'sequence_mean': that over L_i). With `gather`, the penalties of every process in process order
        (float32, as trainers gather rewards). metrics: the `adaptive_kl/*` floats, `adaptive_kl/reward_penalty`
        included (also in `last_metrics`); the next `step` reads the batch's KL, unless `train=False` (an evaluation
        batch). Numerics as `kl_loss`: float32, a non-finite log-prob on a valid token raises
        `NonFiniteLogProbError`, and negative log-likelihoods passed for log-probs a ValueError.

        `group_size`: the completions per prompt, each group consecutive in the (gathered) batch. A completion with
        no valid token has no KL; with `group_size` it gets its group's mean penalty (`neutral_where_empty`), as the
        trainer integrations give it, so that its reward moves no other advantage by its penalty. Without it, its
        penalty is 0 and the first such batch warns."""
        self._check_batch_call(train, gather)
        if not self.config.kl_in_reward:
            raise ValueError("kl_placement='loss' puts beta * KL into the loss, not the rewards: call kl_loss(...) on "
                             "each micro-batch instead of reward_penalty(...), or set kl_placement='reward'.")
        check_batch(logps, ref_logps, mask, per_token_kl)
        check_estimator_read(self.config, per_token_kl)
        gather = gather or local
        term = self.term(logps, ref_logps, mask, per_token_kl=per_token_kl)
        lengths = gather(term.lengths)  # every process's, as the penalties are returned
        if group_size is not None and (not is_whole(group_size, 1) or lengths.numel() % group_size):
            raise reject("group_size", group_size, python_number(group_size, f"an integer >= 1 that divides the "
                         f"{lengths.numel()} completions (of every process, with gather), or None"))
        if train:
            self._warn_if_unstepped("reward_penalty")
        penalty, self.last_metrics = self.penalize(term, gather=gather, train=train,
                                                   completed_steps=self.completed_steps)
        if group_size is not None:
            penalty = neutral_where_empty(penalty, lengths, group_size)
        elif not self._warned_empty and bool((lengths == 0).any()):
            self._warned_empty = True
            warnings.warn(f"adaptive KL: reward_penalty: completion(s) {(lengths == 0).nonzero().flatten().tolist()} "
                          "have no valid token, so no KL: their penalty is 0, which lowers the advantages of the "
                          "other completions of their group by their share of the group's mean penalty. Pass "
                          "group_size= (the completions per prompt) to give them their group's mean penalty.",
                          UserWarning, stacklevel=2)
        return penalty, self.last_metrics

    def step(self, mean_reward: Optional[float] = None, *, kl: Optional[WindowKL] = None) -> float:
        """After each optimizer step: the beta controller's update from what the step saw, effective from the next
        step; returns the new beta. `mean_reward`: the mean (un-penalised) reward, over all processes, of a new
        generation batch (`dynamic` decays at most once per generation batch: pass None for further optimizer steps
        on the same batch). `target` reads the step's KL: `kl`, where the loop measured it itself (a `WindowKL`, as
        an engine that aggregates its own loss does), else what the step's training `kl_loss` calls or the last
        training `reward_penalty` saw.

        The first step that leaves beta where it is for want of an input says so (a UserWarning): `dynamic` before any
        `mean_reward` was passed, `target` (the KL in the loss) with no valid token in a training `kl_loss` since the
        last step and no `kl`, or a `kl` whose measure is NaN (a step that measured none, which also keeps
        `last_raw_kl`)."""
        if kl is not None and not isinstance(kl, WindowKL):  # else found missing only after the step's sums are gone
            raise TypeError(f"kl must be a WindowKL(token_mean=..., sequence_sum=..., completions=...) or None (the "
                            f"KL of the batches the step trained on), not {type(kl).__name__}")
        self._check_window(kl)
        if mean_reward is not None:
            self.observe_rewards(mean_reward)
        self._warn_if_stepped_twice()
        self._end_step(self.completed_steps + 1, kl)
        return self.current_beta

    def _check_batch_call(self, train: Any, gather: Any) -> None:
        """What `kl_loss` and `reward_penalty` check before they read a tensor: the settings, `train` and `gather`."""
        self.check_settings()
        check_train(train)
        check_gather(gather)

    def check_settings(self, source: Any = None) -> None:
        """A ValueError where a field of `source` (default: `config`; a trainer passes its args, which `config` was
        copied from) no longer holds the value this object was built with. The settings are validated, and the beta
        controller and a trainer's hooks chosen, once, when a run starts: a value set later would be used unchecked,
        or not at all. Every door checks, per batch and per step (a comparison of the fields' values)."""
        found = settings_of(self.config if source is None else source)
        if found == self._settings:
            return
        name, built, now = next(change for change in zip(ADAPTIVE_KL_FIELDS, self._settings, found)
                                if change[1] != change[2])
        raise ValueError(
            f"{name} changed from {built!r} to {now!r} after the run started: adaptive-KL settings are validated, "
            "and the beta controller built, once, when the run's AdaptiveKL is built (a trainer builds it in its "
            "__init__). Set it before; in a loop of your own, build a new AdaptiveKL with it (and the run's beta) "
            "and carry the step and a moving beta over with new.load_state_dict(old.state_dict()).")

    # ----- the trainer integrations -----------------------------------------------------------------------------

    def term(self, logps: torch.Tensor, ref_logps: torch.Tensor, mask: torch.Tensor, *,
             ctx: ReductionContext = ReductionContext(), loss_type: Optional[str] = None,
             per_token_kl: Optional[torch.Tensor] = None, with_grad: Optional[bool] = None,
             names: Optional[dict[str, str]] = None, old_logps: Optional[torch.Tensor] = None) -> KLTerm:
        """The KL term of one batch (`adaptation.kl_term`: the loss's term, or with the KL in the reward each
        completion's KL_i) from the log-probs as the trainer holds them, of `per_token_kl` where the trainer computed
        the KL itself. Without `with_grad`, the loss's term records a graph only where it replaces the trainer's own
        (`config.is_stock_kl` is False). `old_logps`: the old policy's log-probs, where the trainer holds them (its
        importance ratio divides by them), checked with the others. `names`: what a non-finite error calls each
        tensor, which `record` or `penalize` reports at the step's end."""
        self.check_settings()
        return kl_term(logps, ref_logps, mask, self.config, loss_type=loss_type or self.loss_type, context=ctx,
                       per_token_kl=per_token_kl, with_grad=with_grad, names=names, old_logps=old_logps)

    def loss_reductions(self) -> dict[str, str]:
        """{what: its reduction's name} of what `kl_loss` reduces: the KL term, and raw_kl where the loss type
        reduces otherwise (raw_kl is the trainer's own metric, reduced as the loss type reduces)."""
        kl, raw = kl_reduction(self.config, self.loss_type), loss_type_reduction(self.loss_type)
        return {"the KL term": kl, **({"raw_kl": raw} if raw != kl else {})}

    def observe_rewards(self, mean_reward: float) -> None:
        """The mean reward over all processes of a new training generation batch (un-penalised), as
        `finite_mean_reward` reads it at every door. The controller observes, at the step's end, the mean of the
        batches observed during the step: the mean reward of the completions the step trained on, where its batches
        are of one size (a trainer's are)."""
        reward = finite_mean_reward(mean_reward)
        self._rewards.append(reward)

    def record(
        self, term: Optional[KLTerm], *, gather: Gather, train: bool, end_of_step: bool, completed_steps: int
    ) -> list[dict[str, float]]:
        """Queue one micro-batch's sums (a device row: no host transfer; `term` None where the loss has no KL term,
        the KL being in the reward); at the end of an optimizer step in training (every call in evaluation) return
        the metrics of each queued micro-batch (over all processes, `adaptive_kl/` names) and, in training, end the
        step: the controller moves, `completed_steps` being the optimizer steps completed with this one."""
        if term is not None:
            self._queued.append((device_sums(term), term.check))
        if train and not end_of_step:
            return []
        queued, self._queued = self._queued, []
        batches = []
        if queued:
            rows, checks = zip(*queued)
            batches = gather_statistics(list(rows), list(checks), step=completed_steps, gather=gather)
        return self.record_sums(batches, train=train, completed_steps=completed_steps)

    def record_sums(self, batches: list[KLStatistics], *, train: bool, completed_steps: int) -> list[dict[str, float]]:
        """The end of an optimizer step (in training; in evaluation, of a pass) whose batches' sums are known over
        all processes: `record`'s last stage, for an engine that gathers its workers' sums itself.
        Returns each batch's metrics; in training the sums are the step's and the controller moves. Sums no batch can
        hold (`check_given_sums`) and a `completed_steps` that is not an integer >= 0 are refused, before any is kept.
        """
        check_train(train)
        check_whole("completed_steps", completed_steps, 0, "an integer >= 0 (the optimizer steps completed with this one)")
        check_given_sums(batches, completed_steps)
        metrics = []
        for sums in batches:
            metrics.append(sums.metrics(beta=self.current_beta, config=self.config, step=completed_steps))
            if train:
                self._trained = self._trained + sums
        if train:
            self._end_step(completed_steps)
        return metrics

    def penalize(
        self, term: KLTerm, *, gather: Gather, train: bool, completed_steps: int
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """kl_placement="reward": the penalty beta_t * KL_i of every completion of a generation batch, over all
        processes in process order (as the trainer gathers its rewards), and its metrics, `completed_steps` optimizer
        steps into training. In training the batch's sums are kept: the next step's end moves the controller from
        them, and beta_{t+1} penalises the next batch."""
        (sums,) = gather_statistics([device_sums(term)], [term.check], step=completed_steps + 1, gather=gather)
        metrics = sums.metrics(beta=self.current_beta, config=self.config, step=completed_steps + 1, reward=True)
        if train:
            scored = sums if self._scored is None else self._scored + sums
            self._check_window(scored.window())  # the batch the next step reads, before its rewards are used
            self._scored = scored
        return gather((self.current_beta * term.adapted).float()), metrics

    # ----- the driver ----------------------------------------------------------------------------------------------

    def _end_step(self, completed_steps: int, window: Optional[WindowKL] = None) -> None:
        """The one place the controller moves: once per optimizer step, from the step's KL `window` (by default, as
        the placement says: the sums the step trained on, n counted once per generation batch; with the KL in the
        reward, those of the batch scored since the last step), which also becomes `last_raw_kl`."""
        self.check_settings()
        given = window
        if window is None and self.config.kl_in_reward:
            window = None if self._scored is None else self._scored.window()
        elif window is None:
            window = self._trained.window(self.num_iterations)
        self._check_window(window)  # before anything moves: a refused step leaves the run as it was
        if self._rewards:  # the generation batches of this step, as one: `dynamic` decides on their mean
            self.controller.observe_rewards(sum(self._rewards) / len(self._rewards))
            self._rewards = []
        self._warn_if_held(completed_steps, given)
        self._trained, self._scored = KLStatistics(), None
        self._optimizer_steps.reset()
        if window is not None and not math.isnan(window.token_mean):  # a step that measured none keeps the last
            self.last_raw_kl = window.token_mean
        self.controller.step(completed_steps, window)
        check_controller_beta(self.controller, f"at step {completed_steps}")
        self.completed_steps = completed_steps

    def _check_window(self, window: Optional[WindowKL]) -> None:
        """The controller's `check` of a step's window (`target`'s horizon), where it has one (a registered controller
        may not)."""
        check = getattr(self.controller, "check", None)
        if check is not None:
            check(window)

    def _warn_if_held(self, step: int, kl: Optional[WindowKL]) -> None:
        """A controller that cannot move for want of its input would hold beta silently: say which input is missing,
        the first time (every door ends its steps in `_end_step`, so each says it alike)."""
        if self._held_warned:
            return
        kind = controller_kind(self.controller)
        if kind == "dynamic" and self.controller.generation_batch == 0:
            missing = ("no mean reward has been passed: dynamic decays beta from each new generation batch's mean "
                       "reward, step(mean_reward=...)")
        elif kind == "target" and kl is None and not self.config.kl_in_reward and not self._trained.completions:
            missing = ("target moves beta from the KL of the valid tokens the step trained on, and no training "
                       "kl_loss saw one since the last step (call kl_loss(..., train=True) before step(), or pass "
                       "step(kl=WindowKL(...)))")
        elif kind == "target" and kl is not None and math.isnan(getattr(kl, self.config.kl_target_measure)):
            missing = (f"the step's WindowKL has no KL ({self.config.kl_target_measure}=nan, a step that measured "
                       "none): target moves beta from the KL the step measured")
        elif kind == "target" and kl is not None and not kl.completions:
            missing = ("the step's WindowKL counts completions=0: target moves beta by e * n / kl_horizon, n the "
                       "completions the step accounts for, and by nothing where n is 0")
        elif (kind == "target" and kl is None and self.config.kl_in_reward and math.isnan(self.last_raw_kl)
              and (self._scored is None or not self._scored.completions)):  # later steps on a batch read may hold
            missing = ("target moves beta from the KL of the valid tokens of the generation batch scored for the "
                       "step, and no training reward_penalty has scored one yet (call reward_penalty(..., "
                       "train=True) before step(), or pass step(kl=WindowKL(...)))")
        else:
            return
        warnings.warn(f"adaptive KL: beta holds at step {step}: {missing}.", UserWarning, stacklevel=4)
        self._held_warned = True

    def _warn_if_unstepped(self, door: str) -> None:
        """A loop of your own that never calls `step()` would train on with beta where it started, silently. From its
        first training batch on, a training batch that an optimizer step came before is counted (`OptimizerSteps`); the
        second since the last `step()` is said, once per run (one may come before the loop's `akl.step()`, not two).
        Nothing to say for a constant beta."""
        kind = controller_kind(self.controller)
        if kind == "constant" or self._unstepped_warned:
            return
        self._optimizer_steps.start()
        optimizer = self._optimizer_steps.batch()
        if self._optimizer_steps.batches < 2:
            return
        since = "the last akl.step()" if self.completed_steps else f"the first training {door}, and no akl.step()"
        warnings.warn(f"adaptive KL: beta holds at step {self.completed_steps + 1}: {optimizer} has stepped twice "
                      f"since {since}: {kind} moves beta in akl.step() alone, once per optimizer step (call "
                      "akl.step(mean_reward=...) after each optimizer.step()).", UserWarning, stacklevel=3)
        self._unstepped_warned = True

    def _warn_if_stepped_twice(self) -> None:
        """The mirror of `_warn_if_unstepped`: a loop that calls `step()` per micro-batch (or per pass) moves beta that
        many times per optimizer step, silently. Said, once per run, where the loop's optimizer steps and
        `STEPPED_TWICE` times in a row more than one `step()` ran between one optimizer step and the next: an
        optimizer step skipped now and then (fp16's scaler skips one on overflow, several at the start) is not that,
        nor a remote optimizer, which is never seen to step. A count is read at the first `step()` after the
        optimizer stepped, which starts the next one."""
        steps = self._optimizer_steps
        if not steps.started or self._twice_warned:
            return
        self._calls_since_optimizer += 1
        if not steps.since_reset():  # no optimizer step since the previous akl.step(): the same interval goes on
            return
        between, self._calls_since_optimizer = self._calls_since_optimizer - 1, 1  # this call is after it
        self._stepped_twice = [*self._stepped_twice, between] if between > 1 else []
        if len(self._stepped_twice) >= STEPPED_TWICE:
            *first, last = map(str, self._stepped_twice[-STEPPED_TWICE:])
            warnings.warn(f"adaptive KL: akl.step() ran {', '.join(first)} and {last} times between one optimizer "
                          f"step and the next, {STEPPED_TWICE} times in a row: {controller_kind(self.controller)} moves "
                          "beta at each akl.step() (call it once per optimizer.step(), not per micro-batch or pass).",
                          UserWarning, stacklevel=3)
            self._twice_warned = True

    def state_dict(self) -> dict[str, Any]:
        """JSON: the format version (`format_version`), the controller's kind (`controller`: "constant", "dynamic",
        "target" or a registered one's), its state (its beta, the generation batch count and its reward, ...),
        `completed_steps`, `configured_beta` (the beta this object was built with: a resume with another one says so),
        and what the next step reads of the KL seen so far: `last_raw_kl` (None before the first step; a KL-triggered
        reference sync reads it), `trained` (the `KLStatistics` sums, by name, of this step's training batches so
        far), `scored` (the same of a batch scored for the KL in the reward whose step has not run, or None) and
        `rewards` (the mean rewards observed since the last step, which its end hands the controller)."""
        return {"format_version": STATE_FORMAT, "controller": controller_kind(self.controller),
                **self.controller.state_dict(), "completed_steps": self.completed_steps,
                "configured_beta": self.beta,
                "last_raw_kl": self.last_raw_kl if math.isfinite(self.last_raw_kl) else None,
                "trained": asdict(self._trained), "scored": None if self._scored is None else asdict(self._scored),
                "rewards": list(self._rewards)}

    def load_state_dict(self, state: dict[str, Any], *, without_state: str = RESUME_WITHOUT_STATE) -> None:
        """Restore a `state_dict()`. `without_state`: how this loop resumes without it, for the warning that a moving
        beta continues from the checkpoint's where the run's beta changed (a trainer names its checkpoint's file). A
        state of another controller kind raises ValueError naming both. Older states load too: formats up to 6 without
        the beta the run was built with (a resume with another beta then cannot be told from a moved one, and says
        nothing); sums without `old_logps` (formats up to 5) load it as 0 (the old policy's log-probs' sum, which only
        the non-finite check reads); format 4 without rewards observed since the last step (it handed each to the
        controller at once); format 3 (the step's KL as [sum S_i, sum L_i, completions] lists under `step_kl` and
        `generation_kl`); formats 2 and 1 without the step's KL (a resumed run then has seen none). Format 1 has no
        version: the controller's fields and `completed_steps` (which the oldest trainer checkpoints lack), as the
        own-loop object and the trainer integrations' checkpoints wrote them; its kind is read from its fields."""
        if not isinstance(state, Mapping):  # a path or None would fail in dict() without naming the argument
            raise TypeError(f"state must be the dict that state_dict() returned (json.load of a saved one), not "
                            f"{type(state).__name__}")
        state = dict(state)
        version = state.pop("format_version", 1)
        if not is_whole(version, 1) or version > STATE_FORMAT:  # True is no version (record_sums' rule for counts)
            raise ValueError(f"adaptive KL state: format_version={version!r} is not supported: allowed is 1 to "
                             f"{STATE_FORMAT} (a newer unsloth-adaptive-kl wrote it?).")
        expected = controller_kind(self.controller)
        kind = state.pop("controller", None)
        if kind is None and version >= 2:  # format 2 added the kind: without it the state was cut or made by hand
            raise ValueError(f"adaptive KL state: format_version={version} has no 'controller' field (the kind every "
                             "state of format 2 on records): allowed is the dict state_dict() returned, whole.")
        fields = set(self.controller.state_dict())
        if kind is None:  # format 1: a dynamic controller's state alone has last_decayed_batch
            found = "dynamic" if "last_decayed_batch" in state else ("constant or target")
            compatible = expected in found.split(" or ")
        else:
            found, compatible = kind, kind == expected
        if not compatible:
            raise ValueError(
                f"adaptive KL state: a {found!r} controller's state cannot be loaded into this run's {expected!r} "
                f"controller (kl_adaptation_method={self.config.kl_adaptation_method!r}): resume with the "
                "kl_adaptation_method the checkpoint was written with.")
        # what state_dict() of this format wrote beside the controller's fields: one of them missing is refused as a
        # missing controller field is (a resumed run would restart its count or its sums unannounced)
        ours = _written_beside_the_controller(version)
        unknown = sorted(set(state) - fields - set(ours) - {"completed_steps"})  # format 1 may have it
        missing = sorted((fields | set(ours)) - set(state))
        if unknown or missing:
            found = f"unknown field(s) {', '.join(unknown)}" if unknown else f"missing field(s) {', '.join(missing)}"
            raise ValueError(f"adaptive KL state: {found} for a {expected!r} controller (format {version}): allowed "
                             f"are {', '.join(sorted(fields | set(ours)))}.")
        completed_steps = state.pop("completed_steps", 0)  # format 1: the oldest trainer checkpoints lack it
        last_raw_kl = state.pop("last_raw_kl", None)
        trained, scored = (_sums(state.pop(name, None), name, every_sum=version >= 6)
                           for name in (("trained", "scored") if version >= 4 else ("step_kl", "generation_kl")))
        rewards = state.pop("rewards", [])
        configured_beta = state.pop("configured_beta", None)  # formats up to 6 lack it
        if not (configured_beta is None or (is_real(configured_beta) and 0 <= configured_beta < math.inf)):
            raise reject("adaptive KL state: configured_beta", configured_beta, "a finite number >= 0 (the beta the "
                         "checkpoint's run was built with)")
        if not isinstance(rewards, list) or not all(is_real(r) and math.isfinite(r) for r in rewards):
            raise reject("adaptive KL state: rewards", rewards, "a list of finite numbers (the mean rewards observed "
                         "since the last step)")
        # a beta that is negative or not a number would flip or poison the KL term from the first resumed step
        value = state.get("value", 0.0)
        check_real("adaptive KL state: value", value, is_real(value) and 0 <= value < math.inf,
                   "a finite number >= 0 (beta)")
        if value == 0 == self.config.beta_min < self.beta and controller_kind(self.controller) == "target":
            # target multiplies beta a step: from 0 it would stay 0, the KL off (with beta_min > 0 the clamp lifts it)
            raise reject("adaptive KL state: value", value, "a number > 0 for target with beta_min=0: its "
                         "multiplicative update never leaves 0, so the KL term would stay off for the rest of the run "
                         "(set beta_min > 0 to resume from it at that floor)")
        check_whole("adaptive KL state: completed_steps", completed_steps, 0, "an integer >= 0")
        if not (last_raw_kl is None or (is_real(last_raw_kl) and math.isfinite(last_raw_kl))):
            raise reject("adaptive KL state: last_raw_kl", last_raw_kl, "None or a finite number (the last step's KL)")
        # every field of ours checked; the controller checks its own as it loads them, and gets its previous state
        # back where it refuses one: nothing is loaded unless all of it is
        previous = self.controller.state_dict()
        try:
            self.controller.load_state_dict(state)
        except Exception:
            self.controller.load_state_dict(previous)
            raise
        self.completed_steps = completed_steps
        self.last_raw_kl = math.nan if last_raw_kl is None else float(last_raw_kl)
        self._trained, self._scored = trained or KLStatistics(), scored
        self._rewards = [float(reward) for reward in rewards]
        self._check_loaded_beta(configured_beta, without_state)

    def _check_loaded_beta(self, configured_beta: Optional[float], without_state: str) -> None:
        """A constant beta is the run's own setting: a state's other one is not loaded (a trainer's own KL term
        trains at the run's), saying so. So is a beta of 0, which turns the KL term off (a trainer then takes the
        stock path), whatever the state's. A `dynamic` or `target` beta continues the run, saying so where this run
        was built with another beta than the checkpoint's run (`configured_beta`: a new beta is no restart of the
        schedule), and clamped, saying so, into this run's bounds (beta_min and beta, which dynamic only lowers;
        target's beta_min, beta_max), which a new config may have moved. A registered controller's state is its own:
        it is loaded as it is."""
        loaded, kind, config = self.controller.value, controller_kind(self.controller), self.config
        if (kind == "constant" or self.beta == 0) and loaded != self.beta:
            self.controller.value = self.beta
            why = ("a constant beta is the run's own setting" if kind == "constant" else
                   f"beta=0 turns the KL term off, whatever {kind}'s beta")
            warnings.warn(f"adaptive KL: the loaded state's beta {loaded:g} is not this run's beta={self.beta:g}: "
                          f"{why}, so {self.beta:g} is kept (the rest of the state is loaded).", UserWarning,
                          stacklevel=3)
        if kind not in ("dynamic", "target") or self.beta == 0:
            return
        ceiling = ("beta_max", config.beta_max) if kind == "target" else ("beta", self.beta)
        high = math.inf if ceiling[1] is None else ceiling[1]
        bounded = min(max(loaded, config.beta_min), high)
        named = f"beta_min={config.beta_min:g}" + (f", {ceiling[0]}={high:g}" if high < math.inf else "")
        bounds = f"outside this run's {named}: clamped to {bounded:g}, as {kind} keeps beta within them"
        if bounded != loaded:
            self.controller.value = bounded
        clamped = f", {bounds}" if bounded != loaded else ""
        if configured_beta is not None and configured_beta != self.beta:
            warnings.warn(f"adaptive KL: this run's beta={self.beta:g} is not the beta={configured_beta:g} the "
                          f"checkpoint's run was built with: {kind} moves beta, so the run continues from the "
                          f"checkpoint's beta {loaded:g}{clamped}. To start from {self.beta:g} instead, "
                          f"{without_state}.", UserWarning, stacklevel=3)
        elif clamped:
            warnings.warn(f"adaptive KL: the loaded state's beta {loaded:g} is {bounds}.", UserWarning, stacklevel=3)


# Intervals between optimizer steps in a row, each with more than one `step()`, that `_warn_if_stepped_twice` takes for
# a loop calling `step()` per micro-batch (one such interval alone is an optimizer step skipped, as fp16's scaler skips
# one).
STEPPED_TWICE = 3


def check_batch(logps: torch.Tensor, ref_logps: torch.Tensor, mask: torch.Tensor,
                per_token_kl: Optional[torch.Tensor] = None) -> None:
    """A loop's batch is (B, T) tensors of one shape, on one device: a (B, 1) mask or reference would broadcast, and
    every completion would silently count one token, or all share one reference log-prob. A ValueError names each
    shape (or device), or the entries of a mask that are neither 0 nor 1."""
    given = {"logps": logps, "ref_logps": ref_logps, "mask": mask}
    if per_token_kl is not None:
        given["per_token_kl"] = per_token_kl
    for name, tensor in given.items():
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor of shape (B, T), not {type(tensor).__name__}")
        if name != "mask" and not tensor.is_floating_point():  # integers would be values truncated, silently
            raise TypeError(f"{name} must be a floating-point tensor, not {tensor.dtype}")
    if logps.dim() != 2 or logps.shape[0] == 0 or any(tensor.shape != logps.shape for tensor in given.values()):
        shapes = ", ".join(f"{name} {tuple(tensor.shape)}" for name, tensor in given.items())
        raise ValueError(f"{', '.join(given)} must be (B, T) tensors of one shape (B >= 1 completions, T completion "
                         f"tokens; mask 1 on each completion's tokens, 0 on padding): got {shapes}.")
    if any(tensor.device != logps.device for tensor in given.values()):  # else torch's error names no tensor
        devices = ", ".join(f"{name} on {tensor.device}" for name, tensor in given.items())
        raise ValueError(f"{', '.join(given)} must be on one device (the policy's): got {devices}.")
    check_mask(mask)


def check_train(train: Any) -> None:
    """`train` is True or False: "no" trained (a truthy string) and None passed as an evaluation batch, silently."""
    if not isinstance(train, bool):
        raise reject("train", train, "True (a training batch, which the next step reads) or False (an evaluation "
                     "batch)")


def check_gather(gather: Any) -> None:
    """`gather` is a callable or None: an int or a process group handed in its place failed inside the statistics
    with "'int' object is not callable", naming nothing the loop passed."""
    if gather is not None and not callable(gather):
        raise reject("gather", gather, "a callable that all-gathers a tensor over processes along dim 0 (e.g. "
                     "accelerator.gather), or None (this process alone)")


def check_estimator_read(config: AdaptiveKLConfig, per_token_kl: Optional[torch.Tensor]) -> None:
    """A loop's own `per_token_kl` replaces the estimator: one set explicitly (`kl_estimator`) would go unread, so
    the pair is a ValueError naming it."""
    if per_token_kl is not None and config.kl_estimator is not None:
        raise ValueError(f"kl_estimator={config.kl_estimator!r} is not read where per_token_kl is given (the methods "
                         "shape and reduce that tensor instead): leave kl_estimator at None to pass a KL of your own, "
                         "or leave out per_token_kl to use the estimator.")


def check_mask(mask: torch.Tensor, name: str = "mask") -> None:
    """A ValueError where a loop's mask holds entries other than 0 and 1, naming how many: the core counts any
    nonzero entry as a whole token, so a per-token weight would silently count as one (one read of the mask)."""
    if mask.dtype == torch.bool:
        return
    other = (mask != 0) & (mask != 1)
    if bool(other.any()):
        count = int(other.sum())
        raise ValueError(f"{name} must hold 0 and 1 only (1 on each completion's tokens, 0 on padding): "
                         f"{count} {'entry is' if count == 1 else 'entries are'} neither, e.g. "
                         f"{mask[other][0].item()!r}. A per-token "
                         "weight is not a mask: each nonzero entry would count as one whole token.")


def divisors(max_completion_length: Any, token_normalizer: Any) -> ReductionContext:
    """The `ReductionContext` of a loop's own divisors (dr_grpo's `max_completion_length`, dapo/cispo/vespo's
    `token_normalizer`), each checked as a number, a tensor too: it must hold one number, read once (a count <= 0
    would flip or blow up the term). A one-element `token_normalizer` is that number whatever its shape (a (1,) count
    gave a (1,) term, which the metrics read as per-completion); a tensor `max_completion_length` is its value."""
    max_completion_length, token_normalizer = as_tensor_if_array(max_completion_length), as_tensor_if_array(
        token_normalizer)
    for name, value, allowed in (("max_completion_length", max_completion_length, "one integer >= 1"),
                                 ("token_normalizer", token_normalizer, "one number > 0 (the micro-batch's active "
                                                                        "tokens)")):
        if isinstance(value, torch.Tensor) and value.numel() != 1:
            raise ValueError(f"{name} is invalid: a tensor of shape {tuple(value.shape)}; allowed is {allowed}.")
    if isinstance(max_completion_length, torch.Tensor):
        max_completion_length = max_completion_length.item()
    if isinstance(token_normalizer, torch.Tensor):
        ReductionContext(token_normalizer=token_normalizer.item())  # its value, checked as a number is
        token_normalizer = token_normalizer.reshape(())
    return ReductionContext(max_completion_length, token_normalizer)


def as_tensor_if_array(value: Any) -> Any:
    """An array (numpy's, 0-d too; not a numpy scalar, which is a number) as the tensor it stands for; one torch
    cannot hold (text, objects) as it is, for the divisor's check to refuse by name."""
    if not hasattr(value, "__array__") or isinstance(value, (numbers.Number, torch.Tensor)):
        return value
    try:
        return torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError):
        return value


def _check_controller_fields(controller: Any) -> None:
    """Refuse, when the run is built, a (registered) controller whose `state_dict()` has a field `state_dict()` writes
    beside it: the state's own value would replace the controller's at every save, and the controller would resume
    from it."""
    taken = sorted(set(controller.state_dict()) & {"format_version", "controller",
                                                   *_written_beside_the_controller(STATE_FORMAT)})
    if taken:
        raise TypeError(f"beta controller {type(controller).__name__} ({controller_kind(controller)!r}): its "
                        f"state_dict() field(s) {', '.join(taken)} are the adaptive KL state's own, which every "
                        "checkpoint writes beside the controller's fields: rename them (an attribute whose name "
                        "starts with '_' is left out of ConstantBeta.state_dict).")


def _written_beside_the_controller(version: int) -> tuple[str, ...]:
    """The fields `state_dict()` of format `version` wrote beside the controller's own (formats 2 to 7; format 1
    wrote `completed_steps` from the own-loop object only)."""
    sums = ("trained", "scored") if version >= 4 else ("step_kl", "generation_kl") if version == 3 else ()
    return (("completed_steps",) * (version >= 2) + ("last_raw_kl",) * (version >= 3) + sums
            + ("rewards",) * (version >= 5) + ("configured_beta",) * (version >= 7))


def _sums(saved: Any, name: str, every_sum: bool) -> Optional[KLStatistics]:
    """A checkpoint's sums: by name (format 4 on; `every_sum`: each of today's, as formats 6 and 7 write them),
    or format 3's [sum S_i, sum L_i, completions]; anything else a ValueError naming the field."""
    if saved is None:
        return None
    names = asdict(KLStatistics())
    as_list = "" if every_sum else " or as format 3's [kl, tokens, completions]"
    allowed = (f"None, or the sums by name ({', '.join(names)}){as_list}, each a finite number ("
               f"{', '.join(NOT_NEGATIVE[:-1])} and {NOT_NEGATIVE[-1]} >= 0)")
    if every_sum and not (isinstance(saved, dict) and set(saved) == set(names)):
        raise reject(f"adaptive KL state: {name}", saved, allowed)
    try:
        sums = (KLStatistics(**saved) if isinstance(saved, dict) else
                KLStatistics(**dict(zip(("kl", "tokens", "completions"), saved, strict=True))))
    except (TypeError, ValueError):
        raise reject(f"adaptive KL state: {name}", saved, allowed) from None
    if invalid_sum(sums, finite=NAMES) is not None:  # as the package writes them: else fed to the next step's KL
        raise reject(f"adaptive KL state: {name}", saved, allowed)
    return sums
