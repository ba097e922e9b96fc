"""`python -m unsloth_adaptive_kl --gpu` (tools/gpucheck.py, tools/gpu_scenarios.py): on this CPU machine it exits
2, and every scenario with a CPU equivalent runs here on the saved tiny Llama for 1-3 steps, so that the GPU check
does not rot between GPU runs. The Unsloth 4-bit, Unsloth fp16 and vLLM scenarios need a CUDA GPU and run only
there; the Unsloth scenario's per-method and beta-moving checks run here on TRL's trainer."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from unsloth_adaptive_kl.tools import gpu_scenarios as scenarios
from unsloth_adaptive_kl.tools import gpucheck, machine, selfcheck
from unsloth_adaptive_kl.tools.selfcheck import Check

ROOT = Path(__file__).parents[1]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("gpucheck") / "tiny-llama")
    gpucheck.save_tiny_llama(path)
    return path


def test_gpu_check_without_cuda_exits_2_saying_it_needs_a_cuda_gpu(tmp_path) -> None:
    assert not torch.cuda.is_available()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-m", "unsloth_adaptive_kl", "--gpu"], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    assert "python -m unsloth_adaptive_kl --gpu needs a CUDA GPU: torch.cuda.is_available() is False" in result.stdout
    assert list(tmp_path.iterdir()) == []  # nothing built or written


def test_the_tiny_llama_saves_and_reloads_with_what_every_gpu_path_needs(tmp_path) -> None:
    from transformers import AutoConfig, AutoTokenizer

    from unsloth_adaptive_kl.tools.tiny import CHAT_TEMPLATE

    model_dir = str(tmp_path / "tiny-llama")
    checks = gpucheck.build_tiny_llama(model_dir)
    assert [check.name for check in checks] == ["tiny Llama: shapes every GPU path runs",
                                                 "tiny Llama: tokenizer reloads", "tiny Llama: weights reload"]
    assert all(check.ok for check in checks), [check.line() for check in checks]
    assert checks[0].detail == "hidden 256, head_dim 64, vocab 128, max_position_embeddings 1024 (max_seq_length 512)"
    # Read back independently of the check's own code
    config = AutoConfig.from_pretrained(model_dir)
    head_dim = config.hidden_size // config.num_attention_heads
    assert (config.model_type, head_dim, config.vocab_size) == ("llama", 64, 128)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert tokenizer.is_fast and tokenizer.chat_template == CHAT_TEMPLATE
    assert (tokenizer.pad_token, tokenizer.eos_token) == ("<pad>", "<eos>")
    assert config.pad_token_id != config.eos_token_id
    conversation = [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "5"}]
    text = tokenizer.apply_chat_template(conversation, tokenize=False)
    assert text == "<user>What is 2 + 3?<assistant>5<eos>"
    ids = tokenizer(text).input_ids
    assert ids[-1] == tokenizer.eos_token_id and tokenizer.pad_token_id not in ids  # every character is in the vocab
    assert tokenizer.decode(ids) == text
    assert tokenizer.apply_chat_template(conversation[:1], tokenize=False, add_generation_prompt=True) == \
        "<user>What is 2 + 3?<assistant>"
    assert (tmp_path / "tiny-llama" / "model.safetensors").exists()


def test_the_tiny_llama_check_fails_when_head_dim_is_not_64(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(gpucheck, "NUM_HEADS", 2)  # head_dim 128
    shapes = gpucheck.build_tiny_llama(str(tmp_path / "tiny-llama"))[0]
    assert not shapes.ok and "head_dim 128" in shapes.detail


def test_trl_autocast_scenario_in_bf16_on_cpu(model_dir, tmp_path) -> None:
    (check,) = scenarios.trl_autocast(model_dir, str(tmp_path), device="cpu", precision="bf16", steps=2)
    assert check.ok, check.line()
    assert check.name == "TRL GRPOTrainer, bf16 autocast on cpu"
    assert "accelerate mixed_precision=bf16, beta 0.04 -> 0.02" in check.detail
    assert check.detail.startswith("2 steps, last: raw_kl ")


def test_fp16_grad_scaler_scenario_runs_in_float32_on_cpu(model_dir, tmp_path) -> None:
    """accelerate has no fp16 on a CPU: the same scenario code in float32, no scaler expected."""
    (check,) = scenarios.fp16_grad_scaler(model_dir, str(tmp_path), device="cpu", precision="fp32", steps=2)
    assert check.ok, check.line()
    assert check.name == "TRL, fp32 (no GradScaler) on cpu"
    assert check.detail.endswith("GradScaler: none, scale none, 2 of 2 optimizer steps applied")


def test_the_step_recorder_counts_the_steps_a_grad_scaler_skips() -> None:
    """A real GradScaler (on the CPU): a step whose gradient overflowed is skipped and halves the scale."""
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")

    class Trainer:
        accelerator = type("Accelerator", (), {"scaler": scaler})()

        def __init__(self) -> None:
            self.model = model

        def add_callback(self, callback) -> None:
            pass

    recorder = scenarios.StepRecorder(Trainer())
    recorder.record()
    for value in (float("inf"), 1.0):  # an overflow, then a finite loss
        optimizer.zero_grad()
        scaler.scale(model(torch.ones(1, 3)).sum() * value).backward()
        scaler.step(optimizer)
        scaler.update()
        recorder.record()
    assert recorder.applied_steps() == 1
    assert recorder.scales == [65536.0, 32768.0, 32768.0]


def test_ref_sync_scenario_with_an_8bit_optimizer_on_cpu(model_dir, tmp_path) -> None:
    pytest.importorskip("bitsandbytes")
    (check,) = scenarios.ref_sync_8bit(model_dir, str(tmp_path), backend="trl", device="cpu", precision="fp32",
                                      optim="adamw_8bit", steps=3)
    assert check.ok, check.line()
    assert "1 syncs in 3 steps" in check.detail and "uint8" in check.detail  # 8-bit state again after the reset
    # the reset at step 2 cleared Adam's state: step 3 counted from 1
    assert "step counts [1] after the reset at step 2 (3 without it)" in check.detail


def test_the_ref_sync_scenario_fails_where_the_optimizer_reset_did_nothing(model_dir, tmp_path, monkeypatch) -> None:
    """A sync that kept the optimizer's state (its reset lost) leaves the step counts at 3: the check says so."""
    from unsloth_adaptive_kl.integrations.ref_sync import SyncSchedule

    stock = SyncSchedule.from_args.__func__
    monkeypatch.setattr(SyncSchedule, "from_args",
                        classmethod(lambda cls, args: dataclasses.replace(stock(cls, args), reset_optimizer=False)))
    (check,) = scenarios.ref_sync_8bit(model_dir, str(tmp_path), backend="trl", device="cpu", precision="fp32",
                                      optim="adamw_torch", steps=3)
    assert not check.ok and "1 syncs in 3 steps" in check.detail and "step counts [3]" in check.detail


def test_the_unsloth_scenarios_method_and_recompile_checks_run_on_trl_on_cpu(model_dir, tmp_path) -> None:
    """The per-method and beta-moving checks of `unsloth-4bit` are trainer-agnostic: on TRL's trainer (its loss
    method `_compute_loss`, nothing compiled) on the CPU, on a captured batch whose reference is 1 nat away."""
    from unsloth_adaptive_kl.tools.selfcheck import captured_inputs, comparison_inputs

    trainer = scenarios.chat_trainer(model_dir, str(tmp_path), "trl", "cpu", "fp32")
    inputs = comparison_inputs(captured_inputs(trainer, "_compute_loss"))
    (clip,) = scenarios.method_check("TRL", trainer, "clip+length_normalized+dynamic", inputs, "_compute_loss")
    assert clip.ok, clip.line()
    raw, adapted = (float(clip.detail.split(f"{key} ")[1].split(",")[0]) for key in ("raw_kl", "adapted_kl"))
    assert 0 < adapted < raw  # some tokens' KL is above the 0.2 threshold
    (moving,) = scenarios.no_recompile_check("TRL", trainer, inputs, "_compute_loss", compiled=False)
    assert moving.ok and moving.line() == (
        "[untested] TRL: no recompile while beta moves: beta 0.02 -> 0.01 -> 0.005: 0 frames compiled, 0 new graphs "
        "(nothing is compiled here: the counts check nothing)")


def test_a_missing_optional_package_is_a_fail_line_naming_the_install(model_dir, tmp_path, monkeypatch) -> None:
    real = scenarios.importlib.util.find_spec
    monkeypatch.setattr(scenarios.importlib.util, "find_spec",
                        lambda name, *a: None if name in ("unsloth", "vllm", "bitsandbytes") else real(name, *a))
    checks = scenarios.vllm_kl_in_reward(model_dir, str(tmp_path))  # one line per missing package, nothing run
    assert [check.line().split(": ", 2)[:2] for check in checks] == [
        ["[FAIL] vLLM fast_inference, kl_placement='reward'", "needs unsloth"],
        ["[FAIL] vLLM fast_inference, kl_placement='reward'", "needs bitsandbytes"],
        ["[FAIL] vLLM fast_inference, kl_placement='reward'", "needs vllm"]]  # whatever this machine has installed
    assert checks[2].detail.startswith("vllm is not installed: pip install vllm")
    (eight_bit,) = scenarios.ref_sync_8bit(model_dir, str(tmp_path), backend="trl", device="cpu", precision="fp32")
    assert not eight_bit.ok and eight_bit.detail == "bitsandbytes is not installed: pip install bitsandbytes"


def test_demo_model_path_on_cpu(model_dir, tmp_path) -> None:
    """The demo's public entry point with --model on the saved tiny Llama (chat prompts, transformers + PEFT)."""
    (check,) = scenarios.demo_model(model_dir, str(tmp_path), backend="trl", steps=1, methods="dynamic")
    assert check.ok, check.line()
    assert check.name == "demo --model (backend trl)" and check.detail.startswith("exit 0; dynamic: reward ")
    rows = json.loads((tmp_path / "demo" / "metrics.json").read_text())
    assert [(row["method"], row["step"]) for row in rows] == [("dynamic", 1)]


def test_run_all_reports_every_scenario_and_the_log_of_a_failed_one(tmp_path, capsys) -> None:
    calls = []

    def run(name, model_dir, work_dir, timeout):
        calls.append((name, os.path.isdir(model_dir), work_dir, timeout))
        if name == "b":
            return [Check("b: thing", False, "boom")], "line 1\nTraceback: boom"
        return [Check(f"{name}: thing", True, "fine")], "unused log"

    model_checks, ran = gpucheck.run_all(["a", "b"], str(tmp_path), run=run)
    assert len(model_checks) == 3 and all(c.ok for c in model_checks)
    assert list(ran) == ["a", "b"] and [c.name for o in ran.values() for c in o.checks] == ["a: thing", "b: thing"]
    assert calls == [("a", True, str(tmp_path / "a"), 8 * 60),  # at most 8 minutes a scenario (docs/compatibility.md)
                     ("b", True, str(tmp_path / "b"), 8 * 60)]
    out = capsys.readouterr().out
    assert "[ok] a: thing: fine\n[FAIL] b: thing: boom\n    --- b: the last 2 lines of its log ---\n" in out
    assert "    Traceback: boom" in out and "unused log" not in out


def test_run_all_runs_nothing_without_a_model_or_past_the_budget(tmp_path, monkeypatch) -> None:
    def run(*args):
        raise AssertionError("no scenario may run")

    _, spent = gpucheck.run_all(["a"], str(tmp_path / "one"), run=run, budget_s=20)
    assert [c.line() for c in spent["a"].checks] == ["[FAIL] a: not run: the 20-second budget is spent"]

    def broken(model_dir):
        raise OSError("disk full")

    monkeypatch.setattr(gpucheck, "build_tiny_llama", broken)
    model_checks, ran = gpucheck.run_all(["a", "b"], str(tmp_path / "two"), run=run)
    checks = model_checks + [check for outcome in ran.values() for check in outcome.checks]
    assert [check.line() for check in checks] == ["[FAIL] tiny Llama built and saved: OSError: disk full",
                                                   "[FAIL] a: not run: the tiny model could not be built",
                                                   "[FAIL] b: not run: the tiny model could not be built"]


def test_a_scenario_process_writes_its_checks_and_an_exception_as_a_fail_line(model_dir, tmp_path, capsys) -> None:
    """The child's side of the process boundary (`scenario_process`, in this process to keep the suite short)."""
    result = tmp_path / "result.json"
    assert gpucheck.scenario_process(["no-such-scenario", model_dir, str(tmp_path), str(result)]) == 0
    assert json.loads(result.read_text()) == [
        {"name": "no-such-scenario", "ok": False, "detail": "KeyError: 'no-such-scenario'", "untested": False}]
    assert capsys.readouterr().out == "[FAIL] no-such-scenario: KeyError: 'no-such-scenario'\n"


def fake_scenario(monkeypatch, script: str) -> None:
    """Runs `script` (python -c) as the scenario process, with RESULT its result path."""
    monkeypatch.setattr(gpucheck, "scenario_command", lambda name, model_dir, work_dir, result, dry_run=False: [
        sys.executable, "-c", f"RESULT = {result!r}\n" + script])


def test_run_isolated_reads_the_checks_back_and_reports_a_crash_or_a_hang(tmp_path, monkeypatch) -> None:
    """The parent's side: checks come back from the JSON, offline; a process that dies without writing them, or
    outlives its time, is a FAIL line with the last line of its log."""
    monkeypatch.delenv("TORCHINDUCTOR_COMPILE_THREADS", raising=False)
    fake_scenario(monkeypatch, "import importlib.util, json, os\n"
                  "print(os.getcwd(), os.environ['HF_HUB_OFFLINE'], os.environ['TORCHINDUCTOR_CACHE_DIR'],\n"
                  "      os.environ['TORCHINDUCTOR_COMPILE_THREADS'])\n"
                  "print(importlib.util.find_spec('unsloth_adaptive_kl').origin)\n"
                  "check = {'name': 'x: y', 'ok': True, 'detail': 'measured 1', 'untested': False}\n"
                  "json.dump([check], open(RESULT, 'w'))")
    checks, log = gpucheck.run_isolated("x", "model", str(tmp_path / "ok"), timeout=120)
    assert checks == [Check("x: y", True, "measured 1")]
    # in its work folder, offline, with its own compile cache and 4 compile workers (4 scenarios run at once on the
    # GPU machine's 16 cores), importing this copy of the package
    work = tmp_path / "ok"
    assert log == f"{work} 1 {work / 'inductor_cache'} 4\n{ROOT / 'unsloth_adaptive_kl' / '__init__.py'}\n"

    fake_scenario(monkeypatch,
                  "import sys\nprint('CUDA error: an illegal memory access', file=sys.stderr)\nsys.exit(134)")
    checks, _ = gpucheck.run_isolated("x", "model", str(tmp_path / "crash"), timeout=60)
    assert checks == [Check("x", False, "the process exited 134: CUDA error: an illegal memory access")]
    fake_scenario(monkeypatch, "print('loading the model')\nprint('RuntimeError: out of memory')\nprint()\n"
                  "raise SystemExit(1)")  # the last line it printed, empty lines passed over
    checks, _ = gpucheck.run_isolated("x", "model", str(tmp_path / "last"), timeout=60)
    assert checks == [Check("x", False, "the process exited 1: RuntimeError: out of memory")]
    fake_scenario(monkeypatch, "raise SystemExit(3)")
    checks, _ = gpucheck.run_isolated("x", "model", str(tmp_path / "silent"), timeout=60)
    assert checks == [Check("x", False, "the process exited 3: no output")]

    fake_scenario(monkeypatch, "import time\nprint('compiling', flush=True)\ntime.sleep(60)")
    checks, _ = gpucheck.run_isolated("x", "model", str(tmp_path / "hang"), timeout=2)
    assert checks == [Check("x", False, "timed out after 2 s: compiling")]


def test_metric_problems_allow_only_the_correlation_to_be_nan() -> None:
    row = {"adaptive_kl/raw_kl": 0.1, "adaptive_kl/adapted_kl": 0.1, "adaptive_kl/current_beta": 0.04,
           "adaptive_kl/length_kl_corr": None}
    assert scenarios.metric_problems([row]) == []
    assert scenarios.metric_problems([{**row, "adaptive_kl/adapted_kl": float("nan")}]) == [
        "step 1: adaptive_kl/adapted_kl=nan"]
    assert scenarios.metric_problems([{**row, "adaptive_kl/sequence_kl": None}]) == [
        "step 1: adaptive_kl/sequence_kl=None"]
    assert scenarios.metric_problems([{"adaptive_kl/raw_kl": 0.1}])[0] == "step 1: adaptive_kl/adapted_kl not logged"
    assert scenarios.metric_problems([]) == ["no adaptive_kl metric logged"]


def test_only_selects_scenarios_by_name() -> None:
    assert gpucheck.parse_only(None) == list(gpucheck.SCENARIOS)
    assert gpucheck.parse_only("demo-model, trl-autocast") == ["demo-model", "trl-autocast"]
    with pytest.raises(SystemExit, match="unknown scenario nope; allowed: trl-autocast"):
        gpucheck.parse_only("nope")
    for only in (",", "demo-model,demo-model"):  # ran every scenario; ran one twice
        with pytest.raises(SystemExit, match=f"^--only={only!r} is invalid: allowed is each scenario at most once"):
            gpucheck.parse_only(only)


def test_run_all_runs_jobs_scenarios_at_once_and_reports_them_in_the_order_asked(tmp_path) -> None:
    """With jobs=2 the two scenarios run at the same time (each waits at a barrier that needs both: one at a time,
    the first would time out), and the outcomes come back in the order of the names."""
    import threading

    barrier = threading.Barrier(2, timeout=60)

    def run(name, model_dir, work_dir, timeout):
        barrier.wait()
        return [Check(f"{name}: thing", True)], ""

    _, ran = gpucheck.run_all(["b", "a"], str(tmp_path), run=run, jobs=2)
    assert list(ran) == ["b", "a"] and all(o.checks[0].ok for o in ran.values())


def test_the_results_json_names_the_device_and_every_scenario_run_or_not() -> None:
    found = gpucheck.environment()
    assert found["device"]["kind"] == "cpu" and found["device"]["cores"] == os.cpu_count()
    assert torch.__version__.startswith(found["versions"]["torch"]) and found["versions"]["vllm"] is None
    ran = {"trl-autocast": gpucheck.Ran([Check("x", True, "fine")], 12.5)}
    data = gpucheck.results(found, [Check("model", True)], ran, dry_run=True, seconds=20.0, command="cmd")
    assert data["dry_run"] is True and data["command"] == "cmd" and data["device"]["kind"] == "cpu"
    assert list(data["scenarios"]) == list(gpucheck.SCENARIOS)
    assert data["scenarios"]["trl-autocast"] == {"ran": True, "seconds": 12.5, "checks": [
        {"name": "x", "ok": True, "detail": "fine", "untested": False}]}
    assert all(data["scenarios"][name] == {"ran": False, "why": "not asked for (--only)"}
               for name in gpucheck.SCENARIOS if name != "trl-autocast")
    json.dumps(data)  # as written


def test_the_json_is_written_after_each_scenario_naming_those_not_finished(monkeypatch, tmp_path) -> None:
    """A run the device tool stops from outside (its command's time limit) keeps the scenarios that had finished:
    main writes the JSON after each one, the others named as not finished; the last write has them all."""
    monkeypatch.setattr(gpucheck, "environment", lambda: {"device": {"kind": "cpu", "name": "x", "cores": 2},
                                                          "versions": {"torch": "2.0"}})
    monkeypatch.setattr(gpucheck, "build_tiny_llama", lambda model_dir: [Check("model", True)])
    path = tmp_path / "check.json"
    seen = []

    def run(name, model_dir, work_dir, timeout):
        seen.append(json.loads(path.read_text())["scenarios"] if path.exists() else None)
        return [Check(f"{name}: fine", True)], ""

    monkeypatch.setattr(gpucheck, "run_isolated", lambda name, model_dir, work_dir, timeout, dry_run: run(
        name, model_dir, work_dir, timeout))
    assert gpucheck.main(only="trl-autocast,demo-model", json_path=str(path), dry_run=True, jobs=1) == 0
    assert seen[0] is None  # nothing had finished
    assert seen[1]["trl-autocast"]["ran"] is True
    assert seen[1]["demo-model"] == {"ran": False, "why": gpucheck.PENDING}
    assert seen[1]["unsloth-4bit"] == {"ran": False, "why": "not asked for (--only)"}
    final = json.loads(path.read_text())["scenarios"]
    assert final["trl-autocast"]["ran"] is final["demo-model"]["ran"] is True


def test_the_prepared_run_needs_the_wheelhouse_carried(tmp_path) -> None:
    """.ci/gpu/run in a checkout without .whl/ (git-ignored, so a device call that does not carry it): exit 2 naming
    what to build and carry, before any install."""
    (tmp_path / ".ci" / "gpu").mkdir(parents=True)
    script = tmp_path / ".ci" / "gpu" / "run"
    script.write_text((ROOT / ".ci" / "gpu" / "run").read_text())
    environment = {key: value for key, value in os.environ.items() if key != "SITE"}
    result = subprocess.run(["bash", str(script), "check", str(tmp_path / "out")], env=environment,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr == (".whl/ holds no wheelhouse: build it (.ci/gpu/wheelhouse.sh .whl 3.12) and carry it to "
                             "the GPU\n")


def test_the_dry_run_has_a_cpu_equivalent_for_every_scenario_but_vllms(model_dir, tmp_path, capsys) -> None:
    assert set(gpucheck.DRY_RUN) == set(gpucheck.SCENARIOS) - {"vllm-kl-in-reward"}
    result = tmp_path / "result.json"
    assert gpucheck.scenario_process(["vllm-kl-in-reward", model_dir, str(tmp_path), str(result), "--dry-run"]) == 0
    assert capsys.readouterr().out == ("[untested] vllm-kl-in-reward: not run: it has no CPU equivalent (vLLM "
                                       "generates on CUDA only)\n")
    command = gpucheck.scenario_command("a", "m", "w", "r", dry_run=True)
    assert command[-5:] == ["a", "m", "w", "r", "--dry-run"] and ("-S" in command) == bool(sys.flags.no_site)


def test_the_dry_run_of_every_scenario_passes_with_vllms_line_untested(monkeypatch, capsys) -> None:
    """compatibility.md's `--gpu --dry-run` (no --only) exited 1 on every machine: vLLM's scenario, which has no CPU
    equivalent, was a FAIL line. It is an untested line now, counted as such; every other scenario runs its CPU
    equivalent (replaced here by one passing check each: their own runs are tested above and below)."""
    monkeypatch.setattr(gpucheck, "environment", lambda: {"device": {"kind": "cpu", "name": "x", "cores": 2},
                                                          "versions": {"torch": "2.0"}})
    for name in gpucheck.DRY_RUN:
        monkeypatch.setitem(gpucheck.SCENARIOS, name, lambda model_dir, work_dir, _name=name, **_: [Check(_name, True)])
    monkeypatch.setattr(gpucheck, "run_all", lambda names, root, run, budget_s, jobs, progress: (
        [Check("model", True)], {name: gpucheck.Ran(gpucheck.run_scenario(name, "m", "w", dry_run=True), 1.0)
                                 for name in names}))
    assert gpucheck.main(dry_run=True) == 0
    checks = len(gpucheck.SCENARIOS) + 1
    last = capsys.readouterr().out.splitlines()[-1]
    assert re.fullmatch(rf"GPU check dry run passed: {checks} of {checks} checks hold, 1 of them untested \(\d+ s\)",
                        last), last


def test_the_dry_run_of_a_scenario_runs_without_cuda_and_writes_the_results(tmp_path) -> None:
    """`--gpu --dry-run --only trl-fp16-scaler --json PATH` on this CPU: exit 0, the scenario's CPU equivalent in its
    own process (2 steps in float32), and the JSON marked as a dry run on a CPU."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    path = tmp_path / "check.json"
    result = subprocess.run([sys.executable, "-m", "unsloth_adaptive_kl", "--gpu", "--dry-run", "--only",
                             "trl-fp16-scaler", "--json", str(path)], cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    data = json.loads(path.read_text())
    assert (data["dry_run"], data["device"]["kind"]) == (True, "cpu")
    (check,) = data["scenarios"]["trl-fp16-scaler"]["checks"]
    assert check["ok"] and check["name"] == "TRL, fp32 (no GradScaler) on cpu", check
    assert "2 of 2 optimizer steps applied" in check["detail"]
    assert [name for name, s in data["scenarios"].items() if s["ran"]] == ["trl-fp16-scaler"]


def run_module(monkeypatch: pytest.MonkeyPatch, *flags: str) -> int:
    """`python -m unsloth_adaptive_kl FLAGS`, the module run in this process: its exit code."""
    import runpy

    monkeypatch.setattr(sys, "argv", ["python -m unsloth_adaptive_kl", *flags])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_module("unsloth_adaptive_kl", run_name="__main__")
    return exit_info.value.code


def test_the_gpu_flags_need_gpu(monkeypatch, capsys, tmp_path) -> None:
    """`python -m unsloth_adaptive_kl --budget 60 --jobs 2` (the module run in this process): a usage error naming
    both flags, before anything runs (`--json` is the self-check's too)."""
    assert run_module(monkeypatch, "--budget", "60", "--jobs", "2") == 2
    assert "error: --jobs, --budget: only with --gpu" in capsys.readouterr().err
    assert run_module(monkeypatch, "--only", "trl-autocast") == 2  # one such flag
    assert "error: --only: only with --gpu" in capsys.readouterr().err
    # with --gpu: jobs 0 ran one at a time, a budget of -5 s failed every scenario as "not run"
    for flags, message in ((["--jobs", "0"], "--jobs=0 is invalid: allowed is an integer >= 1"),
                           (["--budget", "-5"], "--budget=-5.0 is invalid: allowed is a finite number of seconds > 0"),
                           (["--budget", "nan"], "--budget=nan is invalid"),
                           (["--budget", "inf"], "--budget=inf is invalid"),
                           (["--budget", "0"], "--budget=0.0 is invalid")):
        assert run_module(monkeypatch, "--gpu", "--dry-run", *flags) == 2
        assert f"error: {message}" in capsys.readouterr().err
    # the self-check's --json a folder: an IsADirectoryError once every check had run; now refused first
    assert run_module(monkeypatch, "--json", "/") == 2
    assert "error: --json='/' is a folder: allowed is a file's path" in capsys.readouterr().err
    # a --json that cannot be written (it was found after every check had run) and an unknown --gpu scenario (it
    # exited 1, as a failed check): usage errors now (exit 2), before anything runs
    for flags, message in ((["--json", "/proc/selfcheck.json"], "--json='/proc/selfcheck.json' cannot be written ("),
                           (["--gpu", "--dry-run", "--only", "bogus"], "--only: unknown scenario bogus; allowed: ")):
        assert run_module(monkeypatch, *flags) == 2 and f"error: {message}" in capsys.readouterr().err
    # the --json check before a usage error leaves no trace: an existing record kept as it was, no new file made
    kept, new = tmp_path / "kept.json", tmp_path / "records" / "check.json"
    kept.write_text('{"kept": 1}')
    for path in (kept, new):
        assert run_module(monkeypatch, "--gpu", "--only", "bogus", "--json", str(path)) == 2
        assert "error: --only: unknown scenario bogus" in capsys.readouterr().err
    assert kept.read_text() == '{"kept": 1}' and not new.exists() and new.parent.is_dir()


def test_the_prepared_gpu_run_checks_every_scenario_but_vllms_and_names_its_commands(tmp_path) -> None:
    """.ci/gpu/run: its check runs every scenario of the GPU check except vLLM's (whose wheels cannot travel), with
    Unsloth's first; an unknown command is a usage error (exit 2) before anything runs."""
    script = ROOT / ".ci" / "gpu" / "run"
    only = next(line.split("--only ")[1].split() for line in script.read_text().splitlines() if "--only " in line)
    names = only[0].split(",")
    assert sorted(names) == sorted(set(gpucheck.SCENARIOS) - {"vllm-kl-in-reward"}) and names[0] == "unsloth-4bit"
    result = subprocess.run(["bash", str(script), "nope", str(tmp_path)], env={**os.environ, "SITE": str(tmp_path)},
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and result.stderr == "usage: .ci/gpu/run check|cost|loss OUT\n"


def test_the_prepared_cost_and_loss_commands_pass_the_arguments_after_out_to_their_benchmark(tmp_path) -> None:
    """`.ci/gpu/run cost OUT --rounds 4` (a lease whose rounds are already recorded gives the whole steps the time):
    the benchmark gets its budget, its JSON under OUT and the arguments given after OUT, in that order; BUDGET sets
    the budget. The python is `echo` here, so the command line is what runs."""
    script = ROOT / ".ci" / "gpu" / "run"
    env = {**os.environ, "SITE": str(tmp_path), "PYTHON": "echo"}
    for what, extra, budget, expected in (
            ("cost", ["--rounds", "4"], None, "benchmarks/unsloth_cost.py --budget 480 --json {out}/cost.json "
                                              "--rounds 4"),
            ("loss", [], "200", "benchmarks/loss_overhead.py --budget 200 --json {out}/loss_overhead.json")):
        result = subprocess.run(["bash", str(script), what, str(tmp_path), *extra], capture_output=True, text=True,
                                env={**env, **({"BUDGET": budget} if budget else {})}, timeout=60)
        assert result.returncode == 0, result.stderr
        assert result.stdout == expected.format(out=tmp_path) + "\n"


def test_the_scenarios_keep_truncated_completions_in_the_loss(monkeypatch) -> None:
    """Every trainer of the self-check's (the GPU scenarios' and the cost benchmark's too: they build it with
    `selfcheck.tiny_trainer`) gets TRL's mask_truncated_completions=False explicitly: Unsloth's generated config turns
    it on for loss_type='dapo', and the tiny Llama, which seldom samples EOS, then had every completion masked out of
    the loss (all-zero gradients in the dry run's Unsloth scenarios; the self-check failed on 7 of 16 sampling seeds).
    A trainer that asks for it still gets it; the scenarios' trainers pass their fields through unchanged."""
    import trl

    from unsloth_adaptive_kl.tools import selfcheck

    class Built(Exception):
        pass

    def config(**settings):
        raise Built(settings)

    monkeypatch.setattr(trl, "GRPOConfig", config)
    for overrides, expected in (({}, False), ({"mask_truncated_completions": True}, True)):
        with pytest.raises(Built) as built:
            selfcheck.tiny_trainer("w", **overrides)
        assert built.value.args[0]["mask_truncated_completions"] is expected
    seen = []
    monkeypatch.setattr(selfcheck, "tiny_trainer", lambda work_dir, **kwargs: seen.append(kwargs))
    scenarios.chat_trainer("m", "w", "unsloth", "cpu", "fp32", policy=("model", "tokenizer"), max_steps=1)
    assert "mask_truncated_completions" not in seen[0]
    assert seen[0]["max_steps"] == 1 and seen[0]["use_cpu"] is True and seen[0]["prompts"] == scenarios.CHAT_PROMPTS


# ----- what a mutation audit of tools/gpucheck.py found unpinned: what counts as a pass, what the JSON holds ----------


def save_llama(hidden_size: int = 256, num_heads: int = 4, vocab_size: int = 128, positions: int = 1024):
    """A stand-in for `save_tiny_llama`: a one-layer Llama of head_dim 64 (explicit) with the given sizes, and the
    chat tokenizer."""
    def save(model_dir: str, seed: int = 0):
        from transformers import LlamaConfig, LlamaForCausalLM

        from unsloth_adaptive_kl.tools.tiny import CHAT_ALPHABET, CHAT_TEMPLATE, build_tokenizer

        tokenizer = build_tokenizer(CHAT_ALPHABET, chat_template=CHAT_TEMPLATE, vocab_size=vocab_size)
        config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                             num_hidden_layers=1, num_attention_heads=num_heads, num_key_value_heads=num_heads,
                             head_dim=64, max_position_embeddings=positions, pad_token_id=tokenizer.pad_token_id,
                             eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
        model.save_pretrained(model_dir)
        tokenizer.save_pretrained(model_dir)
        return model

    return save


@pytest.mark.parametrize(("sizes", "detail"), [
    ({}, None),
    ({"hidden_size": 96, "num_heads": 1}, "hidden 96, head_dim 64, vocab 128, max_position_embeddings 1024"),
    ({"vocab_size": 100}, "hidden 256, head_dim 64, vocab 100, max_position_embeddings 1024"),
    ({"positions": 511}, "hidden 256, head_dim 64, vocab 128, max_position_embeddings 511"),
    ({"positions": 512}, None),
], ids=["all-sizes-fit", "hidden-not-a-multiple-of-64", "vocab-not-a-multiple-of-64", "positions-below-512",
        "positions-exactly-512"])
def test_the_shapes_check_fails_for_each_size_a_gpu_path_cannot_run(tmp_path, monkeypatch, sizes, detail) -> None:
    """bitsandbytes' 4-bit blocks need hidden and vocab sizes that are multiples of 64, and the scenarios sequences of
    up to MAX_SEQ_LENGTH = 512 positions: a model off in any one size alone fails the shapes check."""
    monkeypatch.setattr(gpucheck, "save_tiny_llama", save_llama(**sizes))
    checks = gpucheck.build_tiny_llama(str(tmp_path / "m"))
    assert [c.ok for c in checks] == [detail is None, True, True], [c.line() for c in checks]
    if detail is not None:
        assert checks[0].detail == f"{detail} (max_seq_length 512)"


def edit_json(path: Path, **changes) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def lowercase_normalizer(folder: Path) -> None:
    edit_json(folder / "tokenizer.json", normalizer={"type": "Lowercase"})


def perturbed_weights(folder: Path) -> None:
    from safetensors.torch import load_file, save_file

    weights = load_file(folder / "model.safetensors")
    weights["model.norm.weight"] = weights["model.norm.weight"] + 1e-3
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize(("edit", "failed"), [
    (lambda f: edit_json(f / "tokenizer_config.json", padding_side="right"), "tiny Llama: tokenizer reloads"),
    (lambda f: (f / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}"),
     "tiny Llama: tokenizer reloads"),
    (lowercase_normalizer, "tiny Llama: tokenizer reloads"),  # 'What is 2 + 3?' no longer decodes to itself
    (lambda f: (edit_json(f / "tokenizer_config.json", pad_token="<eos>"),
                edit_json(f / "config.json", pad_token_id=1)),
     "tiny Llama: tokenizer reloads"),  # pad == eos, in the tokenizer and the config alike
    (lambda f: edit_json(f / "config.json", pad_token_id=5), "tiny Llama: tokenizer reloads"),  # config's pad != its
    (perturbed_weights, "tiny Llama: weights reload"),
], ids=["padding-right", "other-chat-template", "decode-not-round-trip", "pad-is-eos", "config-pad-id-differs",
        "weights-differ"])
def test_the_reload_checks_fail_for_a_saved_folder_that_differs_from_the_model(tmp_path, monkeypatch, edit, failed):
    """The tiny Llama's folder changed after saving, one thing at a time: the check of that thing fails, and only
    it."""
    real = gpucheck.save_tiny_llama

    def save_then_edit(model_dir: str, seed: int = 0):
        model = real(model_dir, seed)
        edit(Path(model_dir))
        return model

    monkeypatch.setattr(gpucheck, "save_tiny_llama", save_then_edit)
    checks = gpucheck.build_tiny_llama(str(tmp_path / "m"))
    assert [c.name for c in checks if not c.ok] == [failed], [c.line() for c in checks]
    if failed == "tiny Llama: weights reload":
        diff = float(checks[2].detail.split()[-1])
        assert 0 < diff < 1  # the norm's 1e-3 shift, times hidden states of size ~1, through the output layer


@pytest.mark.parametrize("moves, given", [({"a": 50, "b": 50}, [100, 50]), ({"a": 69, "b": 2}, [100, 31])],
                         ids=["50-s-each", "31-s-left"])
def test_run_all_gives_each_scenario_what_is_left_of_the_budget_and_its_own_time(tmp_path, monkeypatch, moves,
                                                                                 given) -> None:
    """A 100 s budget and a clock that each scenario moves: by 50 s each, the first runs with 100 s, the second with
    the 50 s left, the third (0 s left) does not; by 69 s then 2 s, the second runs with 31 s left, the third (29 s
    left) does not (docs/compatibility.md: under 30 seconds left, a scenario is not run). Each outcome takes its own
    time."""
    clock = [1000.0]
    monkeypatch.setattr(gpucheck, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    monkeypatch.setattr(gpucheck, "build_tiny_llama", lambda model_dir: [Check("model", True)])
    timeouts = []

    def run(name, model_dir, work_dir, timeout):
        timeouts.append(timeout)
        clock[0] += moves[name]
        return [Check(f"{name}: thing", True)], ""

    _, ran = gpucheck.run_all(["a", "b", "c"], str(tmp_path), run=run, budget_s=100)
    assert timeouts == given
    assert [(o.checks[0].line(), o.seconds) for o in ran.values()] == [
        ("[ok] a: thing", moves["a"]), ("[ok] b: thing", moves["b"]),
        ("[FAIL] c: not run: the 100-second budget is spent", 0)]


def test_run_all_prints_the_last_30_lines_of_a_failed_scenarios_log(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setattr(gpucheck, "build_tiny_llama", lambda model_dir: [Check("model", True)])
    log = "\n".join(f"log line {i}" for i in range(1, 41))
    gpucheck.run_all(["a"], str(tmp_path), run=lambda *args: ([Check("a", False, "boom")], log))
    out = capsys.readouterr().out
    assert "    --- a: the last 30 lines of its log ---\n    log line 11\n" in out and out.endswith("    log line 40\n")
    assert "log line 10\n" not in out


def test_a_scenario_process_runs_offline_with_its_own_compile_cache_and_this_checkout_first(monkeypatch,
                                                                                            tmp_path) -> None:
    """`scenario_env`: offline and without telemetry whatever the caller's environment says, the compile cache in the
    work folder, this checkout first on PYTHONPATH, and 4 compile workers unless the caller chose a number."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "2")
    env = gpucheck.scenario_env(str(tmp_path))
    expected = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                "UNSLOTH_DISABLE_STATISTICS": "1", "TOKENIZERS_PARALLELISM": "false", "WANDB_DISABLED": "true",
                "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor_cache"), "TORCHINDUCTOR_COMPILE_THREADS": "2",
                "PYTHONPATH": f"{ROOT}{os.pathsep}/elsewhere"}
    assert {key: env.get(key) for key in expected} == expected
    monkeypatch.delenv("TORCHINDUCTOR_COMPILE_THREADS")
    monkeypatch.delenv("PYTHONPATH")
    env = gpucheck.scenario_env(str(tmp_path))
    assert (env["TORCHINDUCTOR_COMPILE_THREADS"], env["PYTHONPATH"]) == ("4", str(ROOT))


def test_run_scenario_gives_a_scenario_its_cpu_arguments_in_a_dry_run_only(monkeypatch) -> None:
    """trl-autocast's CPU equivalent: bf16 autocast on the CPU for 2 steps; outside a dry run, its GPU defaults."""
    seen = []
    monkeypatch.setitem(gpucheck.SCENARIOS, "trl-autocast", lambda model_dir, work_dir, **kwargs: seen.append(
        (model_dir, work_dir, kwargs)) or [Check("t", True)])
    assert gpucheck.run_scenario("trl-autocast", "m", "w", dry_run=True) == [Check("t", True)]
    assert gpucheck.run_scenario("trl-autocast", "m", "w") == [Check("t", True)]
    assert seen == [("m", "w", {"device": "cpu", "precision": "bf16", "steps": 2}), ("m", "w", {})]


def test_the_gpu_check_runs_one_job_at_a_time_within_25_minutes_by_default(monkeypatch, tmp_path) -> None:
    """`python -m unsloth_adaptive_kl --gpu --dry-run` (the module run in this process, the check itself faked): the
    defaults of docs/compatibility.md, one scenario at a time and 25 minutes in all; the flags given handed on as
    typed, and the check's exit code (without --gpu, the self-check's) the module's."""
    calls = []
    monkeypatch.setattr(gpucheck, "main", lambda *args: calls.append(args) or 0)
    assert run_module(monkeypatch, "--gpu", "--dry-run") == 0 and calls == [(None, 1, None, True, 25 * 60)]
    path = str(tmp_path / "check.json")
    monkeypatch.setattr(gpucheck, "main", lambda *args: calls.append(args) or 1)  # a check failed: exit 1
    assert run_module(monkeypatch, "--gpu", "--only", "trl-autocast", "--jobs", "2", "--budget", "90", "--json",
                      path) == 1
    assert calls[1:] == [("trl-autocast", 2, path, False, 90.0)]
    # without --gpu, the self-check's exit code is the module's
    monkeypatch.setattr(selfcheck, "main", lambda json_path: calls.append(json_path) or 1)
    assert run_module(monkeypatch, "--json", path) == 1 and calls[2:] == [path]


def test_main_hands_its_jobs_budget_and_dry_run_on_and_records_the_command_and_its_time(monkeypatch,
                                                                                      tmp_path) -> None:
    """main with a clock that the run moves by 42.5 s: run_all gets the names, the budget and the jobs asked for, and
    scenario processes in the dry run; the JSON records the command line as typed, the date and the 42.5 s."""
    import time

    clock = [1000.0]
    monkeypatch.setattr(gpucheck, "time", types.SimpleNamespace(perf_counter=lambda: clock[0],
                                                                strftime=time.strftime))
    monkeypatch.setattr(gpucheck, "environment", lambda: {"device": {"kind": "cpu", "name": "x", "cores": 2},
                                                          "versions": {"torch": "2.0"}})
    monkeypatch.setattr(gpucheck, "run_isolated", lambda name, model_dir, work_dir, timeout, dry_run: dry_run)
    seen = {}

    def run_all(names, root, run, budget_s, jobs, progress):
        seen.update(names=names, budget_s=budget_s, jobs=jobs, dry_run=run("trl-autocast", "m", "w", 1.0))
        clock[0] += 42.5
        return [Check("model", True)], {"trl-autocast": gpucheck.Ran([Check("a", True)], 40.0)}

    monkeypatch.setattr(gpucheck, "run_all", run_all)
    monkeypatch.setattr(sys, "argv", ["/site/unsloth_adaptive_kl/__main__.py", "--gpu", "--dry-run", "--only",
                                      "trl-autocast", "--jobs", "3", "--budget", "90", "--json", "a b.json"])
    path = tmp_path / "check.json"
    assert gpucheck.main(only="trl-autocast", jobs=3, json_path=str(path), dry_run=True, budget_s=90.0) == 0
    assert seen == {"names": ["trl-autocast"], "budget_s": 90.0, "jobs": 3, "dry_run": True}
    data = json.loads(path.read_text())
    assert data["command"] == ("python -m unsloth_adaptive_kl --gpu --dry-run --only trl-autocast --jobs 3 "
                               "--budget 90 --json 'a b.json'")
    assert data["seconds"] == 42.5 and re.fullmatch(r"\d{4}-\d{2}-\d{2}", data["date"])


def fake_run(monkeypatch, model_checks: list, outcomes: dict) -> None:
    """`main` (a dry run, so that no GPU is needed) with the model's checks and the scenarios' outcomes given."""
    monkeypatch.setattr(gpucheck, "environment", lambda: {"device": {"kind": "cpu", "name": "x", "cores": 2},
                                                          "versions": {"torch": "2.0"}})
    monkeypatch.setattr(gpucheck, "run_all", lambda names, root, run, budget_s, jobs, progress: (
        model_checks, {name: gpucheck.Ran(checks, 1.0) for name, checks in outcomes.items()}))


@pytest.mark.parametrize(("model_ok", "scenario_ok", "code", "summary"), [
    (True, (True, True), 0, "passed: 3 of 3"), (False, (True, True), 1, "FAILED: 2 of 3"),
    (True, (True, False), 1, "FAILED: 2 of 3"), (True, (False, True), 1, "FAILED: 2 of 3")])
def test_main_passes_only_if_the_model_and_every_scenario_check_holds(monkeypatch, tmp_path, capsys, model_ok,
                                                                       scenario_ok, code, summary) -> None:
    fake_run(monkeypatch, [Check("model", model_ok)], {
        "trl-autocast": [Check("a", scenario_ok[0])], "demo-model": [Check("b", scenario_ok[1])]})
    path = tmp_path / "out" / "check.json"
    assert gpucheck.main(only="trl-autocast,demo-model", json_path=str(path), dry_run=True) == code
    last = capsys.readouterr().out.splitlines()[-1]
    assert re.fullmatch(rf"GPU check dry run {summary} checks hold \(\d+ s\)", last), last
    data = json.loads(path.read_text())
    assert data["dry_run"] is True and data["model"] == [
        {"name": "model", "ok": model_ok, "detail": "", "untested": False}]
    assert [c["ok"] for name in ("trl-autocast", "demo-model") for c in data["scenarios"][name]["checks"]] == list(
        scenario_ok)


def test_the_environment_of_a_cuda_machine_names_the_card_and_every_package(monkeypatch) -> None:
    """A CUDA machine as torch and nvidia-smi would report it (faked here): the device's fields, its printed line,
    and every package of PACKAGES in the versions, None where it is not installed."""
    monkeypatch.setattr(gpucheck.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpucheck.torch.cuda, "get_device_capability", lambda index: (9, 0))
    monkeypatch.setattr(gpucheck.torch.cuda, "get_device_name", lambda index: "NVIDIA H200")
    monkeypatch.setattr(gpucheck.torch.version, "cuda", "12.4")
    monkeypatch.setattr(gpucheck, "native_precision", lambda: "bf16")
    monkeypatch.setattr(gpucheck, "driver_version", lambda: "550.54.15")
    # a copy of this package installed elsewhere (site-packages) beside the checkout that runs (on PYTHONPATH)
    monkeypatch.setattr(gpucheck, "installed_versions", lambda packages: {"unsloth_adaptive_kl": "0.0.9",
                                                                          "torch": "2.9.0", "trl": "1.15.0"})
    monkeypatch.setattr(gpucheck, "__version__", "0.1.0")
    monkeypatch.setenv("ADAPTIVE_KL_COMMIT", "0123abc")  # the tree travelled without its git folder
    found = gpucheck.environment()
    assert found["device"] == {"kind": "cuda", "name": "NVIDIA H200", "capability": "9.0", "precision": "bf16",
                               "cuda": "12.4", "driver": "550.54.15"}
    assert list(found["versions"]) == list(gpucheck.PACKAGES) and found["commit"] == "0123abc"
    # this package's version is the module's that runs, not an installed distribution's (none, or another copy)
    assert {p: v for p, v in found["versions"].items() if v} == {"unsloth_adaptive_kl": "0.1.0", "torch": "2.9.0",
                                                                  "trl": "1.15.0"}
    lines = gpucheck.environment_lines(found)
    assert lines[0] == "card: NVIDIA H200 (compute capability 9.0), precision bf16, CUDA 12.4, driver 550.54.15"
    assert lines[1].startswith("versions: unsloth_adaptive_kl==0.1.0, torch==2.9.0, transformers (not "
                               "installed), trl==1.15.0, peft (not installed)")
    assert len(lines) == 2
    unread = {**found, "device": {**found["device"], "driver": None}}  # nvidia-smi gave nothing
    assert gpucheck.environment_lines(unread)[0].endswith("CUDA 12.4, driver not read")
    monkeypatch.setattr(gpucheck, "native_precision", lambda: "fp16")  # a card without native bf16 (a T4)
    assert gpucheck.environment()["device"]["precision"] == "fp16"


def test_the_commit_is_the_checkouts_head_marked_where_tracked_files_changed(monkeypatch, tmp_path) -> None:
    """Outside ADAPTIVE_KL_COMMIT: `git rev-parse HEAD` of the checkout this package is in, "+changes" where a
    tracked file differs from it; None for a copy without its git folder."""
    monkeypatch.delenv("ADAPTIVE_KL_COMMIT", raising=False)
    checkout = tmp_path / "checkout"
    package = checkout / "unsloth_adaptive_kl" / "tools"
    package.mkdir(parents=True)
    monkeypatch.setattr(machine, "__file__", str(package / "machine.py"))
    assert machine.source_commit() is None  # no git folder
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(checkout)]
    (package / "machine.py").write_text("v1\n")
    subprocess.run(git + ["init", "-q"], check=True)
    assert machine.source_commit() is None  # a git folder without a commit: HEAD names none
    for command in (["add", "."], ["commit", "-qm", "one"]):
        subprocess.run(git + command, check=True)
    head = subprocess.run(git + ["rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    assert machine.source_commit() == head
    (package / "notes.txt").write_text("an untracked file\n")
    assert machine.source_commit() == head  # untracked files are no change to the source
    (package / "machine.py").write_text("v2\n")
    assert machine.source_commit() == head + "+changes"
    monkeypatch.setenv("ADAPTIVE_KL_COMMIT", "0123abc")  # where set, it wins over the checkout's own git
    assert machine.source_commit() == "0123abc"
    monkeypatch.setenv("ADAPTIVE_KL_COMMIT", "")  # set empty: as if unset
    assert machine.source_commit() == head + "+changes"

    def no_git(*args, **kwargs):
        raise FileNotFoundError(2, "No such file or directory: 'git'")

    monkeypatch.setattr(machine, "subprocess", types.SimpleNamespace(run=no_git, TimeoutExpired=TimeoutError))
    assert machine.source_commit() is None  # git not installed


def test_the_hardware_is_the_card_else_the_cpus_model_name_cores_and_torch_threads(monkeypatch) -> None:
    """On a CPU: /proc/cpuinfo's "model name" (x86 lists a numeric "model" line before it), the cores and torch's
    threads; where /proc/cpuinfo cannot be read, the platform's processor, else the architecture. On CUDA: the card."""
    import io

    cpuinfo = ["processor\t: 0\nvendor_id\t: GenuineIntel\nmodel\t\t: 143\nmodel name\t: Intel(R) Xeon(R) Platinum "
               "8480+\nflags\t\t: fpu\n"]

    def fake_open(path, *args, **kwargs):
        assert path == "/proc/cpuinfo"
        if not cpuinfo:
            raise PermissionError(13, "Permission denied", path)
        return io.StringIO(cpuinfo.pop())

    monkeypatch.setattr(machine, "open", fake_open, raising=False)
    monkeypatch.setattr(machine.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(machine.os, "cpu_count", lambda: 16)
    monkeypatch.setattr(machine.torch, "get_num_threads", lambda: 4)
    monkeypatch.setattr(machine.platform, "processor", lambda: "arm")
    monkeypatch.setattr(machine.platform, "machine", lambda: "aarch64")
    assert machine.hardware() == "CPU: Intel(R) Xeon(R) Platinum 8480+, 16 cores, 4 torch threads"
    assert machine.hardware() == "CPU: arm, 16 cores, 4 torch threads"  # no cpuinfo (macOS, or a sandbox)
    monkeypatch.setattr(machine.platform, "processor", lambda: "")  # Linux's platform.processor() is often ""
    assert machine.hardware() == "CPU: aarch64, 16 cores, 4 torch threads"
    monkeypatch.setattr(machine.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(machine.torch.cuda, "get_device_name", lambda index: "NVIDIA H100 80GB HBM3")
    assert machine.hardware() == "NVIDIA H100 80GB HBM3"


def test_installed_versions_lists_the_installed_packages_in_the_order_asked() -> None:
    import importlib.metadata

    found = machine.installed_versions(["torch", "no_such_package_for_this_test", "pytest"])
    assert list(found.items()) == [("torch", importlib.metadata.version("torch")),
                                   ("pytest", importlib.metadata.version("pytest"))]


def test_the_driver_version_is_the_first_cards_or_none(monkeypatch) -> None:
    def smi(stdout=None, error=None):
        def run(*args, **kwargs):
            if error:
                raise error
            return subprocess.CompletedProcess(args, 0, stdout=stdout)
        return run

    monkeypatch.setattr(gpucheck.subprocess, "run", smi("550.54.15\n550.54.15\n"))  # two cards
    assert gpucheck.driver_version() == "550.54.15"
    monkeypatch.setattr(gpucheck.subprocess, "run", smi(""))
    assert gpucheck.driver_version() is None
    monkeypatch.setattr(gpucheck.subprocess, "run", smi(error=FileNotFoundError("nvidia-smi")))
    assert gpucheck.driver_version() is None
    monkeypatch.setattr(gpucheck.subprocess, "run", smi(error=subprocess.TimeoutExpired("nvidia-smi", 30)))  # hung
    assert gpucheck.driver_version() is None


def test_run_all_runs_no_scenario_when_any_model_check_fails(tmp_path, monkeypatch) -> None:
    """A model that was built but whose tokenizer did not reload as saved: the scenarios would test a broken model,
    so none runs."""
    monkeypatch.setattr(gpucheck, "build_tiny_llama", lambda model_dir: [
        Check("tiny Llama: shapes every GPU path runs", True), Check("tiny Llama: tokenizer reloads", False),
        Check("tiny Llama: weights reload", True)])

    def run(*args):
        raise AssertionError("no scenario may run")

    _, ran = gpucheck.run_all(["a"], str(tmp_path), run=run)
    assert [c.line() for c in ran["a"].checks] == ["[FAIL] a: not run: the tiny model could not be built"]
