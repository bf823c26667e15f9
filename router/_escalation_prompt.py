"""What an escalation asks: the prompt (configurable) and the answer schema (structured output).

The prompt is a langchain-core `ChatPromptTemplate` with up to three variables:
`{state}` (the rendered state), `{questions}` (one line per question: instructions,
options, the canvas probabilities as a hint) and `{keys}` (the question ids, quoted).
`ESCALATION_PROMPT`, the default, is a system message, a one-shot example of the reply
and the request. The answer schema is a JSON object with one property per question id,
each an `enum` of its options: a target with structured output (`with_structured_output`:
JSON schema on OpenAI-compatible servers, guided decoding on vLLM) can only answer in it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, SystemMessage
from langchain_core.prompts import BasePromptTemplate, ChatPromptTemplate

from ._questions import QuestionSpec, option_text, parse_questions

__all__ = ["ESCALATION_PROMPT", "PROMPT_VARIABLES", "answer_schema", "check_prompt", "prompt_messages"]

PROMPT_VARIABLES = frozenset({"state", "questions", "keys"})
"""The variables an escalation prompt may use."""

INSTRUCTIONS = ("You answer classification questions about an input. For each question choose exactly one "
                "of its allowed options. A fast model's probabilities are given as a hint; they may be wrong. "
                "Reply with only a JSON object that maps each question id to one allowed option.")
REQUEST = "Input:\n{state}\n\n{questions}\n\nJSON with the keys {keys}:"


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


def variables(state_text: str, specs: Sequence[QuestionSpec],
              canvas: Mapping[str, Mapping[str, float] | None]) -> dict[str, str]:
    return {"state": state_text, "questions": question_lines(specs, canvas),
            "keys": ", ".join(f'"{s.id}"' for s in specs)}


def _example() -> tuple[HumanMessage, AIMessage]:
    """A one-shot example of the reply format (small models need it; large ones don't mind)."""
    specs = parse_questions({"weather": {"type": "choice", "instructions": "What is the weather like?",
                                         "criteria": {"sunny": None, "rainy": None}},
                             "cold": {"type": "noul", "instructions": "Is it cold?"}})
    hint = {"weather": {"sunny": 0.6, "rainy": 0.4}, "cold": {"yes": 0.3, "no": 0.7}}
    text = REQUEST.format(**variables("It is a bright, sunny day in July.", list(specs.values()), hint))
    return HumanMessage(text), AIMessage('{"weather": "sunny", "cold": "no"}')


ESCALATION_PROMPT = ChatPromptTemplate.from_messages([SystemMessage(INSTRUCTIONS), *_example(), ("human", REQUEST)])
"""The default escalation prompt: instructions, a one-shot example, the request."""


def check_prompt(prompt: Any) -> Any:
    """`prompt` if it is a prompt template over `PROMPT_VARIABLES` only (or None)."""
    if prompt is None:
        return None
    if not isinstance(prompt, BasePromptTemplate):
        raise ValueError(f"escalation_prompt must be a langchain-core ChatPromptTemplate, not {type(prompt).__name__}")
    unknown = sorted(set(prompt.input_variables) - PROMPT_VARIABLES)
    if unknown:
        raise ValueError(f"escalation_prompt uses unknown variables {unknown}; it may use {sorted(PROMPT_VARIABLES)}")
    return prompt


async def prompt_messages(prompt: Any, state_text: str, specs: Sequence[QuestionSpec],
                          canvas: Mapping[str, Mapping[str, float] | None]) -> list[BaseMessage]:
    """The escalation's messages: `prompt` (default `ESCALATION_PROMPT`) filled in."""
    template = prompt or ESCALATION_PROMPT
    values = variables(state_text, specs, canvas)
    filled = await template.ainvoke({k: values[k] for k in template.input_variables})
    return filled.to_messages()


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
