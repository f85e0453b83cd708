"""Generated data sources (rlhf_core/data/generators.py): ``reasoning_gym:<task>?<options>`` in load_rows gives
the same rows for the same spec, a held-out split that shares no question with the train split, JSON-safe entries,
and one-line DataErrors naming the spec for bad specs."""

import json
import sys

import pytest

from rlhf_core.data.generators import generated_rows, rows_digest
from rlhf_core.data.loading import DataError, load_rows

SPEC = "reasoning_gym:chain_sum?size=40&seed=1&eval_size=10&min_terms=2&max_terms=2&max_digits=2"


def test_rows_hold_the_question_the_answer_and_the_json_safe_entry():
    rows = load_rows(SPEC)
    assert len(rows) == 40
    first = rows[0]
    assert sorted(first) == ["answer", "entry", "prompt"]
    # chain_sum's row 0 with seed 1: "4 - 1 =" (the options reach the task: two terms)
    assert first["prompt"].endswith("4 - 1 =") and first["answer"] == "3"
    assert first["entry"]["question"] == first["prompt"] and first["entry"]["answer"] == "3"
    assert first["entry"]["metadata"]["source_dataset"] == "chain_sum"
    assert first["entry"]["metadata"]["difficulty"]["num_terms"] == [2, 2]  # a tuple in reasoning-gym: now a list
    assert json.loads(json.dumps(rows)) == rows
    assert all(r["entry"]["metadata"]["num_terms"] == 2 for r in rows)


def test_the_same_spec_gives_the_same_rows_and_digest():
    rows = load_rows(SPEC)
    assert load_rows(SPEC) == rows and rows_digest(load_rows(SPEC)) == rows_digest(rows)
    other = load_rows(SPEC.replace("seed=1", "seed=2"))
    assert rows_digest(other) != rows_digest(rows)
    assert load_rows(SPEC, max_rows=5) == rows[:5]


def test_rows_digest_is_a_short_sha256_of_the_sorted_json():
    # sha256(b'[{"a":1,"b":"x"}]') (keys sorted, no spaces) begins a103829f0f464d42
    assert rows_digest([{"b": "x", "a": 1}]) == rows_digest([{"a": 1, "b": "x"}]) == "a103829f0f464d42"


def test_the_held_out_split_shares_no_question_with_the_train_split():
    train = {r["prompt"] for r in load_rows(SPEC)}
    held_out = load_rows(SPEC, split="test")  # "test": the data sections' default eval_split
    assert len(held_out) == 10 and not train & {r["prompt"] for r in held_out}
    assert load_rows(SPEC, split="eval") == held_out == load_rows(SPEC, split="validation")


def test_a_task_with_too_few_questions_for_a_held_out_split_is_refused():
    # one-digit sums of two terms: 10 * 10 * 2 signs = 200 questions at most, all drawn by 2000 train rows
    spec = "reasoning_gym:chain_sum?size=2000&eval_size=5&min_terms=2&max_terms=2&min_digits=1&max_digits=1"
    assert len(load_rows(spec)) == 2000
    with pytest.raises(DataError, match="every held-out question is also a train question"):
        load_rows(spec, split="test")


@pytest.mark.parametrize(
    ("spec", "split", "message"),
    [
        (
            "reasoning_gym:chain_summ",
            "train",
            r"no task 'chain_summ' \(e.g. chain_sum, decimal_chain_sum; \d+ tasks\)",
        ),
        ("reasoning_gym:chain_sum?colour=red", "train", "chain_sum has no option 'colour' .options: min_terms,"),
        ("reasoning_gym:chain_sum?size=abc", "train", r"size must be an integer >= 1 \(got 'abc'\)"),
        ("reasoning_gym:chain_sum?size=2.5", "train", r"size must be an integer >= 1 \(got 2.5\)"),
        ("reasoning_gym:chain_sum?eval_size=0", "test", r"eval_size must be an integer >= 1 \(got 0\)"),
        ("reasoning_gym:chain_sum?seed=true", "train", r"seed must be an integer >= 0 \(got True\)"),
        ("reasoning_gym:chain_sum?min_terms=0", "train", "reasoning-gym refused the options .AssertionError"),
        ("reasoning_gym:chain_sum?size=1&size=2", "train", "option 'size' is given twice"),
        ("reasoning_gym:chain_sum?size", "train", "the options are not a query string like size=1000&seed=1"),
        ("reasoning_gym:", "train", "no task name; write reasoning_gym:<task>"),
        ("reasoning_gym:chain_sum", "dev", "no split 'dev' .generated rows have train, test, eval, validation."),
    ],
)
def test_a_bad_spec_is_one_data_error_naming_it(spec, split, message):
    with pytest.raises(DataError, match=message) as caught:
        load_rows(spec, split=split)
    assert str(caught.value).startswith(f"{spec}: ") and "\n" not in str(caught.value)
    assert caught.value.source == spec


def test_without_reasoning_gym_the_error_says_to_run_make_setup(monkeypatch):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # import reasoning_gym now raises ImportError
    with pytest.raises(
        DataError, match=r"^reasoning_gym:chain_sum: reasoning-gym is not installed; run `make setup`$"
    ):
        load_rows("reasoning_gym:chain_sum")


def test_generated_rows_is_what_load_rows_returns():
    assert generated_rows(SPEC, "test") == load_rows(SPEC, split="test")
