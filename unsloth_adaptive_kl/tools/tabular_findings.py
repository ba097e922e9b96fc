"""What the KL lab's tables show, as sentences whose every figure is computed from the lab's JSON
(`docs/results/kl_lab.json`): the Ground truth page renders them, so a re-run that changes a figure changes the
sentence, and a finding the new figures no longer support changes its words.

`findings(result)` reads both environments' tables; `target_reading(result)` reads the `target` runs. A row is named by
its setting label, as `tabular_lab.default_settings` writes it.
"""

from __future__ import annotations

from decimal import ROUND_CEILING, Decimal
from typing import Any, Callable, Sequence

from . import tabular_lab
from .tabular_lab import TARGET_TRACE_EVERY

ENVIRONMENTS = tuple(tabular_lab.ENVIRONMENTS)  # contains_a, first_a: the order every "x and y" pair reads
OFF = "beta = 0 (no KL)"
OPTIMUM = "the optimum pi*"
K1_VALUED = ("k1", "k1+", "k1_future")  # the estimators whose value is the log-ratio
K3_FAMILY = ("k2", "k3", "k3+", "low_var_kl", "k3_bottom_percentile")
OFF_FRONTIER = 0.05  # a frontier regret above this is named
FRONTIER = 0.01  # a frontier regret below this is "on the frontier"
EXACT, NEAR = 1e-3, 0.05  # KL(pi||pi*) below EXACT: on pi*; below NEAR: near it
SETTLED = 0.05  # target: beta within 5 % of beta*


def _row(result: dict[str, Any], environment: str, setting: str) -> dict[str, Any]:
    return next(row for row in result["tables"][environment]["rows"] if row["setting"] == setting)


def _each(result: dict[str, Any], setting: str, column: str, digits: int = 3) -> str:
    """'0.447 and 0.473': the column in contains_a and first_a."""
    return " and ".join(f"{_row(result, env, setting)[column]:.{digits}f}" for env in ENVIRONMENTS)


def span(values: Sequence[float], show: Callable[[float], str] = "{:.3f}".format) -> str:
    """'2.092 to 2.389', or one figure where the lowest and the highest show the same (`show`: three decimals)."""
    low, high = show(min(values)), show(max(values))
    return low if low == high else f"{low} to {high}"


def counted(number: int, noun: str) -> str:
    """'1 run', '2 runs'."""
    return f"{number} {noun}{'' if number == 1 else 's'}"


def names_in_code(names: Sequence[str]) -> str:
    """"`a`", "`a` and `b`", "`a`, `b` and `c`"."""
    quoted = [f"`{name}`" for name in names]
    return quoted[0] if len(quoted) == 1 else ", ".join(quoted[:-1]) + " and " + quoted[-1]


def _at_most(value: float) -> str:
    """`value` rounded up to two significant digits: a bound that holds ('at most 2.2e-06' for 2.14e-06). In decimal,
    from the value as printed: in binary floats 0.14 / 0.001 is 140.00000000000003, whose ceil would say 0.15."""
    if value <= 0:
        return "0"
    exact = Decimal(repr(value))
    return f"{float(exact.quantize(Decimal(1).scaleb(exact.adjusted() - 1), ROUND_CEILING)):.2g}"


def _where(result: dict[str, Any], setting: str) -> str:
    """Where a setting ends against pi*_beta, from its KL(pi||pi*) in both environments: on it, near it, or far."""
    values = [_row(result, env, setting)["kl_opt"] for env in ENVIRONMENTS]
    return "lands on" if max(values) < EXACT else "ends near" if max(values) < NEAR else "ends far from"


def findings(result: dict[str, Any]) -> list[str]:
    """The Ground truth page's "What the tables show", from the lab's result (both environments). Every figure
    reads "contains_a and first_a" where two are given; every verdict (on, near, far, grows, shortens) is the
    comparison of the figures beside it."""
    rows = {env: result["tables"][env]["rows"] for env in ENVIRONMENTS}
    optimum = {env: _row(result, env, OPTIMUM) for env in ENVIRONMENTS}
    off = {env: _row(result, env, OFF) for env in ENVIRONMENTS}
    out = []

    k1_rows = [row for env in ENVIRONMENTS for row in rows[env] if row.get("placement") == "reward"
               and row["setting"].split(" in the reward")[0] in K1_VALUED and "sequence_mean" not in row["setting"]]
    worst = max(row["kl_opt"] for row in k1_rows)
    k1_length = all(abs(_row(result, env, "k1 in the reward")["length"] - optimum[env]["length"]) < 0.01
                    for env in ENVIRONMENTS)
    loss_types = names_in_code(list(dict.fromkeys(row["loss_type"] for row in k1_rows)))
    scalings = names_in_code(list(dict.fromkeys(row["scale_rewards"] for row in k1_rows)))
    out.append(f"**k1 in the reward {'lands on' if worst < EXACT else 'ends near'} \\( \\pi^*_\\beta \\)**: in all "
               f"{len(k1_rows)} of its rows (both environments; the loss types {loss_types}, the reward scalings "
               f"{scalings}; `k1+` and "
               f"`k1_future`, which have k1's value, alike) KL(pi||pi\\*) is at most {_at_most(worst)}. It is the "
               "reward placement's default estimator: `kl_estimator=None` resolves to `k1` there, with the summed "
               f"KL of each completion (`sequence_sum`): E[length] {_each(result, 'k1 in the reward', 'length')}"
               + (", the optimum's." if k1_length else f" (the optimum's: {_each(result, OPTIMUM, 'length')})."))

    def reward(name: str, env: str) -> dict[str, Any]:
        return _row(result, env, f"{name} in the reward")

    grows = [name for name in K3_FAMILY
             if all(reward(name, env)["kl_ref"] >= off[env]["kl_ref"] for env in ENVIRONMENTS)]
    if grows:
        kls = {env: [reward(name, env)["kl_ref"] for name in grows] for env in ENVIRONMENTS}
        lengths = {env: [reward(name, env)["length"] for name in grows] for env in ENVIRONMENTS}
        shorter = all(max(lengths[env]) < optimum[env]["length"] for env in ENVIRONMENTS)
        rewards = [reward(name, env)["reward"] for name in grows for env in ENVIRONMENTS]
        kl_spans = "; ".join(f"{env}: {span(kls[env])} against {off[env]['kl_ref']:.3f}" for env in ENVIRONMENTS)
        length = "; ".join(f"{env}: {span(lengths[env])} against the optimum's {optimum[env]['length']:.3f}"
                           for env in ENVIRONMENTS)
        out.append(f"**{names_in_code(grows)} in the reward do not regularise**: the KL to the reference ends above "
                   f"that of no KL at all ({kl_spans}), E[r] at {span(rewards)}. As a reward their "
                   "score-function gradient is not the KL's gradient (their value is not the log-ratio). "
                   + (f"They shorten completions (every extra token adds \\( k \\geq 0 \\) to the summed penalty: "
                      f"E[length] {length}), which is why a length curve alone does not reveal it. " if shorter else
                      f"E[length]: {length}. ")
                   + "An explicit one there warns (`KLEstimatorWarning`).")
    for name in (name for name in K3_FAMILY if name not in grows):
        setting = f"{name} in the reward"
        out.append(f"**`{name}` in the reward {_where(result, setting)} \\( \\pi^*_\\beta \\)**: KL(pi||pi\\*) "
                   f"{_each(result, setting, 'kl_opt', 4)}, at a KL to the reference of "
                   f"{_each(result, setting, 'kl_ref')} (no KL at all: {_each(result, OFF, 'kl_ref')}) and E[r] "
                   f"{_each(result, setting, 'reward')}. It warns (`KLEstimatorWarning`).")

    k1_loss = "k1 in the loss"
    held = all(_row(result, env, k1_loss)["kl_ref"] >= off[env]["kl_ref"] for env in ENVIRONMENTS)
    out.append(f"**k1 in the loss{' does not regularise' if held else ''}**: its expected gradient is zero "
               f"on-policy; the KL to the reference ends at {_each(result, k1_loss, 'kl_ref')}, against "
               f"{_each(result, OFF, 'kl_ref')} with no KL. It warns.")

    k3, k2, future = "k3 in the loss", "k2 in the loss", "k1_future in the loss"
    apart = [env for env in ENVIRONMENTS if min(_row(result, env, k3)["kl_opt"], _row(result, env, k2)["kl_opt"])
             > 3 * _row(result, env, future)["kl_opt"]]
    out.append(f"**k3 in the loss (verl's; TRL's and Unsloth's without the importance ratio) {_where(result, k3)} "
               f"\\( \\pi^*_\\beta \\)**: KL(pi||pi\\*) {_each(result, k3, 'kl_opt', 4)}; k2 (= k3+ = k1+ = the "
               "k3 TRL and Unsloth compute by default, bias-corrected by the importance ratio: on-policy one "
               f"gradient) {_each(result, k2, 'kl_opt', 4)}; k1_future, which adds the KL of the "
               f"tokens that follow, {_each(result, future, 'kl_opt', 4)}. "
               + (f"In {' and '.join(apart)} the per-token estimators end more than three times as far as k1_future: "
                  "a per-token loss misses the KL of the tokens that follow (Tang & Munos, 2025), so the claim that "
                  "on-policy \"k2 as loss\" has the gradient of \"k1 in the reward\" holds per token, not for a "
                  "completion." if apart else ""))

    constant = ("k1_future in the loss", "k1_future in the loss, dapo, scale none")
    by_length = ("k1_future in the loss, grpo, scale none", "k1_future in the loss, sequence_mean")
    grouped = [row["kl_opt"] for env in ENVIRONMENTS for row in rows[env]
               if row["setting"].startswith("k1_future in the loss,") and row["setting"].endswith("scale group")]
    summed = "k1_future in the loss, sequence_sum"
    exact = max(_row(result, env, setting)["kl_opt"] for setting in constant for env in ENVIRONMENTS)
    moved = min(_row(result, env, setting)["kl_opt"] for setting in by_length for env in ENVIRONMENTS)
    frontier = max(_row(result, env, summed)["regret"] for env in ENVIRONMENTS) < FRONTIER
    out.append("**k1_future in the loss** (`kl_estimator=\"k1_future\"`: the value of k1 per token, the gradient "
               "\\( \\operatorname{sg}\\big(\\sum_{s \\ge t} m_s k_{1,s}\\big)\\, \\nabla \\log \\pi_t \\), the "
               "KL-to-go, which sums to the whole completion's reverse-KL gradient) ends at most "
               f"{_at_most(exact)} from \\( \\pi^*_\\beta \\) with `scale_rewards=\"none\"` where its reduction "
               "weighs every completion as the policy gradient's does (`dr_grpo`'s `max_length_mean`, `dapo`'s token "
               "sum over a fixed count within a step). A reduction that divides each completion by its own length "
               f"(`grpo`, `sequence_mean`) moves the fixed point: {moved:.4f} or more. With `scale_rewards=\"group\"` "
               "(TRL's default) the advantages are divided by each group's reward spread and the KL term is not "
               f"([the scale relation](#the-scale-relation-what-a-loss-side-beta-means)): {min(grouped):.4f} to "
               f"{max(grouped):.4f}. `kl_reduction=\"sequence_sum\"` is not divided by the policy gradient's "
               f"normaliser, so it acts as a larger beta: it ends {_each(result, summed, 'kl_opt', 4)} from "
               f"\\( \\pi^*_\\beta \\){', on the frontier' if frontier else ''} (regret "
               f"{_each(result, summed, 'regret', 4)}), at a KL to the reference of {_each(result, summed, 'kl_ref')}. "
               "Shaping (`clip`, `sigmoid`) changes the value the KL-to-go sums, so a shaped k1_future is no longer "
               "the exact gradient.")

    mean_reward, normalized = "k1 in the reward, sequence_mean", "length_normalized in the loss"
    longer = all(_row(result, env, mean_reward)["length"] > optimum[env]["length"] for env in ENVIRONMENTS)
    shorter = all(_row(result, env, normalized)["length"] < optimum[env]["length"] for env in ENVIRONMENTS)
    title = ("Per-completion means lengthen, length normalisation shortens" if longer and shorter
             else "Per-completion means and length normalisation move the length")
    out.append(f"**{title}**: with the optimum's E[length] at {_each(result, OPTIMUM, 'length')}, a per-completion "
               f"mean of the KL in the reward (`sequence_mean`) ends at {_each(result, mean_reward, 'length')} "
               f"(KL(pi||pi\\*) {_each(result, mean_reward, 'kl_opt', 4)}), and `length_normalized` in the loss at "
               f"{_each(result, normalized, 'length')} (KL(pi||pi\\*) {_each(result, normalized, 'kl_opt', 4)}).")

    methods = [(env, row) for env in ENVIRONMENTS for row in rows[env] if row["group"].startswith("methods")
               and row["setting"].split(" in the ")[0] in ("clip", "dynamic", "target")]
    grown = [(env, row) for env, row in methods if row["setting"].split(" in the ")[0] in ("clip", "dynamic")]
    grew = all(row["kl_ref"] > optimum[env]["kl_ref"] for env, row in grown)
    regret = max(row["regret"] for _, row in methods)
    sigmoid_reward = "sigmoid in the reward"
    weaker = all(_row(result, env, sigmoid_reward)["kl_ref"] > optimum[env]["kl_ref"] for env in ENVIRONMENTS)
    out.append(f"**The adaptive methods trade the objective for something else**: `clip` and `dynamic` "
               f"{'let the KL to the reference grow to' if grew else 'end at a KL to the reference of'} "
               f"{min(row['kl_ref'] for _, row in grown):.3f} to {max(row['kl_ref'] for _, row in grown):.3f} (the "
               f"optimum's: {_each(result, OPTIMUM, 'kl_ref')}; dynamic's `reward_threshold` is set below the "
               f"optimum's reward so that it acts), `target` ends at {_each(result, 'target in the loss', 'kl_ref')} "
               f"in the loss and {_each(result, 'target in the reward', 'kl_ref')} in the reward; each ends "
               + (f"within {_at_most(regret)} of the reward-KL frontier rather than at \\( \\pi^*_\\beta \\), which "
                  "is what they are for. " if regret < FRONTIER else f"up to {regret:.4f} from the reward-KL "
                  "frontier. ")
               + f"`sigmoid` in the loss {_where(result, 'sigmoid in the loss')} \\( \\pi^*_\\beta \\) "
               f"({_each(result, 'sigmoid in the loss', 'kl_opt', 4)}); in the reward the KL to the reference ends "
               f"at {_each(result, sigmoid_reward, 'kl_ref')}"
               + (", above the optimum's: shaping k1's signed values weakens the penalty." if weaker else "."))

    for env in ENVIRONMENTS:
        outliers = sorted((row for row in rows[env] if row["regret"] > OFF_FRONTIER), key=lambda row: -row["regret"])
        rest = max(row["regret"] for row in rows[env] if row["regret"] <= OFF_FRONTIER)
        named = "; ".join(f"{row['setting']} {row['regret']:.4f}" for row in outliers)
        out.append(f"**Off the frontier ({env})**: " + (
            f"{named} (frontier regret): they spend KL without buying reward with it; every other setting ends "
            f"within {_at_most(rest)} of the frontier." if outliers else
            f"no setting's frontier regret exceeds {OFF_FRONTIER:g}; the largest is {rest:.4f}."))

    out.append(saturated_length(result))
    closer = all(_row(result, "first_a", setting)["kl_opt"] < _row(result, "contains_a", setting)["kl_opt"]
                 for setting in (k3, k2))
    after = {name: later_tokens_kl(_row(result, "first_a", name)) for name in (k3, k2)}
    out.append(f"**With the reward saturated and the length free (first_a)**, the per-token estimators in the loss "
               f"end {'closer to' if closer else 'no closer to'} \\( \\pi^*_\\beta \\) than in contains_a: k3 "
               f"{_each(result, k3, 'kl_opt', 4)}, k2 {_each(result, k2, 'kl_opt', 4)}"
               + (" (the reward reads only the first token, and the tokens after it keep almost no KL to the "
                  f"reference: k3 {after[k3]:.4f}, k2 {after[k2]:.4f}; a per-token estimator misses the KL-to-go of "
                  "later tokens, and there is almost none)." if closer else "."))
    return out


TRL_DEFAULTS = "k3+ in the loss, dapo, scale group"  # loss_type, scale_rewards and k3 times the ratio: TRL's defaults
HELD = 0.01  # the tokens after the first carry under this share of the KL to the reference: they stay at the reference


def later_tokens_kl(row: dict[str, Any]) -> float:
    """The tokens after the first's share of a row's KL to the reference (the chain rule: the whole less the first's)."""
    return row["kl_ref"] - row["kl_ref_first"]


def reference_length_after_a(tree: tabular_lab.Tree) -> tuple[float, float]:
    """(E_ref[length | the first token is a], E_ref[length]): the reference's completions that start with a, the one
    token first_a's reward reads, against all of them."""
    p = tree.log_probs(tree.reference_table).double().exp()
    starts_with_a = (tree.token[:, 0] == 0).double()
    lengths = tree.lengths.double()
    return float((p * starts_with_a * lengths).sum() / (p * starts_with_a).sum()), float((p * lengths).sum())


def saturated_length(result: dict[str, Any]) -> str:
    """first_a under TRL's defaults: E[r] and E[length] against the optimum's (and no KL's), where the KL to the
    reference sits (the first token, the one the reward reads, against the tokens after it), and why the length follows
    the first token (the reference's length after a); beside the same term without the group scaling and k1 in the
    reward."""
    env = "first_a"
    best, off, stock, unscaled, in_reward = (_row(result, env, name) for name in (
        OPTIMUM, OFF, TRL_DEFAULTS, "k3+ in the loss, dapo, scale none", "k1 in the reward, dapo, scale group"))
    after = later_tokens_kl(stock)
    after_a, overall = reference_length_after_a(tabular_lab.Tree(tabular_lab.Environment(
        **result["tables"][env]["environment"])))
    over = stock["reward"] > best["reward"] + NEAR
    verdict = ("over-optimise it, and the length follows" if over and stock["length"] > best["length"]
               else "over-optimise it" if over else "hold it near the optimum")
    later = ("the continuations stay at the reference's, where the term holds them" if after < HELD * stock["kl_ref"]
             else "the continuations move from the reference's too")
    return (f"**Once the reward saturates, TRL's defaults {verdict} (first_a)**: with `loss_type=\"dapo\"`, "
            "`scale_rewards=\"group\"` and k3 times the importance ratio (TRL's defaults: the lab's k3+), E[r] ends at "
            f"{stock['reward']:.3f} against the optimum's {best['reward']:.3f}, and E[length] at {stock['length']:.3f} "
            f"against the optimum's {best['length']:.3f} ({off['length']:.3f} with no KL at all, a run with no fixed "
            f"point), KL(pi||pi\\*) {stock['kl_opt']:.4f}. The group scaling makes the term act weaker than its beta "
            "([the scale relation](#the-scale-relation-what-a-loss-side-beta-means)), and the KL the policy gains sits "
            f"where the reward reads: of its KL(pi||pi_ref) {stock['kl_ref']:.4f}, the first token carries "
            f"{stock['kl_ref_first']:.4f} and the tokens after it {after:.4f}: {later}. The length follows the first "
            f"token: under the reference, a completion that starts with a has E[length] {after_a:.3f}, against "
            f"{overall:.3f} over all. With `scale_rewards=\"none\"` the same term ends at E[r] "
            f"{unscaled['reward']:.3f} and E[length] {unscaled['length']:.3f} (KL(pi||pi\\*) "
            f"{unscaled['kl_opt']:.4f}); k1 in the reward, with TRL's defaults otherwise, at E[r] "
            f"{in_reward['reward']:.3f} and E[length] {in_reward['length']:.3f} (KL(pi||pi\\*) "
            f"{in_reward['kl_opt']:.4f}).")


def target_reading(result: dict[str, Any]) -> list[str]:
    """Each `target` run's beta against beta*, from its trace (one beta every `TARGET_TRACE_EVERY` steps, then the
    final one): the step from which it stays within `SETTLED` of beta*, or its range over the second half where it
    never does."""
    star, steps = result["beta_star"], result["training"]["steps"]
    out = []
    for run in result["runs"]:
        betas = [*run["betas"], run["final_beta"]]
        within = [abs(beta / star - 1) <= SETTLED for beta in betas]
        settled = next((index for index in range(len(within)) if all(within[index:])), None)
        start = f"At \\( n/\\mathrm{{kl\\_horizon}} = {run['rate']:g} \\), \\( \\beta \\) "
        if settled is None:
            tail = run["betas"][len(run["betas"]) // 2:]
            out.append(f"{start}never stays within {SETTLED:.0%} of \\( \\beta^* = {star:.3f} \\): over the second "
                       f"half it ranges from {min(tail):.3f} to {max(tail):.3f}, and the policy with it "
                       f"(KL(pi||pi\\*) {run['kl_opt']:.4f} at the end).")
        else:
            out.append(f"{start}stays within {SETTLED:.0%} of \\( \\beta^* = {star:.3f} \\) from step "
                       f"{settled * TARGET_TRACE_EVERY:,} of {steps:,} on and ends at {run['final_beta']:.3f} "
                       f"(KL(pi||pi\\*) {run['kl_opt']:.5f}).")
    return out
