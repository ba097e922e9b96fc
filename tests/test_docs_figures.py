"""Every figure the docs hook (docs/hooks/generated.py) renders says what its results file holds: each table is read
back cell by cell against the JSON it is rendered from (the committed files, and made-up ones for the shapes the
committed files do not show: a CUDA run, a failed check, a ratio on an interval's end). A number is checked to be the
JSON's value rounded to the decimals the page shows; a row dropped, a column or label swapped, a wrong key, size or
interval end fails."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import re
import typing
from pathlib import Path
from typing import Any, Optional

import pytest

ROOT = Path(__file__).resolve().parents[1]
Table = tuple[list[str], list[list[str]]]


@pytest.fixture()
def hook() -> Any:
    """docs/hooks/generated.py, loaded from its file (a fresh module each test: some tests point its ROOT elsewhere)."""
    spec = importlib.util.spec_from_file_location("docs_generated_figures", ROOT / "docs" / "hooks" / "generated.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load(path: str) -> Any:
    return json.loads((ROOT / path).read_text())


def tables(markdown: str) -> list[Table]:
    """The Markdown tables of a text, in order: (header, rows), each cell unescaped ('\\|' is '|')."""
    found, block = [], []
    for line in [*markdown.split("\n"), ""]:
        if line.startswith("|"):
            block.append(line)
            continue
        if block:
            cells = [[cell.replace("\\|", "|") for cell in row[2:-2].split(" | ")] for row in block[:1] + block[2:]]
            assert re.fullmatch(r"\|(---\|)+", block[1]) and block[1].count("---") == len(cells[0]), block[:2]
            assert all(len(row) == len(cells[0]) for row in cells), block
            found.append((cells[0], cells[1:]))
            block = []
    return found


def only_table(markdown: str) -> Table:
    (table,) = tables(markdown)
    return table


def fixed(cell: str, value: float, decimals: int) -> None:
    """`cell` is `value` written with exactly `decimals` decimals (',' between thousands allowed), correctly rounded."""
    pattern = r"-?(\d{1,3}(,\d{3})+|\d+)" + (rf"\.\d{{{decimals}}}" if decimals else "")
    assert re.fullmatch(pattern, cell), (cell, decimals)
    assert abs(float(cell.replace(",", "")) - value) <= 0.5 * 10 ** -decimals * (1 + 1e-9) + 1e-12, (cell, value)


def scientific(cell: str, value: float) -> None:
    """`cell` is `value` with two decimals in scientific notation ('6.14e-04')."""
    assert re.fullmatch(r"\d\.\d\de[-+]\d\d", cell), cell
    assert abs(float(cell) - value) <= 0.5e-2 * 10 ** int(cell.split("e")[1]) * (1 + 1e-9), (cell, value)


def interval(text: str, ends: list[float], decimals: int) -> None:
    """`text` is '[low, high]', the two ends of `ends` in order."""
    low, high = re.fullmatch(r"\[([^,]+), ([^\]]+)\]", text).groups()
    fixed(low, ends[0], decimals)
    fixed(high, ends[1], decimals)


def made_at(data: dict) -> str:
    """How a page names the commit a results file ran at: its first 7 hex digits, "with uncommitted changes" where
    `source_commit` marked it "+changes"; a file without one (written before results recorded it) says so."""
    commit = data.get("commit")
    if not commit:
        return "at a commit it did not record"
    return f"at commit `{commit[:7]}`" + (" with uncommitted changes" if commit.endswith("+changes") else "")


def test_a_results_files_commit_is_named_as_it_was_recorded(hook: Any) -> None:
    """Written by hand: a clean checkout's sha, one with changes, none."""
    sha = "0123456789abcdef0123456789abcdef01234567"
    assert hook._commit({"commit": sha}) == "at commit `0123456`"
    assert hook._commit({"commit": sha + "+changes"}) == "at commit `0123456` with uncommitted changes"
    assert hook._commit({"commit": None}) == hook._commit({}) == "at a commit it did not record"


def ratio_with_interval(text: str, ratio: float, ends: list[float], decimals: int) -> None:
    """`text` is 'ratio [low, high]'."""
    value, rest = text.split(" ", 1)
    fixed(value, ratio, decimals)
    interval(rest, ends, decimals)


def minutes(cell: str, seconds: float) -> None:
    """`cell` is 'M min S s', whole minutes and the whole seconds left."""
    whole_minutes, rest = divmod(int(seconds), 60)
    assert cell == f"{whole_minutes} min {rest} s", (cell, seconds)


def size_label(size: dict) -> str:
    return f"{size['completions']} completions × {size['completion_length']} tokens"


LOSS_SIZES = [None, "large"]
TRAINER_LABELS = {"trl": "TRL", "unsloth": "Unsloth"}


def loss_part(size: Optional[str]) -> dict:
    data = load("benchmarks/loss_overhead.json")
    return data["large"] if size == "large" else data


# ----- benchmarks/loss_overhead.json --------------------------------------------------------------------------------

@pytest.mark.parametrize("size", LOSS_SIZES)
def test_loss_overhead_table_is_every_row_of_each_trainer(hook: Any, size: Optional[str]) -> None:
    """One row a method, four columns a trainer (TRL first): added and stock ms, the ratio with its interval to 4
    decimals, the aten ops added; a method one trainer lacks has blank cells there."""
    part = loss_part(size)
    trainers = [trainer for trainer in ("trl", "unsloth") if part.get(trainer)]
    header, rows = only_table(hook.loss_overhead(size))
    assert header == ["method"] + [f"{TRAINER_LABELS[t]}: {column}" for t in trainers
                                   for column in ("added ms", "stock ms", "overhead [95 %]", "ops added")]
    methods = list(dict.fromkeys(row["method"] for t in trainers for row in part[t]["rows"]))
    assert [row[0] for row in rows] == [f"`{method}`" for method in methods]
    for method, row in zip(methods, rows):
        for index, trainer in enumerate(trainers):
            cells = row[1 + 4 * index:5 + 4 * index]
            measured = next((r for r in part[trainer]["rows"] if r["method"] == method), None)
            if measured is None:
                assert cells == ["", "", "", ""]
                continue
            fixed(cells[0], measured["added_s"] * 1e3, 3)
            fixed(cells[1], measured["stock_s"] * 1e3, 1)
            ratio_with_interval(cells[2], measured["ratio"], measured["ci"], 4)
            assert cells[3] == str(measured["ops_added"])


def test_an_unknown_loss_overhead_size_fails_the_build(hook: Any) -> None:
    for generate in (hook.loss_overhead, hook.benchmark_headline, hook.loss_overhead_sanity, hook.loss_overhead_max,
                     hook.loss_overhead_end_to_end):
        with pytest.raises(ValueError):
            generate("huge")


@pytest.mark.parametrize("size", [*LOSS_SIZES, "default"])
def test_benchmark_headline_is_its_sizes_headline(hook: Any, size: Optional[str]) -> None:
    """The headline line of one size (the `_large` name for the larger only: `default` names the default size), its
    trainer, method and size, and the whole run's seconds (the larger size's headline, written last)."""
    part, data = loss_part(size), load("benchmarks/loss_overhead.json")
    found = re.fullmatch(r"`max_loss_overhead_ratio(?P<suffix>\S*?)=(?P<ratio>\S+) ci=\[(?P<c0>[^,]+),(?P<c1>[^\]]+)\] "
                         r"aa=\[(?P<a0>[^,]+),(?P<a1>[^\]]+)\] ops_added=(?P<ops>\d+)` \((?P<trainer>\w+), "
                         r"`(?P<method>[^`]+)`, (?P<size>[^;]+); (?P<total>\d+) s for the whole run, (?P<commit>.+)\)",
                         hook.benchmark_headline(size))
    headline = part["headline"]
    assert found["suffix"] == ("_large" if size == "large" else "")
    fixed(found["ratio"], headline["ratio"], 3)
    for key, ends in (("c", headline["ci"]), ("a", headline["aa"])):
        fixed(found[key + "0"], ends[0], 3)
        fixed(found[key + "1"], ends[1], 3)
    assert int(found["ops"]) == headline["ops_added"]
    assert (found["trainer"], found["method"], found["size"]) == (headline["trainer"], headline["method"],
                                                                   size_label(part["size"]))
    fixed(found["total"], data["large"]["headline"]["seconds"], 0)
    assert found["commit"] == made_at(data) and data["commit"]  # the benchmark records it


@pytest.mark.parametrize("size", LOSS_SIZES)
@pytest.mark.parametrize("trainer", ["trl", "unsloth"])
def test_loss_overhead_summary_is_the_range_of_that_trainers_rows(hook: Any, trainer: str, size: Optional[str]) -> None:
    """The sentence on one trainer at one size: the ratios' range, how many rows are within 1.01 of how many, and
    the ranges of added ms, aten ops and stock ms."""
    part = loss_part(size)
    if not part.get(trainer):
        pytest.skip(f"no {trainer} rows in the committed benchmark")
    rows = part[trainer]["rows"]
    found = re.fullmatch(r"(\S+) to (\S+) \((\d+) of (\d+) rows within 1\.01\), adding (\S+)-(\S+) ms and (\d+)-(\d+) "
                         r"aten ops to a (\d+)-(\d+) ms loss",
                         hook.loss_overhead_summary(trainer + (":large" if size else "")))
    ratios = sorted(row["ratio"] for row in rows)
    fixed(found[1], ratios[0], 4)
    fixed(found[2], ratios[-1], 4)
    assert (int(found[3]), int(found[4])) == (len([r for r in ratios if r <= 1.01]), len(rows))
    added = sorted(row["added_s"] * 1e3 for row in rows)
    fixed(found[5], added[0], 2)
    fixed(found[6], added[-1], 2)
    ops = sorted(row["ops_added"] for row in rows)
    assert (int(found[7]), int(found[8])) == (ops[0], ops[-1])
    stock = sorted(row["stock_s"] * 1e3 for row in rows)
    fixed(found[9], stock[0], 0)
    fixed(found[10], stock[-1], 0)


@pytest.mark.parametrize("size", LOSS_SIZES)
def test_loss_overhead_max_and_seconds(hook: Any, size: Optional[str]) -> None:
    """The largest overhead at one size in per cent to one decimal; the whole run's seconds (the larger size's
    headline)."""
    percent, unit = hook.loss_overhead_max(size).split(" ")
    assert unit == "%"
    fixed(percent, (loss_part(size)["headline"]["ratio"] - 1) * 100, 1)
    seconds, unit = hook.loss_overhead_seconds().split(" ")
    assert unit == "s"
    fixed(seconds, load("benchmarks/loss_overhead.json")["large"]["headline"]["seconds"], 0)


MADE_UP_SHARES = {"size": {"completions": 8, "completion_length": 64}, "large": {"size": {"completions": 16,
                                                                                        "completion_length": 256}},
                  "shares": [{"trainer": "unsloth", "method": "clip", "added_s": 0.00031, "added_s_large": 0.00052,
                              "stock_s": 0.031, "stock_s_large": 0.29, "overhead": 0.01, "overhead_large": 0.0018,
                              "ops_added": 80, "ops_added_large": 96}]}


@pytest.mark.parametrize("source", ["committed", "made up"])
def test_loss_overhead_shares_are_each_rows_figures_at_both_sizes(hook: Any, source: str,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Per trainer and method, small → large: added ms, stock ms, overhead in per cent, ops; the header names the two
    sizes in that order (made up: ops that change with the size)."""
    data = load("benchmarks/loss_overhead.json") if source == "committed" else MADE_UP_SHARES
    monkeypatch.setattr(hook, "_benchmark", lambda name: data)
    header, rows = only_table(hook.loss_overhead_shares())
    sizes = f"{size_label(data['size'])} → {size_label(data['large']['size'])}"
    assert header == ["trainer", "method", f"added ms ({sizes})", "stock loss ms", "overhead %", "ops added"]
    assert len(rows) == len(data["shares"])
    for share, row in zip(data["shares"], rows):
        assert row[:2] == [TRAINER_LABELS[share["trainer"]], f"`{share['method']}`"]
        for cell, key, scale, decimals in ((row[2], "added_s", 1e3, 3), (row[3], "stock_s", 1e3, 1),
                                           (row[4], "overhead", 100, 2)):
            small, large = cell.split(" → ")
            fixed(small, share[key] * scale, decimals)
            fixed(large, share[key + "_large"] * scale, decimals)
        assert row[5] == f"{share['ops_added']} → {share['ops_added_large']}"


@pytest.mark.parametrize("size", [*LOSS_SIZES, "inconsistent"])
def test_loss_overhead_sanity_is_each_trainers_stock_timing_and_end_to_end_row(hook: Any, size: Optional[str],
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Each trainer's stock timing and end-to-end row (made up: TRL's end to end not consistent with the
    decomposition, Unsloth's consistent)."""
    part = loss_part(size)
    if size == "inconsistent":
        part["trl"]["end_to_end"]["consistent"] = False
        part["unsloth"]["end_to_end"]["consistent"] = True
        monkeypatch.setattr(hook, "_benchmark", lambda name: part)
        size = None
    header, rows = only_table(hook.loss_overhead_sanity(size))
    assert header[0] == "trainer" and len(header) == 6
    labels = {"trl": "TRL", "unsloth": "Unsloth's generated trainer"}
    trainers = [trainer for trainer in ("trl", "unsloth") if part.get(trainer)]
    assert [row[0] for row in rows] == [labels[t] for t in trainers]
    for trainer, row in zip(trainers, rows):
        stock, e2e = part[trainer]["stock_loss_s"], part[trainer]["end_to_end"]
        median, low, high, n = re.fullmatch(r"(\S+) \(min (\S+), max (\S+), n=(\d+)\)", row[1]).groups()
        for cell, value in ((median, stock["median"]), (low, stock["min"]), (high, stock["max"])):
            fixed(cell, value * 1e3, 1)
        assert int(n) == stock["n"] and row[2] == f"`{e2e['method']}`"
        ratio_with_interval(row[3], e2e["ratio"], e2e["ci"], 3)
        ratio_with_interval(row[4], e2e["aa"], e2e["aa_ci"], 3)
        assert row[5] == {True: "yes", False: "no"}[e2e["consistent"]]


@pytest.mark.parametrize("size", [*LOSS_SIZES, "made up"])
def test_loss_overhead_end_to_end_reads_each_sanity_row_against_its_decomposed_ratio(
        hook: Any, size: Optional[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Per trainer, the heaviest method's end-to-end ratio with its interval, and where it lies: within the A/A
    half-width of the decomposed ratio of the same method, above it, or below it (made up: TRL's above, Unsloth's
    below)."""
    made_up = size == "made up"
    part = loss_part(None if made_up else size)
    if made_up:
        for trainer, (ratio, consistent) in {"trl": (1.5, False), "unsloth": (0.5, False)}.items():
            part[trainer]["end_to_end"].update(ratio=ratio, consistent=consistent)
        monkeypatch.setattr(hook, "_benchmark", lambda name: part)
        size = None
    said = hook.loss_overhead_end_to_end(size).split("; ")
    trainers = [trainer for trainer in ("trl", "unsloth") if part.get(trainer)]
    assert len(said) == len(trainers)
    for trainer, sentence in zip(trainers, said):
        e2e = part[trainer]["end_to_end"]
        decomposed = {row["method"]: row["ratio"] for row in part[trainer]["rows"]}[e2e["method"]]
        half_width = (e2e["aa_ci"][1] - e2e["aa_ci"][0]) / 2
        if abs(e2e["ratio"] - decomposed) <= half_width:
            where = "within the A/A half-width of"
        else:
            where = "above" if e2e["ratio"] > decomposed else "below"
        found = re.fullmatch(rf"{TRAINER_LABELS[trainer]}'s `([^`]+)` measured (\S+ \[\S+, \S+\]) end to end, "
                             rf"{where} its decomposed (\S+)", sentence)
        assert found and found[1] == e2e["method"], sentence
        ratio_with_interval(found[2], e2e["ratio"], e2e["ci"], 3)
        fixed(found[3], decomposed, 3)
    if made_up:
        assert "above" in said[0] and "below" in said[1]


def test_core_op_table_is_every_method_against_stock_k3(hook: Any) -> None:
    rows = load("benchmarks/loss_overhead.json")["core_op"]
    (stock,) = [row for row in rows if row["method"] == "stock k3"]
    table, sentence = hook.core_op().split("\n\nStock k3 expression alone: ")
    header, cells = only_table(table)
    others = [row for row in rows if row is not stock]
    assert [c[0] for c in cells] == [f"`{row['method']}`" for row in others]
    for row, cell in zip(others, cells):
        fixed(cell[1], row["median_ms"], 3)
        fixed(cell[2], row["x_k3"], 2)
        assert cell[3] == str(row["ops"])
    fixed(sentence.removesuffix(" ms."), stock["median_ms"], 3)


def profile_shown(text: str) -> list[tuple[str, int]]:
    return [(op, int(percent)) for op, percent in re.findall(r"`([^`]+)` (\d+) %", text)]


def test_core_op_profile_lists_the_ops_that_round_to_one_per_cent(hook: Any, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Every op whose share is written as 1 % or more, in the file's order, as a whole per cent; none written "0 %"
    (made up: 0.5 % exactly, which rounds to even, 0)."""
    for profile in (load("benchmarks/loss_overhead.json")["core_op_profile"],
                    [{"op": "aten::where", "share": 0.9}, {"op": "aten::exp", "share": 0.0071},
                     {"op": "aten::sub", "share": 0.0051}, {"op": "aten::mul", "share": 0.005},
                     {"op": "aten::sum", "share": 0.0049}]):
        monkeypatch.setattr(hook, "_benchmark", lambda name, profile=profile: {"core_op_profile": profile})
        text = hook.core_op_profile()
        assert " 0 %" not in text
        shown = [op for op in profile if op["share"] * 100 > 0.5]
        assert [op for op, _ in profile_shown(text)] == [op["op"] for op in shown]
        assert len(text.split(", ")) == len(shown)
        for (_, percent), op in zip(profile_shown(text), shown):
            fixed(str(percent), op["share"] * 100, 0)


# ----- benchmarks/overhead_cpu.json ---------------------------------------------------------------------------------

def made_up_steps() -> dict:
    row = {"variant": "stock", "median_step_s": 0.41234, "step_ratio": 1.0, "forwards_per_step": [40, 34],
           "extra_forwards": 0, "peak_memory_bytes": 3 * 2 ** 27, "memory_ratio": 1.0, "core_ratio": None}
    return {"device": "cpu", "aa_interval": [0.91, 1.12], "command": "python benchmarks/overhead.py --steps 5",
            "commit": "0123456789abcdef0123456789abcdef01234567+changes",
            "settings": {"hidden": 64, "layers": 3, "batch": 8, "completion_length": 16, "steps": 5, "repeats": 7},
            "rows": [row, {**row, "variant": "clip", "median_step_s": 0.43, "step_ratio": 1.043,
                           "forwards_per_step": [18, 10, 18], "extra_forwards": 2, "peak_memory_bytes": 400 * 2 ** 20,
                           "memory_ratio": 1.0417, "core_ratio": 4.56}]}


@pytest.mark.parametrize("source", ["committed", "made up", "one timed pass"])
def test_steps_table_and_its_settings(hook: Any, source: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The step benchmark's rows (forwards per step in the order the steps ran; core op ratio blank where none), its
    A/A interval and settings (made up: several forwards a row, not in ascending order, settings that differ; one
    timed pass, as `--smoke` writes it: NaN ends, no interval)."""
    data = load("benchmarks/overhead_cpu.json") if source == "committed" else made_up_steps()
    if source == "one timed pass":
        data["aa_interval"] = [math.nan, math.nan]
    monkeypatch.setattr(hook, "_benchmark", lambda name: data)
    table, sentence = hook.steps().split("\n\n")
    header, rows = only_table(table)
    assert header == ["variant", "s/step", "x stock", "forwards/step", "extra forwards", "run's peak RSS MiB",
                      "x stock", "core op x k3"]
    assert [row[0] for row in rows] == [r["variant"] for r in data["rows"]]
    for r, row in zip(data["rows"], rows):
        fixed(row[1], r["median_step_s"], 4)
        fixed(row[2], r["step_ratio"], 3)
        assert row[3].split(" or ") == [str(n) for n in r["forwards_per_step"]] and row[4] == str(r["extra_forwards"])
        fixed(row[5], r["peak_memory_bytes"] / 1024 / 1024, 1)
        fixed(row[6], r["memory_ratio"], 3)
        if r["core_ratio"] is None:
            assert row[7] == ""
        else:
            fixed(row[7], r["core_ratio"], 2)
    found = re.fullmatch(r"A/A interval of the step ratio \(stock against stock\): (\[[^\]]+\]|none \(one timed pass\))\. Settings: "
                         r"hidden (\d+), (\d+) layers, batch (\d+), (\d+)-token completions, (\d+) steps x (\d+) "
                         r"timed passes, device `(\w+)`, `(.+)` (at .+?)\. (The core op is blank .*)", sentence)
    # a blank core-op cell said nothing of why: stock is the reference; the committed file's two combinations are not
    # among the core op's methods (the made-up stock's blank is the reference's alone)
    blank = {"committed": " and for `dynamic+length_normalized` and `kl_in_reward`, which are not among the core "
                          "op's methods"}.get(source, "")
    assert found[11] == f"The core op is blank for stock (its k3 is what the ratio is against){blank}."
    if source == "one timed pass":
        assert found[1] == "none (one timed pass)"
    else:
        interval(found[1], data["aa_interval"], 3)
    s = data["settings"]
    assert [int(n) for n in found.groups()[1:7]] == [s["hidden"], s["layers"], s["batch"], s["completion_length"],
                                                     s["steps"], s["repeats"]]
    assert (found[8], found[9], found[10]) == (data["device"], data["command"], made_at(data))


def against_aa(text: str) -> list[list[str]]:
    inside, outside = re.fullmatch(r"inside it (.*); outside it (.*)", text).groups()
    return [[] if side == "no variant" else side.split(", ") for side in (inside, outside)]


def test_steps_against_aa_sorts_every_variant_but_stock_by_the_closed_interval(hook: Any, tmp_path: Path,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Committed: each non-stock variant once, inside where low <= ratio <= high. Made up: a ratio on either end is
    inside, one beyond either end outside, stock rows left out."""
    data = load("benchmarks/overhead_cpu.json")
    low, high = data["aa_interval"]
    inside, outside = against_aa(hook.steps_against_aa())
    variants = [r for r in data["rows"] if not r["variant"].startswith("stock")]
    assert sorted(inside + outside) == sorted(f"`{r['variant']}` ({r['step_ratio']:.3f})" for r in variants)
    for shown in inside + outside:
        variant, ratio = re.fullmatch(r"`(.+)` \((\S+)\)", shown).groups()
        measured = next(r for r in variants if r["variant"] == variant)["step_ratio"]
        fixed(ratio, measured, 3)
        assert (shown in inside) == (low <= measured <= high), shown
    made_up = {"aa_interval": [0.95, 1.05], "rows": [
        {"variant": "stock", "step_ratio": 1.0}, {"variant": "stock (A/A)", "step_ratio": 1.01},
        {"variant": "on_low", "step_ratio": 0.95}, {"variant": "on_high", "step_ratio": 1.05},
        {"variant": "below", "step_ratio": 0.9}, {"variant": "above", "step_ratio": 1.2}]}
    monkeypatch.setattr(hook, "_benchmark", lambda name: made_up)
    assert against_aa(hook.steps_against_aa()) == [["`on_low` (0.950)", "`on_high` (1.050)"],
                                                  ["`below` (0.900)", "`above` (1.200)"]]
    made_up["aa_interval"] = [math.nan, math.nan]  # one timed pass: no variant is inside or outside
    assert hook.steps_against_aa() == "no variant is placed against an A/A interval: it has none (one timed pass)"


def test_unsloth_steps_table(hook: Any) -> None:
    data = load("benchmarks/overhead_cpu.json")["unsloth_rows"]
    header, rows = only_table(hook.unsloth_steps())
    assert header == ["variant", "s/step", "x stock", "forwards/step", "compiled graphs added during a run"]
    assert [row[0] for row in rows] == [r["variant"] for r in data]
    for r, row in zip(data, rows):
        fixed(row[1], r["median_step_s"], 4)
        fixed(row[2], r["step_ratio"], 3)
        assert row[3].split(" or ") == [str(n) for n in r["forwards_per_step"]]
        assert row[4] == str(r["graphs_added_per_run"])


def ref_sync_rows(hook: Any) -> dict[str, str]:
    header, rows = only_table(hook.ref_sync_cost())
    assert header == ["measured (`ref_model_sync_steps=1`, alpha 1.0, LoRA)", "value"]
    return {label: value for label, value in rows}


def test_ref_sync_cost_table(hook: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every row against overhead_cpu.json's `ref_sync`, the whole step's ratio said to be inside the A/A interval
    only where it is (made up: copy and adapter bytes that differ, so that one cannot stand for the other, and an
    A/A interval the step ratio lies outside)."""
    committed = load("benchmarks/overhead_cpu.json")
    made_up = {"ref_sync": {**committed["ref_sync"], "copy_bytes": 1234567, "adapter_bytes": 7654321, "copy_tensors": 9,
                            "syncs_per_run": 3, "exchanges_per_run": 5, "step_ratio": 1.21},
               "aa_interval": [0.95, 1.05]}
    one_pass = {**made_up, "aa_interval": [math.nan, math.nan]}
    for data in (committed, made_up, one_pass):
        monkeypatch.setattr(hook, "_benchmark", lambda name, data=data: data)
        r, (low, high) = data["ref_sync"], data["aa_interval"]
        rows = ref_sync_rows(hook)
        assert len(rows) == 8
        assert rows["extra forwards per step (sync on against stock)"] == str(r["extra_forwards"])
        copy = re.fullmatch(r"([\d,]+) bytes in (\d+) tensors \(the adapter: ([\d,]+) bytes; ratio (\S+)\)",
                            rows["memory of the reference copy"])
        assert (copy[1], int(copy[2]), copy[3]) == (f"{r['copy_bytes']:,}", r["copy_tensors"],
                                                    f"{r['adapter_bytes']:,}")
        fixed(copy[4], r["bytes_to_adapter_ratio"], 3)
        assert rows["extra memory during an exchange (largest tensor)"] == f"{r['exchange_temp_bytes']:,} bytes"
        sync = re.fullmatch(r"(\S+) ms = (\S+) x the stock step \((\S+) s\)", rows["one sync (alpha = 1), median"])
        fixed(sync[1], r["sync_seconds_median"] * 1e3, 3)
        scientific(sync[2], r["sync_to_step_ratio"])
        fixed(sync[3], r["stock_step_seconds_median"], 3)
        exchange = re.fullmatch(r"(\S+) ms = (\S+) x the stock step",
                                rows["one exchange (swap in + swap back), median"])
        fixed(exchange[1], r["exchange_seconds_median"] * 1e3, 3)
        scientific(exchange[2], r["exchange_to_step_ratio"])
        copy_time = re.fullmatch(r"(\S+) ms", rows["initial copy (once, when training starts)"])
        fixed(copy_time[1], r["copy_seconds_median"] * 1e3, 2)
        added = re.fullmatch(r"(\S+) ms = (\S+) x the stock step",
                             rows[f"added per step ({r['syncs_per_run']} syncs, {r['exchanges_per_run']} exchanges per "
                                  "run)"])
        fixed(added[1], r["added_seconds_per_step"] * 1e3, 3)
        scientific(added[2], r["added_to_step_ratio"])
        against_aa = ("A/A interval: none (one timed pass)" if math.isnan(low)
                      else "inside the A/A interval: not resolved" if low <= r["step_ratio"] <= high
                      else "outside the A/A interval")
        label = f"whole step, sync on against stock ({against_aa})"
        step = re.fullmatch(r"(\S+) s / (\S+) s = (\S+)", rows[label])
        for cell, value in zip(step.groups(), (r["step_seconds_median"], r["stock_step_seconds_median"],
                                               r["step_ratio"])):
            fixed(cell, value, 3)


def test_verl_loss_table_and_its_settings(hook: Any) -> None:
    data = load("benchmarks/verl_loss.json")
    table, sentence = hook.verl_loss().split("\n\n")
    header, rows = only_table(table)
    assert header == ["loss", "forward + backward, median ms", "x stock", "95 % interval"]
    assert [row[0] for row in rows] == [f"`{r['method']}`" for r in data["rows"]]
    for r, row in zip(data["rows"], rows):
        fixed(row[1], r["median_ms"], 3)
        fixed(row[2], r["ratio"], 3)
        interval(row[3], r["ci"], 3)
    found = re.fullmatch(r"Stock `ppo_loss` with its KL term: (\S+) ms\. One micro-batch of (\d+) responses of (\d+) "
                         r"to (\d+) tokens after (\d+)-token prompts, (\d+) interleaved rounds, one CPU thread "
                         r"\(verl (\S+), torch (\S+)\)\. Made by `(.+)` on (\S+), (.+), (at .+)\.", sentence)
    fixed(found[1], data["stock_ms"], 3)
    # benchmarks/verl_loss.py draws each response's length from half the maximum to the maximum
    assert [int(n) for n in found.groups()[1:6]] == [data["responses"], data["response_length"] // 2,
                                                     data["response_length"], data["prompt_length"], data["repeats"]]
    assert (found[7], found[8]) == (data["verl"], data["torch"])
    assert (found[9], found[10], found[11], found[12]) == (data["command"], data["date"], data["machine"],
                                                           made_at(data))
    assert data["command"].startswith("python benchmarks/verl_loss.py")  # the committed run, not a smoke run
    assert "--smoke" not in data["command"] and data["machine"].startswith("CPU: ")


# ----- value, ci_record, self_check -------------------------------------------------------------------------------

def test_value_reads_the_paths_it_names(hook: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`value FILE:PATHS:FORMAT`: one figure, the range low-high of several (in that order, one figure where they are
    equal), `[field=text]` selects items, a number indexes a list, ',' joins paths; nothing or a null fails."""
    (tmp_path / "r.json").write_text(json.dumps({
        "rows": [{"variant": "stock", "x": 3.0, "n": 1200}, {"variant": "a.b,c:d", "x": 1.25, "n": 7},
                 {"variant": "c", "x": 2.5, "n": None}],
        "other": {"y": 1.251}, "list": [10, 20, 30]}))
    monkeypatch.setattr(hook, "ROOT", tmp_path)
    assert hook.value("r.json:rows[].x:.2f") == "1.25-3.00"
    assert hook.value("r.json:rows[variant=stock].x:.1f") == "3.0"
    assert hook.value("r.json:rows[variant=a.b,c:d].x:.2f") == "1.25"
    assert hook.value("r.json:rows[variant=stock].n:,") == "1,200"
    assert hook.value("r.json:rows[variant=a.b,c:d].x,other.y:.2f") == "1.25"  # equal at that format: one figure
    assert hook.value("r.json:rows[variant=a.b,c:d].x,other.y:.3f") == "1.250-1.251"
    assert hook.value("r.json:other.y,rows[variant=stock].x:.1f") == "1.3-3.0"
    assert hook.value("r.json:list.0:d") == "10" and hook.value("r.json:list.2:d") == "30"
    for bad in ("r.json:rows[].n:d", "r.json:rows[variant=none].x:.1f"):
        with pytest.raises(ValueError):
            hook.value(bad)
    # inside a sentence, a selector may hold spaces (the KL lab's setting names); the marker ends at its own " -->"
    (tmp_path / "lab.json").write_text(json.dumps({"rows": [{"setting": "k3 in the loss", "x": 0.25},
                                                             {"setting": "k3 in the loss, sequence_sum", "x": 0.5}]}))
    assert hook.render("a <!-- generated-inline: value lab.json:rows[setting=k3 in the loss].x:.2f --> b "
                       "<!-- generated-inline: value lab.json:rows[setting=k3 in the loss, sequence_sum].x:.1f -->.") \
        == "a 0.25 b 0.5."


MADE_UP_CI = {"commit": "0123456789abcdef", "date": "2026-12-02", "seconds": 3725, "exit": 1,
              "machine": {"cpu": "Xeon", "cores": 4, "arch": "aarch64"},
              "rows": [{"row": "a", "result": "10 passed, 1 failed, 1 warning in 61.20s (0:01:01)", "exit": 1,
                        "pytest_seconds": 75, "ended_at": 3599,
                        "versions": {"python": "3.13.0", "torch": "2.14.1", "trl": "1.15.0",
                                     "transformers": "5.17.0", "datasets": "4.8.5"}},
                       {"row": "e (x-0.1.0.whl)", "result": "self-check", "exit": 0, "pytest_seconds": None,
                        "ended_at": 3660, "versions": {}},
                       {"row": "h", "result": "3 passed, 12 warnings in 1.00s", "exit": 0, "pytest_seconds": 119,
                        "ended_at": 3700, "versions": {"verl": "0.9.1", "trl": "1.15.0", "liger-kernel": "0.8.5"}},
                       {"row": "f", "result": "mkdocs build --strict", "exit": 0, "pytest_seconds": None,
                        "ended_at": 3725, "versions": {"mkdocs": "1.6.1", "mkdocs-material": "9.8.2"}}]}


@pytest.mark.parametrize("source", ["committed", "made up"])
def test_ci_record_is_every_row_of_the_record(hook: Any, source: str, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Each row's name, versions ('none' where not installed), other packages, result (pytest's counts without
    warnings and time) with that row's exit status, pytest's and the run's minutes; then how the run was made (made
    up: a failed row in a failed run beside rows that passed, a missing version, a single warning)."""
    data = load("docs/results/ci.json")
    if source == "made up":
        data = MADE_UP_CI
        (tmp_path / "docs" / "results").mkdir(parents=True)
        (tmp_path / "docs" / "results" / "ci.json").write_text(json.dumps(data))
        monkeypatch.setattr(hook, "ROOT", tmp_path)
    table, sentence = hook.ci_record().split("\n\n")
    header, rows = only_table(table)
    versions = ["python", "torch", "trl", "transformers", "datasets", "unsloth"]
    assert header == ["row", *versions, "also", "result", "pytest", "ended at"]
    assert len(rows) == len(data["rows"])
    for record, row in zip(data["rows"], rows):
        name, _, detail = record["row"].partition(" ")
        assert row[0] == (f"({name}) {detail[1:-1]}" if detail else f"({name})")
        assert row[1:7] == [record["versions"].get(package, "none") for package in versions]
        assert row[7] == ", ".join(f"{p} {v}" for p, v in record["versions"].items()
                                   if p in ("torchao", "liger-kernel", "tinker", "verl"))
        # pytest's counts without the warnings and the time, or what ran (the docs build with its versions)
        result = ", ".join(part for part in record["result"].split(" in ")[0].split(", ")
                           if not re.fullmatch(r"\d+ warnings?", part))
        if result.startswith("mkdocs"):
            docs = record["versions"]
            result += f" (mkdocs {docs['mkdocs']}, mkdocs-material {docs['mkdocs-material']})"
        assert row[8] == f"{result}: exit {record['exit']}"
        if record["pytest_seconds"] is None:
            assert row[9] == ""
        else:
            minutes(row[9], record["pytest_seconds"])
        minutes(row[10], record["ended_at"])
    machine = data["machine"]
    found = re.fullmatch(r"Run on (\S+) from a clean clone of `(\w+)`, on (\d+) cores \((.+), (\S+)\): (.+) in all, "
                         r"exit (\d+)\. .*", sentence)
    assert found[1] == data["date"] and data["commit"].startswith(found[2]) and len(found[2]) == 7
    assert (int(found[3]), found[4], found[5]) == (machine["cores"], machine["cpu"], machine["arch"])
    minutes(found[6], data["seconds"])
    assert int(found[7]) == data["exit"]


@pytest.mark.parametrize("name", [None, "selfcheck_verl.json"])
def test_self_check_is_the_recorded_output(hook: Any, name: Optional[str]) -> None:
    data = load(f"docs/results/{name or 'selfcheck.json'}")
    text = hook.self_check(name)
    assert text.split("```text\n", 1)[1] == "\n".join(data["lines"]) + "\n```"
    assert f"on {data['date']} with " in text and f"(`{data['command']}`, {made_at(data)}):" in text


# ----- the demo's committed runs ------------------------------------------------------------------------------------

DEMO_COLUMNS = [("reward", "reward", 2), ("completions/mean_length", "completion length", 1),
                ("adaptive_kl/raw_kl", "raw KL", 3), ("adaptive_kl/adapted_kl", "adapted KL", 3),
                ("adaptive_kl/sequence_kl", "KL per completion", 2)]
DEMO_RUNS = sorted(path.parent.name for path in (ROOT / "docs" / "results").glob("*/summary.json"))


def test_every_committed_demo_run_has_the_settings_the_results_page_names_once() -> None:
    """results.md renders the seeds of one run and says every comparison ran them, with the steps, beta, loss type,
    learning rate and averaging window it names (and the pages name them as settings: 120 steps, beta=0.04, the last
    12 steps, target's kl_target=0.2 and kl_horizon=100, a sync every 30 steps): every committed run must have them."""
    runs = {run: load(f"docs/results/{run}/summary.json") for run in DEMO_RUNS}
    settings = {run: data["settings"] for run, data in runs.items()}
    assert len(settings) == 4
    for run, given in settings.items():
        assert (given["seeds"], given["steps"], given["beta"], given["loss_type"], given["learning_rate"]) == \
            (settings["default"]["seeds"], 120, 0.04, "dapo", 5e-3), run  # the tiny task's, as resolved and recorded
        assert runs[run]["window"] == 12, run
    for run in ("options", "kl_in_reward"):  # the runs with a `target` variant
        assert (settings[run]["kl_target"], settings[run]["kl_horizon"]) == (0.2, 100.0), run
    assert [method for method in settings["ref_sync"]["methods"] if method.startswith("ref_sync:")] == \
        ["ref_sync:30", "ref_sync:30:reset"]


def mean_and_std(cell: str, mean: float, std: float, decimals: int) -> None:
    shown_mean, shown_std = cell.split(" +/- ")
    fixed(shown_mean, mean, decimals)
    fixed(shown_std, std, decimals)


MADE_UP_DEMO = {"settings": {"seeds": 2}, "wall_seconds": 99.6, "window": 7,
                "environment": {"command": "python demo.py --steps 5 --output-dir /tmp/x --seeds 2",
                                "versions": {"trl": "1.15.0"}, "hardware": "a CPU"},
                # by_seed: the midpoint of 7.25 and 9.5 is 8.375, so stock's 8.3 held and beta=0's 8.4 drifted
                "summary": [{"method": "none", "reward": [0.5, 0.125], "completions/mean_length": [7.25, 1.05],
                             "adaptive_kl/raw_kl": [0.1234, 0.0101], "adaptive_kl/adapted_kl": [0.0617, 0.0052],
                             "adaptive_kl/sequence_kl": [1.5, 0.25], "adaptive_kl/current_beta": [0.0437, 0.0],
                             "by_seed": {"completions/mean_length": [6.2, 8.3]}},
                            {"method": "beta=0", "reward": [0.61, 0.02], "completions/mean_length": [9.5, 0.5],
                             "by_seed": {"completions/mean_length": [8.4, 10.6]},
                             **{key: [None, None] for key in ("adaptive_kl/raw_kl", "adaptive_kl/adapted_kl",
                                                            "adaptive_kl/sequence_kl", "adaptive_kl/current_beta")}}]}


def seeds_drifted(summary: list[dict], variant: str) -> str:
    """By hand: of `variant`'s seeds, those whose length is nearer the run's `beta=0` mean than its `none` mean."""
    by_method = {item["method"]: item for item in summary}
    stock, drift = (by_method[name]["completions/mean_length"][0] for name in ("none", "beta=0"))
    lengths = by_method[variant]["by_seed"]["completions/mean_length"]
    drifted = [length for length in lengths if abs(length - drift) < abs(length - stock)]
    return f"{len(drifted)} of {len(lengths)} seeds"


@pytest.mark.parametrize("run", [*DEMO_RUNS, "made up"])
def test_demo_results_table_is_every_variant_of_the_run(hook: Any, run: str, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Each variant's mean +/- std of each column (reward 2 decimals, length 1, raw and adapted KL 3, KL per
    completion 2; '(off)' where never logged), beta at the end to 2 significant digits, and the run's settings (made
    up: a window other than the default, a variant without a KL)."""
    if run == "made up":
        data = MADE_UP_DEMO
        (tmp_path / "docs" / "results" / run).mkdir(parents=True)
        (tmp_path / "docs" / "results" / run / "summary.json").write_text(json.dumps(data))
        monkeypatch.setattr(hook, "ROOT", tmp_path)
    else:
        data = load(f"docs/results/{run}/summary.json")
    table, sentence = hook.demo_results(run).split("\n\n")
    header, rows = only_table(table)
    # a run with stock, beta=0 and each seed's figures (default, kl_in_reward, a made-up one); options has no beta=0
    counted = (all("by_seed" in item for item in data["summary"])
               and {"none", "beta=0"} <= {item["method"] for item in data["summary"]})
    assert header == ["variant", *(title for _, title, _ in DEMO_COLUMNS), "beta at the end",
                      *(["length drifted in"] if counted else [])]
    assert [row[0] for row in rows] == [f"`{item['method']}`" for item in data["summary"]]
    for item, row in zip(data["summary"], rows):
        if counted:
            assert row.pop() == seeds_drifted(data["summary"], item["method"])
        for (key, _, decimals), cell in zip(DEMO_COLUMNS, row[1:]):
            mean, std = item[key]
            if mean is None:  # the demo writes a NaN (never logged) as null
                assert cell == "(off)"
            else:
                mean_and_std(cell, mean, std, decimals)
        beta = item["adaptive_kl/current_beta"][0]
        if beta is None:
            assert row[-1] == "0 (off)"
        else:
            digits = re.sub(r"e.*|^0\.0*|\.", "", row[-1])
            assert len(digits) <= 2 and math.isclose(float(row[-1]), beta, rel_tol=0.05 if beta else 0, abs_tol=1e-12)
    found = re.search(r"Wall time: (\d+) s\. Values: mean \+/- std over (\d+) seeds of each seed's mean over the last "
                      r"(\d+) steps\.$", sentence)
    fixed(found[1], data["wall_seconds"], 0)
    assert (int(found[2]), int(found[3])) == (data["settings"]["seeds"], data["window"])
    assert "--output-dir" not in sentence and f"Hardware: {data['environment']['hardware']}." in sentence


DEMO_VALUE = re.compile(r"<!-- generated-inline: demo_value (\S+) -->")
DEMO_VALUE_MARKERS = sorted({m for page in (ROOT / "docs").glob("*.md") for m in DEMO_VALUE.findall(page.read_text())})


def test_the_pages_ask_for_demo_values() -> None:
    assert len(DEMO_VALUE_MARKERS) > 50


@pytest.mark.parametrize("argument", DEMO_VALUE_MARKERS)
def test_each_demo_value_on_the_pages_is_its_runs_mean(hook: Any, argument: str) -> None:
    """Every `demo_value RUN:VARIANT:KEY:DIGITS[:std]` marker of the pages: the variant's mean over seeds to DIGITS
    decimals (or that format), with the std where asked."""
    run, rest = argument.split(":", 1)
    std = rest.endswith(":std")
    variant, key, digits = rest.removesuffix(":std").rsplit(":", 2)
    (item,) = [item for item in load(f"docs/results/{run}/summary.json")["summary"] if item["method"] == variant]
    text = hook.demo_value(argument)
    parts = text.split(" +/- ")
    assert len(parts) == (2 if std else 1), text
    for part, value in zip(parts, item[key]):
        if digits.isdigit():
            fixed(part, value, int(digits))
        else:
            assert digits == "0e" and re.fullmatch(r"\de[-+]\d\d", part) and \
                abs(float(part) - value) <= 0.5 * 10 ** int(part.split("e")[1]), (part, value)


DEMO_DRIFTED = re.compile(r"<!-- generated-inline: demo_drifted (\S+) -->")
DEMO_DRIFTED_MARKERS = sorted({m for page in (ROOT / "docs").glob("*.md") for m in DEMO_DRIFTED.findall(page.read_text())})


def test_demo_drifted_counts_the_seeds_nearer_the_unregularised_length(hook: Any, tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Made up: stock (`none`) holds at 7, `beta=0` drifts to 21 (midpoint 14); seeds at 8 and 13.9 held, 14.1, 20
    and 30 (past the drift) drifted: 3 of 5."""
    summary = [{"method": "none", "completions/mean_length": [7.0, 0.5],
                "by_seed": {"completions/mean_length": [6.5, 7.5]}},
               {"method": "beta=0", "completions/mean_length": [21.0, 2.0],
                "by_seed": {"completions/mean_length": [19.0, 23.0]}},
               {"method": "x", "completions/mean_length": [17.2, 8.1],
                "by_seed": {"completions/mean_length": [8.0, 13.9, 14.1, 20.0, 30.0]}}]
    (tmp_path / "docs" / "results" / "made").mkdir(parents=True)
    (tmp_path / "docs" / "results" / "made" / "summary.json").write_text(json.dumps({"summary": summary}))
    monkeypatch.setattr(hook, "ROOT", tmp_path)
    assert hook.demo_drifted("made:x") == "3 of 5 seeds"


def test_the_pages_count_drifted_seeds_where_they_say_a_method_lets_length_drift() -> None:
    """Every page that tells what `clip` or `dynamic` did to the length on the demo task counts the seeds."""
    asked = {(page.name, argument.split(":", 1)[1]) for page in (ROOT / "docs").glob("*.md")
             for argument in DEMO_DRIFTED.findall(page.read_text())}
    for page in ("index.md", "results.md", "methods.md", "choosing-a-setting.md"):
        assert {(page, "clip"), (page, "dynamic")} <= asked, page


@pytest.mark.parametrize("argument", DEMO_DRIFTED_MARKERS)
def test_each_demo_drifted_on_the_pages_counts_its_runs_seeds(hook: Any, argument: str) -> None:
    """Every `demo_drifted RUN:VARIANT` marker of the pages: of the variant's seeds, those whose length is nearer the
    run's `beta=0` mean than its `none` mean."""
    run, variant = argument.split(":", 1)
    summary = load(f"docs/results/{run}/summary.json")["summary"]
    (item,) = [item for item in summary if item["method"] == variant]
    assert len(item["by_seed"]["completions/mean_length"]) == item["seeds"]
    assert hook.demo_drifted(argument) == seeds_drifted(summary, variant)


# ----- the KL lab ---------------------------------------------------------------------------------------------------

def test_kl_lab_sentences_and_groups(hook: Any) -> None:
    """The lab run's and the target run's sentences against kl_lab.json; each environment's table has one section a
    group, in the file's order."""
    lab = load("docs/results/kl_lab.json")
    target = lab["target"]
    found = re.fullmatch(r"tau = KL\(pi\*_beta \|\| pi_ref\) = (\S+), so beta\* = (\S+); beta_0 = (\S+), (\d+) steps "
                         r"at a constant learning rate\.", hook.kl_lab_target().split("\n\n")[0])
    fixed(found[1], target["tau"], 4)
    fixed(found[2], target["beta_star"], 4)
    assert float(found[3]) == target["beta_0"] and int(found[4]) == target["training"]["steps"]
    training = next(iter(lab["tables"].values()))["training"]
    found = re.search(r"\(torch \S+, (\d+) s on (.+?), (at [^)]+)\): (\d+) groups of (\d+) completions a step, "
                      r"(\d+) steps, .*, seeds (.+) averaged", hook.kl_lab_run())
    fixed(found[1], lab["seconds"], 0)
    assert found[2] == lab["machine"] and lab["machine"].startswith("CPU: ")  # the machine the run recorded
    assert found[3] == made_at(lab)
    assert [int(n) for n in found.groups()[3:6]] == [training["groups"], training["group_size"], training["steps"]]
    # the seeds themselves (it read "seeds 2 averaged", the count, beside the trainer lab's "seeds 0, 1 averaged")
    assert found[7] == ", ".join(str(seed) for seed in range(lab["seeds"]))
    for environment, table in lab["tables"].items():
        groups = re.findall(r"^\*\*(.+)\*\*$", hook.kl_lab(environment), re.MULTILINE)
        assert groups == list(dict.fromkeys(row["group"] for row in table["rows"]))


def kl(cell: str, value: float) -> None:
    """The lab's KL(pi || pi*): 4 decimals, '0' below 0.00005."""
    if abs(value) < 5e-5:
        assert cell == "0", (cell, value)
    else:
        fixed(cell, value, 4)


def trainer_table(name: str) -> dict:
    (table,) = load(f"docs/results/kl_lab_{name}.json")["trainers"].values()
    return table


def lab_row(table: dict, recipe: str, setting: str) -> dict:
    (row,) = [r for r in table["rows"] if (r["recipe"], r["setting"]) == (recipe, setting) and "refused" not in r]
    return row


@pytest.mark.parametrize("name", ["trl", "unsloth", "unsloth_pad_is_eos", "made_up"])
def test_kl_lab_trainer_says_how_its_run_was_made(hook: Any, name: str, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The sentence before a trainer's tables: its command, the versions installed (made up: peft not installed,
    null, left out), its seconds, machine and commit."""
    data = load(f"docs/results/kl_lab_{'trl' if name == 'made_up' else name}.json")
    if name == "made_up":
        data["versions"]["peft"] = None
        (tmp_path / "docs" / "results").mkdir(parents=True)
        (tmp_path / "docs" / "results" / "kl_lab_made_up.json").write_text(json.dumps(data))
        monkeypatch.setattr(hook, "ROOT", tmp_path)
    made = hook.kl_lab_trainer(name).split("\n\n")[0]
    found = re.fullmatch(r"Made by `(.+)` \((.+?); (\d+) s on (.+?), (at [^)]+)\): .+\.", made)
    assert found[1] == data["command"]
    assert found[2] == ", ".join(f"{package} {version}" for package, version in data["versions"].items()
                                 if version is not None)
    fixed(found[3], data["seconds"], 0)
    assert (found[4], found[5]) == (data["machine"], made_at(data))


def test_kl_lab_side_by_side_puts_each_trainers_figures_under_its_name(hook: Any) -> None:
    trl, unsloth = trainer_table("trl"), trainer_table("unsloth")
    recipes = {label: key for key, label in trl["recipes"].items()}
    header, rows = only_table(hook.kl_lab_side_by_side())
    assert [cell.replace("\\*", "*") for cell in header[2:5]] == ["TRL: KL(pi||pi*)", "Unsloth: KL(pi||pi*)",
                                                                   "Unsloth - TRL"]
    assert rows
    for row in rows:
        mine, other = (lab_row(table, recipes[row[0]], row[1]) for table in (trl, unsloth))
        for cell, value in ((row[2], mine["train"]["kl_opt"]), (row[3], other["train"]["kl_opt"]),
                            (row[4], other["train"]["kl_opt"] - mine["train"]["kl_opt"])):
            kl(cell, value)


def test_kl_lab_differences_and_pad_is_eos_name_each_trainers_own_figure(hook: Any) -> None:
    """Where Unsloth's KL(pi||pi*) lies outside TRL's seeds' range, TRL's figure and range come first, Unsloth's after
    'against'; the pad = EOS sentence gives that table's figure first, then TRL's, then Unsloth's own."""
    trl, unsloth, eos = trainer_table("trl"), trainer_table("unsloth"), trainer_table("unsloth_pad_is_eos")
    text = hook.kl_lab_differences()
    outside = re.findall(r"`(\w+)`, (.+?) (\S+) \[(\S+) - (\S+)\] against (\d+(?:\.\d+)?)[;.]", text)
    assert outside, text
    for recipe, setting, mine, low, high, other in outside:
        theirs, own = lab_row(trl, recipe, setting)["train"], lab_row(unsloth, recipe, setting)["train"]
        kl(mine, theirs["kl_opt"])
        kl(low, min(theirs["kl_opt_seeds"]))
        kl(high, max(theirs["kl_opt_seeds"]))
        kl(other, own["kl_opt"])
    label = "k3 in the loss (the trainer's own)"
    found = re.search(r"ends (\S+) from pi\* with pad = EOS .* against TRL's (\S+) .* and Unsloth's own (\S+) with",
                      hook.kl_lab_pad_is_eos())
    for cell, table in zip(found.groups(), (eos, trl, unsloth)):
        kl(cell, lab_row(table, "dr_grpo", label)["train"]["kl_opt"])


# ----- docs/results/gpu/ ------------------------------------------------------------------------------------------

CUDA = {"kind": "cuda", "name": "NVIDIA H200", "capability": "9.0", "cuda": "12.8", "driver": "570.1",
        "precision": "bf16"}


def check_cell(checks: list[dict]) -> str:
    """Each check as the check prints it, a star in its name or detail escaped (KL(pi||pi*) would open an emphasis
    that a later star closes)."""
    return "<br>".join(("**FAIL**" if not c["ok"] else "untested" if c.get("untested") else "ok") + ": "
                       + (c["name"] + (f": {c['detail']}" if c["detail"] else "")).replace("*", "\\*")
                       for c in checks)


def made_up_check() -> dict:
    return {"command": "python -m unsloth_adaptive_kl --gpu", "date": "2026-12-01", "device": CUDA,
            "versions": {"torch": "2.11.0", "vllm": None, "trl": "1.15.0", "unsloth": "2026.10.9"}, "dry_run": False,
            "seconds": 300.6,
            "model": [{"name": "m1", "ok": True, "detail": "d1"}, {"name": "m2", "ok": True, "detail": ""},
                      {"name": "trl version", "ok": True, "detail": "1.17.0 (tested: 1.9-1.16)", "untested": True}],
            "scenarios": {"a": {"ran": True, "seconds": 61.4, "checks": [
                {"name": "x", "ok": True, "detail": "fine | good"}, {"name": "y", "ok": False, "detail": "boom"},
                {"name": "z", "ok": True, "detail": ""},
                {"name": "guard", "ok": True, "detail": "KL(pi||pi*) 9e-05, then pi* again"}]},
                "b": {"ran": False, "why": "not asked for (--only)"},
                "c": {"ran": True, "seconds": 2.6, "checks": [{"name": "w", "ok": False, "detail": "timed out"}]}}}


@pytest.mark.parametrize("source", ["committed", "made up", "driver not read", "within the ranges"])
def test_gpu_check_is_every_check_of_every_scenario(hook: Any, source: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A row for the tiny model and one a scenario, in the file's order: its seconds and each check, ok, untested
    (a version outside the tested range, as the check prints it) or **FAIL**, with its detail; a scenario not run says
    why; the device (a driver nvidia-smi did not give: "not read", not "None"), versions (those installed), kind of
    run and seconds, and those outside the CPU matrix's ranges (within the ranges: a torch the matrix runs and a tested
    package not installed, null, which is outside nothing)."""
    data = load("docs/results/gpu/check.json") if source == "committed" else made_up_check()
    if source == "driver not read":
        data["device"] = {**CUDA, "driver": None}
    if source == "within the ranges":
        data["versions"] = {"torch": "2.14.1", "vllm": None, "trl": "1.15.0", "unsloth": None}
    monkeypatch.setattr(hook, "_gpu", lambda name: data if name == "check.json" else None)
    text, table = hook.gpu_check().split("\n\n")
    header, rows = only_table(table)
    assert header == ["scenario", "seconds", "checks"]
    assert rows[0] == ["the tiny Llama", "", check_cell(data["model"])]
    assert [row[0] for row in rows[1:]] == [f"`{name}`" for name in data["scenarios"]]
    for scenario, row in zip(data["scenarios"].values(), rows[1:]):
        if scenario["ran"]:
            fixed(row[1], scenario["seconds"], 0)
            assert row[2] == check_cell(scenario["checks"])
        else:
            assert row[1:] == ["", f"not run: {scenario['why']}"]
    kind = "dry run (each scenario's CPU equivalent)" if data["dry_run"] else "run"
    assert text.startswith(f"The {kind} of {data['date']} on ")
    device = data["device"]
    if device["kind"] == "cuda":
        driver = "not read" if source == "driver not read" else device["driver"]
        assert f" on {device['name']} (compute capability {device['capability']}, CUDA {device['cuda']}, driver " \
               f"{driver}, {device['precision']}): " in text and "not a GPU result" not in text
    else:
        assert f" on a CPU ({device['name']}, {device['cores']} cores; **not a GPU result**): " in text
    seconds = re.search(r"`, (\d+) s in all\. Versions: (.*?)\. (Outside the tested ranges: .*|Each of its .*)$", text)
    fixed(seconds[1], data["seconds"], 0)
    assert seconds[2] == versions_line(data)
    if source == "within the ranges":
        assert seconds[3] == "Each of its versions is within the tested ranges."
        return
    # the versions outside the CPU matrix's ranges of the core and the integrations the GPU check ran (TRL and
    # Unsloth), by name: torch 2.11.0 (the GPU image's) is within the core's and TRL's but not Unsloth's 2.14.1
    assert seconds[3] == ("Outside the tested ranges: torch 2.11.0 (tested: `torch>=2.4.0,<=2.15.0 with the core; "
                          "torch>=2.6.0,<=2.15.0 with TRL; torch==2.14.1 with Unsloth`); the GPU results were taken on "
                          "a version the CPU matrix does not run.")


@pytest.mark.parametrize("source", ["committed", "made up", "dry run"])
def test_gpu_check_summary_names_the_card_and_each_scenarios_verdict(hook: Any, source: str,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """compatibility.md's sentence: the card, date and commit, then the scenarios that passed (every check ok), those
    that failed (one check failed: `a` and `c` of the made-up run) and those not run with why; a dry run is no GPU
    run."""
    data = load("docs/results/gpu/check.json") if source == "committed" else made_up_check()
    if source == "dry run":
        data = {**data, "dry_run": True}
    if source == "made up":  # a scenario that ran and recorded no check held none
        data["scenarios"]["d"] = {"ran": True, "seconds": 1.0, "checks": []}
    monkeypatch.setattr(hook, "_gpu", lambda name: data if name == "check.json" else None)
    text = hook.gpu_check_summary()
    if source == "dry run":
        assert text == "No GPU run of the check is recorded: [Tested on a GPU](gpu.md) shows its dry run on a CPU."
        monkeypatch.setattr(hook, "_gpu", lambda name: None)
        assert hook.gpu_check_summary() == "No run of the GPU check is recorded in docs/results/gpu/check.json."
        return
    head, *parts = text.removesuffix(".").split("; ")
    assert head == f"The last recorded GPU check: {data['device']['name']}, {data['date']}, {made_at(data)}"
    verdicts = {"passed": [], "**failed**": []}
    for name, scenario in data["scenarios"].items():
        if scenario["ran"]:
            held = scenario["checks"] and all(c["ok"] for c in scenario["checks"])
            verdicts["passed" if held else "**failed**"].append(f"`{name}`")
    expected = [f"{verdict}: {', '.join(names)}" for verdict, names in verdicts.items() if names]
    expected += [f"not run: `{name}`, {s['why']}" for name, s in data["scenarios"].items() if not s["ran"]]
    assert parts == expected
    if source == "made up":
        assert parts == ["**failed**: `a`, `c`, `d`", "not run: `b`, not asked for (--only)"]


def versions_line(data: dict) -> str:
    """A GPU results file's versions as the page lists them: those installed, this package's naming the commit it ran
    at (`made_at`)."""
    return ", ".join(f"{p} {v}{f' ({made_at(data)})' if p == 'unsloth_adaptive_kl' else ''}"
                     for p, v in data["versions"].items() if v is not None)


def made_up_cost() -> dict:
    def row(median: float, ratio: float, ci: list[float], peak: int, memory: Optional[float], n: int = 12) -> dict:
        return {"median_s": median, "n": n, "ratio": ratio, "ci": ci, "peak_bytes": peak, "memory_ratio": memory,
                "working_bytes": peak // 3, "working_memory_ratio": None if memory is None else memory * 1.1}

    return {"command": "python benchmarks/unsloth_cost.py --json x", "date": "2026-12-01", "size": "0.5b",
            "device": CUDA, "versions": {"torch": "2.11.0", "vllm": None},
            "settings": {"model": {"hidden_size": 896, "num_hidden_layers": 24, "vocab_size": 151936},
                         "lora_rank": 16, "prompts": 8, "completions": 4, "length": 256},
            "rounds": 12, "warmup": 2, "whole_rounds": 3, "rounds_finished": True, "seconds": 301.4,
            "step": {"stock": row(0.25, 1.0, [0.97, 1.03], 3 * 2 ** 30, 1.0),
                     "stock (A/A)": row(0.2512, 1.0048, [0.981, 1.026], 3 * 2 ** 30 + 2 ** 20, 1.0003),
                     "clip": row(0.2634, 1.0536, [1.012, 1.094], 5 * 2 ** 29, 1.25)},
            # the 0.5b size times one round of whole steps: bootstrap_ratio of one sample each is [ratio, ratio]
            "whole_step": {"stock": row(4.0, 1.0, [1.0, 1.0], 0, None, n=1),
                           "kl_in_reward": row(4.2, 1.05, [1.05, 1.05], 0, None, n=1)},
            "loss_share": 0.0625,
            "profile": {"method": "clip",
                        "stock": [{"name": "aten::mm", "self_us": 1200.4, "calls": 8},
                                  {"name": "aten::add", "self_us": 90.6, "calls": 8},
                                  {"name": "aten::copy_", "self_us": 45.4, "calls": 4}],
                        "heaviest": [{"name": "aten::mm", "self_us": 1210.0, "calls": 8},
                                     {"name": "aten::where", "self_us": 15.2, "calls": 3}]}}


def cost_rows(rows: list[list[str]], part: dict) -> None:
    """A cost table's rows against the file's: median ms, ratio, interval (stock: 'the reference'), peak MiB and its
    ratio where memory was measured."""
    assert [row[0] for row in rows] == [f"`{name}`" for name in part]
    for (name, measured), row in zip(part.items(), rows):
        fixed(row[1], measured["median_s"] * 1e3, 1)
        fixed(row[2], measured["ratio"], 3)
        if name == "stock":
            assert row[3] == "the reference"
        elif measured["n"] < 5:  # a bootstrap of the median of 1 to 4 samples takes a handful of values: no interval
            assert row[3] == f"none ({measured['n']} round{'s' * (measured['n'] > 1)}: too few to resample)"
        else:
            interval(row[3], measured["ci"], 3)
        if len(row) == 4:  # no row of the part measured memory: the table has no memory columns
            assert not any(r["memory_ratio"] for r in part.values())
            continue
        if measured["memory_ratio"] is None:
            assert row[4:6] == ["", ""]
        else:
            fixed(row[4], measured["peak_bytes"] / 1024 / 1024, 0)
            fixed(row[5], measured["memory_ratio"], 3)
        if not measured.get("working_memory_ratio"):  # a file written before it was measured has none
            assert row[6:] == ["", ""]
        else:
            fixed(row[6], measured["working_bytes"] / 1024 / 1024, 0)
            fixed(row[7], measured["working_memory_ratio"], 3)


@pytest.mark.parametrize("source", ["committed", "made up", "no warm-up"])
def test_gpu_cost_is_every_variant_and_the_profile(hook: Any, source: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each table against cost.json, and the rounds timed after the warm-up rounds (`--warmup 0`: "0 warm-up
    rounds")."""
    data = load("docs/results/gpu/cost.json") if source == "committed" else made_up_cost()
    if source == "no warm-up":
        data["warmup"] = 0
    monkeypatch.setattr(hook, "_gpu", lambda name: data if name == "cost.json" else None)
    text = hook.gpu_cost()
    found = tables(text)
    header = ["variant", "median ms", "x stock", "95 % interval", "peak MiB", "x stock", "working MiB", "x stock"]
    # a part without memory (the committed CPU run's, the made-up whole step's) had four columns of blanks: none now,
    # and a line says why
    measured = {part: any(row["memory_ratio"] for row in data.get(part, {}).values())
                for part in ("step", "whole_step")}
    # memory is measured on CUDA only: the committed run is the H100's (the made-up rows measured it)
    assert measured["step"] is (data["device"]["kind"] == "cuda")
    assert found[0][0] == header[:8 if measured["step"] else 4]
    assert text.count(hook.NO_MEMORY) == (not measured["step"]) + (bool(data.get("whole_step")) and not measured[
        "whole_step"])
    cost_rows(found[0][1], data["step"])
    # read by hand: each of the H100's ten method intervals holds 1.000; the made-up `clip` [1.012, 1.094] does not
    noise = "The A/A pair's interval, [{:.3f}, {:.3f}], is the noise of these rounds. ".format(
        *data["step"]["stock (A/A)"]["ci"])
    assert noise + ("Every method's interval holds 1.000: these rounds tell no method from stock."
                    if source == "committed" else
                    "The intervals that leave out 1.000: `clip` [1.012, 1.094]; every other method's holds it.") in text
    size, model = data["settings"], data["settings"]["model"]
    assert (f"Model: hidden {model['hidden_size']}, {model['num_hidden_layers']} layers, vocabulary "
            f"{model['vocab_size']:,}, LoRA r{size['lora_rank']}; {size['prompts']} prompts × {size['completions']} "
            f"completions of {size['length']} tokens.") in text
    warmup = f"after {data['warmup']} warm-up round{'s' * (data['warmup'] != 1)})"
    if "profile" not in data:
        # the committed H100 run, of 64fa45f (before `rounds_finished` was written): its command's time limit stopped
        # it in the profile, after its 10 timed rounds; the file was last written after the 10th, at 275 s (read by
        # hand), and does not say whether the budget or the limit ended the rounds
        assert "rounds_finished" not in data and data["rounds"] < data["rounds_planned"] and len(found) == 1
        assert f"the optimizer's step; {data['rounds']} rounds of the {data['rounds_planned']} planned, " \
               f"{warmup}" in text
        assert text.endswith("\n\n**The run stopped before its end** (its command's time limit): its file was last "
                             "written 275 s into the run, after the last of these rounds, and holds neither the "
                             "profile nor the whole steps.")
        return
    assert f"the optimizer's step; {data['rounds']} rounds, {warmup}" in text
    profile = data["profile"]
    method = profile["method"]
    assert found[1][0] == ["operation", "stock", f"`{method}`"]
    stock = {op["name"]: op["self_us"] for op in profile["stock"]}
    heaviest = {op["name"]: op["self_us"] for op in profile["heaviest"]}
    assert [row[0] for row in found[1][1]] == [f"`{name}`" for name in dict.fromkeys([*stock, *heaviest])]
    for row in found[1][1]:
        for cell, times in zip(row[1:], (stock, heaviest)):
            name = row[0].strip("`")
            assert cell == "" if name not in times else fixed(cell, times[name], 0) is None
    clock = "GPU" if data["device"]["kind"] == "cuda" else "CPU"
    assert f"({clock} time, µs)" in text and f"top {len(profile['stock'])}:" in text
    if data["whole_step"]:
        timed = data["whole_step"]["stock"]["n"]  # the rounds run, which a budget can make fewer than planned
        assert f"Whole GRPO step, generation included ({timed} round{'s' * (timed != 1)}):" in text
        assert found[2][0] == header[:8 if measured["whole_step"] else 4]
        cost_rows(found[2][1], data["whole_step"])
        share = re.search(r"The captured-batch step is (\d+)% of stock's whole step\.$", text)
        fixed(share[1], data["loss_share"] * 100, 0)
    else:
        assert len(found) == 2 and "Whole GRPO step" not in text and "captured-batch step is" not in text


def test_gpu_cost_of_a_run_its_budget_or_time_limit_cut_short(hook: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rounds the budget ended say so (7 of the 12 planned); a file written after a timed round of a run then stopped
    by its command's time limit (no profile yet) shows its table and says the rest was not reached."""
    data = {**made_up_cost(), "rounds": 7, "rounds_planned": 12, "warmup": 1}
    monkeypatch.setattr(hook, "_gpu", lambda name: data)
    assert ("the optimizer's step; 7 rounds of the 12 planned: its `--budget` ended the rest, after 1 warm-up "
            "round):") in hook.gpu_cost()
    del data["profile"]
    data.update(whole_step={}, loss_share=None, rounds=1, rounds_finished=False)
    text = hook.gpu_cost()
    found = tables(text)
    # not the budget's doing: the run had not reached the end of its rounds
    assert len(found) == 1 and "step; 1 round so far, of the 12 planned, after 1 warm-up round):" in text
    cost_rows(found[0][1], data["step"])
    assert "--budget" not in text
    assert text.endswith("\n\n**The run stopped before its end** (its command's time limit): the table holds the "
                         "rounds that had finished; the profile and the whole steps were not reached.")
    # a file from before `rounds_finished` was written (the H100's of 64fa45f): the rounds left out are not said to be
    # the budget's doing or the stop's; the stop is, with the moment of the file's last write
    del data["rounds_finished"]
    text = hook.gpu_cost()
    assert "step; 1 round of the 12 planned, after 1 warm-up round):" in text and "--budget" not in text
    assert text.endswith("\n\n**The run stopped before its end** (its command's time limit): its file was last "
                         "written 301 s into the run, after the last of these rounds, and holds neither the profile "
                         "nor the whole steps.")
    # the file as written at the start (the environment, no rows): what the H200's first 0.5B run kept
    started = {key: value for key, value in made_up_cost().items()
               if key not in ("step", "whole_step", "loss_share", "profile", "rounds_finished")}
    started.update(rounds=0, rounds_planned=12, phases={"model saved": 9.6, "trainer built": 31.2})
    data = started
    text = hook.gpu_cost()
    assert not tables(text) and text.startswith("The `--size 0.5b` run of 2026-12-01 on NVIDIA H200 ")
    assert text.endswith("tokens. Versions: torch 2.11.0.\n\n**The run stopped before its first timed round** (its "
                         "command's time limit); it reached: model saved at 10 s, trainer built at 31 s.")


def test_gpu_cost_without_whole_steps(hook: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run stopped after the captured batch (`whole_step` empty, `loss_share` null) shows no whole-step part; one
    whose budget skipped it says why."""
    data = {**made_up_cost(), "whole_step": {}, "loss_share": None}
    monkeypatch.setattr(hook, "_gpu", lambda name: data)
    text = hook.gpu_cost()
    assert len(tables(text)) == 2 and "Whole GRPO step" not in text and "captured-batch step is" not in text
    data["whole_step_skipped"] = "the captured-batch part took 300 s of the 420-second budget (more than half)"
    assert hook.gpu_cost().endswith("\n\nThe whole GRPO step was not timed: the captured-batch part took 300 s of the "
                                    "420-second budget (more than half).")


def test_gpu_cost_whose_profile_came_last_and_was_not_reached(hook: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The profile runs last (`rounds_finished` written when the rounds end): a run whose budget ended its rounds and
    left no time for the profile shows its rounds (the budget ended the rest) and its whole steps, and says why the
    profile is missing; one stopped in the profile by its command's time limit, or in the whole steps (no profile
    reason written), says that."""
    data = {key: value for key, value in made_up_cost().items() if key != "profile"}
    data.update(rounds=7, rounds_planned=12, warmup=1, rounds_finished=True,
                profile_skipped="the run had spent 420 s of the 480-second budget (more than 85%)")
    monkeypatch.setattr(hook, "_gpu", lambda name: data)
    text = hook.gpu_cost()
    found = tables(text)
    assert len(found) == 2 and "Where a step's time goes:" not in text
    assert "the optimizer's step; 7 rounds of the 12 planned: its `--budget` ended the rest, after 1 warm-up " \
           "round):" in text
    cost_rows(found[0][1], data["step"])
    cost_rows(found[1][1], data["whole_step"])
    assert ("\n\nWhere a step's time goes was not profiled: the run had spent 420 s of the 480-second budget (more "
            "than 85%).\n\nWhole GRPO step, generation included") in text
    data["profile_skipped"] = "the run stopped during the profile (its command's time limit)"
    assert ("\n\nWhere a step's time goes was not profiled: the run stopped during the profile (its command's time "
            "limit).\n\n") in hook.gpu_cost()
    del data["profile_skipped"]
    data.update(whole_step={}, loss_share=None,
                whole_step_skipped="the run stopped during the whole steps (its command's time limit)")
    assert hook.gpu_cost().endswith(
        "\n\nWhere a step's time goes was not profiled: the run stopped before it (its command's time limit).\n\n"
        "The whole GRPO step was not timed: the run stopped during the whole steps (its command's time limit).")


@pytest.mark.parametrize("source", ["committed", "both trainers", "on a CPU"])
def test_gpu_loss_names_its_device_and_is_each_sizes_headline(hook: Any, source: str,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The page says each section names its device first and marks a CPU run "not a GPU result": this section named
    none. The committed file is the H100's run, which its command's time limit stopped after TRL's rows."""
    data = load("docs/results/gpu/loss_overhead.json")
    if source != "committed":  # Unsloth's config trains the tiny float32 model in bf16 on CUDA
        data = {**data, "unsloth": {**data["trl"], "precision": "bf16"}, "finished": True}
        if source == "on a CPU":
            data["device"] = {"kind": "cpu", "name": "x86_64", "cores": 2}
        monkeypatch.setattr(hook, "_gpu", lambda name: data)
    text = hook.gpu_loss()
    precisions = "TRL fp32" + (", Unsloth bf16" if "unsloth" in data else "")
    assert (f"\n\nEach trainer's loss ran in its own precision ({precisions}): each ratio is against "
            "that trainer's stock loss in the same precision. The A/A interval is the end-to-end sanity row's (stock "
            "against stock, whole loss calls): the noise of that comparison, not of the decomposed ratio beside it."
            ) in text
    assert text.endswith("each size with the trainers it reached.") is (not data["finished"])
    # read by hand from the H100's TRL rows: the least added 1.558 ms (sequence_sum; none's 1.568), the most 2.733 ms
    trl = "1.56 ms (`kl_reduction=sequence_sum`) to 2.73 ms (`estimator=k3_bottom_percentile`)"
    added = f"TRL {trl}" + (f"; Unsloth {trl}" if "unsloth" in data else "")  # the made-up Unsloth rows are TRL's
    assert f" Time added to one loss call: {added}." in text
    first = text.split("\n\n")[0]
    assert first.startswith(f"The run of {data['date']} on ") and f": `{data['command']}`." in first
    assert first.endswith(f"Versions: {versions_line(data)}.")
    device = data["device"]
    if device["kind"] == "cpu":
        assert f"a CPU ({device['name']}, {device['cores']} cores; **not a GPU result**)" in first
    else:
        assert (f"on {device['name']} (compute capability {device['capability']}, CUDA {device['cuda']}, driver "
                f"{device['driver']}, bf16)") in first
        assert "not a GPU result" not in text
    header, rows = only_table(text)
    assert header == ["size", "captured batch", "trainers", "largest loss ratio", "95 % interval",
                      "A/A interval (end to end)", "rounds (95 % / A/A)", "ops added"]
    parts = [part for part in (data, data.get("large")) if part is not None and "headline" in part]
    assert [row[0] for row in rows] == ["default", "large"][:len(parts)]
    # the rounds each interval is over, which the page did not show: the script's defaults on the H100
    assert [row[6] for row in rows] == ["100 / 40"] * len(parts)
    for row, part in zip(rows, parts):
        headline = part["headline"]
        assert row[1] == size_label(part["size"])
        assert row[2] == " and ".join(name for key, name in (("trl", "TRL"), ("unsloth", "Unsloth")) if key in part)
        fixed(row[3], headline["ratio"], 3)
        interval(row[4], headline["ci"], 3)
        interval(row[5], headline["aa"], 3)
        assert row[7] == str(headline["ops_added"])


def test_gpu_loss_added_time_is_each_sizes_least_and_most(hook: Any) -> None:
    """The added milliseconds per size and trainer, the least and the most of its rows; a size without rows says
    nothing."""
    def rows(*added: tuple[str, float]) -> dict:
        return {"rows": [{"method": method, "added_s": seconds} for method, seconds in added]}

    data = {"trl": rows(("none", 0.0011), ("clip", 0.0009), ("sigmoid", 0.0031)),
            "large": {"unsloth": rows(("none", 0.0204), ("target", 0.01996))}}
    assert hook._gpu_loss_added(data) == (" Time added to one loss call: TRL 0.90 ms (`clip`) to 3.10 ms (`sigmoid`); "
                                          "Unsloth (larger size) 19.96 ms (`target`) to 20.40 ms (`none`).")
    assert hook._gpu_loss_added({"large": None}) == ""


def test_gpu_held_is_silent_for_a_run_that_reached_every_part(hook: Any) -> None:
    """A cost run with its rounds, whole steps and profile, and a loss run with both trainers at both sizes, hold every
    part: no clause; a loss run without its larger size names that (the committed one's, in the test below, also the
    trainer it did not reach)."""
    assert hook._gpu_held("cost.json", made_up_cost()) == ""
    size = {"completions": 8, "completion_length": 64}
    large = {"size": {"completions": 16, "completion_length": 256}, "trl": {"rows": []}, "unsloth": {"rows": []}}
    assert hook._gpu_held("loss_overhead.json", {"size": size, "trl": {"rows": []}, "unsloth": {"rows": []},
                                                 "large": large}) == ""
    assert hook._gpu_held("loss_overhead.json", {"size": size, "trl": {"rows": []}, "unsloth": {"rows": []}}) == (
        "; its file holds TRL at 8 completions × 64 tokens, Unsloth at 8 completions × 64 tokens, not the larger "
        "size")


@pytest.mark.parametrize("cost, loss, measured", [
    ("committed", "committed", (True, True)),  # the H100's runs, the cost at its 0.5b size
    ("cuda", "cuda", (True, True)), ("cuda small", None, (False, False)), ("cpu", "cuda", (False, True)),
    (None, "cpu", (False, False))])
def test_gpu_measured_names_the_card_of_a_cuda_run_only(hook: Any, cost: Optional[str], loss: Optional[str],
                                                        measured: tuple[bool, bool],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """benchmarks.md's and compatibility.md's sentence a measurement: "measured on" the card, date and commit only
    for a CUDA run (the cost at its 0.5b size, not its small one); a CPU run, or no file, has not been measured."""
    committed = {name: load(f"docs/results/gpu/{name}") for name in ("cost.json", "loss_overhead.json")}
    sha = "0123456789abcdef0123456789abcdef01234567"
    made = {"cuda": {"device": CUDA, "date": "2026-12-04", "size": "0.5b", "commit": sha},
            "cuda small": {"device": CUDA, "date": "2026-12-04", "size": "small", "commit": sha},
            "cpu": {"device": {"kind": "cpu", "name": "x86_64", "cores": 2}, "date": "2026-12-04", "size": "0.5b"}}
    files = {name: committed[name] if kind == "committed" else made.get(kind)
             for name, kind in (("cost.json", cost), ("loss_overhead.json", loss))}
    if loss in made:  # the loss benchmark's `size` is its batch's shape, not a model's: a made-up file has none
        files["loss_overhead.json"] = {key: value for key, value in made[loss].items() if key != "size"}
    monkeypatch.setattr(hook, "_gpu", lambda name: files[name])
    # what each file holds, read by hand: the H100's runs were stopped by their commands' time limits
    held = {("committed", "cost.json"): "; its file holds the captured-batch rounds, not the whole GRPO step or the "
                                        "profile",
            ("committed", "loss_overhead.json"): "; its file holds TRL at 8 completions × 64 tokens, not Unsloth at 8 "
                                                 "completions × 64 tokens or the larger size",
            ("cuda", "cost.json"): "; its file holds no timed part, not the captured-batch rounds or the whole GRPO "
                                   "step or the profile"}
    expected = [f"{what} was measured on {files[name]['device']['name']}, {files[name]['date']}, "
                f"{made_at(files[name])}{held.get((kind, name), '')}." if gpu else
                f"{what} has not been measured on a GPU yet."
                for (name, what), gpu, kind in zip(hook.GPU_MEASURES.items(), measured, (cost, loss))]
    assert list(hook.GPU_MEASURES) == ["cost.json", "loss_overhead.json"]
    assert hook.gpu_measured() == " ".join([*expected, "[Tested on a GPU](gpu.md) shows the last recorded runs, a CPU "
                                            "run marked as such."])


# ----- the references: configuration, anchors, versions, the demo's flags ------------------------------------------

def test_configuration_reference_rows_and_sections(hook: Any) -> None:
    """Each field's row (type, default repr, the methods that read it: FIELD_READERS, else every method) and its
    section, whose allowed values are the text after 'allowed is' of the ValueError a bad value raises (beta_max's
    without the default beta_min's value); for a field
    of the reference sync, then that of the ValueError a trainer raises for it set without a sync."""
    from unsloth_adaptive_kl import GRPOConfig
    from unsloth_adaptive_kl.core.config import FIELD_READERS, REFERENCE_SYNC_FIELDS, AdaptiveKLConfig

    text = hook.configuration()
    header, rows = only_table(text.split("\n\n### ")[0])
    assert header == ["field", "type", "default", "read by"]
    fields = dataclasses.fields(AdaptiveKLConfig)
    hints = typing.get_type_hints(AdaptiveKLConfig)
    assert [row[0] for row in rows] == [f"`{f.name}`" for f in fields]
    for field, row, section in zip(fields, rows, text.split("\n\n### ")[1:]):
        readers = ", ".join(FIELD_READERS[field.name]) if field.name in FIELD_READERS else "every method"
        type_name = hints[field.name].__name__ if isinstance(hints[field.name], type) else str(hints[field.name])
        assert row[1:] == [f"`{type_name.replace('typing.', '')}`", f"`{field.default!r}`", readers]
        with pytest.raises(ValueError) as error:
            AdaptiveKLConfig(**{field.name: object()})
        allowed = re.search(r"^- allowed: (.*)$", section, re.MULTILINE)[1]
        if field.name in REFERENCE_SYNC_FIELDS:
            allowed, without_sync = allowed.split("; only ", 1)
            with pytest.raises(ValueError) as refused:  # set without sync_ref_model, as a trainer refuses it
                GRPOConfig(output_dir="x", use_cpu=True, beta=0.04, **{field.name: 0.1 if "kl" in field.name else True})
            assert str(refused.value).endswith(f"allowed is {without_sync}.")
        # a bound the error names with its value (beta_max: "beta_min=0.0", the default) is named without it
        said = str(error.value).replace("beta_min=0.0", "beta_min") if field.name == "beta_max" else str(error.value)
        assert said.startswith(f"{field.name}=") and said.endswith(f"allowed is {allowed}.")
        assert section.startswith(f"`{field.name}`\n\n{field.metadata['help']}\n\n")
        assert f"- read by: {readers}" in section and f"default `{field.default!r}`" in section


def test_anchors_tested_versions_and_demo_flags(hook: Any) -> None:
    from packaging.specifiers import SpecifierSet

    from unsloth_adaptive_kl.integrations import versions
    from unsloth_adaptive_kl.tools.demo import LOGGED, build_parser

    for which, found in ((None, versions.TRL_ANCHORS), ("trl", versions.TRL_ANCHORS),
                         ("unsloth", versions.UNSLOTH_ANCHORS), ("verl", versions.VERL_ANCHORS)):
        header, rows = only_table(hook.anchors(which))
        assert rows == [[f"`{a.function}`", f"`{'; '.join(map(str.strip, a.text.splitlines()))}`"
                         + (" (signature)" * bool(a.signature)), a.reason.replace("\n", " ")] for a in found], which
    header, rows = only_table(hook.tested_versions())
    tested = [(integration, name) for integration, packages in versions.TESTED.items() for name in packages]
    assert header == ["integration", "package", "tested range"]
    assert [row[:2] for row in rows] == [[versions.INTEGRATION_NAMES[integration], f"`{name}`"]
                                         for integration, name in tested]
    for (integration, name), row in zip(tested, rows):  # the same range, its lower bound first
        assert SpecifierSet(row[2].strip("`")) == versions.TESTED[integration][name]
        assert "," not in row[2] or row[2].startswith("`>")
    header, rows = only_table(hook.demo_flags())
    actions = [a for a in build_parser()._actions if a.option_strings and a.dest != "help"]
    assert [row[0] for row in rows] == [", ".join(f"`{flag}`" for flag in a.option_strings) for a in actions]
    for action, row in zip(actions, rows):
        assert row[1] == ("" if action.default is None or action.default is False or action.default == ""
                          else f"`{action.default}`")
        assert row[2].startswith(action.help or "")
        if action.choices:
            assert row[2].endswith(f" One of {', '.join(map(str, action.choices))}.")
    logged = hook.demo_logged()  # demo.md's list of the metrics the demo keeps: each of demo.LOGGED, in its order
    assert re.findall(r"`([^`]+)`", logged) == list(LOGGED) and logged.count(", ") == len(LOGGED) - 1


def test_render_passes_each_markers_argument(hook: Any) -> None:
    """A marker's argument reaches its generator, on a line of its own or inside a sentence; an unknown name fails."""
    from unsloth_adaptive_kl.integrations import versions

    page = hook.render("Before.\n\n<!-- generated: anchors verl -->\n\nIt took <!-- generated-inline: "
                       "loss_overhead_max large --> at most.\n")
    assert all(f"`{a.text}`" in page for a in versions.VERL_ANCHORS)
    assert not any(f"`{a.text}`" in page for a in versions.TRL_ANCHORS)
    percent = re.search(r"It took (\S+) % at most\.", page)[1]
    fixed(percent, (load("benchmarks/loss_overhead.json")["large"]["headline"]["ratio"] - 1) * 100, 1)
    with pytest.raises(KeyError):
        hook.render("<!-- generated: no_such_block -->")


def test_a_value_selector_with_two_conditions_and_the_effective_beta_of_one_trainer_lab_row(hook: Any) -> None:
    """`rows[recipe=defaults&setting=...]` selects the one row both name (a recipe's and a setting's), and
    `kl_lab_effective_beta TRAINER:RECIPE:SETTING` renders that row's effective beta as the lab's tables do ("beyond
    pi*" where the policy ended further from the reference than every optimum)."""
    lab = load("docs/results/kl_lab_trl.json")["trainers"]["trl"]

    def row(recipe: str, setting: str) -> dict:
        (found,) = [r for r in lab["rows"] if r["recipe"] == recipe and r["setting"] == setting]
        return found

    for recipe, setting in (("defaults", "k1 in the reward"), ("dr_grpo", "k3 in the loss (the trainer's own)"),
                            ("defaults", "k3 in the loss (the trainer's own)")):
        shown = hook.value(f"docs/results/kl_lab_trl.json:trainers.trl.rows[recipe={recipe}&setting={setting}]"
                           ".train.length:.3f")
        assert shown == f"{row(recipe, setting)['train']['length']:.3f}"
        beta = row(recipe, setting)["train"]["effective_beta"]
        assert hook.kl_lab_effective_beta(f"trl:{recipe}:{setting}") == ("beyond pi*" if beta is None else f"{beta:.3g}")
    # the words of choosing-a-setting.md: at TRL's defaults a loss-side beta acts far weaker than its value (stock's
    # k3 and sigmoid beyond every optimum), the summed k1 in the reward as its value, and stock's k3 as about its value
    # without the group scaling (the dr_grpo recipe)
    given = lab["beta"]
    for setting in ("k3 in the loss (the trainer's own)", "sigmoid in the loss"):
        assert row("defaults", setting)["train"]["effective_beta"] is None
    assert row("defaults", "length_normalized in the loss")["train"]["effective_beta"] < 0.75 * given
    assert row("defaults", "k1 in the reward")["train"]["effective_beta"] == pytest.approx(given, rel=0.05)
    assert row("dr_grpo", "k3 in the loss (the trainer's own)")["train"]["effective_beta"] == pytest.approx(given,
                                                                                                          rel=0.05)
    # "their mean lengths ... against ... with no KL": longer than the summed k1's, shorter than no KL's
    for setting in ("k3 in the loss (the trainer's own)", "sigmoid in the loss", "length_normalized in the loss"):
        length = row("defaults", setting)["train"]["length"]
        assert row("defaults", "k1 in the reward")["train"]["length"] < length < row("defaults", "beta = 0 (no KL)")[
            "train"]["length"]
