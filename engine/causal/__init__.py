"""A causal LM on an OpenAI-compatible server, read at each slot (`CausalServerEngine`).

The server-side twin of `TransformersEngine`'s causal readout: one `/v1/completions` request
per read batch, exact label logprobs per slot (`_server.py`). `server_kind` tells which engine a
server needs: DiffusionGemma's structured read (`VLLMServerEngine`) or a causal LM (this one).
"""

from ._server import CausalServerEngine, Readout, ServerKind, server_kind

__all__ = ["CausalServerEngine", "Readout", "ServerKind", "server_kind"]
