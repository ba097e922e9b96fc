"""Run verl 0.9.1 on CPU (a subprocess of tests/test_verl.py and tests/test_verl_end_to_end.py; not collected). Test
fixtures only, never shipped.

    python tests/verl_cpu.py worker OUTPUT_JSON

verl has no CPU backend; what stands in for the missing accelerator, and only that:
- `PlatformCPU`, registered through verl's own `PlatformRegistry` and chosen with VERL_PLATFORM=cpu: device "cpu",
  gloo collectives, no-op memory statistics / empty_cache / synchronize (torch.cpu lacks them).
- verl's own FSDP engines (`FSDPEngineWithLMHead`, `FSDPEngineWithValueHead`) registered for device "cpu" through
  verl's own `EngineRegistry`: the engine code that runs is verl's, unchanged.
- A plain gloo process group (verl asks torch for "cpu:gloo,cpu:gloo", which torch rejects): the worker's call of
  `initialize_global_process_group_ray` passes backend="gloo".
- Unpinned CPU offload for the reference (verl's FSDP2 engine builds the forward-only model with
  CPUOffloadPolicy(pin_memory=True), and pinning needs an accelerator).
- An HF `generate` rollout (rollout.name=hf_cpu) registered in verl's rollout registries: the worker-side adapter
  pushes the trained weights to a Ray actor that samples with the HF model (verl registers only vLLM/SGLang/TRT-LLM).
The model is a tiny Llama built from a config (unsloth_adaptive_kl.tools.tiny), with use_remove_padding=False and
attn_implementation="eager" (flash-attn's padding-free path needs a GPU).
"""

from __future__ import annotations

import copy
import json
import os
import socket
import sys
import tempfile
import time
import types
from contextlib import contextmanager
from functools import partial

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402


class _CPUDeviceModule(types.ModuleType):
    """`torch.cpu`, plus the torch.cuda-style calls verl makes on its device module, as no-ops."""

    _ZERO = ("max_memory_allocated", "max_memory_reserved", "memory_allocated", "memory_reserved")
    _NOOP = ("empty_cache", "ipc_collect", "set_per_process_memory_fraction", "reset_peak_memory_stats",
             "manual_seed", "manual_seed_all", "set_device", "synchronize")

    def __init__(self) -> None:
        super().__init__("verl_cpu_device")

    def __getattr__(self, name):
        if name in self._ZERO:
            return lambda *args, **kwargs: 0
        if name in self._NOOP:
            return lambda *args, **kwargs: None
        if name == "get_device_name":
            return lambda *args, **kwargs: "CPU"
        if name == "mem_get_info":
            return lambda *args, **kwargs: (16 << 30, 16 << 30)
        if name == "get_rng_state":
            return lambda *args, **kwargs: torch.get_rng_state()
        if name == "set_rng_state":
            return lambda state, *args, **kwargs: torch.set_rng_state(state)
        return getattr(torch.cpu, name)


CPU_DEVICE_MODULE = _CPUDeviceModule()


def register() -> None:
    """Register the CPU platform and verl's FSDP engines for device "cpu" (idempotent)."""
    from verl.plugin.platform.platform_base import PlatformBase
    from verl.plugin.platform.platform_manager import PlatformRegistry

    if PlatformRegistry.get("cpu") is None:

        @PlatformRegistry.register(platform="cpu")
        class PlatformCPU(PlatformBase):
            device_name = "cpu"
            vendor_name = "cpu"
            device_module = CPU_DEVICE_MODULE

            def is_available(self):
                return True

            def is_platform_available(self, use_smi_check=False):
                return True

            def current_device(self):
                return "cpu"  # verl moves tensors with .to(get_device_id())

            def device_count(self):
                return 1

            def set_device(self, device_index):
                return None

            def synchronize(self, device_index=None):
                return None

            def manual_seed(self, seed):
                torch.manual_seed(seed)

            def manual_seed_all(self, seed):
                torch.manual_seed(seed)

            def set_allocator_settings(self, settings):
                return None

            def empty_cache(self):
                return None

            def get_device_capability(self, device_index=0):
                return None, None

            def communication_backend_name(self):
                return "gloo"

            def visible_devices_envvar(self):
                return "CUDA_VISIBLE_DEVICES"

            @contextmanager
            def nvtx_range(self, msg):
                yield

            def profiler_start(self):
                return None

            def profiler_stop(self):
                return None

            def ray_resource_name(self):
                return "GPU"  # Ray is started with logical GPUs, so verl's placement groups resolve

            def ray_noset_envvars(self):
                return ["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"]

            def is_ipc_supported(self):
                return False

            def cudart(self):
                return None

    from verl.workers.engine import EngineRegistry
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead, FSDPEngineWithValueHead

    for model_type, cls in (("language_model", FSDPEngineWithLMHead), ("value_model", FSDPEngineWithValueHead)):
        for backend in ("fsdp", "fsdp2"):
            if "cpu" not in EngineRegistry._engines.get(model_type, {}).get(backend, {}):
                EngineRegistry.register(model_type=model_type, backend=backend, device="cpu")(cls)
    register_rollout()
    from verl.workers import engine_workers

    if not getattr(engine_workers.initialize_global_process_group_ray, "gloo_only", False):
        # verl asks torch for "cpu:gloo,<device>:<backend>", i.e. "cpu:gloo,cpu:gloo" here, which torch rejects.
        original = engine_workers.initialize_global_process_group_ray

        def initialize_gloo(timeout_second=None, backend=None):
            return original(timeout_second=timeout_second, backend="gloo")

        initialize_gloo.gloo_only = True
        engine_workers.initialize_global_process_group_ray = initialize_gloo
    from verl.workers.engine.fsdp import transformer_impl

    if not getattr(transformer_impl.CPUOffloadPolicy, "unpinned", False):
        # The reference (forward_only) gets CPUOffloadPolicy(pin_memory=True); pinning needs an accelerator.
        class UnpinnedCPUOffloadPolicy(transformer_impl.CPUOffloadPolicy):
            unpinned = True

            def __init__(self, pin_memory: bool = True) -> None:
                super().__init__(pin_memory=False)

        transformer_impl.CPUOffloadPolicy = UnpinnedCPUOffloadPolicy


def init_single_process_group() -> None:
    """One-process gloo group, before verl's initialize_global_process_group_ray (which then finds it)."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("LOCAL_WORLD_SIZE", "1"),
                       ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(port))):
        os.environ.setdefault(key, value)
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{port}")


def save_tiny_model(path: str) -> str:
    """A tiny Llama and its character tokenizer, built from a config (no download), saved as an HF model folder."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from unsloth_adaptive_kl.tools.tiny import build_tiny_model, build_tokenizer

    tokenizer = build_tokenizer()
    model = build_tiny_model(tokenizer, hidden_size=32, num_layers=2)
    model.config.attn_implementation = "eager"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


# ----- an HF `generate` rollout, registered in verl's rollout registries ------------------------------------------


class HFGenerateServer:
    """The rollout server (a Ray actor): an HF causal LM answering verl's token-in/token-out `generate`, its weights
    pushed by the actor worker after every step (verl's "naive" colocated weight sync)."""

    def __init__(self, model_path: str, response_length: int, seed: int = 0) -> None:
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(1)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, attn_implementation="eager").eval()
        self.response_length = response_length
        self.generator = torch.Generator().manual_seed(seed)
        self.weight_updates = 0
        self.global_steps = None

    def load_weights(self, state: dict, global_steps=None) -> int:
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        assert not unexpected, unexpected
        self.weight_updates += 1
        self.global_steps = global_steps
        return self.weight_updates

    @torch.no_grad()
    def generate(self, request_id=None, *, prompt_ids, sampling_params, **kwargs):
        from verl.workers.rollout.replica import TokenOutput

        ids = torch.tensor([prompt_ids])
        temperature = float(sampling_params.get("temperature", 1.0)) or 1.0
        new, logps = [], []
        eos = self.model.config.eos_token_id
        for _ in range(int(sampling_params.get("max_tokens") or self.response_length)):
            logits = self.model(ids).logits[0, -1].float() / temperature
            logp = torch.log_softmax(logits, -1)
            token = int(torch.multinomial(logp.exp(), 1, generator=self.generator))
            new.append(token)
            logps.append(float(logp[token]))
            ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
            if token == eos:
                break
        return TokenOutput(token_ids=new, log_probs=logps, stop_reason="completed",
                           extra_fields={"global_steps": self.global_steps})

    def _noop(self, *args, **kwargs):
        return {}

    sleep = wake_up = clear_kv_cache = release_kv_cache = resume_kv_cache = _noop
    resume_generation = wait_for_requests_to_drain = start_profile = stop_profile = _noop

    def abort_all_requests(self, *args, **kwargs):
        return {"aborted_count": 0, "request_ids": []}


SERVER_NAME = "verl_cpu_hf_server_{}"


def _rollout_classes():
    from verl.workers.rollout.base import BaseRollout
    from verl.workers.rollout.replica import RolloutReplica

    class HFServerAdapter(BaseRollout):
        """Worker side (in the actor worker process): forwards the trained weights to the HF server."""

        async def resume(self, tags):
            return None

        async def release(self):
            return None

        async def update_weights(self, weights, wire_format="named_tensors", **kwargs):
            import ray

            state = {}
            for name, tensor in weights:
                tensor = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
                state[name] = tensor.detach().to("cpu", copy=True)
            server = ray.get_actor(SERVER_NAME.format(0))
            await server.load_weights.remote(state, kwargs.get("global_steps"))

    class HFReplica(RolloutReplica):
        """Driver side: one HF server actor per replica (no accelerator of its own)."""

        def rollout_worker_use_gpu(self) -> bool:
            return False

        async def launch_servers(self):
            import ray

            server = ray.remote(HFGenerateServer).options(
                name=SERVER_NAME.format(self.replica_rank), num_cpus=0, max_concurrency=1,
            ).remote(self.model_config.path, self.config.response_length, seed=self.config.seed)
            self.servers = [server]
            self._server_handle = server
            self._server_address = f"hf-cpu-{self.replica_rank}"

    return HFServerAdapter, HFReplica


HFServerAdapter = HFReplica = None


def register_rollout() -> None:
    """`actor_rollout_ref.rollout.name=hf_cpu`: the worker-side adapter in verl's `_ROLLOUT_REGISTRY`, the replica
    in its `RolloutReplicaRegistry`."""
    global HFServerAdapter, HFReplica
    from verl.workers.rollout import base
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    if HFServerAdapter is None:
        HFServerAdapter, HFReplica = _rollout_classes()
    base._ROLLOUT_REGISTRY[("hf_cpu", "async")] = f"{__name__}.HFServerAdapter"
    RolloutReplicaRegistry.register("hf_cpu", lambda: HFReplica)

# ----- verl's TrainingWorker (fsdp2, gloo, one process) ----------------------------------------------------------


def _nested(rows):
    return torch.nested.as_nested_tensor(rows, layout=torch.jagged)


def training_batch(vocab: int, batch_size: int = 8, seed: int = 0):
    """A mini-batch as the V1 trainer hands update_actor: nested sequences and per-response-token fields."""
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu

    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(2, vocab, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g)
               for _ in range(batch_size)]
    responses = [torch.randint(2, vocab, (int(torch.randint(1, 8, (1,), generator=g)),), generator=g)
                 for _ in range(batch_size)]
    ids = [torch.cat([p, r]) for p, r in zip(prompts, responses)]
    td = TensorDict({
        "prompts": _nested(prompts), "responses": _nested(responses), "input_ids": _nested(ids),
        "position_ids": _nested([torch.arange(len(x)) for x in ids]),
        "attention_mask": _nested([torch.ones(len(x), dtype=torch.int64) for x in ids]),
        "response_mask": _nested([torch.ones(len(r), dtype=torch.int64) for r in responses]),
        "loss_mask": _nested([torch.ones(len(r), dtype=torch.int64) for r in responses]),
        "old_log_probs": _nested([-torch.rand(len(r), generator=g) * 3 for r in responses]),
        "ref_log_prob": _nested([-torch.rand(len(r), generator=g) * 3 for r in responses]),
        "advantages": _nested([torch.full((len(r),), float(torch.randn(1, generator=g))) for r in responses]),
    }, batch_size=[batch_size])
    tu.assign_non_tensor(td, temperature=1.0, calculate_entropy=False, global_batch_size=batch_size,
                         mini_batch_size=batch_size, epochs=1, seed=0, dataloader_kwargs={"shuffle": False})
    return td


def worker_scenario() -> dict:
    """Stock ppo_loss against AdaptivePPOLoss on verl's TrainingWorker: loss, grad_norm, kl_coef, weights."""
    register()
    init_single_process_group()
    from verl.trainer.config.config import CheckpointConfig
    from verl.utils import tensordict_utils as tu
    from verl.workers.config import (ActorConfig, FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig,
                                     TrainingWorkerConfig)
    from verl.workers.engine_workers import TrainingWorker
    from verl.workers.utils.losses import ppo_loss

    from unsloth_adaptive_kl import AdaptiveKLConfig
    from unsloth_adaptive_kl.core.statistics import NAMES
    from unsloth_adaptive_kl.integrations.verl import BETA_KEY, STATS, AdaptivePPOLoss

    started = time.time()
    path = save_tiny_model(tempfile.mkdtemp(prefix="verl_tiny_"))

    def worker(loss_fn, micro_batch_size=2):
        model = HFModelConfig(path=path, use_remove_padding=False, override_config={"attn_implementation": "eager"})
        engine = FSDPEngineConfig(strategy="fsdp2", forward_only=False, use_torch_compile=False, seed=0,
                                  micro_batch_size_per_gpu=micro_batch_size, infer_micro_batch_size_per_gpu=4,
                                  use_dynamic_bsz=False)
        w = TrainingWorker(TrainingWorkerConfig(model_type="language_model", model_config=model,
                                                engine_config=engine, optimizer_config=FSDPOptimizerConfig(lr=1e-2),
                                                checkpoint_config=CheckpointConfig()))
        w.reset()
        w.set_loss_fn(loss_fn)
        return w

    def weights(w):
        return {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                for name, p in w.engine.module.named_parameters()}

    def train(w, beta=None, seed=0):
        td = training_batch(len(w.engine.module.get_input_embeddings().weight), seed=seed)
        if beta is not None:
            tu.assign_non_tensor(td, **{BETA_KEY: beta})
        metrics = w.train_mini_batch(td)["metrics"]
        rows, found = metrics.pop(STATS + "sums", None), metrics.pop(STATS + "nonfinite", None)
        result = {key: [float(v) for v in value] if isinstance(value, list) else float(value)
                  for key, value in metrics.items() if not key.startswith("perf/") and key != "mfu"}
        if rows is not None:  # the micro-batches' sums rows, added as the driver adds them
            result["sums"] = dict(zip(NAMES, torch.tensor(rows, dtype=torch.float64).view(-1, len(NAMES)).sum(0)
                                      .tolist()))
            result["nonfinite"] = found
        return result

    out = {}
    for mode in ("token-mean", "seq-mean-token-mean"):
        actor = ActorConfig(strategy="fsdp2", rollout_n=1, ppo_micro_batch_size_per_gpu=2, use_kl_loss=True,
                            kl_loss_coef=0.05, kl_loss_type="low_var_kl", loss_agg_mode=mode)
        stock = train(worker(partial(ppo_loss, config=copy.deepcopy(actor))))
        none = train(worker(AdaptivePPOLoss(copy.deepcopy(actor), AdaptiveKLConfig())), beta=0.05)
        out[f"stock/{mode}"], out[f"none/{mode}"] = stock, none

    actor = ActorConfig(strategy="fsdp2", rollout_n=1, ppo_micro_batch_size_per_gpu=2, use_kl_loss=True,
                        kl_loss_coef=0.05, kl_loss_type="low_var_kl", loss_agg_mode="token-mean")
    clip = AdaptivePPOLoss(copy.deepcopy(actor), AdaptiveKLConfig(kl_adaptation_method="clip", kl_clip_threshold=0.5))
    w = worker(clip)
    before = weights(w)
    out["clip"] = train(w, beta=0.37)
    after = weights(w)
    out["weights_changed"] = sum(not torch.equal(before[name], after[name]) for name in before)
    out["weights"] = len(before)
    for micro in (1, 2, 4):  # 8 sequences in 8, 4 or 2 micro-batches: the same total gradient
        out[f"clip/micro{micro}"] = train(worker(clip, micro_batch_size=micro), beta=0.37)
    out["seconds"] = time.time() - started
    return out


# ----- python -m verl.trainer.main_ppo, end to end -------------------------------------------------------------------

REWARD_FUNCTION = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    """A deterministic reward in [0, 1]: the share of digits in the completion."""
    return sum(c.isdigit() for c in solution_str) / max(len(solution_str), 1)
'''


def prepare_e2e(workdir: str) -> dict:
    """The tiny model (with a chat template), a prompt parquet and a reward function file under `workdir`."""
    import pandas as pd

    paths = {"model": save_tiny_model(os.path.join(workdir, "model"))}
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(paths["model"])
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tokenizer.save_pretrained(paths["model"])
    rows = [{"data_source": "digits", "prompt": [{"role": "user", "content": f"{a}+{b}="}],
             "reward_model": {"style": "rule", "ground_truth": str(a + b)}, "extra_info": {"index": i}}
            for i, (a, b) in enumerate([(1, 2), (3, 4), (5, 6), (7, 8), (2, 9), (4, 4), (6, 1), (9, 9)])]
    paths["data"] = os.path.join(workdir, "train.parquet")
    pd.DataFrame(rows).to_parquet(paths["data"])
    paths["reward"] = os.path.join(workdir, "reward.py")
    with open(paths["reward"], "w") as handle:
        handle.write(REWARD_FUNCTION)
    return paths


def e2e_overrides(paths: dict, checkpoints: str, steps: int) -> list[str]:
    """GRPO on the tiny model, 2 prompts x 2 samples per step, on one logical GPU that is the CPU."""
    return [
        "algorithm.adv_estimator=grpo",
        f"data.train_files={paths['data']}", f"data.val_files={paths['data']}",
        "data.train_batch_size=2", "data.max_prompt_length=16", "data.max_response_length=6",
        "data.dataloader_num_workers=0", "data.shuffle=False",
        f"actor_rollout_ref.model.path={paths['model']}", "actor_rollout_ref.model.use_remove_padding=False",
        "+actor_rollout_ref.model.override_config.attn_implementation=eager",
        "actor_rollout_ref.actor.strategy=fsdp2", "actor_rollout_ref.ref.strategy=fsdp2",
        "actor_rollout_ref.actor.fsdp_config.use_torch_compile=False",
        "actor_rollout_ref.ref.fsdp_config.use_torch_compile=False",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.actor.optim.lr=1e-2",
        "actor_rollout_ref.rollout.name=hf_cpu", "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1", "actor_rollout_ref.rollout.agent.num_workers=1",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4",
        f"reward.custom_reward_function.path={paths['reward']}", "reward.num_workers=1",
        "trainer.n_gpus_per_node=1", "trainer.nnodes=1", "trainer.logger=[console,file]",
        "trainer.val_before_train=False", "trainer.test_freq=-1", "trainer.save_freq=1",
        f"trainer.total_training_steps={steps}", f"trainer.default_local_dir={checkpoints}",
        "trainer.project_name=verl_cpu", "trainer.experiment_name=e2e",
        "+ray_kwargs.ray_init.num_gpus=1", "ray_kwargs.ray_init.num_cpus=16",
        "transfer_queue.backend.SimpleStorage.num_data_storage_units=1",
    ]


# The integration on by configuration only: the module verl imports in every process, a trainer name and an
# `adaptive_kl` block, beside verl's own KL switches. PAGE_RUN is docs/verl.md's command (tests/test_docs.py holds the
# page to it), with values for a real run: its target horizon passes the core's check at verl's default batch and at
# GRPO's sizes (test_verl.py builds the trainer from verl's own config with it).
EXTERNAL_MODULE = "unsloth_adaptive_kl.integrations.verl"
LOSS_BETA, REWARD_BETA, BETA_MAX = 0.1, 0.1, 0.2
PAGE_RUN = [
    "trainer.v1.trainer_mode=adaptive_kl",
    "actor_rollout_ref.actor.use_kl_loss=True", f"actor_rollout_ref.actor.kl_loss_coef={LOSS_BETA}",
    "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
    "+adaptive_kl.kl_adaptation_method=dynamic",
    "algorithm.use_kl_in_reward=True", f"algorithm.kl_ctrl.kl_coef={REWARD_BETA}", "algorithm.kl_penalty=kl",
    "+adaptive_kl.reward.kl_adaptation_method=target", "+adaptive_kl.reward.kl_target=0.05",
    "+adaptive_kl.reward.kl_horizon=10000", f"+adaptive_kl.reward.beta_max={BETA_MAX}",
]
# The end-to-end run's: the page's command, sized (`++` replaces a value) for 3 steps of 4 completions, so that both
# betas move by a visible amount each step: dynamic decays at every reward, target's horizon is 4 completions' scale.
KL_TARGET, HORIZON = 1e-4, 10.0
ADAPTIVE_RUN = PAGE_RUN + [
    "++adaptive_kl.reward_threshold=-1", "++adaptive_kl.dynamic_beta_decay=0.5",
    f"++adaptive_kl.reward.kl_target={KL_TARGET}", f"++adaptive_kl.reward.kl_horizon={HORIZON}",
]


def run_main_ppo(overrides: list[str], log_path: str, cwd: str, timeout: int = 600) -> tuple[list[dict], str]:
    """`python -m verl.trainer.main_ppo` with this module and the integration imported in every verl process
    (VERL_USE_EXTERNAL_MODULES); verl's file logger's records and the output."""
    import subprocess

    here = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "VERL_PLATFORM": "cpu", "VERL_FILE_LOGGER_PATH": log_path,
           "VERL_USE_EXTERNAL_MODULES": f"verl_cpu,{EXTERNAL_MODULE}",
           "PYTHONPATH": os.pathsep.join([here, os.path.dirname(here), os.environ.get("PYTHONPATH", "")]),
           "RAY_DEDUP_LOGS": "0", "TOKENIZERS_PARALLELISM": "false", "WANDB_MODE": "disabled"}
    proc = subprocess.run([sys.executable, "-m", "verl.trainer.main_ppo", *overrides], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)
    output = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise RuntimeError(f"main_ppo failed ({proc.returncode}):\n{output[-12000:]}")
    with open(log_path) as handle:
        return [json.loads(line) for line in handle if line.strip()], output


if __name__ == "__main__":
    os.environ["VERL_PLATFORM"] = "cpu"
    scenario, output = sys.argv[1], sys.argv[2]
    result = {"worker": worker_scenario}[scenario]()
    with open(output, "w") as handle:
        json.dump(result, handle)
elif os.environ.get("VERL_PLATFORM") == "cpu":  # imported in each verl process (VERL_USE_EXTERNAL_MODULES)
    if "verl" in sys.modules:  # by verl's own __init__: the platform is registered before the modules after this one
        register()
    else:  # first (a Ray actor of this module): import verl without its external modules, register, then import them
        _external = os.environ.pop("VERL_USE_EXTERNAL_MODULES", "")
        try:
            import verl  # noqa: F401
        finally:
            os.environ["VERL_USE_EXTERNAL_MODULES"] = _external
        register()
        import importlib

        for _module in filter(None, _external.split(",")):
            if _module != __name__:
                importlib.import_module(_module)
