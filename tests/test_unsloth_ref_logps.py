"""Issue #18: what Unsloth's generated GRPO trainer scores, against a plain forward of the same ids (one subprocess,
this file run as a script through tests/unsloth_cpu.py's setup, since importing unsloth rewrites TRL).

Pinned, for the installed unsloth / unsloth_zoo:
  * Unsloth's: a completion holding the pad token id is scored as a different sequence. Its no-grad scoring
    (unsloth/models/rl_replacements.py, `_get_per_token_logps_and_entropies`) left-packs every row with unsloth_zoo's
    `left_pack_padding`, which moves every token equal to pad_token_id to the right, and rebuilds the attention mask
    as `input_ids != pad_token_id`; the loss mask (`create_completion_attention_mask`) drops those tokens too. So the
    log-probs are those of the sequence without its pad-id tokens, ending one token early per pad-id token, on every
    path (packed and padded loop). Pure torch on token ids: the same on a GPU.
  * Ours (the CPU harness): the harness's model is a plain transformers Llama, not a FastLanguageModel, so it ignores
    the `prefix_seg_info` of Unsloth's PrefixGrouper path; transformers reads the PG stream's restarting position_ids
    as packed sequences and scores completions 2..G of a group without their prompt. The tiny model's error (0.1-0.5
    nats) passes PG's first-use self-verify (0.7 nats). With PG off (the packed path, which PG, through Unsloth's
    own attention on a GPU, is built to equal) Unsloth's log-probs are the model's, and the step-1 `kl` is 0.
  * With a pad token the model cannot generate and PG off, the reference log-probs of a real training step match a
    plain forward and the step-1 `kl` metric is 0.
  * Ours (the package, expected to fail until fixed): kl_placement="reward" under Unsloth raises on a generation batch
    whose prompts differ in length, as Unsloth's log-probs then have max_left_pad more columns than TRL's mask.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.unsloth_runs import ROOT, needs_unsloth

# Two float32 computations of the same log-probs (Unsloth's packed [1, T] forward with a block-diagonal mask and its
# chunked log-softmax, against a batched padded forward and log_softmax) differ by rounding only: <= 7.2e-7 measured
# on this 2-layer width-64 model. 1e-4 leaves two orders of magnitude for other CPUs' summation orders and sits three
# orders below the smallest effect pinned here (> 0.01 asserted; 0.095-0.33 measured for PrefixGrouper rows, 0.22 for
# the pad-id row: this random tiny model is near uniform, log p ~ -3.95 for every token, so scoring the wrong token or
# losing the prompt moves log p by tenths of a nat), so neither side of a comparison can pass by the other's noise.
SAME = 1e-4


def run_subprocess(tmp_path: Path) -> dict:
    output = tmp_path / "ref_logps.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
           "UNSLOTH_GRPO_PREFIX_GROUPER": "1", "UNSLOTH_GRPO_SEQ_PACKING": "1"}  # both paths importable, toggled below
    result = subprocess.run([sys.executable, __file__, str(output)], cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return json.loads(output.read_text())


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> dict:
    return run_subprocess(tmp_path_factory.mktemp("ref_logps"))


@needs_unsloth
def test_pad_id_in_a_completion_is_scored_as_the_sequence_without_it(measured) -> None:
    for path in ("packed", "padded_loop"):
        entry = measured["pad"][path]
        # the row without a pad-id token: the model's log-probs
        assert entry["clean_vs_plain"] <= SAME, path
        # the row with one: up to the pad-id token the model's log-probs; from there those of the sequence with the
        # pad-id token removed (slot t holds log p(token t+1)), one token shorter; not the sampled sequence's (0.22)
        assert entry["padded_vs_plain_before_pad"] <= SAME, path
        assert entry["padded_vs_shifted"] <= SAME, path
        assert entry["padded_vs_plain_after_pad"] > 0.01, path
    # Unsloth's loss mask drops the pad-id token (TRL's counts it): one token fewer in that row only
    assert measured["pad"]["trl_mask_tokens"] == [4, 6]
    assert measured["pad"]["unsloth_mask_tokens"] == [4, 5]


@needs_unsloth
def test_prefix_grouper_scores_later_completions_without_prompt_on_a_plain_transformers_model(measured) -> None:
    pg = measured["prefix_grouper"]
    assert pg["engaged_rows_vs_plain"][0] <= SAME  # the group's first completion continues the prefix
    for row in (1, 2, 3):  # the others: without their prompt (positions restart: a new sequence to transformers)
        assert pg["engaged_rows_vs_isolated"][row] <= SAME, row
        assert pg["engaged_rows_vs_plain"][row] > 0.01, row
    assert max(pg["engaged_rows_vs_plain"]) < 0.7  # why PG's own self-verify (tol 0.7 nats) accepted it
    assert max(pg["off_rows_vs_plain"]) <= SAME  # the packed path: the model's log-probs


@needs_unsloth
def test_training_step_reference_matches_plain_forward_without_pad_and_prefix_grouper(measured) -> None:
    step = measured["step"]
    assert step["pad_id_sampled"] is False  # suppress_tokens: the pad token cannot be generated
    assert step["rows"] == 8 and step["ref_vs_plain"] <= SAME
    assert step["kl"] == [pytest.approx(0.0, abs=1e-9)]


@needs_unsloth
def test_kl_in_reward_on_a_left_padded_unsloth_batch_is_the_formula(measured) -> None:
    entry = measured["reward_left_padded"]
    assert entry["prompt_pads"] == [0, 4]  # left padding in the batch: max_left_pad = 4
    assert entry["error"] is None, entry["error"]
    # per completion a sum of 8 k1 terms (the reward placement's default), each moved by <= 2 SAME (k1 = logp - ref:
    # its derivative in either log-prob is 1), times beta 0.5
    assert entry["penalty"] == [pytest.approx(entry["expected"], abs=8 * SAME)]


# ---------------------------------------------------------------- the subprocess (python this_file OUTPUT_JSON)


def _scenario(out: str) -> dict[str, Any]:
    sys.argv = [str(ROOT / "tests" / "unsloth_cpu.py"), "ref_logps", out]  # the harness reads its scenario at import
    import tests.unsloth_cpu as H  # noqa: E402  (imports this package first, then unsloth, generates the trainer)
    import torch
    from datasets import Dataset

    trainer = H.make_trainer(os.path.dirname(out) + "/runs/direct", max_steps=1)
    generated = sys.modules[type(trainer).__module__]
    model, pad = trainer.model, trainer.processing_class.pad_token_id
    ids_of = H.TOKENIZER.convert_tokens_to_ids

    def batch(prompts: list[str], completions: list[list[int]]) -> dict:
        """TRL's layout: prompts left-padded, completions right-padded, masks from the lengths."""
        p = [ids_of(list(text)) for text in prompts]
        width, c_width = max(map(len, p)), max(map(len, completions))
        return {"prompt_ids": torch.tensor([[pad] * (width - len(r)) + r for r in p]),
                "prompt_mask": torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in p]),
                "completion_ids": torch.tensor([r + [pad] * (c_width - len(r)) for r in completions]),
                "completion_mask": torch.tensor([[1] * len(r) + [0] * (c_width - len(r)) for r in completions])}

    def token_logps(ids: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        """log p(ids[t] | ids[:t]) for t >= 1, one plain forward."""
        with torch.no_grad():
            logits = model(input_ids=ids.unsqueeze(0), **kwargs).logits[0, :-1].float()
        return torch.log_softmax(logits, -1).gather(-1, ids[1:, None])[:, 0]

    def unsloth_logps(b: dict) -> torch.Tensor:
        """The trainer's own no-grad scoring (the reference / old log-probs path), back in TRL's layout: Unsloth
        returns [B, C + max_left_pad], rows left-packed (row i's completion starts at column max_left_pad - pads_i)."""
        ids = torch.cat([b["prompt_ids"], b["completion_ids"]], 1)
        mask = torch.cat([b["prompt_mask"], b["completion_mask"]], 1)
        C = b["completion_ids"].size(1)
        with torch.no_grad():
            packed = trainer._get_per_token_logps_and_entropies(model, ids, mask, C, batch_size=ids.size(0))[0]
        pads = generated.calculate_pad_tokens_in_prompt(ids, C, pad)
        assert pads.tolist() == (b["prompt_mask"] == 0).sum(1).tolist()
        start = packed.size(1) - C - pads
        return packed.gather(1, start[:, None] + torch.arange(C)[None])

    def plain(b: dict) -> torch.Tensor:
        with torch.no_grad():
            return H.policy_logps(model, b)

    def fresh() -> None:  # forget Unsloth's per-model verification caches, so each path verifies anew
        for name in [n for n in vars(model) if n.startswith("_unsloth_seq_packing") or n.startswith("_unsloth_prefix")]:
            delattr(model, name)

    model.eval()
    results: dict[str, Any] = {}

    # 1. A completion holding the pad id (row 1, its third token), prompts of different lengths (left padding).
    a, b_, c, d, e, f = ids_of(list("xyz#+a"))
    eos = H.TOKENIZER.eos_token_id
    pad_batch = batch(["ab:", "cdefgh:"], [[a, b_, c, eos], [d, e, pad, f, a, eos]])
    reference = plain(pad_batch)
    prompt_1 = pad_batch["prompt_ids"][1][pad_batch["prompt_mask"][1].bool()]
    row = torch.cat([prompt_1, pad_batch["completion_ids"][1][:6]])
    kept = row[row != pad]
    shifted = token_logps(kept)[-5:]  # the 5 completion tokens left, scored without the pad-id token
    results["pad"] = {}
    generated.UNSLOTH_GRPO_PREFIX_GROUPER_ON = False
    for path, packing in (("packed", True), ("padded_loop", False)):
        generated.UNSLOTH_GRPO_SEQ_PACKING_ON = packing
        fresh()
        got = unsloth_logps(pad_batch)
        results["pad"][path] = {
            "clean_vs_plain": (got[0, :4] - reference[0, :4]).abs().max().item(),
            "padded_vs_shifted": (got[1, :5] - shifted).abs().max().item(),
            "padded_vs_plain_before_pad": (got[1, :2] - reference[1, :2]).abs().max().item(),
            "padded_vs_plain_after_pad": (got[1, 2:5] - reference[1, 2:5]).abs().max().item(),
        }
    ids = torch.cat([pad_batch["prompt_ids"], pad_batch["completion_ids"]], 1)
    C, max_left_pad = pad_batch["completion_ids"].size(1), int((pad_batch["prompt_mask"] == 0).sum(1).max())
    loss_mask = generated.create_completion_attention_mask(  # as grpo_accumulated_loss rebuilds it
        generated.left_pack_padding(ids, pad)[:, -(C + max_left_pad):],
        generated.calculate_pad_tokens_in_prompt(ids, C, pad), max_left_pad, pad)
    results["pad"]["trl_mask_tokens"] = pad_batch["completion_mask"].sum(1).tolist()
    results["pad"]["unsloth_mask_tokens"] = loss_mask.sum(1).tolist()

    # 2. PrefixGrouper: one group of 4 completions of one prompt (long enough to pass its token-reuse gate).
    completions = [ids_of(list(text)) + [eos] for text in ("x1y2", "ab cd", "q9z", "hello!")]
    group = batch(["a long prompt:"] * 4, completions)
    reference = plain(group)
    lengths = group["completion_mask"].sum(1).tolist()
    isolated = reference.clone()  # token 0 from the prompt; tokens 1.. from the completion alone
    for i, n in enumerate(lengths):
        if n > 1:
            isolated[i, 1:n] = token_logps(group["completion_ids"][i, :n])

    def per_row(x: torch.Tensor, y: torch.Tensor) -> list[float]:
        return [(x[i, :n] - y[i, :n]).abs().max().item() for i, n in enumerate(lengths)]

    generated.UNSLOTH_GRPO_SEQ_PACKING_ON = True
    generated.UNSLOTH_GRPO_PREFIX_GROUPER_ON = True
    fresh()
    engaged = unsloth_logps(group)
    generated.UNSLOTH_GRPO_PREFIX_GROUPER_ON = False
    fresh()
    off = unsloth_logps(group)
    results["prefix_grouper"] = {"engaged_rows_vs_plain": per_row(engaged, reference),
                                 "engaged_rows_vs_isolated": per_row(engaged, isolated),
                                 "off_rows_vs_plain": per_row(off, reference)}

    # 3. A training step, the pad token not generatable, PrefixGrouper off (no-grad path here, grad path in the zoo
    # loss, memoised on the function): the first generation batch's reference log-probs and the logged kl.
    step = H.make_trainer(os.path.dirname(out) + "/runs/step", max_steps=1,
                          generation_kwargs={"suppress_tokens": [pad]})
    step_module = sys.modules[type(step).__module__]
    step_module.UNSLOTH_GRPO_PREFIX_GROUPER_ON = False
    step_module.grpo_accumulated_loss._pg_funcs = ()
    captured: dict = {}
    upstream = step._generate_and_score_completions

    def capture(inputs: Any) -> dict:
        output = upstream(inputs)
        if not captured:
            with torch.no_grad(), step.model.disable_adapter():
                captured.update(output=output, plain=H.policy_logps(step.model, output))
        return output

    step._generate_and_score_completions = capture
    step.train()
    output = captured["output"]
    C = output["completion_ids"].size(1)
    pads = (output["prompt_mask"] == 0).sum(1)
    ref = output["ref_per_token_logps"]
    ref = ref.gather(1, (ref.size(1) - C - pads)[:, None] + torch.arange(C)[None])
    mask = output["completion_mask"].bool()
    results["step"] = {"rows": int(mask.any(1).sum()),
                       "pad_id_sampled": bool((output["completion_ids"].eq(pad) & mask).any()),
                       "ref_vs_plain": (ref - captured["plain"])[mask].abs().max().item(),
                       "kl": H.logged(step, "kl")}

    # 4. kl_placement="reward" on a left-padded generation batch (two prompts of different lengths): the reward
    # penalty against the formula on plain forwards. Unsloth hands its log-probs over left-packed,
    # (B, C + max_left_pad).
    reward = H.make_trainer(os.path.dirname(out) + "/runs/reward", max_steps=1, per_device_train_batch_size=8,
                            gradient_accumulation_steps=1, kl_placement="reward", kl_reduction="sequence_sum", beta=0.5,
                            generation_kwargs={"suppress_tokens": [pad]})
    reward.train_dataset = Dataset.from_dict({"prompt": ["ab:", "cdefgh:"]})
    H.perturb_adapters(reward.model)
    weights = {name: p.detach().clone() for name, p in reward.model.named_parameters()}  # scored with these
    captured: dict = {}
    scoring = reward._get_per_token_logps_and_entropies

    def record(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int, *args: Any,
               **kwargs: Any) -> Any:
        """The first scoring call's ids and masks, in TRL's layout."""
        captured.setdefault("batch", {
            "prompt_ids": input_ids[:, :-logits_to_keep], "prompt_mask": attention_mask[:, :-logits_to_keep],
            "completion_ids": input_ids[:, -logits_to_keep:], "completion_mask": attention_mask[:, -logits_to_keep:]})
        return scoring(model, input_ids, attention_mask, logits_to_keep, *args, **kwargs)

    reward._get_per_token_logps_and_entropies = record
    try:
        reward.train()
        error = None
    except RuntimeError as caught:
        error = str(caught)
    split = captured["batch"]
    with torch.no_grad():
        for name, p in reward.model.named_parameters():  # back to the weights before the optimizer step
            p.copy_(weights[name])
        policy = H.policy_logps(reward.model, split)
        with reward.model.disable_adapter():
            reference = H.policy_logps(reward.model, split)
    sums = H.completion_kl_by_hand(policy, reference, split["completion_mask"], "sequence_sum")
    results["reward_left_padded"] = {"prompt_pads": sorted(set((split["prompt_mask"] == 0).sum(1).tolist())),
                                     "error": error, "penalty": H.logged(reward, "adaptive_kl/reward_penalty"),
                                     "expected": 0.5 * sums.mean().item()}
    return results


if __name__ == "__main__":
    target = sys.argv[1]
    measured_values = _scenario(target)
    with open(target, "w") as f:
        json.dump(measured_values, f)
