"""The functional layer: pure functions of one batch, without state. `AdaptiveKL` (core/adaptive_kl.py) keeps the
state (beta's controller, the step's KL, checkpoints) and is built on these; a loop that keeps its own state (a
pipelined client thread, say) calls them directly, as torchmetrics' `functional` sits beside its stateful classes.

- `adapted_kl`: the adapted KL term K of a (micro-)batch (estimator -> shaping -> reduction), with autograd;
- `completion_kls`: the per-completion KL_i of a generation batch, whose penalty is beta * KL_i;
- `statistics_row` / `step_statistics` / `penalty_statistics`: a batch's `adaptive_kl/*` metrics (docs/metrics.md)
  and the step's KL (`StepKL`: sum_i S_i, sum_i L_i, completions), over every process with one gather and one
  host transfer; a non-finite log-prob on a valid token raises `NonFiniteLogProbError` there.

Notation: k the per-token KL estimate, m the mask, L_i = sum_t m, S_i = sum_t m k (the raw KL of completion i).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from .adaptation import KLTerm, ReductionContext, completion_kl, kl_term
from .config import AdaptiveKLConfig
from .controllers import WindowKL
from .estimators import checked_kl
from .errors import NonFiniteLogProbError
from .numerics import LogpCheck, nonfinite_message

METRIC_PREFIX = "adaptive_kl/"
CHECK_COLUMNS = 2  # each statistics row's LogpCheck sums: policy, reference
Gather = Callable[[torch.Tensor], torch.Tensor]


def local(tensor: torch.Tensor) -> torch.Tensor:
    """The gather of a single process: the tensor itself."""
    return tensor


@dataclass(frozen=True)
class StepKL:
    """The raw KL a step saw, as sums over every completion it trained on (all processes): sum_i S_i, sum_i L_i and
    the completion count. Sums add across micro-batches; `window` turns them into the controller's `WindowKL`
    (token_mean = sum S_i / sum L_i: the step's KL that `ref_model_sync_kl` and `target` read)."""

    kl_sum: float = 0.0
    tokens: float = 0.0
    completions: float = 0.0

    @classmethod
    def of(cls, lengths: list[float], sequence_kl: list[float]) -> "StepKL":
        """A batch's sums from its L_i and S_i; a completion without a valid token (L_i = 0) was not trained on."""
        return cls(sum(sequence_kl), sum(lengths), sum(1 for length in lengths if length > 0))

    def __add__(self, other: "StepKL") -> "StepKL":
        return StepKL(self.kl_sum + other.kl_sum, self.tokens + other.tokens, self.completions + other.completions)

    def window(self) -> Optional[WindowKL]:
        """The step's `WindowKL`, None where it trained on no completion."""
        return WindowKL.from_sums(self.kl_sum, self.tokens, self.completions) if self.completions else None


def _per_token(logps: torch.Tensor, ref_logps: torch.Tensor, mask: torch.Tensor, config: AdaptiveKLConfig,
               per_token_kl: Optional[torch.Tensor]) -> tuple[torch.Tensor, LogpCheck]:
    """(k, the log-probs' non-finite check): the configured estimator's, or `per_token_kl` where the caller has one."""
    if per_token_kl is None:
        return checked_kl(logps, ref_logps, mask, config)
    return per_token_kl, LogpCheck.of(logps, ref_logps, mask)


def adapted_kl(
    logps: torch.Tensor, ref_logps: torch.Tensor, mask: torch.Tensor, config: AdaptiveKLConfig, *,
    loss_type: str = "grpo", context: ReductionContext = ReductionContext(),
    per_token_kl: Optional[torch.Tensor] = None, with_grad: bool = True,
) -> KLTerm:
    """K, the adapted KL term of one (micro-)batch: k = the `kl_estimator` of (logps, ref_logps) per token (or
    `per_token_kl`), shaped per token (clip/sigmoid/registered), reduced as `loss_type` reduces the loss (or per
    `kl_reduction` / length normalisation). The loss adds beta * `.adapted`; `.check` carries the log-probs'
    non-finite check, which `step_statistics` raises on. Float32 for half-precision input."""
    kl, check = _per_token(logps, ref_logps, mask, config, per_token_kl)
    term = kl_term(kl, mask, config, loss_type, context, with_grad=with_grad)
    term.check = check
    return term


@torch.no_grad()
def completion_kls(
    logps: torch.Tensor, ref_logps: torch.Tensor, mask: torch.Tensor, config: AdaptiveKLConfig, *,
    per_token_kl: Optional[torch.Tensor] = None,
) -> KLTerm:
    """KL_i of every completion of a generation batch, for the penalty beta * KL_i (no gradient): the estimator per
    token, shaped, reduced per completion by `kl_reduction` (sequence_sum: sum_t m k'; sequence_mean: over L_i)."""
    kl, check = _per_token(logps, ref_logps, mask, config, per_token_kl)
    return completion_kl(kl, mask, config, check=check)


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


def kl_metrics(raws: list[float], adapteds: list[float], at_threshold: list[float], lengths: list[float],
               sequence_kl: list[float], *, beta: float, config: AdaptiveKLConfig, step: int,
               **extra: float) -> dict[str, float]:
    """The `adaptive_kl/*` metrics of docs/metrics.md over every process's values: raw_kl and adapted_kl (the mean
    of the raw and adapted entries: one per micro-batch in the loss, one per completion in the reward), current_beta,
    sequence_kl (mean S_i) and length_kl_corr (corr(L_i, S_i)) over the completions with a valid token (L_i > 0),
    clip_fraction (`clip` only: clipped tokens / sum L_i), and `extra`. A non-finite raw or adapted KL raises
    FloatingPointError naming `step`."""
    raw_kl, adapted_kl_value = statistics.fmean(raws), statistics.fmean(adapteds)
    if not (math.isfinite(raw_kl) and math.isfinite(adapted_kl_value)):
        raise FloatingPointError(
            f"adaptive KL: non-finite KL at step {step}: raw_kl={raw_kl}, adapted_kl={adapted_kl_value}. "
            "The policy and reference log-probs diverged beyond float range.")
    # A completion without a valid token (a truncated one the trainer masks out, a trainer's padding sample) has no
    # KL to measure: as a point (0, 0) it would pull the mean down and bias the correlation.
    trained = [(length, kl) for length, kl in zip(lengths, sequence_kl) if length > 0]
    trained_lengths, trained_kl = [length for length, _ in trained], [kl for _, kl in trained]
    metrics = {"raw_kl": raw_kl, "adapted_kl": adapted_kl_value, "current_beta": beta,
               "sequence_kl": statistics.fmean(trained_kl) if trained else math.nan,
               "length_kl_corr": pearson_correlation(trained_lengths, trained_kl) if trained else math.nan,
               **extra}
    if "clip" in config.kl_methods:
        metrics["clip_fraction"] = sum(at_threshold) / max(sum(lengths), 1.0)
    return {METRIC_PREFIX + name: value for name, value in metrics.items()}


def _check_sums(check: Optional[LogpCheck], like: torch.Tensor) -> torch.Tensor:
    """A row's LogpCheck columns: its sums, or zeros where the caller had no log-probs to check."""
    return check.sums.to(like.device) if check is not None else like.new_zeros(CHECK_COLUMNS, dtype=torch.float32)


def _raise_if_nonfinite(sums: list[list[list[float]]], checks: list[Optional[LogpCheck]], step: int) -> None:
    """sums[batch][process] = that row's LogpCheck sums: raise `NonFiniteLogProbError` where one is non-finite
    (every process sees the gathered rows, so every process raises)."""
    flags = [(batch, process, which) for batch, per_process in enumerate(sums)
             for process, values in enumerate(per_process) for which, value in enumerate(values)
             if not math.isfinite(value)]
    if flags:
        raise NonFiniteLogProbError(nonfinite_message(step, flags, checks))


def statistics_row(term: KLTerm) -> torch.Tensor:
    """One micro-batch's statistics as one float32 device row (no host transfer): raw, adapted, clipped tokens, the
    LogpCheck sums (policy, reference), L_i..., S_i..."""
    head = torch.stack([term.raw, term.adapted.detach(), term.at_threshold]).float()
    return torch.cat([head, _check_sums(term.check, head), term.lengths.float(), term.sequence_kl.float()])


def step_statistics(rows: list[torch.Tensor], checks: list[Optional[LogpCheck]], *, beta: float,
                    config: AdaptiveKLConfig, step: int, gather: Gather = local) -> tuple[list[dict[str, float]], StepKL]:
    """The metrics of each micro-batch row (`statistics_row`) over all processes, and the step's `StepKL`. One
    collective and one transfer; the rest is O(B) arithmetic on the host. A non-finite log-prob on a valid token
    (a row's LogpCheck sums) raises first, naming `step`."""
    sizes = [row.numel() for row in rows]
    table = gather(torch.cat(rows)).view(-1, sum(sizes)).double().tolist()
    head = 3 + CHECK_COLUMNS
    offsets = [sum(sizes[:index]) for index in range(len(sizes))]
    _raise_if_nonfinite([[row[offset + 3 : offset + head] for row in table] for offset in offsets], checks, step)
    metrics, seen = [], StepKL()
    for offset, size in zip(offsets, sizes):
        n = (size - head) // 2
        blocks = [row[offset : offset + size] for row in table]  # this micro-batch, one block per process
        raws, adapteds, at_threshold, _, lengths, sequence_kl = split_columns(blocks, [1, 1, 1, CHECK_COLUMNS, n, n])
        metrics.append(kl_metrics(raws, adapteds, at_threshold, lengths, sequence_kl, beta=beta, config=config,
                                  step=step))
        seen = seen + StepKL.of(lengths, sequence_kl)
    return metrics, seen


def penalty_statistics(term: KLTerm, *, beta: float, config: AdaptiveKLConfig, step: int,
                       gather: Gather = local) -> tuple[torch.Tensor, dict[str, float], StepKL]:
    """The KL in the reward: (P, metrics, the batch's `StepKL`) with P_i = beta * KL_i for every completion of every
    process in process order (float32, as trainers gather rewards) and the metrics of `kl_metrics` per completion,
    with `adaptive_kl/reward_penalty` = mean P_i. One collective and one host transfer."""
    n = term.adapted.numel()
    row = torch.cat([term.raw, term.adapted, term.at_threshold.view(1), _check_sums(term.check, term.adapted),
                     term.lengths, term.sequence_kl, beta * term.adapted])
    table = gather(row.float()).view(-1, row.numel())
    rows = table.double().tolist()
    _raise_if_nonfinite([[row[2 * n + 1 : 2 * n + 1 + CHECK_COLUMNS] for row in rows]], [term.check], step)
    raws, adapteds, at_threshold, _, lengths, sequence_kl, penalties = split_columns(
        rows, [n, n, 1, CHECK_COLUMNS, n, n, n])
    metrics = kl_metrics(raws, adapteds, at_threshold, lengths, sequence_kl, beta=beta, config=config, step=step,
                         reward_penalty=statistics.fmean(penalties))
    return table[:, -n:].reshape(-1), metrics, StepKL.of(lengths, sequence_kl)
