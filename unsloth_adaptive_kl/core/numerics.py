"""Numerics shared by the core (pure torch, traceable): the float32 compute dtype, masked positions set to 0 before
any estimator sees them, and the check for non-finite log-probs on valid tokens (SPEC rule 3.13).

- Half precision (bf16, fp16) is upcast to float32 before anything is computed; float32 and float64 stay as they are
  (`upcast` returns the tensor itself: no copy on the float32 path).
- Masked positions may hold anything (NaN, +-inf, huge gaps): they are replaced by 0 before an estimator runs, so
  every estimator gives 0 there with a zero (finite) gradient. A product `m * x` would not do: its value there is
  NaN for a non-finite x, and its backward multiplies the estimator's derivative there (exp(NaN), exp(huge)) by 0,
  which is NaN. The replacement is `keep_valid`: a bitwise AND of the float's bits with all-ones (valid) or zeros
  (masked), the exact semantics of `torch.where(valid, x, 0)` (a NaN on a valid position stays NaN) at the cost of a
  multiply: on a CPU `torch.where` with a bool mask costs 3x that (0.31 against 0.10 ms at 64 x 4096, measured),
  and 2x forward + backward. Below `WHERE_BELOW` elements, where a call's cost is the number of ops, not the
  bandwidth, a tensor that needs a gradient goes through `torch.where` (2 ops fewer than the autograd function), so
  does one with a bool mask (one op, against three to build the mask's bits: 8 against 33 us at 8 x 1024 inside a
  trainer's loss, measured), and so does a graph that torch.compile traces (`kl_compile`), which fuses it into its
  loop.
- A non-finite log-prob on a valid token must raise, naming the tensor and how many tokens, without a host transfer
  per micro-batch: `LogpCheck` carries the sum over valid tokens of each tensor (non-finite exactly when one of its
  terms is, or the sum overflows), which rides in the statistics row that `AdaptiveKL` transfers once per optimizer
  step; the tokens are counted only on that (error) path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import weakref

import torch
import torch.fx

HALF_PRECISION = (torch.float16, torch.bfloat16)


def upcast(x: torch.Tensor) -> torch.Tensor:
    """float32 for half-precision input (bf16, fp16), else `x` itself (float32 and float64 are not copied).
    Autograd carries the gradient back to the half-precision tensor. No branch on the dtype, so torch.fx can trace
    it (a custom loss traced by torch.fx): `.to` of the promoted dtype is the tensor itself where nothing changes."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def valid_positions(mask: torch.Tensor) -> torch.Tensor:
    """The mask as bool (a nonzero entry marks a valid token; a bool mask is returned as it is)."""
    return mask.bool()


# The integer type of each float type's width: its bits are ANDed with the valid positions' all-ones.
_BITS = {torch.float32: torch.int32, torch.float64: torch.int64, torch.float16: torch.int16, torch.bfloat16: torch.int16}
WHERE_BELOW = 1 << 14  # elements: below, a tensor that needs a gradient is masked by `torch.where` (fewer ops)


# The last mask's bits: a micro-batch masks its log-probs (the check, an estimator) and its KL with the same mask.
_last_bits: list = [None]  # (weakref to the mask, its version, the bits)


def valid_bits(mask: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """All-ones bits on valid positions (mask != 0), zeros on masked ones, in the integer type of `dtype`'s width.
    Eagerly, the bits of the last mask seen are reused while that very tensor is unchanged (same object, same version
    counter): the check, the estimator and the KL of one micro-batch convert its mask once."""
    int_dtype = _BITS[dtype]
    if torch.compiler.is_compiling() or mask.is_inference():
        return valid_positions(mask).to(int_dtype).neg_()
    entry = _last_bits[0]
    if entry is not None and entry[0]() is mask and entry[1] == mask._version and entry[2].dtype == int_dtype:
        return entry[2]
    bits = valid_positions(mask).to(int_dtype).neg_()
    _last_bits[0] = (weakref.ref(mask), mask._version, bits)
    return bits


def _and_bits(x: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    return torch.bitwise_and(x.view(bits.dtype), bits).view(x.dtype)


class _KeepValid(torch.autograd.Function):
    """x on valid positions, 0 on masked ones; the gradient likewise (exactly 0 on masked positions)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(bits)
        return _and_bits(x, bits)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        (bits,) = ctx.saved_tensors
        return _and_bits(grad.contiguous(), bits), None


def keep_valid(x: torch.Tensor, mask: torch.Tensor, bits: Optional[torch.Tensor] = None) -> torch.Tensor:
    """`torch.where(mask != 0, upcast(x), 0)`, exactly (a NaN or inf on a valid position stays; whatever a masked
    position holds becomes 0, with a zero gradient), by a bitwise AND: see the module's docstring. bits: `valid_bits`
    of the mask for x's (upcast) dtype, where the caller masks several tensors."""
    if isinstance(x, torch.fx.Proxy):  # torch.fx symbolic tracing (a traced custom loss): no dtype, no requires_grad
        return torch.where(valid_positions(mask), upcast(x), 0.0)
    if x.dtype in HALF_PRECISION:
        x = x.float()
    if torch.compiler.is_compiling():  # a compiled graph fuses torch.where into its loop (no bits to build)
        return torch.where(valid_positions(mask), x, 0.0)
    needs_grad = x.requires_grad and torch.is_grad_enabled()
    if x.numel() < WHERE_BELOW and (needs_grad or mask.dtype == torch.bool):
        return torch.where(valid_positions(mask), x, 0.0)
    if needs_grad:
        return _KeepValid.apply(x, valid_bits(mask, x.dtype) if bits is None or bits.dtype != _BITS[x.dtype] else bits)
    return _and_bits(x, valid_bits(mask, x.dtype) if bits is None or bits.dtype != _BITS[x.dtype] else bits)


def masked_logps(
    logp: torch.Tensor, ref: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """(logp, ref) upcast to float32 (half precision) with every masked position set to 0, and the mask's `valid_bits`.
    Gradients reach the given `logp` (and `ref`, where it requires one) on valid positions only."""
    bits = (None if isinstance(logp, torch.fx.Proxy) or torch.compiler.is_compiling()
            else valid_bits(mask, torch.promote_types(logp.dtype, torch.float32)))
    return keep_valid(logp, mask, bits), keep_valid(ref, mask, bits), bits


@dataclass
class LogpCheck:
    """Whether the policy or reference log-probs hold a non-finite value on a valid token, as device tensors.

    sums: (2,) float32, the sum over valid tokens of the policy and of the reference log-probs (masked positions
        are 0): non-finite when a valid value is. It rides in `AdaptiveKL`'s statistics row (no extra transfer).
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
            logp, ref, _ = masked_logps(logp, ref, mask)
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
