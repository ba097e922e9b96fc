"""MkDocs hook: the parts of the docs that code can produce are generated at build time, so they cannot drift.

A page asks for one with a line of its own, `<!-- generated: NAME [ARGUMENT] -->`, or inside a sentence,
`<!-- generated-inline: NAME [ARGUMENT] -->`; the hook replaces it with the Markdown that `GENERATORS[NAME](ARGUMENT)`
returns. An unknown name fails the build. Sources:
- `configuration`: `AdaptiveKLConfig`'s fields (type, default, help), what its validation allows (the text of the
  ValueError it raises for a bad value) and `read_by` (the core's `FIELD_READERS`);
- `tested_versions`, `anchors`: `versions.TESTED` and the source anchors each integration checks;
- `demo_flags`, `demo_logged`: the demo's argparse parser, the metrics it keeps (`demo.LOGGED`);
- `loss_overhead`, `loss_overhead_sanity`, `loss_overhead_end_to_end`, `benchmark_headline` (each with `large` for
  the larger size),
  `loss_overhead_shares`, `loss_overhead_summary TRAINER[:large]`, `core_op`, `core_op_profile`, `steps`,
  `steps_against_aa`, `unsloth_steps`, `ref_sync_cost`, `verl_loss`: `benchmarks/*.json`;
- `demo_results NAME`, `demo_value RUN:VARIANT:KEY:DIGITS[:std]`, `demo_drifted RUN:VARIANT`:
  `docs/results/NAME/summary.json`, written by the demo;
- `value FILE:PATHS:FORMAT`: one figure (or the range of several) of any committed results file;
- `ci_record`: `docs/results/ci.json`, the record `.ci/run` writes (`.ci-record.json`);
- `gpu_check`, `gpu_check_summary`, `gpu_cost`, `gpu_loss`, `gpu_measured`, `gpu_untested`: `docs/results/gpu/*.json`,
  written by `.ci/gpu/run`;
- `kl_lab ENVIRONMENT`, `kl_lab_target`, `kl_lab_estimators`, `kl_lab_run`, `kl_lab_tables_show`,
  `kl_lab_target_reading`:
  `docs/results/kl_lab.json`, written by the KL lab (the sentences are `tabular_findings`');
- `kl_lab_trainer NAME`, `kl_lab_findings NAME`, `kl_lab_effective_beta NAME:RECIPE:SETTING`, `kl_lab_side_by_side`,
  `kl_lab_differences`, `kl_lab_pad_is_eos`:
  `docs/results/kl_lab_NAME.json` (trl, unsloth, unsloth_pad_is_eos), written by the KL lab through the trainers
  (`--trainer`); the findings' sentences are `trainer_lab.findings` and its neighbours.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import typing
from pathlib import Path
from typing import Any, Callable, Optional

ROOT = Path(__file__).resolve().parents[2]
MARKER = re.compile(r"^<!-- generated: (?P<name>[a-z_]+)(?: (?P<argument>\S+))? -->$", re.MULTILINE)
# a generated phrase inside a sentence: `<!-- generated-inline: NAME [ARGUMENT] -->`, on one line; the argument may hold
# spaces (a `value` selector naming a KL lab setting: `rows[setting=k3 in the loss]`)
INLINE = re.compile(r"<!-- generated-inline: (?P<name>[a-z_]+)(?: (?P<argument>\S(?:.*?\S)?))? -->")

EVERY_METHOD = "every method"


def read_by(name: str) -> tuple[str, ...]:
    """The methods (or the estimator) that read an `AdaptiveKLConfig` field: the core's `FIELD_READERS`, every method
    for the fields it does not list. The configuration reference prints it; tests/test_docs.py holds each field's help
    text to it."""
    from unsloth_adaptive_kl.core.config import FIELD_READERS

    return FIELD_READERS.get(name, (EVERY_METHOD,))


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_cell(value) for value in row) + " |" for row in rows]
    return "\n".join(lines)


def _type_name(annotation: Any) -> str:
    return annotation.__name__ if isinstance(annotation, type) else str(annotation).replace("typing.", "")


def allowed_values(name: str) -> str:
    """What validation allows for `name`: the 'allowed is ...' part of the ValueError a bad value raises; for a field
    of the reference sync, also the part of the error the field set without a sync raises (the trainers' own)."""
    from unsloth_adaptive_kl.core.config import REFERENCE_SYNC_FIELDS, AdaptiveKLConfig

    try:
        AdaptiveKLConfig(**{name: object()})
    except ValueError as error:
        message = str(error)
        if message.startswith(f"{name}="):
            allowed = message.split("allowed is ", 1)[1].rstrip(".")
            for field in dataclasses.fields(AdaptiveKLConfig):  # a bound's rule, not its default value's (beta_max:
                allowed = allowed.replace(f"{field.name}={field.default!r}", field.name)  # "beta_min=0.0")
            if name not in REFERENCE_SYNC_FIELDS:
                return allowed
            try:
                AdaptiveKLConfig(**{name: True if name.endswith("optimizer") else 0.1}).refuse_sync_settings(
                    "with sync_ref_model=False", "set sync_ref_model=True to sync the reference")
            except ValueError as refused:
                return f"{allowed}; only {str(refused).split('allowed is ', 1)[1].rstrip('.')}"
    raise AssertionError(f"AdaptiveKLConfig accepted a bad value for {name}: no allowed values to document")


def configuration(_: Optional[str] = None) -> str:
    """One row per `AdaptiveKLConfig` field, in declaration order."""
    from unsloth_adaptive_kl.core.config import AdaptiveKLConfig

    hints = typing.get_type_hints(AdaptiveKLConfig)
    fields = dataclasses.fields(AdaptiveKLConfig)
    summary = _table(["field", "type", "default", "read by"],
                     [[f"`{f.name}`", f"`{_type_name(hints[f.name])}`", f"`{f.default!r}`", ", ".join(read_by(f.name))]
                      for f in fields])
    sections = [f"### `{f.name}`\n\n{f.metadata['help']}\n\n- type: `{_type_name(hints[f.name])}`, default "
                f"`{f.default!r}`\n- allowed: {allowed_values(f.name)}\n- read by: {', '.join(read_by(f.name))}"
                for f in fields]
    return "\n\n".join([summary, *sections])


def tested_versions(_: Optional[str] = None) -> str:
    from unsloth_adaptive_kl.integrations.versions import INTEGRATION_NAMES, TESTED, tested_range

    return _table(["integration", "package", "tested range"],
                  [[INTEGRATION_NAMES[integration], f"`{name}`", f"`{tested_range(name, integration)}`"]
                   for integration, packages in TESTED.items() for name in packages])


def anchors(which: Optional[str] = None) -> str:
    """The source anchors of one integration (`trl`, `unsloth` or `verl`): where each is looked up, its text, why."""
    from unsloth_adaptive_kl.integrations import versions

    found = {"trl": versions.TRL_ANCHORS, "unsloth": versions.UNSLOTH_ANCHORS,
             "verl": versions.VERL_ANCHORS}[which or "trl"]
    return _table(["in", "anchor", "why"],
                  [[f"`{a.function}`", f"`{anchor_line(a.text)}`" + (" (signature)" if a.signature else ""), a.reason]
                   for a in found])


def anchor_line(text: str) -> str:
    """An anchor's text in one table cell: the lines of one of several lines (consecutive in the source) joined by
    `; `, as Python would read them on one line."""
    return "; ".join(line.strip() for line in text.splitlines())


def demo_flags(_: Optional[str] = None) -> str:
    from unsloth_adaptive_kl.tools.demo import build_parser

    rows = []
    for action in build_parser()._actions:
        if not action.option_strings or action.dest == "help":
            continue
        default = "" if action.default in (None, "", False) else f"`{action.default}`"
        choices = f" One of {', '.join(map(str, action.choices))}." if action.choices else ""
        rows.append([", ".join(f"`{flag}`" for flag in action.option_strings), default,
                     (action.help or "") + choices])
    return _table(["flag", "default", "what it does"], rows)


def demo_logged(_: Optional[str] = None) -> str:
    """The metrics the demo keeps per step (`demo.LOGGED`), inline."""
    from unsloth_adaptive_kl.tools.demo import LOGGED

    return ", ".join(f"`{name}`" for name in LOGGED)


def _commit(data: dict) -> str:
    """The commit a results file ran at (its `commit`, from `source_commit`), for the sentence saying how it was made;
    a file written outside a checkout, or before results recorded one, says that it did not record it."""
    if not data.get("commit"):
        return "at a commit it did not record"
    sha, _, changes = data["commit"].partition("+")  # "+changes": tracked files differed from it
    return f"at commit `{sha[:7]}`" + (" with uncommitted changes" if changes else "")


def _benchmark(name: str) -> dict:
    return json.loads((ROOT / "benchmarks" / name).read_text())


def _loss_overhead_part(size: Optional[str]) -> dict:
    """loss_overhead.json's default size, or its larger one (`large`)."""
    data = _benchmark("loss_overhead.json")
    if size in (None, "default"):
        return data
    if size != "large":
        raise ValueError(f"loss_overhead size {size!r}: allowed is 'large' or nothing")
    return data["large"]


# The loss benchmark's trainers: the key of each one's part in its JSON, and its name on a page
TRAINERS = (("trl", "TRL"), ("unsloth", "Unsloth"))


def _size_label(part: dict) -> str:
    size = part["size"]
    return f"{size['completions']} completions × {size['completion_length']} tokens"


def loss_overhead(size: Optional[str] = None) -> str:
    data = _loss_overhead_part(size)
    trainers = [name for name in ("trl", "unsloth") if data.get(name)]
    by_method: dict[str, dict[str, dict]] = {}
    for trainer in trainers:
        for row in data[trainer]["rows"]:
            by_method.setdefault(row["method"], {})[trainer] = row
    header = ["method"]
    for trainer in trainers:
        label = {"trl": "TRL", "unsloth": "Unsloth"}[trainer]
        header += [f"{label}: added ms", f"{label}: stock ms", f"{label}: overhead [95 %]", f"{label}: ops added"]
    rows = []
    for method, cells in by_method.items():
        row = [f"`{method}`"]
        for trainer in trainers:
            r = cells.get(trainer)
            row += (["", "", "", ""] if r is None else
                    [f"{r['added_s'] * 1e3:.3f}", f"{r['stock_s'] * 1e3:.1f}",
                     f"{r['ratio']:.4f} [{r['ci'][0]:.4f}, {r['ci'][1]:.4f}]", r["ops_added"]])
        rows.append(row)
    return _table(header, rows)


def benchmark_headline(size: Optional[str] = None) -> str:
    part = _loss_overhead_part(size)
    h, total = part["headline"], _benchmark("loss_overhead.json")["large"]["headline"]["seconds"]
    suffix = "_large" if size == "large" else ""
    return (f"`max_loss_overhead_ratio{suffix}={h['ratio']:.3f} ci=[{h['ci'][0]:.3f},{h['ci'][1]:.3f}] "
            f"aa=[{h['aa'][0]:.3f},{h['aa'][1]:.3f}] ops_added={h['ops_added']}` "
            f"({h['trainer']}, `{h['method']}`, {_size_label(part)}; {total:.0f} s for the whole run, "
            f"{_commit(_benchmark('loss_overhead.json'))})")


def loss_overhead_summary(argument: Optional[str] = None) -> str:
    """One trainer's rows at one size in a sentence: `TRAINER` or `TRAINER:large`."""
    trainer, _, size = (argument or "trl").partition(":")
    rows = _loss_overhead_part(size or None)[trainer]["rows"]
    ratios = [row["ratio"] for row in rows]
    added = [row["added_s"] * 1e3 for row in rows]
    ops = [row["ops_added"] for row in rows]
    stock = [row["stock_s"] * 1e3 for row in rows]
    within = sum(ratio <= 1.01 for ratio in ratios)
    return (f"{min(ratios):.4f} to {max(ratios):.4f} ({within} of {len(rows)} rows within 1.01), adding "
            f"{min(added):.2f}-{max(added):.2f} ms and {min(ops)}-{max(ops)} aten ops to a {min(stock):.0f}-"
            f"{max(stock):.0f} ms loss")


def loss_overhead_max(size: Optional[str] = None) -> str:
    """The largest overhead of any row at one size, in per cent."""
    return f"{(_loss_overhead_part(size)['headline']['ratio'] - 1) * 100:.1f} %"


def loss_overhead_seconds(_: Optional[str] = None) -> str:
    return f"{_benchmark('loss_overhead.json')['large']['headline']['seconds']:.0f} s"


def loss_overhead_shares(_: Optional[str] = None) -> str:
    """Per method and trainer: the added time and the overhead at both sizes (the share falls with size)."""
    data = _benchmark("loss_overhead.json")
    small, large = _size_label(data), _size_label(data["large"])
    label = {"trl": "TRL", "unsloth": "Unsloth"}
    rows = [[label[s["trainer"]], f"`{s['method']}`",
             f"{s['added_s'] * 1e3:.3f} → {s['added_s_large'] * 1e3:.3f}",
             f"{s['stock_s'] * 1e3:.1f} → {s['stock_s_large'] * 1e3:.1f}",
             f"{s['overhead'] * 100:.2f} → {s['overhead_large'] * 100:.2f}",
             f"{s['ops_added']} → {s['ops_added_large']}"] for s in data["shares"]]
    return _table(["trainer", "method", f"added ms ({small} → {large})", "stock loss ms", "overhead %",
                   "ops added"], rows)


def loss_overhead_sanity(size: Optional[str] = None) -> str:
    """Each trainer's stock loss timing and its end-to-end sanity row (heaviest method against stock, with A/A)."""
    data = _loss_overhead_part(size)
    rows = []
    for trainer, label in (("trl", "TRL"), ("unsloth", "Unsloth's generated trainer")):
        if not data.get(trainer):
            continue
        stock, e2e = data[trainer]["stock_loss_s"], data[trainer]["end_to_end"]
        rows.append([label, f"{stock['median'] * 1e3:.1f} (min {stock['min'] * 1e3:.1f}, max {stock['max'] * 1e3:.1f}, "
                     f"n={stock['n']})", f"`{e2e['method']}`",
                     f"{e2e['ratio']:.3f} [{e2e['ci'][0]:.3f}, {e2e['ci'][1]:.3f}]",
                     f"{e2e['aa']:.3f} [{e2e['aa_ci'][0]:.3f}, {e2e['aa_ci'][1]:.3f}]",
                     "yes" if e2e["consistent"] else "no"])
    return _table(["trainer", "stock loss ms, forward + backward", "heaviest method", "end to end x stock [95 %]",
                   "A/A [95 %]", "consistent with the decomposition"], rows)


def loss_overhead_end_to_end(size: Optional[str] = None) -> str:
    """What each sanity row says of the decomposition at one size: the heaviest method's end-to-end ratio against
    its decomposed one, and whether the gap lies within the A/A interval's half-width (`consistent`) or above or
    below it."""
    data = _loss_overhead_part(size)
    said = []
    for trainer, label in TRAINERS:
        if not data.get(trainer):
            continue
        e2e = data[trainer]["end_to_end"]
        decomposed = next(row["ratio"] for row in data[trainer]["rows"] if row["method"] == e2e["method"])
        reading = ("within the A/A half-width of" if e2e["consistent"] else
                   "above" if e2e["ratio"] > decomposed else "below")
        said.append(f"{label}'s `{e2e['method']}` measured {e2e['ratio']:.3f} [{e2e['ci'][0]:.3f}, "
                    f"{e2e['ci'][1]:.3f}] end to end, {reading} its decomposed {decomposed:.3f}")
    return "; ".join(said)


def core_op(_: Optional[str] = None) -> str:
    rows = _benchmark("loss_overhead.json")["core_op"]
    stock = next(r for r in rows if r["method"] == "stock k3")
    body = [[f"`{r['method']}`", f"{r['median_ms']:.3f}", f"{r['x_k3']:.2f}", r["ops"]]
            for r in rows if r is not stock]
    return (_table(["method", "k3 + adaptation, median ms", "x stock k3", "aten ops added"], body)
            + f"\n\nStock k3 expression alone: {stock['median_ms']:.3f} ms.")


def core_op_profile(_: Optional[str] = None) -> str:
    """Where `none`'s core op spends its time: the aten ops with the most self time, with their shares (those that
    round to 1 % or more)."""
    ops = [op for op in _benchmark("loss_overhead.json")["core_op_profile"] if round(op["share"] * 100) >= 1]
    return ", ".join(f"`{op['op']}` {op['share'] * 100:.0f} %" for op in ops)


def _counts(values: list[int]) -> str:
    """The distinct counts a run's steps made, each: "34", or "10 or 18" where steps differed."""
    return " or ".join(map(str, values))


def steps(_: Optional[str] = None) -> str:
    data = _benchmark("overhead_cpu.json")
    rows = [[r["variant"], f"{r['median_step_s']:.4f}", f"{r['step_ratio']:.3f}",
             _counts(r["forwards_per_step"]), r["extra_forwards"],
             f"{r['peak_memory_bytes'] / 2 ** 20:.1f}", f"{r['memory_ratio']:.3f}",
             "" if r["core_ratio"] is None else f"{r['core_ratio']:.2f}"] for r in data["rows"]]
    aa = _aa_interval(data)
    s = data["settings"]
    return (_table(["variant", "s/step", "x stock", "forwards/step", "extra forwards", "run's peak RSS MiB", "x stock",
                    "core op x k3"], rows)
            + "\n\nA/A interval of the step ratio (stock against stock): "
            + (f"[{aa[0]:.3f}, {aa[1]:.3f}]" if aa else NO_AA) + ". Settings: "
            f"hidden {s['hidden']}, {s['layers']} layers, batch {s['batch']}, {s['completion_length']}-token "
            f"completions, {s['steps']} steps x {s['repeats']} timed passes, device `{data['device']}`, "
            f"`{data['command']}` {_commit(data)}." + _no_core_op(data["rows"]))


def _no_core_op(rows: list[dict]) -> str:
    """Which rows' core op cell is blank, and why: stock is the k3 the ratio is against; another variant is not one
    of the core op's methods (`benchmarks/loss_overhead.py`'s)."""
    from unsloth_adaptive_kl.tools.tabular_findings import names_in_code

    blank = [r["variant"] for r in rows if r["core_ratio"] is None and not r["variant"].startswith("stock")]
    return (" The core op is blank for stock (its k3 is what the ratio is against)"
            + (f" and for {names_in_code(blank)}, which are not among the core op's methods" if blank else "") + ".")


NO_AA = "none (one timed pass)"


def _aa_interval(data: dict) -> Optional[tuple[float, float]]:
    """The step benchmark's A/A interval, or None where the run timed one pass (NaN ends: no interval to place a
    ratio against)."""
    low, high = data["aa_interval"]
    return (low, high) if math.isfinite(low) and math.isfinite(high) else None


def steps_against_aa(_: Optional[str] = None) -> str:
    """Which variants' step ratio lies inside the step benchmark's A/A interval, and which outside it."""
    data = _benchmark("overhead_cpu.json")
    aa = _aa_interval(data)
    if aa is None:
        return f"no variant is placed against an A/A interval: it has {NO_AA}"
    low, high = aa
    rows = [r for r in data["rows"] if not r["variant"].startswith("stock")]
    inside = [f"`{r['variant']}` ({r['step_ratio']:.3f})" for r in rows if low <= r["step_ratio"] <= high]
    outside = [f"`{r['variant']}` ({r['step_ratio']:.3f})" for r in rows if not low <= r["step_ratio"] <= high]
    return f"inside it {', '.join(inside) or 'no variant'}; outside it {', '.join(outside) or 'no variant'}"


def unsloth_steps(_: Optional[str] = None) -> str:
    rows = [[r["variant"], f"{r['median_step_s']:.4f}", f"{r['step_ratio']:.3f}",
             _counts(r["forwards_per_step"]), r["graphs_added_per_run"]]
            for r in _benchmark("overhead_cpu.json")["unsloth_rows"]]
    return _table(["variant", "s/step", "x stock", "forwards/step", "compiled graphs added during a run"], rows)


def ref_sync_cost(_: Optional[str] = None) -> str:
    """Reference sync on against off, measured side by side in the step benchmark's run."""
    data = _benchmark("overhead_cpu.json")
    r, aa = data["ref_sync"], _aa_interval(data)
    against_aa = (f"A/A interval: {NO_AA}" if aa is None else "inside the A/A interval: not resolved"
                  if aa[0] <= r["step_ratio"] <= aa[1] else "outside the A/A interval")
    rows = [
        ["extra forwards per step (sync on against stock)", r["extra_forwards"]],
        ["memory of the reference copy", f"{r['copy_bytes']:,} bytes in {r['copy_tensors']} tensors "
         f"(the adapter: {r['adapter_bytes']:,} bytes; ratio {r['bytes_to_adapter_ratio']:.3f})"],
        ["extra memory during an exchange (largest tensor)", f"{r['exchange_temp_bytes']:,} bytes"],
        ["one sync (alpha = 1), median", f"{r['sync_seconds_median'] * 1e3:.3f} ms = "
         f"{r['sync_to_step_ratio']:.2e} x the stock step ({r['stock_step_seconds_median']:.3f} s)"],
        ["one exchange (swap in + swap back), median", f"{r['exchange_seconds_median'] * 1e3:.3f} ms = "
         f"{r['exchange_to_step_ratio']:.2e} x the stock step"],
        ["initial copy (once, when training starts)", f"{r['copy_seconds_median'] * 1e3:.2f} ms"],
        [f"added per step ({r['syncs_per_run']} syncs, {r['exchanges_per_run']} exchanges per run)",
         f"{r['added_seconds_per_step'] * 1e3:.3f} ms = {r['added_to_step_ratio']:.2e} x the stock step"],
        [f"whole step, sync on against stock ({against_aa})",
         f"{r['step_seconds_median']:.3f} s / {r['stock_step_seconds_median']:.3f} s = {r['step_ratio']:.3f}"],
    ]
    return _table(["measured (`ref_model_sync_steps=1`, alpha 1.0, LoRA)", "value"], rows)


def verl_loss(_: Optional[str] = None) -> str:
    """verl's actor loss with adaptive KL against its stock loss (benchmarks/verl_loss.py)."""
    data = _benchmark("verl_loss.json")
    rows = [[f"`{r['method']}`", f"{r['median_ms']:.3f}", f"{r['ratio']:.3f}", f"[{r['ci'][0]:.3f}, {r['ci'][1]:.3f}]"]
            for r in data["rows"]]
    return (_table(["loss", "forward + backward, median ms", "x stock", "95 % interval"], rows)
            + f"\n\nStock `ppo_loss` with its KL term: {data['stock_ms']:.3f} ms. One micro-batch of "
            f"{data['responses']} responses of {data['response_length'] // 2} to {data['response_length']} tokens "
            f"after {data['prompt_length']}-token prompts, {data['repeats']} interleaved rounds, one CPU thread "
            f"(verl {data['verl']}, torch {data['torch']}). Made by `{data['command']}` on {data['date']}, "
            f"{data['machine']}, {_commit(data)}.")


def _values_at(data: Any, path: list[str]) -> list[Any]:
    """The values at a dotted path in JSON data: `key` (an index for a list), `key[]` every item of its list,
    `key[field=text]` the items of its list whose `field` reads `text` (`key[a=x&b=y]`: both hold)."""
    if not path:
        return [data]
    key, _, selector = path[0].rstrip("]").partition("[")
    found = data[int(key)] if isinstance(data, list) else data[key]
    if "[" in path[0]:
        conditions = [condition.partition("=")[::2] for condition in selector.split("&") if condition]
        found = [item for item in found if all(str(item.get(field)) == text for field, text in conditions)]
    else:
        found = [found]
    return [v for item in found for v in _values_at(item, path[1:])]


def value(argument: Optional[str] = None) -> str:
    """A figure of a committed results file inside a sentence: `FILE:PATHS:FORMAT`, FILE relative to the repository,
    PATHS dotted keys (`rows[]` every item of the list `rows`, `rows[variant=stock]` those whose `variant` is `stock`;
    several paths joined by `,`), FORMAT a format spec (`,` for `557,056`, `.3f`, `.0%`). Several values give their
    range, "min-max" (one figure where they are equal). No value, or a null one, fails the build."""
    file, rest = str(argument).split(":", 1)
    paths, style = rest.rsplit(":", 1)
    data = json.loads((ROOT / file).read_text())
    found, path = [], []
    # dotted keys, paths joined by ',': split outside brackets (a selector's text may hold dots, commas and colons)
    for part, separator in re.findall(r"((?:[^.,\[]|\[[^\]]*\])+)([.,]?)", paths):
        path.append(part)
        if separator != ".":
            found += _values_at(data, path)
            path = []
    if not found or any(v is None for v in found):
        raise ValueError(f"value {argument}: {found or 'nothing'} at that path")
    low, high = f"{min(found):{style}}", f"{max(found):{style}}"
    return low if low == high else f"{low}-{high}"


CI_VERSIONS = ("python", "torch", "trl", "transformers", "datasets", "unsloth")
CI_OTHERS = ("torchao", "liger-kernel", "tinker", "verl")


def _minutes(seconds: float) -> str:
    return f"{int(seconds // 60)} min {int(seconds % 60)} s"


def ci_record(_: Optional[str] = None) -> str:
    """docs/results/ci.json, the record `.ci/run` writes: each row's versions and result, and how the run was made."""
    data = json.loads((ROOT / "docs" / "results" / "ci.json").read_text())
    rows = []
    for row in data["rows"]:
        versions = row["versions"]
        result = re.sub(r", \d+ warnings?", "", row["result"].split(" in ")[0])  # pytest's counts, or what ran
        if result.startswith("mkdocs"):
            result += f" (mkdocs {versions['mkdocs']}, mkdocs-material {versions['mkdocs-material']})"
        took = _minutes(row["pytest_seconds"]) if row["pytest_seconds"] is not None else ""
        others = ", ".join(f"{name} {version}" for name, version in versions.items() if name in CI_OTHERS)
        name, _, detail = row["row"].partition(" ")  # "e (the wheel's file name)", "h (resolution)"
        rows.append([f"({name}) {detail.strip('()')}".strip(), *(versions.get(n, "none") for n in CI_VERSIONS), others,
                     f"{result}: exit {row['exit']}", took, _minutes(row["ended_at"])])
    machine = data["machine"]
    return (_table(["row", *CI_VERSIONS, "also", "result", "pytest", "ended at"], rows)
            + f"\n\nRun on {data['date']} from a clean clone of `{data['commit'][:7]}`, on {machine['cores']} cores "
            f"({machine['cpu']}, {machine['arch']}): {_minutes(data['seconds'])} in all, exit {data['exit']}. "
            "The rows with `pytest` run tests; the others run the self-check, a resolution or the docs build.")


def self_check(name: Optional[str] = None) -> str:
    """docs/results/NAME (selfcheck.json by default), written by `python -m unsloth_adaptive_kl --json ...`: what the
    self-check printed, with the versions and the machine it ran on."""
    data = json.loads((ROOT / "docs" / "results" / (name or "selfcheck.json")).read_text())
    installed = ", ".join(f"{package} {version}" for package, version in data["versions"].items())
    return (f"Its output on {data['date']} with {installed}, on a {data['hardware']} (`{data['command']}`, "
            f"{_commit(data)}):\n\n"
            "```text\n" + "\n".join(data["lines"]) + "\n```")


RESULT_COLUMNS = (("reward", "reward", 2), ("completions/mean_length", "completion length", 1),
                  ("adaptive_kl/raw_kl", "raw KL", 3), ("adaptive_kl/adapted_kl", "adapted KL", 3),
                  ("adaptive_kl/sequence_kl", "KL per completion", 2))


def _seeds(counts: tuple[int, int]) -> str:
    """One variant's (K, N) of the demo's `drifted_seeds`, as "K of N seeds"."""
    return f"{counts[0]} of {counts[1]} seeds"


def demo_results(name: Optional[str] = None) -> str:
    """The demo's summary table of one committed run, with the command, versions and hardware that produced it; where
    the run has stock, `beta=0` and each seed's figures, how many seeds of each variant let the length drift."""
    from unsloth_adaptive_kl.tools.demo import drifted_seeds

    data = json.loads((ROOT / "docs" / "results" / str(name) / "summary.json").read_text())
    drifted = drifted_seeds(data["summary"])  # empty for a run without them
    rows = []
    for item in data["summary"]:
        row = [f"`{item['method']}`"]
        for key, _, digits in RESULT_COLUMNS:
            mean, std = item[key]
            # null: never logged, as beta=0 has no KL term (and no reference model) to measure
            row.append("(off)" if mean is None else f"{mean:.{digits}f} +/- {std:.{digits}f}")
        beta = item["adaptive_kl/current_beta"][0]
        row.append("0 (off)" if beta is None else f"{beta:.2g}")
        rows.append(row + ([_seeds(drifted[item["method"]])] if drifted else []))
    table = _table(["variant", *(title for _, title, _ in RESULT_COLUMNS), "beta at the end",
                    *(["length drifted in"] if drifted else [])], rows)
    env = data.get("environment", {})
    versions = ", ".join(f"{package} {version}" for package, version in env.get("versions", {}).items())
    command = re.sub(r" --output-dir \S+", "", env.get("command", ""))  # where it wrote is not what it measured
    return (f"{table}\n\nCommand: `{command}`, {_commit(env)}. Versions: {versions}. Hardware: "
            f"{env.get('hardware', '')}. Wall time: {data['wall_seconds']:.0f} s. Values: mean +/- std over "
            f"{data['settings']['seeds']} seeds of each seed's mean over the last {data.get('window', 12)} steps.")


def demo_drifted(argument: Optional[str] = None) -> str:
    """How many seeds of a committed demo run's variant let the length drift, inside a sentence: `RUN:VARIANT` gives
    "K of N seeds" (the demo's `drifted_seeds`)."""
    from unsloth_adaptive_kl.tools.demo import drifted_seeds

    run, variant = str(argument).split(":", 1)
    data = json.loads((ROOT / "docs" / "results" / run / "summary.json").read_text())
    return _seeds(drifted_seeds(data["summary"])[variant])


def demo_value(argument: Optional[str] = None) -> str:
    """One figure of a committed demo run, inside a sentence: `RUN:VARIANT:KEY:DIGITS[:std]` is the mean over seeds of
    KEY (a summary column: reward, completions/mean_length, adaptive_kl/raw_kl, ...) for VARIANT in
    `docs/results/RUN/summary.json`, with DIGITS decimals (or a format such as `0e`); `:std` adds the seed-to-seed std
    ("7.5 +/- 1.3")."""
    run, rest = str(argument).split(":", 1)
    std = rest.endswith(":std")
    variant, key, digits = rest.removesuffix(":std").rsplit(":", 2)  # a variant may hold ':' (reward:sequence_sum)
    data = json.loads((ROOT / "docs" / "results" / run / "summary.json").read_text())
    mean, spread = next(item for item in data["summary"] if item["method"] == variant)[key]
    style = digits if digits[-1].isalpha() else f"{digits}f"  # '2' -> 2 decimals; '0e' -> '6e-07'
    return f"{mean:.{style}}" + (f" +/- {spread:.{style}}" if std else "")


def _kl_lab() -> dict:
    return json.loads((ROOT / "docs" / "results" / "kl_lab.json").read_text())


def kl_lab(environment: Optional[str] = None) -> str:
    """The KL lab's table for one environment (`docs/results/kl_lab.json`, written by the lab), one table a group."""
    from unsloth_adaptive_kl.tools.tabular_lab import HEADER, markdown, table_rows

    table = _kl_lab()["tables"][environment]
    return "\n\n".join(f"**{group}**\n\n{markdown(HEADER, rows)}" for group, rows in table_rows(table))


def kl_lab_estimators(_: Optional[str] = None) -> str:
    """Each estimator's exact expectation against the KL (`tabular_lab.estimator_expectations`)."""
    from unsloth_adaptive_kl.tools.tabular_lab import estimator_rows, markdown

    header = ["estimator", "\\( \\mathbb{E}_\\pi[\\sum_t k_t] \\)", "minus the KL",
              "std of \\( \\sum_t k_t \\) over \\( y \\sim \\pi \\)"]
    return markdown(header, estimator_rows(_kl_lab()["estimators"]))


def kl_lab_target(_: Optional[str] = None) -> str:
    """The KL lab's `target` runs against beta*."""
    from unsloth_adaptive_kl.tools.tabular_lab import TARGET_HEADER, markdown, target_rows

    result = _kl_lab()["target"]
    return (f"tau = KL(pi*_beta || pi_ref) = {result['tau']:.4f}, so beta* = {result['beta_star']:.4f}; beta_0 = "
            f"{result['beta_0']}, {result['training']['steps']} steps at a constant learning rate.\n\n"
            + markdown(TARGET_HEADER, target_rows(result)))


def kl_lab_run(_: Optional[str] = None) -> str:
    """How the committed lab run was made."""
    result = _kl_lab()
    training = next(iter(result["tables"].values()))["training"]
    seeds = ", ".join(str(seed) for seed in next(iter(result["tables"].values()))["seeds"])
    return (f"Made by `{result['command']}` (torch {result['torch']}, {result['seconds']:.0f} s on "
            f"{result['machine']}, {_commit(result)}): "
            f"{training['groups']} groups of {training['group_size']} completions a step, {training['steps']} steps, "
            f"Adam at {training['learning_rate']} decayed linearly to 0, seeds {seeds} averaged "
            "(a spread in KL(pi||pi*) above 0.05 between seeds is shown beside it).")


def kl_lab_tables_show(_: Optional[str] = None) -> str:
    """What the KL lab's two tables show (`tabular_findings.findings`), every figure computed from them."""
    from unsloth_adaptive_kl.tools.tabular_findings import findings

    return "\n".join(f"- {finding}" for finding in findings(_kl_lab()))


def kl_lab_target_reading(_: Optional[str] = None) -> str:
    """Each `target` run's beta against beta* (`tabular_findings.target_reading`)."""
    from unsloth_adaptive_kl.tools.tabular_findings import target_reading

    return "\n".join(f"- {reading}" for reading in target_reading(_kl_lab()["target"]))


def _lab_through(trainer: str) -> dict:
    return json.loads((ROOT / "docs" / "results" / f"kl_lab_{trainer}.json").read_text())


def kl_lab_trainer(name: Optional[str] = None) -> str:
    """The KL lab through one trainer (`docs/results/kl_lab_NAME.json`, written by `kl_lab --trainer ...`): how it was
    made, then one table a recipe."""
    from unsloth_adaptive_kl.tools.tabular_lab import markdown
    from unsloth_adaptive_kl.tools.trainer_lab import HEADER, describe, trainer_rows

    result = _lab_through(str(name))
    (table,) = result["trainers"].values()
    versions = ", ".join(f"{name} {version}" for name, version in result["versions"].items() if version)
    made = (f"Made by `{result['command']}` ({versions}; {result['seconds']:.0f} s on "
            f"{result.get('machine', 'a CPU')}, {_commit(result)}): {describe(table)}.")
    return "\n\n".join([made, *(f"**{recipe}**\n\n{markdown(HEADER, rows)}" for recipe, rows in trainer_rows(table))])


def kl_lab_side_by_side(_: Optional[str] = None) -> str:
    """TRL and Unsloth on the same GRPOConfig: KL(pi||pi*) and the effective beta of each, with the tabular lab's
    prediction for each trainer's masking, for every recipe and setting both ran."""
    from unsloth_adaptive_kl.tools.tabular_lab import markdown
    from unsloth_adaptive_kl.tools.trainer_lab import side_by_side_rows

    return markdown(*side_by_side_rows(_lab_through("trl")["trainers"]["trl"],
                                       _lab_through("unsloth")["trainers"]["unsloth"]))


def kl_lab_effective_beta(argument: Optional[str] = None) -> str:
    """One row's effective beta through a trainer, inside a sentence: `TRAINER:RECIPE:SETTING` gives the beta its
    policy acted as (mean over seeds), or "beyond pi*" where it ended further from the reference than every optimum."""
    from unsloth_adaptive_kl.tools.trainer_lab import _beta

    trainer, recipe, setting = str(argument).split(":", 2)
    (table,) = _lab_through(trainer)["trainers"].values()
    (row,) = [row for row in table["rows"] if row["recipe"] == recipe and row["setting"] == setting]
    return _beta(row["train"]["effective_beta"])


def kl_lab_findings(name: Optional[str] = None) -> str:
    """What one trainer's table shows (`trainer_lab.findings`), as a list whose every figure is computed from it."""
    from unsloth_adaptive_kl.tools.trainer_lab import findings

    (table,) = _lab_through(str(name))["trainers"].values()
    return "\n".join(f"- {finding}" for finding in findings(table))


def kl_lab_differences(_: Optional[str] = None) -> str:
    """Unsloth against TRL on the same GRPOConfig (`trainer_lab.differences`)."""
    from unsloth_adaptive_kl.tools.trainer_lab import differences

    return "\n".join(f"- {finding}" for finding in differences(_lab_through("trl")["trainers"]["trl"],
                                                                 _lab_through("unsloth")["trainers"]["unsloth"]))


def kl_lab_pad_is_eos(_: Optional[str] = None) -> str:
    """The pad = EOS row against TRL's and Unsloth's own (`trainer_lab.pad_is_eos_finding`), inside a sentence."""
    from unsloth_adaptive_kl.tools.trainer_lab import pad_is_eos_finding

    return pad_is_eos_finding(*(_lab_through(name)["trainers"][trainer] for name, trainer in (
        ("unsloth_pad_is_eos", "unsloth"), ("trl", "trl"), ("unsloth", "unsloth"))))


# ----- tested on a GPU: docs/results/gpu/ (.ci/gpu/run writes it; .ci/gpu/dry-run on a CPU) ------------------------

def _gpu(name: str) -> Optional[dict]:
    path = ROOT / "docs" / "results" / "gpu" / name
    return json.loads(path.read_text()) if path.exists() else None


def _device(data: dict) -> str:
    device = data["device"]
    if device["kind"] == "cuda":
        return (f"{device['name']} (compute capability {device['capability']}, CUDA {device['cuda']}, driver "
                f"{device['driver'] or 'not read'}, {device['precision']})")
    return f"a CPU ({device['name']}, {device['cores']} cores; **not a GPU result**)"


def _versions(data: dict) -> str:
    """The versions a GPU results file records, this package's with the commit it ran at."""
    versions = {name: version for name, version in data["versions"].items() if version}
    if "unsloth_adaptive_kl" in versions:
        versions["unsloth_adaptive_kl"] += f" ({_commit(data)})"
    return ", ".join(f"{name} {version}" for name, version in versions.items())


def gpu_check(_: Optional[str] = None) -> str:
    """docs/results/gpu/check.json: each scenario's lines, or that it did not run."""
    data = _gpu("check.json")
    if data is None:
        return "No run of the GPU check is recorded in docs/results/gpu/check.json."
    kind = "dry run (each scenario's CPU equivalent)" if data["dry_run"] else "run"
    rows = [["the tiny Llama", "", "<br>".join(_check_line(c) for c in data["model"])]]
    for name, scenario in data["scenarios"].items():
        if not scenario["ran"]:
            rows.append([f"`{name}`", "", f"not run: {scenario['why']}"])
        else:
            rows.append([f"`{name}`", f"{scenario['seconds']:.0f}",
                         "<br>".join(_check_line(c) for c in scenario["checks"])])
    return (f"The {kind} of {data['date']} on {_device(data)}: `{data['command']}`, {data['seconds']:.0f} s in all. "
            f"Versions: {_versions(data)}. {gpu_untested()}\n\n" + _table(["scenario", "seconds", "checks"], rows))


def gpu_untested(_: Optional[str] = None) -> str:
    """Which versions of docs/results/gpu/check.json lie outside `versions.TESTED` (the CPU matrix's ranges) of the
    integrations installed there, in a sentence: the GPU machine's image is not chosen by this project."""
    from packaging.version import Version

    from unsloth_adaptive_kl.integrations.versions import BROUGHT_BY, TESTED, in_tested_range, tested_ranges

    data = _gpu("check.json")
    if data is None:
        return ""
    here = tuple(name for name, package in BROUGHT_BY.items() if data["versions"].get(package) is not None)
    found = {name: Version(data["versions"][name]) for name in dict.fromkeys(p for i in here for p in TESTED[i])
             if data["versions"].get(name) is not None}
    outside = [f"{name} {version} (tested: `{tested_ranges(name, here)}`)" for name, version in found.items()
               if not in_tested_range(name, version, here)]
    if not outside:
        return "Each of its versions is within the tested ranges."
    return ("Outside the tested ranges: " + ", ".join(outside) + "; the GPU results were taken on a version the CPU "
            "matrix does not run.")


def gpu_check_summary(_: Optional[str] = None) -> str:
    """docs/results/gpu/check.json in a sentence: the card, the date and commit, and which scenarios passed, failed
    or did not run (and why); a dry run is said to be none."""
    data = _gpu("check.json")
    if data is None:
        return "No run of the GPU check is recorded in docs/results/gpu/check.json."
    if data["dry_run"]:
        return "No GPU run of the check is recorded: [Tested on a GPU](gpu.md) shows its dry run on a CPU."
    ran = {name: scenario for name, scenario in data["scenarios"].items() if scenario["ran"]}

    def passed(scenario: dict) -> bool:
        return bool(scenario["checks"]) and all(check["ok"] for check in scenario["checks"])  # no check: none held

    groups = {"passed": [name for name, scenario in ran.items() if passed(scenario)],
              "**failed**": [name for name, scenario in ran.items() if not passed(scenario)]}
    parts = [f"{verdict}: " + ", ".join(f"`{name}`" for name in names) for verdict, names in groups.items() if names]
    parts += [f"not run: `{name}`, {scenario['why']}" for name, scenario in data["scenarios"].items()
              if not scenario["ran"]]
    head = f"The last recorded GPU check: {data['device']['name']}, {data['date']}, {_commit(data)}"
    return "; ".join([head, *parts]) + "."


def _check_line(check: dict) -> str:
    status = "**FAIL**" if not check["ok"] else "untested" if check.get("untested") else "ok"  # as the check prints it
    text = check["name"] + (f": {check['detail']}" if check["detail"] else "")
    return f"{status}: " + text.replace("*", "\\*")  # a star (the guard's KL(pi||pi*)) would open an emphasis


def gpu_cost(_: Optional[str] = None) -> str:
    """docs/results/gpu/cost.json (benchmarks/unsloth_cost.py): each variant against stock Unsloth."""
    data = _gpu("cost.json")
    if data is None:
        return "No run of benchmarks/unsloth_cost.py is recorded in docs/results/gpu/cost.json."
    size = data["settings"]
    model = size["model"]

    def rows(part: dict) -> list[list[str]]:
        # under 5 timed rounds (the whole step: 1 at the 0.5b size, 2 at the small one) a bootstrap of the median
        # takes a handful of values: no interval is shown
        return [[f"`{name}`", f"{row['median_s'] * 1e3:.1f}", f"{row['ratio']:.3f}",
                 "the reference" if name == "stock" else
                 f"none ({_rounds_of(row['n'])}: too few to resample)" if row.get("n", 5) < 5
                 else f"[{row['ci'][0]:.3f}, {row['ci'][1]:.3f}]",
                 "" if not row["memory_ratio"] else f"{row['peak_bytes'] / 2 ** 20:,.0f}",
                 "" if not row["memory_ratio"] else f"{row['memory_ratio']:.3f}",
                 "" if not row.get("working_memory_ratio") else f"{row['working_bytes'] / 2 ** 20:,.0f}",
                 "" if not row.get("working_memory_ratio") else f"{row['working_memory_ratio']:.3f}"]
                for name, row in part.items()]

    # peak: all that is allocated at the step's peak (the model and optimizer state included); working: that peak
    # above what was allocated when the step began
    header = ["variant", "median ms", "x stock", "95 % interval", "peak MiB", "x stock", "working MiB", "x stock"]

    def table(part: dict) -> str:
        """The part's rows; without memory columns where no row measured memory (a CPU run: columns of blanks)."""
        if any(row["memory_ratio"] for row in part.values()):
            return _table(header, rows(part))
        return _table(header[:4], [row[:4] for row in rows(part)]) + "\n\n" + NO_MEMORY

    share = "" if data.get("loss_share") is None else (
        f" The captured-batch step is {data['loss_share']:.0%} of stock's whole step.")
    text = (f"The `--size {data['size']}` run of {data['date']} on {_device(data)}: `{data['command']}`. Model: "
            f"hidden {model['hidden_size']}, {model['num_hidden_layers']} layers, vocabulary {model['vocab_size']:,}, "
            f"LoRA r{size['lora_rank']}; {size['prompts']} prompts × {size['completions']} completions of "
            f"{size['length']} tokens. Versions: {_versions(data)}.")
    if "step" not in data:  # the file written at the start: the run was stopped before a timed round ended
        reached = ", ".join(f"{name} at {seconds:.0f} s" for name, seconds in data.get("phases", {}).items())
        return text + ("\n\n**The run stopped before its first timed round** (its command's time limit)"
                       + (f"; it reached: {reached}" if reached else "") + ".")
    text += (f"\n\nCaptured batch (`compute_loss` forward and backward, then the optimizer's step; {_rounds(data)}):"
             "\n\n" + table(data["step"]) + "\n\n" + _cost_against_aa(data["step"]))
    if data.get("rounds_finished") is False:  # stopped in its rounds
        return text + ("\n\n**The run stopped before its end** (its command's time limit): the table holds the "
                       "rounds that had finished; the profile and the whole steps were not reached.")
    if "rounds_finished" not in data and "profile" not in data:
        # a file from before the key was written (the H100's first run: the profile then came before the whole steps,
        # and the run's log, not its file, says it was stopped in it)
        return text + (f"\n\n**The run stopped before its end** (its command's time limit): its file was last "
                       f"written {data['seconds']:.0f} s into the run, after the last of these rounds, and holds "
                       "neither the profile nor the whole steps.")
    if "profile" in data:
        text += _cost_profile(data)
    else:
        reason = data.get("profile_skipped", "the run stopped before it (its command's time limit)")
        text += f"\n\nWhere a step's time goes was not profiled: {reason}."
    if data.get("whole_step"):
        # the rounds run (a budget can end them before those planned)
        text += (f"\n\nWhole GRPO step, generation included ({_rounds_of(data['whole_step']['stock']['n'])}):\n\n"
                 + table(data["whole_step"]) + "\n\n" + share.strip())
    elif data.get("whole_step_skipped"):
        text += f"\n\nThe whole GRPO step was not timed: {data['whole_step_skipped']}."
    return text


def _cost_against_aa(rows: dict) -> str:
    """The A/A pair's interval (stock against stock: the noise of these rounds), and the methods whose own interval
    leaves out 1.000 (the only ones the rounds tell from stock)."""
    low, high = rows["stock (A/A)"]["ci"]
    apart = [f"`{name}` [{row['ci'][0]:.3f}, {row['ci'][1]:.3f}]" for name, row in rows.items()
             if not name.startswith("stock") and not row["ci"][0] <= 1.0 <= row["ci"][1]]
    return (f"The A/A pair's interval, [{low:.3f}, {high:.3f}], is the noise of these rounds. "
            + ("Every method's interval holds 1.000: these rounds tell no method from stock." if not apart else
               f"The intervals that leave out 1.000: {', '.join(apart)}; every other method's holds it."))


def _cost_profile(data: dict) -> str:
    """cost.json's profile, a paragraph and its table: torch.profiler's self time per step of the operations that
    take the most in stock's step or in that of the method with the largest ratio."""
    profile = data["profile"]
    times = {name: {op["name"]: op["self_us"] for op in profile[part]}
             for name, part in (("stock", "stock"), (profile["method"], "heaviest"))}
    names = list(dict.fromkeys([*times["stock"], *times[profile["method"]]]))
    clock = "GPU" if data["device"]["kind"] == "cuda" else "CPU"
    return (f"\n\nWhere a step's time goes: torch.profiler's self time per step ({clock} time, µs) of the "
            f"operations that take the most in stock's step or in that of `{profile['method']}` (the largest "
            f"ratio above); a blank cell is an operation outside that step's top {len(profile['stock'])}:\n\n"
            + _table(["operation", "stock", f"`{profile['method']}`"],
                     [[f"`{name}`", *(f"{times[k][name]:,.0f}" if name in times[k] else "" for k in times)]
                      for name in names]))


NO_MEMORY = ("No memory columns: these rows measured none (the peak is read from "
             "`torch.cuda.max_memory_allocated`, on CUDA only).")


def _rounds(data: dict) -> str:
    """The captured batch's timed rounds, and those left out: by the budget in a run that finished them
    (`rounds_finished` true), by the run's stop in one that did not (false); a file from before `rounds_finished`
    was written does not say which, and one from before `rounds_planned` was recorded ran them all."""
    rounds, planned, finished = data["rounds"], data.get("rounds_planned", data["rounds"]), data.get("rounds_finished")
    if rounds == planned:
        left_out = ""
    elif finished:
        left_out = f" of the {planned} planned: its `--budget` ended the rest"
    elif finished is False:
        left_out = f" so far, of the {planned} planned"
    else:
        left_out = f" of the {planned} planned"
    return f"{_rounds_of(rounds)}{left_out}, after {data['warmup']} warm-up round{'s' * (data['warmup'] != 1)}"


def _rounds_of(count: int) -> str:
    return f"{count} round{'s' * (count != 1)}"


GPU_MEASURES = {
    "cost.json": "The cost of each method in an Unsloth step at Qwen2.5-0.5B's size (`benchmarks/unsloth_cost.py`)",
    "loss_overhead.json": "The loss benchmark on CUDA (`benchmarks/loss_overhead.py`)",
}


def gpu_measured(_: Optional[str] = None) -> str:
    """Whether the GPU page's measurements (docs/results/gpu/cost.json, loss_overhead.json) come from a GPU, a
    sentence each: a CPU run, or the cost at its small size, is said to be no such measurement."""
    sentences = []
    for name, what in GPU_MEASURES.items():
        data = _gpu(name)
        if data is not None and data["device"]["kind"] == "cuda" and data.get("size") != "small":
            sentences.append(f"{what} was measured on {data['device']['name']}, {data['date']}, {_commit(data)}"
                             f"{_gpu_held(name, data)}.")
        else:
            sentences.append(f"{what} has not been measured on a GPU yet.")
    return " ".join(sentences) + " [Tested on a GPU](gpu.md) shows the last recorded runs, a CPU run marked as such."


def _gpu_held(name: str, data: dict) -> str:
    """What a GPU run's file holds, where its run did not reach every part: "; its file holds A, not B or C" (a run
    its command's time limit stopped keeps what had finished)."""
    if name == "cost.json":
        parts = {"the captured-batch rounds": "step" in data, "the whole GRPO step": bool(data.get("whole_step")),
                 "the profile": "profile" in data}
    else:
        sizes = [part for part in (data, data.get("large")) if part and "size" in part]
        parts = {f"{label} at {_size_label(part)}": bool(part.get(trainer)) for part in sizes
                 for trainer, label in TRAINERS}
        if len(sizes) == 1:
            parts["the larger size"] = False
    held, missing = [part for part, kept in parts.items() if kept], [part for part, kept in parts.items() if not kept]
    return "" if not missing else f"; its file holds {', '.join(held) or 'no timed part'}, not {' or '.join(missing)}"


def gpu_loss(_: Optional[str] = None) -> str:
    """docs/results/gpu/loss_overhead.json (benchmarks/loss_overhead.py, run by .ci/gpu/run loss): the headlines,
    and what the run did not reach (the larger size skipped for its budget, a run stopped before its end)."""
    data = _gpu("loss_overhead.json")
    if data is None:
        return "No run of benchmarks/loss_overhead.py is recorded in docs/results/gpu/loss_overhead.json."
    rows = []
    for label, part in (("default", data), ("large", data.get("large"))):
        if part is None or "headline" not in part:
            continue
        headline = part["headline"]
        trainers = " and ".join(name for trainer, name in TRAINERS if trainer in part)
        repeats = part.get("repeats")  # a file written before they were recorded has none
        rows.append([label, _size_label(part), trainers, f"{headline['ratio']:.3f}",
                     f"[{headline['ci'][0]:.3f}, {headline['ci'][1]:.3f}]", f"[{headline['aa'][0]:.3f}, "
                     f"{headline['aa'][1]:.3f}]",
                     "not recorded" if repeats is None else f"{repeats['methods']} / {repeats['end_to_end']}",
                     headline["ops_added"]])
    precisions = ", ".join(f"{label} {data[trainer]['precision']}" for trainer, label in TRAINERS
                           if data.get(trainer))
    missing = ""
    if data.get("large_skipped"):
        missing = f" The larger size was not run: {data['large_skipped']}."
    elif not data.get("finished", True):
        missing = (" **The run stopped before its end** (its command's time limit): the table holds what had "
                   "finished, each size with the trainers it reached.")
    return (f"The run of {data['date']} on {_device(data)}: `{data['command']}`. Versions: {_versions(data)}.\n\n"
            + _table(["size", "captured batch", "trainers", "largest loss ratio", "95 % interval",
                      "A/A interval (end to end)", "rounds (95 % / A/A)", "ops added"], rows)
            + f"\n\nEach trainer's loss ran in its own precision ({precisions}): each ratio is against that trainer's "
              "stock loss in the same precision. The A/A interval is the end-to-end sanity row's (stock against "
              "stock, whole loss calls): the noise of that comparison, not of the decomposed ratio beside it."
            + _gpu_loss_added(data) + missing)


def _gpu_loss_added(data: dict) -> str:
    """The time the methods add to one loss call, the least and the most, per size and trainer (in milliseconds: the
    ratios' denominators are a tiny model's losses)."""
    parts = []
    for label, part in (("", data), (" (larger size)", data.get("large") or {})):
        for trainer, name in TRAINERS:
            if (part.get(trainer) or {}).get("rows"):  # a trainer's rows: the methods timed
                rows = sorted(part[trainer]["rows"], key=lambda row: row["added_s"])
                parts.append(f"{name}{label} {rows[0]['added_s'] * 1e3:.2f} ms (`{rows[0]['method']}`) to "
                             f"{rows[-1]['added_s'] * 1e3:.2f} ms (`{rows[-1]['method']}`)")
    return f" Time added to one loss call: {'; '.join(parts)}." if parts else ""


GENERATORS: dict[str, Callable[[Optional[str]], str]] = {
    "kl_lab_trainer": kl_lab_trainer,
    "kl_lab_findings": kl_lab_findings,
    "kl_lab_effective_beta": kl_lab_effective_beta,
    "kl_lab_differences": kl_lab_differences,
    "kl_lab_pad_is_eos": kl_lab_pad_is_eos,
    "kl_lab_side_by_side": kl_lab_side_by_side,
    "kl_lab": kl_lab,
    "kl_lab_target": kl_lab_target,
    "kl_lab_estimators": kl_lab_estimators,
    "kl_lab_tables_show": kl_lab_tables_show,
    "kl_lab_target_reading": kl_lab_target_reading,
    "kl_lab_run": kl_lab_run,
    "configuration": configuration,
    "tested_versions": tested_versions,
    "anchors": anchors,
    "demo_flags": demo_flags,
    "demo_logged": demo_logged,
    "loss_overhead": loss_overhead,
    "benchmark_headline": benchmark_headline,
    "loss_overhead_summary": loss_overhead_summary,
    "loss_overhead_shares": loss_overhead_shares,
    "loss_overhead_seconds": loss_overhead_seconds,
    "loss_overhead_max": loss_overhead_max,
    "loss_overhead_sanity": loss_overhead_sanity,
    "loss_overhead_end_to_end": loss_overhead_end_to_end,
    "core_op": core_op,
    "core_op_profile": core_op_profile,
    "steps": steps,
    "steps_against_aa": steps_against_aa,
    "unsloth_steps": unsloth_steps,
    "ref_sync_cost": ref_sync_cost,
    "verl_loss": verl_loss,
    "demo_results": demo_results,
    "demo_value": demo_value,
    "demo_drifted": demo_drifted,
    "value": value,
    "ci_record": ci_record,
    "self_check": self_check,
    "gpu_check": gpu_check,
    "gpu_check_summary": gpu_check_summary,
    "gpu_untested": gpu_untested,
    "gpu_cost": gpu_cost,
    "gpu_loss": gpu_loss,
    "gpu_measured": gpu_measured,
}


def render(markdown: str) -> str:
    """Replace every generated-content marker of a page; an unknown name is an error."""
    def replace(match: re.Match) -> str:
        name = match["name"]
        if name not in GENERATORS:
            raise KeyError(f"unknown generated block {name!r}: known are {', '.join(GENERATORS)}")
        return optimum_stars_kept(GENERATORS[name](match["argument"]))

    return INLINE.sub(replace, MARKER.sub(replace, markdown))


CODE = re.compile(r"(```.*?```|`[^`\n]*`)", re.DOTALL)


def optimum_stars_kept(markdown: str) -> str:
    """`pi*` and `beta*` (the optimum and its beta) in generated prose escaped: two in one paragraph would open and
    close an emphasis, hiding both stars and italicising the words between. Code, fenced or between backticks, is
    left as it is."""
    return "".join(part if part.startswith("`") else re.sub(r"\b(pi|beta)\*", r"\1\\*", part)
                   for part in CODE.split(markdown))


def on_page_markdown(markdown: str, **_: Any) -> str:  # MkDocs hook
    return render(markdown)
