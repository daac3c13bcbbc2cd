"""schemathesis against the server's own OpenAPI schema: no generated body, valid or not, gets a
5xx. On a tiny random model, so a few hundred bodies run in seconds. Half the bodies are cut down
to the served model, a well-formed prompt and a few of the generated fields, so that they reach
generation instead of stopping at the first invalid field or at a 404."""

from __future__ import annotations

import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from metaloom.generator import LocalGenerator  # noqa: E402
from metaloom.server.app import create_app  # noqa: E402
from metaloom.testing.served import serve_app  # noqa: E402
from metaloom.testing.tiny import tiny_llama  # noqa: E402

APP = create_app(LocalGenerator(tiny_llama()), model_ids=["default"], max_rows=16, max_waiting=64)
SCHEMA = schemathesis.openapi.from_dict(APP.openapi())
OPERATIONS = {op.ok().label: op.ok() for op in SCHEMA.get_all_operations()}


@pytest.fixture(scope="module")
def url():
    with serve_app(APP) as base:
        yield base
SEEN: dict[tuple[str, int], int] = {}


@pytest.mark.parametrize("label", sorted(OPERATIONS))
def test_no_body_gets_a_server_error(label, url):
    op = OPERATIONS[label]

    @given(case=op.as_strategy(), data=st.data())
    @settings(max_examples=100, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    def check(case, data):
        if isinstance(case.body, dict) and data.draw(st.booleans()):
            keep = data.draw(st.lists(st.sampled_from(sorted(case.body)), max_size=3)) if case.body else []
            body = {k: case.body[k] for k in keep}
            body["model"] = "default"
            body.setdefault("max_tokens", 8)
            text = data.draw(st.text("abcdef", min_size=1, max_size=12))
            if "messages" in case.body:
                body["messages"] = [{"role": "user", "content": text}]
            else:
                body["prompt"] = text
            case.body = body
        response = case.call(base_url=url, timeout=30)
        SEEN[label, response.status_code] = SEEN.get((label, response.status_code), 0) + 1
        assert response.status_code < 500, (case.body, response.text)

    check()


def test_the_fuzzing_reached_generation():
    """The run above tried valid and invalid bodies on both generation routes (else it proved little)."""
    for route in ("POST /v1/chat/completions", "POST /v1/completions"):
        refused = sum(n for (r, status), n in SEEN.items() if r == route and 400 <= status < 500)
        assert SEEN.get((route, 200), 0) >= 15 and refused >= 15, sorted(SEEN.items())
