"""Aggregation: one histogram's points by attribute key, and the SDK's metric data made
from them at export (`histogram_metric`, `sum_metric`).

A point is a flat list, [count, sum, min, max, bucket counts...]: a request's values take
one dict look-up and a bisect each, no SDK object, until an export reads them.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Mapping, Sequence
from typing import Any

from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    Histogram,
    HistogramDataPoint,
    Metric,
    NumberDataPoint,
    Sum,
)

from proxy.core.buckets import bucket_counts
from proxy.sinks.otlp.instruments import Instrument

Key = tuple[tuple[str, Any], ...]


class Points:
    """One histogram's points, by attribute key."""

    __slots__ = ("bounds", "points")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        # key -> [count, sum, min, max, bucket counts...]
        self.points: dict[Key, list[Any]] = {}

    def add(self, key: Key, values: Sequence[float]) -> None:
        point = self.points.get(key)
        if point is None:
            point = self.points[key] = [0, 0.0, math.inf, -math.inf] + [0] * (len(self.bounds) + 1)
        bounds = self.bounds
        if len(values) == 1:
            value = values[0]
            point[4 + bisect_left(bounds, value)] += 1  # the first bound >= value, as le
        else:  # a stream's chunk gaps
            for i, n in enumerate(bucket_counts(bounds, values), 4):
                if n:
                    point[i] += n
        point[0] += len(values)
        point[1] += sum(values)
        point[2] = min(point[2], *values)
        point[3] = max(point[3], *values)


def histogram_metric(
    instrument: Instrument,
    points: Mapping[Key, list[Any]],
    start: int,
    now: int,
    temporality: AggregationTemporality,
) -> Metric:
    data = [
        HistogramDataPoint(
            attributes=dict(key),
            start_time_unix_nano=start,
            time_unix_nano=now,
            count=p[0],
            sum=p[1],
            bucket_counts=p[4:],
            explicit_bounds=instrument.bounds,
            min=p[2],
            max=p[3],
        )
        for key, p in points.items()
    ]
    return Metric(
        instrument.name, instrument.description, instrument.unit, Histogram(data, temporality)
    )


def sum_metric(
    instrument: Instrument,
    values: Mapping[Key, float],
    start: int,
    now: int,
    temporality: AggregationTemporality,
    monotonic: bool,
) -> Metric:
    data = [NumberDataPoint(dict(key), start, now, value) for key, value in values.items()]
    return Metric(
        instrument.name, instrument.description, instrument.unit, Sum(data, temporality, monotonic)
    )
