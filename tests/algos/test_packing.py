"""Padding removal (rlhf_core.algos.packing) and chunked chosen-token log-probs, by hand."""

from __future__ import annotations

import math

import pytest
import torch

from rlhf_core.algos.losses import chunked_token_logprobs, logprob_chunk_size, token_logprobs
from rlhf_core.algos.packing import first_fit_rows, padding_fraction, plan_packing


def test_first_fit_rows_by_hand():
    # Longest first: 5 (i=1) opens row 0 (room 1); 4 (i=3) opens row 1 (room 2); 3 (i=0) fits neither: row 2
    # (room 3); 2 (i=2) fits row 1 (room 2 -> 0).
    assert first_fit_rows([3, 5, 2, 4], 6) == [[1], [3, 2], [0]]
    # A sample over the budget gets a row of its own; ties keep the input order.
    assert first_fit_rows([7, 2, 2], 4) == [[0], [1, 2]]
    assert first_fit_rows([], 4) == []


def test_plan_packing_places_samples_whole_with_restarting_positions():
    # Right-padded lengths 3, 5, 2, 4 in a (4, 6) batch; budget = the longest sample, 5.
    mask = torch.tensor([[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 0, 0]])
    p = plan_packing(mask)
    # Rows: [sample 1] (5), [sample 3] (4), [sample 0, sample 2] (3 + 2): width 5.
    assert p.packed_shape == (3, 5)
    assert p.position_ids.tolist() == [[0, 1, 2, 3, 4], [0, 1, 2, 3, 0], [0, 1, 2, 0, 1]]
    ids = torch.arange(24).reshape(4, 6) + 100
    packed = p.pack(ids, fill=-1)
    assert packed.tolist() == [[106, 107, 108, 109, 110], [118, 119, 120, 121, -1], [100, 101, 102, 112, 113]]
    # 14 real tokens of 24 positions; 1 filler of 15 packed positions.
    assert p.num_tokens == 14 and padding_fraction(mask) == pytest.approx(10 / 24)
    # Back to the padded layout: real tokens where they were, the fill elsewhere.
    assert torch.equal(p.unpack(packed, fill=0), ids * mask)
    # A bigger budget packs tighter: 3 + 2 + ... first fit decreasing into 9: [5, 4], [3, 2].
    assert plan_packing(mask, max_tokens=9).packed_shape == (2, 9)


def test_plan_packing_handles_left_padding_and_empty_rows():
    mask = torch.tensor([[0, 0, 1, 1], [0, 0, 0, 0], [0, 1, 1, 1]])
    p = plan_packing(mask)
    assert p.packed_shape == (2, 3)  # lengths 2, 0, 3: the empty row takes no space; 2 + 3 > 3
    ids = torch.tensor([[9, 9, 1, 2], [9, 9, 9, 9], [9, 3, 4, 5]])
    back = p.unpack(p.pack(ids), fill=-7)
    assert back.tolist() == [[-7, -7, 1, 2], [-7, -7, -7, -7], [-7, 3, 4, 5]]
    rows, cols = p.locate(torch.tensor([2, 0]), torch.tensor([1, 3]))
    assert p.pack(ids)[rows, cols].tolist() == [3, 2]
    with pytest.raises(ValueError, match="padding"):
        p.locate(torch.tensor([1]), torch.tensor([0]))


def test_unpack_is_differentiable():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    p = plan_packing(mask)
    y = torch.ones(p.packed_shape, requires_grad=True)
    (p.unpack(y) * torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])).sum().backward()
    # Each real token's packed slot receives its padded position's weight; the filler none.
    assert y.grad.tolist() == [[1.0, 2.0], [4.0, 0.0]]  # rows: [sample 0], [sample 1, filler]


def test_chunked_token_logprobs_by_hand_and_against_the_full_softmax():
    # Vocabulary 2: logits [ln 3, 0] -> p = 3/4, 1/4. Target 0: ln 3/4; target 1: ln 1/4. At temperature 2 the
    # logits are [ln 3 / 2, 0] -> p(0) = sqrt(3) / (sqrt(3) + 1) = 0.633975.
    hidden = torch.tensor([[math.log(3.0), 0.0], [math.log(3.0), 0.0]])
    out = chunked_token_logprobs(hidden, torch.tensor([0, 1]), torch.nn.Identity(), chunk_size=1)
    assert out.tolist() == pytest.approx([math.log(0.75), math.log(0.25)], abs=1e-6)
    out = chunked_token_logprobs(hidden[:1], torch.tensor([0]), torch.nn.Identity(), temperature=2.0)
    assert out.item() == pytest.approx(math.log(3**0.5 / (3**0.5 + 1)), abs=1e-6)
    # Any chunking equals token_logprobs (full log_softmax) at the same positions, values and gradients.
    gen = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(8, 50, bias=False)
    h = torch.randn(2, 7, 8, generator=gen)
    ids = torch.randint(0, 50, (2, 7), generator=gen)
    full = token_logprobs(head(h), ids, temperature=0.7)  # (2, 6): position t scores ids[:, t+1]
    grads = []
    for chunk in (1, 4, 100):
        hh = h[:, :-1].reshape(-1, 8).clone().requires_grad_(True)
        lp = chunked_token_logprobs(hh, ids[:, 1:].reshape(-1), head, temperature=0.7, chunk_size=chunk)
        torch.testing.assert_close(lp, full.reshape(-1), atol=1e-6, rtol=0)
        lp.sum().backward()
        grads.append(hh.grad)
    torch.testing.assert_close(grads[0], grads[2], atol=1e-6, rtol=0)
    torch.testing.assert_close(grads[1], grads[2], atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="temperature"):
        chunked_token_logprobs(hidden, torch.tensor([0, 1]), torch.nn.Identity(), temperature=0.0)


def test_logprob_chunk_size():
    # 2**25 elements: 1024 positions of a 32768 vocabulary; at least one position for any vocabulary.
    assert logprob_chunk_size(32768) == 1024
    assert logprob_chunk_size(10**9) == 1
    assert logprob_chunk_size(100, max_elements=1000) == 10
