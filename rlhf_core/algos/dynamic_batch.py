"""Token-budget micro-batches (``train.dynamic_batch``): a mini-batch split into as few micro-batches as hold at most
``max_tokens`` tokens each, balanced by token count, with every data-parallel rank running the same number.

Per mini-batch (one optimizer step) and rank, after OpenRLHF 0.11 ``replay_buffer.setup_dynamic_batch``:
1. count the micro-batches by first fit of the samples' token counts against the budget;
2. take the largest count over the ranks (all-reduce MAX; never rounded down, which could break the budget);
3. split into that many partitions of near-equal token sums (Karmarkar-Karp, :func:`karmarkar_karp`);
4. weigh each micro-batch's loss so that the micro-batch gradients sum to the mini-batch's
   (:func:`micro_batch_weights`).
Balanced partitions need not fit where first fit did, so a count rises until they do (:func:`micro_batch_count`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def first_fit_count(lengths: Sequence[int], max_tokens: int) -> int:
    """The number of bins of ``max_tokens`` that first fit fills with ``lengths`` in order: each sample goes into the
    first bin with room for it, else opens a bin; a sample longer than the budget gets a bin of its own.

    Args:
        lengths: token count of each sample (>= 0).
        max_tokens: the budget of one micro-batch (> 0).
    Returns:
        the number of bins (0 for no samples).
    """
    if max_tokens <= 0:
        raise ValueError(f"max_tokens must be > 0, got {max_tokens}")
    room: list[int] = []
    for length in lengths:
        for i, free in enumerate(room):
            if length <= free:
                room[i] -= length
                break
        else:
            room.append(max(0, max_tokens - length))
    return len(room)


def karmarkar_karp(lengths: Sequence[int], k: int) -> list[list[int]]:
    """Indices of ``lengths`` in ``k`` partitions of near-equal sums, by the largest differencing method
    (Karmarkar & Karp 1982, k-way form).

    Each sample starts as a k-tuple of partitions holding it alone; the two tuples with the largest spread (largest
    minus smallest sum) merge, the largest partition of one with the smallest of the other, and so on, which cancels
    most of both spreads; repeated until one tuple is left. With n >= k samples of positive length no partition is
    empty (a merge of tuples with a and b non-empty partitions has min(k, a + b)). Ties break by sample index, so the
    result depends only on ``lengths``.

    Args:
        lengths: token count of each sample.
        k: number of partitions (>= 1).
    Returns:
        k lists of sample indices, each in increasing order, the partitions by decreasing sum.
    """
    if k < 1:
        raise ValueError(f"need k >= 1 partitions, got {k}")
    # (-spread, tie, partitions by decreasing sum), kept sorted: the front has the largest spread
    states = sorted(
        (-int(length), i, [(int(length), [i])] + [(0, []) for _ in range(k - 1)]) for i, length in enumerate(lengths)
    )
    if not states:
        return [[] for _ in range(k)]
    while len(states) > 1:
        _, tie_a, a = states.pop(0)
        _, tie_b, b = states.pop(0)
        merged = [(sa + sb, ia + ib) for (sa, ia), (sb, ib) in zip(a, reversed(b), strict=True)]
        merged.sort(key=lambda part: -part[0])
        state = (-(merged[0][0] - merged[-1][0]), min(tie_a, tie_b), merged)
        at = 0  # linear insertion (n <= a mini-batch's rows): O(n^2) in all, no heap module needed
        while at < len(states) and states[at][:2] < state[:2]:
            at += 1
        states.insert(at, state)
    return [sorted(indices) for _, indices in states[0][2]]


def fits(parts: Sequence[Sequence[int]], lengths: Sequence[int], max_tokens: int) -> bool:
    """Whether every partition holds at most ``max_tokens`` tokens, or a single sample (which no split can shrink)."""
    return all(len(p) <= 1 or sum(lengths[i] for i in p) <= max_tokens for p in parts)


def micro_batch_count(lengths: Sequence[int], max_tokens: int, at_least: int = 1) -> int:
    """The smallest count >= ``at_least`` and >= the first-fit count whose :func:`karmarkar_karp` partitions all fit
    the budget (:func:`fits`); at most ``len(lengths)`` (one sample each), unless ``at_least`` asks for more.

    Args:
        lengths: token count of each sample of this rank's mini-batch.
        max_tokens: the budget of one micro-batch (> 0).
        at_least: a lower bound, e.g. the count another rank needs.
    Returns:
        the number of micro-batches.
    """
    k = max(at_least, first_fit_count(lengths, max_tokens), 1)
    while k < len(lengths) and not fits(karmarkar_karp(lengths, k), lengths, max_tokens):
        k += 1
    return k


def agreed_micro_batch_counts(
    window_lengths: Sequence[Sequence[int]],
    max_tokens: int,
    all_reduce_max: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> list[int]:
    """Per mini-batch, the micro-batch count every data-parallel rank uses: the largest count any rank needs, raised
    until every rank's partitions fit. Each rank calls this with its own mini-batches (the same number on every
    rank); the collective is injected (None: a single rank).

    Every rank sees the same maxima, so all leave the loop together: a round ends when no rank needed more than the
    counts agreed before it (usually the second round; each further one raises some count, at most to the samples).

    Args:
        window_lengths: for each mini-batch of this rank, its samples' token counts.
        max_tokens: the budget of one micro-batch (> 0).
        all_reduce_max: in-place element-wise MAX over the ranks of an int64 tensor (returns it).
    Returns:
        one count per mini-batch, equal on every rank.
    """
    agreed = [1] * len(window_lengths)
    while True:
        local = torch.tensor(
            [micro_batch_count(lengths, max_tokens, at_least=k) for lengths, k in zip(window_lengths, agreed)],
            dtype=torch.int64,
        )
        if all_reduce_max is not None:
            local = all_reduce_max(local)
        needed = [int(c) for c in local]
        if needed == agreed:
            return agreed
        agreed = needed


def micro_batch_weights(parts: Sequence[Sequence[int]], weights: Sequence[float] | None = None) -> list[float]:
    """The factor of each micro-batch's loss that makes the micro-batch gradients sum to the mini-batch's: a loss
    that is a mean over the micro-batch's samples (``weights`` None) gets n_micro / n_total; a token mean (``weights``
    = each sample's action tokens) gets tokens_micro / tokens_total. A total of 0 gives 0 everywhere.

    E.g. parts [[0, 2], [1]] of 3 samples: [2/3, 1/3]; with tokens [4, 1, 3]: [7/8, 1/8].

    Args:
        parts: sample indices of each micro-batch.
        weights: each sample's weight (e.g. action tokens); None = 1 each.
    Returns:
        one factor per micro-batch; they sum to 1 (if the parts cover the samples).
    """
    n = max((max(p) for p in parts if len(p)), default=-1) + 1
    w = [1.0] * n if weights is None else [float(x) for x in weights]
    total = sum(w)
    if total <= 0:
        return [0.0] * len(parts)
    return [sum(w[i] for i in p) / total for p in parts]
