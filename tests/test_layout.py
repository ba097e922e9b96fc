"""The package's layers (SPEC 1): the core imports with torch alone and never a trainer; module-level imports form no
cycle; with no trainer package importable, `import unsloth_adaptive_kl` is the core, silently. Torch alone: this
file runs where trl is not installed."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).parents[1] / "unsloth_adaptive_kl"
TRAINER_PACKAGES = ("trl", "transformers", "peft", "accelerate", "datasets", "unsloth", "unsloth_zoo", "tinker", "verl")
STDLIB = set(sys.stdlib_module_names)


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def top_level_imports(path: Path, everywhere: bool = False) -> set[str]:
    """Absolute names of what a module imports at its top level (not inside functions: those run when called); with
    `everywhere`, also inside functions and `if TYPE_CHECKING:` blocks (the module still depends on them)."""
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    names: set[str] = set()
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree) if everywhere else tree.body:
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                prefix = f"{base}.{node.module}" if node.module else base
                # `from . import x` may import a submodule x
                names.update({prefix, *(f"{prefix}.{alias.name}" for alias in node.names)})
            else:
                names.add(node.module)
    return names


MODULES = {module_name(path): path for path in PACKAGE.rglob("*.py")}


def own_imports(name: str, everywhere: bool = False) -> set[str]:
    return {imported for imported in top_level_imports(MODULES[name], everywhere)
            if imported in MODULES and imported != name}


def test_the_tree_shows_core_integrations_and_tools() -> None:
    packages = sorted(path.parent.name for path in PACKAGE.glob("*/__init__.py"))
    assert packages == ["core", "integrations", "tools"]
    assert sorted(path.name for path in PACKAGE.glob("*.py")) == ["__init__.py", "__main__.py"]


def test_the_how_it_works_tree_names_every_module_in_its_folder() -> None:
    """docs/how-it-works.md's tree: each module's file name appears under its folder's line (a sub-package's own
    __init__.py aside), and the page names no module that is not there."""
    page = (PACKAGE.parent / "docs" / "how-it-works.md").read_text()
    tree = page[page.index("```text\nunsloth_adaptive_kl/\n"):]
    tree = tree[:tree.index("\n```")]
    folders = re.split(r"\n  (?=\w+/ )", tree)  # the top level, then one part a sub-package
    shown = {part.split("/", 1)[0] if i else "": set(re.findall(r"\b\w+\.py\b", part)) for i, part in enumerate(folders)}
    modules = {folder: {path.name for path in (PACKAGE / folder).glob("*.py")} - ({"__init__.py"} if folder else set())
               for folder in ("", "core", "integrations", "tools")}
    assert shown == modules


def test_the_core_imports_only_torch_the_standard_library_and_itself() -> None:
    for name, path in MODULES.items():
        if not name.startswith("unsloth_adaptive_kl.core"):
            continue
        outside = {imported.split(".")[0] for imported in top_level_imports(path)} - STDLIB - {"torch", "unsloth_adaptive_kl"}
        assert not outside, (name, outside)
        assert all(i.startswith("unsloth_adaptive_kl.core") or not i.startswith("unsloth_adaptive_kl")
                   for i in top_level_imports(path)), name


# The trainers the package integrates, as words (compared lower-case): the core must know none of them.
TRAINER_WORDS = {"trl", "unsloth", "verl", "tinker", "grpotrainer"}
PACKAGE_SPELLINGS = ("unsloth_adaptive_kl", "unsloth-adaptive-kl")  # the package's own name is no trainer's
# Core modules that still name a trainer, each with why it is left for now; the test fails once one complies.


def trainer_mentions(text: str) -> list[tuple[int, str]]:
    """(line, word) of each trainer named in a module's text: its identifiers, string literals, docstrings and comments
    alike. Words are split at every non-letter and at camel-case humps, so `trl_sync_fields`, `TRL's`, `verl.py` and
    `UnslothGRPOTrainer` are found and `control` or `overlap` are not."""
    found = []
    for number, line in enumerate(text.splitlines(), start=1):
        for spelling in PACKAGE_SPELLINGS:
            line = line.replace(spelling, " ")
        words = [word for run in re.findall(r"[A-Za-z]+", line) for word in re.findall(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+", run)]
        found += [(number, word) for word in words if word.lower() in TRAINER_WORDS]
        found += [(number, "GRPOTrainer")] * line.count("GRPOTrainer")
    return found


def test_trainer_mentions_finds_each_spelling_and_nothing_else() -> None:
    text = ("x = trl_sync_fields  # TRL's\nfrom verl.py import Tinker\nclass UnslothGRPOTrainer: 'unsloth'\n"
            "control, overlap, tinkering, unsloth_adaptive_kl, unsloth-adaptive-kl")
    assert trainer_mentions(text) == [(1, "trl"), (1, "TRL"), (2, "verl"), (2, "Tinker"), (3, "Unsloth"),
                                      (3, "unsloth"), (3, "GRPOTrainer")]


CORE_MODULES = sorted(name for name in MODULES if name.startswith("unsloth_adaptive_kl.core"))


@pytest.mark.parametrize("name", CORE_MODULES)
def test_the_core_names_no_trainer(name: str) -> None:
    """SPEC 1 and STYLE: the core holds no trainer's fields, rules or knowledge; not even its docstrings name one (they
    say 'a trainer'). A trainer's own names belong to its integration."""
    assert trainer_mentions(MODULES[name].read_text()) == [], name


@pytest.mark.parametrize("everywhere", [False, True], ids=["module-level", "every-import"])
def test_no_import_cycles(everywhere: bool) -> None:
    """Depth-first search over the package's imports: a back edge would be a cycle. Module-level imports, then every
    import (inside functions and `if TYPE_CHECKING:` blocks too): a cycle hidden in a function or a type-only import
    is still two modules that each need the other (b3d53c1 had core/config <-> core/adaptation and tools/kl_lab <->
    tools/trainer_lab)."""
    state: dict[str, str] = {}

    def visit(name: str, trail: list[str]) -> None:
        state[name] = "open"
        for imported in sorted(own_imports(name, everywhere)):
            assert state.get(imported) != "open", f"import cycle: {' -> '.join(trail + [name, imported])}"
            if imported not in state:
                visit(imported, trail + [name])
        state[name] = "done"

    for name in sorted(MODULES):
        if name not in state:
            visit(name, [])
    assert len(state) == len(MODULES) > 15


def test_the_core_imports_and_runs_with_no_trainer_package_importable() -> None:
    """Each trainer package is made unimportable (sys.modules[name] = None, so import raises ModuleNotFoundError and
    find_spec returns None); warnings are errors, so 'silently' is checked too."""
    code = f"""
import sys, warnings
warnings.simplefilter("error")
for name in {TRAINER_PACKAGES!r}:
    sys.modules[name] = None
import torch
import unsloth_adaptive_kl
from unsloth_adaptive_kl import AdaptiveKL, AdaptiveKLConfig, register_kl_estimator
logps = torch.full((2, 3), -3.0, requires_grad=True)
akl = AdaptiveKL(AdaptiveKLConfig(kl_adaptation_method="clip", kl_clip_threshold=1.0), 0.04)
term, metrics = akl.kl_loss(logps, logps.detach() + 2.0, torch.ones(2, 3))  # k3 = e^2 - 3 = 4.39: clipped to 1
assert abs(term.item() - 0.04) < 1e-8 and metrics["adaptive_kl/raw_kl"] > 4.38, (term.item(), metrics)
assert not unsloth_adaptive_kl.is_patched() and not hasattr(unsloth_adaptive_kl, "GRPOConfig")
loaded = sorted(m for m in sys.modules if m.split(".")[0] in {TRAINER_PACKAGES!r} and sys.modules[m] is not None)
assert loaded == [], loaded
try:
    unsloth_adaptive_kl.patch()
except ImportError as error:
    print(error)
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            cwd=PACKAGE.parent)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == ("unsloth_adaptive_kl.patch() patches TRL, which is not installed: pip install "
                                     "'unsloth-adaptive-kl[trl] @ git+https://github.com/unsloth-adaptive-kl/"
                                     "unsloth-adaptive-kl' (or [unsloth]).")
    assert result.stderr == ""


def test_the_top_level_exports_what_a_user_writes() -> None:
    """The public surface (issue 26): the object, its config, the four registries, the estimator, the window a loop
    may measure, the errors and the patching entry points; internals stay importable from their modules."""
    import unsloth_adaptive_kl
    from unsloth_adaptive_kl.core import controllers, errors, reductions

    public = {"AdaptiveKL", "AdaptiveKLConfig", "WindowKL", "estimate_kl", "register_kl_estimator",
              "register_kl_shaping", "register_kl_reduction", "register_beta_controller", "IncompatibleVersionError",
              "IncompatibleVersionWarning", "KLEstimatorWarning", "NonFiniteLogProbError", "UntestedVersionWarning",
              "patch", "unpatch", "is_patched"}
    exported = set(unsloth_adaptive_kl.__all__) - {"GRPOConfig"}  # trl.GRPOConfig, patched, where TRL is installed
    assert exported == public
    for name in ("KLTerm", "ReductionContext", "kl_term", "reduce_kl", "shape_kl", "DynamicBeta"):
        assert not hasattr(unsloth_adaptive_kl, name), name
    assert reductions.ReductionContext and controllers.DynamicBeta  # still importable where they live
    # every error of the package is defined in core/errors.py
    assert {name for name in dir(errors) if name[0].isupper()} == {
        "IncompatibleVersionError", "IncompatibleVersionWarning", "KLEstimatorWarning", "NonFiniteLogProbError",
        "UntestedVersionWarning"}
    assert all(getattr(unsloth_adaptive_kl, name).__module__ == errors.__name__
               for name in ("IncompatibleVersionError", "IncompatibleVersionWarning", "KLEstimatorWarning",
                            "NonFiniteLogProbError", "UntestedVersionWarning"))
