"""A LoRA stage's output as a PEFT adapter folder (``lora.export: adapter``), and its loading as base + adapters.

The folder is peft's own format, so ``peft.PeftModel.from_pretrained(base, folder)`` loads it: ``adapter_config.json``
(a ``peft.LoraConfig``: rank, alpha, the adapted layers' names, ``modules_to_save`` with a value head's ``score``) and
``adapter_model.safetensors`` (every weight that trained, under peft's names: the adapters, ``modules_to_save`` and a
value head). Beside them the tokenizer and ``adapter_base.json``, what this project needs to rebuild the trained model:
the base (``stage:<name>`` for an upstream stage's output, with the content hash of that output's manifest; else the
``builtin:`` name, hub name or absolute path the stage trained from), the build's dtype, seed and kind (causal LM or
value model) and the ``lora`` section.

``merge_adapter`` builds the base as the stage built it (QLoRA's base quantised to 4 bits again), loads the trained
weights and writes the plain Hugging Face folder a ``lora.export: merged`` stage would have written:
``W + s B @ A``, or with ``load_in_4bit`` ``dequant(quant(W)) + s B @ A``, exactly the model that trained. (Plain peft
over the full-precision base gives ``W + s B @ A`` there, which differs from the trained model by the NF4 rounding of
W.) ``rlhf_core.distributed.node_files`` calls it wherever a model source is resolved to a local folder, so every
loader (the builders, the rollout engines, the reference and reward roles) sees a plain model folder.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from rlhf_core.models.lora import ADAPTER, LORA_MARKERS, lora_layers, merged_tensors

if TYPE_CHECKING:
    from transformers import PreTrainedModel

RECORD = "adapter_base.json"
PEFT_PREFIX = "base_model.model."  # peft's names: those of the PeftModel that wraps the model
STAGE_PREFIX = "stage:"  # (rlhf_core.config's: the models layer does not read the config)
MANIFEST = "manifest.json"  # (rlhf_core.storage.MANIFEST_NAME: a committed folder's file list)


@dataclass(frozen=True)
class AdapterRecord:
    """``adapter_base.json``: what the trained model is built from besides the adapter folder itself."""

    base: str  # stage:<name>, builtin:<name>, a hub name or an absolute path
    base_content: str | None  # a stage base: the content hash of its manifest when the stage trained
    init_seed: int
    trust_remote_code: bool
    lora: dict = field(default_factory=dict)  # the model's lora section
    scalar: bool = False  # a value model (reward model, critic): AutoModelForSequenceClassification
    dtype: str = "float32"


def is_adapter_folder(path: Any) -> bool:
    """Whether ``path`` is a local adapter folder. A committed folder counts only when its manifest lists the record:
    a stage switched back to ``merged`` keeps the old folder's stale files beside the new ones."""
    if not isinstance(path, str | Path) or not (Path(path) / RECORD).is_file():
        return False
    manifest = Path(path) / MANIFEST
    return not manifest.is_file() or RECORD in json.loads(manifest.read_text()).get("files", {})


def read_record(path: str | Path) -> AdapterRecord:
    return AdapterRecord(**json.loads((Path(path) / RECORD).read_text()))


def peft_name(name: str) -> str:
    """A parameter's name in peft's adapter file: ``x.lora_A.default.weight`` -> ``base_model.model.x.lora_A.weight``
    (peft drops the adapter's name)."""
    if any(marker in name for marker in LORA_MARKERS):
        name = name.replace(f".{ADAPTER}.", ".", 1)
    return PEFT_PREFIX + name


def project_name(key: str) -> str:
    """``peft_name`` undone: the parameter's name in a model with injected adapters (``models.lora``)."""
    name = key.removeprefix(PEFT_PREFIX)
    for marker in (".lora_A.", ".lora_B."):
        name = name.replace(marker, f"{marker}{ADAPTER}.", 1)
    return name


def write_adapter(module: nn.Module, weights: dict, tokenizer: Any, local: Path, record: AdapterRecord) -> Path:
    """Write the adapter folder of ``module`` (a model with adapters, or a wrapper holding it as ``hf_model``) from
    its gathered ``weights``: what trains (``requires_grad``), under peft's names, and ``record``."""
    import shutil

    from peft import LoraConfig as PeftLoraConfig
    from peft.utils import CONFIG_NAME, SAFETENSORS_WEIGHTS_NAME
    from safetensors.torch import save_file

    hf_model = getattr(module, "hf_model", module)
    prefix = "hf_model." if hf_model is not module else ""
    trained = [n for n, p in module.named_parameters() if p.requires_grad and n.startswith(prefix)]
    tensors = {peft_name(n[len(prefix) :]): weights[n].detach().cpu().contiguous() for n in trained}
    saved = sorted({n.rsplit(".", 2)[-2] for n in trained if not any(m in n for m in LORA_MARKERS)})
    lora = record.lora
    modules = dict(hf_model.named_modules(remove_duplicate=False))
    linear = {n for n in lora_layers(hf_model) if type(modules[n]).__name__ != "ParamWrapper"}  # not a parameter's
    extra: dict[str, Any] = (
        {"target_parameters": list(lora["target_parameters"])} if lora.get("target_parameters") else {}
    )
    config = PeftLoraConfig(
        r=lora["rank"],
        lora_alpha=lora["alpha"],
        lora_dropout=lora["dropout"],
        target_modules=sorted({name.rsplit(".", 1)[-1] for name in linear}),
        modules_to_save=saved or None,
        bias="none",
        base_model_name_or_path=record.base,
        **extra,
    )
    adapter = next(p for n, p in module.named_parameters() if ".lora_A." in n)
    scalar = "ForSequenceClassification" in type(hf_model).__name__
    record = AdapterRecord(**{**asdict(record), "scalar": scalar, "dtype": str(adapter.dtype).removeprefix("torch.")})
    shutil.rmtree(local, ignore_errors=True)
    local.mkdir(parents=True)
    config.save_pretrained(str(local))
    written = json.loads((local / CONFIG_NAME).read_text())  # peft keeps the names as a set: its order varies
    written["target_modules"] = sorted(written["target_modules"])
    (local / CONFIG_NAME).write_text(json.dumps(written, indent=2, sort_keys=True))
    save_file(tensors, str(local / SAFETENSORS_WEIGHTS_NAME), metadata={"format": "pt"})
    (local / RECORD).write_text(json.dumps(asdict(record), indent=2, sort_keys=True))
    tokenizer.save_pretrained(str(local))
    return local


def merge_adapter(adapter_dir: str | Path, base_path: str, out: str | Path) -> Path:
    """Write to ``out`` the plain Hugging Face folder of the model trained as the adapter folder ``adapter_dir``
    over the base at ``base_path`` (the record's base resolved to something the builders load)."""
    from types import SimpleNamespace

    from peft.utils import SAFETENSORS_WEIGHTS_NAME
    from safetensors.torch import load_file

    from rlhf_core.models.builders import ModelPathError, build_causal_lm, build_scalar_model, load_tokenizer

    adapter_dir, out = Path(adapter_dir), Path(out)
    record = read_record(adapter_dir)
    tokenizer = load_tokenizer(str(adapter_dir))
    build = build_scalar_model if record.scalar else build_causal_lm
    lora = SimpleNamespace(**record.lora)
    model = build(
        base_path,
        tokenizer,
        seed=record.init_seed,
        dtype=getattr(torch, record.dtype),
        attn="sdpa",
        trust_remote_code=record.trust_remote_code,
        lora=lora,
    )
    params = dict(model.named_parameters())
    with torch.no_grad():
        for key, value in load_file(str(adapter_dir / SAFETENSORS_WEIGHTS_NAME)).items():
            name = project_name(key)
            if name not in params or params[name].shape != value.shape:
                raise ModelPathError(f"{adapter_dir}: {key} does not fit the base {record.base}; retrain the stage")
            params[name].copy_(value)
    weights = {t.name: t.value() for t in merged_tensors(model)}
    cast("PreTrainedModel", model).save_pretrained(str(out), state_dict=weights, safe_serialization=True)
    tokenizer.save_pretrained(str(out))
    return out


def local_base(adapter_dir: str | Path) -> str:
    """The base of a local adapter folder: a ``stage:<name>`` base is the folder ``<name>`` of the run folder that
    holds it (beside it, or beside the stage folder that holds a role's output, such as ``ppo/critic``), refused
    when it is not the output the adapters were trained over; any other base as recorded."""
    from rlhf_core.models.builders import ModelPathError
    from rlhf_core.storage import Manifest

    record = read_record(adapter_dir)
    if not record.base.startswith(STAGE_PREFIX):
        return record.base
    name = record.base[len(STAGE_PREFIX) :]
    folders = [parent / name for parent in Path(adapter_dir).resolve().parents]
    base = next((folder for folder in folders if (folder / MANIFEST).is_file()), folders[0])
    manifest = base / MANIFEST
    if not manifest.is_file():
        raise ModelPathError(f"{adapter_dir}: its base {record.base} is not a committed folder at {base}")
    found = Manifest.from_json(manifest.read_text()).content_hash()
    if record.base_content and found != record.base_content:
        raise ModelPathError(
            f"{adapter_dir}: {base} is not the {record.base} output these adapters were trained over (content "
            f"{found[:12]}, expected {record.base_content[:12]}); rerun the stage"
        )
    return str(base)
