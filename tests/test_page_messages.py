"""A message a docs page quotes in a `text` block (an error or a warning of this package) is the one the package
raises today, as a traceback or a warning prints it: `module.Class: message` for the package's own classes, the
version it found written X.Y.Z where the page does."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest
import torch

from unsloth_adaptive_kl import AdaptiveKL, AdaptiveKLConfig
from unsloth_adaptive_kl.integrations import trl as trl_patch, unsloth, versions

ROOT = Path(__file__).parents[1]


def quoted(page: str, starts: str) -> list[str]:
    """The `text` blocks of docs/PAGE that start with `starts`."""
    blocks = re.findall(r"```text\n(.*?)\n```", (ROOT / "docs" / page).read_text(), re.S)
    return [block for block in blocks if block.startswith(starts)]


def as_printed(error: BaseException) -> str:
    """The last line of a traceback (or a warning's text): the class's qualified name where it is not a builtin."""
    kind = type(error)
    name = kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
    return f"{name}: {error}"


def test_the_missing_anchor_error_is_quoted_as_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    """compatibility.md and troubleshooting.md quote the error for a trl whose `_compute_loss` lacks the KL line (a
    new release: outside the tested range)."""
    monkeypatch.setattr(versions, "is_tested", lambda package: False)
    error = versions.anchor_error("trl", versions.TRL_KL_LINE)
    printed = as_printed(error).replace(f"trl=={versions.installed_version('trl')} (", "trl==X.Y.Z (")
    pages = quoted("compatibility.md", "unsloth_adaptive_kl.") + quoted("troubleshooting.md", "unsloth_adaptive_kl.")
    assert len(pages) == 2 and pages == [printed] * 2, (pages, printed)


def test_the_stock_config_error_is_quoted_as_raised() -> None:
    """troubleshooting.md quotes the TypeError of a GRPOConfig bound before the import, given an adaptive-KL field."""
    with pytest.raises(TypeError) as raised:
        trl_patch.StockGRPOConfig(output_dir="out", kl_adaptation_method="clip")
    assert quoted("troubleshooting.md", "TypeError") == [as_printed(raised.value)]


def test_the_untested_version_warning_is_quoted_as_warned(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(versions, "installed_version", lambda package: versions.Version("99.0.0"))
    monkeypatch.setattr(versions, "_warned", set())
    with pytest.warns(versions.UntestedVersionWarning) as caught:
        versions.warn_if_untested("trl")
    (warning,) = caught
    printed = f"{warning.category.__name__}: {warning.message}".replace("trl==99.0.0 (", "trl==X.Y.Z (")
    assert quoted("troubleshooting.md", "UntestedVersionWarning") == [printed]


def test_the_late_import_error_is_quoted_as_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    """Once Unsloth has generated its trainer (stood in for by a non-None `generated_grpo_trainer`)."""
    monkeypatch.setattr(unsloth, "generated_grpo_trainer", lambda: object)
    with pytest.raises(ImportError) as caught:
        unsloth.check_import_order()
    assert quoted("troubleshooting.md", "ImportError") == [as_printed(caught.value)]


def test_the_beta_zero_warning_is_quoted_as_warned() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        AdaptiveKL(AdaptiveKLConfig(kl_adaptation_method="clip"), beta=0.0, loss_type="dapo")
    (warning,) = caught
    assert quoted("methods.md", "UserWarning: kl_adaptation_method") == [f"UserWarning: {warning.message}"]


def test_the_held_beta_and_unread_divisor_warnings_are_quoted_as_warned() -> None:
    """troubleshooting.md quotes the first step of each controller that holds beta for want of its input (and a loop
    of your own that never calls step()), and a token_normalizer that grpo's reduction does not read."""
    import torch

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        AdaptiveKL(AdaptiveKLConfig(kl_adaptation_method="dynamic"), beta=0.04).step()
        AdaptiveKL(AdaptiveKLConfig(kl_adaptation_method="target"), beta=0.04).step()
        AdaptiveKL(AdaptiveKLConfig(kl_adaptation_method="target", kl_placement="reward"), beta=0.04).step()
        forgot = AdaptiveKL(AdaptiveKLConfig(kl_adaptation_method="dynamic"), beta=0.04)
        optimizer = torch.optim.AdamW([torch.zeros(1, requires_grad=True)])
        for _ in range(3):  # a loop of your own that never calls forgot.step()
            forgot.kl_loss(torch.zeros(1, 2, requires_grad=True), torch.zeros(1, 2), torch.ones(1, 2))
            optimizer.step()
        AdaptiveKL(None, beta=0.04).kl_loss(torch.zeros(1, 2, requires_grad=True), torch.zeros(1, 2),
                                            torch.ones(1, 2), token_normalizer=7.0)
    printed = [f"UserWarning: {warning.message}" for warning in caught]
    assert quoted("troubleshooting.md", "UserWarning: adaptive KL: beta holds") == ["\n".join(printed[:4])]
    assert quoted("troubleshooting.md", "UserWarning: token_normalizer") == [printed[4]]


def test_the_changed_setting_error_is_quoted_as_raised() -> None:
    """troubleshooting.md quotes a clip threshold set after the run started (in a loop of your own)."""
    import torch

    config = AdaptiveKLConfig(kl_adaptation_method="clip", kl_clip_threshold=0.5)
    akl = AdaptiveKL(config, beta=0.04)
    config.kl_clip_threshold = 1.0
    with pytest.raises(ValueError) as raised:
        akl.kl_loss(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2))
    assert quoted("troubleshooting.md", "ValueError: kl_clip_threshold changed") == [as_printed(raised.value)]


def elided(block: str) -> re.Pattern:
    """A quoted message whose `...` stand for text the page leaves out, as a pattern of the whole message."""
    return re.compile(".*".join(re.escape(part) for part in block.split("...")), re.S)


def test_the_sequence_level_bias_correction_error_is_quoted_as_raised() -> None:
    """troubleshooting.md quotes, shortened, the refusal of an adapted k3 that TRL weights by the sequence-level
    importance ratio."""
    from argparse import Namespace

    from unsloth_adaptive_kl.integrations.trainer_hooks import check_trl_settings

    args = Namespace(beta=0.04, importance_sampling_level="sequence", use_bias_correction_kl=True)
    with pytest.raises(ValueError) as raised:
        check_trl_settings(args, AdaptiveKLConfig(kl_adaptation_method="clip"))
    (block,) = quoted("troubleshooting.md", "ValueError: use_bias_correction_kl=True")
    assert elided(block).fullmatch(as_printed(raised.value)), (block, as_printed(raised.value))


def test_the_log_probs_above_0_error_is_quoted_as_raised() -> None:
    """troubleshooting.md quotes the ValueError for negative log-likelihoods passed to `kl_loss`: those of 4
    completions of 16 tokens over a vocabulary of 50 (seeded), the reference's logits 0.2 from the policy's."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 16, 50, generator=generator)
    ref_logits = logits + 0.2 * torch.randn(4, 16, 50, generator=generator)
    tokens = torch.randint(0, 50, (4, 16), generator=generator)
    nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), tokens, reduction="none")
    ref_nll = torch.nn.functional.cross_entropy(ref_logits.transpose(1, 2), tokens, reduction="none")
    with pytest.raises(ValueError) as raised:
        AdaptiveKL(None, beta=0.04).kl_loss(nll.requires_grad_(True), ref_nll, torch.ones(4, 16))
    assert quoted("troubleshooting.md", "ValueError: adaptive KL: log-probs above 0") == [as_printed(raised.value)]
