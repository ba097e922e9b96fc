"""The functional layer: pure functions of one batch, without state. `AdaptiveKL` (core/adaptive_kl.py) keeps the
state (beta's controller, the step's KL, checkpoints) and is built on these and on the named sums of
core/statistics.py; a loop that keeps its own state (a pipelined client thread, say) calls them directly, as
torchmetrics' `functional` sits beside its stateful classes.

- `adapted_kl`: the adapted KL term K of a (micro-)batch (estimator -> shaping -> reduction), with autograd;
- `completion_kls`: the per-completion KL_i of a generation batch, whose penalty is beta * KL_i;
- a batch's metrics: `gather_statistics([device_sums(term)], [term.check], step=...)[0].metrics(...)`
  (core/statistics.py).

Notation: k the per-token KL estimate, m the mask, L_i = sum_t m, S_i = sum_t m k (the raw KL of completion i).
"""

from __future__ import annotations

from typing import Optional

import torch

from .adaptation import KLTerm, ReductionContext, completion_kl, kl_term
from .config import AdaptiveKLConfig
from .estimators import checked_kl
from .numerics import LogpCheck


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
    non-finite check, which `gather_statistics` raises on. Float32 for half-precision input."""
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
