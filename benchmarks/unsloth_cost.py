"""What adaptive KL adds to an Unsloth GRPO step at a real model's size, against stock Unsloth, side by side.

    python benchmarks/unsloth_cost.py --json docs/results/gpu/cost.json   # a CUDA GPU: the 0.5B size (minutes)
    python benchmarks/unsloth_cost.py --size small --json /tmp/cost.json  # a CPU: the same code at a tiny size

Sizes (`--size`):
- `0.5b`: Qwen2.5-0.5B's architecture (hidden 896, 24 layers, 14 query and 2 key-value heads, intermediate 4864,
  vocabulary 151,936, tied embeddings), randomly initialised from its config in-process (nothing is downloaded), with
  a character tokenizer built in-process and padded to that vocabulary; saved, then loaded as Unsloth users load a
  model: `FastLanguageModel.from_pretrained(load_in_4bit=True)` (CUDA only) and LoRA r16 on every projection. 8
  prompts x 8 completions of 256 tokens (`min_new_tokens`), in the card's native precision.
- `small`: the same family at hidden 64, 2 layers and a 512-token vocabulary, 4 prompts x 4 completions of 16
  tokens, in float32, loaded with transformers and PEFT (FastLanguageModel needs CUDA) and trained by Unsloth's
  generated trainer on the CPU, as the Unsloth tests run it. Its ratios are a CPU's, at a toy size: the JSON says so.

What it measures, every variant in one process on one captured batch (the micro-batch of a real training step):
- `step`: Unsloth's `compute_loss` forward and backward, then the optimizer's step, for stock Unsloth (this package's
  hooks bypassed), stock again (the A/A pair: the noise floor), and each method of `METHODS` (a method with
  `dynamic` after a mean reward above its threshold, so that beta decays at each step's end). Rounds rotate the
  order (`ROTATION`: the A/A copy half a rotation from stock), after warm-up rounds; each ratio is median(variant) /
  median(stock) with a 95 % bootstrap interval, and peak memory (`torch.cuda.max_memory_allocated` over the timed
  call, CUDA only) against stock's.
- `whole_step`: one whole GRPO optimizer step, generation included (`trainer.train()` for 2 steps, the second
  timed), for stock Unsloth (every hook this package puts on a step bypassed, generation's too), one method and the
  KL in the reward (whose cost is in scoring the completions, not in the loss), interleaved after one untimed round,
  so that a reader sees what share of a step the loss is.
- `profile`, last: stock's captured-batch step and that of the method with the largest ratio under torch.profiler,
  the operations with the most self time, per step.
Ends with one line: `max_step_ratio=X max_memory_ratio=X aa=[a,b] loss_share=X`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from loss_overhead import aa_half_way, bootstrap_ratio, with_passing_reward  # noqa: E402

QWEN2_5_0_5B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                    num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768, rope_theta=1000000.0,
                    rms_norm_eps=1e-6, tie_word_embeddings=True)
METHODS = ["none", "clip", "sigmoid", "length_normalized", "dynamic", "target", "clip+length_normalized+dynamic",
           "sigmoid+length_normalized"]
STOCK = ("stock", "stock (A/A)")
# The order a round runs the captured-batch variants in (each round starts one later)
ROTATION = aa_half_way(*STOCK, METHODS)
# The whole-step variants: the KL's placement is fixed when a trainer is built, so the KL in the reward has a trainer
# of its own (on the same policy).
WHOLE_STEP = ["stock", "sigmoid+length_normalized", "kl_in_reward"]
# With `--budget`: the captured-batch rounds aim to end by ROUNDS_BY of it (a round starts only if the last one's
# duration says it ends by then; the warm-up and one timed round always run), the whole steps start only if at most
# WHOLE_UNTIL of it is spent, their timed round only if the untimed one's duration says it ends by PROFILE_UNTIL,
# and the profile runs only if at most PROFILE_UNTIL is spent. The rounds' intervals come first (each ratio's, the
# A/A pair's), the whole step's share of a step second, where the time goes last.
ROUNDS_BY, WHOLE_UNTIL, PROFILE_UNTIL = 0.6, 0.65, 0.85
KL_IN_REWARD = {"kl_placement": "reward", "kl_reduction": "sequence_sum"}


@dataclass
class Size:
    model: dict[str, Any]
    prompts: int
    completions: int  # per prompt
    length: int  # tokens per completion
    rounds: int  # timed rounds over every variant
    whole_rounds: int
    lora_rank: int = 16


SIZES = {
    # at most 13 rounds (1 warm-up, 12 timed) of 10 captured-batch steps, then 2 rounds (1 untimed, 1 timed) of the
    # 3 whole-step variants of 2 GRPO steps each (12 generations of 64 completions of 256 tokens), then 2 profiled
    # steps; more than 9 minutes on an H200 (a run stopped at 560 s had not ended its captured-batch rounds), so the
    # GPU run gives it `--budget`, which ends the rounds by time
    "0.5b": Size(QWEN2_5_0_5B, prompts=8, completions=8, length=256, rounds=12, whole_rounds=1),
    "small": Size({**QWEN2_5_0_5B, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                   "num_attention_heads": 4, "vocab_size": 512, "max_position_embeddings": 512},
                  prompts=4, completions=4, length=16, rounds=6, whole_rounds=2),
}


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SIZES), default="0.5b")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds of the captured-batch step")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds first (compiles, caches)")
    parser.add_argument("--whole-rounds", type=int, default=None, help="rounds of the whole-step timing (0: none)")
    parser.add_argument("--budget", type=float, default=None,
                        # argparse %-formats a help text: a percent sign is written %%
                        help="seconds the run may take: the captured-batch rounds aim to end by "
                             f"{ROUNDS_BY * 100:.0f} %% of them, the whole steps are skipped when more than "
                             f"{WHOLE_UNTIL * 100:.0f} %% is spent, their timed round when it would end past "
                             f"{PROFILE_UNTIL * 100:.0f} %%, and the profile when more than that is spent (the JSON "
                             "says what stopped); default: no budget")
    parser.add_argument("--json", required=True)
    args = parser.parse_args(argv)
    for flag, value, least in (("--rounds", args.rounds, 1), ("--warmup", args.warmup, 0),
                               ("--whole-rounds", args.whole_rounds, 0)):
        if value is not None and value < least:
            parser.error(f"{flag}={value} is invalid: allowed is an integer >= {least}")
    if args.budget is not None and not args.budget > 0:
        parser.error(f"--budget={args.budget} is invalid: allowed is a number of seconds > 0")
    if args.size == "0.5b" and not torch.cuda.is_available():
        parser.error("--size 0.5b needs a CUDA GPU (4-bit loading); on a CPU, run --size small")
    return args


def save_model(size: Size, model_dir: str) -> None:
    """The architecture of `size`, randomly initialised, and a chat tokenizer padded to its vocabulary, saved."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from unsloth_adaptive_kl.tools.tiny import CHAT_ALPHABET, CHAT_TEMPLATE, build_tokenizer

    tokenizer = build_tokenizer(CHAT_ALPHABET, chat_template=CHAT_TEMPLATE, vocab_size=size.model["vocab_size"])
    config = Qwen2Config(**size.model, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                         bos_token_id=None)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)


def build_trainer(size: Size, model_dir: str, output_dir: str, policy: Any = None, **overrides: Any) -> Any:
    """Unsloth's generated trainer at `size` on the GPU check's chat prompts (`gpu_scenarios.chat_trainer`, whose
    `selfcheck.tiny_trainer` sets TRL's `mask_truncated_completions=False`); `policy`: a (model, tokenizer) already
    loaded (else loaded here); `overrides`: GRPOConfig fields."""
    from unsloth_adaptive_kl.tools import gpu_scenarios

    device = "cuda" if torch.cuda.is_available() else "cpu"
    precision = gpu_scenarios.native_precision() if device == "cuda" else "fp32"
    policy = policy or gpu_scenarios.load_policy(model_dir, "unsloth", precision, device, rank=size.lora_rank)
    return gpu_scenarios.chat_trainer(
        model_dir, output_dir, "unsloth", device, precision, policy=policy,
        per_device_train_batch_size=size.prompts * size.completions, num_generations=size.completions,
        gradient_accumulation_steps=1, max_completion_length=size.length, optim="adamw_torch", warmup_steps=0,
        generation_kwargs={"min_new_tokens": size.length}, logging_steps=1000, beta=0.04, **overrides)


def timed(function: Callable[[], Any]) -> tuple[float, int, int]:
    """(seconds, peak bytes allocated on the GPU during the call, that peak above what was allocated before it: the
    call's own working memory, which the resident model and optimizer state would dilute; 0, 0 on a CPU)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    start = time.perf_counter()
    function()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        return time.perf_counter() - start, peak, peak - before
    return time.perf_counter() - start, 0, 0


Sample = tuple[float, int, int]  # seconds, peak bytes, peak bytes above the call's start


def rotating(names: list[str], rounds: int, warmup: int, run: Callable[[str], Sample], until: float | None = None,
             least: int = 1, label: str = "round", after: Callable[[dict[str, list[Sample]]], None] | None = None
             ) -> dict[str, list[Sample]]:
    """`run(name)` for every name, `warmup + rounds` times in a rotating order; the timed rounds' results. `until`: a
    `time.perf_counter()` deadline: once `least` timed rounds have run, no round starts that the last round's
    duration says would end after it. Each round prints a line (`label`, its seconds); `after(samples)` follows each
    timed round."""
    samples: dict[str, list[Sample]] = {name: [] for name in names}
    total, took = warmup + rounds, 0.0
    for index in range(total):
        if until is not None and index - warmup >= least and time.perf_counter() + took > until:
            print(f"{label}s stop after {index - warmup} timed: the next would end past the budget", flush=True)
            break
        start = time.perf_counter()
        for name in names[index % len(names):] + names[:index % len(names)]:
            result = run(name)
            if index >= warmup:
                samples[name].append(result)
        took = time.perf_counter() - start
        print(f"{label} {index + 1} of {total} ({'timed' if index >= warmup else 'warm-up'}): {took:.1f} s",
              flush=True)
        if index >= warmup and after is not None:
            after(samples)
    return samples


def ratios(samples: dict[str, list[Sample]]) -> dict[str, dict[str, Any]]:
    """Per variant: median seconds, the ratio to stock with its interval, peak memory and its ratio to stock, and
    the peak above the call's start (the step's working memory) and its ratio to stock's."""
    stock = [seconds for seconds, _, _ in samples["stock"]]
    stock_peak = max(peak for _, peak, _ in samples["stock"])
    stock_added = max(added for _, _, added in samples["stock"])
    rows = {}
    for name, values in samples.items():
        seconds = [s for s, _, _ in values]
        peak, added = max(p for _, p, _ in values), max(a for _, _, a in values)
        rows[name] = {"median_s": statistics.median(seconds), "n": len(seconds),
                      "ratio": statistics.median(seconds) / statistics.median(stock),
                      "ci": list(bootstrap_ratio(seconds, stock)), "peak_bytes": peak,
                      "memory_ratio": peak / stock_peak if stock_peak else None, "working_bytes": added,
                      "working_memory_ratio": added / stock_added if stock_added else None}
    return rows


def captured_steps(trainer: Any, rounds: int, warmup: int, until: float | None = None,
                   progress: Callable[[dict[str, dict[str, Any]]], None] | None = None
                   ) -> tuple[dict[str, dict[str, Any]], Callable[[], dict[str, Any]]]:
    """The `step` rows: compute_loss forward + backward + the optimizer's step on one captured micro-batch; and a
    function that profiles stock's step and that of the method with the largest ratio (`top_operations`), for the
    caller to run when its time allows (on the H100 it outlasted the command's time limit). `until`: the rounds'
    deadline (`rotating`); `progress(rows)`: the rows so far, after each timed round."""
    from unsloth_adaptive_kl.tools import gpu_scenarios, selfcheck

    start = time.perf_counter()
    inputs = selfcheck.captured_inputs(trainer, "compute_loss")
    print(f"batch captured in {time.perf_counter() - start:.1f} s (one GRPO step, generation included)", flush=True)
    trainer.model.train()
    optimizer = trainer.optimizer

    def step() -> None:
        trainer.compute_loss(trainer.model, dict(inputs)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def stock_step() -> None:
        with selfcheck.stock_unsloth(trainer):
            step()

    def variant(name: str) -> Callable[[], None]:
        """`name`'s step; the trainer is set to it here, outside any timing (what a run does once)."""
        if name in STOCK:
            return stock_step
        gpu_scenarios.use_method(trainer, name)
        return with_passing_reward(trainer, name, step)

    def table(samples: dict[str, list[Sample]]) -> dict[str, dict[str, Any]]:
        return ratios({name: samples[name] for name in (*STOCK, *METHODS)})  # the order: stock, A/A, methods

    samples = rotating(ROTATION, rounds, warmup, lambda name: timed(variant(name)), until=until,
                       label="captured-batch round",
                       after=None if progress is None else lambda so_far: progress(table(so_far)))
    rows = table(samples)
    heaviest = max(METHODS, key=lambda name: rows[name]["ratio"])
    return rows, lambda: {"method": heaviest, "stock": top_operations(variant("stock")),
                          "heaviest": top_operations(variant(heaviest))}


def top_operations(step: Callable[[], None], calls: int = 1, count: int = 12) -> list[dict[str, Any]]:
    """The `count` operations with the most self time over `calls` calls of `step` (torch.profiler: the GPU's time
    on CUDA, else the CPU's), per call: where the time of a step goes. One call by default: under the profiler a
    compiled model can run many times slower (pytorch/ao#693: 20 times in torchao's generate), and on the H100 three
    profiled calls each of stock's and a method's step did not end within the command's time limit."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    with profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]) as profiler:
        for _ in range(calls):
            step()
        if cuda:
            torch.cuda.synchronize()
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    events = sorted(profiler.key_averages(), key=lambda event: getattr(event, key), reverse=True)[:count]
    return [{"name": event.key, "self_us": getattr(event, key) / calls, "calls": event.count / calls}
            for event in events]


class StepClock:
    """A TrainerCallback's view of optimizer steps: the seconds of each (on_step_begin to on_step_end)."""

    def __init__(self, trainer: Any) -> None:
        from transformers import TrainerCallback

        clock = self
        self.seconds: list[float] = []

        class Callback(TrainerCallback):
            def on_step_begin(self, *args: Any, **kwargs: Any) -> None:
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                clock.start = time.perf_counter()

            def on_step_end(self, *args: Any, **kwargs: Any) -> None:
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                clock.seconds.append(time.perf_counter() - clock.start)

        trainer.add_callback(Callback())


def whole_steps(trainers: dict[str, Any], rounds: int, until: float | None = None) -> dict[str, dict[str, Any]]:
    """The `whole_step` rows: a whole GRPO step, generation included (2 steps a run, the second timed), on the
    trainer of each variant (`trainers`: 'loss' and 'reward', the KL's placement), with the reward penalty each
    logged (the KL was in the reward exactly where it was asked for); none where `until` (a deadline, `rotating`)
    left no time for a timed round after the untimed one."""
    from unsloth_adaptive_kl.tools import gpu_scenarios, selfcheck

    clocks = {placement: StepClock(trainer) for placement, trainer in trainers.items()}
    penalties: dict[str, list[float]] = {name: [] for name in WHOLE_STEP}

    def run(name: str) -> Sample:
        placement = "reward" if name == "kl_in_reward" else "loss"
        trainer = trainers[placement]
        trainer.args.max_steps = 2
        if placement == "loss":
            gpu_scenarios.use_method(trainer, "none" if name == "stock" else name)
        with selfcheck.stock_unsloth(trainer) if name == "stock" else contextlib.nullcontext():
            trainer.train()
        # the run's last log (at its end) holds its metrics' means
        penalty = trainer.state.log_history[-1].get("adaptive_kl/reward_penalty")
        penalties[name] += [] if penalty is None else [penalty]
        return clocks[placement].seconds[-1], 0, 0

    # a first, untimed round: each trainer's first run warms up
    samples = rotating(WHOLE_STEP, rounds, 1, run, until=until, least=0, label="whole-step round")
    if not samples["stock"]:
        return {}
    rows = ratios(samples)
    for name, row in rows.items():
        row["reward_penalty"] = statistics.mean(penalties[name]) if penalties[name] else None
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    size = SIZES[args.size]
    rounds = size.rounds if args.rounds is None else args.rounds
    whole_rounds = size.whole_rounds if args.whole_rounds is None else args.whole_rounds
    import unsloth_adaptive_kl  # noqa: F401  (first, as users must)
    from unsloth_adaptive_kl.tools import gpucheck, selfcheck

    error = selfcheck.generate_unsloth_trainer()
    if error is not None:
        raise SystemExit(f"Unsloth's trainer could not be generated: {error}")
    started = time.perf_counter()
    report: dict[str, Any] = {
        "command": shlex.join(["python", "benchmarks/unsloth_cost.py", *(sys.argv[1:] if argv is None else argv)]),
        "date": time.strftime("%Y-%m-%d"), "size": args.size, "settings": asdict(size), "rounds": 0,
        "rounds_planned": rounds, "rounds_finished": False, "warmup": args.warmup, "whole_rounds": whole_rounds,
        **gpucheck.environment(), "phases": {}}

    def by(share: float) -> float | None:
        """The moment `share` of the budget is spent (None: no budget)."""
        return None if args.budget is None else started + share * args.budget

    def phase(name: str) -> None:
        """A phase ended: its time since the start, printed and kept (where the time of a run goes)."""
        report["phases"][name] = time.perf_counter() - started
        print(f"{report['phases'][name]:.0f} s: {name}", flush=True)

    def write(**measured: Any) -> None:
        """The report so far, written: the environment before anything is measured, then the captured-batch rows
        after each timed round, so that a run stopped by its command's time limit keeps what had finished."""
        report.update(measured, seconds=time.perf_counter() - started)
        step, whole = report.get("step"), report.get("whole_step")
        if step:
            methods = [row for name, row in step.items() if name not in STOCK]
            report["max_step_ratio"] = max(row["ratio"] for row in methods)
            report["max_memory_ratio"] = max((row["memory_ratio"] or 0.0) for row in methods) or None
            report["max_working_memory_ratio"] = max((row["working_memory_ratio"] or 0.0) for row in methods) or None
            report["aa_ci"] = step["stock (A/A)"]["ci"]
            report["loss_share"] = step["stock"]["median_s"] / whole["stock"]["median_s"] if whole else None
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)

    write()
    with tempfile.TemporaryDirectory() as folder:
        save_model(size, os.path.join(folder, "model"))
        phase("model saved")
        trainer = build_trainer(size, os.path.join(folder, "model"), os.path.join(folder, "out"))
        phase("trainer built")
        step, profiler = captured_steps(trainer, rounds, args.warmup, until=by(ROUNDS_BY),
                                        progress=lambda rows: write(step=rows, rounds=rows["stock"]["n"]))
        phase("captured batch timed")
        # rounds_finished (false until here): rounds fewer than planned were ended by the budget, not by the
        # command's time limit
        write(step=step, rounds=step["stock"]["n"], rounds_finished=True, whole_step={})
        whole, profile = {}, None
        spent = time.perf_counter() - started
        if whole_rounds and args.budget is not None and spent > WHOLE_UNTIL * args.budget:
            write(whole_step_skipped=f"the captured-batch part took {spent:.0f} s of the {args.budget:.0f}-second "
                                     f"budget (more than {WHOLE_UNTIL:.0%})")
        elif whole_rounds:
            # what the page says if the command's time limit stops the run in them; replaced when they end
            write(whole_step_skipped="the run stopped during the whole steps (its command's time limit)")
            in_reward = build_trainer(size, "", os.path.join(folder, "reward"),
                                      policy=(trainer.model, trainer.processing_class), **KL_IN_REWARD)
            whole = whole_steps({"loss": trainer, "reward": in_reward}, whole_rounds, until=by(PROFILE_UNTIL))
            phase("whole steps")
            if whole:
                del report["whole_step_skipped"]
                write(whole_step=whole)
            else:
                write(whole_step_skipped=f"its untimed round ended {report['phases']['whole steps']:.0f} s into "
                                         f"the {args.budget:.0f}-second budget, and a timed one would have ended "
                                         "past it")
        # the profile last, its time the least known: on the H100 the first run's outlasted its command's time limit
        spent = time.perf_counter() - started
        if args.budget is not None and spent > PROFILE_UNTIL * args.budget:
            write(profile_skipped=f"the run had spent {spent:.0f} s of the {args.budget:.0f}-second budget (more "
                                  f"than {PROFILE_UNTIL:.0%})")
        else:
            write(profile_skipped="the run stopped during the profile (its command's time limit)")
            profile = profiler()
            phase("profiled")
            del report["profile_skipped"]
            write(profile=profile)
    print(f"{'variant':<34}{'s/step':>10}{'x stock':>9}{'95% interval':>18}{'peak MiB':>10}{'x stock':>9}")
    for title, rows in (("captured batch", step), ("whole step", whole)):
        print(f"-- {title}")
        for name, row in rows.items():
            memory = (f"{row['peak_bytes'] / 2**20:>10.0f}{row['memory_ratio']:>9.3f}" if row["memory_ratio"]
                      else f"{'-':>10}{'-':>9}")
            print(f"{name:<34}{row['median_s']:>10.4f}{row['ratio']:>9.3f}"
                  f"{'[%.3f, %.3f]' % tuple(row['ci']):>18}{memory}")
    profiles = [] if profile is None else [("stock", profile["stock"]), (profile["method"], profile["heaviest"])]
    for title, operations in profiles:
        print(f"-- profile of {title}'s step: self time per step (us), calls")
        for operation in operations[:6]:
            print(f"   {operation['name'][:60]:<62}{operation['self_us']:>12.0f}{operation['calls']:>8.0f}")
    share = "n/a" if report["loss_share"] is None else f"{report['loss_share']:.3f}"
    memory = "n/a" if report["max_memory_ratio"] is None else f"{report['max_memory_ratio']:.3f}"
    print(f"max_step_ratio={report['max_step_ratio']:.3f} max_memory_ratio={memory} "
          f"aa=[{report['aa_ci'][0]:.3f},{report['aa_ci'][1]:.3f}] loss_share={share}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
