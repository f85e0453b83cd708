"""What ``rlhf run`` shows on a terminal and in a log file, on the real tiny pipeline (the test's Prefect server and
Ray, as in test_faults.py): in a pseudo-terminal (``script``) live progress bars with step k/N and an ETA; then, with
stdout a file and an override that changes only the last stage, plain lines: the earlier stages Cached, ppo's steps.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import time

import pytest

from tests.conftest import ROOT
from tests.flows.test_faults import RLHF, env, stages_launched, states  # noqa: F401 (env: a fixture)

pytestmark = pytest.mark.slow

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
EARLIER = ("sft", "reward_model", "critic_init", "critic_warmup")


@pytest.fixture
def run_env(env, shared_ray):  # noqa: F811
    """test_faults' environment, but the jobs join the session's Ray (the display does not care whose Ray)."""
    return {**env, "RAY_ADDRESS": shared_ray, "COLUMNS": "160"}


def test_a_terminal_shows_live_bars_and_a_log_file_plain_lines_with_the_cached_stages(run_env, tmp_path):
    run_dir = tmp_path / "term" / "run"
    args = ["run", "tiny", "ppo.train.max_steps=2", "--run-name", "term", "--run-uri", str(run_dir)]

    # 1. in a pseudo-terminal: bars
    started = time.time()
    cmd = shlex.join([RLHF, *args])
    tty = subprocess.run(["script", "-qefc", cmd, "/dev/null"], cwd=ROOT, env=run_env, stdin=subprocess.DEVNULL,
                         capture_output=True, timeout=600)  # fmt: skip
    out = tty.stdout.decode("utf-8", "replace")
    assert tty.returncode == 0, out[-4000:]
    print(f"tty run: {time.time() - started:.0f} s")
    assert "━" in out and "\r" in out and "\x1b[" in out  # rich's bars, redrawn in place, in color
    text = ANSI.sub("", out)
    assert re.search(r"sft +━+ step 32/32 [\d.]+ steps/s", text), text[-3000:]
    assert re.search(r"step \d+/64 [\d.]+ steps/s ETA \d+s", text), text[-3000:]  # reward_model, mid-stage
    assert "Completed in" in text and "Task run 'sft'" in text  # the final states, and the log above the bars
    assert states(run_dir) == dict.fromkeys((*EARLIER, "ppo"), "Completed")

    # 2. stdout to a file (the flow's log, on stderr, to another: Ray's colored prefixes stay in job lines), only
    # ppo changed: plain lines
    started = time.time()
    stdout, stderr = tmp_path / "plain.out", tmp_path / "plain.log"
    with stdout.open("w") as f, stderr.open("w") as g:
        plain = subprocess.run([RLHF, *args[:2], "ppo.train.max_steps=3", *args[3:]], cwd=ROOT, env=run_env,
                               stdin=subprocess.DEVNULL, stdout=f, stderr=g, timeout=600)  # fmt: skip
    out = stdout.read_text()
    assert plain.returncode == 0, out[-2000:] + stderr.read_text()[-4000:]
    print(f"plain run: {time.time() - started:.0f} s")
    assert "\x1b" not in out and "\r" not in out and "━" not in out
    assert "Task run 'ppo'" in stderr.read_text()  # logging left as it is
    lines = out.splitlines()
    for stage in EARLIER:
        assert f"{stage}: Cached (output committed for this config)" in lines, out[-4000:]
    steps = [line for line in lines if re.fullmatch(r"ppo: step \d/3 \(\d+%\).*", line)]
    assert [s.split()[2] for s in steps] == ["1/3", "2/3", "3/3"], steps  # every tenth of 3 steps: each
    assert re.search(r"ppo: step 2/3 \(66%\) [\d.]+ steps/s ETA \d+s reward=", out), steps
    assert any(re.fullmatch(r"ppo: Completed in [\d.]+ s", line) for line in lines)
    assert states(run_dir) == {**dict.fromkeys(EARLIER, "Cached"), "ppo": "Completed"}
    assert stages_launched(run_dir)[-1:] == ["ppo"] and stages_launched(run_dir).count("ppo") == 2
