"""Prometheus metrics of the decision server, served at `GET /metrics` (`prometheus-client`).

One registry per app (never the process-global one), so several apps in one process keep
their own counts. What it holds:

| metric | kind | labels |
|---|---|---|
| `canvasroute_server_requests_total` | counter | `route`, `method`, `status` |
| `canvasroute_server_request_duration_seconds` | histogram | `route` |
| `canvasroute_server_requests_in_flight` | gauge | |
| `canvasroute_server_queue_wait_seconds` | histogram (admission to a running slot) | |
| `canvasroute_server_decisions_total` | counter: questions answered | `path`, `cause` (below) |
| `canvasroute_server_refusals_total` | counter: questions answered `refusal` on `/v1/decisions` | `reason` (below) |
| `canvasroute_server_hedges_total` | counter: hedged target calls (`--hedge-band`) | `outcome` (below) |
| `canvasroute_server_rejections_total` | counter: requests and connections turned away | `reason` (the error `type`) |
| `canvasroute_server_connections` | gauge: open client connections | |
| `canvasroute_server_decisions_running`, `..._queued` | gauges, read from the gate at scrape | |
| `canvasroute_server_controller_target` | gauge: the escalation rate the controller holds (`--target-escalation`) | |
| `canvasroute_server_controller_rate` | gauge: its realised rate, decayed, over the questions it controls | |
| `canvasroute_server_controller_offset` | gauge: its threshold offsets over those questions | `stat` (min, mean, max) |
| `canvasroute_server_controller_questions` | gauge: questions it holds an offset for | |
| `canvasroute_server_breaker_state` | gauge: 1 for the escalation breaker's state, else 0 | `state` |
| `canvasroute_server_breaker_transitions_total` | counter: its changes of state | `state` (entered) |
| `canvasroute_server_breaker_short_circuits_total` | counter: decisions it kept from the target | |
| `canvasroute_server_breaker_failures_total` | counter: failed target calls | |
| `canvasroute_server_fault_cap_escalations` | gauge: engine-fault escalations in the cap's window now | |
| `canvasroute_server_fault_cap_limit` | gauge: the cap (`Breaker.fault_escalations`; absent when uncapped) | |
| `canvasroute_server_fault_cap_refused_total` | counter: engine-fault questions past the cap | |
| `canvasroute_server_live_max_error`, `..._confidence` | gauges: the claim (`--audit-max-error`, ...) | |
| `canvasroute_server_live_questions` | gauge: questions live certification gates | `state` |
| `canvasroute_server_live_threshold` | gauge: certified thresholds, over certified questions | `stat` |
| `canvasroute_server_live_bound` | gauge: their anytime-valid bounds on disagreement | `stat` |
| `canvasroute_server_live_audits_total` | counter: audits sent (this worker) | |
| `canvasroute_server_live_rows_total` | counter: labelled rows counted (this worker) | |
| `canvasroute_server_live_alarms_total` | counter: drift alarms (this worker) | |
| `canvasroute_server_live_dropped_total` | counter: sampled decisions left out | `reason` |
| `canvasroute_server_live_pending` | gauge: audits reserved or in flight | |

Decisions: `path` is canvas, reread, escalated, fallback, unsure or skipped; `cause` is
uncertain, abstained, engine_fault, over_budget or target_fault (`none` when the gate passed).
The breaker and fault-cap figures are the served model's (`CanvasDecisionModel.breaker_counters`,
read at scrape; in this process). Refusals: `reason` is `escalation_refused` (the target refused
it), `target_fault` (`--refuse-unsure`, its escalation failed), `unsure` (`--refuse-unsure`),
`model_refused` (the decision model refused them all) or `no_answer` (another decision model
left it unanswered). Hedges: `outcome` is won, cancelled, failed or refused (`Diagnostics.hedges`).
Live certification (`--audit-rate`): `state` is certified or uncertified; `stat` min, mean, max;
`reason` slots (every audit slot taken), budget (the escalation budget refused it) or failed (the
labeller's transport).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .gate import Gate

__all__ = ["Metrics", "MetricsMiddleware"]

ROUTES = frozenset({"/v1/systemone", "/v1/decisions", "/v1/models", "/health", "/metrics", "/openapi.json"})
"""Routes counted by name; any other path is counted as `other` (no unbounded label values)."""
REJECTED = frozenset({400, 401, 404, 408, 413, 415, 422, 429, 529})
"""Statuses that turn a request away before or instead of decision work (engine faults are not among them)."""
_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class _GateCollector:
    """Running and queued decisions, read from the gate when scraped."""

    def __init__(self, gate: Gate) -> None:
        self.gate = gate

    def collect(self) -> Iterable[GaugeMetricFamily]:
        load = self.gate.snapshot()
        yield GaugeMetricFamily("canvasroute_server_decisions_running", "Decisions holding a running slot",
                                value=load["in_flight"])
        yield GaugeMetricFamily("canvasroute_server_decisions_queued", "Admitted decisions waiting for a slot",
                                value=load["queued"])


class _ControllerCollector:
    """The served model's escalation-rate controller, read when scraped (question ids stay out of
    the labels: a client names them, so they would be unbounded)."""

    def __init__(self, model: Any) -> None:
        self.model = model

    def collect(self) -> Iterable[GaugeMetricFamily]:
        snap = self.model.controller_counters
        if not snap:
            return
        questions = list((snap.get("questions") or {}).values())
        yield GaugeMetricFamily("canvasroute_server_controller_target", "Escalation rate the controller holds",
                                value=snap["target"])
        yield GaugeMetricFamily("canvasroute_server_controller_questions", "Questions the controller holds an "
                                "offset for", value=len(questions))
        decided = sum(q["decisions"] for q in questions)
        if decided:
            rate = sum(q["rate"] * q["decisions"] for q in questions) / decided
            yield GaugeMetricFamily("canvasroute_server_controller_rate", "Realised escalation rate (decayed, "
                                    "weighted by decisions) over the questions the controller holds", value=rate)
        if questions:
            offsets = [q["offset"] for q in questions]
            family = GaugeMetricFamily("canvasroute_server_controller_offset", "Threshold offsets the controller "
                                       "holds, over its questions", labels=["stat"])
            for stat, value in (("min", min(offsets)), ("mean", sum(offsets) / len(offsets)), ("max", max(offsets))):
                family.add_metric([stat], value)
            yield family


class _BreakerCollector:
    """The served model's escalation breaker and engine-fault cap (`breaker_counters`), read when scraped."""

    STATES = ("closed", "open", "half_open")

    def __init__(self, model: Any) -> None:
        self.model = model

    def collect(self) -> Iterable[GaugeMetricFamily | CounterMetricFamily]:
        snap = self.model.breaker_counters
        if not snap:
            return
        state = GaugeMetricFamily("canvasroute_server_breaker_state", "The escalation target's circuit breaker: 1 "
                                  "for its state", labels=["state"])
        for name in self.STATES:
            state.add_metric([name], float(snap["state"] == name))
        yield state
        moved = CounterMetricFamily("canvasroute_server_breaker_transitions", "The breaker's changes of state, by "
                                    "the state entered", labels=["state"])
        for name in ("open", "half_open", "closed"):
            moved.add_metric([name], snap[name])
        yield moved
        yield CounterMetricFamily("canvasroute_server_breaker_short_circuits", "Decisions whose questions the open "
                                  "breaker kept from the target", value=snap["short_circuits"])
        yield CounterMetricFamily("canvasroute_server_breaker_failures", "Failed calls to the escalation target",
                                  value=snap["failures"])
        yield GaugeMetricFamily("canvasroute_server_fault_cap_escalations", "Engine-fault escalations in the cap's "
                                "window now", value=snap["fault_escalations"])
        if snap["fault_cap"] is not None:
            yield GaugeMetricFamily("canvasroute_server_fault_cap_limit", "Engine-fault escalations the cap allows "
                                    "per window", value=snap["fault_cap"])
        yield CounterMetricFamily("canvasroute_server_fault_cap_refused", "Engine-fault questions past the cap, not "
                                  "escalated", value=snap["fault_refused"])


class _LiveCollector:
    """The served model's live certification (`--audit-rate`), read when scraped (question ids stay
    out of the labels: a client names them)."""

    def __init__(self, model: Any) -> None:
        self.model = model

    def collect(self) -> Iterable[GaugeMetricFamily | CounterMetricFamily]:
        snap = self.model.live_counters
        if not snap:
            return
        questions = list((snap.get("questions") or {}).values())
        certified = [q for q in questions if q["threshold"] is not None]
        yield GaugeMetricFamily("canvasroute_server_live_max_error", "Disagreement rate live certification "
                                "certifies for the answers the gate passes", value=snap["max_error"])
        yield GaugeMetricFamily("canvasroute_server_live_confidence", "Confidence at which it certifies it, at "
                                "every moment", value=snap["confidence"])
        family = GaugeMetricFamily("canvasroute_server_live_questions", "Questions live certification gates",
                                   labels=["state"])
        family.add_metric(["certified"], len(certified))
        family.add_metric(["uncertified"], len(questions) - len(certified))
        yield family
        for name, key, text in (("threshold", "threshold", "Certified H/lnK thresholds"),
                                ("bound", "bound", "Anytime-valid upper bounds on the certified thresholds' "
                                                   "disagreement rates")):
            if certified:
                values = [float(q[key]) for q in certified]
                stats = GaugeMetricFamily(f"canvasroute_server_live_{name}", f"{text}, over the certified "
                                          "questions", labels=["stat"])
                for stat, value in (("min", min(values)), ("mean", sum(values) / len(values)), ("max", max(values))):
                    stats.add_metric([stat], value)
                yield stats
        counts = snap["counts"]
        for name, value, text in (("audits", counts["audits"], "Audits sent to the labeller"),
                                  ("rows", counts["rows"], "Labelled rows counted (audits and free escalated labels)"),
                                  ("alarms", counts["alarms"], "Drift alarms (each resets its question)")):
            yield CounterMetricFamily(f"canvasroute_server_live_{name}", f"{text}, this worker", value=value)
        dropped = CounterMetricFamily("canvasroute_server_live_dropped", "Sampled decisions left out of the rows, "
                                      "this worker", labels=["reason"])
        for reason, key in (("slots", "dropped_slots"), ("budget", "dropped_budget"), ("failed", "failed")):
            dropped.add_metric([reason], counts[key])
        yield dropped
        yield GaugeMetricFamily("canvasroute_server_live_pending", "Audits reserved or in flight",
                                value=snap["pending"])


class Metrics:
    """The server's metrics in their own registry (`model`: the served model, whose escalation-rate
    controller, if it has one, is read at scrape)."""

    def __init__(self, gate: Gate, model: Any = None) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("canvasroute_server_requests", "HTTP requests answered",
                                ["route", "method", "status"], registry=r)
        self.duration = Histogram("canvasroute_server_request_duration_seconds",
                                  "Seconds from a request's start to its answer", ["route"], buckets=_BUCKETS,
                                  registry=r)
        self.in_flight = Gauge("canvasroute_server_requests_in_flight", "HTTP requests being answered", registry=r)
        self.queue_wait = Histogram("canvasroute_server_queue_wait_seconds",
                                    "Seconds an admitted decision waited for a running slot", buckets=_BUCKETS,
                                    registry=r)
        self.decisions = Counter("canvasroute_server_decisions", "Questions answered, by the path that answered "
                                 "and why the gate did not pass them", ["path", "cause"], registry=r)
        self.refusals = Counter("canvasroute_server_refusals", "Questions answered with a refusal (/v1/decisions), "
                                "by why", ["reason"], registry=r)
        self.hedges = Counter("canvasroute_server_hedges", "Hedged target calls beside re-reads, by how they ended",
                              ["outcome"], registry=r)
        self.rejections = Counter("canvasroute_server_rejections", "Requests and connections turned away",
                                  ["reason"], registry=r)
        self.connections = Gauge("canvasroute_server_connections", "Open client connections", registry=r)
        r.register(_GateCollector(gate))
        escalation = getattr(model, "escalation", None)
        if escalation is not None and getattr(escalation, "controller", None) is not None:
            r.register(_ControllerCollector(model))  # the served canvas model's escalation-rate controller
        if escalation is not None and getattr(escalation, "breaker_state", None) is not None:
            r.register(_BreakerCollector(model))  # its escalation breaker and engine-fault cap
        if escalation is not None and getattr(escalation, "audit", None) is not None:
            r.register(_LiveCollector(model))  # the served canvas model's live certification

    def decided(self, reads: Mapping[str, Any], hedges: Iterable[str] = ()) -> None:
        """Count each question of an answered decision set by its path and cause, and its hedges."""
        for report in reads.values():
            cause = getattr(report, "cause", None)
            self.decisions.labels(str(getattr(report, "path", "unknown")), str(cause or "none")).inc()
        for outcome in hedges:
            self.hedges.labels(outcome).inc()

    def refused(self, status: int, kind: str) -> None:
        """Count a refusal that turned the request away (see `REJECTED`)."""
        if status in REJECTED:
            self.rejections.labels(kind).inc()

    def rejected(self, reason: str) -> None:
        """Count a connection turned away before any request (cap, slow head)."""
        self.rejections.labels(reason).inc()

    async def endpoint(self, request: Request) -> Response:
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)


class MetricsMiddleware:
    """Counts every HTTP request by route, method and status, with its duration and the in-flight gauge."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route = scope["path"] if scope["path"] in ROUTES else "other"
        status = 500
        started = time.perf_counter()

        async def sent(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        self.metrics.in_flight.inc()
        try:
            await self.app(scope, receive, sent)
        finally:
            self.metrics.in_flight.dec()
            self.metrics.requests.labels(route, scope["method"], str(status)).inc()
            self.metrics.duration.labels(route).observe(time.perf_counter() - started)
