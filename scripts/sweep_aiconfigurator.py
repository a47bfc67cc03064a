"""Sweep NVIDIA aiconfigurator into prefill and decode-step tables, one TSV per model.

Runs under a Python that has PyPI `aiconfigurator` installed (its own virtual environment,
not the project's; nothing here imports hexgen_flow):

    python3 -m venv /path/to/aic-venv && /path/to/aic-venv/bin/pip install aiconfigurator
    /path/to/aic-venv/bin/python scripts/sweep_aiconfigurator.py \
        --out-dir src/hexgen_flow/data/profiles/aiconfigurator

Every point is one static (no in-flight batching) estimate of aiconfigurator's vLLM backend,
called through its Python API (`aiconfigurator.cli.api.cli_estimate`, the function behind
`aiconfigurator cli estimate`; a process per point costs ~3 s, the API ~0.5 s):

- prefill: `static_ctx`, batch 1, `isl` prompt tokens, osl 1; TTFT_ms is the prefill time.
- decode: `static_gen`, `bs` sequences each holding `isl` tokens of context, osl 2; TPOT_ms is
  one decode step of the whole batch. static_gen's TPOT is its generation time / (osl - 1)
  with no fixed part, so osl 2 is exactly one step at context isl (a longer osl averages the
  steps over a context that grows by osl tokens, and returns the same figure within 0.1%).

Both database modes are swept: SILICON (interpolated from kernels measured on the GPU) and SOL
(speed of light, the tool's own roofline). A point whose memory does not fit the GPUs (the
tool's OOM check), or that the tool refuses, is written as a `skipped` row with the reason.

Resumable: rows are appended as they come, and a point already in the output file is not run
again, so an interrupted sweep loses at most the point in flight.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import logging
import shlex
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

COLUMNS = (
    "model",
    "system",
    "tp",
    "phase",
    "bs",
    "isl",
    "osl",
    "mode",
    "TTFT_ms",
    "TPOT_ms",
    "version",
    "backend",
    "mem_GiB",
    "status",
    "note",
)
KEY_COLUMNS = ("model", "system", "tp", "phase", "bs", "isl", "osl", "mode")
SCRIPT = "scripts/sweep_aiconfigurator.py"

# The instances: model -> (aiconfigurator system, tensor-parallel degree). The tp we serve at
# (the catalogue's tensor_parallel), plus tp 8 for Llama-3.1-70B. a100_pcie has a system
# description but no measured kernels in aiconfigurator, so only its SOL rows have numbers.
INSTANCES: dict[str, tuple[tuple[str, int], ...]] = {
    "meta-llama/Meta-Llama-3.1-70B": (
        ("a100_sxm", 4),
        ("a100_sxm", 8),
        ("h100_sxm", 4),
        ("h100_sxm", 8),
        ("h200_sxm", 2),
        ("h200_sxm", 4),
        ("h200_sxm", 8),
        ("l40s", 4),
        ("l40s", 8),
        ("a100_pcie", 4),
        ("a100_pcie", 8),
    ),
    "Qwen/Qwen3-30B-A3B": (
        ("a100_sxm", 1),
        ("h100_sxm", 1),
        ("h200_sxm", 1),
        ("l40s", 2),
        ("a100_pcie", 1),
    ),
    "meta-llama/Meta-Llama-3.1-8B": (
        ("a100_sxm", 1),
        ("h100_sxm", 1),
        ("h200_sxm", 1),
        ("l40s", 1),
        ("a100_pcie", 1),
    ),
}
# Output file per model: the project's catalogue name.
FILE_NAMES = {
    "meta-llama/Meta-Llama-3.1-70B": "llama-3.1-70b.tsv",
    "Qwen/Qwen3-30B-A3B": "qwen3-30b-a3b.tsv",
    "meta-llama/Meta-Llama-3.1-8B": "llama-3.1-8b.tsv",
}
PREFILL_ISL = (128, 512, 1024, 2048, 4096, 8192, 12288, 16384)
DECODE_BATCH = (1, 2, 4, 8, 16, 32, 64, 128)
DECODE_CONTEXT = (512, 2048, 8192, 16384)
MODES = ("SILICON", "SOL")
BACKEND = "vllm"


@dataclass(frozen=True, slots=True)
class Point:
    model: str
    system: str
    tp: int
    phase: str  # "prefill" | "decode"
    bs: int
    isl: int
    osl: int
    mode: str  # "SILICON" | "SOL"

    def key(self) -> tuple[str, ...]:
        return (
            self.model,
            self.system,
            str(self.tp),
            self.phase,
            str(self.bs),
            str(self.isl),
            str(self.osl),
            self.mode,
        )

    def label(self) -> str:
        return (
            f"{FILE_NAMES[self.model].removesuffix('.tsv')} {self.system} tp{self.tp} "
            f"{self.phase} bs{self.bs} isl{self.isl} {self.mode}"
        )


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(",") if part.strip())


def _names(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


def grid(args: argparse.Namespace) -> Iterator[Point]:
    """Every point of the sweep, model by model, instance by instance."""
    for model, instances in INSTANCES.items():
        if args.models and FILE_NAMES[model].removesuffix(".tsv") not in args.models:
            continue
        for system, tp in instances:
            if args.systems and system not in args.systems:
                continue
            for mode in args.modes:
                for isl in args.prefill_isl:
                    yield Point(model, system, tp, "prefill", 1, isl, 1, mode)
                for context in args.decode_context:
                    for bs in args.decode_batch:
                        yield Point(model, system, tp, "decode", bs, context, 2, mode)


def read_done(path: Path) -> set[tuple[str, ...]]:
    """The keys of the points already in `path`; drops a last line cut short by a kill."""
    if not path.exists():
        return set()
    text = path.read_text()
    if text and not text.endswith("\n"):
        text = text[: text.rfind("\n") + 1]
        path.write_text(text)
    done: set[tuple[str, ...]] = set()
    header: list[str] | None = None
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        fields = line.split("\t")
        if header is None:
            header = fields
            if tuple(header) != COLUMNS:
                sys.exit(f"{path}: columns {header} are not {list(COLUMNS)}; use a fresh file")
            continue
        row = dict(zip(header, fields, strict=True))
        done.add(tuple(row[c] for c in KEY_COLUMNS))
    return done


def _clean(text: str) -> str:
    return " ".join(text.split())[:300]


def estimate(point: Point) -> dict[str, str]:
    """One aiconfigurator estimate, as the row's value columns."""
    # aiconfigurator lives in its own environment, not the project's (so no stubs for mypy),
    # and loads for seconds: imported here, where the sweep needs it.
    from aiconfigurator.cli.api import cli_estimate  # type: ignore[import-not-found]  # noqa: PLC0415

    kwargs: dict[str, Any] = {}
    if "A3B" in point.model:
        # vLLM shards experts across the TP group unless expert parallelism is switched on.
        kwargs = {"moe_tp_size": point.tp, "moe_ep_size": 1}
    try:
        result = cli_estimate(
            point.model,
            point.system,
            mode="static_ctx" if point.phase == "prefill" else "static_gen",
            backend_name=BACKEND,
            database_mode=point.mode,
            isl=point.isl,
            osl=point.osl,
            batch_size=point.bs,
            tp_size=point.tp,
            **kwargs,
        )
    except Exception as exc:  # the tool refuses the point: record why
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return {"status": "skipped", "note": _clean(f"{type(exc).__name__}: {first}")}
    memory = float(result.raw.get("memory", 0.0) or 0.0)
    row = {
        "version": str(result.backend_version),
        "mem_GiB": f"{memory:.2f}",
        "status": "ok",
        "note": "",
    }
    if result.summary.check_oom():
        capacity = float(result.summary.get_mem_capacity_bytes()) / 2**30
        row["status"] = "skipped"
        row["note"] = f"OOM: needs {memory:.1f} GiB per GPU, the GPU has {capacity:.1f} GiB"
        return row
    if point.phase == "prefill":
        row["TTFT_ms"] = f"{float(result.ttft):.4f}"
    else:
        row["TPOT_ms"] = f"{float(result.tpot):.4f}"
    return row


def _write_row(out: TextIO, point: Point, values: dict[str, str]) -> None:
    row = dict(zip(KEY_COLUMNS, point.key(), strict=True)) | {"backend": BACKEND} | values
    out.write("\t".join(row.get(c, "") for c in COLUMNS) + "\n")
    out.flush()


class Progress:
    """A tqdm-style line on stderr: count, share, rate, time left, the point in flight."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.done = 0
        self.start = time.monotonic()
        self.tty = sys.stderr.isatty()
        self.last = 0.0

    def show(self, label: str, final: bool = False) -> None:
        now = time.monotonic()
        if not final and not self.tty and now - self.last < 10:
            return  # a log file gets a line every 10 s, a terminal every point
        self.last = now
        elapsed = now - self.start
        rate = self.done / elapsed if elapsed > 0 else 0.0
        left = (self.total - self.done) / rate if rate > 0 else 0.0
        share = 100.0 * self.done / self.total if self.total else 100.0
        line = (
            f"{share:5.1f}% {self.done}/{self.total} [{elapsed:.0f}s<{left:.0f}s, "
            f"{rate:.2f} pt/s] {label}"
        )
        end = "\n" if final or not self.tty else ""
        sys.stderr.write(("\r" if self.tty else "") + line[:150].ljust(150 if self.tty else 0))
        sys.stderr.write(end)
        sys.stderr.flush()


def _header(command: str) -> str:
    version = importlib.metadata.version("aiconfigurator")
    return (
        f"# generated by {SCRIPT} with aiconfigurator {version} "
        f"(vLLM backend, static estimates): {command}\n" + "\t".join(COLUMNS) + "\n"
    )


def run(args: argparse.Namespace, estimator: Callable[[Point], dict[str, str]]) -> int:
    command = shlex.join(["python", SCRIPT, *sys.argv[1:]])
    points = list(grid(args))
    files = {model: args.out_dir / name for model, name in FILE_NAMES.items()}
    done = {model: read_done(path) for model, path in files.items()}
    todo = [p for p in points if p.key() not in done[p.model]]
    print(
        f"{len(points)} points, {len(points) - len(todo)} already in {args.out_dir}, "
        f"{len(todo)} to run",
        file=sys.stderr,
    )
    if args.dry_run or not todo:
        return len(todo)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    handles: dict[str, TextIO] = {}
    progress = Progress(len(todo))
    try:
        for point in todo:
            out = handles.get(point.model)
            if out is None:
                path = files[point.model]
                fresh = not path.exists() or path.stat().st_size == 0
                out = handles[point.model] = path.open("a")
                if fresh:
                    out.write(_header(command))
                elif not path.read_text().startswith(f"# generated by {SCRIPT}"):
                    sys.exit(f"{path}: not written by {SCRIPT}")
            progress.show(point.label())
            _write_row(out, point, estimator(point))
            progress.done += 1
        progress.show("done", final=True)
    finally:
        for out in handles.values():
            out.close()
    return len(todo)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out-dir",
        type=Path,
        default=Path("src/hexgen_flow/data/profiles/aiconfigurator"),
        help="folder of the per-model TSVs (appended to; default: the shipped tables)",
    )
    parser.add_argument(
        "--models",
        type=_names,
        default=(),
        help=f"comma list of {', '.join(n.removesuffix('.tsv') for n in FILE_NAMES.values())}"
        " (default all)",
    )
    parser.add_argument(
        "--systems", type=_names, default=(), help="comma list of systems (default all)"
    )
    parser.add_argument("--modes", type=_names, default=MODES, help="default SILICON,SOL")
    parser.add_argument(
        "--prefill-isl",
        type=_ints,
        default=PREFILL_ISL,
        help=f"prompt lengths of the prefill rows (default {','.join(map(str, PREFILL_ISL))})",
    )
    parser.add_argument(
        "--decode-batch",
        type=_ints,
        default=DECODE_BATCH,
        help=f"batch sizes of the decode rows (default {','.join(map(str, DECODE_BATCH))})",
    )
    parser.add_argument(
        "--decode-context",
        type=_ints,
        default=DECODE_CONTEXT,
        help="context tokens per sequence of the decode rows "
        f"(default {','.join(map(str, DECODE_CONTEXT))})",
    )
    parser.add_argument("--dry-run", action="store_true", help="count the points and stop")
    parser.add_argument(
        "--quiet-tool",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="silence aiconfigurator's own log below ERROR (default on)",
    )
    args = parser.parse_args()
    if args.quiet_tool:
        logging.disable(logging.WARNING)
    run(args, estimate)


if __name__ == "__main__":
    main()
