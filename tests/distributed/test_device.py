"""The device module: batches moved to the worker's device, collectives issued on the process group's device, and
the role and trainer code sending every forward's inputs through that one path (on CPU, the same code as on GPU)."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
from pathlib import Path

import pytest
import torch

from rlhf_core.algos.batching import make_sequences
from rlhf_core.distributed import device
from rlhf_core.ports import free_port
from tests.conftest import TINY


def test_to_device_moves_dicts_and_tensor_batches():
    # The meta device stands in for an accelerator: a tensor that is not moved stays on the CPU and is seen.
    seq = make_sequences([[1, 2, 3]], [[4, 5]], 0)
    moved = device.to_device(seq, "meta")
    assert {k: v.device.type for k, v in moved.tensors().items()} == {k: "meta" for k in seq.tensors()}
    assert seq.input_ids.device.type == "cpu"  # the original is left alone
    batch = device.to_device({"input_ids": torch.ones(2, 3), "rows": 2}, "meta")
    assert batch["input_ids"].device.type == "meta" and batch["rows"] == 2
    with pytest.raises(TypeError, match="cannot move a list"):
        device.to_device([torch.ones(1)], "cpu")


def test_device_choice_follows_the_driver(monkeypatch):
    monkeypatch.setenv(device.DEVICE_ENV, "cpu")
    assert device.current() == torch.device("cpu")
    assert device.resolve_device("cuda") == "cuda" and device.resolve_device("cpu") == "cpu"
    assert device.resolve_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")


def test_collectives_without_a_process_group_are_the_identity():
    assert not device.initialized()
    t = torch.tensor([1.0, 2.0])
    assert device.all_reduce_sum(t) is t and t.tolist() == [1.0, 2.0]
    assert device.all_reduce_mean(3.5) == 3.5
    assert device.all_gather_object({"a": 1}) == [{"a": 1}]
    assert device.broadcast_object("x") == "x"
    device.barrier()


def _collectives_worker(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    try:
        # rank 0: [1, 2], rank 1: [10, 20] (float64, as the callers' statistics): summed on the group's device (the
        # CPU for gloo) and written back into the caller's tensor.
        t = torch.tensor([1.0, 2.0] if rank == 0 else [10.0, 20.0], dtype=torch.float64)
        device.all_reduce_sum(t)
        result = {
            "comm_device": str(device.comm_device()),
            "sum": t.tolist(),
            "dtype": str(t.dtype),
            "mean": device.all_reduce_mean(1.0 + 2 * rank),  # (1 + 3) / 2 = 2
            "gathered": device.all_gather_object(f"r{rank}"),
            "broadcast": device.broadcast_object(f"from {rank}"),
        }
        device.barrier()
        Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        torch.distributed.destroy_process_group()


def test_collectives_run_on_the_group_device_and_write_back(tmp_path):
    torch.multiprocessing.spawn(_collectives_worker, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r in results:
        assert r["comm_device"] == "cpu"
        assert r["sum"] == [11.0, 22.0]
        assert r["dtype"] == "torch.float64"
        assert r["mean"] == 2.0
        assert r["gathered"] == ["r0", "r1"]
        assert r["broadcast"] == "from 0"


# ---------------------------------------------------------------------------------------------------------------------
# The role and trainer code: every forward's inputs come out of device.to_device.


def _batch_path_worker(port: int, run_dir: str, out: str) -> None:
    """In a fresh process (its own one-rank DeepSpeed world): mark every tensor that leaves ``device.to_device``,
    hook the forward of each model, then run the actor, critic and SFT trainer code as the Ray workers run it."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    os.environ[device.DEVICE_ENV] = "cpu"
    from rlhf_core.config import load_config
    from rlhf_core.data.examples import sft_examples
    from rlhf_core.distributed.actor import PolicyActor
    from rlhf_core.distributed.critic import CriticActor
    from rlhf_core.jobs import stage_setup
    from rlhf_core.jobs.sft import SFTTrainer
    from rlhf_core.models.builders import load_tokenizer
    from tests.distributed.test_roles import experience, role_context

    original = device.to_device

    def marking(batch, where):
        moved = original(batch, where)
        for t in moved.values() if isinstance(moved, dict) else moved.tensors().values():
            if isinstance(t, torch.Tensor):
                t.rlhf_moved = True  # type: ignore[attr-defined]
        return moved

    device.to_device = marking
    # Packed forwards (strategy.packing, the default) run on rows packed from the moved batch: the mark follows.
    from rlhf_core.algos.packing import Packing

    pack = Packing.pack

    def marked_pack(self, x, fill=0):
        packed = pack(self, x, fill)
        packed.rlhf_moved = getattr(x, "rlhf_moved", False)  # type: ignore[attr-defined]
        return packed

    Packing.pack = marked_pack  # type: ignore[method-assign]
    seen: dict[str, list[bool]] = {}

    def watch(name: str, module: torch.nn.Module) -> None:
        def hook(_module, args, kwargs):
            ids = kwargs.get("input_ids", args[0] if args else None)
            seen.setdefault(name, []).append(bool(getattr(ids, "rlhf_moved", False)))

        module.register_forward_pre_hook(hook, with_kwargs=True)

    tok = load_tokenizer("builtin:tiny")
    seq = make_sequences([[5, 6, 7], [8, 9, 10]], [[20, 21], [22, 23, 24]], tok.pad_token_id)
    tmp = Path(run_dir)
    actor = PolicyActor(role_context(tmp / "actor", micro=2, window=2, role="actor"))
    critic = CriticActor(role_context(tmp / "critic", micro=1, window=2))
    for role in (actor, critic):
        role.setup()
        watch(role.ctx.role, role.engine.module)
    old = actor.logprobs(seq)
    values = critic.values(seq)
    exp = experience(values, seq)
    actor.fit(exp.with_advantages(torch.ones_like(values) * exp.action_mask, exp.returns), 0)
    critic.fit(exp.with_advantages(exp.advantages, exp.returns), 0)
    assert old.device.type == "cpu" and values.device.type == "cpu"  # results come back to the CPU for Ray

    cfg = load_config(TINY, [f"run_uri={tmp / 'sft_run'}", "sft.train.max_steps=1"])
    st = stage_setup.setup_stage(cfg, "sft")
    section = st.section
    train = sft_examples(section.data, tok, "train", {})
    held_out = sft_examples(section.data, tok, "eval", {})[:4]

    class WatchedSFT(SFTTrainer):
        def build_model(self, *args, **kwargs):
            model = super().build_model(*args, **kwargs)
            watch("sft", model)
            return model

    WatchedSFT(st.context(), train, held_out).fit()
    Path(out).write_text(json.dumps(seen))


@pytest.mark.slow
def test_role_and_trainer_forwards_take_the_batch_to_device_path(tmp_path):
    ctx = mp.get_context("spawn")
    out = tmp_path / "seen.json"
    proc = ctx.Process(target=_batch_path_worker, args=(free_port(), str(tmp_path), str(out)))
    proc.start()
    proc.join(timeout=600)
    assert proc.exitcode == 0, f"worker exited with {proc.exitcode}"
    seen = json.loads(out.read_text())
    # actor: the old-log-prob forward and the training forward; critic: the value forward and 2 training
    # micro-batches; sft: one step's micro-batches and the held-out batches. Every one came out of to_device.
    assert set(seen) == {"actor", "critic", "sft"}, seen
    for role, marks in seen.items():
        assert marks and all(marks), (role, marks)
    print({role: len(marks) for role, marks in seen.items()})


@pytest.mark.slow  # a Ray of its own that declares GPUs, in a process of its own; and the session's Ray
def test_auto_is_decided_by_the_clusters_gpus_not_the_drivers(ray_cluster):
    """A driver that sees no GPU (this machine; on a real cluster a Prefect worker container or a CPU head node)
    resolves ``auto`` to cuda on a Ray cluster that has GPUs, where the engines take them; to cpu on one without."""
    import subprocess
    import sys

    from rlhf_core.distributed.cluster import RayCluster

    code = (
        "import ray, torch\n"
        "from rlhf_core.distributed.cluster import RayCluster\n"
        "from rlhf_core.distributed.device import resolve_device\n"
        "ray.init(address='local', num_cpus=1, num_gpus=2, include_dashboard=False, log_to_driver=False)\n"
        "c = RayCluster()\n"
        "print(torch.cuda.is_available(), resolve_device('auto'), c.device('auto'), c.device('cpu'))\n"
        "ray.shutdown()\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    seen = {2: out.stdout.split()[-4:]}
    session = RayCluster()  # the test session's Ray: 8 CPUs, no GPU
    seen[0] = [str(x) for x in (torch.cuda.is_available(), device.resolve_device("auto"))]
    seen[0] += [session.device("auto"), session.device("cpu")]
    assert seen == {2: ["False", "cpu", "cuda", "cpu"], 0: ["False", "cpu", "cpu", "cpu"]}
