"""Adaptive KL regularisation for GRPO in TRL and Unsloth.

`import unsloth_adaptive_kl` patches `trl.GRPOConfig` / `trl.GRPOTrainer` in place: the config gains the
adaptive-KL fields (see `AdaptiveKLConfig`) and the trainer applies the adapted KL term and logs
`adaptive_kl/raw_kl`, `adaptive_kl/adapted_kl`, `adaptive_kl/current_beta`, `adaptive_kl/sequence_kl` and
`adaptive_kl/length_kl_corr`, with `adaptive_kl/clip_fraction` for `clip` and `adaptive_kl/reward_penalty` for the
KL in the reward (the docs' metrics page has each formula). Imported before `unsloth`, it also
hooks the `UnslothGRPOTrainer` that Unsloth generates. `unpatch()` restores the stock objects.
`python -m unsloth_adaptive_kl` checks the installed versions and anchors on this machine.
"""

from . import trl_patch, unsloth_patch
from .adaptation import KLTerm, ReductionContext, adapted_kl_term, reduce_kl, shape_kl
from .config import AdaptiveKLConfig, parse_methods
from .controllers import ConstantBeta, DynamicBeta, make_beta_controller
from .trl_patch import GRPOConfig, is_patched
from .versions import IncompatibleVersionError, UntestedVersionWarning

__version__ = "0.1.0"


def patch() -> None:
    """Patch TRL and hook Unsloth's trainer generation. Idempotent. Raises ImportError when Unsloth already
    generated its GRPO trainer (import this package before unsloth), and IncompatibleVersionError when an anchor
    the integration relies on is missing from the installed trl."""
    unsloth_patch.check_import_order()
    trl_patch.patch()
    unsloth_patch.patch()


def unpatch() -> None:
    """Restore every stock TRL and Unsloth object. Idempotent."""
    unsloth_patch.unpatch()
    trl_patch.unpatch()


patch()

__all__ = [
    "AdaptiveKLConfig",
    "ConstantBeta",
    "DynamicBeta",
    "GRPOConfig",
    "IncompatibleVersionError",
    "KLTerm",
    "ReductionContext",
    "adapted_kl_term",
    "is_patched",
    "make_beta_controller",
    "parse_methods",
    "patch",
    "reduce_kl",
    "shape_kl",
    "unpatch",
    "UntestedVersionWarning",
]
