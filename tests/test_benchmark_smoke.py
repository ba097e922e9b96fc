"""The overhead benchmark runs end to end at tiny sizes and reports (no timing is asserted here)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parents[1] / "benchmarks" / "overhead.py"


def test_overhead_benchmark_smoke(tmp_path) -> None:
    report_path = tmp_path / "overhead.json"
    result = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--json", str(report_path)],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    last_line = result.stdout.strip().splitlines()[-1]
    assert last_line.startswith("max_step_overhead_ratio=")
    report = json.loads(report_path.read_text())
    assert [row["variant"] for row in report["rows"]][0] == "stock"
    assert len(report["rows"]) == 8
    measured = report["rows"][2:] + [row for row in report["unsloth_rows"] if row["variant"] != "unsloth:stock"]
    assert float(last_line.split("=")[1]) == round(max(row["step_ratio"] for row in measured), 3)
    assert all(row["extra_forwards"] == 0 for row in report["rows"])  # same forwards as stock, none extra
    assert all(row["peak_memory_bytes"] > 0 for row in report["rows"])
    if importlib.util.find_spec("unsloth") is not None:
        unsloth = {row["variant"]: row for row in report["unsloth_rows"]}
        assert set(unsloth) == {f"unsloth:{v}" for v in ("stock", "none", "clip", "length_normalized", "dynamic")}
        assert all(row["forwards_per_step"] == unsloth["unsloth:stock"]["forwards_per_step"] for row in unsloth.values())
        assert all(row["graphs_added_per_run"] == 0 for row in unsloth.values())  # dynamic: beta moves every step
