"""The accelerate configs of the docs' "Scaling out" page (docs/accelerate/ddp.yaml, docs/accelerate/fsdp2.yaml), each
launched with `accelerate launch --config_file <yaml> --num_processes 2` on a tiny GRPO run with `dynamic` beta: both
processes run, and both log the same beta at every step and the same adaptive_kl metrics, decided on the mean over
both processes (rank 0 scores 1.0 on average, rank 1 0.6: only their mean, 0.8, crosses the 0.7 threshold).

On a CPU, accelerate (1.16) runs the FSDP config as DDP over gloo: `AcceleratorState` assigns `DistributedType.FSDP`
only in its branch for accelerator devices (MULTI_GPU and the like), and CPU processes are MULTI_CPU; the test pins
that, so that the docs' statement fails here the day accelerate shards on CPUs. FSDP2 sharding itself (torch's
`fully_shard` on two gloo processes, without accelerate's routing) is tested with the reference sync
(tests/test_ref_sync.py)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import accelerate  # noqa: F401  (a base dependency: this test is never skipped for want of it)
import pytest

from .conftest import at_the_test_commands_versions

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = Path(__file__).with_name("scaling_out_run.py")
CONFIGS = {"ddp": ROOT / "docs" / "accelerate" / "ddp.yaml", "fsdp2": ROOT / "docs" / "accelerate" / "fsdp2.yaml"}
DECAY, BETA = 0.5, 0.04


def accelerate_launch(arguments: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """`accelerate launch ARGUMENTS` run from `cwd` with this checkout importable; it must succeed."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", *arguments], env=env, cwd=cwd,
                            capture_output=True, text=True, timeout=540)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return result


def launch(config: Path, output_dir: Path, device: str) -> list[dict]:
    """`accelerate launch --config_file config --num_processes 2` the run script; each rank's JSON."""
    accelerate_launch(["--config_file", str(config), "--num_processes", "2", "--main_process_port", "0", str(SCRIPT),
                       str(output_dir), device], output_dir)
    files = sorted(output_dir.glob("rank*.json"))
    assert [f.name for f in files] == ["rank0.json", "rank1.json"], "both processes must write their own rank's file"
    return [json.loads(f.read_text()) for f in files]


def assert_both_ranks_agree_on_the_global_decision(ranks: list[dict]) -> None:
    assert all(rank["world_size"] == 2 for rank in ranks)
    assert ranks[0]["logged"] == ranks[1]["logged"]  # beta and every adaptive_kl metric, identical on each process
    assert ranks[0]["final_beta"] == ranks[1]["final_beta"]
    logged = ranks[0]["logged"]
    assert len(logged) == 3
    # The all-process mean reward (0.8) crossed the 0.7 threshold at every step: beta halved after each step on both
    # ranks, though rank 1's own mean (0.6) is below the threshold.
    assert [entry["reward"] for entry in logged] == pytest.approx([0.8] * 3)
    assert [entry["adaptive_kl/current_beta"] for entry in logged] == pytest.approx([BETA * DECAY**k for k in range(3)])
    assert ranks[0]["final_beta"] == pytest.approx(BETA * DECAY**3)
    assert max(entry["adaptive_kl/raw_kl"] for entry in logged) > 0  # the KL metrics are real, not zeros
    assert max(entry["adaptive_kl/sequence_kl"] for entry in logged) > 0


def by_hand(micro_batches: list[list[dict]]) -> dict[str, float]:
    """One step's logged raw_kl, adapted_kl and sequence_kl from each process's micro-batches (`micro_batches[p][j]`:
    process p's j-th of the step): the core gathers micro-batch j over the processes (its raw and adapted once each,
    its completions' S_i and L_i), and TRL logs the mean over the step's micro-batches."""
    per_batch = []
    for batches in zip(*micro_batches):
        sums = [s for batch in batches for s, length in zip(batch["sums"], batch["lengths"]) if length > 0]
        per_batch.append({"raw_kl": sum(batch["raw"] for batch in batches) / len(batches),
                          "adapted_kl": sum(batch["adapted"] for batch in batches) / len(batches),
                          "sequence_kl": sum(sums) / len(sums)})
    return {name: sum(batch[name] for batch in per_batch) / len(per_batch) for name in per_batch[0]}


def assert_metrics_are_over_both_ranks(ranks: list[dict]) -> None:
    """Each step's logged KL metrics are the two ranks' micro-batches combined by hand (`by_hand`), not one rank's:
    the ranks' completions differ, so rank 0's alone gives other figures."""
    apart = []  # how far rank 0's alone is from both ranks', each step (the first step's KL is 0: LoRA starts at 0)
    for entry in ranks[0]["logged"]:
        step = [[batch for batch in rank["micro_batches"] if batch["step"] == entry["step"]] for rank in ranks]
        assert [len(batches) for batches in step] == [2, 2]  # gradient_accumulation_steps=2 on each process
        both, alone = by_hand(step), by_hand(step[:1])
        for name, value in both.items():
            assert entry[f"adaptive_kl/{name}"] == pytest.approx(value, rel=1e-5, abs=1e-9), (name, entry)
        apart.append(abs(alone["sequence_kl"] - both["sequence_kl"]) / max(both["sequence_kl"], 1e-12))
    assert max(apart) > 1e-3, apart


@pytest.mark.parametrize("name", ["ddp", "fsdp2"])
def test_two_processes_on_cpu_log_the_same_beta_and_metrics(name: str, tmp_path: Path) -> None:
    ranks = launch(CONFIGS[name], tmp_path, "cpu")
    assert_both_ranks_agree_on_the_global_decision(ranks)
    assert_metrics_are_over_both_ranks(ranks)
    for rank in ranks:
        # use_cpu=True: gloo over two CPU processes; accelerate runs either config as DDP there (see the docstring)
        assert (rank["distributed_type"], rank["backend"], rank["model"]) == \
            ("MULTI_CPU", "gloo", "DistributedDataParallel"), rank



PAGE = ROOT / "docs" / "scaling-out.md"
PRINTED = re.compile(r"process \d of \d: step \d+ reward [\d.]+ beta [\d.]+ raw_kl [\d.]+")


def test_the_pages_two_process_example_prints_what_the_page_shows(tmp_path: Path) -> None:
    """The page's train.py (its python block that prints per process) under the page's two-process command, as a user
    runs them from a checkout: each process prints its three steps, both the same values. Where the installed versions
    are those of the test command's CI row (docs/results/ci.json's row a, which the page names), the lines are exactly
    the ones the page shows; with other versions (the matrix's other rows) only the agreement is checked. The script's
    ending (free the trainer, close the group) stops threads of gloo's while Python still runs: on Linux, each
    process's thread count, printed before and after it, falls."""
    text = PAGE.read_text()
    (script,) = [block for block in re.findall(r"```python\n(.*?)```", text, re.S) if "accelerator.state" in block]
    command, shown = re.search(r"```bash\n(accelerate launch [^\n]*--num_processes 2 [^\n]*)\n```\s*```text\n(.*?)```",
                               text, re.S).groups()
    # The script's ending (free the trainer, collect it, close the group) must stop the group's threads while Python
    # still runs: on Linux, each process prints its thread count before and after it.
    body, ending = script.rsplit("if torch.distributed.is_initialized():", 1)
    statements = [code for line in ending.splitlines()[1:] if (code := line.split("#")[0].strip())]
    assert statements == ["del trainer", "gc.collect()", "torch.distributed.destroy_process_group()"], ending
    threads = Path("/proc/self/task").is_dir()  # Linux's list of the process's threads
    count = ('print(f"threads of process {os.environ[\'RANK\']}: {len(os.listdir(\'/proc/self/task\'))}", flush=True)\n'
             if threads else "")
    (tmp_path / "train.py").write_text(f"import os\n{body}{count}if torch.distributed.is_initialized():{ending}{count}")
    (tmp_path / "docs" / "accelerate").mkdir(parents=True)
    shutil.copy(CONFIGS["ddp"], tmp_path / "docs" / "accelerate" / "ddp.yaml")
    assert command.split()[:2] == ["accelerate", "launch"]
    result = accelerate_launch(command.split()[2:], tmp_path)
    printed = sorted(PRINTED.findall(result.stdout))  # the processes' lines may interleave, even within a line
    steps = {rank: [line.split(": ", 1)[1] for line in printed if line.startswith(f"process {rank} of 2:")]
             for rank in (0, 1)}
    assert len(printed) == 6 and len(steps[0]) == 3 and steps[0] == steps[1], printed
    for rank in ("0", "1") if threads else ():
        counts = [int(n) for n in re.findall(rf"threads of process {rank}: (\d+)", result.stdout)]
        assert len(counts) == 2, result.stdout[-3000:]
        assert counts[1] < counts[0], (rank, counts)  # without the trainer freed first, the count stayed the same
    if at_the_test_commands_versions(("trl", "transformers", "torch", "accelerate")):
        assert printed == sorted(line.strip() for line in shown.strip().splitlines())
