"""Fitting tool answers into a response, as plain text.

Tool answers are text the policy did not write (a snippet's output, a retrieved page), so they are encoded as
plain text (``encode_plain``): a special or added token's string in them (``<|im_end|>``, ``<|im_start|>``,
``<|endoftext|>``, ``<tool_call>``) becomes ordinary tokens that decode to the same characters, never the control
token, so a tool cannot end a sequence or forge a turn (``encode_with_plain_part`` does the same for a part of a
templated text: the response in the reward model's input). Then verl's character limit on each answer
(``multi_turn.max_tool_response_length`` and ``tool_response_truncate_side``: ``left`` keeps the head, ``right``
the tail, ``middle`` both ends, each with a "(truncated)" mark). Then the response budget: when a turn's answers would leave the model no token of
``response_length``, they are cut in token space (same side) to the room there is, short answers whole and the
longer ones sharing the rest equally.
"""

from __future__ import annotations

import re

from transformers import PreTrainedTokenizerBase

TRUNCATE_SIDES = ("left", "right", "middle")
_SURROGATE = re.compile("[\ud800-\udfff]")


def valid_unicode(text: str) -> str:
    """``text`` with each surrogate code point (a JSON escape can write a lone one, which neither the tokenizer
    nor a UTF-8 file accepts) replaced by U+FFFD."""
    return _SURROGATE.sub("\ufffd", text)


def encode_plain(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """``text`` as ordinary tokens: no id of the tokenizer's added vocabulary (special tokens included).

    The tokenizer splits special tokens itself (``split_special_tokens``); an added token that is not special
    (Qwen's ``<tool_call>``, ``<think>``) is matched by the tokenizer even then, so where one remains, the text is
    cut at every added token's string: the distinct pieces between are encoded plainly, in one batch, and each
    distinct added token's string once, one character at a time (only a one-character added token can stay
    itself). The cost is about that of three encodings of the text, however many added-token strings it holds.
    """
    text = valid_unicode(text)
    added = tokenizer.get_added_vocab()
    ids = tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    if set(added.values()).isdisjoint(ids):
        return ids
    pattern = "|".join(re.escape(t) for t in sorted(added, key=len, reverse=True))
    pieces = re.split(f"({pattern})", text)  # odd pieces are the added tokens' strings
    plain = _encode_each(tokenizer, pieces[0::2])
    for token in set(pieces[1::2]):
        chars = _encode_each(tokenizer, list(token))
        plain[token] = [i for char in token for i in chars[char]]
    ids = [i for piece in pieces for i in plain[piece]]
    if not set(tokenizer.all_special_ids).isdisjoint(ids):  # a one-character special token has no plain spelling
        raise ValueError("the tokenizer has a one-character special token; tool text cannot be kept plain")
    return ids


def _encode_each(tokenizer: PreTrainedTokenizerBase, texts: list[str]) -> dict[str, list[int]]:
    """The ids of each distinct text, special-token strings split, from one call of the tokenizer."""
    distinct = list(dict.fromkeys(texts))
    ids = tokenizer(distinct, add_special_tokens=False, split_special_tokens=True)["input_ids"] if distinct else []
    return dict(zip(distinct, ids, strict=True))


def encode_with_plain_part(tokenizer: PreTrainedTokenizerBase, text: str, start: int, end: int) -> list[int]:
    """``text`` encoded as the tokenizer encodes it whole, except that no added token overlapping
    ``text[start:end]`` (text the policy or a tool wrote, inside a template's frame) stays a control token: each
    such token is spelled plainly (``encode_plain``). Elsewhere the ids are the whole text's, merges across the
    part's edges included. A tokenizer without offsets (a slow one) encodes the three parts apart."""
    if not tokenizer.is_fast:
        return (tokenizer.encode(text[:start], add_special_tokens=False) + encode_plain(tokenizer, text[start:end])
                + tokenizer.encode(text[end:], add_special_tokens=False))
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    added = set(tokenizer.get_added_vocab().values())
    ids: list[int] = []
    for token, (first, last) in zip(encoded["input_ids"], encoded["offset_mapping"], strict=True):
        forged = token in added and first < end and last > start
        ids += encode_plain(tokenizer, text[first:last]) if forged else [token]
    return ids


def clip_text(text: str, limit: int | None, side: str) -> str:
    """``text`` cut to ``limit`` characters (plus the mark) on ``side``; unchanged when it fits or ``limit`` is None."""
    if limit is None or len(text) <= limit:
        return text
    if side == "left":
        return text[:limit] + "...(truncated)"
    if side == "right":
        return "(truncated)..." + text[len(text) - limit:]
    head = limit // 2
    return text[:head] + "...(truncated)..." + text[len(text) - (limit - head):]


def cut_ids(ids: list[int], keep: int, side: str) -> list[int]:
    """At most ``keep`` of ``ids``: the first (left), the last (right) or both ends (middle)."""
    if len(ids) <= keep:
        return ids
    if side == "left":
        return ids[:keep]
    if side == "right":
        return ids[len(ids) - keep:]
    head = keep // 2
    return ids[:head] + ids[len(ids) - (keep - head):]


def share_room(lengths: list[int], room: int) -> list[int]:
    """Tokens each answer keeps so that they total at most ``room``: answers shorter than an equal share keep
    everything, and what they leave is shared equally by the longer ones."""
    keep = [0] * len(lengths)
    left = max(room, 0)
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    for rank, i in enumerate(order):
        keep[i] = min(lengths[i], left // (len(order) - rank))
        left -= keep[i]
    return keep
