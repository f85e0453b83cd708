"""Check a model source before any worker loads it: a builtin name, a hub name, or a local model directory's config,
weight files (headers only) and shapes.

Every refusal is one ``ModelPathError`` line naming the config key, the file and the fix. Weights are never read:
a safetensors file is checked by its header (8-byte little-endian length, then JSON ``{name: {dtype, shape,
data_offsets}}``) against the file size, a ``.bin`` by its zip directory (its tensors' shapes read on the meta
device). The shapes the config implies come from the model built on the meta device; checkpoint tensors are matched
by name with the base-model prefix stripped, and names the model does not have (a ``score`` head read as a causal
LM, renamed or fused weights) are left to transformers.
"""

from __future__ import annotations

import json
import math
import struct
import zipfile
from pathlib import Path
from typing import Any

from rlhf_core.errors import first_line
from rlhf_core.models.builders import BUILTIN_PREFIX, ModelPathError, builtin_names, builtin_spec, load_tokenizer

SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
BIN = "pytorch_model.bin"
BIN_INDEX = "pytorch_model.bin.index.json"
DTYPE_BYTES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E5M2": 1,
    "F8_E4M3": 1,
    "F8_E8M0": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
    "C64": 8,
}
MAX_HEADER = 100_000_000  # the safetensors library's own limit
REEXPORT = "re-export it with save_pretrained"


def check_model_source(
    path: str,
    key: str,
    *,
    trust_remote_code: bool = False,
    tokenizer: str | None = None,
    tokenizer_key: str | None = None,
) -> None:
    """Fail fast, before any worker starts, when ``path`` cannot be a model. ``key`` names the config key.

    A local directory is checked without loading its weights (``check_model_dir``): config.json, the weight
    files' headers and their shapes against the config, and that the tokenizer the stage will use loads: the one at
    ``tokenizer`` (its config key ``tokenizer_key``, default ``key``'s sibling ``tokenizer``) when given, else the
    model's own."""
    if path.startswith(BUILTIN_PREFIX):
        name = path[len(BUILTIN_PREFIX) :]
        if name not in builtin_names():
            raise ModelPathError(
                f"'{key}': unknown builtin model '{name}'; choose one of {', '.join(builtin_names())}"
            )
        if tokenizer is None:
            return  # the bundled tokenizer
    elif Path(path).exists():
        if not Path(path).is_dir():
            raise ModelPathError(f"'{key}': {path} is a file, not a model directory; point {key} at the folder")
        check_model_dir(Path(path), key, trust_remote_code=trust_remote_code)
    else:
        from transformers import AutoConfig

        try:
            AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
        except Exception as e:  # noqa: BLE001 - any failure means the same thing to the user
            raise ModelPathError(
                f"'{key}': model path {path!r} is not a local directory and could not be loaded from the hub "
                f"({first_line(e)})"
            ) from None
        if tokenizer is None:
            return  # a hub model's tokenizer comes with it; not fetched twice here
    if tokenizer is not None:
        tokenizer_key = tokenizer_key or (f"{key.rsplit('.', 1)[0]}.tokenizer" if "." in key else key)
    load_tokenizer(path, tokenizer, trust_remote_code=trust_remote_code, key=tokenizer_key or key)


def sibling_key(key: str, leaf: str) -> str:
    """``<stage>.<role>.name_or_path`` -> ``<stage>.<role>.<leaf>``."""
    return f"{key.rsplit('.', 1)[0]}.{leaf}" if "." in key else leaf


def check_model_dir(local: Path, key: str, *, trust_remote_code: bool = False) -> None:
    """Refuse ``local`` unless its config, weight files and weight shapes are what a load needs."""
    raw = read_config(local, key)
    config = auto_config(local, key, raw, trust_remote_code)
    found = weight_shapes(local, key)
    if "quantization_config" not in raw:  # quantized tensors are packed: their shapes are not the config's
        check_shapes(local, key, config, raw, found, trust_remote_code)


def read_config(local: Path, key: str) -> dict[str, Any]:
    path = local / "config.json"
    if not path.is_file():
        raise ModelPathError(
            f"'{key}': {local} has no config.json, so it is not a model directory; point {key} "
            "at a folder written by save_pretrained"
        )
    try:
        raw = json.loads(path.read_text())
    except UnicodeDecodeError:
        raise ModelPathError(f"'{key}': {path} is not text; {REEXPORT}") from None
    except json.JSONDecodeError as e:
        raise ModelPathError(
            f"'{key}': {path} is not valid JSON (line {e.lineno}, column {e.colno}: {e.msg}); fix the file"
        ) from None
    if not isinstance(raw, dict):
        raise ModelPathError(f"'{key}': {path} holds a JSON {type(raw).__name__}, not an object; {REEXPORT}")
    return raw


def auto_config(local: Path, key: str, raw: dict[str, Any], trust_remote_code: bool) -> Any:
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    path = local / "config.json"
    model_type = raw.get("model_type")
    if not model_type or not isinstance(model_type, str):
        raise ModelPathError(
            f"'{key}': {path} has no model_type; add the model's type (e.g. \"model_type\": "
            '"llama") or re-export it with save_pretrained'
        )
    custom = isinstance(raw.get("auto_map"), dict) and "AutoConfig" in raw["auto_map"]
    if model_type not in CONFIG_MAPPING:
        if not custom:
            raise ModelPathError(
                f"'{key}': {path} has model_type '{model_type}', which this transformers does not "
                "know; fix model_type or upgrade transformers"
            )
        if not trust_remote_code:
            raise ModelPathError(
                f"'{key}': {path} has model_type '{model_type}' with custom code (auto_map); set "
                f"{sibling_key(key, 'trust_remote_code')}=true if you trust it"
            )
    try:
        return AutoConfig.from_pretrained(str(local), trust_remote_code=trust_remote_code)
    except Exception as e:  # noqa: BLE001 - any failure here means a config a load would reject
        raise ModelPathError(
            f"'{key}': {path} does not load as a {model_type} config ({first_line(e)}); fix it"
        ) from None


def weight_shapes(local: Path, key: str) -> dict[str, tuple[str, tuple[int, ...] | None]]:
    """{tensor name: (file name, shape or None when unknown)} of the weights a load reads, each file checked."""
    if (local / SAFETENSORS).is_file():
        return {n: (SAFETENSORS, s) for n, s in safetensors_header(local / SAFETENSORS, key).items()}
    if (local / SAFETENSORS_INDEX).is_file():
        return sharded(local, key, SAFETENSORS_INDEX, safetensors_header)
    if (local / BIN).is_file():
        return {n: (BIN, s) for n, s in bin_header(local / BIN, key).items()}
    if (local / BIN_INDEX).is_file():
        return sharded(local, key, BIN_INDEX, bin_header)
    raise ModelPathError(
        f"'{key}': {local} has no weights ({SAFETENSORS}, {SAFETENSORS_INDEX}, {BIN} or "
        f"{BIN_INDEX}); copy the weight files into it or re-export the model"
    )


def sharded(local: Path, key: str, index_name: str, header: Any) -> dict[str, tuple[str, tuple[int, ...] | None]]:
    index = local / index_name
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        assert isinstance(weight_map, dict) and weight_map and all(isinstance(f, str) for f in weight_map.values())
    except Exception:  # noqa: BLE001 - unreadable, not JSON, no weight_map: all the same to the user
        raise ModelPathError(f"'{key}': {index} is not a shard index (JSON with a weight_map); {REEXPORT}") from None
    shards = sorted(set(weight_map.values()))
    missing = [f for f in shards if not (local / f).is_file()]
    if missing:
        raise ModelPathError(
            f"'{key}': {index} lists {len(missing)} shard(s) missing from {local} "
            f"({', '.join(missing[:3])}); copy every shard"
        )
    shapes = {f: header(local / f, key) for f in shards}
    found: dict[str, tuple[str, tuple[int, ...] | None]] = {}
    for name, f in weight_map.items():
        if name not in shapes[f]:
            raise ModelPathError(f"'{key}': {index} places tensor {name} in {f}, which does not hold it; {REEXPORT}")
        found[name] = (f, shapes[f][name])
    return found


def safetensors_header(path: Path, key: str) -> dict[str, tuple[int, ...]]:
    """{tensor name: shape} from the header of a safetensors file, checked against the file's size."""
    bad = f"'{key}': {path} is not a readable safetensors file"
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ModelPathError(f"{bad} ({size} bytes); {REEXPORT}")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8 or n > MAX_HEADER:
            raise ModelPathError(
                f"{bad} (header length {n} but the file has {size} bytes: truncated or not safetensors); {REEXPORT}"
            )
        text = f.read(n)
    try:
        header = json.loads(text)
        assert isinstance(header, dict)
    except Exception:  # noqa: BLE001 - bad UTF-8, bad JSON, not an object
        raise ModelPathError(f"{bad} (its header is not JSON); {REEXPORT}") from None
    data = size - 8 - n
    shapes: dict[str, tuple[int, ...]] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            shape = tuple(int(d) for d in info["shape"])
            begin, end = (int(o) for o in info["data_offsets"])
            width = DTYPE_BYTES[info["dtype"]]
        except Exception:  # noqa: BLE001 - a malformed entry
            raise ModelPathError(f"{bad} (header entry {name} is malformed); {REEXPORT}") from None
        if end > data:
            raise ModelPathError(
                f"{bad} (tensor {name} ends at byte {end} of {data} data bytes: the file is "
                "truncated); copy it again or re-export the model"
            )
        if end - begin != math.prod(shape) * width:
            raise ModelPathError(f"{bad} (tensor {name}: {end - begin} bytes for shape {list(shape)}); {REEXPORT}")
        shapes[name] = shape
    return shapes


def bin_header(path: Path, key: str) -> dict[str, tuple[int, ...] | None]:
    """{tensor name: shape} of a torch zip checkpoint, read on the meta device (no data); {} for the legacy format."""
    import torch

    bad = f"'{key}': {path} is not a readable PyTorch checkpoint"
    with path.open("rb") as f:
        magic = f.read(4)
    if magic[:1] == b"\x80":  # legacy (pre-zip) pickle: no cheap way to list it
        return {}
    if magic != b"PK\x03\x04":
        raise ModelPathError(f"{bad} (neither zip nor pickle); {REEXPORT} (safetensors preferred)")
    try:
        with zipfile.ZipFile(path) as z:
            z.infolist()
        state = torch.load(path, map_location="meta", mmap=True, weights_only=True)
    except Exception as e:  # noqa: BLE001 - truncated zip, bad pickle, disallowed objects
        raise ModelPathError(f"{bad} ({first_line(e)}); copy it again or {REEXPORT}") from None
    if not isinstance(state, dict):
        raise ModelPathError(f"{bad} (it holds a {type(state).__name__}, not a state dict); {REEXPORT}")
    return {k: tuple(v.shape) if isinstance(v, torch.Tensor) else None for k, v in state.items()}


def expected_model(config: Any, raw: dict[str, Any], trust_remote_code: bool) -> Any:
    """The model the config builds, on the meta device. A sequence-classification checkpoint is built as the
    one-output scalar model that ``build_scalar_model`` loads."""
    import copy

    import torch
    from transformers import AutoModel, AutoModelForCausalLM, AutoModelForSequenceClassification

    architectures = raw.get("architectures") or []
    if any(str(a).endswith("ForSequenceClassification") for a in architectures):
        config = copy.deepcopy(config)
        config.num_labels = 1
        classes = [AutoModelForSequenceClassification, AutoModel]
    else:
        classes = [AutoModelForCausalLM, AutoModel]
    error: Exception | None = None
    for auto_cls in classes:
        try:
            with torch.device("meta"):
                return auto_cls.from_config(config, trust_remote_code=trust_remote_code)
        except ValueError as e:  # this auto class has no mapping for the config: try the next one
            error = error or e
    assert error is not None
    raise error  # the first class's reason


def renamed(name: str) -> str:
    """transformers' legacy renames on load (LayerNorm ``gamma``/``beta``)."""
    head, _, leaf = name.rpartition(".")
    return f"{head}.{ {'gamma': 'weight', 'beta': 'bias'}.get(leaf, leaf) }" if head else name


def check_shapes(
    local: Path,
    key: str,
    config: Any,
    raw: dict[str, Any],
    found: dict[str, tuple[str, tuple[int, ...] | None]],
    trust_remote_code: bool,
) -> None:
    """Refuse a tensor whose shape is not the config's; and, for a model without weight conversions on load, a
    checkpoint that lacks some of the config's tensors (tied copies, a classification head and what the model
    class itself tolerates aside): transformers would initialise those at random."""
    path = local / "config.json"
    try:
        model = expected_model(config, raw, trust_remote_code)
    except Exception as e:  # noqa: BLE001 - a config transformers cannot build a model from
        raise ModelPathError(f"'{key}': {path} does not build a model ({first_line(e)}); fix the config") from None
    prefix = model.base_model_prefix

    def plain(name: str) -> str:
        name = renamed(name)
        return name[len(prefix) + 1 :] if prefix and name.startswith(prefix + ".") else name

    want = {plain(k): tuple(v.shape) for k, v in model.state_dict().items()}
    have = {plain(k) for k in found}
    for name, (file, shape) in found.items():
        target = want.get(plain(name))
        if shape is not None and target is not None and tuple(shape) != target:
            raise ModelPathError(
                f"'{key}': tensor {name} in {local / file} has shape {list(shape)} but {path} "
                f"implies {list(target)}; the config does not match the weights (fix the config "
                "or re-export the model)"
            )
    if not found or any(s is None for _, s in found.values()) or converted(model):
        return
    missing = sorted(missing_names(model, plain, have))
    if missing:
        raise ModelPathError(
            f"'{key}': the weights in {local} lack {len(missing)} tensor(s) that {path} implies "
            f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}); the config does not "
            "match the weights (fix the config or re-export the model)"
        )


def converted(model: Any) -> bool:
    """Whether transformers renames or fuses this model's checkpoint tensors on load (then names do not match)."""
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    except ImportError:
        return True
    model_type = getattr(model.config, "model_type", None)
    return any(get_checkpoint_conversion_mapping(n) for n in (type(model).__name__, model_type) if n)


def missing_names(model: Any, plain: Any, have: set[str]) -> list[str]:
    """The config's state-dict tensors absent from ``have`` (plain names); a tied group counts once, present when
    any of its names is; classification heads, tied ``lm_head`` and the class's own tolerated names excepted."""
    import re

    ignore = [re.compile(p) for p in (getattr(model, "_keys_to_ignore_on_load_missing", None) or [])]
    tied = getattr(model.config, "tie_word_embeddings", False) or model.config.get_text_config().tie_word_embeddings
    groups: dict[int, list[str]] = {}  # tied parameters: one Parameter under several names
    for name, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(plain(name))
    wanted = {plain(w) for w in model.state_dict()}
    candidates = [*groups.values(), *([plain(n)] for n, _ in model.named_buffers(remove_duplicate=False))]
    missing = []
    for names in candidates:
        names = [n for n in names if n in wanted]
        if not names or any(n in have for n in names) or any(r.search(n) for r in ignore for n in names):
            continue
        if names[0].split(".")[0] in ("score", "classifier") or (tied and names[0].startswith("lm_head.")):
            continue
        missing.append(names[0])
    return missing


# Hybrid and pure state-space (Mamba) families: a recurrent state runs along each row, so the samples packed into one
# row would leak state into each other (``position_ids`` never reach the scan), and vLLM's CPU build has no kernel for
# their selective-scan prefill.
STATE_SPACE_MODEL_TYPES = frozenset(
    {
        "jamba",
        "mamba",
        "mamba2",
        "falcon_mamba",
        "zamba",
        "zamba2",
        "bamba",
        "nemotron_h",
        "granitemoehybrid",
        "falcon_h1",
    }
)


def model_type(path: str) -> str | None:
    """The ``model_type`` of a builtin or a local model directory, read from its config file (None: a hub name or a
    directory without one)."""
    try:
        if path.startswith(BUILTIN_PREFIX):
            return builtin_spec(path[len(BUILTIN_PREFIX) :]).get("model_type")
        return json.loads((Path(path) / "config.json").read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None


def has_state_space_layers(path: str) -> bool:
    return model_type(path) in STATE_SPACE_MODEL_TYPES
