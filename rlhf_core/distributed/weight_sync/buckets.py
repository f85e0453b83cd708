"""The pure part of the weight sync: specs, the bucket plan and layout, the header, pack and unpack.

A bucket is one flat uint8 buffer: a 16-byte header (int64 status, int64 bucket index), then each tensor's bytes at
the next multiple of ``ALIGN``. Both sides compute the plan and the layout from the same specs, so only the buffer
travels. torch only: these functions need neither Ray nor vLLM (a GPU check script uses them as they are).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

WeightSpec = tuple[str, str, tuple[int, ...]]

HEADER_BYTES = 16  # int64 status, int64 bucket index
ALIGN = 16  # every tensor starts at a multiple of 16 bytes: a uint8 view can be re-viewed as any dtype
STATUS_DATA, STATUS_ABORT = 1, 2
MIB = 1 << 20


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"`` (what travels in the specs)."""
    return str(dtype).removeprefix("torch.")


def to_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def spec_of(name: str, tensor: torch.Tensor) -> WeightSpec:
    return (name, dtype_name(tensor.dtype), tuple(int(s) for s in tensor.shape))


def normal_specs(specs: Iterable[Sequence[Any]]) -> list[WeightSpec]:
    """Specs as tuples of (str, str, tuple of ints): what arrives after a trip through Ray or vLLM's RPC."""
    return [(str(n), str(d), tuple(int(s) for s in shape)) for n, d, shape in specs]


def spec_nbytes(spec: WeightSpec) -> int:
    numel = 1
    for s in spec[2]:
        numel *= s
    return numel * to_dtype(spec[1]).itemsize


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def bucket_plan(specs: Sequence[WeightSpec], bucket_bytes: int) -> list[list[int]]:
    """Indices of ``specs`` per bucket, in order: a tensor joins the current bucket unless that would take the
    bucket's tensor bytes over ``bucket_bytes``; a tensor bigger than a bucket gets one of its own. Both sides call
    this with the same arguments, so the plan itself never travels."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    plan: list[list[int]] = []
    current: list[int] = []
    size = 0
    for i, spec in enumerate(specs):
        n = spec_nbytes(spec)
        if current and size + n > bucket_bytes:
            plan.append(current)
            current, size = [], 0
        current.append(i)
        size += n
    if current:
        plan.append(current)
    return plan


def bucket_layout(specs: Sequence[WeightSpec]) -> tuple[list[int], int]:
    """Byte offsets of the tensors of one bucket in its buffer, and the buffer's size: the header first, then each
    tensor at the next multiple of ``ALIGN``."""
    offsets, end = [], HEADER_BYTES
    for spec in specs:
        offsets.append(end)
        end = _aligned(end + spec_nbytes(spec))
    return offsets, end


def set_header(buffer: torch.Tensor, status: int, index: int) -> None:
    buffer[:HEADER_BYTES].view(torch.int64).copy_(torch.tensor([status, index], dtype=torch.int64))


def read_header(buffer: torch.Tensor) -> tuple[int, int]:
    status, index = buffer[:HEADER_BYTES].view(torch.int64).tolist()
    return int(status), int(index)


def pack_bucket(
    tensors: Sequence[torch.Tensor],
    specs: Sequence[WeightSpec],
    out: torch.Tensor | None = None,
    device: torch.device | str | None = None,
    index: int = 0,
) -> torch.Tensor:
    """The tensors' bytes in one flat uint8 buffer laid out by ``bucket_layout(specs)``, header "data" + ``index``.
    ``out``: a buffer to reuse (at least that big; the slice used is returned); else one is allocated on ``device``
    (default: the first tensor's device). Each tensor is checked against its spec."""
    if len(tensors) != len(specs):
        raise ValueError(f"{len(tensors)} tensors for {len(specs)} specs")
    offsets, nbytes = bucket_layout(specs)
    if out is None:
        device = device if device is not None else (tensors[0].device if tensors else "cpu")
        buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
    else:
        if out.dtype != torch.uint8 or out.numel() < nbytes:
            raise ValueError(f"out must be a uint8 buffer of at least {nbytes} bytes")
        buffer = out[:nbytes]
    for t, spec, off in zip(tensors, specs, offsets):
        if (t.dtype, tuple(t.shape)) != (to_dtype(spec[1]), tuple(spec[2])):
            raise ValueError(f"tensor {spec[0]!r} is {dtype_name(t.dtype)} {tuple(t.shape)}, expected {spec}")
        n = spec_nbytes(spec)
        if n:
            buffer[off : off + n].copy_(t.detach().reshape(-1).view(torch.uint8))
    set_header(buffer, STATUS_DATA, index)
    return buffer


def unpack_bucket(buffer: torch.Tensor, specs: Sequence[WeightSpec]) -> dict[str, torch.Tensor]:
    """Name -> tensor for one bucket: views into ``buffer`` (no copy), dtype and shape from the specs."""
    specs = normal_specs(specs)
    offsets, nbytes = bucket_layout(specs)
    if buffer.numel() < nbytes:
        raise ValueError(f"bucket buffer has {buffer.numel()} bytes, its specs need {nbytes}")
    out = {}
    for (name, dtype, shape), off in zip(specs, offsets):
        n = spec_nbytes((name, dtype, shape))
        out[name] = buffer[off : off + n].view(to_dtype(dtype)).view(shape)
    return out


def load_into_module(
    module: torch.nn.Module, named: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]
) -> int:
    """Copy tensors into ``module``'s parameters/buffers by name (Hugging Face names); returns how many."""
    state: dict[str, torch.Tensor] = dict(module.named_parameters())
    state.update(dict(module.named_buffers()))
    items = named.items() if isinstance(named, Mapping) else named
    count = 0
    with torch.no_grad():
        for name, tensor in items:
            if name not in state:
                raise KeyError(f"received weight {name!r} is not in the model")
            state[name].copy_(tensor)
            count += 1
    return count
