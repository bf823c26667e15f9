"""Escalation: ask a larger model the questions the canvas was unsure about, in one call.

Targets: a chat model (`BaseChatModel`), any `Runnable` that takes messages (e.g. a
structured-output chain), or another decision model (`BaseDecisionModel`). The target is
asked what the canvas read had (`Asked`): the state (its images included), the decision's
instructions, and for a dependent question its parents' answers.

A chat model is asked for its structured output (`with_structured_output` over
`answer_schema`: a JSON schema on OpenAI-compatible servers, guided decoding on vLLM); one
without it, and any Runnable, replies with a JSON object in text. The messages come from
the escalation prompt (`Escalation.prompt`, default `ESCALATION_PROMPT`), a langchain-core
`ChatPromptTemplate` over `{state}` (the rendered state), `{questions}` (one line per
question: instructions, options, the canvas probabilities as a hint), `{keys}` (the question
ids, quoted) and `{instructions}` (the decision's instructions; a prompt without that
variable gets them ahead of the state). Images go with the last human message as image parts.

Replies are read leniently but only into allowed options: an option by name (exactly,
else stripped, else case-folded when that names one option), by its description when that
is unambiguous, a bool for a Noul, an int for a Score level. A distribution comes from
OpenAI-shaped logprobs when the reply carries them, read per option along the reply's tokens
(`_logprob_distribution`: an option gets only the mass of a token path that spells it); a
decision-model target reports its own.

A call is sent once: the target's own client owns transport retries (`ChatOpenAI`'s
`max_retries`). Only a reply outside the allowed options is asked again, once, with the
invalid reply shown. A failure is an `EscalationError` whose `failure` says what failed:
`network`, `target` or `format`. `Calls` counts what went out: each call handed to the target
(a malformed reply's retry is a second; an escalation cancelled before its first call, none).

A sync target (`runs_in_thread`: langchain runs its sync code in a thread) cannot be cancelled
once its thread runs: a hedge's call to one runs in `SyncThreads` (bounded, process-wide), where
a call cancelled after it started is counted (`Calls.ran_on`) and runs to its end.
"""

from __future__ import annotations

import asyncio
import bisect
import contextvars
import functools
import itertools
import json
import math
import re
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal

from langchain_core.decisions import BaseDecisionModel, Choice, Noul, NoulAnswer, Score
from langchain_core.exceptions import ModelRefusalError
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, SystemMessage
from langchain_core.prompts import BasePromptTemplate, ChatPromptTemplate
from langchain_core.runnables import Runnable, RunnableLambda

from canvasroute.engine.errors import CanvasRouteError, EngineResponseError, EngineUnavailable, EscalationError

from ._policy import Escalation, EscalationOutput
from ._questions import QuestionSpec, option_text, parse_questions
from ._read import system_one_confidence
from ._state import state_images

__all__ = ["ESCALATION_PROMPT", "PROMPT_VARIABLES", "Asked", "Calls", "Escalated", "Restated", "SyncThreads",
           "TargetAnswer", "TargetReply", "answer_schema", "ask_decision_target", "check_prompt", "escalate", "failure",
           "is_decision_target", "is_target", "runs_in_thread", "target_name"]


@dataclass(frozen=True, slots=True)
class Restated:
    """A parent's final answer, restated to a question that depends on it."""

    question: str
    """The parent question, as text (its instructions)."""
    answer: str
    """Its answer, as text (yes/no, the option's name, the level's description)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Asked:
    """What one escalation asks: what the canvas read had, for the questions it hands on."""

    specs: tuple[QuestionSpec, ...]
    """The questions as the caller asked them (no abstain label)."""
    state: Any
    """The state as given (a decision-model target reads it)."""
    text: str
    """The state rendered as the canvas read it."""
    restated: str = ""
    """What the canvas read after the state at this stage: the parents' answers ("" for none)."""
    parents: Mapping[str, tuple[Restated, ...]] = field(default_factory=dict)
    """Per dependent question, its parents' answers (a decision target gets them per question)."""
    instructions: str = ""
    """The decision's instructions (`ReadOptions.instructions`)."""
    images: tuple[str, ...] = ()
    """Every image the canvas read saw."""
    canvas: Mapping[str, Mapping[str, float] | None] = field(default_factory=dict)
    """The canvas distribution per question, as a hint (None where the engine failed)."""

    @property
    def questions(self) -> dict[str, Noul | Choice | Score]:
        return {s.id: s.question for s in self.specs}

_HINTS = {
    "network": "check the escalation target's URL and that its server is up and answering in time",
    "target": "check the escalation target's model name, API key and quota",
    "raised": "the escalation target's own code raised: see the chained exception",
    "format": "give the target structured output (Escalation(output='auto') on a chat model that has it), "
              "or a clearer Escalation(prompt=...)",
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


def runs_in_thread(target: Any) -> bool:
    """Whether `target`'s async path is langchain's default, its sync code in a thread: a chat model
    without an `_agenerate` of its own, a decision model without `_aclassify`, a `RunnableLambda`
    over a plain function, a Runnable without `ainvoke`. Such a call cannot be cancelled once it runs."""
    if isinstance(target, BaseChatModel):
        return type(target)._agenerate is BaseChatModel._agenerate
    if isinstance(target, BaseDecisionModel):
        return type(target)._aclassify is BaseDecisionModel._aclassify
    if isinstance(target, RunnableLambda):
        return not hasattr(target, "afunc")
    return isinstance(target, Runnable) and type(target).ainvoke is Runnable.ainvoke


class SyncThreads:
    """Threads for a sync target's calls that may be cancelled (hedges), at most `size` at once.

    A sync target's call runs in a thread, which no cancellation stops: a call cancelled once it
    runs goes on to its end (its reply dropped) while the decision has moved on. Here such calls
    run in a pool of `size` threads; `busy` says when all are taken (calls still running, cancelled
    ones among them), so a burst of cancelled calls cannot pile up threads: the caller starts no
    more until one ends. A call cancelled before a thread took it never runs (nothing was sent).
    """

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"SyncThreads needs at least one thread, not {size}")
        self.size = size
        self._pool: ThreadPoolExecutor | None = None
        self._jobs = 0
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"SyncThreads(size={self.size}, running={self.running})"

    @property
    def running(self) -> int:
        """Calls submitted and not ended (running, or about to)."""
        return self._jobs

    def busy(self) -> bool:
        """Whether every thread is taken."""
        return self._jobs >= self.size

    async def run(self, calls: Calls, fn: Callable[[], Any]) -> Any:
        """`fn()` in one of the threads, counted in `calls` once a thread took it; cancelled before
        that, it never runs; after, it runs on (`calls.ran_on`) and this returns at once."""
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.size, thread_name_prefix="canvasroute-sync-call")
            self._jobs += 1
        job: Future[Any] = self._pool.submit(contextvars.copy_context().run, fn)
        job.add_done_callback(self._ended)
        try:
            return await asyncio.wrap_future(job)
        except asyncio.CancelledError:
            if not job.cancel() and not job.done():
                calls.ran_on = True  # it runs: no thread can be stopped, it ends by itself
            raise
        finally:
            calls.sent += not job.cancelled()

    def _ended(self, _: Future[Any]) -> None:
        with self._lock:
            self._jobs -= 1


@dataclass(slots=True)
class Calls:
    """The calls one escalation made to its target, counted as they go out."""

    threads: SyncThreads | None = None
    """Where a sync target's calls run (`runs_in_thread`; a hedge's: bounded, counted when they
    run on); None: through the target's own async path (`ainvoke`)."""
    sent: int = 0
    """Calls handed to the target: its `ainvoke` called, or its thread started (a malformed reply's
    retry is one more; none when the escalation was cancelled before its first call)."""
    ran_on: bool = False
    """A call was cancelled while a sync target's thread ran it: it runs on to its end."""

    async def send(self, target: Any, runnable: Any, value: Any, config: Any) -> Any:
        """One call of `runnable` (the target, or its structured output) on `value`."""
        if self.threads is not None and runs_in_thread(target):
            return await self.threads.run(self, functools.partial(runnable.invoke, value, config=config))
        self.sent += 1
        return await runnable.ainvoke(value, config=config)


async def escalate(escalation: Escalation, asked: Asked, calls: Calls | None = None) -> Escalated:
    """Answer `asked.specs` with `escalation.target`, one call for all of them (and one more
    for a malformed reply), each counted in `calls` as it goes out."""
    target, specs = escalation.target, list(asked.specs)
    calls = calls if calls is not None else Calls()
    name = target_name(target)
    config: Any = {"tags": ["nostream"]}
    if is_decision_target(target):
        reply = await ask_decision_target(target, asked, calls)
        return Escalated(reply.model, {q: a.answer for q, a in reply.answers.items() if a.answer is not None},
                         {q: dict(a.probabilities) if a.probabilities else None for q, a in reply.answers.items()},
                         dict(reply.usage), reply.model,
                         confidence={q: a.confidence for q, a in reply.answers.items() if a.confidence is not None},
                         refused={q: a.refusal or "refused" for q, a in reply.answers.items() if a.answer is None})
    messages = await prompt_messages(escalation.prompt, asked)
    runner, structured = _runner(target, name, specs, escalation.output)
    usage = {"input_tokens": 0, "output_tokens": 0}
    cause: ValueError | None = None
    for _ in range(2):
        try:
            reply = await calls.send(target, runner, messages, config)
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
                              hint="use Escalation(output='auto') or Escalation(output='text')") from exc


def _unpack(reply: Any) -> tuple[Any, Any, Any]:
    """(raw message, parsed mapping, parsing error) of an `include_raw` structured reply."""
    if isinstance(reply, Mapping) and "raw" in reply:
        return reply["raw"], reply.get("parsed"), reply.get("parsing_error")
    return reply, None, None


def failure(name: str, target: Any, exc: BaseException) -> EscalationError:
    """The `EscalationError` for a target call that raised `exc`: network (unreachable, timed
    out) or target (it answered with an error, or its own code raised), retryable when it may
    pass by itself."""
    hint_kind = "target"
    if isinstance(exc, CanvasRouteError):  # a decision-model target's own typed fault
        kind = "network" if isinstance(exc, EngineUnavailable) else "target"
        retryable, attempts = exc.retryable, exc.attempts
    else:
        status = getattr(exc, "status_code", None)
        # langchain-openai's OpenAIConnectionError is an APIConnectionError
        names = {c.__name__ for c in type(exc).__mro__}
        network = isinstance(exc, (ConnectionError, TimeoutError)) or bool(names & _NETWORK_NAMES)
        kind = "network" if network else "target"
        answered = status is not None or getattr(exc, "response", None) is not None or bool(names & _API_NAMES)
        hint_kind = kind if network or answered else "raised"
        retryable = network or bool(names & _SHEDDING_NAMES) or status in (429, 503, 529)
        own = getattr(target, "max_retries", None)  # a client that retries itself owns its retries
        attempts = own + 1 if isinstance(own, int) and not isinstance(own, bool) and own > 0 else 1
    what = ("could not be reached or timed out" if kind == "network" else "answered with an error"
            if hint_kind == "target" else f"raised {type(exc).__name__}")
    failed: Literal["network", "target"] = "network" if kind == "network" else "target"
    return EscalationError(f"escalation to {name} failed ({kind}: the target {what}): {exc!r}", failure=failed,
                           hint=_HINTS[hint_kind if kind == "target" else kind], retryable=retryable,
                           attempts=attempts)


def _format_error(name: str, what: str) -> EscalationError:
    return EscalationError(f"escalation to {name} {what} (format)", failure="format", hint=_HINTS["format"])


_NETWORK_NAMES = {"APIConnectionError", "APITimeoutError", "ConnectError", "ReadTimeout", "ConnectTimeout",
                  "RemoteProtocolError", "ReadError", "WriteError", "PoolTimeout"}
"""Transport errors of the OpenAI and httpx clients, named so neither has to be imported."""
_SHEDDING_NAMES = {"RateLimitError", "InternalServerError", "ServiceUnavailableError"}
_API_NAMES = {"APIError", "APIStatusError", "HTTPStatusError", "BadRequestError", "AuthenticationError",
              "PermissionDeniedError", "NotFoundError", "UnprocessableEntityError"}
"""A target that answered but shed load: it may pass by itself."""


def _reraise_control_flow(exc: Exception) -> None:
    """Let a graph's control flow through (LangGraph's `GraphBubbleUp`: an `interrupt()`
    inside an escalation target, e.g. a human reviewer), without importing LangGraph."""
    if any(cls.__name__ == "GraphBubbleUp" for cls in type(exc).__mro__):
        raise exc


def is_target(target: Any) -> bool:
    """Whether `target` can be escalated to."""
    return isinstance(target, (BaseChatModel, BaseDecisionModel)) or hasattr(target, "ainvoke")


# -- the prompt and the answer schema -----------------------------------------------------

PROMPT_VARIABLES = frozenset({"state", "questions", "keys", "instructions"})
"""The variables an escalation prompt may use."""

INSTRUCTIONS = ("You answer classification questions about an input. For each question choose exactly one "
                "of its allowed options. A fast model's probabilities are given as a hint; they may be wrong. "
                "Reply with only a JSON object that maps each question id to one allowed option.")
REQUEST = "{instructions}Input:\n{state}\n\n{questions}\n\nJSON with the keys {keys}:"


def question_lines(specs: Sequence[QuestionSpec], canvas: Mapping[str, Mapping[str, float] | None]) -> str:
    """One compact line per question (options, canvas hint): small models stay on track."""
    lines = []
    for spec in specs:
        options = ", ".join(f'"{o}"' + (f" ({d})" if d else "")
                            for o, d in zip(spec.options, spec.descriptions, strict=True))
        line = f'Question "{spec.id}": {option_text(spec.question.instructions)} Options: {options}.'
        if hint := canvas.get(spec.id):
            line += " Fast model's probabilities: " + json.dumps({k: round(v, 3) for k, v in hint.items()})
        lines.append(line)
    return "\n".join(lines)


def variables(asked: Asked) -> dict[str, str]:
    """The prompt's variables for one escalation."""
    return {"state": asked.text + asked.restated, "questions": question_lines(asked.specs, asked.canvas),
            "keys": ", ".join(f'"{s.id}"' for s in asked.specs),
            "instructions": f"Context for every question: {asked.instructions}\n\n" if asked.instructions else ""}


def _example() -> tuple[HumanMessage, AIMessage]:
    """A one-shot example of the reply format (small models need it; large ones don't mind)."""
    specs = parse_questions({"weather": {"type": "choice", "instructions": "What is the weather like?",
                                         "criteria": {"sunny": None, "rainy": None}},
                             "cold": {"type": "noul", "instructions": "Is it cold?"}})
    hint = {"weather": {"sunny": 0.6, "rainy": 0.4}, "cold": {"yes": 0.3, "no": 0.7}}
    asked = Asked(specs=tuple(specs.values()), state=None, text="It is a bright, sunny day in July.", canvas=hint)
    return HumanMessage(REQUEST.format(**variables(asked))), AIMessage('{"weather": "sunny", "cold": "no"}')


ESCALATION_PROMPT = ChatPromptTemplate.from_messages([SystemMessage(INSTRUCTIONS), *_example(), ("human", REQUEST)])
"""The default escalation prompt: instructions, a one-shot example, the request."""


def check_prompt(prompt: Any) -> Any:
    """`prompt` if it is a prompt template over `PROMPT_VARIABLES` only (or None)."""
    if prompt is None:
        return None
    if not isinstance(prompt, BasePromptTemplate):
        raise ValueError(f"escalation prompt must be a langchain-core ChatPromptTemplate, not {type(prompt).__name__}")
    unknown = sorted(set(prompt.input_variables) - PROMPT_VARIABLES)
    if unknown:
        raise ValueError(f"escalation prompt uses unknown variables {unknown}; it may use {sorted(PROMPT_VARIABLES)}")
    return prompt


async def prompt_messages(prompt: Any, asked: Asked) -> list[BaseMessage]:
    """The escalation's messages: `prompt` (default `ESCALATION_PROMPT`) filled in, the
    instructions ahead of the state where the prompt has no place for them, and the images
    with the last human message."""
    template = prompt or ESCALATION_PROMPT
    values = variables(asked)
    if "instructions" not in template.input_variables and values["instructions"]:
        values["state"] = values["instructions"] + values["state"]
    filled = (await template.ainvoke({k: values[k] for k in template.input_variables})).to_messages()
    if asked.images:
        last = max((i for i, m in enumerate(filled) if isinstance(m, HumanMessage)), default=None)
        if last is None:
            filled.append(HumanMessage(content=[]))
            last = len(filled) - 1
        message = filled[last]
        text = message.content if isinstance(message.content, list) else [{"type": "text", "text": message.content}]
        images = [{"type": "image_url", "image_url": {"url": url}} for url in asked.images]
        filled[last] = HumanMessage(content=[*text, *images])
    return filled


def answer_schema(specs: Sequence[QuestionSpec]) -> dict[str, Any]:
    """The JSON schema of a reply: `{question id: one of its options}`, every id required."""
    return {
        "title": "answers",
        "description": "One allowed option per question id.",
        "type": "object",
        "properties": {s.id: {"type": "string", "enum": list(s.options),
                              "description": option_text(s.question.instructions)} for s in specs},
        "required": [s.id for s in specs],
        "additionalProperties": False,
    }


# -- the reply ---------------------------------------------------------------------------

@dataclass(slots=True)
class Escalated:
    """The escalation's answers: option and (if the target reported one) distribution."""

    model: str
    answers: dict[str, str]
    """Per question the target answered, its option (a refused question has none)."""
    probabilities: dict[str, dict[str, float] | None]
    """The target's own distribution per question, when it reports one (decision targets,
    logprobs of a chat reply); None: only the option is known."""
    usage: dict[str, int] = field(default_factory=dict)
    response_model: str | None = None
    """The model that answered, as the target's reply names it (None when it does not)."""
    confidence: dict[str, float] = field(default_factory=dict)
    """The target's confidence per question, when it reports one (decision targets)."""
    refused: dict[str, str] = field(default_factory=dict)
    """Questions the target refused, with its reason: not answers."""


def usage_of(reply: Any) -> dict[str, int]:
    """Token usage a chat reply reports (empty when it reports none)."""
    if isinstance(reply, AIMessage) and reply.usage_metadata:
        return {"input_tokens": int(reply.usage_metadata.get("input_tokens", 0)),
                "output_tokens": int(reply.usage_metadata.get("output_tokens", 0))}
    return {}


def from_reply(name: str, reply: Any, specs: Sequence[QuestionSpec], parsed: Any = None) -> Escalated:
    """Validate a chat/runnable reply (or, with structured output, its `parsed` mapping beside
    the raw message) and read a distribution from logprobs if present."""
    usage = usage_of(reply)
    logprobs, served = None, None
    if isinstance(reply, BaseMessage):
        text: str = reply.text if isinstance(reply.text, str) else reply.text()
        metadata = reply.response_metadata or {}
        logprobs, served = metadata.get("logprobs"), metadata.get("model_name") or metadata.get("model")
        data: Any = parsed if parsed is not None else _parse_json(text)
    elif isinstance(reply, Mapping):
        data, text = dict(reply), ""
    elif hasattr(reply, "model_dump"):
        data, text = reply.model_dump(), ""
    else:
        text = str(reply)
        data = _parse_json(text)
    answers: dict[str, str] = {}
    by_description: dict[str, bool] = {}  # answered by an option's description, not its name
    for spec in specs:
        value = data.get(spec.id) if isinstance(data, Mapping) else None
        option = _match(spec, value)
        if option is None:
            raise ValueError(f"{spec.id!r}: {value!r} is not one of {list(spec.options)}")
        answers[spec.id] = option
        by_description[spec.id] = isinstance(value, str) and value.strip().casefold() != option.casefold()
    tokens = _Tokens.of(logprobs) if logprobs else None
    probs = {s.id: _logprob_distribution(tokens, s, by_description[s.id]) if tokens else None for s in specs}
    for qid, dist in probs.items():  # a distribution that disagrees with the answer was mis-mapped
        if dist and max(dist, key=dist.__getitem__) != answers[qid]:
            probs[qid] = None
    return Escalated(name, answers, probs, usage, served if isinstance(served, str) and served else None)


def _parse_json(text: str) -> Any:
    """The first JSON object in `text` (prose or code fences around it are ignored)."""
    decoder = json.JSONDecoder()
    start, error = (text or "").find("{"), "no JSON object"
    while start != -1:
        try:
            value, _ = decoder.raw_decode(text, start)
        except json.JSONDecodeError as exc:
            error = f"invalid JSON ({exc.msg})"
        else:
            if isinstance(value, dict):
                return value
        start = text.find("{", start + 1)
    raise ValueError(f"{error} in {(text or '')[:120]!r}")


def _match(spec: QuestionSpec, value: Any) -> str | None:
    """The option a reply value names: its name (exactly, else stripped, else case-folded if
    that names one option), or (if unambiguous) its description."""
    if isinstance(value, bool) and spec.kind == "noul":
        return "yes" if value else "no"
    if isinstance(value, int) and not isinstance(value, bool) and spec.kind == "score":
        value = str(value)
    if not isinstance(value, str):
        return None
    if value in spec.options:
        return value
    stripped = {o.strip(): o for o in spec.options}
    if value.strip() in stripped:
        return stripped[value.strip()]
    key = value.strip().casefold()
    folded = [o for o in spec.options if o.strip().casefold() == key]
    if len(folded) == 1:
        return folded[0]
    described = [o for o, d in zip(spec.options, spec.descriptions, strict=True) if d and d.casefold() == key]
    return described[0] if len(described) == 1 else None


@dataclass(frozen=True, slots=True)
class _Tokens:
    """A reply's OpenAI-shaped logprobs, checked once for all its questions, as bytes.

    A token is read as its `bytes` where the logprobs give them (OpenAI's token for part of a
    character is `bytes:\\xc3`, its bytes the part; vLLM gives a character's earlier tokens as ""
    and its last token whole), else as its text in UTF-8: what the tokens spell is the reply's
    bytes, whatever characters they split."""

    entries: tuple[Mapping[str, Any], ...]
    """One per token: `token`, `logprob`, `top_logprobs` (and `bytes`)."""
    spelled: tuple[bytes, ...]
    """Each token's bytes."""
    text: bytes
    """The tokens' bytes: the reply (UTF-8) as the logprobs spell it."""
    ends: tuple[int, ...]
    """Where each token ends in `text`."""

    @classmethod
    def of(cls, logprobs: Any) -> _Tokens | None:
        """The logprobs' tokens (None when they are not OpenAI's shape)."""
        content = logprobs.get("content") if isinstance(logprobs, Mapping) else logprobs
        if not isinstance(content, Sequence) or not content:
            return None
        entries = tuple(content)
        if not all(isinstance(e, dict) and isinstance(e.get("token"), str) for e in entries):
            return None
        spelled = tuple(_token_bytes(e) for e in entries)
        return cls(entries, spelled, b"".join(spelled), tuple(itertools.accumulate(map(len, spelled))))


def _token_bytes(entry: Mapping[str, Any]) -> bytes:
    """A token's (or an alternative's) bytes: its `bytes` where given and well formed, else its text."""
    given = entry.get("bytes")
    if isinstance(given, list) and all(isinstance(b, int) and not isinstance(b, bool) and 0 <= b < 256
                                       for b in given):
        return bytes(given)
    token = entry.get("token")
    return token.encode("utf-8", "surrogatepass") if isinstance(token, str) else b""


_KEY = re.compile(rb'"((?:[^"\\]|\\.)*)"\s*:\s*("?)', re.DOTALL)
"""A JSON object key, its colon and (for a string value) the value's opening quote."""


def _value_start(text: bytes, qid: str) -> re.Match[bytes] | None:
    """Where `qid`'s value starts in a reply: after the first key that says `qid` in JSON (written
    as it is, or with escapes: `"cat\\u00e9gorie"` is `catégorie`)."""
    plain = json.dumps(qid, ensure_ascii=False).encode()
    for m in _KEY.finditer(text):
        key = m.group(1)
        if b'"' + key + b'"' == plain or (b"\\" in key and _json_string(key) == qid):
            return m
    return None


def _json_string(body: bytes, *, partial: bool = False) -> str | None:
    """What a JSON string's body (the bytes between its quotes) says (None: not JSON). `partial`:
    the body as far as it goes, a character or escape it cuts short left out."""
    if partial:
        body = _CUT_ESCAPE.sub(rb"\1", body)
    try:
        value: str = json.loads(b'"' + body + b'"' if not partial else
                                b'"' + body.decode("utf-8", "ignore").encode() + b'"', strict=False)
    except ValueError:
        return None
    if partial and value and "\ud800" <= value[-1] <= "\udbff":  # half of a surrogate pair
        value = value[:-1]
    return value


_CUT_ESCAPE = re.compile(rb"(?<!\\)((?:\\\\)*)\\(?:u[0-9a-fA-F]{0,3})?$")
"""An escape a partial string body ends in the middle of (`\\`, `\\u00`), after any whole `\\\\`."""


def _logprob_distribution(tokens: _Tokens, spec: QuestionSpec, by_description: bool = False) -> dict[str, float] | None:
    """The target's distribution over `spec`'s options, read exactly from OpenAI-shaped logprobs.

    The reply's tokens (their bytes are the reply) are walked from where the question's value
    starts (after `"<id>":` and, for a string, its opening quote). At each token, every
    alternative the target weighed leaves the reply there, with the probability of the chosen
    tokens so far times its own; the chosen tokens go on, up to the token that ends the value.
    A path counts for an option only when the text it spells names that one option: it spells
    the option whole and ends it (the closing quote; for a bare `true` or `10`, a delimiter),
    or it begins the option where no other option continues it (`crit` of `critical`; never `1`
    while `10` is an option, or `opt` among `opt0`..`opt79`). Options are spelled by name (by
    description when the reply named its answer by description), case-folded when that keeps
    them apart, as the reply is read. Text is what the JSON says: escapes (`\\u00e7`) and
    characters split across tokens (read as bytes, `_Tokens`) spell what they stand for, and a
    question id is found the same way.

    Normalized over the mass that names an option: the result is the target's distribution
    given that it names one, as far as its logprobs show. Mass that names no single option (a
    prefix several options share, text that is no option, structure instead of a value, an
    alternative outside the reply's `top_logprobs`, one whose bytes are not given) is left out,
    never given to an option: an option no path spells gets 0. None when the value is not in the
    logprobs or nothing in them names an option.
    """
    text = tokens.text
    m = _value_start(text, spec.id)
    if m is None:
        return None
    names = _Spelled.of(spec, by_description, quoted=bool(m.group(2)))
    start, path = m.end(), 0.0
    mass = dict.fromkeys(spec.options, 0.0)
    first = bisect.bisect_right(tokens.ends, start)  # the first token that reaches past the value's start
    value = text[start:]
    for i in range(first, len(tokens.entries)):
        entry, token, offset = tokens.entries[i], tokens.spelled[i], tokens.ends[i - 1] if i else 0
        lead, prefix = text[offset:start], text[start:offset]
        for alt in entry.get("top_logprobs") or ():
            other = _token_bytes(alt) if isinstance(alt, dict) else b""
            if other and other != token and other.startswith(lead):
                option = names.named(prefix + other[len(lead):])
                if option is not None:
                    mass[option] += math.exp(path + _logprob(alt.get("logprob"), -math.inf))
        path += _logprob(entry.get("logprob"), 0.0)
        if names.ended(prefix + token[len(lead):]) is not None:  # the chosen path ends the value here
            value = prefix + token[len(lead):]
            break
    option = names.named(value)
    if option is not None:
        mass[option] += math.exp(path)
    total = sum(mass.values())
    return {o: p / total for o, p in mass.items()} if total > 0 and math.isfinite(total) else None


def _logprob(value: Any, missing: float) -> float:
    """A reported logprob (NaN for one that is not a number: the distribution is then unreadable)."""
    if value is None:
        return missing
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan


_BARE_END = frozenset(b",}] \t\r\n")
"""What ends a bare JSON value (a number, `true`, `false`)."""


@dataclass(frozen=True, slots=True)
class _Spelled:
    """How a reply's text spells one question's options (`_logprob_distribution`)."""

    spellings: tuple[tuple[str, str], ...]
    """(text as the reply's JSON says it, normalized; option) pairs."""
    quoted: bool
    """Whether the value is a JSON string (else a bare literal)."""
    fold: bool
    """Whether spellings are case-folded (when that keeps them apart)."""

    @classmethod
    def of(cls, spec: QuestionSpec, by_description: bool, *, quoted: bool) -> _Spelled:
        return _spelled(spec.kind, spec.options, spec.descriptions, by_description, quoted)

    @classmethod
    def build(cls, kind: str, options: tuple[str, ...], descriptions: tuple[str, ...], by_description: bool,
              quoted: bool) -> _Spelled:
        if quoted:
            pairs = [(d if by_description else o, o) for o, d in zip(options, descriptions, strict=True)]
            texts = [(s.strip(), o) for s, o in pairs if s]
        elif kind == "noul" and not by_description:
            texts = [("true", "yes"), ("false", "no")]
        elif kind == "score" and not by_description:
            texts = [(o, o) for o in options]
        else:
            texts = []
        distinct = {s for s, _ in texts}
        fold = len({s.casefold() for s in distinct}) == len(distinct)
        return cls(tuple((s.casefold() if fold else s, o) for s, o in texts), quoted, fold)

    def ended(self, value: bytes) -> int | None:
        """Where `value` (the bytes from the value's start) ends the value; None: it goes on."""
        if not self.quoted:
            return next((i for i, c in enumerate(value) if c in _BARE_END), None)
        i = value.find(b'"')
        while i > 0 and (i - len(value[:i].rstrip(b"\\"))) % 2:  # an escaped quote goes on
            i = value.find(b'"', i + 1)
        return i if i >= 0 else None

    def named(self, value: bytes) -> str | None:
        """The one option the bytes `value` name: whole and ended, or begun where no other continues."""
        end = self.ended(value)
        body = value[:end] if end is not None else value
        said = _json_string(body, partial=end is None) if self.quoted else body.decode("utf-8", "ignore")
        if said is None:
            return None
        text = said.strip() if end is not None else said.lstrip()
        text = text.casefold() if self.fold else text
        if end is not None:
            hits = {o for s, o in self.spellings if s == text}
        else:
            hits = {o for s, o in self.spellings if s.startswith(text)}
        return hits.pop() if len(hits) == 1 else None


_spelled = functools.lru_cache(maxsize=256)(_Spelled.build)
"""`_Spelled.build`, once per question shape (a reply's questions are read together, and again)."""


# -- decision-model targets (OpenAIDecisions, BaseDecisionModel) ---------------------------
#
# Targets: langchain-openai's `OpenAIDecisions` (the OpenAI Decisions wire, `/v1/decisions`) and
# any langchain-core `BaseDecisionModel` (canvasroute's `SystemOneDecisionModel` on `/v1/systemone`
# among them). One call asks every question; each comes back as the target answered it: the
# option, the target's own distribution over the options (kept, never re-derived from the
# option), its confidence, or a refusal, which is not an answer: an OpenAI Decisions `refusal`
# answer, a `BaseDecisionModel`'s `ModelRefusalError` (every question), or a question its response
# names in `refusals` ({id: reason}; `SystemOneResponse`: what a canvasroute server's own target refused).
#
# What the target is asked (`DecisionAsk`): the questions in the target's own types (`Noul` ->
# `Predicate`, `Choice` -> `Choice`, `Score` -> `Score` for `OpenAIDecisions`; langchain-core's
# questions as they are for a `BaseDecisionModel`), each question's instructions headed by the
# decision's instructions and followed by its parents' answers ("Earlier answers about this
# input"), as the canvas read them. The state: a `BaseDecisionModel` gets the state value (it
# renders and reads it itself, images included); `OpenAIDecisions` gets the text the canvas read,
# with the images beside it in one user message (its client would send any other conversation as
# JSON text).
#
# `OpenAIDecisions` is a Runnable over `{"input", "questions"}` with its own question types, not a
# `BaseDecisionModel`: the chat path (`_escalation.escalate`) invokes it with a list of chat messages,
# and its `_payload` reads `request["input"]` from that list, raising `TypeError('list indices must
# be integers or slices, not str')` before any request is sent, which `failure` then reports as
# "the target answered with an error". Here it gets the request it takes.
#
# Failures are `EscalationError`s (`_escalation.failure` classifies the exception: `network` or
# `target`), except an answer outside the wire, which is `format`: a response the target's client
# could not read (`APIResponseValidationError`, `EngineResponseError`), a missing answer, an
# answer of another type, an option that was not offered.

_FORMAT_HINT = ("the decision target answered outside the wire: check that it answers every question with its "
                "own type and one of the options it was given")
_OPENAI_RETRIES = 2
"""The `openai` SDK's own retries when `OpenAIDecisions(max_retries=None)` (`openai.DEFAULT_MAX_RETRIES`)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TargetAnswer:
    """One question as the target answered it."""

    answer: str | None
    """The option (`yes`/`no`, a Choice's key, a Score level `0`..`n-1`); None when refused."""
    probabilities: Mapping[str, float] | None = None
    """The target's distribution over the question's options, as it reported it."""
    confidence: float | None = None
    """The target's confidence (a predicate's or a noul's, which the target does not report: System
    One's over p and 1 - p, `system_one_confidence`: `|2p - 1|`)."""
    refusal: str | None = None
    """Why the target did not answer (a refusal is not an answer)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TargetReply:
    """A decision target's reply to one `Asked`."""

    model: str
    """The model that answered, as the target names it."""
    answers: Mapping[str, TargetAnswer]
    """Per question id, in the order asked."""
    usage: Mapping[str, int] = field(default_factory=dict)
    """`input_tokens`, `output_tokens` (0 when not reported)."""
    request_id: str | None = None
    """The target's request id, when it reports one."""


def is_decision_target(target: Any) -> bool:
    """Whether `target` is asked as a decision model (`OpenAIDecisions` or a `BaseDecisionModel`)."""
    return isinstance(target, BaseDecisionModel) or _is_openai_decisions(target)


async def ask_decision_target(target: Any, ask: Asked, calls: Calls | None = None) -> TargetReply:
    """Ask `target` every question of `ask` in one call (counted in `calls` as it goes out).

    Raises:
        EscalationError: `failure` `network` (unreachable, timed out), `target` (it answered
            with an error, or cannot take the request) or `format` (an answer outside the wire).

    Example:
        ```python
        reply = await ask_decision_target(OpenAIDecisions(model="gpt-6-luna"), Asked(
            specs=tuple(parse_questions({"urgent": Noul(instructions="Urgent?")}).values()), state=ticket, text=ticket))
        reply.answers["urgent"].probabilities  # {"yes": 0.91, "no": 0.09}
        ```
    """
    name = target_name(target)
    questions = ask.questions
    options = {qid: _options(q) for qid, q in questions.items()}
    if _is_openai_decisions(target):
        request = _openai_request(ask, name)
    elif isinstance(target, BaseDecisionModel):
        restated = {qid: _restated(qid, q, ask) for qid, q in questions.items()}
        request = {"state": _decision_state(ask), "questions": restated}
    else:
        raise TypeError(f"{name} is not a decision model (OpenAIDecisions or a BaseDecisionModel)")
    try:
        response = await (calls or Calls()).send(target, target, request, {"tags": ["nostream"]})
    except ModelRefusalError as exc:  # a BaseDecisionModel's refusal: every question refused, none answered
        return TargetReply(model=name, answers={qid: TargetAnswer(answer=None, refusal=str(exc) or "refused")
                                                for qid in questions})
    except Exception as exc:
        _reraise_control_flow(exc)
        raise _classified(name, target, exc) from exc
    named = getattr(response, "refusals", None) if isinstance(target, BaseDecisionModel) else None
    refused = {q: why for q, why in named.items() if isinstance(why, str)} if isinstance(named, Mapping) else {}
    try:
        answers = {qid: TargetAnswer(answer=None, refusal=str(refused[qid]) or "refused") if qid in refused
                   else _read(qid, q, getattr(response, "answers", {}).get(qid), options[qid])
                   for qid, q in questions.items()}
    except ValueError as exc:
        raise EscalationError(f"escalation to {name} answered outside the wire (format): {exc}", failure="format",
                              hint=_FORMAT_HINT) from exc
    usage = getattr(response, "usage", None)
    counts = {k: int(_usage_value(usage, k) or 0) for k in ("input_tokens", "output_tokens")}
    model = getattr(response, "model", None)
    return TargetReply(model=model if isinstance(model, str) and model else name, answers=answers, usage=counts,
                       request_id=getattr(response, "request_id", None))


# -- asking ------------------------------------------------------------------------------------


def _options(q: Noul | Choice | Score) -> tuple[str, ...]:
    if isinstance(q, Noul):
        return ("yes", "no")
    if isinstance(q, Choice):
        return tuple(q.criteria)
    return tuple(str(n) for n in range(len(q.criteria)))


def _text(q: Noul | Choice | Score, ask: Asked, qid: str, *, criteria: bool) -> str:
    """A question's instructions as the target reads them: the decision's instructions first, a
    Noul's outcome descriptions (when the target's type has no place for them), the parents' answers."""
    parts = [ask.instructions] if ask.instructions else []
    parts.append(option_text(q.instructions))
    if criteria and isinstance(q, Noul) and q.criteria is not None:
        outcomes = [f"{word} means: {option_text(text)}" for word, text in
                    (("Yes", q.criteria.true), ("No", q.criteria.false)) if text not in (None, "")]
        parts += outcomes
    if restated := ask.parents.get(qid):
        parts.append("Earlier answers about this input:\n" + "\n".join(f"- {r.question}: {r.answer}"
                                                                       for r in restated))
    return "\n\n".join(parts)


def _restated(qid: str, q: Noul | Choice | Score, ask: Asked) -> Noul | Choice | Score:
    """A langchain-core question with the decision's instructions and its parents' answers in it."""
    if not ask.instructions and not ask.parents.get(qid):
        return q
    return q.model_copy(update={"instructions": _text(q, ask, qid, criteria=False)})


def _decision_state(ask: Asked) -> Any:
    """A `BaseDecisionModel`'s state: the value as given (it renders it and finds its images), or,
    when the decision adds images of its own (`ReadOptions.images`), which the value does not hold,
    what the canvas read: its text with every image beside it in one user message."""
    if not ask.images or ask.images == state_images(ask.state):
        return ask.state
    return _as_read(ask)


def _as_read(ask: Asked) -> list[HumanMessage]:
    """What the canvas read, as one user message: its text, then every image."""
    return [HumanMessage(content=[{"type": "text", "text": ask.text},
                                  *({"type": "image_url", "image_url": {"url": url}} for url in ask.images)])]


def _openai_request(ask: Asked, name: str) -> dict[str, Any]:
    """`OpenAIDecisions`'s input: the canvas's text (and images), the questions in its own types."""
    from langchain_openai.decisions import Choice as OpenAIChoice
    from langchain_openai.decisions import Level, Predicate
    from langchain_openai.decisions import Score as OpenAIScore

    hosted = [url for url in ask.images if not url.startswith("data:")]
    if hosted:
        raise EscalationError(f"escalation to {name}: OpenAIDecisions sends images only as base64 data URLs, and "
                              f"the state holds {len(hosted)} hosted image URL(s)", failure="target",
                              hint="inline the images (data URLs), or escalate to a target that takes image URLs")
    state: Any = _as_read(ask) if ask.images else ask.text
    questions: dict[str, Any] = {}
    for qid, q in ask.questions.items():
        text = _text(q, ask, qid, criteria=True)
        if isinstance(q, Noul):
            questions[qid] = Predicate(instructions=text)
        elif isinstance(q, Choice):
            questions[qid] = OpenAIChoice(instructions=text, choices={
                option: None if d in (None, "") else option_text(d) for option, d in q.criteria.items()})
        else:
            questions[qid] = OpenAIScore(instructions=text, levels=[
                Level(label=option_text(d) or str(n)) for n, d in enumerate(q.criteria)])
    return {"input": state, "questions": questions}


def _is_openai_decisions(target: Any) -> bool:
    """langchain-openai's `OpenAIDecisions` (optional: `canvasroute[openai]`), by its class."""
    return any(c.__name__ == "OpenAIDecisions" and c.__module__.startswith("langchain_openai.decisions")
               for c in type(target).__mro__)


def _classified(name: str, target: Any, exc: Exception) -> EscalationError:
    """`failure`'s classification, with an unreadable response as `format` and the SDK's own retries counted."""
    names = {c.__name__ for c in type(exc).__mro__}
    if isinstance(exc, EngineResponseError) or "APIResponseValidationError" in names:
        return EscalationError(f"escalation to {name} answered something its client cannot read (format): "
                               f"{exc!r}", failure="format", hint=_FORMAT_HINT)
    error = failure(name, target, exc)
    status = getattr(exc, "status_code", None)
    retried = "APIConnectionError" in names or (isinstance(status, int)
                                                 and (status in (408, 409, 429) or status >= 500))
    if _is_openai_decisions(target) and getattr(target, "max_retries", None) is None and retried:
        error.attempts = _OPENAI_RETRIES + 1  # the SDK retried these by itself
    return error


# -- reading -----------------------------------------------------------------------------------


def _read(qid: str, q: Noul | Choice | Score, answer: Any, options: Sequence[str]) -> TargetAnswer:
    """One answer (OpenAI Decisions' or langchain-core's) as a `TargetAnswer` (ValueError: outside the wire)."""
    kind = getattr(answer, "type", None)
    if answer is None:
        raise ValueError(f"no answer for {qid!r}")
    if kind == "refusal":
        extra = getattr(answer, "model_extra", None) or {}
        reason = next((str(v) for k, v in extra.items() if k in ("reason", "refusal", "message") and v), None)
        return TargetAnswer(answer=None, refusal=reason or "the target refused to answer")
    wanted = ("predicate", "noul") if isinstance(q, Noul) else ("choice",) if isinstance(q, Choice) else ("score",)
    if kind not in wanted:
        raise ValueError(f"{qid!r} is a {q.type}, the target answered a {kind}")
    if isinstance(answer, NoulAnswer) or kind == "predicate":
        p = _probability(answer.noul if isinstance(answer, NoulAnswer) else answer.probability, qid)
        return TargetAnswer(answer="yes" if p >= 0.5 else "no", probabilities={"yes": p, "no": 1.0 - p},
                            confidence=system_one_confidence(max(p, 1.0 - p), 2))
    if kind == "choice":
        choice = answer.choice
        if not isinstance(choice, str) or choice not in options:
            raise ValueError(f"{qid!r}: {json.dumps(choice)} is not one of {list(options)}")
        probs = _distribution(qid, dict(answer.probabilities), options, _choice_key)
        return TargetAnswer(answer=choice, probabilities=probs, confidence=float(answer.confidence))
    probs = _distribution(qid, dict(answer.probabilities), options, _level_key)
    if probs:
        level = max(probs, key=probs.__getitem__)
    else:
        level = str(min(max(round(float(answer.score)), 0), len(options) - 1))
    return TargetAnswer(answer=level, probabilities=probs or None, confidence=float(answer.confidence))


def _choice_key(key: Any) -> str | None:
    return key if isinstance(key, str) else None  # a boolean is another value than any string option


def _level_key(key: Any) -> str | None:
    return str(key) if isinstance(key, int) and not isinstance(key, bool) else None


def _distribution(qid: str, given: Mapping[Any, Any], options: Sequence[str],
                  key: Callable[[Any], str | None]) -> dict[str, float]:
    """The target's probabilities over the options (an option it gave none: 0); ValueError for mass on
    anything that is not an option."""
    out = dict.fromkeys(options, 0.0)
    for raw, p in given.items():
        option = key(raw)
        if option not in out:
            raise ValueError(f"{qid!r}: a probability for {json.dumps(raw)}, which is not one of {list(options)}")
        out[option] = _probability(p, qid)
    return out if given else {}


def _probability(value: Any, qid: str) -> float:
    p = float(value)
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"{qid!r}: probability {value!r} is not in [0, 1]")
    return p


def _usage_value(usage: Any, key: str) -> Any:
    if isinstance(usage, Mapping):
        return usage.get(key)
    return getattr(usage, key, None)

