"""Questions from a schema: the graders of LangGraph's tutorials, read from a canvas.

A pydantic model (or a `TypedDict`) whose fields are closed choices becomes a decision set,
one question per field (its id is the field's name), and the decision's answers become an
instance of the schema, validated by the schema itself:

```
field                                      question   option -> value
bool, Literal[True, False]                 Noul       yes -> True, no -> False
Literal["yes", "no"] (any case, 2 values)  Noul       yes -> the yes value as spelled ("Yes" stays "Yes")
Literal["vectorstore", "web_search"]       Choice     the value itself
Literal[1, 2, 3] (str or int values)       Choice     str(value) -> the value (an int stays an int)
an Enum of str or int values               Choice     str(value) -> the member
```

A yes/no `Literal` is a Noul rather than a two-option Choice: the canvas reads it with the
labels `yes`/`no`, the escalation target is asked `yes`/`no`, and the answer keeps the
probability of yes (`NoulAnswer.noul`). The mapping back is by name, so the `Literal`'s order
does not matter. A field's description (`Field(description=...)`, or the description in
`Annotated[..., Field(description=...)]` or, as LangChain reads TypedDicts, the last string in
`Annotated[...]`) is its question's instructions; a field without one is asked by its name.
The schema's own docstring is context for every question (the decision's `instructions`).
Any other field (str, int, float, Optional, unions, lists, nested models) raises
`UnsupportedQuestion` naming it: a canvas reads a closed set of options, not free values.

`StructuredOutput.with_structured_output` (a mixin of `CanvasDecisionModel`) returns a
`StructuredDecision`: a Runnable that takes what a tutorial's chain gives a chat model (a
`PromptValue`, messages, a string, or a dict state), decides the schema's questions in one
decision (the messages are the state) and returns an instance of the schema.

Example:
    ```python
    class GradeDocuments(BaseModel):
        binary_score: Literal["yes", "no"] = Field(description="Documents are relevant to the question")

    grader = grade_prompt | model.with_structured_output(GradeDocuments)
    grader.invoke({"question": q, "document": d}).binary_score   # "yes" or "no"
    ```
"""

from __future__ import annotations

import functools
import inspect
import types
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Annotated, Any, Literal, NotRequired, Required, Union, cast, get_args, get_origin, get_type_hints

from langchain_core.callbacks import AsyncCallbackManagerForChainRun, CallbackManagerForChainRun
from langchain_core.decisions import BaseDecisionModel, Choice, ChoiceAnswer, ClassifierRequest, Noul, NoulAnswer
from langchain_core.prompt_values import PromptValue
from langchain_core.runnables import Runnable, RunnableConfig
from pydantic import BaseModel, TypeAdapter
from pydantic.fields import FieldInfo
from typing_extensions import ReadOnly, is_typeddict

from canvasroute.engine import DecisionError, UnsupportedQuestion

from ._state import as_message

__all__ = ["StructuredDecision", "answers_to_schema", "questions_from_schema", "schema_questions"]

SUPPORTED = ("a schema field is asked as a question when it is bool, Literal[...] of str or int values "
             "(Literal['yes', 'no'] and Literal[True, False] are yes/no), or an Enum of str or int values")


def questions_from_schema(schema: type) -> dict[str, Noul | Choice]:
    """The schema's fields as questions, by field name (fresh models: yours to change).

    Raises:
        UnsupportedQuestion: `schema` is not a pydantic model or TypedDict class, has no
            fields, or has a field with no question form (named in the message).

    Example:
        ```python
        questions_from_schema(GradeDocuments)   # {"binary_score": Noul(instructions="...")}
        ```
    """
    return {name: f.question.model_copy(deep=True) for name, f in _form(schema).fields.items()}


def schema_questions(schema: type) -> tuple[dict[str, Noul | Choice], str | None]:
    """`questions_from_schema(schema)` and the schema's docstring (the decision's instructions;
    None without one): a schema given where questions go (`decide`, `decision_node`, `route_on`).

    Raises:
        UnsupportedQuestion: as `questions_from_schema`.
    """
    return questions_from_schema(schema), _form(schema).instructions


def answers_to_schema(schema: type, response: Any) -> Any:
    """A decision's answers to `questions_from_schema(schema)` as an instance of `schema`
    (a dict for a TypedDict), validated by the schema.

    Each field takes its question's chosen option: the read report's answer for a
    `CanvasResponse`, else the answer (`choice`; a Noul is yes when `noul >= 0.5`).

    Raises:
        DecisionError: a field the response does not answer, or answers outside its values.
        pydantic.ValidationError: the schema's own validators refused the values.
    """
    form = _form(schema)
    data = {}
    for name, f in form.fields.items():
        option = _option(response, name)
        if option not in f.values:
            raise DecisionError(f"{form.name}.{name}: the decision answered {option!r}, not one of "
                                f"{list(f.values)}")
        data[name] = f.values[option]
    return form.validate(data)


class StructuredDecision(Runnable[Any, Any]):
    """A decision model answering a schema: what `with_structured_output(schema)` returns.

    Input: a `PromptValue` (a prompt's output), messages, a string, or any other state (a
    dict, e.g. a graph's state); messages and prompts are the state as a transcript. Output: an
    instance of the schema, or with `include_raw` LangChain's `{"raw": <the decision's response>,
    "parsed": <the instance or None>, "parsing_error": <the schema's ValidationError or None>}`.
    """

    def __init__(self, model: BaseDecisionModel, schema: type, *, include_raw: bool = False) -> None:
        form = _form(schema)
        self.model, self.schema, self.include_raw = model, schema, include_raw
        self.questions = questions_from_schema(schema)
        """The decision set asked on every call (one question per field)."""
        self._extra = {"read": {"instructions": form.instructions}} if form.instructions else {}

    def __repr__(self) -> str:
        return f"StructuredDecision({self.schema.__name__}, model={self.model.model!r})"

    @property
    def OutputType(self) -> Any:  # noqa: N802 - LangChain's Runnable.OutputType, overridden
        return dict if self.include_raw else self.schema

    def request(self, input: Any) -> ClassifierRequest:
        """The decision request for one input (the schema's docstring as its `instructions`)."""
        return cast(ClassifierRequest, {"state": as_state(input), "questions": self.questions, **self._extra})

    def invoke(self, input: Any, config: RunnableConfig | None = None, **kwargs: Any) -> Any:
        return self._call_with_config(self._decide, input, config)

    async def ainvoke(self, input: Any, config: RunnableConfig | None = None, **kwargs: Any) -> Any:
        return await self._acall_with_config(self._adecide, input, config)

    def _decide(self, input: Any, run_manager: CallbackManagerForChainRun, config: RunnableConfig) -> Any:
        return self._output(self.model.invoke(self.request(input), config))

    async def _adecide(self, input: Any, run_manager: AsyncCallbackManagerForChainRun,
                       config: RunnableConfig) -> Any:
        return self._output(await self.model.ainvoke(self.request(input), config))

    def _output(self, response: Any) -> Any:
        if not self.include_raw:
            return answers_to_schema(self.schema, response)
        try:
            return {"raw": response, "parsed": answers_to_schema(self.schema, response), "parsing_error": None}
        except ValueError as exc:  # the schema's ValidationError, or an answer outside its values
            return {"raw": response, "parsed": None, "parsing_error": exc}


def as_state(value: Any) -> Any:
    """What a chat model would be given, as a decision's state: a prompt's messages, a list of
    message-likes as messages (each as a decision reads it in a state: `as_message`); a string, a
    message or anything else as it is."""
    if isinstance(value, PromptValue):
        return value.to_messages()
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        try:
            return [as_message(m) for m in value]
        except (ValueError, TypeError, KeyError, NotImplementedError) as exc:
            raise DecisionError(f"a list input is messages, as a chat model reads it: {exc}",
                                hint="pass other JSON-like state inside a dict") from exc
    return value


# -- the schema's form -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Field:
    question: Noul | Choice
    values: Mapping[str, Any]
    """Each option's value in the schema."""


@dataclass(frozen=True, slots=True)
class _Form:
    name: str
    fields: Mapping[str, _Field]
    instructions: str | None
    validate: Any
    """`data -> instance`: the schema's own validation (by field name)."""


def _form(schema: Any) -> _Form:
    if not isinstance(schema, type) or not (issubclass(schema, BaseModel) or is_typeddict(schema)):
        raise UnsupportedQuestion(f"a schema is a pydantic model or TypedDict class, not {schema!r}",
                                  hint="declare the answers as a pydantic model (a JSON schema dict is not read)")
    return _cached_form(schema)


@functools.lru_cache(maxsize=256)
def _cached_form(schema: type) -> _Form:
    name = schema.__name__
    if issubclass(schema, BaseModel):
        fields = {n: (info.annotation, _description(info, info.metadata)) for n, info in schema.model_fields.items()}
        validate: Any = functools.partial(schema.model_validate, by_name=True)
    else:
        fields = {n: _typed_dict_field(t) for n, t in get_type_hints(schema, include_extras=True).items()}
        validate = functools.partial(TypeAdapter(schema).validate_python, by_name=True)
    if not fields:
        raise UnsupportedQuestion(f"{name} has no fields to ask", hint=SUPPORTED)
    doc = schema.__dict__.get("__doc__")
    form = {n: _field(f"{name}.{n}", t, desc or n.replace("_", " ") + "?") for n, (t, desc) in fields.items()}
    return _Form(name, form, inspect.cleandoc(doc) if doc else None, validate)


def _typed_dict_field(hint: Any) -> tuple[Any, str | None]:
    while get_origin(hint) in (Required, NotRequired, ReadOnly):
        (hint,) = get_args(hint)
    if get_origin(hint) is Annotated:
        return hint.__origin__, _description(None, hint.__metadata__)
    return hint, None


def _description(info: FieldInfo | None, metadata: Sequence[Any]) -> str | None:
    if info is not None and info.description:
        return info.description
    texts = [m.description if isinstance(m, FieldInfo) else m for m in metadata
             if isinstance(m, str) or (isinstance(m, FieldInfo) and m.description)]
    return texts[-1] if texts else None


def _field(where: str, annotation: Any, instructions: str) -> _Field:
    if annotation is bool:
        return _Field(Noul(instructions=instructions), {"yes": True, "no": False})
    if isinstance(annotation, type) and issubclass(annotation, Enum):
        return _choice(where, [m.value for m in annotation], instructions, list(annotation))
    if get_origin(annotation) is Literal:
        values = list(get_args(annotation))
        if all(isinstance(v, bool) for v in values) and set(values) == {True, False}:
            return _Field(Noul(instructions=instructions), {"yes": True, "no": False})
        if len(values) == 2 and all(isinstance(v, str) for v in values) and {
                v.casefold() for v in values} == {"yes", "no"}:
            yes, no = sorted(values, key=lambda v: v.casefold() != "yes")
            return _Field(Noul(instructions=instructions), {"yes": yes, "no": no})
        return _choice(where, values, instructions, values)
    raise UnsupportedQuestion(f"{where}: {_named(annotation)} has no question form{_why(annotation)}", hint=SUPPORTED)


def _choice(where: str, values: list[Any], instructions: str, back: list[Any]) -> _Field:
    if len(values) < 2:
        raise UnsupportedQuestion(f"{where}: one value leaves nothing to decide", hint=SUPPORTED)
    if not all(isinstance(v, (str, int)) and not isinstance(v, bool) for v in values):
        odd = next(v for v in values if not isinstance(v, (str, int)) or isinstance(v, bool))
        raise UnsupportedQuestion(f"{where}: the value {odd!r} is not a str or an int "
                                  "(a bool only as yes/no: Literal[True, False])", hint=SUPPORTED)
    options = {str(v): b for v, b in zip(values, back, strict=True)}
    if len(options) < len(values):
        raise UnsupportedQuestion(f"{where}: two values have the same text ({[str(v) for v in values]})",
                                  hint=SUPPORTED)
    return _Field(Choice(instructions=instructions, criteria=dict.fromkeys(options)), options)


def _named(annotation: Any) -> str:
    if isinstance(annotation, type) and not get_args(annotation):
        return annotation.__name__
    return repr(annotation).replace("typing.", "")


def _why(annotation: Any) -> str:
    origin, args = get_origin(annotation), get_args(annotation)
    if origin in (Union, types.UnionType):
        return " (an Optional or a union: every answer is one of a field's values)" if type(None) in args \
            else " (a union: give the field one Literal of its values)"
    if annotation in (str, int, float):
        return " (a free value: list the allowed values as a Literal[...])"
    if isinstance(annotation, type) and (issubclass(annotation, BaseModel) or is_typeddict(annotation)):
        return " (a nested schema: ask its fields as a schema of their own)"
    if origin in (list, tuple, set, frozenset, dict):
        return " (a collection: a question has one answer)"
    return ""


def _option(response: Any, name: str) -> str:
    """The option a response chose for question `name`."""
    reads = getattr(response, "reads", None)
    report = reads.get(name) if isinstance(reads, Mapping) else None
    if report is not None and getattr(report, "answer", None) is not None:
        return str(report.answer)
    answer = getattr(response, "answers", {}).get(name)
    if isinstance(answer, NoulAnswer):
        return "yes" if answer.noul >= 0.5 else "no"
    if isinstance(answer, ChoiceAnswer):
        return answer.choice
    raise DecisionError(f"the decision has no answer for {name!r}", hint="decide questions_from_schema(schema)")
