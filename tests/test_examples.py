"""Prompt formatting and tokenization of SFT and preference rows, and their refusal of bad rows."""

import json

import pytest

from rlhf_core.config import DataConfig
from rlhf_core.data.examples import encode, preference_examples, render_prompt, sft_examples, split_hh
from rlhf_core.data.loading import DataError
from rlhf_core.models.builders import load_tokenizer


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("builtin:tiny")


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_chat_template_template_string_and_plain(tok):
    cfg = DataConfig(train_path="x")
    assert render_prompt("hi", tok, cfg) == "<|user|>hi\n<|assistant|>"
    cfg_t = DataConfig(train_path="x", input_template="User: {}\nAssistant: ")
    assert render_prompt("hi", tok, cfg_t) == "User: hi\nAssistant: "
    cfg_plain = DataConfig(train_path="x", apply_chat_template=False)
    assert render_prompt("hi", tok, cfg_plain) == "hi"
    messages = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"},
    ]
    assert render_prompt(messages, tok, cfg) == "<|user|>a\n<|assistant|>b<|eos|>\n<|user|>c\n<|assistant|>"


def test_split_hh_cuts_before_the_last_assistant_turn():
    text = "\n\nHuman: hi\n\nAssistant: hello\n\nHuman: more?\n\nAssistant: sure thing"
    prompt, response = split_hh(text, "f row 1")
    assert prompt == "\n\nHuman: hi\n\nAssistant: hello\n\nHuman: more?\n\nAssistant:"
    assert response == " sure thing"
    with pytest.raises(DataError, match="f row 2"):
        split_hh("no turns here", "f row 2")


def test_sft_examples_mask_prompt_and_end_with_eos(tmp_path, tok):
    path = write_jsonl(tmp_path / "sft.jsonl", [{"input": "Say hi.", "output": "The dog is good."}])
    (ex,) = sft_examples(DataConfig(train_path=path), tok)
    prompt_ids = tok("<|user|>Say hi.\n<|assistant|>")["input_ids"]
    assert ex["input_ids"][: len(prompt_ids)] == prompt_ids and prompt_ids[0] == tok.bos_token_id
    assert ex["input_ids"][-1] == tok.eos_token_id
    assert ex["loss_mask"] == [0] * len(prompt_ids) + [1] * (len(ex["input_ids"]) - len(prompt_ids))
    assert tok.decode(ex["input_ids"][len(prompt_ids) : -1]) == "The dog is good."


def test_hh_style_sft_and_preferences(tmp_path, tok):
    hh = "\n\nHuman: Say hi.\n\nAssistant: hello there"
    sft_path = write_jsonl(tmp_path / "hh.jsonl", [{"text": hh}])
    (ex,) = sft_examples(DataConfig(train_path=sft_path, input_key="text", output_key=None), tok)
    n_prompt = ex["loss_mask"].index(1)
    assert tok.decode(ex["input_ids"][n_prompt:-1]) == " hello there"
    pref_path = write_jsonl(tmp_path / "p.jsonl", [{"chosen": hh, "rejected": "\n\nHuman: Say hi.\n\nAssistant: no"}])
    (pair,) = preference_examples(DataConfig(train_path=pref_path, prompt_key=None), tok)
    assert tok.decode(pair["rejected_ids"], skip_special_tokens=True).endswith("Assistant: no")


def test_long_response_is_truncated_but_long_prompt_is_refused(tmp_path, tok):
    ids, prompt_len = encode(tok, "hi", "word " * 100, max_len=16, where="w")
    assert len(ids) == 16 and prompt_len == len(tok("hi")["input_ids"])
    path = write_jsonl(
        tmp_path / "long.jsonl", [{"input": "ok", "output": "ok"}, {"input": "word " * 50, "output": "x"}]
    )
    with pytest.raises(DataError, match=r"long.jsonl row 2: the prompt has \d+ tokens but data.max_len is 16"):
        sft_examples(DataConfig(train_path=path, max_len=16), tok)


def test_missing_key_names_file_row_and_key(tmp_path, tok):
    path = write_jsonl(
        tmp_path / "p.jsonl", [{"prompt": "a", "chosen": "b", "rejected": "c"}, {"prompt": "a", "chosen": "b"}]
    )
    with pytest.raises(DataError, match=r"p.jsonl.*row 2.*'rejected'"):
        preference_examples(DataConfig(train_path=path), tok)
