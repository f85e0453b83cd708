"""Batch plumbing for experience: build padded (B, T) tensors from prompt/response ids and mark truncated responses
(the typed PPO batches split, shard and select their own rows, see :mod:`rlhf_core.algos.experience`).

Pure torch. Conventions: sequences are right-padded; position t of a (B, T-1) per-token tensor (log-probs, values,
KL, rewards, advantages) belongs to the token at t+1, so ``action_mask[:, t]`` is 1 when token t+1 is a response
token.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .experience import SequenceBatch


def ensure_eos(
    responses: list[list[int]], eos_id: int, stop_ids: Sequence[int] = ()
) -> tuple[list[list[int]], torch.Tensor]:
    """Close every response with EOS; a response cut at max_new_tokens has none.

    Args:
        responses: B lists of token ids (not modified).
        eos_id: the EOS token id, appended where a response does not end on a stop id.
        stop_ids: the other ids that end a response as EOS does (a model's ``generation_config.eos_token_id``:
            Llama-3-Instruct ends a turn with <|eot_id|>, Qwen2.5-Instruct with <|im_end|>; the engines stop there).
    Returns:
        (responses, truncated): new lists, each ending with a stop id (``eos_id`` appended where the last token was
        none; an empty response becomes ``[eos_id]``), and a (B,) bool tensor, True where EOS was appended.
    """
    stops = {eos_id, *stop_ids}
    truncated = [not r or r[-1] not in stops for r in responses]
    closed = [list(r) + [eos_id] if cut else list(r) for r, cut in zip(responses, truncated)]
    return closed, torch.tensor(truncated, dtype=torch.bool).reshape(len(responses))


def make_sequences(prompts: list[list[int]], responses: list[list[int]], pad_id: int) -> SequenceBatch:
    """Join each prompt with its response.

    Args:
        prompts: B lists of token ids, each non-empty.
        responses: B lists of token ids (EOS included when there is one; may be empty).
        pad_id: id written on the padding.
    Returns:
        a :class:`SequenceBatch`: ``input_ids`` (B, T) long, right-padded with ``pad_id``, T = the longest
        prompt + response; ``attention_mask`` (B, T) bool; ``action_mask`` (B, T-1) bool, True at position t when
        token t+1 is a response token (bool: a mask travels to the Ray workers as one byte per position).
    """
    rows = [p + r for p, r in zip(prompts, responses)]
    width = max(len(x) for x in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.bool)
    action_mask = torch.zeros((len(rows), width - 1), dtype=torch.bool)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        input_ids[i, : len(p) + len(r)] = torch.tensor(p + r, dtype=torch.long)
        attention_mask[i, : len(p) + len(r)] = 1
        action_mask[i, len(p) - 1 : len(p) - 1 + len(r)] = 1
    return SequenceBatch(input_ids=input_ids, attention_mask=attention_mask, action_mask=action_mask)
