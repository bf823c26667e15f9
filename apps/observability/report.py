"""The dashboard's data: decide spans folded into per-node decisions, paths and latencies."""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from canvasroute.engine import TraceFileError
from canvasroute.router import Tally
from canvasroute.router import telemetry as tm

from .traces import SpanRecord, decision_figures

__all__ = ["PATHS", "Decision", "NodeStats", "Report", "ShadowStats", "build_report", "near_chance"]

PATHS = Tally.PATHS

NEAR_CHANCE_NOTE = ("Tiny and embedded models (the tiny random DiffusionGemma used in tests, the embedded "
                    "SmolLM2-135M) are near chance at decisions: figures from them show the pipeline at work, "
                    "not decision quality.")


# -- the data ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Decision:
    """One question answered in one decision set, as its decide span recorded it."""

    time_ns: int
    node: str
    question: str
    kind: str
    path: str
    answer: str
    canvas_answer: str | None
    normalized_entropy: float | None
    confidence: float | None
    margin: float | None
    reads: int
    escalation_model: str | None
    trace_id: str
    crossed: tuple[str, ...] = ()
    """The gate thresholds the canvas read crossed (non-empty: over the gate)."""
    gate: str | None = None
    """What the gate passes (`GatePolicy.gate_text`); None in traces written before 0.2."""

    @property
    def agrees(self) -> bool | None:
        """For escalated questions with a canvas read: whether the canvas argmax was the answer."""
        if self.path != "escalated" or self.canvas_answer is None:
            return None
        return self.canvas_answer == self.answer


@dataclass(slots=True)
class NodeStats:
    """Everything the page shows for one graph node."""

    name: str
    decisions: list[Decision] = field(default_factory=list)
    set_latencies: list[float] = field(default_factory=list)
    """Duration of each decision set (decide span) at this node, seconds."""
    errors: int = 0

    @property
    def tally(self) -> Tally:
        """Its decisions counted as the console and the stream events count them."""
        return Tally.of(self.decisions)

    @property
    def paths(self) -> Counter[str]:
        return Counter(d.path for d in self.decisions)

    @property
    def escalation_rate(self) -> float:
        return self.paths["escalated"] / len(self.decisions) if self.decisions else 0.0

    @property
    def agreement(self) -> tuple[int, int]:
        """(agreeing, escalated with a canvas read)."""
        votes = [d.agrees for d in self.decisions if d.agrees is not None]
        return sum(votes), len(votes)


@dataclass(slots=True)
class ShadowStats:
    """Shadow mode at one node: the existing router against a canvas-only read."""

    sets: int = 0
    agreed: int = 0
    canvas_alone: int = 0
    """Sets where no question would have escalated at the thresholds in effect."""
    canvas_errors: int = 0
    router_latencies: list[float] = field(default_factory=list)
    canvas_latencies: list[float] = field(default_factory=list)

    @property
    def agreement(self) -> float | None:
        return self.agreed / self.sets if self.sets else None

    @property
    def canvas_alone_share(self) -> float | None:
        return self.canvas_alone / self.sets if self.sets else None


@dataclass(slots=True)
class Report:
    """Decision spans grouped by node, plus the engine and escalation calls under them."""

    nodes: dict[str, NodeStats]
    models: dict[str, str]
    """Canvas model name to provider."""
    escalation_models: dict[str, str]
    """Escalation model name to provider."""
    read_latencies: dict[str, list[float]]
    """Engine call durations by read kind (`first`, `reread`), seconds."""
    escalation_latencies: list[float]
    start_ns: int
    end_ns: int
    spans: int
    sources: list[str] = field(default_factory=list)
    routes: dict[tuple[str, str], int] = field(default_factory=dict)
    """Decision sets per (node, destination), from `route <node>` spans: the edges' traffic."""
    cache_hits: dict[str, int] = field(default_factory=dict)
    """Spans marked `canvasroute.cache.hit`, per graph node."""
    shadow: dict[str, ShadowStats] = field(default_factory=dict)
    graph: dict[str, Any] | None = None
    """The graph's nodes and edges (a `graph <name>` span, or `--graph`), if any."""

    @property
    def decisions(self) -> list[Decision]:
        return [d for n in self.nodes.values() for d in n.decisions]

    @property
    def tally(self) -> Tally:
        return Tally.of(self.decisions)


def _is_decide(s: SpanRecord) -> bool:
    return s.name.startswith("decide ") and tm.DECISION_SET in s.attributes


def build_report(spans: Sequence[SpanRecord], sources: Sequence[str] = ()) -> Report:
    """Group decide spans by node and collect their child calls."""
    decides = [s for s in spans if _is_decide(s)]
    if not decides:
        raise TraceFileError("no canvasroute decision spans (`decide <model>`) in the trace files"
                             if spans else "the trace files hold no spans")
    decide_ids = {s.span_id for s in decides}
    nodes: dict[str, NodeStats] = {}
    models: dict[str, str] = {}
    for s in decides:
        node = str(s.attributes.get(tm.GRAPH_NODE) or s.attributes.get(tm.DECISION_SET))
        stats = nodes.setdefault(node, NodeStats(node))
        stats.set_latencies.append(s.duration_s)
        stats.errors += s.status == "ERROR"
        models.setdefault(s.name[len("decide "):], "")
        for qid, f in sorted(decision_figures(s).items()):
            if "path" not in f:
                continue
            stats.decisions.append(Decision(
                time_ns=s.start_time_ns, node=node, question=qid, kind=str(f.get("kind", "")), path=str(f["path"]),
                answer=str(f.get("answer", "")), canvas_answer=_str_or_none(f.get("canvas_answer")),
                normalized_entropy=_float_or_none(f.get("normalized_entropy")),
                confidence=_float_or_none(f.get("confidence")), margin=_float_or_none(f.get("margin")),
                reads=int(f.get("reads") or 0), escalation_model=_str_or_none(f.get("escalation_model")),
                trace_id=s.trace_id, crossed=tuple(map(str, f.get("crossed") or ())), gate=_str_or_none(f.get("gate"))))
    reads: dict[str, list[float]] = defaultdict(list)
    escalations: list[float] = []
    escalation_models: dict[str, str] = {}
    chats = {s.parent_id: s for s in spans if s.attributes.get(tm.GEN_AI_OPERATION) == tm.OPERATION_CHAT}
    for s in spans:
        if s.parent_id not in decide_ids:
            continue
        op = s.attributes.get(tm.GEN_AI_OPERATION)
        model = str(s.attributes.get(tm.GEN_AI_MODEL, ""))
        provider = str(s.attributes.get(tm.GEN_AI_PROVIDER) or s.attributes.get(tm.GEN_AI_SYSTEM) or "")
        if op == tm.OPERATION_CANVAS_READ:
            reads[str(s.attributes.get(tm.READ_KIND, "first"))].append(s.duration_s)
            if model:
                models[model] = provider
        elif s.name.startswith("escalate "):
            escalations.append(s.duration_s)
            chat = chats.get(s.span_id)  # the model and provider live on the `chat` call under it
            if chat is not None:
                model = model or str(chat.attributes.get(tm.GEN_AI_MODEL, ""))
                provider = provider or str(chat.attributes.get(tm.GEN_AI_PROVIDER)
                                           or chat.attributes.get(tm.GEN_AI_SYSTEM) or "")
            escalation_models[model or s.name[len("escalate "):]] = provider
    return Report(nodes=dict(sorted(nodes.items())), models=models, escalation_models=escalation_models,
                  read_latencies=dict(reads), escalation_latencies=escalations,
                  start_ns=min(s.start_time_ns for s in decides), end_ns=max(s.end_time_ns for s in decides),
                  spans=len(spans), sources=list(sources), **_graph_figures(spans))


def _graph_figures(spans: Sequence[SpanRecord]) -> dict[str, Any]:
    """Edge traffic, cache hits, shadow mode and the recorded graph structure."""
    routes: Counter[tuple[str, str]] = Counter()
    cache: Counter[str] = Counter()
    shadow: dict[str, ShadowStats] = {}
    graph = None
    for s in spans:
        a = s.attributes
        node = str(a.get(tm.GRAPH_NODE, ""))
        if tm.ROUTE_DESTINATION in a and s.name.startswith(tm.OPERATION_ROUTE + " "):
            routes[(node, str(a[tm.ROUTE_DESTINATION]))] += 1
        if a.get(tm.CACHE_HIT) is True:
            cache[node or str(a.get(tm.DECISION_SET, ""))] += 1
        if tm.SHADOW_DESTINATION in a:
            st = shadow.setdefault(node, ShadowStats())
            st.sets += 1
            st.agreed += a.get(tm.SHADOW_AGREES) is True
            st.canvas_alone += a.get(tm.SHADOW_CANVAS_ALONE) is True
            st.canvas_errors += tm.SHADOW_CANVAS_ERROR in a
            st.router_latencies.append(float(a.get(tm.SHADOW_ROUTER_LATENCY) or 0.0))
            st.canvas_latencies.append(float(a.get(tm.SHADOW_CANVAS_LATENCY) or 0.0))
        if tm.GRAPH_STRUCTURE in a:
            try:
                graph = json.loads(a[tm.GRAPH_STRUCTURE])  # the latest one wins
            except (TypeError, ValueError) as exc:
                raise TraceFileError(f"span {s.span_id}: {tm.GRAPH_STRUCTURE} is not JSON ({exc})") from exc
    return {"routes": dict(routes), "cache_hits": dict(cache), "shadow": dict(sorted(shadow.items())),
            "graph": graph}


def _float_or_none(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _str_or_none(v: Any) -> str | None:
    return str(v) if v is not None else None


def near_chance(model: str, provider: str = "") -> str | None:
    """Why figures from this model say nothing about decision quality (None: a real model)."""
    name = model.casefold()
    if provider == "function":
        return "a FunctionEngine test double (synthetic rows)"
    if "smollm" in name:
        return "the embedded SmolLM2-135M (near chance at decisions)"
    if "tiny" in name or "random" in name:
        return "a tiny random DiffusionGemma (near chance at decisions)"
    return None
