"""Linear-time reading of ``<tag>...</tag>`` blocks out of model text.

Model output is hostile: a lazy regex such as ``<answer>(.*?)</answer>`` rescans the rest of the text from every
opening tag that has no closing tag after it, so a response of n repeated opening tags costs O(n^2). These
helpers find the same blocks with ``str.find``, left to right, without rescanning, so that rewards, tool-call
parsing and the trace explorer cost time proportional to the text (times the number of tag pairs).
"""

from __future__ import annotations

from collections.abc import Sequence


def tag_spans(text: str, tags: Sequence[tuple[str, str]]) -> list[tuple[int, int, int]]:
    """(start, end, pair index) of each block ``opening ... closing`` of ``text`` for the (opening, closing) pairs
    ``tags``: exactly the matches of ``re.finditer("|".join(f"{opening}.*?{closing}" ...), text, re.DOTALL)`` for
    literal tags (leftmost first; at one position the first pair that closes wins), found in linear time."""
    last_close = [text.rfind(closing) for _, closing in tags]  # no closing after it: that pair cannot match
    next_open = [text.find(opening) for opening, _ in tags]
    spans: list[tuple[int, int, int]] = []
    pos = 0
    while True:
        for i, (opening, _) in enumerate(tags):
            if 0 <= next_open[i] < pos:
                next_open[i] = text.find(opening, pos)
        candidates = sorted((at, i) for i, at in enumerate(next_open) if at >= 0)
        if not candidates:
            return spans
        start = candidates[0][0]
        pos = start + 1  # unless a pair opening here closes later: then after its block
        for at, i in candidates:
            if at != start:
                break
            opening, closing = tags[i]
            if last_close[i] < start + len(opening):
                next_open[i] = -1  # no closing after this opening, nor after any later one: the pair is done
                continue
            pos = text.find(closing, start + len(opening)) + len(closing)
            spans.append((start, pos, i))
            break


def tag_blocks(text: str, opening: str, closing: str) -> list[str]:
    """The contents of the ``opening ... closing`` blocks of ``text``, left to right, exactly as
    ``re.findall(f"{opening}(.*?){closing}", text, re.DOTALL)`` returns them (for literal tags), in linear time."""
    return [text[start + len(opening):end - len(closing)] for start, end, _ in tag_spans(text, [(opening, closing)])]


def last_tag_block(text: str, opening: str, closing: str) -> str | None:
    """The content of the last block ``tag_blocks`` would return, or None when there is none."""
    blocks = tag_blocks(text, opening, closing)
    return blocks[-1] if blocks else None
