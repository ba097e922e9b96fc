"""The reductions of a per-token tensor to the loss's scalar, in one table (pure torch: it imports only numerics,
errors and the registry). Every reduction is a function of the per-completion sums S_i = sum_t m x and the lengths
L_i, so the per-token tensor is summed once per completion whatever the reduction.

`REDUCTIONS` holds one `Reduction` record each (its function, the loss types it serves, its `kl_reduction` setting,
its per-completion form in the reward, its `loss_agg_mode` name); the config's validation, the KL pipeline and the
integrations read it. `register_kl_reduction` adds a `kl_reduction` value, as the other registries add theirs.
"""

from __future__ import annotations

import math
import numbers
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, Union

import torch

from .errors import reject
from .numerics import in_float32, keep_valid, valid_positions
from .registry import NAME_RULE, selectable


CONTEXT_FIELDS = ("max_completion_length", "token_normalizer")


@dataclass(frozen=True)
class ReductionContext:
    """What some `loss_type` reductions need beyond the tensors.

    max_completion_length: dr_grpo's constant per-completion length.
    token_normalizer: dapo/cispo/vespo's active-token count for one micro-batch (the trainer's normalizer
        without the gradient-accumulation factor).
    """

    max_completion_length: Optional[int] = None
    token_normalizer: Optional[Union[torch.Tensor, float]] = None

    def __post_init__(self) -> None:
        # A number <= 0 would flip the KL term's sign or divide by zero, an infinite one zero the term. A tensor (the
        # trainer's own count, on its device) is not read back here.
        allowed = {"max_completion_length": "an integer >= 1", "token_normalizer": "a finite number > 0"}
        for name in CONTEXT_FIELDS:
            value = getattr(self, name)
            if value is None or isinstance(value, torch.Tensor):
                continue
            whole = name != "max_completion_length" or isinstance(value, numbers.Integral)
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not (0 < value < math.inf and whole):
                raise reject(name, value, f"{allowed[name]}, or None where the loss_type does not need it")


# Every reduction is a function of the per-completion sums S_i = sum_t m x and the lengths L_i, so the per-token
# tensor is summed once per completion whatever the reduction, and raw, adapted and diagnostics share that pass.
ReduceFn = Callable[[torch.Tensor, torch.Tensor, ReductionContext], torch.Tensor]
PerCompletion = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Reduction:
    """One reduction of a (B, T) per-token tensor to the loss's scalar, and every name it has: the one record that
    the config's validation, the core and the integrations read.

    name: the core's name for it (`reduce_kl`, `loss_type_reduction`, `kl_reduction`).
    reduce: (S, L, ctx) -> the scalar, from the sums S_i = sum_t m x and the lengths L_i.
    loss_types: the GRPO `loss_type`s that reduce their per-token loss this way; the first is the one its
        `agg_mode` stands for.
    setting: the `kl_reduction` value that picks it for the adapted KL (None: only a loss_type picks it).
    per_completion: (S, L) -> KL_i, its form with the KL in the reward, one KL per completion (None: not allowed
        there).
    agg_mode: its name where a trainer picks its loss aggregation by a `loss_agg_mode` ('token-mean',
        'seq-mean-token-mean', ...); None where it has none.
    reads: the `ReductionContext` fields it divides by (a registered reduction's function may read either).
    """

    name: str
    reduce: ReduceFn
    loss_types: tuple[str, ...] = ()
    setting: Optional[str] = None
    per_completion: Optional[PerCompletion] = None
    agg_mode: Optional[str] = None
    reads: tuple[str, ...] = ()


REDUCTIONS: dict[str, Reduction] = {}


def register_reduction(name: str, *, loss_types: tuple[str, ...] = (), setting: Optional[str] = None,
                       per_completion: Optional[PerCompletion] = None, agg_mode: Optional[str] = None,
                       reads: tuple[str, ...] = ()) -> Callable[[ReduceFn], ReduceFn]:
    """Decorator: the decorated `fn(S, L, ctx) -> scalar` becomes the reduction `name` (`REDUCTIONS[name]`), with the
    loss types, `kl_reduction` setting, per-completion form, `loss_agg_mode` name and context fields read given. A
    taken name or setting is a ValueError."""
    taken = [reduction.name for reduction in REDUCTIONS.values()] + list(kl_reduction_settings())
    if not selectable(name) or name in taken or (setting is not None and setting in taken):
        raise ValueError(f"register_kl_reduction({name!r}): allowed is {NAME_RULE} (taken: "
                         f"{', '.join(dict.fromkeys(taken))}).")

    def add(function: ReduceFn) -> ReduceFn:
        if not callable(function):
            raise TypeError(f"register_kl_reduction({name!r}) decorates a function, not {type(function).__name__}")
        REDUCTIONS[name] = Reduction(name, function, tuple(loss_types), setting, per_completion, agg_mode, reads)
        return function

    return add


def register_kl_reduction(name: str, *, per_completion: Optional[PerCompletion] = None
                          ) -> Callable[[ReduceFn], ReduceFn]:
    """Decorator: make `kl_reduction=name` reduce the adapted KL with the decorated `fn(S, L, ctx) -> scalar`, S_i =
    sum_t m k' the shaped KL summed per completion, L_i the lengths, ctx the `ReductionContext`
    (max_completion_length, token_normalizer), in every loop, as 'token_mean' or 'sequence_mean' do. With
    `per_completion` (`(S, L) -> KL_i`), it is allowed with kl_placement='reward' too. Register before the config is
    built: the value is validated there. A taken name is a ValueError."""
    return register_reduction(name, setting=name, per_completion=per_completion, reads=CONTEXT_FIELDS)


def kl_reduction_settings(reward: bool = False) -> tuple[str, ...]:
    """The allowed `kl_reduction` values, registered ones included: 'loss_type' and each reduction's setting; with the
    KL in the reward (`reward`), those with a per-completion form (each completion gets one KL_i)."""
    return ("loss_type", *(reduction.setting for reduction in REDUCTIONS.values()
                           if reduction.setting and (reduction.per_completion or not reward)))


def completion_sum(sums: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """KL_i = S_i, the sequence-level KL: every extra token adds its k."""
    return sums


def completion_mean(sums: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """KL_i = S_i / max(L_i, 1), the per-token mean."""
    return sums / lengths.clamp(min=1.0)


# Registered first: the reward's default ('loss_type' means it there), so the reward's allowed values list it first.
@register_reduction("sequence_sum_mean", loss_types=("luspo",), setting="sequence_sum", per_completion=completion_sum,
                    agg_mode="seq-mean-token-sum")
def sequence_sum_mean(sums: torch.Tensor, lengths: torch.Tensor, ctx: ReductionContext) -> torch.Tensor:
    """mean_i S_i (luspo; `kl_reduction='sequence_sum'`)."""
    return sums.mean()


@register_reduction("sequence_mean", loss_types=("grpo", "sapo"), setting="sequence_mean",
                    per_completion=completion_mean, agg_mode="seq-mean-token-mean")
def sequence_mean(sums: torch.Tensor, lengths: torch.Tensor, ctx: ReductionContext) -> torch.Tensor:
    """mean_i S_i / max(L_i, 1): each completion weighs the same whatever its length (grpo, sapo; length
    normalisation)."""
    return completion_mean(sums, lengths).mean()


@register_reduction("token_mean", loss_types=("bnpo",), setting="token_mean", agg_mode="token-mean")
def token_mean(sums: torch.Tensor, lengths: torch.Tensor, ctx: ReductionContext) -> torch.Tensor:
    """sum_i S_i / max(sum_i L_i, 1) over the micro-batch (bnpo)."""
    return sums.sum() / lengths.sum().clamp(min=1.0)


@register_reduction("max_length_mean", loss_types=("dr_grpo",), agg_mode="seq-mean-token-sum-norm",
                    reads=("max_completion_length",))
def max_length_mean(sums: torch.Tensor, lengths: torch.Tensor, ctx: ReductionContext) -> torch.Tensor:
    """sum_i S_i / (B * max_completion_length) (dr_grpo)."""
    if ctx.max_completion_length is None:
        raise reject("max_completion_length", None, "an integer >= 1, the cap on a completion's length, which "
                     "loss_type='dr_grpo' divides by")
    return sums.sum() / (sums.size(0) * ctx.max_completion_length)


@register_reduction("token_sum_normalized", loss_types=("dapo", "cispo", "vespo"), agg_mode="token-sum",
                    reads=("token_normalizer",))
def token_sum_normalized(sums: torch.Tensor, lengths: torch.Tensor, ctx: ReductionContext) -> torch.Tensor:
    """sum_i S_i / token_normalizer, the window's active tokens per micro-batch (dapo, cispo, vespo)."""
    if ctx.token_normalizer is None:
        raise reject("token_normalizer", None, "a finite number > 0, the active tokens of the micro-batch's window, "
                     "which loss_type dapo, cispo and vespo divide by")
    return sums.sum() / ctx.token_normalizer


# With the KL in the reward, kl_reduction='loss_type' means the sequence-level KL (there is no loss to follow).
REWARD_LOSS_TYPE_SETTING = "sequence_sum"


def loss_types() -> tuple[str, ...]:
    """Every GRPO `loss_type` adaptive KL supports (those of the registered reductions)."""
    return tuple(loss_type for reduction in REDUCTIONS.values() for loss_type in reduction.loss_types)


def loss_type_reduction(loss_type: str) -> str:
    """The reduction a stock GRPO `loss_type` applies to its per-token loss."""
    for reduction in REDUCTIONS.values():
        if loss_type in reduction.loss_types:
            return reduction.name
    raise ValueError(f"loss_type={loss_type!r} is not supported by adaptive KL: allowed is one of "
                     f"{', '.join(sorted(loss_types()))}.")


def reduction_of_setting(setting: str) -> Reduction:
    """The reduction `kl_reduction=setting` picks (a setting other than 'loss_type', which the config validated)."""
    return next(reduction for reduction in REDUCTIONS.values() if reduction.setting == setting)


def reward_reduction(config: Any) -> Reduction:
    """With the KL in the reward, the reduction whose per-completion form gives each completion's KL: `kl_reduction`'s,
    and for 'loss_type' the sequence-level KL (REWARD_LOSS_TYPE_SETTING)."""
    return reduction_of_setting(REWARD_LOSS_TYPE_SETTING if config.kl_reduction == "loss_type" else config.kl_reduction)


def kl_reduction(config: Any, loss_type: str) -> str:
    """The reduction of the adapted KL: `kl_reduction`'s when set, length normalisation's (each completion's mean
    per-token KL) when active, else the loss_type's own."""
    if config.kl_reduction != "loss_type":
        return reduction_of_setting(config.kl_reduction).name
    if "length_normalized" in config.kl_methods:
        return "sequence_mean"
    return loss_type_reduction(loss_type)


def reduction_left_as_is(config: Any, loss_type: str, *, prefix: str = "", loss: Optional[str] = None) -> Optional[str]:
    """Where a setting asks the KL in the loss for the reduction `loss_type` already gives it (`kl_reduction=...`, or
    length normalisation under grpo/sapo, which average each completion's tokens already), it changes nothing: the
    warning that says so, naming the setting (after `prefix`, the block a trainer's config holds it in) and the loss's
    own reduction (`loss`: how the trainer names it; default `loss_type=...`). None otherwise (the KL in the reward,
    whose reduction is per completion, is not the loss's)."""
    reduction = kl_reduction(config, loss_type)
    if config.kl_in_reward or reduction != loss_type_reduction(loss_type):
        return None
    if config.kl_reduction != "loss_type":
        setting = f"{prefix}kl_reduction={config.kl_reduction!r}"
    elif "length_normalized" in config.kl_methods:
        setting = f"length_normalized (in {prefix}kl_adaptation_method={config.kl_adaptation_method!r})"
    else:
        return None
    return (f"{setting} has no effect: {loss or f'loss_type={loss_type!r}'} already reduces the KL term that way. "
            "Leave it out, or choose a reduction the loss does not apply.")


def context_read(config: Any, loss_type: str) -> frozenset[str]:
    """The `ReductionContext` fields that the loss's reduction (`loss_type`'s) or the KL's
    (`kl_reduction(config, loss_type)`) divides by: the divisors a loop passes with each batch."""
    return frozenset({*REDUCTIONS[loss_type_reduction(loss_type)].reads,
                      *REDUCTIONS[kl_reduction(config, loss_type)].reads})


def warn_unread_context(ctx: ReductionContext, config: Any, loss_type: str) -> None:
    """Warn for each divisor a loop passed in `ctx` that `context_read(config, loss_type)` leaves out: it would do
    nothing, most likely because the loop normalises its loss as another loss type than the one it declared (once
    per process and message, Python's default filter: the message names the field and the loss type)."""
    loss, kl = loss_type_reduction(loss_type), kl_reduction(config, loss_type)
    read = context_read(config, loss_type)
    for field in CONTEXT_FIELDS:
        value = getattr(ctx, field)
        if value is None or field in read:
            continue
        *others, last = [loss for reduction in REDUCTIONS.values() if field in reduction.reads
                         for loss in reduction.loss_types]
        # The value is left out (a count that changes every batch), so the message is said once, not per count.
        warnings.warn(f"{field} has no effect: only loss_type {', '.join(others)}{' or ' * bool(others)}"
                      f"{last} reads it, and loss_type={loss_type!r} reduces the loss by {loss}"
                      f"{'' if kl == loss else f' and the KL by {kl}'}. Leave it None, or declare the loss type your "
                      "loss reduces as (AdaptiveKL(..., loss_type=...)).",
                      UserWarning)  # attributed here: once per process and message


def check_divisors_given(ctx: ReductionContext, reductions: Iterable[str], door: str) -> None:
    """Each reduction that reads a divisor `ctx` lacks asked, on a one-completion probe, whether it needs it, before
    anything is computed: a ValueError naming the divisor and the door it goes to (a loop that passed it to its loss
    and not to its `record_step_kl` met a reduction's internal name). The probe answers that alone: a registered
    reduction's other errors (one completion too few, say) are its own, met by the batch if at all."""
    for reduction in dict.fromkeys(reductions):
        missing = [field for field in REDUCTIONS[reduction].reads if getattr(ctx, field) is None]
        if not missing:  # every divisor it reads is there (the common case: nothing is computed)
            continue
        try:
            REDUCTIONS[reduction].reduce(torch.zeros(1), torch.ones(1), ctx)
        except Exception as error:  # a registered reduction raises what it raises
            if isinstance(error, ValueError) and any(str(error).startswith(f"{field}=None is invalid")
                                                     for field in missing):
                raise ValueError(f"{str(error).rstrip('.')}: pass it to {door}(...).") from None
            if isinstance(error, TypeError) and "NoneType" in str(error):  # a registered one divided by None
                raise ValueError(f"kl_reduction={reduction!r} divides by a divisor not given here ("
                                 f"{', '.join(f'{field}=None' for field in missing)}; {error}): pass it to "
                                 f"{door}(...).") from None
            # else its own check, of a probe that is not the batch: the batch meets it, if at all


def check_completions_fit(ctx: ReductionContext, mask: torch.Tensor, reductions: dict[str, str]) -> None:
    """A ValueError where dr_grpo's sum_i S_i / (B * max_completion_length) divides a term by a cap below a
    completion's valid tokens L_i: it is the cap on every L_i (a trainer's generation cap), so a smaller one would
    scale the term up without a word. `reductions`: {the term a door reduces ("the KL term", ...): its reduction's
    name}. The mask is read only where it is wider than the cap: a loop whose completions fit in width pays no device
    read."""
    cap = ctx.max_completion_length
    divided = [term for term, reduction in reductions.items() if reduction == "max_length_mean"]
    if cap is None or mask.shape[-1] <= cap or not divided:
        return
    longest = int(valid_positions(mask).sum(-1).max())
    if longest > cap:
        raise reject("max_completion_length", cap, f"an integer >= {longest}, the longest completion's valid tokens "
                     f"in this batch: loss_type='dr_grpo' divides {' and '.join(divided)} by it as the cap on every "
                     "completion's length")


def agg_mode_of(reduction: str, field: str = "kl_reduction") -> str:
    """The `loss_agg_mode` name of the named reduction (e.g. of `kl_reduction(config, loss_type)`: how a trainer that
    aggregates by such names reduces the adapted KL). A ValueError where it has none (a registered reduction), naming
    `field` (the setting, as the trainer's integration spells it), the reduction and the settings allowed there."""
    agg_mode = REDUCTIONS[reduction].agg_mode
    if agg_mode is None:
        allowed = [setting for setting in kl_reduction_settings()
                   if setting == "loss_type" or reduction_of_setting(setting).agg_mode is not None]
        raise ValueError(f"{field}={reduction!r} is invalid where the KL is aggregated by a loss_agg_mode name: the "
                         f"reduction has none (a registered one). Allowed is one of {', '.join(allowed)}.")
    return agg_mode


def loss_type_of_agg_mode(agg_mode: str, field: str = "loss_agg_mode") -> str:
    """The GRPO `loss_type` whose reduction has the `loss_agg_mode` name `agg_mode` (the first of that reduction's loss
    types). A ValueError naming `field` (the trainer's setting, as its integration spells it), the value and the
    names allowed, for a name no reduction has."""
    for reduction in REDUCTIONS.values():
        if reduction.agg_mode == agg_mode and reduction.loss_types:
            return reduction.loss_types[0]
    modes = [reduction.agg_mode for reduction in REDUCTIONS.values() if reduction.agg_mode and reduction.loss_types]
    raise ValueError(f"{field}={agg_mode!r} is invalid: allowed is one of {', '.join(modes)}.")


def reduce_sums(reduction: str, sums: torch.Tensor, lengths: torch.Tensor, ctx: ReductionContext) -> torch.Tensor:
    """The named reduction (a `REDUCTIONS` name) of per-completion sums S_i over L_i valid tokens, `ctx` in float32.
    Other modules reduce through this function, not `REDUCTIONS` itself: torch 2.4's `torch.compile` fails to guard
    a dict that a traced call reaches through two modules' globals ("DictGuardManager does not support a
    leaf_guard")."""
    return REDUCTIONS[reduction].reduce(sums, lengths, ctx)


def reduce_kl(x: torch.Tensor, mask: torch.Tensor, reduction: str, ctx: ReductionContext) -> torch.Tensor:
    """Apply the named reduction (a `REDUCTIONS` name: a loss type's is `loss_type_reduction(loss_type)`) to a
    per-token tensor (in float32 whatever its dtype). A nonzero mask entry is a valid token, a whole one: L_i counts
    them, as the KL pipeline does."""
    if reduction not in REDUCTIONS:
        raise reject("reduction", reduction, f"one of {', '.join(REDUCTIONS)} (a loss_type's: "
                     "loss_type_reduction(loss_type))")
    valid = valid_positions(mask)
    sums = keep_valid(x, valid).sum(-1)
    return reduce_sums(reduction, sums, valid.sum(-1, dtype=sums.dtype), context_in_float32(ctx))


def context_in_float32(ctx: ReductionContext) -> ReductionContext:
    """A floating tensor `token_normalizer` of another dtype in float32 (the same object otherwise: a float32 or an
    integer count divides a float32 sum as it is)."""
    normalizer = ctx.token_normalizer
    if isinstance(normalizer, torch.Tensor) and normalizer.is_floating_point() and normalizer.dtype != torch.float32:
        return ReductionContext(ctx.max_completion_length, in_float32(normalizer))
    return ctx


