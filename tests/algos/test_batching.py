import torch

from rlhf_core.algos.batching import ensure_eos, make_sequences
from rlhf_core.algos.experience import SequenceBatch


def test_make_sequences_masks_response_positions():
    out = make_sequences([[1, 5, 6], [1, 7]], [[8, 2], [9, 9, 2]], pad_id=0)
    assert isinstance(out, SequenceBatch) and out.size == 2
    assert out.input_ids.tolist() == [[1, 5, 6, 8, 2], [1, 7, 9, 9, 2]]
    assert out.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 1]]
    # position t predicts token t+1: row 0's response tokens are at 3, 4 -> positions 2, 3
    assert out.action_mask.tolist() == [[0, 0, 1, 1], [0, 1, 1, 1]]
    short = make_sequences([[1, 5]], [[2]], pad_id=0)
    assert short.action_mask.tolist() == [[0, 1]]


def test_make_sequences_right_pads_the_shorter_row():
    out = make_sequences([[1, 5], [1]], [[2], [7, 8, 2]], pad_id=0)
    # row 0: 1 5 2 then one pad; row 1: 1 7 8 2
    assert out.input_ids.tolist() == [[1, 5, 2, 0], [1, 7, 8, 2]]
    assert out.attention_mask.tolist() == [[1, 1, 1, 0], [1, 1, 1, 1]]
    # row 0: response token at index 2 -> position 1; row 1: response at 1, 2, 3 -> positions 0, 1, 2
    assert out.action_mask.tolist() == [[0, 1, 0], [1, 1, 1]]


def test_ensure_eos_appends_to_truncated_and_empty_responses():
    responses = [[5, 2], [5, 6], [], [2]]
    closed, truncated = ensure_eos(responses, eos_id=2)
    # [5, 2] ends with EOS: kept; [5, 6] was cut: + EOS; [] becomes [EOS]; [2] (EOS only) kept
    assert closed == [[5, 2], [5, 6, 2], [2], [2]]
    assert truncated.dtype == torch.bool and truncated.tolist() == [False, True, True, False]
    assert responses == [[5, 2], [5, 6], [], [2]]  # the input lists are not modified
    closed_none, truncated_none = ensure_eos([], eos_id=2)
    assert closed_none == [] and truncated_none.shape == (0,)


def test_ensure_eos_counts_every_stop_id_as_an_end():
    # An instruct model ends a turn on its own token (Llama-3-Instruct's <|eot_id|> = 9 here) as well as on EOS (2):
    # [5, 9] and [5, 2] stopped, [5, 7] was cut at max_new_tokens and gets EOS; [] gets EOS.
    closed, truncated = ensure_eos([[5, 9], [5, 2], [5, 7], []], eos_id=2, stop_ids=(2, 9))
    assert closed == [[5, 9], [5, 2], [5, 7, 2], [2]]
    assert truncated.tolist() == [False, False, True, True]
    # without the stop ids, [5, 9] would be taken as cut: EOS appended and the missing-EOS penalty applied
    assert ensure_eos([[5, 9]], eos_id=2)[1].tolist() == [True]
