"""Bad model folders given to the sft job on its command line: each is refused with exit 2 and one error line
naming the key and the file, before Ray or any worker starts (``refused``: tests/bad_input/conftest.py)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.test_model_checks import edit_config, save_tiny

KEY = r"'sft.model.name_or_path': "


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {"good": save_tiny(root / "good"), "sharded": save_tiny(root / "sharded", max_shard_size="50KB")}


def no_config(folder: Path) -> None:
    (folder / "config.json").unlink()


def malformed_config(folder: Path) -> None:
    (folder / "config.json").write_text('{"model_type": "llama",\n "hidden_size": 64 "vocab_size": 1024}')


def truncated(folder: Path) -> None:
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) * 2 // 3])


def random_bytes(folder: Path) -> None:
    (folder / "model.safetensors").write_bytes(bytes(range(256)) * 64)


def missing_shard(folder: Path) -> None:
    sorted(folder.glob("model-*.safetensors"))[0].unlink()


def no_tokenizer(folder: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (folder / name).unlink(missing_ok=True)


def broken_tokenizer(folder: Path) -> None:
    (folder / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "BPE", "vocab": ')


CASES: dict[str, tuple[str, Callable[[Path], None], str]] = {
    "no config.json": ("good", no_config, r"has no config.json, so it is not a model directory"),
    "malformed config.json": (
        "good",
        malformed_config,
        r"config.json is not valid JSON \(line 2, column 20: Expecting ',' delimiter\)",
    ),
    "no model_type": ("good", lambda f: edit_config(f, model_type=None), r"config.json has no model_type"),
    "unknown model_type": (
        "good",
        lambda f: edit_config(f, model_type="llama9000"),
        r"model_type 'llama9000', which this transformers",
    ),
    "no weights": ("good", lambda f: (f / "model.safetensors").unlink(), r"has no weights \(model.safetensors, "),
    "truncated safetensors": ("good", truncated, r"model.safetensors is not a readable safetensors file .*truncated"),
    "random bytes": ("good", random_bytes, r"model.safetensors is not a readable safetensors file \(header length"),
    "vocab_size mismatch": (
        "good",
        lambda f: edit_config(f, vocab_size=999),
        r"tensor \S+ in \S+model.safetensors has shape \[1024, 64\] "
        r"but \S+config.json implies \[999, 64\]",
    ),
    "hidden_size mismatch": (
        "good",
        lambda f: edit_config(f, hidden_size=128, head_dim=64),
        r"has shape \[\d+, 64\] but \S+ implies \[",
    ),
    "missing shard": ("sharded", missing_shard, r"index.json lists 1 shard\(s\) missing .*copy every shard"),
    "no tokenizer files": ("good", no_tokenizer, r"has no tokenizer files .* or set sft.model.tokenizer to one"),
    "broken tokenizer.json": ("good", broken_tokenizer, r"the tokenizer at \S+ does not load \(.*\); fix or re-save"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_model_folder_is_refused(models, tmp_path, refused, case):
    source, breaks, match = CASES[case]
    folder = tmp_path / "model"
    shutil.copytree(models[source], folder)
    breaks(folder)
    refused("sft", f"sft.model.name_or_path={folder}", match=KEY + r".*" + match)


def test_bad_separate_tokenizer_is_refused(models, tmp_path, refused):
    folder = tmp_path / "tok"
    shutil.copytree(models["good"], folder)
    (folder / "tokenizer.json").write_text(json.dumps({"not": "a tokenizer"}))
    refused(
        "sft",
        f"sft.model.name_or_path={models['good']}",
        f"sft.model.tokenizer={folder}",
        match=r"^error: 'sft.model.tokenizer': the tokenizer at \S+ does not load",
    )
