"""Numerics shared by the core (pure torch, traceable): the float32 compute dtype, masked positions set to 0 before
any estimator sees them, and the check for non-finite log-probs on valid tokens.

- `upcast(x)`: x in float32 for half precision (bf16, fp16); float32 and float64 are returned as they are (no copy).
- `keep_valid(x, mask) = torch.where(mask != 0, upcast(x), 0)`: masked positions may hold anything (NaN, +-inf, huge
  gaps) and give the value 0 with a gradient of exactly 0 (where's backward selects, it does not multiply); a NaN or
  inf on a valid position stays, so the sums it enters are non-finite and the check below reports it. A product
  `m * x` would not do: its value is NaN for a non-finite x on a masked position, and its backward multiplies the
  estimator's derivative there (exp(NaN), exp(huge)) by 0, which is NaN.
- A non-finite log-prob on a valid token must raise, naming the tensor and how many tokens, without a host transfer
  per micro-batch: `LogpCheck` carries the sum over valid tokens of each tensor (non-finite exactly when one of its
  terms is, or the sum overflows), which rides in the statistics `AdaptiveKL` transfers once per optimizer step; the
  tokens are counted only on that (error) path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

HALF_PRECISION = (torch.float16, torch.bfloat16)


def upcast(x: torch.Tensor) -> torch.Tensor:
    """float32 for half-precision input (bf16, fp16), else `x` itself (float32 and float64 are not copied).
    Autograd carries the gradient back to the half-precision tensor. No branch on the dtype, so torch.fx can trace
    it (a custom loss traced by torch.fx, where a tensor is a Proxy without a dtype): `.to` of the promoted
    dtype is the tensor itself where nothing changes."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def valid_positions(mask: torch.Tensor) -> torch.Tensor:
    """The mask as bool (a nonzero entry marks a valid token; a bool mask is returned as it is)."""
    return mask.bool()


def keep_valid(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`torch.where(mask != 0, upcast(x), 0)`: x on valid positions (a NaN or inf there stays), 0 with a zero gradient
    on masked ones, whatever they hold; float32 for half-precision x. A bool `mask` is used as it is: a caller masking
    several tensors converts the mask once (`valid_positions`)."""
    return torch.where(valid_positions(mask), upcast(x), 0.0)


def masked_logps(logp: torch.Tensor, ref: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(keep_valid(logp, mask), keep_valid(ref, mask)), the mask converted once. Gradients reach the given `logp` (and
    `ref`, where it requires one) on valid positions only."""
    valid = valid_positions(mask)
    return keep_valid(logp, valid), keep_valid(ref, valid)


@dataclass
class LogpCheck:
    """Whether the policy or reference log-probs hold a non-finite value on a valid token, as device tensors.

    sums: (2,) float32, the sum over valid tokens of the policy and of the reference log-probs (masked positions
        are 0): non-finite when a valid value is. It rides in `AdaptiveKL`'s statistics (no extra transfer).
    tensors: the two masked tensors (detached), kept only to count the non-finite tokens once a sum says so.
    names: what the error calls each (an integration names where its policy log-probs came from)."""

    sums: torch.Tensor
    tensors: tuple[torch.Tensor, torch.Tensor]
    names: tuple[str, str] = ("policy log-probs", "reference log-probs")

    @classmethod
    def of_masked(cls, logp: torch.Tensor, ref: torch.Tensor, **names: str) -> "LogpCheck":
        """From tensors whose masked positions are already 0 (`masked_logps`). names: policy=, reference=."""
        logp, ref = logp.detach(), ref.detach()
        labels = (names.get("policy", cls.names[0]), names.get("reference", cls.names[1]))
        return cls(sums=torch.stack([logp.sum(), ref.sum()]).float(), tensors=(logp, ref), names=labels)

    @classmethod
    def of(cls, logp: torch.Tensor, ref: torch.Tensor, mask: torch.Tensor, **names: str) -> "LogpCheck":
        """From raw log-probs and the mask (masked positions may hold anything)."""
        with torch.no_grad():
            logp, ref = masked_logps(logp, ref, mask)
        return cls.of_masked(logp, ref, **names)

    def counts(self) -> tuple[int, int]:
        """How many valid tokens of each tensor are non-finite (one host transfer; the error path only)."""
        return tuple(int((~torch.isfinite(tensor)).sum()) for tensor in self.tensors)  # type: ignore[return-value]


def nonfinite_message(step: int, flags: list[tuple[int, int, int]], checks: list[Optional[LogpCheck]]) -> str:
    """The error for non-finite log-probs. flags: (micro-batch, process, which tensor) of every non-finite sum in the
    gathered rows; checks: this process's `LogpCheck` of each micro-batch (None where none was recorded)."""
    parts = []
    names = next((check.names for check in checks if check is not None), LogpCheck.names)
    for index, name in enumerate(names):
        hits = [(batch, process) for batch, process, which in flags if which == index]
        if not hits:
            continue
        local = sum(checks[batch].counts()[index] for batch in sorted({b for b, _ in hits})
                    if batch < len(checks) and checks[batch] is not None)
        processes = sorted({process for _, process in hits})
        where = f" on this process (processes with non-finite values: {processes})" if processes != [0] else ""
        parts.append(f"{name} (the {'policy' if index == 0 else 'reference'} tensor): {local} valid token(s)"
                     f"{where}")
    return (f"adaptive KL: non-finite input at step {step}: NaN or +-inf on valid (mask=1) tokens in the "
            + "; ".join(parts) + ". Masked positions may hold anything; a valid token's log-prob must be finite "
            "(check the model's forward in this precision, and the log-probs handed over by the generation engine).")
