"""Optimizer steps taken between a loop's training batches, so that a loop that never calls `AdaptiveKL.step()` is told.

A loop of your own moves beta by calling `akl.step()` after each `optimizer.step()`; a loop that never does trains on
with beta where it started, and nothing in `kl_loss` can tell one step's micro-batches from the next's. The optimizer
can: torch calls every global optimizer step hook (`register_optimizer_step_post_hook`) after each `step()` of any
`torch.optim.Optimizer` (bitsandbytes' and accelerate's wrapped ones included). What counts is whether an optimizer
stepped between two training batches, not how often: DeepSpeed's ZeRO-3 steps its optimizer once per parameter
sub-group, and a second optimizer (a reward model's, say) may step beside the policy's.
"""

from __future__ import annotations

import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook


class OptimizerSteps:
    """The training batches since `reset()` that an optimizer step came before (`batches`), and which optimizer last
    stepped. The hook holds this object weakly and is removed when it is collected."""

    def __init__(self) -> None:
        self.stepped = ""  # the class name of the optimizer that stepped last since the previous batch; "" if none did
        self.batches = 0
        self.started = False

    def __getstate__(self) -> dict:
        """A copy (`copy.deepcopy`, pickle) has no hook of its own: it starts watching at its own first batch."""
        return {**self.__dict__, "started": False}

    def start(self) -> None:
        """Watch from now on (idempotent)."""
        if self.started:
            return
        watch = weakref.ref(self)

        def note(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
            steps = watch()
            if steps is not None:
                steps.stepped = type(optimizer).__name__

        weakref.finalize(self, register_optimizer_step_post_hook(note).remove)
        self.started = True

    def batch(self) -> str:
        """A training batch: counted if an optimizer stepped since the previous one, whose class name it returns ("" if
        none did)."""
        stepped, self.stepped = self.stepped, ""
        self.batches += bool(stepped)
        return stepped

    def since_reset(self) -> bool:
        """Whether an optimizer stepped since the last `reset()`."""
        return bool(self.stepped) or self.batches > 0

    def reset(self) -> None:
        """The loop's `akl.step()`: a step taken before it was that step's."""
        self.stepped, self.batches = "", 0
