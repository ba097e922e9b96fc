"""The loss-path overhead of adaptive KL, resolved by decomposition (only ratios measured side by side count).

    python benchmarks/loss_overhead.py          # TRL; Unsloth's trainer when installed (< 15 min, 2 cores)
    python benchmarks/loss_overhead.py --smoke  # tiny repetition counts: checks that it runs and reports

Timing whole loss calls cannot resolve 1 % on a noisy CPU (an A/A pair of loss calls spreads by several per cent).
So, per trainer, on one captured real generation batch:
(a) stock: the trainer's own loss, forward + backward, with the patches bypassed: `--stock-repeats` times up front
    (the table's header), and again before each call of (b), for that row's ratio (the machine's speed drifts by
    tens of per cent between minutes; a shared denominator would carry that drift);
(b) adaptation: what the integration adds to that loss, on the same captured tensors and shapes: the patched loss
    with the trainer's loss function replaced by a stub that only does its KL line (TRL: `per_token_loss + beta *
    per_token_kl`; Unsloth: the compiled loss call), minus that stub alone, forward + backward, each timed right
    after a stock loss call (where it runs in training: timed back to back, the two calls find each other's data in
    the caches and read the added time low), `--core-repeats` rounds per method; this includes the wrapper, the
    probes, the core and the metric queue (flushed at every call here, as at the end of every optimizer step: an
    upper bound with gradient accumulation; a method with `dynamic` after a mean reward above its threshold, so that
    beta decays there);
(c) overhead = 1 + (b) / (a) per row, with a bootstrap 95 % interval (both resampled);
(d) deterministic counts from torch.profiler: aten ops and bytes allocated that each method adds per micro-batch;
(e) a sanity row: stock against the heaviest method end to end, interleaved, with an A/A control (stock against
    stock, half a rotation from stock): the difference must be consistent with (c) within the A/A interval.
It also times the core op alone (64 x 4096 per-token KL, every method) against the stock k3 expression.

(a)-(e) run at two sizes: `--completions` x `--completion-length` (8 x 64) and a larger batch,
`--large-completions` x `--large-completion-length` (16 x 256, 8x the tokens; `--large-*-repeats`: fewer repeats,
as its stock loss is far slower). What the adaptation adds to the loss
path is mostly fixed per call (ops, the metric row), while the stock loss grows with the tokens, so its share falls
with size; the table `share by size` shows it per method.
Writes JSON after each trainer (`finished` false until the end; with `--budget SECONDS` the larger size is skipped,
and the JSON says why, when the core op and the default size have used more than half of it) and ends with
`max_loss_overhead_ratio=X.XXX ci=[a,b] aa=[c,d] ops_added=N` (the default size) and
`max_loss_overhead_ratio_large=X.XXX ci=[a,b] aa=[c,d] ops_added=N` (the larger one, where it ran).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # above USDT (5): torch.profiler's per-session lines
import torch  # noqa: E402

METHODS: dict[str, dict[str, Any]] = {
    "none": {},
    "clip": {"kl_adaptation_method": "clip"},
    "sigmoid": {"kl_adaptation_method": "sigmoid"},
    "length_normalized": {"kl_adaptation_method": "length_normalized"},
    "dynamic": {"kl_adaptation_method": "dynamic"},
    "target": {"kl_adaptation_method": "target"},
    "sigmoid+length_normalized+dynamic": {"kl_adaptation_method": "sigmoid+length_normalized+dynamic"},
    "estimator=k2": {"kl_estimator": "k2"},
    "estimator=low_var_kl": {"kl_estimator": "low_var_kl"},
    "estimator=k3+": {"kl_estimator": "k3+"},
    "estimator=k3_bottom_percentile": {"kl_estimator": "k3_bottom_percentile"},
    "kl_reduction=sequence_sum": {"kl_reduction": "sequence_sum"},
    "kl_reduction=token_mean": {"kl_reduction": "token_mean"},
}
FIELDS = ("kl_adaptation_method", "kl_estimator", "kl_reduction")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--stock-repeats", type=int, default=40)
    parser.add_argument("--core-repeats", type=int, default=100)
    parser.add_argument("--e2e-repeats", type=int, default=40)
    parser.add_argument("--completions", type=int, default=8)
    parser.add_argument("--completion-length", type=int, default=64)
    parser.add_argument("--large-completions", type=int, default=16)
    parser.add_argument("--large-completion-length", type=int, default=256)
    # The larger size's stock loss is far slower than the default size's, and each of a method's rounds runs it twice:
    # fewer repeats there keep the whole run within 15 minutes on a 2-core CPU.
    parser.add_argument("--large-stock-repeats", type=int, default=20)
    parser.add_argument("--large-core-repeats", type=int, default=15)
    parser.add_argument("--large-e2e-repeats", type=int, default=20)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--budget", type=float, default=None,
                        help="seconds: the larger size is skipped (and the JSON says so) when the core op and the "
                             "default size have used more than half of them; default: no budget")
    parser.add_argument("--json", default=None, help="default: benchmarks/loss_overhead.json (the committed run); "
                                                     "with --smoke, loss_overhead_smoke.json in the temp folder")
    parser.add_argument("--trainer", choices=["trl", "unsloth"], default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.smoke:  # tiny defaults; sizes given on the command line (the trainer processes get theirs) still count
        parser.set_defaults(stock_repeats=3, core_repeats=5, e2e_repeats=3, large_stock_repeats=3, large_core_repeats=5,
                            large_e2e_repeats=3, completion_length=8,
                            large_completions=8, large_completion_length=32)
        args = parser.parse_args(argv)
    if args.json is None:  # a smoke run never overwrites the committed figures
        args.json = (os.path.join(tempfile.gettempdir(), "loss_overhead_smoke.json") if args.smoke
                     else "benchmarks/loss_overhead.json")
    if args.budget is not None and not args.budget > 0:
        parser.error(f"--budget={args.budget} is invalid: allowed is a number of seconds > 0")
    for name, value in vars(args).items():
        if name.endswith(("repeats", "completions", "completion_length")) or name in ("hidden", "layers"):
            if value < 1:
                parser.error(f"--{name.replace('_', '-')}={value} is invalid: allowed is an integer >= 1")
    return args


def bootstrap_ratio(numerator: list[float], denominator: list[float], resamples: int = 2000) -> tuple[float, float]:
    """95 % interval of median(numerator) / median(denominator), both resampled with replacement."""
    rng = random.Random(0)
    ratios = sorted(
        statistics.median(rng.choices(numerator, k=len(numerator)))
        / statistics.median(rng.choices(denominator, k=len(denominator)))
        for _ in range(resamples)
    )
    return ratios[int(0.025 * resamples)], ratios[int(0.975 * resamples) - 1]


def overhead_interval(added: list[float], stock: list[float], resamples: int = 2000) -> tuple[float, float]:
    """95 % interval of 1 + median(added) / median(stock), both resampled."""
    rng = random.Random(1)
    values = sorted(
        1 + statistics.median(rng.choices(added, k=len(added))) / statistics.median(rng.choices(stock, k=len(stock)))
        for _ in range(resamples)
    )
    return values[int(0.025 * resamples)], values[int(0.975 * resamples) - 1]


def timed(function: Callable[[], Any]) -> float:
    start = time.perf_counter()
    function()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start


def aa_half_way(stock: str, copy: str, others: list[str]) -> list[str]:
    """A rotation's order with the A/A copy half a rotation from stock, so that it follows another variant, as stock
    does: right after stock it would find stock's caches and allocator state in most rounds, and measure a noise floor
    no method sees."""
    half = (len(others) + 1) // 2
    return [stock, *others[:half], copy, *others[half:]]


def interleaved(functions: dict[str, Callable[[], Any]], repeats: int, warmup: int = 3) -> dict[str, list[float]]:
    """Round-robin in a rotating order, so that drift and cache effects hit every variant alike."""
    names = list(functions)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for iteration in range(repeats + warmup):
        for name in names[iteration % len(names):] + names[: iteration % len(names)]:
            elapsed = timed(functions[name])
            if iteration >= warmup:
                samples[name].append(elapsed)
    return samples


def after_stock(stock: Callable[[], Any], functions: dict[str, Callable[[], Any]], repeats: int,
                warmup: int = 1) -> dict[str, list[float]]:
    """Each of `functions` timed right after a call of `stock` (timed too, its samples under "stock"), in a rotating
    order: where the added code runs in training, after the model's forward and backward have filled the caches and
    the heap with their own data. Timed back to back instead, the sub-millisecond stub and patched calls find each
    other's data there, and the end-to-end sanity row measured more than their difference."""
    names = list(functions)
    samples: dict[str, list[float]] = {name: [] for name in [*names, "stock"]}
    for iteration in range(repeats + warmup):
        for name in names[iteration % len(names):] + names[: iteration % len(names)]:
            stock_s, elapsed = timed(stock), timed(functions[name])
            if iteration >= warmup:
                samples["stock"].append(stock_s)
                samples[name].append(elapsed)
    return samples


def profile_counts(function: Callable[[], Any]) -> tuple[int, int]:
    """(aten ops, bytes allocated on the host and the device) of one call, from torch.profiler: deterministic, unlike
    time."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities, profile_memory=True) as prof:
        function()
    events = [event for event in prof.events() if event.name.startswith("aten::")]
    allocated = sum(max(event.cpu_memory_usage, 0) + max(event.device_memory_usage, 0)  # a GPU's is the device's
                    for event in prof.events() if event.name == "[memory]")
    return len(events), allocated


def apply_method(trainer: Any, settings: dict[str, Any]) -> None:
    from unsloth_adaptive_kl.core.config import FIELD_DEFAULTS
    from unsloth_adaptive_kl.integrations.trainer_hooks import attach_runtime

    for field in FIELDS:
        setattr(trainer.args, field, settings.get(field, FIELD_DEFAULTS[field]))
    attach_runtime(trainer)


def with_passing_reward(trainer: Any, method: str, function: Callable[[], Any]) -> Callable[[], Any]:
    """`function`, each call after a mean reward above `reward_threshold` where `method` has `dynamic`: each step of a
    run whose reward has saturated decays beta at its end, while without a reward beta holds (and the run warns "beta
    holds"), a path no such run takes. Observing is a float's append, which a real step does as it generates; here
    it is timed with the call (an upper bound)."""
    if "dynamic" not in method.split("+"):
        return function

    def call() -> Any:
        trainer.adaptive_kl.observe_rewards(trainer.adaptive_kl.config.reward_threshold + 1.0)
        return function()

    return call


def backward(loss_function: Callable[[], torch.Tensor], leaves: list[torch.Tensor]) -> Callable[[], None]:
    """forward + backward of `loss_function`, then the gradients of `leaves` cleared."""

    def call() -> None:
        loss_function().backward()
        for leaf in leaves:
            leaf.grad = None

    return call


def with_stubs(stubs: list[tuple[Any, str, Any]], function: Callable[[], None]) -> Callable[[], None]:
    """`function` run with each (owner, name, stub) set, the previous attributes restored after it."""
    from unsloth_adaptive_kl.integrations.patching import PatchSet

    def call() -> None:
        with PatchSet() as patches:
            for owner, name, stub in stubs:
                patches.replace(owner, name, stub)
            function()

    return call


def stub_leaves(mask: torch.Tensor) -> list[torch.Tensor]:
    """The TRL stub's leaves (the policy term, the per-token KL, the policy log-probs), shaped like the captured
    batch's completion mask and on its device (CUDA on a GPU), drawn from one seeded CPU generator."""
    generator = torch.Generator().manual_seed(0)
    policy = torch.randn(mask.shape, generator=generator)
    kl = torch.rand(mask.shape, generator=generator) * 0.5
    logps = -torch.rand(mask.shape, generator=generator) * 3
    return [leaf.to(mask.device).requires_grad_(True) for leaf in (policy, kl, logps)]


def trl_bench(args: argparse.Namespace, output_dir: str) -> dict[str, Any]:
    from unsloth_adaptive_kl.tools import selfcheck
    from unsloth_adaptive_kl.tools.trainer_lab import precision_of  # Unsloth's latched autocast, else args
    from unsloth_adaptive_kl.integrations import trl as trl_patch

    trainer = selfcheck.tiny_trainer(output_dir, max_completion_length=args.completion_length,
                                     generation_kwargs={"min_new_tokens": args.completion_length},
                                     per_device_train_batch_size=args.completions)
    inputs = selfcheck.captured_inputs(trainer, "_compute_loss")
    trainer.model.train()
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    # Stock: trl's own _compute_loss (the patched state only adds trl 1.15's CPU log-prob path, which stock needs).
    stock_loss = backward(lambda: trl_patch._stock_compute_loss(trainer, trainer.model, dict(inputs)), params)
    patched_loss = backward(lambda: trl_patch._compute_loss(trainer, trainer.model, dict(inputs)), params)
    stock = interleaved({"stock": stock_loss}, args.stock_repeats)["stock"]

    # The stub: trl's KL line and reduction on captured-shape tensors (leaves, so the backward stops there), and the
    # policy log-prob call a non-default kl_estimator reads, answered from a tensor.
    mask = inputs["completion_mask"].float()
    policy, kl, logps = leaves = stub_leaves(mask)

    def stub(self: Any, model: Any, inputs: dict) -> torch.Tensor:
        per_token_logps = self._get_per_token_logps_and_entropies(model, inputs)[0]
        per_token_loss = policy + per_token_logps * 0.0 + self.beta * kl
        return (per_token_loss * mask).sum() / mask.sum()

    # Swapped in for each stubbed call only, so the stock loss sampled between them runs trl's own functions.
    stubs = [(trl_patch, "_stock_compute_loss", stub),
             (type(trainer), "_get_per_token_logps_and_entropies", lambda self, *a, **k: (logps, None))]
    rows = method_rows(args, trainer, stock_loss, {
        False: with_stubs(stubs, backward(lambda: stub(trainer, trainer.model, inputs), leaves)),
        True: with_stubs(stubs, backward(lambda: trl_patch._compute_loss(trainer, trainer.model, inputs), leaves)),
    })
    return {**report(args, trainer, stock, rows, stock_loss, patched_loss), "precision": precision_of(trainer)}


def unsloth_bench(args: argparse.Namespace, output_dir: str) -> dict[str, Any]:
    from unsloth_adaptive_kl.tools import selfcheck
    from unsloth_adaptive_kl.tools.trainer_lab import precision_of
    from unsloth_adaptive_kl.integrations import unsloth as unsloth_patch

    error = selfcheck.generate_unsloth_trainer()
    if error is not None:
        raise RuntimeError(error)
    trainer = selfcheck.tiny_trainer(output_dir, optim="adamw_torch", warmup_steps=0,
                                     max_completion_length=args.completion_length,
                                     generation_kwargs={"min_new_tokens": args.completion_length},
                                     per_device_train_batch_size=args.completions)
    shim = unsloth_patch._AdaptiveEfficientGRPO
    recorded: list = []
    apply = shim.apply

    def record(*call_args: Any) -> Any:
        recorded.append(call_args)
        return apply(*call_args)

    shim.apply = record
    try:
        inputs = selfcheck.captured_inputs(trainer, "compute_loss")
    finally:
        shim.apply = apply
    trainer.model.train()
    params = [p for p in trainer.model.parameters() if p.requires_grad]

    def stock_compute_loss() -> torch.Tensor:
        with selfcheck.stock_unsloth(trainer):  # two attribute swaps
            return trainer.compute_loss(trainer.model, dict(inputs))

    stock_loss = backward(stock_compute_loss, params)
    patched_loss = backward(lambda: trainer.compute_loss(trainer.model, dict(inputs)), params)
    stock = interleaved({"stock": stock_loss}, args.stock_repeats)["stock"]

    # The stub: the compiled loss replaced by one linear in the log-probs; the captured call's other arguments.
    new, *rest = recorded[-1]
    new = new.detach().requires_grad_(True)

    class StubLoss:
        """Stands in for the compiled UnslothEfficientGRPO: its 6 outputs, at almost no cost."""

        @staticmethod
        def apply(new_logps: torch.Tensor, *_: Any) -> tuple:
            loss = new_logps.sum() * 1e-3
            return loss, loss.detach(), loss.detach(), None, None, new_logps.detach()

    def shim_loss() -> torch.Tensor:
        token = unsloth_patch._ACTIVE.set((trainer, []))
        try:
            return shim.apply(new, *rest)[0]
        finally:
            unsloth_patch._ACTIVE.reset(token)

    stubs = [(shim, "upstream", StubLoss)]  # both sides, so that the swap's own cost cancels
    rows = method_rows(args, trainer, stock_loss, {
        False: with_stubs(stubs, backward(lambda: StubLoss.apply(new, *rest)[0], [new])),
        True: with_stubs(stubs, backward(shim_loss, [new])),
    })
    # on a GPU Unsloth's config trains the tiny float32 model in bf16 (TRL's stays fp32): each ratio is against its
    # own trainer's stock, in that trainer's precision, which the JSON records
    return {**report(args, trainer, stock, rows, stock_loss, patched_loss), "precision": precision_of(trainer)}


def method_rows(args: argparse.Namespace, trainer: Any, stock_loss: Callable[[], None],
                stubbed: dict[bool, Callable[[], None]]) -> list[dict[str, Any]]:
    """(b)-(d) per method: the patched call with the stub against the stub alone, each right after a stock loss
    (`after_stock`), whose samples in the same rounds are the ratio's denominator: numerator and denominator share
    the machine's state."""
    rows = []
    base_ops, base_bytes = profile_counts(stubbed[False])
    for name, settings in METHODS.items():
        apply_method(trainer, settings)
        patched = with_passing_reward(trainer, settings.get("kl_adaptation_method", "none"), stubbed[True])
        samples = after_stock(stock_loss, {"stub": stubbed[False], "patched": patched}, args.core_repeats)
        added = [p - s for p, s in zip(samples["patched"], samples["stub"])]
        ops, allocated = profile_counts(patched)
        low, high = overhead_interval(added, samples["stock"])
        rows.append({
            "method": name, "added_s": statistics.median(added), "stock_s": statistics.median(samples["stock"]),
            "ratio": 1 + statistics.median(added) / statistics.median(samples["stock"]), "ci": [low, high],
            "ops_added": ops - base_ops, "bytes_added": allocated - base_bytes,
        })
    return rows


def report(args: argparse.Namespace, trainer: Any, stock: list[float], rows: list[dict[str, Any]],
           stock_loss: Callable[[], None], patched_loss: Callable[[], None]) -> dict[str, Any]:
    """(e): the heaviest method end to end against stock, interleaved, with an A/A control."""
    heaviest = max(rows, key=lambda row: row["ratio"])
    settings = METHODS[heaviest["method"]]
    apply_method(trainer, settings)
    patched_loss = with_passing_reward(trainer, settings.get("kl_adaptation_method", "none"), patched_loss)
    functions = {"stock": stock_loss, "stock (A/A)": stock_loss, heaviest["method"]: patched_loss}
    e2e = interleaved({name: functions[name] for name in aa_half_way("stock", "stock (A/A)", [heaviest["method"]])},
                      args.e2e_repeats)
    ratio = statistics.median(e2e[heaviest["method"]]) / statistics.median(e2e["stock"])
    aa = statistics.median(e2e["stock (A/A)"]) / statistics.median(e2e["stock"])
    aa_ci = bootstrap_ratio(e2e["stock (A/A)"], e2e["stock"])
    return {
        "stock_loss_s": {"median": statistics.median(stock), "min": min(stock), "max": max(stock), "n": len(stock)},
        "rows": rows,
        "end_to_end": {
            "method": heaviest["method"], "ratio": ratio,
            "ci": list(bootstrap_ratio(e2e[heaviest["method"]], e2e["stock"])), "aa": aa, "aa_ci": list(aa_ci),
            # the end-to-end ratio lies within the A/A interval's half-width of the decomposed one
            "consistent": abs(ratio - heaviest["ratio"]) <= (aa_ci[1] - aa_ci[0]) / 2,
        },
    }


def where_time_goes(function: Callable[[], Any], calls: int = 20, count: int = 6) -> list[dict[str, Any]]:
    """The `count` aten ops with the most self time over `calls` calls of `function` (torch.profiler, CPU), each with
    its share of the self time of every aten op the call ran."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            function()
    events = [event for event in prof.key_averages() if event.key.startswith("aten::")]
    total = sum(event.self_cpu_time_total for event in events)
    top = sorted(events, key=lambda event: event.self_cpu_time_total, reverse=True)[:count]
    return [{"op": event.key, "share": event.self_cpu_time_total / total} for event in top]


def core_pipeline() -> tuple[Callable[[], torch.Tensor], Callable[[Any], Any]]:
    """On a 64 x 4096 per-token KL (90 % valid tokens), on the device the trainers' losses run on (CUDA where there
    is one): the stock k3 expression, and the core's pipeline for a config (k3 plus the method's adaptation: shaping,
    reductions, diagnostics)."""
    from unsloth_adaptive_kl.core.adaptation import kl_term
    from unsloth_adaptive_kl.core.reductions import ReductionContext

    generator = torch.Generator().manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # the H100's first run timed it on the host's CPU
    logp = (-torch.rand(64, 4096, generator=generator) * 5).to(device)
    ref = logp + (torch.randn(64, 4096, generator=generator) * 0.3).to(device)
    mask = (torch.rand(64, 4096, generator=generator) < 0.9).float().to(device)
    ctx = ReductionContext(max_completion_length=4096, token_normalizer=mask.sum())

    def stock() -> torch.Tensor:
        delta = ref - logp
        return torch.exp(delta) - delta - 1

    def term(config: Any) -> Any:
        # the core's one pipeline: the trainer's own KL for k3, as the integrations hand it, the core's estimator of
        # the masked log-probs otherwise; the check of both log-probs either way
        own = stock() if config.estimator == "k3" else None
        return kl_term(logp, ref, mask, config, loss_type="dapo", context=ctx, per_token_kl=own, with_grad=True)

    return stock, term


def core_op(repeats: int) -> list[dict[str, Any]]:
    """The core op alone (`core_pipeline`): the stock k3 expression, and each method's pipeline, eager, with its aten
    op count; each method against the stock k3 timed in its own interleaved rounds."""
    from unsloth_adaptive_kl import AdaptiveKLConfig

    stock, term = core_pipeline()
    base_ops = profile_counts(stock)[0]
    rows = []
    stock_samples: list[float] = []
    for name, settings in METHODS.items():
        config = AdaptiveKLConfig(**settings)
        eager = lambda config=config: term(config)  # noqa: E731
        # Each method interleaved with the stock k3 alone, in its own rounds: no other method's allocations shift the
        # heap under its ratio.
        samples = interleaved({"stock": stock, "eager": eager}, repeats, warmup=20)
        stock_samples += samples["stock"]
        method_ms, stock_ms = statistics.median(samples["eager"]), statistics.median(samples["stock"])
        rows.append({"method": name, "median_ms": method_ms * 1e3, "x_k3": method_ms / stock_ms,
                     "ops": profile_counts(eager)[0] - base_ops})
    stock_row = {"method": "stock k3", "median_ms": statistics.median(stock_samples) * 1e3, "x_k3": 1.0, "ops": 0}
    return [stock_row, *rows]


def core_op_profile() -> list[dict[str, Any]]:
    """Where `none`'s core op spends its time (`where_time_goes`): what every method pays."""
    from unsloth_adaptive_kl import AdaptiveKLConfig

    term = core_pipeline()[1]
    return where_time_goes(lambda: term(AdaptiveKLConfig()))


def run_trainer(trainer: str, args: argparse.Namespace, argv: list[str], size: tuple[int, int],
                repeats: tuple[int, int, int]) -> dict[str, Any]:
    """Each trainer in its own process: importing Unsloth rewrites TRL for the whole process. size: (completions,
    completion length) of the captured batch; repeats: (stock, core, e2e) repetition counts at that size."""
    with tempfile.TemporaryDirectory() as folder:
        output = os.path.join(folder, "result.json")
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        sized = ["--completions", str(size[0]), "--completion-length", str(size[1]), "--stock-repeats", str(repeats[0]),
                 "--core-repeats", str(repeats[1]), "--e2e-repeats", str(repeats[2])]
        no_site = ["-S"] if sys.flags.no_site else []  # an emulated image's python (.ci/gpu/dry-run) stays so
        subprocess.run([sys.executable, *no_site, os.path.abspath(__file__), *argv, *sized, "--trainer", trainer,
                        "--json", output], check=True, env=env, cwd=folder)
        with open(output) as f:
            return json.load(f)


def child(args: argparse.Namespace) -> int:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    import unsloth_adaptive_kl  # noqa: F401  (first, as users must)

    with tempfile.TemporaryDirectory() as folder:
        result = (trl_bench if args.trainer == "trl" else unsloth_bench)(args, folder)
    with open(args.json, "w") as f:
        json.dump(result, f)
    return 0


def print_table(title: str, result: dict[str, Any]) -> None:
    stock = result["stock_loss_s"]
    print(f"\n{title}: stock loss forward + backward {stock['median'] * 1e3:.1f} ms in {result['precision']} "
          f"(min {stock['min'] * 1e3:.1f}, max {stock['max'] * 1e3:.1f}, n={stock['n']})")
    print(f"{'method':36s} {'added ms':>9s} {'stock ms':>9s} {'overhead':>9s} {'95% interval':>19s} {'ops added':>10s} "
          f"{'bytes added':>12s}")
    for row in result["rows"]:
        print(f"{row['method']:36s} {row['added_s'] * 1e3:9.3f} {row['stock_s'] * 1e3:9.1f} {row['ratio']:9.4f} "
              f"[{row['ci'][0]:.4f}, {row['ci'][1]:.4f}] {row['ops_added']:10d} {row['bytes_added']:12d}")
    e2e = result["end_to_end"]
    print(f"end to end, {e2e['method']} / stock: {e2e['ratio']:.3f} [{e2e['ci'][0]:.3f}, {e2e['ci'][1]:.3f}]; "
          f"A/A {e2e['aa']:.3f} [{e2e['aa_ci'][0]:.3f}, {e2e['aa_ci'][1]:.3f}]; consistent with the decomposition: "
          f"{'yes' if e2e['consistent'] else 'NO'}")


def headline(part: dict[str, Any], started: float) -> dict[str, Any]:
    """The worst row over both trainers at one size, with its trainer's A/A interval."""
    rows = [(trainer, row) for trainer in ("trl", "unsloth") if trainer in part for row in part[trainer]["rows"]]
    trainer, worst = max(rows, key=lambda item: item[1]["ratio"])
    return {"trainer": trainer, "method": worst["method"], "ratio": worst["ratio"], "ci": worst["ci"],
            "aa": part[trainer]["end_to_end"]["aa_ci"], "ops_added": worst["ops_added"],
            "seconds": time.perf_counter() - started}


def shares(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Per trainer and method: the added time and the overhead (ratio - 1) at both sizes."""
    small, large = results, results["large"]
    out = []
    for trainer in ("trl", "unsloth"):
        if trainer not in small or trainer not in large:
            continue
        for row, big in zip(small[trainer]["rows"], large[trainer]["rows"]):
            out.append({"trainer": trainer, "method": row["method"], "added_s": row["added_s"],
                        "added_s_large": big["added_s"], "stock_s": row["stock_s"], "stock_s_large": big["stock_s"],
                        "overhead": row["ratio"] - 1, "overhead_large": big["ratio"] - 1,
                        "ops_added": row["ops_added"], "ops_added_large": big["ops_added"]})
    return out


def print_shares(results: dict[str, Any]) -> None:
    small, large = results["size"], results["large"]["size"]
    results["shares"] = shares(results)
    print(f"\nshare by size ({small['completions']} x {small['completion_length']} -> {large['completions']} x "
          f"{large['completion_length']} tokens): added ms, stock ms and overhead (ratio - 1) at each")
    for row in results["shares"]:
        print(f"  {row['trainer']:8s} {row['method']:36s} added {row['added_s'] * 1e3:6.3f} -> "
              f"{row['added_s_large'] * 1e3:6.3f} ms  stock {row['stock_s'] * 1e3:6.1f} -> "
              f"{row['stock_s_large'] * 1e3:6.1f} ms  overhead {row['overhead'] * 100:5.2f}% -> "
              f"{row['overhead_large'] * 100:5.2f}%  ops {row['ops_added']} -> {row['ops_added_large']}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.trainer is not None:
        return child(args)
    started = time.perf_counter()
    passthrough = [a for a in argv if not a.startswith("--json")]
    if "--json" in argv:
        index = argv.index("--json")
        passthrough = argv[:index] + argv[index + 2:]
    torch.set_num_threads(1)
    core, profile = core_op(20 if args.smoke else 300), core_op_profile()
    print("core op, 64 x 4096 per-token KL (eager ms; x the stock k3 expression; aten ops added)")
    for row in core:
        print(f"  {row['method']:36s} {row['median_ms']:7.3f} ms  x{row['x_k3']:.2f}  +{row['ops']} ops")
    print("where none's core op spends its time: " + ", ".join(f"{op['op']} {op['share']:.0%}" for op in profile))
    from unsloth_adaptive_kl.tools import gpucheck

    # what ran it, as the GPU page names it: the command, the date, the device and the versions
    from unsloth_adaptive_kl.tools.machine import hardware

    results: dict[str, Any] = {"command": shlex.join(["python", "benchmarks/loss_overhead.py", *argv]),
                               "date": time.strftime("%Y-%m-%d"), **gpucheck.environment(), "machine": hardware(),
                               "core_op": core, "core_op_profile": profile}
    sizes = {"": ((args.completions, args.completion_length),
                  (args.stock_repeats, args.core_repeats, args.e2e_repeats)),
             "_large": ((args.large_completions, args.large_completion_length),
                        (args.large_stock_repeats, args.large_core_repeats, args.large_e2e_repeats))}
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)

    def write() -> None:
        """The JSON as it stands: written after each trainer, so a run stopped by a time limit keeps what finished
        (`finished` stays false until the end)."""
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)

    results["finished"] = False
    trainers = ["trl"] + (["unsloth"] if importlib.util.find_spec("unsloth") is not None else [])
    for suffix, (size, repeats) in sizes.items():
        spent = time.perf_counter() - started
        if suffix and args.budget is not None and spent > args.budget / 2:
            results["large_skipped"] = (f"the core op and the default size took {spent:.0f} s of the "
                                        f"{args.budget:.0f}-second budget (more than half)")
            print(f"\nthe larger size is skipped: {results['large_skipped']}")
            break
        part = results if not suffix else results.setdefault("large", {})
        part["size"] = {"completions": size[0], "completion_length": size[1], "tokens": size[0] * size[1]}
        # the rounds each interval is over: a method's against the stub (its 95 % interval), the A/A's end to end
        part["repeats"] = {"stock": repeats[0], "methods": repeats[1], "end_to_end": repeats[2]}
        for trainer in trainers:
            part[trainer] = run_trainer(trainer, args, passthrough, size, repeats)
            title = "TRL GRPOTrainer" if trainer == "trl" else "Unsloth's generated trainer"
            print_table(f"{title}, {size[0]} x {size[1]} tokens", part[trainer])
            part["headline"] = headline(part, started)
            write()
    if "large" in results:
        print_shares(results)
    results["finished"] = True
    write()
    print(f"\n{time.perf_counter() - started:.0f} s; JSON in {args.json}")
    for suffix, part in (("", results), ("_large", results.get("large"))):
        if part is None:
            continue
        h = part["headline"]
        print(f"max_loss_overhead_ratio{suffix}={h['ratio']:.3f} ci=[{h['ci'][0]:.3f},{h['ci'][1]:.3f}] "
              f"aa=[{h['aa'][0]:.3f},{h['aa'][1]:.3f}] ops_added={h['ops_added']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
