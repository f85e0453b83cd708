"""``weight_sync``: the project's weight-sync transport between this process and a spawned one. ``WeightSender``
(``cuda_ipc`` on the GPU, ``gloo`` on the dry run) here; ``make_receiver_transport`` and ``receive_into_module``
into a differently initialised model there; buckets smaller than the model. Two syncs, the second after an AdamW step
changed the weights; after each, every received tensor must equal the sent one bit for bit (sha256 of its bytes,
computed in each process). GB/s = the model's bytes / (start of ``send_weights`` to the receiver's end)."""

from __future__ import annotations

import contextlib
import hashlib
import time
from collections.abc import Iterable
from typing import Any

import torch

from .common import MODEL_SPECS, Ctx, causal_lm_on, dtype_of, emit, free_memory, model_config, run_check, sync, wait_s


def tensor_digests(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, str]:
    """sha256 of each tensor's bytes: equal digests, bit-identical tensors."""
    return {
        name: hashlib.sha256(t.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy()).hexdigest()
        for name, t in named
    }


def _sync_receiver(
    spec: dict,
    precision: str,
    device: str,
    where: tuple[str, int, str, float, str],
    specs: list,
    bucket_bytes: int,
    inbox: Any,
    outbox: Any,
) -> None:
    """Spawned process: a model of its own (other weights than the sender's), joined to the sender as rank 1 of the
    weight-sync world; each message is a sync id to receive into the model, answered with the seconds it took and
    then the digests of the model's tensors."""
    try:
        from rlhf_core.distributed.weight_sync.receiver import make_receiver_transport, receive_into_module

        torch.set_num_threads(1)
        if device == "cuda":
            torch.cuda.set_device(0)
        torch.manual_seed(123)
        model = causal_lm_on(device, model_config(spec, "sdpa"), dtype_of(precision))
        addr, port, group, timeout_s, backend = where
        transport = make_receiver_transport(addr, port, 1, 2, group, timeout_s, backend)
        outbox.put(("joined", tensor_digests(model.named_parameters())))
        while (sync_id := inbox.get()) is not None:
            start = time.perf_counter()
            receive_into_module(transport, specs, model, bucket_bytes, sync_id)
            sync(device)
            outbox.put(("done", time.perf_counter() - start))
            outbox.put(("digests", tensor_digests(model.named_parameters())))
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which fails the check
        outbox.put(("error", f"{type(e).__name__}: {e}"))


def _detached(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [(n, p.detach()) for n, p in model.named_parameters()]


def _expect(outbox: Any, kind: str, timeout_s: float) -> Any:
    got, value = outbox.get(timeout=timeout_s)
    if got == "error":
        raise RuntimeError(f"receiver process: {value}")
    if got != kind:
        raise RuntimeError(f"receiver process answered {got!r}, expected {kind!r}")
    return value


def _optimizer_step(model: torch.nn.Module, vocab: int, device: str) -> None:
    """One AdamW step on random tokens: new weights for the second sync, as training makes them."""
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(3, vocab, (2, 32), generator=torch.Generator().manual_seed(3)).to(device)
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    model.eval()


def check_weight_sync(
    plan: dict[str, Any], device: str, bucket_bytes: int | None = None, timeout_s: float = 60
) -> dict:
    """``WeightSender`` here, ``make_receiver_transport`` + ``receive_into_module`` in a spawned process; two syncs."""
    import torch.multiprocessing as mp

    from rlhf_core.distributed.weight_sync.buckets import bucket_plan, spec_of
    from rlhf_core.distributed.weight_sync.sender import WeightSender
    from rlhf_core.ports import free_port

    spec, precision = MODEL_SPECS[plan["model"]], plan["precision"]
    backend = "cuda_ipc" if device == "cuda" else "gloo"
    bucket_bytes = bucket_bytes or plan["sync_bucket_bytes"]
    torch.manual_seed(7)
    model = causal_lm_on(device, model_config(spec, "sdpa"), dtype_of(precision)).eval()
    specs = [spec_of(n, t) for n, t in _detached(model)]
    nbytes = sum(t.numel() * t.element_size() for _, t in _detached(model))
    where = ("127.0.0.1", free_port(), "gpu_check", float(timeout_s), backend)
    ctx = mp.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    # The receiver starts first: with gloo the sender's constructor blocks until the receiver has joined; with cuda_ipc
    # the sender hosts the store that the receiver's client waits for.
    child = ctx.Process(
        target=_sync_receiver,
        args=(spec, precision, device, where, specs, bucket_bytes, inbox, outbox),
        daemon=True,
    )
    child.start()
    record: dict[str, Any] = {
        "check": "weight_sync",
        "ok": False,
        "device": device,
        "transport": backend,
        "model": plan["model"],
        "bytes": nbytes,
        "tensors": len(specs),
        "bucket_bytes": bucket_bytes,
        "buckets": len(bucket_plan(specs, bucket_bytes)),
    }
    sender = None
    try:
        sender = WeightSender(where[0], where[1], 2, where[2], timeout_s, backend=backend, bucket_bytes=bucket_bytes)
        initial = _expect(outbox, "joined", timeout_s)
        sender.check_peer()  # cuda_ipc: the receiver is on this process's GPU (by UUID)
        syncs, sent = [], []
        for k in range(2):
            if k:
                _optimizer_step(model, spec["vocab_size"], device)
            expected = tensor_digests(_detached(model))
            sent.append(expected)
            inbox.put(sender.sync_id)
            sync(device)
            start = time.perf_counter()
            sync_id = sender.send_weights(iter(_detached(model)), specs)
            receiver_s = _expect(outbox, "done", timeout_s)
            seconds = time.perf_counter() - start
            got = _expect(outbox, "digests", timeout_s)
            mismatched = [n for n in expected if got.get(n) != expected[n]]
            syncs.append(
                {
                    "sync_id": sync_id,
                    "equal": not mismatched and set(got) == set(expected),
                    "mismatched": mismatched[:5],
                    "buckets": sender.last_sync_buckets,
                    "transfers": sender.last_sync_broadcasts,
                    "seconds": round(seconds, 4),
                    "sender_s": round(sender.last_sync_s, 4),
                    "receiver_s": round(receiver_s, 4),
                    "gb_per_s": round(nbytes / seconds / 1e9, 3),
                }
            )
        inbox.put(None)
        changed = sum(sent[0][n] != sent[1][n] for n in sent[0])
        started_different = sum(initial.get(n) != sent[0][n] for n in sent[0])
        problems = [f"sync {s['sync_id']}: {len(s['mismatched'])}+ tensors differ" for s in syncs if not s["equal"]]
        if changed == 0:
            problems.append("the optimizer step changed no tensor: the second sync shows nothing")
        if started_different == 0:
            problems.append("the receiver started with the sender's weights: the syncs show nothing")
        if min(s["buckets"] for s in syncs) < 2:
            problems.append("one bucket only: the bucketing is not exercised")
        record.update(
            ok=not problems,
            syncs=syncs,
            gb_per_s=max(s["gb_per_s"] for s in syncs),
            tensors_changed_by_step=changed,
            receiver_tensors_different_before=started_different,
        )
        if problems:
            record["reason"] = "; ".join(problems)
    except Exception as e:
        why = f"receiver process exited with status {child.exitcode}" if not child.is_alive() else ""
        with contextlib.suppress(Exception):  # the receiver's own error, if it failed first
            while True:
                kind, value = outbox.get(timeout=1)
                if kind == "error":
                    why = f"receiver process: {value}"
                    break
        if why:
            raise RuntimeError(f"{type(e).__name__}: {str(e).splitlines()[0]}; {why}") from e
        raise
    finally:
        if sender is not None:
            sender.close()
        child.join(timeout=30)
        if child.is_alive():
            child.terminate()
    del model
    free_memory(device)
    return emit(record)


def run(c: Ctx) -> None:
    run_check("weight_sync", check_weight_sync, c.plan, c.device, None, wait_s(c))
