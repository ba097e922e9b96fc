"""Adaptive KL regularisation for GRPO in TRL and Unsloth.

`import unsloth_adaptive_kl` patches `trl.GRPOConfig` / `trl.GRPOTrainer` in place: the config gains the
adaptive-KL fields (see `AdaptiveKLConfig`) and the trainer applies the adapted KL term and logs
`adaptive_kl/raw_kl`, `adaptive_kl/adapted_kl` and `adaptive_kl/current_beta`. `unpatch()` restores stock TRL.
"""

from .adaptation import KLTerm, ReductionContext, adapted_kl_term, reduce_kl, shape_kl
from .config import AdaptiveKLConfig, parse_methods
from .controllers import ConstantBeta, DynamicBeta, make_beta_controller
from .trl_patch import GRPOConfig, is_patched, patch, unpatch

__version__ = "0.1.0"

patch()

__all__ = [
    "AdaptiveKLConfig",
    "ConstantBeta",
    "DynamicBeta",
    "GRPOConfig",
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
]
