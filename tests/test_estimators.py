"""KL estimators, kl_reduction and the reduction table, diagnostics (pure torch, against hand formulas and numpy)."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch

from unsloth_adaptive_kl import AdaptiveKL, AdaptiveKLConfig, KLEstimatorWarning
from unsloth_adaptive_kl.core import reductions
from unsloth_adaptive_kl.core.adaptation import kl_term
from unsloth_adaptive_kl.core.reductions import ReductionContext
from unsloth_adaptive_kl.core.statistics import NAMES, KLStatistics, device_sums
from unsloth_adaptive_kl.core.estimators import (BUILT_IN_ESTIMATORS, bottom_percentile_mask, estimate_kl,
                                                 estimator_names)

from .kl_terms import adapted_kl_term
from .test_core import CTX, HAND_REDUCTIONS, KL, MASK

LOGP = torch.tensor([[-1.0, -2.0, -0.5], [-3.0, -0.1, -25.0]])
REF = torch.tensor([[-1.5, -1.0, -0.5], [-0.5, -4.0, -1.0]])
ONES = torch.ones_like(LOGP)


def config_of(name: str, **kwargs) -> AdaptiveKLConfig:
    """AdaptiveKLConfig(kl_estimator=name): k1 in the loss (the default placement) warns (SPEC 3.12)."""
    if name != "k1":
        return AdaptiveKLConfig(kl_estimator=name, **kwargs)
    with pytest.warns(KLEstimatorWarning, match="^kl_estimator='k1' with kl_placement='loss'"):
        return AdaptiveKLConfig(kl_estimator=name, **kwargs)


def estimate(name: str, logp: torch.Tensor, **kwargs) -> torch.Tensor:
    return estimate_kl(logp, REF, ONES, config_of(name, **kwargs))


def grad_of(name: str) -> torch.Tensor:
    logp = LOGP.clone().requires_grad_(True)
    estimate(name, logp).sum().backward()
    return logp.grad


FORMULAS = {
    "k1": lambda lp, rf: lp - rf,
    "k2": lambda lp, rf: 0.5 * (lp - rf) ** 2,
    "k3": lambda lp, rf: math.exp(rf - lp) - (rf - lp) - 1,
    "low_var_kl": lambda lp, rf: min(max(math.exp(min(max(rf - lp, -20), 20)) - min(max(rf - lp, -20), 20) - 1, -10), 10),
    "k1+": lambda lp, rf: lp - rf,
    "k3+": lambda lp, rf: math.exp(rf - lp) - (rf - lp) - 1,
}
# d/dlogp of each formula, by hand
GRADIENTS = {
    "k1": lambda lp, rf: 1.0,
    "k2": lambda lp, rf: lp - rf,
    "k3": lambda lp, rf: 1 - math.exp(rf - lp),
    "k1+": lambda lp, rf: lp - rf,
    "k3+": lambda lp, rf: lp - rf,
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("name", sorted(FORMULAS))
def test_estimator_values_match_formula(name: str, dtype: torch.dtype) -> None:
    """In float32 whatever the input dtype: half-precision inputs give the formula of the same (rounded) values (the
    last token's k3, e^24, overflows fp16)."""
    logp, ref = LOGP.to(dtype), REF.to(dtype)
    expected = [[FORMULAS[name](lp, rf) for lp, rf in zip(row_lp, row_rf)]
                for row_lp, row_rf in zip(logp.double().tolist(), ref.double().tolist())]
    value = estimate_kl(logp, ref, ONES.to(dtype), AdaptiveKLConfig(kl_estimator=name))
    assert value.dtype == torch.float32
    torch.testing.assert_close(value, torch.tensor(expected), rtol=1e-6, atol=1e-6)


def test_low_var_kl_clamps_large_ratios() -> None:
    # r = ref - logp = 24 on the last token: clamped to 20, k3 = e^20 - 21 > 10, clamped to 10
    assert estimate("low_var_kl", LOGP)[1, 2].item() == 10.0
    assert estimate("k3", LOGP)[1, 2].item() > 1e10
    # Between the two clamps: r = -10.5 is inside [-20, 20] and k3 = e^-10.5 + 9.5 inside [-10, 10], so low_var_kl is
    # k3 there, with its gradient 1 - e^r; r = -15 gives e^-15 + 14, clamped to 10, with no gradient.
    logp = torch.zeros(1, 2, requires_grad=True)
    value = estimate_kl(logp, torch.tensor([[-10.5, -15.0]]), torch.ones(1, 2),
                        AdaptiveKLConfig(kl_estimator="low_var_kl"))
    assert value[0, 0].item() == pytest.approx(math.exp(-10.5) + 9.5, rel=1e-6) and value[0, 1].item() == 10.0
    value.sum().backward()
    assert logp.grad[0].tolist() == pytest.approx([1 - math.exp(-10.5), 0.0], rel=1e-6)


@pytest.mark.parametrize("name", sorted(GRADIENTS))
def test_estimator_gradients_match_formula(name: str) -> None:
    expected = [[GRADIENTS[name](lp, rf) for lp, rf in zip(row_lp, row_rf)] for row_lp, row_rf in zip(LOGP.tolist(), REF.tolist())]
    torch.testing.assert_close(grad_of(name), torch.tensor(expected), rtol=1e-5, atol=1e-5)


def test_plus_variants_have_k2_gradient() -> None:
    torch.testing.assert_close(grad_of("k1+"), grad_of("k2"))
    torch.testing.assert_close(grad_of("k3+"), grad_of("k2"))


def test_bottom_percentile_selects_by_hand_count() -> None:
    ref = torch.tensor([[-0.1, -5.0, -2.0, -9.0, -0.3], [-7.0, -0.2, -4.0, -100.0, -1.0]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 1]])  # -100 is padding: never selected
    # 9 valid tokens; 0.2 * 9 = 1.8 -> k = 1: only the smallest valid value (-9.0)
    assert bottom_percentile_mask(ref, mask, 0.2).tolist() == [[0, 0, 0, 1, 0], [0, 0, 0, 0, 0]]
    # 0.5 * 9 = 4.5 -> k = 4: -9, -7, -5, -4
    assert bottom_percentile_mask(ref, mask, 0.5).tolist() == [[0, 1, 0, 1, 0], [1, 0, 1, 0, 0]]
    kth = torch.kthvalue(ref[mask.bool()], 4).values.item()
    assert kth == -4.0
    config = AdaptiveKLConfig(kl_estimator="k3_bottom_percentile", kl_percentile=0.5, kl_percentile_scale=5.0)
    logp = torch.full_like(ref, -1.0)
    k = estimate_kl(logp, ref, mask, config)
    r = ref - logp
    expected = (torch.exp(r) - r - 1) * 5.0 * bottom_percentile_mask(ref, mask, 0.5)
    torch.testing.assert_close(k, expected)
    assert torch.count_nonzero(k) == 4


def test_bottom_percentile_keeps_floor_n_p_tokens_for_the_p_as_written() -> None:
    """k = max(1, floor(n p)) in exact arithmetic, for p in hundredths and n up to 300 (distinct values, so k tokens
    are kept): the count was taken in float32, where 0.53 is 0.52999997, so 100 tokens kept 52 (and 22 of 109 p tried
    kept one token off for some n)."""
    wrong = []
    for percent in range(1, 101):
        for n in range(1, 301):
            ref = -torch.arange(1, n + 1, dtype=torch.float32)
            kept = int(bottom_percentile_mask(ref, torch.ones(n), percent / 100).sum())
            if kept != max(1, n * percent // 100):
                wrong.append((percent, n, kept))
    assert wrong == []
    ref = -torch.arange(1.0, 101.0)
    assert int(bottom_percentile_mask(ref, torch.ones(100), 0.53).sum()) == 53


def test_bottom_percentile_takes_the_fraction_to_6_decimal_places() -> None:
    """p = 0.0000026 is 3 millionths at 6 places: of a million tokens it keeps 3, where floor(n p) would keep 2."""
    ref = -torch.arange(1.0, 1_000_001.0)
    assert int(bottom_percentile_mask(ref, torch.ones(1_000_000), 0.0000026).sum()) == 3
    assert int(bottom_percentile_mask(ref, torch.ones(1_000_000), 0.000002).sum()) == 2


def test_bottom_percentile_is_0_off_its_selection_even_where_k3_overflows() -> None:
    """An unselected token whose reference is far more confident than the policy (ref - logp = 94.5) has a k3 of
    e^94.5 = inf in float32: it must give 0 there, not inf * 0 = NaN (which failed the step as a non-finite KL).
    One token of five is selected (floor(5 * 0.2)): ref -3, logp -1, r = -2: k3 = e^-2 + 1 = 1.135335, times 5 over
    5 tokens (grpo's per-completion mean), times beta 0.1; its gradient (1 - e^-2) * 5 / 5 * 0.1 = 0.086466."""
    akl = AdaptiveKL(AdaptiveKLConfig(kl_estimator="k3_bottom_percentile"), beta=0.1)
    logp = torch.tensor([[-1.0, -2.0, -95.0, -1.5, -0.7]], requires_grad=True)
    term, _ = akl.kl_loss(logp, torch.tensor([[-3.0, -2.5, -0.5, -1.0, -0.9]]), torch.ones(1, 5))
    term.backward()
    assert term.item() == pytest.approx(0.1 * (math.exp(-2.0) + 1.0), rel=1e-6)
    assert logp.grad[0, 0].item() == pytest.approx(0.1 * (1.0 - math.exp(-2.0)), rel=1e-6)
    assert logp.grad[0, 1:].tolist() == [0.0, 0.0, 0.0, 0.0]


def test_k3_of_tiny_log_ratios_rounds_to_a_tiny_negative_mean_as_the_docs_say() -> None:
    """k3 is the trainer's float32 expression e^r - r - 1, which cancels for log-ratios near 0, so that a batch of them
    can average to a tiny negative (what docs/estimators.md and docs/metrics.md say): at r = 1e-4 it is 0 (exactly
    5e-9), and 8 x 1024 log-ratios of N(0, 1e-4) average to about -4e-9 where the exact mean is about +5e-9."""
    assert estimate_kl(torch.zeros(1, 1), torch.full((1, 1), 1e-4), torch.ones(1, 1), AdaptiveKLConfig()).item() == 0
    r = torch.randn(8, 1024, generator=torch.Generator().manual_seed(0)) * 1e-4
    _, metrics = AdaptiveKL(AdaptiveKLConfig(), beta=0.1, loss_type="bnpo").kl_loss(
        torch.zeros(8, 1024, requires_grad=True), r, torch.ones(8, 1024))
    exact = (torch.expm1(r.double()) - r.double()).mean().item()
    assert 4.5e-9 < exact < 5.5e-9 and -5e-9 < metrics["adaptive_kl/raw_kl"] < -3e-9


@pytest.mark.parametrize("estimator", ["k3", "k3_bottom_percentile"])
def test_a_batch_of_zero_width_completions_has_no_kl_in_the_loss_or_the_reward(estimator: str) -> None:
    """Shape (2, 0): no token, so a loss term of 0 and a penalty of 0 per completion, for the percentile estimator as
    for k3 (its sort of no values raised IndexError)."""
    akl = AdaptiveKL(AdaptiveKLConfig(kl_estimator=estimator), beta=0.1)
    empty = torch.zeros(2, 0)
    term, _ = akl.kl_loss(empty, empty, torch.ones(2, 0))
    assert term.item() == 0.0
    with pytest.warns(KLEstimatorWarning):  # k3 in the reward ends far from the regularised optimum
        in_reward = AdaptiveKL(AdaptiveKLConfig(kl_estimator=estimator, kl_placement="reward"), beta=0.1)
    penalty, _ = in_reward.reward_penalty(empty, empty, torch.ones(2, 0))
    assert penalty.tolist() == [0.0, 0.0]
    assert bottom_percentile_mask(empty, torch.ones(2, 0), 0.5).shape == (2, 0)


def test_callable_estimator_is_used() -> None:
    config = AdaptiveKLConfig(kl_estimator=lambda logp, ref, mask: (logp - ref).abs() * mask)
    torch.testing.assert_close(estimate_kl(LOGP, REF, ONES, config), (LOGP - REF).abs())
    assert "k3_bottom_percentile" in estimator_names()


def test_any_nonzero_mask_entry_is_a_valid_position() -> None:
    """estimate_kl's mask: an entry of 0.25 marks a valid token (its log-probs kept), 0 a masked one (a NaN there
    gives 0). Position 0: ref - logp = -0.5; position 1: ref - logp = 1, so k1 = -1 and k3 = e - 2."""
    logp, ref, mask = torch.tensor([[-1.0, -2.0, math.nan]]), torch.tensor([[-1.5, -1.0, 5.0]]), torch.tensor(
        [[1.0, 0.25, 0.0]])
    assert estimate_kl(logp, ref, mask, config_of("k1")).tolist() == [[0.5, -1.0, 0.0]]
    assert estimate_kl(logp, ref, mask, config_of("k3"))[0].tolist() == pytest.approx(
        [math.exp(-0.5) + 0.5 - 1.0, math.e - 2.0, 0.0], rel=1e-6)


def test_reduce_kl_counts_a_nonzero_mask_entry_as_one_token_as_the_pipeline_does() -> None:
    """x = 1 on 4 positions, mask [1, 0.5, 1, 0]: 3 valid tokens (sums 3, L = 3), so the per-token mean is 1; L was
    the mask's sum, 2.5, giving 1.2, where kl_term's lengths are 3."""
    x, mask = torch.ones(1, 4), torch.tensor([[1.0, 0.5, 1.0, 0.0]])
    assert reductions.reduce_kl(x, mask, "sequence_mean", ReductionContext()).item() == 1.0
    assert reductions.reduce_kl(x, mask, "sequence_sum_mean", ReductionContext()).item() == 3.0
    term = kl_term(torch.zeros(1, 4), torch.zeros(1, 4), mask, AdaptiveKLConfig(), loss_type="grpo")
    assert term.lengths.tolist() == [3.0]


def test_a_callable_estimator_gives_0_on_masked_positions_as_the_pipeline_does() -> None:
    """A callable that maps the masked positions' zeros to a nonzero value (exp(0) = 1): estimate_kl gives 0 there,
    as AdaptiveKL.kl_loss's pipeline does, and passes the mask as bool. Valid: exp(ref - logp) = exp(-1)."""
    seen = []

    def ratio(logp: torch.Tensor, ref: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        seen.append(mask.dtype)
        return torch.exp(ref - logp)

    config = AdaptiveKLConfig(kl_estimator=ratio)
    logp = torch.tensor([[-1.0, -1.0, -1.0]], requires_grad=True)
    k = estimate_kl(logp, torch.tensor([[-2.0, -2.0, -2.0]]), torch.tensor([[1.0, 1.0, 0.0]]), config)
    assert k[0].tolist() == pytest.approx([math.exp(-1.0), math.exp(-1.0), 0.0], rel=1e-6)
    k.sum().backward()
    assert logp.grad[0].tolist() == pytest.approx([-math.exp(-1.0), -math.exp(-1.0), 0.0], rel=1e-6)
    assert seen == [torch.bool]
    akl = AdaptiveKL(AdaptiveKLConfig(kl_estimator=ratio, kl_reduction="token_mean"), beta=1.0)
    term, _ = akl.kl_loss(logp.detach(), torch.tensor([[-2.0, -2.0, -2.0]]), torch.tensor([[1.0, 1.0, 0.0]]))
    assert term.item() == pytest.approx(math.exp(-1.0), rel=1e-6)  # (e^-1 + e^-1 + 0) / 2 valid tokens


@pytest.mark.parametrize("loss_type", sorted(HAND_REDUCTIONS))
def test_kl_reduction_overrides_loss_type_by_hand(loss_type: str) -> None:
    # masked sums 2.6 (L=3) and 3.0 (L=1)
    hand = {"sequence_mean": (2.6 / 3 + 3.0) / 2, "token_mean": 5.6 / 4, "sequence_sum": (2.6 + 3.0) / 2}
    for reduction, value in hand.items():
        term = adapted_kl_term(KL, MASK, AdaptiveKLConfig(kl_reduction=reduction), loss_type, CTX)
        assert term.adapted.item() == pytest.approx(value, rel=1e-6)
        assert term.raw.item() == pytest.approx(HAND_REDUCTIONS[loss_type], rel=1e-6)
    loss_type_term = adapted_kl_term(KL, MASK, AdaptiveKLConfig(), loss_type, CTX)
    assert loss_type_term.adapted.item() == pytest.approx(HAND_REDUCTIONS[loss_type], rel=1e-6)


def test_sequence_sum_grows_with_length_sequence_mean_does_not() -> None:
    short, long = torch.tensor([[0.5] * 2 + [0.0] * 2]), torch.tensor([[0.5] * 4])
    short_mask, long_mask = torch.tensor([[1, 1, 0, 0]]), torch.tensor([[1, 1, 1, 1]])
    ctx = ReductionContext(max_completion_length=4, token_normalizer=1.0)
    for reduction, ratio in (("sequence_sum", 2.0), ("sequence_mean", 1.0)):
        config = AdaptiveKLConfig(kl_reduction=reduction)
        a = adapted_kl_term(short, short_mask, config, "dapo", ctx).adapted.item()
        b = adapted_kl_term(long, long_mask, config, "dapo", ctx).adapted.item()
        assert b / a == pytest.approx(ratio)


def test_diagnostics_against_numpy() -> None:
    generator = torch.Generator().manual_seed(3)
    kl = torch.rand(6, 7, generator=generator) * 2
    lengths = [7, 2, 5, 1, 6, 3]
    mask = torch.tensor([[1 if t < n else 0 for t in range(7)] for n in lengths])
    diagnostics = adapted_kl_term(kl, mask, AdaptiveKLConfig(kl_adaptation_method="clip", kl_clip_threshold=1.5), "bnpo",
                                  ReductionContext())
    k, m = kl.numpy(), mask.numpy()
    sequence = (k * m).sum(1)
    np.testing.assert_allclose(diagnostics.sequence_kl.numpy(), sequence, rtol=1e-6)
    np.testing.assert_allclose(diagnostics.lengths.numpy(), lengths)
    assert diagnostics.at_threshold.item() == ((k >= 1.5) & (m == 1)).sum()
    assert diagnostics.raw.item() == pytest.approx(sequence.sum() / sum(lengths), rel=1e-6)
    assert diagnostics.adapted.item() == pytest.approx((np.minimum(k, 1.5) * m).sum() / sum(lengths), rel=1e-6)
    sums = KLStatistics(*device_sums(diagnostics).tolist())  # the correlation from the sums, as the metrics take it
    # the same sums from the completions' values read to the host (verl's worker), and both by hand
    on_host = KLStatistics.of_completions(diagnostics.lengths.tolist(), diagnostics.sequence_kl.tolist(), entries=1.0,
                                          raw=diagnostics.raw.item(), adapted=diagnostics.adapted.item(),
                                          clipped=diagnostics.at_threshold.item(),
                                          policy_logps=diagnostics.check.sums[0].item(),
                                          reference_logps=diagnostics.check.sums[1].item())
    by_hand = dict(completions=6, tokens=sum(lengths), kl=sequence.sum(), tokens_sq=sum(n * n for n in lengths),
                   tokens_kl=(np.array(lengths) * sequence).sum(), kl_sq=(sequence ** 2).sum(), entries=1.0)
    for name, value in by_hand.items():
        assert getattr(sums, name) == pytest.approx(value, rel=1e-6) == getattr(on_host, name), name
    for name in NAMES:  # every field, the scalars too
        assert getattr(on_host, name) == pytest.approx(getattr(sums, name), rel=1e-12), name
    assert sums.length_kl_corr() == pytest.approx(np.corrcoef(lengths, sequence)[0, 1], rel=1e-6)  # float32 S_i
    constant = [KLStatistics(completions=4, tokens=4 * 5, tokens_sq=4 * 25, kl=s, kl_sq=s * s / 4 * 4, tokens_kl=5 * s)
                for s in (0.4, 1.3)]  # every L_i = 5, or every S_i equal: no correlation to speak of
    assert math.isnan(constant[0].length_kl_corr())
    repeated = KLStatistics(completions=4, tokens=1 + 2 + 3 + 4, tokens_sq=1 + 4 + 9 + 16, kl=4 * 0.1,
                            kl_sq=4 * 0.1 * 0.1, tokens_kl=(1 + 2 + 3 + 4) * 0.1)
    assert math.isnan(repeated.length_kl_corr())  # S_i = 0.1 each: its variance is rounding error, not a spread
    # S_i = 0.3 each, summed on the host: 3 * (3 * 0.09) - 0.9^2 rounds to 2.2e-16, not 0: still no spread
    summed = KLStatistics.of_completions([1, 2, 3], [0.3] * 3, entries=1, raw=0.0, adapted=0.0)
    assert summed.completions * summed.kl_sq - summed.kl ** 2 > 0 and math.isnan(summed.length_kl_corr())


# BUILT_IN_ESTIMATORS, not estimator_names(): that also lists what the test files collected before this one register
# (test_adaptive_kl's estimator calls .item(), a graph break by design)
@pytest.mark.parametrize("name", BUILT_IN_ESTIMATORS)
def test_every_builtin_estimator_and_adaptation_traces_with_fullgraph(name: str) -> None:
    """No graph breaks (no .item(), no data-dependent Python branching): what Unsloth's compiled loss requires."""
    torch._dynamo.reset()
    config = config_of(name, kl_adaptation_method="sigmoid+length_normalized")
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    ctx = ReductionContext(max_completion_length=3, token_normalizer=torch.tensor(3.0))

    def adapted(logp: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
        return adapted_kl_term(estimate_kl(logp, ref, mask, config), mask, config, "dapo", ctx).adapted

    compiled = torch.compile(adapted, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(LOGP, REF), adapted(LOGP, REF))


# ----- the reduction table: one record per reduction, read by the config, the core and verl --------------------------

# verl 0.9.1's loss_agg_mode and the GRPO loss_type of the same reduction, from verl's agg_loss and TRL's normalisers.
VERL_LOSS_TYPE_OF_AGG_MODE = {"token-mean": "bnpo", "token-sum": "dapo", "seq-mean-token-mean": "grpo",
                              "seq-mean-token-sum": "luspo", "seq-mean-token-sum-norm": "dr_grpo"}


def test_verl_agg_modes_map_to_loss_types_and_back() -> None:
    for agg_mode, loss_type in VERL_LOSS_TYPE_OF_AGG_MODE.items():
        assert reductions.loss_type_of_agg_mode(agg_mode) == loss_type
        assert reductions.agg_mode_of(reductions.loss_type_reduction(loss_type)) == agg_mode
    with pytest.raises(ValueError, match=r"^actor_rollout_ref\.actor\.loss_agg_mode='seq-sum' is invalid: allowed is "
                                         r"one of .*seq-mean-token-mean.*token-sum"):
        reductions.loss_type_of_agg_mode("seq-sum", field="actor_rollout_ref.actor.loss_agg_mode")


@pytest.mark.parametrize("loss_agg_mode", sorted(VERL_LOSS_TYPE_OF_AGG_MODE))
def test_verl_aggregation_of_the_adapted_kl_follows_kl_reduction_then_length_normalisation(loss_agg_mode) -> None:
    """kl_reduction's precedence, read in verl's names: the setting's mode, length normalisation's (each completion's
    mean per-token KL), else the loss's own mode."""
    loss_type = reductions.loss_type_of_agg_mode(loss_agg_mode)

    def agg_mode(**settings) -> str:
        return reductions.agg_mode_of(reductions.kl_reduction(AdaptiveKLConfig(**settings), loss_type))

    assert agg_mode() == loss_agg_mode
    assert agg_mode(kl_adaptation_method="length_normalized") == "seq-mean-token-mean"
    for setting, mode in (("sequence_mean", "seq-mean-token-mean"), ("token_mean", "token-mean"),
                          ("sequence_sum", "seq-mean-token-sum")):
        assert agg_mode(kl_reduction=setting) == mode


def test_each_loss_type_reduces_by_one_record_and_the_config_allows_the_table_settings() -> None:
    assert sorted(reductions.loss_types()) == sorted(HAND_REDUCTIONS)
    assert reductions.kl_reduction_settings() == ("loss_type", "sequence_sum", "sequence_mean", "token_mean")
    with pytest.raises(ValueError, match=r"^kl_reduction='token_mean' is invalid: allowed is one of loss_type, "
                                         r"sequence_sum, sequence_mean with kl_placement='reward'"):
        AdaptiveKLConfig(kl_placement="reward", kl_reduction="token_mean")
    with pytest.raises(ValueError, match=r"^loss_type='ppo' is not supported by adaptive KL: allowed is one of bnpo, "
                                         r"cispo, dapo, dr_grpo, grpo, luspo, sapo, vespo\.$"):
        reductions.loss_type_reduction("ppo")


def test_reward_kl_per_completion_by_hand() -> None:
    """KL_i with the KL in the reward: the record's per-completion form; 'loss_type' means the sequence sum there.
    Masked sums 2.6 (L=3) and 3.0 (L=1)."""
    for setting, want in (("loss_type", [2.6, 3.0]), ("sequence_sum", [2.6, 3.0]), ("sequence_mean", [2.6 / 3, 3.0])):
        term = kl_term(torch.zeros(KL.shape), torch.zeros(KL.shape), MASK,
                       AdaptiveKLConfig(kl_placement="reward", kl_reduction=setting), per_token_kl=KL)
        torch.testing.assert_close(term.raw, torch.tensor(want))


def test_a_registered_reduction_is_selected_by_kl_reduction_in_every_placement() -> None:
    """`register_kl_reduction` works as the other registries do: the name becomes an allowed `kl_reduction` value,
    validated when the config is built, and reduces the adapted KL in a loop of your own (here the largest completion
    sum: S = (2.6, 3.0) by hand, so K = 3.0); with a per-completion form it is allowed with the KL in the reward too.
    On b3d53c1 the allowed values were fixed at import and the config refused the name."""
    from unsloth_adaptive_kl import register_kl_reduction

    with pytest.raises(ValueError, match=r"kl_reduction='max_completion' is invalid: allowed is one of loss_type, "
                                         r"sequence_sum, sequence_mean, token_mean \(register your own"):
        AdaptiveKLConfig(kl_reduction="max_completion")
    try:
        @register_kl_reduction("max_completion", per_completion=lambda sums, lengths: sums)
        def max_completion(sums: torch.Tensor, lengths: torch.Tensor, ctx: ReductionContext) -> torch.Tensor:
            return sums.max()

        assert reductions.kl_reduction_settings()[-1] == "max_completion"
        logp = torch.zeros(KL.shape)
        akl = AdaptiveKL(AdaptiveKLConfig(kl_reduction="max_completion"), beta=0.5, loss_type="grpo")
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a registered reduction may divide by either: no divisor is unread
            loss, metrics = akl.kl_loss(logp, logp, MASK, per_token_kl=KL.clone().requires_grad_(),
                                        max_completion_length=4)
        assert loss.item() == pytest.approx(0.5 * 3.0)
        assert metrics["adaptive_kl/raw_kl"] == pytest.approx((2.6 / 3 + 3.0) / 2)  # grpo's own reduction
        reward = AdaptiveKL(AdaptiveKLConfig(kl_reduction="max_completion", kl_placement="reward"), beta=0.5)
        penalty, _ = reward.reward_penalty(logp, logp, MASK, per_token_kl=KL)
        torch.testing.assert_close(penalty, 0.5 * torch.tensor([2.6, 3.0]))
        with pytest.raises(ValueError, match=r"register_kl_reduction\('max_completion'\): allowed is a new"):
            register_kl_reduction("max_completion")
    finally:
        reductions.REDUCTIONS.pop("max_completion", None)
    with pytest.raises(ValueError, match="kl_reduction='max_completion' is invalid"):
        AdaptiveKLConfig(kl_reduction="max_completion")


def test_a_registered_reductions_own_check_is_not_taken_for_a_missing_divisor() -> None:
    """Every door asks each reduction, on a one-completion probe, whether it lacks a divisor. A registered reduction
    that refuses fewer than two completions failed that probe, and kl_loss refused every batch in its words plus
    ': pass it to kl_loss(...)' (one failing on it with a RuntimeError, a view into pairs, refused every batch in
    torch's words). The probe now reads a divisor's refusal alone: a batch of 2 gets mean_i S_i, one of 1 the
    reduction's own error as written; one refusing a missing token_normalizer, or dividing by None, is named with the
    door."""
    from unsloth_adaptive_kl import register_kl_reduction
    from unsloth_adaptive_kl.core.errors import reject

    def pairs(sums: torch.Tensor, lengths: torch.Tensor, ctx: ReductionContext) -> torch.Tensor:
        if sums.numel() < 2:
            raise ValueError("pairs needs two completions or more")
        return sums.mean()

    def per_token(sums: torch.Tensor, lengths: torch.Tensor, ctx: ReductionContext) -> torch.Tensor:
        if ctx.token_normalizer is None:
            raise reject("token_normalizer", None, "a number > 0")
        return sums.sum() / ctx.token_normalizer

    def pairwise(sums: torch.Tensor, lengths: torch.Tensor, ctx: ReductionContext) -> torch.Tensor:
        return sums.view(-1, 2).mean(1).sum()  # a RuntimeError on one completion

    def unchecked(sums: torch.Tensor, lengths: torch.Tensor, ctx: ReductionContext) -> torch.Tensor:
        return sums.sum() / ctx.token_normalizer  # a TypeError on None

    logps, ref = torch.tensor([[-1.0, -2.0], [-1.0, -1.0]]), torch.tensor([[-0.5, -1.0], [-2.0, -1.0]])
    mask = torch.ones(2, 2)
    try:
        for function in (pairs, per_token, pairwise, unchecked):
            register_kl_reduction(function.__name__)(function)
        term, _ = AdaptiveKL(AdaptiveKLConfig(kl_reduction="pairs"), 1.0).kl_loss(logps, ref, mask)
        k3 = [[math.exp(r) - r - 1 for r in row] for row in ((0.5, 1.0), (-1.0, 0.0))]  # r = ref - logp
        assert term.item() == pytest.approx(sum(map(sum, k3)) / 2, rel=1e-6)
        with pytest.raises(ValueError, match=r"^pairs needs two completions or more$"):
            AdaptiveKL(AdaptiveKLConfig(kl_reduction="pairs"), 1.0).kl_loss(logps[:1], ref[:1], mask[:1])
        with pytest.raises(ValueError, match=r"^token_normalizer=None is invalid: allowed is a number > 0: pass it "
                                             r"to kl_loss\(\.\.\.\)\.$"):
            AdaptiveKL(AdaptiveKLConfig(kl_reduction="per_token"), 1.0).kl_loss(logps, ref, mask)
        term, _ = AdaptiveKL(AdaptiveKLConfig(kl_reduction="pairwise"), 1.0).kl_loss(logps, ref, mask)
        assert term.item() == pytest.approx(sum(map(sum, k3)) / 2, rel=1e-6)  # one pair: its mean
        with pytest.raises(ValueError, match=r"^kl_reduction='unchecked' divides by a divisor not given here \("
                                             r"max_completion_length=None, token_normalizer=None; unsupported operand "
                                             r".*NoneType.*\): pass it to kl_loss\(\.\.\.\)\.$"):
            AdaptiveKL(AdaptiveKLConfig(kl_reduction="unchecked"), 1.0).kl_loss(logps, ref, mask)
    finally:
        for name in ("pairs", "per_token", "pairwise", "unchecked"):
            reductions.REDUCTIONS.pop(name, None)
