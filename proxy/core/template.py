"""A stream's repeating event, recognised from its bytes without parsing it again.

Within one vLLM stream the content events differ only in their text: id, created, model,
index and the null fields are the same bytes every time. So after one event has been
parsed and found to be plain content (choice 0, nothing else), the observer splits it
into the bytes before its text, the text, and the bytes after it. A later event that is
`before + a valid JSON string body + after` says the same facts, and needs no parse:
two `bytes` comparisons and one anchored regex over the text alone.

Why that is safe (`learn` checks it before a template is used): the split is proven by
parsing `before + marker + after` for two different markers, with the text collected. If
both parse to the same facts as the original, with the marker as the only generated text,
then the bytes in between are exactly one JSON string, the one the content is read from,
and nothing else about the event depends on them: every string body that the regex
accepts (well-formed escapes, surrogates in pairs, valid UTF-8, no bare quote or control
character, not empty) gives the same facts. Anything else (another field changing,
finish, usage, an error, whitespace, a different key order) fails the comparison, and the
event goes to the full parse as before.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from proxy.core.apis.base import Api, Facts

#: A non-empty JSON string body (what sits between the quotes), as orjson accepts it.
STRING_BODY = re.compile(
    rb"(?:[\x20\x21\x23-\x5b\x5d-\x7f]++"  # printable ASCII except '"' and '\'
    rb'|\\["\\/bfnrt]'
    rb"|\\u(?![dD][89a-fA-F])[0-9a-fA-F]{4}"  # not a surrogate
    rb"|\\u[dD][89abAB][0-9a-fA-F]{2}\\u[dD][c-fC-F][0-9a-fA-F]{2}"  # a surrogate pair
    rb"|[\xc2-\xdf][\x80-\xbf]"  # UTF-8, 2 to 4 bytes, no surrogates, no overlongs
    rb"|\xe0[\xa0-\xbf][\x80-\xbf]|[\xe1-\xec\xee\xef][\x80-\xbf]{2}|\xed[\x80-\x9f][\x80-\xbf]"
    rb"|\xf0[\x90-\xbf][\x80-\xbf]{2}|[\xf1-\xf3][\x80-\xbf]{3}|\xf4[\x80-\x8f][\x80-\xbf]{2}"
    rb")++"
)

_MARKERS = (b"tokenprobe-probe-a", b"tokenprobe-probe-b")


class EventTemplate:
    """`before + text + after`, and the facts every event of that shape says."""

    __slots__ = ("after", "before", "end", "facts", "fullmatch", "start")

    def __init__(self, before: bytes, after: bytes, facts: Facts) -> None:
        self.before = before
        self.after = after
        self.start = len(before)
        self.end = len(before) + len(after)  # the shortest event: an empty text
        self.facts = facts
        self.fullmatch = STRING_BODY.fullmatch

    def fits(self, payload: bytes) -> bool:
        return (
            len(payload) > self.end
            and payload.startswith(self.before)
            and payload.endswith(self.after)
            and self.fullmatch(payload, self.start, len(payload) - len(self.after)) is not None
        )


def learn(api: Api, payload: bytes, facts: Facts) -> EventTemplate | None:
    """The template of `payload`, whose parse gave the shared plain `facts`, or None when
    its text cannot be located, or the proof fails."""
    for opening in api.text_openings:
        at = payload.find(opening)
        while at >= 0:
            start = at + len(opening)
            text = STRING_BODY.match(payload, start)
            if text is not None and payload[text.end() : text.end() + 1] == b'"':
                before, after = payload[:start], payload[text.end() :]
                if _proven(api, before, after, facts):
                    return EventTemplate(before, after, facts)
            at = payload.find(opening, at + 1)
    return None


def _proven(api: Api, before: bytes, after: bytes, facts: Facts) -> bool:
    if _MARKERS[0] in before + after:
        return False
    for marker in _MARKERS:
        probe = before + marker + after
        if api.event(probe, False, False) is not facts:
            return False
        seen = api.event(probe, True, False)
        if (
            seen.texts != [marker.decode()]
            or seen.content != facts.content
            or seen.choices != facts.choices
            or seen.finish is not None
            or seen.usage is not None
            or seen.error is not None
            or seen.end
            or seen.malformed
        ):
            return False
    return True
