"""``python -m rlhf_core.config``: every key with its default and meaning, as the manual's configuration reference.

    python -m rlhf_core.config                 # writes docs/configuration-reference.md
    python -m rlhf_core.config --out -         # the same page on stdout
    python -m rlhf_core.config --check         # exit 1 when the page differs from what the code says

The page lists the run-level keys, then each built-in stage kind's keys under its name (an instance of that kind
takes the same keys under its own name). Installed plugin kinds are left out: the page documents this project."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rlhf_core.config.kinds import BUILTIN_KINDS
from rlhf_core.config.pipeline import PipelineConfig
from rlhf_core.config.serialise import describe

REFERENCE = Path("docs") / "configuration-reference.md"

_INTRO = """\
# Configuration reference

Every key of a preset, with its default and meaning. This page is generated from the code by
`python -m rlhf_core.config`; change the help text beside the field and run that command again, rather than editing
this page. How a preset is put together: [Configuration](configuration.md).

A stage instance of kind `K` named `N` takes the keys listed under `K`, spelled `stages.N.<key>` in a preset and
`N.<key>` in an override (`rlhf run tiny sft.optim.lr=1e-3`). A key without a default must be set.
"""


def _cell(text: str) -> str:
    """Table-cell text: a '|' would end the cell, '<' open an HTML tag, '*' start emphasis."""
    return text.replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;").replace("*", "\\*")


_YAML = {"None": "null", "True": "true", "False": "false"}  # defaults as a preset spells them


def _table(rows: list[tuple[str, str, str]]) -> list[str]:
    out = ["| key | default | meaning |", "|---|---|---|"]
    for key, default, help_text in rows:
        default = _YAML.get(default, default)
        shown = default if default == "(required)" else "`" + default.replace("|", "\\|") + "`"
        out.append(f"| `{key}` | {shown} | {_cell(help_text)} |")
    return out


def render(rows: list[tuple[str, str, str]] | None = None) -> str:
    """The page for ``rows`` (default: ``describe`` of the pipeline with the built-in kinds)."""
    rows = describe(PipelineConfig, kinds=BUILTIN_KINDS) if rows is None else rows
    kinds = {kind.name: kind for kind in BUILTIN_KINDS}
    by_kind: dict[str, list[tuple[str, str, str]]] = {name: [] for name in kinds}
    run_level = []
    for row in rows:
        head = row[0].split(".", 1)[0]
        by_kind.get(head, run_level).append(row)
    lines = [_INTRO, "## Run keys", "", *_table(run_level), "", "## Stage kinds", ""]
    for name, kind in kinds.items():
        lines += [f"### `{name}`", "", f"{kind.description} Job: `python -m {kind.job}`.", ""]
        lines += [*_table(by_kind[name]), ""]
    return "\n".join(lines)


def stale(path: Path) -> str | None:
    """None when ``path`` holds the page the code gives, else why not (the first differing line)."""
    want = render()
    if not path.is_file():
        return f"{path} is missing; run python -m rlhf_core.config"
    have = path.read_text(encoding="utf-8")
    if have == want:
        return None
    for number, (a, b) in enumerate(zip(have.splitlines(), want.splitlines(), strict=False), start=1):
        if a != b:
            return f"{path}:{number} differs from the code ({b[:100]!r}); run python -m rlhf_core.config"
    return f"{path} differs from the code in its length; run python -m rlhf_core.config"


def main(argv: list[str] | None = None) -> int:
    assert __doc__ is not None  # the module docstring (absent only under python -OO, which also drops asserts)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(REFERENCE), help=f"where to write the page ('-': stdout; {REFERENCE})")
    parser.add_argument("--check", action="store_true", help="only compare --out with the code; exit 1 if stale")
    args = parser.parse_args(argv)
    if args.check:
        why = stale(Path(args.out))
        if why:
            print(f"error: {why}", file=sys.stderr)
        return 1 if why else 0
    if args.out == "-":
        sys.stdout.write(render())
    elif not Path(args.out).parent.is_dir():
        print(f"error: no folder {Path(args.out).parent}/ here: run from the checkout, or give --out", file=sys.stderr)
        return 2
    else:
        Path(args.out).write_text(render(), encoding="utf-8")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
