"""Probes of the PPO kinds' keys (critic_warmup and ppo): ``RL_PROBES`` for the estimators, the actor-loss options and
the reward sources, and ``ppo_section``, which builds each kind's rows of PPOConfig (observed by ``ppo_observers``).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.config_keys.fakes import RM_RAW
from tests.config_keys.harness import DATA, Probe, close, probe
from tests.config_keys.ppo_observers import (
    actor_sync_plan,
    advantage_phase,
    experience_phase,
    first_prompts,
    frozen_engines,
    held_out_accuracy,
    micro_batches,
    old_logprobs_phase,
    ppo_controller,
    ppo_plan,
    recomputation,
    report_part,
    role_ds_config,
    role_export,
    role_lora,
    role_lr_curve,
    role_model,
    role_workers,
    rollout_distribution,
    rollout_mode,
    rollout_sampling,
    rounded,
    sampling,
    sync_check,
    train_phase,
)
from tests.config_keys.probes_training import (
    checkpoint_steps,
    critic_written,
    logged_steps,
    lora_export_probe,
    lora_probes,
    rollout_staleness,
)

PACKING_FOLLOWERS = {"actor": ("actor", "reward", "reference"), "critic": ("critic",)}
UNPACKED = ("{stage}.actor.strategy.packing=false", "{stage}.critic.strategy.packing=false")  # forwards show rows


def _rows(report: dict, role: str) -> set[int]:
    """The row counts of ``role``'s forwards in a ``micro_batches`` report."""
    return {n for n, _ in report[role]}


def packing_turned_off(roles: tuple[str, ...]) -> Callable[[Any, Any], bool]:
    """Expectation on ``micro_batches``: every forward of ``roles`` packed before and none after; the other roles'
    forwards unchanged."""

    def expect(a: dict, b: dict) -> bool:
        for role in a:
            if role in roles:
                if not (all(p for _, p in a[role]) and not any(p for _, p in b[role])):
                    return False
            elif a[role] != b[role]:
                return False
        return True

    return expect


def _result(*path: str) -> Callable[[Any], Any]:
    """A part of experience_phase's result (None when the controller raised)."""

    def get(observed: dict) -> Any:
        out = observed["result"]
        if isinstance(out, tuple):
            return None
        for part in path:
            out = out[part]
        return out

    return get


def _gold(observed: dict) -> list[float]:
    from tests.reward_server import gold_scores

    out = observed["result"]
    return rounded(gold_scores(out["prompts"], out["texts"]))


PPO_BASE = (
    "{stage}.actor.model.name_or_path=builtin:tiny",
    "{stage}.critic.model.name_or_path={rm_seed0}",
    "{stage}.reward.model.name_or_path={rm_seed0}",
    "{stage}.train.eval_prompts=8",
    "{stage}.data.max_samples=32",
    "{stage}.train.max_steps=null",
)  # 32 prompts / 16 per step = 2 PPO steps
PROMPT_ROWS = f"{DATA / 'prompts.jsonl'}"
PROMPT_SPLITS = f"{DATA / 'prompts_splits'}"
# PROMPT_ROWS' labels when data.label_key = question: each prompt's question
QUESTIONS = {r["prompt"]: r["question"] for r in map(json.loads, Path(PROMPT_ROWS).read_text().splitlines())}
REWARD_FNS = "tests/data/config_keys/reward_fn.py"  # response_length, is_short, label_length
# The real job runs (roles in-process): 24 prompts / 8 per step = 3 PPO steps, checkpoints after steps 1 and 2.
PPO_RUN_BASE = (
    "{stage}.data.max_samples=24",
    "{stage}.train.rollout_batch_size=8",
    "{stage}.train.eval_prompts=0",
    "{stage}.rollout.max_new_tokens=8",
    "{stage}.train.save_steps=1",
    "{stage}.train.keep_last=3",
    "{stage}.train.log_steps=1",
)
PPO_RUN_CHANGE = ("{stage}.train.save_steps=2", "{stage}.train.log_steps=2")
# Models whose init_seed / tokenizer act (built from config: builtin:), and models with custom code.
BUILTIN_BASES = {
    "actor": (),
    "critic": ("{stage}.critic.model.name_or_path=builtin:tiny",),
    "reward": ("{stage}.reward.model.name_or_path=builtin:tiny", "{stage}.algo.normalize_reward=false"),
    "reference": ("{stage}.reference.model.name_or_path=builtin:tiny",),
}
REMOTE_BASES = {
    "actor": "{remote_code_model}",
    "critic": "{remote_code_rm}",
    "reward": "{remote_code_rm}",
    "reference": "{remote_code_model}",
}


def _raised_then(cls_prefix: str) -> Callable[[Any, Any], bool]:
    return lambda a, b: a[0] == "raised" and b["class"].startswith(cls_prefix)


def _advantages_are_returns(observed: dict) -> bool:
    return _result("advantages")(observed) == _result("returns")(observed)


def _shifted_by(a: dict, b: dict, weight: float, source: str) -> bool:
    """b's summed scores are a's with ``source`` weighed by ``weight`` instead of 1 (its own part unchanged)."""
    parts, before, after = _result("parts")(a), _result("scores")(a), _result("scores")(b)
    expected = [s + (weight - 1.0) * x for s, x in zip(before, parts[source])]
    return parts == _result("parts")(b) and all(close(x, y) for x, y in zip(after, expected))


# Rewards by a function (no reward model): the response's length (score and the PPO kinds)
BY_LENGTH = ("{stage}.reward.model=null", "{stage}.reward_fn=tests/data/config_keys/reward_fn.py:response_length")
# The server that answers HTTP 503 to every request, tried three times without pauses
FAILING_SERVER = (
    "{stage}.remote_rm_url={failing_url}",
    "{stage}.remote_rm.retries=2",
    "{stage}.remote_rm.backoff_s=0",
)
# The KL term in the actor's loss, to a reference other than the actor's starting model (else it is 0 at step 0)
KL_LOSS = (
    "{stage}.algo.kl_mode=loss",
    "{stage}.reference.model.name_or_path=builtin:tiny",
    "{stage}.reference.model.init_seed=1",
)

# The held-out accuracy (greedy) and pass@k, judged by the stage's reward_fn (the response's length) unless
# eval_reward_fn names another judge: 8 held-out prompts, answered by fakes.FixedEngines with 3, 2, 2, 3, 2, 2, 3, 2
# characters (greedy), every third sample of 3.
JUDGE = (f"{{stage}}.reward_fn={REWARD_FNS}:response_length",)
GREEDY = (*JUDGE, "{stage}.train.eval_greedy=true")


def _accuracy(observed: dict) -> float:
    return observed["metrics"]["accuracy_greedy"]


EVAL_PROBES: dict[str, Probe] = {
    "train.eval_greedy": probe(  # every answer scores at least 1: all correct
        "{stage}.train.eval_greedy=true",
        observe=held_out_accuracy,
        base=JUDGE,
        expect=lambda a, b: (
            a == {"metrics": {}, "judge": None, "sampling": []}
            and b["sampling"] == [(1, 0.0)]
            and (_accuracy(b), b["metrics"]["eval_rows"]) == (1.0, 8.0)
        ),
    ),
    "train.eval_pass_k": probe(  # 4 answers per prompt at the rollout temperature
        "{stage}.train.eval_pass_k=4",
        observe=held_out_accuracy,
        base=JUDGE,
        expect=lambda a, b: a["metrics"] == {} and b["sampling"] == [(4, 1.0)] and b["metrics"]["pass_at_4"] == 1.0,
    ),
    "train.eval_reward_fn": probe(  # 5 of the 8 greedy answers are short
        f"{{stage}}.train.eval_reward_fn={REWARD_FNS}:is_short",
        observe=held_out_accuracy,
        base=GREEDY,
        expect=lambda a, b: (
            (a["judge"], b["judge"]) == (f"{REWARD_FNS}:response_length", f"{REWARD_FNS}:is_short")
            and (_accuracy(a), _accuracy(b)) == (1.0, 0.625)
        ),
    ),
    "train.eval_correct_at": probe(  # 3 of the 8 greedy answers have 3 characters
        "{stage}.train.eval_correct_at=3",
        observe=held_out_accuracy,
        base=GREEDY,
        expect=lambda a, b: (_accuracy(a), _accuracy(b)) == (1.0, 0.375),
    ),
    "train.sync_check_tolerance": probe(  # the gaps 2e-6, 0.01 and 0.3: the second now passes
        "{stage}.train.sync_check_tolerance=0.1",
        observe=sync_check,
        expect=lambda a, b: a == [None, *[("raised", "RuntimeError")] * 2] and b == [None, None, a[2]],
    ),
}

# The estimators, the actor-loss options and the reward sources (the kinds' StageKind.unused filters them): fast on
# experience_phase / advantage_phase, slow where they act in PolicyActor.fit (train_phase on the in-process roles).
RL_PROBES: dict[str, Probe] = {
    "algo.advantage_estimator": probe(  # critic-free: the advantage is the return of the group-normalised score
        "{stage}.algo.advantage_estimator=grpo",
        "{stage}.critic.model=null",
        observe=experience_phase,
        expect=lambda a, b: not _advantages_are_returns(a) and _advantages_are_returns(b),
    ),
    "algo.dynamic_filter": probe(  # the second prompt's samples score alike (RM_RAW): dropped
        "{stage}.algo.dynamic_filter=true",
        observe=experience_phase,
        expect=lambda a, b: (
            "filtered_frac" not in _result("logs")(a)
            and _result("logs")(b)["filtered_frac"] == 0.5
            and _result("action_tokens")(b)[2:] == [0, 0]
            and _result("action_tokens")(a)[2:] != [0, 0]
        ),
    ),
    "algo.kl_mode": probe("{stage}.algo.kl_mode=loss", observe=advantage_phase),  # no KL penalty in the rewards
    "algo.kl_loss_unbiased": probe(  # the KL term weighed by pi / pi_old (the old log-probs are 0.5 below)
        "{stage}.algo.kl_loss_unbiased=true",
        observe=train_phase,
        base=KL_LOSS,
        slow=True,
        expect=lambda a, b: a["kl_loss"] != b["kl_loss"],
    ),
    "algo.eps_clip_high": probe(  # the ratio starts at e^0.5 = 1.65: clipped at 1.2, not at 1.8
        "{stage}.algo.eps_clip_high=0.8",
        observe=train_phase,
        slow=True,
        expect=lambda a, b: b["clip_frac"] < a["clip_frac"],
    ),
    "algo.dual_clip": probe(
        "{stage}.algo.dual_clip=1.1",
        observe=train_phase,
        slow=True,
        expect=lambda a, b: a["dual_clip_frac"] == 0 < b["dual_clip_frac"],
    ),
    "algo.loss_agg": probe(  # responses of 2 to 7 tokens: each sequence weighs the same instead of each token
        "{stage}.algo.loss_agg=seq_mean",
        observe=train_phase,
        slow=True,
        expect=lambda a, b: a["policy_loss"] != b["policy_loss"],
    ),
    "algo.entropy_coef": probe(
        "{stage}.algo.entropy_coef=0.01",
        observe=train_phase,
        slow=True,
        expect=lambda a, b: "entropy" not in a and b["entropy"] > 0,
    ),
    "algo.is_correction_cap": probe(  # the engines' log-probs are 0.5 above the old ones: weights e^-0.5
        "{stage}.algo.is_correction_cap=2.0",
        observe=train_phase,
        slow=True,
        expect=lambda a, b: a["policy_loss"] != b["policy_loss"],
    ),
    "algo.is_correction": probe(  # r = e^-0.5 = 0.61 on every token, inside tis's [0.5, 5]: each loss x 0.61
        "{stage}.algo.is_correction=tis",
        observe=train_phase,
        slow=True,
        expect=lambda a, b: a["policy_loss"] != b["policy_loss"],
    ),
    "algo.use_rollout_logprobs": probe(  # tiny: 2 optimizer steps per batch; the engines 0.05 above the actor
        "{stage}.algo.use_rollout_logprobs=true",
        observe=old_logprobs_phase,
        expect=lambda a, b: a["logs"]["old_logprobs_engine"] == 0 and b["logs"]["old_logprobs_engine"] == 1,
    ),
    "algo.rollout_logprobs_max_diff": probe(  # the probed gap 0.05 is above 0.01: the step falls back
        "{stage}.algo.rollout_logprobs_max_diff=0.01",
        observe=old_logprobs_phase,
        base=("{stage}.algo.use_rollout_logprobs=true",),
        expect=lambda a, b: a["logs"]["old_logprobs_engine"] == 1 and b["logs"]["old_logprobs_engine"] == 0,
    ),
    "algo.is_correction_threshold": probe(  # icepop: r = 0.61 is inside [0.5, 5] and outside [0.7, 5]: all dropped
        "{stage}.algo.is_correction_threshold=[0.7,5.0]",
        observe=train_phase,
        base=("{stage}.algo.is_correction=icepop",),
        slow=True,
        expect=lambda a, b: b["policy_loss"] == 0 != a["policy_loss"],
    ),
    "algo.policy_loss": probe(  # every token's log-ratio is 0.5, so GSPO's loss equals PPO's here: its seq_ratio
        "{stage}.algo.policy_loss=gspo",
        observe=train_phase,
        base=("{stage}.algo.loss_agg=seq_mean",),
        slow=True,
        expect=lambda a, b: "seq_ratio" not in a and b["seq_ratio"] > 1.2,
    ),
    "reward_fn": probe(  # instead of the reward model: the response's length
        *BY_LENGTH,
        observe=experience_phase,
        expect=lambda a, b: (
            _result("parts")(b) == {"reward_fn": [float(len(t)) for t in _result("texts")(b)]}
            and "reward_fn_score" in _result("logs")(b)
            and "rm_score" not in _result("logs")(b)
        ),
    ),
    "remote_rm_url": probe(  # the server's gold scores added; its requests: the check, then the batch
        "{stage}.remote_rm_url={reward_url}",
        observe=experience_phase,
        expect=lambda a, b: _result("parts", "remote_rm_url")(b) == _gold(b) and b["rows"] == [1, 4],
    ),
    "remote_rm.batch_size": probe(
        "{stage}.remote_rm.batch_size=1",
        observe=experience_phase,
        base=("{stage}.remote_rm_url={reward_url}",),
        expect=lambda a, b: (a["rows"], b["rows"]) == ([1, 4], [1, 1, 1, 1, 1]) and a["result"] == b["result"],
    ),
    "remote_rm.retries": probe(  # HTTP 503 to every request: tried once, then three times
        "{stage}.remote_rm.retries=2",
        observe=experience_phase,
        base=(*FAILING_SERVER, "{stage}.remote_rm.retries=0"),
        expect=lambda a, b: (
            (a["requests"], b["requests"]) == (1, 3) and a["result"] == b["result"] == ("raised", "RemoteRewardError")
        ),
    ),
    "remote_rm.backoff_s": probe(  # the third try after 2 x 0.5 s
        "{stage}.remote_rm.backoff_s=0.5",
        observe=experience_phase,
        base=FAILING_SERVER,
        expect=lambda a, b: (
            (a["requests"], b["requests"]) == (3, 3) and (a["backed_off"], b["backed_off"]) == (False, True)
        ),
    ),
    "remote_rm.timeout_s": probe(  # the server answers after 0.4 s
        "{stage}.remote_rm.timeout_s=0.1",
        observe=experience_phase,
        base=("{stage}.remote_rm_url={slow_url}", "{stage}.remote_rm.retries=0"),
        expect=lambda a, b: isinstance(a["result"], dict) and b["result"] == ("raised", "RemoteRewardError"),
    ),
    "reward_weights": probe(  # reward model + length; the length at half weight
        "{stage}.reward_weights={{reward_fn: 0.5}}",
        observe=experience_phase,
        base=(BY_LENGTH[1],),
        expect=lambda a, b: _shifted_by(a, b, 0.5, "reward_fn"),
    ),
}


def ppo_section(kind: str) -> dict[str, Probe]:
    trains_actor = kind == "ppo"  # critic_warmup: the actor never trains (no actor.optim, save_critic, freezing)
    on_splits = (
        f"{{stage}}.data.train_path={PROMPT_SPLITS}",
        f"{{stage}}.data.eval_path={PROMPT_SPLITS}",
        "{stage}.train.rollout_batch_size=4",
        "{stage}.train.train_batch_size=8",
        "{stage}.train.micro_train_batch_size=8",
        "{stage}.train.micro_rollout_batch_size=8",
    )
    out: dict[str, Probe] = {
        "data.train_path": probe(
            f"{{stage}}.data.train_path={PROMPT_SPLITS}/train.jsonl", observe=ppo_controller, base=on_splits[1:]
        ),
        "data.eval_path": probe(f"{{stage}}.data.eval_path={PROMPT_ROWS}", observe=ppo_controller),
        "data.train_split": probe("{stage}.data.train_split=dev", observe=ppo_controller, base=on_splits),
        "data.eval_split": probe("{stage}.data.eval_split=dev", observe=ppo_controller, base=on_splits),
        "data.max_len": probe("{stage}.data.max_len=12", observe=ppo_controller),
        "data.max_samples": probe("{stage}.data.max_samples=16", observe=ppo_controller),
        "data.input_template": probe("{stage}.data.input_template='Q: {{}} A:'", observe=ppo_controller),
        "data.prompt_template": probe("{stage}.data.prompt_template='Q: {{}} A:'", observe=ppo_controller),
        "data.apply_chat_template": probe("{stage}.data.apply_chat_template=false", observe=ppo_controller),
        "data.input_key": probe("{stage}.data.input_key=question", observe=ppo_controller, base=on_splits),
        "data.label_key": probe(  # each prompt's question reaches the reward function as its label
            "{stage}.data.label_key=question",
            observe=experience_phase,
            base=(
                f"{{stage}}.data.train_path={PROMPT_ROWS}",
                f"{{stage}}.data.eval_path={PROMPT_ROWS}",
                *on_splits[2:],
                "{stage}.reward.model=null",
                f"{{stage}}.reward_fn={REWARD_FNS}:label_length",
            ),
            expect=lambda a, b: (
                _result("parts")(a) == {"reward_fn": [0.0] * 4}
                and _result("parts")(b) == {"reward_fn": [float(len(QUESTIONS[q])) for q in _result("prompts")(b)]}
            ),
        ),
    }
    for role in ("actor", "critic") if trains_actor else ("critic",):  # the trained roles' adapters
        out |= lora_probes(f"{role}.model", role_lora(role), base=BUILTIN_BASES[role])
        out |= lora_export_probe(f"{role}.model", role_export(role), base=BUILTIN_BASES[role])
        stat = "aux_loss" if role == "actor" else "critic_aux_loss"
        out[f"{role}.model.aux_loss_coef"] = probe(  # an MoE model's load-balancing loss joins the role's loss
            f"{{stage}}.{role}.model.aux_loss_coef=0.5",
            observe=train_phase,
            base=(f"{{stage}}.{role}.model.name_or_path=builtin:tiny-moe",),
            slow=True,
            expect=lambda a, b, stat=stat: stat not in a and b[stat] > 0,
        )
    for role in ("actor", "critic", "reward", "reference"):
        path = "builtin:small" if role == "actor" else "{rm_seed1}"
        out[f"{role}.model.name_or_path"] = probe(
            f"{{stage}}.{role}.model.name_or_path={path}", observe=ppo_controller
        )
        out[f"{role}.model.tokenizer"] = probe(
            f"{{stage}}.{role}.model.tokenizer={{alt_tokenizer}}",
            observe=ppo_controller if role == "actor" else role_model(role),
            base=BUILTIN_BASES[role],
            slow=role != "actor",
            expect=None if role == "actor" else lambda a, b: b["vocab"] == a["vocab"] + 1,
        )
        out[f"{role}.model.init_seed"] = probe(
            f"{{stage}}.{role}.model.init_seed=1",
            observe=role_model(role),
            base=BUILTIN_BASES[role],
            slow=True,
            expect=lambda a, b: a["checksum"] != b["checksum"],
        )
        out[f"{role}.model.trust_remote_code"] = probe(
            f"{{stage}}.{role}.model.trust_remote_code=true",
            observe=role_model(role),
            base=(f"{{stage}}.{role}.model.name_or_path={REMOTE_BASES[role]}",),
            slow=True,
            expect=_raised_then("Probe"),
        )
    out["reference.model.name_or_path"] = probe(
        "{stage}.reference.model.name_or_path=builtin:small", observe=ppo_controller
    )
    for role in ("actor", "critic"):
        ds = role_ds_config(role)
        s = f"{{stage}}.{role}.strategy"
        out |= {
            f"{role}.strategy.num_workers": probe(
                f"{s}.num_workers=2", "{stage}.train.micro_train_batch_size=8", observe=ppo_plan
            ),
            f"{role}.strategy.zero_stage": probe(f"{s}.zero_stage=3", observe=ds),
            f"{role}.strategy.offload_optimizer": probe(f"{s}.offload_optimizer=true", observe=ds),
            f"{role}.strategy.precision": probe(f"{s}.precision=bf16", observe=ds),
            f"{role}.strategy.gradient_checkpointing": probe(
                f"{s}.gradient_checkpointing=true",
                observe=recomputation(role),
                slow=True,
                expect=lambda a, b: a > 0 and b == 2 * a,
            ),
            f"{role}.strategy.attn_implementation": probe(
                f"{s}.attn_implementation=eager",
                observe=role_model(role),
                slow=True,
                expect=lambda a, b: (a["attn"], b["attn"]) == ("sdpa", "eager"),
            ),
            f"{role}.strategy.cpus_per_worker": probe(f"{s}.cpus_per_worker=2.0", observe=ppo_plan),
            # the actor's flag also sets the frozen reward and reference models' packing
            f"{role}.strategy.packing": probe(
                f"{s}.packing=false",
                observe=micro_batches,
                slow=True,
                expect=packing_turned_off(PACKING_FOLLOWERS[role]),
            ),
            f"{role}.strategy.resources": probe(
                f"{s}.resources={{{{node_a: 1}}}}", observe=ppo_plan, expect=lambda a, b: b["cpu"]["node_a"] == 1
            ),
            f"{role}.strategy.threads_per_worker": probe(
                f"{s}.threads_per_worker=2",
                observe=role_workers(role),
                slow=True,
                expect=lambda a, b: b[0]["torch_threads"] == 2,
            ),
        }
        if role == "actor":  # the controller's device (resources, engines), also what the actor group gets
            out[f"{role}.strategy.device"] = probe(f"{s}.device=cuda", observe=ppo_controller)
        else:
            device = report_part("devices", role, doc=f"The device start() gave the {role} group's ranks.")
            out[f"{role}.strategy.device"] = probe(
                f"{s}.device=cuda", observe=device, slow=True, expect=lambda a, b: (a, b) == ("cpu", "cuda")
            )
        if role == "actor" and not trains_actor:
            continue
        o = f"{{stage}}.{role}.optim"
        curve = role_lr_curve(role)
        out |= {
            f"{role}.optim.lr": probe(
                f"{o}.lr=0.25", observe=role_model(role), slow=True, expect=lambda a, b: b["lr"] == 0.25
            ),
            f"{role}.optim.weight_decay": probe(
                f"{o}.weight_decay=0.1",
                observe=role_model(role),
                slow=True,
                expect=lambda a, b: b["weight_decay"] == 0.1,
            ),
            f"{role}.optim.adam_betas": probe(
                f"{o}.adam_betas=[0.8,0.9]",
                observe=role_model(role),
                slow=True,
                expect=lambda a, b: b["betas"] == [0.8, 0.9],
            ),
            f"{role}.optim.lr_scheduler": probe(f"{o}.lr_scheduler=cosine_with_min_lr", observe=curve),
            f"{role}.optim.lr_warmup_ratio": probe(f"{o}.lr_warmup_ratio=0.5", observe=curve),
            f"{role}.optim.min_lr_ratio": probe(
                f"{o}.min_lr_ratio=0.5",
                f"{o}.lr_scheduler=cosine_with_min_lr",
                observe=curve,
                base=(f"{o}.lr_scheduler=cosine_with_min_lr",),
            ),
            f"{role}.optim.max_norm": probe(f"{o}.max_norm=0.5", observe=ds),
        }
    out |= {
        "reward.workers": probe("{stage}.reward.workers=2", observe=ppo_plan),
        "reference.workers": probe("{stage}.reference.workers=2", observe=ppo_plan),
        "frozen.cpus_per_worker": probe("{stage}.frozen.cpus_per_worker=1.0", observe=ppo_plan),
        "frozen.zero_stage": probe(
            "{stage}.frozen.zero_stage=3",
            observe=frozen_engines,
            slow=True,
            expect=lambda a, b: a["reward"] is None and b["reward"]["zero_optimization"]["stage"] == 3,
        ),
        "frozen.offload": probe(
            "{stage}.frozen.offload=true",
            observe=frozen_engines,
            base=("{stage}.frozen.zero_stage=3",),
            slow=True,
            expect=lambda a, b: (
                "offload_param" not in a["reward"]["zero_optimization"]
                and b["reward"]["zero_optimization"]["offload_param"]["device"] == "cpu"
            ),
        ),
        "reward.resources": probe(
            "{stage}.reward.resources={{node_b: 1}}", observe=ppo_plan, expect=lambda a, b: b["cpu"]["node_b"] == 1
        ),
        "reference.resources": probe(
            "{stage}.reference.resources={{node_b: 1}}", observe=ppo_plan, expect=lambda a, b: b["cpu"]["node_b"] == 1
        ),
        "placement.offload_states_during_rollout": probe(  # DeepSpeed offloads optimizer states of ZeRO 1-3 only
            "{stage}.placement.offload_states_during_rollout=true",
            observe=ppo_plan,
            base=("{stage}.critic.strategy.zero_stage=0",),
            expect=lambda a, b: a["fits_cpu"] is None and b["fits_cpu"] == ("raised", "ConfigError"),
        ),
        "placement.colocate_actor_ref": probe("{stage}.placement.colocate_actor_ref=true", observe=ppo_plan),
        "placement.colocate_critic_reward": probe("{stage}.placement.colocate_critic_reward=true", observe=ppo_plan),
        "placement.colocate_all": probe("{stage}.placement.colocate_all=true", observe=ppo_plan),
        "rollout.backend": probe("{stage}.rollout.backend=vllm", observe=ppo_controller),
        "rollout.num_engines": probe("{stage}.rollout.num_engines=2", observe=ppo_plan),
        "rollout.tensor_parallel_size": probe(
            "{stage}.rollout.tensor_parallel_size=2", observe=ppo_plan, base=("{stage}.rollout.backend=vllm",)
        ),
        "rollout.cpus_per_engine": probe("{stage}.rollout.cpus_per_engine=2.0", observe=ppo_plan),
        "rollout.weight_sync_backend": probe(
            "{stage}.rollout.weight_sync_backend=gloo",
            observe=ppo_plan,
            expect=lambda a, b: (
                (a["weight_sync"], b["weight_sync"])
                == ({"cpu": "gloo", "cuda": "nccl"}, {"cpu": "gloo", "cuda": "gloo"})
            ),
        ),
        "rollout.weight_sync_bucket_mb": probe(  # builtin:small is 4.3 MiB of fp32 weights
            "{stage}.rollout.weight_sync_bucket_mb=1",
            observe=actor_sync_plan,
            base=("{stage}.actor.model.name_or_path=builtin:small",),
            slow=True,
            expect=lambda a, b: len(a) == 1 and len(b) == 5,
        ),
        "rollout.resources": probe(
            "{stage}.rollout.resources={{node_a: 1}}", observe=ppo_plan, expect=lambda a, b: b["cpu"]["node_a"] == 1
        ),
        "rollout.gpu_memory_utilization": probe(
            "{stage}.rollout.gpu_memory_utilization=0.4",
            observe=ppo_controller,
            base=("{stage}.rollout.backend=vllm",),
            expect=lambda a, b: b["engine_kwargs"]["gpu_memory_utilization"] == 0.4,
        ),
        "rollout.enforce_eager": probe(  # null: eager on the CPU build; false: CUDA graphs wherever vLLM has them
            "{stage}.rollout.enforce_eager=false",
            observe=ppo_controller,
            base=("{stage}.rollout.backend=vllm",),
            expect=lambda a, b: (
                (a["engine_kwargs"]["enforce_eager"], b["engine_kwargs"]["enforce_eager"]) == (True, False)
            ),
        ),
        "rollout.enable_sleep": probe(  # vLLM's sleep mode needs CUDA: refused on this CPU machine, before Ray
            "{stage}.rollout.enable_sleep=true",
            observe=ppo_plan,
            base=("{stage}.rollout.backend=vllm",),
            expect=lambda a, b: a["fits_cpu"] is None and b["fits_cpu"] == ("raised", "ConfigError"),
        ),
        "rollout.kv_cache_gib": probe(
            "{stage}.rollout.kv_cache_gib=2", observe=ppo_controller, base=("{stage}.rollout.backend=vllm",)
        ),
        "rollout.n_samples_per_prompt": probe("{stage}.rollout.n_samples_per_prompt=4", observe=ppo_plan),
        "rollout.temperature": probe(
            "{stage}.rollout.temperature=0.5",
            observe=rollout_distribution,
            slow=True,
            expect=lambda a, b: a["logprobs"] != b["logprobs"] and a["evaluate"] != b["evaluate"],
        ),
        "rollout.top_p": probe("{stage}.rollout.top_p=0.5", observe=sampling, slow=True),
        "rollout.seed_per_prompt": probe(  # null on this CPU machine: per prompt
            "{stage}.rollout.seed_per_prompt=false",
            observe=rollout_sampling,
            expect=lambda a, b: (a["seed_per_prompt"], b["seed_per_prompt"]) == (True, False),
        ),
        "rollout.max_new_tokens": probe(
            "{stage}.rollout.max_new_tokens=8", observe=ppo_controller, base=("{stage}.rollout.backend=vllm",)
        ),
        "algo.kl_coef": probe("{stage}.algo.kl_coef=0.5", observe=advantage_phase),
        "algo.kl_estimator": probe("{stage}.algo.kl_estimator=k3", observe=advantage_phase),
        "algo.kl_target": probe("{stage}.algo.kl_target=0.1", observe=advantage_phase),
        "algo.kl_horizon": probe(
            "{stage}.algo.kl_horizon=100", observe=advantage_phase, base=("{stage}.algo.kl_target=0.1",)
        ),
        "algo.gamma": probe("{stage}.algo.gamma=0.5", observe=advantage_phase),
        "algo.lam": probe("{stage}.algo.lam=0.5", observe=advantage_phase),
        "algo.eps_clip": probe("{stage}.algo.eps_clip=0.1", observe=train_phase, slow=True),
        "algo.value_clip": probe("{stage}.algo.value_clip=0.1", observe=train_phase, slow=True),
        "algo.normalize_reward": probe(  # the reward model's part of the rewards: raw instead of normalised
            "{stage}.algo.normalize_reward=false",
            observe=experience_phase,
            expect=lambda a, b: _result("scores")(b) == list(RM_RAW) != _result("scores")(a),
        ),
        "algo.reward_clip": probe("{stage}.algo.reward_clip=[-1.0,1.0]", observe=advantage_phase),
        "algo.missing_eos_penalty": probe("{stage}.algo.missing_eos_penalty=-1.0", observe=advantage_phase),
        "algo.whiten_advantages": probe("{stage}.algo.whiten_advantages=false", observe=train_phase, slow=True),
        "algo.ppo_epochs": probe("{stage}.algo.ppo_epochs=2", observe=ppo_plan),
        **RL_PROBES,
        "train.rollout_batch_size": probe("{stage}.train.rollout_batch_size=32", observe=ppo_controller),
        "train.train_batch_size": probe("{stage}.train.train_batch_size=8", observe=ppo_plan),
        "train.micro_train_batch_size": probe(
            "{stage}.train.micro_train_batch_size=4", observe=role_ds_config("actor")
        ),
        "train.micro_rollout_batch_size": probe(
            "{stage}.train.micro_rollout_batch_size=4",
            observe=micro_batches,
            slow=True,
            base=("{stage}.actor.strategy.packing=false", "{stage}.critic.strategy.packing=false"),
            expect=lambda a, b: all({n for n, _ in calls} == {4} for calls in b.values()),
        ),
        "train.dynamic_batch": probe(  # the default budget holds all 16 rows: one forward each, not 8 + 8
            "{stage}.train.dynamic_batch=true",
            observe=micro_batches,
            slow=True,
            base=UNPACKED,
            expect=lambda a, b: _rows(b, "actor") == _rows(b, "critic") == {16} != _rows(a, "actor"),
        ),
        "train.max_tokens_per_micro_batch": probe(  # a budget of a few rows: more, smaller forwards
            "{stage}.train.max_tokens_per_micro_batch=40",
            observe=micro_batches,
            slow=True,
            base=(*UNPACKED, "{stage}.train.dynamic_batch=true"),
            expect=lambda a, b: _rows(a, "actor") == {16} and max(_rows(b, "actor")) < 16,
        ),
        "train.num_episodes": probe("{stage}.train.num_episodes=2", observe=ppo_controller),
        "train.max_steps": probe("{stage}.train.max_steps=1", observe=ppo_controller),
        "train.seed": probe("{stage}.train.seed=7", observe=first_prompts),
        "train.save_steps": probe(
            *PPO_RUN_CHANGE,
            observe=checkpoint_steps,
            base=PPO_RUN_BASE,
            slow=True,
            expect=lambda a, b: (a, b) == ([1, 2], [2]),
        ),
        "train.keep_last": probe(
            "{stage}.train.keep_last=1",
            observe=checkpoint_steps,
            base=PPO_RUN_BASE,
            slow=True,
            expect=lambda a, b: (a, b) == ([1, 2], [2]),
        ),
        "train.log_steps": probe(
            *PPO_RUN_CHANGE,
            observe=logged_steps,
            base=PPO_RUN_BASE,
            slow=True,
            expect=lambda a, b: (a, b) == ([1, 2, 3], [2, 3]),
        ),
        "train.eval_prompts": probe("{stage}.train.eval_prompts=4", observe=ppo_controller),
        "train.gold_reward": probe("{stage}.train.gold_reward=null", observe=ppo_controller),
        **EVAL_PROBES,
    }
    if trains_actor:
        out["train.freeze_actor_steps"] = probe("{stage}.train.freeze_actor_steps=1", observe=ppo_controller)
        out["train.save_critic"] = probe(
            *PPO_RUN_CHANGE,
            "{stage}.train.save_critic=false",
            observe=critic_written,
            base=PPO_RUN_BASE,
            slow=True,
            expect=lambda a, b: (a, b) == (True, False),
        )
        # The fake engines answer at once, so the generator thread runs as far ahead as the queue lets it.
        out["train.async_enable"] = probe(
            "{stage}.train.async_enable=true",
            observe=rollout_staleness,
            base=PPO_RUN_BASE,
            slow=True,
            expect=lambda a, b: (a, b) == ([None] * 3, [0, 1, 1]),
        )
        out["train.async_queue_size"] = probe(
            "{stage}.train.async_queue_size=2",
            observe=rollout_staleness,
            base=(*PPO_RUN_BASE, "{stage}.train.async_enable=true"),
            slow=True,
            expect=lambda a, b: (a, b) == ([0, 1, 1], [0, 1, 2]),
        )
        out["train.partial_rollout_enable"] = probe(
            "{stage}.train.partial_rollout_enable=true",
            observe=rollout_mode,
            base=("{stage}.train.async_enable=true", "{stage}.rollout.backend=vllm"),
            expect=lambda a, b: (a, b) == ("async", "partial"),
        )
        # the same run as save_steps / log_steps: one run for the three
        for key in ("train.save_steps", "train.log_steps"):
            out[key] = dataclasses.replace(out[key], change=out["train.save_critic"].change)
    return out
