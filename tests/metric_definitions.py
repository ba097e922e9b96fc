"""The `adaptive_kl/*` metrics as docs/metrics.md defines them, written out independently of the core (plain torch
on a (B, T) per-token KL), for the per-integration tests that check each logged value on a captured batch."""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch

Reduce = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (S_i, L_i) -> the reduced KL

# The loss reductions, from (S_i, L_i), B completions (docs/methods.md#notation).
REDUCE: dict[str, Reduce] = {
    "grpo": lambda s, lengths: (s / lengths.clamp(min=1)).mean(),
    "bnpo": lambda s, lengths: s.sum() / lengths.sum(),
    "luspo": lambda s, lengths: s.mean(),
    "length_normalized": lambda s, lengths: (s / lengths.clamp(min=1)).mean(),
    "sequence_sum": lambda s, lengths: s.mean(),  # the reward placement: mean over completions of KL_i = S_i
}


def shaped(k: torch.Tensor, method: str, *, clip: float = 0.1, target: float = 0.1) -> torch.Tensor:
    """min(k, kl_clip_threshold) or sigmoid(k - kl_target) * k, per token; k itself otherwise."""
    methods = method.split("+")
    if "clip" in methods:
        return torch.minimum(k, torch.full_like(k, clip))
    if "sigmoid" in methods:
        return torch.sigmoid(k - target) * k
    return k


def by_definition(k: torch.Tensor, mask: torch.Tensor, *, method: str, raw: Reduce, adapted: Reduce, beta: float,
                  clip: float = 0.1, target: float = 0.1, penalty: bool = False) -> dict[str, float]:
    """Every `adaptive_kl/*` value of one batch: raw_kl = raw(S_i, L_i); adapted_kl = adapted(S'_i, L_i) with S' the
    shaped KL's sums; current_beta; sequence_kl = mean S_i and length_kl_corr = Pearson(L_i, S_i) (NaN if constant)
    over the completions with L_i > 0; clip_fraction = #{valid k >= clip} / sum L_i (`clip` only); reward_penalty =
    beta * adapted_kl (`penalty`)."""
    k, mask = k.double(), mask.double()
    lengths = mask.sum(-1)
    sums = (k * mask).sum(-1)
    shaped_sums = (shaped(k, method, clip=clip, target=target) * mask).sum(-1)
    trained = lengths > 0
    pair = torch.stack([lengths[trained], sums[trained]])
    corr = (torch.corrcoef(pair)[0, 1].item()
            if trained.sum() > 1 and pair[0].std() > 0 and pair[1].std() > 0 else math.nan)
    metrics = {"raw_kl": raw(sums, lengths).item(), "adapted_kl": adapted(shaped_sums, lengths).item(),
               "current_beta": beta, "sequence_kl": sums[trained].mean().item(), "length_kl_corr": corr}
    if "clip" in method.split("+"):
        metrics["clip_fraction"] = ((k >= clip) & (mask > 0)).sum().item() / lengths.sum().item()
    if penalty:
        metrics["reward_penalty"] = beta * metrics["adapted_kl"]
    return {"adaptive_kl/" + name: value for name, value in metrics.items()}


def assert_metrics_match(logged: dict[str, float], expected: dict[str, float], *, rel: float,
                         abs_: float = 1e-9, only: Optional[set[str]] = None) -> None:
    """The logged adaptive_kl/* keys are exactly the expected ones (or `only`), each within rel/abs."""
    logged = {key: value for key, value in logged.items() if key.startswith("adaptive_kl/")}
    assert set(logged) == (only or set(expected)), (sorted(logged), sorted(expected))
    for key in logged:
        want, got = expected[key], logged[key]
        if math.isnan(want):
            assert math.isnan(got), key
        else:
            assert abs(got - want) <= max(rel * abs(want), abs_), (key, got, want)
