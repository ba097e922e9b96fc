"""kl_compile=True: the KL adaptation as one torch.compile graph gives the eager core's values, metrics and gradients,
and falls back to eager, with one warning, where compiling fails."""

from __future__ import annotations

import warnings

import pytest
import torch

from unsloth_adaptive_kl import AdaptiveKLConfig
from unsloth_adaptive_kl.core.adaptation import ReductionContext
from unsloth_adaptive_kl.core import adaptation

SETTINGS = [dict(kl_adaptation_method="clip", kl_clip_threshold=0.3), dict(kl_adaptation_method="sigmoid"),
            dict(kl_adaptation_method="length_normalized"), dict(kl_reduction="sequence_sum")]


@pytest.fixture(autouse=True)
def fresh_compiled_core(monkeypatch) -> None:
    monkeypatch.setattr(adaptation, "_compiled_term", None)
    monkeypatch.setattr(adaptation, "_compile_failed", False)


def per_token_kl(logp: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    delta = ref - logp
    return torch.exp(delta) - delta - 1


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: "/".join(map(str, s.values())))
def test_compiled_core_equals_eager_over_changing_shapes(settings: dict) -> None:
    config = AdaptiveKLConfig(kl_compile=True, **settings)
    generator = torch.Generator().manual_seed(0)
    for batch, length in ((4, 8), (6, 11), (6, 11)):
        logp = (-torch.rand(batch, length, generator=generator) * 3).requires_grad_(True)
        ref = logp.detach() + torch.randn(batch, length, generator=generator)
        mask = (torch.rand(batch, length, generator=generator) < 0.8).float()
        ctx = ReductionContext(max_completion_length=length, token_normalizer=mask.sum())
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)  # a fallback to eager would not test the compiled graph
            # nor may dynamo warn of tracing through a cache wrapper (possible silent incorrectness)
            warnings.filterwarnings("error", message=".*lru_cache", category=UserWarning)
            compiled = adaptation.kl_term(per_token_kl(logp, ref), mask, config, "dapo", ctx)
        (compiled_grad,) = torch.autograd.grad(compiled.adapted, logp)
        eager = adaptation.adapted_kl_term(per_token_kl(logp, ref), mask, config, "dapo", ctx)
        (eager_grad,) = torch.autograd.grad(eager.adapted, logp)
        for name in ("raw", "adapted", "sequence_kl", "lengths", "at_threshold"):
            torch.testing.assert_close(getattr(compiled, name), getattr(eager, name), rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(compiled_grad, eager_grad, rtol=1e-6, atol=1e-8)
        assert eager_grad.abs().max() > 0
    assert adaptation._compiled_term is not None and not adaptation._compile_failed


def test_a_failing_compile_warns_once_and_runs_eagerly(monkeypatch) -> None:
    def broken(function):
        def run(*args, **kwargs):
            raise RuntimeError("no C++ compiler")

        return run

    monkeypatch.setattr(torch, "compile", broken)
    config = AdaptiveKLConfig(kl_compile=True, kl_adaptation_method="clip", kl_clip_threshold=0.3)
    kl, mask = torch.tensor([[0.1, 0.5, 2.0]]), torch.tensor([[1.0, 1.0, 0.0]])
    ctx = ReductionContext(max_completion_length=3, token_normalizer=mask.sum())
    with pytest.warns(RuntimeWarning, match=r"kl_compile=True: torch.compile failed \(RuntimeError: no C\+\+ compiler\)"):
        first = adaptation.kl_term(kl, mask, config, "dapo", ctx)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        second = adaptation.kl_term(kl, mask, config, "dapo", ctx)
    # (0.1 + min(0.5, 0.3)) / 2 tokens, the padded 2.0 ignored
    assert first.adapted.item() == pytest.approx(0.2) and second.adapted.item() == pytest.approx(0.2)


def test_kl_compile_must_be_a_bool() -> None:
    with pytest.raises(ValueError, match=r"kl_compile='yes' is invalid: allowed is True or False"):
        AdaptiveKLConfig(kl_compile="yes")
