"""Thin translators between a training loop and the core's `AdaptiveKL`, one module per loop, each behind its own
extra: `trl` (TRL's GRPOTrainer, patched in place), `unsloth` (the trainer Unsloth generates from TRL's), `tinker`
(Tinker's custom and built-in losses), `verl` (verl's actor loss and reward KL). Importing this package imports none
of them. Shared by `trl` and `unsloth`: `grpo_loss` (the decisions their losses have in common), `trainer_hooks` (the
trainer methods both wrap, TRL's own fields and rules) and `ref_sync` (reference syncing). `versions` holds every
integration's anchors, and `patching.PatchSet` records every replacement any of them makes."""
