"""How a model calls tools and how their answers go back into the sequence
(``actor_rollout_ref.rollout.multi_turn.format``).

- ``arpo``: ARPO's tags. Generation stops at a tool's closing tag (``</python>``, ``</search>``); the call is
  the text inside the last ``<python>...</python>``; its answer goes back as `` <result>\\n...\\n</result>``.
- ``hermes``: the ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks of an assistant turn
  that ends with the eos token (what Qwen2.5 / Qwen3 chat models write). Every call of the turn runs; the
  answers go back as ``tool`` messages rendered by the model's chat template, followed by the header of the
  next assistant turn.

A format reads a finished segment into the calls it ends with (``parse``), tells whether a segment stops
inside a call (``unclosed``: an opening tag without its closing tag; the loop counts it as invalid) and gives
the text around the answers (``frame(k)``: k + 1 pieces, the answers go between them). The loop tokenises the
pieces and the answers separately, so that it can cut an answer to the response budget in token space; the
model's own tokens are never re-tokenised.
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedTokenizerBase

from archer.errors import ArcherError
from archer.rollout.tool_text import valid_unicode
from archer.tagged_text import tag_blocks
from archer.tools import ToolCall, ToolRegistry

CALL_FORMATS = ("arpo", "hermes")


@dataclass(frozen=True)
class ParsedCall:
    """One call a segment ends with. ``error`` is set when the call cannot be run as written (a closing tag
    without its opening tag, a tool call that is not JSON): that text is its answer and no tool runs."""

    call: ToolCall
    error: str | None = None


class CallFormat(ABC):
    """Reads the calls out of a segment and frames their answers."""

    stop_strings: tuple[str, ...] = ()
    call_tags: tuple[tuple[str, str], ...] = ()  # (opening, closing) tag of each kind of call

    @abstractmethod
    def parse(self, text: str, finish_reason: str) -> list[ParsedCall]:
        """The calls a segment (its text, special tokens dropped) ends with; [] when the response ends there."""

    @abstractmethod
    def frame(self, count: int) -> list[str]:
        """``count + 1`` text pieces; the answers of ``count`` calls go between them, in call order."""

    def unclosed(self, text: str) -> bool:
        """Whether ``text`` stops inside a call: its last opening tag has no closing tag after it."""
        start, closing = max(((text.rfind(opening), closing) for opening, closing in self.call_tags),
                             default=(-1, ""))
        return start >= 0 and closing not in text[start:]


def arpo_call_tags(trigger_tags: Iterable[str]) -> tuple[tuple[str, str], ...]:
    """The (opening, closing) tags of ARPO's calls to tools with these trigger tags."""
    return tuple((f"<{tag}>", f"</{tag}>") for tag in trigger_tags)


class ArpoTags(CallFormat):
    """``<tag>content</tag>`` calls; each answer as `` <result>\\n{answer}\\n</result>`` (ARPO)."""

    RESULT_FRAME = (" <result>\n", "\n</result>")

    def __init__(self, registry: ToolRegistry) -> None:
        self.registry = registry
        self.stop_strings = tuple(registry.stop_strings)
        self.call_tags = arpo_call_tags(registry.by_tag)

    def parse(self, text: str, finish_reason: str) -> list[ParsedCall]:
        if finish_reason != "stop":
            return []
        # generation stopped at the first closing tag it completed; the text may run on within that token
        ends = [(text.find(stop) + len(stop), stop) for stop in self.stop_strings if stop in text]
        if not ends:
            return []  # a stop string of rollout.stop ended it: the response ends
        end, stop = min(ends)
        call = self.registry.find_call(text[:end])
        if call is not None:
            return [ParsedCall(call)]
        tag = stop[2:-1]
        tool = self.registry.by_tag[tag].name
        return [ParsedCall(ToolCall(tool, ""), error=f"Error: {stop} without a <{tag}> before it.")]

    def frame(self, count: int) -> list[str]:
        if count != 1:
            raise ValueError(f"an ARPO segment ends with exactly one call, not {count}")
        return list(self.RESULT_FRAME)


_SENTINEL = "\x00ARCHER_TOOL_RESPONSE_{}\x00"


def _call_content(arguments: Any) -> str:
    """The text a tool gets from Hermes arguments: the value of a single argument, a string as it is, else JSON."""
    if isinstance(arguments, Mapping) and len(arguments) == 1:
        arguments = next(iter(arguments.values()))
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


def _invalid(error: str) -> ParsedCall:
    return ParsedCall(ToolCall("", ""), error=f"Error: {error}")


def _read_call(body: str) -> ParsedCall:
    """One ``<tool_call>`` body as a call, or as an invalid call whose error text is its answer. Model text is
    hostile: nothing it can write raises here (the rollout of the whole batch would stop)."""
    try:
        message = json.loads(body)
        name = message.get("name") if isinstance(message, dict) else None
        if not isinstance(name, str) or not name:
            return _invalid('the tool call has no "name".')
        content = _call_content(message.get("arguments", {}))
    except json.JSONDecodeError as e:
        return _invalid(f"the tool call is not valid JSON ({e}).")
    except RecursionError:  # nesting deeper than the interpreter's stack: hostile or broken, not a call
        return _invalid("the tool call's JSON is nested too deeply.")
    except ValueError as e:  # a number Python refuses to read (an integer of more than 4300 digits)
        return _invalid(f"the tool call's JSON cannot be read ({e}).")
    # a JSON escape can spell a lone surrogate, which no encoder (the tokenizer's, a file's) accepts
    return ParsedCall(ToolCall(valid_unicode(name), valid_unicode(content)))


class HermesCalls(CallFormat):
    """``<tool_call>{json}</tool_call>`` calls of an eos-ended assistant turn; answers as chat-template tool
    messages. The frame is cut out of the template's own rendering of placeholder messages, so any chat template
    that renders ``tool`` messages works (Qwen2.5/Qwen3 wrap them in ``<tool_response>`` of a user turn)."""

    call_tags = (("<tool_call>", "</tool_call>"),)

    def __init__(self, tokenizer: PreTrainedTokenizerBase, *, chat_template: str | None = None,
                 template_kwargs: Mapping[str, Any] | None = None) -> None:
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.template_kwargs = dict(template_kwargs or {})
        if chat_template is None and not tokenizer.chat_template:
            raise ArcherError("multi_turn.format=hermes renders tool answers with the chat template, and the "
                              "tokenizer has none", "use a chat model, or set actor_rollout_ref.model."
                              "custom_chat_template, or use multi_turn.format=arpo")
        self._eos_tail = self._text_after_eos()
        self._frames: dict[int, list[str]] = {}

    def _render(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, chat_template=self.chat_template, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt, **self.template_kwargs)

    def _text_after_eos(self) -> str:
        """What the template writes after the special token that closes an assistant turn (Qwen: the newline
        after ``<|im_end|>``); the model's turn ends at that token, which is one of its eos tokens."""
        marker = _SENTINEL.format("assistant")
        closed = self._render([{"role": "user", "content": "u"}, {"role": "assistant", "content": marker}],
                              add_generation_prompt=False)
        turn_end = closed[closed.rfind(marker) + len(marker):]
        specials = {*self.tokenizer.all_special_tokens, *self.tokenizer.get_added_vocab()}
        closing = max((t for t in specials if t and turn_end.startswith(t)), key=len, default="")
        return turn_end[len(closing):]

    def parse(self, text: str, finish_reason: str) -> list[ParsedCall]:
        if finish_reason != "eos":
            return []
        return [_read_call(body) for body in tag_blocks(text, "<tool_call>", "</tool_call>")]

    def frame(self, count: int) -> list[str]:
        if count not in self._frames:
            user = [{"role": "user", "content": "u"}]
            tools = [{"role": "tool", "content": _SENTINEL.format(i)} for i in range(count)]
            before = self._render(user, add_generation_prompt=False)
            after = self._render(user + tools, add_generation_prompt=True)
            if not after.startswith(before):
                raise ArcherError("the chat template renders a conversation differently once tool messages follow, "
                                  "so archer cannot cut out the tool turn", "use multi_turn.format=arpo, or a chat "
                                  "template that appends tool messages (actor_rollout_ref.model.custom_chat_template)")
            turn = self._eos_tail + after[len(before):]
            pieces = re.split("|".join(re.escape(_SENTINEL.format(i)) for i in range(count)), turn)
            if len(pieces) != count + 1:
                raise ArcherError(f"the chat template does not render the content of {count} tool message(s)",
                                  "use multi_turn.format=arpo, or a chat template that renders tool messages")
            self._frames[count] = pieces
        return self._frames[count]


def build_call_format(name: str, registry: ToolRegistry, tokenizer: PreTrainedTokenizerBase, *,
                      chat_template: str | None = None, template_kwargs: Mapping[str, Any] | None = None
                      ) -> CallFormat:
    """The format ``multi_turn.format`` names."""
    if name == "arpo":
        return ArpoTags(registry)
    if name == "hermes":
        return HermesCalls(tokenizer, chat_template=chat_template, template_kwargs=template_kwargs)
    raise ArcherError(f"unknown multi_turn.format {name!r}",
                      f"set actor_rollout_ref.rollout.multi_turn.format to one of: {', '.join(CALL_FORMATS)}")
