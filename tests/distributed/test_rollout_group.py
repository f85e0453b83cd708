"""The rollout engines' interface and the typed calls to them, without Ray or vLLM: both backends implement the
``RolloutEngine`` protocol with its signatures, and ``EngineHandles`` sends the hosted class's own method once the
arguments bind (a wrong call fails on the caller's side, before anything is sent)."""

import inspect

import pytest

from rlhf_core.distributed.rollout.engine import RolloutEngine, SamplingConfig
from rlhf_core.distributed.rollout.group import EngineGroup, EngineHandles
from rlhf_core.distributed.rollout.hf_engine import HFGenerateEngine
from rlhf_core.distributed.rollout.vllm_engine import RECEIVER_CLS, VLLMEngine
from rlhf_core.distributed.weight_sync.receiver import WorkerWeightReceiver

# RolloutEngine's methods, with the weight-sync ones it takes from weight_sync.peers.ReceivingEngine
STUBS = {
    name: fn
    for klass in RolloutEngine.__mro__
    if klass.__module__.startswith("rlhf_core.")
    for name, fn in vars(klass).items()
    if inspect.isfunction(fn) and not name.startswith("_")
}
PROTOCOL = list(STUBS)


def _parameters(fn):
    """The parameters as written: ``ray.remote`` of a class adds ``_ray_trace_ctx`` to its methods' signatures in this
    process (Ray's tracing hook), so a test that ran an engine before this one would otherwise see it."""
    params = inspect.signature(fn).parameters.values()
    return [(p.name, p.kind, p.default) for p in params if p.name != "_ray_trace_ctx"]


@pytest.mark.parametrize("cls", [VLLMEngine, HFGenerateEngine])
def test_backends_implement_the_protocol(cls):
    assert len(PROTOCOL) == 14, PROTOCOL
    for name in PROTOCOL:
        own = next((vars(k)[name] for k in cls.__mro__ if name in vars(k)), None)
        assert inspect.isfunction(own), f"{cls.__name__} has no {name}"
        assert _parameters(own) == _parameters(STUBS[name]), f"{cls.__name__}.{name}"


def test_vllm_loads_the_receiver_by_its_current_path():
    module, _, name = RECEIVER_CLS.rpartition(".")
    assert (module, name) == ("rlhf_core.distributed.weight_sync.receiver", "WorkerWeightReceiver")
    assert vars(__import__(module, fromlist=[name]))[name] is WorkerWeightReceiver


class Recorded(EngineHandles):
    """Handles whose calls are recorded instead of sent."""

    def _submit(self, actor, method, args, kwargs):
        return (actor, method, args, kwargs)


def test_handles_send_the_hosted_class_method_after_checking_the_arguments():
    handles = Recorded(VLLMEngine, ["e0", "e1"])
    specs = [("w", "float32", (2,))]
    assert handles.call_async(RolloutEngine.receive_weights, specs, 16, sync_id=3) == [
        ("e0", VLLMEngine.receive_weights, (specs, 16), {"sync_id": 3}),
        ("e1", VLLMEngine.receive_weights, (specs, 16), {"sync_id": 3}),
    ]
    sampling = SamplingConfig(n=2)
    assert handles.call_one_async(1, RolloutEngine.generate, [[1, 2]], sampling) == (
        "e1",
        VLLMEngine.generate,
        ([[1, 2]], sampling),
        {},
    )
    hf = Recorded(HFGenerateEngine, ["h0"])
    assert hf.call_async(RolloutEngine.sleep) == [("h0", HFGenerateEngine.sleep, (), {})]
    assert hf.call_async(HFGenerateEngine.load_state_dict, {}) == [("h0", HFGenerateEngine.load_state_dict, ({},), {})]

    with pytest.raises(TypeError, match=r"generate.*sampling"):
        handles.call_async(RolloutEngine.generate, [[1, 2]])
    with pytest.raises(TypeError, match="unexpected keyword argument 'seed'"):
        handles.call_one_async(0, RolloutEngine.sequence_logprobs, [[1, 2]], seed=1)
    with pytest.raises(TypeError, match="is not a method of VLLMEngine"):
        handles.call_async(HFGenerateEngine.generate, [[1]], sampling)
    with pytest.raises(TypeError, match="pass a method of VLLMEngine"):
        handles.call_async("generate", [[1]], sampling)


def test_engine_group_refuses_a_bad_request_before_starting_anything():
    with pytest.raises(ValueError, match="unknown rollout backend 'tgi'"):
        EngineGroup.create(1, "unused", eos_token_id=0, backend="tgi")
    with pytest.raises(ValueError, match="no tensor parallelism"):
        EngineGroup.create(1, "unused", eos_token_id=0, backend="hf", tensor_parallel_size=2)
    with pytest.raises(TypeError, match="unexpected keyword argument 'max_model_len'"):
        EngineGroup.create(1, "unused", eos_token_id=0, backend="hf", max_model_len=64)  # a vLLM engine's key
