"""`use_liger_kernel=True` on the trl versions whose GRPOTrainer.compute_loss hands the whole loss to Liger's fused
GRPO loss (trl 1.9.1 - 1.13.0, told apart by that call in the installed source, not by the version number): a
non-stock setting is refused before training, `none` trains as stock. CI row (d) runs this on trl 1.9.1 with
liger-kernel installed; on trl >= 1.14 `use_liger_kernel` keeps the loss, so the refusal must not fire."""

from __future__ import annotations

import importlib.util

import pytest
import torch

import trl

from unsloth_adaptive_kl.integrations.trainer_hooks import check_loss_not_replaced
from unsloth_adaptive_kl.integrations.versions import TRL_LIGER_LOSS_CALL, source

from .conftest import logged, make_trainer, stock_trl

REPLACES_LOSS = TRL_LIGER_LOSS_CALL in source(trl.GRPOTrainer.compute_loss)
# Liger's Triton layer kernels need a GPU; with these off, the fused GRPO loss (plain torch) runs on a CPU.
CPU_LIGER = dict(use_liger_kernel=True, liger_kernel_config={
    "rope": False, "rms_norm": False, "swiglu": False, "cross_entropy": False, "fused_linear_cross_entropy": False})
NON_STOCK = [dict(kl_adaptation_method="clip"), dict(kl_adaptation_method="dynamic"), dict(kl_estimator="k2"),
             dict(kl_placement="reward"), dict(kl_reduction="sequence_sum"), dict(sync_ref_model=True)]


@pytest.mark.parametrize("setting", NON_STOCK, ids=lambda setting: "-".join(f"{k}={v}" for k, v in setting.items()))
def test_the_refusal_follows_the_installed_compute_loss(tokenizer, tmp_path, setting: dict) -> None:
    args = trl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, beta=0.04, report_to="none", **CPU_LIGER,
                          **setting)
    if not REPLACES_LOSS:  # trl >= 1.14: use_liger_kernel only swaps layer kernels, the loss keeps the adapted KL
        check_loss_not_replaced(trl.GRPOTrainer, args)
        return
    with pytest.raises(ValueError) as raised:
        make_trainer(tokenizer, str(tmp_path), **CPU_LIGER, **setting)
    message = str(raised.value)
    assert message.startswith("use_liger_kernel=True is invalid with adaptive KL (")
    assert f"trl=={trl.__version__}" in message
    assert "use_liger_kernel=False, or trl>=1.14" in message
    # beta = 0: no KL term at all, nothing to refuse (the stock trainer skips the reference model)
    if "sync_ref_model" not in setting:  # which beta = 0 refuses on its own
        check_loss_not_replaced(trl.GRPOTrainer, trl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False,
                                                                beta=0.0, **CPU_LIGER, **setting))


@pytest.mark.skipif(not REPLACES_LOSS or importlib.util.find_spec("liger_kernel") is None,
                    reason="only trl versions that hand the loss to Liger (CI row d: trl 1.9.1 with liger-kernel)")
def test_none_with_liger_trains_as_stock(tokenizer, tmp_path) -> None:
    def run(folder: str) -> tuple[list[float], list[torch.Tensor]]:
        trainer = make_trainer(tokenizer, str(tmp_path / folder), max_steps=2, **CPU_LIGER)
        trainer.train()
        return logged(trainer, "loss"), [p.detach().clone() for p in trainer.model.parameters() if p.requires_grad]

    with pytest.warns(UserWarning) as caught:  # said once, at construction; no loss-hook warning at each step
        patched_losses, patched_params = run("patched")
    said = [str(w.message) for w in caught if "adaptive_kl" in str(w.message)]
    assert len(said) == 1 and "hands the GRPO loss to Liger's fused loss" in said[0], said
    with stock_trl():
        stock_losses, stock_params = run("stock")
    assert patched_losses == stock_losses and len(stock_losses) == 2
    assert all(torch.equal(a, b) for a, b in zip(patched_params, stock_params))


class _LigerLossTrainer:
    """A trainer whose compute_loss hands the loss to Liger's fused loss, as GRPOTrainer.compute_loss does in trl 1.9.1
    - 1.13.0 (the refusal reads the installed source, so it is exercised here on any trl)."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        return self.compute_liger_loss(model, inputs)


@pytest.mark.parametrize("setting", NON_STOCK, ids=lambda setting: "-".join(f"{k}={v}" for k, v in setting.items()))
def test_a_compute_loss_that_calls_liger_refuses_every_adapted_setting_and_leaves_none_and_beta_zero(tmp_path,
                                                                                                   setting) -> None:
    def config(**fields):
        return trl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", **CPU_LIGER,
                              **fields)

    with pytest.raises(ValueError, match=r"^use_liger_kernel=True is invalid with adaptive KL \(") as raised:
        check_loss_not_replaced(_LigerLossTrainer, config(beta=0.04, **setting))
    assert "use_liger_kernel=False, or trl>=1.14" in str(raised.value)
    # none: stock, Liger's loss is the stock one, which the loss hook never sees: said once, at construction
    with pytest.warns(UserWarning, match=r"^adaptive_kl: use_liger_kernel=True on trl==.*: this trl hands the GRPO "
                                         r"loss to Liger's fused loss .* no adaptive_kl/ metric is logged\.$"):
        assert check_loss_not_replaced(_LigerLossTrainer, config(beta=0.04)) is True
    if "sync_ref_model" not in setting:  # beta = 0: no KL term to drop (sync with beta = 0 is refused on its own)
        check_loss_not_replaced(_LigerLossTrainer, config(beta=0.0, **setting))
    # use_liger_kernel=False: the installed loss runs whatever compute_loss would call with it on
    off = trl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", beta=0.04, **setting)
    assert check_loss_not_replaced(_LigerLossTrainer, off) is False
