"""Service-level objectives: whether one request kept the promise. One definition, read by
`tokenprobe serve --slo` (live counters) and `tokenprobe bench --slo` (goodput), so a
request the bench counts as good is the request the proxy counts as met.

A target is a name, how to read its figure from a record, and a limit in seconds. Each
finished request gets one verdict:

  <target>   the first target, in TARGETS order, whose figure is above its limit; for a
             request the client left, also a first token (or answer) it waited for
             longer than its limit without getting: a miss already known when it left
  cancelled  the client went away first (`client_cancelled`) and no miss was known:
             counted apart and left out of attainment, as the bench leaves out the
             requests still in flight when a run stops (guidellm does the same with
             requests cut off at the end); so is a background Response that had not
             finished when its answer ended: its acknowledgement not streamed
             (`queued`), or a stream its client left (no cancellation: vLLM generates
             on); whether it keeps its promise is not known here
  refused    the backend (or the proxy) refused it with a 4xx for the client's own
             doing: a bad key (`auth`), an unknown model (`not_found`), a prompt over the
             context (`context_length`), other bad parameters (`bad_request`); an `auth`
             error a backend answers with a 5xx (a gateway's token exchange that failed)
             is the service's, an error. The service broke
             no promise, and an objective that counted them would page the operator for a
             client's mistake (the alerts keep those apart, with their own advice). The
             live proxy leaves them out of attainment (tokenprobe_requests_total counts
             them by error_type); the bench counts them as not met, since a benchmark
             whose requests are refused measured nothing
  error      any other failure: it kept no promise (guidellm counts errors as failing);
             a 429 too, since throttling is the service short of capacity
  met        it succeeded and no figure is above its limit

A figure a request does not have cannot miss its target (the TPOT of a one-token answer),
except a first token (or answer) its client waited for: a non-streamed answer's first
token reaches its client with the whole answer, so its ttft and ttfa are judged by its
e2e, as a client that left is judged by how long it waited. Goodput (DistServe) is met requests per second; the
proxy also counts their output tokens, so goodput tokens/s is a `rate()`.

Targets come from `--slo ttft=0.5,tpot=0.05` (seconds), the same text on both sides, and
for `serve` optionally per model from a file (`parse_slo_file`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any

from proxy.core.apis.responses import FINISH as RESPONSE_STATUSES
from proxy.core.measurement import NONE_LABEL, ErrorType, Measurement


@dataclass(frozen=True, slots=True)
class Target:
    name: str  # what --slo takes, and the `result` label when it is missed
    read: Callable[[Measurement], float | None]  # the figure of a record, in seconds
    record_key: str  # the same figure in a saved bench record (a JSON object)
    meaning: str


#: Every target --slo accepts, in the order a miss is reported (the first one missed
#: names the result). A new one is one row. `ttfa` is what a chat user of a reasoning
#: model waits for (proxy/core/measurement.py `first_answer`); a request with no answer
#: token is not judged on it where it needed none (it made a tool call, or generated
#: nothing), and misses it where it generated and ended with neither (`without_answer`:
#: reasoning cut by its token limit, streamed or not).
TARGETS: tuple[Target, ...] = (
    Target(
        "ttft",
        attrgetter("ttft"),
        "ttft",
        "request received -> first content token (of a non-streamed answer, its last byte)",
    ),
    Target(
        "ttfa",
        attrgetter("ttfa"),
        "first_answer",
        "request received -> first answer token (of a non-streamed answer, its last byte)",
    ),
    Target("tpot", attrgetter("tpot"), "tpot", "time per output token after the first"),
    Target("e2e", attrgetter("e2e"), "e2e", "request received -> last byte"),
)
BY_NAME: Mapping[str, Target] = {t.name: t for t in TARGETS}
NAMES = tuple(BY_NAME)

MET = "met"
ERROR = "error"
CANCELLED = "cancelled"
REFUSED = "refused"
#: The errors that are the client's own doing when answered with a 4xx: judged REFUSED.
REFUSALS = frozenset(
    error.value
    for error in (
        ErrorType.AUTH,
        ErrorType.NOT_FOUND,
        ErrorType.CONTEXT_LENGTH,
        ErrorType.BAD_REQUEST,
    )
)
#: Every value of the `result` label, a closed set.
RESULTS = (MET, *NAMES, ERROR)

#: A parsed --slo: target name -> limit in seconds, in TARGETS order.
Limits = Mapping[str, float]


class SloError(ValueError):
    """A malformed --slo or SLO file; the message says what and where."""


def parse_slo(text: str, source: str = "--slo") -> dict[str, float]:
    """'ttft=0.5,tpot=0.05' -> {"ttft": 0.5, "tpot": 0.05}; SloError naming `source`
    (no name when it is "", for a caller that names the setting itself)."""
    limits: dict[str, float] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, value = item.partition("=")
        limits.update(_limit(source, name.strip().lower() if sep else "", value, item))
    return _ordered(limits)


def _limit(source: str, name: str, value: Any, item: Any) -> dict[str, float]:
    source = f"{source}: " if source else ""
    if name not in BY_NAME:
        raise SloError(
            f"{source}expected NAME=SECONDS with NAME in {', '.join(NAMES)}, got {item!r}"
        )
    try:
        if isinstance(value, bool):  # YAML's `ttft: true` is no number of seconds
            raise TypeError
        seconds = float(value)
    except (TypeError, ValueError):
        raise SloError(f"{source}{name} is not a number: {value!r}") from None
    if not 0 < seconds < float("inf"):  # also refuses nan
        raise SloError(f"{source}{name} must be a positive number of seconds, got {value!r}")
    return {name: seconds}


def _ordered(limits: Mapping[str, float]) -> dict[str, float]:
    return {name: limits[name] for name in NAMES if name in limits}


def format_slo(limits: Limits) -> str:
    return ",".join(f"{name}={limits[name]:g}" for name in NAMES if name in limits)


def verdict(m: Measurement, limits: Limits) -> str:
    """One of CANCELLED, REFUSED, ERROR, a target's name (the first missed), MET."""
    if m.error_type is not None and not m.cancelled:
        return _failed(m.error_type, m.status_code)
    return _judged(
        lambda name: BY_NAME[name].read(m),
        limits,
        m.e2e,
        left=m.cancelled or _generating_on(m.error_type, m.raw_finish_reason),
        unanswered=m.without_answer is not None,
        streamed=_streamed(m.stream_requested, m.stream),
    )


def record_verdict(record: Mapping[str, Any], limits: Limits) -> str:
    """The same verdict for a saved bench record (its JSON object)."""
    error = record.get("error_type")
    if error is not None and error != "client_cancelled":
        return _failed(error, record.get("status_code"))

    def read(name: str) -> float | None:
        value = record.get(BY_NAME[name].record_key)
        return value if isinstance(value, int | float) else None

    e2e = record.get("e2e")
    return _judged(
        read,
        limits,
        e2e if isinstance(e2e, int | float) else None,
        left=error is not None or _generating_on(error, record.get("raw_finish_reason")),
        unanswered=record.get("without_answer") is not None,
        streamed=_streamed(record.get("stream_requested"), record.get("stream")),
    )


def _streamed(requested: object, measured: object) -> bool:
    """Whether a request is judged as streamed: it asked for a stream, or its answer was
    measured as one. One rule for a live record and a saved one, whose fields may be null
    (`stream_requested` of a request that named no `stream`) or absent (an older run)."""
    return requested is True or measured is True


#: The raw finishes of a response that had not finished when its record was made: the
#: Responses statuses its seam gives no finish reason (apis/responses.py FINISH). vLLM
#: answers a `background: true` request not streamed at once, `queued`, and generates in
#: a task of its own (openai/responses/serving.py:537-590); a background stream whose
#: client left is recorded `in_progress` (proxy/core/observe.py `finish`). Neither has an
#: error, a finish or tokens: judged as a client that left.
_NOT_FINISHED = frozenset(raw for raw, label in RESPONSE_STATUSES.items() if label == NONE_LABEL)


def _generating_on(error: object, raw_finish: object) -> bool:
    """Whether a record without an error is of a response that had not finished."""
    return error is None and raw_finish in _NOT_FINISHED


#: The targets a request that ends without their figure has missed once it waited past
#: their limit: its first token, its first answer token.
_AWAITED = frozenset({"ttft", "ttfa"})


def _failed(error: str, status: object) -> str:
    """REFUSED for a 4xx the client caused, or a 200 whose stream said the client caused
    it (errors.classify_stream_end: vLLM checks a grammar or a schema only once its stream
    began), or a prompt over the context however it was said, else ERROR."""
    client_side = isinstance(status, int) and (200 <= status < 300 or 400 <= status < 500)
    if error == ErrorType.CONTEXT_LENGTH or (client_side and error in REFUSALS):
        return REFUSED
    return ERROR


def _judged(
    read: Callable[[str], float | None],
    limits: Limits,
    e2e: float | None,
    *,
    left: bool,
    unanswered: bool = False,
    streamed: bool = True,
) -> str:
    """The first target missed; else MET, or CANCELLED for a request the client `left`.
    `unanswered`: it generated, then ended with neither an answer nor a call (reasoning cut
    by its token limit): the first answer a ttfa target waits for never came.

    A first token (or answer) a request lacks is judged by how long its client waited for
    it, e2e: a client that left waited that long without getting it, and a request not
    `streamed` gets its first token with the whole answer, at its end. Judged by nothing,
    a non-streamed request would meet a ttft target however slow it was."""
    for name, limit in limits.items():
        value = read(name)
        if value is None and name in _AWAITED:
            if name == "ttfa" and unanswered and not left:
                return name
            if left or not streamed:
                value = e2e
        if value is not None and value > limit:
            return name
    return CANCELLED if left else MET


@dataclass(frozen=True, slots=True)
class Policy:
    """The targets of each model: its own from the SLO file, else the default (--slo, or
    the file's `default`). Looked up by the requested model name, never made a label."""

    default: Mapping[str, float] = field(default_factory=dict)
    models: Mapping[str, Mapping[str, float]] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.default) or bool(self.models)

    def limits(self, model: str) -> Limits:
        return self.models.get(model, self.default)


def parse_slo_file(data: Any, source: str) -> Policy:
    """An SLO file's parsed YAML/JSON:

        default: {ttft: 2, tpot: 0.025}      # optional; --slo gives it otherwise
        models:
          llama-3-70b: {ttft: 4, e2e: 60}    # this model's targets replace the default

    Every value is seconds; a target may also be written as the --slo text
    (`llama: "ttft=4,e2e=60"`). SloError naming the file and key for anything else."""
    if not isinstance(data, dict):
        raise SloError(f"{source}: expected a mapping with 'default' and/or 'models'")
    unknown = sorted(str(k) for k in set(data) - {"default", "models"})
    if unknown:
        raise SloError(f"{source}: unknown key {unknown[0]!r} (expected default, models)")
    default = _targets(data["default"], f"{source}: default") if "default" in data else {}
    models = data.get("models", {})
    if not isinstance(models, dict):
        raise SloError(f"{source}: models: expected a mapping of model name to targets")
    table: dict[str, dict[str, float]] = {}
    for name, targets in models.items():
        if not isinstance(name, str) or not name:
            raise SloError(f"{source}: models: model names must be non-empty strings")
        table[name] = _targets(targets, f"{source}: models.{name}")
    return Policy(default, table)


def _targets(value: Any, where: str) -> dict[str, float]:
    if isinstance(value, str):
        if not (parsed := parse_slo(value, where)):  # "" would judge that model by nothing
            raise SloError(f"{where}: no targets")
        return parsed
    if not isinstance(value, dict):
        raise SloError(f"{where}: expected targets like {{ttft: 0.5, tpot: 0.05}}")
    limits: dict[str, float] = {}
    for name, seconds in value.items():
        key = str(name).lower()
        limits.update(_limit(where, key, seconds, f"{name}: {seconds}"))
    if not limits:
        raise SloError(f"{where}: no targets")
    return _ordered(limits)
