"""The dependency rules of the layout, checked on the source: arrows point one way."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HEAVY = {"ray", "deepspeed", "vllm"}


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_rlhf_core_never_imports_prefect_and_engines_only_in_distributed():
    offenders = []
    for path in sorted((ROOT / "rlhf_core").rglob("*.py")):
        tops = {name.split(".")[0] for name in imported_modules(path)}
        rel = path.relative_to(ROOT)
        if "prefect" in tops or {"tasks", "flows", "deployments"} & tops:
            offenders.append(f"{rel}: imports an upper layer")
        if HEAVY & tops and rel.parts[1] != "distributed":
            offenders.append(f"{rel}: imports {sorted(HEAVY & tops)} outside rlhf_core/distributed")
    assert not offenders, offenders


def test_algos_are_torch_only():
    for path in (ROOT / "rlhf_core" / "algos").rglob("*.py"):
        tops = {name.split(".")[0] for name in imported_modules(path)}
        assert tops <= {"torch", "math", "__future__", "typing", "dataclasses"}, (path, tops)


def test_upper_layers_only_point_down():
    allowed = {"tasks": {"rlhf_core", "tasks"}, "flows": {"rlhf_core", "tasks", "flows"}}
    offenders = []
    for layer, ok in allowed.items():
        for path in sorted((ROOT / layer).rglob("*.py")):
            ours = {n.split(".")[0] for n in imported_modules(path)} & {"rlhf_core", "tasks", "flows", "deployments"}
            if ours - ok:
                offenders.append(f"{path.relative_to(ROOT)} imports {sorted(ours - ok)}")
    assert not offenders, offenders
