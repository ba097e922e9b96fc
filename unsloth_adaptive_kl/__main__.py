"""`python -m unsloth_adaptive_kl`: the self-check (tools/selfcheck.py); with `--gpu`, the GPU check
(tools/gpucheck.py)."""

import argparse
import sys

parser = argparse.ArgumentParser(prog="python -m unsloth_adaptive_kl",
                                 description="Check this install: versions, anchors and the loss against the stock "
                                 "trainers on a tiny model (the self-check), or, with --gpu, the GPU paths.")
parser.add_argument("--gpu", action="store_true",
                    help="the GPU check: a tiny Llama through TRL autocast, Unsloth 4-bit + LoRA, fp16 GradScaler, "
                    "vLLM, reference sync with an 8-bit optimizer and the demo's --model path; needs a CUDA GPU "
                    "(exit 2 without one)")
parser.add_argument("--only", default=None, help="with --gpu: comma-separated scenario names to run (default: all)")
args = parser.parse_args()
if args.gpu:
    from .tools.gpucheck import main as gpu_check

    sys.exit(gpu_check(args.only))
if args.only is not None:
    parser.error("--only needs --gpu")
from .tools.selfcheck import main  # noqa: E402

sys.exit(main())
