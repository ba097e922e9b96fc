"""Per-trainer adaptive-KL state shared by both integrations: the beta controller, the step's KL window and the
metrics of each micro-batch. Trainer-agnostic: the integration passes the cross-process `gather` it has."""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

import torch

from .adaptation import KLTerm, kl_diagnostics, pearson_correlation
from .config import AdaptiveKLConfig
from .controllers import WindowKL, make_beta_controller

METRIC_PREFIX = "adaptive_kl/"
Gather = Callable[[torch.Tensor], torch.Tensor]


class AdaptiveKLRuntime:
    """Holds the live beta (`current_beta`) and turns each micro-batch's KL into metrics and controller updates."""

    def __init__(self, config: AdaptiveKLConfig, beta: float) -> None:
        self.config = config
        self.controller = make_beta_controller(beta, config)
        self._window: Optional[torch.Tensor] = None  # [sum of sequence KL, tokens, completions] so far this step

    @property
    def current_beta(self) -> float:
        return self.controller.value

    def observe_rewards(self, mean_reward: float) -> None:
        """The mean reward over all processes of a new generation batch."""
        self.controller.observe_rewards(mean_reward)

    def record(
        self,
        kl: torch.Tensor,
        mask: torch.Tensor,
        term: KLTerm,
        *,
        gather: Gather,
        train: bool,
        end_of_step: bool,
        completed_steps: int,
    ) -> dict[str, float]:
        """Metrics of one micro-batch (averaged over processes), and, at the end of an optimizer step in training,
        the controller update from the step's global KL. Returns the metrics with their `adaptive_kl/` names."""
        diagnostics = kl_diagnostics(kl, mask, self.config)
        # One gather (a row per process) and one host transfer per micro-batch: this runs on every loss call.
        size = diagnostics.lengths.numel()
        row = torch.cat([
            torch.stack([term.raw, term.adapted.detach(), diagnostics.at_threshold, diagnostics.tokens]),
            diagnostics.lengths, diagnostics.sequence_kl,
        ]).float()
        table = gather(row).view(-1, row.numel())
        lengths, sequence_kl = table[:, 4 : 4 + size].flatten(), table[:, 4 + size :].flatten()
        summary = torch.stack([
            table[:, 0].mean(), table[:, 1].mean(), sequence_kl.mean(),
            pearson_correlation(lengths.double(), sequence_kl.double()).float(),
            table[:, 2].sum() / table[:, 3].sum().clamp(min=1), sequence_kl.sum(), lengths.sum(),
        ]).tolist()
        raw_kl, adapted_kl, mean_sequence_kl, correlation, clip_fraction, kl_sum, tokens = summary
        if not (math.isfinite(raw_kl) and math.isfinite(adapted_kl)):
            raise FloatingPointError(
                f"adaptive KL: non-finite KL at step {completed_steps}: raw_kl={raw_kl}, adapted_kl={adapted_kl}. "
                "The policy and reference log-probs diverged beyond float range."
            )
        metrics = {
            "raw_kl": raw_kl,
            "adapted_kl": adapted_kl,
            "current_beta": self.current_beta,
            "sequence_kl": mean_sequence_kl,
            "length_kl_corr": correlation,
        }
        if "clip" in self.config.kl_methods:
            metrics["clip_fraction"] = clip_fraction
        if train:
            totals = torch.tensor([kl_sum, tokens, float(sequence_kl.numel())], dtype=torch.float64)
            self._window = totals if self._window is None else self._window + totals
            if end_of_step:
                self._end_step(completed_steps)
        return {METRIC_PREFIX + name: value for name, value in metrics.items()}

    def _end_step(self, completed_steps: int) -> None:
        kl_sum, tokens, completions = self._window.tolist()
        self._window = None
        window = WindowKL(
            token_mean=kl_sum / max(tokens, 1.0), sequence_sum=kl_sum / max(completions, 1.0), completions=int(completions)
        )
        self.controller.step(completed_steps, window)

    def state_dict(self) -> dict[str, Any]:
        return self.controller.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.controller.load_state_dict(state)
