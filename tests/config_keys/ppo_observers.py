"""Observers of the PPO kinds (critic_warmup and ppo share PPOConfig).

Fast ones: the controller as ppo.run builds it, its advantage phase, its experience phase with the role groups
answering fixed numbers (``fakes.FixedRole``) and the remote reward servers real loopback ones
(``tests/reward_server.py``), and the plan it asks of Ray. Slow ones: the roles started on this process as the
cluster (``fakes.in_process``), what each built and each phase on fixed sequences (``ppo_roles``, once per distinct
config).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from typing import Any

import torch

from rlhf_core.algos.batching import make_sequences
from rlhf_core.config import PipelineConfig, TrainConfig, as_ppo
from rlhf_core.data.sampler import global_batch
from rlhf_core.distributed.device import resolve_device
from rlhf_core.distributed.strategy import DeepSpeedStrategy, lr_lambda
from rlhf_core.jobs import stage_setup
from tests.config_keys.fakes import FixedEngines, FixedRole, in_process
from tests.config_keys.harness import content_key, fingerprint, forward_record, lora_report, outcome
from tests.config_keys.probes_training import engine_state, group_report

# ---------------------------------------------------------------------------------------------------------------------
# The controller's set-up and its advantage phase, in-process


def _ppo_setup(cfg: PipelineConfig, stage: str):
    """The controller as ppo.run builds it (the same models fetched and inputs read), on this process as the cluster
    (``fakes.in_process``)."""
    from rlhf_core.config import as_ppo
    from rlhf_core.distributed.placement import RoleSet, role_models
    from rlhf_core.jobs.ppo.controller import PPOController, load_inputs

    p, train_actor = as_ppo(cfg.stage(stage)), cfg.kind(stage) == "ppo"
    roles = RoleSet.of(p, train_actor)
    setup = stage_setup.setup_stage(cfg, stage, role_models(p, roles))
    return PPOController(stage, p, setup, train_actor, roles, load_inputs(stage, p, setup), in_process())


def rollout_mode(cfg: PipelineConfig, stage: str) -> str:
    """How the controller's loop gets its rollouts: generated in the step ("sync"), by the generator thread a whole
    batch at a time ("async"), or in turns that weight syncs may come between ("partial")."""
    rollout = _ppo_setup(cfg, stage).async_rollout()
    return "sync" if rollout is None else "partial" if rollout.partial else "async"


def ppo_controller(cfg: PipelineConfig, stage: str) -> Any:
    """jobs.ppo.controller.PPOController(...) as run() builds it before any Ray actor: prompts, plan, reward stats,
    gold, KL, and the engines' kwargs as start() passes them."""
    from rlhf_core.distributed.placement import engine_kwargs

    def build():
        c = _ppo_setup(cfg, stage)
        p = c.p
        device = c.cluster.device(p.actor.strategy.device)  # as start() decides it, once the cluster is up
        engines = engine_kwargs(
            p.rollout,
            p.actor.model,
            p.actor.strategy.precision,
            device,
            p.train.seed,
            p.data.max_len,
            enable_sleep=p.rollout.enable_sleep,
        )
        return {
            "prompts": [e["prompt_ids"] for e in c.prompts],
            "eval_prompts": c.held_out.prompt_ids,
            "steps": c.steps,
            "actor_ppo_steps": c.actor_ppo_steps,
            "stats": c.rewards.stats,
            "gold": getattr(c.held_out.gold, "__name__", None),
            "kl_coef": c.kl_ctl.value,
            "device": device,
            "vocab": len(c.tokenizer),
            "engine_kwargs": engines,
            "paths": c.paths,
        }

    return outcome(build)


def role_lora(role: str):
    """The LoRA adapters of the model the trained role ``role`` builds from the context start() gives it
    (``PPOController.role_context``), without starting anything."""
    from rlhf_core.distributed.actor import PolicyActor
    from rlhf_core.distributed.critic import CriticActor
    from rlhf_core.distributed.node_files import local_model_path
    from rlhf_core.models.builders import load_tokenizer

    def observe(cfg: PipelineConfig, stage: str) -> Any:
        def build():
            ctx = _ppo_setup(cfg, stage).role_context(role)
            ctx = dataclasses.replace(ctx, model_path=local_model_path(ctx.model_path))
            tokenizer = load_tokenizer(ctx.model_path, ctx.tokenizer_path)
            obj = (PolicyActor if role == "actor" else CriticActor)(ctx)
            return lora_report(obj.build_model(tokenizer, torch.float32, "sdpa"))

        return outcome(build)

    observe.__name__ = f"{role}_lora"
    return observe


def role_export(role: str):
    """The files of the trained role's output as its export writes them (``TrainableRole.export``: ``export_hf``
    with the context's ``adapter_record``) for the model it builds (``role_lora``'s path)."""
    from rlhf_core.distributed.actor import PolicyActor
    from rlhf_core.distributed.critic import CriticActor
    from rlhf_core.distributed.node_files import local_model_path
    from rlhf_core.models.builders import load_tokenizer
    from tests.config_keys.probes_training import export_files

    def observe(cfg: PipelineConfig, stage: str) -> Any:
        def build():
            ctx = _ppo_setup(cfg, stage).role_context(role)
            ctx = dataclasses.replace(ctx, model_source=ctx.model_path, model_path=local_model_path(ctx.model_path))
            tokenizer = load_tokenizer(ctx.model_path, ctx.tokenizer_path)
            obj = (PolicyActor if role == "actor" else CriticActor)(ctx)
            return export_files(obj.build_model(tokenizer, torch.float32, "sdpa"), tokenizer, ctx)

        return outcome(build)

    observe.__name__ = f"{role}_export"
    return observe


def rollout_sampling(cfg: PipelineConfig, stage: str) -> Any:
    """PPOController.rollout_sampling(0): how fit() samples step 0's rollout, on the device start() decides."""

    def build():
        c = _ppo_setup(cfg, stage)
        c.device = c.cluster.device(c.p.actor.strategy.device)
        return dataclasses.asdict(c.rollout_sampling(0))

    return outcome(build)


def fixed_experience(pad_id: int, eos_id: int):
    """Two hand-made rollouts (one closed by EOS, one cut without it) with fixed log-probs, values and scores."""
    from rlhf_core.algos.batching import ensure_eos, make_sequences
    from rlhf_core.algos.experience import Experience

    prompts, responses = [[1, 5, 6], [1, 7]], [[8, 9, eos_id], [10, 11, 12]]
    seq = make_sequences(prompts, responses, pad_id)
    _, truncated = ensure_eos(responses, eos_id)
    shape = seq.action_mask.shape
    gen = torch.Generator().manual_seed(0)
    return Experience.from_sequences(
        seq,
        old_logprobs=-torch.rand(shape, generator=gen),
        ref_logprobs=-torch.rand(shape, generator=gen),
        values=torch.rand(shape, generator=gen),
        scores=torch.tensor([2.0, 3.0]),
        truncated=truncated,
    )


def advantage_phase(cfg: PipelineConfig, stage: str) -> Any:
    """jobs.ppo.experience.advantages on a fixed Experience (scores -> EOS penalty, clip -> KL penalty -> GAE), then
    one KL-controller update."""
    from rlhf_core.jobs.ppo.experience import advantages
    from rlhf_core.rewards import Scored

    def run():
        c = _ppo_setup(cfg, stage)
        exp, logs = advantages(Scored(fixed_experience(c.pad_id, c.eos_id), {}), c.p, c.kl_ctl.value)
        c.kl_ctl.update(0.5, 64)
        return {
            "advantages": exp.advantages.tolist(),
            "returns": exp.returns.tolist(),
            "reward": round(logs["reward"], 6),
            "kl_after_update": c.kl_ctl.value,
        }

    return outcome(run)


# The reward sources and the critic-free estimators, fast: the controller's experience phase (ExperienceMaker.make) on
# fixed responses with its role groups answering fixed numbers (FixedRole), then advantages; the remote reward
# servers are real loopback servers.


FIXED_RESPONSES = ("a lovely happy day", "a sad day", "the calm lake", "the calm river")  # 2 prompts x 2 samples


REWARD_SERVERS: dict[str, Any] = {}  # url -> the loopback reward server (tests/reward_server.py) answering there
SERVER_OPTIONS = {"reward_url": {}, "failing_url": {"fail_status": 503}, "slow_url": {"delay_s": 0.4}}


@contextlib.contextmanager
def reward_servers():
    """Within: a loopback reward server for each of ``SERVER_OPTIONS`` (gold scores; always HTTP 503; 0.4 s before
    each answer), their URLs by name; each records the time of each request it gets (``times``)."""
    from tests.reward_server import RewardHandler, RewardServer, ServerState

    class TimedHandler(RewardHandler):
        def do_POST(self) -> None:
            self.server.times.append(time.monotonic())
            super().do_POST()

    urls = {}
    with contextlib.ExitStack() as stack:
        for name, options in SERVER_OPTIONS.items():
            server = RewardServer(0, ServerState(**options))
            server.RequestHandlerClass, server.times = TimedHandler, []
            thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
            thread.start()
            stack.callback(thread.join, 5)
            stack.callback(server.server_close)
            stack.callback(server.shutdown)
            urls[name] = server.url
            REWARD_SERVERS[server.url] = server
        try:
            yield urls
        finally:
            for url in urls.values():
                REWARD_SERVERS.pop(url, None)


def rounded(values: Any) -> list[float]:
    """Numbers as plain floats rounded to 5 places, so that observations compare by value."""
    return [round(float(v), 5) for v in values]


def experience_phase(cfg: PipelineConfig, stage: str) -> Any:
    """PPOController(...) (its reward sources checked), its experience phase on FIXED_RESPONSES with the roles
    answering fixed numbers (FixedRole) and the prompts' labels and columns given as fit() gives them, then
    advantages: each source's scores, their weighted sum, advantages, returns, the action tokens left per sample, the
    logs; with a loopback server at remote_rm_url, the requests it got (rows of each, and whether a pause of >= 0.5 s
    came between two)."""
    from rlhf_core.jobs.ppo.experience import advantages

    server = REWARD_SERVERS.get(cfg.stage(stage).remote_rm_url or "")
    seen = (len(server.times), len(server.state.batches)) if server is not None else None

    def run():
        c = _ppo_setup(cfg, stage)
        assert c.p.rollout.n_samples_per_prompt == 2, "FIXED_RESPONSES are two samples of two prompts"
        c.actor = FixedRole("actor")
        c.critic = FixedRole("critic") if c.roles.critic else None
        c.reward = FixedRole("reward") if c.roles.reward_model else None
        c.reference = FixedRole("reference") if c.roles.reference else None
        responses = [c.tokenizer.encode(t, add_special_tokens=False) + [c.eos_id] for t in FIXED_RESPONSES]
        prompts = c.prompts[:2]
        scored = c.experience_maker().make(
            [e["prompt_ids"] for e in prompts], responses, [e["prompt"] for e in prompts], columns=c.columns(prompts)
        )
        exp, logs = advantages(scored, c.p, c.kl_ctl.value)
        return {
            "prompts": [e["prompt"] for e in prompts for _ in range(2)],
            "texts": [c.tokenizer.decode(r, skip_special_tokens=True) for r in responses],
            "parts": {k: rounded(v) for k, v in scored.parts.items()},
            "scores": rounded(scored.exp.scores),
            "advantages": _rounded(exp.advantages),
            "returns": _rounded(exp.returns),
            "action_tokens": exp.action_mask.sum(1).tolist(),
            "logs": {k: round(v, 5) for k, v in logs.items()},
        }

    out: dict[str, Any] = {"result": outcome(run)}
    if server is not None:
        times = server.times[seen[0] :]
        out |= {
            "requests": len(times),
            "rows": server.state.batches[seen[1] :],
            "backed_off": any(b - a >= 0.5 for a, b in zip(times, times[1:])),
        }
    return out


def held_out_accuracy(cfg: PipelineConfig, stage: str) -> Any:
    """HeldOut.accuracy() of the held-out prompts as run() loads them (HeldOut.load), the engines answering fixed
    responses of 2 or 3 characters (fakes.FixedEngines): the metrics, the judge the summary names and how each call
    asked the engines to sample (n, temperature)."""

    def run():
        c = _ppo_setup(cfg, stage)
        asked: list[dict] = []
        metrics = c.held_out.accuracy(FixedEngines(c.eos_id, asked), c.p, c.tokenizer)
        return {
            "metrics": {k: round(v, 6) for k, v in metrics.items()},
            "judge": c.held_out.described().get("eval_judge"),
            "sampling": [(a["sampling"]["n"], a["sampling"]["temperature"]) for a in asked],
        }

    return outcome(run)


SYNC_GAPS = (2e-6, 0.01, 0.3)  # gaps between the engines' and the actor's log-probs of the probe sequence


def sync_check(cfg: PipelineConfig, stage: str) -> list:
    """evaluation.check_engine_sync as fit() calls it at the stage's end (the stage's tolerance and the actor's
    precision) on metrics whose sync_engine_vs_actor_max_diff is each of SYNC_GAPS: None (passed) or what it raised."""
    from rlhf_core.jobs.ppo.evaluation import check_engine_sync

    p = as_ppo(cfg.stage(stage))
    tolerance, precision = p.train.sync_check_tolerance, p.actor.strategy.precision
    metrics = [{"sync_engine_vs_actor_max_diff": gap} for gap in SYNC_GAPS]
    return [outcome(lambda m=m: check_engine_sync(stage, m, tolerance, precision)) for m in metrics]


def old_logprobs_phase(cfg: PipelineConfig, stage: str) -> Any:
    """The controller's experience phase on FIXED_RESPONSES as fit() runs it for a step whose actor trains (the old
    log-probs' source from ``jobs.ppo.old_logprobs``), the roles answering fixed numbers (FixedRole) and the engines'
    log-probs 0.05 above the actor's: the source, the experience phase's metrics and the old log-probs."""
    from rlhf_core.jobs.ppo.old_logprobs import old_logprobs_source

    def run():
        c = _ppo_setup(cfg, stage)
        c.actor = FixedRole("actor")
        c.critic = FixedRole("critic") if c.roles.critic else None
        c.reward = FixedRole("reward") if c.roles.reward_model else None
        c.reference = FixedRole("reference") if c.roles.reference else None
        responses = [c.tokenizer.encode(t, add_special_tokens=False) + [c.eos_id] for t in FIXED_RESPONSES]
        prompts = c.prompts[:2]
        prompt_ids = [e["prompt_ids"] for e in prompts]
        seq = make_sequences([ids for ids in prompt_ids for _ in range(2)], responses, c.pad_id)
        (actor,) = FixedRole("actor").call_each_async(None, [seq])
        engine = [(actor[i][seq.action_mask[i].bool()] + 0.05).tolist() for i in range(seq.size)]
        source = old_logprobs_source(c.p, actor_frozen=False, ref_from_actor=c.ref_from_actor)
        scored = c.experience_maker().make(prompt_ids, responses, [e["prompt"] for e in prompts], None, source, engine)
        return {"source": source, "logs": scored.logs, "old": _rounded(scored.exp.old_logprobs)}

    return outcome(run)


def ppo_plan(cfg: PipelineConfig, stage: str) -> Any:
    """jobs.ppo.roles.optimizer_steps and placement's resource_demand / check_fits for the stage (what start() asks of
    Ray)."""
    from rlhf_core.distributed import placement
    from rlhf_core.jobs.ppo.roles import optimizer_steps

    p = as_ppo(cfg.stage(stage))
    roles = placement.RoleSet.of(p)  # counted with a trained actor, as ``jobs.stage_setup.ray_cpus`` does
    return {
        "optimizer_steps": optimizer_steps(p, 10),
        "cpu": placement.resource_demand(p, roles, "cpu"),
        "cuda": placement.resource_demand(p, roles, "cuda"),
        "fits_cpu": outcome(lambda: placement.check_fits(stage, p, roles, "cpu", {"CPU": 64})),
        "fits_cuda": outcome(lambda: placement.check_fits(stage, p, roles, "cuda", {"CPU": 64, "GPU": 64})),
        "weight_sync": {d: outcome(lambda d=d: placement.weight_sync_backend(stage, p, d)) for d in ("cpu", "cuda")},
    }


def role_ds_config(role: str):
    def observe(cfg: PipelineConfig, stage: str) -> dict:
        p = as_ppo(cfg.stage(stage))
        t = p.train
        batch = TrainConfig(train_batch_size=t.train_batch_size, micro_train_batch_size=t.micro_train_batch_size)
        return DeepSpeedStrategy(getattr(p, role).strategy, getattr(p, role).optim, batch).ds_config()

    observe.__name__ = f"{role}_ds_config"
    observe.__doc__ = f"DeepSpeedStrategy of the {role} role (strategy, optim, PPO batch).ds_config()."
    return observe


def role_lr_curve(role: str):
    def observe(cfg: PipelineConfig, stage: str) -> list[float]:
        fn = lr_lambda(getattr(as_ppo(cfg.stage(stage)), role).optim, 20)
        return [round(fn(step), 9) for step in range(20)]

    observe.__name__ = f"{role}_lr_curve"
    observe.__doc__ = f"strategy.lr_lambda of the {role} optimizer over 20 steps."
    return observe


def first_prompts(cfg: PipelineConfig, stage: str) -> list[int]:
    """Prompt indices of PPO step 0 (sampler.global_batch with the train seed, as fit() reads them)."""
    c = _ppo_setup(cfg, stage)
    return global_batch(len(c.prompts), c.p.train.rollout_batch_size, 0, c.p.train.seed)


# ---------------------------------------------------------------------------------------------------------------------
# The PPO roles in this process (fakes.in_process): what start() built, then each phase on fixed sequences


def _rounded(t: torch.Tensor | None) -> list | None:
    return None if t is None else [[round(v, 5) for v in row] for row in t.tolist()]


def _trained_role(role: Any) -> dict:
    """The model and the optimizer's set-up; a role that never trains (the critic warm-up's actor) has no optimizer
    (ZeRO-3: DeepSpeed's parameter-gathering inference wrapper in its place)."""
    engine = role.engine
    if not role.ctx.trains:
        optimizer = engine.optimizer
        return {**fingerprint(engine.module), "optimizer": type(optimizer).__name__ if optimizer else None}
    return {**fingerprint(engine.module), **engine_state(engine.module, engine)}


def _role_report(c) -> dict:
    """After start(): what each role built, then the phases on fixed sequences: experience (with the forward
    micro-batch sizes of each role), the held-out evaluation, one train() on that experience (its old log-probs and
    values shifted, so that the clips act; the engines' log-probs taken as the unshifted ones, 0.5 above the old
    ones, for the truncated importance weights)."""
    from rlhf_core.distributed.placement import row_multiple
    from rlhf_core.jobs.ppo.experience import advantages

    tokenizer_len = len(c.tokenizer)
    gen = torch.Generator().manual_seed(0)
    prompts = [e["prompt_ids"] for e in c.prompts[:8]]
    texts = [e["prompt"] for e in c.prompts[:8]]
    responses = [
        torch.randint(5, tokenizer_len, (2 + i % 5,), generator=gen).tolist() + [c.eos_id] * (i % 2) for i in range(16)
    ]
    roles = {"actor": c.actor.obj.engine.module, "critic": c.critic.obj.engine.module, "reward": c.reward.obj.model}
    if c.reference is not None:
        roles["reference"] = c.reference.obj.model
    out: dict[str, Any] = {
        "actor": _trained_role(c.actor.obj),
        "critic": _trained_role(c.critic.obj),
        "reward": fingerprint(c.reward.obj.model),
        "reference": fingerprint(c.reference.obj.model) if c.reference is not None else None,
        "engine": fingerprint(c.engines.handles.actors[0].model),
        "groups": {"actor": c.actor.cfg, "critic": c.critic.cfg},
        "devices": {"actor": resolve_device(c.actor.cfg.device), "critic": resolve_device(c.critic.cfg.device)},
        "micro_batches": {role: [] for role in roles},
    }

    calls = out["micro_batches"]
    hooks = [m.register_forward_pre_hook(forward_record(calls[r]), with_kwargs=True) for r, m in roles.items()]
    try:
        scored = c.experience_maker().make(prompts, responses, texts)
    finally:
        for h in hooks:
            h.remove()
    exp = scored.exp
    out["logprobs"] = {"old": _rounded(exp.old_logprobs), "ref": _rounded(exp.ref_logprobs)}
    evaluated = c.held_out.evaluate(c.engines, c.experience_maker(), row_multiple(c.p, c.roles))
    out["evaluate"] = {k: round(v, 6) for k, v in evaluated.items()}
    mask = exp.action_mask
    shifted = dataclasses.replace(exp, old_logprobs=exp.old_logprobs - 0.5 * mask, values=exp.values + 0.5 * mask)
    engine = torch.where(mask.bool(), exp.old_logprobs, torch.full_like(exp.old_logprobs, float("nan")))
    shifted, _ = advantages(dataclasses.replace(scored, exp=shifted), c.p, c.kl_ctl.value, engine)
    # Forwards of each trained role's first decoder layer in train(): twice as many when backward recomputes them.
    out["layer_forwards_in_train"] = calls = {"actor": 0, "critic": 0}
    layers = {r: next(m for m in roles[r].modules() if type(m).__name__.endswith("DecoderLayer")) for r in calls}
    # a pre-hook: a recomputation stops early (torch.utils.checkpoint), before a forward hook would run
    hooks = [layers[r].register_forward_pre_hook(lambda *_, r=r: calls.__setitem__(r, calls[r] + 1)) for r in calls]
    try:
        # step 0 of fit(): the actor trains unless the stage never trains it (freeze_actor_steps = 0 here)
        stats = c.train(shifted, 0, actor_frozen=not c.train_actor)
    finally:
        for h in hooks:
            h.remove()
    out["train"] = {k: round(v, 6) for k, v in stats.items()}
    return out


ROLE_REPORTS: dict[str, Any] = {}  # ppo_roles' reports by config; the in_process_world fixture empties it


def ppo_roles(cfg: PipelineConfig, stage: str) -> Any:
    """PPOController.start() in-process, then ``_role_report`` (once per distinct config)."""
    key = content_key(cfg, stage)
    if key not in ROLE_REPORTS:

        def run():
            c = _ppo_setup(cfg, stage)
            try:
                c.start()
                return _role_report(c)
            finally:
                c.shutdown()

        ROLE_REPORTS[key] = outcome(run)
    return ROLE_REPORTS[key]


def actor_sync_plan(cfg: PipelineConfig, stage: str) -> Any:
    """PPOController.start() in-process, then the buckets the actor's weight push sends (and, under ZeRO-3, gathers):
    the number of tensors in each bucket of its parameters' plan."""
    from rlhf_core.distributed.weight_sync.buckets import bucket_plan

    def run():
        c = _ppo_setup(cfg, stage)
        try:
            c.start()
            actor = c.actor.obj
            return [len(b) for b in bucket_plan(actor._sync_plan()[1], actor.bucket_bytes)]
        finally:
            c.shutdown()

    return outcome(run)


def frozen_engines(cfg: PipelineConfig, stage: str) -> Any:
    """PPOController.start() in-process, then how the reward and reference models were built: the DeepSpeed inference
    config of a partitioned one (frozen.zero_stage 3), else None. Nothing runs after start(): in one process, a ZeRO-3
    role's DeepSpeed state would reach the other roles' models (in a run each role is its own Ray worker)."""

    def run():
        c = _ppo_setup(cfg, stage)
        try:
            c.start()
            groups = (("reward", c.reward), ("reference", c.reference))
            return {role: getattr(g.obj.strategy, "engine_config", None) for role, g in groups if g is not None}
        finally:
            c.shutdown()

    return outcome(run)


def report_part(*path: str, doc: str):
    """An observer of one part of ``ppo_roles`` (the whole report when start() raised)."""

    def observe(cfg: PipelineConfig, stage: str) -> Any:
        out = ppo_roles(cfg, stage)
        if isinstance(out, tuple):  # ("raised", ...)
            return out
        for part in path:
            out = out[part]
        return out

    observe.__name__ = "ppo_roles:" + ".".join(path)
    observe.__doc__ = doc
    return observe


def role_model(role: str):
    return report_part(
        role,
        doc=f"What the {role} role built in start() (model class, attention, vocabulary, weights"
        f"{', optimizer, recomputation' if role in ('actor', 'critic') else ''}).",
    )


def role_workers(role: str):
    def observe(cfg: PipelineConfig, stage: str) -> Any:
        return group_report(ppo_roles(cfg, stage)["groups"][role])

    observe.__name__ = f"{role}_workers"
    observe.__doc__ = f"A real Ray group started with the strategy start() gave the {role} group: what each rank got."
    return observe


def recomputation(role: str):
    return report_part(
        "layer_forwards_in_train",
        role,
        doc=f"Forwards of the {role}'s first decoder layer in PPOController.train() (backward recomputes them).",
    )


micro_batches = report_part(
    "micro_batches", doc="(rows, packed) of each forward of each role in the experience phase."
)
sampling = report_part("evaluate", doc="HeldOut.evaluate(): the engines sample the held-out prompts.")
train_phase = report_part("train", doc="PPOController.train() on a fixed experience: the actor's and critic's fit.")


def rollout_distribution(cfg: PipelineConfig, stage: str) -> Any:
    """The distribution of the rollout: the actor's and reference's log-probs of fixed sequences (experience phase)
    and the engines' samples (evaluate)."""
    out = ppo_roles(cfg, stage)
    return {"logprobs": out["logprobs"], "evaluate": out["evaluate"]}
