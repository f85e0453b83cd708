"""Check that a stage's exported model scores text as the trainer did: the folder loads in transformers and in vLLM,
and both give the trainer's log-probs.

    python scripts/check_export.py runs/smollm2-rlvr/rlvr [--data SPEC] [--rows 8] [--tolerance 1e-4]

The folder is loaded with ``AutoModelForCausalLM`` (fp32) and scored through the trainer's own log-prob function
(``rlhf_core.models.forward.causal_lm_logprobs``, padding removed, as the actor computes it), and by a ``vllm.LLM``
of the same folder (fp32, its prompt log-probs: the raw logits, as the rollout engines' ``sequence_logprobs``).
The sequences are chat prompts of held-out rows (``--data``, a data spec or file with ``prompt``/``answer``
columns; by default the smollm2 presets' task) followed by their answers. Prints one line and exits 1 when the
largest difference of any token's log-prob is above the tolerance:

    check_export: rows=8 tokens=... max_diff=... tolerance=0.0001 ok=true
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

TASK = (
    "reasoning_gym:basic_arithmetic?size=3000&eval_size=200&seed=1&min_terms=2&max_terms=2&min_digits=2&max_digits=2"
    "&operators=[%2B]&allow_negation=false&allow_parentheses=false"
)


def sequences(folder: Path, data: str, rows: int) -> list[list[int]]:
    """Chat-rendered held-out prompts followed by their answers, as token ids."""
    from transformers import AutoTokenizer

    from rlhf_core.data.loading import load_rows

    tokenizer = AutoTokenizer.from_pretrained(folder)
    out = []
    for row in load_rows(data, split="test", max_rows=rows):
        chat = [{"role": "user", "content": row["prompt"]}, {"role": "assistant", "content": str(row["answer"])}]
        out.append(list(tokenizer.apply_chat_template(chat, tokenize=True, return_dict=True)["input_ids"]))
    return out


def trainer_logprobs(folder: Path, seqs: list[list[int]]) -> list[list[float]]:
    import torch
    from transformers import AutoModelForCausalLM

    from rlhf_core.algos.batching import make_sequences
    from rlhf_core.models.forward import causal_lm_logprobs

    model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    batch = make_sequences([s[:1] for s in seqs], [s[1:] for s in seqs], 0)
    with torch.no_grad():
        lp = causal_lm_logprobs(model, batch.input_ids, batch.attention_mask, batch.action_mask)
    return [lp[i][batch.action_mask[i].bool()].tolist() for i in range(len(seqs))]


def engine_logprobs(folder: Path, seqs: list[list[int]]) -> list[list[float]]:
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=str(folder), dtype="float32", max_model_len=512, enforce_eager=True, kv_cache_memory_bytes=256 << 20
    )
    params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": s} for s in seqs], params, use_tqdm=False)
    return [[float(o.prompt_logprobs[t][s[t]].logprob) for t in range(1, len(s))] for s, o in zip(seqs, outs)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--data", default=TASK)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--tolerance", type=float, default=1e-4)
    args = parser.parse_args()
    seqs = sequences(args.folder, args.data, args.rows)
    trainer = trainer_logprobs(args.folder, seqs)
    engine = engine_logprobs(args.folder, seqs)
    diff = max(abs(a - b) for t, e in zip(trainer, engine) for a, b in zip(t, e, strict=True))
    tokens = sum(len(t) for t in trainer)
    ok = diff <= args.tolerance
    print(
        f"check_export: rows={len(seqs)} tokens={tokens} max_diff={diff:.2e} tolerance={args.tolerance:g} "
        f"ok={'true' if ok else 'false'}"
    )
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
