"""Ray actor groups: one actor per device, joined into one ``torch.distributed`` group.

A plain Python object (the trainer of a stage) lives inside a thin Ray shell. Every actor gets an explicit thread
count before torch is touched, so several workers on a small machine do not oversubscribe its cores; rank 0 reports
its address and a free port, and every rank then gets ``MASTER_ADDR``/``MASTER_PORT``/``RANK``/``WORLD_SIZE``/
``LOCAL_RANK`` before its object is built. Nothing in that sequence waits on the driver (see ``RayWorkerGroup``).
Ray is imported here and in the other ``rlhf_core.distributed`` modules only.

Calls are typed: the driver passes the hosted class's method object (``group.call(PolicyActor.export, ...)``), never
a method name; the shell runs ``method(obj, *args, **kwargs)``. The driver checks the method and the arguments
against the class before anything is sent (``check_call``), so each role stays a plain class that also runs
without Ray.
"""

from __future__ import annotations

import inspect
import os
import re
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Concatenate, Generic, ParamSpec, Protocol, TypeVar, cast

from rlhf_core import events
from rlhf_core.config import ConfigError, StrategyConfig, WorkerConfig
from rlhf_core.distributed.device import resolve_device
from rlhf_core.ports import free_port

if TYPE_CHECKING:  # annotations only: Ref[R] is the ObjectRef of a remote call returning R
    from ray import ObjectRef as Ref

T = TypeVar("T")
S = TypeVar("S")
R = TypeVar("R")
P = ParamSpec("P")


# Forwarded from the driver to every worker when set: a driver told to stay offline keeps its workers offline too.
# RLHF_NODE_CACHE is not among them: it is a path on each node (node_files), set in each ``ray start``'s environment.
FORWARDED_ENV = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")


def init_ray(min_cpus: float = 1) -> bool:
    """Connect to ``RAY_ADDRESS`` when set (an existing cluster), else start a local Ray. Returns True when this call
    connected or started Ray: the caller then ends with ``ray.shutdown()``, which stops a local Ray but only
    disconnects from an existing cluster (its nodes and other jobs keep running). Within ``one_ray()`` the Ray this
    call starts is that context's to stop: False."""
    import ray

    if ray.is_initialized():
        return False
    forwarded = {name: os.environ[name] for name in FORWARDED_ENV if os.environ.get(name)}
    env = {"env_vars": {"TOKENIZERS_PARALLELISM": "false", "RAY_DEDUP_LOGS": "0", **forwarded}}
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], runtime_env=env, log_to_driver=True)
    else:
        cpus = max(float(os.cpu_count() or 1), min_cpus, _one_ray["min_cpus"])
        # address="local": a new Ray for this job even when another one runs on the machine
        ray.init(
            address="local", num_cpus=int(-(-cpus // 1)), include_dashboard=False, runtime_env=env, log_to_driver=True
        )
    if _one_ray["active"]:
        _one_ray["started"] = True
        return False
    return True


_one_ray: dict[str, Any] = {"active": False, "started": False, "min_cpus": 1.0}


@contextmanager
def one_ray(min_cpus: float = 1) -> Iterator[None]:
    """One Ray for everything inside (the stages that ``rlhf_core.jobs.pipeline`` runs one after the other in its
    process): the first ``init_ray`` starts it (or connects) as usual, and it stays up for the later ones instead
    of being shut down by each caller (a local ``ray.init`` takes seconds); leaving the context shuts it down.
    Nothing starts when nothing inside needs Ray. ``min_cpus``: the most any caller inside asks for (a local Ray
    gets at least that many, as the largest stage would have given its own)."""
    _one_ray.update(active=True, started=False, min_cpus=min_cpus)
    try:
        yield
    finally:
        started = _one_ray["started"]
        _one_ray.update(active=False, started=False, min_cpus=1.0)
        if started:
            shutdown_ray()


class _Shell:
    """The Ray side of a worker: sets the process environment, then hosts one plain object."""

    def __init__(self, env: dict[str, str], threads: int, role: str = "worker"):
        os.environ.update(env)
        os.environ["OMP_NUM_THREADS"] = str(threads)
        import warnings

        import torch

        # DeepSpeed calls deprecated torch.distributed names on every step; keep worker logs readable.
        warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")

        torch.set_num_threads(threads)
        self.obj: Any = None
        self.role = role  # "<hosted class> rank <r>": Ray's log prefix and error header show it

    def __repr__(self) -> str:  # Ray prefixes the worker's log lines with it and puts it in a RayTaskError
        return self.role

    def address(self) -> tuple[str, int]:
        import ray

        return ray.util.get_node_ip_address(), free_port()

    def construct(
        self, master: tuple[str, int], env: dict[str, str], factory: Callable[..., Any], args: tuple, kwargs: dict
    ) -> None:
        """Join the group's world (``master``: rank 0's address and port; Ray hands over the value of the ObjectRef
        the driver passes) and build the hosted object."""
        os.environ.update(env, MASTER_ADDR=master[0], MASTER_PORT=str(master[1]))
        self.obj = factory(*args, **kwargs)

    def call(self, method: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        # The method object itself (checked on the driver to belong to the hosted class): no name lookup.
        return method(self.obj, *args, **kwargs)


def describe_worker_error(error: BaseException) -> str | None:
    """One line for an error raised in a Ray worker: ``<role> rank <r> failed: <Type>: <first line of the cause>``
    (the worker died: says so); None for an error of the driver's own."""
    from ray.exceptions import RayActorError, RayTaskError

    if isinstance(error, RayTaskError):
        cause = error.cause if isinstance(error.cause, BaseException) else error
        first = (str(cause).strip().splitlines() or [""])[0]
        if isinstance(cause, RayTaskError):  # no usable cause: the first line of the remote traceback's last line
            first = (str(cause).strip().splitlines() or [""])[-1]
        # The class Ray derives from the cause's loses actor_repr (and forwards unknown attributes to the cause):
        # the remote traceback's header carries it, "ray::_Shell.call() (pid=..., repr=PolicyActor rank 0)".
        found = re.search(r"repr=([^)]*)\)", str(error))
        role = found.group(1) if found else "a worker"
        return f"{role} failed: {type(cause).__name__}: {first}"
    if isinstance(error, RayActorError):
        first = (str(error).strip().splitlines() or [""])[0]
        return f"a worker process died ({first})"
    return None


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

    Making a group does not wait for it: the actors start, and each rank's environment and constructor are queued on
    its actor behind rank 0's address, so that groups made one after the other (the PPO roles) and the engines start
    together. The first call (or ``wait_started``) waits for every rank's constructor, and raises its error.
    """

    def __init__(
        self,
        cfg: WorkerConfig,
        factory: type[T],
        *args: Any,
        name: str = "worker",
        placement: Any = None,
        share: float = 1.0,
        **kwargs: Any,
    ):
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        check_constructor(factory, args, kwargs)
        self.cls: type[T] = factory
        device = cluster_device(cfg.device)
        gpus = share if device == "cuda" else 0
        remote_shell = ray.remote(_Shell)
        base_env = {"RLHF_DEVICE": device, "TOKENIZERS_PARALLELISM": "false"}
        events_file = events.events_path()
        if events_file is not None:  # rank-0 workers append their own step events
            base_env[events.EVENTS_ENV] = events_file
        self.actors: list[Any] = []
        tag = uuid.uuid4().hex[:8]
        for rank in range(cfg.num_workers):
            # named after the role: `ray list actors` and the dashboard show which actor is which (PolicyActor:0:...)
            options: dict[str, Any] = {
                "num_cpus": cfg.cpus_per_worker,
                "num_gpus": gpus,
                "name": f"{factory.__name__}:{rank}:{tag}",
            }
            if cfg.resources and placement is None:  # pinned to the nodes that have them (in a bundle: its node)
                options["resources"] = dict(cfg.resources)
            if placement is not None:
                options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                    placement_group=placement, placement_group_bundle_index=rank
                )
            self.actors.append(
                remote_shell.options(**options).remote(
                    base_env, cfg.threads_per_worker, f"{factory.__name__} rank {rank}"
                )
            )
        self.name = name
        if not self.actors:
            self._starting: list[Any] = []
            return
        master = self.actors[0].address.remote()  # an ObjectRef: each construct below runs once it is there
        world = {"WORLD_SIZE": str(cfg.num_workers)}
        self._starting = [
            actor.construct.remote(
                master, {**world, "RANK": str(rank), "LOCAL_RANK": "0" if gpus else str(rank)}, factory, args, kwargs
            )
            for rank, actor in enumerate(self.actors)
        ]

    def wait_started(self) -> None:
        """Wait until every rank has built its object; a constructor's error is raised here (and again by every
        later call: the group is unusable)."""
        import ray

        if self._starting:
            ray.get(self._starting)
            self._starting = []

    def __len__(self) -> int:
        return len(self.actors)

    def call(self, method: Callable[Concatenate[T, P], R], *args: P.args, **kwargs: P.kwargs) -> list[R]:
        """Run ``method`` on every rank at once (collectives need all ranks) and return the results in rank order."""
        import ray

        return ray.get(self.call_async(method, *args, **kwargs))

    def call_async(self, method: Callable[Concatenate[T, P], R], *args: P.args, **kwargs: P.kwargs) -> list[Ref[R]]:
        check_call(self.cls, method, args, kwargs)
        self.wait_started()
        return [actor.call.remote(method, args, kwargs) for actor in self.actors]

    def call_each_async(
        self, method: Callable[Concatenate[T, S, P], R], shards: Sequence[S], *args: P.args, **kwargs: P.kwargs
    ) -> list[Ref[R]]:
        """``method(shards[rank], *args, **kwargs)`` on each rank; returns the ObjectRefs."""
        if len(shards) != len(self.actors):
            raise ValueError(f"{len(shards)} shards for the {len(self.actors)} workers of {self.cls.__qualname__}")
        if shards:
            check_call(self.cls, method, (shards[0], *args), kwargs)
        self.wait_started()
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
        self.actors, self._starting = [], []


def colocation_group(bundles: int, cpus_per_bundle: float, device: str) -> Any:
    """A PACK placement group of ``bundles`` bundles (one device each on GPU), ready to place workers on."""
    import ray
    from ray.util.placement_group import placement_group

    bundle = {"CPU": cpus_per_bundle, **({"GPU": 1} if device == "cuda" else {})}
    group = placement_group([dict(bundle) for _ in range(bundles)], strategy="PACK")
    ray.get(group.ready())
    return group


def release_group(group: Any) -> None:
    """Remove a placement group made by :func:`colocation_group` (its bundles' CPUs and GPUs go back to the
    cluster: a long-lived or shared Ray would otherwise keep them reserved after the stage)."""
    from ray.util.placement_group import remove_placement_group

    remove_placement_group(group)


class Fits(Protocol):
    """A class whose instances train with ``fit()`` (e.g. ``jobs.sft.SFTTrainer``)."""

    def fit(self) -> Any: ...


F = TypeVar("F", bound=Fits)


def run_group(cfg: StrategyConfig, factory: type[F], *args: Any, key: str = "strategy") -> list[Any]:
    """Start Ray if needed, run ``factory(*args).fit()`` on ``cfg.num_workers`` ranks, and clean up after. ``key``:
    the config key of ``cfg`` (e.g. ``sft.strategy``), named when the cluster lacks its ``resources``."""
    import ray

    check_constructor(factory, args, {})
    started = init_ray(min_cpus=cfg.num_workers * cfg.cpus_per_worker)
    group = None
    try:
        if cfg.resources:
            check_resources(
                {f"{key}.resources": (cfg.num_workers, cfg.cpus_per_worker, cfg.resources)}, node_resources()
            )
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

    return cast(dict[str, float], ray.cluster_resources())  # inferred from Ray as int; the amounts are floats


def cluster_device(requested: str) -> str:
    """``requested`` (``auto``, ``cpu``, ``cuda``) on this Ray cluster: its workers' GPUs decide ``auto``, not the
    driver's."""
    return resolve_device(requested, cluster_resources().get("GPU", 0.0))


def node_resources() -> list[dict[str, float]]:
    """The resources of each alive node of the cluster."""
    import ray

    return [dict(n["Resources"]) for n in ray.nodes() if n.get("Alive")]


def check_resources(groups: dict[str, tuple[int, float, dict[str, float]]], nodes: list[dict[str, float]]) -> None:
    """Refuse custom resources the cluster cannot give, before any worker starts (a pinned worker that Ray cannot
    place would wait forever). ``groups`` maps the config key of each group's resources to (workers, CPUs per worker,
    resources per worker); ``nodes`` are the alive nodes' resources (``node_resources()``). The ConfigError names the
    keys that ask for a resource no node has, more of it than the cluster has, or more CPUs than its nodes have."""
    demand: dict[str, float] = {}
    cpus: dict[str, float] = {}
    askers: dict[str, list[str]] = {}
    for key, (workers, cpus_per_worker, resources) in groups.items():
        for name, amount in resources.items():
            if name in ("CPU", "GPU"):
                raise ConfigError(
                    f"'{key}' names {name}: Ray sets CPUs and GPUs per worker itself (cpus_per_worker, "
                    "devices); use custom resources here, e.g. {node_a: 1}"
                )
            if amount <= 0:
                raise ConfigError(f"invalid value {amount!r} for '{key}.{name}': must be > 0")
            demand[name] = demand.get(name, 0.0) + workers * amount
            cpus[name] = cpus.get(name, 0.0) + workers * cpus_per_worker
            askers.setdefault(name, []).append(key)
    for name, needed in demand.items():
        holders = [n for n in nodes if n.get(name, 0) > 0]
        have, cpus_there = sum(n[name] for n in holders), sum(n.get("CPU", 0) for n in holders)
        keys = ", ".join(f"'{k}'" for k in askers[name])
        if not holders:
            raise ConfigError(
                f"{keys} ask for Ray resource {name!r}, which no node of the cluster has (start a node "
                f"with ray start --resources='{{\"{name}\": N}}', or change {keys})"
            )
        if needed > have:
            raise ConfigError(
                f"{keys} ask for {needed:g} {name!r} in all (workers x amount) but the cluster has {have:g}"
            )
        if cpus[name] > cpus_there:
            raise ConfigError(
                f"{keys}: the workers pinned to {name!r} need {cpus[name]:g} CPU but the nodes with "
                f"{name!r} have {cpus_there:g}"
            )


def shutdown_ray() -> None:
    import ray

    ray.shutdown()


def wait_timed(
    groups: dict[str, list[Ref[Any]]], started: float | None = None
) -> tuple[dict[str, list], dict[str, float]]:
    """Results of concurrently dispatched groups of ObjectRefs ({name: refs}, each list in order) and, per group, the
    seconds from ``started`` (a ``time.perf_counter()`` taken before the first dispatch; default: now) until its last
    ref was ready. A group without refs counts 0.0; entries that are values already (an in-process stand-in group's
    results) count as ready when this is called. A failed call raises when the results are read, after every group
    has finished."""
    import time

    import ray

    started = time.perf_counter() if started is None else started
    owner = {ref: name for name, refs in groups.items() for ref in refs if isinstance(ref, ray.ObjectRef)}
    left = {name: sum(isinstance(ref, ray.ObjectRef) for ref in refs) for name, refs in groups.items()}
    now = time.perf_counter()
    seconds = {name: now - started if refs and not left[name] else 0.0 for name, refs in groups.items()}
    pending = list(owner)
    while pending:
        ready, pending = ray.wait(pending, num_returns=1)
        now = time.perf_counter()
        for ref in ready:
            name = owner[ref]
            left[name] -= 1
            if left[name] == 0:
                seconds[name] = now - started
    values = dict(zip(owner, ray.get(list(owner)))) if owner else {}
    results = {
        name: [values[ref] if isinstance(ref, ray.ObjectRef) else ref for ref in refs] for name, refs in groups.items()
    }
    return results, seconds
