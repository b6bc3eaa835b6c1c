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
    reader = _Reader(Form(body, boundary))
    parser = MultipartParser(boundary, reader.callbacks())
    try:
        parser.write(body)
        parser.finalize()
    except MultipartParseError:
        return None
    return reader.form if reader.ended else None


class _Reader:
    """python-multipart's callbacks for one body: each part's name, whether it is a file,
    and its bytes (kept only for small text fields)."""

    def __init__(self, form: Form) -> None:
        self.form = form
        self.ended = False
        self.name: bytes | None = None
        self.file = False
        self.size = 0
        self.data: list[bytes] = []
        self.header = [b"", b""]

    def callbacks(self) -> Any:
        return {
            "on_part_begin": self.part_begin,
            "on_header_field": self.header_field,
            "on_header_value": self.header_value,
            "on_header_end": self.header_end,
            "on_part_data": self.part_data,
            "on_part_end": self.part_end,
            "on_end": self.end,
        }

    def part_begin(self) -> None:
        self.name, self.file, self.size, self.data = None, False, 0, []

    def header_field(self, data: bytes, start: int, end: int) -> None:
        self.header[0] += data[start:end]

    def header_value(self, data: bytes, start: int, end: int) -> None:
        self.header[1] += data[start:end]

    def header_end(self) -> None:
        if self.header[0].lower() == b"content-disposition":
            _, options = parse_options_header(self.header[1])
            self.name, self.file = options.get(b"name"), b"filename" in options
        self.header = [b"", b""]

    def part_data(self, data: bytes, start: int, end: int) -> None:
        self.size += end - start
        if not self.file and self.size <= MAX_FIELD_BYTES:
            self.data.append(data[start:end])

    def part_end(self) -> None:
        if self.name is None:
            raise MultipartParseError("a part without a name")
        if self.file:
            self.form.file_bytes += self.size
        elif self.size <= MAX_FIELD_BYTES:
            text = b"".join(self.data).decode("utf-8", "replace")
            self.form[self.name.decode("utf-8", "replace")] = text

    def end(self) -> None:
        self.ended = True


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
