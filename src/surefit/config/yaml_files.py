"""Reading config files: YAML through a capped ``yaml.SafeLoader`` (a config from elsewhere is data, not code, and
may be hostile), and the shipped presets.
"""

from __future__ import annotations

import difflib
from importlib.resources import files
from pathlib import Path
from typing import Any

import yaml

from surefit.errors import ConfigError, Problem


def load_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML config (``safe_load``) into a flat mapping with keys in underscore form."""
    import stat

    path = Path(path)
    if path.exists() and not path.is_file() and not path.is_dir():
        mode = path.stat().st_mode
        kind = "a named pipe" if stat.S_ISFIFO(mode) else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else \
            "not a regular file"
        raise ConfigError(Problem(f"{path} is {kind}: reading it could block forever or never end", "--config",
                                  "pass a YAML file"))
    if not path.is_file():
        raise ConfigError(Problem(f"config file not found: {path}", "--config", "check the path"))
    with path.open("rb") as fh:
        raw = fh.read(MAX_CONFIG_BYTES + 1)
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(Problem(f"{path} is larger than {MAX_CONFIG_BYTES // 1024} KiB; a config holds settings, "
                                  "not data", "--config", "pass the settings file (data goes in --data)"))
    try:
        data = load_yaml_text(raw.decode("utf-8"))  # yaml.SafeLoader with caps: safe_load's construction
    except (yaml.YAMLError, UnicodeDecodeError, RecursionError) as e:
        raise ConfigError(Problem(f"cannot parse {path}: {e}", "--config", "fix the YAML syntax")) from e
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            Problem(f"{path} holds a {type(data).__name__}, not a mapping of settings", "--config", "write key: value lines")
        )
    return {str(k).replace("-", "_"): v for k, v in data.items()}


# A config file is a page of settings. These caps stop a hostile one early: 20,000 nested brackets (a RecursionError
# in the composer) and alias bombs (a few lines that expand to millions of nodes).
MAX_CONFIG_BYTES = 1 << 20
MAX_CONFIG_DEPTH = 32
MAX_CONFIG_ALIASES = 100
MAX_CONFIG_NODES = 100_000  # values once every alias is expanded


class _ConfigLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` with a cap on nesting depth and on the number of aliases (``*name``)."""

    def __init__(self, stream: Any) -> None:
        super().__init__(stream)
        self._depth = 0
        self._aliases = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            self._aliases += 1
            if self._aliases > MAX_CONFIG_ALIASES:
                raise yaml.composer.ComposerError(None, None, f"more than {MAX_CONFIG_ALIASES} aliases (*name): a "
                                                  "config does not need them, and they can expand without end",
                                                  self.peek_event().start_mark)
        self._depth += 1
        try:
            if self._depth > MAX_CONFIG_DEPTH:
                raise yaml.composer.ComposerError(None, None, f"nested more than {MAX_CONFIG_DEPTH} levels deep",
                                                  self.peek_event().start_mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def get_single_node(self) -> Any:
        node = super().get_single_node()
        if node is not None:
            sizes: dict[int, int] = {}

            def expanded(n: Any) -> int:  # shared (aliased) nodes are counted once per use, computed once
                if id(n) not in sizes:
                    sizes[id(n)] = 1
                    if isinstance(n, yaml.SequenceNode):
                        sizes[id(n)] += sum(expanded(c) for c in n.value)
                    elif isinstance(n, yaml.MappingNode):
                        sizes[id(n)] += sum(expanded(k) + expanded(v) for k, v in n.value)
                return sizes[id(n)]

            if expanded(node) > MAX_CONFIG_NODES:
                raise yaml.composer.ComposerError(None, None, f"its aliases expand to more than {MAX_CONFIG_NODES:,} "
                                                  "values (an alias bomb?)", node.start_mark)
        return node


# --- JSON from user input: one parser with a depth limit (a config's JSON values, data rows, tool-call arguments) --

# A settings object (model_args, head_args) is a few levels deep; past this the factory call, the saved config and
# the start-up cache key would recurse into a RecursionError.
MAX_JSON_DEPTH = 32


class TooDeep(ValueError):
    """JSON or YAML nested deeper than its limit (a ``ValueError``, so callers that catch bad JSON catch it too)."""


def check_depth(value: Any, limit: int) -> Any:
    """``value`` unchanged, or :class:`TooDeep` when its lists and mappings nest more than ``limit`` levels.

    Walks with a stack, not recursion, so the check itself cannot overflow.
    """
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, (list, tuple)) else None
        if children is None:
            continue
        if depth > limit:
            raise TooDeep(f"nested more than {limit} levels deep")
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list, tuple)))
    return value


def load_json(text: str | bytes, limit: int = MAX_JSON_DEPTH) -> Any:
    """``json.loads`` for text a user gave: malformed, too deep (also past Python's recursion limit) or an integer
    Python refuses all raise ``ValueError`` with a readable reason, never ``RecursionError``."""
    import json

    try:
        value = json.loads(text)
    except RecursionError:
        raise TooDeep(f"nested more than {limit} levels deep (past what Python's parser can follow)") from None
    return check_depth(value, limit)


def load_yaml_text(text: str) -> Any:
    """YAML a user or a run folder gave, through the same capped safe loader as ``--config`` (depth, aliases,
    expansion): raises ``yaml.YAMLError`` for hostile or malformed text."""
    loader = _ConfigLoader(text)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


# The package's own folder, wherever this module sits in it.
PRESET_DIR = Path(str(files("surefit"))) / "presets"


def list_presets() -> list[str]:
    """Names of the presets shipped with surefit."""
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


def load_preset(name: str) -> tuple[dict[str, Any], list[Problem]]:
    """A preset's settings by name (shipped) or path (a YAML file of the user's)."""
    path = Path(name) if name.endswith((".yaml", ".yml")) else PRESET_DIR / f"{name}.yaml"
    if not path.is_file():
        close = difflib.get_close_matches(name, list_presets(), n=1)
        fix = f"did you mean '{close[0]}'? " if close else ""
        return {}, [Problem(f"unknown preset {name!r}", "--preset", f"{fix}shipped presets: {', '.join(list_presets())}")]
    try:
        return load_yaml(path), []
    except ConfigError as e:
        return {}, e.problems
