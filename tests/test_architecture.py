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
        assert tops <= {"torch", "math", "__future__", "typing", "collections", "dataclasses"}, (path, tops)


def test_upper_layers_only_point_down():
    allowed = {"tasks": {"rlhf_core", "tasks"}, "flows": {"rlhf_core", "tasks", "flows"}}
    offenders = []
    for layer, ok in allowed.items():
        for path in sorted((ROOT / layer).rglob("*.py")):
            ours = {n.split(".")[0] for n in imported_modules(path)} & {"rlhf_core", "tasks", "flows", "deployments"}
            if ours - ok:
                offenders.append(f"{path.relative_to(ROOT)} imports {sorted(ours - ok)}")
    assert not offenders, offenders


REMOTE_CALLS = {"call", "call_async", "call_each", "call_each_async", "collective_rpc"}


def test_no_remote_call_by_method_name_string():
    """Role methods are called through the role's own method objects (a grep finds the callers, a wrong signature
    fails at once), never by a method name in a string."""
    offenders = []
    for layer in ("rlhf_core", "tasks", "flows"):
        for path in sorted((ROOT / layer).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args):
                    continue
                first = node.args[0]
                if node.func.attr in REMOTE_CALLS and isinstance(first, ast.Constant) and isinstance(first.value, str):
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.func.attr}({first.value!r})")
                if (
                    isinstance(node.func, ast.Attribute)
                    and node.func.attr == "remote"
                    and _is_getattr(node.func.value)
                ):
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} getattr(...).remote")
    launcher = ast.parse((ROOT / "rlhf_core" / "distributed" / "launcher.py").read_text())
    offenders += [f"launcher.py:{n.lineno} getattr dispatch" for n in ast.walk(launcher) if _is_getattr(n)]
    assert not offenders, offenders


def _is_getattr(node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"


def test_flows_import_nothing_from_the_jobs():
    offenders = []
    for path in sorted((ROOT / "flows").rglob("*.py")):
        for name in imported_modules(path):
            if name == "rlhf_core.jobs" or name.startswith("rlhf_core.jobs."):
                offenders.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not offenders, offenders


def test_task_progress_comes_from_job_events_not_log_text():
    """The task layer reads no log text for meaning: no regular expressions, and the launcher follows the events
    file (tests/test_launch_events.py shows the behaviour)."""
    for path in sorted((ROOT / "tasks").rglob("*.py")):
        assert "re" not in {n.split(".")[0] for n in imported_modules(path)}, f"{path} parses text with re"
    launch = (ROOT / "tasks" / "_launch.py").read_text()
    assert "read_new" in launch and "EVENTS_ENV" in launch


# torch.distributed's collectives, and the methods a ProcessGroup object exposes for them.
COLLECTIVES = {
    "all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
    "all_to_all", "all_gather_object", "broadcast_object_list", "scatter", "gather", "reduce", "barrier",
}  # fmt: skip
GROUP_METHODS = {"allreduce", "allgather", "broadcast", "all_reduce", "reduce_scatter", "alltoall"}
DEVICE_MODULE = ROOT / "rlhf_core" / "distributed" / "device.py"


def _collective_calls(path: Path) -> list[tuple[int, str]]:
    """(line, what) of each torch.distributed collective issued in ``path``: ``dist.X(...)`` /
    ``torch.distributed.X(...)``, ``<group>.broadcast/allreduce(...)`` on any object, and collectives imported by
    name from torch.distributed."""
    tree = ast.parse(path.read_text())
    aliases = {"torch.distributed"}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases |= {a.asname or a.name for a in node.names if a.name == "torch.distributed"}
        elif isinstance(node, ast.ImportFrom) and node.module == "torch.distributed":
            found += [
                (node.lineno, f"from torch.distributed import {a.name}") for a in node.names if a.name in COLLECTIVES
            ]
        elif (
            isinstance(node, ast.ImportFrom)
            and node.module == "torch"
            and any(a.name == "distributed" for a in node.names)
        ):
            aliases |= {a.asname or a.name for a in node.names if a.name == "distributed"}
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        attr, receiver = node.func.attr, ast.unparse(node.func.value)
        if (attr in COLLECTIVES and receiver in aliases) or attr in GROUP_METHODS:
            found.append((node.lineno, f"{receiver}.{attr}(...)"))
    return found


def test_every_collective_goes_through_the_device_aware_helper():
    """NCCL refuses CPU tensors and gloo CUDA ones: every collective of the project's own code is issued by
    rlhf_core/distributed/device.py, which moves the tensor to the group's device. Anywhere else a torch.distributed
    collective (``dist.all_reduce``, ``group.broadcast``, ...) is an offender; DeepSpeed's own collectives are
    DeepSpeed's business."""
    offenders = [
        f"{path.relative_to(ROOT)}:{line} {what}"
        for path in sorted((ROOT / "rlhf_core").rglob("*.py"))
        if path != DEVICE_MODULE
        for line, what in _collective_calls(path)
    ]
    assert not offenders, offenders
    # and the helper really is the one issuing them
    issued = {what.split("(")[0].rsplit(".", 1)[-1] for _, what in _collective_calls(DEVICE_MODULE)}
    assert {"all_reduce", "broadcast", "all_gather_object", "broadcast_object_list", "barrier"} <= issued, issued
