"""Run by test_scaling_out under `accelerate launch --config_file docs/accelerate/<ddp|fsdp2>.yaml --num_processes 2`
(`python tests/scaling_out_run.py OUTPUT_DIR cpu|cuda`): a 3-step GRPO run of the tiny model with `dynamic` beta, each
process scoring its completions differently, two micro-batches a step; each rank writes the adaptive_kl metrics it
logged at every step, its own micro-batches' KL sums before any gather (the test computes the all-process metrics from
both ranks' by hand), the beta it ends with and how accelerate ran it to OUTPUT_DIR/rank<N>.json."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch

import unsloth_adaptive_kl  # noqa: F401  (first: patches trl)
from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer
from unsloth_adaptive_kl.tools.tiny import add_lora, build_tiny_model, build_tokenizer

from tests.torchrun_exit import end_process

RANK_REWARD = {0: 1.0, 1: 0.6}  # all-process mean 0.8: above the 0.7 threshold, though rank 1's own 0.6 is below


def rank_reward(completions: list[str], **kwargs: Any) -> list[float]:
    """The rank's mean reward, +/- 0.2 alternately (so that the advantages, and the KL, are not zero)."""
    mean = RANK_REWARD[int(os.environ["RANK"])]
    return [mean + (0.2 if index % 2 else -0.2) for index in range(len(completions))]


def main(output_dir: str, device: str) -> None:
    torch.set_num_threads(1)
    tokenizer = build_tokenizer()
    args = GRPOConfig(
        output_dir=output_dir, use_cpu=device == "cpu", bf16=False, report_to="none", disable_tqdm=True,
        save_strategy="no", per_device_train_batch_size=4, num_generations=4, max_completion_length=8, max_steps=3,
        gradient_accumulation_steps=2,
        logging_steps=1, learning_rate=5e-3, beta=0.04, seed=0,
        kl_adaptation_method="dynamic", reward_threshold=0.7, dynamic_beta_decay=0.5,
    )
    dataset = Dataset.from_dict({"prompt": ["ab:", "cde:", "fg:", "h:", "bad:", "ce:", "gh:", "abc:"] * 4})
    trainer = GRPOTrainer(model=add_lora(build_tiny_model(tokenizer)), processing_class=tokenizer,
                          reward_funcs=[rank_reward], args=args, train_dataset=dataset)
    local = []  # this rank's training micro-batches, as the core receives them before the all-process gather
    record = trainer.adaptive_kl.record

    def recording(term: Any, **kwargs: Any) -> Any:
        if term is not None and kwargs["train"]:
            local.append({"step": kwargs["completed_steps"], "lengths": term.lengths.tolist(),
                          "sums": term.sequence_kl.tolist(), "raw": float(term.raw), "adapted": float(term.adapted)})
        return record(term, **kwargs)

    trainer.adaptive_kl.record = recording
    trainer.train()
    logged = [{key: value for key, value in entry.items()
               if key.startswith("adaptive_kl/") or key in ("reward", "step")}
              for entry in trainer.state.log_history if "adaptive_kl/current_beta" in entry]
    state = trainer.accelerator.state
    result = {
        "world_size": state.num_processes,
        "distributed_type": state.distributed_type.value,
        "backend": state.backend,
        "fsdp_version": getattr(getattr(state, "fsdp_plugin", None), "fsdp_version", None),
        "model": type(trainer.model_wrapped).__name__,
        "logged": logged,
        "micro_batches": local,
        "final_beta": trainer.current_beta,
    }
    with open(os.path.join(output_dir, f"rank{state.process_index}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    end_process()
