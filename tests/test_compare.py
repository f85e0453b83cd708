"""``rlhf compare`` on hand-written run folders: the differing config keys, one overlay PNG per stage, the final
metrics side by side, a stage only one run has, bad run arguments, and the ``compare-runs`` flow's artifact."""

import base64
import json
import re

import matplotlib.image
import pytest
import yaml

import flows.compare
from flows.cli import main
from flows.compare import ARTIFACT_KEY, compare_command, compare_runs
from rlhf_core import compare

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def write_run(folder, lr=None, stages=None, seed=42):
    """A run folder as the pipeline leaves it: ``config.yaml`` (when ``lr`` is given) and ``<stage>/metrics.json``.
    ``stages``: {stage: (history, final)}."""
    folder.mkdir(parents=True)
    if lr is not None:
        config = {
            "run_uri": str(folder),
            "storage": {"endpoint_url": None, "key": "***"},
            "stages": {
                "sft": {"kind": "sft", "optim": {"lr": lr, "adam_betas": [0.9, 0.95]}, "train": {"seed": seed}},
                "ppo": {"kind": "ppo", "algo": {"kl_coef": 0.01}},
            },
        }
        (folder / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    for stage, (history, final) in (stages or {}).items():
        (folder / stage).mkdir()
        (folder / stage / "metrics.json").write_text(json.dumps({"history": history, "final": final}))
    return folder


def sft_history(scale):
    return [{"step": k, "loss": scale / k, "lr": 1e-4} for k in range(1, 5)]


@pytest.fixture
def two_runs(tmp_path):
    """a: sft and ppo, lr 1e-4; b: sft only, lr 5e-4 (given as a file:// URI)."""
    a = write_run(
        tmp_path / "a",
        lr=1e-4,
        stages={
            "sft": (sft_history(2.0), {"loss_end": 0.512345678, "steps": 4}),
            "ppo": ([{"step": 1, "reward": 0.1}, {"step": 2, "reward": 0.4}], {"reward_mean": 0.25}),
        },
    )
    b = write_run(tmp_path / "b", lr=5e-4, stages={"sft": (sft_history(1.0), {"loss_end": 0.25, "steps": 4})})
    return a, b


def section(text, title):
    """The lines of the markdown section ``## title``."""
    body = text.split(f"\n## {title}\n", 1)[1]
    return body.split("\n## ", 1)[0].strip().splitlines()


def table(lines):
    """{first cell: other cells} of the markdown table rows in ``lines`` (header included, separator left out)."""
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in lines if line.startswith("|")]
    return {row[0]: row[1:] for row in rows if not row[0].startswith("---")}


def test_report_has_the_differing_keys_overlay_images_and_final_metrics(two_runs, tmp_path, capsys):
    a, b = two_runs
    out = tmp_path / "report"
    main(["compare", str(a), f"file://{b}", "--out", str(out)])
    assert capsys.readouterr().out.strip() == f"report: {out}/compare.md"
    text = (out / "compare.md").read_text()

    assert text.startswith("# Run comparison: a vs b\n")
    runs = table(text.split("\n## ", 1)[0].splitlines())
    assert runs["a"] == [f"`{a}`", "sft, ppo"] and runs["b"] == [f"`file://{b}`", "sft"]
    # Only the key that differs: run_uri (always different, shown as the location), seeds, betas are equal.
    assert table(section(text, "Config differences")) == {"key": ["a", "b"], "`sft.optim.lr`": ["0.0001", "0.0005"]}

    sft = section(text, "sft")
    assert "![sft](sft.png)" in sft
    assert table(sft) == {
        "final metric": ["a", "b"],
        "`loss_end`": ["0.512346", "0.25"],
        "`steps`": ["4", "4"],
    }
    ppo = section(text, "ppo")
    assert ppo[0] == "Only in a (not in b)."
    assert "![ppo](ppo.png)" in ppo
    assert table(ppo) == {"final metric": ["a"], "`reward_mean`": ["0.25"]}

    assert sorted(p.name for p in out.iterdir()) == ["compare.md", "ppo.png", "sft.png"]
    for name in ("sft.png", "ppo.png"):
        data = (out / name).read_bytes()
        assert data.startswith(PNG_SIGNATURE)
        height, width, channels = matplotlib.image.imread(out / name).shape
        assert height >= 200 and width >= 300 and channels in (3, 4)


def record_figures(monkeypatch) -> dict:
    """{figure title: {label: history}} of every figure the report draws (each still drawn for real)."""
    drawn = {}
    real = compare.curves.figure_png

    def record(series, title):
        drawn[title] = dict(series)
        return real(series, title)

    monkeypatch.setattr(compare.curves, "figure_png", record)
    return drawn


def test_each_stage_image_overlays_every_run_that_has_the_stage(two_runs, tmp_path, monkeypatch):
    drawn = record_figures(monkeypatch)
    report = compare.compare_report([str(p) for p in two_runs], str(tmp_path / "out"))
    assert drawn == {
        "sft: a vs b": {"a": sft_history(2.0), "b": sft_history(1.0)},
        "ppo: a": {"a": [{"step": 1, "reward": 0.1}, {"step": 2, "reward": 0.4}]},
    }
    assert set(report.images) == {"sft", "ppo"}


def test_run_names_default_location_unique_labels_and_a_run_without_config(tmp_path, monkeypatch, capsys):
    runs = tmp_path / "runs"
    monkeypatch.setattr(flows.compare, "RUNS", runs)
    write_run(runs / "lr-low", lr=1e-4, stages={"sft": (sft_history(2.0), {"loss_end": 0.5})})
    write_run(tmp_path / "elsewhere" / "lr-low", stages={"sft": (sft_history(1.0), {"loss_end": 0.25})})
    main(["compare", "lr-low", str(tmp_path / "elsewhere" / "lr-low")])
    report = runs / "_compare" / "lr-low-vs-lr-low" / "compare.md"
    assert capsys.readouterr().out.strip() == f"report: {report}"
    text = report.read_text()
    assert text.startswith("# Run comparison: lr-low vs lr-low-2\n")
    assert table(section(text, "sft"))["final metric"] == ["lr-low", "lr-low-2"]
    differences = section(text, "Config differences")
    assert differences[0].startswith("No config.yaml in lr-low-2")
    assert differences[-1] == "Fewer than two runs have a config.yaml: nothing to compare."


def test_equal_configs_say_so(tmp_path):
    a = write_run(tmp_path / "a", lr=1e-4, stages={"sft": (sft_history(2.0), {"loss_end": 0.5})})
    b = write_run(tmp_path / "b", lr=1e-4, stages={"sft": (sft_history(2.0), {"loss_end": 0.5})})
    report = compare.compare_report([str(a), str(b)], str(tmp_path / "out"))
    assert section(report.markdown, "Config differences") == ["No config key differs between a, b."]


@pytest.mark.parametrize(
    "make, expected",
    [
        (
            lambda tmp: "no-such-run",
            r"^error: 'no-such-run' is not a run: neither a run .*runs/no-such-run nor a folder ",
        ),
        (
            lambda tmp: str((tmp / "empty" / "sft").mkdir(parents=True) or tmp / "empty"),
            r"^error: '.*/empty' is not a run: no stage folder with a metrics\.json in .*/empty$",
        ),
    ],
    ids=["unknown-name", "no-metrics"],
)
def test_a_bad_run_argument_is_one_line_naming_it(two_runs, tmp_path, capsys, make, expected):
    bad = make(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main(["compare", str(two_runs[0]), bad, "--out", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and bad in err, err
    assert re.match(expected, err.strip()), err
    assert not (tmp_path / "out").exists()


def test_an_unwritable_report_folder_is_one_line(two_runs, tmp_path, capsys):
    (tmp_path / "taken").write_text("a file, not a folder")
    with pytest.raises(SystemExit) as exit_info:
        main(["compare", *map(str, two_runs), "--out", str(tmp_path / "taken")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: cannot write the report to '{tmp_path}/taken' (") and "\n" not in err, err


class Recorder:
    def __init__(self):
        self.calls = []

    def __call__(self, markdown, key=None, description=None):
        self.calls.append({"markdown": markdown, "key": key, "description": description})


def test_the_flow_publishes_the_report_with_inline_images(two_runs, tmp_path, monkeypatch):
    artifacts = Recorder()
    monkeypatch.setattr(flows.compare, "create_markdown_artifact", artifacts)
    out = tmp_path / "out"
    assert compare_runs.name == "compare-runs"
    path = compare_runs.fn([str(p) for p in two_runs], str(out))
    assert path == f"{out}/compare.md"
    [artifact] = artifacts.calls
    assert artifact["key"] == ARTIFACT_KEY == "run-comparison"
    inline = artifact["markdown"]
    assert "(sft.png)" not in inline and inline.count("](data:image/png;base64,") == 2
    uri = inline.split("![sft](", 1)[1].split(")", 1)[0]
    assert base64.b64decode(uri.removeprefix("data:image/png;base64,")) == (out / "sft.png").read_bytes()
    # the same report as the file, the images aside
    assert inline.replace(uri, "sft.png").split("![ppo](")[0] == (out / "compare.md").read_text().split("![ppo](")[0]


def test_the_command_publishes_only_inside_a_flow_run(two_runs, tmp_path, monkeypatch):
    artifacts = Recorder()
    monkeypatch.setattr(flows.compare, "create_markdown_artifact", artifacts)
    runs = [str(p) for p in two_runs]
    compare_command(runs, str(tmp_path / "outside"))
    assert artifacts.calls == []
    monkeypatch.setattr(flows.compare.FlowRunContext, "get", classmethod(lambda cls: object()))
    compare_command(runs, str(tmp_path / "inside"))
    assert [c["key"] for c in artifacts.calls] == ["run-comparison"]
