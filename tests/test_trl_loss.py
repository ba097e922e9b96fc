"""The patched GRPOTrainer loss: 'none' is stock, and every method's KL part equals an independent formula
computed from a separate forward pass (SPEC 3.1-3.6, 4)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import json
import math
import re
import warnings
from typing import Any

import pytest
import torch

from unsloth_adaptive_kl import KLEstimatorWarning
from unsloth_adaptive_kl.tools.selfcheck import absolute_loss, backward_grads, loss_and_grads
from unsloth_adaptive_kl.integrations import trl as trl_patch
from unsloth_adaptive_kl.integrations.trainer_hooks import attach_runtime
from unsloth_adaptive_kl.integrations.versions import TRL_ANCHORS

from .conftest import grpo_args, logged, make_trainer, stock_trl
from .float32_error import MAX_LOGIT, two_path_logp_tolerance
from .metric_definitions import REDUCE, assert_metrics_match, by_definition
from unsloth_adaptive_kl.core.reductions import loss_types
from unsloth_adaptive_kl.core.tolerance import EPS32, reordered_sum_tolerance

GA = 2
LENGTHS = [5, 3, 1, 4]
T = 5


def tool_mask() -> torch.Tensor:
    """TRL's tool_mask for `fixed_inputs`' batch: 0 on the tokens a tool returned (tokens 1-2 of row 0, token 2 of row
    3), 1 elsewhere, padding included."""
    mask = torch.ones(4, T, dtype=torch.long)
    mask[0, 1:3] = 0
    mask[3, 2] = 0
    return mask


def fixed_inputs(trainer, tokenizer, log_ratio_scale: float = 1.0, shift: float = 0.0) -> dict:
    """A micro-batch of 4 completions with lengths 5, 3, 1, 4 and reference log-probs that differ from the
    policy's by a fixed pattern (per-token KL from ~0 to > 1)."""
    generator = torch.Generator().manual_seed(1)
    prompts = tokenizer(["ab:", "cde:", "fg:", "h:"], return_tensors="pt", padding=True)
    completion_ids = torch.randint(2, len(tokenizer), (4, T), generator=generator)
    completion_mask = torch.tensor([[1.0 if t < n else 0.0 for t in range(T)] for n in LENGTHS])
    offsets = (torch.rand(4, T, generator=generator) * 2 - 1) * 2.0 * log_ratio_scale + shift
    inputs = {
        "prompt_ids": prompts.input_ids,
        "prompt_mask": prompts.attention_mask,
        "completion_ids": completion_ids,
        "completion_mask": completion_mask.long(),
        "advantages": torch.tensor([1.0, -1.0, 0.5, -0.5]),
        "num_items_in_batch": torch.tensor(float(sum(LENGTHS) * GA)),
    }
    with torch.no_grad():
        inputs["ref_per_token_logps"] = policy_logps(trainer.model, inputs) + offsets
    return inputs


def policy_logps(model, inputs: dict) -> torch.Tensor:
    """log pi(completion token) from a plain forward pass and log_softmax (independent of TRL's fused path); every
    logit below MAX_LOGIT in size, as the bound on two paths' log-prob difference assumes."""
    input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    logits = model(input_ids=input_ids, attention_mask=attention).logits
    prompt_length = inputs["prompt_ids"].size(1)
    logits = logits[:, prompt_length - 1 : -1].float()
    assert logits.abs().max().item() < MAX_LOGIT, "the two-path log-prob bound assumes |logits| < MAX_LOGIT"
    return torch.log_softmax(logits, -1).gather(-1, inputs["completion_ids"].unsqueeze(-1)).squeeze(-1)


def shaped_by_hand(k: torch.Tensor, args) -> torch.Tensor:
    """SPEC 3.2/3.3: min(k, kl_clip_threshold) or sigmoid(k - kl_target) * k, per token."""
    methods = args.kl_adaptation_method.split("+")
    if "clip" in methods:
        return torch.minimum(k, torch.full_like(k, args.kl_clip_threshold))
    if "sigmoid" in methods:
        return torch.sigmoid(k - args.kl_target) * k
    return k


def expected_kl_part(trainer, inputs: dict, logp: torch.Tensor) -> torch.Tensor:
    """beta * KL term / GA, written out per method and loss_type from the SPEC's formulas."""
    args = trainer.args
    ref = inputs["ref_per_token_logps"]
    m = inputs["completion_mask"].float()
    delta = ref - logp
    k = torch.exp(delta) - delta - 1
    estimator = args.kl_estimator or "k3"  # unset: the loss placement's default, the trainer's own k3 (SPEC 3.12)
    if estimator == "k3" and args.use_bias_correction_kl:
        k = k * torch.exp(logp - logp.detach())  # TRL's default: times the (on-policy 1, differentiable) IS ratio
    elif estimator == "k1":
        k = logp - ref
    elif estimator == "k2":
        k = 0.5 * (logp - ref) ** 2
    elif estimator == "k3+":  # value of k3, gradient of k2
        k2 = 0.5 * (logp - ref) ** 2
        k = k2 + (k - k2).detach()
    elif estimator == "k1_future":  # value k1, gradient G_t * grad logp_t with G_t = sum_{s >= t} m_s k1_s
        k1 = ((logp - ref) * m).detach()
        to_go = torch.stack([k1[:, t:].sum(-1) for t in range(k1.size(1))], dim=-1)
        k = (logp - ref).detach() + to_go * logp - (to_go * logp).detach()
    methods = args.kl_adaptation_method.split("+")
    k = shaped_by_hand(k, args)
    lengths = m.sum(-1)
    per_completion_sum = (k * m).sum(-1)
    if args.kl_reduction == "sequence_sum":
        term = per_completion_sum.mean()
    elif args.kl_reduction == "token_mean":
        term = per_completion_sum.sum() / lengths.sum()
    elif "length_normalized" in methods or args.loss_type == "grpo":
        term = (per_completion_sum / lengths).mean()
    elif args.loss_type == "bnpo":
        term = per_completion_sum.sum() / lengths.sum()
    elif args.loss_type == "dr_grpo":
        term = per_completion_sum.sum() / (4 * args.max_completion_length)
    elif args.loss_type == "dapo":  # TRL: num_items_in_batch / processes * GA / steps_per_generation
        term = per_completion_sum.sum() / (inputs["num_items_in_batch"] * GA / args.steps_per_generation) * GA
    return args.beta * term / GA


def kl_part_and_grads(trainer, inputs: dict) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(loss - loss with beta=0) and its gradient, through the patched trainer."""
    model = trainer.model
    loss = trainer._compute_loss(model, inputs)
    total_grads = backward_grads(trainer, loss)
    beta = trainer.beta
    trainer.beta = 0.0
    try:
        policy = trainer._compute_loss(model, inputs)
    finally:
        trainer.beta = beta
    policy_grads = backward_grads(trainer, policy)
    return (loss - policy).detach(), [t - p for t, p in zip(total_grads, policy_grads)]


def prepared_trainer(tokenizer, tmp_path, **overrides):
    trainer = make_trainer(tokenizer, str(tmp_path), gradient_accumulation_steps=GA, **overrides)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = GA
    # Each call is the step's last micro-batch, so its metrics are logged. accelerate's GradientState is one per
    # process: a train() that an expected error interrupted inside a step (test_patching's) leaves it False.
    trainer.accelerator.gradient_state._set_sync_gradients(True)
    return trainer


METHODS = ["none", "clip", "sigmoid", "length_normalized", "dynamic", "clip+length_normalized", "sigmoid+dynamic"]
TOKENS = sum(LENGTHS)


def assert_matches_formula(trainer, kl_part: torch.Tensor, grads: list[torch.Tensor], expected: torch.Tensor) -> None:
    """The KL part and its gradient against the formula's. The formula's log-probs come from a plain forward and
    log_softmax, TRL's from its chunked path: per token they differ by <= two_path_logp_tolerance (logits < MAX_LOGIT,
    the model's vocabulary). With log ratios within +/-2 the KL's first and second derivatives stay below e^2 < 7.4, and a
    reduction weights a token by at most beta (beta * max_completion_length for sequence_sum), so the value is
    within 7.4 * weight * that. The gradient is a difference of two backward passes (total - policy), each reordered
    (reordered_sum_tolerance over the tokens), plus the per-token 7.4 * logp error relative to its size."""
    logp_error = two_path_logp_tolerance(MAX_LOGIT, trainer.model.config.vocab_size)
    weight = trainer.args.beta * (trainer.args.max_completion_length if trainer.args.kl_reduction == "sequence_sum" else 1)
    assert abs(kl_part.item() - expected.item()) <= 7.4 * weight * logp_error
    expected_grads = backward_grads(trainer, expected)
    scale = max(g.abs().max().item() for g in expected_grads)
    tolerance = TOKENS * 7.4 * logp_error * scale + 4 * reordered_sum_tolerance(TOKENS, scale / trainer.args.beta)
    for grad, want in zip(grads, expected_grads):
        assert (grad - want).abs().max().item() <= tolerance


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("method", METHODS)
def test_kl_part_of_loss_and_its_gradient_match_formula(tokenizer, tmp_path, method: str, loss_type: str) -> None:
    trainer = prepared_trainer(
        tokenizer, tmp_path, loss_type=loss_type, kl_adaptation_method=method, kl_clip_threshold=0.3, kl_target=0.2
    )
    inputs = fixed_inputs(trainer, tokenizer)
    kl_part, grads = kl_part_and_grads(trainer, inputs)

    expected = expected_kl_part(trainer, inputs, policy_logps(trainer.model, inputs))
    assert_matches_formula(trainer, kl_part, grads, expected)

    # SPEC 4: current_beta * adapted_kl is the KL part of the loss (without the accumulation factor).
    metrics = trainer._metrics["train"]
    assert metrics["adaptive_kl/current_beta"][0] == pytest.approx(0.04)
    assert metrics["adaptive_kl/current_beta"][0] * metrics["adaptive_kl/adapted_kl"][0] == pytest.approx(
        kl_part.item() * GA, rel=1e-5
    )
    if method in ("none", "dynamic"):
        assert metrics["adaptive_kl/raw_kl"][0] == pytest.approx(metrics["adaptive_kl/adapted_kl"][0], rel=1e-7)


def loss_guard(estimator: str) -> Any:
    """SPEC 3.12: k1 in the loss warns when the config is built (its expected gradient is zero on-policy)."""
    if estimator == "k1":
        return pytest.warns(KLEstimatorWarning, match="^kl_estimator='k1' with kl_placement='loss': ")
    return contextlib.nullcontext()


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
@pytest.mark.parametrize(
    ("estimator", "reduction", "method"),
    [("k1", "loss_type", "none"), ("k2", "sequence_sum", "none"), ("k3+", "token_mean", "clip"),
     ("k3", "sequence_sum", "dynamic"), ("k2", "loss_type", "sigmoid+length_normalized"),
     ("k1_future", "loss_type", "none"), ("k1_future", "sequence_sum", "clip")],
)
def test_estimators_and_reductions_through_the_trainer(tokenizer, tmp_path, estimator, reduction, method, loss_type):
    """The KL part of the trainer's loss (loss - the stock loss at beta=0, which is the policy-gradient part) and its
    gradient against the hand formula of each estimator; for k1_future the gradient of each token is the KL-to-go
    G_t = sum_{s >= t} m_s (logp_s - ref_s) times beta and the reduction's weight."""
    with loss_guard(estimator):
        trainer = prepared_trainer(tokenizer, tmp_path, loss_type=loss_type, kl_adaptation_method=method,
                                   kl_estimator=estimator, kl_reduction=reduction, kl_clip_threshold=0.3)
    inputs = fixed_inputs(trainer, tokenizer)
    kl_part, grads = kl_part_and_grads(trainer, inputs)
    expected = expected_kl_part(trainer, inputs, policy_logps(trainer.model, inputs))
    assert_matches_formula(trainer, kl_part, grads, expected)


def test_clip_has_zero_kl_gradient_above_threshold(tokenizer, tmp_path) -> None:
    """Every token's KL above the threshold: the KL part is constant and has no gradient."""
    trainer = prepared_trainer(tokenizer, tmp_path, loss_type="bnpo", kl_adaptation_method="clip", kl_clip_threshold=0.5)
    inputs = fixed_inputs(trainer, tokenizer, log_ratio_scale=0.1, shift=3.0)  # k3(3 +- 0.2) > 16
    kl_part, grads = kl_part_and_grads(trainer, inputs)
    assert kl_part.item() == pytest.approx(0.04 * 0.5 / GA, rel=1e-6)
    assert all(torch.count_nonzero(grad) == 0 for grad in grads)


@pytest.mark.parametrize("method", METHODS)
def test_log_ratios_of_50_give_finite_loss_and_gradients(tokenizer, tmp_path, method: str) -> None:
    trainer = prepared_trainer(tokenizer, tmp_path, loss_type="dapo", kl_adaptation_method=method)
    inputs = fixed_inputs(trainer, tokenizer)
    # log-ratios of +50 and -50 on each row; more of them -50, so that the reference's mean over the tokens stays a
    # log-prob's (at most 0: above it, the core refuses the tensor as negative log-likelihoods)
    signs = torch.tensor([[1.0, -1.0, -1.0, 1.0, -1.0]] * 4)
    with torch.no_grad():
        inputs["ref_per_token_logps"] = policy_logps(trainer.model, inputs) + 50.0 * signs
    loss = trainer._compute_loss(trainer.model, inputs)
    loss.backward()
    assert math.isfinite(loss.item())
    assert all(torch.isfinite(p.grad).all() for p in trainer.model.parameters() if p.grad is not None)


@pytest.mark.parametrize("where", ["padding", "tool_output"])
@pytest.mark.parametrize("garbage", [math.nan, -math.inf, 1e4], ids=["nan", "-inf", "huge"])
@pytest.mark.parametrize("method", ["none", "clip"])
def test_garbage_on_masked_reference_positions_leaves_loss_and_gradients_untouched(tokenizer, tmp_path, method,
                                                                                   garbage, where) -> None:
    """The trainer's own KL (its k3 line) with NaN, -inf or a huge gap on masked reference positions, padded ones or
    the tokens a tool returned (tool_mask 0: tokens 1-2 of row 0, token 2 of row 3): the loss and every gradient equal
    those of the clean batch (SPEC 3.13; stock TRL's 0 * NaN would poison the gradient). The trainer's batch keeps
    its reference tensor as it was: the stock loss reads a copy (TRL reuses the batch over num_iterations and
    steps_per_generation)."""
    results = []
    for dirty in (False, True):
        trainer = prepared_trainer(tokenizer, tmp_path, loss_type="bnpo", kl_adaptation_method=method,
                                   kl_clip_threshold=0.5)
        inputs = fixed_inputs(trainer, tokenizer)
        masked = inputs["completion_mask"] == 0
        if where == "tool_output":
            inputs["tool_mask"] = tool_mask()
            masked = inputs["tool_mask"] == 0
        if dirty:
            inputs["ref_per_token_logps"][masked] = garbage
        reference = inputs["ref_per_token_logps"]
        before = reference.clone()
        loss = trainer._compute_loss(trainer.model, inputs)
        assert inputs["ref_per_token_logps"] is reference and torch.equal(reference.nan_to_num(), before.nan_to_num())
        results.append((loss.detach(), backward_grads(trainer, loss)))
    (clean_loss, clean_grads), (dirty_loss, dirty_grads) = results
    assert math.isfinite(dirty_loss.item()) and dirty_loss.item() == clean_loss.item()
    assert all(torch.isfinite(g).all() for g in dirty_grads)
    assert all(torch.equal(g, c) for g, c in zip(dirty_grads, clean_grads))


@pytest.mark.parametrize("which, method, bias_correction", [
    ("policy", "clip", True), ("reference", "clip", True),
    # the old policy's (off-policy passes): the importance ratio's denominator, which TRL's bias-corrected k3 reads
    # too; without the correction only the stock policy term does, whose loss would be NaN without a word
    ("old policy", "clip", True), ("old policy", "none", False)])
def test_a_nan_log_prob_on_a_valid_token_raises_at_the_end_of_the_optimizer_step(tokenizer, tmp_path, which, method,
                                                                                  bias_correction) -> None:
    """Queued micro-batches read nothing back; the step's one transfer finds the NaN and names the tensor."""
    from unsloth_adaptive_kl import NonFiniteLogProbError

    trainer = prepared_trainer(tokenizer, tmp_path, loss_type="bnpo", kl_adaptation_method=method,
                               use_bias_correction_kl=bias_correction)
    inputs = fixed_inputs(trainer, tokenizer)
    if which == "reference":
        inputs["ref_per_token_logps"][0, 0] = math.nan
        inputs["ref_per_token_logps"][1, 2] = math.nan
    elif which == "old policy":  # finite elsewhere (any values: the ratio need not be 1 here)
        inputs["old_per_token_logps"] = inputs["ref_per_token_logps"].index_put(
            (torch.tensor([0, 1]), torch.tensor([0, 2])), torch.tensor(math.nan))
    else:  # the policy's own forward gives a NaN on two valid tokens
        stock = trainer._get_per_token_logps_and_entropies

        def nan_logps(*args, **kwargs):
            logps, *rest = stock(*args, **kwargs)
            return (logps.index_put((torch.tensor([0, 1]), torch.tensor([0, 2])), torch.tensor(math.nan)), *rest)

        trainer._get_per_token_logps_and_entropies = nan_logps
    trainer.accelerator.gradient_state._set_sync_gradients(False)  # a micro-batch inside the accumulation window
    trainer._compute_loss(trainer.model, inputs)
    trainer.accelerator.gradient_state._set_sync_gradients(True)  # the step's last micro-batch
    with pytest.raises(NonFiniteLogProbError, match=rf"non-finite input at step 1: .*in the {which} log-probs: 4 valid "
                                                    r"token\(s\)"):
        trainer._compute_loss(trainer.model, inputs)


def run_and_params(tokenizer, output_dir: str, **overrides):
    trainer = make_trainer(tokenizer, output_dir, **overrides)
    trainer.train()
    params = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    return trainer.state.log_history, params


TIMING_KEYS = {"step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second"}


# trl 1.9.1's luspo averages its per-token loss over every position, padding included, each weighted by its
# completion's length (`(per_token_loss * mask.sum(1, keepdim=True)).mean()`, later masked first), so its stock KL
# counts the padded positions' KL, which this package keeps out (a masked position gives 0, whatever it holds): there
# `none` is not stock.
(UNMASKED_LUSPO,) = next(anchor for anchor in TRL_ANCHORS if anchor.reason == "the luspo reduction").or_text
STOCK_LOSS_TYPES = [loss_type for loss_type in loss_types()
                    if not (loss_type == "luspo" and UNMASKED_LUSPO in inspect.getsource(
                        trl_patch._stock_function("GRPOTrainer._compute_loss")))]


@pytest.mark.parametrize("luspo_source", ["installed", "padded", "masked"])
def test_an_adapted_kl_with_luspo_is_refused_where_trl_weights_its_loss_by_length_over_the_padding(
        tokenizer, tmp_path, monkeypatch, luspo_source: str) -> None:
    """trl 1.9.1 reduces luspo as (1 / (B T)) sum_i L_i sum_t x_{i,t} over every position, later releases as
    (1 / B) sum_i S_i; the adapted KL is reduced as the latter, so on 1.9.1 a setting that changes nothing (clip above
    every KL) trained at another scale than stock, each completion's KL weighted L_i / T apart. There it is refused
    before training, naming the trl and the adapted fields, for GRPOTrainer and a subclass whose _compute_loss calls
    the hooked one; elsewhere the trainer is built. `none`, the KL in the reward (no KL term in the loss), beta 0 and
    another loss_type are built on either. The trl's loss source decides: the installed one's, and (so that both
    branches run on any trl) that source with 1.9.1's luspo line added (`padded`) or taken out (`masked`)."""
    import trl

    installed_source = trl_patch.source
    if luspo_source != "installed":
        def source(function):
            text = installed_source(function).replace(UNMASKED_LUSPO, "")
            return text + UNMASKED_LUSPO if luspo_source == "padded" else text

        monkeypatch.setattr(trl_patch, "source", source)
    unmasked = UNMASKED_LUSPO in trl_patch.source(trl_patch._stock_function("GRPOTrainer._compute_loss"))
    assert luspo_source == "installed" or unmasked == (luspo_source == "padded")
    args = dict(loss_type="luspo", importance_sampling_level="sequence", use_bias_correction_kl=False)
    adapted = dict(args, kl_adaptation_method="clip", kl_clip_threshold=1e3)

    class Subclass(trl.GRPOTrainer):
        def _compute_loss(self, model, inputs):
            return super()._compute_loss(model, inputs)

    for trainer_class in (trl.GRPOTrainer, Subclass):
        folder = str(tmp_path / trainer_class.__name__)
        with monkeypatch.context() as patched:
            patched.setattr(trl, "GRPOTrainer", trainer_class)
            if unmasked:
                with pytest.raises(ValueError, match=r"^loss_type='luspo' is invalid: allowed is another loss_type "
                                                     r"with kl_adaptation_method='clip' on "
                                                     rf"trl=={re.escape(trl.__version__)} .* Upgrade trl "
                                                     r"\(luspo's reduction changed in 1\.10\.0\), put the KL in the "
                                                     r"reward \(kl_placement='reward'\), or leave "
                                                     r"kl_adaptation_method='clip' unset \(this trl's own term\)\.$"):
                    make_trainer(tokenizer, folder, **adapted)
            else:
                assert make_trainer(tokenizer, folder, **adapted).adaptive_kl.config.kl_adaptation_method == "clip"
    for label, settings in {"none": args, "reward": dict(adapted, kl_placement="reward", kl_clip_threshold=1.0),
                            "beta 0": dict(adapted, beta=0.0), "grpo": dict(adapted, loss_type="grpo")}.items():
        with warnings.catch_warnings():  # beta 0 warns that the settings have no effect
            warnings.simplefilter("ignore")
            trainer = make_trainer(tokenizer, str(tmp_path / label), **settings)
        assert trainer.loss_type == settings["loss_type"], label


@pytest.mark.parametrize("loss_type", STOCK_LOSS_TYPES)
def test_none_is_stock_over_a_real_run(tokenizer, tmp_path, loss_type: str) -> None:
    """Same seed and arguments, every loss_type (luspo where the installed TRL masks its loss): stock and patched
    'none' log the same stock metrics and end with the same weights, bit for bit."""
    args = dict(loss_type=loss_type, gradient_accumulation_steps=GA, max_steps=2)
    if loss_type == "luspo":  # TRL refuses luspo at the token level
        args["importance_sampling_level"] = "sequence"
    patched_log, patched_params = run_and_params(tokenizer, str(tmp_path / "patched"), **args)
    with stock_trl():
        stock_log, stock_params = run_and_params(tokenizer, str(tmp_path / "stock"), **args)
    assert len(patched_log) == len(stock_log) == 3
    for patched, stock in zip(patched_log, stock_log):
        stock_keys = set(stock) - TIMING_KEYS
        assert stock_keys <= set(patched)
        assert not any(key.startswith("adaptive_kl/") for key in stock)
        for key in stock_keys:
            assert patched[key] == stock[key], key
    assert patched_log[0]["kl"] == 0.0 and patched_log[1]["kl"] > 0.0  # the KL term is live by step 2
    for name, value in stock_params.items():
        assert torch.equal(patched_params[name], value), name
    assert logged_metric_keys(patched_log) == {"adaptive_kl/raw_kl", "adaptive_kl/adapted_kl", "adaptive_kl/current_beta",
                                               "adaptive_kl/sequence_kl", "adaptive_kl/length_kl_corr"}



@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
@pytest.mark.parametrize("setting", [{"kl_adaptation_method": "dynamic", "reward_threshold": 1e9},
                                     {"kl_adaptation_method": "none"}], ids=["dynamic", "none"])
def test_with_the_entropy_bonus_policy_loss_holds_the_adapted_kl_term_as_stock_holds_its_own(tokenizer, tmp_path,
                                                                                             loss_type: str,
                                                                                             setting: dict) -> None:
    """With TRL's entropy bonus on, TRL logs `policy_loss`: the loss before the bonus, its KL term included, taken
    before the accumulation divide for grpo and after it for dapo. `dynamic` before any decay (a reward threshold out
    of reach) adapts nothing: it trains as stock and must log stock's policy_loss, at GA = 2, where a term scaled as
    the other loss type's would be off by 2. Without its KL part, steps 2 and 3 logged other values. `none` keeps
    TRL's own term, which holds it already: adding the term again would count the KL twice."""
    args = dict(loss_type=loss_type, gradient_accumulation_steps=GA, max_steps=3, entropy_coef=0.05)
    adapted_log, adapted_params = run_and_params(tokenizer, str(tmp_path / "adapted"), **setting, **args)
    with stock_trl():
        stock_log, stock_params = run_and_params(tokenizer, str(tmp_path / "stock"), **args)
    for name, value in stock_params.items():
        assert torch.equal(adapted_params[name], value), name
    stock = [(entry["policy_loss"], entry["kl"]) for entry in stock_log if "policy_loss" in entry]
    adapted = [entry["policy_loss"] for entry in adapted_log if "policy_loss" in entry]
    assert len(stock) == len(adapted) == 3
    # float32 rounding of the policy part (terms of order 0.1 that cancel) leaves ~4e-8 between the two paths; the KL
    # part, beta * kl (/ GA for dapo), is live from step 2 and at least 10 times the tolerance, so its absence or a
    # factor of 2 shows
    tolerance = 1e-6
    assert stock[0][1] == 0.0 and all(0.04 * kl / GA > 10 * tolerance for _, kl in stock[1:]), stock
    for (expected, _), found in zip(stock, adapted):
        assert math.isclose(found, expected, rel_tol=1e-5, abs_tol=tolerance), (found, expected)


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_policy_loss_holds_the_kl_part_of_the_loss_at_the_controllers_beta(tokenizer, tmp_path, loss_type,
                                                                            training) -> None:
    """With the entropy bonus on, TRL logs each micro-batch's `policy_loss` under the model's mode, its KL term
    included: taken before the accumulation divide for grpo, after it for dapo, and in evaluation, which divides by
    nothing. The adapted term it gains is the loss's own at the controller's beta: here a dynamic run resumed at beta
    0.01 (trainer.beta stays the configured 0.04), so the loss's KL part is a quarter of the formula at 0.04, and
    the entry's KL part (its value minus that of the same batch at beta 0) is the loss's KL part times GA for grpo
    in training, times 1 otherwise."""
    trainer = prepared_trainer(tokenizer, tmp_path, loss_type=loss_type, entropy_coef=0.05,
                               kl_adaptation_method="clip+dynamic", kl_clip_threshold=0.3)
    state = trainer.adaptive_kl.state_dict()
    state["value"] = 0.01
    trainer.adaptive_kl.load_state_dict(state)
    assert (trainer.current_beta, trainer.beta) == (0.01, 0.04)
    trainer.model.train(training)
    inputs = fixed_inputs(trainer, tokenizer)
    with warnings.catch_warnings():  # no generation batch has fed the controller a reward
        warnings.filterwarnings("ignore", message="adaptive KL: beta holds")
        kl_part, grads = kl_part_and_grads(trainer, inputs)
    split = 1 if training else GA / (trainer.args.steps_per_generation if loss_type == "dapo" else 1)
    expected = expected_kl_part(trainer, inputs, policy_logps(trainer.model, inputs)) * 0.01 / 0.04 * split
    assert_matches_formula(trainer, kl_part, grads, expected)
    adapted_entry, beta_zero_entry = trainer._metrics["train" if training else "eval"]["policy_loss"][-2:]
    factor = GA if loss_type == "grpo" and training else 1
    assert adapted_entry - beta_zero_entry == pytest.approx(kl_part.item() * factor, rel=1e-4)
    assert abs(kl_part.item()) > 1e-3


def logged_metric_keys(log_history: list[dict]) -> set:
    return {key for entry in log_history for key in entry if key.startswith("adaptive_kl/")}


@pytest.mark.parametrize("method", ["clip", "sigmoid", "length_normalized", "dynamic", "dynamic+length_normalized"])
def test_metrics_logged_for_every_method_with_spec_meaning(tokenizer, tmp_path, method: str) -> None:
    trainer = make_trainer(
        tokenizer, str(tmp_path), kl_adaptation_method=method, kl_clip_threshold=1e-4, max_steps=3, loss_type="bnpo"
    )
    trainer.train()
    raw, adapted = logged(trainer, "adaptive_kl/raw_kl"), logged(trainer, "adaptive_kl/adapted_kl")
    betas = logged(trainer, "adaptive_kl/current_beta")
    assert len(raw) == len(adapted) == len(betas) == 3
    assert raw[1] > 0
    if method == "clip":
        assert all(a <= min(r, 1e-4) + 1e-12 for a, r in zip(adapted, raw))
        assert adapted[1] < raw[1]
    if method == "sigmoid":  # sigmoid(k - 0.1) < 1 and k >= 0
        assert all(a <= r for a, r in zip(adapted, raw)) and adapted[1] < raw[1]
    if method == "dynamic":
        assert raw == adapted
    assert all(beta == pytest.approx(0.04) or "dynamic" in method for beta in betas)


@pytest.mark.parametrize(("method", "loss_type"), [("clip", "grpo"), ("sigmoid+length_normalized", "bnpo"),
                                                  ("none", "luspo")])
def test_logged_metrics_match_their_definitions_on_a_captured_batch(tokenizer, tmp_path, method, loss_type) -> None:
    """One micro-batch through the patched `_compute_loss` at an optimizer-step boundary: each logged adaptive_kl/*
    value against docs/metrics.md's definition, from a plain forward's log-probs and the batch's reference (k3)."""
    trainer = prepared_trainer(tokenizer, tmp_path, kl_adaptation_method=method, kl_clip_threshold=0.3,
                               loss_type=loss_type)
    inputs = fixed_inputs(trainer, tokenizer)
    assert trainer.accelerator.sync_gradients  # the step ends with this micro-batch: its metrics are logged
    trainer._compute_loss(trainer.model, inputs)
    logged_now = {key: values[-1] for key, values in trainer._metrics["train"].items()}
    with torch.no_grad():
        logp = policy_logps(trainer.model, inputs)
    delta = inputs["ref_per_token_logps"] - logp
    k3 = torch.exp(delta) - delta - 1
    mask = inputs["completion_mask"]
    adapted = REDUCE["length_normalized" if "length_normalized" in method else loss_type]
    expected = by_definition(k3, mask, method=method, raw=REDUCE[loss_type], adapted=adapted, beta=0.04, clip=0.3)
    # TRL's chunked log-probs against a plain forward: per token within two_path_logp_tolerance (1e-5 here).
    assert_metrics_match(logged_now, expected, rel=1e-4, abs_=1e-6)


def test_beta_zero_warns_and_logs_no_adaptive_metrics(tokenizer, tmp_path) -> None:
    with pytest.warns(UserWarning, match=r"kl_adaptation_method='clip' has no effect: beta=0.0 turns the KL term off"):
        trainer = make_trainer(tokenizer, str(tmp_path), beta=0.0, kl_adaptation_method="clip")
    trainer.train()
    assert trainer.ref_model is None and trainer.beta == 0.0
    assert logged_metric_keys(trainer.state.log_history) == set()


@pytest.mark.parametrize("where", ["args", "adaptive_kl.config"])
def test_a_setting_changed_after_the_trainer_was_built_stops_the_first_loss(tokenizer, tmp_path, monkeypatch,
                                                                           where: str) -> None:
    """The trainer's AdaptiveKL was built from args.kl_clip_threshold=1.0 in __init__; set to 2.0 afterwards (a
    callback, a notebook cell) on the args it would clip nothing differently, on the AdaptiveKL's copy it would act
    unvalidated. The first micro-batch's loss says so (of two per optimizer step): no term is recorded."""
    trainer = make_trainer(tokenizer, str(tmp_path), kl_adaptation_method="clip", kl_clip_threshold=1.0)
    setattr(trainer.args if where == "args" else trainer.adaptive_kl.config, "kl_clip_threshold", 2.0)
    recorded = []
    record = trainer.adaptive_kl.record
    monkeypatch.setattr(trainer.adaptive_kl, "record",
                        lambda *args, **kwargs: recorded.append(1) or record(*args, **kwargs))
    with pytest.raises(ValueError, match=r"^kl_clip_threshold changed from 1\.0 to 2\.0 after the run started: .*a "
                                         r"trainer builds it in its __init__\)\. Set it before;"):
        trainer.train()
    assert trainer.state.global_step == 0 and not recorded


def test_trainer_beta_set_during_training_is_refused_where_adapted_and_said_where_stock(tokenizer, tmp_path) -> None:
    """TRL's loss reads trainer.beta; a callback that sets it mid-run (0.04 -> 0.4): with `clip` the adapted term
    multiplies the controller's beta and would ignore it (on fa480e6 the KL part stayed 0.04's), so the next loss is
    refused naming trainer.beta, before its step. With `none` the stock term follows it as stock TRL does, bit for bit,
    and the metrics' beta does not: a warning, once. Set to 0 (no KL term in any setting) it is honoured silently."""
    from transformers import TrainerCallback

    class Schedule(TrainerCallback):
        def __init__(self, trainer: Any, value: float) -> None:
            self.trainer, self.value = trainer, value

        def on_step_end(self, *args: Any, **kwargs: Any) -> None:
            self.trainer.beta = self.value

    clipped = make_trainer(tokenizer, str(tmp_path / "clip"), kl_adaptation_method="clip", max_steps=3)
    clipped.add_callback(Schedule(clipped, 0.4))
    with pytest.raises(ValueError, match=r"^trainer\.beta=0\.4 is invalid: allowed is the beta the trainer was built "
                                         r"with \(0\.04\) while adaptive KL is on \(kl_adaptation_method='clip'\)"):
        clipped.train()
    assert clipped.state.global_step == 1 and clipped.adaptive_kl.completed_steps == 1
    def losses(name: str, beta: float = 0.4) -> list[float]:
        trainer = make_trainer(tokenizer, str(tmp_path / name), max_steps=3)
        trainer.add_callback(Schedule(trainer, beta))
        trainer.train()
        return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]

    runs = {}
    with pytest.warns(UserWarning, match=r"^adaptive_kl: trainer\.beta was set to 0\.4 after the run started "
                                         r"\(built with 0\.04\)") as caught:
        runs["none"] = losses("none")  # 4 loss calls after the change: said once
    assert sum("trainer.beta was set" in str(w.message) for w in caught) == 1
    with stock_trl():
        runs["stock"] = losses("stock")
        runs["unscheduled"] = losses("unscheduled", 0.04)
    assert runs["none"] == runs["stock"] and len(runs["none"]) == 3
    assert runs["none"][1:] != runs["unscheduled"][1:]  # the schedule moved the stock loss: it was followed
    zero = make_trainer(tokenizer, str(tmp_path / "zero"), kl_adaptation_method="clip", max_steps=2)
    zero.add_callback(Schedule(zero, 0.0))
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="adaptive_kl")  # nothing from this package (trl 1.9.1 warns its own)
        zero.train()
    assert zero.state.global_step == 2


def test_args_beta_set_after_the_trainer_was_built_is_refused_where_adapted_and_said_where_stock(tokenizer,
                                                                                             tmp_path) -> None:
    """TRL reads args.beta once, in __init__ (trainer.beta = args.beta): set later it does nothing, in stock TRL too.
    With `sigmoid` the next loss refuses it (it trained on at 0.04, silently); with `none` the loss is stock TRL's,
    bit for bit, and a warning says once that the value does nothing."""
    adapted = make_trainer(tokenizer, str(tmp_path / "sigmoid"), kl_adaptation_method="sigmoid", max_steps=2)
    adapted.args.beta = "0.1"  # whatever a callback sets is named (it was formatted as a number: a bare ValueError)
    with pytest.raises(ValueError, match=r"^trainer\.args\.beta='0\.1' is invalid: allowed is 0\.04, the value the "
                                         r"trainer was built with, while adaptive KL is on \(kl_adaptation_method="
                                         r"'sigmoid'\): the trainer read it once"):
        adapted.train()
    assert adapted.state.global_step == 0

    def losses(name: str) -> list[float]:
        trainer = make_trainer(tokenizer, str(tmp_path / name), max_steps=2)
        trainer.args.beta = 0.1
        trainer.train()
        assert trainer.beta == 0.04
        return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]

    with pytest.warns(UserWarning, match=r"^adaptive_kl: trainer\.args\.beta was set to 0\.1 after the run started: "
                                         r"the trainer read it once, when it was built with 0\.04 .*; trainer\.beta "
                                         r"is what the stock loss reads\.$") as caught:
        patched = losses("none")
    assert sum("trainer.args.beta was set" in str(w.message) for w in caught) == 1
    with stock_trl():
        assert losses("stock") == patched and len(patched) == 2


def test_at_beta_zero_a_setting_changed_after_the_trainer_was_built_is_refused_too(tokenizer, tmp_path) -> None:
    """At beta 0 the loss is stock (no KL term) and returned before the adaptive KL runs; on ccb0d5c that early
    return skipped the settings check the own loop makes at beta 0 too. A change is refused at the first loss."""
    with pytest.warns(UserWarning, match=r"kl_adaptation_method='clip' has no effect: beta=0.0"):
        trainer = make_trainer(tokenizer, str(tmp_path), beta=0.0, kl_adaptation_method="clip", kl_clip_threshold=1.0)
    trainer.args.kl_adaptation_method = "sigmoid"
    with pytest.raises(ValueError, match=r"^kl_adaptation_method changed from 'clip' to 'sigmoid' after the run "
                                         r"started"):
        trainer.train()
    assert trainer.state.global_step == 0


def test_the_list_form_and_a_command_lines_none_set_on_the_args_before_the_trainer_train_as_built(tokenizer,
                                                                                                 tmp_path) -> None:
    """`kl_adaptation_method` as a list (the documented form) and `kl_estimator="None"` (a command line's None), set on
    the args after the config was built and before the trainer: the run was built from them ('clip'; the stock
    estimator), but the per-batch check compared the args' raw ['clip'] with 'clip' and refused the first batch with
    "changed ... after the run started. Set it before", which the user had. They now train, the trainer logging the
    clipped KL, and a real change to the list form is still refused, naming the values as they read."""
    args = grpo_args(str(tmp_path / "list"), max_steps=1, kl_clip_threshold=0.01)
    args.kl_adaptation_method, args.kl_estimator = ["clip"], "None"
    trainer = make_trainer(tokenizer, str(tmp_path / "list"), config=args)
    assert trainer.adaptive_kl.config.kl_adaptation_method == "clip" and trainer.adaptive_kl.config.kl_estimator is None
    trainer.train()
    assert trainer.state.global_step == 1 and logged(trainer, "adaptive_kl/adapted_kl")[0] <= 0.01 + 1e-6
    trainer.args.kl_adaptation_method = ["sigmoid"]
    with pytest.raises(ValueError, match=r"^kl_adaptation_method changed from 'clip' to 'sigmoid' after the run "):
        trainer.adaptive_kl.check_settings(trainer.args)


class _OwnLossTrainer:
    """A GRPOTrainer subclass whose `_compute_loss` is a copy of TRL's (here: the stock function itself), as recipes
    that rewrite the loss do: it never calls the patched one."""

    def _compute_loss(self, model, inputs):
        return trl_patch._stock_compute_loss(self, model, inputs)


class _SuperLossTrainer:
    """A subclass whose override calls super(): the adaptive KL runs."""

    def _compute_loss(self, model, inputs):
        return super()._compute_loss(model, inputs)


def subclassed_trainer(tokenizer, output_dir: str, mixin: type, **overrides: Any):
    trainer = make_trainer(tokenizer, output_dir, **{"max_steps": 2, **overrides})
    trainer.__class__ = type(f"My{mixin.__name__}", (mixin, type(trainer)), {})
    return trainer


def test_a_subclass_loss_that_bypasses_the_patched_one_stops_the_run(tokenizer, tmp_path) -> None:
    """An adapted setting trained through an override that never calls the patched `_compute_loss` would train with
    the stock KL, log no adaptive_kl/ metric and never move beta: the step's end raises, naming the class and the
    setting. The stock KL only warns (its loss is stock either way); an override calling super() is not flagged."""
    trainer = subclassed_trainer(tokenizer, str(tmp_path / "a"), _OwnLossTrainer, kl_adaptation_method="clip+dynamic",
                                 reward_threshold=-1.0)
    with pytest.raises(RuntimeError, match=r"^adaptive_kl: optimizer step 1 of My_OwnLossTrainer ran without the "
                                           r"adaptive KL's loss hook .* \(kl_adaptation_method='clip\+dynamic'\)$"):
        trainer.train()
    assert trainer.state.global_step == 1 and trainer.adaptive_kl.completed_steps == 0
    # one generation batch for 4 optimizer steps: refused after the first of them (on fa480e6, at the next generation,
    # after all 4)
    trainer = subclassed_trainer(tokenizer, str(tmp_path / "spg"), _OwnLossTrainer, kl_adaptation_method="clip",
                                 gradient_accumulation_steps=1, steps_per_generation=4, max_steps=4)
    with pytest.raises(RuntimeError, match=r"^adaptive_kl: optimizer step 1 of My_OwnLossTrainer ran without"):
        trainer.train()
    assert trainer.state.global_step == 1
    trainer = subclassed_trainer(tokenizer, str(tmp_path / "b"), _OwnLossTrainer)
    with pytest.warns(UserWarning, match=r"With kl_adaptation_method='none' the loss is stock; only the metrics are "
                                         r"missing\.$") as caught:
        trainer.train()
    assert sum("loss hook" in str(w.message) for w in caught) == 1  # once, though both steps bypassed it
    trainer = subclassed_trainer(tokenizer, str(tmp_path / "c"), _SuperLossTrainer, kl_adaptation_method="clip+dynamic",
                                 reward_threshold=-1.0)
    trainer.train()
    assert trainer.adaptive_kl.completed_steps == 2 and trainer.adaptive_kl.current_beta == pytest.approx(0.04 * 0.81)
    trainer.train()  # a second train() starts at step 0 again, the hook ending each step: nothing is flagged
    assert trainer.state.global_step == 2 and trainer.adaptive_kl.completed_steps == 2


def test_a_callable_estimator_that_would_not_survive_a_checkpoint_is_refused_when_the_trainer_is_built(
        tokenizer, tmp_path) -> None:
    """Every checkpoint pickles the trainer's config (training_args.bin): a lambda would crash the first save, after
    training started. A module-level function pickles, and is accepted."""
    with pytest.raises(ValueError, match=r"^kl_estimator=<function .*<lambda>.* is invalid: allowed is a registered "
                                         r"estimator's name .* \((PicklingError|AttributeError): "):
        make_trainer(tokenizer, str(tmp_path), kl_estimator=lambda logp, ref, mask: (logp - ref) ** 2 / 2)
    trainer = make_trainer(tokenizer, str(tmp_path), kl_estimator=half_squared_log_ratio)
    assert trainer.adaptive_kl.config.kl_estimator is half_squared_log_ratio
    # report_to="tensorboard" writes args.to_json_string() when training begins: json cannot write the function (a
    # TypeError there); it is written by its name, and the config keeps the function
    written = json.loads(trainer.args.to_json_string())
    assert written["kl_estimator"] == "half_squared_log_ratio" and written["beta"] == 0.04
    assert trainer.args.kl_estimator is half_squared_log_ratio
    # a partial pickles too (so the trainer takes it) but has no name: its repr
    partial = functools.partial(scaled_squared_log_ratio, 0.5)
    written = json.loads(grpo_args(str(tmp_path), kl_estimator=partial).to_json_string())["kl_estimator"]
    assert written == repr(partial) and written.startswith("functools.partial(<function scaled_squared_log_ratio")
    assert json.loads(grpo_args(str(tmp_path), kl_estimator="k2").to_json_string())["kl_estimator"] == "k2"


def half_squared_log_ratio(logp: torch.Tensor, ref: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """k2, as a module-level function (it pickles by reference)."""
    return (logp - ref) ** 2 / 2


def scaled_squared_log_ratio(scale: float, logp: torch.Tensor, ref: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """scale * (logp - ref)^2, for a functools.partial."""
    return scale * (logp - ref) ** 2


def test_unknown_loss_type_for_a_method_is_rejected_before_training(tokenizer, tmp_path, monkeypatch) -> None:
    trainer = make_trainer(tokenizer, str(tmp_path), kl_adaptation_method="clip")
    from unsloth_adaptive_kl.core import reductions

    monkeypatch.setitem(reductions.REDUCTIONS, "token_sum_normalized", dataclasses.replace(
        reductions.REDUCTIONS["token_sum_normalized"], loss_types=("cispo", "vespo")))  # dapo served by none
    with pytest.raises(ValueError, match=r"loss_type='dapo' is not supported by adaptive KL: allowed is one of"):
        make_trainer(tokenizer, str(tmp_path), kl_adaptation_method="clip", loss_type="dapo")
    assert trainer.current_beta == 0.04


NO_OP_ADAPTATIONS = {
    "clip_above_every_kl": dict(kl_adaptation_method="clip", kl_clip_threshold=1e3),  # KL * ratio < e^4.3 here
    "dynamic_before_decay": dict(kl_adaptation_method="dynamic"),
}
SAME_REDUCTION = {"grpo": "sequence_mean", "bnpo": "token_mean"}  # TRL's bnpo: the micro-batch's token mean


@pytest.mark.parametrize("off_policy", [False, True], ids=["on_policy", "off_policy"])
@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_no_op_adaptations_reproduce_stock_trl_loss_and_gradients(tokenizer, tmp_path, loss_type, off_policy) -> None:
    """SPEC 3.8: the adapted path shapes the trainer's own KL (importance-ratio correction included), so
    adaptations that change nothing give stock TRL's loss and gradients. Log ratios from -4 to 4 (per-token KL up
    to e^4 - 5 > 10); off-policy, old log-probs 0.3 away from the policy's (importance ratios e^-0.3 to e^0.3)."""
    trainer = prepared_trainer(tokenizer, tmp_path, loss_type=loss_type)
    inputs = fixed_inputs(trainer, tokenizer)
    with torch.no_grad():
        logp = policy_logps(trainer.model, inputs)
    inputs["ref_per_token_logps"] = logp + torch.linspace(-4.0, 4.0, logp.numel()).view_as(logp)
    if off_policy:
        inputs["old_per_token_logps"] = logp + torch.linspace(0.3, -0.3, logp.numel()).view_as(logp)
    adaptations = dict(NO_OP_ADAPTATIONS)
    if loss_type in SAME_REDUCTION:
        adaptations["same_reduction"] = dict(kl_reduction=SAME_REDUCTION[loss_type])
    assert_no_op_adaptations_are_stock(trainer, inputs, adaptations)
    assert max(trainer._metrics["train"]["adaptive_kl/raw_kl"]) > 1.0


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_a_shorter_last_accumulation_window_divides_the_kl_part_as_stock_does(tokenizer, tmp_path, loss_type) -> None:
    """Where the epoch's micro-batches run out, transformers sets current_gradient_accumulation_steps to the ones
    left (here 1 of gradient_accumulation_steps=2), and TRL divides the loss (grpo) or scales dapo's normaliser by
    that, not by the configured count: no-op adaptations still give stock TRL's loss and gradients, whose KL part is
    twice that of a full window."""
    trainer = prepared_trainer(tokenizer, tmp_path, loss_type=loss_type)
    trainer.current_gradient_accumulation_steps = 1
    inputs = fixed_inputs(trainer, tokenizer)
    assert_no_op_adaptations_are_stock(trainer, inputs, NO_OP_ADAPTATIONS)
    assert trainer.args.gradient_accumulation_steps == GA == 2


def assert_no_op_adaptations_are_stock(trainer, inputs: dict, adaptations: dict) -> None:
    """Each of `adaptations` (settings that change nothing on `inputs`) gives stock TRL's loss and gradients: the same
    per-token terms, reduced in another order (the KL on its own, then added)."""
    with stock_trl():
        stock_loss, stock_grads = loss_and_grads(trainer, "_compute_loss", inputs)
        magnitude = absolute_loss(trainer, "_compute_loss", inputs)
    tokens = int(inputs["completion_mask"].sum())
    stock_grad_max = max(g.abs().max().item() for g in stock_grads)
    for label, settings in adaptations.items():
        for name, value in {"kl_adaptation_method": "none", "kl_reduction": "loss_type", **settings}.items():
            setattr(trainer.args, name, value)
        attach_runtime(trainer)
        loss, grads = loss_and_grads(trainer, "_compute_loss", inputs)
        assert abs(loss - stock_loss) <= reordered_sum_tolerance(tokens, magnitude), label
        grad_diff = max((g - s).abs().max().item() for g, s in zip(grads, stock_grads))
        assert grad_diff <= 2 * reordered_sum_tolerance(tokens, stock_grad_max), (label, grad_diff)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_trls_policy_masks_leave_the_kl_on_every_valid_token_as_stock_does(tokenizer, tmp_path, loss_type) -> None:
    """TRL multiplies the policy term alone by its entropy mask (top_entropy_quantile) and its off-policy sequence
    mask (off_policy_mask_threshold), then adds beta * KL over every valid token. With both on, no-op adaptations
    give stock TRL's loss and gradients, and clip's KL part is its formula over every valid token, masked ones too."""
    trainer = prepared_trainer(tokenizer, tmp_path, loss_type=loss_type, top_entropy_quantile=0.5,
                               off_policy_mask_threshold=0.0, use_bias_correction_kl=False, kl_clip_threshold=0.3)
    inputs = fixed_inputs(trainer, tokenizer)
    with torch.no_grad():
        logp = policy_logps(trainer.model, inputs)
    # old - logp = 0.3 > the threshold: the completions with a negative advantage (2 of 4) leave the policy term
    inputs["old_per_token_logps"] = logp + 0.3
    with stock_trl():
        trainer.beta = 0.0
        masked_policy, _ = loss_and_grads(trainer, "_compute_loss", inputs)
        trainer.top_entropy_quantile, trainer.off_policy_mask_threshold = 1.0, None
        unmasked_policy, _ = loss_and_grads(trainer, "_compute_loss", inputs)
        trainer.top_entropy_quantile, trainer.off_policy_mask_threshold = 0.5, 0.0
        trainer.beta = 0.04
    assert abs(masked_policy - unmasked_policy) > 1e-3  # the masks act on this batch
    assert_no_op_adaptations_are_stock(trainer, inputs, NO_OP_ADAPTATIONS)
    trainer.args.kl_adaptation_method, trainer.args.kl_clip_threshold = "clip", 0.3
    attach_runtime(trainer)
    kl_part, grads = kl_part_and_grads(trainer, inputs)
    assert_matches_formula(trainer, kl_part, grads, expected_kl_part(trainer, inputs, policy_logps(trainer.model, inputs)))


@pytest.mark.parametrize("ratio_shape", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_vllms_importance_sampling_ratio_weights_the_policy_term_alone_as_stock_does(tokenizer, tmp_path, loss_type,
                                                                                    ratio_shape) -> None:
    """With vLLM generating and `vllm_importance_sampling_correction` (TRL's default), TRL multiplies the policy term
    alone by the ratio of the old policy to vLLM's sampling log-probs (`inputs["importance_sampling_ratio"]`, per
    token, or per completion in the sequence modes), then adds beta * KL unweighted. vLLM cannot run here: the trainer
    is told it generated with vLLM and the batch carries a ratio as vLLM's generation step writes it. No-op adaptations
    give stock TRL's loss and gradients, and clip's KL part is its formula, with no ratio in it."""
    trainer = prepared_trainer(tokenizer, tmp_path, loss_type=loss_type, kl_clip_threshold=0.3)
    inputs = fixed_inputs(trainer, tokenizer)
    columns = T if ratio_shape == "token" else 1
    inputs["importance_sampling_ratio"] = torch.linspace(0.5, 2.0, 4 * columns).view(4, columns)
    trainer.use_vllm = trainer.vllm_importance_sampling_correction = True
    with stock_trl():
        trainer.beta = 0.0
        weighted_policy, _ = loss_and_grads(trainer, "_compute_loss", inputs)
        trainer.use_vllm = False
        unweighted_policy, _ = loss_and_grads(trainer, "_compute_loss", inputs)
        trainer.use_vllm, trainer.beta = True, 0.04
    assert abs(weighted_policy - unweighted_policy) > 1e-3  # the ratio acts on this batch
    assert_no_op_adaptations_are_stock(trainer, inputs, NO_OP_ADAPTATIONS)
    trainer.args.kl_adaptation_method = "clip"
    attach_runtime(trainer)
    kl_part, grads = kl_part_and_grads(trainer, inputs)
    expected = expected_kl_part(trainer, inputs, policy_logps(trainer.model, inputs))
    assert_matches_formula(trainer, kl_part, grads, expected)


class _LogpsRecorder:
    """Stands in for `trainer._get_per_token_logps_and_entropies` during one `_compute_loss`: keeps the log-probs the
    trainer itself computed for the policy."""

    def __init__(self, method) -> None:
        self.method, self.logps = method, []

    def __call__(self, *args, **kwargs):
        output = self.method(*args, **kwargs)
        self.logps.append(output[0].detach())
        return output


@pytest.mark.parametrize(
    ("method", "estimator", "reduction", "loss_type"),
    [(method, "k3", "loss_type", loss_type) for method in METHODS + ["target"] for loss_type in ("grpo", "dapo")]
    + [("none", estimator, "loss_type", "bnpo") for estimator in ("k1", "k2", "low_var_kl", "k1+", "k3+",
                                                                    "k3_bottom_percentile", "k1_future")]
    + [("clip", "k3", reduction, "dr_grpo") for reduction in ("sequence_mean", "token_mean", "sequence_sum")],
)
def test_adaptive_kl_object_returns_what_the_trl_integration_computes(tokenizer, tmp_path, monkeypatch, method,
                                                                      estimator, reduction, loss_type) -> None:
    """SPEC 3.11: the public AdaptiveKL, given the trainer's own log-probs, reference log-probs and mask, returns the
    KL part the patched trainer adds to its loss (times the accumulation factor) and the metrics it logs."""
    from unsloth_adaptive_kl import AdaptiveKL, AdaptiveKLConfig
    from unsloth_adaptive_kl.core.config import ADAPTIVE_KL_FIELDS

    with loss_guard(estimator):
        trainer = prepared_trainer(tokenizer, tmp_path, loss_type=loss_type, kl_adaptation_method=method,
                                   kl_estimator=estimator, kl_reduction=reduction, kl_clip_threshold=0.3, kl_target=0.2)
    inputs = fixed_inputs(trainer, tokenizer)
    recorder = _LogpsRecorder(trainer._get_per_token_logps_and_entropies)
    monkeypatch.setattr(trainer, "_get_per_token_logps_and_entropies", recorder)
    kl_part, _ = kl_part_and_grads(trainer, inputs)
    logged_metrics = {name: values[0] for name, values in trainer._metrics["train"].items()
                      if name.startswith("adaptive_kl/")}

    with loss_guard(estimator):
        config = AdaptiveKLConfig(**{name: getattr(trainer.args, name) for name in ADAPTIVE_KL_FIELDS})
        akl = AdaptiveKL(config, trainer.args.beta, loss_type)
    term, metrics = akl.kl_loss(recorder.logps[0], inputs["ref_per_token_logps"], inputs["completion_mask"].float(),
                                max_completion_length=trainer.args.max_completion_length,
                                token_normalizer=inputs["num_items_in_batch"] / trainer.args.steps_per_generation)
    # The trainer's k3 carries TRL's bias-correction factor (on-policy exactly 1). kl_part is the difference of two
    # float32 losses below 1 in size, each within EPS32 of its exact value: GA * 2 * EPS32 after the factor GA.
    assert term.item() == pytest.approx(kl_part.item() * GA, abs=GA * 2 * EPS32)
    assert term.item() == pytest.approx(logged_metrics["adaptive_kl/current_beta"]
                                        * logged_metrics["adaptive_kl/adapted_kl"], rel=1e-6)
    assert metrics.keys() == logged_metrics.keys()
    for name, value in metrics.items():
        assert value == pytest.approx(logged_metrics[name], rel=1e-6, abs=1e-9), name


def user_three_k2(logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """A user's own estimator: 3 * 0.5 * (logp - ref)^2."""
    return 1.5 * (logp - ref_logp) ** 2


def test_a_user_registered_estimator_trains_and_changes_the_loss_by_its_formula(tokenizer, tmp_path) -> None:
    """register_kl_estimator makes kl_estimator='name' work in GRPOConfig, on the command line and in training."""
    import trl

    from unsloth_adaptive_kl import register_kl_estimator

    if "test_user_three_k2" not in unsloth_adaptive_kl_estimators():
        register_kl_estimator("test_user_three_k2")(user_three_k2)
    (parsed,) = trl.TrlParser(trl.GRPOConfig).parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--use_cpu", "True", "--bf16", "False", "--kl_estimator", "test_user_three_k2"])
    assert parsed.kl_estimator == "test_user_three_k2"
    trainer = prepared_trainer(tokenizer, tmp_path, loss_type="bnpo", kl_estimator="test_user_three_k2")
    inputs = fixed_inputs(trainer, tokenizer)
    kl_part, grads = kl_part_and_grads(trainer, inputs)
    logp, m = policy_logps(trainer.model, inputs), inputs["completion_mask"].float()
    expected = trainer.args.beta * (user_three_k2(logp, inputs["ref_per_token_logps"], m) * m).sum() / m.sum() / GA
    assert_matches_formula(trainer, kl_part, grads, expected)
    trained = make_trainer(tokenizer, str(tmp_path / "train"), kl_estimator="test_user_three_k2", max_steps=2)
    trained.train()
    raw = logged(trained, "adaptive_kl/raw_kl")
    assert len(raw) == 2 and all(math.isfinite(value) for value in raw)


def unsloth_adaptive_kl_estimators() -> tuple[str, ...]:
    from unsloth_adaptive_kl.core.estimators import estimator_names

    return estimator_names()


def test_a_subclass_loss_that_bypasses_the_patched_one_stops_a_syncing_run_with_the_stock_kl(tokenizer,
                                                                                            tmp_path) -> None:
    """Reference syncing is this package's setting even with the stock KL (its KL trigger and step count come from the
    loss hook): an override that never calls the patched `_compute_loss` raises at the end of the step, naming
    sync_ref_model=True, rather than warning as the stock KL alone does. One step ran (global_step 1), none in the
    hook (completed_steps 0)."""
    trainer = subclassed_trainer(tokenizer, str(tmp_path), _OwnLossTrainer, sync_ref_model=True,
                                 ref_model_sync_steps=1, ref_model_mixup_alpha=1.0)
    assert trainer.adaptive_kl.config.is_stock_kl
    with pytest.raises(RuntimeError, match=r"^adaptive_kl: optimizer step 1 of My_OwnLossTrainer ran without the "
                                           r"adaptive KL's loss hook .* \(sync_ref_model=True\)$"):
        trainer.train()
    assert trainer.state.global_step == 1 and trainer.adaptive_kl.completed_steps == 0


def test_two_generations_in_one_optimizer_step_are_not_taken_for_a_bypassed_loss_hook(tokenizer, tmp_path) -> None:
    """steps_per_generation=1 with gradient_accumulation_steps=2: each optimizer step's two micro-batches come from
    two generation batches, so the second generation of a step sees no new optimizer step (global_step unchanged) and
    no new hook-ended step, which is not a bypass. clip+dynamic with reward_threshold=-1 decays beta once per step
    (0.9 each): after 2 steps beta = 0.04 * 0.9**2 = 0.0324."""
    trainer = make_trainer(tokenizer, str(tmp_path), max_steps=2, steps_per_generation=1,
                           kl_adaptation_method="clip+dynamic", reward_threshold=-1.0)
    generations: list[int] = []
    upstream = trainer._generate_and_score_completions

    def counted(*args: Any, **kwargs: Any) -> Any:
        generations.append(trainer.state.global_step)
        return upstream(*args, **kwargs)

    trainer._generate_and_score_completions = counted
    trainer.train()
    assert generations == [0, 0, 1, 1]
    assert trainer.adaptive_kl.completed_steps == 2 and trainer.current_beta == pytest.approx(0.0324)


def test_tool_response_tokens_are_out_of_the_adapted_kl_in_the_loss(tokenizer, tmp_path) -> None:
    """TRL's tool_mask (0 on the tokens a tool returned) masks them out of the loss as the completion mask does: the
    adapted KL part and its gradient are the formula's with the mask completion_mask * tool_mask. Lengths 5, 3, 1, 4;
    tool mask 0 on tokens 1-2 of row 0 and token 2 of row 3, 1 elsewhere (padding included): 13 - 3 = 10 tokens
    count, rows 0 and 3 by 3 each (grpo's per-completion mean)."""
    trainer = prepared_trainer(tokenizer, tmp_path, loss_type="grpo", kl_adaptation_method="clip",
                               kl_clip_threshold=0.3)
    inputs = fixed_inputs(trainer, tokenizer)
    kl_part, grads = kl_part_and_grads(trainer, {**inputs, "tool_mask": tool_mask()})
    mask = inputs["completion_mask"] * tool_mask()
    assert mask.sum(-1).tolist() == [3, 3, 1, 3]
    expected = expected_kl_part(trainer, {**inputs, "completion_mask": mask}, policy_logps(trainer.model, inputs))
    assert_matches_formula(trainer, kl_part, grads, expected)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_in_evaluation_the_kl_part_takes_no_accumulation_or_generation_split(tokenizer, tmp_path, loss_type) -> None:
    """In evaluation TRL neither accumulates nor splits the generation batch: grpo's loss is not divided by the
    accumulation steps, dapo's normaliser is num_items_in_batch itself, not num_items_in_batch * GA /
    steps_per_generation. So the adapted KL part (clip at 0.3) is the training formula times GA = 2 for grpo
    (beta * the mean of the per-completion means) and times GA / steps_per_generation = 2 / 2 = 1 for dapo
    (beta * the token sum / num_items_in_batch)."""
    trainer = prepared_trainer(tokenizer, tmp_path, loss_type=loss_type, kl_adaptation_method="clip",
                               kl_clip_threshold=0.3)
    trainer.model.eval()
    inputs = fixed_inputs(trainer, tokenizer)
    kl_part, grads = kl_part_and_grads(trainer, inputs)
    training_formula = expected_kl_part(trainer, inputs, policy_logps(trainer.model, inputs))
    factor = GA / (trainer.args.steps_per_generation if loss_type == "dapo" else 1)
    assert factor == (2 if loss_type == "grpo" else 1)
    assert_matches_formula(trainer, kl_part, grads, training_formula * factor)


def test_dapo_divides_the_kl_part_by_each_process_share_of_the_tokens_as_trl_does(tokenizer, tmp_path,
                                                                                 monkeypatch) -> None:
    """dapo's normaliser is num_items_in_batch (the generation batch's tokens over all processes) / the process count
    (times GA / steps_per_generation). With the accelerator reporting 2 processes (one runs here; only the normalisers
    read the count), a no-op adaptation (clip above every KL) gives stock TRL's loss and gradients, whose KL part is
    twice that of 1 process: a KL part divided by all the tokens would be half of it."""
    import accelerate

    trainer = prepared_trainer(tokenizer, tmp_path, loss_type="dapo", kl_adaptation_method="clip",
                               kl_clip_threshold=1e3)
    inputs = fixed_inputs(trainer, tokenizer)
    monkeypatch.setattr(accelerate.Accelerator, "num_processes", property(lambda self: 2))
    with stock_trl():
        stock_loss, stock_grads = loss_and_grads(trainer, "_compute_loss", inputs)
        magnitude = absolute_loss(trainer, "_compute_loss", inputs)  # |stock_loss| is not: advantages cancel
    loss, grads = loss_and_grads(trainer, "_compute_loss", inputs)
    kl_part, _ = kl_part_and_grads(trainer, inputs)
    tokens = int(inputs["completion_mask"].sum())
    assert abs(loss - stock_loss) <= reordered_sum_tolerance(tokens, magnitude)
    assert abs(kl_part.item()) > 100 * reordered_sum_tolerance(tokens, magnitude)
    stock_grad_max = max(g.abs().max().item() for g in stock_grads)
    assert max((g - s).abs().max().item() for g, s in zip(grads, stock_grads)) <= 2 * reordered_sum_tolerance(
        tokens, stock_grad_max)
