"""Figure 4: one canvas read vs autoregressive structured output, same model and machine.

On the embedded SmolLM2-135M-Instruct (CPU, float32): the canvas path is a full
`CanvasDecisionModel.decide` with re-reads off (prompt prefill + one forward pass over
the canvas, reading k slots); the AR path is `generate` of the JSON answer
(`{"q1": "A", ...}`), greedy, forced to exactly the answer's token count, from the same
system prompt (its last line asks for JSON instead of `id: label` lines) and state.
Each run uses a fresh state. Cold, neither path reuses any cached prompt: the canvas runs on
an engine without a prompt cache (`prompt_cache_size=0`), since the default engine would
reuse the node's system prompt from earlier runs while `generate` prefills it in full.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import statistics
import time
from collections.abc import Mapping
from typing import Any

from canvasroute.router import CanvasDecisionModel, GatePolicy

from .common import NODES, TICKETS, TRIAGE, Recorder, Section

__all__ = ["run_canvas_vs_ar"]

CASES = {1: "1 Noul", 3: TRIAGE, 8: "8 Nouls"}
TARGET_RATIO_K3 = 0.2
_FORMAT_LINE = 'Reply with one line per question, in this order, formatted as "id: label".'


def run_canvas_vs_ar(quick: bool) -> Section:
    runs = 1 if quick else 5
    cases = {k: v for k, v in CASES.items() if k <= 3} if quick else CASES
    section = Section("canvas_vs_ar", f"4. One canvas read vs AR JSON generation, SmolLM2-135M on CPU "
                                      f"(median of {runs} run{'s' if runs > 1 else ''})",
                      ["k questions", "prompt tokens", "AR tokens", "canvas ms", "AR ms", "canvas/AR",
                       "cached: canvas ms", "cached: AR ms", "cached: canvas/AR"])
    try:
        from canvasroute.engine import TransformersEngine, embedded_engine
        engine = embedded_engine()  # ExtraMissing without torch: before torch is imported here
        import torch
        cold = TransformersEngine(engine.model, engine.tokenizer, name="no-cache", prompt_cache_size=0)
    except Exception as exc:  # noqa: BLE001 - wheel or torch missing: say so
        section.skipped = f"embedded model unavailable: {type(exc).__name__}: {exc}"
        return section
    section.extra["torch_threads"] = torch.get_num_threads()
    try:
        asyncio.run(_case(engine, cold, 1, NODES[CASES[1]], 1, tag="warm-up"))  # torch, tokenizer, generate
        for k, node in cases.items():
            section.rows.append(asyncio.run(_case(engine, cold, k, NODES[node], runs)))
    finally:
        asyncio.run(engine.aclose())
        asyncio.run(cold.aclose())
    k3 = next((r for r in section.rows if r["k questions"] == 3), None)
    if k3:
        verdict = {key: f"{k3[key]:.3f} ({'met' if k3[key] <= TARGET_RATIO_K3 else 'NOT met'})"
                   for key in ("canvas/AR", "cached: canvas/AR")}
        section.notes.append(f"target: canvas/AR <= {TARGET_RATIO_K3} at k=3; cold prompt {verdict['canvas/AR']}, "
                             f"cached prompt {verdict['cached: canvas/AR']}")
    section.notes += [
        "canvas = decide() with re-reads off: prefill + ONE forward pass over the canvas, all k slots read at once",
        "AR = model.generate of the JSON answer, greedy, min_new_tokens = max_new_tokens = its token count",
        "cold: both prefill the whole prompt (the canvas on an engine without a prompt cache); cached: the "
        "prompt's KV cache is ready (the engine's LRU for the canvas, a prefilled DynamicCache for generate), so "
        "one pass is compared with the AR decode steps",
        f"torch threads: {section.extra['torch_threads']}; float32; a fresh state per run"
        + ("; --quick: k=8 skipped" if quick else ""),
        "SmolLM2-135M is near chance at these decisions: latency only, never accuracy",
    ]
    return section


async def _case(engine: Any, cold: Any, k: int, questions: Mapping[str, Any], runs: int,
                tag: str = "") -> dict[str, Any]:
    """Median latencies of both paths for k questions, with a cold prompt (`cold`: an engine
    without a prompt cache) and a cached one (`engine`, after a first read of the prompt)."""
    import copy

    import torch
    from transformers import DynamicCache

    recorder = Recorder(engine)
    policy = GatePolicy(max_normalized_entropy=None, rereads=0)
    model = CanvasDecisionModel(engine=recorder, policy=policy)
    cold_model = CanvasDecisionModel(engine=cold, policy=policy)
    tokenizer, hf = engine.tokenizer, engine.model
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    # transformers 5.2x renamed `past_key_values` to `cache`; use what this version takes
    cache_kw = "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"
    times: dict[str, list[float]] = {"canvas": [], "ar": [], "canvas_cached": [], "ar_cached": []}
    ar_tokens = prompt_tokens = 0
    for i in range(runs):
        state = f"{TICKETS[i % len(TICKETS)]} (ticket {tag}#{1000 + k * 100 + i})"  # never seen before
        t = time.perf_counter()
        resp = await cold_model.adecide(state, questions)  # cold: the whole prompt is prefilled
        canvas = time.perf_counter() - t
        await model.adecide(state, questions)  # fills the engine's prompt KV cache
        t = time.perf_counter()
        await model.adecide(state, questions)
        canvas_cached = time.perf_counter() - t
        read = recorder.reads[-1]
        labels = [resp.reads[qid].labels[0] for qid in questions]
        answer = json.dumps({f"q{n}": label for n, label in enumerate(labels, 1)})
        system = read.messages[0]["content"].replace(
            _FORMAT_LINE, "Reply with only a JSON object mapping each question id to its label, like " + answer)
        messages = [{"role": "system", "content": system}, {"role": "user", "content": read.messages[1]["content"]}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                            return_dict=True)
        n_new = len(tokenizer(answer, add_special_tokens=False).input_ids)
        with torch.inference_mode():
            t = time.perf_counter()
            out = hf.generate(**ids, max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False,
                              pad_token_id=pad)
            ar = time.perf_counter() - t
            prefix = DynamicCache()  # the same prompt, prefilled ahead (all but its last token)
            hf(input_ids=ids["input_ids"][:, :-1], use_cache=True, **{cache_kw: prefix})
            cache = copy.deepcopy(prefix)
            t = time.perf_counter()
            hf.generate(**ids, max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False, pad_token_id=pad,
                        **{cache_kw: cache})
            ar_cached = time.perf_counter() - t
        if out.shape[1] - ids["input_ids"].shape[1] != n_new:
            raise RuntimeError("generate did not produce the forced token count")
        for key, value in (("canvas", canvas), ("ar", ar), ("canvas_cached", canvas_cached),
                           ("ar_cached", ar_cached)):
            times[key].append(value * 1000)
        ar_tokens, prompt_tokens = n_new, int(ids["input_ids"].shape[1])
    med = {key: statistics.median(v) for key, v in times.items()}
    return {"k questions": k, "prompt tokens": prompt_tokens, "AR tokens": ar_tokens,
            "canvas ms": med["canvas"], "AR ms": med["ar"], "canvas/AR": med["canvas"] / med["ar"],
            "cached: canvas ms": med["canvas_cached"], "cached: AR ms": med["ar_cached"],
            "cached: canvas/AR": med["canvas_cached"] / med["ar_cached"], "runs ms": times}
