"""``attention_<impl>``: one sequence alone versus the same sequence right- and left-padded in a batch: max |logit
difference| on the real tokens, for sdpa (on the GPU also in fp32, an exact reference) and (when installed)
flash_attention_2. A control with the padding unmasked must differ, so that the check can see a masking error at
all."""

from __future__ import annotations

from typing import Any

import torch

from .common import MODEL_SPECS, Ctx, causal_lm_on, dtype_of, emit, model_config, run_per_attention


def _positions(mask: torch.Tensor) -> torch.Tensor:
    return (mask.cumsum(-1) - 1).clamp(min=0)


def check_attention(impl: str, plan: dict[str, Any], device: str, precision: str) -> dict:
    spec = MODEL_SPECS[plan["model"]]
    # fewer layers and a larger init than the training model: padding that leaks into attention must show clearly
    config = model_config(spec, impl, num_hidden_layers=min(4, spec["num_hidden_layers"]), initializer_range=0.1)
    torch.manual_seed(11)
    dtype = dtype_of(precision)
    model = causal_lm_on(device, config, dtype).eval()
    length, pad = (plan["seq"] // 2, plan["seq"] // 4)
    gen = torch.Generator().manual_seed(5)
    seq = torch.randint(3, spec["vocab_size"], (length,), generator=gen)
    other = torch.randint(3, spec["vocab_size"], (length + pad,), generator=gen)
    pad_id = 0
    ids = torch.stack(
        [
            torch.cat([seq, torch.full((pad,), pad_id)]),  # right-padded
            torch.cat([torch.full((pad,), pad_id), seq]),  # left-padded
            other,  # a full row, so the batch is ragged
        ]
    ).to(device)
    mask = torch.ones_like(ids)
    mask[0, length:] = 0
    mask[1, :pad] = 0

    def logits(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=_positions(attention_mask))
        return out.logits.float()

    alone = logits(seq[None].to(device), torch.ones(1, length, dtype=torch.long, device=device))[0]
    batched = logits(ids, mask)
    unmasked = logits(ids, torch.ones_like(ids))  # control: the left padding visible to the real tokens
    right = (batched[0, :length] - alone).abs().max().item()
    left = (batched[1, pad:] - alone).abs().max().item()
    control = (unmasked[1, pad:] - alone).abs().max().item()
    scale = alone.abs().max().item()
    tol = 1e-4 * max(1.0, scale) if dtype == torch.float32 else 5e-2 * max(1.0, scale)
    problems = []
    if max(right, left) > tol:
        problems.append(f"padded rows differ by {max(right, left):.3g} > tol {tol:.3g}")
    if control <= tol:
        problems.append(f"the unmasked control differs only by {control:.3g} <= tol: the check cannot see leaks")
    record = {
        "check": f"attention_{impl}",
        "device": device,
        "precision": precision,
        "ok": not problems,
        "max_abs_diff_right_pad": right,
        "max_abs_diff_left_pad": left,
        "unmasked_control_diff": control,
        "logit_scale": scale,
        "tol": tol,
        "rows": f"{length} real tokens alone vs padded by {pad} in a batch of 3",
    }
    if problems:
        record["reason"] = "; ".join(problems)
    return emit(record)


def run(c: Ctx) -> None:
    run_per_attention("attention", check_attention, c)
