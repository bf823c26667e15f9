"""`POST /v1/decisions` (OpenAI Decisions) on the wire: a body to questions, answers to a body.

Pure functions over decoded JSON, no I/O. The `openai` SDK's own types define the wire
(`docs/decisions-wire.md` writes it down):

- `parse(body)` checks a request and returns a `WireRequest`: the state to decide on
  (text as is; messages as langchain-core messages, images as standard image blocks, tool
  calls as `tool_calls` and their outputs as `ToolMessage`s), its faithful transcript and its
  images, and the questions in order, each as a langchain-core `Noul` / `Choice` / `Score`
  beside what the wire said (name, typed choice values, level labels, instruction images).
- `render(request, results)` is the response body: one answer per question in question
  order, each with its name (null when unnamed), a choice's value as it was sent (`true` and
  `"true"` are distinct), a score's expected level, refusals, and usage.
- `error_body(...)` is OpenAI's error shape, `{"error": {"message", "type", "param", "code"}}`;
  `DecisionsWireError` carries it (status, `param` naming the field: `questions[3].choices`,
  `input[2].call_id`), and `from_refusal` turns the `/v1/systemone` server's own error
  answers (`wire.Refusal`: engine down, budget spent, ...) into it.
- `decision_inputs(request)` and `question_results(request, response)` are the serving side
  (`canvasroute serve`): the transcript, images and questions a decision takes, and the
  decision's reports back as results, refusals included (`_served`).

The JSON text itself (its size, depth, lone surrogates, NaN) is the body reader's to check
(`parse.load_json`, for both wires). Every request error here is a 400, as on OpenAI's API.
"""

from ._fields import DecisionsWireError, error_body, from_refusal
from ._questions import MAX_CHOICES, MAX_LEVELS, MAX_QUESTIONS, MIN_CHOICES, MIN_LEVELS, ChoiceValue, WireQuestion
from ._served import DecisionInputs, decision_inputs, question_results, refusal_kind, usage_of
from ._wire import QuestionResult, Usage, WireRequest, parse, render

__all__ = [
    "MAX_CHOICES",
    "MAX_LEVELS",
    "MAX_QUESTIONS",
    "MIN_CHOICES",
    "MIN_LEVELS",
    "ChoiceValue",
    "DecisionInputs",
    "DecisionsWireError",
    "QuestionResult",
    "Usage",
    "WireQuestion",
    "WireRequest",
    "decision_inputs",
    "error_body",
    "from_refusal",
    "parse",
    "question_results",
    "refusal_kind",
    "render",
    "usage_of",
]
