"""The statistics behind the benchmarks' published figures, checked on synthetic timings against values worked out
by hand or by an independent formula (no GPU, no model): benchmarks/loss_overhead.py's bootstrap intervals,
interleaving and rows, and benchmarks/unsloth_cost.py's rotation, ratios, peak memory, timing, profile, whole steps
and JSON summary. tests/test_benchmark_smoke.py runs the scripts end to end; these pin down what their numbers mean."""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import types
from math import comb
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))  # as the scripts import each other (unsloth_cost imports loss_overhead)

import loss_overhead  # noqa: E402
import unsloth_cost  # noqa: E402

from unsloth_adaptive_kl import AdaptiveKL, AdaptiveKLConfig  # noqa: E402
from unsloth_adaptive_kl.tools import gpu_scenarios, gpucheck, selfcheck  # noqa: E402


# ----- the bootstrap intervals ------------------------------------------------------------------------------------

def median_cdf(n: int, draws: int, j: int) -> float:
    """P(median of `draws` (odd) values drawn with replacement from n distinct values <= the j-th smallest): at least
    draws // 2 + 1 of the draws must be among the j smallest, each with probability j / n."""
    p, needed = j / n, draws // 2 + 1
    return sum(comb(draws, k) * p ** k * (1 - p) ** (draws - k) for k in range(needed, draws + 1))


def median_quantile_rank(n: int, q: float, resamples: int, deviations: float = 4.0) -> int:
    """The rank j (1-based) of the value the `q` order statistic of `resamples` resampled medians lands on (the
    smallest j whose probability mass up to it reaches q), checked to be at least `deviations` standard deviations
    of the resampling error away from the neighbouring ranks, so that a seed is unlikely to move it."""
    F = [median_cdf(n, n, j) for j in range(1, n + 1)]
    j = next(j for j in range(1, n + 1) if F[j - 1] >= q)
    margin = deviations * math.sqrt(q * (1 - q) / resamples)
    assert F[j - 1] - q > margin and (j == 1 or q - F[j - 2] > margin), (j, F[j - 2:j])
    return j


# The order statistics the functions document, at 20000 resamples: the 501st smallest and the 19500th (50 of 2000
# outside either end at the default 2000), i.e. a symmetric 95 % interval.
LOW_Q, HIGH_Q, MANY = 501 / 20000, 19500 / 20000, 20000


def test_the_ratio_interval_is_the_2_5_and_97_5_percentiles_of_the_resampled_numerators_median() -> None:
    """A constant denominator: the interval is that of median(numerator) / 2, whose resampled distribution is known
    exactly (`median_cdf`): with 41 distinct values 1..41, its 2.5 % and 97.5 % points are ranks 15 and 27 (5 % and
    95 % would be 16 and 26, a mean's would not be integers, a numerator drawn 5 at a time would be wider). The
    numerator is given shuffled, with outliers at one end that a mean would follow."""
    assert (median_quantile_rank(41, LOW_Q, MANY), median_quantile_rank(41, HIGH_Q, MANY)) == (15, 27)
    assert (median_quantile_rank(41, 0.05, MANY), median_quantile_rank(41, 0.95, MANY)) == (16, 26)
    values = [float(v) for v in range(1, 39)] + [1000.0, 2000.0, 3000.0]  # ranks 39-41: outliers
    numerator = values[20:] + values[:20]
    low, high = loss_overhead.bootstrap_ratio(numerator, [2.0] * 5, resamples=MANY)
    assert (low, high) == (15 / 2, 27 / 2)


def test_the_ratio_interval_resamples_the_denominator_too() -> None:
    """A constant numerator: the interval is that of 6 / median(denominator), 6/27 to 6/15 for the values 1..41:
    an interval that resampled the numerator alone would be the single point 6 / 21."""
    low, high = loss_overhead.bootstrap_ratio([6.0] * 7, [float(v) for v in range(41, 0, -1)], resamples=MANY)
    assert (low, high) == (6 / 27, 6 / 15)


def test_the_default_ratio_interval_takes_2000_resamples() -> None:
    """At the default resamples (the 51st smallest and the 1950th of 2000 resampled medians), the same known
    distribution for 21, 31 and 41 values: the ranks the formula gives, each at least 1.5 standard deviations of the
    resampling error from the next (the function's seed is fixed); a few dozen resamples would land elsewhere."""
    for n in (21, 31, 41):
        expected = [float(median_quantile_rank(n, q, 2000, deviations=1.5)) for q in (51 / 2000, 1950 / 2000)]
        assert list(loss_overhead.bootstrap_ratio([float(v) for v in range(1, n + 1)], [1.0] * 3)) == expected, n


class ScriptedDraws:
    """random.Random's stand-in: the i-th `choices` call on a population returns its i-th value k times (k: the
    population's size), so that the i-th resample's median is that value."""

    def __init__(self, seed: int) -> None:
        self.calls: dict[int, int] = {}

    def choices(self, population: list[float], k: int) -> list[float]:
        assert k == len(population)
        index = self.calls.get(id(population), 0)
        self.calls[id(population)] = index + 1
        return [population[index % len(population)]] * k


@pytest.mark.parametrize("resamples", [{"resamples": 40}, {}])
@pytest.mark.parametrize("interval, offset", [(loss_overhead.bootstrap_ratio, 0.0),
                                              (loss_overhead.overhead_interval, 1.0)])
def test_the_interval_leaves_out_as_many_resampled_values_at_either_end(
        monkeypatch: pytest.MonkeyPatch, interval: Callable[..., tuple[float, float]], offset: float,
        resamples: dict[str, int]) -> None:
    """Scripted draws whose resampled medians cycle through the values 1..40 (odd ones first) over a constant 1: of
    40 resamples int(0.025 * 40) = 1 is left out below and 1 above, i.e. the 2nd smallest and the 2nd largest (not
    the largest, 49 of 2000 above; 5 % / 95 % would be the 3rd and the 38th); at the default 2000 resamples, each
    value 50 times, 50 left out at either end: the same 2 and 39 (100 resamples would give 1: the odd ones, 1 among
    them, three times)."""
    monkeypatch.setattr(loss_overhead, "random", types.SimpleNamespace(Random=ScriptedDraws))
    values = [float(v) for v in range(1, 41)]
    assert interval(values[::2] + values[1::2], [1.0] * 3, **resamples) == (offset + 2.0, offset + 39.0)


def test_the_overhead_interval_is_one_plus_the_added_over_the_stock_median_both_resampled() -> None:
    """1 + median(added) / median(stock): added 1..41 ms over a constant 0.5 s stock gives 1 + [15, 27] ms / 0.5 s
    (ranks as above; 25 % / 75 % points would be 19 and 23); a constant added time over stock 1..41 s gives
    1 + 0.01 / [27, 15]; added and stock of different lengths, as in the benchmark (stock timed before each of a
    round's two calls)."""
    assert (median_quantile_rank(41, 0.25, MANY), median_quantile_rank(41, 0.75, MANY)) == (19, 23)
    added = [v / 1000 for v in range(1, 39)] + [1.0, 2.0, 3.0]  # outliers a mean would follow
    low, high = loss_overhead.overhead_interval(added[::-1], [0.5] * 9, resamples=MANY)
    assert low == pytest.approx(1 + 0.015 / 0.5, rel=1e-12) and high == pytest.approx(1 + 0.027 / 0.5, rel=1e-12)
    low, high = loss_overhead.overhead_interval([0.01] * 300, [float(v) for v in range(1, 42)], resamples=MANY)
    assert low == pytest.approx(1 + 0.01 / 27, rel=1e-12) and high == pytest.approx(1 + 0.01 / 15, rel=1e-12)


# ----- interleaving and rotation ----------------------------------------------------------------------------------

def test_interleaved_rotates_the_order_and_keeps_only_timed_rounds(monkeypatch: pytest.MonkeyPatch) -> None:
    """Three variants, 2 warm-up rounds then 3 timed ones: the calls in the order worked out by hand, and each sample
    the time of its own call in a timed round."""
    calls: list[str] = []
    monkeypatch.setattr(loss_overhead, "timed", lambda function: (function(), float(len(calls)))[1])
    functions = {name: (lambda name=name: calls.append(name)) for name in "abc"}
    samples = loss_overhead.interleaved(functions, repeats=3, warmup=2)
    assert "".join(calls) == "abc" "bca" "cab" "abc" "bca"  # 2 warm-up rounds, then 3 timed ones
    # the call index each sample's call made (1-based: the fake clock reads the calls made so far)
    assert samples == {"a": [8.0, 10.0, 15.0], "b": [9.0, 11.0, 13.0], "c": [7.0, 12.0, 14.0]}


def test_after_stock_times_each_function_right_after_a_timed_stock_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two functions, 1 warm-up round then 2 timed ones: every call of a function comes right after a stock call,
    the order rotates, and the samples are the timed rounds' own calls (stock's: one per function call)."""
    calls: list[str] = []
    monkeypatch.setattr(loss_overhead, "timed", lambda function: (function(), float(len(calls)))[1])
    functions = {name: (lambda name=name: calls.append(name)) for name in "ab"}
    samples = loss_overhead.after_stock(lambda: calls.append("S"), functions, repeats=2, warmup=1)
    assert "".join(calls) == "SaSb" "SbSa" "SaSb"
    assert samples == {"a": [8.0, 10.0], "b": [6.0, 12.0], "stock": [5.0, 7.0, 9.0, 11.0]}


def test_rotating_runs_every_name_in_a_rotating_order_and_keeps_the_timed_rounds() -> None:
    """`unsloth_cost.rotating`, 2 warm-up rounds then 3 timed ones over three names: each round starts one name
    later, and only the timed rounds' results are kept, in order."""
    calls: list[str] = []

    def run(name: str) -> tuple[float, int]:
        calls.append(name)
        return float(len(calls)), len(calls) * 10

    samples = unsloth_cost.rotating(["a", "b", "c"], rounds=3, warmup=2, run=run)
    assert "".join(calls) == "abc" "bca" "cab" "abc" "bca"
    assert samples == {"a": [(8.0, 80), (10.0, 100), (15.0, 150)], "b": [(9.0, 90), (11.0, 110), (13.0, 130)],
                       "c": [(7.0, 70), (12.0, 120), (14.0, 140)]}


@pytest.mark.parametrize("least, timed, deadline", [(1, 1, 35.0), (0, 0, 35.0), (0, 1, 40.0)])
def test_rotating_stops_at_a_deadline_the_last_round_says_it_would_pass(monkeypatch: pytest.MonkeyPatch, least: int,
                                                                        timed: int, deadline: float) -> None:
    """Two names of 10 s each on a fake clock, 1 warm-up round and 5 timed ones, a deadline 35 s on: after the warm-up
    round (20 s) the next would end at 40 s, so none starts once `least` timed rounds have run (1: the first, b a, runs
    anyway, and `after` sees its samples; 0: none runs); a deadline 40 s on: that round ends at it, not past it, and
    runs (the next would pass it); without a deadline all 6 run."""
    clock = FakeClock()
    fake_time(monkeypatch, clock)
    start = clock.now

    def run(name: str) -> tuple[float, int, int]:
        clock.advance(10.0)
        return clock.now - start, 0, 0

    seen: list[dict] = []
    samples = unsloth_cost.rotating(["a", "b"], rounds=5, warmup=1, run=run, until=start + deadline, least=least,
                                    after=lambda so_far: seen.append({k: list(v) for k, v in so_far.items()}))
    assert samples == ({"a": [(40.0, 0, 0)], "b": [(30.0, 0, 0)]} if timed else {"a": [], "b": []})
    assert seen == [samples] * timed and clock.now == start + 20.0 * (1 + timed)
    everything = unsloth_cost.rotating(["a", "b"], rounds=5, warmup=1, run=run)
    assert [len(v) for v in everything.values()] == [5, 5]


# ----- unsloth_cost: ratios, peak memory, timing, profile -----------------------------------------------------------

def test_ratios_are_medians_against_stocks_median_with_an_interval_and_peak_memory_against_stocks() -> None:
    """Synthetic timings whose medians and means differ (an outlier each): ratio = median / stock's median, its
    interval around it, n, and the largest peak of a variant against the largest of stock, and so the working memory
    (the peak above the call's start, here the peak less 40); stock's own ratio is 1."""
    def timings(seconds: list[float], peaks: list[int]) -> list[tuple[float, int, int]]:
        return [(second, peak, peak - 40) for second, peak in zip(seconds, peaks)]

    samples = {  # 9 rounds; medians 1.0, 1.0 and 1.5; stock's and clip's means 1.89 and 4.78
        "stock": timings([1.0, 1.02, 0.98, 1.01, 0.99, 9.0, 1.03, 0.97, 1.0], [100, 300, 200, 250, 120] + [110] * 4),
        "stock (A/A)": timings([1.01, 0.99, 1.0, 1.02, 0.98, 1.0, 1.03, 0.97, 1.005], [120, 300, 260] + [90] * 6),
        "clip": timings([1.5, 1.53, 1.47, 1.515, 1.485, 30.0, 1.545, 1.455, 1.5], [150, 450, 50] + [60] * 6),
    }
    rows = unsloth_cost.ratios(samples)
    assert list(rows) == ["stock", "stock (A/A)", "clip"]
    assert rows["clip"]["median_s"] == 1.5 and rows["clip"]["n"] == 9
    assert rows["clip"]["ratio"] == 1.5 and rows["stock"]["ratio"] == 1.0 and rows["stock (A/A)"]["ratio"] == 1.0
    low, high = rows["clip"]["ci"]
    assert 1.0 < low <= 1.5 <= high < 2.0  # around 1.5, not around its inverse or 1
    low, high = rows["stock (A/A)"]["ci"]
    assert 0.9 < low < 1.0 < high < 1.1
    assert (rows["clip"]["peak_bytes"], rows["stock"]["peak_bytes"]) == (450, 300)
    assert rows["clip"]["memory_ratio"] == 1.5 and rows["stock (A/A)"]["memory_ratio"] == 1.0
    assert (rows["clip"]["working_bytes"], rows["stock"]["working_bytes"]) == (410, 260)
    assert rows["clip"]["working_memory_ratio"] == 410 / 260
    higher_aa = unsloth_cost.ratios({"stock": [(1.0, 200, 100)], "stock (A/A)": [(1.0, 400, 300)],
                                     "clip": [(1.0, 300, 150)]})  # against stock's peaks, not the A/A copy's
    assert (higher_aa["clip"]["memory_ratio"], higher_aa["clip"]["working_memory_ratio"]) == (1.5, 1.5)
    on_a_cpu = unsloth_cost.ratios({"stock": [(1.0, 0, 0)], "none": [(1.1, 0, 0)]})
    assert on_a_cpu["none"]["memory_ratio"] is None and on_a_cpu["none"]["peak_bytes"] == 0
    assert on_a_cpu["none"]["working_memory_ratio"] is None


class FakeClock:
    """time.perf_counter's stand-in: advanced by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def advance(self, seconds: float) -> None:
        self.now += seconds


def fake_time(monkeypatch: pytest.MonkeyPatch, clock: FakeClock) -> None:
    monkeypatch.setattr(unsloth_cost, "time", types.SimpleNamespace(perf_counter=lambda: clock.now,
                                                                     strftime=lambda fmt: "2026-01-01"))


def test_timed_on_cuda_waits_for_the_gpu_and_reads_the_peak_of_its_own_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fake CUDA device: the GPU work queued by the call (4 s) is waited for before the clock is read, and the
    peak is the call's own (peak statistics reset before it), not an earlier variant's higher peak, nor what is
    allocated at its end; its working memory is that peak less what was allocated when it began (10)."""
    clock, memory = FakeClock(), {"current": 10, "peak": 999, "queued": 0.0}  # 999: a previous variant's peak

    def synchronize() -> None:
        clock.advance(memory["queued"])
        memory["queued"] = 0.0

    def reset_peak_memory_stats() -> None:
        memory["peak"] = memory["current"]

    def function() -> None:
        clock.advance(1.0)
        memory["queued"] = 4.0
        memory["peak"] = max(memory["peak"], 123)

    fake_time(monkeypatch, clock)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", reset_peak_memory_stats)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: memory["peak"])
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda: memory["current"])
    assert unsloth_cost.timed(function) == (5.0, 123, 113)


class Event:
    def __init__(self, key: str, cpu: float, device: float, count: int) -> None:
        self.key, self.self_cpu_time_total, self.self_device_time_total, self.count = key, cpu, device, count


def fake_profiler(monkeypatch: pytest.MonkeyPatch, events: list[Event]) -> None:
    @contextlib.contextmanager
    def profile(activities: Any) -> Iterator[Any]:
        yield types.SimpleNamespace(key_averages=lambda: events)

    monkeypatch.setattr(torch.profiler, "profile", profile)


EVENTS = [Event("aten::add", cpu=300.0, device=30.0, count=6), Event("aten::mm", cpu=90.0, device=900.0, count=3),
          Event("aten::where", cpu=600.0, device=60.0, count=12), Event("aten::copy_", cpu=30.0, device=3.0, count=3)]


def test_top_operations_orders_by_self_time_per_call_the_cpus_on_a_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Over 3 calls, the most self CPU time first, each per call (time and count divided by 3)."""
    fake_profiler(monkeypatch, EVENTS)
    steps: list[int] = []
    top = unsloth_cost.top_operations(lambda: steps.append(1), calls=3, count=3)
    assert steps == [1, 1, 1]
    assert top == [{"name": "aten::where", "self_us": 200.0, "calls": 4.0},
                   {"name": "aten::add", "self_us": 100.0, "calls": 2.0},
                   {"name": "aten::mm", "self_us": 30.0, "calls": 1.0}]


def test_top_operations_on_cuda_orders_by_the_gpus_self_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA the GPU's self time decides (a matmul, not the CPU's dispatch)."""
    fake_profiler(monkeypatch, EVENTS)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    top = unsloth_cost.top_operations(lambda: None, calls=3, count=2)
    assert top == [{"name": "aten::mm", "self_us": 300.0, "calls": 1.0},
                   {"name": "aten::where", "self_us": 20.0, "calls": 4.0}]


# ----- unsloth_cost.captured_steps on a fake trainer -----------------------------------------------------------------

# seconds of a fake step per method (stock: 1 s); `target` the heaviest
STEP_COST = {"stock": 1.0, "none": 1.01, "clip": 1.02, "sigmoid": 1.03, "length_normalized": 1.04, "dynamic": 1.05,
             "target": 1.5, "clip+length_normalized+dynamic": 1.2, "sigmoid+length_normalized": 1.1}


class FakeUnslothTrainer:
    """Unsloth's trainer as captured_steps sees it: compute_loss costs `STEP_COST` of the method set (stock inside
    `stock_unsloth`), on a fake clock; switching methods costs 100 s (outside any timing, or the ratios show it)."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock, self.method, self.stock, self.log = clock, "none", False, []
        # each mean reward observed, with the log's length then: the step it comes before
        self.observed: list[tuple[int, float]] = []
        self.adaptive_kl = types.SimpleNamespace(config=AdaptiveKLConfig(), observe_rewards=lambda reward: (
            self.observed.append((len(self.log), reward))))
        self.model = types.SimpleNamespace(train=lambda: None)
        self.optimizer = types.SimpleNamespace(step=lambda: self.log.append("step"),
                                               zero_grad=lambda set_to_none: self.log.append("zero_grad"))

    def use(self, method: str) -> None:
        self.clock.advance(100.0)
        self.method = method

    def compute_loss(self, model: Any, inputs: dict) -> Any:
        mode = "stock" if self.stock else self.method
        self.clock.advance(STEP_COST[mode])
        self.log.append(mode)
        return types.SimpleNamespace(backward=lambda: None)


def fake_unsloth(monkeypatch: pytest.MonkeyPatch, clock: FakeClock) -> None:
    @contextlib.contextmanager
    def stock_unsloth(trainer: Any) -> Iterator[None]:
        trainer.stock = True
        try:
            yield
        finally:
            trainer.stock = False

    fake_time(monkeypatch, clock)
    monkeypatch.setattr(selfcheck, "stock_unsloth", stock_unsloth)
    monkeypatch.setattr(selfcheck, "captured_inputs", lambda trainer, compute: {"input_ids": 1})
    monkeypatch.setattr(gpu_scenarios, "use_method", lambda trainer, method: trainer.use(method))


def test_captured_steps_times_each_method_against_stock_with_the_switch_outside_the_timing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Every variant's ratio is its step's cost over stock's (the 100 s switch between methods is not in it), each
    step is compute_loss, backward, the optimizer's step and zero_grad, each step of a method with `dynamic` follows
    a mean reward above its default threshold (0.8: beta decays at the step's end), and the profile, when asked for,
    is of stock's step and of the method with the largest ratio."""
    clock = FakeClock()
    fake_unsloth(monkeypatch, clock)
    profiled: list[str] = []

    def top_operations(step: Callable[[], None]) -> list[dict[str, Any]]:
        step()
        profiled.append(trainer.log[-3])
        return [{"name": profiled[-1], "self_us": 1.0, "calls": 1.0}]

    monkeypatch.setattr(unsloth_cost, "top_operations", top_operations)
    trainer = FakeUnslothTrainer(clock)
    progress: list[dict] = []
    rows, profiler = unsloth_cost.captured_steps(trainer, rounds=3, warmup=1, progress=progress.append)
    assert profiled == []  # the profile runs when its caller asks, after what its time allows
    profile = profiler()
    assert list(rows) == ["stock", "stock (A/A)", *unsloth_cost.METHODS]
    # the rows so far after each timed round: what a run stopped by its time limit keeps
    assert [{name: row["n"] for name, row in so_far.items()} for so_far in progress] == [
        {name: n for name in rows} for n in (1, 2, 3)]
    assert progress[-1] == rows
    for name, row in rows.items():
        assert row["ratio"] == pytest.approx(STEP_COST["stock" if name.startswith("stock") else name]), name
        assert row["n"] == 3 and row["median_s"] == pytest.approx(row["ratio"])
    assert profile["method"] == "target" and profiled == ["stock", "target"]
    assert profile["stock"][0]["name"] == "stock" and profile["heaviest"][0]["name"] == "target"
    calls = 4 * len(rows) + 2
    assert trainer.log == [item for mode in trainer.log[::3] for item in (mode, "step", "zero_grad")]
    assert len(trainer.log) == 3 * calls
    dynamic_steps = [index for index in range(0, len(trainer.log), 3) if "dynamic" in trainer.log[index].split("+")]
    assert dynamic_steps and [index for index, _ in trainer.observed] == dynamic_steps
    assert all(reward > AdaptiveKLConfig().reward_threshold for _, reward in trainer.observed)
    # the rounds' order: the A/A copy half a rotation from stock, after a method as stock is; each round one later
    first = ["stock", "none", "clip", "sigmoid", "length_normalized", "stock", "dynamic", "target",
             "clip+length_normalized+dynamic", "sigmoid+length_normalized"]
    assert trainer.log[::3][:2 * len(first)] == first + first[1:] + first[:1]


def test_captured_steps_profiles_a_method_even_when_the_aa_pair_has_the_largest_ratio(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU the methods' costs are within the noise, so the A/A pair's ratio can be the largest of all: the
    profile is still of the method (of METHODS) with the largest ratio."""
    clock = FakeClock()
    fake_unsloth(monkeypatch, clock)
    monkeypatch.setattr(unsloth_cost, "top_operations", lambda step: [])
    real_ratios = unsloth_cost.ratios

    def noisy(samples: dict) -> dict:
        rows = real_ratios(samples)
        rows["stock (A/A)"]["ratio"] = 2.0
        return rows

    monkeypatch.setattr(unsloth_cost, "ratios", noisy)
    rows, profiler = unsloth_cost.captured_steps(FakeUnslothTrainer(clock), rounds=1, warmup=0)
    assert profiler()["method"] == "target"


def test_captured_steps_end_their_rounds_by_the_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    """A deadline the warm-up round (10 steps, 9 method switches of 100 s: about 911 s) says the next round would pass:
    one timed round runs, and its rows are the table."""
    clock = FakeClock()
    fake_unsloth(monkeypatch, clock)
    monkeypatch.setattr(unsloth_cost, "top_operations", lambda step: [])
    rows, _ = unsloth_cost.captured_steps(FakeUnslothTrainer(clock), rounds=12, warmup=1, until=clock.now + 1500.0)
    assert {row["n"] for row in rows.values()} == {1}


# ----- unsloth_cost.whole_steps on fake trainers -------------------------------------------------------------------

class FakeGRPOTrainer:
    """A trainer whose train() runs `args.max_steps` optimizer steps through its callbacks on the fake clock: a step
    costs its variant's seconds, plus 5 s on the first step of a run (its caches) and 50 s on every step of the
    trainer's first run (compiles); each run logs its reward penalty, the next of `penalties` (none for the KL in
    the loss)."""

    COST = {("loss", "stock"): 2.0, ("loss", "none"): 2.02, ("loss", "sigmoid+length_normalized"): 2.1,
            ("reward", "kl_in_reward"): 2.5}

    def __init__(self, clock: FakeClock, placement: str, penalties: list[float]) -> None:
        self.clock, self.placement, self.penalties = clock, placement, penalties
        self.method = "kl_in_reward" if placement == "reward" else "none"
        self.stock, self.callbacks = False, []
        self.args = types.SimpleNamespace(max_steps=None)
        self.state = types.SimpleNamespace(log_history=[])
        self.runs: list[tuple[str, int]] = []

    def add_callback(self, callback: Any) -> None:
        self.callbacks.append(callback)

    def use(self, method: str) -> None:
        self.method = method

    def train(self) -> None:
        variant = "stock" if self.stock else self.method
        self.runs.append((variant, self.args.max_steps))
        for step in range(self.args.max_steps):
            for callback in self.callbacks:
                callback.on_step_begin(None, None, None)
            first_step, first_run = step == 0, len(self.runs) == 1
            self.clock.advance(self.COST[(self.placement, variant)] + 5.0 * first_step + 50.0 * first_run)
            for callback in self.callbacks:
                callback.on_step_end(None, None, None)
        penalty = {"adaptive_kl/reward_penalty": self.penalties.pop(0)} if self.penalties else {}
        self.state.log_history.append({"train_runtime": 1.0, **penalty})


def test_whole_steps_time_the_second_step_of_each_run_after_an_untimed_round(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two timed rounds of each variant after a warm-up round: each sample is the second step of a 2-step run (no
    first-step or first-run cost), stock is stock Unsloth, the KL in the reward runs on its own trainer, and its
    reward penalty is the mean of those its runs logged (0.4: not their median, 0.3, nor the last, 0.8)."""
    clock = FakeClock()
    fake_unsloth(monkeypatch, clock)
    trainers = {"loss": FakeGRPOTrainer(clock, "loss", []), "reward": FakeGRPOTrainer(clock, "reward", [0.3, 0.1, 0.8])}
    rows = unsloth_cost.whole_steps(trainers, rounds=2)
    assert list(rows) == unsloth_cost.WHOLE_STEP
    assert rows["stock"]["median_s"] == pytest.approx(2.0) and rows["stock"]["n"] == 2
    assert rows["sigmoid+length_normalized"]["ratio"] == pytest.approx(1.05)
    assert rows["kl_in_reward"]["ratio"] == pytest.approx(1.25)
    stock, method = ("stock", 2), ("sigmoid+length_normalized", 2)
    assert trainers["loss"].runs == [stock, method, method, stock, stock, method]  # rounds: s m r, m r s, r s m
    assert trainers["reward"].runs == [("kl_in_reward", 2)] * 3
    assert rows["kl_in_reward"]["reward_penalty"] == pytest.approx(0.4)
    assert rows["stock"]["reward_penalty"] is None and rows["stock"]["memory_ratio"] is None


def test_whole_steps_time_nothing_when_the_untimed_round_leaves_no_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """The untimed round (3 runs of 2 steps, first runs compiling: about 330 s) says a timed round would end past a
    deadline 400 s on: none runs, and there are no rows (not rows of nothing)."""
    clock = FakeClock()
    fake_unsloth(monkeypatch, clock)
    trainers = {"loss": FakeGRPOTrainer(clock, "loss", []), "reward": FakeGRPOTrainer(clock, "reward", [])}
    assert unsloth_cost.whole_steps(trainers, rounds=1, until=clock.now + 400.0) == {}
    assert len(trainers["loss"].runs) == 2 and len(trainers["reward"].runs) == 1


# ----- unsloth_cost.main: the JSON's summary and the last line -----------------------------------------------------

def cost_row(median: float, ratio: float, ci: list[float], memory: Any = None, peak: int = 0,
             working: Any = None) -> dict[str, Any]:
    return {"median_s": median, "n": 3, "ratio": ratio, "ci": ci, "peak_bytes": peak, "memory_ratio": memory,
            "working_bytes": peak // 2, "working_memory_ratio": working}


def test_the_cost_json_summarises_the_methods_against_stock_and_the_aa_pair(monkeypatch: pytest.MonkeyPatch,
                                                                            tmp_path: Path, capsys: Any) -> None:
    """main() on measured rows given here: the largest step ratio and memory ratio are the methods' (not the A/A
    pair's, whose noise is the largest here), by their ratio, not their interval; aa_ci is the A/A pair's interval;
    loss_share is stock's captured step over stock's whole step; the last line says all four. The size's rounds
    unless `--rounds`, `--warmup` and `--whole-rounds` say otherwise (0 whole rounds: none, and no loss share)."""
    step = {"stock": cost_row(0.5, 1.0, [0.98, 1.02], 1.0, 100, 1.0),
            "stock (A/A)": cost_row(0.6, 1.2, [0.9, 1.3], 1.3, 130, 1.6),
            "none": cost_row(0.505, 1.01, [0.99, 1.03], 1.02, 102, 1.25),
            "clip": cost_row(0.525, 1.05, [1.0, 1.4], 1.1, 110, 1.2),
            "sigmoid": cost_row(0.51, 1.02, [1.0, 1.04], None, 0)}
    whole = {"stock": cost_row(2.0, 1.0, [0.9, 1.1]), "sigmoid+length_normalized": cost_row(2.2, 1.1, [1.0, 1.2]),
             "kl_in_reward": cost_row(2.4, 1.2, [1.1, 1.3])}
    profile = {"method": "clip", "stock": [{"name": "aten::mm", "self_us": 10.0, "calls": 2.0}],
               "heaviest": [{"name": "aten::mm", "self_us": 11.0, "calls": 2.0}]}
    monkeypatch.setattr(selfcheck, "generate_unsloth_trainer", lambda: None)
    monkeypatch.setattr(gpucheck, "environment", lambda: {"device": {"kind": "cpu"}, "versions": {}})
    monkeypatch.setattr(unsloth_cost, "save_model", lambda size, folder: None)
    monkeypatch.setattr(unsloth_cost, "build_trainer", lambda *args, **kwargs: types.SimpleNamespace(
        model=None, processing_class=None))
    asked: list[tuple] = []
    monkeypatch.setattr(unsloth_cost, "captured_steps", lambda trainer, rounds, warmup, **kw: (
        asked.append(("captured", rounds, warmup)), (step, lambda: profile))[1])
    monkeypatch.setattr(unsloth_cost, "whole_steps", lambda trainers, rounds, until: (
        asked.append(("whole", rounds)), whole)[1])
    path = tmp_path / "cost.json"
    assert unsloth_cost.main(["--size", "small", "--json", str(path)]) == 0
    small = unsloth_cost.SIZES["small"]
    assert asked == [("captured", small.rounds, 1), ("whole", small.whole_rounds)]
    report = json.loads(path.read_text())
    assert report["max_step_ratio"] == 1.05 and report["max_memory_ratio"] == 1.1
    assert report["max_working_memory_ratio"] == 1.25
    assert report["aa_ci"] == [0.9, 1.3] and report["loss_share"] == 0.25 and report["profile"] == profile
    assert capsys.readouterr().out.strip().splitlines()[-1] == (
        "max_step_ratio=1.050 max_memory_ratio=1.100 aa=[0.900,1.300] loss_share=0.250")
    asked.clear()
    argv = ["--size", "small", "--rounds", "2", "--warmup", "0", "--whole-rounds", "0", "--json", str(path)]
    assert unsloth_cost.main(argv) == 0
    report = json.loads(path.read_text())
    assert asked == [("captured", 2, 0)] and (report["rounds_planned"], report["warmup"]) == (2, 0)
    assert report["whole_step"] == {} and report["loss_share"] is None


def test_a_budget_ends_the_rounds_and_skips_the_whole_steps_it_has_no_time_for_and_says_so(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """`--budget 100` on a fake clock: the captured-batch rounds get the deadline 60 s on, and the rows after each
    timed round are written with the rounds so far (so a run stopped by its time limit keeps them); that part taking
    70 s leaves the whole steps untimed (more than 65 s spent), and the JSON says why; taking 40 s, or 65 s (not more
    than 65 %, though more than the rounds' 60 %), they run with the deadline 85 s on; where their untimed round
    left no time for a timed one, the JSON says that. The profile (10 s) comes last, only where at most 85 s are
    spent (65 s and 30 s of whole steps: 95 s, so none, and the JSON says why). The JSON exists, with the
    environment, before anything is measured; each phase's time since the start is kept; no memory ratio without
    CUDA peaks."""
    clock = FakeClock()
    fake_time(monkeypatch, clock)
    start = clock.now
    step = {"stock": cost_row(0.5, 1.0, [0.98, 1.02]), "stock (A/A)": cost_row(0.5, 1.0, [0.9, 1.1]),
            "none": cost_row(0.5, 1.0, [0.99, 1.01])}
    profile = {"method": "none", "stock": [], "heaviest": []}
    path = tmp_path / "cost.json"
    written_first, written_after_round, deadlines = [], [], []

    def captured(trainer, rounds, warmup, until, progress):
        written_first.append(json.loads(path.read_text()))
        deadlines.append(until - start)
        progress({name: {**row, "n": 1} for name, row in step.items()})
        written_after_round.append(json.loads(path.read_text()))
        clock.advance(spent)
        return step, profiler

    def profiler():
        # what the page would say of a run stopped here by its command's time limit, the rounds' table kept whole
        written = json.loads(path.read_text())
        assert written["profile_skipped"] == "the run stopped during the profile (its command's time limit)"
        assert written["rounds_finished"] is True and "profile" not in written
        clock.advance(10.0)
        return profile

    def whole_steps(trainers, rounds, until):
        deadlines.append(until - start)
        # what the page would say of a run stopped here by its command's time limit
        assert json.loads(path.read_text())["whole_step_skipped"] == ("the run stopped during the whole steps (its "
                                                                      "command's time limit)")
        clock.advance(30.0)
        return whole

    monkeypatch.setattr(selfcheck, "generate_unsloth_trainer", lambda: None)
    monkeypatch.setattr(gpucheck, "environment", lambda: {"device": {"kind": "cpu"}, "versions": {"torch": "x"}})
    monkeypatch.setattr(unsloth_cost, "save_model", lambda size, folder: None)
    monkeypatch.setattr(unsloth_cost, "build_trainer", lambda *args, **kwargs: types.SimpleNamespace(
        model=None, processing_class=None))
    monkeypatch.setattr(unsloth_cost, "captured_steps", captured)
    monkeypatch.setattr(unsloth_cost, "whole_steps", whole_steps)
    for spent, whole, skipped in ((70.0, {}, "the captured-batch part took 70 s of the 100-second budget (more "
                                               "than 65%)"),
                                  (40.0, {"stock": cost_row(2.0, 1.0, [1, 1])}, None),
                                  (65.0, {"stock": cost_row(2.0, 1.0, [1, 1])}, None),
                                  (40.0, {}, "its untimed round ended 70 s into the 100-second budget, and a "
                                             "timed one would have ended past it")):
        profiled = spent != 65.0
        deadlines.clear()
        start = clock.now
        assert unsloth_cost.main(["--size", "small", "--budget", "100", "--json", str(path)]) == 0
        report = json.loads(path.read_text())
        assert written_first[-1]["versions"] == {"torch": "x"} and "step" not in written_first[-1]
        assert written_after_round[-1]["rounds"] == 1 and written_after_round[-1]["step"]["none"]["n"] == 1
        # a run stopped in its rounds says so in its file (the page: "so far"); one that ended them says that
        assert written_first[-1]["rounds_finished"] is written_after_round[-1]["rounds_finished"] is False
        assert "profile" not in written_after_round[-1] and report["rounds_finished"] is True
        assert report["rounds"] == 3 and report["rounds_planned"] == unsloth_cost.SIZES["small"].rounds
        assert deadlines == [60.0] + [85.0] * (spent <= 65)
        assert report["phases"]["captured batch timed"] == spent
        assert report.get("profile") == (profile if profiled else None)
        assert report.get("profile_skipped") == (None if profiled else "the run had spent 95 s of the 100-second "
                                                                       "budget (more than 85%)")
        assert report["whole_step"] == whole and report.get("whole_step_skipped") == skipped
        assert (report["loss_share"] is None) == (not whole)
        assert report["max_memory_ratio"] is None and report["max_working_memory_ratio"] is None  # no CUDA peaks


def test_the_help_states_the_budgets_shares(capsys: Any) -> None:
    """`--help` prints (argparse %-formats each help text: a bare percent sign raised TypeError there) the shares of
    `--budget` the rounds and the whole steps get, from the constants the run reads."""
    with pytest.raises(SystemExit) as exit:
        unsloth_cost.parse_args(["--help"])
    assert exit.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert (f"the captured-batch rounds aim to end by {unsloth_cost.ROUNDS_BY * 100:.0f} % of them, the whole steps "
            f"are skipped when more than {unsloth_cost.WHOLE_UNTIL * 100:.0f} % is spent, their timed round when it "
            f"would end past {unsloth_cost.PROFILE_UNTIL * 100:.0f} %, and the profile when more than that is "
            "spent") in text


def test_the_gpu_size_times_enough_rounds_after_a_warm_up() -> None:
    """The GPU figures' ratios and intervals come from at least 10 timed rounds, after at least one untimed round
    (compiles, caches: the docstring's 'after warm-up rounds')."""
    assert unsloth_cost.SIZES["0.5b"].rounds >= 10
    assert unsloth_cost.parse_args(["--size", "small", "--json", "x.json"]).warmup >= 1


# ----- loss_overhead: rows, the sanity row, the headline, the sizes --------------------------------------------------

def test_method_rows_divide_the_paired_added_time_by_the_stock_timed_in_the_same_rounds(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Synthetic rounds: added = patched - stub per round (medians 1 ms, a mean of 4 ms with one outlier; the
    difference of the two medians would be 2 ms), over the median of the stock loss timed before each of them in
    those rounds (50 ms, not the stub's): ratio 1.02, its interval around it; the stub and the patched call each
    timed after the stock loss (`after_stock`), not back to back."""
    samples = {"stub": [0.010, 0.014, 0.012, 0.010, 0.011], "patched": [0.011, 0.015, 0.013, 0.026, 0.012],
               "stock": [0.049, 0.050, 0.052, 0.050, 0.051, 0.048, 0.050, 0.053, 0.050, 0.047]}
    rounds: list[tuple[Any, list[str], int]] = []
    monkeypatch.setattr(loss_overhead, "METHODS", {"clip": {"kl_adaptation_method": "clip"}})
    monkeypatch.setattr(loss_overhead, "apply_method", lambda trainer, settings: None)
    monkeypatch.setattr(loss_overhead, "profile_counts", lambda function: function())
    monkeypatch.setattr(loss_overhead, "after_stock", lambda stock, functions, repeats: (
        rounds.append((stock, list(functions), repeats)), samples)[1])
    args = types.SimpleNamespace(core_repeats=5)
    stock = lambda: None  # noqa: E731
    (row,) = loss_overhead.method_rows(args, None, stock, {False: lambda: (10, 100), True: lambda: (17, 164)})
    assert row["added_s"] == pytest.approx(0.001) and row["stock_s"] == 0.050
    assert row["ratio"] == pytest.approx(1.02)
    assert row["ci"][0] <= row["ratio"] <= row["ci"][1] and row["ci"][0] > 1.0
    assert (row["ops_added"], row["bytes_added"]) == (7, 64)
    assert rounds == [(stock, ["stub", "patched"], 5)]


@pytest.mark.parametrize("threshold", [0.8, -2.0])
def test_a_method_with_dynamic_is_timed_on_the_decaying_path(threshold: float) -> None:
    """`with_passing_reward`: before each call of a method with `dynamic`, a mean reward above its threshold (its
    default, and one below 0), so beta decays at each step's end: 0.04 * 0.9 ** n after n steps, not 0.04 (the hold a
    step with no reward takes). A method without `dynamic` gets its function unchanged."""
    trainer = types.SimpleNamespace(adaptive_kl=AdaptiveKL(
        AdaptiveKLConfig(kl_adaptation_method="sigmoid+dynamic", reward_threshold=threshold), beta=0.04))
    call = loss_overhead.with_passing_reward(trainer, "sigmoid+dynamic", trainer.adaptive_kl.step)
    assert [call() for _ in range(3)] == pytest.approx([0.04 * 0.9, 0.04 * 0.81, 0.04 * 0.729])
    function = trainer.adaptive_kl.step
    assert loss_overhead.with_passing_reward(trainer, "clip+length_normalized", function) is function


def test_the_sanity_row_interleaves_the_aa_pair_and_checks_consistency_within_its_half_width(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The heaviest decomposed row end to end on a fake clock that drifts by 0.1 % a call: stock (1 s), its A/A copy
    (3 % slower: the noise floor) and the method (1.5 s) in the rotating order, so that the drift hits all alike. The
    ratio is the method's over stock's (not over the A/A copy's), the A/A ratio 1.03 with its interval around it, and
    `consistent` holds exactly when the decomposed ratio is within half the A/A interval's width of the measured one."""
    names = ["stock", "sigmoid", "stock (A/A)"]  # the A/A copy half a rotation from stock (`aa_half_way`)
    cost = {"stock": 1.0, "stock (A/A)": 1.03, "sigmoid": 1.5}
    calls = {"n": 0}

    def timed(function: Callable[[], None]) -> float:
        n = calls["n"]
        calls["n"] += 1
        name = names[(n // 3 + n % 3) % 3]  # round n // 3 starts n // 3 names later (`interleaved`)
        return cost[name] * (1 + 0.001 * n)

    monkeypatch.setattr(loss_overhead, "timed", timed)
    applied: list[dict] = []
    monkeypatch.setattr(loss_overhead, "apply_method", lambda trainer, settings: applied.append(settings))
    rows = [{"method": "clip", "ratio": 1.01}, {"method": "sigmoid", "ratio": 1.49}, {"method": "none", "ratio": 1.0}]
    stock = [1.0, 1.1, 5.0]  # median 1.1, mean 2.37
    args = types.SimpleNamespace(e2e_repeats=30)
    result = loss_overhead.report(args, None, stock, rows, lambda: None, lambda: None)
    e2e = result["end_to_end"]
    assert result["stock_loss_s"] == {"median": 1.1, "min": 1.0, "max": 5.0, "n": 3}
    assert e2e["method"] == "sigmoid" and applied == [loss_overhead.METHODS["sigmoid"]]
    assert e2e["ratio"] == pytest.approx(1.5, abs=0.005) and 1.45 < e2e["ci"][0] <= e2e["ci"][1] < 1.55
    assert e2e["aa"] == pytest.approx(1.03, abs=0.005) and e2e["aa_ci"][0] < 1.03 < e2e["aa_ci"][1] < 1.1
    width = e2e["aa_ci"][1] - e2e["aa_ci"][0]
    for off, consistent in ((0.25, True), (0.75, False)):  # the decomposed ratio off by a share of that width
        rows[1]["ratio"] = e2e["ratio"] - off * width
        calls["n"] = 0
        again = loss_overhead.report(args, None, stock, rows, lambda: None, lambda: None)["end_to_end"]
        assert (again["ratio"], again["aa_ci"]) == (e2e["ratio"], e2e["aa_ci"])
        assert again["consistent"] is consistent, off


def overhead_result(ratios: dict[str, float], aa: list[float], added: float, stock: float = 0.05) -> dict[str, Any]:
    rows = [{"method": method, "added_s": added, "stock_s": stock, "ratio": ratio, "ci": [ratio - 0.01, ratio + 0.01],
             "ops_added": 10, "bytes_added": 100} for method, ratio in ratios.items()]
    return {"stock_loss_s": {"median": 0.05, "min": 0.04, "max": 0.06, "n": 3}, "rows": rows,
            "end_to_end": {"method": "clip", "ratio": 1.0, "ci": [0.9, 1.1], "aa": 1.0, "aa_ci": aa,
                           "consistent": True}, "precision": "fp32"}


def test_headline_is_the_largest_row_of_either_trainer_with_that_trainers_aa_interval() -> None:
    part = {"trl": overhead_result({"clip": 1.02, "sigmoid": 1.03}, [0.97, 1.03], 0.001),
            "unsloth": overhead_result({"clip": 1.05, "sigmoid": 1.01}, [0.95, 1.06], 0.002)}
    part["trl"]["rows"][1]["ci"] = [0.9, 1.2]  # a wider interval does not make a row the largest
    headline = loss_overhead.headline(part, 0.0)
    assert (headline["trainer"], headline["method"], headline["ratio"], headline["aa"]) == (
        "unsloth", "clip", 1.05, [0.95, 1.06])


def test_the_loss_benchmark_runs_the_documented_sizes_and_shares_each_sizes_own_rows(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: Any) -> None:
    """main() with the trainers' processes replaced: the default size is 8 x 64 tokens with 40 / 100 / 40 repeats and
    the larger 16 x 256 with 20 / 15 / 20, the counts the committed run records (docs/benchmarks.md says them from
    there); the shares and headlines pair each size's own rows."""
    runs: list[tuple[str, tuple[int, int], tuple[int, int, int]]] = []

    def run_trainer(trainer: str, args: Any, argv: list[str], size: tuple[int, int],
                    repeats: tuple[int, int, int]) -> dict[str, Any]:
        runs.append((trainer, size, repeats))
        large = size[1] == 256
        return overhead_result({"clip": 1.004 if large else 1.02, "sigmoid": 1.006 if large else 1.03},
                               [0.99, 1.01], 0.004 if large else 0.001, 0.5 if large else 0.05)

    monkeypatch.setattr(loss_overhead, "run_trainer", run_trainer)
    monkeypatch.setattr(loss_overhead, "core_op", lambda repeats: [])
    monkeypatch.setattr(loss_overhead, "core_op_profile", lambda: [])
    path = tmp_path / "loss.json"
    assert loss_overhead.main(["--json", str(path)]) == 0
    assert {(size, repeats) for _, size, repeats in runs} == {((8, 64), (40, 100, 40)), ((16, 256), (20, 15, 20))}
    committed = json.loads((BENCHMARKS / "loss_overhead.json").read_text())
    assert [tuple(part["repeats"].values()) for part in (committed, committed["large"])] == [(40, 100, 40), (20, 15, 20)]
    report = json.loads(path.read_text())
    assert report["size"]["tokens"] == 512 and report["large"]["size"]["tokens"] == 4096
    assert report["headline"]["ratio"] == 1.03 and report["large"]["headline"]["ratio"] == 1.006
    trl = [share for share in report["shares"] if share["trainer"] == "trl"]
    assert [(s["method"], round(s["overhead"], 6), round(s["overhead_large"], 6)) for s in trl] == [
        ("clip", 0.02, 0.004), ("sigmoid", 0.03, 0.006)]
    assert [(s["added_s"], s["added_s_large"], s["stock_s"], s["stock_s_large"]) for s in trl] == [
        (0.001, 0.004, 0.05, 0.5)] * 2
    last = capsys.readouterr().out.strip().splitlines()[-2:]
    assert last[0].startswith("max_loss_overhead_ratio=1.030 ci=[1.020,1.040] aa=[0.990,1.010]")
    assert last[1].startswith("max_loss_overhead_ratio_large=1.006 ci=[0.996,1.016]")


def test_a_budget_half_spent_on_the_default_size_skips_the_larger_and_the_json_is_written_after_each_trainer(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: Any) -> None:
    """main() with the trainers' processes replaced and a clock that advances 20 s for the core op and 60 s a trainer
    run: with --budget 200 the core op and the default size (both trainers) take 140 s, more than half, so the larger
    size is skipped and the JSON says why; before each run the JSON on disk holds every run before it, `finished` false
    until the end. With --budget 280 the same 140 s is half, not more: the larger size runs."""
    monkeypatch.setattr(loss_overhead.importlib.util, "find_spec", lambda name: object())  # "unsloth is installed"
    clock = {"now": 1000.0}
    monkeypatch.setattr(loss_overhead.time, "perf_counter", lambda: clock["now"])
    path = tmp_path / "loss.json"
    seen: list[tuple[str, list[str], bool]] = []

    def run_trainer(trainer: str, args: Any, argv: list[str], size: tuple[int, int],
                    repeats: tuple[int, int, int]) -> dict[str, Any]:
        written = json.loads(path.read_text()) if path.exists() else {}
        seen.append((trainer, [t for t in ("trl", "unsloth") if t in written], written.get("finished", False)))
        clock["now"] += 60
        return overhead_result({"clip": 1.02}, [0.99, 1.01], 0.001)

    monkeypatch.setattr(loss_overhead, "run_trainer", run_trainer)
    monkeypatch.setattr(loss_overhead, "core_op", lambda repeats: clock.update(now=clock["now"] + 20) or [])
    monkeypatch.setattr(loss_overhead, "core_op_profile", lambda: [])
    assert loss_overhead.main(["--budget", "200", "--json", str(path)]) == 0
    assert seen == [("trl", [], False), ("unsloth", ["trl"], False)]
    report = json.loads(path.read_text())
    assert report["finished"] is True and "large" not in report and "shares" not in report
    assert report["large_skipped"] == ("the core op and the default size took 140 s of the 200-second budget (more "
                                       "than half)")
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("max_loss_overhead_ratio=1.020 ")
    seen.clear()
    path.unlink()
    assert loss_overhead.main(["--budget", "280", "--json", str(path)]) == 0
    report = json.loads(path.read_text())
    assert [trainer for trainer, _, _ in seen] == ["trl", "unsloth"] * 2
    assert "large_skipped" not in report and report["large"]["headline"]["ratio"] == 1.02
    with pytest.raises(SystemExit):
        loss_overhead.parse_args(["--budget", "0"])
    assert "--budget=0.0 is invalid: allowed is a number of seconds > 0" in capsys.readouterr().err


def test_a_trainer_process_parses_its_sizes_repeats_and_the_parents_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    """run_trainer: the child process gets the parent's arguments, then the size and the (stock, core, e2e) repeats
    it is given (all different here), its trainer and a JSON path in its own folder, whose contents it returns."""
    commands: list[list[str]] = []

    def run(command: list[str], check: bool, env: dict[str, str], cwd: str) -> None:
        commands.append(command)
        assert check and env["OMP_NUM_THREADS"] and os.path.dirname(command[-1]) == cwd
        Path(command[-1]).write_text(json.dumps({"rows": [], "trainer": command[-3]}))

    monkeypatch.setattr(loss_overhead, "subprocess", types.SimpleNamespace(run=run))
    result = loss_overhead.run_trainer("unsloth", types.SimpleNamespace(), ["--hidden", "64", "--budget", "900"],
                                       (16, 256), (20, 100, 30))
    assert result == {"rows": [], "trainer": "unsloth"}
    (command,) = commands
    child = loss_overhead.parse_args(command[command.index(os.path.abspath(loss_overhead.__file__)) + 1:])
    assert (child.trainer, child.completions, child.completion_length) == ("unsloth", 16, 256)
    assert (child.stock_repeats, child.core_repeats, child.e2e_repeats) == (20, 100, 30)
    assert (child.hidden, child.budget, child.json) == (64, 900.0, command[-1])


def test_profile_counts_count_the_aten_ops_and_the_bytes_allocated_on_host_and_device(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """One call under a fake profiler: its aten ops (not the other events), and the bytes its `[memory]` events
    allocate on the host and the device, 512 + 256 (frees, negative, left out: not 0)."""
    def event(name: str, cpu: int = 0, device: int = 0) -> Any:
        return types.SimpleNamespace(name=name, cpu_memory_usage=cpu, device_memory_usage=device)

    events = [event("aten::add"), event("[memory]", cpu=512), event("aten::mul"), event("cudaLaunchKernel"),
              event("[memory]", cpu=-512), event("[memory]", device=256), event("[memory]", device=-256),
              event("Optimizer.step")]

    @contextlib.contextmanager
    def profile(activities: Any, profile_memory: bool) -> Iterator[Any]:
        assert profile_memory
        yield types.SimpleNamespace(events=lambda: events)

    monkeypatch.setattr(torch.profiler, "profile", profile)
    calls: list[int] = []
    assert loss_overhead.profile_counts(lambda: calls.append(1)) == (2, 768) and calls == [1]


def test_the_aa_copy_runs_half_a_rotation_from_stock_in_every_benchmark() -> None:
    """Right after stock, an A/A copy finds stock's caches in most rounds and measures a noise floor no method sees:
    every benchmark's rotation puts it half the other variants after stock."""
    assert loss_overhead.aa_half_way("s", "a", ["m1", "m2", "m3", "m4", "m5"]) == ["s", "m1", "m2", "m3", "a", "m4",
                                                                                    "m5"]
    assert loss_overhead.aa_half_way("s", "a", ["m"]) == ["s", "m", "a"]
    import overhead

    for order in (unsloth_cost.ROTATION, overhead.TIMED):
        others = len(order) - 2
        assert order[0] == "stock" and order.index("stock (A/A)") == 1 + (others + 1) // 2, order


def test_the_trl_stubs_leaves_are_on_the_captured_batchs_device() -> None:
    """On a GPU the captured batch (its completion mask) is on CUDA: the stub's leaves must be there too, or the
    stub's `per_token_loss * mask` fails with a device mismatch and the loss benchmark stops. A mask on the meta
    device stands in for CUDA here; the leaves are drawn from one seeded CPU generator (the same values anywhere)."""
    mask = torch.ones(2, 3)
    leaves = loss_overhead.stub_leaves(mask.to("meta"))
    assert [leaf.device.type for leaf in leaves] == ["meta"] * 3
    assert all(leaf.is_leaf and leaf.requires_grad and leaf.shape == (2, 3) for leaf in leaves)
    policy, kl, logps = leaves
    ((policy + logps * 0.0 + 0.04 * kl) * mask.to("meta")).sum().backward()  # the stub's expression runs there
    policy, kl, logps = loss_overhead.stub_leaves(mask)
    generator = torch.Generator().manual_seed(0)
    assert torch.equal(policy, torch.randn(2, 3, generator=generator))
    assert torch.equal(kl, torch.rand(2, 3, generator=generator) * 0.5)
    assert torch.equal(logps, -torch.rand(2, 3, generator=generator) * 3)


def test_the_step_benchmarks_stock_side_leaves_the_fallbacks_upstream_trls_kernel() -> None:
    """overhead.py's stock variants run stock TRL with the CPU log-prob fallback put in by hand; a patched variant
    after one made patch() take that fallback as its own upstream, so on an accelerator it would call itself. After
    stock -> patched -> stock -> patched the upstream is TRL's kernel, and stock TRL runs on the fallback."""
    import overhead

    from unsloth_adaptive_kl.integrations import trl as trl_patch
    from unsloth_adaptive_kl.integrations.trl_cpu_fallback import ChunkedLogProbWithCPUFallback

    kernel = ChunkedLogProbWithCPUFallback.upstream
    try:
        for stock in (True, False, True, False):
            overhead.set_stock(stock)
            if trl_patch.kernel_lacks_cpu_path():
                assert trl_patch.trl_utils._ChunkedLogProbFunction is ChunkedLogProbWithCPUFallback
            assert ChunkedLogProbWithCPUFallback.upstream is kernel is not ChunkedLogProbWithCPUFallback
    finally:
        overhead.set_stock(False)


def test_a_smoke_run_writes_to_the_temp_folder_unless_told_and_sizes_below_one_are_refused(capsys: Any) -> None:
    """`loss_overhead.py --smoke`, as the benchmarks page gives it, wrote its smoke figures over the committed
    benchmarks/loss_overhead.json; a repeat count of 0 failed in a worker process (no median of no data), the cost's
    0 rounds after the model was built."""
    import tempfile

    assert loss_overhead.parse_args(["--smoke"]).json == os.path.join(tempfile.gettempdir(), "loss_overhead_smoke.json")
    assert loss_overhead.parse_args([]).json == "benchmarks/loss_overhead.json"
    assert loss_overhead.parse_args(["--smoke", "--json", "x.json"]).json == "x.json"
    for parse, argv, message in ((loss_overhead.parse_args, ["--smoke", "--stock-repeats", "0"],
                                  "--stock-repeats=0 is invalid: allowed is an integer >= 1"),
                                 (loss_overhead.parse_args, ["--large-completion-length", "0"],
                                  "--large-completion-length=0 is invalid: allowed is an integer >= 1"),
                                 (unsloth_cost.parse_args, ["--size", "small", "--rounds", "0", "--json", "x"],
                                  "--rounds=0 is invalid: allowed is an integer >= 1"),
                                 (unsloth_cost.parse_args, ["--size", "small", "--budget", "-1", "--json", "x"],
                                  "--budget=-1.0 is invalid: allowed is a number of seconds > 0"),
                                 (unsloth_cost.parse_args, ["--size", "small", "--budget", "0", "--json", "x"],
                                  "--budget=0.0 is invalid: allowed is a number of seconds > 0")):
        with pytest.raises(SystemExit):
            parse(argv)
        assert message in capsys.readouterr().err, argv


# ----- overhead.py: median seconds, bytes, the ref_sync object, the rows and the A/A interval ----------------------

def test_median_seconds_is_the_median_of_the_timed_calls_after_3_untimed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Calls of 100 s, 100 s, 100 s (untimed), then 1, 2 and 9 s: the median, 2 (the mean would be 4)."""
    import overhead

    clock, durations = FakeClock(), [100.0, 100.0, 100.0, 1.0, 2.0, 9.0]
    monkeypatch.setattr(overhead, "time", types.SimpleNamespace(perf_counter=lambda: clock.now))
    assert overhead.median_seconds(lambda: clock.advance(durations.pop(0)), 3) == 2.0 and durations == []


def test_tensor_bytes_are_elements_times_their_size() -> None:
    import overhead

    tensors = [torch.zeros(3, dtype=torch.float16), torch.zeros(2, 2, dtype=torch.float64),
               torch.zeros(5, dtype=torch.int8)]
    assert overhead.tensor_bytes(tensors) == 3 * 2 + 4 * 8 + 5


def test_the_ref_sync_object_takes_medians_over_the_passes_against_stocks_median_step() -> None:
    """Three timed passes: each cost the median over the passes (sync 4 us, not the first pass's 2 or the mean 5;
    exchange 3 us; copy 20 us), each against stock's median step (1 s, mean 1.63; not the A/A copy's 2 s, nor
    ref_sync's own 1.3 s); per step, 6 syncs and 5 exchanges of a 6-step run: 4 + 5/6 * 3 = 6.5 us."""
    import overhead

    exact = {"copy_tensors": 4, "copy_bytes": 400, "adapter_bytes": 800, "exchange_temp_bytes": 100,
             "syncs_per_run": 6, "exchanges_per_run": 5}
    runs = [{"sync_s": sync, "exchange_s": exchange, "copy_s": copy, **exact}
            for sync, exchange, copy in ((2e-6, 5e-6, 1e-5), (4e-6, 1e-6, 3e-5), (9e-6, 3e-6, 2e-5))]
    times = {"stock": [1.0, 0.9, 3.0], "stock (A/A)": [2.0, 2.0, 2.0]}
    forwards = {"stock": [3, 3, 3], "stock (A/A)": [3, 3, 3], "none": [2, 2, 2]}
    sync = overhead.ref_sync_report(runs, [1.1, 1.3, 5.0], [3, 4, 3], times, forwards,
                                    types.SimpleNamespace(steps=6))
    assert {key: sync[key] for key in exact} == exact and sync["bytes_to_adapter_ratio"] == 0.5
    assert (sync["forwards_per_step"], sync["stock_forwards_per_step"], sync["extra_forwards"]) == ([3, 4], [3], 1)
    assert (sync["stock_step_seconds_median"], sync["step_seconds_median"], sync["step_ratio"]) == (1.0, 1.3, 1.3)
    assert (sync["sync_seconds_median"], sync["exchange_seconds_median"], sync["copy_seconds_median"]) == (
        4e-6, 3e-6, 2e-5)
    assert (sync["sync_to_step_ratio"], sync["exchange_to_step_ratio"]) == (4e-6, 3e-6)
    assert sync["added_seconds_per_step"] == pytest.approx(6.5e-6, rel=1e-12)
    assert sync["added_to_step_ratio"] == pytest.approx(6.5e-6, rel=1e-12)


def test_the_step_benchmarks_rows_and_aa_interval_leave_out_the_untimed_pass_and_the_aa_copy(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: Any) -> None:
    """overhead.main with its runs replaced: 2 timed passes after an untimed one (100 s steps, left out), each
    pass one later in the rotation; each ratio a median over stock's (1.1 s); the A/A pair's interval its median over
    stock's resampled: of 2 values a resampled median is the low one, their mean or the high one, so the interval's
    ends are 1.3 / 1.2 and 1.5 / 1.0 (each with probability 1/16, far above 2.5 %); the largest step ratio is the
    methods' (1.1), not the A/A pair's (1.27)."""
    import overhead

    seconds = {"stock": [1.0, 1.2], "stock (A/A)": [1.3, 1.5], "dynamic": [1.21, 1.21], "kl_in_reward": [1.1, 1.1]}
    calls: list[str] = []

    def run(variant: str, args: Any, output_dir: str) -> dict[str, Any]:
        passes = calls.count(variant)
        calls.append(variant)
        median = 100.0 if passes == 0 else seconds.get(variant, [1.1, 1.1])[passes - 1]
        result = {"median_step_s": median, "forwards_per_step": [4 if variant == "kl_in_reward" else 3],
                  "cuda_peak_bytes": None}
        if variant == overhead.REF_SYNC:
            result.update({"sync_s": 1e-6, "exchange_s": 1e-6, "copy_s": 1e-6, "copy_tensors": 1, "copy_bytes": 8,
                           "adapter_bytes": 8, "exchange_temp_bytes": 8, "syncs_per_run": 3, "exchanges_per_run": 2})
        return result

    monkeypatch.setattr(overhead, "run", run)
    monkeypatch.setattr(overhead, "set_stock", lambda stock: None)
    monkeypatch.setattr(overhead, "peak_rss", lambda variant, argv: 200 if variant in overhead.STOCK else 220)
    monkeypatch.setattr(overhead, "core_op", lambda repeats: [{"method": "clip", "x_k3": 1.5}])
    monkeypatch.setattr(overhead, "unsloth_timing", lambda smoke: None)
    monkeypatch.setattr(overhead, "hardware", lambda: {})
    monkeypatch.setattr(overhead, "source_commit", lambda: "x")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    path = tmp_path / "overhead.json"
    assert overhead.main(["--repeats", "2", "--steps", "3", "--json", str(path)]) == 0
    timed = overhead.TIMED
    assert calls == timed + timed[1:] + timed[:1] + timed[2:] + timed[:2]
    report = json.loads(path.read_text())
    rows = {row["variant"]: row for row in report["rows"]}
    assert rows["stock"]["median_step_s"] == 1.1 and rows["clip"]["step_ratio"] == 1.0
    assert rows["dynamic"]["step_ratio"] == pytest.approx(1.1) and rows["stock (A/A)"]["step_ratio"] == 1.4 / 1.1
    assert rows["kl_in_reward"]["extra_forwards"] == 2 and rows["clip"]["memory_ratio"] == 1.1
    assert report["aa_interval"] == [1.3 / 1.2, 1.5 / 1.0]
    assert report["ref_sync"]["step_ratio"] == 1.0 and report["ref_sync"]["stock_step_seconds_median"] == 1.1
    assert "max_step_ratio=1.100 aa=[1.083,1.500] " in capsys.readouterr().out.strip().splitlines()[-1]
