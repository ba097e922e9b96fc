"""The decisions TRL's and Unsloth's GRPO losses have in common, written once for both.

`trl._compute_loss` and `unsloth._AdaptiveEfficientGRPO.apply` only translate: each reads, where its trainer keeps
them, the per-token KL the trainer computed itself (taken at its KL line), the policy and raw reference log-probs, the
mask, the loss type and the trainer's normaliser numbers, and hands them to `adapted_loss`, which decides per
micro-batch:

- which per-token KL the methods adapt: the trainer's own for the stock k3 estimator (bit for bit what the installed
  version computes), else the configured estimator's, of the raw log-probs;
- the `ReductionContext`: the trainer's normalisers translated to the core's (`LossNormalisers`);
- the term (`trainer.adaptive_kl.term`, the core's one pipeline, which also checks the log-probs: a non-finite one
  on a valid token raises at the step's end) and the loss: plus beta_t * adapted / gradient accumulation where the adapted
  term replaces the trainer's own, the trainer's loss untouched where it is stock.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch

from ..core.adaptation import KLTerm
from ..core.adaptive_kl import AdaptiveKL
from ..core.reductions import ReductionContext


@dataclass(frozen=True)
class LossNormalisers:
    """The numbers a trainer's GRPO loss divides by, as the trainer holds them.

    max_completion_length: dr_grpo's constant per-completion length.
    num_items_in_batch: the active tokens of the generation batch over all processes (None where the trainer passes
        none).
    num_processes: the processes sharing that batch.
    steps_per_generation: the optimizer steps one generation batch is split over, where the trainer divides by it
        (None where it does not, e.g. TRL in evaluation).
    gradient_accumulation: the micro-batches of one optimizer step (1 in evaluation).
    """

    max_completion_length: Optional[int]
    num_items_in_batch: Union[torch.Tensor, float, None]
    num_processes: int
    steps_per_generation: Optional[int]
    gradient_accumulation: int

    def reduction_context(self) -> ReductionContext:
        """dapo/cispo/vespo divide each micro-batch's token sum by num_items_in_batch / num_processes * GA /
        steps_per_generation (at least 1 token); the GA factor is applied with beta_t (`adapted_loss`), so the
        core's token normaliser is the rest."""
        items = self.num_items_in_batch
        token_normalizer = None
        if items is not None:
            token_normalizer = (items.clamp(min=1.0) if torch.is_tensor(items) else max(float(items), 1.0))
            token_normalizer = token_normalizer / self.num_processes
            if self.steps_per_generation:
                token_normalizer = token_normalizer / self.steps_per_generation
        return ReductionContext(max_completion_length=self.max_completion_length, token_normalizer=token_normalizer)


def adapted_loss(
    adaptive_kl: AdaptiveKL,
    loss: torch.Tensor,
    trainer_kl: torch.Tensor,
    policy_logps: torch.Tensor,
    ref_logps: torch.Tensor,
    mask: torch.Tensor,
    normalisers: LossNormalisers,
    loss_type: Optional[str] = None,
    old_logps: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, KLTerm]:
    """(the loss with the adapted KL, the micro-batch's KL term for `record_metrics`).

    loss: the trainer's loss, with its own KL term where the setting is stock and without one otherwise.
    trainer_kl: the per-token KL the trainer computed. policy_logps, ref_logps: the log-probs as the trainer holds them
    (the raw reference, not `masked_reference`'s). loss_type: the reduction in effect (None: `adaptive_kl.loss_type`).
    old_logps: the old policy's log-probs where the trainer holds them (None on-policy), checked with the others: a
    NaN there on a valid token would make the trainer's importance ratio, and its loss, NaN.
    """
    config = adaptive_kl.config
    term = adaptive_kl.term(policy_logps, ref_logps, mask, ctx=normalisers.reduction_context(), loss_type=loss_type,
                            per_token_kl=trainer_kl if config.reads_trainer_kl else None, old_logps=old_logps)
    if not config.is_stock_kl:
        loss = loss + term.adapted * (adaptive_kl.current_beta / normalisers.gradient_accumulation)  # one autograd node
    return loss, term
