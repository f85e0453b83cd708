"""The vocabulary of the config-key probes (``test_keys`` states the rule they enforce).

A ``Probe`` names the overrides that change a key and an observer: a function that runs the code path consuming the
key and returns what that code produced. This module holds the ``Probe`` type and its helpers, what several observers
share (a built model's fingerprint, a forward recorder), the stage-kind table that puts each kind's probes on the
preset of its stage (``kind_probes``), and ``check``: both configs loaded, both observed, the change asserted.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rlhf_core.config import STAGE_KINDS, PipelineConfig, describe, load_config, to_dict
from tests.conftest import ROOT, TINY

DATA = ROOT / "tests" / "data" / "config_keys"  # rows with alternative keys, and split folders (train/test/dev)
METHODS = DATA / "methods.yaml"  # one stage of each of the kinds dpo, kto, generate and score, named after it
LOOP = DATA / "loop.yaml"  # a loop of K = 2 iterations (generate -> score -> dpo, sft_best)
PPO_KINDS = ("critic_warmup", "ppo")  # the kinds of PPOConfig: a job run of theirs has its roles in this process


# ---------------------------------------------------------------------------------------------------------------------
# The probe table's vocabulary


@dataclass(frozen=True)
class Probe:
    """``change``: overrides that change the key (``{stage}`` and fixture names like ``{alt_tokenizer}`` are filled
    in); ``observe(cfg, stage)``: what the consuming code produced; ``base``: overrides for both configs (a fixture
    data file...); ``expect(before, after)``: the expected change, when cheap to state; ``slow``: needs Ray or
    DeepSpeed; ``preset``: the preset both configs start from (default: the tiny one)."""

    change: tuple[str, ...]
    observe: Callable[[PipelineConfig, str], Any]
    base: tuple[str, ...] = ()
    expect: Callable[[Any, Any], bool] | None = None
    slow: bool = False
    preset: Path = TINY


def probe(*change: str, observe, base=(), expect=None, slow=False, preset=TINY) -> Probe:
    return Probe(tuple(change), observe, tuple(base), expect, slow, preset)


def content_key(cfg: PipelineConfig, stage: str) -> str:
    """The stage's kind and resolved section (not the run directory): configs that compute the same share a key."""
    return json.dumps([cfg.kind(stage), to_dict(cfg)["stages"][stage]], sort_keys=True, default=str)


def outcome(fn: Callable[[], Any]) -> Any:
    """``fn()``, or the type of the error it raised (refusing is also a change of behaviour)."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001
        return ("raised", type(e).__name__)


def fingerprint(model: torch.nn.Module) -> dict:
    """What a built model is: class, attention, dtype, vocabulary, parameter count and a weight checksum."""
    if type(model).__name__ == "DeepSpeedEngine":  # a frozen role partitioned with ZeRO-3 (frozen.zero_stage)
        model = model.module
    model = getattr(model, "hf_model", model)  # ScalarHeadModel wraps the Hugging Face model
    params = list(model.parameters())
    return {
        "class": type(model).__name__,
        "attn": model.config._attn_implementation,
        "dtype": str(params[0].dtype),
        "vocab": model.get_input_embeddings().weight.shape[0],
        "params": sum(p.numel() for p in params),
        "checksum": round(sum(p.detach().double().abs().sum().item() for p in params), 6),
    }


def lora_report(model: torch.nn.Module) -> dict:
    """A built model's LoRA adapters: the adapted layers (short names), their scaling and dropout, and the parameters
    that train (their count and the modules they belong to)."""
    from rlhf_core.models.lora import lora_layers, plain_name

    # an adapted parameter (lora.target_parameters) by its own name: its wrapper is the module that holds it
    layers = {
        plain_name(f"{k}.{v.parameter_name}") if hasattr(v, "parameter_name") else k: v
        for k, v in lora_layers(model).items()
    }
    modules = model.named_modules()
    dropout = {
        round(float(m.p), 6) for name, m in modules if name.endswith("lora_dropout.default") and hasattr(m, "p")
    }
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return {
        "layers": sorted({name.rsplit(".", 1)[-1] for name in layers}),
        "count": len(layers),
        "scaling": sorted(set(layers.values())),
        "dropout": sorted(dropout),
        "trainable_params": sum(p.numel() for _, p in trainable),
        "weights_4bit": sum(p.dtype == torch.uint8 for p in model.parameters()),
        # what trains beside the adapters, by module name (embed_tokens, a value head's score, ...)
        "trainable_modules": sorted({n.rsplit(".", 2)[-2] for n, _ in trainable if ".lora_" not in n}),
    }


# ---------------------------------------------------------------------------------------------------------------------
# What several observers and expectations share


def forward_record(calls: list):
    """A forward pre-hook appending (rows, packed) of each call: packed = position_ids given without a mask."""

    def hook(module, args, kwargs):
        ids = args[0] if args else kwargs["input_ids"]
        mask = args[1] if len(args) > 1 else kwargs.get("attention_mask")
        position_ids = args[2] if len(args) > 2 else kwargs.get("position_ids")
        calls.append((len(ids), mask is None and position_ids is not None))

    return hook


def close(a: float, b: float) -> bool:
    """Whether two floats agree within a relative 1e-5."""
    return abs(a - b) <= 1e-5 * max(1.0, abs(a), abs(b))


# ---------------------------------------------------------------------------------------------------------------------
# Stage kinds: the job that runs a kind, another kind its keys also make valid, the preset its probes start from


def stage_runner(cfg: PipelineConfig, stage: str) -> Any:
    """The job module that runs the stage (STAGE_KINDS[kind].job: the pipeline's and the Prefect task's dispatch)."""
    return job_module(cfg, stage).__name__


def job_module(cfg: PipelineConfig, stage: str):
    return importlib.import_module(STAGE_KINDS[cfg.kind(stage)].job)


KIND_CHANGES = {  # another kind whose section the stage's keys also make valid
    "sft": ("sft.kind=reward_model",),
    "reward_model": ("reward_model.kind=sft",),
    "critic_init": (
        "critic_init.kind=reward_model",
        f"critic_init.data.train_path={DATA / 'pref.jsonl'}",
        f"critic_init.data.eval_path={DATA / 'pref.jsonl'}",
    ),
    "critic_warmup": ("critic_warmup.kind=ppo",),
    "ppo": ("ppo.kind=critic_warmup",),  # on KIND_PRESETS["ppo"]: the tiny ppo stage sets actor.optim
    # on METHODS, whose stages set only keys that the other kind also takes
    "dpo": ("dpo.kind=kto",),
    "kto": ("kto.kind=dpo",),
    "generate": ("generate.kind=sft",),
    "score": (
        "score.kind=ppo",
        "score.reward={{model: {{name_or_path: 'builtin:tiny'}}}}",  # a score stage's reward is a model section
        "score.actor.model.name_or_path=builtin:tiny",
        "score.critic.model.name_or_path=builtin:tiny",
        "score.train.eval_prompts=0",
    ),
}
# The tiny preset's ppo stage sets actor.optim, which a critic_warmup stage does not have: its kind changes on a preset
# whose ppo stage sets only keys both kinds take.
KIND_PRESETS = {"ppo": DATA / "ppo_both_kinds.yaml"}
# The preset with a stage named after each kind: the tiny one for the first kinds, METHODS for the newer ones.
KIND_HOMES = {"dpo": METHODS, "kto": METHODS, "generate": METHODS, "score": METHODS}


def kind_probes(kind: str, probes: dict[str, Probe], base: tuple[str, ...] = ()) -> dict[str, Probe]:
    """The probes of a kind's keys, on the preset of its stage (KIND_HOMES; the tiny one by default)."""
    home = KIND_HOMES.get(kind, TINY)
    out = {
        f"{kind}.kind": probe(
            *KIND_CHANGES[kind], observe=stage_runner, base=base, preset=KIND_PRESETS.get(kind, home)
        )
    }
    keys = {row[0] for row in describe(STAGE_KINDS[kind].section, kind)}
    for rel, p in probes.items():
        if f"{kind}.{rel}" in keys:  # the probes shared by several kinds, for the keys this kind has
            out[f"{kind}.{rel}"] = dataclasses.replace(
                p, base=base + p.base, preset=home if p.preset == TINY else p.preset
            )
    return out


# ---------------------------------------------------------------------------------------------------------------------
# Checking a probe: its two configs loaded, both observed, the change asserted


def configs(key: str, p: Probe, paths: dict[str, str]) -> tuple[PipelineConfig, PipelineConfig, str]:
    """(tiny preset + base, tiny preset + base + change, stage) for ``key``, each in its own run directory."""
    stage = key.split(".")[0] if "." in key and key.split(".")[0] not in ("storage",) else "sft"

    def load(overrides: tuple[str, ...]) -> PipelineConfig:
        filled = [o.format(stage=stage, **paths) for o in overrides]
        run = Path(paths["tmp"]) / "runs" / hashlib.sha256(json.dumps([key, filled]).encode()).hexdigest()[:16]
        return load_config(p.preset, [f"run_uri={run}", *filled])

    return load(p.base), load(p.base + p.change), stage


def check(key: str, p: Probe, paths: dict[str, str]) -> None:
    """Load ``key``'s two configs, observe both with ``p``, and assert that they differ (and changed as ``p``
    expects)."""
    base, changed, stage = configs(key, p, paths)
    before, after = p.observe(base, stage), p.observe(changed, stage)
    what = f"{p.observe.__name__} ({' '.join((p.observe.__doc__ or '').split())})"
    assert before != after, f"{key}: no effect on {what}: {_short(before)}"
    if p.expect is not None:
        assert p.expect(before, after), f"{key}: unexpected change of {what}: {_short(before)} -> {_short(after)}"


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) < 300 else text[:300] + "..."
