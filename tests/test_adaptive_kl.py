"""The public `AdaptiveKL` object on its own (torch alone: this file runs where trl is not installed), against hand
formulas: the KL term per loss_type, the reward penalty, the controllers' steps, exact resume, validation, and a
user-registered estimator (SPEC 3.11)."""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import re
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from unsloth_adaptive_kl import (AdaptiveKL, AdaptiveKLConfig, KLEstimatorWarning, NonFiniteLogProbError, WindowKL,
                                 register_kl_estimator)
from unsloth_adaptive_kl.core.numerics import NONFINITE_ADVICE
from unsloth_adaptive_kl.core.statistics import KLStatistics, device_sums, gather_statistics
from unsloth_adaptive_kl.core.estimators import estimator_names
from unsloth_adaptive_kl.core.tolerance import k3_gradient_magnitude, k3_magnitude

from .conftest import torchrun
from .float32_error import assert_float32_close, k1_magnitude
from .metric_definitions import REDUCE, assert_metrics_match, by_definition

BETA = 0.04
LENGTHS = torch.tensor([4.0, 2.0, 1.0])
MASK = (torch.arange(4)[None] < LENGTHS[:, None]).float()


def batch(seed: int = 0, requires_grad: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 log-probs in [-3, 0] (the core's compute dtype), so r = ref - logp lies in [-3, 3]."""
    generator = torch.Generator().manual_seed(seed)
    logps = (-torch.rand(3, 4, generator=generator) * 3).requires_grad_(requires_grad)
    ref = -torch.rand(3, 4, generator=generator) * 3
    return logps, ref


def exact(x: torch.Tensor) -> torch.Tensor:
    """The same values in float64 (a leaf of its own where `x` requires a gradient): the exact side of a comparison."""
    return x.detach().double().requires_grad_(x.requires_grad)


def k3_by_hand(logps: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    r = ref - logps
    return (torch.exp(r) - r - 1) * MASK


# loss_type -> the KL term from the per-completion sums S_i and lengths L_i, written out (B = 3, T = 4).
HAND = {
    "grpo": lambda s, ctx: (s / LENGTHS).mean(),
    "bnpo": lambda s, ctx: s.sum() / LENGTHS.sum(),
    "dr_grpo": lambda s, ctx: s.sum() / (3 * ctx["max_completion_length"]),
    "dapo": lambda s, ctx: s.sum() / ctx["token_normalizer"],
    "luspo": lambda s, ctx: s.mean(),
}


def token_weights(loss_type: str, ctx: dict) -> torch.Tensor:
    """d HAND[loss_type] / d k_t: the weight of each token's KL in the term (the reduction is linear in the sums)."""
    k = torch.zeros(3, 4, dtype=torch.float64, requires_grad=True)
    return torch.autograd.grad(HAND[loss_type](k.sum(-1), ctx), k)[0] * MASK


@pytest.mark.parametrize("loss_type", sorted(HAND))
def test_none_is_beta_times_the_k3_term_of_the_loss_type(loss_type: str) -> None:
    """The float32 term and gradient against the exact (float64) formula of the same inputs, within the float32 bound
    of the arithmetic: the value's 13 operations (k3's 5, exp counted twice; 3 additions over 4 tokens; the
    reduction's at most 4, grpo's / L_i and mean; beta), the gradient's 7 (exp(r) - 1 from the forward's exp, times
    the upstream gradient, beta, the reduction's at most 2 divisions); sequence_kl's 11 (k3, the sums, the mean)."""
    logps, ref = batch()
    ctx = {"max_completion_length": 4, "token_normalizer": 5.0}
    term, metrics = AdaptiveKL(None, BETA, loss_type).kl_loss(logps, ref, MASK, **ctx)
    exact_logps = exact(logps)
    want = BETA * HAND[loss_type](k3_by_hand(exact_logps, exact(ref)).sum(-1), ctx)
    magnitude = BETA * HAND[loss_type]((k3_magnitude(logps, ref) * MASK).sum(-1), ctx)
    assert_float32_close(term.item(), want.item(), magnitude, 13)
    (grad,) = torch.autograd.grad(term, logps)
    (want_grad,) = torch.autograd.grad(want, exact_logps)
    assert want_grad[MASK > 0].ne(0).all()
    assert_float32_close(grad, want_grad, BETA * token_weights(loss_type, ctx) * k3_gradient_magnitude(logps, ref), 7)
    assert metrics["adaptive_kl/raw_kl"] == metrics["adaptive_kl/adapted_kl"]
    assert_float32_close(metrics["adaptive_kl/raw_kl"], want.item() / BETA, magnitude / BETA, 12)
    assert metrics["adaptive_kl/current_beta"] == BETA
    assert_float32_close(metrics["adaptive_kl/sequence_kl"], k3_by_hand(exact(logps), exact(ref)).sum(-1).mean().item(),
                         (k3_magnitude(logps, ref) * MASK).sum(-1).mean(), 11)


def test_clip_sigmoid_and_length_normalisation_follow_their_formulas() -> None:
    """Against the exact formulas of the same float32 inputs, within the float32 bound: clip (1-Lipschitz, so k's
    error passes unchanged) in 12 operations (k3's 5, the 6 additions over 7 tokens and the division, beta);
    sigmoid(k - 0.2) k, whose derivative in k is at most 1 + k / 4 and whose own roundings (the subtraction, the
    sigmoid's 5 with exp counted twice, the product) are at most k (|k| + 1.2), in 18 (then / L_i, the mean, beta)."""
    logps, ref = batch(requires_grad=False)
    k = k3_by_hand(exact(logps), exact(ref))
    assert ((k - 0.3).abs() > 1e-4).all()  # no token's float32 k3 can fall on the other side of the threshold
    clip = AdaptiveKL(AdaptiveKLConfig(kl_adaptation_method="clip", kl_clip_threshold=0.3), BETA, "bnpo")
    term, metrics = clip.kl_loss(logps, ref, MASK)
    magnitude = k3_magnitude(logps, ref) * MASK
    assert_float32_close(term.item(), BETA * (k.clamp(max=0.3) * MASK).sum().item() / 7, BETA * magnitude.sum() / 7, 12)
    assert metrics["adaptive_kl/clip_fraction"] == pytest.approx(((k >= 0.3) & (MASK > 0)).sum().item() / 7)
    sigmoid = AdaptiveKL(AdaptiveKLConfig(kl_adaptation_method="sigmoid+length_normalized", kl_target=0.2), BETA, "dapo")
    term, _ = sigmoid.kl_loss(logps, ref, MASK, token_normalizer=5.0)  # length_normalized: dapo's normaliser unused
    shaped = torch.sigmoid(k - 0.2) * k * MASK
    shaped_magnitude = ((1 + k / 4) * magnitude + k * (k.abs() + 1.2)) * MASK
    assert_float32_close(term.item(), BETA * (shaped.sum(-1) / LENGTHS).mean().item(),
                         BETA * (shaped_magnitude.sum(-1) / LENGTHS).mean(), 18 + 3 + 1 + 3 + 1)


def k1_by_hand(logps: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    return (logps - ref) * MASK


def test_reward_penalty_is_beta_times_each_completions_shaped_kl() -> None:
    """The reward placement's default estimator is k1 (SPEC 3.12): penalty_i = beta * sum_t m min(logp - ref, c), and
    beta * sum_t m (logp - ref) / L_i for sequence_mean; k3 there, set explicitly, warns and gives the k3 sums. Each
    within the float32 bound against the exact values: k1's subtraction, 3 additions and beta (5 operations; / L_i
    one more), k3's 5 for its 1 (9)."""
    logps, ref = batch(requires_grad=False)
    k1 = k1_by_hand(exact(logps), exact(ref))
    k1_parts = BETA * (k1_magnitude(logps, ref) * MASK).sum(-1)
    summed = AdaptiveKL(AdaptiveKLConfig(kl_placement="reward", kl_adaptation_method="clip", kl_clip_threshold=0.05),
                        BETA)
    penalty = summed.reward_penalty(logps, ref, MASK)[0]
    assert penalty.dtype == torch.float32  # as trainers gather rewards
    assert_float32_close(penalty, BETA * (k1.clamp(max=0.05) * MASK).sum(-1), k1_parts, 5)
    assert (k1.clamp(max=0.05) != k1).any() and (k1 < 0).any()  # the clip binds, and k1 has negative tokens
    assert summed.last_metrics["adaptive_kl/reward_penalty"] == pytest.approx(penalty.mean().item())
    mean = AdaptiveKL(AdaptiveKLConfig(kl_placement="reward", kl_reduction="sequence_mean"), BETA)
    assert_float32_close(mean.reward_penalty(logps, ref, MASK)[0], BETA * k1.sum(-1) / LENGTHS, k1_parts / LENGTHS, 6)
    k3 = k3_by_hand(exact(logps), exact(ref))
    with pytest.warns(KLEstimatorWarning, match=r"^kl_estimator='k3' with kl_placement='reward': "):
        explicit_k3 = AdaptiveKL(AdaptiveKLConfig(kl_placement="reward", kl_adaptation_method="clip",
                                                  kl_clip_threshold=0.3, kl_estimator="k3"), BETA)
    assert_float32_close(explicit_k3.reward_penalty(logps, ref, MASK)[0], BETA * (k3.clamp(max=0.3) * MASK).sum(-1),
                         BETA * (k3_magnitude(logps, ref) * MASK).sum(-1), 9)
    with pytest.raises(ValueError, match="kl_placement='reward' puts beta \\* KL into the rewards"):
        summed.kl_loss(logps, ref, MASK)
    with pytest.raises(ValueError, match=r"^kl_reduction='token_mean' is invalid: allowed is one of loss_type, "
                                         r"sequence_sum, sequence_mean with kl_placement='reward'"):
        AdaptiveKLConfig(kl_reduction="token_mean", kl_placement="reward")  # one KL per completion


@pytest.mark.parametrize(("name", "value", "off"), [("ref_model_sync_kl", 0.05, None),
                                                    ("ref_model_sync_reset_optimizer", True, False)])
def test_reference_sync_settings_without_a_reference_sync_are_refused(name: str, value: object, off: object) -> None:
    """A loop of your own (and Tinker's routes, which build this object) syncs no reference, so the settings that act
    on the sync would do nothing: refused by name, as TRL's trainer refuses them with sync_ref_model=False; a loop
    that syncs (reference_sync=True, as TRL's and Unsloth's trainers pass with sync_ref_model=True) takes them."""
    config = AdaptiveKLConfig(**{name: value})
    with pytest.raises(ValueError) as error:
        AdaptiveKL(config, BETA)
    assert str(error.value) == (f"{name}={value!r} is invalid: allowed is {off!r} without a reference sync (the setting "
                                "acts on the reference sync, which is off); AdaptiveKL syncs no reference itself: "
                                "a trainer's integration does, with sync_ref_model=True.")
    assert getattr(AdaptiveKL(config, BETA, reference_sync=True).config, name) == value


def test_reference_sync_is_true_or_false() -> None:
    """reference_sync="no" (truthy) let the sync settings through that reference_sync=False refuses, without a word;
    train="no" was already refused alike."""
    config = AdaptiveKLConfig(ref_model_sync_kl=0.1)
    for given in ("no", 1, None):
        with pytest.raises(ValueError) as error:
            AdaptiveKL(config, BETA, reference_sync=given)
        assert str(error.value).startswith(f"reference_sync={given!r} is invalid: allowed is True (the loop syncs the "
                                           "reference model) or False")


def test_each_door_refuses_the_other_placement_and_the_step_reads_its_own() -> None:
    """reward_penalty refuses the loss placement as kl_loss refuses the reward one, so a stray call in a loss-placement
    loop cannot replace the step's KL (it once took last_raw_kl from 1.897 to 0.616 and moved target's beta); the step
    then reads the KL of the batches it trained on, by hand here."""
    logps, ref = batch(requires_grad=False)
    akl = AdaptiveKL(AdaptiveKLConfig(kl_adaptation_method="target", kl_target=0.1, kl_horizon=30.0), BETA, "bnpo")
    akl.kl_loss(logps, ref, MASK)
    with pytest.raises(ValueError, match=r"^kl_placement='loss' puts beta \* KL into the loss, not the rewards: "
                                         r"call kl_loss\(\.\.\.\)"):
        akl.reward_penalty(logps, ref, MASK)
    akl.step()
    trained = (k3_by_hand(logps, ref) * MASK).sum().item() / LENGTHS.sum().item()
    assert akl.last_raw_kl == pytest.approx(trained, rel=1e-6)


def estimator_warnings(**fields) -> list[str]:
    """The KLEstimatorWarning messages that building AdaptiveKLConfig(**fields) emits (every one: filter 'always')."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = AdaptiveKLConfig(**fields)
        AdaptiveKL(config, BETA)
    return [str(w.message) for w in caught if issubclass(w.category, KLEstimatorWarning)]


def test_each_placement_defaults_to_its_estimator_and_the_guards_warn() -> None:
    """SPEC 3.12: kl_estimator=None is k3 in the loss and k1 in the reward, silently; k1 in the loss and a non-log-ratio
    estimator in the reward warn, naming the field, its value, the placement and the fix; the others do not."""
    assert AdaptiveKLConfig().kl_estimator is None and AdaptiveKLConfig().estimator == "k3"
    assert AdaptiveKLConfig(kl_placement="reward").estimator == "k1"
    with pytest.warns(KLEstimatorWarning):
        assert AdaptiveKLConfig(kl_placement="reward", kl_estimator="k2").estimator == "k2"
    for placement, silent in (("loss", (None, "k2", "k3", "low_var_kl", "k1+", "k3+", "k1_future")),
                              ("reward", (None, "k1", "k1+", "k1_future", "test_least_confident_half"))):
        for estimator in silent:
            assert estimator_warnings(kl_placement=placement, kl_estimator=estimator) == [], (placement, estimator)
    (k1_in_loss,) = set(estimator_warnings(kl_estimator="k1"))
    assert k1_in_loss.startswith("kl_estimator='k1' with kl_placement='loss': the expected gradient of k1 is zero "
                                 "on-policy")
    assert "Use kl_estimator='k1_future'" in k1_in_loss and "kl_placement='reward', where k1 is exact" in k1_in_loss
    for estimator in ("k2", "k3", "low_var_kl", "k3+", "k3_bottom_percentile"):
        (message,) = set(estimator_warnings(kl_placement="reward", kl_estimator=estimator))
        assert message.startswith(f"kl_estimator={estimator!r} with kl_placement='reward': a KL in the reward must be "
                                  "the log-ratio k1 = logp - ref_logp")
        assert message.endswith("Use kl_estimator='k1' (the reward placement's default: leave kl_estimator unset).")


def k1_future_by_hand(logps: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """G_t = sum_{s >= t} m_s (logp_s - ref_s), the KL-to-go of each completion, token by token (float64)."""
    k1 = (logps.double() - ref.double()).detach() * MASK
    return torch.tensor([[k1[i, t:].sum().item() for t in range(k1.size(1))] for i in range(k1.size(0))],
                        dtype=torch.float64) * MASK


def k1_future_magnitude(logps: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """The parts of G_t: sum_{s >= t} m_s (|logp_s| + |ref_s|)."""
    parts = k1_magnitude(logps, ref) * MASK
    return parts.flip(-1).cumsum(-1).flip(-1) * MASK


def test_k1_future_has_the_value_of_k1_and_the_kl_to_go_as_gradient() -> None:
    """k1_future in the own loop (dr_grpo): the term is beta * sum m (logp - ref) / (B T_max), exactly k1's; its
    gradient per token is beta / (B T_max) * G_t (k1's is beta / (B T_max) on every valid token); the reward
    penalty is k1's; masked positions may hold NaN or -inf."""
    logps, ref = batch()
    term, metrics = AdaptiveKL(AdaptiveKLConfig(kl_estimator="k1_future"), BETA, "dr_grpo").kl_loss(
        logps, ref, MASK, max_completion_length=4)
    with pytest.warns(KLEstimatorWarning):
        k1 = AdaptiveKL(AdaptiveKLConfig(kl_estimator="k1"), BETA, "dr_grpo")
    k1_term, k1_metrics = k1.kl_loss(logps, ref, MASK, max_completion_length=4)
    # float32 against the exact value: k1's subtraction, 6 additions, / 12 and beta (9 operations); the gradient's
    # KL-to-go: the subtraction, at most 3 additions, beta and / 12 (6)
    value, value_magnitude = BETA * k1_by_hand(exact(logps), exact(ref)).sum().item() / 12, BETA * (
        k1_magnitude(logps, ref) * MASK).sum() / 12
    assert term.item() == k1_term.item()
    assert_float32_close(term.item(), value, value_magnitude, 9)
    assert metrics == k1_metrics
    (grad,) = torch.autograd.grad(term, logps)
    to_go = k1_future_by_hand(logps, ref)
    assert_float32_close(grad, BETA / 12 * to_go, BETA / 12 * k1_future_magnitude(logps, ref), 6)
    assert (to_go * MASK != k1_by_hand(logps, ref)).any()  # the KL of the tokens that follow counts
    (k1_grad,) = torch.autograd.grad(k1_term, logps)
    assert_float32_close(k1_grad, BETA / 12 * MASK.double(), BETA / 12 * MASK, 3)  # beta in float32, * and / 12
    reward = AdaptiveKL(AdaptiveKLConfig(kl_placement="reward", kl_estimator="k1_future"), BETA)
    assert torch.equal(reward.reward_penalty(logps.detach(), ref, MASK)[0],
                       AdaptiveKL(AdaptiveKLConfig(kl_placement="reward"), BETA).reward_penalty(logps.detach(), ref, MASK)[0])
    garbage = torch.where(MASK > 0, logps.detach(), torch.tensor([math.nan, -math.inf])[torch.arange(4) % 2]
                          ).requires_grad_(True)
    term, _ = AdaptiveKL(AdaptiveKLConfig(kl_estimator="k1_future"), BETA, "dr_grpo").kl_loss(
        garbage, ref, MASK, max_completion_length=4)
    (grad,) = torch.autograd.grad(term, garbage)
    assert_float32_close(term.item(), value, value_magnitude, 9)
    assert_float32_close(grad, BETA / 12 * to_go, BETA / 12 * k1_future_magnitude(logps, ref), 6)


def test_dynamic_decays_once_per_generation_batch_and_cuts_off() -> None:
    config = AdaptiveKLConfig(kl_adaptation_method="dynamic", reward_threshold=0.5, dynamic_beta_decay=0.5,
                              beta_min=0.005, beta_schedule_steps=5)
    akl = AdaptiveKL(config, BETA)
    betas = [akl.step(mean_reward=0.9), akl.step(), akl.step(mean_reward=0.4), akl.step(mean_reward=0.6),
             akl.step(mean_reward=0.9)]
    # decay, same batch (no decay), reward below threshold, decay, then step 5 >= beta_schedule_steps: beta_min
    assert betas == pytest.approx([0.02, 0.02, 0.02, 0.01, 0.005])
    logps, ref = batch()
    assert akl.kl_loss(logps, ref, MASK)[1]["adaptive_kl/current_beta"] == 0.005



def test_the_schedules_end_says_so_once() -> None:
    """beta_schedule_steps (default 1000) sets beta to beta_min (default 0: no KL term) whatever the reward: a run
    longer than it lost its KL at step 1000 without a word. It warns at that step, once, naming both betas; where
    the decays had already reached beta_min it changes nothing and says nothing."""
    akl = AdaptiveKL(AdaptiveKLConfig(kl_adaptation_method="dynamic", reward_threshold=0.5, beta_schedule_steps=3),
                     BETA)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert [akl.step(mean_reward=0.1), akl.step(mean_reward=0.1)] == [BETA, BETA]
    with pytest.warns(UserWarning) as caught:
        assert akl.step(mean_reward=0.1) == 0.0
    assert [str(w.message) for w in caught] == [
        "adaptive KL: step 3 reached beta_schedule_steps=3: beta = beta_min = 0 from the next step on (it was 0.04); "
        "the KL term is off. Set beta_schedule_steps=None (or later) to decay by the reward alone."]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert akl.step(mean_reward=0.9) == 0.0
def test_target_steers_beta_from_the_steps_kl() -> None:
    config = AdaptiveKLConfig(kl_adaptation_method="target", kl_target=0.1, kl_horizon=30.0)
    akl = AdaptiveKL(config, BETA)
    logps, ref = batch()
    akl.kl_loss(logps, ref, MASK)
    akl.kl_loss(*batch(1), MASK)  # two micro-batches in one optimizer step
    k = torch.cat([k3_by_hand(logps, ref), k3_by_hand(*batch(1), )]).detach()
    token_mean = k.sum().item() / (2 * LENGTHS.sum().item())
    error = min(max(token_mean / 0.1 - 1, -0.2), 0.2)
    assert akl.step() == pytest.approx(BETA * (1 + error * 6 / 30.0), rel=1e-12)


@pytest.mark.parametrize("placement", ["loss", "reward"])
def test_a_completion_without_a_valid_token_is_not_a_completion_the_step_trained_on(placement: str) -> None:
    """A fully masked completion (TRL's mask_truncated_completions, verl's padding samples) is no point (0, 0) in the
    sequence-level metrics nor a completion of the step's KL: sequence_kl, length_kl_corr and target's sequence_sum
    measure are those of the batch without it, by hand."""
    logps, ref = batch(requires_grad=False)
    logps = logps if placement == "loss" else torch.maximum(logps, ref)  # k1 >= 0 in the reward: a positive mean
    padded_logps, padded_ref = torch.cat([logps, -torch.ones(1, 4, dtype=torch.float64)]), torch.cat([ref, ref[:1]])
    padded_mask = torch.cat([MASK, torch.zeros(1, 4, dtype=torch.float64)])
    # each placement's default estimator: k3 in the loss, k1 (the log-ratio) in the reward
    sums = (k3_by_hand(logps, ref) if placement == "loss" else (logps - ref) * MASK).sum(-1)
    corr = torch.corrcoef(torch.stack([LENGTHS.double(), sums]))[0, 1].item()
    target = sums.mean().item() / 1.1  # an error of 0.1 from the 3 trained completions, inside the +-0.2 clamp
    config = AdaptiveKLConfig(kl_adaptation_method="target", kl_target_measure="sequence_sum", kl_target=target,
                              kl_horizon=30.0, kl_placement=placement)
    akl = AdaptiveKL(config, BETA, "bnpo")
    if placement == "loss":
        _, metrics = akl.kl_loss(padded_logps, padded_ref, padded_mask)
        beta = akl.step()
    else:
        _, metrics = akl.reward_penalty(padded_logps, padded_ref, padded_mask)
        beta = akl.step(mean_reward=0.5)
    # (the statistics travel as float32)
    assert metrics["adaptive_kl/sequence_kl"] == pytest.approx(sums.mean().item(), rel=1e-6)
    assert metrics["adaptive_kl/length_kl_corr"] == pytest.approx(corr, rel=1e-6)
    error = sums.mean().item() / target - 1  # the mean over the 3 trained completions, not 4; n = 3
    assert error == pytest.approx(0.1) and beta == pytest.approx(BETA * (1 + error * 3 / 30.0), rel=1e-6)


def test_target_steps_from_a_kl_measured_by_the_loop() -> None:
    """`step(kl=WindowKL(...))`: a loop that aggregates its own KL (verl) hands it over; it wins over what kl_loss saw
    and is the raw KL a KL-triggered sync reads. 0.15 / 0.1 - 1 = 0.5 is clipped to 0.2; 0.09: e = -0.1."""
    from unsloth_adaptive_kl import WindowKL

    akl = AdaptiveKL(AdaptiveKLConfig(kl_adaptation_method="target", kl_target=0.1, kl_horizon=8.0), BETA)
    akl.kl_loss(*batch(), MASK)  # its KL is replaced by the loop's own measure
    assert akl.step(kl=WindowKL(token_mean=0.15, sequence_sum=0.4, completions=4)) == pytest.approx(
        BETA * (1 + 0.2 * 4 / 8), rel=1e-12)
    assert akl.last_raw_kl == 0.15 and akl.completed_steps == 1
    assert akl.step(kl=WindowKL(token_mean=0.09, sequence_sum=0.3, completions=8)) == pytest.approx(
        BETA * 1.1 * 0.9, rel=1e-12)
    with pytest.warns(UserWarning, match="beta holds at step 3: target moves beta from the KL"):
        assert akl.step() == pytest.approx(BETA * 1.1 * 0.9, rel=1e-12)  # no KL seen: beta holds, and says so

def test_state_dict_resumes_exactly() -> None:
    config = AdaptiveKLConfig(kl_adaptation_method="target", kl_target=0.05, kl_horizon=10.0, beta_max=0.1)

    def run(akl: AdaptiveKL, steps: range) -> list[float]:
        betas = []
        for step in steps:
            logps, ref = batch(step)
            term, metrics = akl.kl_loss(logps, ref, MASK)
            betas.append(metrics["adaptive_kl/current_beta"])
            akl.step(mean_reward=0.1 * step)
        return betas

    uninterrupted = run(AdaptiveKL(config, BETA), range(6))
    first = AdaptiveKL(config, BETA)
    head = run(first, range(3))
    saved = json.loads(json.dumps(first.state_dict()))  # what a checkpoint holds
    resumed = AdaptiveKL(config, BETA)
    resumed.load_state_dict(saved)
    assert resumed.completed_steps == 3
    assert head + run(resumed, range(3, 6)) == uninterrupted
    assert len(set(uninterrupted)) == 6  # beta moved every step


def test_the_steps_kl_is_one_token_mean_whatever_the_loop_and_placement() -> None:
    """`last_raw_kl` (what ref_model_sync_kl compares) and the `target` controller's KL are sum_t m k / sum L over
    the step's completions, all micro-batches, in every path: the own loop's kl_loss + step, the trainer path's
    record, the own loop's reward_penalty + step, and the trainer path's penalize + observe_rewards + record at the
    step's end. grpo's loss
    reduction (a mean of per-completion means) would give another number: the test tells them apart."""
    (a, ref_a), (b, ref_b) = batch(0, False), batch(1, False)
    loss_mean = (k3_by_hand(a, ref_a).sum() + k3_by_hand(b, ref_b).sum()).item() / (2 * LENGTHS.sum().item())
    grpo_mean = ((k3_by_hand(a, ref_a).sum(-1) / LENGTHS).mean() + (k3_by_hand(b, ref_b).sum(-1) / LENGTHS).mean()) / 2
    assert abs(loss_mean - grpo_mean.item()) > 0.02  # 0.813 against 0.782
    target = AdaptiveKLConfig(kl_adaptation_method="target", kl_target=0.1, kl_horizon=30.0)

    own = AdaptiveKL(target, BETA)
    own.kl_loss(a, ref_a, MASK), own.kl_loss(b, ref_b, MASK)
    own.step()
    trainer = AdaptiveKL(target, BETA)
    for logps, ref, last in ((a, ref_a, False), (b, ref_b, True)):
        term = trainer.term(logps, ref, MASK, per_token_kl=k3_by_hand(logps, ref))
        trainer.record(term, gather=lambda t: t, train=True, end_of_step=last, completed_steps=1)
    # The statistics rows are float32 (one gather for every dtype): 1e-7 relative.
    assert own.last_raw_kl == pytest.approx(loss_mean, rel=1e-6)
    assert trainer.last_raw_kl == pytest.approx(loss_mean, rel=1e-6)
    assert own.current_beta == pytest.approx(trainer.current_beta, rel=1e-9) and own.current_beta != BETA

    in_reward = AdaptiveKLConfig(kl_adaptation_method="target", kl_target=0.1, kl_horizon=30.0, kl_placement="reward")
    reward_mean = k1_by_hand(a, ref_a).sum().item() / LENGTHS.sum().item()  # k1: the reward's default estimator
    own = AdaptiveKL(in_reward, BETA)
    own.reward_penalty(a, ref_a, MASK)
    own.step(mean_reward=0.5)
    trainer = AdaptiveKL(in_reward, BETA)
    trainer.penalize(trainer.term(a, ref_a, MASK), gather=lambda t: t, train=True, completed_steps=0)
    trainer.observe_rewards(0.5)
    assert trainer.current_beta == BETA  # scoring moves nothing: the step's end does
    trainer.record(None, gather=lambda t: t, train=True, end_of_step=True, completed_steps=1)
    assert own.last_raw_kl == pytest.approx(reward_mean, rel=1e-6)
    assert trainer.last_raw_kl == pytest.approx(reward_mean, rel=1e-6)
    error = min(max(reward_mean / 0.1 - 1, -0.2), 0.2)
    assert own.current_beta == trainer.current_beta == pytest.approx(BETA * (1 + error * 3 / 30.0), rel=1e-9)


@pytest.mark.parametrize(("method", "loss_type"), [("clip", "grpo"), ("sigmoid+length_normalized", "bnpo"),
                                                  ("target", "luspo")])
def test_kl_loss_metrics_match_their_definitions(method: str, loss_type: str) -> None:
    """Each adaptive_kl/* value of `kl_loss` against docs/metrics.md's definition (tests/metric_definitions.py)."""
    config = AdaptiveKLConfig(kl_adaptation_method=method, kl_clip_threshold=0.3)
    logps, ref = batch(2, False)
    _, metrics = AdaptiveKL(config, BETA, loss_type).kl_loss(logps, ref, MASK)
    adapted = REDUCE["length_normalized" if "length_normalized" in method else loss_type]
    assert_metrics_match(metrics, by_definition(k3_by_hand(logps, ref), MASK, method=method, raw=REDUCE[loss_type],
                                                adapted=adapted, beta=BETA, clip=0.3), rel=1e-5)  # float32 rows


def test_reward_penalty_metrics_match_their_definitions() -> None:
    config = AdaptiveKLConfig(kl_adaptation_method="clip", kl_clip_threshold=0.3, kl_placement="reward")
    logps, ref = batch(2, False)
    penalty, metrics = AdaptiveKL(config, BETA).reward_penalty(logps, ref, MASK)
    k1 = k1_by_hand(logps, ref)
    assert_metrics_match(metrics, by_definition(k1, MASK, method="clip", raw=REDUCE["sequence_sum"],
                                                adapted=REDUCE["sequence_sum"], beta=BETA, clip=0.3, penalty=True),
                         rel=1e-5)
    exact_k1 = k1_by_hand(exact(logps), exact(ref))  # float32 bound: k1's subtraction, 3 additions, beta
    assert_float32_close(penalty, BETA * (torch.clamp(exact_k1, max=0.3) * MASK).sum(-1),
                         BETA * (k1_magnitude(logps, ref) * MASK).sum(-1), 5)


def test_the_kl_in_the_reward_applies_the_schedule_cut_off_when_a_batch_is_scored() -> None:
    """A trainer scores generation batch k after k optimizer steps (`penalize`, `observe_rewards`, then the step's
    end, `record(None, ...)` with the KL in the reward): from beta_schedule_steps = 2 on, the batch is penalised with
    beta_min, not one batch later."""
    config = AdaptiveKLConfig(kl_adaptation_method="dynamic", kl_placement="reward", beta_schedule_steps=2,
                              beta_min=0.01, reward_threshold=0.8)
    akl = AdaptiveKL(config, BETA)
    logps, ref = batch(0, False)
    betas = []
    for step in range(4):
        _, metrics = akl.penalize(akl.term(logps, ref, MASK), gather=lambda t: t, train=True,
                                  completed_steps=step)
        betas.append(metrics["adaptive_kl/current_beta"])
        akl.observe_rewards(0.5)  # below the reward threshold: no decay
        akl.record(None, gather=lambda t: t, train=True, end_of_step=True, completed_steps=step + 1)
    assert betas == [BETA, BETA, 0.01, 0.01]


@pytest.mark.parametrize("placement", ["loss", "reward"])
def test_a_checkpoint_between_the_kl_and_the_step_resumes_exactly(placement: str) -> None:
    """Saved after the batch's KL was seen and before `step` read it (and after a first step: last_raw_kl), a
    resumed object steps to the same beta and the same last_raw_kl as the uninterrupted one."""
    config = AdaptiveKLConfig(kl_adaptation_method="target", kl_target=0.1, kl_horizon=30.0, kl_placement=placement)

    def see(akl: AdaptiveKL, seed: int) -> None:
        logps, ref = batch(seed, False)
        (akl.kl_loss if placement == "loss" else akl.reward_penalty)(logps, ref, MASK)

    uninterrupted, first = AdaptiveKL(config, BETA), AdaptiveKL(config, BETA)
    for akl in (uninterrupted, first):
        see(akl, 0), akl.step(mean_reward=0.5), see(akl, 1)
    resumed = AdaptiveKL(config, BETA)
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    assert resumed.last_raw_kl == uninterrupted.last_raw_kl and math.isfinite(resumed.last_raw_kl)
    assert resumed.step(mean_reward=0.5) == uninterrupted.step(mean_reward=0.5) != BETA
    assert resumed.last_raw_kl == uninterrupted.last_raw_kl


def test_a_format_2_state_loads_without_the_steps_kl() -> None:
    state = {"format_version": 2, "controller": "target", "value": 0.05, "generation_batch": 3, "batch_reward": 0.5,
             "completed_steps": 3}  # as the previous release wrote it
    akl = AdaptiveKL(AdaptiveKLConfig(kl_adaptation_method="target"), BETA)
    akl.load_state_dict(state)
    assert (akl.current_beta, akl.completed_steps, math.isnan(akl.last_raw_kl)) == (0.05, 3, True)
    with pytest.warns(UserWarning, match="beta holds at step 4"):
        assert akl.step() == 0.05  # no KL seen since the resume: beta holds


def test_a_versioned_state_without_its_controller_kind_is_refused_as_cut() -> None:
    """{"format_version": 7} alone was read as a format-1 state and refused as "a 'constant or target' controller's
    state" loaded into a dynamic one: it names the missing field instead; a format-1 state (no version) has no kind."""
    akl = AdaptiveKL(AdaptiveKLConfig(kl_adaptation_method="dynamic"), BETA)
    for version in (2, 7):
        with pytest.raises(ValueError, match=rf"^adaptive KL state: format_version={version} has no 'controller' field"):
            akl.load_state_dict({"format_version": version})
    akl.load_state_dict({"value": 0.03, "generation_batch": 2, "batch_reward": 0.5, "last_decayed_batch": 1})
    assert akl.current_beta == 0.03


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(config=AdaptiveKLConfig(beta_min=0.5), beta=0.1),
         "beta_min=0.5 is invalid: allowed is a finite number with 0 <= beta_min <= beta=0.1."),
        (dict(config=None, beta=math.nan), "beta=nan is invalid: allowed is a finite number >= 0."),
        (dict(config=None, beta=-0.1), "beta=-0.1 is invalid: allowed is a finite number >= 0."),
        # a number, but not a Python one: said so (it read "0.04 is invalid: allowed is a number")
        (dict(config=None, beta=torch.tensor(0.5)), "beta=tensor(0.5000) is invalid: allowed is a finite number >= 0, "
                                                    "as a Python int or float (this is a torch.Tensor: pass "
                                                    "float(...))."),
        (dict(config=None, beta=0.1, loss_type="ppo"), "loss_type='ppo' is not supported by adaptive KL: allowed is one "
                                                       "of bnpo, cispo, dapo, dr_grpo, grpo, luspo, sapo, vespo."),
        # at beta=0 too: kl_loss reduces its (zero) term as the loss type does, and refused it at the first batch
        # (Tinker's loss doors checked it again, for want of this check)
        (dict(config=None, beta=0.0, loss_type="ppo"),
         "loss_type='ppo' is not supported by adaptive KL: allowed is one of bnpo, cispo, dapo, dr_grpo, grpo, luspo, "
         "sapo, vespo."),
    ],
)
def test_bad_input_names_field_value_and_what_is_allowed(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError) as raised:
        AdaptiveKL(**kwargs)
    assert str(raised.value) == message


@pytest.mark.parametrize(("loss_type", "kwargs"), [("dapo", dict(token_normalizer=-8.0)),
                                                 ("dapo", dict(token_normalizer=0)),
                                                 ("dapo", dict(token_normalizer=math.inf)),
                                                 ("dr_grpo", dict(max_completion_length=-4)),
                                                 ("dr_grpo", dict(max_completion_length=True)),
                                                 ("dr_grpo", dict(max_completion_length=math.inf)),
                                                 ("dr_grpo", dict(max_completion_length=0.5)),
                                                 ("dapo", dict(token_normalizer="8")),
                                                 ("dr_grpo", dict(max_completion_length="6"))])
def test_a_normaliser_that_is_not_positive_is_refused_by_name(loss_type: str, kwargs: dict) -> None:
    """A negative normaliser would flip the KL term's sign (the loss would reward KL), a zero one divide by zero, an
    infinite one zero the term (silently: no KL); dr_grpo's length counts tokens; text raised a bare TypeError from
    the division."""
    ((name, value),) = kwargs.items()
    logps, ref = batch()
    with pytest.raises(ValueError) as raised:
        AdaptiveKL(None, BETA, loss_type).kl_loss(logps, ref, MASK, **kwargs)
    allowed = "an integer >= 1" if name == "max_completion_length" else "a finite number > 0"
    assert str(raised.value) == (f"{name}={value!r} is invalid: allowed is {allowed}, or None where the loss_type "
                                 "does not need it.")



@pytest.mark.parametrize(("loss_type", "message"), [
    ("dr_grpo", "max_completion_length=None is invalid: allowed is an integer >= 1, the cap on a completion's length, "
                "which loss_type='dr_grpo' divides by: pass it to kl_loss(...)."),
    ("dapo", "token_normalizer=None is invalid: allowed is a finite number > 0, the active tokens of the micro-batch's "
             "window, which loss_type dapo, cispo and vespo divide by: pass it to kl_loss(...).")])
def test_a_missing_divisor_is_named_with_the_door_it_goes_to(loss_type: str, message: str) -> None:
    """It said "the 'max_length_mean' reduction (loss_type='dr_grpo') needs max_completion_length": an internal
    name, no allowed value, no door."""
    with pytest.raises(ValueError) as raised:
        AdaptiveKL(None, BETA, loss_type).kl_loss(*batch(), MASK)
    assert str(raised.value) == message
def test_a_dr_grpo_cap_below_a_completions_length_is_refused() -> None:
    """dr_grpo divides by max_completion_length as the cap on every completion's length: MASK's longest completion
    has 4 valid tokens, so a cap of 3 (which multiplied the term by 4/3 without a word) is refused, naming both; a
    cap of 4 on a wider, padded batch is read from the mask and accepted. Where the KL term is not reduced by
    dr_grpo's divisor (length_normalized, a token_mean kl_reduction) raw_kl still is, as the loss type reduces: the
    cap is refused naming it (it doubled raw_kl at a cap of half the length, accepted); under grpo the cap divides
    nothing and only warns as unread."""
    logps, ref = batch()
    with pytest.raises(ValueError) as raised:
        AdaptiveKL(None, BETA, "dr_grpo").kl_loss(logps, ref, MASK, max_completion_length=3)
    assert str(raised.value) == ("max_completion_length=3 is invalid: allowed is an integer >= 4, the longest "
                                 "completion's valid tokens in this batch: loss_type='dr_grpo' divides the KL term by "
                                 "it as the cap on every completion's length.")
    padded = torch.nn.functional.pad(MASK, (0, 2))  # width 6, the longest completion still 4
    wide_logps, wide_ref = (torch.nn.functional.pad(x.detach(), (0, 2)) for x in (logps, ref))
    term, _ = AdaptiveKL(None, BETA, "dr_grpo").kl_loss(wide_logps, wide_ref, padded, max_completion_length=4)
    k = k3_by_hand(exact(logps), exact(ref)) * MASK
    assert term.item() == pytest.approx(BETA * k.sum().item() / (3 * 4), rel=1e-6)  # sum_i S_i / (B * cap)
    for config in (AdaptiveKLConfig(kl_adaptation_method="length_normalized"),
                   AdaptiveKLConfig(kl_reduction="token_mean")):
        with pytest.raises(ValueError, match="loss_type='dr_grpo' divides raw_kl by it as the cap on every"):
            AdaptiveKL(config, BETA, "dr_grpo").kl_loss(logps, ref, MASK, max_completion_length=3)
    with pytest.warns(UserWarning, match="^max_completion_length has no effect"):
        AdaptiveKL(None, BETA, "grpo").kl_loss(logps, ref, MASK, max_completion_length=3)


def test_an_all_masked_micro_batch_adds_nothing_to_a_token_mean() -> None:
    """bnpo's sum_i S_i / max(sum_i L_i, 1): a micro-batch with no valid token (all padding, a truncated completion
    masked out) gives 0, not 0 / 0."""
    term, metrics = AdaptiveKL(None, BETA, "bnpo").kl_loss(*batch(), torch.zeros(3, 4))
    assert term.item() == 0.0 and metrics["adaptive_kl/raw_kl"] == 0.0


def test_clip_fraction_counts_a_token_exactly_at_the_threshold() -> None:
    """clip_fraction = #{k >= kl_clip_threshold} / tokens: with k1+ (the log-ratio as value) of [1, 0.5, 0, 0] and a
    threshold of 1, the first token is at it: 1 of 4."""
    akl = AdaptiveKL(AdaptiveKLConfig(kl_adaptation_method="clip", kl_clip_threshold=1.0, kl_estimator="k1+"), BETA)
    _, metrics = akl.kl_loss(torch.tensor([[-1.0, -1.5, -2.0, -2.0]]), torch.full((1, 4), -2.0), torch.ones(1, 4))
    assert metrics["adaptive_kl/clip_fraction"] == 0.25


def test_the_reward_penalty_carries_no_gradient() -> None:
    """The penalty enters the advantages, which GRPO treats as constants: no graph is kept from the log-probs."""
    logps, ref = batch()
    penalty, _ = AdaptiveKL(AdaptiveKLConfig(kl_placement="reward"), BETA).reward_penalty(logps, ref, MASK)
    assert logps.requires_grad and not penalty.requires_grad and penalty.grad_fn is None


def test_two_batches_scored_before_one_step_are_that_steps_kl() -> None:
    """The KL in the reward, two generation batches scored before `step()`: the step's KL is their pooled token mean,
    (2 + 3) / (2 + 1) of k1, not the last batch's 3."""
    akl = AdaptiveKL(AdaptiveKLConfig(kl_placement="reward", kl_adaptation_method="target"), BETA)
    akl.reward_penalty(torch.tensor([[-1.0, -1.0]]), torch.zeros(1, 2), torch.ones(1, 2))  # k1 sum 2, 2 tokens
    akl.reward_penalty(torch.tensor([[-3.0, 0.0]]), torch.zeros(1, 2), torch.tensor([[1.0, 0.0]]))  # k1 sum 3, 1 token
    akl.step()
    assert akl.last_raw_kl == pytest.approx(-5 / 3)


def test_an_evaluation_pass_through_the_trainer_door_moves_nothing() -> None:
    """`record_sums(..., train=False)`: the metrics of an evaluation pass; `dynamic` with a pending reward above its
    threshold neither decays nor counts a step, and the training sums of the step in progress stay."""
    akl = AdaptiveKL(AdaptiveKLConfig(kl_adaptation_method="dynamic"), BETA)
    akl.kl_loss(*batch(), MASK)
    akl.observe_rewards(0.95)
    akl.record_sums([], train=False, completed_steps=0)
    assert (akl.completed_steps, akl.current_beta) == (0, BETA)
    akl.step()
    assert akl.current_beta == pytest.approx(BETA * 0.9) and math.isfinite(akl.last_raw_kl)


def engine_sums(**change: float) -> KLStatistics:
    """A batch's sums as an engine gathers them (two completions of 2 and 1 tokens, k1 sums -2 and -3), changed."""
    akl = AdaptiveKL(AdaptiveKLConfig(kl_estimator="k1"), BETA)
    term = akl.term(torch.tensor([[-1.0, -1.0], [-3.0, 0.0]]), torch.zeros(2, 2),
                    torch.tensor([[1.0, 1.0], [1.0, 0.0]]))
    (sums,) = gather_statistics([device_sums(term)], [term.check], step=1)
    return dataclasses.replace(sums, **change)


@pytest.mark.parametrize(("change", "error", "message"), [
    # record() raised NonFiniteLogProbError on a non-finite log-prob sum; record_sums trained on without a word
    ({"old_logps": math.nan}, NonFiniteLogProbError,
     "adaptive KL: non-finite input at step 1: NaN or +-inf on valid (mask=1) tokens in the old policy log-probs: "
     "non-finite (its sum over the valid tokens)."),
    # tokens -40: target read the step's KL as -5 / max(-40, 1) = -5, not -5 / 3
    ({"tokens": -40.0}, ValueError, "record_sums: batches[0].tokens=-40.0 is invalid: allowed is a finite number >= 0 "
     "(a count, as device_sums computes it)."),
    ({"completions": math.inf}, ValueError, "record_sums: batches[0].completions=inf is invalid: allowed is a finite "
     "number >= 0 (a count, as device_sums computes it)."),
    ({"kl_sq": -1.0}, ValueError, "record_sums: batches[0].kl_sq=-1.0 is invalid: allowed is a number >= 0 (a sum of "
     "squares)."),
    ({"kl": "5"}, ValueError, "record_sums: batches[0].kl='5' is invalid: allowed is a number."),
    # negative log-likelihoods' sum over the 3 valid tokens: +1.5, so +0.5 a token
    ({"policy_logps": 1.5}, ValueError, "adaptive KL: log-probs above 0 at step 1: over its 3 valid (mask=1) tokens: "
     "policy log-probs average +0.5 a token. A log-prob is log p <= 0, so its mean cannot exceed 0.01 (rounding "
     "in any precision stays below that); these look like negative log-likelihoods (-log p, what "
     "F.cross_entropy(..., reduction='none') returns): pass their negation."),
])
def test_an_engines_sums_are_checked_as_a_batch_of_ones_own_and_nothing_kept(change, error, message) -> None:
    """`record_sums`, the door of an engine that gathers its own sums, checked nothing: sums `record` refuses (a
    non-finite log-prob) or `load_state_dict` refuses (a negative or non-finite count) were kept, and the step moved
    beta from them. Refused now, before anything is kept: the refused step leaves the run as it was."""
    akl = AdaptiveKL(AdaptiveKLConfig(kl_adaptation_method="target", kl_target=0.1), BETA)
    before = akl.state_dict()
    with pytest.raises(error) as raised:
        akl.record_sums([engine_sums(**change)], train=True, completed_steps=1)
    advice = (" Masked positions may hold anything; a valid token's log-prob must be finite in float32, the precision "
              f"the KL is computed in (a float64 beyond 3.4e38 in magnitude is not) ({NONFINITE_ADVICE}).")
    assert str(raised.value) == message + ("" if error is ValueError else advice)
    assert akl.state_dict() == before


def test_an_engines_sums_give_what_record_gives() -> None:
    """The same batch through `kl_loss` (record's door) and through `record_sums`: equal metrics and step KL (k1
    sums -2 and -3 over 3 tokens: the step's KL, last_raw_kl, -5 / 3 per token)."""
    own, engine = (AdaptiveKL(AdaptiveKLConfig(kl_estimator="k1"), BETA) for _ in range(2))
    logps = torch.tensor([[-1.0, -1.0], [-3.0, 0.0]], requires_grad=True)
    _, metrics = own.kl_loss(logps, torch.zeros(2, 2), torch.tensor([[1.0, 1.0], [1.0, 0.0]]))
    own.step()
    (logged,) = engine.record_sums([engine_sums()], train=True, completed_steps=1)
    assert logged == metrics and engine.last_raw_kl == own.last_raw_kl == pytest.approx(-5 / 3)


@pytest.mark.parametrize("completed_steps", [-3, 2.5, True, "1"])
def test_an_engines_step_count_is_an_integer(completed_steps) -> None:
    """completed_steps=-3 was kept, and the checkpoint the run then wrote could not be loaded (load_state_dict refuses
    it); 2.5 the same."""
    akl = AdaptiveKL(None, BETA)
    with pytest.raises(ValueError, match=re.escape(f"completed_steps={completed_steps!r} is invalid: allowed is an "
                                                   "integer >= 0 (the optimizer steps completed with this one)")):
        akl.record_sums([engine_sums()], train=True, completed_steps=completed_steps)
    assert akl.completed_steps == 0
    with pytest.raises(TypeError, match=r"record_sums: batches\[0\] must be a KLStatistics, not dict"):
        akl.record_sums([{"kl": 1.0}], train=True, completed_steps=1)


@pytest.mark.parametrize("train", ["no", None, 1])
def test_train_is_true_or_false_at_every_door(train) -> None:
    """train="no" trained (a truthy string), None passed as an evaluation batch: both silently. Each public door that
    takes it refuses anything but a bool, naming it."""
    message = re.escape(f"train={train!r} is invalid: allowed is True (a training batch, which the next step reads) "
                        "or False (an evaluation batch).")
    logps, ref = batch()
    with pytest.raises(ValueError, match=message):
        AdaptiveKL(None, BETA).kl_loss(logps, ref, MASK, train=train)
    with pytest.raises(ValueError, match=message):
        AdaptiveKL(AdaptiveKLConfig(kl_placement="reward"), BETA).reward_penalty(logps, ref, MASK, train=train)
    with pytest.raises(ValueError, match=message):
        AdaptiveKL(None, BETA).record_sums([engine_sums()], train=train, completed_steps=1)


@pytest.mark.parametrize("gather", [5, "accelerator.gather"])
def test_gather_is_a_callable_or_none_at_every_door(gather) -> None:
    """A process group or a number handed as `gather` failed inside the statistics ("'int' object is not
    callable"), naming nothing the loop passed: both loop doors name it, and what it must be, before the step's sums
    move."""
    message = re.escape(f"gather={gather!r} is invalid: allowed is a callable that all-gathers a tensor over "
                        "processes along dim 0 (e.g. accelerator.gather), or None (this process alone).")
    logps, ref = batch()
    loss_kl, reward_kl = AdaptiveKL(None, BETA), AdaptiveKL(AdaptiveKLConfig(kl_placement="reward"), BETA)
    with pytest.raises(ValueError, match=message):
        loss_kl.kl_loss(logps, ref, MASK, gather=gather)
    with pytest.raises(ValueError, match=message):
        reward_kl.reward_penalty(logps, ref, MASK, gather=gather)
    assert loss_kl.last_metrics == {} and reward_kl.last_metrics == {}


def test_a_step_without_a_valid_token_keeps_the_last_kl() -> None:
    """A KL-triggered reference sync reads `last_raw_kl`: a step that trained on no valid token has no KL, and leaves
    the last one (k3 of r = 1: e - 2) where it was rather than NaN (which would skip the sync silently)."""
    akl = AdaptiveKL(None, BETA)
    akl.kl_loss(torch.tensor([[-1.0, -1.0]]), torch.zeros(1, 2), torch.ones(1, 2))
    akl.step()
    akl.kl_loss(torch.tensor([[-1.0, -1.0]]), torch.zeros(1, 2), torch.zeros(1, 2))
    akl.step()
    assert akl.last_raw_kl == pytest.approx(math.e - 2, rel=1e-6)


def test_a_step_that_holds_beta_for_want_of_its_input_says_so() -> None:
    """`dynamic` before any mean reward, and `target` (the KL in the loss) with no valid token trained on since the
    last step, would keep beta without a word: the first such step warns, naming it and the call that feeds it, at
    every door (`step`, and `record_sums` where an engine gathers its own sums); `target` with the KL in the reward
    before any training batch was scored too. A step that has its input, or a later
    pass over the same batch (mean_reward None), or the KL in the reward between scored batches (mu passes over one),
    holds or moves silently as documented."""
    dynamic = AdaptiveKL(AdaptiveKLConfig(kl_adaptation_method="dynamic"), BETA)
    with pytest.warns(UserWarning, match=r"beta holds at step 1: no mean reward has been passed: dynamic decays "
                                         r"beta from each new generation batch's mean reward, step\(mean_reward"):
        assert dynamic.step() == BETA
    target = AdaptiveKL(AdaptiveKLConfig(kl_adaptation_method="target", kl_target=0.1, kl_horizon=8.0), BETA)
    target.kl_loss(*batch(), MASK, train=False)  # an evaluation batch feeds no step
    with pytest.warns(UserWarning, match=r"beta holds at step 1: target moves beta from the KL of the valid tokens"):
        assert target.step() == BETA
    masked = AdaptiveKL(AdaptiveKLConfig(kl_adaptation_method="target", kl_target=0.1, kl_horizon=8.0), BETA)
    masked.kl_loss(torch.tensor([[-1.0, -1.0]]), torch.zeros(1, 2), torch.zeros(1, 2))  # no valid token
    with pytest.warns(UserWarning, match="beta holds at step 1: target moves"):
        masked.step()
    with warnings.catch_warnings():  # said once a run: a loop that never feeds it is not told every step
        warnings.simplefilter("error")
        assert masked.step() == BETA
    engine = AdaptiveKL(AdaptiveKLConfig(kl_adaptation_method="dynamic"), BETA)  # a door that gathers its own sums
    with pytest.warns(UserWarning, match="beta holds at step 1: no mean reward has been passed"):
        engine.record_sums([], train=True, completed_steps=1)
    unscored = AdaptiveKL(AdaptiveKLConfig(kl_adaptation_method="target", kl_placement="reward"), BETA)
    unscored.reward_penalty(*batch(), MASK, train=False)  # the KL in the reward, no training batch scored
    held = (r"beta holds at step 1: target moves beta from the KL of the valid tokens of the generation batch scored "
            r"for the step, and no training reward_penalty has scored one")
    with pytest.warns(UserWarning, match=held):
        assert unscored.step() == BETA  # ccb0d5c: silent, where the loss placement warns
    empty = AdaptiveKL(AdaptiveKLConfig(kl_adaptation_method="target", kl_placement="reward"), BETA)
    empty.reward_penalty(torch.tensor([[-1.0, -1.0]]), torch.zeros(1, 2), torch.zeros(1, 2))  # scored: no valid token
    with pytest.warns(UserWarning, match=held):
        assert empty.step() == BETA  # the step that holds says so, not a later one
    in_reward = AdaptiveKL(AdaptiveKLConfig(kl_adaptation_method="target", kl_placement="reward"), BETA)
    in_reward.reward_penalty(*batch(), MASK)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert dynamic.step(mean_reward=0.95) == pytest.approx(BETA * 0.9) and dynamic.step() == pytest.approx(
            BETA * 0.9)  # the second pass over the same batch: no reward, no decay, no warning
        target.kl_loss(*batch(), MASK)
        assert target.step() != BETA
        assert in_reward.step() != BETA and in_reward.step() == in_reward.current_beta  # mu = 2: one scored batch


def _own_loop(akl: AdaptiveKL, optimizers: list, script: str) -> list[str]:
    """A loop of your own on a (3, 4) policy table, one character at a time: "b" a training batch (kl_loss and its
    backward, or with the KL in the reward reward_penalty), "o" every optimizer's step(), "a" akl.step(mean_reward=0.9);
    the warnings it gave."""
    logits = optimizers[0].param_groups[0]["params"][0]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for call in script:
            logps = torch.log_softmax(logits, dim=-1)
            if call == "b" and akl.config.kl_in_reward:
                akl.reward_penalty(logps.detach(), batch()[1], MASK)
                logps.sum().backward()
            elif call == "b":
                akl.kl_loss(logps, batch()[1], MASK)[0].backward()
            for optimizer in optimizers if call == "o" else []:
                optimizer.step()
                optimizer.zero_grad()
            if call == "a":
                akl.step(mean_reward=0.9)
    return [str(warning.message) for warning in caught]


def test_a_loop_of_your_own_that_never_calls_step_is_told_beta_holds() -> None:
    """A loop that never calls `akl.step()` trains on with beta where it started: the second training batch since the
    last `step()` (or the first training batch) that an optimizer step came before says so, naming the optimizer.
    akl.step() before or after optimizer.step(), accumulation, two optimizers, an optimizer stepped several times per
    step (ZeRO-3's sub-groups), a constant beta: silent. The watch goes with the object."""
    def fresh(method: str = "dynamic", placement: str = "loss") -> AdaptiveKL:
        return AdaptiveKL(AdaptiveKLConfig(kl_adaptation_method=method, kl_placement=placement), BETA)

    def table(kind=torch.optim.AdamW) -> torch.optim.Optimizer:
        return kind([torch.zeros(3, 4, requires_grad=True)], lr=0.1)

    never = (r"adaptive KL: beta holds at step 1: AdamW has stepped twice since the first training {door}, and no "
             r"akl.step\(\): {kind} moves beta in akl.step\(\) alone, once per optimizer step \(call "
             r"akl.step\(mean_reward=...\) after each optimizer.step\(\)\).")
    forgot, optimizer = fresh(), [table()]
    assert _own_loop(forgot, optimizer, "bobo") == []  # one step may come before akl.step()
    (printed,) = _own_loop(forgot, optimizer, "b")  # a second step has passed between batches
    assert re.fullmatch(never.format(door="kl_loss", kind="dynamic"), printed)
    assert forgot.current_beta == BETA and _own_loop(forgot, optimizer, "bobob") == []  # said once a run
    (printed,) = _own_loop(fresh("target", "reward"), [table()], "bobob")
    assert re.fullmatch(never.format(door="reward_penalty", kind="target"), printed)
    for script in ("boa" * 4, "bao" * 4, "bbboa" * 4, "booooa" * 4):
        akl = fresh()
        assert _own_loop(akl, [table()], script) == [], script
        assert akl.current_beta == pytest.approx(BETA * 0.9 ** script.count("a"), rel=1e-12)
    assert _own_loop(fresh(), [table(), table(torch.optim.SGD)], "boa" * 4) == []  # each steps once a step
    assert _own_loop(fresh("clip"), [table()], "bo" * 4) == []  # a constant beta: nothing held
    later, optimizer = fresh(), [table(torch.optim.SGD)]
    assert _own_loop(later, optimizer, "boabob") == []  # the step before akl.step() is that step's
    (printed,) = _own_loop(later, optimizer, "ob")
    assert printed.startswith("adaptive KL: beta holds at step 2: SGD has stepped twice since the last akl.step(): ")
    from torch.optim.optimizer import _global_optimizer_post_hooks as hooks

    # a copy taken after the watch started has no hook of its own: it watches from its own first batch (the copy of
    # the flag said it watched, and a copy's loop that forgot akl.step() was never told)
    copied = copy.deepcopy(fresh())
    assert _own_loop(copied, [table()], "bo") == []
    copied = copy.deepcopy(copied)
    (printed,) = _own_loop(copied, [table()], "bobob")
    assert re.fullmatch(never.format(door="kl_loss", kind="dynamic"), printed)
    before = len(hooks)
    del later, forgot, copied
    assert len(hooks) == before - 3  # the watch goes with the object


def test_a_loop_that_steps_akl_more_often_than_its_optimizer_is_told() -> None:
    """akl.step() after every micro-batch decayed `dynamic` once per micro-batch (2 micro-batches x 4 optimizer
    steps: 0.9^8 for 0.9^4) without a word. More than one step() between one optimizer step and the next, three times
    in a row, says so, once a run, naming each count (read at the step() after the optimizer stepped, which starts the
    next count). Not told: optimizer steps skipped now and then (fp16's GradScaler skips one on an overflow, several
    at a run's start: they make one interval, the next ones are one call each), akl.step() before optimizer.step(),
    and a loop with no torch optimizer stepping (a remote one, as Tinker's)."""
    def table() -> list[torch.optim.Optimizer]:
        return [torch.optim.AdamW([torch.zeros(3, 4, requires_grad=True)], lr=0.1)]

    def fresh() -> AdaptiveKL:
        return AdaptiveKL(AdaptiveKLConfig(kl_adaptation_method="dynamic"), BETA)

    akl = fresh()
    (printed,) = _own_loop(akl, table(), "babao" * 4)  # step() per micro-batch, then the optimizer's
    assert printed == ("adaptive KL: akl.step() ran 2, 2 and 2 times between one optimizer step and the next, 3 times "
                       "in a row: dynamic moves beta at each akl.step() (call it once per optimizer.step(), not per "
                       "micro-batch or pass).")
    assert akl.current_beta == pytest.approx(BETA * 0.9 ** 8)  # what it warns of: one decay per micro-batch
    assert _own_loop(akl, table(), "babao" * 4) == []  # said once a run
    (printed,) = _own_loop(fresh(), table(), "babao" + "bababao" + "babao" + "b" + "a")  # each interval's own count
    assert "ran 2, 3 and 2 times between one optimizer step and the next" in printed
    assert _own_loop(fresh(), table(), "babao" * 3) == []  # the third count is read at the next step()
    for script in ("babao" * 2 + "bao" * 4,  # two intervals in a row: not yet three
                   "ba" * 4 + "boa" * 4,  # skipped steps at the start, then one call per optimizer step
                   "boa" * 3 + "bababoa" + "boa" * 3 + "bababoa" + "boa",  # one skipped step now and then
                   "bao" * 4, "boa" * 4, "bbboa" * 4, "booooa" * 4, "ba" * 6):
        assert _own_loop(fresh(), table(), script) == [], script


@pytest.mark.parametrize("door", ["kl_loss", "reward_penalty", "step"])
def test_a_setting_changed_after_the_run_started_is_refused_at_the_next_door(door: str) -> None:
    """kl_clip_threshold set to -1 after the object was built (validated: 1.0) would clip every token's KL to -1 and
    flip the term's sign; dynamic's reward_threshold set to 0.5 would be read by no controller (it keeps 0.9); the
    other placement would be refused by the door as a wrong call, not as the change it is. Each door names the field,
    both values and how to change it; the same value set again is no change."""
    placement = "reward" if door == "reward_penalty" else "loss"
    config = AdaptiveKLConfig(kl_adaptation_method="clip+dynamic", kl_clip_threshold=1.0, reward_threshold=0.9,
                              kl_placement=placement)
    akl = AdaptiveKL(config, BETA, "bnpo")
    logps, ref = batch(requires_grad=False)
    call = {"kl_loss": lambda: akl.kl_loss(logps, ref, MASK), "step": lambda: akl.step(mean_reward=1.0),
            "reward_penalty": lambda: akl.reward_penalty(logps, ref, MASK)}[door]
    config.kl_clip_threshold = 1  # equal to 1.0: no change
    call()
    other = "loss" if placement == "reward" else "reward"
    for name, value, was in (("kl_clip_threshold", -1.0, 1.0), ("reward_threshold", 0.5, 0.9),
                             ("kl_placement", other, placement)):
        setattr(config, name, value)
        with pytest.raises(ValueError, match=rf"^{name} changed from {was!r} to {value!r} after the run started: .* "
                                             r"new\.load_state_dict\(old\.state_dict\(\)\)\.$"):
            call()
        setattr(config, name, was)
    call()


@pytest.mark.parametrize("name, value, was", [("beta", 0.0, BETA), ("loss_type", "dr_grpo", "bnpo"),
                                              ("num_iterations", 2, 1)])
def test_what_the_object_was_built_with_besides_its_config_is_fixed(name: str, value, was) -> None:
    """`akl.beta = 0.0` after the object was built changed nothing (the controller holds beta_t: the term stayed
    0.04 x KL), and a new loss_type was used unchecked (dr_grpo then asked for a divisor): setting either, or
    num_iterations, raises naming the value it keeps and the way to change it; the object is unchanged."""
    akl = AdaptiveKL(None, BETA, "bnpo")
    with pytest.raises(AttributeError, match=rf"^AdaptiveKL\.{name} is {was!r}, fixed when the run's AdaptiveKL was "
                                             rf"built: to train with {name}={value!r}, build a new AdaptiveKL with it "):
        setattr(akl, name, value)
    assert getattr(akl, name) == was
    akl.completed_steps = 3  # the object's own state is not fixed
    with pytest.raises(ValueError, match=r"^beta=None is invalid: allowed is a finite number >= 0\.$"):
        AdaptiveKL(None, None)  # was float()'s TypeError


def test_a_new_setting_between_steps_carries_the_run_over_through_the_state() -> None:
    """What the refusal above advises: dynamic at reward_threshold 0.8 decays 0.04 -> 0.02 on a mean reward of 0.9;
    a new AdaptiveKL at reward_threshold 0.95 that loads the state starts at 0.02, step 1, and holds on 0.9 where the
    old one would have decayed to 0.01, then decays on 0.99 to 0.01."""
    old = AdaptiveKL(AdaptiveKLConfig(kl_adaptation_method="dynamic", reward_threshold=0.8, dynamic_beta_decay=0.5),
                     BETA)
    assert old.step(mean_reward=0.9) == pytest.approx(0.02)
    new = AdaptiveKL(AdaptiveKLConfig(kl_adaptation_method="dynamic", reward_threshold=0.95, dynamic_beta_decay=0.5),
                     BETA)
    new.load_state_dict(old.state_dict())
    assert (new.current_beta, new.completed_steps) == (pytest.approx(0.02), 1)
    assert [new.step(mean_reward=0.9), new.step(mean_reward=0.99)] == pytest.approx([0.02, 0.01])
    assert new.completed_steps == 3


def test_target_never_moves_beta_above_beta_max() -> None:
    """A KL far above kl_target raises beta by at most 20 % * n / kl_horizon an update; beta_max caps it: 0.04 with
    n = 3 and kl_horizon = 3 would reach 0.048, 0.0576, ..., and stops at 0.05."""
    akl = AdaptiveKL(AdaptiveKLConfig(kl_adaptation_method="target", kl_target=1e-3, kl_horizon=3.0, beta_max=0.05),
                     BETA)
    betas = []
    for _ in range(3):
        akl.kl_loss(*batch(), MASK)
        betas.append(akl.step())
    assert betas == pytest.approx([0.048, 0.05, 0.05])


@pytest.mark.parametrize("value", [torch.tensor(0), torch.tensor(-4.0), torch.tensor(math.nan),
                                   torch.tensor(math.inf)])
def test_a_tensor_normaliser_that_is_not_positive_is_refused_as_a_number_is(value: torch.Tensor) -> None:
    """A loop's own count as a tensor: -4 would flip the term's sign (the loss would reward KL), 0 and NaN blow it up."""
    logps, ref = batch()
    with pytest.raises(ValueError) as raised:
        AdaptiveKL(None, BETA, "dapo").kl_loss(logps, ref, MASK, token_normalizer=value)
    assert str(raised.value) == (f"token_normalizer={value.item()!r} is invalid: allowed is a finite number > 0, or "
                                 "None where the loss_type does not need it.")
    with pytest.raises(ValueError, match=r"^token_normalizer is invalid: a tensor of shape \(3,\); allowed is one"):
        AdaptiveKL(None, BETA, "dapo").kl_loss(logps, ref, MASK, token_normalizer=LENGTHS)
    term, _ = AdaptiveKL(None, BETA, "dapo").kl_loss(logps, ref, MASK, token_normalizer=torch.tensor(7))
    want = BETA * (k3_by_hand(exact(logps), exact(ref)).sum() / 7)
    assert_float32_close(term.item(), want.item(), BETA * (k3_magnitude(logps, ref) * MASK).sum() / 7, 13)


def test_a_divisor_no_reduction_reads_warns_and_one_read_does_not() -> None:
    """A dapo loop that forgot `loss_type='dapo'` (the default is grpo) hands over its token count, which grpo's
    sequence mean never reads: the KL term is mean_i S_i / L_i, not sum_i S_i / 7. That says so, naming the field,
    the loss types that read it and the reductions in effect; a divisor one of them reads (dapo's normaliser for its
    raw KL under length normalisation, dr_grpo's length) or a registered reduction (which may read either) is quiet."""
    logps, ref = batch()
    with pytest.warns(UserWarning) as caught:
        term, _ = AdaptiveKL(None, BETA).kl_loss(logps, ref, MASK, token_normalizer=7.0)
    assert [str(warning.message) for warning in caught] == [
        "token_normalizer has no effect: only loss_type dapo, cispo or vespo reads it, and loss_type='grpo' reduces "
        "the loss by sequence_mean. Leave it None, or declare the loss type your loss reduces as "
        "(AdaptiveKL(..., loss_type=...))."]
    k = k3_by_hand(exact(logps), exact(ref))
    magnitude = BETA * ((k3_magnitude(logps, ref) * MASK).sum(-1) / LENGTHS).mean()
    assert_float32_close(term.item(), BETA * (k.sum(-1) / LENGTHS).mean().item(), magnitude, 12)
    with pytest.warns(UserWarning, match=r"^max_completion_length has no effect: only loss_type dr_grpo reads it, "
                                         r"and loss_type='dapo' reduces the loss by token_sum_normalized and the KL "
                                         r"by token_mean\."):
        AdaptiveKL(AdaptiveKLConfig(kl_reduction="token_mean"), BETA, "dapo").kl_loss(
            logps, ref, MASK, max_completion_length=4, token_normalizer=7.0)
    with warnings.catch_warnings(record=True) as caught:  # a loop's count per batch: one message, whatever it is
        warnings.simplefilter("default")
        for count in (torch.tensor(7), 6.0, 5.0, torch.tensor(4.0)):  # a number's value was in it: one per count
            AdaptiveKL(None, BETA).kl_loss(logps, ref, MASK, token_normalizer=count)
    assert [str(warning.message)[:60] for warning in caught] == [
        "token_normalizer has no effect: only loss_type dapo, cispo o"]
    quiet = [(AdaptiveKLConfig(kl_adaptation_method="length_normalized"), "dapo", {"token_normalizer": 7.0}),
             (None, "dr_grpo", {"max_completion_length": 4})]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for config, loss_type, divisors in quiet:
            AdaptiveKL(config, BETA, loss_type).kl_loss(logps, ref, MASK, **divisors)


def test_a_mask_that_is_not_zeros_and_ones_is_refused() -> None:
    """A per-token weight handed over as the mask would count each nonzero entry as one whole token (the KL of a
    token weighted 0.5 counted in full): refused, naming how many entries and one of them; float, integer and bool
    masks of 0 and 1 pass."""
    logps, ref = batch()
    weights = MASK.clone()
    weights[0, 1], weights[2, 0] = 0.5, 2.0
    with pytest.raises(ValueError) as raised:
        AdaptiveKL(None, BETA).kl_loss(logps, ref, weights)
    assert str(raised.value) == ("mask must hold 0 and 1 only (1 on each completion's tokens, 0 on padding): 2 entries "
                                 "are neither, e.g. 0.5. A per-token weight is not a mask: each nonzero entry would "
                                 "count as one whole token.")
    with pytest.raises(ValueError, match="^mask must hold 0 and 1 only"):
        AdaptiveKL(AdaptiveKLConfig(kl_placement="reward"), BETA).reward_penalty(logps, ref, weights)
    terms = [AdaptiveKL(None, BETA).kl_loss(logps, ref, mask)[0] for mask in (MASK, MASK.long(), MASK.bool())]
    assert terms[0].item() == terms[1].item() == terms[2].item()


@pytest.mark.parametrize(("logps", "ref", "mask"), [
    ((3, 4), (3, 4), (3, 1)),  # a mask per completion: every completion would count one token
    ((3, 4), (3, 1), (3, 4)),  # one reference log-prob per completion, broadcast
    ((3, 4), (3, 4), (3,)),  # lengths instead of a mask
    ((4,), (4,), (4,)),  # one completion without its batch dimension
])
def test_a_batch_whose_shapes_would_broadcast_is_refused_naming_each_shape(logps, ref, mask) -> None:
    shapes = {"logps": logps, "ref_logps": ref, "mask": mask}
    expected = ", ".join(f"{name} {shape}" for name, shape in shapes.items())
    for placement, door in (("loss", "kl_loss"), ("reward", "reward_penalty")):
        akl = AdaptiveKL(AdaptiveKLConfig(kl_placement=placement), BETA)
        with pytest.raises(ValueError) as raised:
            getattr(akl, door)(*(torch.zeros(shape) - 1 for shape in shapes.values()))
        assert str(raised.value) == ("logps, ref_logps, mask must be (B, T) tensors of one shape (B >= 1 "
                                     "completions, T completion tokens; mask 1 on each completion's tokens, 0 on "
                                     f"padding): got {expected}.")


def test_the_kl_gradient_reaches_the_policy_alone() -> None:
    """A reference whose forward kept its graph (a loop's own, without torch.no_grad) gets no gradient from the KL
    term, and the policy's gradient is the one of a detached reference: k3's d/dlogp = 1 - exp(ref - logp), by hand."""
    logps, ref = batch()
    ref = ref.clone().requires_grad_(True)
    term, _ = AdaptiveKL(AdaptiveKLConfig(kl_adaptation_method="clip", kl_clip_threshold=100.0), BETA).kl_loss(
        logps, ref, MASK)
    term.backward()
    assert ref.grad is None
    weights = BETA * MASK / LENGTHS[:, None] / 3  # grpo: the mean over 3 completions of each one's sum / L_i
    by_hand = weights.double() * (1 - (exact(ref) - exact(logps)).exp())
    assert_float32_close(logps.grad, by_hand, weights * k3_gradient_magnitude(logps, ref), 7)


@pytest.mark.parametrize("mean_reward", [math.nan, math.inf])
def test_a_mean_reward_that_is_not_finite_is_refused(mean_reward: float) -> None:
    """`dynamic` compares it with reward_threshold: NaN would never decay beta, +inf always, silently. Refused at
    `step` and at `observe_rewards`, which the trainer hooks and verl's controllers call (on ccb0d5c they took it)."""
    akl = AdaptiveKL(AdaptiveKLConfig(kl_adaptation_method="dynamic", reward_threshold=0.0), BETA)
    with pytest.raises(ValueError) as raised:
        akl.step(mean_reward=mean_reward)
    assert str(raised.value) == (f"mean_reward={mean_reward!r} is invalid: allowed is a finite number (the batch's mean "
                                 "reward), or None where the step scored no new generation batch.")
    with pytest.raises(ValueError, match=r"^mean_reward=(nan|inf) is invalid"):  # the trainers' and verl's door
        akl.observe_rewards(mean_reward)
    assert akl.controller.generation_batch == 0
    assert akl.step(mean_reward=torch.tensor(0.5)) == pytest.approx(BETA * 0.9)  # a tensor is a number


def test_beta_zero_with_an_adapted_setting_warns_that_it_has_no_effect() -> None:
    with pytest.warns(UserWarning) as caught:
        AdaptiveKL(AdaptiveKLConfig(kl_adaptation_method="clip+dynamic"), 0.0)
    assert [str(w.message) for w in caught] == [
        "kl_adaptation_method='clip+dynamic' has no effect: beta=0.0 turns the KL term off. Set beta > 0 to regularise."]
    with pytest.warns(UserWarning) as caught:  # the fields the user set, not the method left at 'none'
        AdaptiveKL(AdaptiveKLConfig(kl_estimator="k2", kl_reduction="token_mean"), 0.0)
    assert [str(w.message) for w in caught] == [
        "kl_estimator='k2', kl_reduction='token_mean' have no effect: beta=0.0 turns the KL term off. Set beta > 0 to "
        "regularise."]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        AdaptiveKL(None, 0.0)  # stock: nothing to say


UNREAD = ". Leave it at its default, or choose a setting that reads it."


def test_a_field_that_no_setting_in_effect_reads_warns_naming_it() -> None:
    """Nothing silently does nothing: a field set away from its default that no method or estimator in effect reads
    warns, at the config and again at `AdaptiveKL`, naming the field, its value and what reads it."""
    cases = {
        "kl_clip_threshold=0.5 has no effect: only kl_adaptation_method clip reads it, and kl_adaptation_method="
        "'sigmoid' does not include it": dict(kl_adaptation_method="sigmoid", kl_clip_threshold=0.5),
        "kl_target=0.2 has no effect: only kl_adaptation_method sigmoid or target reads it, and kl_adaptation_method="
        "'none' includes neither": dict(kl_target=0.2),
        "kl_percentile=0.5 has no effect: only kl_estimator 'k3_bottom_percentile' reads it, and the estimator in "
        "effect is 'k1'": dict(kl_placement="reward", kl_percentile=0.5),
    }
    for message, settings in cases.items():
        with pytest.warns(UserWarning) as caught:
            AdaptiveKL(AdaptiveKLConfig(**settings), BETA)
        assert [str(w.message) for w in caught] == [message + UNREAD] * 2
    with pytest.warns(UserWarning) as caught:  # every unread field, in declaration order
        AdaptiveKLConfig(kl_adaptation_method="dynamic", reward_threshold=0.5, kl_horizon=50.0, beta_max=0.1)
    assert [str(w.message).split(" has")[0] for w in caught] == ["kl_horizon=50.0", "beta_max=0.1"]


def own_k1(logp: torch.Tensor, ref: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (logp - ref) * mask


register_kl_estimator("test_scaled_k3")(
    lambda logp, ref, mask, config: config.kl_clip_threshold * (torch.exp(ref - logp) - (ref - logp) - 1) * mask)


@pytest.mark.parametrize(("settings", "message"), [
    (dict(kl_adaptation_method="dynamic", beta_min=BETA),
     f"kl_adaptation_method dynamic cannot move beta: it lowers beta, down to beta_min={BETA}, which is beta={BETA}. "
     "Set beta_min < beta for beta to decay."),
    (dict(kl_adaptation_method="dynamic", dynamic_beta_decay=1.0, beta_schedule_steps=None),
     "kl_adaptation_method dynamic cannot move beta: dynamic_beta_decay=1.0 multiplies it by 1 after a rewarded step, "
     "and beta_schedule_steps=None sets no cut-off. Set dynamic_beta_decay < 1 for beta to decay."),
    (dict(kl_adaptation_method="dynamic", dynamic_beta_decay=1.0, reward_threshold=0.5),
     "reward_threshold=0.5 has no effect: dynamic_beta_decay=1.0 leaves beta where it is after a rewarded step (beta "
     "moves only at beta_schedule_steps=1000, to beta_min). Set dynamic_beta_decay < 1 for the reward to decay beta."),
    (dict(kl_adaptation_method="target", beta_min=BETA, beta_max=BETA),
     f"kl_adaptation_method target cannot move beta: beta_min = beta_max = {BETA} is the one value it may take. Set "
     "beta_min < beta_max for beta to follow kl_target."),
], ids=["dynamic floor at beta", "dynamic decay 1", "reward threshold unread", "target bounds at beta"])
def test_a_controller_that_cannot_move_beta_is_said(settings: dict, message: str) -> None:
    """Each held beta where it was for the whole run, silently: its method and fields did nothing (by hand below, a
    rewarded step and a KL far above target leave it at BETA). Said as an unread field is: by the config and again by
    AdaptiveKL, which knows beta (the config alone does not: the floor at beta is said once)."""
    with pytest.warns(UserWarning) as caught:
        akl = AdaptiveKL(AdaptiveKLConfig(**settings), BETA)
    assert [str(w.message) for w in caught] == [message] * (1 if "beta_max" not in settings and "beta_min" in settings
                                                            else 2)
    logps, ref = batch()
    akl.kl_loss(logps, ref, MASK)
    assert akl.step(mean_reward=1.0) == BETA


@pytest.mark.parametrize("settings", [
    dict(kl_adaptation_method="dynamic", dynamic_beta_decay=1.0),  # moves at the cut-off: reward_threshold at default
    dict(kl_adaptation_method="target", beta_min=BETA),  # may rise
    dict(kl_adaptation_method="dynamic", beta_min=0.0),
])
def test_a_controller_that_can_move_beta_says_nothing(settings: dict) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        AdaptiveKL(AdaptiveKLConfig(**settings), BETA)


@pytest.mark.parametrize("estimator", [own_k1, "test_least_confident_half"], ids=["callable", "registered"])
def test_an_estimator_of_ones_own_that_receives_no_config_leaves_the_fields_unread_said(estimator) -> None:
    """A callable estimator, or one registered without a config parameter, is handed the log-probs alone: with it,
    kl_clip_threshold under sigmoid and kl_percentile did nothing, and no field was said unread (any estimator but
    the built-in ones counted as reading every field). One registered with the config may read any: nothing said."""
    with pytest.warns(UserWarning) as caught:
        AdaptiveKLConfig(kl_adaptation_method="sigmoid", kl_estimator=estimator, kl_clip_threshold=0.5,
                         kl_percentile=0.5)
    named = "own_k1" if callable(estimator) else repr(estimator)
    assert [str(w.message) for w in caught] == [
        "kl_clip_threshold=0.5 has no effect: only kl_adaptation_method clip reads it, and kl_adaptation_method="
        "'sigmoid' does not include it" + UNREAD,
        "kl_percentile=0.5 has no effect: only kl_estimator 'k3_bottom_percentile' reads it, and the estimator in "
        f"effect is {named}" + UNREAD]


@pytest.mark.parametrize("settings", [
    dict(kl_adaptation_method="clip", kl_clip_threshold=0.5),
    dict(kl_adaptation_method="target", kl_target=0.2, beta_min=0.01, kl_horizon=50.0, beta_max=0.1),
    dict(kl_adaptation_method="sigmoid+dynamic", kl_target=0.2, beta_schedule_steps=None, dynamic_beta_decay=0.5),
    dict(kl_estimator="k3_bottom_percentile", kl_percentile=0.5, kl_percentile_scale=2.0),
    dict(kl_estimator="test_scaled_k3", kl_clip_threshold=0.5),  # it receives the config: it may read any field
    dict(kl_target=0.1, kl_clip_threshold=1.0),  # the defaults, spelled out
], ids=["clip", "target", "sigmoid+dynamic", "percentile", "registered with the config", "defaults"])
def test_a_field_a_setting_in_effect_reads_says_nothing(settings: dict) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        AdaptiveKL(AdaptiveKLConfig(**settings), BETA)


@pytest.mark.parametrize("threshold", [0.7, 0.8])
def test_dynamic_does_not_decay_at_a_mean_reward_equal_to_its_threshold(threshold: float) -> None:
    """`r > reward_threshold`, in float32 as trainers average: float32(0.7) is 0.699999988, below the float 0.7,
    and float32(0.8) is 0.800000012, above 0.8; neither mean decays beta, a mean one float32 step above does."""
    akl = AdaptiveKL(AdaptiveKLConfig(kl_adaptation_method="dynamic", reward_threshold=threshold), BETA)
    above = torch.nextafter(torch.tensor(threshold, dtype=torch.float32), torch.tensor(2.0)).item()
    assert [akl.step(mean_reward=threshold), akl.step(mean_reward=torch.tensor(threshold).item()),
            akl.step(mean_reward=above)] == [BETA, BETA, BETA * 0.9]


def test_config_errors_are_the_grpo_config_messages() -> None:
    with pytest.raises(ValueError, match=r"^kl_clip_threshold=-1 is invalid: allowed is a finite number > 0\.$"):
        AdaptiveKLConfig(kl_clip_threshold=-1)


def least_confident_k3(logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """k3 on the valid tokens whose reference log-prob is in the lowest 50 %, x 2; 0 elsewhere."""
    r = ref_logp - logp
    valid = ref_logp.masked_fill(mask == 0, math.inf)
    threshold = valid.flatten().kthvalue(max(1, int(mask.sum().item() * 0.5))).values
    return (torch.exp(r) - r - 1) * (ref_logp <= threshold) * mask * 2.0


register_kl_estimator("test_least_confident_half")(least_confident_k3)


def test_a_registered_estimator_is_used_by_name() -> None:
    """The registered estimator runs on the core's float32 inputs; against its exact value (the selection of tokens
    is the same: ordering survives the conversion to float64) in 12 operations (k3's 5, the 6 additions over 7
    tokens and the division, beta; x 2 is exact)."""
    logps, ref = batch()
    akl = AdaptiveKL(AdaptiveKLConfig(kl_estimator="test_least_confident_half"), BETA, "bnpo")
    term, _ = akl.kl_loss(logps, ref, MASK)
    want = BETA * least_confident_k3(exact(logps), exact(ref), MASK).sum() / LENGTHS.sum()
    selected = least_confident_k3(exact(logps), exact(ref), MASK) != 0
    assert_float32_close(term.item(), want.item(), BETA * (2 * k3_magnitude(logps, ref) * selected).sum() / 7, 12)
    assert 0 < term.item() < AdaptiveKL(None, BETA, "bnpo").kl_loss(logps, ref, MASK)[0].item()


def test_registering_names_is_checked() -> None:
    with pytest.raises(ValueError, match=r"register_kl_estimator\('k3'\): allowed is a new, non-empty name "
                                         r"without surrounding spaces, other than 'None' \(registered: k1, k2, k3, "):
        register_kl_estimator("k3")
    with pytest.raises(ValueError, match=r"kl_estimator='k4' is invalid: allowed is None \(the placement's default\), one of k1, k2, k3, .*"
                                         r"test_least_confident_half(, [^ ]+)* \(register your own with register_kl_estimator\), or a callable"):
        AdaptiveKLConfig(kl_estimator="k4")
    assert "test_least_confident_half" in estimator_names()


def test_an_estimators_signature_decides_what_it_is_given() -> None:
    """The config goes to a 4th positional parameter only: a keyword-only option or **kwargs was counted as one, and
    `fn(logp, ref, mask, config)` raised a bare TypeError when the run was built. A function that cannot take the
    three tensors is refused where it is named (registered, or given as kl_estimator); one whose 4th parameter meant
    something else fails the build's probe naming the field and the config it was given."""
    def eps_k2(logp, ref_logp, mask, *, eps=0.5):
        return 0.5 * (logp - ref_logp) ** 2 + eps * mask

    register_kl_estimator("test_keyword_option")(eps_k2)
    register_kl_estimator("test_kwargs_option")(lambda logp, ref_logp, mask, **options: (logp - ref_logp) * mask)
    logps, ref = batch()
    for name, per_token in [("test_keyword_option", 0.5 * (logps - ref) ** 2 + 0.5),
                            ("test_kwargs_option", logps - ref)]:
        term, _ = AdaptiveKL(AdaptiveKLConfig(kl_estimator=name), 1.0, "bnpo").kl_loss(logps, ref, MASK)
        assert term.item() == pytest.approx((per_token * MASK).sum().item() / LENGTHS.sum().item(), rel=1e-6), name
    with pytest.raises(TypeError, match=r"^register_kl_estimator\('test_two'\): \S*<lambda>\(logp, ref\) cannot be "
                                        r"called with 3 positional arguments \(too many positional arguments\); "
                                        r"allowed is a function of \(logp, ref_logp, mask\), and of a 4th "
                                        r"positional parameter where it reads the AdaptiveKLConfig$"):
        register_kl_estimator("test_two")(lambda logp, ref: logp - ref)
    assert "test_two" not in estimator_names()

    def with_config(logp, ref_logp, mask, config):
        return config.kl_clip_threshold * (logp - ref_logp) * mask

    with pytest.raises(ValueError, match=r"^kl_estimator='.*with_config' is invalid: .*with_config\(logp, ref_logp, "
                                         r"mask, config\) cannot be called with 3 positional arguments \(missing a "
                                         r"required argument: 'config'\); allowed is a callable"):
        AdaptiveKLConfig(kl_estimator=with_config)

    def scaled_k1(logp, ref_logp, mask, scale=2.0):
        return scale * (logp - ref_logp) * mask

    assert AdaptiveKLConfig(kl_estimator=scaled_k1).kl_estimator is scaled_k1  # given, it is called with three
    register_kl_estimator("test_scaled_option")(scaled_k1)  # registered, its 4th parameter is the config's
    with pytest.raises(ValueError, match=r"^kl_estimator='test_scaled_option' raised TypeError: unsupported operand "
                                         r"type\(s\) for \*: 'AdaptiveKLConfig' and 'Tensor' on a \(2, 3\) batch of "
                                         r"log-probs and a mask and the AdaptiveKLConfig as its 4th argument, when "
                                         r"the run was built$"):
        AdaptiveKL(AdaptiveKLConfig(kl_estimator="test_scaled_option"), BETA)


def test_in_the_reward_raw_kl_and_sequence_kl_count_the_same_completions() -> None:
    """A completion without a valid token (a truncation the trainer masks out, a padding sample) is not trained on:
    with the KL in the reward, raw_kl, adapted_kl and reward_penalty average over the completions trained on, as
    sequence_kl does (a probe once gave raw_kl 2.0 against sequence_kl 4.0). By hand: k1 sums 4 and 2 (mean 3)."""
    logps = torch.tensor([[-1.0, -1.0, 0.0], [-1.0, 0.0, 0.0], [-5.0, -5.0, -5.0]])
    ref = torch.tensor([[-3.0, -3.0, 0.0], [-3.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    akl = AdaptiveKL(AdaptiveKLConfig(kl_placement="reward", kl_reduction="sequence_sum"), BETA)
    penalty, metrics = akl.reward_penalty(logps, ref, mask)
    assert penalty.tolist() == pytest.approx([BETA * 4.0, BETA * 2.0, 0.0])
    for name in ("raw_kl", "adapted_kl", "sequence_kl"):
        assert metrics[f"adaptive_kl/{name}"] == pytest.approx(3.0), name
    assert metrics["adaptive_kl/reward_penalty"] == pytest.approx(BETA * 3.0)
    _, empty = akl.reward_penalty(logps, ref, torch.zeros_like(mask))  # nothing trained on: NaN, not an error
    assert math.isnan(empty["adaptive_kl/raw_kl"]) and math.isnan(empty["adaptive_kl/sequence_kl"])


def test_two_processes_with_batches_of_different_sizes_sum_both_by_hand(tmp_path) -> None:
    """The named sums of both processes, not process 0's alone (a gather that kept only its rows passed every other
    test): two gloo processes, 2 and 3 completions, bnpo, `target`. By hand from both batches: raw_kl is the mean of
    the two processes' token means, sequence_kl the mean S_i over all 5 completions, the step's KL the token mean
    over both, and beta_1 = beta_0 (1 + clip(KL / kl_target - 1, +-0.2) * 5 / kl_horizon)."""
    from . import distributed_core as run

    torchrun(Path(run.__file__), str(tmp_path), timeout=300)
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert ranks[0] == ranks[1]
    batches = [run.batch(rank) for rank in (0, 1)]
    token_kl = [((ref - logps).exp() - (ref - logps) - 1).double() * mask for logps, ref, mask in batches]  # k3
    sums = torch.cat([kl.sum(-1) for kl in token_kl])
    tokens = sum(float(mask.sum()) for _, _, mask in batches)
    raw = [float(kl.sum()) / float(mask.sum()) for kl, (_, _, mask) in zip(token_kl, batches)]
    metrics = ranks[0]["metrics"]
    assert metrics["adaptive_kl/raw_kl"] == pytest.approx(sum(raw) / 2, rel=1e-6)
    assert metrics["adaptive_kl/sequence_kl"] == pytest.approx(float(sums.mean()), rel=1e-6)
    assert ranks[0]["last_raw_kl"] == pytest.approx(float(sums.sum()) / tokens, rel=1e-6)
    error = max(min(float(sums.sum()) / tokens / run.CONFIG["kl_target"] - 1, 0.2), -0.2)
    assert ranks[0]["beta"] == pytest.approx(run.BETA * (1 + error * 5 / run.CONFIG["kl_horizon"]), rel=1e-6)
    assert abs(error) < 0.2  # the clamp does not hide the KL
    alone = [float(token_kl[0].sum()) / float(batches[0][2].sum()), float(sums[:2].mean())]  # process 0's alone
    assert abs(metrics["adaptive_kl/raw_kl"] - alone[0]) > 1e-3 and abs(metrics["adaptive_kl/sequence_kl"] - alone[1]) > 1e-3


@pytest.mark.parametrize("shape", [(1,), (1, 1)])
def test_a_token_normaliser_of_one_element_in_any_shape_is_that_number(shape: tuple[int, ...]) -> None:
    """A (1,) count gave a (1,) term, which the metrics read as one KL per completion: raw_kl came out divided by B."""
    logps, ref = batch()
    want, want_metrics = AdaptiveKL(None, BETA, "dapo").kl_loss(logps, ref, MASK, token_normalizer=7.0)
    term, metrics = AdaptiveKL(None, BETA, "dapo").kl_loss(logps, ref, MASK, token_normalizer=torch.full(shape, 7.0))
    assert term.shape == () and term.item() == want.item()
    assert metrics == want_metrics


def test_a_numpy_divisor_is_the_number_it_holds() -> None:
    """A loop that counts its tokens in numpy passes an array: np.array(7.0) (0-d or (1,)) was refused as 'not a
    number' though np.float32(7.0) was taken; each numpy form now gives the term and metrics of the plain number, and
    an array of two counts is refused by its shape, as a tensor's is, and one torch cannot hold (text, objects) by
    name (the conversion raised torch's TypeError)."""
    logps, ref = batch()
    for loss_type, field, number, forms in (
            ("dapo", "token_normalizer", 7.0, (np.array(7.0), np.array([7.0]), np.float32(7.0), np.int64(7))),
            ("dr_grpo", "max_completion_length", 8, (np.array(8), np.array([8]), np.int64(8)))):
        want, want_metrics = AdaptiveKL(None, BETA, loss_type).kl_loss(logps, ref, MASK, **{field: number})
        for form in forms:
            term, metrics = AdaptiveKL(None, BETA, loss_type).kl_loss(logps, ref, MASK, **{field: form})
            assert term.shape == () and term.item() == want.item() and metrics == want_metrics, (field, form)
        with pytest.raises(ValueError, match=rf"^{field} is invalid: a tensor of shape \(2,\); allowed is one "):
            AdaptiveKL(None, BETA, loss_type).kl_loss(logps, ref, MASK, **{field: np.array([number, number])})
        for unheld in (np.array("7"), np.array([7.0], dtype=object)):  # torch holds neither: refused by name
            with pytest.raises(ValueError, match=rf"^{field}=array\(.*\) is invalid: allowed is "):
                AdaptiveKL(None, BETA, loss_type).kl_loss(logps, ref, MASK, **{field: unheld})


def test_an_empty_batch_is_refused_naming_its_shape() -> None:
    """No completion at all: grpo's mean of nothing raised a FloatingPointError blaming an estimator's overflow, bnpo
    returned 0."""
    for loss_type in ("grpo", "bnpo"):
        with pytest.raises(ValueError, match=re.escape("(B >= 1 completions, T completion tokens; mask 1 on each "
                                                       "completion's tokens, 0 on padding): got logps (0, 4)")):
            AdaptiveKL(None, BETA, loss_type).kl_loss(torch.zeros(0, 4), torch.zeros(0, 4), torch.zeros(0, 4))


@pytest.mark.parametrize("reward", ["0.9", True, torch.tensor([0.9, 0.8]), np.array([0.9, 0.8]), [0.9]])
def test_a_mean_reward_that_is_text_a_bool_or_the_rewards_is_refused(reward) -> None:
    """float("0.9") and float(True) are numbers: `dynamic` decayed on both. The rewards themselves, not their mean,
    failed inside float() with a message that named no field."""
    akl = AdaptiveKL(AdaptiveKLConfig(kl_adaptation_method="dynamic"), BETA)
    with pytest.raises(ValueError) as raised:
        akl.step(mean_reward=reward)
    assert str(raised.value) == (f"mean_reward={reward!r} is invalid: allowed is a finite number (the batch's mean "
                                 "reward), or None where the step scored no new generation batch.")
    assert akl.current_beta == BETA
    assert akl.step(mean_reward=torch.tensor(0.9)) == pytest.approx(BETA * 0.9)  # a 0-dim tensor is a number


@pytest.mark.parametrize("reward", [torch.tensor(0.9), torch.tensor([0.9]), np.array(0.9), np.array([0.9]),
                                    np.float32(0.9), torch.tensor([0.9], dtype=torch.float16)])
def test_a_one_element_tensor_or_array_is_a_mean_reward_alike(reward) -> None:
    """A one-element tensor was read as its number and a one-element numpy array refused (numpy 2's float() takes
    only a 0-dim array): both doors now read item(). dynamic decays once, by 0.9, above its threshold 0.5."""
    akl = AdaptiveKL(AdaptiveKLConfig(kl_adaptation_method="dynamic", reward_threshold=0.5), BETA)
    assert akl.step(mean_reward=reward) == pytest.approx(BETA * 0.9)


@pytest.mark.parametrize("reward", [torch.tensor([True]), np.array([True]), np.bool_(True), np.array([math.nan])])
def test_a_one_element_bool_or_nan_is_refused_as_the_number_would_be(reward) -> None:
    """item() of a bool tensor or array is a bool, refused as True is; NaN inside an array is refused as NaN is."""
    akl = AdaptiveKL(AdaptiveKLConfig(kl_adaptation_method="dynamic"), BETA)
    with pytest.raises(ValueError, match=r"^mean_reward=.* is invalid: allowed is a finite number"):
        akl.step(mean_reward=reward)
    assert akl.current_beta == BETA


@pytest.mark.parametrize("name", ["logps", "ref_logps", "per_token_kl"])
def test_integer_log_probs_are_refused_naming_the_tensor(name: str) -> None:
    """Log-probs cast to integers were truncated and trained on: a term of 0.18 where the float input gives 0.33."""
    logps, ref = torch.tensor([[-0.7, -1.6, -2.2]]), torch.tensor([[-1.4, -0.3, -2.9]])
    given = {"logps": logps, "ref_logps": ref, "mask": torch.ones(1, 3), "per_token_kl": None}
    given[name] = torch.tensor([[-1, -2, -3]])
    with pytest.raises(TypeError, match=rf"^{name} must be a floating-point tensor, not torch\.int64$"):
        AdaptiveKL(None, BETA).kl_loss(given["logps"], given["ref_logps"], given["mask"],
                                       per_token_kl=given["per_token_kl"])
    AdaptiveKL(None, BETA).kl_loss(logps, ref, torch.tensor([[1, 1, 0]]))  # an integer mask is a mask


@pytest.mark.parametrize(("fields", "message"), [
    ((0.1, 0.1, math.nan), "WindowKL.completions=nan is invalid: allowed is a finite number >= 0 (the completions "
                           "the step accounts for)."),
    ((0.1, 0.1, -0.5), "WindowKL.completions=-0.5 is invalid: allowed is a finite number >= 0 (the completions the "
                       "step accounts for)."),
    ((0.1, 0.1, -1.0), "WindowKL.completions=-1.0 is invalid: allowed is a finite number >= 0 (the completions the "
                       "step accounts for)."),
    ((math.inf, 0.1, 3.0), "WindowKL.token_mean=inf is invalid: allowed is a finite number, or NaN where the step "
                           "measured none."),
])
def test_a_window_kl_that_would_move_beta_to_nan_inf_or_0_is_refused(fields, message) -> None:
    """target's beta * (1 + e * n / kl_horizon) took n = NaN to beta NaN, n = -1e9 to 0."""
    with pytest.raises(ValueError) as raised:
        WindowKL(*fields)
    assert str(raised.value) == message
    assert math.isnan(WindowKL(math.nan, math.nan, 3.0).token_mean)  # a step that measured no KL: beta holds


@pytest.mark.parametrize("measure", ["token_mean", "sequence_sum"])
def test_a_given_window_without_a_kl_holds_beta_saying_so_and_keeps_the_last_kl(measure: str) -> None:
    """step(kl=WindowKL(nan, nan, 64)), an engine's step that measured no KL, held target's beta without a word (the
    warning was skipped whenever a window was given) and set last_raw_kl to NaN, where a step of one's own that
    trained on no valid token keeps the last one. One step with a KL first: 0.5 per token, above the target 0.1, so
    beta rises by 1 + 0.2 * 40 / 80 = 1.1; then the NaN window holds it there and keeps 0.5."""
    akl = AdaptiveKL(AdaptiveKLConfig(kl_adaptation_method="target", kl_target=0.1, kl_horizon=80.0,
                                      kl_target_measure=measure), BETA)
    assert akl.step(kl=WindowKL(0.5, 0.5, 40.0)) == pytest.approx(BETA * 1.1)
    with pytest.warns(UserWarning, match=re.escape(f"beta holds at step 2: the step's WindowKL has no KL ({measure}="
                                                   "nan, a step that measured none)")):
        assert akl.step(kl=WindowKL(math.nan, math.nan, 64.0)) == pytest.approx(BETA * 1.1)
    assert akl.last_raw_kl == 0.5


def test_a_given_window_of_0_completions_holds_beta_saying_so() -> None:
    """step(kl=WindowKL(5.0, 5.0, 0)): a KL 50 times the target, over no completion, moves target's beta by
    1 + 0.2 * 0 / kl_horizon = 1: held three steps without a word. Now it says why, once; the KL is still read."""
    akl = AdaptiveKL(AdaptiveKLConfig(kl_adaptation_method="target", kl_target=0.1), BETA)
    with pytest.warns(UserWarning, match=re.escape("beta holds at step 1: the step's WindowKL counts completions=0: "
                                                   "target moves beta by e * n / kl_horizon")) as caught:
        betas = [akl.step(kl=WindowKL(5.0, 5.0, 0.0)) for _ in range(3)]
    assert betas == [BETA] * 3 and len([w for w in caught if "beta holds" in str(w.message)]) == 1
    assert akl.last_raw_kl == 5.0


def test_target_refuses_a_horizon_under_which_beta_would_reach_0_and_stay() -> None:
    """kl_horizon=1 with 8 completions a step: 1 + (-0.2) * 8 / 1 = -0.6, so beta went to beta_min (0) and stayed.
    At kl_horizon=1.7 the factor is 1 - 0.2 * 8 / 1.7 = 0.0588: beta 0.1 -> 0.00588. With beta_min=0.05 beta lands
    on beta_min and can rise again: 0.05 * (1 + 0.2 * 8) = 0.13 when the KL is far above the target."""
    akl = AdaptiveKL(AdaptiveKLConfig(kl_adaptation_method="target", kl_target=1.0, kl_horizon=1.0), 0.1)
    with pytest.raises(ValueError) as raised:
        akl.step(kl=WindowKL(0.01, 0.01, 8.0))
    assert str(raised.value) == (
        "kl_horizon=1.0 is invalid for steps of 8 completions with beta_min=0: target's update beta * (1 + e * n / "
        "kl_horizon), e down to -0.2, would reach 0, and a multiplicative update never leaves 0; allowed is "
        "kl_horizon > 1.6 (n / 5), or beta_min > 0.")
    akl = AdaptiveKL(AdaptiveKLConfig(kl_adaptation_method="target", kl_target=1.0, kl_horizon=1.7), 0.1)
    assert akl.step(kl=WindowKL(0.01, 0.01, 8.0)) == pytest.approx(0.1 * (1 - 0.2 * 8 / 1.7))
    floored = AdaptiveKL(AdaptiveKLConfig(kl_adaptation_method="target", kl_target=1.0, kl_horizon=1.0,
                                          beta_min=0.05), 0.1)
    assert floored.step(kl=WindowKL(0.01, 0.01, 8.0)) == 0.05
    assert floored.step(kl=WindowKL(5.0, 5.0, 8.0)) == pytest.approx(0.05 * (1 + 0.2 * 8))


def test_at_beta_0_a_target_horizon_is_not_checked_as_at_every_door() -> None:
    """beta=0 turns the KL term off, and target's multiplicative update keeps it 0: kl_horizon=1 with 8 completions a
    step, refused at beta 0.1 (above), trains at beta=0 with beta 0 throughout, as the trainers build it (they skip the
    check at beta=0). It was refused at the loop's first training batch."""
    config = AdaptiveKLConfig(kl_adaptation_method="target", kl_target=1.0, kl_horizon=1.0)
    with pytest.warns(UserWarning, match="beta=0"):
        akl = AdaptiveKL(config, 0.0)
    eight = (torch.zeros(8, 2, requires_grad=True), torch.zeros(8, 2) - 0.5, torch.ones(8, 2))
    term, _ = akl.kl_loss(*eight)
    assert float(term) == 0.0
    assert akl.step() == 0.0 and akl.step(kl=WindowKL(0.01, 0.01, 8.0)) == 0.0


def test_a_refused_horizon_is_said_before_the_loops_backward_and_leaves_the_run_as_it_was() -> None:
    """kl_horizon=1 with 8 completions a step: the training kl_loss whose completions bring the step to n / kl_horizon
    >= 5 is refused before its term reaches the loop's backward (it was accepted, and step() raised after clearing the
    step's sums and moving last_raw_kl); a refused step(kl=...) or step() leaves the state as it was (a reward passed
    with it is not kept: a retried step would count it twice)."""
    config = AdaptiveKLConfig(kl_adaptation_method="target", kl_target=1.0, kl_horizon=1.0)
    message = "^kl_horizon=1.0 is invalid for steps of 8 completions with beta_min=0"
    akl = AdaptiveKL(config, 0.1)
    logps, ref = batch()
    akl.kl_loss(logps, ref, MASK)  # 3 completions: 3 / 1 < 5
    before = akl.state_dict()
    with pytest.raises(ValueError, match=r"^kl_horizon=1.0 is invalid for steps of 6 completions with beta_min=0"):
        akl.kl_loss(logps, ref, MASK)  # 6 / 1 >= 5
    assert akl.state_dict() == before and before["trained"]["completions"] == 3
    stepped = AdaptiveKL(config, 0.1)
    state = stepped.state_dict()
    with pytest.raises(ValueError, match=message):
        stepped.step(mean_reward=0.5, kl=WindowKL(0.01, 0.01, 8.0))
    assert stepped.state_dict() == state and state["rewards"] == []
    in_reward = AdaptiveKL(AdaptiveKLConfig(kl_adaptation_method="target", kl_target=1.0, kl_horizon=1.0,
                                            kl_placement="reward"), 0.1)
    eight = (torch.zeros(8, 2) - 1, torch.zeros(8, 2) - 1.5, torch.ones(8, 2))
    with pytest.raises(ValueError, match=message):
        in_reward.reward_penalty(*eight)  # the batch the next step would read, before its rewards are used
    assert in_reward.state_dict()["scored"] is None
    in_reward.reward_penalty(*eight, train=False)  # an evaluation batch: no step reads it


@pytest.mark.parametrize("kl", [0.3, {"token_mean": 0.3, "sequence_sum": 1.0, "completions": 4.0}, torch.tensor(0.3)])
def test_a_step_kl_that_is_not_a_window_kl_is_refused_before_the_step_moves(kl) -> None:
    """step(kl=0.3) cleared the step's sums, then failed on `kl.token_mean` (AttributeError), completed_steps 0."""
    akl = AdaptiveKL(AdaptiveKLConfig(kl_adaptation_method="target", kl_target=0.1, kl_horizon=30.0), BETA)
    akl.kl_loss(*batch(), MASK)
    before = akl.state_dict()
    with pytest.raises(TypeError) as raised:
        akl.step(kl=kl)
    assert str(raised.value) == ("kl must be a WindowKL(token_mean=..., sequence_sum=..., completions=...) or None "
                                 f"(the KL of the batches the step trained on), not {type(kl).__name__}")
    assert akl.state_dict() == before and before["trained"]["completions"] == 3


@pytest.mark.parametrize("state", [None, "checkpoint/adaptive_kl_state.json", [("completed_steps", 1)]])
def test_a_state_that_is_not_a_dict_is_refused_naming_the_argument(state) -> None:
    """load_state_dict(None) raised "'NoneType' object is not iterable", of a path "dictionary update sequence element
    #0 has length 1; 2 is required"."""
    with pytest.raises(TypeError) as raised:
        AdaptiveKL(AdaptiveKLConfig(kl_adaptation_method="dynamic"), BETA).load_state_dict(state)
    assert str(raised.value) == ("state must be the dict that state_dict() returned (json.load of a saved one), not "
                                 f"{type(state).__name__}")


def test_a_numpy_or_torch_number_in_a_window_kl_is_refused_as_such() -> None:
    """WindowKL(np.float32(0.3), ...) said "np.float32(0.3) is invalid: allowed is a finite number", a contradiction
    to the reader; it now says why, as the config's fields do."""
    with pytest.raises(ValueError) as raised:
        WindowKL(np.float32(0.3), 1.0, 4.0)
    assert str(raised.value) == ("WindowKL.token_mean=np.float32(0.3) is invalid: allowed is a finite number, or NaN "
                                 "where the step measured none, as a Python int or float (this is a numpy.float32: "
                                 "pass float(...)).")


def test_dr_grpos_cap_is_checked_for_raw_kl_under_another_kl_reduction() -> None:
    """raw_kl is reduced as dr_grpo reduces (sum / (B * max_completion_length)) whatever kl_reduction: a cap of 2 under
    completions of 4 tokens doubled it (0.15 against the KL term's token mean 0.075), accepted without a word."""
    akl = AdaptiveKL(AdaptiveKLConfig(kl_reduction="token_mean"), BETA, "dr_grpo")
    logps, ref = batch()
    with pytest.raises(ValueError) as raised:
        akl.kl_loss(logps, ref, MASK, max_completion_length=2)
    assert str(raised.value) == ("max_completion_length=2 is invalid: allowed is an integer >= 4, the longest "
                                 "completion's valid tokens in this batch: loss_type='dr_grpo' divides raw_kl by it "
                                 "as the cap on every completion's length.")
    _, metrics = akl.kl_loss(logps, ref, MASK, max_completion_length=4)
    k3 = torch.exp(ref - logps.detach()) - (ref - logps.detach()) - 1
    assert metrics["adaptive_kl/raw_kl"] == pytest.approx(float((k3 * MASK).sum() / (3 * 4)), rel=1e-6)


def test_a_batch_on_two_devices_is_refused_naming_each_device() -> None:
    """A mask left on the CPU beside the policy's log-probs raised torch's own error, which names no tensor ('meta'
    stands in for a GPU here)."""
    logps, ref = batch()
    with pytest.raises(ValueError) as raised:
        AdaptiveKL(None, BETA).kl_loss(logps, ref, MASK.to("meta"))
    assert str(raised.value) == ("logps, ref_logps, mask must be on one device (the policy's): got logps on cpu, "
                                 "ref_logps on cpu, mask on meta.")


@pytest.mark.parametrize(("fields", "loss_type", "said"), [
    (dict(kl_adaptation_method="length_normalized"), "grpo",
     "length_normalized (in kl_adaptation_method='length_normalized') has no effect: loss_type='grpo'"),
    (dict(kl_adaptation_method="length_normalized+dynamic"), "sapo",
     "length_normalized (in kl_adaptation_method='length_normalized+dynamic') has no effect: loss_type='sapo'"),
    (dict(kl_reduction="sequence_mean"), "grpo", "kl_reduction='sequence_mean' has no effect: loss_type='grpo'"),
    (dict(kl_reduction="token_mean"), "bnpo", "kl_reduction='token_mean' has no effect: loss_type='bnpo'"),
    (dict(kl_reduction="sequence_sum"), "luspo", "kl_reduction='sequence_sum' has no effect: loss_type='luspo'"),
    (dict(kl_adaptation_method="length_normalized"), "dapo", None),  # dapo reduces by tokens: it acts
    (dict(kl_reduction="token_mean"), "grpo", None),
    (dict(kl_reduction="sequence_mean", kl_placement="reward"), "grpo", None),  # per completion: the reward's own
])
def test_a_reduction_the_loss_type_already_applies_is_said_to_do_nothing(fields, loss_type, said) -> None:
    """Under grpo (mean over completions of each one's token mean) length_normalized's term equals stock's, as
    kl_reduction set to the loss type's own reduction does: checked here against the stock term, then said."""
    logps, ref = batch()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        akl = AdaptiveKL(AdaptiveKLConfig(**fields), BETA, loss_type)
    messages = [str(w.message) for w in caught if "has no effect" in str(w.message)]
    assert messages == ([] if said is None else
                        [f"{said} already reduces the KL term that way. Leave it out, or choose a reduction the loss "
                         "does not apply."])
    if said is not None:
        stock, _ = AdaptiveKL(None, BETA, loss_type).kl_loss(logps, ref, MASK, token_normalizer=7.0)
        term, _ = akl.kl_loss(logps, ref, MASK, token_normalizer=7.0)
        assert term.item() == pytest.approx(stock.item(), rel=1e-6)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        AdaptiveKL(AdaptiveKLConfig(**fields), 0.0, loss_type)  # beta 0 says its own: the term is off
    assert not [w for w in caught if "already reduces" in str(w.message)]


def test_the_public_shaping_and_reduction_compute_in_float32_and_name_an_unknown_reduction() -> None:
    """shape_kl of a bf16 KL clipped at 0.3 gave 0.30078125 (0.3 rounded to bf16), above the threshold; reduce_kl of a
    loss type's name raised a bare KeyError."""
    from unsloth_adaptive_kl.core.reductions import ReductionContext, reduce_kl
    from unsloth_adaptive_kl.core.shapings import shape_kl

    shaped = shape_kl(torch.tensor([0.5, 0.1], dtype=torch.bfloat16),
                      AdaptiveKLConfig(kl_adaptation_method="clip", kl_clip_threshold=0.3))
    assert shaped.dtype == torch.float32 and shaped[0].item() == torch.tensor(0.3).item()
    with pytest.raises(ValueError, match=r"^reduction='grpo' is invalid: allowed is one of sequence_sum_mean, "):
        reduce_kl(torch.zeros(1, 2), torch.ones(1, 2), "grpo", ReductionContext())


@pytest.mark.parametrize("door", ["kl_loss", "reward_penalty"])
def test_a_kl_of_your_own_beside_an_explicit_estimator_is_refused(door: str) -> None:
    """per_token_kl replaces the estimator: kl_estimator="k1" with per_token_kl=7 gave 7 per token, the k1 never run
    (and k1's warning still fired); with kl_estimator left at None the tensor is what is shaped and reduced."""
    logps, ref = batch(requires_grad=False)
    own = torch.full_like(logps, 7.0)
    placement = "loss" if door == "kl_loss" else "reward"
    akl = AdaptiveKL(AdaptiveKLConfig(kl_placement=placement, kl_estimator="k2"), BETA)
    with pytest.raises(ValueError) as raised:
        getattr(akl, door)(logps, ref, MASK, per_token_kl=own)
    assert str(raised.value) == ("kl_estimator='k2' is not read where per_token_kl is given (the methods shape and "
                                 "reduce that tensor instead): leave kl_estimator at None to pass a KL of your own, "
                                 "or leave out per_token_kl to use the estimator.")
    result, _ = getattr(AdaptiveKL(AdaptiveKLConfig(kl_placement=placement), BETA), door)(logps, ref, MASK,
                                                                                         per_token_kl=own)
    # grpo's mean per completion of 7 is 7, times beta; in the reward each completion's sum, 7 * L_i, times beta
    want = BETA * 7.0 if door == "kl_loss" else (BETA * 7.0 * LENGTHS).tolist()
    assert (result.item() if door == "kl_loss" else result.tolist()) == pytest.approx(want)


def test_the_rewards_observed_during_a_step_survive_a_checkpoint_taken_before_its_end() -> None:
    """A step's mean rewards reach the controller at its end (the mean of every batch it trained on): a state saved
    between observe_rewards and step carries them, so the resumed step decays as the uninterrupted one (0.1 * 0.5),
    and loading a state replaces what the loading object had observed (a new AdaptiveKL for changed settings,
    loaded from the old one's state, must not decide on rewards of its own and the old one's)."""
    settings = dict(kl_adaptation_method="dynamic", reward_threshold=0.5, dynamic_beta_decay=0.5)
    original = AdaptiveKL(AdaptiveKLConfig(**settings), beta=0.1)
    original.observe_rewards(0.9)
    original.observe_rewards(0.3)  # the step's mean 0.6 > 0.5: a decay
    state = json.loads(json.dumps(original.state_dict()))
    assert state["rewards"] == [0.9, 0.3] and state["generation_batch"] == 0
    resumed = AdaptiveKL(AdaptiveKLConfig(**settings), beta=0.1)
    resumed.observe_rewards(0.0)  # replaced by the state's
    resumed.load_state_dict(state)
    assert resumed.step() == original.step() == pytest.approx(0.05)
    bad = {**state, "rewards": [math.nan]}
    with pytest.raises(ValueError, match=r"^adaptive KL state: rewards=\[nan\] is invalid: allowed is a list of finite "):
        resumed.load_state_dict(bad)



def test_a_training_term_without_a_gradient_warns_once_and_a_measurement_does_not() -> None:
    """kl_loss on detached log-probs (the reward branch's `logps.detach()`, copied) returned a term that added nothing
    to the gradient, silently. Training with autograd on, it says so once; under torch.no_grad(), for an evaluation
    batch (train=False) or at beta 0 it is a measurement and stays quiet."""
    logps = torch.tensor([[-1.0, -2.0], [-0.5, -1.5]], requires_grad=True)
    ref, mask = torch.tensor([[-1.2, -1.0], [-0.4, -2.0]]), torch.ones(2, 2)
    akl = AdaptiveKL(None, beta=BETA)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        term, _ = akl.kl_loss(logps, ref, mask)
        assert term.requires_grad
        akl.kl_loss(logps.detach(), ref, mask, train=False)
        with torch.no_grad():
            akl.kl_loss(logps, ref, mask)
        AdaptiveKL(None, beta=0.0).kl_loss(logps.detach(), ref, mask)
    with pytest.warns(UserWarning, match=r"^adaptive KL: kl_loss\(\.\.\.\) returned a KL term without a gradient: "
                                         r"neither logps nor per_token_kl requires grad") as said:
        term, _ = akl.kl_loss(logps.detach(), ref, mask)
        akl.kl_loss(logps.detach(), ref, mask)
    mine = [w for w in said if "without a gradient" in str(w.message)]
    assert not term.requires_grad and len(mine) == 1 and mine[0].filename == __file__  # said once, at the user's line


NUMPY_INT = ", as a Python int (this is a numpy.int64: pass int(...))."


@pytest.mark.parametrize(("door", "message"), [
    (lambda: AdaptiveKL(None, BETA, num_iterations=np.int64(2)),
     "num_iterations=np.int64(2) is invalid: allowed is an integer >= 1 (the optimizer passes over each generation "
     "batch)"),
    (lambda: AdaptiveKL(AdaptiveKLConfig(kl_placement="reward"), BETA).reward_penalty(
        *batch(requires_grad=False), torch.ones(3, 4), group_size=np.int64(3)),
     "group_size=np.int64(3) is invalid: allowed is an integer >= 1 that divides the 3 completions (of every process, "
     "with gather), or None"),
    (lambda: AdaptiveKL(None, BETA).record_sums([engine_sums()], train=True, completed_steps=np.int64(1)),
     "completed_steps=np.int64(1) is invalid: allowed is an integer >= 0 (the optimizer steps completed with this "
     "one)"),
    (lambda: AdaptiveKL(None, BETA).load_state_dict({**AdaptiveKL(None, BETA).state_dict(),
                                                    "completed_steps": np.int64(1)}),
     "adaptive KL state: completed_steps=np.int64(1) is invalid: allowed is an integer >= 0"),
    (lambda: AdaptiveKL(AdaptiveKLConfig(kl_adaptation_method="dynamic"), BETA).load_state_dict(
        {**AdaptiveKL(AdaptiveKLConfig(kl_adaptation_method="dynamic"), BETA).state_dict(),
         "generation_batch": np.int64(1)}),
     "adaptive KL state: generation_batch=np.int64(1) is invalid: allowed is an integer >= 0 (a count)"),
])
def test_a_numpy_integer_count_is_refused_saying_why(door, message) -> None:
    """Each count is a Python int (the settings and a state are saved as JSON): a numpy one was refused with "allowed
    is an integer", of an integer; every door now says why, as the config's fields do."""
    with pytest.raises(ValueError) as raised:
        door()
    assert str(raised.value) == message + NUMPY_INT
