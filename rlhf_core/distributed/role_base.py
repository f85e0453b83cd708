"""What the trained PPO roles (actor, critic) share: DeepSpeed set-up, batched forwards, the PPO-epoch loop,
checkpoint shards and export. Each role file adds its model and its loss. A role that never trains (the critic
warm-up's actor, ``RoleContext.trains``) gets an engine without optimizer (``DeepSpeedStrategy.prepare_frozen``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn

from rlhf_core.algos.dynamic_batch import agreed_micro_batch_counts, karmarkar_karp, micro_batch_weights
from rlhf_core.algos.experience import SequenceBatch
from rlhf_core.algos.losses import window_loss_scale
from rlhf_core.config import LoraConfig, OptimConfig, PPOAlgoConfig, StrategyConfig, TrainConfig
from rlhf_core.distributed import device
from rlhf_core.distributed.checkpoints import adapter_record, export_hf, load_engine_shards, save_engine_shards
from rlhf_core.distributed.node_files import ModelSource, local_model_path
from rlhf_core.distributed.strategy import DeepSpeedStrategy, offload_training_states
from rlhf_core.models.builders import attn_implementation, load_tokenizer
from rlhf_core.storage import ObjectStore

B = TypeVar("B", bound=SequenceBatch)


@dataclass
class RoleContext:
    """Plain data a role needs on its ranks, resolved by the PPO driver."""

    stage: str
    role: str
    model_path: ModelSource  # a StageModel is fetched to a copy on the rank's node (setup)
    tokenizer_path: str | None
    init_seed: int  # <stage>.<role>.init_seed: builtin: models and fresh value heads
    strategy: StrategyConfig
    optim: OptimConfig
    batch: TrainConfig  # train_batch_size / micro_train_batch_size of the role's optimizer steps
    micro_rollout_batch_size: int
    total_optimizer_steps: int
    algo: PPOAlgoConfig
    seed: int
    run_uri: str
    storage_options: dict
    work_dir: str
    max_new_tokens: int = 1024  # rollout.max_new_tokens: the constant length of algo.loss_agg=seq_sum_norm
    temperature: float = 1.0  # rollout temperature: log-probs are those of the distribution the engines sampled
    trust_remote_code: bool = False  # <stage>.<role>.trust_remote_code
    reward_stats: tuple[float, float] | None = None  # (mean, std) of the reward model when normalize_reward is on
    trains: bool = True  # False: forwards only (the critic warm-up's actor), an engine without optimizer
    lora: LoraConfig | None = None  # <stage>.<role>.model.lora: LoRA adapters (rank 0: none)
    aux_loss_coef: float = 0.0  # <stage>.<role>.model.aux_loss_coef: the MoE load-balancing loss's weight
    model_source: ModelSource | None = None  # model_path before setup fetched it: an adapter export's base
    max_tokens_per_micro_batch: int | None = None  # train.dynamic_batch on: the token budget of a micro-batch


@dataclass(frozen=True)
class WindowNorm:
    """The denominators of one micro-batch's loss: the action tokens (``tokens``) and the sequences with at least one
    action token (``sequences``) of its whole accumulation window over all ranks, each divided by
    accumulation_steps x world_size (``losses.window_loss_scale``), so that a token (or a sequence) weighs the same
    wherever it falls in the window."""

    tokens: float
    sequences: float
    aux_scale: float = 1.0  # the MoE aux loss's factor: gas x the micro-batch's share of its rank's window rows


def logprob_temperature(temperature: float) -> float:
    """The temperature the log-probs divide by: greedy sampling (T <= 0) has no distribution, so T = 1 there."""
    return temperature if temperature > 0 else 1.0


class TrainableRole:
    """One rank of a DeepSpeed-trained role. Subclasses implement ``build_model``."""

    def __init__(self, ctx: RoleContext):
        self.ctx = ctx

    def build_model(self, tokenizer: Any, dtype: torch.dtype, attn: str) -> nn.Module:
        raise NotImplementedError

    @property
    def model_dir(self) -> str:
        """The model's directory on this node: ``ctx.model_path`` once resolved (``setup`` fetches a StageModel)."""
        path = self.ctx.model_path
        assert isinstance(path, str), f"{self.ctx.role}: the model source is not resolved to this node's copy yet"
        return path

    def setup(self) -> int:
        ctx = self.ctx = replace(
            self.ctx, model_source=self.ctx.model_path, model_path=local_model_path(self.ctx.model_path)
        )
        self.strategy = DeepSpeedStrategy(ctx.strategy, ctx.optim, ctx.batch)
        self.strategy.init_distributed()
        torch.manual_seed(ctx.seed)
        self.store = ObjectStore(ctx.run_uri, ctx.storage_options)
        self.work = Path(ctx.work_dir) / f"{ctx.role}{self.strategy.rank}"
        self.tokenizer = load_tokenizer(self.model_dir, ctx.tokenizer_path, trust_remote_code=ctx.trust_remote_code)
        attn = attn_implementation(ctx.strategy.attn_implementation, self.strategy.device)
        with self.strategy.model_init():  # ZeRO-3: each rank materialises only its partition
            model = self.build_model(self.tokenizer, self.strategy.dtype, attn)
        if ctx.trains:
            self.engine = self.strategy.prepare(model, max(1, ctx.total_optimizer_steps))
        else:
            self.engine = self.strategy.prepare_frozen(model)
        return self.strategy.rank

    @property
    def device(self) -> torch.device:
        return next(self.engine.module.parameters()).device

    @torch.no_grad()
    def forward_batches(self, batch: SequenceBatch, fn: Callable[[Any, SequenceBatch], torch.Tensor]) -> torch.Tensor:
        """``fn(engine, micro_batch)`` over micro-batches of the rollout batch size, concatenated (eval mode). With
        ``train.dynamic_batch``: over token-budget micro-batches (``algos.dynamic_batch``), rows back in their order;
        ZeRO-3 forwards gather the weights on every rank, so there the ranks agree on the count (all-reduce MAX)."""
        self.engine.eval()
        budget = self.ctx.max_tokens_per_micro_batch
        if budget is None:
            micros, order = batch.split(self.ctx.micro_rollout_batch_size), None
        else:
            lengths = batch.attention_mask.sum(1).tolist()
            reduce_max = self.strategy.all_reduce_max if self.ctx.strategy.zero_stage == 3 else None
            (k,) = agreed_micro_batch_counts([lengths], budget, reduce_max)
            parts = karmarkar_karp(lengths, k)
            assert all(parts), f"{batch.size} rows on this rank cannot fill the {k} micro-batches other ranks need"
            order = torch.tensor([i for part in parts for i in part])
            micros = [batch.select_rows(torch.tensor(part)) for part in parts]
        outputs = torch.cat([fn(self.engine, device.to_device(m, self.device)).float().cpu() for m in micros])
        self.engine.train()
        if order is None:
            return outputs
        return torch.empty_like(outputs).index_copy_(0, order, outputs)

    def train_epochs(
        self, batch: B, step: int, loss_fn: Callable[[Any, B, WindowNorm], tuple[torch.Tensor, dict]]
    ) -> dict[str, float]:
        """PPO epochs over this rank's share of the rollout: shuffled micro-batches; DeepSpeed steps the optimizer
        every ``accumulation_steps`` micro-batches of a rank (a window: that many micro-batches on every rank).

        ``loss_fn(engine, micro, norm)`` returns sum_t(loss_t * mask_t) / norm.tokens, with
        norm.tokens = N_window / (accumulation_steps x world_size) and N_window the action tokens of the whole window
        over all ranks (all-reduced once per epoch): DeepSpeed divides by the accumulation steps and averages over
        ranks, so every action token of a window weighs 1 / N_window, whatever the length of its response and
        however the window splits into micro-batches (OpenRLHF 0.11's token mean over the global accumulation
        window). ``norm.sequences`` does the same for sequence-mean losses (``algo.loss_agg``). Returns ``loss`` =
        the mean over windows of each window's loss, and the other stats averaged over micro-batches and ranks.

        ``train.dynamic_batch``: a window (micro_train_batch_size x accumulation_steps rows of a rank) splits into
        token-budget micro-batches instead (``_dynamic_windows``), as many on every rank; the losses above already
        weigh each token by its window's count, so only the MoE aux loss (a per-micro-batch mean) needs
        ``norm.aux_scale``, and the optimizer steps at the window's last micro-batch (the accumulation boundary is
        set by hand, since DeepSpeed counts micro-batches in fixed windows)."""
        s = self.strategy
        n, micro_size, gas = batch.size, self.ctx.batch.micro_train_batch_size, s.accumulation_steps
        scale = window_loss_scale(gas, s.world_size)
        dynamic = self.ctx.max_tokens_per_micro_batch is not None
        sums: dict[str, float] = {}
        count, loss_sum, windows = 0, 0.0, 0
        for epoch in range(self.ctx.algo.ppo_epochs):
            gen = torch.Generator().manual_seed(self.ctx.seed * 7919 + step * 101 + epoch * 13 + s.rank)
            shuffled = batch.select_rows(torch.randperm(n, generator=gen))
            micros = shuffled.split(micro_size)
            if len(micros) % gas:
                raise ValueError(
                    f"{len(micros)} micro-batches of {micro_size} rows on this rank do not fill whole accumulation "
                    f"windows of {gas}: an optimizer step would straddle two PPO epochs"
                )
            if dynamic:
                plan = self._dynamic_windows(shuffled.split(micro_size * gas))
            else:
                plan = [[(m, 1.0) for m in micros[w : w + gas]] for w in range(0, len(micros), gas)]
            # per window: [action tokens, sequences with an action token], summed over the ranks in one collective
            counts = torch.tensor(
                [
                    [
                        sum(int(m.action_mask.sum()) for m, _ in window),
                        sum(int((m.action_mask.sum(1) > 0).sum()) for m, _ in window),
                    ]
                    for window in plan
                ],
                dtype=torch.float64,
            )
            s.all_reduce_sum(counts)
            windows += len(counts)
            for w, window in enumerate(plan):
                tokens, sequences = (max(float(c), 1.0) / scale for c in counts[w])
                for j, (micro, aux_scale) in enumerate(window):
                    norm = WindowNorm(tokens=tokens, sequences=sequences, aux_scale=aux_scale)
                    if dynamic:
                        self.engine.set_gradient_accumulation_boundary(j == len(window) - 1)
                    loss, stats = loss_fn(self.engine, device.to_device(micro, self.device), norm)
                    self.engine.backward(loss)
                    self.engine.step()
                    loss_sum += loss.item() / scale  # this micro-batch's share of its window's token mean
                    for k, v in stats.items():
                        sums[k] = sums.get(k, 0.0) + v
                    count += 1
        totals = torch.tensor([loss_sum], dtype=torch.float64)
        s.all_reduce_sum(totals)
        out = {"loss": totals.item() / max(1, windows)}
        out.update({k: s.all_reduce_mean(v / count) for k, v in sums.items()})
        return out

    def _dynamic_windows(self, windows: list[B]) -> list[list[tuple[B, float]]]:
        """Each window's token-budget micro-batches (``algos.dynamic_batch``: first-fit count, MAX over the ranks,
        Karmarkar-Karp on the rows' token counts) with their aux-loss factors: DeepSpeed divides every loss by its
        fixed accumulation_steps, so accumulation_steps x n_micro / n_window makes the aux loss the window's
        sample mean whatever the number of micro-batches."""
        gas, budget = self.strategy.accumulation_steps, self.ctx.max_tokens_per_micro_batch
        assert budget is not None
        lengths = [w.attention_mask.sum(1).tolist() for w in windows]
        ks = agreed_micro_batch_counts(lengths, budget, self.strategy.all_reduce_max)
        plan = []
        for window, lens, k in zip(windows, lengths, ks, strict=True):
            parts = karmarkar_karp(lens, k)
            assert all(parts), f"{window.size} rows on this rank cannot fill the {k} micro-batches other ranks need"
            weights = micro_batch_weights(parts)
            plan.append([(window.select_rows(torch.tensor(p)), gas * w) for p, w in zip(parts, weights, strict=True)])
        return plan

    # -- checkpoints and export ---------------------------------------------------------------------------------------
    def save_shards(self, rel: str) -> dict[str, dict]:
        """Collective: this role's DeepSpeed shards under ``rel/<role>/``; returns all ranks' file entries."""
        return save_engine_shards(
            self.strategy, self.engine, self.store, rel, self.work / "ckpt", client_state={}, sub=self.ctx.role
        )

    def load_shards(self, rel: str) -> None:
        load_engine_shards(self.strategy, self.engine, self.store, rel, self.work / "resume", sub=self.ctx.role)

    def export(self, rel: str, config_hash: str, metrics: dict, extra: dict) -> None:
        """Collective: gather the weights and (rank 0) commit a Hugging Face directory at ``rel``."""
        weights = self.strategy.full_state_dict(self.engine)
        if weights is not None:  # rank 0
            adapter = adapter_record(self.ctx)
            local = export_hf(self.engine.module, weights, self.tokenizer, self.work / "export", adapter=adapter)
            self.store.put_artifact(
                str(local),
                rel,
                stage=self.ctx.stage,
                config_hash=config_hash,
                metrics=metrics,
                extra=extra,
                clear=False,
            )
        self.strategy.barrier()

    def trainable_state(self) -> dict[str, torch.Tensor] | None:
        """Full weights on rank 0 (collective), for tests that compare before and after."""
        return self.strategy.full_state_dict(self.engine)

    def lr(self) -> float:
        """The optimizer's current learning rate (after the last step's scheduler update)."""
        return float(self.engine.get_lr()[0])

    # -- offload while the rollout engines generate (ppo.placement.offload_states_during_rollout) -----------------
    def offload_states(self) -> bool:
        """Move what only training needs (optimizer states, fp32 master weights, gradient buffers) to host memory,
        so that colocated rollout engines have the GPU memory; the weights the experience forwards use stay
        (``strategy.offload_training_states``; ZeRO-1/2/3 only: ``placement.check_fits`` refuses ZeRO-0). On CPU the
        states already live in host memory: nothing moves, returns False."""
        if self.device.type != "cuda":
            return False
        offload_training_states(self.engine, pin_memory=True)
        return True

    def reload_states(self) -> bool:
        """Undo ``offload_states`` before training (a no-op, False, on CPU)."""
        if self.device.type != "cuda":
            return False
        self.engine.reload_states()
        return True
