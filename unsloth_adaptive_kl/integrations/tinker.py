"""Adaptive KL for GRPO on Tinker (the `tinker` SDK): thin translators between Tinker's data (`tinker.Datum`, the
per-datum log-probs `TrainingClient.forward_backward_custom` hands a loss function, the `ForwardBackwardOutput` it
returns) and the core's `AdaptiveKL`. No KL formula lives here: the estimator, shaping, reductions, beta and metrics
are the core's. Three routes, one per way Tinker trains:

1. `grpo_kl_loss(akl)`: a `loss_fn` for `forward_backward_custom` (KL in the loss). The SDK runs it client-side on
   its own thread ("tinker-custom-loss") on the log-probs of a forward pass, differentiates it, and sends
   weights = -dL/dlogprobs back as a second, `cross_entropy` forward_backward; its metrics come back in the result.
   beta_t is read once, on your thread, when the loss is built.
2. `kl_penalized_data(akl, data, rewards, group_size)`: the KL in the reward for Tinker's built-in
   `importance_sampling` loss (one forward_backward, no custom pass): r_i - beta_t * KL_i before the group advantages.
3. `traceable_grpo_loss(akl)` + `traced_loss_data(akl, data)` + `check_traced_loss(akl, result)`: the route-1 loss
   as a per-datum function that `ServiceClient.create_custom_loss` traces with torch.fx (beta and the reduction
   weights are inputs, so one traced loss serves every step).

Datum layout (the Tinker cookbook's, plus the reference): one `tinker.Datum` per completion, its `model_input` the
prompt and completion tokens but the last, and `loss_fn_inputs` aligned one-to-one with `target_tokens` (shape (T,)):
`target_tokens` (int64), `logprobs` (float32: the sampler's log-probs of the targets, 0 on prompt positions),
`advantages` (float32), `ref_logprobs` (float32: the reference model's log-probs of the targets) and `mask` (float32:
1 on completion tokens, 0 on prompt tokens). `completion_datum` builds it. Every input is a `TensorData` (a plain
Python list is only accepted by the SDK for the keys it knows, and `ref_logprobs`/`mask` are not among them).
"""

from __future__ import annotations

import copy
import math
import numbers
import warnings
from typing import Any, Callable, Optional, Sequence, Union

import torch

try:
    from tinker import types
except ImportError as error:  # pragma: no cover - exercised only without the extra
    raise ImportError("unsloth_adaptive_kl.integrations.tinker needs the Tinker SDK: pip install tinker") from error

from ..core import AdaptiveKL, AdaptiveKLConfig, ReductionContext, reduce_kl
from ..core.adaptive_kl import check_mask, divisors
from ..core.adaptation import kl_term, token_kl
from ..core.numerics import (KINDS, LogpCheck, NonFinite, found_in_check, keep_valid, nonfinite_error, positive_logps,
                             positive_logps_error, valid_positions)
from ..core.config import check_real, is_real, is_whole, python_number
from ..core.errors import reject
from ..core.reductions import (check_completions_fit, check_divisors_given, kl_reduction, loss_type_reduction,
                               warn_unread_context)
from ..core.statistics import KL_OVERFLOW, device_sums, gather_statistics

__all__ = [
    "BUILTIN_LOSS_INPUTS",
    "GRPOKLLoss",
    "builtin_loss_data",
    "check_traced_loss",
    "completion_datum",
    "grpo_kl_loss",
    "kl_penalized_data",
    "record_step_kl",
    "traceable_grpo_loss",
    "traced_loss_data",
]

TARGET_TOKENS, SAMPLING_LOGPROBS, ADVANTAGES, REF_LOGPROBS, MASK = (
    "target_tokens", "logprobs", "advantages", "ref_logprobs", "mask")
# What Tinker's built-in policy losses (importance_sampling, ppo, cispo) read; the cookbook strips the rest ("mask")
# before every forward_backward, and so does `builtin_loss_data`.
BUILTIN_LOSS_INPUTS: tuple[str, ...] = (TARGET_TOKENS, SAMPLING_LOGPROBS, ADVANTAGES)
COMPLETION_DATUM_INPUTS = (TARGET_TOKENS, SAMPLING_LOGPROBS, REF_LOGPROBS, MASK)  # what `completion_datum` builds
Number = Union[float, torch.Tensor]


# ----- Datums ---------------------------------------------------------------------------------------------------------

def _tensor_data(values: torch.Tensor, dtype: torch.dtype = torch.float32) -> "types.TensorData":
    return types.TensorData.from_torch(values.detach().to("cpu", dtype).contiguous())


def _token_ids(tokens: Sequence[int], name: str) -> list[int]:
    """`tokens` as Python ints: int() would read a float (1.9) or a bool as another token id, silently."""
    ids = []
    for index, token in enumerate(tokens):
        value = token.item() if isinstance(token, torch.Tensor) and token.numel() == 1 else token
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
            raise reject(f"{name}[{index}]", token, "a token id: an integer >= 0 (a float or a bool would be read as "
                         "another token)")
        ids.append(int(value))
    return ids


def completion_datum(
    prompt_tokens: Sequence[int],
    completion_tokens: Sequence[int],
    sampling_logprobs: Union[Sequence[float], torch.Tensor],
    ref_logprobs: Union[Sequence[float], torch.Tensor],
) -> "types.Datum":
    """One completion as a `tinker.Datum`, every input aligned with `target_tokens`.

    With tokens x = prompt + completion (P + C tokens): model_input = x[:-1], target_tokens = x[1:] (T = P + C - 1);
    the last C positions are the completion: logprobs / ref_logprobs there are `sampling_logprobs` / `ref_logprobs`
    (C values each: the sampler's and the reference model's log-probs of the completion tokens), 0 before;
    mask = 0 on the first P - 1 positions, 1 on the last C. Each token an integer >= 0 (a Python or numpy int, or
    an integer tensor's element): a float or a bool is a ValueError naming it."""
    prompt, completion = _token_ids(prompt_tokens, "prompt_tokens"), _token_ids(completion_tokens, "completion_tokens")
    if not prompt or not completion:
        raise ValueError("completion_datum needs at least one prompt token and one completion token")
    sampled, ref = _logprobs(sampling_logprobs, "sampling_logprobs"), _logprobs(ref_logprobs, "ref_logprobs")
    if sampled.numel() != len(completion) or ref.numel() != len(completion):
        raise ValueError(f"completion_datum: {len(completion)} completion tokens but {sampled.numel()} sampling and "
                         f"{ref.numel()} reference log-probs")
    tokens = prompt + completion
    pad = torch.zeros(len(prompt) - 1)
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            TARGET_TOKENS: _tensor_data(torch.tensor(tokens[1:]), torch.int64),
            SAMPLING_LOGPROBS: _tensor_data(torch.cat([pad, sampled])),
            REF_LOGPROBS: _tensor_data(torch.cat([pad, ref])),
            MASK: _tensor_data(torch.cat([pad, torch.ones(len(completion))])),
        },
    )


def _logprobs(values: Any, name: str) -> torch.Tensor:
    """`values` (numbers, or a tensor) as a flat float32 tensor; anything else a ValueError naming `name`."""
    try:
        return torch.as_tensor(values, dtype=torch.float32).flatten()
    except (TypeError, ValueError, RuntimeError) as error:  # text, None, ragged lists
        raise ValueError(f"completion_datum: {name}={values!r} is invalid: allowed is a sequence of numbers or a "
                         f"tensor, one log-prob per completion token ({error})") from error


def _input(datum: "types.Datum", key: str) -> torch.Tensor:
    """loss_fn_inputs[key] as a float32 (T,) tensor, checked to align with target_tokens."""
    inputs = datum.loss_fn_inputs
    if key not in inputs:
        raise KeyError(missing_input(key, inputs))
    for name in (key, TARGET_TOKENS):  # set after the Datum was built, which converts at construction
        if name in inputs and not isinstance(inputs[name], types.TensorData):
            raise TypeError(f"loss_fn_inputs[{name!r}] is a {type(inputs[name]).__name__}: allowed is a tinker "
                            "types.TensorData aligned with target_tokens (types.TensorData.from_torch(tensor))")
    value = inputs[key].to_torch().to(torch.float32)
    targets = inputs[TARGET_TOKENS].shape or [len(inputs[TARGET_TOKENS].data)]
    if list(value.shape) != list(targets) or value.dim() != 1:
        raise ValueError(f"loss_fn_inputs[{key!r}] has shape {list(value.shape)}, target_tokens {list(targets)}: "
                         "each input holds one value per target token")
    return value


def _stack(rows: Sequence[torch.Tensor]) -> torch.Tensor:
    """(T_i,) tensors -> (B, max T_i), zero-padded (differentiable; padded positions have mask 0)."""
    return torch.nn.utils.rnn.pad_sequence([row.to(torch.float32) for row in rows], batch_first=True)


def _policy_rows(rows: Sequence[torch.Tensor], data: Sequence["types.Datum"], name: str, source: str) -> torch.Tensor:
    """The policy's log-prob rows, one 1-D tensor per Datum, as (B, max T_i) (`_stack`). A row that is not its
    Datum's length (the target tokens') is a ValueError naming `name` (with `{i}` for the row) and `source`, what
    the rows must be: rows swapped, or another batch's, padded to one width, would pass silently, a valid token
    reading a log-prob of 0 or another completion's."""
    for i, (row, datum) in enumerate(zip(rows, data)):
        tokens = _input(datum, MASK).numel()
        if not isinstance(row, torch.Tensor) or row.shape != (tokens,):
            given = (f"type {type(row).__name__}" if not isinstance(row, torch.Tensor) else
                     f"{row.numel()} values" if row.dim() == 1 else f"shape {tuple(row.shape)}")
            raise ValueError(f"{name.format(i=i)} has {given}, Datum {i} {tokens} target tokens: {source}")
    return _stack(rows)


def _batch(data: Sequence["types.Datum"], key: str) -> torch.Tensor:
    """loss_fn_inputs[key] of every Datum, (B, max T_i); a ValueError for no Datum (a loop that drops groups of
    equal rewards may drop them all)."""
    if not data:
        raise reject("data", [], "one Datum or more (one per completion)")
    return _stack([_input(datum, key) for datum in data])


def _ppo_clip_surrogate(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                        mask: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """GRPO's per-token PPO-clip surrogate: -min(ratio A, clip(ratio, low, high) A), ratio = exp(logprobs - old), of
    the valid (mask != 0) positions: the three inputs are set to 0 elsewhere first (the core's `keep_valid`), so a
    prompt or padding position may hold anything (NaN, -inf) and still give 0 with a zero gradient, as the KL's do.
    Plain torch, so torch.fx traces it inside `traceable_grpo_loss` as it runs eagerly in `GRPOKLLoss`."""
    valid = valid_positions(mask)
    logprobs, old_logprobs, advantages = (keep_valid(x, valid) for x in (logprobs, old_logprobs, advantages))
    ratio = torch.exp(logprobs - old_logprobs)
    return -torch.minimum(ratio * advantages, torch.clamp(ratio, low, high) * advantages)


def missing_input(key: str, inputs: Any, where: str = "Datum") -> str:
    """What a Datum lacking loss_fn_inputs[key] is told: `completion_datum` builds the inputs of
    `COMPLETION_DATUM_INPUTS`; `advantages` the loop sets from its own advantages (or `kl_penalized_data` sets, with
    the KL in the reward); another key (a built-in loss's own) is the caller's to add."""
    if key == ADVANTAGES:
        fix = ("set it from your advantages, A_i on each completion token, as a TensorData aligned with target_tokens "
               "(or build the data with kl_penalized_data, which sets it)")
    elif key in COMPLETION_DATUM_INPUTS:
        fix = "build it with completion_datum (or add it as a TensorData aligned with target_tokens)"
    else:
        fix = "add it as a TensorData aligned with target_tokens"
    return f"{where} has no loss_fn_inputs[{key!r}] (it has {', '.join(sorted(inputs))}); {fix}"


def loss_terms(config: AdaptiveKLConfig, loss_type: str) -> dict[str, str]:
    """{term: its reduction's name} of the two terms a custom or traced loss reduces."""
    return {"the policy-gradient loss": loss_type_reduction(loss_type), "the KL term": kl_reduction(config, loss_type)}


def builtin_loss_data(data: Sequence["types.Datum"], keys: Sequence[str] = BUILTIN_LOSS_INPUTS) -> list["types.Datum"]:
    """The Datums with only `keys` in loss_fn_inputs (default: what importance_sampling / ppo / cispo read; pass more
    for a built-in loss that reads other inputs), for `TrainingClient.forward_backward(..., "importance_sampling")`:
    the built-in losses get no `ref_logprobs`/`mask`."""
    for index, datum in enumerate(data):
        missing = [key for key in keys if key not in datum.loss_fn_inputs]
        if missing:
            raise KeyError(missing_input(missing[0], datum.loss_fn_inputs, f"data[{index}]"))
    return [types.Datum(model_input=d.model_input, loss_fn_inputs={k: d.loss_fn_inputs[k] for k in keys})
            for d in data]


# ----- the checks every route shares ------------------------------------------------------------------------------

# What the errors call the Datums' log-probs.
DATUM_LOGPS = {"policy": "loss_fn_inputs['logprobs'] (the sampler's)", "reference": "loss_fn_inputs['ref_logprobs']"}


def clip_bounds(clip_epsilon: float, clip_epsilon_high: Optional[float]) -> tuple[float, float]:
    """(1 - clip_epsilon, 1 + clip_epsilon_high): the PPO-clip ratio bounds of routes 1 and 3. A ValueError naming
    the field outside 0 <= clip_epsilon < 1, 0 <= clip_epsilon_high < inf (None: clip_epsilon)."""
    check_real("clip_epsilon", clip_epsilon, is_real(clip_epsilon) and 0 <= clip_epsilon < 1,
               "a number with 0 <= x < 1")
    if clip_epsilon_high is not None:
        check_real("clip_epsilon_high", clip_epsilon_high,
                   is_real(clip_epsilon_high) and 0 <= clip_epsilon_high < math.inf,
                   "a finite number >= 0, or None for clip_epsilon")
    return 1.0 - clip_epsilon, 1.0 + (clip_epsilon if clip_epsilon_high is None else clip_epsilon_high)


# The loss types whose policy-gradient term is the token-level PPO-clip surrogate routes 1 and 3 compute: cispo, sapo
# and vespo replace that term by their own, and luspo takes its ratio per sequence (TRL requires
# importance_sampling_level="sequence" for it), which these losses do not reproduce.
PPO_CLIP_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")


def check_loss_placement(akl: AdaptiveKL, door: str) -> None:
    """A ValueError where the settings put beta * KL into the rewards, at a door of the KL in the loss."""
    if akl.config.kl_in_reward:
        raise ValueError(f"kl_placement='reward' puts beta * KL into the rewards: use kl_penalized_data(...) with the "
                         f"built-in importance_sampling loss instead of {door}(...)")


def check_loss_route(akl: AdaptiveKL, door: str) -> None:
    """Routes 1 and 3 put beta * KL into the loss beside a PPO-clip surrogate: a ValueError where the settings put it
    into the rewards, or where `akl.loss_type` names another policy-gradient term."""
    check_loss_placement(akl, door)
    if akl.loss_type not in PPO_CLIP_LOSS_TYPES:
        raise ValueError(f"loss_type={akl.loss_type!r} is invalid for {door}(...): its policy-gradient term is the "
                         "token-level PPO-clip surrogate, which that loss type replaces by its own; allowed is one of "
                         f"{', '.join(PPO_CLIP_LOSS_TYPES)} (the loss types whose term it is).")


def check_datum_inputs(sampled: torch.Tensor, ref: torch.Tensor, mask: torch.Tensor, step: int) -> None:
    """Every route's check of the Datums' `mask` (0 and 1 only: a ValueError) and of their `logprobs` (the sampler's)
    and `ref_logprobs` (finite on valid tokens: `NonFiniteLogProbError`; averaging at most 0 over them, as log-probs
    do: a ValueError, `positive_logps`), each named as the Datum's field (the core's own-loop doors call them `mask`
    and the policy's)."""
    check_mask(mask, f"loss_fn_inputs[{MASK!r}]")
    check = LogpCheck.of(sampled, ref, mask, names=DATUM_LOGPS)
    found = found_in_check(check)
    if found:
        raise nonfinite_error(step, found)
    tokens = float(valid_positions(mask).sum())
    positive = positive_logps(check.sums.tolist(), tokens, check.names)
    if positive:
        raise positive_logps_error(step, positive, tokens)


def check_datum_batch(sampled: torch.Tensor, ref: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                      step: int) -> None:
    """The rules of the core's own-loop doors, for routes 1 and 3 before a loss is computed from the Datums (route 2
    computes the advantages from rewards it checks): `check_datum_inputs` (the sampler log-probs are the PPO ratio's
    denominator), and a ValueError where an advantage on a valid (mask=1) token is NaN or +-inf (the loss and every
    gradient would be NaN)."""
    check_datum_inputs(sampled, ref, mask, step)
    bad = (mask != 0) & ~torch.isfinite(advantages)
    if bool(bad.any()):
        raise ValueError(f"loss_fn_inputs[{ADVANTAGES!r}] holds NaN or +-inf on {int(bad.sum())} valid (mask=1) "
                         f"token(s), in Datum(s) {bad.any(-1).nonzero().flatten().tolist()}: allowed is a finite "
                         "advantage on every completion token (a NaN one makes the loss and every gradient NaN).")


# ----- 1. the KL in the loss: a loss_fn for forward_backward_custom ---------------------------------------------------

class GRPOKLLoss:
    """`loss_fn(data, logprobs) -> (loss, metrics)` for `TrainingClient.forward_backward_custom`:

        loss = PG + beta_t * K

    with logprobs the per-datum (T_i,) log-probs of the forward pass, stacked to (B, T) with the Datums' `logprobs`
    (old, the sampler's) o, `advantages` A, `ref_logprobs` and `mask` m:

        ratio = exp(logprobs - o);  PG = reduce_loss_type(-min(ratio A, clip(ratio, 1 - eps_low, 1 + eps_high) A), m)
        beta_t * K = beta_t * kl_term(logprobs, ref_logprobs, m).adapted   (AdaptiveKL.kl_loss's term, unrecorded)

    reduce_loss_type is the core's reduction of `akl.loss_type` (grpo: mean_i sum_t m x / L_i), and K the core's
    adapted KL (estimator, clip/sigmoid shaping, reduction). beta_t is `akl.current_beta` read once, here, on the
    caller's thread, when the loss is built: the SDK calls the loss later on its own thread, possibly after
    `akl.step()` moved beta on (a pipelined loop). Build one loss per optimizer step.

    metrics (floats, merged by the SDK into the result's metrics): the core's `adaptive_kl/*` of this batch (their
    `adaptive_kl/current_beta` is the captured beta), `grpo/pg_loss` (PG) and `grpo/kl_term` (beta_t * K).

    The SDK thread computes K and its metrics from the captured beta and config (`kl_term`, the core's pipeline) and
    writes nothing of `akl`; it reads two of its numbers, its step count and beta, to warn where this one loss is
    called again two `akl.step()` after it was built (built once, above the loop, it would train every step at the
    first beta).
    A `target` controller reads the step's KL: call `record_step_kl(akl, data, result)` on your thread before
    `akl.step()`."""

    def __init__(
        self,
        akl: AdaptiveKL,
        *,
        clip_epsilon: float = 0.2,
        clip_epsilon_high: Optional[float] = None,
        max_completion_length: Optional[int] = None,
        token_normalizer: Optional[Number] = None,
    ) -> None:
        akl.check_settings()
        check_loss_route(akl, "grpo_kl_loss")
        self.clip_low, self.clip_high = clip_bounds(clip_epsilon, clip_epsilon_high)
        self.beta = akl.current_beta
        self.config = copy.copy(akl.config)  # the settings checked now: a later change to akl's is refused at akl.step
        self.loss_type = akl.loss_type
        self.training_step = akl.completed_steps + 1  # the step this loss trains, as the non-finite message names it
        self.context = divisors(max_completion_length, token_normalizer)
        warn_unread_context(self.context, self.config, self.loss_type)
        # A reduction missing its divisor would raise only when the SDK calls the loss, on its thread: ask both of
        # this step's reductions (the policy gradient's and the KL's) now.
        check_divisors_given(self.context, loss_terms(self.config, self.loss_type).values(), "grpo_kl_loss")
        self._akl = akl  # read on the SDK's thread: its step count and beta (a loss called again at a later step)
        self._called_before = False  # a loss called once is its step's, however late
        self._stale_warned = False

    def __call__(
        self, data: list["types.Datum"], logprobs: list[torch.Tensor]
    ) -> tuple[torch.Tensor, dict[str, float]]:
        if len(data) != len(logprobs):
            raise ValueError(f"{len(data)} Datums but {len(logprobs)} log-prob tensors")
        self._warn_if_stale()
        old, advantages, mask = (_batch(data, key) for key in (SAMPLING_LOGPROBS, ADVANTAGES, MASK))
        logps = _policy_rows(logprobs, data, "logprobs[{i}]", "the SDK passes one log-prob per target token, a "
                             "tensor of shape (T_i,) per Datum, in their order")
        ref = _batch(data, REF_LOGPROBS)  # masked positions may hold anything: the core zeroes them
        check_datum_batch(old, ref, advantages, mask, self.training_step)
        check_completions_fit(self.context, mask, loss_terms(self.config, self.loss_type))
        surrogate = _ppo_clip_surrogate(logps, old, advantages, mask, self.clip_low, self.clip_high)
        pg = reduce_kl(surrogate, mask, loss_type_reduction(self.loss_type), self.context)
        term = kl_term(logps, ref, mask, self.config, loss_type=self.loss_type, context=self.context, with_grad=True)
        (sums,) = gather_statistics([device_sums(term)], [term.check], step=self.training_step)
        metrics = sums.metrics(beta=self.beta, config=self.config, step=self.training_step)
        kl_part = term.adapted * self.beta
        metrics["grpo/pg_loss"] = float(pg.detach())
        metrics["grpo/kl_term"] = float(kl_part.detach())
        return pg + kl_part, metrics

    def _warn_if_stale(self) -> None:
        """A loss built once, outside the loop, trains every step at the beta of the step it was built for, while
        `akl` moves on: said once, where the SDK calls the same loss again two `akl.step()` or more after the one it
        was built after, with beta moved. A pipelined loop's loss may be called after its own step's `akl.step()`
        (once, or for each of its forward_backward_custom calls, submitted before the loop stepped akl): its step's."""
        steps_since_built = self._akl.completed_steps - (self.training_step - 1)
        if not self._called_before:
            self._called_before = True
            return
        if steps_since_built >= 2 and self._akl.current_beta != self.beta and not self._stale_warned:
            self._stale_warned = True
            warnings.warn(f"grpo_kl_loss: this loss, built for step {self.training_step}, is called again after "
                          f"{steps_since_built} akl.step() since: it keeps step {self.training_step}'s beta "
                          f"({self.beta:g}; akl's is now {self._akl.current_beta:g}) and settings. Build one per "
                          "optimizer step, loss_fn = grpo_kl_loss(akl).", UserWarning, stacklevel=2)


def grpo_kl_loss(
    akl: AdaptiveKL,
    *,
    clip_epsilon: float = 0.2,
    clip_epsilon_high: Optional[float] = None,
    max_completion_length: Optional[int] = None,
    token_normalizer: Optional[Number] = None,
) -> GRPOKLLoss:
    """The `loss_fn` of one optimizer step for `TrainingClient.forward_backward_custom(data, loss_fn)`: the GRPO
    PPO-clip surrogate plus beta_t * the adapted KL, beta_t captured now (see `GRPOKLLoss`). Per step:

        loss_fn = grpo_kl_loss(akl)
        result = training_client.forward_backward_custom(data, loss_fn).result()
        training_client.optim_step(adam).result()
        record_step_kl(akl, data, result)          # only a `target` controller needs it
        akl.step(mean_reward=...)

    max_completion_length: dr_grpo's divisor; token_normalizer: dapo/cispo/vespo's active-token count."""
    return GRPOKLLoss(akl, clip_epsilon=clip_epsilon, clip_epsilon_high=clip_epsilon_high,
                      max_completion_length=max_completion_length, token_normalizer=token_normalizer)


def record_step_kl(
    akl: AdaptiveKL,
    data: Sequence["types.Datum"],
    result: "types.ForwardBackwardOutput",
    *,
    max_completion_length: Optional[int] = None,
    token_normalizer: Optional[Number] = None,
    train: bool = True,
) -> dict[str, float]:
    """On the caller's thread, after a custom forward_backward: hand the batch's KL to `akl` as `akl.kl_loss` would
    (without gradient), so the next `akl.step()` sees it (the `target` controller reads it; the others ignore it).
    The log-probs are the ones the result carries (`loss_fn_outputs[i]["logprobs"]`, the policy the loss saw).
    Returns the core's `adaptive_kl/*` metrics of the batch. Call it once per forward_backward_custom; `train=False`
    for an evaluation batch, whose KL the next step does not read."""
    check_loss_placement(akl, "record_step_kl")  # any loss type: it measures the KL, whatever loss trained on it
    # the reductions akl.kl_loss reads below, each asked here: a divisor missing is named as this door's
    check_divisors_given(divisors(max_completion_length, token_normalizer), akl.loss_reductions().values(),
                         "record_step_kl")
    if len(result.loss_fn_outputs) != len(data):
        raise ValueError(f"{len(data)} Datums but the result has {len(result.loss_fn_outputs)} outputs")
    mask = _batch(data, MASK)
    rows = [output[SAMPLING_LOGPROBS].to_torch().flatten() for output in result.loss_fn_outputs]
    logps = _policy_rows(rows, data, "result.loss_fn_outputs[{i}]['logprobs']", "the result must be the "
                         "forward_backward of these Datums, in their order")
    with torch.no_grad():
        _, metrics = akl.kl_loss(logps, _batch(data, REF_LOGPROBS), mask, max_completion_length=max_completion_length,
                                 token_normalizer=token_normalizer, train=train)
    return metrics


# ----- 2. the KL in the reward: Datums for the built-in importance_sampling loss --------------------------------------

STD_EPSILON = 1e-4  # kl_penalized_data's default: added to a group's reward std with scale_by_std


def kl_penalized_data(
    akl: AdaptiveKL,
    data: Sequence["types.Datum"],
    rewards: Union[Sequence[float], torch.Tensor],
    group_size: int,
    *,
    scale_by_std: bool = False,
    std_epsilon: float = STD_EPSILON,
    train: bool = True,
) -> tuple[list["types.Datum"], dict[str, float]]:
    """The KL in the reward, for Tinker's built-in `importance_sampling` loss (one forward_backward, no custom pass):

        r'_i = r_i - P_i,  P_i = akl.reward_penalty(logprobs, ref_logprobs, mask)_i = beta_t * KL_i   (no gradient)
        A_i = r'_i - mean_{j in group(i)} r'_j   (/ (std_group r' + std_epsilon) with scale_by_std)

    A completion whose mask is all 0 has no KL: its P_i is its group's mean over the completions with tokens, as in
    TRL's and Unsloth's scoring (penalised 0, its reward would lower every other completion's advantage).

    `data`: one Datum per completion (see `completion_datum`), groups of `group_size` consecutive completions of the
    same prompt; `logprobs` are the sampler's (the policy the completions came from). `rewards`: (N,) un-penalised.
    KL_i is the core's (estimator, shaping, `kl_reduction`: sequence_sum by default); configure
    `AdaptiveKLConfig(kl_placement="reward")`. beta_t is read here, on the caller's thread.

    Returns the Datums with `advantages` = A_i on the completion tokens (mask), 0 elsewhere, as a float32 TensorData
    (the other inputs unchanged), and the metrics: the core's `adaptive_kl/*` (with `adaptive_kl/reward_penalty`,
    the mean P_i), `reward/mean` (un-penalised: pass it to `akl.step(mean_reward=...)`) and `reward/penalized_mean`.
    Send `builtin_loss_data(datums)` to `forward_backward(..., "importance_sampling")`. `train=False` for an
    evaluation batch: the next `akl.step()` reads the KL of the training batch scored before it, not this one's."""
    if not akl.config.kl_in_reward:
        raise ValueError("kl_placement='loss' puts beta * KL into the loss: kl_penalized_data(...) needs "
                         "AdaptiveKLConfig(kl_placement='reward'); for the KL in the loss, use grpo_kl_loss(...) or "
                         "traced_loss_data(...)")
    allowed = ("one finite number per Datum (score each completion, or leave an unscored completion's group out of "
               "the batch)")
    try:  # None (an unscored completion) or text failed in torch, naming neither the argument nor what it takes
        given = torch.as_tensor(rewards)
    except (TypeError, ValueError, RuntimeError):
        raise reject("rewards", rewards, allowed) from None
    # One value a Datum, in their order: a 2-D array was flattened, so a (group_size, prompts) one went to the wrong
    # completions; a bool is not a score (the loss door's mean_reward refuses it too).
    if given.dim() != 1 or given.dtype == torch.bool or given.is_complex():
        raise reject("rewards", rewards, f"{allowed}, as a 1-D sequence of numbers in the Datums' order (flatten a "
                     f"(prompts, group_size) array), not a {given.dim()}-D {str(given.dtype).replace('torch.', '')} "
                     "one")
    rewards = given.to(torch.float32)
    if len(data) != rewards.numel():
        raise ValueError(f"{len(data)} Datums but {rewards.numel()} rewards")
    # A group of one has the advantage 0 whatever its reward (and NaN with scale_by_std: a sample std of one value).
    if not is_whole(group_size, 2) or len(data) % group_size:
        raise reject("group_size", group_size, python_number(group_size, f"an integer >= 2 that divides the "
                     f"{len(data)} completions (a group's completions of one prompt)"))
    if not isinstance(scale_by_std, bool):  # "False" (a config's text) is truthy: it would scale, silently
        raise reject("scale_by_std", scale_by_std, "True (each group's advantages divided by its rewards' std + "
                     "std_epsilon) or False")
    check_real("std_epsilon", std_epsilon, is_real(std_epsilon) and 0 < std_epsilon < math.inf, "a finite number > 0 "
               "(a group of equal rewards has a std of 0)")
    if not scale_by_std and std_epsilon != STD_EPSILON:
        warnings.warn(f"std_epsilon={std_epsilon!r} has no effect: it is read only with scale_by_std=True.",
                      UserWarning, stacklevel=2)
    unscored = (~torch.isfinite(rewards)).nonzero().flatten().tolist()
    if unscored:  # one NaN would make every advantage of its group NaN, prompt positions included (NaN * 0)
        raise ValueError(f"rewards hold NaN or +-inf at completion(s) {unscored}: every reward must be a finite number "
                         "(score each completion, or leave an unscored completion's group out of the batch)")
    logps, ref, mask = (_batch(data, key) for key in (SAMPLING_LOGPROBS, REF_LOGPROBS, MASK))
    check_datum_inputs(logps, ref, mask, akl.completed_steps + 1)  # as routes 1 and 3 name them
    # A completion without valid tokens (masked out) has no KL: its group's mean penalty (group_size), as TRL's and
    # Unsloth's scoring gives it, so that its reward in the group's statistics moves no other completion's advantage.
    penalty, penalty_metrics = akl.reward_penalty(logps, ref, mask, train=train, group_size=group_size)
    penalized = (rewards - penalty).view(-1, group_size)
    advantages = penalized - penalized.mean(dim=1, keepdim=True)
    if scale_by_std:
        advantages = advantages / (penalized.std(dim=1, keepdim=True) + std_epsilon)
    out = []
    for datum, advantage in zip(data, advantages.flatten()):
        inputs = dict(datum.loss_fn_inputs)
        inputs[ADVANTAGES] = _tensor_data(advantage * _input(datum, MASK))
        out.append(types.Datum(model_input=datum.model_input, loss_fn_inputs=inputs))
    metrics = {**penalty_metrics, "reward/mean": float(rewards.mean()),
               "reward/penalized_mean": float(penalized.mean())}
    return out, metrics


# ----- 3. a per-datum loss for ServiceClient.create_custom_loss (traced with torch.fx) --------------------------------

PG_WEIGHTS, KL_WEIGHTS, BETA, OLD_LOGPROBS = "pg_weights", "kl_weights", "beta", "sampling_logprobs"
# The traced loss's non-finite check: each tensor's name in the error, and the metric carrying its sum over the
# valid tokens (summed over the datums by the SDK).
TRACED_CHECK = {"logprobs (in the traced loss)": "custom/adaptive_kl/policy_logprobs:sum",
                "ref_logprobs": "custom/adaptive_kl/ref_logprobs:sum"}
TRACED_KL = "custom/adaptive_kl/adapted_kl:sum"  # the traced loss's adapted KL, summed over the datums
# Estimators of batch statistics: per datum they would compute another KL.
_BATCH_ESTIMATORS = frozenset({"k3_bottom_percentile"})


def traceable_grpo_loss(
    akl: AdaptiveKL, *, clip_epsilon: float = 0.2, clip_epsilon_high: Optional[float] = None
) -> tuple[Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]], dict[str, int]]:
    """(fn, input_ranks) for `ServiceClient.create_custom_loss(fn, input_ranks)`: route 1's loss, per datum. The SDK
    runs fn once per datum and sums; with the per-token weights of `traced_loss_data` the sum is

        loss = sum_t w_pg,t * (-min(ratio_t A_t, clip(ratio_t, 1 - eps_low, 1 + eps_high) A_t))
               + beta * sum_t w_kl,t * shape(k_t m_t),   ratio_t = exp(logprobs_t - sampling_logprobs_t)

    k the core's estimator of the masked log-probs (0 where m = 0), shape the core's clip/sigmoid, and
    w_pg, w_kl the core's `loss_type` / KL reductions as per-token weights (each reduction is linear in the
    per-completion sums S_i, so sum_i sum_t w_t x_t is exactly the reduced batch value). It equals `grpo_kl_loss`.

    fn's inputs: logprobs, then the Datum keys sampling_logprobs, advantages, ref_logprobs, mask, pg_weights,
    kl_weights (rank 1) and beta (rank 0): beta is data, so the one traced loss (created once per session) serves
    every step. Its metrics (summed over datums): custom/grpo/pg_loss:sum, custom/adaptive_kl/adapted_kl:sum (K),
    custom/grpo/kl_term:sum (beta K), and the core's non-finite check: custom/adaptive_kl/policy_logprobs:sum and
    custom/adaptive_kl/ref_logprobs:sum, the sums of the valid log-probs, non-finite exactly when one is. A traced
    graph cannot raise on a value: `check_traced_loss` reads them on your thread.

    Supported: kl_placement='loss'; every shaping (none, clip, sigmoid), length_normalized, every kl_reduction, the
    loss types of `PPO_CLIP_LOSS_TYPES` (dr_grpo / dapo via `traced_loss_data`'s max_completion_length /
    token_normalizer),
    every controller (beta is an input; `target` needs `record_step_kl`); the per-token estimators k1, k2, k3,
    low_var_kl, k1+, k3+, k1_future (its KL-to-go runs over the datum, which is one completion) and registered
    callables torch.fx can trace. Not: k3_bottom_percentile (a batch statistic)."""
    akl.check_settings()
    check_loss_route(akl, "traceable_grpo_loss")
    config = copy.copy(akl.config)  # traced once: a later change to akl's settings is refused by traced_loss_data
    if isinstance(config.estimator, str) and config.estimator in _BATCH_ESTIMATORS:
        raise ValueError(f"kl_estimator={config.estimator!r} selects tokens by a batch-wide percentile, which a "
                         "per-datum loss cannot see: use grpo_kl_loss(...) (the whole batch) instead")
    low, high = clip_bounds(clip_epsilon, clip_epsilon_high)

    def adaptive_kl_grpo(logprobs, sampling_logprobs, advantages, ref_logprobs, mask, pg_weights, kl_weights, beta):
        pg = (pg_weights * _ppo_clip_surrogate(logprobs, sampling_logprobs, advantages, mask, low, high)).sum()
        stage = token_kl(logprobs, ref_logprobs, mask, config)  # the core's pipeline, up to the per-token k'
        adapted = (kl_weights * stage.shaped).sum()
        kl_part = beta * adapted
        policy_sum, reference_sum = TRACED_CHECK.values()
        return pg + kl_part, {"custom/grpo/pg_loss:sum": pg, TRACED_KL: adapted,
                              "custom/grpo/kl_term:sum": kl_part, policy_sum: stage.check.sums[0],
                              reference_sum: stage.check.sums[1]}

    ranks = {"logprobs": 1, OLD_LOGPROBS: 1, ADVANTAGES: 1, REF_LOGPROBS: 1, MASK: 1, PG_WEIGHTS: 1, KL_WEIGHTS: 1,
             BETA: 0}
    return adaptive_kl_grpo, ranks


def _reduction_weights(mask: torch.Tensor, reduction: str, context: ReductionContext, setting: str) -> torch.Tensor:
    """d reduce(x) / d x_t for the core's named reduction: m_t * w_i. Exact only for a reduction linear in the
    per-completion sums, as every built-in one is; a registered one (`register_kl_reduction`) may not be, so the
    weights are checked against the reduction itself on a probe batch of this mask, and a ValueError naming `setting`
    (the field and its value) refuses one they do not reproduce (the traced loss would silently compute another KL)."""
    x = torch.zeros_like(mask, requires_grad=True)
    with torch.enable_grad():
        (weights,) = torch.autograd.grad(reduce_kl(x, mask, reduction, context), x)
    probe = torch.rand(mask.shape, generator=torch.Generator().manual_seed(0)) * 2 - 1
    reduced, weighted = float(reduce_kl(probe, mask, reduction, context)), float((weights * probe).sum())
    if not (math.isfinite(reduced) and math.isclose(reduced, weighted, rel_tol=1e-4, abs_tol=1e-6)):
        raise ValueError(f"{setting} is invalid for the traced loss: its reduction is not linear in the "
                         f"per-completion sums (on a probe batch it gives {reduced!r}, its per-token weights "
                         f"{weighted!r}), and traceable_grpo_loss reduces by per-token weights. Allowed: a reduction "
                         "linear in the sums (every built-in one), or grpo_kl_loss(...), which reduces the whole batch.")
    return weights


def traced_loss_data(
    akl: AdaptiveKL,
    data: Sequence["types.Datum"],
    *,
    max_completion_length: Optional[int] = None,
    token_normalizer: Optional[Number] = None,
) -> list["types.Datum"]:
    """The Datums of one batch with the inputs `traceable_grpo_loss` reads added: sampling_logprobs (a copy of
    `logprobs`: the per-datum loss's own first parameter is named logprobs), pg_weights / kl_weights (the per-token
    weights of the core's `akl.loss_type` reduction and of its KL reduction over this batch: m_t / (B L_i) for grpo's
    sequence_mean) and beta (rank 0: `akl.current_beta`, read here, on the caller's thread, as every door trains at
    the controller's beta and logs it). A NaN or +-inf
    in the Datums' `logprobs` or `ref_logprobs` on a valid token raises `NonFiniteLogProbError` here, before anything
    is sent."""
    akl.check_settings()
    check_loss_route(akl, "traced_loss_data")
    mask = _batch(data, MASK)
    check_datum_batch(_batch(data, SAMPLING_LOGPROBS), _batch(data, REF_LOGPROBS), _batch(data, ADVANTAGES), mask,
                      akl.completed_steps + 1)
    context = divisors(max_completion_length, token_normalizer)
    warn_unread_context(context, akl.config, akl.loss_type)
    terms = loss_terms(akl.config, akl.loss_type)
    check_divisors_given(context, terms.values(), "traced_loss_data")
    check_completions_fit(context, mask, terms)
    reduction = kl_reduction(akl.config, akl.loss_type)
    pg_weights = _reduction_weights(mask, loss_type_reduction(akl.loss_type), context, f"loss_type={akl.loss_type!r}")
    kl_weights = _reduction_weights(mask, reduction, context, f"kl_reduction={reduction!r}")
    beta_value = torch.tensor(akl.current_beta, dtype=torch.float32)
    out = []
    for i, datum in enumerate(data):
        length = _input(datum, MASK).numel()
        inputs = dict(datum.loss_fn_inputs)
        inputs[OLD_LOGPROBS] = inputs[SAMPLING_LOGPROBS]
        inputs[PG_WEIGHTS] = _tensor_data(pg_weights[i, :length])
        inputs[KL_WEIGHTS] = _tensor_data(kl_weights[i, :length])
        inputs[BETA] = _tensor_data(beta_value)
        out.append(types.Datum(model_input=datum.model_input, loss_fn_inputs=inputs))
    return out


def check_traced_loss(akl: AdaptiveKL, result: "types.ForwardBackwardOutput") -> None:
    """On the caller's thread, after each `forward_backward_custom(traced_loss_data(akl, data), handle)` and before
    `optim_step`: `NonFiniteLogProbError` where the traced loss saw a NaN or +-inf log-prob on a valid (mask=1) token,
    its policy log-probs (from the service's forward) or its `ref_logprobs`. The graph cannot raise on a value, so
    it returns the core's check, the sums of the valid log-probs (`TRACED_CHECK`'s metrics, non-finite exactly when
    one of their terms is), and this reads them; and FloatingPointError where the adapted KL the loss summed is
    not finite (an estimator overflowed on finite log-probs). That forward_backward's gradients are accumulated
    already: do not step on them."""
    found = [NonFinite(name, kind) for (name, key), kind in zip(TRACED_CHECK.items(), KINDS)
             if not math.isfinite(result.metrics[key])]
    if found:
        raise nonfinite_error(akl.completed_steps + 1, found,
                              advice="the gradients of this forward_backward are accumulated: resume from the last "
                                     "checkpoint instead of calling optim_step")
    kl = result.metrics[TRACED_KL]
    if not math.isfinite(kl):  # finite log-probs, so the KL itself is not, as grpo_kl_loss raises on its thread
        raise FloatingPointError(
            f"adaptive KL: non-finite KL at step {akl.completed_steps + 1}: {TRACED_KL}={kl}. The policy and reference "
            f"log-probs are finite on valid tokens, so the KL itself is not: {KL_OVERFLOW}. The gradients of this "
            "forward_backward are accumulated: resume from the last checkpoint instead of calling optim_step.")
