"""Demo: train LoRA policies with each adaptive-KL method side by side and show the difference.

The entry point is `blackwell/test_adaptive_kl_grpo.py` (not a pytest file: pytest collects only tests/); the
notebook `blackwell/adaptive_kl_grpo.ipynb` calls the same functions. With no arguments it runs on a CPU in minutes:

    python blackwell/test_adaptive_kl_grpo.py             # embedded tiny model, 7 methods x 3 seeds
    python blackwell/test_adaptive_kl_grpo.py --quick     # smoke run, under a minute
    python blackwell/test_adaptive_kl_grpo.py --kl-in-reward --kl-target 0.2 --kl-horizon 100   # KL in the reward
    python blackwell/test_adaptive_kl_grpo.py --ref-sync   # a moving reference: a hard sync every 30 steps
    python blackwell/test_adaptive_kl_grpo.py --model Qwen/Qwen2.5-0.5B-Instruct --backend auto   # GPU users

Default task: a character vocabulary a-h plus '#' and ':'. The reference policy (the tiny model, briefly
pretrained here) completes a prompt of 2-4 letters and ':' with 3-8 letters, rarely a '#'. The reward is 1 when
the completion contains '#'. It saturates within a few dozen steps, and the completion length is free, so what
happens to the length afterwards is decided by the KL term.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import random
import shlex
import statistics
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from ..core.config import AdaptiveKLConfig
from ..core.controllers import check_horizon
from ..core.reductions import kl_reduction, loss_types, reward_reduction
from ..core.registry import LENGTH_METHODS
from .machine import hardware, installed_versions, source_commit

DEFAULT_METHODS = ["none", "beta=0", "clip", "sigmoid", "length_normalized", "dynamic", "dynamic+length_normalized"]
# --kl-in-reward: the KL as a loss term (stock) against the KL in the reward, per-token mean and summed, and the
# target controller on the reward placement; beta=0 for the unregularised drift.
KL_IN_REWARD_VARIANTS = ["none", "reward:sequence_mean", "reward:sequence_sum", "reward:sequence_sum:target", "beta=0"]
# --ref-sync: stock against a hard reference reset (ref_model_mixup_alpha=1) every 30 steps, without and with the
# optimizer reset (ProRL's recipe).
REF_SYNC_VARIANTS = ["none", "ref_sync:30", "ref_sync:30:reset"]
QUICK = {"steps": 4, "seeds": 1, "pretrain_steps": 60}
# Completions a step trains on (per_device_train_batch_size; one process, no accumulation, one generation batch a
# step): the embedded tiny model's and a --model's.
TINY_BATCH, MODEL_BATCH = 16, 8
LOGGED = ["reward", "kl", "adaptive_kl/raw_kl", "adaptive_kl/adapted_kl", "adaptive_kl/current_beta",
          "adaptive_kl/sequence_kl", "adaptive_kl/length_kl_corr", "adaptive_kl/reward_penalty",
          "completions/mean_length", "adaptive_kl/ref_syncs", "step_time"]
ALPHABET = "abcdefgh"
TINY_LEARNING_RATE, MODEL_LEARNING_RATE = 5e-3, 5e-6  # --learning-rate's default for the tiny model / with --model


def build_parser() -> argparse.ArgumentParser:
    """The demo's command line (the docs' flag list is generated from it)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 4 steps, 1 seed, 60 pretraining steps (each unless given)")
    parser.add_argument("--methods", default=",".join(DEFAULT_METHODS),
                        help="comma-separated kl_adaptation_method values; 'beta=0' is stock with beta 0")
    parser.add_argument("--estimators", default="",
                        help="comma-separated kl_estimator values, each run as its own variant 'estimator=NAME'")
    parser.add_argument("--kl-reductions", default="",
                        help="comma-separated kl_reduction values, each run as its own variant 'kl_reduction=NAME'")
    parser.add_argument("--kl-in-reward", action="store_true",
                        help="compare the KL as a loss term with the KL in the reward: runs the variants "
                        + ", ".join(KL_IN_REWARD_VARIANTS) + " ('reward:REDUCTION[:METHOD]' is kl_placement='reward' "
                        "with that kl_reduction and kl_adaptation_method)")
    parser.add_argument("--ref-sync", action="store_true",
                        help="compare stock with a moving reference: runs the variants " + ", ".join(REF_SYNC_VARIANTS)
                        + " ('ref_sync:STEPS' is sync_ref_model=True with a hard reset, ref_model_mixup_alpha=1.0, "
                        "every STEPS optimizer steps; ':reset' adds ref_model_sync_reset_optimizer=True)")
    parser.add_argument("--steps", type=int, default=120, help="optimizer steps per run")
    parser.add_argument("--seeds", type=int, default=3, help="number of seeds per method")
    parser.add_argument("--output-dir", default="adaptive_kl_demo_output",
                        help="where the plot, metrics.csv, metrics.json and summary.json go")
    parser.add_argument("--model", default=None,
                        help="a model name or path (GPU users); default: the embedded tiny model")
    parser.add_argument("--backend", choices=["unsloth", "trl", "auto"], default="auto",
                        help="with --model: Unsloth FastLanguageModel (4-bit + LoRA) or transformers + PEFT")
    parser.add_argument("--beta", type=float, default=0.04, help="beta of every variant but beta=0")
    parser.add_argument("--kl-target", type=float, default=0.1, help="kl_target (sigmoid, target)")
    parser.add_argument("--kl-horizon", type=float, default=10000.0, help="kl_horizon (target)")
    parser.add_argument("--loss-type", default="dapo", help="GRPOConfig loss_type")
    parser.add_argument("--learning-rate", type=float, default=None,
                        help="default: {} for the tiny model, {} with --model".format(*(
                            f"{rate:.0e}".replace("e-0", "e-") for rate in (TINY_LEARNING_RATE, MODEL_LEARNING_RATE))))
    parser.add_argument("--pretrain-steps", type=int, default=300, help="tiny model: reference pretraining steps")
    return parser


SCRIPT = ("python", "blackwell/test_adaptive_kl_grpo.py")  # the demo from a checkout
MODULE = ("python", "-m", "unsloth_adaptive_kl.tools.demo")  # the same demo from an installed wheel


def parse_args(argv: list[str], launcher: tuple[str, ...] = SCRIPT) -> argparse.Namespace:
    """The run's settings, each checked (a bad one is a usage error, exit 2, before any training), with --output-dir
    created and written to; `args.command` is the command line that gives them, `launcher` then `argv` (what
    summary.json records: the notebook and tests pass `argv` themselves, so `sys.argv` would name their own
    process)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    args.command = shlex.join([*launcher, *argv])
    # what the command line gave, read against a parser whose defaults are None (argparse also takes abbreviations)
    unset = build_parser()
    unset.set_defaults(**{action.dest: None for action in unset._actions if action.dest != "help"})
    given = {name for name, value in vars(unset.parse_args(argv)).items() if value is not None}
    if args.quick:
        for name, value in QUICK.items():
            if name not in given:  # a value given beside --quick is kept (summary.json records both)
                setattr(args, name, value)

    def listed(value: str, prefix: str = "") -> list[str]:
        return [prefix + item.strip() for item in value.split(",") if item.strip()]

    if args.kl_in_reward and args.ref_sync:
        parser.error("--kl-in-reward and --ref-sync each select a list of variants: use one of them")
    if "methods" in given and (args.kl_in_reward or args.ref_sync):
        parser.error(f"--methods has no effect with {'--kl-in-reward' if args.kl_in_reward else '--ref-sync'}, "
                     "which selects its own variants: allowed is one of them")
    if "backend" in given and args.model is None:
        parser.error(f"--backend={args.backend} has no effect without --model (the embedded tiny model trains with "
                     "TRL): allowed with --model")
    if args.model is not None and not args.model.strip():  # an empty name would be read as "no --model"
        parser.error(f"--model={args.model!r} is invalid: allowed is a model name or path (without --model: the "
                     "embedded tiny model)")
    if "pretrain_steps" in given and args.model is not None:
        parser.error("--pretrain-steps has no effect with --model (it pretrains the embedded tiny model): allowed "
                     "without --model")
    if not 0 <= args.beta < math.inf:
        parser.error(f"--beta={args.beta} is invalid: allowed is a finite number >= 0")
    methods = (KL_IN_REWARD_VARIANTS if args.kl_in_reward else REF_SYNC_VARIANTS if args.ref_sync
               else listed(args.methods))
    requested = args.methods
    args.methods = methods + listed(args.estimators, "estimator=") + listed(args.kl_reductions, "kl_reduction=")
    if not args.methods:
        parser.error(f"--methods={requested!r} is invalid: allowed is a comma-separated list of at least one variant")
    for name, value, least in (("--steps", args.steps, 1), ("--seeds", args.seeds, 1),
                               ("--pretrain-steps", args.pretrain_steps, 0)):
        if value < least:
            parser.error(f"{name}={value} is invalid: allowed is an integer >= {least}")
    if args.learning_rate is None:  # resolved here, so that summary.json's settings record the rate the runs used
        args.learning_rate = TINY_LEARNING_RATE if args.model is None else MODEL_LEARNING_RATE
    elif not 0 < args.learning_rate < math.inf:
        parser.error(f"--learning-rate={args.learning_rate} is invalid: allowed is a finite number > 0")
    if args.loss_type not in loss_types():
        parser.error(f"--loss-type={args.loss_type!r} is invalid: allowed is one of {', '.join(sorted(loss_types()))}")
    from ..integrations.trainer_hooks import TRL_SYNC_FIELDS, check_trl_settings  # TRL's rules (imports trl)

    read = set()
    labels: dict[tuple, str] = {}  # each variant's resolved settings -> its label
    for method in args.methods:  # bad names and values fail here, before any training, as usage errors
        try:
            settings = variant_settings(method, args.beta)
            trl_fields = {k: settings.pop(k) for k in TRL_SYNC_FIELDS if k in settings}  # TRL's, not AdaptiveKLConfig's
            fields = method_fields(settings, args)
            read |= set(fields)
            config = AdaptiveKLConfig(**settings, **fields)
            config.validate_adaptive_kl(beta=trl_fields["beta"])  # as GRPOConfig does: beta, and the bounds it sets
            check_trl_settings(argparse.Namespace(**trl_fields), config)
            if "target" in config.kl_methods:  # the trainer's check at its construction, after the pretraining
                check_horizon(config, TINY_BATCH if args.model is None else MODEL_BATCH, trl_fields["beta"])
        except ValueError as error:
            parser.error(f"variant {method!r}: {error}")
        if args.beta == 0 and method != "beta=0":  # the KL term is off: the variant would train as 'beta=0' does
            parser.error(f"--beta={args.beta} turns the KL term off, so variant {method!r} would be the same run as "
                         "'beta=0': allowed is --beta > 0, or --beta 0 with only the variant 'beta=0'")
        key = resolved_settings(config, trl_fields, args.loss_type)
        if key in labels:  # the same run twice, shown as two variants (or, under one label, merged into one)
            parser.error(f"variant {method!r} is listed twice: allowed is each variant once" if labels[key] == method
                         else f"variants {labels[key]!r} and {method!r} are the same settings: allowed is each variant "
                         "once")
        labels[key] = method
        sync_steps = trl_fields.get("ref_model_sync_steps")
        if sync_steps is not None and sync_steps >= args.steps:  # the same run as 'none', under another label
            parser.error(f"variant {method!r} syncs the reference after every {sync_steps} steps, and --steps="
                         f"{args.steps} ends the run before any step trains against a synced one: allowed is a sync "
                         "every STEPS < --steps")
    if "beta" in given and args.beta != 0 and set(args.methods) == {"beta=0"}:  # summary.json would record it
        parser.error(f"--beta={args.beta} has no effect: the only variant, 'beta=0', trains without the KL term "
                     "(allowed with a variant that has one)")
    for flag, field_name in (("--kl-target", "kl_target"), ("--kl-horizon", "kl_horizon")):
        if field_name in given and field_name not in read:  # nothing silently does nothing, the default value included
            parser.error(f"{flag}={getattr(args, field_name)} has no effect: no variant of this run reads {field_name} "
                         "(allowed with a variant that does: sigmoid or target for --kl-target, target for "
                         "--kl-horizon)")
    try:  # last, so that a usage error above creates no folder; before any training, so that no run is lost to it
        os.makedirs(args.output_dir, exist_ok=True)
        with tempfile.TemporaryFile(dir=args.output_dir):
            pass
    except OSError as error:
        parser.error(f"--output-dir={args.output_dir!r} is invalid ({type(error).__name__}: {error}): allowed is a "
                     "writable directory")
    return args


def resolved_settings(config: AdaptiveKLConfig, trl_fields: dict[str, Any], loss_type: str) -> tuple:
    """What a variant trains with, whatever its label spells: every AdaptiveKLConfig field (defaults included, the
    methods in the canonical order the config stores, the estimator the placement resolves None to, the reduction in
    effect under `loss_type`, which is length normalisation's whole effect) and the TRL fields it sets. Two labels
    with the same value (`dynamic+length_normalized` and `length_normalized+dynamic`, `ref_sync:5` and `ref_sync:05`,
    `none` and `kl_reduction=loss_type`, `length_normalized` and `kl_reduction=sequence_mean`, `reward:loss_type` and
    `reward:sequence_sum`) are one run."""
    values = {spec.name: getattr(config, spec.name) for spec in dataclasses.fields(config)}
    values["kl_estimator"] = config.estimator
    values["kl_adaptation_method"] = tuple(m for m in config.kl_methods if m not in LENGTH_METHODS)
    values["kl_reduction"] = (reward_reduction(config).name if config.kl_in_reward
                              else kl_reduction(config, loss_type))
    return tuple(sorted({**values, **trl_fields}.items()))


def variant_settings(label: str, beta: float) -> dict[str, Any]:
    """The GRPOConfig fields of a variant label: a kl_adaptation_method, 'beta=0', 'estimator=NAME',
    'kl_reduction=NAME', 'reward:REDUCTION[:METHOD]' (the KL in the reward) or 'ref_sync:STEPS[:reset]' (a hard
    reference reset every STEPS optimizer steps, with ':reset' also the optimizer's)."""
    if label == "beta=0":
        return {"kl_adaptation_method": "none", "beta": 0.0}
    if label.startswith("ref_sync:"):
        _, steps, *rest = label.split(":")
        if not steps.lstrip("-").isdigit() or rest not in ([], ["reset"]):
            raise ValueError(f"variant {label!r} is invalid: allowed is 'ref_sync:STEPS' or 'ref_sync:STEPS:reset' "
                             "with STEPS an integer >= 1")
        return {"sync_ref_model": True, "ref_model_sync_steps": int(steps), "ref_model_mixup_alpha": 1.0,
                "ref_model_sync_reset_optimizer": rest == ["reset"], "beta": beta}
    if label.startswith("reward:"):
        _, reduction, *method = label.split(":")
        if len(method) > 1:  # a part past the method would be dropped: the variant would not be what it says
            raise ValueError(f"variant {label!r} is invalid: allowed is 'reward:REDUCTION' or "
                             "'reward:REDUCTION:METHOD'")
        return {"kl_placement": "reward", "kl_reduction": reduction,
                "kl_adaptation_method": method[0] if method else "none", "beta": beta}
    for field_name in ("estimator", "kl_reduction"):
        if label.startswith(field_name + "="):
            key = "kl_estimator" if field_name == "estimator" else field_name
            return {key: label.split("=", 1)[1], "beta": beta}
    return {"kl_adaptation_method": label, "beta": beta}


def method_fields(settings: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """The demo's values of the fields only some methods read (`dynamic` decays above a reward of 0.8 with no
    cut-off; `--kl-target`, `--kl-horizon`), those that the variant's `settings` read: an unread one would warn."""
    variant = AdaptiveKLConfig.unvalidated_from(argparse.Namespace(**settings))
    values = {"reward_threshold": 0.8, "beta_schedule_steps": None, "kl_target": args.kl_target,
              "kl_horizon": args.kl_horizon}
    return {name: value for name, value in values.items() if variant.reads(name)}


# ----- the tiny default task ----------------------------------------------------------------------------------

def reference_text(rng: random.Random) -> tuple[str, str]:
    prompt = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(2, 4))) + ":"
    completion = [rng.choice(ALPHABET) for _ in range(rng.randint(3, 8))]
    if rng.random() < 0.1:  # '#' is rare under the reference policy
        completion[rng.randrange(len(completion))] = "#"
    return prompt, "".join(completion)


def hash_reward(completions: list[str], **kwargs: Any) -> list[float]:
    """1 when the completion contains '#', else 0."""
    return [1.0 if "#" in text else 0.0 for text in completions]


def pretrain_tiny_reference(steps: int, seed: int = 0) -> tuple[Any, dict]:
    """The tiny Llama trained by next-token prediction on reference completions; returns (tokenizer, weights)."""
    from .tiny import build_tiny_model, build_tokenizer

    tokenizer = build_tokenizer(ALPHABET + "#:")
    model = build_tiny_model(tokenizer, seed=seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    rng = random.Random(seed)
    for _ in range(steps):
        rows = []
        for _ in range(32):
            prompt, completion = reference_text(rng)
            rows.append(tokenizer(prompt + completion).input_ids + [tokenizer.eos_token_id])
        width = max(map(len, rows))
        ids = torch.tensor([row + [tokenizer.pad_token_id] * (width - len(row)) for row in rows])
        mask = (torch.arange(width)[None, :] < torch.tensor([len(r) for r in rows])[:, None]).long()
        labels = ids.masked_fill(mask == 0, -100)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return tokenizer, {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


@dataclass
class Task:
    """What a run needs: a fresh LoRA policy and its tokenizer per run (`make_policy(seed)`), the trainer class every
    run of the comparison uses, the prompts and the reward."""

    make_policy: Callable[[int], tuple[Any, Any]]
    trainer_class: type
    prompts: list[str]
    reward: Callable[..., list[float]]
    grpo_settings: dict = field(default_factory=dict)


def tiny_task(args: argparse.Namespace) -> Task:
    import trl

    from .tiny import add_lora, build_tiny_model

    tokenizer, weights = pretrain_tiny_reference(args.pretrain_steps)

    def make_policy(seed: int) -> tuple[Any, Any]:
        model = build_tiny_model(tokenizer)
        model.load_state_dict(weights)
        return add_lora(model, seed=seed), tokenizer

    rng = random.Random(1234)
    prompts = [reference_text(rng)[0] for _ in range(256)]
    settings = dict(per_device_train_batch_size=TINY_BATCH, num_generations=8, max_completion_length=24,
                    learning_rate=args.learning_rate, use_cpu=not torch.cuda.is_available(), bf16=False)
    return Task(make_policy, trl.GRPOTrainer, prompts, hash_reward, settings)


# ----- a real model (GPU users) -------------------------------------------------------------------------------

def arithmetic_reward(completions: list[str], answer: list[str], **kwargs: Any) -> list[float]:
    """1 when the completion's first number is the right answer."""
    import re

    rewards = []
    for text, expected in zip(completions, answer):
        text = text if isinstance(text, str) else text[-1]["content"]
        found = re.findall(r"-?\d+", text)
        rewards.append(1.0 if found and found[0] == expected else 0.0)
    return rewards


def mixed_precision() -> dict[str, bool]:
    """The GRPOConfig precision flags for this machine: ``{"bf16": ..., "fp16": ...}``.

    Rule: bf16 where CUDA is available and the GPU has native bf16 (Ampere or newer, e.g. A100, L4, H100); fp16
    where CUDA is available without it (e.g. a Colab T4, where bf16=True fails); neither on a CPU. The check passes
    ``including_emulation=False``: torch's default also counts bf16 that a T4 only emulates.
    """
    cuda = torch.cuda.is_available()
    bf16 = cuda and torch.cuda.is_bf16_supported(including_emulation=False)
    return {"bf16": bf16, "fp16": cuda and not bf16}


class ModelNotLoaded(Exception):
    """--model's model or tokenizer could not be loaded (a hub name without the network, a wrong path): unlike a
    run's other failures, every run would fail alike."""


@contextlib.contextmanager
def loading(model: str) -> Iterator[None]:
    """Turns the OSError (a name or path they cannot find) or ValueError (a folder without a model's or a tokenizer's
    files, an unknown model type) with which transformers and Unsloth refuse a model they cannot load into
    ModelNotLoaded naming --model; either raised elsewhere in a run (e.g. writing its output folder) stays what it
    is."""
    try:
        yield
    except (OSError, ValueError) as error:
        raise ModelNotLoaded(f"--model {model!r} could not be loaded: {type(error).__name__}: {error}") from error


def model_task(args: argparse.Namespace) -> Task:
    backend = args.backend
    if backend == "auto":
        import importlib.util

        backend = "unsloth" if torch.cuda.is_available() and importlib.util.find_spec("unsloth") else "trl"
    if backend == "unsloth":
        # Before trl.GRPOTrainer is read below: `import unsloth` replaces it with the UnslothGRPOTrainer it generates,
        # so every run of the comparison, the first included, trains with Unsloth's trainer.
        from unsloth import FastLanguageModel
    import trl

    def make_policy(seed: int) -> tuple[Any, Any]:
        if backend == "unsloth":  # with the tokenizer FastLanguageModel returns, Unsloth's fixes applied
            with loading(args.model):
                model, unsloth_tokenizer = FastLanguageModel.from_pretrained(args.model, max_seq_length=512,
                                                                             load_in_4bit=True)
            model = FastLanguageModel.get_peft_model(model, r=16, lora_alpha=32, random_state=seed,
                                                     target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
            return model, unsloth_tokenizer
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        with loading(args.model):
            model = AutoModelForCausalLM.from_pretrained(args.model, dtype="auto")
        return get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear")), tokenizer

    tokenizer = None
    if backend == "trl":  # one tokenizer for every run
        from transformers import AutoTokenizer

        with loading(args.model):
            tokenizer = AutoTokenizer.from_pretrained(args.model)
    rng = random.Random(1234)
    pairs = [(rng.randint(2, 49), rng.randint(2, 49)) for _ in range(256)]
    prompts = [[{"role": "user", "content": f"What is {a} + {b}? Reply with the number."}] for a, b in pairs]
    task = Task(make_policy, trl.GRPOTrainer, prompts, arithmetic_reward,
                dict(per_device_train_batch_size=MODEL_BATCH, num_generations=8, max_completion_length=128,
                     learning_rate=args.learning_rate, **mixed_precision()))
    task.grpo_settings["answers"] = [str(a + b) for a, b in pairs]
    return task


# ----- running and reporting ----------------------------------------------------------------------------------

def run_one(task: Task, method: str, seed: int, args: argparse.Namespace, on_step: Callable[[], None]) -> list[dict]:
    import trl
    from datasets import Dataset
    from transformers import PrinterCallback, TrainerCallback, set_seed

    class Progress(TrainerCallback):
        def on_step_end(self, *_: Any, **__: Any) -> None:
            on_step()

    settings = dict(task.grpo_settings)
    columns = {"prompt": task.prompts}
    if "answers" in settings:
        columns["answer"] = settings.pop("answers")
    variant = variant_settings(method, args.beta)
    config = trl.GRPOConfig(
        output_dir=os.path.join(args.output_dir, "runs", f"{method}-seed{seed}"),
        **variant, loss_type=args.loss_type, max_steps=args.steps, logging_steps=1, save_strategy="no",
        report_to="none", disable_tqdm=True, seed=seed, data_seed=seed, temperature=1.0,
        **method_fields(variant, args), **settings,
    )
    set_seed(seed)
    model, tokenizer = task.make_policy(seed)
    trainer = task.trainer_class(model=model, processing_class=tokenizer, reward_funcs=[task.reward], args=config,
                                 train_dataset=Dataset.from_dict(columns), callbacks=[Progress()])
    trainer.remove_callback(PrinterCallback)  # the progress bar and the table report; no per-step dicts
    trainer.train()
    rows = []
    for entry in trainer.state.log_history:
        if "reward" in entry:
            row = {"method": method, "seed": seed, "step": entry["step"]}
            # TRL logs None for a metric that was NaN on every micro-batch (e.g. a correlation of equal lengths)
            row.update({key: math.nan if entry.get(key) is None else entry[key] for key in LOGGED})
            if variant["beta"] == 0.0:  # the KL term is off: its coefficient is 0 and stock logs no KL
                row["adaptive_kl/current_beta"] = 0.0
            rows.append(row)
    return rows


def mean_std(values: list[float]) -> tuple[float, float]:
    values = [v for v in values if not math.isnan(v)]
    if not values:
        return math.nan, math.nan
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def summarise(rows: list[dict], methods: list[str], steps: int) -> list[dict]:
    """Per method: the mean and std over seeds of each seed's last-10%-of-steps average, and under `by_seed` each
    seed's average itself (a mean over seeds can sit between runs that drifted and runs that did not)."""
    window = max(1, steps // 10)
    summary = []
    for method in methods:
        seeds = sorted({row["seed"] for row in rows if row["method"] == method})
        if not seeds:
            continue
        per_seed: dict[str, list[float]] = {key: [] for key in LOGGED}
        for seed in seeds:
            tail = [r for r in rows if r["method"] == method and r["seed"] == seed][-window:]
            for key in LOGGED:
                per_seed[key].append(statistics.fmean(r[key] for r in tail))
        summary.append({"method": method, "seeds": len(seeds),
                        **{key: mean_std(values) for key, values in per_seed.items()}, "by_seed": per_seed})
    return summary


def drifted_seeds(summary: list[dict]) -> dict[str, tuple[int, int]]:
    """Per variant, (K, N): of its N seeds, the K whose completion length (`by_seed`: the seed's mean over the last
    10 % of steps) ended nearer the run's `beta=0` mean than its stock (`none`) mean, the seeds whose length drifted.
    Empty for a run without both."""
    by_method = {item["method"]: item for item in summary}
    if not {"none", "beta=0"} <= set(by_method) or any("by_seed" not in item for item in summary):
        return {}
    held, drift = (by_method[name]["completions/mean_length"][0] for name in ("none", "beta=0"))
    counts = {}
    for method, item in by_method.items():
        lengths = item["by_seed"]["completions/mean_length"]
        counts[method] = (sum(abs(length - drift) < abs(length - held) for length in lengths), len(lengths))
    return counts


def print_table(summary: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    drifted = drifted_seeds(summary)
    table = Table(title="Adaptive KL: last 10% of steps, mean +/- std over seeds"
                  + ("; drifted: seeds whose length ended nearer beta=0's than none's" if drifted else ""))
    for column in ["method", "reward", "completion length", "raw KL", "adapted KL", "KL per completion", "final beta",
                   "s/step", *(["drifted"] if drifted else [])]:
        table.add_column(column, justify="left" if column == "method" else "right")
    def cell(item: dict, key: str, digits: int) -> str:
        mean, std = item[key]
        if math.isnan(mean):  # never logged: beta=0 has no KL term (and no reference model) to measure
            return "(off)"
        return f"{mean:.{digits}f} +/- {std:.{digits}f}"

    for item in summary:
        table.add_row(item["method"], cell(item, "reward", 2), cell(item, "completions/mean_length", 1),
                      cell(item, "adaptive_kl/raw_kl", 4), cell(item, "adaptive_kl/adapted_kl", 4),
                      cell(item, "adaptive_kl/sequence_kl", 3), f"{item['adaptive_kl/current_beta'][0]:.3g}",
                      f"{item['step_time'][0]:.3f}",
                      *([f"{drifted[item['method']][0]}/{drifted[item['method']][1]}"] if drifted else []))
    Console(width=170).print(table)


def plot(rows: list[dict], methods: list[str], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from matplotlib.ticker import MaxNLocator

    # (metric, title, y-axis label, (bottom, top) of the axis, None: matplotlib's): a bounded metric shows its whole
    # range and a count starts at 0, so a flat line reads as the value it is (a constant beta, no sync yet)
    panels = [("reward", "reward", "mean reward (0 to 1)", (-0.03, 1.03)),
              ("completions/mean_length", "completion length", "tokens", (0.0, None)),
              ("adaptive_kl/current_beta", "beta", "KL coefficient", (0.0, None)),
              ("adaptive_kl/sequence_kl", "summed KL per completion", "nats (the run's estimator)", (None, None)),
              ("adaptive_kl/reward_penalty", "reward penalty (KL in the reward)", "subtracted from the reward",
               (None, None)),
              ("adaptive_kl/length_kl_corr", "corr(length, summed KL)", "Pearson r", (-1.05, 1.05)),
              ("adaptive_kl/ref_syncs", "reference syncs so far", "syncs", (0.0, None))]
    # A panel no variant logs (e.g. the reward penalty when no variant puts the KL in the reward) is left out.
    panels = [panel for panel in panels if any(r["method"] in methods and not math.isnan(r[panel[0]]) for r in rows)]
    columns = min(3, max(1, len(panels)))
    rows_of_panels = max(1, math.ceil(len(panels) / columns))
    # constrained layout keeps the legend below the panels, where it covers no band
    figure, axes = plt.subplots(rows_of_panels, columns, figsize=(6 * columns, 4.25 * rows_of_panels + 0.6),
                                squeeze=False, layout="constrained")
    for axis in axes.flat[len(panels):]:
        axis.remove()
    # One colour per variant, the same in every panel: matplotlib's 10-colour cycle (C0-C9) repeats from the 11th, so
    # more variants take evenly spaced colours of a colormap instead.
    colors = ([f"C{index}" for index in range(len(methods))] if len(methods) <= 10
              else [matplotlib.colormaps["turbo"](index / (len(methods) - 1)) for index in range(len(methods))])
    for axis, (key, title, unit, (bottom, top)) in zip(axes.flat, panels):
        for color, method in zip(colors, methods):
            seeds = sorted({r["seed"] for r in rows if r["method"] == method})
            curves = [[r[key] for r in rows if r["method"] == method and r["seed"] == s] for s in seeds]
            if not curves or all(math.isnan(value) for curve in curves for value in curve):
                continue
            length = min(map(len, curves))
            steps = list(range(1, length + 1))
            values = torch.tensor([curve[:length] for curve in curves], dtype=torch.float64)
            mean, low, high = values.nanmean(0), values.amin(0), values.amax(0)
            axis.plot(steps, mean.tolist(), label=method, color=color)
            axis.fill_between(steps, low.tolist(), high.tolist(), alpha=0.15, color=color)
        axis.set_title(title)
        axis.set_xlabel("step")
        axis.set_ylabel(unit)
        axis.set_ylim(bottom, top)
        axis.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole: no 2.5 tick on a short run
        if key == "adaptive_kl/ref_syncs":  # a count: whole ticks, up to 1 at least (all-zero has no whole tick)
            axis.set_ylim(top=max(1.0, axis.get_ylim()[1]))
            axis.yaxis.set_major_locator(MaxNLocator(integer=True))
        if bottom == 0.0:  # a line at 0 (beta=0, a decayed beta, no sync yet) drawn clear of the axis line
            axis.set_ylim(bottom=-0.03 * axis.get_ylim()[1])
    # every variant drawn in some panel, in the order given (one may lack a metric another panel shows)
    drawn = {line.get_label(): line for axis in figure.axes for line in axis.lines}
    labels = [method for method in methods if method in drawn]
    if labels:  # none where every run failed
        figure.legend([drawn[label] for label in labels], labels, loc="outside lower center", ncol=min(len(labels), 4))
    figure.suptitle("mean over seeds, band: min-max")
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main(argv: list[str] | None = None, launcher: tuple[str, ...] = SCRIPT) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv, launcher)
    # transformers >= 5.2x warns at every trainer that TRL's gradient_checkpointing names will go in v6: upstream's.
    warnings.filterwarnings("ignore", message=r".*is deprecated and will be removed in v6", category=FutureWarning)
    torch.set_num_threads(min(torch.get_num_threads(), 2))
    from rich.progress import Progress

    started = time.perf_counter()
    try:
        task = model_task(args) if args.model is not None else tiny_task(args)
    except ModelNotLoaded as error:  # the trl backend's tokenizer, loaded once for every run: no run can start
        print(f"FAILED {error}", file=sys.stderr)
        return 1
    rows: list[dict] = []
    failures: list[str] = []
    total = len(args.methods) * args.seeds * args.steps
    with Progress(transient=False) as progress:
        bar = progress.add_task("training", total=total)
        for seed in range(args.seeds):
            for method in args.methods:  # methods interleaved per seed, so drift hits all alike
                progress.update(bar, description=f"{method} seed {seed}")
                done_before = progress.tasks[0].completed
                try:
                    rows.extend(run_one(task, method, seed, args, lambda: progress.advance(bar)))
                except Exception as error:  # a failed run is reported and fails the demo, the others still run
                    failures.append(f"{method} seed {seed}: {type(error).__name__}: {error}")
                    progress.update(bar, completed=done_before + args.steps)
                    if isinstance(error, ModelNotLoaded) and not rows:
                        # every other run would retry the hub (or the path) for as long, and fail alike
                        failures.append(f"the remaining runs: not started, --model {args.model!r} could not be "
                                        "loaded")
                        break
            else:
                continue
            break

    summary = summarise(rows, args.methods, args.steps)
    print_table(summary)
    for failure in failures:  # before the files: a failure writing them must not hide the runs' failures
        print(f"FAILED {failure}", file=sys.stderr)
    write_outputs(rows, summary, args, time.perf_counter() - started)
    plot(rows, args.methods, os.path.join(args.output_dir, "adaptive_kl_comparison.png"))
    print(f"Outputs in {args.output_dir}/: adaptive_kl_comparison.png, metrics.csv, metrics.json, summary.json")
    return 1 if failures else 0


def write_outputs(rows: list[dict], summary: list[dict], args: argparse.Namespace, seconds: float) -> None:
    import csv

    with open(os.path.join(args.output_dir, "metrics.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["method", "seed", "step", *LOGGED])
        writer.writeheader()
        writer.writerows(rows)
    with open(os.path.join(args.output_dir, "metrics.json"), "w") as f:
        json.dump(nan_as_null(rows), f, allow_nan=False)
    settings = {k: v for k, v in vars(args).items() if k != "command"}
    with open(os.path.join(args.output_dir, "summary.json"), "w") as f:
        json.dump(nan_as_null({"settings": settings, "wall_seconds": seconds, "window": max(1, args.steps // 10),
                               "environment": environment(args.command), "summary": summary}),
                  f, indent=1, allow_nan=False)


def nan_as_null(value: Any) -> Any:
    """`value` with every NaN (a metric never logged, e.g. beta=0's KL) as None: JSON has no NaN, and the bare `NaN`
    Python's json writes is refused by other readers (JavaScript's JSON.parse, jq, serde)."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {key: nan_as_null(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [nan_as_null(item) for item in value]
    return value


def environment(command: str) -> dict[str, Any]:
    """What produced a run: the command line, the installed versions, the commit (`source_commit`) and the hardware."""
    import platform

    versions = installed_versions(("unsloth_adaptive_kl", "trl", "transformers", "torch", "peft", "unsloth",
                                   "unsloth_zoo"))
    return {"command": command, "versions": versions, "hardware": hardware(), "python": platform.python_version(),
            "commit": source_commit()}


if __name__ == "__main__":
    sys.exit(main(launcher=MODULE))
