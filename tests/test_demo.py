"""The demo's --quick path: files, table and metrics with the SPEC meaning (issue: demo)."""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

DEMO = Path(__file__).parents[1] / "blackwell" / "test_adaptive_kl_grpo.py"


@pytest.fixture(autouse=True)
def in_tmp_path(tmp_path, monkeypatch) -> None:
    """Each test in its own folder: parse_args creates --output-dir, by default adaptive_kl_demo_output/ in the
    working directory, which would otherwise be the checkout."""
    monkeypatch.chdir(tmp_path)


def test_the_demo_runs_as_a_module_from_an_installed_package_and_records_that_command(tmp_path) -> None:
    """A wheel has no blackwell/ script: `python -m unsloth_adaptive_kl.tools.demo` is the same demo (it did nothing,
    with exit status 0, when the module had no __main__ block)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ADAPTIVE_KL_COMMIT": "0123456"}
    argv = ["--quick", "--methods", "none", "--pretrain-steps", "2", "--output-dir", str(tmp_path)]
    result = subprocess.run([sys.executable, "-m", "unsloth_adaptive_kl.tools.demo", *argv], cwd=tmp_path,
                            capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["environment"]["command"] == "python -m unsloth_adaptive_kl.tools.demo " + " ".join(argv)
    assert summary["environment"]["commit"] == "0123456"  # the commit it ran at (source_commit)
    assert [row["method"] for row in summary["summary"]] == ["none"]


def strict_json(path: Path) -> Any:
    """The file's JSON, refusing the NaN and Infinity Python writes by default and other readers refuse."""
    def refuse(constant: str) -> None:
        raise AssertionError(f"{path.name} holds {constant}, which is not JSON")

    return json.loads(path.read_text(), parse_constant=refuse)


def test_quick_demo_writes_table_plot_and_metrics(tmp_path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "160"}
    result = subprocess.run([sys.executable, str(DEMO), "--quick", "--output-dir", str(tmp_path)],
                            capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    for method in ["none", "beta=0", "clip", "sigmoid", "length_normalized", "dynamic", "dynamic+length_normalized"]:
        assert f"│ {method} " in result.stdout
    # beta=0 has no KL to measure: its KL cells read "(off)", and no cell reads nan
    beta0_line = next(line for line in result.stdout.splitlines() if "│ beta=0 " in line)
    assert beta0_line.count("(off)") == 3 and "nan" not in result.stdout
    png = (tmp_path / "adaptive_kl_comparison.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000
    rows = list(csv.DictReader((tmp_path / "metrics.csv").open()))
    assert len(rows) == 7 * 4  # 7 methods x 1 seed x 4 steps
    # the same rows; a NaN (never logged) is "nan" in the CSV and null in the JSON, which has no NaN
    assert rows == [{k: "nan" if v is None else str(v) for k, v in row.items()}
                    for row in strict_json(tmp_path / "metrics.json")]
    strict_json(tmp_path / "summary.json")
    by_method: dict[str, list[dict]] = {}
    for row in rows:
        by_method.setdefault(row["method"], []).append({k: float(v) for k, v in row.items() if k != "method"})
    assert all(row["adaptive_kl/raw_kl"] == row["adaptive_kl/adapted_kl"] for row in by_method["none"])
    assert all(math.isnan(row["adaptive_kl/raw_kl"]) for row in by_method["beta=0"])
    # In 4 steps from this reference the reward stays below dynamic's reward_threshold (0.8), so its beta never decays,
    # and no token's KL reaches clip's kl_clip_threshold (1.0): neither method acts, and each run is stock's (`none`,
    # the same seed and data) in every logged value, not merely "beta non-increasing" or "adapted <= raw". Up to
    # rounding: the methods take the per-token KL on the package's path, stock on the trainer's.
    assert max(row["reward"] for row in by_method["dynamic"]) <= 0.8
    assert [row["adaptive_kl/current_beta"] for row in by_method["dynamic"]] == [0.04] * 4
    keys = [key for key in by_method["none"][0] if key != "step_time"]
    for method in ("clip", "dynamic"):
        for row, stock in zip(by_method[method], by_method["none"], strict=True):
            for key in keys:
                assert (math.isnan(row[key]) and math.isnan(stock[key])) or row[key] == pytest.approx(
                    stock[key], rel=1e-5, abs=1e-12), (method, row["step"], key)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [item["method"] for item in summary["summary"]] == list(by_method)
    assert summary["settings"]["learning_rate"] == 5e-3  # the rate the runs used, not null for "the default"


def test_quick_kl_in_reward_comparison(tmp_path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "160"}
    result = subprocess.run([sys.executable, str(DEMO), "--quick", "--kl-in-reward", "--output-dir", str(tmp_path)],
                            capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    variants = ["none", "reward:sequence_mean", "reward:sequence_sum", "reward:sequence_sum:target", "beta=0"]
    for variant in variants:
        assert f"│ {variant} " in result.stdout
    rows = [{k: (v if k == "method" else float(v)) for k, v in row.items()}
            for row in csv.DictReader((tmp_path / "metrics.csv").open())]
    assert [row["method"] for row in rows] == [v for v in variants for _ in range(4)]
    for row in rows:
        if row["method"].startswith("reward:"):  # the penalty is beta * the mean KL_i of the batch
            assert row["adaptive_kl/reward_penalty"] == pytest.approx(
                row["adaptive_kl/current_beta"] * row["adaptive_kl/adapted_kl"], rel=1e-5, abs=1e-12)
        else:  # the KL as a loss term, or off: no penalty in the reward
            assert math.isnan(row["adaptive_kl/reward_penalty"])
    summed = [row for row in rows if row["method"] == "reward:sequence_sum"]
    assert all(row["adaptive_kl/raw_kl"] == pytest.approx(row["adaptive_kl/sequence_kl"], rel=1e-6) for row in summed)


def test_bad_kl_in_reward_variant_fails_before_training(tmp_path) -> None:
    result = subprocess.run([sys.executable, str(DEMO), "--quick", "--methods", "reward:token_mean",
                             "--output-dir", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "kl_reduction='token_mean' is invalid" in result.stderr and "kl_placement='reward'" in result.stderr
    assert not (tmp_path / "metrics.csv").exists()


def test_bad_method_fails_before_training(tmp_path) -> None:
    result = subprocess.run([sys.executable, str(DEMO), "--quick", "--methods", "clip+sigmoid",
                             "--output-dir", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "kl_adaptation_method='clip+sigmoid' is invalid" in result.stderr
    assert not (tmp_path / "metrics.csv").exists()


def test_bad_loss_type_fails_before_training(tmp_path) -> None:
    result = subprocess.run([sys.executable, str(DEMO), "--quick", "--loss-type", "nope",
                             "--output-dir", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "--loss-type='nope' is invalid: allowed is one of bnpo, cispo, dapo" in result.stderr


def test_quick_keeps_the_steps_seeds_and_pretraining_given_beside_it() -> None:
    """--quick --steps 10 ran 4 steps, and summary.json's command (--steps 10) contradicted its settings (4)."""
    from unsloth_adaptive_kl.tools import demo

    args = demo.parse_args(["--quick", "--steps", "10"])
    assert (args.steps, args.seeds, args.pretrain_steps) == (10, 1, 60)
    args = demo.parse_args(["--quick", "--seed", "2", "--pretrain-steps=7"])  # an abbreviation, the = form
    assert (args.steps, args.seeds, args.pretrain_steps) == (4, 2, 7)
    args = demo.parse_args(["--steps", "10"])
    assert (args.steps, args.seeds, args.pretrain_steps) == (10, 3, 300)


def test_a_model_that_cannot_be_loaded_stops_the_demo_after_its_first_run(tmp_path, monkeypatch, capsys) -> None:
    """A hub name without the network: each run retried the hub (about a minute each, 21 runs by default) and failed
    alike. The first load's OSError stops the demo, saying so, with exit 1."""
    import transformers

    from unsloth_adaptive_kl.tools import demo

    loads = []

    def offline(name, **kwargs):
        loads.append(name)
        raise OSError(f"We couldn't connect to 'https://huggingface.co' to load the files of {name}")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda name, **kwargs: "tokenizer")
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", offline)
    code = demo.main(["--model", "org/model", "--backend", "trl", "--methods", "none,clip", "--seeds", "2",
                      "--steps", "1", "--output-dir", str(tmp_path)])
    assert code == 1 and loads == ["org/model"]
    err = capsys.readouterr().err
    assert ("FAILED none seed 0: ModelNotLoaded: --model 'org/model' could not be loaded: OSError: We couldn't "
            "connect") in err
    assert "FAILED the remaining runs: not started, --model 'org/model' could not be loaded" in err


def test_a_tokenizer_that_cannot_be_loaded_is_reported_by_the_flag_without_a_traceback(tmp_path) -> None:
    """The trl backend (the default on a CPU) loads the tokenizer once, before the runs: a name that cannot be loaded
    ended in transformers' traceback there. Offline, a name not in the cache fails at once, with no network."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    result = subprocess.run([sys.executable, str(DEMO), "--model", "no-such-org/no-such-model", "--backend", "trl",
                             "--methods", "none", "--steps", "1", "--seeds", "1", "--output-dir", str(tmp_path)],
                            capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 1, result.stderr[-3000:]
    assert "FAILED --model 'no-such-org/no-such-model' could not be loaded: OSError: " in result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "metrics.csv").exists()


def test_an_os_error_of_a_run_is_not_blamed_on_the_model(tmp_path, monkeypatch, capsys) -> None:
    """Any OSError of the first run (here creating its folder) was reported as "--model could not be loaded" and
    stopped the demo: only a failure to load the model says so; the other runs still run."""
    from unsloth_adaptive_kl.tools import demo

    ran = []

    def run_one(task, method, seed, args, on_step):
        ran.append(method)
        if method == "none":
            raise PermissionError(f"[Errno 13] Permission denied: '{tmp_path}/runs'")
        return []

    monkeypatch.setattr(demo, "model_task", lambda args: "task")
    monkeypatch.setattr(demo, "run_one", run_one)
    code = demo.main(["--model", "org/model", "--methods", "none,clip", "--steps", "1", "--seeds", "1",
                      "--output-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 1 and ran == ["none", "clip"]
    assert "FAILED none seed 0: PermissionError: [Errno 13] Permission denied" in err
    assert "could not be loaded" not in err


def test_an_unusable_output_dir_is_refused_before_training(tmp_path, monkeypatch, capsys) -> None:
    """The folder was first used after all training: the runs failed creating runs/ in it, then writing the files
    crashed with a traceback (FileNotFoundError for '', FileExistsError for a file). A path under a regular file is
    unwritable whoever runs the test (root included)."""
    from unsloth_adaptive_kl.tools import demo

    (tmp_path / "file").write_text("")
    monkeypatch.setattr(demo, "tiny_task", lambda args: pytest.fail("training started"))
    for value, error in (("", "FileNotFoundError"), (str(tmp_path / "file"), "FileExistsError"),
                         (str(tmp_path / "file" / "sub"), "NotADirectoryError")):
        with pytest.raises(SystemExit) as refused:
            demo.main(["--quick", "--methods", "none", "--output-dir", value])
        err = capsys.readouterr().err
        assert refused.value.code == 2 and f"--output-dir={value!r} is invalid ({error}: " in err
        assert "allowed is a writable directory" in err
    assert demo.parse_args(["--output-dir", str(tmp_path / "new" / "folder")])  # created, as the runs need it
    assert (tmp_path / "new" / "folder").is_dir() and not list((tmp_path / "new" / "folder").iterdir())


def test_failed_runs_are_reported_before_the_files_are_written(tmp_path, monkeypatch, capsys) -> None:
    """The FAILED lines came after writing the files: a failure there (a full disk) hid which runs had failed."""
    from unsloth_adaptive_kl.tools import demo

    def run_one(task, method, seed, args, on_step):
        raise RuntimeError("boom")

    def write_outputs(*args):
        raise OSError("[Errno 28] No space left on device")

    monkeypatch.setattr(demo, "tiny_task", lambda args: "task")
    monkeypatch.setattr(demo, "run_one", run_one)
    monkeypatch.setattr(demo, "write_outputs", write_outputs)
    with pytest.raises(OSError, match="No space left"):
        demo.main(["--quick", "--methods", "none", "--output-dir", str(tmp_path)])
    assert "FAILED none seed 0: RuntimeError: boom" in capsys.readouterr().err


def test_a_failed_run_is_reported_and_makes_the_exit_code_non_zero(tmp_path, monkeypatch, capsys) -> None:
    from unsloth_adaptive_kl.tools import demo

    real_run_one = demo.run_one

    def run_one(task, method, seed, args, on_step):
        if method == "sigmoid":
            raise RuntimeError("boom")
        return real_run_one(task, method, seed, args, on_step)

    monkeypatch.setattr(demo, "run_one", run_one)
    code = demo.main(["--quick", "--methods", "none,sigmoid", "--pretrain-steps", "5", "--output-dir", str(tmp_path)])
    assert code == 1
    assert "FAILED sigmoid seed 0: RuntimeError: boom" in capsys.readouterr().err
    rows = list(csv.DictReader((tmp_path / "metrics.csv").open()))
    assert {row["method"] for row in rows} == {"none"} and len(rows) == 4


# ----- mixed precision on a GPU: bf16 only where the GPU has it natively (a Colab T4 does not) ------------------

def fake_device(monkeypatch, cuda: bool, bf16: bool) -> list[dict]:
    """Fakes torch.cuda's answers; returns the keyword arguments each is_bf16_supported call got."""
    calls: list[dict] = []

    def is_bf16_supported(**kwargs) -> bool:
        calls.append(kwargs)
        return bf16

    monkeypatch.setattr("torch.cuda.is_available", lambda: cuda)
    monkeypatch.setattr("torch.cuda.is_bf16_supported", is_bf16_supported)
    return calls


def test_mixed_precision_is_bf16_on_a_gpu_with_bf16(monkeypatch) -> None:
    from unsloth_adaptive_kl.tools import demo

    calls = fake_device(monkeypatch, cuda=True, bf16=True)
    assert demo.mixed_precision() == {"bf16": True, "fp16": False}
    assert calls == [{"including_emulation": False}]  # emulated bf16 (torch's default answer on a T4) does not count


def test_mixed_precision_is_fp16_on_a_t4_like_gpu(monkeypatch) -> None:
    from unsloth_adaptive_kl.tools import demo

    fake_device(monkeypatch, cuda=True, bf16=False)
    assert demo.mixed_precision() == {"bf16": False, "fp16": True}


def test_mixed_precision_is_neither_on_cpu(monkeypatch) -> None:
    from unsloth_adaptive_kl.tools import demo

    fake_device(monkeypatch, cuda=False, bf16=True)  # is_bf16_supported is not even asked without CUDA
    assert demo.mixed_precision() == {"bf16": False, "fp16": False}


def test_the_model_path_passes_mixed_precision_into_grpo_config(monkeypatch) -> None:
    """model_task (the GPU path) -> task.grpo_settings -> run_one -> trl.GRPOConfig, faking a T4; no download."""
    import transformers
    import trl

    from unsloth_adaptive_kl.tools import demo

    import peft

    fake_device(monkeypatch, cuda=True, bf16=False)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda name, **kwargs: f"tokenizer:{name}")
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda name, **kwargs: f"model:{name}")
    monkeypatch.setattr(peft, "get_peft_model", lambda model, config: f"lora:{model}")
    args = demo.parse_args(["--model", "org/some-model", "--backend", "trl", "--steps", "1", "--seeds", "1"])
    task = demo.model_task(args)
    assert task.make_policy(0) == ("lora:model:org/some-model", "tokenizer:org/some-model")
    assert task.trainer_class is trl.GRPOTrainer
    assert (task.grpo_settings["bf16"], task.grpo_settings["fp16"]) == (False, True)

    class Built(Exception):
        pass

    def grpo_config(**kwargs):
        raise Built(kwargs)

    monkeypatch.setattr(trl, "GRPOConfig", grpo_config)
    try:
        demo.run_one(task, "clip", 0, args, on_step=lambda: None)
    except Built as built:
        kwargs = built.args[0]
    else:
        raise AssertionError("run_one did not build a GRPOConfig")
    assert (kwargs["bf16"], kwargs["fp16"]) == (False, True)
    assert kwargs["kl_adaptation_method"] == "clip" and "answers" not in kwargs


# ----- the model path with the unsloth backend: one trainer class for every run, Unsloth's tokenizer -------------

STAND_IN_UNSLOTH = '''"""Stands in for unsloth: importing it replaces trl.GRPOTrainer, as `import unsloth` does with the trainer it
generates; FastLanguageModel loads the tiny model with a tokenizer of its own."""
import string

import trl

from unsloth_adaptive_kl.tools.tiny import add_lora, build_tiny_model, build_tokenizer

BUILT = []  # (trainer class, processing_class, model) of every trainer built


class RecordingGRPOTrainer(trl.GRPOTrainer):
    def __init__(self, *args, **kwargs):
        BUILT.append((type(self), kwargs["processing_class"], kwargs["model"]))
        super().__init__(*args, **kwargs)


trl.GRPOTrainer = RecordingGRPOTrainer
TOKENIZER = build_tokenizer(string.ascii_letters + string.digits + " #:.,!?+-=*/()")
TOKENIZER.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}={% endif %}"
LOADED = []  # (name, kwargs) of every from_pretrained call


class FastLanguageModel:
    @staticmethod
    def from_pretrained(name, **kwargs):
        LOADED.append((name, kwargs))
        return build_tiny_model(TOKENIZER), TOKENIZER

    @staticmethod
    def get_peft_model(model, random_state, **kwargs):
        return add_lora(model, seed=random_state)
'''


def test_the_model_path_with_unsloth_trains_every_run_with_its_trainer_and_tokenizer(tmp_path, monkeypatch) -> None:
    """--model with --backend unsloth: the stand-in swaps trl.GRPOTrainer when the demo imports it; every run, the
    first (`none`) included, is built by the swapped class with FastLanguageModel's own tokenizer."""
    import transformers
    import trl

    from unsloth_adaptive_kl.tools import demo

    (tmp_path / "stand_in").mkdir()
    (tmp_path / "stand_in" / "unsloth.py").write_text(STAND_IN_UNSLOTH)
    assert "unsloth" not in sys.modules
    monkeypatch.syspath_prepend(str(tmp_path / "stand_in"))
    monkeypatch.setattr(trl, "GRPOTrainer", trl.GRPOTrainer)  # restored after the test, whatever the stand-in set

    def no_download(name, **kwargs):
        raise AssertionError(f"the unsloth backend loaded a tokenizer of its own for {name}")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", no_download)
    try:
        code = demo.main(["--model", "stand-in/tiny", "--backend", "unsloth", "--methods", "none,clip", "--steps", "1",
                          "--seeds", "1", "--output-dir", str(tmp_path / "out")])
        stand_in = sys.modules["unsloth"]
    finally:
        sys.modules.pop("unsloth", None)
    assert code == 0
    assert [name for name, _ in stand_in.LOADED] == ["stand-in/tiny", "stand-in/tiny"]  # a fresh policy per run
    assert [cls for cls, _, _ in stand_in.BUILT] == [stand_in.RecordingGRPOTrainer] * 2
    assert all(tokenizer is stand_in.TOKENIZER for _, tokenizer, _ in stand_in.BUILT)
    assert stand_in.BUILT[0][2] is not stand_in.BUILT[1][2]
    rows = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert [row["method"] for row in rows] == ["none", "clip"]


# ----- the moving reference: 'ref_sync:STEPS[:reset]' and --ref-sync ---------------------------------------------

def test_ref_sync_variant_syncs_on_schedule(tmp_path) -> None:
    """A hard reset every 2 of 4 steps on the demo's LoRA model: the sync count follows the schedule, and the step
    after each sync is on-policy against the new reference, so its KL is exactly 0 (stock's is not)."""
    from unsloth_adaptive_kl.tools import demo

    code = demo.main(["--quick", "--methods", "none,ref_sync:2,ref_sync:2:reset", "--pretrain-steps", "5",
                      "--output-dir", str(tmp_path)])
    assert code == 0
    # what produced the run is the argv main was given, not this pytest process's sys.argv
    assert json.loads((tmp_path / "summary.json").read_text())["environment"]["command"] == (
        "python blackwell/test_adaptive_kl_grpo.py --quick --methods none,ref_sync:2,ref_sync:2:reset "
        f"--pretrain-steps 5 --output-dir {tmp_path}")
    rows = json.loads((tmp_path / "metrics.json").read_text())
    by_method = {m: [r for r in rows if r["method"] == m] for m in ("none", "ref_sync:2", "ref_sync:2:reset")}
    assert all(len(v) == 4 for v in by_method.values())
    assert all(r["adaptive_kl/ref_syncs"] is None for r in by_method["none"])  # syncing off: not logged (null)
    stock = [r["adaptive_kl/raw_kl"] for r in by_method["none"]]
    assert stock[0] == 0.0 and all(kl > 0 for kl in stock[1:])
    for method in ("ref_sync:2", "ref_sync:2:reset"):
        synced = by_method[method]
        assert [r["adaptive_kl/ref_syncs"] for r in synced] == [0.0, 1.0, 1.0, 2.0]  # after steps 2 and 4
        raw = [r["adaptive_kl/raw_kl"] for r in synced]
        assert raw[:2] == stock[:2]  # before the first sync: the stock reference, the same run
        assert raw[2] == 0.0 and raw[3] > 0  # step 3: the reference is the policy that generated it
        assert [r["kl"] for r in synced] == raw
    # The optimizer reset changes nothing until the step after the sync (step 3) has updated the weights.
    plain, reset = by_method["ref_sync:2"], by_method["ref_sync:2:reset"]
    keys = [k for k in demo.LOGGED if k != "step_time"]
    assert [[r[k] for k in keys] for r in plain[:3]] == [[r[k] for k in keys] for r in reset[:3]]
    assert plain[3]["adaptive_kl/raw_kl"] != reset[3]["adaptive_kl/raw_kl"]


def test_ref_sync_labels_and_flag(capsys) -> None:
    from unsloth_adaptive_kl.tools import demo

    assert demo.variant_settings("ref_sync:30:reset", 0.04) == {
        "sync_ref_model": True, "ref_model_sync_steps": 30, "ref_model_mixup_alpha": 1.0,
        "ref_model_sync_reset_optimizer": True, "beta": 0.04}
    assert demo.variant_settings("ref_sync:30", 0.04)["ref_model_sync_reset_optimizer"] is False
    assert demo.parse_args(["--ref-sync"]).methods == ["none", "ref_sync:30", "ref_sync:30:reset"]
    labels = ("ref_sync:x", "ref_sync:2:soft", "ref_sync:")
    for flags, message in [*((["--methods", label], f"variant {label!r}: ") for label in labels),
                           (["--methods", "ref_sync:0"], "variant 'ref_sync:0': ref_model_sync_steps=0 is invalid"),
                           (["--methods", "ref_sync:30", "--beta", "0"],
                            "variant 'ref_sync:30': sync_ref_model=True is invalid"),
                           (["--ref-sync", "--kl-in-reward"], "--kl-in-reward and --ref-sync each select")]:
        with pytest.raises(SystemExit) as refused:  # a usage error, exit 2, naming the variant
            demo.parse_args(flags)
        assert refused.value.code == 2 and message in capsys.readouterr().err, flags
    with pytest.raises(SystemExit):
        demo.parse_args(["--methods", "ref_sync:x"])
    assert "'ref_sync:STEPS' or 'ref_sync:STEPS:reset'" in capsys.readouterr().err


def test_bad_flags_fail_before_training_naming_the_flag_the_value_and_what_is_allowed(capsys) -> None:
    """Each was accepted, to fail later or never: a negative beta failed each run after the reference's pretraining;
    a negative learning rate at each run's optimizer; negative pretraining steps pretrained nothing; no variant ran
    nothing; a variant listed twice merged its two runs' rows into one summary line."""
    from unsloth_adaptive_kl.tools import demo

    for flags, message in ((["--learning-rate", "-1"], "--learning-rate=-1.0 is invalid: allowed is a finite number "
                                                       "> 0"),
                           (["--learning-rate", "inf"], "--learning-rate=inf is invalid: allowed is a finite number "
                                                        "> 0"),
                           (["--pretrain-steps", "-3"], "--pretrain-steps=-3 is invalid: allowed is an integer >= 0"),
                           (["--methods", ","], "--methods=',' is invalid: allowed is a comma-separated list of at "
                                                "least one variant"),
                           (["--methods", "none,clip,none"], "variant 'none' is listed twice: allowed is each variant "
                                                             "once"),
                           # an empty name read as "no --model": the tiny demo ran
                           (["--model", ""], "--model='' is invalid: allowed is a model name or path"),
                           (["--model", " "], "--model=' ' is invalid: allowed is a model name or path"),
                           # a part past the method was dropped
                           (["--methods", "reward:sequence_mean:target:extra"],
                            "variant 'reward:sequence_mean:target:extra' is invalid: allowed is 'reward:REDUCTION' or "
                            "'reward:REDUCTION:METHOD'"),
                           # with the KL term off, every variant but beta=0 trains as beta=0 does
                           (["--beta", "0"], "--beta=0.0 turns the KL term off, so variant 'none' would be the "
                                             "same run as 'beta=0': allowed is --beta > 0, or --beta 0 with only the "
                                             "variant 'beta=0'"),
                           (["--beta", "0", "--methods", "beta=0,clip"], "variant 'clip' would be the same run as")):
        with pytest.raises(SystemExit) as refused:
            demo.parse_args(flags)
        assert refused.value.code == 2 and message in capsys.readouterr().err, flags
    for beta in ("-1", "nan"):  # the core's rule and wording, as GRPOConfig(beta=...) refuses it, by the flag's name
        with pytest.raises(SystemExit):
            demo.parse_args(["--beta", beta, "--methods", "none"])
        assert f"--beta={float(beta)} is invalid: allowed is a finite number >= 0" in capsys.readouterr().err
    for flags, message in ((["--kl-target", "-1", "--methods", "sigmoid"],
                            "variant 'sigmoid': kl_target=-1.0 is invalid"),
                           (["--methods", "foo"], "variant 'foo': kl_adaptation_method='foo' is invalid"),
                           (["--estimators", "k9"], "variant 'estimator=k9': kl_estimator='k9' is invalid"),
                           # flags the run would not read: --methods beside a mode that picks its own variants, a
                           # backend or pretraining the chosen model does not have
                           (["--kl-in-reward", "--methods", "clip"], "--methods has no effect with --kl-in-reward"),
                           (["--ref-sync", "--methods", "dynamic"], "--methods has no effect with --ref-sync"),
                           (["--backend", "trl"], "--backend=trl has no effect without --model"),
                           (["--model", "x", "--pretrain-steps", "5"], "--pretrain-steps has no effect with --model")):
        with pytest.raises(SystemExit) as refused:
            demo.parse_args(flags)
        assert refused.value.code == 2 and message in capsys.readouterr().err, flags
    args = demo.parse_args(["--pretrain-steps", "0", "--learning-rate", "0.01", "--methods", "beta=0", "--beta", "0"])
    assert (args.pretrain_steps, args.learning_rate, args.beta) == (0, 0.01, 0.0)  # the edges allowed
    # --learning-rate's default, resolved for the model in use (summary.json records it)
    assert (demo.parse_args([]).learning_rate, demo.parse_args(["--model", "org/m"]).learning_rate) == (5e-3, 5e-6)


def test_two_labels_with_the_same_settings_are_refused(capsys) -> None:
    """Each pair ran the same settings twice, shown as two variants: the variants are keyed on their resolved settings
    (the methods in canonical order, the defaults a label leaves out), not on how the label spells them."""
    from unsloth_adaptive_kl.tools import demo

    for first, second in (("dynamic+length_normalized", "length_normalized+dynamic"),
                          ("dynamic+length_normalized", "dynamic + length_normalized"),
                          ("ref_sync:5", "ref_sync:05"), ("reward:sequence_sum", "reward:sequence_sum:none"),
                          ("none", "kl_reduction=loss_type"), ("none", "estimator=k3")):
        with pytest.raises(SystemExit) as refused:
            demo.parse_args(["--methods", f"clip,{first},{second}"])
        assert refused.value.code == 2, (first, second)
        assert (f"variants {first!r} and {second!r} are the same settings: allowed is each variant once"
                in capsys.readouterr().err)
    assert demo.parse_args(["--methods", "none,ref_sync:5,ref_sync:5:reset,reward:sequence_sum,reward:sequence_mean"])


def test_each_variant_gets_only_the_method_fields_it_reads_and_an_unread_flag_is_refused(capsys) -> None:
    """The demo's `dynamic` settings and `--kl-target` / `--kl-horizon` reach the variants that read them (an unread
    field would warn that it does nothing); a flag that no variant of the run reads is refused by name."""
    from unsloth_adaptive_kl.tools import demo

    args = demo.parse_args(["--methods", "none,sigmoid,dynamic,target", "--kl-target", "0.3", "--kl-horizon", "50"])
    fields = {method: demo.method_fields(demo.variant_settings(method, args.beta), args) for method in args.methods}
    assert fields == {"none": {}, "sigmoid": {"kl_target": 0.3},
                      "dynamic": {"reward_threshold": 0.8, "beta_schedule_steps": None},
                      "target": {"kl_target": 0.3, "kl_horizon": 50.0}}
    for flags, message in ((["--kl-target", "0.3"], "--kl-target=0.3 has no effect: no variant of this run reads "
                                                     "kl_target"),
                           (["--kl-horizon", "50"], "--kl-horizon=50.0 has no effect: no variant of this run reads "
                                                    "kl_horizon"),
                           # given at its default value, it was accepted: the check compared with the default
                           (["--kl-target", "0.1"], "--kl-target=0.1 has no effect: no variant of this run reads "
                                                    "kl_target")):
        with pytest.raises(SystemExit):
            demo.parse_args(["--methods", "none,clip,sigmoid" if "horizon" in flags[0] else "none,clip", *flags])
        assert message in capsys.readouterr().err


def test_the_plot_gives_each_variant_its_own_colour_past_ten(tmp_path, monkeypatch) -> None:
    """matplotlib's colour cycle C0-C9 repeats: with 12 variants the 11th and 12th took the 1st and 2nd's colours."""
    import matplotlib.figure
    from matplotlib.colors import to_rgba

    from unsloth_adaptive_kl.tools import demo

    saved = []
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda figure, *args, **kwargs: saved.append(figure))
    for count in (3, 12):
        methods = [f"variant{index}" for index in range(count)]
        rows = [{"method": method, "seed": 0, "step": step, **{key: float(index) for key in demo.LOGGED}}
                for index, method in enumerate(methods) for step in (1, 2)]
        demo.plot(rows, methods, str(tmp_path / "plot.png"))
        lines = saved[-1].axes[0].lines
        assert [line.get_label() for line in lines] == methods
        assert len({to_rgba(line.get_color()) for line in lines}) == count


def test_the_summary_is_each_seeds_last_tenth_and_their_mean_and_std() -> None:
    """summary.json per variant: each seed's mean over the last 10 % of steps (`by_seed`), and the mean and sample std
    of those (checked by hand: steps 19 and 20 of 20 are the window; a value of seed*10 + step gives 19.5 and 29.5,
    mean 24.5, std sqrt(2 * 5^2 / 1)); a NaN key (beta=0's KL) stays NaN."""
    from unsloth_adaptive_kl.tools.demo import LOGGED, summarise

    rows = [{"method": "a", "seed": seed, "step": step,
             **{key: math.nan if key == "kl" else seed * 10.0 + step for key in LOGGED}}
            for seed in (0, 1) for step in range(1, 21)]
    (item,) = summarise(rows, ["a", "not run"], steps=20)
    assert (item["method"], item["seeds"]) == ("a", 2)
    assert item["completions/mean_length"] == pytest.approx((24.5, math.sqrt(50)))
    assert item["by_seed"]["completions/mean_length"] == [19.5, 29.5] == item["by_seed"]["reward"]
    assert all(math.isnan(v) for v in item["kl"]) and all(math.isnan(v) for v in item["by_seed"]["kl"])
    assert set(item["by_seed"]) == set(LOGGED)


def test_drifted_seeds_counts_each_variants_seeds_nearer_the_unregularised_length() -> None:
    """A seed's length drifted where it ended nearer beta=0's mean (21) than stock's (7): past the midpoint 14. By
    hand: stock 0 of 2, beta=0 2 of 2, x 2 of 3 (13.9 held; 14.1 and 30 drifted). A run without beta=0, or without
    each seed's figures (a summary.json written before `by_seed`), has no count."""
    from unsloth_adaptive_kl.tools.demo import drifted_seeds

    def variant(method: str, lengths: list[float]) -> dict:
        return {"method": method, "completions/mean_length": [sum(lengths) / len(lengths), 0.0],
                "by_seed": {"completions/mean_length": lengths}}

    summary = [variant("none", [6.0, 8.0]), variant("beta=0", [20.0, 22.0]), variant("x", [13.9, 14.1, 30.0])]
    assert drifted_seeds(summary) == {"none": (0, 2), "beta=0": (2, 2), "x": (2, 3)}
    assert drifted_seeds([summary[0], summary[2]]) == {}
    assert drifted_seeds([{k: v for k, v in item.items() if k != "by_seed"} for item in summary]) == {}
