"""mars serve at its edges, where outside probes found it wanting (issue #45). The release and the server
are test_serve's."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time

import httpx
import openai
import pytest
import uvicorn
from test_serve import NAME, PROMPTS, Running, chat, release  # noqa: F401 (release: a fixture)

from mars.errors import ConfigError
from mars.serving.config import ServeConfig
from mars.serving.server import MarsServer

HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(release, tmp_path_factory):  # noqa: F811 (release: the fixture imported above)
    running = Running(release, tmp_path_factory.mktemp("cache"), max_batch=4)
    yield running
    running.stop()


def assert_error(response: httpx.Response, status: int, param: str) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert error["param"] == param and param in error["message"] and error["type"] == "invalid_request_error"
    return error


@pytest.mark.parametrize("field, value", [
    ("seed", 2**64),  # torch's generator raised ValueError: a 500 in text/plain, then a reset connection
    ("seed", -(2**63) - 1),
    ("stop", ["x" * 257]),  # the step thread would decode that far back on every token
])
def test_a_value_out_of_range_gets_400_and_the_connection_keeps_serving(server, field, value):
    with httpx.Client(base_url=server.url, timeout=60) as client:  # one keep-alive connection
        bad = client.post("/v1/chat/completions", json={"model": NAME, "messages": HI, field: value})
        assert_error(bad, 400, field)
        good = client.post("/v1/chat/completions", json={"model": NAME, "messages": HI, "max_tokens": 3,
                                                          "seed": 2**63 - 1})  # the largest seed samples
        assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize("path, field, value", [
    ("/v1/chat/completions", "presence_penalty", 0.5),
    ("/v1/chat/completions", "frequency_penalty", -1),
    ("/v1/chat/completions", "logit_bias", {"5": 100}),
    ("/v1/chat/completions", "response_format", {"type": "json_object"}),
    ("/v1/chat/completions", "tools", [{"type": "function", "function": {"name": "f"}}]),
    ("/v1/chat/completions", "tool_choice", "required"),
    ("/v1/chat/completions", "functions", [{"name": "f"}]),
    ("/v1/chat/completions", "logprobs", True),
    ("/v1/chat/completions", "top_logprobs", 2),
    ("/v1/completions", "best_of", 3),
    ("/v1/completions", "echo", True),
    ("/v1/completions", "suffix", "."),
])
def test_an_unimplemented_openai_field_is_refused_not_ignored(server, path, field, value):
    body = {"model": NAME, "max_tokens": 3, field: value}
    body.update({"messages": HI} if "chat" in path else {"prompt": "hi"})
    error = assert_error(server.post(path, body), 400, field)
    assert "not supported" in error["message"]


def test_an_unimplemented_field_at_its_neutral_value_changes_nothing(server):
    plain = chat(server, PROMPTS[0], temperature=0, max_tokens=12, tau=1.0)
    neutral = chat(server, PROMPTS[0], temperature=0, max_tokens=12, tau=1.0, presence_penalty=0,
                   frequency_penalty=0.0, logit_bias={}, response_format={"type": "text"}, logprobs=False,
                   tool_choice="none", tools=[])
    assert neutral.choices[0].message.content == plain.choices[0].message.content
    completion = server.client.completions.create(model=NAME, prompt="the cat", temperature=0, max_tokens=8,
                                                  echo=False, best_of=1, logit_bias=None)
    assert completion.usage.completion_tokens == 8


def test_a_body_over_the_size_limit_gets_413_without_being_parsed(server):
    """The default limit, 1 MiB: a 2 MB body is refused by its Content-Length, and a chunked one (no length)
    once what arrived passes the limit; neither is parsed or tokenized, and the server keeps serving."""
    huge = json.dumps({"model": NAME, "messages": [{"role": "user", "content": "the cat " * 250_000}]})
    error = assert_error(server.post("/v1/chat/completions", huge), 413, "body")
    assert error["code"] == "request_too_large"

    def chunks():
        for start in range(0, len(huge), 65536):
            yield huge[start:start + 65536].encode()

    chunked = httpx.post(server.url + "/v1/chat/completions", content=chunks(), timeout=60,
                         headers={"content-type": "application/json"})
    assert "content-length" not in chunked.request.headers
    assert_error(chunked, 413, "body")
    assert chat(server, "hi", temperature=0, max_tokens=3).usage.completion_tokens == 3


def test_the_size_limit_is_configurable(release, tmp_path):  # noqa: F811
    with pytest.raises(ConfigError, match="max_request_bytes"):
        ServeConfig(max_request_bytes=0)
    small = Running(release, tmp_path / "cache", max_request_bytes=300)
    try:
        fits = {"model": NAME, "prompt": "the cat sat", "max_tokens": 2}
        assert small.post("/v1/completions", fits).status_code == 200
        assert_error(small.post("/v1/completions", {**fits, "prompt": "the cat sat " * 30}), 413, "body")
    finally:
        small.stop()


def test_the_event_loop_serves_others_while_a_prompt_is_tokenized(server, monkeypatch):
    """The chat template and the tokenizer run off the event loop: while one request's prompt is held in
    the template, the loop still answers (before, a 2 MB prompt stalled every stream for ~2 s)."""
    tokenizer = server.built.serving.current.model.tokenizer
    template, entered, go_on = tokenizer.apply_chat_template, threading.Event(), threading.Event()

    def slow_template(*args, **kwargs):
        entered.set()
        go_on.wait(20)
        return template(*args, **kwargs)

    monkeypatch.setattr(tokenizer, "apply_chat_template", slow_template)
    result = {}
    waiting = threading.Thread(target=lambda: result.update(out=chat(server, "hi", temperature=0, max_tokens=3)))
    waiting.start()
    try:
        assert entered.wait(20)
        assert httpx.get(server.url + "/health", timeout=5).status_code == 200  # the loop is free
    finally:
        go_on.set()
        waiting.join(30)
    assert result["out"].usage.completion_tokens == 3


def test_a_non_streaming_request_whose_client_goes_away_stops_decoding(server):
    tokens_before = server.metric("mars_generated_tokens_total")
    body = json.dumps({"model": NAME, "prompt": [5, 6, 7], "max_tokens": 250, "temperature": 0, "tau": 1.0})
    with socket.create_connection(("127.0.0.1", server.cfg.port)) as sock:
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\n\r\n{body}".encode())
        deadline = time.monotonic() + 30
        while server.metric("mars_running_requests") < 1:  # decoding: now the client hangs up
            assert time.monotonic() < deadline
            time.sleep(0.005)
    deadline = time.monotonic() + 10
    while server.metric("mars_running_requests") > 0:  # the engine let go of it
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert server.metric("mars_generated_tokens_total") - tokens_before < 250
    assert chat(server, "hi", temperature=0, max_tokens=5).usage.completion_tokens == 5


def test_models_retrieve_gives_the_model_object_and_404_for_another_id(server):
    model = server.client.models.retrieve(NAME)
    assert model.id == NAME and model.object == "model" and model.block_size == 4
    assert model.model_dump() == {**server.client.models.list().data[0].model_dump(), "created": model.created}
    for other in ("gpt-4", "org/mars"):
        with pytest.raises(openai.NotFoundError) as err:
            server.client.models.retrieve(other)
        assert err.value.body["code"] == "model_not_found" and err.value.body["param"] == "model"


class _Draining:  # what MarsServer's exit handler asks of Serving
    def __init__(self, finishes: bool):
        self.finishes, self.draining = finishes, False

    def running(self) -> int:
        return 2

    def queue_depth(self) -> int:
        return 1

    def drain(self, timeout: float) -> bool:
        return self.finishes


@pytest.mark.parametrize("finishes, said", [(True, "drained"), (False, "drain timed out after 7 s")])
def test_the_drain_logs_its_outcome_without_a_logging_error(caplog, finishes, said):
    server = MarsServer(uvicorn.Config(app=None), _Draining(finishes), drain_seconds=7)
    with caplog.at_level(logging.INFO, logger="mars.serve"):
        server.handle_exit(15, None)
        deadline = time.monotonic() + 10
        while not server.should_exit:
            assert time.monotonic() < deadline
            time.sleep(0.01)
    messages = [record.getMessage() for record in caplog.records]  # a bad format string raises here
    assert messages[0] == "shutting down: finishing 2 running and 1 waiting requests"
    assert messages[1].startswith(said) and len(messages) == 2


def test_an_unexpected_error_is_a_json_500_and_the_connection_keeps_serving(server, monkeypatch, caplog):
    from mars.serving import app

    def broken(*_args):
        raise RuntimeError("a bug nobody turned into an HTTP error")

    with httpx.Client(base_url=server.url, timeout=60) as client:  # one keep-alive connection
        with monkeypatch.context() as patch, caplog.at_level(logging.ERROR, logger="mars.serve"):
            patch.setattr(app, "_prompt_ids", broken)
            bad = client.post("/v1/chat/completions", json={"model": NAME, "messages": HI, "max_tokens": 3})
        assert bad.status_code == 500 and bad.headers["content-type"] == "application/json"
        assert bad.json()["error"]["code"] == "internal_error" and "a bug" not in bad.text  # no internals leak
        assert any("a bug nobody turned" in r.exc_text for r in caplog.records if r.exc_text)
        good = client.post("/v1/chat/completions", json={"model": NAME, "messages": HI, "max_tokens": 3})
        assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 3
