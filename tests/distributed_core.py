"""Run by test_adaptive_kl under `torchrun --nproc_per_node 2` (gloo): the public `AdaptiveKL` in an own loop, each
process with a batch of its own size (`batch(rank)`), `gather` = an all-gather over both; each rank writes the
metrics and the `target` beta it got."""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

from tests.torchrun_exit import end_process
from unsloth_adaptive_kl import AdaptiveKL, AdaptiveKLConfig

CONFIG = dict(kl_adaptation_method="target", kl_target=0.18, kl_horizon=20.0)  # the KL is 0.203: inside the clamp
BETA = 0.1


def batch(rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logps, ref, mask) of rank `rank`: 2 completions on rank 0 and 3 on rank 1, of lengths 1 to 4."""
    generator = torch.Generator().manual_seed(rank)
    rows = 2 + rank
    logps, ref = -torch.rand(rows, 4, generator=generator) * 2, -torch.rand(rows, 4, generator=generator) * 2
    lengths = torch.arange(1 + rank, 1 + rank + rows).clamp(max=4)
    mask = (torch.arange(4) < lengths[:, None]).float()
    return logps, ref, mask


def all_gather(tensor: torch.Tensor) -> torch.Tensor:
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, tensor.contiguous())
    return torch.cat(parts)


def main(output_dir: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    akl = AdaptiveKL(AdaptiveKLConfig(**CONFIG), beta=BETA, loss_type="bnpo")
    _, metrics = akl.kl_loss(*batch(rank), gather=all_gather)
    beta = akl.step()
    with open(os.path.join(output_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"metrics": metrics, "beta": beta, "last_raw_kl": akl.last_raw_kl}, f)


if __name__ == "__main__":
    main(sys.argv[1])
    end_process()
