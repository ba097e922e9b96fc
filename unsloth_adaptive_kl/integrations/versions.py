"""Everything version-specific, in one place: the versions the CI matrix tests, and the source anchors each
integration relies on.

Compatibility is decided by the anchors, never by a version number alone. At patch time each anchor (an exact
line of the installed upstream source, or a method signature) is looked up: a missing anchor is an
`IncompatibleVersionError` naming the anchor, the version found and the tested range; a version outside the tested
range whose anchors all hold gets one `UntestedVersionWarning` and is patched.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from ..core.errors import IncompatibleVersionError, UntestedVersionWarning

# What the CI matrix runs (.ci/run), integration by integration: the versions of each package its rows ran the
# integration's tests on, as ranges whose ends a row ran (the exact sets: docs/results/ci.json). A package is tested
# with one integration, not with every one: transformers 4.56.2 ran TRL's tests (row k), never Unsloth's. "core": the
# core's tests (AdaptiveKL in an own loop, Tinker's), which need torch alone.
TESTED: dict[str, dict[str, SpecifierSet]] = {
    "core": {"torch": SpecifierSet(">=2.4.0,<=2.15.0")},
    "trl": {"trl": SpecifierSet(">=1.9.1,<=1.16.0"), "transformers": SpecifierSet(">=4.56.2,<=5.25.0"),
            "torch": SpecifierSet(">=2.6.0,<=2.15.0")},
    "unsloth": {"unsloth": SpecifierSet(">=2026.10.7,<=2026.10.9"),
                "unsloth_zoo": SpecifierSet(">=2026.10.7,<=2026.10.9"), "trl": SpecifierSet("==1.15.0"),
                "transformers": SpecifierSet("==5.17.0"), "torch": SpecifierSet("==2.14.1")},
    "verl": {"verl": SpecifierSet("==0.9.1"), "transformers": SpecifierSet("==5.10.4"),
             "torch": SpecifierSet("==2.13.0")},
}
PACKAGE_ROOT = Path(__file__).resolve().parents[1]  # unsloth_adaptive_kl/
# The package whose install brings each integration: where it is installed, that integration's ranges apply.
BROUGHT_BY = {"core": "torch", "trl": "trl", "unsloth": "unsloth", "verl": "verl"}
# The integration whose anchors a package's source holds: its versions are checked against that integration's range.
OWNER = {"trl": "trl", "unsloth": "unsloth", "unsloth_zoo": "unsloth", "verl": "verl"}
# How a range's integration is named where several are listed ("tested: ... with TRL; ... with Unsloth").
INTEGRATION_NAMES = {"core": "the core", "trl": "TRL", "unsloth": "Unsloth", "verl": "verl"}


@dataclass(frozen=True)
class Anchor:
    """`text` must occur in the source of `function` (or, for `signature=True`, equal its parameter list); `or_text`:
    the other forms a tested version has instead, any one of which will do."""

    function: str
    text: str
    reason: str
    signature: bool = False
    or_text: tuple[str, ...] = ()


# trl.GRPOTrainer (integrations/trl.py). The KL line is where the per-token KL is taken from; the normaliser lines are
# the reductions `reductions.REDUCTIONS` reproduces for the adapted KL.
TRL_KL_LINE = Anchor("GRPOTrainer._compute_loss", "per_token_loss = per_token_loss + self.beta * per_token_kl",
                     "the trainer's own per-token KL is taken at this line")
TRL_LOGPS_CALL = Anchor("GRPOTrainer._compute_loss", "= self._get_per_token_logps_and_entropies(",
                        "the policy log-probs, for a non-default kl_estimator")
TRL_REWARD_METRIC = Anchor("GRPOTrainer._generate_and_score_completions", 'self._metrics[mode]["reward"].append(',
                           "the mean reward the dynamic beta reads")
# With the entropy bonus on, TRL logs `policy_loss`: the loss before the bonus, its KL term included, taken after the
# accumulation divide for dapo, cispo and vespo and before it for the other loss types.
TRL_POLICY_LOSS_METRIC = Anchor(
    "GRPOTrainer._compute_loss",
    'self._metrics[mode]["policy_loss"].append(self.accelerator.gather(policy_loss).nanmean().item())',
    "the policy_loss metric (entropy bonus on), which holds the KL term")
TRL_POLICY_LOSS_AFTER_DIVIDE = Anchor(
    "GRPOTrainer._compute_loss",
    "loss = (per_token_loss * mask).sum() / normalizer\n            policy_loss = loss.detach()",
    "dapo/cispo/vespo's policy_loss, taken after the accumulation divide")


def reward_placement_anchors(function: str) -> tuple[Anchor, ...]:
    """kl_placement="reward" in a `_generate_and_score_completions` (TRL's, or Unsloth's copy of it): the call whose
    rewards gain the penalty column, the weighted sum that subtracts it before the advantages, the unscored rows that
    keep no penalty, and the log-prob locals read at the call."""
    reason = "read where it calls _calculate_rewards, for the KL in the reward"
    return (
        Anchor(function, "rewards_per_func = self._calculate_rewards(", "the rewards the KL penalty joins"),
        Anchor(function, "rewards = (rewards_per_func * self.reward_weights.to(device).unsqueeze(0)).nansum(dim=1)",
               "the weighted reward sum that subtracts the KL penalty before the advantages"),
        Anchor(function, "unscorable_mask = torch.isnan(rewards_per_func).all(dim=1)",
               "unscored completions, which take no KL penalty"),
        *(Anchor(function, f"{name} = ", reason) for name in GENERATION_LOCALS),
    )


def generation_local(name: str) -> Anchor:
    """The anchor of a `_generate_and_score_completions` local that was absent at the `_calculate_rewards` call."""
    return Anchor("_generate_and_score_completions", f"{name} = ",
                  "read where it calls _calculate_rewards, for the KL in the reward")


def reference_forward_anchor(function: str) -> Anchor:
    """The PEFT reference forward in a `_generate_and_score_completions` (TRL's, or Unsloth's copy of it): its
    `use_adapter` is replaced by `ref_sync.use_reference`, which exchanges in a synced reference."""
    return Anchor(function, 'with use_adapter(model, adapter_name="ref" if "ref" in model.peft_config else None):',
                  "the PEFT reference forward, which runs with the synced reference after a sync")


# TRL's reference mix, which `ref_sync` calls for full and PEFT references alike.
TRL_SYNC_MIX = Anchor("SyncRefModelCallback._sync_target_model",
                      "target_param.data.mul_(1.0 - alpha).add_(copy_param.data, alpha=alpha)",
                      "the reference mix alpha * policy + (1 - alpha) * reference")
# The locals of `_generate_and_score_completions` read where it calls `_calculate_rewards` (kl_placement="reward").
GENERATION_LOCALS = ("old_per_token_logps", "sampling_per_token_logps", "ref_per_token_logps", "completion_mask",
                     "tool_mask")
# trl 1.9.1's luspo reduction: the mean over every position, padding included, of the per-token loss times its
# completion's length, (1 / (B T)) sum_i L_i sum_t x_{i,t} (1.10.0 on: (1 / B) sum_i sum_t m_{i,t} x_{i,t}).
TRL_PADDED_LUSPO = "loss = (per_token_loss * mask.sum(1, keepdim=True)).mean()"
TRL_ANCHORS = (
    TRL_KL_LINE,
    TRL_LOGPS_CALL,
    TRL_REWARD_METRIC,
    TRL_POLICY_LOSS_METRIC,
    TRL_POLICY_LOSS_AFTER_DIVIDE,
    Anchor("GRPOTrainer._compute_loss",
           'mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]',
           "the loss mask"),
    Anchor("GRPOTrainer._compute_loss", "loss = ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()",
           "the grpo/sapo reduction"),
    Anchor("GRPOTrainer._compute_loss", "loss = (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)",
           "the bnpo reduction"),
    # trl 1.9.1 averages luspo's loss over every position, padding included, weighted by length (docs/methods.md)
    Anchor("GRPOTrainer._compute_loss", "loss = (per_token_loss * mask).sum(-1).mean()", "the luspo reduction",
           or_text=(TRL_PADDED_LUSPO,)),
    Anchor("GRPOTrainer._compute_loss",
           "loss = (per_token_loss * mask).sum() / (per_token_loss.size(0) * self.max_completion_length)",
           "the dr_grpo reduction"),
    Anchor("GRPOTrainer._compute_loss",
           'normalizer = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes',
           "the dapo/cispo/vespo normaliser"),
    Anchor("GRPOTrainer._compute_loss",
           "normalizer = normalizer * self.current_gradient_accumulation_steps / self.args.steps_per_generation",
           "the dapo/cispo/vespo normaliser's accumulation window"),
    Anchor("GRPOTrainer._save_checkpoint", "self, model, trial", "the beta state saved with checkpoints",
           signature=True),
    Anchor("GRPOTrainer._load_optimizer_and_scheduler", "self, checkpoint", "the beta state restored on resume",
           signature=True),
    *reward_placement_anchors("GRPOTrainer._generate_and_score_completions"),
    reference_forward_anchor("GRPOTrainer._generate_and_score_completions"),
    TRL_SYNC_MIX,
)
# trl 1.15 imports its Triton log-prob kernel with a None fallback and has no CPU path: trl_cpu_fallback serves CPU.
TRL_KERNEL_WITHOUT_CPU_PATH = "_ChunkedLogProbFunction = None"
# trl 1.9.1 - 1.13.0: with use_liger_kernel=True, GRPOTrainer.compute_loss hands the whole loss to Liger's fused GRPO
# loss, which computes its own beta * k3, and `_compute_loss` (where the adapted KL goes) never runs. Not an anchor:
# its presence in the installed compute_loss is what makes a non-stock setting with Liger an error.
TRL_LIGER_LOSS_CALL = "self.compute_liger_loss"

# unsloth_zoo's grpo_compute_loss, as inlined into Unsloth's generated trainer module (integrations/unsloth.py).
UNSLOTH_KL_LINE = Anchor("grpo_compute_loss", "loss_i = loss_i + beta * kl_i",
                         "the trainer's own per-token KL is taken at this line")
UNSLOTH_LOSS_CALL = Anchor("grpo_accumulated_loss", "UnslothEfficientGRPO.apply(",
                           "the compiled loss, which the adaptive loss wraps")
UNSLOTH_REWARD_METRIC = Anchor("UnslothGRPOTrainer._generate_and_score_completions",
                               'self._metrics[mode]["reward"].append(', "the mean reward the dynamic beta reads")
# Unsloth's generated _generate_and_score_completions keeps its reference and old log-probs left-packed,
# (B, C + max_left_pad): this local, each row's left padding, puts them back in TRL's (B, C) layout for the KL in the
# reward (trainer_hooks.trl_layout).
UNSLOTH_LEFT_PAD_LOCAL = "left_pad_tokens_per_prompt"
# The keywords the generated compute_loss passes grpo_accumulated_loss (which hands them on to the loss), by which the
# installed grpo_compute_loss reduces the loss; it reads each with a default, so a renamed one would silently differ.
# Checked in the source at patch time, and in the call's keywords at the first loss call.
UNSLOTH_PASSED_LOSS_KWARGS = {
    name: Anchor("UnslothGRPOTrainer.compute_loss", f"{name} = ", "a keyword its grpo_accumulated_loss call passes the "
                 "loss, which reduces the adapted KL as it reduces the loss")
    for name in ("loss_type", "max_completion_length", "num_items_in_batch", "current_gradient_accumulation_steps",
                 "num_processes")
}
# Unsloth's per-completion loss weights (UNSLOTH_GRPO_ZERO_VARIANCE_EXCLUDE=1, UNSLOTH_GRPO_LOSS_AGGREGATION=prompt):
# its `_unsloth_grpo_sample_weight` reads `_unsloth_grpo_sample_weight_mode()` (exclude, prompt_level) and gives no
# weights for these loss types, which integrations/unsloth.py's `unsloth_weights_loss` follows.
UNSLOTH_SAMPLE_WEIGHT_RULE = ("settings = _unsloth_grpo_sample_weight_mode()",
                              'if (prompt_level and loss_type == "luspo") or (',
                              'not prompt_level and loss_type not in ("bnpo", "dapo", "cispo", "vespo")')
UNSLOTH_ANCHORS = (
    *UNSLOTH_PASSED_LOSS_KWARGS.values(),
    UNSLOTH_KL_LINE,
    UNSLOTH_LOSS_CALL,
    UNSLOTH_REWARD_METRIC,
    Anchor("UnslothGRPOTrainer._generate_and_score_completions", f"{UNSLOTH_LEFT_PAD_LOCAL} = ",
           "each row's left padding: Unsloth's left-packed log-probs in TRL's layout, for the KL in the reward"),
    Anchor("grpo_compute_loss", "return loss, completion_length, mean_kl",
           "the trainer's own KL metric"),
    Anchor("grpo_compute_loss", "loss = ((loss_i * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()",
           "the grpo/sapo reduction"),
    Anchor("grpo_compute_loss", "loss = (loss_i * mask).sum() / (loss_i.size(0) * max_completion_length)",
           "the dr_grpo reduction"),
    Anchor("grpo_compute_loss", "loss = (loss_i * mask).sum(-1).mean()", "the luspo reduction"),
    Anchor("grpo_compute_loss", "normalizer = normalizer * current_gradient_accumulation_steps / steps_per_generation",
           "the dapo/cispo/vespo normaliser's accumulation window"),
    *reward_placement_anchors("UnslothGRPOTrainer._generate_and_score_completions"),
    reference_forward_anchor("UnslothGRPOTrainer._generate_and_score_completions"),
    *(Anchor("_unsloth_grpo_sample_weight", text, "the settings under which Unsloth weights the loss's completions")
      for text in UNSLOTH_SAMPLE_WEIGHT_RULE),
)
# unsloth_zoo 2026.10.9 drops rollout_rs's rejected tokens from every loss term, the KL included (2026.10.7 only
# from the policy term): where this line is present, the KL is masked by the function's `rs_keep` at the KL line.
UNSLOTH_REJECTED_TOKENS_LEAVE_KL = "loss_i = torch.where(rs_keep, loss_i, 0.0)"
# verl's V1 trainer (integrations/verl.py, imported by verl itself through VERL_USE_EXTERNAL_MODULES). Names are
# dotted paths under the `verl` package.
VERL_ANCHORS = (
    Anchor("workers.utils.losses.ppo_loss", "if config.use_kl_loss:", "ppo_loss's KL term, which AdaptivePPOLoss adapts"),
    Anchor("workers.utils.losses.ppo_loss",
           "kld = kl_penalty(logprob=log_prob, ref_logprob=ref_log_prob, kl_penalty=config.kl_loss_type)",
           "verl's per-token KL in the loss, which the adaptation shapes"),
    Anchor("workers.utils.losses.ppo_loss", "policy_loss += kl_loss * config.kl_loss_coef",
           "where verl adds beta * KL to the loss"),
    Anchor("workers.utils.losses.ppo_loss", 'config.global_batch_info["global_batch_size"] = data["global_batch_size"]',
           "the global batch normalisation the adapted KL is aggregated with"),
    Anchor("workers.utils.losses.ppo_loss",
           "loss_mat=kld, loss_mask=response_mask, loss_agg_mode=config.loss_agg_mode, **config.global_batch_info",
           "ppo_loss's aggregation of its per-token KL, which AdaptivePPOLoss replaces by the adapted term's"),
    Anchor("workers.utils.losses.ppo_loss", "policy_loss_fn = get_policy_loss_fn(loss_mode)",
           "ppo_loss's policy loss, whose old_log_prob the KL's non-finite check covers"),
    Anchor("workers.utils.losses.ppo_loss", "old_log_prob=old_log_prob,",
           "the old log-probs ppo_loss hands its policy loss"),
    Anchor("workers.utils.losses.ppo_loss", 'metrics["kl_loss"] = Metric(value=kl_loss, aggregation=metric_aggregation)',
           "verl's kl_loss metric, whose aggregation the adaptive_kl/* metrics share"),
    Anchor("trainer.ppo.core_algos.agg_loss", "batch_num_tokens: Optional[int] = None",
           "agg_loss's global normalisation arguments"),
    Anchor("trainer.ppo.ray_trainer.apply_kl_penalty", "kld = core_algos.kl_penalty(",
           "the per-token KL verl subtracts from the rewards, which clip and sigmoid replace by the shaped KL"),
    Anchor("trainer.ppo.ray_trainer.apply_kl_penalty", "beta = kl_ctrl.value", "the reward KL reads the controller's value"),
    Anchor("trainer.ppo.ray_trainer.apply_kl_penalty", "kl_ctrl.update(current_kl=current_kl, n_steps=batch_size)",
           "the reward KL updates the controller once per batch"),
    Anchor("trainer.ppo.v1.trainer_base.PPOTrainer.__init__",
           "self.kl_ctrl_in_reward = core_algos.get_kl_controller(self.config.algorithm.kl_ctrl)",
           "the reward KL controller, which RewardKLController replaces"),
    Anchor("trainer.ppo.v1.trainer_base.PPOTrainer.__init__", "self.trainer_mode = self.config.trainer.v1.trainer_mode",
           "the trainer mode the registered trainer runs as"),
    Anchor("trainer.ppo.v1.trainer_base.PPOTrainer.__init__", "self.config = config",
           "the config every V1 trainer reads, whose adaptive_kl block verl's own trainers refuse"),
    Anchor("trainer.ppo.ray_trainer.RayPPOTrainer.__init__", "self.config = config",
           "the config the legacy trainer (trainer.use_v1=False) reads, whose adaptive_kl block it refuses"),
    Anchor("trainer.ppo.v1.trainer_base.PPOTrainer._compute_advantage", "data, kl_metrics = apply_kl_penalty(",
           "where the V1 trainer applies the reward KL"),
    Anchor("trainer.ppo.v1.trainer_base.PPOTrainer._update_actor", "batch.extra_info.update(extra_info)",
           "the meta info that carries beta to every micro-batch"),
    Anchor("trainer.ppo.v1.trainer_base.PPOTrainer._update_actor", 'output = rename_dict(output["metrics"], "actor/")',
           "the actor metrics the adaptive_kl/* metrics come back in"),
    Anchor("trainer.ppo.v1.trainer_base.PPOTrainer._update_actor", "actor_metrics = reduce_metrics(output)",
           "where the per-completion KL statistics are taken before verl averages them"),
    Anchor("trainer.ppo.v1.trainer_base.PPOTrainer._setup", "self.actor_rollout_wg = all_wg[str(actor_role)]",
           "the actor worker group whose loss is replaced (set_loss_fn)"),
    Anchor("trainer.ppo.v1.trainer_base.PPOTrainer._load_checkpoint",
           'self.global_steps = int(global_step_folder.split("global_step_")[-1])', "the step resumed from"),
    Anchor("trainer.ppo.v1.trainer_base.PPOTrainer._save_checkpoint", 'f"global_step_{self.global_steps}"',
           "the checkpoint folder the controller state is saved in"),
    Anchor("utils.transferqueue_utils._async_meta_to_realdata",
           "tu.assign_non_tensor_data(tensor_dict=tensordict, key=key, val=val)",
           "the meta info reaches the workers as non-tensor data"),
    Anchor("workers.engine_workers.ActorRolloutRefWorker.set_loss_fn", "def set_loss_fn(",
           "how the driver installs the adaptive loss on the actor workers"),
)

# How unsloth_zoo reduces bnpo when the trainer passes num_items_in_batch: like dapo, by the global token count
# (2026.10.7), or by the micro-batch's own tokens, like TRL (2026.10.9).
UNSLOTH_BNPO_RULES = {
    'elif loss_type in ["bnpo", "cispo", "dapo", "vespo"]:': "global",
    'elif loss_type in ["cispo", "dapo", "vespo"]:': "micro_batch",
}

_warned: set[tuple[str, str]] = set()


def installed_version(package: str) -> Version | str:
    """The installed version, parsed; its metadata's own text where that is not a PEP 440 version (a local build's
    '2.14.1-custom'), which no tested range contains; 'unknown' where its metadata has no Version field."""
    try:
        text = importlib.metadata.version(package)
    except KeyError:  # no Version field: KeyError where the metadata raises for a missing field, else None
        text = None
    if text is None:
        return "unknown"
    try:
        return Version(text)
    except InvalidVersion:
        return text


def integrations_of(package: str, integrations: Optional[tuple[str, ...]] = None) -> tuple[str, ...]:
    """The integrations whose tested ranges `package` is read against: those of `integrations` that run with it, else
    (none does, or none is given) the package's owner (`OWNER`), or for torch and transformers every integration."""
    return (tuple(name for name in integrations or () if package in TESTED.get(name, {}))
            or ((OWNER[package],) if package in OWNER else tuple(name for name in TESTED if package in TESTED[name])))


def installed_integrations() -> tuple[str, ...]:
    """The core, and each integration whose package (`BROUGHT_BY`) is installed here."""
    return tuple(name for name, package in BROUGHT_BY.items() if is_installed(package))


def is_installed(package: str) -> bool:
    """Whether `package`'s distribution is installed here (its metadata is found; it may still fail to import)."""
    try:
        importlib.metadata.distribution(package)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def in_tested_range(package: str, version: Version | str, integrations: Optional[tuple[str, ...]] = None) -> bool:
    """Whether `version` is in the package's tested range with each of `integrations` (never, for a version that is
    not PEP 440)."""
    return isinstance(version, Version) and all(version in TESTED[name][package]
                                                for name in integrations_of(package, integrations))


def tested_range(package: str, integration: Optional[str] = None) -> str:
    """'>=1.9.1,<=1.16.0': the tested range with `integration` (default: the package's owner), lower bound first."""
    specifiers = TESTED[integration or OWNER[package]][package]
    return ",".join(sorted((str(spec) for spec in specifiers), key=lambda spec: not spec.startswith(">")))


def tested_ranges(package: str, integrations: Optional[tuple[str, ...]] = None) -> str:
    """'trl>=1.9.1,<=1.16.0', or, with several integrations, 'trl>=1.9.1,<=1.16.0 with TRL; trl==1.15.0 with
    Unsloth'."""
    names = integrations_of(package, integrations)
    if len(names) == 1:
        return f"{package}{tested_range(package, names[0])}"
    return "; ".join(f"{package}{tested_range(package, name)} with {INTEGRATION_NAMES[name]}" for name in names)


def describe(package: str, integrations: Optional[tuple[str, ...]] = None) -> str:
    """'trl==1.16.0 (tested: trl>=1.9.1,<=1.16.0)', or 'trl (not installed) (tested: trl>=1.9.1,<=1.16.0)'; the
    ranges of `integrations` (default: the package's owner)."""
    try:
        found = f"{package}=={installed_version(package)}"
    except importlib.metadata.PackageNotFoundError:
        found = f"{package} (not installed)"
    return f"{found} (tested: {tested_ranges(package, integrations)})"


def is_tested(package: str, integrations: Optional[tuple[str, ...]] = None) -> Optional[bool]:
    """Whether the installed version is in the tested range with each of `integrations` (default: the package's
    owner); None when the package is not installed."""
    try:
        return in_tested_range(package, installed_version(package), integrations)
    except importlib.metadata.PackageNotFoundError:
        return None


def source(function: Any, depth: int = 3) -> str:
    """The installed source of `function` and of the functions it wraps (a wrapper's closure: Unsloth wraps some
    generated methods without functools.wraps); '' when it has none (built-in, or generated without a file)."""
    try:
        text = inspect.getsource(function)
    except (OSError, TypeError):
        return ""
    cells = getattr(function, "__closure__", None) or ()
    wrapped = [inner for inner in map(_contents, cells) if inspect.isfunction(inner)]
    return "\n".join([text, *(source(inner, depth - 1) for inner in wrapped if depth > 0)])


def _contents(cell: Any) -> Any:
    """A closure cell's value; None for an empty one (a name its scope has not bound), which has no source."""
    try:
        return cell.cell_contents
    except ValueError:
        return None


def _text(function: Any, signature: bool) -> str:
    return ", ".join(inspect.signature(function).parameters) if signature else source(function)


def resolve_verl(name: str) -> Any:
    """A VERL_ANCHORS name ('trainer.ppo.core_algos.agg_loss', a class's method) -> verl's object, None where it is
    gone: the longest importable module prefix under `verl`, then attributes."""
    parts = name.split(".")
    for split in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(["verl", *parts[:split]]))
        except ImportError:
            continue
        for attribute in parts[split:]:
            obj = getattr(obj, attribute, None)
        return obj
    return None


def missing_anchors(anchors: tuple[Anchor, ...], resolve: Callable[[str], Any]) -> list[Anchor]:
    """The anchors whose text is not in the installed source; `resolve` maps an anchor's function name to the
    object (None when that function itself is gone)."""
    missing = []
    for anchor in anchors:
        function = resolve(anchor.function)
        if function is None:
            missing.append(anchor)
            continue
        text = _text(function, anchor.signature)
        if (text != anchor.text) if anchor.signature else not any(t in text for t in (anchor.text, *anchor.or_text)):
            missing.append(anchor)
    return missing


def anchor_error(package: str, anchor: Anchor, where: str = "") -> IncompatibleVersionError:
    """A missing anchor: the package, its version and the tested range, and the fix. A tested version without the
    anchor is not that release's source (a fork, a development build, an edited install): reinstalling it fixes it."""
    if is_tested(package):
        fix = (f"this {package} is a tested version, so its installed source is not that release's (a fork, a "
               f"development build or an edited file): reinstall it, pip install --force-reinstall --no-deps "
               f"'{package}=={installed_version(package)}'")
    else:
        fix = f"install a tested version: pip install '{package}{tested_range(package)}'"
    return IncompatibleVersionError(
        f"unsloth_adaptive_kl cannot patch {describe(package)}: the anchor "
        f"`{'` or `'.join((anchor.text, *anchor.or_text))}` ({anchor.reason}) was not found in "
        f"{where}{anchor.function}. Adaptive KL cannot be applied; {fix}."
    )


def import_error(package: str, error: ImportError) -> IncompatibleVersionError:
    """The integration of the installed `package` does not import here (the ImportError, quoted): nothing of it can
    be patched. Where the import statement that failed is in `package`'s own source, a tested version fails on what it
    imports (trl 1.9.1 imports torch's FSDPModule, which torch 2.4 and 2.5 lack), so the fix names the untested torch
    or transformers beside it (with both tested, what the ImportError names) rather than the package a reinstall
    would not change. Where it is in this package's source (`failed_import_here`: a name it imports from the package
    or beside it), the message names that line, and with every version tested calls it this package's defect."""
    here, tested, beside = failed_import_here(error), is_tested(package), (OWNER[package],)
    untested = [describe(name, beside) for name in ("torch", "transformers")
                if name != package and is_tested(name, beside) is False]
    if here:
        cause = f"this package's integration could not import what it needs from {package} or beside it, at {here}"
        if tested is False:
            untested.insert(0, describe(package))
        fix = (f"install tested versions ({', '.join(untested)})" if untested else "with tested versions this is a "
               "defect of unsloth_adaptive_kl: please report it with this message")
        if tested is False:
            fix += f": pip install '{package}{tested_range(package)}'"
    elif tested:
        cause = "importing it failed"
        fix = (f"this {package} is a tested version, so what fails is what it imports: "
               + (f"install tested versions beside it ({', '.join(untested)})" if untested else
                  "install what the ImportError names"))
    else:
        cause = "importing it failed"
        fix = f"install a tested version: pip install '{package}{tested_range(package)}'"
    return IncompatibleVersionError(
        f"unsloth_adaptive_kl cannot patch {describe(package)}: {cause} ({type(error).__name__}: {error}). "
        f"Adaptive KL cannot be applied; {fix}."
    )


def failed_import_here(error: ImportError) -> Optional[str]:
    """'unsloth_adaptive_kl/integrations/ref_sync.py:31' where the import statement that raised `error` is in this
    package's source (the innermost frame but importlib's frozen ones), else None (the import failed inside the
    imported package). This package imports by statements, never through importlib.import_module, whose frame would
    be the innermost."""
    frames = [(frame.f_code.co_filename, line) for frame, line in traceback.walk_tb(error.__traceback__)
              if not frame.f_code.co_filename.startswith("<frozen ")]
    if not frames:
        return None
    path, line = Path(frames[-1][0]).resolve(), frames[-1][1]
    return f"{path.relative_to(PACKAGE_ROOT.parent).as_posix()}:{line}" if path.is_relative_to(PACKAGE_ROOT) else None


def check_anchors(package: str | Callable[[Anchor], str], anchors: tuple[Anchor, ...], resolve: Callable[[str], Any],
                  where: str = "") -> None:
    """Raise IncompatibleVersionError for the first missing anchor, naming the package it belongs to (`package`, or
    `package(anchor)` where the anchors belong to several); else warn once per version outside the tested range."""
    owner = package if callable(package) else (lambda anchor: package)
    missing = missing_anchors(anchors, resolve)
    if missing:
        raise anchor_error(owner(missing[0]), missing[0], where)
    for name in dict.fromkeys(map(owner, anchors)):
        warn_if_untested(name)


def warn_if_untested(package: str) -> None:
    """One UntestedVersionWarning per (package, version) outside the tested range, or with no version to read (a
    source checkout on the path, importable without its package metadata)."""
    try:
        version: Version | str | None = installed_version(package)
    except importlib.metadata.PackageNotFoundError:
        version = None
    found = f"{package}=={version}" if version is not None else f"{package} of unknown version (no package metadata)"
    if (version is None or not in_tested_range(package, version)) and (package, str(version)) not in _warned:
        _warned.add((package, str(version)))
        warnings.warn(
            f"unsloth_adaptive_kl is untested with {found} (tested: {package}{tested_range(package)}); every "
            "anchor it relies on was found, so it is applied. `python -m unsloth_adaptive_kl` checks it on this machine.",
            UntestedVersionWarning,
            stacklevel=4,
        )


def unsloth_bnpo_rule(installed_source: str) -> str:
    """'global' or 'micro_batch': how the installed grpo_compute_loss reduces bnpo given num_items_in_batch."""
    for text, rule in UNSLOTH_BNPO_RULES.items():
        if text in installed_source:
            return rule
    raise anchor_error("unsloth_zoo", Anchor("grpo_compute_loss", " or ".join(UNSLOTH_BNPO_RULES), "the bnpo reduction"),
                       "Unsloth's generated trainer: ")
