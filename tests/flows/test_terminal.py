"""What ``rlhf run`` shows on a terminal and in a log file, on a real run of two SFT stages (``sft_chain``; the test's
Prefect server and Ray, as in test_faults.py): in a pseudo-terminal (``script``) live progress bars with step k/N and
an ETA; then, with stdout a file and an override that changes only the second stage, plain lines: the first stage
Cached, the second one's steps. The display is the same for every stage kind (it reads the jobs' step events). The
same two runs show two instances of one stage kind as two tasks, each named after its instance and cached on its own.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import time

import pytest

from rlhf_core.storage import ObjectStore
from tests.conftest import ROOT
from tests.flows.test_faults import RLHF, env, stages_launched, states  # noqa: F401 (env: a fixture)

# make test: `rlhf run` shows a real job's step events (test_stage_kind_plugin.py), and the display's plain lines, bars
# and cached rows from events (test_console.py); the pseudo-terminal of a real run is make test-all's
pytestmark = [pytest.mark.slow, pytest.mark.extended]

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
# sft_a: 512 rows / 16 = 32 steps, sft_b: 8; both report every step (log_steps is outside the config hash)
CHAIN = ["sft_a.data.max_samples=512", "sft_a.train.log_steps=1", "sft_b.train.log_steps=1"]


@pytest.fixture
def run_env(env, shared_ray):  # noqa: F811
    """test_faults' environment, but the jobs join the session's Ray (the display does not care whose Ray)."""
    return {**env, "RAY_ADDRESS": shared_ray, "COLUMNS": "160"}


def test_a_terminal_shows_live_bars_and_a_log_file_plain_lines_with_the_cached_stages(run_env, tmp_path):
    run_dir = tmp_path / "term" / "run"
    args = ["run", "sft_chain", *CHAIN, "--run-name", "term", "--run-uri", str(run_dir)]

    # 1. in a pseudo-terminal: bars
    started = time.time()
    cmd = shlex.join([RLHF, *args])
    tty = subprocess.run(
        ["script", "-qefc", cmd, "/dev/null"],
        cwd=ROOT,
        env=run_env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        timeout=600,
    )
    out = tty.stdout.decode("utf-8", "replace")
    assert tty.returncode == 0, out[-4000:]
    print(f"tty run: {time.time() - started:.0f} s")
    assert "━" in out and "\r" in out and "\x1b[" in out  # rich's bars, redrawn in place, in color
    text = ANSI.sub("", out)
    assert re.search(r"sft_a +━+ step 32/32 [\d.]+ steps/s", text), text[-3000:]
    assert re.search(r"step \d+/32 [\d.]+ steps/s ETA \d+s", text), text[-3000:]  # sft_a, mid-stage
    assert "Completed in" in text  # the final states, and above the bars the log: one task run per instance
    assert "Task run 'sft_a'" in text and "Task run 'sft_b'" in text
    assert states(run_dir) == {"sft_a": "Completed", "sft_b": "Completed"}
    assert stages_launched(run_dir) == ["sft_a", "sft_b"]
    store = ObjectStore(str(run_dir))  # the second instance records the output it started from
    assert store.read_manifest("sft_b").extra["upstream"] == {"sft_a": store.read_manifest("sft_a").config_hash}

    # 2. stdout to a file (the flow's log, on stderr, to another: Ray's colored prefixes stay in job lines), only
    # sft_b changed: plain lines
    started = time.time()
    stdout, stderr = tmp_path / "plain.out", tmp_path / "plain.log"
    with stdout.open("w") as f, stderr.open("w") as g:
        plain = subprocess.run(
            [RLHF, *args[:-4], "sft_b.optim.lr=5e-4", *args[-4:]],
            cwd=ROOT,
            env=run_env,
            stdin=subprocess.DEVNULL,
            stdout=f,
            stderr=g,
            timeout=600,
        )
    out = stdout.read_text()
    assert plain.returncode == 0, out[-2000:] + stderr.read_text()[-4000:]
    print(f"plain run: {time.time() - started:.0f} s")
    assert "\x1b" not in out and "\r" not in out and "━" not in out
    assert "Task run 'sft_b'" in stderr.read_text()  # logging left as it is
    lines = out.splitlines()
    assert "sft_a: Cached (output committed for this config)" in lines, out[-4000:]
    steps = [line for line in lines if re.fullmatch(r"sft_b: step \d/8 \(\d+%\).*", line)]
    assert [s.split()[2] for s in steps] == [f"{k}/8" for k in range(1, 9)], steps  # every tenth of 8 steps: each
    assert re.search(r"sft_b: step 4/8 \(50%\) [\d.]+ steps/s ETA \d+s loss=", out), steps
    assert any(re.fullmatch(r"sft_b: Completed in [\d.]+ s", line) for line in lines)
    assert states(run_dir) == {"sft_a": "Cached", "sft_b": "Completed"}
    assert stages_launched(run_dir) == ["sft_a", "sft_b", "sft_b"]
