"""Reference syncing (SPEC 3.10): TRL's sync_ref_model for PEFT and full models, the KL trigger, the optimizer reset,
checkpoints and resume."""

from __future__ import annotations

import contextlib
import copy
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Iterator

import pytest
import torch
import trl.trainer.grpo_trainer as trl_grpo_trainer
import trl.trainer.utils as trl_utils
from transformers import TrainerCallback

import unsloth_adaptive_kl
from unsloth_adaptive_kl.integrations import ref_sync
from unsloth_adaptive_kl.integrations.ref_sync import (STATE_FILE, AdapterReference, ReferenceSync, SyncSchedule,
                                                        attach_reference_sync, check_supported, use_reference,
                                                        warn_if_synced_reference_dropped)
from unsloth_adaptive_kl.tools.tiny import add_lora, build_tiny_model

from .conftest import PROMPTS, constant_reward, grpo_args, logged, make_trainer, torchrun

HARD_SYNC = dict(sync_ref_model=True, ref_model_sync_steps=2, ref_model_mixup_alpha=1.0)


class AfterSync(TrainerCallback):
    """Added after the trainer's own callbacks, so it sees each step end after the sync: records the policy's
    trainable tensors, the reference's and the optimizer state there (and the reference when training starts)."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self.steps: list[dict[str, Any]] = []

    def reference(self) -> list[torch.Tensor]:
        return [t.clone() for t in self.trainer.adaptive_kl_reference.reference.tensors]

    def on_train_begin(self, *_: Any, **__: Any) -> None:
        self.initial = self.reference()
        self.initial_policy = [p.detach().clone() for p in self.trainer.adaptive_kl_reference.reference.policy]

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        optimizer = self.trainer.optimizer
        self.steps.append({
            "policy": [p.detach().clone() for p in self.trainer.adaptive_kl_reference.reference.policy],
            "reference": self.reference(),
            "optimizer_state_size": len(optimizer.state),
            "adam_steps": sorted({float(s["step"]) for s in optimizer.state.values()}),
        })


def recorded_run(tokenizer: Any, output_dir: str, **overrides: Any) -> tuple[Any, AfterSync]:
    trainer = make_trainer(tokenizer, output_dir, model_kind="peft_config", **overrides)
    recorder = AfterSync(trainer)
    trainer.add_callback(recorder)
    trainer.train()
    return trainer, recorder


# ----- validation ---------------------------------------------------------------------------------------------------

BAD_SYNC_VALUES = [
    (dict(ref_model_mixup_alpha=0.0), "ref_model_mixup_alpha=0.0 is invalid: allowed is a number with 0 < x <= 1"),
    (dict(ref_model_mixup_alpha=1.5), "ref_model_mixup_alpha=1.5 is invalid: allowed is a number with 0 < x <= 1"),
    (dict(ref_model_mixup_alpha=math.nan), "ref_model_mixup_alpha=nan is invalid"),
    (dict(ref_model_sync_steps=0), "ref_model_sync_steps=0 is invalid: allowed is an integer >= 1"),
    (dict(ref_model_sync_steps=2.5), "ref_model_sync_steps=2.5 is invalid: allowed is an integer >= 1"),
    (dict(ref_model_sync_steps=True), "ref_model_sync_steps=True is invalid: allowed is an integer >= 1"),
    (dict(ref_model_sync_kl=0.0), "ref_model_sync_kl=0.0 is invalid: allowed is None or a finite number > 0"),
    (dict(ref_model_sync_kl=-1.0), "ref_model_sync_kl=-1.0 is invalid: allowed is None or a finite number > 0"),
    (dict(ref_model_sync_kl=math.inf), "ref_model_sync_kl=inf is invalid: allowed is None or a finite number > 0"),
    (dict(ref_model_sync_kl="0.1"), "ref_model_sync_kl='0.1' is invalid: allowed is None or a finite number > 0"),
    (dict(ref_model_sync_reset_optimizer="yes"), "ref_model_sync_reset_optimizer='yes' is invalid: allowed is True or False"),
    (dict(beta=0.0), "sync_ref_model=True is invalid: allowed is False with beta=0.0"),
    # TRL reads it by truth: the string "False" synced, and let ref_model_sync_kl through as if sync were on
    (dict(sync_ref_model="False", ref_model_sync_kl=0.1),
     "sync_ref_model='False' is invalid: allowed is True or False."),
    (dict(sync_ref_model=1), "sync_ref_model=1 is invalid: allowed is True or False."),
]


@pytest.mark.parametrize(("overrides", "message"), BAD_SYNC_VALUES, ids=[str(o) for o, _ in BAD_SYNC_VALUES])
def test_bad_sync_values_rejected_at_construction(tmp_path, overrides: dict, message: str) -> None:
    with pytest.raises(ValueError) as error:
        grpo_args(str(tmp_path), **{**HARD_SYNC, **overrides})
    assert str(error.value).startswith(message)


def test_trl_sync_fields_are_checked_only_while_syncing(tmp_path) -> None:
    args = grpo_args(str(tmp_path), ref_model_mixup_alpha=2.0, ref_model_sync_steps=0, beta=0.0)  # unused: stock
    assert (args.ref_model_mixup_alpha, args.ref_model_sync_steps) == (2.0, 0)
    assert (args.ref_model_sync_kl, args.ref_model_sync_reset_optimizer) == (None, False)
    grpo_args(str(tmp_path), **{**HARD_SYNC, "ref_model_sync_steps": 1, "ref_model_sync_kl": 1e-3})


@pytest.mark.parametrize(("name", "value", "off"), [("ref_model_sync_kl", 0.05, None),
                                                    ("ref_model_sync_reset_optimizer", True, False)])
def test_this_packages_sync_settings_without_syncing_are_refused(tmp_path, name: str, value: Any, off: Any) -> None:
    """They act on the reference sync alone: with sync_ref_model=False they would do nothing."""
    with pytest.raises(ValueError) as error:
        grpo_args(str(tmp_path), **{name: value})
    assert str(error.value) == (f"{name}={value!r} is invalid: allowed is {off!r} with sync_ref_model=False (the "
                                "setting acts on the reference sync, which is off); set sync_ref_model=True to sync "
                                "the reference.")


def test_unpatch_restores_trls_refusal_of_peft_models(tokenizer, tmp_path) -> None:
    unsloth_adaptive_kl.unpatch()
    try:
        assert trl_grpo_trainer.use_adapter is trl_utils.use_adapter
        with pytest.raises(NotImplementedError, match="sync_ref_model=True` while using a PEFT model"):
            make_trainer(tokenizer, str(tmp_path), **HARD_SYNC)
    finally:
        unsloth_adaptive_kl.patch()
    assert trl_grpo_trainer.use_adapter is use_reference
    trainer = make_trainer(tokenizer, str(tmp_path), **HARD_SYNC)
    assert trainer.args.sync_ref_model is True
    assert not any(type(c).__name__ == "SyncRefModelCallback" for c in trainer.callback_handler.callbacks)


# ----- TRL + PEFT ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("model_kind", ["peft_config", "peft_model", "full"])
def test_hard_sync_brings_the_kl_back_to_the_policy_equals_reference_floor(tokenizer, tmp_path, model_kind: str) -> None:
    """On-policy (one generation per optimizer step), a hard sync after steps 2 and 4: steps 3 and 5 compute their
    reference log-probs with the policy that generates, so their KL is the policy == reference floor of step 1 (0 in
    TRL); unsynced, the same steps' KL is well above it. Before the first sync the reference is the stock one."""
    synced = make_trainer(tokenizer, str(tmp_path / "synced"), model_kind=model_kind, max_steps=5, **HARD_SYNC)
    synced.train()
    stock = make_trainer(tokenizer, str(tmp_path / "stock"), model_kind=model_kind, max_steps=5)
    stock.train()
    raw, stock_raw = logged(synced, "adaptive_kl/raw_kl"), logged(stock, "adaptive_kl/raw_kl")
    assert raw[:2] == stock_raw[:2]  # the stock reference until the first sync, bit for bit
    assert raw[0] == 0.0 and raw[2] == 0.0 and raw[4] == 0.0  # measured: exactly 0.0 in TRL
    assert min(stock_raw[2], stock_raw[4]) > 5e-4  # measured (peft_config): 8.0e-4 and 3.0e-3
    assert logged(synced, "adaptive_kl/ref_syncs") == [0.0, 1.0, 1.0, 2.0, 2.0]
    assert logged(stock, "adaptive_kl/ref_syncs") == []


def test_mix_is_alpha_policy_plus_one_minus_alpha_reference_on_the_tensors(tokenizer, tmp_path) -> None:
    """alpha = 0.5, a sync after every step: each LoRA A and B factor of the reference is 0.5 * policy + 0.5 * previous
    reference, exactly (TRL's formula, factor by factor), starting from the policy's tensors when training starts."""
    trainer, recorder = recorded_run(tokenizer, str(tmp_path), max_steps=3, sync_ref_model=True, ref_model_sync_steps=1,
                                     ref_model_mixup_alpha=0.5)
    names = trainer.adaptive_kl_reference.reference.names
    assert len(names) == 28 and all(".lora_A.default." in n or ".lora_B.default." in n for n in names)
    assert all(torch.equal(r, p) for r, p in zip(recorder.initial, recorder.initial_policy))
    previous = recorder.initial
    for step in recorder.steps:
        expected = [0.5 * p + 0.5 * r for p, r in zip(step["policy"], previous)]
        assert all(torch.equal(e, r) for e, r in zip(expected, step["reference"]))
        previous = step["reference"]
    last = recorder.steps[-1]
    assert max((p - r).abs().max().item() for p, r in zip(last["policy"], last["reference"])) > 1e-3  # a real mix
    assert logged(trainer, "adaptive_kl/ref_syncs") == [1.0, 2.0, 3.0]


@contextlib.contextmanager
def trainable_set_to(model: torch.nn.Module, values: list[torch.Tensor]) -> Iterator[None]:
    """The model's trainable tensors hold `values` for the block, set by hand (not by the package's exchange)."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    own = [p.detach().clone() for p in trainable]
    with torch.no_grad():
        for p, value in zip(trainable, values, strict=True):
            p.copy_(value)
    try:
        yield
    finally:
        with torch.no_grad():
            for p, value in zip(trainable, own):
                p.copy_(value)


def logps_by_hand(trainer: Any, values: list[torch.Tensor], output: dict) -> torch.Tensor:
    """The completion log-probs by a plain forward and log_softmax of the policy with its trainable tensors set to
    `values`."""
    model = trainer.accelerator.unwrap_model(trainer.model)
    ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)
    mask = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
    with torch.no_grad(), trainable_set_to(model, values):
        logits = model(input_ids=ids, attention_mask=mask).logits[:, -output["completion_ids"].size(1) - 1 : -1]
    logps = torch.log_softmax(logits.float() / trainer.temperature, dim=-1)
    return logps.gather(-1, output["completion_ids"].unsqueeze(-1)).squeeze(-1)


def test_reference_forward_uses_the_synced_reference_and_leaves_the_policy_untouched(tokenizer, tmp_path) -> None:
    """After a sync with alpha = 0.5 (reference != policy), one generation: its reference log-probs are those of the
    synced reference, and the policy's weights, gradients and optimizer state are bit-for-bit what they were."""
    trainer, recorder = recorded_run(tokenizer, str(tmp_path), max_steps=2, sync_ref_model=True, ref_model_sync_steps=2,
                                     ref_model_mixup_alpha=0.5)
    reference = trainer.adaptive_kl_reference.reference
    policy = reference.policy
    torch.manual_seed(1)
    for p in policy:
        p.grad = torch.randn_like(p)
    before = ([p.detach().clone() for p in policy], [p.grad.clone() for p in policy],
              copy.deepcopy(trainer.optimizer.state_dict()))
    assert before[2]["state"]  # the optimizer has moments to keep
    trainer.model.train()
    output = trainer._generate_and_score_completions([{"prompt": prompt} for prompt in PROMPTS[:4]])
    assert all(torch.equal(a, p) for a, p in zip(before[0], policy))
    assert all(torch.equal(a, p.grad) for a, p in zip(before[1], policy))
    state = trainer.optimizer.state_dict()["state"]
    assert state.keys() == before[2]["state"].keys()
    assert all(torch.equal(state[k][n], before[2]["state"][k][n]) for k in state for n in state[k])
    # the reference log-probs: the synced reference's (not the policy's, not the base model's)
    expected = logps_by_hand(trainer, reference.tensors, output)
    policy_logps = logps_by_hand(trainer, before[0], output)
    mask = output["completion_mask"].bool()
    assert torch.allclose(output["ref_per_token_logps"][mask], expected[mask], atol=1e-5)
    assert (output["ref_per_token_logps"][mask] - policy_logps[mask]).abs().max() > 1e-4


def reference_one_above() -> tuple[torch.nn.Linear, AdapterReference, list[torch.Tensor]]:
    """A Linear(3, 2), its reference (every tensor the policy's + 1) and a copy of the policy's tensors."""
    layer = torch.nn.Linear(3, 2)
    reference = AdapterReference(layer)
    with torch.no_grad():
        for r in reference.tensors:
            r.add_(1.0)
    return layer, reference, [p.detach().clone() for p in layer.parameters()]


def test_exchange_is_undone_when_the_reference_forward_raises() -> None:
    layer, reference, weights = reference_one_above()
    with pytest.raises(RuntimeError, match="forward failed"), reference.swapped_in():
        assert torch.equal(layer.weight, weights[0] + 1.0)
        raise RuntimeError("forward failed")
    assert all(torch.equal(w, p) for w, p in zip(weights, layer.parameters()))
    assert all(torch.equal(r, w + 1.0) for r, w in zip(reference.tensors, weights))


# ----- beyond TRL: the KL trigger and the optimizer reset -----------------------------------------------------------

@pytest.mark.parametrize("placement", ["loss", "reward"])
def test_kl_trigger_syncs_only_after_steps_whose_raw_kl_exceeded_it(tokenizer, tmp_path, placement: str) -> None:
    """A sync is due after every step; with ref_model_sync_kl = 1e-3 it happens only after the steps whose KL exceeded
    1e-3, and each such hard sync brings the next step's KL to 0. The step's KL is the token mean over the step's
    completions (one step per generation batch here): the logged mean summed KL per completion over the logged mean
    completion length, in both placements. It is not the logged raw_kl: grpo's reduction (a mean of per-completion
    means) in the loss, a per-completion sum in the reward (sequence_sum)."""
    extra = dict(kl_placement="reward", kl_reduction="sequence_sum") if placement == "reward" else {}
    trainer = make_trainer(tokenizer, str(tmp_path), model_kind="peft_config", max_steps=8, sync_ref_model=True,
                           ref_model_sync_steps=1, ref_model_mixup_alpha=1.0, ref_model_sync_kl=1e-3, **extra)
    trainer.train()
    step_kl = [kl / length for kl, length in zip(logged(trainer, "adaptive_kl/sequence_kl"),
                                                 logged(trainer, "completions/mean_length"), strict=True)]
    syncs = logged(trainer, "adaptive_kl/ref_syncs")
    triggered = [kl > 1e-3 for kl in step_kl]
    assert syncs == [float(sum(triggered[: step + 1])) for step in range(8)]
    assert 2 <= sum(triggered) < 8
    assert all(step_kl[step + 1] == 0.0 for step in range(7) if triggered[step])
    assert any(0.0 < kl <= 1e-3 for kl in step_kl)  # due steps whose KL stayed below the trigger


@pytest.mark.parametrize("reset", [True, False])
def test_optimizer_reset_empties_the_optimizer_state_at_each_sync(tokenizer, tmp_path, reset: bool) -> None:
    """Syncs after steps 2 and 4: with the reset, the optimizer state is empty right after each sync and Adam counts
    its steps from the sync; without it the state is kept. The learning-rate schedule is the same either way."""
    trainer, recorder = recorded_run(tokenizer, str(tmp_path), max_steps=5, ref_model_sync_reset_optimizer=reset,
                                     **HARD_SYNC)
    sizes = [step["optimizer_state_size"] for step in recorder.steps]
    adam_steps = [step["adam_steps"] for step in recorder.steps]
    if reset:
        assert sizes == [28, 0, 28, 0, 28]
        assert adam_steps == [[1.0], [], [1.0], [], [1.0]]
    else:
        assert sizes == [28] * 5
        assert adam_steps == [[1.0], [2.0], [3.0], [4.0], [5.0]]
    assert logged(trainer, "learning_rate") == pytest.approx([5e-3 * (1 - step / 5) for step in range(5)])
    assert logged(trainer, "adaptive_kl/ref_syncs") == [0.0, 1.0, 1.0, 2.0, 2.0]


def test_dynamic_beta_carries_across_syncs(tokenizer, tmp_path) -> None:
    """A sync moves the reference, not beta: with a constant reward above the threshold, `dynamic` halves beta after
    every step as without syncing, while a hard sync happens after every step."""
    trainer = make_trainer(tokenizer, str(tmp_path), constant_reward(1.0), model_kind="peft_config", max_steps=4,
                           kl_adaptation_method="dynamic", dynamic_beta_decay=0.5, sync_ref_model=True,
                           ref_model_sync_steps=1, ref_model_mixup_alpha=1.0)
    trainer.train()
    assert logged(trainer, "adaptive_kl/current_beta") == pytest.approx([0.04, 0.02, 0.01, 0.005])
    assert logged(trainer, "adaptive_kl/ref_syncs") == [1.0, 2.0, 3.0, 4.0]


# ----- checkpoints ----------------------------------------------------------------------------------------------------

RESUMED_METRICS = ("loss", "reward", "adaptive_kl/raw_kl", "adaptive_kl/ref_syncs", "kl")


@pytest.mark.parametrize("model_kind", ["peft_config", "full"])
def test_resume_after_a_sync_continues_as_the_uninterrupted_run(tokenizer, tmp_path, model_kind: str) -> None:
    """alpha = 0.5, syncs after steps 2, 4 and 6, a checkpoint after step 3: resumed from it, steps 4-6 log what the
    uninterrupted run logged. The same checkpoint without the saved reference resumes with the initial reference (no
    sync yet), and its KL differs: the synced reference comes from the checkpoint."""
    settings = dict(max_steps=6, save_strategy="steps", save_steps=3, sync_ref_model=True, ref_model_sync_steps=2,
                    ref_model_mixup_alpha=0.5, model_kind=model_kind)
    full = make_trainer(tokenizer, str(tmp_path / "full"), **settings)
    full.train()
    checkpoint = tmp_path / "full" / "checkpoint-3"
    saved = torch.load(checkpoint / STATE_FILE, weights_only=True)
    assert (saved["syncs"], saved["last_sync_step"]) == (1, 2)
    reference = full.adaptive_kl_reference.reference
    expected_keys = reference.names if model_kind == "peft_config" else list(full.ref_model.state_dict())
    assert list(saved["reference"]) == expected_keys
    resumed = make_trainer(tokenizer, str(tmp_path / "resumed"), **settings)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    for name in RESUMED_METRICS:  # the resumed run's log history starts with the checkpoint's 3 steps
        assert logged(resumed, name) == pytest.approx(logged(full, name), rel=1e-6, abs=1e-9), name
    assert logged(full, "adaptive_kl/ref_syncs") == [0.0, 1.0, 1.0, 2.0, 2.0, 3.0]
    assert (resumed.adaptive_kl_reference.syncs, resumed.adaptive_kl_reference.last_sync_step) == (3, 6)
    if model_kind == "peft_config":  # resumed with syncing off: the synced reference is dropped, and said
        unsynced = make_trainer(tokenizer, str(tmp_path / "unsynced"), **{**settings, "sync_ref_model": False})
        with pytest.warns(UserWarning, match=rf"checkpoint-3/{STATE_FILE} holds the reference this run synced 1 "):
            unsynced.train(resume_from_checkpoint=str(checkpoint))

    (checkpoint / STATE_FILE).unlink()
    without = make_trainer(tokenizer, str(tmp_path / "without"), **settings)
    bound = BoundReference(without)
    without.add_callback(bound)  # after the sync's own callback: sees the reference it bound
    into = {"full": "the trainer's reference model",
            "peft_config": "a copy of the adapter as resumed, not into the initial adapter \\(which the checkpoint "
                           "lacks\\)"}[model_kind]
    with pytest.warns(UserWarning, match=rf"^adaptive_kl: .*checkpoint-3/{STATE_FILE} is missing: no sync so far, so "
                                         rf"TRL's own reference serves until the first sync, which then mixes the "
                                         rf"policy into {into}\.$"):
        without.train(resume_from_checkpoint=str(checkpoint))
    assert logged(without, "adaptive_kl/raw_kl")[3] != pytest.approx(logged(full, "adaptive_kl/raw_kl")[3], rel=1e-3)
    if model_kind == "peft_config":  # the copy is the resumed adapter, which step 3 had trained away from the initial
        initial = make_trainer(tokenizer, str(tmp_path / "initial"), **settings).model
        assert same_tensors(bound.reference, bound.policy)
        assert not all(torch.equal(bound.policy[name], dict(initial.named_parameters())[name].detach())
                       for name in bound.policy)


class BoundReference(TrainerCallback):
    """The reference a trainer's sync bound when training began, and the policy's trainable tensors then."""

    def __init__(self, trainer) -> None:
        self.trainer = trainer

    def on_train_begin(self, *args, **kwargs) -> None:
        sync = self.trainer.adaptive_kl_reference
        self.reference = {name: tensor.detach().clone() for name, tensor in sync.reference.named_tensors()}
        self.policy = {name: p.detach().clone() for name, p in self.trainer.model.named_parameters() if p.requires_grad}


# ----- two processes ------------------------------------------------------------------------------------------------

def run_two_processes(mode: str, output_dir: Path) -> list[dict]:
    torchrun(Path(__file__).with_name("distributed_ref_sync.py"), mode, str(output_dir), timeout=600)
    return [torch.load(output_dir / f"{mode}-rank{rank}.pt", weights_only=False) for rank in (0, 1)]


def same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)


def test_ddp_ranks_sync_at_the_same_steps_and_hold_the_same_reference(tmp_path) -> None:
    """Two DDP processes: the PEFT run (alpha 0.5, a sync due after every step, ref_model_sync_kl = 1e-3 on the
    all-process raw KL) and the full-model run (a hard sync every 2 steps) log the same KL and sync counts on both
    ranks, and both ranks end with the same reference, bit for bit, which is what the checkpoint holds."""
    ranks = run_two_processes("ddp", tmp_path)
    for run in ("peft", "full"):
        first, second = ranks[0][run], ranks[1][run]
        assert first["raw_kl"] == second["raw_kl"] and first["syncs"] == second["syncs"]
        assert (first["count"], first["last_sync_step"]) == (second["count"], second["last_sync_step"])
        assert same_tensors(first["reference"], second["reference"]) and same_tensors(first["policy"], second["policy"])
    peft = ranks[0]["peft"]
    triggered = [kl > 1e-3 for kl in peft["raw_kl"]]
    assert peft["syncs"] == [float(sum(triggered[: step + 1])) for step in range(4)]
    assert 1 <= sum(triggered) < 4  # measured: only step 3 (3.8e-3) of 0, 7.8e-4, 3.8e-3, 8.2e-4
    saved = torch.load(tmp_path / "peft" / "checkpoint-4" / STATE_FILE, weights_only=True)
    assert same_tensors(saved["reference"], peft["reference"]) and saved["syncs"] == peft["count"]
    full = ranks[0]["full"]
    assert full["syncs"] == [0.0, 1.0, 1.0] and full["raw_kl"][2] == 0.0 < full["raw_kl"][1]


# torch 2.6's FSDP2 all-gather records an event on its stream, which that torch's CPU stream cannot (AttributeError:
# 'Stream' object has no attribute 'record_event'): its FSDP2 runs on accelerators alone (CI row k).
@pytest.mark.skipif(not hasattr(torch.cpu.Stream, "record_event"),
                    reason="this torch's FSDP2 cannot run on a CPU: torch.cpu.Stream has no record_event")
def test_fsdp2_sharded_reference_mixes_exchanges_and_checkpoints_whole_tensors(tokenizer, tmp_path) -> None:
    """A LoRA model sharded by FSDP2 over two CPU processes (accelerate runs no FSDP on CPUs, so this drives the
    reference directly): each rank holds a shard of every reference tensor; gathered, the mix is exactly
    0.5 * policy + 0.5 * initial and the same on both ranks; the forward with the reference exchanged in gives the
    logits of an unsharded model holding those tensors, and the policy's own values come back exactly; the reference
    saved by `ReferenceSync.save` (gathered, the process that writes nothing taking part in each gather) loads back
    into the shards exactly."""
    ranks = run_two_processes("fsdp2", tmp_path)
    first, second = ranks
    assert first["sharded"] and second["sharded"]
    for name in ("policy", "initial", "mixed", "restored", "reloaded"):
        assert same_tensors(first[name], second[name]), name
    assert all(torch.equal(0.5 * first["policy"][n] + 0.5 * first["initial"][n], first["mixed"][n]) for n in first["mixed"])
    assert same_tensors(first["restored"], first["policy"]) and same_tensors(first["reloaded"], first["mixed"])
    assert torch.equal(first["after_logits"], first["policy_logits"])
    unsharded = add_lora(build_tiny_model(tokenizer, seed=0), seed=0)
    with torch.no_grad():
        for name, p in unsharded.named_parameters():
            if p.requires_grad:
                p.copy_(first["mixed"][name])
        expected = unsharded(input_ids=torch.arange(2, 8).view(1, 6)).logits
    assert torch.allclose(first["reference_logits"], expected, atol=1e-6)
    assert (first["reference_logits"] - first["policy_logits"]).abs().max() > 1e-2


# ----- the schedule, the checkpointed state and the refusals, on hand-made objects ----------------------------------

def test_a_sync_is_due_on_multiples_of_the_steps_and_only_above_the_kl_trigger() -> None:
    """due(step, kl) = step % steps == 0 and (min_kl is None or kl > min_kl): with steps = 3, after steps 3 and 6 of
    1-7 (not after step 1); with min_kl = 1e-3, a KL of 2e-3 (or inf) triggers, exactly 1e-3 is not above it, 5e-4 is
    below, and NaN (no KL measured) never triggers."""
    every_3 = SyncSchedule(steps=3, alpha=1.0, min_kl=None, reset_optimizer=False)
    assert [step for step in range(1, 8) if every_3.due(step, math.nan)] == [3, 6]
    trigger = SyncSchedule(steps=1, alpha=1.0, min_kl=1e-3, reset_optimizer=False)
    assert [trigger.due(5, kl) for kl in (2e-3, math.inf, 1e-3, 5e-4, math.nan)] == [True, True, False, False, False]


class HandMadeTrainer:
    """What `ReferenceSync` reads of a trainer: the (unwrapped) model, no `ref_model` (a PEFT-like policy whose
    trainable tensors are the reference's), the step's raw KL, an optimizer and the metrics."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model, self.ref_model = model, None
        self.accelerator = SimpleNamespace(unwrap_model=lambda m: m)
        self.adaptive_kl = SimpleNamespace(last_raw_kl=math.nan)
        self.optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        self._metrics = {"train": {}}


def synced_linear(steps: int, alpha: float) -> tuple[ReferenceSync, torch.nn.Linear, list[torch.Tensor]]:
    torch.manual_seed(0)
    layer = torch.nn.Linear(3, 2)
    initial = [p.detach().clone() for p in layer.parameters()]
    sync = ReferenceSync(HandMadeTrainer(layer), SyncSchedule(steps=steps, alpha=alpha, min_kl=None,
                                                              reset_optimizer=False))
    sync.on_train_begin(None, SimpleNamespace(max_steps=steps + 1), None)  # a run that trains after a sync
    return sync, layer, initial


def test_a_full_models_sync_mixes_every_reference_parameter_and_writes_no_policy_parameter() -> None:
    """A full model's reference is the trainer's `ref_model`: policy parameters all 4, reference all 2, alpha = 0.25;
    after the sync every reference parameter (weight and bias) is 0.25 * 4 + 0.75 * 2 = 2.5 exactly (a hard reset
    would give 4, the weights swapped 3.5), and the policy is still 4."""
    policy, ref_model = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    with torch.no_grad():
        for p, r in zip(policy.parameters(), ref_model.parameters()):
            p.fill_(4.0)
            r.fill_(2.0)
    trainer = HandMadeTrainer(policy)
    trainer.ref_model = ref_model
    sync = ReferenceSync(trainer, SyncSchedule(steps=1, alpha=0.25, min_kl=None, reset_optimizer=False))
    sync.on_step_end(None, SimpleNamespace(global_step=1), None)
    assert sync.syncs == 1 and sync.moved_adapter() is None  # the trainer's ref_model serves: nothing to exchange in
    assert [r.tolist() for r in ref_model.parameters()] == [[[2.5] * 3] * 2, [2.5] * 2]
    assert [p.tolist() for p in policy.parameters()] == [[[4.0] * 3] * 2, [4.0] * 2]


def test_a_sync_that_no_step_of_the_run_trains_on_is_said(recwarn) -> None:
    """sync_ref_model=True with TRL's default ref_model_sync_steps=512 in a run of 4 steps never synced, and said
    nothing; nor did a sync at the last step (ref_model_sync_steps = max_steps), after which nothing trains. A run
    that trains after a sync, or whose length is unknown (max_steps 0), says nothing."""
    sync, _, _ = synced_linear(steps=3, alpha=0.5)
    for max_steps in (2, 3):
        with pytest.warns(UserWarning) as caught:
            sync.on_train_begin(None, SimpleNamespace(max_steps=max_steps), None)
        assert [str(w.message) for w in caught] == [
            f"adaptive_kl: sync_ref_model=True syncs every ref_model_sync_steps=3 optimizer steps, and this run has "
            f"{max_steps}: no step trains against a synced reference. Set ref_model_sync_steps below {max_steps} to "
            "sync it."]
    recwarn.clear()
    for max_steps in (4, 0):
        sync.on_train_begin(None, SimpleNamespace(max_steps=max_steps), None)
    assert not [w for w in recwarn if "synced reference" in str(w.message)]


@pytest.mark.parametrize("training", [True, False])
def test_the_synced_peft_reference_forward_draws_no_lora_dropout(training: bool) -> None:
    """The stock PEFT reference runs with its adapter disabled, so LoRA dropout never acts on it; the synced one runs
    through the adapter, in train mode: with lora_dropout=0.3 two reference forwards of one batch differed by 0.12.
    Inside the exchange every LoRA dropout is off (two forwards equal), and in its own mode again after it: train mode
    in training, and still eval mode for a model in eval mode (an evaluation's generation), not switched to train."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    model = get_peft_model(base, LoraConfig(r=4, lora_dropout=0.3, target_modules=["0", "1"], init_lora_weights=False))
    model.train(training)
    reference = AdapterReference(model)
    assert len(reference.dropouts) == 2
    x = torch.randn(16, 8)
    with torch.no_grad(), reference.swapped_in():
        assert torch.equal(model(x), model(x))
    assert [dropout.training for dropout in reference.dropouts] == [training, training]
    with torch.no_grad():  # the policy's own forward draws it in train mode, as before, and not in eval mode
        assert torch.equal(model(x), model(x)) is not training


def test_before_the_first_sync_the_reference_forward_runs_trls_ref_adapter() -> None:
    """A PeftModel given to the trainer gets TRL's frozen "ref" adapter (a copy of its own); until the first sync (no
    synced reference set) `use_reference(model, "ref")` runs that adapter as stock TRL's `use_adapter` does, not the
    base model with every adapter disabled: by hand, W x + b + s B_ref (A_ref x) with s = lora_alpha / r = 8 / 2.
    The "default" adapter is active again after it."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    lora = dict(r=2, lora_alpha=8, target_modules=["0"], init_lora_weights=False)
    model = get_peft_model(torch.nn.Sequential(torch.nn.Linear(4, 4)), LoraConfig(**lora))
    model.add_adapter("ref", LoraConfig(**lora))
    layer = model.base_model.model[0]
    x = torch.randn(3, 4)
    a, b = layer.lora_A["ref"].weight, layer.lora_B["ref"].weight
    by_hand = x @ layer.base_layer.weight.T + layer.base_layer.bias + 4.0 * (x @ a.T) @ b.T
    with torch.no_grad(), use_reference(model, "ref"):
        assert torch.allclose(model(x), by_hand, atol=1e-6)
        assert not torch.allclose(model(x), layer.base_layer(x), atol=1e-3)  # the adapter acts
    assert model.active_adapter == "default"


def test_a_peft_model_with_no_trainable_tensor_is_refused() -> None:
    """A PEFT reference is a copy of the policy's trainable tensors: a model with none (every tensor frozen) would
    sync an empty copy, a reference that never moves, so it is refused when the reference is built."""
    layer = torch.nn.Linear(3, 2).requires_grad_(False)
    with pytest.raises(ValueError, match=r"^sync_ref_model=True needs trainable parameters in the PEFT model; it has "
                                         r"none\.$"):
        AdapterReference(layer)


def test_a_synced_checkpoint_resumed_without_syncing_says_the_reference_changes(tmp_path, recwarn) -> None:
    """A checkpoint whose reference was synced, resumed with sync_ref_model=False, went on from the trainer's own
    reference without a word (its KL drifted from the uninterrupted run's at once); a checkpoint whose run never
    synced, or that has no reference file, says nothing."""
    sync, layer, _ = synced_linear(steps=1, alpha=0.5)
    sync.on_step_end(None, SimpleNamespace(global_step=1), None)
    sync.on_step_end(None, SimpleNamespace(global_step=2), None)
    sync.save(str(tmp_path), write=True)
    with pytest.warns(UserWarning) as caught:
        warn_if_synced_reference_dropped(str(tmp_path))
    assert [str(w.message) for w in caught] == [
        f"adaptive_kl: {tmp_path / STATE_FILE} holds the reference this run synced 2 time(s), and sync_ref_model=False "
        "now: the resumed run uses the trainer's own reference instead. Set sync_ref_model=True (with the "
        "checkpoint's sync settings) to continue from the synced one."]
    unsynced, _, _ = synced_linear(steps=5, alpha=0.5)
    (tmp_path / "unsynced").mkdir()
    unsynced.save(str(tmp_path / "unsynced"), write=True)
    warn_if_synced_reference_dropped(str(tmp_path / "unsynced"))
    warn_if_synced_reference_dropped(str(tmp_path / "elsewhere"))
    assert not [w for w in recwarn if "holds the reference" in str(w.message)]


def test_the_checkpoint_restores_the_count_the_last_sync_step_and_the_reference(tmp_path) -> None:
    """A Linear(3, 2), weight and bias trainable, syncing every 2 steps with alpha = 0.5: the policy moves by +2 after
    training starts, so the sync after step 2 gives R = 0.5 (P0 + 2) + 0.5 P0 = P0 + 1 (step 1 syncs nothing; before
    the first sync the reference forward is the stock one, after it the copy). Saved and loaded into a fresh run
    (policy P0) before it is bound (restored when training starts) and after: 1 sync, last at step 2, R = P0 + 1."""
    sync, layer, initial = synced_linear(steps=2, alpha=0.5)
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(2.0)
    sync.on_step_end(None, SimpleNamespace(global_step=1), None)
    assert (sync.syncs, sync.last_sync_step, sync.moved_adapter()) == (0, 0, None)
    assert sync.trainer._metrics["train"]["adaptive_kl/ref_syncs"] == [0.0]
    sync.on_step_end(None, SimpleNamespace(global_step=2), None)
    assert (sync.syncs, sync.last_sync_step, sync.moved_adapter()) == (1, 2, sync.reference)
    assert sync.trainer._metrics["train"]["adaptive_kl/ref_syncs"] == [1.0]
    assert all(torch.allclose(r, p0 + 1.0, atol=1e-6) for r, p0 in zip(sync.reference.tensors, initial))
    assert all(torch.equal(p, p0 + 2.0) for p, p0 in zip(layer.parameters(), initial))  # the policy is not written
    sync.save(str(tmp_path), write=True)
    for bound_before_loading in (False, True):
        resumed, _, _ = synced_linear(steps=2, alpha=0.5)
        if not bound_before_loading:
            resumed.reference = None
        resumed.load(str(tmp_path))
        resumed.bind()
        assert (resumed.syncs, resumed.last_sync_step) == (1, 2)
        assert resumed.moved_adapter() is resumed.reference
        assert all(torch.allclose(r, p0 + 1.0, atol=1e-6) for r, p0 in zip(resumed.reference.tensors, initial))


def test_a_process_that_writes_no_checkpoint_copies_no_reference_to_the_host(tmp_path, monkeypatch) -> None:
    """Every process copied the whole reference to the host at each checkpoint, the ones writing nothing included (N
    host copies of a full model under DDP); only an FSDP2 shard needs every process, for its gather (the FSDP2 test
    checkpoints across two processes)."""
    sync, _, _ = synced_linear(steps=1, alpha=0.5)
    copied: list[torch.Tensor] = []
    monkeypatch.setattr(ref_sync, "_full", lambda tensor: copied.append(tensor) or tensor.detach().cpu())
    sync.save(str(tmp_path), write=False)
    assert copied == [] and not (tmp_path / STATE_FILE).exists()
    sync.save(str(tmp_path), write=True)
    assert len(copied) == 2 and (tmp_path / STATE_FILE).exists()


def test_a_checkpointed_reference_of_other_tensors_is_refused(tmp_path) -> None:
    """The checkpoint holds the reference of weight and bias; a model whose bias is frozen has the reference of its
    weight alone: loading refuses, naming the unexpected tensor, instead of loading part of it."""
    sync, _, _ = synced_linear(steps=1, alpha=1.0)
    sync.save(str(tmp_path), write=True)
    torch.manual_seed(0)
    layer = torch.nn.Linear(3, 2)
    layer.bias.requires_grad_(False)
    other = ReferenceSync(HandMadeTrainer(layer), SyncSchedule(steps=1, alpha=1.0, min_kl=None, reset_optimizer=False))
    other.load(str(tmp_path))
    with pytest.raises(ValueError) as error:
        other.bind()
    assert str(error.value).startswith(f"The checkpoint's synced reference ({STATE_FILE}) has other tensors than this "
                                       "model's reference: missing [], unexpected ['bias'].")


@pytest.mark.parametrize(("state", "message"), [
    (SimpleNamespace(deepspeed_plugin=SimpleNamespace(zero_stage=3), fsdp_plugin=None),
     "sync_ref_model=True is not supported under DeepSpeed ZeRO-3 by unsloth_adaptive_kl"),
    (SimpleNamespace(deepspeed_plugin=None, fsdp_plugin=SimpleNamespace(fsdp_version=1)),
     "sync_ref_model=True is supported with FSDP2 (fsdp_version=2), not FSDP1, by unsloth_adaptive_kl"),
], ids=["zero3", "fsdp1"])
def test_zero3_and_fsdp1_are_refused_before_training(state: Any, message: str) -> None:
    """Refused where a trainer's syncing is attached (`attach_reference_sync`), before anything else is read."""
    with pytest.raises(NotImplementedError) as error:
        attach_reference_sync(SimpleNamespace(accelerator=SimpleNamespace(state=state)))
    assert str(error.value).startswith(message)
    for supported in (SimpleNamespace(deepspeed_plugin=SimpleNamespace(zero_stage=2), fsdp_plugin=None),
                      SimpleNamespace(deepspeed_plugin=None, fsdp_plugin=SimpleNamespace(fsdp_version=2)),
                      SimpleNamespace()):
        check_supported(SimpleNamespace(accelerator=SimpleNamespace(state=supported)))


def test_an_exchange_failing_midway_restores_exactly_the_tensors_already_exchanged(monkeypatch) -> None:
    """The reference is the policy + 1; the second exchange (the bias) fails, as an out-of-memory clone would: the
    weight, already exchanged, gets its own values back, and the bias, never exchanged, is not exchanged afterwards
    (policy and reference both as they were)."""
    layer, reference, weights = reference_one_above()
    real_exchange, calls = ref_sync._exchange, []

    def second_fails(a: torch.Tensor, b: torch.Tensor) -> None:
        calls.append(a.shape)
        if len(calls) == 2:
            raise RuntimeError("out of memory")
        real_exchange(a, b)

    monkeypatch.setattr(ref_sync, "_exchange", second_fails)
    with pytest.raises(RuntimeError, match="out of memory"), reference.swapped_in():
        pass
    assert calls == [layer.weight.shape, layer.bias.shape, layer.weight.shape]  # the weight exchanged back alone
    assert all(torch.equal(w, p) for w, p in zip(weights, layer.parameters()))
    assert all(torch.equal(r, w + 1.0) for r, w in zip(reference.tensors, weights))
