"""Every documented config key changes what the code does.

The documented keys are the rows of ``describe(PipelineConfig)``. ``EFFECTS`` maps each of them to a ``Probe``
(``harness``): the overrides that change it and a function that runs the code path consuming the key and returns what
that code produced (examples, a DeepSpeed config, an LR curve, a built model, a job's checkpoints, ...). The test loads
the tiny preset twice, without and with the change, runs the probe on both and asserts that the observables differ
(and, where a probe says so, that they changed as expected). ``test_every_documented_key_has_a_probe`` keeps the table
complete: a new key without a probe fails it.

Each kind's section holds only the keys the kind reads; ``test_another_kinds_keys_are_refused`` shows that a key of
another kind's section (SFT's data has no ``chosen_key``) is refused, naming the key.

The rows live with their family: ``probes_training`` (sft, reward_model, critic_init and the sections they share),
``probes_ppo`` (critic_warmup and ppo, observed by ``ppo_observers``), ``probes_methods`` (dpo, kto, generate, score)
and ``probes_run`` (run_uri, storage, loop, tracking). The clusters the jobs run on here are in ``fakes``.

Probes that need Ray/DeepSpeed (job runs, worker groups, engines, the PPO roles) are marked slow. The PPO roles run
in this process on a one-rank DeepSpeed world: ``PPOController.start()`` (or the whole ``ppo.run``) on this process as
the cluster (``fakes.in_process``, a ``LocalCluster``), so that what is observed is what the controller
gave each role and what the real role classes built and computed from it. Keys that only act inside a job's loop share
one job run per distinct config (the cache ignores the run directory). The reward sources, the critic-free estimators
and the dynamic filter act on the driver: they are probed fast, on ``PPOController.experience`` with its role groups
answering fixed numbers (``fakes.FixedRole``) and the remote reward servers real loopback ones
(``tests/reward_server.py``).

The dpo, kto, generate and score kinds are probed on their own preset (``harness.METHODS``), mostly without Ray: their
jobs run on this process as the cluster (``fakes.RecordingCluster``) with their worker groups local, the test
session's resources and the rollout engines recorded; a DPO/KTO job's training group is replaced by its first step on
the policy (``fakes.first_step``). The loop keys are probed on the stage graph of ``harness.LOOP``.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import yaml

from rlhf_core import events
from rlhf_core.config import STAGE_KINDS, ConfigError, PipelineConfig, describe, load_config
from rlhf_core.models.builders import build_causal_lm, build_scalar_model, load_tokenizer
from tests.config_keys.fakes import end_one_rank_world
from tests.config_keys.harness import KIND_HOMES, Probe, check, kind_probes
from tests.config_keys.ppo_observers import ROLE_REPORTS, reward_servers
from tests.config_keys.probes_methods import DPO_SECTION, GENERATE_BASE, GENERATE_SECTION, KTO_SECTION, SCORE_SECTION
from tests.config_keys.probes_ppo import PPO_BASE, ppo_section
from tests.config_keys.probes_run import LOOP_SECTION, RUN_LEVEL, TRACKING
from tests.config_keys.probes_training import CRITIC_INIT_SECTION, REWARD_MODEL_SECTION, RM_BASE, SFT_SECTION
from tests.conftest import TINY
from tests.remote_code import add_remote_code

EFFECTS: dict[str, Probe] = {
    **RUN_LEVEL,
    **kind_probes("sft", SFT_SECTION),
    **kind_probes("reward_model", REWARD_MODEL_SECTION, RM_BASE),
    **kind_probes("critic_init", CRITIC_INIT_SECTION),
    **kind_probes("critic_warmup", ppo_section("critic_warmup"), PPO_BASE),
    **kind_probes("ppo", ppo_section("ppo"), PPO_BASE),
    **kind_probes("dpo", DPO_SECTION),
    **kind_probes("kto", KTO_SECTION),
    **kind_probes(
        "generate", {k: dataclasses.replace(p, base=GENERATE_BASE + p.base) for k, p in GENERATE_SECTION.items()}
    ),
    **kind_probes("score", SCORE_SECTION),
    **LOOP_SECTION,
    **TRACKING,
}


# ---------------------------------------------------------------------------------------------------------------------
# Fixtures: a second tokenizer, models with custom code, tiny reward models


def _with_remote_code(model: torch.nn.Module, tokenizer, out: Path, architecture: str) -> str:
    """Save ``model`` as a directory whose config needs its own modelling code (config.json auto_map)."""
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    add_remote_code(out, "keyprobe", architecture)
    return str(out)


@pytest.fixture(scope="session")
def paths(tmp_path_factory) -> Iterator[dict[str, str]]:
    """Fixture files by name (a second tokenizer, models with custom code, tiny reward models), and the URLs of the
    loopback reward servers (``reward_servers``)."""
    root = tmp_path_factory.mktemp("config-keys")
    tokenizer = load_tokenizer("builtin:tiny")
    alt = load_tokenizer("builtin:tiny")
    alt.add_special_tokens({"additional_special_tokens": ["<|probe|>"]})
    alt.save_pretrained(str(root / "alt_tokenizer"))
    out = {"alt_tokenizer": str(root / "alt_tokenizer"), "tmp": str(root)}
    lm = build_causal_lm("builtin:tiny", tokenizer, seed=0, dtype=torch.float32, attn="sdpa")
    out["remote_code_model"] = _with_remote_code(lm, tokenizer, root / "remote_lm", "ProbeForCausalLM")
    for seed in (0, 1):
        rm = build_scalar_model("builtin:tiny", tokenizer, seed=seed, dtype=torch.float32, attn="sdpa")
        rm.config.reward_mean, rm.config.reward_std = 0.5 + seed, 2.0  # as the reward-model stage stores them
        rm.save_pretrained(str(root / f"rm{seed}"))
        tokenizer.save_pretrained(str(root / f"rm{seed}"))
        out[f"rm_seed{seed}"] = str(root / f"rm{seed}")
    rm = build_scalar_model("builtin:tiny", tokenizer, seed=0, dtype=torch.float32, attn="sdpa")
    rm.config.reward_mean, rm.config.reward_std = 0.5, 2.0  # usable as a PPO reward model with normalize_reward
    out["remote_code_rm"] = _with_remote_code(rm, tokenizer, root / "remote_rm", "ProbeForSequenceClassification")
    with reward_servers() as urls:
        yield {**out, **urls}


@pytest.fixture(autouse=True)
def _isolated(monkeypatch, tmp_path):
    for name in (
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_SESSION_TOKEN",
        "AWS_ENDPOINT_URL",
        "AWS_ENDPOINT_URL_S3",
        "AWS_REGION",
        "AWS_DEFAULT_REGION",
        events.EVENTS_ENV,
        "WANDB_API_KEY",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RLHF_WORK_DIR", str(tmp_path / "work"))


# ---------------------------------------------------------------------------------------------------------------------
# Tests


def documented_keys() -> set[str]:
    return {key for key, _, _ in describe(PipelineConfig)}


def test_every_documented_key_has_a_probe():
    documented = documented_keys()
    assert not documented - set(EFFECTS), f"documented keys without a probe: {sorted(documented - set(EFFECTS))}"
    assert not set(EFFECTS) - documented, f"probes of undocumented keys: {sorted(set(EFFECTS) - documented)}"


def test_another_kinds_keys_are_refused(tmp_path):
    """A key that another kind's section has and this kind's does not (SFT's data has no chosen_key, the critic
    warm-up's actor no optimizer) is refused by name, as an override and in a preset: each kind reads exactly the
    keys it documents, and none is silently ignored."""
    documented = documented_keys()
    for kind in STAGE_KINDS:
        home = KIND_HOMES.get(kind, TINY)
        preset = yaml.safe_load(home.read_text())
        own = {key.split(".", 1)[1] for key in documented if key.startswith(f"{kind}.")}
        sections = {rel.split(".")[0] for rel in own if "." in rel}
        foreign = {
            key.split(".", 1)[1]
            for key in documented
            if not key.startswith(f"{kind}.") and key.split(".")[0] in STAGE_KINDS and "." in key.split(".", 1)[1]
        }
        # in one of this kind's sections, absent from it, and not a whole sub-section of one of its keys
        refused_keys = sorted(
            rel for rel in foreign - own if rel.split(".")[0] in sections and not any(o.startswith(rel) for o in own)
        )
        assert refused_keys or kind == "critic_init", kind
        for rel in refused_keys:
            key = f"{kind}.{rel}"  # the home preset's stage of each kind is named after it
            with pytest.raises(ConfigError, match=_refusal(kind, rel, own)):
                load_config(home, [f"run_uri={tmp_path}", f"{key}=1"])
        rel = refused_keys[0] if refused_keys else "model.init_seed"  # critic_init copies a model: no build seed
        edited = json.loads(json.dumps(preset))  # the preset with the key set in the stage's section
        section = edited["stages"][kind]
        *parents, leaf = rel.split(".")
        for part in parents:
            section = section.setdefault(part, {})
        section[leaf] = 1
        path = tmp_path / f"{kind}.yaml"
        path.write_text(yaml.safe_dump(edited))
        with pytest.raises(ConfigError, match=_refusal(kind, rel, own)):
            load_config(path, [f"run_uri={tmp_path}"])


def _refusal(kind: str, rel: str, own: set[str]) -> str:
    """The loader's refusal of ``<kind>.<rel>``: unknown, naming the first part of the key that the kind's keys
    ``own`` do not have, or (a PPO-kind role's model key spelled as DPO's) its new spelling."""
    parts = rel.split(".")
    missing = next(
        (
            p
            for p in (".".join(parts[:i]) for i in range(1, len(parts) + 1))
            if not any(o == p or o.startswith(f"{p}.") for o in own)
        ),
        rel,
    )
    return f"unknown config key '{re.escape(f'{kind}.{missing}')}'|^'{re.escape(f'{kind}.{rel}')}' is now '"


FAST = sorted(k for k, p in EFFECTS.items() if not p.slow)
SLOW = sorted(k for k, p in EFFECTS.items() if p.slow)


@pytest.mark.parametrize("key", FAST)
def test_key_changes_behaviour(key, paths):
    check(key, EFFECTS[key], paths)


@pytest.fixture(scope="module")
def in_process_world():
    """The one-rank DeepSpeed world of the engine reports (``fakes.one_rank_world``, made on first use), ended after
    the module so that later tests find no process group (a LocalCluster ends the world its roles made itself)."""
    yield
    ROLE_REPORTS.clear()
    end_one_rank_world()


@pytest.mark.slow
# make test: every key's probe that needs no run (test_key_changes_behaviour above); the run probes are test-all's
@pytest.mark.extended
@pytest.mark.parametrize("key", SLOW)
def test_key_changes_behaviour_in_a_run(key, paths, ray_cluster, in_process_world):
    check(key, EFFECTS[key], paths)
