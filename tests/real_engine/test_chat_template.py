"""The ``vllm`` engine builds a chat call's prompt with the model's chat template.

It needs the model's real tokenizer (transformers), which only the vLLM venv has, so the
engine's prompt building runs there, in a subprocess under ``HEXGEN_VLLM_PYTHON``: the
tokenizer of the SmolLM2 folder is loaded as vLLM's engine holds it (no vLLM engine is
started: this takes seconds), and `VllmEngine.engine_prompt` is asked for a chat call and
for a plain prompt. The ``openai`` engine's chat path is run against a real vLLM server (conftest's
`vllm_server`) here, and against a recording HTTP server in tests/test_worker_chat.py.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
from typing import Any

import pytest

from hexgen_flow.runtime import CallTicket
from hexgen_flow.workload import LLMCall
from hexgen_service.clock import ClusterClock
from hexgen_worker.engines import OpenAIEngine
from hexgen_worker.engines.base import ChatMessage
from hexgen_worker.events import CallFinished, CallTokens

pytestmark = pytest.mark.real_engine

SCRIPT = r"""
import json, sys
from transformers import AutoTokenizer
from hexgen_flow.runtime import CallTicket
from hexgen_flow.workload import LLMCall
from hexgen_worker.engines.base import CallRequest, ChatMessage
from hexgen_worker.engines.vllm import VllmEngine, chat_prompt

model = sys.argv[1]
tokenizer = AutoTokenizer.from_pretrained(model)
engine = VllmEngine(model=model, max_context_tokens=2048)
engine.tokenizer = tokenizer

def ticket(input_tokens, output_tokens):
    return CallTicket.detached(
        seq=0, call_id="c", query_id="q", query_seq=0, tenant="t", stage=0,
        call=LLMCall("generate_candidate", input_tokens, output_tokens), released_s=0.0,
        deadline_s=1.0, query_deadline_s=1.0, remaining_after_s=0.0,
    )

messages = (
    ChatMessage("system", "You write SQLite queries."),
    ChatMessage("user", "How many artists are there?"),
)
rendered = "system: You write SQLite queries.\nuser: How many artists are there?\nassistant:"
chat, chat_max = engine.engine_prompt(ticket(40, 64), CallRequest(rendered, messages))
long_chat, long_max = engine.engine_prompt(ticket(40, 4000), CallRequest(rendered, messages))
plain, plain_max = engine.engine_prompt(ticket(40, 64), CallRequest(rendered))
# A long prompt: passed when declared near its size, failed when declared far below it.
long_text = " ".join(f"column_{i} INTEGER" for i in range(2000))
long_tokens = len(tokenizer.encode(long_text))
engine.engine_prompt(ticket(long_tokens // 2, 8), CallRequest(long_text))
try:
    engine.engine_prompt(ticket(10, 8), CallRequest(long_text))
    refused = ""
except ValueError as exc:
    refused = str(exc)
print(json.dumps({
    "long_tokens": long_tokens,
    "refused": refused,
    "chat_ids": chat["prompt_token_ids"],
    "chat_keys": sorted(chat),
    "chat_max": chat_max,
    "long_max": long_max,
    "decoded": tokenizer.decode(chat["prompt_token_ids"]),
    "template": chat_prompt(tokenizer, messages),
    "bos": tokenizer.bos_token_id,
    "plain": plain,
    "plain_max": plain_max,
}))
"""


def test_a_chat_call_is_prompted_through_the_models_chat_template(real_engines: Any) -> None:
    """`real_engines`: conftest's `RealEngines` (the vLLM Python, the model folder)."""
    done = subprocess.run(
        [real_engines.python, "-c", SCRIPT, str(real_engines.model_dir)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**real_engines.env, "HF_HUB_OFFLINE": "1"},
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    # SmolLM2's template (ChatML): the system and user turns, then the assistant's opened.
    assert out["template"] == (
        "<|im_start|>system\nYou write SQLite queries.<|im_end|>\n"
        "<|im_start|>user\nHow many artists are there?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert out["chat_keys"] == ["prompt_token_ids"]
    assert out["decoded"] == out["template"]  # tokenised as is: no special token added
    assert out["chat_ids"].count(out["bos"]) == 3  # <|im_start|> per turn, no extra BOS
    assert out["chat_max"] == 64
    assert out["long_max"] == 2048 - len(out["chat_ids"])  # cut to what the context leaves
    # Without messages: the rendered prompt, as before.
    assert out["plain"] == {
        "prompt": "system: You write SQLite queries.\nuser: How many artists are there?\nassistant:"
    }
    assert out["plain_max"] == 64
    # A prompt the model's tokenizer finds far longer than declared fails the call.
    assert out["long_tokens"] > 8 * 10 + 1024
    assert out["refused"].startswith(
        f"call.input_tokens: declared 10, but the prompt is {out['long_tokens']} tokens"
    ), out["refused"]


def _ticket(call_id: str, output_tokens: int) -> CallTicket:
    return CallTicket.detached(
        seq=0,
        call_id=call_id,
        query_id="q",
        query_seq=0,
        tenant="t",
        stage=0,
        call=LLMCall("generate_candidate", 40, output_tokens),
        released_s=0.0,
        deadline_s=100.0,
        query_deadline_s=200.0,
        remaining_after_s=0.0,
    )


def test_the_openai_engine_streams_a_chat_call_from_a_vllm_server(vllm_server: str) -> None:
    """A call with messages goes to vLLM's /v1/chat/completions (the server applies the
    template; a /v1/completions request would have no `messages`), streams ``delta.content``
    chunks and counts the server's usage; one without goes to /v1/completions as before."""
    engine = OpenAIEngine(url=vllm_server, send_priority=True)
    engine.set_clock(ClusterClock.starting_now(1.0))

    async def run() -> dict[str, tuple[CallFinished, str]]:
        await engine.start()
        try:
            engine.prompts["chat"] = "system: You write SQL.\nuser: Count the artists.\nassistant:"
            engine.messages["chat"] = (
                ChatMessage("system", "You write SQL."),
                ChatMessage("user", "Count the artists."),
            )
            engine.prompts["plain"] = "SELECT COUNT(*) FROM"
            for call_id in ("chat", "plain"):
                engine.admit(_ticket(call_id, 16), engine.clock.now())
            done: dict[str, tuple[CallFinished, str]] = {}
            streamed: dict[str, str] = {"chat": "", "plain": ""}
            while len(done) < 2:
                event = await asyncio.wait_for(engine.next_event(), 240)
                if isinstance(event, CallTokens):
                    streamed[event.call_id] += event.text
                elif isinstance(event, CallFinished):
                    done[event.call_id] = (event, streamed[event.call_id])
            return done
        finally:
            await engine.close()

    done = asyncio.run(run())
    for call_id in ("chat", "plain"):
        finished, streamed = done[call_id]
        assert finished.error == "", finished.error
        assert finished.output_tokens == 16  # ignore_eos: exactly max_tokens, per usage
        assert finished.text and finished.text == streamed
