"""``packing_<impl>``: ``rlhf_core.models.forward.causal_lm_logprobs`` with ``pack=True`` (padding removed, samples
packed into rows with restarting ``position_ids``) against ``pack=False`` (padded rows and the attention mask) on a
ragged rollout-like batch (left-padded prompts, right-padded responses of different lengths): max |log-prob
difference| over every real next token, within a tolerance per dtype (fp32 1e-4, bf16 5e-2, times the largest
|log-prob| when over 1). A control packed without the restarts (a row's samples attend to each other) must differ by
more. sdpa (on the GPU in bf16 and fp32), and flash_attention_2 when installed (CUDA)."""

from __future__ import annotations

from typing import Any

import torch

from .common import MODEL_SPECS, Ctx, causal_lm_on, dtype_of, emit, free_memory, model_config, run_per_attention


def ragged_batch(longest: int, vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """4 rows laid out as a rollout: a left-padded prompt then a right-padded response, of 100%, 60%, 30% and 25% of
    ``longest`` real tokens (so packing puts the 60% and 30% samples into one row). Pad id 0."""
    prompt_width = max(1, longest // 3)
    width = longest + 1  # one column of padding even in the longest row
    lengths = [longest, longest * 6 // 10, longest * 3 // 10, longest // 4]
    gen = torch.Generator().manual_seed(seed)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        p = max(1, min(prompt_width, n // 3))
        lo, hi = prompt_width - p, prompt_width - p + n
        ids[i, lo:hi] = torch.randint(3, vocab, (n,), generator=gen)
        mask[i, lo:hi] = 1
    return ids, mask


def _unrestarted_logprobs(model: Any, ids: torch.Tensor, mask: torch.Tensor, score: torch.Tensor) -> torch.Tensor:
    """The control: the same packing, but the positions run on through each packed row (no restart per sample), so
    a row's later samples attend to the earlier ones."""
    from rlhf_core.models.forward import packing_for

    packing = packing_for(model, mask)
    packed = packing.pack(ids)
    positions = torch.arange(packed.shape[1], device=ids.device).expand_as(packed)
    logits = model(input_ids=packed, position_ids=positions, use_cache=False).logits.float()
    b, t = score.nonzero(as_tuple=True)
    rows, cols = packing.locate(b, t)
    out = torch.zeros(score.shape, dtype=torch.float32, device=ids.device)
    out[b, t] = torch.log_softmax(logits[rows, cols], -1).gather(1, ids[b, t + 1][:, None]).squeeze(1)
    return out


def check_packing(impl: str, plan: dict[str, Any], device: str, precision: str) -> dict:
    from rlhf_core.models.forward import causal_lm_logprobs, packing_for

    spec = MODEL_SPECS[plan["model"]]
    # as the attention check: few layers and a large init, so that a leak between samples shows clearly
    config = model_config(spec, impl, num_hidden_layers=min(4, spec["num_hidden_layers"]), initializer_range=0.1)
    torch.manual_seed(13)
    dtype = dtype_of(precision)
    model = causal_lm_on(device, config, dtype).eval()
    ids, mask = (t.to(device) for t in ragged_batch(plan["seq"] // 2, spec["vocab_size"], seed=17))
    score = mask[:, :-1].bool() & mask[:, 1:].bool()  # every real token's next real token
    with torch.no_grad():
        packed = causal_lm_logprobs(model, ids, mask, score, pack=True)
        padded = causal_lm_logprobs(model, ids, mask, score, pack=False)
        control = _unrestarted_logprobs(model, ids, mask, score)
    diff = (packed - padded)[score].abs().max().item()
    control_diff = (control - padded)[score].abs().max().item()
    scale = padded[score].abs().max().item()
    tol = (1e-4 if dtype == torch.float32 else 5e-2) * max(1.0, scale)
    packing = packing_for(model, mask)
    problems = []
    if diff > tol:
        problems.append(f"packed log-probs differ from padded ones by {diff:.3g} > tol {tol:.3g}")
    if control_diff <= tol:
        problems.append(f"the unrestarted control differs only by {control_diff:.3g} <= tol: no leak to see")
    record = {
        "check": f"packing_{impl}",
        "device": device,
        "precision": precision,
        "ok": not problems,
        "max_abs_diff": diff,
        "cross_sample_control_diff": control_diff,
        "logprob_scale": scale,
        "tol": tol,
        "real_tokens_per_row": mask.sum(1).tolist(),
        "scored_tokens": int(score.sum()),
        "packed_shape": list(packing.packed_shape),
        "padded_shape": list(ids.shape),
    }
    if problems:
        record["reason"] = "; ".join(problems)
    del model
    free_memory(device)
    return emit(record)


def run(c: Ctx) -> None:
    run_per_attention("packing", check_packing, c)
