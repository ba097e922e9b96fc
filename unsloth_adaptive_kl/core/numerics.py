"""Numerics shared by the core (pure torch, traceable): the float32 compute dtype, masked positions set to 0 before
any estimator sees them, and the check for non-finite log-probs on valid tokens.

- `in_float32(x)`: x in float32 whatever its dtype (bf16 and fp16 upcast, float64 rounded); float32 is not copied.
- `keep_valid(x, mask) = torch.where(mask != 0, in_float32(x), 0)`: masked positions may hold anything (NaN, +-inf, huge
  gaps) and give the value 0 with a gradient of exactly 0 (where's backward selects, it does not multiply); a NaN or
  inf on a valid position stays, so the sums it enters are non-finite and the check below reports it. A product
  `m * x` would not do: its value is NaN for a non-finite x on a masked position, and its backward multiplies the
  estimator's derivative there (exp(NaN), exp(huge)) by 0, which is NaN.
- `masked_reference(ref, logp, mask)`: where a trainer computes the KL itself, the reference it is handed, with each
  masked position holding the policy's own (detached) log-prob, so the trainer's KL there is 0 with a finite gradient.
- A non-finite log-prob on a valid token must raise, naming the tensor and how many tokens, without a host transfer
  per micro-batch: `LogpCheck` carries the sum over valid tokens of each tensor (the policy's, the reference's, and
  where a door holds them the old policy's, which a trainer's importance ratio divides by) (non-finite exactly when
  one of its terms is, or the sum overflows), which rides in the statistics `AdaptiveKL` transfers once per optimizer
  step; the tokens are counted only on that (error) path.
- Log-probs averaging above `LOGP_MEAN_CEILING` over the valid tokens are negative log-likelihoods passed by mistake:
  `positive_logps` finds them from the same sums and the token count, so every door refuses them where it checks
  for non-finite ones (`positive_logps_error`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from collections.abc import Mapping, Sequence
from typing import Optional

import torch

from .errors import NonFiniteLogProbError

KINDS = ("policy", "reference", "old policy")  # the tensors a `LogpCheck` checks, in its order


def in_float32(x: torch.Tensor) -> torch.Tensor:
    """`x` in float32, whatever its dtype: the one compute dtype of the core, so a term is the same float32 figure at
    every door (a float64 own loop included). Autograd carries the gradient back in the given dtype. No branch on the
    dtype, so torch.fx can trace it (a custom loss traced by torch.fx, where a tensor is a Proxy without a dtype):
    `.to(torch.float32)` of a float32 tensor is the tensor itself (no copy)."""
    return x.to(torch.float32)


def valid_positions(mask: torch.Tensor) -> torch.Tensor:
    """The mask as bool (a nonzero entry marks a valid token; a bool mask is returned as it is)."""
    return mask.bool()


def keep_valid(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`torch.where(mask != 0, in_float32(x), 0)`: x on valid positions (a NaN or inf there stays), 0 with a zero
    gradient on masked ones, whatever they hold; float32 whatever x's dtype. A bool `mask` is used as it is
    (`.bool()` returns it): a caller masking several tensors converts the mask once (`valid_positions`)."""
    return torch.where(mask.bool(), in_float32(x), 0.0)


def masked_reference(ref_logps: torch.Tensor, policy_logps: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The reference log-probs to hand a trainer's own KL line: valid positions keep theirs exactly, masked ones take
    the policy's (detached), so the trainer's KL there is 0 with a finite gradient whatever the padding held (NaN,
    -inf, or a gap so large that 0 * inf = NaN in the backward)."""
    return torch.where(valid_positions(mask), ref_logps, policy_logps.detach())


def masked_logps(logp: torch.Tensor, ref: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(keep_valid(logp, mask), keep_valid(ref, mask)), the mask converted once. Gradients reach the given `logp` (and
    `ref`, where it requires one) on valid positions only."""
    valid = valid_positions(mask)
    return keep_valid(logp, valid), keep_valid(ref, valid)


@dataclass
class LogpCheck:
    """Whether the policy, reference or old policy log-probs hold a non-finite value on a valid token, as device
    tensors.

    sums: (3,) float32, the sum over valid tokens of the policy, the reference and the old policy log-probs (masked
        positions are 0; the old policy's 0 where the door holds none): non-finite when a valid value is. It rides in
        `AdaptiveKL`'s statistics (no extra transfer).
    tensors: the masked tensors (detached; None for an old policy not given), kept only to count the non-finite
        tokens once a sum says so.
    names: what the error calls each (an integration names where its log-probs came from)."""

    sums: torch.Tensor
    tensors: tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]
    names: tuple[str, str, str] = ("policy log-probs", "reference log-probs", "old policy log-probs")

    @classmethod
    def of_masked(cls, logp: torch.Tensor, ref: torch.Tensor, old: Optional[torch.Tensor] = None,
                  names: Optional[Mapping[str, str]] = None) -> "LogpCheck":
        """From tensors whose masked positions are already 0 (`masked_logps`). names: what the error calls each
        tensor, keyed by its kind (`KINDS`); a kind not named keeps its default name."""
        names = names or {}
        if not set(names) <= set(KINDS):
            raise KeyError(f"LogpCheck names {sorted(set(names) - set(KINDS))}: the kinds are {KINDS}")
        logp, ref = logp.detach(), ref.detach()
        old = None if old is None else old.detach()
        labels = tuple(names.get(kind, default) for kind, default in zip(KINDS, cls.names))
        old_sum = logp.new_zeros(()) if old is None else old.sum()
        return cls(sums=torch.stack([logp.sum(), ref.sum(), old_sum.to(logp.dtype)]).float(),
                   tensors=(logp, ref, old), names=labels)  # type: ignore[arg-type]

    @classmethod
    def of(cls, logp: torch.Tensor, ref: torch.Tensor, mask: torch.Tensor,
           names: Optional[Mapping[str, str]] = None) -> "LogpCheck":
        """From raw log-probs and the mask (masked positions may hold anything)."""
        with torch.no_grad():
            logp, ref = masked_logps(logp, ref, valid_positions(mask))
        return cls.of_masked(logp, ref, None, names)

    def counts(self) -> tuple[int, ...]:
        """How many valid tokens of each tensor are non-finite (one host transfer; the error path only)."""
        return tuple(0 if tensor is None else int((~torch.isfinite(tensor)).sum()) for tensor in self.tensors)


@dataclass(frozen=True)
class NonFinite:
    """One tensor with a NaN or +-inf on valid tokens, as the error names it.

    name: what the error calls the tensor (where it came from); kind: one of `KINDS`.
    process: the process that saw it (None where that is not known: a remote service, workers counted together).
    tokens: how many valid tokens (None where only its sum over them is known here: the count is the other
        process's, or the service's)."""

    name: str
    kind: str
    process: Optional[int] = None
    tokens: Optional[int] = None

    def __str__(self) -> str:
        if self.tokens is not None:
            seen = f"{self.tokens} valid token(s)" + ("" if self.process is None else f" on process {self.process}")
        elif self.process is not None:
            seen = f"non-finite on process {self.process} (its sum over the valid tokens: that process counts them)"
        else:
            seen = "non-finite (its sum over the valid tokens)"
        if self.name.startswith(self.kind):  # "policy log-probs": the name says which it is
            what = self.name
        elif self.name.endswith(")"):  # "loss_fn_inputs['logprobs'] (the sampler's)": one parenthesis
            what = f"{self.name[:-1]}; the {self.kind} tensor)"
        else:
            what = f"{self.name} (the {self.kind} tensor)"
        return f"{what}: {seen}"


NONFINITE_ADVICE = "check the model's forward in this precision, and the log-probs handed over by the generation engine"


def nonfinite_error(step: int, found: Sequence[NonFinite], advice: str = NONFINITE_ADVICE) -> NonFiniteLogProbError:
    """The one `NonFiniteLogProbError` every door raises: the step, each tensor found non-finite on valid tokens
    (`NonFinite`: its name, the process that saw it and how many tokens, where known), and `advice`."""
    return NonFiniteLogProbError(
        f"adaptive KL: non-finite input at step {step}: NaN or +-inf on valid (mask=1) tokens in the "
        + "; ".join(map(str, found)) + ". Masked positions may hold anything; a valid token's log-prob must be finite "
        f"in float32, the precision the KL is computed in (a float64 beyond 3.4e38 in magnitude is not) ({advice}).")


# A log-prob is log p <= 0, and computed in any precision it stays so (log_softmax, and x - logsumexp(x), round to at
# most 0 in bf16, fp16 and float32: logsumexp rounds to no less than the largest logit, which is representable).
# Negative log-likelihoods passed by mistake (-log p: F.cross_entropy(..., reduction="none") returns them) average the
# sampled tokens' surprise over the valid tokens, which a model still learning holds far above this.
LOGP_MEAN_CEILING = 0.01


def positive_logps(sums: Sequence[float], tokens: float, names: Sequence[str]) -> list[tuple[str, float]]:
    """(name, mean) of each tensor whose valid log-probs average above `LOGP_MEAN_CEILING` per token: `sums` their
    sums over the `tokens` valid tokens (a `LogpCheck`'s, in `KINDS` order; an old policy's 0 where a door holds
    none). From sums a door holds already: no device operation."""
    if not tokens > 0:
        return []
    return [(name, total / tokens) for name, total in zip(names, sums) if total > LOGP_MEAN_CEILING * tokens]


def positive_logps_error(step: int, found: Sequence[tuple[str, float]], tokens: float) -> ValueError:
    """The ValueError every door raises where `positive_logps` found a tensor: the step, each tensor with its mean per
    valid token, and the likely cause."""
    means = "; ".join(f"{name} average {mean:+.4g} a token" for name, mean in found)
    return ValueError(
        f"adaptive KL: log-probs above 0 at step {step}: over its {tokens:g} valid (mask=1) tokens: {means}. "
        f"A log-prob is log p <= 0, so its mean cannot exceed {LOGP_MEAN_CEILING} (rounding in any precision stays "
        "below that); these look like negative log-likelihoods (-log p, what F.cross_entropy(..., reduction='none') "
        "returns): pass their negation.")


def this_process() -> int:
    """This process's rank among those a gather spans (torch.distributed's, which accelerate's processes share; 0
    without a process group)."""
    distributed = torch.distributed
    return distributed.get_rank() if distributed.is_available() and distributed.is_initialized() else 0


def found_in_check(check: LogpCheck, process: Optional[int] = None) -> list[NonFinite]:
    """The tensors of one `LogpCheck` with a non-finite sum, counted (one host transfer)."""
    sums = check.sums.tolist()
    counts = check.counts() if not all(map(math.isfinite, sums)) else (0,) * len(sums)
    return [NonFinite(name, kind, process, count)
            for name, kind, total, count in zip(check.names, KINDS, sums, counts) if not math.isfinite(total)]
