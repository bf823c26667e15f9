"""Human review in the ecosystem's shape: LangGraph's prebuilt `HumanInterrupt`, as Agent Inbox reads it.

With `ReviewPolicy(interrupt="human_interrupt")` the node interrupts with a list of one
`HumanInterrupt` (the TypedDict `langgraph.prebuilt.interrupt` ships):

```python
[{"action_request": {"action": "Review triage", "args": {"team": "billing"}},   # the model's answers
  "config": {"allow_accept": True, "allow_edit": True, "allow_respond": True, "allow_ignore": True},
  "description": "..."}]                                                         # questions, options, odds
```

and resumes with a `HumanResponse` (or a list holding one, as Agent Inbox sends it):

- `{"type": "accept"}`: the proposed answers, path `human`;
- `{"type": "edit", "args": {"action": ..., "args": {"team": "technical"}}}`: another option per
  question (questions left out keep the proposal), path `human`;
- `{"type": "response", "args": "technical"}`: a reply naming an option (one question under review);
- `{"type": "ignore"}`: no review: the model's answers stand with their own path.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from canvasroute.engine import DecisionError
from canvasroute.router import CanvasResponse

__all__ = ["human_interrupt", "human_response"]

ALLOW = {"allow_accept": True, "allow_edit": True, "allow_respond": True, "allow_ignore": True}


def human_interrupt(node: str, response: CanvasResponse, pending: Sequence[str],
                    options: Mapping[str, tuple[str, ...]], questions: Mapping[str, Any],
                    state: Any | None) -> list[dict[str, Any]]:
    """The interrupt value: one `HumanInterrupt` for the decision set's answers under review."""
    lines = [f"The decision node `{node}` is unsure. Accept its answers, edit them (pick another option), "
             "respond with an option, or ignore the review."]
    for qid in pending:
        report = response.reads[qid]
        odds = ", ".join(f"`{o}` {report.probabilities.get(o, 0.0):.0%}" for o in options[qid])
        instructions = getattr(questions[qid], "instructions", None) or qid
        lines.append(f"- **{qid}**: {instructions} Options: {odds}. Proposed: `{report.answer}` "
                     f"(path {report.path}).")
    if state is not None:
        lines.append(f"\nWhat was decided on:\n\n{state if isinstance(state, str) else repr(state)}")
    return [{
        "action_request": {"action": f"Review {node}", "args": {qid: response.reads[qid].answer for qid in pending}},
        "config": dict(ALLOW),
        "description": "\n".join(lines),
    }]


def human_response(value: Any, response: CanvasResponse, pending: Sequence[str],
                   options: Mapping[str, tuple[str, ...]]) -> dict[str, str]:
    """The human's option per reviewed question from a `HumanResponse` (empty: ignored)."""
    if isinstance(value, list | tuple) and len(value) == 1:
        value = value[0]  # Agent Inbox resumes with a list of one response
    kind = value.get("type") if isinstance(value, Mapping) else None
    proposed = {qid: str(response.reads[qid].answer) for qid in pending}
    if kind == "accept":
        return proposed
    if kind == "ignore":
        return {}
    if kind == "edit":
        request = value.get("args")
        edited = request.get("args") if isinstance(request, Mapping) else None
        if not isinstance(edited, Mapping):
            raise DecisionError("an edit resumes with {'type': 'edit', 'args': {'action': ..., "
                                "'args': {question_id: option}}}")
        unknown = sorted(set(edited) - set(pending))
        if unknown:
            raise DecisionError(f"the edit names questions not under review: {unknown}; under review: {list(pending)}")
        return {qid: _option(qid, edited.get(qid, proposed[qid]), options) for qid in pending}
    if kind == "response":
        if len(pending) != 1:
            raise DecisionError(f"{len(pending)} questions are under review ({list(pending)}); a text response "
                                "can answer only one", hint="resume with an edit naming an option per question")
        return {pending[0]: _option(pending[0], value.get("args"), options)}
    raise DecisionError(f"resume a human_interrupt review with a HumanResponse of type accept, edit, response or "
                        f"ignore, not {value!r}")


def _option(qid: str, value: Any, options: Mapping[str, tuple[str, ...]]) -> str:
    text = str(value).strip() if isinstance(value, str | int) and not isinstance(value, bool) else None
    by_name = {o.casefold(): o for o in options[qid]}
    if text is None or text.casefold() not in by_name:
        raise DecisionError(f"{value!r} is not an option of {qid!r}; options: {list(options[qid])}")
    return by_name[text.casefold()]
