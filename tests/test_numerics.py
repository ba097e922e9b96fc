"""SPEC rule 3.13 in the core: float32 whatever the input dtype (eagerly and in a torch.fx-traced loss), non-finite
log-probs on valid tokens raise (naming the step, the tensor and how many tokens), masked positions may hold anything
(`keep_valid` is torch.where); checkpoints carry a format version and the controller's kind (issue 27, items 1, 2, 5,
7; issue 32, item 3)."""

from __future__ import annotations

import json
from dataclasses import asdict
import math
import warnings

import pytest
import torch
import torch.fx

from unsloth_adaptive_kl import AdaptiveKL, AdaptiveKLConfig, NonFiniteLogProbError
from unsloth_adaptive_kl.core.reductions import ReductionContext
from unsloth_adaptive_kl.core.controllers import WindowKL
from unsloth_adaptive_kl.core.estimators import estimate_kl
from unsloth_adaptive_kl.core.numerics import in_float32, keep_valid
from unsloth_adaptive_kl.core.statistics import NAMES, KLStatistics

from .kl_terms import adapted_kl_term

# k1 in the loss and estimators other than the log-ratio in the reward warn by design; every estimator is exercised
# in both here.
pytestmark = pytest.mark.filterwarnings("ignore::unsloth_adaptive_kl.core.config.KLEstimatorWarning")

ESTIMATORS = ["k1", "k2", "k3", "low_var_kl", "k1+", "k3+", "k1_future", "k3_bottom_percentile"]
HALF = [torch.bfloat16, torch.float16]
BETA = 0.04


def config(**fields) -> AdaptiveKLConfig:
    return AdaptiveKLConfig(**fields)


def batch(b: int = 4, t: int = 16, seed: int = 0, scale: float = 0.3) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    logp = -torch.rand(b, t, generator=generator) * 4
    ref = logp + torch.randn(b, t, generator=generator) * scale
    lengths = torch.randint(1, t + 1, (b,), generator=generator)
    mask = (torch.arange(t)[None] < lengths[:, None]).float()
    return logp, ref, mask


# ----- float32 whatever the dtype -----------------------------------------------------------------------------------


def k3_term_by_hand(logp: torch.Tensor, ref: torch.Tensor, mask: torch.Tensor, loss_type: str) -> float:
    """The k3 KL term in float64 from the given values (independent of the core)."""
    r = ref.double() - logp.double()
    k = (torch.exp(r) - r - 1) * mask.double()
    sums, lengths = k.sum(-1), mask.double().sum(-1)
    if loss_type == "grpo":
        return float((sums / lengths.clamp(min=1)).mean().detach())
    assert loss_type == "bnpo"
    return float((sums.sum() / lengths.sum()).detach())


def in_dtype(dtype: torch.dtype, *tensors: torch.Tensor) -> list[torch.Tensor]:
    """The tensors in `dtype`: rounded for half precision; for float64, with a part below float32's precision added
    (1e-10 against an ulp of 2.4e-7 at these magnitudes), which rounding to float32 removes."""
    extra = 1e-10 if dtype == torch.float64 else 0.0
    return [x.to(dtype) + extra for x in tensors]


@pytest.mark.parametrize("dtype", [*HALF, torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("estimator", ESTIMATORS)
@pytest.mark.parametrize("method", ["none", "clip", "sigmoid+length_normalized+dynamic"])
def test_every_input_dtype_gives_the_float32_result_of_its_values_in_float32(dtype, estimator, method) -> None:
    settings = dict(kl_estimator=estimator, kl_adaptation_method=method, kl_clip_threshold=0.02)
    logp, ref, mask = batch()
    (logp, ref), mask = in_dtype(dtype, logp, ref), mask.to(dtype)  # the inputs as that dtype holds them
    half_leaf = logp.clone().requires_grad_(True)
    term, metrics = AdaptiveKL(config(**settings), BETA, "grpo").kl_loss(half_leaf, ref, mask)
    full_leaf = logp.float().requires_grad_(True)
    want, want_metrics = AdaptiveKL(config(**settings), BETA, "grpo").kl_loss(full_leaf, ref.float(), mask.float())
    assert term.dtype == torch.float32
    assert term.item() == pytest.approx(want.item(), rel=1e-6, abs=1e-12)
    assert metrics == pytest.approx(want_metrics, rel=1e-6, abs=1e-12)
    term.backward()
    want.backward()
    assert half_leaf.grad.dtype == dtype  # the gradient reaches the log-probs in their own dtype
    assert torch.equal(half_leaf.grad, full_leaf.grad.to(dtype))
    if estimator == "k3" and method == "none":  # and the float32 value is the k3 term of those inputs, by hand
        assert want.item() == pytest.approx(BETA * k3_term_by_hand(logp, ref, mask, "grpo"), rel=1e-5)


@pytest.mark.parametrize("dtype", [*HALF, torch.float64], ids=str)
def test_reward_penalty_of_any_input_dtype_is_the_float32_one(dtype) -> None:
    logp, ref, mask = batch(seed=1)
    (logp, ref), mask = in_dtype(dtype, logp, ref), mask.to(dtype)
    settings = dict(kl_placement="reward", kl_adaptation_method="clip", kl_clip_threshold=0.02)
    penalty = AdaptiveKL(config(**settings), BETA).reward_penalty(logp, ref, mask)[0]
    want = AdaptiveKL(config(**settings), BETA).reward_penalty(logp.float(), ref.float(), mask.float())[0]
    assert penalty.dtype == torch.float32
    torch.testing.assert_close(penalty, want, rtol=1e-6, atol=0)
    k1 = (logp.double() - ref.double()).clamp(max=0.02) * mask.double()  # the reward's default estimator, clipped
    torch.testing.assert_close(AdaptiveKL(config(**settings, kl_estimator="k1"), BETA).reward_penalty(logp, ref, mask)[0],
                               (BETA * k1.sum(-1)).float(), rtol=1e-5, atol=1e-7)


def test_an_fp16_log_ratio_of_19_nats_is_finite() -> None:
    logp = torch.tensor([[-20.0, -1.0]], dtype=torch.float16)
    ref = torch.tensor([[-1.0, -1.0]], dtype=torch.float16)
    mask = torch.ones(1, 2, dtype=torch.float16)
    term, metrics = AdaptiveKL(None, BETA, "bnpo").kl_loss(logp, ref, mask)
    # k3 of r = 19 (exp(19) = 1.8e8 overflows fp16's 65504), 0 for the second token; bnpo over 2 tokens
    assert term.item() == pytest.approx(BETA * (math.exp(19) - 19 - 1) / 2, rel=1e-6)
    assert metrics["adaptive_kl/raw_kl"] == pytest.approx((math.exp(19) - 20) / 2, rel=1e-6)


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_bnpo_over_80000_half_precision_tokens_counts_every_token(dtype) -> None:
    logp, ref, mask = batch(b=2, t=40_000, seed=2, scale=0.1)
    logp, ref, mask = logp.to(dtype), ref.to(dtype), torch.ones_like(mask, dtype=dtype)  # 80,000 valid tokens
    term, metrics = AdaptiveKL(None, BETA, "bnpo").kl_loss(logp, ref, mask)
    assert metrics["adaptive_kl/raw_kl"] > 0
    assert term.item() == pytest.approx(BETA * k3_term_by_hand(logp, ref, mask, "bnpo"), rel=1e-5)
    lengths = adapted_kl_term(torch.ones(2, 40_000, dtype=dtype), mask, config(), "bnpo",
                                         ReductionContext()).lengths
    assert lengths.dtype == torch.float32 and lengths.tolist() == [40_000.0, 40_000.0]


def test_float32_input_is_not_copied_and_a_float64_normaliser_is_rounded_too() -> None:
    x = torch.zeros(3)
    assert in_float32(x) is x and in_float32(x.double()).dtype == torch.float32
    logp, ref, mask = batch()
    normaliser = torch.tensor(mask.sum().item() + 1e-9, dtype=torch.float64)  # float32 rounds the 1e-9 away
    term, _ = AdaptiveKL(None, BETA, "dapo").kl_loss(logp.double(), ref.double(), mask.double(),
                                                     token_normalizer=normaliser)
    want, _ = AdaptiveKL(None, BETA, "dapo").kl_loss(logp, ref, mask, token_normalizer=mask.sum())
    assert term.dtype == torch.float32 and torch.equal(term, want)


def test_a_finite_float64_log_prob_beyond_float32_is_refused_saying_why() -> None:
    """-1e300 is finite in float64 and -inf in float32, the precision the KL is computed in: refused, and the message
    says so (it read "NaN or +-inf" of a finite value, with no word of the rounding)."""
    with pytest.raises(NonFiniteLogProbError, match=r"in the policy log-probs: 2 valid token\(s\) on process 0\. "
                                                    r".* must be finite in float32, the precision the KL is computed "
                                                    r"in \(a float64 beyond 3\.4e38 in magnitude is not\)"):
        AdaptiveKL(None, BETA).kl_loss(torch.full((1, 2), -1e300, dtype=torch.float64), torch.full((1, 2), -1.0),
                                       torch.ones(1, 2))
    term, _ = AdaptiveKL(None, BETA).kl_loss(torch.full((1, 2), -1e38, dtype=torch.float64), torch.full((1, 2), -1e38),
                                             torch.ones(1, 2))
    assert term.item() == 0.0  # within float32's range: accepted (equal log-probs, KL 0)


@pytest.mark.parametrize("dtype", [*HALF, torch.float64], ids=str)
def test_a_torch_fx_traced_loss_computes_in_float32(dtype) -> None:
    """Tinker's route: torch.fx traces the core, where a tensor is a Proxy without a dtype, so `in_float32` is the
    one conversion there. The traced k3 term of half-precision or float64 log-probs is float32 and equals the float32
    computation of the same values in float32; a half-precision computation differs (exp and the sums rounded to 8 or
    11 bits)."""
    settings = config(kl_estimator="k3", kl_adaptation_method="clip", kl_clip_threshold=0.02)
    logp, ref, mask = batch(seed=7)
    logp, ref = in_dtype(dtype, logp, ref)

    def loss(logp: torch.Tensor, ref: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        per_token = estimate_kl(logp, ref, mask, settings)
        return per_token, adapted_kl_term(per_token, mask, settings, "bnpo", ReductionContext()).adapted

    per_token, term = torch.fx.symbolic_trace(loss)(logp, ref, mask)
    want_per_token, want_term = loss(logp.float(), ref.float(), mask)
    assert per_token.dtype == term.dtype == torch.float32
    assert torch.equal(per_token, want_per_token) and torch.equal(term, want_term)
    r = ref.double() - logp.double()  # by hand: clip(k3, 0.02) over the valid tokens, bnpo
    k3 = ((torch.exp(r) - r - 1).clamp(max=0.02) * mask.double()).sum() / mask.double().sum()
    assert term.item() == pytest.approx(k3.item(), rel=1e-6)


# ----- non-finite log-probs on valid tokens ---------------------------------------------------------------------------


@pytest.mark.parametrize("estimator", ESTIMATORS)
@pytest.mark.parametrize("which", ["policy", "reference"])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
def test_a_non_finite_log_prob_on_valid_tokens_raises_naming_step_tensor_and_count(estimator, which, value) -> None:
    logp, ref, mask = batch()
    bad = logp if which == "policy" else ref
    bad[0, 0] = bad[1, 0] = value  # two valid tokens (every completion has length >= 1)
    runtime = AdaptiveKL(config(kl_estimator=estimator), BETA, "grpo")
    runtime.step()  # the next step is step 2
    pattern = rf"non-finite input at step 2: .*in the {which} log-probs: 2 valid token\(s\)"
    with pytest.raises(NonFiniteLogProbError, match=pattern):
        runtime.kl_loss(logp.requires_grad_(True), ref, mask)
    reward = AdaptiveKL(config(kl_estimator=estimator, kl_placement="reward"), BETA)
    with pytest.raises(NonFiniteLogProbError, match=rf"at step 1: .*{which} log-probs: 2 valid token"):
        reward.reward_penalty(logp.detach(), ref, mask)[0]


@pytest.mark.parametrize("method", ["none", "target"])
def test_a_batch_whose_kl_is_refused_leaves_the_step_as_it_was(method) -> None:
    """Finite log-probs whose k3 overflows (r = 100 on one token) raise FloatingPointError; a loop that skips the
    batch continues as if it never came. kl_loss kept its inf in the step's sums before it raised: every later step
    refused WindowKL.token_mean=inf (with `none` too) and state_dict() held Infinity."""
    fields = dict(kl_target=0.05, kl_horizon=1000.0) if method == "target" else {}
    mask = torch.ones(1, 3)
    good = (torch.tensor([[-1.0, -1.1, -0.9]]), torch.tensor([[-1.2, -1.0, -1.0]]))
    overflow = (torch.tensor([[-1.0, -100.0, -0.9]]), torch.tensor([[-1.2, 0.0, -1.0]]))
    skipped, alone = (AdaptiveKL(config(kl_adaptation_method=method, **fields), 0.1) for _ in range(2))
    with pytest.raises(FloatingPointError, match="non-finite KL at step 1: raw_kl=inf"):
        skipped.kl_loss(*overflow, mask)
    for runtime in (skipped, alone):
        runtime.kl_loss(*good, mask)
    assert skipped.state_dict() == alone.state_dict()
    json.dumps(skipped.state_dict(), allow_nan=False)
    assert skipped.step() == alone.step()  # target: 0.1 * (1 + clip((0.0096 - 0.05) / 0.05) / 1000)


def test_the_trainer_path_reports_non_finite_input_at_the_end_of_the_step_without_a_transfer_before() -> None:
    """The check rides in the one statistics row per optimizer step: queuing micro-batches reads nothing back."""
    logp, ref, mask = batch()
    ref[2, 0] = math.nan
    runtime = AdaptiveKL(config(kl_adaptation_method="clip"), BETA, "grpo")
    identity = lambda tensor: tensor  # noqa: E731  (one process)
    clean = runtime.term(logp, logp, mask, per_token_kl=torch.zeros_like(logp))
    bad_kl = torch.exp(ref - logp) - (ref - logp) - 1
    bad = runtime.term(logp, ref, mask, per_token_kl=bad_kl)
    assert runtime.record(clean, gather=identity, train=True, end_of_step=False, completed_steps=5) == []
    assert runtime.record(bad, gather=identity, train=True, end_of_step=False, completed_steps=5) == []
    with pytest.raises(NonFiniteLogProbError, match=r"at step 5: .*reference log-probs: 1 "):
        runtime.record(clean, gather=identity, train=True, end_of_step=True, completed_steps=5)


def test_other_processes_non_finite_input_raises_on_every_process_naming_the_process_that_saw_it() -> None:
    """A NaN on process 1 only: process 0 (this one) raises too, and its error says the tokens were process 1's,
    whose count only process 1 holds (on b3d53c1 it said "0 valid token(s) on this process"). A NaN on both: this
    process's tokens counted, the other's named."""
    logp, ref, mask = batch()
    runtime = AdaptiveKL(None, BETA, "grpo")

    def gather(rows: torch.Tensor) -> torch.Tensor:  # a two-process gather: process 1's reference sum is NaN
        other = rows.clone()
        other[:, NAMES.index("reference_logps")] = math.nan
        return torch.cat([rows, other])

    with pytest.raises(NonFiniteLogProbError) as raised:
        runtime.kl_loss(logp, ref, mask, gather=gather)
    message = str(raised.value)
    assert ("reference log-probs: non-finite on process 1 (its sum over the valid tokens: "
            "that process counts them)") in message
    assert "process 0" not in message and "policy" not in message.split(" in the ")[1].split(".")[0]
    ref[0, 0] = math.nan
    with pytest.raises(NonFiniteLogProbError, match=r"reference log-probs: 1 valid token\(s\) "
                                                    r"on process 0; reference log-probs: "
                                                    r"non-finite on process 1"):
        runtime.kl_loss(logp, ref, mask, gather=gather)


# ----- log-probs above 0: negative log-likelihoods passed by mistake -----------------------------------------------


def nll_batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(-log p of the policy, -log p of the reference, mask): what F.cross_entropy(..., reduction='none') returns for
    sampled tokens, on a (3, 5) batch with 2 padded positions."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, 5, 11, generator=generator)
    ref_logits = logits + 0.2 * torch.randn(3, 5, 11, generator=generator)
    tokens = torch.randint(0, 11, (3, 5), generator=generator)
    mask = torch.ones(3, 5)
    mask[2, 3:] = 0
    nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), tokens, reduction="none")
    ref_nll = torch.nn.functional.cross_entropy(ref_logits.transpose(1, 2), tokens, reduction="none")
    return nll.requires_grad_(True), ref_nll, mask


def mean_over_valid(x: torch.Tensor, mask: torch.Tensor) -> float:
    return float((x.double() * mask.double()).sum() / mask.double().sum())


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_negative_log_likelihoods_for_log_probs_are_refused_naming_each_tensor_and_its_mean(estimator) -> None:
    """Passed F.cross_entropy's -log p instead of log p, every estimator computed a finite, plausible KL of the wrong
    quantity (k3 of the negated log-ratio) without a word. Each door's sums of the valid log-probs hold their mean:
    above 0.01 a token it is refused, naming the tensor and its mean, and the step is left as it was; the negation of
    the same tensors trains."""
    nll, ref_nll, mask = nll_batch()
    policy, reference = mean_over_valid(nll, mask), mean_over_valid(ref_nll, mask)
    assert policy > 1 and reference > 1  # log(11) = 2.4 for a uniform guess
    runtime = AdaptiveKL(config(kl_estimator=estimator), BETA, "grpo")
    with pytest.raises(ValueError, match=rf"^adaptive KL: log-probs above 0 at step 1: over its 13 valid \(mask=1\) "
                                         rf"tokens: policy log-probs average \+{policy:.4g} a token; reference "
                                         rf"log-probs average \+{reference:.4g} a token\. .*pass their negation\.$"):
        runtime.kl_loss(nll, ref_nll, mask)
    fresh = AdaptiveKL(config(kl_estimator=estimator), BETA, "grpo")
    for akl in (runtime, fresh):
        akl.kl_loss(-nll, -ref_nll, mask)
    assert runtime.state_dict() == fresh.state_dict()
    reward = AdaptiveKL(config(kl_estimator=estimator, kl_placement="reward"), BETA)
    with pytest.raises(ValueError, match=rf"at step 1: .*reference log-probs average \+{reference:.4g} a token\."):
        reward.reward_penalty(-nll.detach(), ref_nll, mask)


def test_the_trainer_path_refuses_negative_log_likelihoods_at_the_end_of_the_step_over_its_micro_batches() -> None:
    """A trainer's micro-batches are recorded without a transfer and checked together at the step's end: the
    policy's mean there is over the three batches' valid tokens (the NLL batch's +m over 13 tokens, twice -0.1 m
    over 13 in the log-probs' batch: 0.8 m / 3)."""
    nll, ref_nll, mask = nll_batch()
    runtime = AdaptiveKL(config(kl_adaptation_method="clip"), BETA, "grpo")
    identity = lambda tensor: tensor  # noqa: E731  (one process)
    real = runtime.term(-nll.detach() * 0.1, -ref_nll * 0.1, mask)
    wrong = runtime.term(nll.detach(), -ref_nll * 0.1, mask)
    assert runtime.record(real, gather=identity, train=True, end_of_step=False, completed_steps=5) == []
    assert runtime.record(wrong, gather=identity, train=True, end_of_step=False, completed_steps=5) == []
    mean = 0.8 * mean_over_valid(nll, mask) / 3
    with pytest.raises(ValueError, match=rf"at step 5: over its 39 valid .*: policy log-probs average "
                                         rf"\+{mean:.4g} a token\. "):
        runtime.record(real, gather=identity, train=True, end_of_step=True, completed_steps=5)


@pytest.mark.parametrize("dtype", [*HALF, torch.float32], ids=str)
def test_the_log_probs_of_a_near_certain_model_in_any_precision_are_accepted(dtype) -> None:
    """The check's margin: the log-probs of a model sure of every token (its logit 60 above the others, normal about
    0: log p = -32000 e^-60 ~ -3e-22 in exact arithmetic), computed in bf16, fp16 or float32 by log_softmax and by
    x - logsumexp(x), round to 0 (not above), and masked positions holding +1e4 are not read: each batch trains
    without a word, so a ceiling of 0 itself is not too tight for a trainer's own log-probs."""
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 6, 32000, generator=generator)
    tokens = torch.randint(0, 32000, (4, 6, 1), generator=generator)
    logits = logits.scatter_add(-1, tokens, torch.full((4, 6, 1), 60.0)).to(dtype)
    by_softmax = torch.log_softmax(logits, -1).gather(-1, tokens).squeeze(-1)
    by_logsumexp = (logits.gather(-1, tokens) - torch.logsumexp(logits, -1, keepdim=True)).squeeze(-1)
    mask = torch.ones(4, 6)
    mask[:, 4:] = 0
    for logps in (by_softmax, by_logsumexp):
        assert float(logps.float().max()) == 0.0 and float(logps.float().min()) > -1e-6
        logps = torch.where(mask.bool(), logps, torch.tensor(1e4, dtype=dtype))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            AdaptiveKL(None, BETA).kl_loss(logps.requires_grad_(True), logps.detach(), mask)


# ----- masked positions may hold anything --------------------------------------------------------------------------

GARBAGE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf, "huge": 1e4, "-huge": -1e4}


@pytest.mark.parametrize("estimator", ESTIMATORS)
@pytest.mark.parametrize("garbage", sorted(GARBAGE))
@pytest.mark.parametrize("where", ["policy", "reference", "both"])
def test_anything_on_masked_positions_gives_the_clean_value_and_finite_gradients(estimator, garbage, where) -> None:
    logp, ref, mask = batch(seed=3)
    assert (mask == 0).any()
    dirty_logp, dirty_ref = logp.clone(), ref.clone()
    if where in ("policy", "both"):
        dirty_logp[mask == 0] = GARBAGE[garbage]
    if where in ("reference", "both"):
        dirty_ref[mask == 0] = -GARBAGE[garbage]
    settings = dict(kl_estimator=estimator, kl_adaptation_method="sigmoid")
    results = []
    for lp, rf in ((logp, ref), (dirty_logp, dirty_ref)):
        leaf = lp.clone().requires_grad_(True)
        term, metrics = AdaptiveKL(config(**settings), BETA, "bnpo").kl_loss(leaf, rf, mask)
        (grad,) = torch.autograd.grad(term, leaf)
        results.append((term, metrics, grad))
    (clean, clean_metrics, clean_grad), (dirty, dirty_metrics, dirty_grad) = results
    assert torch.isfinite(dirty) and torch.isfinite(dirty_grad).all()
    assert dirty.item() == clean.item() and dirty_metrics == clean_metrics
    assert torch.equal(dirty_grad, clean_grad) and (dirty_grad[mask == 0] == 0).all()
    assert clean_grad.abs().sum() > 0 or estimator == "k3_bottom_percentile"
    penalty = AdaptiveKL(config(kl_estimator=estimator, kl_placement="reward"), BETA).reward_penalty(
        dirty_logp, dirty_ref, mask)[0]
    want = AdaptiveKL(config(kl_estimator=estimator, kl_placement="reward"), BETA).reward_penalty(logp, ref, mask)[0]
    assert torch.equal(penalty, want)


def test_a_per_token_kl_with_garbage_on_masked_positions_gives_finite_values_and_zero_gradient_there() -> None:
    """A KL handed over (`per_token_kl`): its masked positions are dropped by `torch.where`, with a zero gradient."""
    logp, ref, mask = batch(seed=4)
    kl = (ref - logp).square().requires_grad_(True)
    dirty = kl.detach().clone()
    dirty[mask == 0] = math.nan
    dirty.requires_grad_(True)
    term, _ = AdaptiveKL(None, BETA, "grpo").kl_loss(logp, ref, mask, per_token_kl=dirty)
    want, _ = AdaptiveKL(None, BETA, "grpo").kl_loss(logp, ref, mask, per_token_kl=kl)
    (grad,) = torch.autograd.grad(term, dirty)
    (want_grad,) = torch.autograd.grad(want, kl)
    assert term.item() == want.item() and torch.equal(grad, want_grad) and (grad[mask == 0] == 0).all()


MASKS = {"float": lambda m: m, "long": lambda m: m.long(), "bool": lambda m: m.bool(),
         "float, nonzero not 1": lambda m: m * torch.tensor([0.5, 2.0, -1.0, 3.0])[:, None]}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, *HALF], ids=str)
@pytest.mark.parametrize("mask_kind", sorted(MASKS))
@pytest.mark.parametrize("grad", [False, True], ids=["no grad", "grad"])
def test_keep_valid_is_torch_where_bit_for_bit_values_and_gradients(dtype, mask_kind, grad) -> None:
    """The core's masking against `torch.where(mask != 0, x, 0)` written out: the same bits on every position (a NaN or
    inf on a valid token stays, anything on a masked one is 0), the same gradient (0 on masked positions), float32
    whatever the dtype."""
    logp, _, mask = batch(seed=5)
    mask = MASKS[mask_kind](mask)
    x = logp.to(dtype)
    valid = (mask != 0).nonzero()
    padded = (mask == 0).nonzero()
    x[tuple(valid[0])], x[tuple(valid[1])], x[tuple(valid[2])] = math.nan, math.inf, -math.inf
    for index, value in zip(padded[:4], (math.nan, math.inf, -math.inf, 1e4)):
        x[tuple(index)] = value
    leaf, want_leaf = x.clone().requires_grad_(grad), x.clone().requires_grad_(grad)
    got = keep_valid(leaf, mask)
    want = torch.where(mask != 0, want_leaf.to(torch.float32), 0.0)
    assert got.dtype == want.dtype and torch.equal(got.nan_to_num(), want.nan_to_num())
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.isposinf(), want.isposinf())
    assert got[mask == 0].eq(0).all()
    if grad:
        upstream = torch.randn(got.shape, generator=torch.Generator().manual_seed(1)).to(got.dtype)
        (grad_got,) = torch.autograd.grad(got, leaf, upstream)
        (grad_want,) = torch.autograd.grad(want, want_leaf, upstream)
        assert grad_got.dtype == dtype and torch.equal(grad_got, grad_want)
        assert grad_got[mask == 0].eq(0).all() and torch.isfinite(grad_got).all()


def test_a_mask_changed_in_place_is_converted_again() -> None:
    """No mask is remembered between calls: an in-place change of the mask is seen."""
    logp, _, mask = batch(seed=6)
    assert torch.equal(keep_valid(logp, mask), torch.where(mask != 0, logp, 0.0))
    mask[0] = 0.0
    mask[1] = 1.0
    assert torch.equal(keep_valid(logp, mask), torch.where(mask != 0, logp, 0.0))
    assert torch.equal(keep_valid(logp.double(), mask), torch.where(mask != 0, logp.double(), 0.0))


# ----- checkpoints: format version and controller kind ---------------------------------------------------------------

KINDS = {"constant": "clip", "dynamic": "dynamic", "target": "target"}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_state_dict_carries_a_format_version_and_the_controller_kind(kind) -> None:
    """...and is strict JSON before the first reward (its batch_reward, NaN in the controller, was written as a bare
    NaN, which JSON readers other than Python's refuse), and loads back to that NaN; a NaN written before loads too."""
    state = AdaptiveKL(config(kl_adaptation_method=KINDS[kind]), 0.1).state_dict()
    assert state["format_version"] == 7 and state["controller"] == kind and state["batch_reward"] is None
    json.dumps(state, allow_nan=False)
    for saved in (state, {**state, "batch_reward": math.nan}):
        runtime = AdaptiveKL(config(kl_adaptation_method=KINDS[kind]), 0.2)
        with warnings.catch_warnings():
            # a constant beta keeps the run's 0.2, saying so; a moving one continues, saying that the run was built
            # with another beta (both tested below), and is loaded within the bounds without a clamp warning
            warnings.filterwarnings("ignore" if kind == "constant" else "error", "adaptive KL: the loaded state")
            warnings.filterwarnings("ignore", "adaptive KL: this run's beta=0.2 is not the beta=0.1")
            runtime.load_state_dict(json.loads(json.dumps(saved)))
        assert math.isnan(runtime.controller.batch_reward)
        assert runtime.current_beta == (0.2 if kind == "constant" else 0.1)


@pytest.mark.parametrize("saved", sorted(KINDS))
@pytest.mark.parametrize("loaded", sorted(KINDS))
def test_a_state_of_another_kind_is_refused_naming_both(saved, loaded) -> None:
    state = AdaptiveKL(config(kl_adaptation_method=KINDS[saved]), 0.1).state_dict()
    runtime = AdaptiveKL(config(kl_adaptation_method=KINDS[loaded]), 0.2)
    if saved == loaded:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore" if saved == "constant" else "error", "adaptive KL: the loaded state")
            warnings.filterwarnings("ignore", "adaptive KL: this run's beta=0.2 is not the beta=0.1")  # tested below
            runtime.load_state_dict(state)
        assert runtime.current_beta == (0.2 if saved == "constant" else 0.1)
        return
    with pytest.raises(ValueError, match=rf"a '{saved}' controller's state cannot be loaded into this run's "
                                         rf"'{loaded}' controller"):
        runtime.load_state_dict(state)
    assert runtime.current_beta == 0.2  # nothing loaded



def test_a_loaded_beta_is_said_where_it_overrides_this_runs_settings() -> None:
    """own-loop.md's way to change a setting mid-run (a new AdaptiveKL, then load the old state): the state's beta
    replaced a new constant beta without a word (which a trainer's own KL term, at the run's beta, did not follow: a
    constant beta is now the run's, saying so), and stayed outside new bounds (a target's 0.5 above a new
    beta_max=0.2; a dynamic 0.01 below a new beta_min=0.05, until its next decay jumped to it; a dynamic 1.0 above
    a new beta=0.1, which dynamic only lowers)."""
    def state(method: str, beta: float, **fields: float) -> dict:
        """A state at `beta` of a run built, as this one, with beta=0.1 (one built with another says so: below)."""
        saved = AdaptiveKL(config(kl_adaptation_method=method, **fields), 0.1)
        saved.controller.value = beta
        return saved.state_dict()

    cases = [("clip", {}, 0.04, 0.1, r"^adaptive KL: the loaded state's beta 0\.04 is not this run's beta=0\.1: a "
                                       r"constant beta is the run's own setting, so 0\.1 is kept \(the rest of the "
                                       r"state is loaded\)\.$"),
             ("target", {"beta_max": 0.2}, 0.5, 0.2, r"^adaptive KL: the loaded state's beta 0\.5 is outside this "
                                                     r"run's beta_min=0, beta_max=0\.2: clamped to 0\.2, as target "
                                                     r"keeps beta within them\.$"),
             ("dynamic", {"beta_min": 0.05}, 0.01, 0.05, r"beta 0\.01 is outside this run's beta_min=0\.05, "
                                                         r"beta=0\.1: clamped to 0\.05"),
             ("dynamic", {}, 1.0, 0.1, r"^adaptive KL: the loaded state's beta 1 is outside this run's beta_min=0, "
                                       r"beta=0\.1: clamped to 0\.1, as dynamic keeps beta within them\.$")]
    for method, fields, saved, loaded, message in cases:
        runtime = AdaptiveKL(config(kl_adaptation_method=method, **fields), 0.1)
        with pytest.warns(UserWarning, match=message):
            runtime.load_state_dict(state(method, saved))
        assert runtime.current_beta == loaded
    with warnings.catch_warnings():  # a resume of the same settings is quiet
        warnings.simplefilter("error")
        AdaptiveKL(config(kl_adaptation_method="clip"), 0.1).load_state_dict(state("clip", 0.1))
        AdaptiveKL(config(kl_adaptation_method="target", beta_max=0.2), 0.1).load_state_dict(
            state("target", 0.15, beta_max=0.2))
        AdaptiveKL(config(kl_adaptation_method="dynamic"), 0.1).load_state_dict(state("dynamic", 0.05))


@pytest.mark.parametrize("method", ["dynamic", "target"])
def test_a_moving_beta_resumed_with_another_beta_says_the_checkpoints_continues(method) -> None:
    """A dynamic or target run resumed with a new `beta` continued from the checkpoint's moved beta without a word
    (the state did not record the beta its run was built with). Format 7 records it: the resume says which beta
    continues and how to start from the new one; a format 6 state, which cannot tell, loads quietly as before."""
    saved = AdaptiveKL(config(kl_adaptation_method=method), 0.1)
    saved.controller.value = 0.05  # moved during the checkpoint's run
    state = saved.state_dict()
    assert state["configured_beta"] == 0.1
    resumed = AdaptiveKL(config(kl_adaptation_method=method), 0.2)
    with pytest.warns(UserWarning) as caught:
        resumed.load_state_dict(json.loads(json.dumps(state)))
    assert [str(w.message) for w in caught] == [
        f"adaptive KL: this run's beta=0.2 is not the beta=0.1 the checkpoint's run was built with: {method} moves "
        "beta, so the run continues from the checkpoint's beta 0.05. To start from 0.2 instead, resume without the "
        "adaptive KL state."]
    assert resumed.current_beta == 0.05
    # a new beta that also bounds the checkpoint's (dynamic only lowers beta; target's beta_max) says both at once
    bound = {"dynamic": ("beta", {}), "target": ("beta_max", {"beta_max": 0.02})}[method]
    resumed = AdaptiveKL(config(kl_adaptation_method=method, **bound[1]), 0.01)
    with pytest.warns(UserWarning) as caught:
        resumed.load_state_dict(state)
    assert [str(w.message) for w in caught] == [
        f"adaptive KL: this run's beta=0.01 is not the beta=0.1 the checkpoint's run was built with: {method} moves "
        f"beta, so the run continues from the checkpoint's beta 0.05, outside this run's beta_min=0, "
        f"{bound[0]}={0.01 if method == 'dynamic' else 0.02}: clamped to {0.01 if method == 'dynamic' else 0.02}, "
        f"as {method} keeps beta within them. To start from 0.01 instead, resume without the adaptive KL state."]
    old = {key: value for key, value in state.items() if key != "configured_beta"}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        AdaptiveKL(config(kl_adaptation_method=method), 0.2).load_state_dict({**old, "format_version": 6})


@pytest.mark.parametrize("method", ["dynamic", "target"])
def test_a_moving_state_loaded_at_beta_0_keeps_the_kl_term_off(method) -> None:
    """beta=0 turns the KL term off (a trainer takes the stock path), but a target state's 0.05 loaded into it was
    kept: kl_loss returned a KL term again in a loop of your own. dynamic clamped it to 0 already, saying that the
    run continued from 0.05. Both keep 0 now, and say that beta=0 turns the term off."""
    saved = AdaptiveKL(config(kl_adaptation_method=method), 0.1)
    saved.controller.value = 0.05
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # beta=0's own warning at construction
        resumed = AdaptiveKL(config(kl_adaptation_method=method), 0.0)
    with pytest.warns(UserWarning) as caught:
        resumed.load_state_dict(saved.state_dict())
    assert [str(w.message) for w in caught] == [
        f"adaptive KL: the loaded state's beta 0.05 is not this run's beta=0: beta=0 turns the KL term off, whatever "
        f"{method}'s beta, so 0 is kept (the rest of the state is loaded)."]
    assert resumed.current_beta == 0.0
    logps = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    term, _ = resumed.kl_loss(logps, torch.tensor([[-1.5, -1.0]]), torch.ones(1, 2))
    assert term.item() == 0.0


def test_a_target_state_at_beta_0_is_refused_where_the_run_has_a_kl_term() -> None:
    """target's update multiplies beta: from a loaded 0 the KL term stayed off for the rest of a run whose beta is
    > 0, without a word. With beta_min=0 it is refused, and nothing of the state is loaded; with beta_min > 0 the
    clamp lifts it to beta_min, saying so."""
    saved = AdaptiveKL(config(kl_adaptation_method="target", kl_target=0.1), 0.1).state_dict()
    saved["value"], saved["completed_steps"] = 0.0, 7
    runtime = AdaptiveKL(config(kl_adaptation_method="target", kl_target=0.1), 0.1)
    with pytest.raises(ValueError, match=r"^adaptive KL state: value=0\.0 is invalid: allowed is a number > 0 for "
                                         r"target with beta_min=0: its multiplicative update never leaves 0"):
        runtime.load_state_dict(saved)
    assert (runtime.current_beta, runtime.completed_steps) == (0.1, 0)
    floored = AdaptiveKL(config(kl_adaptation_method="target", kl_target=0.1, beta_min=0.01), 0.1)
    with pytest.warns(UserWarning, match=r"beta 0 is outside this run's beta_min=0\.01: clamped to 0\.01"):
        floored.load_state_dict(saved)
    assert (floored.current_beta, floored.completed_steps) == (0.01, 7)


def test_target_says_when_its_beta_underflows_to_0() -> None:
    """n / kl_horizon = 4.9 (under check_horizon's 5) multiplies beta by 1 - 0.2 * 4.9 = 0.02 a step while the KL is
    below the target: 0.1 * 0.02^k reaches float64's smallest number and then 0 (from which it never returns) within
    200 steps, the KL term then off without a word. Said once, at the step it happens."""
    akl = AdaptiveKL(config(kl_adaptation_method="target", kl_target=1.0, kl_horizon=10.0), 0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        betas = [akl.step(kl=WindowKL(0.01, 0.01, 49.0)) for _ in range(200)]
    zero = betas.index(0.0)
    assert betas[zero - 1] > 0 and set(betas[zero:]) == {0.0}
    said = [str(w.message) for w in caught if "underflowed" in str(w.message)]
    assert said == [f"adaptive KL: target's beta underflowed to 0 at step {zero + 1} (beta_min=0): its multiplicative "
                    "update never leaves 0, so the KL term is off for the rest of the run. Set beta_min > 0 for a "
                    "floor, or a larger kl_horizon for smaller updates."]


def test_a_format_5_state_without_the_old_policys_sum_loads_it_as_0() -> None:
    """Format 6 added `old_logps` to the step's sums; a state written before it resumes with 0 there, and a format 6
    state carries it through a save and load."""
    state = AdaptiveKL(config(kl_adaptation_method="target", kl_target=0.1), 0.1).state_dict()
    state["trained"].update(completions=1.0, tokens=2.0, kl=0.3, policy_logps=-3.0, old_logps=-0.75)
    old = {**{k: v for k, v in state.items() if k != "configured_beta"}, "format_version": 5,
           "trained": {k: v for k, v in state["trained"].items() if k != "old_logps"}}
    for saved, expected in ((old, 0.0), (state, -0.75)):
        resumed = AdaptiveKL(config(kl_adaptation_method="target", kl_target=0.1), 0.1)
        resumed.load_state_dict(json.loads(json.dumps(saved)))
        assert resumed.state_dict()["trained"] == {**state["trained"], "old_logps": expected}


def test_a_newer_format_and_unknown_fields_are_refused() -> None:
    runtime = AdaptiveKL(config(kl_adaptation_method="dynamic"), 0.1)
    with pytest.raises(ValueError, match=r"format_version=8 is not supported: allowed is 1 to 7"):
        runtime.load_state_dict({**runtime.state_dict(), "format_version": 8})
    # True read as format 1 (a bool is an int to Python): refused as no version at all
    with pytest.raises(ValueError, match=r"format_version=True is not supported: allowed is 1 to 7"):
        runtime.load_state_dict({**runtime.state_dict(), "format_version": True})
    with pytest.raises(ValueError, match=r"unknown field\(s\) beta for a 'dynamic' controller"):
        runtime.load_state_dict({**runtime.state_dict(), "beta": 0.3})


@pytest.mark.parametrize(("change", "message"), [
    ({"value": -5.0}, "adaptive KL state: value=-5.0 is invalid: allowed is a finite number >= 0 (beta)."),
    ({"value": math.nan}, "adaptive KL state: value=nan is invalid: allowed is a finite number >= 0 (beta)."),
    ({"value": "0.1"}, "adaptive KL state: value='0.1' is invalid: allowed is a finite number >= 0 (beta)."),
    ({"completed_steps": -3}, "adaptive KL state: completed_steps=-3 is invalid: allowed is an integer >= 0."),
    # a bool is no step count, here as at record_sums
    ({"completed_steps": True}, "adaptive KL state: completed_steps=True is invalid: allowed is an integer >= 0."),
    ({"value": None}, "adaptive KL state: value=None is invalid: allowed is a finite number >= 0 (beta)."),
    # each beside a good step count, which was loaded before the bad field raised (without naming it, for the first)
    ({"completed_steps": 7, "last_raw_kl": "x"},
     "adaptive KL state: last_raw_kl='x' is invalid: allowed is None or a finite number (the last step's KL)."),
    # a count of "3" loaded, and the next step without a reward decayed beta again (no new batch)
    ({"completed_steps": 7, "generation_batch": "3"},
     "adaptive KL state: generation_batch='3' is invalid: allowed is an integer >= 0 (a count)."),
    ({"completed_steps": 7, "batch_reward": "0.9"},
     "adaptive KL state: batch_reward='0.9' is invalid: allowed is a finite number, or None (or NaN) before the "
     "first reward."),
    # +inf loaded, and dynamic decayed on it at the next step, where step(mean_reward=inf) is refused at every door
    ({"completed_steps": 7, "generation_batch": 3, "last_decayed_batch": 2, "batch_reward": math.inf},
     "adaptive KL state: batch_reward=inf is invalid: allowed is a finite number, or None (or NaN) before the "
     "first reward."),
    ({"completed_steps": 7, "trained": {"kl_sum": 1.0}},
     "adaptive KL state: trained={'kl_sum': 1.0} is invalid: allowed is None, or the sums by name (completions, "
     "tokens, kl, tokens_sq, tokens_kl, kl_sq, entries, raw, adapted, clipped, policy_logps, reference_logps, "
     "old_logps), each a finite number (completions, tokens, tokens_sq, entries, "
     "clipped and kl_sq >= 0)."),
    # the package never writes a non-finite sum (a batch whose KL is not finite is refused before it is kept)
    ({"completed_steps": 7, "trained": {"kl": math.inf}},
     "adaptive KL state: trained={'kl': inf} is invalid: allowed is None, or the sums by name (completions, tokens, kl, "
     "tokens_sq, tokens_kl, kl_sq, entries, raw, adapted, clipped, policy_logps, reference_logps, old_logps), each "
     "a finite number (completions, tokens, tokens_sq, entries, clipped and kl_sq >= 0)."),
    ({"completed_steps": 7, "scored": {"kl": "1"}},
     "adaptive KL state: scored={'kl': '1'} is invalid: allowed is None, or the sums by name (completions, tokens, kl, "
     "tokens_sq, tokens_kl, kl_sq, entries, raw, adapted, clipped, policy_logps, reference_logps, old_logps), each "
     "a finite number (completions, tokens, tokens_sq, entries, clipped and kl_sq >= 0)."),
    # a negative count (hand-edited; the package never writes one) loaded into the next step's KL and metrics
    ({"completed_steps": 7, "configured_beta": "0.1"},
     "adaptive KL state: configured_beta='0.1' is invalid: allowed is a finite number >= 0 (the beta the "
     "checkpoint's run was built with)."),
    ({"completed_steps": 7, "trained": {**asdict(KLStatistics()), "tokens": -4.0}},
     f"adaptive KL state: trained={ {**asdict(KLStatistics()), 'tokens': -4.0} !r} is invalid: allowed is None, or "
     "the sums by name (completions, tokens, kl, tokens_sq, tokens_kl, kl_sq, entries, raw, adapted, clipped, "
     "policy_logps, reference_logps, old_logps), each a finite number (completions, tokens, tokens_sq, entries, "
     "clipped and kl_sq >= 0)."),
])
def test_a_state_with_a_bad_field_is_refused_naming_it_and_nothing_loaded(change, message) -> None:
    """A negative beta loaded as it was made the KL term -1.006 (the loss rewarded KL), a NaN one poisoned it."""
    runtime = AdaptiveKL(config(kl_adaptation_method="dynamic"), 0.2)
    state = {**AdaptiveKL(config(kl_adaptation_method="dynamic"), 0.1).state_dict(), **change}
    with pytest.raises(ValueError) as raised:
        runtime.load_state_dict(state)
    assert str(raised.value) == message
    assert runtime.current_beta == 0.2 and runtime.completed_steps == 0


@pytest.mark.parametrize("field", ["completed_steps", "last_raw_kl", "trained", "scored", "rewards",
                                   "configured_beta"])
def test_a_current_state_missing_a_field_it_writes_is_refused_naming_it(field) -> None:
    """A format-7 state without `completed_steps` loaded it as 0: a dynamic run with beta_schedule_steps=3 resumed
    after step 2 cut beta to beta_min at step 5, not 3. Each field `state_dict()` writes is required of its format."""
    saved = AdaptiveKL(config(kl_adaptation_method="dynamic", beta_schedule_steps=3), 0.1)
    saved.completed_steps = 2
    state = saved.state_dict()
    del state[field]
    runtime = AdaptiveKL(config(kl_adaptation_method="dynamic", beta_schedule_steps=3), 0.2)
    with pytest.raises(ValueError) as raised:
        runtime.load_state_dict(state)
    assert str(raised.value) == (
        f"adaptive KL state: missing field(s) {field} for a 'dynamic' controller (format 7): allowed are "
        "batch_reward, completed_steps, configured_beta, generation_batch, last_decayed_batch, last_raw_kl, rewards, "
        "scored, trained, value.")
    assert runtime.current_beta == 0.2 and runtime.completed_steps == 0
    # a format 7 state's sums are all of today's: one missing is refused too (format 5's lack old_logps, loaded as 0)
    state = saved.state_dict()
    del state["trained"]["old_logps"]
    with pytest.raises(ValueError, match=r"^adaptive KL state: trained=\{'completions': 0\.0, .*\} is invalid: allowed "
                                         r"is None, or the sums by name \(completions, .*, old_logps\), each a finite "
                                         r"number \(completions, .* >= 0\)\.$"):
        runtime.load_state_dict(state)


def test_a_state_missing_a_controller_field_is_refused_naming_it() -> None:
    """{"controller": "dynamic"} alone loaded, and the run resumed at its initial beta, silently."""
    runtime = AdaptiveKL(config(kl_adaptation_method="dynamic"), 0.2)
    state = AdaptiveKL(config(kl_adaptation_method="dynamic"), 0.1).state_dict()
    del state["value"], state["last_decayed_batch"]
    with pytest.raises(ValueError) as raised:
        runtime.load_state_dict(state)
    assert str(raised.value) == ("adaptive KL state: missing field(s) last_decayed_batch, value for a 'dynamic' "
                                 "controller (format 7): allowed are batch_reward, completed_steps, configured_beta, "
                                 "generation_batch, last_decayed_batch, last_raw_kl, rewards, scored, trained, value.")
    assert runtime.current_beta == 0.2


# Unversioned states as the code at 559aac2 wrote them (generated by running it: AdaptiveKL(dynamic, decay 0.5,
# beta 0.1) after two kl_loss + step(mean_reward=0.9); AdaptiveKL(target, kl_target 0.1, horizon 10) after one).
OLD_OWN_LOOP_DYNAMIC = ('{"value": 0.025, "generation_batch": 2, "batch_reward": 0.9, "last_decayed_batch": 2, '
                        '"completed_steps": 2}')
OLD_OWN_LOOP_TARGET = '{"value": 0.10400000000000001, "generation_batch": 1, "batch_reward": 0.5, "completed_steps": 1}'
# integrations/trainer_hooks.py's `_save_checkpoint` at 559aac2 wrote checkpoint-N/adaptive_kl_state.json (the same run)
OLD_TRAINER_FILE = OLD_OWN_LOOP_DYNAMIC
# the first trainer integration (61d7797, trl_patch.py) wrote the controller's fields alone, no completed_steps
OLDEST_TRAINER_FILE = '{"value": 0.025, "generation_batch": 2, "batch_reward": 0.9, "last_decayed_batch": 2}'
# verl's global_step_N/adaptive_kl.json at 559aac2 (AdaptiveKLTrainerMixin.adaptive_kl_state: loss dynamic, reward target)
OLD_VERL_FILE = ('{"global_steps": 2, "loss": {"value": 0.025, "generation_batch": 2, "batch_reward": 0.9, '
                 '"last_decayed_batch": 2, "completed_steps": 2}, "reward": {"value": 0.21600000000000003, '
                 '"generation_batch": 1, "batch_reward": 0.3, "completed_steps": 1}}')


@pytest.mark.parametrize("text", [OLD_OWN_LOOP_DYNAMIC, OLD_TRAINER_FILE, OLDEST_TRAINER_FILE],
                         ids=["own-loop", "trainer", "oldest-trainer"])
def test_old_dynamic_states_still_load(text) -> None:
    runtime = AdaptiveKL(config(kl_adaptation_method="dynamic", dynamic_beta_decay=0.5), 0.1)
    runtime.load_state_dict(json.loads(text))
    assert runtime.current_beta == 0.025
    assert runtime.completed_steps == (0 if "completed_steps" not in text else 2)
    assert runtime.controller.last_decayed_batch == 2 and runtime.controller.generation_batch == 2
    runtime.observe_rewards(0.9)  # a new batch above the threshold decays once more: the state is live
    runtime.step()
    assert runtime.current_beta == 0.0125
    with pytest.raises(ValueError, match=r"a 'dynamic' controller's state cannot be loaded into this run's 'target'"):
        AdaptiveKL(config(kl_adaptation_method="target"), 0.1).load_state_dict(json.loads(text))


def test_an_old_target_state_loads_and_is_refused_by_a_dynamic_run() -> None:
    runtime = AdaptiveKL(config(kl_adaptation_method="target", kl_target=0.1, kl_horizon=10), 0.1)
    runtime.load_state_dict(json.loads(OLD_OWN_LOOP_TARGET))
    assert runtime.current_beta == 0.10400000000000001 and runtime.completed_steps == 1
    with pytest.raises(ValueError, match=r"a 'constant or target' controller's state cannot be loaded into this "
                                         r"run's 'dynamic' controller"):
        AdaptiveKL(config(kl_adaptation_method="dynamic"), 0.1).load_state_dict(json.loads(OLD_OWN_LOOP_TARGET))


def test_an_old_verl_file_loads_into_both_controllers() -> None:
    """What AdaptiveKLTrainerMixin.load_adaptive_kl_state does with each entry (verl itself is not needed)."""
    state = json.loads(OLD_VERL_FILE)
    loss = AdaptiveKL(config(kl_adaptation_method="dynamic", dynamic_beta_decay=0.5), 0.1)
    reward = AdaptiveKL(config(kl_adaptation_method="target", kl_target=0.1, kl_horizon=10), 0.2, "bnpo")
    loss.load_state_dict(state["loss"])
    reward.load_state_dict(state["reward"])
    assert (loss.current_beta, loss.completed_steps) == (0.025, 2)
    assert (reward.current_beta, reward.completed_steps) == (0.21600000000000003, 1)
    with pytest.raises(ValueError, match=r"'dynamic' controller's state cannot be loaded into this run's 'target'"):
        reward.load_state_dict(state["loss"])
