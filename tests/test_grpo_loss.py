"""The decisions TRL's and Unsloth's losses share (integrations/grpo_loss.py), on hand-made tensors: which per-token KL
is adapted, the normaliser translation, and the loss addition. Expected values are written out by hand. Torch alone:
the module imports no trainer."""

from __future__ import annotations

import math

import pytest
import torch

from unsloth_adaptive_kl import AdaptiveKL, AdaptiveKLConfig
from unsloth_adaptive_kl.core.numerics import masked_reference
from unsloth_adaptive_kl.integrations.grpo_loss import LossNormalisers, adapted_loss

MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])  # L = (2, 1)
POLICY = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -1.5, -2.5]])
REF = torch.tensor([[-1.5, -1.0, math.nan], [-0.5, -math.inf, 7.0]])  # masked positions hold garbage
BETA = 0.04


def normalisers(gradient_accumulation: int = 1, **overrides: object) -> LossNormalisers:
    values = dict(max_completion_length=3, num_items_in_batch=None, num_processes=1, steps_per_generation=None,
                  gradient_accumulation=gradient_accumulation)
    return LossNormalisers(**{**values, **overrides})


@pytest.mark.parametrize(("items", "processes", "steps", "expected"), [
    (torch.tensor(37.0), 2, 4, 37 / 2 / 4),
    (torch.tensor(0.0), 2, 4, 1 / 2 / 4),  # no active token: at least 1, never a division by 0
    (10, 1, None, 10.0),  # a plain number, no steps_per_generation division (TRL in evaluation)
    (0.0, 4, 2, 1 / 4 / 2),
])
def test_the_normaliser_translation(items: object, processes: int, steps: int | None, expected: float) -> None:
    ctx = normalisers(num_items_in_batch=items, num_processes=processes, steps_per_generation=steps).reduction_context()
    assert float(ctx.token_normalizer) == pytest.approx(expected, rel=1e-7)
    assert ctx.max_completion_length == 3


def test_without_num_items_there_is_no_token_normaliser() -> None:
    assert normalisers(steps_per_generation=4).reduction_context().token_normalizer is None


def test_masked_reference_keeps_valid_positions_and_takes_the_policy_elsewhere() -> None:
    ref = masked_reference(REF, POLICY, MASK)
    assert torch.equal(ref, torch.tensor([[-1.5, -1.0, -3.0], [-0.5, -1.5, -2.5]]))


def test_stock_reads_the_trainers_kl_and_leaves_its_loss_alone() -> None:
    """The stock k3 setting: the term reduces the trainer's own KL (here deliberately not k3 of the log-probs, so
    which one was read shows), and the loss is the trainer's, with its own KL term, untouched."""
    adaptive_kl = AdaptiveKL(AdaptiveKLConfig(), BETA, "grpo")
    trainer_kl = torch.tensor([[0.3, 0.1, 0.0], [0.6, 0.0, 0.0]])
    loss = torch.tensor(1.25)
    out, term = adapted_loss(adaptive_kl, loss, trainer_kl, POLICY, REF, MASK, normalisers(gradient_accumulation=2))
    assert out is loss
    assert float(term.raw) == pytest.approx(((0.3 + 0.1) / 2 + 0.6 / 1) / 2)  # grpo: mean over completions of S_i / L_i
    assert term.check is not None and torch.isfinite(term.check.sums).all()  # the garbage sits on masked positions


def test_clip_adapts_the_trainers_kl_and_adds_beta_over_accumulation() -> None:
    adaptive_kl = AdaptiveKL(AdaptiveKLConfig(kl_adaptation_method="clip", kl_clip_threshold=0.2), BETA, "dapo")
    trainer_kl = torch.tensor([[0.3, 0.1, 0.0], [0.6, 0.0, 0.0]], requires_grad=True)
    numbers = normalisers(gradient_accumulation=2, num_items_in_batch=torch.tensor(12.0), num_processes=2,
                          steps_per_generation=2)  # token normaliser 12 / 2 / 2 = 3
    out, term = adapted_loss(adaptive_kl, torch.tensor(1.25), trainer_kl, POLICY, REF, MASK, numbers, "dapo")
    adapted = (0.2 + 0.1 + 0.2) / 3  # min(k, 0.2) summed over valid tokens, over the token normaliser
    assert float(term.raw) == pytest.approx((0.3 + 0.1 + 0.6) / 3)
    assert float(term.adapted.detach()) == pytest.approx(adapted)
    assert float(out.detach()) == pytest.approx(1.25 + BETA * adapted / 2)
    out.backward()
    slope = BETA / 2 / 3  # d loss / d k where k is below the threshold; above it the clipped KL has no gradient
    assert torch.allclose(trainer_kl.grad, torch.tensor([[0.0, slope, 0.0], [0.0, 0.0, 0.0]]))


def test_another_estimator_is_computed_from_the_raw_log_probs() -> None:
    """k2 = 0.5 (logp - ref)^2 from the log-probs as the trainer holds them; the trainer's KL is not read."""
    adaptive_kl = AdaptiveKL(AdaptiveKLConfig(kl_estimator="k2"), BETA, "bnpo")
    policy = POLICY.clone().requires_grad_(True)
    trainer_kl = torch.full((2, 3), 9.0)
    out, term = adapted_loss(adaptive_kl, torch.tensor(0.0), trainer_kl, policy, REF, MASK, normalisers())
    k2 = [0.5 * 0.5 ** 2, 0.5 * 1.0 ** 2, 0.0]  # valid tokens: r = 0.5, -1.0, 0.0
    assert float(term.raw) == pytest.approx(sum(k2) / 3)  # bnpo: over the micro-batch's 3 valid tokens
    assert float(out.detach()) == pytest.approx(BETA * sum(k2) / 3)
    out.backward()
    expected = torch.tensor([[0.5, -1.0, 0.0], [0.0, 0.0, 0.0]]) * BETA / 3  # d/dlogp 0.5 (logp - ref)^2 = logp - ref
    assert torch.allclose(policy.grad, expected)


def test_the_loss_type_passed_overrides_the_objects_for_the_kl_reduction() -> None:
    """Unsloth's integration passes the reduction in effect for the micro-batch (its bnpo rule), which may differ
    from the one the AdaptiveKL object was built with: the KL is reduced as the loss_type passed. The trainer's KL on
    the valid tokens is (0.3, 0.1 | 0.6): grpo (the object's) gives ((0.3 + 0.1) / 2 + 0.6 / 1) / 2 = 0.4, bnpo
    (passed) (0.3 + 0.1 + 0.6) / 3 = 1 / 3; with clip above 1.0 (no clipping) the loss adds BETA * 1 / 3."""
    adaptive_kl = AdaptiveKL(AdaptiveKLConfig(kl_adaptation_method="clip", kl_clip_threshold=1.0), BETA, "grpo")
    trainer_kl = torch.tensor([[0.3, 0.1, 0.0], [0.6, 0.0, 0.0]])
    out, term = adapted_loss(adaptive_kl, torch.tensor(0.0), trainer_kl, POLICY, REF, MASK, normalisers(), "bnpo")
    assert float(term.raw) == pytest.approx((0.3 + 0.1 + 0.6) / 3)
    assert float(out) == pytest.approx(BETA * (0.3 + 0.1 + 0.6) / 3)
    _, term = adapted_loss(adaptive_kl, torch.tensor(0.0), trainer_kl, POLICY, REF, MASK, normalisers())
    assert float(term.raw) == pytest.approx(((0.3 + 0.1) / 2 + 0.6) / 2)
