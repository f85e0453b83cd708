"""The terminal display (flows/console.py) fed event sequences as tasks.progress hands them over: live bars on a
terminal console, plain lines otherwise, with the Cached / retry / resumed markers and the final states."""

import io
import logging
import re

from rich.console import Console

from flows.console import StageConsole, duration, step_line
from tasks import progress

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def sft_steps(times=(100.0, 107.0, 115.0, 123.0, 131.0), steps=(1, 8, 16, 24, 32)) -> list[dict]:
    return [
        {"event": "step", "stage": "sft", "step": s, "total": 32, "time": t, "metrics": {"loss": 2.0 / s, "lr": 1e-3}}
        for s, t in zip(steps, times)
    ]


def run_events() -> list[dict]:
    """sft runs; reward_model is Cached; ppo fails once, is retried and resumes from step 4."""
    ppo_metrics = {"reward": 0.25, "kl": 0.0125, "critic_loss": 0.5, "policy_loss": 0.1, "response_len": 16.0}
    return [
        {"event": "started", "stage": "sft", "kind": "sft", "attempt": 1},
        *sft_steps(),
        {"event": "finished", "stage": "sft", "kind": "sft", "state": "Completed", "duration_s": 31.24, "metrics": {}},
        {
            "event": "finished",
            "stage": "reward_model",
            "kind": "reward_model",
            "state": "Cached",
            "duration_s": 0.2,
            "metrics": {"eval_accuracy": 0.9},
        },
        {"event": "started", "stage": "ppo", "kind": "ppo", "attempt": 2},
        {"event": "resumed", "stage": "ppo", "step": 4},
        {"event": "step", "stage": "ppo", "step": 5, "total": 12, "time": 200.0, "metrics": ppo_metrics},
        {"event": "step", "stage": "ppo", "step": 6, "total": 12, "time": 202.0, "metrics": ppo_metrics},
    ]


def show(events: list[dict], terminal: bool, clock: float = 202.0, **kwargs) -> str:
    out = io.StringIO()
    display = StageConsole(Console(file=out, width=160, force_terminal=terminal), clock=lambda: clock, **kwargs)
    with display:
        for event in events:
            display(event)
    return out.getvalue()


def test_a_terminal_gets_live_bars_with_steps_rate_eta_metrics_and_the_markers():
    out = show(run_events(), terminal=True)
    assert "\x1b[" in out and "━" in out  # rich drew (colored) bars
    final = ANSI.sub("", out).split("\r")[-1]  # the last redraw of the live area
    rows = {line.split()[0]: line for line in final.splitlines() if line.strip()}
    assert set(rows) == {"sft", "reward_model", "ppo"}
    assert "step 32/32" in rows["sft"] and "loss=0.0625" in rows["sft"] and "Completed in 31.2 s" in rows["sft"]
    assert "Cached (output committed for this config)" in rows["reward_model"]
    assert "step" not in rows["reward_model"]  # no steps of its own to show
    ppo = rows["ppo"]
    assert "step 6/12" in ppo and "0.5 steps/s" in ppo and "ETA 12s" in ppo  # 1 step in 2 s, 6 to go
    assert "reward=0.25 kl=0.0125 critic_loss=0.5" in ppo and "policy_loss" not in ppo  # 3 metrics at most
    assert "attempt 2 (retry), resumed from step 4" in ppo


def test_the_eta_counts_down_between_step_events():
    out = show(run_events(), terminal=True, clock=206.0)  # 4 s after ppo's last step
    assert "ETA 8s" in ANSI.sub("", out).split("\r")[-1]


def test_plain_output_has_lines_without_escape_codes_or_redraws():
    out = show(run_events(), terminal=False)
    assert "\x1b" not in out and "\r" not in out
    assert out.splitlines() == [
        "sft: started",
        "sft: step 1/32 (3%) loss=2",
        "sft: step 8/32 (25%) 1 steps/s ETA 24s loss=0.25",
        "sft: step 16/32 (50%) 1 steps/s ETA 16s loss=0.125",
        "sft: step 24/32 (75%) 1 steps/s ETA 8s loss=0.08333",
        "sft: step 32/32 (100%) 1 steps/s loss=0.0625",
        "sft: Completed in 31.2 s",
        "reward_model: Cached (output committed for this config)",
        "ppo: attempt 2 (retry)",
        "ppo: resumed from step 4",
        "ppo: step 5/12 (41%) reward=0.25 kl=0.0125 critic_loss=0.5",
        "ppo: step 6/12 (50%) 0.5 steps/s ETA 12s reward=0.25 kl=0.0125 critic_loss=0.5",
    ]


def test_plain_lines_are_throttled_to_each_tenth_or_every_n_seconds_plus_first_and_last():
    steps = list(range(1, 101))
    events = [
        {"event": "step", "stage": "ppo", "step": s, "total": 100, "time": float(s), "metrics": {}} for s in steps
    ]
    shown = [int(line.split()[2].split("/")[0]) for line in show(events, terminal=False, every_s=1e9).splitlines()]
    assert shown == [1, 10, 20, 30, 40, 50, 60, 70, 80, 90, 100]
    shown = [int(line.split()[2].split("/")[0]) for line in show(events, terminal=False, every_s=5).splitlines()]
    assert shown[:7] == [1, 6, 10, 15, 20, 25, 30]  # a step a second: also 5 s after the previous line


def test_a_failed_stage_shows_its_state_and_duration():
    events = [
        {"event": "started", "stage": "sft", "attempt": 1},
        {"event": "finished", "stage": "sft", "state": "Failed", "duration_s": 3.04, "metrics": {}},
    ]
    assert show(events, terminal=False).splitlines() == ["sft: started", "sft: Failed after 3.0 s"]
    assert "Failed after 3.0 s" in ANSI.sub("", show(events, terminal=True))


def test_step_line_and_duration_formats():
    assert step_line("sft", 8, 16, 1.9, 4.2, "loss=1.23") == "sft: step 8/16 (50%) 1.9 steps/s ETA 4s loss=1.23"
    assert [duration(s) for s in (4.2, 125, 3720)] == ["4s", "2m05s", "1h02m"]


def test_prefect_log_lines_print_through_the_bars_console_while_live_and_not_after():
    from prefect.logging.handlers import PrefectConsoleHandler

    handler = PrefectConsoleHandler(stream=io.StringIO())
    logging.getLogger().addHandler(handler)
    own = handler.console
    out = io.StringIO()
    try:
        with StageConsole(Console(file=out, width=120, force_terminal=True, markup=False)) as display:
            assert handler.console is display.progress.console
            display({"event": "started", "stage": "sft", "attempt": 1})
            handler.emit(logging.LogRecord("prefect", logging.INFO, "", 0, "[sft] step 1/2 loss=3.0", None, None))
        assert handler.console is own
    finally:
        logging.getLogger().removeHandler(handler)
    assert "[sft] step 1/2 loss=3.0" in ANSI.sub("", out.getvalue())  # above the bars, "[sft]" kept (no markup)


def test_unknown_events_are_ignored_and_a_malformed_one_drops_the_listener_without_failing_the_run(capsys):
    out = io.StringIO()
    display = StageConsole(Console(file=out, width=120), live=False)
    unsubscribe = progress.subscribe(display)
    try:
        progress.publish({"event": "result", "stage": "sft"})  # not a progress event
        progress.publish({"what": "garbage"})
        progress.publish({"event": "step", "stage": "sft", "step": 1, "total": 2, "metrics": {}})
        assert out.getvalue() == "sft: step 1/2 (50%)\n"
        progress.publish({"event": "step", "stage": "sft", "step": "two"})  # raises in the listener ...
        progress.publish({"event": "step", "stage": "sft", "step": 2, "total": 2, "metrics": {}})
    finally:
        unsubscribe()
    assert "a progress listener failed and is dropped" in capsys.readouterr().err  # ... which is dropped
    assert out.getvalue() == "sft: step 1/2 (50%)\n"
