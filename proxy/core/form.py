"""Reading a multipart/form-data request body once, and adding one text field to it.

The audio APIs (`/v1/audio/transcriptions`, `/v1/audio/translations`) take a form, not
JSON. `read_form` parses it with python-multipart's push parser (bytes in, callbacks out,
no I/O; the body is already bounded by the relay's body limit) and keeps the text fields
(each at most `MAX_FIELD_BYTES`) and, for file parts, only their size. A body that is not a
well-formed form (no boundary, a part without a name, a missing end delimiter) gives None:
the request is forwarded as it came and measured as a bad one.

`with_field` appends one text part just before the closing delimiter, so every byte the
client sent stays where it was; the backend reads the added field as it reads any other.
"""

from __future__ import annotations

from typing import Any

from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header

MAX_FIELD_BYTES = 64 * 1024
_FORM = b"multipart/form-data"


class Form(dict[str, Any]):
    """The text fields of a form by name (the last one wins, as Starlette's FormData
    `get` does); `file_bytes` sums the file parts; `raw` and `boundary` are the body as sent."""

    __slots__ = ("boundary", "file_bytes", "raw")

    def __init__(self, raw: bytes, boundary: bytes) -> None:
        super().__init__()
        self.raw, self.boundary, self.file_bytes = raw, boundary, 0


def boundary_of(content_type: bytes, body: bytes) -> bytes | None:
    """The form's boundary from its Content-Type, else (no header passed) from its first line."""
    if content_type:
        kind, options = parse_options_header(content_type)
        return options.get(b"boundary") if kind == _FORM else None
    if body.startswith(b"--"):  # a client that put no preamble: the first line is the delimiter
        line = body[2 : body.find(b"\r\n")]
        return line if 0 < len(line) <= 70 else None
    return None


def read_form(body: bytes, content_type: bytes = b"") -> Form | None:
    boundary = boundary_of(content_type, body)
    if not boundary:
        return None
    form = Form(body, boundary)
    part: dict[str, Any] = {}
    header = [b"", b""]

    def on_part_begin() -> None:
        part.clear()
        part["data"] = []
        part["size"] = 0

    def on_header_field(data: bytes, start: int, end: int) -> None:
        header[0] += data[start:end]

    def on_header_value(data: bytes, start: int, end: int) -> None:
        header[1] += data[start:end]

    def on_header_end() -> None:
        if header[0].lower() == b"content-disposition":
            _, options = parse_options_header(header[1])
            part["name"] = options.get(b"name")
            part["file"] = b"filename" in options
        header[0] = header[1] = b""

    def on_part_data(data: bytes, start: int, end: int) -> None:
        part["size"] += end - start
        if not part.get("file") and part["size"] <= MAX_FIELD_BYTES:
            part["data"].append(data[start:end])

    def on_part_end() -> None:
        name = part.get("name")
        if name is None:
            raise MultipartParseError("a part without a name")
        if part.get("file"):
            form.file_bytes += part["size"]
        elif part["size"] <= MAX_FIELD_BYTES:
            form[name.decode("utf-8", "replace")] = b"".join(part["data"]).decode(
                "utf-8", "replace"
            )

    ended = [False]

    def on_end() -> None:
        ended[0] = True

    parser = MultipartParser(
        boundary,
        {
            "on_part_begin": on_part_begin,
            "on_header_field": on_header_field,
            "on_header_value": on_header_value,
            "on_header_end": on_header_end,
            "on_part_data": on_part_data,
            "on_part_end": on_part_end,
            "on_end": on_end,
        },
    )
    try:
        parser.write(body)
        parser.finalize()
    except MultipartParseError:
        return None
    return form if ended[0] else None


def with_field(form: Form, name: str, value: str) -> bytes | None:
    """The form's bytes with one more text part before its closing delimiter, or None
    when the closing delimiter is not where a well-formed body has it."""
    close = b"\r\n--" + form.boundary + b"--"
    at = form.raw.rfind(close)
    if at < 0:
        return None
    part = b'\r\n--%s\r\nContent-Disposition: form-data; name="%s"\r\n\r\n%s' % (
        form.boundary,
        name.encode(),
        value.encode(),
    )
    return form.raw[:at] + part + form.raw[at:]
