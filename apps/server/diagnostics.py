"""The reply's `diagnostics` object: vLLM's gateway's keys, filled with what canvasroute knows.

vLLM's gateway requires `diagnostics` in every 200 (its `systemone-openapi.yaml`). Its keys
(`steps`, `stages`, `skipped`, `chunks`, `chunk_prompt`, `sequential`, `conditioning`,
`thought`, `samples`, `timing`, `prompt_tokens`, `questions`, `engine`) come from the
decision's `CanvasResponse.diagnostics` and read reports; canvasroute adds `constrained`,
`formats`, `canvas_reads`, `ignored` (request keys it did not read), `refused` (question id ->
why the escalation target refused it: that question's answer, when there is one, is the
canvas's, not vouched for), `escalation_errors` (question id -> why its escalation failed, the
target's error or its open breaker: that question's answer is the canvas's, cause
`target_fault`), and per question its `path`, `cause` (why the gate did not pass it:
`uncertain`, `abstained`, `engine_fault`, `over_budget`, `target_fault`; null when it passed),
`reads` and `gate`
(the gate it was held to, e.g. `H/lnK <= 0.43`: under an escalation-rate controller, the threshold
it set for this request).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from langchain_core.decisions import Score

from .parse import Parsed

__all__ = ["diagnostics"]


def diagnostics(resp: Any, parsed: Parsed, engine: str) -> dict[str, Any]:
    """The `diagnostics` object for one answered request."""
    reads: Mapping[str, Any] = getattr(resp, "reads", None) or {}
    diag = getattr(resp, "diagnostics", None)
    latency = getattr(resp, "latency_s", 0.0)
    refused = {qid: r.refusal for qid, r in reads.items() if r.refusal is not None}
    refused |= {qid: why for qid, why in (getattr(resp, "refusals", None) or {}).items() if qid in parsed.questions}
    failed = {qid: r.escalation_error for qid, r in reads.items() if getattr(r, "escalation_error", None)}
    out: dict[str, Any] = {"engine": engine, "timing": {"total_ms": latency * 1e3,
                                                        "reads": getattr(resp, "canvas_reads", 0)},
                           "questions": {}, "ignored": list(parsed.ignored), "refused": refused,
                           "escalation_errors": failed}
    if diag is None:  # a decision model other than a canvas model: only what any model tells
        return out
    answered = {qid: r for qid, r in reads.items() if r.path != "skipped"}
    thoughts = [{"tokens": t.tokens, "closed": t.closed, "ms": t.latency_s * 1e3, "text": t.text}
                for t in diag.thoughts]
    out.update({
        "steps": diag.steps,
        "stages": diag.stages,
        "skipped": {qid: _skipped(r.asked_if, parsed.questions) for qid, r in reads.items() if r.path == "skipped"},
        "chunks": diag.chunks,
        "chunk_prompt": "own",
        "sequential": False,
        "conditioning": diag.conditioning,
        "thought": (thoughts[0] if len(thoughts) == 1 else thoughts) or None,
        "samples": _samples(answered, parsed),
        "prompt_tokens": diag.prompt_tokens or None,
        "questions": {qid: {"pos": r.slot, "entropy": r.read_entropies, "label_mass": r.label_mass,
                            "argmax_is_label": r.argmax_is_label, "path": r.path, "cause": r.cause,
                            "reads": r.reads, "gate": r.gate}
                      for qid, r in answered.items()},
        "constrained": diag.constrained,
        "formats": diag.formats,
        "canvas_reads": getattr(resp, "canvas_reads", 0),
    })
    return out


def _samples(answered: Mapping[str, Any], parsed: Parsed) -> dict[str, Any]:
    policy = dict(parsed.extensions.samples or {"mode": "server"})
    if policy["mode"] != "fixed":
        policy["extended"] = any(len(r.read_entropies) > 1 for r in answered.values())  # re-read, sure or not
        policy["first_read_entropy"] = {qid: r.read_entropies[0] for qid, r in answered.items() if r.read_entropies}
    return {"n": max((r.reads for r in answered.values()), default=0), "policy": policy}


def _skipped(asked_if: Mapping[str, Any] | None, questions: Mapping[str, Any]) -> dict[str, Any]:
    """Why a question was skipped, in the wire's answer names (a Score level by its text)."""
    if not asked_if:
        return {}
    parent = questions.get(asked_if["question"])

    def shown(answer: Any) -> Any:
        if isinstance(parent, Score) and answer is not None:
            return parent.criteria[int(answer)]
        return answer

    return {"because": asked_if["question"], "was": shown(asked_if["parent_answer"]),
            "wanted": [shown(a) for a in asked_if["answers"]]}
