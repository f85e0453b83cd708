"""Asynchronous rollout for the RL controller, after OpenRLHF's ``PPOTrainerAsync``: a generator thread makes the
rollout batches of the next steps while the controller's own step loop trains on the current one.

The two sides are joined by a queue bounded by ``queue_size`` slot tokens (a counting semaphore): the generator takes
a slot before it generates a batch, the trainer gives it back when it takes the batch. A lock keeps generation and
the weight update apart, so every batch is sampled with one weight version (no partial rollout), and a batch trained
after ``v`` weight updates was generated after at least ``v - queue_size`` of them: staleness never exceeds
``queue_size``. The engines and roles are remote, so the two threads overlap for real while each waits on its calls.

Usage, the trainer being the caller's loop::

    with AsyncRollout(generate, queue_size) as rollout:
        for record, batch in rollout.batches(start, stop):
            train(batch)                   # the step for prompt batch ``record.index``
            with rollout.weight_update():  # at most once per batch; generation waits meanwhile
                push_weights()
            save(position=record.index + 1)  # the data position to checkpoint

With ``partial=True`` (partial rollout) the generator holds the lock only for a few decoding steps at a time:
``generate(index, turn)`` makes its engine calls inside ``with turn():``, and a weight update can come between two
turns. A batch then spans the versions from its first turn to its last (``version_start``, ``version_end``), each
token recording its own, and the staleness bound holds for its first turn's version.

The data position is the index of the next prompt batch to train. Batches generated but not trained when a run stops
are lost and generated again on resume (with the checkpointed weights), so a resumed run trains the same prompt
batches in the same order as an uninterrupted one, though not the same samples: which weight version generated a
batch depends on timing, as it does in an uninterrupted async run.
"""

from __future__ import annotations

import functools
import queue
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Generic, TypeVar

B = TypeVar("B")
# One step's rollout as the engines return it: responses, the log-probs they sampled them with, and with partial
# rollout each token's weight version (None without).
Rollout = tuple[list[list[int]], list[list[float]], list[list[int]] | None]


def rollout_logs(record: BatchRecord, versions: list[list[int]] | None) -> dict[str, float]:
    """A step's async rollout as logged: the weight updates it lagged when it trained (``rollout_staleness``), the
    seconds the generator took to make it (``rollout_generate_s``; the step's ``timing/generation_s`` is only the
    part it waited for), the updates that came while it was generated (``rollout_version_span``: 0 but with partial
    rollout) and, with partial rollout, the share of its tokens sampled after an update that came during their
    response (``rollout_tokens_after_update``, from each token's version)."""
    logs = {
        "rollout_staleness": float(record.staleness),
        "rollout_version_span": float(record.version_end - record.version_start),
        "rollout_generate_s": record.seconds,
    }
    if versions is not None:
        after = sum(1 for v in versions for x in v if x != v[0])
        logs["rollout_tokens_after_update"] = after / max(sum(map(len, versions)), 1)
    return logs


@dataclass
class BatchRecord:
    """One prompt batch as the generator made it: the weight versions (updates applied) when its generation started
    and ended (equal but with partial rollout), and the version that trained it (None: filtered to empty, or never
    trained)."""

    index: int
    version_start: int
    version_end: int
    trained_version: int | None = None
    seconds: float = 0.0  # in ``generate``, lock waits included

    @property
    def staleness(self) -> int:
        assert self.trained_version is not None, f"batch {self.index} was not trained"
        return self.trained_version - self.version_start


_DONE = object()  # the generator's last item: every prompt batch up to ``stop`` was generated


class AsyncRollout(Generic[B]):
    """A generator thread calling ``generate(index)`` for the prompt batches of ``batches(start, stop)`` ahead of the
    caller's loop; ``generate`` returns None for a batch filtered to empty, which is skipped. An exception in
    ``generate`` is raised in the caller's loop; leaving the ``with`` block (done, ``break`` or an exception) stops
    the generator and waits for its current call."""

    def __init__(self, generate: Callable[..., B | None], queue_size: int = 1, partial: bool = False) -> None:
        """``generate(index)``, or with ``partial`` ``generate(index, turn)``: see the module's docstring."""
        if queue_size < 1:
            raise ValueError(f"queue_size must be at least 1, got {queue_size}")
        self.queue_size, self.partial = queue_size, partial
        self.version = 0  # weight updates applied; written only under the lock
        self.position: int | None = None  # the next prompt batch to train
        self.records: list[BatchRecord] = []  # every batch generated, in order
        self._generate = generate
        self._slots = threading.Semaphore(queue_size)
        self._queue: queue.Queue = queue.Queue()  # at most queue_size batches: the slots bound it
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._error: BaseException | None = None  # the generator's, raised at the caller's next batch
        self._thread: threading.Thread | None = None
        self._updated = True  # whether the batch in training has had its weight update

    def __enter__(self) -> AsyncRollout[B]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def batches(self, start: int, stop: int) -> Iterator[tuple[BatchRecord, B]]:
        """(record, batch) for the non-empty prompt batches in [start, stop), in order (``record.index``: the prompt
        batch, ``record.staleness``: the weight updates it lags); ``position`` is ``stop`` once the loop ends by
        itself."""
        assert self._thread is None, "one run per AsyncRollout"
        self.position = start
        self._thread = threading.Thread(target=self._generator, args=(start, stop), name="rollout", daemon=True)
        self._thread.start()
        while True:
            item = self._queue.get()
            if self._error is not None:  # before any batch still queued: fail now, not queue_size steps later
                raise self._error
            if item is _DONE:
                self.position = stop
                return
            record, batch = item
            self._slots.release()  # taken: the generator may start the next batch
            record.trained_version = self.version
            self._updated = False
            yield record, batch
            self.position = record.index + 1

    @contextmanager
    def weight_update(self) -> Iterator[None]:
        """Hold generation off while the caller pushes new weights to the engines; the version counts the update."""
        assert not self._updated, "one weight update per trained batch: the staleness bound counts on it"
        with self._lock:
            yield
            self.version += 1
        self._updated = True

    def stop(self) -> None:
        """End the generator: wake it from a slot wait and wait for its current ``generate`` call to return."""
        self._stopping.set()
        self._slots.release()
        if self._thread is not None:
            self._thread.join()

    def _generator(self, start: int, stop: int) -> None:
        try:
            for index in range(start, stop):
                self._slots.acquire()
                if self._stopping.is_set():
                    return
                turns: list[int] = []  # the weight version at each turn
                started = time.perf_counter()
                if self.partial:
                    batch = self._generate(index, functools.partial(self._turn, turns))
                else:
                    with self._turn(turns):  # the whole generation in one turn
                        batch = self._generate(index)
                turns = turns or [self.version]
                record = BatchRecord(index, turns[0], turns[-1], seconds=time.perf_counter() - started)
                self.records.append(record)
                if batch is None:
                    self._slots.release()  # filtered to empty: nothing for the trainer to take and give back
                else:
                    self._queue.put((record, batch))
            self._queue.put(_DONE)
        except BaseException as error:  # raised in the caller's loop, which then stops this thread
            self._error = error
            self._queue.put(_DONE)  # wakes the caller if it waits for a batch

    @contextmanager
    def _turn(self, versions: list[int]) -> Iterator[None]:
        """One turn of the generator's engine calls (a whole batch, or with partial rollout a few decoding steps): no
        weight update meanwhile."""
        with self._lock:
            versions.append(self.version)
            yield
