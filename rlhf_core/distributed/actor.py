"""The actor role: the policy, trained with DeepSpeed; old log-probs, the clipped PPO update, and the weight push
to the rollout engines (in buckets; ZeRO-3 partitions gathered one bucket at a time)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from rlhf_core.algos.advantages import whitens
from rlhf_core.algos.experience import Experience, SequenceBatch
from rlhf_core.algos.is_correction import is_correction_setting, is_correction_weights
from rlhf_core.algos.logprob_gap import rollout_logprob_gap
from rlhf_core.algos.losses import masked_mean
from rlhf_core.algos.moe import aux_list, with_aux_loss
from rlhf_core.algos.ppo import (
    aggregate_loss,
    approx_kl,
    distributed_masked_whiten,
    kl_loss_tokens,
    policy_loss_tokens,
)
from rlhf_core.distributed.role_base import TrainableRole, WindowNorm, logprob_temperature
from rlhf_core.distributed.weight_sync.buckets import dtype_name
from rlhf_core.models.builders import build_causal_lm
from rlhf_core.models.checkpoint_names import checkpoint_pieces
from rlhf_core.models.forward import causal_lm_logprobs
from rlhf_core.models.lora import MergedTensor, merged_tensors

if TYPE_CHECKING:
    from rlhf_core.distributed.rollout.group import EngineHandles
    from rlhf_core.distributed.weight_sync.sender import WeightSender


def _logprobs(
    model: Any,
    batch: SequenceBatch,
    temperature: float,
    pack: bool,
    with_entropy: bool = False,
    aux_loss: list | None = None,
) -> Any:
    """(N, T-1) log-probs of the action tokens (0 elsewhere): packed, chosen tokens only (``models.forward``);
    ``with_entropy``: (log-probs, entropies), both (N, T-1); ``aux_loss``: collects an MoE model's load-balancing
    loss."""
    return causal_lm_logprobs(
        model,
        batch.input_ids,
        batch.attention_mask,
        batch.action_mask,
        temperature=logprob_temperature(temperature),
        pack=pack,
        with_entropy=with_entropy,
        aux_loss=aux_loss,
    )


@torch.no_grad()
def _measure_old(
    old: torch.Tensor, micro: Experience, kl_estimator: Any, correction: Any, sums: dict[str, float]
) -> torch.Tensor | None:
    """What the controller measures from the old log-probs, measured on the training forward's (``old`` (N, T-1),
    detached) when the experience phase skipped its forward: into ``sums`` the engine gap's max, the KL to the
    reference summed per sequence and as token means, the IS correction's clipped and masked token counts. Returns
    the IS weights (N, T-1), or None without a correction."""
    mask, engine = micro.action_mask, micro.rollout_logprobs
    weights = None
    if engine is not None:
        sums["gap"] = max(sums["gap"], rollout_logprob_gap(replace(micro, old_logprobs=old), engine))
        if correction is not None:
            weights, is_stats = is_correction_weights(old, engine, mask, *correction)
            tokens = float(mask.sum())
            sums["is_clipped"] += is_stats["is_clipped_frac"] * tokens
            sums["is_masked"] += is_stats["is_masked_frac"] * tokens
            sums["tokens"] += tokens
    if micro.ref_logprobs is not None:
        kl = approx_kl(old, micro.ref_logprobs, mask, kl_estimator)
        rows = mask.sum(1) > 0
        sums["kl"] += float((kl * mask).sum())
        sums["kl_token_mean"] += float(masked_mean(kl, mask, dim=1)[rows].sum())
        sums["rows"] += float(rows.sum())
    return weights


class PolicyActor(TrainableRole):
    """One rank of the actor group. Its log-probs (old ones and in the loss) are those of the rollout distribution:
    logits divided by the rollout temperature."""

    sender: WeightSender | None = None  # set by connect_engines (None: no collective, or a rank that does not send)
    # vLLM engines (a collective): weights in checkpoint names. The same on every rank, senders or not, so that all
    # ranks plan the same buckets and ZeRO-3 gathers the same parameters.
    to_vllm = False
    _sync: Any = None  # _sync_plan, once per connection

    def build_model(self, tokenizer: Any, dtype: torch.dtype, attn: str) -> nn.Module:
        c = self.ctx
        return build_causal_lm(
            self.model_dir,
            tokenizer,
            seed=c.init_seed,
            dtype=dtype,
            attn=attn,
            trust_remote_code=c.trust_remote_code,
            lora=c.lora,
        )

    def logprobs(self, batch: SequenceBatch, temperature: float | None = None) -> torch.Tensor:
        """(N, T-1) log-probs of the action tokens of this rank's shard under the current policy (0 elsewhere), at
        the rollout temperature (or at ``temperature``, e.g. 1.0 for the raw logits)."""
        t = self.ctx.temperature if temperature is None else temperature
        return self.forward_batches(batch, lambda model, micro: _logprobs(model, micro, t, self.ctx.strategy.packing))

    def fit(self, exp: Experience, step: int, kl_coef: float = 0.0) -> dict[str, float]:
        """PPO epochs on this rank's shard. Advantages are whitened over the whole batch across all actor ranks when
        the estimator asks for it (``advantages.whitens``: GAE with whiten_advantages, REINFORCE++). The loss per
        token: the clipped surrogate (``algo.policy_loss``: PPO's token ratio or GSPO's sequence ratio; clip-higher,
        dual clip, the off-policy weights of ``algo.is_correction``), plus ``kl_coef`` x the KL to the
        reference with ``algo.kl_mode=loss`` (``exp.ref_logprobs``), minus ``algo.entropy_coef`` x the entropy;
        aggregated over the window as ``algo.loss_agg`` says.

        ``exp.old_logprobs`` None (a batch of one optimizer step, ``rlhf_core.old_logprobs``): no update came since
        the experience phase, so the training forward's log-probs, detached, are the old ones (ratio 1: PPO's
        gradient at ratio 1, exactly); the IS weights, ``rollout_logprob_max_diff`` and the KL to the reference
        (``kl``, ``kl_token_mean``, over the samples with action tokens) are then measured on them
        (``_measure_old``)."""
        a = self.ctx.algo
        assert exp.advantages is not None, "the actor trains on experience with advantages"
        if whitens(a.advantage_estimator, a.whiten_advantages):
            exp = exp.with_advantages(
                distributed_masked_whiten(exp.advantages, exp.action_mask, self.strategy.all_reduce_sum), exp.returns
            )
        kl_loss = a.kl_in_loss
        assert not kl_loss or exp.ref_logprobs is not None, "kl_mode=loss trains on the reference log-probs"
        temperature, pack = self.ctx.temperature, self.ctx.strategy.packing
        from_training = exp.old_logprobs is None
        assert not from_training or a.ppo_epochs == 1, "old log-probs from the training forward need one epoch"
        correction = is_correction_setting(a.is_correction, a.is_correction_threshold, a.is_correction_cap)
        sums: dict[str, float] = dict.fromkeys(
            ("gap", "is_clipped", "is_masked", "tokens", "kl", "kl_token_mean", "rows"), 0.0
        )

        def loss_fn(model: Any, micro: Experience, norm: WindowNorm) -> tuple[torch.Tensor, dict]:
            mask, aux = micro.action_mask, aux_list(self.ctx.aux_loss_coef)
            assert micro.advantages is not None  # exp's rows (asserted above)
            if a.entropy_coef > 0:
                logp, entropy = _logprobs(model, micro, temperature, pack, with_entropy=True, aux_loss=aux)
            else:
                logp, entropy = _logprobs(model, micro, temperature, pack, aux_loss=aux), None
            old, is_weights = micro.old_logprobs, micro.is_weights
            if old is None:
                old = logp.detach()
                is_weights = _measure_old(old, micro, a.kl_estimator, correction, sums)
            loss_t, stats = policy_loss_tokens(
                logp, old, micro.advantages, mask, a.eps_clip, a.eps_clip_high, a.dual_clip, is_weights, a.policy_loss
            )
            if kl_loss:
                assert micro.ref_logprobs is not None  # exp's rows (asserted above)
                unbiased = old if a.kl_loss_unbiased else None
                kl_t = kl_loss_tokens(logp, micro.ref_logprobs, mask, a.kl_estimator, old_logprobs=unbiased)
                loss_t = loss_t + kl_coef * kl_t
                stats["kl_loss"] = masked_mean(kl_t.detach(), mask).item()
            if entropy is not None:
                loss_t = loss_t - a.entropy_coef * entropy
                stats["entropy"] = masked_mean(entropy.detach(), mask).item()
            loss = aggregate_loss(
                loss_t,
                mask,
                a.loss_agg,
                num_tokens=norm.tokens,
                num_sequences=norm.sequences,
                norm_len=self.ctx.max_new_tokens,
            )
            # (DeepSpeed averages it over the window; norm.aux_scale keeps that mean with train.dynamic_batch)
            loss, extra = with_aux_loss(loss, aux, self.ctx.aux_loss_coef * norm.aux_scale)
            return loss, {**stats, **extra}

        stats = self.train_epochs(exp, step, loss_fn)
        out = {"policy_loss" if k == "loss" else k: v for k, v in stats.items()}
        if from_training:  # every rank, alike: two collectives
            names = ("is_clipped", "is_masked", "tokens", "kl", "kl_token_mean", "rows")
            totals = self.strategy.all_reduce_sum(torch.tensor([sums[k] for k in names], dtype=torch.float64))
            gap = self.strategy.all_reduce_max(torch.tensor([sums["gap"]], dtype=torch.float64)).item()
            is_clipped, is_masked, tokens, kl, kl_token_mean, rows = totals.tolist()
            if exp.rollout_logprobs is not None:
                out["rollout_logprob_max_diff"] = gap
            if correction is not None and exp.rollout_logprobs is not None:
                out.update(is_clipped_frac=is_clipped / max(tokens, 1.0), is_masked_frac=is_masked / max(tokens, 1.0))
            if exp.ref_logprobs is not None:
                out.update(kl=kl / max(rows, 1.0), kl_token_mean=kl_token_mean / max(rows, 1.0))
        return out

    # -- weight push to the rollout engines ---------------------------------------------------------------------------
    def connect_engines(
        self, engines: EngineHandles, use_collective: bool, backend: str = "gloo", bucket_mb: float = 1024
    ) -> None:
        """Join the weight sync with every engine worker over ``backend`` (already resolved: gloo, nccl or cuda_ipc)
        in buckets of ``bucket_mb`` MiB; which ranks send is ``weight_sync.sender.connect_rank``'s business. Without
        ``use_collective`` (HF engines) ``push_weights`` sends a state dict instead."""
        from rlhf_core.distributed.weight_sync.buckets import MIB
        from rlhf_core.distributed.weight_sync.sender import connect_rank

        self.engines = engines
        self.sender = None
        self.to_vllm, self._sync = use_collective, None  # the sync plan depends on the engines' kind
        self.bucket_bytes = int(bucket_mb * MIB)
        if use_collective:
            s = self.strategy
            self.sender = connect_rank(
                engines, s.rank, s.world_size, s.broadcast_object, backend=backend, bucket_mb=bucket_mb
            )

    def _sync_plan(self) -> tuple[list[MergedTensor], list[tuple[str, str, tuple[int, ...]]], list[int], set[int]]:
        """What a weight push sends, worked out once per connection: the weights (``models.lora.merged_tensors``: a
        LoRA layer's merged), the spec of each tensor sent, for each spec the index of the weight it comes from, and
        the weights sent under other names or in pieces. To vLLM engines each weight goes as the pieces its checkpoint
        stores (``models.checkpoint_names``: an MoE layer's fused experts one matrix per expert); to HF engines (a
        state dict) as the model holds it. ZeRO-3: shapes from ``ds_shape``."""
        if self._sync is not None:
            return self._sync
        zero3 = self.ctx.strategy.zero_stage == 3
        tensors = merged_tensors(self.engine.module)
        specs, owners, converted = [], [], set()
        for i, t in enumerate(tensors):
            dtype, shape = t.meta(zero3)
            meta = torch.empty(shape, dtype=dtype, device="meta")
            pieces = checkpoint_pieces(self.engine.module, t.name, meta) if self.to_vllm else [(t.name, meta)]
            if [name for name, _ in pieces] != [t.name]:
                converted.add(i)
            for name, piece in pieces:
                specs.append((name, dtype_name(piece.dtype), tuple(int(s) for s in piece.shape)))
                owners.append(i)
        self._sync = tensors, specs, owners, converted
        return self._sync

    def _named_full_params(self, plan: list[list[int]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The tensors of the specs in order (``_sync_plan``), full values. ZeRO-3: for each bucket of ``plan`` the
        sources of the weights it needs gathered together (every rank takes part in each gather); a bucket's tensors
        stay valid until the next bucket is requested, which is when the sender has packed them; pieces of a weight
        that belong to a later bucket are kept as copies until then."""
        tensors, _, owners, converted = self._sync_plan()

        def pieces(i: int) -> list[tuple[str, torch.Tensor]]:
            t = tensors[i]
            return (
                checkpoint_pieces(self.engine.module, t.name, t.value()) if i in converted else [(t.name, t.value())]
            )

        if self.ctx.strategy.zero_stage != 3:
            for i in range(len(tensors)):
                yield from pieces(i)
            return
        import deepspeed

        first = {}  # the first spec index of each weight
        for j, i in enumerate(owners):
            first.setdefault(i, j)
        kept: dict[int, tuple[str, torch.Tensor]] = {}
        for bucket in plan:
            need = sorted({owners[j] for j in bucket if j not in kept})
            with deepspeed.zero.GatheredParameters([p for i in need for p in tensors[i].sources]):
                here: dict[int, tuple[str, torch.Tensor]] = {}
                for i in need:
                    for k, piece in enumerate(pieces(i)):
                        j = first[i] + k
                        if j in bucket:
                            here[j] = piece
                        else:
                            kept[j] = (piece[0], piece[1].clone())
                for j in bucket:
                    yield here.pop(j) if j in here else kept.pop(j)

    def push_weights(self) -> dict[str, float]:
        """Collective over the actor ranks: send every parameter to the engines. Returns rank 0's sync metrics
        (``weight_sync_s``: seconds of the whole push, ``weight_sync_buckets``, ``weight_sync_broadcasts``:
        transfers, one per bucket, ``weight_sync_mib``); other ranks return {}."""
        from rlhf_core.distributed.weight_sync.buckets import bucket_plan
        from rlhf_core.distributed.weight_sync.sender import sync_weights

        start = time.perf_counter()
        specs = self._sync_plan()[1]
        named = self._named_full_params(bucket_plan(specs, self.bucket_bytes))
        rank = self.strategy.rank
        if rank != 0:
            if self.sender is not None:  # cuda_ipc: this rank serves the engine workers on its GPU
                self.sender.send_weights(named, specs, self.bucket_bytes)
            else:
                for _ in named:  # take part in each gather
                    pass
            return {}
        if self.sender is None:  # no collective (HF engines): a state dict through Ray's object store
            # Compact copies: a ZeRO-2 parameter is a view into DeepSpeed's flat buffer, and a pickled view carries
            # the whole buffer (ZeRO-3's gathered tensors are released after their bucket).
            sync_weights(None, self.engines, ((n, t.clone()) for n, t in named))
            return {
                "weight_sync_s": time.perf_counter() - start,
                "weight_sync_buckets": 0,
                "weight_sync_broadcasts": 0,
            }
        sync_weights(self.sender, self.engines, named, specs=specs, bucket_bytes=self.bucket_bytes)
        return {**self.sender.stats(), "weight_sync_s": time.perf_counter() - start}
