"""The SLO sink: each finished request's verdict (proxy/core/slo.py) as Prometheus counters.

  tokenprobe_slo_requests_total{model, endpoint, *labels, result}
      result: met, the first target missed (ttft, ttfa, tpot, e2e), error; a request
      refused for the client's own doing (auth, not_found, context_length, bad_request)
      is not judged: tokenprobe_requests_total counts it by error_type
  tokenprobe_slo_cancelled_requests_total{model, endpoint, *labels}
      client went away first, no miss known yet: left out of attainment, as the bench
      leaves them out (one that left after a miss was known counts as that miss); so is
      a background Response not finished when its answer ended (`queued`, or a stream
      its client left: slo.py `_NOT_FINISHED`)
  tokenprobe_goodput_tokens_total{model, endpoint, *labels}
      output tokens of the met requests: rate() is goodput in tokens/s

Attainment is `sum(rate(..{result="met"}[w])) / sum(rate(..[w]))`. The labels are the
Prometheus sink's: the model bounded by ModelLabels (an SLO file naming thousands of
models adds no series: its names are looked up, never made labels), the API's endpoint,
and each --label-header label. Only generative requests are judged: an embedding has no
token to be late with.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter

from proxy.core import slo
from proxy.core.measurement import Measurement
from proxy.core.wsseam import seam_of
from proxy.sinks.metrics import LABELS
from proxy.sinks.sink import Labels

_TARGETS = ", ".join(f"{t.name} ({t.meaning})" for t in slo.TARGETS)


class SloMetrics:
    """A Sink counting SLO verdicts; only built when --slo or --slo-file is given."""

    def __init__(
        self, registry: CollectorRegistry, policy: slo.Policy, attribution: tuple[str, ...] = ()
    ) -> None:
        self.policy = policy
        labels = (*LABELS, *attribution)
        self.requests = Counter(
            "tokenprobe_slo_requests",
            "Generative requests judged against their model's SLO targets (--slo, --slo-file) "
            "when they ended, from the proxy receiving the request to its last byte: result "
            f"met (every target kept), the first target missed, in this order: {_TARGETS}; or "
            "error (the request failed; a 429 too). A client that left once a target was known "
            "missed (a figure over its limit, or a first token awaited past it) counts as that "
            "miss; other cancellations are counted apart. Requests refused for the client's own "
            "doing (error_type auth, not_found, context_length, bad_request) are not judged.",
            (*labels, "result"),
            registry=registry,
        )
        self.cancelled = Counter(
            "tokenprobe_slo_cancelled_requests",
            "Generative requests whose client went away before the end (from the proxy "
            "receiving the request to the disconnect) before any target was known missed, "
            "and background Responses not finished when their answer ended (queued, or a "
            "stream its client left): left out of SLO attainment.",
            labels,
            registry=registry,
        )
        self.goodput_tokens = Counter(
            "tokenprobe_goodput_tokens",
            "Output tokens of requests that met every SLO target, counted when each ended "
            "(first to last content read): rate() is goodput in tokens per second.",
            labels,
            registry=registry,
        )
        self._children: dict[tuple[str, ...], tuple[dict[str, Any], Any, Any]] = {}
        self._generative: dict[str, bool] = {}

    def record(self, m: Measurement, labels: Labels) -> None:
        generative = self._generative.get(m.endpoint)
        if generative is None:
            generative = self._generative[m.endpoint] = seam_of(m.endpoint).generative
        if not generative:
            return
        limits = self.policy.limits(m.model)
        if not limits:
            return  # neither the file nor --slo gives this model a target
        result = slo.verdict(m, limits)
        if result == slo.REFUSED:
            return  # the client's own doing, counted by error_type in requests_total
        results, cancelled, tokens = self._bound((labels.model, m.endpoint, *labels.attribution))
        if result == slo.CANCELLED:
            cancelled.inc()
            return
        results[result].inc()
        if result == slo.MET and m.output_tokens:
            tokens.inc(m.output_tokens)

    def _bound(self, key: tuple[str, ...]) -> tuple[dict[str, Any], Any, Any]:
        """Every child of one (model, endpoint, *attribution), resolved once: all results
        at once, so a series reads 0 before its first miss (rate() needs that start)."""
        children = self._children.get(key)
        if children is None:
            results = {r: self.requests.labels(*key, r) for r in slo.RESULTS}
            children = (results, self.cancelled.labels(*key), self.goodput_tokens.labels(*key))
            self._children[key] = children
        return children
