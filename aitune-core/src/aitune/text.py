"""Text shown to people: a long message is cut at a word boundary with an ellipsis, never mid-word.

A reason cut at a fixed count of characters ("This means tha") reads as a bug in aitune and hides
the end of a sentence the reader needed; cut here, it ends on a whole word and says that it goes on.
"""

from __future__ import annotations

import re

ELLIPSIS = "…"
_BOUNDARY = re.compile(r"[\s/\\,;:()\[\]{}]")
"""Where a cut may fall: whitespace or punctuation that separates words and paths."""


def clip(text: str, limit: int) -> str:
    """``text`` whole when it has at most ``limit`` characters, else its longest start that ends at a
    word boundary, with an ellipsis; a text with no boundary in its first ``limit`` characters is kept whole."""
    text = text.strip()
    if len(text) <= limit:
        return text
    head = text[: max(limit - len(ELLIPSIS), 1) + 1]  # one more: a boundary right after the last kept char counts
    cuts = [m.start() for m in _BOUNDARY.finditer(head)]
    if not cuts or cuts[-1] == 0:
        return text
    return head[: cuts[-1]].rstrip(" ,;:.(") + ELLIPSIS
