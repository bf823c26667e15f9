"""Escalation: ask a larger model the questions the canvas was unsure about, in one call.

Targets: a chat model (`BaseChatModel`), any `Runnable` that takes messages (e.g. a
structured-output chain), or another `BaseDecisionModel`. A chat model is asked for its
structured output (`with_structured_output` over the answer schema of
`_escalation_prompt`: a JSON schema on OpenAI-compatible servers, guided decoding on
vLLM); one without it, and any Runnable, replies with a JSON object in text. The
messages come from the escalation prompt (`escalation_prompt=`, default
`ESCALATION_PROMPT`): the state, the questions with their options, the canvas
probabilities.

A call is sent once: the target's own client owns transport retries (`ChatOpenAI`'s
`max_retries`). Only a reply outside the allowed options is asked again, once, with the
invalid reply shown. A failure is an `EscalationError` whose `failure` says what failed:
`network`, `target` or `format`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

from langchain_core.decisions import BaseDecisionModel
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage

from canvasroute.engine.errors import CanvasRouteError, EngineUnavailable, EscalationError

from ._escalation_prompt import answer_schema, prompt_messages
from ._escalation_reply import Escalated, from_decision, from_reply, usage_of
from ._questions import QuestionSpec

__all__ = ["EscalationOutput", "Escalated", "escalate", "failure", "is_target", "target_name"]

EscalationOutput = Literal["auto", "json_schema", "function_calling", "json_mode", "text"]
"""How a chat-model target answers: `auto` (its own structured output, a JSON reply in text
when it has none), a `with_structured_output` method by name, or `text`."""

_HINTS = {
    "network": "check the escalation target's URL and that its server is up and answering in time",
    "target": "check the escalation target's model name, API key and quota",
    "format": "give the target structured output (escalation_output='auto' on a chat model that has it), "
              "or a clearer escalation_prompt",
}


def target_name(target: Any) -> str:
    """A readable model name for reports and spans."""
    for attr in ("model_name", "model", "model_id"):
        value = getattr(target, attr, None)
        if isinstance(value, str) and value:
            return value
    if callable(getattr(target, "get_name", None)):  # a Runnable: its name (default: its class)
        return str(target.get_name())
    return type(target).__name__


async def escalate(target: Any, state_text: str, state: Any, specs: Sequence[QuestionSpec],
                   canvas: Mapping[str, Mapping[str, float] | None], *, prompt: Any = None,
                   output: EscalationOutput = "auto") -> Escalated:
    """Answer `specs` with `target`, one call for all of them (and one more for a malformed reply)."""
    name = target_name(target)
    config = {"tags": ["nostream"]}
    if isinstance(target, BaseDecisionModel):
        request = {"state": state, "questions": {s.id: s.question for s in specs}}
        try:
            resp = await target.ainvoke(request, config=config)
        except Exception as exc:
            _reraise_control_flow(exc)
            raise failure(name, target, exc) from exc
        try:
            return from_decision(name, resp, specs)
        except ValueError as exc:
            raise _format_error(name, f"returned {exc}") from exc
    messages = await prompt_messages(prompt, state_text, specs, canvas)
    runner, structured = _runner(target, name, specs, output)
    usage = {"input_tokens": 0, "output_tokens": 0}
    cause: ValueError | None = None
    for _ in range(2):
        try:
            reply = await runner.ainvoke(messages, config=config)
        except Exception as exc:
            _reraise_control_flow(exc)
            raise failure(name, target, exc) from exc
        raw, parsed, error = _unpack(reply) if structured else (reply, None, None)
        for key, value in usage_of(raw).items():
            usage[key] += value
        try:
            if error is not None:
                raise ValueError(f"invalid structured output ({error})")
            result = from_reply(name, raw, specs, parsed)
        except ValueError as exc:
            cause = exc
            messages = [*messages, raw if isinstance(raw, BaseMessage) else AIMessage(str(raw)),
                        HumanMessage(f"That reply was invalid ({exc}). Reply with the JSON object only.")]
            continue
        result.usage = usage  # both attempts count
        return result
    assert cause is not None
    raise _format_error(name, f"answered outside the allowed options twice: {cause}") from cause


def _runner(target: Any, name: str, specs: Sequence[QuestionSpec], output: EscalationOutput) -> tuple[Any, bool]:
    """What to invoke: the target's structured output (`include_raw`: usage and logprobs
    stay readable), or the target itself."""
    if output == "text" or not isinstance(target, BaseChatModel):
        return target, False
    kwargs = {} if output == "auto" else {"method": output}
    try:
        return target.with_structured_output(answer_schema(specs), include_raw=True, **kwargs), True
    except NotImplementedError as exc:
        if output == "auto":
            return target, False  # no structured output: a JSON reply in text
        raise EscalationError(f"escalation to {name}: the target has no structured output for method "
                              f"{output!r} ({exc})", failure="target",
                              hint="use escalation_output='auto' or 'text'") from exc


def _unpack(reply: Any) -> tuple[Any, Any, Any]:
    """(raw message, parsed mapping, parsing error) of an `include_raw` structured reply."""
    if isinstance(reply, Mapping) and "raw" in reply:
        return reply["raw"], reply.get("parsed"), reply.get("parsing_error")
    return reply, None, None


def failure(name: str, target: Any, exc: BaseException) -> EscalationError:
    """The `EscalationError` for a target call that raised `exc`: network (unreachable, timed
    out) or target (it answered with an error), retryable when it may pass by itself."""
    if isinstance(exc, CanvasRouteError):  # a decision-model target's own typed fault
        kind = "network" if isinstance(exc, EngineUnavailable) else "target"
        retryable, attempts = exc.retryable, exc.attempts
    else:
        status = getattr(exc, "status_code", None)
        names = {c.__name__ for c in type(exc).__mro__}  # langchain-openai's OpenAIConnectionError is an APIConnectionError
        network = isinstance(exc, (ConnectionError, TimeoutError)) or bool(names & _NETWORK_NAMES)
        kind = "network" if network else "target"
        retryable = network or bool(names & _SHEDDING_NAMES) or status in (429, 503, 529)
        own = getattr(target, "max_retries", None)  # a client that retries itself owns its retries
        attempts = own + 1 if isinstance(own, int) and not isinstance(own, bool) and own > 0 else 1
    what = "could not be reached or timed out" if kind == "network" else "answered with an error"
    return EscalationError(f"escalation to {name} failed ({kind}: the target {what}): {exc!r}", failure=kind,
                           hint=_HINTS[kind], retryable=retryable, attempts=attempts)


def _format_error(name: str, what: str) -> EscalationError:
    return EscalationError(f"escalation to {name} {what} (format)", failure="format", hint=_HINTS["format"])


_NETWORK_NAMES = {"APIConnectionError", "APITimeoutError", "ConnectError", "ReadTimeout", "ConnectTimeout",
                  "RemoteProtocolError", "ReadError", "WriteError", "PoolTimeout"}
"""Transport errors of the OpenAI and httpx clients, named so neither has to be imported."""
_SHEDDING_NAMES = {"RateLimitError", "InternalServerError", "ServiceUnavailableError"}
"""A target that answered but shed load: it may pass by itself."""


def _reraise_control_flow(exc: Exception) -> None:
    """Let a graph's control flow through (LangGraph's `GraphBubbleUp`: an `interrupt()`
    inside an escalation target, e.g. a human reviewer), without importing LangGraph."""
    if any(cls.__name__ == "GraphBubbleUp" for cls in type(exc).__mro__):
        raise exc


def is_target(target: Any) -> bool:
    """Whether `target` can be escalated to."""
    return isinstance(target, (BaseChatModel, BaseDecisionModel)) or hasattr(target, "ainvoke")
