"""Float tolerances derived from the arithmetic (float32, the number of terms), not from the machine a comparison
was first run on: two CPUs may sum the same float32 terms in different orders (vector widths differ) and so round
differently."""

from __future__ import annotations

EPS32 = 2.0**-23  # float32 machine epsilon, torch.finfo(torch.float32).eps


def reordered_sum_tolerance(terms: int, magnitude: float) -> float:
    """Bound on the difference of two float32 sums of the same `terms` values taken in different orders: each is
    within (terms - 1) * EPS32 / 2 * sum|x| of the exact sum (Higham, Accuracy and Stability of Numerical
    Algorithms, 4.2), so they differ by at most terms * EPS32 * magnitude, where magnitude >= sum|x|."""
    return terms * EPS32 * magnitude


def two_path_logp_tolerance(max_logit: float, vocabulary: int) -> float:
    """Bound on |log p| differences between two float32 log-softmax implementations (a fused, chunked one and a
    plain one): each rounds log-sum-exp over `vocabulary` terms of size <= e^max_logit relative to the max, an
    absolute error of at most (vocabulary * EPS32) plus EPS32 * |max_logit| for the subtraction."""
    return EPS32 * (vocabulary + abs(max_logit))
