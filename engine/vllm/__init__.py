"""vLLM engines: the server over HTTP (`VLLMServerEngine`) and vLLM in-process (`VLLMEngine`).

Both speak vLLM's structured-read wire, which `_server.py` holds with the server engine's
prompt cache and thoughts; `VLLMEngine` (`_inprocess.py`) imports vLLM only when it starts.
"""

from ._inprocess import VLLMEngine
from ._server import MAX_LABEL_IDS, VLLMServerEngine, session_key

__all__ = ["MAX_LABEL_IDS", "VLLMEngine", "VLLMServerEngine", "session_key"]
