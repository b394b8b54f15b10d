"""Fitting tool answers into a response.

First verl's character limit on each answer (``multi_turn.max_tool_response_length`` and
``tool_response_truncate_side``: ``left`` keeps the head, ``right`` the tail, ``middle`` both ends, each with a
"(truncated)" mark). Then the response budget: when a turn's answers would leave the model no token of
``response_length``, they are cut in token space (same side) to the room there is, short answers whole and the
longer ones sharing the rest equally.
"""

from __future__ import annotations

TRUNCATE_SIDES = ("left", "right", "middle")


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
