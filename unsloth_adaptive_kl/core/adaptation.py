"""Per-token KL shaping, per-`loss_type` reduction and the adapted KL term (pure torch, no trainer imports).

Notation: `kl` is the per-token KL estimate k[i, t] of completion i (shape (B, T)), `mask` is m[i, t] and
L_i = sum_t m[i, t]. Every function is traceable torch (no `.item()`), so it also runs inside
`torch.compile(fullgraph=True)`.

Numerics: everything is computed in float32 whatever the input dtype (bf16/fp16 per-token KL and masks are upcast;
float64 stays float64), so the terms, sums, lengths and normalisers are float32 for half-precision input. Masked
positions are set to 0 (they may hold NaN or +-inf) and get a zero gradient (`numerics.keep_valid`).
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch

from .config import AdaptiveKLConfig
from .numerics import LogpCheck, keep_valid
from .registry import SHAPINGS as _SHAPINGS
from .registry import new_method_name, registrar

Shaping = Callable[[torch.Tensor, AdaptiveKLConfig], torch.Tensor]


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


Reduction = Callable[[torch.Tensor, torch.Tensor, ReductionContext], torch.Tensor]
_REDUCTIONS: dict[str, Reduction] = {}


register_reduction = registrar(_REDUCTIONS)

# Every reduction is a function of the per-completion sums S_i = sum_t m k and the lengths L_i, so the per-token
# tensor is reduced once (`row_sums`) whatever the reduction, and raw, adapted and diagnostics share that pass.


def masked(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """x on valid positions (mask != 0), 0 on masked ones, in float32 for half-precision x: whatever a padded position
    holds (NaN, +-inf) it cannot leak into a sum, and its gradient is exactly 0. A NaN or inf at a valid position stays
    (never silently zeroed): the KL's sums are then non-finite, which `AdaptiveKL` reports."""
    return keep_valid(x, mask)


def row_sums(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """S_i = sum_t m x."""
    return masked(x, mask).sum(-1)


@register_reduction("sequence_mean")
def sequence_mean(sums: torch.Tensor, lengths: torch.Tensor, ctx: ReductionContext) -> torch.Tensor:
    """mean_i S_i / max(L_i, 1): each completion weighs the same whatever its length (grpo, sapo)."""
    return (sums / lengths.clamp(min=1.0)).mean()


@register_reduction("token_mean")
def token_mean(sums: torch.Tensor, lengths: torch.Tensor, ctx: ReductionContext) -> torch.Tensor:
    """sum_i S_i / max(sum_i L_i, 1) over the micro-batch (bnpo)."""
    return sums.sum() / lengths.sum().clamp(min=1.0)


@register_reduction("max_length_mean")
def max_length_mean(sums: torch.Tensor, lengths: torch.Tensor, ctx: ReductionContext) -> torch.Tensor:
    """sum_i S_i / (B * max_completion_length) (dr_grpo)."""
    if ctx.max_completion_length is None:
        raise ValueError("the 'max_length_mean' reduction (loss_type='dr_grpo') needs max_completion_length")
    return sums.sum() / (sums.size(0) * ctx.max_completion_length)


@register_reduction("token_sum_normalized")
def token_sum_normalized(sums: torch.Tensor, lengths: torch.Tensor, ctx: ReductionContext) -> torch.Tensor:
    """sum_i S_i / token_normalizer, the window's active tokens per micro-batch (dapo, cispo, vespo)."""
    if ctx.token_normalizer is None:
        raise ValueError("the 'token_sum_normalized' reduction (loss_type='dapo'/'cispo'/'vespo') needs token_normalizer")
    return sums.sum() / ctx.token_normalizer


@register_reduction("sequence_sum_mean")
def sequence_sum_mean(sums: torch.Tensor, lengths: torch.Tensor, ctx: ReductionContext) -> torch.Tensor:
    """mean_i S_i (luspo)."""
    return sums.mean()


LOSS_TYPE_REDUCTIONS: dict[str, str] = {
    "grpo": "sequence_mean",
    "sapo": "sequence_mean",
    "bnpo": "token_mean",
    "dr_grpo": "max_length_mean",
    "dapo": "token_sum_normalized",
    "cispo": "token_sum_normalized",
    "vespo": "token_sum_normalized",
    "luspo": "sequence_sum_mean",
}
# Length normalisation: each completion contributes its mean per-token KL, whatever the loss_type.
LENGTH_METHOD_REDUCTIONS: dict[str, str] = {"length_normalized": "sequence_mean"}
# `kl_reduction` values other than "loss_type", and the reduction each names.
KL_REDUCTION_FIELD: dict[str, str] = {
    "sequence_mean": "sequence_mean",  # mean per-token KL of each completion, averaged over completions
    "token_mean": "token_mean",  # per-token KL averaged over every token of the micro-batch
    "sequence_sum": "sequence_sum_mean",  # summed KL of each completion (sequence-level KL), averaged
}


def loss_type_reduction(loss_type: str) -> str:
    """The reduction a stock GRPO `loss_type` applies to its per-token loss."""
    if loss_type not in LOSS_TYPE_REDUCTIONS:
        raise ValueError(
            f"loss_type={loss_type!r} is not supported by adaptive KL: allowed is one of "
            f"{', '.join(sorted(LOSS_TYPE_REDUCTIONS))}."
        )
    return LOSS_TYPE_REDUCTIONS[loss_type]


def reduce_kl(x: torch.Tensor, mask: torch.Tensor, reduction: str, ctx: ReductionContext) -> torch.Tensor:
    """Apply the named reduction to a per-token tensor (in float32 for half-precision input)."""
    sums = row_sums(x, mask)
    return _REDUCTIONS[reduction](sums, mask.sum(-1, dtype=sums.dtype), _upcast_context(ctx))


def _upcast_context(ctx: ReductionContext) -> ReductionContext:
    """A half-precision tensor `token_normalizer` in float32 (the same object otherwise)."""
    normalizer = ctx.token_normalizer
    if isinstance(normalizer, torch.Tensor) and normalizer.dtype in (torch.float16, torch.bfloat16):
        return ReductionContext(ctx.max_completion_length, normalizer.float())
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


def kl_reduction(config: AdaptiveKLConfig, loss_type: str) -> str:
    """The reduction of the adapted KL: `kl_reduction`'s when set, length normalisation's when active, else the
    loss_type's own."""
    if config.kl_reduction in KL_REDUCTION_FIELD:
        return KL_REDUCTION_FIELD[config.kl_reduction]
    for method in config.kl_methods:
        if method in LENGTH_METHOD_REDUCTIONS:
            return LENGTH_METHOD_REDUCTIONS[method]
    return loss_type_reduction(loss_type)


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
    valid_kl = masked(kl, mask)
    shaped = shape_kl(valid_kl, config)
    sums = valid_kl.sum(-1)
    return valid_kl, mask.sum(-1, dtype=valid_kl.dtype), sums, sums if shaped is valid_kl else shaped.sum(-1)


def adapted_kl_term(
    kl: torch.Tensor, mask: torch.Tensor, config: AdaptiveKLConfig, loss_type: str, ctx: ReductionContext
) -> KLTerm:
    """shaping -> length normalisation (reduction); the caller multiplies `adapted` by the current beta.

    One masked pass: padded positions are set to 0 first (`masked`; every shaping maps 0 to 0, so they stay 0), the
    shaping runs on that tensor, and each of the raw and the adapted KL is summed per completion once; the reductions and
    the diagnostics are then O(B) functions of those sums."""
    raw_reduction, adapted_reduction = loss_type_reduction(loss_type), kl_reduction(config, loss_type)
    ctx = _upcast_context(ctx)
    valid_kl, lengths, sums, adapted_sums = masked_row_sums(kl, mask, config)
    raw_sums = sums.detach()
    adapted = _REDUCTIONS[adapted_reduction](adapted_sums, lengths, ctx)
    if adapted_sums is sums and adapted_reduction == raw_reduction:  # nothing adapted: the same number
        raw = adapted.detach()
    else:
        raw = _REDUCTIONS[raw_reduction](raw_sums, lengths, ctx)
    at_threshold = clipped_tokens(valid_kl.detach(), config, lengths)
    return KLTerm(raw=raw, adapted=adapted, sequence_kl=raw_sums, lengths=lengths, at_threshold=at_threshold)


_compiled_term: Optional[Callable[..., KLTerm]] = None
_compile_failed = False


def kl_term(kl: torch.Tensor, mask: torch.Tensor, config: AdaptiveKLConfig, loss_type: str,
            ctx: ReductionContext, with_grad: Optional[bool] = None) -> KLTerm:
    """`adapted_kl_term`, as one `torch.compile` graph when `config.kl_compile` (compiled once per process; shapes
    turn dynamic after the first change). Where compiling or running the graph fails, eager from then on, after one
    warning naming the error: the result is the same, only slower. By default, where the KL term is the trainer's
    own (`is_stock_kl`) it only feeds the metrics, so no autograd graph is recorded for it; `with_grad` decides."""
    with_grad = not config.is_stock_kl if with_grad is None else with_grad
    with contextlib.nullcontext() if with_grad else torch.no_grad():
        return _term(kl, mask, config, loss_type, ctx)


def _term(kl: torch.Tensor, mask: torch.Tensor, config: AdaptiveKLConfig, loss_type: str,
          ctx: ReductionContext) -> KLTerm:
    global _compiled_term
    if not config.kl_compile or _compile_failed:
        return adapted_kl_term(kl, mask, config, loss_type, ctx)
    if _compiled_term is None:
        _compiled_term = torch.compile(adapted_kl_term)
    try:
        if torch.is_grad_enabled() and kl.requires_grad:
            return _CompiledWithEagerBackward.term(kl, mask, config, loss_type, ctx)
        return _compiled_term(kl, mask, config, loss_type, ctx)
    except Exception as error:  # no compiler toolchain, an unsupported backend: the eager core computes the same
        _fall_back(error)
        return adapted_kl_term(kl, mask, config, loss_type, ctx)


def _fall_back(error: Exception) -> None:
    """From now on the eager core, after one warning naming the error."""
    global _compile_failed
    _compile_failed = True
    warnings.warn(f"kl_compile=True: torch.compile failed ({type(error).__name__}: {error}); the KL adaptation "
                  "runs eagerly.", RuntimeWarning, stacklevel=4)


class _CompiledWithEagerBackward(torch.autograd.Function):
    """The compiled term whose backward falls back to eager: torch.compile compiles the backward graph lazily, at
    the first `loss.backward()`, where a failure (a Triton error, say) would otherwise crash the step. The forward
    runs the compiled graph on a detached leaf; the backward takes the compiled graph's gradient, and where that
    fails, warns once and recomputes the gradient through the eager core (the same value)."""

    @staticmethod
    def term(kl: torch.Tensor, mask: torch.Tensor, config: AdaptiveKLConfig, loss_type: str,
             ctx: ReductionContext) -> KLTerm:
        box: dict = {}
        adapted = _CompiledWithEagerBackward.apply(kl, mask, config, loss_type, ctx, box)
        term = box.pop("term")
        term.adapted = adapted
        return term

    @staticmethod
    def forward(autograd_ctx, kl, mask, config, loss_type, ctx, box):  # type: ignore[override]
        leaf = kl.detach().requires_grad_(True)
        with torch.enable_grad():
            term = _compiled_term(leaf, mask, config, loss_type, ctx)
        autograd_ctx.graph = (leaf, term.adapted, mask, config, loss_type, ctx)
        box["term"] = term
        return term.adapted.detach()

    @staticmethod
    def backward(autograd_ctx, grad):  # type: ignore[override]
        leaf, adapted, mask, config, loss_type, ctx = autograd_ctx.graph
        del autograd_ctx.graph
        gradient = None
        if not _compile_failed:
            try:
                (gradient,) = torch.autograd.grad(adapted, leaf, grad)
            except Exception as error:  # the compiled backward failed to compile or to run
                _fall_back(error)
        if gradient is None:
            with torch.enable_grad():
                eager_leaf = leaf.detach().requires_grad_(True)
                (gradient,) = torch.autograd.grad(
                    adapted_kl_term(eager_leaf, mask, config, loss_type, ctx).adapted, eager_leaf, grad)
        return gradient, None, None, None, None, None


# ----- the KL in the reward (kl_placement="reward") -------------------------------------------------------------

# KL_i from the per-completion sums S_i and lengths L_i; with the KL in the reward "loss_type" means the sum.
COMPLETION_KL_REDUCTIONS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "sequence_sum": lambda sums, lengths: sums,  # KL_i = S_i, the sequence-level KL: every extra token adds k >= 0
    "sequence_mean": lambda sums, lengths: sums / lengths.clamp(min=1.0),  # KL_i = S_i / L_i, the per-token mean
}
COMPLETION_KL_REDUCTIONS["loss_type"] = COMPLETION_KL_REDUCTIONS["sequence_sum"]


@torch.no_grad()
def completion_kl(kl: torch.Tensor, mask: torch.Tensor, config: AdaptiveKLConfig,
                  check: Optional[LogpCheck] = None) -> KLTerm:
    """KL_i = reduce_t(shape(k_i,t)) per completion: shaping (clip/sigmoid) per token, then `kl_reduction`
    (`sequence_sum`: S_i = sum_t m k'; `sequence_mean`: S_i / max(L_i, 1)). One masked pass, as `adapted_kl_term`."""
    reduce = COMPLETION_KL_REDUCTIONS[config.kl_reduction]
    valid_kl, lengths, sums, adapted_sums = masked_row_sums(kl, mask, config)
    raw = reduce(sums, lengths)
    adapted = raw if adapted_sums is sums else reduce(adapted_sums, lengths)
    at_threshold = clipped_tokens(valid_kl, config, lengths)
    return KLTerm(raw=raw, adapted=adapted, sequence_kl=sums, lengths=lengths, at_threshold=at_threshold,
                        check=check)
