"""Reference syncing: TRL's `sync_ref_model` for full and PEFT models in both trainers, a KL trigger, an
optimizer reset, and the synced reference in every checkpoint.

After every `ref_model_sync_steps` optimizer steps (with `ref_model_sync_kl`: only if the last step's raw KL, mean
over all processes, exceeded it), every reference tensor R_j takes TRL's own mix (`SyncRefModelCallback`) of the
policy's tensor P_j, alpha = `ref_model_mixup_alpha` (alpha = 1: ProRL's hard reset):

    R_j <- alpha * P_j + (1 - alpha) * R_j

Full models: R is the trainer's `ref_model`, P every policy parameter, as in TRL. PEFT models have no `ref_model` (the
stock reference is the policy with its adapter disabled, or TRL's frozen "ref" adapter copy): R is a private copy of
the policy's trainable tensors (LoRA A and B, biases, `modules_to_save`, DoRA magnitudes) taken when training starts.
For LoRA the mix acts on the factors, A_ref <- alpha A + (1 - alpha) A_ref and B_ref likewise, so for alpha < 1 the
reference's update B_ref A_ref is not the mix of the two products. Until the first sync the stock reference is used;
after it, the reference forward runs with R exchanged into the policy's own tensors (`use_reference`) and the policy's
values exchanged back afterwards. The base weights are never written, and the copy lives outside the model, so
nothing that reads the model's state (Unsloth's vLLM LoRA sync, adapter saving) sees a second adapter.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import warnings
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch
import trl.trainer.utils as trl_utils
from torch.distributed.tensor import DTensor, distribute_tensor
from transformers import TrainerCallback
from trl.trainer.callbacks import SyncRefModelCallback

METRIC = "adaptive_kl/ref_syncs"
STATE_FILE = "adaptive_kl_reference.pt"
stock_use_adapter = trl_utils.use_adapter
# The reference the PEFT reference forward exchanges in while a trainer generates: None before its first sync.
_MOVED: contextvars.ContextVar[Optional["AdapterReference"]] = contextvars.ContextVar("adaptive_kl_moved_reference",
                                                                                       default=None)


@dataclass(frozen=True)
class SyncSchedule:
    """When a sync is due (`ref_model_sync_steps`, `ref_model_sync_kl`) and what it does (`ref_model_mixup_alpha`,
    `ref_model_sync_reset_optimizer`), read from the trainer's config."""

    steps: int
    alpha: float
    min_kl: Optional[float]
    reset_optimizer: bool

    @classmethod
    def from_args(cls, args: Any) -> "SyncSchedule":
        return cls(args.ref_model_sync_steps, args.ref_model_mixup_alpha, getattr(args, "ref_model_sync_kl", None),
                   getattr(args, "ref_model_sync_reset_optimizer", False))

    def due(self, global_step: int, raw_kl: float) -> bool:
        """global_step % steps == 0 and, with min_kl, raw_kl > min_kl (a NaN KL, none measured, never triggers)."""
        return global_step % self.steps == 0 and (self.min_kl is None or raw_kl > self.min_kl)


class _Parameters:
    """Tensors in the shape TRL's `SyncRefModelCallback._sync_target_model` takes a model: `.parameters()`."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.tensors = tensors

    def parameters(self) -> Iterator[torch.Tensor]:
        return iter(self.tensors)


def _exchange(a: torch.Tensor, b: torch.Tensor) -> None:
    """a <-> b in place (values only: both stay the same tensor objects); exact, one tensor of temporary memory."""
    held = a.clone()
    a.copy_(b)
    b.copy_(held)


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor on the host: an FSDP2 shard (DTensor) is gathered from every process (all must call this)."""
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().cpu()


def _load_into(target: torch.Tensor, source: torch.Tensor) -> None:
    """target <- source (a whole tensor, the same on every process); an FSDP2 shard takes its own part."""
    if isinstance(target, DTensor):
        source = distribute_tensor(source.to(target.device), target.device_mesh, target.placements)
    target.copy_(source)


class AdapterReference:
    """A PEFT policy's reference: R_j, a private copy of each trainable tensor P_j (initially equal to it)."""

    def __init__(self, model: torch.nn.Module) -> None:
        named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("sync_ref_model=True needs trainable parameters in the PEFT model; it has none.")
        self.names = [name for name, _ in named]
        self.policy = [p for _, p in named]
        with torch.no_grad():
            self.tensors = [p.detach().clone() for p in self.policy]
        # PEFT's LoRA dropout (`lora_dropout`), which the stock reference skips (its adapter is disabled): the moved
        # reference's forward runs through the adapter, so it is switched off there (train mode would draw it)
        self.dropouts = [module for name, module in model.named_modules()
                         if isinstance(module, torch.nn.Dropout) and ".lora_dropout." in f".{name}"]

    def mix(self, alpha: float) -> None:
        """R_j <- alpha * P_j + (1 - alpha) * R_j, by TRL's own function."""
        with torch.no_grad():
            SyncRefModelCallback._sync_target_model(_Parameters(self.policy), _Parameters(self.tensors), alpha)

    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        return list(zip(self.names, self.tensors))

    @contextlib.contextmanager
    def swapped_in(self) -> Iterator[None]:
        """P_j <-> R_j for the block, LoRA dropout off: the policy's tensors hold the reference's values, and exactly
        their own again afterwards, also when the block raises (each dropout its own mode again). In place under
        no_grad: the parameters, their gradients and the optimizer state stay the same objects with the same values,
        and no autograd graph records the exchange."""
        exchanged = 0
        modes = [dropout.training for dropout in self.dropouts]
        try:
            with torch.no_grad():
                for p, r in zip(self.policy, self.tensors):
                    _exchange(p, r)
                    exchanged += 1
            for dropout in self.dropouts:
                dropout.eval()
            yield
        finally:
            for dropout, mode in zip(self.dropouts, modes):
                dropout.train(mode)
            with torch.no_grad():
                for p, r in zip(self.policy[:exchanged], self.tensors[:exchanged]):
                    _exchange(p, r)


class ModelReference:
    """A full model's reference: the trainer's `ref_model`, mixed with every policy parameter as TRL mixes it."""

    def __init__(self, policy: torch.nn.Module, ref_model: torch.nn.Module) -> None:
        self.policy = policy
        self.ref_model = ref_model

    def mix(self, alpha: float) -> None:
        """R_j <- alpha * P_j + (1 - alpha) * R_j over every parameter, by TRL's own function."""
        with torch.no_grad():
            SyncRefModelCallback._sync_target_model(self.policy, self.ref_model, alpha)

    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        return list(self.ref_model.state_dict().items())


Reference = AdapterReference | ModelReference


class ReferenceSync(TrainerCallback):
    """One trainer's reference syncing: the reference (bound when training starts, after the model is prepared, since
    FSDP2 replaces the parameters then), `syncs` (how many so far) and `last_sync_step`. Each optimizer step's end
    decides from the global step and the step's all-process raw KL, so every process syncs at the same steps."""

    def __init__(self, trainer: Any, schedule: SyncSchedule) -> None:
        self.trainer = trainer
        self.schedule = schedule
        self.reference: Optional[Reference] = None
        self.syncs = 0
        self.last_sync_step = 0
        self._restored: Optional[dict[str, torch.Tensor]] = None  # read from a checkpoint before binding

    def bind(self) -> Reference:
        """The reference, built on first use from the trainer's (prepared) model, or restored from a checkpoint."""
        if self.reference is None:
            trainer = self.trainer
            policy = trainer.accelerator.unwrap_model(trainer.model)
            self.reference = (ModelReference(policy, trainer.ref_model) if trainer.ref_model is not None
                              else AdapterReference(policy))
            if self._restored is not None:
                self._load_tensors(self._restored)
                self._restored = None
        return self.reference

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.bind()
        # e.g. TRL's default of 512 steps in a shorter run; a sync after the last step moves nothing that trains
        if 0 < state.max_steps <= self.schedule.steps:
            warnings.warn(f"adaptive_kl: sync_ref_model=True syncs every ref_model_sync_steps={self.schedule.steps} "
                          f"optimizer steps, and this run has {state.max_steps}: no step trains against a synced "
                          f"reference. Set ref_model_sync_steps below {state.max_steps} to sync it.", UserWarning,
                          stacklevel=2)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        trainer = self.trainer
        if self.schedule.due(state.global_step, trainer.adaptive_kl.last_raw_kl):
            self.bind().mix(self.schedule.alpha)
            self.syncs += 1
            self.last_sync_step = state.global_step
            if self.schedule.reset_optimizer:  # Adam's moments and step counts; the scheduler keeps its step
                trainer.optimizer.state.clear()
        # One value, not one per step: the logged mean over a logging window is then the count at its end.
        trainer._metrics["train"][METRIC] = [float(self.syncs)]

    def moved_adapter(self) -> Optional[AdapterReference]:
        """The PEFT reference to exchange in for the reference forward: None until the first sync (stock reference)."""
        return self.reference if self.syncs and isinstance(self.reference, AdapterReference) else None

    def save(self, folder: str, write: bool) -> None:
        """`write` (the saving process) gathers the reference to the host and writes it with the count and the last
        sync step to `folder`/STATE_FILE; every other process takes part in the gather of each FSDP2 shard alone (a
        whole model's host copy on each of them would be thrown away)."""
        named = self.bind().named_tensors()
        if not write:
            for _, tensor in named:
                if isinstance(tensor, DTensor):
                    tensor.full_tensor()
            return
        tensors = {name: _full(tensor) for name, tensor in named}
        torch.save({"syncs": self.syncs, "last_sync_step": self.last_sync_step, "reference": tensors},
                   os.path.join(folder, STATE_FILE))

    def load(self, folder: str) -> None:
        """Restore what `save` wrote; a checkpoint without it (saved without syncing, or the file lost) warns, naming
        it: no sync so far, so TRL's own reference serves until the first sync. That sync mixes the policy into the
        trainer's reference model (a full model), or into a copy of the adapter as resumed (PEFT: the initial adapter
        an uninterrupted run would have mixed into is not in the checkpoint)."""
        path = os.path.join(folder, STATE_FILE)
        if not os.path.exists(path):
            into = ("the trainer's reference model" if self.trainer.ref_model is not None else
                    "a copy of the adapter as resumed, not into the initial adapter (which the checkpoint lacks)")
            warnings.warn(f"adaptive_kl: {path} is missing: no sync so far, so TRL's own reference serves until the "
                          f"first sync, which then mixes the policy into {into}.", UserWarning, stacklevel=3)
            return
        state = torch.load(path, map_location="cpu", weights_only=True)
        self.syncs, self.last_sync_step = state["syncs"], state["last_sync_step"]
        if self.reference is None:
            self._restored = state["reference"]
        else:
            self._load_tensors(state["reference"])

    def _load_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        named = self.reference.named_tensors()
        if set(tensors) != {name for name, _ in named}:
            raise ValueError(
                f"The checkpoint's synced reference ({STATE_FILE}) has other tensors than this model's reference: "
                f"missing {sorted({n for n, _ in named} - set(tensors))[:3]}, unexpected "
                f"{sorted(set(tensors) - {n for n, _ in named})[:3]}. Resume with the model the checkpoint was saved from."
            )
        with torch.no_grad():
            for name, tensor in named:
                _load_into(tensor, tensors[name])


def warn_if_synced_reference_dropped(checkpoint: str) -> None:
    """A checkpoint whose run synced its reference, resumed with sync_ref_model=False: the run goes on from TRL's own
    reference, not the synced one the checkpoint holds; said, naming the file (its tensors are mapped, not read)."""
    path = os.path.join(checkpoint, STATE_FILE)
    if not os.path.exists(path):
        return
    syncs = torch.load(path, map_location="cpu", weights_only=True, mmap=True)["syncs"]
    if syncs:
        warnings.warn(f"adaptive_kl: {path} holds the reference this run synced {syncs} time(s), and "
                      "sync_ref_model=False now: the resumed run uses the trainer's own reference instead. Set "
                      "sync_ref_model=True (with the checkpoint's sync settings) to continue from the synced one.",
                      UserWarning, stacklevel=3)


def check_supported(trainer: Any) -> None:
    """Refuse, before training, the setups where the synced reference cannot be kept correctly."""
    plugin = getattr(trainer.accelerator.state, "deepspeed_plugin", None)
    if plugin is not None and plugin.zero_stage == 3:
        raise NotImplementedError(
            "sync_ref_model=True is not supported under DeepSpeed ZeRO-3 by unsloth_adaptive_kl: ZeRO-3 partitions the "
            "parameters, so the PEFT reference copy and the checkpointed reference would hold partitions, not the "
            "tensors. Use ZeRO-2, DDP or FSDP2; or unsloth_adaptive_kl.unpatch() for TRL's own full-model sync "
            "(no PEFT, the synced reference not saved in checkpoints)."
        )
    fsdp = getattr(trainer.accelerator.state, "fsdp_plugin", None)
    if fsdp is not None and getattr(fsdp, "fsdp_version", 1) != 2:
        raise NotImplementedError(
            "sync_ref_model=True is supported with FSDP2 (fsdp_version=2), not FSDP1, by unsloth_adaptive_kl: FSDP1 "
            "flattens the parameters, so the reference could not be exchanged into them tensor by tensor."
        )


def attach_reference_sync(trainer: Any) -> ReferenceSync:
    """Give a trainer with `sync_ref_model=True` its syncing (`trainer.adaptive_kl_reference`, also a callback)."""
    check_supported(trainer)
    trainer.adaptive_kl_reference = ReferenceSync(trainer, SyncSchedule.from_args(trainer.args))
    trainer.add_callback(trainer.adaptive_kl_reference)
    return trainer.adaptive_kl_reference


@contextlib.contextmanager
def reference_for_generation(trainer: Any) -> Iterator[None]:
    """While `trainer` generates and scores a batch, `use_reference` exchanges in its synced PEFT reference."""
    sync = getattr(trainer, "adaptive_kl_reference", None)
    token = _MOVED.set(sync.moved_adapter() if sync is not None else None)
    try:
        yield
    finally:
        _MOVED.reset(token)


@contextlib.contextmanager
def use_reference(model: Any, adapter_name: Optional[str]) -> Iterator[None]:
    """Stands in for TRL's `use_adapter` where `_generate_and_score_completions` computes a PEFT model's reference
    log-probs: TRL's own (adapter disabled, or the "ref" adapter) until the first sync, the synced reference after."""
    moved = _MOVED.get()
    if moved is None:
        with stock_use_adapter(model, adapter_name):
            yield
    else:
        with moved.swapped_in():
            yield
