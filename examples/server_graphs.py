"""The example graphs as LangGraph Server serves them (`langgraph.json` at the repository root).

```
langgraph dev --no-browser --no-reload            # local server on :2024, in-memory persistence
langgraph up                                      # Docker image with PostgreSQL persistence
```

Importing this module is cheap: the engine is built on the first decision, not at import
(LangGraph Server warns when a graph import takes over 3 s, and the embedded model takes
~20 s to load). Which engine, from the environment:

- `CANVASROUTE_ENGINE_URL=http://...` (or `CANVASROUTE_ENGINE=vllm` with it): DiffusionGemma on vLLM.
- `CANVASROUTE_ENGINE=embedded` (the default without a URL): SmolLM2-135M on CPU,
  near-chance decisions (plumbing only).
- `CANVASROUTE_ENGINE=function`: a deterministic `FunctionEngine` (tests and smoke
  checks of a deployment: no model at all). Its rows are a hash of the prompt; a state
  containing `[unsure]` gets flat rows, so the review lane opens.

Graphs: `triage`, `triage_review` (unsure answers go to a person through `interrupt()`;
resume with `Command(resume={question_id: option})`), `rag_relevance`, `tool_routing`.
The server supplies the checkpointer (in-memory for `langgraph dev`, PostgreSQL for
`langgraph up` / LangGraph Platform).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
from collections.abc import Sequence
from typing import Any

from langgraph.graph import END, START, StateGraph

from canvasroute import CanvasDecisionModel, GatePolicy, ReviewPolicy, decision_node
from canvasroute.apps.demo import triage as _triage

from . import rag_relevance as _rag
from . import tool_routing as _tools

__all__ = ["LazyEngine", "make_engine", "make_function_engine", "rag_relevance", "tool_routing", "triage",
           "triage_review"]

UNSURE = "[unsure]"


def make_engine() -> Any:
    """The engine named by `CANVASROUTE_ENGINE` / `CANVASROUTE_ENGINE_URL` (built now)."""
    kind = os.environ.get("CANVASROUTE_ENGINE", "").lower()
    url = os.environ.get("CANVASROUTE_ENGINE_URL")
    if kind == "function":
        return make_function_engine()
    if url and kind in ("", "vllm"):
        from canvasroute import VLLMServerEngine

        return VLLMServerEngine([u.strip() for u in url.split(",") if u.strip()])
    if kind in ("", "embedded"):
        from canvasroute import embedded_engine

        return embedded_engine()
    raise ValueError(f"CANVASROUTE_ENGINE={kind!r}: use embedded, vllm (with CANVASROUTE_ENGINE_URL) or function")


class LazyEngine:
    """An `canvasroute.engine.Engine` that builds the real one on first use (`make_engine` by default)."""

    def __init__(self, factory: Any = make_engine) -> None:
        self._factory = factory
        self._engine: Any = None
        self._lock = asyncio.Lock()

    def __repr__(self) -> str:
        return f"LazyEngine({self._engine!r})" if self._engine is not None else "LazyEngine(<not built>)"

    async def _get(self) -> Any:
        if self._engine is None:
            async with self._lock:
                if self._engine is None:
                    self._engine = await asyncio.to_thread(self._factory)  # model loads off the event loop
        return self._engine

    async def info(self) -> Any:
        return await (await self._get()).info()

    async def tokenize(self, text: str) -> list[int]:
        return await (await self._get()).tokenize(text)

    async def count_prompt(self, messages: Sequence[Any]) -> int:
        return await (await self._get()).count_prompt(messages)

    async def read(self, batch: Sequence[Any]) -> list[Any]:
        return await (await self._get()).read(batch)

    async def aclose(self) -> None:
        if self._engine is not None:
            await self._engine.aclose()


def make_function_engine() -> Any:
    """The deterministic `FunctionEngine` of `CANVASROUTE_ENGINE=function` (no model).

    Per slot, the labels are ranked by a hash of (prompt, slot) and 3 nats apart, so the
    same prompt always gives the same confident answers; `[unsure]` gives flat rows.
    """
    from canvasroute import FunctionEngine

    def rows(read: Any) -> list[dict[int, float]]:
        prompt = "".join(m["content"] for m in read.messages)
        if UNSURE in prompt:
            return [dict.fromkeys(read.label_ids, -1.0) for _ in read.slots]
        out = []
        for k in range(len(read.slots)):  # rank the labels by a hash of (prompt, slot): 3 nats apart
            ranked = sorted(read.label_ids, key=lambda lid: hashlib.sha256(f"{prompt}|{k}|{lid}".encode()).digest())
            out.append({lid: -0.01 - 3.0 * rank for rank, lid in enumerate(ranked)})
        return out

    return FunctionEngine(rows, model="canvasroute-function")


MODEL = CanvasDecisionModel(engine=LazyEngine(), policy=GatePolicy(max_normalized_entropy=0.5))
"""One decision model (one engine) shared by every served graph."""


def _triage_review() -> Any:
    lanes = [*_triage.TEAMS, "on_call"]
    node = decision_node(MODEL, _triage.QUESTIONS, inputs="ticket", route=_triage.route, destinations=lanes,
                         review=ReviewPolicy())
    builder = StateGraph(_triage.TicketState)
    builder.add_node("triage", node)
    builder.add_edge(START, "triage")
    for lane in lanes:
        builder.add_node(lane, _triage._handler(lane))
        builder.add_edge(lane, END)
    return builder.compile(name="triage_review")


triage = _triage.build_graph(MODEL)
triage_review = _triage_review()
rag_relevance = _rag.build_graph(MODEL)
tool_routing = _tools.build_graph(MODEL)
