"""Chat requests reach the model through its chat template: a call dispatched with chat
messages (`DispatchCall.messages`) is sent by the ``openai`` engine to the server's
``/v1/chat/completions`` with those messages, and a call without them to
``/v1/completions`` with its prompt, as before.

The server is a real HTTP server on a free port that speaks the OpenAI streaming protocol
(server-sent events) and records every request it gets; the dispatch goes through the
worker's own path (the protobuf `DispatchCall`, `dispatch_messages`, `WorkerState`, the
local queue, the engine). The ``vllm`` engine's chat path needs a real tokenizer, which only
the vLLM venv has: tests/real_engine/test_chat_template.py."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, TypeVar

import pytest

from hexgen_api.v1 import workflow_pb2 as wfpb
from hexgen_coordinator.worker_messages import Run
from hexgen_coordinator.worker_wire import encode_command
from hexgen_flow.runtime import CallTicket
from hexgen_flow.workload import LLMCall
from hexgen_service.clock import ClusterClock
from hexgen_service.convert import dispatch_to_ticket
from hexgen_worker import DispatchOutcome, WelcomeSettings, WorkerConfig, WorkerState
from hexgen_worker.convert import dispatch_messages
from hexgen_worker.engines import Engine, OpenAIEngine, SimulatedEngine
from hexgen_worker.engines.base import CallRequest, ChatMessage
from hexgen_worker.events import CallFinished, CallReport, CallTokens

T = TypeVar("T")

CHAT_REPLY = ("SELECT", " Name", " FROM", " Artist")
COMPLETION_REPLY = (" a", " plain", " completion")
MESSAGES = (
    ChatMessage("system", "You write SQLite queries."),
    ChatMessage("user", "How many artists are there?"),
)
RENDERED = "system: You write SQLite queries.\nuser: How many artists are there?\nassistant:"


@dataclass(frozen=True, slots=True)
class Received:
    """One request the server got."""

    path: str
    body: dict[str, Any]


class OpenAIStreamServer:
    """An OpenAI-compatible HTTP server (``/v1/models``, streaming ``/v1/completions`` and
    ``/v1/chat/completions``) that answers with fixed text and records every request. It
    waits `pause_s` after the first chunk (a chat's, the role alone) and before the usage."""

    def __init__(self, pause_s: float = 0.0) -> None:
        self.received: list[Received] = []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                if self.path != "/v1/models":
                    self.send_error(404)
                    return
                self._json({"object": "list", "data": [{"id": "smol", "object": "model"}]})

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length", "0"))
                body = json.loads(self.rfile.read(length))
                owner.received.append(Received(self.path, body))
                if self.path == "/v1/chat/completions":
                    pieces: list[dict[str, Any]] = [{"delta": {"role": "assistant"}}]
                    pieces += [{"delta": {"content": p}} for p in CHAT_REPLY]
                elif self.path == "/v1/completions":
                    pieces = [{"text": p} for p in COMPLETION_REPLY]
                else:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Connection", "close")
                self.end_headers()
                for n, piece in enumerate(pieces):
                    if n == 1 and pause_s:  # (a chat's first chunk has the role only)
                        time.sleep(pause_s)
                    self._event({"choices": [{"index": 0, **piece}]})
                if pause_s:
                    time.sleep(pause_s)
                self._event({"choices": [], "usage": {"completion_tokens": len(pieces)}})
                self.wfile.write(b"data: [DONE]\n\n")
                self.wfile.flush()
                self.close_connection = True

            def _event(self, data: dict[str, Any]) -> None:
                self.wfile.write(f"data: {json.dumps(data)}\n\n".encode())
                self.wfile.flush()

            def _json(self, data: dict[str, Any]) -> None:
                raw = json.dumps(data).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host!s}:{port}"

    def __enter__(self) -> OpenAIStreamServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(5)


@pytest.fixture
def server() -> Iterator[OpenAIStreamServer]:
    with OpenAIStreamServer() as running:
        yield running


def ticket(call_id: str, seq: int, input_tokens: int = 40, output_tokens: int = 8) -> CallTicket:
    return CallTicket.detached(
        seq=seq,
        call_id=call_id,
        query_id="q",
        query_seq=0,
        tenant="t",
        stage=0,
        call=LLMCall("generate_candidate", input_tokens, output_tokens),
        released_s=0.0,
        deadline_s=100.0 + seq,
        query_deadline_s=200.0,
        remaining_after_s=0.0,
    )


class Worker:
    """A `WorkerState` in front of an engine, fed protobuf dispatches as the link feeds it."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.sent: list[CallReport] = []
        cfg = WorkerConfig(worker_id="w", gpu="A100").resolved()
        self.state = WorkerState(
            engine,
            gpu=cfg.gpu,
            model=cfg.model,
            kv_cache_tokens=cfg.kv_cache_tokens or 0,
            send=lambda _link, report: self.sent.append(report),
        )

    def dispatch(
        self, call: CallTicket, prompt: str, messages: tuple[ChatMessage, ...] = ()
    ) -> DispatchOutcome:
        """Dispatch as the worker's link does: through the DispatchCall message."""
        chat = [wfpb.ChatMessage(role=m.role, content=m.content) for m in messages]
        pb = encode_command(Run.of(call, prompt, "", chat)).dispatch
        return self.state.dispatch(
            dispatch_to_ticket(pb), prompt=pb.prompt, messages=dispatch_messages(pb)
        )

    def finished(self, call_id: str) -> CallFinished | None:
        for event in self.sent:
            if isinstance(event, CallFinished) and event.call_id == call_id:
                return event
        return None

    def streamed(self, call_id: str) -> str:
        return "".join(
            e.text for e in self.sent if isinstance(e, CallTokens) and e.call_id == call_id
        )

    async def finish(self, call_id: str, timeout: float = 10.0) -> CallFinished:
        end = time.monotonic() + timeout
        while (done := self.finished(call_id)) is None:
            assert time.monotonic() < end, f"call {call_id} did not finish"
            await asyncio.sleep(0.01)
        return done

    def run(self, body: Callable[[], Awaitable[T]]) -> T:
        async def main() -> T:
            await self.engine.start()
            events = asyncio.create_task(self.state.run_engine_events())
            try:
                self.state.configure(
                    WelcomeSettings(
                        slot=0,
                        instance="A100#0",
                        clock=ClusterClock(time.time(), 1.0),
                        cluster="A100",
                        queue_policy="urgency",
                        queue_params={"estimate": "call"},
                        heartbeat_interval_s=1.0,
                    )
                )
                return await body()
            finally:
                events.cancel()
                await self.engine.close()

        return asyncio.run(main())


def test_a_call_with_messages_is_a_chat_request_with_those_messages(
    server: OpenAIStreamServer,
) -> None:
    worker = Worker(OpenAIEngine(url=server.url, send_priority=True))

    async def body() -> None:
        assert worker.dispatch(ticket("chat", 0), RENDERED, MESSAGES) is DispatchOutcome.QUEUED
        done = await worker.finish("chat")
        assert done.error == ""
        assert done.text == worker.streamed("chat") == "".join(CHAT_REPLY)
        assert done.output_tokens == len(CHAT_REPLY) + 1  # the server's usage
        assert worker.engine.prompts == {} and worker.engine.messages == {}

    worker.run(body)
    [request] = server.received
    assert request.path == "/v1/chat/completions"
    assert request.body["messages"] == [
        {"role": "system", "content": "You write SQLite queries."},
        {"role": "user", "content": "How many artists are there?"},
    ]
    assert "prompt" not in request.body
    assert request.body["model"] == "smol"  # the first model the server lists
    assert request.body["max_tokens"] == 8 and request.body["stream"] is True
    assert request.body["stream_options"] == {"include_usage": True}
    assert request.body["ignore_eos"] is True and request.body["priority"] == 0


def test_the_first_token_is_the_first_chunk_with_text() -> None:
    """The engine's first output token is when the first chunk carrying generated text
    arrived (not the role-only chunk before it), on the cluster clock as started_s and
    finished_s are."""
    pause = 0.05
    with OpenAIStreamServer(pause_s=pause) as server:
        worker = Worker(OpenAIEngine(url=server.url, model="smol", api="chat"))

        async def body() -> CallFinished:
            worker.dispatch(ticket("ftt", 0), "hello")
            return await worker.finish("ftt")

        done = worker.run(body)
    assert done.error == "" and done.text == "".join(CHAT_REPLY)
    assert done.started_s < done.first_token_s < done.finished_s
    assert done.first_token_s - done.started_s >= pause * 0.9  # the role's chunk is no token
    assert done.finished_s - done.first_token_s >= pause * 0.9


def test_a_call_without_messages_is_a_completion_request(server: OpenAIStreamServer) -> None:
    worker = Worker(OpenAIEngine(url=server.url, model="smol"))

    async def body() -> None:
        worker.dispatch(ticket("plain", 0), "Translate to SQL: how many artists?")
        worker.dispatch(ticket("filler", 1, input_tokens=12), "")
        for call_id in ("plain", "filler"):
            done = await worker.finish(call_id)
            assert done.error == "" and done.text == "".join(COMPLETION_REPLY)

    worker.run(body)
    by_prompt = {r.body["prompt"]: r for r in server.received}
    assert [r.path for r in server.received] == ["/v1/completions"] * 2
    assert "messages" not in server.received[0].body
    assert "Translate to SQL: how many artists?" in by_prompt
    filler = next(p for p in by_prompt if p != "Translate to SQL: how many artists?")
    assert len(filler.split()) == 12  # no prompt: the synthetic one of the declared length


def test_the_chat_api_sends_a_plain_prompt_as_one_user_message(
    server: OpenAIStreamServer,
) -> None:
    worker = Worker(OpenAIEngine(url=server.url, model="smol", api="chat"))

    async def body() -> None:
        worker.dispatch(ticket("one", 0), "hello")
        assert (await worker.finish("one")).text == "".join(CHAT_REPLY)

    worker.run(body)
    [request] = server.received
    assert request.path == "/v1/chat/completions"
    assert request.body["messages"] == [{"role": "user", "content": "hello"}]


def test_a_cancelled_queued_call_leaves_no_messages_behind() -> None:
    spec = WorkerConfig(worker_id="w", gpu="A100", max_batch=1).instance_spec()
    worker = Worker(SimulatedEngine(spec))

    async def body() -> None:
        worker.dispatch(ticket("first", 0, output_tokens=4000), "x")
        worker.dispatch(ticket("waits", 1), RENDERED, MESSAGES)  # queued: max batch 1
        assert worker.engine.messages == {"waits": MESSAGES}
        assert worker.state.cancel("waits")
        assert worker.engine.messages == {} and "waits" not in worker.engine.prompts

    worker.run(body)


def test_the_simulated_engine_answers_from_the_rendered_prompt() -> None:
    """The synthetic responder reads the plain rendering; the messages are dropped."""
    spec = WorkerConfig(worker_id="w", gpu="A100").instance_spec()
    engine = SimulatedEngine(spec)
    engine.prompts["c"] = RENDERED
    engine.messages["c"] = MESSAGES
    assert engine.take_request(ticket("c", 0)) == CallRequest(RENDERED, MESSAGES)
    assert engine.take_request(ticket("c", 0)) == CallRequest(None, ())
    engine.prompts["d"], engine.messages["d"] = RENDERED, MESSAGES
    assert engine.take_prompt(ticket("d", 0)) == RENDERED and engine.messages == {}
