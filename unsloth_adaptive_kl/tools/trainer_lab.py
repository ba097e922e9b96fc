"""The KL lab through a real trainer: TRL's `GRPOTrainer` or Unsloth's generated trainer, on a transformer.

    python -m unsloth_adaptive_kl.tools.kl_lab --trainer trl
    python -m unsloth_adaptive_kl.tools.kl_lab --trainer unsloth --recipe lora --only "in the reward"
    python -m unsloth_adaptive_kl.tools.kl_lab --trainer trl --set loss_type=dapo scale_rewards=group num_iterations=2

The tabular lab's environment (tabular_lab.py) with a tiny Llama as the policy, built in-process (tools/tiny.py) over the
vocabulary {EOS, a, b} and a pad token the model never samples (its logit fixed at `PAD_LOGIT` through `bias_unit`;
`--pad-is-eos`: pad = EOS, no pad token). Its completions of at most 4 tokens are the tabular lab's 31, so every figure
stays exact: the model's next-token distribution after a prompt x and each of the 15 prefixes is one row of a tabular
table (`node_logits`), and log pi(y | x) follows by the tabular lab's enumeration. The reference is the initial model
(the trainers' reference, with full fine-tuning and with LoRA), so pi*_beta(y | x) is proportional to
pi_ref(y | x) exp(r(y) / beta) for each prompt.

Training is the trainer as a user configures it: `GRPOConfig(...)` with this package's fields and any field passed
with `--set`, a `Dataset` of prompts, a reward function of the decoded completions, `trainer.train()`. The figures are
averaged over the training prompts and given apart for a prompt never trained on (does the regularisation reach a
prompt the gradient never saw?). Each row also gives the effective beta: the beta' whose optimum pi*_beta' has the
policy's KL to the reference, the beta the setting acted as. Beside it, the tabular lab's prediction for the same
setting on the same reference (the model's initial tables) with the loss type and reward scaling the trainer ran.

Unsloth on a machine without CUDA: Unsloth's generated trainer has no CPU path (2026.10.9's CPU backend trains with
TRL's own trainers), so the lab sets `UNSLOTH_ALLOW_CPU=1` and
generates the trainer itself as `PatchFastRL` does on a GPU (`_patch_trl_rl_trainers("grpo_trainer")`), with
Unsloth's prefix grouper off (it needs FastLanguageModel's attention); the trainer, its config and its loss are
Unsloth's own. The policy is a plain transformers model, not a FastLanguageModel, on a GPU too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import multiprocessing
import os
import statistics
import tempfile
import warnings
from dataclasses import dataclass
from typing import Any, Collection, Iterator, Optional, Sequence

import torch

from ..core import AdaptiveKLConfig
from ..core.config import FIELD_DEFAULTS
from .logprob_paths import counted_logprob_calls, describe as describe_scorers
from .machine import hardware, source_commit
from .tabular_findings import K1_VALUED, counted, span
from .tabular_lab import (ENVIRONMENTS, METHOD_FIELDS, REWARDS, Environment, Figures, Setting, Training, Tree,
                          beta_for_kl, beta_trained, chosen, show, train)

TRAINERS = ("trl", "unsloth")
# Prompts of mixed letters, of one length (no padding). A Llama has no absolute positions, so it cannot tell "aa" from
# "aaa": attention over identical tokens averages identical values. After the prompt "aa" the nodes "", "a", "aa" and
# "aaa" would share one distribution, and pi* (which needs 'a' before the first 'a' and the reference after it) would
# be out of reach: k1 in the reward measured 0.109 from pi* there, against 0.0001 for these.
TRAIN_PROMPTS = ("aab", "abb", "bab")
HELD_OUT = "aba"  # never in the training set
GROUP_SIZE = 8
BATCH = 64  # completions an optimizer step: 8 groups
LEARNING_RATE = 3e-3  # AdamW's peak, decayed linearly to 0


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
    decayed linearly to 0 (the trainers' default schedule); `learning_rate` None: `LEARNING_RATE`, with LoRA too.
    (Measured once by minimising the exact KL(pi || pi*) over LoRA's adapters directly, Adam without sampling: 0.0008
    after 250 steps at a constant 3e-3, stalled near 0.04 at 1e-2 and 0.16 at 2e-2, the rate LoRA rows once ran at.)"""

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
        return LEARNING_RATE if self.learning_rate is None else self.learning_rate


# ----- the policy ---------------------------------------------------------------------------------------------------

LETTERS = "ab"  # the tabular lab's tokens 0 and 1; its EOS (2) is the tokenizer's EOS


def lab_tokenizer(pad_is_eos: bool = False) -> Any:
    """The tokenizer over {EOS, a, b}, one token per letter, with a pad token of its own (or pad = EOS)."""
    from .tiny import build_tokenizer

    return build_tokenizer(LETTERS, pad_is_eos=pad_is_eos)


def lab_model(tokenizer: Any, seed: int = 0) -> Any:
    """The policy at the start (and so the reference): a 2-layer Llama of width 64, seeded, with `bias_unit` (a pad
    token of the tokenizer's own is out of reach)."""
    from .tiny import build_tiny_model

    model = build_tiny_model(tokenizer, hidden_size=64, num_layers=2, seed=seed, max_position_embeddings=16)
    with torch.no_grad():
        if tokenizer.pad_token_id != tokenizer.eos_token_id:
            model.lm_head.weight[tokenizer.pad_token_id] = 0.0
            model.lm_head.weight[tokenizer.pad_token_id, 0] = PAD_LOGIT
    return bias_unit(model)


PAD_LOGIT = -1e4  # the pad token's logit, fixed (finite: a float16 logit holds it, and 0 * it is 0)


def bias_unit(model: Any) -> Any:
    """Make hidden coordinate 0 of the model's final hidden state the constant 1, a bias unit: the final norm's
    output there is replaced (a forward hook on `model.norm`, which the trainers' forwards all run, Unsloth's
    hidden-state scorer included), so lm_head's column 0 is a per-token bias. `lab_model` sets the pad token's row of
    lm_head to `PAD_LOGIT` at coordinate 0 and 0 elsewhere: its logit is `PAD_LOGIT` whatever the weights below do.

    Why no machine can sample or train the pad: the other logits are w_j . h with |h| <= 8 |g| and weights of order 1
    (a few units after any run), so the pad's probability is below exp(-9000), 0 in float32 and float64. It is never
    sampled, its share of every normaliser is 0, and its row's gradient, sum_t p_pad(t) h_t, is exactly 0, so AdamW
    (no weight decay, as the lab runs it) never moves the row. Nothing depends on a trajectory or on rounding. The
    hook is not saved with the weights: a model loaded from them (TRL's reference, a trainer's policy) gets it again
    from `bias_unit`, which leaves a model that has it alone."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    norm = base.model.norm
    if not getattr(norm, "_lab_bias_unit", False):
        norm.register_forward_hook(lambda module, inputs, output: torch.cat(
            [torch.ones_like(output[..., :1]), output[..., 1:]], dim=-1))
        norm._lab_bias_unit = True
    return model


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


@contextlib.contextmanager
def unsloth_cache_aside() -> Iterator[None]:
    """Inside the block, Unsloth (if imported there) writes its generated trainer to a temporary folder, deleted after
    it, not to ./unsloth_compiled_cache in the folder the lab runs in; UNSLOTH_COMPILE_LOCATION set by the user is
    kept, and the variable is as it was after the block. Unsloth reads it once, at its import: Unsloth imported
    before the block keeps its folder, one imported inside the deleted one's path (a later compile makes it again)."""
    if "UNSLOTH_COMPILE_LOCATION" in os.environ:
        yield
        return
    with tempfile.TemporaryDirectory() as folder:
        os.environ["UNSLOTH_COMPILE_LOCATION"] = os.path.join(folder, "unsloth_compiled_cache")
        try:
            yield
        finally:
            del os.environ["UNSLOTH_COMPILE_LOCATION"]


def config_fields(run: LabRun, output_dir: str) -> dict[str, Any]:
    """The GRPOConfig a user writes for this run: the batch, the schedule, beta, the KL setting, the recipe, then
    `--set` overrides (last, so any field can be changed)."""

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
            from .tiny import as_unsloth_model

            model = as_unsloth_model(model)
            # On a GPU with bf16, Unsloth's generated config would train this float32 model under bf16 autocast: the
            # lab's bounds are float32's, as on a CPU (Unsloth's own flag for a model that must stay float32; its GRPO
            # steps' own autocast is latched off below, `unsloth_in_float32`).
            model._unsloth_forced_float32 = torch.cuda.is_available()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the lab runs the settings the guards warn about, on purpose
            dataset = Dataset.from_dict({"prompt": list(TRAIN_PROMPTS) * BATCH})
            try:
                args = config_class(**config_fields(run, os.path.join(folder, "out")))
                trainer = trainer_class(model=model, processing_class=tokenizer, reward_funcs=[reward_function(env)],
                                        args=args, train_dataset=dataset)
            except ValueError as error:  # a combination refused before training (the config's or the trainer's)
                return {"refused": str(error)}
            if run.trainer == "unsloth":
                unsloth_in_float32(trainer)
            trainer.add_callback(progress_callback(run))
            for loaded in (trainer.model, getattr(trainer, "ref_model", None)):  # loaded from the saved weights
                if loaded is not None:
                    bias_unit(loaded)
            with counted_logprob_calls() if run.trainer == "unsloth" else contextlib.nullcontext({}) as scorers:
                trainer.train()
        policy = trainer.model.eval()
        tree = Tree(env)
        trained = {prompt: node_logits(policy, tokenizer, prompt, tree) for prompt in tables}
    pad_probability = max(float(1 - table.exp().sum(-1).min()) for table in trained.values())
    return {"tables": trained, "in_effect": settings_in_effect(trainer.args), "pad_probability": pad_probability,
            **({"logprob_path": describe_scorers(scorers), "precision": precision_of(trainer)} if scorers else {})}


PROGRESS_EVERY = 100  # optimizer steps between a run's progress lines


def progress_callback(run: LabRun) -> Any:
    """A TrainerCallback that prints to stderr, every `PROGRESS_EVERY` optimizer steps, how far the run is and since
    when: a run stopped from outside (the GPU check's time limit) says where it had got to."""
    import time

    from transformers import TrainerCallback

    class Progress(TrainerCallback):
        started = time.perf_counter()

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.global_step % PROGRESS_EVERY == 0:
                line = (f"trainer lab: {run.trainer}, {run.setting.label}, seed {run.seed}: step "
                        f"{state.global_step} of {run.steps} after {time.perf_counter() - self.started:.0f} s\n")
                # one write to fd 2: the seeds' forked workers share it, and print's two writes (text, then the
                # newline) interleaved, one worker's line running into the next's
                os.write(2, line.encode())

    return Progress()


# Where Unsloth's GRPO steps pick their own autocast, once a trainer: only while the trainer has no latch yet.
UNSLOTH_AUTOCAST_LATCH = 'if not hasattr(self, "_autocast_enabled"):'


def unsloth_in_float32(trainer: Any) -> None:
    """Latch Unsloth's GRPO autocast off before the first step, so the lab's float32 model trains in float32 on a GPU
    as on a CPU.

    The model's `_unsloth_forced_float32` keeps Unsloth's generated config in float32 (fp16 = bf16 = False, no
    GradScaler), but its GRPO steps then choose their own autocast the first time one runs
    (`_unsloth_grpo_autocast` in unsloth/models/rl_replacements.py), and for a forced-float32 model that is float16
    (Gemma3's rule on a T4), unscaled. Upstream chooses only while the trainer has no `_autocast_enabled`: this sets
    the three fields to what it latches on a CPU (autocast off; the dtype is then never read)."""
    import inspect

    from unsloth.models import rl_replacements

    choose = getattr(rl_replacements, "_unsloth_grpo_autocast", None)
    if choose is None or UNSLOTH_AUTOCAST_LATCH not in inspect.getsource(choose):
        raise RuntimeError("unsloth.models.rl_replacements._unsloth_grpo_autocast no longer starts with "
                           f"{UNSLOTH_AUTOCAST_LATCH!r}: the lab cannot keep its model out of Unsloth's GRPO autocast")
    trainer._autocast_enabled, trainer._autocast_dtype, trainer._autocast_force_float32 = False, torch.bfloat16, False


def precision_of(trainer: Any) -> str:
    """The precision a trainer trained in: Unsloth's own GRPO autocast where it latched one on the trainer, else its
    config's ('bf16' or 'fp16' autocast), else 'fp32'."""
    if getattr(trainer, "_autocast_enabled", False):
        return "fp16" if trainer._autocast_dtype == torch.float16 else "bf16"
    args = trainer.args
    return "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"


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


BEYOND = 1e-5  # an effective beta at the bisection's floor (1e-6): the policy is beyond every pi*_beta'


def exact_figures(tree: Tree, logp: torch.Tensor, beta: float) -> dict[str, Any]:
    """The tabular lab's exact figures of one prompt's policy (log pi(y) of every completion) against pi*_beta of the
    tree's reference, and the effective beta: the beta' with KL(pi*_beta' || pi_ref) = KL(pi || pi_ref), or None where
    the policy is further from the reference than every optimum (the reference restricted to rewarded completions is
    the furthest)."""
    figures = Figures.of(tree, logp, beta)
    effective = beta_for_kl(tree, figures.kl_ref)
    return {**dataclasses.asdict(figures), "effective_beta": effective if effective > BEYOND else None}


def summarise(per_prompt: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The figures averaged over prompts; the effective beta is None where any prompt's is (beyond every optimum)."""
    betas = [figures["effective_beta"] for figures in per_prompt]
    return {**{key: statistics.fmean(figures[key] for figures in per_prompt) for key in per_prompt[0]
               if key != "effective_beta"},
            "effective_beta": None if None in betas else statistics.fmean(betas)}


def over_seeds(per_seed: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """A row's figures over seeds: each averaged, KL(pi || pi*) and the effective beta kept per seed, and the seeds
    beyond every optimum counted (never averaged in: no run acted as a beta near 0)."""
    betas = [figures["effective_beta"] for figures in per_seed]
    real = [beta for beta in betas if beta is not None]
    return {**{key: statistics.fmean(figures[key] for figures in per_seed) for key in per_seed[0]
               if key != "effective_beta"},
            "effective_beta": statistics.fmean(real) if real else None, "effective_beta_seeds": betas,
            "kl_opt_seeds": [figures["kl_opt"] for figures in per_seed], "beyond_seeds": len(betas) - len(real)}


def scaling(scale_rewards: Any) -> str:
    """A trainer's `scale_rewards` as the tabular lab names it (True is "group", False "none", as TRL reads them)."""
    if isinstance(scale_rewards, bool):
        return "group" if scale_rewards else "none"
    return str(scale_rewards)


# ----- the prediction: the tabular lab on what the trainer computes -------------------------------------------------

# The trainer's fields a row records and the prediction reads: those that decide the fixed point, then the runtime
# fields Unsloth's config changes from TRL's defaults (so that a row says what ran), then this package's.
PREDICTED_FIELDS = ("beta", "loss_type", "scale_rewards", "num_generations", "num_iterations", "steps_per_generation",
                    "gradient_accumulation_steps", "importance_sampling_level", "use_bias_correction_kl",
                    "mask_truncated_completions", "temperature")  # what `prediction_of` reads of TRL's fields
TRAINER_FIELDS = (*PREDICTED_FIELDS, "epsilon", "epsilon_high", "top_k", "top_p", "learning_rate", "lr_scheduler_type",
                  "warmup_steps", "warmup_ratio", "optim", "weight_decay", "max_grad_norm", "seed")


def settings_in_effect(args: Any) -> dict[str, Any]:
    """{field: value} of a trainer config as the trainer runs it (`TRAINER_FIELDS`, then the adaptive-KL fields);
    enums as their values, so that it is JSON."""
    def plain(value: Any) -> Any:
        return value.value if isinstance(value, enum.Enum) else value

    return {name: plain(getattr(args, name, None)) for name in (*TRAINER_FIELDS, *FIELD_DEFAULTS)}


@dataclass(frozen=True)
class Prediction:
    """How the tabular lab models a trainer's settings: `setting` with the estimator the trainer computes, its loss
    type and reward scaling, trained at `beta` (the trainer's own) with groups of `group_size`; `unmodelled`: what the
    trainer does that the tabular lab (on-policy single steps of a free table) does not, by name."""

    setting: Setting
    beta: float
    group_size: int
    unmodelled: tuple[str, ...]


def prediction_of(in_effect: dict[str, Any], lora: bool = False) -> Prediction:
    """The tabular model of a trainer's settings in effect (`settings_in_effect`). The trainer's own k3 in the loss
    with `use_bias_correction_kl=True` (TRL >= 1.10's default, which Unsloth follows) is k3 times the importance
    ratio pi / pi_old: on-policy its value is k3 and its gradient k2's, the lab's `k3+`, so the prediction runs k3+
    there (and k3 where the trainer applies no ratio, trl 1.9's default)."""
    fields = {name: in_effect[name] for name, default in FIELD_DEFAULTS.items()
              if in_effect.get(name, default) != default}
    config = AdaptiveKLConfig(**fields)
    beta = float(in_effect["beta"])
    placement = "off" if beta == 0 else "reward" if config.kl_in_reward else "loss"
    if placement == "loss" and config.reads_trainer_kl and in_effect.get("use_bias_correction_kl"):
        fields["kl_estimator"] = "k3+"
    unmodelled = []
    passes = in_effect.get("num_iterations") or 1
    if passes > 1:
        unmodelled.append(f"num_iterations={passes}: {passes} clipped passes over each batch")
    accumulation = in_effect.get("gradient_accumulation_steps") or 1
    steps = in_effect.get("steps_per_generation") or accumulation
    if steps > accumulation:
        unmodelled.append(f"steps_per_generation={steps}: optimizer steps on completions sampled by an earlier policy")
    if in_effect.get("importance_sampling_level") == "sequence":
        unmodelled.append("importance_sampling_level='sequence': one ratio per completion")
    if in_effect.get("mask_truncated_completions"):
        unmodelled.append("mask_truncated_completions=True: completions without EOS leave the loss")
    if in_effect.get("temperature") not in (None, 1.0):
        unmodelled.append(f"temperature={in_effect['temperature']}: sampling from a tempered policy")
    if lora:
        unmodelled.append("LoRA: only the adapters train (the tabular lab trains every logit)")
    tabular = Setting("the trainer's settings", placement, tuple(fields.items()), str(in_effect["loss_type"]),
                      scaling(in_effect["scale_rewards"]), beta_scale="passed")
    return Prediction(tabular, beta, int(in_effect.get("num_generations") or GROUP_SIZE), tuple(unmodelled))


def tabular_prediction(environment: Environment, prediction: Prediction, objective_beta: float,
                       tables: dict[str, torch.Tensor], seed: int = 0) -> dict[str, Any]:
    """The tabular lab's figures for `prediction` against pi*_objective_beta: on-policy single steps, started from
    each training prompt's reference table (the model's initial one), averaged over the prompts, with what it does
    not model (`unmodelled`) and the estimator it ran."""
    training = Training(group_size=prediction.group_size)
    per_prompt = []
    for prompt in TRAIN_PROMPTS:
        tree = Tree(environment, tables[prompt].float())
        run = train(tree, prediction.setting, prediction.beta, training, seed)
        per_prompt.append(exact_figures(tree, run.logp, objective_beta))
    estimator = AdaptiveKLConfig(**dict(prediction.setting.config)).estimator
    return {**summarise(per_prompt), "estimator": estimator if isinstance(estimator, str) else estimator.__name__,
            "unmodelled": list(prediction.unmodelled)}


def run_trainer_table(trainer: str, settings: Sequence[Setting], recipes: Sequence[str], beta: float, steps: int,
                      seeds: Sequence[int], processes: int = 1, overrides: Sequence[tuple[str, Any]] = (),
                      learning_rate: Optional[float] = None, environment: str = "contains_a",
                      pad_is_eos: bool = False, pairs: Optional[Collection[tuple[str, str]]] = None,
                      start_method: Optional[str] = None) -> dict[str, Any]:
    """Every setting x recipe x seed through `trainer` (worker processes, one trainer each), or only the (recipe,
    setting label) `pairs`; per row the exact figures averaged over the training prompts and then over seeds, each
    seed's KL(pi || pi*), the held-out prompt's figures and the tabular prediction. `start_method`: how the workers
    start (multiprocessing's; None: 'spawn' where CUDA is available, else 'fork')."""
    env = ENVIRONMENTS[environment]
    tables = reference_tables(env, (*TRAIN_PROMPTS, HELD_OUT), pad_is_eos)
    runs = [LabRun(trainer, setting, RECIPES[recipe], beta, steps, seed, learning_rate, tuple(overrides), environment,
                   pad_is_eos)
            for recipe in recipes for setting in settings for seed in seeds
            if pairs is None or (recipe, setting.label) in pairs]
    # fork is quick, but a process that has asked CUDA anything (importing trl does) forks children that cannot use
    # it: on a GPU each worker starts afresh
    start = start_method or ("spawn" if torch.cuda.is_available() else "fork")
    with multiprocessing.get_context(start).Pool(processes) as pool:
        results = pool.map(_worker, [(run, tables) for run in runs], chunksize=1)
    predictions: dict[Prediction, dict[str, Any]] = {}
    rows = []
    for index in range(0, len(runs), len(seeds)):
        run, mine = runs[index], results[index:index + len(seeds)]
        recipe = next(name for name, recipe in RECIPES.items() if recipe == run.recipe)
        row = {"recipe": recipe, "setting": run.setting.label, "placement": run.setting.placement,
               "config": run.setting.config_fields()}
        if "refused" in mine[0]:
            rows.append({**row, "refused": mine[0]["refused"]})
            continue
        trees = {prompt: Tree(env, tables[prompt]) for prompt in (*TRAIN_PROMPTS, HELD_OUT)}
        trained = [summarise([exact_figures(trees[p], trees[p].log_probs(result["tables"][p]), beta)
                              for p in TRAIN_PROMPTS]) for result in mine]
        held_out = [exact_figures(trees[HELD_OUT], trees[HELD_OUT].log_probs(result["tables"][HELD_OUT]), beta)
                    for result in mine]
        in_effect = mine[0]["in_effect"]
        prediction = prediction_of(in_effect, run.recipe.lora)
        if prediction not in predictions:
            predictions[prediction] = tabular_prediction(env, prediction, beta, tables)
        rows.append({**row, "learning_rate": run.lr, "in_effect": in_effect, "train": over_seeds(trained),
                     "held_out": over_seeds(held_out), "tabular": predictions[prediction],
                     "pad_probability": max(result["pad_probability"] for result in mine),
                     **{key: mine[0][key] for key in ("logprob_path", "precision") if key in mine[0]}})
    return {"trainer": trainer, "environment": dataclasses.asdict(env), "beta": beta, "steps": steps,
            "seeds": list(seeds), "batch": BATCH, "group_size": GROUP_SIZE, "train_prompts": list(TRAIN_PROMPTS),
            "held_out": HELD_OUT, "overrides": dict(overrides), "pad_is_eos": pad_is_eos,
            "recipes": {name: RECIPES[name].label for name in recipes}, "rows": rows}


# ----- output -------------------------------------------------------------------------------------------------------

STEPS = 800
# The end-to-end guard's bounds (tests/test_trainer_lab.py, tests/test_unsloth.py, the GPU check's unsloth-guard):
# KL(pi || pi*_beta) averaged over the training prompts, and the effective beta's distance to beta, relative. Noise
# floor (docs/results/kl_lab_trl.json, 800 steps, two seeds): k1 in the reward 0.0005 to 0.0013 in dr_grpo, the
# defaults, accumulation, steps_per_generation=2 and LoRA, k1_future in the loss 0.0011 to 0.0019; a beta off by a
# factor 1.25 (a normaliser off by a quarter) lands over 0.005 away and a factor 2 over 0.05 (tests/test_trainer_lab.py).
GUARD_TOLERANCE = 0.005
GUARD_BETA_TOLERANCE = 0.05
HEADER = ["setting", "beta trained", "E[r]", "E[length]", "KL(pi||pi_ref)", "KL(pi||pi*) [seeds]",
          "effective beta [seeds]", "tabular: KL(pi||pi*) (estimator)", "measured - tabular", "tabular: effective beta",
          "held out: KL(pi||pi*)", "held out: effective beta"]


def parse_overrides(pairs: Sequence[str]) -> tuple[tuple[str, Any], ...]:
    """`FIELD=VALUE` pairs, FIELD a GRPOConfig field; VALUE is read as a Python literal where it is one (2, 0.5, True,
    None), else a string."""
    import ast

    import trl

    fields = {field.name for field in dataclasses.fields(trl.GRPOConfig)}
    parsed = []
    for pair in pairs:
        name, separator, text = pair.partition("=")
        if not separator or not name:
            raise SystemExit(f"--set {pair!r}: expected FIELD=VALUE, e.g. --set loss_type=dapo num_iterations=2")
        if name not in fields:  # else a TypeError inside every worker process
            raise SystemExit(f"--set {pair!r}: {name!r} is not a field of GRPOConfig")
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            value = text
        parsed.append((name, value))
    return tuple(parsed)


def _kl(value: float) -> str:
    return "0" if abs(value) < 5e-5 else f"{value:.4f}"


def _beta(value: Optional[float]) -> str:
    """An effective beta; None: the policy's KL is beyond every pi*_beta' (more than pi*_0's)."""
    return "beyond pi*" if value is None else f"{value:.3g}"


def _spread(values: Sequence[Optional[float]], cell: Any) -> str:
    """Each seed's value, as a range (or the count beyond every optimum), after the mean; nothing for one seed."""
    real = [value for value in values if value is not None]
    if len(values) < 2:
        return ""
    beyond = len(values) - len(real)
    if beyond:
        return f" ({beyond} of {len(values)} seeds beyond pi*)"
    return f" [{cell(min(real))} - {cell(max(real))}]"


def not_modelled(rows: Sequence[dict[str, Any]]) -> list[str]:
    """What the trainer did in these rows that the tabular prediction does not model, each once."""
    return list(dict.fromkeys(note for row in rows if "tabular" in row for note in row["tabular"]["unmodelled"]))


def trainer_rows(table: dict[str, Any]) -> list[tuple[str, list[list[str]]]]:
    """The table's rows as text cells, one group a recipe: [(recipe label and what the tabular prediction does not
    model there, [[setting, figures...], ...]), ...]."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for row in table["rows"]:
        groups.setdefault(row["recipe"], []).append(row)
    out = []
    for recipe, rows in groups.items():
        cells = []
        for row in rows:
            if "refused" in row:
                reason = row["refused"].split(": allowed is ")[0]
                # in the setting's cell: under the "beta trained" header it read as a beta
                cells.append([f"{row['setting']}: refused before training ({reason})", *["-"] * (len(HEADER) - 1)])
                continue
            train, tabular, held_out = row["train"], row["tabular"], row["held_out"]
            cells.append(
                [row["setting"], f"{row['in_effect']['beta']:.4g}", f"{train['reward']:.3f}", f"{train['length']:.3f}",
                 f"{train['kl_ref']:.3f}", _kl(train["kl_opt"]) + _spread(train["kl_opt_seeds"], _kl),
                 _beta(train["effective_beta"]) + _spread(train["effective_beta_seeds"], _beta),
                 f"{_kl(tabular['kl_opt'])} ({tabular['estimator']})", _kl(train["kl_opt"] - tabular["kl_opt"]),
                 _beta(tabular["effective_beta"]), _kl(held_out["kl_opt"]), _beta(held_out["effective_beta"])])
        notes = not_modelled(rows)
        label = table["recipes"][recipe] + (f" (not in the tabular prediction: {'; '.join(notes)})" if notes else "")
        out.append((label, cells))
    return out


SIDE_BY_SIDE = ["recipe", "setting", "TRL: KL(pi||pi*)", "Unsloth: KL(pi||pi*)", "Unsloth - TRL",
                "TRL: effective beta", "Unsloth: effective beta", "tabular: KL(pi||pi*) (estimator)"]


def side_by_side(trl: dict[str, Any], unsloth: dict[str, Any]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(TRL's row, Unsloth's row) for each recipe and setting both tables trained."""
    theirs = {(row["recipe"], row["setting"]): row for row in unsloth["rows"]}
    pairs = [(row, theirs.get((row["recipe"], row["setting"]))) for row in trl["rows"]]
    return [(mine, other) for mine, other in pairs
            if other is not None and "refused" not in mine and "refused" not in other]


def side_by_side_rows(trl: dict[str, Any], unsloth: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """(header, rows): each recipe and setting both tables ran, TRL's figures beside Unsloth's, the difference, and
    the tabular lab's prediction for TRL's settings in effect."""
    rows = []
    for mine, other in side_by_side(trl, unsloth):
        rows.append([trl["recipes"][mine["recipe"]], mine["setting"], _kl(mine["train"]["kl_opt"]),
                     _kl(other["train"]["kl_opt"]), _kl(other["train"]["kl_opt"] - mine["train"]["kl_opt"]),
                     _beta(mine["train"]["effective_beta"]), _beta(other["train"]["effective_beta"]),
                     f"{_kl(mine['tabular']['kl_opt'])} ({mine['tabular']['estimator']})"])
    return SIDE_BY_SIDE, rows


def _row(table: dict[str, Any], recipe: str, setting: str) -> Optional[dict[str, Any]]:
    return next((row for row in table["rows"] if (row["recipe"], row["setting"]) == (recipe, setting)
                 and "refused" not in row), None)


def _seeds(row: dict[str, Any]) -> str:
    """A row's KL(pi || pi*) with its seeds' range, e.g. '0.0009 [0.0004 - 0.0014]'."""
    return _kl(row["train"]["kl_opt"]) + _spread(row["train"]["kl_opt_seeds"], _kl)


def inside(value: float, row: dict[str, Any]) -> bool:
    """Whether `value` lies within the row's seeds' range of KL(pi || pi*) (with one seed: equal to 4 decimals)."""
    seeds = row["train"]["kl_opt_seeds"]
    return min(seeds) - 5e-5 <= value <= max(seeds) + 5e-5


def without_fixed_point(row: dict[str, Any]) -> Optional[str]:
    """Why a row's setting has no fixed point for the tabular lab to predict (where it ends depends on the training
    budget, which the tabular lab's differs from a trainer's), or None."""
    methods = str(row["in_effect"].get("kl_adaptation_method") or "none").split("+")
    if "dynamic" in methods:
        return "dynamic's beta decays as long as the reward stays high"
    if "clip" in methods:
        return "clip leaves no KL gradient above its threshold"
    if row["placement"] == "reward" and row["tabular"]["estimator"] not in K1_VALUED:
        return "an estimator other than the log-ratio in the reward does not regularise in the exact lab"
    return None


def findings(table: dict[str, Any]) -> list[str]:
    """What a trainer table shows, as sentences whose every figure is computed from it: the noise floor, measured
    against predicted, the settings that do not regularise, the trainer's defaults, LoRA against full fine-tuning,
    the held-out prompt."""
    out: list[str] = []
    k1 = [row for row in table["rows"] if row["setting"] == "k1 in the reward" and "refused" not in row]
    full = [row for row in k1 if not row["tabular"]["unmodelled"]]
    others = [row for row in k1 if row["tabular"]["unmodelled"] and row["recipe"] != "lora"]
    if full:
        values = [value for row in full for value in row["train"]["kl_opt_seeds"]]
        betas = [beta for row in full for beta in row["train"]["effective_beta_seeds"] if beta is not None]
        out.append(f"**k1 in the reward, the noise floor**: over {counted(len(values), 'run')} "
                   f"({counted(len(full), 'recipe')} the tabular lab models x seeds) it ends {span(values, _kl)} from "
                   f"pi*_{table['beta']:g}, at an effective beta of {span(betas, '{:.3g}'.format)}: " + "; ".join(
                       f"`{row['recipe']}` {_seeds(row)}" for row in full) + (
                   "; in the recipes the tabular lab does not model: " + "; ".join(
                       f"`{row['recipe']}` {_seeds(row)}" for row in others) if others else "") + ".")
    modelled = [row for row in table["rows"] if "tabular" in row and not row["tabular"]["unmodelled"]
                and row["placement"] != "off"]  # beta = 0 has no fixed point to predict
    why = [(row, without_fixed_point(row)) for row in modelled if row not in full]  # full: the noise floor's rows
    budget = [(row, reason) for row, reason in why if reason]
    predicted = [row for row, reason in why if not reason]
    if predicted:
        # The prediction is one sampled tabular run and each measured seed one trainer run: they agree where the
        # prediction lies within the seeds' range widened by the noise floor (the k1-in-the-reward runs' largest
        # distance to pi*, where the exact answer is 0)
        floor = max((value for row in full for value in row["train"]["kl_opt_seeds"]), default=0.0)
        agree = [row for row in predicted if min(row["train"]["kl_opt_seeds"]) - floor <= row["tabular"]["kl_opt"]
                 <= max(row["train"]["kl_opt_seeds"]) + floor]
        worst = max(predicted, key=lambda row: abs(row["train"]["kl_opt"] - row["tabular"]["kl_opt"]))
        k3 = [row for row in predicted if row["tabular"]["estimator"] == "k3+"]
        sentence = (f"**Measured against predicted**, in the {len(predicted)} rows whose recipe the tabular lab models "
                    "(on-policy, full fine-tuning) and whose setting has a fixed point (k1 in the reward, the noise "
                    f"floor's source, aside): the prediction lies within the seeds' range widened by the noise floor "
                    f"({_kl(floor)}) in {len(agree)}; the largest difference "
                    f"is `{worst['recipe']}`, {worst['setting']}: {_seeds(worst)} against "
                    f"{_kl(worst['tabular']['kl_opt'])} predicted.")
        if k3:
            sentence += (f" The {len(k3)} rows on the trainer's k3 times the importance ratio are predicted with k3+ "
                         "(on-policy the same value and gradient): " + "; ".join(
                             f"`{row['recipe']}`, {row['setting']} {_seeds(row)} against "
                             f"{_kl(row['tabular']['kl_opt'])}" for row in k3) + ".")
        if budget:
            reasons = dict.fromkeys(reason for _, reason in budget)
            sentence += (f" The {len(budget)} rows whose setting has no fixed point end where the training budget "
                         f"leaves them ({'; '.join(reasons)}), so the tabular lab's run, on its own budget, predicts "
                         "none of them: " + "; ".join(f"`{row['recipe']}`, {row['setting']} {_seeds(row)}"
                                                     for row, _ in budget) + ".")
        out.append(sentence)
    off, k3_reward = _row(table, "dr_grpo", "beta = 0 (no KL)"), _row(table, "dr_grpo", "k3 in the reward")
    if off and k3_reward:
        sentence = (f"**k3 in the reward** ends {_seeds(k3_reward)} from pi* with dr_grpo, where beta = 0 ends "
                    f"{_seeds(off)}")
        k3, none, k1 = (_row(table, "defaults", setting)
                        for setting in ("k3 in the reward", "beta = 0 (no KL)", "k1 in the reward"))
        if k3 and none and k1:  # the group scaling changes what it does (it is not the exact lab's environment)
            sentence += (f"; under the trainer's defaults {_seeds(k3)}, where beta = 0 ends {_seeds(none)} and k1 in "
                         f"the reward {_seeds(k1)}")
        out.append(sentence + ".")
    defaults = [row for row in table["rows"] if row["recipe"] == "defaults" and row["placement"] == "loss"
                and "refused" not in row]
    k1_defaults = _row(table, "defaults", "k1 in the reward")
    if defaults and k1_defaults:
        effect = defaults[0]["in_effect"]
        out.append(f"**The trainer's defaults** (loss_type={effect['loss_type']!r}, scale_rewards="
                   f"{effect['scale_rewards']!r}) make a loss-side beta of {effect['beta']:g} act as: " + "; ".join(
                       f"{row['setting']} {_beta(row['train']['effective_beta'])}" for row in defaults)
                   + f", where k1 in the reward acts as {_beta(k1_defaults['train']['effective_beta'])}.")
    lora, full_k1 = _row(table, "lora", "k1 in the reward"), _row(table, "dr_grpo", "k1 in the reward")
    if lora and full_k1:
        out.append(f"**LoRA** (rank 8, the same recipe and learning rate): k1 in the reward ends {_seeds(lora)} from "
                   f"pi* at an effective beta of {_beta(lora['train']['effective_beta'])}, full fine-tuning "
                   f"{_seeds(full_k1)}.")
    held = [row for row in (off, _row(table, "dr_grpo", "k1 in the reward")) if row]
    if held:
        out.append("**The prompt never trained on**: " + "; ".join(
            f"{row['setting']} ends {_kl(row['held_out']['kl_opt'])} from its pi* (effective beta "
            f"{_beta(row['held_out']['effective_beta'])})" for row in held) + ".")
    return out


def differences(trl: dict[str, Any], unsloth: dict[str, Any]) -> list[str]:
    """TRL against Unsloth on the same GRPOConfig, computed: how many of Unsloth's rows lie within TRL's seeds' range,
    and each row outside it with both figures."""
    pairs = side_by_side(trl, unsloth)
    outside = [(mine, other) for mine, other in pairs if not inside(other["train"]["kl_opt"], mine)]
    return [f"**Unsloth against TRL**: in {len(pairs) - len(outside)} of {len(pairs)} rows Unsloth's KL(pi||pi*) lies "
            "within TRL's seeds' range" + (": the others, TRL's range against Unsloth's figure: " + "; ".join(
                f"`{mine['recipe']}`, {mine['setting']} {_seeds(mine)} against "
                f"{_kl(other['train']['kl_opt'])}" for mine, other in outside) if outside else "") + "."]


def pad_is_eos_finding(eos: dict[str, Any], trl: dict[str, Any], unsloth: dict[str, Any]) -> str:
    """The trainer's own k3 in the loss with dr_grpo, where Unsloth's pad is EOS, against TRL's and Unsloth's with a
    pad token of their own."""
    label = "k3 in the loss (the trainer's own)"
    mine, theirs, own = (_row(table, "dr_grpo", label) for table in (eos, trl, unsloth))
    if not (mine and theirs and own):
        return "(no dr_grpo row of the trainer's own k3 in all three tables)"
    return (f"the trainer's own k3 in the loss ends {_seeds(mine)} from pi* with pad = EOS (effective beta "
            f"{_beta(mine['train']['effective_beta'])}), against TRL's {_seeds(theirs)} and Unsloth's own "
            f"{_seeds(own)} with a pad token of its own.")


def describe(table: dict[str, Any]) -> str:
    """One sentence: how the table's runs were made (beside every figure of it)."""
    trained = [row for row in table["rows"] if "refused" not in row]
    rate = ", ".join(f"{value:g}" for value in sorted({row["learning_rate"] for row in trained})) or "-"
    overrides = "; --set " + " ".join(f"{k}={v!r}" for k, v in table["overrides"].items()) if table["overrides"] else ""
    groups = table["batch"] // table["group_size"]
    return (f"{table['trainer']}: beta = {table['beta']}, {table['batch']} completions a step ({groups} groups of "
            f"{table['group_size']}), prompts {', '.join(table['train_prompts'])} "
            f"(held out: {table['held_out']}), {table['steps']} steps, AdamW at {rate} decayed linearly to 0, "
            f"seeds {', '.join(map(str, table['seeds']))} averaged{overrides}; " + (
                "pad = EOS" if table["pad_is_eos"] else "a pad token of its own, which no run can sample (its logit "
                f"is fixed at {PAD_LOGIT:g}: `bias_unit`)"))


def mistyped(config_class: Any, overrides: dict[str, Any], error: TypeError) -> str:
    """Why `config_class(**overrides)` raised `error`: each override whose value is not of its field's default's type
    (a field without a default or with None is not named: its type is not known here), with the config's own error."""
    defaults = {field.name: field.default for field in dataclasses.fields(config_class)
                if field.default not in (None, dataclasses.MISSING)}
    named = [f"{name}={value!r} is invalid: allowed is a value of type {type(defaults[name]).__name__}"
             for name, value in overrides.items() if name in defaults and not isinstance(value, type(defaults[name]))]
    return f"{'; '.join(named) or 'a value of the wrong type'} ({config_class.__name__}: {error})"


def predict(args: Any) -> dict[str, Any]:
    """`kl_lab --predict --trainer T --set FIELD=VALUE ...`: the tabular lab's prediction for a GRPOConfig as trainer T
    runs it (its defaults, Unsloth's changes to them), by the rule the trainer rows use (`prediction_of`), against
    pi*_beta (beta: --beta if given, else the config's), beside k1 in the reward at that beta. No trainer is built
    and no file is left (`unsloth_cache_aside`); a --set value the trainer would refuse as it is built is refused
    first."""

    if args.trainer not in TRAINERS:
        raise SystemExit(f"--predict: --trainer {args.trainer} is not a trainer; use --trainer trl or unsloth")
    with unsloth_cache_aside():  # no trainer is built, so Unsloth's generated source is no file of the user's
        config_class, _ = import_trainer(args.trainer)
    from ..integrations.trainer_hooks import checked_runtime  # here: the tabular lab imports this module too

    with tempfile.TemporaryDirectory() as folder, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a setting the package warns about is still predicted
        machine = {} if torch.cuda.is_available() else {"use_cpu": True, "bf16": False}  # no effect on the KL
        overrides = dict(parse_overrides(args.overrides))
        given = f"--predict: --set {' '.join(args.overrides)}"
        try:  # a --set value the config or the trainer refuses: its own message, not a traceback
            config = config_class(**{"output_dir": folder, "report_to": "none", **machine, **overrides})
            # what the trainer checks as it is built, which a training run reports as the row's refusal:
            # num_iterations='abc' or loss_type='bogus' would otherwise reach the prediction and raise there
            checked_runtime(config, config.beta, config.loss_type)
        except TypeError as error:  # TRL's config computes with some fields (num_generations) before checking them
            raise SystemExit(f"{given}: {mistyped(config_class, overrides, error)}") from None
        except ValueError as error:
            raise SystemExit(f"{given}: {error}") from None
        in_effect = settings_in_effect(config)
    beta = args.beta if args.beta is not None else in_effect["beta"]
    if not beta:
        raise SystemExit("--predict: beta is 0 (TRL's default: no KL term); set it, e.g. --set beta=0.04, or give "
                         "--beta, the beta of the optimum to measure against")
    env = ENVIRONMENTS["contains_a" if args.env == "all" else args.env]
    tables = reference_tables(env, TRAIN_PROMPTS, args.pad_is_eos)
    mine = prediction_of(in_effect)
    k1 = dataclasses.replace(mine, beta=beta, unmodelled=(), setting=dataclasses.replace(
        mine.setting, placement="reward", config=(("kl_placement", "reward"), ("kl_estimator", "k1"))))
    figures = {"the config": tabular_prediction(env, mine, beta, tables),
               f"k1 in the reward at beta={beta:g}": tabular_prediction(env, k1, beta, tables)}
    show(f"{args.trainer}: where the tabular lab puts this config (against pi*_{beta:g}; {GROUP_SIZE}-completion "
         "groups, on-policy single steps, this lab's model's reference)",
         ["setting", "beta", "estimator", "E[r]", "KL(pi||pi_ref)", "KL(pi||pi*)", "effective beta"],
         [[name, f"{(mine if name == 'the config' else k1).beta:.4g}", f["estimator"], f"{f['reward']:.3f}",
           f"{f['kl_ref']:.3f}", _kl(f["kl_opt"]), _beta(f["effective_beta"])] for name, f in figures.items()])
    notes = mine.unmodelled or ("nothing",)
    print(f"not modelled: {'; '.join(notes)}. A tabular policy has a free table per prefix (no function approximation)"
          "; ground-truth.md says what that leaves out.")
    return {"in_effect": in_effect, "beta": beta, "predictions": figures}


def main(args: Any, command: str) -> dict[str, Any]:
    """`kl_lab --trainer ...`: the table through each trainer asked for, printed, and written with --json."""
    import importlib.metadata
    import json
    import time

    unknown = [name for name in args.recipe if name not in RECIPES]
    if unknown:
        raise SystemExit(f"--recipe {', '.join(unknown)}: unknown; the recipes are {', '.join(RECIPES)}")
    if args.env == "all":
        args.env = "contains_a"
    start = time.perf_counter()
    settings = chosen(trainer_settings(), args.only)
    trainers = TRAINERS if args.trainer == "both" else (args.trainer,)
    versions = {}
    for name in ("torch", "transformers", "trl", "peft", *(("unsloth", "unsloth_zoo") if "unsloth" in trainers else ())):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    result: dict[str, Any] = {"command": command, "versions": versions, "trainers": {},
                              "machine": f"{hardware()}, {args.processes} worker processes", "commit": source_commit()}
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
    if not runs:  # every row refused (a bad --set, for one): no figure to write, and a script must see it failed
        reason = next(row["refused"] for t in result["trainers"].values() for row in t["rows"])
        raise SystemExit(f"kl_lab: every setting was refused before training ({reason}); nothing written")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result
