"""Turn dataset rows into token ids for the SFT, reward-model, DPO and KTO stages, refusing bad rows up front.

Prompt formatting, in order: ``prompt_template`` first wraps the prompt text (a message list's last user message);
then a list of chat messages or ``apply_chat_template`` with a tokenizer that has a chat template -> the template;
``input_template`` -> ``template.format(prompt)``; otherwise the text as it is. With
``output_key: null`` (SFT) or ``prompt_key: null`` (preferences) the texts are HH-RLHF transcripts
("\\n\\nHuman: ...\\n\\nAssistant: ...") split before the last assistant turn. Message lists are checked by
:func:`rlhf_core.data.loading.require_keys` (roles, alternation, the answer last). Rows whose response is cut at
``max_len`` are counted and reported once per file on stderr.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from rlhf_core.config import (
    DataSource,
    GeneratePrompts,
    HeldOutSource,
    KTOData,
    PreferenceData,
    PromptData,
    SFTData,
)
from rlhf_core.data.loading import DataError, load_rows, require_keys

HH_ASSISTANT = "\n\nAssistant:"


def split_hh(text: str, where: str) -> tuple[str, str]:
    """Split an HH-RLHF transcript into (prompt up to and including the last 'Assistant:', response)."""
    cut = text.rfind(HH_ASSISTANT)
    if cut < 0:
        raise DataError(f"{where}: expected an HH-RLHF transcript with '\\n\\nAssistant:' in it")
    cut += len(HH_ASSISTANT)
    return text[:cut], text[cut:]


def _chat_template(tokenizer: Any, messages: list[dict], where: str | None) -> str:
    """The template's text of ``messages`` plus the generation prompt.

    A template without a system role (the bundled one) gets the system text prepended to the first user message;
    any other template failure is a DataError naming ``where``.
    """
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except Exception as e:  # noqa: BLE001 - jinja2 and transformers raise several types
        error = e
    if len(messages) > 1 and messages[0].get("role") == "system":
        system, first = messages[0], messages[1]
        merged = [{**first, "content": f"{system['content']}\n\n{first['content']}"}, *messages[2:]]
        try:
            return tokenizer.apply_chat_template(merged, add_generation_prompt=True, tokenize=False)
        except Exception:  # noqa: BLE001
            pass
    reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
    raise DataError(
        f"{where + ': ' if where else ''}the tokenizer's chat template refused the messages ({reason}); "
        "fix the roles or set data.apply_chat_template/input_template"
    )


def templated(prompt: Any, template: str | None) -> Any:
    """``prompt`` with ``template`` (``data.prompt_template``, one ``{}``) around its text: a string's whole text, a
    message list's last user message; as it is without a template."""
    if template is None:
        return prompt
    if not isinstance(prompt, list):
        return template.format(prompt)
    last = max((i for i, m in enumerate(prompt) if m.get("role") == "user"), default=None)
    return [{**m, "content": template.format(m["content"])} if i == last else m for i, m in enumerate(prompt)]


def render_prompt(prompt: Any, tokenizer: Any, cfg: DataSource, where: str | None = None) -> str:
    """Prompt text as the model sees it (a string, or a list of {'role', 'content'} messages)."""
    prompt = templated(prompt, cfg.prompt_template)
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if isinstance(prompt, list):
        if not has_template:
            return "".join(f"{m['role']}: {m['content']}\n" for m in prompt)
        return _chat_template(tokenizer, prompt, where)
    if cfg.input_template is not None:
        return cfg.input_template.format(prompt)
    if cfg.apply_chat_template and has_template:
        return _chat_template(tokenizer, [{"role": "user", "content": prompt}], where)
    return prompt


def _split_conversation(value: Any, tokenizer: Any, cfg: DataSource, where: str) -> tuple[str, str]:
    """(prompt text, response text) of a full conversation: HH text or a message list ending with the answer."""
    if isinstance(value, list):
        if not value or value[-1].get("role") != "assistant":
            raise DataError(f"{where}: a message list must end with an assistant message")
        return render_prompt(value[:-1], tokenizer, cfg, where), value[-1]["content"]
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


def _warn_truncated(source: str, truncated: int, total: int, max_len: int) -> None:
    """One stderr line per file when responses were cut at ``max_len`` (the model never sees their ends)."""
    if truncated:
        print(f"warning: {source}: {truncated} of {total} rows truncated to data.max_len={max_len}", file=sys.stderr)


def _rows(cfg: DataSource, split: str, storage_options: dict | None) -> tuple[str, list[dict]]:
    if split == "train":
        source, hf_split, max_rows = cfg.train_path, cfg.train_split, cfg.max_samples
    else:
        assert isinstance(cfg, HeldOutSource) and cfg.eval_path is not None, "eval_path must be checked by the config"
        source, hf_split, max_rows = cfg.eval_path, cfg.eval_split, None
    return source, load_rows(source, split=hf_split, storage_options=storage_options, max_rows=max_rows)


def sft_examples(cfg: SFTData, tokenizer: Any, split: str = "train", storage_options: dict | None = None) -> list:
    """[{'input_ids', 'loss_mask'}]: loss on the response tokens and the final EOS only."""
    source, rows = _rows(cfg, split, storage_options)
    if cfg.output_key:
        kinds = {cfg.input_key: "prompt", cfg.output_key: "response"}
    else:
        kinds = {cfg.input_key: "conversation"}
    require_keys(rows, list(kinds), source, kinds)
    out, truncated = [], 0
    for i, row in enumerate(rows, start=1):
        where = f"{source} row {i}"
        if cfg.output_key:
            prompt = render_prompt(row[cfg.input_key], tokenizer, cfg, where)
            response = _response_text(row[cfg.output_key], where)
        else:
            prompt, response = _split_conversation(row[cfg.input_key], tokenizer, cfg, where)
        prompt_ids, response_ids = _encode_parts(tokenizer, prompt, response, cfg.max_len, where)
        ids, prompt_len = (prompt_ids + response_ids)[: cfg.max_len], len(prompt_ids)
        truncated += prompt_len + len(response_ids) > cfg.max_len
        out.append({"input_ids": ids, "loss_mask": [0] * prompt_len + [1] * (len(ids) - prompt_len)})
    _warn_truncated(source, truncated, len(rows), cfg.max_len)
    return out


def _response_text(value: Any, where: str) -> str:
    """The response of a row whose prompt is under its own key: a string, or messages ending with the answer."""
    if isinstance(value, list):
        if not value or value[-1].get("role") != "assistant":
            raise DataError(f"{where}: a message list must end with an assistant message")
        return value[-1]["content"]
    return value


def _prompt_and_response(row: dict, key: str, tokenizer: Any, cfg: PreferenceData, where: str) -> tuple[str, str]:
    """(rendered prompt, response text) of ``row[key]``, the prompt from ``cfg.prompt_key`` or from the transcript.

    An empty (or whitespace-only) response is refused: ``where`` names the file, row and key.
    """
    if cfg.prompt_key:
        prompt, response = render_prompt(row[cfg.prompt_key], tokenizer, cfg, where), _response_text(row[key], where)
    else:
        prompt, response = _split_conversation(row[key], tokenizer, cfg, where)
    if not response.strip():
        raise DataError(f"{where}: the response is empty; drop the row or fix it")
    return prompt, response


def _encode_parts(tokenizer: Any, prompt: str, response: str, max_len: int, where: str) -> tuple[list, list]:
    """(prompt ids, response ids + EOS), untruncated; the prompt is refused at ``max_len`` tokens (see encode)."""
    prompt_ids = encode_prompt(tokenizer, prompt, max_len, where)
    return prompt_ids, tokenizer(response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]


def _pairs(
    cfg: PreferenceData, tokenizer: Any, split: str, storage_options: dict | None
) -> tuple[str, list[tuple[tuple, tuple]]]:
    """(source, [(chosen, rejected)]), each side (prompt text, prompt ids, response ids + EOS), checked.

    Refused rows (one-line DataError naming file, row and key): a missing or empty key, a bad message list, an
    empty response, and chosen equal to rejected (the same text after rendering, also up to whitespace around the
    response, or the same token ids within ``max_len``).
    """
    source, rows = _rows(cfg, split, storage_options)
    answer = "response" if cfg.prompt_key else "conversation"
    kinds = {
        **({cfg.prompt_key: "prompt"} if cfg.prompt_key else {}),
        cfg.chosen_key: answer,
        cfg.rejected_key: answer,
    }
    require_keys(rows, list(kinds), source, kinds)
    out = []
    for i, row in enumerate(rows, start=1):
        where = f"{source} row {i}"
        sides, texts = [], []
        for key in (cfg.chosen_key, cfg.rejected_key):
            prompt, response = _prompt_and_response(row, key, tokenizer, cfg, f"{where} key '{key}'")
            prompt_ids, response_ids = _encode_parts(tokenizer, prompt, response, cfg.max_len, where)
            sides.append((prompt, prompt_ids, response_ids))
            texts.append((prompt, response))
        (_, cp, cr), (_, rp, rr) = sides
        same = None
        if texts[0] == texts[1]:
            same = "text"
        elif texts[0][0] == texts[1][0] and texts[0][1].strip() == texts[1][1].strip():
            same = "text up to leading/trailing whitespace"
        elif cp + cr == rp + rr:
            same = "token ids"
        elif (cp + cr)[: cfg.max_len] == (rp + rr)[: cfg.max_len]:
            same = f"token ids within data.max_len {cfg.max_len}"
        if same is not None:
            raise DataError(
                f"{where} keys '{cfg.chosen_key}' and '{cfg.rejected_key}': chosen and rejected are the same "
                f"{same}, so the pair prefers nothing; drop the row or fix it"
            )
        out.append((sides[0], sides[1]))
    return source, out


def preference_examples(
    cfg: PreferenceData, tokenizer: Any, split: str = "train", storage_options: dict | None = None
) -> list:
    """[{'chosen_ids', 'rejected_ids', 'chosen_prompt_len', 'rejected_prompt_len'}] for the reward model and DPO.

    ``*_prompt_len`` counts the prompt tokens at the start of each sequence (they may differ with HH transcripts);
    the tokens after them are the response and its EOS, truncated to ``max_len``.  Bad rows are refused: see
    :func:`_pairs`.
    """
    source, pairs = _pairs(cfg, tokenizer, split, storage_options)
    truncated = sum(len(cp + cr) > cfg.max_len or len(rp + rr) > cfg.max_len for (_, cp, cr), (_, rp, rr) in pairs)
    _warn_truncated(source, truncated, len(pairs), cfg.max_len)
    out = []
    for (_, cp, cr), (_, rp, rr) in pairs:
        out.append(
            {
                "chosen_ids": (cp + cr)[: cfg.max_len],
                "rejected_ids": (rp + rr)[: cfg.max_len],
                "chosen_prompt_len": len(cp),
                "rejected_prompt_len": len(rp),
            }
        )
    return out


def _label(row: dict, key: str, where: str) -> bool:
    """The 'desirable' label of an unpaired KTO row: true/false or 1/0."""
    if key not in row:
        present = ", ".join(map(str, row.keys())) or "none"
        raise DataError(f"{where} key '{key}': missing (row has keys: {present}); add the label or drop the row")
    value = row[key]
    if isinstance(value, bool):
        return value
    if type(value) is int and value in (0, 1):
        return bool(value)
    raise DataError(
        f"{where} key '{key}': the label must be true/false or 1/0, got {value!r}; fix the label or drop the row"
    )


def kto_examples(
    cfg: KTOData, tokenizer: Any, split: str = "train", storage_options: dict | None = None
) -> list[dict]:
    """[{'input_ids', 'prompt_len', 'desirable', 'kl_ids', 'kl_prompt_len'}] for KTO.

    With ``label_key: null`` the rows are preference pairs (checked as in :func:`preference_examples`) and each
    gives two examples, chosen (desirable) then rejected (undesirable).  Otherwise each row is one example:
    ``prompt_key``, ``response_key`` and the boolean (or 0/1) ``label_key``; with ``prompt_key: null`` the
    response key holds the whole transcript (HH text or a message list).

    ``kl_ids`` is a mismatched pair for KTO's KL reference point: this example's prompt ids followed by the
    response ids (with EOS) of the next example, cyclically in dataset order, whose prompt text differs;
    ``kl_prompt_len`` is its prompt length.  Both sequences are truncated to ``max_len``.  A dataset without both
    desirable and undesirable examples, or with a single distinct prompt, is refused.
    """
    items: list[tuple[str, list[int], list[int], bool]] = []  # (prompt text, prompt ids, response ids, desirable)
    if cfg.label_key is None:
        source, pairs = _pairs(cfg, tokenizer, split, storage_options)
        for chosen, rejected in pairs:
            items += [(*chosen, True), (*rejected, False)]
        truncated = sum(len(c[1] + c[2]) > cfg.max_len or len(r[1] + r[2]) > cfg.max_len for c, r in pairs)
        _warn_truncated(source, truncated, len(pairs), cfg.max_len)
    else:
        source, rows = _rows(cfg, split, storage_options)
        answer = "response" if cfg.prompt_key else "conversation"
        kinds = {**({cfg.prompt_key: "prompt"} if cfg.prompt_key else {}), cfg.response_key: answer}
        require_keys(rows, list(kinds), source, kinds)
        for i, row in enumerate(rows, start=1):
            where = f"{source} row {i}"
            desirable = _label(row, cfg.label_key, where)
            prompt, response = _prompt_and_response(
                row, cfg.response_key, tokenizer, cfg, f"{where} key '{cfg.response_key}'"
            )
            items.append((prompt, *_encode_parts(tokenizer, prompt, response, cfg.max_len, where), desirable))
        truncated = sum(len(prompt_ids + response_ids) > cfg.max_len for _, prompt_ids, response_ids, _ in items)
        _warn_truncated(source, truncated, len(rows), cfg.max_len)
    labels = {d for *_, d in items}
    if labels != {True, False}:
        kind = "desirable" if True in labels else "undesirable"
        how = f"labelled by key '{cfg.label_key}'" if cfg.label_key else "from pairs"
        raise DataError(
            f"{source}: every example ({how}) is {kind}; KTO needs both desirable and undesirable examples"
        )
    # next[k]: the first index after k (in the list repeated twice) whose prompt text differs from that of k
    n, texts = len(items), [it[0] for it in items] * 2
    nxt: list[int | None] = [None] * (2 * n)
    for k in range(2 * n - 2, -1, -1):
        nxt[k] = k + 1 if texts[k + 1] != texts[k] else nxt[k + 1]
    out = []
    for k, (_, prompt_ids, response_ids, desirable) in enumerate(items):
        j = nxt[k]
        if j is None or j - k >= n:
            raise DataError(
                f"{source}: every example has the same prompt; KTO needs at least two distinct prompts "
                "(its KL reference point pairs each prompt with another prompt's response)"
            )
        out.append(
            {
                "input_ids": (prompt_ids + response_ids)[: cfg.max_len],
                "prompt_len": len(prompt_ids),
                "desirable": desirable,
                "kl_ids": (prompt_ids + items[j % n][2])[: cfg.max_len],
                "kl_prompt_len": len(prompt_ids),
            }
        )
    return out


def pad_right(sequences: list[list[int]], pad_value: int) -> torch.Tensor:
    """(B, T_max) long tensor, each row right-padded with ``pad_value``."""
    width = max(len(s) for s in sequences)
    return torch.tensor([s + [pad_value] * (width - len(s)) for s in sequences], dtype=torch.long)


def prompt_examples(
    cfg: PromptData | GeneratePrompts,
    tokenizer: Any,
    split: str = "train",
    storage_options: dict | None = None,
    max_rows: int | None = None,
) -> list[dict]:
    """[{'prompt_ids', 'prompt', 'columns'[, 'label']}] for RL: the rendered prompt's ids, the raw prompt value, the
    row's other values by column and, with ``label_key``, its label (which travels with the prompt to every sample
    of it and to the rewards)."""
    source, rows = _rows(cfg, split, storage_options)
    if max_rows is not None:
        rows = rows[:max_rows]
    keys = {cfg.input_key: "prompt", **({cfg.label_key: "label"} if cfg.label_key is not None else {})}
    require_keys(rows, list(keys), source, keys)
    out = []
    for i, row in enumerate(rows, start=1):
        text = render_prompt(row[cfg.input_key], tokenizer, cfg, f"{source} row {i}")
        ids = encode_prompt(tokenizer, text, cfg.max_len, f"{source} row {i}")
        example = {"prompt_ids": ids, "prompt": row[cfg.input_key]}
        example["columns"] = {k: v for k, v in row.items() if k != cfg.input_key}
        if cfg.label_key is not None:
            example["label"] = row[cfg.label_key]
        out.append(example)
    return out
