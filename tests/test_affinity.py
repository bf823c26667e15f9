"""Prefix affinity: the session header, and rendezvous routing over the client's replicas.

Two loopback vLLM servers (engine.testing, real sockets) are the replicas. A recording
transport in front of them notes, for every read request, the replica it went to and its
session header. One decision's reads (first read and re-reads) go to one replica and
carry one key; when that replica is down they fail over to the other, together.
"""

from __future__ import annotations

from collections import defaultdict

import httpx
import pytest
from langchain_core.decisions import Choice

from canvasroute.engine import Connection, Retries, VLLMServerEngine
from canvasroute.engine.testing import LoopbackVLLM
from canvasroute.engine.vllm import session_key
from canvasroute.router import CanvasDecisionModel, GatePolicy

TEAM = Choice(instructions="Which team?", criteria={"billing": None, "tech": None})
REREADS = 2


class Recording(httpx.AsyncBaseTransport):
    """Real HTTP; notes (replica, session header) per answered read, and failed attempts."""

    def __init__(self) -> None:
        self.inner = httpx.AsyncHTTPTransport()
        self.reads: list[tuple[str, str | None]] = []
        self.failed: list[str] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        replica = f"http://{request.url.host}:{request.url.port}"
        try:
            response = await self.inner.handle_async_request(request)
        except httpx.TransportError:
            self.failed.append(replica)
            raise
        if b"logprob_token_ids" in request.content:  # a read, not discovery
            self.reads.append((replica, request.headers.get("x-session-id")))
        return response

    async def aclose(self) -> None:
        await self.inner.aclose()


def decider(urls: list[str], rec: Recording, **engine) -> CanvasDecisionModel:
    # `uniform` rows: every read is uncertain, so each decision reads 1 + REREADS times
    connection = Connection(urls, transport=rec, retries=Retries(backoff=0, replica_cooldown=60))
    return CanvasDecisionModel(engine=VLLMServerEngine(connection, **engine), policy=GatePolicy(rereads=REREADS))


async def by_decision(model: CanvasDecisionModel, rec: Recording, states: list[str]) -> dict[str, list[tuple]]:
    out: dict[str, list[tuple]] = defaultdict(list)
    for state in states:
        before = len(rec.reads)
        await model.adecide(state, {"team": TEAM})
        out[state] = rec.reads[before:]
    return out


async def test_one_decisions_reads_stay_on_one_replica_and_fail_over_together() -> None:
    async with LoopbackVLLM(answer="uniform") as a, LoopbackVLLM(answer="uniform") as b:
        rec = Recording()
        model = decider([a.url, b.url], rec)
        states = [f"ticket {i}: my invoice is wrong" for i in range(12)]
        reads = await by_decision(model, rec, states)
        for state, sent in reads.items():
            assert len(sent) == 1 + REREADS
            replicas, keys = {r for r, _ in sent}, {k for _, k in sent}
            assert len(replicas) == 1, f"{state!r} read on {replicas}"
            assert len(keys) == 1 and None not in keys, "first read and re-reads must carry one session key"
            [key] = keys
            assert model.engine.connection.rendezvous(key)[0] == next(iter(replicas))
        assert len({k for sent in reads.values() for _, k in sent}) == len(states), "keys differ by prompt"
        assert len({sent[0][0] for sent in reads.values()}) == 2, "12 decisions all hashed to one replica"

        # the replica holding the first decision goes down: its reads fail over, together
        first = reads[states[0]][0][0]
        down, up = (a, b) if first == a.url else (b, a)
        await down.close()
        again = await by_decision(model, rec, states)
        for state, sent in again.items():
            assert {r for r, _ in sent} == {up.url}, f"{state!r} not failed over to {up.url}"
        # one failed attempt put it in cool-down: the decisions it held did not try it again
        assert rec.failed == [down.url]
        await model.engine.aclose()


async def test_round_robin_without_affinity_spreads_one_decisions_reads() -> None:
    async with LoopbackVLLM(answer="uniform") as a, LoopbackVLLM(answer="uniform") as b:
        rec = Recording()
        model = decider([a.url, b.url], rec, affinity=False)
        reads = await by_decision(model, rec, ["ticket: refund please"])
        [sent] = reads.values()
        assert {r for r, _ in sent} == {a.url, b.url}  # round-robin: reads alternate
        assert len({k for _, k in sent}) == 1  # the header is still sent, for a router in front
        await model.engine.aclose()


async def test_the_session_header_is_configurable_or_off() -> None:
    async with LoopbackVLLM() as server:
        seen: list[httpx.Headers] = []

        class Headers(Recording):
            async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
                if b"logprob_token_ids" in request.content:
                    seen.append(request.headers)
                return await self.inner.handle_async_request(request)

        messages = None
        for header in ("x-user-id", None):
            seen.clear()
            engine = VLLMServerEngine(Connection(server.url, transport=Headers()), session_header=header)
            model = CanvasDecisionModel(engine=engine)
            resp = await model.adecide("ticket: refund please", {"team": TEAM})
            assert resp.reads["team"].path == "canvas"
            read = seen[-1]
            if header is None:
                assert "x-session-id" not in read and "x-user-id" not in read
            else:
                assert "x-session-id" not in read and len(read[header]) == 32
                messages = read[header]
            await engine.aclose()
        assert messages is not None
    with pytest.raises(ValueError, match="header name"):
        VLLMServerEngine("http://vllm.test", session_header="bad header")
    assert session_key([{"role": "user", "content": "a"}]) == session_key([{"role": "user", "content": "a"}])
    assert session_key([{"role": "user", "content": "a"}]) != session_key([{"role": "user", "content": "b"}])
