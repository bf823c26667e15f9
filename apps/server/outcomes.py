"""What the server does with a question its gate does not pass: the `OutcomePolicy` actions an HTTP answer can carry.

A served model's outcomes are checked once, when the app is built (`create_app`, and `canvasroute
serve` before it builds its engine), never per request: a request cannot be answered with an
action the wire has no shape for, and a client must not be blamed (422) for the server's setting.

| cause | served | refused at start |
|---|---|---|
| `uncertain` | `escalate` (no target: the canvas answer, path `unsure`), `answer` | `review`, `raise`, `fallback` |
| `abstained` | `escalate` (needs a target when the gate abstains), `answer` | `fallback` |
| `engine_fault` | `escalate` (no target: the fault's status, 502/503/504/529), `raise` | `fallback` |
| `over_budget` | `answer` (path `unsure`, cause `over_budget`), `raise` (429) | `fallback` |
| `target_fault` | `answer` (path `unsure`, cause `target_fault`), `raise` (502; 503: breaker open) | `fallback` |

Why: `review` sends a question to a human through a graph's `interrupt()`, and HTTP has no such
lane; `raise` for an uncertain question has no wire shape (`UnsureAnswer` would be a 500); a
`fallback` option is declared per question id, and a request's question ids are its client's
own, so every other request would be refused. `canvasroute serve`'s flags offer exactly the
served actions (`SERVED`).
"""

from __future__ import annotations

from canvasroute.router import GatePolicy, OutcomePolicy

__all__ = ["SERVED", "check_outcomes"]

SERVED: dict[str, tuple[str, ...]] = {
    "uncertain": ("escalate", "answer"),
    "abstained": ("escalate", "answer"),
    "engine_fault": ("escalate", "raise"),
    "over_budget": ("answer", "raise"),
    "target_fault": ("answer", "raise"),
}
"""The actions a served model may take, per `OutcomePolicy` field (the first is the default)."""

_WHY = {
    "review": "there is no human review lane over HTTP (review is a decision node's interrupt())",
    "raise": "an unsure answer has no wire shape (UnsureAnswer would answer 500)",
    "fallback": "fallback options are declared per question id, and a request's question ids are its client's own",
}


def check_outcomes(outcomes: OutcomePolicy, policy: GatePolicy, escalates: bool) -> None:
    """Refuse outcomes a server cannot honour (`SERVED`), naming the field.

    Args:
        outcomes: The model's `OutcomePolicy`.
        policy: The model's gate (an abstaining gate needs somewhere to go).
        escalates: Whether the model has an escalation target.

    Raises:
        ValueError: an action the wire cannot carry, or abstaining questions that would
            escalate with no target.
    """
    for name, served in SERVED.items():
        action = getattr(outcomes, name)
        if action not in served:
            flag = f" (canvasroute serve: --{_FLAGS[name]} {'|'.join(served)})" if name in _FLAGS else ""
            raise ValueError(f"OutcomePolicy.{name}={action!r} cannot be served over HTTP: {_WHY[action]}; "
                             f"a server takes {' or '.join(served)}{flag}")
    abstains = policy.abstain or any(p.abstain for p in policy.per_question.values())
    if abstains and outcomes.abstained == "escalate" and not escalates:
        raise ValueError("OutcomePolicy.abstained='escalate', but the gate abstains (GatePolicy.abstain) and there "
                         "is no escalation target: every abstaining request would be refused; set an escalation "
                         "target, or abstained='answer' (canvasroute serve: --on-abstain answer)")


_FLAGS = {"uncertain": "on-uncertain", "abstained": "on-abstain", "engine_fault": "on-engine-error",
          "target_fault": "on-target-fault"}
"""The `canvasroute serve` flag of each field (serve has no budget of its own: `over_budget` has none)."""
