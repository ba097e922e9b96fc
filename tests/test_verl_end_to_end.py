"""verl end to end: `python -m verl.trainer.main_ppo` on CPU with the integration, through a checkpoint and its
resume, beside stock verl resumed from the same checkpoint (tests/verl_cpu.py: a CPU platform and engine registered
through verl's own registries, one gloo process group, and an HF-generate rollout). Its own file, apart from
tests/test_verl.py: its three runs of main_ppo take minutes, and pytest-xdist hands out a file to a worker, so the
other worker runs the rest of the verl tests beside it."""

from __future__ import annotations

import json
import math
import os
import sys

import pytest

# Without verl this test skips; `.ci/run` installs it in a row of its own and sets ADAPTIVE_KL_REQUIRE_VERL=1, so
# there a missing verl is an error, not a skip.
if os.environ.get("ADAPTIVE_KL_REQUIRE_VERL") != "1":
    pytest.importorskip("verl")

from unsloth_adaptive_kl.integrations import verl as verl_kl  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import verl_cpu  # noqa: E402
from verl_cpu import ADAPTIVE_RUN, BETA_MAX, HORIZON, KL_TARGET, REWARD_BETA  # noqa: E402


def test_main_ppo_end_to_end_betas_follow_the_controllers_and_survive_resume(tmp_path):
    paths = verl_cpu.prepare_e2e(str(tmp_path))
    ckpt = str(tmp_path / "ckpt")

    def launch(name, steps, extra):
        records, _ = verl_cpu.run_main_ppo(verl_cpu.e2e_overrides(paths, ckpt, steps) + extra,
                                           str(tmp_path / f"{name}.jsonl"), str(tmp_path))
        return {r["step"]: r["data"] for r in records}

    first = launch("first", 2, ADAPTIVE_RUN)
    with open(os.path.join(ckpt, "global_step_2", verl_kl.STATE_FILE)) as handle:
        saved = json.load(handle)
    resumed = launch("resumed", 3, ADAPTIVE_RUN)  # resume_mode=auto: from global_step_2
    assert sorted(first) == [1, 2] and sorted(resumed) == [3]
    steps = {**first, **resumed}

    # the loss beta: dynamic, every batch's reward > -1, so beta halves after every step
    assert [steps[s]["adaptive_kl/current_beta"] for s in (1, 2, 3)] == [0.1, 0.05, 0.025]
    assert [steps[s]["actor/kl_coef"] for s in (1, 2, 3)] == [0.1, 0.05, 0.025]  # what the workers used
    # the reward beta: target, n = 2 prompts x 2 samples, within beta_max; its error is clamped at +0.2 (any KL
    # measure is far above KL_TARGET here): which KL it reads, the token mean, is pinned by
    # test_reward_target_controller_follows_the_token_mean_kl_within_bounds
    beta = REWARD_BETA
    for s in (1, 2, 3):
        assert steps[s]["actor/reward_kl_penalty_coeff"] == pytest.approx(beta, rel=1e-12)
        assert steps[s]["adaptive_kl/reward/current_beta"] == steps[s]["actor/reward_kl_penalty_coeff"]
        error = min(max(steps[s]["actor/reward_kl_penalty"] / KL_TARGET - 1, -0.2), 0.2)
        beta = min(beta * (1 + error * 4 / HORIZON), BETA_MAX)
    # the first step after resume uses the saved betas
    assert saved["global_steps"] == 2
    assert steps[3]["adaptive_kl/current_beta"] == saved["loss"]["value"]
    assert steps[3]["actor/reward_kl_penalty_coeff"] == saved["reward"]["value"] != REWARD_BETA
    for s in (1, 2, 3):
        for name in ("raw_kl", "adapted_kl"):
            assert math.isfinite(steps[s]["adaptive_kl/" + name])

    # stock verl beside it: its adaptive controller, resumed from the same checkpoint, restarts from kl_coef
    # (verl issue #2653). If verl starts checkpointing it, this flips.
    stock = launch("stock", 3, [
        "trainer.v1.trainer_mode=sync", "algorithm.use_kl_in_reward=True", "algorithm.kl_ctrl.type=adaptive",
        f"algorithm.kl_ctrl.kl_coef={REWARD_BETA}", f"algorithm.kl_ctrl.target_kl={KL_TARGET}",
        f"algorithm.kl_ctrl.horizon={HORIZON}", "algorithm.kl_penalty=kl", "trainer.resume_mode=resume_path",
        f"trainer.resume_from_path={os.path.join(ckpt, 'global_step_2')}",
        f"trainer.default_local_dir={tmp_path / 'ckpt_stock'}"])
    assert sorted(stock) == [3]
    assert stock[3]["actor/reward_kl_penalty_coeff"] == REWARD_BETA
