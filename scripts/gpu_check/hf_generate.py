"""``hf_generate``: the HF rollout engine (``HFGenerateEngine``) on the device: greedy generation of ragged prompts,
``load_state_dict`` with another model's weights, greedy generation again, which must equal a plain ``generate`` of
that other model on the same left-padded prompts, token for token, and differ from the first; tokens/s."""

from __future__ import annotations

import time
from typing import Any

import torch

from .common import Ctx, dtype_of, emit, free_memory, run_check, sync


def _plain_generate(
    model: Any, prompts: list[list[int]], pad_id: int, stop_ids: tuple[int, ...], max_new_tokens: int
) -> list[list[int]]:
    """Greedy ``model.generate`` on the left-padded prompts; each response cut after its first stop id."""
    device = next(model.parameters()).device
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    with torch.no_grad():
        out = model.generate(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=list(stop_ids),
            pad_token_id=pad_id,
        )
    responses = []
    for row in out[:, width:].tolist():
        end = next((i for i, token in enumerate(row) if token in stop_ids), None)
        responses.append(row if end is None else row[: end + 1])
    return responses


def check_hf_generate(plan: dict[str, Any], device: str) -> dict:
    from rlhf_core.distributed.rollout.engine import SamplingConfig
    from rlhf_core.distributed.rollout.hf_engine import HFGenerateEngine
    from rlhf_core.models.builders import build_causal_lm

    path, dtype = plan["hf_model"], dtype_of(plan["precision"])
    start = time.perf_counter()
    engine = HFGenerateEngine(path, dtype=str(dtype).removeprefix("torch."), init_seed=0)
    start_s = time.perf_counter() - start
    tok = engine.tokenizer
    special = set(tok.all_special_ids)
    allowed = torch.tensor([i for i in range(len(tok)) if i not in special])
    gen = torch.Generator().manual_seed(21)
    n = plan["hf_prompts"]
    prompts = [allowed[torch.randint(len(allowed), (4 + 3 * i,), generator=gen)].tolist() for i in range(n)]
    sampling = SamplingConfig(n=1, temperature=0.0, max_new_tokens=plan["hf_new_tokens"], seed=0)

    def timed_generate(engine: Any) -> tuple[list[list[int]], float]:
        sync(device)
        t0 = time.perf_counter()
        out = engine.generate(prompts, sampling)
        sync(device)
        return out, time.perf_counter() - t0

    first, first_s = timed_generate(engine)
    other = build_causal_lm(path, tok, seed=1, dtype=dtype, attn="sdpa").to(engine.device).eval()
    engine.load_state_dict(dict(other.state_dict()))
    loaded = all(torch.equal(p, dict(other.named_parameters())[n]) for n, p in engine.model.named_parameters())
    second, second_s = timed_generate(engine)
    reference = _plain_generate(other, prompts, engine.pad_id, engine.stop_ids, plan["hf_new_tokens"])
    tokens = sum(len(r) for r in second)
    problems = []
    if engine.device.type != device:
        problems.append(f"the engine's model is on {engine.device}, not {device}")
    if not loaded:
        problems.append("load_state_dict left parameters that differ from the loaded model's")
    if second != reference:
        rows = [i for i, (a, b) in enumerate(zip(second, reference)) if a != b]
        problems.append(f"after load_state_dict, rows {rows} differ from the loaded model's own generate")
    if second == first:
        problems.append("the generations before and after load_state_dict are equal: the load shows nothing")
    if tokens == 0:
        problems.append("nothing was generated")
    record = {
        "check": "hf_generate",
        "ok": not problems,
        "device": str(engine.device),
        "model": path,
        "dtype": str(dtype).removeprefix("torch."),
        "prompts": n,
        "max_new_tokens": plan["hf_new_tokens"],
        "generated_tokens": tokens,
        "matches_reference": second == reference,
        "differs_from_before_load": second != first,
        "tokens_per_s": round(tokens / second_s, 1),
        "first_call_tokens_per_s": round(sum(len(r) for r in first) / first_s, 1),
        "engine_start_s": round(start_s, 2),
    }
    if problems:
        record["reason"] = "; ".join(problems)
    del engine, other
    free_memory(device)
    return emit(record)


def run(c: Ctx) -> None:
    run_check("hf_generate", check_hf_generate, c.plan, c.device)
