"""Training curves: which panels a history gets, the figure's lines, and the stage's curves markdown."""

import base64
import io
import math

import matplotlib.image

from rlhf_core import curves

PPO_STEP = {
    "reward": 0.5,
    "rm_score": 0.4,
    "kl": 0.02,
    "kl_token_mean": 0.001,
    "response_len": 14.0,
    "policy_loss": -0.1,
    "critic_loss": 0.3,
    "clip_frac": 0.05,
    "value_clip_frac": 0.0,
    "actor_lr": 1e-6,
    "timing/generation_s": 0.4,
    "timing/step_s": 1.2,
    "actor_frozen": False,
    "prompts": [1, 2],
    "weight_sync_mib": 3.0,
    "truncated_frac": 0.25,
}


def ppo_history(n: int) -> list[dict]:
    return [{"step": k, **PPO_STEP, "reward": 0.1 * k} for k in range(1, n + 1)]


def test_ppo_panels_follow_the_groups_then_timing_then_the_rest():
    assert curves.panels([ppo_history(3)]) == [
        ("reward", ["reward"]),
        ("reward-source score", ["rm_score"]),
        ("KL", ["kl", "kl_token_mean"]),
        ("response length (tokens)", ["response_len"]),
        ("policy loss", ["policy_loss"]),
        ("critic loss", ["critic_loss"]),
        ("clip fraction", ["clip_frac", "value_clip_frac"]),
        ("learning rate", ["actor_lr"]),
        ("step phases (s)", ["timing/generation_s", "timing/step_s"]),
        ("truncated_frac", ["truncated_frac"]),  # not a known group: a panel of its own
    ]  # no panel for the step, the prompt list, a flag or the weight-sync bookkeeping


def test_sft_and_reward_model_panels():
    assert curves.panels([[{"step": 1, "loss": 2.0, "lr": 1e-4}]]) == [("loss", ["loss"]), ("learning rate", ["lr"])]
    assert curves.panels([[{"step": 1, "loss": 0.7, "acc": 0.5}]]) == [("loss", ["loss"]), ("accuracy", ["acc"])]


def test_panels_are_capped_and_skip_non_finite_values():
    wide = [{"step": 1, **{f"m{i}": float(i) for i in range(20)}, "bad": math.nan}]
    layout = curves.panels([wide])
    assert len(layout) == curves.MAX_PANELS and ("bad", ["bad"]) not in layout
    history = [{"step": 1, "x": 1.0}, {"step": 2, "x": math.inf}, {"step": 3}, {"step": 4, "x": 2}]
    assert curves.points(history, "x") == ([1, 4], [1.0, 2.0])


def test_an_overlay_has_one_line_per_run_and_metric():
    a, b = ppo_history(4), ppo_history(2)
    fig = curves.figure({"lr=1e-6": a, "lr=5e-6": b}, "ppo")
    axes = [ax for ax in fig.axes if ax.get_visible()]
    assert [ax.get_title() for ax in axes] == [title for title, _ in curves.panels([a, b])]
    kl = axes[2]
    assert [line.get_label() for line in kl.get_lines()] == [
        "lr=1e-6: kl",
        "lr=1e-6: kl_token_mean",
        "lr=5e-6: kl",
        "lr=5e-6: kl_token_mean",
    ]
    reward = axes[0].get_lines()
    assert list(reward[0].get_xdata()) == [1, 2, 3, 4] and list(reward[1].get_xdata()) == [1, 2]
    assert list(reward[0].get_ydata()) == [0.1, 0.2, 0.30000000000000004, 0.4]


def test_an_empty_history_still_draws():
    png = curves.figure_png({"sft": []}, "sft")
    assert png.startswith(b"\x89PNG") and matplotlib.image.imread(io.BytesIO(png)).shape[0] > 100


def test_stage_markdown_inlines_the_figure_and_tables_the_last_steps():
    history = ppo_history(15)
    text = curves.stage_markdown("ppo", "ppo", history, 20, "running", table_rows=12)
    assert "**running, redrawn as steps are logged**: 15 logged steps, last step 15 of 20" in text
    encoded = text.split("](data:image/png;base64,", 1)[1].split(")", 1)[0]
    image = matplotlib.image.imread(io.BytesIO(base64.b64decode(encoded)))
    assert image.shape[0] > 100 and image.shape[1] > 100
    rows = [line for line in text.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [r.split(" | ")[0] for r in rows] == [f"| {k}" for k in range(4, 16)]  # the last 12 of 15
    header = next(line for line in text.splitlines() if line.startswith("| step |"))
    assert header.split(" | ")[1:4] == ["reward", "rm_score", "kl"]
    assert rows[-1].split(" | ")[1] == "1.5"  # reward at step 15, 4 significant digits
    assert "**final**: 1 logged step, last step 1" in curves.stage_markdown("sft", "sft", [{"step": 1}], None, "final")
