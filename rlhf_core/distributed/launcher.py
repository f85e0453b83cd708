"""Ray actor groups: one actor per device, joined into one ``torch.distributed`` group.

A plain Python object (the trainer of a stage) lives inside a thin Ray shell. Rank 0 is created first and reports
its address and a free port; every actor then gets ``MASTER_ADDR``/``MASTER_PORT``/``RANK``/``WORLD_SIZE``/
``LOCAL_RANK`` and an explicit thread count before torch is touched, so several workers on a small machine do not
oversubscribe its cores. Ray is imported here and in the other ``rlhf_core.distributed`` modules only.

Calls are typed: the driver passes the hosted class's method object (``group.call(PolicyActor.export, ...)``), never
a method name; the shell runs ``method(obj, *args, **kwargs)``. The driver checks the method and the arguments
against the class before anything is sent (``check_call``), so each role stays a plain class that also runs
without Ray.
"""

from __future__ import annotations

import inspect
import os
import socket
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Concatenate, Generic, ParamSpec, Protocol, TypeVar

from rlhf_core import events
from rlhf_core.config import StrategyConfig

if TYPE_CHECKING:  # annotations only: Ref[R] is the ObjectRef of a remote call returning R
    from ray import ObjectRef as Ref

T = TypeVar("T")
S = TypeVar("S")
R = TypeVar("R")
P = ParamSpec("P")


def resolve_device(requested: str) -> str:
    from rlhf_core.distributed.device import resolve_device as resolve

    return resolve(requested)


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

    def construct(self, factory: Callable[..., Any], args: tuple, kwargs: dict) -> None:
        self.obj = factory(*args, **kwargs)

    def call(self, method: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        # The method object itself (checked on the driver to belong to the hosted class): no name lookup.
        return method(self.obj, *args, **kwargs)


def check_constructor(factory: type, args: tuple, kwargs: dict) -> None:
    """Raise TypeError at once when ``factory(*args, **kwargs)`` cannot bind (before any worker starts)."""
    if not isinstance(factory, type):
        raise TypeError(f"a worker group hosts instances of a class, got {factory!r}")
    try:
        inspect.signature(factory).bind(*args, **kwargs)
    except TypeError as e:
        raise TypeError(f"{factory.__qualname__}{_signature(factory)}: {e}") from None


def check_call(cls: type, method: Callable[..., Any], args: tuple, kwargs: dict) -> None:
    """Raise TypeError at once when ``method`` is not a method of ``cls`` (the class the group hosts, its own or
    inherited, as ``cls.<name>`` resolves) or when ``(self, *args, **kwargs)`` does not bind to its signature."""
    if not inspect.isfunction(method):
        raise TypeError(
            f"pass a method of {cls.__qualname__} as the function object (e.g. {cls.__qualname__}.fit), not {method!r}"
        )
    name = method.__name__
    # What ``cls.<name>`` resolves to, along the MRO, without invoking descriptors.
    own = next((vars(klass)[name] for klass in cls.__mro__ if name in vars(klass)), None)
    if isinstance(own, (staticmethod, classmethod)) or own is not method:
        where = f"; {cls.__qualname__}.{name} is another function" if own is not None else ""
        raise TypeError(
            f"{method.__qualname__} is not a method of {cls.__qualname__}, the class this group hosts{where}"
        )
    try:
        inspect.signature(method).bind(None, *args, **kwargs)
    except TypeError as e:
        raise TypeError(f"{method.__qualname__}{_signature(method)}: {e}") from None


def _signature(fn: Callable[..., Any]) -> str:
    try:
        return str(inspect.signature(fn))
    except (TypeError, ValueError):
        return "(...)"


class RayWorkerGroup(Generic[T]):
    """``num_workers`` Ray actors hosting ``factory(*args, **kwargs)`` each (``factory`` a plain class), forming one
    torch.distributed world.

    Calls name the hosted class's own method objects, e.g. ``group.call(PolicyActor.export, rel, ...)`` or
    ``group.call_each_async(PolicyActor.logprobs, shards)``: a type checker sees the method's signature
    (``ParamSpec``/``Concatenate``), and the driver checks that the method belongs to the class and that the
    arguments bind before anything is sent (a TypeError at once, not a remote error later).

    With ``placement`` (a placement group from ``colocation_group``) worker i is pinned to bundle i and takes
    ``share`` of that bundle's device, so that several roles share devices (OpenRLHF's colocation).
    """

    def __init__(
        self, cfg: StrategyConfig, factory: type[T], *args: Any, name: str = "worker", placement: Any = None,
        share: float = 1.0, **kwargs: Any,
    ):  # fmt: skip
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        check_constructor(factory, args, kwargs)
        self.cls: type[T] = factory
        device = resolve_device(cfg.device)
        gpus = share if device == "cuda" else 0
        remote_shell = ray.remote(_Shell)
        base_env = {"RLHF_DEVICE": device, "TOKENIZERS_PARALLELISM": "false"}
        if events.events_path() is not None:  # rank-0 workers append their own step events
            base_env[events.EVENTS_ENV] = events.events_path()
        self.actors: list[Any] = []
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
        ray.get([actor.construct.remote(factory, args, kwargs) for actor in self.actors])
        self.name = name

    def __len__(self) -> int:
        return len(self.actors)

    def call(self, method: Callable[Concatenate[T, P], R], *args: P.args, **kwargs: P.kwargs) -> list[R]:
        """Run ``method`` on every rank at once (collectives need all ranks) and return the results in rank order."""
        import ray

        return ray.get(self.call_async(method, *args, **kwargs))

    def call_async(self, method: Callable[Concatenate[T, P], R], *args: P.args, **kwargs: P.kwargs) -> list[Ref[R]]:
        check_call(self.cls, method, args, kwargs)
        return [actor.call.remote(method, args, kwargs) for actor in self.actors]

    def call_each_async(
        self, method: Callable[Concatenate[T, S, P], R], shards: Sequence[S], *args: P.args, **kwargs: P.kwargs
    ) -> list[Ref[R]]:
        """``method(shards[rank], *args, **kwargs)`` on each rank; returns the ObjectRefs."""
        if len(shards) != len(self.actors):
            raise ValueError(f"{len(shards)} shards for the {len(self.actors)} workers of {self.cls.__qualname__}")
        if shards:
            check_call(self.cls, method, (shards[0], *args), kwargs)
        return [actor.call.remote(method, (shard, *args), kwargs) for actor, shard in zip(self.actors, shards)]

    def call_each(
        self, method: Callable[Concatenate[T, S, P], R], shards: Sequence[S], *args: P.args, **kwargs: P.kwargs
    ) -> list[R]:
        import ray

        return ray.get(self.call_each_async(method, shards, *args, **kwargs))

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


class Fits(Protocol):
    """A class whose instances train with ``fit()`` (e.g. ``SupervisedTrainer``)."""

    def fit(self) -> Any: ...


F = TypeVar("F", bound=Fits)


def run_group(cfg: StrategyConfig, factory: type[F], *args: Any) -> list[Any]:
    """Start Ray if needed, run ``factory(*args).fit()`` on ``cfg.num_workers`` ranks, and clean up after."""
    import ray

    check_constructor(factory, args, {})
    started = init_ray(min_cpus=cfg.num_workers * cfg.cpus_per_worker)
    group = None
    try:
        group = RayWorkerGroup(cfg, factory, *args)
        return group.call(factory.fit)
    finally:
        if group is not None:
            group.shutdown()
        if started:
            ray.shutdown()


def wait(refs: list[Ref[R]]) -> list[R]:
    """Results of Ray ObjectRefs, in order (the controller never imports Ray itself)."""
    import ray

    return ray.get(refs)


def cluster_resources() -> dict[str, float]:
    import ray

    return ray.cluster_resources()


def shutdown_ray() -> None:
    import ray

    ray.shutdown()
