"""Padding removal: the real tokens of a padded (B, T) batch packed into fewer, fuller rows, and back.

Pure torch. A batch's samples (the runs of 1s of each row's attention mask) are placed whole into packed rows of at
most ``max_tokens`` tokens (first fit, longest sample first), one after the other; each sample's ``position_ids``
restart at 0, which is how the model tells the samples of a row apart (Hugging Face's attention builds a
block-diagonal causal mask from the restarts for sdpa/eager, and flash-attention's varlen kernel reads the same
restarts), so no token attends across samples. What is left at the end of a packed row is filler: its own run of
positions from 0, so it attends only to itself, and ``unpack`` drops it. Outputs computed on the packed rows go back
to the padded layout with ``unpack``, so everything downstream keeps the (B, T) conventions of
:mod:`rlhf_core.algos.batching`.

With ``max_tokens`` = the longest sample (the default) no packed row is wider than the padded batch was, so
attention, whose cost grows with the square of a row's width, never costs more than it did padded. A larger budget
(e.g. everything in one row for flash-attention's varlen kernel, whose cost is per sample) packs tighter.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Packing:
    """Where each real token of a (B, T) batch sits in the packed (R, L) rows.

    ``src_rows``/``src_cols`` ((N,) long) index the N real tokens in the padded batch, in row-major order;
    ``dst_rows``/``dst_cols`` the same tokens in the packed rows. ``position_ids`` is (R, L) long.
    """

    shape: tuple[int, int]
    packed_shape: tuple[int, int]
    src_rows: torch.Tensor
    src_cols: torch.Tensor
    dst_rows: torch.Tensor
    dst_cols: torch.Tensor
    position_ids: torch.Tensor

    @property
    def num_tokens(self) -> int:
        """N, the real tokens."""
        return int(self.src_rows.numel())

    def pack(self, x: torch.Tensor, fill: float | int = 0) -> torch.Tensor:
        """(B, T, ...) -> (R, L, ...); filler positions hold ``fill``."""
        out = x.new_full((*self.packed_shape, *x.shape[2:]), fill)
        out[self.dst_rows, self.dst_cols] = x[self.src_rows, self.src_cols]
        return out

    def unpack(self, y: torch.Tensor, fill: float | int = 0) -> torch.Tensor:
        """(R, L, ...) -> (B, T, ...); padding positions hold ``fill``. Differentiable in ``y``."""
        out = y.new_full((*self.shape, *y.shape[2:]), fill)
        out[self.src_rows, self.src_cols] = y[self.dst_rows, self.dst_cols]
        return out

    def locate(self, rows: torch.Tensor, cols: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Packed (row, col) of the padded positions (``rows``, ``cols``), which must be real tokens."""
        index = torch.full(self.shape, -1, dtype=torch.long, device=self.src_rows.device)
        index[self.src_rows, self.src_cols] = torch.arange(self.num_tokens, device=index.device)
        flat = index[rows, cols]
        if bool((flat < 0).any()):
            raise ValueError("locate: a position is padding, not a real token")
        return self.dst_rows[flat], self.dst_cols[flat]


def first_fit_rows(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Sample indices per packed row: longest sample first, each into the first row with room (first-fit
    decreasing); ties keep the input order. A sample longer than ``max_tokens`` gets a row of its own.

    Example: lengths [3, 5, 2, 4], max_tokens 6. Longest first: 5 (i=1), 4 (i=3), 3 (i=0), 2 (i=2). 5 opens
    row 0 (room 1), 4 opens row 1 (room 2), 3 fits neither and opens row 2 (room 3), 2 fits row 1 (room 0):
    [[1], [3, 2], [0]].
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    rows: list[list[int]] = []
    room: list[int] = []
    for i in order:
        n = lengths[i]
        for r, free in enumerate(room):
            if n <= free:
                rows[r].append(i)
                room[r] -= n
                break
        else:
            rows.append([i])
            room.append(max_tokens - n)
    return rows


def plan_packing(attention_mask: torch.Tensor, max_tokens: int | None = None) -> Packing:
    """Pack the real tokens of each row of ``attention_mask`` ((B, T), 1 on real tokens; each row's real tokens
    one contiguous run, as right or left padding gives) into rows of at most ``max(max_tokens, longest sample)``
    tokens (default: the longest sample). Rows without a real token take no space."""
    mask = attention_mask.bool()
    lengths = mask.sum(1).tolist()
    longest = max(lengths, default=0)
    budget = max(max_tokens or 0, longest, 1)
    nonempty = [i for i, n in enumerate(lengths) if n > 0]
    rows = first_fit_rows([lengths[i] for i in nonempty], budget)
    rows = [[nonempty[j] for j in row] for row in rows]
    width = max((sum(lengths[i] for i in row) for row in rows), default=1)
    src_rows, src_cols, dst_rows, dst_cols = [], [], [], []
    position_ids = torch.zeros((max(len(rows), 1), width), dtype=torch.long)
    for r, row in enumerate(rows):
        col = 0
        for i in row:
            n = lengths[i]
            src_rows.append(torch.full((n,), i, dtype=torch.long))
            src_cols.append(mask[i].nonzero().flatten().cpu())
            dst_rows.append(torch.full((n,), r, dtype=torch.long))
            dst_cols.append(torch.arange(col, col + n))
            position_ids[r, col : col + n] = torch.arange(n)
            col += n
        position_ids[r, col:] = torch.arange(width - col)  # filler: its own run, attending only to itself

    def cat(parts: list[torch.Tensor]) -> torch.Tensor:
        return (torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)).to(attention_mask.device)

    return Packing(
        shape=(mask.size(0), mask.size(1)),
        packed_shape=(position_ids.size(0), width),
        src_rows=cat(src_rows),
        src_cols=cat(src_cols),
        dst_rows=cat(dst_rows),
        dst_cols=cat(dst_cols),
        position_ids=position_ids.to(attention_mask.device),
    )


def padding_fraction(attention_mask: torch.Tensor) -> float:
    """Share of the (B, T) positions that are padding."""
    return 1.0 - float(attention_mask.bool().float().mean()) if attention_mask.numel() else 0.0
