"""The docs cannot rot: every Python block of README.md and docs/ runs (or, where it needs a GPU and a download, is
compiled and its imports checked), the metrics page lists exactly the keys a real run logs, every config field's
help names the methods that read it, and the strict site build passes, with every generated reference in it, and
fails on a broken anchor."""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import importlib
import importlib.util
import io
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, NamedTuple, Optional

import pytest

from .conftest import at_the_test_commands_versions, built_in_registries, make_trainer, pyproject
from unsloth_adaptive_kl.core.config import FIELD_READERS, METHODS, AdaptiveKLConfig

ROOT = Path(__file__).resolve().parents[1]


def docs_generator() -> Any:
    """docs/hooks/generated.py, the MkDocs hook (not a package: loaded from its file), which renders the configuration
    reference."""
    spec = importlib.util.spec_from_file_location("docs_generated", ROOT / "docs" / "hooks" / "generated.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module

FENCE = re.compile(r"^```(?P<lang>[\w+-]*)[^\n]*\n(?P<body>.*?)^```$", re.MULTILINE | re.DOTALL)
NO_RUN = re.compile(r"<!-- no-run: (?P<reason>.+) -->\s*$")
# Between a block and its output: what it prints depends on the versions (a training run's sampling and arithmetic),
# and the page shows it with the test command's versions, those of docs/results/ci.json's row a.
VERSIONED = "<!-- output with the test command's versions -->"
# Unsloth insists on being imported first and takes over the process: its blocks' imports are checked in a child.
SEPARATE_PROCESS_MODULES = {"unsloth", "unsloth_zoo", "vllm"}
# An integration's own package, and our module that needs it: their names are checked where its extra is installed
# (tests/test_tinker.py checks the Tinker page's imports in CI row g).
EXTRA_MODULES = {"tinker": ("tinker", "unsloth_adaptive_kl.integrations.tinker")}


class Block(NamedTuple):
    path: Path
    line: int
    code: str
    no_run: str  # the reason, or "" for a block that runs
    shown: Optional[str] = None  # the `text` block right after it (blank lines between): what the page says it prints
    at_row_a: bool = False  # `shown` is what it prints with the test command's versions (a VERSIONED marker between)

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").rglob("*.md") if "hooks" not in p.parts)]


def python_blocks(path: Path) -> list[Block]:
    text = path.read_text()
    blocks = []
    for match in FENCE.finditer(text):
        if match["lang"] not in ("python", "py"):
            continue
        line = text.count("\n", 0, match.start()) + 1
        before = text[:match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        reason = NO_RUN.search(before)
        rest = text[match.end():].lstrip("\n")
        at_row_a = rest.startswith(VERSIONED)
        rest = rest[len(VERSIONED):].lstrip("\n") if at_row_a else rest
        after = FENCE.match(text, len(text) - len(rest))  # the next block, blank lines (and the marker) between
        shown = after["body"] if after and after["lang"] == "text" else None
        blocks.append(Block(path, line, match["body"], reason["reason"] if reason else "", shown, at_row_a))
    return blocks


BLOCKS = [block for path in doc_files() for block in python_blocks(path)]


def test_the_docs_have_python_blocks_to_check() -> None:
    """The collection above finds the blocks: README's TRL quickstart runs, its Unsloth quickstart is no-run."""
    readme = [block for block in BLOCKS if block.path.name == "README.md"]
    assert any(not b.no_run and "GRPOTrainer(" in b.code for b in readme)
    assert any(b.no_run and "FastLanguageModel" in b.code for b in readme)
    assert len({block.path for block in BLOCKS}) >= 5


# Hugging Face's Trainer prints each log as a dict (its PrinterCallback, with disable_tqdm=True): a page shows what
# its own code prints and leaves those out.
TRAINER_LOG = re.compile(r"^\{'.*\}$")
TRAINING_VERSIONS = ("torch", "trl", "transformers", "accelerate", "peft", "datasets")


@pytest.mark.parametrize("block", [b for b in BLOCKS if not b.no_run], ids=lambda b: b.id)
def test_python_block_runs(block: Block, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every block runs on its own (the package's built-in names alone); where the page shows its output (a `text`
    block right after it), it prints exactly that, the trainer's own log lines aside; output marked VERSIONED, where
    the installed versions are the test command's."""
    monkeypatch.chdir(tmp_path)
    printed = io.StringIO()
    with built_in_registries(), contextlib.redirect_stdout(printed):
        exec(compile(block.code, block.id, "exec"), {"__name__": "__main__"})
    if block.shown is None or block.at_row_a and not at_the_test_commands_versions(TRAINING_VERSIONS):
        return
    # line by line, as the page indents it (a block inside a list is indented)
    lines = [line.strip() for line in printed.getvalue().strip().splitlines()]
    assert [line for line in lines if not TRAINER_LOG.match(line)] == [
        line.strip() for line in block.shown.strip().splitlines()]


def test_some_blocks_show_their_output() -> None:
    """The comparison above has blocks to compare."""
    assert len([block for block in BLOCKS if block.shown is not None and not block.no_run]) >= 5


def imported_names(code: str) -> list[tuple[str, list[str]]]:
    """(module, names imported from it) for every import statement of a block."""
    found = []
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            found += [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.append((node.module, [alias.name for alias in node.names]))
    return found


NO_RUN_BLOCKS = [b for b in BLOCKS if b.no_run]


@pytest.mark.parametrize("block", NO_RUN_BLOCKS, ids=lambda b: b.id)
def test_no_run_block_compiles_and_its_imports_resolve(block: Block) -> None:
    """A block that needs a GPU and a download still compiles, and everything it imports exists (Unsloth's names
    are checked in a child process below)."""
    compile(block.code, block.id, "exec")
    for module, names in imported_names(block.code):
        if module.split(".")[0] in SEPARATE_PROCESS_MODULES:
            continue
        if any(module.startswith(prefixes) and importlib.util.find_spec(package) is None
               for package, prefixes in EXTRA_MODULES.items()):
            continue
        imported = importlib.import_module(module)
        missing = [name for name in names if not hasattr(imported, name)
                   and importlib.util.find_spec(f"{module}.{name}") is None]
        assert not missing, f"{block.id}: {module} has no {missing}"


def test_unsloth_names_the_no_run_blocks_import_exist(tmp_path: Path) -> None:
    """`from unsloth import FastLanguageModel` and the like, imported after this package as the docs say, in a child
    process on the CPU path of the test harness."""
    statements = sorted({f"from {module} import {', '.join(names)}" if names else f"import {module}"
                         for block in NO_RUN_BLOCKS for module, names in imported_names(block.code)
                         if module.split(".")[0] in SEPARATE_PROCESS_MODULES})
    assert statements, "the Unsloth quickstart imports unsloth"
    if importlib.util.find_spec("unsloth") is None:
        if os.environ.get("ADAPTIVE_KL_REQUIRE_UNSLOTH"):
            pytest.fail("Unsloth is not installed")
        pytest.skip("Unsloth is not installed (the TRL-only rows of the CI matrix)")
    script = "import unsloth_adaptive_kl\n" + "\n".join(statements) + "\nprint('imported')\n"
    env = dict(os.environ, UNSLOTH_ALLOW_CPU="1", UNSLOTH_COMPILE_DISABLE="1", UNSLOTH_DISABLE_STATISTICS="1")
    result = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0 and "imported" in result.stdout, result.stderr[-3000:]


# ----- facts the docs state, held to the code ---------------------------------------------------------------------

def documented_metric_keys() -> set[str]:
    text = (ROOT / "docs" / "metrics.md").read_text()
    return set(re.findall(r"^\| `(adaptive_kl/[a-z_]+)`", text, re.MULTILINE))


def test_metrics_page_lists_exactly_the_keys_real_runs_log(tokenizer: Any, tmp_path: Path) -> None:
    """One run per way of logging (clip in the loss; KL in the reward; reference syncing where the package has it)
    logs the union of every adaptive_kl/ key; the metrics page's table lists that set, no more, no less."""
    runs = [dict(kl_adaptation_method="clip"), dict(kl_placement="reward", kl_reduction="sequence_sum")]
    if "ref_model_sync_kl" in {f.name for f in dataclasses.fields(AdaptiveKLConfig)}:
        runs.append(dict(sync_ref_model=True, ref_model_sync_steps=1, ref_model_mixup_alpha=1.0))
    keys: set[str] = set()
    for index, overrides in enumerate(runs):
        trainer = make_trainer(tokenizer, str(tmp_path / str(index)), **overrides)
        trainer.train()
        keys |= {key for entry in trainer.state.log_history for key in entry if key.startswith("adaptive_kl/")}
    assert keys and documented_metric_keys() == keys


def test_every_config_field_has_help_naming_the_methods_that_read_it() -> None:
    generator = docs_generator()
    for field in dataclasses.fields(AdaptiveKLConfig):
        help_text = field.metadata.get("help", "")
        assert len(help_text) > 20, f"{field.name} has no help text"
        for reader in generator.read_by(field.name):
            if reader == generator.EVERY_METHOD:
                assert "every method" in help_text.lower() or all(f"'{m}'" in help_text for m in METHODS), field.name
            else:
                assert f"`{reader}`" in help_text, f"{field.name}'s help does not name `{reader}`, which reads it"
    assert set(FIELD_READERS) < {field.name for field in dataclasses.fields(AdaptiveKLConfig)}


# ----- the site ---------------------------------------------------------------------------------------------------

def mkdocs_build(config: Path, site: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)],
                          capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    site = tmp_path_factory.mktemp("site")
    result = mkdocs_build(ROOT / "mkdocs.yml", site)
    assert result.returncode == 0, result.stderr[-5000:]
    return site


def test_site_has_every_page_of_the_nav(site: Path) -> None:
    pages = re.findall(r":\s+(\S+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(), re.MULTILINE)
    required = {"install", "quickstart-unsloth", "quickstart-trl", "choosing-a-setting", "methods", "estimators",
                "kl-in-reward", "metrics", "configuration", "results", "compatibility", "scaling-out", "benchmarks",
                "troubleshooting", "papers", "contributing", "changelog"}
    assert required <= {page[:-3] for page in pages}
    for page in pages:
        built = site / ("index.html" if page == "index.md" else page[:-3] + "/index.html")
        assert built.is_file(), page


def test_configuration_reference_lists_every_field_with_its_default(site: Path) -> None:
    html = (site / "configuration" / "index.html").read_text()
    for field in dataclasses.fields(AdaptiveKLConfig):
        row = re.search(rf"<tr>\s*<td><code>{field.name}</code></td>(.*?)</tr>", html, re.DOTALL)
        assert row, f"{field.name} is missing from the configuration reference"
        assert f"<code>{field.default!r}</code>".replace("'", "&#39;") in row[1] or \
            f"<code>{field.default!r}</code>" in row[1], f"{field.name}: default {field.default!r} not shown"
        assert f'id="{field.name}"' in html, f"{field.name} has no section of its own (help, allowed values)"


def test_a_nested_list_is_indented_four_spaces() -> None:
    """MkDocs' Markdown nests a list item under another only where it is indented 4 spaces: one indented 1 to 3 is the
    outer list's next item (the GPU page's wheelhouse list was rendered flat, three bullets beside their heading)."""
    shallow = re.compile(r"^ {1,3}(?:[-*+]|\d+\.) ")
    found = [f"{path.relative_to(ROOT)}: {line}" for path in doc_files() if path.parent != ROOT
             for line in FENCE.sub("", path.read_text()).splitlines() if shallow.match(line)]
    assert not found


def test_no_generated_marker_survives_the_build(site: Path) -> None:
    leftovers = [page for page in site.rglob("*.html") if "<!-- generated" in page.read_text()]
    assert not leftovers


def test_a_generated_optimum_keeps_its_stars_and_a_formula_its_underscores(site: Path) -> None:
    """Two generated `pi*` in one paragraph opened and closed an emphasis that hid both stars ("KL(pi_beta || pi_ref)
    ... so beta = 0.5000" in italics); MathJax shows `\\_` inside `\\text{}` as a backslash and an underscore, so a
    field's name in a formula is set in `\\mathrm{}`."""
    html = (site / "ground-truth" / "index.html").read_text()
    assert "tau = KL(pi*_beta || pi_ref) = " in html and ", so beta* = " in html
    assert not re.search(r"<em>[^<]*\|\| pi_ref", html)
    for page in site.rglob("*.html"):
        assert not re.search(r"\\text\{[^}]*\\_", page.read_text()), page


def test_strict_build_fails_on_a_broken_anchor(tmp_path: Path) -> None:
    for folder in ("docs", "benchmarks"):  # the pages and what they generate from
        shutil.copytree(ROOT / folder, tmp_path / folder)
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    page = tmp_path / "docs" / "methods.md"
    page.write_text(page.read_text() + "\nSee [nowhere](metrics.md#no-such-heading).\n")
    result = mkdocs_build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert result.returncode != 0 and "no-such-heading" in result.stderr


# ----- the README ---------------------------------------------------------------------------------------------------

REPOSITORY = "https://github.com/unsloth-adaptive-kl/unsloth-adaptive-kl"
DOCS_SITE = "https://unsloth-adaptive-kl.github.io/unsloth-adaptive-kl/"
RAW = "https://raw.githubusercontent.com/unsloth-adaptive-kl/unsloth-adaptive-kl/main/"


def readme_bash_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    return [m["body"].strip() for m in FENCE.finditer(text) if m["lang"] == "bash"]


def test_the_readmes_gpu_line_names_the_card_and_torch_of_the_gpu_check() -> None:
    """The README said "on an H200" where the check ran on torch 2.11, outside the tested range: the card, the torch
    and the date it names are the GPU check's (docs/results/gpu/check.json, written on the device)."""
    check = json.loads((ROOT / "docs" / "results" / "gpu" / "check.json").read_text())
    assert check["dry_run"] is False and check["device"]["kind"] == "cuda"
    card = check["device"]["name"].removeprefix("NVIDIA ")
    torch_version = ".".join(check["versions"]["torch"].split(".")[:2])
    assert f"on an {card} with torch {torch_version} on {check['date']} ([GPU]({DOCS_SITE}gpu/))" in (
        ROOT / "README.md").read_text()


def test_the_floors_rows_are_the_trl_extras_floors() -> None:
    """CI's row (k) installs each package the `trl` extra declares with a ">=" at that version (read from
    pyproject.toml by .ci/run), the torch floor first and kept by the second install, and row (d) the trl and peft
    floors on the newest torch; the compatibility page's rows name those pins, and the prose the same versions, so a
    floor raised in pyproject.toml cannot leave the page naming the old one."""
    from packaging.requirements import Requirement

    extra = pyproject()["project"]["optional-dependencies"]["trl"]
    floors = {r.name: s.version for r in map(Requirement, extra) for s in r.specifier if s.operator == ">="}
    torch_floor = floors.pop("torch")
    assert torch_floor == "2.6.0" and set(floors) == {"trl", "transformers", "datasets", "accelerate", "peft"}
    page = (ROOT / "docs" / "compatibility.md").read_text()
    rows = {line.split(" | ")[0].removeprefix("| "): line for line in page.splitlines() if line.startswith("| (")}
    assert "`" + " ".join(f"{name}=={version}" for name, version in floors.items()) + "`" in rows["(k)"]
    assert f"`uv pip install torch=={torch_floor}`" in rows["(k)"] and f"and `torch=={torch_floor}`" in rows["(k)"]
    assert f"`uv pip install trl=={floors['trl']} peft=={floors['peft']} torchao liger-kernel`" in rows["(d)"]
    prose = " ".join(page.split())
    assert (f"row (k) runs the TRL tests on trl {floors['trl']}, transformers {floors['transformers']}, datasets "
            f"{floors['datasets']}, accelerate {floors['accelerate']} and peft {floors['peft']} together, on Python "
            f"3.10 and torch {torch_floor}, the extra's torch floor, and row (d) runs trl {floors['trl']} and peft "
            f"{floors['peft']} with torchao on the newest torch and transformers") in prose
    ci = (ROOT / ".ci" / "run").read_text()
    assert '"$UV" pip install -q "$torch_floor"' in ci and 'row k "${OLD_VERSION_TESTS[@]}"' in ci
    assert '"$UV" pip install -q -e ".[test,trl]" $floors "$torch_floor"' in ci
    assert "grep -E '^(trl|peft)=='" in ci and '"$UV" pip install -q $trl_peft_floors torchao liger-kernel' in ci


def test_the_page_names_the_rows_that_install_with_uv() -> None:
    """.ci/run installs rows (a), (c), (e) and (f), which stand for commands users run with pip, with pip, and the
    others with uv: the compatibility page names the same rows, and only their lines in its table say `uv pip
    install`."""
    ci = (ROOT / ".ci" / "run").read_text()
    with_uv = set(re.findall(r"step install-(\w+) \"\$UV\" pip", ci))
    with_pip = set(re.findall(r"step install-(\w+) pip install", ci))
    assert with_uv == {"k", "b", "d", "g", "i", "h"} and with_pip == {"a", "c", "e", "f"}
    page = (ROOT / "docs" / "compatibility.md").read_text()
    prose = " ".join(page.split())
    assert "the rows that stand for no user's pip command, (k), (b), (d), (g), (i) and (h), install with" in prose
    rows = {line.split(" | ")[0].strip("|() "): line.split(" | ")[1] for line in page.splitlines()
            if line.startswith("| (")}
    assert set(rows) == with_uv | with_pip
    for name, installs in rows.items():
        assert ("`uv pip install" in installs) == (name in with_uv), name
        assert name not in with_uv or "`pip install" not in installs, name


def test_the_old_version_rows_leave_what_a_fresh_install_runs_to_rows_a_and_b() -> None:
    """Rows (k) and (d) skip the tests of the demo, the docs' code and the GPU check, and row (k)'s line on the
    compatibility page names exactly those files; rows (a) and (b) run them: (a) the whole suite, (b) every TRL test."""
    page = " ".join((ROOT / "docs" / "compatibility.md").read_text().split())
    ci = (ROOT / ".ci" / "run").read_text()
    definition = re.search(r"^OLD_VERSION_TESTS=\(\"\$\{TRL_TESTS\[@\]\}\" ([^)]*)\)", ci, flags=re.M)
    skipped = re.findall(r"--ignore=(\S+)", definition.group(1))
    assert skipped == ["tests/test_demo.py", "tests/test_docs.py", "tests/test_gpucheck.py"]
    assert "(" + ", ".join(f"`{name}`" for name in skipped) + "), which (a) and (b) run" in page
    assert 'row k "${OLD_VERSION_TESTS[@]}"' in ci and 'row d "${OLD_VERSION_TESTS[@]}"' in ci
    assert re.search(r"^row a$", ci, flags=re.M) and 'row b "${TRL_TESTS[@]}" --deselect "$TRL_LAB_GUARD"\n' in ci
    trl_tests = re.search(r"^TRL_TESTS=\(tests ([^)]*)\)", ci, flags=re.M).group(1)
    assert not set(skipped) & set(re.findall(r"--ignore=(\S+)", trl_tests))


def test_readme_is_short_and_holds_the_commands_ci_runs() -> None:
    """At most 150 lines; its test command is the one `.ci/run` runs (row a: install split from pytest so that its
    exit status can be read), and its demo command installs torch as row e does."""
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 150
    commands = readme_bash_commands()
    test = next(c for c in commands if "pytest" in c)
    demo = next(c for c in commands if "blackwell/test_adaptive_kl_grpo.py" in c)
    ci = (ROOT / ".ci" / "run").read_text()
    assert test == ("python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.14.1 torchvision==0.29.1 && "
                    'pip install -e ".[test,unsloth]" && ADAPTIVE_KL_REQUIRE_UNSLOTH=1 python -m pytest -q -n auto '
                    "--dist loadfile")
    assert "pip install -q torch==2.14.1 torchvision==0.29.1" in ci and 'pip install -q -e ".[test,unsloth]"' in ci
    assert "export ADAPTIVE_KL_REQUIRE_UNSLOTH=1" in ci and "python -m pytest -q -n auto --dist loadfile" in ci
    assert demo.startswith("python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 && ")
    assert "pip install -q torch==2.13.0" in ci


def test_readme_methods_column_says_what_the_committed_demo_run_shows() -> None:
    """README's "on the demo task" column against the committed runs (docs/results/default, and options for `target`),
    seed by seed: a seed's length drifted where it is nearer the mean of the drift without a KL (`beta=0`) than that
    of stock (`none`). A method "holds length" where no seed drifted, else "length drifted in K of N seeds" with the
    run's own counts (its words "in most seeds" / "in some seeds" called 1 of 10 as 5 of 10); it "costs reward" where
    its mean reward is below stock's by more than both runs' spreads over seeds. A mean over seeds alone would call a variant that
    drifted in a few seeds by a lot as drifting as one that drifted in all."""
    def means(run: str) -> dict[str, dict[str, list[float]]]:
        return {row["method"]: row for row in json.loads((ROOT / f"docs/results/{run}/summary.json").read_text())["summary"]}

    default, options = means("default"), means("options")
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("|---|", readme.index("## Methods")):]  # the rows under the header
    rows = re.findall(r"^\| `(\w+)`(?: \(default\))? \|[^\n]*\| ([a-z0-9 ]+) \|$", table, re.M)
    assert [method for method, _ in rows] == ["none", "clip", "sigmoid", "length_normalized", "dynamic", "target"]
    stock, drift = default["none"]["completions/mean_length"][0], default["beta=0"]["completions/mean_length"][0]
    for method, claim in rows:
        if claim == "costs reward":
            reward, spread = (default.get(method) or options[method])["reward"]
            assert default["none"]["reward"][0] - reward > spread + default["none"]["reward"][1], (method, reward)
            continue
        lengths = default[method]["by_seed"]["completions/mean_length"]
        drifted = sum(1 for length in lengths if abs(length - drift) < abs(length - stock))
        expected = "holds length" if drifted == 0 else f"length drifted in {drifted} of {len(lengths)} seeds"
        assert claim == expected, (method, claim, drifted, len(lengths))


def test_the_summed_kl_in_the_loss_has_the_tightest_length_spread_of_the_loss_side_settings() -> None:
    """Results, Estimators and Choosing a setting say `kl_reduction=sequence_sum` gave the tightest length spread over
    seeds of the settings with the KL in the loss: its std is the smallest of every variant of the committed runs
    that puts the KL in the loss (all but `beta=0` and the `reward:` variants); the summed KL in the reward is named
    beside it with its own figure, not ranked."""
    spreads = {}
    for run in ("default", "options", "ref_sync", "kl_in_reward"):
        for row in json.loads((ROOT / f"docs/results/{run}/summary.json").read_text())["summary"]:
            if row["method"] != "beta=0" and not row["method"].startswith("reward:"):
                spreads[f"{run}:{row['method']}"] = row["completions/mean_length"][1]
    assert len(spreads) == 17 and min(spreads, key=spreads.get) == "options:kl_reduction=sequence_sum"
    for page in ("results.md", "estimators.md", "choosing-a-setting.md"):
        assert "the KL in the loss" in (ROOT / "docs" / page).read_text().split("tightest", 1)[1][:120], page


def test_verl_page_command_is_the_one_the_end_to_end_test_runs() -> None:
    """docs/verl.md's command switches the integration on as tests/test_verl.py's runs do: the environment variable,
    the trainer name and every adaptive_kl and KL override of PAGE_RUN, which test_verl.py builds verl's trainer with at
    verl's default and GRPO's batch sizes, and runs end to end with test-sized targets appended."""
    sys.path.insert(0, str(ROOT / "tests"))
    try:
        from verl_cpu import EXTERNAL_MODULE, PAGE_RUN
    finally:
        sys.path.remove(str(ROOT / "tests"))
    page = (ROOT / "docs" / "verl.md").read_text()
    block = re.search(r"<!-- verl-command: .+ -->\n```bash\n(?P<body>.*?)^```$", page, re.MULTILINE | re.DOTALL)
    tokens = block["body"].replace("\\\n", " ").split()
    assert tokens[:3] == [f"VERL_USE_EXTERNAL_MODULES={EXTERNAL_MODULE}", "python", "-m"]
    assert tokens[3] == "verl.trainer.main_ppo"
    assert [t for t in tokens if t in PAGE_RUN] == PAGE_RUN  # all of them, in the test's order
    assert not [t for t in tokens if t.startswith("++")]  # none of the end-to-end run's sizing


def test_readme_links_are_absolute_and_resolve() -> None:
    """The README is also the package index page, where relative links break: every link is absolute, and each one
    into this project names a file of the repository or a page of the docs site that exists."""
    readme = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\(([^)\s]+)\)", readme) + re.findall(r"(https://\S+?)[)\s]", readme)
    assert links
    for link in links:
        assert link.startswith("https://"), f"relative link {link}"
        if link.startswith(RAW):
            assert (ROOT / link[len(RAW):]).is_file(), link
        elif link.startswith(REPOSITORY + "/tree/main/") or link.startswith(REPOSITORY + "/blob/main/"):
            assert (ROOT / link.split("/main/", 1)[1]).exists(), link
        elif link.startswith(DOCS_SITE):
            page = link[len(DOCS_SITE):].split("#")[0].strip("/") or "index"
            assert (ROOT / "docs" / f"{page}.md").is_file(), link
    urls = (ROOT / "pyproject.toml").read_text()
    assert f'Repository = "{REPOSITORY}"' in urls and f'Documentation = "{DOCS_SITE}"' in urls


def test_readme_quickstarts_are_the_quickstart_pages_blocks() -> None:
    """The README's quickstarts are the docs pages' own, so one cannot drift from the other."""
    readme = {block.code for block in python_blocks(ROOT / "README.md")}
    for page in ("quickstart-unsloth.md", "quickstart-trl.md"):
        assert readme & {block.code for block in python_blocks(ROOT / "docs" / page)}, page


def trainer_sections() -> str:
    """ground-truth.md from the trainers' lab to the guards (the part written from kl_lab_*.json)."""
    text = (ROOT / "docs" / "ground-truth.md").read_text()
    return text[text.index("## Through the trainers"):text.index("## What a tabular lab cannot tell")]


def test_the_trainer_sections_carry_no_typed_figure() -> None:
    """Every figure of the trainers' lab reaches the page through the docs hook, from the JSON the lab writes: the
    prose between the markers holds no number (code blocks, identifiers such as k1 or r8, and maths aside), and each
    table is rendered once."""
    text = FENCE.sub("", trainer_sections())
    text = re.sub(r"\\\(.*?\\\)|`[^`]*`|<!--.*?-->|\]\([^)]*\)", "", text, flags=re.DOTALL)
    figures = re.findall(r"(?<![\w.])\d+(?:[.,]\d+)?(?![\w])", text)
    assert figures == [], figures
    markers = re.findall(r"<!-- generated: (kl_lab_\w+(?: \w+)?) -->", trainer_sections())
    assert len(markers) == len(set(markers)), markers


# The numbers each docs page may carry in prose: the settings it names (seeds, steps, beta, thresholds, horizons,
# sizes, versions, years, issue and paper numbers), never a measured figure. Anything else must come through the docs
# hook, from the results file its command wrote. Every page but the changelog (a history of what was measured when).
SETTINGS_IN_PROSE = {
    "results.md": {"0", "1", "5", "12", "24", "30", "120", "0.04", "0.2", "0.9", "5e-3"},
    "choosing-a-setting.md": {"0", "1", "2", "5", "8", "12", "30", "64", "100", "120", "1000", "10000", "2019", "0.001",
                              "0.04", "0.2", "0.8", "0.9", "5e-3"},
    "ground-truth.md": {"0", "1"},
    "index.md": set(),
    "methods.md": {"0", "0.0", "0.032", "0.04", "0.1", "0.8", "0.9", "1", "1.0", "1.10", "1.9.1", "12", "16", "120",
                   "1000", "2019", "2605.11403", "10000", "10000.0"},
    "estimators.md": {"0", "0.2", "5", "5.0", "6", "10", "20", "1.9.1", "1.10", "2026.10.7", "2026.10.9"},
    "papers.md": {"0.2", "1", "3", "10", "20", "2.2", "3.1", "2019", "2020", "2022", "2025", "2507", "1909.08593",
                  "2203.02155", "2505.24864", "2506.09477", "2510.01555", "2512.21852"},
    "benchmarks.md": {"0", "1", "2", "3", "4", "5", "8", "15", "16", "64", "90", "95", "128", "200", "256", "300", "512",
                      "4096"},
    "kl-in-reward.md": {"0", "1", "2", "3", "10", "20", "2019"},
    "reference-sync.md": {"0", "1", "2", "3", "4", "14", "16", "30", "120", "5.24", "2025", "2404.09656",
                          "2505.24864"},
    "scaling-out.md": {"0", "1", "3", "0.6", "0.7", "0.8", "1.0", "0.01", "0.02", "0.04", "29500",
                       "2026.10.7", "1.7.0"},
    "how-it-works.md": {"0", "5", "10", "1.14", "1.15", "1.16", "0.27.0", "2026.10.7", "2026.10.9"},
    "demo.md": {"0", "1", "3", "4", "6", "7", "8", "10", "16", "17", "24", "25", "60", "120", "300", "5e-3", "5e-6"},
    "install.md": {"0", "1", "0.28", "0.29", "2.13", "2.14", "3.10", "3.11", "3.13", "0.9.1", "1.9.1", "1.14.1",
                   "1.15.0", "2.4.0", "2026.10.7", "2026.10.9", "1.13", "2.6", "2.6.0"},
    "metrics.md": {"1", "2", "1.10", "1.15.0"},
    "own-loop.md": {"0", "1", "5", "12", "13", "0.2", "0.9", "1000", "2.14.1"},
    "tinker.md": {"0", "1", "0.38.0", "127.0.0.1"},  # mask values, the SDK version, loopback
    "verl.md": {"0", "1", "2", "4", "5", "6", "8", "2653", "3.11", "5.11", "0.9.1", "1.9.1", "2.13.0"},
    "troubleshooting.md": {"0", "1", "2", "4", "8", "0.7", "1.9.1", "1.10",
                           "1.14", "1.15", "1.16", "5.17", "5.24", "6586", "1.15.0",
                           "0.27.0", "2026.10.7", "2026.10.8", "2026.10.9"},
    "gpu.md": {"0", "4", "10", "13", "15", "64", "3.12"},
    "quickstart-trl.md": {"1", "2", "0.3", "0.9", "0.04", "0.036", "0.0324", "1.15.0", "2.14.1", "5.17.0"},
    "quickstart-unsloth.md": {"0", "1", "4", "0.1", "0.04"},
    "configuration.md": {"1.9.1"},
    "compatibility.md": {"0", "1", "2", "3", "4", "5", "6", "8", "25", "30", "64", "100", "0.5", "128", "256", "512",
                         "800", "1024", "3.10", "3.11", "3.13", "1.15.0", "2.4.0", "0.005", "0.9.1", "1.9.0",
                         "1.9.1", "1e-12", "1.14.1", "0.27.0", "2026.10.7", "2026.10.9",
                         # the trl extra's floors (rows k and d) and the torch releases below its torch floor
                         "1.4.0", "1.7.0", "0.18", "0.19.0", "0.19.1", "4.7.0", "4.56.2", "1.13", "2.4", "2.6", "2.6.0",
                         "2.14.1", "5.17.0"},
    "contributing.md": {"2", "4", "10", "20", "25", "2026.10.7", "2026.10.9"},
}


def test_every_page_but_the_changelog_is_held_to_its_settings() -> None:
    assert set(SETTINGS_IN_PROSE) | {"changelog.md"} == {page.name for page in (ROOT / "docs").glob("*.md")}


@pytest.mark.parametrize("page", sorted(SETTINGS_IN_PROSE))
def test_the_pages_carry_no_typed_figure(page: str) -> None:
    """Every measured figure of a docs page reaches it through the docs hook, from the results file its command
    wrote: the prose outside code blocks, inline code, maths, markers and links holds no number but
    the settings it names."""
    text = FENCE.sub("", (ROOT / "docs" / page).read_text())
    text = re.sub(r"\\\(.*?\\\)|\\\[.*?\\\]|`[^`]*`|<!--.*?-->|\]\([^)]*\)|!\[[^\]]*\]", "", text, flags=re.DOTALL)
    figures = set(re.findall(r"(?<![\w.])\d+(?:[.,]\d+)*(?:e-?\d+)?(?![\w])", text))
    assert figures <= SETTINGS_IN_PROSE[page], sorted(figures - SETTINGS_IN_PROSE[page])
    # and every allowed figure is one the page names: a stale entry would let a stale typed figure through (a demo
    # run re-run at 10 seeds left "3 seeds" on choosing-a-setting.md, allowed by an entry for another sentence)
    assert SETTINGS_IN_PROSE[page] <= figures, sorted(SETTINGS_IN_PROSE[page] - figures)


def test_every_committed_results_file_is_strict_json() -> None:
    """A reader other than Python's json (JavaScript's JSON.parse, jq, serde) refuses a bare NaN or Infinity: the
    demo's summary files held 597 NaN until it wrote null for a metric never logged."""
    files = sorted({*(ROOT / "docs" / "results").rglob("*.json"), *(ROOT / "benchmarks").rglob("*.json")})
    assert len(files) > 15
    for path in files:
        json.loads(path.read_text(), parse_constant=lambda constant: pytest.fail(f"{path}: {constant}"))


@pytest.mark.parametrize("name", ["trl", "unsloth", "unsloth_pad_is_eos"])
def test_each_trainer_lab_json_is_the_output_of_the_command_it_records(name: str) -> None:
    """A results file records the one command that wrote it, and what it says of the machine follows from that
    command (no hand-merged shards, no annotation): its --json is the file itself, its worker processes are the
    command's --processes, and its trainers and recipes are the ones the command asked for."""
    from unsloth_adaptive_kl.tools import kl_lab

    path = f"docs/results/kl_lab_{name}.json"
    result = json.loads((ROOT / path).read_text())
    argv = result["command"].split()[3:]
    assert result["command"].startswith("python -m unsloth_adaptive_kl.tools.kl_lab ")
    args = kl_lab.build_parser().parse_args(argv)
    assert args.json == path
    assert result["machine"].endswith(f", {args.processes} worker processes")  # after the CPU (or card) it ran on
    assert list(result["trainers"]) == ([args.trainer] if args.trainer != "both" else ["trl", "unsloth"])
    for table in result["trainers"].values():
        assert list(table["recipes"]) == (args.recipe or list(kl_lab_recipes()))
        assert table["seeds"] == list(range(args.seeds)) and table["pad_is_eos"] == args.pad_is_eos


def kl_lab_recipes() -> dict:
    from unsloth_adaptive_kl.tools.trainer_lab import RECIPES

    return RECIPES


def test_the_gpu_page_names_its_device_and_marks_a_cpu_run_as_not_a_gpu_result(monkeypatch) -> None:
    """docs/gpu.md's blocks read docs/results/gpu/: a CUDA run is shown with its card; a CPU run (the dry run) is
    marked as not a GPU result; a file not there says so instead of failing the build."""
    hook = docs_generator()
    cuda = {"kind": "cuda", "name": "NVIDIA H100 80GB HBM3", "capability": "9.0", "cuda": "13.0", "driver": "580.1",
            "precision": "bf16"}
    cpu = {"kind": "cpu", "name": "x86_64", "cores": 2}
    check = {"command": "python -m unsloth_adaptive_kl --gpu", "date": "2026-11-27", "versions": {"torch": "2.11.0",
             "vllm": None}, "dry_run": False, "seconds": 300.0, "model": [{"name": "m", "ok": True, "detail": ""}],
             "scenarios": {"unsloth-4bit": {"ran": True, "seconds": 61.0, "checks": [
                 {"name": "a", "ok": True, "detail": "x"}, {"name": "b", "ok": False, "detail": "boom"}]},
                 "vllm-kl-in-reward": {"ran": False, "why": "not asked for (--only)"}}}
    files = {"check.json": {**check, "device": cuda}}
    monkeypatch.setattr(hook, "_gpu", lambda name: files.get(name))
    text = hook.gpu_check()
    assert text.startswith("The run of 2026-11-27 on NVIDIA H100 80GB HBM3 (compute capability 9.0, CUDA 13.0, "
                           "driver 580.1, bf16)") and "Versions: torch 2.11.0." in text  # vllm: None
    assert "| `unsloth-4bit` | 61 | ok: a: x<br>**FAIL**: b: boom |" in text
    assert "| `vllm-kl-in-reward` |  | not run: not asked for (--only) |" in text
    files["check.json"] = {**check, "device": cpu, "dry_run": True}
    assert hook.gpu_check().startswith("The dry run (each scenario's CPU equivalent) of 2026-11-27 on a CPU (x86_64, "
                                       "2 cores; **not a GPU result**)")
    assert hook.gpu_cost() == "No run of benchmarks/unsloth_cost.py is recorded in docs/results/gpu/cost.json."
    row = {"median_s": 0.25, "ratio": 1.004, "ci": [0.99, 1.02], "peak_bytes": 3 * 2 ** 30, "memory_ratio": 1.0}
    files["cost.json"] = {"command": "c", "date": "2026-11-27", "size": "0.5b", "device": cuda, "versions": {},
                          "settings": {"model": {"hidden_size": 896, "num_hidden_layers": 24, "vocab_size": 151936},
                                       "lora_rank": 16, "prompts": 8, "completions": 8, "length": 256},
                          "rounds": 12, "warmup": 2, "whole_rounds": 0, "rounds_finished": True,
                          "step": {"stock": row, "stock (A/A)": row, "clip": row},
                          "whole_step": {}, "loss_share": None,
                          "profile": {"method": "clip", "stock": [{"name": "aten::mm", "self_us": 1200.4, "calls": 8}],
                                      "heaviest": [{"name": "aten::mm", "self_us": 1210.0, "calls": 8},
                                                   {"name": "aten::where", "self_us": 15.2, "calls": 3}]}}
    cost = hook.gpu_cost()
    assert "hidden 896, 24 layers, vocabulary 151,936, LoRA r16; 8 prompts × 8 completions of 256 tokens" in cost
    assert "| `clip` | 250.0 | 1.004 | [0.990, 1.020] | 3,072 | 1.000 |" in cost and "Whole GRPO step" not in cost
    assert "| `aten::mm` | 1,200 | 1,210 |\n| `aten::where` |  | 15 |" in cost and "(GPU time, µs)" in cost
    # a row of under 5 timed rounds: its bootstrap takes a handful of values, so no interval is shown
    files["cost.json"]["step"]["clip"] = {**row, "n": 2}
    assert "| `clip` | 250.0 | 1.004 | none (2 rounds: too few to resample) | 3,072 |" in hook.gpu_cost()


def test_the_gpu_page_names_the_commit_and_what_the_loss_benchmark_did_not_reach(monkeypatch) -> None:
    """The versions line names the commit a GPU results file ran at (and uncommitted changes); the loss benchmark's
    block shows each size it reached, with its trainers, and says why the larger size is missing: skipped for the
    budget, or a run stopped before its end."""
    hook = docs_generator()
    headline = {"ratio": 1.02, "ci": [1.01, 1.03], "aa": [0.98, 1.02], "ops_added": 40}
    loss = {"command": "python benchmarks/loss_overhead.py --budget 400", "date": "2026-12-03",
            "device": {"kind": "cpu", "name": "x86_64", "cores": 2},
            "versions": {"unsloth_adaptive_kl": "0.1.0", "torch": "2.11.0", "vllm": None},
            "commit": "0123456789abcdef+changes", "size": {"completions": 8, "completion_length": 64},
            "trl": {"precision": "fp32"}, "unsloth": {"precision": "bf16"}, "headline": headline, "finished": True,
            "large_skipped": "the core op and the default size took 230 s of the 400-second budget (more than half)"}
    monkeypatch.setattr(hook, "_gpu", lambda name: loss if name == "loss_overhead.json" else None)
    text = hook.gpu_loss()
    assert "Versions: unsloth_adaptive_kl 0.1.0 (at commit `0123456` with uncommitted changes), torch 2.11.0." in text
    assert ("| default | 8 completions × 64 tokens | TRL and Unsloth | 1.020 | [1.010, 1.030] | [0.980, 1.020] | "
            "not recorded | 40 |" in text)  # a file written before the rounds were recorded
    assert "| large |" not in text and text.endswith("The larger size was not run: the core op and the default size "
                                                     "took 230 s of the 400-second budget (more than half).")
    del loss["unsloth"], loss["large_skipped"]
    loss.update(finished=False, commit="0123456789abcdef")
    text = hook.gpu_loss()
    assert "(at commit `0123456`)," in text and "| default | 8 completions × 64 tokens | TRL | 1.020 |" in text
    assert "**The run stopped before its end**" in text
