"""Build models and tokenizers: bundled tiny models from config, or any Hugging Face model by path or hub name.

``builtin:<name>`` builds a Llama from ``rlhf_core/assets/models/<name>.json`` with a fixed seed and the bundled
tokenizer; everything else goes through ``AutoTokenizer`` / ``AutoModelForCausalLM`` /
``AutoModelForSequenceClassification``, so switching to a real model is a change of path.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rlhf_core.algos.losses import last_token_index

ASSETS = Path(__file__).resolve().parent.parent / "assets"
BUNDLED_TOKENIZER = ASSETS / "tokenizer"
BUILTIN_PREFIX = "builtin:"


class ModelPathError(ValueError):
    """A model or tokenizer path that is neither a local model directory, a builtin model nor a loadable hub name."""


def builtin_names() -> list[str]:
    return sorted(p.stem for p in (ASSETS / "models").glob("*.json"))


def check_model_source(path: str, key: str, *, trust_remote_code: bool = False) -> None:
    """Fail fast, before any worker starts, when ``path`` cannot be a model. ``key`` names the config key."""
    if path.startswith(BUILTIN_PREFIX):
        name = path[len(BUILTIN_PREFIX) :]
        if name not in builtin_names():
            raise ModelPathError(
                f"'{key}': unknown builtin model '{name}'; choose one of {', '.join(builtin_names())}"
            )
        return
    local = Path(path)
    if local.exists():
        if not (local / "config.json").is_file():
            raise ModelPathError(f"'{key}': {path} exists but has no config.json, so it is not a model directory")
        return
    from transformers import AutoConfig

    try:
        AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as e:  # noqa: BLE001 - any failure means the same thing to the user
        raise ModelPathError(
            f"'{key}': model path {path!r} is not a local directory and could not be loaded from the hub "
            f"({type(e).__name__}: {str(e).splitlines()[0][:200]})"
        ) from None


def load_tokenizer(model_path: str, tokenizer_path: str | None = None, *, trust_remote_code: bool = False) -> Any:
    """The tokenizer at ``tokenizer_path`` (default: the model's own; the bundled one for builtin: models), with a pad
    token (EOS when it has none). ``trust_remote_code`` allows custom tokenizer code from that directory."""
    from transformers import AutoTokenizer

    if tokenizer_path is None:
        tokenizer_path = str(BUNDLED_TOKENIZER) if model_path.startswith(BUILTIN_PREFIX) else model_path
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path, trust_remote_code=trust_remote_code)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def attn_implementation(requested: str, device: str) -> str:
    if requested != "auto":
        return requested
    if device == "cuda":
        try:
            import flash_attn  # noqa: F401

            return "flash_attention_2"
        except ImportError:
            pass
    return "sdpa"


def _builtin_config(name: str, vocab_size: int, tokenizer: Any, attn: str) -> Any:
    from transformers import AutoConfig

    spec = json.loads((ASSETS / "models" / f"{name}.json").read_text())
    spec.pop("_comment", None)
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


def build_causal_lm(
    path: str, tokenizer: Any, *, seed: int, dtype: torch.dtype, attn: str, trust_remote_code: bool = False
) -> nn.Module:
    """A causal LM: ``builtin:<name>`` built with ``seed``, else ``from_pretrained`` (``trust_remote_code`` allows the
    directory's custom modelling code)."""
    from transformers import AutoModelForCausalLM

    if path.startswith(BUILTIN_PREFIX):
        config = _builtin_config(path[len(BUILTIN_PREFIX) :], len(tokenizer), tokenizer, attn)
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(config, dtype=dtype)
    return AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, attn_implementation=attn, trust_remote_code=trust_remote_code
    )


def build_scalar_model(
    path: str, tokenizer: Any, *, seed: int, dtype: torch.dtype, attn: str, trust_remote_code: bool = False
) -> nn.Module:
    """A sequence-classification model with one output (reward model or critic) in Hugging Face format.

    Loading a causal-LM checkpoint keeps its backbone and creates the ``score`` head, which is then initialised
    N(0, 1/(hidden+1)) with ``seed`` (as OpenRLHF does); a reward-model checkpoint keeps its trained head.
    ``trust_remote_code`` allows the directory's custom modelling code (config and model).
    """
    from transformers import AutoConfig, AutoModelForSequenceClassification

    if path.startswith(BUILTIN_PREFIX):
        config = _builtin_config(path[len(BUILTIN_PREFIX) :], len(tokenizer), tokenizer, attn)
        config.num_labels = 1
        torch.manual_seed(seed)
        model = AutoModelForSequenceClassification.from_config(config, dtype=dtype)
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
        with torch.no_grad():
            std = 1.0 / (model.config.hidden_size + 1) ** 0.5
            head = score_head(model)
            head.weight.copy_(torch.randn(head.weight.shape, generator=gen) * std)
            if head.bias is not None:
                head.bias.zero_()
    return model


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
        self.backbone = getattr(hf_model, hf_model.base_model_prefix)
        self.head = score_head(hf_model)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """(B, T) ids and mask -> (B, T) values."""
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return self.head(hidden).squeeze(-1).float()

    @staticmethod
    def last_values(values: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """(B, T) values -> (B,) value at the last real token (the sequence reward)."""
        return values.gather(1, last_token_index(attention_mask).unsqueeze(1)).squeeze(1)
