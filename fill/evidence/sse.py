"""Server-sent events (``text/event-stream``) read from a logged response body.

:func:`event_data` reads the text as the HTML standard interprets an event stream
(https://html.spec.whatwg.org/multipage/server-sent-events.html#event-stream-interpretation):
a line ends at CRLF, LF or CR (no other character: JSON text may hold U+2028 raw); a leading
byte-order mark is dropped; a line that starts with ``:`` is a comment; a field's value is what
follows the first colon of its line, less one leading space (a line without a colon is a field
with an empty value); an event's ``data`` values join with LF; a blank line dispatches the event,
one without a ``data`` field not at all; what follows the text's last line end is discarded, so
an event the text does not finish is not dispatched. The other fields (``event``, ``id``,
``retry``) are not read: the APIs read here say what an event is in its data (an Anthropic
event's name is the ``type`` its data holds; OpenAI names none).
"""

from __future__ import annotations

import re

__all__ = ["event_data"]

LINE_END = re.compile(r"\r\n|\r|\n")


def event_data(text: str) -> list[str]:
    """The data of each event ``text`` dispatches, in order (see the module contract)."""
    dispatched: list[str] = []
    data: list[str] = []  # the data values of the event being read
    for line in LINE_END.split(text.removeprefix("\ufeff"))[:-1]:  # the last piece ends no line
        if not line:
            if data:
                dispatched.append("\n".join(data))
            data = []
            continue
        field, _, value = line.partition(":")
        if field == "data":
            data.append(value.removeprefix(" "))
    return dispatched
