"""The KL settings in effect, read from the trainer TRL builds (SPEC 3.15), and TRL's sequence-level KL bias
correction (huggingface/trl#6586): what this package's KL term does with it, refused where it would adapt it."""

from __future__ import annotations

import logging

import pytest
import torch

from unsloth_adaptive_kl.integrations import trl as trl_integration
from unsloth_adaptive_kl.integrations.trainer_hooks import attach_runtime
from unsloth_adaptive_kl.tools.selfcheck import loss_and_grads

from .conftest import grpo_args, make_trainer, stock_trl
from .test_trl_loss import fixed_inputs, policy_logps, prepared_trainer

LOGGER = "unsloth_adaptive_kl.integrations.trainer_hooks"
# use_bias_correction_kl set explicitly: its default is True in trl 1.15 and False in trl 1.9.1.
SEQUENCE = dict(loss_type="grpo", importance_sampling_level="sequence", use_bias_correction_kl=True)


def settings_lines(caplog, capsys) -> list[str]:
    """The settings lines said so far: printed (an adapted setting) and logged at INFO (the stock KL)."""
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("adaptive_kl: KL settings")]
    return printed + [record.getMessage() for record in caplog.records if record.name == LOGGER]


def test_trainer_construction_says_the_kl_settings_in_effect_once(tokenizer, tmp_path, caplog, capsys) -> None:
    """One line per trainer, read from the trainer's own args: scale_rewards=True as TRL stores it ('group'),
    steps_per_generation as TRL derives it, the estimator as the placement resolves it; training says no other. An
    adapted setting prints it (INFO is hidden at Python's default level, as a new user runs the quickstart); the
    stock KL logs it at INFO and prints nothing."""
    caplog.set_level(logging.INFO, logger=LOGGER)
    trainer = make_trainer(tokenizer, str(tmp_path), loss_type="grpo", kl_adaptation_method="clip", num_iterations=2,
                           use_bias_correction_kl=True,
                           scale_rewards=True, max_steps=1)
    expected = ("adaptive_kl: KL settings in effect for GRPOTrainer: beta=0.04, kl_adaptation_method='clip', "
                "kl_estimator='k3' (unset: the placement's default), kl_placement='loss', kl_reduction='loss_type', "
                "kl_clip_threshold=1.0, loss_type='grpo', "
                "scale_rewards='group', num_iterations=2, importance_sampling_level='token', "
                "use_bias_correction_kl=True, steps_per_generation=2, gradient_accumulation_steps=2")
    assert settings_lines(caplog, capsys) == [expected]
    assert not caplog.records  # printed, not also logged
    trainer.train()
    assert trainer.state.global_step == 1
    assert settings_lines(caplog, capsys) == []
    make_trainer(tokenizer, str(tmp_path), loss_type="grpo", use_bias_correction_kl=True, max_steps=1)
    assert capsys.readouterr().out.count("adaptive_kl: KL settings") == 0
    (stock,) = [record.getMessage() for record in caplog.records if record.name == LOGGER]
    assert stock.startswith("adaptive_kl: KL settings in effect for GRPOTrainer: beta=0.04, "
                            "kl_adaptation_method='none', kl_estimator='k3'")


# kl_adaptation_method='dynamic' reads these (its defaults), and the reduction is said beside them
DYNAMIC_READS = ("kl_reduction='loss_type', dynamic_beta_decay=0.9, reward_threshold=0.8, beta_min=0.0, "
                 "beta_schedule_steps=1000, ")


def test_the_line_names_the_reduction_and_the_fields_the_settings_read(tokenizer, tmp_path, caplog, capsys) -> None:
    """A reduction away from the loss type's reads as stock where the line leaves it out (kl_adaptation_method='none'
    with kl_reduction='sequence_sum' did); the fields of the methods and estimator in effect, as set, are named, and
    no other (target's, and k3_bottom_percentile's; not clip's)."""
    caplog.set_level(logging.INFO, logger=LOGGER)
    make_trainer(tokenizer, str(tmp_path), kl_reduction="sequence_sum", max_steps=1)
    (line,) = settings_lines(caplog, capsys)
    assert "kl_placement='loss', kl_reduction='sequence_sum', loss_type=" in line
    make_trainer(tokenizer, str(tmp_path), kl_adaptation_method="target", kl_target=0.2, kl_horizon=50.0,
                 kl_estimator="k3_bottom_percentile", kl_percentile=0.25, max_steps=1)
    (line,) = settings_lines(caplog, capsys)
    assert ("kl_reduction='loss_type', kl_target=0.2, beta_min=0.0, kl_horizon=50.0, beta_max=None, "
            "kl_target_measure='token_mean', kl_percentile=0.25, kl_percentile_scale=5.0, loss_type=") in line
    assert "kl_clip_threshold" not in line and "dynamic_beta_decay" not in line
    make_trainer(tokenizer, str(tmp_path), kl_adaptation_method="length_normalized", max_steps=1)  # dapo's loss
    (line,) = settings_lines(caplog, capsys)
    assert ("kl_reduction='loss_type' (length_normalized: 'sequence_mean', each completion's mean), "
            "loss_type='dapo'") in line


@pytest.mark.parametrize(("settings", "shown"), [
    (dict(kl_estimator="k2"),
     "kl_estimator='k2', kl_placement='loss', " + DYNAMIC_READS + "loss_type='dapo', scale_rewards='group', "
     "num_iterations=1, importance_sampling_level='sequence', use_bias_correction_kl=True (not applied: the KL is "
     "'k2' from the log-probs)"),
    (dict(kl_placement="reward"),
     "kl_estimator='k1' (unset: the placement's default), kl_placement='reward', "
     + DYNAMIC_READS.replace("'loss_type', ", "'loss_type' (in the reward: 'sequence_sum', each completion's sum), ")
     + "loss_type='dapo', scale_rewards='group', num_iterations=1, importance_sampling_level='sequence', "
     "use_bias_correction_kl=True "
     "(not applied: the KL in the reward is 'k1' from the log-probs)"),
    (dict(kl_estimator="k2", beta=0.0),  # no KL term at all: nothing to say of the correction
     "kl_estimator='k2', kl_placement='loss', " + DYNAMIC_READS + "loss_type='dapo', scale_rewards='group', "
     "num_iterations=1, importance_sampling_level='sequence', use_bias_correction_kl=True, steps_per_generation"),
], ids=["k2_in_the_loss", "k1_in_the_reward", "beta_0"])
def test_settings_line_says_where_trls_kl_correction_does_not_apply(tokenizer, tmp_path, caplog, capsys, settings,
                                                                     shown) -> None:
    """TRL's use_bias_correction_kl multiplies its own k3 only: with another estimator, or the KL in the reward, the
    line says it is not applied (and these settings train with importance_sampling_level='sequence'); at beta=0 there
    is no KL term, and the line says nothing of it."""
    caplog.set_level(logging.INFO, logger=LOGGER)
    make_trainer(tokenizer, str(tmp_path), kl_adaptation_method="dynamic", importance_sampling_level="sequence",
                 use_bias_correction_kl=True,
                 **settings)
    (line,) = settings_lines(caplog, capsys)
    assert shown in line


def test_sequence_level_bias_correction_gives_the_trl_6586_gradient_which_none_keeps(tokenizer, tmp_path) -> None:
    """The evidence for the refusal below. With importance_sampling_level='sequence' and use_bias_correction_kl=True,
    the per-token KL the installed TRL computes (the one KLTermProbe hands this package's methods) is k3 times the
    sequence-mean ratio broadcast over the tokens: on-policy its value is k3, but its gradient is that of
    k3 * exp(mean_t (log pi_t - sg(log pi_t))), which carries (sum_t k_t) * grad(mean_t log pi_t), not the per-token
    correction's k3 * exp(log pi_t - sg(log pi_t)). `none` keeps it exactly, as stock TRL (and warns); an adaptation
    built from that KL is refused."""
    with pytest.warns(UserWarning, match=r"kl_adaptation_method='none' keeps it, as the stock trainer does"):
        trainer = prepared_trainer(tokenizer, tmp_path, **SEQUENCE)
    inputs = fixed_inputs(trainer, tokenizer)
    with stock_trl():
        stock_loss, stock_grads = loss_and_grads(trainer, "_compute_loss", inputs)
    loss, grads = loss_and_grads(trainer, "_compute_loss", inputs)
    assert loss == stock_loss and all(torch.equal(g, s) for g, s in zip(grads, stock_grads))  # none: stock

    _, kl = trl_integration._stock_loss_and_kl(trainer, trainer.model, dict(inputs), keep_stock_term=True)
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    m = inputs["completion_mask"].float()
    logp = policy_logps(trainer.model, inputs)
    r = inputs["ref_per_token_logps"] - logp
    k3 = torch.exp(r) - r - 1
    log_ratio = logp - logp.detach()  # on-policy: TRL's old log-probs are the policy's, detached
    by_sequence = k3 * torch.exp((log_ratio * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True))
    by_token = k3 * torch.exp(log_ratio)

    def grads_of(term: torch.Tensor) -> list[torch.Tensor]:
        return list(torch.autograd.grad((term * m).sum(), params, retain_graph=True))

    def relative_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
        return max((x - y).abs().max().item() for x, y in zip(a, b)) / max(y.abs().max().item() for y in b)

    assert torch.allclose(kl * m, k3.detach() * m, rtol=1e-4, atol=1e-6)  # the value: k3, the ratio being 1
    trainer_grads = grads_of(kl)
    # Two forward paths (TRL's chunked log-probs, a plain log_softmax) agree to ~1e-6 relative.
    assert relative_diff(trainer_grads, grads_of(by_sequence)) < 1e-4
    assert relative_diff(trainer_grads, grads_of(by_token)) > 0.05

    trainer.args.kl_adaptation_method = "dynamic"  # the same KL, only reweighted by beta_t: refused
    with pytest.raises(ValueError, match=r"^use_bias_correction_kl=True is invalid: allowed is False with "
                                         r"importance_sampling_level='sequence' and adaptive KL"):
        attach_runtime(trainer)


@pytest.mark.parametrize("settings", [dict(kl_adaptation_method="clip"), dict(kl_adaptation_method="dynamic"),
                                      dict(kl_adaptation_method="sigmoid+length_normalized", kl_estimator="k3"),
                                      dict(kl_reduction="sequence_sum")],
                         ids=["clip", "dynamic", "sigmoid_length_normalized", "sequence_sum"])
def test_an_adapted_trainer_kl_is_refused_with_sequence_level_bias_correction(tmp_path, settings) -> None:
    """Every non-stock KL in the loss built from the trainer's own k3 would adapt the #6586 gradient: refused when
    the config is built, naming both fields, their values, why, and what is allowed."""
    with pytest.raises(ValueError) as error:
        grpo_args(str(tmp_path), **SEQUENCE, **settings)
    method = settings.get("kl_adaptation_method", "none")
    reduction = settings.get("kl_reduction", "loss_type")
    assert str(error.value) == (
        "use_bias_correction_kl=True is invalid: allowed is False with importance_sampling_level='sequence' and "
        f"adaptive KL (kl_adaptation_method={method!r}, kl_reduction={reduction!r}, kl_estimator 'k3'): the adapted "
        "KL is built from the trainer's own per-token KL, which the trainer multiplies by the sequence-level "
        "importance ratio exp(mean_t log(pi/pi_old)) broadcast over the tokens, so its gradient gains the spurious "
        "term (sum_t k_t) * grad(mean_t log pi_t) on every step, on-policy included (huggingface/trl#6586, open). "
        "Or importance_sampling_level='token', or a kl_estimator other than 'k3' (computed from the log-probs, "
        "without the trainer's factor); kl_adaptation_method='none' stays stock."
    )


@pytest.mark.parametrize("settings", [
    dict(SEQUENCE, use_bias_correction_kl=False, kl_adaptation_method="clip"),
    dict(loss_type="grpo", importance_sampling_level="token", kl_adaptation_method="clip"),
    dict(**SEQUENCE, kl_adaptation_method="clip", kl_estimator="k2"),
    dict(**SEQUENCE, kl_adaptation_method="dynamic", kl_placement="reward"),
    dict(**SEQUENCE, kl_adaptation_method="clip", beta=0.0),
    dict(**SEQUENCE),
], ids=["no_bias_correction", "token_level", "k2", "kl_in_reward", "beta_zero", "none"])
def test_settings_whose_kl_carries_no_sequence_weight_are_accepted(tmp_path, settings) -> None:
    """Only a KL term built from the trainer's sequence-weighted k3 is refused: another estimator and the KL in the
    reward are computed from the log-probs, beta=0 has no KL, and `none` stays stock (it warns on the trainer)."""
    assert grpo_args(str(tmp_path), **settings).importance_sampling_level == settings["importance_sampling_level"]


def test_k3_named_in_the_reward_is_accepted_with_sequence_level_bias_correction(tmp_path) -> None:
    """The KL in the reward is computed from the log-probs, never from the trainer's sequence-weighted k3, even with
    k3 named (which reads like the trainer's own estimator): the config is built, with the reward placement's k3
    warning only, not the #6586 refusal."""
    from unsloth_adaptive_kl import KLEstimatorWarning

    with pytest.warns(KLEstimatorWarning, match=r"^kl_estimator='k3' with kl_placement='reward'"):
        args = grpo_args(str(tmp_path), **SEQUENCE, kl_adaptation_method="dynamic", kl_placement="reward",
                         kl_estimator="k3")
    assert (args.importance_sampling_level, args.use_bias_correction_kl, args.estimator) == ("sequence", True, "k3")
