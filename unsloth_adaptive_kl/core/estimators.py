"""Per-token KL(pi_theta || pi_ref) estimators (pure torch, traceable: no `.item()`, no Python branching on values).

Notation: logp = log pi_theta(token), ref = log pi_ref(token), r = ref - logp (so pi_ref / pi_theta = exp(r)),
mask m marks completion tokens. Every estimator maps (logp, ref, mask) to a (B, T) tensor.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import torch

from .numerics import keep_valid, masked_logps, valid_positions
from .registry import NAME_RULE, selectable

Estimator = Callable[..., torch.Tensor]
_ESTIMATORS: dict[str, Estimator] = {}
_TAKES_CONFIG: set[str] = set()  # estimators called with the config as a 4th argument


def register_kl_estimator(name: str) -> Callable[[Estimator], Estimator]:
    """Decorator: make `kl_estimator=name` mean the decorated function, everywhere the field is read (each trainer's
    config, the command line, `AdaptiveKL`). The function maps (logp, ref_logp, mask), (B, T) tensors of policy and
    reference log-probs of the sampled tokens and the completion mask, to a (B, T) per-token KL; a 4th positional
    parameter, if it has one, receives the `AdaptiveKLConfig` (for settings of its own), and one that cannot take
    these arguments is refused here (TypeError). Every method then reads the KL it gives (shaping, length
    normalisation, reductions, the KL in the reward). Register before the config is built: the name is validated
    there. A registered name cannot be registered again."""
    if not selectable(name) or name in _ESTIMATORS:
        taken = f" (registered: {', '.join(_ESTIMATORS)})" if name in _ESTIMATORS else ""
        raise ValueError(f"register_kl_estimator({name!r}): allowed is {NAME_RULE}{taken}.")

    def add(function: Estimator) -> Estimator:
        if not callable(function):
            raise TypeError(f"register_kl_estimator({name!r}) decorates a function, not {type(function).__name__}")
        config = named_positionals(function) >= 4
        refused = call_refused(function, 4 if config else 3)
        if refused:
            raise TypeError(f"register_kl_estimator({name!r}): {refused}; allowed is a function of (logp, ref_logp, "
                            "mask), and of a 4th positional parameter where it reads the AdaptiveKLConfig")
        _ESTIMATORS[name] = function
        if config:
            _TAKES_CONFIG.add(name)
        return function

    return add


def named_positionals(function: Callable[..., Any]) -> int:
    """The named parameters `function` takes by position (*args, keyword-only ones and **kwargs are not); 3 where
    Python cannot read its signature (some builtins)."""
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):
        return 3
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in parameters)


def call_refused(function: Callable[..., Any], arguments: int) -> str:
    """Why `function` cannot be called with `arguments` positional arguments and no keyword (Python's own message,
    its signature named), or "" where it can or its signature cannot be read."""
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):
        return ""
    try:
        signature.bind(*range(arguments))
    except TypeError as error:
        label = estimator_label(function)
        return f"{label}{signature} cannot be called with {arguments} positional arguments ({error})"
    return ""


def takes_config(estimator: Any) -> bool:
    """Whether `run_estimator` hands `estimator` the config: a name registered with a 4th positional parameter (a
    keyword-only one or **kwargs is left alone). A callable, and a name registered without one, receive no
    setting."""
    return isinstance(estimator, str) and estimator in _TAKES_CONFIG


def estimator_names() -> tuple[str, ...]:
    """Every registered estimator name, built-in first."""
    return tuple(_ESTIMATORS)


@register_kl_estimator("k1")
def k1(logp: torch.Tensor, ref: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """k1 = logp - ref = -r (unbiased, high variance, can be negative)."""
    return logp - ref


@register_kl_estimator("k2")
def k2(logp: torch.Tensor, ref: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """k2 = 0.5 * (logp - ref)^2 (biased, low variance; its gradient is the unbiased reverse-KL gradient)."""
    return 0.5 * (logp - ref) ** 2


@register_kl_estimator("k3")
def k3(logp: torch.Tensor, ref: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """k3 = exp(r) - r - 1 (unbiased, >= 0): the estimator GRPO trainers compute by default."""
    r = ref - logp
    return torch.exp(r) - r - 1


@register_kl_estimator("low_var_kl")
def low_var_kl(logp: torch.Tensor, ref: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """low_var_kl: k3 of r clamped to [-20, 20], the result clamped to [-10, 10]."""
    r = torch.clamp(ref - logp, min=-20.0, max=20.0)
    return torch.clamp(torch.exp(r) - r - 1, min=-10.0, max=10.0)


def straight_through(value: torch.Tensor, gradient_of: torch.Tensor) -> torch.Tensor:
    """The value of `value` with the gradient of `gradient_of`."""
    return gradient_of + (value - gradient_of).detach()


@register_kl_estimator("k1+")
def k1_plus(logp: torch.Tensor, ref: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Value of k1, gradient of k2."""
    return straight_through(k1(logp, ref, mask), k2(logp, ref, mask))


@register_kl_estimator("k3+")
def k3_plus(logp: torch.Tensor, ref: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Value of k3, gradient of k2."""
    return straight_through(k3(logp, ref, mask), k2(logp, ref, mask))


@register_kl_estimator("k1_future")
def k1_future(logp: torch.Tensor, ref: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Value k1_t = logp_t - ref_t per token (so sums and metrics stay the completion's log-ratio); gradient
    sg(G_t) * grad logp_t with G_t = sum_{s >= t} m_s k1_s, the KL-to-go of the completion. Summed over a
    completion's tokens, that is the score-function gradient of the whole completion's reverse KL,
    E[sum_t G_t grad logp_t] = grad KL(pi_theta || pi_ref) over sequences: the loss-side KL whose fixed point is the
    KL-regularised optimum (a per-token k2 or k3 misses the KL of the tokens that follow). Padded positions (any value)
    carry no KL-to-go and no gradient."""
    valid = mask.bool()
    value = logp - ref
    to_go = torch.where(valid, value.detach(), 0.0).flip(-1).cumsum(-1).flip(-1)
    surrogate = to_go * torch.where(valid, logp, 0.0)
    return value.detach() + (surrogate - surrogate.detach())


def bottom_percentile_mask(ref: torch.Tensor, mask: torch.Tensor, fraction: float) -> torch.Tensor:
    """True on the valid tokens whose ref log-prob is <= the k-th smallest valid ref log-prob, k = max(1, floor(n *
    fraction)) over the n valid tokens of the batch (the value torch.kthvalue returns), the fraction taken to 6
    decimal places. Found by a sort, so n stays a tensor and the function stays traceable."""
    valid = mask.bool()
    # one +inf after the tokens: the sort has an element even in a batch of zero-width completions, where it selects
    # nothing (a k-th of n values, k <= n, is never the +inf appended after them)
    values = torch.cat([torch.where(valid, ref, torch.full_like(ref, float("inf"))).flatten(),
                        ref.new_full((1,), float("inf"))])
    count = valid.sum()
    # floor(n * fraction) in integers, the fraction in millionths as it was written: exact (0.53 of 100 tokens is 53;
    # in float32 it was 52.99999, so 52). Plain arithmetic on a Python number, which every torch.compile folds
    # (torch 2.4's cannot trace fractions.Fraction).
    k = torch.clamp(count * round(fraction * 10**6) // 10**6, min=1)
    threshold = torch.sort(values).values.gather(0, (k - 1).reshape(1))
    return valid & (ref <= threshold)


@register_kl_estimator("k3_bottom_percentile")
def k3_bottom_percentile(logp: torch.Tensor, ref: torch.Tensor, mask: torch.Tensor, config: Any) -> torch.Tensor:
    """k3 only on the tokens in the bottom `kl_percentile` fraction of reference log-probs, times
    `kl_percentile_scale` (the reference is least confident there); 0 elsewhere."""
    selected = bottom_percentile_mask(ref.detach(), mask, config.kl_percentile)
    # an unselected token is scored at log-ratio 0, where k3 is exactly 0 and `where` passes no gradient on (a mask
    # multiplied in after k3 gave NaN where that token's own k3 overflowed: inf * 0)
    return k3(torch.where(selected, logp, ref.detach()), ref, mask) * config.kl_percentile_scale


def run_estimator(logp: torch.Tensor, ref: torch.Tensor, mask: torch.Tensor, config: Any) -> torch.Tensor:
    """The estimator in effect on inputs already masked (`numerics.keep_valid`: float32, masked positions 0)."""
    estimator = config.estimator
    if callable(estimator):
        return estimator(logp, ref, mask)
    if takes_config(estimator):
        return _ESTIMATORS[estimator](logp, ref, mask, config)
    return _ESTIMATORS[estimator](logp, ref, mask)


def estimator_label(estimator: Any) -> str:
    """An estimator as a message or a log writes it: a name as itself, a function by its qualified name, not its
    address; a callable without one (a functools.partial, a callable object) as its repr."""
    if isinstance(estimator, str):
        return estimator
    return getattr(estimator, "__qualname__", None) or repr(estimator)


def check_per_token(config: Any) -> None:
    """Refuse, when a run is built, an estimator (a registered one, a callable) that does not return a tensor of the
    tokens' shape on a (2, 3) batch: a (B, 1) sequence KL would broadcast onto every token, silently. Checked once on
    a probe, not per batch: the pipeline runs traced (torch.fx, torch.compile), where shapes are not numbers."""
    logp, ref, mask = torch.full((2, 3), -1.0), torch.full((2, 3), -1.5), torch.ones(2, 3, dtype=torch.bool)
    try:
        kl = run_estimator(logp, ref, mask, config)
    except Exception as error:
        given = " and the AdaptiveKLConfig as its 4th argument" if takes_config(config.estimator) else ""
        raise ValueError(f"kl_estimator={estimator_label(config.estimator)!r} raised {type(error).__name__}: {error} "
                         f"on a (2, 3) batch of log-probs and a mask{given}, when the run was built") from error
    if not isinstance(kl, torch.Tensor) or kl.shape != logp.shape:
        found = f"shape {tuple(kl.shape)}" if isinstance(kl, torch.Tensor) else type(kl).__name__
        raise ValueError(f"kl_estimator={estimator_label(config.estimator)!r} returned {found} for a (2, 3) batch; "
                         "allowed is the per-token KL, a tensor of the log-probs' shape (batch, completion tokens).")


def estimate_kl(logp: torch.Tensor, ref: torch.Tensor, mask: torch.Tensor, config: Any) -> torch.Tensor:
    """The estimator in effect (`config.estimator`: `kl_estimator`, or the placement's default for None), a registered
    name or a callable (logp, ref, mask) -> per-token KL.

    The estimator is given float32 whatever the input's dtype (bf16/fp16 upcast, float64 rounded; float32 is not
    copied). Masked positions (mask == 0) of logp and ref are replaced by 0 before the estimator sees them, and its
    output is 0 there, so whatever they hold (NaN, +-inf, padding garbage) and whatever a callable makes of 0 (exp(0)
    is 1), the KL there is 0 with a zero gradient, as in `AdaptiveKL`'s pipeline. The estimator is given the mask as
    bool. Traceable (torch.fx, `torch.compile(fullgraph=True)`), so it checks nothing on the host: a (B, 1) mask or
    reference broadcasts, and a mask entry of 0.5 is a valid position. `AdaptiveKL.kl_loss` and `reward_penalty`
    check a batch's shapes and mask."""
    valid = valid_positions(mask)
    logp, ref = masked_logps(logp, ref, valid)
    return keep_valid(run_estimator(logp, ref, valid, config), valid)


# The estimators this package defines (registered above); a name registered later is a user's, which may read any
# config field (`config.unread_fields`).
BUILT_IN_ESTIMATORS = estimator_names()
