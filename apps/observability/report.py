"""The dashboard's data: decide spans folded into per-node decisions, paths, causes, latencies
and per-run totals.

Decisions are counted with `Tally` (by path, and by why the gate did not pass: `cause`), as
the demo's console and the graph's decision events count them; an escalation is a question
whose path is `escalated`, whatever its cause.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from canvasroute.engine import TraceFileError
from canvasroute.router import Tally
from canvasroute.router import telemetry as tm

from .traces import SpanEvent, SpanRecord, decision_figures

__all__ = ["CAUSE_WORDS", "GUARD_WORDS", "PATHS", "Decision", "GuardEvent", "NodeStats", "Report", "RunTotals",
           "ShadowStats", "build_report", "cause_shares", "near_chance", "replayed_span"]

PATHS = Tally.PATHS
CAUSE_WORDS = {"uncertain": "uncertain", "abstained": "abstained", "engine_fault": "engine fault",
               "over_budget": "over budget", "target_fault": "target fault"}
"""Why the gate did not pass a question (`Cause`), in words, in `CAUSES` order."""
GUARD_WORDS = {("breaker", "open"): "breaker opened", ("breaker", "half_open"): "breaker half open (probe)",
               ("breaker", "closed"): "breaker closed", ("breaker", "short_circuit"): "kept from the target (open)",
               ("fault_cap", "capped"): "engine-fault cap reached",
               ("fault_cap", "uncapped"): "engine-fault cap cleared",
               ("fault_cap", "refused"): "engine faults not escalated (cap)"}
"""What an escalation guard did (`canvasroute.guard`, `canvasroute.guard.event`), in words."""


def cause_shares(tally: Tally) -> str:
    """`uncertain 3, abstained 1, engine fault 0, over budget 0`: the tally's causes, every one."""
    return ", ".join(f"{CAUSE_WORDS.get(c, c)} {k}" for c, k in tally.causes.items())

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
    cause: str | None = None
    """Why the gate did not pass it (`uncertain`, `abstained`, `engine_fault`, `over_budget`;
    None: it passed, or nothing was read)."""
    hedged: bool = False
    """The target was asked beside its re-reads (`Escalation.hedge`); `path` says which settled it."""
    escalation_error: str | None = None
    """Why its escalation failed (cause `target_fault`): the target's error, or its open breaker."""
    live_threshold: float | None = None
    """Live certification (`Escalation.audit`): the certified threshold the gate passed at (None:
    none certified, or no live certification)."""
    live_bound: float | None = None
    """... the anytime-valid bound on its disagreement rate when decided."""
    live_rows: int | None = None
    """... the labelled rows the bound rested on."""
    live_audits: int | None = None
    """... the audits spent on the question by then."""

    @property
    def agrees(self) -> bool | None:
        """For escalated questions with a canvas read: whether the canvas argmax was the answer."""
        if self.path != "escalated" or self.canvas_answer is None:
            return None
        return self.canvas_answer == self.answer


@dataclass(frozen=True, slots=True, kw_only=True)
class GuardEvent:
    """One thing an escalation guard did (`Escalation.breaker`), as the decide span it happened in recorded it."""

    time_ns: int
    node: str
    guard: str
    """`breaker` (the target's circuit breaker) or `fault_cap` (the cap on what engine faults escalate)."""
    what: str
    """`open`, `half_open`, `closed`, `short_circuit`; `capped`, `uncapped`, `refused` (`GUARD_WORDS`)."""
    message: str
    questions: tuple[str, ...]
    """The questions it kept from the target (a short circuit, a refusal)."""
    trace_id: str

    @property
    def change(self) -> bool:
        """Whether it changed the guard's state (else it kept a decision's questions from the target)."""
        return self.what not in ("short_circuit", "refused")


@dataclass(slots=True)
class NodeStats:
    """Everything the page shows for one graph node."""

    name: str
    decisions: list[Decision] = field(default_factory=list)
    set_latencies: list[float] = field(default_factory=list)
    """Duration of each decision set decided at this node (decide spans, cache hits left out:
    `replayed`), seconds."""
    replayed: int = 0
    """Decision sets a `DecisionCache` replayed at this node (`replayed_span`)."""
    errors: int = 0

    @property
    def tally(self) -> Tally:
        """Its decisions counted as the console and the stream events count them."""
        return Tally.of(self.decisions)

    @property
    def escalated(self) -> Tally:
        """Its escalated questions only: their `causes` say why each went to the target."""
        return Tally.of(d for d in self.decisions if d.path == "escalated")

    @property
    def paths(self) -> Counter[str]:
        return Counter(d.path for d in self.decisions)

    @property
    def escalation_rate(self) -> float:
        """Share of its questions the escalation target answered (path `escalated`, any cause)."""
        return escalation_rate(self.tally)

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
class RunTotals:
    """What one run's decisions cost (a run: one trace file), beside what they would have cost
    had every decision set gone to the escalation target (one target call per set).

    Measured: decision sets, questions, canvas reads, escalated questions, target calls, their
    tokens and seconds. Estimated (`if_all_to_target_*`): the mean measured target call times the
    decision sets; None when no target call reported it (a hedge cancelled before it answered is a
    target call, as `Totals` counts it, but no measure of one: the mean seconds leave it out). The
    figures are the runs' `Totals`: a `DecisionCache` hit (a decide span marked
    `canvasroute.cache.hit`) decided nothing, so it is counted apart (`replayed`), never as a
    decision set routing answered without the target.
    """

    source: str
    """The trace file (empty: spans not read from a file)."""
    models: dict[str, str] = field(default_factory=dict)
    """Its canvas models, name to provider."""
    sets: int = 0
    """Decision sets decided (decide spans, cache hits left out: `replayed`)."""
    questions: int = 0
    reads: int = 0
    """Canvas reads sent (`canvasroute.canvas_reads` of the decide spans)."""
    escalated: int = 0
    """Questions the escalation target answered (path `escalated`)."""
    target_calls: int = 0
    """Calls to the target, as `Totals` counts them: each `escalate` span's `canvasroute.escalation.calls`
    (a malformed reply's retry is a second; a hedge cancelled before it was sent, none; a span
    without it, one)."""
    target_tokens: int = 0
    """Tokens (input + output) of the target calls that reported usage."""
    calls_with_usage: int = 0
    target_s: float = 0.0
    """Seconds spent in target calls."""
    canvas_tokens: int = 0
    """Tokens (input + output) of the canvas reads that reported usage: routing's own cost."""
    decide_s: float = 0.0
    """Seconds of the decision sets, end to end (escalations and replays included)."""
    replayed: int = 0
    """Decision sets a `DecisionCache` replayed (cache hits): nothing read, nothing escalated."""
    hedges: int = 0
    """Target calls made as hedges beside re-reads (`escalate` spans marked `canvasroute.hedge`)."""
    hedges_cancelled: int = 0
    """Hedges cancelled because the re-reads settled their questions first."""
    cancelled_s: float = 0.0
    """Seconds of the cancelled hedges (in `target_s`)."""
    cancelled_calls: int = 0
    """Target calls of the cancelled hedges (in `target_calls`; a hedge cancelled before it was sent made none)."""
    audits: int = 0
    """Target calls made as audits (live certification's labeller, `escalate` spans marked
    `canvasroute.audit`): in `target_calls`, as they are target work."""

    @property
    def calls_saved(self) -> int:
        """Target calls not made: decision sets the canvas answered without the target."""
        return self.sets - self.target_calls

    @property
    def if_all_to_target_tokens(self) -> float | None:
        """Estimated target tokens had every decision set been a target call."""
        return self.target_tokens / self.calls_with_usage * self.sets if self.calls_with_usage else None

    @property
    def if_all_to_target_s(self) -> float | None:
        """Estimated target seconds had every decision set been a target call (the mean completed
        call: cancelled hedges left out)."""
        completed = self.target_calls - self.cancelled_calls
        return (self.target_s - self.cancelled_s) / completed * self.sets if completed else None

    def __add__(self, other: RunTotals) -> RunTotals:
        return RunTotals("all runs", {**self.models, **other.models}, self.sets + other.sets,
                         self.questions + other.questions, self.reads + other.reads,
                         self.escalated + other.escalated, self.target_calls + other.target_calls,
                         self.target_tokens + other.target_tokens, self.calls_with_usage + other.calls_with_usage,
                         self.target_s + other.target_s, self.canvas_tokens + other.canvas_tokens,
                         self.decide_s + other.decide_s, self.replayed + other.replayed,
                         self.hedges + other.hedges, self.hedges_cancelled + other.hedges_cancelled,
                         self.cancelled_s + other.cancelled_s, self.cancelled_calls + other.cancelled_calls,
                         self.audits + other.audits)


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
    runs: list[RunTotals] = field(default_factory=list)
    """What each run (trace file) cost, in file order."""
    guards: list[GuardEvent] = field(default_factory=list)
    """What the escalation guards did (breaker changes and short circuits, the engine-fault cap), in time order."""

    @property
    def decisions(self) -> list[Decision]:
        return [d for n in self.nodes.values() for d in n.decisions]

    @property
    def set_latencies(self) -> list[float]:
        """Every node's decision set durations (cache hits left out), seconds."""
        return [x for n in self.nodes.values() for x in n.set_latencies]

    @property
    def replayed(self) -> int:
        """Decision sets a `DecisionCache` replayed, at every node."""
        return sum(n.replayed for n in self.nodes.values())

    @property
    def tally(self) -> Tally:
        return Tally.of(self.decisions)

    @property
    def escalated(self) -> Tally:
        """The escalated questions only: their `causes` say why each went to the target."""
        return Tally.of(d for d in self.decisions if d.path == "escalated")


def escalation_rate(tally: Tally) -> float:
    """Escalated questions over all questions of a tally (0 when it is empty)."""
    return tally.paths["escalated"] / tally.decisions if tally.decisions else 0.0


def _is_decide(s: SpanRecord) -> bool:
    return s.name.startswith("decide ") and tm.DECISION_SET in s.attributes


def replayed_span(s: SpanRecord) -> bool:
    """Whether a span is a cache hit (`canvasroute.cache.hit`): a replay decided nothing, so every
    figure counts it apart from the decision sets (`Totals`)."""
    return s.attributes.get(tm.CACHE_HIT) is True


def build_report(spans: Sequence[SpanRecord], sources: Sequence[str] = ()) -> Report:
    """Group decide spans by node and collect their child calls."""
    decides = [s for s in spans if _is_decide(s)]
    if not decides:
        raise TraceFileError("no canvasroute decision spans (`decide <model>`) in the trace files"
                             if spans else "the trace files hold no spans")
    decide_ids = {s.span_id for s in decides}
    figures = {s.span_id: decision_figures(s) for s in decides}
    nodes: dict[str, NodeStats] = {}
    models: dict[str, str] = {}
    guards: list[GuardEvent] = []
    for s in decides:
        node = str(s.attributes.get(tm.GRAPH_NODE) or s.attributes.get(tm.DECISION_SET))
        guards += [_guard_event(e, s, node) for e in s.events if e.name == tm.GUARD_EVENT]
        stats = nodes.setdefault(node, NodeStats(node))
        stats.errors += s.status == "ERROR"
        models.setdefault(s.name[len("decide "):], "")
        if replayed_span(s):
            stats.replayed += 1
            continue
        stats.set_latencies.append(s.duration_s)
        for qid, f in sorted(figures[s.span_id].items()):
            if "path" not in f:
                continue
            stats.decisions.append(Decision(
                time_ns=s.start_time_ns, node=node, question=qid, kind=str(f.get("kind", "")), path=str(f["path"]),
                answer=str(f.get("answer", "")), canvas_answer=_str_or_none(f.get("canvas_answer")),
                normalized_entropy=_float_or_none(f.get("normalized_entropy")),
                confidence=_float_or_none(f.get("confidence")), margin=_float_or_none(f.get("margin")),
                reads=int(f.get("reads") or 0), escalation_model=_str_or_none(f.get("escalation_model")),
                trace_id=s.trace_id, crossed=tuple(map(str, f.get("crossed") or ())), gate=_str_or_none(f.get("gate")),
                cause=_str_or_none(f.get("cause")), hedged=f.get("hedged") is True,
                escalation_error=_str_or_none(f.get("escalation_error")),
                live_threshold=_float_or_none(f.get("live_threshold")), live_bound=_float_or_none(f.get("live_bound")),
                live_rows=_int_or_none(f.get("live_rows")), live_audits=_int_or_none(f.get("live_audits"))))
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
                  spans=len(spans), sources=list(sources), runs=_run_totals(spans, decides, figures, chats),
                  guards=sorted(guards, key=lambda g: g.time_ns), **_graph_figures(spans))


def _guard_event(event: SpanEvent, s: SpanRecord, node: str) -> GuardEvent:
    """A `canvasroute.guard` event of a decide span, as the dashboard shows it."""
    a = event.attributes
    asked = str(a.get(tm.ESCALATED_QUESTIONS) or "")
    return GuardEvent(time_ns=event.time_ns or s.start_time_ns, node=node, guard=str(a.get(tm.GUARD, "")),
                      what=str(a.get(tm.GUARD_WHAT, "")), message=str(a.get(tm.FAULT_MESSAGE, "")),
                      questions=tuple(q for q in asked.split(",") if q), trace_id=s.trace_id)


def _run_totals(spans: Sequence[SpanRecord], decides: Sequence[SpanRecord],
                figures: Mapping[str, Mapping[str, Mapping[str, Any]]],
                chats: Mapping[str | None, SpanRecord]) -> list[RunTotals]:
    """Per trace file: what its decision sets cost, from the decide spans and the calls under them."""
    runs: dict[str, RunTotals] = {}
    batches: Counter[str] = Counter()  # canvas reads per decide span, for spans without canvas_reads
    for s in decides:
        run = runs.setdefault(s.source, RunTotals(s.source))
        run.decide_s += s.duration_s
        if replayed_span(s):
            run.replayed += 1
            continue
        run.sets += 1
        questions = figures[s.span_id].values()
        run.questions += sum("path" in f for f in questions)
        run.escalated += sum(f.get("path") == "escalated" for f in questions)
    by_id = {s.span_id: s for s in decides}
    for s in spans:
        parent = by_id.get(s.parent_id or "")
        if parent is None:
            continue
        run = runs[parent.source]
        if s.attributes.get(tm.GEN_AI_OPERATION) == tm.OPERATION_CANVAS_READ:
            batches[parent.span_id] += int(s.attributes.get(tm.READ_BATCH) or 1)
            run.canvas_tokens += _tokens(s)
            run.models.setdefault(str(s.attributes.get(tm.GEN_AI_MODEL) or parent.name[len("decide "):]),
                                  str(s.attributes.get(tm.GEN_AI_PROVIDER) or s.attributes.get(tm.GEN_AI_SYSTEM) or ""))
        elif s.name.startswith(tm.OPERATION_ESCALATE + " "):
            made = s.attributes.get(tm.TARGET_CALLS)  # (a trace written before it was recorded: one call)
            calls = made if isinstance(made, int) and not isinstance(made, bool) else 1
            run.target_calls += calls
            run.target_s += s.duration_s
            run.hedges += tm.HEDGE in s.attributes
            run.audits += tm.AUDIT in s.attributes
            if s.attributes.get(tm.HEDGE) == "cancelled":  # its calls are target calls (`Totals`), not a call's time
                run.hedges_cancelled += 1
                run.cancelled_calls += calls
                run.cancelled_s += s.duration_s
            chat = chats.get(s.span_id)
            if chat is not None and tm.GEN_AI_INPUT_TOKENS in chat.attributes:
                run.target_tokens += _tokens(chat)
                run.calls_with_usage += 1
    for s in decides:
        run = runs[s.source]
        reads = s.attributes.get(tm.CANVAS_READS)
        run.reads += int(reads) if isinstance(reads, int) else batches[s.span_id]
        run.models.setdefault(s.name[len("decide "):], "")
    return list(runs.values())


def _tokens(s: SpanRecord) -> int:
    """Input plus output tokens a model-call span reported (0 when it reported none)."""
    return sum(int(v) for k in (tm.GEN_AI_INPUT_TOKENS, tm.GEN_AI_OUTPUT_TOKENS)
               if isinstance(v := s.attributes.get(k), (int, float)) and not isinstance(v, bool))


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
        if replayed_span(s):
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


def _int_or_none(v: Any) -> int | None:
    return int(v) if isinstance(v, int) and not isinstance(v, bool) else None


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
