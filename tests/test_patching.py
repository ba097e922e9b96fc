"""patch()/unpatch(): idempotent, reversible, version-checked, loud when an anchor is missing (SPEC 5)."""

from __future__ import annotations

import importlib.util
import inspect
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

from .conftest import make_trainer

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


def fake_version(monkeypatch, package: str, version: str) -> None:
    unsloth_adaptive_kl.unpatch()
    real = versions.installed_version
    monkeypatch.setattr(versions, "installed_version", lambda p: Version(version) if p == package else real(p))
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


@pytest.mark.parametrize(("function", "package"), [("UnslothGRPOTrainer._generate_and_score_completions", "unsloth"),
                                                   ("UnslothGRPOTrainer.compute_loss", "unsloth"),
                                                   ("grpo_compute_loss", "unsloth_zoo"),
                                                   ("grpo_accumulated_loss", "unsloth_zoo"),
                                                   ("_unsloth_grpo_sample_weight", "unsloth")])
def test_a_missing_unsloth_anchor_names_the_package_it_belongs_to(tmp_path, function: str, package: str) -> None:
    """Unsloth generates UnslothGRPOTrainer's methods; the loss functions inlined beside them are unsloth_zoo's. A
    missing anchor names its own package, its installed version and the install that fixes it."""
    from unsloth_adaptive_kl.integrations.unsloth import anchor_package

    dropped = next(anchor for anchor in versions.UNSLOTH_ANCHORS if anchor.function == function)
    resolve = stand_in_resolver(tmp_path, versions.UNSLOTH_ANCHORS, dropped)
    assert versions.missing_anchors(versions.UNSLOTH_ANCHORS, resolve) == [dropped]
    with pytest.raises(versions.IncompatibleVersionError) as caught:
        versions.check_anchors(anchor_package, versions.UNSLOTH_ANCHORS, resolve, "Unsloth's generated trainer: ")
    message = str(caught.value)
    assert re.search(rf"^unsloth_adaptive_kl cannot patch {package}(==[\w.]+| \(not installed\)) \(tested: "
                     rf"{package}>=2026\.10\.7,<=2026\.10\.9\): the anchor `", message), message
    assert f"was not found in Unsloth's generated trainer: {function}." in message
    assert message.endswith(f"pip install '{package}>=2026.10.7,<=2026.10.9'.")


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
    """The luspo reduction is checked in the form of trl >= 1.10 or in trl 1.9.1's (which sums over the padding too):
    either passes; a source with neither is refused, naming both forms."""
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


@pytest.mark.parametrize(("package", "version"), [("torch", "2.15.0"), ("transformers", "5.24.0"), ("trl", "1.16.0"),
                                                  ("datasets", "5.2.0")])
def test_base_dependencies_admit_the_newest_releases(package: str, version: str) -> None:
    """A TRL user on the newest torch / transformers / trl installs this package without a downgrade: Unsloth's
    caps live in the `unsloth` extra only."""
    import tomllib
    from pathlib import Path

    from packaging.requirements import Requirement

    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
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


def test_a_patch_set_restores_newest_first_down_to_a_kept_count_and_knows_what_it_replaced() -> None:
    """Three replacements, the first and third of one attribute: `restore(keep=1)` undoes the newest two (value back
    to 'first', other back to 'other'), `restore()` the first (value back to 'original'); `len` counts the
    replacements held and `replaced` answers for the owner and name of a held one only."""
    from unsloth_adaptive_kl.integrations.patching import PatchSet

    class Owner:
        value = "original"
        other = "other"

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


def test_the_trl_integrations_own_patch_is_idempotent_too() -> None:
    """`unsloth_adaptive_kl.patch()` returns early when TRL is patched; the integration's own `patch()`, called
    directly, is idempotent as well: a second call records no second replacement (13 here: the 12 patch points and
    the CPU fallback kernel where trl's has no CPU path, 12 otherwise) and leaves the fallback's upstream TRL's kernel,
    not the fallback itself (which would call itself on an accelerator)."""
    installed = len(trl_patch._patches)
    upstream = trl_patch.ChunkedLogProbWithCPUFallback.upstream
    trl_patch.patch()
    assert len(trl_patch._patches) == installed == 12 + trl_patch.kernel_lacks_cpu_path()
    assert trl_patch.ChunkedLogProbWithCPUFallback.upstream is upstream
