"""The pure-torch core against independent hand formulas on fixed tensors (SPEC 3.2-3.6, 4)."""

from __future__ import annotations

import math

import pytest
import torch

from unsloth_adaptive_kl import AdaptiveKLConfig
from unsloth_adaptive_kl.core.adaptation import kl_term
from unsloth_adaptive_kl.core.reductions import ReductionContext, loss_type_reduction, loss_types, reduce_kl
from unsloth_adaptive_kl.core.shapings import shape_kl

from .kl_terms import adapted_kl_term

# Two completions: lengths 3 and 1 (T = 4).
KL = torch.tensor([[0.5, 2.0, 0.1, 9.0], [3.0, 7.0, 7.0, 7.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
CTX = ReductionContext(max_completion_length=4, token_normalizer=torch.tensor(5.0))


def config(method: str, **kwargs) -> AdaptiveKLConfig:
    return AdaptiveKLConfig(kl_adaptation_method=method, **kwargs)


def sig(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def test_clip_is_min_with_threshold_and_zero_gradient_above() -> None:
    kl = KL.clone().requires_grad_(True)
    shaped = shape_kl(kl, config("clip", kl_clip_threshold=1.0))
    assert torch.equal(shaped, torch.tensor([[0.5, 1.0, 0.1, 1.0], [1.0, 1.0, 1.0, 1.0]]))
    shaped.sum().backward()
    assert kl.grad.tolist() == [[1.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]]


def test_sigmoid_formula_by_hand() -> None:
    shaped = shape_kl(KL, config("sigmoid", kl_target=0.1))
    expected = [[sig(k - 0.1) * k for k in row] for row in KL.tolist()]
    assert torch.allclose(shaped, torch.tensor(expected))
    assert shaped[0, 0].item() == pytest.approx(sig(0.4) * 0.5)  # 0.29934...


def test_none_and_dynamic_do_not_shape() -> None:
    assert torch.equal(shape_kl(KL, config("none")), KL)
    assert torch.equal(shape_kl(KL, config("dynamic")), KL)


# Hand-computed reductions of KL under MASK: masked sums are 2.6 (L=3) and 3.0 (L=1); 4 tokens in all.
HAND_REDUCTIONS = {
    "grpo": (2.6 / 3 + 3.0 / 1) / 2,
    "sapo": (2.6 / 3 + 3.0 / 1) / 2,
    "bnpo": 5.6 / 4,
    "dr_grpo": 5.6 / (2 * 4),
    "dapo": 5.6 / 5.0,
    "cispo": 5.6 / 5.0,
    "vespo": 5.6 / 5.0,
    "luspo": (2.6 + 3.0) / 2,
}


@pytest.mark.parametrize("loss_type", sorted(HAND_REDUCTIONS))
def test_loss_type_reductions_by_hand(loss_type: str) -> None:
    value = reduce_kl(KL, MASK, loss_type_reduction(loss_type), CTX)
    assert value.item() == pytest.approx(HAND_REDUCTIONS[loss_type], rel=1e-6)
    assert set(HAND_REDUCTIONS) == set(loss_types())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("method", ["none", "clip", "sigmoid", "length_normalized", "clip+length_normalized"])
@pytest.mark.parametrize("loss_type", sorted(HAND_REDUCTIONS))
def test_half_precision_terms_are_the_float32_terms_of_the_same_values(loss_type: str, method: str, dtype) -> None:
    """The per-token KL, mask and normaliser in bf16/fp16: the term, its diagnostics and its gradient are float32 and
    equal the float32 computation of the same (rounded) values to 1e-6."""
    kl, mask = KL.to(dtype).clone().requires_grad_(True), MASK.to(dtype)
    ctx = ReductionContext(max_completion_length=4, token_normalizer=torch.tensor(5.0, dtype=dtype))
    settings = config(method, kl_clip_threshold=1.0)
    half = adapted_kl_term(kl, mask, settings, loss_type, ctx)
    full_kl = kl.detach().float().requires_grad_(True)
    full = adapted_kl_term(full_kl, mask.float(), settings, loss_type, CTX)
    for name in ("raw", "adapted", "sequence_kl", "lengths", "at_threshold"):
        assert getattr(half, name).dtype == torch.float32, name
        torch.testing.assert_close(getattr(half, name), getattr(full, name), rtol=1e-6, atol=0)
    (grad,) = torch.autograd.grad(half.adapted, kl)
    (full_grad,) = torch.autograd.grad(full.adapted, full_kl)
    assert grad.dtype == dtype and torch.equal(grad, full_grad.to(dtype))
    if method == "none" and dtype != torch.bfloat16:  # fp16 holds KL's values exactly but 0.1: the hand formula
        assert half.adapted.item() == pytest.approx(HAND_REDUCTIONS[loss_type], rel=1e-3)


@pytest.mark.parametrize("loss_type", sorted(HAND_REDUCTIONS))
def test_length_normalized_is_mean_per_completion_whatever_loss_type(loss_type: str) -> None:
    term = adapted_kl_term(KL, MASK, config("length_normalized"), loss_type, CTX)
    assert term.adapted.item() == pytest.approx((2.6 / 3 + 3.0) / 2, rel=1e-6)
    assert term.raw.item() == pytest.approx(HAND_REDUCTIONS[loss_type], rel=1e-6)


@pytest.mark.parametrize("loss_type", sorted(HAND_REDUCTIONS))
def test_length_normalized_penalty_invariant_to_doubling_length(loss_type: str) -> None:
    """Completion 0 doubled (same per-token KL 0.7 on 3 -> 6 tokens): its KL penalty is unchanged."""
    short_kl = torch.tensor([[0.7] * 3 + [0.0] * 3, [0.2] * 6])
    short_mask = torch.tensor([[1.0] * 3 + [0.0] * 3, [1.0] * 2 + [0.0] * 4])
    long_mask = torch.tensor([[1.0] * 6, [1.0] * 2 + [0.0] * 4])
    long_kl = torch.tensor([[0.7] * 6, [0.2] * 6])
    ctx = ReductionContext(max_completion_length=6, token_normalizer=torch.tensor(5.0))
    cfg = config("length_normalized")
    short = adapted_kl_term(short_kl, short_mask, cfg, loss_type, ctx).adapted
    long = adapted_kl_term(long_kl, long_mask, cfg, loss_type, ctx).adapted
    assert short.item() == pytest.approx(long.item(), rel=1e-6)
    assert short.item() == pytest.approx((0.7 + 0.2) / 2, rel=1e-6)


def test_combination_applies_shaping_before_length_normalisation() -> None:
    cfg = config("length_normalized+clip", kl_clip_threshold=1.0)
    assert cfg.kl_adaptation_method == "clip+length_normalized"
    term = adapted_kl_term(KL, MASK, cfg, "bnpo", CTX)
    # clipped rows: [0.5, 1.0, 0.1] (L=3) and [1.0] (L=1)
    assert term.adapted.item() == pytest.approx((1.6 / 3 + 1.0) / 2, rel=1e-6)
    sigmoid_then_length = adapted_kl_term(KL, MASK, config("sigmoid+length_normalized+dynamic"), "dapo", CTX)
    row0 = sum(sig(k - 0.1) * k for k in (0.5, 2.0, 0.1)) / 3
    row1 = sig(2.9) * 3.0
    assert sigmoid_then_length.adapted.item() == pytest.approx((row0 + row1) / 2, rel=1e-6)


# The same by hand with completion 0 empty: sums 0 (L=0) and 3.0 (L=1); 1 token in all. The empty completion counts
# as one completion (B = 2) and adds no token: bnpo divides by 1, not by max(L_i, 1) summed (2).
EMPTY_FIRST_REDUCTIONS = {
    **dict.fromkeys(("grpo", "sapo"), (0.0 + 3.0 / 1) / 2),  # the mean of S_i / max(L_i, 1)
    "luspo": (0.0 + 3.0) / 2,
    "bnpo": 3.0 / 1,
    "dr_grpo": 3.0 / (2 * 4),
    **dict.fromkeys(("dapo", "cispo", "vespo"), 3.0 / 5.0),
}


@pytest.mark.parametrize("loss_type", sorted(EMPTY_FIRST_REDUCTIONS))
def test_empty_completion_does_not_divide_by_zero(loss_type: str) -> None:
    mask = torch.tensor([[0.0, 0.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
    assert reduce_kl(KL, mask, loss_type_reduction(loss_type), CTX).item() == pytest.approx(
        EMPTY_FIRST_REDUCTIONS[loss_type], rel=1e-6)
    term = adapted_kl_term(KL, mask, config("sigmoid+length_normalized"), loss_type, CTX)
    assert math.isfinite(term.adapted.item()) and math.isfinite(term.raw.item())
    assert set(EMPTY_FIRST_REDUCTIONS) == set(loss_types())


def test_non_finite_values_at_padded_positions_do_not_leak() -> None:
    kl = KL.clone()
    kl[0, 3] = float("inf")
    kl[1, 2] = float("nan")
    for loss_type in HAND_REDUCTIONS:
        assert reduce_kl(kl, MASK, loss_type_reduction(loss_type), CTX).item() == pytest.approx(
            HAND_REDUCTIONS[loss_type], rel=1e-6
        )


@pytest.mark.parametrize("requires_grad", [False, True])
def test_padded_non_finite_values_leave_the_input_untouched_and_get_no_gradient(requires_grad: bool) -> None:
    """The masking runs in place on its own product where nothing needs a gradient: never on the caller's KL."""
    kl = KL.clone()
    kl[0, 3] = float("inf")
    kl[1, 2] = float("nan")
    kl.requires_grad_(requires_grad)
    before = kl.detach().clone()
    term = adapted_kl_term(kl, MASK, config("sigmoid", kl_target=0.1), "grpo", CTX)
    assert torch.equal(kl.detach().isnan(), before.isnan()) and torch.equal(kl.detach().nan_to_num(), before.nan_to_num())
    # grpo: mean over completions of the per-token mean of sigmoid(k - 0.1) * k over the valid tokens.
    rows = [[0.5, 2.0, 0.1], [3.0]]
    expected = sum(sum(sig(k - 0.1) * k for k in row) / len(row) for row in rows) / 2
    assert term.adapted.item() == pytest.approx(expected, rel=1e-6)
    if requires_grad:
        term.adapted.backward()
        assert torch.isfinite(kl.grad).all() and kl.grad[0, 3].item() == 0.0 and kl.grad[1, 2].item() == 0.0


def test_the_stock_term_records_no_autograd_graph() -> None:
    """With the trainer's own KL term the adapted value only feeds the metrics: kl_term builds no graph for it,
    and its numbers are the eager core's."""
    kl, zeros = KL.clone().requires_grad_(True), torch.zeros(KL.shape)

    def term(settings):  # the pipeline's default: a graph only where the term replaces the trainer's own
        return kl_term(zeros, zeros, MASK, settings, loss_type="grpo", context=CTX, per_token_kl=kl)

    stock = term(config("none"))
    eager = adapted_kl_term(kl, MASK, config("none"), "grpo", CTX)
    assert stock.adapted.grad_fn is None and stock.adapted.item() == eager.adapted.item()
    assert eager.adapted.grad_fn is not None
    assert term(config("clip")).adapted.grad_fn is not None


@pytest.mark.parametrize("method", ["none", "clip", "sigmoid", "length_normalized", "dynamic", "sigmoid+dynamic"])
def test_log_ratio_of_plus_minus_50_gives_finite_term_and_gradient(method: str) -> None:
    logp = torch.tensor([[-1.0, -60.0, -1.0], [-55.0, -2.0, -3.0]], requires_grad=True)
    ref = torch.tensor([[-51.0, -10.0, -1.0], [-5.0, -2.0, -3.0]])
    kl = torch.exp(ref - logp) - (ref - logp) - 1  # k3; log-ratios -50, +50, 0, +50, 0, 0
    mask = torch.ones_like(ref)
    for loss_type in HAND_REDUCTIONS:
        term = adapted_kl_term(kl, mask, config(method), loss_type, CTX)
        term.adapted.backward(retain_graph=True)
        assert math.isfinite(term.adapted.item())
        assert torch.isfinite(logp.grad).all()
        logp.grad = None


def test_unknown_loss_type_is_rejected_with_the_allowed_values() -> None:
    with pytest.raises(ValueError, match=r"loss_type='nope'.*allowed is one of bnpo, cispo, dapo"):
        loss_type_reduction("nope")


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_kl_at_a_valid_position_raises_at_the_end_of_the_step_naming_it(value: float) -> None:
    """A NaN or inf at a valid position is never zeroed: the reduced KL is non-finite, and the runtime raises when it
    reads the step's statistics, before the optimizer step."""
    from unsloth_adaptive_kl.core.adaptive_kl import AdaptiveKL

    bad = KL.clone()
    bad[1, 0] = value  # valid
    assert not math.isfinite(adapted_kl_term(bad, MASK, config("none"), "bnpo", CTX).adapted.item())
    runtime = AdaptiveKL(config("none"), beta=0.04, loss_type="bnpo")
    term = adapted_kl_term(bad, MASK, config("none"), "bnpo", CTX)
    identity = lambda tensor: tensor  # noqa: E731  (one process)
    assert runtime.record(term, gather=identity, train=True, end_of_step=False, completed_steps=7) == []
    shown = "nan" if math.isnan(value) else "inf"
    with pytest.raises(FloatingPointError, match=rf"non-finite KL at step 7: raw_kl={shown}, adapted_kl={shown}"):
        runtime.record(term, gather=identity, train=True, end_of_step=True, completed_steps=7)


def test_the_methods_are_parsed_once_per_value_of_the_field(monkeypatch) -> None:
    """kl_methods, read on every loss call, parses kl_adaptation_method once (at construction) and not again for
    the same value; a field set anew is parsed anew, so the methods follow it."""
    from unsloth_adaptive_kl.core import config as config_module

    parsed = []
    parse = config_module.parse_methods
    monkeypatch.setattr(config_module, "parse_methods", lambda value: parsed.append(value) or parse(value))
    config = AdaptiveKLConfig(kl_adaptation_method="dynamic+clip")
    at_construction = len(parsed)
    logps, ref, mask = torch.full((2, 3), -1.0), torch.full((2, 3), -1.5), torch.ones(2, 3)
    for _ in range(3):
        kl_term(logps, ref, mask, config)
    assert config.kl_methods == ("clip", "dynamic") and len(parsed) == at_construction
    config.kl_adaptation_method = "sigmoid"
    assert config.kl_methods == ("sigmoid",) == config.kl_methods and parsed[at_construction:] == ["sigmoid"]
