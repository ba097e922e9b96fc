"""Float tolerances derived from the arithmetic (float32, the number of terms), not from the machine a comparison
was first run on: two CPUs may sum the same float32 terms in different orders (vector widths differ) and so round
differently."""

from __future__ import annotations

import torch

EPS32 = 2.0**-23  # float32 machine epsilon, torch.finfo(torch.float32).eps


def reordered_sum_tolerance(terms: int, magnitude: float, eps: float = EPS32) -> float:
    """Bound on the difference of two float32 sums of the same `terms` values taken in different orders: each is
    within (terms - 1) * EPS32 / 2 * sum|x| of the exact sum (Higham, Accuracy and Stability of Numerical
    Algorithms, 4.2), so they differ by at most terms * EPS32 * magnitude, where magnitude >= sum|x|. `eps`: another
    precision's epsilon for sums taken in it (bf16's or fp16's, under autocast)."""
    return terms * eps * magnitude


def float32_chain_tolerance(operations: int, magnitude: torch.Tensor | float) -> torch.Tensor | float:
    """Bound on |computed - exact| for `operations` chained float32 operations on float32 inputs, to first order:
    each returns its exact result times (1 + d), |d| <= EPS32 / 2, and no intermediate exceeds `magnitude`, the same
    chain applied to the magnitudes of its parts (|a| + |b| for a +- b; see the `*_magnitude` functions). Count exp
    (and log) as two operations: a vectorised exp is accurate to 1 ulp, twice a correctly rounded operation's error."""
    return operations * EPS32 / 2 * magnitude


def k3_magnitude(logp: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Per token, the parts of k3 = exp(r) - r - 1, r = ref - logp: exp(r) (1 + |r|) + |r| + 1, in float64. exp
    also carries the rounding of r (exp(r (1 + d)) = exp(r) (1 + r d + ...)), so its part counts 1 + |r| times."""
    r = ref.detach().double() - logp.detach().double()
    return torch.exp(r) * (1 + r.abs()) + r.abs() + 1


def k3_gradient_magnitude(logp: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Per token, the parts of dk3/dlogp = 1 - exp(r): exp(r) (1 + |r|) + 1, in float64."""
    r = ref.detach().double() - logp.detach().double()
    return torch.exp(r) * (1 + r.abs()) + 1
