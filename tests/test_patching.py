"""patch()/unpatch(): idempotent, reversible, version-checked, loud when an anchor is missing (SPEC 5)."""

from __future__ import annotations

import copy
import gc
import importlib.metadata
import importlib.util
import inspect
import math
import pickle
import re
import sys
import types
import warnings
from typing import Optional

import pytest
import torch
import trl
import trl.trainer.utils as trl_utils
from packaging.version import Version

import unsloth_adaptive_kl
from unsloth_adaptive_kl.integrations import trl as trl_patch
from unsloth_adaptive_kl.integrations import unsloth as unsloth_patch
from unsloth_adaptive_kl.integrations import versions
from unsloth_adaptive_kl.integrations.ref_sync import use_reference

from .conftest import make_trainer, pyproject

PATCHED_METHODS = ["__init__", "_compute_loss", "_generate_and_score_completions", "_calculate_rewards",
                   "_save_checkpoint", "_load_optimizer_and_scheduler"]


def snapshot() -> dict:
    trainer = trl_patch.StockGRPOTrainer
    return {
        "GRPOConfig": (trl.GRPOConfig, trl.trainer.GRPOConfig, trl.trainer.grpo_config.GRPOConfig,
                       trl.trainer.grpo_trainer.GRPOConfig),
        "use_adapter": trl.trainer.grpo_trainer.use_adapter,
        "methods": tuple(vars(trainer).get(name) for name in PATCHED_METHODS),
        "current_beta": "current_beta" in vars(trainer),
        "kernel": trl_utils._ChunkedLogProbFunction,
        # unsloth is not imported in the test process: its hook is the import hook, waiting for unsloth.models.rl
        "unsloth_hooks": sys.meta_path.count(unsloth_patch._FINDER),
        # a trainer built before the patch says so (trl.BuiltBeforePatch); stock trl has no such attribute
        "built_before_patch": isinstance(vars(trainer).get("adaptive_kl"), trl_patch.BuiltBeforePatch),
        # a stock config bound before the import pickles by its attributes (trl.reduce_stock_config)
        "stock_config_reduction": vars(trl_patch.StockGRPOConfig).get("__reduce_ex__"),
    }


def test_patch_and_unpatch_are_idempotent_and_restore_stock_objects() -> None:
    assert unsloth_adaptive_kl.is_patched()
    patched = snapshot()
    unsloth_adaptive_kl.patch()
    assert snapshot() == patched
    try:
        unsloth_adaptive_kl.unpatch()
        unsloth_adaptive_kl.unpatch()
        stock = snapshot()
        assert not unsloth_adaptive_kl.is_patched()
        assert stock["GRPOConfig"] == (trl_patch.StockGRPOConfig,) * 4
        assert stock["methods"] == (
            trl_patch._stock_init, trl_patch._stock_compute_loss, trl_patch._stock_generate_and_score,
            trl_patch._stock_calculate_rewards, trl_patch._stock_save_checkpoint,
            trl_patch._stock_load_optimizer_and_scheduler,
        )
        assert stock["use_adapter"] is trl_utils.use_adapter and patched["use_adapter"] is use_reference
        assert stock["current_beta"] is False
        assert (patched["built_before_patch"], stock["built_before_patch"]) == (True, False)
        assert (patched["stock_config_reduction"], stock["stock_config_reduction"]) == (trl_patch.reduce_stock_config,
                                                                                       None)
        assert (patched["unsloth_hooks"], stock["unsloth_hooks"]) == (1, 0)  # installed once, removed
        if trl_patch.kernel_lacks_cpu_path():  # trl 1.15 only: the fallback stands in for the kernel
            assert stock["kernel"] is trl_patch.ChunkedLogProbWithCPUFallback.upstream
            assert patched["kernel"] is trl_patch.ChunkedLogProbWithCPUFallback
        else:
            assert stock["kernel"] is patched["kernel"]
        assert not hasattr(trl.GRPOConfig(output_dir="x", use_cpu=True), "kl_adaptation_method")
    finally:
        unsloth_adaptive_kl.patch()
    assert snapshot() == patched
    assert patched["GRPOConfig"] == (unsloth_adaptive_kl.GRPOConfig,) * 4
    assert all(method is not None for method in patched["methods"])


def fake_version(monkeypatch, package: str, version: Optional[str], missing_field_raises: bool = False) -> None:
    """Unpatched, with `package`'s metadata saying `version` (read and parsed by versions.installed_version); None: a
    metadata without a Version field, whose lookup gives None or, `missing_field_raises`, a KeyError."""
    unsloth_adaptive_kl.unpatch()
    real = importlib.metadata.version

    def metadata_version(name: str) -> Optional[str]:
        if name != package:
            return real(name)
        if version is None and missing_field_raises:
            raise KeyError("Version")
        return version

    monkeypatch.setattr(importlib.metadata, "version", metadata_version)
    monkeypatch.setattr(versions, "_warned", set())


def test_newer_untested_trl_whose_anchors_hold_warns_once_and_is_patched(monkeypatch) -> None:
    fake_version(monkeypatch, "trl", "1.99.0")
    try:
        with pytest.warns(versions.UntestedVersionWarning) as caught:
            unsloth_adaptive_kl.patch()
            unsloth_adaptive_kl.unpatch()
            unsloth_adaptive_kl.patch()
        assert len(caught) == 1
        assert str(caught[0].message).startswith(
            f"unsloth_adaptive_kl is untested with trl==1.99.0 (tested: trl{versions.tested_range('trl')}); every "
            "anchor it relies on was found, so it is applied."
        )
        assert unsloth_adaptive_kl.is_patched()
    finally:
        monkeypatch.undo()
        unsloth_adaptive_kl.patch()


@pytest.mark.parametrize(("text", "raises", "shown"), [("1.16.0-custom build", False, "1.16.0-custom build"),
                                                     (None, False, "unknown"), (None, True, "unknown")])
def test_a_trl_whose_version_is_not_pep_440_is_untested_and_named_as_installed(monkeypatch, text, raises,
                                                                               shown) -> None:
    """A local build's version text that packaging cannot parse ('1.16.0-custom build') failed the import of this
    package with InvalidVersion, and metadata without a Version field (None, or a KeyError where the metadata raises
    for a missing field) with a TypeError; each is now outside every tested range, named as its metadata says or
    'unknown'."""
    fake_version(monkeypatch, "trl", text, missing_field_raises=raises)
    try:
        with pytest.warns(versions.UntestedVersionWarning) as caught:
            unsloth_adaptive_kl.patch()
        described = f"trl=={shown} (tested: trl>=1.9.1,<=1.16.0)"
        assert [str(w.message).split(";")[0] for w in caught] == [f"unsloth_adaptive_kl is untested with {described}"]
        assert unsloth_adaptive_kl.is_patched()
        assert versions.is_tested("trl") is False
        assert versions.describe("trl") == described
    finally:
        monkeypatch.undo()
        unsloth_adaptive_kl.patch()


def compute_loss_without_the_kl_line(self, model, inputs):
    """A changed trl: the KL is added to the loss some other way."""
    return model(inputs)


def test_unsloths_generator_loaded_before_the_hook_is_wrapped_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where unsloth.models.rl is loaded before the hook is installed (an Unsloth that generated no trainer when
    imported), patch() wraps its generator at once, and once however often it is called: a generation that gives no
    GRPO trainer warns once, not once a wrapper, and unpatch() gives Unsloth its own generator back."""
    def _patch_trl_rl_trainers(trainer_file: str = "grpo_trainer") -> None:
        """Unsloth's generator, generating nothing (TRL's GRPOTrainer stays)."""

    rl = types.ModuleType("unsloth.models.rl")
    rl._patch_trl_rl_trainers = _patch_trl_rl_trainers
    unsloth_adaptive_kl.unpatch()
    try:
        monkeypatch.setitem(sys.modules, "unsloth.models.rl", rl)
        unsloth_adaptive_kl.patch()
        unsloth_adaptive_kl.patch()  # TRL patched already: the Unsloth hook alone, again
        unsloth_patch.patch()  # the integration's own patch(), past the package's early return: idempotent too
        assert unsloth_patch._FINDER not in sys.meta_path
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            rl._patch_trl_rl_trainers("grpo_trainer")
        assert [str(w.message).split(" (")[0] for w in caught] == ["Unsloth did not generate UnslothGRPOTrainer"]
        unsloth_adaptive_kl.unpatch()
        assert rl._patch_trl_rl_trainers is _patch_trl_rl_trainers
    finally:
        monkeypatch.undo()
        unsloth_adaptive_kl.unpatch()
        unsloth_adaptive_kl.patch()
    assert unsloth_patch._FINDER in sys.meta_path


def test_unsloths_generated_module_loaded_is_the_late_import_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """Unsloth's generated module `UnslothGRPOTrainer` loaded means Unsloth generated its trainer from TRL's source
    without this package's hook, even where trl's GRPOTrainer is not that module's class: too late, as when it is."""
    monkeypatch.setitem(sys.modules, "UnslothGRPOTrainer", types.ModuleType("UnslothGRPOTrainer"))
    assert unsloth_patch.generated_grpo_trainer() is None
    with pytest.raises(ImportError, match="^unsloth_adaptive_kl was imported after unsloth, which has already "
                                          "generated UnslothGRPOTrainer"):
        unsloth_patch.check_import_order()


def test_a_kl_line_reached_other_than_once_is_the_anchor_error() -> None:
    """The probe standing in for beta records each `beta * tensor`; a trainer that reaches its KL line twice (or
    never, or as `tensor * beta`) is refused, not read from its first product. A plain number times the probe is
    beta times it, recorded as no KL line."""
    from unsloth_adaptive_kl.integrations.trainer_hooks import KLTermProbe

    def missing() -> RuntimeError:
        return RuntimeError("the KL line")

    once = KLTermProbe(0.1, keep_stock_term=False)
    kl = torch.tensor([0.5, 2.0])
    assert torch.equal(once * kl, torch.zeros(2)) and once * 3.0 == pytest.approx(0.3)
    assert torch.equal(once.single_capture(missing), kl)
    assert torch.equal(KLTermProbe(0.1, keep_stock_term=True) * kl, 0.1 * kl)
    twice = KLTermProbe(0.1, keep_stock_term=False)
    for _ in range(2):
        twice * kl
    reflected = KLTermProbe(0.1, keep_stock_term=True)
    assert torch.equal(kl * reflected, 0.1 * kl) and 2.0 * reflected == pytest.approx(0.2)
    for probe in (twice, reflected, KLTermProbe(0.1, keep_stock_term=True)):
        with pytest.raises(RuntimeError, match="^the KL line$"):
            probe.single_capture(missing)


def test_missing_anchor_is_refused_naming_anchor_version_and_tested_range(monkeypatch) -> None:
    unsloth_adaptive_kl.unpatch()
    real = trl_patch._stock_function
    monkeypatch.setattr(trl_patch, "_stock_function",
                        lambda name: compute_loss_without_the_kl_line if name == "GRPOTrainer._compute_loss" else real(name))
    try:
        with pytest.raises(versions.IncompatibleVersionError) as caught:
            unsloth_adaptive_kl.patch()
        message = str(caught.value)
        assert "the anchor `per_token_loss = per_token_loss + self.beta * per_token_kl`" in message
        assert f"trl=={versions.installed_version('trl')} (tested: trl{versions.tested_range('trl')})" in message
        assert "GRPOTrainer._compute_loss" in message
        assert not unsloth_adaptive_kl.is_patched()
    finally:
        monkeypatch.undo()
        unsloth_adaptive_kl.patch()
    assert unsloth_adaptive_kl.is_patched()


UNPATCHABLE_TRL = {
    # a trl whose loss has none of the anchors (as trl 0.27.0's lacks the loss mask's)
    "anchor": """
from trl.trainer import grpo_trainer
def _compute_loss(self, model, inputs):
    return 0
grpo_trainer.GRPOTrainer._compute_loss = _compute_loss
untouched = lambda: grpo_trainer.GRPOTrainer._compute_loss is _compute_loss
""",
    # a trl that does not import (trl 0.27.0 under transformers 5 imports `weave`, which a verl install lacks)
    "import": """
import sys
sys.modules["trl.data_utils"] = None  # fails inside trl's own source (its callbacks module imports it)
untouched = lambda: sys.modules["trl.data_utils"] is None
""",
}
AFTER_UNPATCHABLE_TRL = """
import warnings
import torch
import trl
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import unsloth_adaptive_kl
from unsloth_adaptive_kl import AdaptiveKL, AdaptiveKLConfig, IncompatibleVersionError, IncompatibleVersionWarning
(warning,) = [w for w in caught if w.category is IncompatibleVersionWarning]
print(str(warning.message))
akl = AdaptiveKL(AdaptiveKLConfig(kl_adaptation_method="clip", kl_clip_threshold=0.5), beta=0.1)
term, _ = akl.kl_loss(torch.tensor([[-1.0, -3.0]]), torch.tensor([[-2.0, -1.0]]), torch.ones(1, 2))
print(round(term.item(), 6))
print(unsloth_adaptive_kl.is_patched(), hasattr(unsloth_adaptive_kl, "GRPOConfig"),
      "kl_adaptation_method" in trl.GRPOConfig.__dataclass_fields__, untouched())
unsloth_adaptive_kl.unpatch()  # nothing to undo
try:
    unsloth_adaptive_kl.patch()
except IncompatibleVersionError as error:
    print("patch():", str(error) in str(warning.message))
"""


@pytest.mark.parametrize("why", sorted(UNPATCHABLE_TRL))
def test_a_trl_it_cannot_patch_leaves_the_core_and_the_other_doors_working(why: str) -> None:
    """verl[fsdp]==0.9.1 pins trl==0.27.0, which this package cannot patch (it lacks the anchors, and under
    transformers 5 it does not even import: it imports `weave`): `import unsloth_adaptive_kl` raised there, and took
    the core, verl's and Tinker's doors down with TRL's. It now warns with the error's text
    (IncompatibleVersionWarning), patches nothing, and the core works; patch() still raises."""
    import subprocess

    code = UNPATCHABLE_TRL[why] + AFTER_UNPATCHABLE_TRL
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    message, term, state, again = result.stdout.strip().splitlines()
    assert message.startswith(f"unsloth_adaptive_kl cannot patch trl=={versions.installed_version('trl')} (tested: ")
    assert ("importing it failed (ModuleNotFoundError: import of trl.data_utils halted; None in sys.modules)"
            if why == "import" else "the anchor `") in message
    assert message.endswith("The TRL and Unsloth integrations are off (trl.GRPOConfig has no adaptive-KL fields); the "
                            "core (AdaptiveKL), verl and Tinker work without TRL.")
    # clip at 0.5: k3 of r = ref - logp = (-1, 2): e^-1 + 1 - 1 = 0.367879 and e^2 - 2 - 1 = 4.389056 -> 0.5;
    # grpo's per-completion mean (0.367879 + 0.5) / 2, times beta 0.1
    assert float(term) == pytest.approx(0.1 * (math.exp(-1.0) + 0.5) / 2, abs=1e-6)
    assert state == "False False False True"  # nothing patched, nothing exported, trl's own objects untouched
    assert again == "patch(): True"


HALF_PATCHED = """
import sys, types, warnings
import trl
stock = trl.GRPOConfig
# an Unsloth whose rl module is loaded (imported before the package, no trainer generated) and renamed its generator
package = types.ModuleType("unsloth"); package.__path__ = []
models = types.ModuleType("unsloth.models"); models.__path__ = []
rl = types.ModuleType("unsloth.models.rl"); rl.patch_trl_rl_trainers_v2 = lambda *args: None
sys.modules.update({"unsloth": package, "unsloth.models": models, "unsloth.models.rl": rl})
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import unsloth_adaptive_kl
from unsloth_adaptive_kl import IncompatibleVersionWarning, IncompatibleVersionError
said = [str(w.message) for w in caught if issubclass(w.category, IncompatibleVersionWarning)]
print(len(said), "_patch_trl_rl_trainers" in said[0], "integrations are off" in said[0])
print(unsloth_adaptive_kl.is_patched(), trl.GRPOConfig is stock, hasattr(unsloth_adaptive_kl, "GRPOConfig"))
try:
    unsloth_adaptive_kl.patch()
except IncompatibleVersionError:
    print("refused", unsloth_adaptive_kl.is_patched(), trl.GRPOConfig is stock)
"""


REIMPORTED = """
import sys
import trl
import unsloth_adaptive_kl
patched = trl.GRPOConfig
for name in [name for name in sys.modules if name.startswith("unsloth_adaptive_kl")]:
    del sys.modules[name]
try:
    import unsloth_adaptive_kl
except ImportError as error:
    print(str(error).startswith("unsloth_adaptive_kl: trl is patched already, by an earlier import of this package"))
print(trl.GRPOConfig is patched, trl.GRPOConfig.__mro__.count(patched))
"""


def test_a_second_copy_of_the_package_refuses_to_patch_trl_again() -> None:
    """The package's modules removed from sys.modules and imported again (a notebook's autoreload does as much)
    took the patched trl objects for stock ones: the config class was subclassed twice, the loss wrapped twice (its
    first step raised a false missing-anchor error) and unpatch() could not restore trl. Now the second import
    refuses, saying why and what to do; the first copy's patch stays as it was."""
    import subprocess

    result = subprocess.run([sys.executable, "-c", REIMPORTED], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split("\n")[-3:] == ["True", "True 1", ""]


def test_a_missing_unsloth_anchor_leaves_trl_stock_too_as_its_warning_says() -> None:
    """patch() patched TRL, then the Unsloth hook raised: the import warned "the TRL and Unsloth integrations are off
    (trl.GRPOConfig has no adaptive-KL fields)" while trl.GRPOConfig had them and is_patched() was True. Now nothing
    is patched half-way, at the import and at a later patch()."""
    import subprocess

    result = subprocess.run([sys.executable, "-c", HALF_PATCHED], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split("\n")[-4:] == ["1 True True", "False True False", "refused False True", ""]


def stand_in_resolver(tmp_path, anchors: tuple, dropped: Optional[versions.Anchor]):
    """Maps each anchor's function name to a stand-in function (in a file, so its source can be read) whose body
    holds, as comments, the texts of every anchor of that name but `dropped`'s."""
    names = sorted({anchor.function for anchor in anchors})
    lines = []
    for index, name in enumerate(names):
        lines.append(f"def f{index}():")
        lines += [f"    # {anchor.text}" for anchor in anchors if anchor.function == name and anchor is not dropped]
        lines.append("    pass")
    (tmp_path / "stand_in.py").write_text("\n".join(lines) + "\n")
    spec = importlib.util.spec_from_file_location("stand_in", tmp_path / "stand_in.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return lambda name: getattr(module, f"f{names.index(name)}")


@pytest.mark.parametrize(("function", "text", "package"), [
    ("UnslothGRPOTrainer._generate_and_score_completions", "", "unsloth"),
    # the PEFT reference forward, which the synced reference stands in for
    ("UnslothGRPOTrainer._generate_and_score_completions", "with use_adapter(model, ", "unsloth"),
    ("UnslothGRPOTrainer.compute_loss", "", "unsloth"),
    ("grpo_compute_loss", "", "unsloth_zoo"),
    ("grpo_accumulated_loss", "", "unsloth_zoo"),
    ("_unsloth_grpo_sample_weight", "", "unsloth"),
])
@pytest.mark.parametrize("tested", [False, True])
def test_a_missing_unsloth_anchor_names_the_package_it_belongs_to(tmp_path, monkeypatch, function: str, text: str,
                                                                 package: str, tested: bool) -> None:
    """Unsloth generates UnslothGRPOTrainer's methods; the loss functions inlined beside them are unsloth_zoo's. A
    missing anchor (the first of its function, or the one whose text starts with `text`) names its own package, its
    installed version and the install that fixes it: a tested version (the anchor is missing from its installed
    source, not from that release) is reinstalled, not installed again."""
    from unsloth_adaptive_kl.integrations.unsloth import anchor_package

    found = Version("2026.10.9" if tested else "2026.11.1")  # installed or not here
    monkeypatch.setattr(versions, "installed_version", lambda name: found)

    dropped = next(anchor for anchor in versions.UNSLOTH_ANCHORS
                   if anchor.function == function and anchor.text.startswith(text))
    resolve = stand_in_resolver(tmp_path, versions.UNSLOTH_ANCHORS, dropped)
    assert versions.missing_anchors(versions.UNSLOTH_ANCHORS, resolve) == [dropped]
    with pytest.raises(versions.IncompatibleVersionError) as caught:
        versions.check_anchors(anchor_package, versions.UNSLOTH_ANCHORS, resolve, "Unsloth's generated trainer: ")
    message = str(caught.value)
    assert re.search(rf"^unsloth_adaptive_kl cannot patch {package}(==[\w.]+| \(not installed\)) \(tested: "
                     rf"{package}>=2026\.10\.7,<=2026\.10\.9\): the anchor `", message), message
    assert f"was not found in Unsloth's generated trainer: {function}." in message
    if tested:
        assert message.endswith(f"; this {package} is a tested version, so its installed source is not that "
                                "release's (a fork, a development build or an edited file): reinstall it, pip install "
                                f"--force-reinstall --no-deps '{package}==2026.10.9'.")
    else:
        assert message.endswith(f"; install a tested version: pip install '{package}>=2026.10.7,<=2026.10.9'.")


@pytest.mark.parametrize("package", ["unsloth", "unsloth_zoo"])
def test_an_untested_unsloth_or_unsloth_zoo_whose_anchors_hold_warns_naming_it(tmp_path, monkeypatch, package) -> None:
    from unsloth_adaptive_kl.integrations.unsloth import anchor_package

    found = {"unsloth": Version("2026.10.9"), "unsloth_zoo": Version("2026.10.9"), package: Version("2026.12.1")}
    monkeypatch.setattr(versions, "installed_version", found.__getitem__)
    monkeypatch.setattr(versions, "_warned", set())
    resolve = stand_in_resolver(tmp_path, versions.UNSLOTH_ANCHORS, None)
    with pytest.warns(versions.UntestedVersionWarning) as caught:
        versions.check_anchors(anchor_package, versions.UNSLOTH_ANCHORS, resolve)
    assert [str(warning.message).split(" (tested")[0] for warning in caught] == [
        f"unsloth_adaptive_kl is untested with {package}==2026.12.1"]


def test_an_anchor_with_another_form_takes_either_and_names_both_when_neither_is_there(tmp_path) -> None:
    """The luspo reduction is checked in the form of trl >= 1.10 or in trl 1.9.1's (which averages over the padding
    too): either passes; a source with neither is refused, naming both forms."""
    (luspo,) = [anchor for anchor in versions.TRL_ANCHORS if anchor.reason == "the luspo reduction"]
    assert luspo.or_text == ("loss = (per_token_loss * mask.sum(1, keepdim=True)).mean()",)
    for index, form in enumerate((luspo.text, *luspo.or_text)):
        (tmp_path / str(index)).mkdir()
        resolve = stand_in_resolver(tmp_path / str(index), (versions.Anchor(luspo.function, form, luspo.reason),), None)
        assert versions.missing_anchors((luspo,), resolve) == []
    neither = stand_in_resolver(tmp_path, (luspo,), luspo)
    assert versions.missing_anchors((luspo,), neither) == [luspo]
    with pytest.raises(versions.IncompatibleVersionError, match=re.escape(
            "the anchor `loss = (per_token_loss * mask).sum(-1).mean()` or `loss = (per_token_loss * mask.sum(1, "
            "keepdim=True)).mean()` (the luspo reduction) was not found in GRPOTrainer._compute_loss.")):
        versions.check_anchors("trl", (luspo,), neither)


def test_every_trl_anchor_is_found_in_the_installed_trl() -> None:
    assert versions.missing_anchors(versions.TRL_ANCHORS, trl_patch._stock_function) == []


@pytest.mark.parametrize(("package", "version"), [("torch", "2.15.0"), ("transformers", "5.25.0"), ("trl", "1.16.0"),
                                                  ("datasets", "5.2.0")])
def test_base_dependencies_admit_the_newest_releases(package: str, version: str) -> None:
    """A TRL user on the newest torch / transformers / trl installs this package without a downgrade: Unsloth's
    caps live in the `unsloth` extra only."""
    from packaging.requirements import Requirement

    project = pyproject()["project"]
    requirements = {Requirement(r).name: Requirement(r)
                    for r in project["dependencies"] + project["optional-dependencies"]["trl"]}
    assert requirements[package].specifier.contains(version)
    extra = [Requirement(r) for r in project["optional-dependencies"]["unsloth"]]
    assert {r.name for r in extra} == {"unsloth-adaptive-kl", "unsloth", "unsloth_zoo"}  # [trl] + Unsloth's caps
    assert all(r.specifier.contains("2026.10.9") and r.specifier.contains("2026.10.7") for r in extra)


def test_missing_kl_anchor_is_an_error_not_a_silent_stock_fallback(tokenizer, tmp_path, monkeypatch) -> None:
    """A trl whose _compute_loss no longer multiplies the KL by `self.beta` must fail loudly."""
    trainer = make_trainer(tokenizer, str(tmp_path), kl_adaptation_method="clip")

    monkeypatch.setattr(trl_patch, "_stock_compute_loss", lambda self, model, inputs: 0.0)
    with pytest.raises(versions.IncompatibleVersionError,
                       match=r"cannot patch trl==\d.*the anchor `per_token_loss = per_token_loss \+ self.beta \* per_token_kl`"):
        trainer._compute_loss(trainer.model, {"completion_mask": torch.ones(1, 2)})


def test_a_patch_set_block_restores_instance_inherited_and_absent_attributes_even_on_error() -> None:
    """The per-call overrides (the probe beta, the recorder, the reward weights) leave the trainer exactly as found:
    an inherited attribute must not be frozen onto the instance, an absent one must not appear."""
    from unsloth_adaptive_kl.integrations.patching import PatchSet

    class Owner:
        inherited = "class value"

    owner = Owner()
    owner.own = "instance value"
    for name in ("own", "inherited", "absent"):
        before = dict(vars(owner))
        with pytest.raises(RuntimeError), PatchSet() as patches:
            patches.replace(owner, name, "override")
            assert getattr(owner, name) == "override"
            raise RuntimeError("the block failed")
        assert vars(owner) == before, name
    assert Owner.inherited == "class value" and owner.inherited == "class value"
    Owner.inherited = "changed on the class"
    assert owner.inherited == "changed on the class"  # still read through the class, not a frozen copy


def test_the_stock_function_of_a_class_or_method_trl_lacks_is_none_so_its_anchor_is_reported_missing() -> None:
    """`_stock_function` resolves 'Owner.attribute' on GRPOTrainer (patched here: the replacement, which wraps the
    stock function, so the anchors are read from the stock source) or on a class of trl.trainer.callbacks. A trl that
    dropped the class or the method gives None, which check_anchors reports as that anchor missing (the
    IncompatibleVersionError naming it), not as an AttributeError from inside patch()."""
    assert inspect.unwrap(trl_patch._stock_function("GRPOTrainer._compute_loss")) is trl_patch._stock_compute_loss
    assert (trl_patch._stock_function("SyncRefModelCallback._sync_target_model")
            is trl.trainer.callbacks.SyncRefModelCallback._sync_target_model)
    for function in ("NoSuchCallback._sync_target_model", "SyncRefModelCallback._no_such_method"):
        assert trl_patch._stock_function(function) is None
        anchor = versions.Anchor(function, "alpha", "a stand-in")
        with pytest.raises(versions.IncompatibleVersionError,
                           match=re.escape(f"the anchor `alpha` (a stand-in) was not found in {function}.")):
            versions.check_anchors("trl", (anchor,), trl_patch._stock_function)


def kl_line_without_the_log_prob_call(self, model, inputs):
    """A changed trl: the KL line is there, but the policy log-probs no longer come from
    `self._get_per_token_logps_and_entropies`."""
    per_token_kl = torch.zeros(1, 2)
    return (per_token_kl + self.beta * per_token_kl).sum()


def test_a_loss_that_never_calls_the_policy_log_prob_method_is_an_error_naming_that_anchor(tokenizer, tmp_path,
                                                                                         monkeypatch) -> None:
    """The adapted KL reads the policy log-probs the stock loss computes: a trl whose `_compute_loss` reaches the KL
    line without calling `_get_per_token_logps_and_entropies` raises IncompatibleVersionError naming that call, not an
    IndexError."""
    trainer = make_trainer(tokenizer, str(tmp_path), kl_adaptation_method="clip")
    monkeypatch.setattr(trl_patch, "_stock_compute_loss", kl_line_without_the_log_prob_call)
    with pytest.raises(versions.IncompatibleVersionError, match=re.escape(
            "the anchor `= self._get_per_token_logps_and_entropies(` (the policy log-probs, for a non-default "
            "kl_estimator) was not found in GRPOTrainer._compute_loss.")):
        trainer._compute_loss(trainer.model, {"completion_mask": torch.ones(1, 2)})


class _UnloggedRewards(list):
    """A reward metric list that keeps nothing appended: a changed trl that no longer logs the mean reward there."""

    def append(self, value: object) -> None:
        pass


def test_a_generation_that_logs_no_mean_reward_is_an_error_naming_that_anchor(tokenizer, tmp_path) -> None:
    """The dynamic beta reads the mean reward the stock generation appends to `_metrics["train"]["reward"]`: when one
    training generation appends none, IncompatibleVersionError names that line."""
    from .conftest import PROMPTS

    trainer = make_trainer(tokenizer, str(tmp_path), kl_adaptation_method="dynamic")
    trainer.model.train()
    trainer._metrics["train"]["reward"] = _UnloggedRewards()
    with pytest.raises(versions.IncompatibleVersionError, match=re.escape(
            'the anchor `self._metrics[mode]["reward"].append(` (the mean reward the dynamic beta reads) was not found '
            "in GRPOTrainer._generate_and_score_completions.")):
        trainer._generate_and_score_completions([{"prompt": prompt} for prompt in PROMPTS[:4]])


def owner() -> type:
    """A class with two attributes for a PatchSet to replace."""
    return type("Owner", (), {"value": "original", "other": "other"})


def test_a_patch_set_restores_newest_first_down_to_a_kept_count_and_knows_what_it_replaced() -> None:
    """Three replacements, the first and third of one attribute: `restore(keep=1)` undoes the newest two (value back
    to 'first', other back to 'other'), `restore()` the first (value back to 'original'); `len` counts the
    replacements held and `replaced` answers for the owner and name of a held one only."""
    from unsloth_adaptive_kl.integrations.patching import PatchSet

    Owner = owner()
    patches = PatchSet()
    patches.replace(Owner, "value", "first")
    patches.replace(Owner, "other", "changed")
    patches.replace(Owner, "value", "second")
    assert len(patches) == 3 and patches.replaced(Owner, "value") and patches.replaced(Owner, "other")
    assert not patches.replaced(Owner, "absent") and not patches.replaced(type("Another", (), {}), "value")
    patches.restore(keep=1)
    assert len(patches) == 1 and (Owner.value, Owner.other) == ("first", "other")
    assert patches.replaced(Owner, "value") and not patches.replaced(Owner, "other")
    patches.restore()
    assert not patches and len(patches) == 0 and (Owner.value, Owner.other) == ("original", "other")


def test_a_restore_leaves_a_value_set_since_by_someone_else() -> None:
    """Unsloth points trl.GRPOConfig at the config it generates after the package patched it: unpatch() put TRL's own
    back over Unsloth's, beside Unsloth's trainer (which then failed on a config without Unsloth's fields). unpatch()'s
    restore undoes only what still holds the replacement it made; a block's is undone whatever the block set."""
    from unsloth_adaptive_kl.integrations.patching import PatchSet

    Owner = owner()
    patches = PatchSet()
    patches.replace(Owner, "value", "ours")
    patches.replace(Owner, "other", "ours too")
    Owner.other = "theirs"  # the newest replacement, set again since by another package
    patches.restore(leave_newer=True)  # leaves it, and goes on to restore the older one
    assert (Owner.value, Owner.other, len(patches)) == ("original", "theirs", 0)
    with PatchSet() as block:  # a block restores what was there before it, whatever it set since
        block.replace(Owner, "other", "ours")
        Owner.other = "set inside the block"
    assert Owner.other == "theirs"


def test_a_trainer_built_before_the_patch_says_so_at_its_first_step(tokenizer, tmp_path) -> None:
    """A trainer built while trl was stock (before `import unsloth_adaptive_kl`, here between unpatch() and patch())
    has no adaptive KL; the patched methods failed on "'GRPOTrainer' object has no attribute 'adaptive_kl'". A trainer
    built after the patch is not affected. The error names the trainer's class (here a user's subclass)."""
    unsloth_adaptive_kl.unpatch()
    try:
        early = make_trainer(tokenizer, str(tmp_path / "early"), max_steps=1, beta=0.04)
    finally:
        unsloth_adaptive_kl.patch()
    early.__class__ = type("MyGRPOTrainer", (type(early),), {})
    with pytest.raises(AttributeError, match=r"^adaptive_kl: this MyGRPOTrainer was built before unsloth_adaptive_kl "
                                             r"patched trl .* Build the trainer after `import unsloth_adaptive_kl`\.$"):
        early.train()
    later = make_trainer(tokenizer, str(tmp_path / "later"), max_steps=1, beta=0.04)
    assert later.adaptive_kl.current_beta == 0.04 and not hasattr(early, "adaptive_kl")
    # read on the class (help(), inspect.getmembers), the attribute is what stands there, not that error
    assert isinstance(type(early).adaptive_kl, trl_patch.BuiltBeforePatch)


def test_a_trainer_built_while_patched_and_trained_after_unpatch_says_so_before_its_first_step(tokenizer,
                                                                                                tmp_path) -> None:
    """unpatch() restores the stock trainer's methods, so a trainer built before it trained one stock step and then
    blamed "an override of _compute_loss or compute_loss that does not call super()", which no one wrote. Now the
    train() call names unpatch(): an error before any step with an adapted setting, a warning (once) with `none`. At
    beta=0 (no KL term, the stock loss either way) nothing is said."""
    from unsloth_adaptive_kl.integrations.trainer_hooks import LossHookCheck

    clip = make_trainer(tokenizer, str(tmp_path / "clip"), max_steps=1, kl_adaptation_method="clip")
    off = make_trainer(tokenizer, str(tmp_path / "off"), max_steps=1, kl_adaptation_method="clip", beta=0.0)
    stock = make_trainer(tokenizer, str(tmp_path / "none"), max_steps=1)
    unsloth_adaptive_kl.unpatch()
    try:
        with pytest.raises(RuntimeError, match=r"^adaptive_kl: this GRPOTrainer was built while unsloth_adaptive_kl "
                                               r"was patched, and unsloth_adaptive_kl\.unpatch\(\) has since restored "
                                               r"the stock trainer: .* \(kl_adaptation_method='clip'\)$"):
            clip.train()
        assert clip.state.global_step == 0
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                stock.train()
            except RuntimeError:  # stock trl 1.15 has no CPU log-prob path (troubleshooting.md, "trl 1.15 on a CPU")
                pass
        said = [str(w.message) for w in caught if str(w.message).startswith("adaptive_kl: ")]
        assert len(said) == 1 and "unpatch() has since restored the stock trainer" in said[0]
        (check,) = [callback for callback in off.callback_handler.callbacks if isinstance(callback, LossHookCheck)]
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message="adaptive_kl")
            check.on_train_begin(off.args, off.state, off.control)
    finally:
        unsloth_adaptive_kl.patch()


def test_a_stock_config_bound_before_the_import_says_why_it_refuses_an_adaptive_field() -> None:
    """`from trl import GRPOConfig` above the import binds trl's stock class: given an adaptive-KL field it raised the
    bare "unexpected keyword argument"; now the TypeError names the import order. Its stock fields work as before."""
    stock = unsloth_adaptive_kl.integrations.trl.StockGRPOConfig
    with pytest.raises(TypeError, match=r"^GRPOConfig\.__init__\(\) got an unexpected keyword argument "
                                        r"'kl_adaptation_method': this GRPOConfig is trl's stock class, bound before "
                                        r"`import unsloth_adaptive_kl` replaced trl\.GRPOConfig"):
        stock(output_dir="out", use_cpu=True, beta=0.04, kl_adaptation_method="clip", kl_clip_threshold=0.5)
    assert stock(output_dir="out", use_cpu=True, beta=0.04).beta == 0.04
    # what help() and inspect show of it: trl's own signature, not the wrapper's (*args, **kwargs)
    assert {"output_dir", "beta", "loss_type"} <= set(inspect.signature(stock).parameters)
    unsloth_adaptive_kl.unpatch()
    try:
        with pytest.raises(TypeError, match=r"unexpected keyword argument 'kl_adaptation_method'$"):
            stock(output_dir="out", use_cpu=True, kl_adaptation_method="clip")  # stock trl's own error again
    finally:
        unsloth_adaptive_kl.patch()


def test_a_config_with_adaptive_fields_built_while_unpatched_warns_that_a_trainer_will_not_read_them() -> None:
    """The package's GRPOConfig (`unsloth_adaptive_kl.GRPOConfig`, or a trl.GRPOConfig bound before unpatch()) still
    takes the fields after unpatch(); a stock trainer built from it trained without them, silently. The warning names
    every adapted field and points at the line that built the config; one without an adapted field warns nothing."""
    unsloth_adaptive_kl.unpatch()
    try:
        with pytest.warns(UserWarning, match=r"^kl_adaptation_method='clip', kl_reduction='token_mean' set while "
                                             r"unsloth_adaptive_kl is unpatched \(unpatch\(\)\): a GRPOTrainer built "
                                             r"now is trl's stock one, which reads none of the adaptive-KL fields\. "
                                             r"Call unsloth_adaptive_kl\.patch\(\) before building the trainer\.$"
                          ) as caught:
            unsloth_adaptive_kl.GRPOConfig(output_dir="x", use_cpu=True, beta=0.04, kl_adaptation_method="clip",
                                           kl_reduction="token_mean")
        assert [w.filename for w in caught if "unpatched" in str(w.message)] == [__file__]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            unsloth_adaptive_kl.GRPOConfig(output_dir="x", use_cpu=True, beta=0.04, kl_clip_threshold=0.5)
        assert not [w for w in caught if "unpatched" in str(w.message)]
    finally:
        unsloth_adaptive_kl.patch()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        unsloth_adaptive_kl.GRPOConfig(output_dir="x", use_cpu=True, beta=0.04, kl_adaptation_method="clip")
    assert not [w for w in caught if "unpatched" in str(w.message)]


def test_unpatch_names_a_config_with_adaptive_fields_that_no_patched_trainer_has_taken(tokenizer, tmp_path) -> None:
    """A GRPOConfig with adapted fields built while patched, then unpatch(), then its trainer: trl's stock trainer,
    which trained without the fields, silently. unpatch() now names each such config still alive, with the fields it
    holds then (one given them after it was built too, one set back to none not), at the caller's line; one a patched
    trainer took (the comparison of an adaptive run with stock) is not named, one whose trainer failed to build is,
    and a second unpatch() says nothing."""
    waiting = trl.GRPOConfig(output_dir=str(tmp_path / "a"), use_cpu=True, beta=0.04, kl_adaptation_method="clip",
                             kl_reduction="token_mean")
    set_later = trl.GRPOConfig(output_dir=str(tmp_path / "b"), use_cpu=True, beta=0.04)
    set_later.kl_estimator = "k2"
    set_back = trl.GRPOConfig(output_dir=str(tmp_path / "c"), use_cpu=True, beta=0.04, kl_adaptation_method="sigmoid")
    set_back.kl_adaptation_method = "none"
    invalid = trl.GRPOConfig(output_dir=str(tmp_path / "f"), use_cpu=True, beta=0.04, kl_adaptation_method="clip")
    invalid.kl_adaptation_method = ["no_such_method"]  # no trainer takes it (a patched one refuses it): not named, and
    # unpatch() neither raises on it nor stays patched
    gone = trl.GRPOConfig(output_dir=str(tmp_path / "d"), use_cpu=True, beta=0.04, kl_estimator="k1")
    taken = make_trainer(tokenizer, str(tmp_path / "taken"), max_steps=1, kl_adaptation_method="sigmoid")
    failed = trl.GRPOConfig(output_dir=str(tmp_path / "e"), use_cpu=True, beta=0.04, kl_adaptation_method="dynamic")
    failed.dynamic_beta_decay = 2.0  # refused when the trainer is built: no trainer took it
    with pytest.raises(ValueError, match=r"^dynamic_beta_decay=2\.0 is invalid"):
        make_trainer(tokenizer, str(tmp_path / "failed"), config=failed)
    del gone
    gc.collect()  # a config nothing holds any more is not named (nor one an earlier test left in a cycle)
    try:
        with pytest.warns(UserWarning, match=r"^unsloth_adaptive_kl\.unpatch\(\): 3 GRPOConfigs with adaptive-KL "
                                             r"fields \(kl_adaptation_method='clip', kl_reduction='token_mean'; "
                                             r"kl_estimator='k2'; kl_adaptation_method='dynamic'\), built while "
                                             r"patched, not yet given to a GRPOTrainer: a GRPOTrainer built from one "
                                             r"now is trl's stock one, which reads none of the adaptive-KL fields\. "
                                             r"Call unsloth_adaptive_kl\.patch\(\) before building the trainer\.$"
                          ) as caught:
            unsloth_adaptive_kl.unpatch()
        assert [w.filename for w in caught if "unpatch():" in str(w.message)] == [__file__]
        with warnings.catch_warnings(record=True) as again:
            warnings.simplefilter("always")
            unsloth_adaptive_kl.unpatch()
        assert not again
    finally:
        unsloth_adaptive_kl.patch()
    assert taken.args.kl_adaptation_method == "sigmoid" and waiting.beta == set_later.beta == set_back.beta == 0.04
    assert invalid.beta == 0.04


def test_the_trl_integrations_own_patch_is_idempotent_too() -> None:
    """`unsloth_adaptive_kl.patch()` returns early when TRL is patched; the integration's own `patch()`, called
    directly, is idempotent as well: a second call records no second replacement (17 here: the 16 patch points and
    the CPU fallback kernel where trl's has no CPU path, 16 otherwise) and leaves the fallback's upstream TRL's kernel,
    not the fallback itself (which would call itself on an accelerator)."""
    installed = len(trl_patch._patches)
    upstream = trl_patch.ChunkedLogProbWithCPUFallback.upstream
    trl_patch.patch()
    assert len(trl_patch._patches) == installed == 16 + trl_patch.kernel_lacks_cpu_path()
    assert trl_patch.ChunkedLogProbWithCPUFallback.upstream is upstream


def test_a_stock_config_bound_before_the_import_pickles_into_a_checkpoint_and_ours_as_before(tmp_path) -> None:
    """A GRPOConfig bound before the import is trl's stock class (it trains as `none`), whose name
    trl.trainer.grpo_config.GRPOConfig is ours while patched: pickle refused it, a PicklingError at the first
    checkpoint's training_args.bin, after save_steps of training. It pickles (and copies) by its attributes and comes
    back a stock config holding them; ours and a subclass pickle by their own names, as before; unpatched, the stock
    class pickles by its name again."""
    stock = trl_patch.StockGRPOConfig(output_dir=str(tmp_path), use_cpu=True, beta=0.04, max_steps=3, save_steps=2)
    torch.save(stock, tmp_path / "training_args.bin")  # as transformers' Trainer._save does
    back = torch.load(tmp_path / "training_args.bin", weights_only=False)
    assert type(back) is trl_patch.StockGRPOConfig and back.to_dict() == stock.to_dict() and back is not stock
    copied = copy.deepcopy(stock)
    assert type(copied) is trl_patch.StockGRPOConfig and copied.to_dict() == stock.to_dict()

    ours = trl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, beta=0.04, kl_adaptation_method="clip")
    back = pickle.loads(pickle.dumps(ours))
    assert type(back) is unsloth_adaptive_kl.GRPOConfig and back.kl_adaptation_method == "clip"
    assert pickle.dumps(ours).count(b"unsloth_adaptive_kl.integrations.trl") == 1  # by its class's name
    assert stock.__reduce_ex__(4)[0] is trl_patch.stock_config is not ours.__reduce_ex__(4)[0]

    unsloth_adaptive_kl.unpatch()
    try:
        assert stock.__reduce_ex__(4)[0] is not trl_patch.stock_config
        assert type(pickle.loads(pickle.dumps(stock))) is trl_patch.StockGRPOConfig
    finally:
        unsloth_adaptive_kl.patch()


def test_each_tested_range_ends_at_versions_the_recorded_ci_run_installed() -> None:
    """versions.TESTED is what the CI matrix runs, integration by integration: every bound of every range (TRL's trl
    1.9.1 and 1.16.0, Unsloth's transformers 5.17.0, the core's torch 2.4.0, ...) is a version that one row of the
    last recorded `.ci/run` (docs/results/ci.json) installed beside the package that brings that integration, so a
    user on a version CI ran gets no UntestedVersionWarning and a range never claims a version no row ran with it."""
    import json
    from pathlib import Path

    rows = json.loads((Path(__file__).parents[1] / "docs" / "results" / "ci.json").read_text())["rows"]
    for integration, packages in versions.TESTED.items():
        ran = {(package, Version(version).base_version) for row in rows
               if versions.BROUGHT_BY[integration] in row["versions"] for package, version in row["versions"].items()}
        for package, specifiers in packages.items():
            for specifier in specifiers:
                assert (package, specifier.version) in ran, (integration, package, str(specifier))
                assert Version(specifier.version) in specifiers, (package, str(specifier))  # a bound CI ran is tested


def _innermost_of_three_wrappers() -> str:
    return "the innermost function's own line"


def _wrap(function):
    def wrapper(*args, **kwargs):  # no functools.wraps, as Unsloth wraps some generated methods
        return function(*args, **kwargs)

    return wrapper


class _HeldByAClosure:
    """the source of a class a closure holds"""


def _recursive():
    def countdown(n: int) -> int:
        return n if n <= 0 else countdown(n - 1)  # its own closure holds countdown itself

    return countdown


def _with_an_empty_cell():
    def reads_a_name_not_bound_yet():
        return bound_later  # a cell of _with_an_empty_cell's, empty when it returns

    return reads_a_name_not_bound_yet
    bound_later = None  # never reached: the cell stays empty


def test_source_reads_through_three_wrappers_and_only_functions_and_ends_on_a_recursive_closure() -> None:
    """`source` is what every anchor is looked up in: a function wrapped three times without functools.wraps is read
    down to its own body; a closure cell that holds a class or a string is not read as source; a recursive function
    (its closure holds itself) is read without a RecursionError, one with an empty cell without a ValueError; a
    built-in and a function made by exec (no file) have none, so an anchor in them is reported missing, not a
    TypeError or OSError out of patch()."""
    assert "the innermost function's own line" in versions.source(_wrap(_wrap(_wrap(_innermost_of_three_wrappers))))

    held_class, held_text = _HeldByAClosure, "a string a closure holds"

    def holds_a_class_and_a_string():
        return held_class, held_text

    read = versions.source(holds_a_class_and_a_string)
    assert "def holds_a_class_and_a_string" in read and "the source of a class a closure holds" not in read

    assert "countdown(n - 1)" in versions.source(_recursive())
    assert "return bound_later" in versions.source(_with_an_empty_cell())  # an empty cell has no source: no ValueError

    namespace: dict = {}
    # a file name of its own: Python 3.13 keeps the source of `python -c` (how pytest-xdist starts a worker) under
    # "<string>", exec's default, where inspect then finds that command's line
    exec(compile("def generated(self):\n    per_token_loss = per_token_loss + self.beta * per_token_kl\n",
                 "<generated without a file>", "exec"), namespace)
    assert versions.source(len) == versions.source(namespace["generated"]) == ""
    objects = {"GRPOTrainer._compute_loss": namespace["generated"], "GRPOTrainer._save_checkpoint": len}
    anchors = (versions.TRL_KL_LINE, versions.Anchor("GRPOTrainer._save_checkpoint", "self, model", "a stand-in"))
    assert versions.missing_anchors(anchors, objects.get) == list(anchors)


def test_a_signature_anchor_holds_for_that_exact_parameter_list_only(monkeypatch) -> None:
    """`_save_checkpoint(self, model, trial)`, the beta state's checkpoint hook, is found in the installed trl; a trl
    whose method gains a parameter, or loses one, is refused naming the signature, as a missing line is."""
    (anchor,) = [a for a in versions.TRL_ANCHORS if a.function == "GRPOTrainer._save_checkpoint"]
    assert anchor.signature and anchor.text == "self, model, trial"
    assert versions.missing_anchors((anchor,), trl_patch._stock_function) == []

    def gained(self, model, trial, metrics=None): ...

    def lost(self, model): ...

    for changed in (gained, lost):
        assert versions.missing_anchors((anchor,), lambda name: changed) == [anchor]
        with pytest.raises(versions.IncompatibleVersionError, match=re.escape(
                "the anchor `self, model, trial` (the beta state saved with checkpoints) was not found in "
                "GRPOTrainer._save_checkpoint.")):
            versions.check_anchors("trl", (anchor,), lambda name: changed)


def test_a_refusal_names_the_first_missing_anchor_and_warns_no_untested_version(tmp_path, monkeypatch) -> None:
    """An untested trl (1.99.0) with two anchors missing: the error names the first in the order checked, and no
    UntestedVersionWarning (which says every anchor was found) comes with it; once the anchors hold, that version warns,
    once."""
    real = versions.installed_version
    monkeypatch.setattr(versions, "installed_version", lambda p: Version("1.99.0") if p == "trl" else real(p))
    monkeypatch.setattr(versions, "_warned", set())
    anchors = (versions.TRL_KL_LINE, versions.TRL_LOGPS_CALL, versions.TRL_REWARD_METRIC)
    reward_metric_only = stand_in_resolver(tmp_path, anchors[2:], None)("GRPOTrainer._generate_and_score_completions")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(versions.IncompatibleVersionError, match=re.escape(f"the anchor `{anchors[0].text}`")):
            versions.check_anchors("trl", anchors, lambda name: reward_metric_only)
    assert caught == []
    with pytest.warns(versions.UntestedVersionWarning) as caught:
        versions.check_anchors("trl", anchors[2:], lambda name: reward_metric_only)
        versions.check_anchors("trl", anchors[2:], lambda name: reward_metric_only)
    assert [str(w.message).split(" (")[0] for w in caught] == ["unsloth_adaptive_kl is untested with trl==1.99.0"]


@pytest.fixture
def stand_in_verl(tmp_path, monkeypatch):
    """A package named verl (verl itself is not installed in most CI rows; where it is, its modules are set aside for
    the test and put back after): verl.trainer.core_algos with a function and a class, imported by name as
    resolve_verl imports verl's."""
    for name in [name for name in sys.modules if name == "verl" or name.startswith("verl.")]:
        monkeypatch.delitem(sys.modules, name)
    (tmp_path / "verl" / "trainer").mkdir(parents=True)
    (tmp_path / "verl" / "__init__.py").write_text("")
    (tmp_path / "verl" / "trainer" / "__init__.py").write_text("")
    (tmp_path / "verl" / "trainer" / "core_algos.py").write_text(
        "def agg_loss(loss_mat, batch_num_tokens=None):\n"
        "    return loss_mat.sum() / batch_num_tokens\n\n\n"
        "class Controller:\n"
        "    def update(self, current_kl, n_steps):\n"
        "        self.value = current_kl\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    for name in [name for name in sys.modules if name == "verl" or name.startswith("verl.")]:
        del sys.modules[name]


def test_resolve_verl_takes_the_longest_module_then_attributes_and_none_for_what_is_gone(stand_in_verl) -> None:
    """'trainer.core_algos.agg_loss' is verl.trainer.core_algos's agg_loss (the module imported by its own name, not
    looked up as an attribute of verl.trainer, which it is not before it is imported); a method through its class; a
    function, module or package verl no longer has is None, so that anchor is missing even where its line still stands
    elsewhere in the module."""
    function = versions.resolve_verl("trainer.core_algos.agg_loss")
    import verl.trainer.core_algos as core_algos

    assert function is core_algos.agg_loss
    assert versions.resolve_verl("trainer.core_algos.Controller.update") is core_algos.Controller.update
    for gone in ("trainer.core_algos.renamed_agg_loss", "trainer.core_algos.Controller.renamed",
                 "trainer.no_such_module.agg_loss", "no_such_package.agg_loss"):
        assert versions.resolve_verl(gone) is None, gone
    moved = versions.Anchor("trainer.core_algos.renamed_agg_loss", "return loss_mat.sum() / batch_num_tokens",
                            "a line now in another function of the module")
    kept = versions.Anchor("trainer.core_algos.agg_loss", "return loss_mat.sum() / batch_num_tokens", "the line")
    assert versions.missing_anchors((kept, moved), versions.resolve_verl) == [moved]


def test_unsloth_zoos_bnpo_rule_is_read_from_its_grpo_compute_loss_and_a_third_form_is_refused() -> None:
    """Given num_items_in_batch, unsloth_zoo 2026.10.7 reduces bnpo by the global token count, 2026.10.9 by the
    micro-batch's own tokens (docs/estimators.md): read from the installed grpo_compute_loss (its file, not imported);
    a grpo_compute_loss with neither form is an IncompatibleVersionError naming unsloth_zoo, both forms and the install
    that fixes it."""
    import ast
    from pathlib import Path

    assert versions.unsloth_bnpo_rule('        elif loss_type in ["bnpo", "cispo", "dapo", "vespo"]:\n') == "global"
    assert versions.unsloth_bnpo_rule('        elif loss_type in ["cispo", "dapo", "vespo"]:\n') == "micro_batch"
    spec = importlib.util.find_spec("unsloth_zoo")
    if spec is None:
        pytest.skip("unsloth_zoo is not installed")
    expected = {"2026.10.7": "global", "2026.10.9": "micro_batch"}.get(importlib.metadata.version("unsloth_zoo"))
    if expected is None:
        pytest.skip("an unsloth_zoo outside the tested range")
    path = Path(spec.submodule_search_locations[0]) / "rl_replacements.py"
    text = path.read_text()
    (function,) = [node for node in ast.parse(text).body
                   if isinstance(node, ast.FunctionDef) and node.name == "grpo_compute_loss"]
    assert versions.unsloth_bnpo_rule(ast.get_source_segment(text, function)) == expected

    with pytest.raises(versions.IncompatibleVersionError) as caught, pytest.MonkeyPatch.context() as patch:
        patch.setattr(versions, "is_tested", lambda name: False)  # a new unsloth_zoo
        versions.unsloth_bnpo_rule('    elif loss_type in ["dapo"]:\n')
    message = str(caught.value)
    assert message.startswith("unsloth_adaptive_kl cannot patch unsloth_zoo==")
    assert ('the anchor `elif loss_type in ["bnpo", "cispo", "dapo", "vespo"]: or elif loss_type in ["cispo", "dapo", '
            '"vespo"]:` (the bnpo reduction) was not found in Unsloth\'s generated trainer: grpo_compute_loss.'
            ) in message
    assert message.endswith("pip install 'unsloth_zoo>=2026.10.7,<=2026.10.9'.")


def _raw_logits(z: torch.Tensor, softcap: float, logit_scale: float, temperature: float) -> torch.Tensor:
    """The h W^T + b that trl's kernel (`_transform`) turns into the logits `z` = softcap * tanh(logit_scale * (h W^T
    + b) / softcap) / temperature, each step undone by hand."""
    return softcap * torch.atanh(temperature * z / softcap) / logit_scale


def test_the_cpu_fallback_gives_hand_computed_log_probs_entropy_and_statistics_through_every_logit_step() -> None:
    """Two tokens whose logits, after the bias, the logit scale, the softcap and the temperature, are ln [1, 2, 1]
    (p = [1/4, 1/2, 1/4]) and ln [3, 1, 1] (p = [3/5, 1/5, 1/5]), targets 1 and 2: log p = ln 1/2 and ln 1/5; entropy
    1.5 ln 2 and -(0.6 ln 0.6 + 0.4 ln 0.2); log(sum p^2) = ln 3/8 and ln 11/25; mean logit ln 2 / 3 and ln 3 / 3; the
    first token's target is its argmax, the second's is not."""
    from unsloth_adaptive_kl.integrations.trl_cpu_fallback import chunked_logprob_torch

    softcap, logit_scale, temperature = 3.0, 0.5, 2.0
    z = torch.log(torch.tensor([[1.0, 2.0, 1.0], [3.0, 1.0, 1.0]], dtype=torch.float64))
    raw = _raw_logits(z, softcap, logit_scale, temperature)  # [token, vocab]
    bias = torch.tensor([0.25, -0.5, 0.0], dtype=torch.float64)
    hidden = torch.eye(2)  # token i reads weight column i
    weight = (raw - bias).T.float()  # [vocab, hidden]
    logprobs, entropy, log_sum_sq, mean_logits, is_top1 = chunked_logprob_torch(
        hidden, weight, bias.float(), torch.tensor([1, 2]), temperature, 4, softcap, logit_scale)
    ln = math.log
    expected = {"log p": [ln(1 / 2), ln(1 / 5)], "entropy": [1.5 * ln(2), -(0.6 * ln(0.6) + 0.4 * ln(0.2))],
                "log sum p^2": [ln(3 / 8), ln(11 / 25)], "mean logit": [ln(2) / 3, ln(3) / 3]}
    for name, got in zip(expected, (logprobs, entropy, log_sum_sq, mean_logits)):
        assert got.dtype == torch.float32 and got.tolist() == pytest.approx(expected[name], rel=1e-5, abs=1e-6), name
    assert is_top1.tolist() == [True, False]


def reference_logprobs(hidden, weight, bias, targets, temperature, softcap, logit_scale):
    """trl's kernel's outputs in float64 from its docstring's formula, on the logits as computed in the inputs' dtype
    (the kernel's projection tile is in that dtype; everything after it in float32)."""
    z = torch.nn.functional.linear(hidden, weight, bias).double() * logit_scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    z = z / temperature
    log_norm = torch.logsumexp(z, dim=-1)
    p = torch.exp(z - log_norm[:, None])
    logprobs = z.gather(-1, targets[:, None])[:, 0] - log_norm
    entropy = log_norm - (p * z).sum(-1)
    return logprobs, entropy, torch.log((p * p).sum(-1)), z.mean(-1), z.argmax(-1) == targets


@pytest.mark.parametrize(("dtype", "softcap", "logit_scale", "temperature"),
                         [(torch.float32, None, 1.0, 1.0), (torch.float32, 30.0, 0.25, 0.7),
                          (torch.float64, 5.0, 2.0, 1.3), (torch.bfloat16, 30.0, 1.0, 0.9)])
def test_the_cpu_fallback_matches_the_kernels_formula_in_value_dtype_and_gradient(dtype, softcap, logit_scale,
                                                                               temperature) -> None:
    """Random tokens over a 50-word vocabulary against the formula in float64: log-probs, entropy, log(sum p^2), mean
    logit and top-1 (float32 results, as the kernel's, from bfloat16 inputs too), and the gradient of log p + entropy
    for the hidden states, weight and bias; the statistics outside that gradient, as the kernel marks them."""
    from unsloth_adaptive_kl.integrations.trl_cpu_fallback import chunked_logprob_torch

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(7, 16, generator=g).to(dtype).requires_grad_()
    weight = torch.randn(50, 16, generator=g).to(dtype).requires_grad_()
    bias = torch.randn(50, generator=g).to(dtype).requires_grad_()
    targets = torch.randint(0, 50, (7,), generator=g)
    targets[0] = int(torch.nn.functional.linear(hidden, weight, bias)[0].argmax())  # one target that is the argmax
    got = chunked_logprob_torch(hidden, weight, bias, targets, temperature, 8, softcap, logit_scale)
    want = reference_logprobs(hidden, weight, bias, targets, temperature, softcap, logit_scale)
    assert [x.dtype for x in got] == [torch.float32] * 4 + [torch.bool]
    for name, a, b in zip(("log p", "entropy", "log sum p^2", "mean logit"), got, want):
        assert torch.allclose(a.double(), b, rtol=1e-5, atol=1e-5), name
    assert torch.equal(got[4], want[4]) and bool(got[4][0])
    assert [x.requires_grad for x in got] == [True, True, False, False, False]
    grads = torch.autograd.grad((got[0] + got[1]).sum(), (hidden, weight, bias))
    want_grads = torch.autograd.grad((want[0] + want[1]).sum(), (hidden, weight, bias))
    for a, b in zip(grads, want_grads):
        assert torch.allclose(a.double(), b.double(), rtol=1e-4, atol=1e-4)


def test_the_cpu_fallback_computes_only_the_requested_statistics() -> None:
    """As the kernel: each optional output is None unless named in `outputs`; the log-probs always come."""
    from unsloth_adaptive_kl.integrations.trl_cpu_fallback import OPTIONAL_OUTPUTS, chunked_logprob_torch

    hidden, weight, targets = torch.randn(3, 4), torch.randn(6, 4), torch.tensor([0, 5, 2])
    for requested in [(), *((name,) for name in OPTIONAL_OUTPUTS)]:
        got = chunked_logprob_torch(hidden, weight, None, targets, 1.0, 8, outputs=requested)
        assert got[0] is not None
        assert [name for name, x in zip(OPTIONAL_OUTPUTS, got[1:]) if x is not None] == list(requested)


@pytest.mark.parametrize(("targets", "expected"), [([1, 0], [True, True]), ([1, 1], [True, False]),
                                                   ([0, 2], [False, False])])
def test_the_cpu_fallback_takes_the_top1_on_the_logits_with_a_tie_going_to_the_first_as_the_kernel(targets,
                                                                                                expected) -> None:
    """As the kernel (the target is top-1 where its logit is a maximum above every earlier one): token 0's logits put
    word 1 at 1e-7 above word 0 (0.0), its strict argmax although their float32 log-probs round to one value (each is
    about -ln 1000, whose spacing is 4.8e-7); token 1's words 0 and 1 tie exactly at 0.5, so word 0 is its top-1 and
    word 1 is not. The other 998 words sit at -1e-3."""
    from unsloth_adaptive_kl.integrations.trl_cpu_fallback import chunked_logprob_torch

    z = torch.full((2, 1000), -1e-3)
    z[0, :2] = torch.tensor([0.0, 1e-7])
    z[1, :2] = 0.5
    assert z[0, 1] > z[0, 0]  # the margin survives float32
    is_top1 = chunked_logprob_torch(torch.eye(2), z.T.contiguous(), None, torch.tensor(targets), 1.0, 8)[4]
    assert is_top1.tolist() == expected


def test_the_cpu_fallback_sends_accelerator_tensors_to_trls_kernel_and_cpu_tensors_to_torch(monkeypatch) -> None:
    """`ChunkedLogProbWithCPUFallback.apply` with trl's kernel as `upstream` (stood in for: the Triton kernel needs a
    GPU): a tensor on another device (meta here) goes to the kernel with every argument, a CPU tensor to the torch path;
    without the kernel (no Triton) every tensor takes the torch path."""
    from unsloth_adaptive_kl.integrations.trl_cpu_fallback import ChunkedLogProbWithCPUFallback

    calls = []

    class Kernel:
        @staticmethod
        def apply(*args):
            calls.append(args)
            return "the kernel's outputs"

    def inputs(device: str) -> tuple:
        return torch.randn(2, 4, device=device), torch.randn(6, 4, device=device), None, \
            torch.tensor([0, 5], device=device), 1.0, 8

    monkeypatch.setattr(ChunkedLogProbWithCPUFallback, "upstream", Kernel)
    on_meta = inputs("meta")
    assert ChunkedLogProbWithCPUFallback.apply(*on_meta) == "the kernel's outputs"
    assert len(calls) == 1 and all(a is b for a, b in zip(calls[0], on_meta, strict=True))
    on_cpu = inputs("cpu")
    logprobs = ChunkedLogProbWithCPUFallback.apply(*on_cpu)[0]
    assert torch.allclose(logprobs, torch.log_softmax(on_cpu[0] @ on_cpu[1].T, -1)[[0, 1], [0, 5]]) and len(calls) == 1
    monkeypatch.setattr(ChunkedLogProbWithCPUFallback, "upstream", None)
    assert ChunkedLogProbWithCPUFallback.apply(*on_meta)[0].device.type == "meta" and len(calls) == 1


def test_a_package_importable_without_its_metadata_is_applied_with_one_warning_its_version_unknown(tmp_path,
                                                                                                 monkeypatch) -> None:
    """A package run from a source checkout on the path (verl run from its own clone, say) is importable with no
    package metadata: where its anchors hold it is applied, with one UntestedVersionWarning saying its version is
    unknown, not a PackageNotFoundError out of the import. A name nothing installs stands for it, with a tested range."""
    from packaging.specifiers import SpecifierSet

    absent = "unsloth_adaptive_kl_absent_package"
    monkeypatch.setitem(versions.TESTED, absent, {absent: SpecifierSet("==1.0")})
    monkeypatch.setitem(versions.OWNER, absent, absent)
    monkeypatch.setattr(versions, "_warned", set())
    anchor = versions.Anchor("f", "the line it relies on", "a stand-in")
    resolve = stand_in_resolver(tmp_path, (anchor,), None)
    with pytest.warns(versions.UntestedVersionWarning) as caught:
        versions.check_anchors(absent, (anchor,), resolve)
        versions.check_anchors(absent, (anchor,), resolve)
    assert [str(warning.message) for warning in caught] == [
        f"unsloth_adaptive_kl is untested with {absent} of unknown version (no package metadata) (tested: {absent}==1.0); "
        "every anchor it relies on was found, so it is applied. `python -m unsloth_adaptive_kl` checks it on this "
        "machine."]


GENERATION = "GRPOTrainer._generate_and_score_completions"
READ_AT_THE_REWARD_CALL = "read where it calls _calculate_rewards, for the KL in the reward"
# (the stock function, its text changed, the changed text, the anchor the refusal names and that anchor's reason)
CHANGED_TRL_SOURCES = [
    *((GENERATION, f"{local} = ", f"{local}_renamed = ", f"{local} = ", READ_AT_THE_REWARD_CALL)
      for local in ("old_per_token_logps", "sampling_per_token_logps", "ref_per_token_logps", "completion_mask",
                    "tool_mask")),
    # a trl without the frozen "ref" adapter copy: the PEFT reference forward the synced reference stands in for
    (GENERATION, 'adapter_name="ref" if "ref" in model.peft_config else None', "adapter_name=None",
     'with use_adapter(model, adapter_name="ref" if "ref" in model.peft_config else None):',
     "the PEFT reference forward, which runs with the synced reference after a sync"),
    ("GRPOTrainer._compute_loss", "loss = (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)",
     "loss = (per_token_loss * mask).sum() / mask.sum()",
     "loss = (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)", "the bnpo reduction"),
    ("GRPOTrainer._load_optimizer_and_scheduler", "(self, checkpoint)", "(self, checkpoint, strict=True)",
     "self, checkpoint", "the beta state restored on resume"),
    # a trl whose reference mix is another formula: the PEFT and full-model syncs call it
    ("SyncRefModelCallback._sync_target_model", "mul_(1.0 - alpha)", "mul_(alpha)",
     "target_param.data.mul_(1.0 - alpha).add_(copy_param.data, alpha=alpha)",
     "the reference mix alpha * policy + (1 - alpha) * reference"),
]


@pytest.mark.parametrize(("function", "old", "new", "anchor", "reason"), CHANGED_TRL_SOURCES,
                         ids=[f"{change[0]}:{change[2]}" for change in CHANGED_TRL_SOURCES])
def test_a_trl_whose_source_changed_where_an_integration_reads_it_is_refused_at_patch_time(
        tmp_path, function: str, old: str, new: str, anchor: str, reason: str) -> None:
    """The installed trl's own function with one line changed is refused by the patch-time check, naming that line,
    not left to fail (or silently differ) at the first generation or sync: the KL in the reward reads
    `_generate_and_score_completions`'s log-prob and mask locals where it calls `_calculate_rewards` (one renamed);
    the synced PEFT reference stands in for the `use_adapter` line of its reference forward (the "ref" adapter
    dropped); the reference sync calls `SyncRefModelCallback._sync_target_model`'s mix (its formula changed)."""
    stock = inspect.getsource(trl_patch._stock_function(function))  # indented as in its class, which it stays in
    assert old in stock
    (tmp_path / "changed_trl.py").write_text("from __future__ import annotations\n\n\nclass Changed:\n"
                                             + stock.replace(old, new))
    spec = importlib.util.spec_from_file_location("changed_trl", tmp_path / "changed_trl.py")
    changed = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(changed)
    replaced = getattr(changed.Changed, function.split(".")[-1])
    with pytest.raises(versions.IncompatibleVersionError, match=re.escape(
            f"the anchor `{anchor}` ({reason}) was not found in {function}.")):
        versions.check_anchors("trl", versions.TRL_ANCHORS, lambda name: replaced
                               if name == function else trl_patch._stock_function(name))
