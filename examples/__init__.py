"""Runnable example scripts: LangGraph graphs whose branches are canvas-read decisions.

- `examples.triage`: support-ticket triage (the graph `canvasroute demo` runs, from
  `canvasroute.apps.demo.triage`).
- `examples.rag_relevance`: grade every retrieved document in one read.
- `examples.tool_routing`: pick a tool for the user's message.
- `examples.adaptive_rag`: LangGraph's Adaptive RAG tutorial, its router and graders as decisions.
- `examples.supervisor`: LangGraph's multi-agent supervisor tutorial, its pick of a worker as a decision.

Run one from the repository root: `python -m examples.triage [vLLM URL]`. Each module has
`build_graph(model)` and `main(engine_url=None)`. Without a URL they run on the embedded
CPU model (SmolLM2-135M, near-chance decisions: it shows the plumbing, not accuracy).
These scripts live in the repository only; they are not part of the installed package.
"""

from canvasroute.apps.demo.model import EMBEDDED_NOTE, make_model

__all__ = ["EMBEDDED_NOTE", "make_model"]
