"""Adaptive KL regularisation for GRPO, in any training loop.

The core (`unsloth_adaptive_kl.core`, pure torch) is the `AdaptiveKL` object: per-token estimators, shaping (clip,
sigmoid), length normalisation and reductions, beta controllers (dynamic, target), the KL in the reward, metrics
`adaptive_kl/raw_kl`, `adaptive_kl/adapted_kl`, `adaptive_kl/current_beta`, `adaptive_kl/sequence_kl`,
`adaptive_kl/length_kl_corr` (with `adaptive_kl/clip_fraction` for `clip` and `adaptive_kl/reward_penalty` for the
KL in the reward; the docs' metrics page has each formula), and checkpointable state.

Where TRL is installed, `import unsloth_adaptive_kl` also replaces `trl.GRPOConfig` with a subclass that has the
adaptive-KL fields and patches `trl.GRPOTrainer` in place (the trainer drives an `AdaptiveKL`), and, imported before
`unsloth`, hooks the
`UnslothGRPOTrainer` Unsloth generates. `unpatch()` restores the stock objects. With neither installed it is the core
alone, silently. `python -m unsloth_adaptive_kl` checks the installed versions and anchors on this machine.
"""

import importlib.util
import warnings
from typing import Any

# The public surface: what a user writes. Internals (the adaptation's functions, the controller classes, the reduction
# context) stay importable from their modules: unsloth_adaptive_kl.core.adaptation, .core.controllers, ...
from .core import AdaptiveKL, AdaptiveKLConfig, WindowKL, estimate_kl
from .core import register_beta_controller, register_kl_estimator, register_kl_reduction, register_kl_shaping
from .core.errors import (IncompatibleVersionError, IncompatibleVersionWarning, KLEstimatorWarning,
                          NonFiniteLogProbError, UntestedVersionWarning)

__version__ = "0.1.0"

TRL_INSTALLED = importlib.util.find_spec("trl") is not None


def patch() -> None:
    """Patch TRL and hook Unsloth's trainer generation. Idempotent. Raises ImportError when TRL is not installed or
    when, unpatched, Unsloth already generated its GRPO trainer (import this package before unsloth), and
    IncompatibleVersionError when an anchor the integration relies on is missing from the installed trl, or when trl
    itself does not import."""
    if not TRL_INSTALLED:
        raise ImportError("unsloth_adaptive_kl.patch() patches TRL, which is not installed: "
                          "pip install 'unsloth-adaptive-kl[trl] @ git+https://github.com/unsloth-adaptive-kl/unsloth-adaptive-kl' "
                          "(or [unsloth]).")
    trl, unsloth = _integrations()
    if trl.is_patched():  # already patched: the Unsloth hook with TRL (both or neither, below)
        return
    unsloth.check_import_order()
    trl.patch()
    try:
        unsloth.patch()
    except BaseException:  # nothing patched half-way: an Unsloth anchor missing leaves TRL stock too, as it says
        trl.unpatch(name_configs=False)  # its error is what this call says
        raise


def unpatch() -> None:
    """Restore every stock TRL and Unsloth object. Idempotent (nothing to do without TRL, or with a trl that does not
    import)."""
    if not TRL_INSTALLED:
        return
    try:
        trl, unsloth = _integrations()
    except IncompatibleVersionError:  # a trl that does not import was never patched
        return
    unsloth.unpatch()
    trl.unpatch()


def is_patched() -> bool:
    """Whether TRL is patched now."""
    try:
        return TRL_INSTALLED and _integrations()[0].is_patched()
    except IncompatibleVersionError:  # a trl that does not import was never patched
        return False


def _integrations() -> tuple[Any, Any]:
    """The TRL and Unsloth integration modules; IncompatibleVersionError where trl itself does not import."""
    try:
        from .integrations import trl, unsloth
    except ImportError as error:  # trl 0.27.0 (verl[fsdp]==0.9.1 pins it) imports `weave` under transformers 5
        from .integrations.versions import import_error

        raise import_error("trl", error) from error
    return trl, unsloth


__all__ = [
    "AdaptiveKL",
    "AdaptiveKLConfig",
    "IncompatibleVersionError",
    "IncompatibleVersionWarning",
    "KLEstimatorWarning",
    "NonFiniteLogProbError",
    "UntestedVersionWarning",
    "WindowKL",
    "estimate_kl",
    "is_patched",
    "patch",
    "register_beta_controller",
    "register_kl_estimator",
    "register_kl_reduction",
    "register_kl_shaping",
    "unpatch",
]

if TRL_INSTALLED:
    try:
        patch()
    except IncompatibleVersionError as error:
        # A trl this package cannot patch must not take down the doors that do not use TRL: verl[fsdp]==0.9.1 pins
        # trl==0.27.0 beside a verl user's install. The TRL door stays off and says so; patch() raises the error.
        warnings.warn(f"{error} The TRL and Unsloth integrations are off (trl.GRPOConfig has no adaptive-KL fields); "
                      "the core (AdaptiveKL), verl and Tinker work without TRL.", IncompatibleVersionWarning,
                      stacklevel=2)
    else:
        from .integrations.trl import GRPOConfig  # noqa: E402  (trl.GRPOConfig with the adaptive-KL fields)

        __all__.append("GRPOConfig")
