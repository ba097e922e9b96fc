"""The KL lab through the real trainers (unsloth_adaptive_kl/tools/trainer_lab.py): its exact figures against a plain
forward pass, a pad token out of reach by construction, its command line, its predictions from the settings in
effect, and the end-to-end guards: k1 in the reward and k1_future in the loss reach pi*_beta through TRL's real
GRPOTrainer, with the package's patch, in the compositions a wrong gradient would show in (the dr_grpo normaliser,
gradient accumulation, steps on samples one step old), and a method on TRL's own k3 lands where the tabular lab
predicts it."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch

from unsloth_adaptive_kl.core.config import FIELD_DEFAULTS
from unsloth_adaptive_kl.tools import kl_lab, tabular_lab, trainer_lab
from unsloth_adaptive_kl.tools.tabular_lab import ENVIRONMENTS, Setting, Tree, kl, optimum

ENV = ENVIRONMENTS["contains_a"]
ROOT = Path(__file__).resolve().parents[1]
TOLERANCE = trainer_lab.GUARD_TOLERANCE  # the guard's bound on KL(pi || pi*_beta) (its comment says why)


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


def test_the_pad_is_out_of_reach_whatever_the_weights_by_construction() -> None:
    """Why no machine can sample or train the pad token (the Unsloth guard rested on it, and float differences between
    CPUs once decided it): with every weight but the pad's row of lm_head redrawn N(0, 1) (50 times the initial
    scale; the norms' weights too), the pad's
    logit is still PAD_LOGIT exactly, its probability 0 in float64, and its row's gradient exactly 0. Without the bias
    unit (the mutation) the same weights give the pad a logit that moves with them."""
    tokenizer = trainer_lab.lab_tokenizer()
    pad = tokenizer.pad_token_id
    model = trainer_lab.lab_model(tokenizer)
    assert trainer_lab.bias_unit(model) is model and len(model.model.norm._forward_hooks) == 1  # idempotent
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            keep = parameter[pad].clone() if name == "lm_head.weight" else None
            parameter.copy_(torch.randn(parameter.shape, generator=generator))
            if keep is not None:
                parameter[pad] = keep
    inputs = torch.tensor([[2, 3, 2, 1, 3]])
    logits = model(input_ids=inputs).logits
    assert torch.equal(logits[..., pad], torch.full_like(logits[..., pad], trainer_lab.PAD_LOGIT))
    assert pad == 0 and float(logits[..., 1:].abs().max()) < 1e3  # the others: 9000 above it at least
    torch.log_softmax(logits, -1)[..., 2].sum().backward()  # a policy-gradient-like loss on the letter 'a'
    assert torch.count_nonzero(model.lm_head.weight.grad[pad]) == 0
    table = trainer_lab.node_logits(model, tokenizer, "aab", Tree(ENV))
    assert float(table.exp().sum(-1).min()) > 1 - 1e-12
    model.model.norm._forward_hooks.clear()  # the mutation: no bias unit
    assert float(model(input_ids=inputs).logits[..., pad].max()) != trainer_lab.PAD_LOGIT


def test_set_reads_literals_and_strings_and_refuses_what_is_not_a_pair() -> None:
    assert trainer_lab.parse_overrides(["loss_type=dapo", "num_iterations=2", "beta=0.25", "scale_rewards=none",
                                        "mask_truncated_completions=True", "top_k=None"]) == (
        ("loss_type", "dapo"), ("num_iterations", 2), ("beta", 0.25), ("scale_rewards", "none"),
        ("mask_truncated_completions", True), ("top_k", None))
    with pytest.raises(SystemExit, match="expected FIELD=VALUE"):
        trainer_lab.parse_overrides(["loss_type"])
    # a name GRPOConfig has not failed with a TypeError inside every worker
    with pytest.raises(SystemExit, match=r"^--set 'foo=1': 'foo' is not a field of GRPOConfig$"):
        trainer_lab.parse_overrides(["foo=1"])
    assert trainer_lab.parse_overrides(["kl_adaptation_method=clip"]) == (("kl_adaptation_method", "clip"),)
    with pytest.raises(SystemExit, match="--recipe nope: unknown; the recipes are dr_grpo, defaults"):
        kl_lab.main(["--trainer", "trl", "--recipe", "nope"])
    with pytest.raises(SystemExit, match="--estimator, --no-target: not read with --trainer trl"):
        kl_lab.main(["--trainer", "trl", "--estimator", "k1", "--no-target"])
    with pytest.raises(SystemExit, match="--set, --pad-is-eos: not read with --trainer tabular"):
        kl_lab.main(["--set", "loss_type=dapo", "--pad-is-eos"])


def test_a_bad_number_a_flag_predict_does_not_read_or_an_only_in_no_label_is_refused_before_any_run() -> None:
    """Each was taken: --seeds 0 ended in a ZeroDivisionError, a negative --beta (or --predict's --set beta=-1) in a
    traceback, --beta 0 in tables of NaN; --json a folder in an IsADirectoryError after every table was printed;
    --predict dropped --json (nothing written), --only and --seeds without a word; an --only TEXT in no label ran an
    empty table ("1 rows") or dropped its rows."""
    for argv, message in ((["--seeds", "0"], "--seeds=0 is invalid: allowed is an integer >= 1"),
                          (["--steps", "-2"], "--steps=-2 is invalid: allowed is an integer >= 1"),
                          (["--processes", "0"], "--processes=0 is invalid: allowed is an integer >= 1"),
                          (["--beta", "-1"], "--beta=-1.0 is invalid: allowed is a finite number > 0"),
                          (["--beta", "nan"], "--beta=nan is invalid: allowed is a finite number > 0"),
                          # pi*_beta is undefined at 0: every table was NaN, exit 0
                          (["--beta", "0"], "--beta=0.0 is invalid: allowed is a finite number > 0"),
                          (["--json", "/"], "--json='/' is a folder: allowed is a file's path"),
                          (["--import", "no_such_module_here"], "--import no_such_module_here: no such module here"),
                          (["--import", "no_such.module"], "--import no_such.module: no such module here"),
                          (["--trainer", "trl", "--learning-rate", "0"],
                           "--learning-rate=0.0 is invalid: allowed is a finite number > 0"),
                          (["--predict", "--trainer", "trl", "--json", "p.json", "--only", "k1", "--seeds", "2"],
                           "--only, --json, --seeds: not read with --predict (it trains nothing: it reads --trainer, "
                           "--set, --beta, --env, --pad-is-eos and --import)"),
                          (["--only", "k1 in", "--only", "k9", "--only", "clip in the lost"],
                           "--only 'k9', 'clip in the lost': in no setting's label; the labels are beta = 0 (no KL); "
                           "k1 in the reward; k1 in the loss; "),
                          # the config's refusal of a --set value ended in a traceback
                          (["--predict", "--trainer", "trl", "--set", "beta=-1"],
                           "--predict: --set beta=-1: beta=-1 is invalid: allowed is a finite number >= 0."),
                          (["--trainer", "unsloth", "--only", "k9"],
                           "--only 'k9': in no setting's label; the labels are beta = 0 (no KL); k1 in the reward; "
                           "k3 in the reward; k3 in the loss (the trainer's own); ")):
        with pytest.raises(SystemExit) as refused:
            kl_lab.main(argv)
        assert str(refused.value.code).startswith(message), (argv, refused.value.code)
    only = ["in the reward", "beta = 0"]  # the docs' picks: each TEXT in some label, rows of either kept
    picked = [s.label for s in tabular_lab.chosen(tabular_lab.default_settings([], []), only)]
    assert picked[0] == "beta = 0 (no KL)" and picked[1] == "k1 in the reward" and len(picked) > 3
    assert all("in the reward" in label or "beta = 0" in label for label in picked)


def test_the_set_fields_reach_the_config_last() -> None:
    setting = next(s for s in trainer_lab.trainer_settings() if s.label == "k3 in the loss (the trainer's own)")
    run = trainer_lab.LabRun("trl", setting, trainer_lab.RECIPES["accumulation"], 0.5, 10, 0,
                             overrides=(("loss_type", "dapo"), ("gradient_accumulation_steps", 4)))
    fields = trainer_lab.config_fields(run, "out")
    assert fields["beta"] == pytest.approx(0.5 * 7 / 8)  # a loss-side beta at beta (G - 1) / G, as the tabular lab
    assert (fields["loss_type"], fields["scale_rewards"], fields["gradient_accumulation_steps"]) == ("dapo", "none", 4)
    assert fields["per_device_train_batch_size"] == 32 and fields["learning_rate"] == 3e-3


def test_a_refused_combination_is_a_row_that_says_so(tmp_path, monkeypatch) -> None:
    """--set passes any field through; a combination the package refuses (TRL #6586: the sequence-level ratio with the
    bias correction under an adapted k3) is refused before training and the row names the refusal, while a setting
    that is accepted with it trains."""
    monkeypatch.setenv("ADAPTIVE_KL_COMMIT", "0123456")
    result = kl_lab.main(["--trainer", "trl", "--recipe", "dr_grpo", "--only", "in the loss", "--steps", "2",
                          "--set", "importance_sampling_level=sequence", "use_bias_correction_kl=True"])
    assert result["commit"] == "0123456"  # the commit it ran at (source_commit)
    rows = {row["setting"]: row for row in result["trainers"]["trl"]["rows"]}
    assert rows["clip in the loss"]["refused"].startswith(
        "use_bias_correction_kl=True is invalid: allowed is False with importance_sampling_level='sequence'")
    assert "refused" not in rows["k2 in the loss"]  # computed from the log-probs, without the trainer's factor
    assert rows["k2 in the loss"]["in_effect"]["importance_sampling_level"] == "sequence"
    (_, cells), = [group for group in trainer_lab.trainer_rows(result["trainers"]["trl"])]
    clip = next(cell for cell in cells if cell[0].startswith("clip in the loss"))
    assert clip[0] == "clip in the loss: refused before training (use_bias_correction_kl=True is invalid)"
    assert set(clip[1:]) == {"-"}  # nothing under the figures' headers ("beta trained" read the refusal as a beta)
    # every row refused: it exited 0 with an empty table written; now it fails, naming why, and writes nothing
    written = tmp_path / "lab.json"
    with pytest.raises(SystemExit) as refused:
        kl_lab.main(["--trainer", "trl", "--recipe", "dr_grpo", "--only", "clip in the loss", "--json", str(written),
                     "--set", "importance_sampling_level=sequence", "use_bias_correction_kl=True"])
    assert str(refused.value.code).startswith("kl_lab: every setting was refused before training "
                                              "(use_bias_correction_kl=True is invalid: allowed is False with ")
    assert str(refused.value.code).endswith("; nothing written") and not written.exists()


def test_a_run_says_how_far_it_got_every_so_many_steps(monkeypatch, capfd) -> None:
    """Each worker prints its progress to stderr every `PROGRESS_EVERY` optimizer steps (every step here), so a run
    stopped from outside (the GPU check's time limit) leaves in its log the last step it finished."""
    monkeypatch.setattr(trainer_lab, "PROGRESS_EVERY", 1)  # the workers are forked: they see it
    kl_lab.main(["--trainer", "trl", "--recipe", "dr_grpo", "--only", "k1 in the reward", "--steps", "2",
                 "--seeds", "2"])
    lines = [line for line in capfd.readouterr().err.splitlines() if line.startswith("trainer lab: ")]
    assert sorted(line.rsplit(" after ", 1)[0] for line in lines) == [  # the seeds' workers may interleave
        f"trainer lab: trl, k1 in the reward, seed {seed}: step {step} of 2" for seed in (0, 1) for step in (1, 2)]
    assert all(line.endswith(" s") for line in lines)


def test_a_beta_off_by_a_quarter_is_beyond_the_guards_tolerance(tables) -> None:
    """The guard can fail: the optimum of a beta 1.25 or 0.8 times the one asked for is more than TOLERANCE away
    from pi*_beta (exactly, averaged over the training prompts), and a factor 2 an order of magnitude more."""
    def away(factor: float) -> float:
        return sum(kl(optimum(Tree(ENV, tables[p]), 0.5 * factor), optimum(Tree(ENV, tables[p]), 0.5))
                   for p in trainer_lab.TRAIN_PROMPTS) / len(trainer_lab.TRAIN_PROMPTS)

    assert min(away(1.25), away(0.8)) > TOLERANCE
    assert min(away(2.0), away(0.5)) > 10 * TOLERANCE


# The guards through TRL: (recipe, setting) pairs, one seed each, as a user configures them.
# sigmoid's bound: half the distance between its tabular predictions with k3+ and with the plain k3 (0.0151 and
# 0.0066 on the lab's model), so the guard tells which one the trainer computes; TRL's seeds lie within it of k3+.
SIGMOID_BOUND = 0.004
EXACT = (("dr_grpo", "k1 in the reward"), ("spg2", "k1 in the reward"), ("lora", "k1 in the reward"),
         ("dr_grpo", "k1_future in the loss"), ("accumulation", "k1_future in the loss"))
PREDICTED = (("dr_grpo", "sigmoid in the loss"),)


def test_the_exact_settings_reach_the_optimum_and_a_method_its_prediction_through_trls_trainer(tables) -> None:
    """The end-to-end guards: TRL's GRPOTrainer patched by this package, 800 steps of 64 completions.

    - k1 in the reward (dr_grpo; steps_per_generation=2, steps on samples one step old; LoRA rank 8) and k1_future
      in the loss (dr_grpo; gradient_accumulation_steps=2) each land on pi*_beta: KL(pi || pi*) within TOLERANCE and
      an effective beta within 5 % of 0.5, where a normaliser, the accumulation or a mask that is wrong moves it (test
      above). (LoRA at the 2e-2 it once ran at, on the lab's earlier model, ended 0.08 to 0.19 away.)
    - sigmoid in the loss, shaping TRL's own k3 times the importance ratio, lands within SIGMOID_BOUND of the tabular
      prediction with k3+ (what that product is on-policy), and not within it of the plain-k3 prediction the lab
      made before it read use_bias_correction_kl (the mutation, computed here)."""
    torch.set_num_threads(1)
    table = trainer_lab.run_trainer_table("trl", trainer_lab.trainer_settings(), list(trainer_lab.RECIPES), 0.5,
                                          trainer_lab.STEPS, [0], processes=2, pairs={*EXACT, *PREDICTED},
                                          overrides=[("use_bias_correction_kl", True)])  # trl 1.9.1's is False
    rows = {(row["recipe"], row["setting"]): row for row in table["rows"]}
    assert set(rows) == {*EXACT, *PREDICTED}
    for pair in EXACT:
        row = rows[pair]
        assert row["train"]["kl_opt"] < TOLERANCE, row
        assert math.isclose(row["train"]["effective_beta"], 0.5, rel_tol=0.05), row
        assert row["tabular"]["kl_opt"] < 1e-3, row  # the prediction: exact
    sigmoid = rows[PREDICTED[0]]
    assert sigmoid["tabular"]["estimator"] == "k3+"
    assert abs(sigmoid["train"]["kl_opt"] - sigmoid["tabular"]["kl_opt"]) < SIGMOID_BOUND, sigmoid
    plain_k3 = trainer_lab.prediction_of({**sigmoid["in_effect"], "use_bias_correction_kl": False})
    assert dict(plain_k3.setting.config).get("kl_estimator") is None  # the trainer's k3, as the lab once predicted
    plain = trainer_lab.tabular_prediction(ENV, plain_k3, 0.5, tables)["kl_opt"]
    assert abs(sigmoid["train"]["kl_opt"] - plain) > SIGMOID_BOUND, (sigmoid, plain)


# ----- the prediction: what the trainer computes ---------------------------------------------------------------------

IN_EFFECT = dict(beta=0.4375, loss_type="dr_grpo", scale_rewards="none", num_generations=8, num_iterations=1,
                 steps_per_generation=1, gradient_accumulation_steps=1, importance_sampling_level="token",
                 use_bias_correction_kl=True, mask_truncated_completions=False, temperature=1.0)


@pytest.mark.parametrize(("fields", "estimator"), [
    ({}, "k3+"),  # TRL >= 1.10's default: k3 times the importance ratio, on-policy k3's value and k2's gradient
    ({"use_bias_correction_kl": False}, None),  # trl 1.9.1's default: the plain k3 (the placement's default)
    ({"kl_adaptation_method": "sigmoid", "kl_target": 0.05}, "k3+"),  # a method adapts the trainer's k3 * ratio
    ({"kl_estimator": "k2"}, "k2"),  # computed from the log-probs: no ratio
    ({"kl_placement": "reward"}, None),  # k1 in the reward, the placement's default
], ids=["trainer_k3_corrected", "trainer_k3_plain", "sigmoid_on_trainer_k3", "k2", "reward"])
def test_the_prediction_runs_the_estimator_the_trainer_computes(fields, estimator) -> None:
    prediction = trainer_lab.prediction_of({**IN_EFFECT, **fields})
    assert dict(prediction.setting.config).get("kl_estimator") == estimator
    assert (prediction.setting.loss_type, prediction.setting.scale_rewards, prediction.beta) == ("dr_grpo", "none",
                                                                                                  0.4375)
    assert prediction.setting.placement == ("reward" if fields.get("kl_placement") else "loss")
    assert prediction.unmodelled == ()


def test_the_prediction_names_what_the_tabular_lab_does_not_model() -> None:
    prediction = trainer_lab.prediction_of({**IN_EFFECT, "num_iterations": 2, "steps_per_generation": 2,
                                            "importance_sampling_level": "sequence", "scale_rewards": True}, lora=True)
    assert [note.split(":")[0] for note in prediction.unmodelled] == [
        "num_iterations=2", "steps_per_generation=2", "importance_sampling_level='sequence'", "LoRA"]
    assert prediction.setting.scale_rewards == "group"  # True as TRL reads it
    accumulation = trainer_lab.prediction_of({**IN_EFFECT, "gradient_accumulation_steps": 2,
                                              "steps_per_generation": 2})
    assert accumulation.unmodelled == ()  # the same gradient as one batch: modelled
    assert trainer_lab.prediction_of({**IN_EFFECT, "beta": 0.0}).setting.placement == "off"


def test_a_seed_beyond_every_optimum_is_counted_not_averaged() -> None:
    """The effective beta's sentinel (the bisection's floor) never enters a mean: a prompt beyond every optimum makes
    its seed's beta None, and a row averages the real seeds and counts the others."""
    tree = Tree(ENV)
    reference = tree.log_probs(tree.reference_table)
    rarest_rewarded = torch.where(tree.rewards > 0, reference, torch.tensor(math.inf)).argmin()
    delta = torch.log_softmax(torch.full_like(reference, -60.0).index_fill(0, rarest_rewarded, 0.0), 0)
    beyond = trainer_lab.exact_figures(tree, delta, 0.5)  # further than pi*_0, the reference on rewarded ones
    assert beyond["effective_beta"] is None
    at_optimum = trainer_lab.exact_figures(tree, optimum(tree, 0.5).float(), 0.5)
    assert at_optimum["effective_beta"] == pytest.approx(0.5, rel=1e-3)
    assert trainer_lab.summarise([at_optimum, beyond])["effective_beta"] is None
    row = trainer_lab.over_seeds([at_optimum, trainer_lab.summarise([at_optimum, beyond])])
    assert row["effective_beta"] == pytest.approx(0.5, rel=1e-3) and row["beyond_seeds"] == 1
    assert row["effective_beta_seeds"][1] is None
    assert trainer_lab._spread(row["effective_beta_seeds"], trainer_lab._beta) == " (1 of 2 seeds beyond pi*)"


def test_the_settings_in_effect_are_the_trainers_args_as_json(tmp_path) -> None:
    """What a row records and the prediction reads: TRL's args as the trainer holds them (use_bias_correction_kl,
    the runtime fields, enums as their values) and the package's fields."""
    from trl import GRPOConfig

    import unsloth_adaptive_kl  # noqa: F401

    args = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, beta=0.04, use_bias_correction_kl=False,
                      kl_adaptation_method="sigmoid", optim="adamw_torch", lr_scheduler_type="cosine")
    in_effect = trainer_lab.settings_in_effect(args)
    assert json.loads(json.dumps(in_effect)) == in_effect
    assert (in_effect["use_bias_correction_kl"], in_effect["optim"], in_effect["lr_scheduler_type"],
            in_effect["kl_adaptation_method"], in_effect["learning_rate"]) == (
        False, "adamw_torch", "cosine", "sigmoid", args.learning_rate)
    assert dict(trainer_lab.prediction_of(in_effect).setting.config)["kl_adaptation_method"] == "sigmoid"


def test_predict_reproduces_the_committed_rows_predictions() -> None:
    """One rule: every committed TRL row's recorded prediction (estimator, what is not modelled) is what
    `prediction_of` makes of the row's settings in effect, and `kl_lab --predict` given those settings as --set
    reproduces a row's tabular figures exactly, for a row on the trainer's k3 times the ratio under TRL's defaults, a
    shaped one, and one whose recipe the tabular lab does not model."""
    result = json.loads((ROOT / "docs" / "results" / "kl_lab_trl.json").read_text())
    table = result["trainers"]["trl"]
    rows = [row for row in table["rows"] if "tabular" in row]
    for row in rows:
        prediction = trainer_lab.prediction_of(row["in_effect"], row["recipe"] == "lora")
        assert list(prediction.unmodelled) == row["tabular"]["unmodelled"], row["setting"]
        estimator = dict(prediction.setting.config).get("kl_estimator")
        assert row["tabular"]["estimator"] == estimator or estimator is None, row["setting"]
    for recipe, setting in (("defaults", "k3 in the loss (the trainer's own)"), ("dr_grpo", "sigmoid in the loss"),
                            ("mu2", "k1 in the reward")):
        (row,) = [row for row in rows if (row["recipe"], row["setting"]) == (recipe, setting)]
        fields = [f"{name}={value!r}" for name, value in row["in_effect"].items()  # what the prediction reads
                  if value is not None and (name in trainer_lab.PREDICTED_FIELDS or name in FIELD_DEFAULTS)]
        predicted = kl_lab.main(["--predict", "--trainer", "trl", "--beta", str(table["beta"]), "--set", *fields])
        # The same settings give the same run; its figures agree to float32 rounding, not bit for bit, across CPUs:
        # 500 float32 Adam steps whose sums another vector width orders otherwise (5e-7 relative between AVX-512 and
        # torch's generic kernels, ATEN_CPU_CAPABILITY=default; 1e-5 leaves a factor 20), and a KL near 0 (at the
        # optimum) is a difference of float32 log-probs, exact to about 8 float32 ulps of 1 (7e-8 apart there).
        found = predicted["predictions"]["the config"]
        # every figure the row records (a file written before the first token's share of the KL was measured has
        # one figure fewer: kl_ref_first)
        assert set(row["tabular"]) <= set(found) <= set(row["tabular"]) | {"kl_ref_first"}, (recipe, setting)
        for name, value in row["tabular"].items():
            assert found[name] == (pytest.approx(value, rel=1e-5, abs=1e-6) if isinstance(value, float) else value), (
                setting, name)


# ----- the trainer tables' sentences and cells, from hand-made rows (a mutation audit found them unpinned) ----------

def lab_row(recipe: str, setting: str, seeds: list, tabular: float, *, placement: str = "loss", betas: list = (),
            estimator: str = "k1", unmodelled: tuple = (), held_out: float = 0.0) -> dict:
    """A trainer table's row as run_trainer_table writes it, with only the figures the sentences read."""
    betas = list(betas) or [0.5] * len(seeds)
    real = [b for b in betas if b is not None]
    return {"recipe": recipe, "setting": setting, "placement": placement, "in_effect": {
                "beta": 0.4375, "loss_type": "dr_grpo", "scale_rewards": "none"},
            "train": {"kl_opt": sum(seeds) / len(seeds), "kl_opt_seeds": list(seeds), "effective_beta_seeds": betas,
                      "effective_beta": sum(real) / len(real) if real else None},
            "held_out": {"kl_opt": held_out, "effective_beta": 0.45},
            "tabular": {"kl_opt": tabular, "estimator": estimator, "unmodelled": list(unmodelled)}}


def test_inside_is_the_seeds_range_to_four_decimals() -> None:
    """The other trainer's figure agrees with a row when it lies in its seeds' range of KL(pi||pi*),
    widened by half a unit of the 4th decimal the tables print (so one seed means equal to 4 decimals)."""
    two, one = lab_row("r", "s", [0.001, 0.003], 0.0), lab_row("r", "s", [0.001], 0.0)
    assert [trainer_lab.inside(v, two) for v in (0.002, 0.00304, 0.0009600, 0.0032, 0.0009)] == [
        True, True, True, False, False]
    assert [trainer_lab.inside(v, one) for v in (0.00104, 0.00106, 0.00094)] == [True, False, False]


def test_the_trainer_findings_name_the_rows_their_figures_pick() -> None:
    """trainer_lab.findings on a hand-made table: the noise floor is the k1-in-the-reward rows the tabular lab models
    (dr_grpo, 2 seeds: at most 0.0013), those it does not (mu2) named apart and LoRA left out; "measured against
    predicted" counts the 3 modelled rows with a fixed point (beta = 0 and clip have none: clip is named apart, beta = 0
    left out; k1 in the reward is the floor's source), a prediction agreeing within its seeds' range widened by that
    floor: k1_future's and sigmoid's do, k3's 0.0289 does not (0.0254 + 0.0013 = 0.0267), the largest difference."""
    clip = lab_row("dr_grpo", "clip in the loss", [1.5, 1.6], 0.2)
    clip["in_effect"]["kl_adaptation_method"] = "clip"
    table = {"beta": 0.5, "rows": [
        lab_row("dr_grpo", "beta = 0 (no KL)", [0.9, 1.0], 0.5, placement="off", betas=[None, None]),
        lab_row("dr_grpo", "k1 in the reward", [0.0005, 0.0013], 0.0001, placement="reward", betas=[0.49, 0.51],
                held_out=0.0123),
        lab_row("dr_grpo", "k1_future in the loss", [0.0011, 0.0019], 0.0015, estimator="k1_future"),
        lab_row("dr_grpo", "sigmoid in the loss", [0.014, 0.016], 0.0151, estimator="k3+"),
        lab_row("dr_grpo", "k3 in the loss", [0.025, 0.0254], 0.0289, estimator="k3+"), clip,
        lab_row("mu2", "k1 in the reward", [0.002, 0.004], 0.0001, placement="reward",
                unmodelled=("num_iterations=2",)),
        lab_row("lora", "k1 in the reward", [0.007, 0.009], 0.0001, placement="reward", unmodelled=("LoRA",))]}
    noise, measured, *rest = trainer_lab.findings(table)
    assert noise.startswith("**k1 in the reward, the noise floor**: over 2 runs (1 recipe the tabular lab models x "
                            "seeds) it ends 0.0005 to 0.0013 from pi*_0.5, at an effective beta of 0.49 to 0.51: "
                            "`dr_grpo` 0.0009 [0.0005 - 0.0013]; in the recipes the tabular lab does not model: "
                            "`mu2` 0.0030 [0.0020 - 0.0040].")
    assert measured == (
        "**Measured against predicted**, in the 3 rows whose recipe the tabular lab models (on-policy, full "
        "fine-tuning) and whose setting has a fixed point (k1 in the reward, the noise floor's source, aside): the "
        "prediction lies within the seeds' range widened by the noise floor (0.0013) in 2; the largest difference is "
        "`dr_grpo`, k3 in the loss: 0.0252 [0.0250 - 0.0254] against 0.0289 predicted. The 2 rows on the trainer's k3 "
        "times the importance ratio are predicted with k3+ (on-policy the same value and gradient): `dr_grpo`, sigmoid "
        "in the loss 0.0150 [0.0140 - 0.0160] against 0.0151; `dr_grpo`, k3 in the loss 0.0252 [0.0250 - 0.0254] "
        "against 0.0289. The 1 rows whose setting has no fixed point end where the training budget leaves them (clip "
        "leaves no KL gradient above its threshold), so the tabular lab's run, on its own budget, predicts none of "
        "them: `dr_grpo`, clip in the loss 1.5500 [1.5000 - 1.6000].")
    held = next(sentence for sentence in rest if sentence.startswith("**The prompt never trained on**"))
    assert "k1 in the reward ends 0.0123 from its pi*" in held
    # Unsloth against TRL: 0.0012 lies in TRL's k1 range, 0.0030 not in k1_future's
    unsloth = {"rows": [lab_row("dr_grpo", "k1 in the reward", [0.0012], 0.0001),
                        lab_row("dr_grpo", "k1_future in the loss", [0.0030], 0.0015)]}
    (sentence,) = trainer_lab.differences(table, unsloth)
    assert sentence == ("**Unsloth against TRL**: in 1 of 2 rows Unsloth's KL(pi||pi*) lies within TRL's seeds' range: "
                        "the others, TRL's range against Unsloth's figure: `dr_grpo`, k1_future in the loss 0.0015 "
                        "[0.0011 - 0.0019] against 0.0030.")


def test_the_k3_in_the_reward_finding_gives_the_defaults_recipe_beside_dr_grpo() -> None:
    """k3 in the reward, in its own words per recipe: under dr_grpo as far from pi* as beta = 0, under the trainer's
    group-scaled defaults closer (kl_lab_trl.json: 2.64 against 3.61), so the sentence gives both and claims neither;
    without the defaults' rows it gives dr_grpo's alone."""
    rows = [lab_row("dr_grpo", "beta = 0 (no KL)", [3.5, 3.6], 0.0, placement="off", betas=[None, None]),
            lab_row("dr_grpo", "k3 in the reward", [3.8, 3.8], 0.0, placement="reward", betas=[None, None]),
            lab_row("defaults", "beta = 0 (no KL)", [3.6, 3.62], 0.0, placement="off", betas=[None, None]),
            lab_row("defaults", "k3 in the reward", [2.6, 2.68], 0.0, placement="reward", betas=[None, None]),
            lab_row("defaults", "k1 in the reward", [0.001, 0.001], 0.0, placement="reward")]
    (sentence,) = [f for f in trainer_lab.findings({"beta": 0.5, "rows": rows}) if f.startswith("**k3 in the reward")]
    assert sentence == ("**k3 in the reward** ends 3.8000 [3.8000 - 3.8000] from pi* with dr_grpo, where beta = 0 ends "
                        "3.5500 [3.5000 - 3.6000]; under the trainer's defaults 2.6400 [2.6000 - 2.6800], where "
                        "beta = 0 ends 3.6100 [3.6000 - 3.6200] and k1 in the reward 0.0010 [0.0010 - 0.0010].")
    (alone,) = [f for f in trainer_lab.findings({"beta": 0.5, "rows": rows[:2]}) if f.startswith("**k3 in the reward")]
    assert alone == ("**k3 in the reward** ends 3.8000 [3.8000 - 3.8000] from pi* with dr_grpo, where beta = 0 ends "
                     "3.5500 [3.5000 - 3.6000].")


def test_the_reward_function_reads_the_decoded_letters() -> None:
    """contains_a: 1 when an 'a' is anywhere; first_a: 1 when the first letter is 'a' (EOS and pads decode to
    nothing, other characters are skipped)."""
    contains, first = (trainer_lab.reward_function(ENVIRONMENTS[name]) for name in ("contains_a", "first_a"))
    texts = ["", "a", "b", "ba", "ab", "bbb", "bba"]
    assert contains(texts) == [0.0, 1.0, 0.0, 1.0, 1.0, 0.0, 1.0]
    assert first(texts) == [0.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.0]
    assert contains.__name__ == "contains_a"


def test_over_seeds_counts_the_seeds_beyond_every_optimum() -> None:
    """Three seeds, one beyond every optimum: 1 counted, the two others' betas averaged, the KL averaged over all."""
    seeds = [{"kl_opt": 0.1, "effective_beta": 0.4}, {"kl_opt": 0.2, "effective_beta": None},
             {"kl_opt": 0.3, "effective_beta": 0.6}]
    row = trainer_lab.over_seeds(seeds)
    assert row["beyond_seeds"] == 1 and row["effective_beta"] == pytest.approx(0.5)
    assert row["kl_opt"] == pytest.approx(0.2) and row["kl_opt_seeds"] == [0.1, 0.2, 0.3]


def test_a_temperature_is_named_as_not_modelled() -> None:
    assert trainer_lab.prediction_of({**IN_EFFECT, "temperature": 0.7}).unmodelled == (
        "temperature=0.7: sampling from a tempered policy",)


def test_a_trainer_rows_figures_are_each_prompts_policy_against_its_own_optimum(tables, monkeypatch) -> None:
    """run_trainer_table's assembly, with the trainer replaced by a stand-in that returns known policies (another
    prompt's reference table: seed 0 shifts the training prompts by one, seed 1 by two; the held-out prompt gets
    "aab"'s): each seed's KL(pi||pi*) is the mean over the training prompts of KL(pi || pi*_0.5 of that prompt's
    reference), the held-out one against the held-out prompt's, computed here from the closed form; the cells read
    those figures, measured minus predicted, and Unsloth minus TRL."""
    prompts, held = trainer_lab.TRAIN_PROMPTS, trainer_lab.HELD_OUT
    in_effect = {**{name: None for name in trainer_lab.TRAINER_FIELDS}, **FIELD_DEFAULTS, **IN_EFFECT,
                 "beta": 0.5, "kl_placement": "reward", "kl_estimator": "k1"}

    def policies(seed: int) -> dict:
        shift = 1 + seed
        return {**{p: tables[prompts[(i + shift) % 3]] for i, p in enumerate(prompts)}, held: tables["aab"]}

    def stand_in(run, tables_):
        return {"tables": policies(run.seed), "in_effect": in_effect, "pad_probability": 0.0}

    monkeypatch.setattr(trainer_lab, "train_through", stand_in)
    setting = Setting("k1 in the reward", "reward", (("kl_estimator", "k1"),))
    table = trainer_lab.run_trainer_table("trl", [setting], ["dr_grpo"], 0.5, 1, [0, 1])
    tree = Tree(ENV)

    def away(table_: torch.Tensor, prompt: str) -> float:  # KL(pi || pi*_0.5) by the closed form, in float64
        logp, ref = tree.log_probs(table_.double()), tree.log_probs(tables[prompt].double())
        star = ref + tree.rewards.double() / 0.5
        star = star - torch.logsumexp(star, 0)
        return float((logp.exp() * (logp - star)).sum())

    expected = [sum(away(policies(seed)[p], p) for p in prompts) / 3 for seed in (0, 1)]
    (row,) = table["rows"]
    assert row["train"]["kl_opt_seeds"] == pytest.approx(expected, rel=1e-6) and expected[0] != expected[1]
    assert row["train"]["kl_opt"] == pytest.approx(sum(expected) / 2, rel=1e-6)
    assert row["held_out"]["kl_opt"] == pytest.approx(away(tables["aab"], held), rel=1e-6)
    assert row["held_out"]["kl_opt"] > 0.01  # another prompt's reference: not the held-out one's optimum
    ((_, (cells,)),) = trainer_lab.trainer_rows(table)
    header = trainer_lab.HEADER
    assert cells[header.index("measured - tabular")] == f"{row['train']['kl_opt'] - row['tabular']['kl_opt']:.4f}"
    assert cells[header.index("held out: KL(pi||pi*)")] == f"{row['held_out']['kl_opt']:.4f}"
    assert cells[header.index("KL(pi||pi*) [seeds]")] == (
        f"{row['train']['kl_opt']:.4f} [{min(expected):.4f} - {max(expected):.4f}]")
    other = json.loads(json.dumps({**table, "rows": [{**row, "train": {**row["train"], "kl_opt": 0.5}}]}))
    _, (side,) = trainer_lab.side_by_side_rows(table, other)
    assert side[trainer_lab.SIDE_BY_SIDE.index("Unsloth - TRL")] == f"{0.5 - row['train']['kl_opt']:.4f}"


# ----- from a mutation audit of trainer_lab.py: what each survivor changed that users read -------------------------

def test_each_setting_and_recipe_runs_what_its_label_says() -> None:
    """A row is read by its label: "kN in the P" runs estimator kN (k3 where none is set: the trainers' own) placed in
    P, "M in the loss" adaptation method M; a recipe's label names each field it sets beyond dr_grpo's (and "dr_grpo"
    only where it sets it), LoRA only where it trains LoRA, and every recipe steps on BATCH completions."""
    settings = trainer_lab.trainer_settings()
    assert len(settings) == 6 + len(tabular_lab.METHOD_FIELDS)
    for setting in settings:
        config = dict(setting.config)
        if setting.placement == "off":
            assert setting.label == "beta = 0 (no KL)" and not config
            continue
        name, _, place = setting.label.partition(" in the ")
        assert place.split(" ")[0] == setting.placement, setting
        if name.startswith("k"):
            assert config.get("kl_estimator", "k3") == name, setting
        else:
            assert config["kl_adaptation_method"] == name, setting
    for recipe in trainer_lab.RECIPES.values():
        fields = dict(recipe.fields)
        assert ("LoRA" in recipe.label) == recipe.lora, recipe
        assert recipe.label.startswith("dr_grpo") == (fields.get("loss_type") == "dr_grpo"), recipe
        for name, value in fields.items():
            if name not in ("loss_type", "scale_rewards", "per_device_train_batch_size"):
                assert f"{name}={value}" in recipe.label, recipe
        batch = fields.get("per_device_train_batch_size", trainer_lab.BATCH)
        assert batch * fields.get("gradient_accumulation_steps", 1) == 64, recipe


def test_the_config_is_the_batch_the_schedule_and_the_kl_setting_the_lab_describes() -> None:
    """config_fields for dr_grpo at a learning rate of its own: an optimizer step is one batch of 64 completions in
    groups of 8 (no accumulation), completions of at most the environment's 4 tokens, AdamW without weight decay (the
    pad's row never moves: `bias_unit`) decayed linearly from the run's rate, one log line a run; k1 in the reward at
    beta as passed, placed in the reward."""
    setting = next(s for s in trainer_lab.trainer_settings() if s.label == "k1 in the reward")
    run = trainer_lab.LabRun("trl", setting, trainer_lab.RECIPES["dr_grpo"], 0.5, 10, 3, learning_rate=1e-2)
    fields = trainer_lab.config_fields(run, "out")
    batch = (fields["per_device_train_batch_size"], fields["num_generations"], fields["gradient_accumulation_steps"])
    assert batch == (64, 8, 1)
    assert fields["max_completion_length"] == ENV.max_length == 4
    assert (fields["learning_rate"], fields["weight_decay"], fields["optim"], fields["lr_scheduler_type"],
            fields["warmup_steps"]) == (1e-2, 0.0, "adamw_torch", "linear", 0)
    assert (fields["seed"], fields["max_steps"], fields["logging_steps"]) == (3, 10, 10)
    assert (fields["beta"], fields["kl_placement"], fields["kl_estimator"]) == (0.5, "reward", "k1")
    assert (fields["loss_type"], fields["scale_rewards"]) == ("dr_grpo", "none")


def test_the_reward_function_skips_any_character_that_is_not_a_letter() -> None:
    """What the docstring of the reward test says and no decoded text of the lab's tokenizer holds: a character other
    than a or b (a space, a pad's text) is skipped, not an error."""
    contains, first = (trainer_lab.reward_function(ENVIRONMENTS[name]) for name in ("contains_a", "first_a"))
    assert contains([" a", "b-b", "<pad>"]) == [1.0, 0.0, 1.0]  # "<pad>" holds an 'a'
    assert first([" a", "-ba", "<b>"]) == [1.0, 0.0, 0.0]


def test_a_run_records_the_precision_its_trainer_trained_in() -> None:
    """precision_of: Unsloth's own GRPO autocast where it latched one (its dtype named), else the config's bf16 or
    fp16, else fp32."""
    from types import SimpleNamespace

    def trainer(bf16: bool, fp16: bool, **latched) -> SimpleNamespace:
        return SimpleNamespace(args=SimpleNamespace(bf16=bf16, fp16=fp16), **latched)

    assert [trainer_lab.precision_of(trainer(*flags)) for flags in ((True, False), (False, True), (False, False))] == [
        "bf16", "fp16", "fp32"]
    assert trainer_lab.precision_of(trainer(False, False, _autocast_enabled=True,
                                            _autocast_dtype=torch.float16)) == "fp16"
    assert trainer_lab.precision_of(trainer(False, True, _autocast_enabled=True,
                                            _autocast_dtype=torch.bfloat16)) == "bf16"
    assert trainer_lab.precision_of(trainer(True, False, _autocast_enabled=False,
                                            _autocast_dtype=torch.float16)) == "bf16"


def test_the_settings_in_effect_carry_every_field_the_prediction_reads() -> None:
    """A row's prediction reads the trainer's args through `settings_in_effect`: a field it leaves out is never named
    as not modelled. It records the fields the committed runs recorded (docs/results/kl_lab_*.json), in their order;
    an enum (of any kind) as its value; and a run sampling at temperature 0.7 with two clipped passes and a
    sequence-level ratio says so."""
    import enum
    from types import SimpleNamespace

    class Level(enum.Enum):  # not a str: json cannot write it
        SEQUENCE = "sequence"

    for name in ("trl", "unsloth", "unsloth_pad_is_eos"):
        (table,) = json.loads((ROOT / "docs" / "results" / f"kl_lab_{name}.json").read_text())["trainers"].values()
        recorded = {tuple(row["in_effect"]) for row in table["rows"] if "in_effect" in row}
        assert recorded == {tuple(trainer_lab.settings_in_effect(SimpleNamespace()))}, name
    args = SimpleNamespace(**{**FIELD_DEFAULTS, **IN_EFFECT, "temperature": 0.7, "num_iterations": 2,
                              "importance_sampling_level": Level.SEQUENCE, "mask_truncated_completions": True})
    in_effect = trainer_lab.settings_in_effect(args)
    assert in_effect["importance_sampling_level"] == "sequence" and json.loads(json.dumps(in_effect)) == in_effect
    assert [note.split(":")[0] for note in trainer_lab.prediction_of(in_effect).unmodelled] == [
        "num_iterations=2", "importance_sampling_level='sequence'", "mask_truncated_completions=True",
        "temperature=0.7"]


def test_a_field_the_settings_leave_unset_is_read_as_the_trainers_default() -> None:
    """prediction_of on settings that leave the runtime fields unset (None or absent): one pass, no accumulation,
    groups of GROUP_SIZE, so nothing is named as not modelled; two steps a generation without accumulation are."""
    bare = {"beta": 0.04, "loss_type": "grpo", "scale_rewards": "group", "num_iterations": None}
    prediction = trainer_lab.prediction_of(bare)
    assert (prediction.unmodelled, prediction.group_size, prediction.setting.placement) == ((), 8, "loss")
    (note,) = trainer_lab.prediction_of({**bare, "steps_per_generation": 2}).unmodelled
    assert note.startswith("steps_per_generation=2: ")


def test_a_lora_row_names_lora_as_not_modelled_and_a_row_keeps_its_worst_seeds_pad(tables, monkeypatch) -> None:
    """run_trainer_table passes the recipe's LoRA to the prediction: the LoRA row's tabular figures name it as not
    modelled (so the noise floor and "measured against predicted" leave it out), the full fine-tuning row's nothing; a
    row's pad probability is its seeds' largest (the guard's bound holds for every seed); the table records --set."""
    in_effect = {**{name: None for name in trainer_lab.TRAINER_FIELDS}, **FIELD_DEFAULTS, **IN_EFFECT,
                 "beta": 0.5, "kl_placement": "reward", "kl_estimator": "k1"}
    monkeypatch.setattr(trainer_lab, "train_through", lambda run, tables_: {
        "tables": tables, "in_effect": in_effect, "pad_probability": [1e-9, 3e-9][run.seed]})
    setting = Setting("k1 in the reward", "reward", (("kl_estimator", "k1"),))
    table = trainer_lab.run_trainer_table("trl", [setting], ["lora", "dr_grpo"], 0.5, 1, [0, 1],
                                          overrides=[("temperature", 1.0)])
    lora, full = table["rows"]
    assert lora["tabular"]["unmodelled"] == ["LoRA: only the adapters train (the tabular lab trains every logit)"]
    assert full["tabular"]["unmodelled"] == [] and full["recipe"] == "dr_grpo"
    assert lora["pad_probability"] == full["pad_probability"] == 3e-9
    assert table["overrides"] == {"temperature": 1.0} and "; --set temperature=1.0;" in trainer_lab.describe(table)


def test_set_splits_at_the_first_equals_sign_and_keeps_a_value_python_cannot_parse_as_text() -> None:
    """`--set run_name=a=b` sets run_name to "a=b"; a value that is not a Python expression (a path: a SyntaxError,
    not a ValueError, to literal_eval) is its text."""
    assert trainer_lab.parse_overrides(["run_name=a=b", "output_dir=/tmp/lab out", "hub_model_id=a/b-1"]) == (
        ("run_name", "a=b"), ("output_dir", "/tmp/lab out"), ("hub_model_id", "a/b-1"))


def test_a_kl_cell_is_zero_only_below_half_a_unit_of_its_fourth_decimal() -> None:
    """_kl prints '0' for |KL| < 0.00005 (what 4 decimals cannot tell from 0), else 4 decimals, signed: 5e-5 (in
    binary a little above it) is 0.0001, a difference of -6e-5 is -0.0001."""
    assert [trainer_lab._kl(v) for v in (4.9e-5, -4.9e-5, 5e-5, -6e-5, 0.01234)] == [
        "0", "0", "0.0001", "-0.0001", "0.0123"]


def test_a_spread_counts_the_seeds_beyond_every_optimum() -> None:
    """Two of three seeds beyond every optimum: '2 of 3', not the one seed that has a beta; one seed: no spread."""
    assert trainer_lab._spread([None, 0.4, None], trainer_lab._beta) == " (2 of 3 seeds beyond pi*)"
    assert trainer_lab._spread([0.5, 0.25, 0.4], trainer_lab._beta) == " [0.25 - 0.5]"
    assert trainer_lab._spread([None], trainer_lab._beta) == ""


def test_what_a_recipe_does_not_model_is_named_once_for_all_its_rows() -> None:
    """A recipe's rows share its notes (mu2's two passes in every row): the group's label names each once, in the
    order met, and a refused row (no prediction) adds none."""
    rows = [lab_row("mu2", "k1 in the reward", [0.1], 0.0, unmodelled=("passes", "LoRA")),
            {"recipe": "mu2", "setting": "clip in the loss", "refused": "no"},
            lab_row("mu2", "k3 in the loss", [0.1], 0.0, unmodelled=("passes", "temperature"))]
    assert trainer_lab.not_modelled(rows) == ["passes", "LoRA", "temperature"]


def test_a_trainer_rows_cells_are_its_figures_each_under_its_header() -> None:
    """trainer_rows on a hand-made row and a refused one: the recipe's label with what the prediction does not model,
    the beta trained to 4 significant figures, E[r], E[length]
    and KL(pi||pi_ref) to 3 decimals, the prediction's effective beta and the held-out prompt's beside it; every row,
    the refused one too, has one cell a header."""
    row = lab_row("dr_grpo", "k1 in the reward", [0.002, 0.004], 0.0012, placement="reward", betas=[0.5, 0.6],
                  held_out=0.0123, unmodelled=("LoRA: adapters",))
    row["train"].update(reward=0.91234, length=2.3456, kl_ref=0.12345)
    row["tabular"]["effective_beta"], row["held_out"]["effective_beta"] = 0.4567, None
    refused = {"recipe": "dr_grpo", "setting": "clip in the loss", "refused": "x=1 is invalid: allowed is 2"}
    ((label, (cells, refused_cells)),) = trainer_lab.trainer_rows({"recipes": {"dr_grpo": "dr_grpo, scale"},
                                                                   "rows": [row, refused]})
    assert label == "dr_grpo, scale (not in the tabular prediction: LoRA: adapters)"
    assert len(cells) == len(refused_cells) == len(trainer_lab.HEADER)
    assert dict(zip(trainer_lab.HEADER, cells)) == {
        "setting": "k1 in the reward", "beta trained": "0.4375", "E[r]": "0.912", "E[length]": "2.346",
        "KL(pi||pi_ref)": "0.123", "KL(pi||pi*) [seeds]": "0.0030 [0.0020 - 0.0040]",
        "effective beta [seeds]": "0.55 [0.5 - 0.6]", "tabular: KL(pi||pi*) (estimator)": "0.0012 (k1)",
        "measured - tabular": "0.0018", "tabular: effective beta": "0.457", "held out: KL(pi||pi*)": "0.0123",
        "held out: effective beta": "beyond pi*"}
    assert refused_cells[:2] == ["clip in the loss: refused before training (x=1 is invalid)", "-"]


def test_side_by_side_pairs_rows_both_trainers_trained_and_puts_each_figure_under_its_trainer() -> None:
    """A row Unsloth refused has no pair (and no KeyError); TRL's effective beta comes before Unsloth's, and the
    prediction is the one for TRL's settings in effect."""
    trl = {"recipes": {"dr_grpo": "dr_grpo, scale"}, "rows": [
        lab_row("dr_grpo", "k1 in the reward", [0.002, 0.004], 0.0012, placement="reward", betas=[0.5, 0.6]),
        lab_row("dr_grpo", "clip in the loss", [0.1], 0.2)]}
    unsloth = {"rows": [lab_row("dr_grpo", "k1 in the reward", [0.005], 0.0099, placement="reward", betas=[0.7],
                                estimator="k3+"),
                        {"recipe": "dr_grpo", "setting": "clip in the loss", "refused": "no"}]}
    header, rows = trainer_lab.side_by_side_rows(trl, unsloth)
    assert rows == [["dr_grpo, scale", "k1 in the reward", "0.0030", "0.0050", "0.0020", "0.55", "0.7",
                     "0.0012 (k1)"]] and len(header) == len(rows[0])
    (sentence,) = trainer_lab.differences(trl, unsloth)
    assert sentence.startswith("**Unsloth against TRL**: in 0 of 1 rows ")


def test_a_refused_row_is_no_rows_figure_in_a_finding() -> None:
    """_row skips a refused row: the pad = EOS sentence says it lacks a row where that table's was refused, and the
    held-out sentence gives beta = 0's alone when k1 in the reward was refused."""
    label = "k3 in the loss (the trainer's own)"
    own = {"rows": [lab_row("dr_grpo", label, [0.01, 0.02], 0.0)]}
    refused = {"rows": [{"recipe": "dr_grpo", "setting": label, "refused": "no"}]}
    assert trainer_lab.pad_is_eos_finding(refused, own, own) == (
        "(no dr_grpo row of the trainer's own k3 in all three tables)")
    rows = [lab_row("dr_grpo", "beta = 0 (no KL)", [0.9, 1.0], 0.0, placement="off", held_out=0.5),
            {"recipe": "dr_grpo", "setting": "k1 in the reward", "placement": "reward", "refused": "no"}]
    (held,) = trainer_lab.findings({"beta": 0.5, "rows": rows})
    assert held == "**The prompt never trained on**: beta = 0 (no KL) ends 0.5000 from its pi* (effective beta 0.45)."


def test_a_combined_method_with_dynamic_or_clip_has_no_fixed_point() -> None:
    """kl_adaptation_method combines methods with '+': any part that is dynamic or clip leaves the row without a fixed
    point (dynamic named first), an estimator other than the log-ratio in the reward too; k1 in the reward and
    sigmoid have one."""
    def row(method, placement: str = "loss", estimator: str = "k3+") -> dict:
        return {"in_effect": {"kl_adaptation_method": method}, "placement": placement,
                "tabular": {"estimator": estimator}}

    reasons = [trainer_lab.without_fixed_point(row(method)) for method in ("sigmoid+dynamic", "sigmoid+clip",
                                                                            "clip+dynamic", "sigmoid", None)]
    assert [reason.split("'")[0] if reason else reason for reason in reasons] == [
        "dynamic", "clip leaves no KL gradient above its threshold", "dynamic", None, None]
    assert trainer_lab.without_fixed_point(row(None, "reward", "k3")).startswith("an estimator other than the "
                                                                                 "log-ratio")
    assert trainer_lab.without_fixed_point(row(None, "reward", "k1")) is None


def test_the_noise_floor_alone_gives_its_betas_to_three_figures_and_no_unmodelled_clause() -> None:
    """One modelled k1-in-the-reward row and none the tabular lab does not model: no "recipes the tabular lab does not
    model" clause, and the effective betas 0.4876 and 0.5123 to 3 significant figures."""
    rows = [lab_row("dr_grpo", "k1 in the reward", [0.0005, 0.0013], 0.0, placement="reward", betas=[0.4876, 0.5123])]
    (noise, held) = trainer_lab.findings({"beta": 0.5, "rows": rows})
    assert noise == ("**k1 in the reward, the noise floor**: over 2 runs (1 recipe the tabular lab models x seeds) it "
                     "ends 0.0005 to 0.0013 from pi*_0.5, at an effective beta of 0.488 to 0.512: `dr_grpo` 0.0009 "
                     "[0.0005 - 0.0013].")
    assert held.startswith("**The prompt never trained on**: k1 in the reward ends 0 from its pi*")


def test_a_prediction_agrees_within_the_noise_floor_on_either_side_and_each_reason_is_given_once() -> None:
    """Noise floor 0.002 (the k1 rows' largest seed): predictions 0.0015 above the seeds' range and 0.0014 below it
    both agree (2 of 2); two clip rows give their reason once."""
    clips = [lab_row("dr_grpo", f"clip {n} in the loss", [1.5], 0.2) for n in (1, 2)]
    for clip in clips:
        clip["in_effect"]["kl_adaptation_method"] = "clip"
    rows = [lab_row("dr_grpo", "k1 in the reward", [0.001, 0.002], 0.0, placement="reward"),
            lab_row("dr_grpo", "sigmoid in the loss", [0.010, 0.012], 0.0135),
            lab_row("dr_grpo", "target in the loss", [0.010, 0.012], 0.0086), *clips]
    (measured,) = [f for f in trainer_lab.findings({"beta": 0.5, "rows": rows}) if f.startswith("**Measured")]
    assert "widened by the noise floor (0.0020) in 2; the largest difference is `dr_grpo`, sigmoid in the loss" in (
        measured)
    assert ("The 2 rows whose setting has no fixed point end where the training budget leaves them (clip leaves no "
            "KL gradient above its threshold), so") in measured


def test_the_defaults_findings_read_only_the_rows_they_name() -> None:
    """Under the trainer's defaults: the loss-side rows act as a beta, k1 in the reward beside them (not among
    them; a refused one left out); without the defaults' k1 row the k3-in-the-reward sentence gives dr_grpo's
    figures alone."""
    rows = [lab_row("dr_grpo", "beta = 0 (no KL)", [3.5], 0.0, placement="off", betas=[None]),
            lab_row("dr_grpo", "k3 in the reward", [3.8], 0.0, placement="reward", betas=[None]),
            lab_row("defaults", "beta = 0 (no KL)", [3.6], 0.0, placement="off", betas=[None]),
            lab_row("defaults", "k3 in the reward", [2.6], 0.0, placement="reward", betas=[None]),
            lab_row("defaults", "k3 in the loss", [0.02], 0.0, betas=[0.25])]
    found = trainer_lab.findings({"beta": 0.5, "rows": rows})
    assert "**k3 in the reward** ends 3.8000 from pi* with dr_grpo, where beta = 0 ends 3.5000." in found
    rows += [lab_row("defaults", "k1 in the reward", [0.001], 0.0, placement="reward", betas=[0.5]),
             {"recipe": "defaults", "setting": "clip in the loss", "placement": "loss", "refused": "no"}]
    (defaults,) = [f for f in trainer_lab.findings({"beta": 0.5, "rows": rows}) if f.startswith("**The trainer's")]
    assert defaults == ("**The trainer's defaults** (loss_type='dr_grpo', scale_rewards='none') make a loss-side beta "
                        "of 0.4375 act as: k3 in the loss 0.25, where k1 in the reward acts as 0.5.")


def test_the_lora_finding_gives_loras_figures_beside_full_fine_tunings() -> None:
    """LoRA's k1 in the reward, its effective beta, then dr_grpo's with full fine-tuning; no sentence without the
    latter."""
    lora = lab_row("lora", "k1 in the reward", [0.007, 0.009], 0.0, placement="reward", betas=[0.6, 0.6],
                   unmodelled=("LoRA",))
    full = lab_row("dr_grpo", "k1 in the reward", [0.0005, 0.0013], 0.0, placement="reward", betas=[0.5, 0.5])
    (sentence,) = [f for f in trainer_lab.findings({"beta": 0.5, "rows": [lora, full]}) if f.startswith("**LoRA**")]
    assert sentence == ("**LoRA** (rank 8, the same recipe and learning rate): k1 in the reward ends 0.0080 "
                        "[0.0070 - 0.0090] from pi* at an effective beta of 0.6, full fine-tuning 0.0009 "
                        "[0.0005 - 0.0013].")
    assert not [f for f in trainer_lab.findings({"beta": 0.5, "rows": [lora]}) if f.startswith("**LoRA**")]


def test_the_pad_is_eos_finding_gives_each_tables_own_figure() -> None:
    """The pad = EOS table's figure and its effective beta, then TRL's, then Unsloth's own; any of the three tables
    without the row: no sentence."""
    label = "k3 in the loss (the trainer's own)"
    eos, trl, own = ({"rows": [lab_row("dr_grpo", label, seeds, 0.0, betas=betas)]}
                     for seeds, betas in (([0.01, 0.02], [0.3, 0.3]), ([0.004], [0.5]), ([0.005], [0.6])))
    assert trainer_lab.pad_is_eos_finding(eos, trl, own) == (
        "the trainer's own k3 in the loss ends 0.0150 [0.0100 - 0.0200] from pi* with pad = EOS (effective beta 0.3), "
        "against TRL's 0.0040 and Unsloth's own 0.0050 with a pad token of its own.")
    assert trainer_lab.pad_is_eos_finding(eos, {"rows": []}, own).startswith("(no dr_grpo row")


def test_describe_says_how_the_runs_were_made() -> None:
    """The sentence beside every table: 64 completions a step as 16 groups of 4, the learning rates the trained rows
    ran at (a refused row has none), the seeds, --set, and the pad (its own at a logit of -10000, or EOS)."""
    table = {"trainer": "trl", "beta": 0.5, "batch": 64, "group_size": 4, "train_prompts": ["aab", "abb", "bab"],
             "held_out": "aba", "steps": 800, "seeds": [0, 1], "overrides": {"loss_type": "dapo"}, "pad_is_eos": False,
             "rows": [{"learning_rate": 0.003}, {"learning_rate": 0.001}, {"refused": "no"}]}
    assert trainer_lab.describe(table) == (
        "trl: beta = 0.5, 64 completions a step (16 groups of 4), prompts aab, abb, bab (held out: aba), 800 steps, "
        "AdamW at 0.001, 0.003 decayed linearly to 0, seeds 0, 1 averaged; --set loss_type='dapo'; a pad token of its "
        "own, which no run can sample (its logit is fixed at -10000: `bias_unit`)")
    eos = trainer_lab.describe({**table, "pad_is_eos": True, "overrides": {}, "rows": [{"refused": "no"}]})
    assert eos.endswith("AdamW at - decayed linearly to 0, seeds 0, 1 averaged; pad = EOS")


def test_predict_refuses_a_beta_of_0_and_its_k1_row_models_everything() -> None:
    """--predict against pi*_0 is undefined: TRL's default beta (0) is refused, naming --set beta and --beta, and so is
    a --trainer that is not one trainer. The
    k1-in-the-reward row beside a config the tabular lab does not fully model (two clipped passes) is its exact
    reference: nothing named as not modelled, trained at the --beta it is measured against, so it ends at that
    optimum (the tabular lab's k1 in the reward is exact)."""
    with pytest.raises(SystemExit, match=r"^--predict: beta is 0 \(TRL's default: no KL term\); set it"):
        kl_lab.main(["--predict", "--trainer", "trl"])
    with pytest.raises(SystemExit, match=r"^--predict: --trainer both is not a trainer; use --trainer trl or unsloth$"):
        kl_lab.main(["--predict", "--trainer", "both", "--set", "beta=0.04"])
    predicted = kl_lab.main(["--predict", "--trainer", "trl", "--beta", "0.5", "--set", "beta=0.04",
                             "num_iterations=2"])
    config, k1 = predicted["predictions"]["the config"], predicted["predictions"]["k1 in the reward at beta=0.5"]
    assert config["unmodelled"] == ["num_iterations=2: 2 clipped passes over each batch"] and k1["unmodelled"] == []
    assert predicted["beta"] == 0.5 and k1["estimator"] == "k1" and k1["kl_opt"] < 1e-3 < config["kl_opt"]


def test_predict_refuses_a_set_value_the_trainer_refuses_before_anything_runs(monkeypatch) -> None:
    """--predict with a --set value the trainer refuses as it is built (`attach_runtime`) ended in a traceback from the
    prediction (num_iterations='abc': a TypeError comparing it; loss_type='bogus': the tabular run's ValueError), where
    a training run refuses it with the same message; a value TRL's config computes with before checking it
    (gradient_accumulation_steps='abc') ended in TRL's TypeError. Each is refused, naming the field, the value and
    what is allowed, before any table is made.
    (Mutants: the trainer's checks not run; the TypeError not caught; the field not named.)"""
    monkeypatch.setattr(trainer_lab, "reference_tables", lambda *args, **kwargs: pytest.fail("the prediction ran"))
    for overrides, message in (
            (["num_iterations=abc"], "num_iterations='abc' is invalid: allowed is an integer >= 1 (the optimizer "
             "passes over each generation batch)."),
            (["loss_type=bogus"], "loss_type='bogus' is not supported by adaptive KL: allowed is one of bnpo, cispo, "
             "dapo, dr_grpo, grpo, luspo, sapo, vespo."),
            (["gradient_accumulation_steps=abc"], "gradient_accumulation_steps='abc' is invalid: allowed is a value "
             "of type int (GRPOConfig: ")):
        with pytest.raises(SystemExit) as refused:
            kl_lab.main(["--predict", "--trainer", "trl", "--set", "beta=0.04", *overrides])
        assert str(refused.value.code).startswith(f"--predict: --set beta=0.04 {overrides[0]}: {message}"), (
            refused.value.code)


def test_predict_generates_unsloths_trainer_in_a_temporary_folder_unless_told_where(tmp_path, monkeypatch) -> None:
    """--predict --trainer unsloth builds no trainer, yet importing Unsloth wrote its generated trainer to
    ./unsloth_compiled_cache in the user's folder: UNSLOTH_COMPILE_LOCATION names a temporary folder while the trainer
    is imported (gone after, and the variable unset again); a location the user set is kept. Unsloth itself is not
    imported here (20 s): `import_trainer` is replaced by one that records what it would see.
    (Mutants: the variable not set; set after the import; left set; the user's location overridden.)"""
    seen: list[str] = []

    class Imported(Exception):
        pass

    def import_trainer(trainer: str) -> None:
        location = os.environ["UNSLOTH_COMPILE_LOCATION"]
        assert os.path.isdir(os.path.dirname(location)), location
        seen.append(location)
        raise Imported

    monkeypatch.setattr(trainer_lab, "import_trainer", import_trainer)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("UNSLOTH_COMPILE_LOCATION", raising=False)
    with pytest.raises(Imported):
        kl_lab.main(["--predict", "--trainer", "unsloth", "--set", "beta=0.04"])
    assert os.path.basename(seen[0]) == "unsloth_compiled_cache" and not seen[0].startswith(str(tmp_path))
    assert not os.path.exists(os.path.dirname(seen[0])) and "UNSLOTH_COMPILE_LOCATION" not in os.environ
    monkeypatch.setenv("UNSLOTH_COMPILE_LOCATION", str(tmp_path / "mine"))
    with pytest.raises(Imported):
        kl_lab.main(["--predict", "--trainer", "unsloth", "--set", "beta=0.04"])
    assert seen[1] == os.environ["UNSLOTH_COMPILE_LOCATION"] == str(tmp_path / "mine")


def test_a_prediction_steps_in_the_trainers_groups(tables) -> None:
    """tabular_prediction trains in groups of the trainer's num_generations: k1_future in the loss at beta passed
    as it is lands on pi* of beta * G / (G - 1) (the group mean's own sample, ground-truth.md's scale relation), so
    its effective beta is 0.4 with groups of 4 and 0.3429 with groups of 8, to 1 %."""
    for group in (4, 8):
        prediction = trainer_lab.prediction_of({**IN_EFFECT, "num_generations": group, "kl_estimator": "k1_future",
                                                "beta": 0.3})
        expected = 0.3 * group / (group - 1)
        figures = trainer_lab.tabular_prediction(ENV, prediction, expected, tables)
        assert figures["effective_beta"] == pytest.approx(expected, rel=0.01), group


@pytest.mark.parametrize("pad_is_eos", [False, True])
def test_predict_with_pad_is_eos_measures_against_that_models_reference(pad_is_eos: bool) -> None:
    """--predict --pad-is-eos predicts from the reference of the model whose pad is EOS: its k1 in the reward (exact)
    ends on that reference's pi*_0.5, whose E[r] and KL to the reference (log pi* = log pi_ref + r / beta - log Z,
    averaged over the training prompts) are 0.898 and 0.298 against the own pad's 0.831 and 0.394."""
    import statistics

    exact = []
    for prompt, reference in trainer_lab.reference_tables(ENV, trainer_lab.TRAIN_PROMPTS, pad_is_eos).items():
        tree = Tree(ENV, reference)
        star = optimum(tree, 0.5)
        exact.append(((star.exp() * tree.rewards.double()).sum().item(),
                      kl(star, tree.log_probs(tree.reference_table))))
    reward, kl_ref = (statistics.fmean(values) for values in zip(*exact))
    assert (round(reward, 3), round(kl_ref, 3)) == ((0.898, 0.298) if pad_is_eos else (0.831, 0.394))
    flag = ["--pad-is-eos"] if pad_is_eos else []
    predicted = kl_lab.main(["--predict", "--trainer", "trl", "--beta", "0.5", "--set", "beta=0.04", *flag])
    k1 = predicted["predictions"]["k1 in the reward at beta=0.5"]
    assert k1["reward"] == pytest.approx(reward, abs=1e-4) and k1["kl_ref"] == pytest.approx(kl_ref, abs=1e-4)
