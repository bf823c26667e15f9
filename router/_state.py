"""The state as the model sees it: prompt text and its images.

How a state is rendered (`render_state`): a string as it is; a message or a list of
messages (langchain-core messages, or OpenAI-style message dicts) as a transcript, the text
the OpenAI Decisions wire (`canvasroute serve`, `/v1/decisions`) writes for the same
conversation; anything else as JSON, where the values JSON lacks are written as text.

The transcript: `speaker: text` per message, the speaker `human`, `ai`, `system`, `tool` or
`developer` (OpenAI's developer role: a `SystemMessage` marked `__openai_role__`, as
langchain-openai and `convert_to_messages` read it, a `ChatMessage(role="developer")`, a
`{"role": "developer"}` dict); a message's parts one line each (an image `[image N]`, N
counting the state's images, a refusal `[refusal] text`); an AI message's tool calls one line
each, `ai: [call NAME id=ID] ARGS` (a custom tool call `ai: [custom call NAME id=ID] INPUT`),
every call (without an id or sharing one too), in the order its content holds them, the
arguments exactly as sent where the message keeps them (a Responses API `function_call` block,
OpenAI chat `additional_kwargs["tool_calls"]`, a streamed chunk's `tool_call_chunks`; matched by
id and name, then position; else their JSON, as langchain-openai sends them back); calls whose
arguments did not parse as sent; a tool message names its call,
`tool: [NAME id=ID] text`. JSON's rules:

- `datetime`, `date`, `time` as ISO 8601; `timedelta`, `UUID`, `Decimal`, paths as `str()`;
- `bytes` as their UTF-8 text; an `Enum` as its value;
- `set` and `frozenset` as lists, sorted by their JSON (the same order in every process);
- dataclasses and pydantic models as their fields (`model_dump()`, then these rules);
  a message inside a state as `{"role", "content"}` (its speaker, as in a transcript, and
  its text), with an AI message's `tool_calls` (`name`, `id`, `args`; unparsed arguments as
  sent, after the others) and a tool message's `name` and `tool_call_id`;
- tuples as lists; a mapping key that is not a string, number, bool or None as text
  (a tuple key as its JSON);
- an image content block, anywhere, as `{"type": "image"}`: the image itself travels
  beside the text (`state_images`, `canvasroute.router._images`), never as base64 text;
- other values pydantic can serialize (`SecretStr`, URLs, IP addresses...) as it does.

A lone surrogate, which no UTF-8 text can carry, becomes U+FFFD. What has no text form
(an arbitrary object, bytes that are not UTF-8, a cycle, nesting deeper than
`MAX_DEPTH`) raises `DecisionError` naming where it is in the state, with a hint.

Images: a state can carry LangChain content blocks anywhere (in a message's content, a dict
message, or a value of its own). Accepted shapes, LangChain's standard and OpenAI's:

- `{"type": "image", "base64": ..., "mime_type": "image/png"}` (or `"url": ...`)
- `{"type": "image", "source_type": "base64", "data": ..., "mime_type": ...}` (v0.3)
- `{"type": "image_url", "image_url": {"url": "data:..." | "https://..."}}` (or a string)

They are sent as OpenAI image parts beside the state's text, with the same canvas; the
rendered text holds no image data, so images enter keys by digest (`image_digests`).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib
import json
import re
import uuid
from collections.abc import Mapping, Sequence
from decimal import Decimal
from enum import Enum
from pathlib import PurePath
from typing import Any

from langchain_core.messages import AIMessage, BaseMessage, ChatMessage, SystemMessage, ToolMessage, convert_to_messages

from canvasroute.engine import SPECIAL_CANDIDATES, DecisionError, ImagesUnsupported, defuse

__all__ = ["MAX_DEPTH", "as_message", "check_images", "image_digests", "image_url", "read_state",
           "render_state", "state_images", "wire_state"]

MAX_DEPTH = 64
"""Deepest nesting of containers a state may have."""

_SURROGATE = re.compile("[\ud800-\udfff]")
_HINT = ("a state is text, messages, or JSON-like values (dicts, lists, str, numbers, bool, None, and the "
         "types canvasroute.router._state lists); turn other values into one of those before deciding")


def render_state(state: Any, special_tokens: Sequence[str] | None = None) -> str:
    """The user message: a string as is, messages as a transcript, anything else as JSON
    (the rules in this module's docstring).

    Every special-token text of the engine's tokenizer (`EngineInfo.special_tokens`;
    default: the texts `engine` probes servers for) is defused with a zero-width space, so
    a state cannot close the turn or forge template tokens.
    """
    return defuse(read_state(state)[0], special_tokens or SPECIAL_CANDIDATES)


def state_images(state: Any) -> tuple[str, ...]:
    """The image URLs (data URLs for inline images) of every image content block in
    `state`, wherever it is (in a message, a dict message, or a value of its own), in order."""
    return read_state(state)[1]


def read_state(state: Any) -> tuple[str, tuple[str, ...]]:
    """The state's text (not yet defused: that depends on the engine's tokenizer) and its
    images, in one pass over the state."""
    if isinstance(state, str):
        return _text(state), ()
    if (messages := _messages(state)) is not None:
        return _transcript(messages)
    images: list[str] = []
    return _text(json.dumps(_Walk(images).plain(state, (), 0), ensure_ascii=False)), tuple(images)


def _transcript(messages: Sequence[BaseMessage]) -> tuple[str, tuple[str, ...]]:
    """Messages as their transcript and its images (`[image N]` is `images[N-1]`)."""
    images: list[str] = []
    return _text("\n".join(line for m in messages for line in _lines(m, images))), tuple(images)


def _text(text: str) -> str:
    """`text` with each lone surrogate as U+FFFD."""
    return text if text.isascii() else _SURROGATE.sub("\ufffd", text)


def as_message(value: Any) -> BaseMessage:
    """A message-like as a state's messages are read: an OpenAI-style message dict by `_from_dict`,
    anything else (a message, a `(role, text)` pair, a string) as `convert_to_messages` reads it.

    Raises:
        ValueError, TypeError, KeyError, NotImplementedError: `value` is not a message-like.
    """
    return _from_dict(value) if _message_dict(value) else convert_to_messages([value])[0]


def _messages(state: Any) -> Sequence[BaseMessage] | None:
    """The messages a state is (a message, or a non-empty sequence of messages and OpenAI-style
    message dicts, `{"role": "developer", "content": ...}`), or None."""
    if isinstance(state, BaseMessage):
        return (state,)
    if not (isinstance(state, Sequence) and not isinstance(state, str) and state):
        return None
    if all(isinstance(m, BaseMessage) for m in state):
        return state
    if all(isinstance(m, BaseMessage) or _message_dict(m) for m in state):
        try:
            return [m if isinstance(m, BaseMessage) else _from_dict(m) for m in state]
        except (ValueError, TypeError, KeyError, NotImplementedError):  # not messages after all: JSON
            return None
    return None


_ROLES = frozenset({"user", "human", "assistant", "ai", "system", "developer", "tool"})
_SPEAKERS = {"user": "human", "assistant": "ai", "developer": "developer"}
"""Who speaks a `ChatMessage` of a role (OpenAI's names to LangChain's; developer as itself)."""


def _message_dict(value: Any) -> bool:
    """Whether `value` is an OpenAI-style message dict (a known role, and content or tool calls)."""
    return (isinstance(value, Mapping) and value.get("role") in _ROLES
            and ("content" in value or "tool_calls" in value))


def _from_dict(value: Mapping[str, Any]) -> BaseMessage:
    """A message dict as langchain-core reads it (`developer` a `SystemMessage` marked as such); an
    assistant's tool calls as langchain-openai reads them (arguments that do not parse an invalid
    call), kept as sent in `additional_kwargs`, where OpenAI's chat messages hold them."""
    raw = value.get("tool_calls")
    if value.get("role") not in ("assistant", "ai") or not isinstance(raw, list):
        return convert_to_messages([{"content": "", **value}])[0]
    from langchain_core.exceptions import OutputParserException
    from langchain_core.output_parsers.openai_tools import make_invalid_tool_call, parse_tool_call

    calls, invalid = [], []
    for call in raw:
        try:
            calls.append(parse_tool_call(call, return_id=True))
        except OutputParserException as exc:
            invalid.append(make_invalid_tool_call(call, str(exc)))
    return AIMessage(content=value.get("content") or "", tool_calls=[c for c in calls if c is not None],
                     invalid_tool_calls=invalid, additional_kwargs={"tool_calls": raw})


def _speaker(message: BaseMessage) -> str:
    """Who speaks `message` in a transcript: its type (`human`, `ai`, `system`, `tool`), `developer`
    for OpenAI's developer role (a `SystemMessage` marked `__openai_role__`, or a `ChatMessage`)."""
    if isinstance(message, ChatMessage):
        return _SPEAKERS.get(message.role, message.role)
    if isinstance(message, SystemMessage) and message.additional_kwargs.get("__openai_role__") == "developer":
        return "developer"
    return message.type


def _content_text(message: BaseMessage, images: list[str]) -> str:
    """A message's text as the OpenAI Decisions wire writes its parts: one line each, text as it is,
    a refusal as `[refusal] text`, an image as `[image N]` (its URL appended to `images`, the
    state's images so far); other blocks (tool calls, reasoning) have no text."""
    if isinstance(message.content, str):
        return message.content
    parts = []
    for block in message.content:
        if isinstance(block, str):
            parts.append(block)
        elif not isinstance(block, Mapping):
            continue
        elif block.get("type") == "text" and isinstance(block.get("text"), str):
            refusal = isinstance(block.get("extras"), Mapping) and block["extras"].get("refusal")
            parts.append(f"[refusal] {block['text']}" if refusal else block["text"])
        elif block.get("type") == "refusal" and isinstance(block.get("refusal"), str):
            parts.append(f"[refusal] {block['refusal']}")
        elif (url := image_url(block)) is not None:
            images.append(url)
            parts.append(f"[image {len(images)}]")
    return "\n".join(parts)


def _lines(message: BaseMessage, images: list[str]) -> list[str]:
    """A message's transcript lines, as the OpenAI Decisions wire writes the same turn: `speaker:
    text` (`_speaker`, `_content_text`); an AI message's tool calls one line each after its text,
    if any (`_call_lines`); a tool message names its call (`tool: [NAME id=ID] text`)."""
    text = _content_text(message, images)
    if isinstance(message, ToolMessage):
        return [f"tool: [{message.name or 'tool'} id={message.tool_call_id}] {text}"]
    if not isinstance(message, AIMessage) or not (message.tool_calls or message.invalid_tool_calls):
        return [f"{_speaker(message)}: {text}"]
    return [*([f"ai: {text}"] if text else []), *_call_lines(message)]


_Sent = tuple[str, Any, Any, str]
"""A tool call as sent: its kind (`function_call`, `custom_tool_call`), id, name and arguments."""


def _call_lines(message: AIMessage) -> list[str]:
    """Every tool call of `message`, one line each: `ai: [call NAME id=ID] ARGS` (a custom tool call
    `ai: [custom call NAME id=ID] INPUT`). A call's arguments are those sent (`_sent_calls`) for the
    first call not yet matched with the same id (None included) and name, so calls without an id or
    sharing one keep their own, by position; else an invalid call's text, or a valid call's JSON.
    The calls matched are in the order sent (a message's content order, the wire's), then the rest."""
    sent = _sent_calls(message)
    taken = [False] * len(sent)
    placed: list[tuple[int, str]] = []
    calls = [*((c, False) for c in message.tool_calls), *((c, True) for c in message.invalid_tool_calls)]
    for k, (call, invalid) in enumerate(calls):
        j = next((j for j, (_, i, name, _) in enumerate(sent)
                  if not taken[j] and i == call["id"] and _same_tool(name, call["name"])), None)
        if j is not None:
            taken[j] = True
        placed.append((len(sent) + k if j is None else j, _call_line(call, invalid, None if j is None else sent[j])))
    return [line for _, line in sorted(placed, key=lambda p: p[0])]


def _call_line(call: Any, invalid: bool, sent: _Sent | None) -> str:
    """One call's line: its arguments as sent, else an invalid call's text or a valid call's JSON."""
    if sent is not None:
        kind, args = sent[0], sent[3]
    elif invalid:
        kind, args = "function_call", call["args"]
    else:
        kind, args = "function_call", json.dumps(_Walk(None).plain(call["args"], (), 0), ensure_ascii=False)
    custom = "custom " if kind == "custom_tool_call" else ""
    return f"ai: [{custom}call {call['name']} id={call['id']}] {args}"


def _same_tool(sent: Any, name: Any) -> bool:
    """Whether a call sent as `sent` (None: unnamed) is the call named `name` (`namespace.name` too)."""
    return sent is None or sent == name or (isinstance(name, str) and name.endswith(f".{sent}"))


def _sent_calls(message: AIMessage) -> list[_Sent]:
    """The message's tool calls as sent, in order, from the first of these the message keeps:
    Responses API `function_call` / `custom_tool_call` blocks in its content, OpenAI's chat
    `additional_kwargs["tool_calls"]`, a streamed chunk's `tool_call_chunks`."""
    content = message.content if isinstance(message.content, list) else []
    if blocks := [sent for b in content if (sent := _sent_block(b)) is not None]:
        return blocks
    raw = message.additional_kwargs.get("tool_calls")
    calls = [c for c in raw if isinstance(c, Mapping)] if isinstance(raw, list) else []
    if chat := [("function_call", c.get("id"), f.get("name"), f["arguments"]) for c in calls
                if isinstance(f := c.get("function"), Mapping) and isinstance(f.get("arguments"), str)]:
        return chat
    return [("function_call", c.get("id"), c.get("name"), c["args"])
            for c in getattr(message, "tool_call_chunks", None) or () if isinstance(c.get("args"), str)]


def _sent_block(block: Any) -> _Sent | None:
    """A Responses API call content block as sent; None for any other block."""
    if not isinstance(block, Mapping):
        return None
    if block.get("type") == "function_call" and isinstance(block.get("arguments"), str):
        return "function_call", block.get("call_id"), block.get("name"), block["arguments"]
    if block.get("type") == "custom_tool_call" and isinstance(block.get("input"), str):
        return "custom_tool_call", block.get("call_id"), block.get("name"), block["input"]
    return None


def wire_state(state: Any) -> tuple[Any, tuple[str, ...]]:
    """`state` for a wire that carries JSON with image blocks in it, and images beside it
    (`/v1/systemone`'s `state` and `images`), so the server reads what a local read would: a
    string as is; messages as their transcript, their images beside it; anything else as
    JSON-able values by the rules above, image blocks kept where they are, and the images of
    messages inside it (whose content becomes their text) beside it."""
    if isinstance(state, str):
        return state, ()
    if (messages := _messages(state)) is not None:
        return _transcript(messages)
    beside: list[str] = []
    return _Walk(None, beside).plain(state, (), 0), tuple(beside)


class _Walk:
    """One pass over a state: JSON-able values out; image blocks collected into `images`
    and replaced by `{"type": "image"}` (None: kept as they are, and a message's images,
    which its text has no place for, collected into `beside`)."""

    __slots__ = ("active", "beside", "images")

    def __init__(self, images: list[str] | None, beside: list[str] | None = None) -> None:
        self.images, self.beside = images, beside
        self.active: set[int] = set()  # containers on the current path (a repeat is a cycle)

    def plain(self, value: Any, where: Where, depth: int) -> Any:
        kind = type(value)
        if kind in _SCALARS:
            return value
        if depth >= MAX_DEPTH:
            raise DecisionError(f"the state nests deeper than {MAX_DEPTH} levels at {_at(where)}", hint=_HINT)
        if kind is dict or kind is list:  # the common containers, without the general dispatch
            return self._enter(value, where, depth + 1, self._dict if kind is dict else self._list)
        if isinstance(value, Enum):
            return self.plain(value.value, where, depth)
        if isinstance(value, (str, int, float)):
            return value
        if isinstance(value, BaseMessage):
            self._message_images(value)
            return self._message(value, where, depth)
        leaf = _leaf(value, where)
        if leaf is not _CONTAINER:
            return leaf
        return self._enter(value, where, depth + 1, self._container)

    def _enter(self, value: Any, where: Where, depth: int, walk: Any) -> Any:
        if id(value) in self.active:
            raise DecisionError(f"the state holds a cycle at {_at(where)}", hint=_HINT)
        self.active.add(id(value))
        try:
            return walk(value, where, depth)
        finally:
            self.active.discard(id(value))

    def _dict(self, value: Mapping[Any, Any], where: Where, depth: int) -> Any:
        if "type" in value and self.images is not None and (url := image_url(value)) is not None:
            self.images.append(url)
            return {"type": "image"}
        return {k if type(k) in _SCALARS else self._key(k, where, depth):
                v if type(v) in _SCALARS else self.plain(v, (where, (k,)), depth) for k, v in value.items()}

    def _list(self, value: Sequence[Any], where: Where, depth: int) -> list[Any]:
        return [v if type(v) in _SCALARS else self.plain(v, (where, i), depth) for i, v in enumerate(value)]

    def _container(self, value: Any, where: Where, depth: int) -> Any:
        if isinstance(value, Mapping):
            return self._dict(value, where, depth)
        if isinstance(value, (set, frozenset)):
            items = [self.plain(v, (where, " (in a set)"), depth) for v in value]
            return sorted(items, key=lambda v: json.dumps(v, sort_keys=True, ensure_ascii=False))
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            return {f.name: self.plain(getattr(value, f.name), (where, f".{f.name}"), depth)
                    for f in dataclasses.fields(value)}
        if hasattr(value, "model_dump") and callable(value.model_dump):  # pydantic models
            try:
                dumped = value.model_dump()
            except Exception as exc:  # a serializer of the model's own
                raise DecisionError(f"{_at(where)}: {type(value).__name__}.model_dump() failed: {exc}",
                                    hint=_HINT) from exc
            return self.plain(dumped, where, depth)
        return self._list(value, where, depth)

    def _key(self, key: Any, where: Where, depth: int) -> Any:
        if isinstance(key, Enum):
            key = key.value
        if key is None or isinstance(key, (str, int, float)):
            return key
        text = self.plain(key, (where, " (a key)"), depth)
        return text if isinstance(text, str) else json.dumps(text, sort_keys=True, ensure_ascii=False)

    def _message(self, message: BaseMessage, where: Where, depth: int) -> dict[str, Any]:
        """`{"role", "content"}` (its text), an AI message's tool calls and a tool message's call beside."""
        out: dict[str, Any] = {"role": _speaker(message), "content": message.text}
        if isinstance(message, AIMessage) and (message.tool_calls or message.invalid_tool_calls):
            out["tool_calls"] = [*({"name": c["name"], "id": c["id"],
                                    "args": self.plain(c["args"], (where, ".tool_calls"), depth)}
                                   for c in message.tool_calls),
                                 *({"name": c["name"], "id": c["id"], "args": c["args"]}
                                   for c in message.invalid_tool_calls)]  # arguments that did not parse, as sent
        elif isinstance(message, ToolMessage):
            out |= {"name": message.name, "tool_call_id": message.tool_call_id}
        return out

    def _message_images(self, message: BaseMessage) -> None:
        into = self.images if self.images is not None else self.beside
        if into is not None and isinstance(message.content, list):
            for block in message.content:
                if isinstance(block, Mapping) and (url := image_url(block)) is not None:
                    into.append(url)


_CONTAINER = object()
_SCALARS = frozenset((str, int, float, bool, type(None)))
Where = tuple[Any, ...]
"""Where a value sits: () for the state, (parent, step) below it, a step being a list index,
a 1-tuple holding a mapping key, or text (formatted only for an error)."""


def _at(where: Where) -> str:
    steps: list[str] = []
    while where:
        where, step = where
        steps.append(f"[{step}]" if isinstance(step, int) else f"[{step[0]!r}]" if isinstance(step, tuple) else step)
    return "state" + "".join(reversed(steps))


def _leaf(value: Any, where: Where) -> Any:
    """The text form of a value JSON lacks, or `_CONTAINER` for the values walked into."""
    if isinstance(value, (dt.datetime, dt.date, dt.time)):
        return value.isoformat()
    if isinstance(value, (dt.timedelta, uuid.UUID, Decimal, PurePath)):
        return str(value)
    if isinstance(value, (bytes, bytearray, memoryview)):
        try:
            return bytes(value).decode()
        except UnicodeDecodeError:
            raise DecisionError(f"{_at(where)} holds bytes that are not UTF-8 text",
                                hint="decode them yourself, or pass an image as a content block "
                                     "({'type': 'image', 'base64': ..., 'mime_type': ...})") from None
    if isinstance(value, (Mapping, set, frozenset, list, tuple)) or hasattr(value, "model_dump") or (
            dataclasses.is_dataclass(value) and not isinstance(value, type)):
        return _CONTAINER
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        return _CONTAINER
    try:  # what pydantic can serialize (SecretStr, URLs, IP addresses, ...)
        from pydantic_core import to_jsonable_python

        out = to_jsonable_python(value)
    except Exception:  # noqa: BLE001 - pydantic has no text form for it either
        raise DecisionError(f"{_at(where)} is a {type(value).__name__}, which has no text form", hint=_HINT) from None
    if out is None or isinstance(out, (str, int, float)):
        return out
    raise DecisionError(f"{_at(where)} is a {type(value).__name__}, which has no text form", hint=_HINT)


# -- images ------------------------------------------------------------------------------


def image_digests(images: Sequence[str]) -> tuple[str, ...]:
    """A short SHA-256 per image, for keys and spans (never the image itself)."""
    return tuple(hashlib.sha256(url.encode()).hexdigest()[:16] for url in images)


def image_url(block: Mapping[str, Any]) -> str | None:
    """The URL (a data URL for inline data) of an image content block; None for any other
    mapping; `DecisionError` for an image block without a usable source."""
    kind = block.get("type")
    if kind == "image_url":
        inner = block.get("image_url")
        url = inner.get("url") if isinstance(inner, Mapping) else inner
        if not isinstance(url, str) or not url:
            raise DecisionError(f"an image_url block without a url: {str(block)[:120]}")
        return url
    if kind != "image":
        return None
    data = block.get("base64") or (block.get("data") if block.get("source_type") == "base64" else None)
    if data:
        mime = block.get("mime_type")
        if not isinstance(mime, str) or not mime.startswith("image/"):
            raise DecisionError(f"an inline image block needs mime_type 'image/...', got {mime!r}")
        return f"data:{mime};base64,{data}"
    url = block.get("url") or (block.get("data") if block.get("source_type") == "url" else None)
    if isinstance(url, str) and url:
        return url
    raise DecisionError("an image block needs base64 (with mime_type) or url",
                        hint="images in a state are LangChain content blocks, e.g. "
                             "{'type': 'image', 'base64': ..., 'mime_type': 'image/png'}")


def check_images(info: Any, images: Sequence[str]) -> None:
    """Refuse a state with images before any read when the engine cannot take them."""
    if images and not getattr(info, "accepts_images", False):
        raise ImagesUnsupported(
            f"the state holds {len(images)} image(s) and engine {info.model!r} ({info.provider}) cannot take images",
            hint="read images with VLLMServerEngine (endpoint='chat') on a vision-capable vLLM server; the "
                 "completions endpoint and in-process causal LMs read text only")
