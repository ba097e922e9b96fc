"""A batch's KL statistics as named sums: every `adaptive_kl/*` metric and the step's KL that the controller reads
are functions of them, and sums add, across micro-batches, steps and processes, whatever each one's batch size.

Notation: k the per-token KL estimate, m the mask, L_i = sum_t m, S_i = sum_t m k (the raw KL of completion i); a
completion is trained on when L_i > 0 (a truncated completion the trainer masks out, a padding sample, is not).

`device_sums(term)` turns one batch's `KLTerm` into its sums as one float64 device tensor (no host transfer);
`gather_statistics` gathers a step's rows over processes with one collective and one transfer and returns a
`KLStatistics` per batch (summed over processes), raising `NonFiniteLogProbError` first where a log-prob on a valid
token is not finite, and a ValueError where a tensor's valid log-probs average above 0 (negative log-likelihoods).
`KLStatistics.metrics` computes docs/metrics.md's values from the sums, the Pearson correlation included (as
torchmetrics computes it from running sums).
"""

from __future__ import annotations

import math
from dataclasses import astuple, dataclass, fields
from typing import Any, Callable, Optional, Sequence

import torch

from .adaptation import KLTerm
from .controllers import WindowKL
from .config import is_real, reject
from .numerics import (KINDS, LogpCheck, NonFinite, nonfinite_error, positive_logps, positive_logps_error,
                       this_process)

METRIC_PREFIX = "adaptive_kl/"
# Why the KL is not finite where the log-probs are (the metrics here and a traced loss's check say it alike): of the
# built-in estimators, k3, k3+ and k3_bottom_percentile exponentiate the log-ratio unclamped (low_var_kl clamps it),
# and k2 squares it (float32's range ends at 3.4e38, so a log-ratio beyond 2.6e19 overflows there).
KL_OVERFLOW = ("the estimator overflowed float32 where they diverged (k3, k3+ and k3_bottom_percentile exponentiate "
               "the log-ratio; k2 squares it)")
Gather = Callable[[torch.Tensor], torch.Tensor]
# Below this share of n sum x^2, a variance n sum x^2 - (sum x)^2 is rounding error: x is constant, corr undefined.
CONSTANT_BELOW = 1e-10


def local(tensor: torch.Tensor) -> torch.Tensor:
    """The gather of a single process: the tensor itself."""
    return tensor


@dataclass(frozen=True)
class KLStatistics:
    """Sums over one or more batches (all processes, once gathered).

    completions: completions trained on (L_i > 0); tokens: sum L_i; kl: sum S_i; tokens_sq: sum L_i^2;
        tokens_kl: sum L_i S_i; kl_sq: sum S_i^2.
    entries: how many raw/adapted values are summed (one per micro-batch with the KL in the loss, one per completion
        trained on with the KL in the reward); raw, adapted: their sums.
    clipped: valid tokens with k >= kl_clip_threshold (`clip` only, else 0).
    policy_logps, reference_logps, old_logps: the sums of the valid log-probs (`LogpCheck`; the old policy's 0
        where the door holds none): non-finite exactly when one is."""

    completions: float = 0.0
    tokens: float = 0.0
    kl: float = 0.0
    tokens_sq: float = 0.0
    tokens_kl: float = 0.0
    kl_sq: float = 0.0
    entries: float = 0.0
    raw: float = 0.0
    adapted: float = 0.0
    clipped: float = 0.0
    policy_logps: float = 0.0
    reference_logps: float = 0.0
    old_logps: float = 0.0

    @classmethod
    def of_completions(cls, lengths: Sequence[float], sums: Sequence[float], *, entries: float, raw: float,
                       adapted: float, clipped: float = 0.0, policy_logps: float = 0.0,
                       reference_logps: float = 0.0, old_logps: float = 0.0) -> "KLStatistics":
        """One batch's sums from its completions' L_i and S_i read to the host, where a trainer reads its numbers
        there anyway (an engine whose metrics synchronise every micro-batch): `device_sums`'s fields, in
        Python floats, without a device operation per field."""
        return cls(completions=float(sum(length > 0 for length in lengths)), tokens=float(sum(lengths)),
                   kl=float(sum(sums)), tokens_sq=float(sum(length * length for length in lengths)),
                   tokens_kl=float(sum(length * kl for length, kl in zip(lengths, sums))),
                   kl_sq=float(sum(kl * kl for kl in sums)), entries=entries, raw=raw, adapted=adapted,
                   clipped=clipped, policy_logps=policy_logps, reference_logps=reference_logps, old_logps=old_logps)

    def __add__(self, other: "KLStatistics") -> "KLStatistics":
        return KLStatistics(*(a + b for a, b in zip(astuple(self), astuple(other))))

    def window(self, passes: int = 1) -> Optional[WindowKL]:
        """The step's KL for the controller (None where it trained on no completion): token_mean = sum S_i / sum L_i,
        sequence_sum = sum S_i / completions, and n = completions / passes (a completion trained on in each of
        `passes` optimizer passes over its generation batch counts once per batch)."""
        if not self.completions:
            return None
        return WindowKL(token_mean=self.kl / max(self.tokens, 1.0), sequence_sum=self.kl / self.completions,
                        completions=self.completions / passes)

    def metrics(self, *, beta: float, config: Any, step: int, reward: bool = False) -> dict[str, float]:
        """The `adaptive_kl/*` metrics of docs/metrics.md: raw_kl = raw / entries, adapted_kl = adapted / entries,
        current_beta, sequence_kl = sum S_i / completions and length_kl_corr = corr(L_i, S_i) over the completions
        trained on, reward_penalty = beta * adapted_kl (`reward`), clip_fraction = clipped / sum L_i (`clip` only).
        With the KL in the reward the means are over the completions trained on, as sequence_kl's (NaN where there is
        none). A non-finite raw or adapted KL raises FloatingPointError naming `step`."""
        raw_kl, adapted_kl = (self.raw / self.entries, self.adapted / self.entries) if self.entries else (math.nan,) * 2
        if self.entries and not (math.isfinite(raw_kl) and math.isfinite(adapted_kl)):
            raise FloatingPointError(
                f"adaptive KL: non-finite KL at step {step}: raw_kl={raw_kl}, adapted_kl={adapted_kl}. "
                "The policy and reference log-probs are finite on valid tokens, so the KL itself is not: "
                f"{KL_OVERFLOW}, or a per-token KL handed in (per_token_kl, a trainer's own) holds a NaN or inf on a "
                "valid token.")
        values = {"raw_kl": raw_kl, "adapted_kl": adapted_kl, "current_beta": beta,
                  "sequence_kl": self.kl / self.completions if self.completions else math.nan,
                  "length_kl_corr": self.length_kl_corr()}
        if reward:
            values["reward_penalty"] = beta * adapted_kl
        if "clip" in config.kl_methods:
            values["clip_fraction"] = self.clipped / max(self.tokens, 1.0)
        return {METRIC_PREFIX + name: value for name, value in values.items()}

    def length_kl_corr(self) -> float:
        """Pearson's r of (L_i, S_i) over the completions trained on, from the sums:
        (n sum LS - sum L sum S) / sqrt((n sum L^2 - (sum L)^2)(n sum S^2 - (sum S)^2)); NaN when either is constant."""
        n = self.completions
        var_length = n * self.tokens_sq - self.tokens**2
        var_kl = n * self.kl_sq - self.kl**2
        if var_length <= CONSTANT_BELOW * n * self.tokens_sq or var_kl <= CONSTANT_BELOW * n * self.kl_sq:
            return math.nan
        return (n * self.tokens_kl - self.tokens * self.kl) / math.sqrt(var_length * var_kl)


NAMES = tuple(field.name for field in fields(KLStatistics))


def device_sums(term: KLTerm) -> torch.Tensor:
    """One batch's `KLStatistics` as a float64 device tensor in field order (no host transfer): the sums over the
    completions of 1{L_i > 0}, L_i, S_i, L_i^2, L_i S_i, S_i^2 (in float64: sum L_i^2 outgrows float32's integers),
    then the batch's scalars; entries is one per micro-batch in the loss, one per completion trained on in the
    reward (the others' KL_i is 0)."""
    lengths, sums = term.lengths.double(), term.sequence_kl.double()
    trained = lengths.sign()
    moments = torch.stack([trained, lengths, sums, lengths * lengths, lengths * sums, sums * sums]).sum(-1)
    entries = trained.sum() if term.raw.dim() else term.lengths.new_ones(())
    check = term.check.sums if term.check is not None else term.sequence_kl.new_zeros(len(KINDS))
    # Few operations, each of one dtype: on a CPU each costs microseconds whatever its size, a mixed-dtype one
    # several times more (12 scalars stacked one by one: 150 against 65 us a call, measured).
    scalars = torch.stack([entries.to(term.raw.dtype), term.raw.sum(), term.adapted.detach().sum(),
                           term.at_threshold.to(term.raw.dtype)])
    return torch.cat([moments, torch.cat([scalars, check.to(term.raw.dtype)]).double()])


# the sums of counts (finite whatever the KL), and those never negative as a batch's are computed
COUNTS = ("completions", "tokens", "tokens_sq", "entries", "clipped")
NOT_NEGATIVE = COUNTS + ("kl_sq",)


def invalid_sum(sums: KLStatistics, finite: Sequence[str] = COUNTS) -> Optional[str]:
    """The first field of `sums` no batch's sums can hold, or None: not a real number, not finite among `finite` (the
    counts by default; a non-finite KL is the metrics' FloatingPointError, as for a batch of one's own), or below 0
    among `NOT_NEGATIVE` (a count or a square). The rule of every door that takes sums from outside."""
    for field in fields(sums):
        value = getattr(sums, field.name)
        if (not is_real(value) or (field.name in finite and not math.isfinite(value))
                or (field.name in NOT_NEGATIVE and value < 0)):
            return field.name
    return None


def check_given_sums(batches: Sequence[KLStatistics], step: int) -> None:
    """An engine's own sums, checked as a batch of one's own is: each a `KLStatistics`; a non-finite log-prob sum
    raises `NonFiniteLogProbError` naming `step` (as `gather_statistics` does; the process and the tokens are not
    known here), a field `invalid_sum` finds a ValueError naming it, and so do log-probs averaging above 0
    (`check_logp_means`)."""
    for index, sums in enumerate(batches):
        if not isinstance(sums, KLStatistics):
            raise TypeError(f"record_sums: batches[{index}] must be a KLStatistics, not {type(sums).__name__}")
        logps = (sums.policy_logps, sums.reference_logps, sums.old_logps)
        found = [NonFinite(name, kind) for name, kind, value in zip(LogpCheck.names, KINDS, logps)
                 if is_real(value) and not math.isfinite(value)]
        if found:
            raise nonfinite_error(step, found)
        field = invalid_sum(sums)
        if field is not None:
            raise reject(f"record_sums: batches[{index}].{field}", getattr(sums, field),
                         "a finite number >= 0 (a count, as device_sums computes it)" if field in COUNTS
                         else "a number >= 0 (a sum of squares)" if field in NOT_NEGATIVE else "a number")
    check_logp_means(batches, step)


def check_logp_means(batches: Sequence[KLStatistics], step: int, names: Sequence[str] = LogpCheck.names) -> None:
    """ValueError (`positive_logps_error`) where a tensor's valid log-probs over `batches` (summed) average above 0
    beyond rounding: negative log-likelihoods passed for log-probs. From the sums alone: no device operation."""
    total = sum(batches, KLStatistics())
    found = positive_logps((total.policy_logps, total.reference_logps, total.old_logps), total.tokens, names)
    if found:
        raise positive_logps_error(step, found, total.tokens)


def gather_statistics(rows: list[torch.Tensor], checks: list[Optional[LogpCheck]], *, step: int,
                      gather: Gather = local) -> list[KLStatistics]:
    """Each batch's statistics (`device_sums` rows, one per batch, the same count on every process) summed over
    processes: one collective, one host transfer. A non-finite log-prob on a valid token (a row's `policy_logps`,
    `reference_logps` or `old_logps` on any process) raises `NonFiniteLogProbError` naming `step`, and log-probs
    averaging above 0 a ValueError (`check_logp_means`); every process sees every row, so every process raises.
    checks: this process's `LogpCheck` of each batch (for the error's token counts and the tensors' names)."""
    table = gather(torch.stack(rows)).view(-1, len(rows), len(NAMES)).tolist()  # [process][batch][field]
    per_process = [[KLStatistics(*values) for values in process] for process in table]
    found = nonfinite_found(per_process, checks)
    if found:
        raise nonfinite_error(step, found)
    totals = per_process[0]
    for batches in per_process[1:]:
        totals = [total + sums for total, sums in zip(totals, batches)]
    check_logp_means(totals, step, names_of(checks))
    return totals


def names_of(checks: Sequence[Optional[LogpCheck]]) -> tuple[str, str, str]:
    """What a step's checks call the tensors (a door names where its log-probs came from), else the defaults."""
    return next((check.names for check in checks if check is not None), LogpCheck.names)


def nonfinite_found(per_process: list[list[KLStatistics]], checks: list[Optional[LogpCheck]]) -> list[NonFinite]:
    """Each (tensor, process) whose valid log-probs hold a NaN or +-inf, from the gathered sums: counted for this
    process's batches (`checks`), named by process for the others (only their sums are known here)."""
    flags = [(which, process, batch) for process, batches in enumerate(per_process)
             for batch, sums in enumerate(batches)
             for which, value in enumerate((sums.policy_logps, sums.reference_logps, sums.old_logps))
             if not math.isfinite(value)]
    if not flags:  # every step: one pass over the sums, nothing else
        return []
    rank, names = this_process(), names_of(checks)
    found = []
    for which, process in sorted({(which, process) for which, process, _ in flags}):
        tokens = None
        if process == rank:
            tokens = sum(checks[batch].counts()[which] for w, p, batch in flags
                         if (w, p) == (which, process) and batch < len(checks) and checks[batch] is not None)
        found.append(NonFinite(names[which], KINDS[which], process, tokens))
    return found
