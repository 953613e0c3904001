"""Prometheus metrics of one app, in a registry of its own (two apps in a process never collide).

Names (all prefixed `omni_`):
  requests_total{endpoint, model, status}      every API request, by the HTTP status it got
                                               (499: the client went away first)
  request_failures_total{endpoint, model, reason}
                                               invalid_request | model_not_found | rate_limited |
                                               unavailable | timeout | pipeline_error |
                                               client_disconnected | server_shutdown |
                                               server_error
  requests_in_flight{model}                    requests inside the pipeline now
  requests_queued{model}                       requests waiting for a place (admission)
  time_to_first_audio_seconds{model}           request received -> first audio bytes ready
  request_latency_seconds{endpoint, model}     request received -> last byte written
  audio_seconds_total{model}                   seconds of audio produced
  stage_queue_seconds{stage}                   time a request waited in a stage's inbox
  stage_compute_seconds{stage}                 time a stage's backend spent on a request
  stage_stream_lead_seconds{stage}             a media stream's smallest lead over its listener
                                               (audio it had beyond real time when a later
                                               chunk came out; 0 bucket: it ran dry)
  stage_stream_underruns_total{stage}          media streams whose listener ran out of audio
  http_rejections_total{reason}                requests refused before any endpoint saw them:
                                               unauthorized | host_not_allowed |
                                               origin_not_allowed
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from aiohttp import web
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from omni_server.serve.errors import ApiError

UNKNOWN_MODEL = "unknown"  # label for requests naming no served model (keeps cardinality bounded)

# Speech latencies on this voice run from ~10 ms (one short sentence) to tens of seconds (4096
# characters at 8 concurrent requests); stage times go lower (text normalization is sub-ms).
_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_STAGE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10)
# a stream's lead over its listener: 0 = it ran dry; a few seconds ahead is plenty
_LEAD_BUCKETS = (0.0, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30)


def _reason(status: int) -> str:
    if status == 404:
        return "model_not_found"
    if status == 429:
        return "rate_limited"
    if status == 503:
        return "unavailable"
    if status == 504:
        return "timeout"
    return "invalid_request" if status < 500 else "pipeline_error"


class ServerMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "omni_requests",
            "API requests by HTTP status",
            ["endpoint", "model", "status"],
            registry=r,
        )
        self.failures = Counter(
            "omni_request_failures",
            "API requests that did not get their result",
            ["endpoint", "model", "reason"],
            registry=r,
        )
        self.in_flight = Gauge(
            "omni_requests_in_flight", "requests inside the pipeline", ["model"], registry=r
        )
        self.ttfa = Histogram(
            "omni_time_to_first_audio_seconds",
            "request received to first audio ready",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.latency = Histogram(
            "omni_request_latency_seconds",
            "request received to response complete",
            ["endpoint", "model"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.audio_seconds = Counter(
            "omni_audio_seconds", "seconds of audio produced", ["model"], registry=r
        )
        self.stage_queue = Histogram(
            "omni_stage_queue_seconds",
            "time a request waited in a stage's inbox",
            ["stage"],
            buckets=_STAGE_BUCKETS,
            registry=r,
        )
        self.stage_compute = Histogram(
            "omni_stage_compute_seconds",
            "backend time a stage spent on a request",
            ["stage"],
            buckets=_STAGE_BUCKETS,
            registry=r,
        )
        self.stage_lead = Histogram(
            "omni_stage_stream_lead_seconds",
            "a media stream's smallest lead over a listener playing from its first chunk",
            ["stage"],
            buckets=_LEAD_BUCKETS,
            registry=r,
        )
        self.stage_underruns = Counter(
            "omni_stage_stream_underruns",
            "media streams that came out later than a listener playing from the first chunk",
            ["stage"],
            registry=r,
        )
        self.queued = Gauge(
            "omni_requests_queued",
            "requests waiting for a place in the pipeline (admission)",
            ["model"],
            registry=r,
        )
        self.rejections = Counter(
            "omni_http_rejections",
            "requests refused before any endpoint saw them",
            ["reason"],
            registry=r,
        )

        self.supervision = Counter(
            "omni_supervision_events",
            "stage process deaths, restarts and crash-loop failures (by instance), stage "
            "timeouts (by stage)",
            ["event", "subject"],
            registry=r,
        )

    def observe_supervision(self, event: str, subject: str, detail: str) -> None:
        """A runtime supervision observer: death / restart / failed (instance), timeout (stage)."""
        self.supervision.labels(event, subject).inc()

    def queue_length(self, model: str, length: int) -> None:
        """An admission `on_queue` hook."""
        self.queued.labels(model).set(length)

    def rejected(self, reason: str) -> None:
        """A request the door refused (access.py): counted, never seen by an endpoint."""
        self.rejections.labels(reason).inc()

    def observe_stage(
        self, stage: str, queue_seconds: float, compute_seconds: float, lead_seconds: float
    ) -> None:
        """A runtime stage observer: called once per request per stage (lead: NaN unless the
        stage streams media; +inf for a stream of one chunk, which has no later chunk)."""
        self.stage_queue.labels(stage).observe(queue_seconds)
        self.stage_compute.labels(stage).observe(compute_seconds)
        if math.isfinite(lead_seconds):
            # a histogram's sum must not shrink: a late stream counts in the 0 bucket and once
            # among the underruns
            self.stage_lead.labels(stage).observe(max(0.0, lead_seconds))
            if lead_seconds < 0:
                self.stage_underruns.labels(stage).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)

    @contextmanager
    def track(self, endpoint: str) -> Iterator[RequestTrack]:
        """Account one API request: its status, failure reason and latency, whatever happens.

        The handler fills in the track as it learns things (model, first audio, failure); an
        exception escaping the block that the handler did not classify is a server fault (500).
        """
        track = RequestTrack(endpoint)
        try:
            yield track
        except ApiError as error:
            track.fail(error.status, _reason(error.status))
            raise
        except web.HTTPException as error:  # aiohttp's own: 413 from the body reader
            track.fail(error.status, _reason(error.status))
            raise
        except BaseException:
            if track.status < 400 and track.failure is None:
                track.fail(500, "server_error")
            raise
        finally:
            self._finish(track)

    def _finish(self, track: RequestTrack) -> None:
        self.requests.labels(track.endpoint, track.model, str(track.status)).inc()
        if track.failure is not None:
            self.failures.labels(track.endpoint, track.model, track.failure).inc()
        else:
            self.latency.labels(track.endpoint, track.model).observe(track.elapsed())
        if track.first_audio_at is not None:
            self.ttfa.labels(track.model).observe(track.first_audio_at - track.started)
        if track.audio_seconds:
            self.audio_seconds.labels(track.model).inc(track.audio_seconds)

    @contextmanager
    def in_pipeline(self, model: str) -> Iterator[None]:
        gauge = self.in_flight.labels(model)
        gauge.inc()
        try:
            yield
        finally:
            gauge.dec()


@dataclass
class RequestTrack:
    endpoint: str
    model: str = UNKNOWN_MODEL
    status: int = 200
    failure: str | None = None
    audio_seconds: float = 0.0
    started: float = field(default_factory=time.perf_counter)
    first_audio_at: float | None = None

    def first_audio(self) -> None:
        if self.first_audio_at is None:
            self.first_audio_at = time.perf_counter()

    def fail(self, status: int, reason: str) -> None:
        """`status` is what the client got (the 200 already sent for a stream failing mid-way)."""
        self.status, self.failure = status, reason

    def elapsed(self) -> float:
        return time.perf_counter() - self.started
