"""The KL lab through the real trainers (unsloth_adaptive_kl/tools/trainer_lab.py): its exact figures against a plain
forward pass, its command line, and the end-to-end guard: k1 in the reward reaches pi*_beta through TRL's real
GRPOTrainer, with the package's patch, in the compositions a wrong gradient would show in (the dr_grpo normaliser,
gradient accumulation, steps on samples one step old)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from unsloth_adaptive_kl.tools import kl_lab, trainer_lab
from unsloth_adaptive_kl.tools.kl_lab import ENVIRONMENTS, Tree, kl, optimum

ENV = ENVIRONMENTS["contains_a"]
# The guard's bound on KL(pi || pi*_beta), averaged over the training prompts. Noise floor: k1 in the reward measured
# 0 to 0.0018 over two seeds in each of these recipes (docs/results/kl_lab_trl.json, 800 steps); a beta off by a
# factor 1.25 (a normaliser off by a quarter) lands over 0.005 away and a factor 2 over 0.05 (test below).
TOLERANCE = 0.005


@pytest.fixture(scope="module")
def tables() -> dict[str, torch.Tensor]:
    torch.set_num_threads(1)
    return trainer_lab.reference_tables(ENV, (*trainer_lab.TRAIN_PROMPTS, trainer_lab.HELD_OUT))


def test_node_tables_give_every_completions_probability_of_a_forward_pass(tables) -> None:
    """log pi(y | x) from the 15 node rows (Tree's enumeration) against the sum of the model's token log-probs over
    prompt + completion in one forward pass each, for all 31 completions of two prompts; they sum to 1."""
    tokenizer = trainer_lab.lab_tokenizer()
    model = trainer_lab.lab_model(tokenizer).eval()
    tree = Tree(ENV)
    ids = trainer_lab.token_ids(tokenizer)  # a, b, EOS
    for prompt in ("aab", trainer_lab.HELD_OUT):
        enumerated = tree.log_probs(tables[prompt])
        prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        assert float(enumerated.exp().sum()) == pytest.approx(1.0, abs=1e-9)
        for c, completion in enumerate(tree.completions):
            sequence = torch.tensor([prompt_ids + ids[list(completion)].tolist()])
            with torch.no_grad():
                logps = torch.log_softmax(model(input_ids=sequence).logits[0].double(), -1)
            by_forward = sum(float(logps[len(prompt_ids) - 1 + t, sequence[0, len(prompt_ids) + t]])
                             for t in range(len(completion)))
            assert float(enumerated[c]) == pytest.approx(by_forward, abs=1e-5), (prompt, completion)


def test_the_tokenizer_is_the_three_symbols_and_a_pad_the_model_does_not_sample(tables) -> None:
    tokenizer = trainer_lab.lab_tokenizer()
    assert len(tokenizer) == 4 and (tokenizer.pad_token_id, tokenizer.eos_token_id) == (0, 1)
    assert tokenizer("aba", add_special_tokens=False)["input_ids"] == [2, 3, 2]
    assert tokenizer.batch_decode([[2, 3, 1, 0]], skip_special_tokens=True) == ["ab"]
    for table in tables.values():  # the three symbols hold the probability to float64's precision (pad: ~e^-80)
        assert float(table.exp().sum(-1).min()) > 1 - 1e-12
    eos_pads = trainer_lab.lab_tokenizer(pad_is_eos=True)
    assert len(eos_pads) == 3 and eos_pads.pad_token_id == eos_pads.eos_token_id == 0


def test_set_reads_literals_and_strings_and_refuses_what_is_not_a_pair() -> None:
    assert trainer_lab.parse_overrides(["loss_type=dapo", "num_iterations=2", "beta=0.25", "scale_rewards=none",
                                        "mask_truncated_completions=True", "top_k=None"]) == (
        ("loss_type", "dapo"), ("num_iterations", 2), ("beta", 0.25), ("scale_rewards", "none"),
        ("mask_truncated_completions", True), ("top_k", None))
    with pytest.raises(SystemExit, match="expected FIELD=VALUE"):
        trainer_lab.parse_overrides(["loss_type"])
    with pytest.raises(SystemExit, match="--recipe nope: unknown; the recipes are dr_grpo, defaults"):
        kl_lab.main(["--trainer", "trl", "--recipe", "nope"])
    with pytest.raises(SystemExit, match="--estimator, --no-target: not read with --trainer trl"):
        kl_lab.main(["--trainer", "trl", "--estimator", "k1", "--no-target"])
    with pytest.raises(SystemExit, match="--set, --pad-is-eos: not read with --trainer tabular"):
        kl_lab.main(["--set", "loss_type=dapo", "--pad-is-eos"])


def test_the_set_fields_reach_the_config_last() -> None:
    setting = next(s for s in trainer_lab.trainer_settings() if s.label == "k3 in the loss (the trainer's own)")
    run = trainer_lab.LabRun("trl", setting, trainer_lab.RECIPES["accumulation"], 0.5, 10, 0,
                             overrides=(("loss_type", "dapo"), ("gradient_accumulation_steps", 4)))
    fields = trainer_lab.config_fields(run, "out")
    assert fields["beta"] == pytest.approx(0.5 * 7 / 8)  # a loss-side beta at beta (G - 1) / G, as the tabular lab
    assert (fields["loss_type"], fields["scale_rewards"], fields["gradient_accumulation_steps"]) == ("dapo", "none", 4)
    assert fields["per_device_train_batch_size"] == 32 and fields["learning_rate"] == 3e-3


def test_a_refused_combination_is_a_row_that_says_so(tmp_path) -> None:
    """--set passes any field through; a combination the package refuses (TRL #6586: the sequence-level ratio with the
    bias correction under an adapted k3) is refused before training and the row names the refusal, while a setting
    that is accepted with it trains."""
    result = kl_lab.main(["--trainer", "trl", "--recipe", "dr_grpo", "--only", "in the loss", "--steps", "2",
                          "--set", "importance_sampling_level=sequence", "use_bias_correction_kl=True"])
    rows = {row["setting"]: row for row in result["trainers"]["trl"]["rows"]}
    assert rows["clip in the loss"]["refused"].startswith(
        "use_bias_correction_kl=True is invalid: allowed is False with importance_sampling_level='sequence'")
    assert "refused" not in rows["k2 in the loss"]  # computed from the log-probs, without the trainer's factor
    assert rows["k2 in the loss"]["in_effect"]["importance_sampling_level"] == "sequence"
    (_, cells), = [group for group in trainer_lab.trainer_rows(result["trainers"]["trl"])]
    clip = next(cell for cell in cells if cell[0] == "clip in the loss")
    assert clip[1] == "refused before training (use_bias_correction_kl=True is invalid)" and set(clip[2:]) == {""}


def test_a_beta_off_by_a_quarter_is_beyond_the_guards_tolerance(tables) -> None:
    """The guard can fail: the optimum of a beta 1.25 or 0.8 times the one asked for is more than TOLERANCE away
    from pi*_beta (exactly, averaged over the training prompts), and a factor 2 an order of magnitude more."""
    def away(factor: float) -> float:
        return sum(kl(optimum(Tree(ENV, tables[p]), 0.5 * factor), optimum(Tree(ENV, tables[p]), 0.5))
                   for p in trainer_lab.TRAIN_PROMPTS) / len(trainer_lab.TRAIN_PROMPTS)

    assert min(away(1.25), away(0.8)) > TOLERANCE
    assert min(away(2.0), away(0.5)) > 10 * TOLERANCE


def test_k1_in_the_reward_reaches_the_optimum_through_trls_trainer(tmp_path) -> None:
    """The end-to-end guard: TRL's GRPOTrainer patched by this package, k1 in the reward, 800 steps of 64 completions
    through the recipes dr_grpo, gradient_accumulation_steps=2 and steps_per_generation=2, each lands on pi*_beta:
    KL(pi || pi*) within TOLERANCE and an effective beta within 5 % of 0.5, where a normaliser, the accumulation or
    a mask that is wrong moves it (test above)."""
    output = tmp_path / "guard.json"
    result = kl_lab.main(["--trainer", "trl", "--recipe", "dr_grpo", "--recipe", "accumulation", "--recipe", "spg2",
                          "--only", "k1 in the reward", "--seeds", "1", "--processes", "2", "--json", str(output)])
    table = result["trainers"]["trl"]
    assert json.loads(output.read_text())["trainers"]["trl"]["rows"] == json.loads(json.dumps(table["rows"]))
    assert [row["recipe"] for row in table["rows"]] == ["dr_grpo", "accumulation", "spg2"]
    for row in table["rows"]:
        effect = row["in_effect"]
        assert (effect["beta"], effect["loss_type"], effect["scale_rewards"]) == (0.5, "dr_grpo", "none")
        assert row["train"]["kl_opt"] < TOLERANCE, row
        assert math.isclose(row["train"]["effective_beta"], 0.5, rel_tol=0.05), row
        assert row["tabular"]["kl_opt"] < 1e-3  # the tabular lab's prediction: exact
    assert table["rows"][1]["in_effect"]["gradient_accumulation_steps"] == 2
    assert table["rows"][2]["in_effect"]["steps_per_generation"] == 2
