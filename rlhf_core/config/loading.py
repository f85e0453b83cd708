"""From a YAML preset and ``key=value`` overrides to a validated ``PipelineConfig``: strict YAML, the loop's
expansion into instances, and the coercion of every value to its field's type."""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import yaml

from rlhf_core.config.fields import MISSING, ConfigError, is_section, join_key
from rlhf_core.config.kinds import STAGE_KINDS
from rlhf_core.config.pipeline import STAGE_NAME, STAGE_PREFIX, LoopConfig, PipelineConfig, StageSpec
from rlhf_core.config.validation import validate

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

_TOP_LEVEL = ("run_uri", "storage", "stages", "loop", "tracking")
LOOP_POLICY = "loop:policy"


# ---------------------------------------------------------------------------------------------------------------------
# Strict YAML


class DuplicateKeyError(yaml.YAMLError):
    """A YAML mapping names one key twice (PyYAML would keep the last value without a word)."""

    def __init__(self, key: Any, line: int, first: int):
        super().__init__(
            f"key '{key}' appears twice in one mapping (first at line {first}): the later value would "
            "silently win; keep one"
        )
        self.line = line


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping (keys merged in with ``<<:`` may be overridden)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            if not isinstance(key, (str, int, float, bool)):
                continue
            line = key_node.start_mark.line + 1
            if key in seen:
                raise DuplicateKeyError(key, line, seen[key])
            seen[key] = line
        return super().construct_mapping(node, deep)


def strict_yaml(text: str) -> Any:
    """``yaml.safe_load`` that refuses duplicate keys (DuplicateKeyError)."""
    return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 (a SafeLoader subclass)


def _yaml_problem(e: yaml.YAMLError) -> str:
    """A YAML error on one line: its problem and where."""
    mark = getattr(e, "problem_mark", None)
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    return where + " ".join(str(getattr(e, "problem", None) or e).split())


# ---------------------------------------------------------------------------------------------------------------------
# load_config and the loop


def load_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> PipelineConfig:
    """Merge a YAML preset and ``a.b.c=value`` overrides into a validated ``PipelineConfig``.

    An override whose first part is a stage name is shorthand for ``stages.<name>...``: ``sft.optim.lr=1e-4``.
    """
    raw: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        try:
            raw = strict_yaml(path.read_text(encoding="utf-8-sig")) or {}
        except DuplicateKeyError as e:
            raise ConfigError(f"config file {path} line {e.line}: {e}") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {path} is not valid YAML: {_yaml_problem(e)}") from None
        except UnicodeDecodeError as e:
            line = path.read_bytes()[: e.start].count(b"\n") + 1
            raise ConfigError(
                f"config file {path} line {line}: not valid UTF-8 (byte 0x{e.object[e.start]:02x})"
            ) from None
        if not isinstance(raw, dict):
            raise ConfigError(f"config file {path} must hold a mapping at the top level")
        raw = _unalias(raw)
        for key in raw:
            if key not in _TOP_LEVEL:
                hint = f"; stage sections go under 'stages:' (stages.{key}.kind: ...)" if key in STAGE_KINDS else ""
                raise ConfigError(f"unknown config key '{key}' at the top level of {path}{hint}")
    parsed = []
    for item in overrides:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"override '{item}' is not of the form key=value")
        try:
            parsed.append((key, strict_yaml(value) if value.strip() else None))
        except yaml.YAMLError as e:
            raise ConfigError(f"override '{item}': the value is not valid YAML ({_yaml_problem(e)})") from None
    for key, value in parsed:  # run-level keys and the loop first: the loop's instances are made from them
        if key.split(".")[0] in _TOP_LEVEL and not key.startswith("stages."):
            _set_dotted(raw, key, value)
    loop = _build(LoopConfig, raw.pop("loop", None) or {}, "loop")
    stages = raw.pop("stages", None) or {}
    if not isinstance(stages, dict):
        raise ConfigError("'stages' must be a mapping of stage names to sections")
    stages, iterations = expand_loop(loop, stages)
    raw["stages"] = stages
    for key, value in parsed:  # <stage>.a.b: shorthand for stages.<stage>.a.b; <loop stage>.a.b: every iteration's
        head = key.split(".")[0]
        if head in _TOP_LEVEL and not key.startswith("stages."):
            continue
        rest = key.removeprefix("stages.")
        head, _, tail = rest.partition(".")
        targets = [f"{head}_{i}" for i in range(1, loop.iterations + 1)] if head in loop.stages else [head]
        for target in targets:
            _set_dotted(raw, f"stages.{target}.{tail}" if tail else f"stages.{target}", value)
    stages = raw.pop("stages")
    cfg = _build(PipelineConfig, raw, "")
    cfg.loop, cfg.iterations = loop, iterations
    cfg.stages = {name: _build_stage(str(name), entry) for name, entry in stages.items()}
    validate(cfg)
    return cfg


def expand_loop(loop: LoopConfig, stages: dict) -> tuple[dict, dict[str, int]]:
    """The preset's stages plus K copies of the loop's: instance ``<name>_<i>`` of iteration i, its ``stage:<name>``
    references to loop stages turned into ``stage:<name>_<i>`` and ``loop:policy`` into the iteration's policy
    (``loop.policy`` for the first, ``stage:<next_policy>_<i-1>`` after it)."""
    if loop.iterations < 0:
        raise ConfigError(f"invalid value {loop.iterations} for 'loop.iterations': must be >= 0")
    if loop.iterations == 0:
        if loop.stages:
            raise ConfigError("'loop.stages' is set but 'loop.iterations' is 0: set loop.iterations to K >= 1")
        return dict(stages), {}
    if not loop.stages:
        raise ConfigError("'loop.iterations' is set but 'loop.stages' is empty: list the stages of one iteration")
    if loop.next_policy not in loop.stages:
        raise ConfigError(
            f"invalid value {loop.next_policy!r} for 'loop.next_policy': name the loop stage whose output is the next "
            f"policy (one of {', '.join(loop.stages)})"
        )
    if not loop.policy:
        raise ConfigError("'loop.policy' is required: the first iteration's policy, e.g. stage:sft")
    clash = sorted(set(loop.stages) & set(stages))
    if clash:
        raise ConfigError(
            f"loop stage '{clash[0]}' has the name of a stage under 'stages': rename one (inside the loop, "
            f"stage:{clash[0]} means the iteration's own instance)"
        )
    out, iterations = dict(stages), {}
    for i in range(1, loop.iterations + 1):
        policy = loop.policy if i == 1 else f"{STAGE_PREFIX}{loop.next_policy}_{i - 1}"
        for base, entry in loop.stages.items():
            name = f"{base}_{i}"
            if name in out:
                raise ConfigError(f"loop stage '{base}' of iteration {i} is named '{name}', which 'stages' has too")
            if not isinstance(entry, dict):
                raise ConfigError(f"'loop.stages.{base}' must be a mapping (a stage section)")
            entry = dict(entry)
            entry.setdefault("kind", base if base in STAGE_KINDS else None)
            out[name] = _rename(entry, set(loop.stages), i, policy)
            iterations[name] = i
    return out, iterations


def _rename(node: Any, loop_names: set[str], i: int, policy: str) -> Any:
    if isinstance(node, dict):
        return {k: _rename(v, loop_names, i, policy) for k, v in node.items()}
    if isinstance(node, list):
        return [_rename(v, loop_names, i, policy) for v in node]
    if node == LOOP_POLICY:
        return policy
    if isinstance(node, str) and node.startswith(STAGE_PREFIX) and node[len(STAGE_PREFIX) :] in loop_names:
        return f"{node}_{i}"
    return node


def _build_stage(name: str, entry: Any) -> StageSpec:
    if not isinstance(entry, dict):
        raise ConfigError(
            f"unknown config key '{name}': top-level keys are {', '.join(_TOP_LEVEL)}, and a stage section "
            f"(stages.{name}) must be a mapping"
        )
    if not STAGE_NAME.match(name):
        raise ConfigError(f"invalid stage name '{name}': use lowercase letters, digits and _ (it names a folder)")
    entry = dict(entry)
    kind = entry.pop("kind", name if name in STAGE_KINDS else None)
    if kind not in STAGE_KINDS:
        close = difflib.get_close_matches(str(kind), STAGE_KINDS, n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        what = f"unknown kind {kind!r}" if kind is not None else "no kind"
        raise ConfigError(f"stage '{name}' has {what}: set '{name}.kind' to one of {', '.join(STAGE_KINDS)}{hint}")
    return StageSpec(name, kind, _build(STAGE_KINDS[kind].section, entry, name))


def _unalias(node: Any) -> Any:
    """Copy a YAML tree so that sections shared through anchors (&x / *x) stop sharing: an override of one
    stage's section must not change another's."""
    if isinstance(node, dict):
        return {k: _unalias(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_unalias(v) for v in node]
    return node


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted keys of a nested mapping, the inverse of ``_set_dotted``: ``{"optim": {"lr": 1e-4}}`` ->
    ``{"optim.lr": 1e-4}`` (an empty mapping is a value of its own)."""
    if isinstance(tree, dict) and tree:
        out: dict[str, Any] = {}
        for key, value in tree.items():
            out.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix: tree} if prefix else {}


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = tree
    for p in parents:
        child = node.get(p)
        if child is None:
            child = node[p] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"override '{dotted}': '{p}' is not a section")
        node = child
    node[leaf] = value


# ---------------------------------------------------------------------------------------------------------------------
# Sections from mappings: unknown keys refused, every value coerced to its field's type


def _build(cls: type, data: Any, prefix: str) -> Any:
    where = prefix or "the top level"
    if not isinstance(data, dict):
        raise ConfigError(f"'{prefix}' must be a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in data:
        if key not in fields:
            _refuse_moved(cls, prefix, key, data[key])
            close = difflib.get_close_matches(str(key), fields, n=1)
            hint = f"; did you mean '{join_key(prefix, close[0])}'?" if close else ""
            raise ConfigError(f"unknown config key '{join_key(prefix, key)}' in {where}{hint}")
    kwargs = {}
    for name, f in fields.items():
        key = join_key(prefix, name)
        if name in data:
            value = data[name]
            default = f.default_factory() if f.default_factory is not MISSING else None  # type: ignore[misc]
            if isinstance(value, dict) and dataclasses.is_dataclass(default):
                # A partial section overrides the stage's own defaults (e.g. the RM's higher learning rate).
                value = _deep_merge(dataclasses.asdict(typing.cast("DataclassInstance", default)), value)
            kwargs[name] = _coerce(hints[name], value, key)
        elif f.default is MISSING and f.default_factory is MISSING:  # type: ignore[misc]
            raise ConfigError(f"missing required config key '{key}': {f.metadata.get('help', '')}")
    return cls(**kwargs)


def _refuse_moved(cls: type, prefix: str, key: str, value: Any) -> None:
    """Refuse a key that an earlier version spelled this way (a section's ``RENAMED``: old name -> new relative path),
    naming the new spelling of the leaf that was set: 'ppo.actor_strategy.zero_stage' is now
    'ppo.actor.strategy.zero_stage'."""
    moved = getattr(cls, "RENAMED", {}).get(key)
    if moved is None:
        return
    leaf = next(iter(flatten(value)), "") if isinstance(value, dict) and value else ""
    if not _has_key(cls, f"{moved}.{leaf}" if leaf else moved):
        return  # a key that this kind never had (the critic warm-up's actor optimizer): refused as unknown
    old, new = join_key(prefix, key), join_key(prefix, moved)
    if leaf:
        old, new = f"{old}.{leaf}", f"{new}.{leaf}"
    raise ConfigError(f"'{old}' is now '{new}': the PPO-kind sections are grouped by role; rename the key")


def _has_key(cls: type, dotted: str) -> bool:
    """Whether the section ``cls`` has the (nested) key ``dotted``."""
    head, _, rest = dotted.partition(".")
    fields = {f.name for f in dataclasses.fields(cls)}
    if head not in fields:
        return False
    if not rest:
        return True
    tp = typing.get_type_hints(cls)[head]
    inner = [a for a in (tp, *typing.get_args(tp)) if is_section(a)]
    return bool(inner) and _has_key(inner[0], rest)


def _deep_merge(base: dict, update: dict) -> dict:
    out = dict(base)
    for k, v in update.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _coerce(tp: Any, value: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return _coerce(args[0], value, key)
    if is_section(tp):
        return _build(tp, value, key)
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            raise ConfigError(f"invalid value {value!r} for '{key}': choose one of {', '.join(map(str, choices))}")
        return value
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"invalid value {value!r} for '{key}': expected a mapping, e.g. {{name: 1}}")
        key_tp, value_tp = typing.get_args(tp)
        return {_coerce(key_tp, k, key): _coerce(value_tp, v, f"{key}.{k}") for k, v in value.items()}
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"invalid value {value!r} for '{key}': expected a list")
        (item_tp,) = typing.get_args(tp)
        return [_coerce(item_tp, v, f"{key}[{i}]") for i, v in enumerate(value)]
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"invalid value {value!r} for '{key}': expected true or false")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"invalid value {value!r} for '{key}': expected an integer")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads 1e-4 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"invalid value {value!r} for '{key}': expected a number")
        return float(value)
    if tp is str:
        if value is None or isinstance(value, (dict, list)):
            raise ConfigError(f"invalid value {value!r} for '{key}': expected a string")
        return str(value)
    return value
