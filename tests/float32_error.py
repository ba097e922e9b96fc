"""Comparing the core's float32 result with the exact value of the same float32 inputs (computed in float64, whose
own rounding, 2^-53, is far below the bound), within the bound the arithmetic gives (`float32_chain_tolerance`); and
the bounds only the tests use beside the self-check's in core/tolerance.py: two log-softmax paths, k1's parts."""

from __future__ import annotations

import torch

from unsloth_adaptive_kl.core.tolerance import EPS32, float32_chain_tolerance


def assert_float32_close(got: torch.Tensor | float, want: torch.Tensor | float, magnitude: torch.Tensor | float,
                         operations: int) -> None:
    """|got - want| <= float32_chain_tolerance(operations, magnitude), elementwise."""
    got, want = torch.as_tensor(got, dtype=torch.float64), torch.as_tensor(want, dtype=torch.float64)
    bound = torch.as_tensor(float32_chain_tolerance(operations, torch.as_tensor(magnitude, dtype=torch.float64)))
    error = (got - want).abs()
    assert bool((error <= bound).all()), f"float32 error {error.tolist()} exceeds the bound {bound.tolist()}"


# The logits' bound the tests take two_path_logp_tolerance at; their plain forward (test_trl_loss.policy_logps)
# asserts it (the tiny model's largest |logit| is below 1).
MAX_LOGIT = 20.0


def two_path_logp_tolerance(max_logit: float, vocabulary: int) -> float:
    """Bound on |log p| differences between two float32 log-softmax implementations (a fused, chunked one and a
    plain one): each rounds log-sum-exp over `vocabulary` terms of size <= e^max_logit relative to the max, an
    absolute error of at most (vocabulary * EPS32) plus EPS32 * |max_logit| for the subtraction."""
    return EPS32 * (vocabulary + abs(max_logit))


def k1_magnitude(logp: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Per token, the parts of k1 = logp - ref: |logp| + |ref|, in float64."""
    return logp.detach().double().abs() + ref.detach().double().abs()
