"""The dynamic beta over real short runs, checkpoint/resume and two processes (SPEC 3.5, 5)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from unsloth_adaptive_kl import AdaptiveKLConfig, DynamicBeta

from .conftest import constant_reward, logged, make_trainer

DYNAMIC = dict(kl_adaptation_method="dynamic", gradient_accumulation_steps=1, beta=0.04)


def test_constant_reward_above_threshold_decays_geometrically_to_the_floor(tokenizer, tmp_path) -> None:
    trainer = make_trainer(
        tokenizer, str(tmp_path), constant_reward(1.0), max_steps=5, dynamic_beta_decay=0.5, beta_min=0.006, **DYNAMIC
    )
    trainer.train()
    # beta_k = max(0.04 * 0.5^k, 0.006) used by step k+1
    assert logged(trainer, "adaptive_kl/current_beta") == pytest.approx([0.04, 0.02, 0.01, 0.006, 0.006])
    assert trainer.current_beta == pytest.approx(0.006)
    assert trainer.beta == 0.04 and trainer.args.beta == 0.04  # the live beta never overwrites the stock one


def test_reward_below_threshold_leaves_beta_unchanged(tokenizer, tmp_path) -> None:
    trainer = make_trainer(tokenizer, str(tmp_path), constant_reward(0.8), max_steps=3, **DYNAMIC)  # 0.8 is not > 0.8
    trainer.train()
    assert logged(trainer, "adaptive_kl/current_beta") == pytest.approx([0.04, 0.04, 0.04])
    assert logged(trainer, "reward") == pytest.approx([0.8, 0.8, 0.8])


def test_schedule_cut_off_sets_beta_min(tokenizer, tmp_path) -> None:
    trainer = make_trainer(
        tokenizer, str(tmp_path), constant_reward(0.0), max_steps=4, beta_min=0.01, beta_schedule_steps=2, **DYNAMIC
    )
    trainer.train()
    assert logged(trainer, "adaptive_kl/current_beta") == pytest.approx([0.04, 0.04, 0.01, 0.01])


def test_at_most_one_decay_per_generation_batch(tokenizer, tmp_path) -> None:
    """num_iterations=2: steps 1-2 train on batch 1 and steps 3-4 on batch 2, so beta decays after steps 1 and 3."""
    trainer = make_trainer(
        tokenizer, str(tmp_path), constant_reward(1.0), max_steps=4, num_iterations=2, dynamic_beta_decay=0.5, **DYNAMIC
    )
    trainer.train()
    assert logged(trainer, "adaptive_kl/current_beta") == pytest.approx([0.04, 0.02, 0.02, 0.01])


def test_controller_state_round_trip() -> None:
    config = AdaptiveKLConfig(kl_adaptation_method="dynamic", dynamic_beta_decay=0.5)
    controller = DynamicBeta(1.0, config)
    controller.observe_rewards(0.9)
    controller.step(1)
    restored = DynamicBeta(1.0, config)
    restored.load_state_dict(json.loads(json.dumps(controller.state_dict())))
    assert restored.state_dict() == controller.state_dict() == {
        "value": 0.5, "generation_batch": 1, "batch_reward": 0.9, "last_decayed_batch": 1
    }
    restored.step(2)  # same generation batch: no second decay
    assert restored.value == 0.5


def test_resume_from_checkpoint_restores_beta(tokenizer, tmp_path) -> None:
    settings = dict(max_steps=8, dynamic_beta_decay=0.8, save_strategy="steps", save_steps=4, **DYNAMIC)
    full = make_trainer(tokenizer, str(tmp_path / "full"), constant_reward(1.0), **settings)
    full.train()
    expected = 0.04 * 0.8**8
    assert full.current_beta == pytest.approx(expected)
    checkpoint = tmp_path / "full" / "checkpoint-4"
    assert json.loads((checkpoint / "adaptive_kl_state.json").read_text())["value"] == pytest.approx(0.04 * 0.8**4)

    resumed = make_trainer(tokenizer, str(tmp_path / "resumed"), constant_reward(1.0), **settings)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert logged(resumed, "adaptive_kl/current_beta")[-4:] == pytest.approx([0.04 * 0.8**k for k in range(4, 8)])
    assert resumed.current_beta == pytest.approx(full.current_beta, rel=1e-12)


def test_two_processes_share_the_globally_averaged_beta(tmp_path) -> None:
    """Rank 0 rewards 1.0 and rank 1 rewards 0.6: the global mean 0.8 crosses a 0.7 threshold but not 0.9, while
    either rank alone would decide the other way for one of them."""
    script = Path(__file__).with_name("distributed_beta.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[1])}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", str(script), str(tmp_path)]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert ranks[0] == ranks[1]
    for threshold, run in ranks[0].items():
        assert run["reward"] == pytest.approx([0.8, 0.8, 0.8])
        decay = 0.5 if float(threshold) < 0.8 else 1.0
        assert run["betas"] == pytest.approx([0.04, 0.04 * decay, 0.04 * decay**2])
        assert run["final_beta"] == pytest.approx(0.04 * decay**3)
