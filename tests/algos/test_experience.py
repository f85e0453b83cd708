"""The typed PPO batches: split, shard and select rows of every field alike, None fields included."""

import pytest
import torch

from rlhf_core.algos.experience import Experience, SequenceBatch


def _experience() -> Experience:
    # 4 rows, T = 3, so per-token fields are (4, 2); row i holds values 10 * i + column so rows are easy to follow
    per_token = torch.tensor([[0.0, 1.0], [10.0, 11.0], [20.0, 21.0], [30.0, 31.0]])
    return Experience(
        input_ids=torch.arange(12).reshape(4, 3),
        attention_mask=torch.ones(4, 3, dtype=torch.long),
        action_mask=torch.tensor([[0, 1], [1, 1], [0, 1], [1, 1]]),
        old_logprobs=-per_token,
        ref_logprobs=None,  # no reference model
        values=per_token,
        scores=torch.tensor([0.5, 1.5, 2.5, 3.5]),
        truncated=torch.tensor([False, True, False, True]),
    )


def test_experience_split_keeps_shapes_and_none_fields():
    exp = _experience()
    assert exp.size == 4
    chunks = exp.split(3)
    # 4 rows in chunks of 3: rows 0-2, then row 3
    assert [c.size for c in chunks] == [3, 1]
    assert all(isinstance(c, Experience) for c in chunks)
    assert chunks[0].input_ids.shape == (3, 3) and chunks[0].values.shape == (3, 2) and chunks[0].scores.shape == (3,)
    assert chunks[1].values.tolist() == [[30.0, 31.0]] and chunks[1].truncated.tolist() == [True]
    assert all(c.ref_logprobs is None and c.advantages is None and c.returns is None for c in chunks)


def test_experience_shard_and_refusal_message():
    shards = _experience().shard(2)
    # 4 rows over 2 ranks: rows 0-1 and rows 2-3
    assert [s.scores.tolist() for s in shards] == [[0.5, 1.5], [2.5, 3.5]]
    assert [s.input_ids[:, 0].tolist() for s in shards] == [[0, 3], [6, 9]]
    assert shards[1].ref_logprobs is None
    with pytest.raises(AssertionError, match="Experience of 4 rows does not shard evenly over 3 ranks"):
        _experience().shard(3)


def test_experience_select_rows_reorders_every_field():
    picked = _experience().select_rows(torch.tensor([3, 1]))
    assert picked.input_ids.tolist() == [[9, 10, 11], [3, 4, 5]]
    assert picked.action_mask.tolist() == [[1, 1], [1, 1]]
    assert picked.old_logprobs.tolist() == [[-30.0, -31.0], [-10.0, -11.0]]
    assert picked.scores.tolist() == [3.5, 1.5] and picked.truncated.tolist() == [True, True]
    assert picked.ref_logprobs is None


def test_with_advantages_returns_a_new_experience():
    exp = _experience()
    advantages, returns = torch.ones(4, 2), torch.full((4, 2), 2.0)
    done = exp.with_advantages(advantages, returns)
    assert exp.advantages is None and exp.returns is None  # the original is not mutated
    assert done.advantages is advantages and done.returns is returns and done.values is exp.values
    # the new fields split like the others: rows 2-3 of the second shard
    assert done.shard(2)[1].returns.tolist() == [[2.0, 2.0], [2.0, 2.0]]


def test_from_sequences_and_sequences_round_trip():
    seq = SequenceBatch(
        input_ids=torch.tensor([[1, 5, 2]]), attention_mask=torch.ones(1, 3), action_mask=torch.tensor([[0, 1]])
    )
    zeros = torch.zeros(1, 2)
    exp = Experience.from_sequences(seq, old_logprobs=zeros, values=zeros, scores=torch.ones(1))
    assert exp.ref_logprobs is None and exp.truncated is None
    back = exp.sequences()
    assert type(back) is SequenceBatch and back.input_ids is seq.input_ids
    assert set(back.tensors()) == {"input_ids", "attention_mask", "action_mask"}


def test_batches_refuse_mismatched_shapes():
    exp = _experience()
    with pytest.raises(ValueError, match="disagree on the number of rows"):
        Experience(**{**exp.tensors(), "scores": torch.zeros(3)})
    with pytest.raises(ValueError, match=r"Experience.values must be \(4, 2\), got \(4, 3\)"):
        Experience(**{**exp.tensors(), "values": torch.zeros(4, 3)})
    with pytest.raises(ValueError, match="action_mask"):
        SequenceBatch(input_ids=torch.zeros(2, 3), attention_mask=torch.zeros(2, 3), action_mask=torch.zeros(2, 3))


def test_a_shard_travels_without_the_rest_of_the_batch():
    """What a Ray worker receives is the pickled shard (Ray pickles torch tensors with their storage): 10 rows of a
    1000-row batch, not the whole batch a view would drag along."""
    import pickle

    from rlhf_core.algos.batching import make_sequences

    seq = make_sequences([[1] * 500] * 1000, [[2] * 500] * 1000, 0)
    assert seq.attention_mask.dtype == torch.bool and seq.action_mask.dtype == torch.bool
    shard = seq.shard(100)[3]
    assert torch.equal(shard.input_ids, seq.input_ids[30:40])
    # 10 x 1000 ids x 8 bytes + 10 x (1000 + 999) mask bytes = 99,990 bytes of data.
    size = len(pickle.dumps(shard))
    assert 99_990 <= size < 110_000, size
    # The view of the same rows pickles the whole batch: 1000 x 1000 x 8 + masks, about 10 MB.
    assert len(pickle.dumps(seq.split(10)[3])) > 9_000_000
