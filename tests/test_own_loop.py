"""docs/own-loop.md, held to numbers: its Python blocks run as the docs tests run them (each in a fresh namespace, in
a folder of its own), and what its GRPO loop logs equals hand formulas: the KL term in the loss, the penalised
rewards of the KL in the reward, the `dynamic` beta, and a resumed run step for step. Imports torch and the package
alone, so it runs where trl is not installed."""

from __future__ import annotations

import ast
import contextlib
import copy
import math
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

from unsloth_adaptive_kl import AdaptiveKL, AdaptiveKLConfig

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "own-loop.md"
FENCE = re.compile(r"^```(?P<lang>[\w+-]*)[^\n]*\n(?P<body>.*?)^```$", re.MULTILINE | re.DOTALL)
BETA = 0.1  # train()'s default beta on the page
DECAY, THRESHOLD, TAU = 0.9, 0.9, 0.1  # dynamic_beta_decay (default), the page's reward_threshold and kl_target


def python_blocks() -> list[str]:
    return [match["body"] for match in FENCE.finditer(PAGE.read_text()) if match["lang"] in ("python", "py")]


@contextlib.contextmanager
def recorded_calls() -> Iterator[dict[str, list[dict[str, Any]]]]:
    """Every `kl_loss` / `reward_penalty` call made inside, with its inputs, the beta it used and what it returned."""
    calls: dict[str, list[dict[str, Any]]] = {"kl_loss": [], "reward_penalty": []}
    kl_loss, reward_penalty = AdaptiveKL.kl_loss, AdaptiveKL.reward_penalty

    def inputs(akl: AdaptiveKL, logps: torch.Tensor, ref_logps: torch.Tensor, mask: torch.Tensor) -> dict[str, Any]:
        return dict(config=akl.config, logps=logps.detach().clone(), ref_logps=ref_logps.clone(), mask=mask.clone())

    def recording_kl_loss(self: AdaptiveKL, logps, ref_logps, mask, **kwargs):
        term, metrics = kl_loss(self, logps, ref_logps, mask, **kwargs)
        calls["kl_loss"].append(dict(inputs(self, logps, ref_logps, mask), beta=self.current_beta,
                                     term=term.detach().clone(), metrics=dict(metrics)))
        return term, metrics

    def recording_reward_penalty(self: AdaptiveKL, logps, ref_logps, mask, **kwargs):
        penalty, metrics = reward_penalty(self, logps, ref_logps, mask, **kwargs)
        calls["reward_penalty"].append(dict(inputs(self, logps, ref_logps, mask), beta=self.current_beta,
                                            penalty=penalty.clone(), metrics=dict(metrics)))
        return penalty, metrics

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(AdaptiveKL, "kl_loss", recording_kl_loss)
        patch.setattr(AdaptiveKL, "reward_penalty", recording_reward_penalty)
        yield calls


@dataclass
class RunPage:
    namespaces: list[dict[str, Any]]  # one per Python block, in page order
    folders: list[Path]
    calls: dict[str, list[dict[str, Any]]]

    @property
    def program(self) -> dict[str, Any]:
        return next(ns for ns in self.namespaces if "train" in ns)

    def program_calls(self, name: str) -> list[dict[str, Any]]:
        """The `kl_loss` / `reward_penalty` calls of the program's runs (the other blocks make their own)."""
        configs = (self.program["in_loss_config"], self.program["in_reward_config"])
        return [call for call in self.calls[name] if any(call["config"] is config for config in configs)]

    @property
    def program_folder(self) -> Path:
        return next(folder for ns, folder in zip(self.namespaces, self.folders) if "train" in ns)


@pytest.fixture(scope="module")
def page(tmp_path_factory: pytest.TempPathFactory) -> RunPage:
    """Each block as tests/test_docs.py runs it: `exec` in a namespace of its own, the working directory a new folder."""
    namespaces, folders = [], []
    with recorded_calls() as calls, pytest.MonkeyPatch.context() as patch:
        for index, code in enumerate(python_blocks()):
            folder = tmp_path_factory.mktemp(f"own_loop_block{index}")
            patch.chdir(folder)
            namespace: dict[str, Any] = {"__name__": "__main__"}
            exec(compile(code, f"{PAGE.name} block {index}", "exec"), namespace)
            namespaces.append(namespace)
            folders.append(folder)
    return RunPage(namespaces, folders, calls)


# ----- hand formulas ----------------------------------------------------------------------------------------------

def k3(logps: torch.Tensor, ref_logps: torch.Tensor) -> torch.Tensor:
    r = ref_logps - logps
    return torch.exp(r) - r - 1


def k1(logps: torch.Tensor, ref_logps: torch.Tensor) -> torch.Tensor:
    """The log-ratio logp - ref_logp per token: the reward placement's default estimator (SPEC 3.12)."""
    return logps.double() - ref_logps.double()


def grpo_kl(per_token: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """mean_i (sum_t m k) / max(L_i, 1)."""
    return ((per_token * mask).sum(1) / mask.sum(1).clamp(min=1)).mean()


def sigmoid_shaped(per_token: torch.Tensor) -> torch.Tensor:
    return torch.sigmoid(per_token - TAU) * per_token


def hand_advantages(rewards: torch.Tensor, group: int) -> torch.Tensor:
    groups = rewards.view(-1, group)
    return ((groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + 1e-4)).view(-1)


def hand_policy_loss(logps: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return -((advantages[:, None] * logps * mask).sum(1) / mask.sum(1).clamp(min=1)).mean()


def hand_reward(completions: torch.Tensor, mask: torch.Tensor, hash_token: int) -> torch.Tensor:
    return torch.tensor([float(any(int(tok) == hash_token for tok, m in zip(row, mrow) if m > 0))
                         for row, mrow in zip(completions, mask)])


def close(a: float, b: float, tol: float = 2e-6) -> bool:
    return abs(a - b) <= tol * max(1.0, abs(b))


def same(a: Any, b: Any) -> bool:
    return (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b)) or a == b


# ----- the page runs ----------------------------------------------------------------------------------------------

def test_the_page_runs_on_torch_alone(page: RunPage) -> None:
    """Every block ran (their own asserts included); the program is one of them; and they import nothing but torch,
    the standard library's `copy` and this package."""
    assert len(page.namespaces) >= 3
    assert {"train", "grpo_step", "in_loss", "in_reward", "resumed"} <= set(page.program)
    roots = set()
    for code in python_blocks():
        for node in ast.walk(ast.parse(code)):
            if isinstance(node, ast.Import):
                roots |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                roots.add(node.module.split(".")[0])
    assert roots <= {"copy", "torch", "unsloth_adaptive_kl"}, roots


def test_the_program_logs_every_step_of_both_placements(page: RunPage) -> None:
    """24 steps per run, each log the step's kl_loss (or reward_penalty) metrics; the KL in the reward never calls
    kl_loss, the KL in the loss never calls reward_penalty."""
    program = page.program
    in_loss, in_reward, resumed = program["in_loss"], program["in_reward"], program["resumed"]
    assert (len(in_loss), len(in_reward), len(resumed)) == (24, 24, 12)
    loss_calls, reward_calls = page.program_calls("kl_loss"), page.program_calls("reward_penalty")
    assert [call["config"].kl_placement for call in loss_calls] == ["loss"] * 36  # the run and the resumed run
    assert [call["config"].kl_placement for call in reward_calls] == ["reward"] * 24
    for log, call in zip(in_loss + resumed, loss_calls):
        assert all(same(log[key], value) for key, value in call["metrics"].items())
    for log, call in zip(in_reward, reward_calls):
        assert all(same(log[key], value) for key, value in call["metrics"].items())
        assert "adaptive_kl/reward_penalty" in log
    assert max(log["adaptive_kl/raw_kl"] for log in in_loss) > 0.3  # the policy moved: the checks below bite


# ----- the KL in the loss -----------------------------------------------------------------------------------------

def test_kl_term_is_beta_times_the_hand_formula_on_every_batch(page: RunPage) -> None:
    """`sigmoid+dynamic`, loss_type grpo: term = beta_t * mean_i(sum_t m sigmoid(k3 - 0.1) k3 / L_i); the logged
    raw_kl is the un-shaped (none/k3) mean_i(sum_t m k3 / L_i), adapted_kl the shaped one, current_beta beta_t."""
    calls = page.program_calls("kl_loss")
    assert len(calls) == 36
    for call in calls:
        k = k3(call["logps"], call["ref_logps"])
        raw, adapted = grpo_kl(k, call["mask"]).item(), grpo_kl(sigmoid_shaped(k), call["mask"]).item()
        metrics = call["metrics"]
        assert close(call["term"].item(), call["beta"] * adapted, 1e-5)
        assert close(metrics["adaptive_kl/raw_kl"], raw, 1e-5)
        assert close(metrics["adaptive_kl/adapted_kl"], adapted, 1e-5)
        assert metrics["adaptive_kl/current_beta"] == call["beta"]


def test_kl_term_gradient_is_the_hand_formulas(page: RunPage) -> None:
    """On the run's last batch: d term / d logps from kl_loss equals autograd of beta * the hand formula."""
    call = page.program_calls("kl_loss")[23]
    logps = call["logps"].clone().requires_grad_(True)
    term, _ = AdaptiveKL(call["config"], beta=call["beta"]).kl_loss(logps, call["ref_logps"], call["mask"])
    (grad,) = torch.autograd.grad(term, logps)
    hand_logps = call["logps"].clone().requires_grad_(True)
    hand = call["beta"] * grpo_kl(sigmoid_shaped(k3(hand_logps, call["ref_logps"])), call["mask"])
    (hand_grad,) = torch.autograd.grad(hand, hand_logps)
    assert grad.abs().max() > 0
    torch.testing.assert_close(grad, hand_grad, rtol=1e-5, atol=1e-9)


def test_the_none_kl_term_of_the_pages_loop_is_beta_times_the_k3_formula(page: RunPage, tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The page's train() with the default config (`none`): term = 0.1 * mean_i(sum_t m k3 / L_i) on every batch."""
    monkeypatch.chdir(tmp_path)
    with recorded_calls() as calls:
        history = page.program["train"](AdaptiveKLConfig(), steps=6)
    assert len(calls["kl_loss"]) == 6 and max(log["adaptive_kl/raw_kl"] for log in history) > 0
    for call, log in zip(calls["kl_loss"], history):
        expected = BETA * grpo_kl(k3(call["logps"], call["ref_logps"]), call["mask"]).item()
        assert close(call["term"].item(), expected, 1e-5)
        assert log["adaptive_kl/current_beta"] == BETA and log["adaptive_kl/raw_kl"] == log["adaptive_kl/adapted_kl"]


def replay_from(program: dict, checkpoint: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The next step's batch from a checkpoint of the page's program: completions and mask sampled with the saved RNG
    state, and the policy's and the reference's log-probs of them."""
    policy, reference = program["TinyLM"](), program["TinyLM"]()
    policy.load_state_dict(checkpoint["policy"])
    reference.load_state_dict(checkpoint["reference"])
    generator = torch.Generator()
    generator.set_state(checkpoint["rng"])
    completions, mask = program["sample"](policy, generator)
    with torch.no_grad():
        return (completions, mask, program["completion_logps"](policy, completions),
                program["completion_logps"](reference, completions))


def test_a_step_of_the_kl_in_the_loss_replayed_by_hand(page: RunPage) -> None:
    """From the page's checkpoint (after step 12): step 13 sampled with the saved RNG state, rewards, advantages,
    policy loss and KL term computed by hand give the loss the run logged for step 13."""
    program = page.program
    checkpoint = torch.load(page.program_folder / "checkpoint.pt")
    assert checkpoint["step"] == 12 and checkpoint["adaptive_kl"]["completed_steps"] == 12
    completions, mask, logps, ref_logps = replay_from(program, checkpoint)
    rewards = hand_reward(completions, mask, program["HASH"])
    beta = checkpoint["adaptive_kl"]["value"]
    loss = hand_policy_loss(logps, hand_advantages(rewards, program["G"]), mask) + \
        beta * grpo_kl(sigmoid_shaped(k3(logps, ref_logps)), mask)
    log = program["in_loss"][12]
    assert log["adaptive_kl/current_beta"] == beta and log["reward"] == rewards.mean().item()
    assert close(log["loss"], loss.item(), 1e-5)


# ----- the KL in the reward ---------------------------------------------------------------------------------------

def test_penalty_is_beta_times_the_summed_k1_of_each_completion(page: RunPage) -> None:
    """`sequence_sum` with the reward placement's default estimator k1: penalty_i = beta_t * sum_t m (logp - ref);
    the logged reward_penalty is its mean; the logged penalised reward is the un-penalised reward minus it."""
    program = page.program
    assert page.program["in_reward_config"].kl_estimator is None  # the page leaves it unset
    for call, log in zip(page.program_calls("reward_penalty"), program["in_reward"]):
        kl_i = (k1(call["logps"], call["ref_logps"]) * call["mask"]).sum(1).float()
        torch.testing.assert_close(call["penalty"], call["beta"] * kl_i, rtol=1e-5, atol=1e-6)
        assert close(log["adaptive_kl/reward_penalty"], call["beta"] * kl_i.mean().item(), 1e-5)
        assert close(log["penalised_reward"], log["reward"] - call["beta"] * kl_i.mean().item(), 1e-5)
        assert log["adaptive_kl/current_beta"] == call["beta"]
    assert max(log["adaptive_kl/reward_penalty"] for log in program["in_reward"]) > 0.01


def test_a_step_of_the_kl_in_the_reward_replayed_by_hand(page: RunPage, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The page's train() on the reward placement, checkpointed after step 6 (its steps are the page's run's);
    step 7 by hand: penalised rewards r_i - beta_t * sum_t m k1, their advantages, the policy loss without a KL
    term, against what the run logged and the penalty vector it computed."""
    program = page.program
    monkeypatch.chdir(tmp_path)
    with recorded_calls() as calls:
        history = program["train"](program["in_reward_config"], steps=7, save_at=6)
    assert [log["loss"] for log in history] == [log["loss"] for log in program["in_reward"][:7]]
    checkpoint = torch.load(tmp_path / "checkpoint.pt")
    completions, mask, logps, ref_logps = replay_from(program, checkpoint)
    rewards = hand_reward(completions, mask, program["HASH"])
    beta = checkpoint["adaptive_kl"]["value"]
    penalised = rewards - beta * (k1(logps, ref_logps) * mask).sum(1).float()
    loss = hand_policy_loss(logps, hand_advantages(penalised, program["G"]), mask)
    log = history[6]
    torch.testing.assert_close(rewards - calls["reward_penalty"][6]["penalty"], penalised, rtol=1e-5, atol=1e-6)
    assert (penalised != rewards).any()
    assert close(log["penalised_reward"], penalised.mean().item(), 1e-5) and log["reward"] == rewards.mean().item()
    assert close(log["loss"], loss.item(), 1e-5)


def test_kl_loss_refuses_the_reward_placement(page: RunPage) -> None:
    akl = AdaptiveKL(page.program["in_reward_config"], beta=BETA)
    logps = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="reward_penalty"):
        akl.kl_loss(logps, logps, torch.ones(2, 3))


# ----- dynamic beta, resume ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("run", ["in_loss", "in_reward"])
def test_dynamic_beta_decays_after_each_step_whose_mean_reward_exceeds_the_threshold(page: RunPage, run: str) -> None:
    """beta_{t+1} = 0.9 beta_t after a step with mean (un-penalised) reward > 0.9, else beta_t; both happen."""
    history = page.program[run]
    betas = [log["adaptive_kl/current_beta"] for log in history]
    assert betas[0] == BETA
    decays = 0
    for log, beta, next_beta in zip(history, betas, betas[1:]):
        expected = beta * DECAY if log["reward"] > THRESHOLD else beta
        assert next_beta == expected, (log["reward"], beta, next_beta)
        decays += log["reward"] > THRESHOLD
    assert 0 < decays < len(history) - 1 and betas[-1] < BETA


def test_step_with_no_mean_reward_does_not_decay() -> None:
    """Further optimizer steps on the same generation batch pass mean_reward=None: at most one decay per batch."""
    akl = AdaptiveKL(AdaptiveKLConfig(kl_adaptation_method="dynamic", reward_threshold=THRESHOLD), beta=BETA)
    assert akl.step(mean_reward=1.0) == BETA * DECAY
    assert akl.step(mean_reward=None) == BETA * DECAY
    assert akl.step(mean_reward=0.5) == BETA * DECAY
    assert akl.step(mean_reward=1.0) == BETA * DECAY * DECAY


def test_resumed_run_equals_the_uninterrupted_run_exactly(page: RunPage) -> None:
    """Steps 13-24 of the run resumed from the step-12 checkpoint log the uninterrupted run's values bit for bit:
    loss, reward, beta and every metric."""
    program = page.program
    resumed, uninterrupted = program["resumed"], program["in_loss"][12:]
    assert len({log["loss"] for log in resumed}) == len(resumed)  # the steps differ from one another
    assert [log["adaptive_kl/current_beta"] for log in resumed] == [log["adaptive_kl/current_beta"]
                                                                    for log in uninterrupted]
    assert [log["loss"] for log in resumed] == [log["loss"] for log in uninterrupted]
    for log, expected in zip(resumed, uninterrupted):
        assert log.keys() == expected.keys() and all(same(log[key], expected[key]) for key in log)


def test_resume_without_the_adaptive_kl_state_restarts_beta(page: RunPage, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """What the checkpoint's akl.state_dict() carries: resumed with a fresh AdaptiveKL's state instead, step 13
    runs with beta 0.1 again, not the decayed beta_13."""
    program = page.program
    checkpoint = torch.load(page.program_folder / "checkpoint.pt")
    checkpoint["adaptive_kl"] = AdaptiveKL(program["in_loss_config"], beta=BETA).state_dict()
    torch.save(checkpoint, tmp_path / "fresh.pt")
    monkeypatch.chdir(tmp_path)
    history = program["train"](copy.deepcopy(program["in_loss_config"]), steps=13, resume="fresh.pt")
    assert program["in_loss"][12]["adaptive_kl/current_beta"] < BETA
    assert history[0]["adaptive_kl/current_beta"] == BETA
    assert history[0]["loss"] != program["in_loss"][12]["loss"]


# ----- several processes, other loss types -------------------------------------------------------------------------

def test_gathered_penalties_come_in_rank_order(page: RunPage) -> None:
    """Two processes simulated in one: with `gather`, reward_penalty returns both processes' penalties in rank
    order (each process takes its own slice), and the metrics average over both."""
    config = AdaptiveKLConfig(kl_placement="reward", kl_reduction="sequence_sum")
    torch.manual_seed(0)
    batches = [(-torch.rand(3, 5), -torch.rand(3, 5), torch.ones(3, 5)) for _ in range(2)]
    sent: list[list[torch.Tensor]] = [[], []]
    alone = []
    for rank, (logps, ref_logps, mask) in enumerate(batches):  # each process alone: its penalties, what it sends
        alone.append(AdaptiveKL(config, beta=BETA).reward_penalty(
            logps, ref_logps, mask, gather=lambda tensor, rank=rank: sent[rank].append(tensor) or tensor)[0])
    rank0, from_rank1 = AdaptiveKL(config, beta=BETA), iter(sent[1])  # an all-gather: each call meets rank 1's
    gathered = rank0.reward_penalty(*batches[0], gather=lambda tensor: torch.cat([tensor, next(from_rank1)]))[0]
    assert gathered.shape == (6,)
    torch.testing.assert_close(gathered.view(2, -1)[0], alone[0])
    torch.testing.assert_close(gathered.view(2, -1)[1], alone[1])
    assert close(rank0.last_metrics["adaptive_kl/reward_penalty"], torch.cat(alone).mean().item())
    gather, own_slice = next((ns["gather"], ns["own_slice"]) for ns in page.namespaces if "own_slice" in ns)
    x = torch.tensor([1.0, 2.0])
    assert torch.equal(gather(x), x) and torch.equal(own_slice(x), x)  # one process: the tensor itself


def test_a_completion_without_tokens_gets_its_groups_mean_penalty_with_group_size() -> None:
    """Two groups of 3; completion 1 is masked out. With group_size=3 its penalty is the mean of completions 0 and 2's
    (as the trainers' scoring gives it), the others unchanged; without group_size it is 0 and the first such batch
    warns, once. With gather, group_size counts every process's completions."""
    config = AdaptiveKLConfig(kl_placement="reward", kl_reduction="sequence_sum")
    logps = torch.tensor([[-1.0, -2.0], [-0.5, -0.5], [-1.5, -0.2], [-0.3, -0.9], [-1.1, -0.4], [-0.8, -0.6]])
    ref = torch.tensor([[-1.5, -1.0], [-0.9, -0.1], [-1.0, -0.7], [-0.6, -0.6], [-0.8, -0.8], [-0.5, -1.0]])
    mask = torch.tensor([[1.0, 1.0], [0.0, 0.0], [1.0, 0.0], [1.0, 1.0], [1.0, 1.0], [1.0, 1.0]])
    by_hand = BETA * ((logps - ref) * mask).sum(-1)  # k1 (the reward's default) summed over valid tokens, times beta
    by_hand[1] = (by_hand[0] + by_hand[2]) / 2
    grouped, _ = AdaptiveKL(config, beta=BETA).reward_penalty(logps, ref, mask, group_size=3)
    torch.testing.assert_close(grouped, by_hand)
    alone = AdaptiveKL(config, beta=BETA)
    with pytest.warns(UserWarning, match=r"completion\(s\) \[1\] have no valid token.*Pass group_size="):
        penalty, _ = alone.reward_penalty(logps, ref, mask)
    assert penalty[1].item() == 0.0 and torch.equal(penalty[[0, 2, 3, 4, 5]], grouped[[0, 2, 3, 4, 5]])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        alone.reward_penalty(logps, ref, mask)  # said once
    twice = AdaptiveKL(config, beta=BETA).reward_penalty(logps, ref, mask, group_size=4,
                                                         gather=lambda tensor: torch.cat([tensor, tensor]))[0]
    torch.testing.assert_close(twice[1], (by_hand[0] + by_hand[2] + by_hand[3]) / 3)  # the group of 0..3
    # a group none of whose completions has a token: 0 each (no mean to carry), not 0 / 0
    empty_group = mask.clone()
    empty_group[:3] = 0.0
    expected = by_hand.clone()
    expected[:3] = 0.0
    torch.testing.assert_close(AdaptiveKL(config, beta=BETA).reward_penalty(logps, ref, empty_group, group_size=3)[0],
                               expected, rtol=0, atol=0)
    for bad in (0, 4, 2.0, True, "3"):
        with pytest.raises(ValueError, match=rf"^group_size={bad!r} is invalid: allowed is an integer >= 1 that "
                                             r"divides the 6 completions"):
            AdaptiveKL(config, beta=BETA).reward_penalty(logps, ref, mask, group_size=bad)


def test_other_loss_types_need_their_normaliser(page: RunPage) -> None:
    """The loss-type block's terms are what its table says; without its argument dr_grpo / dapo raise."""
    ns = next(ns for ns in page.namespaces if "dr_grpo" in ns)
    assert ns["dr_grpo"].item() != ns["dapo"].item()
    assert close(ns["dapo"].item(), ns["bnpo"].item())  # one micro-batch on one process: N = mask.sum()
    logps, ref_logps, mask = ns["logps"], ns["ref_logps"], ns["mask"]
    for loss_type, argument in [("dr_grpo", "max_completion_length"), ("dapo", "token_normalizer")]:
        with pytest.raises(ValueError, match=argument):
            AdaptiveKL(None, 0.04, loss_type=loss_type).kl_loss(logps, ref_logps, mask)
