"""Bad data files refused by the job's command line before any worker starts: exit 2, one ``error:`` line naming the
file, the row or line and the key (see conftest.refused)."""

import json

import pytest

from tests.conftest import ROOT

DPO = ROOT / "deployments" / "configs" / "tiny-dpo.yaml"
KTO = ROOT / "deployments" / "configs" / "tiny-kto.yaml"

SFT = {"input": "Say hi.", "output": "Hello."}
PAIR = {"prompt": "Say hi.", "chosen": "Hello.", "rejected": "Go away."}
U = {"role": "user", "content": "Say hi."}


def A(text):  # noqa: N802 - an assistant message
    return {"role": "assistant", "content": text}


def lines(*rows):
    return b"".join((r if isinstance(r, bytes) else json.dumps(r).encode()) + b"\n" for r in rows)


# (file name, bytes, match): SFT data (keys input/output)
SFT_CASES = {
    "duplicate key": (
        "d.jsonl",
        lines(SFT, b'{"input": "a", "output": "b", "output": "c"}'),
        r"d\.jsonl: line 2: key 'output': the key appears twice",
    ),
    "NaN": (
        "n.jsonl",
        lines(SFT, SFT, b'{"input": "a", "output": "b", "weight": NaN}'),
        r"n\.jsonl: line 3: key 'weight': value is NaN",
    ),
    "Infinity": (
        "i.json",
        b'[{"input": "a", "output": "b", "w": -Infinity}]',
        r"i\.json: row 1: key 'w': value is -Infinity",
    ),
    "bad byte": (
        "u.jsonl",
        lines(SFT, SFT) + b'{"in\xffput": "a"}\n',
        r"u\.jsonl: line 3: not valid UTF-8 \(byte 0xff at column 5\)",
    ),
    "malformed JSON line": ("m.jsonl", lines(SFT, b'{"input": "a",'), r"m\.jsonl: line 2: invalid JSON"),
    "non-object line": ("o.jsonl", lines(SFT, b"[1, 2]"), r"o\.jsonl: line 2: expected a JSON object"),
    "empty file": ("e.jsonl", b"\n\n", r"e\.jsonl: has no rows"),
    "missing key": ("k.jsonl", lines(SFT, {"input": "a"}), r"k\.jsonl: row 2: key 'output': missing"),
    "whitespace-only value": (
        "w.jsonl",
        lines(SFT, {"input": "a", "output": " \n\t"}),
        r"w\.jsonl: row 2: key 'output': value is an empty string",
    ),
    "number where text is expected": (
        "t.jsonl",
        lines(SFT, {"input": 42, "output": "b"}),
        r"t\.jsonl: row 2: key 'input': value is not a string or a list of messages \(got int 42\)",
    ),
    "dict where text is expected": (
        "t.jsonl",
        lines({"input": {"text": "a"}, "output": "b"}),
        r"t\.jsonl: row 1: key 'input': value is not a string .*got dict",
    ),
    "CSV with too many fields": (
        "c.csv",
        b"input,output\r\na,b\r\na,b,c\r\n",
        r"c\.csv: line 3: more fields than the header has columns \(2\)",
    ),
    "CSV with an empty cell": (
        "c.csv",
        b"input,output\na,b\na,\n",
        r"c\.csv: row 2: key 'output': value is an empty string",
    ),
    "wrong role": (
        "r.jsonl",
        lines(SFT, {"input": [{"role": "human", "content": "hi"}], "output": "b"}),
        r"r\.jsonl: row 2: key 'input': value message 1 has role 'human'; use one of system, user, assistant",
    ),
    "system not first": (
        "s.jsonl",
        lines({"input": [U, {"role": "system", "content": "x"}, U], "output": "b"}),
        r"s\.jsonl: row 1: key 'input': value message 2 is a system message after message 1",
    ),
    "two user messages in a row": (
        "uu.jsonl",
        lines({"input": [U, U], "output": "b"}),
        r"uu\.jsonl: row 1: key 'input': value message 2 is a second user message in a row",
    ),
    "empty content": (
        "ec.jsonl",
        lines({"input": [{"role": "user", "content": " "}], "output": "b"}),
        r"ec\.jsonl: row 1: key 'input': value message 1 \(user\) has empty content",
    ),
    "content not a string": (
        "cl.jsonl",
        lines({"input": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}], "output": "b"}),
        r"cl\.jsonl: row 1: key 'input': value message 1 has no string 'content' \(a list\)",
    ),
    "prompt ending with the answer": (
        "pa.jsonl",
        lines({"input": [U, A("x")], "output": "b"}),
        r"pa\.jsonl: row 1: key 'input': value message 2 is 'assistant'; a prompt ends with a user message",
    ),
}


@pytest.mark.parametrize("case", sorted(SFT_CASES))
def test_bad_sft_data_is_refused(tmp_path, refused, case):
    name, data, match = SFT_CASES[case]
    path = tmp_path / name
    path.write_bytes(data)
    refused("sft", f"sft.data.train_path={path}", match=match)


def test_transcript_without_the_answer_is_refused(tmp_path, refused):
    path = tmp_path / "h.jsonl"
    path.write_bytes(lines({"text": [U, A("a")]}, {"text": [U, A("a"), U]}))
    refused(
        "sft",
        f"sft.data.train_path={path}",
        "sft.data.input_key=text",
        "sft.data.output_key=null",
        match=r"h\.jsonl: row 2: key 'text': value message 3 is 'user'; the list must end with the assistant's answer",
    )


RM = "reward_model.model.name_or_path=builtin:tiny"

# (row 2 of a pair file, prompt_key, match)
PAIR_CASES = {
    "chosen equal to rejected, strings": ({**PAIR, "rejected": "Hello."}, "prompt", "the same text"),
    "chosen equal to rejected up to a trailing newline": (
        {**PAIR, "rejected": "Hello.\n"},
        "prompt",
        "the same text up to leading/trailing whitespace",
    ),
    "chosen equal to rejected, chat conversations": (
        {"chosen": [U, A("x")], "rejected": [U, A("x")]},
        "null",
        "the same text",
    ),
    "chosen equal to rejected, chat answers": (
        {"prompt": [U], "chosen": [A("x")], "rejected": [A("x")]},
        "prompt",
        "the same text",
    ),
    "chosen equal to rejected, HH": (
        {"chosen": "\n\nHuman: a\n\nAssistant: b", "rejected": "\n\nHuman: a\n\nAssistant: b"},
        "null",
        "the same text",
    ),
}


@pytest.mark.parametrize("case", sorted(PAIR_CASES))
def test_identical_pairs_are_refused_by_the_reward_model(tmp_path, refused, case):
    row, prompt_key, same = PAIR_CASES[case]
    good = PAIR if prompt_key != "null" else {"chosen": [U, A("Hello.")], "rejected": [U, A("No.")]}
    path = tmp_path / "p.jsonl"
    path.write_bytes(lines(good, row))
    refused(
        "reward_model",
        RM,
        f"reward_model.data.train_path={path}",
        f"reward_model.data.prompt_key={prompt_key}",
        match=rf"p\.jsonl row 2 keys 'chosen' and 'rejected': chosen and rejected are {same}, so the pair prefers "
        "nothing; drop the row or fix it",
    )


def test_chat_conversation_not_ending_with_the_answer_is_refused_by_the_reward_model(tmp_path, refused):
    path = tmp_path / "p.jsonl"
    path.write_bytes(lines({"chosen": [U, A("Hello.")], "rejected": [U, A("No."), U]}))
    refused(
        "reward_model",
        RM,
        f"reward_model.data.train_path={path}",
        "reward_model.data.prompt_key=null",
        match=r"p\.jsonl: row 1: key 'rejected': value message 3 is 'user'; the list must end with the assistant's",
    )


def test_bad_eval_file_is_refused_by_the_reward_model(tmp_path, refused):
    train, held_out = tmp_path / "train.jsonl", tmp_path / "eval.jsonl"
    train.write_bytes(lines(PAIR, {**PAIR, "prompt": "Name a colour."}))
    held_out.write_bytes(lines(PAIR, b'{"prompt": "a", "chosen": "b", "rejected": "c", "rejected": "d"}'))
    refused(
        "reward_model",
        RM,
        f"reward_model.data.train_path={train}",
        f"reward_model.data.eval_path={held_out}",
        match=r"eval\.jsonl: line 2: key 'rejected': the key appears twice",
    )


def test_identical_pair_is_refused_by_dpo(tmp_path, refused):
    path = tmp_path / "p.jsonl"
    path.write_bytes(lines(PAIR, {"prompt": [U], "chosen": [U, A("x")], "rejected": [A("x")]}))
    refused(
        "dpo",
        "dpo.model.name_or_path=builtin:tiny",
        f"dpo.data.train_path={path}",
        config=DPO,
        stage="dpo",
        match=r"p\.jsonl row 2 keys 'chosen' and 'rejected': chosen and rejected are the same text",
    )


def test_non_finite_number_is_refused_by_kto(tmp_path, refused):
    path = tmp_path / "k.jsonl"
    path.write_bytes(lines(PAIR, b'{"prompt": "a", "chosen": "b", "rejected": "c", "margin": Infinity}'))
    refused(
        "kto",
        "kto.model.name_or_path=builtin:tiny",
        f"kto.data.train_path={path}",
        config=KTO,
        stage="kto",
        match=r"k\.jsonl: line 2: key 'margin': value is Infinity, not a finite number",
    )
