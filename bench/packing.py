"""SFT training throughput, packed versus padded, on the same model, batches and steps, in one run.

    python -m bench.packing [--model builtin:medium] [--steps 8] [--micro 8] [--threads 2]

Two copies of one model (``--model``, seed 0, fp32) train side by side on the same micro-batches of SFT examples of
mixed lengths (about half of each padded micro-batch is padding; the measured share is printed): one with the
stage's loss packed (``SFTTrainer.loss``, ``strategy.packing``: the samples packed into rows with restarting
position_ids, log-probs of the response tokens only), one padded (``packing=False``, the attention mask over padded
rows). Each step is a forward, backward and AdamW step of each side, interleaved (packed, padded, packed, ...), so
both see the same drift of a shared machine; one warm-up step per side is not timed. The two sides' losses must
agree at every step within ``--loss-tol`` (1e-4), or the benchmark fails. Throughput counts real tokens (not
padding) per second of forward + backward + optimizer step. The last line is the summary:

    packing: speedup=<packed / padded tok/s> packed_tok_s=<..> padded_tok_s=<..> padding=<share> max_loss_diff=<..>
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time
from types import SimpleNamespace

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def mixed_examples(n: int, seed: int, vocab: int, max_len: int) -> list[dict]:
    """SFT examples (a prompt of 4..16 tokens, the rest response) whose lengths mix short and long: three in four
    between 8 and max_len / 3, one in four between 2/3 max_len and max_len."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        lo, hi = (2 * max_len // 3, max_len) if i % 4 == 0 else (8, max_len // 3)
        length = int(torch.randint(lo, hi + 1, (1,), generator=gen))
        prompt = int(torch.randint(4, 17, (1,), generator=gen))
        ids = torch.randint(5, vocab, (length,), generator=gen).tolist()
        out.append({"input_ids": ids, "loss_mask": [0] * prompt + [1] * (length - prompt)})
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin:medium")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per side")
    parser.add_argument("--micro", type=int, default=8, help="examples per step")
    parser.add_argument("--max-len", type=int, default=240)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--loss-tol", type=float, default=1e-4)
    args = parser.parse_args(argv)

    import torch

    from rlhf_core.algos.packing import padding_fraction
    from rlhf_core.config import StrategyConfig
    from rlhf_core.jobs.sft import SFTTrainer
    from rlhf_core.models.builders import build_causal_lm, load_tokenizer

    torch.set_num_threads(args.threads)
    tok = load_tokenizer(args.model)
    model = build_causal_lm(args.model, tok, seed=0, dtype=torch.float32, attn="sdpa")
    # the stage's loss as its ranks run it; only the context's strategy.packing is read
    sides = {
        name: SFTTrainer(SimpleNamespace(strategy=StrategyConfig(packing=packing)), [], [])
        for name, packing in (("packed", True), ("padded", False))
    }
    models = {"packed": model, "padded": copy.deepcopy(model)}
    optims = {k: torch.optim.AdamW(m.parameters(), lr=1e-4) for k, m in models.items()}
    examples = mixed_examples((args.steps + 1) * args.micro, 0, len(tok), args.max_len)
    batches = [
        sides["packed"].collate(examples[i : i + args.micro], tok.pad_token_id)
        for i in range(0, len(examples), args.micro)
    ]
    padding = statistics.mean(padding_fraction(b["attention_mask"]) for b in batches)
    seconds = {k: 0.0 for k in sides}
    tokens = 0
    max_diff = 0.0
    for step, batch in enumerate(batches):
        losses = {}
        for name, impl in sides.items():
            start = time.perf_counter()
            loss, _ = impl.loss(models[name], batch)
            loss.backward()
            optims[name].step()
            optims[name].zero_grad(set_to_none=True)
            if step:  # step 0 warms up
                seconds[name] += time.perf_counter() - start
            losses[name] = loss.item()
        diff = abs(losses["packed"] - losses["padded"])
        max_diff = max(max_diff, diff)
        if step:
            tokens += int(batch["attention_mask"].sum())
        print(f"step {step}: loss packed {losses['packed']:.6f} padded {losses['padded']:.6f} (diff {diff:.1e})")
    if max_diff > args.loss_tol:
        raise SystemExit(f"packed and padded losses differ by {max_diff:.2e} > {args.loss_tol:g}")
    rate = {k: tokens / s for k, s in seconds.items()}
    for name in sides:
        print(f"{name}: {tokens} real tokens in {seconds[name]:.2f} s -> {rate[name]:.0f} tok/s")
    print(
        f"packing: speedup={rate['packed'] / rate['padded']:.2f} packed_tok_s={rate['packed']:.0f} "
        f"padded_tok_s={rate['padded']:.0f} padding={padding:.2f} max_loss_diff={max_diff:.1e}"
    )


if __name__ == "__main__":
    main()
