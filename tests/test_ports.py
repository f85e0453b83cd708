"""Free ports are picked outside the kernel's ephemeral range (a CI failure: a critic group's torch.distributed
store lost its port, picked by binding port 0, to another socket of the machine before it could listen)."""

import random
import socket

import pytest

from rlhf_core import ports


def test_ports_avoid_the_ephemeral_range_and_can_be_listened_on():
    low, high = ports.ephemeral_range()
    picked = [ports.free_port("127.0.0.1") for _ in range(50)]
    assert all(ports.LOWEST <= p < low or high < p <= 65535 for p in picked), picked
    assert len(set(picked)) == 50  # never the same port twice from one process
    with socket.socket() as s:
        s.bind(("127.0.0.1", picked[0]))
        s.listen()


def test_seeding_the_random_module_does_not_make_two_workers_pick_the_same_ports():
    # Two workers of a job seed ``random`` alike; their picks must still differ.
    random.seed(0)
    first = [ports._random.choice(range(20000, 32768)) for _ in range(5)]
    random.seed(0)
    second = [ports._random.choice(range(20000, 32768)) for _ in range(5)]
    assert first != second


def test_a_taken_port_is_not_picked(monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # The one candidate outside a (made-up) ephemeral range is the taken port: the kernel picks another.
        monkeypatch.setattr(ports, "LOWEST", port)
        monkeypatch.setattr(ports, "_given", set())
        assert ports.free_port("127.0.0.1", ephemeral=(port + 1, 65535)) != port
        assert port not in ports._given


@pytest.mark.parametrize("text, expected", [("32768\t60999\n", (32768, 60999)), ("garbage", (32768, 60999))])
def test_the_ephemeral_range_is_read_from_the_kernel(tmp_path, text, expected):
    path = tmp_path / "ip_local_port_range"
    path.write_text(text)
    assert ports.ephemeral_range(path) == expected
    assert ports.ephemeral_range(tmp_path / "missing") == (32768, 60999)


def test_with_no_room_outside_the_range_the_kernel_picks():
    port = ports.free_port("127.0.0.1", ephemeral=(1024, 65535))
    assert 1024 <= port <= 65535
