"""What the KL lab's tables show, as sentences whose every figure is computed from the lab's JSON
(`docs/results/kl_lab.json`): the Ground truth page renders them, so a re-run that changes a figure changes the
sentence, and a finding the new figures no longer support changes its words.

`findings(result)` reads both environments' tables; `target_reading(result)` reads the `target` runs. A row is named by
its setting label, as `tabular_lab.default_settings` writes it.
"""

from __future__ import annotations

from typing import Any, Sequence

ENVIRONMENTS = ("contains_a", "first_a")
OFF = "beta = 0 (no KL)"
OPTIMUM = "the optimum pi*"
K1_VALUED = ("k1", "k1+", "k1_future")  # the estimators whose value is the log-ratio
K3_FAMILY = ("k2", "k3", "k3+", "low_var_kl", "k3_bottom_percentile")
OFF_FRONTIER = 0.05  # a frontier regret above this is named
SETTLED = 0.05  # target: beta within 5 % of beta*
TRACE_EVERY = 50  # target: steps between two recorded betas (tabular_lab.target_experiment)


def _row(result: dict[str, Any], environment: str, setting: str) -> dict[str, Any]:
    return next(row for row in result["tables"][environment]["rows"] if row["setting"] == setting)


def _each(result: dict[str, Any], setting: str, column: str, digits: int = 3) -> str:
    """'0.447 and 0.473': the column in contains_a and first_a."""
    return " and ".join(f"{_row(result, env, setting)[column]:.{digits}f}" for env in ENVIRONMENTS)


def _kl_opt(value: float) -> str:
    return "0" if value < 5e-5 else f"{value:.4f}"


def _names(names: Sequence[str]) -> str:
    quoted = [f"`{name}`" for name in names]
    return quoted[0] if len(quoted) == 1 else ", ".join(quoted[:-1]) + " and " + quoted[-1]


def findings(result: dict[str, Any]) -> list[str]:
    """The Ground truth page's "What the tables show", from the lab's result (both environments). Every figure
    reads "contains_a and first_a" where two are given."""
    rows = {env: result["tables"][env]["rows"] for env in ENVIRONMENTS}
    out = []

    k1_rows = [row for env in ENVIRONMENTS for row in rows[env] if row.get("placement") == "reward"
               and row["setting"].split(" in the reward")[0] in K1_VALUED and "sequence_mean" not in row["setting"]]
    worst = max(row["kl_opt"] for row in k1_rows)
    out.append(f"**k1 in the reward {'lands on' if worst < 1e-3 else 'ends near'} \\( \\pi^*_\\beta \\)**: in all "
               f"{len(k1_rows)} of its rows (both environments, every loss type and reward scaling; `k1+` and "
               f"`k1_future`, which have k1's value, alike) KL(pi||pi\\*) is at most {worst:.1e}. It is the "
               "reward placement's default estimator: `kl_estimator=None` resolves to `k1` there.")

    off_kl = {env: _row(result, env, OFF)["kl_ref"] for env in ENVIRONMENTS}
    grows = [name for name in K3_FAMILY if all(_row(result, env, f"{name} in the reward")["kl_ref"] >= off_kl[env]
                                               for env in ENVIRONMENTS)]
    if grows:
        kls = [_row(result, env, f"{name} in the reward")["kl_ref"] for name in grows for env in ENVIRONMENTS]
        rewards = [_row(result, env, f"{name} in the reward")["reward"] for name in grows for env in ENVIRONMENTS]
        lengths = [_row(result, env, f"{name} in the reward")["length"] for name in grows for env in ENVIRONMENTS]
        out.append(f"**{_names(grows)} in the reward do not regularise**: the KL to the reference ends at "
                   f"{min(kls):.3f} to {max(kls):.3f}, above the {_each(result, OFF, 'kl_ref')} of no KL at all, and "
                   f"E[r] at {min(rewards):.3f} to {max(rewards):.3f}. As a reward their score-function gradient is "
                   "not the KL's gradient (their value is not the log-ratio). They shorten completions (every extra "
                   f"token adds \\( k \\geq 0 \\) to the summed penalty: E[length] {min(lengths):.3f} to {max(lengths):.3f} "
                   f"against the optimum's {_each(result, OPTIMUM, 'length')}), which is why a length curve alone "
                   "does not reveal it. An explicit one there warns (`KLEstimatorWarning`).")
    for name in (name for name in K3_FAMILY if name not in grows):
        setting = f"{name} in the reward"
        out.append(f"**`{name}` in the reward** ends at a KL to the reference of {_each(result, setting, 'kl_ref')}"
                   f" (no KL at all: {_each(result, OFF, 'kl_ref')}), E[r] {_each(result, setting, 'reward')}, and "
                   f"KL(pi||pi\\*) {_each(result, setting, 'kl_opt', 4)}: far from the optimum wherever it holds the "
                   "KL down. It warns (`KLEstimatorWarning`).")

    k1_loss = "k1 in the loss"
    held = all(_row(result, env, k1_loss)["kl_ref"] >= off_kl[env] for env in ENVIRONMENTS)
    out.append(f"**k1 in the loss {'does not regularise' if held else 'barely regularises'}**: its expected gradient "
               f"is zero on-policy; the KL to the reference ends at {_each(result, k1_loss, 'kl_ref')}, against "
               f"{_each(result, OFF, 'kl_ref')} with no KL. It warns.")

    k3, k2 = "k3 in the loss", "k2 in the loss"
    out.append(f"**k3 in the loss (TRL's, Unsloth's, verl's) ends near \\( \\pi^*_\\beta \\), not on it**: "
               f"KL(pi||pi\\*) {_each(result, k3, 'kl_opt', 4)}; k2 (= k3+ = k1+ = TRL's bias-corrected k3 "
               f"on-policy, one gradient) {_each(result, k2, 'kl_opt', 4)}. A per-token loss misses the KL of the "
               "tokens that follow (Tang & Munos, 2025), so the claim that on-policy \"k2 as loss\" has the gradient "
               "of \"k1 in the reward\" holds per token, not for a completion.")

    constant = ("k1_future in the loss", "k1_future in the loss, dapo, scale none")
    by_length = ("k1_future in the loss, grpo, scale none", "k1_future in the loss, sequence_mean")
    summed = "k1_future in the loss, sequence_sum"
    exact = max(_row(result, env, setting)["kl_opt"] for setting in constant for env in ENVIRONMENTS)
    moved = min(_row(result, env, setting)["kl_opt"] for setting in by_length for env in ENVIRONMENTS)
    out.append("**k1_future in the loss** (`kl_estimator=\"k1_future\"`: the value of k1 per token, the gradient "
               "\\( \\operatorname{sg}\\big(\\sum_{s \\ge t} m_s k_{1,s}\\big)\\, \\nabla \\log \\pi_t \\), the "
               "KL-to-go, which sums to the whole completion's reverse-KL gradient) ends at most "
               f"{_kl_opt(exact)} from \\( \\pi^*_\\beta \\) where its reduction weighs every completion as the "
               "policy gradient's does (`dr_grpo`'s `max_length_mean`, `dapo`'s token sum over a fixed count within a "
               "step); a reduction that divides each completion by its own length (`grpo`, `sequence_mean`) moves the "
               f"fixed point: {moved:.4f} or more. `kl_reduction=\"sequence_sum\"` weighs every completion alike but "
               "is not divided by the policy gradient's normaliser, so it acts as a larger beta: it ends "
               f"{_each(result, summed, 'kl_opt', 4)} from \\( \\pi^*_\\beta \\), on the frontier (regret "
               f"{_each(result, summed, 'regret', 4)}) at a KL to the reference of {_each(result, summed, 'kl_ref')}. "
               "Shaping (`clip`, `sigmoid`) changes the value the KL-to-go sums, so a shaped k1_future is no longer "
               "the exact gradient.")

    mean_reward, normalized = "k1 in the reward, sequence_mean", "length_normalized in the loss"
    optimum = {env: _row(result, env, OPTIMUM)["length"] for env in ENVIRONMENTS}
    longer = all(_row(result, env, mean_reward)["length"] > optimum[env] for env in ENVIRONMENTS)
    shorter = all(_row(result, env, normalized)["length"] < optimum[env] for env in ENVIRONMENTS)
    title = ("Per-completion means lengthen, length normalisation shortens" if longer and shorter
             else "Per-completion means and length normalisation move the length")
    out.append(f"**{title}**: with the optimum's E[length] at {_each(result, OPTIMUM, 'length')}, a per-completion "
               f"mean of the KL in the reward (`sequence_mean`) ends at {_each(result, mean_reward, 'length')} and "
               f"`length_normalized` in the loss at {_each(result, normalized, 'length')}, each at a KL(pi||pi\\*) "
               f"of {_each(result, mean_reward, 'kl_opt', 4)} and {_each(result, normalized, 'kl_opt', 4)}. A summed "
               "KL (`sequence_sum` in the reward, or the loss types that sum) keeps the optimum's length.")

    methods = [row for env in ENVIRONMENTS for row in rows[env] if row["group"].startswith("methods")
               and row["setting"].split(" in the ")[0] in ("clip", "dynamic", "target")]
    grown = [row["kl_ref"] for row in methods if row["setting"].split(" in the ")[0] in ("clip", "dynamic")]
    out.append(f"**The adaptive methods trade the objective for something else**: `clip` and `dynamic` let the KL to "
               f"the reference grow to {min(grown):.3f} to {max(grown):.3f} (the optimum's: "
               f"{_each(result, OPTIMUM, 'kl_ref')}; dynamic's `reward_threshold` is set below the optimum's reward so "
               f"that it acts), `target` holds it at {_each(result, 'target in the loss', 'kl_ref')} in the loss and "
               f"{_each(result, 'target in the reward', 'kl_ref')} in the reward; each ends within "
               f"{max(row['regret'] for row in methods):.4f} of the reward-KL frontier rather than at "
               "\\( \\pi^*_\\beta \\), which is what they are for. `sigmoid` in the loss ends "
               f"{_each(result, 'sigmoid in the loss', 'kl_opt', 4)} from \\( \\pi^*_\\beta \\); in the reward, "
               "shaping k1's signed values weakens the penalty and the KL to the reference ends at "
               f"{_each(result, 'sigmoid in the reward', 'kl_ref')}.")

    for env in ENVIRONMENTS:
        outliers = sorted((row for row in rows[env] if row["regret"] > OFF_FRONTIER), key=lambda row: -row["regret"])
        rest = max(row["regret"] for row in rows[env] if row["regret"] <= OFF_FRONTIER)
        named = "; ".join(f"{row['setting']} {row['regret']:.4f}" for row in outliers)
        out.append(f"**Off the frontier ({env})**: " + (
            f"{named} (frontier regret): they spend KL without buying reward with it; every other setting ends "
            f"within {rest:.4f} of the frontier." if outliers else
            f"no setting's frontier regret exceeds {OFF_FRONTIER:g}; the largest is {rest:.4f}."))

    closer = all(_row(result, "first_a", setting)["kl_opt"] < _row(result, "contains_a", setting)["kl_opt"]
                 for setting in (k3, k2))
    out.append(f"**With the reward saturated and the length free (first_a)**, the per-token estimators in the loss "
               f"end {'closer to' if closer else 'as far from'} \\( \\pi^*_\\beta \\) than in contains_a: k3 "
               f"{_each(result, k3, 'kl_opt', 4)}, k2 {_each(result, k2, 'kl_opt', 4)} (only the first token "
               "matters there, so there is little KL-to-go to miss).")
    return out


def target_reading(result: dict[str, Any]) -> list[str]:
    """Each `target` run's beta against beta*, from its trace (one beta every `TRACE_EVERY` steps): the step from
    which it stays within `SETTLED` of beta*, or its range over the second half where it never does."""
    star, steps = result["beta_star"], result["training"]["steps"]
    out = []
    for run in result["runs"]:
        betas = run["betas"]
        within = [abs(beta / star - 1) <= SETTLED for beta in betas]
        settled = next((index for index in range(len(within)) if all(within[index:])), None)
        start = f"At \\( n/\\text{{kl\\_horizon}} = {run['rate']:g} \\), \\( \\beta \\) "
        if settled is None:
            tail = betas[len(betas) // 2:]
            out.append(f"{start}never stays within {SETTLED:.0%} of \\( \\beta^* = {star:.3f} \\): over the second "
                       f"half it ranges from {min(tail):.3f} to {max(tail):.3f}, and the policy with it "
                       f"(KL(pi||pi\\*) {run['kl_opt']:.4f} at the end).")
        else:
            out.append(f"{start}stays within {SETTLED:.0%} of \\( \\beta^* = {star:.3f} \\) from step "
                       f"{settled * TRACE_EVERY:,} of {steps:,} on and ends at {run['final_beta']:.3f} "
                       f"(KL(pi||pi\\*) {run['kl_opt']:.5f}).")
    return out
