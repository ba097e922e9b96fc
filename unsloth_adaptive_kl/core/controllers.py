"""Beta controllers: the live KL coefficient, updated once per optimizer step, with checkpointable state.

The live beta is trainer state, never written back into `trainer.beta`/`args.beta` (stock trainers skip the
reference model whenever those are 0). Every process calls `observe_rewards` and `step` with the same globally
averaged statistics and step, so every process holds the same beta.
"""

from __future__ import annotations

import json
import math
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from .config import AdaptiveKLConfig, check_beta, check_whole, is_real, python_number, reject
from .registry import BETA_CONTROLLERS as _CONTROLLERS
from .registry import new_method_name


@dataclass
class WindowKL:
    """The un-adapted KL of one optimizer step, over all its micro-batches and processes.

    token_mean: sum of k over valid tokens / their count. sequence_sum: mean over completions of sum_t m k.
    completions: n, the generated completions the step accounts for: those it trained on, each counted once per
    generation batch (with mu optimizer passes over a batch, a step that trains on c completions accounts for c / mu;
    with the KL in the reward, a scored batch's completions, once). `target` moves beta by n / kl_horizon per update,
    so a batch of n completions moves it as one update of n does, as in Ziegler et al. (one update per batch)."""

    token_mean: float
    sequence_sum: float
    completions: float

    def __post_init__(self) -> None:
        # NaN KLs are a step that measured none (beta holds); an infinite one, or a count that is not a finite
        # number >= 0, would move beta to inf, NaN or 0 (from which a multiplicative update never returns)
        for name in ("token_mean", "sequence_sum", "completions"):
            value = getattr(self, name)
            if not is_real(value) or math.isinf(value) or (name == "completions" and not value >= 0):
                raise reject(f"WindowKL.{name}", value, python_number(
                    value, "a finite number >= 0 (the completions the step accounts for)" if name == "completions"
                    else "a finite number, or NaN where the step measured none"))


class ConstantBeta:
    """beta_k = beta_0 for every step.

    A controller sees, at the end of each optimizer step that trained on new generation batches, their mean reward
    (`observe_rewards`: the mean of the batches' means; a trainer's integration hands none to a controller that
    reads none, `AdaptiveKL.reads_rewards`), and is stepped after each optimizer step (`step`); several optimizer
    steps may share one generation batch, and one step may train on several."""

    kind = "constant"  # the name a checkpoint records (`AdaptiveKL.state_dict()["controller"]`)

    def __init__(self, beta: float, config: AdaptiveKLConfig) -> None:
        self.value = float(beta)
        self.generation_batch = 0
        self.batch_reward = math.nan

    def observe_rewards(self, mean_reward: float) -> None:
        """Record the mean reward (over all processes) of the new generation batches of the step that just ended
        (`generation_batch` counts the steps that had new ones)."""
        self.generation_batch += 1
        self.batch_reward = float(mean_reward)

    def check(self, window: Optional[WindowKL]) -> None:
        """A ValueError where this controller would refuse to move from a step's `window`: the driver asks before
        anything moves (a refused step leaves the run as it was), and a loop's training batch asks as soon as the
        step's window so far is refused. A constant beta refuses none."""

    def step(self, completed_steps: int, window: Optional[WindowKL] = None) -> None:
        """Called after each optimizer step; a constant beta ignores it."""

    # The checkpointed counts (beyond beta, `value`, which the caller checks): an integer >= 0 each, a
    # generation_batch of "3" compared unequal to every count, and decayed beta again.
    counts: tuple[str, ...] = ("generation_batch",)

    def state_dict(self) -> dict[str, Any]:
        """Its public attributes; `batch_reward` None before the first reward (NaN here, which strict JSON lacks)."""
        state = {name: value for name, value in vars(self).items() if not name.startswith("_")}
        return {**state, "batch_reward": None if math.isnan(self.batch_reward) else self.batch_reward}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Its fields, each checked first (`counts`, and `batch_reward` a finite number, or None or NaN before the
        first reward); a subclass's own fields are set as they come, for it to check."""
        for name in self.counts:
            check_whole(f"adaptive KL state: {name}", state[name], 0, "an integer >= 0 (a count)")
        reward = state["batch_reward"]  # +-inf: dynamic would decay on it, as no door lets a mean reward of +inf in
        if reward is not None and (not is_real(reward) or math.isinf(reward)):
            raise reject("adaptive KL state: batch_reward", reward, "a finite number, or None (or NaN) before the "
                         "first reward")
        for name, value in state.items():
            setattr(self, name, value)
        if self.batch_reward is None:
            self.batch_reward = math.nan


def float32(value: float) -> float:
    """`value` rounded to the nearest float32."""
    return torch.tensor(value, dtype=torch.float32).item()


class DynamicBeta(ConstantBeta):
    """After an optimizer step that trained on new generation batches with mean reward r > reward_threshold (the mean
    of their means): beta <- max(beta * dynamic_beta_decay, beta_min), at most once per generation batch;
    once completed_steps >= beta_schedule_steps: beta = beta_min."""

    kind = "dynamic"
    counts = ("generation_batch", "last_decayed_batch")

    def __init__(self, beta: float, config: AdaptiveKLConfig) -> None:
        super().__init__(beta, config)
        self.last_decayed_batch = 0
        self._config = config
        # Trainers average rewards in float32: a mean of exactly 0.8 arrives as 0.800000011920929, so the
        # threshold and the mean are compared in float32 ("> 0.8" must be false for rewards of 0.8, whether the mean
        # arrives as a float32 or, from a loop of one's own, as the float 0.8).
        self._threshold = float32(config.reward_threshold)

    def step(self, completed_steps: int, window: Optional[WindowKL] = None) -> None:
        config = self._config
        if self.generation_batch != self.last_decayed_batch and float32(self.batch_reward) > self._threshold:
            self.value = max(self.value * config.dynamic_beta_decay, config.beta_min)
            self.last_decayed_batch = self.generation_batch
        if config.beta_schedule_steps is not None and completed_steps >= config.beta_schedule_steps:
            if self.value != config.beta_min:  # the schedule's end, said once: a long run's beta drops there
                warnings.warn(f"adaptive KL: step {completed_steps} reached beta_schedule_steps="
                              f"{config.beta_schedule_steps}: beta = beta_min = {config.beta_min:g} from the next "
                              f"step on (it was {self.value:g}){'; the KL term is off' if config.beta_min == 0 else ''}"
                              ". Set beta_schedule_steps=None (or later) to decay by the reward alone.", UserWarning,
                              stacklevel=2)
            self.value = config.beta_min


def check_horizon(config: AdaptiveKLConfig, completions: float, beta: float) -> None:
    """`target`'s horizon against steps of n = `completions`: with beta_min = 0 and n / kl_horizon >= 5, the update
    1 + e * n / kl_horizon (e down to -0.2) reaches 0, where a multiplicative update stays for good: a ValueError
    naming kl_horizon, n and what is allowed. A `beta` of 0 (the KL term off, which every door says) has nothing to
    lose, and is not checked. A loop that knows n before training checks it then."""
    if completions / config.kl_horizon >= 5.0 and config.beta_min == 0 and beta != 0:
        raise ValueError(f"kl_horizon={config.kl_horizon!r} is invalid for steps of {completions:g} completions with "
                         "beta_min=0: target's update beta * (1 + e * n / kl_horizon), e down to -0.2, would reach 0, "
                         "and a multiplicative update never leaves 0; allowed is kl_horizon > "
                         f"{completions / 5.0:g} (n / 5), or beta_min > 0.")


class TargetKL(ConstantBeta):
    """The adaptive KL controller of Ziegler et al. (2019), on the loss beta. After each optimizer step, with KL the
    step's `kl_target_measure` and n its completions:
    e = clip(KL / kl_target - 1, -0.2, 0.2); beta <- clamp(beta * (1 + e * n / kl_horizon), beta_min, beta_max)."""

    kind = "target"

    def __init__(self, beta: float, config: AdaptiveKLConfig) -> None:
        super().__init__(beta, config)
        self._config = config

    def check(self, window: Optional[WindowKL]) -> None:
        """`check_horizon` for the window's n at this beta: an update from it could reach 0, and stay."""
        if window is not None:
            check_horizon(self._config, window.completions, self.value)

    def step(self, completed_steps: int, window: Optional[WindowKL] = None) -> None:
        config = self._config
        kl = getattr(window, config.kl_target_measure) if window is not None else math.nan
        if not math.isfinite(kl):
            return
        error = min(max(kl / config.kl_target - 1.0, -0.2), 0.2)
        value = max(self.value * (1.0 + error * window.completions / config.kl_horizon), config.beta_min)
        if value == 0 < self.value:  # float underflow (beta_min = 0): from 0 a multiplicative update never returns
            warnings.warn(f"adaptive KL: target's beta underflowed to 0 at step {completed_steps} (beta_min=0): its "
                          "multiplicative update never leaves 0, so the KL term is off for the rest of the run. Set "
                          "beta_min > 0 for a floor, or a larger kl_horizon for smaller updates.", UserWarning,
                          stacklevel=2)
        self.value = value if config.beta_max is None else min(value, config.beta_max)


BetaController = ConstantBeta


def register_beta_controller(name: str) -> Callable[[type], type]:
    """Decorator: make `kl_adaptation_method=name` (alone or joined by '+' with shapings and length normalisation)
    move beta with the decorated class, in every loop. The class is built as `cls(beta, config)` (beta_0 and the
    `AdaptiveKLConfig`) and follows the built-in controllers' protocol (subclassing `ConstantBeta` gives the rest):
    `value` (beta_t, a float), `observe_rewards(mean_reward)` (at the end of a step that trained on new generation
    batches, before `step`: their mean reward over all processes), `step(completed_steps, window)` (after each
    optimizer step; `window` is the step's `WindowKL` or None), `state_dict()` / `load_state_dict(state)` (JSON-able;
    saved in every checkpoint like the built-in ones), and optionally `check(window)` (a ValueError for a window it
    would refuse, asked before anything moves). At most one controller per setting. A taken name is a ValueError."""
    new_method_name("register_beta_controller", name)

    def add(cls: type) -> type:
        missing = [attribute for attribute in ("observe_rewards", "step", "state_dict", "load_state_dict")
                   if not callable(getattr(cls, attribute, None))]
        if not isinstance(cls, type) or missing:
            raise TypeError(f"register_beta_controller({name!r}) decorates a class with observe_rewards, step, "
                            f"state_dict and load_state_dict (subclass ConstantBeta); missing: {', '.join(missing)}")
        if "kind" not in vars(cls):  # checkpoints record the kind: a registered class's own is its name
            cls.kind = name
        _CONTROLLERS[name] = cls
        return cls

    return add


register_beta_controller("dynamic")(DynamicBeta)
register_beta_controller("target")(TargetKL)


def controller_kind(controller: BetaController) -> str:
    """The controller's kind, as checkpoints record it: "constant", "dynamic", "target" (or a subclass's own)."""
    return controller.kind


def make_beta_controller(beta: float, config: AdaptiveKLConfig) -> BetaController:
    """The controller of the configured beta method, or a constant beta; its state must survive a checkpoint."""
    check_beta(beta)
    kind = next((method for method in config.kl_methods if method in _CONTROLLERS), None)
    controller = ConstantBeta(beta, config) if kind is None else _CONTROLLERS[kind](beta, config)
    check_controller_beta(controller, "when built")
    check_checkpointable(controller)
    return controller


def check_controller_beta(controller: BetaController, when: str) -> None:
    """Refuse a beta (the controller's `value`) that is not a finite number >= 0: a registered controller's NaN would
    make every KL term NaN, and a negative beta would reward the policy for drifting from the reference. `when`: the
    moment, for the message ("when built", "at step 3")."""
    value = getattr(controller, "value", None)
    if not (is_real(value) and 0 <= value < math.inf):
        raise ValueError(f"beta controller {type(controller).__name__} ({controller_kind(controller)!r}) {when}: its "
                         f"value (beta_t) is {value!r}; allowed is a finite Python number >= 0.")


def check_checkpointable(controller: BetaController) -> None:
    """Refuse, when the run is built, a controller whose `state_dict()` does not survive JSON (every checkpoint
    writes it as JSON: a config or a tensor kept in a public attribute would crash the first save, hours in)."""
    state = controller.state_dict()
    try:
        text = json.dumps(state, allow_nan=True)
        survives = json.dumps(json.loads(text)) == text
    except (TypeError, ValueError) as error:
        text, survives = f"{type(error).__name__}: {error}", False
    if not survives:
        raise TypeError(
            f"beta controller {type(controller).__name__} ({controller_kind(controller)!r}): state_dict() must be "
            f"JSON numbers, strings, lists and dicts, as every checkpoint saves it; it gave {text}. Keep "
            "other objects (the config, tensors) in attributes whose names start with '_' (ConstantBeta.state_dict "
            "leaves them out), or override state_dict / load_state_dict.")
