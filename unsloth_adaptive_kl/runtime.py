"""Per-trainer adaptive-KL state shared by both integrations: the beta controller, the step's queued micro-batch
statistics and their metrics. Trainer-agnostic: the integration passes the cross-process `gather` it has."""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

from .adaptation import KLTerm, pearson_correlation
from .config import AdaptiveKLConfig
from .controllers import WindowKL, make_beta_controller

METRIC_PREFIX = "adaptive_kl/"
Gather = Callable[[torch.Tensor], torch.Tensor]


class AdaptiveKLRuntime:
    """Holds the live beta (`current_beta`) and turns each micro-batch's KL into metrics and controller updates.

    Nothing is read back from the device per micro-batch: each micro-batch's statistics stay a device tensor until
    the optimizer step ends (or, in evaluation, the call ends), where the step's micro-batches are gathered over
    processes and transferred to the host once, for the metrics and the controller together."""

    def __init__(self, config: AdaptiveKLConfig, beta: float) -> None:
        self.config = config
        self.controller = make_beta_controller(beta, config)
        self._pending: list[torch.Tensor] = []  # one row per micro-batch of this step, on the device

    @property
    def current_beta(self) -> float:
        return self.controller.value

    def observe_rewards(self, mean_reward: float) -> None:
        """The mean reward over all processes of a new generation batch."""
        self.controller.observe_rewards(mean_reward)

    def record(
        self, term: KLTerm, *, gather: Gather, train: bool, end_of_step: bool, completed_steps: int
    ) -> list[dict[str, float]]:
        """Queue one micro-batch's statistics; at the end of an optimizer step in training (every call in
        evaluation) return the metrics of each queued micro-batch (averaged over processes, `adaptive_kl/` names)
        and, in training, update the controller from the step's global KL."""
        self._pending.append(torch.cat([
            torch.stack([term.raw, term.adapted.detach(), term.at_threshold, term.lengths.sum()]),
            term.lengths, term.sequence_kl,
        ]).float())
        if train and not end_of_step:
            return []
        rows, self._pending = self._pending, []
        sizes = [row.numel() for row in rows]
        table = gather(torch.cat(rows)).view(-1, sum(sizes))  # one collective and one transfer per step
        summaries, totals = [], torch.zeros(3, dtype=torch.float64, device=table.device)
        for block in table.split(sizes, dim=1):
            size = (block.size(1) - 4) // 2
            lengths, sequence_kl = block[:, 4 : 4 + size].flatten(), block[:, 4 + size :].flatten()
            summaries.append(torch.stack([
                block[:, 0].mean(), block[:, 1].mean(), sequence_kl.mean(),
                pearson_correlation(lengths.double(), sequence_kl.double()).float(),
                block[:, 2].sum() / block[:, 3].sum().clamp(min=1),
            ]))
            totals += torch.stack([sequence_kl.sum(), lengths.sum(), sequence_kl.new_tensor(float(sequence_kl.numel()))]).double()
        metrics = [self._metrics(summary, completed_steps) for summary in torch.stack(summaries).tolist()]
        if train:
            self._end_step(completed_steps, *totals.tolist())
        return metrics

    def _metrics(self, summary: list[float], completed_steps: int) -> dict[str, float]:
        raw_kl, adapted_kl, mean_sequence_kl, correlation, clip_fraction = summary
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
        return {METRIC_PREFIX + name: value for name, value in metrics.items()}

    def _end_step(self, completed_steps: int, kl_sum: float, tokens: float, completions: float) -> None:
        window = WindowKL(
            token_mean=kl_sum / max(tokens, 1.0), sequence_sum=kl_sum / max(completions, 1.0), completions=int(completions)
        )
        self.controller.step(completed_steps, window)

    def state_dict(self) -> dict[str, Any]:
        return self.controller.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.controller.load_state_dict(state)
