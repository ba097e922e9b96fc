"""Run by test_dynamic_beta under `torchrun --nproc_per_node 2`: each rank writes the betas (and, with the KL in the
reward, the penalties) it used, and, with the KL in the reward, each scored batch's per-completion KL and lengths as
this rank held them before any gather, with the penalties the scoring returned (every rank's)."""

from __future__ import annotations

import json
import os
import sys
from typing import Any


from tests.conftest import logged, make_trainer
from tests.torchrun_exit import end_process
from unsloth_adaptive_kl.tools.tiny import build_tokenizer

RANK_REWARD = {0: 1.0, 1: 0.6}


def rank_reward(completions: list[str], **kwargs: Any) -> list[float]:
    """The rank's mean reward, +/- 0.2 alternately within each group (so advantages, and the KL, are not zero)."""
    mean = RANK_REWARD[int(os.environ["RANK"])]
    return [mean + (0.2 if index % 2 else -0.2) for index in range(len(completions))]


def main(output_dir: str) -> None:
    tokenizer = build_tokenizer()
    runs = {}
    for placement, threshold in (("loss", 0.7), ("loss", 0.9), ("reward", 0.7)):
        trainer = make_trainer(
            tokenizer,
            os.path.join(output_dir, f"{placement}{threshold}"),
            rank_reward,
            kl_adaptation_method="dynamic",
            reward_threshold=threshold,
            dynamic_beta_decay=0.5,
            gradient_accumulation_steps=1,
            max_steps=3,
            kl_placement=placement,
            kl_reduction="sequence_sum" if placement == "reward" else "loss_type",
        )
        scored: list[dict[str, Any]] = []  # the KL in the reward: each scored batch, as this rank held it
        penalize = trainer.adaptive_kl.penalize

        def recording(term: Any, **kwargs: Any) -> Any:
            penalty, metrics = penalize(term, **kwargs)
            if kwargs["train"]:
                scored.append({"step": kwargs["completed_steps"], "kl": term.sequence_kl.tolist(),
                               "lengths": term.lengths.tolist(), "penalty": penalty.tolist()})
            return penalty, metrics

        trainer.adaptive_kl.penalize = recording
        trainer.train()
        runs[f"{placement} {threshold}"] = {
            "scored": scored,
            "reward": logged(trainer, "reward"),
            "betas": logged(trainer, "adaptive_kl/current_beta"),
            "raw_kl": logged(trainer, "adaptive_kl/raw_kl"),
            "sequence_kl": logged(trainer, "adaptive_kl/sequence_kl"),
            "reward_penalty": logged(trainer, "adaptive_kl/reward_penalty"),
            "final_beta": trainer.current_beta,
        }
    with open(os.path.join(output_dir, f"rank{os.environ['RANK']}.json"), "w") as f:
        json.dump(runs, f)


if __name__ == "__main__":
    main(sys.argv[1])
    end_process()
