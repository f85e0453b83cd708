"""``rlhf_core.algos.is_correction``: the off-policy weights between the rollout engine's log-probs and the trainer's
(tis, icepop, seq-mask-tis as OpenRLHF's ``PolicyLoss``); the expected values worked by hand."""

import math

import pytest
import torch
from torch.testing import assert_close

from rlhf_core.algos.is_correction import is_correction_weights

OLD = torch.zeros(2, 4)
# r = exp(old - rollout) = exp(-rollout):
# row 0: [e^-ln4, e^ln2, e^0, NaN] = [0.25, 2, 1, (no engine log-prob: 1)], all four action tokens;
# row 1: [e^ln8, e^ln8] = [8, 8] on two action tokens, then padding (5.0: ignored).
ROLLOUT = torch.tensor(
    [[math.log(4.0), -math.log(2.0), 0.0, float("nan")], [-math.log(8.0), -math.log(8.0), 5.0, 5.0]]
)
MASK = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])


def test_tis_clamps_both_ends():
    # [0.5, 5]: 0.25 -> 0.5, 2, 1, 1 | 8 -> 5, 8 -> 5, padding 1, 1; clamped: 3 of the 6 action tokens
    w, stats = is_correction_weights(OLD, ROLLOUT, MASK, "tis", 0.5, 5.0)
    assert_close(w, torch.tensor([[0.5, 2.0, 1.0, 1.0], [5.0, 5.0, 1.0, 1.0]]))
    assert stats == pytest.approx({"is_clipped_frac": 0.5, "is_masked_frac": 0.0})


def test_tis_with_low_zero_is_the_upper_cap_alone():
    # algo.is_correction_cap = 2 is tis on [0, 2]: exp(0 - ln 2) = 0.5; exp(0 + ln 4) = 4 -> 2; NaN -> 1; masked -> 1
    rollout = torch.tensor([[math.log(2.0), -math.log(4.0), float("nan"), 5.0]])
    w, stats = is_correction_weights(torch.zeros(1, 4), rollout, torch.tensor([[1, 1, 1, 0]]), "tis", 0.0, 2.0)
    assert_close(w, torch.tensor([[0.5, 2.0, 1.0, 1.0]]))
    assert stats["is_clipped_frac"] == pytest.approx(1 / 3)  # the 4: one of the three action tokens


def test_icepop_drops_the_tokens_outside_the_interval():
    # [0.5, 5]: 0.25 is out -> 0; 2, 1, 1 (NaN counts as 1) kept as r | 8, 8 out -> 0; 3 of 6 tokens dropped
    w, stats = is_correction_weights(OLD, ROLLOUT, MASK, "icepop", 0.5, 5.0)
    assert_close(w, torch.tensor([[0.0, 2.0, 1.0, 1.0], [0.0, 0.0, 1.0, 1.0]]))
    assert stats == pytest.approx({"is_clipped_frac": 0.0, "is_masked_frac": 0.5})


def test_seq_mask_tis_drops_whole_rows_by_their_geometric_mean():
    # row 0: mean log r over its 3 engine tokens = (-2 ln 2 + ln 2 + 0) / 3 = -ln2 / 3 -> 2^(-1/3) = 0.7937, in
    # [0.5, 5]: kept, weighed by r unclamped (0.25, 2, 1, 1); row 1: (ln 8 + ln 8) / 2 = ln 8 -> 8 > 5: dropped.
    w, stats = is_correction_weights(OLD, ROLLOUT, MASK, "seq-mask-tis", 0.5, 5.0)
    assert_close(w, torch.tensor([[0.25, 2.0, 1.0, 1.0], [0.0, 0.0, 1.0, 1.0]]))
    assert stats == pytest.approx({"is_clipped_frac": 0.0, "is_masked_frac": 2 / 6})
    # [0.5, 0.75]: 0.7937 > 0.75 drops row 0 too: all 6 action tokens
    w, stats = is_correction_weights(OLD, ROLLOUT, MASK, "seq-mask-tis", 0.5, 0.75)
    assert_close(w, torch.tensor([[0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 1.0, 1.0]]))
    assert stats["is_masked_frac"] == 1.0


def test_refuses_an_unknown_kind_and_bad_thresholds():
    with pytest.raises(ValueError, match="unknown IS correction 'mis'"):
        is_correction_weights(OLD, ROLLOUT, MASK, "mis", 0.5, 5.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"0 <= low < high, got \[5.0, 0.5\]"):
        is_correction_weights(OLD, ROLLOUT, MASK, "tis", 5.0, 0.5)
