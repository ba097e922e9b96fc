"""Overhead of adaptive KL next to stock TRL GRPO, measured side by side in one run (only ratios count).

    python benchmarks/overhead.py                 # full run (a few minutes on 2 CPU cores)
    python benchmarks/overhead.py --smoke         # tiny sizes, checks that it runs and reports

Per method and for `none`, against the unpatched stock GRPOTrainer:
- median seconds per optimizer step, methods interleaved over repeats (rotated order, the A/A copy half a rotation
  from stock; same seed, fixed-length generation via min_new_tokens so every variant trains on equally long
  completions);
- model forward calls per step (forward hook on the causal LM): must equal stock with the KL in the loss; the KL in
  the reward (`kl_in_reward`) adds one no-grad policy forward per generation batch;
- peak memory: on CPU, the peak RSS a variant's run adds in a fresh process (the imports' peak cleared), on GPU
  torch.cuda.max_memory_allocated;
- the core op on a 64 x 4096 per-token KL against the stock k3 expression alone;
- reference syncing on (`ref_sync`: `sync_ref_model=True`, a hard reset, alpha 1, after every step), interleaved with
  the others but kept out of the rows: its forwards per step against stock (0 extra: the reference forward with the
  exchanged tensors replaces the stock one), the bytes of its private reference copy against the LoRA adapter's
  bytes (exact, numel x element size), and, timed directly with many repetitions, one sync (the mix) and one
  exchange (swap in + swap back around each reference forward), each as a ratio of stock's median step time.
Prints a table, writes JSON, and ends with one line `extra_forwards=N max_memory_ratio=X graphs_added=N
max_step_ratio=X aa=[a,b] ref_sync_extra_forwards=N ref_sync_bytes=N sync_step_ratio=X`: step time includes
generation, so its ratios are resolved only outside the A/A interval (stock against stock);
benchmarks/loss_overhead.py resolves the loss path's overhead.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import math
import os
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # above USDT (5): torch.profiler's per-session lines
import torch  # noqa: E402

import unsloth_adaptive_kl
from unsloth_adaptive_kl.integrations import trl as trl_patch
from unsloth_adaptive_kl.integrations.patching import PatchSet
from unsloth_adaptive_kl.tools.machine import hardware, source_commit

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from loss_overhead import aa_half_way, bootstrap_ratio, core_op  # noqa: E402

# "stock (A/A)" is stock again: its ratio to stock is the noise floor of this machine.
VARIANTS = ["stock", "stock (A/A)", "none", "clip", "sigmoid", "length_normalized", "dynamic", "dynamic+length_normalized",
            "kl_in_reward"]
STOCK = ("stock", "stock (A/A)")
# kl_placement="reward" needs the policy's log-probs before the advantages: one no-grad forward per generation batch
# where the trainer computes no old log-probs (as here), counted in its own column, not in the loss-placement headline.
KL_IN_REWARD = {"kl_placement": "reward", "kl_reduction": "sequence_sum"}
# Reference syncing on: a hard reset (ProRL) after every optimizer step, so every step after the first runs its
# reference forward with the synced copy exchanged in. Timed with the variants, reported in its own JSON object.
REF_SYNC = "ref_sync"
REF_SYNC_CONFIG = {"kl_adaptation_method": "none", "sync_ref_model": True, "ref_model_sync_steps": 1,
                   "ref_model_mixup_alpha": 1.0}
# The order the runs rotate through (each pass starts one later)
TIMED = aa_half_way(*STOCK, [variant for variant in VARIANTS if variant not in STOCK] + [REF_SYNC])


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true",
                        help="tiny sizes: 1 repeat, 3 steps (the first untimed), each unless given")
    parser.add_argument("--repeats", type=int, default=7, help="timed passes over all variants, after one untimed")
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps per run; the first is not timed")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--completion-length", type=int, default=32)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--json", default="benchmarks/overhead.json")
    parser.add_argument("--sync-repeats", type=int, default=200, help="timed syncs and exchanges per ref_sync run")
    parser.add_argument("--memory-child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.smoke:  # tiny defaults; values given on the command line still count
        parser.set_defaults(repeats=1, steps=3, hidden=32, layers=1, completion_length=4, batch=4, sync_repeats=20)
        args = parser.parse_args(argv)
    for name in ("repeats", "hidden", "layers", "completion_length", "batch", "sync_repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}={getattr(args, name)} is invalid: allowed is an integer >= 1")
    if args.steps < 2:  # the first step is not timed
        parser.error(f"--steps={args.steps} is invalid: allowed is an integer >= 2 (the first is not timed)")
    return args


_STOCK_FALLBACK = PatchSet()  # stock TRL's CPU log-prob path, taken off before patch() installs the patch's own


def set_stock(stock: bool) -> None:
    """Stock TRL (keeping the CPU log-prob path stock trl 1.15 lacks) or the patched one. The stock side's fallback
    is restored before `patch()`, which takes the kernel it finds as the fallback's upstream (the fallback itself
    would make it call itself on an accelerator)."""
    if stock:
        unsloth_adaptive_kl.unpatch()
        if not _STOCK_FALLBACK:
            trl_patch.stock_cpu_fallback(_STOCK_FALLBACK)
    else:
        _STOCK_FALLBACK.restore()
        unsloth_adaptive_kl.patch()


def tensor_bytes(tensors: Any) -> int:
    """Exact bytes of the tensors' elements: sum of numel x element size."""
    return sum(t.numel() * t.element_size() for t in tensors)


def joined_counts(values: list[int]) -> str:
    """The forward counts a variant's steps took, as the tables print them: "3" or "3 or 4"."""
    return " or ".join(map(str, values))


def median_seconds(fn: Any, repeats: int) -> float:
    """Median wall time of `fn()` over `repeats` calls (after 3 untimed), each timed on its own."""
    def synced() -> None:
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    for _ in range(3):
        synced()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        synced()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def sync_costs(trainer: Any, model: Any, args: argparse.Namespace) -> dict[str, Any]:
    """After a ref_sync run: the private copy's exact bytes against the adapter's, and one sync (the mix), one
    exchange (swap in + swap back) and the initial copy, each timed directly (median of `--sync-repeats`)."""
    from peft import get_peft_model_state_dict

    from unsloth_adaptive_kl.integrations.ref_sync import AdapterReference

    sync = trainer.adaptive_kl_reference
    reference = sync.bind()
    assert isinstance(reference, AdapterReference)

    def exchange() -> None:
        with reference.swapped_in():
            pass

    return {
        "syncs_per_run": sync.syncs,
        "copy_tensors": len(reference.tensors),
        "copy_bytes": tensor_bytes(reference.tensors),
        "adapter_bytes": tensor_bytes(get_peft_model_state_dict(model).values()),
        "exchange_temp_bytes": max(tensor_bytes([t]) for t in reference.tensors),
        "sync_s": median_seconds(lambda: reference.mix(sync.schedule.alpha), args.sync_repeats),
        "exchange_s": median_seconds(exchange, args.sync_repeats),
        "copy_s": median_seconds(lambda: AdapterReference(trainer.accelerator.unwrap_model(trainer.model)),
                                 args.sync_repeats),
    }


def run(variant: str, args: argparse.Namespace, output_dir: str) -> dict[str, Any]:
    import trl
    from datasets import Dataset
    from transformers import PrinterCallback, TrainerCallback, set_seed

    from unsloth_adaptive_kl.tools.tiny import add_lora, build_tiny_model, build_tokenizer

    set_stock(variant in STOCK)
    tokenizer = build_tokenizer()
    set_seed(0)
    model = add_lora(build_tiny_model(tokenizer, hidden_size=args.hidden, num_layers=args.layers))
    forwards = [0]
    model.get_base_model().register_forward_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
    step_times: list[float] = []
    step_forwards: list[int] = []

    def synchronized() -> float:  # on a GPU, the step's queued kernels belong to its time
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter()

    class Timer(TrainerCallback):
        def on_step_begin(self, *_: Any, **__: Any) -> None:
            self.start, self.forwards = synchronized(), forwards[0]

        def on_step_end(self, *_: Any, **__: Any) -> None:
            step_times.append(synchronized() - self.start)
            step_forwards.append(forwards[0] - self.forwards)

    if variant in STOCK:
        method = {}
    elif variant == "kl_in_reward":
        method = dict(KL_IN_REWARD)
    elif variant == REF_SYNC:
        method = dict(REF_SYNC_CONFIG)
    else:
        method = {"kl_adaptation_method": variant}
        if "dynamic" in variant.split("+"):  # beta decays every step: a moving beta is what the step costs
            method["reward_threshold"] = 0.0
    config = trl.GRPOConfig(
        output_dir=output_dir, use_cpu=not torch.cuda.is_available(), bf16=False, report_to="none",
        disable_tqdm=True, per_device_train_batch_size=args.batch, num_generations=4,
        max_completion_length=args.completion_length,
        generation_kwargs={"min_new_tokens": args.completion_length}, max_steps=args.steps, logging_steps=1,
        learning_rate=1e-3, beta=0.04, save_strategy="no", seed=0, loss_type="dapo", **method,
    )
    prompts = Dataset.from_dict({"prompt": ["ab:", "cde:", "fg:", "h:"] * (args.batch * args.steps)})
    trainer = trl.GRPOTrainer(model=model, processing_class=tokenizer, args=config, train_dataset=prompts,
                              reward_funcs=[lambda completions, **_: [float(len(set(c))) for c in completions]],
                              callbacks=[Timer()])
    trainer.remove_callback(PrinterCallback)
    if torch.cuda.is_available():
        # the previous run's trainer is garbage (a reference cycle) that transformers frees only inside train(): freed
        # here, so that this run's peak holds this run's model and optimizer alone
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    exchanges = [0]
    if variant == REF_SYNC:  # count the reference forwards that ran with the synced copy exchanged in
        from unsloth_adaptive_kl.integrations.ref_sync import AdapterReference

        stock_swapped_in = AdapterReference.swapped_in

        def counted(self: Any) -> Any:
            exchanges[0] += 1
            return stock_swapped_in(self)

        AdapterReference.swapped_in = counted
    try:
        trainer.train()
    finally:
        if variant == REF_SYNC:
            AdapterReference.swapped_in = stock_swapped_in
    measured = step_times[1:] or step_times
    result = {
        "median_step_s": statistics.median(measured),
        "forwards_per_step": step_forwards[1:] or step_forwards,
        "cuda_peak_bytes": torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None,
    }
    if variant == REF_SYNC:
        result.update(sync_costs(trainer, model, args), exchanges_per_run=exchanges[0])
    return result


def memory_child(variant: str, args: argparse.Namespace) -> None:
    """Run one variant in this fresh process and print as JSON the RSS its run added at its peak (bytes): the model,
    the trainer and training, above what the imports hold. The imports' own peak, the same in every variant and about
    a GB, is cleared first (Linux: writing 5 to /proc/self/clear_refs resets the peak RSS to the current RSS);
    without /proc the whole process's peak is reported."""
    import datasets  # noqa: F401  (the imports' memory, before the peak is reset)
    import peft  # noqa: F401
    import trl  # noqa: F401

    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        before = proc_status_bytes("VmRSS")
    except OSError:
        before = 0
    run(variant, args, os.path.join("/tmp", "adaptive_kl_bench_memory"))
    peak = proc_status_bytes("VmHWM") if before else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"peak_rss_bytes": peak - before}))


def proc_status_bytes(field: str) -> int:
    """A `kB` field of /proc/self/status (VmRSS: the resident set now; VmHWM: its peak), in bytes."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(f"{field}:"))


def peak_rss(variant: str, argv: list[str]) -> int:
    output = subprocess.run([sys.executable, __file__, *argv, "--memory-child", variant],
                            capture_output=True, text=True, check=True).stdout
    return json.loads(output.strip().splitlines()[-1])["peak_rss_bytes"]


def unsloth_timing(smoke: bool) -> dict[str, Any] | None:
    """Unsloth's generated trainer on CPU (tests/unsloth_cpu.py, in a fresh process), when Unsloth is installed."""
    if importlib.util.find_spec("unsloth") is None:
        return None
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with tempfile.TemporaryDirectory() as folder:
        output = os.path.join(folder, "timing.json")
        env = {**os.environ, "PYTHONPATH": root, "OMP_NUM_THREADS": "1",
               "ADAPTIVE_KL_BENCH_REPEATS": "1" if smoke else "3"}
        subprocess.run([sys.executable, os.path.join(root, "tests", "unsloth_cpu.py"), "timing", output],
                       cwd=folder, env=env, check=True, capture_output=True, text=True)
        with open(output) as f:
            return json.load(f)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    torch.set_num_threads(min(torch.get_num_threads(), 2))
    if args.memory_child:
        memory_child(args.memory_child, args)
        return 0

    times: dict[str, list[float]] = {variant: [] for variant in TIMED}
    forwards: dict[str, list[int]] = {variant: [] for variant in TIMED}
    cuda_peak: dict[str, Any] = {}
    sync_runs: list[dict[str, Any]] = []
    for repeat in range(args.repeats + 1):  # pass 0 warms caches and allocators for every variant, untimed
        order = TIMED[repeat % len(TIMED):] + TIMED[: repeat % len(TIMED)]
        for variant in order:
            result = run(variant, args, os.path.join("/tmp", "adaptive_kl_bench"))
            if repeat == 0:
                continue
            times[variant].append(result["median_step_s"])
            forwards[variant].extend(result["forwards_per_step"])
            if result["cuda_peak_bytes"] is not None:  # the largest over the repeats
                cuda_peak[variant] = max(cuda_peak.get(variant, 0), result["cuda_peak_bytes"])
            if variant == REF_SYNC:
                sync_runs.append(result)
    ref_sync_steps = times.pop(REF_SYNC)
    ref_sync_forwards = forwards.pop(REF_SYNC)
    set_stock(False)
    memory = cuda_peak if torch.cuda.is_available() else {variant: peak_rss(variant, argv) for variant in VARIANTS}
    core = {row["method"]: row["x_k3"] for row in core_op(50 if args.smoke else 300)}

    stock_time = statistics.median(times["stock"])
    rows = []
    for variant in VARIANTS:
        median = statistics.median(times[variant])
        rows.append({
            "variant": variant,
            "median_step_s": median,
            "step_ratio": median / stock_time,
            "forwards_per_step": sorted(set(forwards[variant])),
            "extra_forwards": sum(forwards[variant]) - sum(forwards["stock"]),
            "peak_memory_bytes": memory[variant],
            "memory_ratio": memory[variant] / memory["stock"],
            "core_ratio": core.get(variant),
        })
    print(f"{'variant':<27}{'s/step':>9}{'x stock':>9}{'fwd/step':>10}{'+fwd':>6}{'peak MiB':>10}{'x stock':>9}{'core x k3':>11}")
    for row in rows:
        core_ratio = "" if row["core_ratio"] is None else f"{row['core_ratio']:.2f}"
        print(f"{row['variant']:<27}{row['median_step_s']:>9.4f}{row['step_ratio']:>9.3f}"
              f"{joined_counts(row['forwards_per_step']):>10}{row['extra_forwards']:>6}"
              f"{row['peak_memory_bytes'] / 2**20:>10.1f}{row['memory_ratio']:>9.3f}{core_ratio:>11}")
    unsloth = unsloth_timing(args.smoke)
    unsloth_rows = []
    if unsloth is not None:
        print(f"\nUnsloth generated trainer (CPU, tiny model){'':<4}{'s/step':>9}{'x stock':>9}{'fwd/step':>10}{'new graphs':>12}")
        for variant, row in unsloth.items():
            row = {"variant": f"unsloth:{variant}", **row,
                   "step_ratio": row["median_step_s"] / unsloth["stock"]["median_step_s"]}
            unsloth_rows.append(row)
            print(f"{row['variant']:<47}{row['median_step_s']:>9.4f}{row['step_ratio']:>9.3f}"
                  f"{joined_counts(row['forwards_per_step']):>10}{row['graphs_added_per_run']:>12}")
    ref_sync = ref_sync_report(sync_runs, ref_sync_steps, ref_sync_forwards, times, forwards, args)
    print(f"\nref_sync (sync_ref_model=True, alpha {ref_sync['alpha']}, every {ref_sync['sync_steps']} step): "
          f"{ref_sync['step_seconds_median']:.4f} s/step ({ref_sync['step_ratio']:.3f} x stock), forwards/step "
          f"{joined_counts(ref_sync['forwards_per_step'])}, {ref_sync['extra_forwards']} extra; copy "
          f"{ref_sync['copy_bytes']} B ({ref_sync['copy_tensors']} tensors) against the adapter's "
          f"{ref_sync['adapter_bytes']} B; one sync {ref_sync['sync_seconds_median'] * 1e6:.1f} us "
          f"({ref_sync['sync_to_step_ratio']:.2e} of a stock step), one exchange "
          f"{ref_sync['exchange_seconds_median'] * 1e6:.1f} us ({ref_sync['exchange_to_step_ratio']:.2e}), "
          f"{ref_sync['exchanges_per_run']} exchanges and {ref_sync['syncs_per_run']} syncs per run")
    ratios = [row["step_ratio"] for row in rows[2:] + unsloth_rows if not row["variant"].endswith(":stock")]
    # one timed pass (--smoke) has no A/A interval: NaN ends, which the docs render as none
    aa = bootstrap_ratio(times["stock (A/A)"], times["stock"]) if len(times["stock"]) > 1 else (math.nan, math.nan)
    report = {"command": shlex.join(["python", "benchmarks/overhead.py", *argv]),
              "machine": hardware(), "commit": source_commit(), "settings": vars(args),
              "device": "cuda" if torch.cuda.is_available() else "cpu", "rows": rows,
              "unsloth_rows": unsloth_rows, "core_x_k3": core, "step_seconds": times, "ref_sync": ref_sync,
              "aa_interval": list(aa)}
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(report, f, indent=1)
    # Step time includes generation: ratios inside the A/A interval are not resolved here (benchmarks/loss_overhead.py
    # resolves the loss path's overhead by decomposition). Forwards, memory and recompiles are exact.
    print(f"step time: every ratio in [{min(ratios):.3f}, {max(ratios):.3f}], A/A interval [{aa[0]:.3f}, {aa[1]:.3f}]")
    graphs = max([row["graphs_added_per_run"] for row in unsloth_rows], default=0)
    in_reward = next(row for row in rows if row["variant"] == "kl_in_reward")
    print(f"kl_in_reward: {in_reward['extra_forwards']} extra forwards over {len(forwards['kl_in_reward'])} counted "
          f"steps ({args.repeats} runs, each's first step left out; one no-grad policy forward per generation batch)")
    print(f"extra_forwards={max(row['extra_forwards'] for row in rows if row is not in_reward)} "
          f"max_memory_ratio={max(row['memory_ratio'] for row in rows):.3f} graphs_added={graphs} "
          f"max_step_ratio={max(ratios):.3f} aa=[{aa[0]:.3f},{aa[1]:.3f}] "
          f"ref_sync_extra_forwards={ref_sync['extra_forwards']} ref_sync_bytes={ref_sync['copy_bytes']} "
          f"sync_step_ratio={ref_sync['sync_to_step_ratio']:.2e}")
    return 0


def ref_sync_report(runs: list[dict[str, Any]], step_seconds: list[float], step_forwards: list[int],
                    times: dict[str, list[float]], forwards: dict[str, list[int]],
                    args: argparse.Namespace) -> dict[str, Any]:
    """The `ref_sync` JSON object: flat keys, medians over the timed passes (each pass's own median)."""
    stock_step = statistics.median(times["stock"])
    sync_s = statistics.median(run["sync_s"] for run in runs)
    exchange_s = statistics.median(run["exchange_s"] for run in runs)
    # identical in every run (same model): the first run's
    exact = {key: runs[0][key] for key in ("copy_tensors", "copy_bytes", "adapter_bytes", "exchange_temp_bytes",
                                            "syncs_per_run", "exchanges_per_run")}
    assert all(run[key] == value for run in runs for key, value in exact.items())
    exchanges_per_step = exact["exchanges_per_run"] / args.steps
    syncs_per_step = exact["syncs_per_run"] / args.steps
    return {
        "sync_steps": REF_SYNC_CONFIG["ref_model_sync_steps"],
        "alpha": REF_SYNC_CONFIG["ref_model_mixup_alpha"],
        "kl_adaptation_method": REF_SYNC_CONFIG["kl_adaptation_method"],
        "forwards_per_step": sorted(set(step_forwards)),
        "stock_forwards_per_step": sorted(set(forwards["stock"])),
        "extra_forwards": sum(step_forwards) - sum(forwards["stock"]),
        **exact,
        "bytes_to_adapter_ratio": exact["copy_bytes"] / exact["adapter_bytes"],
        "step_seconds_median": statistics.median(step_seconds),
        "stock_step_seconds_median": stock_step,
        "step_ratio": statistics.median(step_seconds) / stock_step,
        "sync_seconds_median": sync_s,
        "sync_to_step_ratio": sync_s / stock_step,
        "exchange_seconds_median": exchange_s,
        "exchange_to_step_ratio": exchange_s / stock_step,
        "copy_seconds_median": statistics.median(run["copy_s"] for run in runs),
        "added_seconds_per_step": syncs_per_step * sync_s + exchanges_per_step * exchange_s,
        "added_to_step_ratio": (syncs_per_step * sync_s + exchanges_per_step * exchange_s) / stock_step,
        "step_seconds": step_seconds,
    }


if __name__ == "__main__":
    sys.exit(main())
