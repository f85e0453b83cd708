"""The engines' log-probs placed on the action tokens, and their largest gap to the actor's, by hand."""

import math

import pytest
import torch

from rlhf_core.algos.batching import make_sequences
from rlhf_core.algos.experience import Experience
from rlhf_core.algos.logprob_gap import engine_logprob_tensor, rollout_logprob_gap


def two_rollouts() -> Experience:
    # prompts of 2 and 1 tokens, responses of 2 and 3: T = 4, action positions row 0: 1, 2; row 1: 0, 1, 2
    seq = make_sequences([[1, 2], [3]], [[4, 5], [6, 7, 8]], pad_id=0)
    old = torch.tensor([[0.0, -1.0, -2.0], [-0.5, -0.25, -3.0]])
    return Experience.from_sequences(seq, old_logprobs=old, scores=torch.zeros(2))


def test_engine_logprobs_sit_on_the_action_tokens_and_nan_elsewhere():
    exp = two_rollouts()
    assert exp.action_mask.tolist() == [[0, 1, 1], [1, 1, 1]]
    engine = engine_logprob_tensor(exp, [[-1.5, -2.0], [-0.5, -0.75, -3.0]])
    assert math.isnan(engine[0, 0].item())
    assert engine[0, 1:].tolist() == [-1.5, -2.0] and engine[1].tolist() == [-0.5, -0.75, -3.0]
    with pytest.raises(ValueError, match="response 0: 1 engine log-probs for 2 action tokens"):
        engine_logprob_tensor(exp, [[-1.0], [-0.5, -0.75, -3.0]])


def test_the_gap_is_the_largest_difference_on_comparable_tokens():
    exp = two_rollouts()
    engine = engine_logprob_tensor(exp, [[-1.5, -2.0], [-0.5, -0.75, -3.0]])
    # |-1.5 - -1.0| = 0.5, |-0.75 - -0.25| = 0.5, the rest 0: max 0.5
    assert rollout_logprob_gap(exp, engine) == 0.5
    engine[0, 1] = float("nan")  # a token the engine did not report is skipped
    assert rollout_logprob_gap(exp, engine) == 0.5
    assert rollout_logprob_gap(exp, torch.full_like(engine, float("nan"))) == 0.0
