"""Guided decoding for the AR test server: a JSON schema whose properties are string enums.

`response_format={"type": "json_schema", ...}` (what `ChatOpenAI.with_structured_output`
sends) over an object of `enum` properties is answered the way a guided-decoding server
(vLLM's `guided_choice` / JSON schema) would: the object is written property by property,
and each value is the option the model gives the highest total log-probability after the
text so far. Other schemas are refused (400), never answered unconstrained.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["enum_fields", "guided_tokens"]


def enum_fields(response_format: Any) -> list[tuple[str, list[str]]] | None:
    """The (property, options) of a `json_schema` response format over string enums, in the
    schema's order; None when there is no such response format (ValueError: another schema)."""
    if not isinstance(response_format, Mapping) or response_format.get("type") != "json_schema":
        return None
    schema = (response_format.get("json_schema") or {}).get("schema") or {}
    properties = schema.get("properties") if schema.get("type") == "object" else None
    if not isinstance(properties, Mapping) or not properties:
        raise ValueError("this test server guides only JSON schemas of an object with enum properties")
    fields = []
    for key, prop in properties.items():
        options = prop.get("enum") if isinstance(prop, Mapping) else None
        if not (isinstance(options, list) and options and all(isinstance(o, str) for o in options)):
            raise ValueError(f"property {key!r} is not a string enum")
        fields.append((str(key), options))
    return fields


def guided_tokens(model: Any, tokenizer: Any, prompt_ids: Any,
                  fields: Sequence[tuple[str, list[str]]]) -> tuple[list[int], list[Any]]:
    """The JSON object the model answers within `fields` (per property, the best-scored
    option), as token ids with the logits row that predicted each one. The prompt is
    prefilled once; options are scored on its KV cache."""
    import torch

    ids: list[int] = []
    rows: list[Any] = []
    with torch.inference_mode():
        out = model(prompt_ids, use_cache=True)
        cache, last = out.cache, out.logits[0, -1]

        def feed(tokens: list[int]) -> None:  # commit tokens: extend the cache, keep the rows predicting them
            nonlocal last
            logits = model(torch.tensor([tokens]), cache=cache, use_cache=True).logits[0]
            ids.extend(tokens)
            rows.extend([last.unsqueeze(0), *(row.unsqueeze(0) for row in logits[:-1])])
            last = logits[-1]

        def score(tokens: list[int]) -> float:  # total logprob of tokens after the committed text
            total = float(torch.log_softmax(last.float(), dim=-1)[tokens[0]])
            if len(tokens) > 1:
                logits = model(torch.tensor([tokens[:-1]]), cache=cache, use_cache=True).logits[0]
                logprobs = torch.log_softmax(logits.float(), dim=-1)
                total += sum(float(logprobs[i, t]) for i, t in enumerate(tokens[1:]))
                cache.crop(-(len(tokens) - 1))  # back to the committed text
            return total

        def encode(text: str) -> list[int]:
            return list(tokenizer(text, add_special_tokens=False)["input_ids"])

        for i, (key, options) in enumerate(fields):
            feed(encode(("{" if i == 0 else ", ") + json.dumps(key) + ": "))
            end = "}" if i == len(fields) - 1 else ""
            feed(max((encode(json.dumps(o) + end) for o in options), key=score))
        rows.append(last.unsqueeze(0))  # the end of the answer
    return [*ids, tokenizer.eos_token_id], rows
