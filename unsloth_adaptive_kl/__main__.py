"""`python -m unsloth_adaptive_kl`: the self-check (tools/selfcheck.py); with `--gpu`, the GPU check
(tools/gpucheck.py)."""

import argparse
import math
import os
import sys

parser = argparse.ArgumentParser(prog="python -m unsloth_adaptive_kl",
                                 description="Check this install: versions, anchors and the loss against the stock "
                                 "trainers on a tiny model (the self-check), or, with --gpu, the GPU paths.")
parser.add_argument("--gpu", action="store_true",
                    help="the GPU check: a tiny Llama through TRL autocast, Unsloth 4-bit + LoRA, fp16 GradScaler, "
                    "vLLM, reference sync with an 8-bit optimizer, the demo's --model path and the KL lab's guard "
                    "through Unsloth; needs a CUDA GPU (exit 2 without one, unless --dry-run)")
parser.add_argument("--only", default=None, help="with --gpu: comma-separated scenario names to run (default: all)")
parser.add_argument("--jobs", type=int, default=None, help="with --gpu: scenarios run at once (default 1)")
parser.add_argument("--json", default=None, metavar="PATH",
                    help="write what was checked to PATH as JSON, with the versions and the machine")
parser.add_argument("--budget", type=float, default=None, metavar="SECONDS",
                    help="with --gpu: a scenario whose turn comes later is not run (default 1500)")
parser.add_argument("--dry-run", action="store_true",
                    help="with --gpu: each scenario's CPU equivalent, on any machine (what a GPU run would import "
                    "and call, checked before GPU time is spent)")
args = parser.parse_args()
if args.jobs is not None and args.jobs < 1:
    parser.error(f"--jobs={args.jobs} is invalid: allowed is an integer >= 1")
if args.budget is not None and not 0 < args.budget < math.inf:
    parser.error(f"--budget={args.budget} is invalid: allowed is a finite number of seconds > 0")
if args.json is not None:  # found before the checks run, not after them
    if os.path.isdir(args.json):
        parser.error(f"--json={args.json!r} is a folder: allowed is a file's path")
    try:  # the record's folder made (as the record would make it) and the file opened, as the end of the run will
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        existed = os.path.exists(args.json)
        with open(args.json, "a"):
            pass
        if not existed:
            os.remove(args.json)
    except OSError as error:
        parser.error(f"--json={args.json!r} cannot be written ({error.strerror}): allowed is a file's path that can be")
gpu_only = {"--only": args.only, "--jobs": args.jobs, "--budget": args.budget,
            "--dry-run": args.dry_run or None}
if args.gpu:
    from .tools.gpucheck import BUDGET_S, main as gpu_check, parse_only

    try:  # a usage error (exit 2), as every other flag's
        parse_only(args.only)
    except SystemExit as refused:
        parser.error(str(refused))

    sys.exit(gpu_check(args.only, args.jobs or 1, args.json, args.dry_run,
                       BUDGET_S if args.budget is None else args.budget))
given = [flag for flag, value in gpu_only.items() if value is not None]
if given:
    parser.error(f"{', '.join(given)}: only with --gpu")
from .tools.selfcheck import main  # noqa: E402

sys.exit(main(args.json))
