"""Ray actor groups: one actor per device, joined into one ``torch.distributed`` group.

A plain Python object (the trainer of a stage) lives inside a thin Ray shell. Rank 0 is created first and reports
its address and a free port; every actor then gets ``MASTER_ADDR``/``MASTER_PORT``/``RANK``/``WORLD_SIZE``/
``LOCAL_RANK`` and an explicit thread count before torch is touched, so several workers on a small machine do not
oversubscribe its cores. Ray is imported here and in the other ``rlhf_core.distributed`` modules only.
"""

from __future__ import annotations

import os
import socket
from typing import Any, Callable

from rlhf_core.config import StrategyConfig


def resolve_device(requested: str) -> str:
    if requested != "auto":
        return requested
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def init_ray(min_cpus: float = 1) -> bool:
    """Connect to ``RAY_ADDRESS`` when set, else start a local Ray. Returns True when this call started Ray."""
    import ray

    if ray.is_initialized():
        return False
    env = {"env_vars": {"TOKENIZERS_PARALLELISM": "false", "RAY_DEDUP_LOGS": "0"}}
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], runtime_env=env, log_to_driver=True)
    else:
        cpus = max(float(os.cpu_count() or 1), min_cpus)
        # address="local": a new Ray for this job even when another one runs on the machine
        ray.init(address="local", num_cpus=int(-(-cpus // 1)), include_dashboard=False, runtime_env=env,
                 log_to_driver=True)  # fmt: skip
    return True


class _Shell:
    """The Ray side of a worker: sets the process environment, then hosts one plain object."""

    def __init__(self, env: dict[str, str], threads: int):
        os.environ.update(env)
        os.environ["OMP_NUM_THREADS"] = str(threads)
        import warnings

        import torch

        # DeepSpeed calls deprecated torch.distributed names on every step; keep worker logs readable.
        warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")

        torch.set_num_threads(threads)
        self.obj: Any = None

    def address(self) -> tuple[str, int]:
        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def set_env(self, env: dict[str, str]) -> None:
        os.environ.update(env)

    def construct(self, factory: Callable[..., Any], *args: Any) -> None:
        self.obj = factory(*args)

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.obj, method)(*args, **kwargs)


class RayWorkerGroup:
    """``num_workers`` Ray actors hosting ``factory(*args)`` each, forming one torch.distributed world.

    With ``placement`` (a placement group from ``colocation_group``) worker i is pinned to bundle i and takes
    ``share`` of that bundle's device, so that several roles share devices (OpenRLHF's colocation).
    """

    def __init__(
        self, cfg: StrategyConfig, factory: Callable[..., Any], *args: Any, name: str = "worker",
        placement: Any = None, share: float = 1.0,
    ):  # fmt: skip
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        device = resolve_device(cfg.device)
        gpus = share if device == "cuda" else 0
        remote_shell = ray.remote(_Shell)
        base_env = {"RLHF_DEVICE": device, "TOKENIZERS_PARALLELISM": "false"}
        self.actors = []
        for rank in range(cfg.num_workers):
            options: dict[str, Any] = {"num_cpus": cfg.cpus_per_worker, "num_gpus": gpus}
            if placement is not None:
                options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                    placement_group=placement, placement_group_bundle_index=rank
                )
            self.actors.append(remote_shell.options(**options).remote(base_env, cfg.threads_per_worker))
        master_addr, master_port = ray.get(self.actors[0].address.remote())
        ray.get(
            [
                actor.set_env.remote(
                    {
                        "MASTER_ADDR": master_addr,
                        "MASTER_PORT": str(master_port),
                        "RANK": str(rank),
                        "LOCAL_RANK": "0" if gpus else str(rank),
                        "WORLD_SIZE": str(cfg.num_workers),
                    }
                )
                for rank, actor in enumerate(self.actors)
            ]
        )
        ray.get([actor.construct.remote(factory, *args) for actor in self.actors])
        self.name = name

    def call(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Run ``method`` on every rank at once (collectives need all ranks) and return the results in rank order."""
        import ray

        return ray.get(self.call_async(method, *args, **kwargs))

    def call_async(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        return [actor.call.remote(method, *args, **kwargs) for actor in self.actors]

    def call_each_async(self, method: str, shards: list[Any], *args: Any) -> list[Any]:
        """``method(shards[rank], *args)`` on each rank; returns the ObjectRefs."""
        assert len(shards) == len(self.actors), f"{len(shards)} shards for {len(self.actors)} workers"
        return [actor.call.remote(method, shard, *args) for actor, shard in zip(self.actors, shards)]

    def call_each(self, method: str, shards: list[Any], *args: Any) -> list[Any]:
        import ray

        return ray.get(self.call_each_async(method, shards, *args))

    def shutdown(self) -> None:
        import ray

        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        self.actors = []


def colocation_group(bundles: int, cpus_per_bundle: float, device: str) -> Any:
    """A PACK placement group of ``bundles`` bundles (one device each on GPU), ready to place workers on."""
    import ray
    from ray.util.placement_group import placement_group

    bundle = {"CPU": cpus_per_bundle, **({"GPU": 1} if device == "cuda" else {})}
    group = placement_group([dict(bundle) for _ in range(bundles)], strategy="PACK")
    ray.get(group.ready())
    return group


def run_group(cfg: StrategyConfig, factory: Callable[..., Any], *args: Any) -> list[Any]:
    """Start Ray if needed, run ``factory(*args).fit()`` on ``cfg.num_workers`` ranks, and clean up after."""
    import ray

    started = init_ray(min_cpus=cfg.num_workers * cfg.cpus_per_worker)
    group = None
    try:
        group = RayWorkerGroup(cfg, factory, *args)
        return group.call("fit")
    finally:
        if group is not None:
            group.shutdown()
        if started:
            ray.shutdown()


def wait(refs: list[Any]) -> list[Any]:
    """Results of Ray ObjectRefs, in order (the controller never imports Ray itself)."""
    import ray

    return ray.get(refs)


def cluster_resources() -> dict[str, float]:
    import ray

    return ray.cluster_resources()


def shutdown_ray() -> None:
    import ray

    ray.shutdown()
