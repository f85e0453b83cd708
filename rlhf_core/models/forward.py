"""The forwards every stage and PPO role runs: without padding (``rlhf_core.algos.packing``) and, for causal LMs,
with log-probs of the chosen tokens only, chunked (``rlhf_core.algos.losses.chunked_token_logprobs``).

``model`` is a Hugging Face model, a :class:`~rlhf_core.models.builders.ScalarHeadModel`, or a DeepSpeed engine
around one (called as the engine, so that ZeRO-3 gathers the partitions as usual). Inputs and outputs keep the
padded (B, T) layout; the packing happens inside.

Causal LMs whose forward is ``lm_head(final hidden states)`` (the families in ``HIDDEN_PATH_MODEL_TYPES``) skip the
full logits: the forward is asked for no logits at all (``logits_to_keep`` = no position), the final hidden states
are caught on their way out of the base model, and the LM head runs on the scored positions only, a chunk at a
time. Other families (logit soft-capping or scaling in the forward, e.g. Gemma 2, Cohere, Granite) take their logits
from the forward and are scored a chunk at a time from there.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from rlhf_core.algos.losses import LOGPROB_CHUNK_ELEMENTS, chunked_token_logprobs, logprob_chunk_size
from rlhf_core.algos.moe import load_balancing_loss
from rlhf_core.algos.packing import Packing, plan_packing
from rlhf_core.models.partitioned import full_copies

if TYPE_CHECKING:
    from peft.tuners.lora import LoraLayer
    from transformers import PreTrainedModel

# Families whose causal-LM forward computes exactly ``logits = lm_head(last_hidden_state)``.
HIDDEN_PATH_MODEL_TYPES = frozenset(
    {"llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "phi3", "olmo2", "deepseek_v3"}
)
_NO_POSITION = torch.zeros(0, dtype=torch.long)


def unwrap(model: Any) -> nn.Module:
    """The module inside a DeepSpeed engine (or the model itself)."""
    inner = getattr(model, "module", None)
    return inner if isinstance(inner, nn.Module) else model


def packing_for(model: nn.Module, attention_mask: torch.Tensor) -> Packing:
    """The packing of a batch for ``model``: one row for flash-attention (its varlen kernel's cost is per sample),
    else rows no wider than the longest sample (dense attention's cost grows with a row's width squared)."""
    config = getattr(model, "config", None) or getattr(getattr(model, "hf_model", None), "config", None)
    flash = getattr(config, "_attn_implementation", None) == "flash_attention_2"
    return plan_packing(attention_mask, max_tokens=int(attention_mask.sum()) if flash else None)


def uses_hidden_path(hf: PreTrainedModel) -> bool:
    """True when ``hf``'s logits are its LM head over the final hidden states and its forward takes
    ``logits_to_keep``: then :func:`causal_lm_logprobs` never asks it for the full logits."""
    model_type = getattr(getattr(hf, "config", None), "model_type", None)
    return (
        model_type in HIDDEN_PATH_MODEL_TYPES
        and hf.get_output_embeddings() is not None
        and "logits_to_keep" in inspect.signature(hf.forward).parameters
    )


def _final_hidden(model: Any, hf: PreTrainedModel, **inputs: Any) -> tuple[torch.Tensor, Any]:
    """The base model's last hidden state of a forward of ``model`` that computes no logits, and its router logits
    (an MoE model asked for them with ``output_router_logits``; else None)."""
    caught: list[Any] = []

    def catch(_module: nn.Module, _args: Any, output: Any) -> None:
        caught.append(output)

    handle = hf.base_model.register_forward_hook(catch)
    try:
        model(**inputs, logits_to_keep=_NO_POSITION.to(inputs["input_ids"].device), use_cache=False)
    finally:
        handle.remove()
    out = caught[-1]
    if isinstance(out, tuple):
        return out[0], None
    return out.last_hidden_state, getattr(out, "router_logits", None)


def _append_aux_loss(aux_loss: list, hf: PreTrainedModel, router_logits: Any, real: torch.Tensor) -> None:
    """The MoE load-balancing loss of the forward over its ``real`` tokens (``algos.moe``), appended to
    ``aux_loss``; a model without a router refuses."""
    if not router_logits:
        raise ValueError(f"{type(hf).__name__} returned no router logits: the MoE auxiliary loss needs an MoE model")
    aux_loss.append(load_balancing_loss(router_logits, int(hf.config.num_experts_per_tok), real.reshape(-1)))


def _head_function(head: nn.Linear) -> Any:
    """The LM head as the chunk loop applies it. With autograd off, or a head that does not train (LoRA, a frozen
    model), its weight is read once (under ZeRO-3 gathered once, ``partitioned.full_copies``) and applied to every
    chunk: a module call per chunk would fetch it each time (about 1 GiB at a 128k vocabulary), and the recomputation
    of a checkpointed chunk in backward would find a frozen, partitioned weight empty. A head that trains is called as
    a module, so that ZeRO-3's hooks see its gradient."""
    params = list(head.parameters())
    if torch.is_grad_enabled() and any(p.requires_grad for p in params):
        return head
    copies = full_copies([head.weight] + ([head.bias] if head.bias is not None else []))
    weight, bias = copies[0], (copies[1] if len(copies) > 1 else None)
    return lambda h: F.linear(h, weight, bias)


def causal_lm_logprobs(
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    score_mask: torch.Tensor,
    *,
    temperature: float = 1.0,
    pack: bool = True,
    chunk_elements: int = LOGPROB_CHUNK_ELEMENTS,
    with_entropy: bool = False,
    aux_loss: list | None = None,
) -> Any:
    """log p(input_ids[:, t+1] | input_ids[:, :t+1]) where ``score_mask[:, t]`` is 1, 0 elsewhere.

    Args:
        model: a causal LM (or a DeepSpeed engine around one).
        input_ids: (B, T); attention_mask: (B, T), 1 on real tokens.
        score_mask: (B, T-1), 1 where the next token is scored (``action_mask``, SFT's ``loss_mask[:, 1:]``); the
            scored tokens must be real.
        temperature: > 0; log-probs of the logits divided by it.
        pack: remove the padding (packed rows with restarting ``position_ids``) instead of masking it.
        chunk_elements: the logits of one chunk of scored positions hold at most this many elements
            (positions x vocabulary; at least one position).
        with_entropy: also the entropy of each scored position's next-token distribution (the actor's entropy
            bonus), from the same chunks of logits.
        aux_loss: a Mixture-of-Experts model's load-balancing loss of this forward, over its real tokens only (packed
            rows end in filler tokens, which the router still routes), is appended to this list.
    Returns:
        (B, T-1) float32; with ``with_entropy``, (log-probs, entropies), both (B, T-1) float32.
    """
    hf = cast("PreTrainedModel", unwrap(model))  # a causal LM: a Hugging Face model
    b, t = score_mask.bool().nonzero(as_tuple=True)
    targets = input_ids[b, t + 1]
    if pack:
        packing = packing_for(hf, attention_mask)
        inputs: dict[str, Any] = {"input_ids": packing.pack(input_ids), "position_ids": packing.position_ids}
        rows, cols = packing.locate(b, t)
        real = packing.pack(attention_mask)
    else:
        inputs = {"input_ids": input_ids, "attention_mask": attention_mask}
        rows, cols = b, t
        real = attention_mask
    if aux_loss is not None:
        inputs["output_router_logits"] = True
    if uses_hidden_path(hf):
        head = cast(nn.Linear, hf.get_output_embeddings())  # the LM head (uses_hidden_path: present, a linear layer)
        hidden, router_logits = _final_hidden(model, hf, **inputs)
        tether = _head_function(head)(hidden[:1, :1]).sum() if b.numel() == 0 else None  # see below
        hidden = hidden[rows, cols]
        chunk = logprob_chunk_size(head.out_features, chunk_elements)
        scored = chunked_token_logprobs(
            hidden, targets, _head_function(head), temperature, chunk, with_entropy=with_entropy
        )
    else:
        output = model(**inputs, use_cache=False)
        logits, router_logits = output.logits[rows, cols], getattr(output, "router_logits", None)
        tether = output.logits[:1, :1].sum() if b.numel() == 0 else None
        chunk = logprob_chunk_size(logits.size(-1), chunk_elements)
        scored = chunked_token_logprobs(logits, targets, nn.Identity(), temperature, chunk, with_entropy=with_entropy)
    if aux_loss is not None:
        _append_aux_loss(aux_loss, hf, router_logits, real)
    parts = scored if isinstance(scored, tuple) else (scored,)  # a tuple exactly when with_entropy
    outs = []
    for values in parts:
        out = torch.zeros(score_mask.shape, dtype=torch.float32, device=values.device)
        out[b, t] = values
        if tether is not None:  # nothing scored (a batch filtered to empty): zeros that still hang on the forward
            out = out + 0.0 * tether  # (one position, head included), so a backward reaches every parameter
        outs.append(out)
    return tuple(outs) if with_entropy else outs[0]


def scalar_values(
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    pack: bool = True,
    aux_loss: list | None = None,
):
    """(B, T) per-token values of a ScalarHeadModel (or an engine around one); 0 on padding when packed. With
    ``aux_loss``, an MoE backbone's load-balancing loss over the real tokens is appended to it (as in
    ``causal_lm_logprobs``)."""
    routed = None if aux_loss is None else []
    if not pack:
        values = model(input_ids, attention_mask, None, routed)
        real = attention_mask
    else:
        packing = packing_for(unwrap(model), attention_mask)
        values = packing.unpack(model(packing.pack(input_ids), None, packing.position_ids, routed))
        real = packing.pack(attention_mask)
    if aux_loss is not None:
        _append_aux_loss(aux_loss, cast("PreTrainedModel", unwrap(model).hf_model), routed, real)
    return values


def adapters_without_gradient(model: nn.Module, *, scalar: bool = False) -> list[str]:
    """The LoRA layers of ``model`` (a causal LM, or with ``scalar`` a sequence-classification model) whose adapter
    weights get no gradient (``grad is None``) from a forward and backward on a few tokens through the training
    forward (``causal_lm_logprobs``, ``scalar_values``). A model can read a wrapped layer's weight itself instead of
    calling the layer (Jamba's Mamba mixer: ``self.dt_proj.weight @ x``), so the adapter is never in the graph and
    would never train. B starts at zero, so A's gradient is zero, not None, on a layer that is in the graph."""
    from rlhf_core.models.builders import ScalarHeadModel
    from rlhf_core.models.lora import ADAPTER, lora_layers

    vocab = cast(nn.Embedding, cast("PreTrainedModel", model).get_input_embeddings()).num_embeddings
    ids = torch.arange(12).reshape(2, 6) % vocab
    mask = torch.ones_like(ids)
    if scalar:
        out = scalar_values(ScalarHeadModel(model), ids, mask, pack=False)
    else:
        out = causal_lm_logprobs(model, ids, mask, torch.ones(2, 5), pack=False)
    out.sum().backward()
    missing = []
    for name in lora_layers(model):
        layer = cast("LoraLayer", model.get_submodule(name))
        params = [*layer.lora_A[ADAPTER].parameters(), *layer.lora_B[ADAPTER].parameters()]
        if any(p.grad is None for p in params):
            missing.append(name)
    return missing
