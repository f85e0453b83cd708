"""The rollout engines as Ray actors: where they run, and the only place they are called.

``start_engines`` starts the engines (``VLLMEngine`` or ``HFGenerateEngine``) in Ray actors (``EngineGroup.create``)
or in this process (a ``LocalCluster``'s); the group owns the placement groups made for them, and
``EngineGroup.shutdown`` kills the actors and removes those groups. Every call to an engine goes through
``EngineHandles`` with a method object of the ``RolloutEngine`` protocol (``handles.call(RolloutEngine.generate,
prompts, sampling)``): the hosted class's implementation is looked up and the arguments checked against its signature
on the caller's side (``launcher.check_call``), before anything is sent. The trainer's actor gets the same
``EngineHandles`` for the weight sync (``weight_sync.sender``, which takes them as its ``peers.ReceivingEngines``).
Results come back through ``EngineHandles.get``, so that engines of the driver's own process (``LocalEngineHandles``)
are called the same way.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager as ContextManager
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Concatenate, Literal, ParamSpec, TypeVar

from rlhf_core.distributed.launcher import check_call, check_constructor
from rlhf_core.distributed.node_files import ModelSource
from rlhf_core.distributed.rollout.engine import RolloutEngine, SamplingConfig
from rlhf_core.distributed.rollout.hf_engine import HFGenerateEngine
from rlhf_core.distributed.rollout.vllm_engine import VLLMEngine

if TYPE_CHECKING:  # annotations only: Ref[R] is the ObjectRef of a remote call returning R
    from ray import ObjectRef as Ref

P = ParamSpec("P")
R = TypeVar("R")
S = TypeVar("S")

Backend = Literal["vllm", "hf"]
Hosting = Literal["ray", "in_process"]  # where start_engines runs the engines


class EngineHandles:
    """The Ray actors of one backend's engines (``cls``), called with ``RolloutEngine``'s method objects (or the
    hosted class's own). Picklable: it travels to the trainer's actor for the weight sync."""

    def __init__(self, cls: type, actors: Sequence[Any]):
        self.cls = cls
        self.actors = list(actors)

    def __len__(self) -> int:
        return len(self.actors)

    def call_async(
        self, method: Callable[Concatenate[RolloutEngine, P], R], *args: P.args, **kwargs: P.kwargs
    ) -> list[Ref[R]]:
        """``method(*args, **kwargs)`` on every engine; returns the ObjectRefs in engine order."""
        impl = self._checked(method, args, kwargs)
        return [self._submit(actor, impl, args, kwargs) for actor in self.actors]

    def call(self, method: Callable[Concatenate[RolloutEngine, P], R], *args: P.args, **kwargs: P.kwargs) -> list[R]:
        return self.get(self.call_async(method, *args, **kwargs))

    def get(self, pending: Sequence[Any]) -> list[Any]:
        """The results of ``call_async``/``call_one_async`` calls, in order."""
        import ray

        return ray.get(list(pending))

    def put(self, value: Any) -> Any:
        """``value`` as an argument of a later call to several engines (stored once in Ray's object store)."""
        import ray

        return ray.put(value)

    def call_one_async(
        self, index: int, method: Callable[Concatenate[RolloutEngine, P], R], *args: P.args, **kwargs: P.kwargs
    ) -> Ref[R]:
        """``method(*args, **kwargs)`` on engine ``index`` alone (its own arguments: a prompt chunk, a rank)."""
        impl = self._checked(method, args, kwargs)
        return self._submit(self.actors[index], impl, args, kwargs)

    def kill(self) -> None:
        import ray

        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        self.actors = []

    def _checked(self, method: Callable[..., Any], args: tuple, kwargs: dict) -> Callable[..., Any]:
        """The hosted class's own function for ``method``, once ``(self, *args, **kwargs)`` binds to it."""
        name = getattr(method, "__name__", "")
        # the protocol's stub (its own, or one of the weight sync's that it extends): the hosted class implements it
        if any(vars(protocol).get(name) is method for protocol in inspect.getmro(RolloutEngine)):
            method = next((vars(klass)[name] for klass in self.cls.__mro__ if name in vars(klass)), method)
        check_call(self.cls, method, args, kwargs)
        return method

    def _submit(self, actor: Any, method: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        # Ray's __ray_call__ runs method(engine, *args, **kwargs) on the actor's instance, as launcher's shell runs
        # a role's method: the function object travels, no method name is looked up.
        return actor.__ray_call__.remote(method, *args, **kwargs)


class LocalEngineHandles(EngineHandles):
    """Engines that are objects of this process: each call runs at once and returns its result, and ``get``/``put``
    pass values through (the weight sync's state dict included)."""

    def _submit(self, actor: Any, method: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        return method(actor, *args, **kwargs)

    def get(self, pending: Sequence[Any]) -> list[Any]:
        return list(pending)

    def put(self, value: Any) -> Any:
        return value

    def kill(self) -> None:
        self.actors = []


# Decoding steps of a partial rollout between two chances for a weight sync (EngineGroup.generate_partial): a sync
# waits for at most this many steps of the engines; each turn is one more call to every engine.
TURN_STEPS = 8
NAN = float("nan")  # the log-prob of the EOS put in an empty response: the engine did not sample it


def engine_seed(seed: int, i: int) -> int:
    """Engine ``i``'s seed, of its sampling calls and of its own generator: no two engines draw the same stream."""
    return seed + 7919 * i


def start_engines(
    hosting: Hosting,
    count: int,
    model_path: ModelSource,
    *,
    eos_token_id: int,
    backend: Backend = "vllm",
    tensor_parallel_size: int = 1,
    num_cpus_per_engine: float = 1,
    env_vars: dict[str, str] | None = None,
    placement: Any = None,
    share: float = 1.0,
    resources: dict[str, float] | None = None,
    **kwargs: Any,
) -> EngineGroup:
    """``count`` rollout engines of ``backend`` sampling ``model_path``, hosted as ``hosting`` says: the one
    declaration of the engines' parameters, which ``EngineGroup.create`` and every ``Cluster.engines`` take
    (``parameters_of``).

    ``"ray"``: ``count`` Ray actors hosting a ``VLLMEngine`` or ``HFGenerateEngine`` each. Returns at once; the
    engines start in the background (``wait_ready`` waits for them). ``kwargs`` go to the engine's constructor
    (checked here; ``enable_sleep`` also turns on the group's sleep mode); ``env_vars`` to the actors' environment.

    Placement: each engine gets its own placement group, one bundle per tensor-parallel rank ({GPU: 1, CPU:
    cpus / tp} on GPU, {CPU: cpus / tp} on CPU), the actor in bundle 0 with ``placement_group_capture_child_tasks``
    so that what vLLM starts from it stays inside (on GPU with TP > 1, vLLM's Ray executor puts one worker in each
    bundle; on CPU the TP workers are child processes of the actor and the other bundles reserve their CPUs). With
    ``placement`` (the training roles' PACK group, ``launcher.colocation_group``: the hybrid engine of
    ``colocate_all``) engine i uses bundles ``i*tp .. i*tp+tp-1`` of that group instead, taking ``share`` of each
    bundle's GPU and ``num_cpus_per_engine`` of bundle ``i*tp``'s CPUs; that group stays its owner's. ``resources``
    (Ray custom resources per engine, e.g. ``{"node_a": 1}``): an actor in a placement group can only use its
    bundle's resources, so they go into bundle 0 of the engine's own group, which then lands on a node that has
    them (not with ``placement``: the shared group's owner decides its nodes).

    vLLM CPU with tensor_parallel_size > 1 binds each TP worker's threads to the cores of one NUMA node of its own
    (``VLLM_CPU_OMP_THREADS_BIND=auto``) and refuses when there are fewer nodes than workers; on such a machine
    the engines get ``VLLM_CPU_OMP_THREADS_BIND=nobind`` (threads left to the OS, ``OMP_NUM_THREADS`` each) unless
    ``env_vars`` chooses a binding (e.g. ``"0|1"`` with ``VLLM_CPU_NUM_OF_RESERVED_CPU=0`` on 2 cores).

    ``"in_process"`` (a ``LocalCluster``'s): ``HFGenerateEngine`` objects of this process, called through
    ``LocalEngineHandles``; the HF backend only, without tensor parallelism (vLLM's weight sync is a collective
    between processes). Where to run (CPUs, environment, placement, resources) does not apply there, and every
    engine gets ``kwargs`` as they are."""
    if hosting == "in_process":
        if backend != "hf" or tensor_parallel_size != 1:
            raise ValueError(
                "in-process rollout engines: the HF backend without tensor parallelism only (got backend "
                f"{backend!r}, tensor_parallel_size {tensor_parallel_size})"
            )
        check_constructor(HFGenerateEngine, (model_path,), kwargs)
        engines = [HFGenerateEngine(model_path, **kwargs) for _ in range(count)]
        return EngineGroup(LocalEngineHandles(HFGenerateEngine, engines), eos_token_id)
    import ray
    from ray.util.placement_group import remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    if backend not in ("vllm", "hf"):
        raise ValueError(f"unknown rollout backend {backend!r} (expected 'vllm' or 'hf')")
    if backend == "hf" and tensor_parallel_size != 1:
        raise ValueError("the HF backend has no tensor parallelism (tensor_parallel_size must be 1)")
    tp = tensor_parallel_size
    if placement is not None and resources:
        raise ValueError(
            "engines in a shared placement group cannot ask for custom resources (the group's bundles decide)"
        )
    if placement is not None and len(placement.bundle_specs) < count * tp:
        raise ValueError(
            f"{count} engine(s) x tensor_parallel_size {tp} need {count * tp} bundles of the shared placement "
            f"group, which has {len(placement.bundle_specs)}"
        )
    engine_cls = VLLMEngine if backend == "vllm" else HFGenerateEngine
    if backend == "vllm":
        kwargs = {"tensor_parallel_size": tp, **kwargs}
    check_constructor(engine_cls, (model_path,), kwargs)
    gpus = _cluster_has_gpus()
    threads = max(1, int(num_cpus_per_engine / (tp if placement is None else 1)))
    env = {"OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
    if backend == "vllm" and tp > 1 and not gpus and _numa_nodes() < tp:
        env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
    env.update(env_vars or {})
    actors: list[Any] = []
    own: list[Any] = []
    try:
        for i in range(count):
            if placement is None:
                group, first = _engine_placement_group(tp, num_cpus_per_engine, gpus, resources or {}), 0
                own.append(group)
                cpus, gpu_share = num_cpus_per_engine / tp, 1.0
            else:
                group, first = placement, i * tp
                cpus, gpu_share = num_cpus_per_engine, share
            actor_kwargs = dict(kwargs)
            if "seed" in kwargs:  # each engine's own generator (SamplingConfig.seed_per_prompt off) differs
                actor_kwargs["seed"] = engine_seed(kwargs["seed"], i)
            if backend == "vllm" and gpus and tp > 1:
                # the actor holds no GPU; vLLM's TP workers take gpu_share of the GPU of each of its bundles
                actor_kwargs.update(bundle_indices=list(range(first, first + tp)), gpus_per_worker=gpu_share)
                actor_gpus = 0.0
            else:
                actor_gpus = gpu_share if gpus else 0.0
            strategy = PlacementGroupSchedulingStrategy(
                placement_group=group, placement_group_bundle_index=first, placement_group_capture_child_tasks=True
            )
            options = ray.remote(engine_cls).options(
                num_cpus=cpus,
                num_gpus=actor_gpus,
                resources=dict(resources or {}),
                scheduling_strategy=strategy,
                runtime_env={"env_vars": env},
            )
            actors.append(options.remote(model_path, **actor_kwargs))
    except BaseException:  # what was started before the failure is no one else's to clean up
        EngineHandles(engine_cls, actors).kill()
        for group in own:
            remove_placement_group(group)
        raise
    sleep = bool(kwargs.get("enable_sleep", False))
    return EngineGroup(EngineHandles(engine_cls, actors), eos_token_id, sleep=sleep, placement_groups=own)


def parameters_of(
    source: Callable[Concatenate[Any, P], R],
) -> Callable[[Callable[Concatenate[S, ...], R]], Callable[Concatenate[S, P], R]]:
    """Types the decorated ``(self, *args, **kwargs)`` method as taking ``source``'s parameters after its first (the
    engines': ``start_engines``' after ``hosting``), so that they are declared once; the method is returned as it
    is."""

    def typed(method: Callable[Concatenate[S, ...], R]) -> Callable[Concatenate[S, P], R]:
        return method

    return typed


class EngineGroup:
    """The rollout engines as one object for the controller: prompts spread evenly, results in prompt order.

    With sleep mode (vLLM engines built with ``enable_sleep``): ``sleep()`` after a rollout frees the engines' GPU
    memory for training; ``wake_up(["weights"])`` before a weight sync brings back the weights only; any generation
    or log-prob call wakes what is still asleep first. Without it both are no-ops."""

    def __init__(
        self, handles: EngineHandles, eos_token_id: int, sleep: bool = False, placement_groups: Sequence[Any] = ()
    ):
        self.handles, self.eos = handles, eos_token_id
        self.sleep_enabled = sleep
        self.asleep: set[str] = set()  # tags released on every engine (the engines keep their own record too)
        self.placement_groups = list(placement_groups)  # made by create, one per engine: removed by shutdown

    @classmethod
    @parameters_of(start_engines)
    def create(cls, *args: Any, **kwargs: Any) -> EngineGroup:
        """The engines in Ray actors: ``start_engines("ray", ...)``, whose parameters it takes."""
        return start_engines("ray", *args, **kwargs)

    def sleep(self) -> None:
        if self.sleep_enabled and not self.asleep:
            self.handles.call(RolloutEngine.sleep)
            self.asleep = {"weights", "kv_cache"}

    def wake_up(self, tags: list[str] | None = None) -> None:
        todo = self.asleep if tags is None else self.asleep & set(tags)
        if todo:
            self.handles.call(RolloutEngine.wake_up, sorted(todo))
            self.asleep = self.asleep - todo

    def wait_ready(self) -> None:
        self.handles.call(RolloutEngine.ready)

    def placement_group_ids(self) -> list[str | None]:
        """Each engine's placement group, asked from inside its actor (None: not in one)."""
        return self.handles.call(RolloutEngine.placement_group_id)

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingConfig) -> list[list[int]]:
        """n responses per prompt, prompt-major; engine i samples with ``engine_seed(seed, i)``; an empty one becomes
        [EOS]."""
        parts = self._on_engines(RolloutEngine.generate, prompt_ids, sampling)
        return self._joined([(part,) for part in parts], fills=())[0]

    def generate_with_logprobs(
        self, prompt_ids: list[list[int]], sampling: SamplingConfig
    ) -> tuple[list[list[int]], list[list[float]]]:
        """``generate``, and per response token the log-prob the engine sampled it with
        (``RolloutEngine.generate_with_logprobs``); an empty response becomes [EOS] with a NaN log-prob (the engine
        did not sample it)."""
        return self._joined(self._on_engines(RolloutEngine.generate_with_logprobs, prompt_ids, sampling), (NAN,))

    def generate_partial(
        self, prompt_ids: list[list[int]], sampling: SamplingConfig, turn: Callable[[], ContextManager[Any]]
    ) -> tuple[list[list[int]], list[list[float]], list[list[int]]]:
        """Partial rollout (vLLM engines): ``generate_with_logprobs`` in turns of ``TURN_STEPS`` decoding steps, each
        inside ``turn()``, so that weight syncs can come in between; the responses keep running through them. Also
        returns, per response token, the weight version (the engine's syncs received) that sampled it (-1 for the
        EOS put in an empty response)."""
        self.wake_up()
        split = self._split(prompt_ids, sampling)
        self.handles.get([self.handles.call_one_async(i, RolloutEngine.begin_generation, c, s) for i, c, s in split])
        running = [i for i, _, _ in split]
        while running:
            with turn():
                refs = [self.handles.call_one_async(i, RolloutEngine.advance_generation, TURN_STEPS) for i in running]
                left = self.handles.get(refs)
            running = [i for i, n in zip(running, left) if n]
        parts = self.handles.get([self.handles.call_one_async(i, RolloutEngine.take_generation) for i, _, _ in split])
        return self._joined(parts, fills=(NAN, -1))

    def _on_engines(self, method: Callable[..., R], prompt_ids: list[list[int]], sampling: SamplingConfig) -> list[R]:
        """``method(prompts, sampling)`` on each engine with its share of the prompts (``_split``), awake."""
        self.wake_up()
        split = self._split(prompt_ids, sampling)
        return self.handles.get([self.handles.call_one_async(i, method, c, s) for i, c, s in split])

    def _split(
        self, prompt_ids: list[list[int]], sampling: SamplingConfig
    ) -> list[tuple[int, list[list[int]], SamplingConfig]]:
        """``(engine, prompts, sampling)`` per engine with prompts: an even share in order, its own seed."""
        k = len(self.handles)
        chunks = [prompt_ids[i * len(prompt_ids) // k : (i + 1) * len(prompt_ids) // k] for i in range(k)]
        return [
            (i, chunk, replace(sampling, seed=engine_seed(sampling.seed, i)))
            for i, chunk in enumerate(chunks)
            if chunk
        ]

    def _joined(self, parts: list[tuple[list[list[Any]], ...]], fills: tuple[Any, ...]) -> Any:
        """The engines' columns (responses, then per-token lists beside them) in prompt order. An empty response
        becomes [EOS], and its row in each other column ``[fill]``: the engine did not sample that token (a NaN
        log-prob)."""
        columns: list[list[list[Any]]] = [[] for _ in range(1 + len(fills))]
        for part in parts:
            for response, *rest in zip(*part):
                columns[0].append(response or [self.eos])
                for column, row, fill in zip(columns[1:], rest, fills):
                    column.append(row if response else [fill])
        return tuple(columns)

    def sequence_logprobs(self, token_ids: list[int]) -> list[float]:
        self.wake_up()
        return self.handles.get([self.handles.call_one_async(0, RolloutEngine.sequence_logprobs, [token_ids])])[0][0]

    def shutdown(self) -> None:
        """Kill the engine actors and remove the placement groups ``create`` made for them."""
        self.handles.kill()
        if self.placement_groups:
            from ray.util.placement_group import remove_placement_group

            for group in self.placement_groups:
                remove_placement_group(group)
        self.placement_groups = []


def _engine_placement_group(
    tp: int, cpus: float, gpus: bool, resources: dict[str, float], timeout_s: float = 120
) -> Any:
    """One engine's group: a bundle per TP rank, packed (vLLM's TP ranks talk over the node's shared memory); the
    custom ``resources`` in bundle 0, where the engine actor runs."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    bundle = {"CPU": cpus / tp, **({"GPU": 1.0} if gpus else {})}
    bundles = [{**bundle, **resources}] + [dict(bundle) for _ in range(tp - 1)]
    group = placement_group(bundles, strategy="PACK")
    ready, _ = ray.wait([group.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(group)
        raise RuntimeError(
            f"a rollout engine's placement group ({bundles}) could not be placed in {timeout_s:g} s; the Ray "
            f"cluster has {ray.available_resources()} free"
        )
    return group


def _cluster_has_gpus() -> bool:
    import ray

    return ray.cluster_resources().get("GPU", 0) > 0


def _numa_nodes() -> int:
    """NUMA nodes of this machine (1 where Linux does not say), as vLLM CPU counts them for its thread binding."""
    import glob

    return max(1, len(glob.glob("/sys/devices/system/node/node[0-9]*")))
