"""The adaptive-KL configuration: one dataclass of fields, defaults and validation, reused everywhere.

`AdaptiveKLConfig` is usable on its own (the pure core takes it) and is mixed into a trainer's own config class by
that trainer's integration, so the same fields, help texts and checks appear on the trainer's config, in its
`to_dict()` and on its command line. The rules of a trainer's own fields stay in its integration.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence, Union

from .errors import KLEstimatorWarning, reject
from .estimators import BUILT_IN_ESTIMATORS, call_refused, estimator_label, estimator_names, takes_config
from .reductions import kl_reduction_settings
from .registry import BETA_CONTROLLERS, LENGTH_METHODS, SHAPINGS, method_names

# The built-in methods; registered shapings and controllers join them (registry.method_names()). Application order:
# shaping -> length normalisation -> beta.
SHAPING_METHODS = ("clip", "sigmoid")
BETA_METHODS = ("dynamic", "target")
METHODS = SHAPING_METHODS + LENGTH_METHODS + BETA_METHODS
METHOD_SEPARATOR = "+"
TARGET_MEASURES = ("token_mean", "sequence_sum")
STOCK_ESTIMATOR = "k3"  # the per-token KL GRPO trainers compute in their own loss
KL_PLACEMENTS = ("loss", "reward")


# Estimators whose value is not the log-ratio k1: as a reward their score-function gradient is not the KL's gradient
# (the KL lab: k3 in the reward misses the regularised optimum), so with the KL in the reward they warn.
NOT_LOG_RATIO_ESTIMATORS = ("k2", "k3", "low_var_kl", "k3+", "k3_bottom_percentile")


@dataclass(frozen=True)
class EstimatorFields:
    """How a trainer spells the estimator and placement settings, for the text of `KLEstimatorWarning`: the core's
    (`CORE_FIELDS`) and an integration's own (where its trainer names these settings differently) are one message
    each with these names filled in."""

    estimator: str  # the estimator's field, e.g. "kl_estimator"
    in_loss: str  # the setting that puts the KL in the loss, e.g. "kl_placement='loss'"
    in_reward: str  # the setting that puts the KL in the reward, e.g. "kl_placement='reward'"
    to_reward: str  # how to put k1 in the reward instead of k1 in the loss
    loss_fix: str  # what to use in the loss instead of k1
    reward_fix: str  # what to use in the reward instead of an estimate that is not the log-ratio


CORE_FIELDS = EstimatorFields(
    estimator="kl_estimator", in_loss="kl_placement='loss'", in_reward="kl_placement='reward'",
    to_reward="kl_placement='reward'",
    loss_fix="kl_estimator='k1_future' (the whole completion's KL gradient), 'k3' (the default) or 'k2'",
    reward_fix="kl_estimator='k1' (the reward placement's default: leave kl_estimator unset)")

K1_IN_LOSS, NOT_LOG_RATIO_IN_REWARD = "k1 in the loss", "not the log-ratio in the reward"
_ESTIMATOR_WARNINGS = {
    K1_IN_LOSS: "{estimator}={value!r} with {in_loss}: the expected gradient of k1 is zero on-policy, so the KL term "
                "does not regularise (the KL lab: the policy ends further from the reference than with beta=0). Use "
                "{loss_fix}, or put the KL in the reward ({to_reward}, where k1 is exact).",
    NOT_LOG_RATIO_IN_REWARD: "{estimator}={value!r} with {in_reward}: a KL in the reward must be the log-ratio "
                             "k1 = logp - ref_logp; with k2, k3 or low_var_kl there the reward's gradient is not the "
                             "KL's, and the KL lab measures k3 in the reward ending far from the regularised "
                             "optimum (in its exact lab with the KL to the reference above beta=0's). Use "
                             "{reward_fix}.",
}


# This package's reference-sync fields, each with its off value: they act on a trainer's reference sync
# (sync_ref_model=True), and where no sync runs a value other than off is refused (`refuse_sync_settings`).
REFERENCE_SYNC_FIELDS: dict[str, Any] = {"ref_model_sync_kl": None, "ref_model_sync_reset_optimizer": False}
# The fields that only some settings read, with the methods or the estimator that read them. Set away from its default
# while none of its readers is in effect, a field does nothing, and validation says so (`unread_fields`).
FIELD_READERS: dict[str, tuple[str, ...]] = {
    "kl_clip_threshold": ("clip",),
    "kl_target": ("sigmoid", "target"),
    "dynamic_beta_decay": ("dynamic",),
    "reward_threshold": ("dynamic",),
    "beta_min": ("dynamic", "target"),
    "beta_schedule_steps": ("dynamic",),
    "kl_horizon": ("target",),
    "beta_max": ("target",),
    "kl_target_measure": ("target",),
    "kl_percentile": ("k3_bottom_percentile",),
    "kl_percentile_scale": ("k3_bottom_percentile",),
}


def warn_estimator_issue(issue: str, value: Any, fields: EstimatorFields = CORE_FIELDS, stacklevel: int = 2) -> None:
    """Warn `KLEstimatorWarning` for `issue` (K1_IN_LOSS or NOT_LOG_RATIO_IN_REWARD), naming the estimator field as
    `fields` spells it, its `value`, the placement and the fix. Once per process and setting (Python's default filter).
    A trainer whose estimator names differ from the core's decides the issue itself, in its integration."""
    message = _ESTIMATOR_WARNINGS[issue].format(value=value, **dataclasses.asdict(fields))
    warnings.warn(message, KLEstimatorWarning, stacklevel=stacklevel + 1)


def warn_estimator_placement(estimator: Any, placement: str) -> None:
    """Warn (once per process and setting, Python's default warning filter) for an estimator that does not
    regularise where it acts: 'k1' in the loss (its expected gradient is zero on-policy) and, in the reward, one whose
    value is not the log-ratio (`NOT_LOG_RATIO_ESTIMATORS`: the reward's gradient is then not the KL's)."""
    if placement == "loss" and estimator == "k1":
        warn_estimator_issue(K1_IN_LOSS, estimator)
    if placement == "reward" and estimator in NOT_LOG_RATIO_ESTIMATORS:
        warn_estimator_issue(NOT_LOG_RATIO_IN_REWARD, estimator)


def parse_methods(value: Union[str, Sequence[str]]) -> tuple[str, ...]:
    """Parse `kl_adaptation_method` ("none", "clip", "dynamic+length_normalized", or a list) into a tuple of
    method names in application order; `()` means "none"."""
    known = method_names()
    allowed = f'"none", or one or more of {", ".join(known)} joined by "{METHOD_SEPARATOR}" or given as a list'
    if isinstance(value, str):
        names = [part.strip() for part in value.split(METHOD_SEPARATOR)]
    elif isinstance(value, (list, tuple)) and all(isinstance(part, str) for part in value):
        names = [part.strip() for part in value]
    else:
        raise reject("kl_adaptation_method", value, allowed)
    if names == ["none"]:
        return ()
    unknown = [name for name in names if name not in known]
    if not names or unknown:
        raise reject("kl_adaptation_method", value, allowed)
    if len(set(names)) != len(names):
        raise reject("kl_adaptation_method", value, allowed + ", each method at most once")
    if sum(name in SHAPINGS for name in names) > 1:
        raise reject("kl_adaptation_method", value, f"{allowed}, with at most one of {'/'.join(SHAPINGS)}")
    if sum(name in BETA_CONTROLLERS for name in names) > 1:
        raise reject("kl_adaptation_method", value, f"{allowed}, with at most one of {'/'.join(BETA_CONTROLLERS)}")
    return tuple(name for name in known if name in names)


def canonical_methods(value: Union[str, Sequence[str]]) -> str:
    """`kl_adaptation_method` as a config stores it: the parsed methods in application order joined by '+', or
    'none'."""
    return METHOD_SEPARATOR.join(parse_methods(value)) or "none"


def is_real(value: Any) -> bool:
    """An int or float, not a bool. numpy's float64 is a float (a subclass, saved in JSON as one), and passes; its
    float32 and integers, and torch's numbers, are not, and are refused saying so (`python_number`)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def is_whole(value: Any, least: int) -> bool:
    """An int, not a bool, >= least (a count, a size, a number of steps)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def check_whole(name: str, value: Any, least: int, allowed: str) -> None:
    """`reject` unless `is_whole(value, least)`; a numpy or torch integer is refused as such, saying so (as by
    `check_real`)."""
    if not is_whole(value, least):
        raise reject(name, value, python_number(value, allowed))


def check_real(name: str, value: Any, ok: bool, allowed: str) -> None:
    """`reject` unless value is a real number, not NaN, and `ok` holds. A numpy or torch number (but numpy's float64,
    a float) is refused as such, saying so: the settings are kept and saved (a trainer's JSON) as Python numbers, and
    "0.04 is invalid: allowed is a number" would read as a contradiction."""
    if not is_real(value) or math.isnan(value) or not ok:
        raise reject(name, value, python_number(value, allowed))


def check_beta(beta: Any, name: str = "beta", allowed: str = "a finite number >= 0") -> None:
    """`reject` a KL coefficient unless it is a finite number >= 0: a negative one would reward KL, a NaN or an inf
    make the loss so. `name`: the coefficient as the caller's user knows it (an integration's own name for it)."""
    check_real(name, beta, is_real(beta) and 0 <= beta < math.inf, allowed)


def python_number(value: Any, allowed: str) -> str:
    """`allowed`, followed for a numpy or torch number by why it is refused as such (Python numbers only)."""
    if is_real(value) or not hasattr(value, "item"):
        return allowed
    kind = type(value)
    python, call = ("a Python int", "int") if allowed.startswith("an integer") else ("a Python int or float", "float")
    return f"{allowed}, as {python} (this is a {kind.__module__}.{kind.__qualname__}: pass {call}(...))"


@dataclass
class AdaptiveKLConfig:
    """Adaptive KL regularisation for GRPO.

    The KL term of the loss, `beta * KL(pi_theta || pi_ref)`, is adapted per token by `clip`
    (min(k, kl_clip_threshold)) or `sigmoid` (sigmoid(k - kl_target) * k), reduced per completion by
    `length_normalized` ((sum_t m k') / max(L_i, 1)), and weighted by a `dynamic` beta that decays by
    `dynamic_beta_decay` while the mean reward exceeds `reward_threshold`, never below `beta_min`, and equals
    `beta_min` once `beta_schedule_steps` optimizer steps are done, or by `target`, the adaptive controller of
    Ziegler et al. (2019): e = clip(KL / kl_target - 1, -0.2, 0.2), beta <- beta * (1 + e * n / kl_horizon) within
    [beta_min, beta_max], n the generated completions of the step (each counted once per generation batch, whatever
    the optimizer passes over it). `kl_estimator` picks the per-token estimate k and
    `kl_reduction` how each completion's KL enters the loss.
    """

    # Typed `str` for HfArgumentParser; a list of names is accepted programmatically and stored joined by '+'.
    kl_adaptation_method: str = field(
        default="none",
        metadata={
            "help": "How the KL term is adapted: 'none' (stock), or one or more of 'clip', 'sigmoid', "
            "'length_normalized', 'dynamic', 'target' joined by '+' (e.g. 'dynamic+length_normalized'); at most "
            "one of clip/sigmoid and one of dynamic/target. Applied in the order shaping -> length normalisation -> "
            "beta."
        },
    )
    kl_clip_threshold: float = field(
        default=1.0,
        metadata={"help": "`clip`: per-token KL is min(KL, kl_clip_threshold); above it the KL gradient is zero. > 0."},
    )
    kl_target: float = field(
        default=0.1,
        metadata={"help": "`sigmoid`: per-token KL is sigmoid(KL - kl_target) * KL. `target`: the KL the controller "
                  "steers to (> 0 there). >= 0."},
    )
    dynamic_beta_decay: float = field(
        default=0.9,
        metadata={"help": "`dynamic`: beta is multiplied by this after a step whose mean reward > reward_threshold. "
                  "0 < x <= 1."},
    )
    reward_threshold: float = field(
        default=0.8,
        metadata={"help": "`dynamic`: mean reward above which beta decays. A finite number."},
    )
    beta_min: float = field(
        default=0.0,
        metadata={"help": "`dynamic`: lower bound of beta, and its value after step beta_schedule_steps. `target`: "
                  "lower bound of beta. 0 <= beta_min <= beta."},
    )
    beta_schedule_steps: Optional[int] = field(
        default=1000,
        metadata={"help": "`dynamic`: once this many optimizer steps are done, beta = beta_min. An integer >= 1, or "
                  "None: no cut-off."},
    )

    kl_estimator: Optional[str] = field(
        default=None,
        metadata={
            "help": "Per-token KL estimator. None (default): the placement's own, 'k3' (what the trainer computes) "
            "with the KL in the loss and 'k1' (the log-ratio) with the KL in the reward. 'k3' in the loss is the "
            "trainer's own per-token KL, taken where it computes it (its clamps and factors included; each "
            "integration's page names it). Or 'k1', 'k2', 'k3', "
            "'low_var_kl', 'k1+', 'k3+' (value of k1/k3, gradient of k2), 'k1_future' (value of k1, gradient of the "
            "whole completion's KL), 'k3_bottom_percentile', or a name registered with register_kl_estimator; "
            "programmatically also a callable (logp, ref_logp, mask) -> per-token KL. 'k1' in the loss and, in the "
            "reward, 'k2', 'k3', 'low_var_kl', 'k3+' or 'k3_bottom_percentile' (not the log-ratio) warn (they miss "
            "the regularised optimum: docs, Ground truth). Every "
            "method reads the KL it gives."
        },
    )
    kl_percentile: float = field(
        default=0.2,
        metadata={"help": "kl_estimator `k3_bottom_percentile`: fraction of tokens (lowest reference log-prob) that carry "
                  "KL, max(1, floor(n x)) of a micro-batch's n valid tokens with x to 6 decimal places; every method "
                  "reads the KL it gives. 0 < x <= 1."},
    )
    kl_percentile_scale: float = field(
        default=5.0,
        metadata={"help": "kl_estimator `k3_bottom_percentile`: factor on the selected tokens' k3; every method reads "
                  "the KL it gives. > 0."},
    )
    kl_reduction: str = field(
        default="loss_type",
        metadata={
            "help": "How each completion's KL enters the loss: 'loss_type' (stock), 'sequence_mean' (mean "
            "per-token KL per completion, as length_normalized), 'token_mean' (over all tokens of the batch) or "
            "'sequence_sum' (summed KL per completion: the sequence-level KL, which grows with length). Every "
            "method; with length_normalized only 'loss_type' or 'sequence_mean'."
        },
    )
    kl_horizon: float = field(
        default=10000.0,
        metadata={"help": "`target`: horizon of the adaptive controller, in completions: each update moves beta by "
                          "the factor 1 + e * n / kl_horizon, n the step's generated completions, each counted once "
                          "per generation batch (larger: slower beta changes). > 0, and > n / 5 with beta_min=0 and "
                          "beta > 0 (an update could reach 0 and stay there; checked once n is known)."},
    )
    beta_max: Optional[float] = field(
        default=None,
        metadata={"help": "`target`: upper bound of beta (None: unbounded). >= beta."},
    )
    kl_target_measure: str = field(
        default="token_mean",
        metadata={"help": "`target`: the KL compared with kl_target: 'token_mean' (the step's KL: sum of the KL over the "
                  "valid tokens of the step's completions / their count) or 'sequence_sum' (mean per-completion sum)."},
    )
    kl_placement: str = field(
        default="loss",
        metadata={"help": "Where beta * KL acts: 'loss' (stock: a KL term in the loss) or 'reward' (each "
                  "completion's reward becomes r_i - beta * KL_i before the advantages; the KL loss term is off). "
                  "With 'reward', kl_reduction picks KL_i: 'sequence_sum' (also what 'loss_type' means there) or "
                  "'sequence_mean'. Every method but length_normalized."},
    )
    ref_model_sync_kl: Optional[float] = field(
        default=None,
        metadata={"help": "With sync_ref_model=True: a due reference sync (every ref_model_sync_steps optimizer steps) "
                  "happens only if the last step's KL (the token mean of the un-shaped KL over every completion the step "
                  "trained on, all processes; with kl_placement='reward', of its generation batch) exceeded this. "
                  "None (sync on schedule) or a finite number > 0. Every method."},
    )
    ref_model_sync_reset_optimizer: bool = field(
        default=False,
        metadata={"help": "With sync_ref_model=True: each reference sync also clears the optimizer state (Adam moments "
                  "and step counts), as ProRL does; the learning-rate schedule goes on. Every method."},
    )

    def __post_init__(self) -> None:
        parent_post_init = getattr(super(), "__post_init__", None)
        if parent_post_init is not None:  # mixed into a trainer's config: let it resolve its own fields first
            parent_post_init()
        # Stored canonically so to_dict()/YAML/CLI round-trip it as one string.
        self.kl_adaptation_method = canonical_methods(self.kl_adaptation_method)
        self.kl_estimator = stored_estimator(self.kl_estimator)
        # Mixed into a config that holds the KL coefficient, the beta bounds are checked against it.
        self.validate_adaptive_kl(beta=getattr(self, "beta", None))

    @classmethod
    def unvalidated_from(cls, source: Any) -> "AdaptiveKLConfig":
        """The adaptive-KL settings `source` (any object: a trainer's config, a namespace) holds, fields it lacks at
        their defaults (so a trainer config without the fields means 'none'), NOT validated: for a caller that hands
        them to `AdaptiveKL(config, beta)`, which validates them, once, against the beta in use. Built without
        `__init__`, whose `__post_init__` would validate them a second time."""
        config = cls.__new__(cls)
        for name, value in zip(ADAPTIVE_KL_FIELDS, settings_of(source)):
            setattr(config, name, value)
        return config

    @property
    def kl_methods(self) -> tuple[str, ...]:
        """The active methods in application order; empty for 'none'. Parsed once per value of
        `kl_adaptation_method` and kept beside it (read on every loss call); a field set anew is parsed anew."""
        parsed = self.__dict__.get("_parsed_methods")
        if parsed is None or parsed[0] != self.kl_adaptation_method:
            # Not functools.cached_property: it would keep the methods of a field since set to another value.
            parsed = self.__dict__["_parsed_methods"] = (self.kl_adaptation_method,
                                                         parse_methods(self.kl_adaptation_method))
        return parsed[1]

    @property
    def reads_trainer_kl(self) -> bool:
        """True when the estimator is the one GRPO trainers compute themselves (k3, `STOCK_ESTIMATOR`): the methods
        then adapt the trainer's own per-token KL, taken where the trainer computes it."""
        return self.estimator == STOCK_ESTIMATOR

    @property
    def is_stock_kl(self) -> bool:
        """True when the KL term is the trainer's own: no field of `adapted_fields` set (no method, the stock estimator
        and reduction, in the loss)."""
        return not self.adapted_fields()

    @property
    def estimator(self) -> Union[str, Callable[..., Any]]:
        """The estimator in effect: `kl_estimator`, or for None the placement's default: 'k3' (the trainer's own) with
        the KL in the loss, 'k1' with the KL in the reward (where only an estimate whose value is the log-ratio gives
        the regularised optimum: the KL lab's finding)."""
        if self.kl_estimator is None:
            return "k1" if self.kl_in_reward else "k3"
        return self.kl_estimator

    def adapted_fields(self) -> list[str]:
        """The KL-shaping fields set away from the trainer's own KL term, as `name=value`: a method, an estimator
        other than the stock one, a `kl_reduction`, the KL in the reward. None set is `is_stock_kl`; with a beta of 0
        they have no effect."""
        adapted = {"kl_adaptation_method": bool(self.kl_methods),
                   "kl_estimator": self.kl_estimator not in (None, STOCK_ESTIMATOR),
                   "kl_reduction": self.kl_reduction != "loss_type", "kl_placement": self.kl_in_reward}
        return [f"{name}={getattr(self, name)!r}" for name, away in adapted.items() if away]

    @property
    def kl_in_reward(self) -> bool:
        """True when beta * KL_i is subtracted from each completion's reward instead of added to the loss."""
        return self.kl_placement == "reward"

    def validate_adaptive_kl(self, beta: Optional[float] = None) -> None:
        """Raise ValueError naming the field, the value and what is allowed for the first bad field. `beta`: the KL
        coefficient in use, which bounds beta_min and beta_max (None: unknown, not checked)."""
        methods = self.kl_methods  # parsed here once: every later call reads it
        if beta is not None:  # the trainer's own field, named before the fields it bounds
            check_beta(beta)
        check_real("kl_clip_threshold", self.kl_clip_threshold,
                   is_real(self.kl_clip_threshold) and 0 < self.kl_clip_threshold < math.inf,
                   "a finite number > 0")
        check_real("kl_target", self.kl_target,
                   is_real(self.kl_target) and 0 <= self.kl_target < math.inf,
                   "a finite number >= 0 (> 0 with kl_adaptation_method target)")
        check_real("dynamic_beta_decay", self.dynamic_beta_decay,
                   is_real(self.dynamic_beta_decay) and 0 < self.dynamic_beta_decay <= 1, "a number with 0 < x <= 1")
        check_real("reward_threshold", self.reward_threshold,
                   is_real(self.reward_threshold) and math.isfinite(self.reward_threshold), "a finite number")
        beta_bound = "beta" if beta is None else f"beta={beta!r}"
        check_real("beta_min", self.beta_min,
                   is_real(self.beta_min) and 0 <= self.beta_min < math.inf
                   and (beta is None or self.beta_min <= beta),
                   f"a finite number with 0 <= beta_min <= {beta_bound}")
        if not (self.kl_estimator is None or callable(self.kl_estimator) or self.kl_estimator in estimator_names()):
            raise reject("kl_estimator", self.kl_estimator,
                         f"None (the placement's default), one of {', '.join(estimator_names())} (register your own "
                         "with register_kl_estimator), or a callable (logp, ref_logp, mask) -> per-token KL")
        if callable(self.kl_estimator) and (refused := call_refused(self.kl_estimator, 3)):
            raise ValueError(f"kl_estimator={estimator_label(self.kl_estimator)!r} is invalid: {refused}; allowed is a "
                             "callable (logp, ref_logp, mask) -> per-token KL (one registered with "
                             "register_kl_estimator and named receives the config as a 4th argument)")
        check_real("kl_percentile", self.kl_percentile,
                   is_real(self.kl_percentile) and 0 < self.kl_percentile <= 1, "a number with 0 < x <= 1")
        check_real("kl_percentile_scale", self.kl_percentile_scale,
                   is_real(self.kl_percentile_scale) and 0 < self.kl_percentile_scale < math.inf,
                   "a finite number > 0")
        allowed = kl_reduction_settings()  # read at validation: registered reductions count
        if self.kl_reduction not in allowed:
            raise reject("kl_reduction", self.kl_reduction,
                         f"one of {', '.join(allowed)} (register your own with register_kl_reduction)")
        # in the reward, length_normalized is refused whatever the reduction (_validate_placement says why)
        if ("length_normalized" in methods and self.kl_placement != "reward"
                and self.kl_reduction not in ("loss_type", "sequence_mean")):
            raise reject("kl_reduction", self.kl_reduction,
                         "'loss_type' or 'sequence_mean' with kl_adaptation_method length_normalized")
        check_real("kl_horizon", self.kl_horizon,
                   is_real(self.kl_horizon) and 0 < self.kl_horizon < math.inf,
                   "a finite number > 0 (and > n / 5 with beta_min=0, n the completions of a step: checked when a "
                   "trainer is built, or at your loop's first training batch)")
        if self.beta_max is not None:
            check_real("beta_max", self.beta_max,
                       is_real(self.beta_max) and max(self.beta_min, beta or 0.0) <= self.beta_max < math.inf,
                       f"None or a finite number >= beta_min={self.beta_min!r} and >= {beta_bound}")
        if self.kl_target_measure not in TARGET_MEASURES:
            raise reject("kl_target_measure", self.kl_target_measure, f"one of {', '.join(TARGET_MEASURES)}")
        if "target" in methods and not self.kl_target > 0:
            raise reject("kl_target", self.kl_target, "a finite number > 0 with kl_adaptation_method target")
        self._validate_placement(methods)
        warn_estimator_placement(self.estimator, self.kl_placement)
        steps = self.beta_schedule_steps
        if steps is not None:
            check_whole("beta_schedule_steps", steps, 1, "an integer >= 1, or None for no cut-off")
        if self.ref_model_sync_kl is not None:
            check_real("ref_model_sync_kl", self.ref_model_sync_kl,
                       is_real(self.ref_model_sync_kl) and 0 < self.ref_model_sync_kl < math.inf,
                       "None or a finite number > 0")
        if not isinstance(self.ref_model_sync_reset_optimizer, bool):
            raise reject("ref_model_sync_reset_optimizer", self.ref_model_sync_reset_optimizer, "True or False")
        for name in self.unread_fields():
            warnings.warn(self._unread_message(name), UserWarning)  # attributed here: once per process and message
        for message in self.beta_held(beta):
            warnings.warn(message, UserWarning)

    def refuse_sync_settings(self, where: str, fix: str) -> None:
        """`ref_model_sync_kl` and `ref_model_sync_reset_optimizer` act on a reference sync alone: where none runs
        (`where`) a ValueError names the first one set, its value and `fix`."""
        for name, off in REFERENCE_SYNC_FIELDS.items():
            if getattr(self, name) is not off:
                raise reject(name, getattr(self, name), f"{off!r} {where} (the setting acts on the reference sync, "
                             f"which is off); {fix}")

    def schedule_after_run(self, beta: float, run_steps: int, field: str = "beta_schedule_steps") -> Optional[str]:
        """`dynamic`'s cut-off set where a run of `run_steps` steps (0: not known) ends first, said: beta = beta_min
        from the step after beta_schedule_steps, so with beta_schedule_steps >= run_steps no step trains at it. None
        otherwise, and for the default (1000), where the reward alone decays beta. `field`: the name the loop's
        configuration gives it."""
        steps = self.beta_schedule_steps
        if ("dynamic" not in self.kl_methods or beta == 0 or steps is None
                or steps == FIELD_DEFAULTS["beta_schedule_steps"] or not 0 < run_steps <= steps):
            return None
        return (f"{field}={steps} sets beta = beta_min={self.beta_min:g} after {steps} steps, and this run has "
                f"{run_steps}: no step trains at it. Set {field} below {run_steps} for the cut-off to act, or "
                "None for none.")

    def beta_held(self, beta: Optional[float]) -> list[str]:
        """What leaves a moving beta where it is, said (with `beta` > 0, or unknown: beta = 0 is said as the KL term
        off): `dynamic` with beta_min = beta (it only lowers beta, down to beta_min) or dynamic_beta_decay = 1 (a
        rewarded step multiplies beta by 1: without a cut-off beta never moves, with one reward_threshold decides
        nothing); `target` with beta_min = beta_max (the one value it may take)."""
        if beta == 0:
            return []
        methods, said = self.kl_methods, []
        if "dynamic" in methods and beta is not None and self.beta_min == beta:
            said.append(f"kl_adaptation_method dynamic cannot move beta: it lowers beta, down to beta_min="
                        f"{self.beta_min!r}, which is beta={beta!r}. Set beta_min < beta for beta to decay.")
        elif "dynamic" in methods and self.dynamic_beta_decay == 1 and self.beta_schedule_steps is None:
            said.append("kl_adaptation_method dynamic cannot move beta: dynamic_beta_decay="
                        f"{self.dynamic_beta_decay!r} multiplies it by 1 after a rewarded step, and "
                        "beta_schedule_steps=None sets no cut-off. Set dynamic_beta_decay < 1 for beta to decay.")
        elif ("dynamic" in methods and self.dynamic_beta_decay == 1
              and self.reward_threshold != FIELD_DEFAULTS["reward_threshold"]):
            said.append(f"reward_threshold={self.reward_threshold!r} has no effect: dynamic_beta_decay="
                        f"{self.dynamic_beta_decay!r} leaves beta where it is after a rewarded step (beta moves only "
                        f"at beta_schedule_steps={self.beta_schedule_steps!r}, to beta_min). Set "
                        "dynamic_beta_decay < 1 for the reward to decay beta.")
        if "target" in methods and self.beta_max is not None and self.beta_min == self.beta_max:
            said.append(f"kl_adaptation_method target cannot move beta: beta_min = beta_max = {self.beta_max!r} is the "
                        "one value it may take. Set beta_min < beta_max for beta to follow kl_target.")
        return said

    def _unread_message(self, name: str) -> str:
        readers = FIELD_READERS[name]
        if readers[0] in BUILT_IN_ESTIMATORS:
            estimator = self.estimator  # a callable by its name, not its address
            named = repr(estimator) if isinstance(estimator, str) else estimator_label(estimator)
            why = f"kl_estimator {readers[0]!r} reads it, and the estimator in effect is {named}"
        else:
            missing = "does not include it" if len(readers) == 1 else "includes neither"
            why = (f"kl_adaptation_method {' or '.join(readers)} reads it, and "
                   f"kl_adaptation_method={self.kl_adaptation_method!r} {missing}")
        return (f"{name}={getattr(self, name)!r} has no effect: only {why}. Leave it at its default, or choose a "
                "setting that reads it.")

    def reads(self, name: str) -> bool:
        """Whether a setting in effect reads the field `name`: one of its `FIELD_READERS` (a method or the estimator),
        or any field it does not list. Also True while a method a user registered is in effect, or an estimator
        registered with a config parameter (`takes_config`): it receives the config and may read any field. A callable
        estimator receives none: the fields it leaves unread are said as a built-in one's are."""
        methods, estimator = self.kl_methods, self.estimator
        if name not in FIELD_READERS or any(method not in METHODS for method in methods):
            return True
        if estimator not in BUILT_IN_ESTIMATORS and takes_config(estimator):
            return True
        return bool({*methods, estimator}.intersection(FIELD_READERS[name]))

    def unread_fields(self) -> list[str]:
        """The fields set away from their defaults that no setting in effect reads: each does nothing."""
        return [name for name, default in FIELD_DEFAULTS.items()
                if getattr(self, name) != default and not self.reads(name)]

    def _validate_placement(self, methods: tuple[str, ...]) -> None:
        if self.kl_placement not in KL_PLACEMENTS:
            raise reject("kl_placement", self.kl_placement, f"one of {', '.join(KL_PLACEMENTS)}")
        if self.kl_placement != "reward":
            return
        if "length_normalized" in methods:
            raise reject("kl_adaptation_method", self.kl_adaptation_method,
                         "methods without length_normalized with kl_placement='reward' (there each completion's KL "
                         "is already one number per completion: choose it with kl_reduction='sequence_mean')")
        allowed = kl_reduction_settings(reward=True)
        if self.kl_reduction not in allowed:
            raise reject("kl_reduction", self.kl_reduction,
                         f"one of {', '.join(allowed)} with kl_placement='reward' (one KL per completion)")


FIELD_DEFAULTS = {spec.name: spec.default for spec in dataclasses.fields(AdaptiveKLConfig)}  # in declaration order
ADAPTIVE_KL_FIELDS = tuple(FIELD_DEFAULTS)


def settings_of(source: Any) -> tuple[Any, ...]:
    """The adaptive-KL fields' values that `source` (a config, or a trainer's args it was copied from) holds, in
    `ADAPTIVE_KL_FIELDS` order, a field it lacks at its default (as `AdaptiveKLConfig.unvalidated_from` reads it), in
    the forms a config's `__post_init__` stores: a list of methods as their joined string (`kl_methods` reads it), a
    command line's "None" estimator as None. A trainer's args set so after the config was built (the list form is
    documented) read as they would have been built, by the run and by `AdaptiveKL.check_settings` alike."""
    values = {name: getattr(source, name, default) for name, default in FIELD_DEFAULTS.items()}
    if not isinstance(values["kl_adaptation_method"], str):
        values["kl_adaptation_method"] = canonical_methods(values["kl_adaptation_method"])
    values["kl_estimator"] = stored_estimator(values["kl_estimator"])
    return tuple(values.values())


def stored_estimator(value: Any) -> Any:
    """`kl_estimator` as a config stores it: a command line's "None" (argument parsers read an Optional[str] field
    as text) as None."""
    return None if isinstance(value, str) and value == "None" else value
