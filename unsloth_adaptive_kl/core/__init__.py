"""The pure-torch core: configuration, per-token estimators, shaping and reductions, the one KL pipeline, beta
controllers, and the `AdaptiveKL` object every loop drives. Imports with torch alone; never imports a trainer."""

from .adaptation import KLTerm, kl_term
from .adaptive_kl import AdaptiveKL
from .config import AdaptiveKLConfig, parse_methods
from .controllers import ConstantBeta, DynamicBeta, TargetKL, WindowKL, make_beta_controller, register_beta_controller
from .errors import (IncompatibleVersionError, IncompatibleVersionWarning, KLEstimatorWarning, NonFiniteLogProbError,
                     UntestedVersionWarning)
from .estimators import estimate_kl, estimator_names, register_kl_estimator
from .reductions import ReductionContext, reduce_kl, register_kl_reduction
from .shapings import register_kl_shaping, shape_kl, shapes_per_token

__all__ = [
    "AdaptiveKL",
    "AdaptiveKLConfig",
    "ConstantBeta",
    "DynamicBeta",
    "KLEstimatorWarning",
    "KLTerm",
    "NonFiniteLogProbError",
    "ReductionContext",
    "TargetKL",
    "WindowKL",
    "estimate_kl",
    "estimator_names",
    "kl_term",
    "make_beta_controller",
    "parse_methods",
    "reduce_kl",
    "register_beta_controller",
    "register_kl_estimator",
    "register_kl_reduction",
    "register_kl_shaping",
    "shape_kl",
    "shapes_per_token",
]
