"""The escalation target of `canvasroute eval` (and `calibrate`): from command-line options.

- `--escalate-url URL --escalate-model NAME`: any OpenAI-compatible chat server
  (`langchain_openai.ChatOpenAI`; key from `--escalate-api-key-env`).
- `--escalate-systemone URL`: a decision model behind `/v1/systemone`.
- `--escalate-causal URL`: a causal model on an OpenAI-compatible server, read for its exact
  label distribution (`CanvasDecisionModel.reader` over `CausalServerEngine`; `--escalate-model`:
  its served name, default the first).
- `--escalate-embedded`: an AR model served from the embedded SmolLM2 weights on a
  loopback port (`canvasroute.apps.eval.ar_server`), for offline runs: near chance, plumbing only.
"""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Iterator
from typing import Any

from canvasroute.engine import CalibrationError, Connection
from canvasroute.engine._extras import require_extra

__all__ = ["add_target_options", "open_target"]


def add_target_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("escalation target")
    which = group.add_mutually_exclusive_group()
    which.add_argument("--escalate-url", metavar="URL", help="OpenAI-compatible base URL (…/v1) of the AR target")
    which.add_argument("--escalate-systemone", metavar="URL", help="a /v1/systemone decision server as the target")
    which.add_argument("--escalate-causal", metavar="URL",
                       help="a causal model on an OpenAI-compatible server (…/v1 works), read for its exact label "
                            "distribution: one read per question, no JSON generated")
    which.add_argument("--escalate-embedded", action="store_true",
                       help="serve the embedded SmolLM2 as an AR target on a loopback port (near chance; needs the "
                            "local, serve and openai extras)")
    group.add_argument("--escalate-model", metavar="NAME",
                       help="model name at --escalate-url / --escalate-systemone / --escalate-causal")
    group.add_argument("--escalate-api-key-env", default="CANVASROUTE_ESCALATE_API_KEY", metavar="VAR",
                       help="environment variable holding the target's API key")
    group.add_argument("--escalate-timeout", type=float, default=120.0, help="seconds per target call (default 120)")
    group.add_argument("--hedge-band", type=float, metavar="BAND",
                       help="the cascade hedges: a question whose first read is over the gate by at most BAND asks "
                            "the target beside its re-reads (Escalation(hedge=Hedge(band=BAND)))")


def wants_target(args: argparse.Namespace) -> bool:
    return bool(args.escalate_url or args.escalate_systemone or args.escalate_causal or args.escalate_embedded)


@contextlib.contextmanager
def open_target(args: argparse.Namespace) -> Iterator[Any]:
    """The target the options name (None when none is named); a served one stops on exit."""
    key = os.environ.get(args.escalate_api_key_env)
    if args.escalate_systemone:
        from canvasroute.router import SystemOneDecisionModel

        yield SystemOneDecisionModel(Connection(args.escalate_systemone, api_key=key, timeout=args.escalate_timeout),
                                     model=args.escalate_model or "canvas")
        return
    if args.escalate_causal:
        from canvasroute.engine import CausalServerEngine
        from canvasroute.router import CanvasDecisionModel

        yield CanvasDecisionModel.reader(CausalServerEngine(
            Connection(args.escalate_causal, api_key=key, timeout=args.escalate_timeout), model=args.escalate_model))
        return
    if args.escalate_url:
        if not args.escalate_model:
            raise CalibrationError("--escalate-url needs --escalate-model")
        yield _chat(args.escalate_url, args.escalate_model, key or "EMPTY", args.escalate_timeout)
        return
    if not args.escalate_embedded:
        yield None
        return
    require_extra("local", "--escalate-embedded (SmolLM2-135M behind a local chat server)", ("torch", "transformers"))
    require_extra("serve", "--escalate-embedded (SmolLM2-135M behind a local chat server)", ("starlette", "uvicorn"))
    from .ar_server import ARServer, create_app, load_smollm2

    model, tokenizer = load_smollm2()
    with ARServer(create_app(model, tokenizer)) as server:
        # a JSON object of a few short answers fits in 32 tokens; a CPU model should not write more
        yield _chat(server.url + "/v1", "smollm2", "x", args.escalate_timeout, max_tokens=32)


def _chat(base_url: str, model: str, api_key: str, timeout: float, **extra: Any) -> Any:
    require_extra("openai", "an OpenAI-compatible escalation target")
    from langchain_openai import ChatOpenAI

    target = Connection(base_url, api_key=api_key, timeout=timeout, retries=1)
    return ChatOpenAI(model=model, logprobs=True, top_logprobs=5, temperature=0, **target.openai_options(), **extra)
