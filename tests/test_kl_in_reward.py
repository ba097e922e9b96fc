"""kl_placement="reward" with TRL's GRPOTrainer (SPEC 3.9): each completion's reward becomes r_i - beta_t * KL_i before
the group statistics and advantages; the KL loss term is off; controllers act on that beta."""

from __future__ import annotations

import contextlib
import json
import math
import re
import warnings
from typing import Any, Callable

import pytest
import torch

import trl

from unsloth_adaptive_kl import AdaptiveKLConfig, KLEstimatorWarning

from .conftest import constant_reward, hash_reward, logged, make_trainer
from .test_trl_loss import TIMING_KEYS, policy_logps, run_and_params

REWARD = dict(kl_placement="reward", gradient_accumulation_steps=1)


def expected_advantages(rewards: torch.Tensor, kl: torch.Tensor, beta: float, group: int, scale_rewards: str) -> torch.Tensor:
    """GRPO's advantages of the penalised rewards p_i = r_i - beta * KL_i, written out: p_i minus its group's mean,
    divided by (std + 1e-4) with the unbiased std of its group ('group') or of the whole batch ('batch'), or not
    divided ('none')."""
    penalised = (rewards - beta * kl).double()
    groups = penalised.view(-1, group)
    centred = (groups - groups.mean(1, keepdim=True)).reshape(-1)
    if scale_rewards == "none":
        return centred
    std = groups.std(1).repeat_interleave(group) if scale_rewards == "group" else penalised.std().expand_as(penalised)
    return centred / (std + 1e-4)


def completion_kl_by_hand(logp: torch.Tensor, ref: torch.Tensor, mask: torch.Tensor, reduction: str,
                          estimator: str = "k1") -> torch.Tensor:
    """KL_i = sum_t m (logp - ref) (k1, the reward placement's default, SPEC 3.12), or with estimator='k3'
    sum_t m (exp(ref - logp) - (ref - logp) - 1); divided by L_i for 'sequence_mean'."""
    delta = (ref - logp).double()
    per_token = -delta if estimator == "k1" else torch.exp(delta) - delta - 1
    sums = (per_token * mask).sum(-1)
    return sums / mask.sum(-1).clamp(min=1) if reduction == "sequence_mean" else sums


def k3_in_the_reward() -> Any:
    """k3 named with the KL in the reward warns when the config is built (SPEC 3.12: it does not regularise there)."""
    return pytest.warns(KLEstimatorWarning, match=r"^kl_estimator='k3' with kl_placement='reward': a KL in the reward "
                                                  r"must be the log-ratio")


def recording(reward: Callable[..., list[float]], seen: list[float]) -> Callable[..., list[float]]:
    def recorded(completions: list[str], **kwargs: Any) -> list[float]:
        values = reward(completions, **kwargs)
        seen.extend(values)
        return values

    recorded.__name__ = reward.__name__
    return recorded


def perturb_adapters(model: Any, scale: float = 0.3) -> None:
    """LoRA starts with B = 0 (policy == reference, KL 0): random B makes the KL visible from the first batch."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * scale)


def plain_policy_logps(trainer: Any, batch: dict) -> torch.Tensor:
    return policy_logps(trainer.model, batch)


def scored_batch(trainer: Any, logps: Callable[[Any, dict], torch.Tensor] = plain_policy_logps) -> dict:
    """The first generation batch as `_generate_and_score_completions` returns it, with the policy's log-probs taken
    right then (before any optimizer step), by default from a plain forward pass."""
    upstream = trainer._generate_and_score_completions
    captured: dict = {}

    def capture(*args: Any, **kwargs: Any) -> dict:
        output = upstream(*args, **kwargs)
        if not captured:
            captured.update(output)
            with torch.no_grad():
                captured["policy_logps"] = logps(trainer, output)
        return output

    trainer._generate_and_score_completions = capture
    trainer.train()
    del trainer._generate_and_score_completions
    return captured


@pytest.mark.parametrize(("scale_rewards", "reduction", "estimator", "weight"),
                         [("group", "sequence_sum", None, 1.0), ("batch", "sequence_sum", None, 1.0),
                          ("none", "sequence_sum", None, 1.0), ("group", "sequence_mean", None, 1.0),
                          ("group", "loss_type", None, 1.0), ("group", "sequence_sum", "k3", 1.0),
                          ("none", "sequence_sum", None, 2.0)])
def test_advantages_are_the_formula_of_penalised_rewards(tokenizer, tmp_path, scale_rewards: str, reduction: str,
                                                         estimator: Any, weight: float) -> None:
    """GRPOConfig(kl_placement="reward") penalises each completion by beta * its summed k1 (logp - ref, the
    placement's default: SPEC 3.12) computed by hand from the trainer's policy and reference log-probs of the batch;
    k3 named explicitly warns and penalises by the summed k3. The reward function's weight (`reward_weights`) scales
    its rewards, not the penalty: with weight 2 the penalty column weighed 2 would double it."""
    rewards: list[float] = []
    beta = 0.5
    with k3_in_the_reward() if estimator == "k3" else contextlib.nullcontext():
        trainer = make_trainer(tokenizer, str(tmp_path), recording(hash_reward, rewards), per_device_train_batch_size=8,
                               max_steps=1, beta=beta, scale_rewards=scale_rewards, kl_reduction=reduction,
                               kl_estimator=estimator, reward_weights=[weight], **REWARD)
    assert trainer.adaptive_kl.config.estimator == (estimator or "k1")
    perturb_adapters(trainer.model)
    batch = scored_batch(trainer)
    r = weight * torch.tensor(rewards[:8], dtype=torch.float64)
    logps, ref, mask = batch["policy_logps"], batch["ref_per_token_logps"], batch["completion_mask"]
    kl = completion_kl_by_hand(logps, ref, mask, reduction, estimator or "k1")
    expected = expected_advantages(r, kl, beta, group=4, scale_rewards=scale_rewards)
    unpenalised = expected_advantages(r, torch.zeros_like(kl), beta, group=4, scale_rewards=scale_rewards)
    # float32 log-probs through two paths (TRL's and a plain forward): ~1e-6 per token, amplified by 1/std
    assert batch["advantages"].double() == pytest.approx(expected.tolist(), abs=2e-4)
    assert (expected - unpenalised).abs().max() > 0.05  # the penalty really moves the advantages
    # every completion carries a KL (k1's may have either sign): its penalty, beta * KL_i >= 5e-4, moves its advantage
    # by more than the 2e-4 above, so a penalty left off any one completion fails the formula (0.005 here failed on
    # torch 2.6's samples: a sequence mean of 0.0046)
    assert kl.abs().min() > 1e-3
    if estimator is None:  # k1 is not k3: the hand formula tells the two apart on this batch
        k3 = completion_kl_by_hand(logps, ref, mask, reduction, "k3")
        assert (expected - expected_advantages(r, k3, beta, group=4, scale_rewards=scale_rewards)).abs().max() > 0.05
    assert logged(trainer, "adaptive_kl/reward_penalty")[0] == pytest.approx(beta * kl.mean().item(), rel=1e-4)
    assert logged(trainer, "adaptive_kl/raw_kl")[0] == pytest.approx(kl.mean().item(), rel=1e-4)
    summed = completion_kl_by_hand(logps, ref, mask, "sequence_sum", estimator or "k1")
    assert logged(trainer, "adaptive_kl/sequence_kl")[0] == pytest.approx(summed.mean().item(), rel=1e-4)
    assert logged(trainer, "reward")[0] == pytest.approx(r.mean().item(), abs=1e-6)  # the stock metric: un-penalised
    assert logged(trainer, "adaptive_kl/current_beta") == [beta]


def replays(monkeypatch) -> list[int]:
    """Counts the extra no-grad policy forwards (the reference forward replayed with the policy)."""
    from unsloth_adaptive_kl.integrations.trainer_hooks import _CallRecorder

    calls: list[int] = []
    upstream = _CallRecorder.replay_with

    def counted(self: Any, model: Any, missing: Any) -> torch.Tensor:
        calls.append(1)
        return upstream(self, model, missing)

    monkeypatch.setattr(_CallRecorder, "replay_with", counted)
    return calls


def test_one_extra_forward_per_generation_batch_without_old_logps(tokenizer, tmp_path, monkeypatch) -> None:
    calls = replays(monkeypatch)
    trainer = make_trainer(tokenizer, str(tmp_path), max_steps=3, **REWARD)
    trainer.train()
    assert len(calls) == 3  # one generation batch per step (steps_per_generation = GA = 1)


def test_the_trainers_old_logps_are_used_where_it_computes_them(tokenizer, tmp_path, monkeypatch) -> None:
    """num_iterations=2: TRL computes old log-probs at generation; the penalty uses them, with no extra forward."""
    calls = replays(monkeypatch)
    rewards: list[float] = []
    trainer = make_trainer(tokenizer, str(tmp_path), recording(hash_reward, rewards), per_device_train_batch_size=8,
                           max_steps=1, beta=0.5, num_iterations=2, kl_reduction="sequence_sum", **REWARD)
    perturb_adapters(trainer.model)
    batch = scored_batch(trainer, lambda trainer, batch: batch["old_per_token_logps"])
    assert calls == []
    kl = completion_kl_by_hand(batch["policy_logps"], batch["ref_per_token_logps"], batch["completion_mask"],
                               "sequence_sum")
    expected = expected_advantages(torch.tensor(rewards[:8], dtype=torch.float64), kl, 0.5, 4, "group")
    assert batch["advantages"].double() == pytest.approx(expected.tolist(), abs=1e-5)  # the very same log-probs


@pytest.mark.parametrize(("method", "reduction"), [("none", "sequence_sum"), ("clip", "sequence_sum"),
                                                  ("sigmoid", "sequence_mean"), ("dynamic", "loss_type")])
def test_adaptive_kl_reward_penalty_is_what_the_trainer_subtracts(tokenizer, tmp_path, method: str,
                                                                  reduction: str) -> None:
    """SPEC 3.11: the public AdaptiveKL's reward_penalty on the trainer's log-probs (num_iterations=2: the old
    log-probs the trainer computes) is the penalty the trainer subtracts, and its metrics are the ones logged."""
    from unsloth_adaptive_kl import AdaptiveKL

    rewards: list[float] = []
    settings = dict(kl_adaptation_method=method, kl_reduction=reduction, kl_clip_threshold=0.05, kl_target=0.05)
    trainer = make_trainer(tokenizer, str(tmp_path), recording(hash_reward, rewards), per_device_train_batch_size=8,
                           max_steps=1, beta=0.5, num_iterations=2, **settings, **REWARD)
    perturb_adapters(trainer.model)
    batch = scored_batch(trainer, lambda trainer, batch: batch["old_per_token_logps"])
    akl = AdaptiveKL(AdaptiveKLConfig(kl_placement="reward", **settings), 0.5)
    penalty = akl.reward_penalty(batch["policy_logps"], batch["ref_per_token_logps"], batch["completion_mask"].float())[0]
    expected = expected_advantages(torch.tensor(rewards[:8], dtype=torch.float64), penalty.double() / 0.5, 0.5, 4,
                                   "group")
    assert batch["advantages"].double() == pytest.approx(expected.tolist(), abs=1e-5)
    for name, value in akl.last_metrics.items():
        if math.isnan(value):  # length_kl_corr with every completion of one length; trl logs an all-NaN mean as None
            assert logged(trainer, name)[0] is None, name
        else:
            assert logged(trainer, name)[0] == pytest.approx(value, rel=1e-6), name


def test_policy_logps_prefer_old_then_vllm_sampling_then_one_replayed_forward() -> None:
    """The source order of the policy log-probs for KL_i: the trainer's old log-probs, else vLLM's sampling log-probs
    (no vLLM on CPU, so the choice is exercised here with stand-in tensors), else the reference forward replayed with
    the policy, without gradient, whether the model was passed by position or keyword; a generation that made no
    log-prob call is reported, not replayed from nothing."""
    from unsloth_adaptive_kl.integrations.trainer_hooks import _CallRecorder, _policy_logps

    class Trainer:
        model = "policy"

    forwards: list[tuple] = []
    recorder = _CallRecorder(lambda model, ids: (torch.full((1, 2), float(len(forwards))),
                                                 forwards.append((model, ids, torch.is_grad_enabled()))))
    old, sampling = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-3.0, -4.0]])

    def missing() -> Exception:
        return RuntimeError("no reference forward")

    assert _policy_logps(Trainer(), {"old_per_token_logps": old, "sampling_per_token_logps": sampling}, recorder,
                         missing) is old
    assert _policy_logps(Trainer(), {"old_per_token_logps": None, "sampling_per_token_logps": sampling}, recorder,
                         missing) is sampling
    with pytest.raises(RuntimeError, match="no reference forward"):
        _policy_logps(Trainer(), {"old_per_token_logps": None, "sampling_per_token_logps": None}, recorder, missing)
    recorder("reference", "ids-1")
    recorder("reference", "ids-2")  # the last call is the one replayed
    replayed = _policy_logps(Trainer(), {"old_per_token_logps": None, "sampling_per_token_logps": None}, recorder,
                             missing)
    assert forwards[-1] == ("policy", "ids-2", False) and replayed.tolist() == [[2.0, 2.0]] and len(forwards) == 3
    recorder(model="reference", ids="ids-3")  # called by keyword: the policy replaces the keyword's model
    replayed = _policy_logps(Trainer(), {"old_per_token_logps": None, "sampling_per_token_logps": None}, recorder,
                             missing)
    assert forwards[-1] == ("policy", "ids-3", False) and replayed.tolist() == [[4.0, 4.0]]


def test_a_nan_log_prob_on_a_valid_token_raises_before_the_rewards_are_penalised(tokenizer, tmp_path,
                                                                                 monkeypatch) -> None:
    """Never a silent zero in the reward (issue 27 item 6): a NaN log-prob on a valid token (here from every log-prob
    forward, so the reference's and the replayed policy's) stops scoring, naming the tensors and the count."""
    from unsloth_adaptive_kl import NonFiniteLogProbError

    trainer = make_trainer(tokenizer, str(tmp_path), max_steps=1, **REWARD)
    stock = trainer._get_per_token_logps_and_entropies

    def nan_on_the_first_token(*args, **kwargs):
        logps, *rest = stock(*args, **kwargs)
        logps = logps.clone()
        logps[0, 0] = math.nan  # every completion's first token is valid
        return (logps, *rest)

    monkeypatch.setattr(trainer, "_get_per_token_logps_and_entropies", nan_on_the_first_token)
    with pytest.raises(NonFiniteLogProbError, match=r"non-finite input at step 1: .*policy log-probs \(a policy "
                                                    r"forward\): 1 valid token\(s\) on process 0; "
                                                    r"reference log-probs \(ref_per_token_logps\): 1 valid token"):
        trainer.train()


def test_evaluation_scores_with_the_penalty_and_logs_it(tokenizer, tmp_path) -> None:
    from datasets import Dataset

    from .conftest import PROMPTS

    trainer = make_trainer(tokenizer, str(tmp_path), max_steps=1, beta=0.5, kl_adaptation_method="dynamic", **REWARD)
    trainer.eval_dataset = Dataset.from_dict({"prompt": PROMPTS[:4]})
    perturb_adapters(trainer.model)
    metrics = trainer.evaluate()
    assert metrics["eval_adaptive_kl/reward_penalty"] == pytest.approx(
        metrics["eval_adaptive_kl/current_beta"] * metrics["eval_adaptive_kl/adapted_kl"], rel=1e-5)
    assert abs(metrics["eval_adaptive_kl/reward_penalty"]) > 0.005  # k1's mean over 4 completions: either sign
    assert trainer.current_beta == 0.5  # evaluation never moves the controller
    trainer.train()  # the step's KL (last_raw_kl) is its own batch's, without the evaluation batch scored before it
    # its token mean sum_i S_i / sum_i L_i: the batch's mean KL per completion over its mean length
    token_mean = logged(trainer, "adaptive_kl/sequence_kl")[0] / logged(trainer, "completions/mean_length")[0]
    assert trainer.adaptive_kl.last_raw_kl == pytest.approx(token_mean, rel=1e-5)


def test_unscored_completions_stay_unscored(tokenizer, tmp_path) -> None:
    """A completion no reward function scored (None) gets no penalty either: advantage 0, and its group's statistics
    come from the scored completions only."""
    rewards: list[float] = []

    def partly_unscored(completions: list[str], **kwargs: Any) -> list[Any]:
        return [None if index % 4 == 0 else value for index, value in enumerate(hash_reward(completions))]

    trainer = make_trainer(tokenizer, str(tmp_path), recording(partly_unscored, rewards), per_device_train_batch_size=8,
                           max_steps=1, beta=0.5, kl_reduction="sequence_sum", **REWARD)
    perturb_adapters(trainer.model)
    batch = scored_batch(trainer)
    kl = completion_kl_by_hand(batch["policy_logps"], batch["ref_per_token_logps"], batch["completion_mask"],
                               "sequence_sum")
    expected = torch.zeros(8, dtype=torch.float64)
    for group in range(2):
        scored = [group * 4 + i for i in (1, 2, 3)]
        penalised = torch.tensor([rewards[i] for i in scored], dtype=torch.float64) - 0.5 * kl[scored]
        expected[scored] = (penalised - penalised.mean()) / (penalised.std() + 1e-4)
    assert batch["advantages"].double() == pytest.approx(expected.tolist(), abs=2e-4)
    assert batch["advantages"][[0, 4]].tolist() == [0.0, 0.0]


def test_a_masked_truncated_completion_carries_its_groups_mean_penalty(tokenizer, tmp_path) -> None:
    """mask_truncated_completions=True zeroes a truncated completion's mask (its KL is unknown), while its reward still
    enters its group's statistics. It carries the mean penalty of its group's completions that have tokens, so under a
    constant reward and scale_rewards='none' the trained completions' advantages sum to 0 in every group (penalised 0,
    it would lower each by its share of their mean penalty: a push towards truncation)."""
    trainer = make_trainer(tokenizer, str(tmp_path), constant_reward(1.0), per_device_train_batch_size=8, max_steps=1,
                           beta=0.5, scale_rewards="none", mask_truncated_completions=True, max_completion_length=4,
                           **REWARD)
    perturb_adapters(trainer.model)
    model, eos = trainer.model.get_base_model(), tokenizer.eos_token_id
    generate = model.generate

    def ending_often(*args: Any, **kwargs: Any) -> Any:
        """In sampling only, EOS +8 on its logit in even rows (they end: at their first token, on torch 2.6 and 2.14
        alike) and -1e4 in odd rows (never: truncated at 4 tokens), so that every group holds both kinds whatever
        torch's sampling draws: with +4 in every row, torch 2.6's draws ended all 8 completions."""
        def eos_shift(module: Any, inputs: Any, output: torch.Tensor) -> torch.Tensor:
            shift = torch.where(torch.arange(output.size(0)) % 2 == 0, 8.0, -1e4).to(output.dtype)
            return output + shift.view(-1, *[1] * (output.dim() - 1)) * torch.nn.functional.one_hot(
                torch.tensor(eos), output.size(-1)).to(output.dtype)

        hook = model.get_output_embeddings().register_forward_hook(eos_shift)
        try:
            return generate(*args, **kwargs)
        finally:
            hook.remove()

    model.generate = ending_often  # in every group, two completions end and two are truncated at 4 tokens
    batch = scored_batch(trainer)
    mask = batch["completion_mask"]
    lengths = mask.sum(1).view(2, 4)
    assert ((lengths == 0).any(1) & (lengths > 0).any(1)).any()  # a group with both kinds: the case under test
    kl = completion_kl_by_hand(batch["policy_logps"], batch["ref_per_token_logps"], mask, "sequence_sum").view(2, 4)
    has = lengths > 0
    mean = (kl * has).sum(1, keepdim=True) / has.sum(1, keepdim=True).clamp(min=1)
    imputed = torch.where(has, kl, mean).view(-1)
    expected = expected_advantages(torch.ones(8, dtype=torch.float64), imputed, 0.5, group=4, scale_rewards="none")
    assert batch["advantages"].double() == pytest.approx(expected.tolist(), abs=1e-5)
    trained = batch["advantages"].double().view(2, 4) * has
    assert trained.sum(1).tolist() == pytest.approx([0.0, 0.0], abs=1e-5)
    assert kl[has].abs().min() > 0.005  # the trained completions carry a KL: the sums are 0 by the rule, not by chance
    # the metrics count the completions that have tokens alone
    assert logged(trainer, "adaptive_kl/reward_penalty")[0] == pytest.approx(0.5 * kl[has].mean().item(), rel=1e-4)


@pytest.mark.parametrize("estimator", [None, "k3"])
def test_clip_shapes_each_token_before_the_completion_sum(tokenizer, tmp_path, estimator: Any) -> None:
    """KL_i = sum_t m min(k, 0.05): k the log-ratio k1 by default, k3 when named (with its warning)."""
    rewards: list[float] = []
    with k3_in_the_reward() if estimator == "k3" else contextlib.nullcontext():
        trainer = make_trainer(tokenizer, str(tmp_path), recording(hash_reward, rewards), per_device_train_batch_size=8,
                               max_steps=1, beta=0.5, kl_adaptation_method="clip", kl_clip_threshold=0.05,
                               kl_reduction="sequence_sum", kl_estimator=estimator, **REWARD)
    perturb_adapters(trainer.model)
    batch = scored_batch(trainer)
    delta = (batch["ref_per_token_logps"] - batch["policy_logps"]).double()
    k = torch.exp(delta) - delta - 1 if estimator == "k3" else -delta
    mask = batch["completion_mask"]
    clipped = (torch.clamp(k, max=0.05) * mask).sum(-1)
    assert (k * mask).sum(-1).sub(clipped).max() > 0.05  # the threshold binds
    expected = expected_advantages(torch.tensor(rewards[:8], dtype=torch.float64), clipped, 0.5, 4, "group")
    assert batch["advantages"].double() == pytest.approx(expected.tolist(), abs=2e-4)
    assert logged(trainer, "adaptive_kl/adapted_kl")[0] == pytest.approx(clipped.mean().item(), rel=1e-4)
    assert logged(trainer, "adaptive_kl/raw_kl")[0] == pytest.approx((k * mask).sum(-1).mean().item(), rel=1e-4)


def test_loss_has_no_kl_term_and_keeps_the_stock_kl_metric(tokenizer, tmp_path) -> None:
    """With the KL in the reward the loss is the stock loss at beta=0 on the same inputs; `kl` is still logged."""
    trainer = make_trainer(tokenizer, str(tmp_path), max_steps=1, beta=0.5, **REWARD)
    perturb_adapters(trainer.model)
    batch = scored_batch(trainer)
    inputs = {key: value for key, value in batch.items() if key != "policy_logps"}
    trainer.model.train()
    loss = trainer._compute_loss(trainer.model, dict(inputs))
    trainer.beta = 0.0
    without_kl = trainer._compute_loss(trainer.model, dict(inputs))
    trainer.beta = 0.5
    assert loss.item() == pytest.approx(without_kl.item(), rel=1e-6, abs=1e-8)
    assert trainer._metrics["train"]["kl"][-1] > 0.01


def test_loss_placement_is_stock_over_a_real_run(tokenizer, tmp_path) -> None:
    """kl_placement='loss' (the default) logs what stock TRL logs and ends with the same weights."""
    from unsloth_adaptive_kl.tools.selfcheck import stock_trl

    patched_log, patched_params = run_and_params(tokenizer, str(tmp_path / "patched"), kl_placement="loss")
    with stock_trl():
        stock_log, stock_params = run_and_params(tokenizer, str(tmp_path / "stock"))
    for patched, stock in zip(patched_log, stock_log, strict=True):
        for key in set(stock) - TIMING_KEYS:
            assert patched[key] == pytest.approx(stock[key], rel=1e-6, abs=1e-6), key
    for name, value in stock_params.items():
        torch.testing.assert_close(patched_params[name], value, rtol=0, atol=1e-6)


def test_the_reward_placement_at_beta_0_warns_once_and_trains_as_stock(tokenizer, tmp_path) -> None:
    """beta 0 computes no reference log-probs, so there is no KL to put in the rewards: the reward placement warns
    that it has no effect and trains as stock TRL at beta 0 (same weights), logging no adaptive_kl metric."""
    from unsloth_adaptive_kl.tools.selfcheck import stock_trl

    off = r"^kl_placement='reward' has no effect: beta=0\.0 turns the KL term off"
    with pytest.warns(UserWarning, match=off) as said:
        patched_log, patched_params = run_and_params(tokenizer, str(tmp_path / "patched"), beta=0.0, max_steps=2,
                                                     **REWARD)
    assert sum(bool(re.match(off, str(warning.message))) for warning in said) == 1
    with stock_trl():
        stock_log, stock_params = run_and_params(tokenizer, str(tmp_path / "stock"), beta=0.0, max_steps=2,
                                                 gradient_accumulation_steps=1)
    assert len(patched_log) == len(stock_log) == 3
    assert not any(key.startswith("adaptive_kl/") for entry in patched_log for key in entry)
    for name, value in stock_params.items():
        assert torch.equal(patched_params[name], value), name


def test_dynamic_reads_the_unpenalised_reward(tokenizer, tmp_path) -> None:
    """Rewards 0.81 > 0.8 every batch while the penalty takes the penalised mean below 0.8: beta still decays."""
    trainer = make_trainer(tokenizer, str(tmp_path), constant_reward(0.81), max_steps=3, beta=1.0,
                           kl_adaptation_method="dynamic", dynamic_beta_decay=0.5, kl_reduction="sequence_sum", **REWARD)
    perturb_adapters(trainer.model)
    trainer.train()
    penalties = logged(trainer, "adaptive_kl/reward_penalty")
    assert max(0.81 - penalty for penalty in penalties) < 0.8  # the penalised mean is below the threshold every step
    assert logged(trainer, "reward") == pytest.approx([0.81] * 3, abs=1e-6)
    assert logged(trainer, "adaptive_kl/current_beta") == pytest.approx([1.0, 0.5, 0.25])
    assert trainer.current_beta == pytest.approx(0.125)


def test_target_reads_the_measured_kl(tokenizer, tmp_path) -> None:
    """Ziegler et al.'s controller once per generation batch, n = its 4 completions, on the summed KL per completion."""
    from .test_dynamic_beta import expected_target_betas

    trainer = make_trainer(tokenizer, str(tmp_path), max_steps=5, beta=0.2, kl_adaptation_method="target",
                           kl_target=0.5, kl_horizon=10.0, kl_target_measure="sequence_sum", **REWARD)
    perturb_adapters(trainer.model, scale=0.1)
    trainer.train()
    measured, betas = logged(trainer, "adaptive_kl/sequence_kl"), logged(trainer, "adaptive_kl/current_beta")
    assert betas == pytest.approx(expected_target_betas(measured, 0.2, 0.5, 10.0, 4, 0.0, math.inf), rel=1e-9)
    assert len(set(betas)) == 5


def test_resume_restores_beta(tokenizer, tmp_path) -> None:
    settings = dict(max_steps=6, beta=0.04, kl_adaptation_method="dynamic", dynamic_beta_decay=0.8,
                    save_strategy="steps", save_steps=3, model_kind="peft_config", **REWARD)
    full = make_trainer(tokenizer, str(tmp_path / "full"), constant_reward(1.0), **settings)
    full.train()
    checkpoint = tmp_path / "full" / "checkpoint-3"
    assert json.loads((checkpoint / "adaptive_kl_state.json").read_text())["value"] == pytest.approx(0.04 * 0.8**3)
    resumed = make_trainer(tokenizer, str(tmp_path / "resumed"), constant_reward(1.0), **settings)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert logged(resumed, "adaptive_kl/current_beta")[-3:] == pytest.approx([0.04 * 0.8**k for k in range(3, 6)])
    assert resumed.current_beta == pytest.approx(full.current_beta, rel=1e-12) == pytest.approx(0.04 * 0.8**6)


@pytest.mark.parametrize(("fields", "named", "allowed"), [
    (dict(kl_placement="middle"), "kl_placement='middle'", "one of loss, reward"),
    (dict(kl_adaptation_method="length_normalized"), "kl_adaptation_method='length_normalized'", "kl_placement='reward'"),
    (dict(kl_reduction="token_mean"), "kl_reduction='token_mean'", "kl_placement='reward'"),
    (dict(multi_objective_aggregation="normalize_then_sum"), "multi_objective_aggregation='normalize_then_sum'",
     "'sum_then_normalize' with kl_placement='reward'"),
])
def test_bad_combinations_are_rejected_at_config_time(tmp_path, fields: dict, named: str, allowed: str) -> None:
    settings = {"kl_placement": "reward", "output_dir": str(tmp_path), "use_cpu": True, **fields}
    with pytest.raises(ValueError) as error:
        trl.GRPOConfig(**settings)
    assert str(error.value).startswith(named + " is invalid") and allowed in str(error.value)


def test_placement_field_round_trips_and_means_nothing_stock(tmp_path) -> None:
    config = trl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, kl_placement="reward", kl_reduction="sequence_mean")
    assert config.to_dict()["kl_placement"] == "reward" and not config.is_stock_kl
    assert config.estimator == "k1" and config.to_dict()["kl_estimator"] is None
    assert AdaptiveKLConfig().kl_placement == "loss" and AdaptiveKLConfig().is_stock_kl
    # the aggregation rule is the reward placement's: with the KL in the loss, TRL's other aggregation is accepted
    loss_side = trl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, kl_adaptation_method="clip",
                               multi_objective_aggregation="normalize_then_sum")
    assert loss_side.multi_objective_aggregation == "normalize_then_sum"


@pytest.mark.parametrize("estimator", ["k2", "k3", "low_var_kl", "k3+", "k3_bottom_percentile"])
def test_a_k3_family_estimator_in_the_reward_warns_from_grpo_config_and_trainer(tokenizer, tmp_path,
                                                                               estimator: str) -> None:
    """SPEC 3.12 in TRL: GRPOConfig(kl_placement='reward', kl_estimator=<k3 family>) warns KLEstimatorWarning naming the
    field, its value and the fix; the trainer built from it keeps the estimator (the warning does not change it)."""
    with pytest.warns(KLEstimatorWarning) as caught:
        trainer = make_trainer(tokenizer, str(tmp_path), max_steps=1, kl_estimator=estimator, **REWARD)
    messages = {str(w.message) for w in caught if issubclass(w.category, KLEstimatorWarning)}
    assert len(messages) == 1
    (message,) = messages
    assert message.startswith(f"kl_estimator={estimator!r} with kl_placement='reward': ")
    assert message.endswith("Use kl_estimator='k1' (the reward placement's default: leave kl_estimator unset).")
    assert trainer.adaptive_kl.config.estimator == estimator


def test_k1_in_the_loss_warns_and_the_defaults_do_not(tokenizer, tmp_path) -> None:
    """The other guard in TRL: kl_estimator='k1' with the KL in the loss warns; the defaults of both placements and
    k1_future in the loss are silent."""
    with pytest.warns(KLEstimatorWarning, match=r"^kl_estimator='k1' with kl_placement='loss': the expected gradient "
                                                r"of k1 is zero on-policy.* Use kl_estimator='k1_future'"):
        trl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, kl_estimator="k1")
    with warnings.catch_warnings():
        warnings.simplefilter("error", KLEstimatorWarning)
        for fields in ({}, {"kl_placement": "reward"}, {"kl_estimator": "k1_future"},
                       {"kl_placement": "reward", "kl_estimator": "k1"}):
            make_trainer(tokenizer, str(tmp_path), max_steps=1, **fields)


def test_tool_response_tokens_carry_no_reward_penalty(tokenizer, tmp_path) -> None:
    """TRL's tool_mask (0 on the tokens a tool returned, which the policy did not sample) masks them out of KL_i as the
    completion mask does, on the rewards `_calculate_rewards` returns (no tool calls on CPU: the generation's locals are
    stand-ins named as TRL names them). beta = 0.5, k1 = logp - ref, sequence_sum:
    row 0: k1 = [0.5, -1.0, 1.0], completion mask [1, 1, 1], tool mask [1, 0, 1]: KL = 0.5 + 1.0 = 1.5 (0.5 with the
    tool token); row 1: k1 = [0.5, 1.0, -1.0], completion mask [1, 1, 0], tool mask [0, 1, 1]: KL = 1.0 (1.5 with it).
    The penalty column is -0.5 * [1.5, 1.0] = [-0.75, -0.5], its mean 0.625 is added back to the reward metric."""
    from unsloth_adaptive_kl.integrations.trainer_hooks import _CallRecorder, wrap_calculate_rewards

    trainer = make_trainer(tokenizer, str(tmp_path), max_steps=1, beta=0.5, kl_reduction="sequence_sum", **REWARD)
    calculate = wrap_calculate_rewards(lambda self: torch.tensor([[1.0], [0.0]]), lambda name: RuntimeError(name))
    scoring = {"train": False, "recorder": _CallRecorder(lambda *args, **kwargs: None), "group_size": 2}
    trainer._adaptive_kl_scoring = scoring  # the stand-in batch: one group of 2

    def generation() -> torch.Tensor:  # the locals of TRL's _generate_and_score_completions that the hook reads
        old_per_token_logps = torch.tensor([[-1.0, -2.0, -0.5], [-0.2, -1.0, -3.0]])  # noqa: F841
        sampling_per_token_logps = None  # noqa: F841
        ref_per_token_logps = torch.tensor([[-1.5, -1.0, -1.5], [-0.7, -2.0, -2.0]])  # noqa: F841
        completion_mask = torch.tensor([[1, 1, 1], [1, 1, 0]])  # noqa: F841
        tool_mask = torch.tensor([[1, 0, 1], [0, 1, 1]])  # noqa: F841
        return calculate(trainer)

    rewards = generation()
    torch.testing.assert_close(rewards, torch.tensor([[1.0, -0.75], [0.0, -0.5]]), rtol=0, atol=1e-6)
    assert scoring["mean_penalty"] == pytest.approx(0.625, abs=1e-6)
    assert trainer.current_beta == 0.5


@pytest.mark.parametrize("placement", ["loss", "reward"])
def test_evaluation_never_feeds_the_beta_controller_a_reward(tokenizer, tmp_path, placement: str) -> None:
    """Only training generation batches count for the dynamic controller (SPEC: one observed mean reward per
    training generation batch): after evaluate() it has seen no batch (generation_batch 0, no reward), no optimizer
    step completed, beta is 0.5 and is logged under evaluation's metrics (its reward, 0, unseen); one training step
    with reward 1.0 above the 0.8 threshold then counts one batch and decays once, to 0.5 * 0.9 = 0.45."""
    from datasets import Dataset

    from .conftest import PROMPTS

    settings = REWARD if placement == "reward" else dict(gradient_accumulation_steps=1)
    phase_reward = {"value": 0.0}  # 0 while evaluating, 1.0 in training: a leaked evaluation reward shows

    def reward(completions: list[str], **kwargs: Any) -> list[float]:
        return [phase_reward["value"]] * len(completions)

    trainer = make_trainer(tokenizer, str(tmp_path), reward, max_steps=1, beta=0.5,
                           kl_adaptation_method="dynamic", reward_threshold=0.8, dynamic_beta_decay=0.9, **settings)
    trainer.eval_dataset = Dataset.from_dict({"prompt": PROMPTS[:4]})
    metrics = trainer.evaluate()
    phase_reward["value"] = 1.0
    assert metrics["eval_adaptive_kl/current_beta"] == 0.5  # logged as evaluation's, not training's
    controller = trainer.adaptive_kl.controller
    assert controller.generation_batch == 0 and math.isnan(controller.batch_reward) and controller.value == 0.5
    assert trainer.adaptive_kl.completed_steps == 0  # evaluation completes no optimizer step
    trainer.train()
    assert (controller.generation_batch, controller.batch_reward) == (1, pytest.approx(1.0))
    assert trainer.current_beta == pytest.approx(0.45)


@pytest.mark.parametrize("placement", ["loss", "reward"])
def test_an_evaluation_whose_generation_leaves_training_mode_on_feeds_nothing(tokenizer, tmp_path,
                                                                              placement: str) -> None:
    """Unsloth's generation (and TRL's continuous batching) puts the model in training mode, so model.training no
    longer says an evaluation once a batch is generated. Here generation calls model.train(): an evaluation batch of
    one prompt (num_generations_eval=2) is grouped by 2, as the trainer grouped it by the mode it read before
    generating (on fa480e6 the penalty was grouped by num_generations, 4: a shape error), and its loss moves neither
    beta nor the step count (on fa480e6 it was a dynamic step: 0.45 -> 0.405)."""
    from datasets import Dataset

    settings = REWARD if placement == "reward" else dict(gradient_accumulation_steps=1)
    trainer = make_trainer(tokenizer, str(tmp_path), constant_reward(1.0), max_steps=1, beta=0.5,
                           kl_adaptation_method="dynamic", reward_threshold=0.8, dynamic_beta_decay=0.9,
                           num_generations_eval=2, per_device_eval_batch_size=2, **settings)
    generate = trainer._generate

    def generate_then_train(*args: Any, **kwargs: Any) -> Any:
        output = generate(*args, **kwargs)
        trainer.model.train()
        return output

    trainer._generate = generate_then_train
    trainer.train()
    assert trainer.adaptive_kl.completed_steps == 1 and trainer.current_beta == pytest.approx(0.45)
    metrics = trainer.evaluate(Dataset.from_dict({"prompt": ["ab:"]}))
    assert "eval_loss" in metrics
    assert trainer.adaptive_kl.completed_steps == 1 and trainer.current_beta == pytest.approx(0.45)


def test_an_unscored_completion_is_left_out_of_the_mean_a_masked_one_carries(tokenizer, tmp_path) -> None:
    """One group of 4, beta = 0.5, k1 summed: penalties 0.5 * [2, 6, 20, -] where completion 2 is unscored (every
    reward None: the trainer leaves it out of the baseline) and completion 3 has no valid token (masked). The masked
    one carries the mean of the scored ones with tokens, 0.5 * (2 + 6) / 2 = 2.0 (with the unscored one counted it
    would be 0.5 * 28 / 3 = 4.67); the unscored one stays NaN."""
    from unsloth_adaptive_kl.integrations.trainer_hooks import _CallRecorder, wrap_calculate_rewards

    trainer = make_trainer(tokenizer, str(tmp_path), max_steps=1, beta=0.5, kl_reduction="sequence_sum", **REWARD)
    calculate = wrap_calculate_rewards(lambda self: torch.tensor([[1.0], [1.0], [math.nan], [1.0]]),
                                       lambda name: RuntimeError(name))
    trainer._adaptive_kl_scoring = {"train": False, "recorder": _CallRecorder(lambda *args, **kwargs: None),
                                    "group_size": 4}

    def generation() -> torch.Tensor:  # the locals of TRL's _generate_and_score_completions that the hook reads
        old_per_token_logps = torch.tensor([[-1.0, -1.0], [-1.0, -1.0], [-1.0, -1.0], [-1.0, -1.0]])  # noqa: F841
        sampling_per_token_logps = None  # noqa: F841
        ref_per_token_logps = torch.tensor([[-2.0, -2.0], [-4.0, -4.0], [-11.0, -11.0], [-9.0, -9.0]])  # noqa: F841
        completion_mask = torch.tensor([[1, 1], [1, 1], [1, 1], [0, 0]])  # noqa: F841
        tool_mask = None  # noqa: F841
        return calculate(trainer)

    column = generation()[:, 1]
    assert column[[0, 1, 3]].tolist() == pytest.approx([-1.0, -3.0, -2.0]) and math.isnan(column[2])


def test_an_override_of_calculate_rewards_that_skips_the_hook_is_an_error_naming_it(tokenizer, tmp_path) -> None:
    """A trainer whose own `_calculate_rewards` does not call super() (here trl's stock one set on the instance, as a
    subclass's override is found first) scores without the penalty: the first generation raises, naming the override
    and the fix, not a missing reward-metric anchor of trl's source (which is present)."""
    import types

    from unsloth_adaptive_kl.integrations import trl as trl_patch

    trainer = make_trainer(tokenizer, str(tmp_path), max_steps=1, **REWARD)
    trainer._calculate_rewards = types.MethodType(trl_patch._stock_calculate_rewards, trainer)
    with pytest.raises(RuntimeError, match=r"^adaptive_kl: a generation of GRPOTrainer scored its completions without "
                                           r"the adaptive KL's reward hook \(_calculate_rewards, .* Call "
                                           r"super\(\)\._calculate_rewards\(\.\.\.\) from the override, or set "
                                           r"kl_placement='loss'\.$"):
        trainer.train()


def test_a_generation_without_a_local_the_penalty_reads_is_an_error_naming_it(tokenizer, tmp_path) -> None:
    """The reward penalty reads the log-probs and masks from the locals of TRL's `_generate_and_score_completions`
    where it calls `_calculate_rewards`: a trl that renamed one of them (here tool_mask) raises IncompatibleVersionError
    naming that local, through the installed `GRPOTrainer._calculate_rewards`."""
    from unsloth_adaptive_kl.integrations.trainer_hooks import _CallRecorder
    from unsloth_adaptive_kl.integrations.versions import IncompatibleVersionError

    trainer = make_trainer(tokenizer, str(tmp_path), max_steps=1, **REWARD)
    trainer._adaptive_kl_scoring = {"train": False, "recorder": _CallRecorder(lambda *args, **kwargs: None)}
    prompts, completions = ["ab:"] * 4, ["a#", "b", "cc", "#"]

    def generation() -> torch.Tensor:  # TRL's locals at the call, but for tool_mask
        old_per_token_logps = torch.zeros(4, 2)  # noqa: F841
        sampling_per_token_logps = None  # noqa: F841
        ref_per_token_logps = torch.zeros(4, 2)  # noqa: F841
        completion_mask = torch.ones(4, 2)  # noqa: F841
        return trainer._calculate_rewards([{"prompt": p} for p in prompts], prompts, completions, [[3, 4]] * 4)

    with pytest.raises(IncompatibleVersionError, match=re.escape(
            "the anchor `tool_mask = ` (read where it calls _calculate_rewards, for the KL in the reward) was not "
            "found in _generate_and_score_completions.")):
        generation()
