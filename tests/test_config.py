"""Config fields on trl.GRPOConfig: defaults, validation messages, CLI/YAML, to_dict, pickling (SPEC 2)."""

from __future__ import annotations

import math
import pickle
import re
from typing import Any

import numpy as np
import pytest
import trl
from trl import TrlParser

import unsloth_adaptive_kl
from unsloth_adaptive_kl import AdaptiveKLConfig
from unsloth_adaptive_kl.core.config import parse_methods
from unsloth_adaptive_kl.core.config import ADAPTIVE_KL_FIELDS

from .conftest import PROMPTS, grpo_args, hash_reward

DEFAULTS = {
    "kl_adaptation_method": "none",
    "kl_clip_threshold": 1.0,
    "kl_target": 0.1,
    "dynamic_beta_decay": 0.9,
    "reward_threshold": 0.8,
    "beta_min": 0.0,
    "beta_schedule_steps": 1000,
    "kl_estimator": None,  # the placement's own: k3 in the loss, k1 in the reward (SPEC 3.12)
    "kl_percentile": 0.2,
    "kl_percentile_scale": 5.0,
    "kl_reduction": "loss_type",
    "kl_horizon": 10000.0,
    "beta_max": None,
    "kl_target_measure": "token_mean",
    "kl_placement": "loss",
    "ref_model_sync_kl": None,
    "ref_model_sync_reset_optimizer": False,
}

BAD_VALUES = [
    ("kl_adaptation_method", "clipp", "one or more of clip, sigmoid, "),  # registered methods follow the built-ins
    ("kl_adaptation_method", "", "one or more of"),
    ("kl_adaptation_method", "clip+sigmoid", "at most one of clip/sigmoid"),
    ("kl_adaptation_method", ["sigmoid", "clip"], "at most one of clip/sigmoid"),
    ("kl_adaptation_method", "none+clip", "one or more of"),
    ("kl_adaptation_method", "clip+clip", "each method at most once"),
    ("kl_adaptation_method", 3, "one or more of"),
    ("kl_adaptation_method", "dynamic+", "one or more of"),
    ("kl_clip_threshold", 0.0, "a finite number > 0"),
    ("kl_clip_threshold", -1.0, "a finite number > 0"),
    ("kl_clip_threshold", math.nan, "a finite number > 0"),
    ("kl_clip_threshold", math.inf, "a finite number > 0"),
    ("kl_clip_threshold", "1.0", "a finite number > 0"),
    # the rule where target reads it too, so that the value it suggests is not refused next ("0 is invalid ... > 0")
    ("kl_target", -0.1, "a finite number >= 0 (> 0 with kl_adaptation_method target)"),
    ("kl_target", math.nan, "a finite number >= 0"),
    # a number, but not a Python one: it read "kl_target=np.float32(0.5) is invalid: allowed is a finite number >= 0"
    ("kl_target", np.float32(0.5), "a finite number >= 0 (> 0 with kl_adaptation_method target), as a Python int or "
                                   "float (this is a numpy.float32: pass float(...))."),
    ("dynamic_beta_decay", 0.0, "0 < x <= 1"),
    ("dynamic_beta_decay", 1.5, "0 < x <= 1"),
    ("dynamic_beta_decay", -0.5, "0 < x <= 1"),
    ("reward_threshold", math.nan, "a finite number"),
    ("reward_threshold", math.inf, "a finite number"),
    ("beta_min", -0.01, "0 <= beta_min <= beta=0.04"),
    ("beta_min", 0.5, "0 <= beta_min <= beta=0.04"),
    ("beta_min", True, "0 <= beta_min"),
    ("beta_min", math.inf, "a finite number with 0 <= beta_min"),  # it read "a number with 0 <= ...": inf allowed?
    ("beta_schedule_steps", 0, "an integer >= 1, or None"),
    ("beta_schedule_steps", -5, "an integer >= 1, or None"),
    ("beta_schedule_steps", 2.5, "an integer >= 1, or None"),
    ("beta_schedule_steps", True, "an integer >= 1, or None"),
    ("beta_schedule_steps", np.int64(10), "an integer >= 1, or None for no cut-off, as a Python int (this is "
                                          "a numpy.int64: pass int(...))."),
    ("beta_max", 0.02, "None or a finite number >= beta_min=0.0 and >= beta=0.04"),  # target would cut beta at once
    ("kl_percentile", 0.0, "a number with 0 < x <= 1"),  # would keep one token, whatever the batch
    ("kl_percentile_scale", 0.0, "a finite number > 0"),  # would zero the KL term
    ("kl_horizon", 0.0, "a finite number > 0"),  # target's update would divide by zero mid-training
    ("beta", -0.1, "a finite number >= 0"),  # TRL's own field: named, not the beta_min it bounds
    ("beta", math.nan, "a finite number >= 0"),
    ("beta", math.inf, "a finite number >= 0"),  # refused with the config, not when the trainer is built
]


def test_defaults_on_patched_grpo_config(tmp_path) -> None:
    args = grpo_args(str(tmp_path))
    assert isinstance(args, unsloth_adaptive_kl.GRPOConfig)
    assert {name: getattr(args, name) for name in ADAPTIVE_KL_FIELDS} == DEFAULTS
    assert set(ADAPTIVE_KL_FIELDS) == set(DEFAULTS)
    assert trl.trainer.grpo_trainer.GRPOConfig is trl.GRPOConfig is unsloth_adaptive_kl.GRPOConfig
    assert args.estimator == "k3" and args.is_stock_kl
    # help(GRPOConfig), and the config source Unsloth generates from the docstring, document both sets of fields
    doc = unsloth_adaptive_kl.GRPOConfig.__doc__
    assert unsloth_adaptive_kl.integrations.trl.StockGRPOConfig.__doc__ in doc and AdaptiveKLConfig.__doc__ in doc


def test_estimator_default_follows_the_placement_on_the_command_line(tmp_path) -> None:
    """SPEC 3.12 through TrlParser: unset, the reward placement's estimator is k1 (stored as None, so to_dict() keeps
    'unset'); k3 named there is kept and warns, naming the field, the value and the fix."""
    parser = TrlParser((trl.GRPOConfig,))
    common = ["--output_dir", str(tmp_path), "--use_cpu", "--report_to", "none", "--kl_placement", "reward"]
    (args,) = parser.parse_args_and_config(common)
    assert (args.kl_estimator, args.estimator, args.to_dict()["kl_estimator"]) == (None, "k1", None)
    with pytest.warns(unsloth_adaptive_kl.KLEstimatorWarning,
                      match=r"^kl_estimator='k3' with kl_placement='reward': .* Use kl_estimator='k1' "):
        (args,) = parser.parse_args_and_config(common + ["--kl_estimator", "k3"])
    assert (args.kl_estimator, args.estimator) == ("k3", "k3")
    # TrlParser reads an Optional[str] field as text: "--kl_estimator None" was refused as kl_estimator='None', "is
    # invalid: allowed is None"; it is None, the placement's default
    (args,) = parser.parse_args_and_config(common + ["--kl_estimator", "None"])
    assert (args.kl_estimator, args.estimator, args.to_dict()["kl_estimator"]) == (None, "k1", None)


@pytest.mark.parametrize(("field", "value", "allowed"), BAD_VALUES, ids=[f"{f}={v!r}" for f, v, _ in BAD_VALUES])
def test_bad_value_rejected_at_construction(tmp_path, field: str, value, allowed: str) -> None:
    with pytest.raises(ValueError) as error:
        grpo_args(str(tmp_path), **{field: value})
    message = str(error.value)
    assert message.startswith(f"{field}={value!r} is invalid: allowed is ")
    assert allowed in message


def test_bad_value_rejected_by_standalone_config() -> None:
    with pytest.raises(ValueError, match=r"kl_target=-1 is invalid: allowed is a finite number >= 0"):
        AdaptiveKLConfig(kl_target=-1)


@pytest.mark.parametrize(("fields", "message"), [
    (dict(kl_adaptation_method="target", kl_target=0.0),
     "kl_target=0.0 is invalid: allowed is a finite number > 0 with kl_adaptation_method target."),
    (dict(kl_adaptation_method="length_normalized", kl_reduction="token_mean"),  # would drop the length normalisation
     "kl_reduction='token_mean' is invalid: allowed is 'loss_type' or 'sequence_mean' with kl_adaptation_method "
     "length_normalized."),
    (dict(ref_model_sync_kl=0.0), "ref_model_sync_kl=0.0 is invalid: allowed is None or a finite number > 0."),
])
def test_a_combination_that_would_divide_by_zero_or_drop_a_method_is_refused(fields: dict, message: str) -> None:
    with pytest.raises(ValueError) as raised:
        AdaptiveKLConfig(**fields)
    assert str(raised.value) == message


def test_methods_given_as_list_or_string_are_canonical(tmp_path) -> None:
    assert parse_methods("none") == ()
    assert parse_methods(" length_normalized + dynamic ") == ("length_normalized", "dynamic")
    args = grpo_args(str(tmp_path), kl_adaptation_method=["dynamic", "length_normalized", "sigmoid"])
    assert args.kl_adaptation_method == "sigmoid+length_normalized+dynamic"
    assert args.kl_methods == ("sigmoid", "length_normalized", "dynamic")


def test_to_dict_pickle_and_saved_training_args(tmp_path) -> None:
    args = grpo_args(str(tmp_path), kl_adaptation_method="dynamic+clip", kl_clip_threshold=0.5, beta_schedule_steps=None)
    as_dict = args.to_dict()
    assert as_dict["kl_adaptation_method"] == "clip+dynamic"
    assert as_dict["kl_clip_threshold"] == 0.5 and as_dict["beta_schedule_steps"] is None
    restored = pickle.loads(pickle.dumps(args))
    assert type(restored) is type(args)
    assert {n: getattr(restored, n) for n in ADAPTIVE_KL_FIELDS} == {n: getattr(args, n) for n in ADAPTIVE_KL_FIELDS}


def test_trl_parser_cli_round_trip(tmp_path) -> None:
    parser = TrlParser((trl.GRPOConfig,))
    (args,) = parser.parse_args_and_config(
        [
            "--output_dir", str(tmp_path), "--use_cpu", "--report_to", "none", "--beta", "0.1",
            "--kl_adaptation_method", "dynamic+length_normalized", "--kl_clip_threshold", "2.5",
            "--kl_target", "0.3", "--dynamic_beta_decay", "0.5", "--reward_threshold", "0.25",
            "--beta_min", "0.01", "--beta_schedule_steps", "7",
        ]
    )
    assert isinstance(args, unsloth_adaptive_kl.GRPOConfig)
    assert (args.kl_adaptation_method, args.kl_clip_threshold, args.kl_target) == ("length_normalized+dynamic", 2.5, 0.3)
    assert (args.dynamic_beta_decay, args.reward_threshold, args.beta_min, args.beta_schedule_steps) == (0.5, 0.25, 0.01, 7)


def test_beta_schedule_steps_none_parses_with_trl_parser_and_yaml_not_plain_hfargumentparser(tmp_path, capsys) -> None:
    """What the configuration page says of the one field whose None differs from its default: TrlParser and YAML's
    null set it; transformers' HfArgumentParser reads an optional integer as an integer and stops on 'None'."""
    from transformers import HfArgumentParser

    argv = ["--output_dir", str(tmp_path), "--use_cpu", "--report_to", "none", "--kl_adaptation_method", "dynamic",
            "--beta_schedule_steps", "None"]
    (args,) = TrlParser((trl.GRPOConfig,)).parse_args_and_config(argv)
    assert args.beta_schedule_steps is None
    config_file = tmp_path / "grpo.yaml"
    config_file.write_text(f"output_dir: {tmp_path}\nuse_cpu: true\nkl_adaptation_method: dynamic\n"
                           "beta_schedule_steps: null\n")
    (args,) = TrlParser((trl.GRPOConfig,)).parse_args_and_config(["--config", str(config_file)])
    assert args.beta_schedule_steps is None
    with pytest.raises(SystemExit):
        HfArgumentParser((trl.GRPOConfig,)).parse_args_into_dataclasses(argv)
    assert "argument --beta_schedule_steps/--beta-schedule-steps: invalid int value: 'None'" in capsys.readouterr().err


def test_trl_parser_yaml_round_trip_and_cli_error(tmp_path) -> None:
    config_file = tmp_path / "grpo.yaml"
    config_file.write_text(
        f"output_dir: {tmp_path}\nuse_cpu: true\nreport_to: none\nbeta: 0.2\n"
        "kl_adaptation_method: sigmoid+dynamic\nkl_target: 0.05\nbeta_schedule_steps: 3\n"
    )
    parser = TrlParser((trl.GRPOConfig,))
    (args,) = parser.parse_args_and_config(["--config", str(config_file)])
    assert (args.kl_adaptation_method, args.kl_target, args.beta_schedule_steps, args.beta) == ("sigmoid+dynamic", 0.05, 3, 0.2)
    with pytest.raises(ValueError, match=r"dynamic_beta_decay=2.0 is invalid"):
        parser.parse_args_and_config(["--config", str(config_file), "--dynamic_beta_decay", "2"])


def test_validation_runs_once_per_config_and_once_per_trainer(tokenizer, tmp_path, monkeypatch) -> None:
    """Issue 26: constructing the config validates it once, and constructing a trainer from it once more (its
    `AdaptiveKL`, against the trainer's beta, and TRL's own fields with them), not once per layer that reads it. That
    trainer validation is still real: a field set badly after the config was built is refused by the trainer."""
    from datasets import Dataset

    from unsloth_adaptive_kl.integrations import trainer_hooks
    from unsloth_adaptive_kl.integrations import trl as trl_integration
    from unsloth_adaptive_kl.tools.tiny import add_lora, build_tiny_model

    calls = {"adaptive_kl": 0, "trl": 0}
    validate, check = AdaptiveKLConfig.validate_adaptive_kl, trainer_hooks.check_trl_settings

    def counted_validate(self: AdaptiveKLConfig, *args: Any, **kwargs: Any) -> None:
        calls["adaptive_kl"] += 1
        validate(self, *args, **kwargs)

    def counted_check(*args: Any) -> None:
        calls["trl"] += 1
        check(*args)

    monkeypatch.setattr(AdaptiveKLConfig, "validate_adaptive_kl", counted_validate)
    for module in (trainer_hooks, trl_integration):
        monkeypatch.setattr(module, "check_trl_settings", counted_check)

    args = grpo_args(str(tmp_path), kl_adaptation_method="clip", sync_ref_model=True, ref_model_sync_steps=1,
                     ref_model_mixup_alpha=1.0)
    assert calls == {"adaptive_kl": 1, "trl": 1}

    def trainer() -> Any:
        return trl.GRPOTrainer(model=add_lora(build_tiny_model(tokenizer, seed=0), seed=0), processing_class=tokenizer,
                               reward_funcs=[hash_reward], args=args, train_dataset=Dataset.from_dict({"prompt": PROMPTS}))

    built = trainer()
    assert calls == {"adaptive_kl": 2, "trl": 2}
    assert built.adaptive_kl.config.kl_methods == ("clip",) and built.adaptive_kl_reference is not None
    args.kl_clip_threshold = -1.0
    with pytest.raises(ValueError, match=r"^kl_clip_threshold=-1.0 is invalid: allowed is a finite number > 0"):
        trainer()
    assert calls == {"adaptive_kl": 3, "trl": 2}


@pytest.mark.parametrize(("fields", "adapted"), [
    ({}, []),
    ({"kl_adaptation_method": ["none"]}, []),  # a list naming no method is 'none'
    ({"kl_estimator": "k3"}, []),  # the trainer's own estimator, named
    ({"kl_adaptation_method": "clip"}, ["kl_adaptation_method='clip'"]),
    ({"kl_estimator": "k1", "kl_reduction": "token_mean"}, ["kl_estimator='k1'", "kl_reduction='token_mean'"]),
    ({"kl_placement": "reward"}, ["kl_placement='reward'"]),  # k1 by default there: the placement alone is named
])
def test_the_stock_kl_is_exactly_no_adapted_field(fields, adapted) -> None:
    """`is_stock_kl` (the trainer's own KL term, kept as the trainer computes it) and `adapted_fields` (what the beta=0
    warning names) are one table: stock exactly when no field is named."""
    config = AdaptiveKLConfig(**fields)
    assert (config.adapted_fields(), config.is_stock_kl) == (adapted, not adapted)


def test_numpys_float64_is_a_float_and_its_float32_is_refused_saying_so() -> None:
    """The rule `is_real` states: np.float64 subclasses float (json writes it as one), so a field takes it and keeps
    the same number; np.float32 is refused naming its type (float(np.float32(0.1)) is 0.10000000149...)."""
    assert AdaptiveKLConfig(kl_adaptation_method="clip", kl_clip_threshold=np.float64(0.5)).kl_clip_threshold == 0.5
    with pytest.raises(ValueError, match=re.escape("kl_clip_threshold=np.float32(0.5) is invalid: allowed is a finite "
                                                   "number > 0, as a Python int or float (this is a numpy.float32: "
                                                   "pass float(...)).")):
        AdaptiveKLConfig(kl_adaptation_method="clip", kl_clip_threshold=np.float32(0.5))
