"""Wrappers shared by the TRL and Unsloth integrations, built around whichever upstream method they wrap.

Each keeps the upstream signature and source visible (`functools.wraps`): Unsloth reads `inspect.getsource` and
`inspect.signature` of `trl.GRPOTrainer`'s methods to generate its trainer, and must see the stock ones.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import warnings
from typing import Any, Callable

import torch

from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from .adaptation import kl_reduction, loss_type_reduction
from .config import adaptive_kl_config_from
from .runtime import AdaptiveKLRuntime

STATE_FILE = "adaptive_kl_state.json"
AnchorError = Callable[[], Exception]


class KLTermProbe(float):
    """Stands in for beta during one call of the trainer's own loss function.

    It equals beta, so the stock `if beta != 0.0` branches behave as before. At the stock KL line (`... + beta *
    per_token_kl`) it records the per-token KL exactly as the trainer computed it, and the named locals of that
    function at that line (`read_locals`, e.g. Unsloth's rejected-token mask), and returns the stock product
    (`keep_stock_term`) or zeros (the adapted term is then added after the stock reduction instead)."""

    captured: list
    locals_at_kl_line: dict

    def __new__(cls, beta: float, keep_stock_term: bool, read_locals: tuple[str, ...] = ()) -> "KLTermProbe":
        probe = super().__new__(cls, beta)
        probe.keep_stock_term = keep_stock_term
        probe.read_locals = read_locals
        probe.captured = []
        probe.locals_at_kl_line = {}
        return probe

    def __mul__(self, other: Any) -> Any:
        if not isinstance(other, torch.Tensor):
            return float(self) * other
        self.captured.append(other)
        if self.read_locals:
            caller = sys._getframe(1).f_locals
            self.locals_at_kl_line = {name: caller.get(name) for name in self.read_locals}
        return float(self) * other if self.keep_stock_term else torch.zeros_like(other)

    __rmul__ = __mul__

    def single_capture(self, missing: AnchorError) -> torch.Tensor:
        """The one per-token KL recorded; `missing()` is raised when the KL line was not reached exactly once."""
        if len(self.captured) != 1:
            raise missing()
        return self.captured[0]


def attach_runtime(trainer: Any) -> AdaptiveKLRuntime:
    """Validate the trainer's adaptive-KL settings and give it its runtime (`trainer.adaptive_kl`)."""
    config = adaptive_kl_config_from(trainer.args)
    if trainer.beta != 0.0:
        loss_type_reduction(trainer.loss_type)
        kl_reduction(config, trainer.loss_type)
    elif not config.is_stock_kl:
        warnings.warn(
            f"kl_adaptation_method={config.kl_adaptation_method!r} has no effect: beta=0.0 turns the KL term off "
            "(and the trainer loads no reference model). Set beta > 0 to regularise.",
            UserWarning,
            stacklevel=3,
        )
    trainer.adaptive_kl = AdaptiveKLRuntime(config, trainer.beta)
    return trainer.adaptive_kl


def wrap_init(upstream: Callable) -> Callable:
    """__init__: validate the settings and build the beta controller before any training starts."""

    @functools.wraps(upstream)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        upstream(self, *args, **kwargs)
        attach_runtime(self)

    return __init__


def wrap_generate_and_score(upstream: Callable, missing_reward_metric: AnchorError) -> Callable:
    """_generate_and_score_completions: read the global mean reward it appends to `_metrics["train"]["reward"]`
    (`missing_reward_metric()` is raised when it appended none)."""

    @functools.wraps(upstream)
    def _generate_and_score_completions(self: Any, *args: Any, **kwargs: Any) -> Any:
        rewards = self._metrics["train"]["reward"]
        logged = len(rewards)
        output = upstream(self, *args, **kwargs)
        if self.model.training:
            if len(rewards) != logged + 1:
                raise missing_reward_metric()
            self.adaptive_kl.observe_rewards(rewards[-1])
        return output

    return _generate_and_score_completions


def wrap_save_checkpoint(upstream: Callable) -> Callable:
    """_save_checkpoint: save the beta controller's state with every checkpoint."""

    @functools.wraps(upstream)
    def _save_checkpoint(self: Any, model: Any, trial: Any) -> None:
        upstream(self, model, trial)
        if self.args.should_save:
            folder = os.path.join(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
            with open(os.path.join(folder, STATE_FILE), "w") as f:
                json.dump(self.adaptive_kl.state_dict(), f)

    return _save_checkpoint


def wrap_load_optimizer_and_scheduler(upstream: Callable) -> Callable:
    """_load_optimizer_and_scheduler: restore the beta controller's state on resume."""

    @functools.wraps(upstream)
    def _load_optimizer_and_scheduler(self: Any, checkpoint: Any) -> None:
        upstream(self, checkpoint)
        path = os.path.join(checkpoint, STATE_FILE) if checkpoint is not None else None
        if path is not None and os.path.exists(path):
            with open(path) as f:
                self.adaptive_kl.load_state_dict(json.load(f))

    return _load_optimizer_and_scheduler


def current_beta(self: Any) -> float:
    """The beta multiplying the KL term in the next step (`trainer.beta` stays the configured value)."""
    return self.adaptive_kl.current_beta


def record_metrics(trainer: Any, term: Any) -> None:
    """Queue one micro-batch's adaptive-KL statistics; at an optimizer-step boundary in training (every call in
    evaluation) log the queued micro-batches' metrics and update beta (like TRL's adaptive entropy controller: once
    per optimizer step, effective from the next step)."""
    mode = "train" if trainer.model.training else "eval"
    logged = trainer.adaptive_kl.record(
        term, gather=trainer.accelerator.gather, train=mode == "train",
        end_of_step=trainer.accelerator.sync_gradients, completed_steps=trainer.state.global_step + 1,
    )
    for metrics in logged:
        for name, value in metrics.items():
            trainer._metrics[mode][name].append(value)
