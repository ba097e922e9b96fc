"""Registries users extend: `register_kl_shaping` and `register_beta_controller` make new `kl_adaptation_method` names,
combinable with `+`, validated, checkpointed, and usable in a trainer and in the KL lab."""

from __future__ import annotations

import dataclasses
import math
import re

import pytest
import torch

from .conftest import logged, make_trainer
from unsloth_adaptive_kl import (AdaptiveKL, AdaptiveKLConfig, register_beta_controller, register_kl_estimator,
                                 register_kl_reduction, register_kl_shaping)
from unsloth_adaptive_kl.core import registry
from unsloth_adaptive_kl.core.controllers import ConstantBeta
from unsloth_adaptive_kl.core.estimators import estimator_names
from unsloth_adaptive_kl.tools import kl_lab, tabular_lab


@register_kl_shaping("test_square_cap")
def square_cap(kl: torch.Tensor, config: AdaptiveKLConfig) -> torch.Tensor:
    """k' = min(k, c)^2 / c, c = kl_clip_threshold (0 -> 0)."""
    return torch.clamp(kl, max=config.kl_clip_threshold) ** 2 / config.kl_clip_threshold


@register_beta_controller("test_accuracy_beta")
class AccuracyBeta(ConstantBeta):
    """beta <- beta * 2 after a step whose generation batch's mean reward > reward_threshold (once per batch); reads
    the step's KL only to record it."""

    def __init__(self, beta: float, config: AdaptiveKLConfig) -> None:
        super().__init__(beta, config)
        self.threshold = config.reward_threshold
        self.grown_batch = 0
        self.seen_kl = math.nan

    def step(self, completed_steps: int, window=None) -> None:
        if window is not None:
            self.seen_kl = window.token_mean
        if self.generation_batch != self.grown_batch and self.batch_reward > self.threshold:
            self.value *= 2.0
            self.grown_batch = self.generation_batch


LOGPS = torch.tensor([[-1.0, -2.0, -0.5, -0.3], [-0.2, -1.5, -3.0, -0.7]])
REF = torch.tensor([[-1.3, -1.0, -0.9, -0.3], [-0.9, -1.1, -2.0, -2.5]])
MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0]])


def k3(logps: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    r = (ref - logps).double()
    return r.exp() - r - 1


def test_a_registered_shaping_combines_with_length_normalisation_and_follows_its_formula() -> None:
    config = AdaptiveKLConfig(kl_adaptation_method="length_normalized+test_square_cap", kl_clip_threshold=0.3)
    assert config.kl_methods == ("test_square_cap", "length_normalized")  # shaping first, whatever the order written
    assert config.kl_adaptation_method == "test_square_cap+length_normalized"
    term, metrics = AdaptiveKL(config, beta=0.1, loss_type="dapo").kl_loss(LOGPS, REF, MASK, token_normalizer=7.0)
    shaped = torch.clamp(k3(LOGPS, REF), max=0.3) ** 2 / 0.3 * MASK
    expected = (shaped.sum(-1) / MASK.sum(-1)).mean()  # length_normalized: each completion's mean, whatever loss_type
    assert term.item() == pytest.approx(0.1 * expected.item(), rel=1e-6)
    raw = (k3(LOGPS, REF) * MASK).sum() / 7.0  # raw_kl keeps dapo's own reduction
    assert metrics["adaptive_kl/raw_kl"] == pytest.approx(raw.item(), rel=1e-6)


def test_a_registered_controller_moves_beta_reads_the_window_and_checkpoints() -> None:
    config = AdaptiveKLConfig(kl_adaptation_method="test_accuracy_beta+test_square_cap", reward_threshold=0.5)
    akl = AdaptiveKL(config, beta=0.04, loss_type="bnpo")
    assert isinstance(akl.controller, AccuracyBeta)
    akl.kl_loss(LOGPS, REF, MASK)
    assert akl.step(mean_reward=0.7) == pytest.approx(0.08)
    assert akl.controller.seen_kl == pytest.approx(((k3(LOGPS, REF) * MASK).sum() / MASK.sum()).item(), rel=1e-6)
    assert akl.step() == pytest.approx(0.08)  # the same generation batch: once per batch
    assert akl.step(mean_reward=0.2) == pytest.approx(0.08)
    state = akl.state_dict()
    resumed = AdaptiveKL(config, beta=0.04, loss_type="bnpo")
    resumed.load_state_dict(state)
    assert resumed.current_beta == pytest.approx(0.08) and resumed.controller.grown_batch == 1
    assert resumed.step(mean_reward=0.9) == akl.step(mean_reward=0.9) == pytest.approx(0.16)


@register_kl_shaping("test_floor")
def floor_kl(kl: torch.Tensor, config: AdaptiveKLConfig) -> torch.Tensor:
    """k' = max(k, 0.01): lifts the padding's 0 too."""
    return torch.clamp(kl, min=0.01)


@register_beta_controller("test_beta_set_to")
class BetaSetTo(ConstantBeta):
    """beta <- `set_to` at each step (a test sets it: NaN, -1 or inf, as a buggy controller might)."""

    set_to = 0.0

    def step(self, completed_steps: int, window=None) -> None:
        self.value = self.set_to


def test_a_shaping_that_lifts_the_zero_of_padding_is_refused_when_the_run_is_built() -> None:
    """max(k, 0.01) gave each padded position a KL of 0.01: the same two completions gave a loss of 0.0031 padded to
    3 tokens and 0.0069 padded to 8. Refused by name when the AdaptiveKL is built, before any batch."""
    config = AdaptiveKLConfig(kl_adaptation_method="test_floor")
    with pytest.raises(ValueError, match=r"^kl_adaptation_method='test_floor': the shaping 'test_floor' maps a \(2, 3\) "
                       r"KL of zeros to \[0\.0099999.*allowed is a shaping that maps 0 to 0 elementwise"):
        AdaptiveKL(config, beta=0.1)
    AdaptiveKL(AdaptiveKLConfig(kl_adaptation_method="test_square_cap"), beta=0.1)  # min(0, c)^2 / c = 0: built


@pytest.mark.parametrize("value", [math.nan, -1.0, math.inf])
def test_a_controller_that_sets_beta_to_nan_a_negative_or_inf_is_refused_at_that_step(
        value: float, monkeypatch: pytest.MonkeyPatch) -> None:
    """NaN made the loss NaN and -1 made it -0.37 (a reward for drifting), silently: the step that sets it raises,
    naming the controller, the step and the value."""
    monkeypatch.setattr(BetaSetTo, "set_to", value)
    akl = AdaptiveKL(AdaptiveKLConfig(kl_adaptation_method="test_beta_set_to"), beta=0.1)
    akl.kl_loss(LOGPS.requires_grad_(), REF, MASK)
    with pytest.raises(ValueError, match=rf"^beta controller BetaSetTo \('test_beta_set_to'\) at step 1: its value "
                       rf"\(beta_t\) is {value!r}; allowed is a finite Python number >= 0\.$"):
        akl.step(mean_reward=0.5)


@pytest.mark.parametrize("estimator, found", [
    (lambda logp, ref, mask: ((ref - logp) * mask).sum(-1, keepdim=True), "shape (2, 1)"),  # broadcast onto tokens
    (lambda logp, ref, mask: ((ref - logp) * mask).sum(), "shape ()"),
    (lambda logp, ref, mask: 0.5, "float")])
def test_an_estimator_that_does_not_return_a_per_token_kl_is_refused_by_name(estimator, found: str) -> None:
    """A (B, 1) sequence KL broadcast onto every token gave a raw KL of 0.40 where k3's is 0.45, silently: refused
    when the AdaptiveKL is built, from a (2, 3) probe (the pipeline runs traced, where shapes are not numbers)."""
    with pytest.raises(ValueError, match=rf"^kl_estimator='<lambda>' returned {re.escape(found)} for a \(2, 3\) "
                       r"batch; allowed is the per-token KL, a tensor of the log-probs' shape \(batch, completion "
                       r"tokens\)\.$"):
        AdaptiveKL(AdaptiveKLConfig(kl_estimator=estimator), beta=0.1)


def test_names_are_checked_and_unknown_ones_list_the_registered() -> None:
    with pytest.raises(ValueError, match=r"kl_adaptation_method='nope' is invalid: allowed is .*test_square_cap.*"
                                         r"test_accuracy_beta"):
        AdaptiveKLConfig(kl_adaptation_method="nope")
    with pytest.raises(ValueError, match="at most one of clip/sigmoid/test_square_cap"):
        AdaptiveKLConfig(kl_adaptation_method="clip+test_square_cap")
    with pytest.raises(ValueError, match="at most one of dynamic/target/test_accuracy_beta"):
        AdaptiveKLConfig(kl_adaptation_method="dynamic+test_accuracy_beta")
    for taken in ("clip", "none", "length_normalized", "test_accuracy_beta", "a+b", ""):
        with pytest.raises(ValueError, match=r"register_kl_shaping\(.*\): allowed is a new, non-empty name"):
            register_kl_shaping(taken)


@pytest.mark.parametrize("name", [" pad", "pad ", "None"])
def test_a_name_no_config_could_select_is_refused_by_every_registry(name: str) -> None:
    """A config strips a method's name and reads kl_estimator='None' as unset (a command line's None): ' pad' was
    registered, then refused by the config that listed it as allowed, and an estimator named 'None' was registered
    and never used (the config computed k3)."""
    rule = r"allowed is a new, non-empty name without surrounding spaces, other than 'None'"
    for decorator in (register_kl_shaping, register_beta_controller, register_kl_estimator, register_kl_reduction):
        with pytest.raises(ValueError, match=rf"^{decorator.__name__}\({name!r}\): {rule}"):
            decorator(name)
    assert name not in registry.method_names() and name not in estimator_names()
    with pytest.raises(TypeError, match="missing: step"):
        register_beta_controller("test_not_a_controller")(type("NoStep", (), {"observe_rewards": lambda s, r: None,
                                                                              "state_dict": dict,
                                                                              "load_state_dict": dict}))
    assert "test_not_a_controller" not in registry.method_names()


def test_a_registered_controller_and_shaping_drive_trls_trainer(tokenizer, tmp_path) -> None:
    """GRPOConfig takes the names; the trainer's logged beta doubles after each step (mean reward 0.8 > 0.5), and
    adapted_kl is the shaped KL's dapo reduction (below the raw KL: every k' <= k for k <= c = 1)."""
    def alternating(completions, **kwargs):  # mean 0.8 > 0.5, and varied, so that the policy (and its KL) moves
        return [0.6 + 0.4 * (i % 2) for i in range(len(completions))]

    trainer = make_trainer(tokenizer, str(tmp_path), reward=alternating, max_steps=3,
                           gradient_accumulation_steps=1, loss_type="dapo", reward_threshold=0.5,
                           kl_adaptation_method="test_square_cap+test_accuracy_beta")
    assert trainer.args.kl_adaptation_method == "test_square_cap+test_accuracy_beta"
    trainer.train()
    assert logged(trainer, "adaptive_kl/current_beta") == pytest.approx([0.04, 0.08, 0.16])
    raw, adapted = logged(trainer, "adaptive_kl/raw_kl"), logged(trainer, "adaptive_kl/adapted_kl")
    assert all(0 <= a <= r for a, r in zip(adapted, raw)) and max(raw) > 0
    assert trainer.current_beta == pytest.approx(0.32)


def test_registered_methods_and_estimators_run_in_the_kl_lab() -> None:
    if "test_lab_k1" not in estimator_names():
        register_kl_estimator("test_lab_k1")(lambda logp, ref, mask: logp - ref)
    settings = tabular_lab.default_settings(estimators=["test_lab_k1"], methods=["test_square_cap", "test_accuracy_beta"])
    labels = {s.label for s in settings}
    assert {"test_lab_k1 in the reward", "test_lab_k1 in the loss", "test_square_cap in the loss",
            "test_square_cap in the reward", "test_accuracy_beta in the loss"} <= labels
    tree = tabular_lab.Tree(tabular_lab.ENVIRONMENTS["contains_a"])
    setting = next(s for s in settings if s.label == "test_accuracy_beta in the reward")
    setting = dataclasses.replace(setting, config=setting.config + (("reward_threshold", 0.2),))
    run = tabular_lab.train(tree, setting, 0.5, tabular_lab.Training(steps=10), seed=0)
    # every step's mean reward is above 0.2 (the reference's own is 0.31 and a large beta holds the policy there)
    assert run.final_beta == 0.5 * 2 ** 10
    with pytest.raises(SystemExit, match="--method nope: not registered"):
        kl_lab.main(["--method", "nope"])
    # a built-in's rows were added again under the table's labels at the defaults (clip at 1.0 beside the table's
    # 0.1), and the results, matched by label, mixed the two into both rows
    for flag, name in (("--method", "clip"), ("--estimator", "k3")):
        with pytest.raises(SystemExit, match=f"^{flag} {name}: built in, and the table has its rows already"):
            kl_lab.main([flag, name])
