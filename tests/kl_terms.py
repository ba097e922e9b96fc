"""The core's one KL pipeline (`adaptation.kl_term`) on a per-token KL a test computed, as a trainer hands its own:
the tests of shaping, reductions and numerics feed it k directly."""

from __future__ import annotations

import torch

from unsloth_adaptive_kl.core.adaptation import KLTerm, kl_term
from unsloth_adaptive_kl.core.reductions import ReductionContext


def adapted_kl_term(kl: torch.Tensor, mask: torch.Tensor, config, loss_type: str, ctx: ReductionContext) -> KLTerm:
    """The KL term of the per-token KL `kl` (with autograd), the log-probs it came from being 0 (a finite check)."""
    zeros = torch.zeros_like(kl)
    return kl_term(zeros, zeros, mask, config, loss_type=loss_type, context=ctx, per_token_kl=kl, with_grad=True)
