"""Pydantic models of the `/v1/decisions` wire, for the OpenAPI document only (`parse` checks requests).

They follow the `openai` SDK 3.57's types (`docs/decisions-wire.md`); keys they do not name are
ignored by the server, as `parse` ignores them.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ._input import MAX_JSON_BYTES, MAX_JSON_DEPTH, MAX_JSON_VALUES
from ._questions import MAX_CHOICES, MAX_QUESTIONS, MIN_CHOICES, MIN_LEVELS

__all__ = ["DecisionsErrorResponse", "DecisionsRequest", "DecisionsResponse"]


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class Breakpoint(_Open):
    mode: Literal["explicit"]


class InputText(_Open):
    type: Literal["input_text"]
    text: str
    prompt_cache_breakpoint: Breakpoint | None = None


class InputImage(_Open):
    """An image: a base64 data URL (`data:image/<type>;base64,...`) or an http(s) URL; no file ids."""

    type: Literal["input_image"]
    image_url: str = Field(pattern=r"^(data:image/|https?://)")
    detail: Literal["low", "high", "auto", "original"] | None = None
    prompt_cache_breakpoint: Breakpoint | None = None


class InputJson(_Open):
    type: Literal["input_json"]
    data: dict[str, Any] | list[dict[str, Any]] = Field(
        description=f"A JSON object or an array of objects, read as compact JSON text: at most {MAX_JSON_DEPTH} "
                    f"container levels, {MAX_JSON_VALUES} values and {MAX_JSON_BYTES // 1024} KiB.")


class OutputText(_Open):
    type: Literal["output_text"]
    text: str


class RefusalPart(_Open):
    type: Literal["refusal"]
    refusal: str


UserPart = Annotated[InputText | InputImage | InputJson, Field(discriminator="type")]
AssistantPart = Annotated[OutputText | RefusalPart, Field(discriminator="type")]
OutputPart = Annotated[InputText | InputImage, Field(discriminator="type")]
Status = Literal["in_progress", "completed", "incomplete"]


class UserMessage(_Open):
    type: Literal["message"] = "message"
    role: Literal["user"]
    content: str | list[UserPart]


class InstructionMessage(_Open):
    """A developer or system message (read as the conversation's instructions, in place)."""

    type: Literal["message"] = "message"
    role: Literal["developer", "system"]
    content: str | list[InputText]


class AssistantMessage(_Open):
    type: Literal["message"] = "message"
    role: Literal["assistant"]
    content: str | list[AssistantPart]
    phase: Literal["commentary", "final_answer"] | None = None


class FunctionCall(_Open):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str = Field(description="The call's arguments as the model wrote them (JSON text).")
    id: str | None = None
    namespace: str | None = None
    status: Status | None = None


class CustomToolCall(_Open):
    type: Literal["custom_tool_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: str = Field(description="The call's free-text input.")
    id: str | None = None
    namespace: str | None = None
    status: Status | None = None


class ToolOutput(_Open):
    """A tool call's output; `call_id` names an earlier call of the matching type."""

    type: Literal["function_call_output", "custom_tool_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[OutputPart]
    id: str | None = None
    status: Status | None = None


Item = UserMessage | InstructionMessage | AssistantMessage | FunctionCall | CustomToolCall | ToolOutput
Instructions = Annotated[str, Field(min_length=1)] | list[UserPart]


class DecisionPredicate(_Open):
    """How likely a statement about the input is true."""

    type: Literal["predicate"]
    instructions: Instructions
    name: str | None = Field(None, description="Names the answer (unique in the request).")


class DecisionChoiceOption(_Open):
    value: str | bool = Field(description="Typed: a string and a boolean with the same text are two values.")
    description: str | None = None


class DecisionChoice(_Open):
    """One of the supplied options."""

    type: Literal["choice"]
    instructions: Instructions
    choices: list[DecisionChoiceOption] = Field(min_length=MIN_CHOICES, max_length=MAX_CHOICES)
    name: str | None = None


class DecisionLevel(_Open):
    label: str = Field(min_length=1)
    description: str | None = None


class DecisionScore(_Open):
    """A level on the supplied ordered levels, answered as the expected level index."""

    type: Literal["score"]
    instructions: Instructions
    levels: list[DecisionLevel] = Field(min_length=MIN_LEVELS)
    name: str | None = None


Question = Annotated[DecisionPredicate | DecisionChoice | DecisionScore, Field(discriminator="type")]


class CacheOptions(_Open):
    mode: Literal["implicit", "explicit"] | None = None
    ttl: Literal["30m"] | None = None


class DecisionsRequest(_Open):
    """Every question about one input; answers come back in question order."""

    model: str = Field(min_length=1, description="The served model's name or an alias.")
    input: str | Annotated[list[Item], Field(min_length=1)] = Field(
        description="Text, or messages (user, developer, system, assistant) and agent traffic (function and "
                    "custom tool calls, their outputs), read as one transcript.")
    questions: list[Question] = Field(min_length=1, max_length=MAX_QUESTIONS)
    prompt_cache_key: str | None = Field(None, description="Accepted; a canvas read has no prompt cache.")
    prompt_cache_options: CacheOptions | None = None
    safety_identifier: str | None = None


class PredicateAnswer(BaseModel):
    type: Literal["predicate"]
    name: str | None
    probability: float = Field(ge=0, le=1)


class ChoiceProbability(BaseModel):
    value: str | bool
    probability: float = Field(ge=0, le=1)


class ChoiceAnswer(BaseModel):
    type: Literal["choice"]
    name: str | None
    choice: str | bool
    confidence: float = Field(ge=0, le=1)
    probabilities: list[ChoiceProbability]


class ScoreProbability(BaseModel):
    label: str
    value: int = Field(ge=0, description="The level's index, from 0.")
    probability: float = Field(ge=0, le=1)


class ScoreAnswer(BaseModel):
    type: Literal["score"]
    name: str | None
    score: float = Field(ge=0, description="The expected level index (may fall between levels).")
    confidence: float = Field(ge=0, le=1)
    probabilities: list[ScoreProbability]


class RefusalAnswer(BaseModel):
    """Not answered: the escalation target refused it, or (`--refuse-unsure`) nothing answered it
    once the gate did not pass it. The other questions still have answers."""

    type: Literal["refusal"]
    name: str | None


Answer = Annotated[PredicateAnswer | ChoiceAnswer | ScoreAnswer | RefusalAnswer, Field(discriminator="type")]


class InputTokensDetails(BaseModel):
    cached_tokens: int
    cache_write_tokens: int


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int


class DecisionsUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class DecisionsResponse(BaseModel):
    """Each answer also carries a `canvasroute` object (path, cause, entropy, escalation model,
    a target's refusal, ...), and the response one more (decision id, canvas reads, ignored keys):
    the SDK keeps them as extras."""

    answers: list[Answer]
    model: str = Field(description="The served model that answered.")
    usage: DecisionsUsage


class DecisionsError(BaseModel):
    message: str
    type: str = Field(description="`invalid_request_error` below 500, `server_error` from 500.")
    param: str | None = Field(description="The field, in OpenAI's path form (`questions[3].choices`).")
    code: str | None = Field(description="A stable code (`missing_required_parameter`, `invalid_api_key`, "
                                         "`model_not_found`, `engine_timeout`, ...).")


class DecisionsErrorResponse(BaseModel):
    error: DecisionsError
