"""What a decision returns: langchain-core answers plus a read report per question."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from langchain_core.decisions import ChoiceAnswer, ClassifierResponse, NoulAnswer, ScoreAnswer
from pydantic import BaseModel, ConfigDict, Field

from ._diagnostics import Diagnostics

if TYPE_CHECKING:
    from ._questions import QuestionSpec

Path = Literal["canvas", "reread", "escalated", "fallback", "abstained", "unsure", "skipped"]
"""Where an answer came from. `canvas` and `reread`: the gate passed the canvas answer
(at the first read, or on the mean of its re-reads). `escalated`: the escalation model
answered. `fallback`: the declared fallback option, after an engine fault or past the
budget (`when_spent="fallback"`). `abstained`: the canvas chose "none of these / can't
tell" and the answer came from the escalation (`escalation_model` set), the fallback
option, or, past the budget under `when_spent="keep"`, the best real option. `unsure`: the
gate did not pass the canvas answer and nothing answered instead (no escalation target, or
past the budget under `when_spent="keep"`): the answer is what `GatePolicy.on_unsure` says
(the canvas answer by default, or the fallback option). `skipped`: a dependent question
whose condition did not hold; it has no answer."""


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
    over_budget: bool = False
    """Escalation was wanted but the budget was spent."""
    error: str | None = None
    """The engine fault that sent this question down the escalated/fallback path."""
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


def answer_of(spec: QuestionSpec, report: ReadReport) -> NoulAnswer | ChoiceAnswer | ScoreAnswer:
    """The langchain-core answer for one report (validated as one mapping, like the reports)."""
    probs = report.probabilities
    if spec.kind == "noul":
        return NoulAnswer.model_validate({"type": "noul", "noul": min(1.0, max(0.0, probs.get("yes", 0.0)))})
    confidence = min(1.0, max(0.0, probs.get(report.answer, 0.0)))
    if spec.kind == "choice":
        return ChoiceAnswer.model_validate({"type": "choice", "choice": report.answer, "probabilities": probs,
                                            "confidence": confidence})
    by_level = {int(k): v for k, v in probs.items()}
    return ScoreAnswer.model_validate({"type": "score", "score": sum(i * p for i, p in by_level.items()),
                                       "legend": dict(enumerate(spec.question.criteria)),
                                       "probabilities": by_level, "confidence": confidence})
