"""`python -m unsloth_adaptive_kl --gpu`: the one-command check of the GPU paths, offline, in at most 25 minutes.

It builds a tiny Llama that every GPU path can run (hidden size 256, head_dim 64, 128 tokens, 1024 positions, a
character-level fast tokenizer with a chat template, pad != eos), saves it to a temporary folder, and runs each
scenario below on it in a fresh Python process (so that Unsloth is imported after this package, the TRL scenarios
see TRL's own trainer, and one crash or hang fails one scenario only). Each prints one line per check, `[ok]` or
`[FAIL]`, with what it measured or the error (the scenarios are in tools/gpu_scenarios.py):

- `trl-autocast`: TRL's GRPOTrainer under bf16 autocast (fp16 where the card lacks native bf16), a few steps of
  `sigmoid+length_normalized+dynamic`: every `adaptive_kl/*` metric finite, beta moving;
- `trl-fp16-scaler`: TRL with fp16 and accelerate's GradScaler: the scale stays finite, steps are applied, the
  weights stay finite;
- `unsloth-4bit`: `FastLanguageModel.from_pretrained(dir, load_in_4bit=True)` + LoRA: `none` (and a clip no KL
  reaches) equal to stock Unsloth's loss and gradients on a captured batch, every method finite, no recompile while
  beta moves (torch._dynamo's counters), Unsloth's compiled loss generating Triton kernels;
- `unsloth-fp16-scaler`: the same GradScaler check on the 4-bit model loaded in fp16 (what a T4 runs);
- `vllm-kl-in-reward`: `fast_inference=True` (vLLM) generation with `kl_placement="reward"`;
- `ref-sync-8bit`: `sync_ref_model=True` with bitsandbytes' `adamw_8bit` and the optimizer reset;
- `demo-model`: the demo's `--model` path (tools/demo.py) on the saved model, a few steps.

A missing optional package (unsloth, vllm, bitsandbytes) is a FAIL line naming what to install. The exit code is 0
only if every check holds, 1 otherwise, and 2 without a CUDA GPU. Every scenario takes the model folder and a work
folder, and those with a CPU equivalent take a device and a precision as well: the test suite runs them on a CPU
(tests/test_gpucheck.py), so that this check does not rot between GPU runs.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict
from typing import Any, Callable, Optional

import torch

from .gpu_scenarios import CHAT_PROMPTS, MAX_SEQ_LENGTH, SCENARIOS, native_precision
from .selfcheck import Check


# The tiny Llama: head_dim = HIDDEN_SIZE / NUM_HEADS = 64 (vLLM's attention backends); hidden, intermediate and vocab
# sizes multiples of 64 (bitsandbytes' 4-bit blocks); positions beyond any sequence length used here.
HIDDEN_SIZE, NUM_HEADS, NUM_LAYERS, VOCAB_SIZE = 256, 4, 2, 128
MAX_POSITIONS = 1024
BUDGET_S = 25 * 60  # the whole check
SCENARIO_TIMEOUT_S = 8 * 60  # one scenario, at most


# ----- the tiny model ------------------------------------------------------------------------------------------

def save_tiny_llama(model_dir: str, seed: int = 0) -> Any:
    """Build the tiny Llama and its chat tokenizer, save both (safetensors) to `model_dir`; returns the model."""
    from .tiny import CHAT_ALPHABET, CHAT_TEMPLATE, build_tiny_model, build_tokenizer

    tokenizer = build_tokenizer(CHAT_ALPHABET, chat_template=CHAT_TEMPLATE, vocab_size=VOCAB_SIZE)
    model = build_tiny_model(tokenizer, hidden_size=HIDDEN_SIZE, num_layers=NUM_LAYERS, seed=seed,
                             num_heads=NUM_HEADS, max_position_embeddings=MAX_POSITIONS)
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    return model


def build_tiny_llama(model_dir: str) -> list[Check]:
    """Build and save the tiny Llama, then reload it from disk as every scenario does: shapes, tokenizer (fast,
    chat template, pad != eos, the config's ids) and weights (the same logits)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .tiny import CHAT_TEMPLATE

    built = save_tiny_llama(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    shape_ok = (config.hidden_size % 64 == 0 and head_dim == 64 and config.vocab_size % 64 == 0
                and config.max_position_embeddings >= MAX_SEQ_LENGTH)
    checks = [Check("tiny Llama: shapes every GPU path runs", shape_ok,
                    f"hidden {config.hidden_size}, head_dim {head_dim}, vocab {config.vocab_size}, "
                    f"max_position_embeddings {config.max_position_embeddings} (max_seq_length {MAX_SEQ_LENGTH})")]

    text = tokenizer.apply_chat_template(CHAT_PROMPTS[0], tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text).input_ids
    tokenizer_ok = (tokenizer.is_fast and tokenizer.chat_template == CHAT_TEMPLATE
                    and tokenizer.decode(ids) == text and tokenizer.pad_token_id != tokenizer.eos_token_id
                    and (config.pad_token_id, config.eos_token_id) == (tokenizer.pad_token_id, tokenizer.eos_token_id)
                    and tokenizer.padding_side == "left")
    checks.append(Check("tiny Llama: tokenizer reloads", tokenizer_ok,
                        f"{type(tokenizer).__name__} (fast: {tokenizer.is_fast}), pad {tokenizer.pad_token_id} "
                        f"!= eos {tokenizer.eos_token_id}, chat template round-trips: {tokenizer.decode(ids) == text}, "
                        f"padding {tokenizer.padding_side}"))

    probe = torch.tensor([ids])
    with torch.no_grad():
        diff = (model(probe).logits - built(probe).logits).abs().max().item()
    checks.append(Check("tiny Llama: weights reload", diff == 0.0, f"max logit difference {diff:.2g}"))
    return checks


# ----- running them --------------------------------------------------------------------------------------------

def run_scenario(name: str, model_dir: str, work_dir: str) -> list[Check]:
    """One scenario in this process; an exception becomes its FAIL line."""
    try:
        return SCENARIOS[name](model_dir, work_dir)
    except Exception as error:  # reported, and the exit code says so
        return [Check(name, False, f"{type(error).__name__}: {error}")]


def scenario_env(work_dir: str) -> dict[str, str]:
    """A scenario process's environment: offline, no telemetry, a fresh torch.compile cache (so that the compiled
    loss is really compiled, and measured, in this run), and this copy of the package first on the path (the process
    runs in `work_dir`, where Unsloth writes its generated code)."""
    package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
            "UNSLOTH_DISABLE_STATISTICS": "1", "TOKENIZERS_PARALLELISM": "false", "WANDB_DISABLED": "true",
            "TORCHINDUCTOR_CACHE_DIR": os.path.join(work_dir, "inductor_cache"), "PYTHONPATH": path}


def scenario_command(name: str, model_dir: str, work_dir: str, result_path: str) -> list[str]:
    """The command line of one scenario's process (`scenario_process`)."""
    return [sys.executable, "-m", "unsloth_adaptive_kl.tools.gpucheck", name, model_dir, work_dir, result_path]


def run_isolated(name: str, model_dir: str, work_dir: str, timeout: float) -> tuple[list[Check], str]:
    """A scenario in a fresh Python process (`scenario_command`): its checks, read back from the JSON it writes (a
    FAIL line if it crashed or ran out of time), and its log."""
    os.makedirs(work_dir, exist_ok=True)
    result_path, log_path = os.path.join(work_dir, "result.json"), os.path.join(work_dir, "log.txt")
    command = scenario_command(name, model_dir, work_dir, result_path)
    with open(log_path, "w") as log:
        try:
            code = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=scenario_env(work_dir),
                                  cwd=work_dir, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            code = None
    text = open(log_path, errors="replace").read()
    if os.path.exists(result_path):
        with open(result_path) as f:
            return [Check(**item) for item in json.load(f)], text
    last = next((line for line in reversed(text.splitlines()) if line.strip()), "no output")
    reason = f"timed out after {timeout:g} s" if code is None else f"the process exited {code}"
    return [Check(name, False, f"{reason}: {last}")], text


def environment_lines() -> list[str]:
    """The card and the versions this run used."""
    lines = []
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability(0)
        lines.append(f"card: {torch.cuda.get_device_name(0)} (compute capability {major}.{minor}), "
                     f"precision {native_precision()}, CUDA {torch.version.cuda}")
    found = []
    for package in ("unsloth_adaptive_kl", "torch", "transformers", "trl", "peft", "unsloth", "unsloth_zoo", "vllm",
                    "bitsandbytes", "triton"):
        try:
            found.append(f"{package}=={importlib.metadata.version(package.replace('_', '-'))}")
        except importlib.metadata.PackageNotFoundError:
            found.append(f"{package} (not installed)")
    return lines + ["versions: " + ", ".join(found)]


def parse_only(only: Optional[str]) -> list[str]:
    names = [n.strip() for n in (only or "").split(",") if n.strip()] or list(SCENARIOS)
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        raise SystemExit(f"--only: unknown scenario {', '.join(unknown)}; allowed: {', '.join(SCENARIOS)}")
    return names


Runner = Callable[[str, str, str, float], tuple[list[Check], str]]


def run_all(names: list[str], root: str, run: Runner = run_isolated, budget_s: float = BUDGET_S) -> list[Check]:
    """Build the tiny Llama under `root`, then each scenario of `names` through `run` (`run_isolated`: a fresh
    process each), printing each check as it comes and, for a failed scenario, the last lines of its log. A scenario
    is not run (a FAIL line says why) without a model or with less than 30 s of `budget_s` left."""
    start = time.perf_counter()
    checks: list[Check] = []

    def report(new: list[Check]) -> None:
        for check in new:
            checks.append(check)
            print(check.line(), flush=True)

    model_dir = os.path.join(root, "tiny-llama")
    try:
        report(build_tiny_llama(model_dir))
    except Exception as error:  # reported, and every scenario says it could not run
        report([Check("tiny Llama built and saved", False, f"{type(error).__name__}: {error}")])
    built = all(check.ok for check in checks)
    for name in names:
        left = budget_s - (time.perf_counter() - start)
        if not built:
            report([Check(name, False, "not run: the tiny model could not be built")])
        elif left < 30:
            report([Check(name, False, f"not run: the {budget_s:.0f}-second budget is spent")])
        else:
            new, log = run(name, model_dir, os.path.join(root, name), min(SCENARIO_TIMEOUT_S, left))
            report(new)
            if not all(check.ok for check in new):
                tail = log.splitlines()[-30:]
                print(f"    --- {name}: the last {len(tail)} lines of its log ---", *("    " + line for line in tail),
                      sep="\n", flush=True)
    return checks


def main(only: Optional[str] = None) -> int:
    """The GPU check: 2 without CUDA, else 0 if every check holds and 1 otherwise. `only`: comma-separated scenario
    names (all by default)."""
    import tempfile

    names = parse_only(only)
    if not torch.cuda.is_available():
        print(f"python -m unsloth_adaptive_kl --gpu needs a CUDA GPU: torch.cuda.is_available() is False here "
              f"(torch {torch.__version__}, CUDA build {torch.version.cuda or 'none'}). On a CPU, run "
              f"`python -m unsloth_adaptive_kl` (the self-check).")
        return 2
    start = time.perf_counter()
    print("unsloth_adaptive_kl GPU check", *environment_lines(), sep="\n", flush=True)
    with tempfile.TemporaryDirectory(prefix="adaptive_kl_gpucheck_") as root:
        checks = run_all(names, root)
    failed = [check for check in checks if not check.ok]
    print(f"GPU check {'passed' if not failed else 'FAILED'}: {len(checks) - len(failed)} of {len(checks)} checks "
          f"hold ({time.perf_counter() - start:.0f} s)")
    return 1 if failed else 0


def scenario_process(argv: list[str]) -> int:
    """`python -m unsloth_adaptive_kl.tools.gpucheck NAME MODEL_DIR WORK_DIR RESULT_JSON`: one scenario, its checks
    printed and written to RESULT_JSON."""
    parser = argparse.ArgumentParser(description="one scenario of the GPU check (run by `--gpu`)")
    for argument in ("name", "model_dir", "work_dir", "result"):
        parser.add_argument(argument)
    args = parser.parse_args(argv)
    checks = run_scenario(args.name, args.model_dir, args.work_dir)
    for check in checks:
        print(check.line(), flush=True)
    with open(args.result, "w") as f:
        json.dump([asdict(check) for check in checks], f)
    return 0


if __name__ == "__main__":
    sys.exit(scenario_process(sys.argv[1:]))
