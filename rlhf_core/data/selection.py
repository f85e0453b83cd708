"""Pure selection of scored rows for the score stage: all rows, the best response per prompt (best-of-n /
rejection sampling), or a (best, worst) pair per prompt (iterative DPO).

Rows are grouped by prompt: by ``prompt_index`` when the rows have one (a generate stage's output), else by the
prompt value itself (``json.dumps`` of it, so that message lists group too). Groups keep the order in which their
first row appears; within a group ties go to the first row.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any

PROMPT_INDEX = "prompt_index"


def group_key(row: dict, prompt_key: str) -> str:
    """The prompt group of ``row``: its ``prompt_index`` when present, else its prompt value."""
    if PROMPT_INDEX in row:
        return f"index:{json.dumps(row[PROMPT_INDEX])}"
    return f"prompt:{json.dumps(row[prompt_key], sort_keys=True, ensure_ascii=False)}"


def group_rows(rows: Sequence[dict], prompt_key: str) -> list[list[int]]:
    """Row indices per prompt group, groups in order of their first row."""
    groups: dict[str, list[int]] = {}
    for i, row in enumerate(rows):
        groups.setdefault(group_key(row, prompt_key), []).append(i)
    return list(groups.values())


def _check(rows: Sequence[dict], scores: Sequence[float]) -> None:
    if len(rows) != len(scores):
        raise ValueError(f"{len(scores)} scores for {len(rows)} rows")


def select_all(rows: Sequence[dict], scores: Sequence[float]) -> list[dict]:
    """Every row as it is, with its ``score``."""
    _check(rows, scores)
    return [{**row, "score": float(s)} for row, s in zip(rows, scores)]


def _candidates(rows: Sequence[dict], group: list[int], response_key: str) -> list[int]:
    """The group's rows with a non-empty response: best-of-n and pairs feed SFT and DPO, which refuse empty ones
    (a policy can sample EOS at once)."""
    return [i for i in group if str(rows[i][response_key]).strip()]


def _best_row(row: dict, score: float, prompt_key: str, response_key: str) -> dict:
    rest = {k: v for k, v in row.items() if k not in (prompt_key, response_key, "score")}
    return {"prompt": row[prompt_key], "response": row[response_key], "score": float(score), **rest}


def select_best(
    rows: Sequence[dict], scores: Sequence[float], prompt_key: str, response_key: str, threshold: float | None = None
) -> tuple[list[dict], int]:
    """(the best-scoring row of each prompt as {prompt, response, score, ...its other fields}, prompts dropped):
    a prompt whose best score is below ``threshold`` (when given), or with only empty responses, is dropped. Empty
    responses are never selected."""
    _check(rows, scores)
    out, dropped = [], 0
    for group in group_rows(rows, prompt_key):
        group = _candidates(rows, group, response_key)
        if not group:
            dropped += 1
            continue
        best = max(group, key=lambda i: scores[i])  # the first of equal scores
        if threshold is not None and scores[best] < threshold:
            dropped += 1
            continue
        out.append(_best_row(rows[best], scores[best], prompt_key, response_key))
    return out, dropped


def select_pairs(
    rows: Sequence[dict], scores: Sequence[float], prompt_key: str, response_key: str
) -> tuple[list[dict], int]:
    """(one {prompt, chosen, rejected, chosen_score, rejected_score} per prompt, chosen its best-scoring response and
    rejected its worst among its non-empty responses, prompts skipped): a prompt is skipped when its best and worst
    scores are equal (one response, or a tie) or their texts are the same."""
    _check(rows, scores)
    out, skipped = [], 0
    for group in group_rows(rows, prompt_key):
        group = _candidates(rows, group, response_key)
        if not group:
            skipped += 1
            continue
        best = max(group, key=lambda i: scores[i])
        worst = min(group, key=lambda i: scores[i])
        chosen, rejected = rows[best][response_key], rows[worst][response_key]
        if scores[best] == scores[worst] or chosen == rejected:
            skipped += 1
            continue
        out.append(
            {
                "prompt": rows[best][prompt_key],
                "chosen": chosen,
                "rejected": rejected,
                "chosen_score": float(scores[best]),
                "rejected_score": float(scores[worst]),
            }
        )
    return out, skipped


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def selection_metrics(
    rows: Sequence[dict], scores: Sequence[float], out: Sequence[dict], dropped: int, prompt_key: str, select: str
) -> dict[str, Any]:
    """rows_in, rows_out, prompts, score_mean, score_std (population), score_best_mean (each prompt's best score,
    mean over the prompts), prompts_dropped (best: below the threshold; pairs: skipped), and for pairs margin_mean
    (chosen - rejected score, mean over the pairs)."""
    _check(rows, scores)
    groups = group_rows(rows, prompt_key)
    mean = _mean(scores)
    std = math.sqrt(_mean([(s - mean) ** 2 for s in scores])) if scores else float("nan")
    metrics: dict[str, Any] = {
        "rows_in": len(rows),
        "rows_out": len(out),
        "prompts": len(groups),
        "score_mean": mean,
        "score_std": std,
        "score_best_mean": _mean([max(scores[i] for i in g) for g in groups]),
        "prompts_dropped": dropped,
    }
    if select == "pairs":
        metrics["margin_mean"] = _mean([r["chosen_score"] - r["rejected_score"] for r in out])
    return metrics
