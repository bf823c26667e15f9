"""`input`: text, or items (messages, tool calls and their outputs) read into langchain-core messages,
a transcript and the images, each tool output matched to its call.

The transcript and the images are the library's for the messages (`canvasroute.router._state`:
`read_state(messages)`): `speaker: text` per message (`human`, `ai`, `system`, `developer`), a
message's parts one line each (`[image N]` for an image, `[refusal] text`), each call on a line of
its own with its arguments exactly as sent, each output naming its call. The messages keep each
call as sent (a `function_call` / `custom_tool_call` content block, as langchain-openai keeps a
Responses API call), so the library writes them as sent, in order."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, SystemMessage, ToolMessage

from canvasroute.router import read_state

from ._fields import Path, array, fail, mapping, missing, one_of, optional, param_of, required, string

__all__ = ["MAX_JSON_BYTES", "MAX_JSON_DEPTH", "MAX_JSON_VALUES", "image", "image_block", "json_text", "read_input"]

MAX_JSON_DEPTH, MAX_JSON_VALUES, MAX_JSON_BYTES = 32, 10_000, 256 * 1024
"""An `input_json` part's bounds (the SDK: 32 container levels, 10,000 values, 256 KiB compact UTF-8)."""

_DATA_URL = re.compile(r"data:(image/[A-Za-z0-9.+-]+);base64,([A-Za-z0-9+/]+=*)\Z")
_DETAILS = ("low", "high", "auto", "original")
_STATUSES = ("in_progress", "completed", "incomplete")
_PART_TYPES = {"user": ("input_text", "input_image", "input_json"), "developer": ("input_text",),
               "system": ("input_text",), "assistant": ("output_text", "refusal")}
_OUTPUT_PART_TYPES = ("input_text", "input_image")
_ITEM_TYPES = ("message", "function_call", "function_call_output", "custom_tool_call", "custom_tool_call_output")


def read_input(value: Any, ignored: list[str]) -> tuple[str | tuple[BaseMessage, ...], str, tuple[str, ...]]:
    """The state (text, or messages), its transcript and its images; fields not read go to `ignored`."""
    return _Input(ignored).read(value)


class _Input:
    """One pass over `input`: the messages, calls matched to outputs; then their transcript and images."""

    def __init__(self, ignored: list[str]) -> None:
        self.ignored = ignored
        self.messages: list[BaseMessage] = []
        self.calls: dict[str, tuple[str, str]] = {}  # call_id -> (item type, tool name)

    def read(self, value: Any) -> tuple[str | tuple[BaseMessage, ...], str, tuple[str, ...]]:
        if isinstance(value, str):
            return value, value, ()
        items = array(value, ("input",))
        if not items:
            fail(("input",), "expected text or at least one item.", "empty_array")
        for i, raw in enumerate(items):
            self.item(mapping(raw, ("input", i)), ("input", i))
        return (tuple(self.messages), *read_state(self.messages))

    def item(self, item: Mapping[str, Any], path: Path) -> None:
        kind = item.get("type", "message" if "role" in item else None)
        if kind is None:
            missing((*path, "type"))
        kind = one_of(kind, _ITEM_TYPES, (*path, "type"))
        known = {"message": ("type", "role", "content", "phase"),
                 "function_call": ("type", "call_id", "name", "arguments", "id", "namespace", "status"),
                 "custom_tool_call": ("type", "call_id", "name", "input", "id", "namespace", "status")
                 }.get(kind, ("type", "call_id", "output", "id", "status"))
        self.ignored += [param_of((*path, k)) for k in item if k not in known]
        if kind != "message":
            optional(item, "status", _STATUSES, path)
        if kind == "message":
            self.message(item, path)
        elif kind in ("function_call", "custom_tool_call"):
            self.call(kind, item, path)
        else:
            self.output(kind, item, path)

    def message(self, item: Mapping[str, Any], path: Path) -> None:
        role = one_of(required(item, "role", path), tuple(_PART_TYPES), (*path, "role"))
        phase = optional(item, "phase", ("commentary", "final_answer"), path) if role == "assistant" else None
        content = self.content(required(item, "content", path), _PART_TYPES[role], (*path, "content"))
        if role == "user":
            self.messages.append(HumanMessage(content=content))
        elif role in ("system", "developer"):
            extra = {"__openai_role__": "developer"} if role == "developer" else {}
            self.messages.append(SystemMessage(content=content, additional_kwargs=extra))
        else:
            self.messages.append(AIMessage(content=content, additional_kwargs={"phase": phase} if phase else {}))

    def call(self, kind: str, item: Mapping[str, Any], path: Path) -> None:
        call_id = string(required(item, "call_id", path), (*path, "call_id"), empty=False)
        name = string(required(item, "name", path), (*path, "name"), empty=False)
        for key in ("id", "namespace"):
            if item.get(key) is not None:
                string(item[key], (*path, key))
        if call_id in self.calls:
            fail((*path, "call_id"), f"call id {call_id!r} is used by an earlier call.", "duplicate_value")
        tool = f"{item['namespace']}.{name}" if item.get("namespace") else name
        self.calls[call_id] = (kind, tool)
        if kind == "function_call":
            arguments = string(required(item, "arguments", path), (*path, "arguments"))
            call = _tool_call(tool, arguments, call_id)
            block = {"type": "function_call", "call_id": call_id, "name": name, "arguments": arguments}
        else:
            given = string(required(item, "input", path), (*path, "input"))
            call = {"type": "tool_call", "name": tool, "args": {"__arg1": given}, "id": call_id}
            block = {"type": "custom_tool_call", "call_id": call_id, "name": name, "input": given}
        last = self.messages[-1] if self.messages else None
        if not isinstance(last, AIMessage):  # calls right after an assistant turn belong to it (one AIMessage)
            last = AIMessage(content=[])
            self.messages.append(last)
        valid = call["type"] == "tool_call"
        calls = [*(last.tool_calls if valid else last.invalid_tool_calls), call]
        # the call as sent, in content order, as langchain-openai keeps a Responses API call
        content = last.content if isinstance(last.content, list) else (
            [{"type": "text", "text": last.content}] if last.content else [])
        self.messages[-1] = last.model_copy(update={"tool_calls" if valid else "invalid_tool_calls": calls,
                                                    "content": [*content, block]})

    def output(self, kind: str, item: Mapping[str, Any], path: Path) -> None:
        call_id = string(required(item, "call_id", path), (*path, "call_id"), empty=False)
        wanted = kind.removesuffix("_output")
        got = self.calls.get(call_id)
        if got is None:
            fail((*path, "call_id"), f"no earlier {wanted} has call id {call_id!r}.", "unknown_call_id")
        if got[0] != wanted:
            fail((*path, "call_id"), f"call id {call_id!r} is a {got[0]}, not a {wanted}.", "unknown_call_id")
        blocks = self.content(required(item, "output", path), _OUTPUT_PART_TYPES, (*path, "output"))
        extra = {"type": kind} if kind == "custom_tool_call_output" else {}
        self.messages.append(ToolMessage(content=blocks, tool_call_id=call_id, name=got[1], additional_kwargs=extra))

    def content(self, value: Any, allowed: Sequence[str], path: Path) -> str | list[Any]:
        """Content as langchain blocks (text as is)."""
        if isinstance(value, str):
            return value
        parts = array(value, path)
        blocks: list[Any] = []
        for i, raw in enumerate(parts):
            where = (*path, i)
            part = mapping(raw, where)
            kind = one_of(required(part, "type", where), allowed, (*where, "type"))
            if kind in ("input_text", "output_text"):
                text = string(required(part, "text", where), (*where, "text"))
                blocks.append({"type": "text", "text": text})
            elif kind == "refusal":
                text = string(required(part, "refusal", where), (*where, "refusal"))
                blocks.append({"type": "text", "text": text, "extras": {"refusal": True}})
            elif kind == "input_json":
                blocks.append({"type": "text", "text": json_text(required(part, "data", where), (*where, "data"))})
            else:
                blocks.append(image_block(image(part, where)))
            self.ignored += [param_of((*where, k)) for k in part if k not in _PART_KEYS[kind]]
        return blocks


_PART_KEYS = {"input_text": ("type", "text", "prompt_cache_breakpoint"), "output_text": ("type", "text", "annotations"),
              "refusal": ("type", "refusal"), "input_json": ("type", "data"),
              "input_image": ("type", "image_url", "detail", "prompt_cache_breakpoint")}


def _tool_call(name: str, arguments: str, call_id: str) -> dict[str, Any]:
    """A function call as LangChain holds it: JSON-object arguments as `args`, else an invalid tool call."""
    try:
        args = json.loads(arguments) if arguments.strip() else {}
    except ValueError as exc:
        return {"type": "invalid_tool_call", "name": name, "args": arguments, "id": call_id, "error": str(exc)}
    if not isinstance(args, dict):
        return {"type": "invalid_tool_call", "name": name, "args": arguments, "id": call_id,
                "error": "arguments are not a JSON object"}
    return {"type": "tool_call", "name": name, "args": args, "id": call_id}


def image(part: Mapping[str, Any], path: Path) -> str:
    url = string(required(part, "image_url", path), (*path, "image_url"), empty=False)
    optional(part, "detail", _DETAILS, path)
    if url.startswith("data:"):
        if not _DATA_URL.match(url):
            fail((*path, "image_url"), "a data URL must be 'data:image/<type>;base64,<data>'.")
    elif not url.startswith(("http://", "https://")):
        fail((*path, "image_url"), "expected a base64 data URL or an http(s) URL (file IDs are not supported).")
    return url


def image_block(url: str) -> dict[str, Any]:
    """A standard langchain-core image block: inline data as base64 with its mime type, else the URL."""
    if m := _DATA_URL.match(url):
        return {"type": "image", "base64": m.group(2), "mime_type": m.group(1)}
    return {"type": "image", "url": url}


def json_text(data: Any, path: Path) -> str:
    """An `input_json` part's data as compact JSON text, within its bounds."""
    if not (isinstance(data, dict) or (isinstance(data, list) and all(isinstance(d, dict) for d in data))):
        fail(path, "expected a JSON object or an array of objects.", "invalid_type")
    values, stack = 0, [(data, 1)]
    while stack:
        value, depth = stack.pop()
        values += 1
        if isinstance(value, (dict, list)):
            if depth > MAX_JSON_DEPTH:
                fail(path, f"nested deeper than {MAX_JSON_DEPTH} container levels.")
            stack.extend((v, depth + 1) for v in (value.values() if isinstance(value, dict) else value))
        elif isinstance(value, float) and not math.isfinite(value):
            fail(path, "NaN and Infinity are not JSON numbers.")
    if values > MAX_JSON_VALUES:
        fail(path, f"over {MAX_JSON_VALUES} values.")
    text = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    if len(text.encode()) > MAX_JSON_BYTES:
        fail(path, f"over {MAX_JSON_BYTES // 1024} KiB of compact JSON.")
    return text

