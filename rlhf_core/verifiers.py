"""Verifiable rewards bundled with the pipeline: name one as a stage's reward function, e.g.
``reward_fn: rlhf_core.verifiers:math_reward``. Each is called as ``fn(prompts, responses, *, labels, **columns)``
(``labels``: each row's value of ``data.label_key``) and returns one float per row.

- ``math_reward``: 1.0 when math-verify finds the response's answer equal to the label (a number or a string such as
  ``"42"``, ``"1/2"``, ``"\\frac{1}{2}"``), else 0.0. The answer is what the last ``<answer>...</answer>`` holds,
  else the whole response when it holds a ``\\boxed{}`` answer or is a bare formula (math-verify extracts it),
  else the response's last number: ``"17 + 25 = 42."`` and ``"The answer is 42"`` give 42. Of an equation only the
  right side of its last ``=`` counts, and an answer that still holds an operation between numbers counts as its
  last number. Never the last expression: math-verify would evaluate a restated question (``"To add 17 + 25, ..."``,
  ``"17 + 25"``, ``\\boxed{17+25}`` are 42 to it), and a policy learns to restate it.
  ``math_gold(prompt, response, label)`` is the same for one row, as a stage's ``gold_reward``.
- ``format_reward``: 1.0 when the response holds exactly one ``<answer>...</answer>`` with non-blank content, else
  0.0 (no partial credit); it needs no label.
- ``reasoning_gym_reward``: the score of reasoning-gym's own scorer for the task the label comes from (the label is
  a reasoning-gym entry, the ``entry`` column of a ``reasoning_gym:`` data source, so ``label_key: entry``), in
  [0, 1]. The answer is the stripped content of the last ``<answer>`` tag (as reasoning-gym's ``extract_answer``
  reads it), else the whole response stripped: there is no last-number fallback, since most tasks do not answer
  with a number and the scorers compare whole answers.

Math-verify's own timeouts use ``signal.alarm``, which only works on a main thread, and a reasoning-gym scorer is
any code: so both score rows in worker processes (a pool per library, started on the first call and kept), with a
timeout of ``ROW_TIMEOUT_S`` per row. A row that times out or raises scores 0.0, is counted in ``COUNTS`` and
logged; a worker past its timeout is killed and replaced. The workers are fresh interpreters (``subprocess``), not
multiprocessing's spawn or forkserver children, which import the caller's main module again (a job module that
imports torch makes every start take seconds instead of a third of a second).
"""

from __future__ import annotations

import atexit
import importlib
import importlib.util
import logging
import os
import re
import subprocess
import sys
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from functools import cache
from multiprocessing.connection import Connection, Pipe, wait
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

ROW_TIMEOUT_S = 5.0  # one row's scoring, from when a worker gets it
START_TIMEOUT_S = 120.0  # a worker's start: an interpreter and the library's import (reasoning-gym: ~2-3 s)
POOL_SIZE = max(1, min(4, os.cpu_count() or 1))
COUNTS: Counter[str] = Counter()  # rows scored 0.0 because they timed out ("timeouts") or raised ("errors")

ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
NUMBER_RE = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?")  # 42, -3, 1,024, 0.5, 1/2
# two numbers joined by an operation (a fraction a/b is a number): 18 + 45, 2*3, 7 - 2, 2^{10}, 3 \\times 4
OPERATION_RE = re.compile(r"\d\s*\)?\s*(?:[-+*^×÷·]|\\times|\\cdot|\\div)\s*[({]?\s*\d")
MATH_VERIFY = "math_verify"
REASONING_GYM = "reasoning_gym"
_ROOT = str(Path(__file__).resolve().parent.parent)  # where rlhf_core is imported from, for the workers


# ---------------------------------------------------------------------------------------------------------------------
# The reward functions


def math_reward(prompts: Sequence, responses: Sequence[str], *, labels: Sequence, **_: Any) -> list[float]:
    """1.0 per row whose answer math-verify finds equal to its label, else 0.0."""
    golds = [_label_text(label, i) for i, label in enumerate(_labels(labels, responses, "math_reward"), start=1)]
    rows = [(gold, _final(_answer(r, _math_answer(r)))) for gold, r in zip(golds, responses, strict=True)]
    return score_rows(_math_row, rows, MATH_VERIFY, "math_reward")


def _math_answer(response: str) -> str:
    """A response without an ``<answer>`` tag: all of it when it has a boxed answer or is a bare formula (no word
    outside LaTeX commands, as ``\\frac{1}{2}``), else its last number ("" when it has none)."""
    if "\\boxed" in response or not re.search(r"[A-Za-z]", re.sub(r"\\[A-Za-z]+", "", response)):
        return response
    return _last_number(response)


def _final(answer: str) -> str:
    """What math-verify is given of an answer: the right side of its last ``=``, or, when that side still holds an
    operation between numbers, its last number. math-verify evaluates what it parses, so a restated question
    (``18 + 45``, ``\\boxed{18+45}``) would equal the answer; a policy learns to restate it."""
    side = answer.rsplit("=", 1)[-1].strip()
    return _last_number(side) if OPERATION_RE.search(side) else side


def _last_number(text: str) -> str:
    numbers = NUMBER_RE.findall(text)
    return numbers[-1].replace(",", "") if numbers else ""


def math_gold(prompt: Any, response: str, label: Any) -> float:
    """``math_reward`` of one row, as a gold reward (``gold_reward:`` of a generate or PPO-kind stage, given each
    row's label): 1.0 when the answer equals the label, else 0.0; its mean is the accuracy."""
    return math_reward([prompt], [response], labels=[label])[0]


def format_reward(prompts: Sequence, responses: Sequence[str], **_: Any) -> list[float]:
    """1.0 per row holding exactly one ``<answer>...</answer>`` with non-blank content, else 0.0."""
    return [float(r.count("<answer>") == 1 and r.count("</answer>") == 1 and bool(_answer(r, ""))) for r in responses]


def reasoning_gym_reward(prompts: Sequence, responses: Sequence[str], *, labels: Sequence, **_: Any) -> list[float]:
    """Per row, reasoning-gym's score (0 to 1) of its answer against its label, a reasoning-gym entry."""
    entries = _labels(labels, responses, "reasoning_gym_reward")
    for i, entry in enumerate(entries, start=1):
        source = entry.get("metadata", {}).get("source_dataset") if isinstance(entry, dict) else None
        if not isinstance(source, str):
            raise ValueError(
                f"reasoning_gym_reward: the label of row {i} is not a reasoning-gym entry (got "
                f"{type(entry).__name__}); set the data section's label_key to the 'entry' column of a "
                "reasoning_gym: data source"
            )
    rows = [(entry, _answer(r, r.strip())) for entry, r in zip(entries, responses, strict=True)]
    return score_rows(_reasoning_gym_row, rows, REASONING_GYM, "reasoning_gym_reward")


def _labels(labels: Sequence, responses: Sequence[str], name: str) -> list:
    labels = list(labels)
    if len(labels) != len(responses):
        raise ValueError(f"{name}: {len(labels)} labels for {len(responses)} responses")
    return labels


def _label_text(label: Any, row: int) -> str:
    if isinstance(label, dict) and "answer" in label:  # a reasoning-gym entry
        label = label["answer"]
    if label is None:
        raise ValueError(f"math_reward: row {row} has no label (None)")
    return str(label)


def _answer(response: str, otherwise: str) -> str:
    """The stripped content of the last ``<answer>`` tag (an empty tag gives ""), ``otherwise`` when there is none."""
    found = ANSWER_RE.findall(response)
    return found[-1].strip() if found else otherwise


# Run in the workers: module-level so that they are sent by name.


def _math_row(gold: str, answer: str) -> float:
    from math_verify import parse, verify

    # a timeout of 0 (or None) turns math-verify's signal.alarm off (math_verify.utils.timeout): the pool times rows
    return float(verify(parse(gold, parsing_timeout=0), parse(answer, parsing_timeout=0), timeout_seconds=0))


def _reasoning_gym_row(entry: dict, answer: str) -> float:
    return float(_reasoning_gym_scorer(entry["metadata"]["source_dataset"])(answer, entry))


@cache
def _reasoning_gym_scorer(task: str) -> Callable[..., float]:
    import reasoning_gym

    return reasoning_gym.get_score_answer_fn(task)


# ---------------------------------------------------------------------------------------------------------------------
# The worker pools


def score_rows(
    fn: Callable[..., float], rows: Sequence[tuple], library: str, name: str, timeout_s: float = ROW_TIMEOUT_S
) -> list[float]:
    """``fn(*row)`` for each row in the pool of workers that import ``library``; 0.0 where it timed out or raised.
    ``fn`` must be a module-level function (it is sent by name)."""
    with _LOCK:
        pool = _POOLS.get(library)
        if pool is None or pool.pid != os.getpid():  # none yet, or inherited through a fork: the workers are not ours
            pool = _POOLS[library] = _Pool(library)
        scores, timeouts, errors = pool.run(fn, list(rows), timeout_s)
    if timeouts or errors:
        COUNTS.update(timeouts=timeouts, errors=len(errors))
        logger.warning(
            "%s: %d of %d rows timed out (over %s s) and %d raised%s; they score 0.0",
            name,
            timeouts,
            len(rows),
            timeout_s,
            len(errors),
            f" (first: {errors[0]})" if errors else "",
        )
    return scores


_LOCK = threading.Lock()
_POOLS: dict[str, _Pool] = {}


class _Worker:
    """A fresh interpreter running ``_serve``, talking over a socket pair; ``row`` is the row it is scoring."""

    def __init__(self, library: str) -> None:
        parent, child = Pipe()
        code = (
            f"import sys; sys.path.insert(0, {_ROOT!r}); import rlhf_core.verifiers as v; v._serve({child.fileno()})"
        )
        self.proc = subprocess.Popen([sys.executable, "-c", code], pass_fds=[child.fileno()], stdin=subprocess.DEVNULL)
        child.close()
        self.conn = parent
        self.conn.send((sys.path, library))
        self.ready = False
        self.row: int | None = None
        self.deadline = time.monotonic() + START_TIMEOUT_S

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self.conn.close()


class _Pool:
    def __init__(self, library: str) -> None:
        if importlib.util.find_spec(library) is None:
            raise RuntimeError(f"{library} is not installed; run `make setup` (it is in requirements/cpu-lock.txt)")
        self.library = library
        self.pid = os.getpid()
        self.workers = [_Worker(library) for _ in range(POOL_SIZE)]
        atexit.register(self.close)

    def close(self) -> None:
        if os.getpid() != self.pid:  # at the exit of a forked child: the workers are its parent's
            return
        for w in self.workers:
            w.kill()
        self.workers = []

    def _replace(self, w: _Worker) -> None:
        w.kill()
        self.workers[self.workers.index(w)] = _Worker(self.library)

    def run(self, fn: Callable[..., float], rows: list[tuple], timeout_s: float) -> tuple[list[float], int, list[str]]:
        """(scores, rows timed out, errors of the rows that raised): each row goes to the next idle worker."""
        scores, pending, timeouts, errors = [0.0] * len(rows), deque(range(len(rows))), 0, []
        while pending or any(w.row is not None for w in self.workers):
            for w in list(self.workers):
                if w.ready and w.row is None and pending:
                    i = pending.popleft()
                    try:
                        w.conn.send((fn, rows[i]))
                    except OSError:  # it died while idle (killed from outside): the row goes to another worker
                        pending.appendleft(i)
                        self._replace(w)
                        continue
                    w.row, w.deadline = i, time.monotonic() + timeout_s
            waiting = [w for w in self.workers if not w.ready or w.row is not None]
            left = min(w.deadline for w in waiting) - time.monotonic()
            for conn in wait([w.conn for w in waiting], timeout=max(0.0, left)):
                w = next(w for w in self.workers if w.conn is conn)
                try:
                    message = w.conn.recv()
                except (EOFError, OSError):  # the worker died: a crash on a row is that row's error
                    if not w.ready:
                        self._fail(f"a {self.library} worker exited at start with status {w.proc.wait()}")
                    errors.append(f"the worker exited with status {w.proc.wait()}")
                    self._replace(w)
                    continue
                if not w.ready:
                    if message != "ready":
                        self._fail(message)
                    w.ready = True
                    continue
                (ok, value), row, w.row = message, w.row, None
                assert row is not None, "a worker answered with no row to score"
                if ok:
                    scores[row] = value
                else:
                    errors.append(value)
            now = time.monotonic()
            for w in list(self.workers):
                if now < w.deadline or w.ready and w.row is None:
                    continue
                if not w.ready:
                    self._fail(f"a {self.library} worker did not start within {START_TIMEOUT_S} s")
                timeouts += 1
                self._replace(w)
        return scores, timeouts, errors

    def _fail(self, problem: str) -> None:
        self.close()
        _POOLS.pop(self.library, None)
        raise RuntimeError(problem)


def _serve(fd: int) -> None:
    """A worker's loop: import the library, answer "ready", then ``(fn, args)`` -> ``(True, score)`` or
    ``(False, error)`` until the pool closes the connection."""
    conn = Connection(fd)
    path, library = conn.recv()
    sys.path[:] = path
    # math-verify warns once that its timeout is off: the pool's timeout replaces it
    logging.getLogger(MATH_VERIFY).setLevel(logging.ERROR)
    try:
        importlib.import_module(library)
    except Exception as e:
        conn.send(f"cannot import {library} ({type(e).__name__}: {e}); run `make setup`")
        return
    conn.send("ready")
    while True:
        try:
            fn, args = conn.recv()
        except (EOFError, OSError):
            return
        try:
            out = (True, float(fn(*args)))
        except Exception as e:  # any row's failure is its score of 0.0, reported by the pool
            out = (False, f"{type(e).__name__}: {str(e)[:200]}")
        conn.send(out)
