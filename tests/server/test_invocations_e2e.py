"""SageMaker's /invocations and vLLM's batch chat, through the proxy in front of the simulator.

vLLM serves `/invocations` with the handler whose request type the body validates as
(vllm/entrypoints/serve/sagemaker/api_router.py): the proxy measures it as that API and
labels it so. `/v1/chat/completions/batch` answers N conversations with one non-streamed
chat completion of N choices (vllm/entrypoints/openai/chat_completion/batch_serving.py).
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from proxy.core.measurement import ErrorType
from tests.conftest import MODEL, ProxyUnderTest, Running

PROGRAM = {"x-sim-output-tokens": "6"}
OUTPUT = 7  # the 6 programmed and the end-of-sequence token, as vLLM counts it
MESSAGES: Any = [{"role": "user", "content": "Hello there"}]


def measured(proxy: ProxyUnderTest, path: str, body: dict[str, Any]) -> tuple[httpx.Response, Any]:
    reply = httpx.post(proxy.url + path, json={"model": MODEL, **body}, headers=PROGRAM)
    return reply, proxy.wait_records(1, exact=True)[0]


@pytest.mark.parametrize(
    ("body", "label"),
    [
        ({"messages": MESSAGES}, "/v1/chat/completions"),
        ({"prompt": "Hello there"}, "/v1/completions"),
        (
            {"messages": MESSAGES, "prompt": "chat wins: vLLM tries it first"},
            "/v1/chat/completions",
        ),
    ],
)
def test_invocations_is_measured_as_the_api_its_body_is_served_by(
    sim: Running, proxy: ProxyUnderTest, body: dict[str, Any], label: str
) -> None:
    direct = httpx.post(sim.url + "/invocations", json={"model": MODEL, **body}, headers=PROGRAM)
    reply, m = measured(proxy, "/invocations", body)
    assert reply.status_code == direct.status_code == 200
    assert reply.json()["object"] == direct.json()["object"]
    usage = reply.json()["usage"]
    assert (m.endpoint, m.ok, m.stream, m.finish_reason) == (label, True, False, "stop")
    assert (m.prompt_tokens, m.output_tokens) == (usage["prompt_tokens"], OUTPUT)
    assert (
        proxy.sample("tokenprobe_passthrough_requests_total", route="/invocations", code="200") == 0
    )
    labels = {"model": MODEL, "endpoint": label, "code": "200", "error_type": "none"}
    assert proxy.sample("tokenprobe_requests_total", **labels, finish_reason="stop") == 1


def test_a_streamed_chat_invocation_is_measured_as_a_chat_stream(
    proxy: ProxyUnderTest,
) -> None:
    """TTFT and tokens as a chat stream's: the proxy asks for usage (the client did not)
    and takes the usage chunk out again, so the client gets no usage, as direct."""
    reply, m = measured(proxy, "/invocations", {"messages": MESSAGES, "stream": True})
    assert reply.status_code == 200
    assert reply.headers["content-type"].startswith("text/event-stream")
    assert b'"usage"' not in reply.content and reply.content.endswith(b"data: [DONE]\n\n")
    assert (m.endpoint, m.ok, m.stream, m.output_tokens) == (
        "/v1/chat/completions",
        True,
        True,
        OUTPUT,
    )
    assert m.ttft is not None and m.token_source.value == "usage"


def test_an_embeddings_invocation_is_measured_as_embeddings(proxy: ProxyUnderTest) -> None:
    # The simulator plays a generative model, which serves no embeddings: vLLM answers
    # `{"input"}` with completions' 400 for a missing prompt. The proxy, which does not know
    # the model's task, measures the body as the API vLLM's order gives it (embeddings).
    reply, m = measured(proxy, "/invocations", {"input": "Hello there"})
    assert reply.status_code == 400
    assert (m.endpoint, m.ok, m.error_type) == ("/v1/embeddings", False, ErrorType.BAD_REQUEST)


def test_an_invocation_no_handler_takes_is_an_error_of_invocations(proxy: ProxyUnderTest) -> None:
    reply, m = measured(proxy, "/invocations", {"nothing": "here"})
    assert reply.status_code == 400
    assert (m.endpoint, m.ok, m.error_type) == ("/invocations", False, ErrorType.BAD_REQUEST)


def test_batch_chat_is_measured_as_a_chat_with_a_choice_per_conversation(
    sim: Running, proxy: ProxyUnderTest
) -> None:
    conversations = [MESSAGES, [{"role": "user", "content": "a b c d e f"}], MESSAGES]
    reply, m = measured(proxy, "/v1/chat/completions/batch", {"messages": conversations})
    body = reply.json()
    assert reply.status_code == 200 and body["object"] == "chat.completion"
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert (m.endpoint, m.ok, m.stream, m.ttft) == ("/v1/chat/completions/batch", True, False, None)
    assert (m.prompt_tokens, m.output_tokens) == (
        body["usage"]["prompt_tokens"],
        body["usage"]["completion_tokens"],
    )
    assert m.output_tokens == 3 * OUTPUT
    assert m.finish_reasons == ("stop", "stop", "stop")


def test_batch_chat_with_stream_true_is_answered_and_measured_whole(proxy: ProxyUnderTest) -> None:
    """vLLM's batch request model has no `stream`: `stream: true` gets one body
    (tests/fixtures/streams/vllm-0.32/batch_chat_stream_ignored.json)."""
    reply, m = measured(
        proxy, "/v1/chat/completions/batch", {"messages": [MESSAGES], "stream": True}
    )
    assert reply.status_code == 200 and reply.headers["content-type"] == "application/json"
    assert (m.endpoint, m.ok, m.stream, m.output_tokens) == (
        "/v1/chat/completions/batch",
        True,
        False,
        OUTPUT,
    )


def test_batch_chat_without_conversations_is_refused(proxy: ProxyUnderTest) -> None:
    reply, m = measured(proxy, "/v1/chat/completions/batch", {"messages": []})
    assert reply.status_code == 400
    assert (m.endpoint, m.ok) == ("/v1/chat/completions/batch", False)
