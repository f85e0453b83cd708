"""``check_model_source`` on local model folders: a good folder (single file, sharded, tied, reward model, .bin)
passes fast; each kind of broken folder is refused with one ``ModelPathError`` line naming the key and the file."""

from __future__ import annotations

import json
import shutil
import struct
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from rlhf_core.models.builders import ModelPathError, build_causal_lm, build_scalar_model, load_tokenizer
from rlhf_core.models.checks import check_model_source
from tests.remote_code import add_remote_code

KEY = "sft.model.name_or_path"


def save_tiny(dest: Path, *, kind: str = "causal", **save: object) -> Path:
    """The builtin tiny model (``kind``: causal, tied, scalar) and its tokenizer, saved as a Hugging Face folder."""
    tok = load_tokenizer("builtin:tiny")
    if kind == "scalar":
        model = build_scalar_model("builtin:tiny", tok, seed=0, dtype=torch.float32, attn="sdpa")
    else:
        model = build_causal_lm("builtin:tiny", tok, seed=0, dtype=torch.float32, attn="sdpa")
    if kind == "tied":
        from transformers import AutoModelForCausalLM

        config = model.config
        config.tie_word_embeddings = True
        model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(str(dest), **save)
    tok.save_pretrained(str(dest))
    return dest


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {
        "good": save_tiny(root / "good"),
        "sharded": save_tiny(root / "sharded", max_shard_size="50KB"),
    }


@pytest.fixture
def copy_of(models, tmp_path) -> Callable[[str], Path]:
    def copy(name: str = "good") -> Path:
        dest = tmp_path / name
        shutil.copytree(models[name], dest)
        return dest

    return copy


def refused(path: Path | str, match: str, **kwargs: object) -> str:
    with pytest.raises(ModelPathError, match=match) as e:
        check_model_source(str(path), KEY, **kwargs)  # type: ignore[arg-type]
    message = str(e.value)
    assert "\n" not in message and message.startswith("'sft.model"), message
    return message


def edit_config(folder: Path, **changes: object) -> None:
    config = json.loads((folder / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            config.pop(k, None)
        else:
            config[k] = v
    (folder / "config.json").write_text(json.dumps(config, indent=2))


# --- good folders ---------------------------------------------------------------------------------------------


def test_good_folder_passes_fast(models):
    check_model_source(str(models["good"]), KEY)  # warm: transformers' imports and model classes
    start = time.perf_counter()
    check_model_source(str(models["good"]), KEY)
    assert time.perf_counter() - start < 1.0


def test_sharded_folder_passes(models):
    assert len(list(models["sharded"].glob("model-*.safetensors"))) > 1
    check_model_source(str(models["sharded"]), KEY)


@pytest.mark.parametrize("kind", ["tied", "scalar"])
def test_tied_and_reward_model_folders_pass(tmp_path, kind):
    check_model_source(str(save_tiny(tmp_path / kind, kind=kind)), KEY)


def test_bin_folder_passes_and_truncated_bin_is_refused(copy_of):
    from safetensors.torch import load_file

    folder = copy_of()
    state = load_file(str(folder / "model.safetensors"))
    (folder / "model.safetensors").unlink()
    torch.save(state, folder / "pytorch_model.bin")
    check_model_source(str(folder), KEY)
    data = (folder / "pytorch_model.bin").read_bytes()
    (folder / "pytorch_model.bin").write_bytes(data[: len(data) // 2])
    refused(folder, r"pytorch_model.bin is not a readable PyTorch checkpoint")
    (folder / "pytorch_model.bin").write_bytes(b"\x00garbage" * 100)
    refused(folder, r"pytorch_model.bin is not a readable PyTorch checkpoint \(neither zip nor pickle\)")


def test_builtin_passes_and_unknown_builtin_is_refused():
    check_model_source("builtin:tiny", KEY)
    refused("builtin:huge", r"unknown builtin model 'huge'")


def test_separate_tokenizer_is_checked(copy_of, models):
    folder = copy_of()
    (folder / "tokenizer.json").unlink()
    check_model_source(str(folder), KEY, tokenizer=str(models["good"]))
    with pytest.raises(
        ModelPathError,
        match=r"^'sft.model.tokenizer': \S+ has no tokenizer files .* or point sft.model.tokenizer at a",
    ):
        check_model_source("builtin:tiny", KEY, tokenizer=str(folder))


# --- config.json ----------------------------------------------------------------------------------------------


def test_no_config(copy_of):
    folder = copy_of()
    (folder / "config.json").unlink()
    refused(folder, r"has no config.json, so it is not a model directory")


def test_a_file_is_not_a_model_folder(models):
    refused(models["good"] / "config.json", r"is a file, not a model directory")


def test_malformed_config_names_line_and_column(copy_of):
    folder = copy_of()
    (folder / "config.json").write_text('{\n  "model_type": "llama",\n  "hidden_size": 64,,\n}\n')
    refused(folder, r"config.json is not valid JSON \(line 3, column 21: Expecting property name")


def test_config_not_an_object(copy_of):
    folder = copy_of()
    (folder / "config.json").write_text("[1, 2]")
    refused(folder, r"config.json holds a JSON list, not an object")


def test_no_model_type(copy_of):
    folder = copy_of()
    edit_config(folder, model_type=None)
    refused(folder, r"config.json has no model_type")


def test_unknown_model_type(copy_of):
    folder = copy_of()
    edit_config(folder, model_type="no_such_arch")
    refused(folder, r"model_type 'no_such_arch', which this transformers does not know")


def test_custom_code_needs_trust_remote_code(copy_of):
    folder = copy_of()
    edit_config(folder, model_type="my_arch", auto_map={"AutoConfig": "configuration_my.MyConfig"})
    refused(folder, r"custom code \(auto_map\); set sft.model.trust_remote_code=true")


def test_config_values_transformers_rejects(copy_of):
    folder = copy_of()
    edit_config(folder, num_attention_heads=3)  # 64 wide does not split into 3 heads of head_dim 32
    refused(
        folder,
        r"config.json does not load as a llama config \(.*not a multiple of the number of attention "
        r"heads \(3\)",
    )


def test_config_with_more_layers_than_the_weights(copy_of):
    folder = copy_of()
    edit_config(folder, num_hidden_layers=3)
    refused(folder, r"the weights in \S+ lack 9 tensor\(s\) that \S+config.json implies \(layers.2.")


# --- weight files ---------------------------------------------------------------------------------------------


def test_no_weights(copy_of):
    folder = copy_of()
    (folder / "model.safetensors").unlink()
    refused(folder, r"has no weights \(model.safetensors, model.safetensors.index.json, pytorch_model.bin")


def test_truncated_safetensors(copy_of):
    folder = copy_of()
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) - 100])
    refused(
        folder,
        r"model.safetensors is not a readable safetensors file \(tensor \S+ ends at byte \d+ of \d+ "
        r"data bytes: the file is truncated\)",
    )


def test_random_bytes_safetensors(copy_of):
    folder = copy_of()
    (folder / "model.safetensors").write_bytes(torch.randint(0, 256, (4096,), dtype=torch.uint8).numpy().tobytes())
    refused(
        folder,
        r"model.safetensors is not a readable safetensors file \(header length \d+ but the file has "
        r"4096 bytes",
    )


def test_tiny_safetensors(copy_of):
    folder = copy_of()
    (folder / "model.safetensors").write_bytes(b"abc")
    refused(folder, r"not a readable safetensors file \(3 bytes\)")


def test_bad_header_json(copy_of):
    folder = copy_of()
    header = b"{not json}"
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 64)
    refused(folder, r"not a readable safetensors file \(its header is not JSON\)")


def test_header_entry_size_disagrees_with_shape(copy_of):
    folder = copy_of()
    header = json.dumps({"w": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 32]}}).encode()
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 64)
    refused(folder, r"tensor w: 32 bytes for shape \[4, 4\]")


@pytest.mark.parametrize(
    ("change", "tensor"),
    [
        ({"vocab_size": 2048}, r"(\S*embed_tokens|lm_head).weight"),
        ({"intermediate_size": 96}, r"\S*mlp\.\w+_proj.weight"),
    ],
)
def test_shape_mismatch(copy_of, change, tensor):
    folder = copy_of()
    edit_config(folder, **change)
    message = refused(
        folder,
        rf"tensor {tensor} in \S+model.safetensors has shape \[\d+, \d+\] but \S+config.json "
        r"implies \[\d+, \d+\]",
    )
    assert "fix the config or re-export the model" in message


def test_missing_shard(copy_of):
    folder = copy_of("sharded")
    sorted(folder.glob("model-*.safetensors"))[1].unlink()
    refused(
        folder,
        r"model.safetensors.index.json lists 1 shard\(s\) missing from \S+ \(model-00002-of-\d+"
        r".safetensors\); copy every shard",
    )


def test_truncated_shard(copy_of):
    folder = copy_of("sharded")
    shard = sorted(folder.glob("model-*.safetensors"))[-1]
    shard.write_bytes(shard.read_bytes()[:-10])
    refused(folder, rf"{shard.name} is not a readable safetensors file .*truncated")


def test_broken_index(copy_of):
    folder = copy_of("sharded")
    (folder / "model.safetensors.index.json").write_text("{}")
    refused(folder, r"model.safetensors.index.json is not a shard index")


def test_index_places_tensor_in_wrong_shard(copy_of):
    folder = copy_of("sharded")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    name = next(iter(index["weight_map"]))
    others = sorted(set(index["weight_map"].values()) - {index["weight_map"][name]})
    index["weight_map"][name] = others[0]
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    refused(folder, rf"places tensor {name} in {others[0]}, which does not hold it")


# --- tokenizer ------------------------------------------------------------------------------------------------


def test_no_tokenizer_files(copy_of):
    folder = copy_of()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (folder / name).unlink(missing_ok=True)
    refused(
        folder,
        r"has no tokenizer files \(tokenizer.json, .*\); copy the tokenizer into it .* or set "
        r"sft.model.tokenizer to one",
    )


def test_broken_tokenizer_json(copy_of):
    folder = copy_of()
    (folder / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    refused(folder, r"the tokenizer at \S+ does not load \(\w+: .*\); fix or re-save it")


def test_load_tokenizer_refuses_with_key(copy_of):
    folder = copy_of()
    (folder / "tokenizer.json").write_text("garbage")
    with pytest.raises(ModelPathError, match=r"^the tokenizer at \S+ does not load"):
        load_tokenizer(str(folder))
    with pytest.raises(ModelPathError, match=r"^'rm.model.tokenizer': the tokenizer at"):
        load_tokenizer("builtin:tiny", str(folder), key="rm.model.tokenizer")


@pytest.mark.parametrize(
    ("kind", "architecture"), [("causal", "ProbeForCausalLM"), ("scalar", "ProbeForSequenceClassification")]
)
def test_custom_code_model_passes_with_trust_remote_code(tmp_path, kind, architecture):
    folder = save_tiny(tmp_path / "remote", kind=kind)
    add_remote_code(folder, "checkprobe", architecture)
    check_model_source(str(folder), KEY, trust_remote_code=True)
    refused(folder, r"custom code \(auto_map\); set sft.model.trust_remote_code=true")
    edit_config(folder, vocab_size=512)
    refused(folder, r"tensor \S+ in \S+ has shape \[1024, 64\] but \S+ implies \[512, 64\]", trust_remote_code=True)


def test_stop_ids_are_eos_then_the_generation_configs_own(tmp_path):
    from types import SimpleNamespace

    from rlhf_core.models.builders import ModelPathError, stop_ids

    tok = SimpleNamespace(eos_token_id=128001)
    assert stop_ids(str(tmp_path), tok) == (128001,)  # no generation_config.json
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [128001, 128009], "do_sample": true}')
    assert stop_ids(str(tmp_path), tok) == (128001, 128009)  # Llama-3-Instruct's pair, EOS not repeated
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": 151643}')
    assert stop_ids(str(tmp_path), SimpleNamespace(eos_token_id=151645)) == (151645, 151643)  # Qwen2.5-Instruct's
    assert stop_ids("builtin:tiny", tok) == (128001,)
    (tmp_path / "generation_config.json").write_text("[1, 2]")
    with pytest.raises(ModelPathError, match="generation_config.json: not a JSON object"):
        stop_ids(str(tmp_path), tok)
