"""The adaptive-KL configuration: one dataclass of fields, defaults and validation, reused everywhere.

`AdaptiveKLConfig` is usable on its own (the pure core takes it) and is mixed into `trl.GRPOConfig` by
`trl_patch`, so the same fields, help texts and checks appear on the TRL and Unsloth configs, in `to_dict()`
and on the command line.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence, Union

SHAPING_METHODS = ("clip", "sigmoid")
LENGTH_METHODS = ("length_normalized",)
BETA_METHODS = ("dynamic",)
# Application order (SPEC 3.6): shaping -> length normalisation -> beta.
METHODS = SHAPING_METHODS + LENGTH_METHODS + BETA_METHODS
METHOD_SEPARATOR = "+"


def _reject(name: str, value: Any, allowed: str) -> ValueError:
    return ValueError(f"{name}={value!r} is invalid: allowed is {allowed}.")


def parse_methods(value: Union[str, Sequence[str]]) -> tuple[str, ...]:
    """Parse `kl_adaptation_method` ("none", "clip", "dynamic+length_normalized", or a list) into a tuple of
    method names in application order; `()` means "none"."""
    allowed = f'"none", or one or more of {", ".join(METHODS)} joined by "{METHOD_SEPARATOR}" or given as a list'
    if isinstance(value, str):
        names = [part.strip() for part in value.split(METHOD_SEPARATOR)]
    elif isinstance(value, (list, tuple)) and all(isinstance(part, str) for part in value):
        names = [part.strip() for part in value]
    else:
        raise _reject("kl_adaptation_method", value, allowed)
    if names == ["none"]:
        return ()
    unknown = [name for name in names if name not in METHODS]
    if not names or unknown:
        raise _reject("kl_adaptation_method", value, allowed)
    if len(set(names)) != len(names):
        raise _reject("kl_adaptation_method", value, allowed + ", each method at most once")
    if sum(name in SHAPING_METHODS for name in names) > 1:
        raise _reject("kl_adaptation_method", value, allowed + ", with at most one of clip/sigmoid")
    return tuple(name for name in METHODS if name in names)


def _is_real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_real(name: str, value: Any, ok: bool, allowed: str) -> None:
    if not _is_real(value) or math.isnan(value) or not ok:
        raise _reject(name, value, allowed)


@dataclass
class AdaptiveKLConfig:
    """Adaptive KL regularisation for GRPO.

    The KL term of the loss, `beta * KL(pi_theta || pi_ref)`, is adapted per token by `clip`
    (min(k, kl_clip_threshold)) or `sigmoid` (sigmoid(k - kl_target) * k), reduced per completion by
    `length_normalized` ((sum_t m k') / L_i), and weighted by a `dynamic` beta that decays by
    `dynamic_beta_decay` while the mean reward exceeds `reward_threshold`, never below `beta_min`, and equals
    `beta_min` once `beta_schedule_steps` optimizer steps are done.
    """

    # Typed `str` for HfArgumentParser; a list of names is accepted programmatically and stored joined by '+'.
    kl_adaptation_method: str = field(
        default="none",
        metadata={
            "help": "How the KL term is adapted: 'none' (stock), or one or more of 'clip', 'sigmoid', "
            "'length_normalized', 'dynamic' joined by '+' (e.g. 'dynamic+length_normalized'); at most one of "
            "clip/sigmoid. Applied in the order shaping -> length normalisation -> beta."
        },
    )
    kl_clip_threshold: float = field(
        default=1.0,
        metadata={"help": "`clip`: per-token KL is min(KL, kl_clip_threshold); above it the KL gradient is zero. > 0."},
    )
    kl_target: float = field(
        default=0.1,
        metadata={"help": "`sigmoid`: per-token KL is sigmoid(KL - kl_target) * KL. >= 0."},
    )
    dynamic_beta_decay: float = field(
        default=0.9,
        metadata={"help": "`dynamic`: beta is multiplied by this after a step whose mean reward > reward_threshold."},
    )
    reward_threshold: float = field(
        default=0.8,
        metadata={"help": "`dynamic`: mean reward above which beta decays."},
    )
    beta_min: float = field(
        default=0.0,
        metadata={"help": "`dynamic`: lower bound of beta, and its value from beta_schedule_steps on. 0 <= beta_min <= beta."},
    )
    beta_schedule_steps: Optional[int] = field(
        default=1000,
        metadata={"help": "`dynamic`: once this many optimizer steps are done, beta = beta_min. None: no cut-off."},
    )

    def __post_init__(self) -> None:
        parent_post_init = getattr(super(), "__post_init__", None)
        if parent_post_init is not None:  # mixed into trl.GRPOConfig: let it resolve its own fields first
            parent_post_init()
        # Stored canonically so to_dict()/YAML/CLI round-trip it as one string.
        self.kl_adaptation_method = "+".join(parse_methods(self.kl_adaptation_method)) or "none"
        self.validate_adaptive_kl(beta=getattr(self, "beta", None))

    @property
    def kl_methods(self) -> tuple[str, ...]:
        """The active methods in application order; empty for 'none'."""
        return parse_methods(self.kl_adaptation_method)

    def validate_adaptive_kl(self, beta: Optional[float] = None) -> None:
        """Raise ValueError naming the field, the value and what is allowed for the first bad field."""
        parse_methods(self.kl_adaptation_method)
        _check_real("kl_clip_threshold", self.kl_clip_threshold,
                    _is_real(self.kl_clip_threshold) and 0 < self.kl_clip_threshold < math.inf,
                    "a finite number > 0")
        _check_real("kl_target", self.kl_target,
                    _is_real(self.kl_target) and 0 <= self.kl_target < math.inf, "a finite number >= 0")
        _check_real("dynamic_beta_decay", self.dynamic_beta_decay,
                    _is_real(self.dynamic_beta_decay) and 0 < self.dynamic_beta_decay <= 1, "a number with 0 < x <= 1")
        _check_real("reward_threshold", self.reward_threshold,
                    _is_real(self.reward_threshold) and math.isfinite(self.reward_threshold), "a finite number")
        beta_bound = "beta" if beta is None else f"beta={beta!r}"
        _check_real("beta_min", self.beta_min,
                    _is_real(self.beta_min) and 0 <= self.beta_min < math.inf
                    and (beta is None or self.beta_min <= beta),
                    f"a number with 0 <= beta_min <= {beta_bound}")
        steps = self.beta_schedule_steps
        if steps is not None and (not isinstance(steps, int) or isinstance(steps, bool) or steps < 1):
            raise _reject("beta_schedule_steps", steps, "an integer >= 1, or None for no cut-off")


ADAPTIVE_KL_FIELDS = tuple(name for name in AdaptiveKLConfig.__dataclass_fields__)


def adaptive_kl_config_from(args: Any) -> AdaptiveKLConfig:
    """The validated adaptive-KL settings of any config object; fields it lacks take their defaults (so a
    stock `GRPOConfig` built before patching means 'none')."""
    values = {name: getattr(args, name) for name in ADAPTIVE_KL_FIELDS if hasattr(args, name)}
    config = AdaptiveKLConfig(**values)
    config.validate_adaptive_kl(beta=getattr(args, "beta", None))
    return config
