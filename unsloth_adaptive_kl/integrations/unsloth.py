"""Integration with Unsloth's generated `UnslothGRPOTrainer` (unsloth / unsloth_zoo 2026.10.x).

Unsloth builds its GRPO trainer when `unsloth.models` is imported (by `import unsloth` on a GPU) by rewriting TRL's
source as text (`unsloth.models.rl._patch_trl_rl_trainers("grpo_trainer")`) and executing it as module
`UnslothGRPOTrainer`.
This package never imports unsloth. `patch()` (run when `unsloth_adaptive_kl` is imported) waits for
`unsloth.models.rl` to be imported and wraps its `_patch_trl_rl_trainers`; once that has generated the trainer,
`_install` hooks the generated module:

- the module global `UnslothEfficientGRPO` (used by the inlined `grpo_accumulated_loss`) becomes
  `_AdaptiveEfficientGRPO`, which runs Unsloth's compiled loss with beta=0.0 (a constant: no recompiles, however
  beta moves) and adds beta_t * adapted KL, computed eagerly from the same log-probs, outside the compiled region,
  by the decisions it shares with the TRL integration (`grpo_loss.adapted_loss`);
- `UnslothGRPOConfig.__init__` warns where the generated config changed a field the user set (`_wrap_config_init`),
  from the fields its `__post_init__` records as they reached TRL's (`_wrap_config_post_init`);
- `UnslothGRPOTrainer.__init__`, `compute_loss`, `_generate_and_score_completions`, `_calculate_rewards`,
  `prediction_step`, `_save_checkpoint` and `_load_optimizer_and_scheduler` get the same wrappers as the TRL
  integration, `current_beta` the same property, and the module's `use_adapter` the same stand-in
  (`ref_sync.use_reference`).

Unsloth generates its trainers inside a try/except (`patch_trl_rl_trainers`) that turns any exception into a log
line. Where `_install` fails there, what it replaced is undone and the generated `__init__` refuses every adaptive-KL
setting with the original error (`_install_or_refuse`): such a run stops before its first step, and a stock one
trains as stock Unsloth, with a warning.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import importlib.abc
import importlib.machinery
import inspect
import sys
import warnings
from typing import Any, Callable, Optional

import torch
import trl.trainer.grpo_trainer as trl_grpo_trainer
from transformers import TrainingArguments

from ..core.config import reject
from ..core.numerics import masked_reference
from .grpo_loss import LossNormalisers, adapted_loss
from .patching import PatchSet
from .ref_sync import stock_use_adapter, use_reference
from .trl import GRPOConfig
from .trainer_hooks import (
    LOGGED_TRL_FIELDS,
    RUNTIME_FIELDS,
    UNSLOTH_DEFAULTS,
    KLTermProbe,
    asks_for_adaptive_kl,
    check_trainer_beta,
    config_argument,
    current_beta,
    plain,
    record_metrics,
    settle_configs,
    wrap_calculate_rewards,
    wrap_generate_and_score,
    wrap_init,
    wrap_load_optimizer_and_scheduler,
    wrap_prediction_step,
    wrap_save_checkpoint,
)
from .versions import (
    UNSLOTH_ANCHORS,
    UNSLOTH_KL_LINE,
    UNSLOTH_LOSS_CALL,
    UNSLOTH_PASSED_LOSS_KWARGS,
    UNSLOTH_REJECTED_TOKENS_LEAVE_KL,
    UNSLOTH_REWARD_METRIC,
    Anchor,
    anchor_error,
    check_anchors,
    describe,
    generation_local,
    source,
    unsloth_bnpo_rule,
)

RL_MODULE = "unsloth.models.rl"
GENERATED_CLASS = "UnslothGRPOTrainer"
GENERATED_CONFIG = "UnslothGRPOConfig"
# (trainer, calls) of the compute_loss running now; the shim appends its KLTerm for it.
_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("adaptive_kl_unsloth_compute_loss", default=None)
_patches = PatchSet()
# True once unpatch() took the hooks off a trainer Unsloth generated under them: a class that cannot be hooked again
_unpatched_generation = False


def _missing(package: str, anchor: Anchor) -> Callable[[], Exception]:
    return lambda: anchor_error(package, anchor, "Unsloth's generated trainer: ")


def generated_grpo_trainer() -> Optional[type]:
    """Unsloth's generated GRPO trainer class, if Unsloth has generated it."""
    trainer = trl_grpo_trainer.GRPOTrainer
    return trainer if trainer.__name__ == GENERATED_CLASS else None


def _passed(kwargs: dict, name: str) -> Any:
    """kwargs[name]; where the generated compute_loss did not pass it, an IncompatibleVersionError naming it."""
    if name not in kwargs:
        raise _missing("unsloth", UNSLOTH_PASSED_LOSS_KWARGS[name])()
    return kwargs[name]


def _normalisers(kwargs: dict, bnpo_rule: str) -> tuple[str, LossNormalisers]:
    """The installed grpo_compute_loss's loss_type reduction and normalisers, from the kwargs the trainer passes it
    (`versions.UNSLOTH_PASSED_LOSS_KWARGS`, each required; `steps_per_generation` is set by grpo_accumulated_loss
    itself, None in evaluation, as the installed loss reads it); bnpo divides as dapo does where `bnpo_rule` is
    'global' (see versions.UNSLOTH_BNPO_RULES)."""
    loss_type, max_length, items, accumulation, processes = (
        _passed(kwargs, name) for name in UNSLOTH_PASSED_LOSS_KWARGS)
    if items is not None and loss_type == "bnpo" and bnpo_rule == "global":
        loss_type = "dapo"
    return loss_type, LossNormalisers(
        max_completion_length=max_length, num_items_in_batch=items, num_processes=processes,
        steps_per_generation=kwargs.get("steps_per_generation"), gradient_accumulation=accumulation,
    )


class _AdaptiveEfficientGRPO:
    """Stands in for the generated module's `UnslothEfficientGRPO` (only `.apply` is called, from the inlined
    unsloth_zoo `grpo_accumulated_loss`). Set by `_install` from the generated module: `upstream` (the compiled
    loss), `compute_loss` (the installed, uncompiled `grpo_compute_loss`), `bnpo_rule` and
    `rejected_tokens_leave_kl` (the installed version's rules, read from its source)."""

    upstream: Any = None
    compute_loss: Any = None
    bnpo_rule: str = "micro_batch"
    rejected_tokens_leave_kl: bool = False

    @classmethod
    def trainer_kl(cls, new, old, ref, sampling, input_ids, mask, advantages, beta, kwargs) -> tuple[Any, Any]:
        """The per-token KL and the `kl` metric exactly as the installed grpo_compute_loss computes them (its clamps
        in its order, its bias correction, its masking), taken at its KL line by running it eagerly with a probe
        for beta; where that version drops rejected tokens from the KL, they are dropped here too."""
        probe = KLTermProbe(beta, keep_stock_term=True, read_locals=("rs_keep",))
        outputs = cls.compute_loss(ref, new, old, sampling, input_ids, mask, probe, advantages, **kwargs)
        kl = probe.single_capture(_missing("unsloth_zoo", UNSLOTH_KL_LINE))
        keep = probe.locals_at_kl_line.get("rs_keep")
        if cls.rejected_tokens_leave_kl and keep is not None:
            kl = torch.where(keep, kl, 0.0)
        return kl, outputs[2]

    @classmethod
    def apply(cls, new, old, ref, sampling, lm_head, input_ids, mask, advantages, beta, scaler=None, n_chunks=1,
              extra_kwargs=None, upstream_scale=None):
        active = _ACTIVE.get()
        if active is None or ref is None or beta == 0.0:
            return cls.upstream.apply(new, old, ref, sampling, lm_head, input_ids, mask, advantages, beta, scaler,
                                      n_chunks, extra_kwargs, upstream_scale)
        trainer, calls = active
        config = trainer.adaptive_kl.config
        kwargs = extra_kwargs or {}
        stock = config.is_stock_kl
        if kwargs.get("sample_weight") is not None:
            if not stock:  # refused at construction (`_check_unsupported`); the variables were set after it
                raise NotImplementedError(f"{SAMPLE_WEIGHTS}: they were set after the trainer was built")
            calls.append(None)  # stock, untouched: no adaptive_kl/* metrics (warned at construction)
            return cls.upstream.apply(new, old, ref, sampling, lm_head, input_ids, mask, advantages, beta, scaler,
                                      n_chunks, extra_kwargs, upstream_scale)
        # Unsloth's KL line reads the masked reference; the estimator and the non-finite check read the raw one.
        raw_ref, ref = ref, masked_reference(ref, new, mask)
        outputs = list(cls.upstream.apply(new, old, ref, sampling, lm_head, input_ids, mask, advantages,
                                          beta if stock else 0.0, scaler, n_chunks, extra_kwargs, upstream_scale))
        # The trainer's own KL carries the gradient only where the adapted term is built from it.
        metrics_only = stock or not config.reads_trainer_kl or config.kl_in_reward
        with torch.no_grad() if metrics_only else contextlib.nullcontext():
            kl, mean_kl = cls.trainer_kl(new, old, ref, sampling, input_ids, mask, advantages, beta, kwargs)
        if config.kl_in_reward:  # beta * KL_i is in the advantages: the loss keeps the stock KL metric, not its term
            outputs[2] = mean_kl
            calls.append(None)
            return tuple(outputs)
        loss_type, normalisers = _normalisers(kwargs, cls.bnpo_rule)
        outputs[0], term = adapted_loss(trainer.adaptive_kl, outputs[0], kl, new, raw_ref, mask, normalisers, loss_type,
                                        old_logps=old)
        if not stock:
            outputs[2] = mean_kl  # the compiled loss ran with beta=0.0, so it reported a KL of 0
        calls.append(term)
        return tuple(outputs)


def _wrap_compute_loss(upstream: Callable) -> Callable:
    # Replaces UnslothGRPOTrainer.compute_loss (wraps it: exposes the trainer to the shim, then logs the metrics).
    @functools.wraps(upstream)
    def compute_loss(self: Any, model: Any, inputs: Any, return_outputs: bool = False, num_items_in_batch: Any = None):
        check_trainer_beta(self)
        if self.beta == 0.0:  # no KL term: stock, but a setting changed mid-run is refused as at every door
            self.adaptive_kl.check_settings(self.args)
            return upstream(self, model, inputs, return_outputs, num_items_in_batch)
        calls: list = []
        token = _ACTIVE.set((self, calls))
        try:
            loss = upstream(self, model, inputs, return_outputs, num_items_in_batch)
        finally:
            _ACTIVE.reset(token)
        if len(calls) != 1:
            raise _missing("unsloth_zoo", UNSLOTH_LOSS_CALL)()
        record_metrics(self, calls[0])  # None with the KL in the reward: the step still ends here
        return loss

    return compute_loss


def _trl_defaults() -> dict[str, Any]:
    """{field: TRL's default} for the fields whose Unsloth changes are reported: the GRPO fields (trl.GRPOConfig's
    own and this package's), the TRL fields of the settings line (`LOGGED_TRL_FIELDS`) and the runtime fields that
    move the optimisation (`RUNTIME_FIELDS`), not TrainingArguments' others (output_dir, logging, saving); enums as
    their values."""
    runtime = {spec.name for spec in dataclasses.fields(TrainingArguments)} - {*LOGGED_TRL_FIELDS, *RUNTIME_FIELDS}
    return {spec.name: plain(spec.default if spec.default is not dataclasses.MISSING else spec.default_factory())
            for spec in dataclasses.fields(GRPOConfig)
            if spec.name not in runtime and not (spec.default is spec.default_factory is dataclasses.MISSING)}


def _report_changes(config: Any, explicit: dict[str, Any], passed: dict[str, Any]) -> None:
    """Compare, field by field (`_trl_defaults`), what the user passed Unsloth's generated config (`explicit`) with
    what its __init__ passed on to TRL's GRPOConfig (`passed`): a field set explicitly and changed gets one
    UserWarning naming it, the value set and the value in effect (not None, which asks Unsloth for its choice: its own
    advice for dr_grpo is `scale_rewards=None` to keep the scaling); a field left unset whose Unsloth default differs
    from TRL's is recorded on the config (`UNSLOTH_DEFAULTS`) for the settings line its trainer logs."""
    defaults = {}
    for name, trl_default in _trl_defaults().items():
        if name not in passed:
            continue
        # optim='adamw_flash' (Unsloth's own optimizer, its name read as Unsloth reads it) is passed on as
        # 'adamw_torch' with the config marked (`mark_flash_adamw`), from which Unsloth's trainer builds its flash
        # AdamW: not a change
        flash = (name == "optim" and str(plain(explicit.get(name))).strip().lower() == "adamw_flash"
                 and getattr(config, "_unsloth_flash_adamw", False))
        changed = name in explicit and explicit[name] is not None and plain(passed[name]) != plain(explicit[name])
        if changed and not flash:
            warnings.warn(
                f"{name}={explicit[name]!r} was passed to Unsloth's generated {GENERATED_CONFIG} (set explicitly, or "
                f"as its default by an argument parser such as TrlParser, which passes every field), which changed it "
                f"to {passed[name]!r}: {name}={getattr(config, name)!r} is in effect.",
                UserWarning,
                stacklevel=3,
            )
        elif name not in explicit and plain(passed[name]) != trl_default:
            defaults[name] = trl_default
    setattr(config, UNSLOTH_DEFAULTS, defaults)


_PASSED_TO_TRL = "_adaptive_kl_passed_to_trl"


def _wrap_config_post_init(upstream: Callable) -> Callable:
    # Replaces UnslothGRPOConfig.__post_init__ (inherited from this package's GRPOConfig; wraps it): first keeps the
    # fields as the generated __init__ passed them to TRL's GRPOConfig, before TRL's __post_init__ normalises them.
    @functools.wraps(upstream)
    def __post_init__(self: Any) -> None:
        vars(self)[_PASSED_TO_TRL] = dict(vars(self))
        upstream(self)

    return __post_init__


def _wrap_config_init(upstream: Callable) -> Callable:
    # Replaces UnslothGRPOConfig.__init__ (wraps it): the arguments the user passed, against what Unsloth's generated
    # __init__ passed on (`_report_changes`).
    signature = inspect.signature(upstream)

    @functools.wraps(upstream)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        upstream(self, *args, **kwargs)
        explicit: dict[str, Any] = {}
        for name, value in list(signature.bind(self, *args, **kwargs).arguments.items())[1:]:  # after self
            if signature.parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
                explicit.update(value)
            else:
                explicit[name] = value
        _report_changes(self, explicit, vars(self).pop(_PASSED_TO_TRL))

    return __init__


PAD_IS_EOS = ("Unsloth's GRPO loss masks every pad token out of the loss (`completion_ids != pad_token_id`), so each "
              "completion's EOS token gets no policy gradient and no KL: the decision to stop is not trained, and a KL "
              "setting lands elsewhere than in TRL's GRPOTrainer (the KL lab through Unsloth, on the docs' Ground "
              "truth page, measures how far)")


SAMPLE_WEIGHTS = ("Unsloth's per-completion loss weights (UNSLOTH_GRPO_ZERO_VARIANCE_EXCLUDE=1 or "
                  "UNSLOTH_GRPO_LOSS_AGGREGATION=prompt) reweight the loss's rows, which an adapted KL term does not "
                  "follow")


def unsloth_weights_loss(mode: Optional[tuple[bool, bool]], loss_type: str) -> bool:
    """Whether Unsloth weights the loss's completions, as its `_unsloth_grpo_sample_weight` decides (anchored:
    UNSLOTH_SAMPLE_WEIGHT_RULE) from `mode`, its `_unsloth_grpo_sample_weight_mode()` (exclude, prompt_level) or None:
    prompt-level aggregation for every loss type but luspo, zero-variance exclusion alone for the token-normalised
    bnpo, dapo, cispo and vespo. Elsewhere Unsloth warns that it ignores them, and the loss is unweighted."""
    if mode is None:
        return False
    _, prompt_level = mode
    return loss_type != "luspo" if prompt_level else loss_type in ("bnpo", "dapo", "cispo", "vespo")


def _check_unsupported(upstream: Callable, sample_weight_mode: Callable[[], Any]) -> Callable:
    # Wraps the generated UnslothGRPOTrainer.__init__ (after `wrap_init`). Refuses, before training, a KL this package
    # adapts where it cannot follow Unsloth's loss; the stock KL warns and stays stock:
    # - Unsloth's per-completion weights, where the generated module's own `_unsloth_grpo_sample_weight_mode()` and
    #   the loss type say it weights the loss (it reads the environment variables when each batch is generated);
    # - pad = EOS: the KL would be computed without the EOS tokens and still land elsewhere.
    @functools.wraps(upstream)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        upstream(self, *args, **kwargs)
        config = self.adaptive_kl.config
        if unsloth_weights_loss(sample_weight_mode(), self.args.loss_type) and self.beta != 0.0:
            if not config.is_stock_kl:
                raise NotImplementedError(
                    f"{SAMPLE_WEIGHTS}: kl_adaptation_method={config.kl_adaptation_method!r}, kl_placement="
                    f"{config.kl_placement!r} is not supported with them. Unset them, or use "
                    "kl_adaptation_method='none' with the KL in the loss (stock Unsloth)")
            warnings.warn(f"{SAMPLE_WEIGHTS}: the loss stays stock Unsloth's, and no adaptive_kl/* metric is logged "
                          "for the batches they weight.", UserWarning, stacklevel=2)
        tokenizer = getattr(self.processing_class, "tokenizer", self.processing_class)  # a processor holds one
        pad = getattr(tokenizer, "pad_token_id", None)
        if pad is None or pad != getattr(tokenizer, "eos_token_id", None):
            return
        fix = ("a tokenizer with a pad token of its own (FastLanguageModel.from_pretrained gives one; or set "
               "tokenizer.pad_token to an unused special token of the vocabulary)")
        if not config.is_stock_kl and self.beta != 0.0:  # beta = 0: no KL term to land elsewhere, as for the weights
            raise reject("pad_token_id", pad, f"a token other than the eos_token_id ({pad}) with kl_adaptation_method="
                         f"{config.kl_adaptation_method!r}, kl_placement={config.kl_placement!r}: {PAD_IS_EOS}. Use "
                         f"{fix}; kl_adaptation_method='none' with the KL in the loss stays stock (it warns)")
        warnings.warn(f"pad_token_id={pad} is the eos_token_id: {PAD_IS_EOS}. Use {fix}.", UserWarning, stacklevel=2)

    return __init__


# The functions of the generated module that unsloth inlines from unsloth_zoo.rl_replacements.
ZOO_FUNCTIONS = ("grpo_compute_loss", "grpo_accumulated_loss")


def anchor_package(anchor: Anchor) -> str:
    """The package an Unsloth anchor belongs to: the generated module is unsloth's (UnslothGRPOTrainer's methods,
    generated from TRL's source, and unsloth's own helpers) but for the loss functions it inlines from unsloth_zoo."""
    return "unsloth_zoo" if anchor.function in ZOO_FUNCTIONS else "unsloth"


def anchor_resolver(trainer_class: type) -> Callable[[str], Any]:
    """Maps an Unsloth anchor's function name to the generated object: 'UnslothGRPOTrainer.x' to the trainer's
    method, a bare name to the generated module's function."""
    module = sys.modules[trainer_class.__module__]

    def resolve(name: str) -> Any:
        owner, _, attribute = name.rpartition(".")
        return getattr(trainer_class if owner else module, attribute, None)

    return resolve


def _install(trainer_class: type) -> None:
    """Check the anchors in the generated trainer and its module, then hook them. Idempotent."""
    module = sys.modules.get(trainer_class.__module__)
    if module is None or module.__dict__.get("UnslothEfficientGRPO") is _AdaptiveEfficientGRPO:
        return
    for owner, name in ((module, "UnslothEfficientGRPO"), (module, "grpo_compute_loss"), (module, GENERATED_CONFIG),
                        (trainer_class, "compute_loss")):
        if not hasattr(owner, name):
            raise _missing("unsloth", Anchor(name, name, "a name the integration hooks"))()

    check_anchors(anchor_package, UNSLOTH_ANCHORS, anchor_resolver(trainer_class), "Unsloth's generated trainer: ")
    installed = source(module.grpo_compute_loss)
    _AdaptiveEfficientGRPO.compute_loss = module.grpo_compute_loss
    _AdaptiveEfficientGRPO.bnpo_rule = unsloth_bnpo_rule(installed)
    _AdaptiveEfficientGRPO.rejected_tokens_leave_kl = UNSLOTH_REJECTED_TOKENS_LEAVE_KL in installed
    _AdaptiveEfficientGRPO.upstream = module.UnslothEfficientGRPO
    # grpo_accumulated_loss (inlined from unsloth_zoo.rl_replacements) calls UnslothEfficientGRPO.apply.
    _patches.replace(module, "UnslothEfficientGRPO", _AdaptiveEfficientGRPO)
    # The generated config's __init__, which rewrites some of the user's arguments before TRL's GRPOConfig sees them.
    config_class = getattr(module, GENERATED_CONFIG)
    _patches.replace(config_class, "__post_init__", _wrap_config_post_init(config_class.__post_init__))
    _patches.replace(config_class, "__init__", _wrap_config_init(config_class.__init__))
    # The generated trainer's own methods, copied from TRL's source: TRL-side patches do not reach them.
    _patches.replace(trainer_class, "__init__", _check_unsupported(wrap_init(trainer_class.__init__),
                                                                   module._unsloth_grpo_sample_weight_mode))
    _patches.replace(trainer_class, "compute_loss", _wrap_compute_loss(trainer_class.compute_loss))
    _patches.replace(trainer_class, "_generate_and_score_completions",
             wrap_generate_and_score(trainer_class._generate_and_score_completions,
                                     _missing("unsloth", UNSLOTH_REWARD_METRIC)))
    _patches.replace(trainer_class, "_calculate_rewards",
             wrap_calculate_rewards(trainer_class._calculate_rewards,
                                    lambda name: anchor_error("unsloth", generation_local(name), "Unsloth's generated trainer: ")))
    # The generated trainer's prediction_step: evaluation marked, as Unsloth's generation leaves the model in training
    # mode.
    _patches.replace(trainer_class, "prediction_step", wrap_prediction_step(trainer_class.prediction_step))
    # The generated trainer's _save_checkpoint / _load_optimizer_and_scheduler: the controller state and the synced
    # reference in checkpoints, as in TRL's; current_beta: the live beta (trainer.beta stays the configured one).
    _patches.replace(trainer_class, "_save_checkpoint", wrap_save_checkpoint(trainer_class._save_checkpoint))
    _patches.replace(trainer_class, "_load_optimizer_and_scheduler",
             wrap_load_optimizer_and_scheduler(trainer_class._load_optimizer_and_scheduler))
    _patches.replace(trainer_class, "current_beta", property(current_beta))
    # The generated module's `use_adapter` (imported from trl.trainer.grpo_trainer when Unsloth generated it, so
    # already ours when TRL was patched then), as its _generate_and_score_completions calls it for the reference forward;
    # unpatch() restores TRL's own, not the copy of ours.
    _patches.replace(module, "use_adapter", use_reference, stock=stock_use_adapter)


SWALLOWED_NOTE = (
    "unsloth_adaptive_kl's hook raised this while Unsloth generated UnslothGRPOTrainer, where "
    "unsloth.models.rl.patch_trl_rl_trainers logs it and goes on, so the trainer has no adaptive loss: it refuses any "
    "adaptive-KL setting (and sync_ref_model) with this error; kl_adaptation_method='none' trains as stock Unsloth."
)


def _refusing_init(upstream: Callable, error: Exception) -> Callable:
    # Replaces UnslothGRPOTrainer.__init__ (wraps it) once this package's hook failed inside Unsloth's generation of
    # the trainer: a run that asks for adaptive KL fails at construction, before its first step, with that error.
    traceback = error.__traceback__

    @functools.wraps(upstream)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        config = config_argument(args, kwargs)
        if config is not None and asks_for_adaptive_kl(config):
            raise error.with_traceback(traceback)
        warnings.warn(
            f"UnslothGRPOTrainer trains as stock Unsloth, without unsloth_adaptive_kl: its hook failed while Unsloth "
            f"generated the trainer ({type(error).__name__}: {error}) Only stock settings train; for adaptive KL, "
            "do what that error says.",
            UserWarning,
            stacklevel=2,
        )
        upstream(self, *args, **kwargs)

    return __init__


def _install_or_refuse(trainer_class: type) -> None:
    """`_install`, called inside Unsloth's generation, which turns any exception into one log line. Where it fails,
    what it replaced is undone (the trainer is Unsloth's own again), the trainer's __init__ refuses adaptive-KL
    settings with the error (`_refusing_init`), and the error is raised on, for Unsloth to log."""
    installed = len(_patches)
    try:
        _install(trainer_class)
    except Exception as error:
        _patches.restore(keep=installed)
        if hasattr(error, "add_note"):  # Python >= 3.11
            error.add_note(SWALLOWED_NOTE)
        if not _patches.replaced(trainer_class, "__init__"):  # refused already by an earlier failed generation
            _patches.replace(trainer_class, "__init__", _refusing_init(trainer_class.__init__, error))
        raise


def _wrap_patch_trl_rl_trainers(upstream: Callable) -> Callable:
    # Replaces unsloth.models.rl._patch_trl_rl_trainers (wraps it: hooks the trainer it generates).
    @functools.wraps(upstream)
    def _patch_trl_rl_trainers(trainer_file: str = "grpo_trainer", *args: Any, **kwargs: Any) -> Any:
        result = upstream(trainer_file, *args, **kwargs)
        if trainer_file == "grpo_trainer":
            generated = generated_grpo_trainer()
            if generated is None:
                warnings.warn(
                    "Unsloth did not generate UnslothGRPOTrainer (see its warning above): trl.GRPOTrainer stays TRL's "
                    "own trainer. unsloth_adaptive_kl's TRL integration applies to it, without Unsloth's GRPO "
                    f"optimisations ({describe('unsloth')}).",
                    stacklevel=2,
                )
            else:
                _install_or_refuse(generated)
        return result

    return _patch_trl_rl_trainers


def _hook_rl_module(module: Any) -> None:
    if not hasattr(module, "_patch_trl_rl_trainers"):  # before any generation: not "Unsloth's generated trainer"
        raise anchor_error("unsloth", Anchor(RL_MODULE, "_patch_trl_rl_trainers",
                                             "the function that generates Unsloth's trainer"))
    _patches.replace(module, "_patch_trl_rl_trainers", _wrap_patch_trl_rl_trainers(module._patch_trl_rl_trainers))


class _RLModuleFinder(importlib.abc.MetaPathFinder):
    """Import hook: after `unsloth.models.rl` executes (and before it generates anything), wrap its generator."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != RL_MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        upstream_exec = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            upstream_exec(module)
            _hook_rl_module(module)

        # Replaces this spec's loader's exec_module (importlib's SourceFileLoader.exec_module, on the loader made for
        # this import alone): unsloth.models.rl runs as before, then is hooked. unpatch() takes the finder off
        # sys.meta_path, so a later import of the module is stock.
        spec.loader.exec_module = exec_module
        return spec


_FINDER = _RLModuleFinder()


def check_import_order() -> None:
    """Raise ImportError when Unsloth already generated its GRPO trainer: too late to patch it correctly (after an
    `unpatch()` of the hooked trainer too: its hooks cannot be put back on the class Unsloth generated)."""
    if _unpatched_generation:
        raise ImportError(
            "unsloth_adaptive_kl.patch() after unpatch(): Unsloth generated UnslothGRPOTrainer while this package was "
            "patched, and unpatch() took its hooks off; they cannot be put back on that class. Start a new Python "
            "process to train with adaptive KL in Unsloth."
        )
    if generated_grpo_trainer() is not None or GENERATED_CLASS in sys.modules:
        raise ImportError(
            "unsloth_adaptive_kl was imported after unsloth, which has already generated UnslothGRPOTrainer from "
            "TRL's GRPOTrainer, so the adaptive-KL fields and loss cannot reach it. Import unsloth_adaptive_kl "
            "first:\n    import unsloth_adaptive_kl\n    import unsloth"
        )


def patch() -> None:
    """Hook Unsloth's GRPO trainer generation, now if `unsloth.models.rl` is loaded, else when it loads."""
    if _FINDER in sys.meta_path or _patches.replaced(sys.modules.get(RL_MODULE), "_patch_trl_rl_trainers"):
        return
    module = sys.modules.get(RL_MODULE)
    if module is not None:
        _hook_rl_module(module)
    else:
        sys.meta_path.insert(0, _FINDER)


def unpatch() -> None:
    """Remove the import hook and restore every Unsloth object replaced. Idempotent. Where Unsloth already generated
    its trainer under the hooks, its generated config keeps the adaptive-KL fields, which the restored trainer no
    longer reads: a warning says so (once), and a later `patch()` refuses (`check_import_order`)."""
    global _unpatched_generation
    if _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)
    hooked = bool(_patches)
    _patches.restore(leave_newer=True)
    generated = generated_grpo_trainer()
    if hooked and generated is not None and not _unpatched_generation:
        _unpatched_generation = True
        # the warning covers the generated config's every instance: TRL's unpatch() does not name them again
        settle_configs(getattr(sys.modules.get(generated.__module__), GENERATED_CONFIG, type(None)))
        warnings.warn("unsloth_adaptive_kl.unpatch(): Unsloth generated UnslothGRPOTrainer and UnslothGRPOConfig while "
                      "this package was patched; the trainer is stock again, but the config class keeps the "
                      "adaptive-KL fields, which it no longer reads (set one and nothing adapts). Start a new Python "
                      "process for stock Unsloth.", UserWarning, stacklevel=3)
