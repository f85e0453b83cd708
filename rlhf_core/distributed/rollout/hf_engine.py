"""The Hugging Face rollout backend: ``RolloutEngine`` on ``generate``, for machines without vLLM."""

from __future__ import annotations

import time
from typing import Any

import torch

from rlhf_core.distributed.node_files import ModelSource, local_model_path
from rlhf_core.distributed.rollout.engine import SamplingConfig, current_placement_group_id
from rlhf_core.distributed.weight_sync.buckets import MIB, WeightSpec, to_dtype
from rlhf_core.distributed.weight_sync.receiver import make_receiver_transport, receive_into_module

PARTIAL_NEEDS_VLLM = (
    "partial rollout needs the vLLM backend: Hugging Face generate runs a batch to its end in one call"
)


class HFGenerateEngine:
    """The same interface on Hugging Face ``generate``: no vLLM needed, one process, left padding."""

    def __init__(
        self,
        model_path: ModelSource,
        *,
        dtype: str = "float32",
        seed: int = 0,
        tokenizer: str | None = None,
        trust_remote_code: bool = False,
        init_seed: int = 0,
    ):
        """``seed``: the base of the sampling seeds; ``init_seed``: the build seed of a ``builtin:`` model (the
        actor's ``init_seed``, so that engine and actor start from the same weights)."""
        from rlhf_core.models.builders import build_causal_lm, load_tokenizer, stop_ids

        model_path = local_model_path(model_path)  # a StageModel (a stage output): this node's copy
        start = time.perf_counter()
        self.tokenizer = load_tokenizer(model_path, tokenizer, trust_remote_code=trust_remote_code)
        self.model: Any = build_causal_lm(  # a transformers model: generate, which nn.Module does not declare
            model_path,
            self.tokenizer,
            seed=init_seed,
            dtype=to_dtype(dtype),
            attn="sdpa",
            trust_remote_code=trust_remote_code,
        )
        if torch.cuda.is_available():  # a Ray actor given a GPU sees exactly that one
            self.model.to("cuda")
        self.model.eval()
        self.seed = seed
        self.eos_id = self.tokenizer.eos_token_id
        self.stop_ids = stop_ids(model_path, self.tokenizer)  # EOS first: the id generate pads finished rows with
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos_id
        self._sync_group: Any = None
        self.start_s = time.perf_counter() - start

    def ready(self) -> float:
        return self.start_s

    def num_workers(self) -> int:
        return 1

    def placement_group_id(self) -> str | None:
        return current_placement_group_id()

    def sleep(self) -> None:
        raise RuntimeError("the HF backend has no sleep mode (rollout.enable_sleep needs rollout.backend=vllm)")

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Nothing sleeps here (``sleep`` refuses)."""

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
            eos_token_id=list(self.stop_ids),
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
            end = next((t for t, token in enumerate(row) if token in self.stop_ids), None)
            if end is not None:
                row = row[: end + 1]
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

    # Partial rollout needs an engine that can stop between decoding steps and recompute its requests' prefixes
    # after a weight sync; ``generate`` runs a batch to its end in one call (the config refuses the combination).
    def begin_generation(self, prompt_token_ids: list[list[int]], sampling: SamplingConfig) -> None:
        raise NotImplementedError(PARTIAL_NEEDS_VLLM)

    def advance_generation(self, max_steps: int) -> int:
        raise NotImplementedError(PARTIAL_NEEDS_VLLM)

    def take_generation(self) -> tuple[list[list[int]], list[list[float]], list[list[int]]]:
        raise NotImplementedError(PARTIAL_NEEDS_VLLM)

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
        self._sync_group = make_receiver_transport(
            master_addr, master_port, rank_offset, world_size, group_name, timeout_s, backend
        )
        return [rank_offset]

    def receive_weights(self, specs: list[WeightSpec], bucket_bytes: int = 1024 * MIB, sync_id: int = 0) -> float:
        if self._sync_group is None:
            raise RuntimeError("receive_weights before init_weight_sync")
        start = time.perf_counter()
        receive_into_module(self._sync_group, specs, self.model, bucket_bytes, sync_id)
        return time.perf_counter() - start
