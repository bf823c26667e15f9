"""Test doubles for canvasroute's engines, shared by the tests and the bench.

- `FunctionEngine`: an engine whose rows come from a function you write.
- `LoopbackVLLM`: the one fake of vLLM's structured-read wire (discovery, `/tokenize`
  with a DiffusionGemma-shaped chat template, chat and completions reads), over a real
  socket, in its own process (`spawn`), or with no socket (`LoopbackVLLM().transport()`).
  `Fault` injects faults into its reads.
- `FailingPaths`, `SleepingTransport`: HTTP faults in front of any server (a real vLLM too).

Example:
    ```python
    server = LoopbackVLLM(answer="argmax")               # rows without the label ids
    engine = VLLMServerEngine(Connection("http://vllm.test", transport=server.transport()))
    ```
"""

from .._function import FunctionEngine
from ._faults import FailingPaths, SleepingTransport
from ._loopback import Fault, LoopbackVLLM, read_response
from ._process import LoopbackProcess, spawn
from ._tokens import SPECIAL_IDS, chat_text, token_id, tokenize

__all__ = [
    "SPECIAL_IDS",
    "FailingPaths",
    "Fault",
    "FunctionEngine",
    "LoopbackProcess",
    "LoopbackVLLM",
    "SleepingTransport",
    "chat_text",
    "read_response",
    "spawn",
    "token_id",
    "tokenize",
]
