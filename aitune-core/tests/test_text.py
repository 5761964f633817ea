"""Messages cut to a length end on a whole word, with an ellipsis, or are kept whole."""

from __future__ import annotations

from aitune.text import ELLIPSIS, clip

TRACER = (
    "Converting a tensor to a Python boolean might cause the trace to be incorrect. We can't record the data "
    "flow of Python values, so this value will be treated as a constant in the future. This means that the "
    "trace might not generalize to other inputs!"
)


def test_a_text_that_fits_is_kept_whole():
    assert clip("  short enough ", 20) == "short enough"


def test_a_long_text_is_cut_after_a_whole_word_with_an_ellipsis():
    cut = clip(TRACER, 200)
    assert len(cut) <= 200 and cut.endswith(ELLIPSIS)
    kept = cut.removesuffix(ELLIPSIS)
    assert TRACER.startswith(kept) and TRACER[len(kept)] in " ,.", f"cut mid-word: {cut!r}"
    assert "tha" + ELLIPSIS not in cut


def test_a_cut_never_ends_in_punctuation_before_the_ellipsis():
    assert clip("one, two, three, four", 12) == "one, two" + ELLIPSIS


def test_a_text_with_no_boundary_is_kept_whole_rather_than_cut_mid_word():
    token = "x" * 300
    assert clip(token, 50) == token
