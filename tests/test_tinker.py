"""The Tinker integration against the real Tinker SDK, with only the network replaced.

`tinker.ServiceClient(base_url=<loopback>, api_key=...)` builds everything the real way (InternalClientHolder,
AsyncTinker over httpx, the resources, the protobuf encoders, `retrieve_future` polling, seq_id ordering,
`TrainingClient.forward_backward_custom`, `ServiceClient.create_custom_loss`); the server at the other end of the
socket is `FakeTinkerService` below: it speaks the Tinker wire protocol and holds a tiny torch language model, so the
gradients that reach the model can be compared with direct autograd of the same loss on a copy of it.
"""

from __future__ import annotations

import asyncio
import copy
import json
import math
import os
import threading
import warnings
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

import pytest

# Without the SDK these tests skip (the README's test command does not install it); `.ci/run` installs it in row g and
# sets ADAPTIVE_KL_REQUIRE_TINKER=1, so there a missing or broken SDK is an error, not a skip.
if os.environ.get("ADAPTIVE_KL_REQUIRE_TINKER") != "1":
    pytest.importorskip("tinker")

import tinker  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402
from tinker import types  # noqa: E402
from tinker.lib.public_interfaces.custom_loss import trace_loss  # noqa: E402
from tinker.proto import tinker_public_pb2 as pb  # noqa: E402

from unsloth_adaptive_kl import AdaptiveKL, AdaptiveKLConfig, KLEstimatorWarning, NonFiniteLogProbError  # noqa: E402
from unsloth_adaptive_kl.integrations import tinker as integration  # noqa: E402

from .metric_definitions import REDUCE, assert_metrics_match, by_definition  # noqa: E402

VOCAB = 13
PROTO = "application/x-protobuf"
TIGHT = dict(rtol=1e-5, atol=1e-6)


# ----- the fake service ---------------------------------------------------------------------------------------------

class TinyLM(nn.Module):
    """logits_t = W tanh(E[token_t]) + b: a bigram language model."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.embed = nn.Embedding(VOCAB, 8)
        self.head = nn.Linear(8, VOCAB)
        with torch.no_grad():
            for parameter in self.parameters():
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.5)

    def target_logprobs(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """(T,) input tokens and targets -> (T,) log p(target_t | token_t)."""
        logits = self.head(torch.tanh(self.embed(tokens)))
        return torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def _decode_tensor(message: Any) -> torch.Tensor:
    """A wire Tensor (dense or sparse CSR), decoded here rather than by the SDK's own decoder."""
    dtype = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64}[message.dtype]
    shape = list(message.shape)
    if message.HasField("sparse_csr"):
        values = np.frombuffer(message.sparse_csr.values, dtype=dtype)
        crow = np.frombuffer(message.sparse_csr.crow_indices, dtype=np.int64)
        col = np.frombuffer(message.sparse_csr.col_indices, dtype=np.int64)
        dense = np.zeros(shape, dtype=dtype)
        for row in range(len(crow) - 1):
            dense[row, col[crow[row]:crow[row + 1]]] = values[crow[row]:crow[row + 1]]
        return torch.from_numpy(dense)
    return torch.from_numpy(np.frombuffer(message.dense, dtype=dtype).copy().reshape(shape))


def _encode_output(logprobs: list[torch.Tensor], metrics: dict[str, float]) -> bytes:
    """A ForwardBackwardOutput as the service sends it: one ArrayRecord, per-datum `logprobs` at byte offsets."""
    out = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    for key, value in metrics.items():
        out.metrics[key] = value
    record = out.loss_fn_outputs.add()
    record.num_datums = len(logprobs)
    arrays = [lp.detach().to(torch.float32).numpy() for lp in logprobs]
    field = record.fields["logprobs"]
    field.dtype = pb.DTYPE_FLOAT32
    field.data = b"".join(a.tobytes() for a in arrays)
    field.offsets = np.cumsum([0] + [a.nbytes for a in arrays]).astype(np.int64).tobytes()
    return out.SerializeToString()


# What each loss reads: a request with anything else fails, so the tests see exactly what went on the wire.
LOSS_INPUTS = {"cross_entropy": {"target_tokens", "weights"},
               "importance_sampling": {"target_tokens", "logprobs", "advantages"}}


class FakeTinkerService:
    """The remote end of the Tinker API on 127.0.0.1.

    forward_backward: logprob_t = log p(target_t | input_t) from `model`; cross_entropy L = -sum_t weights_t
    logprob_t, importance_sampling L = -sum_t exp(logprob_t - logprobs_t) advantages_t, summed over datums; with
    forward_only under no_grad, else L.backward() accumulates into the model's .grad. It answers the per-datum
    logprobs and loss:sum (protobuf). optim_step: AdamW with the request's AdamParams, then zero_grad. Requests run
    in seq_id order (a gap in the SDK's reserved ids would stall, not pass); retrieve_future long-polls."""

    session_id, model_id = "fake-session", "fake-model"

    def __init__(self, model: TinyLM, *, fwdbwd_max_chunk_len: int = 1024) -> None:
        self.model = model
        self.client_config = {"pjwt_auth_enabled": False, "use_pyqwest_transport": False,
                              "proto_compress_fwdbwd": False, "custom_loss_server_side": False,
                              "fwdbwd_max_chunk_len": fwdbwd_max_chunk_len, "parallel_fwdbwd_chunks": True}
        self.lock = threading.Condition()
        self.results: dict[str, tuple[str, Any]] = {}
        self.pending: dict[int, tuple[str, Callable[[], tuple[str, Any]]]] = {}
        self.next_seq_id, self.counter = 1, 0
        self.log: list[tuple[str, Any]] = []
        self.unexpected: list[str] = []
        self.optimizer: torch.optim.Optimizer | None = None
        self.server: ThreadingHTTPServer | None = None

    def start(self) -> str:
        service = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                status, content_type, payload = service.handle(self.path, self.headers.get("Content-Type", ""), body)
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            do_GET = do_POST

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, name="fake-tinker", daemon=True).start()
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()

    def _future(self, seq_id: int | None, job: Callable[[], tuple[str, Any]]) -> dict[str, Any]:
        def run() -> tuple[str, Any]:
            try:
                return job()
            except Exception as error:  # a failed request, as the service reports one
                return "json", {"error": f"{type(error).__name__}: {error}", "category": "user"}

        with self.lock:
            self.counter += 1
            request_id = f"req-{self.counter}"
            if seq_id is None:
                self.results[request_id] = run()
            else:
                self.pending[seq_id] = (request_id, run)
                while self.next_seq_id in self.pending:
                    queued_id, queued = self.pending.pop(self.next_seq_id)
                    self.results[queued_id] = queued()
                    self.next_seq_id += 1
            self.lock.notify_all()
        return {"request_id": request_id, "model_id": self.model_id}

    def handle(self, path: str, content_type: str, body: bytes) -> tuple[int, str, bytes]:
        def ok(obj: Any) -> tuple[int, str, bytes]:
            return 200, "application/json", json.dumps(obj).encode()

        route = path.split("?")[0].removeprefix("/api/v1/")
        request: Any = pb.ForwardBackwardRequest.FromString(body) if content_type.startswith(PROTO) else (
            json.loads(body) if body else {})
        self.log.append((route, request))
        if route == "client/config":
            return ok(self.client_config)
        if route in ("client/dynamic_config", f"sessions/{self.session_id}/finish"):
            return ok({})
        if route == "create_session":
            return ok({"type": "create_session", "session_id": self.session_id})
        if route == "session_heartbeat":
            return ok({"type": "session_heartbeat"})
        if route == "telemetry":
            return ok({"status": "accepted"})
        if route == "create_model":
            return ok(self._future(None, lambda: ("json", {"type": "create_model", "model_id": self.model_id})))
        if route == "get_info":
            return ok({"type": "get_info", "model_id": self.model_id, "is_lora": True, "lora_rank": 1,
                       "model_data": {"arch": "tiny", "model_name": "fake/tiny-lm"}})
        if route == "forward_backward":
            return ok(self._future(request.seq_id, lambda: ("proto", self.forward_backward(request))))
        if route == "optim_step":
            return ok(self._future(request["seq_id"], lambda: ("json", self.optim_step(request["adam_params"]))))
        if route == "retrieve_future":
            with self.lock:
                self.lock.wait_for(lambda: request["request_id"] in self.results, timeout=5.0)
                result = self.results.get(request["request_id"])
            if result is None:
                return ok({"type": "try_again"})
            kind, payload = result
            return (200, PROTO, payload) if kind == "proto" else ok(payload)
        self.unexpected.append(route)
        return 404, "application/json", json.dumps({"detail": f"no route {route}"}).encode()

    def forward_backward(self, request: Any) -> bytes:
        assert request.model_id == self.model_id
        outputs, total = [], torch.zeros(())
        with torch.set_grad_enabled(not request.forward_only):
            for datum in request.data:
                inputs = {name: _decode_tensor(t) for name, t in datum.loss_fn_inputs.items()}
                if set(inputs) != LOSS_INPUTS[request.loss_fn]:
                    raise ValueError(f"{request.loss_fn} takes {sorted(LOSS_INPUTS[request.loss_fn])}, got "
                                     f"{sorted(inputs)}")
                tokens = torch.tensor([t for chunk in datum.model_input
                                       for t in np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32)])
                logprobs = self.model.target_logprobs(tokens, inputs["target_tokens"])
                if request.loss_fn == "cross_entropy":
                    loss = -(inputs["weights"] * logprobs).sum()
                else:
                    loss = -(torch.exp(logprobs - inputs["logprobs"]) * inputs["advantages"]).sum()
                total = total + loss
                outputs.append(logprobs)
            if not request.forward_only:
                total.backward()
        return _encode_output(outputs, {"loss:sum": float(total.detach())})

    def optim_step(self, adam: dict[str, Any]) -> dict[str, Any]:
        if self.optimizer is None:
            self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=adam["learning_rate"],
                                               betas=(adam["beta1"], adam["beta2"]), eps=adam["eps"],
                                               weight_decay=adam["weight_decay"])
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {"metrics": {}}

    def grads(self) -> dict[str, torch.Tensor]:
        with self.lock:
            return {name: p.grad.clone() for name, p in self.model.named_parameters() if p.grad is not None}

    def zero_grad(self) -> None:
        with self.lock:
            self.model.zero_grad(set_to_none=True)

    def requests(self, route: str) -> list[Any]:
        return [request for path, request in self.log if path == route]


class Tinker:
    """What a test gets: the real SDK clients, the fake service, and `initial`, a copy of the model before any step."""

    def __init__(self, client: Any, training: Any, service: FakeTinkerService, initial: TinyLM) -> None:
        self.client, self.training, self.service, self.initial = client, training, service, initial


@pytest.fixture
def fake_tinker(monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> Any:
    """A real `tinker.ServiceClient` and `TrainingClient` talking to a `FakeTinkerService` on loopback
    (param: the SDK's fwdbwd_max_chunk_len, which the service hands out in its client config)."""
    torch.set_num_threads(1)
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    monkeypatch.delenv("TINKER_BASE_URL", raising=False)
    model = TinyLM()
    service = FakeTinkerService(model, fwdbwd_max_chunk_len=getattr(request, "param", 1024))
    base_url = service.start()
    client = tinker.ServiceClient(base_url=base_url, api_key="tml-fake-key")
    try:
        training = client.create_lora_training_client(base_model="fake/tiny-lm", rank=1).result(timeout=30)
        yield Tinker(client, training, service, copy.deepcopy(model))
    finally:
        client.close("success").result(timeout=30)
        service.stop()
    assert service.unexpected == []


# ----- batches and independent formulas ------------------------------------------------------------------------------

def make_data(initial: TinyLM, n: int = 4, seed: int = 0) -> list[Any]:
    """n completions (prompts of 2-3 tokens, completions of 3.. tokens), the sampler's log-probs near the model's and
    the reference's further off (so ratios clip and the KL is not small)."""
    generator = torch.Generator().manual_seed(seed)
    data = []
    for i in range(n):
        prompt = torch.randint(0, VOCAB, (2 + i % 2,), generator=generator).tolist()
        completion = torch.randint(0, VOCAB, (3 + i,), generator=generator).tolist()
        tokens = prompt + completion
        with torch.no_grad():
            logprobs = initial.target_logprobs(torch.tensor(tokens[:-1]), torch.tensor(tokens[1:]))[len(prompt) - 1:]
        sampling = logprobs + 0.3 * torch.randn(logprobs.shape, generator=generator)
        reference = logprobs + 0.8 * torch.randn(logprobs.shape, generator=generator)
        data.append(integration.completion_datum(prompt, completion, sampling, reference))
    return data


def with_advantages(data: list[Any], advantages: list[float]) -> list[Any]:
    out = []
    for datum, advantage in zip(data, advantages):
        mask = datum.loss_fn_inputs["mask"].to_torch()
        out.append(types.Datum(model_input=datum.model_input, loss_fn_inputs={
            **datum.loss_fn_inputs, "advantages": types.TensorData.from_torch(advantage * mask)}))
    return out


ADVANTAGES = [1.0, -0.5, 0.25, -0.75]


def stacked(data: list[Any], key: str) -> torch.Tensor:
    return torch.nn.utils.rnn.pad_sequence([d.loss_fn_inputs[key].to_torch().float() for d in data], batch_first=True)


def policy_logprobs(model: TinyLM, data: list[Any]) -> torch.Tensor:
    """(B, T) log-probs of the targets under `model`, with autograd to its parameters."""
    rows = [model.target_logprobs(torch.tensor(d.model_input.to_ints()), d.loss_fn_inputs["target_tokens"].to_torch())
            for d in data]
    return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)


def hand_k3(logps: torch.Tensor, ref: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """k3 = exp(r) - r - 1, r = ref - logp, on the completion tokens (0 elsewhere)."""
    r = torch.where(mask > 0, ref - logps, torch.zeros_like(logps))
    return (torch.exp(r) - r - 1) * mask


def sequence_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """GRPO's reduction: mean over completions of sum_t m x / L_i."""
    return ((x * mask).sum(-1) / mask.sum(-1)).mean()


def hand_pg(logps: torch.Tensor, data: list[Any], eps: float = 0.2) -> torch.Tensor:
    old, adv, mask = (stacked(data, key) for key in ("logprobs", "advantages", "mask"))
    ratio = torch.exp(logps - old)
    return sequence_mean(-torch.minimum(ratio * adv, torch.clamp(ratio, 1 - eps, 1 + eps) * adv), mask)


def assert_model_grads(fake: Tinker, loss: torch.Tensor) -> None:
    """The gradients the service accumulated equal direct autograd of `loss` on the initial model."""
    fake.initial.zero_grad(set_to_none=True)
    loss.backward()
    got = fake.service.grads()
    assert set(got) == {name for name, _ in fake.initial.named_parameters()}
    for name, parameter in fake.initial.named_parameters():
        torch.testing.assert_close(got[name], parameter.grad, **TIGHT)
        assert parameter.grad.abs().sum() > 0


# ----- 1. the KL in the loss: forward_backward_custom --------------------------------------------------------------

@pytest.mark.parametrize(("fake_tinker", "variant"), [(1024, "sync"), (2, "async")], indirect=["fake_tinker"])
def test_custom_loss_gradients_equal_direct_autograd(fake_tinker: Tinker, variant: str) -> None:
    """forward + custom loss on the SDK's thread + cross_entropy backward with weights = -dL/dlogprobs: the model's
    gradients are those of L itself (also split into 2-datum chunks, and through the awaitable future)."""
    akl = AdaptiveKL(AdaptiveKLConfig(kl_adaptation_method="clip", kl_clip_threshold=0.3), beta=0.5, loss_type="grpo")
    data = with_advantages(make_data(fake_tinker.initial), ADVANTAGES)
    loss_fn = integration.grpo_kl_loss(akl)
    threads: list[str] = []

    def recorded(batch: list[Any], logprobs: list[torch.Tensor]) -> Any:
        threads.append(threading.current_thread().name)
        assert all(lp.is_leaf and lp.requires_grad for lp in logprobs)
        return loss_fn(batch, logprobs)

    future = fake_tinker.training.forward_backward_custom(data, recorded)
    result = future.result(timeout=30) if variant == "sync" else asyncio.run(_awaited(future))

    logps = policy_logprobs(fake_tinker.initial, data)
    ref, mask = stacked(data, "ref_logprobs"), stacked(data, "mask")
    expected = hand_pg(logps, data) + 0.5 * sequence_mean(torch.clamp(hand_k3(logps, ref, mask), max=0.3), mask)
    assert_model_grads(fake_tinker, expected)
    assert result.metrics["loss:sum"] == pytest.approx(float(expected.detach()), rel=1e-5)
    assert threads == ["tinker-custom-loss"]
    # The forward chunks (forward_only) took the first seq_ids, the cross_entropy backward chunks the next ones.
    forwards = fake_tinker.service.requests("forward_backward")
    chunks = 1 if variant == "sync" else 2
    assert len(forwards) == 2 * chunks and all(r.loss_fn == "cross_entropy" for r in forwards)
    assert sorted(r.seq_id for r in forwards if r.forward_only) == list(range(1, chunks + 1))
    assert sorted(r.seq_id for r in forwards if not r.forward_only) == list(range(chunks + 1, 2 * chunks + 1))


async def _awaited(future: Any) -> Any:
    return await future


def test_custom_loss_metrics_arrive_in_result(fake_tinker: Tinker) -> None:
    """The loss's metrics (the core's adaptive_kl/* and grpo/*) come back in the result, with their values."""
    akl = AdaptiveKL(AdaptiveKLConfig(kl_adaptation_method="clip", kl_clip_threshold=0.3), beta=0.5, loss_type="grpo")
    data = with_advantages(make_data(fake_tinker.initial), ADVANTAGES)
    result = fake_tinker.training.forward_backward_custom(data, integration.grpo_kl_loss(akl)).result(timeout=30)
    with torch.no_grad():
        logps = policy_logprobs(fake_tinker.initial, data)
    ref, mask = stacked(data, "ref_logprobs"), stacked(data, "mask")
    k3 = hand_k3(logps, ref, mask)
    adapted = float(sequence_mean(torch.clamp(k3, max=0.3), mask))
    metrics = result.metrics
    assert metrics["adaptive_kl/current_beta"] == 0.5
    assert metrics["adaptive_kl/raw_kl"] == pytest.approx(float(sequence_mean(k3, mask)), rel=1e-5)
    assert metrics["adaptive_kl/adapted_kl"] == pytest.approx(adapted, rel=1e-5)
    clipped = float(((k3 >= 0.3) & (mask > 0)).sum() / mask.sum())
    assert 0 < clipped < 1 and metrics["adaptive_kl/clip_fraction"] == pytest.approx(clipped)
    assert metrics["grpo/pg_loss"] == pytest.approx(float(hand_pg(logps, data)), rel=1e-5)
    assert metrics["grpo/kl_term"] == pytest.approx(0.5 * adapted, rel=1e-5)
    assert metrics["loss:sum"] == pytest.approx(metrics["grpo/pg_loss"] + metrics["grpo/kl_term"], rel=1e-5)
    assert "surrogate_loss:sum" in metrics  # the server's loss of the cross_entropy backward, kept aside by the SDK
    # Every adaptive_kl/* value against docs/metrics.md's definition (sequence_kl, length_kl_corr included).
    assert_metrics_match(metrics, by_definition(k3, mask, method="clip", raw=REDUCE["grpo"], adapted=REDUCE["grpo"],
                                                beta=0.5, clip=0.3), rel=1e-5)


def test_none_kl_part_is_plain_k3(fake_tinker: Tinker) -> None:
    """kl_adaptation_method='none', loss_type grpo: the KL part is beta * mean_i (sum_t m k3 / L_i), by hand; with
    zero advantages it is the whole loss, and its gradient reaches the model."""
    akl = AdaptiveKL(AdaptiveKLConfig(kl_adaptation_method="none"), beta=0.3, loss_type="grpo")
    data = with_advantages(make_data(fake_tinker.initial, seed=3), [0.0] * 4)
    result = fake_tinker.training.forward_backward_custom(data, integration.grpo_kl_loss(akl)).result(timeout=30)
    logps = policy_logprobs(fake_tinker.initial, data)
    ref, mask = stacked(data, "ref_logprobs"), stacked(data, "mask")
    kl = torch.stack([((hand_k3(logps, ref, mask)[i]).sum() / mask[i].sum()) for i in range(len(data))]).mean()
    assert result.metrics["grpo/kl_term"] == pytest.approx(0.3 * float(kl.detach()), rel=1e-5)
    assert result.metrics["grpo/pg_loss"] == 0.0
    assert result.metrics["loss:sum"] == pytest.approx(0.3 * float(kl.detach()), rel=1e-5)
    assert_model_grads(fake_tinker, 0.3 * kl)


def test_dynamic_beta_steps_and_is_captured_when_built(fake_tinker: Tinker) -> None:
    """dynamic: after akl.step(mean_reward=0.9) > reward_threshold 0.8 the next loss uses beta * decay (gradients
    included); a loss built before a step keeps the beta it was built with."""
    config = AdaptiveKLConfig(kl_adaptation_method="dynamic", reward_threshold=0.8, dynamic_beta_decay=0.5)
    akl = AdaptiveKL(config, beta=0.2, loss_type="grpo")
    data = with_advantages(make_data(fake_tinker.initial, seed=5), ADVANTAGES)
    training, service = fake_tinker.training, fake_tinker.service
    logps = policy_logprobs(fake_tinker.initial, data)
    ref, mask = stacked(data, "ref_logprobs"), stacked(data, "mask")
    kl = sequence_mean(hand_k3(logps, ref, mask), mask)

    first = training.forward_backward_custom(data, integration.grpo_kl_loss(akl)).result(timeout=30)
    assert first.metrics["grpo/kl_term"] == pytest.approx(0.2 * float(kl.detach()), rel=1e-5)
    assert akl.step(mean_reward=0.9) == pytest.approx(0.1)
    service.zero_grad()
    second = training.forward_backward_custom(data, integration.grpo_kl_loss(akl)).result(timeout=30)
    assert second.metrics["adaptive_kl/current_beta"] == pytest.approx(0.1)
    assert second.metrics["grpo/kl_term"] == pytest.approx(0.1 * float(kl.detach()), rel=1e-5)
    assert_model_grads(fake_tinker, hand_pg(logps, data) + 0.1 * kl)

    assert akl.step(mean_reward=0.5) == pytest.approx(0.1)  # not above the threshold: no decay
    built = integration.grpo_kl_loss(akl)  # beta 0.1 read here, on this thread
    assert akl.step(mean_reward=0.95) == pytest.approx(0.05)  # the loop moves on before the SDK runs the loss
    third = training.forward_backward_custom(data, built).result(timeout=30)
    assert third.metrics["adaptive_kl/current_beta"] == pytest.approx(0.1)
    assert third.metrics["grpo/kl_term"] == pytest.approx(0.1 * float(kl.detach()), rel=1e-5)


def test_record_step_kl_feeds_the_target_controller(fake_tinker: Tinker) -> None:
    """`target` reads the step's KL: record_step_kl hands it over on the caller's thread, and the next beta is
    beta * (1 + clip(KL / kl_target - 1, -0.2, 0.2) * n / kl_horizon), KL the token-mean k3, by hand."""
    config = AdaptiveKLConfig(kl_adaptation_method="target", kl_target=0.05, kl_horizon=20.0)
    akl = AdaptiveKL(config, beta=0.1, loss_type="grpo")
    data = with_advantages(make_data(fake_tinker.initial, seed=7), ADVANTAGES)
    result = fake_tinker.training.forward_backward_custom(data, integration.grpo_kl_loss(akl)).result(timeout=30)
    metrics = integration.record_step_kl(akl, data, result)
    assert metrics["adaptive_kl/raw_kl"] == pytest.approx(result.metrics["adaptive_kl/raw_kl"], rel=1e-5)
    with torch.no_grad():
        logps = policy_logprobs(fake_tinker.initial, data)
    mask = stacked(data, "mask")
    token_mean = float(hand_k3(logps, stacked(data, "ref_logprobs"), mask).sum() / mask.sum())
    error = min(max(token_mean / 0.05 - 1.0, -0.2), 0.2)
    assert akl.step() == pytest.approx(0.1 * (1 + error * len(data) / 20.0), rel=1e-5)
    assert akl.current_beta != 0.1


@pytest.mark.parametrize("placement", ["loss", "reward"])
def test_an_evaluation_batch_with_train_false_reaches_no_controller(fake_tinker: Tinker, placement: str) -> None:
    """SPEC 3.14 at Tinker's doors: record_step_kl / kl_penalized_data of an evaluation batch with train=False, between
    the training batch and the step, leave `target`'s beta where the run without it goes (and it would move it:
    the evaluation batch's KL differs), and still return that batch's metrics."""
    config = AdaptiveKLConfig(kl_adaptation_method="target", kl_target=0.05, kl_horizon=20.0, kl_placement=placement)
    train_data = with_advantages(make_data(fake_tinker.initial, seed=7), ADVANTAGES)
    eval_data = with_advantages(make_data(fake_tinker.initial, seed=8), ADVANTAGES)
    rewards = [1.0, 0.0, 0.5, 0.25]

    def feed(akl: AdaptiveKL, data: list[Any], train: bool) -> dict[str, float]:
        if placement == "reward":
            return integration.kl_penalized_data(akl, data, rewards, group_size=2, train=train)[1]
        result = fake_tinker.training.forward_backward_custom(data, integration.grpo_kl_loss(akl)).result(timeout=30)
        return integration.record_step_kl(akl, data, result, train=train)

    betas = {}
    for run, eval_train in (("without", None), ("train=False", False), ("train=True", True)):
        akl = AdaptiveKL(config, beta=0.1, loss_type="grpo")
        feed(akl, train_data, True)
        if eval_train is not None:
            assert feed(akl, eval_data, eval_train)["adaptive_kl/raw_kl"] > 0
        betas[run] = akl.step()
    assert betas["train=False"] == betas["without"] != betas["train=True"]


# ----- 2. the KL in the reward: the built-in importance_sampling loss ------------------------------------------------

def hand_k1(logps: torch.Tensor, ref: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """k1 = logp - ref on the completion tokens (0 elsewhere)."""
    return torch.where(mask > 0, logps - ref, torch.zeros_like(logps))


@pytest.mark.parametrize("estimator", [None, "k3"])
def test_reward_penalty_route(fake_tinker: Tinker, estimator: Any) -> None:
    """P_i = beta * KL_i (KL_i = sum_t m min(k, threshold), the sequence-level clipped KL, by hand, k the log-ratio k1:
    the reward placement's default; k3 when named, which warns) comes off each reward before the group-centred
    advantages; the Datums carry them aligned as float32 TensorData; the built-in importance_sampling loss gets only
    its own inputs and its gradients are those of -sum exp(lp - lp_old) A."""
    fields = dict(kl_adaptation_method="clip", kl_clip_threshold=0.3, kl_placement="reward", kl_estimator=estimator)
    if estimator == "k3":
        with pytest.warns(KLEstimatorWarning, match="^kl_estimator='k3' with kl_placement='reward': "):
            akl = AdaptiveKL(AdaptiveKLConfig(**fields), beta=0.1, loss_type="grpo")
    else:
        akl = AdaptiveKL(AdaptiveKLConfig(**fields), beta=0.1, loss_type="grpo")
    data = make_data(fake_tinker.initial, seed=11)
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.5])
    datums, metrics = integration.kl_penalized_data(akl, data, rewards, group_size=2)

    sampled, ref, mask = (stacked(data, key) for key in ("logprobs", "ref_logprobs", "mask"))
    per_token = hand_k3(sampled, ref, mask) if estimator == "k3" else hand_k1(sampled, ref, mask)
    assert (per_token > 0.3).any() and (estimator == "k3" or (per_token < 0).any())  # the clip binds; k1 < 0 occurs
    penalty = 0.1 * (torch.clamp(per_token, max=0.3) * mask).sum(-1)
    penalized = (rewards - penalty).view(2, 2)
    advantages = (penalized - penalized.mean(1, keepdim=True)).flatten()
    assert metrics["adaptive_kl/reward_penalty"] == pytest.approx(float(penalty.mean()), rel=1e-5)
    assert_metrics_match(metrics, by_definition(per_token, mask, method="clip", raw=REDUCE["sequence_sum"],
                                                adapted=REDUCE["sequence_sum"], beta=0.1, clip=0.3, penalty=True),
                         rel=1e-5)
    assert metrics["reward/mean"] == pytest.approx(0.5)
    assert advantages[2] != 0  # equal rewards, different KL: the penalty alone separates them
    for datum, advantage in zip(datums, advantages):
        inputs = datum.loss_fn_inputs
        assert all(isinstance(v, types.TensorData) for v in inputs.values())
        assert {k: v.dtype for k, v in inputs.items()} == {
            "target_tokens": "int64", "logprobs": "float32", "ref_logprobs": "float32", "mask": "float32",
            "advantages": "float32"}
        assert len({tuple(v.shape) for v in inputs.values()}) == 1  # aligned with target_tokens
        torch.testing.assert_close(inputs["advantages"].to_torch(), advantage * inputs["mask"].to_torch(), **TIGHT)

    result = fake_tinker.training.forward_backward(integration.builtin_loss_data(datums), "importance_sampling")
    result = result.result(timeout=30)
    sent = fake_tinker.service.requests("forward_backward")[0]
    assert sent.loss_fn == "importance_sampling" and set(sent.data[0].loss_fn_inputs) == {
        "target_tokens", "logprobs", "advantages"}
    logps = policy_logprobs(fake_tinker.initial, datums)
    expected = -(torch.exp(logps - sampled) * stacked(datums, "advantages") * mask).sum()
    assert result.metrics["loss:sum"] == pytest.approx(float(expected.detach()), rel=1e-5)
    assert_model_grads(fake_tinker, expected)


def test_an_unscored_reward_or_a_group_size_that_is_not_a_count_is_refused() -> None:
    """One NaN reward would make every advantage of its group NaN, prompt positions included (NaN * 0); a group_size of
    2.0 or True is not a count, and a group of one (1, or True) has the advantage 0 whatever its reward, NaN with
    scale_by_std (a sample std of one value); a std_epsilon of 0 divides a group of equal rewards by 0. None or text
    for a reward failed in torch, naming neither the argument nor what it takes."""
    data = [integration.completion_datum([1, 2], [3, 4, 5], [-1.0, -1.2, -0.8], [-1.1, -1.0, -0.9])
            for _ in range(4)]
    akl = AdaptiveKL(AdaptiveKLConfig(kl_placement="reward"), beta=0.1)
    with pytest.raises(ValueError, match=r"^rewards hold NaN or \+-inf at completion\(s\) \[1, 3\]: every reward must "
                                         r"be a finite number"):
        integration.kl_penalized_data(akl, data, [1.0, math.nan, 0.0, math.inf], group_size=2)
    for rewards in ([None, 1.0, 0.0, 1.0], ["1", "0", "0", "1"]):  # torch's bare TypeError / "too many dimensions"
        with pytest.raises(ValueError) as raised:
            integration.kl_penalized_data(akl, data, rewards, group_size=2)
        assert str(raised.value) == (f"rewards={rewards!r} is invalid: allowed is one finite number per Datum (score "
                                     "each completion, or leave an unscored completion's group out of the batch).")
    # one value a Datum, in order: a 2-D array was flattened (a (group_size, prompts) one to the wrong completions),
    # and bools were read as 1 and 0
    shaped = [(torch.tensor([[1.0, 0.0], [1.0, 1.0]]), "2-D float32"), ([[1.0], [0.0], [1.0], [1.0]], "2-D float32"),
              ([True, False, True, True], "1-D bool"), (np.array([[1, 0, 1, 1]]), "2-D int64")]
    for rewards, shape in shaped:
        with pytest.raises(ValueError) as raised:
            integration.kl_penalized_data(akl, data, rewards, group_size=2)
        assert str(raised.value) == (f"rewards={rewards!r} is invalid: allowed is one finite number per Datum (score "
                                     "each completion, or leave an unscored completion's group out of the batch), as "
                                     "a 1-D sequence of numbers in the Datums' order (flatten a (prompts, group_size) "
                                     f"array), not a {shape} one.")
    penalised, _ = integration.kl_penalized_data(akl, data, np.array([1, 0, 1, 1]), group_size=2)  # integers: scores
    assert len(penalised) == 4
    for group_size in (2.0, True, 3, 0, 1):
        with pytest.raises(ValueError) as raised:
            integration.kl_penalized_data(akl, data, [1.0, 0.0, 0.0, 1.0], group_size=group_size)
        assert str(raised.value) == (f"group_size={group_size!r} is invalid: allowed is an integer >= 2 that divides "
                                     "the 4 completions (a group's completions of one prompt).")
    # an integer, but not a Python one: said so ("allowed is an integer" of np.int64(2) read as a contradiction)
    with pytest.raises(ValueError) as raised:
        integration.kl_penalized_data(akl, data, [1.0, 0.0, 0.0, 1.0], group_size=np.int64(2))
    assert str(raised.value) == ("group_size=np.int64(2) is invalid: allowed is an integer >= 2 that divides the 4 "
                                 "completions (a group's completions of one prompt), as a Python int (this is a "
                                 "numpy.int64: pass int(...)).")
    for epsilon in (0.0, -1e-4, math.nan, math.inf):
        with pytest.raises(ValueError, match=rf"^std_epsilon={epsilon!r} is invalid: allowed is a finite number > 0"):
            integration.kl_penalized_data(akl, data, [1.0, 1.0, 0.0, 1.0], group_size=2, scale_by_std=True,
                                          std_epsilon=epsilon)


@pytest.mark.parametrize(("loss_type", "missing", "method"), [
    ("dapo", "token_normalizer", "none"), ("dr_grpo", "max_completion_length", "none"),
    ("dr_grpo", "max_completion_length", "length_normalized")])
def test_a_loss_missing_its_divisor_is_refused_when_built_not_on_the_sdks_thread(loss_type: str, missing: str,
                                                                                 method: str) -> None:
    """grpo_kl_loss knows the loss type when it is built: a divisor left out would raise only later, inside the SDK's
    call of the loss; with it, the loss builds. The policy-gradient term needs it whatever the KL term's reduction
    (length_normalized's sequence mean needs none), and traced_loss_data names itself as the place to pass it."""
    akl = AdaptiveKL(AdaptiveKLConfig(kl_adaptation_method=method), beta=0.1, loss_type=loss_type)
    datum = integration.completion_datum([1, 2], [3, 4], [-1.0, -1.0], [-0.5, -1.5])
    datum.loss_fn_inputs["advantages"] = types.TensorData.from_torch(torch.ones(3))
    for door, call in (("grpo_kl_loss", lambda: integration.grpo_kl_loss(akl)),
                       ("traced_loss_data", lambda: integration.traced_loss_data(akl, [datum]))):
        with pytest.raises(ValueError, match=rf"^{missing}=None is invalid: allowed is .*{loss_type}.* divides? by: "
                                             rf"pass it to {door}\(\.\.\.\)\.$"):
            call()
    assert integration.grpo_kl_loss(akl, **{missing: 8}).beta == 0.1


def test_tensor_inputs_not_lists() -> None:
    """Why every input is a TensorData: the SDK turns a plain list into a tensor only for keys it knows."""
    with pytest.raises(KeyError, match="ref_logprobs"):
        types.Datum(model_input=types.ModelInput.from_ints([1, 2]),
                    loss_fn_inputs={"target_tokens": [2, 3], "ref_logprobs": [-1.0, -2.0]})
    datum = integration.completion_datum([1, 2, 3], [4, 5], [-0.5, -1.5], [-0.7, -1.0])
    assert datum.model_input.to_ints() == [1, 2, 3, 4]
    assert datum.loss_fn_inputs["target_tokens"].tolist() == [2, 3, 4, 5]
    assert datum.loss_fn_inputs["mask"].tolist() == [0.0, 0.0, 1.0, 1.0]
    assert datum.loss_fn_inputs["logprobs"].tolist() == [0.0, 0.0, -0.5, -1.5]
    assert datum.loss_fn_inputs["ref_logprobs"].tolist() == pytest.approx([0.0, 0.0, -0.7, -1.0])


# ----- 3. the traced per-datum loss (create_custom_loss) -----------------------------------------------------------

TRACED = [
    ("none", "grpo", {}),
    ("clip", "grpo", {}),
    ("sigmoid+length_normalized", "bnpo", {}),
    ("clip", "dr_grpo", {"max_completion_length": 8}),
]


@pytest.mark.parametrize(("method", "loss_type", "context"), TRACED)
def test_traced_loss_equals_eager(fake_tinker: Tinker, method: str, loss_type: str, context: dict[str, Any]) -> None:
    """The loss create_custom_loss traces (torch.fx) gives, per datum, what the eager function gives; summed over
    datums it is grpo_kl_loss's loss; run by forward_backward_custom its gradients are grpo_kl_loss's."""
    akl = AdaptiveKL(AdaptiveKLConfig(kl_adaptation_method=method, kl_clip_threshold=0.3, kl_target=0.2),
                     beta=0.4, loss_type=loss_type)
    data = with_advantages(make_data(fake_tinker.initial, seed=13), ADVANTAGES)
    fn, ranks = integration.traceable_grpo_loss(akl)
    handle = fake_tinker.client.create_custom_loss(fn, ranks).result(timeout=30)
    traced = integration.traced_loss_data(akl, data, **context)

    logps = policy_logprobs(fake_tinker.initial, data)
    eager_total = 0.0
    for i, datum in enumerate(traced):
        row = logps[i, : len(datum.loss_fn_inputs["target_tokens"].tolist())].detach()
        inputs = [datum.loss_fn_inputs[name].to_torch() for name in handle.input_names]
        graph_loss, graph_metrics = handle.graph(row, *inputs)
        eager_loss, eager_metrics = fn(row, *inputs)
        torch.testing.assert_close(graph_loss, eager_loss, rtol=0, atol=0)
        for key in eager_metrics:
            torch.testing.assert_close(graph_metrics[key], eager_metrics[key], rtol=0, atol=0)
        eager_total += float(eager_loss)

    loss_fn = integration.grpo_kl_loss(akl, **context)
    rows = [logps[i, : len(d.loss_fn_inputs["target_tokens"].tolist())] for i, d in enumerate(data)]
    expected, expected_metrics = loss_fn(data, rows)
    assert eager_total == pytest.approx(float(expected.detach()), rel=1e-5)

    result = fake_tinker.training.forward_backward_custom(traced, handle).result(timeout=30)
    assert result.metrics["loss:sum"] == pytest.approx(float(expected.detach()), rel=1e-5)
    assert result.metrics["custom/adaptive_kl/adapted_kl:sum"] == pytest.approx(
        expected_metrics["adaptive_kl/adapted_kl"], rel=1e-5)
    assert result.metrics["custom/grpo/kl_term:sum"] == pytest.approx(expected_metrics["grpo/kl_term"], rel=1e-5)
    assert result.metrics["custom/grpo/pg_loss:sum"] == pytest.approx(expected_metrics["grpo/pg_loss"], rel=1e-5)
    assert_model_grads(fake_tinker, expected)


def kl_to_go(logps: torch.Tensor, ref: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """G_t = sum_{s >= t} m_s (logp_s - ref_s), token by token, without gradient."""
    k1 = hand_k1(logps, ref, mask).detach()
    return torch.stack([k1[:, t:].sum(-1) for t in range(k1.size(1))], dim=-1) * mask


def test_k1_future_in_the_custom_and_the_traced_loss(fake_tinker: Tinker) -> None:
    """kl_estimator='k1_future', loss_type dr_grpo: the custom loss's KL part is beta * sum m k1 / (B T_max) and the
    model's gradients are those of hand_pg + beta * sum_t m (sg(k1_t) + sg(G_t) (logp_t - sg(logp_t))) / (B T_max);
    the traced per-datum loss records it (graph == eager) and its gradient on each datum's log-probs is
    beta * G_t / (B T_max) plus the policy-gradient part, G_t that datum's own KL-to-go."""
    akl = AdaptiveKL(AdaptiveKLConfig(kl_estimator="k1_future"), beta=0.4, loss_type="dr_grpo")
    data = with_advantages(make_data(fake_tinker.initial, seed=17), ADVANTAGES)
    result = fake_tinker.training.forward_backward_custom(
        data, integration.grpo_kl_loss(akl, max_completion_length=8)).result(timeout=30)

    ref, mask = stacked(data, "ref_logprobs"), stacked(data, "mask")
    old, adv = stacked(data, "logprobs"), stacked(data, "advantages")
    divisor = len(data) * 8

    def hand_loss() -> torch.Tensor:  # on a fresh forward of the initial model each time (one backward each)
        logps = policy_logprobs(fake_tinker.initial, data)
        to_go = kl_to_go(logps, ref, mask)
        k = hand_k1(logps, ref, mask).detach() + to_go * (logps - logps.detach())
        ratio = torch.exp(logps - old)
        surrogate = -torch.minimum(ratio * adv, torch.clamp(ratio, 0.8, 1.2) * adv) * mask
        return surrogate.sum() / divisor + 0.4 * (k * mask).sum() / divisor

    expected = hand_loss()
    logps = policy_logprobs(fake_tinker.initial, data).detach()
    to_go = kl_to_go(logps, ref, mask)
    assert (to_go != hand_k1(logps, ref, mask)).any() and (to_go < 0).any() and (to_go > 0).any()
    assert result.metrics["grpo/kl_term"] == pytest.approx(0.4 * float(hand_k1(logps, ref, mask).sum()) / divisor,
                                                           rel=1e-5)
    assert result.metrics["loss:sum"] == pytest.approx(float(expected.detach()), rel=1e-5)
    assert_model_grads(fake_tinker, expected)

    fn, ranks = integration.traceable_grpo_loss(akl)
    handle = fake_tinker.client.create_custom_loss(fn, ranks).result(timeout=30)
    traced = integration.traced_loss_data(akl, data, max_completion_length=8)
    for i, datum in enumerate(traced):
        length = len(datum.loss_fn_inputs["target_tokens"].tolist())
        inputs = [datum.loss_fn_inputs[name].to_torch() for name in handle.input_names]
        row = logps[i, :length].detach().requires_grad_(True)
        graph_loss, graph_metrics = handle.graph(row, *inputs)
        eager_loss, _ = fn(row, *inputs)
        torch.testing.assert_close(graph_loss, eager_loss, rtol=0, atol=0)
        (grad,) = torch.autograd.grad(graph_loss, row)
        surrogate_row = row.detach().clone().requires_grad_(True)
        ratio = torch.exp(surrogate_row - old[i, :length])
        pg = (-torch.minimum(ratio * adv[i, :length], torch.clamp(ratio, 0.8, 1.2) * adv[i, :length])
              * mask[i, :length]).sum() / divisor
        (pg_grad,) = torch.autograd.grad(pg, surrogate_row)
        torch.testing.assert_close(grad, pg_grad + 0.4 * to_go[i, :length] / divisor, **TIGHT)
        assert float(graph_metrics["custom/adaptive_kl/adapted_kl:sum"].detach()) == pytest.approx(
            float(hand_k1(logps, ref, mask)[i].sum()) / divisor, rel=1e-5)
    fake_tinker.service.zero_grad()
    result = fake_tinker.training.forward_backward_custom(traced, handle).result(timeout=30)
    assert result.metrics["loss:sum"] == pytest.approx(float(expected.detach()), rel=1e-5)
    assert_model_grads(fake_tinker, hand_loss())


def test_traced_loss_data_refuses_a_nonfinite_log_prob_on_a_valid_token() -> None:
    """The traced route's inputs are checked on the caller's thread before anything is sent: a NaN or inf in a
    Datum's ref_logprobs or logprobs on a completion token raises NonFiniteLogProbError naming the input and the one
    token; on a prompt token (mask 0) it is padding and passes."""
    akl = AdaptiveKL(AdaptiveKLConfig(kl_adaptation_method="clip"), beta=0.2)
    for key, value, name in (("ref_logprobs", math.nan, r"loss_fn_inputs\['ref_logprobs'\] \(the reference tensor\)"),
                             ("logprobs", math.inf, r"loss_fn_inputs\['logprobs'\] \(the sampler's; the policy "
                                                    r"tensor\)")):
        datum = integration.completion_datum([1, 2, 3], [4, 5], [-0.5, -1.5], [-0.7, -1.0])
        datum.loss_fn_inputs["advantages"] = types.TensorData.from_torch(torch.ones(4))
        values = datum.loss_fn_inputs[key].to_torch().clone()
        values[0] = value  # a prompt position
        datum.loss_fn_inputs[key] = types.TensorData.from_torch(values)
        integration.traced_loss_data(akl, [datum])
        values[3] = value  # a completion token
        datum.loss_fn_inputs[key] = types.TensorData.from_torch(values)
        with pytest.raises(NonFiniteLogProbError, match=rf"at step 1: .*{name}: 1 valid token"):
            integration.traced_loss_data(akl, [datum])


def test_the_custom_loss_reads_the_sdks_policy_rows_in_float32_and_refuses_a_nonfinite_one() -> None:
    """SPEC 3.13 at route 1 for the policy log-probs the SDK hands the loss: rows in float64 give the float32 loss of
    the same rows in float32 (the core computes in float32 whatever it is given), and a NaN on a valid token raises
    NonFiniteLogProbError naming the policy tensor and the step the loss was built for (2, after one akl.step())."""
    akl = AdaptiveKL(AdaptiveKLConfig(kl_adaptation_method="none"), beta=0.1)
    akl.step()
    datum = integration.completion_datum([1, 2], [3, 4], [-1.0, -1.0], [-0.5, -1.5])
    datum.loss_fn_inputs["advantages"] = types.TensorData.from_torch(torch.ones(3))
    loss_fn = integration.grpo_kl_loss(akl)
    (loss64, metrics64), (loss32, metrics32) = (loss_fn([datum], [torch.tensor([0.0, -0.7, -1.2], dtype=dtype)])
                                                for dtype in (torch.float64, torch.float32))
    assert loss64.dtype == torch.float32 and torch.equal(loss64, loss32) and metrics64 == metrics32
    with pytest.raises(NonFiniteLogProbError, match=r"^adaptive KL: non-finite input at step 2: NaN or \+-inf on valid "
                                                    r"\(mask=1\) tokens in the policy log-probs: "
                                                    r"1 valid token"):
        loss_fn([datum], [torch.tensor([0.0, math.nan, -1.0])])


def test_the_custom_and_the_traced_routes_share_their_checks() -> None:
    """Routes 1 and 3 keep one set of rules (on b3d53c1 they did not): a NaN in the sampler's log-probs on a valid
    token raises NonFiniteLogProbError naming it in both, before a loss is computed (route 1 returned loss=nan); both
    refuse clip_epsilon=1.5 with one message (route 3 accepted it)."""
    akl = AdaptiveKL(AdaptiveKLConfig(kl_adaptation_method="clip"), beta=0.2)
    datum = integration.completion_datum([1, 2, 3], [4, 5], [-0.5, math.nan], [-0.7, -1.0])
    datum.loss_fn_inputs["advantages"] = types.TensorData.from_torch(torch.ones(4))
    sampler = r"loss_fn_inputs\['logprobs'\] \(the sampler's; the policy tensor\): 1 valid token\(s\)"
    with pytest.raises(NonFiniteLogProbError, match=rf"at step 1: .*{sampler}"):
        integration.grpo_kl_loss(akl)([datum], [torch.full((4,), -1.0, requires_grad=True)])
    with pytest.raises(NonFiniteLogProbError, match=rf"at step 1: .*{sampler}"):
        integration.traced_loss_data(akl, [datum])
    # route 2 (the KL in the reward) named it "the policy log-probs", the own-loop door's words; two Datums, two tokens
    in_reward = AdaptiveKL(AdaptiveKLConfig(kl_placement="reward"), beta=0.2)
    with pytest.raises(NonFiniteLogProbError, match=rf"at step 1: .*{sampler.replace('1 valid', '2 valid')}"):
        integration.kl_penalized_data(in_reward, [datum] * 2, [0.0, 1.0], group_size=2)
    for route in (integration.grpo_kl_loss, integration.traceable_grpo_loss):
        with pytest.raises(ValueError, match=r"^clip_epsilon=1\.5 is invalid: allowed is a number with 0 <= x < 1\.$"):
            route(akl, clip_epsilon=1.5)


def test_every_route_refuses_negative_log_likelihoods_in_a_datum_naming_the_input() -> None:
    """A Datum built with -log p (the sampler's, or the reference's) instead of log p: routes 1 and 3 and the KL in
    the reward each refuse it before anything is computed or sent, naming the input and its mean over the valid
    tokens (the two completion tokens: (0.5 + 1.5) / 2 = +1); prompt positions are not read."""
    akl = AdaptiveKL(AdaptiveKLConfig(kl_adaptation_method="clip"), beta=0.2)
    in_reward = AdaptiveKL(AdaptiveKLConfig(kl_placement="reward"), beta=0.2)
    for negated, name in ((([0.5, 1.5], [-0.7, -1.0]), r"loss_fn_inputs\['logprobs'\] \(the sampler's\)"),
                          (([-0.5, -1.5], [0.5, 1.5]), r"loss_fn_inputs\['ref_logprobs'\]")):
        datum = integration.completion_datum([1, 2, 3], [4, 5], *negated)
        datum.loss_fn_inputs["advantages"] = types.TensorData.from_torch(torch.ones(4))
        message = (r"^adaptive KL: log-probs above 0 at step 1: over its 2 valid \(mask=1\) tokens: "
                   rf"{name} average \+1 a token\. ")
        with pytest.raises(ValueError, match=message):
            integration.grpo_kl_loss(akl)([datum], [torch.full((4,), -1.0, requires_grad=True)])
        with pytest.raises(ValueError, match=message):
            integration.traced_loss_data(akl, [datum])
        with pytest.raises(ValueError, match=message.replace("2 valid", "4 valid")):
            integration.kl_penalized_data(in_reward, [datum] * 2, [0.0, 1.0], group_size=2)
    prompt = integration.completion_datum([1, 2, 3], [4, 5], [-0.5, -1.5], [-0.7, -1.0])
    for key in ("logprobs", "ref_logprobs"):
        values = prompt.loss_fn_inputs[key].to_torch().clone()
        values[:2] = 5.0  # prompt positions (mask 0)
        prompt.loss_fn_inputs[key] = types.TensorData.from_torch(values)
    prompt.loss_fn_inputs["advantages"] = types.TensorData.from_torch(torch.ones(4))
    integration.traced_loss_data(akl, [prompt])


# What a prompt position (mask 0) of each Datum input holds in `with_garbage_on_prompts`.
GARBAGE = {"logprobs": math.nan, "advantages": math.nan, "ref_logprobs": -math.inf}


def with_garbage_on_prompts(data: list[Any]) -> list[Any]:
    """The Datums with NaN / -inf on every prompt position (mask 0) of the sampler's log-probs, the advantages and
    the reference log-probs."""
    out = []
    for datum in data:
        mask = datum.loss_fn_inputs["mask"].to_torch()
        inputs = dict(datum.loss_fn_inputs)
        for key, value in GARBAGE.items():
            inputs[key] = types.TensorData.from_torch(torch.where(mask > 0, inputs[key].to_torch().float(), value))
        out.append(types.Datum(model_input=datum.model_input, loss_fn_inputs=inputs))
    return out


def test_prompt_positions_may_hold_anything_in_both_routes(fake_tinker: Tinker) -> None:
    """SPEC 3.13 at Tinker's routes 1 and 3: NaN or -inf on the prompt positions (mask 0) of the sampler's log-probs,
    the advantages and the reference log-probs give the clean batch's loss and model gradients exactly, through the
    SDK; so do NaN policy log-probs there, handed to route 1's loss as the SDK hands them (its PPO-clip surrogate
    read its inputs unmasked: the gradient was NaN, route 3's loss NaN)."""
    akl = AdaptiveKL(AdaptiveKLConfig(kl_adaptation_method="clip", kl_clip_threshold=0.3), beta=0.5, loss_type="grpo")
    clean = with_advantages(make_data(fake_tinker.initial, seed=23), ADVANTAGES)
    dirty = with_garbage_on_prompts(clean)
    assert all(torch.isnan(d.loss_fn_inputs["advantages"].to_torch()).any() for d in dirty)
    loss_fn = integration.grpo_kl_loss(akl)
    logps, mask = policy_logprobs(fake_tinker.initial, clean).detach(), stacked(clean, "mask")
    direct = {}
    for name, data, policy in (("clean", clean, logps), ("dirty", dirty, torch.where(mask > 0, logps, math.nan))):
        rows = [policy[i, : len(d.loss_fn_inputs["target_tokens"].tolist())].clone().requires_grad_(True)
                for i, d in enumerate(data)]
        loss, _ = loss_fn(data, rows)
        loss.backward()
        direct[name] = (loss.detach(), [row.grad for row in rows])
    assert torch.isfinite(direct["dirty"][0]) and torch.equal(direct["dirty"][0], direct["clean"][0])
    for got, want in zip(direct["dirty"][1], direct["clean"][1]):
        assert torch.isfinite(got).all() and torch.equal(got, want)
    assert any(grad.abs().sum() > 0 for grad in direct["clean"][1])

    fn, ranks = integration.traceable_grpo_loss(akl)
    handle = fake_tinker.client.create_custom_loss(fn, ranks).result(timeout=30)
    for route in ("custom", "traced"):
        runs = {}
        for name, data in (("clean", clean), ("dirty", dirty)):
            fake_tinker.service.zero_grad()
            if route == "custom":
                result = fake_tinker.training.forward_backward_custom(data, integration.grpo_kl_loss(akl))
            else:
                result = fake_tinker.training.forward_backward_custom(integration.traced_loss_data(akl, data), handle)
            runs[name] = (result.result(timeout=30).metrics["loss:sum"], fake_tinker.service.grads())
        assert math.isfinite(runs["dirty"][0]) and runs["dirty"][0] == runs["clean"][0], route
        assert runs["dirty"][1].keys() == runs["clean"][1].keys() and runs["clean"][1]
        for key, grad in runs["dirty"][1].items():
            assert torch.isfinite(grad).all() and torch.equal(grad, runs["clean"][1][key]), (route, key)


def test_the_traced_loss_returns_the_check_and_check_traced_loss_raises_on_it(fake_tinker: Tinker) -> None:
    """The traced loss returns the core's non-finite check as metrics: summed over datums, the sums of the valid
    policy and reference log-probs, by hand; check_traced_loss passes them. Where the service's forward gives a NaN
    log-prob on a valid token (one embedding row NaN), the metric is NaN and check_traced_loss raises
    NonFiniteLogProbError naming the traced loss's policy log-probs."""
    akl = AdaptiveKL(AdaptiveKLConfig(kl_adaptation_method="clip", kl_clip_threshold=0.3), beta=0.4)
    data = with_advantages(make_data(fake_tinker.initial, seed=19), ADVANTAGES)
    fn, ranks = integration.traceable_grpo_loss(akl)
    handle = fake_tinker.client.create_custom_loss(fn, ranks).result(timeout=30)
    result = fake_tinker.training.forward_backward_custom(integration.traced_loss_data(akl, data), handle).result(
        timeout=30)
    mask = stacked(data, "mask")
    with torch.no_grad():
        policy = float((policy_logprobs(fake_tinker.initial, data) * mask).sum())
    assert result.metrics["custom/adaptive_kl/policy_logprobs:sum"] == pytest.approx(policy, rel=1e-5)
    assert result.metrics["custom/adaptive_kl/ref_logprobs:sum"] == pytest.approx(
        float((stacked(data, "ref_logprobs") * mask).sum()), rel=1e-5)
    integration.check_traced_loss(akl, result)

    last_input = data[0].model_input.to_ints()[-1]  # the input of datum 0's last completion token
    with torch.no_grad():
        fake_tinker.service.model.embed.weight[last_input] = math.nan
    result = fake_tinker.training.forward_backward_custom(integration.traced_loss_data(akl, data), handle).result(
        timeout=30)
    assert math.isnan(result.metrics["custom/adaptive_kl/policy_logprobs:sum"])
    assert math.isfinite(result.metrics["custom/adaptive_kl/ref_logprobs:sum"])
    with pytest.raises(NonFiniteLogProbError, match=r"at step 1: .* in the logprobs \(in the traced loss; the policy "
                                                    r"tensor\): non-finite \(its sum"):
        integration.check_traced_loss(akl, result)


def test_traceable_loss_limits() -> None:
    """Settings a per-datum traced loss cannot represent are refused up front; torch.fx itself refuses a Python
    branch on a tensor attribute (the core's `masked` has one: `if product.requires_grad:`)."""
    for config in (AdaptiveKLConfig(kl_estimator="k3_bottom_percentile"), AdaptiveKLConfig(kl_placement="reward")):
        with pytest.raises(ValueError):
            integration.traceable_grpo_loss(AdaptiveKL(config, beta=0.1))

    def branches(logprobs, mask):
        product = logprobs * mask
        if product.requires_grad:
            return product.sum(), {}
        return -product.sum(), {}

    with pytest.raises(ValueError, match="cannot be traced by torch.fx"):
        trace_loss(branches, {"logprobs": 1, "mask": 1}, "session")


def test_the_tinker_pages_blocks_compile_and_their_names_exist() -> None:
    """docs/tinker.md's blocks need the service (no-run): here, with the SDK installed, each compiles, every name it
    imports exists in tinker and in this integration, and each method it calls on the service and training clients is
    one of theirs."""
    import ast
    import importlib
    import re
    from pathlib import Path

    page = (Path(__file__).parents[1] / "docs" / "tinker.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", page, re.S)
    assert len(blocks) == 3
    clients = {"service": tinker.ServiceClient, "training_client": tinker.TrainingClient}
    for code in blocks:
        tree = ast.parse(code)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                module = importlib.import_module(node.module)
                assert all(hasattr(module, alias.name) for alias in node.names), node.module
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "tinker":
                assert hasattr(tinker, node.attr), f"tinker.{node.attr}"
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in clients:
                assert hasattr(clients[node.value.id], node.attr), f"{node.value.id}.{node.attr}"


# ----- what a user passes: validations, clip bounds, scale_by_std, overrides ------------------------------------------

def test_completion_datum_refuses_what_it_cannot_align() -> None:
    """completion_datum needs a prompt token and a completion token, and exactly one sampler and one reference
    log-prob per completion token: anything else would misalign the inputs with target_tokens (without a prompt token
    there is no first input to predict the first completion token from)."""
    for prompt, completion in (([1, 2], []), ([], [3])):
        with pytest.raises(ValueError, match="^completion_datum needs at least one prompt token and one completion "
                                             "token$"):
            integration.completion_datum(prompt, completion, [-1.0] * len(completion), [-1.0] * len(completion))
    with pytest.raises(ValueError, match=r"^completion_datum: 2 completion tokens but 1 sampling and 2 reference "):
        integration.completion_datum([1, 2], [3, 4], [-1.0], [-1.0, -2.0])
    with pytest.raises(ValueError, match=r"^completion_datum: 2 completion tokens but 2 sampling and 1 reference "):
        integration.completion_datum([1, 2], [3, 4], [-1.0, -2.0], [-1.0])
    # text and None were torch's own errors ("too many dimensions 'str'", "must be real number, not NoneType")
    with pytest.raises(ValueError, match=r"^completion_datum: sampling_logprobs=\['a', 'b'\] is invalid: allowed is a "
                                         r"sequence of numbers or a tensor, one log-prob per completion token \("):
        integration.completion_datum([1, 2], [3, 4], ["a", "b"], [-1.0, -2.0])
    with pytest.raises(ValueError, match=r"^completion_datum: ref_logprobs=\[None, -1\.0\] is invalid: allowed is "):
        integration.completion_datum([1, 2], [3, 4], [-1.0, -2.0], [None, -1.0])



@pytest.mark.parametrize(("prompt", "completion", "message"), [
    # int() read these as the tokens 1, 7 and 1, 4: another prompt, another completion, silently
    ([1.9, 7.6], [3], r"^prompt_tokens\[0\]=1\.9 is invalid: allowed is a token id: an integer >= 0 "),
    ([1, 2], [True, 4], r"^completion_tokens\[0\]=True is invalid: allowed is a token id: an integer >= 0 "),
    ([1, 2], torch.tensor([3.0, 4.5]), r"^completion_tokens\[0\]=tensor\(3\.\) is invalid: allowed is a token id"),
    ([1, -2], [3], r"^prompt_tokens\[1\]=-2 is invalid: allowed is a token id: an integer >= 0 "),
    ([1, 2], [-1], r"^completion_tokens\[0\]=-1 is invalid: allowed is a token id: an integer >= 0 "),  # the bound
])
def test_completion_datum_refuses_a_token_that_is_not_an_id(prompt, completion, message) -> None:
    with pytest.raises(ValueError, match=message):
        integration.completion_datum(prompt, completion, [-1.0] * len(completion), [-1.0] * len(completion))


def test_completion_datum_takes_the_integer_ids_tokenizers_give() -> None:
    """Python ints, numpy ints and an integer tensor's elements are token ids: the same Datum from each."""
    expected = integration.completion_datum([5, 6], [7, 8], [-1.0, -2.0], [-1.5, -2.5])
    for prompt, completion in ((np.array([5, 6]), np.array([7, 8], dtype=np.int32)),
                               (torch.tensor([5, 6]), torch.tensor([7, 8]))):
        datum = integration.completion_datum(prompt, completion, [-1.0, -2.0], [-1.5, -2.5])
        assert datum.model_input.to_ints() == expected.model_input.to_ints() == [5, 6, 7]
        assert datum.loss_fn_inputs["target_tokens"].to_torch().tolist() == [6, 7, 8]


def test_mismatched_batches_are_refused_not_broadcast() -> None:
    """Every count must agree, and the error names the two: a Datum input of another length than target_tokens (T = 4
    here, 3 given; in a batch with a longer Datum, padding would hide it and misalign the tokens), log-prob tensors /
    result outputs / rewards of another count than the Datums (one reward for two Datums would broadcast to both), a
    policy row of another length than its Datum, inputs of shape (T, 1) (target_tokens too: aligned, but not one value
    per token); a Datum without an input the loss reads is named with the inputs it has; and the custom loss refuses the
    reward placement (its KL would be computed in the loss as well)."""
    datum = integration.completion_datum([1, 2, 3], [4, 5], [-0.5, -1.5], [-0.7, -1.0])
    datum.loss_fn_inputs["advantages"] = types.TensorData.from_torch(torch.tensor([0.0, 0.0, 1.0, 1.0]))
    akl = AdaptiveKL(AdaptiveKLConfig(kl_adaptation_method="none"), beta=0.1)
    row = torch.full((4,), -1.0)
    short = types.Datum(model_input=datum.model_input, loss_fn_inputs={
        **datum.loss_fn_inputs, "ref_logprobs": types.TensorData.from_torch(torch.tensor([0.0, -0.7, -1.0]))})
    longer = integration.completion_datum([1, 2, 3], [4, 5, 6], [-0.5, -1.5, -1.0], [-0.7, -1.0, -1.0])
    longer.loss_fn_inputs["advantages"] = types.TensorData.from_torch(torch.tensor([0.0, 0.0, 1.0, 1.0, 1.0]))
    with pytest.raises(ValueError, match=r"^loss_fn_inputs\['ref_logprobs'\] has shape \[3\], target_tokens \[4\]: "):
        integration.grpo_kl_loss(akl)([short, longer], [row, torch.full((5,), -1.0)])
    with pytest.raises(ValueError, match=r"^1 Datums but 2 log-prob tensors$"):
        integration.grpo_kl_loss(akl)([datum], [row, row])
    # the policy's rows in another order than the Datums (padded to one width, they trained on misaligned tokens, as
    # record_step_kl already refused), and a row of shape (T, 1) (a bare broadcast error)
    swapped = r"^logprobs\[0\] has 5 values, Datum 0 4 target tokens: the SDK passes one log-prob per target token, "
    with pytest.raises(ValueError, match=swapped):
        integration.grpo_kl_loss(akl)([datum, longer], [torch.full((5,), -1.0), row])
    with pytest.raises(ValueError, match=r"^logprobs\[0\] has shape \(4, 1\), Datum 0 4 target tokens: "):
        integration.grpo_kl_loss(akl)([datum], [row.view(4, 1)])
    # every input of shape (T, 1), target_tokens too: aligned, but not one value per token (the SDK takes it)
    column = types.Datum(model_input=datum.model_input, loss_fn_inputs={
        key: types.TensorData.from_torch(value.to_torch().view(4, 1)) for key, value in datum.loss_fn_inputs.items()})
    with pytest.raises(ValueError, match=r"^loss_fn_inputs\['logprobs'\] has shape \[4, 1\], target_tokens \[4, 1\]: "
                                         r"each input holds one value per target token$"):
        integration.grpo_kl_loss(akl)([column], [row])
    # a Datum built without advantages (completion_datum adds none): named, with what it has and how to add it (it
    # said "build it with completion_datum", which builds none); builtin_loss_data raised a bare KeyError('advantages')
    bare = integration.completion_datum([1, 2, 3], [4, 5], [-0.5, -1.5], [-0.7, -1.0])
    no_advantages = (r"has no loss_fn_inputs\['advantages'\] \(it has logprobs, mask, ref_logprobs, target_tokens\); "
                     r"set it from your advantages, A_i on each completion token, as a TensorData aligned with "
                     r"target_tokens \(or build the data with kl_penalized_data, which sets it\)\"$")
    with pytest.raises(KeyError, match=r'^"Datum ' + no_advantages):
        integration.grpo_kl_loss(akl)([bare], [row])
    with pytest.raises(KeyError, match=r'^"data\[1\] ' + no_advantages):
        integration.builtin_loss_data([datum, bare])
    with pytest.raises(KeyError, match=r"^\"data\[0\] has no loss_fn_inputs\['clip_ratio'\] \(it has advantages, "
                                       r"logprobs, mask, ref_logprobs, target_tokens\); add it as a TensorData "
                                       r"aligned with target_tokens\"$"):  # a built-in loss's own input: not ours
        integration.builtin_loss_data([datum], (*integration.BUILTIN_LOSS_INPUTS, "clip_ratio"))
    no_mask = types.Datum(model_input=datum.model_input, loss_fn_inputs={
        key: value for key, value in datum.loss_fn_inputs.items() if key != "mask"})
    with pytest.raises(KeyError, match=r"^\"Datum has no loss_fn_inputs\['mask'\] \(it has advantages, logprobs, "
                                       r"ref_logprobs, target_tokens\); build it with completion_datum"):
        integration.grpo_kl_loss(akl)([no_mask], [row])
    # a list set after the Datum was built (the SDK converts one given at construction): named, with what to pass
    # (it raised AttributeError: 'list' object has no attribute 'to_torch')
    bare.loss_fn_inputs["advantages"] = [0.0, 1.0]
    assert types.Datum(model_input=bare.model_input, loss_fn_inputs=dict(bare.loss_fn_inputs)).loss_fn_inputs[
        "advantages"].to_torch().tolist() == [0.0, 1.0]
    with pytest.raises(TypeError, match=r"^loss_fn_inputs\['advantages'\] is a list: allowed is a tinker "
                                        r"types\.TensorData aligned with target_tokens"):
        integration.grpo_kl_loss(akl)([bare], [row])
    bare.loss_fn_inputs["advantages"] = types.TensorData.from_torch(torch.tensor([0.0, 1.0]))
    bare.loss_fn_inputs["target_tokens"] = [4, 5]  # read beside every input: named too
    with pytest.raises(TypeError, match=r"^loss_fn_inputs\['target_tokens'\] is a list: allowed is a tinker "):
        integration.grpo_kl_loss(akl)([bare], [row])
    two_outputs = types.ForwardBackwardOutput(
        loss_fn_output_type="ArrayRecord", loss_fn_outputs=[{"logprobs": types.TensorData.from_torch(row)}] * 2)
    with pytest.raises(ValueError, match=r"^1 Datums but the result has 2 outputs$"):
        integration.record_step_kl(akl, [datum], two_outputs)
    with pytest.raises(ValueError, match=r"^kl_placement='reward' puts beta \* KL into the rewards: use "
                                         r"kl_penalized_data\(\.\.\.\)"):
        integration.grpo_kl_loss(AdaptiveKL(AdaptiveKLConfig(kl_placement="reward"), beta=0.1))
    reward_akl = AdaptiveKL(AdaptiveKLConfig(kl_placement="reward"), beta=0.1)
    with pytest.raises(ValueError, match=r"^2 Datums but 1 rewards$"):
        integration.kl_penalized_data(reward_akl, [datum] * 2, [1.0], group_size=2)


def test_clip_bounds_and_an_asymmetric_high_clip_in_both_routes() -> None:
    """Allowed: 0 <= clip_epsilon < 1 and clip_epsilon_high >= 0 (None: clip_epsilon), bounds (1 - eps, 1 + eps_high).
    With eps=0.2, eps_high=0.28 on one completion (mask 0,1,1,1; old log-probs -1; KL 0: ref = policy), three tokens:
    ratio 0.5, A=-1: -min(-0.5, -0.8) = 0.8 (the low bound binds); ratio 1.25, A=1: -1.25 (inside [0.8, 1.28], not
    inside 1.2); ratio 1.5, A=1: -min(1.5, 1.28) = -1.28. grpo's mean over the 3 tokens: PG = (0.8 - 1.25 - 1.28)/3
    = -0.57667 in routes 1 and 3, and only the unclipped token has a gradient, -ratio A / 3 = -1.25/3."""
    akl = AdaptiveKL(AdaptiveKLConfig(kl_adaptation_method="none"), beta=0.1, loss_type="grpo")
    for clip_epsilon, clip_epsilon_high, bounds in ((0.2, None, (0.8, 1.2)), (0.2, 0.28, (0.8, 1.28)),
                                                    (0.0, 0.0, (1.0, 1.0)), (0.1, 0.3, (0.9, 1.3))):
        loss_fn = integration.grpo_kl_loss(akl, clip_epsilon=clip_epsilon, clip_epsilon_high=clip_epsilon_high)
        assert (loss_fn.clip_low, loss_fn.clip_high) == pytest.approx(bounds)
    built = integration.GRPOKLLoss(akl)  # the public class built directly has grpo_kl_loss's defaults
    assert (built.clip_low, built.clip_high) == pytest.approx((0.8, 1.2))
    # each field by its name (a text epsilon raised a bare TypeError, a bool one was taken as 1.0)
    for clip_epsilon, clip_epsilon_high, message in (
            (1.0, None, r"^clip_epsilon=1\.0 is invalid: allowed is a number with 0 <= x < 1\.$"),
            (-0.1, None, r"^clip_epsilon=-0\.1 is invalid: "), ("0.2", None, r"^clip_epsilon='0\.2' is invalid: "),
            (0.2, -0.1, r"^clip_epsilon_high=-0\.1 is invalid: allowed is a finite number >= 0, or None for "
                        r"clip_epsilon\.$"),
            (0.2, True, r"^clip_epsilon_high=True is invalid: "), (0.2, math.inf, r"^clip_epsilon_high=inf is ")):
        for route in (integration.grpo_kl_loss, integration.traceable_grpo_loss):
            with pytest.raises(ValueError, match=message):
                route(akl, clip_epsilon=clip_epsilon, clip_epsilon_high=clip_epsilon_high)

    ratios = [0.5, 1.25, 1.5]
    policy = [0.0] + [-1.0 + math.log(r) for r in ratios]
    datum = integration.completion_datum([1, 2], [3, 4, 5], [-1.0] * 3, policy[1:])
    datum.loss_fn_inputs["advantages"] = types.TensorData.from_torch(torch.tensor([0.0, -1.0, 1.0, 1.0]))
    pg = (0.8 - 1.25 - 1.28) / 3

    row = torch.tensor(policy, requires_grad=True)
    loss, metrics = integration.grpo_kl_loss(akl, clip_epsilon=0.2, clip_epsilon_high=0.28)([datum], [row])
    assert metrics["grpo/pg_loss"] == pytest.approx(pg, rel=1e-5)
    assert float(loss.detach()) == pytest.approx(pg, rel=1e-5)
    loss.backward()
    torch.testing.assert_close(row.grad, torch.tensor([0.0, 0.0, -1.25 / 3, 0.0]), **TIGHT)

    fn, ranks = integration.traceable_grpo_loss(akl, clip_epsilon=0.2, clip_epsilon_high=0.28)
    (traced,) = integration.traced_loss_data(akl, [datum])
    inputs = [traced.loss_fn_inputs[name].to_torch() for name in list(ranks)[1:]]
    row = torch.tensor(policy, requires_grad=True)
    loss, metrics = fn(row, *inputs)
    assert float(metrics["custom/grpo/pg_loss:sum"].detach()) == pytest.approx(pg, rel=1e-5)
    loss.backward()
    torch.testing.assert_close(row.grad, torch.tensor([0.0, 0.0, -1.25 / 3, 0.0]), **TIGHT)


def test_kl_penalized_data_scale_by_std() -> None:
    """With scale_by_std, A_i = (r'_i - mean_g r') / (std_g r' + std_epsilon), std the sample (n - 1) standard
    deviation of the group, as TRL's GRPO; std_epsilon 1e-4 by default. Four identical completions (k1 = logp - ref =
    0.25, 0, 0.5, kl_adaptation_method none: P = 0.1 * 0.75 = 0.075 each, so it cancels within a group), rewards
    (0, 2e-4 | 1, 3): group 1 is +-1e-4 / (sqrt(2) 1e-4 + 1e-4) = +-0.41421 (the epsilon is of the order of the
    spread), group 2 +-1 / (sqrt(2) + 1e-4); std_epsilon=0.5 gives +-1 / (sqrt(2) + 0.5) in group 2.
    reward/mean = 1.00005, reward/penalized_mean = 1.00005 - 0.075."""
    akl = AdaptiveKL(AdaptiveKLConfig(kl_placement="reward", kl_adaptation_method="none"), beta=0.1)
    data = [integration.completion_datum([1, 2], [3, 4, 5], [-1.0, -1.5, -0.5], [-1.25, -1.5, -1.0])] * 4
    rewards = [0.0, 2e-4, 1.0, 3.0]

    def expected(epsilon: float) -> list[float]:
        out = []
        for group in (rewards[:2], rewards[2:]):
            mean = sum(group) / 2
            std = math.sqrt(sum((r - mean) ** 2 for r in group) / (2 - 1))
            out += [(r - mean) / (std + epsilon) for r in group]
        return out

    assert expected(1e-4)[:2] == pytest.approx([-0.41421, 0.41421], rel=1e-4)
    for kwargs, epsilon in (({}, 1e-4), ({"std_epsilon": 0.5}, 0.5)):
        datums, metrics = integration.kl_penalized_data(akl, data, rewards, group_size=2, scale_by_std=True, **kwargs)
        for datum, advantage in zip(datums, expected(epsilon)):
            mask = datum.loss_fn_inputs["mask"].to_torch()
            torch.testing.assert_close(datum.loss_fn_inputs["advantages"].to_torch(), advantage * mask,
                                       rtol=1e-3, atol=1e-6)
        assert metrics["adaptive_kl/reward_penalty"] == pytest.approx(0.075, rel=1e-5)
        assert metrics["reward/mean"] == pytest.approx(1.00005, rel=1e-6)
        assert metrics["reward/penalized_mean"] == pytest.approx(1.00005 - 0.075, rel=1e-6)


@pytest.mark.parametrize("scale_by_std", ["False", 1, None])
def test_kl_penalized_data_scale_by_std_is_true_or_false(scale_by_std) -> None:
    """scale_by_std="False" (a config's text) scaled the advantages, silently, as a truthy value; train beside it was
    refused the same value."""
    akl = AdaptiveKL(AdaptiveKLConfig(kl_placement="reward"), beta=0.1)
    data = [integration.completion_datum([1, 2], [3, 4], [-1.0, -1.5], [-1.25, -1.5])] * 2
    with pytest.raises(ValueError, match=rf"^scale_by_std={scale_by_std!r} is invalid: allowed is True \(each group's "
                                         r"advantages divided by its rewards' std \+ std_epsilon\) or False\.$"):
        integration.kl_penalized_data(akl, data, [0.0, 1.0], group_size=2, scale_by_std=scale_by_std)


def test_kl_penalized_data_gives_a_datum_without_tokens_its_groups_mean_penalty() -> None:
    """A Datum whose mask is all 0 has no KL: it carries the mean penalty of its group's Datums with tokens, as TRL's
    scoring gives it (penalised 0, its reward would lower the others' advantages). By hand, k1 = logp - ref: datum 0
    k1 = 0.2 + 0.1 + 0.2 = 0.5, datum 1 (masked out) none, datum 2 0.25 + 0 + 0.5 = 0.75; beta 2: P = 1.0, (1.0 + 1.5) /
    2 = 1.25 (the mean over its group's Datums with tokens: 0 and 2), 1.5. Equal rewards 1: penalised 0, -0.25, -0.5,
    mean -0.25, advantages 0.25, 0, -0.25: the Datum without tokens is at the mean and the others sum to 0 (with a
    penalty of 0 it would be at 1 and the others at -1/3 and -2/3)."""
    akl = AdaptiveKL(AdaptiveKLConfig(kl_placement="reward"), beta=2.0)
    data = [integration.completion_datum([1, 2], [3, 4, 5], [-0.5, -0.9, -1.0], [-0.7, -1.0, -1.2]),
            integration.completion_datum([1, 2], [3, 4, 5], [-0.5, -0.9, -1.0], [-0.7, -1.0, -1.2]),
            integration.completion_datum([1, 2], [3, 4, 5], [-0.25, -1.0, -0.5], [-0.5, -1.0, -1.0])]
    data[1].loss_fn_inputs["mask"] = types.TensorData.from_torch(torch.zeros(4))
    datums, metrics = integration.kl_penalized_data(akl, data, [1.0, 1.0, 1.0], group_size=3)
    advantages = [float(datum.loss_fn_inputs["advantages"].to_torch().sum()) / 3 for datum in (datums[0], datums[2])]
    assert advantages == pytest.approx([0.25, -0.25], abs=1e-6)
    assert float(datums[1].loss_fn_inputs["advantages"].to_torch().abs().sum()) == 0.0  # masked: 0 on every token
    assert metrics["reward/penalized_mean"] == pytest.approx(1.0 - 1.25, abs=1e-6)
    assert metrics["adaptive_kl/reward_penalty"] == pytest.approx(1.25, abs=1e-6)  # the Datums with tokens'


def test_record_step_kl_reduces_with_the_divisor_it_is_given() -> None:
    """record_step_kl of a dr_grpo batch: the KL is sum_i sum_t m k3 / (B * max_completion_length), k3 = exp(r) - r - 1,
    r = ref - logp, on the log-probs the result carries: completion 1 r = (-0.5, 0.5), completion 2 r = (0, 0, 1), so
    (e^-0.5 - 0.5 + e^0.5 - 1.5 + e - 2) / (2 * 8) = 0.060846."""
    akl = AdaptiveKL(AdaptiveKLConfig(kl_adaptation_method="none"), beta=0.1, loss_type="dr_grpo")
    data = [integration.completion_datum([1, 2], [3, 4], [-1.0, -1.0], [-1.5, -0.5]),
            integration.completion_datum([1], [2, 3, 4], [-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0])]
    rows = ([0.0, -1.0, -1.0], [-1.0, -1.0, -2.0])  # the policy's log-probs, as the result carries them
    result = types.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", loss_fn_outputs=[
        {"logprobs": types.TensorData.from_torch(torch.tensor(row))} for row in rows])
    kl = (math.exp(-0.5) - 0.5 + math.exp(0.5) - 1.5 + math.e - 2) / (2 * 8)
    assert kl == pytest.approx(0.060846, rel=1e-4)
    metrics = integration.record_step_kl(akl, data, result, max_completion_length=8)
    assert metrics["adaptive_kl/raw_kl"] == pytest.approx(kl, rel=1e-5)
    assert metrics["adaptive_kl/adapted_kl"] == pytest.approx(kl, rel=1e-5)


def test_traced_loss_data_takes_akls_beta() -> None:
    """traced_loss_data's beta is akl.current_beta (0.2), read when the Datums are built, as `grpo_kl_loss` captures
    it: the traced loss's KL part is that beta times its KL, K = sum_t k3 / L here (one completion, ref - logp =
    (0.5, -0.5): K = (e^0.5 - 1.5 + e^-0.5 - 0.5) / 2 = 0.12763)."""
    akl = AdaptiveKL(AdaptiveKLConfig(kl_adaptation_method="none"), beta=0.2, loss_type="grpo")
    datum = integration.completion_datum([1, 2], [3, 4], [-1.0, -1.0], [-0.5, -1.5])
    datum.loss_fn_inputs["advantages"] = types.TensorData.from_torch(torch.tensor([0.0, 1.0, 1.0]))
    fn, ranks = integration.traceable_grpo_loss(akl)
    kl = (math.exp(0.5) - 1.5 + math.exp(-0.5) - 0.5) / 2
    (traced,) = integration.traced_loss_data(akl, [datum])
    inputs = [traced.loss_fn_inputs[name].to_torch() for name in list(ranks)[1:]]
    _, metrics = fn(torch.tensor([0.0, -1.0, -1.0]), *inputs)
    assert float(metrics["custom/adaptive_kl/adapted_kl:sum"]) == pytest.approx(kl, rel=1e-5)
    assert float(metrics["custom/grpo/kl_term:sum"]) == pytest.approx(0.2 * kl, rel=1e-5)


def test_check_traced_loss_raises_on_an_infinite_log_prob_too() -> None:
    """A log-prob of -inf (a token of probability 0) on a valid token makes the traced loss's sum -inf, not NaN:
    check_traced_loss raises on it as on a NaN, naming the tensor (the policy's or the reference's); finite sums
    pass."""
    akl = AdaptiveKL(AdaptiveKLConfig(kl_adaptation_method="none"), beta=0.1)
    policy, reference = "custom/adaptive_kl/policy_logprobs:sum", "custom/adaptive_kl/ref_logprobs:sum"

    def result(policy_sum: float, ref_sum: float) -> Any:
        return types.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", loss_fn_outputs=[],
                                           metrics={policy: policy_sum, reference: ref_sum,
                                                    "custom/adaptive_kl/adapted_kl:sum": 0.5})

    integration.check_traced_loss(akl, result(-5.0, -6.0))
    with pytest.raises(NonFiniteLogProbError, match=r"at step 1: .* in the ref_logprobs \(the reference tensor\): "
                                                    r"non-finite"):
        integration.check_traced_loss(akl, result(-5.0, -math.inf))
    with pytest.raises(NonFiniteLogProbError, match=r"at step 1: .* in the logprobs \(in the traced loss; the policy "
                                                    r"tensor\): non-finite"):
        integration.check_traced_loss(akl, result(math.inf, -6.0))


def test_a_divisor_the_loss_type_does_not_read_warns_in_both_loss_routes() -> None:
    """As in a loop of your own: a grpo `akl` (the default loss type) divides by neither divisor, so a token_normalizer
    handed to grpo_kl_loss, or a max_completion_length to traced_loss_data, warns that it has no effect, naming the
    loss types that read it; the dr_grpo divisor given to a dr_grpo `akl` is quiet."""
    datum = integration.completion_datum([1, 2], [3, 4], [-1.0, -1.0], [-0.5, -1.5])
    datum.loss_fn_inputs["advantages"] = types.TensorData.from_torch(torch.ones(3))
    grpo = AdaptiveKL(AdaptiveKLConfig(kl_adaptation_method="none"), beta=0.1)
    with pytest.warns(UserWarning, match=r"^token_normalizer has no effect: only loss_type dapo, cispo or vespo "
                                         r"reads it, and loss_type='grpo' reduces the loss by sequence_mean\."):
        integration.grpo_kl_loss(grpo, token_normalizer=7.0)
    with pytest.warns(UserWarning, match=r"^max_completion_length has no effect: only loss_type dr_grpo reads it"):
        integration.traced_loss_data(grpo, [datum], max_completion_length=8)
    dr_grpo = AdaptiveKL(AdaptiveKLConfig(kl_adaptation_method="none"), beta=0.1, loss_type="dr_grpo")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        integration.grpo_kl_loss(dr_grpo, max_completion_length=8)
        integration.traced_loss_data(dr_grpo, [datum], max_completion_length=8)


def test_a_dr_grpo_cap_below_a_completions_length_is_refused_in_both_loss_routes() -> None:
    """As in a loop of your own: a completion of 2 tokens against max_completion_length=1 would divide its KL by
    half its length; the traced route refuses it on the caller's thread, the custom loss where the SDK calls it."""
    datum = integration.completion_datum([1, 2], [3, 4], [-1.0, -1.0], [-0.5, -1.5])  # T = 3: mask 0, 1, 1
    datum.loss_fn_inputs["advantages"] = types.TensorData.from_torch(torch.ones(3))
    dr_grpo = AdaptiveKL(AdaptiveKLConfig(kl_adaptation_method="none"), beta=0.1, loss_type="dr_grpo")
    message = (r"^max_completion_length=1 is invalid: allowed is an integer >= 2, the longest completion's valid "
               r"tokens in this batch: loss_type='dr_grpo' divides the policy-gradient loss and the KL term by it")
    with pytest.raises(ValueError, match=message):
        integration.traced_loss_data(dr_grpo, [datum], max_completion_length=1)
    with pytest.raises(ValueError, match=message):
        integration.grpo_kl_loss(dr_grpo, max_completion_length=1)([datum], [torch.full((3,), -1.0)])
    loss, _ = integration.grpo_kl_loss(dr_grpo, max_completion_length=2)([datum], [torch.full((3,), -1.0)])
    assert math.isfinite(float(loss))


def test_a_setting_changed_after_the_run_started_is_refused_in_both_loss_routes() -> None:
    """As in a loop of your own: akl's kl_clip_threshold set to 0 after it was built (validated: 0.5) would clip every
    token's KL to 0, taking the KL term out; grpo_kl_loss, traceable_grpo_loss and traced_loss_data refuse it before a
    loss is built, naming the field and both values."""
    config = AdaptiveKLConfig(kl_adaptation_method="clip", kl_clip_threshold=0.5)
    akl = AdaptiveKL(config, beta=0.1)
    datum = integration.completion_datum([1, 2], [3, 4], [-1.0, -1.0], [-0.5, -1.5])
    config.kl_clip_threshold = 0.0
    for route in (lambda: integration.grpo_kl_loss(akl), lambda: integration.traced_loss_data(akl, [datum]),
                  lambda: integration.traceable_grpo_loss(akl)):
        with pytest.raises(ValueError, match=r"^kl_clip_threshold changed from 0\.5 to 0\.0 after the run started"):
            route()


def test_a_loss_built_keeps_its_settings_and_a_later_change_is_refused_at_the_next_door() -> None:
    """A loss is built with the settings checked then (as with its beta), the custom and the traced one (run eagerly
    here): kl_clip_threshold set to -5 on akl's config after grpo_kl_loss was built would have clipped every token's
    KL to -5 in that loss (on ccb0d5c: the adapted KL of this batch -5 * 2 tokens... a negative KL term). Each keeps
    0.5: its K is min(k3, 0.5) summed over the completion's 2 tokens / 2 (grpo), k3 = exp(r) - r - 1 of r = ref - logp
    by hand; the next akl.step() refuses the change, naming both values."""
    config = AdaptiveKLConfig(kl_adaptation_method="clip", kl_clip_threshold=0.5)
    akl = AdaptiveKL(config, beta=0.1)
    datum = integration.completion_datum([1, 2], [3, 4], [-1.0, -1.0], [-0.5, -2.5])
    datum.loss_fn_inputs["advantages"] = types.TensorData.from_torch(torch.zeros(3))
    loss_fn = integration.grpo_kl_loss(akl)
    fn, ranks = integration.traceable_grpo_loss(akl)
    (traced,) = integration.traced_loss_data(akl, [datum])
    config.kl_clip_threshold = -5.0
    _, metrics = loss_fn([datum], [torch.tensor([0.0, -1.0, -1.0], requires_grad=True)])
    k3 = [math.exp(r) - r - 1 for r in (0.5, -1.5)]  # 0.1487, 0.7231: the second is clipped to 0.5
    assert metrics["adaptive_kl/adapted_kl"] == pytest.approx((k3[0] + 0.5) / 2, rel=1e-6)
    inputs = [traced.loss_fn_inputs[name].to_torch() for name in list(ranks)[1:]]
    _, summed = fn(torch.tensor([0.0, -1.0, -1.0]), *inputs)
    assert float(summed["custom/adaptive_kl/adapted_kl:sum"]) == pytest.approx((k3[0] + 0.5) / 2, rel=1e-6)
    with pytest.raises(ValueError, match=r"^kl_clip_threshold changed from 0\.5 to -5\.0 after the run started"):
        akl.step()


def test_a_nonfinite_advantage_on_a_completion_token_is_refused_in_both_loss_routes() -> None:
    """A NaN advantage on a completion token made route 1's loss and every gradient NaN (and route 3's), where a NaN
    log-prob there raises: both refuse it before a loss is computed, naming the input, the count and the Datum; on a
    prompt position (mask 0) it is padding and passes."""
    akl = AdaptiveKL(AdaptiveKLConfig(kl_adaptation_method="clip"), beta=0.2)
    good = integration.completion_datum([1, 2], [3, 4], [-1.0, -1.0], [-0.5, -1.5])
    good.loss_fn_inputs["advantages"] = types.TensorData.from_torch(torch.tensor([math.nan, 1.0, 1.0]))
    bad = integration.completion_datum([1, 2], [3, 4], [-1.0, -1.0], [-0.5, -1.5])
    bad.loss_fn_inputs["advantages"] = types.TensorData.from_torch(torch.tensor([0.0, math.inf, math.nan]))
    logps = [torch.full((3,), -1.0, requires_grad=True) for _ in range(2)]
    loss, _ = integration.grpo_kl_loss(akl)([good], logps[:1])
    assert math.isfinite(float(loss.detach()))
    integration.traced_loss_data(akl, [good])
    message = (r"^loss_fn_inputs\['advantages'\] holds NaN or \+-inf on 2 valid \(mask=1\) token\(s\), in Datum\(s\) "
               r"\[1\]: allowed is a finite advantage")
    with pytest.raises(ValueError, match=message):
        integration.grpo_kl_loss(akl)([good, bad], logps)
    with pytest.raises(ValueError, match=message):
        integration.traced_loss_data(akl, [good, bad])


def test_the_traced_route_refuses_a_registered_reduction_its_weights_do_not_reproduce() -> None:
    """traced_loss_data turns the KL reduction into per-token weights (its gradient at 0), exact for a reduction linear
    in the per-completion sums S_i. A registered mean_i (S_i / L_i)^2 has the gradient 0 at 0: the traced loss took
    K = 0 where grpo_kl_loss takes K = mean_i (S_i / L_i)^2 (on ccb0d5c, silently). Now it is refused, naming the
    setting, and so is one that divides by a count of 0 on the batch (infinite, its weights as infinite: they agree,
    but the traced loss would be inf); a linear registered reduction (2 * mean_i S_i) passes, its weights 2 / B on
    each valid token."""
    from unsloth_adaptive_kl import register_kl_reduction
    from unsloth_adaptive_kl.core import reductions

    data = []
    for ref in ([-0.5, -1.5], [-1.0, -3.0]):
        datum = integration.completion_datum([1, 2], [3, 4], [-1.0, -1.0], ref)
        datum.loss_fn_inputs["advantages"] = types.TensorData.from_torch(torch.zeros(3))
        data.append(datum)
    try:
        register_kl_reduction("squared_mean")(lambda sums, lengths, ctx: ((sums / lengths) ** 2).mean())
        register_kl_reduction("twice_sum_mean")(lambda sums, lengths, ctx: 2 * sums.mean())
        register_kl_reduction("over_zero")(lambda sums, lengths, ctx: sums.sum() / (lengths - lengths).sum())
        squared = AdaptiveKL(AdaptiveKLConfig(kl_reduction="squared_mean"), beta=0.1)
        _, metrics = integration.grpo_kl_loss(squared)(data, [torch.full((3,), -1.0, requires_grad=True)] * 2)
        k3 = [[math.exp(r) - r - 1 for r in rows] for rows in ([0.5, -0.5], [0.0, -2.0])]
        assert metrics["adaptive_kl/adapted_kl"] == pytest.approx(
            sum((sum(row) / 2) ** 2 for row in k3) / 2, rel=1e-6)
        with pytest.raises(ValueError, match=r"^kl_reduction='squared_mean' is invalid for the traced loss: its "
                                             r"reduction is not linear in the per-completion sums .*grpo_kl_loss"):
            integration.traced_loss_data(squared, data)
        # divided by a count of 0: infinite on a one-token completion, its weights as infinite (equal, not finite)
        single = integration.completion_datum([1], [3], [-1.0], [-1.5])  # T = 1: no prompt position
        single.loss_fn_inputs["advantages"] = types.TensorData.from_torch(torch.ones(1))
        with pytest.raises(ValueError, match=r"^kl_reduction='over_zero' is invalid for the traced loss: .* it gives "
                                             r"-?inf, its per-token weights -?inf\)"):
            integration.traced_loss_data(AdaptiveKL(AdaptiveKLConfig(kl_reduction="over_zero"), beta=0.1), [single])
        linear = AdaptiveKL(AdaptiveKLConfig(kl_reduction="twice_sum_mean"), beta=0.1)
        traced = integration.traced_loss_data(linear, data)
        assert [d.loss_fn_inputs["kl_weights"].to_torch().tolist() for d in traced] == [[0.0, 1.0, 1.0]] * 2
    finally:
        for name in ("squared_mean", "twice_sum_mean", "over_zero"):
            reductions.REDUCTIONS.pop(name, None)


def test_traced_loss_data_refuses_the_kl_in_the_reward_as_the_other_loss_doors_do() -> None:
    """grpo_kl_loss and traceable_grpo_loss refuse kl_placement='reward'; traced_loss_data accepted it (on ccb0d5c)
    and returned the Datums of a loss the settings do not put the KL in. One message names the door."""
    akl = AdaptiveKL(AdaptiveKLConfig(kl_placement="reward"), beta=0.1)
    datum = integration.completion_datum([1, 2], [3, 4], [-1.0, -1.0], [-0.5, -1.5])
    for door, call in (("grpo_kl_loss", lambda: integration.grpo_kl_loss(akl)),
                       ("traceable_grpo_loss", lambda: integration.traceable_grpo_loss(akl)),
                       ("traced_loss_data", lambda: integration.traced_loss_data(akl, [datum]))):
        with pytest.raises(ValueError, match=rf"^kl_placement='reward' puts beta \* KL into the rewards: use "
                                             rf"kl_penalized_data\(\.\.\.\) .* instead of {door}\(\.\.\.\)$"):
            call()


@pytest.mark.parametrize("loss_type", ["cispo", "sapo", "vespo", "luspo"])
def test_a_loss_type_whose_policy_gradient_term_is_not_ppo_clip_is_refused_by_the_loss_doors(loss_type: str) -> None:
    """Routes 1 and 3 compute the token-level PPO-clip surrogate: cispo, sapo and vespo (a term of their own) and
    luspo (a ratio per sequence) gave the same loss and gradients as grpo with their reduction, silently another
    objective than TRL's for the same setting. The loss types whose term it is train; the reward route takes any."""
    datum = integration.completion_datum([1, 2], [3, 4], [-1.0, -1.0], [-0.5, -1.5])
    akl = AdaptiveKL(AdaptiveKLConfig(kl_adaptation_method="clip"), beta=0.1, loss_type=loss_type)
    for door, call in (("grpo_kl_loss", lambda: integration.grpo_kl_loss(akl, max_completion_length=8,
                                                                         token_normalizer=4.0)),
                       ("traceable_grpo_loss", lambda: integration.traceable_grpo_loss(akl)),
                       ("traced_loss_data", lambda: integration.traced_loss_data(akl, [datum], token_normalizer=4.0))):
        with pytest.raises(ValueError) as raised:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # a divisor this loss type does not read
                call()
        assert str(raised.value) == (
            f"loss_type={loss_type!r} is invalid for {door}(...): its policy-gradient term is the token-level "
            "PPO-clip surrogate, which that loss type replaces by its own; allowed is one of grpo, bnpo, dr_grpo, "
            "dapo (the loss types whose term it is).")
    for loss_type in integration.PPO_CLIP_LOSS_TYPES:
        context = {"max_completion_length": 8} if loss_type == "dr_grpo" else (
            {"token_normalizer": 4.0} if loss_type == "dapo" else {})
        integration.grpo_kl_loss(AdaptiveKL(None, beta=0.1, loss_type=loss_type), **context)


def test_a_mask_that_is_not_zeros_and_ones_is_refused_in_every_route() -> None:
    """As the own-loop doors refuse it: a Datum mask of per-token weights (0.5 on a completion token) would count that
    token whole in the reductions' lengths; the three routes name the input and how many entries before a loss is
    computed (route 2 called it `mask`, the own-loop door's name, not the Datum's field)."""
    akl = AdaptiveKL(AdaptiveKLConfig(kl_adaptation_method="clip"), beta=0.2)
    datum = integration.completion_datum([1, 2], [3, 4], [-1.0, -1.0], [-0.5, -1.5])
    datum.loss_fn_inputs["advantages"] = types.TensorData.from_torch(torch.ones(3))
    datum.loss_fn_inputs["mask"] = types.TensorData.from_torch(torch.tensor([0.0, 1.0, 0.5]))
    message = r"^loss_fn_inputs\['mask'\] must hold 0 and 1 only .*: 1 entry is neither, e\.g\. 0\.5\."
    with pytest.raises(ValueError, match=message):
        integration.grpo_kl_loss(akl)([datum], [torch.full((3,), -1.0, requires_grad=True)])
    with pytest.raises(ValueError, match=message):
        integration.traced_loss_data(akl, [datum])
    in_reward = AdaptiveKL(AdaptiveKLConfig(kl_placement="reward"), beta=0.2)
    with pytest.raises(ValueError, match=message.replace("1 entry is", "2 entries are")):  # two Datums
        integration.kl_penalized_data(in_reward, [datum] * 2, [0.0, 1.0], group_size=2)


def test_check_traced_loss_raises_where_the_kl_overflowed_on_finite_log_probs() -> None:
    """Policy -95, reference -1 on a valid token: k3 = e^94 - 94 - 1 overflows float32. grpo_kl_loss raises on its
    thread; the traced loss returned inf (a -inf gradient) with finite log-prob sums, and check_traced_loss, the guard
    before optim_step, let it through."""
    akl = AdaptiveKL(AdaptiveKLConfig(kl_adaptation_method="none"), beta=0.1, loss_type="grpo")
    datum = integration.completion_datum([1, 2], [3], [-95.0], [-1.0])
    datum.loss_fn_inputs["advantages"] = types.TensorData.from_torch(torch.tensor([0.0, 1.0]))
    with pytest.raises(FloatingPointError, match=r"non-finite KL at step 1"):
        integration.grpo_kl_loss(akl)([datum], [torch.tensor([0.0, -95.0], requires_grad=True)])
    fn, ranks = integration.traceable_grpo_loss(akl)
    (traced,) = integration.traced_loss_data(akl, [datum])
    _, metrics = fn(torch.tensor([0.0, -95.0]), *[traced.loss_fn_inputs[name].to_torch() for name in list(ranks)[1:]])
    summed = {key: float(value) for key, value in metrics.items()}
    assert math.isinf(summed["custom/adaptive_kl/adapted_kl:sum"])
    assert math.isfinite(summed["custom/adaptive_kl/policy_logprobs:sum"])
    result = types.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", loss_fn_outputs=[], metrics=summed)
    with pytest.raises(FloatingPointError, match=r"^adaptive KL: non-finite KL at step 1: "
                                                 r"custom/adaptive_kl/adapted_kl:sum=inf\. .* instead of calling "
                                                 r"optim_step\.$"):
        integration.check_traced_loss(akl, result)


@pytest.mark.parametrize(("loss_type", "kwargs", "message"), [
    ("dapo", dict(token_normalizer=torch.tensor(-5.0)), r"^token_normalizer=-5\.0 is invalid: allowed is a finite "
                                                        r"number > 0"),
    ("dapo", dict(token_normalizer=torch.tensor(0.0)), r"^token_normalizer=0\.0 is invalid: "),
    ("dapo", dict(token_normalizer=torch.tensor([2.0, 3.0])), r"^token_normalizer is invalid: a tensor of shape "
                                                              r"\(2,\); allowed is one number > 0"),
    ("dr_grpo", dict(max_completion_length=torch.tensor(-8)), r"^max_completion_length=-8 is invalid: allowed is an "
                                                              r"integer >= 1"),
    ("dr_grpo", dict(max_completion_length=torch.tensor(2.5)), r"^max_completion_length=2\.5 is invalid: "),
])
def test_a_tensor_divisor_is_checked_as_a_number_at_every_door(loss_type: str, kwargs: dict, message: str) -> None:
    """A negative tensor divisor flipped the loss's sign in both Tinker routes (and the own loop's
    max_completion_length): every door now reads a tensor divisor once and checks it as the number it holds."""
    akl = AdaptiveKL(AdaptiveKLConfig(kl_adaptation_method="none"), beta=0.1, loss_type=loss_type)
    datum = integration.completion_datum([1, 2], [3, 4], [-1.0, -1.0], [-0.5, -1.5])
    datum.loss_fn_inputs["advantages"] = types.TensorData.from_torch(torch.tensor([0.0, 1.0, 1.0]))
    logps, ref, mask = torch.tensor([[-1.0, -1.0]]), torch.tensor([[-0.5, -1.5]]), torch.ones(1, 2)
    for door in (lambda: integration.grpo_kl_loss(akl, **kwargs), lambda: integration.traced_loss_data(akl, [datum],
                                                                                                       **kwargs),
                 lambda: akl.kl_loss(logps, ref, mask, **kwargs)):
        with pytest.raises(ValueError, match=message):
            door()


def test_a_one_element_token_normalizer_is_one_number_in_the_tinker_routes() -> None:
    """A (1,)-shaped count gave a (1,) loss and half the raw_kl in grpo_kl_loss (the own loop's fix had not reached
    it): the loss and metrics equal those of the same count as a number."""
    akl = AdaptiveKL(AdaptiveKLConfig(kl_adaptation_method="none"), beta=0.1, loss_type="dapo")
    data = with_advantages([integration.completion_datum([1, 2], [3, 4], [-1.0, -1.0], [-0.5, -1.5]),
                            integration.completion_datum([1], [2, 3, 4], [-1.0, -1.0, -1.0], [-1.0, -2.0, -1.0])],
                           [1.0, -1.0])
    rows = [torch.tensor([0.0, -1.0, -1.0]), torch.tensor([-1.0, -1.0, -1.0])]
    (loss, metrics), (loss1, metrics1) = (integration.grpo_kl_loss(akl, token_normalizer=count)(data, rows)
                                          for count in (5.0, torch.tensor([5.0])))
    assert loss1.shape == () and torch.equal(loss1, loss)
    assert metrics1 == metrics


def test_traced_loss_data_trains_at_the_controllers_beta_which_it_logs() -> None:
    """`traced_loss_data(beta=...)` trained at a beta the controller never chose (a `target` run with beta_max=0.1
    took 5.0), while `adaptive_kl/current_beta` logged akl's: no other door takes a beta beside akl's. It now has no
    such argument (5.0 is a TypeError), and the traced Datums carry akl.current_beta: dynamic's 0.1 * 0.9 after a
    step whose reward passed reward_threshold."""
    akl = AdaptiveKL(AdaptiveKLConfig(kl_adaptation_method="dynamic", reward_threshold=0.5), beta=0.1)
    akl.step(mean_reward=1.0)
    datum = integration.completion_datum([1, 2], [3, 4], [-1.0, -1.0], [-0.5, -1.5])
    datum.loss_fn_inputs["advantages"] = types.TensorData.from_torch(torch.tensor([0.0, 1.0, 1.0]))
    (traced,) = integration.traced_loss_data(akl, [datum])
    assert float(traced.loss_fn_inputs["beta"].to_torch()) == pytest.approx(0.09) == akl.current_beta
    with pytest.raises(TypeError, match="beta"):
        integration.traced_loss_data(akl, [datum], beta=5.0)


def test_std_epsilon_without_scale_by_std_warns_that_it_has_no_effect() -> None:
    akl = AdaptiveKL(AdaptiveKLConfig(kl_placement="reward"), beta=0.1)
    data = [integration.completion_datum([1, 2], [3, 4], [-1.0, -1.0], [-0.5, -1.5])] * 2
    with pytest.warns(UserWarning, match=r"^std_epsilon=0\.5 has no effect: it is read only with scale_by_std=True\.$"):
        integration.kl_penalized_data(akl, data, [0.0, 1.0], group_size=2, std_epsilon=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        integration.kl_penalized_data(akl, data, [0.0, 1.0], group_size=2, scale_by_std=True, std_epsilon=0.5)


def test_each_door_names_its_own_mistakes() -> None:
    """What a Tinker loop met as another door's words, or a torch error:
    - kl_penalized_data on the default placement said "call kl_loss(...) instead of reward_penalty(...)";
    - record_step_kl with the KL in the reward, or without the loss's divisor (the KL term's, or the loss type's,
      which raw_kl reads), named kl_loss or nothing (after the optimizer step had run); a result of other Datums, padded to the same width, gave a KL of the wrong tokens; a
      loss type other than PPO-clip's, whose KL it measures as well, was refused as if it were the loss;
    - an empty batch raised "received an empty list of sequences" from torch."""
    datum = integration.completion_datum([1, 2], [3, 4], [-1.0, -1.0], [-0.5, -1.5])  # T = 3
    datum.loss_fn_inputs["advantages"] = types.TensorData.from_torch(torch.ones(3))
    longer = integration.completion_datum([1], [2, 3, 4], [-1.0] * 3, [-1.0] * 3)  # T = 3 as well
    wider = integration.completion_datum([1, 2, 3], [4, 5], [-1.0] * 2, [-1.0] * 2)  # T = 4
    loss_placed = AdaptiveKL(AdaptiveKLConfig(kl_adaptation_method="none"), beta=0.1)
    reward_placed = AdaptiveKL(AdaptiveKLConfig(kl_placement="reward"), beta=0.1)
    with pytest.raises(ValueError, match=r"^kl_placement='loss' puts beta \* KL into the loss: "
                                         r"kl_penalized_data\(\.\.\.\) needs "
                                         r"AdaptiveKLConfig\(kl_placement='reward'\); "
                                         r"for the KL in the loss, use grpo_kl_loss\(\.\.\.\) or "
                                         r"traced_loss_data\(\.\.\.\)$"):
        integration.kl_penalized_data(loss_placed, [datum, datum], [1.0, 0.0], 2)

    def result(*rows: list[float]) -> Any:
        return types.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", loss_fn_outputs=[
            {"logprobs": types.TensorData.from_torch(torch.tensor(row))} for row in rows])

    with pytest.raises(ValueError, match=r"^kl_placement='reward' puts beta \* KL into the rewards: use "
                                         r"kl_penalized_data\(\.\.\.\) .* instead of record_step_kl\(\.\.\.\)$"):
        integration.record_step_kl(reward_placed, [datum], result([0.0, -1.0, -1.0]))
    dapo = AdaptiveKL(AdaptiveKLConfig(kl_adaptation_method="none"), beta=0.1, loss_type="dapo")
    with pytest.raises(ValueError, match=r"^token_normalizer=None is invalid: .*: pass it to "
                                         r"record_step_kl\(\.\.\.\)\.$"):
        integration.record_step_kl(dapo, [datum], result([0.0, -1.0, -1.0]))
    # raw_kl is reduced as the loss type reduces: dr_grpo's divisor, missing, was named as kl_loss's (the KL term's
    # reduction, length_normalized's sequence mean, needs none, and was the only one this door asked)
    normalized = AdaptiveKL(AdaptiveKLConfig(kl_adaptation_method="length_normalized"), beta=0.1, loss_type="dr_grpo")
    with pytest.raises(ValueError, match=r"^max_completion_length=None is invalid: .*: pass it to "
                                         r"record_step_kl\(\.\.\.\)\.$"):
        integration.record_step_kl(normalized, [datum], result([0.0, -1.0, -1.0]))
    with pytest.raises(ValueError, match=r"^result\.loss_fn_outputs\[0\]\['logprobs'\] has 4 values, Datum 0 3 target "
                                         r"tokens: the result must be the forward_backward of these Datums, in their "
                                         r"order$"):
        integration.record_step_kl(loss_placed, [datum, wider], result([0.0, -1.0, -1.0, -1.0], [0.0, -1.0, -1.0]))
    grpo = integration.record_step_kl(loss_placed, [datum, longer], result([0.0, -1.0, -1.0], [-1.0, -1.0, -1.0]))
    # it measures the KL whatever loss trained on it: a sapo loop's (another policy-gradient term) is not refused
    sapo = AdaptiveKL(AdaptiveKLConfig(kl_adaptation_method="none"), beta=0.1, loss_type="sapo")
    assert integration.record_step_kl(sapo, [datum, longer], result([0.0, -1.0, -1.0], [-1.0, -1.0, -1.0])) == grpo
    empty = r"^data=\[\] is invalid: allowed is one Datum or more \(one per completion\)\.$"
    for door in (lambda: integration.kl_penalized_data(reward_placed, [], [], 2),
                 lambda: integration.traced_loss_data(loss_placed, []),
                 lambda: integration.record_step_kl(loss_placed, [], result()),
                 lambda: integration.grpo_kl_loss(loss_placed)([], [])):
        with pytest.raises(ValueError, match=empty):
            door()


def test_a_loss_built_for_an_earlier_step_says_so_once() -> None:
    """grpo_kl_loss(akl) built once, above the loop, trained every step at the first step's beta (0.2 where akl's
    had decayed to 0.1, then 0.05) without a word; the same loss called again two akl.step() after it was built, beta
    moved, warns once, naming both betas. Quiet: the loss built per step, as the page shows; one loss called twice
    within its step; a pipelined loop's loss called after its step's akl.step(), once or for each of the
    forward_backward_custom calls it submitted before (the first may run before akl.step(), the second after); a loss
    called for the first time however late (a loop two steps ahead); a constant beta, which one loss keeps."""
    def dynamic() -> AdaptiveKL:
        return AdaptiveKL(AdaptiveKLConfig(kl_adaptation_method="dynamic", reward_threshold=0.5,
                                           dynamic_beta_decay=0.5), beta=0.2)

    datum = integration.completion_datum([1, 2], [3, 4], [-1.0, -1.0], [-0.5, -1.5])
    datum.loss_fn_inputs["advantages"] = types.TensorData.from_torch(torch.ones(3))

    def call(loss: integration.GRPOKLLoss) -> None:
        loss([datum], [torch.full((3,), -1.0)])

    akl = dynamic()
    hoisted = integration.grpo_kl_loss(akl)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        call(hoisted)  # step 1, as built
        call(hoisted)  # twice within step 1
        akl.step(mean_reward=1.0)
        call(hoisted)  # step 2: as a pipelined loop's second call of step 1 would be, after its akl.step()
    akl.step(mean_reward=1.0)
    with pytest.warns(UserWarning, match=r"^grpo_kl_loss: this loss, built for step 1, is called again after 2 "
                                         r"akl\.step\(\) since: it keeps step 1's beta \(0\.2; akl's is now "
                                         r"0\.05\) and settings\. Build one per optimizer step, "
                                         r"loss_fn = grpo_kl_loss\(akl\)\.$"):
        call(hoisted)
    akl.step(mean_reward=1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        call(hoisted)  # said once
        call(integration.grpo_kl_loss(akl))  # built for this step
        late = dynamic()
        pipelined = integration.grpo_kl_loss(late)
        late.step(mean_reward=1.0)
        call(pipelined)  # its one call, after its step's akl.step()
        ahead = dynamic()
        first = integration.grpo_kl_loss(ahead)
        ahead.step(mean_reward=1.0)
        ahead.step(mean_reward=1.0)
        call(first)  # its first call, two akl.step() (beta 0.2 -> 0.05) after it was built: its step's still
        constant = AdaptiveKL(AdaptiveKLConfig(kl_adaptation_method="clip"), beta=0.2)
        kept = integration.grpo_kl_loss(constant)
        for _ in range(3):
            call(kept)
            constant.step()
