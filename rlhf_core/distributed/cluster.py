"""The cluster a stage runs on: where its worker groups and rollout engines live.

A job takes a ``Cluster`` and asks it for everything that runs outside the driver's own code: the worker groups of
its roles (``group``), the rollout engines (``engines``), the supervised stages' training group (``run_group``), the
capacity to check a config against (``resources``, ``nodes``), the shared placement groups of colocated roles
(``colocation``), and the results of asynchronous calls (``wait``, ``wait_timed``). Two clusters implement it:

- ``RayCluster``: Ray, as ``python -m rlhf_core.jobs.<kind>`` and the Prefect tasks run the stages: one Ray actor
  per rank (``launcher.RayWorkerGroup``), engines in actors of their own (``EngineGroup.create``).
- ``LocalCluster``: this process, without Ray: every group is one rank whose calls run the role's methods directly on
  one instance (asynchronous calls return their results, so ``wait`` gives them back as they are), the engines are
  ``HFGenerateEngine`` objects of this process, and the ranks share a one-rank torch.distributed world: a stage's
  real code in one process, for tests, checks and benches.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Concatenate, Generic, ParamSpec, Protocol, TypeVar

import torch
import torch.distributed as dist

from rlhf_core.config import StrategyConfig, WorkerConfig
from rlhf_core.distributed import launcher
from rlhf_core.distributed.device import DEVICE_ENV, resolve_device
from rlhf_core.distributed.launcher import Fits, check_call, check_constructor
from rlhf_core.distributed.rollout.group import EngineGroup, parameters_of, start_engines
from rlhf_core.distributed.strategy import leave_world
from rlhf_core.ports import free_port

T = TypeVar("T")
S = TypeVar("S")
R = TypeVar("R")
P = ParamSpec("P")
F = TypeVar("F", bound=Fits)


class WorkerGroup(Protocol[T]):
    """The ranks of one role, called with the hosted class's own method objects (``group.call(PolicyActor.export,
    ...)``). ``call`` and ``call_each`` return the results in rank order; their ``_async`` forms return what the
    cluster's ``wait`` turns into those results (Ray's ObjectRefs, or the results themselves)."""

    cls: type[T]

    def __len__(self) -> int: ...

    def wait_started(self) -> None: ...

    def call(self, method: Callable[Concatenate[T, P], R], *args: P.args, **kwargs: P.kwargs) -> list[R]: ...

    def call_async(self, method: Callable[Concatenate[T, P], R], *args: P.args, **kwargs: P.kwargs) -> list[Any]: ...

    def call_each(
        self, method: Callable[Concatenate[T, S, P], R], shards: Sequence[S], *args: P.args, **kwargs: P.kwargs
    ) -> list[R]: ...

    def call_each_async(
        self, method: Callable[Concatenate[T, S, P], R], shards: Sequence[S], *args: P.args, **kwargs: P.kwargs
    ) -> list[Any]: ...

    def shutdown(self) -> None: ...


class Cluster(Protocol):
    """Where a stage's groups and engines run. ``start``/``stop`` bracket a stage's use of it (they nest: each
    ``stop`` ends what its ``start`` began); ``run_group`` brackets itself."""

    def start(self, min_cpus: float = 1) -> None:
        """Make the cluster ready for groups asking ``min_cpus`` CPUs in all."""
        ...

    def stop(self) -> None:
        """End what the matching ``start`` began."""
        ...

    def resources(self) -> dict[str, float]:
        """The cluster's total resources (``CPU``, ``GPU``, custom ones)."""
        ...

    def device(self, requested: str) -> str:
        """Where roles asking for ``requested`` (``auto``, ``cpu``, ``cuda``) run on this cluster (once started)."""
        ...

    def nodes(self) -> list[dict[str, float]]:
        """The resources of each node."""
        ...

    def colocation(self, bundles: int, cpus_per_bundle: float, device: str) -> Any:
        """A placement of ``bundles`` bundles (one device each on GPU) that several groups share (``placement=``)."""
        ...

    def placement_id(self, placement: Any) -> str | None:
        """The id of a placement made by ``colocation`` (None where there are no placement groups)."""
        ...

    def release(self, placement: Any) -> None:
        """Give back a placement made by ``colocation``."""
        ...

    def group(
        self,
        strategy: WorkerConfig,
        cls: type[T],
        *args: Any,
        name: str = "worker",
        placement: Any = None,
        share: float = 1.0,
        **kwargs: Any,
    ) -> WorkerGroup[T]:
        """The ranks of ``strategy`` hosting ``cls(*args, **kwargs)`` each; with ``placement`` rank i takes ``share``
        of bundle i."""
        ...

    @parameters_of(start_engines)
    def engines(self, *args: Any, **kwargs: Any) -> EngineGroup:
        """``count`` rollout engines of ``backend`` sampling ``model_path``: the parameters of ``start_engines``,
        declared there once."""
        ...

    def wait(self, pending: Sequence[Any]) -> list[Any]:
        """The results of ``_async`` calls, in order."""
        ...

    def wait_timed(
        self, pending: dict[str, list[Any]], started: float | None = None
    ) -> tuple[dict[str, list[Any]], dict[str, float]]:
        """The results of concurrently dispatched groups of calls and each group's seconds from ``started`` until its
        last result (``launcher.wait_timed``)."""
        ...

    def run_group(self, strategy: StrategyConfig, cls: type[F], *args: Any, key: str = "strategy") -> list[Any]:
        """``cls(*args).fit()`` on the ranks of ``strategy``, each rank's result; ``key``: the config key of
        ``strategy``, named when the cluster cannot give what it asks for."""
        ...


# ---------------------------------------------------------------------------------------------------------------------
# Ray


class RayCluster:
    """The stages' Ray: a local one started for the stage, or the one at ``RAY_ADDRESS`` (``launcher.init_ray``);
    groups of Ray actors, engines in actors of their own, each in its own placement group unless colocated."""

    def __init__(self) -> None:
        self._started: list[bool] = []  # per open start(): whether it started (or connected to) Ray

    def start(self, min_cpus: float = 1) -> None:
        self._started.append(launcher.init_ray(min_cpus=min_cpus))

    def stop(self) -> None:
        if self._started and self._started.pop():
            launcher.shutdown_ray()

    def resources(self) -> dict[str, float]:
        return launcher.cluster_resources()

    def device(self, requested: str) -> str:
        return launcher.cluster_device(requested)

    def nodes(self) -> list[dict[str, float]]:
        return launcher.node_resources()

    def colocation(self, bundles: int, cpus_per_bundle: float, device: str) -> Any:
        return launcher.colocation_group(bundles, cpus_per_bundle, device)

    def placement_id(self, placement: Any) -> str | None:
        return placement.id.hex()

    def release(self, placement: Any) -> None:
        launcher.release_group(placement)

    def group(
        self,
        strategy: WorkerConfig,
        cls: type[T],
        *args: Any,
        name: str = "worker",
        placement: Any = None,
        share: float = 1.0,
        **kwargs: Any,
    ) -> WorkerGroup[T]:
        return launcher.RayWorkerGroup(strategy, cls, *args, name=name, placement=placement, share=share, **kwargs)

    @parameters_of(start_engines)
    def engines(self, *args: Any, **kwargs: Any) -> EngineGroup:
        return start_engines("ray", *args, **kwargs)

    def wait(self, pending: Sequence[Any]) -> list[Any]:
        return launcher.wait(list(pending))

    def wait_timed(
        self, pending: dict[str, list[Any]], started: float | None = None
    ) -> tuple[dict[str, list[Any]], dict[str, float]]:
        return launcher.wait_timed(pending, started)

    def run_group(self, strategy: StrategyConfig, cls: type[F], *args: Any, key: str = "strategy") -> list[Any]:
        return launcher.run_group(strategy, cls, *args, key=key)


# ---------------------------------------------------------------------------------------------------------------------
# This process


class LocalWorkerGroup(Generic[T]):
    """One rank in this process: ``obj``, built from the arguments a job gives the group (checked as
    ``RayWorkerGroup`` checks them), runs each call at once; the ``_async`` calls return the results themselves.
    ``cfg``: the strategy the job asked for (its ``num_workers`` is not honoured: there is one rank)."""

    def __init__(self, cfg: WorkerConfig, factory: type[T], *args: Any, name: str = "worker", **kwargs: Any):
        check_constructor(factory, args, kwargs)
        self.cfg, self.cls, self.name = cfg, factory, name
        self.obj: Any = factory(*args, **kwargs)

    def __len__(self) -> int:
        return 1

    def wait_started(self) -> None:
        pass

    def call(self, method: Callable[Concatenate[T, P], R], *args: P.args, **kwargs: P.kwargs) -> list[R]:
        check_call(self.cls, method, args, kwargs)
        return [method(self.obj, *args, **kwargs)]

    def call_async(self, method: Callable[Concatenate[T, P], R], *args: P.args, **kwargs: P.kwargs) -> list[Any]:
        return self.call(method, *args, **kwargs)

    def call_each(
        self, method: Callable[Concatenate[T, S, P], R], shards: Sequence[S], *args: P.args, **kwargs: P.kwargs
    ) -> list[R]:
        if len(shards) != 1:
            raise ValueError(f"{len(shards)} shards for the one in-process rank of {self.cls.__qualname__}")
        check_call(self.cls, method, (shards[0], *args), kwargs)
        return [method(self.obj, shards[0], *args, **kwargs)]

    def call_each_async(
        self, method: Callable[Concatenate[T, S, P], R], shards: Sequence[S], *args: P.args, **kwargs: P.kwargs
    ) -> list[Any]:
        return self.call_each(method, shards, *args, **kwargs)

    def shutdown(self) -> None:
        self.obj = None


# The torch.distributed world of one rank that the in-process roles join, as a Ray worker joins its group's.
WORLD_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE")


class LocalCluster:
    """This process as the cluster, without Ray. Every group is one rank (``LocalWorkerGroup``), whatever its
    strategy's ``num_workers``; ``run_group`` builds the trainer and runs its ``fit()`` here; engines are
    ``HFGenerateEngine`` objects here (the HF backend only, without tensor parallelism: vLLM's weight sync is a
    collective between processes). The roles join a one-rank torch.distributed world, which the outermost ``stop``
    ends (with the environment it set) when this cluster made it.

    ``resources``: what ``resources()`` and the one node of ``nodes()`` report, for the jobs' capacity checks.
    Default: unbounded CPUs, and unbounded GPUs where CUDA is available, since every role gets one rank here.
    ``device``: the device every role runs on (``cpu``, ``cuda``); default: each group's strategy's, resolved.
    ``group_class``: the class of its groups (a subclass of ``LocalWorkerGroup`` can record what its rank is given)."""

    group_class: type[LocalWorkerGroup[Any]] = LocalWorkerGroup

    def __init__(self, resources: dict[str, float] | None = None, device: str | None = None):
        self.device_override = device
        if resources is None:
            resources = {"CPU": math.inf, "GPU": math.inf if torch.cuda.is_available() else 0.0}
        self._resources = dict(resources)
        self._depth = 0
        self._saved_env: dict[str, str | None] | None = None  # the environment before this cluster set the world's

    def start(self, min_cpus: float = 1) -> None:
        self._depth += 1

    def stop(self) -> None:
        self._depth = max(0, self._depth - 1)
        if self._depth == 0:
            self._end_world()

    def resources(self) -> dict[str, float]:
        return dict(self._resources)

    def device(self, requested: str) -> str:
        return self.device_override or resolve_device(requested)

    def nodes(self) -> list[dict[str, float]]:
        return [dict(self._resources)]

    def colocation(self, bundles: int, cpus_per_bundle: float, device: str) -> Any:
        return None  # every group is in this process already

    def placement_id(self, placement: Any) -> str | None:
        return None

    def release(self, placement: Any) -> None:
        pass

    def group(
        self,
        strategy: WorkerConfig,
        cls: type[T],
        *args: Any,
        name: str = "worker",
        placement: Any = None,
        share: float = 1.0,
        **kwargs: Any,
    ) -> WorkerGroup[T]:
        self._join_world(strategy)
        return self.group_class(strategy, cls, *args, name=name, **kwargs)

    @parameters_of(start_engines)
    def engines(self, *args: Any, **kwargs: Any) -> EngineGroup:
        return start_engines("in_process", *args, **kwargs)

    def wait(self, pending: Sequence[Any]) -> list[Any]:
        return list(pending)

    def wait_timed(
        self, pending: dict[str, list[Any]], started: float | None = None
    ) -> tuple[dict[str, list[Any]], dict[str, float]]:
        """The results as they are, each group timed until now (its calls have run by the time they returned)."""
        now = time.perf_counter()
        started = now if started is None else started
        return {name: list(v) for name, v in pending.items()}, {
            name: now - started if v else 0.0 for name, v in pending.items()
        }

    def run_group(self, strategy: StrategyConfig, cls: type[F], *args: Any, key: str = "strategy") -> list[Any]:
        check_constructor(cls, args, {})
        self.start(strategy.num_workers * strategy.cpus_per_worker)
        try:
            self._join_world(strategy)
            return [cls(*args).fit()]
        finally:
            self.stop()

    def _join_world(self, strategy: WorkerConfig) -> None:
        """The device of ``strategy`` and, unless this process has a torch.distributed world already, the environment
        of rank 0 of a one-rank world, as a Ray worker's shell sets them (the world itself is made by the first role
        that joins it)."""
        if self._saved_env is None:
            self._saved_env = {DEVICE_ENV: os.environ.get(DEVICE_ENV)}
            if not dist.is_initialized():
                self._saved_env.update({name: os.environ.get(name) for name in WORLD_ENV})
                world = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "1"}
                os.environ.update(world, RANK="0", LOCAL_RANK="0")
        os.environ[DEVICE_ENV] = self.device_override or resolve_device(strategy.device)

    def _end_world(self) -> None:
        """End the world this cluster's roles made (through DeepSpeed: ``leave_world``); the environment as before."""
        if self._saved_env is None:
            return
        if "MASTER_PORT" in self._saved_env:
            leave_world()
        for name, value in self._saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        self._saved_env = None


if TYPE_CHECKING:  # the type checker holds both clusters to the protocol the jobs take
    _ray: Cluster = RayCluster()
    _local: Cluster = LocalCluster()
