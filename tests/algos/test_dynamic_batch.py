"""Token-budget micro-batches (``rlhf_core.algos.dynamic_batch``): first-fit counts, Karmarkar-Karp partitions, the
count agreed over two gloo ranks, and micro-batch gradients that sum to the full batch's."""

import os
import random

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.testing import assert_close

from rlhf_core.algos.dynamic_batch import (
    agreed_micro_batch_counts,
    first_fit_count,
    fits,
    karmarkar_karp,
    micro_batch_count,
    micro_batch_weights,
)
from rlhf_core.algos.ppo import aggregate_loss
from rlhf_core.algos.vocab import LOSS_AGGREGATIONS
from rlhf_core.distributed import device
from rlhf_core.ports import free_port


def test_first_fit_count_by_hand():
    # budget 10, lengths in order: 6 -> bin A (4 left); 5 -> bin B (5 left); 4 -> A (0 left); 3 -> B (2 left);
    # 3 -> bin C (7 left); 12 (over the budget) -> bin D alone; 2 -> B (0 left). 4 bins.
    assert first_fit_count([6, 5, 4, 3, 3, 12, 2], 10) == 4
    assert first_fit_count([], 10) == 0
    with pytest.raises(ValueError, match="max_tokens must be > 0"):
        first_fit_count([1], 0)


def test_karmarkar_karp_two_ways_by_hand():
    # {8, 7, 6, 5, 4} (indices 0..4), 2 ways. Differencing the two largest spreads each time:
    #   8 vs 7 -> [8 | 7] spread 1;  6 vs 5 -> [6 | 5] spread 1;  left: 4, 1, 1
    #   4 with [8 | 7]: 4 joins the smaller side -> [7+4=11 | 8] spread 3;  left: 3, 1
    #   [11 | 8] with [6 | 5]: larger with smaller -> [11+5=16 | 8+6=14] spread 2
    # KK's known miss on this set: the best split is 15 | 15 ({8, 7} | {6, 5, 4}).
    parts = karmarkar_karp([8, 7, 6, 5, 4], 2)
    assert parts == [[1, 3, 4], [0, 2]]
    # 3 ways, each sample first a triple (x, 0, 0); merging pairs the largest of one with the smallest of the other:
    #   8 with 7 -> (8, 7, 0) spread 8;  with 6 -> (8, 7, 6) spread 2;  5 with 4 -> (5, 4, 0) spread 5
    #   (5, 4, 0) with (8, 7, 6): 5 + 6, 4 + 7, 0 + 8 -> (11, 11, 8): {6, 5} | {7, 4} | {8}
    # (no 3-way split of the set has a largest part under 11)
    assert karmarkar_karp([8, 7, 6, 5, 4], 3) == [[2, 3], [1, 4], [0]]
    assert karmarkar_karp([3], 2) == [[0], []]  # fewer samples than partitions: some stay empty
    assert karmarkar_karp([], 2) == [[], []]
    with pytest.raises(ValueError, match="k >= 1"):
        karmarkar_karp([1], 0)


def test_micro_batch_count_rises_until_the_balanced_partitions_fit():
    # first fit with budget 15: [8, 7] and [6, 5, 4] -> 2 bins; KK's 2 ways are 16 | 14 (above): 16 > 15, so 3,
    # where KK gives 8 | 11 | 11.
    lengths = [8, 7, 6, 5, 4]
    assert first_fit_count(lengths, 15) == 2
    assert not fits(karmarkar_karp(lengths, 2), lengths, 15)
    assert micro_batch_count(lengths, 15) == 3
    assert micro_batch_count(lengths, 16) == 2
    assert micro_batch_count(lengths, 15, at_least=4) == 4  # another rank needs 4
    assert micro_batch_count([40, 1], 10) == 2  # a sample over the budget goes alone
    assert fits([[0], [1]], [40, 1], 10)


@pytest.mark.parametrize("budget", [1, 7, 20, 64, 1000])
def test_partitions_cover_every_sample_once_within_the_budget(budget):
    rng = random.Random(budget)
    for n in (1, 2, 5, 16, 33):
        lengths = [rng.randint(1, 40) for _ in range(n)]
        k = micro_batch_count(lengths, budget)
        parts = karmarkar_karp(lengths, k)
        assert len(parts) == k >= first_fit_count(lengths, budget)
        assert sorted(i for p in parts for i in p) == list(range(n))  # every sample exactly once
        assert all(parts)  # no empty micro-batch when k <= n
        for p in parts:
            assert len(p) == 1 or sum(lengths[i] for i in p) <= budget
        # balance: the largest differencing leaves no partition more than the longest sample above another
        sums = [sum(lengths[i] for i in p) for p in parts]
        assert max(sums) - min(sums) <= max(lengths)


def test_agreed_counts_on_one_rank_are_the_local_counts():
    windows = [[8, 7, 6, 5, 4], [3, 3], [40, 1]]
    assert agreed_micro_batch_counts(windows, 15) == [3, 1, 2]


def test_micro_batch_weights_by_hand():
    # parts [[0, 2], [1]]: sample mean 2/3, 1/3; token mean with tokens [4, 1, 3]: (4 + 3)/8, 1/8
    assert_close(torch.tensor(micro_batch_weights([[0, 2], [1]])), torch.tensor([2 / 3, 1 / 3]))
    assert_close(torch.tensor(micro_batch_weights([[0, 2], [1]], [4, 1, 3])), torch.tensor([7 / 8, 1 / 8]))
    assert micro_batch_weights([[0], [1]], [0, 0]) == [0.0, 0.0]


# Rank 0's mini-batches need 3 and 1 micro-batches of 15 tokens alone; rank 1's need 2 and 3.
RANK_WINDOWS = [[[8, 7, 6, 5, 4], [3, 3, 2, 2, 1]], [[9, 6, 5, 5, 1], [14, 14, 2, 1, 1]]]


def _count_worker(rank: int, world_size: int, port: int, out_dir: str) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        counts = agreed_micro_batch_counts(RANK_WINDOWS[rank], 15, device.all_reduce_max)
        torch.save(counts, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_counts_are_equal_across_two_gloo_ranks(tmp_path):
    local = [[micro_batch_count(w, 15) for w in windows] for windows in RANK_WINDOWS]
    assert local == [[3, 1], [2, 3]]
    mp.spawn(_count_worker, args=(2, free_port("127.0.0.1"), str(tmp_path)), nprocs=2, join=True)
    counts = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(2)]
    assert counts[0] == counts[1] == [3, 3]  # the larger count of each mini-batch, never rounded down
    for windows, ks in zip(RANK_WINDOWS, counts, strict=True):
        for lengths, k in zip(windows, ks, strict=True):
            assert fits(karmarkar_karp(lengths, k), lengths, 15)


class TinyLM(nn.Module):
    """Embedding -> linear next-token model: per-token NLL with a gradient through every weight."""

    def __init__(self, vocab: int = 11, dim: int = 4):
        super().__init__()
        self.embed, self.head = nn.Embedding(vocab, dim), nn.Linear(dim, vocab)

    def token_loss(self, input_ids: torch.Tensor) -> torch.Tensor:
        """(B, T) -> (B, T-1) NLL of each next token."""
        logp = torch.log_softmax(self.head(self.embed(input_ids[:, :-1])), dim=-1)
        return -logp.gather(-1, input_ids[:, 1:, None]).squeeze(-1)


def _rows(n: int = 9, t: int = 12, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, 11, (n, t), generator=gen)
    lengths = torch.randint(3, t + 1, (n,), generator=gen)
    prompt = torch.randint(1, 3, (n,), generator=gen)
    pos = torch.arange(t - 1)
    # action tokens: targets at positions prompt .. length-1 (position t predicts token t + 1)
    action_mask = ((pos >= prompt[:, None] - 1) & (pos < lengths[:, None] - 1)).float()
    return input_ids, action_mask, lengths.tolist()


def _grads(model: nn.Module) -> list[torch.Tensor]:
    grads = [p.grad.detach().clone() for p in model.parameters()]
    model.zero_grad()
    return grads


@pytest.mark.parametrize("mode", LOSS_AGGREGATIONS)
def test_micro_batch_gradients_sum_to_the_full_batch_gradient(mode):
    """The project's losses take the whole mini-batch's denominators (``role_base.WindowNorm``): summed over any
    token-budget split, the micro-batch gradients are the full batch's (fp32, 1e-5)."""
    torch.manual_seed(0)
    model = TinyLM()
    input_ids, mask, lengths = _rows()
    aggregate_loss(model.token_loss(input_ids), mask, mode, norm_len=10.0).backward()
    full = _grads(model)

    tokens, sequences = mask.sum(), (mask.sum(1) > 0).sum().float()
    parts = karmarkar_karp(lengths, micro_batch_count(lengths, 24))
    assert len(parts) > 2
    for p in parts:
        rows = torch.tensor(p)
        loss_t = model.token_loss(input_ids[rows])
        aggregate_loss(loss_t, mask[rows], mode, num_tokens=tokens, num_sequences=sequences, norm_len=10.0).backward()
    for got, want in zip(_grads(model), full, strict=True):
        assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["token_mean", "sample_mean"])
def test_micro_batch_weights_turn_micro_means_into_the_full_mean(kind):
    """A loss that is a mean over its own micro-batch (its tokens, or its samples like the MoE aux loss) times
    ``micro_batch_weights`` sums to the full batch's gradient."""
    torch.manual_seed(0)
    model = TinyLM()
    input_ids, mask, lengths = _rows(seed=1)

    def mean_loss(rows: torch.Tensor) -> torch.Tensor:
        loss_t, m = model.token_loss(input_ids[rows]), mask[rows]
        if kind == "token_mean":
            return (loss_t * m).sum() / m.sum()
        return ((loss_t * m).sum(1) / m.sum(1).clamp(min=1)).mean()

    mean_loss(torch.arange(len(lengths))).backward()
    full = _grads(model)
    parts = karmarkar_karp(lengths, micro_batch_count(lengths, 24))
    weights = micro_batch_weights(parts, mask.sum(1).tolist() if kind == "token_mean" else None)
    for p, w in zip(parts, weights, strict=True):
        (w * mean_loss(torch.tensor(p))).backward()
    for got, want in zip(_grads(model), full, strict=True):
        assert_close(got, want, atol=1e-5, rtol=1e-5)
