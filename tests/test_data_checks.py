"""Row-by-row data checks: duplicate keys, non-finite numbers, encoding, chat message lists, value types, identical
pairs and the truncation warning; and valid controls that must still load with their exact row count."""

import codecs
import json

import pytest

from rlhf_core.config import DataSource, KTOData, PreferenceData, PromptData, SFTData
from rlhf_core.data.examples import kto_examples, preference_examples, prompt_examples, render_prompt, sft_examples
from rlhf_core.data.loading import DataError, load_rows, require_keys
from rlhf_core.models.builders import load_tokenizer

ROW = {"prompt": "Say hi.", "chosen": "Hello.", "rejected": "Go away."}
U, S = {"role": "user", "content": "Say hi."}, {"role": "system", "content": "Be brief."}


def A(text):  # noqa: N802 - an assistant message
    return {"role": "assistant", "content": text}


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("builtin:tiny")


def jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return str(path)


def refused(match, load):
    with pytest.raises(DataError, match=match) as info:
        load()
    assert "\n" not in str(info.value)
    return info.value


# --------------------------------------------------------------------------- duplicate keys


def test_duplicate_key_in_jsonl_line_names_line_and_key(tmp_path):
    p = jsonl(tmp_path / "d.jsonl", [ROW, '{"prompt": "a", "chosen": "b", "chosen": "c", "rejected": "d"}'])
    e = refused(r"d\.jsonl: line 2: key 'chosen': the key appears twice.*keep one", lambda: load_rows(p))
    assert (e.row, e.key) == (2, "chosen")


def test_duplicate_key_in_json_list_names_row(tmp_path):
    p = tmp_path / "d.json"
    p.write_text('[{"prompt": "a"}, {"prompt": "a", "x": 1, "x": 2}]', encoding="utf-8")
    refused(r"d\.json: row 2: key 'x': the key appears twice", lambda: load_rows(str(p)))


def test_duplicate_key_in_a_nested_message_names_the_row_key(tmp_path):
    p = jsonl(tmp_path / "d.jsonl", ['{"prompt": [{"role": "user", "content": "a", "content": "b"}]}'])
    refused(r"line 1: key 'prompt': an object in the value has the key 'content' twice", lambda: load_rows(p))


def test_duplicate_split_key_of_a_json_object(tmp_path):
    p = tmp_path / "s.json"
    p.write_text('{"train": [{"a": "1"}], "train": [{"a": "2"}]}', encoding="utf-8")
    refused(r"s\.json: key 'train': the key appears twice", lambda: load_rows(str(p)))


# --------------------------------------------------------------------------- non-finite numbers


@pytest.mark.parametrize("number", ["NaN", "Infinity", "-Infinity", "1e999"])
def test_non_finite_json_number_names_line_and_key(tmp_path, number):
    p = jsonl(tmp_path / "n.jsonl", [ROW, f'{{"prompt": "a", "score": {number}}}'])
    refused(rf"n\.jsonl: line 2: key 'score': value is {number}, not a finite number", lambda: load_rows(p))


def test_non_finite_number_in_json_list_and_nested(tmp_path):
    p = tmp_path / "n.json"
    p.write_text('[{"prompt": "a"}, {"prompt": "a", "meta": {"w": [1.0, NaN]}}]', encoding="utf-8")
    refused(r"n\.json: row 2: key 'meta': value is NaN", lambda: load_rows(str(p)))


def test_non_finite_parquet_float_names_row_and_key(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    p = tmp_path / "n.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": "a", "w": 1.0}, {"prompt": "b", "w": float("inf")}]), p)
    refused(r"n\.parquet: row 2: key 'w': value is inf, not a finite number", lambda: load_rows(str(p)))


def test_finite_numbers_load(tmp_path):
    p = jsonl(tmp_path / "ok.jsonl", [{"prompt": "a", "w": 1.5, "n": 3, "big": 1e300}])
    assert load_rows(p) == [{"prompt": "a", "w": 1.5, "n": 3, "big": 1e300}]


# --------------------------------------------------------------------------- encoding


@pytest.mark.parametrize("name", ["b.jsonl", "b.json", "b.jsonl.gz"])
def test_invalid_utf8_byte_names_line_and_column(tmp_path, name):
    import gzip

    data = b'{"prompt": "a"}\n{"prompt": "b"}\n{"pr\xffompt": "c"}\n'
    p = tmp_path / name
    p.write_bytes(gzip.compress(data) if name.endswith(".gz") else data)
    e = refused(
        r": line 3: not valid UTF-8 \(byte 0xff at column 5\); re-save the file as UTF-8", lambda: load_rows(p)
    )
    assert e.row == 3


def test_invalid_utf8_in_csv(tmp_path):
    p = tmp_path / "b.csv"
    p.write_bytes(b"prompt,chosen\r\na,b\r\n\xe9t\xe9,c\r\n")
    refused(r"b\.csv: line 3: not valid UTF-8 \(byte 0xe9 at column 1\)", lambda: load_rows(p))


def test_bom_jsonl_json_csv_load_without_bom_in_first_key(tmp_path):
    bom = codecs.BOM_UTF8
    (tmp_path / "b.jsonl").write_bytes(bom + b"".join(json.dumps(ROW).encode() + b"\n" for _ in range(3)))
    (tmp_path / "b.json").write_bytes(bom + json.dumps([ROW, ROW]).encode())
    (tmp_path / "b.csv").write_bytes(bom + b"prompt,chosen,rejected\r\nSay hi.,Hello.,Go away.\r\n")
    assert load_rows(tmp_path / "b.jsonl") == [ROW] * 3
    assert load_rows(tmp_path / "b.json") == [ROW] * 2
    assert load_rows(tmp_path / "b.csv") == [ROW]


def test_bom_with_bad_byte_on_line_one_counts_columns_from_the_file_start(tmp_path):
    p = tmp_path / "b.json"
    p.write_bytes(codecs.BOM_UTF8 + b'[{"a": "\xff"}]')
    refused(r"line 1: not valid UTF-8 \(byte 0xff at column 12\)", lambda: load_rows(p))


def test_crlf_jsonl_loads(tmp_path):
    p = tmp_path / "c.jsonl"
    p.write_bytes(b"".join(json.dumps(ROW).encode() + b"\r\n" for _ in range(4)) + b"\r\n")
    assert load_rows(p) == [ROW] * 4


# --------------------------------------------------------------------------- chat messages


@pytest.mark.parametrize(
    "value, kind, match",
    [
        ([{"role": "bot", "content": "x"}], "any", r"message 1 has role 'bot'; use one of system, user, assistant"),
        ([{"role": "tool", "content": "x"}], "any", r"message 1 has role 'tool'"),
        ([U, S, A("x")], "conversation", r"message 2 is a system message after message 1"),
        ([U, U, A("x")], "conversation", r"message 2 is a second user message in a row"),
        ([U, A("x"), A("y")], "response", r"message 3 is a second assistant message in a row"),
        ([U, A("x"), U], "conversation", r"message 3 is 'user'; the list must end with the assistant's answer"),
        ([U, A("x"), U], "response", r"message 3 is 'user'; the list must end with the assistant's answer"),
        ([U, A("x")], "prompt", r"message 2 is 'assistant'; a prompt ends with a user message"),
        ([S, A("x")], "conversation", r"message 2 is 'assistant'; after an optional system message the first"),
        ([A("x")], "conversation", r"message 1 is 'assistant'"),
        ([S], "prompt", r"has only a system message"),
        ([U, A("  \n")], "conversation", r"message 2 \(assistant\) has empty content"),
        (
            [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
            "prompt",
            r"message 1 has no string 'content'",
        ),
        ([{"role": "user"}], "prompt", r"message 1 has no string 'content' \(missing\)"),
        ([{"content": "hi"}], "prompt", r"message 1 has no string 'role'"),
        (["hi"], "prompt", r"message 1 is not an object \(got str\)"),
        ([], "prompt", r"is an empty message list"),
    ],
)
def test_bad_message_list_names_row_key_and_message(value, kind, match):
    rows = [{"k": "ok"}, {"k": value}]
    refused(rf"src: row 2: key 'k': value {match}", lambda: require_keys(rows, ["k"], "src", {"k": kind}))


@pytest.mark.parametrize(
    "value, kind",
    [
        ([U], "prompt"),
        ([S, U], "prompt"),
        ([U, A("a"), U], "prompt"),
        ([U, A("a")], "conversation"),
        ([S, U, A("a"), U, A("b")], "conversation"),
        ([A("a")], "response"),
        ([U, A("a")], "response"),
        ([A("a")], "any"),
        ([{"role": "user", "content": "hi", "name": "bob"}], "prompt"),
    ],
)
def test_good_message_lists_pass(value, kind):
    rows = [{"k": value}]
    assert require_keys(rows, ["k"], "src", {"k": kind}) is rows


def test_chat_sft_rows_refuse_a_response_list_without_the_answer(tmp_path, tok):
    p = jsonl(tmp_path / "s.jsonl", [{"input": "a", "output": "b"}, {"input": [U], "output": [U, A("x"), U]}])
    refused(
        r"s\.jsonl: row 2: key 'output': value message 3 is 'user'",
        lambda: sft_examples(SFTData(train_path=p), tok),
    )


def test_chat_sft_output_as_messages_encodes(tmp_path, tok):
    p = jsonl(tmp_path / "s.jsonl", [{"input": [U], "output": [A("Hi.")]}, {"input": "a", "output": "b"}])
    a, b = sft_examples(SFTData(train_path=p), tok)
    n = a["loss_mask"].index(1)
    assert tok.decode(a["input_ids"][n:-1]) == "Hi."


def test_prompt_examples_refuse_a_prompt_ending_with_the_answer(tmp_path, tok):
    p = jsonl(tmp_path / "p.jsonl", [{"input": [U]}, {"input": [U, A("x")]}])
    refused(
        r"p\.jsonl: row 2: key 'input': value message 2 is 'assistant'",
        lambda: prompt_examples(PromptData(train_path=p), tok),
    )


# --------------------------------------------------------------------------- chat-format preference pairs


CHAT_ROWS = {
    "conversation, prompt_key null": (None, {"chosen": [U, A("Hello.")], "rejected": [U, A("No.")]}),
    "system first, prompt_key null": (None, {"chosen": [S, U, A("Hello.")], "rejected": [S, U, A("No.")]}),
    "prompt messages, string answers": ("prompt", {"prompt": [S, U], "chosen": "Hello.", "rejected": "No."}),
    "prompt messages, answer messages": ("prompt", {"prompt": [U], "chosen": [A("Hello.")], "rejected": [A("No.")]}),
    "prompt messages, conversations": (
        "prompt",
        {"prompt": [U], "chosen": [U, A("Hello.")], "rejected": [U, A("No.")]},
    ),
    "multi-turn": (None, {"chosen": [U, A("a"), U, A("Hello.")], "rejected": [U, A("a"), U, A("No.")]}),
}


OTHER = {"prompt": "Name a colour.", "chosen": "Blue.", "rejected": "Dog."}
OTHER_CHAT = {"chosen": [{"role": "user", "content": "Name a colour."}, A("Blue.")], "rejected": [U, A("Dog.")]}


@pytest.mark.parametrize("case", sorted(CHAT_ROWS))
@pytest.mark.parametrize("template", [True, False])
def test_chat_format_pairs_encode(tmp_path, tok, case, template):
    prompt_key, row = CHAT_ROWS[case]
    if not template:
        tok = load_tokenizer("builtin:tiny")
        tok.chat_template = None
    p = jsonl(tmp_path / "c.jsonl", [row, OTHER if prompt_key else OTHER_CHAT, row])
    pairs = preference_examples(PreferenceData(train_path=p, prompt_key=prompt_key), tok)
    assert len(pairs) == 3
    first = pairs[0]
    assert tok.decode(first["chosen_ids"][first["chosen_prompt_len"] : -1]) == "Hello."
    assert tok.decode(first["rejected_ids"][first["rejected_prompt_len"] : -1]) == "No."
    assert len(kto_examples(KTOData(train_path=p, prompt_key=prompt_key), tok)) == 6


def test_system_message_folds_into_the_first_user_turn_without_system_role(tok):
    cfg = DataSource(train_path="x")
    assert render_prompt([S, U], tok, cfg) == "<|user|>Be brief.\n\nSay hi.\n<|assistant|>"


def test_a_template_failure_is_a_data_error(tok):
    class Strict:
        chat_template = "x"

        def apply_chat_template(self, *a, **k):
            raise RuntimeError("no such role\nmore")

    refused(
        r"^f row 2: the tokenizer's chat template refused the messages \(no such role\)",
        lambda: render_prompt([U], Strict(), DataSource(train_path="x"), "f row 2"),
    )


SAME = {
    "strings": ("prompt", {"prompt": "a", "chosen": "b c", "rejected": "b c"}),
    "strings up to trailing whitespace": ("prompt", {"prompt": "a", "chosen": "b c", "rejected": "b c \n"}),
    "string and answer message": ("prompt", {"prompt": "a", "chosen": "b", "rejected": [A("b")]}),
    "HH transcripts": (
        None,
        {"chosen": "\n\nHuman: hi\n\nAssistant: yes", "rejected": "\n\nHuman: hi\n\nAssistant: yes"},
    ),
    "HH up to trailing newline": (
        None,
        {"chosen": "\n\nHuman: hi\n\nAssistant: yes", "rejected": "\n\nHuman: hi\n\nAssistant: yes\n"},
    ),
    "chat conversations": (None, {"chosen": [U, A("x")], "rejected": [U, A("x")]}),
    "chat answers with prompt key": ("prompt", {"prompt": [U], "chosen": [A("x")], "rejected": [A("x")]}),
    "chat answers with string prompt": ("prompt", {"prompt": "a", "chosen": [U, A("x")], "rejected": [A("x")]}),
}


@pytest.mark.parametrize("case", sorted(SAME))
def test_chosen_equal_to_rejected_is_refused_in_every_form(tmp_path, tok, case):
    prompt_key, row = SAME[case]
    good = ROW if prompt_key else {"chosen": [U, A("Hello.")], "rejected": [U, A("No.")]}
    p = jsonl(tmp_path / "same.jsonl", [good, row])
    for make in (preference_examples, kto_examples):
        refused(
            r"same\.jsonl row 2 keys 'chosen' and 'rejected': chosen and rejected are the same text",
            lambda make=make: make(KTOData(train_path=p, prompt_key=prompt_key), tok),
        )


def test_responses_differing_inside_only_by_whitespace_are_kept(tmp_path, tok):
    p = jsonl(tmp_path / "ws.jsonl", [{"prompt": "a", "chosen": "x\n    y", "rejected": "x\n  y"}])
    assert len(preference_examples(PreferenceData(train_path=p), tok)) == 1


# --------------------------------------------------------------------------- types


@pytest.mark.parametrize(
    "value, got", [(3, "int 3"), (2.5, "float 2.5"), (True, "bool True"), ({"a": "b"}, "dict"), (None, "NoneType")]
)
def test_non_text_value_is_refused_naming_key_and_row(tmp_path, tok, value, got):
    p = jsonl(tmp_path / "t.jsonl", [ROW, {**ROW, "chosen": value}])
    refused(
        rf"t\.jsonl: row 2: key 'chosen': value is not a string or a list of messages \(got {got}.*write the text",
        lambda: preference_examples(PreferenceData(train_path=p), tok),
    )


def test_whitespace_only_value_is_refused(tmp_path, tok):
    p = jsonl(tmp_path / "w.jsonl", [{"input": "a", "output": "b"}, {"input": " \t\n", "output": "b"}])
    refused(
        r"w\.jsonl: row 2: key 'input': value is an empty string", lambda: sft_examples(SFTData(train_path=p), tok)
    )


# --------------------------------------------------------------------------- truncation warning


def test_truncated_rows_are_reported_once_per_file(tmp_path, tok, capsys):
    rows = [{"input": "a", "output": "word " * 40}] * 3 + [{"input": "a", "output": "ok"}] * 5
    p = jsonl(tmp_path / "x.jsonl", rows)
    assert len(sft_examples(SFTData(train_path=p, max_len=16), tok)) == 8
    err = capsys.readouterr().err.splitlines()
    assert err == [f"warning: {p}: 3 of 8 rows truncated to data.max_len=16"]
    pairs = [{"prompt": "a", "chosen": "word " * 40, "rejected": "no"}, ROW]
    p2 = jsonl(tmp_path / "y.jsonl", pairs)
    preference_examples(PreferenceData(train_path=p2, max_len=16), tok)
    assert capsys.readouterr().err.splitlines() == [f"warning: {p2}: 1 of 2 rows truncated to data.max_len=16"]
    sft_examples(SFTData(train_path=p, max_len=512), tok)
    assert capsys.readouterr().err == ""


def test_truncated_unpaired_kto_rows_are_reported_once(tmp_path, tok, capsys):
    rows = [
        {"prompt": "a", "response": "word " * 40, "label": True},
        {"prompt": "b", "response": "no", "label": False},
    ]
    p = jsonl(tmp_path / "k.jsonl", rows)
    assert len(kto_examples(KTOData(train_path=p, max_len=16, label_key="label"), tok)) == 2
    assert capsys.readouterr().err.splitlines() == [f"warning: {p}: 1 of 2 rows truncated to data.max_len=16"]


# --------------------------------------------------------------------------- valid controls


def test_rows_with_extra_keys_load(tmp_path, tok):
    rows = [{**ROW, "id": i, "score": 0.5, "meta": {"src": "x"}, "tags": ["a"]} for i in range(5)]
    p = jsonl(tmp_path / "extra.jsonl", rows)
    assert load_rows(p) == rows
    assert len(preference_examples(PreferenceData(train_path=p), tok)) == 5


def test_json_list_file_loads(tmp_path, tok):
    p = tmp_path / "list.json"
    p.write_text(json.dumps([ROW] * 7), encoding="utf-8")
    assert len(load_rows(p)) == 7
    assert len(preference_examples(PreferenceData(train_path=str(p)), tok)) == 7


def test_parquet_file_loads(tmp_path, tok):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{**ROW, "w": 1.5}] * 6 + [{"prompt": [U], "chosen": [A("Hello.")], "rejected": [A("No.")], "w": 0.0}]
    p = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(rows[:6]), p)
    assert len(load_rows(p)) == 6
    assert len(preference_examples(PreferenceData(train_path=str(p)), tok)) == 6
    chat = tmp_path / "chat.parquet"
    pq.write_table(pa.Table.from_pylist(rows[6:] * 4), chat)
    assert len(preference_examples(PreferenceData(train_path=str(chat)), tok)) == 4


def test_bom_and_crlf_preference_files_train(tmp_path, tok):
    data = codecs.BOM_UTF8 + b"".join(json.dumps(ROW).encode() + b"\r\n" for _ in range(9))
    (tmp_path / "p.jsonl").write_bytes(data)
    assert len(preference_examples(PreferenceData(train_path=str(tmp_path / "p.jsonl")), tok)) == 9
    (tmp_path / "p.csv").write_bytes(
        codecs.BOM_UTF8 + b"prompt,chosen,rejected\r\n" + b"Say hi.,Hello.,Go away.\r\n" * 4
    )
    assert len(preference_examples(PreferenceData(train_path=str(tmp_path / "p.csv")), tok)) == 4
