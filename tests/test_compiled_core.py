"""The core traces as one torch.compile(fullgraph=True) graph (what a compiled trainer loss calling it needs: no graph
break, no `.item()`), and the compiled graph gives the eager core's values, diagnostics and gradients over changing
shapes, without a dynamo warning of possible silent incorrectness."""

from __future__ import annotations

import warnings

import pytest
import torch

from unsloth_adaptive_kl import AdaptiveKLConfig
from unsloth_adaptive_kl.core.adaptation import kl_term
from unsloth_adaptive_kl.core.estimators import BUILT_IN_ESTIMATORS
from unsloth_adaptive_kl.core.reductions import ReductionContext

from .kl_terms import adapted_kl_term

SETTINGS = [dict(kl_adaptation_method="clip", kl_clip_threshold=0.3), dict(kl_adaptation_method="sigmoid"),
            dict(kl_adaptation_method="length_normalized"), dict(kl_reduction="sequence_sum")]


def per_token_kl(logp: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    delta = ref - logp
    return torch.exp(delta) - delta - 1


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: "/".join(map(str, s.values())))
def test_compiled_core_equals_eager_over_changing_shapes(settings: dict) -> None:
    torch._dynamo.reset()
    config = AdaptiveKLConfig(**settings)
    compiled_term = torch.compile(adapted_kl_term, fullgraph=True)
    generator = torch.Generator().manual_seed(0)
    for batch, length in ((4, 8), (6, 11), (6, 11)):
        logp = (-torch.rand(batch, length, generator=generator) * 3).requires_grad_(True)
        ref = logp.detach() + torch.randn(batch, length, generator=generator)
        mask = (torch.rand(batch, length, generator=generator) < 0.8).float()
        ctx = ReductionContext(max_completion_length=length, token_normalizer=mask.sum())
        with warnings.catch_warnings():
            # dynamo may not warn of tracing through a cache wrapper (possible silent incorrectness)
            warnings.filterwarnings("error", message=".*lru_cache", category=UserWarning)
            compiled = compiled_term(per_token_kl(logp, ref), mask, config, "dapo", ctx)
        (compiled_grad,) = torch.autograd.grad(compiled.adapted, logp)
        eager = adapted_kl_term(per_token_kl(logp, ref), mask, config, "dapo", ctx)
        (eager_grad,) = torch.autograd.grad(eager.adapted, logp)
        for name in ("raw", "adapted", "sequence_kl", "lengths", "at_threshold"):
            torch.testing.assert_close(getattr(compiled, name), getattr(eager, name), rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(compiled_grad, eager_grad, rtol=1e-6, atol=1e-8)
        assert eager_grad.abs().max() > 0


def test_compiled_masking_drops_non_finite_padding_with_a_zero_gradient() -> None:
    """`keep_valid` compiled: NaN and inf on padded positions give the clean term and a zero gradient there."""
    torch._dynamo.reset()
    config = AdaptiveKLConfig(kl_adaptation_method="clip", kl_clip_threshold=0.3)
    kl = torch.tensor([[0.1, 0.5, float("nan")], [0.2, float("inf"), 0.4]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 1.0]])
    term = torch.compile(adapted_kl_term, fullgraph=True)(kl, mask, config, "bnpo", ReductionContext())
    # (0.1 + min(0.5, 0.3) + 0.2 + min(0.4, 0.3)) / 4 valid tokens
    assert term.adapted.item() == pytest.approx(0.9 / 4)
    (grad,) = torch.autograd.grad(term.adapted, kl)
    assert torch.equal(grad, torch.tensor([[0.25, 0.0, 0.0], [0.25, 0.0, 0.0]]))


@pytest.mark.parametrize("placement", ["loss", "reward"])
@pytest.mark.parametrize("estimator", BUILT_IN_ESTIMATORS)
def test_every_built_in_estimator_compiles_in_the_pipeline_and_equals_eager(estimator: str, placement: str) -> None:
    """The pipeline from the log-probs (the estimator run by the core, not a per-token KL handed in) as one
    fullgraph graph, for each built-in estimator in both placements: the compiled term's values and, in the loss, its
    gradient equal the eager core's."""
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # k1 in the loss and a non-log-ratio estimator in the reward warn
        config = AdaptiveKLConfig(kl_estimator=estimator, kl_placement=placement)

    def term(logp: torch.Tensor, ref: torch.Tensor, mask: torch.Tensor):
        return kl_term(logp, ref, mask, config, loss_type="grpo", with_grad=placement == "loss")

    compiled_term = torch.compile(term, fullgraph=True)
    generator = torch.Generator().manual_seed(1)
    logp = (-torch.rand(6, 9, generator=generator) * 3).requires_grad_(True)
    ref = logp.detach() + torch.randn(6, 9, generator=generator)
    mask = (torch.rand(6, 9, generator=generator) < 0.8).float()
    compiled, eager = compiled_term(logp, ref, mask), term(logp, ref, mask)
    for name in ("raw", "adapted", "sequence_kl", "lengths"):
        torch.testing.assert_close(getattr(compiled, name), getattr(eager, name), rtol=1e-6, atol=1e-7)
    if placement == "loss":
        (compiled_grad,) = torch.autograd.grad(compiled.adapted, logp)
        (eager_grad,) = torch.autograd.grad(eager.adapted, logp)
        torch.testing.assert_close(compiled_grad, eager_grad, rtol=1e-6, atol=1e-8)
        assert eager_grad.abs().max() > 0
