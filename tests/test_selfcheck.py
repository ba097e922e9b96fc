"""`python -m unsloth_adaptive_kl`, the self-check users run before a long run: exit code 0 on a working install,
non-zero naming the anchor when one is missing."""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import json
import os
import re
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch

from unsloth_adaptive_kl.core.errors import IncompatibleVersionError
from unsloth_adaptive_kl.integrations import versions
from unsloth_adaptive_kl.tools.selfcheck import Check

from .selfcheck_record import assert_like_the_record, run_self_check

ROOT = Path(__file__).parents[1]


def run(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    # on the CPU even where a GPU is visible, as every test here runs
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run([sys.executable, *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)


def test_self_check_passes_on_this_install(tmp_path) -> None:
    result, record = run_self_check(tmp_path)
    out = result.stdout
    for package in ("trl", "transformers", "torch"):
        assert f"] {package} version: {package}==" in out
    trl_anchors, unsloth_anchors = len(versions.TRL_ANCHORS), len(versions.UNSLOTH_ANCHORS)
    assert f"[ok] trl anchors: {trl_anchors} of {trl_anchors} found" in out
    assert "[ok] trl patched" in out
    assert "[ok] TRL GRPOTrainer on cpu: none == stock" in out
    assert "[ok] TRL GRPOTrainer on cpu: clip above every KL == stock" in out
    if importlib.util.find_spec("unsloth") is not None:
        assert f"[ok] unsloth anchors: {unsloth_anchors} of {unsloth_anchors} found" in out
        assert "[ok] Unsloth's generated trainer on cpu: none == stock" in out
        assert "[ok] Unsloth's generated trainer on cpu: clip above every KL == stock" in out
    assert "[FAIL]" not in out
    assert "self-check passed" in out.splitlines()[-1]
    assert record["versions"]["torch"] == importlib.metadata.version("torch")
    assert_like_the_record(record, "selfcheck.json")


def test_self_check_names_a_missing_anchor_and_fails(tmp_path) -> None:
    """A trl whose GRPOTrainer._compute_loss no longer has the KL line: the import warns (it raised before, and the
    self-check never ran), and the self-check names every anchor missing and fails."""
    script = tmp_path / "changed_trl.py"
    script.write_text(textwrap.dedent('''
        import runpy
        import trl.trainer.grpo_trainer as grpo_trainer

        def _compute_loss(self, model, inputs):
            return model(inputs).loss

        grpo_trainer.GRPOTrainer._compute_loss = _compute_loss
        runpy.run_module("unsloth_adaptive_kl", run_name="__main__")
    '''))
    result = run([str(script)], tmp_path)
    assert result.returncode != 0
    assert "IncompatibleVersionWarning: unsloth_adaptive_kl cannot patch trl==" in result.stderr
    assert ("the anchor `per_token_loss = per_token_loss + self.beta * per_token_kl` (the trainer's own per-token KL is "
            "taken at this line) was not found in GRPOTrainer._compute_loss") in result.stderr
    assert ("[FAIL] trl anchor missing: `per_token_loss = per_token_loss + self.beta * per_token_kl` in "
            "GRPOTrainer._compute_loss (the trainer's own per-token KL is taken at this line)") in result.stdout
    assert "[FAIL] trl patched" in result.stdout and "self-check FAILED" in result.stdout


def test_self_check_reports_a_trl_that_does_not_import_and_fails(tmp_path) -> None:
    """trl 0.27.0 (verl[fsdp]==0.9.1 pins it) does not import under transformers 5 (it imports `weave`): the
    self-check stopped in a traceback at its trl checks; it names the error in one failed line and goes on."""
    script = tmp_path / "broken_trl.py"
    script.write_text(textwrap.dedent('''
        import runpy
        import sys

        sys.modules["trl.data_utils"] = None  # fails inside trl's own source, as trl 0.27.0's `import weave` does
        runpy.run_module("unsloth_adaptive_kl", run_name="__main__")
    '''))
    result = run([str(script)], tmp_path)
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert (f"[FAIL] trl imports: unsloth_adaptive_kl cannot patch trl=={importlib.metadata.version('trl')} (tested: "
            "trl>=1.9.1,<=1.16.0): importing it failed (ModuleNotFoundError: import of trl.data_utils halted; "
            "None in sys.modules).") in result.stdout
    assert "[ok] core AdaptiveKL (torch alone)" in result.stdout and "self-check FAILED" in result.stdout


@pytest.mark.parametrize(("trl_version", "torch_version"), [("1.9.1", "2.4.0"), ("1.9.1", "2.14.1"),
                                                            ("1.99.0", "2.4.0")])
def test_a_trl_that_does_not_import_gets_the_fix_its_version_calls_for(monkeypatch, trl_version: str,
                                                                       torch_version: str) -> None:
    """trl 1.9.1, a tested version, does not import on torch 2.4 (it imports torch's FSDPModule): the error said to
    install a tested trl, which that user had. A tested trl's failure names the untested packages beside it, or, with
    those tested too, what the ImportError names; an untested trl's names the tested range."""
    from packaging.version import Version

    real = versions.installed_version
    monkeypatch.setattr(versions, "installed_version", lambda p: Version(trl_version) if p == "trl" else
                        Version(torch_version) if p == "torch" else Version("5.17.0") if p == "transformers" else
                        real(p))
    error = ImportError("cannot import name 'FSDPModule' from 'torch.distributed.fsdp'")
    message = str(versions.import_error("trl", error))
    assert message.startswith(f"unsloth_adaptive_kl cannot patch trl=={trl_version} (tested: trl>=1.9.1,<=1.16.0): "
                              "importing it failed (ImportError: cannot import name 'FSDPModule' from "
                              "'torch.distributed.fsdp'). Adaptive KL cannot be applied; ")
    if trl_version == "1.99.0":
        assert message.endswith("install a tested version: pip install 'trl>=1.9.1,<=1.16.0'.")
    elif torch_version == "2.4.0":  # transformers 5.17.0 is tested with TRL: only torch is named, with TRL's range
        assert message.endswith("this trl is a tested version, so what fails is what it imports: install tested "
                                "versions beside it (torch==2.4.0 (tested: torch>=2.6.0,<=2.15.0)).")
    else:
        assert message.endswith("this trl is a tested version, so what fails is what it imports: install what the "
                                "ImportError names.")


def test_an_import_this_package_makes_is_told_from_one_inside_trl(monkeypatch) -> None:
    """An ImportError from this package's own import of a trl or transformers name (its integration's modules) was
    reported as trl's ("importing it failed ... install what the ImportError names"), whose import works. The message
    now names the statement's file and line, and with every version tested calls it this package's defect; one raised
    inside another package's source keeps trl's message. Checked on real tracebacks: the TRL integration re-imported
    with its reference-sync module made unimportable, and code compiled under another package's path."""
    import unsloth_adaptive_kl
    from unsloth_adaptive_kl import integrations

    monkeypatch.setitem(sys.modules, "unsloth_adaptive_kl.integrations.ref_sync", None)
    monkeypatch.delitem(sys.modules, "unsloth_adaptive_kl.integrations.trl")
    monkeypatch.delattr(integrations, "trl")
    with pytest.raises(IncompatibleVersionError) as raised:
        unsloth_adaptive_kl._integrations()
    line = next(number for number, text in enumerate(Path(integrations.__file__).with_name("trl.py").read_text()
                                                     .splitlines(), 1) if text.startswith("from .ref_sync import"))
    assert str(raised.value) == (
        f"unsloth_adaptive_kl cannot patch {versions.describe('trl')}: this package's integration could not import "
        f"what it needs from trl or beside it, at unsloth_adaptive_kl/integrations/trl.py:{line} "
        "(ModuleNotFoundError: import of unsloth_adaptive_kl.integrations.ref_sync halted; None in sys.modules). "
        "Adaptive KL cannot be applied; with tested versions this is a defect of unsloth_adaptive_kl: please report it "
        "with this message.")
    from packaging.version import Version

    real = versions.installed_version
    monkeypatch.setattr(versions, "installed_version", lambda p: Version("1.99.0") if p == "trl" else real(p))
    with pytest.raises(IncompatibleVersionError) as raised:  # an untested trl: the versions to install, and how
        unsloth_adaptive_kl._integrations()
    assert str(raised.value).endswith("Adaptive KL cannot be applied; install tested versions (trl==1.99.0 (tested: "
                                      "trl>=1.9.1,<=1.16.0)): pip install 'trl>=1.9.1,<=1.16.0'.")

    def raised_in(path: str) -> ImportError:
        try:
            exec(compile("from trl import no_such_name_here", path, "exec"), {})
        except ImportError as error:
            return error
        raise AssertionError("the import did not fail")

    inside_trl = raised_in(str(Path(sys.modules["trl"].__file__).with_name("no_such_module.py")))
    ours = raised_in(str(Path(integrations.__file__).with_name("any_module.py")))
    assert versions.failed_import_here(inside_trl) is None
    assert versions.failed_import_here(ours) == "unsloth_adaptive_kl/integrations/any_module.py:1"
    assert "importing it failed (ImportError: cannot import name 'no_such_name_here'" in str(
        versions.import_error("trl", inside_trl))


def test_the_integrations_installed_are_those_whose_package_has_a_distribution(monkeypatch) -> None:
    """An integration counts as installed where the package that brings it (torch, trl, unsloth, verl) has
    distribution metadata; its version is not read (it was read, through is_tested, to learn that). The core is always
    there."""
    import importlib.metadata as metadata

    def distribution(name: str) -> metadata.Distribution:
        if name not in ("torch", "trl", "verl"):
            raise metadata.PackageNotFoundError(name)
        return metadata.PathDistribution(Path("/nonexistent"))

    monkeypatch.setattr(versions.importlib.metadata, "distribution", distribution)
    monkeypatch.setattr(versions, "installed_version", lambda package: pytest.fail(f"{package}'s version was read"))
    assert versions.installed_integrations() == ("core", "trl", "verl")


def test_an_untested_version_is_reported_not_failed(monkeypatch) -> None:
    from packaging.version import Version

    from unsloth_adaptive_kl.integrations import versions
    from unsloth_adaptive_kl.tools import selfcheck

    real = versions.installed_version
    monkeypatch.setattr(versions, "installed_version", lambda p: Version("1.99.0") if p == "trl" else real(p))
    monkeypatch.setattr(versions, "installed_integrations", lambda: ("core", "trl"))  # Unsloth or not
    trl_line = next(check for check in selfcheck.version_checks() if check.name == "trl version")
    assert trl_line.ok
    assert trl_line.line() == f"[untested] trl version: trl==1.99.0 (tested: trl{versions.tested_range('trl')})"


@pytest.mark.parametrize(("version", "status"), [("1.9.1", "ok"), ("1.16.0", "ok"), ("1.9.0", "untested"),
                                                 ("1.16.1", "untested")])
def test_the_trl_version_line_is_untested_just_outside_the_tested_range(monkeypatch, version, status) -> None:
    """The tested trl range is 1.9.1 to 1.16.0, both ends included (docs/changelog.md): its ends are reported ok, the
    releases just outside it untested."""
    from packaging.version import Version

    from unsloth_adaptive_kl.tools import selfcheck

    real = versions.installed_version
    monkeypatch.setattr(versions, "installed_version", lambda p: Version(version) if p == "trl" else real(p))
    monkeypatch.setattr(versions, "installed_integrations", lambda: ("core", "trl"))  # Unsloth or not
    trl_line = next(check for check in selfcheck.version_checks() if check.name == "trl version")
    assert trl_line.line() == f"[{status}] trl version: trl=={version} (tested: trl>=1.9.1,<=1.16.0)"


@pytest.mark.parametrize("here", [(), ("trl",), ("trl", "unsloth"), ("trl", "unsloth", "verl"), ("verl",)])
def test_a_version_is_read_against_the_ranges_of_the_integrations_installed(monkeypatch, here) -> None:
    """transformers 4.56.2 and torch 2.6.0 ran the TRL tests (row k), never Unsloth's (rows a and c: 5.17.0 and
    2.14.1) nor verl's (row h: 5.10.4 and 2.13.0): with TRL alone they are tested; beside Unsloth or verl they are
    untested, the line naming each integration's range. torch is read against the core's range too (rows i to b:
    2.4.0 to 2.15.0), the only one where no integration is installed; trl, which only TRL and Unsloth run with, keeps
    TRL's range on a verl install."""
    from packaging.version import Version

    from unsloth_adaptive_kl.tools import selfcheck

    installed = {"trl": "1.9.1", "transformers": "4.56.2", "torch": "2.6.0", "unsloth": "2026.10.7",
                 "unsloth_zoo": "2026.10.7"}
    monkeypatch.setattr(versions, "installed_version", lambda p: Version(installed[p]))
    monkeypatch.setattr(versions, "installed_integrations", lambda: ("core", *here))
    lines = [check.line() for check in selfcheck.version_checks()]
    ranges = {"the core": (None, None, "torch>=2.4.0,<=2.15.0"),
              "TRL": ("trl>=1.9.1,<=1.16.0", "transformers>=4.56.2,<=5.25.0", "torch>=2.6.0,<=2.15.0"),
              "Unsloth": ("trl==1.15.0", "transformers==5.17.0", "torch==2.14.1"),
              "verl": (None, "transformers==5.10.4", "torch==2.13.0")}
    installed_here = [name for name in ("TRL", "Unsloth", "verl") if name.lower() in here]

    def tested(package: int, names: list[str]) -> str:
        found = [(ranges[name][package], name) for name in names if ranges[name][package]]
        return found[0][0] if len(found) == 1 else "; ".join(f"{r} with {name}" for r, name in found)

    # trl: the ranges of TRL and Unsloth where installed, else its owner's (TRL); transformers: those installed, else
    # every integration's (the core has none); torch: the core's and those installed
    trl = tested(0, [name for name in installed_here if name != "verl"] or ["TRL"])
    transformers = tested(1, installed_here or ["TRL", "Unsloth", "verl"])
    torch_ranges = tested(2, ["the core", *installed_here])
    assert lines[:3] == [
        f"[{'ok' if here in ((), ('trl',), ('verl',)) else 'untested'}] trl version: trl==1.9.1 (tested: {trl})",
        f"[{'ok' if here == ('trl',) else 'untested'}] transformers version: transformers==4.56.2 (tested: "
        f"{transformers})",
        f"[{'ok' if here in ((), ('trl',)) else 'untested'}] torch version: torch==2.6.0 (tested: {torch_ranges})"]
    assert lines[3:] == [
        "[ok] unsloth version: unsloth==2026.10.7 (tested: unsloth>=2026.10.7,<=2026.10.9)",
        "[ok] unsloth_zoo version: unsloth_zoo==2026.10.7 (tested: unsloth_zoo>=2026.10.7,<=2026.10.9)"]


def test_a_package_not_installed_is_reported_so_not_as_untested(monkeypatch) -> None:
    """On a TRL-only install the Unsloth lines say '(not installed)', with the range, lower bound first, and are not
    marked untested: a package with a tested range and no installed distribution (a real lookup, of a name nothing
    installs) is reported the same way."""
    from packaging.specifiers import SpecifierSet

    from unsloth_adaptive_kl.tools import selfcheck

    absent = "unsloth_adaptive_kl_absent_package"
    monkeypatch.setitem(versions.TESTED, absent, {absent: SpecifierSet("<=2.0,>=1.0")})
    monkeypatch.setitem(versions.OWNER, absent, absent)
    monkeypatch.setattr(selfcheck, "VERSION_PACKAGES", (absent,))
    assert versions.is_tested(absent) is None
    assert [check.line() for check in selfcheck.version_checks()] == [
        f"[ok] {absent} version: {absent} (not installed) (tested: {absent}>=1.0,<=2.0)"]


# ----- what a mutation audit of tools/selfcheck.py found unpinned: a check must fail when what it checks is broken --


def test_a_failed_check_reads_fail_even_when_its_version_is_untested() -> None:
    assert Check("x", True).line() == "[ok] x"
    assert Check("x", False, "off by 2").line() == "[FAIL] x: off by 2"
    assert Check("x", False, "off by 2", untested=True).line() == "[FAIL] x: off by 2"


def _anchored() -> int:
    value = 41 + 1  # the line the anchor below names
    return value


def test_anchor_checks_count_the_found_anchors_and_name_each_missing_one() -> None:
    from unsloth_adaptive_kl.tools import selfcheck

    present = versions.Anchor("_anchored", "value = 41 + 1", "it is here")
    changed = versions.Anchor("_anchored", "value = 41 + 2", "the line changed")
    gone = versions.Anchor("_gone", "anything", "the function is gone")
    resolve = {"_anchored": _anchored}.get
    assert [c.line() for c in selfcheck.anchor_checks("pkg", (present,), resolve)] == ["[ok] pkg anchors: 1 of 1 found"]
    assert [c.line() for c in selfcheck.anchor_checks("pkg", (present, changed, gone), resolve)] == [
        "[FAIL] pkg anchors: 1 of 3 found",
        "[FAIL] pkg anchor missing: `value = 41 + 2` in _anchored (the line changed)",
        "[FAIL] pkg anchor missing: `anything` in _gone (the function is gone)"]


def broken_core(monkeypatch, change) -> None:
    """`core_checks` on an `AdaptiveKL` whose KL term is `change(term, logps)`."""
    import unsloth_adaptive_kl.core as core
    from unsloth_adaptive_kl.core.adaptive_kl import AdaptiveKL

    class Broken(AdaptiveKL):
        def kl_loss(self, logps, ref, mask, *args, **kwargs):
            term, rest = super().kl_loss(logps, ref, mask, *args, **kwargs)
            return change(term, logps), rest

    monkeypatch.setattr(core, "AdaptiveKL", Broken)


def test_the_core_check_holds_for_the_core_and_fails_for_its_value_or_one_gradient_off(monkeypatch) -> None:
    """The float32 bounds of `core_checks` (16 and 7 operations of EPS32 / 2 = 6e-8 on magnitudes a few times the
    values) are a few 1e-6 of the loss and below 1e-7 per gradient: a core whose value alone is 1e-4 off, or whose
    gradient of one token alone is 1e-3 * beta / 24 = 1.7e-6 off (beta / (4 sequences * 6 tokens) is that token's
    weight), is outside them, and the check must say so."""
    from unsloth_adaptive_kl.tools import selfcheck

    (honest,) = selfcheck.core_checks()
    assert honest.ok, honest.line()
    loss, hand = float(honest.detail.split()[1]), float(honest.detail.split()[3])
    bound, grad_bound = (float(part.split(")")[0]) for part in honest.detail.split("(bound ")[1:])
    step = 1e-3 * 0.04 / 24
    assert bound < 1e-4 * loss / 10 and grad_bound < step / 10  # each change below is over 10 times its bound
    broken_core(monkeypatch, lambda term, logps: term + 1e-4 * term.detach())  # value only: the same gradient
    (value,) = selfcheck.core_checks()
    assert not value.ok, value.line()
    assert float(value.detail.split()[1]) / loss == pytest.approx(1 + 1e-4, abs=1e-6)
    assert float(value.detail.split()[3]) == hand and value.detail.endswith(honest.detail.split("), ")[1])
    # the first token's gradient 1.7e-6 too large, the value unchanged (x - x.detach() is 0)
    broken_core(monkeypatch, lambda term, logps: term + step * (logps[0, 0] - logps[0, 0].detach()))
    (gradient,) = selfcheck.core_checks()
    assert not gradient.ok and gradient.detail.split("), ")[0] == honest.detail.split("), ")[0], gradient.line()
    assert float(gradient.detail.split("max grad diff ")[1].split()[0]) == pytest.approx(step, rel=0.05)


def test_length_reward_is_a_tenth_of_the_length_mod_5_of_a_text_or_of_the_last_message() -> None:
    from unsloth_adaptive_kl.tools.selfcheck import length_reward

    conversation = [{"role": "user", "content": "abcdefgh"}, {"role": "assistant", "content": "abcd"}]
    assert length_reward(["abc", "abcdefg", "abcde", conversation]) == pytest.approx([0.3, 0.2, 0.0, 0.4])


def test_comparison_inputs_moves_the_reference_and_spreads_the_advantages_on_a_copy() -> None:
    """The reference from -1 to +1 nat across the tokens, the advantages from -1 to +1 across the completions (all 0
    here, as a batch whose completions all earned one reward has them), on a copy: the captured batch is unchanged."""
    from unsloth_adaptive_kl.tools.selfcheck import comparison_inputs

    ref, advantages = torch.zeros(2, 3), torch.zeros(2)
    inputs = {"ref_per_token_logps": ref, "advantages": advantages, "completion_mask": torch.ones(2, 3)}
    compared = comparison_inputs(inputs)
    torch.testing.assert_close(compared["ref_per_token_logps"], torch.tensor([[-1.0, -0.6, -0.2], [0.2, 0.6, 1.0]]),
                               rtol=0, atol=1e-6)
    assert compared["advantages"].tolist() == [-1.0, 1.0]
    assert compared["completion_mask"] is inputs["completion_mask"]
    assert inputs["ref_per_token_logps"] is ref and torch.equal(ref, torch.zeros(2, 3))  # the captured batch unchanged
    assert inputs["advantages"] is advantages and torch.equal(advantages, torch.zeros(2))


def linear_trainer():
    """A stand-in trainer: y = w . x + b, w of 2 weights, and a frozen parameter that must get no gradient."""
    model = torch.nn.Linear(2, 1)
    model.register_parameter("frozen", torch.nn.Parameter(torch.ones(1), requires_grad=False))
    return types.SimpleNamespace(model=model)


def test_backward_grads_returns_this_loss_gradients_and_refuses_missing_or_all_zero_ones() -> None:
    from unsloth_adaptive_kl.tools.selfcheck import MissingGradients, backward_grads

    trainer = linear_trainer()
    w, b = trainer.model.weight, trainer.model.bias
    for p in (w, b):
        p.grad = torch.full_like(p, 100.0)  # left over from an earlier backward: not this loss's
    grads = backward_grads(trainer, (w * torch.tensor([[1.0, 2.0]])).sum() + 3 * b.sum())
    assert [g.tolist() for g in grads] == [[[1.0, 2.0]], [3.0]]
    assert w.grad is None and b.grad is None  # cleared after
    grads = backward_grads(trainer, w.sum() + 0 * b.sum())  # one zero gradient among non-zero ones is a gradient
    assert [g.tolist() for g in grads] == [[[1.0, 1.0]], [0.0]]
    with pytest.raises(MissingGradients, match="^1 of 2 trained parameters got no gradient$"):
        backward_grads(trainer, w.sum())
    with pytest.raises(MissingGradients, match="^every gradient is zero$"):
        backward_grads(trainer, 0 * (w.sum() + b.sum()))


@pytest.fixture(scope="module")
def trl_trainer_and_batch(tmp_path_factory):
    """The self-check's TRL trainer and one captured batch, its reference moved as the self-check moves it."""
    from unsloth_adaptive_kl.tools import selfcheck

    trainer = selfcheck.tiny_trainer(str(tmp_path_factory.mktemp("selfcheck")))
    inputs = selfcheck.captured_inputs(trainer, "_compute_loss")
    trainer.default_clip_threshold = trainer.args.kl_clip_threshold
    return trainer, inputs


@contextlib.contextmanager
def changed_stock(trainer, change):
    """Stock TRL inside the block, its loss `change(loss)`."""
    from unsloth_adaptive_kl.tools.selfcheck import stock_trl

    with stock_trl():
        stock = trainer._compute_loss
        trainer._compute_loss = lambda model, inputs: change(stock(model, inputs))
        try:
            yield
        finally:
            del trainer._compute_loss


def compare(trainer, inputs, stock) -> list[str]:
    from unsloth_adaptive_kl.tools import selfcheck

    trainer._metrics["train"].clear()
    trainer.args.kl_clip_threshold = trainer.default_clip_threshold  # as built: the comparisons set it themselves
    return [check.line() for check in selfcheck.compare_with_stock("TRL", trainer, "_compute_loss", stock, inputs)]


def compare_with_adapted(trainer, inputs, adapted) -> list[str]:
    """`compare` against stock TRL's loss as it is, the hooked side replaced by `adapted(model, batch)`."""
    from unsloth_adaptive_kl.tools.selfcheck import stock_trl

    @contextlib.contextmanager
    def stock():
        with stock_trl():
            del trainer._compute_loss
            try:
                yield
            finally:
                trainer._compute_loss = adapted

    trainer._compute_loss = adapted
    try:
        return compare(trainer, inputs, stock)
    finally:
        del trainer._compute_loss


def test_compare_with_stock_fails_a_loss_or_one_parameters_gradient_1e_4_off(trl_trainer_and_batch) -> None:
    """The comparison's bounds are tokens * EPS32 of the loss's magnitude (`absolute_loss`) and twice that of the
    largest gradient, tokens <= 32 (4 completions of at most 8): under 8e-6 of each. The hook on the real trainer
    holds; against a stock loss 1e-4 of its magnitude off (its gradients unchanged), or the last trained parameter's
    gradient 1e-4 of the largest gradient off (the loss unchanged), both comparisons fail."""
    from unsloth_adaptive_kl.tools.selfcheck import absolute_loss, comparison_inputs, loss_and_grads, stock_trl

    trainer, inputs = trl_trainer_and_batch
    assert 0 < int(inputs["completion_mask"].sum()) <= 32
    honest = compare(trainer, inputs, stock_trl)
    assert [line.split(": ")[0] for line in honest] == ["[ok] TRL", "[ok] TRL", "[ok] TRL"], honest
    assert [line.split(": ")[1] for line in honest] == ["stock gradients", "none == stock",
                                                        "clip above every KL == stock"]

    with stock_trl():
        magnitude = absolute_loss(trainer, "_compute_loss", comparison_inputs(inputs))
    lines = compare(trainer, inputs, lambda: changed_stock(trainer, lambda loss: loss + 1e-4 * magnitude))
    assert lines[0].startswith("[ok] TRL: stock gradients") and all(line.startswith("[FAIL]") for line in lines[1:])

    with stock_trl():
        _, grads = loss_and_grads(trainer, "_compute_loss", comparison_inputs(inputs))
    step = 1e-4 * max(g.abs().max().item() for g in grads)
    last = [p for p in trainer.model.parameters() if p.requires_grad][-1]
    lines = compare(trainer, inputs, lambda: changed_stock(
        trainer, lambda loss: loss + step * (last.sum() - last.sum().detach())))
    assert lines[0].startswith("[ok] TRL: stock gradients") and all(line.startswith("[FAIL]") for line in lines[1:])
    assert all(f"max grad diff {step:.2g}" in line for line in lines[1:]), lines


def test_compare_with_stock_allows_what_stock_differs_from_itself_and_names_it(trl_trainer_and_batch) -> None:
    """A stock whose gradient moves between two runs (a GPU's backward may sum in another order each time): the last
    parameter's gradient off by +step, then -step, 1e-4 of the largest gradient. `none` (off from the first run by
    step, which fails against a stock that is off the same way each run: the test above) is within what stock
    differs from itself (2 step), and each line names that difference."""
    from unsloth_adaptive_kl.tools.selfcheck import loss_and_grads, comparison_inputs, stock_trl

    trainer, inputs = trl_trainer_and_batch
    with stock_trl():
        _, grads = loss_and_grads(trainer, "_compute_loss", comparison_inputs(inputs))
    step = 1e-4 * max(g.abs().max().item() for g in grads)
    last = [p for p in trainer.model.parameters() if p.requires_grad][-1]
    signs = iter([1.0, -1.0, 1.0])  # the two runs of stock, then its magnitude (no gradient)
    lines = compare(trainer, inputs, lambda: changed_stock(
        trainer, lambda loss: loss + next(signs) * step * (last.sum() - last.sum().detach())))
    assert all(line.startswith("[ok] TRL") for line in lines), lines
    assert all(line.endswith(f"max grad diff {step:.2g}, stock against itself: loss 0, max grad diff "
                             f"{2 * step:.2g}") for line in lines[1:]), lines


@pytest.mark.parametrize(("precision", "eps"), [("bf16", 2**-7), ("fp16", 2**-10)])
def test_under_autocast_the_no_op_clips_gradient_bound_is_the_autocast_precisions(
        trl_trainer_and_batch, precision, eps) -> None:
    """On a GPU the trainer runs under bf16 (or fp16) autocast: `none` is the stock loss itself and keeps float32's
    bound, but the no-op clip adds its KL term outside the stock loss, whose gradient the autocast backward rounds at
    that precision's epsilon (2**-7, 2**-10): its bound is 2 * tokens * eps * max|grad|, named on its line. A gradient
    1e-4 of the largest off fails `none` and passes the clip's."""
    from unsloth_adaptive_kl.tools.selfcheck import comparison_inputs, loss_and_grads, stock_trl

    trainer, inputs = trl_trainer_and_batch
    with stock_trl():
        _, grads = loss_and_grads(trainer, "_compute_loss", comparison_inputs(inputs))
    scale = max(g.abs().max().item() for g in grads)
    step = 1e-4 * scale
    last = [p for p in trainer.model.parameters() if p.requires_grad][-1]
    setattr(trainer.args, precision, True)  # read by the comparison alone: the trainer's autocast was set when built
    try:
        lines = compare(trainer, inputs, lambda: changed_stock(
            trainer, lambda loss: loss + step * (last.sum() - last.sum().detach())))
    finally:
        setattr(trainer.args, precision, False)
    tokens = int(inputs["completion_mask"].sum())
    assert lines[1].startswith("[FAIL] TRL: none == stock") and "bound" not in lines[1]
    assert lines[2].startswith("[ok] TRL: clip above every KL == stock")
    assert lines[2].endswith(f"max grad diff {step:.2g} (bound {2 * tokens * eps * scale:.2g}, a {precision} backward)")


def test_compare_with_stock_fails_when_the_hook_is_not_in_effect(trl_trainer_and_batch) -> None:
    """Unpatched, the 'adapted' loss is stock's and equals it: what fails the comparison is that no adaptive_kl
    metric was logged."""
    from unsloth_adaptive_kl.tools.selfcheck import stock_trl

    trainer, inputs = trl_trainer_and_batch
    with stock_trl():
        lines = compare(trainer, inputs, contextlib.nullcontext)
    assert [line.split(": ")[:2] for line in lines] == [
        ["[ok] TRL", "stock gradients"], ["[FAIL] TRL", "none == stock"],
        ["[FAIL] TRL", "clip above every KL == stock"]]
    assert all(line.endswith(", adaptive_kl metrics not logged") for line in lines[1:]), lines


def test_each_comparison_reads_the_metrics_its_own_run_logged(trl_trainer_and_batch) -> None:
    """Stock TRL's loss for the stock run and the clip comparison, the hook for `none` alone: the clip line fails for
    want of its own metrics (`none`'s were read as its own, and it passed)."""
    from unsloth_adaptive_kl.tools.selfcheck import stock_trl

    trainer, inputs = trl_trainer_and_batch
    hooked = trainer._compute_loss
    with stock_trl():
        stock = type(trainer)._compute_loss
    calls = []

    def hook_then_stock(model, batch):
        calls.append(len(calls))
        return hooked(model, batch) if len(calls) == 4 else stock(trainer, model, batch)  # stock x 2, |stock|, none

    trainer._compute_loss = hook_then_stock
    try:
        lines = compare(trainer, inputs, contextlib.nullcontext)
    finally:
        del trainer._compute_loss
    assert len(calls) == 5
    assert [line.split(": ")[:2] for line in lines] == [
        ["[ok] TRL", "stock gradients"], ["[ok] TRL", "none == stock"], ["[FAIL] TRL", "clip above every KL == stock"]]
    assert lines[2].endswith(", adaptive_kl metrics not logged"), lines


def test_compare_with_stock_really_runs_clip_in_its_second_comparison(trl_trainer_and_batch, monkeypatch) -> None:
    """With a threshold the per-token KLs of the moved reference (up to e - 2 = 0.72) exceed, clip changes the loss,
    and the second comparison must fail while `none` still holds."""
    from unsloth_adaptive_kl.tools import selfcheck

    trainer, inputs = trl_trainer_and_batch
    monkeypatch.setattr(selfcheck, "NO_OP_CLIP", dict(kl_adaptation_method="clip", kl_clip_threshold=0.01))
    lines = compare(trainer, inputs, selfcheck.stock_trl)
    assert [line.split(": ")[0] for line in lines] == ["[ok] TRL", "[ok] TRL", "[FAIL] TRL"], lines


def test_compare_with_stock_fails_on_missing_stock_or_adapted_gradients(trl_trainer_and_batch) -> None:
    trainer, inputs = trl_trainer_and_batch
    lines = compare(trainer, inputs, lambda: changed_stock(trainer, lambda loss: 0 * loss))
    assert lines == ["[FAIL] TRL: stock gradients: every gradient is zero"]

    lines = compare_with_adapted(trainer, inputs, lambda model, batch: 0 * type(trainer)._compute_loss(
        trainer, model, batch))
    assert lines[0].startswith("[ok] TRL: stock gradients")
    assert lines[1:] == ["[FAIL] TRL: none == stock: every gradient is zero",
                         "[FAIL] TRL: clip above every KL == stock: every gradient is zero"]


def test_the_trl_checks_fail_and_compare_nothing_when_trl_is_not_patched(monkeypatch, tmp_path) -> None:
    from unsloth_adaptive_kl.tools import selfcheck

    def no_trainer(*args, **kwargs):
        raise AssertionError("nothing may be compared")

    monkeypatch.setattr(selfcheck, "tiny_trainer", no_trainer)
    with selfcheck.stock_trl():
        checks = selfcheck.trl_checks(str(tmp_path))
    assert [c.line() for c in checks if not c.ok] == ["[FAIL] trl patched"]
    assert len(checks) == 2  # the anchors' and the patch's


def test_the_unsloth_checks_fail_on_a_failed_generation_a_fallback_or_an_unhooked_trainer(monkeypatch, tmp_path):
    """Without importing Unsloth here: its generation failing, falling back to TRL's trainer, or a generated trainer
    whose module does not hold the hooked loss are FAIL lines, and nothing is compared."""
    from unsloth_adaptive_kl.integrations import unsloth as unsloth_patch
    from unsloth_adaptive_kl.tools import selfcheck

    def no_trainer(*args, **kwargs):
        raise AssertionError("nothing may be compared")

    monkeypatch.setattr(selfcheck, "tiny_trainer", no_trainer)
    monkeypatch.setattr(selfcheck, "generate_unsloth_trainer", lambda *_: "ImportError: no unsloth_zoo")
    assert [c.line() for c in selfcheck.unsloth_checks(str(tmp_path))] == [
        "[FAIL] Unsloth trainer generated and hooked: ImportError: no unsloth_zoo"]
    monkeypatch.setattr(selfcheck, "generate_unsloth_trainer", lambda *_: None)
    monkeypatch.setattr(unsloth_patch, "generated_grpo_trainer", lambda: None)
    assert [c.line() for c in selfcheck.unsloth_checks(str(tmp_path))] == [
        "[FAIL] Unsloth trainer generated: Unsloth fell back to TRL's trainer (see its warning)"]
    generated = types.ModuleType("unsloth_adaptive_kl_test_generated")
    generated.UnslothEfficientGRPO = object()  # Unsloth's own, not the hooked one
    generated.UnslothGRPOTrainer = type("UnslothGRPOTrainer", (), {"__module__": generated.__name__})
    monkeypatch.setitem(sys.modules, generated.__name__, generated)
    monkeypatch.setattr(unsloth_patch, "generated_grpo_trainer", lambda: generated.UnslothGRPOTrainer)
    monkeypatch.setattr(versions, "UNSLOTH_ANCHORS", ())
    assert [c.line() for c in selfcheck.unsloth_checks(str(tmp_path))] == [
        "[ok] unsloth anchors: 0 of 0 found", "[FAIL] Unsloth trainer hooked"]


def test_generating_unsloths_trainer_turns_on_its_cpu_switch_and_returns_an_import_error(monkeypatch) -> None:
    """On this CPU machine: UNSLOTH_ALLOW_CPU and UNSLOTH_COMPILE_DISABLE set to 1, UNSLOTH_COMPILE_LOCATION in the
    run's folder, and an Unsloth that cannot be imported (None in sys.modules, without importing the real one here)
    returned as the error the FAIL line shows."""
    from unsloth_adaptive_kl.tools import selfcheck

    for name in ("UNSLOTH_ALLOW_CPU", "UNSLOTH_COMPILE_DISABLE"):
        monkeypatch.setenv(name, "unset")  # so that the test's end removes what the call sets
        monkeypatch.delenv(name)
    monkeypatch.setitem(sys.modules, "unsloth", None)
    monkeypatch.setenv("UNSLOTH_COMPILE_LOCATION", "unset")
    monkeypatch.delenv("UNSLOTH_COMPILE_LOCATION")
    error = selfcheck.generate_unsloth_trainer("/run/folder")
    assert error == "ModuleNotFoundError: import of unsloth halted; None in sys.modules"
    assert (os.environ["UNSLOTH_ALLOW_CPU"], os.environ["UNSLOTH_COMPILE_DISABLE"]) == ("1", "1")
    # Unsloth's generated trainer goes to the run's folder, not ./unsloth_compiled_cache in the user's directory
    assert os.environ["UNSLOTH_COMPILE_LOCATION"] == "/run/folder/unsloth_compiled_cache"


def fake_parts(monkeypatch, installed: set, **parts) -> None:
    """`main` with each part's checks given and only `installed` of trl, unsloth and verl found."""
    from unsloth_adaptive_kl.tools import selfcheck

    real = importlib.util.find_spec
    monkeypatch.setattr(selfcheck.importlib.util, "find_spec", lambda name, *a: (
        (object() if name in installed else None) if name in ("trl", "unsloth", "verl") else real(name, *a)))
    monkeypatch.setattr(selfcheck, "version_checks", lambda: [Check("trl version", True, "trl==9.0", untested=True)])
    monkeypatch.setattr(selfcheck, "core_checks", lambda: [Check("core", True, "fine")])
    for name, checks in parts.items():
        monkeypatch.setattr(selfcheck, name, lambda output_dir, checks=checks: checks)


def test_main_fails_on_any_failed_check_and_writes_what_it_printed(monkeypatch, tmp_path, capsys) -> None:
    """`main` with every part installed and its checks given: two FAILs among 6 checks, the last one of them, are
    exit 1 and 'FAILED: 4 of 6', and the record says it did not pass, with the lines as printed and verl among the
    versions looked up."""
    from unsloth_adaptive_kl.tools import selfcheck

    fake_parts(monkeypatch, {"trl", "unsloth", "verl"}, trl_checks=[Check("trl a", True), Check("trl b", False, "off")],
               unsloth_checks=[Check("unsloth a", True)], verl_checks=[Check("verl a", False)])
    looked_up = []
    monkeypatch.setattr(selfcheck, "installed_versions", lambda packages: looked_up.extend(packages) or {})
    torch.backends.cuda.matmul.allow_tf32 = True
    assert selfcheck.main(str(tmp_path / "out" / "record.json")) == 1
    assert torch.backends.cuda.matmul.allow_tf32 is False  # the summation bounds are float32's
    out = capsys.readouterr().out.splitlines()
    assert out[1:-1] == ["[untested] trl version: trl==9.0", "[ok] core: fine", "[ok] trl a", "[FAIL] trl b: off",
                         "[ok] unsloth a", "[FAIL] verl a"]
    assert re.fullmatch(r"self-check FAILED: 4 of 6 checks hold \(\d+ s\)", out[-1]), out[-1]
    record = json.loads((tmp_path / "out" / "record.json").read_text())
    assert record["passed"] is False and record["lines"] == out
    assert looked_up == ["trl", "transformers", "torch", "unsloth", "unsloth_zoo", "verl"]


def test_a_part_that_raises_is_one_fail_line_and_the_other_parts_still_run(monkeypatch, tmp_path, capsys) -> None:
    """TRL's part raising (an untested trl renamed an input the comparison reads, say) is one FAIL line naming the part
    and the exception; Unsloth's and verl's parts still run, the exit is 1 and the record is written."""
    from unsloth_adaptive_kl.tools import selfcheck

    fake_parts(monkeypatch, {"trl", "unsloth", "verl"}, unsloth_checks=[Check("unsloth a", True)],
               verl_checks=[Check("verl a", True)])

    def renamed(output_dir):
        raise KeyError("old_per_token_logps")

    monkeypatch.setattr(selfcheck, "trl_checks", renamed)
    monkeypatch.setattr(selfcheck, "installed_versions", lambda packages: {})
    assert selfcheck.main(str(tmp_path / "record.json")) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[1:-1] == ["[untested] trl version: trl==9.0", "[ok] core: fine",
                         "[FAIL] TRL's checks: KeyError: 'old_per_token_logps'", "[ok] unsloth a", "[ok] verl a"]
    assert re.fullmatch(r"self-check FAILED: 4 of 5 checks hold \(\d+ s\)", out[-1]), out[-1]
    assert json.loads((tmp_path / "record.json").read_text())["lines"] == out


def test_main_runs_the_trainer_parts_only_where_their_packages_are_and_passes_when_every_check_holds(
        monkeypatch, tmp_path, capsys) -> None:
    from unsloth_adaptive_kl.tools import selfcheck

    parts = dict(trl_checks=[Check("trl a", True)], unsloth_checks=[Check("unsloth a", True)],
                 verl_checks=[Check("verl a", True)])
    fake_parts(monkeypatch, {"unsloth", "verl"}, **parts)  # no trl: no TRL or Unsloth trainer to check
    assert selfcheck.main(str(tmp_path / "record.json")) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1:-1] == ["[untested] trl version: trl==9.0", "[ok] core: fine", "[ok] verl a"]
    assert re.fullmatch(r"self-check passed: 3 of 3 checks hold \(\d+ s\)", out[-1]), out[-1]
    assert json.loads((tmp_path / "record.json").read_text())["passed"] is True
    fake_parts(monkeypatch, {"trl", "unsloth"}, **parts)
    assert selfcheck.main() == 0
    assert capsys.readouterr().out.splitlines()[3:-1] == ["[ok] trl a", "[ok] unsloth a"]


def test_stock_unsloth_bypasses_every_hook_on_a_step_inside_the_block_only() -> None:
    """Unsloth's own training step inside the block (without importing Unsloth: a generated module of the same shape,
    the shim keeping Unsloth's function as `upstream`, each method wrapper its upstream as `__wrapped__`, the module's
    `use_adapter` this package's): the loss, the generation's, the rewards' and the evaluation's methods, the step-end
    check of the loss hook, and TRL's own `use_adapter` (the real generated trainer: test_unsloth's config scenario);
    the hooks again after it."""
    import functools

    from trl.trainer import utils as trl_utils

    from transformers import TrainerCallback

    from unsloth_adaptive_kl.integrations.ref_sync import use_reference
    from unsloth_adaptive_kl.integrations.trainer_hooks import LossHookCheck
    from unsloth_adaptive_kl.tools.selfcheck import stock_unsloth

    def unsloths_loss(*args, **kwargs):
        return "unsloth's"

    def shim(*args, **kwargs):
        return "adapted"

    shim.upstream = unsloths_loss
    methods, wrappers = {}, {}
    for name in ("compute_loss", "_generate_and_score_completions", "_calculate_rewards", "prediction_step",
                 "_save_checkpoint"):
        def method(self, *args, **kwargs):
            return "unsloth's"

        methods[name] = method
        wrappers[name] = functools.wraps(method)(lambda self, *args, **kwargs: "wrapped")

    module = types.ModuleType("unsloth_adaptive_kl_test_generated_module")
    module.UnslothEfficientGRPO, module.use_adapter = shim, use_reference
    trainer_class = type("UnslothGRPOTrainer", (), {"__module__": module.__name__, **wrappers})
    sys.modules[module.__name__] = module
    try:
        with stock_unsloth(trainer_class()):
            assert module.UnslothEfficientGRPO is unsloths_loss and module.use_adapter is trl_utils.use_adapter
            for name in ("compute_loss", "_generate_and_score_completions", "_calculate_rewards", "prediction_step"):
                assert vars(trainer_class)[name] is methods[name], name
            assert trainer_class._save_checkpoint is wrappers["_save_checkpoint"]  # not a step's: kept
            assert LossHookCheck.on_step_end is TrainerCallback.on_step_end  # stock steps skip the loss hook
        assert LossHookCheck.on_step_end is not TrainerCallback.on_step_end
        assert module.UnslothEfficientGRPO is shim and module.use_adapter is use_reference
        assert {name: vars(trainer_class)[name] for name in wrappers} == wrappers
    finally:
        del sys.modules[module.__name__]


# ----- a second mutation audit: each bound exactly as documented, in both directions, and each check wired to stock --


def core_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The values `core_checks` draws (seed 0, 4 x 6 float32 log-probs about -5, then the reference; lengths 6, 3, 1,
    5)."""
    generator = torch.Generator().manual_seed(0)
    logps, ref = torch.randn(4, 6, generator=generator) - 5.0, torch.randn(4, 6, generator=generator) - 5.0
    lengths = torch.tensor([6, 3, 1, 5])
    return logps, ref, (torch.arange(6)[None] < lengths[:, None]).double()


def test_the_core_check_fails_just_outside_its_documented_bounds_and_holds_inside_them_either_way(monkeypatch):
    """The docstring's bounds, written out here: the value's is 16 * EPS32 / 2 * sum over the real tokens of
    beta / (4 L_i) * (e^r (1 + |r|) + |r| + 1), each token's gradient's 7 * EPS32 / 2 * beta / (4 L_i) *
    (e^r (1 + |r|) + 1), r = ref - logp; the line names both (the gradient's largest). The value off by 1.1 of its
    bound, up or down, fails, by 0.9 holds (the honest difference is 6e-10 of a bound of 3e-7, a float32 ulp of the
    value 4e-9); the gradient of the token where its bound is largest (the second of the 3-token row: 7e-8, the
    honest difference 4e-9, an ulp 4e-9) off by 1.25 of its bound fails, by 0.75 holds."""
    from unsloth_adaptive_kl.tools import selfcheck

    logps, ref, mask = core_inputs()
    r = (ref - logps).double()
    weight = 0.04 / (4 * mask.sum(-1, keepdim=True)) * mask
    bound = float(16 * 2**-24 * (weight * (torch.exp(r) * (1 + r.abs()) + r.abs() + 1)).sum())
    grad_bounds = 7 * 2**-24 * weight * (torch.exp(r) * (1 + r.abs()) + 1)
    row, token = divmod(int(grad_bounds.argmax()), 6)
    assert (row, token) == (1, 1) and 2e-7 < bound < 5e-7 and 3e-8 < float(grad_bounds[row, token]) < 1e-7
    (honest,) = selfcheck.core_checks()
    assert honest.ok and honest.detail.endswith(f"(bound {grad_bounds.max().item():.2g})"), honest.line()
    assert f" (bound {bound:.2g}), " in honest.detail, honest.line()
    for times, ok in ((1.1, False), (-1.1, False), (0.9, True), (-0.9, True)):
        broken_core(monkeypatch, lambda term, logps: term + times * bound)
        (value,) = selfcheck.core_checks()
        assert value.ok is ok, (times, value.line())
    for times, ok in ((1.25, False), (-1.25, False), (0.75, True), (-0.75, True)):
        step = times * float(grad_bounds[row, token])
        broken_core(monkeypatch, lambda term, logps: term + step * (logps[row, token] - logps[row, token].detach()))
        (gradient,) = selfcheck.core_checks()
        assert gradient.ok is ok, (times, gradient.line())


def test_the_core_check_fails_a_core_that_ignores_the_mask(monkeypatch) -> None:
    """The check's sequences are 6, 3, 1 and 5 of 6 tokens long: a core that counts the padding too is off."""
    import unsloth_adaptive_kl.core as core
    from unsloth_adaptive_kl.core.adaptive_kl import AdaptiveKL
    from unsloth_adaptive_kl.tools import selfcheck

    class PaddingCounted(AdaptiveKL):
        def kl_loss(self, logps, ref, mask, *args, **kwargs):
            return super().kl_loss(logps, ref, torch.ones_like(mask), *args, **kwargs)

    monkeypatch.setattr(core, "AdaptiveKL", PaddingCounted)
    (check,) = selfcheck.core_checks()
    assert not check.ok, check.line()


@pytest.mark.parametrize("half", [False, True])
def test_compare_with_stock_fails_just_outside_its_documented_bounds_and_holds_inside_them(
        trl_trainer_and_batch, half) -> None:
    """The bounds, written out here: the loss's tokens * EPS32 * (the stock loss with every advantage -|A|), each
    gradient's 2 * tokens * EPS32 * max |stock gradient|, tokens the completions' real ones (every position of the 4
    completions, or the first half of each, the rest masked out). The stock loss off by 1.5 of its bound, up or down,
    fails both comparisons and by 0.5 holds them; the last parameter's stock gradient off by 1.3 of its bound fails,
    by 0.7 holds (the honest differences are 0 on this CPU)."""
    from unsloth_adaptive_kl.tools.selfcheck import comparison_inputs, stock_trl

    trainer, inputs = trl_trainer_and_batch
    width = inputs["completion_mask"].shape[1]
    length = width // 2 if half else width
    inputs = {**inputs, "completion_mask": (torch.arange(width) < length).float().expand(4, width).clone()}
    moved = comparison_inputs(inputs)
    tokens = 4 * length
    with stock_trl():
        trainer.model.train()
        with torch.no_grad():
            magnitude = trainer._compute_loss(trainer.model, {**moved, "advantages": -moved["advantages"].abs()})
        loss = trainer._compute_loss(trainer.model, dict(moved))
        loss.backward()
    trained = [p for p in trainer.model.parameters() if p.requires_grad]
    scale = max(p.grad.abs().max().item() for p in trained)
    for p in trained:
        p.grad = None
    loss_bound, grad_bound = tokens * 2**-23 * magnitude.item(), 2 * tokens * 2**-23 * scale
    assert 0 < loss_bound < 1e-5 and 0 < grad_bound < 1e-5
    last = trained[-1]
    for times, ok in ((1.5, False), (-1.5, False), (0.5, True), (-0.5, True)):
        lines = compare(trainer, inputs, lambda: changed_stock(trainer, lambda stock: stock + times * loss_bound))
        assert [line.startswith("[ok]") for line in lines] == [True, ok, ok], (times, lines)
    for times, ok in ((1.3, False), (-1.3, False), (0.7, True), (-0.7, True)):
        lines = compare(trainer, inputs, lambda: changed_stock(
            trainer, lambda stock: stock + times * grad_bound * (last.sum() - last.sum().detach())))
        assert [line.startswith("[ok]") for line in lines] == [True, ok, ok], (times, lines)


def test_compare_with_stock_allows_a_stock_loss_that_moves_between_its_two_runs(trl_trainer_and_batch) -> None:
    """A stock loss 1e-4 of itself up in its first run and down in its second (its gradients unchanged): `none` and
    the no-op clip are 1e-4 off the first, far beyond the reordered sum's bound but within what stock differs from
    itself (2e-4 of the loss), and each line names that difference."""
    from unsloth_adaptive_kl.tools.selfcheck import loss_and_grads, comparison_inputs, stock_trl

    trainer, inputs = trl_trainer_and_batch
    with stock_trl():
        loss, _ = loss_and_grads(trainer, "_compute_loss", comparison_inputs(inputs))
    delta = 1e-4 * abs(loss)
    signs = iter([1.0, -1.0, 0.0])  # the two runs of stock, then its magnitude
    lines = compare(trainer, inputs, lambda: changed_stock(trainer, lambda stock: stock + next(signs) * delta))
    assert all(line.startswith("[ok] TRL") for line in lines), lines
    assert all(line.endswith(f", stock against itself: loss {2 * delta:.2g}, max grad diff 0") for line in lines[1:])


def test_the_trl_checks_compare_against_stock_trl(monkeypatch, tmp_path) -> None:
    """`trl_checks` takes its stock side from `stock_trl`: a stock TRL whose loss is 1e-4 of itself off fails both
    comparisons (a stock side that is the hooked trainer itself would hold them whatever the hook did)."""
    from unsloth_adaptive_kl.tools import selfcheck

    real = selfcheck.stock_trl
    entered = []

    @contextlib.contextmanager
    def off_stock():
        with real():
            trainer = entered[-1]
            stock = trainer._compute_loss
            trainer._compute_loss = lambda model, inputs: stock(model, inputs) * (1 + 1e-4)
            try:
                yield
            finally:
                del trainer._compute_loss

    build = selfcheck.tiny_trainer
    monkeypatch.setattr(selfcheck, "tiny_trainer", lambda *args, **kwargs: entered.append(build(*args, **kwargs))
                        or entered[-1])
    monkeypatch.setattr(selfcheck, "stock_trl", off_stock)
    lines = [check.line() for check in selfcheck.trl_checks(str(tmp_path))]
    assert [line.split(": ")[1] for line in lines if line.startswith("[FAIL]")] == [
        "none == stock", "clip above every KL == stock"], lines


def test_the_unsloth_checks_compare_the_generated_trainers_loss_against_stock_unsloth(monkeypatch, tmp_path) -> None:
    """Without importing Unsloth: a hooked generated trainer with its anchors found is compared on its
    `compute_loss` against `stock_unsloth` of that same trainer, and the comparison's lines are the part's."""
    from unsloth_adaptive_kl.integrations import unsloth as unsloth_patch
    from unsloth_adaptive_kl.tools import selfcheck

    generated = types.ModuleType("unsloth_adaptive_kl_test_hooked")
    generated.UnslothEfficientGRPO = unsloth_patch._AdaptiveEfficientGRPO
    generated.UnslothGRPOTrainer = type("UnslothGRPOTrainer", (), {"__module__": generated.__name__})
    monkeypatch.setitem(sys.modules, generated.__name__, generated)
    monkeypatch.setattr(selfcheck, "generate_unsloth_trainer", lambda *_: None)
    monkeypatch.setattr(unsloth_patch, "generated_grpo_trainer", lambda: generated.UnslothGRPOTrainer)
    monkeypatch.setattr(versions, "UNSLOTH_ANCHORS", ())
    trainer = object()
    monkeypatch.setattr(selfcheck, "tiny_trainer", lambda *args, **kwargs: trainer)
    monkeypatch.setattr(selfcheck, "stock_unsloth", lambda given: ("stock Unsloth of", given))
    seen = []

    def compare_with_stock(name, given, compute, stock, inputs=None):
        seen.append((given, compute, stock()))
        return [Check(f"{name}: none == stock", False, "off")]

    monkeypatch.setattr(selfcheck, "compare_with_stock", compare_with_stock)
    assert [c.line() for c in selfcheck.unsloth_checks(str(tmp_path))] == [
        "[ok] unsloth anchors: 0 of 0 found", "[ok] Unsloth trainer hooked",
        "[FAIL] Unsloth's generated trainer on cpu: none == stock: off"]
    assert seen == [(trainer, "compute_loss", ("stock Unsloth of", trainer))]


def test_stock_trl_patches_again_when_its_block_raises() -> None:
    """A comparison that raises inside the stock block (its stock gradients missing) must not leave TRL unpatched for
    the checks after it."""
    from unsloth_adaptive_kl.integrations import trl as trl_patch
    from unsloth_adaptive_kl.tools.selfcheck import MissingGradients, stock_trl

    assert trl_patch.is_patched()
    with pytest.raises(MissingGradients):
        with stock_trl():
            assert not trl_patch.is_patched()
            raise MissingGradients("every gradient is zero")
    assert trl_patch.is_patched()


def test_the_device_is_cuda_where_a_gpu_is_visible(monkeypatch) -> None:
    from unsloth_adaptive_kl.tools import selfcheck

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert selfcheck.device() == "cuda"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert selfcheck.device() == "cpu"


def test_the_tiny_trainer_runs_on_the_cpu_here_and_prints_no_log_lines_of_its_own(trl_trainer_and_batch) -> None:
    """On this CPU machine the trainer is told to use the CPU (not an MPS device, say), and the self-check's output
    is its own lines: the trainer's PrinterCallback (a dict printed per logged step) is removed."""
    from transformers import PrinterCallback

    from unsloth_adaptive_kl.tools.selfcheck import PROMPTS

    trainer, _ = trl_trainer_and_batch
    assert trainer.args.use_cpu is True
    assert not any(isinstance(callback, PrinterCallback) for callback in trainer.callback_handler.callbacks)
    assert trainer.train_dataset["prompt"] == PROMPTS


def test_the_tiny_trainer_trains_on_the_prompts_it_is_given(tmp_path) -> None:
    from unsloth_adaptive_kl.tools.selfcheck import tiny_trainer

    assert tiny_trainer(str(tmp_path), prompts=["x:", "yz:"]).train_dataset["prompt"] == ["x:", "yz:"]


def test_none_is_compared_as_none_whatever_method_the_trainer_was_left_with(trl_trainer_and_batch) -> None:
    """A trainer left on a clip that binds (0.01; the moved reference's per-token KLs reach 0.72): `none` is still run
    as `none` and holds, as does the no-op clip."""
    from unsloth_adaptive_kl.tools import selfcheck

    trainer, inputs = trl_trainer_and_batch
    trainer._metrics["train"].clear()
    trainer.args.kl_adaptation_method, trainer.args.kl_clip_threshold = "clip", 0.01
    checks = selfcheck.compare_with_stock("TRL", trainer, "_compute_loss", selfcheck.stock_trl, inputs)
    lines = [check.line() for check in checks]
    assert all(line.startswith("[ok] TRL") for line in lines), lines


def test_write_record_writes_the_date_the_machine_and_a_final_newline(monkeypatch, tmp_path) -> None:
    import datetime

    from unsloth_adaptive_kl.tools import selfcheck

    monkeypatch.setattr(selfcheck, "source_commit", lambda: "abc1234")
    monkeypatch.setattr(selfcheck, "hardware", lambda: {"cpu": "a test CPU"})
    monkeypatch.setattr(selfcheck, "installed_versions", lambda packages: {p: "1.0" for p in packages})
    monkeypatch.setattr(sys, "argv", ["whatever", "--json", "r.json"])
    today = datetime.date.today().isoformat()
    selfcheck.write_record(str(tmp_path / "r.json"), ["a line", "[FAIL] x"], passed=False)
    text = (tmp_path / "r.json").read_text()
    assert text.endswith("}\n")
    assert json.loads(text) == {
        "command": "python -m unsloth_adaptive_kl --json r.json", "date": today, "commit": "abc1234",
        "hardware": {"cpu": "a test CPU"}, "passed": False, "lines": ["a line", "[FAIL] x"],
        "versions": {p: "1.0" for p in ("trl", "transformers", "torch", "unsloth", "unsloth_zoo", "verl")}}


def test_the_comparisons_magnitude_is_the_loss_with_every_advantage_negative(trl_trainer_and_batch) -> None:
    """At the captured step the policy is the one that sampled (ratio 1), so each token's PPO-clip term is -A and
    `dapo`'s loss (the tokens' sum over num_items_in_batch, N) moves by -sum_i A_i n_i / N, n_i completion i's tokens:
    with advantages 1, -1, 0.5, -0.5 the magnitude is the zero-advantage loss plus sum_i |A_i| n_i / N (0.75 where
    every completion has the batch's length), not minus it (+|A|), nor plus the signed sum (A as it is)."""
    from unsloth_adaptive_kl.tools.selfcheck import absolute_loss, comparison_inputs, stock_trl

    trainer, inputs = trl_trainer_and_batch
    moved = comparison_inputs(inputs)
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5])
    expected = float((advantages.abs() * moved["completion_mask"].sum(1)).sum() / moved["num_items_in_batch"])
    with stock_trl():
        zero = absolute_loss(trainer, "_compute_loss", {**moved, "advantages": torch.zeros(4)})
        magnitude = absolute_loss(trainer, "_compute_loss", {**moved, "advantages": advantages})
    assert magnitude - zero == pytest.approx(expected, rel=1e-5)


def test_compare_with_stock_fails_a_policy_term_off_where_every_captured_advantage_is_0(trl_trainer_and_batch) -> None:
    """A batch whose completions all earned one reward (every advantage 0: the tiny model's first CPU batch can be
    one) still tests the policy term: the comparison spreads the advantages (`comparison_inputs`), so an adapted loss
    that weighs them 1 % too much fails both comparisons, where on the batch's own zeros it would pass."""
    trainer, inputs = trl_trainer_and_batch
    uniform = {**inputs, "advantages": torch.zeros_like(inputs["advantages"])}

    lines = compare_with_adapted(trainer, uniform, lambda model, batch: type(trainer)._compute_loss(
        trainer, model, {**batch, "advantages": 1.01 * batch["advantages"]}))
    assert lines[0].startswith("[ok] TRL: stock gradients")
    assert [line.split(": ")[0:2] for line in lines[1:]] == [["[FAIL] TRL", "none == stock"],
                                                              ["[FAIL] TRL", "clip above every KL == stock"]], lines
