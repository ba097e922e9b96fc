"""The KL lab (unsloth_adaptive_kl/tools/kl_lab.py): its exact quantities against independent formulas, and where
GRPO settings converge against the closed-form optimum pi*_beta(y) = pi_ref(y) exp(r(y) / beta) / Z."""

from __future__ import annotations

import itertools
import json
import math
import warnings
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from unsloth_adaptive_kl import register_kl_estimator
from unsloth_adaptive_kl.core.estimators import estimator_names
from unsloth_adaptive_kl.tools import kl_lab, tabular_lab
from unsloth_adaptive_kl.tools.tabular_lab import (ENVIRONMENTS, Environment, Figures, Setting, Training, Tree, beta_for_kl,
                                             frontier_reward, kl, optimum, train)

ROOT = Path(__file__).resolve().parents[1]
TRAINING = Training()  # the lab's defaults: 32 groups of 8, 500 steps, Adam 0.08 decayed to 0


@pytest.fixture(scope="module")
def tree() -> Tree:
    return Tree(ENVIRONMENTS["contains_a"])


def walk_probability(table: torch.Tensor, env: Environment, tokens: tuple[int, ...]) -> float:
    """pi(y) by walking the prefix tree with a dict of softmaxed rows (independent of Tree's index tensors)."""
    prefixes = [p for d in range(env.max_length) for p in itertools.product(range(env.tokens), repeat=d)]
    rows = {prefix: torch.softmax(table[i].double(), -1) for i, prefix in enumerate(prefixes)}
    probability = 1.0
    for t, token in enumerate(tokens):
        probability *= float(rows[tokens[:t]][token])
    return probability


def test_every_completion_is_enumerated_once_and_probabilities_sum_to_one(tree: Tree) -> None:
    env = tree.env
    # letters then EOS at depths 0..T-1, or T letters: sum_{d<T} K^d + K^T
    assert len(tree.completions) == sum(env.tokens ** d for d in range(env.max_length)) + env.tokens ** env.max_length
    assert len(set(tree.completions)) == len(tree.completions)
    table = torch.randn(tree.num_nodes, tree.vocab, generator=torch.Generator().manual_seed(3)) * 2
    logp = tree.log_probs(table).double()
    assert float(logp.exp().sum()) == pytest.approx(1.0, abs=1e-6)
    for c in (0, 5, len(tree.completions) - 1):
        assert math.exp(logp[c]) == pytest.approx(walk_probability(table, env, tree.completions[c]), rel=1e-5)
    assert tree.lengths.tolist() == [len(tokens) for tokens in tree.completions]
    assert tree.rewards.tolist() == [float(0 in tokens) for tokens in tree.completions]  # EOS is token 2


@pytest.mark.parametrize("beta", [0.2, 0.5, 1.0])
def test_optimum_is_the_normalised_closed_form_and_beats_every_policy(tree: Tree, beta: float) -> None:
    star = optimum(tree, beta)
    assert float(star.exp().sum()) == pytest.approx(1.0, abs=1e-12)
    reference = [walk_probability(tree.reference_table, tree.env, tokens) for tokens in tree.completions]
    by_hand = [p * math.exp(r / beta) for p, r in zip(reference, tree.rewards.tolist())]
    assert star.exp().tolist() == pytest.approx([x / sum(by_hand) for x in by_hand], rel=1e-5)
    assert kl(star, star) == 0.0
    best = Figures.of(tree, star, beta)
    assert best.kl_opt == 0.0 and best.regret == pytest.approx(0.0, abs=1e-6)
    # E[r] - beta KL(pi || ref) = -beta KL(pi || pi*) + beta log Z: the optimum's objective is the largest
    generator = torch.Generator().manual_seed(1)
    for _ in range(20):
        other = tree.log_probs(tree.reference_table + torch.randn(tree.reference_table.shape, generator=generator))
        figures = Figures.of(tree, other, beta)
        assert figures.objective <= best.objective + 1e-9
        assert figures.objective == pytest.approx(best.objective - beta * figures.kl_opt, abs=1e-6)
        assert figures.regret >= -1e-6  # nothing beats the frontier at its own KL


def test_frontier_and_beta_for_kl_invert_the_optimum_family(tree: Tree) -> None:
    reference = tree.log_probs(tree.reference_table)
    for beta in (0.1, 0.5, 2.0):
        star = optimum(tree, beta)
        tau = kl(star, reference)
        assert beta_for_kl(tree, tau) == pytest.approx(beta, rel=1e-6)
        assert frontier_reward(tree, tau) == pytest.approx(float((star.exp() * tree.rewards.double()).sum()), abs=1e-9)
    assert frontier_reward(tree, 100.0) == 1.0  # beyond the KL of beta -> 0, the largest reward


@pytest.mark.parametrize("beta", [0.2, 0.5, 1.0])
def test_k1_in_the_reward_and_k1_future_in_the_loss_reach_the_optimum_where_k2_in_the_loss_does_not(
        tree: Tree, beta: float) -> None:
    reward_k1 = train(tree, Setting("k1", "reward", (("kl_estimator", "k1"),)), beta, TRAINING, seed=0)
    loss_future = train(tree, Setting("k1_future", "loss", (("kl_estimator", "k1_future"),)), beta, TRAINING, seed=0)
    assert reward_k1.figures.kl_opt <= 0.003
    assert loss_future.figures.kl_opt <= 0.003
    if beta <= 0.5:  # k2's per-token gradient misses the KL of the tokens that follow
        loss_k2 = train(tree, Setting("k2", "loss", (("kl_estimator", "k2"),)), beta, TRAINING, seed=0)
        assert loss_k2.figures.kl_opt > 0.01


def test_the_default_reward_estimator_regularises_and_k3_in_the_reward_does_not(tree: Tree) -> None:
    default = train(tree, Setting("default", "reward"), 0.5, TRAINING, seed=1)  # kl_estimator None: k1
    k3 = train(tree, Setting("k3", "reward", (("kl_estimator", "k3"),)), 0.5, TRAINING, seed=1)
    unregularised = train(tree, Setting("off", "off"), 0.5, TRAINING, seed=1)
    assert default.figures.kl_opt <= 0.003
    assert k3.figures.kl_ref > unregularised.figures.kl_ref * 0.8 and k3.figures.reward > 0.99


def test_loss_side_beta_acts_as_beta_times_g_over_g_minus_one(tree: Tree) -> None:
    """GRPO's group mean includes the sample: the policy gradient is scaled by (G - 1) / G and a KL in the loss is
    not, so k1_future trained at beta as passed lands on pi* of beta * G / (G - 1)."""
    beta, g = 0.5, TRAINING.group_size
    run = train(tree, Setting("passed", "loss", (("kl_estimator", "k1_future"),), beta_scale="passed"), beta,
                TRAINING, seed=0)
    assert kl(run.logp, optimum(tree, beta * g / (g - 1))) <= 0.003 < run.figures.kl_opt


@pytest.mark.parametrize("loss_type, config", [("grpo", ()), ("dr_grpo", ()), ("dapo", ()), ("luspo", ()),
                                                ("dapo", (("kl_reduction", "sequence_mean"),))])
def test_the_lab_passes_each_divisor_its_step_reduces_by_and_no_other(
        tree: Tree, loss_type: str, config: tuple[tuple[str, str], ...]) -> None:
    """Two steps of each loss type: a divisor the step reduces by left out raises (dr_grpo's max_completion_length,
    dapo's token_normalizer), one it does not read warns that it has no effect, here an error."""
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*has no effect")
        run = train(tree, Setting("k3", config=config, loss_type=loss_type), 0.1, replace(TRAINING, steps=2), seed=0)
    assert math.isfinite(run.figures.kl_ref)


def test_target_settles_at_the_beta_whose_optimum_has_the_target_kl(tree: Tree) -> None:
    result = tabular_lab.target_experiment(tree.env, 0.5, replace(TRAINING, steps=1500, schedule="constant"), rates=(0.02,))
    run = result["runs"][0]
    assert result["beta_star"] == pytest.approx(0.5, rel=1e-6)
    assert run["final_beta"] == pytest.approx(result["beta_star"], rel=0.05)
    assert run["kl_ref"] == pytest.approx(result["tau"], rel=0.10)


def test_a_registered_estimator_runs_in_the_lab_from_the_command_line(capsys) -> None:
    if "lab_test_k1" not in estimator_names():
        @register_kl_estimator("lab_test_k1")
        def lab_test_k1(logp, ref, mask):  # k1 under another name: must land where k1 lands
            return logp - ref
    result = kl_lab.main(["--env", "contains_a", "--estimator", "lab_test_k1", "--only", "lab_test_k1 in the reward",
                          "--no-target", "--processes", "1"])
    rows = result["tables"]["contains_a"]["rows"]
    assert [row["setting"] for row in rows] == ["the optimum pi*", "lab_test_k1 in the reward"]
    assert rows[1]["kl_opt"] <= 0.003
    assert "lab_test_k1 in the reward" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="not registered"):
        kl_lab.main(["--estimator", "no_such_estimator"])


def test_the_docs_figures_are_what_the_lab_computes() -> None:
    """docs/results/kl_lab.json (the Ground truth page's source) against a re-run of two of its rows."""
    stored = json.loads((ROOT / "docs" / "results" / "kl_lab.json").read_text())
    table = stored["tables"]["contains_a"]
    training = Training(**table["training"])
    settings = {s.label: s for s in tabular_lab.default_settings()}
    rerun = tabular_lab.run_table(Environment(**table["environment"]),
                             [settings["k1 in the reward"], settings["k3 in the loss"]], table["beta"], training,
                             table["seeds"])
    stored_rows = {row["setting"]: row for row in table["rows"]}
    for row in rerun["rows"]:
        for column in ("reward", "length", "kl_ref", "kl_opt"):
            assert row[column] == pytest.approx(stored_rows[row["setting"]][column], abs=0.01), (row["setting"], column)
    assert {s.label for s in tabular_lab.default_settings()} <= set(stored_rows)


def test_the_words_the_docs_use_for_the_lab_hold_in_its_tables() -> None:
    """The estimators, papers and choosing-a-setting pages say in words what the committed tables show (the Ground
    truth page's own sentences are computed, `tabular_findings`): each word claim against the figures."""
    stored = json.loads((ROOT / "docs" / "results" / "kl_lab.json").read_text())

    def row(env: str, setting: str) -> dict:
        return next(r for r in stored["tables"][env]["rows"] if r["setting"] == setting)

    for env in ("contains_a", "first_a"):
        off, best = row(env, "beta = 0 (no KL)"), row(env, "the optimum pi*")
        # "in the reward only an estimator whose value is the log-ratio lands on it"
        assert all(row(env, f"{name} in the reward")["kl_opt"] < 1e-3 for name in ("k1", "k1+", "k1_future"))
        # "k2, k3, low_var_kl and k3+ there do not regularise (the KL to the reference ends above that of beta = 0)"
        assert all(row(env, f"{name} in the reward")["kl_ref"] > off["kl_ref"] for name in ("k2", "k3", "low_var_kl", "k3+"))
        # "k3_bottom_percentile there ends far from the optimum"
        assert row(env, "k3_bottom_percentile in the reward")["kl_opt"] > 0.1
        # "k1 in the loss does not regularise"
        assert row(env, "k1 in the loss")["kl_ref"] > off["kl_ref"]
        # "k1_future is exact with scale_rewards='none' and dr_grpo or dapo; grpo and sequence_mean move the fixed
        # point; sequence_sum acts as a larger beta" (on the frontier, nearer the reference than the optimum)
        assert all(row(env, s)["kl_opt"] < 1e-3 for s in ("k1_future in the loss",
                                                          "k1_future in the loss, dapo, scale none"))
        assert all(row(env, s)["kl_opt"] > 1e-2 for s in ("k1_future in the loss, grpo, scale none",
                                                          "k1_future in the loss, sequence_mean"))
        summed = row(env, "k1_future in the loss, sequence_sum")
        assert summed["regret"] < 1e-2 and summed["kl_ref"] < best["kl_ref"] / 2
    # "in the loss, k3 and k2 end near it, not on it" (the default environment; with the reward saturated at the first
    # token there is little KL-to-go to miss)
    future = row("contains_a", "k1_future in the loss")["kl_opt"]
    assert all(10 * future < row("contains_a", f"{name} in the loss")["kl_opt"] < 0.05 for name in ("k3", "k2"))
    # "k1_future is exact with scale_rewards='none'": with 'group' it is not
    assert all(row(env, "k1_future in the loss, dr_grpo, scale group")["kl_opt"] > 0.1 for env in ("contains_a", "first_a"))


def test_the_saturated_length_finding_reads_the_drift_from_the_table() -> None:
    """first_a under TRL's defaults: the verdict and the share are (E[length] - the optimum's) / (no KL's - the
    optimum's), recomputed here; moving that row's length to the optimum's, or halfway, changes the words. The home
    page's "weaken the term and they drift (... in the exact lab under TRL's default reward scaling)" and Choosing a
    setting's "the exact lab's completions then drift as far as with no KL" rest on it."""
    from unsloth_adaptive_kl.tools.tabular_findings import TRL_DEFAULTS, saturated_length

    stored = json.loads((ROOT / "docs" / "results" / "kl_lab.json").read_text())
    rows = {row["setting"]: row for row in stored["tables"]["first_a"]["rows"]}
    best, off, stock = (rows[name]["length"] for name in ("the optimum pi*", "beta = 0 (no KL)", TRL_DEFAULTS))
    sentence = saturated_length(stored)
    assert f"({round(100 * (stock - best) / (off - best))}% of no KL's drift)" in sentence
    assert "drift as far as no KL does" in sentence  # the committed run: 2.930 against 2.906 with no KL
    for length, words in ((best, "TRL's defaults hold the length"), ((best + off) / 2, "drift part of the way")):
        rows[TRL_DEFAULTS]["length"] = length
        assert words in saturated_length(stored)
