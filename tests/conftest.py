"""Shared fixtures: a tiny offline model, a GRPO trainer factory and fixed loss inputs. Imports torch alone: the
core's tests run where trl is not installed (CI row g); the trainer helpers import trl when called."""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
import torch

torch.set_num_threads(1)  # on 2 cores thread oversubscription makes each step 30-100x slower

import unsloth_adaptive_kl  # noqa: E402,F401  (patches TRL where it is installed)
from unsloth_adaptive_kl.core import estimators, reductions, registry  # noqa: E402
from unsloth_adaptive_kl.tools.selfcheck import stock_trl  # noqa: E402,F401  (stock TRL inside the block)

PROMPTS = ["ab:", "cde:", "fg:", "h:", "bad:", "ce:", "gh:", "abc:"]

# The name tables as the package defines them (its built-ins alone), taken before any test registers a name of its own.
REGISTRIES = (registry.SHAPINGS, registry.BETA_CONTROLLERS, estimators._ESTIMATORS, reductions.REDUCTIONS)
BUILT_INS = [dict(table) for table in REGISTRIES]


@contextlib.contextmanager
def built_in_registries() -> Iterator[None]:
    """The name tables hold the package's built-ins alone inside the block (what a fresh process has), and whatever
    they held before after it: a docs block prints what it prints run on its own."""
    saved = [dict(table) for table in REGISTRIES]
    try:
        for table, built_in in zip(REGISTRIES, BUILT_INS):
            table.clear()
            table.update(built_in)
        yield
    finally:
        for table, before in zip(REGISTRIES, saved):
            table.clear()
            table.update(before)


def hash_reward(completions: list[str], **kwargs: Any) -> list[float]:
    """1 if the completion contains '#', else a small length-dependent reward (so advantages are non-zero)."""
    return [1.0 if "#" in text else 0.1 * (len(text) % 5) for text in completions]


def constant_reward(value: float) -> Callable[..., list[float]]:
    def reward(completions: list[str], **kwargs: Any) -> list[float]:
        return [value] * len(completions)

    reward.__name__ = f"constant_{value}"
    return reward


# The test files that hold minutes of work each, the longest first (worker seconds with --durations on a 2-core AMD
# EPYC, 2026-12-07: 485, 471, 372, 361, 189; the next is 92).
LONGEST_FILES = ("test_unsloth.py", "test_trainer_lab.py", "test_unsloth_loss.py", "test_benchmark_smoke.py",
                 "test_demo.py")


def pytest_configure(config: pytest.Config) -> None:
    """pytest-xdist's `--dist loadfile` hands out the files with the most tests first, so a file of a few long tests
    went last: the README's test command ended with one worker idle for ~3 minutes while test_benchmark_smoke.py (3
    tests, ~6 minutes of work) ran alone. The files go out in collection order instead, the longest first (below);
    the option to keep that order is pytest-xdist 3.8's (the `test` extra's floor)."""
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


@pytest.hookimpl(trylast=True)  # after pytest's own -k and --deselect, so that the counts are of the tests that run
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """In xdist's workers, whose collections the files are handed out from: LONGEST_FILES in that order, then the
    others with the most tests first (xdist's own order); a file's tests keep theirs. A plain run keeps pytest's."""
    if not hasattr(config, "workerinput"):
        return
    counts = Counter(item.path.name for item in items)
    rank = {name: place for place, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: (rank.get(item.path.name, len(rank)), -counts[item.path.name], str(item.path)))


@pytest.hookimpl(wrapper=True, optionalhook=True)  # optional: pytest without pytest-xdist runs too
def pytest_xdist_auto_num_workers(config: pytest.Config) -> Any:
    """`-n auto`: pytest-xdist's count (a worker a core), at most 4 (`-n N` sets any other). Each worker holds about
    1 GB (torch, trl, transformers) and its tests start trainer processes of up to 1 GB more; past 4, the longest
    single tests (5-6 minutes) set the suite's time anyway."""
    return min(4, (yield))


def torchrun(script: Path, *args: str, timeout: int) -> None:
    """`torchrun --standalone --nproc_per_node 2 SCRIPT ARGS` on CPU: --standalone takes a free port, so two tests
    running at once (pytest -n) never meet on torchrun's default one."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[1])}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script),
               *args]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


@pytest.fixture(scope="session")
def tokenizer() -> Any:
    from unsloth_adaptive_kl.tools.tiny import build_tokenizer

    return build_tokenizer()


def grpo_args(output_dir: str, **overrides: Any) -> Any:
    """A small CPU GRPOConfig; `trl.GRPOConfig` is looked up at call time so it follows patch/unpatch."""
    import trl

    settings: dict[str, Any] = dict(
        output_dir=output_dir,
        use_cpu=True,
        bf16=False,
        report_to="none",
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=8,
        max_steps=2,
        logging_steps=1,
        learning_rate=5e-3,
        beta=0.04,
        save_strategy="no",
        gradient_accumulation_steps=2,
        seed=0,
        data_seed=0,
        disable_tqdm=True,
    )
    settings.update(overrides)
    return trl.GRPOConfig(**settings)


def make_trainer(
    tokenizer: Any,
    output_dir: str,
    reward: Optional[Callable[..., list[float]]] = None,
    model_kind: str = "peft_model",
    config: Any = None,
    **overrides: Any,
) -> Any:
    """A GRPO trainer on the tiny model: `peft_model` passes a LoRA PeftModel (TRL then adds its frozen "ref" adapter
    copy as the reference), `peft_config` the base model and the LoRA config (the trainer wraps it; the reference is
    the adapter disabled), `full` the base model alone, saved to a folder it loads from (so does its `ref_model`).
    `config`: a GRPOConfig of the caller's in place of `grpo_args(output_dir, **overrides)`."""
    import trl
    from datasets import Dataset
    from transformers import set_seed

    from unsloth_adaptive_kl.tools.tiny import add_lora, build_tiny_model, lora_config

    args = grpo_args(output_dir, **overrides) if config is None else config

    set_seed(0)
    model = build_tiny_model(tokenizer, seed=0)
    peft_config = None
    if model_kind == "peft_model":
        model = add_lora(model, seed=0)
    elif model_kind == "peft_config":
        torch.manual_seed(0)
        peft_config = lora_config()
    else:  # TRL loads its ref_model from the policy's path: the model goes by a folder
        model.save_pretrained(os.path.join(output_dir, "tiny-model"))
        if torch.distributed.is_initialized():  # process 0 wrote it: the others wait for it
            torch.distributed.barrier()
        model = os.path.join(output_dir, "tiny-model")
    dataset = Dataset.from_dict({"prompt": PROMPTS * 4})
    return trl.GRPOTrainer(
        model=model,
        processing_class=tokenizer,
        reward_funcs=[reward or hash_reward],
        args=args,
        train_dataset=dataset,
        peft_config=peft_config,
    )


def logged(trainer: Any, key: str) -> list[float]:
    return [entry[key] for entry in trainer.state.log_history if key in entry]


def at_the_test_commands_versions(names: tuple[str, ...]) -> bool:
    """Whether the installed `names` have the versions of the test command's CI row (docs/results/ci.json's row a),
    those the pages name where they show a run's output."""
    rows = json.loads((Path(__file__).parents[1] / "docs" / "results" / "ci.json").read_text())["rows"]
    row_a = next(row for row in rows if row["row"] == "a")
    try:
        return all(importlib.metadata.version(name) == row_a["versions"][name] for name in names)
    except importlib.metadata.PackageNotFoundError:
        return False


def pyproject() -> dict[str, Any]:
    """pyproject.toml, read with tomllib (Python 3.11 on; on 3.10 the test extra's tomli, which tomllib came from)."""
    try:
        import tomllib
    except ModuleNotFoundError:
        import tomli as tomllib
    return tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
