"""Incremental detokenisation: UTF-8 split across tokens, stop strings across tokens."""

import pytest

from serving.engine.detok import IncrementalDetokenizer, StopMatcher

pytestmark = pytest.mark.unit


def _detok(pieces: dict[int, bytes], stops: tuple[str, ...] = ()) -> IncrementalDetokenizer:
    return IncrementalDetokenizer(pieces.__getitem__, stops)


def test_multibyte_character_split_over_tokens_is_held_until_whole() -> None:
    data = "中文".encode()  # 6 bytes, two 3-byte characters
    pieces = {0: data[:2], 1: data[2:4], 2: data[4:]}
    d = _detok(pieces)
    assert d.add(0) == ("", False)
    assert d.add(1) == ("中", False)
    assert d.add(2) == ("文", False)
    assert d.finish() == ""


def test_incomplete_tail_at_the_end_becomes_replacement_character() -> None:
    d = _detok({0: "é".encode()[:1]})
    assert d.add(0) == ("", False)
    assert d.finish() == "\ufffd"


def test_stop_string_spanning_tokens_is_never_shown() -> None:
    d = _detok({0: b"Hello ", 1: b"wor", 2: b"ld and more"}, stops=("world",))
    assert d.add(0) == ("Hello ", False)
    assert d.add(1) == ("", False)  # "wor" could start "world": held back
    assert d.add(2) == ("", True)


def test_held_text_is_released_when_it_stops_matching() -> None:
    m = StopMatcher(("STOP",))
    assert m.feed("abc ST") == ("abc ", False)
    assert m.feed("AR") == ("STAR", False)
    assert m.feed("ST") == ("", False)
    assert m.flush() == "ST"


def test_earliest_of_several_stop_strings_wins() -> None:
    m = StopMatcher(("b", "a"))
    assert m.feed("xxab") == ("xx", True)
