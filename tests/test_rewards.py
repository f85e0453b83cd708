"""Reward functions and the remote reward-model client, against a real loopback HTTP server (never a mock)."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlhf_core.config import ConfigError, redact_url
from rlhf_core.config.score import ScoreConfig
from rlhf_core.config.sections import ScoreRows
from rlhf_core.data.loading import DataError
from rlhf_core.data.synthetic import gold_reward
from rlhf_core.jobs import score
from rlhf_core.ports import free_port
from rlhf_core.remote_reward import RemoteRewardError, RemoteRewardModel
from rlhf_core.rewards import (
    Columns,
    call_gold,
    call_reward_fn,
    call_reward_fn_with_mask,
    gold_spec,
    load_reward_fn,
)
from tests.reward_server import gold_scores, serve

KEY = "ppo.remote_rm_url"
PROMPTS = ["Write about the garden.", [{"role": "user", "content": "hi"}], "Describe the river.", "x"]
RESPONSES = ["The garden is good and lovely.", "awful", "The river is bad.", ""]


# ---------------------------------------------------------------------------------------------------------------------
# Remote reward server


def test_remote_scores_match_the_gold_reward():
    with serve() as (url, server), RemoteRewardModel(url, KEY) as rm:
        got = rm.score(PROMPTS, RESPONSES)
    assert got == [gold_reward(p if isinstance(p, str) else json.dumps(p), r) for p, r in zip(PROMPTS, RESPONSES)]
    assert got == gold_scores(PROMPTS, RESPONSES) and any(v > 0 for v in got) and any(v < 0 for v in got)
    assert server.state.requests == 1 and server.state.batches == [4]


def test_remote_accepts_a_rewards_key_and_an_empty_batch():
    with serve(answer_key="rewards") as (url, server):
        rm = RemoteRewardModel(url, KEY)
        assert rm.score(PROMPTS[:2], RESPONSES[:2]) == gold_scores(PROMPTS[:2], RESPONSES[:2])
        assert rm.score([], []) == []
        assert server.state.requests == 1


def test_remote_batch_size_splits_requests():
    with serve() as (url, server):
        rm = RemoteRewardModel(url, KEY, batch_size=3)
        prompts, responses = PROMPTS * 2, RESPONSES * 2  # 8 rows -> 3 + 3 + 2
        assert rm.score(prompts, responses) == gold_scores(prompts, responses)
    assert server.state.requests == 3 and server.state.batches == [3, 3, 2]


def test_remote_check_probes_one_row():
    with serve() as (url, server):
        RemoteRewardModel(url, KEY).check()
        assert server.state.batches == [1]
    with serve(fail_status=500, fail_body="boom") as (url, _), pytest.raises(RemoteRewardError, match="HTTP 500"):
        RemoteRewardModel(url, KEY, retries=0).check()


def test_remote_503_is_retried_then_reported_with_status_tries_and_body():
    with serve(fail_status=503) as (url, server):
        rm = RemoteRewardModel(url, KEY, retries=2, backoff_s=0.1)
        t0 = time.monotonic()
        with pytest.raises(RemoteRewardError) as e:
            rm.score(PROMPTS, RESPONSES)
        elapsed = time.monotonic() - t0
    msg = str(e.value)
    assert msg == f"'{KEY}': the reward server {url} answered HTTP 503 after 3 tries: overloaded"
    assert server.state.requests == 3  # retries + 1
    assert elapsed >= 0.2  # urllib3's backoff: 0 before the first retry, 2 * 0.1 before the second


def test_remote_transient_failures_recover():
    with serve(fail_status=502, fail_first=2) as (url, server):
        rm = RemoteRewardModel(url, KEY, retries=3, backoff_s=0.01)
        assert rm.score(PROMPTS, RESPONSES) == gold_scores(PROMPTS, RESPONSES)
    assert server.state.requests == 3


def test_remote_client_error_is_not_retried_and_the_body_is_cut():
    rm_error = pytest.raises(RemoteRewardError, match=r"HTTP 400 after 1 try: no no")
    with serve(fail_status=400, fail_body="no " * 500) as (url, server), rm_error as e:
        RemoteRewardModel(url, KEY, retries=3, backoff_s=0.01).score(PROMPTS, RESPONSES)
    assert server.state.requests == 1
    assert "\n" not in str(e.value) and len(str(e.value)) < 200 + len(url) + 100


def test_remote_connection_refused_names_the_url_and_tries():
    url = f"http://127.0.0.1:{free_port()}/score"
    rm = RemoteRewardModel(url, KEY, retries=1, backoff_s=0.01)
    with pytest.raises(RemoteRewardError) as e:
        rm.score(PROMPTS, RESPONSES)
    msg = str(e.value)
    assert msg.startswith(f"'{KEY}': the reward server {url} failed after 2 tries: cannot connect")
    assert "ConnectionRefusedError" in msg and "\n" not in msg


def test_remote_timeout_is_an_error():
    with serve(delay_s=1.0) as (url, server):
        rm = RemoteRewardModel(url, KEY, timeout_s=0.2, retries=1, backoff_s=0.01)
        t0 = time.monotonic()
        with pytest.raises(RemoteRewardError, match=r"failed after 2 tries: timed out \(timeout 0.2s\)"):
            rm.score(PROMPTS, RESPONSES)
        assert time.monotonic() - t0 < 1.5
        assert server.state.requests == 2


@pytest.mark.parametrize(
    "options, message",
    [
        ({"extra_scores": 1}, "answered 5 scores for 4 rows"),
        ({"extra_scores": -1}, "answered 3 scores for 4 rows"),
        ({"raw_body": b"<html>oops</html>"}, "answered HTTP 200 with non-JSON: <html>oops</html>"),
        (
            {"raw_body": b'{"score": [1, 2, 3, 4]}'},
            "answered JSON without 'scores' (or 'rewards'): got keys ['score']",
        ),
        ({"raw_body": b"[1, 2, 3, 4]"}, "without 'scores' (or 'rewards'): got list"),
        ({"raw_body": b'{"scores": [1, 2, "3", 4]}'}, "answered '3' for row 3, not a number"),
        ({"raw_body": b'{"scores": [1, 2, true, 4]}'}, "answered True for row 3, not a number"),
        ({"raw_body": b'{"scores": [1, NaN, 3, 4]}'}, "answered nan for row 2: scores must be finite"),
        ({"raw_body": b'{"scores": {"a": 1}}'}, "answered 'scores' = dict, not a list"),
    ],
)
def test_remote_bad_answers_are_errors_never_zeros(options, message):
    with serve(**options) as (url, _), pytest.raises(RemoteRewardError) as e:
        RemoteRewardModel(url, KEY, retries=0).score(PROMPTS, RESPONSES)
    assert str(e.value).startswith(f"'{KEY}': the reward server {url} ") and message in str(e.value)


def test_redact_url_hides_credentials_and_query():
    assert redact_url("http://user:pw@host:8080/score?token=abc#frag") == "http://host:8080/score"
    assert redact_url("https://rm.example.com/v1/score") == "https://rm.example.com/v1/score"
    assert redact_url("http://[::1]:9000/x?k=v") == "http://[::1]:9000/x"
    assert "pw" not in redact_url("http://user:pw@host:notaport/x?token=abc") and "abc" not in redact_url(
        "http://user:pw@host:notaport/x?token=abc"
    )


def test_secrets_in_the_url_never_appear_in_errors():
    secret_pw, secret_token = "hunter2secret", "tok-s3cr3t-value"
    port = free_port()
    url = f"http://alice:{secret_pw}@127.0.0.1:{port}/score?token={secret_token}"
    rm = RemoteRewardModel(url, KEY, retries=0)
    assert secret_pw not in repr(rm) and secret_token not in repr(rm)
    with pytest.raises(RemoteRewardError) as e:
        rm.score(PROMPTS, RESPONSES)
    assert f"http://127.0.0.1:{port}/score" in str(e.value)
    for text in (str(e.value), repr(e.value)):
        assert secret_pw not in text and secret_token not in text and "alice" not in text
    # a server that echoes the query string in its error body: redacted too
    with serve(fail_status=500, fail_body=f"bad token={secret_token}") as (plain, server):
        rm = RemoteRewardModel(
            plain.replace("http://", f"http://alice:{secret_pw}@") + f"?token={secret_token}", KEY, retries=0
        )
        with pytest.raises(RemoteRewardError, match="HTTP 500") as e:
            rm.score(PROMPTS, RESPONSES)
        assert server.state.paths == [f"/score?token={secret_token}"]  # the real URL was used
    assert secret_token not in str(e.value) and secret_pw not in str(e.value)


def test_remote_client_is_picklable_and_refuses_bad_settings():
    with serve() as (url, _):
        rm = RemoteRewardModel(url, KEY)
        rm.score(PROMPTS[:1], RESPONSES[:1])
        copy = pickle.loads(pickle.dumps(rm))
        assert copy.score(PROMPTS, RESPONSES) == gold_scores(PROMPTS, RESPONSES)
    with pytest.raises(ConfigError, match=f"'{KEY}' = 'ftp://h/x' is not an http"):
        RemoteRewardModel("ftp://u:p@h/x?t=1", KEY)
    with pytest.raises(ConfigError, match="timeout must be > 0"):
        RemoteRewardModel("http://h/x", KEY, timeout_s=0)


def test_reward_server_runs_as_a_script_and_restarts_on_the_same_port():
    script = Path(__file__).with_name("reward_server.py")
    port = free_port()
    for _ in range(2):  # killed, then started again on the same port
        proc = subprocess.Popen([sys.executable, str(script), "--port", str(port)], stdout=subprocess.PIPE, text=True)
        try:
            assert proc.stdout is not None
            assert proc.stdout.readline().strip() == f"listening on http://127.0.0.1:{port}"
            rm = RemoteRewardModel(f"http://127.0.0.1:{port}/score", KEY, retries=0)
            assert rm.score(PROMPTS, RESPONSES) == gold_scores(PROMPTS, RESPONSES)
        finally:
            proc.kill()
            proc.wait(timeout=10)


# ---------------------------------------------------------------------------------------------------------------------
# Reward functions


def write_fn(tmp_path, body: str) -> str:
    path = tmp_path / "my_reward.py"
    path.write_text(body)
    return f"{path}:score"


def test_score_stage_uses_these_functions():
    assert score.load_reward_fn is load_reward_fn and score.call_reward_fn is call_reward_fn


def test_a_reward_fn_that_raises_names_file_function_and_exception(tmp_path):
    spec = write_fn(tmp_path, "def score(prompts, responses):\n    return [1 / 0 for _ in prompts]\n")
    fn = load_reward_fn(spec, "ppo.reward_fn")
    with pytest.raises(ConfigError) as e:
        call_reward_fn(fn, spec, "ppo.reward_fn", ["p"], ["r"])
    assert str(e.value) == f"'ppo.reward_fn' = {spec!r} raised ZeroDivisionError: division by zero"
    assert "my_reward.py:score" in str(e.value)
    with pytest.raises(ConfigError, match="raised ZeroDivisionError"):
        call_reward_fn_with_mask(fn, spec, "ppo.reward_fn", ["p"], ["r"])


def test_a_reward_fn_with_a_multiline_error_gives_one_line(tmp_path):
    spec = write_fn(tmp_path, "def score(prompts, responses):\n    raise ValueError('first\\nsecond')\n")
    with pytest.raises(ConfigError) as e:
        call_reward_fn(load_reward_fn(spec, "k"), spec, "k", ["p"], ["r"])
    assert str(e.value).endswith("raised ValueError: first second")


def test_a_reward_fn_returning_the_wrong_length_names_both_counts(tmp_path):
    spec = write_fn(tmp_path, "def score(prompts, responses):\n    return [0.5] * (len(prompts) - 1)\n")
    fn = load_reward_fn(spec, "ppo.reward_fn")
    with pytest.raises(ConfigError) as e:
        call_reward_fn(fn, spec, "ppo.reward_fn", ["a", "b", "c", "d"], ["w", "x", "y", "z"])
    assert str(e.value) == f"'ppo.reward_fn' = {spec!r} returned 3 scores for 4 rows"


def test_a_reward_fn_with_a_keep_mask(tmp_path):
    spec = write_fn(
        tmp_path,
        "def score(prompts, responses):\n"
        "    scores = [float(len(r)) for r in responses]\n"
        "    return {'scores': scores, 'keep': [s > 1 for s in scores]}\n",
    )
    fn = load_reward_fn(spec, "ppo.reward_fn")
    scores, keep = call_reward_fn_with_mask(fn, spec, "ppo.reward_fn", ["p", "q", "r"], ["a", "bbb", "cc"])
    assert scores == [1.0, 3.0, 2.0] and keep == [False, True, True]
    assert call_reward_fn(fn, spec, "ppo.reward_fn", ["p"], ["abc"]) == [3.0]
    # a plain list: no mask; a dict without keep: no mask
    assert call_reward_fn_with_mask(lambda p, r: [1, 2], "m:f", "k", ["a", "b"], ["c", "d"]) == ([1.0, 2.0], None)
    assert call_reward_fn_with_mask(lambda p, r: {"scores": [1]}, "m:f", "k", ["a"], ["c"]) == ([1.0], None)


@pytest.mark.parametrize(
    "returned, message",
    [
        ({"scores": [1.0, 2.0], "keep": [True]}, "returned 1 'keep' flags for 2 rows"),
        ({"scores": [1.0, 2.0], "keep": [True, 1]}, "returned 'keep' = 1 for row 2, not a bool"),
        ({"scores": [1.0, 2.0], "keep": None}, "returned 'keep' = NoneType, not a list of bools"),
        ({"scores": [1.0, 2.0], "mask": [True, True]}, "unknown keys 'mask' (allowed: 'scores', 'keep')"),
        ({"keep": [True, True]}, "returned a dict without 'scores'"),
        ({"scores": [1.0], "keep": [True, True]}, "returned 1 scores for 2 rows"),
        ({"scores": [1.0, float("inf")]}, "returned inf for row 2: scores must be finite"),
    ],
)
def test_bad_keep_masks_are_refused(returned, message):
    with pytest.raises(ConfigError, match="'ppo.reward_fn' = 'm:f'") as e:
        call_reward_fn_with_mask(lambda p, r: returned, "m:f", "ppo.reward_fn", ["p", "q"], ["a", "b"])
    assert message in str(e.value)


# ---------------------------------------------------------------------------------------------------------------------
# Labels and columns: what a reward function takes besides prompts and responses (TRL's convention)

ROWS = [
    {"prompt": "What is 2 + 3?", "label": "5", "columns": {"answer": "5", "level": 1}},
    {"prompt": "What is 4 + 4?", "label": "8", "columns": {"answer": "8", "level": 2}},
]


def test_a_reward_function_gets_labels_and_the_columns_it_names_one_per_sample():
    seen = {}

    def exact(prompts, responses, *, labels, level):
        seen.update(prompts=prompts, labels=labels, level=level)
        return [float(r.strip() == lb) for r, lb in zip(responses, labels)]

    columns = Columns.of(ROWS, "ppo.data.label_key").expanded(2)  # 2 samples per prompt
    prompts = [r["prompt"] for r in ROWS for _ in range(2)]
    scores = call_reward_fn(exact, "m:exact", "ppo.reward_fn", prompts, ["5", "6", " 8", "9"], columns)
    assert scores == [1.0, 0.0, 1.0, 0.0]
    assert seen["labels"] == ["5", "5", "8", "8"] and seen["level"] == [1, 1, 2, 2]
    assert seen["prompts"] == prompts


def test_a_reward_function_with_kwargs_gets_every_column_and_the_two_argument_form_none():
    got = {}

    def everything(prompts, responses, **columns):
        got.update(columns)
        return [0.0] * len(prompts)

    columns = Columns.of(ROWS, "ppo.data.label_key")
    call_reward_fn(everything, "m:f", "ppo.reward_fn", ["a", "b"], ["", ""], columns)
    assert got == {"labels": ["5", "8"], "answer": ["5", "8"], "level": [1, 2]}
    assert call_reward_fn(lambda p, r: [1.0] * len(p), "m:g", "ppo.reward_fn", ["a", "b"], ["", ""], columns) == [
        1.0,
        1.0,
    ]


def test_a_reward_function_asking_for_a_missing_column_is_refused_naming_key_and_column():
    def wants_difficulty(prompts, responses, difficulty):
        return [0.0] * len(prompts)

    def wants_labels(prompts, responses, labels):
        return [0.0] * len(prompts)

    columns = Columns.of(ROWS, "ppo.data.label_key")
    with pytest.raises(ConfigError, match=r"'ppo.reward_fn' = 'm:f' takes the column 'difficulty', which the data "):
        call_reward_fn(wants_difficulty, "m:f", "ppo.reward_fn", ["a", "b"], ["", ""], columns)
    unlabelled = Columns.of([{"prompt": "a", "columns": {}}], "ppo.data.label_key")
    with pytest.raises(ConfigError, match=r"takes labels, but the data has none: set 'ppo.data.label_key'"):
        call_reward_fn(wants_labels, "m:f", "ppo.reward_fn", ["a"], [""], unlabelled)
    # an optional parameter the data lacks is left at its default
    assert call_reward_fn(lambda p, r, extra=2.0: [extra] * len(p), "m:h", "k", ["a"], [""], unlabelled) == [2.0]


def test_the_remote_server_receives_the_labels_of_each_row_in_batches():
    with serve() as (url, server):
        rm = RemoteRewardModel(url, KEY, batch_size=3)
        labels = ["5", {"answer": 8}, 3, "x"]
        assert rm.score(PROMPTS, RESPONSES, labels) == gold_scores(PROMPTS, RESPONSES)
        rm.score(PROMPTS[:1], RESPONSES[:1])  # no labels: none sent
        rm.check(["first"])  # the probe sends the first label
    assert server.state.labels == [["5", {"answer": 8}, 3], ["x"], None, ["first"]]


def test_the_score_stage_passes_each_rows_label_and_refuses_rows_without_one(tmp_path):
    path = tmp_path / "rows.jsonl"
    rows = [{"prompt": "2+3?", "response": "5", "answer": "5"}, {"prompt": "4+4?", "response": "9", "answer": "8"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = ScoreConfig(data=ScoreRows(train_path=str(path), label_key="answer"), reward_fn="m:f")
    loaded = score.load_scored_rows(cfg, "score", None)
    columns = score.row_columns(loaded, cfg, "score")
    assert columns.labels == ["5", "8"] and list(columns.values) == ["answer"]  # prompt and response are not columns

    def exact(prompts, responses, labels):
        return [float(r == lb) for r, lb in zip(responses, labels)]

    assert call_reward_fn(exact, "m:f", "score.reward_fn", ["2+3?", "4+4?"], ["5", "9"], columns) == [1.0, 0.0]
    path.write_text(json.dumps(rows[0]) + "\n" + json.dumps({"prompt": "4+4?", "response": "9"}) + "\n")
    with pytest.raises(DataError, match=r"row 2.*'answer'.*missing"):
        score.load_scored_rows(cfg, "score", None)


def test_the_gold_reward_gets_the_label_and_auto_is_the_bundled_rule_on_the_bundled_data_only(tmp_path):
    def by_label(prompt, response, label):
        return float(response == label)

    assert call_gold(by_label, ["q1", [{"role": "user", "content": "q2"}]], ["5", "7"], ["5", "8"]) == [1.0, 0.0]
    assert call_gold(lambda p, r: len(r), ["q"], ["abc"], ["label ignored"]) == [3.0]
    bundled = "rlhf_core/assets/data/synthetic/prompts_train.jsonl"
    assert gold_spec("auto", bundled) == "rlhf_core.data.synthetic:gold_reward"
    assert gold_spec("auto", str(tmp_path / "mine.jsonl")) is None
    assert (
        gold_spec("auto", "s3://bucket/prompts.jsonl") is None and gold_spec("auto", "reasoning_gym:chain_sum") is None
    )
    assert gold_spec("my.module:gold", str(tmp_path / "mine.jsonl")) == "my.module:gold"
    assert gold_spec(None, bundled) is None
