"""Linear-time reading of ``<tag>...</tag>`` blocks out of model text.

Model output is hostile: a lazy regex such as ``<answer>(.*?)</answer>`` rescans the rest of the text from every
opening tag that has no closing tag after it, so a response of n repeated opening tags costs O(n^2). These
helpers find the same blocks with ``str.find`` from left to right, each character looked at a bounded number of
times, so that rewards and tool-call parsing cost time proportional to the text.
"""

from __future__ import annotations


def tag_blocks(text: str, opening: str, closing: str) -> list[str]:
    """The contents of the ``opening ... closing`` blocks of ``text``, left to right, exactly as
    ``re.findall(f"{opening}(.*?){closing}", text, re.DOTALL)`` returns them (for literal tags), in linear time."""
    blocks: list[str] = []
    pos = 0
    while (start := text.find(opening, pos)) >= 0:
        end = text.find(closing, start + len(opening))
        if end < 0:
            break  # no closing tag after this one: no later opening tag has one either
        blocks.append(text[start + len(opening):end])
        pos = end + len(closing)
    return blocks


def last_tag_block(text: str, opening: str, closing: str) -> str | None:
    """The content of the last block ``tag_blocks`` would return, or None when there is none."""
    blocks = tag_blocks(text, opening, closing)
    return blocks[-1] if blocks else None
