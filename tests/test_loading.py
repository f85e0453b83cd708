import gzip
import json
import uuid

import pytest

from rlhf_core.data.loading import DataError, load_rows, require_keys

ROWS = [
    {
        "prompt": "Write a sentence about the garden.",
        "chosen": "The garden is good.",
        "rejected": "The garden is bad.",
    },
    {"prompt": "Tell me about the river.", "chosen": "The river is calm.", "rejected": "The river is dark."},
    {"prompt": "Say something about the cat.", "chosen": "The cat is kind.", "rejected": "The cat is rude."},
]


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


# --------------------------------------------------------------------------- formats


def test_jsonl(tmp_path):
    p = tmp_path / "data.jsonl"
    p.write_text(
        json.dumps(ROWS[0]) + "\n\n   \n" + json.dumps(ROWS[1]) + "\n" + json.dumps(ROWS[2]), encoding="utf-8"
    )
    assert load_rows(str(p)) == ROWS
    assert load_rows(p, max_rows=2) == ROWS[:2]


def test_jsonl_gz(tmp_path):
    p = tmp_path / "data.jsonl.gz"
    p.write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in ROWS).encode()))
    assert load_rows(str(p)) == ROWS


def test_json_list_and_json_lines(tmp_path):
    p = tmp_path / "list.json"
    p.write_text(json.dumps(ROWS), encoding="utf-8")
    assert load_rows(str(p)) == ROWS
    p2 = _write_jsonl(tmp_path / "lines.json", ROWS)
    assert load_rows(str(p2)) == ROWS
    p3 = tmp_path / "splits.json"
    p3.write_text(json.dumps({"train": ROWS[:2], "test": ROWS[2:]}), encoding="utf-8")
    assert load_rows(str(p3), split="test") == ROWS[2:]


def test_json_list_with_non_object(tmp_path):
    p = tmp_path / "bad.json"
    p.write_text(json.dumps([ROWS[0], 5]), encoding="utf-8")
    with pytest.raises(DataError, match=r"bad\.json: row 2"):
        load_rows(str(p))


def test_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    p = tmp_path / "data.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), p)
    assert load_rows(str(p)) == ROWS
    assert load_rows(str(p), max_rows=1) == ROWS[:1]


def test_csv(tmp_path):
    import csv

    p = tmp_path / "data.csv"
    with open(p, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=list(ROWS[0]))
        w.writeheader()
        w.writerows(ROWS)
    assert load_rows(str(p)) == ROWS


def test_save_to_disk_dataset(tmp_path):
    import datasets

    d = tmp_path / "ds"
    datasets.Dataset.from_list(ROWS).save_to_disk(str(d))
    assert load_rows(str(d)) == ROWS
    assert load_rows(str(d), split="anything") == ROWS  # a plain Dataset has no splits


def test_save_to_disk_dataset_dict(tmp_path):
    import datasets

    d = tmp_path / "dd"
    datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_list(ROWS[:2]),
            "test": datasets.Dataset.from_list(ROWS[2:]),
        }
    ).save_to_disk(str(d))
    assert load_rows(str(d)) == ROWS[:2]
    assert load_rows(str(d), split="test") == ROWS[2:]
    with pytest.raises(DataError, match=r"dd: has no split 'validation' \(available: train, test\)"):
        load_rows(str(d), split="validation")


def test_folder_of_files_by_split(tmp_path):
    _write_jsonl(tmp_path / "sft_train.jsonl", ROWS[:2])
    _write_jsonl(tmp_path / "sft_eval.jsonl", ROWS[2:])
    assert load_rows(str(tmp_path)) == ROWS[:2]
    assert load_rows(str(tmp_path), split="eval") == ROWS[2:]
    with pytest.raises(DataError, match="no data file for split 'validation'"):
        load_rows(str(tmp_path), split="validation")


def test_folder_without_split_names(tmp_path):
    _write_jsonl(tmp_path / "a.jsonl", ROWS[:1])
    _write_jsonl(tmp_path / "b.jsonl", ROWS[1:])
    assert load_rows(str(tmp_path), split="validation") == ROWS
    assert load_rows(str(tmp_path), max_rows=2) == ROWS[:2]


def test_fsspec_memory_url():
    import fsspec

    base = f"memory://rlhf-test-{uuid.uuid4().hex}"
    with fsspec.open(f"{base}/data.jsonl", "w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in ROWS))
    assert load_rows(f"{base}/data.jsonl", storage_options={}) == ROWS
    with fsspec.open(f"{base}/dir/test.jsonl", "w") as f:
        f.write(json.dumps(ROWS[2]) + "\n")
    with fsspec.open(f"{base}/dir/train.jsonl", "w") as f:
        f.write(json.dumps(ROWS[0]) + "\n")
    assert load_rows(f"{base}/dir", split="test") == ROWS[2:]
    with fsspec.open(f"{base}/bad.jsonl", "w") as f:
        f.write(json.dumps(ROWS[0]) + "\n{oops\n")
    with pytest.raises(DataError, match=r"bad\.jsonl: line 2"):
        load_rows(f"{base}/bad.jsonl")
    with pytest.raises(DataError, match=r"missing\.jsonl: does not exist"):
        load_rows(f"{base}/missing.jsonl")


def test_bundled_synthetic_loads():
    from rlhf_core.data.synthetic import bundled_path

    rows = load_rows(bundled_path("pref_eval"))
    require_keys(rows, ["prompt", "chosen", "rejected"], bundled_path("pref_eval"))
    assert len(rows) == 300


# --------------------------------------------------------------------------- errors


def test_malformed_jsonl_names_file_and_line(tmp_path):
    p = tmp_path / "broken.jsonl"
    p.write_text(json.dumps(ROWS[0]) + "\n\n" + '{"prompt": "x",\n', encoding="utf-8")
    with pytest.raises(DataError) as e:
        load_rows(str(p))
    msg = str(e.value)
    assert "broken.jsonl" in msg and "line 3" in msg
    assert e.value.row == 3


def test_jsonl_non_object_line(tmp_path):
    p = tmp_path / "arr.jsonl"
    p.write_text(json.dumps(ROWS[0]) + "\n[1, 2]\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"arr\.jsonl: line 2: expected a JSON object"):
        load_rows(str(p))


@pytest.mark.parametrize("content", ["", "\n\n  \n"])
def test_empty_file_has_no_rows(tmp_path, content):
    p = tmp_path / "empty.jsonl"
    p.write_text(content, encoding="utf-8")
    with pytest.raises(DataError, match=r"empty\.jsonl: has no rows"):
        load_rows(str(p))


def test_empty_json_list_has_no_rows(tmp_path):
    p = tmp_path / "empty.json"
    p.write_text("[]", encoding="utf-8")
    with pytest.raises(DataError, match="has no rows"):
        load_rows(str(p))


def test_unsupported_extension(tmp_path):
    p = tmp_path / "data.txt"
    p.write_text("hello\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"data\.txt: unsupported file type"):
        load_rows(str(p))


@pytest.fixture
def hub_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    # Both libraries read the variable at import time; patch the constants too.
    import datasets.config
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True, raising=False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True, raising=False)


def test_missing_hub_name(hub_offline):
    name = "no-such-org-xyz/no-such-dataset-xyz"
    with pytest.raises(DataError) as e:
        load_rows(name)
    msg = str(e.value)
    assert msg.startswith(name + ":")
    assert "does not exist locally" in msg and "hub dataset could not be loaded" in msg


def test_missing_local_path(tmp_path, hub_offline):
    missing = tmp_path / "nowhere" / "data.jsonl"
    with pytest.raises(DataError, match="does not exist locally") as e:
        load_rows(str(missing))
    assert str(missing) in str(e.value)


def test_max_rows_validation(tmp_path):
    p = _write_jsonl(tmp_path / "d.jsonl", ROWS)
    with pytest.raises(ValueError):
        load_rows(str(p), max_rows=0)


# --------------------------------------------------------------------------- require_keys


def test_require_keys_ok_with_strings_and_messages():
    rows = [
        {"prompt": "hi", "chosen": "a", "rejected": "b"},
        {
            "prompt": [{"role": "user", "content": "hi"}],
            "chosen": [{"role": "assistant", "content": "a"}],
            "rejected": "b",
        },
    ]
    assert require_keys(rows, ["prompt", "chosen", "rejected"], "src.jsonl") is rows


def test_require_keys_missing_key():
    rows = [dict(ROWS[0]), {"prompt": "x", "chosen": "y"}]
    with pytest.raises(DataError) as e:
        require_keys(rows, ["prompt", "chosen", "rejected"], "prefs.jsonl")
    msg = str(e.value)
    assert "prefs.jsonl" in msg and "row 2" in msg and "'rejected'" in msg
    assert (e.value.row, e.value.key) == (2, "rejected")


@pytest.mark.parametrize("bad", ["", "   ", None, 3, [], [{"role": "user"}], ["text"]])
def test_require_keys_bad_values(bad):
    rows = [{"prompt": "ok"}, {"prompt": "ok"}, {"prompt": bad}]
    with pytest.raises(DataError, match=r"src: row 3: key 'prompt': value"):
        require_keys(rows, ["prompt"], "src")


def test_require_keys_empty():
    with pytest.raises(DataError, match="src: has no rows"):
        require_keys([], ["prompt"], "src")
