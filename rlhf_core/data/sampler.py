"""Deterministic data order that survives restarts and any number of ranks.

The training data is read as one stream: the concatenation of per-epoch permutations of ``range(n)`` (seeded by
``seed + epoch``). Optimizer step ``k`` consumes stream items ``[k*B, (k+1)*B)`` where ``B`` is the global batch, and
rank ``r`` of ``W`` takes the ``r``-th contiguous slice of that global batch. So a restart at step ``k`` continues at
exactly the next unconsumed sample, every sample is consumed once per epoch, and the order does not depend on the
number of ranks.
"""

from __future__ import annotations

import random


def epoch_permutation(n: int, seed: int, epoch: int) -> list[int]:
    order = list(range(n))
    random.Random(seed * 1_000_003 + epoch).shuffle(order)
    return order


def global_batch(n: int, batch_size: int, step: int, seed: int) -> list[int]:
    """Dataset indices of optimizer step ``step`` (0-based)."""
    start, stop = step * batch_size, (step + 1) * batch_size
    out: list[int] = []
    epoch = start // n
    while len(out) < batch_size:
        perm = epoch_permutation(n, seed, epoch)
        lo = max(start - epoch * n, 0)
        hi = min(stop - epoch * n, n)
        out.extend(perm[lo:hi])
        epoch += 1
    return out


def rank_slice(indices: list[int], rank: int, world_size: int) -> list[int]:
    """Contiguous share of ``indices`` for ``rank``; ``len(indices)`` must divide by ``world_size``."""
    assert len(indices) % world_size == 0, f"{len(indices)} samples do not split over {world_size} ranks"
    per = len(indices) // world_size
    return indices[rank * per : (rank + 1) * per]


def total_steps(n: int, batch_size: int, max_epochs: int, max_steps: int | None) -> int:
    """Optimizer steps for ``max_epochs`` passes (the last partial batch is dropped), capped by ``max_steps``."""
    steps = n * max_epochs // batch_size
    return min(steps, max_steps) if max_steps is not None else steps
