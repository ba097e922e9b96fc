"""Beta controllers: the live KL coefficient, updated once per optimizer step, with checkpointable state.

The live beta is trainer state, never written back into `trainer.beta`/`args.beta` (stock trainers skip the
reference model whenever those are 0). Every process calls `update` with the same globally averaged reward and
step, so every process holds the same beta.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

from .config import AdaptiveKLConfig


class ConstantBeta:
    """beta_k = beta_0 for every step.

    A controller sees each generation batch's mean reward (`observe_rewards`) and is stepped after each
    optimizer step (`step`); several optimizer steps may share one generation batch."""

    def __init__(self, beta: float, config: AdaptiveKLConfig) -> None:
        self.value = float(beta)
        self.generation_batch = 0
        self.batch_reward = math.nan

    def observe_rewards(self, mean_reward: float) -> None:
        """Record the mean reward (over all processes) of a new generation batch."""
        self.generation_batch += 1
        self.batch_reward = float(mean_reward)

    def step(self, completed_steps: int) -> None:
        """Called after each optimizer step; a constant beta ignores it."""

    def state_dict(self) -> dict[str, Any]:
        return {name: value for name, value in vars(self).items() if not name.startswith("_")}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name, value in state.items():
            setattr(self, name, value)


class DynamicBeta(ConstantBeta):
    """After an optimizer step that trained on a generation batch with mean reward r > reward_threshold:
    beta <- max(beta * dynamic_beta_decay, beta_min), at most once per generation batch;
    once completed_steps >= beta_schedule_steps: beta = beta_min."""

    def __init__(self, beta: float, config: AdaptiveKLConfig) -> None:
        super().__init__(beta, config)
        self.last_decayed_batch = 0
        self._config = config
        # Trainers average rewards in float32: a mean of exactly 0.8 arrives as 0.800000011920929, so the
        # threshold is compared at the same precision ("> 0.8" must be false for rewards of 0.8).
        self._threshold = torch.tensor(config.reward_threshold, dtype=torch.float32).item()

    def step(self, completed_steps: int) -> None:
        config = self._config
        if self.generation_batch != self.last_decayed_batch and self.batch_reward > self._threshold:
            self.value = max(self.value * config.dynamic_beta_decay, config.beta_min)
            self.last_decayed_batch = self.generation_batch
        if config.beta_schedule_steps is not None and completed_steps >= config.beta_schedule_steps:
            self.value = config.beta_min


BetaController = ConstantBeta
_CONTROLLERS: dict[str, Callable[[float, AdaptiveKLConfig], BetaController]] = {"dynamic": DynamicBeta}


def make_beta_controller(beta: float, config: AdaptiveKLConfig) -> BetaController:
    """The controller of the configured beta method, or a constant beta."""
    if not math.isfinite(beta):
        raise ValueError(f"beta={beta!r} is invalid: allowed is a finite number >= 0.")
    for method in config.kl_methods:
        if method in _CONTROLLERS:
            return _CONTROLLERS[method](beta, config)
    return ConstantBeta(beta, config)
