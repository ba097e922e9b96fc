"""`python -m unsloth_adaptive_kl`, the self-check users run before a long run: exit code 0 on a working install,
non-zero naming the anchor when one is missing."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from unsloth_adaptive_kl.integrations import versions

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
    """A trl whose GRPOTrainer._compute_loss no longer has the KL line."""
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
    assert "IncompatibleVersionError: unsloth_adaptive_kl cannot patch trl==" in result.stderr
    assert ("the anchor `per_token_loss = per_token_loss + self.beta * per_token_kl` (the trainer's own per-token KL is "
            "taken at this line) was not found in GRPOTrainer._compute_loss") in result.stderr


def test_an_untested_version_is_reported_not_failed(monkeypatch) -> None:
    from packaging.version import Version

    from unsloth_adaptive_kl.integrations import versions
    from unsloth_adaptive_kl.tools import selfcheck

    real = versions.installed_version
    monkeypatch.setattr(versions, "installed_version", lambda p: Version("1.99.0") if p == "trl" else real(p))
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
    trl_line = next(check for check in selfcheck.version_checks() if check.name == "trl version")
    assert trl_line.line() == f"[{status}] trl version: trl=={version} (tested: trl>=1.9.1,<=1.16.0)"


def test_a_package_not_installed_is_reported_so_not_as_untested(monkeypatch) -> None:
    """On a TRL-only install the Unsloth lines say '(not installed)', with the range, lower bound first, and are not
    marked untested: a package with a tested range and no installed distribution (a real lookup, of a name nothing
    installs) is reported the same way."""
    from packaging.specifiers import SpecifierSet

    from unsloth_adaptive_kl.tools import selfcheck

    absent = "unsloth_adaptive_kl_absent_package"
    monkeypatch.setitem(versions.TESTED, absent, SpecifierSet("<=2.0,>=1.0"))
    monkeypatch.setattr(selfcheck, "VERSION_PACKAGES", (absent,))
    assert versions.is_tested(absent) is None
    assert [check.line() for check in selfcheck.version_checks()] == [
        f"[ok] {absent} version: {absent} (not installed) (tested: {absent}>=1.0,<=2.0)"]
