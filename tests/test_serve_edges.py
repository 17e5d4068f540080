"""mars serve at its edges, where outside probes found it wanting (issue #45). The release and the server
are test_serve's."""

from __future__ import annotations

import httpx
import pytest
from test_serve import NAME, Running, release  # noqa: F401 (release: a fixture)

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
