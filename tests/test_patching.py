"""patch()/unpatch(): idempotent, reversible, version-checked, loud when an anchor is missing (SPEC 5)."""

from __future__ import annotations

import pytest
import torch
import trl
import trl.trainer.utils as trl_utils
from packaging.version import Version

import unsloth_adaptive_kl
from unsloth_adaptive_kl import trl_patch, versions

from .conftest import make_trainer

PATCHED_METHODS = ["__init__", "_compute_loss", "_generate_and_score_completions", "_save_checkpoint",
                   "_load_optimizer_and_scheduler"]


def snapshot() -> dict:
    trainer = trl_patch.StockGRPOTrainer
    return {
        "GRPOConfig": (trl.GRPOConfig, trl.trainer.grpo_config.GRPOConfig, trl.trainer.grpo_trainer.GRPOConfig),
        "methods": tuple(vars(trainer).get(name) for name in PATCHED_METHODS),
        "current_beta": "current_beta" in vars(trainer),
        "kernel": trl_utils._ChunkedLogProbFunction,
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
        assert stock["GRPOConfig"] == (trl_patch.StockGRPOConfig,) * 3
        assert stock["methods"] == (
            trl_patch._stock_init, trl_patch._stock_compute_loss, trl_patch._stock_generate_and_score,
            trl_patch._stock_save_checkpoint, trl_patch._stock_load_optimizer_and_scheduler,
        )
        assert stock["current_beta"] is False
        assert stock["kernel"] is trl_patch.ChunkedLogProbWithCPUFallback.upstream
        assert not hasattr(trl.GRPOConfig(output_dir="x", use_cpu=True), "kl_adaptation_method")
    finally:
        unsloth_adaptive_kl.patch()
    assert snapshot() == patched
    assert patched["GRPOConfig"] == (unsloth_adaptive_kl.GRPOConfig,) * 3
    assert all(method is not None for method in patched["methods"])


def fake_version(monkeypatch, package: str, version: str) -> None:
    unsloth_adaptive_kl.unpatch()
    real = versions.installed_version
    monkeypatch.setattr(versions, "installed_version", lambda p: Version(version) if p == package else real(p))


def test_unsupported_trl_version_is_refused_naming_both_versions(monkeypatch) -> None:
    fake_version(monkeypatch, "trl", "1.16.0")
    try:
        with pytest.raises(ImportError, match=r"supports trl==1.15.0, found trl==1.16.0"):
            unsloth_adaptive_kl.patch()
        assert not unsloth_adaptive_kl.is_patched()
    finally:
        monkeypatch.undo()
        unsloth_adaptive_kl.patch()


def test_unsupported_transformers_version_warns(monkeypatch) -> None:
    fake_version(monkeypatch, "transformers", "5.18.0")
    try:
        with pytest.warns(UserWarning, match=r"supports transformers<=5.17.0,>=4.56.2, found transformers==5.18.0"):
            unsloth_adaptive_kl.patch()
    finally:
        monkeypatch.undo()
    assert unsloth_adaptive_kl.is_patched()


def test_missing_kl_anchor_is_an_error_not_a_silent_stock_fallback(tokenizer, tmp_path, monkeypatch) -> None:
    """A trl whose _compute_loss no longer multiplies the KL by `self.beta` must fail loudly."""
    trainer = make_trainer(tokenizer, str(tmp_path), kl_adaptation_method="clip")

    monkeypatch.setattr(trl_patch, "_stock_compute_loss", lambda self, model, inputs: 0.0)
    with pytest.raises(RuntimeError, match=r"anchor `per_token_loss \+ self.beta \* per_token_kl`.*trl==1.15.0"):
        trainer._compute_loss(trainer.model, {"completion_mask": torch.ones(1, 2)})
