"""The dynamic beta over real short runs, checkpoint/resume and two processes (SPEC 3.5, 5)."""

from __future__ import annotations

import json
import math
import re
import warnings
from pathlib import Path
from typing import Any

import pytest

from unsloth_adaptive_kl import AdaptiveKL, AdaptiveKLConfig
from unsloth_adaptive_kl.core.controllers import DynamicBeta
from unsloth_adaptive_kl.integrations import trainer_hooks
from unsloth_adaptive_kl.integrations.trainer_hooks import loads_only_adapter_subfolders

from .conftest import constant_reward, logged, make_trainer, torchrun

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


@pytest.mark.parametrize("beta_min", [0.01, 0.0])
def test_schedule_cut_off_sets_beta_min(tokenizer, tmp_path, recwarn, beta_min: float) -> None:
    """From step 3 beta is beta_min; at the default beta_min=0 the KL term is off while trainer.beta stays 0.04 (the
    trainer's own KL line, which the adapted loss reads, still runs) and the KL is still measured."""
    trainer = make_trainer(
        tokenizer, str(tmp_path), constant_reward(0.0), max_steps=4, beta_min=beta_min, beta_schedule_steps=2,
        **DYNAMIC
    )
    trainer.train()
    assert logged(trainer, "adaptive_kl/current_beta") == pytest.approx([0.04, 0.04, beta_min, beta_min])
    assert len(logged(trainer, "adaptive_kl/raw_kl")) == 4 and trainer.state.global_step == 4
    assert not [w for w in recwarn if "no step trains at it" in str(w.message)]


def test_a_cut_off_the_run_ends_before_is_said(tokenizer, tmp_path) -> None:
    """beta_schedule_steps=2 in a run of 2 steps: beta = beta_min would start at step 3, so it did nothing, silently;
    said when training starts (as an unreached reference sync is). A run set by epochs (args.max_steps=-1) is said
    from the steps the trainer computed for it (state.max_steps)."""
    from transformers import TrainerState

    from unsloth_adaptive_kl.integrations.trainer_hooks import ScheduleCheck

    trainer = make_trainer(
        tokenizer, str(tmp_path), constant_reward(0.0), max_steps=2, beta_min=0.01, beta_schedule_steps=2, **DYNAMIC
    )
    with pytest.warns(UserWarning, match=re.escape(
            "adaptive_kl: beta_schedule_steps=2 sets beta = beta_min=0.01 after 2 steps, and this run has 2: "
            "no step trains at it. Set beta_schedule_steps below 2 for the cut-off to act, or None for none.")):
        trainer.train()
    assert logged(trainer, "adaptive_kl/current_beta") == pytest.approx([0.04, 0.04])
    trainer.args.max_steps = -1
    with pytest.warns(UserWarning, match=r"after 2 steps, and this run has 2: no step trains at it"):
        ScheduleCheck(trainer).on_train_begin(trainer.args, TrainerState(max_steps=2), None)


def test_at_most_one_decay_per_generation_batch(tokenizer, tmp_path) -> None:
    """num_iterations=2: steps 1-2 train on batch 1 and steps 3-4 on batch 2, so beta decays after steps 1 and 3."""
    trainer = make_trainer(
        tokenizer, str(tmp_path), constant_reward(1.0), max_steps=4, num_iterations=2, dynamic_beta_decay=0.5, **DYNAMIC
    )
    trainer.train()
    assert logged(trainer, "adaptive_kl/current_beta") == pytest.approx([0.04, 0.02, 0.02, 0.01])


def rewards_by_step(values: list[Any]) -> Any:
    """A reward function giving every completion of the n-th generation batch values[n] (None: unscored)."""
    calls = []

    def reward(completions: list[Any], **kwargs: Any) -> list[Any]:
        calls.append(1)
        return [values[len(calls) - 1]] * len(completions)

    return reward


def test_a_batch_no_reward_function_scored_has_no_mean_reward_and_dynamic_does_not_decay_on_it(tokenizer, tmp_path,
                                                                                              caplog) -> None:
    """TRL logs NaN as the mean reward of a batch whose completions every reward function left unscored (None), and
    trains on. That batch has no mean reward: beta decays after step 1 (reward 1.0 > 0.8), holds after step 2 (no
    reward), decays after step 3 (1.0): 0.04, 0.02, 0.02, then 0.01; two batches had a mean reward. The core refuses
    NaN from a loop of one's own, so the hook passes none (before that rule, NaN was observed as a batch that never
    decays: the same betas, three batches)."""
    trainer = make_trainer(tokenizer, str(tmp_path), rewards_by_step([1.0, None, 1.0]), max_steps=3,
                           dynamic_beta_decay=0.5, **DYNAMIC)
    trainer.train()
    assert "All reward functions returned None" in caplog.text  # TRL's warning, at the batch
    unscored = logged(trainer, "reward")[1]
    assert unscored is None or math.isnan(unscored)  # NaN, which the log history keeps as None
    assert logged(trainer, "adaptive_kl/current_beta") == pytest.approx([0.04, 0.02, 0.02])
    assert trainer.current_beta == pytest.approx(0.01)
    assert trainer.adaptive_kl.controller.generation_batch == 2


@pytest.mark.parametrize(("rewards", "threshold", "betas"), [
    ([0.0, 1.0] * 3, 0.6, [0.04, 0.04, 0.04]),  # each step's mean is 0.5: no decay (the last batch's 1.0 decayed it)
    ([1.0, 0.0] * 3, 0.4, [0.04, 0.02, 0.01]),  # each step's mean is 0.5: a decay each step (the last's 0.0: none)
    ([0.0, 1.0] * 3, 0.4, [0.04, 0.02, 0.01]),  # each step's mean is 0.5: a decay each step (the first's 0.0: none)
])
def test_dynamic_reads_the_mean_reward_of_every_generation_batch_a_step_trained_on(
        tokenizer, tmp_path, rewards: list[float], threshold: float, betas: list[float]) -> None:
    """gradient_accumulation_steps=2 with steps_per_generation=1: each optimizer step trains on two generation batches,
    whose mean rewards here alternate, so TRL logs the step's reward as 0.5. `dynamic` decays on the mean reward of
    the completions the step trained on (0.5), not on its last batch's."""
    trainer = make_trainer(tokenizer, str(tmp_path), rewards_by_step(rewards), max_steps=3, dynamic_beta_decay=0.5,
                           reward_threshold=threshold, kl_adaptation_method="dynamic", beta=0.04,
                           gradient_accumulation_steps=2, steps_per_generation=1)
    trainer.train()
    assert logged(trainer, "reward") == pytest.approx([0.5, 0.5, 0.5])
    assert logged(trainer, "adaptive_kl/current_beta") == pytest.approx(betas)


def test_an_infinite_mean_reward_is_refused_as_in_a_loop_of_ones_own(tokenizer, tmp_path) -> None:
    """A reward function returning inf: TRL logs a mean reward of inf, on which dynamic decayed (on ccb0d5c) where
    step(mean_reward=inf) is refused. Now refused at the trainer's door too, naming the value, before step 2's loss,
    in the trainer's words (it said "mean_reward=inf ... or None where the step scored no new generation batch", the
    own loop's, which a TRL user never set)."""
    trainer = make_trainer(tokenizer, str(tmp_path), rewards_by_step([1.0, math.inf]), max_steps=2, **DYNAMIC)
    with pytest.raises(ValueError, match=r"^adaptive_kl: the generation batch's mean reward \(the trainer's logged "
                                         r"reward\) is inf: a reward function returned \+-inf for a completion; .*"
                                         r"where the beta controller reads them \(kl_adaptation_method='dynamic': "):
        trainer.train()
    assert trainer.state.global_step == 1


@pytest.mark.parametrize("method", ["none", "clip", "target"])
def test_an_infinite_reward_trains_as_stock_where_no_controller_reads_it(tokenizer, tmp_path, method: str) -> None:
    """A constant beta and target (which reads the KL) read no reward: the stock trainer trains on a batch with an
    infinite reward (logging it), and so does the patched one. It refused it in every setting, naming dynamic, with
    kl_adaptation_method='none'."""
    trainer = make_trainer(tokenizer, str(tmp_path), rewards_by_step([1.0, math.inf]), max_steps=2,
                           kl_adaptation_method=method, beta=0.04)
    trainer.train()
    assert trainer.state.global_step == 2
    assert logged(trainer, "reward") == [1.0, math.inf]
    assert trainer.adaptive_kl.controller.generation_batch == 0  # handed no reward


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
    settings = dict(max_steps=8, dynamic_beta_decay=0.8, save_strategy="steps", save_steps=4, model_kind="peft_config",
                    **DYNAMIC)
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


def test_a_resume_with_a_new_constant_beta_trains_and_logs_it(tokenizer, tmp_path) -> None:
    """A run resumed with a changed args.beta under a constant controller (clip): the checkpoint's beta replaced the
    new one in the adaptive KL (clip's term, and the logged current_beta, at 0.04) while args.beta said 0.08. The
    run's own beta is kept, saying so, and the resumed step logs it (clip's term is beta times the adapted KL at
    adaptive_kl.current_beta, the logged one)."""
    settings = dict(max_steps=3, save_strategy="steps", save_steps=2, model_kind="peft_config",
                    kl_adaptation_method="clip", kl_clip_threshold=0.5, gradient_accumulation_steps=1)
    make_trainer(tokenizer, str(tmp_path / "full"), constant_reward(1.0), beta=0.04, **settings).train()
    resumed = make_trainer(tokenizer, str(tmp_path / "resumed"), constant_reward(1.0), beta=0.08, **settings)
    with pytest.warns(UserWarning, match=r"^adaptive KL: the loaded state's beta 0\.04 is not this run's beta=0\.08: "
                                         r"a constant beta is the run's own setting, so 0\.08 is kept"):
        resumed.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-2"))
    assert logged(resumed, "adaptive_kl/current_beta")[-1] == 0.08 == resumed.current_beta


def test_a_resume_of_dynamic_with_a_new_beta_says_the_checkpoints_beta_continues(tokenizer, tmp_path) -> None:
    """A dynamic run resumed with a new args.beta continued from the checkpoint's decayed beta without a word (the
    state did not record the beta its run was built with). The resume now names both betas and the one that
    continues (0.04 * 0.8**2, within the new beta=0.08); the resumed step trains and logs at it, then decays it. The
    way to start from the new beta instead is named (it said "resume without the adaptive KL state", which no trainer
    option does): the checkpoint's state file, deleted, and the resume run again, which then trains at 0.08."""
    settings = dict(max_steps=3, dynamic_beta_decay=0.8, save_strategy="steps", save_steps=2,
                    model_kind="peft_config", **DYNAMIC)
    make_trainer(tokenizer, str(tmp_path / "full"), constant_reward(1.0), **settings).train()
    resumed = make_trainer(tokenizer, str(tmp_path / "resumed"), constant_reward(1.0), **{**settings, "beta": 0.08})
    checkpoint = tmp_path / "full" / "checkpoint-2"
    state_file = checkpoint / "adaptive_kl_state.json"
    with pytest.warns(UserWarning, match=r"^adaptive KL: this run's beta=0\.08 is not the beta=0\.04 the checkpoint's "
                                         r"run was built with: dynamic moves beta, so the run continues from the "
                                         r"checkpoint's beta 0\.0256\. To start from 0\.08 instead, delete "
                                         rf"{re.escape(str(state_file))} and resume again\.$"):
        resumed.train(resume_from_checkpoint=str(checkpoint))
    assert logged(resumed, "adaptive_kl/current_beta")[-1] == pytest.approx(0.04 * 0.8**2)
    assert resumed.current_beta == pytest.approx(0.04 * 0.8**3)
    state_file.unlink()
    again = make_trainer(tokenizer, str(tmp_path / "again"), constant_reward(1.0), **{**settings, "beta": 0.08})
    with pytest.warns(UserWarning, match=rf"^adaptive_kl: {re.escape(str(state_file))} is missing: the controllers "
                                         r"restart from their initial beta\.$"):
        again.train(resume_from_checkpoint=str(checkpoint))
    assert logged(again, "adaptive_kl/current_beta")[-1] == 0.08 and again.current_beta == pytest.approx(0.08 * 0.8)


def test_the_checkpoint_a_hub_push_uploads_holds_the_controllers_state(tokenizer, tmp_path) -> None:
    """transformers' _save_checkpoint ends by pushing the folder (`_push_from_checkpoint`, with push_to_hub and a
    checkpoint hub_strategy): the state must be in the folder by then (it was written after, so a run resumed from
    the Hub's checkpoint restarted beta). The push is recorded, not made (no network)."""
    trainer = make_trainer(tokenizer, str(tmp_path), constant_reward(1.0), max_steps=2, dynamic_beta_decay=0.8,
                           save_strategy="steps", save_steps=1, **DYNAMIC)
    pushed = {}
    trainer._push_from_checkpoint = lambda folder: pushed.update({Path(folder).name: (
        sorted(path.name for path in Path(folder).iterdir()),
        json.loads((Path(folder) / "adaptive_kl_state.json").read_text())["value"])})
    trainer.args.push_to_hub, trainer.args.hub_strategy = True, "checkpoint"  # set after construction: no repo made
    trainer.train()
    assert set(pushed) == {"checkpoint-1", "checkpoint-2"}
    assert all("adaptive_kl_state.json" in names and "trainer_state.json" in names for names, _ in pushed.values())
    assert [pushed[f"checkpoint-{step}"][1] for step in (1, 2)] == pytest.approx([0.04 * 0.8, 0.04 * 0.8**2])


@pytest.mark.parametrize("should_save", [True, False])
def test_only_the_saving_process_writes_the_state_and_every_process_takes_part_in_the_reference_save(
        tmp_path, should_save: bool) -> None:
    """Under DDP every process runs `_save_checkpoint`, and `args.should_save` is True on the saving one alone: it
    writes checkpoint-N/adaptive_kl_state.json (the controller's state_dict), a process that does not save writes
    nothing; each calls the reference sync's save (FSDP2 gathers on all), telling it whether to write, then the
    stock save."""
    from types import SimpleNamespace

    from unsloth_adaptive_kl.integrations.trainer_hooks import wrap_save_checkpoint

    calls: list = []
    akl = AdaptiveKL(AdaptiveKLConfig(kl_adaptation_method="dynamic"), beta=0.04)
    akl.step(mean_reward=1.0)
    trainer = SimpleNamespace(
        args=SimpleNamespace(should_save=should_save), state=SimpleNamespace(global_step=3), adaptive_kl=akl,
        _get_output_dir=lambda trial: str(tmp_path),
        adaptive_kl_reference=SimpleNamespace(save=lambda folder, write: calls.append(("sync", folder, write))))
    wrap_save_checkpoint(lambda self, model, trial: calls.append(("stock", model, trial)))(trainer, "model", None)
    folder = str(tmp_path / "checkpoint-3")
    assert calls == [("sync", folder, should_save), ("stock", "model", None)]
    state = tmp_path / "checkpoint-3" / "adaptive_kl_state.json"
    assert state.exists() is should_save
    if should_save:
        assert json.loads(state.read_text())["value"] == pytest.approx(0.04 * 0.9)  # the decayed beta it holds


def test_resume_without_the_state_file_warns_naming_it(tokenizer, tmp_path) -> None:
    """A checkpoint whose adaptive_kl_state.json is gone (saved without the package, or lost) resumes with beta at
    its initial value: the trainer says so, naming the file, instead of training on silently."""
    settings = dict(max_steps=6, dynamic_beta_decay=0.8, save_strategy="steps", save_steps=4, model_kind="peft_config",
                    **DYNAMIC)
    make_trainer(tokenizer, str(tmp_path / "full"), constant_reward(1.0), **settings).train()
    state = tmp_path / "full" / "checkpoint-4" / "adaptive_kl_state.json"
    state.unlink()
    resumed = make_trainer(tokenizer, str(tmp_path / "resumed"), constant_reward(1.0), **settings)
    with pytest.warns(UserWarning, match=f"^adaptive_kl: {re.escape(str(state))} is missing: the controllers restart "
                                         "from their initial beta"):
        resumed.train(resume_from_checkpoint=str(state.parent))
    assert logged(resumed, "adaptive_kl/current_beta")[0] == pytest.approx(0.04)  # beta_0, not 0.04 * 0.8**4


@pytest.mark.parametrize("model_kind", ["peft_model", "peft_config"])
def test_a_resume_says_when_transformers_left_the_trained_adapter_out_and_a_constant_beta_restores_nothing(
        tokenizer, tmp_path, model_kind: str) -> None:
    """A PeftModel passed with beta > 0: TRL saves its "ref" adapter in a sub-folder of each checkpoint, and
    transformers' resume (before 5.24) then loads that sub-folder alone, not the trained adapter at the root, so the
    resumed policy is the adapter it was built with: stock TRL, said (the first resumed step's KL is 0 where the
    uninterrupted run's is not). With peft_config=, or a transformers that loads the root adapter too, the adapter
    resumes and nothing is said. `none` resumed without adaptive_kl_state.json loses nothing (a constant beta) and
    says nothing of it either."""
    settings = dict(max_steps=3, save_strategy="steps", save_steps=2, model_kind=model_kind)
    full = make_trainer(tokenizer, str(tmp_path / "full"), **settings)
    full.train()
    checkpoint = tmp_path / "full" / "checkpoint-2"
    (checkpoint / "adaptive_kl_state.json").unlink()
    resumed = make_trainer(tokenizer, str(tmp_path / "resumed"), **settings)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed.train(resume_from_checkpoint=str(checkpoint))
    said = [str(w.message) for w in caught if str(w.message).startswith("adaptive_kl:")]
    if model_kind == "peft_model" and loads_only_adapter_subfolders():  # transformers before 5.24
        assert said == [f"adaptive_kl: resuming from {checkpoint}, transformers loaded the adapters of its sub-folders "
                        "(ref) but not the trained adapter 'default' at its root (Trainer._load_from_checkpoint; TRL "
                        "saves its 'ref' adapter in a sub-folder when a PeftModel is passed with beta > 0): the policy "
                        "restarts from the adapter it was built with. Pass the base model and peft_config= to the "
                        "trainer instead of a PeftModel."]
        assert logged(resumed, "kl")[2] == 0.0 < logged(full, "kl")[2]
    else:
        assert said == []
        assert logged(resumed, "kl")[2] == pytest.approx(logged(full, "kl")[2], rel=1e-5)


def test_the_adapter_check_reads_peft_models_alone_and_leaves_deepspeed_and_fsdp_to_their_loaders(
        tokenizer, tmp_path, monkeypatch) -> None:
    """A checkpoint with an adapter at its root and one in a sub-folder: a PeftModel resumed through transformers'
    own branch is warned of where that branch loads the sub-folders alone; under DeepSpeed or FSDP (which load the
    checkpoint their own way), for a model without adapters (whose active_adapters is a method: indexing it raised
    TypeError) and where transformers loads the root adapter too, nothing is said."""
    from types import SimpleNamespace

    from unsloth_adaptive_kl.integrations.trainer_hooks import warn_if_adapter_not_resumed
    from unsloth_adaptive_kl.tools.tiny import add_lora, build_tiny_model

    (tmp_path / "ref").mkdir()
    for folder in (tmp_path, tmp_path / "ref"):
        (folder / "adapter_model.safetensors").write_bytes(b"")

    def said(model, **engines) -> list[str]:
        trainer = SimpleNamespace(accelerator=SimpleNamespace(unwrap_model=lambda m: m), model=model, **engines)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            warn_if_adapter_not_resumed(trainer, str(tmp_path))
        return [str(w.message) for w in caught]

    peft_model = add_lora(build_tiny_model(tokenizer))
    monkeypatch.setattr(trainer_hooks, "loads_only_adapter_subfolders", lambda: True)  # transformers 5.17's branch
    assert len(said(peft_model)) == 1 and "not the trained adapter 'default'" in said(peft_model)[0]
    assert said(peft_model, is_deepspeed_enabled=True) == said(peft_model, is_fsdp_enabled=True) == []
    assert said(build_tiny_model(tokenizer)) == []
    monkeypatch.setattr(trainer_hooks, "loads_only_adapter_subfolders", lambda: False)  # 5.24's: the root loaded too
    assert said(peft_model) == []
    monkeypatch.setattr(trainer_hooks, "loads_only_adapter_subfolders", lambda: True)
    (tmp_path / "adapter_model.safetensors").unlink()  # no adapter at the root: none was left out
    assert said(peft_model) == []


def test_which_transformers_loads_the_root_adapter_is_read_in_its_source(monkeypatch) -> None:
    """5.24's Trainer._load_from_checkpoint loads the root adapter beside the sub-folders' (the line below, as it
    stands there); 5.17's has no such line."""
    import transformers

    def with_the_fix(self, resume_from_checkpoint, model=None):
        model.load_adapter(
            resume_from_checkpoint, "default", is_trainable=True
        )

    def without_it(self, resume_from_checkpoint, model=None):
        model.load_adapter(resume_from_checkpoint, "ref", is_trainable=False)

    for function, only_subfolders in ((with_the_fix, False), (without_it, True)):
        monkeypatch.setattr(transformers.Trainer, "_load_from_checkpoint", function)
        assert trainer_hooks.loads_only_adapter_subfolders() is only_subfolders


@pytest.mark.parametrize(("settings", "checkpoint", "every"), [
    # a batch every 2 micro-batches, 1 per optimizer step: step 3 ends inside one
    (dict(steps_per_generation=2, gradient_accumulation_steps=1), 3, 2),
    (dict(steps_per_generation=2, gradient_accumulation_steps=1), 2, None),
    # num_iterations=2 with steps_per_generation = gradient_accumulation_steps = 2: a batch of 4 serves 2 steps
    (dict(num_iterations=2, gradient_accumulation_steps=2), 3, 4),
    (dict(gradient_accumulation_steps=2), 3, None),  # a batch per step: every step is a boundary
])
def test_a_resume_inside_a_generation_batch_says_the_run_differs_from_there(tokenizer, tmp_path, settings, checkpoint,
                                                                            every) -> None:
    """TRL does not checkpoint the rest of a generation batch: resumed inside one it generates a new batch at once,
    and dynamic reads one batch more than the uninterrupted run (beta at step 5: 0.04 * 0.8**3 where the
    uninterrupted run has 0.04 * 0.8**2, a batch decaying it every 2 steps). Said, with the boundary; a checkpoint on
    a boundary resumes exactly and says nothing."""
    fields = dict(max_steps=5, kl_adaptation_method="dynamic", dynamic_beta_decay=0.8, reward_threshold=0.5,
                  save_strategy="steps", save_steps=checkpoint, model_kind="peft_config", **settings)
    full = make_trainer(tokenizer, str(tmp_path / "full"), constant_reward(1.0), **fields)
    full.train()
    resumed = make_trainer(tokenizer, str(tmp_path / "resumed"), constant_reward(1.0), **fields)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed.train(resume_from_checkpoint=str(tmp_path / "full" / f"checkpoint-{checkpoint}"))
    said = [str(w.message) for w in caught if "inside a generation batch" in str(w.message)]
    betas, uninterrupted = logged(resumed, "adaptive_kl/current_beta"), logged(full, "adaptive_kl/current_beta")
    if every:
        micro = checkpoint * fields["gradient_accumulation_steps"]
        assert said == [f"adaptive_kl: resuming at step {checkpoint}, inside a generation batch: the trainer "
                        f"generates one every {every} micro-batches (steps_per_generation x num_iterations) and step "
                        f"{checkpoint} ends at micro-batch {micro}. The rest of that batch is not in the checkpoint, "
                        "so a new one is generated at once and the run differs from the uninterrupted one from here "
                        "(dynamic reads one batch more). Checkpoints at steps whose micro-batch count is a multiple "
                        f"of {every} resume exactly."]
        assert uninterrupted[4] == pytest.approx(0.04 * 0.8**2) and betas[4] == pytest.approx(0.04 * 0.8**3)
    else:
        assert said == []
        assert betas == pytest.approx(uninterrupted, rel=1e-12)


def test_two_processes_share_the_globally_averaged_beta(tmp_path) -> None:
    """Rank 0 rewards 1.0 and rank 1 rewards 0.6: the global mean 0.8 crosses a 0.7 threshold but not 0.9, while
    either rank alone would decide the other way for one of them."""
    torchrun(Path(__file__).with_name("distributed_beta.py"), str(tmp_path), timeout=300)
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    scored = [ranks[rank]["reward 0.7"].pop("scored") for rank in (0, 1)]  # each rank's own batches: they differ
    assert ranks[0] == ranks[1]  # beta, the KL metrics and the penalties: over both processes, identical on each
    assert max(ranks[0]["loss 0.7"]["raw_kl"]) > 0 and max(ranks[0]["loss 0.7"]["sequence_kl"]) > 0
    # with the KL in the reward: the penalty is beta * the summed KL per completion, over both ranks' completions
    in_reward = ranks[0]["reward 0.7"]
    assert in_reward["reward_penalty"] == pytest.approx([b * kl for b, kl in zip(in_reward["betas"], in_reward["sequence_kl"])])
    assert max(abs(penalty) for penalty in in_reward["reward_penalty"]) > 1e-4  # k1 (the default): either sign
    # ...by hand from each rank's scored batch: sequence_kl is the mean KL_i over both ranks' completions with tokens,
    # and every rank's scoring got both ranks' penalties, in rank order (a metric of rank 0's batch alone differs)
    assert [len(batches) for batches in scored] == [3, 3]
    told_apart = 0
    for step, (mine, theirs) in enumerate(zip(*scored)):
        kl = [s for batch in (mine, theirs) for s, length in zip(batch["kl"], batch["lengths"]) if length > 0]
        assert in_reward["sequence_kl"][step] == pytest.approx(sum(kl) / len(kl), rel=1e-5, abs=1e-9)
        alone = [s for s, length in zip(mine["kl"], mine["lengths"]) if length > 0]
        told_apart += in_reward["sequence_kl"][step] != pytest.approx(sum(alone) / len(alone), rel=1e-3)
        beta = in_reward["betas"][step]
        for batch in (mine, theirs):
            assert batch["penalty"] == pytest.approx([beta * s for s in mine["kl"] + theirs["kl"]], rel=1e-5)
    assert told_apart == 2  # the first batch is scored where policy and reference agree: every KL_i is 0
    for name, run in ranks[0].items():
        threshold = float(name.split()[1])
        assert run["reward"] == pytest.approx([0.8, 0.8, 0.8])  # un-penalised, as stock logs it
        decay = 0.5 if float(threshold) < 0.8 else 1.0
        assert run["betas"] == pytest.approx([0.04, 0.04 * decay, 0.04 * decay**2])
        assert run["final_beta"] == pytest.approx(0.04 * decay**3)


def expected_target_betas(measured: list[float], beta: float, target: float, horizon: float, n: float,
                          beta_min: float, beta_max: float) -> list[float]:
    """Ziegler et al. (2019), written out: the beta each step uses, from the KL measured at the steps before."""
    betas = [beta]
    for kl in measured[:-1]:
        error = min(max(kl / target - 1, -0.2), 0.2)
        betas.append(min(max(betas[-1] * (1 + error * n / horizon), beta_min), beta_max))
    return betas


@pytest.mark.parametrize(("measure", "metric", "num_iterations"), [("token_mean", "adaptive_kl/raw_kl", 1),
                                                                   ("sequence_sum", "adaptive_kl/sequence_kl", 1),
                                                                   ("token_mean", "adaptive_kl/raw_kl", 2)])
def test_target_controller_follows_the_formula_in_a_real_run(tokenizer, tmp_path, measure: str, metric: str,
                                                             num_iterations: int) -> None:
    """Ziegler et al.'s update each step, n = the step's 4 completions counted once per generation batch: with
    num_iterations=2 two steps train on each batch of 4, so n = 2 (SPEC 3.14). Each clamp is reached: the token mean
    stays below a target of 0.02 for the 3 steps beta takes to fall to beta_min (measured: at most 0.0021 on torch
    2.6's samples, 0.0004 on torch 2.14's; the target was 0.002, which torch 2.6's passed at step 3), and the
    completions' summed KL passes 0.002 (from step 2 or 3)."""
    target = 0.02 if measure == "token_mean" else 0.002
    settings = dict(kl_adaptation_method="target", kl_target=target, kl_horizon=10.0, beta_max=0.04, beta_min=0.032,
                    kl_target_measure=measure, loss_type="bnpo", gradient_accumulation_steps=1, max_steps=6,
                    num_iterations=num_iterations)
    trainer = make_trainer(tokenizer, str(tmp_path), **settings)
    trainer.train()
    measured, betas = logged(trainer, metric), logged(trainer, "adaptive_kl/current_beta")
    n = 4 / num_iterations  # bnpo's raw_kl is the step's token mean (one micro-batch, one process)
    assert betas == pytest.approx(expected_target_betas(measured, 0.04, target, 10.0, n, 0.032, 0.04), rel=1e-9)
    assert betas[1] == pytest.approx(0.04 * (1 - 0.2 * n / 10))  # step 1: policy == reference, KL 0 < target
    if num_iterations > 1:
        return
    if measure == "token_mean":  # per-token KL stays below the target for 3 steps: beta falls to beta_min
        assert min(betas) == pytest.approx(0.032)
    else:  # summed KL per completion passes the target from step 3: beta rises back to beta_max
        assert max(betas[2:]) == pytest.approx(0.04)


def test_a_target_horizon_that_would_end_beta_is_refused_when_the_trainer_is_built(tokenizer, tmp_path) -> None:
    """n / kl_horizon >= 5 with beta_min=0 takes beta to 0 for good (the core's check_horizon): the trainer refused it
    only inside its first step, after generation, forward and backward. n, with 4 completions a micro-batch and 2
    micro-batches a step: 8 in the loss; 4 with num_iterations=2 (a completion counts once per generation batch); the
    generation batch (4 x 2 = 8) in the reward. Just above n / 5 the trainer builds and its first step runs. Two
    processes double n in the loss (4 x 2 x 2 = 16); at beta=0 (no KL term) nothing is checked."""
    from types import SimpleNamespace

    from unsloth_adaptive_kl.integrations.trainer_hooks import check_target_horizon

    settings = dict(kl_adaptation_method="target", kl_target=1.0, max_steps=1, gradient_accumulation_steps=2)
    in_loss = "per_device_train_batch_size x gradient_accumulation_steps x processes / num_iterations"
    for fields, n, spelled in [({"kl_horizon": 1.6}, 8, in_loss),
                               ({"kl_horizon": 0.8, "num_iterations": 2}, 4, in_loss),
                               ({"kl_horizon": 1.6, "kl_placement": "reward"}, 8, "generation_batch_size")]:
        with pytest.raises(ValueError, match=rf"^kl_horizon={fields['kl_horizon']} is invalid for steps of {n} "
                                             rf"completions with beta_min=0: .*allowed is kl_horizon > {n / 5:g} "
                                             rf"\(n / 5\), or beta_min > 0; here n is {re.escape(spelled)}\.$"):
            make_trainer(tokenizer, str(tmp_path), **settings, **fields)
    trainer = make_trainer(tokenizer, str(tmp_path), **settings, kl_horizon=1.7)
    trainer.train()  # the step's own check agrees: 8 / 1.7 < 5
    assert trainer.current_beta == pytest.approx(0.04 * (1 - 0.2 * 8 / 1.7))  # the KL is far below kl_target=1
    make_trainer(tokenizer, str(tmp_path), **settings, kl_horizon=1.6, beta_min=0.01)  # a floor above 0: allowed
    with pytest.warns(UserWarning, match=r"has no effect: beta=0\.0 turns the KL term off"):  # built, not refused
        make_trainer(tokenizer, str(tmp_path), **settings, kl_horizon=1.6, beta=0.0)
    config = AdaptiveKLConfig.unvalidated_from(trainer.args)  # kl_horizon=1.7: 8 / 1.7 < 5 on one process
    two = SimpleNamespace(beta=0.04, args=trainer.args, accelerator=SimpleNamespace(num_processes=2))
    with pytest.raises(ValueError, match=r"^kl_horizon=1\.7 is invalid for steps of 16 completions"):
        check_target_horizon(two, config)


def test_target_controller_state_survives_resume(tokenizer, tmp_path) -> None:
    settings = dict(kl_adaptation_method="target", kl_target=0.002, kl_horizon=10.0, loss_type="bnpo",
                    gradient_accumulation_steps=1, max_steps=6, save_strategy="steps", save_steps=3,
                    model_kind="peft_config")
    full = make_trainer(tokenizer, str(tmp_path / "full"), **settings)
    full.train()
    resumed = make_trainer(tokenizer, str(tmp_path / "resumed"), **settings)
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-3"))
    full_betas, resumed_betas = logged(full, "adaptive_kl/current_beta"), logged(resumed, "adaptive_kl/current_beta")
    assert resumed_betas[3] == full_betas[3] != 0.04  # step 4's beta comes from the checkpointed state
    assert len(set(full_betas)) == 6


@pytest.mark.parametrize("method", ["none", "clip"])
def test_diagnostics_logged_every_step(tokenizer, tmp_path, method: str) -> None:
    trainer = make_trainer(tokenizer, str(tmp_path), kl_adaptation_method=method, kl_clip_threshold=0.01, max_steps=3)
    trainer.train()
    sequence_kl, corr = logged(trainer, "adaptive_kl/sequence_kl"), logged(trainer, "adaptive_kl/length_kl_corr")
    assert len(sequence_kl) == 3 and sequence_kl[0] == 0.0 and min(sequence_kl[1:]) > 0
    assert all(c is None or -1.0 <= c <= 1.0 for c in corr)
    clip_fraction = logged(trainer, "adaptive_kl/clip_fraction")
    if method == "clip":
        assert len(clip_fraction) == 3 and clip_fraction[0] == 0.0 and 0.0 < max(clip_fraction) <= 1.0
    else:
        assert clip_fraction == []
