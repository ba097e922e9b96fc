"""Per-token KL shaping k -> k' (clip, sigmoid, registered ones) and the clip diagnostic (pure torch, a leaf: it
imports only the method registry and `in_float32`). Every shaping maps 0 to 0, so masked positions (0) stay 0.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from .numerics import in_float32
from .registry import SHAPINGS as _SHAPINGS
from .registry import new_method_name

Shaping = Callable[[torch.Tensor, Any], torch.Tensor]


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
def clip_kl(kl: torch.Tensor, config: Any) -> torch.Tensor:
    """k' = min(k, kl_clip_threshold). Above the threshold the KL gradient is zero."""
    return torch.clamp(kl, max=config.kl_clip_threshold)


@register_kl_shaping("sigmoid")
def sigmoid_kl(kl: torch.Tensor, config: Any) -> torch.Tensor:
    """k' = sigmoid(k - kl_target) * k. The sigmoid runs in place on the difference (a temporary whose backward needs
    nothing of it): one full-size allocation fewer."""
    return torch.sub(kl, config.kl_target).sigmoid_() * kl


def shapes_per_token(config: Any) -> bool:
    """Whether a configured method shapes the per-token KL (clip, sigmoid, a registered shaping)."""
    return any(method in _SHAPINGS for method in config.kl_methods)


def shape_kl(kl: torch.Tensor, config: Any) -> torch.Tensor:
    """Per-token shaping k -> k' by the configured clip/sigmoid method (identity without one), in float32 whatever
    the dtype of `kl` (a bf16 clip would round its threshold: min(k, 0.3) would read 0.30078125)."""
    kl = in_float32(kl)
    for method in config.kl_methods:
        if method in _SHAPINGS:
            kl = _SHAPINGS[method](kl, config)
    return kl


def check_zero_kept(config: Any) -> None:
    """Refuse a configured shaping that does not map a KL of 0 to 0 (elementwise, keeping the shape): the masked
    positions hold 0 after the estimator, so a shaping that lifted them would make the padding count, and the loss
    would change with how a batch is padded."""
    zero = torch.zeros(2, 3)
    for method in config.kl_methods:
        if method in _SHAPINGS:
            shaped = _SHAPINGS[method](zero, config)
            if not isinstance(shaped, torch.Tensor) or shaped.shape != zero.shape or bool(shaped.ne(0).any()):
                found = (f"{shaped.flatten()[:3].tolist()}..." if isinstance(shaped, torch.Tensor)
                         else type(shaped).__name__)
                raise ValueError(f"kl_adaptation_method={config.kl_adaptation_method!r}: the shaping {method!r} maps a "
                                 f"(2, 3) KL of zeros to {found}; allowed is a shaping that maps 0 to 0 elementwise "
                                 "(padded positions hold 0 and must stay 0).")


def clipped_tokens(valid_kl: torch.Tensor, config: Any, lengths: torch.Tensor) -> torch.Tensor:
    """`clip`: how many valid tokens have k >= kl_clip_threshold (padded positions are 0 < kl_clip_threshold), in the
    dtype of `lengths`; 0 otherwise. The comparison writes its 0/1 straight into a tensor of that dtype: a bool
    result summed as floats costs 4x as much on a CPU (0.29 against 0.07 ms at 64 x 4096, measured). That tensor is
    made by a method of `lengths`: torch.fx (a traced custom loss) records a method call whatever its arguments, where
    torch 2.6 refuses `torch.empty_like(valid_kl, dtype=lengths.dtype)` with a traced dtype (TypeError)."""
    if "clip" not in config.kl_methods:
        return lengths.new_zeros(())
    indicator = lengths.new_empty(valid_kl.shape)
    return torch.ge(valid_kl, config.kl_clip_threshold, out=indicator).sum()
