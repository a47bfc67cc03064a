"""The Text-to-SQL agent: a client of any OpenAI-compatible endpoint (the HexGen-Flow
gateway, a vLLM server, ...) through the official ``openai`` SDK.

One question is one workflow: every LLM call carries ``X-Hexgen-Workflow`` and its stage in
``X-Hexgen-Stage`` (plus ``X-Hexgen-Slo-S``, and ``X-Hexgen-Template: chess`` on the first
call), so that the gateway can schedule the calls as the stages of one deadline-bound query.
Any other server ignores the headers. The pipeline (docs/text-to-sql.md, "The agent"):

1. ``extract_keywords``: one call; its answer parsed as a keyword list, or
   `schema.extract_keywords` when it is unusable;
2. ``information_retriever``: lexical `link_schema` over names and values (no call);
3. ``generate_candidate``: N calls in parallel, each answer's SQL run in the `Sandbox`
   (in threads);
4. ``revise``: for each candidate that failed or returned no rows, a call whose prompt
   carries the SQL and the sandbox's reason, for at most `rounds` rounds;
5. selection by execution-result vote (`vote`);
6. the workflow is closed (``POST /v1/workflows/{id}/close``, the gateway's own endpoint,
   so that the coordinator ends it now rather than after its idle timeout); the answer's
   ``arrival_s``/``finished_s`` (cluster seconds) give the workflow's latency on the
   cluster clock. A server without the endpoint (404) is fine: the latency is then the
   wall time x `time_scale`.

Needs the ``openai`` package (``pip install openai``); the rest of `hexgen_sql` does not.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
import urllib.parse
import uuid
from pathlib import Path
from typing import Any

import httpx
import openai
from openai import AsyncOpenAI
from openai.types.chat import ChatCompletionMessageParam

from hexgen_sql import prompts
from hexgen_sql.results import (
    AgentResult,
    CallRecord,
    Candidate,
    StageTiming,
    needs_revision,
    vote,
)
from hexgen_sql.sandbox import Sandbox, SandboxError
from hexgen_sql.schema import (
    Schema,
    extract_keywords,
    link_schema,
    read_schema,
    render_schema,
)

__all__ = [
    "AgentResult",
    "CallRecord",
    "Candidate",
    "SqlAgent",
    "StageTiming",
    "needs_revision",
    "vote",
]

HEADER_WORKFLOW = "X-Hexgen-Workflow"
HEADER_STAGE = "X-Hexgen-Stage"
HEADER_SLO = "X-Hexgen-Slo-S"
HEADER_TEMPLATE = "X-Hexgen-Template"
HEADER_DEADLINE = "X-Hexgen-Deadline-S"
HEADER_QUERY = "X-Hexgen-Query"
"""The gateway's headers (hexgen_gateway.mapping; repeated here: a client does not import
a service)."""
TEMPLATE = "chess"
KEYWORDS_MAX_TOKENS = 64
SQL_MAX_TOKENS = 256
NO_SQL = "the answer held no SQL query"


class SqlAgent:
    """Answers questions over one SQLite database through `client` (see the module)."""

    def __init__(
        self,
        client: AsyncOpenAI,
        db: str | Path,
        *,
        model: str | None = None,
        candidates: int = 3,
        rounds: int = 2,
        slo_s: float | None = None,
        time_scale: float = 1.0,
        top_k: int = 4,
        schema: Schema | None = None,
        sandbox: Sandbox | None = None,
    ) -> None:
        if candidates < 1 or rounds < 0:
            raise ValueError("candidates must be >= 1 and rounds >= 0")
        self.client = client
        self.db = Path(db)
        self.model = model
        self.candidates = candidates
        self.rounds = rounds
        self.slo_s = slo_s
        self.time_scale = time_scale
        self.top_k = top_k
        self.schema = schema if schema is not None else read_schema(self.db)
        self.sandbox = sandbox if sandbox is not None else Sandbox(self.db)

    async def resolve_model(self) -> str:
        """The model to ask: the one given, else the first the server lists."""
        if self.model is None:
            models = await self.client.models.list()
            if not models.data:
                raise RuntimeError("the server lists no models")
            self.model = models.data[0].id
        return self.model

    async def answer(self, question: str, *, workflow: str | None = None) -> AgentResult:
        return await _Run(self, question, workflow or f"sql-{uuid.uuid4().hex[:12]}").run()


class _Run:
    """One question's pass through the pipeline."""

    def __init__(self, agent: SqlAgent, question: str, workflow: str) -> None:
        self.agent = agent
        self.question = question
        self.workflow = workflow
        self.calls: list[CallRecord] = []
        self.stages: list[StageTiming] = []
        self.started = time.perf_counter()

    def _now(self) -> float:
        return time.perf_counter() - self.started

    async def _chat(self, stage: str, prompt: str, max_tokens: int, round_: int = 0) -> str:
        agent = self.agent
        headers = {HEADER_WORKFLOW: self.workflow, HEADER_STAGE: stage}
        if agent.slo_s is not None:
            headers[HEADER_SLO] = f"{agent.slo_s:g}"
        if not self.calls and stage == "extract_keywords":
            headers[HEADER_TEMPLATE] = TEMPLATE
        messages: list[ChatCompletionMessageParam] = [
            {"role": "system", "content": prompts.SYSTEM},
            {"role": "user", "content": prompt},
        ]
        start = self._now()
        raw = await agent.client.chat.completions.with_raw_response.create(
            model=await agent.resolve_model(),
            messages=messages,
            max_tokens=max_tokens,
            temperature=0.0,
            extra_headers=headers,
        )
        completion = raw.parse()
        text = (completion.choices[0].message.content or "") if completion.choices else ""
        usage = completion.usage
        deadline = raw.headers.get(HEADER_DEADLINE)
        self.calls.append(
            CallRecord(
                stage=stage,
                prompt=prompt,
                text=text,
                prompt_tokens=usage.prompt_tokens if usage else _estimate(prompt),
                completion_tokens=usage.completion_tokens if usage else _estimate(text),
                start_s=start,
                end_s=self._now(),
                round=round_,
                query_id=raw.headers.get(HEADER_QUERY),
                deadline_s=_float(deadline),
            )
        )
        return text

    def _stage(self, stage: str, start: float, calls: int) -> None:
        self.stages.append(StageTiming(stage, start, self._now(), calls))

    async def _execute(self, candidate: Candidate, sql: str | None, round_: int) -> None:
        candidate.round = round_
        candidate.sql = sql or ""
        if sql is None:
            candidate.error, candidate.result = NO_SQL, None
        else:
            outcome = await asyncio.to_thread(self.agent.sandbox.try_run, sql)
            if isinstance(outcome, SandboxError):
                candidate.error, candidate.result = outcome.reason, None
            else:
                candidate.error, candidate.result = None, outcome
        candidate.history.append((round_, candidate.sql, candidate.error))

    async def run(self) -> AgentResult:
        try:
            result = await self._pipeline()
        except BaseException:
            if self.calls:  # the workflow is open: do not leave it to the idle timeout
                with contextlib.suppress(Exception):
                    await asyncio.shield(self._close())
            raise
        result.closed = await self._close()
        if result.closed and isinstance(result.closed.get("deadline_s"), int | float):
            result.deadline_s = float(result.closed["deadline_s"])
        return result

    async def _close(self) -> dict[str, Any] | None:
        """Close the workflow at the gateway; None when the server has no such endpoint."""
        path = f"/workflows/{urllib.parse.quote(self.workflow, safe='')}/close"
        try:
            response = await self.agent.client.post(path, cast_to=httpx.Response, body={})
            answer = response.json()
        except (openai.APIError, ValueError):
            return None
        return answer if isinstance(answer, dict) else None

    async def _pipeline(self) -> AgentResult:
        agent = self.agent
        start = self._now()
        answer = await self._chat(
            "extract_keywords", prompts.keywords_prompt(self.question), KEYWORDS_MAX_TOKENS
        )
        keywords = prompts.parse_keywords(answer) or extract_keywords(self.question)
        self._stage("extract_keywords", start, 1)

        start = self._now()
        linked = link_schema(agent.schema, keywords, top_k=agent.top_k)
        schema_text = render_schema(linked)
        self._stage("information_retriever", start, 0)

        start = self._now()
        candidates = [Candidate(i, "") for i in range(agent.candidates)]

        async def generate(candidate: Candidate) -> None:
            prompt = prompts.candidate_prompt(self.question, schema_text, candidate.index)
            text = await self._chat("generate_candidate", prompt, SQL_MAX_TOKENS)
            await self._execute(candidate, prompts.extract_sql(text), 0)

        await asyncio.gather(*(generate(c) for c in candidates))
        self._stage("generate_candidate", start, len(candidates))

        for round_ in range(1, agent.rounds + 1):
            failing = [c for c in candidates if needs_revision(c)]
            if not failing:
                break
            start = self._now()

            async def revise(candidate: Candidate, round_: int = round_) -> None:
                error = candidate.error or prompts.NO_ROWS
                prompt = prompts.revise_prompt(
                    self.question, schema_text, candidate.sql, error, round_
                )
                text = await self._chat("revise", prompt, SQL_MAX_TOKENS, round_)
                await self._execute(candidate, prompts.extract_sql(text), round_)

            await asyncio.gather(*(revise(c) for c in failing))
            self._stage("revise", start, len(failing))

        start = self._now()
        chosen_index = vote([c.result for c in candidates])
        self._stage("select", start, 0)
        result = AgentResult(
            question=self.question,
            workflow=self.workflow,
            sql=candidates[0].sql,
            columns=[],
            rows=[],
            candidates=candidates,
            stages=self.stages,
            calls=self.calls,
            latency_s=self._now(),
            time_scale=agent.time_scale,
            slo_s=agent.slo_s,
            deadline_s=self.calls[0].deadline_s if self.calls else None,
        )
        if chosen_index is None:
            errors = "; ".join(dict.fromkeys(c.error or "" for c in candidates))
            result.error = f"no candidate ran: {errors}"
            return result
        chosen = candidates[chosen_index]
        assert chosen.result is not None
        result.sql = chosen.sql
        result.columns = list(chosen.result.columns)
        result.rows = [tuple(r) for r in chosen.result.rows]
        return result


def _estimate(text: str) -> int:
    return max(1, math.ceil(len(text) / 4))


def _float(text: str | None) -> float | None:
    try:
        return float(text) if text else None
    except ValueError:
        return None
