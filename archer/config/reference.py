"""The config reference of the docs site (docs/config_reference.md, made when the site is built): every key of
``ppo_trainer.yaml`` with its default, its type, what it does (the YAML's own comments) and whether archer acts
on it (the schema's rows of ``no_ops.NO_OPS``).

``key_comments`` reads the comments as the YAML writes them: the comment after a key, the comment lines below it
aligned with that comment (its continuation), and the comment lines right above a key (a block that introduces
it). Defaults and types come from the YAML loaded as archer loads it, so the two cannot disagree.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from archer.config.loader import CONFIG_DIR, list_keys
from archer.config.no_ops import NO_OPS, NoOp

CONFIG_NAME = "ppo_trainer"
KEY_LINE = re.compile(r"^(?P<indent> *)(?P<key>[A-Za-z_][\w+-]*):(?P<rest>.*)$")
INTERPOLATION = re.compile(r"^\$\{([\w.]+)\}$")


@dataclass(frozen=True)
class KeyDoc:
    """One key of the reference: ``key`` dotted, ``default`` as the YAML writes it, ``kind`` its type in words,
    ``comment`` the YAML's words on it, ``no_op`` its entry of no_ops.NO_OPS when archer does not act on it,
    ``section`` whether it holds further keys."""

    key: str
    default: str
    kind: str
    comment: str
    no_op: NoOp | None
    section: bool


def _inline_comment(rest: str) -> tuple[int, str] | None:
    """The offset in ``rest`` and the text of a comment after a value (a ``#`` after a space, outside quotes)."""
    quote = ""
    for i, ch in enumerate(rest):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or rest[i - 1] == " "):
            return i, rest[i + 1:].strip()
    return None


def key_comments(text: str) -> dict[str, str]:
    """Each dotted key's comment in a YAML config written as archer's are (one key a line, block lists only
    under ``defaults``)."""
    comments: dict[str, list[str]] = {}
    stack: list[tuple[int, str]] = []  # (indent, key) of the mappings the current line is in
    pending: list[str] = []  # comment lines above the next key
    last: tuple[str, int] | None = None  # the last key with an inline comment, and that comment's column
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped:
            pending, last = [], None
            continue
        if stripped.startswith("#"):
            column = line.index("#")
            if last is not None and column == last[1]:
                comments[last[0]].append(stripped[1:].strip())
            else:
                pending.append(stripped[1:].strip())
                last = None
            continue
        match = KEY_LINE.match(line)
        if match is None:  # a block list's item
            pending, last = [], None
            continue
        indent = len(match["indent"])
        while stack and stack[-1][0] >= indent:
            stack.pop()
        key = ".".join([*(k for _, k in stack), match["key"]])
        stack.append((indent, match["key"]))
        comments[key] = pending
        pending, last = [], None
        inline = _inline_comment(match["rest"])
        if inline is not None:
            comments[key].append(inline[1])
            last = (key, indent + len(match["key"]) + 1 + inline[0])
    return {key: " ".join(words) for key, words in comments.items()}


def _shown(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (DictConfig, ListConfig)):
        return str(OmegaConf.to_container(value, resolve=False)).replace("'", "")
    return str(value)


def _kind(node: Any, key: str, lists: set[str]) -> str:
    if isinstance(node, DictConfig):
        return "mapping" if len(node) else "mapping (any keys)"
    value = node._value()
    if isinstance(value, str) and INTERPOLATION.match(value):
        return f"as `{INTERPOLATION.match(value)[1]}`"
    if key in lists or isinstance(node, ListConfig):
        return "list"
    if value is None:
        return "any (null: unset)"
    if value == "???":
        return "required"
    return {bool: "bool", int: "int", float: "number", str: "string"}[type(value)]


def key_docs(yaml_path: Path | None = None) -> list[KeyDoc]:
    """Every key of the config, in the YAML's order (Hydra's ``defaults`` list left out)."""
    path = yaml_path or CONFIG_DIR / f"{CONFIG_NAME}.yaml"
    comments = key_comments(path.read_text(encoding="utf-8"))
    tree = OmegaConf.load(path)
    lists = list_keys(CONFIG_NAME) if yaml_path is None else set()
    no_ops = {entry.key: entry for entry in NO_OPS if entry.in_schema}
    out: list[KeyDoc] = []

    def walk(node: DictConfig, prefix: str) -> None:
        for k in node.keys():
            key = f"{prefix}.{k}" if prefix else str(k)
            if key == "defaults":
                continue
            child = node._get_node(k)
            section = isinstance(child, DictConfig) and len(child) > 0
            value = child if isinstance(child, (DictConfig, ListConfig)) else child._value()
            default = "" if section else _shown(value)
            out.append(KeyDoc(key, default, "section" if section else _kind(child, key, lists),
                              comments.get(key, ""), no_ops.get(key), section))
            if section:
                walk(child, key)

    walk(tree, "")
    return out


def _cell(text: str) -> str:
    """Text for a table cell: pipes escaped, and ``<`` outside code spans (``<run>`` is no HTML tag)."""
    parts = text.replace("|", "\\|").split("`")
    return "`".join(part if i % 2 else part.replace("<", "&lt;") for i, part in enumerate(parts))


def _acts(doc: KeyDoc) -> str:
    if doc.no_op is None:
        return "yes"
    if doc.no_op.sharded_only:
        return f"only with several ranks: {doc.no_op.note}"
    return f"no: {doc.no_op.note}"


def reference_markdown(yaml_path: Path | None = None) -> str:
    """The reference page: a table per top-level section of the YAML."""
    docs = key_docs(yaml_path)
    intro = ("Every key of `archer/config/ppo_trainer.yaml`, the config of `archer train` (its names and defaults "
             "are verl's), generated from the YAML when the site is built: the default, the type a value must "
             "have, what the key does (the YAML's comments) and whether archer acts on it. A key archer accepts "
             "but does not act on is a row of `archer/config/no_ops.py`: a value that asks for what archer does "
             "not do warns once, one whose no-op would change the result is refused. `algorithm=NAME` presets "
             "set some of these keys ([Algorithms](presets.md)); `archer train --cfg job KEY=VALUE ...` prints "
             "the resolved config.")
    lines = ["# Config reference", "", intro, ""]
    for doc in docs:
        if "." not in doc.key:
            lines += ["", f"## `{doc.key}`", ""]
            if doc.comment:
                lines += [_cell(doc.comment), ""]
            lines += ["| key | default | type | acts | what it does |", "|---|---|---|---|---|"]
            if not doc.section:
                lines.append(_row(doc))
            continue
        lines.append(_row(doc))
    return "\n".join(lines).strip() + "\n"


def _row(doc: KeyDoc) -> str:
    default = f"`{_cell(doc.default)}`" if doc.default else ""
    return f"| `{doc.key}` | {default} | {doc.kind} | {_cell(_acts(doc))} | {_cell(doc.comment)} |"
