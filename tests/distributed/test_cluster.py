"""The in-process cluster without any model: its groups check calls as Ray's do and run them at once, its
asynchronous results are the values themselves, and it leaves the process environment as it found it."""

import os

import pytest

from rlhf_core.config import StrategyConfig
from rlhf_core.distributed.cluster import WORLD_ENV, LocalCluster
from rlhf_core.distributed.device import DEVICE_ENV
from rlhf_core.distributed.rollout.engine import RolloutEngine, SamplingConfig
from rlhf_core.distributed.rollout.group import EngineGroup, LocalEngineHandles


class Counter:
    def __init__(self, start: int, *, step: int = 1):
        self.value, self.step = start, step

    def add(self, times: int) -> int:
        self.value += times * self.step
        return self.value

    def shard_sum(self, shard: list[int], scale: int = 1) -> int:
        return scale * sum(shard)


class Other:
    def add(self, times: int) -> int:
        return times


def test_a_local_group_is_one_rank_that_runs_checked_calls_at_once(monkeypatch):
    for name in (*WORLD_ENV, DEVICE_ENV):
        monkeypatch.delenv(name, raising=False)
    cluster = LocalCluster()
    cluster.start(min_cpus=4)
    group = cluster.group(StrategyConfig(num_workers=2), Counter, 10, step=2)
    assert len(group) == 1 and os.environ["WORLD_SIZE"] == "1" and os.environ[DEVICE_ENV] == "cpu"
    assert group.call(Counter.add, 1) == [12]
    assert cluster.wait(group.call_async(Counter.add, 2)) == [16]  # the results themselves
    assert group.call_each(Counter.shard_sum, [[1, 2, 3]], scale=2) == [12]
    with pytest.raises(ValueError, match="2 shards for the one in-process rank of Counter"):
        group.call_each(Counter.shard_sum, [[1], [2]])
    with pytest.raises(TypeError, match="Other.add is not a method of Counter"):
        group.call(Other.add, 1)
    with pytest.raises(TypeError, match="unexpected keyword argument 'bogus'"):
        group.call(Counter.add, 1, bogus=True)
    with pytest.raises(TypeError, match=r"Counter\(start: int"):
        cluster.group(StrategyConfig(), Counter)
    results, seconds = cluster.wait_timed({"a": group.call_async(Counter.add, 0), "b": []})
    assert results == {"a": [16], "b": []} and seconds["b"] == 0.0 and seconds["a"] >= 0.0
    cluster.stop()
    assert not any(name in os.environ for name in (*WORLD_ENV, DEVICE_ENV))  # as it found them


def test_local_engines_are_the_hf_backend_in_this_process():
    cluster = LocalCluster(resources={"CPU": 3.0, "node_a": 1.0})
    assert cluster.resources() == {"CPU": 3.0, "node_a": 1.0} and cluster.nodes() == [{"CPU": 3.0, "node_a": 1.0}]
    assert cluster.colocation(2, 1.0, "cpu") is None and cluster.placement_id(None) is None
    with pytest.raises(ValueError, match="the HF backend without tensor parallelism only"):
        cluster.engines(1, "builtin:tiny", eos_token_id=2, backend="vllm")
    with pytest.raises(TypeError, match="unexpected keyword argument 'kv_cache_gib'"):
        cluster.engines(1, "builtin:tiny", eos_token_id=2, backend="hf", kv_cache_gib=1)


class Echo:
    """Stands for an engine: answers each prompt with its own tokens reversed."""

    def generate(self, prompt_token_ids: list[list[int]], sampling: SamplingConfig) -> list[list[int]]:
        return [list(reversed(ids)) for ids in prompt_token_ids for _ in range(sampling.n)]

    def load_state_dict(self, state: dict) -> None:
        self.state = state


def test_local_engine_handles_pass_values_through():
    engines = [Echo(), Echo()]
    handles = LocalEngineHandles(Echo, engines)
    group = EngineGroup(handles, eos_token_id=0)
    # two engines, the prompts split between them; an empty response becomes [EOS]
    assert group.generate([[1, 2], [3], []], SamplingConfig(n=1)) == [[2, 1], [3], [0]]
    state = {"w": 1}
    assert handles.put(state) is state
    handles.call(RolloutEngine.load_state_dict, handles.put(state))
    assert all(e.state is state for e in engines)
    group.shutdown()
    assert len(handles) == 0
