"""Test doubles for decisions: an escalation target whose answers you script.

`ScriptedTarget` is a langchain-core chat model (a `BaseChatModel`, in the spirit of
`GenericFakeChatModel`), so a `CanvasDecisionModel` escalates to it exactly as to `ChatOpenAI`:
through `with_structured_output(answer schema, include_raw=True)`, a tool call whose arguments
map each question id to an option. It answers from a script, counts its calls, keeps every
prompt it was sent, reports a distribution as OpenAI-shaped logprobs when the script gives one,
and can be told to fail or to answer malformed first, or to answer only when a test says so (`hold`).

Example:
    ```python
    target = ScriptedTarget(script={"team": "billing"})
    model = CanvasDecisionModel(engine=FunctionEngine(rows), escalate_to=target)
    model.decide(ticket, {"team": team}).reads["team"].path   # "escalated" when the canvas was unsure
    target.calls, target.prompts[-1][-1].text                 # 1, the request: question, options, canvas hint
    ```
"""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel, LanguageModelInput
from langchain_core.messages import AIMessage, BaseMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from langchain_core.runnables import Runnable
from langchain_core.utils.function_calling import convert_to_openai_tool
from pydantic import Field, PrivateAttr, field_validator

__all__ = ["Answer", "Fault", "Script", "ScriptedTarget", "SyncScriptedTarget"]

Answer = str | bool | int | Mapping[str, float]
"""An option, or a distribution `{option: probability}` (the reply names its most likely option)."""
Script = Mapping[str, Answer] | Callable[[str, tuple[Any, ...], str], Answer]
"""`{question id: answer}`, or `fn(question id, options, prompt text) -> answer`."""
Fault = BaseException | Literal["malformed"] | None
"""What one call does instead of answering: raise the exception, reply in prose ("malformed"),
or nothing (None: it answers)."""


class ScriptedTarget(BaseChatModel):
    """An escalation target that answers from a script: a chat model for tests.

    With a bound answer schema (the structured-output path canvasroute takes), each property of
    the schema is a question: its id and options (the schema's `enum`) go to the script, and the
    reply is a tool call with the answers, its content the same answers as JSON text. Without one
    (`Escalation(target, output="text")`) a mapping script's answers come back as JSON text.
    A distribution is reported as `response_metadata["logprobs"]` (OpenAI's shape, as
    `ChatOpenAI(logprobs=True)` returns it): the answer's value is one token that ends it, its
    alternatives the script's options written the same way, so canvasroute reads the script's
    distribution back exactly, options that prefix each other (`1`, `10`) included; in a reply
    with a distribution an option answered plainly reads as certain.
    """

    script: Any
    """A `Script`: `{question id: answer}` or `fn(question id, options, prompt text) -> answer`, where
    the prompt text is the last message's (canvasroute's request: state, questions, canvas hint)."""
    faults: list[Any] = Field(default_factory=list)
    """A `Fault` for each of the first calls, in order (e.g. `[TimeoutError()]`: the first call
    raises, the next answers; `["malformed"]`: the first reply is prose, with no tool call or JSON)."""
    model: str = "scripted"
    """The model name the replies report (`response_metadata["model_name"]`)."""
    hold: Any = None
    """`async fn(call index)` awaited before an async call answers (None: it answers at once), so a
    test says when the target answers, e.g. `lambda call: answer_now.wait()` with an `asyncio.Event`;
    the call is counted (and cancellable) while it waits."""

    _prompts: list[list[BaseMessage]] = PrivateAttr(default_factory=list)
    _lock: threading.Lock = PrivateAttr(default_factory=threading.Lock)

    @field_validator("script")
    @classmethod
    def _check_script(cls, value: Any) -> Any:
        if not (isinstance(value, Mapping) or callable(value)):
            raise ValueError(f"script must be a mapping of question id to answer, or a function, not {value!r}")
        return value

    @field_validator("hold")
    @classmethod
    def _check_hold(cls, value: Any) -> Any:
        if value is not None and not callable(value):
            raise ValueError(f"hold must be an async function of the call index, not {value!r}")
        return value

    @field_validator("faults")
    @classmethod
    def _check_faults(cls, value: list[Any]) -> list[Any]:
        for fault in value:
            if not (fault is None or fault == "malformed" or isinstance(fault, BaseException)):
                raise ValueError(f"a fault is an exception, 'malformed' or None, not {fault!r}")
        return value

    @property
    def _llm_type(self) -> str:
        return "scripted"

    @property
    def calls(self) -> int:
        """Calls so far (a failed or malformed one counts)."""
        return len(self._prompts)

    @property
    def prompts(self) -> list[list[BaseMessage]]:
        """The messages of every call, in order."""
        return list(self._prompts)

    def bind_tools(self, tools: Sequence[Any], *, tool_choice: str | None = None,
                   **kwargs: Any) -> Runnable[LanguageModelInput, AIMessage]:
        """Tools in OpenAI's form, as a chat model binds them (`with_structured_output` uses this)."""
        return self.bind(tools=[convert_to_openai_tool(t) for t in tools], tool_choice=tool_choice, **kwargs)

    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                  run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        return self._reply_to(self._count(messages), messages, kwargs)

    async def _agenerate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                         run_manager: AsyncCallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        call = self._count(messages)
        if self.hold is not None:
            await self.hold(call)
        return self._reply_to(call, messages, kwargs)

    def _count(self, messages: list[BaseMessage]) -> int:
        """Keep a call's messages; its index."""
        with self._lock:
            self._prompts.append(list(messages))
            return len(self._prompts) - 1

    def _reply_to(self, call: int, messages: list[BaseMessage], kwargs: Mapping[str, Any]) -> ChatResult:
        fault = self.faults[call] if call < len(self.faults) else None
        if isinstance(fault, BaseException):
            raise fault
        metadata: dict[str, Any] = {"model_name": self.model}
        if fault == "malformed":
            return _result(AIMessage("I am not sure which option fits.", response_metadata=metadata))
        tool = (kwargs.get("tools") or [None])[0]
        text = messages[-1].text if messages else ""
        if tool is None:
            if not isinstance(self.script, Mapping):
                raise ValueError("a ScriptedTarget with a function script answers only through structured output "
                                 "(with_structured_output), where it knows the questions")
            questions: dict[str, tuple[Any, ...]] = dict.fromkeys(self.script, ())
        else:
            questions = _questions(tool)
        answers = {qid: self._answer(qid, options, text) for qid, options in questions.items()}
        content, logprobs = _reply(answers)
        if logprobs is not None:
            metadata["logprobs"] = logprobs
        values = {qid: value for qid, (value, _) in answers.items()}
        calls = [] if tool is None else [{"name": tool["function"]["name"], "args": values, "id": f"call_{call}",
                                          "type": "tool_call"}]
        return _result(AIMessage(content, tool_calls=calls, response_metadata=metadata))

    def _answer(self, qid: str, options: tuple[Any, ...], text: str) -> tuple[Any, Mapping[str, float] | None]:
        """(the option answered, its distribution or None) for one question."""
        if isinstance(self.script, Mapping):
            if qid not in self.script:
                raise ValueError(f"ScriptedTarget has no answer for question {qid!r} (it has {sorted(self.script)})")
            answer = self.script[qid]
        else:
            answer = self.script(qid, options, text)
        if isinstance(answer, Mapping):
            return max(answer, key=answer.__getitem__), answer
        return answer, None


class SyncScriptedTarget(ScriptedTarget):
    """A `ScriptedTarget` with no async path of its own, as a sync chat model (one that implements
    `_generate` only): langchain runs it in a thread, which no cancellation stops.
    `hold` is then a plain function of the call index, called in that thread before it answers
    (e.g. `lambda call: release.wait(5)` with a `threading.Event`).

    Example:
        ```python
        release = threading.Event()
        target = SyncScriptedTarget(script={"team": "billing"}, hold=lambda call: release.wait(5))
        ```
    """

    _agenerate = BaseChatModel._agenerate  # langchain's default: `_generate` in a thread

    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                  run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        call = self._count(messages)
        if self.hold is not None:
            self.hold(call)
        return self._reply_to(call, messages, kwargs)


def _questions(tool: Mapping[str, Any]) -> dict[str, tuple[Any, ...]]:
    """Each property of a bound tool's parameters, with its options (`enum`; a boolean: True, False)."""
    properties = tool["function"].get("parameters", {}).get("properties", {})
    return {qid: tuple(p.get("enum") or ((True, False) if p.get("type") == "boolean" else ()))
            for qid, p in properties.items()}


def _reply(answers: Mapping[str, tuple[Any, Mapping[str, float] | None]]) -> tuple[str, dict[str, Any] | None]:
    """The answers as JSON text, and OpenAI-shaped logprobs over its tokens when one has a
    distribution: each answer's value is one token that ends it (a string's closing quote, or a
    bare value's delimiter), and its alternatives are its options, written the same way."""
    tokens: list[tuple[str, Mapping[str, float] | None, str]] = [("{", None, "")]
    for i, (qid, (value, dist)) in enumerate(answers.items()):
        tokens.append((("" if i == 0 else " ") + json.dumps(qid) + ": ", None, ""))
        end = "," if i < len(answers) - 1 else "}"
        if isinstance(value, str):
            tokens.append(('"', None, ""))
        tokens.append((_written(value) + end, dist, end))
    if len(answers) == 0:
        tokens.append(("}", None, ""))
    content = "".join(token for token, _, _ in tokens)
    if all(dist is None for _, dist, _ in tokens):
        return content, None
    entries = []
    for token, dist, end in tokens:
        ranked = sorted(((_written(o) + end, _logprob(p)) for o, p in (dist or {}).items()), key=lambda a: -a[1])
        mine = next((lp for o, lp in ranked if o == token), 0.0)
        entries.append({"token": token, "logprob": mine,
                        "top_logprobs": [{"token": o, "logprob": lp} for o, lp in ranked]})
    return content, {"content": entries}


def _written(value: Any) -> str:
    """A value as the reply writes it from where it starts (a string after its opening quote)."""
    literal = json.dumps(value)
    return literal[1:] if isinstance(value, str) else literal


def _logprob(p: float) -> float:
    return math.log(p) if p > 0 else -9999.0  # OpenAI's floor for a token it would never pick


def _result(message: AIMessage) -> ChatResult:
    return ChatResult(generations=[ChatGeneration(message=message)])
