"""One writer per stage: a lease object in the run's location, ``_leases/<stage>.json``, that a stage job takes before
it reads or writes the stage and gives back when it ends.

The lease holds its owner's token, host, pid, the pid's start time and a heartbeat time that a thread of the owner
renews every ``ttl_s / 4`` seconds. Another job waits while the lease is held and live, and takes it over once it is
stale:

- on the same host: the owner's process is gone (its pid is not alive, or is alive with another start time);
- anywhere: the heartbeat is older than ``ttl_s`` (a dead machine stops renewing).

Object stores have no compare-and-swap that every S3 server offers, so taking a lease is write, wait, read back: of
two jobs writing at once, the one whose token is read back owns it and the other goes on waiting. An owner whose
renewal finds another token lost its lease (it was judged stale, e.g. its machine was cut off for ``ttl_s``): it is
told through ``on_lost`` and must stop writing.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import psutil

from rlhf_core import run_layout
from rlhf_core.storage import ArtifactError, ObjectStore

TTL_ENV = "RLHF_LEASE_TTL_S"
WAIT_ENV = "RLHF_LEASE_WAIT_S"
_SETTLE_S = 0.3  # between writing a lease and reading it back


class LeaseHeld(ArtifactError):
    """Another live job holds the stage's lease."""


def _started(pid: int) -> float | None:
    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


def is_stale(record: dict, ttl_s: float, now: float | None = None) -> bool:
    """Whether a lease record no longer protects a writer: its same-host owner process is gone, or its heartbeat
    is older than ``ttl_s``."""
    now = time.time() if now is None else now
    if now - float(record.get("heartbeat", 0)) > ttl_s:
        return True
    if record.get("host") == socket.gethostname():
        started = _started(int(record.get("pid", -1)))
        return started is None or abs(started - float(record.get("pid_started", 0))) > 1.0
    return False


@dataclass
class Lease:
    """The stage's lease, owned by this process once ``acquire`` returns."""

    store: ObjectStore
    stage: str
    ttl_s: float = field(default_factory=lambda: float(os.environ.get(TTL_ENV) or 30))
    on_lost: Callable[[str], None] | None = None
    token: str = field(default_factory=lambda: uuid.uuid4().hex)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    @property
    def rel(self) -> str:
        return run_layout.lease(self.stage)

    def _record(self, acquired: float) -> dict:
        pid = os.getpid()
        return {
            "token": self.token,
            "stage": self.stage,
            "host": socket.gethostname(),
            "pid": pid,
            "pid_started": _started(pid),
            "acquired": acquired,
            "heartbeat": time.time(),
        }

    def read(self) -> dict | None:
        """The lease record in the store, or None when there is none (or it is unreadable: a torn write)."""
        try:
            return self.store.read_json(self.rel)
        except (OSError, ValueError):  # FileNotFoundError among them
            return None

    def acquire(self, wait_s: float | None = None, poll_s: float = 0.5) -> Lease:
        """Take the lease, waiting up to ``wait_s`` (default ``RLHF_LEASE_WAIT_S``, else 2 × ttl) for a live owner
        to give it back or go stale; raise LeaseHeld naming the owner after that."""
        wait_s = float(os.environ.get(WAIT_ENV) or 2 * self.ttl_s) if wait_s is None else wait_s
        deadline = time.time() + wait_s
        while True:
            held = self.read()
            if held is None or held.get("token") == self.token or is_stale(held, self.ttl_s):
                acquired = time.time()
                self.store.write_json(self.rel, self._record(acquired))
                time.sleep(_SETTLE_S)
                mine = self.read()
                if mine is not None and mine.get("token") == self.token:
                    self._thread = threading.Thread(
                        target=self._renew, args=(acquired,), daemon=True, name=f"lease-{self.stage}"
                    )
                    self._thread.start()
                    return self
                held = mine
            if time.time() >= deadline:
                owner = held or {}
                age = time.time() - float(owner.get("heartbeat", 0))
                raise LeaseHeld(
                    f"{self.store.uri(self.rel)}: stage '{self.stage}' is being written by pid {owner.get('pid')} on "
                    f"{owner.get('host')} (lease renewed {age:.0f} s ago): wait for that job to end or stop it; a "
                    f"lease unrenewed for {self.ttl_s:.0f} s, or whose process on this host is gone, is taken over"
                )
            time.sleep(poll_s)

    def _renew(self, acquired: float) -> None:
        while not self._stop.wait(self.ttl_s / 4):
            try:
                held = self.read()
                if held is None or held.get("token") == self.token:
                    self.store.write_json(self.rel, self._record(acquired))
                    continue
            except Exception:  # noqa: BLE001 - a store blip (botocore's errors are no OSError): the next renewal
                continue  # tries again, the ttl allows for it
            if self.on_lost is not None:
                self.on_lost(
                    f"its lease {self.store.uri(self.rel)} was taken over by pid {held.get('pid')} on "
                    f"{held.get('host')}"
                )
            return

    def release(self) -> None:
        """Stop renewing and delete the lease if it is still this process's."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        try:
            held = self.read()
            if held is not None and held.get("token") == self.token:
                self.store.delete(self.rel)
        except Exception as e:  # noqa: BLE001 - the store is down: the job's own error matters more, and a lease
            # left behind is taken over once its process is gone or its ttl has run out
            print(
                f"warning: the lease {self.store.uri(self.rel)} could not be given back ({type(e).__name__})",
                file=sys.stderr,
            )

    def __enter__(self) -> Lease:
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()
