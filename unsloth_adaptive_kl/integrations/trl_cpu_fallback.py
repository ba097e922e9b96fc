"""A pure-torch stand-in for trl 1.15's Triton `ChunkedLogProbFunction` on CPU tensors.

trl 1.15's fused LM head calls `trl.trainer.utils._ChunkedLogProbFunction.apply` for every forward. Without
Triton that name is `None` (`'NoneType' object has no attribute 'apply'`); with Triton but no GPU the kernel
fails (`0 active drivers`). trl 1.16 added its own CPU path, so `integrations/trl.py` installs this only on
older trl. GPU tensors still go to the upstream kernel.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

OPTIONAL_OUTPUTS = ("entropy", "log_sum_sq_probs", "mean_logits", "is_top1")


def chunked_logprob_torch(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    targets: torch.Tensor,
    temperature: float,
    chunk_size: int,
    final_logit_softcapping: Optional[float] = None,
    logit_scale: float = 1.0,
    outputs: tuple[str, ...] = OPTIONAL_OUTPUTS,
) -> tuple[Optional[torch.Tensor], ...]:
    """Same outputs as the kernel: z = softcap * tanh(logit_scale * (h W^T + b) / softcap) / temperature,
    log p(target), and when requested the entropy, log(sum_v p_v^2), mean z and whether the target is the
    first argmax. Materialises the [N, V] logits, which is fine for the CPU models this path serves; `chunk_size`, the
    kernel's own argument, is taken and not needed."""
    z = torch.nn.functional.linear(hidden, weight, bias).float() * logit_scale
    if final_logit_softcapping is not None:
        z = final_logit_softcapping * torch.tanh(z / final_logit_softcapping)
    z = z / temperature
    log_p = torch.log_softmax(z, dim=-1)
    logprobs = log_p.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(log_p.exp() * log_p).sum(-1) if "entropy" in outputs else None
    with torch.no_grad():
        log_sum_sq = torch.logsumexp(2 * log_p, dim=-1) if "log_sum_sq_probs" in outputs else None
        mean_logits = z.mean(-1) if "mean_logits" in outputs else None
        is_top1 = z.argmax(-1) == targets if "is_top1" in outputs else None
    return logprobs, entropy, log_sum_sq, mean_logits, is_top1


class ChunkedLogProbWithCPUFallback:
    """Drop-in for `trl.trainer.utils._ChunkedLogProbFunction`: CPU tensors take `chunked_logprob_torch`,
    accelerator tensors the upstream kernel (`upstream`, None when Triton is absent)."""

    upstream: Any = None

    @classmethod
    def apply(cls, hidden: torch.Tensor, *args: Any) -> tuple[Optional[torch.Tensor], ...]:
        if cls.upstream is not None and hidden.device.type != "cpu":
            return cls.upstream.apply(hidden, *args)
        return chunked_logprob_torch(hidden, *args)
