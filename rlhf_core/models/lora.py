"""LoRA adapters on a trained model (peft), and the model's weights with the adapters merged, out of place.

``add_adapters`` injects peft LoRA layers into a built model (``peft.inject_adapter_in_model``: the model keeps its
own class, so its forward, its hidden-state path and DeepSpeed see the same model) and leaves trainable only the
adapters, the modules named in ``lora.modules_to_save`` and, for a reward model or critic, the value head. Under
ZeRO-3 the adapters are created inside ``deepspeed.zero.Init`` and partitioned at once; their initialisation (A
random, B zero, so that the model starts as it was) is redone on the gathered values (``partitioned.full_values``).

The rest of the project sees the adapters through two functions:

- ``merged_tensors``: every weight under its checkpoint name, each LoRA layer's weight as ``W + scaling * B @ A``
  computed in fp32 from the current values and rounded once to W's dtype, never written back. The weight sync sends
  these (gathering each one's sources together under ZeRO-3), so the engines serve exactly the trained policy, and the
  trained copy is never merged and unmerged in place (which drifts in bf16).
- ``merged_state_dict``: the same merge on a full state dict (what the export writes: a plain Hugging Face folder that
  any loader reads).

Only ``nn.Linear`` layers are adapted: a target that resolves to an embedding or a convolution is refused with the
module's name.

Parameters (``lora.target_parameters``: a Mixture-of-Experts layer's fused 3-D experts, which no linear layer holds)
are adapted through peft's ``ParamWrapper``: one A and B per expert, stacked along A's rows and B's columns, and two
targets on one module nest two wrappers. ``merged_tensors`` gives such a parameter under its own name as W plus
peft's own delta (``merged_param``), so ``checkpoint_names`` splits it per expert for the sync like the plain one.

QLoRA (``lora.load_in_4bit``): ``quantize_4bit`` replaces the base's linear layers by bitsandbytes NF4 layers before
the adapters are added; ``full_weight`` dequantises such a weight, so the merged tensors and the export hold
``dequant(W) + s B @ A`` in full precision, which is what the 4-bit model computes.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from rlhf_core.models.partitioned import ZeroParameter, full_values

ADAPTER = "default"  # peft's adapter name; the one adapter of a model
LORA_MARKERS = (".lora_A.", ".lora_B.", ".lora_dropout.", ".lora_embedding_", ".lora_magnitude_vector")


class LoraTargetError(ValueError):
    """A LoRA target that this project cannot adapt or merge (not an ``nn.Linear``), or that matched nothing: ``key``
    is the key under the model's section (``lora.target_modules``), ``why`` the rest of the message."""

    def __init__(self, key: str, why: str):
        super().__init__(f"{key} {why}")
        self.key, self.why = key, why


@dataclass(frozen=True)
class MergedTensor:
    """One weight under its checkpoint name, and what it is computed from: the parameter itself, or a LoRA layer's
    base weight with its A and B and scaling."""

    name: str
    sources: tuple[nn.Parameter, ...]
    scaling: float | None = None
    out_in: bool | None = None  # an adapted parameter (ParamWrapper): its layout, see ``ParamScaling``

    def value(self) -> torch.Tensor:
        base = full_weight(self.sources[0])
        if self.scaling is None:
            return base
        a, b = (p.detach() for p in self.sources[1:])
        if self.out_in is not None:
            return merged_param(base, a, b, self.scaling, self.out_in)
        return merged_weight(base, a, b, self.scaling)

    def meta(self, zero3: bool = False) -> tuple[torch.dtype, tuple[int, ...]]:
        """The value's dtype and shape without computing it (ZeRO-3: the shape before partitioning)."""
        base = self.sources[0]
        state = getattr(base, "quant_state", None)
        if state is not None:  # a 4-bit weight: its dequantised dtype and shape
            return state.dtype, tuple(int(s) for s in state.shape)
        return base.dtype, tuple(int(s) for s in (cast(ZeroParameter, base).ds_shape if zero3 else base.shape))


def full_weight(param: nn.Parameter) -> torch.Tensor:
    """A weight's value to compute with: a 4-bit (QLoRA) weight dequantised, any other as it is (detached)."""
    state = getattr(param, "quant_state", None)
    if state is None:
        return param.detach()
    import bitsandbytes.functional as bnbf

    return bnbf.dequantize_4bit(param.data, state)


def quantize_4bit(model: nn.Module, dtype: torch.dtype, keep: Iterable[nn.Module] = ()) -> nn.Module:
    """QLoRA's base: every ``nn.Linear`` of ``model`` but its output embedding and the ``keep`` modules (a value head)
    replaced in place by a bitsandbytes NF4 layer with double quantisation, computing in ``dtype``.

    bitsandbytes repacks a 4-bit weight for a bf16 CPU kernel at its first forward in eval mode without autograd, and
    then uses that kernel, which rounds differently and has no backward, for training too; the repacking is turned
    off, so every forward dequantises the weight exactly and the same weights train."""
    from bitsandbytes.nn.modules import Linear4bit, Params4bit  # (bitsandbytes.nn re-exports them without __all__)

    skip = {id(m) for m in keep}
    out = getattr(model, "get_output_embeddings", lambda: None)()
    if out is not None:
        skip.add(id(out))
    targets = [(name, m) for name, m in model.named_modules() if type(m) is nn.Linear and id(m) not in skip]
    for name, linear in targets:
        parent, _, leaf = name.rpartition(".")
        layer = Linear4bit(
            linear.in_features,
            linear.out_features,
            bias=linear.bias is not None,
            compute_dtype=dtype,
            compress_statistics=True,
            quant_type="nf4",
            device="meta",
        )
        # Params4bit takes its arguments in __new__; pyright also checks the call against torch's nn.Parameter.__init__
        weight = Params4bit(
            linear.weight.data.to(dtype),
            requires_grad=False,
            compress_statistics=True,  # pyright: ignore[reportCallIssue]
            quant_type="nf4",  # pyright: ignore[reportCallIssue]
        )
        # quantised on the move to a device (bitsandbytes binds its Params4bit.to overloads' self to nn.Module)
        layer.weight = weight.to(linear.weight.device)  # pyright: ignore[reportAttributeAccessIssue]
        if linear.bias is not None:
            layer.bias = nn.Parameter(linear.bias.data, requires_grad=linear.bias.requires_grad)
        layer.support_avx512bf16_for_cpu = False
        setattr(model.get_submodule(parent) if parent else model, leaf, layer)
    return model


def merged_weight(base: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    """``base + scaling * b @ a`` in fp32, rounded once to ``base``'s dtype (a new tensor)."""
    return (base.float() + scaling * (b.float() @ a.float())).to(base.dtype)


class ParamScaling(float):
    """The scaling of an adapted parameter's wrapper (peft ``ParamWrapper``), with what its merge needs beside the
    state dict: the parameter's name on the module, and ``out_in``: a 3-D parameter laid out [experts, out, in]
    (transformers' fused experts; peft swaps A and B for it), else [experts, in, out]. The name and the shapes cannot
    tell them apart when the two sizes are equal (tiny-moe's ``down_proj``)."""

    parameter_name: str
    out_in: bool

    def __new__(cls, value: float, parameter_name: str, out_in: bool) -> ParamScaling:
        new = super().__new__(cls, value)
        new.parameter_name, new.out_in = parameter_name, out_in
        return new

    def __reduce__(self) -> tuple:
        return ParamScaling, (float(self), self.parameter_name, self.out_in)


def merged_param(base: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float, out_in: bool) -> torch.Tensor:
    """An adapted parameter plus peft's ``ParamWrapper.get_delta_weight`` (A [experts x rank, in], B [out, rank x
    experts]), taken in fp32 and rounded once to ``base``'s dtype (a new tensor); a 2-D parameter as a linear
    layer's weight."""
    if base.dim() == 2:
        return merged_weight(base, a, b, scaling)
    experts = base.shape[0]
    a = a.float().reshape(experts, -1, a.shape[-1])  # experts x rank x in
    b = b.float().reshape(b.shape[0], -1, experts)  # out x rank x experts
    delta = torch.einsum("o r e, e r i -> e o i" if out_in else "o r e, e r i -> e i o", b, a) * scaling
    return (base.float() + delta).to(base.dtype)


def plain_name(name: str) -> str:
    """A parameter's name in the model without adapters: every wrapper's ``base_layer`` dropped (two targeted
    parameters of one module nest two wrappers)."""
    return ".".join(part for part in name.split(".") if part != "base_layer")


def _check_target_parameters(model: nn.Module, targets: list[str]) -> None:
    """Each ``lora.target_parameters`` entry matches a 2-D or 3-D parameter (peft's rule: the name or a suffix
    after a dot), else ``LoraTargetError`` naming it."""
    if not targets:
        return
    params = {plain_name(n): p for n, p in model.named_parameters()}
    for target in targets:
        hits = [n for n in params if n == target or n.endswith(f".{target}")]
        if not hits:
            raise LoraTargetError("lora.target_parameters", f"{targets!r}: {target!r} matches no parameter")
        flat = [n for n in hits if len(getattr(params[n], "ds_shape", params[n].shape)) not in (2, 3)]
        if flat:
            raise LoraTargetError(
                "lora.target_parameters", f"matches {flat[0]}: only 2-D and 3-D (experts) parameters can be adapted"
            )


def add_adapters(model: nn.Module, lora: Any, *, seed: int, trainable: Iterable[nn.Module] = ()) -> nn.Module:
    """Inject LoRA layers (``lora``: the model's ``lora`` config section, rank > 0) into ``model`` in place and
    return it; only the adapters, ``lora.modules_to_save`` and the ``trainable`` modules (a value head) train.
    ``seed`` makes the adapters' initial A the same on every rank and every run."""
    from peft import LoraConfig, inject_adapter_in_model
    from peft.tuners.lora import Linear as LoraLinear
    from peft.tuners.lora import LoraLayer
    from peft.tuners.lora.layer import ParamWrapper

    parameters = list(getattr(lora, "target_parameters", []))
    _check_target_parameters(model, parameters)
    config = LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=_targets(lora.target_modules) or None,  # [] beside target_parameters: no module
        target_parameters=parameters or None,
        bias="none",
    )
    try:
        inject_adapter_in_model(config, model)
    except ValueError as e:  # peft: "Target modules {...} not found in the base model"
        if "ParamWrapper does not work with lora_dropout" in str(e):  # all-linear reached fused experts (peft)
            raise LoraTargetError(
                "lora.dropout", f"{lora.dropout}: adapters on whole parameters (fused experts) take no dropout in peft"
            ) from None
        raise LoraTargetError("lora.target_modules", f"{lora.target_modules!r}: {str(e).splitlines()[0]}") from None
    layers = {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}
    for name, layer in layers.items():
        if isinstance(layer, ParamWrapper):  # lora.target_parameters, checked above
            continue
        linear = isinstance(layer, LoraLinear) or type(layer).__name__ == "Linear4bit"  # (peft's QLoRA layer)
        if not linear or getattr(layer, "fan_in_fan_out", False):
            raise LoraTargetError(
                "lora.target_modules",
                f"matches {name} ({type(layer.get_base_layer()).__name__}): only nn.Linear layers can be adapted; "
                "name the linear projections instead",
            )
    torch.manual_seed(seed)
    for layer in layers.values():
        params = [*layer.lora_A[ADAPTER].parameters(), *layer.lora_B[ADAPTER].parameters()]
        with torch.no_grad(), full_values(params):  # ZeRO-3: initialise the gathered values, keep what is written
            layer.reset_lora_parameters(ADAPTER, True)
    saved = set(lora.modules_to_save)
    found = set()
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in saved:
            found.add(name.rsplit(".", 1)[-1])
            module.requires_grad_(True)
    if saved - found:
        raise LoraTargetError("lora.modules_to_save", f"{sorted(saved - found)}: no module of that name in the model")
    for module in trainable:
        module.requires_grad_(True)
    return model


def _targets(value: list[str]) -> str | list[str]:
    """peft's target_modules: the one string "all-linear" as it is, else the list of module names."""
    return "all-linear" if list(value) == ["all-linear"] else list(value)


def has_adapters(model: nn.Module) -> bool:
    return any(".lora_A." in name for name, _ in model.named_parameters())


def lora_layers(model: nn.Module) -> dict[str, float]:
    """Each LoRA layer's module name and scaling (alpha / rank); {} without adapters (then peft is not imported).
    An adapted parameter's wrapper gives a ``ParamScaling`` (a float that also names the parameter)."""
    if not has_adapters(model):
        return {}
    from peft.tuners.lora import LoraLayer
    from peft.tuners.lora.layer import ParamWrapper

    out: dict[str, float] = {}
    for name, m in model.named_modules(remove_duplicate=False):  # a wrapper may hold a module under two names
        if isinstance(m, ParamWrapper):  # peft's delta swaps A and B exactly when it swapped in and out features
            out[name] = ParamScaling(m.scaling[ADAPTER], m.parameter_name, bool(m._did_swap_in_out_features))
        elif isinstance(m, LoraLayer):
            out[name] = float(m.scaling[ADAPTER])
    return out


def adapted_parameters(model: nn.Module) -> list[str]:
    """The parameters adapted whole (peft ``ParamWrapper``), by plain name: ``lora.target_parameters``, and on a
    Mixture-of-Experts model that peft maps from transformers 4 (Qwen2/3-MoE, Mixtral) what ``all-linear`` reaches
    of its fused experts and router."""
    return list(_adapted_params(lora_layers(model)))


def _adapted_params(layers: dict[str, float]) -> dict[str, tuple[str, ParamScaling]]:
    """The adapted parameters among ``layers`` (``lora_layers``): each one's plain name, its wrapper and scaling."""
    adapted = {name: s for name, s in layers.items() if isinstance(s, ParamScaling)}
    return {plain_name(f"{name}.{s.parameter_name}"): (name, s) for name, s in adapted.items()}


def merged_tensors(model: nn.Module) -> list[MergedTensor]:
    """Every weight of ``model`` under its checkpoint name, in parameter order, the LoRA layers' merged (see the
    module's docstring); a model without adapters gives its parameters as they are."""
    layers = lora_layers(model)
    adapted = _adapted_params(layers)
    params = dict(model.named_parameters())
    out = []
    for name, param in params.items():
        if any(marker in name for marker in LORA_MARKERS):
            continue
        module, _, leaf = name.rpartition(".")
        owner = module.removesuffix(".base_layer")
        if plain_name(name) in adapted:
            wrapper, s = adapted[plain_name(name)]
            a = params[f"{wrapper}.lora_A.{ADAPTER}.weight"]
            b = params[f"{wrapper}.lora_B.{ADAPTER}.weight"]
            out.append(MergedTensor(plain_name(name), (param, a, b), float(s), s.out_in))
        elif module.endswith(".base_layer") and owner in layers and leaf == "weight":
            a = params[f"{owner}.lora_A.{ADAPTER}.weight"]
            b = params[f"{owner}.lora_B.{ADAPTER}.weight"]
            out.append(MergedTensor(f"{owner}.weight", (param, a, b), layers[owner]))
        else:
            out.append(MergedTensor(plain_name(name), (param,)))
    return out


def merged_state_dict(state: dict[str, torch.Tensor], layers: dict[str, float]) -> dict[str, torch.Tensor]:
    """A full state dict of a model with LoRA ``layers`` (``lora_layers`` of the same module, so the names match) as
    the plain model's: each adapted weight merged, the adapters dropped, ``base_layer`` names restored."""
    adapted = _adapted_params(layers)
    out = {}
    for key, value in state.items():
        if any(marker in key for marker in LORA_MARKERS):
            continue
        owner = key.removesuffix(".base_layer.weight")
        if plain_name(key) in adapted:
            wrapper, s = adapted[plain_name(key)]
            a = state[f"{wrapper}.lora_A.{ADAPTER}.weight"]
            b = state[f"{wrapper}.lora_B.{ADAPTER}.weight"]
            value = merged_param(value, a, b, float(s), s.out_in)
        elif owner != key and owner in layers:
            a = state[f"{owner}.lora_A.{ADAPTER}.weight"]
            b = state[f"{owner}.lora_B.{ADAPTER}.weight"]
            value = merged_weight(value, a, b, layers[owner])
        out[plain_name(key)] = value
    return out
