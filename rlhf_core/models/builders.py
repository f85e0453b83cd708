"""Build models and tokenizers: bundled tiny models from config, or any Hugging Face model by path or hub name.

``builtin:<name>`` builds a Llama from ``rlhf_core/assets/models/<name>.json`` with a fixed seed and the bundled
tokenizer; everything else goes through ``AutoTokenizer`` / ``AutoModelForCausalLM`` /
``AutoModelForSequenceClassification``, so switching to a real model is a change of path.

Under ZeRO-3 the distributed layer builds inside ``deepspeed.zero.Init`` with transformers' DeepSpeed config set
(``rlhf_core.distributed.strategy``), so each parameter is partitioned over the ranks as soon as its module exists.
A builtin model must still get the weights of the plain build with the same seed: ``init_from_config`` builds it the
plain way (same modules, same RNG draws, in the same order) and gathers each module's parameters only around its
Hugging Face initialisation. Partitioned parameters are recognised by their ZeRO attributes (``ds_id``) and driven
through their own methods, so this module does not import DeepSpeed.
"""

from __future__ import annotations

import importlib
import json
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from rlhf_core.algos.losses import last_token_index
from rlhf_core.errors import first_line
from rlhf_core.models.partitioned import full_values

if TYPE_CHECKING:
    from transformers import PreTrainedModel

ASSETS = Path(__file__).resolve().parent.parent / "assets"
BUNDLED_TOKENIZER = ASSETS / "tokenizer"
BUILTIN_PREFIX = "builtin:"


class ModelPathError(ValueError):
    """A model or tokenizer path that is neither a local model directory, a builtin model nor a loadable hub name."""


def builtin_names() -> list[str]:
    return sorted(p.stem for p in (ASSETS / "models").glob("*.json"))


def load_tokenizer(
    model_path: str, tokenizer_path: str | None = None, *, trust_remote_code: bool = False, key: str | None = None
) -> Any:
    """The tokenizer at ``tokenizer_path`` (default: the model's own; the bundled one for builtin: models), with a pad
    token (EOS when it has none). ``trust_remote_code`` allows custom tokenizer code from that directory. One that
    does not load raises ``ModelPathError`` naming the path (and ``key``, the config key it came from, when given)."""
    from transformers import AutoTokenizer

    if tokenizer_path is None:
        tokenizer_path = str(BUNDLED_TOKENIZER) if model_path.startswith(BUILTIN_PREFIX) else model_path
    try:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_path, trust_remote_code=trust_remote_code)
    except Exception as e:  # noqa: BLE001 - missing files, a broken tokenizer.json, custom code: one line each
        raise ModelPathError(tokenizer_error(tokenizer_path, key, e)) from None
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def stop_ids(model_path: str, tokenizer: Any) -> tuple[int, ...]:
    """The token ids that end a response: the tokenizer's EOS first, then the ``eos_token_id`` of the model's
    ``generation_config.json`` (an id or a list). Instruct models list their end-of-turn token there
    (Llama-3-Instruct: <|end_of_text|> and <|eot_id|>; Qwen2.5-Instruct: <|im_end|> and <|endoftext|>), and vLLM and
    Hugging Face ``generate`` stop on each of them. A file that does not parse raises ``ModelPathError``."""
    ids = [tokenizer.eos_token_id]
    path = Path(model_path) / "generation_config.json"
    if not model_path.startswith(BUILTIN_PREFIX) and path.is_file():
        try:
            value = json.loads(path.read_text(encoding="utf-8")).get("eos_token_id")
        except (ValueError, AttributeError) as e:
            raise ModelPathError(f"{path}: not a JSON object ({first_line(e)})") from None
        ids += value if isinstance(value, list) else [value]
    return tuple(dict.fromkeys(i for i in ids if isinstance(i, int)))


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "tiktoken.model")


def tokenizer_error(path: str, key: str | None, e: Exception) -> str:
    where = f"'{key}': " if key else ""
    local = Path(path)
    if local.is_dir() and not any((local / f).is_file() for f in TOKENIZER_FILES):
        if key and key.endswith(".tokenizer"):
            fix = f"point {key} at a tokenizer folder"
        else:
            fix = f"set {key.rsplit('.', 1)[0] if key else 'model'}.tokenizer to one"
        return (
            f"{where}{path} has no tokenizer files ({', '.join(TOKENIZER_FILES[:3])}, ...); copy the tokenizer "
            f"into it (tokenizer.save_pretrained) or {fix}"
        )
    return (
        f"{where}the tokenizer at {path} does not load ({first_line(e)}); fix or re-save it with "
        "tokenizer.save_pretrained"
    )


def attn_implementation(requested: str, device: str) -> str:
    if requested != "auto":
        return requested
    if device == "cuda":
        try:
            importlib.import_module("flash_attn")  # an optional package (CUDA only): installed or not

            return "flash_attention_2"
        except ImportError:
            pass
    return "sdpa"


def builtin_spec(name: str) -> dict:
    """A builtin's config keys (``rlhf_core/assets/models/<name>.json``), model_type included."""
    spec = json.loads((ASSETS / "models" / f"{name}.json").read_text())
    spec.pop("_comment", None)
    return spec


def model_config(path: str, trust_remote_code: bool = False) -> Any:
    """The config of the model at ``path`` alone: no weights, no tokenizer (a builtin's without its vocabulary)."""
    from transformers import AutoConfig

    if path.startswith(BUILTIN_PREFIX):
        spec = builtin_spec(path[len(BUILTIN_PREFIX) :])
        return AutoConfig.for_model(spec.pop("model_type"), **spec)
    return AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)


def _builtin_config(name: str, vocab_size: int, tokenizer: Any, attn: str) -> Any:
    from transformers import AutoConfig

    spec = builtin_spec(name)
    model_type = spec.pop("model_type")
    return AutoConfig.for_model(
        model_type,
        vocab_size=vocab_size,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        attn_implementation=attn,
        **spec,
    )


@contextmanager
def _gathered_hf_init() -> Iterator[None]:
    """Run each module's Hugging Face weight initialisation on its gathered parameters (transformers calls it per
    module, in post-order, from each ``post_init``: by then zero.Init has partitioned the module's parameters)."""
    from transformers.modeling_utils import PreTrainedModel

    original = PreTrainedModel._initialize_weights

    def initialize(self: PreTrainedModel, module: nn.Module, is_custom_code: bool = False) -> None:
        with full_values(list(module.parameters(recurse=False))):
            original(self, module, is_custom_code)

    PreTrainedModel._initialize_weights = initialize  # type: ignore[method-assign]
    try:
        yield
    finally:
        PreTrainedModel._initialize_weights = original  # type: ignore[method-assign]


def init_from_config(auto_cls: Any, config: Any, *, seed: int, dtype: torch.dtype) -> PreTrainedModel:
    """``auto_cls.from_config(config)`` with ``seed``: the same weights whether or not the model is built under ZeRO-3.

    transformers' own ZeRO-3 path skips the construction-time initialisation and re-initialises on rank 0 afterwards,
    a different RNG stream than the plain build. Instead, under ZeRO-3 (transformers' DeepSpeed config set and the
    caller's ``deepspeed.zero.Init`` open), we keep the plain construction (``set_zero3_state`` stops transformers
    from opening its own zero.Init) and gather each module's partition only while it is initialised: every rank draws
    the plain build's stream on full tensors, one module at a time."""
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    torch.manual_seed(seed)
    if not is_deepspeed_zero3_enabled():
        return auto_cls.from_config(config, dtype=dtype)
    from transformers.modeling_utils import set_zero3_state

    with set_zero3_state(), _gathered_hf_init():
        return auto_cls.from_config(config, dtype=dtype)


def build_causal_lm(
    path: str,
    tokenizer: Any,
    *,
    seed: int,
    dtype: torch.dtype,
    attn: str,
    trust_remote_code: bool = False,
    lora: Any = None,
) -> nn.Module:
    """A causal LM: ``builtin:<name>`` built with ``seed``, else ``from_pretrained`` (``trust_remote_code`` allows the
    directory's custom modelling code); with LoRA adapters when ``lora`` (a ``lora`` config section) has a rank."""
    from transformers import AutoModelForCausalLM

    if path.startswith(BUILTIN_PREFIX):
        config = _builtin_config(path[len(BUILTIN_PREFIX) :], len(tokenizer), tokenizer, attn)
        model = init_from_config(AutoModelForCausalLM, config, seed=seed, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, attn_implementation=attn, trust_remote_code=trust_remote_code
        )
    return _with_adapters(model, lora, seed)


def model_skeleton(
    path: str, tokenizer: Any, lora: Any = None, *, scalar: bool = False, trust_remote_code: bool = False
) -> nn.Module:
    """The model at ``path`` built from its config on the meta device (no weights, no memory), with the adapters of
    ``lora``: what a check of the model's shape needs before any worker loads it."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    if path.startswith(BUILTIN_PREFIX):
        config = _builtin_config(path[len(BUILTIN_PREFIX) :], len(tokenizer), tokenizer, "sdpa")
    else:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    auto = AutoModelForSequenceClassification if scalar else AutoModelForCausalLM
    if scalar:
        config.num_labels = 1
    with torch.device("meta"):
        model = auto.from_config(config, trust_remote_code=trust_remote_code)
    return _with_adapters(model, lora, 0, head=score_head(model) if scalar else None)


PROBE_VOCAB = 64  # the shrunken copy's vocabulary: the token ids a gradient probe feeds it are below this


def shrunk_model(
    path: str, tokenizer: Any, lora: Any, *, scalar: bool = False, trust_remote_code: bool = False
) -> nn.Module:
    """A copy of the model at ``path`` built from its config with random fp32 weights, few layers (``probe_layers``)
    and a vocabulary of ``PROBE_VOCAB``, every expert routed, and the adapters of ``lora`` added as training adds
    them (a 4-bit base aside: the adapters' path through the model is the same): what a check of the adapters'
    gradients runs a forward and backward on, in well under a second for the tiny models."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    if path.startswith(BUILTIN_PREFIX):
        config = _builtin_config(path[len(BUILTIN_PREFIX) :], len(tokenizer), tokenizer, "sdpa")
    else:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    text = config.get_text_config()
    n = probe_layers(text)
    if isinstance(vars(text).get("layer_types"), list):  # (Jamba derives its own from the periods)
        text.layer_types = text.layer_types[:n]
    text.num_hidden_layers = n
    text.vocab_size = min(text.vocab_size, PROBE_VOCAB)
    for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
        if isinstance(getattr(text, name, None), int) and getattr(text, name) >= text.vocab_size:
            setattr(text, name, None)
    experts = next((getattr(text, k) for k in EXPERT_KEYS if isinstance(getattr(text, k, None), int)), 0)
    if experts and isinstance(getattr(text, "num_experts_per_tok", None), int):
        text.num_experts_per_tok = experts  # an expert no probe token reaches would get no gradient
        if isinstance(getattr(text, "n_group", None), int):
            text.topk_group = text.n_group
    if scalar:
        config.num_labels = 1
    auto = AutoModelForSequenceClassification if scalar else AutoModelForCausalLM
    torch.manual_seed(0)
    model = auto.from_config(config, dtype=torch.float32, trust_remote_code=trust_remote_code)
    plain = replace(lora, load_in_4bit=False) if getattr(lora, "load_in_4bit", False) else lora
    return _with_adapters(model, plain, 0, head=score_head(model) if scalar else None)


EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")


def probe_layers(config: Any) -> int:
    """The fewest leading layers in which each kind of layer of the model appears: Jamba's attention and expert
    layers repeat with their periods (``attn_layer_period``, ``expert_layer_period``), ``layer_types`` lists each
    layer's kind, DeepSeek's first ``first_k_dense_replace`` layers are dense; one layer for a uniform stack."""
    periods = [getattr(config, k, None) for k in ("attn_layer_period", "expert_layer_period")]
    n = math.lcm(*(p for p in periods if isinstance(p, int) and p > 0))
    types = getattr(config, "layer_types", None)
    if isinstance(types, list) and types:
        n = max(n, *(types.index(t) + 1 for t in set(types)))
    dense_first = getattr(config, "first_k_dense_replace", None)
    if isinstance(dense_first, int):
        n = max(n, dense_first + 1)
    return min(n, config.num_hidden_layers)


def _with_adapters(model: PreTrainedModel, lora: Any, seed: int, head: nn.Module | None = None) -> nn.Module:
    """``model`` with LoRA adapters (``models.lora``) when ``lora`` has a rank, its other linear layers quantised to
    4 bits first with ``lora.load_in_4bit`` (QLoRA); a value head ``head`` trains fully and is never quantised."""
    if lora is None or lora.rank == 0:
        return model
    from rlhf_core.models.lora import add_adapters, quantize_4bit

    weight = next(model.parameters())
    if lora.load_in_4bit and weight.device.type != "meta":  # (a skeleton only checks the targets)
        quantize_4bit(model, weight.dtype, keep=[] if head is None else [head])
    if head is None:
        return add_adapters(model, lora, seed=seed)
    add_adapters(getattr(model, model.base_model_prefix), lora, seed=seed)  # the backbone; the head stays whole
    return model


def build_scalar_model(
    path: str,
    tokenizer: Any,
    *,
    seed: int,
    dtype: torch.dtype,
    attn: str,
    trust_remote_code: bool = False,
    lora: Any = None,
) -> nn.Module:
    """A sequence-classification model with one output (reward model or critic) in Hugging Face format; with LoRA
    adapters on its backbone when ``lora`` has a rank (the head then trains fully).

    Loading a causal-LM checkpoint keeps its backbone and creates the ``score`` head, which is then initialised
    N(0, 1/(hidden+1)) with ``seed`` (as OpenRLHF does); a reward-model checkpoint keeps its trained head.
    ``trust_remote_code`` allows the directory's custom modelling code (config and model).
    """
    from transformers import AutoConfig, AutoModelForSequenceClassification

    if path.startswith(BUILTIN_PREFIX):
        config = _builtin_config(path[len(BUILTIN_PREFIX) :], len(tokenizer), tokenizer, attn)
        config.num_labels = 1
        model = init_from_config(AutoModelForSequenceClassification, config, seed=seed, dtype=dtype)
        fresh_head = True
    else:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
        fresh_head = not any("ForSequenceClassification" in a for a in (config.architectures or []))
        model = AutoModelForSequenceClassification.from_pretrained(
            path, num_labels=1, dtype=dtype, attn_implementation=attn, trust_remote_code=trust_remote_code
        )
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id
    if fresh_head:
        gen = torch.Generator().manual_seed(seed)
        head = score_head(model)
        with torch.no_grad(), full_values(list(head.parameters())):
            std = 1.0 / (model.config.hidden_size + 1) ** 0.5
            head.weight.copy_(torch.randn(head.weight.shape, generator=gen) * std)
            if head.bias is not None:
                head.bias.zero_()
    return _with_adapters(model, lora, seed, head=score_head(model))


def score_head(model: nn.Module) -> nn.Linear:
    head = getattr(model, "score", None)
    if not isinstance(head, nn.Linear):
        raise ModelPathError(
            f"{type(model).__name__} has no linear 'score' head; use a *ForSequenceClassification model"
        )
    return head


class ScalarHeadModel(nn.Module):
    """Per-token scalar values from a sequence-classification model's backbone and ``score`` head.

    We pool ourselves (from the attention mask) instead of relying on the model's pad-token pooling, which breaks
    when a tokenizer's pad token is its EOS token.
    """

    def __init__(self, hf_model: nn.Module):
        super().__init__()
        self.hf_model = hf_model
        self.backbone = getattr(hf_model, cast("PreTrainedModel", hf_model).base_model_prefix)
        self.head = score_head(hf_model)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        router_logits: list | None = None,
    ) -> torch.Tensor:
        """(B, T) ids and mask -> (B, T) values. Packed rows (``rlhf_core.algos.packing``) come without a mask and
        with ``position_ids`` that restart at each sample. ``router_logits``: an MoE backbone's router logits of
        this forward are appended to it."""
        extra = {} if router_logits is None else {"output_router_logits": True}
        out = self.backbone(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False, **extra
        )
        if router_logits is not None:
            router_logits.extend(getattr(out, "router_logits", None) or ())
        return self.head(out.last_hidden_state).squeeze(-1).float()

    @staticmethod
    def last_values(values: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """(B, T) values -> (B,) value at the last real token (the sequence reward)."""
        return values.gather(1, last_token_index(attention_mask).unsqueeze(1)).squeeze(1)
