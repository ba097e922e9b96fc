"""Optimizer steps taken since a loop last called `AdaptiveKL.step()`.

A loop of your own moves beta by calling `akl.step()` after each `optimizer.step()`; a loop that never does trains on
with beta where it started, and nothing in `kl_loss` can tell one step's micro-batches from the next's. The optimizer
can: torch calls every global optimizer step hook (`register_optimizer_step_post_hook`) after
each `step()` of any `torch.optim.Optimizer` (bitsandbytes' and accelerate's wrapped ones included). Counted per
optimizer, so that two optimizers stepping once each per iteration count one step each.
"""

from __future__ import annotations

import weakref
from typing import Optional

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook


class OptimizerSteps:
    """Each optimizer's `step()` calls since `start()` or the last `reset()`. The hook keeps the counts alone (not
    this object), and is removed when this object is collected."""

    def __init__(self) -> None:
        self.counts: weakref.WeakKeyDictionary[torch.optim.Optimizer, int] = weakref.WeakKeyDictionary()
        self.started = False

    def start(self) -> None:
        """Count from now on (idempotent)."""
        if self.started:
            return
        counts = self.counts

        def count(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
            counts[optimizer] = counts.get(optimizer, 0) + 1

        handle = register_optimizer_step_post_hook(count)
        weakref.finalize(self, handle.remove)
        self.started = True

    def reset(self) -> None:
        self.counts.clear()

    def most(self) -> tuple[Optional[torch.optim.Optimizer], int]:
        """The optimizer that stepped most since the last reset, and how many times (None, 0 if none did)."""
        return max(self.counts.items(), key=lambda item: item[1], default=(None, 0))
