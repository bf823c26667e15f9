"""Images in state: content blocks go to vLLM's chat endpoint as image parts; text-only engines refuse first."""

from __future__ import annotations

import pytest
from langchain_core.decisions import Choice
from langchain_core.messages import HumanMessage

from canvasroute.engine import Connection, DecisionError, FunctionEngine, ImagesUnsupported, VLLMServerEngine
from canvasroute.engine.testing import LoopbackVLLM
from canvasroute.router import CanvasDecisionModel, DecisionCache, state_images

TEAM = Choice(instructions="Which team owns the screenshot's error?", criteria={"billing": None, "tech": None})
PNG = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg=="


def _state(data: str = PNG) -> list[HumanMessage]:
    return [HumanMessage(content=[{"type": "text", "text": "What does this screen show?"},
                                  {"type": "image", "base64": data, "mime_type": "image/png"},
                                  {"type": "image_url", "image_url": {"url": "https://example.test/b.png"}}])]


def test_content_block_shapes_become_urls():
    assert state_images(_state()) == (f"data:image/png;base64,{PNG}", "https://example.test/b.png")
    legacy = HumanMessage(content=[
        {"type": "image", "source_type": "base64", "data": "QUJD", "mime_type": "image/jpeg"},
        {"type": "image_url", "image_url": "data:image/gif;base64,R0lG"}])
    assert state_images({"messages": [legacy]}) == ("data:image/jpeg;base64,QUJD", "data:image/gif;base64,R0lG")
    assert state_images("plain text") == ()
    with pytest.raises(DecisionError, match="mime_type"):
        state_images([HumanMessage(content=[{"type": "image", "base64": "QUJD"}])])


async def test_images_go_to_the_chat_endpoint_as_image_parts_with_the_same_canvas():
    server = LoopbackVLLM()
    model = CanvasDecisionModel(engine=VLLMServerEngine(Connection("http://vllm.test", transport=server.transport())))
    with_images = await model.ainvoke({"state": _state(), "questions": {"team": TEAM}, "seed": 5})
    body = server.bodies[-1]
    system, user = body["messages"]
    assert system["role"] == "system" and isinstance(system["content"], str)
    assert user["role"] == "user"
    assert user["content"] == [  # the transcript marks where each image is, as /v1/decisions writes it
        {"type": "text", "text": "human: What does this screen show?\n[image 1]\n[image 2]"},
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}"}},
        {"type": "image_url", "image_url": {"url": "https://example.test/b.png"}},
    ]
    text_only = await model.ainvoke({"state": [HumanMessage("What does this screen show?")],
                                     "questions": {"team": TEAM}, "seed": 5})
    assert server.bodies[-1]["vllm_xargs"] == body["vllm_xargs"]  # same canvas, same noise
    assert server.bodies[-1]["messages"][1]["content"] == "human: What does this screen show?"
    assert with_images.reads["team"].path == text_only.reads["team"].path == "canvas"


async def test_a_server_with_images_off_refuses_with_a_typed_error_then_before_any_request():
    server = LoopbackVLLM(max_images=0)
    engine = VLLMServerEngine(Connection("http://vllm.test", transport=server.transport()))
    model = CanvasDecisionModel(engine=engine)  # escalation would not help: misuse raises
    with pytest.raises(ImagesUnsupported, match="At most 0 image"):
        await model.ainvoke({"state": _state(), "questions": {"team": TEAM}})
    sent = engine.requests_sent
    with pytest.raises(ImagesUnsupported, match="cannot take images"):
        await model.ainvoke({"state": _state(), "questions": {"team": TEAM}})
    assert engine.requests_sent == sent  # refused before any read
    assert (await model.ainvoke({"state": "text only", "questions": {"team": TEAM}})).reads["team"].path == "canvas"


async def test_completions_endpoint_and_in_process_engines_refuse_before_any_read():
    server = LoopbackVLLM()
    engine = VLLMServerEngine(Connection("http://vllm.test", transport=server.transport()), endpoint="completions")
    with pytest.raises(ImagesUnsupported, match="cannot take images"):
        await CanvasDecisionModel(engine=engine).ainvoke({"state": _state(), "questions": {"team": TEAM}})
    assert server.reads == 0
    fake = FunctionEngine(lambda read: pytest.fail("read"))
    with pytest.raises(ImagesUnsupported):
        await CanvasDecisionModel(engine=fake, escalate_to=None).ainvoke(
            {"state": _state(), "questions": {"team": TEAM}})
    assert fake.reads == []


async def test_the_cache_tells_images_apart():
    server = LoopbackVLLM()
    model = CanvasDecisionModel(engine=VLLMServerEngine(Connection("http://vllm.test", transport=server.transport())),
                                cache=DecisionCache())
    await model.ainvoke({"state": _state(), "questions": {"team": TEAM}})
    await model.ainvoke({"state": _state(), "questions": {"team": TEAM}})
    reads = server.reads
    await model.ainvoke({"state": _state("QUJD"), "questions": {"team": TEAM}})
    assert server.reads == reads + 1 and model.cache.hits == 1


@pytest.mark.vllm
async def test_the_real_cpu_server_with_images_off_refuses_them(vllm_url):
    engine = VLLMServerEngine(vllm_url)
    try:
        with pytest.raises(ImagesUnsupported, match="image"):
            await CanvasDecisionModel(engine=engine).ainvoke({"state": _state(), "questions": {"team": TEAM}})
    finally:
        await engine.aclose()


async def test_an_unsure_image_question_escalates_to_a_target_that_sees_the_image():
    """Defect (issue 28.2): the escalation target saw the state's text only, never its images."""
    from langchain_core.language_models import GenericFakeChatModel
    from langchain_core.messages import AIMessage

    from canvasroute.router import GatePolicy

    seen: list = []

    class Target(GenericFakeChatModel):
        def _generate(self, messages, stop=None, run_manager=None, **kwargs):  # type: ignore[no-untyped-def]
            seen.append(messages)
            return super()._generate(messages, stop, run_manager, **kwargs)

    server = LoopbackVLLM(answer="uniform")
    target = Target(messages=iter([AIMessage('{"team": "tech"}')]))
    model = CanvasDecisionModel(engine=VLLMServerEngine(Connection("http://vllm.test", transport=server.transport())),
                                policy=GatePolicy(rereads=0), escalate_to=target)
    resp = await model.ainvoke({"state": _state(), "questions": {"team": TEAM},
                                "read": {"images": ["https://example.test/extra.png"]}})
    assert resp.reads["team"].path == "escalated"
    (messages,) = seen
    parts = messages[-1].content
    urls = [p["image_url"]["url"] for p in parts if isinstance(p, dict) and p.get("type") == "image_url"]
    assert urls == [f"data:image/png;base64,{PNG}", "https://example.test/b.png", "https://example.test/extra.png"]
    assert "What does this screen show?" in parts[0]["text"]
