"""The demo's --quick path: files, table and metrics with the SPEC meaning (issue: demo)."""

from __future__ import annotations

import csv
import importlib.metadata
import json
import math
import os
import re
import statistics
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
    args = demo.parse_args(["--quick", "--pretrain-steps", "0"])  # a value given as 0 is given all the same
    assert (args.steps, args.seeds, args.pretrain_steps) == (4, 1, 0)


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

    def read_only(*args, **kwargs):  # a folder this user may not write to (root, running the tests, may write anywhere)
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(demo.tempfile, "TemporaryFile", read_only)
    with pytest.raises(SystemExit) as refused:
        demo.main(["--quick", "--methods", "none", "--output-dir", str(tmp_path)])
    assert refused.value.code == 2 and (f"--output-dir={str(tmp_path)!r} is invalid (PermissionError: [Errno 13] "
                                        "Permission denied): allowed is a writable directory"
                                        ) in capsys.readouterr().err


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


def test_the_runs_are_interleaved_per_seed_and_only_a_first_failed_load_stops_them(tmp_path, monkeypatch,
                                                                                  capsys) -> None:
    """docs/demo.md: methods are interleaved per seed (the machine's drift hits all alike); a --model that cannot be
    loaded stops the demo at its first load, but a load that fails after one succeeded (the model can be loaded)
    stops nothing: the other runs still run, and the demo exits 1."""
    from unsloth_adaptive_kl.tools import demo

    ran = []

    def run_one(task, method, seed, args, on_step):
        ran.append((method, seed))
        if (method, seed) == ("clip", 0):
            raise demo.ModelNotLoaded("--model 'org/model' could not be loaded: OSError: flaky")
        return [{"method": method, "seed": seed, "step": 1, **{key: 1.0 for key in demo.LOGGED}}]

    monkeypatch.setattr(demo, "model_task", lambda args: "task")
    monkeypatch.setattr(demo, "run_one", run_one)
    code = demo.main(["--model", "org/model", "--methods", "none,clip", "--seeds", "2", "--steps", "1",
                      "--output-dir", str(tmp_path)])
    assert code == 1 and ran == [("none", 0), ("clip", 0), ("none", 1), ("clip", 1)]
    err = capsys.readouterr().err
    assert "FAILED clip seed 0: ModelNotLoaded: --model 'org/model' could not be loaded: OSError: flaky" in err
    assert "the remaining runs" not in err
    rows = json.loads((tmp_path / "metrics.json").read_text())
    assert [(row["method"], row["seed"]) for row in rows] == [("none", 0), ("none", 1), ("clip", 1)]


def test_a_run_trains_with_the_flags_settings_in_a_folder_of_its_own(tmp_path) -> None:
    """run_one -> the trainer's GRPOConfig: --loss-type, --steps, the run's seed (the data order too), the variant's
    method fields (--kl-target), temperature 1.0 and its folder runs/VARIANT-seedN/ (docs/demo.md); the policy is
    built after the seed is set, so a seed builds the same policy whatever drew random numbers before."""
    import torch

    from unsloth_adaptive_kl.tools import demo

    class Built(Exception):
        pass

    draws = []

    def make_policy(seed):
        draws.append(torch.rand(()).item())
        return "model", "tokenizer"

    def trainer_class(args, **kwargs):
        raise Built(args)

    task = demo.Task(make_policy, trainer_class, ["ab:"], demo.hash_reward, {"use_cpu": True})
    args = demo.parse_args(["--methods", "sigmoid", "--loss-type", "bnpo", "--kl-target", "0.3", "--steps", "7",
                            "--output-dir", str(tmp_path)])
    configs = []
    for _ in range(2):
        torch.rand(5)  # whatever ran before
        with pytest.raises(Built) as built:
            demo.run_one(task, "sigmoid", 2, args, on_step=lambda: None)
        configs.append(built.value.args[0])
    config = configs[0]
    assert (config.loss_type, config.max_steps, config.seed, config.data_seed, config.temperature) == (
        "bnpo", 7, 2, 2, 1.0)
    assert (config.kl_adaptation_method, config.kl_target, config.beta) == ("sigmoid", 0.3, 0.04)
    assert config.output_dir == str(tmp_path / "runs" / "sigmoid-seed2") and draws[0] == draws[1]


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


# ----- the tiny default task ---------------------------------------------------------------------------------------

def test_the_tiny_reference_text_and_reward_are_the_documented_task() -> None:
    """docs/demo.md: prompts of 2-4 letters of a-h and ':', completions of 3-8 letters, rarely a '#' (at most one, in 1
    of 10 by construction: of 2000 draws, 7-13 %, over 4 standard deviations either side); the reward is 1 when the
    completion contains '#', wherever it is, else 0."""
    import random

    from unsloth_adaptive_kl.tools import demo

    prompts, completions = zip(*(demo.reference_text(random.Random(seed)) for seed in range(2000)))
    assert {len(prompt) for prompt in prompts} == {3, 4, 5} and {prompt[-1] for prompt in prompts} == {":"}
    assert set("".join(prompt[:-1] for prompt in prompts)) == set("abcdefgh")
    assert {len(completion) for completion in completions} == set(range(3, 9))
    assert set("".join(completions)) == set("abcdefgh#") and max(c.count("#") for c in completions) == 1
    assert 0.07 < sum("#" in completion for completion in completions) / len(completions) < 0.13
    assert demo.hash_reward(["#abc", "ab#c", "abc#", "abc", ""]) == [1.0, 1.0, 1.0, 0.0, 0.0]


def test_each_policy_starts_from_the_pretrained_reference_which_ends_its_completions(tmp_path) -> None:
    """The reference learns from completions of 3-8 letters, each ended by EOS: after 8 letters it ends (every
    training completion does), after 1 it does not (none does). Measured after 120 steps on five pretraining seeds:
    P(EOS) above 0.9 after 8 letters and below 0.003 after 1; a model that did not learn it (untrained, or trained
    without EOS) gives both about the same. Each run's policy is that reference (LoRA's B starts at zero) with
    adapters of its own seed; the task is the page's: 16 completions a step, 8 per prompt, up to 24 tokens."""
    import torch

    from unsloth_adaptive_kl.tools import demo

    args = demo.parse_args(["--pretrain-steps", "120", "--output-dir", str(tmp_path)])
    task = demo.tiny_task(args)
    policy, tokenizer = task.make_policy(0)

    def p_eos(completion_length: int) -> float:
        texts = [prompt + "abcdefgh"[:completion_length] for prompt in ("ab:", "cde:", "fgha:", "hb:")]
        with torch.no_grad():
            logits = [policy(input_ids=torch.tensor([tokenizer(text).input_ids])).logits[0, -1] for text in texts]
        return sum(row.softmax(-1)[tokenizer.eos_token_id].item() for row in logits) / len(texts)

    assert p_eos(8) > 0.5 and p_eos(1) < 0.05
    adapters = [{k: v for k, v in task.make_policy(seed)[0].state_dict().items() if "lora_A" in k}
                for seed in (0, 0, 1)]
    assert all(torch.equal(adapters[0][k], adapters[1][k]) for k in adapters[0])
    assert not any(torch.equal(adapters[0][k], adapters[2][k]) for k in adapters[0])
    settings = task.grpo_settings
    assert (settings["per_device_train_batch_size"], settings["num_generations"]) == (16, 8)
    assert (settings["max_completion_length"], settings["learning_rate"]) == (24, 5e-3)
    assert task.reward is demo.hash_reward and len(task.prompts) == 256


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
    # in the checkpoint's own dtype ("auto"; transformers 4's default is float32)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        lambda name, **kwargs: f"model:{name}" if kwargs == {"dtype": "auto"} else kwargs)
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


def test_the_arithmetic_reward_is_1_when_the_first_number_is_the_answer() -> None:
    """docs/demo.md: "a correctness reward": the completion's first number, a sign included, is the answer; a
    conversational completion is read from its message's content."""
    from unsloth_adaptive_kl.tools import demo

    completions = ["42", "It is 42.", "41, no: 42", "-42", "no idea", "420", [{"role": "assistant", "content": "42"}]]
    assert demo.arithmetic_reward(completions, answer=["42"] * 7) == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0]


def test_each_model_prompt_is_rewarded_for_its_own_sum(monkeypatch) -> None:
    """The model task's answers are the sums its prompts ask for ("What is 17 + 25? Reply with the number."), read
    back from the prompts, and its reward pays exactly those."""
    import re

    import transformers

    from unsloth_adaptive_kl.tools import demo

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda name, **kwargs: "tokenizer")
    task = demo.model_task(demo.parse_args(["--model", "org/m", "--backend", "trl"]))
    asked = [re.fullmatch(r"What is (\d+) \+ (\d+)\? Reply with the number\.", prompt[0]["content"])
             for prompt in task.prompts]
    answers = task.grpo_settings["answers"]
    assert len(answers) == len(asked) == 256
    assert answers == [str(int(a) + int(b)) for a, b in map(re.Match.groups, asked)]
    assert task.reward(answers, answer=answers) == [1.0] * 256
    assert task.reward([str(int(answer) + 1) for answer in answers], answer=answers) == [0.0] * 256


@pytest.mark.parametrize("cuda, unsloth_installed, backend", [(True, True, "unsloth"), (True, False, "trl"),
                                                              (False, True, "trl")])
def test_the_auto_backend_is_unsloth_where_it_is_installed_and_a_gpu_is_there(monkeypatch, cuda, unsloth_installed,
                                                                             backend) -> None:
    """docs/demo.md: `--backend auto` (the default) uses Unsloth's FastLanguageModel in 4-bit with LoRA when Unsloth
    and a GPU are there, else transformers + PEFT (on a CPU Unsloth cannot load a model). Unsloth's LoRA is seeded
    with the run's seed."""
    import importlib.util
    import types

    import transformers

    from unsloth_adaptive_kl.tools import demo

    fake_device(monkeypatch, cuda=cuda, bf16=True)
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: (
        (find_spec("trl") if unsloth_installed else None) if name == "unsloth" else find_spec(name, *args)))
    calls = []

    class FastLanguageModel:
        @staticmethod
        def from_pretrained(name, **kwargs):
            calls.append(("from_pretrained", name, kwargs))
            return "model", "unsloth tokenizer"

        @staticmethod
        def get_peft_model(model, **kwargs):
            calls.append(("get_peft_model", model, kwargs))
            return "lora"

    monkeypatch.setitem(sys.modules, "unsloth", types.SimpleNamespace(FastLanguageModel=FastLanguageModel))
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda name, **kwargs: calls.append(
        ("tokenizer", name)) or "tokenizer")
    task = demo.model_task(demo.parse_args(["--model", "org/m"]))
    if backend == "trl":
        assert calls == [("tokenizer", "org/m")]
        return
    assert calls == [] and task.make_policy(3) == ("lora", "unsloth tokenizer")
    (_, name, loaded), (_, model, lora) = calls
    assert (name, loaded["load_in_4bit"], model, lora["random_state"]) == ("org/m", True, "model", 3)


def test_only_a_failure_to_load_is_blamed_on_the_model() -> None:
    """`loading` turns the OSError of a name that cannot be found, and the ValueError of a model transformers cannot
    build, into ModelNotLoaded, naming --model; any other error (a bug) stays what it is, so that it does not stop the
    demo as a model that cannot be loaded does."""
    from unsloth_adaptive_kl.tools import demo

    with pytest.raises(demo.ModelNotLoaded, match="^--model 'org/m' could not be loaded: OSError: offline$"):
        with demo.loading("org/m"):
            raise OSError("offline")
    with pytest.raises(demo.ModelNotLoaded, match="^--model 'org/m' could not be loaded: ValueError: bad config$"):
        with demo.loading("org/m"):
            raise ValueError("bad config")
    with pytest.raises(RuntimeError, match="^a bug$"):
        with demo.loading("org/m"):
            raise RuntimeError("a bug")


def test_a_folder_transformers_cannot_build_a_model_from_is_a_model_that_cannot_be_loaded(tmp_path) -> None:
    """A folder with a tokenizer and a config of an unknown model type: transformers raises ValueError, which ended
    each run in turn as a failure of its own (and an empty folder's tokenizer, in a traceback) where a name that
    cannot be found stops the demo at its first load."""
    from unsloth_adaptive_kl.tools import demo
    from unsloth_adaptive_kl.tools.tiny import build_tokenizer

    build_tokenizer().save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "no_such_type"}))
    args = demo.parse_args(["--model", str(tmp_path), "--backend", "trl", "--methods", "none",
                            "--output-dir", str(tmp_path / "out")])
    task = demo.model_task(args)
    with pytest.raises(demo.ModelNotLoaded, match=rf"^--model '{re.escape(str(tmp_path))}' could not be loaded: "
                                                  r"ValueError: .*no_such_type"):
        task.make_policy(0)


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

def test_ref_sync_variant_syncs_on_schedule(tmp_path, capsys) -> None:
    """A hard reset every 2 of 4 steps on the demo's LoRA model: the sync count follows the schedule, and the step
    after each sync is on-policy against the new reference, so its KL is exactly 0 (stock's is not)."""
    from unsloth_adaptive_kl.tools import demo

    code = demo.main(["--quick", "--methods", "none,ref_sync:2,ref_sync:2:reset", "--pretrain-steps", "5",
                      "--output-dir", str(tmp_path)])
    assert code == 0
    # what produced the run is the argv main was given, not this pytest process's sys.argv
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["environment"]["command"] == (
        "python blackwell/test_adaptive_kl_grpo.py --quick --methods none,ref_sync:2,ref_sync:2:reset "
        f"--pretrain-steps 5 --output-dir {tmp_path}")
    # the versions that produced it, this package's first; the window of 4 steps is the last (10 % of 4, at least 1)
    assert summary["environment"]["versions"]["unsloth_adaptive_kl"] == importlib.metadata.version(
        "unsloth-adaptive-kl")
    assert summary["window"] == 1
    assert "'reward':" not in capsys.readouterr().out  # the table and the bar report: no trainer's per-step dicts
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
                           (["--learning-rate", "0"], "--learning-rate=0.0 is invalid: allowed is a finite number "
                                                      "> 0"),
                           (["--pretrain-steps", "-3"], "--pretrain-steps=-3 is invalid: allowed is an integer >= 0"),
                           # no step, or no seed, trains nothing
                           (["--steps", "0"], "--steps=0 is invalid: allowed is an integer >= 1"),
                           (["--seeds", "0"], "--seeds=0 is invalid: allowed is an integer >= 1"),
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
                           (["--beta", "0", "--methods", "beta=0,clip"], "variant 'clip' would be the same run as"),
                           # trained at beta 0, recorded in summary.json as 0.5
                           (["--beta", "0.5", "--methods", "beta=0"], "--beta=0.5 has no effect: the only variant, "
                                                                      "'beta=0', trains without the KL term"),
                           # target's horizon against the demo's 16 completions a step: each target run failed when
                           # its trainer was built, after the reference's pretraining
                           (["--methods", "target", "--kl-horizon", "2"],
                            "variant 'target': kl_horizon=2.0 is invalid for steps of 16 completions with beta_min=0"),
                           (["--model", "org/m", "--methods", "target", "--kl-horizon", "1.6"],
                            "variant 'target': kl_horizon=1.6 is invalid for steps of 8 completions with beta_min=0"),
                           # no step trained against a synced reference: three runs of 'none' under three labels
                           (["--ref-sync", "--quick"], "variant 'ref_sync:30' syncs the reference after every 30 "
                                                       "steps, and --steps=4 ends the run before any step trains "
                                                       "against a synced one: allowed is a sync every STEPS < "
                                                       "--steps"),
                           (["--methods", "none,ref_sync:4", "--steps", "4"], "variant 'ref_sync:4' syncs")):
        with pytest.raises(SystemExit) as refused:
            demo.parse_args(flags)
        assert refused.value.code == 2 and message in capsys.readouterr().err, flags
    # the core's rule and wording, as GRPOConfig(beta=...) refuses it, by the flag's name
    for beta in ("-1", "nan", "inf"):
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


def test_the_default_run_is_the_documented_comparison() -> None:
    """docs/demo.md states the default run in prose (7 variants x 3 seeds x 120 steps, beta, loss_type, learning rate,
    the output folder), which no generated table keeps in step with the flags; --kl-target and --kl-horizon default to
    the library's values (AdaptiveKLConfig's), so a variant run without them trains as a config without them does."""
    import re

    from unsloth_adaptive_kl.core.config import AdaptiveKLConfig
    from unsloth_adaptive_kl.tools import demo

    page = (Path(__file__).parents[1] / "docs" / "demo.md").read_text()
    stated = re.search(r"(\d+) variants × (\d+) seeds × (\d+) steps, `beta=([\d.]+)`, `loss_type=\"(\w+)\"`, "
                       r"learning rate\s+([\d.e-]+)\.", page)
    args = demo.parse_args([])
    assert (len(args.methods), args.seeds, args.steps, args.beta, args.loss_type, args.learning_rate) == (
        int(stated[1]), int(stated[2]), int(stated[3]), float(stated[4]), stated[5], float(stated[6]))
    assert f"In `--output-dir` (default `{args.output_dir}/`)" in page
    assert (args.kl_target, args.kl_horizon) == (AdaptiveKLConfig().kl_target, AdaptiveKLConfig().kl_horizon)


def test_each_estimator_and_reduction_is_a_variant_of_its_own() -> None:
    """--estimators and --kl-reductions add a variant per value, after --methods', each training with its value."""
    from unsloth_adaptive_kl.tools import demo

    args = demo.parse_args(["--methods", "none", "--estimators", "k2", "--kl-reductions", "sequence_sum, token_mean"])
    assert args.methods == ["none", "estimator=k2", "kl_reduction=sequence_sum", "kl_reduction=token_mean"]
    assert [demo.variant_settings(method, 0.04) for method in args.methods[1:]] == [
        {"kl_estimator": "k2", "beta": 0.04}, {"kl_reduction": "sequence_sum", "beta": 0.04},
        {"kl_reduction": "token_mean", "beta": 0.04}]


def test_two_labels_with_the_same_settings_are_refused(capsys) -> None:
    """Each pair ran the same settings twice, shown as two variants: the variants are keyed on their resolved settings
    (the methods in canonical order, the defaults a label leaves out), not on how the label spells them."""
    from unsloth_adaptive_kl.tools import demo

    for first, second in (("dynamic+length_normalized", "length_normalized+dynamic"),
                          ("dynamic+length_normalized", "dynamic + length_normalized"),
                          ("ref_sync:5", "ref_sync:05"), ("reward:sequence_sum", "reward:sequence_sum:none"),
                          ("none", "kl_reduction=loss_type"), ("none", "estimator=k3"),
                          # the reduction in effect: length normalisation's, and the reward's default
                          ("length_normalized", "kl_reduction=sequence_mean"),
                          ("reward:sequence_sum", "reward:loss_type")):
        with pytest.raises(SystemExit) as refused:
            demo.parse_args(["--methods", f"clip,{first},{second}"])
        assert refused.value.code == 2, (first, second)
        assert (f"variants {first!r} and {second!r} are the same settings: allowed is each variant once"
                in capsys.readouterr().err)
    assert demo.parse_args(["--methods", "none,ref_sync:5,ref_sync:5:reset,reward:sequence_sum,reward:sequence_mean"])
    # dapo's own reduction is not token_mean: two runs
    assert demo.parse_args(["--methods", "none,kl_reduction=token_mean,length_normalized"])
    # in the reward length normalisation is refused as such, not as the reduction beside it
    with pytest.raises(SystemExit):
        demo.parse_args(["--methods", "reward:sequence_sum:length_normalized"])
    assert ("kl_adaptation_method='length_normalized' is invalid: allowed is methods without length_normalized with "
            "kl_placement='reward'" in capsys.readouterr().err)


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
    # read by a variant other than the last: the flag reaches it
    assert demo.parse_args(["--methods", "sigmoid,none", "--kl-target", "0.3"]).kl_target == 0.3


def test_the_plot_gives_each_variant_its_own_colour_past_ten(tmp_path, monkeypatch) -> None:
    """matplotlib's colour cycle C0-C9 repeats: with 12 variants the 11th and 12th took the 1st and 2nd's colours."""
    import matplotlib.figure
    from matplotlib.colors import to_rgba

    from unsloth_adaptive_kl.tools import demo

    saved = []
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda figure, *args, **kwargs: saved.append(figure))
    for count in (3, 10, 12):
        methods = [f"variant{index}" for index in range(count)]
        rows = [{"method": method, "seed": 0, "step": step, **{key: float(index) for key in demo.LOGGED}}
                for index, method in enumerate(methods) for step in (1, 2)]
        demo.plot(rows, methods, str(tmp_path / "plot.png"))
        lines = saved[-1].axes[0].lines
        assert [line.get_label() for line in lines] == methods
        assert len({to_rgba(line.get_color()) for line in lines}) == count
        if count <= 10:  # up to ten, matplotlib's own cycle (docs/demo.md)
            assert [to_rgba(line.get_color()) for line in lines] == [to_rgba(f"C{index}") for index in range(count)]


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
    # under 10 steps the window is the last step (not none, which read as all of them): 4 and 14 at step 4
    (short,) = summarise([row for row in rows if row["step"] <= 4], ["a"], steps=4)
    assert short["by_seed"]["completions/mean_length"] == [4.0, 14.0]


def test_a_seed_without_a_value_is_left_out_of_the_mean_over_seeds() -> None:
    """A seed's figure is NaN where a step had no value (a correlation of equal lengths): the mean and sample std over
    seeds are those of the other seeds, (1 + 3) / 2 and sqrt(2 * 1^2 / 1); none at all is NaN; one seed has std 0."""
    from unsloth_adaptive_kl.tools.demo import mean_std

    assert mean_std([1.0, math.nan, 3.0]) == pytest.approx((2.0, math.sqrt(2)))
    assert all(math.isnan(value) for value in mean_std([math.nan, math.nan]))
    assert mean_std([5.0]) == (5.0, 0.0)


def test_drifted_seeds_counts_each_variants_seeds_nearer_the_unregularised_length() -> None:
    """A seed's length drifted where it ended nearer beta=0's mean (21) than stock's (7): past the midpoint 14. By
    hand: stock 0 of 2, beta=0 2 of 2, x 2 of 4 (13.9 and 14, as near one as the other, held; 14.1 and 30 drifted).
    A run without beta=0, or without each seed's figures (a summary.json written before `by_seed`), has no count."""
    from unsloth_adaptive_kl.tools.demo import drifted_seeds

    def variant(method: str, lengths: list[float]) -> dict:
        return {"method": method, "completions/mean_length": [sum(lengths) / len(lengths), 0.0],
                "by_seed": {"completions/mean_length": lengths}}

    summary = [variant("none", [6.0, 8.0]), variant("beta=0", [20.0, 22.0]), variant("x", [13.9, 14.0, 14.1, 30.0])]
    assert drifted_seeds(summary) == {"none": (0, 2), "beta=0": (2, 2), "x": (2, 4)}
    assert drifted_seeds([summary[0], summary[2]]) == {}
    assert drifted_seeds([{k: v for k, v in item.items() if k != "by_seed"} for item in summary]) == {}


def table_summary(methods: list[str]) -> list[dict]:
    """A summary as `summarise` gives it, with hand-picked figures: per variant the reward (0.5 +/- 0.1), length, raw
    and adapted KL, summed KL, beta (mean 0.01234, std 0.5) and s/step, and each seed's length; `beta=0`'s KL NaN."""
    lengths = {"none": [6.0, 8.0], "beta=0": [20.0, 22.0], "clip": [10.0, 19.0]}
    items = []
    for method in methods:
        off = method == "beta=0"
        figures = {"reward": (0.5, 0.1), "completions/mean_length": (statistics.fmean(lengths[method]), 1.5),
                   "adaptive_kl/raw_kl": (math.nan, math.nan) if off else (0.25, 0.125),
                   "adaptive_kl/adapted_kl": (math.nan, math.nan) if off else (0.2, 0.0625),
                   "adaptive_kl/sequence_kl": (math.nan, math.nan) if off else (2.0, 0.5),
                   "adaptive_kl/current_beta": (0.01234, 0.5), "step_time": (0.75, 0.25)}
        items.append({"method": method, "seeds": 2, **figures,
                      "by_seed": {"completions/mean_length": lengths[method]}})
    return items


def table_cells(output: str) -> dict[str, list[str]]:
    """The printed table's body rows: {variant: its cells after the name}."""
    rows = [[cell.strip() for cell in line.split("│")[1:-1]]
            for line in output.splitlines() if line.startswith("│")]
    return {row[0]: row[1:] for row in rows if row[0] in ("none", "beta=0", "clip")}


def test_the_table_shows_each_figure_as_the_docs_describe(capsys) -> None:
    """docs/demo.md: mean +/- std over seeds of reward, length, raw, adapted and summed KL; the mean alone of the final
    beta and s/step; beta=0's KL cells "(off)"; and, where the run has none and beta=0, the seeds whose length
    drifted (clip: 19 is nearer 21 than 7, 10 is not: 1 of 2)."""
    from unsloth_adaptive_kl.tools.demo import print_table

    print_table(table_summary(["none", "beta=0", "clip"]))
    output = capsys.readouterr().out
    cells = table_cells(output)
    assert cells["clip"] == ["0.50 +/- 0.10", "14.5 +/- 1.5", "0.2500 +/- 0.1250", "0.2000 +/- 0.0625",
                             "2.000 +/- 0.500", "0.0123", "0.750", "1/2"]
    assert cells["beta=0"][2:5] == ["(off)"] * 3 and cells["beta=0"][-1] == "2/2" and cells["none"][-1] == "0/2"
    assert [line.split("┃")[-2].strip() for line in output.splitlines() if "┃ method" in line] == ["drifted"]
    print_table(table_summary(["none", "clip"]))  # no beta=0: no drift to count
    output = capsys.readouterr().out
    assert "drifted" not in output and table_cells(output)["clip"][-2:] == ["0.0123", "0.750"]


def test_the_plot_shows_the_panels_some_variant_logs_and_the_mean_of_the_seeds_with_a_value(tmp_path,
                                                                                          monkeypatch) -> None:
    """docs/demo.md: a panel no variant logs is left out (here the reward penalty and the syncs), as is a variant's
    curve it never logs (beta=0's KL); the curve is the mean over seeds of those with a value at the step (a seed's
    correlation is NaN where its lengths are equal); the first panel has the legend. By hand: 2 seeds, 3 steps,
    a metric of seed s at step t is 10 s + t, seed 1's correlation NaN at step 2."""
    import matplotlib.figure

    from unsloth_adaptive_kl.tools import demo

    saved = []
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda figure, *args, **kwargs: saved.append(figure))
    never = {"adaptive_kl/reward_penalty", "adaptive_kl/ref_syncs"}
    rows = [{"method": method, "seed": seed, "step": step,
             **{key: math.nan if key in never or (method == "beta=0" and "kl" in key)
                or (key == "adaptive_kl/length_kl_corr" and (seed, step) == (1, 2)) else 10.0 * seed + step
                for key in demo.LOGGED}}
            for method in ("none", "beta=0") for seed in (0, 1) for step in (1, 2, 3)]
    demo.plot(rows, ["none", "beta=0"], str(tmp_path / "plot.png"))
    (figure,) = saved
    panels = {axis.get_title(): axis for axis in figure.axes}
    assert list(panels) == ["reward", "completion length", "beta", "summed KL per completion",
                            "corr(length, summed KL)"]
    assert [line.get_label() for line in panels["summed KL per completion"].lines] == ["none"]
    assert [line.get_label() for line in panels["reward"].lines] == ["none", "beta=0"]
    assert list(panels["reward"].lines[0].get_ydata()) == [6.0, 7.0, 8.0]  # (1 + 11) / 2, ...
    assert list(panels["corr(length, summed KL)"].lines[0].get_ydata()) == [6.0, 2.0, 8.0]
    # one legend for the figure, below the panels, so it covers no band; each panel's axis says its unit
    (legend,) = figure.legends
    assert [text.get_text() for text in legend.get_texts()] == ["none", "beta=0"]
    assert all(axis.get_legend() is None for axis in figure.axes)
    assert [axis.get_ylabel() for axis in figure.axes] == ["mean reward (0 to 1)", "tokens", "KL coefficient",
                                                            "nats (the run's estimator)", "Pearson r"]
    # bounded metrics show their whole range (the values here, 6 to 33, are made up and drawn outside it)
    assert panels["corr(length, summed KL)"].get_ylim() == (-1.05, 1.05)
    # a count starts at 0, with a margin below it so that a line at 0 is not drawn on the axis line
    low, high = panels["completion length"].get_ylim()
    assert low == pytest.approx(-0.03 * high) and high >= 13.0  # the largest length, 10 * 1 + 3
    # the legend names a variant that lacks the first panel's metric, drawn in the others
    saved.clear()
    no_reward = [{**row, "reward": math.nan} if row["method"] == "beta=0" else row for row in rows]
    demo.plot(no_reward, ["none", "beta=0"], str(tmp_path / "plot.png"))
    assert [text.get_text() for text in saved[0].legends[0].get_texts()] == ["none", "beta=0"]


def test_the_plots_reference_sync_count_has_whole_ticks(tmp_path, monkeypatch) -> None:
    """The syncs-so-far panel is a count: its ticks are whole numbers (they were 0.5 apart over 0-4), and with no
    sync yet its axis reaches 1, so the flat line at 0 has a tick of its own."""
    import matplotlib.figure

    from unsloth_adaptive_kl.tools import demo

    saved = []
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda figure, *args, **kwargs: saved.append(figure))
    for syncs, ticks in (([0.0, 1.0, 2.0, 4.0], [0, 1, 2, 3, 4]), ([0.0, 0.0, 0.0, 0.0], [0, 1])):
        rows = [{"method": "ref_sync:1", "seed": 0, "step": step, **{key: 0.5 for key in demo.LOGGED},
                 "adaptive_kl/ref_syncs": count} for step, count in enumerate(syncs, 1)]
        demo.plot(rows, ["ref_sync:1"], str(tmp_path / "plot.png"))
        axis = {axis.get_title(): axis for axis in saved[-1].axes}["reference syncs so far"]
        low, high = axis.get_ylim()
        shown = [tick for tick in axis.get_yticks() if low <= tick <= high]
        assert shown == ticks
        assert [tick for tick in axis.get_xticks() if 1 <= tick <= 4] == [1, 2, 3, 4]  # whole steps too


# ----- the tiny tokenizer and model the demo, the tests and the benchmarks build in-process ---------------------

def test_the_tiny_tokenizer_has_one_token_per_character_and_pads_its_vocabulary_with_tokens_no_text_reaches() -> None:
    """Pad and EOS, then one token per character of the alphabet, each of a run of spaces or newlines its own; it
    returns input_ids and attention_mask alone;
    `vocab_size` pads with `<unusedN>` up to exactly that size (the alphabet's own size allowed, one less refused).
    CHAT_ALPHABET is every printable ASCII character and the newline (no other whitespace)."""
    import string
    import tempfile

    from transformers import AutoTokenizer

    from unsloth_adaptive_kl.tools.tiny import CHAT_ALPHABET, build_tokenizer

    tokenizer = build_tokenizer("ab \n", vocab_size=6)  # <pad>, <eos>, a, b, space, newline: no padding needed
    assert len(tokenizer) == 6 and (tokenizer.pad_token_id, tokenizer.eos_token_id) == (0, 1)
    assert tokenizer("a\n\nb  a").input_ids == [2, 5, 5, 3, 4, 4, 2]
    assert tokenizer.decode([2, 5, 5, 3, 4, 4, 2]) == "a\n\nb  a"
    # a causal LM's inputs alone, also once saved and reloaded (transformers 4.x added token_type_ids, which its
    # generate() refuses for Llama)
    assert list(tokenizer("ab")) == ["input_ids", "attention_mask"]
    with tempfile.TemporaryDirectory() as folder:
        tokenizer.save_pretrained(folder)
        assert list(AutoTokenizer.from_pretrained(folder)("ab")) == ["input_ids", "attention_mask"]
    padded = build_tokenizer("ab \n", vocab_size=8)
    assert len(padded) == 8 and padded.convert_ids_to_tokens([5, 6, 7]) == ["\n", "<unused6>", "<unused7>"]
    with pytest.raises(ValueError, match="vocab_size=5 is invalid: the alphabet needs 6 tokens"):
        build_tokenizer("ab \n", vocab_size=5)
    assert set(CHAT_ALPHABET) == set(string.printable) - set("\t\r\x0b\x0c") and len(CHAT_ALPHABET) == 96


def test_the_tiny_model_its_lora_and_the_unsloth_stand_in_are_seeded_and_shaped_as_documented() -> None:
    """build_tiny_model: a Llama over the tokenizer's vocab (MLP twice the width, as many KV heads as heads, untied,
    the tokenizer's pad and EOS and no BOS: it has none), seeded whatever the global RNG; lora_config: rank r, alpha
    2r, no dropout, on every attention and MLP projection; add_lora seeded too; as_unsloth_model: the two methods of
    Unsloth's models, float32 kept."""
    import torch

    from unsloth_adaptive_kl.tools.tiny import (add_lora, as_unsloth_model, build_tiny_model, build_tokenizer,
                                                lora_config)

    tokenizer = build_tokenizer("ab", vocab_size=8)
    sizes = dict(hidden_size=32, num_layers=1, num_heads=2, max_position_embeddings=16)
    torch.manual_seed(1)
    model = build_tiny_model(tokenizer, **sizes)
    config = model.config
    assert (config.vocab_size, config.hidden_size, config.intermediate_size, config.num_attention_heads,
            config.num_key_value_heads, config.max_position_embeddings) == (8, 32, 64, 2, 2, 16)
    assert (config.pad_token_id, config.eos_token_id, config.bos_token_id, config.tie_word_embeddings) == (
        0, 1, None, False)
    assert (model.generation_config.pad_token_id, model.generation_config.eos_token_id) == (0, 1)
    torch.manual_seed(2)
    same = build_tiny_model(tokenizer, **sizes)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), same.state_dict().values()))
    lora = lora_config(4)
    assert (lora.r, lora.lora_alpha, lora.lora_dropout) == (4, 8, 0.0)
    assert set(lora.target_modules) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    torch.manual_seed(1)
    adapted = add_lora(model, rank=4, seed=3)
    torch.manual_seed(2)
    again = add_lora(same, rank=4, seed=3)
    weights = {name: value for name, value in adapted.state_dict().items() if "lora_A" in name}
    assert {name.split(".")[-4] for name in weights} == set(lora.target_modules)
    assert all(torch.equal(value, again.state_dict()[name]) for name, value in weights.items())
    assert as_unsloth_model(model) is model and model._unsloth_user_float32 is True
    assert (model.for_training(), model.for_inference(use_cache=True)) == (None, None)
