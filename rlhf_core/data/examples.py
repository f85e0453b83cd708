"""Turn dataset rows into token ids for the SFT and reward-model stages, refusing bad rows up front.

Prompt formatting, in order: a list of chat messages or ``apply_chat_template`` with a tokenizer that has a chat
template -> the template; ``input_template`` -> ``template.format(prompt)``; otherwise the text as it is. With
``output_key: null`` (SFT) or ``prompt_key: null`` (preferences) the texts are HH-RLHF transcripts
("\\n\\nHuman: ...\\n\\nAssistant: ...") split before the last assistant turn.
"""

from __future__ import annotations

from typing import Any

import torch

from rlhf_core.config import DataConfig
from rlhf_core.data.loading import DataError, load_rows, require_keys

HH_ASSISTANT = "\n\nAssistant:"


def split_hh(text: str, where: str) -> tuple[str, str]:
    """Split an HH-RLHF transcript into (prompt up to and including the last 'Assistant:', response)."""
    cut = text.rfind(HH_ASSISTANT)
    if cut < 0:
        raise DataError(f"{where}: expected an HH-RLHF transcript with '\\n\\nAssistant:' in it")
    cut += len(HH_ASSISTANT)
    return text[:cut], text[cut:]


def render_prompt(prompt: Any, tokenizer: Any, cfg: DataConfig) -> str:
    """Prompt text as the model sees it (a string, or a list of {'role', 'content'} messages)."""
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if isinstance(prompt, list):
        if not has_template:
            return "".join(f"{m['role']}: {m['content']}\n" for m in prompt)
        return tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
    if cfg.input_template is not None:
        return cfg.input_template.format(prompt)
    if cfg.apply_chat_template and has_template:
        messages = [{"role": "user", "content": prompt}]
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return prompt


def _split_conversation(value: Any, tokenizer: Any, cfg: DataConfig, where: str) -> tuple[str, str]:
    """(prompt text, response text) of a full conversation: HH text or a message list ending with the answer."""
    if isinstance(value, list):
        if not value or value[-1].get("role") != "assistant":
            raise DataError(f"{where}: a message list must end with an assistant message")
        return render_prompt(value[:-1], tokenizer, cfg), value[-1]["content"]
    return split_hh(value, where)


def encode_prompt(tokenizer: Any, prompt_text: str, max_len: int, where: str) -> list[int]:
    """Prompt token ids (BOS added unless the text already starts with it); refused at ``max_len`` tokens or more."""
    bos = tokenizer.bos_token
    add_special = not (bos and prompt_text.startswith(bos))  # chat templates that write BOS themselves
    prompt_ids = tokenizer(prompt_text, add_special_tokens=add_special)["input_ids"]
    if len(prompt_ids) >= max_len:
        raise DataError(
            f"{where}: the prompt has {len(prompt_ids)} tokens but data.max_len is {max_len} "
            "(prompt plus at least one response token); raise data.max_len or drop the row"
        )
    return prompt_ids


def encode(tokenizer: Any, prompt_text: str, response_text: str, max_len: int, where: str) -> tuple[list[int], int]:
    """Token ids of prompt + response + EOS, and the prompt length; long responses are truncated to ``max_len``."""
    prompt_ids = encode_prompt(tokenizer, prompt_text, max_len, where)
    response_ids = tokenizer(response_text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    ids = (prompt_ids + response_ids)[:max_len]
    return ids, len(prompt_ids)


def _rows(cfg: DataConfig, split: str, storage_options: dict | None) -> tuple[str, list[dict]]:
    source = cfg.train_path if split == "train" else cfg.eval_path
    assert source is not None, "eval_path must be checked by the config"
    hf_split = cfg.train_split if split == "train" else cfg.eval_split
    max_rows = cfg.max_samples if split == "train" else None
    return source, load_rows(source, split=hf_split, storage_options=storage_options, max_rows=max_rows)


def sft_examples(cfg: DataConfig, tokenizer: Any, split: str = "train", storage_options: dict | None = None) -> list:
    """[{'input_ids', 'loss_mask'}]: loss on the response tokens and the final EOS only."""
    source, rows = _rows(cfg, split, storage_options)
    keys = [cfg.input_key] + ([cfg.output_key] if cfg.output_key else [])
    require_keys(rows, keys, source)
    out = []
    for i, row in enumerate(rows, start=1):
        where = f"{source} row {i}"
        if cfg.output_key:
            prompt, response = render_prompt(row[cfg.input_key], tokenizer, cfg), row[cfg.output_key]
        else:
            prompt, response = _split_conversation(row[cfg.input_key], tokenizer, cfg, where)
        ids, prompt_len = encode(tokenizer, prompt, response, cfg.max_len, where)
        out.append({"input_ids": ids, "loss_mask": [0] * prompt_len + [1] * (len(ids) - prompt_len)})
    return out


def preference_examples(
    cfg: DataConfig, tokenizer: Any, split: str = "train", storage_options: dict | None = None
) -> list:
    """[{'chosen_ids', 'rejected_ids'}] for the pairwise reward-model loss."""
    source, rows = _rows(cfg, split, storage_options)
    keys = ([cfg.prompt_key] if cfg.prompt_key else []) + [cfg.chosen_key, cfg.rejected_key]
    require_keys(rows, keys, source)
    out = []
    for i, row in enumerate(rows, start=1):
        where = f"{source} row {i}"
        pair = {}
        for name, key in (("chosen_ids", cfg.chosen_key), ("rejected_ids", cfg.rejected_key)):
            if cfg.prompt_key:
                prompt, response = render_prompt(row[cfg.prompt_key], tokenizer, cfg), row[key]
            else:
                prompt, response = _split_conversation(row[key], tokenizer, cfg, f"{where} key '{key}'")
            pair[name], _ = encode(tokenizer, prompt, response, cfg.max_len, where)
        out.append(pair)
    return out


def pad_right(sequences: list[list[int]], pad_value: int) -> torch.Tensor:
    """(B, T_max) long tensor, each row right-padded with ``pad_value``."""
    width = max(len(s) for s in sequences)
    return torch.tensor([s + [pad_value] * (width - len(s)) for s in sequences], dtype=torch.long)


def prompt_examples(
    cfg: DataConfig, tokenizer: Any, split: str = "train", storage_options: dict | None = None,
    max_rows: int | None = None,
) -> list[dict]:  # fmt: skip
    """[{'prompt_ids', 'prompt'}] for RL: the rendered prompt's ids and the raw prompt value."""
    source, rows = _rows(cfg, split, storage_options)
    if max_rows is not None:
        rows = rows[:max_rows]
    require_keys(rows, [cfg.input_key], source)
    out = []
    for i, row in enumerate(rows, start=1):
        text = render_prompt(row[cfg.input_key], tokenizer, cfg)
        ids = encode_prompt(tokenizer, text, cfg.max_len, f"{source} row {i}")
        out.append({"prompt_ids": ids, "prompt": row[cfg.input_key]})
    return out
