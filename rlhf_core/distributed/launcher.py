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
        ray.init(num_cpus=int(-(-cpus // 1)), include_dashboard=False, runtime_env=env, log_to_driver=True)
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
    """``num_workers`` Ray actors hosting ``factory(*args)`` each, forming one torch.distributed world."""

    def __init__(self, cfg: StrategyConfig, factory: Callable[..., Any], *args: Any, name: str = "worker"):
        import ray

        device = resolve_device(cfg.device)
        gpus = 1 if device == "cuda" else 0
        remote_shell = ray.remote(_Shell)
        base_env = {"RLHF_DEVICE": device, "TOKENIZERS_PARALLELISM": "false"}
        self.actors = [
            remote_shell.options(num_cpus=cfg.cpus_per_worker, num_gpus=gpus, name=None).remote(
                base_env, cfg.threads_per_worker
            )
            for _ in range(cfg.num_workers)
        ]
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

        return ray.get([actor.call.remote(method, *args, **kwargs) for actor in self.actors])

    def shutdown(self) -> None:
        import ray

        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        self.actors = []


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
