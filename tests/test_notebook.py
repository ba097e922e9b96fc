"""The Colab notebook: it runs top to bottom on CPU with the tiny default where the test allows the CPU (executed with
nbclient); without that it stops before installing anything; on Colab its install cell installs from the repository
around Colab's own torch."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import sys
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).parents[1]
NOTEBOOK = ROOT / "blackwell" / "adaptive_kl_grpo.ipynb"
REPOSITORY = "git+https://github.com/unsloth-adaptive-kl/unsloth-adaptive-kl"


def execute(notebook: nbformat.NotebookNode, path: Path, allow_errors: bool = False) -> list[dict]:
    """Run the cells in a fresh kernel whose working directory is `path` and which imports this checkout's package
    (not whichever copy is installed), as the Unsloth tests' subprocesses do (tests/unsloth_runs.py)."""
    pythonpath = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PYTHONPATH", pythonpath)
        NotebookClient(notebook, timeout=300, kernel_name="python3", allow_errors=allow_errors,
                       resources={"metadata": {"path": str(path)}}).execute()
    return [output for cell in notebook.cells if cell.cell_type == "code" for output in cell.get("outputs", [])]


def test_notebook_executes_on_cpu(tmp_path, monkeypatch) -> None:
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("ADAPTIVE_KL_NOTEBOOK_CPU", "1")  # the kernel inherits it: the CPU path, for this test only
    outputs = execute(notebook, tmp_path)
    assert not [output for output in outputs if output.output_type == "error"]
    text = "".join(output.get("text", "") for output in outputs)
    assert "CPU | unsloth_adaptive_kl 0.1.0" in text
    assert "dynamic+length_normalized seed 0" in text
    assert (tmp_path / "adaptive_kl_notebook_output" / "adaptive_kl_comparison.png").stat().st_size > 20_000
    assert any("image/png" in output.get("data", {}) for output in outputs)
    # summary.json records what ran (it named the script, which did not) and its wall time (it had null)
    summary = json.loads((tmp_path / "adaptive_kl_notebook_output" / "summary.json").read_text())
    assert summary["environment"]["command"].startswith("notebook blackwell/adaptive_kl_grpo.ipynb --steps 6 ")
    assert isinstance(summary["wall_seconds"], float) and summary["wall_seconds"] > 0
    # its variants are the script's default, read from the demo rather than a copy that could drift from it
    from unsloth_adaptive_kl.tools.demo import DEFAULT_METHODS

    settings = next(cell.source for cell in notebook.cells if cell.source.startswith("METHODS = "))
    assert settings.startswith("METHODS = demo.DEFAULT_METHODS") and summary["settings"]["methods"] == DEFAULT_METHODS


def colab_cells(cuda: bool, pip_returncode: int = 0, imports_cell: bool = False) -> list[nbformat.NotebookNode]:
    """The notebook's install cell (and its import cell) after a cell that makes the kernel look like Colab (a
    `google.colab` module), answers torch.cuda.is_available() with `cuda`, and records pip calls instead of running
    them, then a cell that prints the calls (with each constraints file's lines) as JSON."""
    cells = nbformat.read(NOTEBOOK, as_version=4).cells
    install = next(cell for cell in cells if cell.cell_type == "code" and "ADAPTIVE_KL_SPEC" in cell.source)
    imports = next(cell for cell in cells if cell.cell_type == "code" and "import unsloth_adaptive_kl" in cell.source)
    fake = nbformat.v4.new_code_cell(f"""
import importlib.machinery, subprocess, sys, types
import torch
sys.modules["google.colab"] = types.ModuleType("google.colab")
sys.modules["google.colab"].__spec__ = importlib.machinery.ModuleSpec("google.colab", None)
torch.cuda.is_available = lambda: {cuda}
PIP_CALLS = []
def run(command, **kwargs):
    constraints = command[command.index("-c") + 1] if "-c" in command else None
    PIP_CALLS.append({{"command": command, "kwargs": sorted(kwargs),
                       "constraints": open(constraints).read().splitlines() if constraints else None}})
    return subprocess.CompletedProcess(command, {pip_returncode}, "", "ERROR: ResolutionImpossible (test)")
subprocess.run = subprocess.check_call = subprocess.call = run
""")
    probe = nbformat.v4.new_code_cell("import json; print('PIP_CALLS', json.dumps(PIP_CALLS))")
    return [fake, install, *([imports] if imports_cell else []), probe]


def errors_and_calls(outputs: list[dict]) -> tuple[list[tuple[str, str]], list[dict]]:
    errors = [(output["ename"], output["evalue"]) for output in outputs if output.output_type == "error"]
    text = "".join(output.get("text", "") for output in outputs)
    calls = json.loads(text.split("PIP_CALLS ", 1)[1].splitlines()[0])
    return errors, calls


def test_on_colab_without_a_gpu_the_notebook_stops_before_installing(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("ADAPTIVE_KL_NOTEBOOK_CPU", raising=False)
    errors, calls = errors_and_calls(execute(nbformat.v4.new_notebook(cells=colab_cells(cuda=False, imports_cell=True)), tmp_path,
                                             allow_errors=True))
    assert calls == []  # nothing installed
    assert [name for name, _ in errors] == ["RuntimeError", "RuntimeError"]  # the install cell, then the import cell
    assert errors[0][1].startswith("No CUDA GPU is visible to torch, and this notebook trains on one. On Colab: "
                                   "Runtime > Change runtime type > a GPU")
    assert errors[1][1].startswith("No CUDA GPU is visible to torch ") and "the install broke CUDA" in errors[1][1]


def test_on_colab_with_a_gpu_the_install_cell_installs_from_the_repository_keeping_colabs_torch(tmp_path) -> None:
    errors, calls = errors_and_calls(execute(nbformat.v4.new_notebook(cells=colab_cells(cuda=True)), tmp_path,
                                             allow_errors=True))
    assert len(calls) == 1
    command = calls[0]["command"]
    assert command[:3] == [sys.executable, "-m", "pip"] and command[3] == "install"
    spec = command[-1]
    assert spec == f"unsloth-adaptive-kl[unsloth,demo] @ {REPOSITORY}"
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(r"^unsloth = \[", pyproject, re.M) and re.search(r"^demo = \[", pyproject, re.M)  # the extras
    # Every torch package installed here (as Colab's would be) is pinned to its installed version
    expected = []
    for name in ("torch", "torchvision", "torchaudio"):
        try:
            expected.append(f"{name}=={importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            pass
    assert expected[0].startswith("torch==") and calls[0]["constraints"] == expected
    assert errors == []


def test_on_colab_a_failed_install_stops_with_pips_reason(tmp_path) -> None:
    errors, calls = errors_and_calls(execute(nbformat.v4.new_notebook(cells=colab_cells(cuda=True, pip_returncode=1)),
                                             tmp_path, allow_errors=True))
    assert len(calls) == 1 and errors[0][0] == "RuntimeError"
    assert errors[0][1].startswith(f"pip could not install unsloth-adaptive-kl[unsloth,demo] @ {REPOSITORY} beside "
                                   "Colab's torch==")
    assert "ERROR: ResolutionImpossible (test)" in errors[0][1]
