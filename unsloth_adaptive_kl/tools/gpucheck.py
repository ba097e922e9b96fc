"""`python -m unsloth_adaptive_kl --gpu`: the one-command check of the GPU paths, offline, in at most 25 minutes
(`--budget`).

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
- `demo-model`: the demo's `--model` path (tools/demo.py) on the saved model, a few steps;
- `unsloth-guard`: the KL lab's end-to-end guard through Unsloth's generated trainer on the device (the lab's own
  model), each line naming the log-prob scorer Unsloth called.

`--jobs N` runs N scenario processes at once, `--json PATH` writes the device, the versions and every line
(`results`; docs/results/gpu/ holds the last run, rendered by docs/gpu.md), and `--dry-run` runs each scenario's CPU
equivalent (`DRY_RUN`) on any machine: .ci/gpu/dry-run runs it in an emulation of the GPU machine's image, so that a
GPU run spends no minute on an import error or a typo.

A missing optional package (unsloth, vllm, bitsandbytes) is a FAIL line naming what to install. The exit code is 0
only if every check holds, 1 otherwise, and 2 without a CUDA GPU (unless `--dry-run`). Every scenario takes the model
folder and a work folder, and those with a CPU equivalent take a device and a precision as well: the test suite runs
them on a CPU (tests/test_gpucheck.py), so that this check does not rot between GPU runs.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import shlex
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Collection, Optional

import torch

from .. import __version__
from .gpu_scenarios import CHAT_PROMPTS, MAX_SEQ_LENGTH, SCENARIOS, native_precision
from .machine import installed_versions, source_commit
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

# Each scenario's arguments in the dry run (`--gpu --dry-run`, no GPU needed): its CPU equivalent, in float32 (bf16
# autocast for trl-autocast), for 1 to 4 steps. FastLanguageModel loads on CUDA only, so the Unsloth scenarios import it
# and then train a transformers model through Unsloth's generated trainer (`load_policy`), and the demo runs with
# `--backend trl`; vLLM has no CPU equivalent.
DRY_RUN: dict[str, dict[str, Any]] = {
    "trl-autocast": {"device": "cpu", "precision": "bf16", "steps": 2},  # two: beta's decay is compared once
    "trl-fp16-scaler": {"device": "cpu", "precision": "fp32", "steps": 2},
    "unsloth-4bit": {"device": "cpu"},
    "unsloth-fp16-scaler": {"device": "cpu", "steps": 2},
    "ref-sync-8bit": {"device": "cpu", "precision": "fp32", "steps": 3},  # a step after the reset refills the state
    "demo-model": {"backend": "trl", "steps": 1},
    "unsloth-guard": {"steps": 4},
}


def run_scenario(name: str, model_dir: str, work_dir: str, dry_run: bool = False) -> list[Check]:
    """One scenario in this process (with its `DRY_RUN` arguments in a dry run; one without a CPU equivalent is an
    untested line, so that a dry run of every scenario can pass); an exception becomes its FAIL line."""
    if dry_run and name not in DRY_RUN:
        return [Check(name, True, "not run: it has no CPU equivalent (vLLM generates on CUDA only)", untested=True)]
    try:
        return SCENARIOS[name](model_dir, work_dir, **(DRY_RUN[name] if dry_run else {}))
    except Exception as error:  # reported, and the exit code says so
        return [Check(name, False, f"{type(error).__name__}: {error}")]


def scenario_env(work_dir: str) -> dict[str, str]:
    """A scenario process's environment: offline, no telemetry, a fresh torch.compile cache (so that the compiled
    loss is really compiled, and measured, in this run), and this copy of the package first on the path (the process
    runs in `work_dir`, where Unsloth writes its generated code)."""
    package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH", "")) if p)
    # Inductor compiles with a worker per core by default: 4 scenarios at once (and the guard's workers) on 16 cores
    # would start about 100
    return {"TORCHINDUCTOR_COMPILE_THREADS": "4", **os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1", "UNSLOTH_DISABLE_STATISTICS": "1", "TOKENIZERS_PARALLELISM": "false",
            "WANDB_DISABLED": "true", "TORCHINDUCTOR_CACHE_DIR": os.path.join(work_dir, "inductor_cache"),
            "PYTHONPATH": path}


def scenario_command(name: str, model_dir: str, work_dir: str, result_path: str, dry_run: bool = False) -> list[str]:
    """The command line of one scenario's process (`scenario_process`). `sys.flags.no_site` is kept: a python
    started with -S (an emulated image) starts its scenarios so too."""
    return [sys.executable, *(["-S"] if sys.flags.no_site else []), "-m", "unsloth_adaptive_kl.tools.gpucheck", name,
            model_dir, work_dir, result_path, *(["--dry-run"] if dry_run else [])]


def run_isolated(name: str, model_dir: str, work_dir: str, timeout: float, dry_run: bool = False
                 ) -> tuple[list[Check], str]:
    """A scenario in a fresh Python process (`scenario_command`): its checks, read back from the JSON it writes (a
    FAIL line if it crashed or ran out of time), and its log."""
    os.makedirs(work_dir, exist_ok=True)
    result_path, log_path = os.path.join(work_dir, "result.json"), os.path.join(work_dir, "log.txt")
    command = scenario_command(name, model_dir, work_dir, result_path, dry_run)
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


PACKAGES = ("unsloth_adaptive_kl", "torch", "transformers", "trl", "peft", "accelerate", "unsloth", "unsloth_zoo",
            "vllm", "bitsandbytes", "triton")


def driver_version() -> Optional[str]:
    """The NVIDIA driver's version (`nvidia-smi`), or None where it cannot be read."""
    try:
        output = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return output.strip().splitlines()[0] if output.strip() else None


def environment() -> dict[str, Any]:
    """The device this process computes on and the versions it uses, for a results JSON: {"device": {...},
    "versions": {package: version or None}}."""
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability(0)
        device = {"kind": "cuda", "name": torch.cuda.get_device_name(0), "capability": f"{major}.{minor}",
                  "precision": native_precision(), "cuda": torch.version.cuda, "driver": driver_version()}
    else:
        device = {"kind": "cpu", "name": platform.processor() or platform.machine(), "cores": os.cpu_count()}
    # the version of the module that runs: a checkout on PYTHONPATH (.ci/gpu/run) is not an installed distribution,
    # and one installed elsewhere is not what runs
    installed = {**installed_versions(PACKAGES), "unsloth_adaptive_kl": __version__}
    return {"device": device, "versions": {package: installed.get(package) for package in PACKAGES},
            "commit": source_commit()}


def environment_lines(found: dict[str, Any]) -> list[str]:
    """`environment()` as the check prints it."""
    device = found["device"]
    lines = [f"card: {device['name']} (compute capability {device['capability']}), precision {device['precision']}, "
             f"CUDA {device['cuda']}, driver {device['driver'] or 'not read'}"] if device["kind"] == "cuda" else []
    return lines + ["versions: " + ", ".join(f"{package}=={version}" if version else f"{package} (not installed)"
                                              for package, version in found["versions"].items())]


def parse_only(only: Optional[str]) -> list[str]:
    """The scenarios `--only` names, in its order (None: all); a name unknown, repeated or none at all is refused."""
    if only is None:
        return list(SCENARIOS)
    names = [n.strip() for n in only.split(",") if n.strip()]
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        raise SystemExit(f"--only: unknown scenario {', '.join(unknown)}; allowed: {', '.join(SCENARIOS)}")
    if not names or len(set(names)) < len(names):
        raise SystemExit(f"--only={only!r} is invalid: allowed is each scenario at most once, at least one of "
                         f"{', '.join(SCENARIOS)}")
    return names


Runner = Callable[[str, str, str, float], tuple[list[Check], str]]


@dataclass
class Ran:
    """One scenario's outcome: its checks and its wall-clock seconds."""
    checks: list[Check]
    seconds: float


Progress = Callable[[list[Check], dict[str, Ran]], None]


def run_all(names: list[str], root: str, run: Runner = run_isolated, budget_s: float = BUDGET_S, jobs: int = 1,
            progress: Optional[Progress] = None) -> tuple[list[Check], dict[str, Ran]]:
    """Build the tiny Llama under `root`, then each scenario of `names` through `run` (`run_isolated`: a fresh
    process each), `jobs` at a time, printing each check as it comes and, for a failed scenario, the last lines of
    its log; `progress(model checks, outcomes so far)` after each scenario (the JSON, written as the run goes). A
    scenario is not run (a FAIL line says why) without a model or with less than 30 s of `budget_s` left when its
    turn comes. Returns the model's checks and each scenario's outcome, in the order of `names`."""
    from concurrent.futures import ThreadPoolExecutor

    start = time.perf_counter()
    lock = threading.Lock()

    def report(new: list[Check], log: str = "", name: str = "") -> None:
        with lock:
            for check in new:
                print(check.line(), flush=True)
            if log and not all(check.ok for check in new):
                tail = log.splitlines()[-30:]
                print(f"    --- {name}: the last {len(tail)} lines of its log ---", *("    " + line for line in tail),
                      sep="\n", flush=True)

    model_dir = os.path.join(root, "tiny-llama")
    try:
        model_checks = build_tiny_llama(model_dir)
    except Exception as error:  # reported, and every scenario says it could not run
        model_checks = [Check("tiny Llama built and saved", False, f"{type(error).__name__}: {error}")]
    report(model_checks)
    built = all(check.ok for check in model_checks)

    def one(name: str) -> Ran:
        began = time.perf_counter()
        left = budget_s - (began - start)
        if not built:
            new, log = [Check(name, False, "not run: the tiny model could not be built")], ""
        elif left < 30:
            new, log = [Check(name, False, f"not run: the {budget_s:.0f}-second budget is spent")], ""
        else:
            new, log = run(name, model_dir, os.path.join(root, name), min(SCENARIO_TIMEOUT_S, left))
        report(new, log, name)
        outcome = Ran(new, time.perf_counter() - began)
        with lock:
            done[name] = outcome
            if progress is not None:
                progress(model_checks, dict(done))
        return outcome

    done: dict[str, Ran] = {}

    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        outcomes = list(pool.map(one, names))
    return model_checks, dict(zip(names, outcomes))


PENDING = "had not finished when this file was written (the run was stopped)"


def results(found: dict[str, Any], model_checks: list[Check], ran: dict[str, Ran], dry_run: bool, seconds: float,
            command: str, pending: Collection[str] = ()) -> dict[str, Any]:
    """The run as JSON (docs/results/gpu/check.json; the docs render it): the device and versions, the tiny model's
    checks, and every scenario of `SCENARIOS`, run, `pending` (asked for, not finished yet) or not asked for."""
    def not_run(name: str) -> dict[str, Any]:
        return {"ran": False, "why": PENDING if name in pending else "not asked for (--only)"}

    return {"command": command, "date": time.strftime("%Y-%m-%d"), **found, "dry_run": dry_run, "seconds": seconds,
            "model": [asdict(check) for check in model_checks],
            "scenarios": {name: ({"ran": True, "seconds": ran[name].seconds,
                                  "checks": [asdict(check) for check in ran[name].checks]}
                                 if name in ran else not_run(name))
                          for name in SCENARIOS}}


def main(only: Optional[str] = None, jobs: int = 1, json_path: Optional[str] = None, dry_run: bool = False,
         budget_s: float = BUDGET_S) -> int:
    """The GPU check: 2 without CUDA (unless `dry_run`), else 0 if every check holds and 1 otherwise. `only`:
    comma-separated scenario names (all by default); `jobs`: scenarios run at once; `json_path`: where to write
    `results`; `dry_run`: every scenario's CPU equivalent (`DRY_RUN`), on any machine."""
    import tempfile

    names = parse_only(only)
    if not torch.cuda.is_available() and not dry_run:
        print(f"python -m unsloth_adaptive_kl --gpu needs a CUDA GPU: torch.cuda.is_available() is False here "
              f"(torch {torch.__version__}, CUDA build {torch.version.cuda or 'none'}). On a CPU, run "
              f"`python -m unsloth_adaptive_kl` (the self-check), or `--gpu --dry-run` (the GPU check's CPU "
              f"equivalents).")
        return 2
    start = time.perf_counter()
    found = environment()
    print("unsloth_adaptive_kl GPU check" + (" (dry run: each scenario's CPU equivalent)" if dry_run else ""),
          *environment_lines(found), sep="\n", flush=True)
    command = shlex.join(["python", "-m", "unsloth_adaptive_kl", *sys.argv[1:]])

    def write(model_checks: list[Check], ran: dict[str, Ran]) -> None:
        """The JSON as it stands: a run stopped from outside keeps what had finished."""
        if json_path:
            os.makedirs(os.path.dirname(json_path) or ".", exist_ok=True)
            with open(json_path, "w") as f:
                json.dump(results(found, model_checks, ran, dry_run, time.perf_counter() - start, command,
                                  pending=[name for name in names if name not in ran]), f, indent=1)

    run = functools.partial(run_isolated, dry_run=dry_run)
    with tempfile.TemporaryDirectory(prefix="adaptive_kl_gpucheck_") as root:
        model_checks, ran = run_all(names, root, run, budget_s, jobs, progress=write)
    checks = model_checks + [check for outcome in ran.values() for check in outcome.checks]
    failed = [check for check in checks if not check.ok]
    untested = sum(check.ok and check.untested for check in checks)
    seconds = time.perf_counter() - start
    print(f"GPU check{' dry run' if dry_run else ''} {'passed' if not failed else 'FAILED'}: "
          f"{len(checks) - len(failed)} of {len(checks)} checks hold"
          + (f", {untested} of them untested" if untested else "") + f" ({seconds:.0f} s)")
    write(model_checks, ran)
    return 1 if failed else 0


def scenario_process(argv: list[str]) -> int:
    """`python -m unsloth_adaptive_kl.tools.gpucheck NAME MODEL_DIR WORK_DIR RESULT_JSON`: one scenario, its checks
    printed and written to RESULT_JSON."""
    parser = argparse.ArgumentParser(description="one scenario of the GPU check (run by `--gpu`)")
    for argument in ("name", "model_dir", "work_dir", "result"):
        parser.add_argument(argument)
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args(argv)
    checks = run_scenario(args.name, args.model_dir, args.work_dir, args.dry_run)
    for check in checks:
        print(check.line(), flush=True)
    with open(args.result, "w") as f:
        json.dump([asdict(check) for check in checks], f)
    return 0


if __name__ == "__main__":
    sys.exit(scenario_process(sys.argv[1:]))
