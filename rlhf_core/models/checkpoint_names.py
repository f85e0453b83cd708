"""The names and layout of a Hugging Face checkpoint, for tensors held under the in-memory names of transformers 5.

transformers 5 fuses some weights when it loads a model and splits them again when it saves one: a Mixture-of-Experts
layer holds all its experts in two 3-D tensors (``mlp.experts.gate_up_proj`` [experts, 2 x inner, hidden] and
``mlp.experts.down_proj``), where the checkpoint has one matrix per expert and projection
(``mlp.experts.<e>.gate_proj.weight``, ... ; Mixtral: ``block_sparse_moe.experts.<e>.w1.weight``). vLLM's loaders
take the checkpoint's names, so the weight sync sends each weight as the pieces the checkpoint stores
(``checkpoint_pieces``, transformers' own ``revert_weight_conversion``); a dense model's weights are themselves.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch
from torch import nn

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def checkpoint_pieces(model: nn.Module, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors for ``model``'s in-memory weight ``name`` holding ``tensor`` (meta tensors give the
    names, shapes and dtypes without computing anything), in a fixed order."""
    from transformers.core_model_loading import revert_weight_conversion

    return list(revert_weight_conversion(cast("PreTrainedModel", model), {name: tensor}).items())
