"""The async rollout's invariants with a fake generator and trainer (no engines): staleness within the queue size,
one weight version per batch, empty batches, the end of both loops, failures on either side, and the data position
after a stop and resume."""

import random
import time

import pytest

from rlhf_core.jobs.ppo.async_rollout import AsyncRollout

pytestmark = pytest.mark.timeout(10)  # a deadlock fails here instead of hanging the suite


class PartialEngine:
    """A partial rollout's fake engine: batch ``index`` in a few turns of a few ms each, recording the weights each
    turn saw; returns ``(index, weights at the first turn)``."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.weights = 0
        self.turns: dict[int, list[int]] = {}

    def generate(self, index: int, turn) -> tuple[int, int]:
        seen = self.turns[index] = []
        for _ in range(self.rng.randint(1, 4)):
            with turn():
                seen.append(self.weights)
                time.sleep(self.rng.uniform(0.0, 0.002))
        return index, seen[0]


class FakeEngine:
    """Generates batch ``index`` as ``(index, weights)`` after a seeded delay of a few ms; ``weights`` is the version
    the trainer last pushed, read at the start and end of the generation. None for the ``empty`` indices."""

    def __init__(self, seed: int, empty: frozenset[int] = frozenset(), fail_at: int | None = None) -> None:
        self.rng = random.Random(seed)
        self.weights = 0
        self.empty, self.fail_at = empty, fail_at
        self.seen: list[tuple[int, int, int]] = []  # (index, weights at start, weights at end)

    def generate(self, index: int) -> tuple[int, int] | None:
        start = self.weights
        if index == self.fail_at:
            raise RuntimeError(f"engine failed on batch {index}")
        time.sleep(self.rng.uniform(0.0, 0.004))
        self.seen.append((index, start, self.weights))
        return None if index in self.empty else (index, start)


def train_all(rollout: AsyncRollout, engine: FakeEngine, start: int, stop: int, seed: int, stop_after=None) -> list:
    """The trainer: a few ms of training per batch, then a weight update; ``stop_after``: leave after that index."""
    rng, trained = random.Random(seed), []
    for record, (batch_index, _) in rollout.batches(start, stop):
        index = record.index
        assert batch_index == index
        time.sleep(rng.uniform(0.0, 0.004))
        with rollout.weight_update():
            time.sleep(rng.uniform(0.0, 0.001))
            engine.weights += 1
        trained.append(index)
        if index == stop_after:
            break
    return trained


@pytest.mark.parametrize("queue_size", [1, 2, 4])
def test_staleness_never_exceeds_the_queue_size_and_each_batch_sees_one_weight_version(queue_size):
    engine = FakeEngine(seed=queue_size)
    with AsyncRollout(engine.generate, queue_size) as rollout:
        trained = train_all(rollout, engine, 0, 50, seed=100 + queue_size)
    assert trained == list(range(50))
    assert rollout.position == 50
    staleness = [r.staleness for r in rollout.records]
    assert max(staleness) <= queue_size, staleness
    assert max(staleness) >= 1, "the generator ran ahead of the trainer at least once"
    assert all(r.version_start == r.version_end for r in rollout.records)  # the lock: no update mid-generation
    assert all(start == end for _, start, end in engine.seen)  # as the engine saw it
    assert [r.version_start for r in rollout.records] == [start for _, start, _ in engine.seen]
    assert all(r.seconds > 0 for r in rollout.records)  # the generator's own time, which the trainer overlaps


@pytest.mark.parametrize("queue_size", [1, 2])
def test_partial_rollout_batches_span_versions_between_turns_within_the_staleness_bound(queue_size):
    engine = PartialEngine(seed=queue_size)
    with AsyncRollout(engine.generate, queue_size, partial=True) as rollout:
        trained = train_all(rollout, engine, 0, 50, seed=200 + queue_size)
    assert trained == list(range(50))
    assert max(r.staleness for r in rollout.records) <= queue_size
    # the updates came between turns only: each turn saw one version, the record's first and last are the batch's
    assert [(r.version_start, r.version_end) for r in rollout.records] == [
        (engine.turns[r.index][0], engine.turns[r.index][-1]) for r in rollout.records
    ]
    assert any(r.version_end > r.version_start for r in rollout.records), "no update ever came mid-batch"


def test_the_generator_runs_ahead_by_at_most_the_queue_size():
    """With a trainer that stalls, the generator makes queue_size batches and waits for a slot."""
    engine = FakeEngine(seed=0)
    with AsyncRollout(engine.generate, queue_size=3) as rollout:
        for record, _ in rollout.batches(0, 20):
            if record.index == 0:
                time.sleep(0.2)  # the generator fills the queue meanwhile: batches 1, 2, 3
                assert [r.index for r in rollout.records] == [0, 1, 2, 3]
            with rollout.weight_update():
                engine.weights += 1
    assert rollout.position == 20


def test_empty_batches_give_their_slot_back_and_never_deadlock():
    empty = frozenset({0, 1, 2, 5, 6, 7, 8, 9, 15, 16, 17, 18, 19})  # runs longer than the queue, and the tail
    engine = FakeEngine(seed=1, empty=empty)
    with AsyncRollout(engine.generate, queue_size=2) as rollout:
        trained = train_all(rollout, engine, 0, 20, seed=2)
    assert trained == [i for i in range(20) if i not in empty]
    assert rollout.position == 20
    assert [r.index for r in rollout.records] == list(range(20))
    assert all(r.trained_version is None for r in rollout.records if r.index in empty)
    assert max(r.staleness for r in rollout.records if r.index not in empty) <= 2


def test_done_ends_both_loops():
    """The generator's end ends the trainer's loop; the trainer leaving its loop ends the generator, even one that
    waits for a slot."""
    engine = FakeEngine(seed=3)
    with AsyncRollout(engine.generate, queue_size=2) as rollout:
        assert train_all(rollout, engine, 3, 9, seed=4) == [3, 4, 5, 6, 7, 8]
    assert rollout.position == 9 and not rollout._thread.is_alive()

    engine = FakeEngine(seed=5)
    with AsyncRollout(engine.generate, queue_size=2) as rollout:
        assert train_all(rollout, engine, 0, 1000, seed=6, stop_after=4) == [0, 1, 2, 3, 4]
        time.sleep(0.05)  # the generator is now waiting for a slot
    assert not rollout._thread.is_alive()
    assert rollout.position == 4  # the loop left inside batch 4's step: the caller's checkpoint says more
    assert len(rollout.records) <= 5 + 2


def test_a_failing_generator_fails_the_trainer_loop_at_its_next_batch():
    engine = FakeEngine(seed=7, fail_at=6)
    trained: list[int] = []
    with (
        pytest.raises(RuntimeError, match="engine failed on batch 6"),
        AsyncRollout(engine.generate, queue_size=4) as rollout,
    ):
        for record, _ in rollout.batches(0, 50):
            time.sleep(0.05)  # much slower than the generator: batches 3 to 5 are queued when it fails
            trained.append(record.index)
            with rollout.weight_update():
                engine.weights += 1
    assert not rollout._thread.is_alive()
    assert trained and trained[-1] <= 3  # raised at once, not after the queued batches


def test_a_failing_trainer_stops_the_generator():
    engine = FakeEngine(seed=8)
    with pytest.raises(ValueError, match="trainer failed"), AsyncRollout(engine.generate, queue_size=2) as rollout:
        for record, _ in rollout.batches(0, 1000):
            if record.index == 3:
                raise ValueError("trainer failed")
            with rollout.weight_update():
                engine.weights += 1
    assert not rollout._thread.is_alive()
    assert len(rollout.records) <= 4 + 2


def test_a_failing_weight_update_stops_the_generator_and_releases_the_lock():
    engine = FakeEngine(seed=9)
    with pytest.raises(ConnectionError), AsyncRollout(engine.generate, queue_size=1) as rollout:
        for _ in rollout.batches(0, 1000):
            with rollout.weight_update():
                raise ConnectionError("broadcast aborted")
    assert not rollout._thread.is_alive()
    assert rollout.version == 0


def test_one_weight_update_per_batch_and_a_queue_of_at_least_one():
    engine = FakeEngine(seed=10)
    with (
        pytest.raises(AssertionError, match="one weight update per trained batch"),
        AsyncRollout(engine.generate, queue_size=1) as rollout,
    ):
        for _ in rollout.batches(0, 5):
            for _ in range(2):
                with rollout.weight_update():
                    pass
    with pytest.raises(ValueError, match="queue_size must be at least 1, got 0"):
        AsyncRollout(engine.generate, queue_size=0)


def test_a_stopped_run_resumes_at_the_data_position_of_an_uninterrupted_one():
    """The checkpoint after training batch k holds position k + 1; the batches the generator had made beyond it are
    lost with the run and generated again on resume. Trained in all: each non-empty batch once, in order."""
    empty = frozenset({4, 11})
    engine = FakeEngine(seed=11, empty=empty)
    with AsyncRollout(engine.generate, queue_size=3) as rollout:
        uninterrupted = train_all(rollout, engine, 0, 16, seed=12)

    checkpoint = {"position": 0}
    engine = FakeEngine(seed=13, empty=empty)
    with (  # the run killed right after the checkpoint of batch 7
        pytest.raises(KeyboardInterrupt),
        AsyncRollout(engine.generate, queue_size=3) as killed,
    ):
        for record, _ in killed.batches(0, 16):
            with killed.weight_update():
                engine.weights += 1
            checkpoint["position"] = record.index + 1
            if record.index == 7:
                raise KeyboardInterrupt
    assert checkpoint["position"] == 8
    generated_beyond = [r.index for r in killed.records if r.index >= 8]
    assert generated_beyond, "the generator had run ahead: those batches are generated again"

    with AsyncRollout(engine.generate, queue_size=3) as resumed:
        after = train_all(resumed, engine, checkpoint["position"], 16, seed=14)
    before = [i for i in range(checkpoint["position"]) if i not in empty]
    assert before + after == uninterrupted
    assert resumed.position == rollout.position == 16
