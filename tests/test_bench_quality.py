"""bench.quality's pure parts: method selection, which stages a preset can take over from an earlier run, and the rows
and summary from given metrics (no Ray, no training)."""

from pathlib import Path

import pytest

import bench.quality
from bench.quality import (
    METHODS,
    PRESETS,
    REAL_MODEL,
    StageRun,
    format_row,
    main,
    plan_reuse,
    quality,
    select_methods,
    summary,
)
from rlhf_core.config import load_config


def test_all_methods_by_default_and_a_selection_in_the_benchmarks_order():
    assert select_methods(None) == select_methods("all") == [m for m in METHODS if m not in REAL_MODEL]
    assert select_methods("kto, dpo,rejection-sampling,dpo") == ["dpo", "kto", "rejection_sampling"]
    assert select_methods("real") == ["smollm2_rlvr", "smollm2_ppo", "smollm2_dpo"]
    assert select_methods("smollm2-dpo,smollm2-rlvr") == ["smollm2_rlvr", "smollm2_dpo"]


@pytest.mark.parametrize("text", ["dpo,sppo", ",", "DPO"])
def test_an_unknown_method_is_refused_naming_the_known(text):
    known = r"in --methods \(known: dpo, kto, rejection_sampling, .*ppo, lora, smollm2_rlvr, .*, moe\)"
    with pytest.raises(ValueError, match=known):
        select_methods(text)


def test_main_refuses_an_unknown_method_in_one_line_before_running_anything(tmp_path):
    with pytest.raises(SystemExit) as e:
        main(["--methods", "dpo,sppo", "--root", str(tmp_path)])
    assert str(e.value) == (
        "error: unknown method 'sppo' in --methods "
        "(known: dpo, kto, rejection_sampling, iterative_dpo, grpo, grpo_async, grpo_partial, grpo_rollout_logprobs, "
        "grpo_gspo, grpo_is_correction, grpo_dynamic_batch, reinforce, rloo, rlvr, qlora_dpo, jamba, ppo, lora, "
        "smollm2_rlvr, smollm2_ppo, smollm2_dpo, moe)"
    )
    assert not any(tmp_path.iterdir())


def test_every_method_names_an_existing_preset_and_its_stages():
    for name, m in METHODS.items():
        cfg = load_config(PRESETS / f"{m.preset}.yaml", ["run_uri=/tmp/unused"])
        stages = {m.before[0], m.after[0], *([m.kl[0]] if m.kl else [])}
        assert stages <= set(cfg.order()), (name, stages)


def _made(preset: str, run_dir: Path, *overrides: str) -> list[StageRun]:
    """StageRuns as running ``preset`` would leave them (a stand-in config hash: the stage's name and inputs)."""
    cfg = load_config(PRESETS / f"{preset}.yaml", [f"run_uri={run_dir}", *overrides])
    out: dict[str, StageRun] = {}
    for name in cfg.order():
        upstream = {u: out[u].config_hash for u in cfg.spec(name).upstream_names()}
        out[name] = StageRun(name, cfg.kind(name), cfg.stage(name), upstream, f"{name}{upstream}", run_dir, 1.0, {})
    return list(out.values())


def test_a_preset_takes_over_the_stages_an_earlier_run_made_alike(tmp_path):
    made = _made("tiny-rejection-sampling", tmp_path / "rs")

    def reused(preset: str) -> set[str]:
        return set(plan_reuse(load_config(PRESETS / f"{preset}.yaml", ["run_uri=/tmp/unused"]), made))

    assert reused("tiny-dpo") == {"sft", "eval_sft"}
    assert reused("tiny-iterative-dpo") == {"sft", "reward_model", "eval_sft", "generate_1"}
    assert reused("tiny-grpo") == {"sft", "reward_model", "eval_sft"}
    # tiny.yaml's SFT trains on fewer samples: its reward model, the same section, reads another SFT output
    assert reused("tiny") == set()


OPTION_ROWS = [name for name, m in METHODS.items() if m.overrides]


@pytest.mark.parametrize("method", OPTION_ROWS)
def test_an_option_row_turns_its_option_on_in_the_grpo_stage_alone_and_takes_over_the_rest(method, tmp_path):
    m = METHODS[method]
    assert m.preset == "tiny-grpo" and m.note
    cfg = load_config(PRESETS / "tiny-grpo.yaml", ["run_uri=/tmp/unused", *m.overrides])
    for override in m.overrides:  # grpo.<section>.<key>=<value>: the value reached the stage's section
        path, value = override.split("=")
        stage, *keys = path.split(".")
        got = cfg.stage(stage)
        for key in keys:
            got = getattr(got, key)
        assert str(got).lower() == value, (override, got)
    plain = load_config(PRESETS / "tiny-grpo.yaml", ["run_uri=/tmp/unused"])
    assert [n for n in cfg.order() if cfg.stage(n) != plain.stage(n)] == ["grpo"]
    # after the plain grpo row: its upstream is taken over, its grpo stage (and so eval_grpo) is not
    assert set(plan_reuse(cfg, _made("tiny-grpo", tmp_path / "grpo"))) == {"sft", "reward_model", "eval_sft"}
    # a second run of the row itself takes over all of its stages
    assert set(plan_reuse(cfg, _made("tiny-grpo", tmp_path / method, *m.overrides))) == set(cfg.order())


def test_main_runs_a_row_with_its_overrides(tmp_path, monkeypatch, capsys):
    calls = []

    def run_preset(preset, run_dir, *overrides, reuse=(), log=print):
        calls.append((preset, run_dir.name, overrides))
        metrics = {"eval_sft": {"gold_reward": 0.40}, "eval_grpo": {"gold_reward": 0.50, "kl_to_ref": 0.1}}
        return {n: StageRun(n, "generate", None, {}, n, run_dir, 1.0, ms) for n, ms in metrics.items()}

    monkeypatch.setattr(bench.quality, "run_preset", run_preset)
    monkeypatch.chdir(tmp_path)  # main moves to the repository root
    main(["--methods", "grpo_gspo", "--root", str(tmp_path)])
    assert calls == [("tiny-grpo", "grpo_gspo", ("grpo.algo.policy_loss=gspo", "grpo.algo.loss_agg=seq_mean"))]
    out = capsys.readouterr().out.splitlines()
    assert out[-1] == "quality: min_rise=0.100 grpo_gspo_rise=0.100 all_raise=true"
    assert f"(grpo_gspo: {METHODS['grpo_gspo'].note})" in out


METRICS = {
    "dpo": {
        "eval_sft": {"gold_reward": 0.40},
        "dpo": {"loss_start": 0.69},
        "eval_dpo": {"gold_reward": 0.55, "kl_to_ref": 1.25},
    },
    "kto": {"eval_sft": {"gold_reward": 0.40}, "eval_kto": {"gold_reward": 0.43}},  # no KL measured, rise 0.03
    "ppo": {"ppo": {"gold_reward_before": 0.30, "gold_reward_after": 0.20, "kl_to_ref_after": 0.5}},
}


def test_rows_and_summary_from_the_metrics():
    dpo, kto, ppo = (quality(m, METRICS[m], s) for m, s in (("dpo", 12.0), ("kto", 10.5), ("ppo", 99.0)))
    assert (dpo.before, dpo.after, dpo.kl, dpo.raises) == (0.40, 0.55, 1.25, True)
    assert format_row(dpo) == "dpo                         0.400      0.550  +0.150     1.250    12.0"
    assert format_row(kto).startswith("kto                         0.400      0.430  +0.030         -    10.5  <- ")
    assert "does NOT raise" in format_row(kto) and "does NOT raise" in format_row(ppo)
    assert summary([dpo, kto, ppo]) == (
        "quality: min_rise=-0.100 dpo_rise=0.150 kto_rise=0.030 ppo_rise=-0.100 all_raise=false"
    )
    assert summary([dpo]) == "quality: min_rise=0.150 dpo_rise=0.150 all_raise=true"


def test_a_missing_metric_names_the_method_stage_and_preset():
    with pytest.raises(AssertionError, match="dpo: no gold_reward in the eval_dpo stage's metrics \\(tiny-dpo\\)"):
        quality("dpo", {"eval_sft": {"gold_reward": 0.4}}, 1.0)
