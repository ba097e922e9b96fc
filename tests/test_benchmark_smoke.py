"""The overhead benchmark runs end to end at tiny sizes and reports (no timing is asserted here)."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parents[1] / "benchmarks" / "overhead.py"


def smoke_adapter_bytes() -> int:
    """Bytes of the trainable parameters of the smoke run's model (hidden 32, 1 layer, LoRA), built here."""
    from unsloth_adaptive_kl.tools.tiny import add_lora, build_tiny_model, build_tokenizer

    model = add_lora(build_tiny_model(build_tokenizer(), hidden_size=32, num_layers=1))
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def test_overhead_benchmark_smoke(tmp_path) -> None:
    report_path = tmp_path / "overhead.json"
    result = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--json", str(report_path)],
                            capture_output=True, text=True, timeout=850)
    assert result.returncode == 0, result.stderr[-3000:]
    # torch.profiler's "USDT: ... profiler_start/stop" lines (28 in a smoke run) were mixed into the table
    assert "USDT:" not in result.stdout + result.stderr
    last_line = result.stdout.strip().splitlines()[-1]
    report = json.loads(report_path.read_text())
    assert [row["variant"] for row in report["rows"]][0] == "stock"
    assert len(report["rows"]) == 9
    measured = report["rows"][2:] + [row for row in report["unsloth_rows"] if row["variant"] != "unsloth:stock"]
    assert last_line.startswith("extra_forwards=0 max_memory_ratio=")
    assert f"max_step_ratio={max(row['step_ratio'] for row in measured):.3f} aa=[" in last_line
    loss_rows, (in_reward,) = report["rows"][:-1], report["rows"][-1:]
    assert all(row["extra_forwards"] == 0 for row in loss_rows)  # the KL in the loss: same forwards as stock
    # the KL in the reward: one policy forward per generation batch (one per step here)
    stock_forwards = report["rows"][0]["forwards_per_step"]
    assert len(stock_forwards) == 1 and in_reward["variant"] == "kl_in_reward"
    assert in_reward["forwards_per_step"] == [stock_forwards[0] + 1] and in_reward["extra_forwards"] > 0
    assert all(row["peak_memory_bytes"] > 0 for row in report["rows"])
    # reference syncing on (a hard reset after every step): the stock forwards, a copy the size of the adapter
    sync = report["ref_sync"]
    assert sync["extra_forwards"] == 0 and sync["forwards_per_step"] == stock_forwards
    assert sync["syncs_per_run"] == 3 and sync["exchanges_per_run"] == 2  # every step syncs; steps 2-3 exchange
    assert sync["copy_bytes"] == sync["adapter_bytes"] == smoke_adapter_bytes()
    assert 0 < sync["exchange_temp_bytes"] < sync["copy_bytes"]
    for key in ("sync_seconds_median", "exchange_seconds_median", "copy_seconds_median", "step_seconds_median",
                "sync_to_step_ratio", "exchange_to_step_ratio", "added_to_step_ratio", "step_ratio"):
        assert math.isfinite(sync[key]) and sync[key] > 0, key
    assert sync["sync_to_step_ratio"] == sync["sync_seconds_median"] / sync["stock_step_seconds_median"]
    assert last_line.endswith(f" ref_sync_extra_forwards=0 ref_sync_bytes={sync['copy_bytes']} "
                              f"sync_step_ratio={sync['sync_to_step_ratio']:.2e}")
    if importlib.util.find_spec("unsloth") is not None:
        unsloth = {row["variant"]: row for row in report["unsloth_rows"]}
        assert set(unsloth) == {f"unsloth:{v}" for v in ("stock", "none", "clip", "length_normalized", "dynamic")}
        assert all(row["forwards_per_step"] == unsloth["unsloth:stock"]["forwards_per_step"] for row in unsloth.values())
        assert all(row["graphs_added_per_run"] == 0 for row in unsloth.values())  # dynamic: beta moves every step


LOSS_SCRIPT = Path(__file__).parents[1] / "benchmarks" / "loss_overhead.py"


def test_loss_overhead_benchmark_smoke(tmp_path) -> None:
    """The decomposition runs for every method on both trainers and reports its headline from its own rows; each
    call of a method with `dynamic` follows a passing mean reward, so none says beta holds."""
    report_path = tmp_path / "loss_overhead.json"
    result = subprocess.run([sys.executable, str(LOSS_SCRIPT), "--smoke", "--json", str(report_path)],
                            capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "beta holds" not in result.stdout + result.stderr and "USDT:" not in result.stdout + result.stderr
    headline_line, large_line = result.stdout.strip().splitlines()[-2:]
    report = json.loads(report_path.read_text())
    trainers = ["trl"] + (["unsloth"] if importlib.util.find_spec("unsloth") is not None else [])
    rows = [row for trainer in trainers for row in report[trainer]["rows"]]
    assert len(rows) == 13 * len(trainers) and report["finished"] is True
    # a CPU run trains both in fp32 (Unsloth latches its autocast off there), at both sizes, and says so
    assert [part[trainer]["precision"] for part in (report, report["large"]) for trainer in trainers] == (
        ["fp32"] * 2 * len(trainers))
    worst = max(rows, key=lambda row: row["ratio"])
    assert headline_line.startswith(f"max_loss_overhead_ratio={worst['ratio']:.3f} ci=[{worst['ci'][0]:.3f},")
    assert f"ops_added={worst['ops_added']}" in headline_line
    # the second, larger size (at least 4x the tokens): its own rows, headline line and per-method shares
    large = report["large"]
    assert large["size"]["tokens"] >= 4 * report["size"]["tokens"]
    large_rows = [row for trainer in trainers for row in large[trainer]["rows"]]
    assert [row["method"] for row in large_rows] == [row["method"] for row in rows]
    large_worst = max(large_rows, key=lambda row: row["ratio"])
    assert large_line.startswith(f"max_loss_overhead_ratio_large={large_worst['ratio']:.3f} "
                                 f"ci=[{large_worst['ci'][0]:.3f},{large_worst['ci'][1]:.3f}] aa=[")
    assert large_line.endswith(f" ops_added={large_worst['ops_added']}")
    assert report["large"]["headline"]["ratio"] == large_worst["ratio"]
    shares = report["shares"]
    assert len(shares) == len(rows) and all(
        share["overhead_large"] == big["ratio"] - 1 and share["overhead"] == row["ratio"] - 1
        for share, row, big in zip(shares, rows, large_rows))
    # the same loss path at both sizes: the ops it adds do not depend on the number of tokens
    assert all(share["ops_added"] == share["ops_added_large"] for share in shares)
    # each row's ratio has its own stock loss, timed in the same rounds as its added time
    assert all(row["stock_s"] > 0 and abs(row["ratio"] - (1 + row["added_s"] / row["stock_s"])) < 1e-12 for row in rows)
    # the adaptation adds work, and the profiler counts it: every method adds aten ops over the stock KL line
    assert all(row["ops_added"] > 0 for row in rows)
    core = {row["method"]: row for row in report["core_op"]}
    assert core["stock k3"]["ops"] == 0 and all(core[m]["ops"] > 0 for m in core if m != "stock k3")


def test_unsloth_cost_benchmark_smoke(tmp_path) -> None:
    """benchmarks/unsloth_cost.py at its small size on this CPU (Unsloth's generated trainer on a float32 Qwen2 of
    hidden 64), one round each: every method and the A/A pair against stock on the captured batch, the whole step of
    stock, one method and the KL in the reward (whose penalty is logged there only), and the summary line."""
    if importlib.util.find_spec("unsloth") is None:
        import pytest

        if os.environ.get("ADAPTIVE_KL_REQUIRE_UNSLOTH"):
            pytest.fail("unsloth is not installed, and ADAPTIVE_KL_REQUIRE_UNSLOTH is set")
        pytest.skip("unsloth not installed (CI row a installs it)")
    script = Path(__file__).parents[1] / "benchmarks" / "unsloth_cost.py"
    report_path = tmp_path / "cost.json"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1]), "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, str(script), "--size", "small", "--rounds", "1", "--warmup", "0",
                             "--whole-rounds", "1", "--json", str(report_path)], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    # each step of `dynamic` follows a passing mean reward: its timed path decays beta, and none says it holds
    assert "beta holds" not in result.stdout + result.stderr
    report = json.loads(report_path.read_text())
    assert list(report["step"]) == ["stock", "stock (A/A)", "none", "clip", "sigmoid", "length_normalized", "dynamic",
                                    "target", "clip+length_normalized+dynamic", "sigmoid+length_normalized"]
    assert report["step"]["stock"]["ratio"] == 1.0 and all(row["n"] == 1 for row in report["step"].values())
    assert report["device"]["kind"] == "cpu" and report["max_memory_ratio"] is None  # peak memory: CUDA only
    whole = report["whole_step"]
    assert list(whole) == ["stock", "sigmoid+length_normalized", "kl_in_reward"]
    assert whole["stock"]["reward_penalty"] is None and whole["sigmoid+length_normalized"]["reward_penalty"] is None
    # beta times k1's batch mean, which is of either sign: logged, finite and non-zero (the policy has left the
    # reference in the steps before)
    penalty = whole["kl_in_reward"]["reward_penalty"]
    assert penalty is not None and math.isfinite(penalty) and penalty != 0
    methods = [row["ratio"] for name, row in report["step"].items() if not name.startswith("stock")]
    # the profile of stock's step and of the method with the largest ratio
    profile = report["profile"]
    assert report["step"][profile["method"]]["ratio"] == max(methods)
    assert len(profile["stock"]) == len(profile["heaviest"]) == 12 and profile["stock"][0]["self_us"] > 0
    assert math.isclose(report["loss_share"], report["step"]["stock"]["median_s"] / whole["stock"]["median_s"])
    assert result.stdout.strip().splitlines()[-1] == (
        f"max_step_ratio={max(methods):.3f} max_memory_ratio=n/a aa=[{report['aa_ci'][0]:.3f},"
        f"{report['aa_ci'][1]:.3f}] loss_share={report['loss_share']:.3f}")
