"""Per-token KL shaping, per-`loss_type` reduction and the adapted KL term (pure torch, no trainer imports).

Notation: `kl` is the per-token KL estimate k[i, t] of completion i (shape (B, T)), `mask` is m[i, t] and
L_i = sum_t m[i, t]. Every function is traceable torch (no `.item()`), so it also runs inside
`torch.compile(fullgraph=True)`.

Numerics: everything is computed in float32 whatever the input dtype (bf16/fp16 per-token KL and masks are upcast;
float64 stays float64), so the terms, sums, lengths and normalisers are float32 for half-precision input. Masked
positions are set to 0 (they may hold NaN or +-inf) and get a zero gradient: `numerics.keep_valid`,
torch.where(mask != 0, upcast(x), 0).

Reductions: one table, `REDUCTIONS`, of one `Reduction` record each (its function of the per-completion sums, the
loss types it serves, its `kl_reduction` setting, its per-completion form in the reward, its `loss_agg_mode` name);
the config's validation, the core and the integrations read it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional, Union

import torch

from .numerics import HALF_PRECISION, LogpCheck, keep_valid, upcast
from .registry import SHAPINGS as _SHAPINGS
from .registry import new_method_name

if TYPE_CHECKING:  # config.py validates kl_reduction against this module's table, so it imports this one
    from .config import AdaptiveKLConfig

Shaping = Callable[[torch.Tensor, "AdaptiveKLConfig"], torch.Tensor]


def register_kl_shaping(name: str) -> Callable[[Shaping], Shaping]:
    """Decorator: make `kl_adaptation_method=name` (alone or joined with others by '+') shape the per-token KL with
    the decorated `fn(per_token_kl, config) -> shaped per-token KL`, in every loop (each trainer integration, your
    own, the KL lab). It runs where clip and sigmoid run: on the masked (B, T) KL (padded positions 0, which it must
    map to 0), before length normalisation and the reduction; at most one shaping per setting. Inside a trainer's
    compiled loss it must be traceable torch (no `.item()`). Register before the config is built: the name is
    validated there. A taken name is a ValueError."""
    new_method_name("register_kl_shaping", name)

    def add(function: Shaping) -> Shaping:
        if not callable(function):
            raise TypeError(f"register_kl_shaping({name!r}) decorates a function, not {type(function).__name__}")
        _SHAPINGS[name] = function
        return function

    return add


@register_kl_shaping("clip")
def clip_kl(kl: torch.Tensor, config: AdaptiveKLConfig) -> torch.Tensor:
    """k' = min(k, kl_clip_threshold). Above the threshold the KL gradient is zero."""
    return torch.clamp(kl, max=config.kl_clip_threshold)


@register_kl_shaping("sigmoid")
def sigmoid_kl(kl: torch.Tensor, config: AdaptiveKLConfig) -> torch.Tensor:
    """k' = sigmoid(k - kl_target) * k. The sigmoid runs in place on the difference (a temporary whose backward needs
    nothing of it): one full-size allocation fewer."""
    return torch.sub(kl, config.kl_target).sigmoid_() * kl


@dataclass(frozen=True)
class ReductionContext:
    """What some `loss_type` reductions need beyond the tensors.

    max_completion_length: dr_grpo's constant per-completion length.
    token_normalizer: dapo/cispo/vespo's active-token count for one micro-batch (the trainer's normalizer
        without the gradient-accumulation factor).
    """

    max_completion_length: Optional[int] = None
    token_normalizer: Optional[Union[torch.Tensor, float]] = None


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
    """

    name: str
    reduce: ReduceFn
    loss_types: tuple[str, ...] = ()
    setting: Optional[str] = None
    per_completion: Optional[PerCompletion] = None
    agg_mode: Optional[str] = None


REDUCTIONS: dict[str, Reduction] = {}


def register_reduction(name: str, *, loss_types: tuple[str, ...] = (), setting: Optional[str] = None,
                       per_completion: Optional[PerCompletion] = None,
                       agg_mode: Optional[str] = None) -> Callable[[ReduceFn], ReduceFn]:
    """Decorator: the decorated `fn(S, L, ctx) -> scalar` becomes the reduction `name` (`REDUCTIONS[name]`, usable
    by `reduce_kl`), with the loss types, `kl_reduction` setting, per-completion form and `loss_agg_mode` name
    given."""

    def add(function: ReduceFn) -> ReduceFn:
        REDUCTIONS[name] = Reduction(name, function, tuple(loss_types), setting, per_completion, agg_mode)
        return function

    return add


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


@register_reduction("max_length_mean", loss_types=("dr_grpo",), agg_mode="seq-mean-token-sum-norm")
def max_length_mean(sums: torch.Tensor, lengths: torch.Tensor, ctx: ReductionContext) -> torch.Tensor:
    """sum_i S_i / (B * max_completion_length) (dr_grpo)."""
    if ctx.max_completion_length is None:
        raise ValueError("the 'max_length_mean' reduction (loss_type='dr_grpo') needs max_completion_length")
    return sums.sum() / (sums.size(0) * ctx.max_completion_length)


@register_reduction("token_sum_normalized", loss_types=("dapo", "cispo", "vespo"), agg_mode="token-sum")
def token_sum_normalized(sums: torch.Tensor, lengths: torch.Tensor, ctx: ReductionContext) -> torch.Tensor:
    """sum_i S_i / token_normalizer, the window's active tokens per micro-batch (dapo, cispo, vespo)."""
    if ctx.token_normalizer is None:
        raise ValueError("the 'token_sum_normalized' reduction (loss_type='dapo'/'cispo'/'vespo') needs token_normalizer")
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


def kl_reduction(config: AdaptiveKLConfig, loss_type: str) -> str:
    """The reduction of the adapted KL: `kl_reduction`'s when set, length normalisation's (each completion's mean
    per-token KL) when active, else the loss_type's own."""
    if config.kl_reduction != "loss_type":
        return reduction_of_setting(config.kl_reduction).name
    if "length_normalized" in config.kl_methods:
        return "sequence_mean"
    return loss_type_reduction(loss_type)


def agg_mode_of(reduction: str) -> str:
    """The `loss_agg_mode` name of the named reduction (e.g. of `kl_reduction(config, loss_type)`: how a trainer that
    aggregates by such names reduces the adapted KL). A ValueError where it has none."""
    agg_mode = REDUCTIONS[reduction].agg_mode
    if agg_mode is None:
        raise ValueError(f"the {reduction!r} reduction has no loss_agg_mode name")
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


def reduce_kl(x: torch.Tensor, mask: torch.Tensor, reduction: str, ctx: ReductionContext) -> torch.Tensor:
    """Apply the named reduction to a per-token tensor (in float32 for half-precision input)."""
    sums = keep_valid(x, mask).sum(-1)
    return REDUCTIONS[reduction].reduce(sums, mask.sum(-1, dtype=sums.dtype), _upcast_context(ctx))


def _upcast_context(ctx: ReductionContext) -> ReductionContext:
    """A half-precision tensor `token_normalizer` in float32 (the same object otherwise)."""
    normalizer = ctx.token_normalizer
    if isinstance(normalizer, torch.Tensor) and normalizer.dtype in HALF_PRECISION:
        return ReductionContext(ctx.max_completion_length, upcast(normalizer))
    return ctx


def shapes_per_token(config: AdaptiveKLConfig) -> bool:
    """Whether a configured method shapes the per-token KL (clip, sigmoid, a registered shaping)."""
    return any(method in _SHAPINGS for method in config.kl_methods)


def shape_kl(kl: torch.Tensor, config: AdaptiveKLConfig) -> torch.Tensor:
    """Per-token shaping k -> k' by the configured clip/sigmoid method (identity without one)."""
    for method in config.kl_methods:
        if method in _SHAPINGS:
            kl = _SHAPINGS[method](kl, config)
    return kl


def clipped_tokens(valid_kl: torch.Tensor, config: AdaptiveKLConfig, lengths: torch.Tensor) -> torch.Tensor:
    """`clip`: how many valid tokens have k >= kl_clip_threshold (padded positions are 0 < kl_clip_threshold), in the
    dtype of `lengths`; 0 otherwise. The comparison writes its 0/1 straight into a tensor of that dtype: a bool
    result summed as floats costs 4x as much on a CPU (0.29 against 0.07 ms at 64 x 4096, measured)."""
    if "clip" not in config.kl_methods:
        return lengths.new_zeros(())
    indicator = torch.empty_like(valid_kl, dtype=lengths.dtype)
    return torch.ge(valid_kl, config.kl_clip_threshold, out=indicator).sum()


@dataclass
class KLTerm:
    """One batch's KL and diagnostics: a micro-batch's KL term (KL in the loss, `kl_term`), or a generation batch's
    per-completion KL (KL in the reward, `completion_kl`).

    raw: the un-adapted KL reduced as loss_type reduces the loss (detached, for logging); in the reward, KL_i of each
    completion (shape (B,)).
    adapted: the adapted KL, the quantity beta multiplies in the loss (carries gradient); in the reward, KL_i of the
    shaped per-token KL (detached: the penalty enters the advantages, not the gradient).
    sequence_kl: S_i = sum_t m k, each completion's summed un-adapted KL (detached). lengths: L_i.
    at_threshold: how many valid tokens have k >= kl_clip_threshold (`clip` only; 0 otherwise).
    check: the non-finite check of the log-probs the KL came from (`AdaptiveKL` sets it where it has them).
    All float32 for half-precision input (float64 for float64 input)."""

    raw: torch.Tensor
    adapted: torch.Tensor
    sequence_kl: torch.Tensor
    lengths: torch.Tensor
    at_threshold: torch.Tensor
    check: Optional[LogpCheck] = None


def masked_row_sums(
    kl: torch.Tensor, mask: torch.Tensor, config: AdaptiveKLConfig
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The one masked pass: (m k with padded positions 0, L_i, S_i = sum_t m k, sum_t m k'), k' the shaped KL; the last
    is S_i itself (the same tensor) when no shaping is configured. Every shaping maps 0 to 0, so padded positions stay 0.
    float32 for half-precision input (the lengths too: a bf16 sum holds integers exactly only up to 256)."""
    valid_kl = keep_valid(kl, mask)
    shaped = shape_kl(valid_kl, config)
    sums = valid_kl.sum(-1)
    return valid_kl, mask.sum(-1, dtype=valid_kl.dtype), sums, sums if shaped is valid_kl else shaped.sum(-1)


def adapted_kl_term(
    kl: torch.Tensor, mask: torch.Tensor, config: AdaptiveKLConfig, loss_type: str, ctx: ReductionContext
) -> KLTerm:
    """shaping -> length normalisation (reduction); the caller multiplies `adapted` by the current beta.

    One masked pass: padded positions are set to 0 first (`keep_valid`; every shaping maps 0 to 0, so they stay 0), the
    shaping runs on that tensor, and each of the raw and the adapted KL is summed per completion once; the reductions and
    the diagnostics are then O(B) functions of those sums."""
    raw_reduction, adapted_reduction = loss_type_reduction(loss_type), kl_reduction(config, loss_type)
    ctx = _upcast_context(ctx)
    valid_kl, lengths, sums, adapted_sums = masked_row_sums(kl, mask, config)
    raw_sums = sums.detach()
    adapted = REDUCTIONS[adapted_reduction].reduce(adapted_sums, lengths, ctx)
    if adapted_sums is sums and adapted_reduction == raw_reduction:  # nothing adapted: the same number
        raw = adapted.detach()
    else:
        raw = REDUCTIONS[raw_reduction].reduce(raw_sums, lengths, ctx)
    at_threshold = clipped_tokens(valid_kl.detach(), config, lengths)
    return KLTerm(raw=raw, adapted=adapted, sequence_kl=raw_sums, lengths=lengths, at_threshold=at_threshold)


def kl_term(kl: torch.Tensor, mask: torch.Tensor, config: AdaptiveKLConfig, loss_type: str,
            ctx: ReductionContext, with_grad: Optional[bool] = None) -> KLTerm:
    """`adapted_kl_term`, recording an autograd graph only where the term carries gradient: by default, where the KL
    term is the trainer's own (`is_stock_kl`) it only feeds the metrics, so none is recorded; `with_grad` decides."""
    with_grad = not config.is_stock_kl if with_grad is None else with_grad
    with contextlib.nullcontext() if with_grad else torch.no_grad():
        return adapted_kl_term(kl, mask, config, loss_type, ctx)


# ----- the KL in the reward (kl_placement="reward") -------------------------------------------------------------

@torch.no_grad()
def completion_kl(kl: torch.Tensor, mask: torch.Tensor, config: AdaptiveKLConfig,
                  check: Optional[LogpCheck] = None) -> KLTerm:
    """KL_i = reduce_t(shape(k_i,t)) per completion: shaping (clip/sigmoid) per token, then `kl_reduction`
    (`sequence_sum`, also what 'loss_type' means here: S_i = sum_t m k'; `sequence_mean`: S_i / max(L_i, 1)): the
    reduction's `per_completion` form. One masked pass, as `adapted_kl_term`."""
    setting = REWARD_LOSS_TYPE_SETTING if config.kl_reduction == "loss_type" else config.kl_reduction
    reduce = reduction_of_setting(setting).per_completion
    valid_kl, lengths, sums, adapted_sums = masked_row_sums(kl, mask, config)
    raw = reduce(sums, lengths)
    adapted = raw if adapted_sums is sums else reduce(adapted_sums, lengths)
    at_threshold = clipped_tokens(valid_kl, config, lengths)
    return KLTerm(raw=raw, adapted=adapted, sequence_kl=sums, lengths=lengths, at_threshold=at_threshold,
                  check=check)
