"""Bad presets, overrides and a stage already being written: refused by the job's command line (see conftest)."""

import json
import os
import socket
import time

import psutil

from tests.conftest import TINY


def preset(tmp_path, text: str, name: str = "preset.yaml"):
    path = tmp_path / name
    path.write_bytes(text.encode() if isinstance(text, str) else text)
    return path


def test_a_key_given_twice_in_the_preset(tmp_path, refused):
    text = TINY.read_text().replace("run_uri:", "run_uri: runs/first\nrun_uri:", 1)
    refused("sft", config=preset(tmp_path, text), match=r"preset.yaml line \d+: key 'run_uri' appears twice.*keep one")


def test_a_key_given_twice_in_a_stage_section(tmp_path, refused):
    text = TINY.read_text().replace("    kind: sft\n", "    kind: sft\n    kind: sft\n", 1)
    refused("sft", config=preset(tmp_path, text), match=r"preset.yaml line \d+: key 'kind' appears twice")


def test_malformed_yaml_names_line_and_column(tmp_path, refused):
    refused(
        "sft",
        config=preset(tmp_path, "run_uri: [runs/x\nstages: {}\n"),
        match=r"preset.yaml is not valid YAML: line \d+, column \d+",
    )


def test_invalid_utf8_in_the_preset_names_its_line(tmp_path, refused):
    refused(
        "sft",
        config=preset(tmp_path, b"run_uri: runs/x\n# caf\xe9\nstages: {}\n"),
        match=r"preset.yaml line 2: not valid UTF-8 \(byte 0xe9\)",
    )


def test_a_preset_with_a_bom_loads(tmp_path, refused):
    # The BOM is accepted: what is refused here is the bad value after it, not the file.
    text = "\ufeff" + TINY.read_text()
    refused("sft", "sft.optim.lr=-1", config=preset(tmp_path, text), match=r"'sft.optim.lr': must be > 0")


def test_an_override_with_a_duplicate_key(refused):
    refused("sft", "sft.optim={lr: 1.0e-3, lr: 2.0e-3}", match=r"override 'sft.optim=.*key 'lr' appears twice")


def test_an_unknown_key(refused):
    refused("sft", "sft.optim.learning_rate=1e-3", match=r"sft.optim.learning_rate")


def test_a_stage_being_written_by_a_live_job(run_dir, refused, monkeypatch):
    # Another live writer's lease (this test process stands for it): the job waits RLHF_LEASE_WAIT_S, then refuses.
    me = psutil.Process()
    lease = {
        "token": "other",
        "stage": "sft",
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "pid_started": me.create_time(),
        "acquired": time.time(),
        "heartbeat": time.time() + 3600,
    }
    (run_dir / "_leases").mkdir()
    (run_dir / "_leases" / "sft.json").write_text(json.dumps(lease))
    monkeypatch.setenv("RLHF_LEASE_WAIT_S", "1")
    refused("sft", match=rf"_leases/sft.json: stage 'sft' is being written by pid {os.getpid()} on ")
