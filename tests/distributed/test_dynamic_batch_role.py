"""``train.dynamic_batch`` in the trained roles' loop (``TrainableRole.train_epochs``, ``forward_batches``), on a
stand-in for the DeepSpeed engine that accumulates as DeepSpeed does (each loss / accumulation_steps; a step at the
boundary): token-budget micro-batches give each optimizer step the gradient of the fixed micro-batches, once per
window."""

import random

import pytest
import torch
from torch import nn
from torch.testing import assert_close

from rlhf_core.algos.batching import make_sequences
from rlhf_core.algos.experience import SequenceBatch
from rlhf_core.algos.ppo import aggregate_loss
from rlhf_core.config import OptimConfig, PPOAlgoConfig, StrategyConfig, TrainConfig
from rlhf_core.distributed.role_base import RoleContext, TrainableRole, WindowNorm


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 50, dim: int = 4):
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.head = nn.Embedding(vocab, dim), nn.Linear(dim, vocab)

    def token_loss(self, input_ids: torch.Tensor) -> torch.Tensor:
        logp = torch.log_softmax(self.head(self.embed(input_ids[:, :-1])), dim=-1)
        return -logp.gather(-1, input_ids[:, 1:, None]).squeeze(-1)


class FakeEngine:
    """DeepSpeed's accumulation: backward of loss / accumulation_steps; ``step`` steps (here: records and clears the
    gradients) at the boundary, counted in fixed windows unless set by hand."""

    def __init__(self, module: nn.Module, gas: int):
        self.module, self.gas, self.micro_steps, self.boundary = module, gas, 0, None
        self.step_grads: list[list[torch.Tensor]] = []

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        self.boundary = is_boundary

    def backward(self, loss: torch.Tensor) -> None:
        (loss / self.gas).backward()

    def step(self) -> None:
        at_boundary = (self.micro_steps + 1) % self.gas == 0 if self.boundary is None else self.boundary
        self.micro_steps += 1
        if at_boundary:
            self.step_grads.append([p.grad.clone() for p in self.module.parameters()])
            self.module.zero_grad()

    def eval(self) -> None: ...

    def train(self) -> None: ...


class OneRank:
    rank, world_size = 0, 1

    def __init__(self, gas: int):
        self.accumulation_steps = gas

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def all_reduce_max(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def all_reduce_mean(self, value: float) -> float:
        return value


def _role(tmp_path, budget: int | None, micro: int = 2, gas: int = 3) -> TrainableRole:
    ctx = RoleContext(
        stage="dynamic_test",
        role="actor",
        model_path="builtin:tiny",
        tokenizer_path=None,
        init_seed=3,
        strategy=StrategyConfig(num_workers=1, zero_stage=2, precision="fp32"),
        optim=OptimConfig(),
        batch=TrainConfig(train_batch_size=micro * gas, micro_train_batch_size=micro),
        micro_rollout_batch_size=micro,
        total_optimizer_steps=4,
        algo=PPOAlgoConfig(ppo_epochs=1),
        seed=7,
        run_uri=str(tmp_path / "run"),
        storage_options={},
        work_dir=str(tmp_path / "work"),
        max_tokens_per_micro_batch=budget,
    )
    role = TrainableRole(ctx)
    role.strategy, role.engine = OneRank(gas), FakeEngine(TinyLM(), gas)  # type: ignore[assignment]
    return role


def _batch(n: int = 12) -> SequenceBatch:
    rng = random.Random(0)
    prompts = [[rng.randint(1, 49) for _ in range(rng.randint(1, 4))] for _ in range(n)]
    responses = [[rng.randint(1, 49) for _ in range(rng.randint(1, 12))] for _ in range(n)]
    return make_sequences(prompts, responses, 0)


def test_dynamic_micro_batches_give_each_optimizer_step_the_fixed_gradient(tmp_path):
    batch, budget, seen = _batch(), 20, []

    def loss_fn(engine, micro: SequenceBatch, norm: WindowNorm):
        seen.append(int(micro.attention_mask.sum()))
        loss_t = engine.module.token_loss(micro.input_ids)
        loss = aggregate_loss(loss_t, micro.action_mask, "token_mean", num_tokens=norm.tokens)
        aux = loss_t.mean(1).mean()  # a per-micro-batch mean, like the MoE load-balancing loss
        return loss + 0.5 * norm.aux_scale * aux, {}

    fixed = _role(tmp_path, None)
    fixed_stats = fixed.train_epochs(batch, 0, loss_fn)
    assert fixed.engine.micro_steps == 6 and len(fixed.engine.step_grads) == 2  # 2 windows of 3 micro-batches
    seen.clear()
    dynamic = _role(tmp_path, budget)
    dynamic_stats = dynamic.train_epochs(batch, 0, loss_fn)
    # one optimizer step per window, from other micro-batches than the fixed 3 x 2 rows, each within the budget
    assert len(dynamic.engine.step_grads) == 2 and dynamic.engine.micro_steps != 6
    assert all(tokens <= budget for tokens in seen), seen
    for got, want in zip(dynamic.engine.step_grads, fixed.engine.step_grads, strict=True):
        for g, w in zip(got, want, strict=True):
            assert_close(g, w, atol=1e-5, rtol=1e-5)
    assert dynamic_stats["loss"] == pytest.approx(fixed_stats["loss"], rel=1e-5)


def test_dynamic_forwards_return_the_rows_in_their_order(tmp_path):
    batch = _batch(9)

    def fn(engine, micro: SequenceBatch) -> torch.Tensor:
        return micro.input_ids[:, :3].float() + micro.attention_mask.sum(1, keepdim=True)

    fixed = _role(tmp_path, None).forward_batches(batch, fn)
    dynamic = _role(tmp_path, 15).forward_batches(batch, fn)
    assert_close(dynamic, fixed)
