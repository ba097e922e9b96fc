"""Run by test_dynamic_beta under `torchrun --nproc_per_node 2`: each rank writes the betas it used."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from tests.conftest import build_tokenizer, logged, make_trainer

RANK_REWARD = {0: 1.0, 1: 0.6}


def rank_reward(completions: list[str], **kwargs: Any) -> list[float]:
    """The rank's mean reward, +/- 0.2 alternately within each group (so advantages, and the KL, are not zero)."""
    mean = RANK_REWARD[int(os.environ["RANK"])]
    return [mean + (0.2 if index % 2 else -0.2) for index in range(len(completions))]


def main(output_dir: str) -> None:
    tokenizer = build_tokenizer()
    runs = {}
    for threshold in (0.7, 0.9):
        trainer = make_trainer(
            tokenizer,
            os.path.join(output_dir, f"threshold{threshold}"),
            rank_reward,
            kl_adaptation_method="dynamic",
            reward_threshold=threshold,
            dynamic_beta_decay=0.5,
            gradient_accumulation_steps=1,
            max_steps=3,
        )
        trainer.train()
        runs[threshold] = {
            "reward": logged(trainer, "reward"),
            "betas": logged(trainer, "adaptive_kl/current_beta"),
            "raw_kl": logged(trainer, "adaptive_kl/raw_kl"),
            "sequence_kl": logged(trainer, "adaptive_kl/sequence_kl"),
            "final_beta": trainer.current_beta,
        }
    with open(os.path.join(output_dir, f"rank{os.environ['RANK']}.json"), "w") as f:
        json.dump(runs, f)


if __name__ == "__main__":
    main(sys.argv[1])
