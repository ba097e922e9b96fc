"""The tabular KL lab, as a library: where each KL setting converges, against the KL-regularised optimum known in
closed form. The command line is tools/kl_lab.py; the lab through a trainer, tools/trainer_lab.py (both import this).

An exact toy. A tabular autoregressive policy over a few tokens and EOS writes completions of at most `max_length`
tokens, so every completion can be enumerated. For a reward r and a reference pi_ref, the optimum of
E_pi[r] - beta * KL(pi || pi_ref) over whole completions is

    pi*_beta(y) = pi_ref(y) * exp(r(y) / beta) / Z,

so after training, the lab computes exactly (by enumeration, not by sampling) E[r], E[length], KL(pi || pi_ref),
KL(pi || pi*_beta), the objective, and the regret on the frontier: the reward the optimum family reaches at the same
KL to the reference, minus the policy's (what an adaptive setting trades; 0 on the frontier).

Training is a GRPO loop that drives the public `AdaptiveKL` exactly as a user's loop does: groups of G completions
sampled from the policy, rewards (minus `reward_penalty` with the KL in the reward), advantages r_i - mean of the group
(divided by the group's std with `scale_rewards="group"`, as TRL does), the policy-gradient loss per token reduced as
TRL's `loss_type` reduces it (dr_grpo, dapo, grpo, bnpo), plus `kl_loss` with the KL in the loss, Adam, then
`step(mean_reward=)`. Any registered estimator, method, reduction and placement runs here.

The scale relation: the group mean includes the sample itself, which scales the policy gradient by (G - 1) / G, while
a KL in the loss keeps its scale: a loss-side beta acts as beta * G / (G - 1) next to the reward. A KL in the reward is
scaled with the rewards, so it is exact at beta. The lab trains loss-side settings at beta * (G - 1) / G (column "beta
trained") unless a setting says otherwise, so that KL(pi || pi*) measures the estimator, not that factor.
`scale_rewards="group"` divides the policy gradient, not a KL in the loss, by each group's reward std (< 1 for rewards
in [0, 1]): a loss-side beta then acts several times weaker than its value; the KL in the reward is divided with the
rewards and keeps its fixed point.

What a tabular lab cannot tell: there is no function approximation (every completion has its own parameters, so
nothing generalises and no setting is helped or hurt by it), one prompt, short completions, on-policy single steps;
real models add sampling noise, off-policy steps and clipping.
"""

from __future__ import annotations

import itertools
import math
import multiprocessing
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch

from ..core import AdaptiveKL, AdaptiveKLConfig, estimate_kl
from ..core.estimators import BUILT_IN_ESTIMATORS
from ..core.reductions import context_read

# ----- environments -------------------------------------------------------------------------------------------------

REWARDS: dict[str, Callable[[tuple[int, ...]], float]] = {
    # 1 when the completion contains token 0 ('a'): a longer completion has more chances, so length helps the reward.
    "contains_a": lambda tokens: float(0 in tokens),
    # 1 when the first token is 'a': saturates at the first token and leaves the length free afterwards, the seed's
    # pathology (what happens to the length is decided by the KL term alone).
    "first_a": lambda tokens: float(len(tokens) > 0 and tokens[0] == 0),
}


@dataclass(frozen=True)
class Environment:
    """A prompt's completions over `tokens` letters and EOS, at most `max_length` tokens each (EOS included), a
    reward, and a reference: logits drawn N(0, reference_scale^2) from `reference_seed`, plus `eos_bias` on EOS."""

    reward: str = "contains_a"
    tokens: int = 2
    max_length: int = 4
    reference_seed: int = 0
    reference_scale: float = 1.0
    eos_bias: float = 0.0

    @property
    def name(self) -> str:
        return self.reward


class Tree:
    """Every completion of an environment, as index tensors into a (nodes, tokens + 1) table of logits.

    A node is a prefix of letters (depth 0 .. max_length - 1); at each node the policy picks a letter or EOS (index
    `tokens`). A completion ends at EOS or after max_length tokens. For completion c and position t:
    node[c, t], token[c, t], mask[c, t]; its length L_c = sum_t mask[c, t] (EOS counted, as trainers count it).
    `reference_table`: the reference's logits at each node (default: drawn as `Environment` says)."""

    def __init__(self, env: Environment, reference_table: Optional[torch.Tensor] = None) -> None:
        self.env = env
        eos = env.tokens
        nodes: dict[tuple[int, ...], int] = {}
        for depth in range(env.max_length):
            for prefix in itertools.product(range(env.tokens), repeat=depth):
                nodes[prefix] = len(nodes)
        completions: list[tuple[int, ...]] = []  # the tokens chosen, EOS included
        for prefix in nodes:
            completions.append(prefix + (eos,))
            if len(prefix) == env.max_length - 1:
                completions.extend(prefix + (letter,) for letter in range(env.tokens))
        self.completions = completions
        self.prefixes = list(nodes)  # the nodes' letters, in the order of a table's rows
        self.num_nodes = len(nodes)
        self.vocab = env.tokens + 1
        shape = (len(completions), env.max_length)
        self.node = torch.zeros(shape, dtype=torch.long)
        self.token = torch.zeros(shape, dtype=torch.long)
        self.mask = torch.zeros(shape)
        for c, tokens in enumerate(completions):
            for t, token in enumerate(tokens):
                self.node[c, t], self.token[c, t], self.mask[c, t] = nodes[tokens[:t]], token, 1.0
        self.lengths = self.mask.sum(-1)
        self.rewards = torch.tensor([REWARDS[env.reward](tuple(x for x in tokens if x != eos)) for tokens in completions])
        if reference_table is None:
            generator = torch.Generator().manual_seed(env.reference_seed)
            reference_table = torch.randn(self.num_nodes, self.vocab, generator=generator) * env.reference_scale
            reference_table[:, eos] += env.eos_bias
        self.reference_table = reference_table

    def token_logps(self, table: torch.Tensor, rows: Optional[torch.Tensor] = None) -> torch.Tensor:
        """(completions, max_length) log-probs of each completion's tokens under a table of logits (0 on padding)."""
        node, token, mask = (self.node, self.token, self.mask) if rows is None else (
            self.node[rows], self.token[rows], self.mask[rows])
        return torch.log_softmax(table, dim=-1)[node, token] * mask

    def log_probs(self, table: torch.Tensor) -> torch.Tensor:
        """log pi(y) of every completion (sums to 1 over completions)."""
        return self.token_logps(table).sum(-1)


# ----- exact quantities ---------------------------------------------------------------------------------------------


def kl(logp: torch.Tensor, logq: torch.Tensor) -> float:
    """KL(p || q) = sum_y p(y) (log p(y) - log q(y)), exactly, in float64 (a y with p(y) = 0 adds 0)."""
    logp, logq = logp.double(), logq.double()
    p = logp.exp()
    return float(torch.where(p > 0, p * (logp - logq), 0.0).sum())


def optimum(tree: Tree, beta: float) -> torch.Tensor:
    """log pi*_beta(y) = log pi_ref(y) + r(y) / beta - log Z, in float64."""
    logits = tree.log_probs(tree.reference_table).double() + tree.rewards.double() / beta
    return logits - torch.logsumexp(logits, 0)


def beta_for_kl(tree: Tree, kl_to_reference: float) -> float:
    """beta* with KL(pi*_beta* || pi_ref) = kl_to_reference, by bisection on log beta in [1e-6, 1e6] (the KL of the
    optimum falls as beta grows): the beta a `target` controller must find, and the frontier's point."""
    reference = tree.log_probs(tree.reference_table)
    low, high = math.log(1e-6), math.log(1e6)
    for _ in range(200):
        middle = 0.5 * (low + high)
        if kl(optimum(tree, math.exp(middle)), reference) > kl_to_reference:
            low = middle
        else:
            high = middle
    return math.exp(0.5 * (low + high))


def frontier_reward(tree: Tree, kl_to_reference: float) -> float:
    """The largest E[r] any policy reaches with KL(pi || pi_ref) <= kl_to_reference: that of pi*_beta* with
    KL(pi*_beta* || pi_ref) = kl_to_reference, or, beyond the KL of beta -> 0 (the reference restricted to the
    completions of the largest reward), that largest reward."""
    reference = tree.log_probs(tree.reference_table)
    best = tree.rewards.max()
    limit = reference.masked_fill(tree.rewards < best, -math.inf)
    if kl_to_reference >= kl(limit - torch.logsumexp(limit, 0), reference):
        return float(best)
    star = optimum(tree, beta_for_kl(tree, kl_to_reference))
    return float((star.exp() * tree.rewards.double()).sum())


def first_token_kl(tree: Tree, logp: torch.Tensor, logq: torch.Tensor) -> float:
    """The first token's share of KL(p || q): the KL of the two first-token marginals. By the chain rule, KL(p || q)
    minus it is E_p[KL of the continuations after the first token], the share of every later token."""
    first = tree.token[:, 0]
    marginal_p, marginal_q = (torch.zeros(tree.vocab, dtype=torch.float64).index_add(0, first, x.double().exp())
                              for x in (logp, logq))
    return float(torch.where(marginal_p > 0, marginal_p * (marginal_p.log() - marginal_q.log()), 0.0).sum())


@dataclass
class Figures:
    """Exact figures of one policy against pi*_beta; kl_ref_first: the first token's share of kl_ref."""

    reward: float
    length: float
    kl_ref: float
    kl_opt: float
    objective: float
    regret: float
    kl_ref_first: float

    @classmethod
    def of(cls, tree: Tree, logp: torch.Tensor, beta: float) -> "Figures":
        logp = logp.double()
        p = logp.exp()
        reference = tree.log_probs(tree.reference_table)
        reward = float((p * tree.rewards.double()).sum())
        kl_ref = kl(logp, reference)
        return cls(reward=reward, length=float((p * tree.lengths.double()).sum()), kl_ref=kl_ref,
                   kl_opt=kl(logp, optimum(tree, beta)), objective=reward - beta * kl_ref,
                   regret=frontier_reward(tree, kl_ref) - reward,
                   kl_ref_first=first_token_kl(tree, logp, reference))


# ----- the GRPO loop ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Setting:
    """One row of the lab: a KL setting and how GRPO is run.

    placement 'loss' / 'reward' / 'off' (beta = 0). config: AdaptiveKLConfig fields. beta_scale: the factor on beta
    for the KL in the loss ('matched': (G - 1) / G, the scale relation; 'passed': 1)."""

    label: str
    placement: str = "loss"
    config: tuple[tuple[str, Any], ...] = ()
    loss_type: str = "dr_grpo"
    scale_rewards: str = "none"
    beta_scale: str = "matched"
    group: str = ""

    def config_fields(self) -> dict[str, Any]:
        return dict(self.config)


@dataclass(frozen=True)
class Training:
    """The GRPO run: `groups` groups of `group_size` completions a step, Adam at `learning_rate` decayed linearly to 0
    over `steps` (or constant: `schedule='constant'`)."""

    steps: int = 500
    groups: int = 32
    group_size: int = 8
    learning_rate: float = 0.08
    schedule: str = "linear"


def beta_trained(setting: Setting, beta: float, training: Training) -> float:
    """The beta handed to `AdaptiveKL`: beta itself in the reward, beta * (G - 1) / G in the loss when matched."""
    if setting.placement == "off":
        return 0.0
    if setting.placement == "loss" and setting.beta_scale == "matched":
        return beta * (training.group_size - 1) / training.group_size
    return beta


def advantages(rewards: torch.Tensor, group_size: int, scale_rewards: str) -> torch.Tensor:
    """TRL's: r_i - the mean of its group, divided by the group's (or the batch's) std + 1e-4 unless 'none'."""
    grouped = rewards.view(-1, group_size)
    centred = (grouped - grouped.mean(-1, keepdim=True)).view(-1)
    if scale_rewards == "group":
        return centred / (grouped.std(-1).repeat_interleave(group_size) + 1e-4)
    if scale_rewards == "batch":
        return centred / (rewards.std() + 1e-4)
    return centred


def policy_loss(per_token: torch.Tensor, mask: torch.Tensor, loss_type: str, max_length: int) -> torch.Tensor:
    """TRL's aggregation of the per-token loss (one micro-batch, so dapo's normaliser is this batch's token count)."""
    summed = (per_token * mask).sum(-1)
    if loss_type in ("grpo", "sapo"):
        return (summed / mask.sum(-1).clamp(min=1)).mean()
    if loss_type in ("bnpo", "dapo", "cispo", "vespo"):
        return summed.sum() / mask.sum().clamp(min=1)
    if loss_type == "dr_grpo":
        return summed.sum() / (per_token.size(0) * max_length)
    if loss_type == "luspo":
        return summed.mean()
    raise ValueError(f"loss_type={loss_type!r}: the lab runs grpo, sapo, bnpo, dapo, cispo, vespo, dr_grpo, luspo")


@dataclass
class Run:
    """What one training run ends with: exact figures, and the beta and sampled KL the controller saw last."""

    figures: Figures
    final_beta: float
    logp: torch.Tensor
    betas: list[float] = field(default_factory=list)


def train(tree: Tree, setting: Setting, beta: float, training: Training, seed: int, trace_every: int = 0) -> Run:
    """Train a tabular policy, starting at the reference, with one setting; exact figures against pi*_beta."""
    generator = torch.Generator().manual_seed(seed)
    table = tree.reference_table.clone().requires_grad_(True)
    optimizer = torch.optim.Adam([table], lr=training.learning_rate)
    steps = training.steps
    decay = (lambda step: 1.0 - step / steps) if training.schedule == "linear" else (lambda step: 1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, decay)
    fields = setting.config_fields()
    if setting.placement == "reward":
        fields["kl_placement"] = "reward"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the lab runs the settings the guards warn about, on purpose
        akl = AdaptiveKL(AdaptiveKLConfig(**fields), beta_trained(setting, beta, training), setting.loss_type)
    n = training.groups * training.group_size
    max_length = tree.env.max_length
    reference_logps = tree.token_logps(tree.reference_table)
    read = context_read(akl.config, setting.loss_type)  # the divisors the step's reductions read, and only those
    betas = []
    for step in range(steps):
        with torch.no_grad():
            probs = tree.log_probs(table).exp()
        rows = torch.multinomial(probs, n, replacement=True, generator=generator)
        logps = tree.token_logps(table, rows)
        ref, mask, rewards = reference_logps[rows], tree.mask[rows], tree.rewards[rows]
        scored = rewards
        if setting.placement == "reward":
            scored = rewards - akl.reward_penalty(logps.detach(), ref, mask, group_size=training.group_size)[0]
        advantage = advantages(scored, training.group_size, setting.scale_rewards)
        ratio = torch.exp(logps - logps.detach())  # on-policy: 1, with the gradient of log pi
        loss = policy_loss(-ratio * advantage.unsqueeze(-1), mask, setting.loss_type, max_length)
        if setting.placement == "loss":
            divisors = {"max_completion_length": max_length, "token_normalizer": mask.sum()}
            term, _ = akl.kl_loss(logps, ref, mask, **{name: divisors[name] for name in read})
            loss = loss + term
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        scheduler.step()
        akl.step(mean_reward=float(rewards.mean()))
        if trace_every and step % trace_every == 0:
            betas.append(akl.current_beta)
    with torch.no_grad():
        logp = tree.log_probs(table)
    return Run(Figures.of(tree, logp, beta), akl.current_beta, logp, betas)


# ----- the tables ---------------------------------------------------------------------------------------------------

ESTIMATOR_NOTES = {"k1": "log-ratio", "k2": "0.5 * log-ratio^2", "k3": "the trainers' own", "low_var_kl": "verl's k3",
                   "k1+": "k1, k2's gradient", "k3+": "k3, k2's gradient (= TRL's bias-corrected k3 on-policy)",
                   "k1_future": "k1, the completion's KL gradient", "k3_bottom_percentile": "k3 on 20 % of tokens x 5"}


# Each method's row: the fields that make it act in these environments (dynamic's threshold below the optimum's reward).
METHOD_FIELDS: dict[str, tuple[tuple[str, Any], ...]] = {
    "clip": (("kl_clip_threshold", 0.1),), "sigmoid": (("kl_target", 0.05),), "length_normalized": (),
    "dynamic": (("reward_threshold", 0.6),), "target": (("kl_target", 0.1),)}


def default_settings(estimators: Sequence[str] = (), methods: Sequence[str] = ()) -> list[Setting]:
    """The default table: every estimator in both placements, the reductions, every method, and the loss types
    dr_grpo/dapo/grpo with scale_rewards none and group; `estimators` and `methods` add rows for names a user
    registered (register_kl_estimator, register_kl_shaping, register_beta_controller)."""
    settings = [Setting("beta = 0 (no KL)", placement="off", group="reference points")]
    for name in [*ESTIMATOR_NOTES, *estimators]:
        for placement in ("reward", "loss"):
            settings.append(Setting(f"{name} in the {placement}", placement, (("kl_estimator", name),),
                                    group="estimators (dr_grpo, scale_rewards none, kl_reduction loss_type)"))
    settings.append(Setting("k3 in the loss, at beta as passed", beta_scale="passed", group="the scale relation"))
    settings.append(Setting("k1_future in the loss, at beta as passed", config=(("kl_estimator", "k1_future"),),
                            beta_scale="passed", group="the scale relation"))
    reductions = "reductions (kl_reduction)"
    settings.append(Setting("k1 in the reward, sequence_mean", "reward",
                            (("kl_estimator", "k1"), ("kl_reduction", "sequence_mean")), group=reductions))
    for estimator, reduction in (("k3", "sequence_mean"), ("k3", "token_mean"), ("k3", "sequence_sum"),
                                 ("k1_future", "sequence_mean"), ("k1_future", "token_mean"),
                                 ("k1_future", "sequence_sum")):
        settings.append(Setting(f"{estimator} in the loss, {reduction}", "loss",
                                (("kl_estimator", estimator), ("kl_reduction", reduction)), group=reductions))
    method_group = "methods (k3 in the loss, k1 in the reward)"
    for method, extra in (*METHOD_FIELDS.items(), *((name, ()) for name in methods)):
        for placement in ("loss", "reward"):
            if placement == "reward" and method == "length_normalized":
                continue  # refused there: each completion's KL is one number already (kl_reduction picks it)
            settings.append(Setting(f"{method} in the {placement}", placement,
                                    (("kl_adaptation_method", method), *extra), group=method_group))
    grid = "loss types and reward scaling"
    for loss_type, scale in itertools.product(("dr_grpo", "dapo", "grpo"), ("none", "group")):
        if (loss_type, scale) == ("dr_grpo", "none"):
            continue  # the estimator rows
        for label, placement, estimator in (("k1 in the reward", "reward", "k1"), ("k3 in the loss", "loss", "k3"),
                                            ("k3+ in the loss", "loss", "k3+"),
                                            ("k1_future in the loss", "loss", "k1_future")):
            settings.append(Setting(f"{label}, {loss_type}, scale {scale}", placement, (("kl_estimator", estimator),),
                                    loss_type=loss_type, scale_rewards=scale, group=grid))
    return settings


ENVIRONMENTS = {"contains_a": Environment("contains_a"), "first_a": Environment("first_a")}
COLUMNS = ("reward", "length", "kl_ref", "kl_opt", "objective", "regret", "kl_ref_first")
HEADER = ["setting", "beta trained", "E[r]", "E[length]", "KL(pi||pi_ref)", "KL(pi||pi*)", "objective",
          "frontier regret"]


def _run_one(job: tuple[Environment, Setting, float, Training, int]) -> dict[str, Any]:
    env, setting, beta, training, seed = job
    torch.set_num_threads(1)
    run = train(Tree(env), setting, beta, training, seed)
    return {"setting": setting.label, "seed": seed, **asdict(run.figures), "final_beta": run.final_beta}


def run_table(env: Environment, settings: Sequence[Setting], beta: float, training: Training, seeds: Sequence[int],
              processes: int = 1) -> dict[str, Any]:
    """Train every setting with every seed; the exact figures averaged over seeds (and their largest spread in
    KL(pi || pi*)), beside the optimum's."""
    jobs = [(env, setting, beta, training, seed) for setting in settings for seed in seeds]
    if processes > 1:
        with multiprocessing.get_context("fork").Pool(processes) as pool:
            results = pool.map(_run_one, jobs, chunksize=1)
    else:
        results = [_run_one(job) for job in jobs]
    tree = Tree(env)
    rows = [{"setting": "the optimum pi*", "group": "reference points", "beta_trained": beta,
             **asdict(Figures.of(tree, optimum(tree, beta), beta)), "kl_opt_spread": 0.0}]
    for setting in settings:
        mine = [r for r in results if r["setting"] == setting.label]
        row = {"setting": setting.label, "group": setting.group, "beta_trained": beta_trained(setting, beta, training),
               "placement": setting.placement, "config": setting.config_fields(), "loss_type": setting.loss_type,
               "scale_rewards": setting.scale_rewards}
        row.update({column: sum(r[column] for r in mine) / len(mine) for column in (*COLUMNS, "final_beta")})
        row["kl_opt_spread"] = max(r["kl_opt"] for r in mine) - min(r["kl_opt"] for r in mine)
        rows.append(row)
    return {"environment": asdict(env), "beta": beta, "training": asdict(training), "seeds": list(seeds),
            "completions": len(tree.completions), "rows": rows}


ESTIMATOR_POLICY_SEED = 1  # the policy the estimators are taken at: the reference's logits plus N(0, 1) noise


def estimator_expectations(env: Environment, names: Sequence[str] = BUILT_IN_ESTIMATORS) -> dict[str, Any]:
    """Each estimator's expectation over completions, E_{y ~ pi}[sum_t m_t k_t(y)], exactly (every completion, weighted
    by pi(y)), at a policy pi away from the reference (its logits the reference's plus N(0, 1) noise, seed
    `ESTIMATOR_POLICY_SEED`), against KL(pi || pi_ref): an estimator is unbiased for the KL where they are equal. The
    core computes each k in float32, so equal means within float32 rounding. `std` is the standard deviation of
    sum_t m_t k_t over y ~ pi, exactly: the spread of one completion's estimate (a batch mean of n completions
    spreads by std / sqrt(n)). The reward does not enter. Every completion is one row of one batch:
    k3_bottom_percentile's selection, a statistic of the batch, is of that one."""
    tree = Tree(env)
    noise = torch.randn(tree.reference_table.shape, generator=torch.Generator().manual_seed(ESTIMATOR_POLICY_SEED))
    logp, ref = tree.token_logps(tree.reference_table + noise).double(), tree.token_logps(tree.reference_table).double()
    weight = logp.sum(-1).exp()  # pi(y), summing to 1 over the completions
    exact = kl(logp.sum(-1), ref.sum(-1))
    rows = []
    for name in names:
        with warnings.catch_warnings():  # k1 in the loss warns that it does not regularise: only its value is read
            warnings.simplefilter("ignore")
            config = AdaptiveKLConfig(kl_estimator=name)
        k = estimate_kl(logp, ref, tree.mask, config).double()
        summed = (k * tree.mask).sum(-1)
        expectation = float((weight * summed).sum())
        std = math.sqrt(float((weight * (summed - expectation) ** 2).sum()))
        rows.append({"estimator": name, "expectation": expectation, "bias": expectation - exact, "std": std})
    return {"environment": asdict(env), "policy_seed": ESTIMATOR_POLICY_SEED, "kl": exact, "rows": rows}


TARGET_TRACE_EVERY = 50  # target: steps between two recorded betas
TARGET_RATES = (0.005, 0.02, 0.1)  # completions per step / kl_horizon: the controller's largest relative step is 0.2x this


def target_experiment(env: Environment, beta: float, training: Training, rates: Sequence[float] = TARGET_RATES,
                      seed: int = 0, beta_0: float = 0.2) -> dict[str, Any]:
    """`target` against its fixed point: with tau = KL(pi*_beta || pi_ref), the controller (k1 in the reward,
    kl_target_measure='sequence_sum', starting at beta_0) should settle at beta* = beta and the policy on pi*_beta.
    One run per rate n / kl_horizon (n the completions per step), constant learning rate; beta every 50 steps."""
    tree = Tree(env)
    tau = kl(optimum(tree, beta), tree.log_probs(tree.reference_table))
    n = training.groups * training.group_size
    runs = []
    for rate in rates:
        horizon = n / rate
        setting = Setting(f"target, kl_horizon {horizon:g}", "reward",
                          (("kl_adaptation_method", "target"), ("kl_target", tau),
                           ("kl_target_measure", "sequence_sum"), ("kl_horizon", horizon)))
        run = train(tree, setting, beta_0, training, seed, trace_every=TARGET_TRACE_EVERY)
        tail = run.betas[len(run.betas) // 2:]
        runs.append({"kl_horizon": horizon, "rate": rate, "final_beta": run.final_beta, "beta_tail_min": min(tail),
                     "beta_tail_max": max(tail), "kl_ref": run.figures.kl_ref,
                     "kl_opt": kl(run.logp, optimum(tree, beta)), "betas": run.betas})
    return {"environment": asdict(env), "tau": tau, "beta_star": beta_for_kl(tree, tau), "beta_0": beta_0,
            "training": asdict(training), "runs": runs}


# ----- output -------------------------------------------------------------------------------------------------------


def table_rows(table: dict[str, Any]) -> list[tuple[str, list[list[str]]]]:
    """The table's rows as text cells, grouped: [(group, [[setting, beta trained, figures...], ...]), ...]."""
    groups: dict[str, list[list[str]]] = {}
    for row in table["rows"]:
        spread = f" (spread {row['kl_opt_spread']:.3f})" if row["kl_opt_spread"] > 0.05 else ""
        kl_opt = "0" if row["kl_opt"] < 5e-5 else f"{row['kl_opt']:.4f}"
        groups.setdefault(row["group"], []).append(
            [row["setting"], f"{row['beta_trained']:.4g}", *(f"{row[c]:.3f}" for c in ("reward", "length", "kl_ref")),
             kl_opt + spread, f"{row['objective']:.4f}", f"{max(row['regret'], 0.0):.4f}"])
    return list(groups.items())


ESTIMATORS_HEADER = ("estimator", "E_pi[sum_t k_t]", "minus KL(pi || pi_ref)", "std over y ~ pi")


def estimator_rows(result: dict[str, Any]) -> list[list[str]]:
    """The estimators' expectations against the KL and their spread, as text cells (the KL itself in the first
    row)."""
    return [["KL(pi || pi_ref)", f"{result['kl']:.6f}", "", ""]] + [
        [row["estimator"], f"{row['expectation']:.6f}", f"{row['bias']:.1e}", f"{row['std']:.4f}"]
        for row in result["rows"]]


def target_rows(result: dict[str, Any]) -> list[list[str]]:
    return [[f"{run['kl_horizon']:g}", f"{run['rate']:.3g}", f"{run['final_beta']:.4f}", f"{run['beta_tail_min']:.3f} - {run['beta_tail_max']:.3f}",
             f"{run['kl_ref']:.4f}", f"{run['kl_opt']:.5f}"] for run in result["runs"]]


TARGET_HEADER = ["kl_horizon", "completions / kl_horizon", "final beta", "beta over the second half", "KL(pi||pi_ref)", "KL(pi||pi*_beta*)"]


def markdown(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A Markdown table (the docs page is made of these); '|' and '*' in a cell are escaped."""
    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(cell.replace("|", "\\|").replace("*", "\\*") for cell in cells) + " |"

    return "\n".join([line(header), "|" + "---|" * len(header), *map(line, rows)])


def show(title: str, header: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    """A table on the terminal: rich's, as the demo's, where rich is installed; else Markdown."""
    try:
        from rich.console import Console
        from rich.markup import escape
        from rich.table import Table
    except ImportError:
        print(f"\n{title}\n\n{markdown(header, rows)}")
        return
    table = Table(title=title, title_justify="left")
    for index, name in enumerate(header):
        table.add_column(escape(name), justify="left" if index == 0 else "right")
    for row in rows:
        table.add_row(*map(escape, row))
    Console(width=150).print(table)


def chosen(settings: Sequence[Any], only: Sequence[str]) -> list[Any]:
    """The settings in the table: every one without --only, else those whose label contains one TEXT. A TEXT in no
    label is refused, naming the labels: a typo would drop its rows without a word."""
    missing = [text for text in only if not any(text in setting.label for setting in settings)]
    if missing:
        raise SystemExit(f"--only {', '.join(map(repr, missing))}: in no setting's label; the labels are "
                         + "; ".join(setting.label for setting in settings))
    return [setting for setting in settings if not only or any(text in setting.label for text in only)]
