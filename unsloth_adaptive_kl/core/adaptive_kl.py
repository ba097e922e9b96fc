"""`AdaptiveKL`: the trainer-agnostic adaptive-KL object that every loop drives (your own, TRL's, Unsloth's, Tinker's,
verl's). It holds the live beta (the controller) and turns per-token log-probs into the adapted KL term, the reward
penalty and the `adaptive_kl/*` metrics. Pure torch: it never imports a trainer.

Two ways in, one implementation:
- a loop of your own calls `kl_loss` / `reward_penalty` per (micro-)batch and `step` once per optimizer step;
- a trainer integration hands over the per-token KL the trainer itself computed (`term`), queues the micro-batch's
  statistics without a host transfer (`record`) and flushes them once per optimizer step, over all processes.
"""

from __future__ import annotations

import math
import statistics
from typing import Any, Callable, Optional

import torch

from .adaptation import CompletionKL, KLTerm, ReductionContext, completion_kl, kl_reduction, kl_term, loss_type_reduction
from .config import REWARD_KL_REDUCTIONS, AdaptiveKLConfig, _check_real, _is_real, _reject
from .controllers import WindowKL, controller_kind, make_beta_controller
from .estimators import checked_kl
from .errors import NonFiniteLogProbError
from .numerics import LogpCheck, nonfinite_message

METRIC_PREFIX = "adaptive_kl/"
STATE_FORMAT = 2  # `state_dict()`'s format: 2 carries "format_version" and "controller"; 1 (unversioned) did not
CHECK_COLUMNS = 2  # each statistics row's LogpCheck sums: policy, reference
Gather = Callable[[torch.Tensor], torch.Tensor]


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The gather of a single process: the tensor itself."""
    return tensor


def pearson_correlation(x: list[float], y: list[float]) -> float:
    """sum((x - mean x)(y - mean y)) / sqrt(sum (x - mean x)^2 * sum (y - mean y)^2); NaN when either is constant."""
    mx, my = statistics.fmean(x), statistics.fmean(y)
    dx, dy = [a - mx for a in x], [b - my for b in y]
    denominator = math.sqrt(sum(a * a for a in dx) * sum(b * b for b in dy))
    return sum(a * b for a, b in zip(dx, dy)) / denominator if denominator > 0 else math.nan


def split_columns(blocks: list[list[float]], widths: list[int]) -> list[list[float]]:
    """Gathered rows, one per process, each laid out as consecutive columns of the given widths -> each column with
    every process's values in process order."""
    columns: list[list[float]] = [[] for _ in widths]
    for block in blocks:
        start = 0
        for column, width in zip(columns, widths):
            column.extend(block[start : start + width])
            start += width
    return columns


def summarize(raws: list[float], adapteds: list[float], at_threshold: list[float], lengths: list[float],
              sequence_kl: list[float]) -> list[float]:
    """[mean raw KL, mean adapted KL, mean S_i, corr(L_i, S_i), clipped tokens / sum L_i] over every process's
    values (the raw and adapted entries are per micro-batch or per completion, as the caller recorded them)."""
    return [statistics.fmean(raws), statistics.fmean(adapteds), statistics.fmean(sequence_kl),
            pearson_correlation(lengths, sequence_kl), sum(at_threshold) / max(sum(lengths), 1.0)]


class AdaptiveKL:
    """The adaptive KL of one training run: beta_t (`current_beta`, from the configured controller) times the
    adapted KL term, its metrics, and its checkpointable state.

    `AdaptiveKL(config, beta, loss_type)` validates as `GRPOConfig` does (the same ValueError messages): `config` the
    adaptive-KL fields (None: the defaults, i.e. `none`), `beta` the initial coefficient (finite, >= 0, >= beta_min),
    `loss_type` the GRPO loss whose reduction the KL term follows (grpo, bnpo, dr_grpo, dapo, cispo, vespo, sapo,
    luspo).

    Per optimizer step of a loop: `kl_loss` (KL in the loss) or `reward_penalty` (KL in the reward) on each
    (micro-)batch, then `step(mean_reward=...)` once. `state_dict()` / `load_state_dict()` resume exactly.

    Nothing is read back from the device per micro-batch on the trainer path (`record`): each micro-batch's statistics
    stay a device tensor until the optimizer step ends, where they are gathered over processes and transferred to the
    host once, for the metrics and the controller together."""

    def __init__(self, config: Optional[AdaptiveKLConfig], beta: float, loss_type: str = "grpo") -> None:
        config = AdaptiveKLConfig() if config is None else config
        if not isinstance(config, AdaptiveKLConfig):
            raise TypeError(f"config must be an AdaptiveKLConfig (or None for the defaults), not {type(config).__name__}")
        _check_real("beta", beta, _is_real(beta) and 0 <= beta < math.inf, "a finite number >= 0")
        config.validate_adaptive_kl(beta=beta)
        if beta != 0:  # with beta = 0 there is no KL term to reduce (stock trainers skip it whatever the loss)
            loss_type_reduction(loss_type)
            kl_reduction(config, loss_type)
        self.config = config
        self.beta = float(beta)
        self.loss_type = loss_type
        self.controller = make_beta_controller(beta, config)
        self.completed_steps = 0  # optimizer steps `step` has seen (a loop of your own)
        self._pending: list[torch.Tensor] = []  # trainer path: one row per micro-batch of this step, on the device
        self._pending_checks: list[Optional[LogpCheck]] = []  # each row's log-probs, counted only if non-finite
        self._step_window: list[float] = [0.0, 0.0, 0.0]  # own loop: sum S_i, sum L_i, completions of this step
        self._generation_window: WindowKL | None = None  # kl_placement="reward": the KL of the batch being scored
        # The raw KL (all processes) of the last training step (kl_placement="reward": of the last generation batch
        # scored for training), which a KL-triggered reference sync reads; NaN before the first.
        self.last_raw_kl = math.nan
        self.last_metrics: dict[str, float] = {}

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
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """(beta_t * K, metrics) for one (micro-)batch, K the adapted KL term with autograd:
        k = the `kl_estimator` of (logps, ref_logps) per token (or `per_token_kl`, a KL you computed), shaped per token
        (clip/sigmoid), reduced as `loss_type` reduces the loss (or per `kl_reduction` / length normalisation).

        logps, ref_logps, mask: (B, T) policy and reference log-probs of the sampled tokens and the completion mask.
        max_completion_length: dr_grpo's divisor. token_normalizer: dapo/cispo/vespo's active-token count for this
        micro-batch. gather: a cross-process all-gather (e.g. `accelerator.gather`) for metrics over all processes.
        The metrics are floats under the `adaptive_kl/*` names (one host transfer); the step's KL is kept for
        the `target` controller, which `step` updates.

        Numerics: computed in float32 whatever the dtype of the inputs (bf16/fp16 are upcast; the gradient flows back
        to them); the returned term is float32 for half-precision input (float64 for float64). A NaN or +-inf in
        `logps` or `ref_logps` on a valid token raises `NonFiniteLogProbError` (a FloatingPointError and ValueError)
        naming the step, the tensor and how many tokens; masked positions may hold anything (their KL is 0, with a
        zero gradient)."""
        if self.config.kl_in_reward:
            raise ValueError("kl_placement='reward' puts beta * KL into the rewards, not the loss: call "
                             "reward_penalty(...) on each generation batch instead of kl_loss(...).")
        if per_token_kl is None:
            kl, check = checked_kl(logps, ref_logps, mask, self.config)
        else:
            kl, check = per_token_kl, LogpCheck.of(logps, ref_logps, mask)
        term = self.term(kl, mask, ReductionContext(max_completion_length, token_normalizer), with_grad=True,
                         check=check)
        (metrics,), window = self._flush([self._row(term)], gather or _local, self.completed_steps + 1, [check])
        self._step_window = [a + b for a, b in zip(self._step_window, window)]
        self.last_metrics = metrics
        return term.adapted * self.current_beta, metrics

    def reward_penalty(
        self,
        logps: torch.Tensor,
        ref_logps: torch.Tensor,
        mask: torch.Tensor,
        *,
        per_token_kl: Optional[torch.Tensor] = None,
        gather: Optional[Gather] = None,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """(P, metrics) for the KL in the reward, as `kl_loss` returns (term, metrics): P_i = beta_t * KL_i per
        completion, without gradient, to subtract from each reward before the group statistics. KL_i = the estimator
        per token, shaped (clip/sigmoid), reduced per completion by `kl_reduction` ('sequence_sum' / 'loss_type':
        sum_t m k'; 'sequence_mean': that over L_i). With `gather`, the penalties of every process in process order
        (float32, as trainers gather rewards). metrics: the `adaptive_kl/*` floats, `adaptive_kl/reward_penalty`
        included (also in `last_metrics`); `step` reads its KL. Numerics as `kl_loss`: float32, and a non-finite log-prob on a valid
        token raises `NonFiniteLogProbError`."""
        if self.config.kl_reduction not in REWARD_KL_REDUCTIONS:
            raise _reject("kl_reduction", self.config.kl_reduction,
                          f"one of {', '.join(REWARD_KL_REDUCTIONS)} for reward_penalty (one KL per completion)")
        with torch.no_grad():
            if per_token_kl is None:
                kl, check = checked_kl(logps, ref_logps, mask, self.config)
            else:
                kl, check = per_token_kl, LogpCheck.of(logps, ref_logps, mask)
        penalty, self.last_metrics = self.penalize(
            completion_kl(kl, mask, self.config, check=check), gather=gather or _local, train=True,
            completed_steps=self.completed_steps)
        return penalty, self.last_metrics

    def step(self, mean_reward: Optional[float] = None, *, kl: Optional[WindowKL] = None) -> float:
        """After each optimizer step: the beta controller's update from what the step saw, effective from the next
        step; returns the new beta. `mean_reward`: the mean (un-penalised) reward, over all processes, of a new
        generation batch (`dynamic` decays at most once per generation batch: pass None for further optimizer steps
        on the same batch). `target` reads the step's KL: `kl`, where the loop measured it itself (a `WindowKL`, as
        an engine that aggregates its own loss does), else what `kl_loss` or the last `reward_penalty` saw."""
        if mean_reward is not None:
            self.controller.observe_rewards(mean_reward)
        self.completed_steps += 1
        window, self._generation_window = self._generation_window, None
        if kl is not None:
            window = kl
        elif window is None:
            kl_sum, tokens, completions = self._step_window
            window = WindowKL.from_sums(kl_sum, tokens, completions) if completions else None
        self._step_window = [0.0, 0.0, 0.0]
        if window is not None:
            self.last_raw_kl = window.token_mean
        self.controller.step(self.completed_steps, window)
        return self.current_beta

    def state_dict(self) -> dict[str, Any]:
        """JSON: the format version (`format_version`), the controller's kind (`controller`: "constant", "dynamic" or
        "target"), its state (its beta, the generation batch count and its reward, ...) and `completed_steps`."""
        return {"format_version": STATE_FORMAT, "controller": controller_kind(self.controller),
                **self.controller.state_dict(), "completed_steps": self.completed_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a `state_dict()`. A state of another controller kind raises ValueError naming both. Older states
        load too: format 1 (no version: the controller's fields and `completed_steps`, as the own-loop object, the TRL
        and Unsloth checkpoints' `adaptive_kl_state.json` and verl's `adaptive_kl.json` wrote them; the oldest trainer
        checkpoints lack `completed_steps`), whose kind is read from its fields."""
        state = dict(state)
        version = state.pop("format_version", 1)
        if not isinstance(version, int) or not 1 <= version <= STATE_FORMAT:
            raise ValueError(f"adaptive KL state: format_version={version!r} is not supported: allowed is 1 to "
                             f"{STATE_FORMAT} (a newer unsloth-adaptive-kl wrote it?).")
        expected = controller_kind(self.controller)
        kind = state.pop("controller", None)
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
        completed_steps = state.pop("completed_steps", 0)  # the oldest trainer checkpoints lack it
        unknown = sorted(set(state) - fields)
        if unknown:
            raise ValueError(f"adaptive KL state: unknown field(s) {', '.join(unknown)} for a {expected!r} "
                             f"controller: allowed are {', '.join(sorted(fields))}.")
        self.completed_steps = completed_steps
        self.controller.load_state_dict(state)

    # ----- the trainer integrations -----------------------------------------------------------------------------

    def term(self, kl: torch.Tensor, mask: torch.Tensor, ctx: ReductionContext, loss_type: Optional[str] = None,
             with_grad: Optional[bool] = None, check: Optional[LogpCheck] = None) -> KLTerm:
        """The adapted KL term of a per-token KL the caller computed (`adaptation.kl_term`). Without `with_grad`, the
        term records a graph only where it replaces the trainer's own (`config.is_stock_kl` is False). `check`: the
        `LogpCheck` of the log-probs the KL came from, which `record` reports at the step's end if non-finite."""
        term = kl_term(kl, mask, self.config, loss_type or self.loss_type, ctx,
                       with_grad=not self.config.is_stock_kl if with_grad is None else with_grad)
        term.check = check
        return term

    def observe_rewards(self, mean_reward: float) -> None:
        """The mean reward over all processes of a new generation batch."""
        self.controller.observe_rewards(mean_reward)

    def record(
        self, term: KLTerm, *, gather: Gather, train: bool, end_of_step: bool, completed_steps: int
    ) -> list[dict[str, float]]:
        """Queue one micro-batch's statistics; at the end of an optimizer step in training (every call in
        evaluation) return the metrics of each queued micro-batch (averaged over processes, `adaptive_kl/` names)
        and, in training, update the controller from the step's global KL."""
        self._pending.append(self._row(term))
        self._pending_checks.append(term.check)
        if train and not end_of_step:
            return []
        rows, self._pending = self._pending, []
        checks, self._pending_checks = self._pending_checks, []
        metrics, (kl_sum, tokens, completions) = self._flush(rows, gather, completed_steps, checks)
        if train:
            self.last_raw_kl = statistics.fmean(m[METRIC_PREFIX + "raw_kl"] for m in metrics)
            self.controller.step(completed_steps, WindowKL.from_sums(kl_sum, tokens, completions))
            self.completed_steps = completed_steps
        return metrics

    def penalize(
        self, term: CompletionKL, *, gather: Gather, train: bool, completed_steps: int
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """kl_placement="reward": the penalty beta_t * KL_i of every completion of a generation batch, over all
        processes in process order (as the trainer gathers its rewards), and its metrics. beta_t is the beta after
        `completed_steps` optimizer steps (the schedule cut-off applied); `end_generation` (or `step`) then updates it
        from this batch. One collective and one host transfer."""
        if train:  # no new generation batch has been observed: only the beta_schedule_steps cut-off can apply
            self.controller.step(completed_steps)
        beta = self.current_beta
        n = term.adapted.numel()
        row = torch.cat([term.raw, term.adapted, term.at_threshold.view(1), self._check_sums(term.check, term.adapted),
                         term.lengths, term.sequence_kl, beta * term.adapted])
        table = gather(row.float()).view(-1, row.numel())
        rows = table.double().tolist()
        self._raise_if_nonfinite([[row[2 * n + 1 : 2 * n + 1 + CHECK_COLUMNS] for row in rows]], [term.check],
                                 completed_steps + 1)
        raws, adapteds, at_threshold, _, lengths, sequence_kl, penalties = split_columns(
            rows, [n, n, 1, CHECK_COLUMNS, n, n, n])
        metrics = self._metrics(summarize(raws, adapteds, at_threshold, lengths, sequence_kl), completed_steps,
                                reward_penalty=statistics.fmean(penalties))
        self._generation_window = WindowKL(token_mean=sum(sequence_kl) / max(sum(lengths), 1.0),
                                           sequence_sum=statistics.fmean(sequence_kl), completions=len(lengths))
        if train:
            self.last_raw_kl = metrics[METRIC_PREFIX + "raw_kl"]
        return table[:, -n:].reshape(-1), metrics

    def end_generation(self, mean_reward: float, completed_steps: int) -> None:
        """kl_placement="reward": after a training generation batch is scored, the controller reads its un-penalised
        mean reward (`dynamic`) and its KL (`target`); the new beta penalises the next batch."""
        self.controller.observe_rewards(mean_reward)
        window, self._generation_window = self._generation_window, None
        self.controller.step(completed_steps, window)
        self.completed_steps = completed_steps

    # ----- shared ---------------------------------------------------------------------------------------------------

    @staticmethod
    def _check_sums(check: Optional[LogpCheck], like: torch.Tensor) -> torch.Tensor:
        """The row's LogpCheck columns: its sums, or zeros where the caller had no log-probs to check."""
        return check.sums.to(like.device) if check is not None else like.new_zeros(CHECK_COLUMNS, dtype=torch.float32)

    @classmethod
    def _row(cls, term: KLTerm) -> torch.Tensor:
        """One micro-batch's statistics as one float row: raw, adapted, clipped tokens, the LogpCheck sums (policy,
        reference), L_i..., S_i..."""
        head = torch.stack([term.raw, term.adapted.detach(), term.at_threshold]).float()
        return torch.cat([head, cls._check_sums(term.check, head), term.lengths.float(), term.sequence_kl.float()])

    @staticmethod
    def _raise_if_nonfinite(sums: list[list[list[float]]], checks: list[Optional[LogpCheck]], step: int) -> None:
        """sums[micro-batch][process] = that row's LogpCheck sums: raise `NonFiniteLogProbError` where one is
        non-finite (every process sees the gathered rows, so every process raises)."""
        flags = [(batch, process, which) for batch, per_process in enumerate(sums)
                 for process, values in enumerate(per_process) for which, value in enumerate(values)
                 if not math.isfinite(value)]
        if flags:
            raise NonFiniteLogProbError(nonfinite_message(step, flags, checks))

    def _flush(self, rows: list[torch.Tensor], gather: Gather, completed_steps: int,
               checks: Optional[list[Optional[LogpCheck]]] = None) -> tuple[list[dict[str, float]], tuple[float, float, float]]:
        """The metrics of each micro-batch row (over all processes) and the step's (sum S_i, sum L_i, completions).
        One collective and one transfer; the rest is O(B) arithmetic on the host. A non-finite log-prob on a valid
        token (a row's LogpCheck sums) raises first."""
        sizes = [row.numel() for row in rows]
        table = gather(torch.cat(rows)).view(-1, sum(sizes)).double().tolist()
        head = 3 + CHECK_COLUMNS
        offsets = [sum(sizes[:index]) for index in range(len(sizes))]
        self._raise_if_nonfinite([[row[offset + 3 : offset + head] for row in table] for offset in offsets],
                                 checks or [None] * len(rows), completed_steps)
        metrics, kl_sum, tokens, completions = [], 0.0, 0.0, 0
        start = 0
        for size in sizes:
            n = (size - head) // 2
            blocks = [row[start : start + size] for row in table]  # this micro-batch, one block per process
            start += size
            raws, adapteds, at_threshold, _, lengths, sequence_kl = split_columns(blocks, [1, 1, 1, CHECK_COLUMNS, n, n])
            metrics.append(self._metrics(summarize(raws, adapteds, at_threshold, lengths, sequence_kl), completed_steps))
            kl_sum, tokens, completions = kl_sum + sum(sequence_kl), tokens + sum(lengths), completions + len(lengths)
        return metrics, (kl_sum, tokens, float(completions))

    def _metrics(self, summary: list[float], completed_steps: int, **extra: float) -> dict[str, float]:
        raw_kl, adapted_kl, mean_sequence_kl, correlation, clip_fraction = summary
        if not (math.isfinite(raw_kl) and math.isfinite(adapted_kl)):
            raise FloatingPointError(
                f"adaptive KL: non-finite KL at step {completed_steps}: raw_kl={raw_kl}, adapted_kl={adapted_kl}. "
                "The policy and reference log-probs diverged beyond float range."
            )
        metrics = {
            "raw_kl": raw_kl,
            "adapted_kl": adapted_kl,
            "current_beta": self.current_beta,
            "sequence_kl": mean_sequence_kl,
            "length_kl_corr": correlation,
            **extra,
        }
        if "clip" in self.config.kl_methods:
            metrics["clip_fraction"] = clip_fraction
        return {METRIC_PREFIX + name: value for name, value in metrics.items()}
