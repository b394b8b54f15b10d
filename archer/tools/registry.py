"""Tools built from config (``actor_rollout_ref.rollout.tools``, ARPO's keys), and finding a round's calls.

``tool_instances.<name>.class_path`` names a Tool class, either as a dotted path (``my_pkg.tools.Calc``),
by a built-in short name (``python``, ``search``) or by verl's/ARPO's class path (``VERL_TOOLS``); ``params``
are its keyword arguments. ``check_tool_specs`` checks classes and params without building anything. The registry
owns the tools and the executor for their calls, and knows the stop strings (``</tag>``) a rollout loop
must generate with.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Mapping
from typing import Any

from omegaconf import DictConfig, OmegaConf

from archer.errors import ArcherError
from archer.tools.base import Tool
from archer.tools.executor import ToolCall, ToolExecutor

BUILTIN_TOOLS = {
    "python": "archer.tools.python_tool.PythonTool",
    "search": "archer.tools.search.SearchTool",
}
# verl's and ARPO's tool classes, by the class_path their configs and scripts write, and archer's tool for each
# (docs/porting.md shows this table).
VERL_TOOLS = {
    "verl.workers.rollout.tools.python_tool.PythonTool": "archer.tools.python_tool.PythonTool",
    "verl.workers.agent.tools.python_tool.PythonTool": "archer.tools.python_tool.PythonTool",
    "verl.workers.rollout.tools.search_tool.BingSearchTool": "archer.tools.bing.BingSearchTool",
    "verl.workers.agent.tools.search_tool.BingSearchTool": "archer.tools.bing.BingSearchTool",
}


def _tool_class(name: str, class_path: str) -> type[Tool]:
    dotted = BUILTIN_TOOLS.get(class_path) or VERL_TOOLS.get(class_path, class_path)
    if dotted.startswith("verl."):
        raise ArcherError(f"tool {name!r}: verl's {dotted!r} has no archer counterpart",
                          f"set tool_instances.{name}.class_path to one of {sorted(BUILTIN_TOOLS)}, one of verl's "
                          f"{sorted(VERL_TOOLS)}, or module.ClassName of your own archer Tool")
    module_name, _, class_name = dotted.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), class_name) if module_name else None
    except ImportError as e:
        raise ArcherError(f"tool {name!r}: cannot import {dotted!r} ({e})",
                          f"set tool_instances.{name}.class_path to one of {sorted(BUILTIN_TOOLS)} or to "
                          "module.ClassName of an installed module") from None
    if not (isinstance(cls, type) and issubclass(cls, Tool)):
        raise ArcherError(f"tool {name!r}: {dotted!r} is not a Tool class (archer.tools.base.Tool)",
                          f"set tool_instances.{name}.class_path to one of {sorted(BUILTIN_TOOLS)} or to a "
                          "subclass of archer.tools.base.Tool")
    return cls


def _checked_class(name: str, spec: Any) -> type[Tool]:
    """A tool spec's class, with its params bound to the class's signature (a wrong class_path or param key is
    an error naming the tool)."""
    if not isinstance(spec, Mapping) or not spec.get("class_path"):
        raise ArcherError(f"tool {name!r} has no class_path",
                          f"set tools.tool_instances.{name}.class_path (e.g. python or search)")
    cls = _tool_class(name, spec["class_path"])
    params = spec.get("params") or {}
    try:
        inspect.signature(cls).bind(name, **params)
    except TypeError as e:
        accepted = [p for p in inspect.signature(cls).parameters if p != "name"]
        raise ArcherError(f"tool {name!r}: bad params for {cls.__name__}: {e}",
                          f"use only these keys under tool_instances.{name}.params: {', '.join(accepted)}") from None
    return cls


def check_tool_specs(cfg: DictConfig | Mapping[str, Any]) -> None:
    """Every tool's class_path imports to a Tool and its params fit it; nothing is built (config-check time)."""
    cfg = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else dict(cfg)
    for name, spec in (cfg.get("tool_instances") or {}).items():
        _checked_class(name, spec)


def build_tool(name: str, class_path: str, params: Mapping[str, Any]) -> Tool:
    cls = _checked_class(name, {"class_path": class_path, "params": params})
    return cls(name, **params)


def trigger_tags(cfg: DictConfig | Mapping[str, Any]) -> list[str]:
    """The trigger tag of each tool of ``cfg.tool_instances``, in order, read without building the tools: its
    ``trigger_tag`` param, else its class's default; a class that sets its tag in code is built (and closed)."""
    cfg = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else dict(cfg)
    tags = []
    for name, spec in (cfg.get("tool_instances") or {}).items():
        cls, params = _checked_class(name, spec), spec.get("params") or {}
        bound = inspect.signature(cls).bind(name, **params)
        bound.apply_defaults()
        tag = bound.arguments.get("trigger_tag")
        if not isinstance(tag, str):
            tool = cls(name, **params)
            tag = tool.trigger_tag
            tool.close()
        tags.append(tag)
    return tags


class ToolRegistry:
    def __init__(self, tools: list[Tool], *, call_limit: int = 3, max_workers: int = 64, timeout: float = 120.0,
                 retry_count: int = 3) -> None:
        tags = [t.trigger_tag for t in tools]
        if len(set(tags)) != len(tags):
            raise ArcherError(f"two tools share a trigger tag: {tags}", "give each tool its own trigger_tag param")
        self.tools = {t.name: t for t in tools}
        self.by_tag = {t.trigger_tag: t for t in tools}
        self.call_limit = call_limit
        self.executor = ToolExecutor(self.tools, max_workers=max_workers, timeout=timeout, retry_count=retry_count)

    @classmethod
    def from_config(cls, cfg: DictConfig | Mapping[str, Any]) -> ToolRegistry:
        """Build every tool of ``cfg.tool_instances`` (a startup error names the tool and the key at fault)."""
        cfg = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else dict(cfg)
        tools = []
        for name, spec in (cfg.get("tool_instances") or {}).items():
            tools.append(_checked_class(name, spec)(name, **(spec.get("params") or {})))
        return cls(tools, call_limit=cfg.get("call_limit", 3), max_workers=cfg.get("max_workers", 64),
                   timeout=cfg.get("timeout", 120.0), retry_count=cfg.get("retry_count", 3))

    @property
    def stop_strings(self) -> list[str]:
        return [f"</{tag}>" for tag in self.by_tag]

    def find_call(self, text: str) -> ToolCall | None:
        """The call a generation ends with: the text after the last ``<tag>`` when the text ends at ``</tag>``."""
        body = text.rstrip()
        for tag, tool in self.by_tag.items():
            if body.endswith(f"</{tag}>"):
                end = len(body) - len(tag) - 3
                start = body.rfind(f"<{tag}>", 0, end)
                if start >= 0:
                    return ToolCall(tool.name, body[start + len(tag) + 2:end])
        return None

    def close(self) -> None:
        self.executor.close()
        for tool in self.tools.values():
            tool.close()
