"""Comparing the core's float32 result with the exact value of the same float32 inputs (computed in float64, whose
own rounding, 2^-53, is far below the bound), within the bound the arithmetic gives (`float32_chain_tolerance`)."""

from __future__ import annotations

import torch

from unsloth_adaptive_kl.core.tolerance import float32_chain_tolerance


def assert_float32_close(got: torch.Tensor | float, want: torch.Tensor | float, magnitude: torch.Tensor | float,
                         operations: int) -> None:
    """|got - want| <= float32_chain_tolerance(operations, magnitude), elementwise."""
    got, want = torch.as_tensor(got, dtype=torch.float64), torch.as_tensor(want, dtype=torch.float64)
    bound = torch.as_tensor(float32_chain_tolerance(operations, torch.as_tensor(magnitude, dtype=torch.float64)))
    error = (got - want).abs()
    assert bool((error <= bound).all()), f"float32 error {error.tolist()} exceeds the bound {bound.tolist()}"
