"""Live weight sync from the trainer to the rollout engines, after OpenRLHF's ``broadcast_to_vllm``, in buckets.

Both sides agree beforehand on a list of ``(name, dtype, shape)`` specs and a bucket size; ``buckets.bucket_plan``
turns them into the same list of buckets on both sides (consecutive tensors of about ``bucket_bytes`` each, a tensor
bigger than a bucket in a bucket of its own). Per bucket the sender packs the tensors' bytes into one flat uint8
buffer (``buckets.pack_bucket``) and hands it over in ONE transfer; the receiver unpacks views into it
(``buckets.unpack_bucket``) and hands them to vLLM's ``reload_weights``, which maps Hugging Face names onto its own
layout (stacked qkv, gate/up, tensor-parallel shards) and re-runs the backend's post-load processing (the CPU backend
repacks linear weights, which is why calling the model's ``load_weights`` directly fails there). One transfer per
bucket instead of one per tensor is the point: per-collective latency, not bandwidth, dominates for the many small
tensors of a model.

Every bucket starts with a 16-byte header (status, bucket index). A failure on the sender midway (a failed gather,
a tensor that does not match its spec) still sends that bucket, with the status "abort": the receivers stop at once
instead of waiting in the collective until its timeout, and no transfer is spent on the signal alone.

The modules, in the order a bucket travels:

- ``buckets``: the pure part (specs, plan, layout, header, pack/unpack, ``load_into_module``); torch only.
- ``transports``: gloo and nccl collectives, CUDA IPC handles through a TCPStore (which ones are UNVERIFIED is said
  there), and ``resolve_backend``.
- ``sender``: ``WeightSender`` and the trainer side: ``connect_weight_sync``, ``connect_rank`` (each actor rank's
  part, cuda_ipc included) and ``sync_weights``.
- ``receiver``: the engine side: ``WorkerWeightReceiver`` (mixed into vLLM's workers), ``receive_into_module`` (the
  HF engine).
- ``peers``: the engines as the sync sees them, two protocols of its own: ``ReceivingEngine`` (the weight-sync methods
  of an engine, which ``rollout.engine.RolloutEngine`` extends) and ``ReceivingEngines`` (how the sender calls them;
  ``rollout.group.EngineHandles`` is one). Nothing here imports the rollout package: rollout -> weight_sync only.

vLLM is never imported by this package (the receiver runs inside vLLM's worker process, where it reaches vLLM through
``self``, the worker it is mixed into); Ray only inside the sender's functions.
"""
