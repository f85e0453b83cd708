import torch

from rlhf_core.algos.batching import make_sequences, shard_batch, split_batch


def test_make_sequences_masks_response_positions():
    out = make_sequences([[1, 5, 6], [1, 7]], [[8, 2], [9, 9, 2]], pad_id=0)
    assert out["input_ids"].tolist() == [[1, 5, 6, 8, 2], [1, 7, 9, 9, 2]]
    assert out["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 1]]
    # position t predicts token t+1: row 0's response tokens are at 3, 4 -> positions 2, 3
    assert out["action_mask"].tolist() == [[0, 0, 1, 1], [0, 1, 1, 1]]
    short = make_sequences([[1, 5]], [[2]], pad_id=0)
    assert short["action_mask"].tolist() == [[0, 1]]


def test_split_and_shard():
    batch = {"x": torch.arange(6), "y": torch.arange(6) * 2}
    assert [c["x"].tolist() for c in split_batch(batch, 4)] == [[0, 1, 2, 3], [4, 5]]
    assert [s["y"].tolist() for s in shard_batch(batch, 3)] == [[0, 2], [4, 6], [8, 10]]
