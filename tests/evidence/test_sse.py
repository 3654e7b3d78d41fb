"""Server-sent-events text read as the HTML standard interprets an event stream
(https://html.spec.whatwg.org/multipage/server-sent-events.html#event-stream-interpretation):
lines end at CRLF, LF or CR; ``:`` starts a comment; an event's ``data`` lines join with LF; a
blank line dispatches an event, one without data not at all; an event the text does not finish
is not dispatched."""

from __future__ import annotations

import pytest

from mlx_fill.evidence import sse


@pytest.mark.parametrize("end", ["\n", "\r\n", "\r"])
def test_each_line_end_the_standard_names_ends_a_line(end):
    text = end.join(["data: {", "data: \"a\": 1}", "", "data: [DONE]", "", ""])
    assert sse.event_data(text) == ['{\n"a": 1}', "[DONE]"]


def test_comments_and_other_fields_are_no_data_and_an_event_without_data_is_not_dispatched():
    text = ": keep-alive\n\nevent: ping\nid: 7\nretry: 3000\n\nevent: message_stop\ndata: {}\n\n"
    assert sse.event_data(text) == ["{}"]


def test_a_value_loses_one_leading_space_and_a_field_without_a_colon_has_an_empty_value():
    assert sse.event_data("data:x\n\ndata:  x\n\ndata\n\ndata\ndata: y\n\n") == ["x", " x", "", "\ny"]


def test_an_event_the_text_does_not_finish_is_not_dispatched():
    assert sse.event_data("data: a\n\ndata: b\n") == ["a"]
    assert sse.event_data("data: a\n\ndata: {\"cut") == ["a"]


def test_only_the_three_line_ends_split_lines_and_a_leading_byte_order_mark_is_dropped():
    """Python's ``splitlines`` would also split at U+2028 and form feeds, which JSON text may
    hold raw inside a string."""
    text = "\ufeffdata: {\"text\": \"a\u2028b\x0cc\"}\n\n"
    assert sse.event_data(text) == ["{\"text\": \"a\u2028b\x0cc\"}"]
