"""How many of the package's Python frames one own-loop step enters: `kl_loss` + backward + `step`, counted with
`sys.setprofile` (every "call" event whose code lives in unsloth_adaptive_kl/), after one warm-up step.

    python benchmarks/frame_count.py                    # clip, the default loss type
    python benchmarks/frame_count.py --method none --json frames.json

Prints the frames entered, the distinct named functions and modules, the functions entered more than once, and the
modules `kl_loss` passes through in order (its "stays": a run of frames in one module, the config's property reads
left out), with the returns to a module already left. Run it from another checkout (`git worktree add /tmp/old <commit>`, then `PYTHONPATH=/tmp/old python
benchmarks/frame_count.py`) to compare two versions: the package is the one Python imports.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
from typing import Any, Callable

import torch

import unsloth_adaptive_kl
from unsloth_adaptive_kl import AdaptiveKL, AdaptiveKLConfig

PACKAGE = os.path.dirname(unsloth_adaptive_kl.__file__)


def entered(run: Callable[[], Any]) -> list[tuple[str, str]]:
    """(module, function) of each of the package's frames `run` enters, in order."""
    calls: list[tuple[str, str]] = []

    def profile(frame: Any, event: str, _: Any) -> None:
        if event == "call" and frame.f_code.co_filename.startswith(PACKAGE):
            module = os.path.relpath(frame.f_code.co_filename, PACKAGE)[:-3].replace(os.sep, ".")
            calls.append((module, frame.f_code.co_name))

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return calls


def stays(calls: list[tuple[str, str]]) -> list[str]:
    """The modules in order, one entry per run of consecutive frames in the same module; the config's frames (a
    property read of a setting, wherever it happens) are left out."""
    trail: list[str] = []
    for module, _ in calls:
        if module != "core.config" and (not trail or trail[-1] != module):
            trail.append(module)
    return trail


def main() -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--method", default="clip", help="kl_adaptation_method (default clip)")
    parser.add_argument("--json", metavar="PATH", help="write the counts to PATH")
    args = parser.parse_args()
    generator = torch.Generator().manual_seed(0)
    logp = (-torch.rand(8, 64, generator=generator) * 3).requires_grad_(True)
    ref = logp.detach() + torch.randn(8, 64, generator=generator) * 0.2
    mask = (torch.rand(8, 64, generator=generator) < 0.9).float()
    akl = AdaptiveKL(AdaptiveKLConfig(kl_adaptation_method=args.method), beta=0.1, loss_type="grpo")

    def loss_only() -> None:
        akl.kl_loss(logp, ref, mask)

    def one_step() -> None:
        loss, _ = akl.kl_loss(logp, ref, mask)
        loss.backward()
        akl.step(mean_reward=0.5)

    one_step()  # warm-up: first-call caches (the parsed methods) are not what a step costs
    step_calls, loss_calls = entered(one_step), entered(loss_only)
    counts = collections.Counter(step_calls)
    trail = stays(loss_calls)
    returns = sum(1 for index, module in enumerate(trail) if module in trail[:index])
    result = {
        "method": args.method, "frames": len(step_calls), "named_functions": len(counts),
        "modules": sorted({module for module, _ in step_calls}),
        "repeated": {f"{module}.{name}": n for (module, name), n in counts.most_common() if n > 1},
        "kl_loss_stays": trail, "kl_loss_returns": returns,
    }
    print(f"kl_loss + backward + step ({args.method}): {result['frames']} frames, {result['named_functions']} named "
          f"functions, {len(result['modules'])} modules: {', '.join(result['modules'])}")
    print("entered more than once: " + (", ".join(f"{name} x{n}" for name, n in result["repeated"].items()) or "none"))
    print(f"kl_loss passes through {len(trail)} stays, {returns} of them returns to a module already left: "
          + " -> ".join(trail))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=1)
    return result


if __name__ == "__main__":
    main()
