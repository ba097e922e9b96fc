"""verl integration: adaptive KL in verl's own actor loss (`ppo_loss`), reward KL (`apply_kl_penalty`), training
worker and trainer config, on CPU; the end-to-end trainer (`python -m verl.trainer.main_ppo`) is
tests/test_verl_end_to_end.py's.

The loss and reward tests call verl's real functions on real TensorDicts / DataProtos in this process. The worker and
end-to-end tests run in a subprocess each (tests/verl_cpu.py: a CPU platform and engine registered through verl's own
registries, one gloo process group, and an HF-generate rollout), so this process keeps no process group or Ray."""

from __future__ import annotations

import copy
import dataclasses
import importlib.metadata
import itertools
import json
import math
import os
import re
import statistics
import subprocess
import sys
import types
import warnings
from typing import Any
from unittest import mock

import pytest

# Without verl these tests skip; `.ci/run` installs it in a row of its own and sets ADAPTIVE_KL_REQUIRE_VERL=1, so
# there a missing verl is an error, not a skip.
if os.environ.get("ADAPTIVE_KL_REQUIRE_VERL") != "1":
    pytest.importorskip("verl")

import torch  # noqa: E402
from tensordict import TensorDict  # noqa: E402
from verl.protocol import DataProto  # noqa: E402
from verl.trainer.ppo import core_algos, ray_trainer  # noqa: E402
from verl.trainer.ppo.v1 import trainer_base  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.workers.config import ActorConfig  # noqa: E402
from verl.workers.utils.losses import ppo_loss  # noqa: E402

from unsloth_adaptive_kl import AdaptiveKL, AdaptiveKLConfig, NonFiniteLogProbError  # noqa: E402
from unsloth_adaptive_kl.integrations import verl as verl_kl  # noqa: E402
from unsloth_adaptive_kl.core.numerics import LogpCheck  # noqa: E402
from unsloth_adaptive_kl.core.config import canonical_methods  # noqa: E402
from unsloth_adaptive_kl.core.statistics import NAMES, KLStatistics  # noqa: E402
from unsloth_adaptive_kl.integrations import versions  # noqa: E402
from unsloth_adaptive_kl.integrations.versions import IncompatibleVersionError  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from verl_cpu import ADAPTIVE_RUN, PAGE_RUN  # noqa: E402

AGG_MODES = ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
KL_TYPES = ["low_var_kl", "k1", "k2", "k3+"]
METRIC = "adaptive_kl/"  # the prefix of the metric names a verl user sees


# ----- verl's ppo_loss on real TensorDicts --------------------------------------------------------------------------


def _nested(rows):
    return torch.nested.as_nested_tensor(rows, layout=torch.jagged)


def make_batch(batch_size=8, seed=0, response_lengths=None, kl_scale=2.0):
    """A batch as verl's actor update sees it: nested prompts/responses and per-response-token fields, plus the
    policy log-probs over prompt + response (the model output, left-shifted by verl's no_padding_2_padding)."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(2, 6, (batch_size,), generator=g).tolist()
    responses = response_lengths or torch.randint(1, 9, (batch_size,), generator=g).tolist()
    td = TensorDict({
        "prompts": _nested([torch.randint(0, 50, (n,), generator=g) for n in prompts]),
        "responses": _nested([torch.randint(0, 50, (n,), generator=g) for n in responses]),
        "response_mask": _nested([torch.ones(n, dtype=torch.int64) for n in responses]),
        "old_log_probs": _nested([-torch.rand(n, generator=g) * kl_scale for n in responses]),
        "ref_log_prob": _nested([-torch.rand(n, generator=g) * kl_scale for n in responses]),
        "advantages": _nested([torch.full((n,), float(torch.randn(1, generator=g))) for n in responses]),
    }, batch_size=[batch_size])
    log_probs = -torch.rand(sum(prompts) + sum(responses), generator=g) * kl_scale
    return td, log_probs, prompts, responses


def actor_config(mode="token-mean", kl_type="low_var_kl", coef=0.05, use_kl=True):
    return ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, use_kl_loss=use_kl,
                       kl_loss_coef=coef, kl_loss_type=kl_type, loss_agg_mode=mode, entropy_coeff=0.0,
                       loss_scale_factor=16 if mode.endswith("norm") else None)


def run_loss(loss_fn, batch, micro_batches, beta=None, dp_size=1, batch_num_tokens=None, global_batch_size=None):
    """Forward + backward over `micro_batches` micro-batches as verl's engine does (global batch info in the
    non-tensor data, by default of this batch alone: one data-parallel rank; chunked with verl's chunk_tensordict):
    (total loss, gradient of the log-probs, metrics)."""
    td, log_probs0, prompts, responses = batch
    log_probs = log_probs0.clone().requires_grad_(True)
    td = td.clone()
    tu.assign_non_tensor(td, dp_size=dp_size, batch_num_tokens=batch_num_tokens or sum(responses),
                         global_batch_size=global_batch_size or len(prompts))
    if beta is not None:
        tu.assign_non_tensor(td, **{verl_kl.BETA_KEY: beta})
    lengths = [p + r for p, r in zip(prompts, responses)]
    per = len(prompts) // micro_batches
    total, start, metrics = torch.zeros(()), 0, []
    for index, micro in enumerate(tu.chunk_tensordict(td, micro_batches)):
        sizes = lengths[index * per:(index + 1) * per]
        values = log_probs[start:start + sum(sizes)]
        start += sum(sizes)
        offsets = torch.tensor([0, *torch.tensor(sizes).cumsum(0).tolist()])
        loss, m = loss_fn(model_output={"log_probs": torch.nested.nested_tensor_from_jagged(values, offsets)},
                          data=micro)
        loss.backward()
        total = total + loss.detach()
        metrics.append(m)
    return total, log_probs.grad, metrics


def adaptive(config, method="none", **fields):
    return verl_kl.AdaptivePPOLoss(config, AdaptiveKLConfig(kl_adaptation_method=method, **fields))


@pytest.mark.parametrize("mode", AGG_MODES)
def test_none_is_stock_ppo_loss_bit_for_bit(mode):
    batch = make_batch()
    for kl_type in KL_TYPES:
        config = actor_config(mode, kl_type)
        for micro in (1, 2, 4):
            stock_loss, stock_grad, stock_metrics = run_loss(lambda **kw: ppo_loss(copy.deepcopy(config), **kw),
                                                             batch, micro)
            ours_loss, ours_grad, ours_metrics = run_loss(adaptive(copy.deepcopy(config)), batch, micro, beta=0.05)
            assert torch.equal(stock_loss, ours_loss), (mode, kl_type, micro)
            assert torch.equal(stock_grad, ours_grad), (mode, kl_type, micro)
            for stock, ours in zip(stock_metrics, ours_metrics):
                assert stock["kl_loss"].values == ours["kl_loss"].values
                assert stock["kl_coef"] == ours["kl_coef"]
                assert stock["actor/pg_loss"].values == ours["actor/pg_loss"].values


@pytest.mark.parametrize("method", ["none", "clip", "sigmoid", "length_normalized", "clip+length_normalized"])
@pytest.mark.parametrize("mode", AGG_MODES)
def test_total_gradient_same_for_1_2_4_micro_batches(mode, method):
    batch = make_batch(seed=1)
    loss_fn = adaptive(actor_config(mode), method, kl_clip_threshold=0.2, kl_target=0.1)
    loss1, grad1, _ = run_loss(loss_fn, batch, 1, beta=0.3)
    for micro in (2, 4):
        loss, grad, _ = run_loss(loss_fn, batch, micro, beta=0.3)
        torch.testing.assert_close(loss, loss1, rtol=1e-6, atol=1e-6)  # float32 sums in another order
        torch.testing.assert_close(grad, grad1, rtol=1e-6, atol=1e-6)


def kl_part(loss_fn, batch, beta=1.0):
    """The KL part of the loss: loss(beta) - loss(0), and its gradient."""
    with_kl, grad_kl, metrics = run_loss(loss_fn, batch, 1, beta=beta)
    without, grad0, _ = run_loss(loss_fn, batch, 1, beta=0.0)
    return with_kl - without, grad_kl - grad0, metrics[0]


def sums_of(metrics):
    """The core's sums (`KLStatistics`) of the micro-batches whose worker metrics are `metrics` (a dict or a list):
    the rows the workers ship, added as the driver adds them."""
    rows = [m[verl_kl.STATS + "sums"] for m in (metrics if isinstance(metrics, list) else [metrics])]
    assert all(len(row) == len(NAMES) for row in rows)
    return sum((KLStatistics(*row) for row in rows), KLStatistics())


def padded(batch):
    """The policy and reference log-probs of `batch`'s response tokens (padded, as stored) and its mask, by the
    same slicing verl uses."""
    td, log_probs, prompts, responses = batch
    from verl.workers.utils.padding import no_padding_2_padding

    offsets = torch.tensor([0, *torch.tensor([p + r for p, r in zip(prompts, responses)]).cumsum(0).tolist()])
    lp = no_padding_2_padding(torch.nested.nested_tensor_from_jagged(log_probs, offsets), td)
    fields = td.select("response_mask", "ref_log_prob").to_padded_tensor()
    return lp, fields["ref_log_prob"], fields["response_mask"].bool()


def per_token(batch, kl_type="low_var_kl"):
    """verl's per-token KL of `batch` (padded) and its mask."""
    lp, ref, mask = padded(batch)
    return core_algos.kl_penalty(lp, ref, kl_type), mask


def test_clip_follows_its_formula_and_has_no_gradient_above_the_threshold():
    batch = make_batch(seed=2, kl_scale=3.0)
    threshold = 0.3
    kl_value, grad, metrics = kl_part(adaptive(actor_config(), "clip", kl_clip_threshold=threshold), batch)
    k, mask = per_token(batch)
    expected = torch.clamp(k, max=threshold)[mask].sum() / mask.sum()
    torch.testing.assert_close(kl_value, expected, rtol=1e-5, atol=1e-6)
    sums = sums_of(metrics)  # one micro-batch: all of the mini-batch's tokens, one entry
    assert sums.entries == 1
    assert sums.adapted == pytest.approx(float(expected), rel=1e-6)
    assert sums.raw == pytest.approx(float(k[mask].mean()), rel=1e-6) == metrics["kl_loss"].values[0]
    # the response tokens' log-prob gradient from the KL term, in verl's left-shifted layout
    td, log_probs, prompts, responses = batch
    starts = torch.tensor([0, *torch.tensor([p + r for p, r in zip(prompts, responses)]).cumsum(0).tolist()])
    token_grads = [grad[s + p - 1: s + p - 1 + r] for s, p, r in zip(starts.tolist(), prompts, responses)]
    above = [k[i, :r] >= threshold for i, r in enumerate(responses)]
    assert any(a.any() for a in above) and any((~a).any() for a in above)
    for g, a in zip(token_grads, above):
        assert torch.all(g[a] == 0)
        assert torch.all(g[~a] != 0)


def test_sigmoid_follows_its_formula():
    batch = make_batch(seed=3)
    kl_value, _, _ = kl_part(adaptive(actor_config(), "sigmoid", kl_target=0.2), batch)
    k, mask = per_token(batch)
    expected = (torch.sigmoid(k - 0.2) * k)[mask].sum() / mask.sum()
    torch.testing.assert_close(kl_value, expected, rtol=1e-5, atol=1e-6)


def test_length_normalized_doubling_a_completion_leaves_its_kl_unchanged():
    short = make_batch(batch_size=1, seed=4, response_lengths=[3])
    td, lp, (p,), (r,) = short
    response_lp = lp[p - 1:p - 1 + r]  # verl's left shift: token j's log-prob sits at p - 1 + j
    doubled = lambda key: _nested([torch.cat([td[key][0]] * 2)])  # noqa: E731
    long = (TensorDict({"prompts": td["prompts"], **{key: doubled(key) for key in
                        ("responses", "response_mask", "old_log_probs", "ref_log_prob", "advantages")}},
                       batch_size=[1]),
            torch.cat([lp[:p - 1], response_lp, response_lp, lp[p - 1 + r:]]), [p], [2 * r])
    for mode in AGG_MODES:
        fn = adaptive(actor_config(mode), "length_normalized")
        short_kl, _, _ = kl_part(fn, short)
        long_kl, _, _ = kl_part(fn, long)
        torch.testing.assert_close(short_kl, long_kl, rtol=1e-6, atol=1e-7)
        if "token-sum" in mode:  # without length normalisation, verl's token sums double
            stock_short, _, _ = kl_part(adaptive(actor_config(mode)), short)
            stock_long, _, _ = kl_part(adaptive(actor_config(mode)), long)
            assert not torch.allclose(stock_short, stock_long)


def test_beta_used_is_the_beta_pushed_to_every_micro_batch():
    batch = make_batch(seed=5)
    fn = adaptive(actor_config(coef=0.05), "clip", kl_clip_threshold=0.5)
    _, _, metrics = run_loss(fn, batch, 4, beta=0.37)
    assert [m["kl_coef"] for m in metrics] == [0.37] * 4
    one, _, m1 = kl_part(fn, batch, beta=1.0)
    pushed, _, _ = kl_part(fn, batch, beta=0.37)
    torch.testing.assert_close(pushed, 0.37 * one, rtol=1e-5, atol=1e-7)
    # without a pushed beta (no driver: the controller is not in use), the worker raises instead of training at
    # kl_loss_coef
    with pytest.raises(RuntimeError, match=r"no 'adaptive_kl_beta' in the micro-batch's non-tensor data"):
        run_loss(fn, batch, 2)


@pytest.mark.parametrize("method", ["dynamic", "target"])
def test_unshaped_methods_equal_stock_ppo_loss_at_the_pushed_beta(method):
    """Nothing shaped, on float32 log-probs: the pipeline's float32 term equals verl's ppo_loss with kl_loss_coef =
    the pushed beta, bit for bit; target's KL measure over the micro-batches is the token mean of verl's per-token
    KL."""
    batch = make_batch(seed=6)
    mode = "seq-mean-token-mean"
    stock_loss, stock_grad, _ = run_loss(lambda **kw: ppo_loss(actor_config(mode, coef=0.37), **kw), batch, 2)
    loss, grad, metrics = run_loss(adaptive(actor_config(mode, coef=0.05), method, kl_target=0.1), batch, 2,
                                   beta=0.37)
    assert torch.equal(loss, stock_loss) and torch.equal(grad, stock_grad)
    for m in metrics:
        assert m["kl_coef"] == 0.37
        assert [sums_of(m).raw] == [sums_of(m).adapted] == m["kl_loss"].values
    if method == "target":  # the core's WindowKL.token_mean, from every micro-batch's S_i and L_i
        k, mask = per_token(batch)
        assert sums_of(metrics).window().token_mean == pytest.approx(float(k[mask].mean()), rel=1e-6)


def test_anchor_missing_is_an_error_naming_it(monkeypatch):
    verl_kl.check_anchors()
    assert all(versions.resolve_verl(a.function) is not None for a in versions.VERL_ANCHORS)
    moved = versions.Anchor("workers.utils.losses.ppo_loss", "policy_loss += kl_loss * config.kl_coef_that_moved",
                            "a moved line")
    monkeypatch.setattr(versions, "VERL_ANCHORS", (*versions.VERL_ANCHORS, moved))
    with pytest.raises(IncompatibleVersionError,
                       match=r"verl==0\.9\.1 .*kl_coef_that_moved.*\(a moved line\).*verl\.workers\.utils\.losses\.ppo_loss"):
        verl_kl.check_anchors()
    gone = versions.Anchor("workers.utils.losses.ppo_loss_v2", "anything", "a renamed function")
    monkeypatch.setattr(versions, "VERL_ANCHORS", (gone,))
    with pytest.raises(IncompatibleVersionError, match="ppo_loss_v2"):
        verl_kl.check_anchors()


def test_adaptive_kl_block_is_validated():
    loss, reward = verl_kl.configs_from({"kl_adaptation_method": "clip", "kl_clip_threshold": 0.5,
                                         "reward": {"kl_adaptation_method": "clip+target", "beta_max": 0.2}})
    assert loss.kl_methods == ("clip",) and reward.kl_methods == ("clip", "target")
    assert (loss.kl_clip_threshold, reward.kl_clip_threshold, reward.beta_max) == (0.5, 0.5, 0.2)
    with pytest.raises(ValueError, match="kl_clip_threshold"):
        verl_kl.configs_from({"kl_clip_threshold": -1})
    with pytest.raises(ValueError, match="unknown field.*kl_clip"):
        verl_kl.configs_from({"kl_clip": 1})
    with pytest.raises(ValueError, match="kl_placement.*use_kl_in_reward"):
        verl_kl.configs_from({"kl_placement": "reward"})


@pytest.mark.parametrize(("block", "message"), [
    ({"ref_model_sync_kl": 0.5}, r"adaptive_kl\.ref_model_sync_kl=0\.5 is not used with verl: the reference sync is "
                                 r"TRL's"),
    ({"reward": {"ref_model_sync_reset_optimizer": True}},
     r"adaptive_kl\.reward\.ref_model_sync_reset_optimizer=True is not used with verl"),
    ({"reward": {"kl_estimator": "k3"}}, r"adaptive_kl\.reward\.kl_estimator='k3' is not used with verl: the "
                                         r"estimator of the KL in the reward is verl's algorithm\.kl_penalty"),
    ({"reward": {"kl_percentile": 0.5}}, r"adaptive_kl\.reward\.kl_percentile=0\.5 is not used with verl"),
    ({"reward": {"kl_reduction": "sequence_mean"}},
     r"adaptive_kl\.reward\.kl_reduction='sequence_mean' is not used with verl: .*always beta_t \* sum_t m k'"),
])
def test_a_field_verl_does_not_read_is_refused_naming_it(block, message):
    """Nothing silently does nothing: a field no verl code path reads, set to anything but its default, is a
    ValueError naming the field, its value and why."""
    with pytest.raises(ValueError, match=message):
        verl_kl.configs_from(block)


def test_a_shared_field_goes_to_the_config_that_reads_it_and_one_neither_reads_warns_once():
    """A field at the top of the block acts on both KLs: it goes where a method reads it (kl_clip_threshold to the
    loss's clip, kl_target to the reward's target), silently; one that neither reads, or that `reward` overrides and
    the loss does not read, warns once, naming it."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loss, reward = verl_kl.configs_from({"kl_adaptation_method": "clip", "kl_clip_threshold": 0.5, "kl_target": 0.2,
                                             "reward": {"kl_adaptation_method": "target"}})
    assert (loss.kl_clip_threshold, loss.kl_target) == (0.5, 0.1) and (reward.kl_clip_threshold, reward.kl_target) == (
        1.0, 0.2)
    for block in ({"kl_adaptation_method": "clip", "beta_max": 0.2},  # read by neither
                  {"kl_adaptation_method": "clip", "beta_max": 0.2,  # the reward's own value replaces it there
                   "reward": {"kl_adaptation_method": "target", "beta_max": 0.3}}):
        with pytest.warns(UserWarning) as caught:
            loss, reward = verl_kl.configs_from(block)
        assert [str(w.message) for w in caught] == [
            "adaptive_kl.beta_max=0.2 has no effect: only kl_adaptation_method target reads it, and "
            "kl_adaptation_method='clip' does not include it. Leave it at its default, or choose a setting that reads "
            "it."]
    assert (loss.beta_max, reward.beta_max) == (0.2, 0.3)


def test_a_field_only_an_estimator_of_ours_reads_names_verls_own_kl_type_where_kl_estimator_is_unset():
    """kl_percentile without kl_estimator: the warning said "the estimator in effect is 'k3'", the core's default,
    which verl never uses (its own kl_loss_type / kl_penalty is the KL then). It names verl's fields; with an
    estimator of ours set, that estimator, as before."""
    with pytest.warns(UserWarning) as caught:
        verl_kl.configs_from({"kl_percentile": 0.5})
    assert [str(w.message) for w in caught] == [
        "adaptive_kl.kl_percentile=0.5 has no effect: only kl_estimator 'k3_bottom_percentile' reads it, and "
        "adaptive_kl.kl_estimator is unset, so verl's own KL type is in effect (actor_rollout_ref.actor.kl_loss_type "
        "in the loss, algorithm.kl_penalty in the reward). Leave it at its default, or choose a setting that reads it."]
    with pytest.warns(UserWarning, match=r"and the estimator in effect is 'k2'\. Leave it"):
        verl_kl.configs_from({"kl_percentile": 0.5, "kl_estimator": "k2"})


def test_the_blocks_warnings_come_once_from_the_trainer_in_verls_terms():
    """A field that has no effect, and k1 in the actor loss, each warned twice when the trainer was built (the config,
    then the AdaptiveKL built from it; three times for the reward's: its placed copy too), without the block's name,
    and k1's advised kl_placement='reward', which verl refuses: now once each, named by block, with verl's fix."""
    def caught(config):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            _GuardedTrainer(config)
        return [str(w.message) for w in seen if "no effect" in str(w.message) or "k1" in str(w.message)]

    said = caught(trainer_config(use_kl_in_reward=False, kl_estimator="k1"))
    assert len(said) == 1 and said[0].startswith(
        "adaptive_kl.kl_estimator='k1' with actor_rollout_ref.actor.use_kl_loss=True: the expected gradient of k1 is "
        "zero on-policy")
    assert "algorithm.use_kl_in_reward=True with algorithm.kl_penalty=kl" in said[0] and "kl_placement" not in said[0]
    assert [message.split(" has")[0] for message in caught(trainer_config(kl_clip_threshold=0.5))] == [
        "adaptive_kl.kl_clip_threshold=0.5"]
    assert [message.split(" has")[0] for message in caught(trainer_config(reward={"kl_clip_threshold": 0.5}))] == [
        "adaptive_kl.reward.kl_clip_threshold=0.5"]


HELD = ("kl_adaptation_method dynamic cannot move beta: dynamic_beta_decay=1.0 multiplies it by 1 after a rewarded "
        "step, and beta_schedule_steps=None sets no cut-off. Set dynamic_beta_decay < 1 for beta to decay.")


def beta_held_said(build) -> list[str]:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        build()
    return [str(w.message) for w in seen if "cannot move beta" in str(w.message)]


@pytest.mark.parametrize(("switches", "coefficients"), [
    (dict(use_kl_in_reward=False), ["actor_rollout_ref.actor.kl_loss_coef"]),
    (dict(use_kl_loss=False), ["algorithm.kl_ctrl.kl_coef"]),
    ({}, ["actor_rollout_ref.actor.kl_loss_coef", "algorithm.kl_ctrl.kl_coef"]),
], ids=["loss", "reward", "both"])
def test_what_leaves_beta_where_it_is_is_said_once_for_each_kl_that_is_on_in_verls_terms(switches, coefficients):
    """dynamic with dynamic_beta_decay=1 and no cut-off cannot move beta: said once for each KL that is on, with its
    block and verl's name for its beta (it was said 3 to 5 times, in the core's terms: by the configs, built for both
    KLs whether on or off, and again by each controller); an actor worker's loss does not say it again."""
    config = trainer_config(kl_adaptation_method="dynamic", dynamic_beta_decay=1.0, beta_schedule_steps=None,
                            **switches)
    assert beta_held_said(lambda: _GuardedTrainer(config)) == [
        f"adaptive_kl: {HELD} Here beta is {coefficient}=0.1." for coefficient in coefficients]
    held = AdaptiveKLConfig(kl_adaptation_method="dynamic", dynamic_beta_decay=1.0, beta_schedule_steps=None)
    assert beta_held_said(lambda: verl_kl.AdaptivePPOLoss(actor_config(), held)) == []


def test_what_leaves_the_rewards_beta_where_it_is_names_the_reward_block_that_set_it():
    """beta_min under adaptive_kl.reward equal to verl's algorithm.kl_ctrl.kl_coef: dynamic can only lower beta, to
    beta_min, so the reward's beta cannot move; the loss's (beta_min 0) can, and nothing is said of it."""
    config = trainer_config(kl_adaptation_method="dynamic", reward={"beta_min": 0.1})
    assert beta_held_said(lambda: _GuardedTrainer(config)) == [
        "adaptive_kl.reward: kl_adaptation_method dynamic cannot move beta: it lowers beta, down to beta_min=0.1, "
        "which is beta=0.1. Set beta_min < beta for beta to decay. Here beta is algorithm.kl_ctrl.kl_coef=0.1."]


def test_the_loss_only_fields_are_not_inherited_by_the_reward():
    """kl_estimator and kl_reduction at the top of the block act on the KL in the loss; the reward's config keeps its
    defaults (verl's algorithm.kl_penalty, penalised per token), and reward.kl_reduction=sequence_sum is what verl
    does anyway."""
    loss, reward = verl_kl.configs_from({"kl_estimator": "k1_future", "kl_reduction": "sequence_mean",
                                         "kl_adaptation_method": "clip"})
    assert (loss.kl_estimator, loss.kl_reduction) == ("k1_future", "sequence_mean")
    assert (reward.kl_estimator, reward.kl_reduction, reward.kl_methods) == (None, "loss_type", ("clip",))
    _, reward = verl_kl.configs_from({"reward": {"kl_reduction": "sequence_sum"}})
    assert reward.kl_reduction == "sequence_sum"


@pytest.mark.parametrize("estimator", ["k2", "k1_future"])
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_verls_kl_loss_metric_keeps_its_stock_meaning_beside_an_estimator(estimator, mode):
    """verl's actor/kl_loss is the KL of kl_loss_type (low_var_kl here), as stock verl logs it, whatever estimator
    the loss trains on (it was the estimator's: k1_future logged -0.03 where stock logs 0.36); the estimator's own
    KL is adaptive_kl/raw_kl's (the core's sums)."""
    batch = make_batch(seed=4)
    config = actor_config(mode)
    _, _, stock = run_loss(lambda **kw: ppo_loss(copy.deepcopy(config), **kw), batch, 2)
    _, _, ours = run_loss(adaptive(copy.deepcopy(config), kl_estimator=estimator), batch, 2, beta=0.05)
    assert [m["kl_loss"].values for m in ours] == [m["kl_loss"].values for m in stock]
    lp, ref, mask = padded(batch)
    own = {"k2": 0.5 * (lp - ref) ** 2, "k1_future": lp - ref}[estimator]
    if mode == "token-mean":  # the estimator's KL, token mean over the mini-batch (two micro-batches, one entry each)
        assert sums_of(ours).raw == pytest.approx(float(own[mask].mean()), rel=1e-5)
    assert sums_of(ours).raw != pytest.approx(sum(m["kl_loss"].values[0] for m in stock), rel=1e-3)


def test_k1_future_in_the_actor_loss_has_the_kl_to_go_gradient():
    """+adaptive_kl.kl_estimator=k1_future replaces verl's kl_loss_type in the actor loss: with token-mean the KL part
    is sum m (logp - ref) / N (verl's own 'kl' aggregated), and the gradient of each response token's log-prob is
    beta * G_t / N, G_t = sum_{s >= t} (logp_s - ref_s) over the rest of its response, by hand."""
    loss_config, _ = verl_kl.configs_from({"kl_estimator": "k1_future"})
    batch = make_batch(seed=8)
    kl_value, grad, metrics = kl_part(verl_kl.AdaptivePPOLoss(actor_config(), loss_config), batch, beta=0.7)
    k1, mask = per_token(batch, "kl")
    n = mask.sum()
    torch.testing.assert_close(kl_value, 0.7 * k1[mask].sum() / n, rtol=1e-5, atol=1e-6)
    assert sums_of(metrics).adapted == pytest.approx(float(k1[mask].sum() / n), rel=1e-5)
    td, log_probs, prompts, responses = batch
    starts = torch.tensor([0, *torch.tensor([p + r for p, r in zip(prompts, responses)]).cumsum(0).tolist()])
    differs = False
    for i, (s, p, r) in enumerate(zip(starts.tolist(), prompts, responses)):
        to_go = torch.tensor([float(k1[i, t:r].sum()) for t in range(r)])
        torch.testing.assert_close(grad[s + p - 1: s + p - 1 + r], 0.7 * to_go / n, rtol=1e-5, atol=1e-7)
        differs |= not torch.allclose(to_go, k1[i, :r].detach())
    assert differs and max(responses) > 1  # the KL of the tokens that follow counts


class _StubTrainer:
    """Stands in for verl's trainer below the mixin: keeps the config (the mixin's own __init__ runs in full)."""

    def __init__(self, config):
        self.config = config


class _GuardedTrainer(verl_kl.AdaptiveKLTrainerMixin, _StubTrainer):
    pass


def trainer_config(kl_loss_type="low_var_kl", kl_penalty="kl", use_kl_loss=True, use_kl_in_reward=True, **block):
    from omegaconf import OmegaConf

    return OmegaConf.create({
        "adaptive_kl": block, "trainer": {"v1": {"trainer_mode": "adaptive_kl"}},
        "actor_rollout_ref": {"actor": {"use_kl_loss": use_kl_loss, "kl_loss_coef": 0.1, "kl_loss_type": kl_loss_type,
                                        "loss_agg_mode": "token-mean"}},
        "algorithm": {"use_kl_in_reward": use_kl_in_reward, "kl_penalty": kl_penalty, "kl_ctrl": {"kl_coef": 0.1}}})


def estimator_warnings(config) -> list[str]:
    import warnings

    from unsloth_adaptive_kl import KLEstimatorWarning

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _GuardedTrainer(config)
    return [str(w.message) for w in caught if issubclass(w.category, KLEstimatorWarning)]


@pytest.mark.parametrize(("field", "value"), [("kl_estimator", "k2"), ("kl_reduction", "sequence_mean")])
def test_a_loss_only_field_with_the_kl_in_the_loss_off_is_refused(field, value):
    with pytest.raises(ValueError, match=rf"adaptive_kl\.{field}='{value}' acts on the KL in the actor loss, which is "
                                         r"off \(actor_rollout_ref\.actor\.use_kl_loss=False\); in the reward "):
        _GuardedTrainer(trainer_config(use_kl_loss=False, **{field: value}))
    assert getattr(_GuardedTrainer(trainer_config(**{field: value})).loss_kl.config, field) == value


def test_kl_estimator_none_as_hydra_writes_it_is_the_default_with_the_kl_in_the_loss_off() -> None:
    """`+adaptive_kl.kl_estimator=None` reaches the block as the text "None", which AdaptiveKLConfig reads as None
    (the default): the block's rules read it so too. With the KL in the loss off it was refused as a loss-only field
    set; it is the default, so the trainer is built, at the top of the block and under `reward`."""
    for block in ({"kl_estimator": "None"}, {"reward": {"kl_estimator": "None"}}):
        trainer = _GuardedTrainer(trainer_config(use_kl_loss=False, **block))
        assert trainer.loss_kl is None and trainer.reward_kl.config.kl_estimator is None


def test_a_nullable_field_set_to_none_as_hydra_writes_it_is_none() -> None:
    """`+adaptive_kl.beta_schedule_steps=None` (Hydra: the text "None") was refused with "allowed is an integer >= 1,
    or None for no cut-off", where TRL's command line reads None: every field that takes None reads it so."""
    trainer = _GuardedTrainer(trainer_config(kl_adaptation_method="dynamic", beta_schedule_steps="None"))
    assert trainer.loss_kl.config.beta_schedule_steps is None
    trainer = _GuardedTrainer(trainer_config(kl_adaptation_method="target", kl_target=0.2, beta_max="None"))
    assert trainer.loss_kl.config.beta_max is None
    assert verl_kl.NULLABLE == ("beta_schedule_steps", "kl_estimator", "beta_max", "ref_model_sync_kl")


@pytest.mark.parametrize(("switches", "block", "message"), [
    # the reward block with the KL in the reward off: no reward controller was built, silently
    (dict(use_kl_in_reward=False), dict(reward={"kl_adaptation_method": "target", "kl_target": 0.2}),
     r"adaptive_kl\.reward\.kl_adaptation_method='target' acts on the KL in the reward, which is off "
     r"\(algorithm\.use_kl_in_reward=False\): set algorithm\.use_kl_in_reward=True, or leave the adaptive_kl\.reward "
     r"block out\."),
    # a top-level method that `reward` overrides went to the loss's config, which is off: a fixed beta, silently
    (dict(use_kl_loss=False), dict(kl_adaptation_method="dynamic", reward={"kl_adaptation_method": "clip"}),
     r"adaptive_kl\.kl_adaptation_method='dynamic' acts on the KL in the actor loss, which is off "
     r"\(actor_rollout_ref\.actor\.use_kl_loss=False\); the KL in the reward takes "
     r"adaptive_kl\.reward\.kl_adaptation_method='clip'\."),
    (dict(use_kl_loss=False, use_kl_in_reward=False), dict(kl_estimator="k2"),  # not "set kl_penalty instead"
     r"adaptive_kl\.kl_estimator='k2' acts on the KL in the actor loss, which is off .*; the KL in the reward is off "
     r"too \(algorithm\.use_kl_in_reward=False\)\."),
    (dict(use_kl_loss=False, use_kl_in_reward=False), dict(kl_adaptation_method="clip"),
     r"adaptive_kl\.kl_adaptation_method='clip' acts on the KL in the actor loss, which is off .*; the KL in the "
     r"reward is off too \(algorithm\.use_kl_in_reward=False\)\."),
    (dict(use_kl_loss=False), dict(kl_adaptation_method="clip", kl_target=0.3),  # clip in the reward reads no target
     r"adaptive_kl\.kl_target=0\.3 acts on the KL in the actor loss, which is off .*; the settings of the KL in the "
     r"reward do not read it\."),
])
def test_a_field_set_for_a_kl_that_is_off_is_refused(switches, block, message):
    with pytest.raises(ValueError, match=message):
        _GuardedTrainer(trainer_config(**switches, **block))


def test_a_shared_field_with_one_kl_off_goes_to_the_other():
    """A top-level field the reward's settings read is the reward's with the loss KL off (not refused), and a
    default-valued reward block with the reward off changes nothing (not refused)."""
    trainer = _GuardedTrainer(trainer_config(use_kl_loss=False, kl_adaptation_method="clip", kl_clip_threshold=0.5))
    assert (trainer.loss_kl, trainer.reward_kl.config.kl_adaptation_method,
            trainer.reward_kl.config.kl_clip_threshold) == (None, "clip", 0.5)
    assert _GuardedTrainer(trainer_config(use_kl_in_reward=False, reward={"kl_adaptation_method": "none"})).reward_kl \
        is None


@pytest.mark.parametrize(("switches", "block", "message"), [
    (dict(), "clip", r"^adaptive_kl='clip' is invalid: allowed is a block of AdaptiveKLConfig's fields, set one by one "
                     r"\(\+adaptive_kl\.kl_adaptation_method=clip\)\.$"),
    (dict(), {"reward": "target"}, r"^adaptive_kl\.reward='target' is invalid: allowed is a block of "),
    # a bad value is named with the block that set it (it said kl_target=-1.0, for either block)
    (dict(), {"reward": {"kl_adaptation_method": "target", "kl_target": -1.0}},
     r"^adaptive_kl\.reward\.kl_target=-1\.0 is invalid: allowed is a finite number >= 0"),
    (dict(), {"kl_clip_threshold": -1.0}, r"^adaptive_kl\.kl_clip_threshold=-1\.0 is invalid: allowed is a finite "),
    # and a method that cannot be parsed, in either block (the top level's was named without its block)
    (dict(), {"kl_adaptation_method": "clip+sigmoid"},
     r"^adaptive_kl\.kl_adaptation_method='clip\+sigmoid' is invalid: "),
    (dict(), {"reward": {"kl_adaptation_method": "clip+sigmoid"}},
     r"^adaptive_kl\.reward\.kl_adaptation_method='clip\+sigmoid' is invalid: "),
    # verl's fields by verl's names, before any rollout (it said num_iterations=0; a kl type failed at the first
    # update with a bare NotImplementedError)
    (dict(ppo_epochs=0), {}, r"^actor_rollout_ref\.actor\.ppo_epochs=0 is invalid: allowed is an integer >= 1\.$"),
    (dict(kl_loss_type="low_var"), {}, r"^actor_rollout_ref\.actor\.kl_loss_type='low_var' is invalid: allowed is "
                                       r"kl, k1, abs, mse, k2, low_var_kl or k3, each also with a trailing '\+'"),
    (dict(kl_penalty="full"), {}, r"^algorithm\.kl_penalty='full' is invalid: allowed is kl, k1, abs, "),
])
def test_verls_block_and_fields_are_refused_by_their_verl_names(switches, block, message):
    config = trainer_config(**{key: value for key, value in switches.items() if key != "ppo_epochs"})
    config.adaptive_kl = block
    if "ppo_epochs" in switches:
        config.actor_rollout_ref.actor.ppo_epochs = switches["ppo_epochs"]
    with pytest.raises(ValueError, match=message):
        _GuardedTrainer(config)


def test_a_target_horizon_that_would_end_beta_is_refused_before_the_first_rollout():
    """n = data.train_batch_size x rollout.n = 3 x 2 = 6 completions a step: kl_horizon 1.2 (= n / 5) lets beta reach
    0 for good. It was refused at the first controller step, after a rollout, without the block's name."""
    config = trainer_config(use_kl_loss=False, reward={"kl_adaptation_method": "target", "kl_horizon": 1.2})
    config.data = {"train_batch_size": 3}
    config.actor_rollout_ref.rollout = {"n": 2}
    with pytest.raises(ValueError, match=r"^adaptive_kl\.reward\.kl_horizon=1\.2 is invalid for steps of 6 completions "
                                         r"with beta_min=0: .* allowed is kl_horizon > 1\.2 \(n / 5\), or beta_min > "
                                         r"0; here n is data\.train_batch_size x actor_rollout_ref\.rollout\.n\.$"):
        _GuardedTrainer(config)
    config.adaptive_kl.reward.kl_horizon = 1.25
    assert _GuardedTrainer(config).reward_kl.config.kl_horizon == 1.25


@pytest.mark.parametrize("kl", ["loss", "reward"])
def test_at_a_coefficient_of_0_the_target_horizon_is_not_checked_as_at_every_door(kl):
    """A coefficient of 0 turns that KL off, so target's beta stays 0 whatever the horizon: TRL's and the own loop's
    doors build and train without checking it, and so does verl now (it refused kl_horizon=1.2 at n = 6, which the
    other doors accept at beta=0). The other KL, at 0.1, is still checked."""
    import warnings

    config = trainer_config(kl_adaptation_method="target", kl_horizon=1.2)
    config.data = {"train_batch_size": 3}
    config.actor_rollout_ref.rollout = {"n": 2}
    with pytest.raises(ValueError, match=r"kl_horizon=1\.2 is invalid for steps of 6 completions"):
        _GuardedTrainer(config)
    if kl == "loss":
        config.actor_rollout_ref.actor.kl_loss_coef = 0.0
    else:
        config.algorithm.kl_ctrl.kl_coef = 0.0
    with pytest.raises(ValueError, match=r"kl_horizon=1\.2 is invalid for steps of 6 completions"):
        _GuardedTrainer(config)  # the other KL
    config.adaptive_kl = {"kl_adaptation_method": "target", "kl_horizon": 1.2,
                          "reward": {"kl_horizon": 1.25}} if kl == "loss" else {
        "kl_adaptation_method": "target", "kl_horizon": 1.25, "reward": {"kl_horizon": 1.2}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the coefficient-0 warning, tested elsewhere
        trainer = _GuardedTrainer(config)
    off = trainer.loss_kl if kl == "loss" else trainer.reward_kl.akl
    assert (off.current_beta, off.config.kl_horizon) == (0.0, 1.2)


def test_a_coefficient_of_zero_warns_in_verls_terms_and_only_for_fields_that_were_set():
    """kl_loss_coef = 0 / kl_coef = 0 turn a KL off: a field of the block that would then do nothing is named with its
    block and the verl setting that turned it off. On ccb0d5c the warning named the core's `beta` and, for the reward,
    `kl_placement='reward'` (a field verl refuses), even with `none` set nowhere."""
    import warnings

    def caught(config):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            _GuardedTrainer(config)
        return [str(w.message) for w in seen if "no effect" in str(w.message)]

    config = trainer_config()
    config.actor_rollout_ref.actor.kl_loss_coef = 0.0
    config.algorithm.kl_ctrl.kl_coef = 0.0
    assert caught(config) == []  # nothing set: stock verl at 0, nothing to say
    config.adaptive_kl = {"kl_adaptation_method": "clip", "reward": {"kl_adaptation_method": "dynamic"}}
    assert caught(config) == [
        "adaptive_kl.kl_adaptation_method='clip' has no effect: actor_rollout_ref.actor.kl_loss_coef=0.0 turns the KL "
        "term off. Set actor_rollout_ref.actor.kl_loss_coef > 0 to regularise.",
        "adaptive_kl.reward.kl_adaptation_method='dynamic' has no effect: algorithm.kl_ctrl.kl_coef=0.0 turns the KL "
        "term off. Set algorithm.kl_ctrl.kl_coef > 0 to regularise."]


@pytest.mark.parametrize("value", [True, "abc", "0.1", -0.1, float("nan")])
@pytest.mark.parametrize("field", ["actor_rollout_ref.actor.kl_loss_coef", "algorithm.kl_ctrl.kl_coef"])
def test_a_bad_kl_coefficient_is_refused_by_its_verl_name(field, value):
    """As GRPOConfig(beta=...) and AdaptiveKL(beta=...) refuse it: float() took True to beta 1.0 and "0.1" to 0.1
    silently, and "abc" raised "could not convert string to float" naming no field."""
    from omegaconf import OmegaConf

    config = trainer_config()
    OmegaConf.update(config, field, value)
    with pytest.raises(ValueError, match=rf"^{re.escape(field)}={re.escape(repr(value))} is invalid: allowed is a "
                                         r"finite number >= 0\.$"):
        _GuardedTrainer(config)


def test_a_registered_kl_reduction_verl_cannot_aggregate_is_refused_when_the_trainer_is_built():
    """verl aggregates the KL by a loss_agg_mode name, which a registered reduction has not: on ccb0d5c the trainer
    was built and the actor workers' loss raised "the 'my_mean' reduction has no loss_agg_mode name" at _setup. Now
    the driver's __init__ refuses it, naming the field, the value and the settings allowed."""
    from unsloth_adaptive_kl import register_kl_reduction
    from unsloth_adaptive_kl.core import reductions

    try:
        register_kl_reduction("my_mean")(lambda sums, lengths, ctx: (sums / lengths.clamp(min=1)).mean())
        with pytest.raises(ValueError, match=r"^adaptive_kl\.kl_reduction='my_mean' is invalid where the KL is "
                                             r"aggregated by a loss_agg_mode name: .* Allowed is one of loss_type, "
                                             r"sequence_sum, sequence_mean, token_mean\.$"):
            _GuardedTrainer(trainer_config(use_kl_in_reward=False, kl_reduction="my_mean"))
    finally:
        reductions.REDUCTIONS.pop("my_mean", None)


class _SetUpStub(_StubTrainer):
    """verl's _setup, as far as the mixin reads it: the run's length, from the dataloader or the config."""

    def _setup(self):
        self.total_training_steps = 100


class _SetUpTrainer(verl_kl.AdaptiveKLTrainerMixin, _SetUpStub):
    pass


def test_a_schedule_cut_off_the_run_ends_before_is_said_as_trls_trainer_says_it():
    """dynamic's beta_schedule_steps=5000 in a run of 100 steps never acts; TRL's trainer said so at train(), verl's
    built silently. Now said once its length is known (_setup), with the block the field came from; a cut-off within
    the run, and the default (1000), are not."""
    import warnings

    def said(**block):
        use_kl_loss = "reward" not in block
        trainer = _SetUpTrainer(trainer_config(use_kl_loss=use_kl_loss, use_kl_in_reward=not use_kl_loss, **block))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if use_kl_loss:  # the workers' loss is set after this check (no workers here): the check alone
                trainer.total_training_steps = 100
                trainer._warn_if_schedule_after_run()
            else:
                trainer._setup()
        return [str(w.message) for w in caught]

    assert said(kl_adaptation_method="dynamic", beta_schedule_steps=5000) == [
        "adaptive_kl.beta_schedule_steps=5000 sets beta = beta_min=0 after 5000 steps, and this run has 100: no step "
        "trains at it. Set adaptive_kl.beta_schedule_steps below 100 for the cut-off to act, or None for none."]
    (reward,) = said(reward={"kl_adaptation_method": "dynamic", "beta_schedule_steps": 100})
    assert reward.startswith("adaptive_kl.reward.beta_schedule_steps=100 sets beta = beta_min=0 after 100 steps")
    assert said(kl_adaptation_method="dynamic", beta_schedule_steps=99) == []
    assert said(kl_adaptation_method="dynamic") == []


def test_verls_default_reward_estimator_is_the_log_ratio():
    """The KL in verl's reward is verl's own apply_kl_penalty with algorithm.kl_penalty, whose default is 'kl' (k1):
    the reward placement's default of SPEC 3.12 holds in verl as shipped, silently."""
    from verl.trainer.config import AlgoConfig

    assert AlgoConfig().kl_penalty == "kl"
    assert estimator_warnings(trainer_config()) == []


@pytest.mark.parametrize("kl_penalty", ["abs", "mse", "k2", "low_var_kl", "k3", "k3+"])  # "full": refused (verl has
# no such KL: test_verls_block_and_fields_are_refused_by_their_verl_names)
def test_a_reward_kl_penalty_other_than_the_log_ratio_warns_once_naming_verls_field(kl_penalty):
    (message,) = estimator_warnings(trainer_config(kl_penalty=kl_penalty))
    assert message.startswith(f"algorithm.kl_penalty={kl_penalty!r} with algorithm.use_kl_in_reward=True: a KL in the "
                              "reward must be the log-ratio k1 = logp - ref_logp")
    assert message.endswith("Use algorithm.kl_penalty=kl (k1, verl's default).")
    assert estimator_warnings(trainer_config(kl_penalty=kl_penalty, use_kl_in_reward=False)) == []  # not used


@pytest.mark.parametrize("kl_loss_type", ["kl", "k1"])
def test_k1_as_the_actor_loss_kl_warns_once_naming_verls_field(kl_loss_type):
    (message,) = estimator_warnings(trainer_config(kl_loss_type=kl_loss_type))
    assert message.startswith(f"actor_rollout_ref.actor.kl_loss_type={kl_loss_type!r} with "
                              "actor_rollout_ref.actor.use_kl_loss=True: the expected gradient of k1 is zero on-policy")
    assert ("Use +adaptive_kl.kl_estimator=k1_future (the whole completion's KL gradient), or "
            "actor_rollout_ref.actor.kl_loss_type=low_var_kl (k3, verl's default) or k2") in message
    assert "algorithm.use_kl_in_reward=True with algorithm.kl_penalty=kl, where k1 is exact" in message
    assert estimator_warnings(trainer_config(kl_loss_type=kl_loss_type, use_kl_loss=False)) == []
    # a configured estimator replaces kl_loss_type in the loss: k1_future is silent, the core's k1 guard names its field
    assert estimator_warnings(trainer_config(kl_loss_type=kl_loss_type, kl_estimator="k1_future")) == []


@pytest.mark.parametrize(("kl_loss_type", "kl_penalty"), [("low_var_kl", "kl"), ("k1+", "k1"), ("k2", "kl+"),
                                                          ("k3+", "k1+"), ("k3", "kl")])
def test_log_ratio_rewards_and_non_k1_losses_are_silent(kl_loss_type, kl_penalty):
    assert estimator_warnings(trainer_config(kl_loss_type=kl_loss_type, kl_penalty=kl_penalty)) == []


# ----- verl's apply_kl_penalty with our controller -------------------------------------------------------------------


def reward_batch(seed=0, batch_size=6, length=5, reward=1.0):
    g = torch.Generator().manual_seed(seed)
    mask = (torch.arange(length)[None] < torch.randint(1, length + 1, (batch_size,), generator=g)[:, None]).float()
    scores = torch.zeros(batch_size, length)
    scores[torch.arange(batch_size), mask.sum(-1).long() - 1] = reward
    return DataProto(batch=TensorDict({
        "response_mask": mask, "token_level_scores": scores,
        "old_log_probs": -torch.rand(batch_size, length, generator=g) * 2,
        "ref_log_prob": -torch.rand(batch_size, length, generator=g) * 2}, batch_size=[batch_size]))


class CountingController(verl_kl.RewardKLController):
    def update(self, current_kl, n_steps):
        self.calls = getattr(self, "calls", []) + [(current_kl, n_steps)]
        super().update(current_kl=current_kl, n_steps=n_steps)


@pytest.mark.parametrize("kl_type", ["kl", "low_var_kl", "k2"])
def test_apply_kl_penalty_with_our_controller(kl_type):
    ctrl = CountingController(AdaptiveKLConfig(kl_adaptation_method="dynamic", reward_threshold=0.5,
                                               dynamic_beta_decay=0.5, beta_min=0.03), beta=0.1)
    betas = []
    for step in range(4):
        data = reward_batch(seed=step)
        kld = core_algos.kl_penalty(data.batch["old_log_probs"], data.batch["ref_log_prob"], kl_type) \
            * data.batch["response_mask"]
        beta = ctrl.value
        betas.append(beta)
        ctrl.observe_rewards(1.0)
        out, metrics = ray_trainer.apply_kl_penalty(data, kl_ctrl=ctrl, kl_penalty=kl_type)
        assert torch.equal(out.batch["token_level_rewards"], data.batch["token_level_scores"] - beta * kld)
        assert metrics["actor/reward_kl_penalty_coeff"] == beta
        assert len(ctrl.calls) == step + 1  # one update per batch
    assert betas == [0.1, 0.05, 0.03, 0.03]  # decays while reward > threshold, never below beta_min


def test_reward_target_controller_follows_the_token_mean_kl_within_bounds():
    config = AdaptiveKLConfig(kl_adaptation_method="target", kl_target=1e-4, kl_horizon=10, beta_min=0.01,
                              beta_max=0.2)
    ctrl = verl_kl.RewardKLController(config, beta=0.1)
    values = []
    for step in range(8):
        data = reward_batch(seed=step)
        _, metrics = verl_kl.apply_adaptive_kl_penalty(data, ctrl, kl_penalty="low_var_kl")
        values.append(ctrl.value)
    # KL far above target: e = +0.2 each batch, beta *= 1 + 0.2 * 6 / 10, capped at beta_max
    assert values[0] == pytest.approx(0.1 * 1.12)
    assert values[-1] == 0.2 and all(v <= 0.2 for v in values)
    low = verl_kl.RewardKLController(AdaptiveKLConfig(kl_adaptation_method="target", kl_target=100.0, kl_horizon=1,
                                                      beta_min=0.05, beta_max=0.2), beta=0.1)
    for step in range(5):
        verl_kl.apply_adaptive_kl_penalty(reward_batch(seed=step), low, kl_penalty="low_var_kl")
    assert low.value == 0.05
    # Inside the clamp: beta moves by the token mean of k (sum over valid tokens / their count), not by verl's own
    # measure, the mean of each sequence's token mean, which differs on this batch (a mutant reading either 10x off, or
    # the sequence measure, passed the clamped cases above).
    data = reward_batch(seed=3)
    mask = data.batch["response_mask"]
    kld = core_algos.kl_penalty(data.batch["old_log_probs"], data.batch["ref_log_prob"], "low_var_kl") * mask
    token_mean, sequence_mean = float(kld.sum() / mask.sum()), float((kld.sum(-1) / mask.sum(-1)).mean())
    assert abs(sequence_mean / token_mean - 1) > 0.01
    inside = verl_kl.RewardKLController(AdaptiveKLConfig(kl_adaptation_method="target", kl_target=token_mean * 1.1,
                                                         kl_horizon=10), beta=0.1)
    verl_kl.apply_adaptive_kl_penalty(data, inside, kl_penalty="low_var_kl")
    assert inside.value == pytest.approx(0.1 * (1 + (1 / 1.1 - 1) * mask.shape[0] / 10), rel=1e-5)


def test_reward_clip_shapes_the_per_token_kl():
    """clip in the reward: verl's own apply_kl_penalty subtracts beta * min(k, 0.1) (its kl_penalty replaced by the
    shaped KL for the call, and restored: on ccb0d5c the integration restated verl's formula and metrics) and logs
    its metric of the KL it subtracted; the core's raw and adapted KL under adaptive_kl/reward/."""
    stock_kl_penalty = core_algos.kl_penalty
    ctrl = verl_kl.RewardKLController(AdaptiveKLConfig(kl_adaptation_method="clip", kl_clip_threshold=0.1), beta=0.5)
    data = reward_batch(seed=7)
    mask = data.batch["response_mask"]
    kld = core_algos.kl_penalty(data.batch["old_log_probs"], data.batch["ref_log_prob"], "low_var_kl") * mask
    scores = data.batch["token_level_scores"].clone()
    out, metrics = verl_kl.apply_adaptive_kl_penalty(data, ctrl, kl_penalty="low_var_kl")
    shaped = torch.clamp(kld, max=0.1) * mask
    torch.testing.assert_close(out.batch["token_level_rewards"], scores - 0.5 * shaped)
    # verl's own apply_kl_penalty ran, on the shaped KL: its metric is the mean of each sequence's token mean of it
    assert metrics["actor/reward_kl_penalty"] == pytest.approx(float((shaped.sum(-1) / mask.sum(-1)).mean()))
    assert metrics["actor/reward_kl_penalty"] < float((kld.sum(-1) / mask.sum(-1)).mean())
    assert core_algos.kl_penalty is stock_kl_penalty
    assert metrics[verl_kl.REWARD_METRIC + "adapted_kl"] < metrics[verl_kl.REWARD_METRIC + "raw_kl"]
    assert ctrl.akl.completed_steps == 1  # apply_kl_penalty ended with the controller's update: one step


@pytest.mark.parametrize(("block", "where", "advice"), [
    ({"kl_adaptation_method": "length_normalized"}, "adaptive_kl",
     "; set +adaptive_kl.reward.kl_adaptation_method=none to keep length_normalized for the KL in the actor loss alone."),
    ({"reward": {"kl_adaptation_method": "dynamic+length_normalized"}}, "adaptive_kl.reward", ".")])
def test_length_normalized_in_the_reward_is_refused_naming_the_field_that_set_it(block, where, advice):
    """length_normalized reaching the KL in the reward, inherited from the block or set under reward: refused when the
    trainer is built, naming the field the user set and, where it was inherited, how to keep it for the loss (not the
    core's advice, kl_reduction='sequence_mean', which verl refuses under reward)."""
    with pytest.raises(ValueError) as raised:
        _GuardedTrainer(trainer_config(**block))
    method = canonical_methods((block.get("reward") or block)["kl_adaptation_method"])  # as the config stores it
    assert str(raised.value) == (
        f"{where}.kl_adaptation_method={method!r} is invalid with algorithm.use_kl_in_reward=True: allowed is methods "
        "without length_normalized there (verl's reward KL is the sum over each completion's tokens)" + advice)
    if where == "adaptive_kl":  # inherited by the reward alone: with the reward KL off the loss's is fine
        assert _GuardedTrainer(trainer_config(use_kl_in_reward=False, **block)).reward_kl is None
    else:  # set under reward, for a reward KL that is off: refused as doing nothing
        with pytest.raises(ValueError, match=r"acts on the KL in the reward, which is off"):
            _GuardedTrainer(trainer_config(use_kl_in_reward=False, **block))


def test_length_normalized_inherited_by_the_reward_with_the_loss_kl_off_is_told_to_go():
    """With the actor loss's KL off, the advice to keep length_normalized for the loss alone (under
    adaptive_kl.reward) led to a second refusal: length_normalized acts on that loss alone, so the advice is to drop it."""
    with pytest.raises(ValueError) as raised:
        _GuardedTrainer(trainer_config(use_kl_loss=False, kl_adaptation_method="dynamic+length_normalized"))
    method = canonical_methods("dynamic+length_normalized")
    assert str(raised.value) == (
        f"adaptive_kl.kl_adaptation_method={method!r} is invalid with algorithm.use_kl_in_reward=True: allowed is "
        "methods without length_normalized there (verl's reward KL is the sum over each completion's tokens); set "
        "adaptive_kl.kl_adaptation_method=dynamic: length_normalized acts on the KL in the actor loss alone, which is "
        "off (actor_rollout_ref.actor.use_kl_loss=False).")
    assert _GuardedTrainer(trainer_config(use_kl_loss=False, kl_adaptation_method="dynamic")).reward_kl is not None


@pytest.mark.parametrize("kl_loss_type", ["k2", "low_var_kl+", "kl"])
def test_an_explicit_k3_estimator_beside_another_kl_loss_type_is_refused(kl_loss_type):
    """kl_estimator='k3' means the trainer's own KL, as unset does: with kl_loss_type=k2 the loss trained on k2 (a
    clipped term of 0.767 where k3 was 1.150), the explicit k3 unread, silently. verl's k3 (low_var_kl, k3) passes,
    and unset adapts any kl_loss_type."""
    with pytest.raises(ValueError) as raised:
        _GuardedTrainer(trainer_config(kl_loss_type=kl_loss_type, kl_estimator="k3"))
    assert str(raised.value) == (
        f"adaptive_kl.kl_estimator='k3' is invalid with actor_rollout_ref.actor.kl_loss_type={kl_loss_type!r}: k3 "
        "means the trainer's own KL, which verl computes as kl_loss_type, so it would train on "
        f"{kl_loss_type!r}. Allowed: kl_loss_type one of low_var_kl, k3 (verl's k3), or adaptive_kl.kl_estimator "
        "unset to adapt verl's kl_loss_type as it is.")
    for allowed in ("low_var_kl", "k3"):
        assert _GuardedTrainer(trainer_config(kl_loss_type=allowed, kl_estimator="k3")).loss_kl is not None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # kl warns as the loss's KL (KLEstimatorWarning)
        assert _GuardedTrainer(trainer_config(kl_loss_type=kl_loss_type)).loss_kl is not None


@pytest.mark.parametrize("steps", [2, 4])
def test_more_than_one_actor_update_per_global_step_is_refused(steps):
    """verl's sync mode runs trainer.v1.sync.parameter_sync_step actor updates per global step: each controller moved
    that many times a global step (beta_schedule_steps counted them), against the page's once per verl step."""
    config = trainer_config()
    config.trainer.v1.sync = {"parameter_sync_step": steps}
    with pytest.raises(ValueError) as raised:
        _GuardedTrainer(config)
    assert str(raised.value) == (
        f"trainer.v1.sync.parameter_sync_step={steps!r} is invalid: allowed is 1 under trainer.v1.trainer_mode="
        "adaptive_kl (one actor update per global step, which the controllers move once per).")
    config.trainer.v1.sync = {"parameter_sync_step": 1}
    assert _GuardedTrainer(config).loss_kl is not None


def test_a_kl_reduction_verls_aggregation_applies_already_is_said_in_verls_terms():
    """loss_agg_mode token-mean reduces the KL loss by the token mean already: kl_reduction='token_mean' changes
    nothing, said with verl's field (the core would name loss_type='bnpo', which verl has not); another reduction
    acts, and is not said."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _GuardedTrainer(trainer_config(use_kl_in_reward=False, kl_reduction="token_mean"))
    said = [str(w.message) for w in caught if "no effect" in str(w.message)]
    assert said == ["adaptive_kl.kl_reduction='token_mean' has no effect: actor_rollout_ref.actor.loss_agg_mode="
                    "'token-mean' already reduces the KL term that way. Leave it out, or choose a reduction the loss "
                    "does not apply."]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _GuardedTrainer(trainer_config(use_kl_in_reward=False, kl_reduction="sequence_mean"))
    assert not [w for w in caught if "no effect" in str(w.message)]


def test_verls_own_adaptive_reward_controller_is_refused_naming_its_field():
    """algorithm.kl_ctrl.type=adaptive with the KL in the reward: this package's controller would replace verl's and
    leave its target_kl and horizon unread (with `none` too), so it is refused before training; with the KL in the
    reward off verl never builds that controller, and the setting passes."""
    config = trainer_config()
    config.algorithm.kl_ctrl.type = "adaptive"
    with pytest.raises(ValueError, match=r"^algorithm\.kl_ctrl\.type='adaptive' is invalid with "
                                         r"trainer\.v1\.trainer_mode=adaptive_kl and algorithm\.use_kl_in_reward=True: "
                                         r"allowed is 'fixed'\..*\+adaptive_kl\.reward\.kl_adaptation_method=target"):
        _GuardedTrainer(config)
    config.algorithm.use_kl_in_reward = False
    assert _GuardedTrainer(config).reward_kl is None


def test_reward_controller_state_dict_round_trips():
    config = AdaptiveKLConfig(kl_adaptation_method="dynamic", reward_threshold=0.5)
    ctrl = verl_kl.RewardKLController(config, beta=0.1)
    for step in range(3):
        ctrl.observe_rewards(1.0)
        ray_trainer.apply_kl_penalty(reward_batch(seed=step), kl_ctrl=ctrl, kl_penalty="kl")
    state = json.loads(json.dumps(ctrl.state_dict()))
    resumed = verl_kl.RewardKLController(config, beta=0.1)
    resumed.load_state_dict(state)
    assert resumed.value == ctrl.value == pytest.approx(0.1 * 0.9 ** 3)
    for c in (ctrl, resumed):
        c.observe_rewards(1.0)
        ray_trainer.apply_kl_penalty(reward_batch(seed=9), kl_ctrl=c, kl_penalty="kl")
    assert resumed.value == ctrl.value and resumed.state_dict() == ctrl.state_dict()
    with pytest.raises(ValueError, match="length_normalized"):
        verl_kl.RewardKLController(AdaptiveKLConfig(kl_adaptation_method="length_normalized"), beta=0.1)


@pytest.mark.parametrize("loss_method", ["dynamic", "clip"])
def test_a_checkpoint_without_a_kls_controller_state_warns_naming_it_where_its_beta_moves(loss_method: str):
    """A KL this run adapts whose state the checkpoint lacks (saved with that KL off: use_kl_loss switched on between
    runs) warns, naming it, where its beta moves (`dynamic`), and its controller keeps its initial beta; a constant
    beta (`clip`) has nothing to lose and nothing is said. The other KL's state is restored."""
    moving = AdaptiveKLConfig(kl_adaptation_method="dynamic", reward_threshold=0.5)
    saved = verl_kl.RewardKLController(moving, beta=0.1)
    saved.observe_rewards(1.0)
    ray_trainer.apply_kl_penalty(reward_batch(seed=0), kl_ctrl=saved, kl_penalty="kl")
    loss = AdaptiveKLConfig(kl_adaptation_method=loss_method, reward_threshold=0.5)
    run = types.SimpleNamespace(loss_kl=AdaptiveKL(loss, beta=0.2),
                                reward_kl=verl_kl.RewardKLController(moving, beta=0.1))
    state = json.loads(json.dumps({"global_steps": 1, "loss": None, "reward": saved.state_dict()}))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        verl_kl.AdaptiveKLTrainerMixin.load_adaptive_kl_state(run, state)
    said = [str(w.message) for w in caught]
    assert said == (["adaptive_kl: the checkpoint holds no controller state for the KL in the loss (saved with it "
                     "off, or set to null): its controller restarts from its initial beta."]
                    if loss_method == "dynamic" else [])
    assert run.reward_kl.value == saved.value == pytest.approx(0.1 * 0.9) and run.loss_kl.current_beta == 0.2
    assert (run.loss_kl.moves_beta, run.reward_kl.moves_beta) == (loss_method == "dynamic", True)


def test_a_resume_with_a_new_coefficient_says_which_kl_and_verls_name_for_its_beta():
    """A run resumed with other betas than its checkpoint's (kl_loss_coef 0.2 -> 0.3, kl_coef 0.1 -> 0.05) continues
    each KL from the checkpoint's beta, saying so once per KL in verl's terms: which KL, beta's verl name and value,
    and how to restart that controller alone (its entry set to null, which then restarts it and keeps the other). By
    hand: dynamic decays 0.2 once to 0.2 * 0.9 = 0.18; the reward's 0.1 * 0.9 = 0.09 is above the new run's
    kl_coef=0.05, which dynamic only lowers, so it is clamped to 0.05."""
    moving = AdaptiveKLConfig(kl_adaptation_method="dynamic", reward_threshold=0.5)
    saved = types.SimpleNamespace(loss_kl=AdaptiveKL(moving, beta=0.2),
                                  reward_kl=verl_kl.RewardKLController(moving, beta=0.1))
    saved.loss_kl.step(1.0)
    saved.reward_kl.observe_rewards(1.0)
    ray_trainer.apply_kl_penalty(reward_batch(seed=0), kl_ctrl=saved.reward_kl, kl_penalty="kl")
    saved.reward_kl.update(0.0, 1)
    state = json.loads(json.dumps(verl_kl.AdaptiveKLTrainerMixin.adaptive_kl_state(
        types.SimpleNamespace(global_steps=1, **vars(saved)))))

    def resume(state):
        run = types.SimpleNamespace(loss_kl=AdaptiveKL(moving, beta=0.3),
                                    reward_kl=verl_kl.RewardKLController(moving, beta=0.05))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            verl_kl.AdaptiveKLTrainerMixin.load_adaptive_kl_state(run, state)
        return run, [str(w.message) for w in caught]

    run, said = resume(state)
    assert (run.loss_kl.current_beta, run.reward_kl.value) == (pytest.approx(0.18), 0.05)
    assert said == [
        "adaptive_kl: the KL in the loss: this run's beta=0.3 is not the beta=0.2 the checkpoint's run was built with: "
        "dynamic moves beta, so the run continues from the checkpoint's beta 0.18. To start from 0.3 instead, set "
        "\"loss\": null in the checkpoint's adaptive_kl.json. Here beta is actor_rollout_ref.actor.kl_loss_coef=0.3.",
        "adaptive_kl: the KL in the reward: this run's beta=0.05 is not the beta=0.1 the checkpoint's run was built "
        "with: dynamic moves beta, so the run continues from the checkpoint's beta 0.09, outside this run's "
        "beta_min=0, beta=0.05: clamped to 0.05, as dynamic keeps beta within them. To start from 0.05 instead, set "
        "\"reward\": null in the checkpoint's adaptive_kl.json. Here beta is algorithm.kl_ctrl.kl_coef=0.05."]
    run, said = resume({**state, "loss": None})  # the advice taken: the loss's controller restarts at 0.3
    assert (run.loss_kl.current_beta, run.reward_kl.value) == (0.3, 0.05)
    assert said[0] == ("adaptive_kl: the checkpoint holds no controller state for the KL in the loss (saved with it "
                       "off, or set to null): its controller restarts from its initial beta.")
    assert len(said) == 2 and said[1].startswith("adaptive_kl: the KL in the reward: ")


# ----- the logged adaptive_kl/* metrics, against their definitions (docs/metrics.md) --------------------------------


class _ActorGroup:
    """verl's actor worker group, in this process: `update_actor` runs the installed loss through verl's real
    ppo_loss on each data-parallel worker's micro-batches (`shards`: one batch per worker, each worker's process
    number its index; the global batch info of all of them) and returns the metrics as verl's workers return them for
    one mini-batch (each worker's micro-batches appended by verl's append_to_dict, each Metric over the ranks by
    Metric.aggregate_dp, lists concatenated in rank order; `TrainingWorker.train_mini_batch`)."""

    def __init__(self, shards, micro_batches, epochs=1):
        self.shards, self.micro_batches, self.epochs, self.loss_fn = shards, micro_batches, epochs, None

    def set_loss_fn(self, loss_fn):
        self.loss_fn = loss_fn

    def update_actor(self, meta):
        from verl.utils.metric import Metric
        from verl.utils.py_functional import append_to_dict

        tokens = sum(sum(responses) for _, _, _, responses in self.shards)
        sequences = sum(len(prompts) for _, _, prompts, _ in self.shards)
        output = {}
        for _ in range(self.epochs):  # ppo_epochs: the workers train on the same mini-batch again
            per_rank = []
            for rank, shard in enumerate(self.shards):
                with mock.patch.object(verl_kl, "this_process", lambda rank=rank: rank):
                    _, _, per_micro_batch = run_loss(self.loss_fn, shard, self.micro_batches,
                                                     beta=meta.extra_info[verl_kl.BETA_KEY], dp_size=len(self.shards),
                                                     batch_num_tokens=tokens, global_batch_size=sequences)
                appended = {}
                for metrics in per_micro_batch:
                    append_to_dict(appended, metrics)
                per_rank.append(appended)
            mini_batch = {key: Metric.aggregate_dp([ranked[key] for ranked in per_rank])
                          if isinstance(value, Metric) else list(itertools.chain(*(ranked[key] for ranked in per_rank)))
                          for key, value in per_rank[0].items()}
            append_to_dict(output, mini_batch)
        return {"metrics": {**output, "mfu": [0.0]}}


class _VerlActorUpdate(_StubTrainer):
    _update_actor = trainer_base.PPOTrainer._update_actor  # verl's own, which the mixin's wraps


class _ActorTrainer(verl_kl.AdaptiveKLTrainerMixin, _VerlActorUpdate):
    pass


def logged_actor_metrics(batch, mode, micro_batches=2, beta=0.37, **fields):
    """The metrics one actor update logs: the mixin's `_update_actor` over verl's, with the loss on the workers."""
    return actor_update(batch, mode, micro_batches, beta, **fields)[1]


def actor_update(batch, mode, micro_batches=2, beta=0.37, ppo_epochs=1, **fields):
    """(the trainer, the metrics) of one actor update: the mixin's `_update_actor` over verl's."""
    trainer = actor_trainer(batch, mode, micro_batches, beta, ppo_epochs, **fields)
    metrics = {}
    trainer._update_actor(types.SimpleNamespace(extra_info={}), metrics)
    return trainer, metrics


def actor_trainer(batch, mode, micro_batches=2, beta=0.37, ppo_epochs=1, **fields):
    """The trainer of `actor_update`, before its update: the loss on the workers, a batch mean reward of 0.5."""
    from omegaconf import OmegaConf

    config = OmegaConf.create({
        "adaptive_kl": fields, "trainer": {"v1": {"trainer_mode": "adaptive_kl"}},
        "actor_rollout_ref": {
            "actor": {"use_kl_loss": True, "kl_loss_coef": beta, "kl_loss_type": "low_var_kl", "loss_agg_mode": mode,
                      "ppo_mini_batch_size": 8, "calculate_entropy": False, "entropy_coeff": 0.0, "ppo_epochs": ppo_epochs,
                      "data_loader_seed": 0, "shuffle": False},
            "rollout": {"n": 1, "temperature": 1.0}},
        "algorithm": {"use_kl_in_reward": False, "kl_penalty": "kl", "kl_ctrl": {"kl_coef": 0.1}}})
    trainer = _ActorTrainer(config)
    shards = batch if isinstance(batch, list) else [batch]  # a list: one batch per data-parallel worker
    trainer.actor_rollout_wg = _ActorGroup(shards, micro_batches, ppo_epochs)
    loss = verl_kl.AdaptivePPOLoss(actor_config(mode, coef=beta), AdaptiveKLConfig(**fields))
    trainer.actor_rollout_wg.set_loss_fn(loss)
    trainer._mean_reward = 0.5
    return trainer


@pytest.mark.parametrize(("tensor", "key"), [("log_prob (the actor's forward)", None), ("ref_log_prob", "ref_log_prob"),
                                             ("old_log_probs", "old_log_probs")])
def test_negative_log_likelihoods_stop_the_actor_update_naming_verls_tensor_before_anything_is_kept(tensor, key):
    """One of verl's three log-prob tensors negated (-log p, as a loss of one's own might hand it over): the driver
    raises ValueError naming verl's tensor and its mean over the valid response tokens (computed here from the batch),
    before the batch's mean reward is observed: the run's state is as it was (record_sums alone raised after it)."""
    td, log_probs, prompts, responses = make_batch(seed=13)
    mask = torch.cat([torch.ones(r) for r in responses]).bool()
    if key is None:
        log_probs = -log_probs
        starts = [sum(p + r for p, r in zip(prompts[:i], responses[:i])) + prompts[i] - 1 for i in range(len(prompts))]
        values = torch.cat([log_probs[s:s + r] for s, r in zip(starts, responses)])
    else:
        td = td.clone()
        td[key] = _nested([-row for row in td[key].unbind()])
        values = torch.cat(list(td[key].unbind()))
    mean = float(values.double()[mask].mean())
    trainer = actor_trainer((td, log_probs, prompts, responses), "token-mean", kl_adaptation_method="dynamic",
                            reward_threshold=0.1)
    before = trainer.loss_kl.state_dict()
    with pytest.raises(ValueError, match=rf"^adaptive KL: log-probs above 0 at step 1: over its {int(mask.sum())} "
                                         rf"valid \(mask=1\) tokens: verl's {re.escape(tensor)} average "
                                         rf"\+{mean:.4g} a token\. "):
        trainer._update_actor(types.SimpleNamespace(extra_info={}), {})
    assert trainer.loss_kl.state_dict() == before


@pytest.mark.parametrize("ppo_epochs", [1, 2])
def test_target_counts_each_completion_once_whatever_verls_ppo_epochs(ppo_epochs):
    """With ppo_epochs=2 the update's statistics hold each completion twice; target's n stays the batch's B
    completions (Ziegler et al., verl's own controller: one update of n = the batch per batch), so beta moves by
    1 + e B / kl_horizon, by hand, whatever the epochs."""
    batch = make_batch(seed=11, kl_scale=3.0)
    k, mask = per_token(batch)
    trainer, _ = actor_update(batch, "token-mean", ppo_epochs=ppo_epochs, kl_adaptation_method="target",
                              kl_target=0.1, kl_horizon=100.0)
    assert trainer.loss_kl.num_iterations == ppo_epochs
    error = min(max(float(k[mask].mean()) / 0.1 - 1, -0.2), 0.2)
    assert error != 0
    assert trainer.loss_kl.current_beta == pytest.approx(0.37 * (1 + error * mask.size(0) / 100.0), rel=1e-6)


def by_hand(k, mask, shaped, mode):
    """L_i, S_i and verl's reduction (`mode`) of the raw and the shaped per-token KL, from the definitions."""
    lengths, sums = mask.sum(-1).double(), (k * mask).sum(-1).double()
    shaped_sums = (shaped * mask).sum(-1).double()
    if mode == "token-mean":
        reduce = lambda s: float(s.sum() / lengths.sum())  # noqa: E731
    else:  # seq-mean-token-mean
        reduce = lambda s: float((s / lengths).mean())  # noqa: E731
    return lengths, sums, reduce(sums), reduce(shaped_sums)


def test_verls_padding_samples_are_not_completions_of_the_metrics():
    """verl pads a batch to a divisible size with samples whose response_mask is all 0 (padding_utils, tag
    is_padding): sequence_kl and length_kl_corr are those of the real completions alone, by hand."""
    lengths = [5, 3, 8, 2, 6, 4, 7, 1]
    td, log_probs, prompts, responses = make_batch(seed=12, response_lengths=lengths, kl_scale=3.0)
    td["response_mask"] = _nested([torch.ones(n, dtype=torch.int64) for n in lengths[:-1]]
                                  + [torch.zeros(1, dtype=torch.int64)])  # the last sample: verl's padding
    batch = (td, log_probs, prompts, responses)
    logged = logged_actor_metrics(batch, "token-mean", kl_adaptation_method="clip", kl_clip_threshold=0.3)
    k, mask = per_token(batch)
    real_lengths, real_sums = mask.sum(-1)[:-1].double(), (k * mask).sum(-1)[:-1].double()
    assert logged[METRIC + "sequence_kl"] == pytest.approx(float(real_sums.mean()), rel=1e-6)
    assert logged[METRIC + "length_kl_corr"] == pytest.approx(
        statistics.correlation(real_lengths.tolist(), real_sums.tolist()), rel=1e-5)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_logged_loss_metrics_follow_their_definitions(mode):
    """Every adaptive_kl/* value an actor update logs (clip, 2 micro-batches), against docs/metrics.md by hand:
    raw_kl / adapted_kl verl's k reduced as loss_agg_mode reduces the loss (un-shaped / min(k, c)), sequence_kl the
    mean of S_i = sum_t m k, length_kl_corr Pearson(L_i, S_i), clip_fraction the valid tokens with k >= c over
    sum L_i."""
    batch, threshold = make_batch(seed=11, kl_scale=3.0), 0.3
    logged = logged_actor_metrics(batch, mode, kl_adaptation_method="clip", kl_clip_threshold=threshold)
    k, mask = per_token(batch)
    lengths, sums, raw, adapted = by_hand(k, mask, torch.clamp(k, max=threshold), mode)
    assert sorted(key for key in logged if "adaptive_kl" in key) == [
        METRIC + name for name in ("adapted_kl", "clip_fraction", "current_beta", "length_kl_corr", "raw_kl",
                                           "sequence_kl")]
    assert logged[METRIC + "raw_kl"] == pytest.approx(raw, rel=1e-6)
    assert logged[METRIC + "adapted_kl"] == pytest.approx(adapted, rel=1e-6)
    assert adapted < raw
    assert logged[METRIC + "current_beta"] == 0.37 == logged["actor/kl_coef"]
    assert logged[METRIC + "sequence_kl"] == pytest.approx(float(sums.mean()), rel=1e-6)
    assert logged[METRIC + "length_kl_corr"] == pytest.approx(
        statistics.correlation(lengths.tolist(), sums.tolist()), rel=1e-5)
    clipped = int(((k >= threshold) & mask).sum())
    assert 0 < clipped < int(mask.sum())
    assert logged[METRIC + "clip_fraction"] == pytest.approx(clipped / float(lengths.sum()), rel=1e-6)
    assert logged["actor/kl_loss"] == pytest.approx(raw, rel=1e-6)  # verl's own metric keeps its stock meaning


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_two_data_parallel_workers_are_summed_whole(mode):
    """Two data-parallel workers with different batch sizes (6 and 2 completions, 2 micro-batches each), whose rows
    verl gathers (its Metrics by Metric.aggregate_dp, lists concatenated): every logged metric and target's beta are
    those of all 8 completions together, by hand; raw_kl is verl's own kl_loss as verl aggregates it (the micro-
    batches' shares of the mini-batch's tokens add up to one entry). Worker 0's rows alone would give other values."""
    shards = [make_batch(batch_size=6, seed=21, kl_scale=3.0), make_batch(batch_size=2, seed=22, kl_scale=3.0)]
    threshold, target, horizon = 0.3, 0.1, 100.0
    fields = dict(kl_adaptation_method="clip+target", kl_clip_threshold=threshold, kl_target=target,
                  kl_horizon=horizon)
    trainer, logged = actor_update(shards, mode, **fields)
    per_shard = [per_token(shard) for shard in shards]
    lengths = torch.cat([mask.sum(-1) for _, mask in per_shard]).double()
    sums = torch.cat([(k * mask).sum(-1) for k, mask in per_shard]).double()
    shaped = torch.cat([(torch.clamp(k, max=threshold) * mask).sum(-1) for k, mask in per_shard]).double()
    reduce = ((lambda s: float(s.sum() / lengths.sum())) if mode == "token-mean"  # noqa: E731
              else (lambda s: float((s / lengths).mean())))
    metric = {key[len(METRIC):]: value for key, value in logged.items() if key.startswith(METRIC)}
    assert metric["raw_kl"] == pytest.approx(reduce(sums), rel=1e-6) == pytest.approx(logged["actor/kl_loss"])
    assert metric["adapted_kl"] == pytest.approx(reduce(shaped), rel=1e-6)
    assert metric["sequence_kl"] == pytest.approx(float(sums.mean()), rel=1e-6)
    assert metric["length_kl_corr"] == pytest.approx(statistics.correlation(lengths.tolist(), sums.tolist()),
                                                     rel=1e-5)
    clipped = sum(int(((k >= threshold) & mask).sum()) for k, mask in per_shard)
    assert metric["clip_fraction"] == pytest.approx(clipped / float(lengths.sum()), rel=1e-6)
    error = min(max(float(sums.sum() / lengths.sum()) / target - 1, -0.2), 0.2)
    assert error != 0
    assert trainer.loss_kl.current_beta == pytest.approx(0.37 * (1 + error * 8 / horizon), rel=1e-9)
    _, alone = actor_update(shards[:1], mode, **fields)  # worker 0's completions alone: another batch's values
    assert alone[METRIC + "sequence_kl"] != pytest.approx(metric["sequence_kl"], rel=1e-3)


def test_a_nonfinite_log_prob_on_the_second_worker_is_named_with_its_process():
    """A NaN in worker 1's forward (of two data-parallel workers): the driver's error names verl's tensor, the one
    token and process 1, the worker that saw it."""
    shards = [make_batch(batch_size=4, seed=23), with_policy_value(make_batch(batch_size=4, seed=24), 1, 0, math.nan)]
    with pytest.raises(NonFiniteLogProbError,
                       match=r"at step 1: .*verl's log_prob \(the actor's forward; the policy tensor\): 1 valid "
                             r"token\(s\) on process 1\."):
        actor_update(shards, "token-mean", kl_adaptation_method="clip", kl_clip_threshold=0.3)


@pytest.mark.parametrize("method", ["dynamic", "clip"])
def test_logged_reward_metrics_follow_their_definitions(method):
    """Every adaptive_kl/reward/* value of the KL in the reward (verl's own apply_kl_penalty for dynamic; shaped for
    clip), by hand: KL_i = sum_t m k' (verl penalises every token), raw_kl / adapted_kl the mean KL_i un-shaped /
    shaped, reward_penalty what verl subtracted from each completion's reward, averaged."""
    threshold, beta = 0.2, 0.3
    ctrl = verl_kl.RewardKLController(AdaptiveKLConfig(kl_adaptation_method=method, kl_clip_threshold=threshold),
                                      beta=beta)
    data = reward_batch(seed=5, batch_size=8)
    mask = data.batch["response_mask"]
    k = core_algos.kl_penalty(data.batch["old_log_probs"], data.batch["ref_log_prob"], "kl")
    shaped = torch.clamp(k, max=threshold) if method == "clip" else k
    lengths, sums, shaped_sums = mask.sum(-1), (k * mask).sum(-1), (shaped * mask).sum(-1)
    scores = data.batch["token_level_scores"].clone()
    ctrl.observe_rewards(1.0)
    out, logged = verl_kl.apply_adaptive_kl_penalty(data, ctrl, kl_penalty="kl")
    subtracted = (scores - out.batch["token_level_rewards"]).sum(-1)
    names = ["adapted_kl", "current_beta", "length_kl_corr", "raw_kl", "reward_penalty", "sequence_kl"]
    assert sorted(key for key in logged if "adaptive_kl" in key) == sorted(
        verl_kl.REWARD_METRIC + name for name in names + (["clip_fraction"] if method == "clip" else []))
    metric = {key[len(verl_kl.REWARD_METRIC):]: value for key, value in logged.items()
              if key.startswith(verl_kl.REWARD_METRIC)}
    assert metric["raw_kl"] == pytest.approx(float(sums.mean()), rel=1e-5)
    assert metric["adapted_kl"] == pytest.approx(float(shaped_sums.mean()), rel=1e-5)
    assert metric["sequence_kl"] == pytest.approx(float(sums.mean()), rel=1e-5)
    assert metric["current_beta"] == beta == logged["actor/reward_kl_penalty_coeff"]
    assert metric["reward_penalty"] == pytest.approx(float(subtracted.mean()), rel=1e-5)
    assert metric["reward_penalty"] == pytest.approx(beta * metric["adapted_kl"], rel=1e-6)
    assert metric["length_kl_corr"] == pytest.approx(statistics.correlation(lengths.tolist(), sums.tolist()),
                                                     rel=1e-5)
    if method == "clip":
        clipped = int(((k >= threshold) & mask.bool()).sum())
        assert 0 < clipped < int(mask.sum()) and metric["adapted_kl"] < metric["raw_kl"]
        assert metric["clip_fraction"] == pytest.approx(clipped / float(lengths.sum()), rel=1e-6)


# ----- the core's numerics in verl's loss and reward, and nothing silently assumed ----------------------------------


def with_response_value(batch, key, sample, position, value):
    """`batch` with the per-response-token field `key` (ref_log_prob, response_mask, ...) set to `value` at `sample`'s
    response token `position`."""
    td, log_probs, prompts, responses = batch
    td = td.clone()
    rows = [row.clone() for row in td[key].unbind()]
    rows[sample][position] = value
    td[key] = _nested(rows)
    return td, log_probs, prompts, responses


def with_policy_value(batch, sample, position, value):
    """`batch` with the actor's log-prob of `sample`'s response token `position` set to `value` (verl's left-shifted
    layout: token j of a response after p prompt tokens sits at p - 1 + j of its sample)."""
    td, log_probs, prompts, responses = batch
    start = sum(p + r for p, r in zip(prompts[:sample], responses[:sample]))
    log_probs = log_probs.clone()
    log_probs[start + prompts[sample] - 1 + position] = value
    return td, log_probs, prompts, responses


def in_bf16(batch):
    """`batch` with the actor's forward, old_log_probs and ref_log_prob in bf16."""
    td, log_probs, prompts, responses = batch
    td = td.clone()
    for key in ("old_log_probs", "ref_log_prob"):
        td[key] = _nested([row.to(torch.bfloat16) for row in td[key].unbind()])
    return td, log_probs.to(torch.bfloat16), prompts, responses


@pytest.mark.parametrize("method", ["none", "clip", "length_normalized"])
@pytest.mark.parametrize(("tensor", "value"), [("log_prob (the actor's forward)", math.nan),
                                               ("ref_log_prob", math.inf), ("ref_log_prob", -math.inf),
                                               ("old_log_probs", math.nan)])
def test_a_nonfinite_log_prob_on_a_valid_token_stops_the_actor_update_naming_verls_tensor(method, tensor, value):
    """A NaN or +-inf on one valid response token, in the actor's forward, in ref_log_prob or in old_log_probs (the
    PPO ratio's denominator, read by verl's policy loss), whatever the method (verl's low_var_kl clamps an infinite
    log-ratio to a finite KL: silent without the check; a NaN old log-prob makes the policy loss NaN): the actor
    update raises NonFiniteLogProbError in the driver, naming verl's tensor, the one token and the step."""
    batch = make_batch(seed=13)
    if tensor in ("ref_log_prob", "old_log_probs"):
        batch = with_response_value(batch, tensor, 2, 0, value)
    else:
        batch = with_policy_value(batch, 2, 0, value)
    named = (re.escape(tensor[:-1]) + r"; the [\w ]+ tensor\)" if tensor.endswith(")")  # one parenthesis
             else re.escape(tensor) + r" \(the [\w ]+ tensor\)")
    with pytest.raises(NonFiniteLogProbError, match=rf"at step 1: .*verl's {named}: 1 valid token\(s\) on process 0\."):
        logged_actor_metrics(batch, "token-mean", kl_adaptation_method=method, kl_clip_threshold=0.3)


@pytest.mark.parametrize("method", ["none", "clip"])
def test_an_infinite_reference_log_prob_leaves_the_workers_gradient_finite_so_the_error_follows_the_update(method):
    """What docs/verl.md says of the check: a -inf ref_log_prob on a valid token gives a finite loss and gradient on
    the worker (verl's low_var_kl clamps the log-ratio to 20, the KL to 10), so verl's engine applies that update; the
    micro-batch ships the count on which the driver then raises."""
    batch = with_response_value(make_batch(seed=13), "ref_log_prob", 2, 0, -math.inf)
    total, grad, metrics = run_loss(adaptive(actor_config(), method, kl_clip_threshold=0.3), batch, 1, beta=0.1)
    assert torch.isfinite(total) and bool(torch.isfinite(grad).all())
    with pytest.raises(NonFiniteLogProbError, match=r"ref_log_prob \(the reference tensor\): 1 valid token"):
        verl_kl.raise_if_nonfinite(metrics[0][verl_kl.STATS + "nonfinite"], step=1)


@pytest.mark.parametrize("method", ["clip", "dynamic", "target"])
def test_the_adapted_loss_kl_is_computed_in_float32_from_bf16_log_probs(method):
    """bf16 log-probs (the actor's forward, ref_log_prob): the adapted KL is verl's low_var_kl taken of the float32
    log-probs (clip: clamped at the threshold; a moving beta's: as it is), token-mean reduced over the valid tokens,
    by hand from the upcast values (in bf16 it is off by bf16's rounding, ~1e-3); only `none` keeps verl's own
    term in verl's dtype."""
    batch, threshold = in_bf16(make_batch(seed=14, kl_scale=3.0)), 0.3
    _, _, metrics = run_loss(adaptive(actor_config(), method, kl_clip_threshold=threshold, kl_target=0.1), batch, 1,
                             beta=0.2)
    lp, ref, mask = padded(batch)
    r = torch.clamp(ref.float() - lp.float(), min=-20.0, max=20.0)
    k = torch.clamp(torch.exp(r) - r - 1, min=-10.0, max=10.0)
    expected = float((torch.clamp(k, max=threshold) if method == "clip" else k)[mask].sum() / mask.sum())
    assert sums_of(metrics).adapted == pytest.approx(expected, rel=1e-6)
    assert sums_of(metrics).raw == pytest.approx(float(k[mask].mean()), rel=1e-6)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("kl_type", ["k2", "k3+", "low_var_kl"])
@pytest.mark.parametrize("method", ["clip", "sigmoid", "none", "dynamic", "target"])
def test_masked_response_tokens_holding_nan_or_inf_leave_the_loss_and_its_gradient_finite(method, kl_type, mode):
    """ref_log_prob NaN and -inf on two response tokens verl masks out (response_mask=0, e.g. a tool's output in a
    multi-turn response): no error, the loss is the one of the batch without them (their ref_log_prob finite), and
    the log-prob gradient is finite everywhere and exactly 0 on those tokens, for every method, `none` (verl's own
    term) included. (verl's masked_sum drops the masked values, but the backward of a KL of the raw log-probs
    multiplies its 0 by k2's derivative there, NaN; seq-mean-token-mean's masked mean of a NaN is NaN.)"""
    clean = make_batch(seed=15, response_lengths=[5, 3, 8, 2, 6, 4, 7, 1])
    for sample, position in ((0, 1), (2, 3)):
        clean = with_response_value(clean, "response_mask", sample, position, 0)
    dirty = with_response_value(with_response_value(clean, "ref_log_prob", 0, 1, math.nan),
                                "ref_log_prob", 2, 3, -math.inf)
    loss_fn = adaptive(actor_config(mode, kl_type=kl_type), method, kl_clip_threshold=0.3, kl_target=0.1)
    expected_loss, expected_grad, _ = run_loss(loss_fn, clean, 2, beta=0.5)
    loss, grad, _ = run_loss(loss_fn, dirty, 2, beta=0.5)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    torch.testing.assert_close(loss, expected_loss, rtol=0, atol=0)
    torch.testing.assert_close(grad, expected_grad, rtol=0, atol=0)
    td, _, prompts, responses = clean
    starts = [sum(p + r for p, r in zip(prompts[:i], responses[:i])) for i in range(len(prompts))]
    assert grad[starts[0] + prompts[0] - 1 + 1] == 0 and grad[starts[2] + prompts[2] - 1 + 3] == 0


@pytest.mark.parametrize("kl_type", ["kl", "abs", "mse", "low_var_kl", "k1", "k2", "k3", "k1+", "k3+", "low_var_kl+"])
def test_the_adapted_kl_of_the_masked_log_ratio_is_verls_kl_of_the_log_probs_for_every_kl_type(kl_type):
    """The adapted path hands verl's kl_penalty the masked log-ratio against a reference of 0 (one masking, not
    two): every kl_loss_type gives the same values and gradient as of the log-probs themselves. clip above every
    token's KL shapes nothing, so on a batch whose masked positions hold verl's padding the loss and its gradient
    are verl's stock ppo_loss, bit for bit."""
    batch = make_batch(seed=17, kl_scale=3.0)
    config = actor_config(kl_type=kl_type)
    stock_loss, stock_grad, stock_metrics = run_loss(lambda **kw: ppo_loss(copy.deepcopy(config), **kw), batch, 2)
    loss, grad, metrics = run_loss(adaptive(copy.deepcopy(config), "clip", kl_clip_threshold=1e30), batch, 2,
                                   beta=config.kl_loss_coef)
    assert torch.equal(loss, stock_loss) and torch.equal(grad, stock_grad)
    for stock, ours in zip(stock_metrics, metrics):
        assert ours["kl_loss"].values == [sums_of(ours).adapted] == stock["kl_loss"].values


@pytest.mark.parametrize("method", ["none", "target"])
def test_masked_infinite_log_probs_raise_nothing_where_the_term_is_unshaped(monkeypatch, method):
    """With verl's own KL term (`none`) and with the pipeline's unshaped one (`target`), the check is the core's, of
    the masked log-probs: +-inf on tokens verl masks out (response_mask=0) leave every sum finite, so the actor
    update raises nothing, counts nothing (the count runs on the error path only) and logs what the batch without
    them logs."""
    clean = make_batch(seed=16, response_lengths=[5, 3, 8, 2, 6, 4, 7, 1])
    for sample, position in ((0, 1), (2, 3)):
        clean = with_response_value(clean, "response_mask", sample, position, 0)
    dirty = with_response_value(with_response_value(clean, "ref_log_prob", 0, 1, math.inf),
                                "ref_log_prob", 2, 3, -math.inf)
    expected = logged_actor_metrics(clean, "token-mean", kl_adaptation_method=method, kl_target=0.1)
    counted = []
    counts = LogpCheck.counts
    monkeypatch.setattr(LogpCheck, "counts", lambda check: counted.append(counts(check)) or counted[-1])
    assert logged_actor_metrics(dirty, "token-mean", kl_adaptation_method=method, kl_target=0.1) == expected
    assert counted == []


@pytest.mark.parametrize("method", ["dynamic", "clip"])
@pytest.mark.parametrize(("tensor", "value"), [("old_log_probs", math.nan), ("ref_log_prob", math.inf)])
def test_a_nonfinite_reward_log_prob_on_a_valid_token_raises_naming_verls_tensor(method, tensor, value):
    """The KL in the reward: a NaN or inf on one valid token of old_log_probs or ref_log_prob raises
    NonFiniteLogProbError naming verl's tensor and the one token, before a reward is penalised."""
    ctrl = verl_kl.RewardKLController(AdaptiveKLConfig(kl_adaptation_method=method), beta=0.1)
    data = reward_batch(seed=3)
    data.batch[tensor][1, 0] = value  # every response has a valid first token
    scores = data.batch["token_level_scores"].clone()
    with pytest.raises(NonFiniteLogProbError, match=rf"{tensor} \(the \w+ tensor\): 1 valid token\(s\)"):
        verl_kl.apply_adaptive_kl_penalty(data, ctrl, kl_penalty="kl")
    assert "token_level_rewards" not in data.batch.keys() and torch.equal(data.batch["token_level_scores"], scores)


@pytest.mark.parametrize("method", ["clip", "dynamic"])
def test_the_reward_kl_is_float32_of_the_masked_log_probs(method):
    """bf16 old_log_probs / ref_log_prob with NaN and -inf in ref_log_prob on masked positions: the rewards are
    float32 and finite, token_level_scores - beta * min(k, c) (clip, the shaped route) or - beta * k (dynamic: verl's
    own apply_kl_penalty) on valid tokens with k = old - ref of the float32 values (verl's 'kl'), the scores themselves
    on masked ones; the metrics count the valid tokens alone, and the batch keeps its own log-probs."""
    threshold, beta = 0.2, 0.5
    ctrl = verl_kl.RewardKLController(AdaptiveKLConfig(kl_adaptation_method=method, kl_clip_threshold=threshold),
                                      beta=beta)
    data = reward_batch(seed=8, batch_size=6, length=6)
    mask = data.batch["response_mask"]
    assert (mask == 0).sum() >= 2
    for key in ("old_log_probs", "ref_log_prob"):
        data.batch[key] = data.batch[key].to(torch.bfloat16)
    masked_positions = (mask == 0).nonzero()
    data.batch["ref_log_prob"][tuple(masked_positions[0])] = math.nan
    data.batch["ref_log_prob"][tuple(masked_positions[-1])] = -math.inf
    old, ref = data.batch["old_log_probs"].float(), data.batch["ref_log_prob"].float()
    k = torch.where(mask.bool(), old - ref, 0.0)
    scores = data.batch["token_level_scores"].clone()
    logps = {key: data.batch[key].clone() for key in ("old_log_probs", "ref_log_prob")}
    ctrl.observe_rewards(0.5)  # as the trainer does before verl scores the batch
    out, metrics = verl_kl.apply_adaptive_kl_penalty(data, ctrl, kl_penalty="kl")
    rewards = out.batch["token_level_rewards"]
    assert rewards.dtype == torch.float32 and torch.isfinite(rewards).all()
    penalised = torch.clamp(k, max=threshold) if method == "clip" else k
    torch.testing.assert_close(rewards, scores - beta * penalised, rtol=0, atol=1e-7)
    for key, value in logps.items():
        torch.testing.assert_close(out.batch[key], value, rtol=0, atol=0, equal_nan=True)
    assert metrics[verl_kl.REWARD_METRIC + "raw_kl"] == pytest.approx(float(k.sum(-1).mean()), rel=1e-6)


def test_an_unknown_loss_agg_mode_is_refused_naming_verls_field():
    """verl's loss_agg_mode picks the core's reduction of the KL term: one the core does not know is a ValueError
    naming the field, the value and the allowed modes (not silently bnpo's token mean)."""
    config = trainer_config(use_kl_in_reward=False)
    config.actor_rollout_ref.actor.loss_agg_mode = "seq-mean-token-median"
    with pytest.raises(ValueError, match=r"actor_rollout_ref\.actor\.loss_agg_mode='seq-mean-token-median'.*"
                                         r"token-mean"):
        _GuardedTrainer(config)
    with pytest.raises(ValueError, match=r"actor_rollout_ref\.actor\.loss_agg_mode='seq-mean-token-median'"):
        verl_kl.kl_agg_mode(AdaptiveKLConfig(kl_adaptation_method="clip"), "seq-mean-token-median")


class _ScoredBatch:
    """What the V1 trainer hands `_compute_advantage`: samples' keys and tags (verl's padding samples are tagged
    is_padding) in a transfer-queue partition."""

    def __init__(self, padding):
        self.tags = [{"is_padding": True} if pad else {} for pad in padding]
        self.keys = [f"sample-{i}" for i in range(len(padding))]
        self.partition_id = "train"

    def __len__(self):
        return len(self.tags)


class _ScoringTrainer(_StubTrainer):
    def _compute_advantage(self, batch, metrics):
        return batch


class _RewardTrainer(verl_kl.AdaptiveKLTrainerMixin, _ScoringTrainer):
    pass


@pytest.mark.parametrize("reward", ["0.9", True, math.nan])
def test_the_reward_controllers_door_reads_a_mean_reward_as_the_cores(reward):
    """`RewardKLController.observe_rewards` took float(reward): "0.9" and True became 0.9 and 1.0, and dynamic
    decayed on them, where `AdaptiveKL.step` refuses both; NaN was refused only at verl's `update`. Refused here now,
    in the core's words; a one-element tensor is a number at both doors."""
    ctrl = verl_kl.RewardKLController(AdaptiveKLConfig(kl_adaptation_method="dynamic"), beta=0.3)
    with pytest.raises(ValueError, match=re.escape(f"mean_reward={reward!r} is invalid: allowed is a finite number")):
        ctrl.observe_rewards(reward)
    assert ctrl._mean_reward is None
    ctrl.observe_rewards(torch.tensor([0.9]))
    assert ctrl._mean_reward == pytest.approx(0.9)


def test_a_batch_of_padding_alone_has_no_mean_reward(monkeypatch):
    """The controllers read the mean reward of a batch's real samples, fetched from the transfer queue by key (each
    sample's rm_scores summed over its tokens, as verl's critic/score/mean); a batch of verl's padding samples alone
    has none: nothing is fetched and no controller observes a reward."""
    store = {"sample-0": [1.0, 2.0], "sample-1": [9.0, 9.0], "sample-2": [0.5, 0.0]}
    fetched = []

    def kv_batch_get(keys, partition_id, select_fields):
        fetched.append(list(keys))
        return {"rm_scores": torch.tensor([store[key] for key in keys])}

    monkeypatch.setitem(sys.modules, "transfer_queue", types.SimpleNamespace(kv_batch_get=kv_batch_get))
    trainer = _RewardTrainer(trainer_config(kl_penalty="kl", use_kl_loss=True, use_kl_in_reward=True,
                                            kl_adaptation_method="dynamic"))
    trainer._compute_advantage(_ScoredBatch([False, True, False]), {})
    assert fetched == [["sample-0", "sample-2"]]
    assert trainer._mean_reward == trainer.reward_kl._mean_reward == pytest.approx((3.0 + 0.5) / 2)
    trainer.reward_kl._mean_reward = None  # as verl's apply_kl_penalty leaves it (update reads it)
    assert trainer._batch_mean_reward(_ScoredBatch([True, True, True])) is None
    trainer._compute_advantage(_ScoredBatch([True, True]), {})
    assert fetched == [["sample-0", "sample-2"]]  # nothing fetched for padding alone
    assert trainer._mean_reward is None and trainer.reward_kl._mean_reward is None
    store["sample-1"] = [math.inf, 0.0]  # refused where verl scores the batch, before the update (was after it)
    with pytest.raises(ValueError, match=r"^adaptive_kl: the batch's mean reward \(verl's critic/score/mean, rm_scores "
                                         r"summed per sample\) is inf: a reward returned NaN or \+-inf for a sample; "
                                         r".*where a beta controller reads them \(adaptive_kl\.kl_adaptation_method="
                                         r"'dynamic', adaptive_kl\.kl_adaptation_method='dynamic': dynamic would"):
        trainer._compute_advantage(_ScoredBatch([False, False]), {})
    # a controller that reads no reward in both KLs (a constant beta, target): nothing fetched, nothing refused, as
    # under verl's own trainer
    fetched.clear()
    for block in (dict(kl_adaptation_method="clip"), dict(kl_adaptation_method="clip",
                                                          reward={"kl_adaptation_method": "target", "kl_target": 0.1})):
        constant = _RewardTrainer(trainer_config(kl_penalty="kl", use_kl_loss=True, use_kl_in_reward=True, **block))
        constant._compute_advantage(_ScoredBatch([False, False]), {})
        assert fetched == [] and constant._mean_reward is None, block


# ----- verl's TrainingWorker (fsdp2, gloo, one process, tiny Llama), in a subprocess --------------------------------


def run_cpu_scenario(scenario, tmp_path, timeout=600):
    output = tmp_path / f"{scenario}.json"
    env = {**os.environ, "VERL_PLATFORM": "cpu", "PYTHONPATH": os.pathsep.join(
        [os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, os.path.join(HERE, "verl_cpu.py"), scenario, str(output)],
                          env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(output.read_text())


def test_training_worker_none_is_stock_and_beta_is_the_pushed_one(tmp_path):
    out = run_cpu_scenario("worker", tmp_path)
    for mode in ("token-mean", "seq-mean-token-mean"):
        stock, none = out[f"stock/{mode}"], out[f"none/{mode}"]
        assert none["loss"] == stock["loss"] and none["grad_norm"] == stock["grad_norm"], mode
        for key in stock:
            if key != "lr":
                assert none[key] == stock[key], (mode, key)
        # verl's engine normalises by the mini-batch's tokens: the micro-batches' shares add up to one entry, and
        # the rows' KL is verl's own kl_loss
        sums = none["sums"]
        assert sums["entries"] == pytest.approx(1.0, rel=1e-12) and none["nonfinite"] == []
        assert [sums["raw"]] == [sums["adapted"]] == pytest.approx(stock["kl_loss"], rel=1e-6)  # one mini-batch
    clip = out["clip"]
    assert clip["kl_coef"] == [0.37] * 4  # every micro-batch
    assert clip["sums"]["adapted"] <= 0.5 < clip["sums"]["raw"]
    assert out["weights_changed"] == out["weights"] > 0
    for micro in (1, 2, 4):  # 8, 4 and 2 micro-batches of the same mini-batch: one total gradient
        run = out[f"clip/micro{micro}"]
        assert len(run["kl_coef"]) == 8 // micro
        assert run["loss"][0] == pytest.approx(clip["loss"][0], rel=1e-5)
        assert run["grad_norm"][0] == pytest.approx(clip["grad_norm"][0], rel=1e-4)


# ----- verl's trainer config, as python -m verl.trainer.main_ppo composes it ----------------------------------------

def composed(overrides):
    """verl's own trainer config (ppo_trainer.yaml, as main_ppo composes it) with a GRPO run's overrides."""
    from hydra import compose, initialize_config_module

    with initialize_config_module(config_module="verl.trainer.config", version_base=None):
        return compose(config_name="ppo_trainer", overrides=["algorithm.adv_estimator=grpo", *overrides])


SIZES = {"verl's default batch: 1024 x 1": [], "1024 prompts x 8 samples": ["actor_rollout_ref.rollout.n=8"],
         "32 prompts x 16 samples": ["data.train_batch_size=32", "actor_rollout_ref.rollout.n=16"]}


@pytest.mark.parametrize("size", list(SIZES))
def test_the_page_command_builds_the_trainer_at_real_batch_sizes(size):
    """docs/verl.md's command (PAGE_RUN) in verl's own config: the trainer is built, with no warning of this package,
    at verl's default batch and at GRPO's. The page showed the end-to-end run's test-sized target (horizon 10, for 4
    completions a step), which the core refuses at each of these sizes: beta would reach 0 for good (n / 5 > 10)."""
    import warnings

    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        trainer = verl_kl.AdaptiveKLPPOTrainer(composed(PAGE_RUN + SIZES[size]))
    assert [str(w.message) for w in said if "adaptive_kl" in str(w.message)] == []
    assert trainer.config.adaptive_kl.reward.kl_horizon == 10000
    completions = trainer.config.data.train_batch_size * trainer.config.actor_rollout_ref.rollout.n
    with pytest.raises(ValueError, match=rf"^adaptive_kl\.reward\.kl_horizon=10\.0 is invalid for steps of "
                                         rf"{completions} completions with beta_min=0"):
        verl_kl.AdaptiveKLPPOTrainer(composed(ADAPTIVE_RUN + SIZES[size]))


def test_loss_benchmark_runs_and_reports(tmp_path):
    """benchmarks/verl_loss.py at tiny sizes: every method and the A/A control reported (no timing is asserted)."""
    output = tmp_path / "verl_loss.json"
    result = subprocess.run([sys.executable, os.path.join(os.path.dirname(HERE), "benchmarks", "verl_loss.py"),
                             "--smoke", "--json", str(output)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads(output.read_text())
    assert [row["method"] for row in data["rows"]] == ["stock (A/A)", "none", "clip", "sigmoid", "length_normalized",
                                                       "target", "sigmoid+length_normalized"]
    assert all(row["median_ms"] > 0 and row["ci"][0] <= row["ci"][1] for row in data["rows"])
    assert "max_verl_loss_ratio=" in result.stdout


def test_self_check_holds_verl_to_its_stock_loss(monkeypatch):
    """`python -m unsloth_adaptive_kl` with verl installed: its version, every anchor, none == stock ppo_loss and
    clip == its formula; a missing anchor fails it, naming the line, and the loss checks are not run."""
    from unsloth_adaptive_kl.tools import selfcheck

    checks = selfcheck.verl_checks("")
    assert [c.name for c in checks] == ["verl version", "verl anchors", "verl ppo_loss: none == stock",
                                        "verl ppo_loss: clip == beta * mean min(k, threshold)"]
    assert all(c.ok for c in checks), [c.line() for c in checks]
    assert checks[1].detail == f"{len(versions.VERL_ANCHORS)} of {len(versions.VERL_ANCHORS)} found"
    moved = versions.Anchor("workers.utils.losses.ppo_loss", "a line verl moved", "why it mattered")
    monkeypatch.setattr(versions, "VERL_ANCHORS", (*versions.VERL_ANCHORS, moved))
    failed = selfcheck.verl_checks("")
    assert [c.line() for c in failed if not c.ok] == [
        f"[FAIL] verl anchors: {len(versions.VERL_ANCHORS) - 1} of {len(versions.VERL_ANCHORS)} found",
        "[FAIL] verl anchor missing: `a line verl moved` in workers.utils.losses.ppo_loss (why it mattered)"]
    assert len(failed) == 3


def test_the_self_check_prints_what_the_verl_page_shows(tmp_path):
    """docs/verl.md shows the self-check's output from docs/results/selfcheck_verl.json; run here (verl with its
    core extras, no trl: CI's verl row), it prints the same lines but their measured figures."""
    from selfcheck_record import assert_like_the_record, run_self_check

    _, record = run_self_check(tmp_path)
    assert record["versions"]["verl"] == importlib.metadata.version("verl")
    assert_like_the_record(record, "selfcheck_verl.json")


# ----- what a mutation audit of verl.py found unpinned ----------------------------------------------------------------


def test_a_reward_field_that_its_methods_do_not_read_is_kept_and_warns_naming_it():
    """A field set under `reward` is the reward's, read or not: adaptive_kl.reward.beta_max=0.35 with the reward's
    clip (which reads no beta_max) stays in the reward's config and warns once, naming it (nothing silently does
    nothing); the loss's config (target) keeps its default (None: no cap), as it never sees reward.*."""
    with pytest.warns(UserWarning) as caught:
        loss, reward = verl_kl.configs_from({"kl_adaptation_method": "target",
                                             "reward": {"kl_adaptation_method": "clip", "beta_max": 0.35}})
    assert [str(w.message) for w in caught] == [
        "adaptive_kl.reward.beta_max=0.35 has no effect: only kl_adaptation_method target reads it, and "
        "kl_adaptation_method='clip' does not include it. Leave it at its default, or choose a setting that reads it."]
    assert reward.beta_max == 0.35 and loss.beta_max == AdaptiveKLConfig().beta_max


def test_a_micro_batchs_entries_are_its_share_of_the_mini_batchs_tokens_times_dp_size():
    """entries = tokens * dp_size / batch_num_tokens, by hand: 3 of a mini-batch's 12 valid tokens on 2 ranks count
    3 * 2 / 12 = 0.5, on one rank (dp_size absent) 3 / 12 = 0.25; without batch_num_tokens (verl's per-micro-batch
    means) one entry, whatever its tokens; a mini-batch without a valid token (batch_num_tokens 0) counts 0 entries
    instead of dividing by zero."""
    assert verl_kl.micro_batch_entries(3.0, {"batch_num_tokens": 12, "dp_size": 2}) == 0.5
    assert verl_kl.micro_batch_entries(3.0, {"batch_num_tokens": 12}) == 0.25
    assert verl_kl.micro_batch_entries(3.0, {}) == 1.0
    assert verl_kl.micro_batch_entries(0.0, {"batch_num_tokens": 0, "dp_size": 2}) == 0.0


def test_length_normalized_logs_the_raw_kl_as_loss_agg_mode_reduces_it():
    """length_normalized with loss_agg_mode=token-mean: the adapted term is reduced seq-mean-token-mean (each
    completion's mean k, averaged: mean_i S_i / L_i), but raw_kl and verl's actor/kl_loss keep verl's token-mean of
    the un-adapted k (sum_i S_i / sum_i L_i), by hand; the two differ on this batch of unequal lengths."""
    batch = make_batch(seed=11, kl_scale=3.0, response_lengths=[5, 3, 8, 2, 6, 4, 7, 1])
    logged = logged_actor_metrics(batch, "token-mean", kl_adaptation_method="length_normalized")
    k, mask = per_token(batch)
    lengths, sums = mask.sum(-1).double(), (k * mask).sum(-1).double()
    token_mean, sequence_mean = float(sums.sum() / lengths.sum()), float((sums / lengths).mean())
    assert abs(token_mean - sequence_mean) > 1e-3
    assert logged[METRIC + "raw_kl"] == pytest.approx(token_mean, rel=1e-6)
    assert logged["actor/kl_loss"] == pytest.approx(token_mean, rel=1e-6)
    assert logged[METRIC + "adapted_kl"] == pytest.approx(sequence_mean, rel=1e-6)


def test_nonfinite_log_probs_in_two_micro_batches_of_one_worker_are_counted_together():
    """A NaN in the actor's forward on one valid token of sample 1 (micro-batch 1) and one of sample 6 (micro-batch
    2) of the same worker: one error naming verl's tensor, 1 + 1 = 2 valid tokens on process 0."""
    batch = with_policy_value(with_policy_value(make_batch(seed=13), 1, 0, math.nan), 6, 0, math.nan)
    with pytest.raises(NonFiniteLogProbError,
                       match=r"at step 1: .*verl's log_prob \(the actor's forward; the policy tensor\): 2 valid "
                             r"token\(s\) on process 0\."):
        logged_actor_metrics(batch, "token-mean", micro_batches=2, kl_adaptation_method="clip", kl_clip_threshold=0.3)


def test_a_batch_whose_reward_was_not_observed_does_not_decay_the_reward_beta_again():
    """dynamic in the reward (reward_threshold 0.5, decay 0.5, beta_0 0.1): a batch observed with mean reward 1.0
    decays beta to 0.1 * 0.5 = 0.05 after verl's update; the next batch, whose reward was not observed (verl's padding
    alone: no mean reward), leaves beta at 0.05: a reward counts for its own batch only. Each batch is penalised at
    the beta of its time: scores - beta * k on valid tokens."""
    ctrl = verl_kl.RewardKLController(AdaptiveKLConfig(kl_adaptation_method="dynamic", reward_threshold=0.5,
                                                       dynamic_beta_decay=0.5), beta=0.1)
    for seed, observed, beta, after in ((0, 1.0, 0.1, 0.05), (1, None, 0.05, 0.05)):
        if observed is not None:
            ctrl.observe_rewards(observed)
        data = reward_batch(seed=seed)
        mask = data.batch["response_mask"]
        k = (data.batch["old_log_probs"] - data.batch["ref_log_prob"]) * mask
        scores = data.batch["token_level_scores"].clone()
        out, _ = verl_kl.apply_adaptive_kl_penalty(data, ctrl, kl_penalty="kl")
        torch.testing.assert_close(out.batch["token_level_rewards"], scores - beta * k, rtol=0, atol=1e-7)
        assert ctrl.value == pytest.approx(after, rel=1e-12)


def test_the_trainer_runs_as_verls_sync_mode_and_refuses_distillation_with_the_kl_in_the_loss():
    """verl's mode logic keys on its own names: the trainer sets trainer.v1.trainer_mode=sync for verl's base class.
    distillation with the KL in the loss is refused; with the loss's KL off it is not ours to refuse. Neither KL on
    warns that there is nothing to adapt."""
    config = trainer_config(use_kl_in_reward=False)
    _GuardedTrainer(config)
    assert config.trainer.v1.trainer_mode == "sync"
    config = trainer_config(use_kl_in_reward=False)
    config.distillation = {"enabled": True}
    with pytest.raises(ValueError, match=r"^distillation\.enabled=True is invalid with actor_rollout_ref\.actor\."
                                         r"use_kl_loss=True under trainer\.v1\.trainer_mode=adaptive_kl: allowed is "
                                         r"distillation\.enabled=False, or the KL in the reward alone"):
        _GuardedTrainer(config)
    config = trainer_config(use_kl_loss=False)
    config.distillation = {"enabled": True}
    assert _GuardedTrainer(config).loss_kl is None
    with pytest.warns(UserWarning, match=r"^adaptive_kl: neither actor_rollout_ref\.actor\.use_kl_loss nor "
                                         r"algorithm\.use_kl_in_reward is on: there is no KL to adapt\.$"):
        trainer = _GuardedTrainer(trainer_config(use_kl_loss=False, use_kl_in_reward=False))
    assert trainer.loss_kl is None and trainer.reward_kl is None


class _Reached(Exception):
    """Raised by verl's own code, stubbed, to show that a trainer's own __init__ ran."""


def _reach(*args, **kwargs):
    raise _Reached


def test_verls_own_trainers_refuse_an_adaptive_kl_block_and_build_as_before_without_one(monkeypatch):
    """Left out trainer.v1.trainer_mode=adaptive_kl, verl's own trainer read none of the block: it trained without
    adaptive KL, silently. verl's V1 base (every trainer mode) and the legacy RayPPOTrainer (trainer.use_v1=False)
    refuse it, each saying what to set; without a block, or after unpatch(), verl's own __init__ runs (its first call,
    stubbed, is reached)."""
    from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

    monkeypatch.setattr(trainer_base, "build_checkpoint_callback", _reach)  # PPOTrainer.__init__'s first call
    config = trainer_config(kl_adaptation_method="clip")
    config.trainer.v1.trainer_mode = "sync"
    with pytest.raises(ValueError, match=r"^adaptive_kl: the config holds an adaptive_kl block, but PPOTrainerSync is "
                                         r"verl's own trainer \(trainer\.v1\.trainer_mode='sync'\), which reads none "
                                         r"of it: allowed is trainer\.v1\.trainer_mode=adaptive_kl; or remove the "
                                         r"block to train without adaptive KL\.$"):
        PPOTrainerSync(config)
    config.trainer.v1.trainer_mode = "adaptive_kl"  # as a user may have it: the legacy path reads use_v1
    with pytest.raises(ValueError, match=r"^adaptive_kl: the config holds an adaptive_kl block, but RayPPOTrainer is "
                                         r"verl's legacy trainer \(trainer\.use_v1=False\), which reads none of it: "
                                         r"allowed is trainer\.use_v1=True with trainer\.v1\.trainer_mode=adaptive_kl; "
                                         r"or remove the block to train without adaptive KL\.$"):
        ray_trainer.RayPPOTrainer(config=config, tokenizer=None, role_worker_mapping={}, resource_pool_manager=None)
    config.trainer.v1.trainer_mode = "sync"
    patched = len(verl_kl._patches)
    verl_kl.patch()  # idempotent: one wrapper each
    assert len(verl_kl._patches) == patched
    verls = trainer_base.PPOTrainer.__init__.__wrapped__
    assert verls.__qualname__ == "PPOTrainer.__init__" and not hasattr(verls, "__wrapped__")

    blockless = trainer_config()
    del blockless["adaptive_kl"]
    with pytest.raises(_Reached):
        PPOTrainerSync(blockless)
    verl_kl.unpatch()
    try:
        assert trainer_base.PPOTrainer.__init__ is verls
        with pytest.raises(_Reached):
            PPOTrainerSync(config)
    finally:
        verl_kl.patch()
    with pytest.raises(ValueError, match="but PPOTrainerSync is verl's own trainer"):
        PPOTrainerSync(config)


def test_a_verl_trainer_whose_init_skips_the_bases_refuses_the_block_too():
    """verl's experimental OneStepOffRayTrainer and FullyAsyncTrainer derive from RayPPOTrainer and never call its
    __init__: with an adaptive_kl block they built, and would have trained without it, silently. Every subclass's own
    __init__ refuses it, of either base, defined before patch() or after; after unpatch() none does."""

    def derived(base):
        class Skipping(base):  # as verl's experimental trainers: the base's __init__ is never called
            def __init__(self, config, *args, **kwargs):
                self.config = config

        return Skipping

    from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync  # PPOTrainer's concrete subclass

    bases = (PPOTrainerSync, ray_trainer.RayPPOTrainer)
    config = trainer_config(kl_adaptation_method="clip")
    config.trainer.v1.trainer_mode = "sync"
    verl_kl.unpatch()
    try:
        before = [derived(base) for base in bases]
        assert before[1](config).config is config  # unpatched: built, the block unread
        assert "__init_subclass__" not in vars(ray_trainer.RayPPOTrainer)
    finally:
        verl_kl.patch()
    after = [derived(base) for base in bases]
    for trainer in before + after:
        with pytest.raises(ValueError, match=r"^adaptive_kl: the config holds an adaptive_kl block, but Skipping is "
                                             r"verl's (own|legacy) trainer"):
            trainer(config)
    blockless = trainer_config()
    del blockless["adaptive_kl"]
    assert after[1](blockless).config is blockless


class _PenalisingTrainer(_StubTrainer):
    """verl's _compute_advantage, its step 1: apply_kl_penalty as verl's V1 trainer module references it, with
    verl's kl_ctrl_in_reward and algorithm.kl_penalty; the module's function seen during the call is recorded."""

    def _compute_advantage(self, batch, metrics):
        self.seen = trainer_base.apply_kl_penalty
        self.penalised, kl_metrics = trainer_base.apply_kl_penalty(
            self.reward_data, kl_ctrl=self.kl_ctrl_in_reward, kl_penalty=self.config.algorithm.kl_penalty)
        metrics.update(kl_metrics)
        return batch


class _PenalisingAdaptiveTrainer(verl_kl.AdaptiveKLTrainerMixin, _PenalisingTrainer):
    pass


def test_the_trainers_reward_kl_is_ours_for_the_step_and_verls_function_after_it(monkeypatch):
    """_compute_advantage with the KL in the reward (clip+dynamic, threshold 0.2, reward_threshold 0.5, decay 0.5,
    kl_coef 0.1): verl's step penalises with our controller in verl's kl_ctrl_in_reward, each valid token's reward
    scores - 0.1 * min(old - ref, 0.2) by hand; the batch's mean reward (3.0 + 1.0) / 2 = 2.0 > 0.5 decays beta to
    0.05; the metrics are under actor/ and adaptive_kl/reward/. After the step the V1 trainer module holds verl's own
    apply_kl_penalty again."""
    store = {"sample-0": [1.0, 2.0], "sample-1": [0.5, 0.5]}
    monkeypatch.setitem(sys.modules, "transfer_queue", types.SimpleNamespace(
        kv_batch_get=lambda keys, partition_id, select_fields: {"rm_scores": torch.tensor([store[k] for k in keys])}))
    stock = trainer_base.apply_kl_penalty
    trainer = _PenalisingAdaptiveTrainer(trainer_config(
        use_kl_loss=False, kl_adaptation_method="clip+dynamic", kl_clip_threshold=0.2, reward_threshold=0.5,
        dynamic_beta_decay=0.5))
    trainer.reward_data = data = reward_batch(seed=4)
    mask = data.batch["response_mask"]
    k = (data.batch["old_log_probs"] - data.batch["ref_log_prob"]) * mask
    scores = data.batch["token_level_scores"].clone()
    metrics = {}
    trainer._compute_advantage(_ScoredBatch([False, False]), metrics)
    assert trainer.seen is verl_kl.apply_adaptive_kl_penalty and trainer_base.apply_kl_penalty is stock
    assert (k > 0.2).any()
    torch.testing.assert_close(trainer.penalised.batch["token_level_rewards"],
                               scores - 0.1 * torch.clamp(k, max=0.2), rtol=0, atol=1e-7)
    assert metrics["actor/reward_kl_penalty_coeff"] == 0.1 == metrics[verl_kl.REWARD_METRIC + "current_beta"]
    assert trainer.reward_kl.value == pytest.approx(0.05, rel=1e-12)


def test_the_loss_beta_moves_with_each_batchs_reward_and_the_update_leaves_verl_as_it_was():
    """dynamic in the loss (reward_threshold 0.25, decay 0.5, beta_0 0.37): an update after a batch of mean reward 0.5
    decays beta to 0.37 * 0.5 = 0.185; the next update pushes 0.185 to every micro-batch (verl's actor/kl_coef) and,
    its batch's reward 0.0 being below the threshold, keeps it. Each update leaves the batch's meta info without the
    pushed beta and verl's V1 trainer module with its own reduce_metrics."""
    from verl.utils.metric import reduce_metrics

    batch = make_batch(seed=11)
    trainer, logged = actor_update(batch, "token-mean", kl_adaptation_method="dynamic", reward_threshold=0.25,
                                   dynamic_beta_decay=0.5)
    assert logged["actor/kl_coef"] == 0.37 and trainer.loss_kl.current_beta == pytest.approx(0.185, rel=1e-12)
    assert trainer_base.reduce_metrics is reduce_metrics
    meta, metrics = types.SimpleNamespace(extra_info={}), {}
    trainer._mean_reward = 0.0
    trainer._update_actor(meta, metrics)
    assert metrics["actor/kl_coef"] == pytest.approx(0.185, rel=1e-12)
    assert metrics[METRIC + "current_beta"] == pytest.approx(0.185, rel=1e-12)
    assert trainer.loss_kl.current_beta == pytest.approx(0.185, rel=1e-12)
    assert verl_kl.BETA_KEY not in meta.extra_info and trainer_base.reduce_metrics is reduce_metrics


class _CheckpointingTrainer(_StubTrainer):
    """verl's checkpoint calls: `_save_checkpoint` records whether our state file was already written (it must be,
    before verl marks the checkpoint latest); `_load_checkpoint` sets global_steps as verl's resume does."""

    resumed_step = 0

    def _save_checkpoint(self):
        self.state_written_first = os.path.exists(os.path.join(
            self.config.trainer.default_local_dir, f"global_step_{self.global_steps}", verl_kl.STATE_FILE))

    def _load_checkpoint(self):
        self.global_steps = self.resumed_step


class _CheckpointedTrainer(verl_kl.AdaptiveKLTrainerMixin, _CheckpointingTrainer):
    pass


def test_a_checkpoint_restores_each_kls_beta_from_the_folder_verl_resumes(tmp_path, monkeypatch):
    """dynamic for both KLs (reward_threshold 0), the loss's decay 0.5 and the reward's 0.25, beta_0 0.1 each: after
    one observed batch the loss's beta is 0.05, the reward's 0.025. Saved at step 1 (before verl's own save), a new
    run resuming step 1 gets 0.05 and 0.025 back, each in its own KL: with resume_mode=auto from
    default_local_dir/global_step_1, relative to the working directory; with resume_mode=resume_path from
    resume_from_path (default_local_dir empty). A fresh run (step 0) reads nothing; a resume without the file warns,
    naming it, and keeps beta_0."""
    def config(**trainer):
        cfg = trainer_config(kl_adaptation_method="dynamic", reward_threshold=0.0, dynamic_beta_decay=0.5,
                             reward={"dynamic_beta_decay": 0.25})
        cfg.trainer.update({"resume_mode": "auto", "default_local_dir": "ckpt", **trainer})
        return cfg

    monkeypatch.chdir(tmp_path)
    saved = _CheckpointedTrainer(config())
    saved.loss_kl.step(1.0)
    saved.reward_kl.observe_rewards(1.0)
    saved.reward_kl.update(current_kl=0.0, n_steps=1)
    assert (saved.loss_kl.current_beta, saved.reward_kl.value) == (0.05, 0.025)
    saved.global_steps = 1
    saved._save_checkpoint()
    assert saved.state_written_first

    def resumed(step, **trainer):
        run = _CheckpointedTrainer(config(**trainer))
        run.resumed_step = step
        run._load_checkpoint()
        return run.loss_kl.current_beta, run.reward_kl.value

    assert resumed(1) == (0.05, 0.025)
    os.rename(tmp_path / "ckpt" / "global_step_1", tmp_path / "elsewhere")
    assert resumed(1, resume_mode="resume_path", resume_from_path=str(tmp_path / "elsewhere")) == (0.05, 0.025)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert resumed(0) == (0.1, 0.1)
    missing = os.path.join(str(tmp_path), "ckpt", "global_step_1", verl_kl.STATE_FILE)
    with pytest.warns(UserWarning, match=rf"^adaptive_kl: {re.escape(missing)} is missing: the controllers restart "
                                         r"from their initial beta\.$"):
        assert resumed(1) == (0.1, 0.1)


def test_the_loss_alone_reads_each_batchs_mean_reward_of_verls_nested_scores(monkeypatch):
    """The KL in the loss alone (dynamic; the reward's KL off): _compute_advantage still reads the batch's mean
    reward for the loss's controller. verl's transfer queue returns rm_scores nested, one row per sample of its own
    length: each real sample's row summed, [1, 2, 0] -> 3.0 and [0.5] -> 0.5, averaged: 1.75 (the padding sample
    skipped)."""
    store = {"sample-0": [1.0, 2.0, 0.0], "sample-1": [7.0], "sample-2": [0.5]}

    def kv_batch_get(keys, partition_id, select_fields):
        return {"rm_scores": torch.nested.as_nested_tensor([torch.tensor(store[key]) for key in keys],
                                                           layout=torch.jagged)}

    monkeypatch.setitem(sys.modules, "transfer_queue", types.SimpleNamespace(kv_batch_get=kv_batch_get))
    trainer = _RewardTrainer(trainer_config(use_kl_in_reward=False, kl_adaptation_method="dynamic"))
    assert trainer.reward_kl is None
    trainer._compute_advantage(_ScoredBatch([False, True, False]), {})
    assert trainer._mean_reward == pytest.approx((3.0 + 0.5) / 2, rel=1e-7)


@pytest.mark.parametrize(("coefficient", "build"), [
    ("actor_rollout_ref.actor.kl_loss_coef",
     lambda config, beta: verl_kl.verl_adaptive_kl(config, beta, "actor_rollout_ref.actor.kl_loss_coef", "adaptive_kl",
                                                   loss_type="dapo")),
    ("algorithm.kl_ctrl.kl_coef", lambda config, beta: verl_kl.RewardKLController(config, beta, field="adaptive_kl")),
])
def test_a_bad_coefficient_or_bound_is_named_in_verls_terms(coefficient: str, build) -> None:
    """The core calls verl's coefficient `beta`: `kl_loss_coef=-0.1` was refused as "beta=-0.1 is invalid", and a
    beta_min above it named "beta", so a verl user could not tell the loss's from the reward's."""
    with pytest.raises(ValueError) as raised:
        build(AdaptiveKLConfig(kl_adaptation_method="clip"), -0.1)
    assert str(raised.value) == f"{coefficient}=-0.1 is invalid: allowed is a finite number >= 0."
    with pytest.raises(ValueError) as raised:
        build(AdaptiveKLConfig(kl_adaptation_method="dynamic", beta_min=0.5), 0.1)
    assert str(raised.value) == ("adaptive_kl.beta_min=0.5 is invalid: allowed is a finite number with 0 <= "
                                 f"beta_min <= beta=0.1. Here beta is {coefficient}=0.1.")


@pytest.mark.parametrize(("block", "named"), [
    # the method set under reward, the bound at the top: the bound's block is named (it named the method's)
    (dict(beta_max=0.05, reward={"kl_adaptation_method": "target", "kl_target": 0.2}), "adaptive_kl.beta_max=0.05"),
    (dict(kl_adaptation_method="dynamic", reward={"beta_min": 0.5}), "adaptive_kl.reward.beta_min=0.5"),
])
def test_a_bound_is_named_with_the_block_that_set_it(block, named):
    """kl_coef = 0.1: a beta_max below it or a beta_min above it is refused naming the block the bound was set in,
    whichever block set the method."""
    with pytest.raises(ValueError) as raised:
        _GuardedTrainer(trainer_config(use_kl_loss=False, **block))
    assert str(raised.value).startswith(f"{named} is invalid: ")
    assert str(raised.value).endswith("Here beta is algorithm.kl_ctrl.kl_coef=0.1.")


def test_a_beta_max_below_the_beta_min_the_reward_inherits_names_that_beta_min():
    """beta_min=0.5 at the top (the reward block inherits it), beta_max=0.2 under reward: the refusal named the
    reward's beta_max alone, "allowed is ... >= beta_min", and not the 0.5 the user set elsewhere."""
    block = dict(kl_adaptation_method="dynamic", beta_min=0.5,
                 reward={"kl_adaptation_method": "target", "kl_target": 0.2, "beta_max": 0.2})
    with pytest.raises(ValueError) as raised:
        _GuardedTrainer(trainer_config(**block))
    assert str(raised.value) == ("adaptive_kl.reward.beta_max=0.2 is invalid: allowed is None or a finite number >= "
                                 "beta_min=0.5 and >= beta.")


# ----- from a mutation audit of verl.py: each test fails on a change that every other test let pass ----------------


def test_none_keeps_verls_own_kl_term_in_verls_dtype():
    """`none` is verl's ppo_loss itself, bit for bit, also on bf16 log-probs: verl's KL term in bf16, not the
    pipeline's float32 one (which the other methods take: test_the_adapted_loss_kl_is_computed_in_float32_from_bf16_
    log_probs). A `none` routed through the pipeline equals it in float32 (test_none_is_stock_ppo_loss_bit_for_bit)
    but not here."""
    batch = in_bf16(make_batch(seed=14, kl_scale=3.0))
    for mode in ("token-mean", "seq-mean-token-mean"):
        config = actor_config(mode)
        stock_loss, stock_grad, stock_metrics = run_loss(lambda **kw: ppo_loss(copy.deepcopy(config), **kw), batch, 2)
        loss, grad, metrics = run_loss(adaptive(copy.deepcopy(config)), batch, 2, beta=config.kl_loss_coef)
        assert torch.equal(loss, stock_loss) and torch.equal(grad, stock_grad), mode
        assert [m["kl_loss"].values for m in metrics] == [m["kl_loss"].values for m in stock_metrics]


def _run_with_entropy(loss_fn, batch, beta=None):
    """One micro-batch with an entropy model output (a leaf of its own): (loss, d loss / d entropy, metrics)."""
    td, log_probs, prompts, responses = batch
    td = td.clone()
    tu.assign_non_tensor(td, dp_size=1, batch_num_tokens=sum(responses), global_batch_size=len(prompts))
    if beta is not None:
        tu.assign_non_tensor(td, **{verl_kl.BETA_KEY: beta})
    g = torch.Generator().manual_seed(99)
    entropy = (torch.rand(log_probs.shape[0], generator=g) * 2).requires_grad_(True)
    offsets = torch.tensor([0, *torch.tensor([p + r for p, r in zip(prompts, responses)]).cumsum(0).tolist()])
    nested = lambda values: torch.nested.nested_tensor_from_jagged(values, offsets)  # noqa: E731
    loss, metrics = loss_fn(model_output={"log_probs": nested(log_probs.clone().requires_grad_(True)),
                                          "entropy": nested(entropy)}, data=td)
    loss.backward()
    return loss.detach(), entropy.grad, metrics


@pytest.mark.parametrize("method", ["none", "length_normalized", "clip"])
def test_the_entropy_term_stays_verls_own(method):
    """verl's entropy bonus (entropy_coeff > 0) goes through the same agg_loss the adaptive loss replaces: it must
    stay verl's own, aggregated by loss_agg_mode (token-mean here, where length_normalized aggregates the KL
    seq-mean-token-mean) and with its gradient: verl's actor/entropy_loss and the entropy's gradient equal stock
    ppo_loss's, bit for bit."""
    batch = make_batch(seed=31, response_lengths=[5, 3, 8, 2, 6, 4, 7, 1])
    config = copy.deepcopy(actor_config("token-mean"))
    object.__setattr__(config, "entropy_coeff", 0.01)
    _, stock_grad, stock = _run_with_entropy(lambda **kw: ppo_loss(copy.deepcopy(config), **kw), batch)
    _, grad, ours = _run_with_entropy(adaptive(copy.deepcopy(config), method, kl_clip_threshold=0.3), batch,
                                      beta=config.kl_loss_coef)
    assert ours["actor/entropy_loss"].values == stock["actor/entropy_loss"].values
    assert stock_grad is not None and bool((stock_grad != 0).any())
    assert torch.equal(grad, stock_grad)


def test_verls_kl_loss_metric_keeps_its_stock_meaning_beside_an_estimator_and_length_normalized():
    """kl_estimator=k2 with length_normalized under loss_agg_mode=token-mean: the adapted term is aggregated
    seq-mean-token-mean, but verl's actor/kl_loss stays what stock verl logs: low_var_kl (kl_loss_type) aggregated
    token-mean (loss_agg_mode), whatever aggregation the adapted term takes."""
    batch = make_batch(seed=4, response_lengths=[5, 3, 8, 2, 6, 4, 7, 1])
    config = actor_config("token-mean")
    _, _, stock = run_loss(lambda **kw: ppo_loss(copy.deepcopy(config), **kw), batch, 2)
    _, _, ours = run_loss(adaptive(copy.deepcopy(config), "length_normalized", kl_estimator="k2"), batch, 2, beta=0.05)
    assert [m["kl_loss"].values for m in ours] == [m["kl_loss"].values for m in stock]


def test_a_nonfinite_reward_log_prob_names_the_step_of_the_batch():
    """The KL in the reward: a NaN in old_log_probs of the first batch penalised names step 1 (the batch's step, as
    the actor loss's error names its update's); after one batch penalised cleanly, the next batch's names step 2."""
    ctrl = verl_kl.RewardKLController(AdaptiveKLConfig(kl_adaptation_method="clip"), beta=0.1)
    data = reward_batch(seed=3)
    data.batch["old_log_probs"][1, 0] = math.nan
    with pytest.raises(NonFiniteLogProbError, match=r"at step 1: "):
        verl_kl.apply_adaptive_kl_penalty(data, ctrl, kl_penalty="kl")
    verl_kl.apply_adaptive_kl_penalty(reward_batch(seed=4), ctrl, kl_penalty="kl")
    data = reward_batch(seed=5)
    data.batch["old_log_probs"][1, 0] = math.nan
    with pytest.raises(NonFiniteLogProbError, match=r"at step 2: "):
        verl_kl.apply_adaptive_kl_penalty(data, ctrl, kl_penalty="kl")


def test_the_actor_updates_are_counted_so_the_second_ones_error_names_step_2():
    """Each actor update is one controller step: after a clean update (step 1), a NaN in the actor's forward on the
    second update is named at step 2 (the driver counts the updates the controller took)."""
    trainer, _ = actor_update(make_batch(seed=13), "token-mean", kl_adaptation_method="clip", kl_clip_threshold=0.3)
    trainer.actor_rollout_wg.shards = [with_policy_value(make_batch(seed=13), 2, 0, math.nan)]
    with pytest.raises(NonFiniteLogProbError, match=r"at step 2: .*verl's log_prob \(the actor's forward; the policy "
                                                    r"tensor\)"):
        trainer._update_actor(types.SimpleNamespace(extra_info={}), {})


def test_a_schedule_inherited_by_the_reward_is_named_with_the_block_that_set_it():
    """dynamic and beta_schedule_steps=5000 at the top of the block, the loss's KL off: the reward's controller takes
    them, and the schedule warning names adaptive_kl.beta_schedule_steps, where the user set it (not
    adaptive_kl.reward.beta_schedule_steps, a field the user never wrote)."""
    trainer = _SetUpTrainer(trainer_config(use_kl_loss=False, kl_adaptation_method="dynamic",
                                           beta_schedule_steps=5000))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer._setup()
    assert [str(w.message).split(" sets")[0] for w in caught] == ["adaptive_kl.beta_schedule_steps=5000"]


def test_a_percentile_scale_under_reward_is_refused_as_the_other_estimator_fields():
    """kl_percentile_scale tunes the loss's estimator (k3_bottom_percentile) alone: under adaptive_kl.reward it is
    refused as kl_estimator and kl_percentile are (verl's algorithm.kl_penalty is the reward's estimator), not
    accepted with a no-effect warning."""
    with pytest.raises(ValueError, match=r"^adaptive_kl\.reward\.kl_percentile_scale=2\.0 is not used with verl: the "
                                         r"estimator of the KL in the reward is verl's algorithm\.kl_penalty"):
        verl_kl.configs_from({"reward": {"kl_percentile_scale": 2.0}})


def test_unpatch_leaves_an_init_someone_set_after_the_patch():
    """unpatch() restores verl's own __init__ where it still holds ours; where someone else set the trainer's
    __init__ since (another package's patch), theirs stays: restoring verl's would undo it."""
    base = trainer_base.PPOTrainer
    ours = vars(base)["__init__"]
    verls = ours.__wrapped__

    def theirs(self, config, *args, **kwargs):
        return verls(self, config, *args, **kwargs)

    base.__init__ = theirs
    verl_kl.unpatch()
    try:
        assert vars(base)["__init__"] is theirs
    finally:
        base.__init__ = verls
        verl_kl.patch()
    assert vars(base)["__init__"].__wrapped__ is verls


def test_a_verl_trainer_subclass_keeps_its_other_bases_init_subclass():
    """The refusal is installed through PPOTrainer's __init_subclass__, which must hand on to the next class's in
    the MRO: a subclass mixing in a class with its own __init_subclass__ (a registry, say) still runs it."""
    from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

    seen = []

    class Registering:
        def __init_subclass__(cls, **kwargs):
            super().__init_subclass__(**kwargs)
            seen.append(cls.__name__)

    class Mine(PPOTrainerSync, Registering):
        pass

    assert seen == ["Mine"]


def test_the_loss_kls_verl_fields_are_not_checked_while_that_kl_is_off():
    """actor.kl_loss_type is read by verl only with use_kl_loss=True: with the loss's KL off (the KL in the reward
    alone) a kl_loss_type verl does not compute is not refused (verl never computes it)."""
    trainer = _GuardedTrainer(trainer_config(use_kl_loss=False, kl_loss_type="low_var"))
    assert trainer.loss_kl is None and trainer.reward_kl is not None


def test_an_algorithm_without_kl_penalty_takes_verls_default_log_ratio():
    """algorithm.kl_penalty left out reads as verl's default 'kl' (k1): neither refused nor warned about."""
    from unsloth_adaptive_kl import KLEstimatorWarning

    config = trainer_config()
    del config.algorithm["kl_penalty"]
    with warnings.catch_warnings():
        warnings.simplefilter("error", KLEstimatorWarning)
        assert _GuardedTrainer(config).reward_kl is not None


def test_at_a_coefficient_of_zero_a_reduction_is_said_once_as_turned_off():
    """kl_loss_coef = 0 with kl_reduction='token_mean' (which token-mean applies already): the one thing said is
    that the KL is off; 'already reduces the KL term that way' is not said beside it."""
    config = trainer_config(use_kl_in_reward=False, kl_reduction="token_mean")
    config.actor_rollout_ref.actor.kl_loss_coef = 0.0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _GuardedTrainer(config)
    assert [str(w.message) for w in caught if "no effect" in str(w.message)] == [
        "adaptive_kl.kl_reduction='token_mean' has no effect: actor_rollout_ref.actor.kl_loss_coef=0.0 turns the KL "
        "term off. Set actor_rollout_ref.actor.kl_loss_coef > 0 to regularise."]


def test_a_distillation_block_that_is_not_enabled_is_not_refused():
    """verl's own config always holds a distillation block (enabled: false): only distillation.enabled=True is
    refused beside the KL in the loss."""
    config = trainer_config(use_kl_in_reward=False)
    config.distillation = {"enabled": False}
    assert _GuardedTrainer(config).loss_kl is not None


# ----- from a mutation audit of verl.py's validation and messages: each test fails on a change the others let pass --


def test_a_reward_value_that_is_not_a_block_is_told_to_set_the_reward_blocks_fields() -> None:
    """`+adaptive_kl.reward=target` is refused naming adaptive_kl.reward, its value and how to set that block's own
    fields one by one (+adaptive_kl.reward.<field>=...), not the top-level block's."""
    with pytest.raises(ValueError) as raised:
        verl_kl.configs_from({"reward": "target"})
    assert str(raised.value) == ("adaptive_kl.reward='target' is invalid: allowed is a block of AdaptiveKLConfig's "
                                 "fields, set one by one (+adaptive_kl.reward.kl_adaptation_method=clip).")


def test_an_unparsable_top_level_method_is_named_at_the_top_when_reward_sets_its_own() -> None:
    """A method that cannot be parsed at the top of the block is named adaptive_kl.kl_adaptation_method (where the user
    wrote it), also when adaptive_kl.reward sets a kl_adaptation_method of its own."""
    with pytest.raises(ValueError) as raised:
        verl_kl.configs_from({"kl_adaptation_method": "clip+sigmoid", "reward": {"kl_adaptation_method": "clip"}})
    assert str(raised.value).startswith("adaptive_kl.kl_adaptation_method='clip+sigmoid' is invalid: allowed is ")


def test_kl_placement_and_an_unknown_field_under_reward_are_refused_naming_the_reward_block() -> None:
    """adaptive_kl.reward.kl_placement and an unknown field under reward are named with the reward block; the unknown
    field's error lists every field the block takes (AdaptiveKLConfig's, kl_placement aside, which is refused)."""
    with pytest.raises(ValueError) as raised:
        verl_kl.configs_from({"reward": {"kl_placement": "reward"}})
    assert str(raised.value).startswith("adaptive_kl.reward.kl_placement='reward' is not used with verl: the KL acts "
                                        "in the "
                                        "loss with actor_rollout_ref.actor.use_kl_loss=True and in the reward with "
                                        "algorithm.use_kl_in_reward=True")
    with pytest.raises(ValueError) as raised:
        verl_kl.configs_from({"reward": {"kl_clip": 1}})
    allowed = sorted(field.name for field in dataclasses.fields(AdaptiveKLConfig) if field.name != "kl_placement")
    assert str(raised.value) == (f"adaptive_kl.reward: unknown field(s) kl_clip; allowed are AdaptiveKLConfig's "
                                 f"fields: {', '.join(allowed)}.")


def test_a_parameter_sync_step_of_zero_is_refused_naming_it() -> None:
    """trainer.v1.sync.parameter_sync_step must be 1: 0 is refused as 2 is, naming the field, its value and 1."""
    config = trainer_config()
    config.trainer.v1.sync = {"parameter_sync_step": 0}
    with pytest.raises(ValueError) as raised:
        _GuardedTrainer(config)
    assert str(raised.value).startswith("trainer.v1.sync.parameter_sync_step=0 is invalid: allowed is 1 under "
                                        "trainer.v1.trainer_mode=adaptive_kl")


def test_the_reward_kls_kl_penalty_is_not_checked_while_that_kl_is_off() -> None:
    """algorithm.kl_penalty is read by verl only with use_kl_in_reward=True: with the KL in the reward off, a
    kl_penalty verl does not compute ('full') is not refused (it is, with the KL in the reward on)."""
    trainer = _GuardedTrainer(trainer_config(use_kl_in_reward=False, kl_penalty="full"))
    assert trainer.reward_kl is None and trainer.loss_kl is not None
    with pytest.raises(ValueError, match=r"^algorithm\.kl_penalty='full' is invalid: "):
        _GuardedTrainer(trainer_config(kl_penalty="full"))


def test_a_target_horizon_inherited_by_the_reward_is_refused_naming_the_top_level_field() -> None:
    """target and kl_horizon=1.2 at the top of the block with the loss's KL off: the reward's controller takes them,
    and the refusal names adaptive_kl.kl_horizon, where the user set it (not adaptive_kl.reward.kl_horizon)."""
    config = trainer_config(use_kl_loss=False, kl_adaptation_method="target", kl_horizon=1.2)
    config.data = {"train_batch_size": 3}
    config.actor_rollout_ref.rollout = {"n": 2}
    with pytest.raises(ValueError) as raised:
        _GuardedTrainer(config)
    assert str(raised.value).startswith("adaptive_kl.kl_horizon=1.2 is invalid for steps of 6 completions")
    assert str(raised.value).endswith("; here n is data.train_batch_size x actor_rollout_ref.rollout.n.")


@pytest.mark.parametrize("kl_loss_type", [1, None, b"k3"])
def test_a_kl_loss_type_that_is_not_a_name_is_refused_naming_verls_field(kl_loss_type: Any) -> None:
    """A kl_loss_type that is not a string (an int, None, bytes: verl's kl_penalty raises AttributeError or TypeError
    on it at the first update) is refused before training as an unknown name is: field, value, the allowed types."""
    config = trainer_config(use_kl_in_reward=False)
    config.actor_rollout_ref.actor.kl_loss_type = kl_loss_type
    with pytest.raises(ValueError) as raised:
        _GuardedTrainer(config)
    assert str(raised.value) == (f"actor_rollout_ref.actor.kl_loss_type={kl_loss_type!r} is invalid: allowed is kl, "
                                 "k1, abs, mse, k2, low_var_kl or k3, each also with a trailing '+' (verl's "
                                 "kl_penalty).")


def test_the_registered_adaptive_kl_trainer_is_not_refused_for_its_own_block(monkeypatch: Any) -> None:
    """verl's PPOTrainer.__init__ refuses an adaptive_kl block, but not under our registered trainer, whose block it
    is: AdaptiveKLPPOTrainer reaches verl's own __init__ (its first call, stubbed)."""
    monkeypatch.setattr(trainer_base, "build_checkpoint_callback", _reach)
    with pytest.raises(_Reached):
        verl_kl.AdaptiveKLPPOTrainer(trainer_config(kl_adaptation_method="clip"))


class _RecordingStub(_StubTrainer):
    """verl's trainer below the mixin, recording that its __init__ (where verl builds the run) was reached."""

    reached = False

    def __init__(self, config: Any) -> None:
        _RecordingStub.reached = True
        super().__init__(config)


class _RecordedTrainer(verl_kl.AdaptiveKLTrainerMixin, _RecordingStub):
    pass


def test_verls_settings_are_refused_before_verls_trainer_is_built() -> None:
    """A verl setting the run cannot train with (ppo_epochs=0, parameter_sync_step=2) is refused before verl's own
    trainer __init__ runs, not after it has built the run."""
    for setting in ("ppo_epochs", "sync"):
        config = trainer_config(use_kl_in_reward=False)
        if setting == "ppo_epochs":
            config.actor_rollout_ref.actor.ppo_epochs = 0
        else:
            config.trainer.v1.sync = {"parameter_sync_step": 2}
        _RecordingStub.reached = False
        with pytest.raises(ValueError, match=r"^(actor_rollout_ref\.actor\.ppo_epochs=0|trainer\.v1\.sync\."
                                             r"parameter_sync_step=2) is invalid"):
            _RecordedTrainer(config)
        assert not _RecordingStub.reached
    _RecordedTrainer(trainer_config(use_kl_in_reward=False))
    assert _RecordingStub.reached


@pytest.mark.parametrize(("methods", "warns"), [(("clip", "dynamic"), True), (("clip", "clip"), False)])
def test_a_missing_state_file_warns_where_one_kls_beta_moves_and_not_where_none_does(
        tmp_path: Any, monkeypatch: Any, methods: tuple[str, str], warns: bool) -> None:
    """A resume without adaptive_kl.json: the loss's clip keeps a constant beta, the reward's dynamic moves it; with
    one KL whose beta moves the missing file is said once, naming it; with none (clip for both) nothing is lost and
    nothing is said."""
    monkeypatch.chdir(tmp_path)
    config = trainer_config(kl_adaptation_method=methods[0], reward_threshold=0.0,
                            reward={"kl_adaptation_method": methods[1]})
    config.trainer.update({"resume_mode": "auto", "default_local_dir": "ckpt"})
    run = _CheckpointedTrainer(config)
    run.resumed_step = 1
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run._load_checkpoint()
    missing = os.path.join(str(tmp_path), "ckpt", "global_step_1", verl_kl.STATE_FILE)
    said = [f"adaptive_kl: {missing} is missing: the controllers restart from their initial beta."] if warns else []
    assert [str(w.message) for w in caught] == said


def test_a_field_set_to_its_default_value_is_not_refused_as_doing_nothing() -> None:
    """A field written out at AdaptiveKLConfig's default changes nothing, and is not refused: kl_percentile=0.2 under
    reward (a loss-only field), beta_min=0.0 under reward with the KL in the reward off, kl_clip_threshold=1.0 at the
    top with the loss's KL off, each value as verl's config parses it from the command line."""
    from omegaconf import OmegaConf

    def parsed(dotlist: list[str], **switches: bool) -> Any:
        config = trainer_config(**switches)
        return OmegaConf.merge(config, OmegaConf.from_dotlist(dotlist))

    assert verl_kl.configs_from(OmegaConf.from_dotlist(["reward.kl_percentile=0.2"]))[1].kl_percentile == 0.2
    assert _GuardedTrainer(parsed(["adaptive_kl.reward.beta_min=0.0"], use_kl_in_reward=False)).reward_kl is None
    assert _GuardedTrainer(parsed(["adaptive_kl.kl_clip_threshold=1.0"], use_kl_loss=False)).loss_kl is None


def test_the_horizon_is_checked_only_for_a_target_kl_that_is_on() -> None:
    """n = data.train_batch_size x rollout.n. With the loss's KL off, target and kl_horizon=1.2 at the top and
    reward.beta_min=0.05 (n = 6): the reward's controller, the one KL on, can leave 0 (beta_min > 0) and is built; the
    loss's config, off, is not checked. clip for both KLs at n = 10000 x 5 (n / 5 = kl_horizon's default 10000): no
    target, no horizon to check."""
    config = trainer_config(use_kl_loss=False, kl_adaptation_method="target", kl_horizon=1.2, reward={"beta_min": 0.05})
    config.data = {"train_batch_size": 3}
    config.actor_rollout_ref.rollout = {"n": 2}
    trainer = _GuardedTrainer(config)
    assert trainer.loss_kl is None and (trainer.reward_kl.config.kl_horizon, trainer.reward_kl.config.beta_min) == (
        1.2, 0.05)
    config = trainer_config(kl_adaptation_method="clip")
    config.data = {"train_batch_size": 10000}
    config.actor_rollout_ref.rollout = {"n": 5}
    trainer = _GuardedTrainer(config)
    assert trainer.loss_kl is not None and trainer.reward_kl is not None


def test_without_verls_rollout_n_the_horizon_is_not_checked() -> None:
    """data.train_batch_size set and actor_rollout_ref.rollout.n left out: n is unknown before training, so the
    horizon is not checked (the core checks it at the first step), and the trainer is built."""
    config = trainer_config(use_kl_loss=False, reward={"kl_adaptation_method": "target"})
    config.data = {"train_batch_size": 3}
    config.actor_rollout_ref.rollout = {}
    assert _GuardedTrainer(config).reward_kl.config.kl_methods == ("target",)


def test_a_distillation_block_without_enabled_is_not_refused() -> None:
    """verl's distillation.enabled defaults to False: a distillation block that leaves it out is not enabled, and is
    not refused beside the KL in the loss."""
    config = trainer_config(use_kl_in_reward=False)
    config.distillation = {"teacher": "none"}
    assert _GuardedTrainer(config).loss_kl is not None


@pytest.mark.parametrize(("use_kl_loss", "use_kl_in_reward", "said"), [
    (True, False, 0), (False, True, 0), (True, True, 0), (False, False, 1)])
def test_there_is_no_kl_to_adapt_is_said_only_with_both_kls_off(use_kl_loss: bool, use_kl_in_reward: bool,
                                                                said: int) -> None:
    """'neither ... is on: there is no KL to adapt' is said once with both KLs off, and not with either on."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _GuardedTrainer(trainer_config(use_kl_loss=use_kl_loss, use_kl_in_reward=use_kl_in_reward))
    assert [str(w.message) for w in caught if "there is no KL to adapt" in str(w.message)] == [
        "adaptive_kl: neither actor_rollout_ref.actor.use_kl_loss nor algorithm.use_kl_in_reward is on: there is no "
        "KL to adapt."] * said


@pytest.mark.parametrize("kind", ["pid", "adaptive"])
def test_a_kl_ctrl_type_is_refused_before_verls_trainer_reads_it(monkeypatch: Any, kind: str) -> None:
    """verl's PPOTrainer.__init__ builds its reward controller from algorithm.kl_ctrl, and stops on a type it lacks
    with a bare NotImplementedError (and on an adaptive horizon <= 0 with an AssertionError). The mixin refuses every
    type but 'fixed', naming the field, before verl's __init__ runs (its first call, stubbed, is not reached); so is
    distillation beside the KL in the loss."""
    config = trainer_config(kl_adaptation_method="clip")
    config.algorithm.kl_ctrl.type, config.algorithm.kl_ctrl.horizon = kind, 0
    with pytest.raises(NotImplementedError if kind == "pid" else AssertionError):
        core_algos.get_kl_controller(config.algorithm.kl_ctrl)
    monkeypatch.setattr(trainer_base, "build_checkpoint_callback", _reach)
    with pytest.raises(ValueError, match=rf"^algorithm\.kl_ctrl\.type='{kind}' is invalid with trainer\.v1\."
                                         r"trainer_mode=adaptive_kl and algorithm\.use_kl_in_reward=True: allowed is "
                                         r"'fixed'\."):
        verl_kl.AdaptiveKLPPOTrainer(config)
    config = trainer_config(kl_adaptation_method="clip")
    config.distillation = {"enabled": True}
    with pytest.raises(ValueError, match=r"^distillation\.enabled=True is invalid with actor_rollout_ref\.actor\."
                                         r"use_kl_loss=True"):
        verl_kl.AdaptiveKLPPOTrainer(config)
