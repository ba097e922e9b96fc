"""The one KL pipeline: from (log-probs, reference log-probs, mask, config, loss type, context) to the `KLTerm` a
door needs. Every door makes its KL term here: `AdaptiveKL.kl_loss` / `reward_penalty` (a loop of your own),
`AdaptiveKL.term` (a trainer integration's loss and reward), and `token_kl`, its per-token stage, where a loss is
reduced by other means (per-token weights, a trainer's own aggregation). It calls only leaf modules, each once per
tensor:

    mask   numerics.keep_valid: the mask converted once; the log-probs, the reference and the KL each masked once
           (masked positions 0 with a zero gradient, whatever they held)
    check  numerics.LogpCheck of the masked log-probs (a non-finite valid log-prob raises at the step's end)
    k      estimators: the configured estimator of the masked log-probs, or the per-token KL a trainer computed
    k'     shapings: clip / sigmoid / a registered shaping (each maps 0 to 0)
    K      reductions: the loss type's (or kl_reduction's) reduction of the per-completion sums, or with the KL in
           the reward one KL_i per completion (`neutral_where_empty`: where a door that computes the group statistics
           gives a completion without tokens its group's mean penalty)

Notation: k the per-token KL estimate, m the mask, L_i = sum_t m, S_i = sum_t m k (the raw KL of completion i).
Everything is computed in float32 whatever the input's dtype (bf16/fp16 upcast, float64 rounded), and is traceable
torch (no `.item()`), so it also runs inside `torch.compile(fullgraph=True)`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch

from .estimators import run_estimator
from .numerics import LogpCheck, keep_valid, valid_positions
from .reductions import ReductionContext, kl_reduction, loss_type_reduction, reduce_sums
from .reductions import context_in_float32, reward_reduction
from .shapings import clipped_tokens, shape_kl

if TYPE_CHECKING:  # the pipeline reads the config's fields; the config does not import the pipeline
    from .config import AdaptiveKLConfig


@dataclass
class TokenKL:
    """The per-token stage of the pipeline: the mask as bool, k (masked positions 0), k' = shape(k) (k itself where
    nothing shapes), and the check of the log-probs k came from."""

    valid: torch.Tensor
    kl: torch.Tensor
    shaped: torch.Tensor
    check: LogpCheck


def token_kl(logps: torch.Tensor, ref_logps: torch.Tensor, mask: torch.Tensor, config: AdaptiveKLConfig, *,
             per_token_kl: Optional[torch.Tensor] = None, names: Optional[dict[str, str]] = None,
             old_logps: Optional[torch.Tensor] = None) -> TokenKL:
    """mask, check, estimate, shape: k = the configured estimator of the masked log-probs, or `per_token_kl` (the KL
    a trainer computed itself) masked; k' = shape(k). `old_logps`: the old policy's log-probs where a door holds them
    (a trainer's importance ratio divides by them), checked with the others. `names` (keyed by `KINDS`: policy,
    reference, old policy): what a non-finite error calls each tensor (where it came from)."""
    valid = valid_positions(mask)
    # The KL's gradient is the policy's alone: a reference handed over with a graph (a loop's own reference forward)
    # gets none.
    logp, ref = keep_valid(logps, valid), keep_valid(ref_logps.detach(), valid)
    old = None if old_logps is None else keep_valid(old_logps.detach(), valid)
    check = LogpCheck.of_masked(logp, ref, old, names)
    kl = keep_valid(run_estimator(logp, ref, valid, config) if per_token_kl is None else per_token_kl, valid)
    return TokenKL(valid, kl, shape_kl(kl, config), check)


@dataclass
class KLTerm:
    """One batch's KL and diagnostics: a micro-batch's KL term (KL in the loss), or a generation batch's
    per-completion KL (KL in the reward).

    raw: the un-adapted KL reduced as loss_type reduces the loss (detached, for logging); in the reward, KL_i of each
    completion (shape (B,)).
    adapted: the adapted KL, the quantity beta multiplies in the loss (carries gradient); in the reward, KL_i of the
    shaped per-token KL (detached: the penalty enters the advantages, not the gradient).
    sequence_kl: S_i = sum_t m k, each completion's summed un-adapted KL (detached). lengths: L_i.
    at_threshold: how many valid tokens have k >= kl_clip_threshold (`clip` only; 0 otherwise).
    check: the non-finite check of the log-probs the KL came from.
    All float32, whatever the input's dtype."""

    raw: torch.Tensor
    adapted: torch.Tensor
    sequence_kl: torch.Tensor
    lengths: torch.Tensor
    at_threshold: torch.Tensor
    check: Optional[LogpCheck] = None


def kl_term(
    logps: torch.Tensor, ref_logps: torch.Tensor, mask: torch.Tensor, config: AdaptiveKLConfig, *,
    loss_type: str = "grpo", context: ReductionContext = ReductionContext(),
    per_token_kl: Optional[torch.Tensor] = None, with_grad: Optional[bool] = None,
    names: Optional[dict[str, str]] = None, old_logps: Optional[torch.Tensor] = None,
) -> KLTerm:
    """The KL term of one batch, as the placement says. `token_kl`, then the reduction:

    - the KL in the loss: K = the reduction of S'_i = sum_t m k' (kl_reduction's, length normalisation's, else
      `loss_type`'s; `context` carries dr_grpo's max_completion_length and dapo/cispo/vespo's token normaliser),
      with autograd; `raw` the same of S_i by `loss_type`'s reduction. A graph is recorded only where the term carries
      gradient: by default where it replaces the trainer's own (`config.is_stock_kl` is False); `with_grad` decides.
    - the KL in the reward (`config.kl_in_reward`): KL_i = `kl_reduction`'s per-completion form of S'_i
      (sequence_sum, also what 'loss_type' means there: S'_i; sequence_mean: S'_i / max(L_i, 1)), without gradient.
    """
    in_reward = config.kl_in_reward
    if in_reward:
        with_grad = False
    elif with_grad is None:
        with_grad = not config.is_stock_kl
    with contextlib.nullcontext() if with_grad else torch.no_grad():
        stage = token_kl(logps, ref_logps, mask, config, per_token_kl=per_token_kl, names=names, old_logps=old_logps)
        lengths = stage.valid.sum(-1, dtype=stage.kl.dtype)  # float: a bf16 sum is exact only up to 256
        sums = stage.kl.sum(-1)
        adapted_sums = sums if stage.shaped is stage.kl else stage.shaped.sum(-1)
        at_threshold = clipped_tokens(stage.kl.detach(), config, lengths)
        if in_reward:
            per_completion = reward_reduction(config).per_completion
            raw = per_completion(sums, lengths)
            adapted = raw if adapted_sums is sums else per_completion(adapted_sums, lengths)
            return KLTerm(raw, adapted, sums, lengths, at_threshold, stage.check)
        ctx = context_in_float32(context)
        raw_reduction, adapted_reduction = loss_type_reduction(loss_type), kl_reduction(config, loss_type)
        adapted = reduce_sums(adapted_reduction, adapted_sums, lengths, ctx)
        if adapted_sums is sums and adapted_reduction == raw_reduction:  # nothing adapted: the same number
            raw = adapted.detach()
        else:
            raw = reduce_sums(raw_reduction, sums.detach(), lengths, ctx)
        return KLTerm(raw, adapted, sums.detach(), lengths, at_threshold, stage.check)


def neutral_where_empty(penalty: torch.Tensor, lengths: torch.Tensor, group_size: int) -> torch.Tensor:
    """The penalties beta_t * KL_i of a generation batch (groups of `group_size` consecutive completions), where a
    completion with no valid token (`lengths` 0: a trainer that masks truncated completions out, or a loop that masks
    one) carries the mean penalty of its group's completions that have tokens (0 where none has; an unscored
    completion, which a trainer leaves out of the group's baseline, is passed with length 0).

    Its KL is unknown (its mask is zeroed before the reference forward), while its reward still enters the group's
    statistics: penalised 0, it would lower every trained completion's advantage by its share of their mean penalty,
    a push towards truncation. At the group's mean it moves no other completion's advantage by its penalty."""
    groups, has_tokens = penalty.view(-1, group_size), (lengths > 0).view(-1, group_size).to(penalty.device)
    mean = (groups * has_tokens).sum(1, keepdim=True) / has_tokens.sum(1, keepdim=True).clamp(min=1)
    return torch.where(has_tokens, groups, mean).view(-1)
