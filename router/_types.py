"""What a decision returns, in one outcome vocabulary: langchain-core answers, a report per question.

Every report says who answered (`path`) and, when the gate did not pass the canvas answer,
why (`cause`). The same words are on the wire (`diagnostics`), in traces
(`canvasroute.decision.path`, `canvasroute.decision.cause`), in graph records and events, and
on the dashboard, which count with one `Tally`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal, get_args

from langchain_core.decisions import ClassifierResponse
from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:
    pass

Path = Literal["canvas", "reread", "escalated", "fallback", "unsure", "human", "skipped"]
"""Who answered. `canvas` and `reread`: the gate passed the canvas answer (at the first read,
or on the mean of its re-reads). `escalated`: the escalation target answered. `fallback`: the
question's declared fallback option. `unsure`: the canvas answer stands though the gate did
not pass it (`OutcomePolicy` said `answer` or `review`, there was nothing to escalate to, or
the escalation failed: cause `target_fault`).
`human`: a reviewer chose (graph records only). `skipped`: a dependent question whose
condition did not hold; it has no answer."""

Cause = Literal["uncertain", "abstained", "engine_fault", "over_budget", "target_fault"]
"""Why the gate did not pass the canvas answer (`OutcomePolicy` has one action per cause):
`uncertain` (a threshold was crossed after the re-reads), `abstained` (the abstain label won),
`engine_fault` (the engine failed for it), `over_budget` (escalation was wanted, the budget
was spent, or engine faults' escalations were capped: `Breaker.fault_escalations`),
`target_fault` (escalation was wanted, the target failed or its breaker was open:
`ReadReport.escalation_error` says which)."""

PATHS: tuple[str, ...] = get_args(Path)
CAUSES: tuple[str, ...] = get_args(Cause)


# -- how the decision was read -----------------------------------------------------------


class ThoughtReport(BaseModel):
    """A thought the model wrote before a canvas was read (`think`)."""

    model_config = ConfigDict(frozen=True)

    text: str
    tokens: int
    closed: bool
    """Whether the model closed its thought channel (else the budget cut it)."""
    latency_s: float


class Diagnostics(BaseModel):
    """How one decision was read."""

    model_config = ConfigDict(frozen=True)

    stages: list[list[str]] = Field(default_factory=list)
    """Question ids asked per dependency stage, in read order (one stage without `depends_on`)."""
    chunks: list[list[str]] = Field(default_factory=list)
    """Question ids per canvas prompt, over every stage."""
    formats: list[Literal["lines", "compact"]] = Field(default_factory=list)
    """Answer format of each chunk: `q1: A` lines, or `q1A q2B` (many questions)."""
    conditioning: Literal["restated"] | None = None
    """How a later stage saw earlier answers: restated after the state (None: one stage)."""
    constrained: bool = False
    steps: int = 1
    thoughts: list[ThoughtReport] = Field(default_factory=list)
    """The thought each chunk's reads continued (`think`), in chunk order."""
    prompt_tokens: int = 0
    """Prompt tokens of the first read (0 when the engine reports none)."""
    target_calls: int = 0
    """Calls handed to the escalation target: a malformed reply's retry is a second, a hedge
    cancelled after it was sent is one, a hedge cancelled before it was sent none."""
    hedges: list[Literal["won", "cancelled", "failed", "refused"]] = Field(default_factory=list)
    """How each hedge (`Escalation.hedge`) ended: `won` (the target answered), `cancelled` (the
    re-reads settled its questions first), `failed` (the call failed), `refused` (the budget, or a
    sync target's busy hedge threads, turned it away: not sent, the questions went the sequential way)."""
    hedges_ran_on: int = 0
    """Cancelled hedges whose call to a sync target ran on in its thread (no thread can be
    cancelled: it ends by itself, its reply dropped; `SyncThreads` bounds how many run at once)."""


class ReadReport(BaseModel):
    """How one question was answered: the canvas figures, the path, and provenance.

    Plain JSON-able values only, so a report can go into LangGraph state and checkpoints
    (`report.model_dump()`).
    """

    model_config = ConfigDict(frozen=True)

    question_id: str
    kind: Literal["noul", "choice", "score"]
    answer: str | None
    """Chosen option: `yes`/`no`, a Choice key, or a Score level as a string (None only
    for a `skipped` question)."""
    labels: list[str]
    """Canvas label of each option, in option order (e.g. `A`, `B`, ...)."""
    probabilities: dict[str, float]
    """Final distribution over option names (the escalation's when escalated and known)."""
    canvas_probabilities: dict[str, float] | None = None
    """The canvas distribution the gate saw (mean over reads), None if the engine failed."""
    entropy: float | None = None
    """Canvas entropy in nats."""
    normalized_entropy: float | None = None
    """Canvas entropy over ln K."""
    margin: float | None = None
    label_mass: float | None = None
    """Share of the model's probability on the labels (None when the reads were
    constrained, which normalize over the labels and cannot measure it)."""
    confidence: float | None = None
    """Canvas probability of its chosen label (mean over reads)."""
    path: Path
    cause: Cause | None = None
    """Why the gate did not pass the canvas answer (None: it passed, or nothing was read)."""
    confident: bool
    """Whether the gate passed the canvas answer: True exactly on paths `canvas` and `reread`."""
    crossed: list[str] = Field(default_factory=list)
    """Thresholds the canvas answer crossed at its last gate (non-empty: over the gate)."""
    gate: str | None = None
    """The gate the canvas read was held to (`GatePolicy.gate_text`, e.g. `H/lnK <= 0.5`); None
    when nothing was read (an engine fault before the read, a skipped question)."""
    reads: int = 0
    """Canvas reads of this question (1 + re-reads)."""
    agreement: float | None = None
    """Share of its reads whose argmax is the answer; None with one read (nothing to agree)."""
    stderr: float | None = None
    """Standard error of the answer's probability across reads; None with one read."""
    rereadable: bool = True
    """False when the gate wanted a re-read that could not have changed this read (a causal
    readout's slot that sees no noisy position: `EngineInfo.causal_readout`), so none was made."""
    escalation_model: str | None = None
    """The model that answered an escalated question (or refused it: `refusal`)."""
    escalation_confidence: float | None = None
    """The escalation target's own confidence in its answer, when it reports one (decision targets)."""
    hedged: bool = False
    """The target was asked beside this question's re-reads (`Escalation.hedge`); `path` says
    which settled it first: `escalated` (the target) or `reread`."""
    refusal: str | None = None
    """Why the escalation target refused the question: not an answer, so the question went on as
    if nothing could answer it (its cause's action, `escalate` meaning `answer`)."""
    error: str | None = None
    """The engine fault that sent this question down the escalated/fallback path."""
    escalation_error: str | None = None
    """The escalation's failure when the target did not answer a question that wanted it (cause
    `target_fault`): `EscalationError: ...` (it failed), or `BreakerOpen: ...` (its breaker was
    open, so it was not called)."""
    asked_if: dict[str, Any] | None = None
    """A dependent question's condition: `{question, answers, parent_answer}` (the parent's
    final answer; None when the parent was itself skipped)."""
    slot: int | None = None
    """Canvas position of the question's answer slot (its group slot, when read in two steps)."""
    read_entropies: list[float] = Field(default_factory=list)
    """Entropy (nats) of each read of the slot, in read order."""
    argmax_is_label: bool | None = None
    """Whether the first read's most likely token at the slot was one of the labels (None
    when constrained)."""
    latency_s: float = 0.0


# -- what a decision spent ----------------------------------------------------------------

Replay = Literal["decision_cache", "node_cache", "checkpoint"]
"""How a decision came back without being decided again: `decision_cache` (a `DecisionCache`
hit), `node_cache` (LangGraph's node cache replayed the node's records; graph records only) or
`checkpoint` (a review's resume got the decision its paused run checkpointed)."""

REPLAYS: tuple[str, ...] = get_args(Replay)


@dataclass(frozen=True, slots=True)
class Totals:
    """What decisions spent, summed without any SDK: decision sets decided, their questions,
    canvas reads, distinct canvases (prompts), escalated questions, target calls (hedges among
    them), tokens and seconds.

    One rule for every path: totals count what was spent where they are reported. A decision
    set decided now counts 1 decision, its questions, the reads and escalations it made, their
    tokens and its seconds. A replayed one (`CanvasResponse.replayed`: a `DecisionCache` hit, a
    review's resume, a `NodeCache` hit) decided nothing now and counts nothing: its totals are
    `Totals()`, and what it spent when it was decided stays readable as
    `CanvasResponse.original` (a record's `timing.original`). A failed attempt (an
    error the node raised, retried by a `RetryPolicy` or not) finished no decision set and
    counts nothing; its reads are on its `decide` span. Totals add up (`a + b`): a graph run's
    are the sum of its decision sets' (`canvasroute.harness.run_totals`).

    Example:
        ```python
        first = model.decide(ticket, questions)     # with CanvasDecisionModel(cache=DecisionCache())
        again = model.decide(ticket, questions)     # a hit: again.replayed == "decision_cache"
        again.totals.reads, again.original.reads    # 0, and what the first read cost
        ```
    """

    decisions: int = 0
    """Decision sets decided (a replay decided none)."""
    questions: int = 0
    """Their questions, skipped ones included."""
    reads: int = 0
    """Canvas reads sent to the engine (first reads, re-reads, in-group reads)."""
    canvases: int = 0
    """Distinct canvas prompts read (chunks over every stage)."""
    escalations: int = 0
    """Questions the escalation target answered."""
    input_tokens: int = 0
    output_tokens: int = 0
    target_calls: int = 0
    """Calls handed to the escalation target (`Diagnostics.target_calls`): hedges that were sent
    and a malformed reply's retry included."""
    hedges: int = 0
    """Hedges started beside re-reads (`Escalation.hedge`), and of them cancelled:"""
    hedges_cancelled: int = 0
    hedges_ran_on: int = 0
    """Cancelled hedges whose sync target's call ran on to its end in a thread
    (`Diagnostics.hedges_ran_on`)."""
    latency_s: float = 0.0
    """Seconds the decision sets took to decide (a replay's lookup is no decision: its
    response's own `latency_s` says how long it took)."""

    @classmethod
    def of(cls, response: CanvasResponse) -> Totals:
        """What one response spent: a decision set decided now, or a replay (nothing: `Totals()`)."""
        if response.replayed is not None:
            return cls()
        usage: Mapping[str, Any] = response.usage or {}
        diagnostics = response.diagnostics
        hedges = [h for h in diagnostics.hedges if h != "refused"] if diagnostics is not None else []
        return cls(decisions=1, questions=len(response.reads), reads=response.canvas_reads,
                   canvases=len(diagnostics.chunks) if diagnostics is not None and response.canvas_reads else 0,
                   escalations=sum(r.path == "escalated" for r in response.reads.values()),
                   input_tokens=int(usage.get("input_tokens", 0)), output_tokens=int(usage.get("output_tokens", 0)),
                   latency_s=response.latency_s, target_calls=diagnostics.target_calls if diagnostics else 0,
                   hedges=len(hedges), hedges_cancelled=hedges.count("cancelled"),
                   hedges_ran_on=diagnostics.hedges_ran_on if diagnostics else 0)

    def __add__(self, other: Totals) -> Totals:
        return Totals(*(a + b for a, b in zip(self.as_tuple(), other.as_tuple(), strict=True)))

    def as_tuple(self) -> tuple[Any, ...]:
        return (self.decisions, self.questions, self.reads, self.canvases, self.escalations, self.input_tokens,
                self.output_tokens, self.target_calls, self.hedges, self.hedges_cancelled, self.hedges_ran_on,
                self.latency_s)

    def as_dict(self) -> dict[str, Any]:
        """Plain JSON, the keys of the fields."""
        return dict(zip(_TOTALS_KEYS, self.as_tuple(), strict=True))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Totals:
        """The inverse of `as_dict` (missing keys count 0)."""
        return cls(*(type(v)(data.get(k, 0)) for k, v in zip(_TOTALS_KEYS, cls().as_tuple(), strict=True)))


_TOTALS_KEYS = ("decisions", "questions", "reads", "canvases", "escalations", "input_tokens", "output_tokens",
                "target_calls", "hedges", "hedges_cancelled", "hedges_ran_on", "latency_s")

NO_USAGE = {"input_tokens": 0, "output_tokens": 0, "total_tokens": 0}
"""What a replay spends (langchain-core records a response's usage on its run)."""


class CanvasResponse(ClassifierResponse):
    """A `ClassifierResponse` whose `reads` explain every answer.

    Example:
        ```python
        resp = model.invoke({"state": ticket, "questions": {"team": Choice(...)}})
        resp.answers["team"].choice, resp.reads["team"].normalized_entropy, resp.reads["team"].path
        ```
    """

    reads: dict[str, ReadReport] = Field(default_factory=dict)
    """One report per question, skipped ones included (`answers` has no skipped question)."""
    canvas_reads: int = 0
    """Canvas reads sent to the engine for this decision set (first reads + re-reads)."""
    latency_s: float = 0.0
    diagnostics: Diagnostics | None = None
    """How the decision was read: stages, canvases, formats, thoughts."""
    replayed: Replay | None = None
    """How this response came back without being decided in this call (`Replay`); None: decided
    now. A replay spent nothing: `canvas_reads` 0, no usage; its reports say how it was decided."""
    original: Totals | None = None
    """What the decision spent when it was decided (a replay's; None when decided now)."""

    @property
    def totals(self) -> Totals:
        """What this call spent (`Totals.of`): reads, canvases, escalations, tokens, seconds."""
        return Totals.of(self)

    def replay(self, how: Replay, latency_s: float) -> CanvasResponse:
        """This decision as replayed now (`how`, in `latency_s`): nothing read, nothing escalated,
        no usage, what it spent when decided kept as `original`; a copy of its own."""
        original = self.original if self.original is not None else Totals.of(self)
        return self.model_copy(update={"replayed": how, "original": original, "canvas_reads": 0,
                                       "usage": dict(NO_USAGE), "latency_s": latency_s}, deep=True)


# -- how a run's decisions ended ----------------------------------------------------------
# The demo's console, each decision event of a graph stream and the dashboard all count with
# `Tally`, so they cannot disagree: one count per path and per cause, and how many answers
# came from a read the gate did not pass ("over the gate": the read crossed one of the gate's
# thresholds, whether it then escalated, was re-read to no avail or stayed `unsure`), with the
# gate's own words (`GatePolicy.gate_text`).

_WORDS = {"reread": "re-read"}
_ALWAYS = ("canvas", "reread", "escalated")
"""Shown even when zero."""


@dataclass(frozen=True, slots=True)
class Tally:
    """Counts of decisions by path, and of those over the gate."""

    PATHS: ClassVar[tuple[str, ...]] = PATHS
    paths: Mapping[str, int]
    """Every path, zeros included."""
    over_gate: int = 0
    gates: tuple[str, ...] = ()
    """The gates the reads were held to (distinct, in first-seen order)."""
    causes: Mapping[str, int] = field(default_factory=lambda: dict.fromkeys(CAUSES, 0))
    """Answers the gate did not pass, by why (`Cause`), zeros included."""

    @classmethod
    def of(cls, decisions: Iterable[Any]) -> Tally:
        """Count `ReadReport`s, their JSON dumps, or anything with `path`, `cause`, `crossed` and `gate`."""
        paths = dict.fromkeys(PATHS, 0)
        causes = dict.fromkeys(CAUSES, 0)
        over, gates = 0, dict[str, None]()
        for d in decisions:
            get = d.get if isinstance(d, Mapping) else lambda k, d=d: getattr(d, k, None)
            path, cause, crossed, gate = get("path"), get("cause"), get("crossed"), get("gate")
            if path not in paths:
                raise ValueError(f"unknown decision path {path!r}; paths are {', '.join(PATHS)}")
            paths[path] += 1
            if cause is not None:
                if cause not in causes:
                    raise ValueError(f"unknown decision cause {cause!r}; causes are {', '.join(CAUSES)}")
                causes[cause] += 1
            over += bool(crossed)
            if gate:
                gates.setdefault(gate, None)
        return cls(paths, over, tuple(gates), causes)

    @property
    def decisions(self) -> int:
        return sum(self.paths.values())

    def __add__(self, other: Tally) -> Tally:
        return Tally({p: self.paths[p] + other.paths[p] for p in PATHS}, self.over_gate + other.over_gate,
                     tuple(dict.fromkeys((*self.gates, *other.gates))),
                     {c: self.causes.get(c, 0) + other.causes.get(c, 0) for c in CAUSES})

    def as_dict(self) -> dict[str, Any]:
        """Plain JSON: `{"decisions", "paths", "causes", "over_gate", "gates"}`."""
        return {"decisions": self.decisions, "paths": dict(self.paths), "causes": dict(self.causes),
                "over_gate": self.over_gate, "gates": list(self.gates)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Tally:
        """The inverse of `as_dict` (e.g. summing the tallies of a stream's decision events)."""
        return cls({p: int(data["paths"].get(p, 0)) for p in PATHS}, int(data["over_gate"]), tuple(data["gates"]),
                   {c: int((data.get("causes") or {}).get(c, 0)) for c in CAUSES})

    def shares(self) -> str:
        """`canvas 2/9 (22%), re-read 0/9 (0%), escalated 0/9 (0%), unsure 7/9 (78%)`: paths taken
        (canvas, re-read and escalated always; the rest when they occur)."""
        n = self.decisions
        return ", ".join(f"{_WORDS.get(p, p)} {k}/{n} ({k / max(1, n):.0%})" for p, k in self.paths.items()
                         if k or p in _ALWAYS)

    def gate_line(self) -> str:
        """`over the gate: 7/9 (the gate passes H/lnK <= 0.5)`."""
        gates = "; ".join(self.gates) or "no read was gated"
        return f"over the gate: {self.over_gate}/{self.decisions} (the gate passes {gates})"
