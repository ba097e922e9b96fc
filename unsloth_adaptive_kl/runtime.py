"""Per-trainer adaptive-KL state shared by both integrations: the beta controller, the step's queued micro-batch
statistics and their metrics. Trainer-agnostic: the integration passes the cross-process `gather` it has."""

from __future__ import annotations

import math
import statistics
from typing import Any, Callable

import torch

from .adaptation import CompletionKL, KLTerm
from .config import AdaptiveKLConfig
from .controllers import WindowKL, make_beta_controller

METRIC_PREFIX = "adaptive_kl/"
Gather = Callable[[torch.Tensor], torch.Tensor]


def pearson_correlation(x: list[float], y: list[float]) -> float:
    """sum((x - mean x)(y - mean y)) / sqrt(sum (x - mean x)^2 * sum (y - mean y)^2); NaN when either is constant."""
    mx, my = statistics.fmean(x), statistics.fmean(y)
    dx, dy = [a - mx for a in x], [b - my for b in y]
    denominator = math.sqrt(sum(a * a for a in dx) * sum(b * b for b in dy))
    return sum(a * b for a, b in zip(dx, dy)) / denominator if denominator > 0 else math.nan


def split_columns(blocks: list[list[float]], widths: list[int]) -> list[list[float]]:
    """Gathered rows, one per process, each laid out as consecutive columns of the given widths -> each column with
    every process's values in process order."""
    columns: list[list[float]] = [[] for _ in widths]
    for block in blocks:
        start = 0
        for column, width in zip(columns, widths):
            column.extend(block[start : start + width])
            start += width
    return columns


def summarize(raws: list[float], adapteds: list[float], at_threshold: list[float], lengths: list[float],
              sequence_kl: list[float]) -> list[float]:
    """[mean raw KL, mean adapted KL, mean S_i, corr(L_i, S_i), clipped tokens / sum L_i] over every process's
    values (the raw and adapted entries are per micro-batch or per completion, as the caller recorded them)."""
    return [statistics.fmean(raws), statistics.fmean(adapteds), statistics.fmean(sequence_kl),
            pearson_correlation(lengths, sequence_kl), sum(at_threshold) / max(sum(lengths), 1.0)]


class AdaptiveKLRuntime:
    """Holds the live beta (`current_beta`) and turns each micro-batch's KL into metrics and controller updates.

    Nothing is read back from the device per micro-batch: each micro-batch's statistics stay a device tensor until
    the optimizer step ends (or, in evaluation, the call ends), where the step's micro-batches are gathered over
    processes and transferred to the host once, for the metrics and the controller together."""

    def __init__(self, config: AdaptiveKLConfig, beta: float) -> None:
        self.config = config
        self.controller = make_beta_controller(beta, config)
        self._pending: list[torch.Tensor] = []  # one row per micro-batch of this step, on the device
        self._generation_window: WindowKL | None = None  # kl_placement="reward": the KL of the batch being scored
        # The raw KL (all processes) of the last training step (kl_placement="reward": of the last generation batch
        # scored for training), which a KL-triggered reference sync reads; NaN before the first.
        self.last_raw_kl = math.nan

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
            torch.stack([term.raw, term.adapted.detach(), term.at_threshold]), term.lengths, term.sequence_kl,
        ]).float())
        if train and not end_of_step:
            return []
        rows, self._pending = self._pending, []
        sizes = [row.numel() for row in rows]
        # One collective and one transfer per step; the rest is O(B) arithmetic on the host.
        table = gather(torch.cat(rows)).view(-1, sum(sizes)).double().tolist()
        metrics, kl_sum, tokens, completions = [], 0.0, 0.0, 0
        start = 0
        for size in sizes:
            n = (size - 3) // 2
            blocks = [row[start : start + size] for row in table]  # this micro-batch, one block per process
            start += size
            raws, adapteds, at_threshold, lengths, sequence_kl = split_columns(blocks, [1, 1, 1, n, n])
            metrics.append(self._metrics(summarize(raws, adapteds, at_threshold, lengths, sequence_kl), completed_steps))
            kl_sum, tokens, completions = kl_sum + sum(sequence_kl), tokens + sum(lengths), completions + len(lengths)
        if train:
            self.last_raw_kl = statistics.fmean(m[METRIC_PREFIX + "raw_kl"] for m in metrics)
            self._end_step(completed_steps, kl_sum, tokens, completions)
        return metrics

    def reward_penalty(
        self, term: CompletionKL, *, gather: Gather, train: bool, completed_steps: int
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """kl_placement="reward": the penalty beta_t * KL_i of every completion of a generation batch, over all
        processes in process order (as the trainer gathers its rewards), and its metrics. beta_t is the beta after
        `completed_steps` optimizer steps (the schedule cut-off applied); `end_generation` then updates it from this
        batch. One collective and one host transfer."""
        if train:  # no new generation batch has been observed: only the beta_schedule_steps cut-off can apply
            self.controller.step(completed_steps)
        beta = self.current_beta
        n = term.adapted.numel()
        row = torch.cat([term.raw, term.adapted, term.at_threshold.view(1), term.lengths, term.sequence_kl,
                         beta * term.adapted])
        table = gather(row.float()).view(-1, row.numel())
        raws, adapteds, at_threshold, lengths, sequence_kl, penalties = split_columns(
            table.double().tolist(), [n, n, 1, n, n, n])
        metrics = self._metrics(summarize(raws, adapteds, at_threshold, lengths, sequence_kl), completed_steps,
                                reward_penalty=statistics.fmean(penalties))
        self._generation_window = WindowKL(token_mean=sum(sequence_kl) / max(sum(lengths), 1.0),
                                           sequence_sum=statistics.fmean(sequence_kl), completions=len(lengths))
        if train:
            self.last_raw_kl = metrics[METRIC_PREFIX + "raw_kl"]
        return table[:, -n:].reshape(-1), metrics

    def end_generation(self, mean_reward: float, completed_steps: int) -> None:
        """kl_placement="reward": after a training generation batch is scored, the controller reads its un-penalised
        mean reward (`dynamic`) and its KL (`target`); the new beta penalises the next batch."""
        self.controller.observe_rewards(mean_reward)
        window, self._generation_window = self._generation_window, None
        self.controller.step(completed_steps, window)

    def _metrics(self, summary: list[float], completed_steps: int, **extra: float) -> dict[str, float]:
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
            **extra,
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
