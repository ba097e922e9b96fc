"""One controller protocol in every loop and placement: the controller moves exactly once per optimizer step, from
that step's KL; an evaluation pass moves nothing; `target`'s n counts a generated completion once per generation
batch whatever the number of optimizer passes over it; a controller whose state cannot be checkpointed is refused
when the run is built."""

from __future__ import annotations

import math
import warnings
from typing import Any

import pytest
import torch

from .conftest import constant_reward, logged, make_trainer
from unsloth_adaptive_kl import AdaptiveKL, AdaptiveKLConfig, register_beta_controller
from unsloth_adaptive_kl.core.controllers import ConstantBeta
from unsloth_adaptive_kl.core.registry import BETA_CONTROLLERS

LOGPS = torch.tensor([[-1.0, -2.0, -0.5, -0.3], [-0.2, -1.5, -3.0, -0.7], [-0.4, -0.6, -1.2, -2.0]])
REF = torch.tensor([[-1.3, -1.0, -0.9, -0.3], [-0.9, -1.1, -2.0, -2.5], [-0.5, -0.2, -1.0, -1.1]])
MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0]])
OTHER = LOGPS - 1.5  # another policy, as an evaluation pass on a held-out model or batch might see


class CountingBeta(ConstantBeta):
    """A constant beta that records each `step` call's completed_steps and window."""

    def __init__(self, beta: float, config: AdaptiveKLConfig) -> None:
        super().__init__(beta, config)
        self.calls: list[int] = []
        self._windows: list = []

    def step(self, completed_steps: int, window=None) -> None:
        self.calls.append(completed_steps)
        self._windows.append(window)


class ConfigKeepingBeta(ConstantBeta):
    """The natural mistake: the config kept in a public attribute, which `state_dict()` then carries."""

    def __init__(self, beta: float, config: AdaptiveKLConfig) -> None:
        super().__init__(beta, config)
        self.config = config


class IntegratingBeta(ConstantBeta):
    """A controller with fields of its own: an integer literal that accumulates floats, a -1 marker for "never", and
    a refusal of a state whose marker is below it (its own check)."""

    def __init__(self, beta: float, config: AdaptiveKLConfig) -> None:
        super().__init__(beta, config)
        self.integral = 0
        self.last_update = -1

    def step(self, completed_steps: int, window=None) -> None:
        self.integral += 0.25
        self.value = self.value * 0.5

    def load_state_dict(self, state: dict) -> None:
        if state["last_update"] < -1:
            raise ValueError(f"last_update={state['last_update']} is below -1")
        super().load_state_dict(state)


@pytest.fixture(autouse=True, scope="module")
def registered() -> Any:
    """The controllers registered for this module's tests only (other modules match the registered names)."""
    register_beta_controller("test_counting_beta")(CountingBeta)
    register_beta_controller("test_config_keeping_beta")(ConfigKeepingBeta)
    register_beta_controller("test_integrating_beta")(IntegratingBeta)
    yield
    for name in ("test_counting_beta", "test_config_keeping_beta", "test_integrating_beta"):
        BETA_CONTROLLERS.pop(name)


def test_a_registered_controllers_own_fields_resume_and_its_own_refusal_loads_nothing() -> None:
    """The core checks the built-in controllers' counts (a registered controller's integral of 0.25, started as the
    integer 0, and its -1 marker were refused as "an integer >= 0", at resume); the controller checks its own, and a
    state it refuses leaves the run as it was, its controller too."""
    import json

    config = AdaptiveKLConfig(kl_adaptation_method="test_integrating_beta")
    saved = AdaptiveKL(config, 0.1)
    saved.step()
    state = json.loads(json.dumps(saved.state_dict()))
    assert (state["integral"], state["last_update"], state["value"]) == (0.25, -1, 0.05)
    resumed = AdaptiveKL(config, 0.1)
    resumed.load_state_dict(state)
    assert resumed.controller.integral == 0.25 and resumed.current_beta == 0.05 and resumed.completed_steps == 1
    # its state is its own: loaded into a run built with another beta, it is loaded as it is, without a word on
    # which beta continues (the controller's own step decides that, from what it was built with)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        other = AdaptiveKL(config, 0.2)
        other.load_state_dict(state)
    assert other.current_beta == 0.05 and other.controller.integral == 0.25
    fresh = AdaptiveKL(config, 0.1)
    with pytest.raises(ValueError, match=r"^last_update=-2 is below -1$"):
        fresh.load_state_dict({**state, "last_update": -2, "value": 0.7})
    assert (fresh.current_beta, fresh.controller.integral, fresh.completed_steps) == (0.1, 0, 0)


class RememberingBeta(ConstantBeta):
    """A controller that keeps the beta it was built with in a public field named as the state's own key."""

    def __init__(self, beta: float, config: AdaptiveKLConfig) -> None:
        super().__init__(beta, config)
        self.configured_beta = beta


def test_a_controller_field_named_as_a_state_key_is_refused_when_the_run_is_built() -> None:
    """`state_dict()` writes `configured_beta` (and its other keys) beside the controller's fields, and its own value
    won: a controller with a field of that name saved the run's beta under it, and resumed from it, silently."""
    register_beta_controller("test_remembering_beta")(RememberingBeta)
    try:
        with pytest.raises(TypeError, match=r"^beta controller RememberingBeta \('test_remembering_beta'\): its "
                                            r"state_dict\(\) field\(s\) configured_beta are the adaptive KL state's "
                                            r"own, .* rename them"):
            AdaptiveKL(AdaptiveKLConfig(kl_adaptation_method="test_remembering_beta"), 0.1)
    finally:
        BETA_CONTROLLERS.pop("test_remembering_beta")


def token_mean_k(logps: torch.Tensor, ref: torch.Tensor, estimator: str) -> float:
    """sum_t m k / sum_t m by hand: k1 = log pi - log ref, k3 = e^r - r - 1 with r = ref - log pi."""
    r = (ref - logps).double()
    k = -r if estimator == "k1" else r.exp() - r - 1
    return ((k * MASK).sum() / MASK.sum()).item()


@pytest.mark.parametrize("placement", ["loss", "reward"])
def test_a_registered_controller_is_stepped_once_per_optimizer_step_in_a_loop_of_your_own(placement: str) -> None:
    akl = AdaptiveKL(AdaptiveKLConfig(kl_adaptation_method="test_counting_beta", kl_placement=placement), 0.1)
    for _ in range(3):
        if placement == "loss":
            akl.kl_loss(LOGPS, REF, MASK)
        else:
            akl.reward_penalty(LOGPS, REF, MASK)
        akl.step(mean_reward=0.5)
    assert akl.controller.calls == [1, 2, 3]  # was [0, 1, 1, 2, 2, 3] in the reward placement: penalize ticked too
    estimator = "k3" if placement == "loss" else "k1"
    assert [window.token_mean for window in akl.controller._windows] == pytest.approx(
        [token_mean_k(LOGPS, REF, estimator)] * 3, rel=1e-6)


@pytest.mark.parametrize("placement", ["loss", "reward"])
def test_a_registered_controller_is_stepped_once_per_optimizer_step_through_trl(tokenizer, tmp_path,
                                                                                placement: str) -> None:
    """Three optimizer steps of two micro-batches of 4 completions each (gradient_accumulation_steps=2, one generation
    batch of 8 a step): three calls, 1, 2, 3, each with the step's 8 completions."""
    trainer = make_trainer(tokenizer, str(tmp_path), max_steps=3, beta=0.1, kl_placement=placement,
                           kl_adaptation_method="test_counting_beta")
    trainer.train()
    controller = trainer.adaptive_kl.controller
    assert controller.calls == [1, 2, 3]
    assert [window.completions for window in controller._windows] == [8, 8, 8]


@pytest.mark.parametrize("placement", ["loss", "reward"])
def test_an_evaluation_pass_moves_nothing(placement: str) -> None:
    """Ten evaluation batches on another policy between two training steps leave beta, the step's KL (last_raw_kl,
    what a KL-triggered reference sync reads) and target's update as they are without them."""
    config = AdaptiveKLConfig(kl_adaptation_method="target", kl_target=0.1, kl_horizon=30.0, kl_placement=placement)
    evaluated, plain = AdaptiveKL(config, 0.1), AdaptiveKL(config, 0.1)
    for akl, evaluations in ((evaluated, 10), (plain, 0)):
        measure = akl.kl_loss if placement == "loss" else akl.reward_penalty
        measure(LOGPS, REF, MASK)
        with torch.no_grad():
            for _ in range(evaluations):
                _, metrics = measure(OTHER, REF, MASK, train=False)
        akl.step(mean_reward=0.5)
    assert abs(metrics["adaptive_kl/raw_kl"]) > 1.0  # the evaluation batches were measured, far from the training KL
    kl = token_mean_k(LOGPS, REF, "k3" if placement == "loss" else "k1")
    assert evaluated.last_raw_kl == plain.last_raw_kl == pytest.approx(kl, rel=1e-6)
    error = min(max(kl / 0.1 - 1, -0.2), 0.2)
    assert evaluated.current_beta == plain.current_beta == pytest.approx(0.1 * (1 + error * 3 / 30.0), rel=1e-9)


def test_target_counts_a_completion_once_per_generation_batch_whatever_the_passes() -> None:
    """num_iterations=2: two optimizer steps train on the same 3 completions; each accounts for n = 3 / 2, so the
    batch moves beta by (1 + e 1.5 / H)^2 ~ 1 + e 3 / H, as one pass (and the reward placement) does, not 1 + e 6 / H."""
    config = AdaptiveKLConfig(kl_adaptation_method="target", kl_target=0.1, kl_horizon=30.0)
    passes = AdaptiveKL(config, 0.1, num_iterations=2)
    passes.kl_loss(LOGPS, REF, MASK)
    passes.step(mean_reward=0.5)
    passes.kl_loss(LOGPS, REF, MASK)
    passes.step()
    error = min(max(token_mean_k(LOGPS, REF, "k3") / 0.1 - 1, -0.2), 0.2)
    assert error == pytest.approx(0.2)  # the KL is over target: beta rises
    assert passes.current_beta == pytest.approx(0.1 * (1 + error * 1.5 / 30.0) ** 2, rel=1e-9)
    with pytest.raises(ValueError, match=r"num_iterations=0 is invalid.*integer >= 1"):
        AdaptiveKL(config, 0.1, num_iterations=0)


def test_target_through_trl_counts_each_completion_once_with_two_passes(tokenizer, tmp_path) -> None:
    """TRL's num_iterations=2 (one micro-batch a step, 4 completions a generation batch, trained on twice): each
    optimizer step accounts for n = 4 / 2 completions."""
    from .test_dynamic_beta import expected_target_betas

    trainer = make_trainer(tokenizer, str(tmp_path), max_steps=4, beta=0.04, kl_adaptation_method="target",
                           kl_target=0.002, kl_horizon=10.0, loss_type="bnpo", gradient_accumulation_steps=1,
                           num_iterations=2)
    assert trainer.adaptive_kl.num_iterations == 2
    trainer.train()
    measured, betas = logged(trainer, "adaptive_kl/raw_kl"), logged(trainer, "adaptive_kl/current_beta")
    assert betas == pytest.approx(expected_target_betas(measured, 0.04, 0.002, 10.0, 2, 0.0, math.inf), rel=1e-9)
    assert betas[1] == pytest.approx(0.04 * (1 - 0.2 * 2 / 10))  # step 1: policy == reference, n = 2, not 4


def test_a_controller_whose_state_is_not_json_is_refused_when_the_run_is_built(tokenizer, tmp_path) -> None:
    config = AdaptiveKLConfig(kl_adaptation_method="test_config_keeping_beta")
    with pytest.raises(TypeError, match=r"ConfigKeepingBeta \('test_config_keeping_beta'\).*state_dict\(\) must be "
                                        r"JSON.*not JSON serializable"):
        AdaptiveKL(config, 0.1)
    with pytest.raises(TypeError, match="ConfigKeepingBeta"):  # a trainer refuses it when built, not at its first save
        make_trainer(tokenizer, str(tmp_path), constant_reward(1.0), kl_adaptation_method="test_config_keeping_beta")


@pytest.mark.parametrize("beta", [-0.04, math.nan, math.inf, "0.04"])
def test_building_a_controller_directly_refuses_the_beta_adaptive_kl_refuses(beta: Any) -> None:
    """`make_beta_controller` is public: a controller built without `AdaptiveKL` keeps its rule for beta (a negative
    beta would reward KL; it was accepted there, and only a NaN or an inf refused)."""
    from unsloth_adaptive_kl.core import make_beta_controller

    config = AdaptiveKLConfig(kl_adaptation_method="dynamic")
    expected = rf"beta={beta!r} is invalid: allowed is a finite number >= 0"
    for build in (lambda: make_beta_controller(beta, config), lambda: AdaptiveKL(config, beta=beta)):
        with pytest.raises(ValueError, match=expected.replace("(", r"\(").replace(")", r"\)")):
            build()
