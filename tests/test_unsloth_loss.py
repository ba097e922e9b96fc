"""Unsloth's loss through the package's hook on its compiled loss (`UnslothEfficientGRPO`): `none` and no-op
adaptations against stock Unsloth's loss and gradients, each method's KL part against its formula, the keywords the
generated compute_loss passes, what the loss's mask and per-completion weights do to an adapted KL, and Unsloth's
entropy bonus and mask beside it. The real generated UnslothGRPOTrainer runs in one subprocess, its scenarios in
turn (tests/unsloth_runs.py)."""

from __future__ import annotations

import math
import re
import warnings
from typing import Any

import pytest

from unsloth_adaptive_kl.core.tolerance import EPS32, reordered_sum_tolerance
from unsloth_adaptive_kl.tools.tiny import build_tokenizer

from .float32_error import MAX_LOGIT, two_path_logp_tolerance
from .metric_definitions import assert_metrics_match
from .unsloth_runs import ROOT, needs_unsloth, scenarios_in_turn

METHODS = ["none", "clip", "sigmoid", "length_normalized", "dynamic", "sigmoid+length_normalized+dynamic",
           "k2/sequence_sum", "user_three_k2", "k1_future"]  # k2/sequence_sum: clip with kl_estimator k2 and
# kl_reduction sequence_sum; user_three_k2: an estimator the harness registers with register_kl_estimator
# (1.5 (logp - ref)^2); k1_future: value k1, gradient the KL-to-go G_t of each token (by hand in the harness)
# The harness's micro-batch: 4 completions of at most 8 tokens.
TOKENS = 4 * 8
# A log-prob from a plain forward + log_softmax against one from Unsloth's fused path: they differ by <= LOGP_ERROR per
# token (the harness's tiny model: logits below MAX_LOGIT, which its plain forward asserts, and a vocabulary of the
# tokenizer's 52 tokens).
LOGP_ERROR = two_path_logp_tolerance(MAX_LOGIT, len(build_tokenizer()))


# The file's scenarios of the real generated trainer, in this order in one process (tests/unsloth_runs.py)
scenario = scenarios_in_turn("losses", "drift", "policy_masks", "vllm_is_ratio", "nonfinite", "pad_is_eos",
                             "sample_weights")


@needs_unsloth
def test_generated_trainer_none_is_stock_and_methods_match_formula(scenario) -> None:
    results = scenario("losses")
    assert set(results) == {"grpo", "bnpo", "dr_grpo", "dapo"}
    for loss_type, entry in results.items():
        # `none` runs the stock compiled loss: the same operations, so equal up to summation order.
        # The bound's magnitude is the sum of the terms' |.| (stock_magnitude), not |loss|: advantages cancel.
        assert entry["stock_magnitude"] >= abs(entry["stock_loss"])
        loss_tolerance = reordered_sum_tolerance(TOKENS, entry["stock_magnitude"])
        assert abs(entry["none_loss"] - entry["stock_loss"]) <= loss_tolerance, loss_type
        # Gradients: each token's upstream gradient may round differently (2 EPS32 relative), and one parameter's
        # gradient sums TOKENS of them.
        assert entry["stock_grad_max"] > 0
        assert entry["none_grad_diff"] <= 2 * reordered_sum_tolerance(TOKENS, entry["stock_grad_max"]), loss_type
        for method in METHODS:
            part = entry[method]
            # The formula takes log-probs from a plain forward + log_softmax, Unsloth from its fused path: they
            # differ by <= LOGP_ERROR per token. For log ratios within +/-1.5 the KL's derivative |1 - e^r| and its
            # second derivative e^r are below e^1.5 < 4.5, and every reduction weights a token by at most beta
            # (beta * max_completion_length for sequence_sum).
            weight = 0.04 * (8 if method == "k2/sequence_sum" else 1)
            assert abs(part["kl_part"] - part["expected"]) <= weight * 4.5 * LOGP_ERROR, (loss_type, method)
            assert part["grad_max"] > 0
            # Its gradient: each of the TOKENS per-token terms moves by <= 4.5 * LOGP_ERROR relative to the largest,
            # plus the reordering error of the two backward passes whose difference it is (total - policy).
            grad_tolerance = (TOKENS * 4.5 * LOGP_ERROR * part["grad_max"]
                              + 4 * reordered_sum_tolerance(TOKENS, entry["stock_grad_max"]))
            assert part["grad_diff"] <= grad_tolerance, (loss_type, method, part["grad_diff"], grad_tolerance)
            # current_beta * adapted_kl is the KL part of the loss, without the GA factor (2 here)
            assert part["metric_product"] == pytest.approx(2 * part["kl_part"], rel=1e-4), (loss_type, method)
            # the stock `kl` metric whatever the method (the compiled loss, run with beta=0.0, reports 0): Unsloth's
            # mean over completions of their token mean of k3, eager or compiled on the same inputs (k3 of log ratios
            # within +/-1.5: a few tenths)
            assert entry["stock_kl"] > 0.05
            assert abs(part["kl_metric"] - entry["stock_kl"]) <= reordered_sum_tolerance(TOKENS, entry["stock_kl"])
            if "metrics" in part:  # each logged adaptive_kl/* value against docs/metrics.md's definition
                assert_metrics_match(part["metrics"], part["expected_metrics"], rel=1e-4, abs_=1e-6)
        assert sum("metrics" in entry[method] for method in METHODS) == 6, loss_type
        # docs/metrics.md: Unsloth's `kl` is the mean over completions of each one's token mean, not the token mean
        # (which TRL's is); the captured completions' lengths differ, so the two are told apart
        by_hand = entry["stock_kl_by_hand"]
        assert abs(entry["stock_kl"] - by_hand["completion_mean"]) <= 4.5 * LOGP_ERROR, (loss_type, by_hand)
        assert abs(by_hand["token_mean"] - by_hand["completion_mean"]) > 100 * 4.5 * LOGP_ERROR, by_hand
        assert entry["clip"]["kl_part"] < entry["none"]["kl_part"]
    grpo = results["grpo"]
    # grpo already averages per completion: length normalisation sums the same terms in another order.
    assert abs(grpo["length_normalized"]["kl_part"] - grpo["none"]["kl_part"]) <= reordered_sum_tolerance(
        TOKENS, grpo["none"]["kl_part"])
    assert results["dapo"]["length_normalized"]["kl_part"] != pytest.approx(results["dapo"]["none"]["kl_part"], rel=1e-3)


@needs_unsloth
def test_no_op_adaptations_reproduce_stock_unsloth_loss_and_gradients(scenario) -> None:
    """The KL the adapted path shapes is the installed grpo_compute_loss's own (its clamps in its order,
    its masking, its rejected tokens), so adaptations that change nothing give stock Unsloth's loss and gradients,
    on-policy and off-policy, with per-token KL past the [-10, 10] clamp."""
    results = scenario("drift")
    rejected = results.pop("rejected_tokens")
    bnpo_rule = results.pop("bnpo_rule")
    assert set(results) == {f"{lt}/{policy}" for lt in ("grpo", "bnpo", "dr_grpo", "dapo") for policy in ("on_policy", "off_policy")}
    for case, entry in results.items():
        expected = {"clip_above_every_kl", "dynamic_before_decay"}
        if case.startswith("grpo") or (case.startswith("bnpo") and bnpo_rule == "micro_batch"):
            expected.add("same_reduction")
        assert set(entry) - {"stock_loss", "stock_magnitude", "stock_grad_max"} == expected, case
        assert entry["stock_grad_max"] > 0
        for label in expected:
            variant = entry[label]
            # Both bounds are below the issue's 1e-6 here (the terms' magnitude < 0.5, gradients < 0.05).
            assert entry["stock_magnitude"] >= abs(entry["stock_loss"])
            loss_tolerance = reordered_sum_tolerance(TOKENS, entry["stock_magnitude"])
            assert abs(variant["loss"] - entry["stock_loss"]) <= min(loss_tolerance, 1e-6), (case, label)
            grad_tolerance = 2 * reordered_sum_tolerance(TOKENS, entry["stock_grad_max"])
            assert variant["grad_diff"] <= min(grad_tolerance, 1e-6), (case, label)
            assert variant["max_kl"] > 5  # the reduced KL: most tokens sit at the clamp of 10
    # Rejected tokens: about half rejected; where the installed version drops them from the KL (2026.10.9) the
    # stock loss changes with them, and the hooked loss follows it either way.
    assert 0.3 < rejected["rejected_fraction"] < 0.7
    stock, hooked = rejected["stock"], rejected["hooked"]
    assert rejected["stock_magnitude"] >= abs(stock["loss"])
    assert abs(hooked["loss"] - stock["loss"]) <= reordered_sum_tolerance(TOKENS, rejected["stock_magnitude"])
    grad_scale = max(abs(g) for g in stock["grad"])
    assert grad_scale > 0
    assert max(abs(a - b) for a, b in zip(hooked["grad"], stock["grad"])) <= 2 * reordered_sum_tolerance(TOKENS, grad_scale)
    if rejected["rejected_tokens_leave_kl"]:
        assert stock["loss"] != pytest.approx(rejected["stock_without_rejection"]["loss"], rel=1e-3)


@needs_unsloth
def test_unsloths_entropy_bonus_and_policy_masks_stay_beside_an_adapted_kl(scenario) -> None:
    """A fixed entropy_coef: Unsloth adds -entropy_coef * the entropy mean after the compiled loss this package hooks;
    top_entropy_quantile=0.5 and off_policy_mask_threshold=0.1: the compiled loss multiplies the policy term alone by
    the entropy mask and the off-policy sequence mask. No-op adaptations keep stock Unsloth's loss and gradients,
    bonus and masks included, and clip's KL part (the loss minus the loss at beta 0, bonus and masks in both) is its
    formula's over every valid token."""
    results = scenario("policy_masks")
    assert set(results) == {"grpo", "dapo"}
    vocabulary = len(build_tokenizer())
    for loss_type, entry in results.items():
        # the bonus is there, and below 0.05 * the largest entropy a token can have, log(vocabulary)
        assert 0.01 < entry["stock_without_bonus"] - entry["stock_loss"] < 0.05 * math.log(vocabulary), loss_type
        # each mask acts, alone and beside the other (the off-policy one drops the two completions with a negative
        # advantage, the entropy mask half of the tokens), and a policy term stays: the loss at beta 0 is not the bonus
        without = entry["policy_without"]
        assert abs(without["entropy_mask"] - without["masks"]) > 1e-3, loss_type
        assert abs(without["off_policy_mask"] - without["masks"]) > 1e-3, loss_type
        assert abs(entry["policy"] - without["entropy_mask"]) > 1e-3, loss_type
        assert abs(entry["policy"] - without["off_policy_mask"]) > 1e-3, loss_type
        assert abs(entry["policy"] - (entry["stock_loss"] - entry["stock_without_bonus"])) > 1e-3, loss_type
        # the hooked loss sums the KL in another order (the bound of the drift test, on the policy and KL terms'
        # magnitude) and adds the same bonus: one more rounding of the total
        loss_tolerance = (reordered_sum_tolerance(TOKENS, entry["stock_magnitude"])
                          + 2 * EPS32 * abs(entry["stock_loss"]))
        grad_tolerance = 2 * reordered_sum_tolerance(TOKENS, entry["stock_grad_max"])
        assert entry["none"] == {"loss": entry["stock_loss"], "grad_diff": 0.0}, loss_type  # the stock call itself
        for label in ("clip_above_every_kl", "dynamic_before_decay"):
            assert abs(entry[label]["loss"] - entry["stock_loss"]) <= loss_tolerance, (loss_type, label)
            assert entry[label]["grad_diff"] <= grad_tolerance, (loss_type, label)
        # as in test_generated_trainer_none_is_stock_and_methods_match_formula, plus each loss's last rounding: the
        # KL part covers every valid token, the masked ones too
        clip = entry["clip"]
        assert clip["expected"] > 1e-3
        assert abs(clip["kl_part"] - clip["expected"]) <= 0.04 * 4.5 * LOGP_ERROR + loss_tolerance, loss_type


@needs_unsloth
def test_vllms_importance_sampling_ratio_weights_unsloths_policy_term_alone_beside_an_adapted_kl(scenario) -> None:
    """With vLLM generating, grpo_compute_loss multiplies the policy term alone by the ratio of the old policy to
    vLLM's sampling log-probs (TRL's default mode, per completion, and a per-token one), then adds beta * KL. vLLM
    cannot run here: the harness tells the trainer it generated with vLLM and puts sampling log-probs in the batch.
    No-op adaptations keep stock Unsloth's loss and gradients, and clip's KL part is its formula, no ratio in it."""
    results = scenario("vllm_is_ratio")
    assert set(results) == {f"{lt}/{mode}" for lt in ("grpo", "dapo") for mode in ("sequence_mask", "token_truncate")}
    for case, entry in results.items():
        assert abs(entry["policy"] - entry["unweighted_policy"]) > 1e-3, case  # the ratio acts on this batch
        assert entry["stock_magnitude"] >= abs(entry["stock_loss"])
        loss_tolerance = reordered_sum_tolerance(TOKENS, entry["stock_magnitude"])
        grad_tolerance = 2 * reordered_sum_tolerance(TOKENS, entry["stock_grad_max"])
        assert entry["none"] == {"loss": entry["stock_loss"], "grad_diff": 0.0}, case  # the stock call itself
        for label in ("clip_above_every_kl", "dynamic_before_decay"):
            assert abs(entry[label]["loss"] - entry["stock_loss"]) <= loss_tolerance, (case, label)
            assert entry[label]["grad_diff"] <= grad_tolerance, (case, label)
        clip = entry["clip"]  # the bound of the policy-masks test above
        assert clip["expected"] > 1e-3
        assert abs(clip["kl_part"] - clip["expected"]) <= 0.04 * 4.5 * LOGP_ERROR + loss_tolerance, case


def test_a_loss_keyword_the_generated_trainer_stops_passing_is_an_error_naming_it() -> None:
    """The installed grpo_compute_loss reads the keywords it reduces the loss by with defaults (loss_type 'grpo',
    num_processes 1, gradient accumulation 1, ...): where the generated compute_loss stops passing one (a rename),
    the adaptive loss raises IncompatibleVersionError naming it, instead of reducing the KL by a default the loss no
    longer uses. steps_per_generation may be absent (grpo_accumulated_loss sets it; None, as the installed loss reads
    it, where it does not). The real generated trainer passes every one: the scenarios above run through it."""
    from unsloth_adaptive_kl.integrations import unsloth as integration
    from unsloth_adaptive_kl.integrations.grpo_loss import LossNormalisers
    from unsloth_adaptive_kl.integrations.versions import IncompatibleVersionError

    passed = {"loss_type": "dapo", "max_completion_length": 16, "num_items_in_batch": 40.0,
              "current_gradient_accumulation_steps": 2, "num_processes": 4}
    assert integration._normalisers(passed, "micro_batch") == ("dapo", LossNormalisers(16, 40.0, 4, None, 2))
    assert integration._normalisers({**passed, "steps_per_generation": 8}, "micro_batch")[1].steps_per_generation == 8
    assert integration._normalisers({**passed, "loss_type": "bnpo"}, "global")[0] == "dapo"
    # no token count to divide by (None): bnpo keeps its own reduction under either rule
    assert integration._normalisers({**passed, "loss_type": "bnpo", "num_items_in_batch": None}, "global")[0] == "bnpo"
    assert integration._normalisers({**passed, "loss_type": "bnpo"}, "micro_batch")[0] == "bnpo"
    for name in passed:
        with pytest.raises(IncompatibleVersionError, match=rf"`{name} = `.*UnslothGRPOTrainer\.compute_loss"):
            integration._normalisers({key: value for key, value in passed.items() if key != name}, "micro_batch")


def test_a_generated_compute_loss_that_does_not_call_the_compiled_loss_once_is_an_error() -> None:
    """The generated compute_loss must reach the shim (`UnslothEfficientGRPO.apply`) once per call: where a changed
    Unsloth calls it zero or two times, the wrapper raises IncompatibleVersionError naming that call instead of
    logging a step without a KL term, or one of two. The shim sees the running trainer only inside the call: after it
    (here, after the error) `_ACTIVE` is unset again, so a later call of the shim outside compute_loss runs stock."""
    from types import SimpleNamespace

    from unsloth_adaptive_kl import AdaptiveKLConfig
    from unsloth_adaptive_kl.integrations import unsloth as integration
    from unsloth_adaptive_kl.integrations.versions import IncompatibleVersionError

    seen: list = []

    def generated(self: Any, model: Any, inputs: int, return_outputs: bool = False, num_items_in_batch: Any = None
                  ) -> float:
        """Unsloth's compute_loss, as far as the wrapper sees it: `inputs` shim calls, each recording its term."""
        trainer, calls = integration._ACTIVE.get()
        seen.append(trainer)
        calls.extend([None] * inputs)
        return 0.5

    compute_loss = integration._wrap_compute_loss(generated)
    config = AdaptiveKLConfig(kl_adaptation_method="clip")
    trainer = SimpleNamespace(beta=0.04, args=SimpleNamespace(beta=0.04), _adaptive_kl_args_beta=0.04,  # as built
                              adaptive_kl=SimpleNamespace(beta=0.04, config=config))
    for shim_calls in (0, 2):
        with pytest.raises(IncompatibleVersionError, match=r"unsloth_zoo.*`UnslothEfficientGRPO\.apply\(` \(the "
                           r"compiled loss, which the adaptive loss wraps\) was not found in Unsloth's generated "
                           r"trainer: grpo_accumulated_loss"):
            compute_loss(trainer, None, shim_calls)
        assert integration._ACTIVE.get() is None
    assert seen == [trainer, trainer]


def test_at_beta_zero_the_loss_hook_returns_unsloths_loss_but_refuses_a_setting_changed_mid_run() -> None:
    """At beta 0 the wrapper hands the call to Unsloth's compute_loss untouched (no KL term: the shim is not active
    in it); on ccb0d5c that early return also skipped the settings check every other door makes, there too. Unchanged
    args: Unsloth's loss; kl_adaptation_method changed on the args after the trainer was built: refused, naming it."""
    from types import SimpleNamespace

    from unsloth_adaptive_kl import AdaptiveKL, AdaptiveKLConfig
    from unsloth_adaptive_kl.integrations import unsloth as integration

    active: list = []

    def generated(self: Any, model: Any, inputs: Any, return_outputs: bool = False, num_items_in_batch: Any = None
                  ) -> float:
        active.append(integration._ACTIVE.get())
        return 0.5

    args = AdaptiveKLConfig()
    trainer = SimpleNamespace(beta=0.0, args=args, adaptive_kl=AdaptiveKL(AdaptiveKLConfig(), beta=0.0),
                              _adaptive_kl_args_beta=None)  # as attach_runtime records args.beta (a config has none)
    compute_loss = integration._wrap_compute_loss(generated)
    assert compute_loss(trainer, None, None) == 0.5 and active == [None]
    args.kl_adaptation_method = "clip"
    with pytest.raises(ValueError, match=r"^kl_adaptation_method changed from 'none' to 'clip' after the run started"):
        compute_loss(trainer, None, None)
    assert active == [None]


def test_a_trainer_beta_set_mid_run_stops_an_adapted_loss_at_unsloths_door_before_its_call() -> None:
    """trainer.beta set after the run started (0.04 -> 0.4, a callback scheduling it): as at TRL's door
    (tests/test_trl_loss.py), an adapted setting is refused, naming trainer.beta and the beta it was built with, before
    Unsloth's compute_loss runs (the adapted term would go on multiplying the controller's beta)."""
    from types import SimpleNamespace

    from unsloth_adaptive_kl import AdaptiveKL, AdaptiveKLConfig
    from unsloth_adaptive_kl.integrations import unsloth as integration

    called: list = []
    compute_loss = integration._wrap_compute_loss(lambda *args: called.append(args))
    config = AdaptiveKLConfig(kl_adaptation_method="clip")
    trainer = SimpleNamespace(beta=0.4, args=config, adaptive_kl=AdaptiveKL(config, beta=0.04),
                              _adaptive_kl_args_beta=None)
    with pytest.raises(ValueError, match=r"^trainer\.beta=0\.4 is invalid: allowed is the beta the trainer was built "
                                         r"with \(0\.04\) while adaptive KL is on \(kl_adaptation_method='clip'\)"):
        compute_loss(trainer, None, None)
    assert called == [] and integration._ACTIVE.get() is None


@needs_unsloth
def test_a_non_finite_valid_log_prob_is_named_and_masked_garbage_changes_nothing_at_unsloths_door(scenario) -> None:
    """As at every door: a NaN on one valid token of the reference or of the old policy's log-probs (which Unsloth's
    importance ratio divides by) raises `NonFiniteLogProbError` naming the tensor and the one token; NaN and -inf on
    masked reference positions leave the loss and gradients exactly the clean batch's, for `none` and `clip`."""
    results = scenario("nonfinite")
    for method in ("none", "clip"):
        found = results[method]
        assert found["masked"] >= 2 and found["masked_same"] is True
        for tensor, kind in (("ref_per_token_logps", "reference"), ("old_per_token_logps", "old policy")):
            assert found[tensor].startswith("NonFiniteLogProbError: adaptive KL: non-finite input at step "), found
            assert f"in the {kind} log-probs: 1 valid token(s) on process 0." in found[tensor]


@needs_unsloth
def test_pad_equal_to_eos_masks_every_eos_out_of_unsloths_loss_and_warns(scenario) -> None:
    """Unsloth's loss receives the mask `completion_ids != pad_token_id` (TRL's includes each completion's EOS): with
    pad = EOS, on one step's batch, no completion's EOS is in it while every letter before it is; with a pad token of
    its own every EOS is. The trainer's construction says so, once, for pad = EOS only, and refuses an adapted KL
    there (`none` stays stock)."""
    results = scenario("pad_is_eos")
    same, own = results["pad_is_eos"], results["own_pad"]
    assert same["eos_completions"] > 0 and same["eos_in_mask"] == 0
    assert same["letters_in_mask"] == same["letters"] > 0
    assert own["eos_completions"] > 0 and own["eos_in_mask"] == own["eos_completions"]
    assert len(same["warnings"]) == 1 and same["warnings"][0].startswith(
        "pad_token_id=0 is the eos_token_id: Unsloth's GRPO loss masks every pad token out of the loss")
    # troubleshooting.md quotes its beginning, up to "..."
    page = (ROOT / "docs" / "troubleshooting.md").read_text()
    (quoted,) = re.findall(r"```text\n(UserWarning: pad_token_id=.*?)\n```", page)
    assert quoted.endswith(": ...") and f"UserWarning: {same['warnings'][0]}".startswith(quoted[:-len("...")])
    assert results["refused"].startswith("pad_token_id=0 is invalid: allowed is a token other than the eos_token_id "
                                         "(0) with kl_adaptation_method='clip', kl_placement='loss': Unsloth's GRPO")
    assert own["warnings"] == []


@needs_unsloth
def test_unsloths_sample_weights_refuse_an_adapted_kl_at_construction_and_leave_none_stock(scenario) -> None:
    """With Unsloth's per-completion weights on, building the trainer with `clip` raises the documented error (the
    troubleshooting page's); `none` warns once, logs no adaptive_kl/* metric, and on a weighted batch its loss and
    gradients are stock Unsloth's exactly (the shim hands the call to Unsloth's own loss). Set only after a `clip`
    trainer was built, they stop its first loss call; with beta = 0 (no KL term) `clip` is built without a word."""
    results = scenario("sample_weights")
    troubleshooting = (ROOT / "docs" / "troubleshooting.md").read_text()
    assert f"NotImplementedError: {results['refused']}\n" in troubleshooting
    assert len(results["warnings"]) == 1 and "the loss stays stock Unsloth's" in results["warnings"][0]
    assert results["adaptive_metrics"] == [] and results["logged_kl"]  # the step logged, its KL stock Unsloth's
    assert len(results["weights"]) == 4 and any(weight > 0 for weight in results["weights"])  # the weights reach it
    assert results["loss"] == results["stock_loss"]
    # set only after a `clip` trainer was built: its first loss call stops the run, naming them
    assert results["set_late"] == (
        "Unsloth's per-completion loss weights (UNSLOTH_GRPO_ZERO_VARIANCE_EXCLUDE=1 or UNSLOTH_GRPO_LOSS_AGGREGATION="
        "prompt) reweight the loss's rows, which an adapted KL term does not follow: they were set after the trainer "
        "was built")
    assert results["beta_zero"] == []  # beta = 0: no KL term, so `clip` is neither refused nor warned about
    assert results["grad_diff"] == 0.0 and results["grad_max"] > 0
    grpo = results["grpo"]  # exclusion alone with grpo: Unsloth ignores it (and says so), so nothing is refused
    assert grpo["ours"] == [] and grpo["unsloth_ignores"] and grpo["weights"] is None
    assert "adaptive_kl/clip_fraction" in grpo["adaptive_metrics"]


@pytest.mark.parametrize(("mode", "weighted"), [
    (None, ()),
    ((True, False), ("bnpo", "dapo", "cispo", "vespo")),
    ((False, True), ("grpo", "sapo", "bnpo", "dapo", "cispo", "vespo", "dr_grpo")),
    ((True, True), ("grpo", "sapo", "bnpo", "dapo", "cispo", "vespo", "dr_grpo")),
])
def test_unsloths_weights_are_refused_only_where_unsloth_applies_them(mode, weighted) -> None:
    """Unsloth's `_unsloth_grpo_sample_weight` (2026.10.7-10.9, whose rule the anchors pin) weights with prompt-level
    aggregation for every loss type but luspo, with zero-variance exclusion alone for bnpo/dapo/cispo/vespo only."""
    from unsloth_adaptive_kl.integrations.unsloth import unsloth_weights_loss

    loss_types = ("grpo", "sapo", "bnpo", "dapo", "cispo", "vespo", "dr_grpo", "luspo")
    assert tuple(t for t in loss_types if unsloth_weights_loss(mode, t)) == weighted


@pytest.mark.parametrize("beta", [0.04, 0.0])
def test_the_pad_check_reads_a_processors_tokenizer_and_passes_one_without_pad_or_eos(beta: float) -> None:
    """The construction check of pad = EOS (`_check_unsupported`, run after the generated __init__), Unsloth's sample
    weights off (mode None): with a processor as processing_class it reads the tokenizer the processor holds (pad 0 =
    EOS 0: `clip` refused; with beta = 0 there is no KL term, so, as for the sample weights, only the stock warning
    about the EOS's policy gradient); a tokenizer with neither a pad nor an EOS token (None = None) has no EOS for
    Unsloth's mask to drop, so nothing is refused or warned."""
    from types import SimpleNamespace

    from unsloth_adaptive_kl import AdaptiveKLConfig
    from unsloth_adaptive_kl.integrations.unsloth import _check_unsupported
    from unsloth_adaptive_kl.tools.tiny import build_tokenizer

    def generated_init(self: Any, processing_class: Any) -> None:
        """What the generated __init__ (wrapped by `wrap_init`) leaves on the trainer, as far as the check reads it."""
        self.processing_class, self.beta, self.args = processing_class, beta, SimpleNamespace(loss_type="dapo")
        self.adaptive_kl = SimpleNamespace(config=AdaptiveKLConfig(kl_adaptation_method="clip"))

    init = _check_unsupported(generated_init, lambda: None)
    processor = SimpleNamespace(tokenizer=build_tokenizer("ab", pad_is_eos=True))
    if beta:
        with pytest.raises(ValueError, match=r"^pad_token_id=0 is invalid: allowed is a token other than the "
                                             r"eos_token_id \(0\) with kl_adaptation_method='clip'"):
            init(SimpleNamespace(), processor)
    else:
        with pytest.warns(UserWarning, match=r"^pad_token_id=0 is the eos_token_id: Unsloth's GRPO loss") as caught:
            init(SimpleNamespace(), processor)
        assert caught[0].filename == __file__  # the line that built the trainer, not the package's
    tokenizer = build_tokenizer("ab")
    tokenizer.pad_token = tokenizer.eos_token = None
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id) == (None, None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        init(SimpleNamespace(), tokenizer)
