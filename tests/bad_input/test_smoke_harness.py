import json


def test_missing_key(tmp_path, refused):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"input": "a", "output": "b"}) + "\n" + json.dumps({"input": "a"}) + "\n")
    refused("sft", f"sft.data.train_path={data}", match=r"d.jsonl: row 2: key 'output'")
