"""Run by test_ref_sync under `torchrun --nproc_per_node 2` (gloo, CPU): `python tests/distributed_ref_sync.py MODE DIR`.

ddp: real GRPO runs under DDP (a PEFT model with an alpha = 0.5 sync after every step whose all-process raw KL exceeded
a threshold, and a full model with a hard sync every 2 steps); each rank saves what it logged and its reference.
fsdp2: the reference of a LoRA model sharded by FSDP2's `fully_shard` (accelerate runs no FSDP on CPUs, so no trainer
here): mixed after an optimizer step, exchanged in for a forward, saved (gathered) and loaded (re-sharded) by
`ReferenceSync.save`/`load`; each rank saves the whole tensors it sees.
"""

from __future__ import annotations

import os
import sys
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist

from tests.conftest import logged, make_trainer
from tests.torchrun_exit import end_process
from unsloth_adaptive_kl.integrations.ref_sync import AdapterReference, ReferenceSync, SyncSchedule, _full
from unsloth_adaptive_kl.tools.tiny import add_lora, build_tiny_model, build_tokenizer

RANK_THRESHOLD = 1e-3  # ref_model_sync_kl of the PEFT run


def ddp(output_dir: str) -> dict[str, Any]:
    tokenizer = build_tokenizer()
    runs = {
        "peft": dict(model_kind="peft_config", sync_ref_model=True, ref_model_sync_steps=1, ref_model_mixup_alpha=0.5,
                     ref_model_sync_kl=RANK_THRESHOLD, max_steps=4, save_strategy="steps", save_steps=4),
        "full": dict(model_kind="full", sync_ref_model=True, ref_model_sync_steps=2, ref_model_mixup_alpha=1.0,
                     max_steps=3),
    }
    results: dict[str, Any] = {}
    for name, settings in runs.items():
        trainer = make_trainer(tokenizer, os.path.join(output_dir, name), gradient_accumulation_steps=1, **settings)
        trainer.train()
        sync = trainer.adaptive_kl_reference
        policy = trainer.accelerator.unwrap_model(trainer.model)
        results[name] = {
            "raw_kl": logged(trainer, "adaptive_kl/raw_kl"), "syncs": logged(trainer, "adaptive_kl/ref_syncs"),
            "count": sync.syncs, "last_sync_step": sync.last_sync_step,
            "reference": {n: _full(t).clone() for n, t in sync.reference.named_tensors()},
            "policy": {n: _full(p).clone() for n, p in policy.named_parameters() if p.requires_grad},
        }
    return results


def fsdp2(output_dir: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    tokenizer = build_tokenizer()
    model = add_lora(build_tiny_model(tokenizer, seed=0), seed=0)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.base_model.model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    reference = AdapterReference(model)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ids = torch.arange(2, 12).view(2, 5) + dist.get_rank()  # each rank its own batch: the gradients are all-reduced
    model(input_ids=ids).logits.square().mean().backward()
    optimizer.step()
    policy = {n: _full(p).clone() for n, p in zip(reference.names, reference.policy)}
    initial = {n: _full(t).clone() for n, t in reference.named_tensors()}
    reference.mix(0.5)
    mixed = {n: _full(t).clone() for n, t in reference.named_tensors()}
    probe = torch.arange(2, 8).view(1, 6)
    with torch.no_grad():
        policy_logits = model(input_ids=probe).logits
        with reference.swapped_in():
            reference_logits = model(input_ids=probe).logits
        after_logits = model(input_ids=probe).logits
    restored = {n: _full(p).clone() for n, p in zip(reference.names, reference.policy)}
    # a checkpoint round trip by the trainer's own save and load: gathered on save (process 0 writes, process 1 takes
    # part in each gather alone; without it process 0 waits forever), re-sharded on load into a reference that has
    # moved on since
    sync = ReferenceSync(SimpleNamespace(ref_model=None), SyncSchedule(steps=1, alpha=0.5, min_kl=None,
                                                                       reset_optimizer=False))
    sync.reference, sync.syncs, sync.last_sync_step = reference, 1, 1
    sync.save(output_dir, write=dist.get_rank() == 0)
    dist.barrier()
    reference.mix(1.0)
    sync.load(output_dir)
    return {
        "sharded": all(t.to_local().numel() < t.numel() or t.numel() < 2 for t in reference.tensors),
        "policy": policy, "initial": initial, "mixed": mixed, "restored": restored,
        "reloaded": {n: _full(t).clone() for n, t in reference.named_tensors()},
        "policy_logits": policy_logits, "reference_logits": reference_logits, "after_logits": after_logits,
    }


def main(mode: str, output_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # before any model is saved (process 0 writes, see make_trainer)
    results = {"ddp": ddp, "fsdp2": fsdp2}[mode](output_dir)
    torch.save(results, os.path.join(output_dir, f"{mode}-rank{os.environ['RANK']}.pt"))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    end_process()
