"""The gateway under hostile input, for real: `hexgen-flow up` with its gateway, driven by plain
HTTP (and a raw socket where HTTP clients would not send what is tested).

- A request that is a workflow of its own (no ``X-Hexgen-Workflow``) and whose call the
  coordinator refuses leaves nothing running: the gateway cancels the workflow it opened for
  it at once, and the error names the workflow (``X-Hexgen-Query``). A named workflow is not
  cancelled by one refused call.
- Hostile JSON (deep nesting, numbers past every limit, lone surrogates) and hostile headers
  are 400 in OpenAI's error shape naming the field, never a 500 and never a traceback in the
  gateway's log; a body larger than the gateway's cap is 413 before it is read, and a client
  that goes away in the middle of its body is no traceback either.
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from hexgen_client.client import CoordinatorClient
from up_runner import Up, running_up

needs_redis_server = pytest.mark.skipif(
    subprocess.run(["which", "redis-server"], capture_output=True, check=False).returncode != 0,
    reason="redis-server is not installed (apt install redis-server)",
)

pytestmark = needs_redis_server

RUNNING, SUCCEEDED, CANCELLED = 1, 2, 3  # QueryState
PROMPT_LIMIT = 1 << 20  # the coordinator's default --max-prompt-bytes
# Over the coordinator's prompt limit, yet its tokens (/4) fit an A100's KV cache: the
# workflow is opened (its expected call fits) and the call itself is refused (RunCall).
# Just over it: a chat call carries its prompt twice (rendered, and as its messages), and
# the RunCall as a whole stays within what the coordinator reads of one.
TOO_LONG = "x" * (PROMPT_LIMIT + 1024)
MESSAGES = [{"role": "user", "content": "x"}]


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    tmp = tmp_path_factory.mktemp("gateway-hostile")
    with running_up(
        tmp,
        "--cluster", "A100,A6000",
        "--time-scale", "50",
        "--no-tuner",
        "--gateway-listen", "127.0.0.1:0",
    ) as running:  # fmt: skip
        yield running


def base_url(up: Up) -> str:
    return up.banner["gateway"].split(" ", 1)[0]


def gateway_log(up: Up) -> str:
    return (up.log_dir / "gateway.log").read_text()


def no_traceback_since(up: Up, start: int) -> None:
    """No traceback in what the gateway logged after offset `start` of its log."""
    logged = gateway_log(up)[start:]
    assert "Traceback" not in logged, logged[-4000:]


def is_openai_400(answer: httpx.Response, param: str | None, what: object) -> dict[str, Any]:
    """`answer` is 400 in OpenAI's error shape naming `param`; its error."""
    assert answer.status_code == 400, (what, answer.status_code, answer.text[:500])
    error = answer.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, (what, error)
    assert error["type"] == "invalid_request_error", (what, error)
    assert error["param"] == param, (what, error)
    assert isinstance(error["message"], str) and 0 < len(error["message"]) < 2000, (what, error)
    assert isinstance(error["code"], str), (what, error)
    return dict(error)


async def running_count(up: Up) -> int:
    async with CoordinatorClient(up.coordinator) as coordinator:
        return int((await coordinator.status()).queries_running)


async def state_of(up: Up, workflow: str) -> int:
    async with CoordinatorClient(up.coordinator) as coordinator:
        return int((await coordinator.get(workflow)).query.state)


# ------------------------------------------------------------- refused calls leave nothing


async def test_a_refused_call_leaves_no_workflow_of_its_own_running(up: Up) -> None:
    url = base_url(up)
    # The call is refused by the coordinator (its prompt is over --max-prompt-bytes) after
    # the gateway opened the request's workflow for it: nobody will give that workflow a
    # call any more, and it must not wait for the idle timeout (300 s) counting as work.
    requests: list[tuple[str, dict[str, Any], str]] = [
        ("/completions", {"prompt": TOO_LONG, "max_tokens": 4}, "prompt"),
        ("/chat/completions", {"messages": [{"role": "user", "content": TOO_LONG}]}, "messages"),
        (
            "/chat/completions",
            {"messages": [{"role": "user", "content": TOO_LONG}], "stream": True},
            "messages",
        ),
    ]
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        for path, body, param in requests:
            before = await running_count(up)
            answer = await http.post(path, json=body)
            error = is_openai_400(answer, param, (path, sorted(body)))
            assert f"must be at most {PROMPT_LIMIT} bytes" in error["message"], error
            # Nothing of the request is left running, at once (not after 300 s).
            assert await running_count(up) == before, (path, "a workflow was left running")
            # The error names the workflow made up for the request, which was cancelled.
            workflow = answer.headers["X-Hexgen-Query"]
            assert workflow.startswith("gw-") and answer.headers["X-Hexgen-Workflow"] == workflow
            assert await state_of(up, workflow) == CANCELLED


async def test_a_refused_call_does_not_cancel_a_named_workflow(up: Up) -> None:
    url = base_url(up)
    workflow = f"named-{uuid.uuid4().hex[:8]}"
    headers = {"X-Hexgen-Workflow": workflow, "X-Hexgen-Stage": "s"}
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        first = await http.post(
            "/completions", json={"prompt": "x", "max_tokens": 4}, headers=headers
        )
        assert first.status_code == 200, first.text
        refused = await http.post(
            "/completions", json={"prompt": TOO_LONG, "max_tokens": 4}, headers=headers
        )
        is_openai_400(refused, "prompt", "a named workflow's call over the prompt limit")
        # The error names the workflow the call was refused for, as an answer does.
        assert refused.headers["X-Hexgen-Workflow"] == workflow
        assert refused.headers["X-Hexgen-Query"] == workflow
        # Its other calls are wanted: the workflow goes on.
        assert await state_of(up, workflow) == RUNNING
        again = await http.post(
            "/completions", json={"prompt": "y", "max_tokens": 4}, headers=headers
        )
        assert again.status_code == 200, again.text
        assert again.headers["X-Hexgen-Call"].startswith(f"{workflow}/")
        closed = await http.post(f"/workflows/{workflow}/close")
    assert closed.status_code == 200, closed.text
    assert closed.json()["calls_done"] == 2
    assert await state_of(up, workflow) == SUCCEEDED


# ----------------------------------------------------------------------- hostile JSON


def _post_raw(
    up: Up, path: str, body: bytes, headers: dict[str, str] | None = None
) -> httpx.Response:
    return httpx.post(
        f"{base_url(up)}{path}",
        content=body,
        headers={"Content-Type": "application/json", **(headers or {})},
        timeout=60,
    )


def _chat_with(field: str, value: str) -> bytes:
    """A chat body whose `field` is the raw JSON text `value`."""
    return f'{{"messages": [{{"role": "user", "content": "x"}}], "{field}": {value}}}'.encode()


def test_deeply_nested_json_is_400_not_500(up: Up) -> None:
    start = len(gateway_log(up))
    deep = "[" * 100_000 + "]" * 100_000
    cases = [
        ("/chat/completions", deep.encode()),
        ("/completions", deep.encode()),
        ("/chat/completions", f'{{"messages": {deep}}}'.encode()),
        ("/chat/completions", _chat_with("max_tokens", deep)),
        ("/chat/completions", _chat_with("temperature", '{"a":' * 50_000 + "1" + "}" * 50_000)),
    ]
    for path, body in cases:
        error = is_openai_400(_post_raw(up, path, body), None, (path, body[:40]))
        assert error["code"] == "invalid_json", error
    no_traceback_since(up, start)


def test_numbers_past_every_limit_are_400_naming_the_field(up: Up) -> None:
    start = len(gateway_log(up))
    huge = "9" * 5000  # past Python's 4300 digits of int conversion
    cases = [
        ("max_tokens", v)
        for v in (
            "1e12", "1000000000000", "2147483648", "10000001", huge, "-" + huge, "1e400",
            "-1e400", "NaN", "Infinity", "-1", "0", "3.5", "true", '"5"', "[]", "{}", "[[[1]]]",
        )
    ] + [
        ("max_completion_tokens", v) for v in ("1e12", "2147483648", huge, "NaN", "-1", "false")
    ] + [("n", v) for v in ("NaN", "1e400", "2", huge, '"1"', "[1]")]  # fmt: skip
    for field, value in cases:
        error = is_openai_400(
            _post_raw(up, "/chat/completions", _chat_with(field, value)), field, value[:20]
        )
        assert field in error["message"], error
    # Above the largest call the coordinator accepts: refused by the gateway itself, in the
    # same words whatever the workflow (a named workflow's call too).
    named = {"X-Hexgen-Workflow": f"big-{uuid.uuid4().hex[:8]}"}
    for value in ("10000001", "2147483648", "1000000000000"):
        answer = _post_raw(
            up, "/completions", b'{"prompt": "x", "max_tokens": %s}' % value.encode(), named
        )
        assert "10000000" in is_openai_400(answer, "max_tokens", value)["message"]
    # Ignored sampling options, however odd, are never a 500.
    for field in ("temperature", "top_p", "seed", "presence_penalty", "logit_bias", "stop"):
        for value in (huge, "1e400", "NaN", '"\\ud800"', '{"\\ud800": 1}'):
            answer = _post_raw(up, "/chat/completions", _chat_with(field, value))
            assert answer.status_code in (200, 400), (field, value[:20], answer.text[:300])
    no_traceback_since(up, start)


def test_lone_surrogates_are_400_naming_the_field(up: Up) -> None:
    # JSON may spell a lone UTF-16 surrogate (\ud800): no UTF-8 text, nothing to send on.
    start = len(gateway_log(up))
    cases = [
        (
            "/chat/completions",
            {"messages": [{"role": "user", "content": "\ud800"}]},
            "messages[0].content",
        ),
        (
            "/chat/completions",
            {"messages": [{"role": "user\udfff", "content": "x"}]},
            "messages[0].role",
        ),
        (
            "/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "a\ud800b"}]}]},
            "messages[0].content[0].text",
        ),
        ("/chat/completions", {"messages": MESSAGES, "model": "\ud800"}, "model"),
        ("/completions", {"prompt": "\ud800"}, "prompt"),
        ("/completions", {"prompt": ["\udc00"]}, "prompt[0]"),
    ]
    async_body = [(p, json.dumps(b).encode(), param) for p, b, param in cases]
    before = asyncio.run(running_count(up))
    for path, body, param in async_body:
        is_openai_400(_post_raw(up, path, body), param, body[:60])
    assert asyncio.run(running_count(up)) == before  # nothing was opened for them
    no_traceback_since(up, start)


# -------------------------------------------------------------------- hostile headers


def test_hostile_headers_are_400_naming_the_header(up: Up) -> None:
    start = len(gateway_log(up))
    # Within the HTTP server's limit on a request's head (h11: 16 KiB), beyond any id the
    # coordinator takes (256 characters). gRPC percent-encodes "%" in an error's message:
    # the coordinator's answer naming the template would not fit its metadata (16 KiB).
    long = "t" * 10_000
    cases = [
        ("X-Hexgen-Template", "%" * 6000),
        ("X-Hexgen-Template", long),
        ("X-Hexgen-Workflow", long),
        ("X-Hexgen-Stage", long),
        ("X-Hexgen-Template", "t" * 300),
        ("X-Hexgen-Slo-S", "nan"),
        ("X-Hexgen-Slo-S", "inf"),
        ("X-Hexgen-Slo-S", "1e400"),
        ("X-Hexgen-Slo-S", "-1"),
        ("X-Hexgen-Slo-S", "9" * 5000),
        ("X-Hexgen-Slo-S", "1e300"),  # over the coordinator's --max-slo-s
    ]
    for name, value in cases:
        answer = _post_raw(
            up, "/chat/completions", json.dumps({"messages": MESSAGES}).encode(), {name: value}
        )
        is_openai_400(answer, name, (name, value[:20]))
    no_traceback_since(up, start)


# ------------------------------------------------------------------------- body size cap


def test_a_body_over_the_cap_is_413_before_it_is_read(up: Up) -> None:
    # A gigabyte announced, none sent: the gateway answers without waiting for it.
    host, port = base_url(up).removeprefix("http://").split("/", 1)[0].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\n"
            b"Content-Type: application/json\r\nContent-Length: 1073741824\r\n\r\n"
        )
        answer = b""
        try:
            while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
                piece = sock.recv(65536)
                if not piece:
                    break
                answer += piece
        except TimeoutError:
            pytest.fail(f"no answer within 10 s: the gateway waits for the body ({answer!r})")
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413 "), answer[:300]
    error = json.loads(body)["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "request_too_large"
    assert "bytes" in error["message"]


def test_a_client_that_leaves_during_its_body_is_no_traceback(up: Up) -> None:
    start = len(gateway_log(up))
    host, port = base_url(up).removeprefix("http://").split("/", 1)[0].rsplit(":", 1)
    for _ in range(3):
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: gateway\r\n"
                b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
                b'{"prompt": "only the start'
            )
            time.sleep(0.2)  # read by the gateway, then the client goes away
    time.sleep(1.5)  # the gateway notices at once; its log is written by then
    no_traceback_since(up, start)
