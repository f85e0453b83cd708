"""Prompt formatting and tokenization of SFT, preference (reward model, DPO) and KTO rows; refusal of bad rows."""

import json

import pytest

from rlhf_core.config import DataSource, KTOData, PreferenceData, SFTData
from rlhf_core.data.examples import (
    encode,
    kto_examples,
    preference_examples,
    render_prompt,
    sft_examples,
    split_hh,
)
from rlhf_core.data.loading import DataError
from rlhf_core.models.builders import load_tokenizer


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("builtin:tiny")


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_chat_template_template_string_and_plain(tok):
    cfg = DataSource(train_path="x")
    assert render_prompt("hi", tok, cfg) == "<|user|>hi\n<|assistant|>"
    cfg_t = DataSource(train_path="x", input_template="User: {}\nAssistant: ")
    assert render_prompt("hi", tok, cfg_t) == "User: hi\nAssistant: "
    cfg_plain = DataSource(train_path="x", apply_chat_template=False)
    assert render_prompt("hi", tok, cfg_plain) == "hi"
    messages = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"},
    ]
    assert render_prompt(messages, tok, cfg) == "<|user|>a\n<|assistant|>b<|eos|>\n<|user|>c\n<|assistant|>"


def test_a_prompt_template_wraps_the_question_inside_the_chat_template(tok):
    """``prompt_template`` words the question (an instruction after it, say) and the chat template still applies;
    in a message list only the last user message is worded; with input_template too, both apply in that order."""
    cfg = DataSource(train_path="x", prompt_template="{} Answer with just the number.")
    assert render_prompt("2 + 2?", tok, cfg) == "<|user|>2 + 2? Answer with just the number.\n<|assistant|>"
    messages = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"},
    ]
    worded = "<|user|>a\n<|assistant|>b<|eos|>\n<|user|>c Answer with just the number.\n<|assistant|>"
    assert render_prompt(messages, tok, cfg) == worded
    assert messages[2]["content"] == "c"  # the row itself is left as it was
    both = DataSource(train_path="x", prompt_template="Q: {}", input_template="{}\nA:")
    assert render_prompt("hi", tok, both) == "Q: hi\nA:"


def test_split_hh_cuts_before_the_last_assistant_turn():
    text = "\n\nHuman: hi\n\nAssistant: hello\n\nHuman: more?\n\nAssistant: sure thing"
    prompt, response = split_hh(text, "f row 1")
    assert prompt == "\n\nHuman: hi\n\nAssistant: hello\n\nHuman: more?\n\nAssistant:"
    assert response == " sure thing"
    with pytest.raises(DataError, match="f row 2"):
        split_hh("no turns here", "f row 2")


def test_sft_examples_mask_prompt_and_end_with_eos(tmp_path, tok):
    path = write_jsonl(tmp_path / "sft.jsonl", [{"input": "Say hi.", "output": "The dog is good."}])
    (ex,) = sft_examples(SFTData(train_path=path), tok)
    prompt_ids = tok("<|user|>Say hi.\n<|assistant|>")["input_ids"]
    assert ex["input_ids"][: len(prompt_ids)] == prompt_ids and prompt_ids[0] == tok.bos_token_id
    assert ex["input_ids"][-1] == tok.eos_token_id
    assert ex["loss_mask"] == [0] * len(prompt_ids) + [1] * (len(ex["input_ids"]) - len(prompt_ids))
    assert tok.decode(ex["input_ids"][len(prompt_ids) : -1]) == "The dog is good."


def test_hh_style_sft_and_preferences(tmp_path, tok):
    hh = "\n\nHuman: Say hi.\n\nAssistant: hello there"
    sft_path = write_jsonl(tmp_path / "hh.jsonl", [{"text": hh}])
    (ex,) = sft_examples(SFTData(train_path=sft_path, input_key="text", output_key=None), tok)
    n_prompt = ex["loss_mask"].index(1)
    assert tok.decode(ex["input_ids"][n_prompt:-1]) == " hello there"
    pref_path = write_jsonl(tmp_path / "p.jsonl", [{"chosen": hh, "rejected": "\n\nHuman: Say hi.\n\nAssistant: no"}])
    (pair,) = preference_examples(PreferenceData(train_path=pref_path, prompt_key=None), tok)
    assert tok.decode(pair["rejected_ids"], skip_special_tokens=True).endswith("Assistant: no")


def test_long_response_is_truncated_but_long_prompt_is_refused(tmp_path, tok):
    ids, prompt_len = encode(tok, "hi", "word " * 100, max_len=16, where="w")
    assert len(ids) == 16 and prompt_len == len(tok("hi")["input_ids"])
    path = write_jsonl(
        tmp_path / "long.jsonl", [{"input": "ok", "output": "ok"}, {"input": "word " * 50, "output": "x"}]
    )
    with pytest.raises(DataError, match=r"long.jsonl row 2: the prompt has \d+ tokens but data.max_len is 16"):
        sft_examples(SFTData(train_path=path, max_len=16), tok)


def test_missing_key_names_file_row_and_key(tmp_path, tok):
    path = write_jsonl(
        tmp_path / "p.jsonl", [{"prompt": "a", "chosen": "b", "rejected": "c"}, {"prompt": "a", "chosen": "b"}]
    )
    with pytest.raises(DataError, match=r"p.jsonl.*row 2.*'rejected'"):
        preference_examples(PreferenceData(train_path=path), tok)


# ---------------------------------------------------------------------------------------------------------------------
# Preference pairs (reward model, DPO): prompt lengths and refusal of bad pairs

GOOD = {"prompt": "Say hi.", "chosen": "Hello there.", "rejected": "Go away."}
GOOD_HH = {"chosen": "\n\nHuman: hi\n\nAssistant: yes", "rejected": "\n\nHuman: hi\n\nAssistant: no"}


def prompt_of(tok, ids, prompt_len):
    """The text of the first ``prompt_len`` tokens, which start with BOS."""
    assert ids[0] == tok.bos_token_id
    return tok.decode(ids[:prompt_len]).removeprefix(tok.bos_token)


def test_preference_prompt_lens_mark_where_the_responses_start(tmp_path, tok):
    path = write_jsonl(tmp_path / "p.jsonl", [GOOD])
    (pair,) = preference_examples(PreferenceData(train_path=path), tok)
    prompt_ids = tok("<|user|>Say hi.\n<|assistant|>")["input_ids"]
    assert pair["chosen_prompt_len"] == pair["rejected_prompt_len"] == len(prompt_ids)
    assert pair["chosen_ids"][: len(prompt_ids)] == pair["rejected_ids"][: len(prompt_ids)] == prompt_ids
    assert tok.decode(pair["chosen_ids"][pair["chosen_prompt_len"] : -1]) == "Hello there."
    assert tok.decode(pair["rejected_ids"][pair["rejected_prompt_len"] : -1]) == "Go away."
    assert pair["chosen_ids"][-1] == pair["rejected_ids"][-1] == tok.eos_token_id


def test_hh_preference_prompt_lens_may_differ(tmp_path, tok):
    chosen = "\n\nHuman: Say hi.\n\nAssistant: hello there"
    rejected = "\n\nHuman: Say hi.\n\nAssistant: what?\n\nHuman: hi!\n\nAssistant: no"
    path = write_jsonl(tmp_path / "hh.jsonl", [{"chosen": chosen, "rejected": rejected}])
    (pair,) = preference_examples(PreferenceData(train_path=path, prompt_key=None), tok)
    assert pair["chosen_prompt_len"] < pair["rejected_prompt_len"]
    for side, text in (("chosen", chosen), ("rejected", rejected)):
        ids, n = pair[f"{side}_ids"], pair[f"{side}_prompt_len"]
        prompt, response = split_hh(text, "w")
        assert prompt_of(tok, ids, n) == prompt
        assert tok.decode(ids[n:-1]) == response


def test_message_list_preferences_give_prompt_lens(tmp_path, tok):
    conv = [{"role": "user", "content": "Say hi."}]
    row = {
        "chosen": conv + [{"role": "assistant", "content": "Hello."}],
        "rejected": conv + [{"role": "assistant", "content": "No."}],
    }
    path = write_jsonl(tmp_path / "m.jsonl", [row])
    (pair,) = preference_examples(PreferenceData(train_path=path, prompt_key=None), tok)
    prompt_ids = tok("<|user|>Say hi.\n<|assistant|>")["input_ids"]
    assert pair["chosen_prompt_len"] == len(prompt_ids) and pair["chosen_ids"][: len(prompt_ids)] == prompt_ids
    assert tok.decode(pair["chosen_ids"][len(prompt_ids) : -1]) == "Hello."


def _refused(path, cfg, tok, *fragments):
    """preference_examples and kto_examples (pairs) refuse ``path`` with one line naming each of ``fragments``."""
    for make in (preference_examples, kto_examples):
        with pytest.raises(DataError) as info:
            make(cfg, tok)
        message = str(info.value)
        assert "\n" not in message
        for fragment in (path, *fragments):
            assert fragment in message, (make.__name__, fragment, message)
    return message


def test_pair_missing_key_is_refused(tmp_path, tok):
    path = write_jsonl(tmp_path / "missing.jsonl", [GOOD, {"prompt": "a", "rejected": "c"}])
    _refused(path, KTOData(train_path=path), tok, "row 2", "'chosen'", "missing")


def test_pair_with_chosen_equal_to_rejected_is_refused(tmp_path, tok):
    path = write_jsonl(tmp_path / "same.jsonl", [GOOD, GOOD, {"prompt": "a", "chosen": "b c", "rejected": "b c"}])
    message = _refused(path, KTOData(train_path=path), tok, "row 3", "'chosen'", "'rejected'", "same text")
    assert "drop the row or fix it" in message
    hh = "\n\nHuman: hi\n\nAssistant: hello"
    path = write_jsonl(tmp_path / "same_hh.jsonl", [{"chosen": hh, "rejected": hh}])
    _refused(path, KTOData(train_path=path, prompt_key=None), tok, "row 1", "'chosen'", "'rejected'", "same")


def test_pair_identical_within_max_len_is_refused(tmp_path, tok):
    path = write_jsonl(
        tmp_path / "trunc.jsonl", [{"prompt": "a", "chosen": "word " * 40 + "yes", "rejected": "word " * 40}]
    )
    _refused(path, KTOData(train_path=path, max_len=16), tok, "row 1", "'chosen'", "'rejected'", "token ids")
    (pair,) = preference_examples(PreferenceData(train_path=path, max_len=512), tok)  # they differ when not truncated
    assert pair["chosen_ids"] != pair["rejected_ids"]


@pytest.mark.parametrize(
    "row, prompt_key, key",
    [
        ({"prompt": "a", "chosen": "b", "rejected": "   "}, "prompt", "rejected"),
        ({"prompt": "a", "chosen": "", "rejected": "c"}, "prompt", "chosen"),
        ({"chosen": "\n\nHuman: hi\n\nAssistant:  ", "rejected": "\n\nHuman: hi\n\nAssistant: no"}, None, "chosen"),
        (
            {
                "chosen": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yes"}],
                "rejected": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": " \n"}],
            },
            None,
            "rejected",
        ),
        (
            {"prompt": "hi", "chosen": [{"role": "assistant", "content": ""}], "rejected": "c"},
            "prompt",
            "chosen",
        ),
    ],
)
def test_pair_with_an_empty_response_is_refused(tmp_path, tok, row, prompt_key, key):
    path = write_jsonl(tmp_path / "empty.jsonl", [GOOD if prompt_key else GOOD_HH, row])
    _refused(path, KTOData(train_path=path, prompt_key=prompt_key), tok, "row 2", f"'{key}'")


def test_empty_response_message_suggests_the_fix(tmp_path, tok):
    path = write_jsonl(
        tmp_path / "e.jsonl", [{"chosen": "\n\nHuman: hi\n\nAssistant:", "rejected": "\n\nHuman: hi\n\nAssistant: x"}]
    )
    with pytest.raises(DataError, match=r"e\.jsonl row 1 key 'chosen': the response is empty; drop the row or fix it"):
        preference_examples(PreferenceData(train_path=path, prompt_key=None), tok)


# ---------------------------------------------------------------------------------------------------------------------
# KTO


def test_kto_from_pairs_gives_two_examples_per_pair(tmp_path, tok):
    rows = [
        {"prompt": "Say hi.", "chosen": "Hello.", "rejected": "No."},
        {"prompt": "Name a colour.", "chosen": "Blue.", "rejected": "Dog."},
    ]
    path = write_jsonl(tmp_path / "pairs.jsonl", rows)
    examples = kto_examples(KTOData(train_path=path), tok)
    assert [e["desirable"] for e in examples] == [True, False, True, False]
    responses = [tok.decode(e["input_ids"][e["prompt_len"] : -1]) for e in examples]
    assert responses == ["Hello.", "No.", "Blue.", "Dog."]
    prompts = [prompt_of(tok, e["input_ids"], e["prompt_len"]) for e in examples]
    assert prompts == ["<|user|>Say hi.\n<|assistant|>"] * 2 + ["<|user|>Name a colour.\n<|assistant|>"] * 2
    assert all(e["input_ids"][-1] == tok.eos_token_id for e in examples)
    assert {"input_ids", "prompt_len", "desirable", "kl_ids", "kl_prompt_len"} == set(examples[0])


def test_kto_kl_ids_pair_each_prompt_with_another_prompts_response(tmp_path, tok):
    rows = [
        {"q": "Say hi.", "a": "Hello.", "ok": True},
        {"q": "Say hi.", "a": "Go away.", "ok": 0},
        {"q": "Name a colour.", "a": "Blue.", "ok": 1},
        {"q": "Count to two.", "a": "One, two.", "ok": False},
    ]
    path = write_jsonl(tmp_path / "unpaired.jsonl", rows)
    cfg = KTOData(train_path=path, prompt_key="q", response_key="a", label_key="ok")
    examples = kto_examples(cfg, tok)
    assert [e["desirable"] for e in examples] == [True, False, True, False]
    # the next example, cyclically, with a different prompt: rows 0 and 1 share a prompt, so both take row 2's
    partner = [2, 2, 3, 0]
    for i, e in enumerate(examples):
        p = examples[partner[i]]
        assert e["kl_prompt_len"] == e["prompt_len"]
        assert e["kl_ids"][: e["kl_prompt_len"]] == e["input_ids"][: e["prompt_len"]]
        assert e["kl_ids"][e["kl_prompt_len"] :] == p["input_ids"][p["prompt_len"] :]
        assert e["kl_ids"][-1] == tok.eos_token_id
        mine = prompt_of(tok, e["input_ids"], e["prompt_len"])
        assert mine == f"<|user|>{rows[i]['q']}\n<|assistant|>"
        assert tok.decode(e["kl_ids"][e["kl_prompt_len"] : -1]) == rows[partner[i]]["a"] != rows[i]["a"]
        assert rows[partner[i]]["q"] != rows[i]["q"]


def test_kto_kl_ids_are_truncated_to_max_len(tmp_path, tok):
    rows = [{"prompt": "a", "response": "b", "label": True}, {"prompt": "c", "response": "word " * 50, "label": False}]
    path = write_jsonl(tmp_path / "long.jsonl", rows)
    first, second = kto_examples(KTOData(train_path=path, label_key="label", max_len=16), tok)
    assert len(first["kl_ids"]) == 16 and len(second["input_ids"]) == 16
    assert (
        first["kl_ids"][first["kl_prompt_len"] :]
        == second["input_ids"][second["prompt_len"] :][: 16 - first["kl_prompt_len"]]
    )


def test_kto_unpaired_transcripts_with_prompt_key_null(tmp_path, tok):
    rows = [
        {"text": "\n\nHuman: hi\n\nAssistant: hello", "label": True},
        {"text": [{"role": "user", "content": "bye"}, {"role": "assistant", "content": "ciao"}], "label": False},
    ]
    path = write_jsonl(tmp_path / "t.jsonl", rows)
    cfg = KTOData(train_path=path, prompt_key=None, response_key="text", label_key="label")
    first, second = kto_examples(cfg, tok)
    assert prompt_of(tok, first["input_ids"], first["prompt_len"]) == "\n\nHuman: hi\n\nAssistant:"
    assert tok.decode(first["input_ids"][first["prompt_len"] : -1]) == " hello"
    assert tok.decode(second["input_ids"][second["prompt_len"] : -1]) == "ciao"
    assert tok.decode(first["kl_ids"][first["kl_prompt_len"] : -1]) == "ciao"


@pytest.mark.parametrize("label", ["yes", 2, 0.5, None, "true", [True]])
def test_kto_unpaired_bad_label_is_refused(tmp_path, tok, label):
    rows = [{"prompt": "a", "response": "b", "label": True}, {"prompt": "c", "response": "d", "label": label}]
    path = write_jsonl(tmp_path / "labels.jsonl", rows)
    with pytest.raises(DataError) as info:
        kto_examples(KTOData(train_path=path, label_key="label"), tok)
    message = str(info.value)
    assert path in message and "row 2" in message and "'label'" in message and "true/false or 1/0" in message


def test_kto_unpaired_missing_label_or_empty_response_is_refused(tmp_path, tok):
    rows = [{"prompt": "a", "response": "b", "label": True}, {"prompt": "c", "response": "d"}]
    path = write_jsonl(tmp_path / "nolabel.jsonl", rows)
    with pytest.raises(DataError, match=r"nolabel\.jsonl row 2 key 'label': missing"):
        kto_examples(KTOData(train_path=path, label_key="label"), tok)
    rows = [{"prompt": "a", "response": "b", "label": True}, {"prompt": "c", "response": " ", "label": False}]
    path = write_jsonl(tmp_path / "noresp.jsonl", rows)
    with pytest.raises(DataError, match=r"noresp\.jsonl.*row 2.*'response'"):
        kto_examples(KTOData(train_path=path, label_key="label"), tok)
    rows = [{"text": "\n\nHuman: a\n\nAssistant: b", "label": 1}, {"text": "\n\nHuman: c\n\nAssistant:", "label": 0}]
    path = write_jsonl(tmp_path / "nohh.jsonl", rows)
    with pytest.raises(DataError, match=r"nohh\.jsonl row 2 key 'text': the response is empty"):
        kto_examples(KTOData(train_path=path, prompt_key=None, response_key="text", label_key="label"), tok)


def test_kto_needs_desirable_and_undesirable_examples(tmp_path, tok):
    rows = [{"prompt": "a", "response": "b", "label": 1}, {"prompt": "c", "response": "d", "label": True}]
    path = write_jsonl(tmp_path / "one_kind.jsonl", rows)
    with pytest.raises(DataError, match=r"one_kind\.jsonl: .*desirable.*KTO needs both desirable and undesirable"):
        kto_examples(KTOData(train_path=path, label_key="label"), tok)


def test_kto_needs_two_distinct_prompts(tmp_path, tok):
    rows = [{"prompt": "a", "response": "b", "label": 1}, {"prompt": "a", "response": "d", "label": 0}]
    path = write_jsonl(tmp_path / "one_prompt.jsonl", rows)
    with pytest.raises(DataError, match=r"one_prompt\.jsonl: .*KTO needs at least two distinct prompts"):
        kto_examples(KTOData(train_path=path, label_key="label"), tok)
    path = write_jsonl(tmp_path / "one_pair.jsonl", [GOOD, GOOD | {"rejected": "Never."}])
    with pytest.raises(DataError, match="at least two distinct prompts"):
        kto_examples(KTOData(train_path=path), tok)


def test_bundled_preference_data_still_loads(tok):
    for path in (
        "rlhf_core/assets/data/synthetic/pref_train.jsonl",
        "rlhf_core/assets/data/synthetic/pref_eval.jsonl",
        "tests/data/config_keys/pref.jsonl",
    ):
        cfg = KTOData(train_path=path, max_samples=200)
        pairs = preference_examples(cfg, tok)
        assert pairs and all(0 < p["chosen_prompt_len"] < len(p["chosen_ids"]) for p in pairs)
        examples = kto_examples(cfg, tok)
        assert len(examples) == 2 * len(pairs)
