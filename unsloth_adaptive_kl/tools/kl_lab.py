"""The KL lab's command line: the tabular lab (tools/tabular_lab.py: the exact figures, against the KL-regularised
optimum known in closed form) and, with --trainer, the same environment through a trainer (tools/trainer_lab.py).

    python -m unsloth_adaptive_kl.tools.kl_lab                   # the default tables (both environments)
    python -m unsloth_adaptive_kl.tools.kl_lab --env first_a --beta 0.2
    python -m unsloth_adaptive_kl.tools.kl_lab --import my_estimators --estimator my_k3   # your own estimator
    python -m unsloth_adaptive_kl.tools.kl_lab --import my_methods --method my_beta      # your own method
    python -m unsloth_adaptive_kl.tools.kl_lab --trainer trl     # through TRL's GRPOTrainer

"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import math
import os
import shlex
import sys
import time
from dataclasses import replace
from typing import Any, Optional, Sequence

import torch

from ..core.config import METHODS
from ..core.estimators import BUILT_IN_ESTIMATORS, estimator_names
from ..core.registry import method_names
from .machine import hardware, source_commit
from .tabular_lab import (ENVIRONMENTS, ESTIMATORS_HEADER, HEADER, TARGET_HEADER, Training, chosen, default_settings,
                          estimator_expectations, estimator_rows, run_table, show, table_rows, target_experiment,
                          target_rows)
from .tabular_lab import __doc__ as TABULAR_DOC


def build_parser() -> argparse.ArgumentParser:
    from . import trainer_lab  # here: it needs the trainer packages, which the tabular lab does not

    parser = argparse.ArgumentParser(description=TABULAR_DOC, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--env", default="all", choices=["all", *ENVIRONMENTS],
                        help="the environment: contains_a (length helps the reward), first_a (the reward saturates at "
                        "the first token, the length is free), or all")
    parser.add_argument("--beta", type=float, help="the KL coefficient of the objective (default 0.5; with --predict, "
                        "the config's beta)")
    parser.add_argument("--seeds", type=int, default=1, help="seeds per setting, averaged (default 1)")
    parser.add_argument("--trainer", default="tabular", choices=["tabular", "trl", "unsloth", "both"],
                        help="tabular: the tabular policy in the lab's own GRPO loop (default); trl, unsloth, both: a "
                        "tiny transformer through TRL's GRPOTrainer and/or Unsloth's generated trainer (contains_a)")
    parser.add_argument("--recipe", action="append", default=[], metavar="NAME",
                        help="with --trainer: how the trainer runs, any of " + ", ".join(
                            f"{name} ({recipe.label})" for name, recipe in trainer_lab.RECIPES.items())
                        + " (default: all)")
    parser.add_argument("--set", dest="overrides", nargs="+", action="extend", default=[], metavar="FIELD=VALUE",
                        help="with --trainer: any GRPOConfig field, set last (e.g. --set loss_type=dapo num_iterations=2)")
    parser.add_argument("--predict", action="store_true", help="with --trainer trl or unsloth and --set: the tabular "
                        "lab's prediction for that GRPOConfig as the trainer runs it, in seconds (no trainer is built)")
    parser.add_argument("--pad-is-eos", action="store_true", help="with --trainer: the tokenizer pads with EOS (no pad "
                        "token of its own), where Unsloth's loss masks every EOS out")
    parser.add_argument("--learning-rate", type=float, help="with --trainer: AdamW's peak learning rate, decayed "
                        "linearly to 0 (default 3e-3, LoRA included)")
    parser.add_argument("--steps", type=int, help=f"optimizer steps per run (default {Training.steps}, or "
                        f"{trainer_lab.STEPS} with --trainer)")
    parser.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE",
                        help="import MODULE first (it registers estimators with register_kl_estimator)")
    parser.add_argument("--estimator", action="append", default=[], metavar="NAME",
                        help="add rows for a registered estimator NAME (in the reward and in the loss)")
    parser.add_argument("--method", action="append", default=[], metavar="NAME",
                        help="add rows for a registered kl_adaptation_method NAME (a shaping or a beta controller)")
    parser.add_argument("--only", action="append", default=[], metavar="TEXT",
                        help="only the settings whose label contains TEXT (repeat it for several)")
    parser.add_argument("--no-target", action="store_true", help="skip the target-controller experiment")
    parser.add_argument("--processes", type=int, default=min(2, os.cpu_count() or 1), help="worker processes")
    parser.add_argument("--json", metavar="PATH", help="write every figure to PATH (the docs page reads it)")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
    parser = build_parser()
    args = parser.parse_args(argv)
    for module in args.imports:
        sys.path.insert(0, os.getcwd())
        try:  # a module not found is named here; errors raised while it imports stay its own
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:  # a dotted name whose package is missing
            found = False
        if not found:
            raise SystemExit(f"--import {module}: no such module here (the folder the lab runs in, {os.getcwd()}, "
                             "is searched first)")
        importlib.import_module(module)
    for flag, asked, registered in (("--estimator", args.estimator, estimator_names()),
                                    ("--method", args.method, method_names())):
        unknown = [name for name in asked if name not in registered]
        if unknown:
            raise SystemExit(f"{flag} {', '.join(unknown)}: not registered; registered are {', '.join(registered)} "
                             "(register yours in a module named with --import)")
    trainer_only = {"--recipe": args.recipe, "--set": args.overrides, "--pad-is-eos": args.pad_is_eos,
                    "--learning-rate": args.learning_rate, "--predict": args.predict}
    tabular_only = {"--estimator": args.estimator, "--method": args.method, "--no-target": args.no_target}
    unused = [flag for flag, value in (tabular_only if args.trainer != "tabular" else trainer_only).items() if value]
    if unused:
        raise SystemExit(f"{', '.join(unused)}: not read with --trainer {args.trainer} (" + (
            "the trainers' table runs its own settings; use --only to pick rows" if args.trainer != "tabular"
            else "only with --trainer trl, unsloth or both") + ")")
    for flag, asked, built_in in (("--estimator", args.estimator, BUILT_IN_ESTIMATORS),
                                  ("--method", args.method, METHODS)):
        # a built-in's added rows would share the table's labels (and results, matched by label) at other settings
        ours = [name for name in asked if name in built_in]
        if ours:
            raise SystemExit(f"{flag} {', '.join(ours)}: built in, and the table has its rows already (--only picks "
                             f"them); {flag} adds rows for one registered with --import")
    if args.predict:
        given = {"--recipe": args.recipe, "--learning-rate": args.learning_rate is not None,
                 "--steps": args.steps is not None, "--only": args.only, "--json": args.json,
                 "--seeds": args.seeds != parser.get_default("seeds"),
                 "--processes": args.processes != parser.get_default("processes")}
        unread = [flag for flag, value in given.items() if value]
        if unread:
            raise SystemExit(f"{', '.join(unread)}: not read with --predict (it trains nothing: it reads --trainer, "
                             "--set, --beta, --env, --pad-is-eos and --import)")
    for flag, value, least in (("--seeds", args.seeds, 1), ("--steps", args.steps, 1),
                               ("--processes", args.processes, 1)):
        if value is not None and value < least:
            raise SystemExit(f"{flag}={value} is invalid: allowed is an integer >= {least}")
    if args.beta is not None and not 0 < args.beta < math.inf:  # pi*_beta, every figure's yardstick, needs beta > 0
        raise SystemExit(f"--beta={args.beta} is invalid: allowed is a finite number > 0")
    if args.json is not None:  # before any training: a run whose figures cannot be written is lost
        if os.path.isdir(args.json):
            raise SystemExit(f"--json={args.json!r} is a folder: allowed is a file's path")
        folder = os.path.dirname(os.path.abspath(args.json))
        try:  # the record's folder made now (the write at the end makes none) and the file opened, as that write will
            if not os.path.exists(folder):  # a file in its place is left to open(), which names it "Not a directory"
                os.makedirs(folder)
            existed = os.path.exists(args.json)
            with open(args.json, "a"):  # "a": a record already there is kept until the run writes its own
                pass
            if not existed:  # a run refused later (or failing) leaves no empty record behind
                os.remove(args.json)
        except OSError as error:
            raise SystemExit(f"--json={args.json!r} cannot be written ({error.strerror}): allowed is a file's path "
                             "that can be") from None
    if args.learning_rate is not None and not 0 < args.learning_rate < math.inf:
        raise SystemExit(f"--learning-rate={args.learning_rate} is invalid: allowed is a finite number > 0")
    torch.set_num_threads(1)
    command = shlex.join(["python", "-m", "unsloth_adaptive_kl.tools.kl_lab",
                          *(argv if argv is not None else sys.argv[1:])])
    if args.predict:
        from . import trainer_lab

        return trainer_lab.predict(args)
    args.beta = 0.5 if args.beta is None else args.beta
    if args.trainer != "tabular":
        from . import trainer_lab

        return trainer_lab.main(args, command)
    start = time.perf_counter()
    training = replace(Training(), steps=args.steps or Training.steps)
    settings = chosen(default_settings(args.estimator, args.method), args.only)
    environments = list(ENVIRONMENTS) if args.env == "all" else [args.env]
    result: dict[str, Any] = {"command": command, "torch": torch.__version__, "machine": hardware(),
                              "commit": source_commit(), "seeds": args.seeds, "tables": {}}
    for name in environments:
        table = run_table(ENVIRONMENTS[name], settings, args.beta, training, range(args.seeds), args.processes)
        result["tables"][name] = table
        print(f"\n{name}, beta = {args.beta}: {table['completions']} completions, {training.groups} groups of "
              f"{training.group_size} a step, {training.steps} steps, seeds {args.seeds}")
        for group, rows in table_rows(table):
            show(group, HEADER, rows)
    # the reward does not enter: one environment's completions and reference serve every environment
    result["estimators"] = estimator_expectations(ENVIRONMENTS["contains_a"])
    show("each estimator's expectation against the KL, exactly, at a policy away from the reference", ESTIMATORS_HEADER,
         estimator_rows(result["estimators"]))
    if not args.no_target:
        result["target"] = target_experiment(ENVIRONMENTS["contains_a"], args.beta,
                                              replace(training, steps=1500, schedule="constant"))
        show(f"target (k1 in the reward, sequence_sum) against beta* = {result['target']['beta_star']:.4f} (tau = "
             f"{result['target']['tau']:.4f}, beta_0 = {result['target']['beta_0']})", TARGET_HEADER,
             target_rows(result["target"]))
    result["seconds"] = time.perf_counter() - start
    print(f"\nkl_lab: {sum(len(t['rows']) for t in result['tables'].values())} rows in {result['seconds']:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
