"""The KL lab through a real trainer: TRL's `GRPOTrainer` or Unsloth's generated trainer, on a transformer.

    python -m unsloth_adaptive_kl.tools.kl_lab --trainer trl
    python -m unsloth_adaptive_kl.tools.kl_lab --trainer unsloth --recipe lora --only "in the reward"
    python -m unsloth_adaptive_kl.tools.kl_lab --trainer trl --set loss_type=dapo scale_rewards=group num_iterations=2

The tabular lab's environment (kl_lab.py) with a tiny Llama as the policy, built in-process (tools/tiny.py) over the
vocabulary {EOS, a, b} and a pad token the model never samples (`never_sampled`; `--pad-is-eos`: pad = EOS, no pad
token). Its completions of at most 4 tokens are the tabular lab's 31, so every figure stays exact: the model's next-token distribution after a prompt x and each of the 15 prefixes is one row of a tabular table
(`node_logits`), and log pi(y | x) follows by the tabular lab's enumeration. The reference is the initial model (the
trainers' reference, with full fine-tuning and with LoRA), so pi*_beta(y | x) is proportional to
pi_ref(y | x) exp(r(y) / beta) for each prompt.

Training is the trainer as a user configures it: `GRPOConfig(...)` with this package's fields and any field passed
with `--set`, a `Dataset` of prompts, a reward function of the decoded completions, `trainer.train()`. The figures are
averaged over the training prompts and given apart for a prompt never trained on (does the regularisation reach a
prompt the gradient never saw?). Each row also gives the effective beta: the beta' whose optimum pi*_beta' has the
policy's KL to the reference, the beta the setting acted as. Beside it, the tabular lab's prediction for the same
setting on the same reference (the model's initial tables) with the loss type and reward scaling the trainer ran.

Unsloth on a machine without CUDA: Unsloth 2026.10.x has no CPU backend, so the lab sets `UNSLOTH_ALLOW_CPU=1` and
generates the trainer itself as `PatchFastRL` does on a GPU (`_patch_trl_rl_trainers("grpo_trainer")`), with
Unsloth's prefix grouper off (it needs FastLanguageModel's attention); the trainer, its config and its loss are
Unsloth's own. The policy is a plain transformers model, not a FastLanguageModel, on a GPU too.
"""

from __future__ import annotations

import dataclasses
import functools
import multiprocessing
import os
import statistics
import tempfile
import warnings
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from .kl_lab import ENVIRONMENTS, METHOD_FIELDS, Environment, Figures, Setting, Training, Tree, beta_for_kl, train

TRAINERS = ("trl", "unsloth")
# Prompts of mixed letters, of one length (no padding). A Llama has no absolute positions, so it cannot tell "aa" from
# "aaa": attention over identical tokens averages identical values. After the prompt "aa" the nodes "", "a", "aa" and
# "aaa" would share one distribution, and pi* (which needs 'a' before the first 'a' and the reference after it) would
# be out of reach: k1 in the reward measured 0.109 from pi* there, against 0.0001 for these.
TRAIN_PROMPTS = ("aab", "abb", "bab")
HELD_OUT = "aba"  # never in the training set
GROUP_SIZE = 8
BATCH = 64  # completions an optimizer step: 8 groups


@dataclass(frozen=True)
class Recipe:
    """How the trainer runs besides the KL setting: GRPOConfig fields, and LoRA (rank 8) or full fine-tuning."""

    label: str
    fields: tuple[tuple[str, Any], ...] = ()
    lora: bool = False


DR_GRPO = (("loss_type", "dr_grpo"), ("scale_rewards", "none"))
RECIPES: dict[str, Recipe] = {
    "dr_grpo": Recipe("dr_grpo, scale_rewards none", DR_GRPO),
    "defaults": Recipe("the trainer's defaults (loss_type, scale_rewards unset)"),
    "mu2": Recipe("dr_grpo, num_iterations=2 (clipped)", (*DR_GRPO, ("num_iterations", 2))),
    "accumulation": Recipe("dr_grpo, gradient_accumulation_steps=2",
                           (*DR_GRPO, ("gradient_accumulation_steps", 2), ("per_device_train_batch_size", BATCH // 2))),
    "spg2": Recipe("dr_grpo, steps_per_generation=2", (*DR_GRPO, ("steps_per_generation", 2))),
    "lora": Recipe("dr_grpo, LoRA rank 8", DR_GRPO, lora=True),
}


def trainer_settings() -> list[Setting]:
    """The table's settings: the reference points, the estimators that matter in each placement, each method (k3 in
    the loss, as the trainers' own KL)."""
    return [Setting("beta = 0 (no KL)", "off"),
            Setting("k1 in the reward", "reward", (("kl_estimator", "k1"),)),
            Setting("k3 in the reward", "reward", (("kl_estimator", "k3"),)),
            Setting("k3 in the loss (the trainer's own)", "loss"),
            Setting("k2 in the loss", "loss", (("kl_estimator", "k2"),)),
            Setting("k1_future in the loss", "loss", (("kl_estimator", "k1_future"),)),
            *(Setting(f"{method} in the loss", "loss", (("kl_adaptation_method", method), *fields))
              for method, fields in METHOD_FIELDS.items())]


@dataclass(frozen=True)
class LabRun:
    """One training run through a trainer: `steps` optimizer steps of `BATCH` completions, AdamW at `learning_rate`
    decayed linearly to 0 (the trainers' default schedule); `learning_rate` None: 3e-3, or 2e-2 with LoRA."""

    trainer: str
    setting: Setting
    recipe: Recipe
    beta: float
    steps: int
    seed: int
    learning_rate: Optional[float] = None
    overrides: tuple[tuple[str, Any], ...] = ()
    environment: str = "contains_a"
    pad_is_eos: bool = False

    @property
    def lr(self) -> float:
        if self.learning_rate is not None:
            return self.learning_rate
        return 2e-2 if self.recipe.lora else 3e-3


# ----- the policy ---------------------------------------------------------------------------------------------------

LETTERS = "ab"  # the tabular lab's tokens 0 and 1; its EOS (2) is the tokenizer's EOS


def lab_tokenizer(pad_is_eos: bool = False) -> Any:
    """The tokenizer over {EOS, a, b}, one token per letter, with a pad token of its own (or pad = EOS)."""
    from .tiny import build_tokenizer

    return build_tokenizer(LETTERS, pad_is_eos=pad_is_eos)


def lab_model(tokenizer: Any, seed: int = 0) -> Any:
    """The policy at the start (and so the reference): a 2-layer Llama of width 64, seeded; a pad token of the
    tokenizer's own is never sampled (`never_sampled`)."""
    from .tiny import build_tiny_model

    model = build_tiny_model(tokenizer, hidden_size=64, num_layers=2, seed=seed, max_position_embeddings=16)
    if tokenizer.pad_token_id != tokenizer.eos_token_id:
        never_sampled(model, tokenizer.pad_token_id)
    return model


@torch.no_grad()
def never_sampled(model: Any, token_id: int, weight: float = -10.0) -> None:
    """Give `token_id` a logit near -80 everywhere, in the weights alone (Unsloth computes the logits from the hidden
    states and lm_head's weight itself): hidden coordinate 0 is 1 in every token's embedding and no layer writes it
    (its rows of o_proj and down_proj are 0), so after the final RMSNorm it is about sqrt(hidden) = 8; the token's
    row of lm_head is `weight` there and 0 elsewhere. Training moves these weights, LoRA's adapters on o_proj and
    down_proj included; the lab reports the largest probability the pad token has at the end (`pad_probability`) and
    marks a row where it passed `PAD_EXACT` (measured: below 5e-4 in every full fine-tuning run, up to 0.72 with LoRA
    and `clip`)."""
    model.model.embed_tokens.weight[:, 0] = 1.0
    for layer in model.model.layers:
        layer.self_attn.o_proj.weight[0] = 0.0
        layer.mlp.down_proj.weight[0] = 0.0
    model.lm_head.weight[token_id] = 0.0
    model.lm_head.weight[token_id, 0] = weight


def token_ids(tokenizer: Any) -> torch.Tensor:
    """The vocabulary ids of the tabular lab's tokens (a, b, EOS), in its order."""
    return torch.tensor([*tokenizer.convert_tokens_to_ids(list(LETTERS)), tokenizer.eos_token_id])


@torch.no_grad()
def node_logits(model: Any, tokenizer: Any, prompt: str, tree: Tree) -> torch.Tensor:
    """(nodes, 3) float64: the model's next-token log-probs after `prompt` + each node's prefix, columns a, b, EOS
    (each row sums to 1 less the pad token's probability: the tabular table the model is, for this prompt)."""
    ids = token_ids(tokenizer)
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    rows = torch.empty(tree.num_nodes, len(ids), dtype=torch.float64)
    device = next(model.parameters()).device
    for depth in range(tree.env.max_length):
        nodes = [index for index, prefix in enumerate(tree.prefixes) if len(prefix) == depth]
        inputs = torch.tensor([prompt_ids + ids[list(tree.prefixes[i])].tolist() for i in nodes], device=device)
        logits = model(input_ids=inputs).logits[:, -1].double().cpu()
        rows[nodes] = torch.log_softmax(logits, -1)[:, ids]
    return rows


def reward_function(environment: Environment) -> Any:
    """The environment's reward as a trainer's reward function of the decoded completions (EOS skipped)."""
    from .kl_lab import REWARDS

    rule = REWARDS[environment.reward]

    def reward(completions: list[str], **_: Any) -> list[float]:
        return [rule(tuple(LETTERS.index(char) for char in text if char in LETTERS)) for text in completions]

    reward.__name__ = environment.reward
    return reward


# ----- one run through a trainer ------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def import_trainer(trainer: str) -> tuple[Any, Any]:
    """(GRPOConfig, GRPOTrainer) of `trainer`, this package imported first, once per process. For Unsloth, its
    generated trainer, made as `PatchFastRL` makes it (`_patch_trl_rl_trainers("grpo_trainer")`, which PatchFastRL
    skips without CUDA; see the module's docstring). Unsloth patches TRL in place, so a process runs one trainer only
    (the lab runs each in its own worker processes)."""
    import unsloth_adaptive_kl  # noqa: F401  (first: it patches TRL and hooks Unsloth's generation)

    if trainer == "unsloth":
        if not torch.cuda.is_available():
            for name in ("UNSLOTH_ALLOW_CPU", "UNSLOTH_COMPILE_DISABLE"):
                os.environ.setdefault(name, "1")
        os.environ.setdefault("UNSLOTH_GRPO_PREFIX_GROUPER", "0")
        os.environ.setdefault("UNSLOTH_DISABLE_STATISTICS", "1")
        import unsloth  # noqa: F401
        import unsloth.models.rl as unsloth_rl

        unsloth_rl._patch_trl_rl_trainers("grpo_trainer")
    import trl

    expected = "UnslothGRPOTrainer" if trainer == "unsloth" else "GRPOTrainer"
    if trl.GRPOTrainer.__name__ != expected:
        raise RuntimeError(f"--trainer {trainer}: trl.GRPOTrainer is {trl.GRPOTrainer.__name__}, not {expected}")
    return trl.GRPOConfig, trl.GRPOTrainer


def config_fields(run: LabRun, output_dir: str) -> dict[str, Any]:
    """The GRPOConfig a user writes for this run: the batch, the schedule, beta, the KL setting, the recipe, then
    `--set` overrides (last, so any field can be changed)."""
    from .kl_lab import beta_trained

    fields: dict[str, Any] = dict(
        output_dir=output_dir, report_to="none", disable_tqdm=True, save_strategy="no", logging_steps=run.steps,
        use_cpu=not torch.cuda.is_available(), bf16=False, fp16=False, seed=run.seed, max_steps=run.steps,
        per_device_train_batch_size=BATCH, num_generations=GROUP_SIZE, max_completion_length=4,
        learning_rate=run.lr, lr_scheduler_type="linear", warmup_steps=0, optim="adamw_torch", weight_decay=0.0,
        gradient_accumulation_steps=1,  # TRL's defaults, which Unsloth's config changes (adamw_8bit, 0.001, 2)
        beta=beta_trained(run.setting, run.beta, Training(group_size=GROUP_SIZE)),
        **run.setting.config_fields())
    if run.setting.placement == "reward":
        fields["kl_placement"] = "reward"
    fields.update(run.recipe.fields)
    fields.update(run.overrides)
    return fields


def train_through(run: LabRun, tables: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Train through the real trainer; the policy's tables afterwards ({prompt: (nodes, 3) log-probs}) and the KL
    settings the trainer ran with (read from its own args)."""
    from datasets import Dataset

    config_class, trainer_class = import_trainer(run.trainer)
    tokenizer = lab_tokenizer(run.pad_is_eos)
    env = ENVIRONMENTS[run.environment]
    with tempfile.TemporaryDirectory() as folder:
        model_dir = os.path.join(folder, "model")
        # By path, as users pass a model: TRL loads its reference for full fine-tuning from it.
        lab_model(tokenizer).save_pretrained(model_dir)
        tokenizer.save_pretrained(model_dir)
        model: Any = model_dir
        if run.recipe.lora or run.trainer == "unsloth":
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(model_dir)
        if run.recipe.lora:
            from .tiny import add_lora

            model = add_lora(model, seed=run.seed)
        if run.trainer == "unsloth":
            for name in ("for_training", "for_inference"):  # what FastLanguageModel's models have
                setattr(model, name, lambda *a, **k: None)
            model._unsloth_user_float32 = True  # keep Unsloth from switching to fp16 where it sees no bf16
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the lab runs the settings the guards warn about, on purpose
            dataset = Dataset.from_dict({"prompt": list(TRAIN_PROMPTS) * BATCH})
            try:
                args = config_class(**config_fields(run, os.path.join(folder, "out")))
                trainer = trainer_class(model=model, processing_class=tokenizer, reward_funcs=[reward_function(env)],
                                        args=args, train_dataset=dataset)
            except ValueError as error:  # a combination refused before training (the config's or the trainer's)
                return {"refused": str(error)}
            trainer.train()
        policy = trainer.model.eval()
        tree = Tree(env)
        trained = {prompt: node_logits(policy, tokenizer, prompt, tree) for prompt in tables}
    pad_probability = max(float(1 - table.exp().sum(-1).min()) for table in trained.values())
    in_effect = {name: getattr(trainer.args, name, None) for name in (
        "beta", "loss_type", "scale_rewards", "num_iterations", "steps_per_generation", "gradient_accumulation_steps",
        "epsilon", "epsilon_high", "mask_truncated_completions", "importance_sampling_level")}
    return {"tables": trained, "in_effect": in_effect, "pad_probability": pad_probability}


def _worker(job: tuple[LabRun, dict[str, torch.Tensor]]) -> dict[str, Any]:
    torch.set_num_threads(1)
    return train_through(*job)


# ----- figures ------------------------------------------------------------------------------------------------------


def reference_tables(environment: Environment, prompts: Sequence[str],
                     pad_is_eos: bool = False) -> dict[str, torch.Tensor]:
    """{prompt: the initial model's (nodes, 3) log-probs}: the reference every run starts from."""
    tokenizer = lab_tokenizer(pad_is_eos)
    model = lab_model(tokenizer).eval()
    tree = Tree(environment)
    return {prompt: node_logits(model, tokenizer, prompt, tree) for prompt in prompts}


def exact_figures(environment: Environment, reference: torch.Tensor, policy: torch.Tensor,
                  beta: float) -> dict[str, float]:
    """The tabular lab's exact figures of one prompt's policy table against pi*_beta of its reference table, and
    the effective beta (the beta' with KL(pi*_beta' || pi_ref) = KL(pi || pi_ref))."""
    tree = Tree(environment, reference)
    figures = Figures.of(tree, tree.log_probs(policy), beta)
    return {**dataclasses.asdict(figures), "effective_beta": beta_for_kl(tree, figures.kl_ref)}


def summarise(per_prompt: Sequence[dict[str, float]]) -> dict[str, float]:
    return {key: statistics.fmean(figures[key] for figures in per_prompt) for key in per_prompt[0]}


def scaling(scale_rewards: Any) -> str:
    """A trainer's `scale_rewards` as the tabular lab names it (True is "group", False "none", as TRL reads them)."""
    if isinstance(scale_rewards, bool):
        return "group" if scale_rewards else "none"
    return str(scale_rewards)


def tabular_prediction(environment: Environment, setting: Setting, beta: float, loss_type: str, scale_rewards: str,
                       tables: dict[str, torch.Tensor], seed: int = 0) -> dict[str, float]:
    """The tabular lab's figures for the same setting, on-policy single steps, started from each training prompt's
    reference table (the model's), with the loss type and reward scaling the trainer ran; averaged over the prompts."""
    tabular = dataclasses.replace(setting, loss_type=loss_type, scale_rewards=scaling(scale_rewards))
    per_prompt = []
    for prompt in TRAIN_PROMPTS:
        tree = Tree(environment, tables[prompt].float())
        run = train(tree, tabular, beta, Training(group_size=GROUP_SIZE), seed)
        per_prompt.append({**dataclasses.asdict(run.figures), "effective_beta": beta_for_kl(tree, run.figures.kl_ref)})
    return summarise(per_prompt)


def run_trainer_table(trainer: str, settings: Sequence[Setting], recipes: Sequence[str], beta: float, steps: int,
                      seeds: Sequence[int], processes: int = 1, overrides: Sequence[tuple[str, Any]] = (),
                      learning_rate: Optional[float] = None, environment: str = "contains_a",
                      pad_is_eos: bool = False) -> dict[str, Any]:
    """Every setting x recipe x seed through `trainer` (worker processes, one trainer each); per row the exact
    figures averaged over the training prompts and then over seeds, each seed's KL(pi || pi*), the held-out prompt's
    figures and the tabular prediction."""
    env = ENVIRONMENTS[environment]
    tables = reference_tables(env, (*TRAIN_PROMPTS, HELD_OUT), pad_is_eos)
    runs = [LabRun(trainer, setting, RECIPES[recipe], beta, steps, seed, learning_rate, tuple(overrides), environment,
                   pad_is_eos)
            for recipe in recipes for setting in settings for seed in seeds]
    with multiprocessing.get_context("fork").Pool(processes) as pool:
        results = pool.map(_worker, [(run, tables) for run in runs], chunksize=1)
    predictions: dict[tuple[str, str, str], dict[str, float]] = {}
    rows = []
    for index in range(0, len(runs), len(seeds)):
        run, mine = runs[index], results[index:index + len(seeds)]
        recipe = next(name for name, recipe in RECIPES.items() if recipe == run.recipe)
        if "refused" in mine[0]:
            rows.append({"recipe": recipe, "setting": run.setting.label, "placement": run.setting.placement,
                         "config": run.setting.config_fields(), "refused": mine[0]["refused"]})
            continue
        trained = [summarise([exact_figures(env, tables[p], result["tables"][p], beta) for p in TRAIN_PROMPTS])
                   for result in mine]
        held_out = [exact_figures(env, tables[HELD_OUT], result["tables"][HELD_OUT], beta) for result in mine]
        in_effect = mine[0]["in_effect"]
        key = (run.setting.label, str(in_effect["loss_type"]), scaling(in_effect["scale_rewards"]))
        if key not in predictions:
            predictions[key] = tabular_prediction(env, run.setting, beta, *key[1:], tables)
        rows.append({"recipe": recipe, "setting": run.setting.label, "placement": run.setting.placement,
                     "config": run.setting.config_fields(), "learning_rate": run.lr, "in_effect": in_effect,
                     "train": summarise(trained), "held_out": summarise(held_out),
                     "kl_opt_seeds": [figures["kl_opt"] for figures in trained], "tabular": predictions[key],
                     "pad_probability": max(result["pad_probability"] for result in mine)})
    return {"trainer": trainer, "environment": dataclasses.asdict(env), "beta": beta, "steps": steps,
            "seeds": list(seeds), "batch": BATCH, "group_size": GROUP_SIZE, "train_prompts": list(TRAIN_PROMPTS),
            "held_out": HELD_OUT, "overrides": dict(overrides), "pad_is_eos": pad_is_eos,
            "recipes": {name: RECIPES[name].label for name in recipes}, "rows": rows}


# ----- output -------------------------------------------------------------------------------------------------------

STEPS = 800
HEADER = ["setting", "beta trained", "E[r]", "E[length]", "KL(pi||pi_ref)", "KL(pi||pi*) [seeds]", "effective beta",
          "tabular: KL(pi||pi*)", "tabular: effective beta", "held out: KL(pi||pi*)", "held out: effective beta"]


def parse_overrides(pairs: Sequence[str]) -> tuple[tuple[str, Any], ...]:
    """`FIELD=VALUE` pairs; VALUE is read as a Python literal where it is one (2, 0.5, True, None), else a string."""
    import ast

    parsed = []
    for pair in pairs:
        name, separator, text = pair.partition("=")
        if not separator or not name:
            raise SystemExit(f"--set {pair!r}: expected FIELD=VALUE, e.g. --set loss_type=dapo num_iterations=2")
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            value = text
        parsed.append((name, value))
    return tuple(parsed)


PAD_EXACT = 1e-3  # above this probability of the pad token at the end, a row's figures are marked inexact


def _kl(value: float) -> str:
    return "0" if value < 5e-5 else f"{value:.4f}"


def _pad(row: dict[str, Any]) -> str:
    """A mark for a row whose policy ended sampling the pad token (which the enumeration leaves out)."""
    probability = row.get("pad_probability", 0.0)
    return f" (inexact: pad sampled at up to {probability:.2g})" if probability > PAD_EXACT else ""


def _beta(value: float) -> str:
    """An effective beta; at the bisection's floor, the policy's KL is beyond every pi*_beta' (more than pi*_0's)."""
    return "0 (beyond pi*)" if value < 1e-5 else f"{value:.3g}"


def trainer_rows(table: dict[str, Any]) -> list[tuple[str, list[list[str]]]]:
    """The table's rows as text cells, one group a recipe: [(recipe label, [[setting, figures...], ...]), ...]."""
    groups: dict[str, list[list[str]]] = {}
    for row in table["rows"]:
        if "refused" in row:
            reason = row["refused"].split(": allowed is ")[0]
            groups.setdefault(table["recipes"][row["recipe"]], []).append(
                [row["setting"], f"refused before training ({reason})", *[""] * (len(HEADER) - 2)])
            continue
        train, tabular, held_out = row["train"], row["tabular"], row["held_out"]
        seeds = row["kl_opt_seeds"]
        spread = f" [{_kl(min(seeds))} - {_kl(max(seeds))}]" if len(seeds) > 1 else ""
        groups.setdefault(table["recipes"][row["recipe"]], []).append(
            [row["setting"], f"{row['in_effect']['beta']:.4g}", f"{train['reward']:.3f}", f"{train['length']:.3f}",
             f"{train['kl_ref']:.3f}", _kl(train["kl_opt"]) + spread + _pad(row), _beta(train["effective_beta"]),
             _kl(tabular["kl_opt"]), _beta(tabular["effective_beta"]), _kl(held_out["kl_opt"]),
             _beta(held_out["effective_beta"])])
    return list(groups.items())


SIDE_BY_SIDE = ["recipe", "setting", "TRL: KL(pi||pi*)", "Unsloth: KL(pi||pi*)", "TRL: effective beta",
                "Unsloth: effective beta", "tabular: KL(pi||pi*)"]


def side_by_side_rows(trl: dict[str, Any], unsloth: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """(header, rows): each recipe and setting both tables ran, TRL's figures beside Unsloth's, and the tabular lab's
    prediction for TRL's loss type and reward scaling."""
    theirs = {(row["recipe"], row["setting"]): row for row in unsloth["rows"]}
    rows = []
    for row in trl["rows"]:
        other = theirs.get((row["recipe"], row["setting"]))
        if other is not None and "refused" not in row and "refused" not in other:
            rows.append([trl["recipes"][row["recipe"]], row["setting"], _kl(row["train"]["kl_opt"]) + _pad(row),
                         _kl(other["train"]["kl_opt"]) + _pad(other), _beta(row["train"]["effective_beta"]),
                         _beta(other["train"]["effective_beta"]), _kl(row["tabular"]["kl_opt"])])
    return SIDE_BY_SIDE, rows


def describe(table: dict[str, Any]) -> str:
    """One sentence: how the table's runs were made (beside every figure of it)."""
    trained = [row for row in table["rows"] if "refused" not in row]
    lora = ", 2e-2 with LoRA" if any(row["recipe"] == "lora" for row in trained) else ""
    rates = sorted({row["learning_rate"] for row in trained if row["recipe"] != "lora"})
    rate = ", ".join(f"{value:g}" for value in rates) or "-"
    overrides = "; --set " + " ".join(f"{k}={v!r}" for k, v in table["overrides"].items()) if table["overrides"] else ""
    groups = table["batch"] // table["group_size"]
    return (f"{table['trainer']}: beta = {table['beta']}, {table['batch']} completions a step ({groups} groups of "
            f"{table['group_size']}), prompts {', '.join(table['train_prompts'])} "
            f"(held out: {table['held_out']}), {table['steps']} steps, AdamW at {rate}{lora} decayed linearly to 0, "
            f"seeds {', '.join(map(str, table['seeds']))} averaged{overrides}; " + (
                "pad = EOS" if table["pad_is_eos"] else "a pad token of its own, which the model does not sample at "
                f"the start (a row where it ended above {PAD_EXACT:g} is marked inexact)"))


def main(args: Any, command: str) -> dict[str, Any]:
    """`kl_lab --trainer ...`: the table through each trainer asked for, printed, and written with --json."""
    import importlib.metadata
    import json
    import time

    from .kl_lab import show

    unknown = [name for name in args.recipe if name not in RECIPES]
    if unknown:
        raise SystemExit(f"--recipe {', '.join(unknown)}: unknown; the recipes are {', '.join(RECIPES)}")
    if args.env == "all":
        args.env = "contains_a"
    start = time.perf_counter()
    settings = [setting for setting in trainer_settings() if args.only in setting.label]
    trainers = TRAINERS if args.trainer == "both" else (args.trainer,)
    versions = {}
    for name in ("torch", "transformers", "trl", "peft", *(("unsloth", "unsloth_zoo") if "unsloth" in trainers else ())):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    result: dict[str, Any] = {"command": command, "versions": versions, "machine": f"{os.cpu_count()} CPU cores",
                              "trainers": {}}
    for trainer in trainers:
        table = run_trainer_table(trainer, settings, args.recipe or list(RECIPES), args.beta, args.steps or STEPS,
                                  range(args.seeds), args.processes, parse_overrides(args.overrides),
                                  args.learning_rate, args.env, args.pad_is_eos)
        result["trainers"][trainer] = table
        print(f"\n{describe(table)}")
        for recipe, rows in trainer_rows(table):
            show(f"{trainer}, {recipe}", HEADER, rows)
    result["seconds"] = time.perf_counter() - start
    runs = sum(len([row for row in t["rows"] if "refused" not in row]) * len(t["seeds"])
               for t in result["trainers"].values())
    print(f"\nkl_lab: {runs} runs through {', '.join(trainers)} in {result['seconds']:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result
