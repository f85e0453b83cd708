"""bench.rollout's prompt set and batching (fast: no model, no vLLM)."""

from bench.rollout import FIRST_ID, fixed_batches, make_prompts, prompt_lengths, token_budget_batches


def test_prompt_lengths_are_mixed_and_seeded():
    lengths = prompt_lengths(128, 8, 96, seed=0)
    assert len(lengths) == 128 and min(lengths) >= 8 and max(lengths) <= 96
    assert min(lengths) < 24 and max(lengths) > 80 and len(set(lengths)) > 40  # spread over the range
    assert prompt_lengths(128, 8, 96, seed=0) == lengths
    assert prompt_lengths(128, 8, 96, seed=1) != lengths


def test_prompts_have_those_lengths_and_no_special_tokens():
    prompts = make_prompts(64, 1024, 8, 96, seed=3)
    assert [len(p) for p in prompts] == prompt_lengths(64, 8, 96, seed=3)
    assert all(FIRST_ID <= t < 1024 for p in prompts for t in p)
    assert make_prompts(64, 1024, 8, 96, seed=3) == prompts


def test_batches_cover_every_prompt_once_in_order():
    assert [list(b) for b in fixed_batches(10, 4)] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    lengths = prompt_lengths(128, 8, 96, seed=0)
    batches = token_budget_batches(lengths, budget=4096, max_seqs=256)
    assert [i for b in batches for i in b] == list(range(128))
    assert all(sum(lengths[i] for i in b) <= 4096 for b in batches)
    assert [len(b) for b in token_budget_batches([10] * 5, budget=100, max_seqs=2)] == [2, 2, 1]
    assert [len(b) for b in token_budget_batches([60, 50, 40], budget=100, max_seqs=8)] == [1, 2]
