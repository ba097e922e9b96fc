"""The KL lab (unsloth_adaptive_kl/tools/kl_lab.py): its exact quantities against independent formulas, and where
GRPO settings converge against the closed-form optimum pi*_beta(y) = pi_ref(y) exp(r(y) / beta) / Z."""

from __future__ import annotations

import itertools
import json
import math
import warnings
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import torch

from unsloth_adaptive_kl import register_kl_estimator
from unsloth_adaptive_kl.core.estimators import BUILT_IN_ESTIMATORS, estimator_names
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
    # the page's "beta over the second half" (the first starts at beta_0 = 0.2) and KL(pi||pi*) to pi* of beta = 0.5,
    # not of the beta_0 the run was started at (0.2, whose optimum is far from 0.5's)
    assert run["betas"][0] < 0.25 and 0.45 < run["beta_tail_min"] <= run["beta_tail_max"] < 0.55
    assert run["kl_opt"] < 0.002 < 0.1 < kl(optimum(tree, 0.5), optimum(tree, 0.2))


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
    # Both settings converge (learning rate decayed to 0), so a re-run lands on the stored figures to the machine's
    # rounding (an Intel and an AMD CPU differ by under 1e-6): 1e-5 catches a change of the lab's maths (k3's
    # KL(pi||pi*) is 0.009: collapsing onto pi* would fail here)
    for row in rerun["rows"]:
        for column in ("reward", "length", "kl_ref", "kl_opt", "kl_ref_first"):
            assert row[column] == pytest.approx(stored_rows[row["setting"]][column], abs=1e-5), (row["setting"], column)
    assert {s.label for s in tabular_lab.default_settings()} <= set(stored_rows)


def test_the_estimators_expectations_against_the_kl_by_an_independent_formula() -> None:
    """What the estimators page says "unbiased" on: k1 and k3 (and the estimators sharing their values) have the KL as
    their expectation over completions, to float32 rounding (the core computes k in float32); k2 falls short;
    low_var_kl by exactly what its clamp at 10 cuts off k3 (every token's r stays inside its clamp at +-20 here).
    By hand in float64: pi(y) from the same noise, k3 = e^r - r - 1, r = log pi_ref - log pi per token."""
    env = ENVIRONMENTS["contains_a"]
    result = tabular_lab.estimator_expectations(env)
    figures = {row["estimator"]: row for row in result["rows"]}
    tree = Tree(env)
    noise = torch.randn(tree.reference_table.shape, generator=torch.Generator().manual_seed(result["policy_seed"]))
    logp = torch.log_softmax((tree.reference_table + noise).double(), -1)[tree.node, tree.token] * tree.mask
    ref = torch.log_softmax(tree.reference_table.double(), -1)[tree.node, tree.token] * tree.mask
    weight = logp.sum(-1).exp()
    exact = float((weight * (logp.sum(-1) - ref.sum(-1))).sum())
    r = (ref - logp) * tree.mask
    k3 = (r.exp() - r - 1) * tree.mask
    assert r.abs().max() < 20 and k3.max() > 10  # the clamp at 10 acts on some token, the one at 20 on none
    assert result["kl"] == pytest.approx(exact, rel=1e-6)  # the lab's log-softmax is the tree's float32 one
    for name in ("k1", "k3", "k1+", "k3+", "k1_future"):
        assert abs(figures[name]["bias"]) <= 1e-6 * exact, name
    assert figures["k2"]["expectation"] == pytest.approx(float((weight * (0.5 * r ** 2).sum(-1)).sum()), rel=1e-6)
    assert figures["k2"]["bias"] < -0.1 * exact
    cut = float((weight * (k3 - k3.clamp(max=10.0)).sum(-1)).sum())
    assert figures["low_var_kl"]["bias"] == pytest.approx(-cut, rel=1e-3, abs=1e-7)
    assert [row["estimator"] for row in result["rows"]] == list(BUILT_IN_ESTIMATORS)
    # the spread of one completion's estimate, sqrt(E[X^2] - E[X]^2) over y ~ pi, in float64 by hand: k1's X is the
    # completion's log-ratio, k3's and k2's the sums of their per-token values
    for name, summed in (("k1", -r.sum(-1)), ("k3", k3.sum(-1)), ("k2", (0.5 * r ** 2).sum(-1))):
        spread = math.sqrt(float((weight * summed ** 2).sum()) - float((weight * summed).sum()) ** 2)
        assert figures[name]["std"] == pytest.approx(spread, rel=1e-5), name
    # "k1: the widest spread of the unbiased ones" (the estimators page)
    assert figures["k1"]["std"] > max(figures[name]["std"] for name in ("k3", "k3+", "low_var_kl"))
    # the committed figures (the estimators page's table) are this computation's
    stored = json.loads((ROOT / "docs" / "results" / "kl_lab.json").read_text())["estimators"]
    assert [row["estimator"] for row in stored["rows"]] == list(BUILT_IN_ESTIMATORS)
    for mine, theirs in zip(result["rows"], stored["rows"]):
        assert theirs["expectation"] == pytest.approx(mine["expectation"], rel=1e-6), mine["estimator"]
        assert theirs["std"] == pytest.approx(mine["std"], rel=1e-6), mine["estimator"]


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


def test_the_saturated_length_finding_says_where_the_kl_sits_and_why_the_length_follows() -> None:
    """first_a under TRL's defaults: E[r] and E[length] against the optimum's, the first token's share of the KL to
    the reference against the tokens after it, and the reference's length after a, each from the table; moving that
    row's reward to the optimum's, or its KL onto the later tokens, changes the words. Choosing a setting's "the exact
    lab's policy then over-optimises the reward, and the length follows" rests on it."""
    from unsloth_adaptive_kl.tools.tabular_findings import TRL_DEFAULTS, saturated_length

    stored = json.loads((ROOT / "docs" / "results" / "kl_lab.json").read_text())
    rows = {row["setting"]: row for row in stored["tables"]["first_a"]["rows"]}
    stock, best = rows[TRL_DEFAULTS], rows["the optimum pi*"]
    sentence = saturated_length(stored)
    assert sentence.startswith("**Once the reward saturates, TRL's defaults over-optimise it, and the length follows")
    assert (f"E[r] ends at {stock['reward']:.3f} against the optimum's {best['reward']:.3f}, and E[length] at "
            f"{stock['length']:.3f} against the optimum's {best['length']:.3f}") in sentence
    assert (f"of its KL(pi||pi_ref) {stock['kl_ref']:.4f}, the first token carries {stock['kl_ref_first']:.4f} and the "
            f"tokens after it {stock['kl_ref'] - stock['kl_ref_first']:.4f}: the continuations stay at the "
            "reference's") in sentence
    assert stock["kl_ref"] - stock["kl_ref_first"] < 0.01 * stock["kl_ref"]  # the committed run: 0.0003 of 1.3836
    stock["kl_ref_first"] = 0.9 * stock["kl_ref"]  # a tenth of the KL on the later tokens
    assert "the continuations move from the reference's too" in saturated_length(stored)
    stock["reward"] = best["reward"]
    assert "TRL's defaults hold it near the optimum (first_a)" in saturated_length(stored)


def test_the_first_tokens_share_of_the_kl_and_the_reference_length_after_a_by_hand() -> None:
    """On SMALL ("", "a", "aa"; pi_ref 1/2, 1/4, 1/4) with p = (1/4, 1/2, 1/4): the first-token marginals are
    (EOS 1/4, a 3/4) against (1/2, 1/2), so the first token's KL is 1/4 ln(1/2) + 3/4 ln(3/2); the rest, E_p[KL of the
    continuation] = 3/4 (2/3 ln(4/3) + 1/3 ln(2/3)), adds up to the whole KL (the chain rule). The reference's length
    after a: 2 ("a" and "aa" both have 2 tokens), against 1.5 over all."""
    from unsloth_adaptive_kl.tools.tabular_findings import reference_length_after_a

    tree = Tree(SMALL, reference_table=torch.zeros(2, 2))
    logp = torch.tensor([0.25, 0.5, 0.25], dtype=torch.float64).log()
    reference = tree.log_probs(tree.reference_table)
    first = 0.25 * math.log(0.5) + 0.75 * math.log(1.5)
    # the reference's log-probs are float32's (the tree's table): to its rounding
    assert tabular_lab.first_token_kl(tree, logp, reference) == pytest.approx(first, abs=1e-7)
    figures = tabular_lab.Figures.of(tree, logp, 1.0)
    continuation = 0.75 * (2 / 3 * math.log(4 / 3) + 1 / 3 * math.log(2 / 3))
    assert figures.kl_ref_first == pytest.approx(first, abs=1e-7)
    assert figures.kl_ref - figures.kl_ref_first == pytest.approx(continuation, abs=1e-7)
    assert reference_length_after_a(tree) == pytest.approx((2.0, 1.5), abs=1e-7)


# ----- the exact figures, the GRPO loop's pieces and the rendered cells, against hand computations ------------------
# (added by a mutation audit of the KL lab: each pins figures that reach docs/ground-truth.md and that the tests above
# let change unnoticed)

# A three-completion tree: one letter 'a', at most two tokens: "" (EOS), "a" (a, EOS), "aa"; lengths 1, 2, 2
# (EOS counted), rewards (contains_a) 0, 1, 1. A zero reference table gives pi_ref = (1/2, 1/4, 1/4).
SMALL = Environment("contains_a", tokens=1, max_length=2)


def small_tree() -> Tree:
    return Tree(SMALL, torch.zeros(2, 2))


def policy_table(p_empty: float, p_a: float) -> torch.Tensor:
    """The logits (rows "", "a"; columns a, EOS) of the policy with pi("") = p_empty, pi("a") = p_a."""
    rest = 1 - p_empty
    return torch.tensor([[math.log(rest), math.log(p_empty)],
                         [math.log((rest - p_a) / rest), math.log(p_a / rest)]], dtype=torch.float64)


def bernoulli_kl(m: float) -> float:
    """KL((1 - m, m) || (1/2, 1/2)): on the small tree, the KL of any policy that keeps the reference's proportions
    inside the rewarded completions (every pi*_beta) to the reference, m its reward."""
    return m * math.log(2 * m) + (1 - m) * math.log(2 * (1 - m))


def test_the_exact_figures_of_a_three_completion_policy_are_the_hand_computed_ones() -> None:
    """pi = (0.2, 0.3, 0.5) against pi_ref = (1/2, 1/4, 1/4) and pi*_0.5 = (1, e^2 / 2, e^2 / 2) / (1 + e^2): every
    column of Figures by hand; the frontier's reward at the policy's KL solves bernoulli_kl(m) = KL by bisection on m
    (not on beta), and beta_for_kl is then 1 / logit(m) (pi*_beta' puts m = e^(1/beta') / (1 + e^(1/beta')) on 'a')."""
    tree, beta = small_tree(), 0.5
    assert tree.completions == [(1,), (0, 1), (0, 0)]
    logp = tree.log_probs(policy_table(0.2, 0.3))
    pi, ref = [0.2, 0.3, 0.5], [0.5, 0.25, 0.25]
    e2 = math.exp(2.0)
    star = [1 / (1 + e2), e2 / (2 * (1 + e2)), e2 / (2 * (1 + e2))]
    assert optimum(tree, beta).exp().tolist() == pytest.approx(star, rel=1e-6)  # pi_ref in float32
    kl_ref = sum(p * math.log(p / q) for p, q in zip(pi, ref))
    kl_opt = sum(p * math.log(p / q) for p, q in zip(pi, star))
    low, high = 0.5, 1.0
    for _ in range(100):
        m = (low + high) / 2
        low, high = (m, high) if bernoulli_kl(m) < kl_ref else (low, m)
    frontier = (low + high) / 2
    figures = Figures.of(tree, logp, beta)
    assert figures.reward == pytest.approx(0.8, abs=1e-7)
    assert figures.length == pytest.approx(0.2 * 1 + 0.3 * 2 + 0.5 * 2, abs=1e-7)
    assert figures.kl_ref == pytest.approx(kl_ref, abs=1e-7)
    assert figures.kl_opt == pytest.approx(kl_opt, abs=1e-7)
    assert figures.objective == pytest.approx(0.8 - beta * kl_ref, abs=1e-7)
    assert figures.regret == pytest.approx(frontier - 0.8, abs=1e-6) and figures.regret > 0.005
    assert beta_for_kl(tree, kl_ref) == pytest.approx(1 / math.log(frontier / (1 - frontier)), rel=1e-5)
    # the optimum's own row: E[r] = e^2 / (1 + e^2), E[length] = (1 + 2 e^2) / (1 + e^2), objective beta log Z with
    # Z = sum_y pi_ref(y) exp(r(y) / beta) = (1 + e^2) / 2, on the frontier
    best = Figures.of(tree, optimum(tree, beta), beta)
    assert (best.reward, best.length) == pytest.approx((e2 / (1 + e2), (1 + 2 * e2) / (1 + e2)), rel=1e-6)
    assert best.objective == pytest.approx(beta * math.log((1 + e2) / 2), rel=1e-6)
    assert best.kl_opt == 0.0 and abs(best.regret) < 1e-9
    # beyond log 2, the KL of the reference restricted to the rewarded completions, the frontier's reward is 1
    assert frontier_reward(tree, math.log(2) + 1e-3) == 1.0 > frontier_reward(tree, math.log(2) - 1e-3)


def test_the_advantages_are_trls_by_hand() -> None:
    """r_i - the group's mean, divided by the group's unbiased std (TRL: .std(), Bessel's correction) + 1e-4 for
    'group', by the batch's for 'batch', left alone for 'none'. Groups of 4: (1, 0, 0, 0) has mean 1/4 and std
    sqrt(0.75 / 3) = 1/2; (1, 1, 0, 0) mean 1/2 and std sqrt(1 / 3); the batch's std is sqrt(1.875 / 7)."""
    rewards = torch.tensor([1.0, 0, 0, 0, 1, 1, 0, 0])
    centred = [0.75, -0.25, -0.25, -0.25, 0.5, 0.5, -0.5, -0.5]
    assert tabular_lab.advantages(rewards, 4, "none").tolist() == pytest.approx(centred)
    group = [c / (0.5 + 1e-4) for c in centred[:4]] + [c / (math.sqrt(1 / 3) + 1e-4) for c in centred[4:]]
    assert tabular_lab.advantages(rewards, 4, "group").tolist() == pytest.approx(group, rel=1e-6)
    batch = [c / (math.sqrt(1.875 / 7) + 1e-4) for c in centred]
    assert tabular_lab.advantages(rewards, 4, "batch").tolist() == pytest.approx(batch, rel=1e-6)


def test_each_loss_type_reduces_the_per_token_loss_as_trl_does_by_hand() -> None:
    """Two completions of 2 and 1 tokens, per-token losses (1, 2) and (3), max_length 4: grpo each completion's mean,
    then their mean ((1.5 + 3) / 2); dapo and bnpo the token sum over the token count (6 / 3); dr_grpo the sum over
    completions x max_length (6 / 8); luspo the completions' sums' mean ((3 + 3) / 2). Padding never counts."""
    per_token = torch.tensor([[1.0, 2.0, 7.0, 7.0], [3.0, 7.0, 7.0, 7.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
    for loss_type, expected in (("grpo", 2.25), ("dapo", 2.0), ("bnpo", 2.0), ("dr_grpo", 0.75), ("luspo", 3.0)):
        assert float(tabular_lab.policy_loss(per_token, mask, loss_type, 4)) == pytest.approx(expected), loss_type


def test_the_eos_bias_is_added_to_the_references_eos_logit() -> None:
    plain, biased = (Tree(Environment(eos_bias=bias)).reference_table for bias in (0.0, 1.5))
    assert torch.equal(biased[:, :2], plain[:, :2]) and torch.allclose(biased[:, 2] - plain[:, 2], torch.tensor(1.5))


def test_the_table_cells_are_the_rows_figures_in_the_headers_order() -> None:
    """The Ground truth page's cells (tabular_lab.table_rows under HEADER, target_rows under TARGET_HEADER): each
    figure in its column; KL(pi||pi*) below 5e-5 reads 0, a seeds' spread above 0.05 is shown beside it, a regret below
    0 (the bisection's rounding) reads 0."""
    assert tabular_lab.HEADER[2:] == ["E[r]", "E[length]", "KL(pi||pi_ref)", "KL(pi||pi*)", "objective",
                                      "frontier regret"]
    rows = [{"setting": "one", "group": "g", "beta_trained": 0.4375, "reward": 0.111, "length": 2.222, "kl_ref": 0.333,
             "kl_opt": 0.0444, "kl_opt_spread": 0.06, "objective": -0.1234, "regret": -0.002},
            {"setting": "two", "group": "g", "beta_trained": 0.5, "reward": 0.9, "length": 3.0, "kl_ref": 0.5,
             "kl_opt": 3e-5, "kl_opt_spread": 0.04, "objective": 0.65, "regret": 0.0123}]
    assert tabular_lab.table_rows({"rows": rows}) == [("g", [
        ["one", "0.4375", "0.111", "2.222", "0.333", "0.0444 (spread 0.060)", "-0.1234", "0.0000"],
        ["two", "0.5", "0.900", "3.000", "0.500", "0", "0.6500", "0.0123"]])]
    assert tabular_lab.TARGET_HEADER == ["kl_horizon", "completions / kl_horizon", "final beta",
                                         "beta over the second half", "KL(pi||pi_ref)", "KL(pi||pi*_beta*)"]
    run = {"kl_horizon": 12800.0, "rate": 0.02, "final_beta": 0.49619, "beta_tail_min": 0.4892, "beta_tail_max": 0.5109,
           "kl_ref": 0.44559, "kl_opt": 7.3e-05}
    assert tabular_lab.target_rows({"runs": [run]}) == [
        ["12800", "0.02", "0.4962", "0.489 - 0.511", "0.4456", "0.00007"]]


def test_a_tables_row_is_its_seeds_mean_and_spread() -> None:
    """run_table's row: each figure the mean of the seeds' runs (train, called here one seed at a time), the spread
    the largest minus the smallest KL(pi||pi*), beta trained beta (G - 1) / G in the loss; first the optimum's row."""
    env, beta, training = ENVIRONMENTS["contains_a"], 0.5, replace(TRAINING, steps=5)
    settings = [Setting("k1 in the reward", "reward", (("kl_estimator", "k1"),)), Setting("k3 in the loss")]
    table = tabular_lab.run_table(env, settings, beta, training, [0, 1])
    assert [row["setting"] for row in table["rows"]] == ["the optimum pi*", "k1 in the reward", "k3 in the loss"]
    assert table["rows"][0]["kl_opt"] == 0.0 and table["completions"] == 31
    for setting, row in zip(settings, table["rows"][1:]):
        runs = [train(Tree(env), setting, beta, training, seed) for seed in (0, 1)]
        figures = [run.figures for run in runs]
        assert figures[0].kl_opt != figures[1].kl_opt  # two seeds, two runs
        for column in ("reward", "length", "kl_ref", "kl_opt", "objective", "regret"):
            assert row[column] == pytest.approx((getattr(figures[0], column) + getattr(figures[1], column)) / 2,
                                                abs=1e-9), column
        assert row["kl_opt_spread"] == pytest.approx(abs(figures[0].kl_opt - figures[1].kl_opt), abs=1e-12)
    assert [row["beta_trained"] for row in table["rows"][1:]] == [0.5, pytest.approx(0.5 * 7 / 8)]


def test_the_controller_observes_the_reward_before_the_kl_penalty(monkeypatch) -> None:
    """step(mean_reward=) gets the batch's mean of the rewards themselves (0 or 1 each: a multiple of 1/256 for 256
    completions), not the rewards less k1 in the reward, as the integrations pass it (dynamic's threshold reads it)."""
    seen = []

    class Recording(tabular_lab.AdaptiveKL):
        def step(self, *args, **kwargs):
            seen.append(kwargs["mean_reward"])
            return super().step(*args, **kwargs)

    tree = Tree(ENVIRONMENTS["contains_a"])
    setting = Setting("dynamic in the reward", "reward", (("kl_adaptation_method", "dynamic"),
                                                          ("reward_threshold", 0.6)))
    monkeypatch.setattr(tabular_lab, "AdaptiveKL", Recording)
    train(tree, setting, 0.5, replace(TRAINING, steps=6, learning_rate=0.5), seed=0)
    assert len(seen) == 6 and all(0 <= value <= 1 and (value * 256) == round(value * 256) for value in seen)


def test_k1_future_in_the_loss_with_dapo_reaches_the_optimum_and_with_grpo_does_not(tree: Tree) -> None:
    """dapo divides the policy gradient and the KL term by the same step's token count (the lab passes it as
    token_normalizer), so k1_future lands on pi*; grpo divides each completion by its own length and moves the fixed
    point (the Ground truth page's claims)."""
    dapo = train(tree, Setting("dapo", "loss", (("kl_estimator", "k1_future"),), loss_type="dapo"), 0.5, TRAINING, 0)
    grpo = train(tree, Setting("grpo", "loss", (("kl_estimator", "k1_future"),), loss_type="grpo"), 0.5, TRAINING, 0)
    assert dapo.figures.kl_opt <= 0.003 < 0.01 < grpo.figures.kl_opt


def test_the_command_line_runs_target_at_a_constant_rate_and_the_tables_at_the_steps_asked(monkeypatch) -> None:
    """The page states the target runs' 1500 steps "at a constant learning rate" and the tables' rate "decayed
    linearly to 0": the command line's and the committed run's trainings."""
    seen = {}

    def target(env, beta, training, *args, **kwargs):
        seen.update(env=env, beta=beta, training=training)
        return {"beta_star": beta, "tau": 0.4, "beta_0": 0.2, "runs": []}

    monkeypatch.setattr(kl_lab, "target_experiment", target)
    monkeypatch.setenv("ADAPTIVE_KL_COMMIT", "0123456")
    result = kl_lab.main(["--only", "beta = 0 (no KL)", "--processes", "1", "--steps", "7", "--beta", "0.3"])
    assert result["commit"] == "0123456"  # the commit it ran at (source_commit)
    assert seen == {"env": ENVIRONMENTS["contains_a"], "beta": 0.3,
                    "training": Training(steps=1500, schedule="constant")}
    assert [table["training"]["steps"] for table in result["tables"].values()] == [7, 7]
    assert {table["training"]["schedule"] for table in result["tables"].values()} == {"linear"}
    stored = json.loads((ROOT / "docs" / "results" / "kl_lab.json").read_text())
    assert stored["target"]["training"]["schedule"] == "constant" and stored["target"]["training"]["steps"] == 1500
    assert {table["training"]["schedule"] for table in stored["tables"].values()} == {"linear"}


# ----- the Ground truth page's sentences (tabular_findings) against the figures beside them --------------------------

def stored_lab() -> dict:
    return json.loads((ROOT / "docs" / "results" / "kl_lab.json").read_text())


def set_figure(result: dict, env: str, setting: str, column: str, value: float) -> None:
    next(r for r in result["tables"][env]["rows"] if r["setting"] == setting)[column] = value


def finding(result: dict, title: str) -> str:
    from unsloth_adaptive_kl.tools.tabular_findings import findings

    (sentence,) = [f for f in findings(result) if title in f]
    return sentence


def test_the_bounds_and_ranges_the_findings_print() -> None:
    """'at most' rounds up to two significant digits (a bound that holds), a range reads low to high."""
    from unsloth_adaptive_kl.tools.tabular_findings import _at_most, counted, span

    assert [_at_most(v) for v in (2.14e-06, 0.0123, 0.05, 0.00061, 0.0)] == ["2.2e-06", "0.013", "0.05", "0.00061", "0"]
    assert span([2.389, 2.092, 2.2]) == "2.092 to 2.389" and span([2.0, 2.0004]) == "2.000"
    assert span([0.501, 0.5012], "{:.3g}".format) == "0.501" and span([0.49, 0.51], "{:.3g}".format) == "0.49 to 0.51"
    assert [counted(n, "run") for n in (1, 2)] == ["1 run", "2 runs"]  # the Unsloth lab's "over 1 runs (1 recipes"


def test_each_verdict_of_the_committed_findings_is_the_comparison_of_its_figures() -> None:
    """On the committed tables, each verdict word against the figures as read here (the thresholds: KL(pi||pi*) below
    1e-3 is "on", below 0.05 "near"; a regret below 0.01 "on the frontier", above 0.05 "off" it). The verdicts are
    computed here, so a re-run that moves a figure across a threshold moves the expected word with it; the comment
    beside each says what the committed run gives."""
    result = stored_lab()
    envs = ("contains_a", "first_a")

    def row(env: str, setting: str) -> dict:
        return next(r for r in result["tables"][env]["rows"] if r["setting"] == setting)

    def both(setting: str, column: str) -> list:
        return [row(env, setting)[column] for env in envs]

    def where(setting: str) -> str:
        worst = max(both(setting, "kl_opt"))
        return "lands on" if worst < 1e-3 else "ends near" if worst < 0.05 else "ends far from"

    best, off = {env: row(env, "the optimum pi*") for env in envs}, {env: row(env, "beta = 0 (no KL)") for env in envs}
    # k1 in the reward: 3 estimators with k1's value + 5 other loss-type / scaling rows, in 2 environments
    k1 = [f"{name} in the reward" for name in ("k1", "k1+", "k1_future")] + [
        f"k1 in the reward, {loss}, scale {scale}" for loss, scale in (
            ("dr_grpo", "group"), ("dapo", "none"), ("dapo", "group"), ("grpo", "none"), ("grpo", "group"))]
    worst = max(row(env, s)["kl_opt"] for env in envs for s in k1)
    sentence = finding(result, "**k1 in the reward")
    assert sentence.startswith(f"**k1 in the reward {'lands on' if worst < 1e-3 else 'ends near'}")  # lands on
    assert "in all 16 of its rows" in sentence and f"at most {_ceil2(worst)}" in sentence  # 2.2e-06
    # the loss types and scalings those rows ran, not "every" (the lab's bnpo has no such row)
    assert ("(both environments; the loss types `dr_grpo`, `dapo` and `grpo`, the reward scalings `none` and `group`; "
            in sentence)
    held = all(row(env, "k1 in the loss")["kl_ref"] >= off[env]["kl_ref"] for env in envs)
    assert finding(result, "**k1 in the loss").startswith(
        "**k1 in the loss does not regularise**" if held else "**k1 in the loss**")
    k3 = finding(result, "**k3 in the loss")
    assert k3.startswith("**k3 in the loss (verl's; TRL's and Unsloth's without the importance ratio) "
                         f"{where('k3 in the loss')}")  # 0.0091: near
    apart = [env for env in envs if min(row(env, "k3 in the loss")["kl_opt"], row(env, "k2 in the loss")["kl_opt"])
             > 3 * row(env, "k1_future in the loss")["kl_opt"]]  # contains_a's (first_a's are both near 0)
    assert (f"In {' and '.join(apart)} the per-token estimators" in k3) if apart else "per-token estimators" not in k3
    future = finding(result, "**k1_future in the loss**")
    exact = max(both("k1_future in the loss", "kl_opt") + both("k1_future in the loss, dapo, scale none", "kl_opt"))
    moved = min(both("k1_future in the loss, grpo, scale none", "kl_opt")
                + both("k1_future in the loss, sequence_mean", "kl_opt"))
    assert f"ends at most {_ceil2(exact)} from" in future and f"moves the fixed point: {moved:.4f} or more" in future
    on_frontier = max(both("k1_future in the loss, sequence_sum", "regret")) < 0.01
    assert (", on the frontier (regret" in future) == on_frontier
    longer = all(row(env, "k1 in the reward, sequence_mean")["length"] > best[env]["length"] for env in envs)
    shorter = all(row(env, "length_normalized in the loss")["length"] < best[env]["length"] for env in envs)
    assert ("**Per-completion means lengthen, length normalisation shortens**" in finding(result, "**Per-completion")
            ) == (longer and shorter)  # 3.153 and 2.207 against 2.721
    methods = finding(result, "**The adaptive methods")
    grew = all(row(env, f"{m} in the {p}")["kl_ref"] > best[env]["kl_ref"]
               for env in envs for m in ("clip", "dynamic") for p in ("loss", "reward"))  # 0.770 to 1.546 > 0.473
    assert ("`clip` and `dynamic` let the KL to the reference grow to" in methods) == grew
    assert f"`sigmoid` in the loss {where('sigmoid in the loss')}" in methods  # 0.0055: near
    weaker = all(row(env, "sigmoid in the reward")["kl_ref"] > best[env]["kl_ref"] for env in envs)  # 1.169 > 0.447
    assert (", above the optimum's: shaping" in methods) == weaker
    closer = all(row("first_a", s)["kl_opt"] < row("contains_a", s)["kl_opt"]
                 for s in ("k3 in the loss", "k2 in the loss"))
    assert f"end {'closer to' if closer else 'no closer to'}" in finding(result, "**With the reward saturated")
    for env in envs:
        named = sorted((r for r in result["tables"][env]["rows"] if r["regret"] > 0.05), key=lambda r: -r["regret"])
        sentence = finding(result, f"**Off the frontier ({env})**")  # first_a: k3_bottom_percentile's two rows
        if named:
            assert sentence.startswith(f"**Off the frontier ({env})**: " + "; ".join(
                f"{r['setting']} {r['regret']:.4f}" for r in named) + " (frontier regret)")
        else:
            assert "no setting's frontier regret exceeds 0.05" in sentence


def _ceil2(value: float) -> str:
    """value rounded up at its second significant digit, by decimal arithmetic (the findings' 'at most')."""
    from decimal import ROUND_CEILING, Decimal

    exact = Decimal(repr(value))
    return f"{float(exact.quantize(Decimal(1).scaleb(exact.adjusted() - 1), ROUND_CEILING)):.2g}"


def test_a_finding_changes_its_words_when_its_figures_say_otherwise() -> None:
    """Each verdict moved by one figure: the words follow the figure, not the run the page was written from."""
    result = stored_lab()
    set_figure(result, "first_a", "k1+ in the reward", "kl_opt", 0.004)  # one k1-valued row off pi*, still near
    assert finding(result, "**k1 in the reward").startswith("**k1 in the reward ends near")
    assert "at most 0.004" in finding(result, "**k1 in the reward")
    result = stored_lab()
    best = next(r for r in result["tables"]["contains_a"]["rows"] if r["setting"] == "the optimum pi*")["length"]
    set_figure(result, "contains_a", "k1 in the reward", "length", best + 0.05)
    assert "(the optimum's: " in finding(result, "**k1 in the reward")
    result = stored_lab()
    set_figure(result, "first_a", "k2 in the reward", "kl_ref", 1.0)  # below no KL's 1.675 in one environment
    assert finding(result, "do not regularise**: the KL to the reference ends above").startswith(
        "**`k3`, `k3+` and `low_var_kl` in the reward do not regularise**")
    assert finding(result, "**`k2` in the reward").startswith("**`k2` in the reward ends far from")
    result = stored_lab()
    set_figure(result, "contains_a", "k3+ in the reward", "length", best + 0.1)  # one of them longer than pi*'s
    assert "They shorten completions" not in finding(result, "in the reward do not regularise")
    result = stored_lab()
    set_figure(result, "contains_a", "k3 in the loss", "kl_opt", 0.2)  # far in one environment
    assert finding(result, "**k3 in the loss").startswith("**k3 in the loss (verl's; TRL's and Unsloth's without the "
                                                          "importance ratio) ends far from")
    set_figure(result, "contains_a", "k3 in the loss", "kl_opt", 0.0091)
    set_figure(result, "first_a", "k3 in the loss", "kl_opt", 0.0005)  # on pi* in one environment only: near
    assert finding(result, "**k3 in the loss").startswith("**k3 in the loss (verl's; TRL's and Unsloth's without the "
                                                          "importance ratio) ends near")
    result = stored_lab()
    set_figure(result, "first_a", "clip in the loss", "kl_ref", 0.3)  # below the optimum's 0.473
    assert "`clip` and `dynamic` end at a KL to the reference of 0.300 to" in finding(result, "**The adaptive methods")
    result = stored_lab()
    set_figure(result, "contains_a", "k3 in the loss, token_mean", "regret", 0.07)
    assert "k3 in the loss, token_mean 0.0700 (frontier regret)" in finding(result, "**Off the frontier (contains_a)**")
    set_figure(result, "contains_a", "k3 in the loss, token_mean", "regret", 0.05)  # not above 0.05
    assert "no setting's frontier regret exceeds 0.05; the largest is 0.0500" in finding(
        result, "**Off the frontier (contains_a)**")


def test_the_target_reading_is_the_step_from_which_beta_stays_within_five_percent() -> None:
    """One beta every 50 steps, then the final one, against beta* = 0.5: within 5 % are 0.49, 0.51, 0.52 and 0.505;
    0.535 (7 %) and 0.4 are not. Settling is from the last entry outside on; a final beta outside means it never
    settles, and the second half of the trace is its range."""
    from unsloth_adaptive_kl.tools.tabular_findings import target_reading

    settles = {"rate": 0.02, "betas": [0.2, 0.4, 0.49, 0.535, 0.51, 0.52], "final_beta": 0.505, "kl_opt": 1e-4}
    never = {"rate": 0.1, "betas": [0.2, 0.3, 0.45, 0.55, 0.6, 0.52], "final_beta": 0.58, "kl_opt": 0.012}
    late = {"rate": 0.005, "betas": [0.2, 0.49, 0.5, 0.5, 0.5, 0.5], "final_beta": 0.6, "kl_opt": 0.02}
    result = {"beta_star": 0.5, "training": {"steps": 300}, "runs": [settles, never, late]}
    first, second, third = target_reading(result)
    assert "stays within 5% of \\( \\beta^* = 0.500 \\) from step 200 of 300 on and ends at 0.505" in first
    assert "never stays within 5%" in second and "over the second half it ranges from 0.520 to 0.600" in second
    assert "never stays within 5%" in third  # every traced beta within, the final one not


def test_the_trace_holds_beta_after_steps_0_n_2n(monkeypatch) -> None:
    """target_reading turns trace entry i into "step i * 50": the trace is beta after steps 0, n, 2n, ... (0-based)."""
    after = []

    class Recording(tabular_lab.AdaptiveKL):
        def step(self, *args, **kwargs):
            result = super().step(*args, **kwargs)
            after.append(self.current_beta)
            return result

    monkeypatch.setattr(tabular_lab, "AdaptiveKL", Recording)
    setting = Setting("target", "reward", (("kl_adaptation_method", "target"), ("kl_target", 0.1),
                                           ("kl_target_measure", "sequence_sum"), ("kl_horizon", 100.0)))
    run = train(Tree(ENVIRONMENTS["contains_a"]), setting, 0.2, replace(TRAINING, steps=7), seed=0, trace_every=3)
    assert len(set(after)) == 7  # beta moves every step
    assert run.betas == [after[0], after[3], after[6]] and run.final_beta == after[-1]


# ----- from a mutation audit of the KL lab (tools/kl_lab.py, tabular_lab.py, tabular_findings.py): each test below
# fails on the change its docstring names ("Mutant"), which every other test let pass


def test_first_a_rewards_exactly_the_completions_whose_first_token_is_a() -> None:
    """first_a's reward reads the first token only: the 15 of 31 completions that start with a (1 + 2 + 4 ending in
    EOS after a, a? or a??, and 8 of four letters) score 1, "a" alone (a, EOS) among them; the empty one and every
    completion starting with b score 0. (Mutants: `len(tokens) > 1`, `tokens[-1] == 0`.)"""
    tree = Tree(ENVIRONMENTS["first_a"])
    assert tree.rewards.tolist() == [1.0 if c[0] == 0 else 0.0 for c in tree.completions]
    rewards = dict(zip(tree.completions, tree.rewards.tolist()))
    assert sum(rewards.values()) == 15 and rewards[(0, 2)] == 1.0 and rewards[(2,)] == 0.0
    assert rewards[(1, 0, 2)] == 0.0 and rewards[(0, 1, 1, 1)] == 1.0


def test_the_reference_scale_multiplies_the_drawn_logits() -> None:
    """`reference_scale` is the standard deviation of the reference's logits: the same draw times the scale.
    (Mutant: the draw divided by it.)"""
    plain, scaled = (Tree(Environment(reference_scale=scale)).reference_table for scale in (1.0, 2.0))
    assert torch.allclose(scaled, 2 * plain)


def test_beta_for_kl_finds_a_beta_above_a_thousand() -> None:
    """The bisection's range is [1e-6, 1e6]: on the small tree with a float64 reference (pi_ref = (1/2, 1/4, 1/4)),
    pi*_beta puts m = 1 / (1 + e^(-1/beta)) on the rewarded completions, at KL bernoulli_kl(m) to the reference; at
    beta = 10^4 that KL (about 1.25e-9) is found again as beta = 10^4. (Mutant: the upper end 1e3.)"""
    tree = Tree(SMALL, torch.zeros(2, 2, dtype=torch.float64))
    for beta in (3.0, 1e4):
        m = 1 / (1 + math.exp(-1 / beta))
        assert beta_for_kl(tree, bernoulli_kl(m)) == pytest.approx(beta, rel=1e-4)


def test_beta_trained_and_the_optimums_row_by_hand() -> None:
    """beta trained: 0 with no KL, beta in the reward, beta (G - 1) / G = 0.4375 in the loss (G = 8), beta in the
    loss as passed; the optimum's row carries beta itself. (Mutants: 'off' trained at beta, the optimum's row at 0.)"""
    beta_trained = tabular_lab.beta_trained
    assert beta_trained(Setting("off", "off"), 0.5, TRAINING) == 0.0
    assert beta_trained(Setting("r", "reward"), 0.5, TRAINING) == 0.5
    assert beta_trained(Setting("l"), 0.5, TRAINING) == 0.4375
    assert beta_trained(Setting("p", beta_scale="passed"), 0.5, TRAINING) == 0.5
    table = tabular_lab.run_table(ENVIRONMENTS["contains_a"], [Setting("off", "off")], 0.5, replace(TRAINING, steps=1),
                                  [0])
    assert [row["beta_trained"] for row in table["rows"]] == [0.5, 0.0]


def test_the_loss_types_the_trainers_lab_predicts_and_an_unknown_one() -> None:
    """The same by-hand batch as above: sapo as grpo (2.25), cispo and vespo as dapo (2.0); a loss type the lab
    does not run is refused, not reduced some way. (Mutants: sapo, cispo or vespo unknown; no ValueError.)"""
    per_token = torch.tensor([[1.0, 2.0, 7.0, 7.0], [3.0, 7.0, 7.0, 7.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
    for loss_type, expected in (("sapo", 2.25), ("cispo", 2.0), ("vespo", 2.0)):
        assert float(tabular_lab.policy_loss(per_token, mask, loss_type, 4)) == pytest.approx(expected), loss_type
    with pytest.raises(ValueError, match="loss_type='nope'"):
        tabular_lab.policy_loss(per_token, mask, "nope", 4)


def test_the_estimator_rows_and_the_markdown_tables_by_hand() -> None:
    """The estimators table's cells (the KL to 6 decimals, the bias to 2 significant digits, the std to 4), and a
    Markdown table with '|' and '*' escaped and one '---|' a column. (Mutants: the bias as '.2e'; '*' unescaped; one
    separator short.)"""
    result = {"kl": 0.1234567, "rows": [{"estimator": "k2", "expectation": 0.1, "bias": -0.0234567, "std": 0.123456}]}
    assert tabular_lab.estimator_rows(result) == [["KL(pi || pi_ref)", "0.123457", "", ""],
                                                   ["k2", "0.100000", "-2.3e-02", "0.1235"]]
    assert tabular_lab.markdown(["a*", "b|c"], [["x", "KL(pi||pi*)"]]) == (
        "| a\\* | b\\|c |\n|---|---|\n| x | KL(pi\\|\\|pi\\*) |")


def test_chosen_keeps_every_setting_without_only_and_refuses_a_text_in_no_label() -> None:
    """(Mutants: no --only choosing nothing; a TEXT in no label dropped without a word.)"""
    settings = tabular_lab.default_settings()
    assert tabular_lab.chosen(settings, []) == settings
    assert [s.label for s in tabular_lab.chosen(settings, ["k2 in the"])] == ["k2 in the reward", "k2 in the loss"]
    with pytest.raises(SystemExit, match="--only 'no such row': in no setting's label"):
        tabular_lab.chosen(settings, ["k2 in the", "no such row"])


def test_the_committed_lab_run_is_the_labs_defaults() -> None:
    """docs/results/kl_lab.json, which the Ground truth page renders as "the lab", was written by the lab's defaults:
    the same rows in the same order with the same settings, the default Training (32 groups of 8, 500 steps, Adam 0.08
    decayed linearly), the target runs at TARGET_RATES from beta_0 = 0.2, a trace every TARGET_TRACE_EVERY steps.
    (Mutants: a method's field, a Training default, a target rate, a row dropped from default_settings.)"""
    stored = stored_lab()
    settings = tabular_lab.default_settings()
    for table in stored["tables"].values():
        rows = table["rows"][1:]
        assert [row["setting"] for row in rows] == [s.label for s in settings]
        for row, setting in zip(rows, settings):
            assert (row["placement"], row["config"], row["loss_type"], row["scale_rewards"], row["group"]) == (
                setting.placement, setting.config_fields(), setting.loss_type, setting.scale_rewards, setting.group)
        assert table["training"] == {"steps": 500, "groups": 32, "group_size": 8, "learning_rate": 0.08,
                                     "schedule": "linear"} == asdict(Training())
    target = stored["target"]
    assert [run["rate"] for run in target["runs"]] == [0.005, 0.02, 0.1] == list(tabular_lab.TARGET_RATES)
    assert [run["kl_horizon"] for run in target["runs"]] == [256 / rate for rate in (0.005, 0.02, 0.1)]
    assert target["beta_0"] == 0.2 and tabular_lab.TARGET_TRACE_EVERY == 50
    assert all(len(run["betas"]) == 1500 // 50 for run in target["runs"])


def test_the_command_line_reads_env_seeds_the_default_beta_no_target_and_json(tmp_path, monkeypatch) -> None:
    """--env picks one table, --seeds 2 runs seeds 0 and 1 (and says 2), beta is 0.5 when not given (the page's
    "beta = 0.5"), --no-target runs no target experiment, and --json writes what main returns.
    (Mutants: --env ignored; one seed run; the result's seeds 1; default beta 0.4; nothing written.)"""
    monkeypatch.setattr(kl_lab, "target_experiment", lambda *args, **kwargs: pytest.fail("--no-target ran it"))
    path = tmp_path / "lab.json"
    result = kl_lab.main(["--env", "first_a", "--only", "beta = 0 (no KL)", "--seeds", "2", "--steps", "1",
                          "--no-target", "--processes", "1", "--json", str(path)])
    assert list(result["tables"]) == ["first_a"] and result["seeds"] == 2 and "target" not in result
    table = result["tables"]["first_a"]
    assert table["beta"] == 0.5 and table["seeds"] == [0, 1]
    assert json.loads(path.read_text()) == json.loads(json.dumps(result))


def test_a_json_path_that_cannot_be_written_is_refused_before_any_table_and_a_refusal_leaves_no_file(
        tmp_path, monkeypatch, capsys) -> None:
    """--json under a file (a folder that cannot be) was refused only after every table was printed (the write's
    FileNotFoundError) or by os.makedirs' FileExistsError: it is refused first, naming the path and the OS's error, and
    no table runs. A record already there stays as it was until the run writes its own, and a run refused after the
    --json check (--learning-rate 0) leaves no empty record behind.
    (Mutants: the file not opened before the run; the empty file left; an existing record truncated.)"""
    monkeypatch.setattr(kl_lab, "run_table", lambda *args, **kwargs: pytest.fail("a table ran"))
    (tmp_path / "record").write_text("")
    blocked = str(tmp_path / "record" / "lab.json")
    with pytest.raises(SystemExit) as refused:
        kl_lab.main(["--env", "first_a", "--steps", "1", "--no-target", "--processes", "1", "--json", blocked])
    assert refused.value.code == (f"--json={blocked!r} cannot be written (Not a directory): allowed is a file's path "
                                  "that can be")
    assert capsys.readouterr().out == ""
    kept, fresh = tmp_path / "kept.json", tmp_path / "new" / "lab.json"
    kept.write_text('{"earlier": 1}')
    for path in (kept, fresh):
        with pytest.raises(SystemExit, match=r"^--learning-rate=0.0 is invalid"):
            kl_lab.main(["--trainer", "trl", "--learning-rate", "0", "--json", str(path)])
    assert kept.read_text() == '{"earlier": 1}' and not fresh.exists() and fresh.parent.is_dir()


def test_the_findings_print_each_figure_of_its_own_row() -> None:
    """The saturated-reward sentence's later-token KL: k3's then k2's, each kl_ref - kl_ref_first of its own first_a
    row; the target reading's KL(pi||pi*) to 5 decimals (the table's); the scale-group range to 4.
    (Mutants: k3's and k2's swapped; the target's KL to 4 decimals; the range's low end to 3.)"""
    from unsloth_adaptive_kl.tools.tabular_findings import target_reading

    result = stored_lab()

    def row(env: str, setting: str) -> dict:
        return next(r for r in result["tables"][env]["rows"] if r["setting"] == setting)

    for name in ("k3 in the loss", "k2 in the loss"):  # make the two rows' later-token KL differ, and first_a closer
        for env, value in (("contains_a", 0.02), ("first_a", 0.001)):
            set_figure(result, env, name, "kl_opt", value)
    set_figure(result, "first_a", "k3 in the loss", "kl_ref_first", row("first_a", "k3 in the loss")["kl_ref"] - 0.0123)
    set_figure(result, "first_a", "k2 in the loss", "kl_ref_first", row("first_a", "k2 in the loss")["kl_ref"] - 0.0456)
    assert "k3 0.0123, k2 0.0456; a per-token estimator" in finding(result, "**With the reward saturated")
    grouped = [0.1234, 0.2345]
    for value, loss_type in zip(grouped, ("dapo", "grpo")):
        setting = f"k1_future in the loss, {loss_type}, scale group"
        for env in ("contains_a", "first_a"):
            set_figure(result, env, setting, "kl_opt", value)
    for env in ("contains_a", "first_a"):
        set_figure(result, env, "k1_future in the loss, dr_grpo, scale group", "kl_opt", 0.2)
    assert "0.1234 to 0.2345" in finding(result, "**k1_future in the loss**")
    run = {"rate": 0.02, "betas": [0.2, 0.5], "final_beta": 0.5, "kl_opt": 7.3e-05}
    (reading,) = target_reading({"beta_star": 0.5, "training": {"steps": 100}, "runs": [run]})
    assert reading.endswith("(KL(pi||pi\\*) 0.00007).")


def test_the_kl_loss_gets_this_batchs_token_count_and_max_length(monkeypatch) -> None:
    """dapo's token_normalizer is the number of tokens in the batch the KL term is taken over (the mask's sum), and
    dr_grpo's max_completion_length the environment's max_length (4). (Mutant: the token count plus one.)"""
    seen = []

    class Recording(tabular_lab.AdaptiveKL):
        def kl_loss(self, logps, ref, mask, **divisors):
            seen.append((float(mask.sum()), divisors))
            return super().kl_loss(logps, ref, mask, **divisors)

    monkeypatch.setattr(tabular_lab, "AdaptiveKL", Recording)
    tree = Tree(ENVIRONMENTS["contains_a"])
    train(tree, Setting("k3", loss_type="dapo"), 0.1, replace(TRAINING, steps=2), seed=0)
    train(tree, Setting("k3", loss_type="dr_grpo"), 0.1, replace(TRAINING, steps=2), seed=0)
    assert [divisors for _, divisors in seen[2:]] == [{"max_completion_length": 4}] * 2
    assert all(float(divisors["token_normalizer"]) == tokens for tokens, divisors in seen[:2])


def test_the_target_runs_beta_over_the_second_half_and_horizon(monkeypatch) -> None:
    """target_experiment's row from a run's trace: kl_horizon = completions per step / rate, 'beta over the second
    half' the least and largest of the trace's second half, KL(pi||pi*) to pi* of beta. A stand-in run with a known
    trace. (Mutant: the tail from the first quarter on.)"""
    tree = Tree(ENVIRONMENTS["contains_a"])
    star = optimum(tree, 0.5)

    def fake_train(tree_, setting, beta, training, seed, trace_every=0):
        assert beta == 0.2 and trace_every == 50
        return tabular_lab.Run(Figures.of(tree, star, beta), 0.5, star, [0.2, 0.9, 0.45, 0.51, 0.49, 0.52, 0.5, 0.48])

    monkeypatch.setattr(tabular_lab, "train", fake_train)
    result = tabular_lab.target_experiment(tree.env, 0.5, replace(TRAINING, steps=8), rates=(0.02,))
    (run,) = result["runs"]
    assert run["kl_horizon"] == 256 / 0.02 and (run["beta_tail_min"], run["beta_tail_max"]) == (0.48, 0.52)
    assert run["kl_opt"] == 0.0


def test_a_kl_to_the_optimum_of_one_in_ten_thousand_shows() -> None:
    """Only KL(pi||pi*) below 5e-5 reads 0; 1e-4 reads 0.0001. (Mutant: the threshold 5e-4.)"""
    row = {"setting": "s", "group": "g", "beta_trained": 0.5, "reward": 0.9, "length": 3.0, "kl_ref": 0.5,
           "kl_opt": 1e-4, "kl_opt_spread": 0.0, "objective": 0.65, "regret": 0.0}
    assert tabular_lab.table_rows({"rows": [row]})[0][1][0][5] == "0.0001"


def test_at_most_keeps_a_value_already_at_two_significant_digits() -> None:
    """The findings' bound, rounded up at the second significant digit: a value with two digits stays as it is (in
    binary floats 0.14 / 0.001 is 140.00000000000003, which a ceil took to 0.15), one with more goes up a unit."""
    from unsloth_adaptive_kl.tools.tabular_findings import _at_most

    assert [_at_most(v) for v in (0.14, 1e-05, 2.5e-06, 2.14e-06, 0.1401, 99.0, 0.0)] == [
        "0.14", "1e-05", "2.5e-06", "2.2e-06", "0.15", "99", "0"]


# ----- from a mutation audit of tabular_findings.py: each verdict's threshold and reading, where the committed figures
# agree in both environments and sit far from every threshold, so that a changed rule reads the same words on them


def test_a_kl_to_the_optimum_below_1e_3_is_on_it_below_0_05_near_it_and_else_far() -> None:
    """KL(pi||pi*) below 1e-3 in both environments "lands on" pi*, below 0.05 "ends near" it, else "ends far from" it:
    one k1-valued row at 0.0015 makes k1 in the reward end near (at most 0.0015); k3 in the loss at 0.0009, 0.0015
    and 0.07 in both environments lands on, ends near and ends far. (Mutants: EXACT 2e-3; NEAR 0.1.)"""
    result = stored_lab()
    set_figure(result, "contains_a", "k1_future in the reward", "kl_opt", 0.0015)
    k1 = finding(result, "**k1 in the reward")
    assert k1.startswith("**k1 in the reward ends near \\( \\pi^*_\\beta \\)**") and "is at most 0.0015." in k1
    k3 = "**k3 in the loss (verl's; TRL's and Unsloth's without the importance ratio) "
    for value, where in ((0.0009, "lands on"), (0.0015, "ends near"), (0.07, "ends far from")):
        for env in ("contains_a", "first_a"):
            set_figure(result, env, "k3 in the loss", "kl_opt", value)
        assert finding(result, "**k3 in the loss").startswith(f"{k3}{where} \\( \\pi^*_\\beta \\)**"), value


def test_k1_future_summed_is_on_the_frontier_only_below_0_01_in_both_environments() -> None:
    """k1_future with `sequence_sum` is "on the frontier" when its frontier regret is below 0.01 in both environments:
    0.0099 in both is, 0.015 in both is not, nor 0.02 in contains_a beside 0.0004 in first_a. The scale-group range is
    that of the three k1_future `scale group` rows (0.3 to 0.4 here), not of the `scale none` ones.
    (Mutants: FRONTIER 0.02; the least environment's regret instead of the largest; the range from `scale none`.)"""
    result = stored_lab()
    summed = "k1_future in the loss, sequence_sum"
    for regrets, on in (((0.0099, 0.0099), True), ((0.015, 0.015), False), ((0.02, 0.0004), False)):
        for env, regret in zip(("contains_a", "first_a"), regrets):
            set_figure(result, env, summed, "regret", regret)
        sentence = finding(result, "**k1_future in the loss**")
        shown = f"(regret {regrets[0]:.4f} and {regrets[1]:.4f})"
        assert f"\\( \\pi^*_\\beta \\){', on the frontier' if on else ''} {shown}" in sentence, regrets
    for loss_type, value in (("dr_grpo", 0.3), ("dapo", 0.35), ("grpo", 0.4)):
        for env in ("contains_a", "first_a"):
            set_figure(result, env, f"k1_future in the loss, {loss_type}, scale group", "kl_opt", value)
            if loss_type != "dr_grpo":  # dr_grpo with `scale none` is the row "k1_future in the loss"
                set_figure(result, env, f"k1_future in the loss, {loss_type}, scale none", "kl_opt", 0.0001)
    assert "the KL term is not ([the scale relation](#the-scale-relation-what-a-loss-side-beta-means)): 0.3000 to " \
           "0.4000." in finding(result, "**k1_future in the loss**")


def test_the_adaptive_methods_end_within_the_frontier_bound_only_if_every_row_does() -> None:
    """The adaptive methods' regret is the largest of `clip`'s, `dynamic`'s and `target`'s rows (loss and reward, both
    environments): below 0.01 each ends "within" it of the frontier, else "up to" it. One target row at 0.02, or one
    clip row at 0.015, is "up to"; the largest at 0.0095 is "within 0.0095". (Mutants: the least row's regret; target
    left out; FRONTIER 0.02.)"""
    up_to = "each ends up to {} from the reward-KL frontier. "
    for env, setting, regret, expected in (
            ("first_a", "target in the loss", 0.02, up_to.format("0.0200")),
            ("contains_a", "clip in the reward", 0.015, up_to.format("0.0150")),
            ("first_a", "dynamic in the loss", 0.0095, "each ends within 0.0095 of the reward-KL frontier rather")):
        result = stored_lab()
        set_figure(result, env, setting, "regret", regret)  # the committed methods' rows: at most 0.0012
        assert expected in finding(result, "**The adaptive methods"), setting


def test_clip_and_dynamic_grow_and_sigmoid_weakens_only_in_every_row() -> None:
    """`clip` and `dynamic` "let the KL to the reference grow" only when every one of their rows ends above the
    optimum's KL to the reference: one dynamic row at 0.300 (the optimum's 0.473) and they "end at" a range from 0.300.
    Sigmoid in the reward "weakens the penalty" only when above the optimum's in both environments: at 0.300 and 1.200
    it does not (contains_a's optimum: 0.447). (Mutants: dynamic left out of the rows that grow; `any` environment.)"""
    result = stored_lab()
    set_figure(result, "first_a", "dynamic in the reward", "kl_ref", 0.3)
    assert "`clip` and `dynamic` end at a KL to the reference of 0.300 to " in finding(result, "**The adaptive methods")
    result = stored_lab()
    set_figure(result, "contains_a", "sigmoid in the reward", "kl_ref", 0.3)
    set_figure(result, "first_a", "sigmoid in the reward", "kl_ref", 1.2)
    assert finding(result, "**The adaptive methods").endswith(
        "in the reward the KL to the reference ends at 0.300 and 1.200.")
    set_figure(result, "contains_a", "sigmoid in the reward", "kl_ref", 0.5)
    assert finding(result, "**The adaptive methods").endswith(
        "ends at 0.500 and 1.200, above the optimum's: shaping k1's signed values weakens the penalty.")


def test_means_lengthen_and_normalisation_shortens_only_in_both_environments() -> None:
    """The title says "lengthen, shortens" only when the per-completion mean in the reward ends longer than the optimum
    (2.721 and 2.494) and length_normalized shorter, each in both environments; one environment the other way and the
    title only says they move the length. (Mutants: `any` environment, for either.)"""
    lengthen = "**Per-completion means lengthen, length normalisation shortens**"
    move = "**Per-completion means and length normalisation move the length**"
    for mean, normalized, title in (((3.0, 2.6), (2.2, 2.1), lengthen), ((3.0, 2.4), (2.2, 2.1), move),
                                    ((3.0, 2.6), (2.8, 2.1), move)):
        result = stored_lab()
        for env, m, n in zip(("contains_a", "first_a"), mean, normalized):
            set_figure(result, env, "k1 in the reward, sequence_mean", "length", m)
            set_figure(result, env, "length_normalized in the loss", "length", n)
        sentence = finding(result, "**Per-completion")
        assert sentence.startswith(f"{title}: with the optimum's E[length] at 2.721 and 2.494"), (mean, normalized)
        assert f"(`sequence_mean`) ends at {mean[0]:.3f} and {mean[1]:.3f}" in sentence


def test_k1_in_the_loss_does_not_regularise_only_above_no_kl_in_both_environments() -> None:
    """"k1 in the loss does not regularise" when its KL to the reference ends at or above no KL's in both
    environments; below it in one (1.000 against 1.600) and the title says nothing of it. (Mutant: always "held".)"""
    result = stored_lab()
    for env, off in (("contains_a", 1.5), ("first_a", 1.6)):
        set_figure(result, env, "beta = 0 (no KL)", "kl_ref", off)
    set_figure(result, "contains_a", "k1 in the loss", "kl_ref", 2.0)
    set_figure(result, "first_a", "k1 in the loss", "kl_ref", 1.0)
    assert finding(result, "**k1 in the loss").startswith(
        "**k1 in the loss**: its expected gradient is zero on-policy; the KL to the reference ends at 2.000 and 1.000, "
        "against 1.500 and 1.600 with no KL.")
    set_figure(result, "first_a", "k1 in the loss", "kl_ref", 1.7)
    assert finding(result, "**k1 in the loss").startswith("**k1 in the loss does not regularise**: ")


def test_the_per_token_estimators_are_apart_only_beyond_three_times_k1_future() -> None:
    """An environment is named where k3's and k2's KL(pi||pi*) in the loss both exceed three times k1_future's: at 2.5
    times (0.01 against 0.004) none is; at 0.01 against 0.003 contains_a is. (Mutant: two times.)"""
    result = stored_lab()
    for env, (k3, k2, future) in (("contains_a", (0.01, 0.012, 0.004)), ("first_a", (0.002, 0.0025, 0.001))):
        for setting, value in (("k3 in the loss", k3), ("k2 in the loss", k2), ("k1_future in the loss", future)):
            set_figure(result, env, setting, "kl_opt", value)
    sentence = finding(result, "**k3 in the loss")
    assert sentence.endswith("k1_future, which adds the KL of the tokens that follow, 0.0040 and 0.0010. ")
    set_figure(result, "contains_a", "k1_future in the loss", "kl_opt", 0.003)
    assert "0.0030 and 0.0010. In contains_a the per-token estimators end more than three times as far as k1_future" \
        in finding(result, "**k3 in the loss")


def test_first_a_is_closer_only_where_both_per_token_estimators_are() -> None:
    """"closer to pi*" in first_a than in contains_a only when k3's and k2's KL(pi||pi*) in the loss are both smaller in
    first_a: k3 at 0.0200 there against 0.0090 reads "no closer", and the sentence ends at the figures.
    (Mutant: "closer" whenever first_a's KL is at most 1.)"""
    result = stored_lab()
    for setting, (contains_a, first_a) in (("k3 in the loss", (0.009, 0.02)), ("k2 in the loss", (0.02, 0.0005))):
        set_figure(result, "contains_a", setting, "kl_opt", contains_a)
        set_figure(result, "first_a", setting, "kl_opt", first_a)
    assert finding(result, "**With the reward saturated").endswith(
        "end no closer to \\( \\pi^*_\\beta \\) than in contains_a: k3 0.0090 and 0.0200, k2 0.0200 and 0.0005.")
    set_figure(result, "first_a", "k3 in the loss", "kl_opt", 0.001)
    assert "end closer to \\( \\pi^*_\\beta \\) than in contains_a: k3 0.0090 and 0.0010, k2 0.0200 and 0.0005 (the " \
        in finding(result, "**With the reward saturated")


def test_the_saturated_reward_sentence_reads_trls_defaults_row_and_its_two_neighbours() -> None:
    """first_a: the row of TRL's defaults is "k3+ in the loss, dapo, scale group"; it over-optimises when its E[r]
    exceeds the optimum's by more than 0.05, "and the length follows" only when its E[length] is above the optimum's
    too; the later tokens "stay at the reference's" when they carry under 1 % of its KL to the reference (0.015 of 2.0:
    0.75 %), not at 5 % (0.005 of 0.1). Beside it: k3+ with `scale_rewards="none"` and k1 in the reward with
    `scale_rewards="group"`, each its own row's figures. (Mutants: the verdict ignores the length; the share compared
    with 0.01 itself; HELD 0.1; k3 for k3+, or `scale none` for `scale group`, beside it; TRL_DEFAULTS k3's row.)"""
    from unsloth_adaptive_kl.tools.tabular_findings import saturated_length

    result = stored_lab()
    for setting, figures in (
            ("the optimum pi*", {"reward": 0.7, "length": 2.5}), ("beta = 0 (no KL)", {"length": 2.9}),
            ("k3+ in the loss, dapo, scale group", {"reward": 0.95, "length": 2.2, "kl_ref": 0.1,
                                                    "kl_ref_first": 0.095, "kl_opt": 0.25}),
            ("k3+ in the loss, dapo, scale none", {"reward": 0.7123, "length": 2.5432, "kl_opt": 0.0123}),
            ("k1 in the reward, dapo, scale group", {"reward": 0.9111, "length": 2.8222, "kl_opt": 0.3333})):
        for column, value in figures.items():
            set_figure(result, "first_a", setting, column, value)
    sentence = saturated_length(result)
    assert sentence.startswith("**Once the reward saturates, TRL's defaults over-optimise it (first_a)**:")
    for part in ("E[r] ends at 0.950 against the optimum's 0.700, and E[length] at 2.200 against the optimum's 2.500 "
                 "(2.900 with no KL at all, a run with no fixed point), KL(pi||pi\\*) 0.2500.",
                 "of its KL(pi||pi_ref) 0.1000, the first token carries 0.0950 and the tokens after it 0.0050: the "
                 "continuations move from the reference's too.",
                 "the same term ends at E[r] 0.712 and E[length] 2.543 (KL(pi||pi\\*) 0.0123); k1 in the reward, with "
                 "TRL's defaults otherwise, at E[r] 0.911 and E[length] 2.822 (KL(pi||pi\\*) 0.3333)."):
        assert part in sentence, part
    for column, value in (("length", 2.6), ("kl_ref", 2.0), ("kl_ref_first", 1.985)):
        set_figure(result, "first_a", "k3+ in the loss, dapo, scale group", column, value)
    sentence = saturated_length(result)
    assert sentence.startswith("**Once the reward saturates, TRL's defaults over-optimise it, and the length follows "
                               "(first_a)**:")
    assert ("of its KL(pi||pi_ref) 2.0000, the first token carries 1.9850 and the tokens after it 0.0150: the "
            "continuations stay at the reference's, where the term holds them.") in sentence


def test_a_pair_of_figures_reads_contains_a_then_first_a_to_three_decimals() -> None:
    """Every pair of figures reads "contains_a and first_a", three decimals unless a finding asks for more; a count
    of none is plural. (Mutants: the environments reversed; four decimals by default; "0 run".)"""
    from unsloth_adaptive_kl.tools.tabular_findings import counted

    result = stored_lab()
    set_figure(result, "contains_a", "k1 in the reward", "length", 2.7251)  # the optimum's 2.7214 and 2.4940:
    set_figure(result, "first_a", "k1 in the reward", "length", 2.4987)  # within 0.01 of it
    assert "E[length] 2.725 and 2.499, the optimum's." in finding(result, "**k1 in the reward")
    assert counted(0, "run") == "0 runs"
