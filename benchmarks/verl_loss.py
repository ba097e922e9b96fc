"""verl's actor loss with adaptive KL against its stock loss, side by side (needs the [verl] extra).

    python benchmarks/verl_loss.py            # ~1 min on 2 CPU cores
    python benchmarks/verl_loss.py --smoke    # tiny repetition counts: checks that it runs and reports

On one micro-batch as verl's actor update sees it (nested prompts and responses, the policy log-probs of every
token as the model output), forward + backward of:
- stock: verl's own `ppo_loss` with its KL term (`use_kl_loss=True`, `kl_loss_type=low_var_kl`, `token-mean`);
- each method: `AdaptivePPOLoss` (one call of verl's `ppo_loss` whose `kl_penalty` and `agg_loss` give the adapted
  KL for that call, at kl_loss_coef = beta; verl's own KL term for `none`);
- an A/A control: a second, identical stock loss, half a rotation from stock.
Round-robin in a rotating order (benchmarks/loss_overhead.py `interleaved`); each row is median(method) /
median(stock) with a bootstrap 95 % interval. The model's forward and backward, which a real step adds to both, are
left out, so the ratio is an upper bound on the step's. Writes JSON and ends with `max_verl_loss_ratio=X.XXX`.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
from typing import Any, Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from loss_overhead import aa_half_way, bootstrap_ratio, interleaved  # noqa: E402

METHODS = ("none", "clip", "sigmoid", "length_normalized", "target", "sigmoid+length_normalized")
# (responses, response length, prompt length, interleaved rounds): a micro-batch of a typical GRPO run, or a tiny one
SIZES = {"full": (8, 1024, 256, 200), "smoke": (4, 16, 4, 5)}


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes and repetition counts")
    parser.add_argument("--json", default=None, help="default: benchmarks/verl_loss.json (the committed run); with "
                                                     "--smoke, verl_loss_smoke.json in the temp folder")
    args = parser.parse_args(argv)
    if args.json is None:  # a smoke run never overwrites the committed figures
        args.json = (os.path.join(tempfile.gettempdir(), "verl_loss_smoke.json") if args.smoke
                     else "benchmarks/verl_loss.json")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    from verl.utils import tensordict_utils as tu
    from verl.workers.config import ActorConfig
    from verl.workers.utils.losses import ppo_loss

    from unsloth_adaptive_kl import AdaptiveKLConfig
    from unsloth_adaptive_kl.integrations.verl import BETA_KEY, AdaptivePPOLoss
    from unsloth_adaptive_kl.tools.tiny import verl_loss_and_grad, verl_micro_batch

    def forward_backward(loss_fn: Callable[..., Any]) -> Callable[[], None]:
        return lambda: verl_loss_and_grad(loss_fn, data, values, offsets)

    torch.set_num_threads(1)
    started = time.perf_counter()
    responses, response_length, prompt_length, repeats = SIZES["smoke" if args.smoke else "full"]
    data, values, offsets = verl_micro_batch(responses, response_length, prompt_length)
    # The beta the driver puts in every micro-batch's non-tensor data, as in a run (stock's ppo_loss never reads it)
    tu.assign_non_tensor(data, **{BETA_KEY: 0.04})
    config = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, use_kl_loss=True,
                         kl_loss_coef=0.04, kl_loss_type="low_var_kl", loss_agg_mode="token-mean", entropy_coeff=0.0)

    def stock(model_output: Any, data: Any) -> Any:
        return ppo_loss(config, model_output, data)

    functions = {"stock": forward_backward(stock), "stock (A/A)": forward_backward(stock)}
    for method in METHODS:
        loss = AdaptivePPOLoss(config, AdaptiveKLConfig(kl_adaptation_method=method))
        functions[method] = forward_backward(loss)
    samples = interleaved({name: functions[name] for name in aa_half_way("stock", "stock (A/A)", list(METHODS))},
                          repeats=repeats)
    stock_ms = statistics.median(samples["stock"]) * 1e3
    rows = []
    for name in list(functions)[1:]:  # the A/A row first, then the methods, as the page lists them
        times = samples[name]
        low, high = bootstrap_ratio(times, samples["stock"], resamples=200 if args.smoke else 2000)
        rows.append({"method": name, "median_ms": statistics.median(times) * 1e3,
                     "ratio": statistics.median(times) / statistics.median(samples["stock"]), "ci": [low, high]})
    from unsloth_adaptive_kl.tools.machine import hardware, source_commit

    result = {"command": shlex.join(["python", "benchmarks/verl_loss.py", *(sys.argv[1:] if argv is None else argv)]),
              "date": time.strftime("%Y-%m-%d"), "machine": hardware(), "commit": source_commit(),
              "responses": responses, "response_length": response_length, "prompt_length": prompt_length,
              "repeats": len(samples["stock"]), "stock_ms": stock_ms,
              "rows": rows, "torch": torch.__version__, "seconds": time.perf_counter() - started}
    import verl

    result["verl"] = verl.__version__
    print(f"verl {verl.__version__} ppo_loss, {responses} responses of {response_length // 2} to "
          f"{response_length} tokens, forward + backward: stock {stock_ms:.3f} ms (median of "
          f"{result['repeats']})")
    for row in rows:
        print(f"  {row['method']:28s} {row['median_ms']:8.3f} ms  x{row['ratio']:.3f}  "
              f"[{row['ci'][0]:.3f}, {row['ci'][1]:.3f}]")
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(result, f, indent=2)
    worst = max((row for row in rows if row["method"] != "stock (A/A)"), key=lambda row: row["ratio"])
    aa = next(row for row in rows if row["method"] == "stock (A/A)")
    print(f"max_verl_loss_ratio={worst['ratio']:.3f} ({worst['method']}) ci=[{worst['ci'][0]:.3f},"
          f"{worst['ci'][1]:.3f}] aa=[{aa['ci'][0]:.3f},{aa['ci'][1]:.3f}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
