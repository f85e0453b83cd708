"""The stage lease (rlhf_core/lease.py): one writer per stage, stale leases taken over, a lost lease noticed."""

import socket
import subprocess
import sys
import threading
import time

import psutil
import pytest

from rlhf_core.lease import Lease, LeaseHeld, is_stale
from rlhf_core.storage import ObjectStore


def record(**changes):
    me = psutil.Process()
    base = {
        "token": "t",
        "host": socket.gethostname(),
        "pid": me.pid,
        "pid_started": me.create_time(),
        "heartbeat": time.time(),
    }
    return {**base, **changes}


def test_stale_rules():
    assert not is_stale(record(), ttl_s=30)  # this live process, renewed now
    assert is_stale(record(heartbeat=time.time() - 31), ttl_s=30)  # no renewal for longer than the ttl
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    assert is_stale(record(pid=dead.pid), ttl_s=30)  # same host, process gone
    assert is_stale(record(pid_started=psutil.Process().create_time() - 100), ttl_s=30)  # pid reused
    assert not is_stale(record(host="elsewhere", pid=dead.pid), ttl_s=30)  # another host: only the ttl tells


def test_a_second_job_waits_for_the_first_and_takes_over_when_it_gives_the_lease_back(tmp_path):
    store = ObjectStore(str(tmp_path))
    first = Lease(store, "sft", ttl_s=4).acquire()
    with pytest.raises(LeaseHeld, match=r"stage 'sft' is being written by pid \d+"):
        Lease(store, "sft", ttl_s=4).acquire(wait_s=0.5)
    threading.Timer(1.0, first.release).start()
    second = Lease(store, "sft", ttl_s=4).acquire(wait_s=10)
    assert store.read_json("_leases/sft.json")["token"] == second.token
    second.release()
    assert not store.exists("_leases/sft.json")


def test_a_lease_of_a_dead_machine_is_taken_over_after_the_ttl(tmp_path):
    store = ObjectStore(str(tmp_path))
    store.write_json("_leases/sft.json", record(token="gone", host="elsewhere", heartbeat=time.time()))
    started = time.time()
    lease = Lease(store, "sft", ttl_s=1.5).acquire(wait_s=10, poll_s=0.1)
    assert 1.0 < time.time() - started < 5  # waited for the heartbeat to age past the ttl, no longer
    lease.release()


def test_an_owner_whose_lease_was_taken_over_is_told(tmp_path):
    store = ObjectStore(str(tmp_path))
    lost = threading.Event()
    lease = Lease(store, "sft", ttl_s=0.8, on_lost=lambda why: lost.set()).acquire()
    store.write_json("_leases/sft.json", record(token="usurper"))
    assert lost.wait(5)
    lease.release()
    assert store.read_json("_leases/sft.json")["token"] == "usurper"  # release leaves another's lease alone
