"""Where a run config's values come from before they are validated: YAML files and
``--set dotted.key=value`` assignments, merged as plain mappings.

Errors are :class:`~forgerl.errors.ConfigError`, one line naming the file, line or key.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

from forgerl.configuration.capped_read import read_capped
from forgerl.errors import ConfigError

#: A config larger than this is not a config (a model file or a log given by mistake).
MAX_CONFIG_BYTES = 16 * 1024 * 1024
#: Values that aliases (``*name``) may add to a document once expanded. Anchors and merge
#: keys in a real config add dozens; a 450-byte "billion laughs" document adds 10**9, which
#: nothing downstream (merging, validation, config.yaml) can hold.
MAX_ALIAS_VALUES = 100_000


class AliasBomb(ConfigError):
    """A document whose aliases expand past :data:`MAX_ALIAS_VALUES`, or refer to themselves."""


class _ConfigLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (PyYAML silently
    keeps the last one, so a duplicated section would hide half of what the user wrote)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                duplicate = key in seen
            except TypeError:  # unhashable: the base class reports it
                break
            line = key_node.start_mark.line + 1
            if duplicate:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} is given twice (lines {seen[key]} and {line})", key_node.start_mark
                )
            seen[key] = line
        return super().construct_mapping(node, deep)

    def get_single_node(self) -> yaml.Node | None:
        # Checked on the composed graph, where an alias is one shared node: before anything
        # (construction included) walks the document as the tree it expands to.
        node = super().get_single_node()
        if node is not None:
            check_alias_expansion(node)
        return node


def check_alias_expansion(root: yaml.Node) -> None:
    """Refuse a composed document whose aliases would expand it by more than
    :data:`MAX_ALIAS_VALUES` values, or that contains itself (``&a [*a]``). Linear in the
    distinct nodes: the expanded size of each node is computed once."""
    expanded: dict[int, int] = {}
    on_path: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:  # iterative post-order: a deeply nested document must not hit the recursion limit
        node, children_done = stack.pop()
        if id(node) in expanded:
            continue
        children = _children(node)
        if children_done:
            on_path.discard(id(node))
            expanded[id(node)] = 1 + sum(expanded[id(c)] for c in children)
            continue
        on_path.add(id(node))
        stack.append((node, True))
        for child in children:
            if id(child) in on_path:  # the nodes being expanded: this one's ancestors
                raise AliasBomb(
                    f"an alias (line {child.start_mark.line + 1}) refers to a value that contains it; "
                    "a config cannot be recursive"
                )
            if id(child) not in expanded:
                stack.append((child, False))
    added = expanded[id(root)] - len(expanded)
    if added > MAX_ALIAS_VALUES:
        raise AliasBomb(
            f"its aliases (*name) expand it by {added:,} values, more than the {MAX_ALIAS_VALUES:,} "
            "a config may add that way; write the values out instead of repeating aliases"
        )


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    return []


def load_yaml(text: str) -> Any:
    """``text`` as YAML with the config loader's rules (safe types, no key given twice, aliases
    bounded); YAMLError, RecursionError or :class:`AliasBomb` otherwise."""
    return yaml.load(text, Loader=_ConfigLoader)  # noqa: S506 - a SafeLoader subclass


def read_yaml(path: str | Path) -> dict[str, Any]:
    """The top-level mapping of a YAML config file; ConfigError (one line) for anything else."""
    path = Path(path)
    try:
        # At most one byte past the limit: /dev/zero or a huge file must not fill memory.
        raw = read_capped(path, MAX_CONFIG_BYTES + 1)
    except (OSError, ValueError) as exc:  # ValueError: a NUL byte in the path
        reason = getattr(exc, "strerror", None) or str(exc)
        raise ConfigError(f"cannot read config file {str(path)!r}: {reason}") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{path}: larger than {MAX_CONFIG_BYTES // 2**20} MiB, not a config file")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{path}: not UTF-8 text (byte {exc.start}: {exc.reason}); a config is a YAML file"
        ) from None
    try:
        data = load_yaml(text)
    except AliasBomb as exc:
        raise AliasBomb(f"{path}: {exc}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(f"{path}{where}: not valid YAML ({' '.join(str(problem).split())})") from None
    except RecursionError:
        raise ConfigError(f"{path}: nested too deeply to be a config") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections, not {_describe(data)}")
    return data


def parse_set(assignments: Iterable[str]) -> list[tuple[list[str], Any]]:
    """``a.b.c=value`` strings → (path, value); values are read as YAML scalars."""
    parsed = []
    for item in assignments:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set {item!r}: expected dotted.key=value")
        path = key.strip().split(".")
        if any(not part.strip() for part in path):
            raise ConfigError(f"--set {item!r}: {key.strip()!r} has an empty part; expected dotted.key=value")
        try:
            value = load_yaml(raw) if raw.strip() else ""
        except AliasBomb as exc:
            raise AliasBomb(f"--set {key.strip()}: {exc}") from None
        except (yaml.YAMLError, RecursionError):
            value = raw
        parsed.append((path, value))
    return parsed


def apply_set(data: dict[str, Any], path: list[str], value: Any) -> None:
    node: Any = data
    for i, part in enumerate(path[:-1]):
        nxt = path[i + 1]
        if isinstance(node, list):
            node = node[_index(node, part, path)]
        else:
            if part not in node or node[part] is None:
                node[part] = [] if nxt.isdigit() else {}
            node = node[part]
        if not isinstance(node, (dict, list)):
            where = ".".join(path[: i + 1])
            raise ConfigError(
                f"--set {'.'.join(path)}: {where} is {_describe(node)}, not a section with keys"
            )
    last = path[-1]
    if isinstance(node, list):
        idx = int(last) if last.isdigit() else -1
        if idx == len(node):
            node.append(value)
        else:
            node[_index(node, last, path)] = value
    else:
        node[last] = value


def writable_section(data: dict[str, Any], key: str, source: str) -> dict[str, Any]:
    """``data[key]`` as a mapping a flag can write into (created when absent)."""
    if key not in data:
        data[key] = {}
    section = data[key]
    if not isinstance(section, dict):
        raise ConfigError(f"{source}: {key}: must be a mapping of keys, not {_describe(section)}")
    return section


def _describe(value: Any) -> str:
    if value is None:
        return "null"
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 60 else text[:57] + '...'}"


def _index(node: list[Any], part: str, path: list[str]) -> int:
    if not part.isdigit() or int(part) >= len(node):
        raise ConfigError(f"--set {'.'.join(path)}: {part!r} is not an index of a list of {len(node)}")
    return int(part)


def deep_merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """``over`` laid on ``base``: mappings merge key by key, anything else replaces."""
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def deep_copy(data: Any) -> Any:
    """A copy of nested mappings and lists that flags and ``--set`` may write into."""
    if isinstance(data, Mapping):
        return {k: deep_copy(v) for k, v in data.items()}
    if isinstance(data, list):
        return [deep_copy(v) for v in data]
    return data
