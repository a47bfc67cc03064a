"""``profile``: measure an OpenAI-compatible server into a ``measured:FILE`` profile
(docs/real-engines.md, "Profiling a server"; the format: docs/hardware.md).

- prefill: time to first token of one request alone, by prompt length (``max_tokens`` 1);
- decode: B concurrent streams of a prompt length each; the step time is the gap between
  streamed tokens while all B are decoding (after the last one's first token, before the
  first one ends), so the prefills of the batch do not count as decode steps.

Prompts are random words from a seeded RNG, a fresh draw per request with a first 32 words
(all of them, in a shorter prompt) that no other request shares, so no prompt is a
prefix-cache hit (``prefix_cached: false``). Prompt lengths are what the server's usage says
it read, not what was asked for. Needs ``httpx`` (the ``mesh`` extra), imported when the
command runs.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import importlib
import json
import random
import re
import shlex
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from tqdm import tqdm

from hexgen_cli.options import PROG, info, positive_int, print_json, print_rows
from hexgen_flow.calibration.profile_file import read_profile_file
from hexgen_flow.errors import HexgenFlowError
from hexgen_flow.hardware import (
    GPU_MEMORY_UTILIZATION,
    PRECISIONS,
    parse_precision,
    resolve_model,
)

__all__ = ["ProfileError", "register"]

_WORD_TEXT = (
    "time year people way day man thing woman life child world school state family student "
    "group country problem hand part place case week company system program question work "
    "number night point home water room mother area money story fact month lot right study "
    "book eye job word business issue side kind head house service friend father power hour "
    "game line end member law car city name team minute idea kid body back parent face level "
    "office door health person art war history party result change morning reason research "
    "girl moment air teacher force education river table music window garden paper"
)
_WORDS = tuple(_WORD_TEXT.split())
"""Common words, mostly one token each in a BPE vocabulary."""
_UNIQUE_WORDS = 32  # no two prompts share their first 32 words: no shared cache block
_PROBE_WORDS = (64, 512)  # two probes fit the server's tokens per word (and warm it up)


class ProfileError(HexgenFlowError):
    """The server could not be profiled (unreachable, unknown model, an error answer)."""


def _int_list(text: str) -> list[int]:
    try:
        values = sorted({int(v) for v in text.split(",") if v.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers like 1,2,4, got {text!r}") from None
    if not values or values[0] < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def register(commands: Any) -> None:
    """Add ``profile`` to the command parser."""
    p = commands.add_parser(
        "profile",
        help="measure an OpenAI-compatible server into a measured:FILE latency profile",
        description="Measure a running OpenAI-compatible server (e.g. vLLM): time to first "
        "token by prompt length, and the decode step by batch size and context, with random "
        "prompts that defeat prefix caching; write the profile that `--calibration "
        "measured:FILE` reads (docs/real-engines.md).",
    )
    p.add_argument("--openai-url", required=True, metavar="URL", help="e.g. http://host:8000")
    p.add_argument("--model", required=True, metavar="NAME", help="the model the server serves")
    p.add_argument(
        "--profile-model",
        default=None,
        metavar="NAME",
        help="the catalogue model the profile is of (default: --model)",
    )
    p.add_argument("--out", required=True, type=Path, metavar="FILE.yaml")
    p.add_argument(
        "--gpu",
        required=True,
        metavar="NAME",
        help="the catalogue GPU, or a cluster file's gpus: entry, that the profile describes",
    )
    p.add_argument("--tp", type=positive_int, default=1, metavar="N", help="(default 1)")
    p.add_argument("--precision", choices=PRECISIONS, default="bf16", help="(default bf16)")
    for option, default, what in (
        ("--input-tokens", [64, 256, 512, 1024, 1536], "prefill prompt lengths"),
        ("--batches", [1, 2, 4, 8], "decode batch sizes, 1 among them"),
        ("--contexts", [256, 1024], "decode prompt lengths"),
    ):
        p.add_argument(option, type=_int_list, default=default, metavar="LIST",
                       help=f"{what} (default {','.join(map(str, default))})")  # fmt: skip
    p.add_argument("--output-tokens", type=positive_int, default=32, metavar="M",
                   help="tokens each decode stream generates (default 32)")  # fmt: skip
    p.add_argument("--repeats", type=positive_int, default=3, metavar="N",
                   help="measurements per point, the median kept (default 3)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0, help="the prompts' RNG seed (default 0)")
    p.add_argument("--timeout-s", type=positive_int, default=600, metavar="S",
                   help="per request (default 600)")  # fmt: skip
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(handler=_cmd_profile)


def _command(args: argparse.Namespace) -> str:
    """The run as a command line that repeats it."""
    parts = [PROG, "profile", "--openai-url", args.openai_url, "--model", args.model]
    if args.profile_model:
        parts += ["--profile-model", args.profile_model]
    parts += ["--gpu", args.gpu, "--tp", str(args.tp), "--precision", args.precision]
    for option in ("input_tokens", "batches", "contexts"):
        parts += [f"--{option.replace('_', '-')}", ",".join(map(str, getattr(args, option)))]
    parts += ["--output-tokens", str(args.output_tokens), "--repeats", str(args.repeats)]
    parts += ["--seed", str(args.seed), "--out", str(args.out)]
    return shlex.join(parts)


# ------------------------------------------------------------------------------ the server


@dataclass
class _Stream:
    """One streamed completion: when its text chunks arrived, and what usage said."""

    sent: float
    chunks: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0


class _Server:
    def __init__(self, httpx: Any, url: str, model: str, timeout_s: float, seed: int) -> None:
        self.httpx = httpx
        self.root = url.rstrip("/").removesuffix("/v1")
        self.model = model
        self.client = httpx.AsyncClient(
            base_url=self.root,
            timeout=httpx.Timeout(timeout_s, connect=10.0),
            limits=httpx.Limits(max_connections=None),
        )
        self.rng = random.Random(seed)
        self.seen: set[tuple[str, ...]] = set()
        self.tokens_per_word = (0.0, 1.0)  # (intercept, slope): refit by `probe`

    async def get(self, path: str) -> Any:
        """GET `path`: the response, or None when the server does not have it (404)."""
        try:
            response = await self.client.get(path, timeout=10.0)
        except self.httpx.HTTPError as exc:
            raise ProfileError(
                f"cannot reach {self.root}{path}: {type(exc).__name__}: {exc}"
            ) from None
        if response.status_code == 404:
            return None
        if response.status_code >= 400:
            raise ProfileError(f"{self.root}{path} answered HTTP {response.status_code}")
        return response

    def prompt(self, tokens: int) -> str:
        intercept, slope = self.tokens_per_word
        words = max(1, round((tokens - intercept) / slope))
        while True:
            text = [self.rng.choice(_WORDS) for _ in range(words)]
            # A prompt shorter than the head is checked whole (a 16-token call is profiled
            # with a 16-token prompt, not a padded one).
            head = tuple(text[:_UNIQUE_WORDS])
            if head not in self.seen:
                self.seen.add(head)
                return " ".join(text)

    async def complete(self, prompt: str, max_tokens: int) -> _Stream:
        body = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": True,  # vLLM's: exactly max_tokens, whatever the model says
        }
        stream = _Stream(time.perf_counter())
        try:
            async with self.client.stream("POST", "/v1/completions", json=body) as response:
                if response.status_code >= 400:
                    detail = (await response.aread()).decode("utf-8", "replace")
                    raise ProfileError(
                        f"{self.root}/v1/completions answered HTTP {response.status_code}: "
                        f"{' '.join(detail.split())[:300]}"
                    )
                async for line in response.aiter_lines():
                    self._read(line, stream)
        except self.httpx.HTTPError as exc:
            raise ProfileError(f"{self.root}: {type(exc).__name__}: {exc}") from None
        if not stream.prompt_tokens or not stream.chunks:
            raise ProfileError(
                f"{self.root} streamed no text or no usage (stream_options.include_usage): "
                "cannot time tokens or count the prompt's"
            )
        return stream

    @staticmethod
    def _read(line: str, stream: _Stream) -> None:
        now = time.perf_counter()
        data = line.removeprefix("data:").strip()
        if not line.startswith("data:") or data == "[DONE]":
            return
        chunk = json.loads(data)
        if chunk.get("error"):
            raise ProfileError(f"the server reported an error: {chunk['error']}")
        if any(isinstance(c, dict) and c.get("text") for c in chunk.get("choices") or ()):
            stream.chunks.append(now)
        usage = chunk.get("usage") or {}
        stream.prompt_tokens = usage.get("prompt_tokens") or stream.prompt_tokens
        stream.completion_tokens = usage.get("completion_tokens") or stream.completion_tokens

    async def probe(self) -> None:
        """Fit the server's prompt tokens per word (tokenizers differ)."""
        counts = [(await self.complete(self.prompt(n), 1)).prompt_tokens for n in _PROBE_WORDS]
        slope = (counts[1] - counts[0]) / (_PROBE_WORDS[1] - _PROBE_WORDS[0])
        self.tokens_per_word = (counts[0] - slope * _PROBE_WORDS[0], max(slope, 0.1))


async def _server_facts(server: _Server) -> dict[str, Any]:
    """What the server says about itself: its models, max context, version, KV capacity."""
    response = await server.get("/v1/models")
    if response is None:
        raise ProfileError(f"{server.root} has no /v1/models: not an OpenAI-compatible server?")
    cards = {str(card.get("id")): card for card in response.json().get("data", [])}
    if server.model not in cards:
        raise ProfileError(
            f"{server.root} does not serve {server.model!r}; it serves: {', '.join(cards)}"
        )
    card = cards[server.model]
    version = await server.get("/version")
    facts: dict[str, Any] = {
        "server": f"{card.get('owned_by') or 'an OpenAI-compatible server'}"
        + (f" {version.json().get('version')}" if version is not None else ""),
        "max_context_tokens": card.get("max_model_len"),
        "kv_capacity_tokens": None,
    }
    metrics = await server.get("/metrics")
    info_line = re.search(r"^vllm:cache_config_info\{(.*)\}", metrics.text if metrics else "", re.M)
    labels = dict(re.findall(r'(\w+)="([^"]*)"', info_line.group(1))) if info_line else {}
    if labels.get("kv_cache_size_tokens", "").isdigit():  # newer vLLM says it outright
        facts["kv_capacity_tokens"] = int(labels["kv_cache_size_tokens"])
    elif labels.get("num_gpu_blocks", "").isdigit() and labels.get("block_size", "").isdigit():
        facts["kv_capacity_tokens"] = int(labels["num_gpu_blocks"]) * int(labels["block_size"])
    return facts


# ---------------------------------------------------------------------------- measurement


def _decode_step(streams: list[_Stream], batch: int, context: int) -> float:
    """The mean gap between a stream's tokens while every stream of the batch decodes."""
    start = max(s.chunks[0] for s in streams)
    end = min(s.chunks[-1] for s in streams)
    steps = []
    for s in streams:
        inside = [t for t in s.chunks if start <= t <= end]
        if len(inside) >= 2:
            # A server may stream several tokens per chunk: count tokens, not chunks.
            per_chunk = max(s.completion_tokens / len(s.chunks), 1.0)
            steps.append((inside[-1] - inside[0]) / (len(inside) - 1) / per_chunk)
    if not steps:
        raise ProfileError(
            f"batch {batch} at {context} tokens never decoded together (the server runs "
            "fewer sequences at once, e.g. vLLM's --max-num-seqs; or raise --output-tokens)"
        )
    return statistics.median(steps)


async def _measure(
    server: _Server, args: argparse.Namespace, bar: tqdm[Any]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    await server.probe()
    # The plan runs `repeats` times over, every point once per round, rather than each point
    # `repeats` times in a row: on a machine whose load varies (a shared CPU), every point's
    # median then spans the whole run, and a burst of load cannot bend one point alone.
    points = [(b, c) for c in args.contexts for b in args.batches]
    ttfts: dict[int, list[_Stream]] = {n: [] for n in args.input_tokens}
    steps: dict[tuple[int, int], list[float]] = {p: [] for p in points}
    prompts: dict[tuple[int, int], list[int]] = {p: [] for p in points}
    for _ in range(args.repeats):
        for n in args.input_tokens:
            ttfts[n].append(await server.complete(server.prompt(n), 1))
            bar.update()
        for batch, context in points:
            streams = await asyncio.gather(*(
                server.complete(server.prompt(context), args.output_tokens)
                for _ in range(batch)
            ))  # fmt: skip
            steps[batch, context].append(_decode_step(list(streams), batch, context))
            prompts[batch, context] += [s.prompt_tokens for s in streams]
            bar.update()
    prefill = [
        {
            "input_tokens": round(statistics.median(r.prompt_tokens for r in runs)),
            "ttft_s": round(statistics.median(r.chunks[0] - r.sent for r in runs), 5),
        }
        for runs in ttfts.values()
    ]
    decode = [
        {
            "batch": batch,
            "context_tokens": round(statistics.median(prompts[batch, context])),
            "decode_step_s": round(statistics.median(steps[batch, context]), 6),
        }
        for batch, context in points
    ]
    return prefill, decode


def _check_plan(args: argparse.Namespace, facts: dict[str, Any]) -> list[str]:
    """Refuse what the server cannot run; return notes on what it might run badly."""
    limit, kv = facts["max_context_tokens"], facts["kv_capacity_tokens"]
    longest = max(max(args.input_tokens) + 1, max(args.contexts) + args.output_tokens)
    if isinstance(limit, int) and longest > limit:
        raise ProfileError(
            f"a request of {longest} tokens (prompt + output) exceeds the server's max context "
            f"of {limit} tokens: lower --input-tokens, --contexts or --output-tokens"
        )
    notes = [] if isinstance(limit, int) else ["the server does not say its max context"]
    if kv is None:
        notes.append("KV capacity: not known (the server's /metrics has no vllm:cache_config_info)")
    elif max(args.batches) * (max(args.contexts) + args.output_tokens) > kv:
        notes.append(f"the largest batch needs more than the server's {kv} KV tokens: expect "
                     "preemption in its rows")  # fmt: skip
    return notes


def _document(
    args: argparse.Namespace, facts: dict[str, Any], rows: tuple[list[Any], list[Any]]
) -> str:
    today = datetime.datetime.now(datetime.UTC).date().isoformat()
    source = (
        f"{facts['server']} at {args.openai_url} serving {args.model}, random prompts "
        f"(seed {args.seed}, median of {args.repeats}), {today}; `{_command(args)}`"
    )
    doc = {
        "model": args.profile_model or args.model,
        "gpu": args.gpu,
        "tp": args.tp,
        "precision": args.precision,
        "prefix_cached": False,
        "source": source,
        "prefill": rows[0],
        "decode": rows[1],
    }
    kv, limit = facts["kv_capacity_tokens"], facts["max_context_tokens"]
    header = [
        f"Measured by `{PROG} profile` on {today} (docs/real-engines.md, 'Profiling a server').",
        f"server max context: {limit if limit is not None else 'not said'} tokens; "
        f"KV capacity: {f'{kv} tokens' if kv is not None else 'not known'}",
    ]
    body = yaml.safe_dump(doc, sort_keys=False, width=100, default_flow_style=None)
    return "".join(f"# {line}\n" for line in header) + body


def _cmd_profile(args: argparse.Namespace) -> int:
    try:
        httpx = importlib.import_module("httpx")
    except ImportError:
        raise ProfileError(
            f"`{PROG} profile` needs httpx: pip install 'hexgen-flow[mesh]'"
        ) from None
    model = resolve_model(args.profile_model or args.model)  # an unknown name fails here
    precision = parse_precision(args.precision, "--precision")
    if args.batches[0] != 1 or len(args.batches) < 2:
        # what measured:FILE needs for the batch slowdown
        raise ProfileError(f"--batches must hold 1 and a larger batch, got {args.batches}")
    if not args.out.parent.is_dir():
        raise ProfileError(f"--out {args.out}: no folder {args.out.parent}")

    async def run() -> tuple[dict[str, Any], list[str], tuple[list[Any], list[Any]]]:
        server = _Server(httpx, args.openai_url, args.model, args.timeout_s, args.seed)
        try:
            facts = await _server_facts(server)
            notes = _check_plan(args, facts)
            for note in notes:
                info(f"note: {note}")
            total = args.repeats * (len(args.input_tokens) + len(args.contexts) * len(args.batches))
            with tqdm(total=total, desc="profile", unit="point", leave=False) as bar:
                rows = await _measure(server, args, bar)
            return facts, notes, rows
        finally:
            await server.client.aclose()

    facts, notes, rows = asyncio.run(run())
    tmp = args.out.with_name(args.out.name + ".tmp")
    tmp.write_text(_document(args, facts, rows))
    try:
        read_profile_file(tmp, str(args.out))  # what measured:FILE will read, checked first
    except HexgenFlowError:
        tmp.unlink()
        raise
    tmp.replace(args.out)
    kv = facts["kv_capacity_tokens"]
    # The memory_gib of a gpus: entry whose derived KV capacity is the server's.
    memory_gib = None if kv is None else round(
        (kv * model.kv_bytes_per_token + model.weight_bytes(precision))
        / (args.tp * GPU_MEMORY_UTILIZATION * 2**30), 3,
    )  # fmt: skip
    doc = {"out": str(args.out), **facts, "memory_gib_for_same_kv": memory_gib, "notes": notes,
           "prefill": rows[0], "decode": rows[1]}  # fmt: skip
    if args.json:
        print_json(doc)
        return 0
    print_rows([
        ("profile", f"{args.out} ({args.profile_model or args.model} on {args.gpu})"),
        ("server", f"{facts['server']} at {args.openai_url}"),
        ("max_context_tokens", str(facts["max_context_tokens"] or "not said")),
        ("kv_capacity_tokens", "not known" if kv is None else f"{kv:,} (a gpus: entry with "
         f"memory_gib {memory_gib} gives the same)"),
        *((f"prefill {r['input_tokens']}", f"ttft {r['ttft_s']:.4f} s") for r in rows[0]),
        *((f"decode b={r['batch']} c={r['context_tokens']}", f"{r['decode_step_s'] * 1e3:.2f} ms")
          for r in rows[1]),
    ])  # fmt: skip
    return 0
