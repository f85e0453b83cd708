"""Stage start-up: worker groups that start together, one Ray for the stages the pipeline runs in its process, no
shared-memory comm op and no torch._inductor in the trained workers, and the bench's clocks."""

import os
import subprocess
import sys
import textwrap
import time

import pytest

from bench.startup import first_step_offset
from rlhf_core.config import StrategyConfig, as_ppo, load_config
from rlhf_core.distributed import launcher
from rlhf_core.distributed.placement import RoleSet, resource_demand
from rlhf_core.distributed.rollout.vllm_engine import cpu_kv_cache_bytes
from rlhf_core.jobs.stage_setup import ray_cpus
from tests.conftest import ROOT, TINY


class Sleeper:
    """A hosted object whose constructor takes a while (as a role's model build does)."""

    def __init__(self, seconds: float, fail: bool = False):
        self.began = time.time()
        time.sleep(seconds)
        self.ended = time.time()
        if fail:
            raise ValueError("this constructor fails")
        self.env = {k: os.environ[k] for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE")}

    def span(self) -> tuple[float, float]:
        return self.began, self.ended

    def environment(self) -> dict[str, str]:
        return self.env


CPU = StrategyConfig(num_workers=1, device="cpu", cpus_per_worker=0.5)


@pytest.mark.slow
def test_groups_start_together_and_a_constructor_error_comes_with_the_first_call(ray_cluster):
    made = time.time()
    pair = launcher.RayWorkerGroup(StrategyConfig(num_workers=2, device="cpu", cpus_per_worker=0.5), Sleeper, 4.0)
    single = launcher.RayWorkerGroup(CPU, Sleeper, 4.0)
    broken = launcher.RayWorkerGroup(CPU, Sleeper, 0.0, fail=True)
    try:
        assert time.time() - made < 2.0  # nothing waited for a worker to start or to build its object
        spans = pair.call(Sleeper.span) + single.call(Sleeper.span)
        # the three constructors ran at the same time: each began before any of them had finished
        assert max(began for began, _ in spans) < min(ended for _, ended in spans)
        envs = pair.call(Sleeper.environment)
        assert [e["RANK"] for e in envs] == ["0", "1"] and {e["WORLD_SIZE"] for e in envs} == {"2"}
        assert [e["LOCAL_RANK"] for e in envs] == ["0", "1"]
        assert envs[0]["MASTER_ADDR"] == envs[1]["MASTER_ADDR"] and envs[0]["MASTER_PORT"] == envs[1]["MASTER_PORT"]
        assert int(envs[0]["MASTER_PORT"]) > 0
        for _ in range(2):  # the group stays unusable: every call raises the constructor's error
            with pytest.raises(Exception, match="this constructor fails"):
                broken.call(Sleeper.span)
    finally:
        for group in (pair, single, broken):
            group.shutdown()


ONE_RAY = """
import os
import ray
from rlhf_core.distributed import launcher
from rlhf_core.distributed.placement import RoleSet, resource_demand
from rlhf_core.distributed.rollout.vllm_engine import cpu_kv_cache_bytes

cores = os.cpu_count() or 1
with launcher.one_ray(min_cpus=cores + 1):  # nothing inside needs Ray: nothing starts
    pass
assert not ray.is_initialized()
with launcher.one_ray(min_cpus=cores + 1):
    assert launcher.init_ray(min_cpus=1) is False  # the first stage starts it, sized for the largest
    assert ray.cluster_resources()["CPU"] == cores + 1, ray.cluster_resources()
    node = ray.get_runtime_context().get_node_id()
    assert launcher.init_ray(min_cpus=cores + 1) is False  # a later stage finds it up
    assert ray.get_runtime_context().get_node_id() == node
assert not ray.is_initialized()
assert launcher.init_ray(min_cpus=1) is True and ray.cluster_resources()["CPU"] == cores  # outside: as before
launcher.shutdown_ray()
print("ok")
"""


def _python(script: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.slow
@pytest.mark.extended  # start-up levers, measured by `python -m bench.startup`
def test_one_ray_serves_every_stage_inside_and_stops_after():
    """In a process of its own: Ray's state is per process."""
    out = _python(ONE_RAY)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout[-2000:] + out.stderr[-4000:]


WORKER = """
import os, sys
from rlhf_core.ports import free_port
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
                  RLHF_DEVICE="cpu", OMP_NUM_THREADS="1")
import torch
torch.set_num_threads(1)
if sys.argv[1] == "compiled":  # as DeepSpeed imports it by itself: torch.compile decorators, torch._inductor
    import deepspeed.runtime.zero.muon.muon_optimizer
import deepspeed.comm.comm as ds_comm
from deepspeed.ops.op_builder.builder import OpBuilder
from rlhf_core.config import OptimConfig, StrategyConfig, TrainConfig
from rlhf_core.distributed.strategy import SHM_COMM_OP, DeepSpeedStrategy
from rlhf_core.models.builders import build_causal_lm, load_tokenizer

s = DeepSpeedStrategy(StrategyConfig(num_workers=1, zero_stage=2, precision="fp32", packing=False),
                      OptimConfig(lr=1e-3), TrainConfig(train_batch_size=8, micro_train_batch_size=4))
s.init_distributed()
assert ds_comm.cdb.shm_comm_op is None and SHM_COMM_OP not in OpBuilder._loaded_ops
tok = load_tokenizer("builtin:tiny")
with s.model_init():
    model = build_causal_lm("builtin:tiny", tok, seed=0, dtype=torch.float32, attn="sdpa")
engine = s.prepare(model, 4)
ids = torch.randint(3, 100, (4, 16), generator=torch.Generator().manual_seed(0))
losses = []
for _ in range(4):
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    losses.append(loss.item())
print("inductor", "torch._inductor.compile_fx" in sys.modules)
print("losses", losses)
"""


@pytest.mark.slow
@pytest.mark.extended  # start-up levers, measured by `python -m bench.startup`
def test_workers_load_neither_the_shm_comm_op_nor_torch_inductor_and_train_alike():
    """A trained worker's DeepSpeed set-up (gloo, one rank): the comm backend comes without the shared-memory op,
    ZeRO's Muon import without torch._inductor, and training gives the same losses as with both."""
    runs = {}
    for way in ("eager", "compiled"):
        out = _python(WORKER, way)
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
        assert "deepspeed_shm_comm_op built" not in out.stdout + out.stderr
        runs[way] = dict(
            line.split(" ", 1) for line in out.stdout.splitlines() if line.startswith(("inductor", "losses"))
        )
    assert runs["eager"]["inductor"] == "False" and runs["compiled"]["inductor"] == "True"
    assert runs["eager"]["losses"] == runs["compiled"]["losses"]


DEEPSPEED_WITHOUT_MLFLOW = """
import sys
from rlhf_core.distributed.strategy import import_deepspeed
import_deepspeed()
from deepspeed.autotuning import autotuner
print("deepspeed", "mlflow" in sys.modules, autotuner.has_mlflow)
from rlhf_core.tracking import LOGGERS
import mlflow
from mlflow.tracking import MlflowClient
print("mlflow", mlflow.__version__, MlflowClient.__name__)
"""


def test_deepspeed_loads_without_mlflow_and_the_tracker_still_gets_it():
    """DeepSpeed's autotuner imports mlflow whenever it is installed (1-2 s of every worker's start-up): the
    workers' DeepSpeed loads without it, and a later import, as the MLflow tracker makes, gets the real package."""
    out = _python(DEEPSPEED_WITHOUT_MLFLOW)
    assert out.returncode == 0, out.stderr[-4000:]
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines() if line.startswith(("deepspeed", "mlflow")))
    assert lines["deepspeed"] == "False False"  # mlflow not imported, and DeepSpeed took it for absent
    assert lines["mlflow"].split()[1:] == ["MlflowClient"] and lines["mlflow"][0].isdigit()


def test_ray_cpus_of_each_kind_is_what_its_job_asks_init_ray_for():
    cfg = load_config(TINY, ["sft.strategy.num_workers=2", "sft.strategy.cpus_per_worker=1.5"])
    assert ray_cpus(cfg.stage("sft")) == 3.0
    assert ray_cpus(cfg.stage("reward_model")) == 1.0
    assert ray_cpus(cfg.stage("critic_init")) is None  # no Ray
    for stage in ("critic_warmup", "ppo"):
        p = as_ppo(cfg.stage(stage))  # the warm-up's section run as PPO's, as its job runs it
        assert ray_cpus(cfg.stage(stage)) == resource_demand(p, RoleSet.of(p), "cpu")["CPU"]


def test_bench_reads_the_first_step_from_old_and_new_output():
    shell = "\x1b[36m(_Shell pid=123)\x1b[0m "
    assert first_step_offset("sft", shell + "[sft] first step 12.3s after the job started") == 0.0
    assert first_step_offset("sft", shell + "[sft] step 1/32 loss=6.9320 lr=3.00e-03 (0.05s)") == 0.05
    assert first_step_offset("ppo", "[ppo] before: rm_score=0.1 gold_reward=0.2") == 0.0
    assert first_step_offset("ppo", "[ppo] step 1/12 reward=0.1 (3.2s)") == 3.2
    assert first_step_offset("sft", "[sft] step 12/32 loss=1.0 (0.05s)") is None
    assert first_step_offset("sft", "[reward_model] step 1/32 loss=1.0 (0.05s)") is None
    assert first_step_offset("sft", "[sft] saved /tmp/run/sft") is None


def test_a_cpu_engine_allocates_the_kv_cache_its_sequences_need_not_a_gibibyte():
    """vLLM zero-fills its whole KV cache when an engine starts, and first-touched memory can come at about 3 s per
    GiB: the default cache holds 256 sequences of the longest length (whole 128-token blocks, and the block vLLM
    keeps empty), at most 1 GiB."""
    from transformers import LlamaConfig

    small = LlamaConfig(num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, head_dim=32)
    # demo engine, max_model_len 48 -> 1 block of 128 tokens per sequence, 256 + 1 blocks = 32,896 tokens;
    # a token: keys and values (2) x 4 layers x 4 heads x 32 numbers x 4 bytes (fp32) = 4,096 bytes -> 128.5 MiB
    assert cpu_kv_cache_bytes(small, 48, "float32") == 32_896 * 4_096 == (128 << 20) + (512 << 10)
    # 129 tokens need 2 blocks: 513 blocks = 65,664 tokens; bf16 halves the token: 2,048 bytes
    assert cpu_kv_cache_bytes(small, 129, "bfloat16") == 65_664 * 2_048
    # grouped-query attention: 2 KV heads of the 4, head_dim from hidden_size / heads = 128 / 4 = 32
    gqa = LlamaConfig(num_hidden_layers=4, hidden_size=128, num_attention_heads=4, num_key_value_heads=2)
    assert cpu_kv_cache_bytes(gqa, 48, "float32") == 32_896 * 2 * 4 * 2 * 32 * 4
    # tensor parallel: each of 2 workers holds half the KV heads (1 of 2); 3 ranks: ceil(2 / 3) = 1 head each
    assert cpu_kv_cache_bytes(gqa, 48, "float32", 2) == cpu_kv_cache_bytes(gqa, 48, "float32", 3) == 32_896 * 1_024
    # a 0.5B-size model at 2,048 tokens would need 4,097 blocks x 128 x 2 x 24 x 2 x 64 x 2 bytes = 6 GiB: capped
    big = LlamaConfig(num_hidden_layers=24, hidden_size=896, num_attention_heads=14, num_key_value_heads=2)
    assert cpu_kv_cache_bytes(big, 2048, "bfloat16") == 1 << 30
