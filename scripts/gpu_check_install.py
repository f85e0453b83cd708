"""Which of the carried wheels ``scripts/gpu_check.sh`` installs on the GPU machine, and the requirements file that
decides it.

``scripts/build_gpu_wheels.sh`` runs ``requirements WHEELS`` once the wheels are in ``WHEELS``: it writes
``WHEELS/requirements.txt``, one requirement a line, as the distribution named after it declares it (the project's
``pyproject.toml`` dependencies, DeepSpeed's ``Requires-Dist``, each carried wheel's own ``Requires-Dist``)::

    pydantic>=2  # required by rlhf-pipeline
    pydantic>=2.0.0  # required by deepspeed
    pydantic-core==2.50.5  # required by pydantic
    transformers<5.20,>=5.16.1  # required by rlhf-pipeline

A carried distribution that nothing declares gets ``NAME==<carried version>  # carried version``. Of the project's
own requirements only those on a carried distribution and those the checks import (``CHECKED``: transformers,
numpy...) are written: Ray, Prefect and vLLM are not what the GPU check runs. torch is never written: the image's
CUDA torch is the one to use (the project pins the CPU build's version).

``scripts/gpu_check.sh`` runs ``plan WHEELS`` on the GPU machine. It prints the wheels to install, one path a line,
and logs one line per decision on stderr:

- the project and DeepSpeed: always installed from their wheels;
- any other carried distribution: installed when it is missing or its installed version does not satisfy every
  requirement on it that applies (``installing X V (have Y, need Z)``), else kept (``keeping X Y (need Z)``). A
  requirement declared by a carried distribution applies only when that one is installed from its wheel too; when
  it is kept, the installed one's own requirement applies instead (a kept pydantic 2.10 needs its own pydantic-core,
  not the carried pydantic's). A carried distribution that no applied requirement asks for is not installed;
- a required distribution that is not carried (transformers, numpy...): only checked; a missing or unfitting one is
  logged as a warning, and the checks will show what fails.

The wheel of a distribution is the one whose tags this interpreter ranks first (``packaging.tags.sys_tags``), so the
folder may hold the binary wheels of several Pythons. Standard library and ``packaging`` only (pip's vendored copy
where ``packaging`` itself is not installed).
"""

from __future__ import annotations

import email.message
import email.parser
import importlib.metadata as md
import sys
import zipfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

try:
    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet
    from packaging.tags import Tag, sys_tags
    from packaging.utils import canonicalize_name, parse_wheel_filename
    from packaging.version import Version
except ImportError:  # a bare Python with pip only: pip's vendored copy
    from pip._vendor.packaging.requirements import Requirement  # type: ignore[no-redef]
    from pip._vendor.packaging.specifiers import SpecifierSet  # type: ignore[no-redef]
    from pip._vendor.packaging.tags import Tag, sys_tags  # type: ignore[no-redef]
    from pip._vendor.packaging.utils import canonicalize_name, parse_wheel_filename  # type: ignore[no-redef]
    from pip._vendor.packaging.version import Version  # type: ignore[no-redef]

PROJECT = "rlhf-pipeline"
ALWAYS = (PROJECT, "deepspeed")  # installed from the wheels whatever the image has
NEVER = frozenset({"torch"})  # the image's CUDA build, never a requirement here
# The project's requirements that the checks import, checked on the image though not carried.
CHECKED = frozenset(
    {"transformers", "safetensors", "tokenizers", "numpy", "packaging", "pyyaml", "tqdm", "fsspec", "psutil", "peft"}
)
REQUIREMENTS_FILE = "requirements.txt"


@dataclass(frozen=True)
class Line:
    """One line of the requirements file: ``requirement`` as ``required_by`` declares it."""

    requirement: Requirement
    required_by: str

    @property
    def name(self) -> str:
        return canonicalize_name(self.requirement.name)

    def applies(self, env: dict[str, str] | None = None) -> bool:
        marker = self.requirement.marker
        return marker is None or marker.evaluate({"extra": "", **(env or {})})


@dataclass
class Decision:
    """What ``plan`` does with one distribution: ``install`` (its carried wheel), ``keep`` (the installed one),
    ``skip`` (carried, but nothing installed asks for it), ``warn`` (required, not carried, missing or unfitting),
    ``ok`` (required, not carried, fits)."""

    dist: str
    action: str
    have: str | None
    need: SpecifierSet = field(default_factory=SpecifierSet)
    carried: str | None = None
    note: str = ""

    def log(self) -> str:
        need = str(self.need) or "any version"
        have = self.have or "none"
        if self.action == "install":
            why = "always from the wheels" if self.note else f"have {have}, need {need}"
            return f"installing {self.dist} {self.carried} ({why})"
        if self.action == "keep":
            return f"keeping {self.dist} {self.have} (need {need})"
        if self.action == "ok":
            return f"keeping {self.dist} {self.have} (need {need}; not carried)"
        if self.action == "skip":
            return f"skipping {self.dist} {self.carried} ({self.note})"
        if self.have is None:
            return f"warning: {self.dist} is missing (need {need}), and no wheel of it is carried"
        return f"warning: {self.dist} {self.have} does not satisfy {need}, and no wheel of it is carried"


# -- the requirements file ------------------------------------------------------------------------------------------
def parse_requirements(text: str) -> list[Line]:
    """``REQ  # required by DIST`` lines (``# carried version`` for a carried distribution nothing declares)."""
    lines = []
    for raw in text.splitlines():
        spec, _, comment = raw.partition("#")
        if not spec.strip():
            continue
        words = comment.split()
        by = canonicalize_name(words[-1]) if comment.strip().startswith("required by") and words else ""
        lines.append(Line(Requirement(spec.strip()), by))
    return lines


def wheel_metadata(path: Path) -> email.message.Message:
    with zipfile.ZipFile(path) as zf:
        name = next(n for n in zf.namelist() if n.count("/") == 1 and n.endswith(".dist-info/METADATA"))
        return email.parser.Parser().parsestr(zf.read(name).decode("utf-8"))


def carried_wheels(folder: Path) -> dict[str, dict[str, list[Path]]]:
    """Canonical name -> version -> the wheels of that version in ``folder``."""
    found: dict[str, dict[str, list[Path]]] = {}
    for path in sorted(folder.glob("*.whl")):
        name, version, _, _ = parse_wheel_filename(path.name)
        found.setdefault(canonicalize_name(name), {}).setdefault(str(version), []).append(path)
    return found


def requirement_lines(folder: Path) -> list[str]:
    """The requirements file's lines for the wheels in ``folder`` (see the module's docstring)."""
    carried = carried_wheels(folder)
    lines: list[str] = []
    declared: set[str] = set()
    order = [d for d in ALWAYS if d in carried] + sorted(set(carried) - set(ALWAYS))
    for dist in order:
        meta = wheel_metadata(carried[dist][max(carried[dist], key=Version)][0])
        extras = ("", "test") if dist == PROJECT else ("",)  # the project's test extra: pytest, for tests/gpu
        for text in meta.get_all("Requires-Dist") or []:
            req = Requirement(text)
            target = canonicalize_name(req.name)
            if target in NEVER:
                continue
            if dist in ALWAYS and target not in carried and target not in CHECKED:
                continue  # Ray, Prefect, vLLM, DeepSpeed's optional extras...: not what the GPU check imports
            if req.marker is not None and "extra" in str(req.marker):
                if not any(req.marker.evaluate({"extra": e}) for e in extras):
                    continue
                req.marker = None  # the extra is chosen here; other markers stay for the GPU machine to evaluate
            lines.append(f"{req}  # required by {dist}")
            declared.add(target)
    for dist, versions in sorted(carried.items()):
        if dist not in ALWAYS and dist not in declared:
            lines.append(f"{dist}=={max(versions, key=Version)}  # carried version")
    return lines


# -- the decision -----------------------------------------------------------------------------------------------------
def _order(lines: list[Line], names: Iterable[str]) -> list[str]:
    """``names`` with every distribution after those that declare a requirement on it (roots first)."""
    requirers: dict[str, set[str]] = {}
    for line in lines:
        requirers.setdefault(line.name, set()).add(line.required_by)
    pending = list(dict.fromkeys([*ALWAYS, *sorted(names)]))
    order: list[str] = []
    while pending:
        ready = [n for n in pending if not (requirers.get(n, set()) & set(pending)) - {n}] or pending[:1]
        order.append(ready[0])
        pending.remove(ready[0])
    return order


def decide(
    lines: list[Line],
    carried: dict[str, str],
    installed: Callable[[str], str | None],
    installed_requires: Callable[[str], list[str] | None],
    env: dict[str, str] | None = None,
) -> list[Decision]:
    """One decision per distribution that is carried or required (see the module's docstring).

    ``carried``: canonical name -> the carried wheel's version; ``installed(name)``: the version the image has, or
    None; ``installed_requires(name)``: the installed distribution's ``Requires-Dist``; ``env``: marker values
    (default: this interpreter's)."""
    required = {line.name for line in lines if line.applies(env)}
    names = (set(carried) | required) - NEVER
    decisions: dict[str, Decision] = {}
    for dist in _order(lines, names):
        if dist not in names:
            continue
        have = installed(dist)
        if dist in ALWAYS:
            if dist in carried:
                decisions[dist] = Decision(dist, "install", have, carried=carried[dist], note="always")
            continue
        need = SpecifierSet()
        asked = False
        for line in lines:
            if line.name != dist or not line.applies(env):
                continue
            by = decisions.get(line.required_by)
            if by is None or by.action == "install":  # the requirer is installed from its wheel, or is not carried
                need &= line.requirement.specifier
                asked = True
                continue
            for text in installed_requires(line.required_by) or []:  # a kept requirer asks for what it declares
                own = Line(Requirement(text), line.required_by)
                if own.name == dist and own.applies(env):
                    need &= own.requirement.specifier
                    asked = True
        fits = _fits(need, have)
        if dist in carried:
            if not asked:
                kept = sorted({line.required_by for line in lines if line.name == dist} - {""})
                note = f"not needed: {', '.join(kept) or 'nothing'} kept as installed, not asking for it"
                decisions[dist] = Decision(dist, "skip", have, need, carried[dist], note)
            else:
                decisions[dist] = Decision(dist, "keep" if fits else "install", have, need, carried[dist])
        elif asked:
            decisions[dist] = Decision(dist, "ok" if fits else "warn", have, need)
    return list(decisions.values())


def _fits(need: SpecifierSet, have: str | None) -> bool:
    if have is None:
        return False
    try:
        return need.contains(have, prereleases=True)
    except ValueError:  # not a PEP 440 version: replace it by the carried one
        return False


def pick_wheel(paths: list[Path], tags: list[Tag]) -> Path | None:
    """The wheel of ``paths`` whose best tag comes first in ``tags`` (this interpreter's, most specific first)."""
    rank = {tag: i for i, tag in enumerate(tags)}
    best: tuple[int, Path] | None = None
    for path in paths:
        score = min((rank[t] for t in parse_wheel_filename(path.name)[3] if t in rank), default=None)
        if score is not None and (best is None or score < best[0]):
            best = (score, path)
    return best[1] if best else None


def _installed(name: str) -> str | None:
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def _installed_requires(name: str) -> list[str] | None:
    try:
        return md.requires(name)
    except md.PackageNotFoundError:
        return None


def plan(folder: Path, log: Callable[[str], None]) -> list[Path]:
    """The wheels of ``folder`` to install into this interpreter; one ``log`` line per decision. Raises
    ``SystemExit`` when a distribution to install has no wheel for this interpreter."""
    wheels = carried_wheels(folder)
    req_file = folder / REQUIREMENTS_FILE
    if not req_file.is_file():
        raise SystemExit(f"gpu_check: {req_file} is missing: rebuild the folder with scripts/build_gpu_wheels.sh")
    lines = parse_requirements(req_file.read_text())
    tags = list(sys_tags())
    picked: dict[str, tuple[str, Path | None]] = {}  # the newest version with a wheel for this interpreter
    for dist, versions in wheels.items():
        usable = [(v, p) for v, ps in versions.items() if (p := pick_wheel(ps, tags)) is not None]
        picked[dist] = max(usable, key=lambda vp: Version(vp[0])) if usable else (max(versions, key=Version), None)
    decisions = decide(lines, {d: v for d, (v, _) in picked.items()}, _installed, _installed_requires)
    chosen, problems = [], []
    for d in decisions:
        log(f"gpu_check: {d.log()}")
        if d.action == "install":
            path = picked[d.dist][1]
            if path is None:
                names = ", ".join(p.name for ps in wheels[d.dist].values() for p in ps)
                problems.append(f"{d.dist}: no wheel for this Python ({sys.version.split()[0]}) among {names}")
            else:
                chosen.append(path)
    if problems:
        raise SystemExit("gpu_check: cannot install: " + "; ".join(problems))
    return chosen


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or args[0] not in ("requirements", "plan"):
        print("usage: gpu_check_install.py requirements|plan WHEELS_DIR", file=sys.stderr)
        return 2
    folder = Path(args[1])
    if args[0] == "requirements":
        (folder / REQUIREMENTS_FILE).write_text("\n".join(requirement_lines(folder)) + "\n")
        return 0
    for path in plan(folder, lambda line: print(line, file=sys.stderr)):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
