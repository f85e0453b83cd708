import json
import statistics
from pathlib import Path

import pytest

from rlhf_core.data import synthetic
from rlhf_core.data.synthetic import (
    BUNDLED_DIR,
    FILE_NAMES,
    MIN_GOLD_GAP,
    bundled_path,
    generate,
    gold_reward,
)

SMALL = dict(n_sft=(300, 60), n_pref=(400, 100), n_prompts=(50, 20))


def _read(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    out = tmp_path_factory.mktemp("synthetic")
    paths = generate(out, seed=3, **SMALL)
    return {name: _read(p) for name, p in paths.items()}


@pytest.mark.parametrize(
    "response, expected",
    [
        # words: the, garden, is, good -> 1 positive, 0 negative, 4 words -> 1/4
        ("The garden is good.", 0.25),
        # the, river, is, sad, and, cruel -> 0 pos, 2 neg, 6 words -> -2/6
        ("The river is sad and cruel.", -2 / 6),
        # great, happy, bad -> (2 - 1) / 3
        ("Great, HAPPY... bad!", 1 / 3),
        # only neutral words -> 0 / 5
        ("The cat is a cat", 0.0),
        # no alphabetic words at all -> 0 / max(1, 0)
        ("123 !!!", 0.0),
        ("", 0.0),
        # every word positive -> 4 / 4
        ("good great kind calm", 1.0),
        # every word negative -> -2 / 2
        ("bad sad", -1.0),
        # "goodness" is not the word "good"; 1 neg (dark) of 3 words
        ("goodness dark night", -1 / 3),
        # digits split words: "good2bad" -> good, bad -> 0 / 2
        ("good2bad", 0.0),
    ],
)
def test_gold_reward_examples(response, expected):
    assert gold_reward("Write a sentence about the garden.", response) == pytest.approx(expected)


def test_gold_reward_ignores_prompt_and_is_bounded():
    r = "The dog is good and kind but sad."
    assert gold_reward("a", r) == gold_reward("Tell me about the dog.", r)
    # (2 - 1) / 8
    assert gold_reward("", r) == pytest.approx(1 / 8)


def test_lexicons_disjoint():
    groups = [set(synthetic.POSITIVE), set(synthetic.NEGATIVE), set(synthetic.NEUTRAL), set(synthetic.TOPICS)]
    for i in range(len(groups)):
        for j in range(i + 1, len(groups)):
            assert not groups[i] & groups[j]
    assert len(synthetic.POSITIVE) >= 25 and len(synthetic.NEGATIVE) >= 25


def test_generate_deterministic(tmp_path):
    a = generate(tmp_path / "a", seed=5, **SMALL)
    b = generate(tmp_path / "b", seed=5, **SMALL)
    c = generate(tmp_path / "c", seed=6, **SMALL)
    assert set(a) == set(FILE_NAMES)
    for name in a:
        assert a[name].read_bytes() == b[name].read_bytes(), name
    assert a["sft_train"].read_bytes() != c["sft_train"].read_bytes()


def test_row_counts_and_keys(small):
    assert len(small["sft_train"]) == 300 and len(small["sft_eval"]) == 60
    assert len(small["pref_train"]) == 400 and len(small["pref_eval"]) == 100
    assert len(small["prompts_train"]) == 50 and len(small["prompts_eval"]) == 20
    for r in small["sft_train"] + small["sft_eval"]:
        assert set(r) == {"input", "output"}
    for r in small["pref_train"] + small["pref_eval"]:
        assert set(r) == {"prompt", "chosen", "rejected", "chosen_gold", "rejected_gold"}
    for r in small["prompts_train"] + small["prompts_eval"]:
        assert set(r) == {"prompt"}


def _topic(prompt):
    return prompt.rstrip(".").split(" the ", 1)[1].split()[0]


def test_responses_mention_topic_and_length(small):
    for r in small["sft_train"]:
        topic = _topic(r["input"])
        words = synthetic.tokenize_words(r["output"])
        assert topic in words
        assert 6 <= len(words) <= 12
    for r in small["pref_train"]:
        topic = _topic(r["prompt"])
        assert topic in synthetic.tokenize_words(r["chosen"])
        assert topic in synthetic.tokenize_words(r["rejected"])


def test_label_noise_train_only_and_gold_gap(small):
    train, ev = small["pref_train"], small["pref_eval"]
    swapped = sum(r["chosen_gold"] < r["rejected_gold"] for r in train)
    assert swapped == round(0.1 * len(train))
    assert all(r["chosen_gold"] > r["rejected_gold"] for r in ev)
    for r in train + ev:
        assert abs(r["chosen_gold"] - r["rejected_gold"]) >= MIN_GOLD_GAP - 1e-6
        assert r["chosen_gold"] == pytest.approx(gold_reward(r["prompt"], r["chosen"]), abs=1e-6)
        assert r["rejected_gold"] == pytest.approx(gold_reward(r["prompt"], r["rejected"]), abs=1e-6)


def test_label_noise_parameter(tmp_path):
    paths = generate(tmp_path, seed=1, n_sft=(1, 1), n_pref=(200, 10), n_prompts=(1, 1), label_noise=0.25)
    rows = _read(paths["pref_train"])
    assert sum(r["chosen_gold"] < r["rejected_gold"] for r in rows) == 50
    paths = generate(tmp_path, seed=1, n_sft=(1, 1), n_pref=(200, 10), n_prompts=(1, 1), label_noise=0.0)
    assert all(r["chosen_gold"] > r["rejected_gold"] for r in _read(paths["pref_train"]))


def test_sft_roughly_neutral(small):
    golds = [gold_reward(r["input"], r["output"]) for r in small["sft_train"]]
    assert abs(statistics.mean(golds)) < 0.05
    assert max(golds) < 1.0
    assert statistics.pstdev(golds) > 0.05  # there is variety to learn from


def test_eval_prompts_use_held_out_combos(small):
    def combos(prompts):
        out = set()
        for p in prompts:
            topic = _topic(p)
            for j, t in enumerate(synthetic.TEMPLATES):
                if t.format(topic=topic) == p:
                    out.add((synthetic.TOPICS.index(topic), j))
        assert len(out) > 0
        return out

    train = combos(
        [r["input"] for r in small["sft_train"]] + [r["prompt"] for r in small["pref_train"] + small["prompts_train"]]
    )
    ev = combos(
        [r["input"] for r in small["sft_eval"]] + [r["prompt"] for r in small["pref_eval"] + small["prompts_eval"]]
    )
    assert not train & ev
    assert all(synthetic.is_eval_combo(*c) for c in ev)


def test_bundled_path():
    assert bundled_path("sft_train") == str(BUNDLED_DIR / "sft_train.jsonl")
    assert bundled_path("pref_eval.jsonl") == str(BUNDLED_DIR / "pref_eval.jsonl")
    with pytest.raises(ValueError):
        bundled_path("nope")


@pytest.mark.parametrize("name", sorted(FILE_NAMES))
def test_bundled_assets_exist_with_format(name, small):
    path = Path(bundled_path(name))
    assert path.is_file(), f"{path} missing: run scripts/build_assets.py"
    rows = _read(path)
    expected = {
        "sft_train": 3000,
        "sft_eval": 300,
        "pref_train": 3000,
        "pref_eval": 300,
        "prompts_train": 1000,
        "prompts_eval": 200,
    }[name]
    assert len(rows) == expected
    keys = set(small[name][0])
    assert all(set(r) == keys for r in rows)


def test_bundled_matches_generator(tmp_path):
    # The committed files are exactly generate(seed=0) with default sizes.
    paths = generate(tmp_path, seed=0)
    for name, p in paths.items():
        assert p.read_bytes() == Path(bundled_path(name)).read_bytes(), name


def test_cli(tmp_path, capsys):
    assert synthetic.main(["--out", str(tmp_path), "--seed", "2"]) == 0
    for fname in FILE_NAMES.values():
        assert (tmp_path / fname).is_file()
    assert "sft_train" in capsys.readouterr().out
