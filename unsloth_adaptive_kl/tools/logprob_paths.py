"""Which of Unsloth's per-token log-prob scorers ran: a probe for the GPU check, the KL lab and the cost benchmark.

Unsloth's GRPO trainer (unsloth_zoo 2026.10.9) scores the policy's tokens with a fused linear + log-softmax op on the
hidden states by default (`UNSLOTH_FUSED_LINEAR`, on unless set to 0; `torch.ops.unsloth_zoo.fused_linear_logprobs_*`,
a Triton kernel on CUDA, a torch loop elsewhere), falls back to a per-chunk log-softmax over the hidden states
(`chunked_hidden_states_selective_log_softmax`), and scores the old and reference policies' logits with
`chunked_selective_log_softmax`. Both functions are looked up on `unsloth_zoo.rl_replacements` at each call, so a
counting wrapper sees them; the fused op keeps its own counters (`unsloth_zoo.fused_losses.fused_linear.CALLS`).
unsloth_zoo 2026.10.7 has no fused op (no `fused_losses.fused_linear`): there the counts hold the two scorers only,
and `describe` says the op is absent.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from typing import Any, Iterator

from ..integrations.patching import PatchSet

FUSED_MODULE = "unsloth_zoo.fused_losses.fused_linear"
# the fused op's counters (FUSED_MODULE's CALLS) read here
FUSED = ("logprobs", "logprobs_bwd", "triton", "torch", "tiled", "flash")
WRAPPED = ("chunked_hidden_states_selective_log_softmax", "chunked_selective_log_softmax")


@contextlib.contextmanager
def counted_logprob_calls() -> Iterator[dict[str, int]]:
    """Counts, over the block, of the fused op's calls by kind (`FUSED`) and of each scorer of `WRAPPED`; the dict
    yielded is filled when the block ends. Changes no result: the wrappers call the scorers they replace."""
    from unsloth_zoo import rl_replacements

    fused_linear: Any = None  # stays None where this unsloth_zoo has no fused op (before 2026.10.9)
    try:
        fused_linear = importlib.import_module(FUSED_MODULE)
    except ModuleNotFoundError as error:
        if error.name != FUSED_MODULE:  # a module the fused op needs is missing: not the op's absence
            raise
    counts: dict[str, int] = {}
    before = {key: fused_linear.CALLS.get(key, 0) for key in FUSED} if fused_linear else {}

    def counting(name: str) -> Any:
        upstream = getattr(rl_replacements, name)

        @functools.wraps(upstream)  # keeps the signature: Unsloth inspects its parameters
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            counts[name] = counts.get(name, 0) + 1
            return upstream(*args, **kwargs)

        return wrapper

    with PatchSet() as patches:
        for name in WRAPPED:
            counts[name] = 0
            # replaces unsloth_zoo.rl_replacements.<name>, the scorer the generated trainer imports at each call
            patches.replace(rl_replacements, name, counting(name))
        yield counts
    if fused_linear:
        counts.update({key: fused_linear.CALLS.get(key, 0) - before[key] for key in FUSED})


def describe(counts: dict[str, int]) -> str:
    """The scorers that ran, in words, from `counted_logprob_calls`' counts."""
    parts = []
    if counts.get("logprobs"):
        kernels = ", ".join(f"{key} {counts[key]}" for key in ("triton", "torch", "tiled", "flash") if counts.get(key))
        parts.append(f"fused linear log-probs on the hidden states ({counts['logprobs']} forward, "
                     f"{counts['logprobs_bwd']} backward calls; kernel bodies: {kernels or 'none counted'})")
    if counts.get("chunked_hidden_states_selective_log_softmax"):
        parts.append(f"per-chunk log-softmax on the hidden states "
                     f"({counts['chunked_hidden_states_selective_log_softmax']} calls)")
    if counts.get("chunked_selective_log_softmax"):
        parts.append(f"chunked selective log-softmax on logits ({counts['chunked_selective_log_softmax']} calls)")
    if "logprobs" not in counts:
        parts.append("this unsloth_zoo has no fused linear log-prob op")
    return "; ".join(parts) or "none of Unsloth's scorers ran"
