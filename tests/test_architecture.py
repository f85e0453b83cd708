"""The shape of the code, checked on the source: arrows point one way, no cycles, modules stay small, each fact has
one home. Every failure lists its offenders as ``path:line: what``."""

import ast
import dataclasses
import io
import re
import tokenize
import warnings
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LAYERS = ("rlhf_core", "tasks", "flows", "deployments")
HEAVY = {"ray", "deepspeed", "vllm"}


# ---------------------------------------------------------------------------------------------------------------------
# Reading the source: files, module names, imports


def source_files(*dirs: str) -> list[Path]:
    return sorted(path for d in dirs for path in (ROOT / d).rglob("*.py"))


def rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def project_modules() -> dict[str, Path]:
    return {module_name(path): path for path in source_files(*LAYERS)}


@cache
def parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def walk(tree: ast.AST) -> list[ast.AST]:
    """``ast.walk`` in source order, so that offenders are listed by line."""
    return sorted(ast.walk(tree), key=lambda node: (getattr(node, "lineno", 0), getattr(node, "col_offset", 0)))


def fail_on(offenders: list[str], rule: str) -> None:
    if offenders:
        pytest.fail(f"{rule}:\n" + "\n".join(offenders), pytrace=False)


def from_base(path: Path, node: ast.ImportFrom) -> str:
    """The absolute module a ``from ... import`` reads from, relative imports resolved against ``path``."""
    if node.level == 0:
        return node.module or ""
    package = module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    package = package[: len(package) - (node.level - 1)]
    return ".".join(package + ([node.module] if node.module else []))


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import in ``path``, function-level ones included; ``from pkg import name`` gives
    ``pkg.name`` when that is a module of the project, else ``pkg``."""
    found = []
    for node in walk(parse(path)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = from_base(path, node)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.append((node.lineno, sub if sub in project_modules() else base))
    return found


@cache
def bindings(module: str) -> dict[str, tuple[int, str, str | None]]:
    """What the module-level imports of ``module`` bind: name -> (line, source module, attribute of it, or None when
    the name is the module itself). Function-level imports bind locals, not attributes, and are left out."""
    path = project_modules()[module]
    out: dict[str, tuple[int, str, str | None]] = {}
    stack: list[ast.stmt] = list(parse(path).body)
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    out[alias.asname] = (node.lineno, alias.name, None)
                else:
                    out[alias.name.split(".")[0]] = (node.lineno, alias.name.split(".")[0], None)
        elif isinstance(node, ast.ImportFrom):
            base = from_base(path, node)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                target = (sub, None) if sub in project_modules() else (base, alias.name)
                out[alias.asname or alias.name] = (node.lineno, *target)
        elif isinstance(node, (ast.If, ast.Try)):  # `if TYPE_CHECKING:`, `try: import x`
            stack += node.body + node.orelse + getattr(node, "finalbody", [])
            stack += [stmt for handler in getattr(node, "handlers", []) for stmt in handler.body]
    return out


def origin(module: str, name: str) -> list[tuple[str, str | None]]:
    """The (module, name) steps that ``module.name`` takes through re-imports inside the project, ending where it is
    made; a name that is itself a module ends as (that module, None)."""
    chain: list[tuple[str, str | None]] = [(module, name)]
    while len(chain) < 20:  # a re-import loop cannot run forever
        here, attr = chain[-1]
        bound = bindings(here).get(attr) if here in project_modules() and attr is not None else None
        if bound is None and f"{here}.{attr}" in project_modules():  # `from pkg import submodule`
            bound = (0, f"{here}.{attr}", None)
        if bound is None:
            break
        chain.append((bound[1], bound[2]))
    return chain


def _is_jobs(module: str) -> bool:
    return module == "rlhf_core.jobs" or module.startswith("rlhf_core.jobs.")


# ---------------------------------------------------------------------------------------------------------------------
# Layers


def test_rlhf_core_never_imports_prefect_and_engines_only_in_distributed():
    """rlhf_core imports neither Prefect nor an upper layer; Ray, DeepSpeed and vLLM only in rlhf_core/distributed."""
    offenders = []
    for path in source_files("rlhf_core"):
        in_distributed = path.relative_to(ROOT).parts[1] == "distributed"
        for line, name in imports(path):
            top = name.split(".")[0]
            if top in {"prefect", "tasks", "flows", "deployments"}:
                offenders.append(f"{rel(path)}:{line}: imports {name}, an upper layer")
            if top in HEAVY and not in_distributed:
                offenders.append(f"{rel(path)}:{line}: imports {name} outside rlhf_core/distributed")
    fail_on(offenders, "rlhf_core points down only")


ALGOS_MAY_IMPORT = {"torch", "math", "__future__", "typing", "collections", "dataclasses", "rlhf_core"}


def test_algos_are_torch_only():
    """rlhf_core/algos needs torch and the standard library only, and of the project only other algos modules."""
    offenders = []
    for path in source_files("rlhf_core/algos"):
        for line, name in imports(path):
            if name.split(".")[0] not in ALGOS_MAY_IMPORT or (
                name.startswith("rlhf_core") and not name.startswith("rlhf_core.algos")
            ):
                offenders.append(f"{rel(path)}:{line}: imports {name}")
    fail_on(offenders, "algos are torch-only")


def test_upper_layers_only_point_down():
    """tasks import only rlhf_core and tasks; flows only rlhf_core, tasks and flows."""
    allowed = {"tasks": {"rlhf_core", "tasks"}, "flows": {"rlhf_core", "tasks", "flows"}}
    offenders = [
        f"{rel(path)}:{line}: imports {name}"
        for layer, ok in allowed.items()
        for path in source_files(layer)
        for line, name in imports(path)
        if name.split(".")[0] in LAYERS and name.split(".")[0] not in ok
    ]
    fail_on(offenders, "upper layers point down")


def test_flows_import_nothing_from_the_jobs():
    """flows reach rlhf_core.jobs neither directly nor through a name that tasks (or rlhf_core) re-exports from it."""
    offenders = []
    for path in source_files("flows"):
        tree = parse(path)
        aliases: dict[str, str] = {}  # local name -> project module, for `stages.open_store`
        for node in walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if _is_jobs(alias.name):
                        offenders.append(f"{rel(path)}:{node.lineno}: imports {alias.name}")
                    aliases[alias.asname or alias.name] = alias.name
            elif isinstance(node, ast.ImportFrom):
                base = from_base(path, node)
                for alias in node.names:
                    chain = origin(base, alias.name)
                    if any(_is_jobs(module) or _is_jobs(f"{module}.{name}") for module, name in chain):
                        offenders.append(f"{rel(path)}:{node.lineno}: imports {_steps(chain)}")
                    elif chain[-1][1] is None:
                        aliases[alias.asname or alias.name] = chain[-1][0]
        for node in walk(tree):
            if isinstance(node, ast.Attribute) and aliases.get(ast.unparse(node.value)) in project_modules():
                chain = origin(aliases[ast.unparse(node.value)], node.attr)
                if any(_is_jobs(module) for module, _ in chain):
                    offenders.append(f"{rel(path)}:{node.lineno}: uses {_steps(chain)}")
    fail_on(offenders, "flows do not reach the jobs")


def _steps(chain: list[tuple[str, str | None]]) -> str:
    """``tasks.stages.open_store = rlhf_core.jobs.process.open_store``: a name and what it re-exports."""
    return " = ".join(module if name is None else f"{module}.{name}" for module, name in chain)


def test_task_progress_comes_from_job_events_not_log_text():
    """The task layer reads no log text for meaning: no regular expressions, and the launcher follows the events
    file (tests/test_launch_events.py shows the behaviour)."""
    offenders = [
        f"{rel(path)}:{line}: imports re (parses log text)"
        for path in source_files("tasks")
        for line, name in imports(path)
        if name == "re"
    ]
    fail_on(offenders, "tasks read events, not log text")
    launch = (ROOT / "tasks" / "launch.py").read_text()
    assert "read_new" in launch and "EVENTS_ENV" in launch


# ---------------------------------------------------------------------------------------------------------------------
# Import cycles


def import_graph() -> dict[str, dict[str, int]]:
    """module -> {imported project module: line}, lazy imports included. ``from pkg import X`` where ``pkg``'s
    ``__init__`` re-exports X from a submodule points at that submodule: ``pkg`` itself only runs the import."""
    modules = project_modules()
    graph: dict[str, dict[str, int]] = {}
    for module, path in modules.items():
        edges = graph.setdefault(module, {})
        for node in walk(parse(path)):
            if isinstance(node, ast.Import):
                targets = [_known_module(alias.name) for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = from_base(path, node)
                targets = [_import_target(base, alias.name) for alias in node.names]
            else:
                continue
            for target in targets:
                if target is not None and target != module:
                    edges.setdefault(target, node.lineno)
    return graph


def _known_module(name: str) -> str | None:
    """The deepest project module of a dotted name (``rlhf_core.jobs.ppo.X`` -> ``rlhf_core.jobs.ppo``)."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in project_modules():
            return ".".join(parts[:n])
    return None


def _import_target(base: str, name: str) -> str | None:
    if f"{base}.{name}" in project_modules():
        return f"{base}.{name}"
    path = project_modules().get(base)
    if path is not None and path.name == "__init__.py":  # a package re-exporting X: the edge is to X's module
        bound = bindings(base).get(name)
        if bound is not None and bound[1] in project_modules():
            return bound[1]
    return _known_module(base)


def strongly_connected(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Tarjan's strongly connected components of ``graph``, each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, {})):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return components


def test_strongly_connected_finds_cycles_and_only_cycles():
    """The cycle finder itself: a 3-cycle and a 2-cycle are found, the chains leading into them are not cycles."""
    graph = {"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1, "d": 1}, "d": {"e": 1}, "e": {"d": 1}, "f": {"a": 1, "g": 1}}
    graph |= {"g": {"h": 1}, "h": {}}
    assert sorted(c for c in strongly_connected(graph) if len(c) > 1) == [["a", "b", "c"], ["d", "e"]]


def test_no_import_cycles():
    """No import cycle among the modules of rlhf_core, tasks, flows and deployments, lazy imports included."""
    graph = import_graph()
    offenders = []
    for component in strongly_connected(graph):
        if len(component) < 2:
            continue
        offenders.append(f"cycle among {', '.join(component)}:")
        for module in component:
            for target, line in sorted(graph[module].items(), key=lambda edge: edge[1]):
                if target in component:
                    offenders.append(f"  {rel(project_modules()[module])}:{line}: {module} imports {target}")
    fail_on(offenders, "import cycles")


WEIGHT_SYNC = "rlhf_core.distributed.weight_sync"
ROLLOUT = "rlhf_core.distributed.rollout"


def test_the_weight_sync_imports_nothing_from_the_rollout_engines():
    """The arrow runs one way, rollout -> weight_sync: the engines receive weights through the weight sync, and the
    sender takes what it needs from them as arguments. No module of distributed/weight_sync imports from
    distributed/rollout (lazy and TYPE_CHECKING imports included)."""
    offenders = [
        f"{rel(path)}:{line}: imports {name}"
        for path in source_files("rlhf_core/distributed/weight_sync")
        for line, name in imports(path)
        if name == ROLLOUT or name.startswith(ROLLOUT + ".")
    ]
    fail_on(offenders, "the weight sync imports the rollout engines")
    assert source_files("rlhf_core/distributed/weight_sync") and (ROOT / "rlhf_core/distributed/rollout").is_dir()


# ---------------------------------------------------------------------------------------------------------------------
# Size budgets

MAX_LINES = 600  # any module of rlhf_core, tasks, flows and scripts, stage modules and the GPU check included
REPORT_LINES = 500  # library modules (all but rlhf_core/jobs) above this are reported, not failed


def test_module_size_budgets():
    """No module of rlhf_core, tasks, flows or scripts passes 600 lines; library modules over 500 lines are
    reported."""
    offenders, reported = [], []
    for path in source_files("rlhf_core", "tasks", "flows", "scripts"):
        lines = len(path.read_text().splitlines())
        if lines > MAX_LINES:
            offenders.append(f"{rel(path)}:{MAX_LINES + 1}: {lines} lines, the budget is {MAX_LINES}")
        elif lines > REPORT_LINES and not rel(path).startswith("rlhf_core/jobs/"):
            reported.append(f"{rel(path)}:{REPORT_LINES + 1}: {lines} lines, a library module's aim is {REPORT_LINES}")
    if reported:
        warnings.warn("library modules over their aim:\n" + "\n".join(reported), stacklevel=1)
    fail_on(offenders, "modules over the size budget")


CONFIG_MODULE_LINES = 400  # rlhf_core/config: one module per concern and per stage kind


def test_config_modules_are_small_and_kinds_refuse_nothing_by_list():
    """Each module of the config package stays under 400 lines, and a stage kind is its section, its job and its
    description: no list of keys it refuses (a kind's section has only the keys it reads, so the loader refuses any
    other as unknown)."""
    from rlhf_core.config import STAGE_KINDS, StageKind

    offenders = []
    for path in sorted((ROOT / "rlhf_core" / "config").glob("*.py")):
        lines = len(path.read_text().splitlines())
        if lines > CONFIG_MODULE_LINES:
            offenders.append(
                f"{rel(path)}:{CONFIG_MODULE_LINES + 1}: {lines} lines, the budget is {CONFIG_MODULE_LINES}"
            )
    fail_on(offenders, "config modules over the size budget")
    assert [f.name for f in dataclasses.fields(StageKind)] == ["name", "section", "job", "description"]
    assert all(callable(getattr(kind.section, "validate", None)) for kind in STAGE_KINDS.values())


# ---------------------------------------------------------------------------------------------------------------------
# One home for each fact

RUN_LAYOUT = ROOT / "rlhf_core" / "run_layout.py"
# The names of a run folder's entries (rlhf_core/run_layout.py names them); "checkpoints" only beside a slash, as the
# word also appears in messages.
RUN_PATH = re.compile(
    r"(?<![\w.])(_leases|_launches|_prefect/results|reference_logprobs|metrics\.json|curves\.png|trainer_state\.json"
    r"|controller_state\.json|config\.yaml|pipeline\.json|run_summary\.json)(?![\w])"
    r"|(?<![\w.])checkpoints/|/checkpoints(?!\w)"
)


def string_constants(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, text) of the string constants of ``tree``, the constant parts of f-strings included; strings that
    stand alone as statements (docstrings) are left out."""
    alone = {id(node.value) for node in walk(tree) if isinstance(node, ast.Expr)}
    return [
        (node.lineno, node.value)
        for node in walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in alone
    ]


def test_run_folder_paths_are_named_in_run_layout_only():
    """No string in rlhf_core, tasks or flows names a run-folder path (checkpoints/, _leases, metrics.json, ...)
    outside rlhf_core/run_layout.py."""
    offenders = [
        f"{rel(path)}:{line}: {text!r}"
        for path in source_files("rlhf_core", "tasks", "flows")
        if path != RUN_LAYOUT
        for line, text in string_constants(parse(path))
        if RUN_PATH.search(text)
    ]
    fail_on(offenders, "run-folder paths outside rlhf_core/run_layout.py")


def test_run_path_pattern():
    """The pattern above: path uses match, words and other files do not."""
    for text in ("/checkpoints/step_", "/checkpoints", "checkpoints/", "_leases", "/metrics.json", "_prefect/results"):
        assert RUN_PATH.search(text), text
    for text in ("no checkpoints kept", "gradient_checkpointing", "eval_metrics.json", "my_leases", "config.yamlx"):
        assert not RUN_PATH.search(text), text


# ---------------------------------------------------------------------------------------------------------------------
# Stage modules

JOBS = ROOT / "rlhf_core" / "jobs"
# Where each training stage's step loop lives: its own module, the preference trainer for DPO and KTO (whose modules
# hold their losses), the controller for PPO.
STEP_LOOPS = {
    "sft": JOBS / "sft.py",
    "reward_model": JOBS / "reward_model.py",
    "dpo and kto": JOBS / "preference.py",
    "ppo": JOBS / "ppo" / "controller.py",
}
# The supervised step loops, written alike on purpose (a reader who knows one knows all): (module, rank class).
ALIKE_LOOPS = (
    (JOBS / "sft.py", "SFTTrainer"),
    (JOBS / "reward_model.py", "RewardModelTrainer"),
    (JOBS / "preference.py", "PreferenceTrainer"),
)


def _is_step_loop(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.For)
        and isinstance(node.target, ast.Name)
        and node.target.id == "step"
        and isinstance(node.iter, ast.Call)
        and isinstance(node.iter.func, ast.Name)
        and node.iter.func.id == "range"
    )


def test_every_training_stage_owns_its_step_loop():
    """Each training stage's step loop (``for step in range(...)``) is written in its own job module, DPO's and KTO's
    in the preference trainer beside them, PPO's in its controller."""
    offenders = []
    for kind, path in STEP_LOOPS.items():
        if not path.exists():
            offenders.append(f"{rel(path)}:1: missing ({kind})")
        elif not any(_is_step_loop(node) for node in walk(parse(path))):
            offenders.append(f"{rel(path)}:1: no `for step in range(...)` loop ({kind})")
    fail_on(offenders, "training stages without their own step loop")


class _Normalise(ast.NodeTransformer):
    """What may differ between loops meant to be alike: the preference trainer calls its method's loss
    (``self.method.loss``) where the others call their own (``self.loss``)."""

    def visit_Attribute(self, node: ast.Attribute) -> ast.AST:
        self.generic_visit(node)
        value = node.value
        if isinstance(value, ast.Attribute) and ast.unparse(value) == "self.method":
            return ast.copy_location(ast.Attribute(value=value.value, attr=node.attr, ctx=node.ctx), node)
        return node


def normalised_step_loop(source: str, cls: str) -> str | None:
    """The step loop of ``cls.fit`` in ``source``, normalised (comments and layout gone, ``self.method.X`` read as
    ``self.X``); None when the class, its ``fit`` or the loop is missing."""
    for node in ast.parse(source).body:
        if isinstance(node, ast.ClassDef) and node.name == cls:
            fit = next((f for f in node.body if isinstance(f, ast.FunctionDef) and f.name == "fit"), None)
            loop = next((n for n in ast.walk(fit) if _is_step_loop(n)), None) if fit else None
            return ast.unparse(_Normalise().visit(loop)) if loop else None
    return None


def loop_drifts(sources: dict[str, tuple[str, str]]) -> list[str]:
    """Offenders among ``{name: (source, class)}``: a loop missing, or a loop that differs from the first one's,
    with the first line where they part."""
    loops = {name: normalised_step_loop(source, cls) for name, (source, cls) in sources.items()}
    (first, model), offenders = next(iter(loops.items())), []
    for name, loop in loops.items():
        if loop is None:
            offenders.append(f"{name}: no `for step in range(...)` loop in {sources[name][1]}.fit")
        elif model is not None and loop != model:
            here, there = loop.splitlines(), model.splitlines()
            at = next((i for i, (a, b) in enumerate(zip(here, there)) if a != b), min(len(here), len(there)))
            shown = here[at].strip() if at < len(here) else "(ends)"
            offenders.append(f"{name}: its step loop parts from {first}'s at loop line {at + 1}: {shown}")
    return offenders


def test_the_supervised_step_loops_are_alike():
    """The step loops of sft, reward_model and the preference trainer (DPO, KTO) are the same code once normalised:
    a change to one (a metric averaged differently, a checkpoint saved elsewhere) must be made to all."""
    sources = {rel(path): (path.read_text(), cls) for path, cls in ALIKE_LOOPS}
    fail_on(loop_drifts(sources), "supervised step loops that drifted apart")


def test_a_planted_drift_in_one_alike_loop_fails():
    """The check above on the real loops with one change planted in the reward model's: it is found and named."""
    sources = {rel(path): (path.read_text(), cls) for path, cls in ALIKE_LOOPS}
    name = rel(JOBS / "reward_model.py")
    text, cls = sources[name]
    planted = "sums[k] = sums.get(k, 0.0) + v / strategy.accumulation_steps"
    assert planted in text
    sources[name] = (text.replace(planted, "sums[k] = sums.get(k, 0.0) + v"), cls)
    assert loop_drifts(sources) == [
        f"{name}: its step loop parts from {rel(JOBS / 'sft.py')}'s at loop line 11: sums[k] = sums.get(k, 0.0) + v"
    ]
    sources[name] = (text.replace("for step in range(", "for i in range("), cls)
    assert loop_drifts(sources) == [f"{name}: no `for step in range(...)` loop in {cls}.fit"]


def test_no_job_module_subclasses_another_job_modules_class():
    """A class in rlhf_core/jobs/X.py has no base class defined in another rlhf_core/jobs module."""
    offenders = []
    for path in source_files("rlhf_core/jobs"):
        me = module_name(path)
        for node in walk(parse(path)):
            if not isinstance(node, ast.ClassDef):
                continue
            for base in node.bases:
                found = _job_class(me, base.value if isinstance(base, ast.Subscript) else base)
                if found is not None and found != me:
                    offenders.append(
                        f"{rel(path)}:{node.lineno}: {node.name} subclasses {ast.unparse(base)} of {found}"
                    )
    fail_on(offenders, "job classes built on other job modules' classes")


def _job_class(module: str, base: ast.expr) -> str | None:
    """The jobs module that defines the class ``base`` names, seen from ``module``; None when it is no jobs class."""
    if isinstance(base, ast.Name):
        chain = origin(module, base.id)
    elif isinstance(base, ast.Attribute) and isinstance(base.value, ast.Name):
        bound = bindings(module).get(base.value.id)
        if bound is None or bound[2] is not None:  # not a module alias
            return None
        chain = origin(bound[1], base.attr)
    else:
        return None
    defining, name = chain[-1]
    if name is None or not _is_jobs(defining) or defining not in project_modules():
        return None
    classes = {node.name for node in parse(project_modules()[defining]).body if isinstance(node, ast.ClassDef)}
    return defining if name in classes else None


# ---------------------------------------------------------------------------------------------------------------------
# Remote calls

REMOTE_CALLS = {"call", "call_async", "call_each", "call_each_async", "collective_rpc"}
# Where Ray's `.remote(...)` may be called: the worker group calls the role shells it hosts, the engine group the
# engines. Everything else calls roles through `group.call(Role.method, ...)` and engines through the engine group.
REMOTE_HOSTS = {
    "rlhf_core/distributed/launcher.py": "the role shells",
    "rlhf_core/distributed/rollout/group.py": "the engine handles",
}


def test_no_remote_call_by_method_name_string():
    """Role methods are called through the role's own method objects (a grep finds the callers, a wrong signature
    fails at once), never by a method name in a string or a getattr."""
    offenders = []
    for path in source_files("rlhf_core", "tasks", "flows"):
        for node in walk(parse(path)):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            first = node.args[0] if node.args else None
            if node.func.attr in REMOTE_CALLS and isinstance(first, ast.Constant) and isinstance(first.value, str):
                offenders.append(f"{rel(path)}:{node.lineno}: {node.func.attr}({first.value!r})")
            if node.func.attr == "remote" and _is_getattr(node.func.value):
                offenders.append(f"{rel(path)}:{node.lineno}: getattr(...).remote")
    for host in REMOTE_HOSTS:
        if (ROOT / host).exists():
            offenders += [f"{host}:{n.lineno}: getattr dispatch" for n in walk(parse(ROOT / host)) if _is_getattr(n)]
    fail_on(offenders, "remote calls by name")


def _is_getattr(node: ast.AST) -> bool:
    """A ``getattr(obj, name)`` that looks a method up by name; reading a dunder (``__name__``) is none."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"):
        return False
    name = node.args[1] if len(node.args) > 1 else None
    return not (isinstance(name, ast.Constant) and isinstance(name.value, str) and name.value.startswith("__"))


def test_remote_is_called_only_by_the_worker_group_and_the_engine_group():
    """Ray's ``.remote(...)`` is called only in launcher.py (role shells) and rollout/group.py (engine handles)."""
    offenders = [
        f"{rel(path)}:{node.lineno}: {ast.unparse(node.func)}(...)"
        for path in source_files(*LAYERS)
        if rel(path) not in REMOTE_HOSTS
        for node in walk(parse(path))
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "remote"
        and not (isinstance(node.func.value, ast.Name) and node.func.value.id == "ray")  # ray.remote(cls): a class
    ]
    fail_on(offenders, "`.remote(` outside the worker group and the engine group")


# ---------------------------------------------------------------------------------------------------------------------
# Formatting

FORMAT_OFF = re.compile(r"#\s*fmt:\s*(skip|off)\b")


def test_no_formatter_escapes():
    """No ``fmt: skip`` or ``fmt: off`` comment: ruff formats every line of the project."""
    offenders = []
    for path in source_files(*LAYERS, "tests", "bench", "scripts"):
        for token in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
            if token.type == tokenize.COMMENT and FORMAT_OFF.search(token.string):
                offenders.append(f"{rel(path)}:{token.start[0]}: {token.string.strip()}")
    fail_on(offenders, "formatter escapes")


# ---------------------------------------------------------------------------------------------------------------------
# Collectives

# torch.distributed's collectives, and the methods a ProcessGroup object exposes for them.
COLLECTIVES = {
    "all_reduce",
    "broadcast",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all",
    "all_gather_object",
    "broadcast_object_list",
    "scatter",
    "gather",
    "reduce",
    "barrier",
}
GROUP_METHODS = {"allreduce", "allgather", "broadcast", "all_reduce", "reduce_scatter", "alltoall"}
DEVICE_MODULE = ROOT / "rlhf_core" / "distributed" / "device.py"


def _collective_calls(path: Path) -> list[tuple[int, str]]:
    """(line, what) of each torch.distributed collective issued in ``path``: ``dist.X(...)`` /
    ``torch.distributed.X(...)``, ``<group>.broadcast/allreduce(...)`` on any object, and collectives imported by
    name from torch.distributed."""
    tree = parse(path)
    aliases = {"torch.distributed"}
    found = []
    for node in walk(tree):
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
    for node in walk(tree):
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
        f"{rel(path)}:{line}: {what}"
        for path in source_files("rlhf_core")
        if path != DEVICE_MODULE
        for line, what in _collective_calls(path)
    ]
    fail_on(offenders, "collectives outside rlhf_core/distributed/device.py")
    # and the helper really is the one issuing them
    issued = {what.split("(")[0].rsplit(".", 1)[-1] for _, what in _collective_calls(DEVICE_MODULE)}
    assert {"all_reduce", "broadcast", "all_gather_object", "broadcast_object_list", "barrier"} <= issued, issued


# ---------------------------------------------------------------------------------------------------------------------
# Tests pass a cluster

# Where worker groups and engines come from: jobs take the cluster they run on (rlhf_core/distributed/cluster.py), so
# a test passes a LocalCluster (or one that refuses to start anything) instead of swapping these modules' attributes.
PATCH_GUARDED = ("rlhf_core.distributed.launcher", "rlhf_core.distributed.rollout", "rlhf_core.jobs")


def _guarded(dotted: str) -> bool:
    return any(dotted == g or dotted.startswith(g + ".") for g in PATCH_GUARDED)


def _import_names(path: Path) -> dict[str, str]:
    """What each name bound by an import of ``path`` (function-level ones included) stands for, dotted: ``launcher``
    -> rlhf_core.distributed.launcher, ``EngineGroup`` -> rlhf_core.distributed.rollout.group.EngineGroup."""
    out: dict[str, str] = {}
    for node in walk(parse(path)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                root = alias.name.split(".")[0]
                out[alias.asname or root] = alias.name if alias.asname else root
        elif isinstance(node, ast.ImportFrom):
            base = from_base(path, node)
            out.update({alias.asname or alias.name: f"{base}.{alias.name}" for alias in node.names})
    return out


def _dotted(node: ast.AST, names: dict[str, str]) -> str | None:
    """The dotted name an expression stands for (``launcher.RayWorkerGroup`` ->
    rlhf_core.distributed.launcher.RayWorkerGroup); None when it is no imported name or attribute of one."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name) or node.id not in names:
        return None
    return ".".join([names[node.id], *reversed(parts)])


def swapped_attributes(path: Path) -> list[tuple[int, str]]:
    """(line, what) of each ``setattr(target, ...)`` / ``monkeypatch.setattr(target, ...)`` / ``m.setattr(...)`` in
    ``path`` whose target is the launcher, a rollout module or a job module (or a name imported from one), the
    ``"pkg.module.name"`` string form included. A ``setattr`` whose target is a local variable (a loop over a table of
    swaps) is resolved through the table: every tuple ``(target, "name", ...)`` of the file is checked."""
    tree, names = parse(path), _import_names(path)
    found: list[tuple[int, str]] = []
    unresolved = False
    for node in walk(tree):
        if not (isinstance(node, ast.Call) and node.args):
            continue
        func = node.func
        if not (
            (isinstance(func, ast.Name) and func.id == "setattr")
            or (isinstance(func, ast.Attribute) and func.attr == "setattr")
        ):
            continue
        first = node.args[0]
        if isinstance(first, ast.Constant) and isinstance(first.value, str):
            target: str | None = first.value
        else:
            target = _dotted(first, names)
        if target is None:
            unresolved = True
        elif _guarded(target):
            found.append((node.lineno, f"{ast.unparse(func)}({target}, ...)"))
    if unresolved:
        for node in walk(tree):
            if not (isinstance(node, ast.Tuple) and len(node.elts) >= 2):
                continue
            name = node.elts[1]
            target = _dotted(node.elts[0], names)
            if target and _guarded(target) and isinstance(name, ast.Constant) and isinstance(name.value, str):
                found.append((node.lineno, f"swaps {target}.{name.value}"))
    return sorted(found)


def test_tests_pass_a_cluster_instead_of_swapping_module_attributes():
    """No test swaps an attribute of the launcher, a rollout module or a job module: a job takes the cluster it runs
    on (``LocalCluster`` in this process, or a cluster that refuses to start workers), so nothing else needs
    patching."""
    offenders = [
        f"{rel(path)}:{line}: {what}" for path in source_files("tests") for line, what in swapped_attributes(path)
    ]
    fail_on(offenders, "module attributes swapped in tests (pass a cluster instead)")


def test_swapped_attributes_finds_every_form(tmp_path):
    """The check above on a file holding each form it must find, and the patches it must leave alone."""
    source = tmp_path / "test_sample.py"
    source.write_text(
        "import rlhf_core.jobs.ppo\n"
        "from rlhf_core.distributed import launcher\n"
        "from rlhf_core.distributed.rollout.group import EngineGroup\n"
        "from rlhf_core import compare\n"
        "def test_a(monkeypatch):\n"
        "    monkeypatch.setattr(launcher, 'run_group', None)\n"
        "    with monkeypatch.context() as m:\n"
        "        m.setattr(EngineGroup, 'create', None)\n"
        "    monkeypatch.setattr('rlhf_core.jobs.ppo.load_inputs', None)\n"
        "    monkeypatch.setattr(rlhf_core.jobs.ppo, 'PPOController', None)\n"
        "    monkeypatch.setattr(compare.curves, 'figure_png', None)\n"
        "    monkeypatch.setattr('os.environ', {})\n"
        "def swap():\n"
        "    from rlhf_core.distributed.rollout import group as rollout_group\n"
        "    for module, name, value in [(launcher, 'wait', list), (rollout_group, 'EngineGroup', None)]:\n"
        "        setattr(module, name, value)\n"
    )
    assert [line for line, _ in swapped_attributes(source)] == [6, 8, 9, 10, 15, 15]
