"""The bundled verifiable rewards (rlhf_core/verifiers.py): math-verify and reasoning-gym scores on right, wrong and
tagged answers, and the worker pool's timeout: a row that hangs scores 0.0 without hanging the call, and the pool
works again after it."""

import threading
import time

import pytest

from rlhf_core import verifiers
from rlhf_core.data.generators import generated_rows
from tests import verifier_hooks

CHAIN_SUM = "reasoning_gym:chain_sum?size=4&seed=1&min_terms=2&max_terms=2&max_digits=1"
SLOW_LATEX = "$9^{9^{9^{9}}}$"  # math-verify evaluates the tower: over 40 s of big-integer work


def math(responses, labels):
    return verifiers.math_reward([""] * len(responses), responses, labels=labels)


def test_math_reward_right_and_wrong_answers_in_several_formats():
    responses = ["42", "41", "<answer>0.5</answer>", "\\frac{1}{2}", "3,000", "-7", "x = 17 + 25", ""]
    labels = [42, "42", "1/2", 0.5, 3000, "-7", 42, "42"]
    # 42 = 42; 41 != 42; 0.5 = 1/2; 1/2 = 0.5; "3,000" is 3000; -7 = -7; a restated expression is not an answer
    # (its last number, 25, is compared: a policy would learn to restate the question); nothing found
    assert math(responses, labels) == [1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0]


def test_math_reward_reads_the_last_answer_tag_else_what_math_verify_extracts():
    responses = [
        "17 + 25 = 42.",  # no tag: the last number, 42
        "The answer is 42",  # the last number: 42
        "The answer is 42. Note 17 is prime.",  # the last number, 17: a number after the answer costs the reward
        "<answer>41</answer> though the sum 17 + 25 is 42",  # the tag wins: 41
        "<answer>1</answer> no, <answer>42</answer>",  # the last tag: 42
        "<answer></answer> 42",  # an empty tag: nothing to compare, the 42 outside is not read
    ]
    assert math(responses, [42] * 6) == [1.0, 1.0, 0.0, 0.0, 1.0, 0.0]
    # the question restated, as a policy learns to do when an expression counts: its last number, 45, is not 63
    assert math(["To calculate 18 + 45, you simply add them together by", "\\boxed{63}"], [63, 63]) == [0.0, 1.0]


def test_math_reward_never_evaluates_an_operation_a_restated_question_is_not_its_answer():
    """math-verify evaluates what it parses: "18 + 45" alone (a bare formula), tagged or boxed, would equal 63. An
    equation's answer is its right side; a side that still holds an operation gives its last number."""
    responses = [
        "18 + 45",  # restated: its last number, 45
        "<answer>18+45</answer>",  # tagged: 45
        "\\boxed{18 + 45}",  # boxed: 45
        "18 + 45 = 63",  # the right side: 63
        "18 + 45 = \\boxed{63}",  # the right side, boxed: 63
        "2 \\times 3 + 57",  # LaTeX operations too: 57
        "\\frac{126}{2}",  # a fraction is a number, not an operation: 63
        "57 - 87 = -30",  # a negative answer on the right side: -30, not 63
    ]
    assert math(responses, [63] * 8) == [0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0, 0.0]
    assert math(["57 - 87 = -30", "-30"], [-30, -30]) == [1.0, 1.0]


def test_math_reward_takes_an_entry_label_and_refuses_missing_labels():
    assert math(["<answer>6</answer>"], [{"question": "1 + 5 =", "answer": "6", "metadata": {}}]) == [1.0]
    with pytest.raises(TypeError, match="missing 1 required keyword-only argument: 'labels'"):
        verifiers.math_reward([""], ["42"])
    with pytest.raises(ValueError, match="2 labels for 1 responses"):
        math(["42"], [42, 43])
    with pytest.raises(ValueError, match="row 2 has no label"):
        math(["42", "42"], [42, None])


def test_format_reward_wants_exactly_one_filled_answer_tag():
    responses = [
        "think... <answer>42</answer>",  # one tag with content: 1.0
        "<answer> 42 </answer> done",  # content around spaces: 1.0
        "<answer>  </answer>",  # blank content: 0.0
        "<answer>1</answer><answer>2</answer>",  # two tags: 0.0
        "<answer>42",  # not closed: 0.0
        "</answer>42<answer>",  # closed before opened: 0.0
        "42",  # no tag: 0.0
    ]
    assert verifiers.format_reward([""] * 7, responses) == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0]


def test_reasoning_gym_reward_uses_the_tasks_own_scorer():
    entry = generated_rows(CHAIN_SUM)[0]["entry"]  # "4 - 1 =", answer "3"
    assert entry["answer"] == "3"
    responses = ["<answer> 3 </answer>", " 3\n", "<answer>4</answer> 3", "The answer is 3", "<answer></answer>"]
    scores = verifiers.reasoning_gym_reward([""] * 5, responses, labels=[entry] * 5)
    # tag content "3": 1.0; whole response stripped "3": 1.0; tag "4": 0.0; chain_sum's scorer gives partial
    # credit len("3") / len("The answer is 3") = 1 / 15 when the answer holds the oracle; an empty tag: 0.0
    assert scores == pytest.approx([1.0, 1.0, 0.0, 1 / 15, 0.0])
    with pytest.raises(ValueError, match="label of row 1 is not a reasoning-gym entry .*label_key"):
        verifiers.reasoning_gym_reward([""], ["3"], labels=["3"])


def test_a_slow_row_times_out_scores_zero_and_the_pool_works_again():
    before = verifiers.COUNTS["timeouts"]
    math(["42"], [42])  # the pool is up
    pool = verifiers._POOLS[verifiers.MATH_VERIFY]
    pids = {w.proc.pid for w in pool.workers}
    start = time.monotonic()
    rows = [("42", SLOW_LATEX), ("42", "42")]
    assert verifiers.score_rows(verifiers._math_row, rows, verifiers.MATH_VERIFY, "test", timeout_s=1.0) == [0.0, 1.0]
    assert time.monotonic() - start < 30  # the tower alone runs for over 40 s
    assert verifiers.COUNTS["timeouts"] == before + 1
    assert len(pool.workers) == verifiers.POOL_SIZE and verifiers._POOLS[verifiers.MATH_VERIFY] is pool
    killed = pids - {w.proc.pid for w in pool.workers}
    assert len(killed) == 1  # the hung worker was replaced, the others kept
    assert math(["<answer>42</answer>", "43"], [42, 42]) == [1.0, 0.0]


def test_rows_that_raise_or_sleep_past_the_timeout_score_zero_and_are_counted():
    errors, timeouts = verifiers.COUNTS["errors"], verifiers.COUNTS["timeouts"]
    hooks = verifiers.MATH_VERIFY
    assert verifiers.score_rows(verifier_hooks.failing_row, [("bad row",)], hooks, "test") == [0.0]
    assert verifiers.COUNTS["errors"] == errors + 1
    rows = [(30.0,), (0.0,), (0.0,)]  # a row that sleeps past the timeout, then two quick ones
    assert verifiers.score_rows(verifier_hooks.sleep_row, rows, hooks, "test", timeout_s=1.0) == [0.0, 1.0, 1.0]
    assert verifiers.COUNTS["timeouts"] == timeouts + 1


def test_the_rewards_work_off_the_main_thread():
    out = {}

    def score():
        out["math"] = math(["<answer>1/2</answer>", "0.25"], ["0.5", "0.5"])
        out["format"] = verifiers.format_reward([""], ["<answer>x</answer>"])

    thread = threading.Thread(target=score)
    thread.start()
    thread.join(timeout=60)
    assert out == {"math": [1.0, 0.0], "format": [1.0]}


def test_math_gold_scores_one_row_as_math_reward_does():
    # the gold reward of a generate stage: one row, its label; "18 + 45 = 63" -> 63 equals "63"; 62 does not
    assert verifiers.math_gold("Calculate 18 + 45.", "18 + 45 = 63", "63") == 1.0
    assert verifiers.math_gold("Calculate 18 + 45.", "The answer is 62.", 63) == 0.0
