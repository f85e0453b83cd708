"""A saved tiny model made into one that needs its own modelling code (``config.json`` ``auto_map``), for the tests
of ``trust_remote_code``."""

from __future__ import annotations

import json
from pathlib import Path

_CONFIG = """
from transformers import LlamaConfig


class ProbeConfig(LlamaConfig):
    model_type = "{model_type}"
"""
_MODELLING = """
from torch import nn
from transformers import LlamaForCausalLM, LlamaForSequenceClassification, LlamaModel, LlamaPreTrainedModel

from .configuration_{model_type} import ProbeConfig


class ProbeForCausalLM(LlamaForCausalLM):
    config_class = ProbeConfig


class ProbeForSequenceClassification(LlamaForSequenceClassification):
    config_class = ProbeConfig

    def __init__(self, config):  # the backbone built directly: AutoModel does not know this config class
        LlamaPreTrainedModel.__init__(self, config)
        self.num_labels = config.num_labels
        self.model = LlamaModel(config)
        self.score = nn.Linear(config.hidden_size, self.num_labels, bias=False)
        self.post_init()
"""


def add_remote_code(folder: Path, model_type: str, architecture: str) -> Path:
    """Give the saved model in ``folder`` the custom ``model_type`` (one name per test module: transformers keeps a
    registry) and its code; ``architecture`` is ProbeForCausalLM or ProbeForSequenceClassification."""
    (folder / f"configuration_{model_type}.py").write_text(_CONFIG.format(model_type=model_type))
    (folder / f"modeling_{model_type}.py").write_text(_MODELLING.format(model_type=model_type))
    config = json.loads((folder / "config.json").read_text())
    config.update(
        model_type=model_type,
        architectures=[architecture],
        auto_map={
            "AutoConfig": f"configuration_{model_type}.ProbeConfig",
            "AutoModelForCausalLM": f"modeling_{model_type}.ProbeForCausalLM",
            "AutoModelForSequenceClassification": f"modeling_{model_type}.ProbeForSequenceClassification",
        },
    )
    (folder / "config.json").write_text(json.dumps(config))
    return folder
