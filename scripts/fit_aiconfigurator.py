"""Fit the aiconfigurator sweep: prefill per token and the decode step, beside the floors.

    .venv/bin/python scripts/fit_aiconfigurator.py             # a text table
    .venv/bin/python scripts/fit_aiconfigurator.py --markdown  # the same, as Markdown

Reads the TSVs that scripts/sweep_aiconfigurator.py wrote (src/hexgen_flow/data/profiles/
aiconfigurator/) and, per (model, system, tp, database mode), least-squares fits

- prefill: TTFT_ms = intercept + slope x prompt tokens (batch-1 rows), slope in µs/token;
- decode step: TPOT_ms = a + b x batch + c x kv_tokens, kv_tokens = batch x context;

each with its largest relative error over the rows. Beside them, the project's roofline
floors for the same instance at bf16 (hexgen_flow.roofline: prefill 2 x active parameters
FLOPs per token at the group's dense peak; decode step the active weights plus the KV cache
read once at its memory bandwidth), and how many rows sit below a floor.
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hexgen_flow.hardware import GpuSpec, InstanceHardware, gpu_catalogue, resolve_model
from hexgen_flow.roofline import decode_step_floor_s, prefill_floor_s

DATA = Path(__file__).resolve().parent.parent / "src/hexgen_flow/data/profiles/aiconfigurator"
# aiconfigurator systems the GPU catalogue does not name (its aiconfigurator_system is null
# there because the tool has no measured kernels for them, only a spec for SOL).
EXTRA_SYSTEMS = {"a100_pcie": "A100-80GB-PCIe"}
# Routing of the mixtures of experts (config.json: num_experts_per_tok, num_experts). Their
# decode step is not linear in the batch: the expert weights read grow with the experts the
# batch routes to, and stop growing once every expert is read.
MOE_ROUTING = {"Qwen/Qwen3-30B-A3B": (8, 128)}
Group = tuple[str, str, int, str]  # model, system, tp, mode


def read_rows(folder: Path) -> list[dict[str, str]]:
    """Every row of every TSV in `folder`, as column -> text; `#` lines are comments."""
    rows: list[dict[str, str]] = []
    for path in sorted(folder.glob("*.tsv")):
        lines = [ln for ln in path.read_text().splitlines() if ln and not ln.startswith("#")]
        header = lines[0].split("\t")
        rows.extend(dict(zip(header, ln.split("\t"), strict=True)) for ln in lines[1:])
    return rows


def gpu_for(system: str) -> GpuSpec | None:
    for gpu in gpu_catalogue().gpus:
        if gpu.aiconfigurator_system == system:
            return gpu
    extra = EXTRA_SYSTEMS.get(system)
    return gpu_catalogue().resolve(extra) if extra else None


def hardware_for(model: str, system: str, tp: int) -> InstanceHardware | None:
    gpu = gpu_for(system)
    return None if gpu is None else InstanceHardware(resolve_model(model), gpu, tp, "bf16")


@dataclass(frozen=True, slots=True)
class Fit:
    coef: tuple[float, ...]
    max_rel_err: float
    points: int


def least_squares(x: np.ndarray, y: np.ndarray) -> Fit:
    """Least squares in relative terms (each row weighted by 1 / y), so that short prompts
    and small batches count as much as long ones."""
    coef, *_ = np.linalg.lstsq(x / y[:, None], np.ones_like(y), rcond=None)
    err = float(np.max(np.abs(x @ coef - y) / y))
    return Fit(tuple(float(c) for c in coef), err, len(y))


@dataclass(frozen=True, slots=True)
class GroupFit:
    group: Group
    prefill: Fit | None  # (intercept ms, ms per token)
    prefill_quadratic: Fit | None  # (intercept ms, ms per token, ms per token squared)
    decode: Fit | None  # (a ms, b ms per sequence, c ms per KV token)
    prefill_floor_us: float | None  # per token
    decode_floor_a_ms: float | None
    decode_floor_c_ns: float | None  # per KV token
    below_prefill: tuple[int, float]  # rows below the floor, the least time / floor of any row
    below_decode: tuple[int, float]


def fit_group(group: Group, rows: list[dict[str, str]]) -> GroupFit:
    model, system, tp, _ = group
    pre = [r for r in rows if r["phase"] == "prefill" and r["bs"] == "1"]
    dec = [r for r in rows if r["phase"] == "decode"]
    prefill = quadratic = decode = None
    if len(pre) >= 3:
        tokens = np.array([float(r["isl"]) for r in pre])
        ttft = np.array([float(r["TTFT_ms"]) for r in pre])
        ones = np.ones_like(tokens)
        prefill = least_squares(np.column_stack([ones, tokens]), ttft)
        quadratic = least_squares(np.column_stack([ones, tokens, tokens**2]), ttft)
    if len(dec) >= 3:
        batch = np.array([float(r["bs"]) for r in dec])
        kv = batch * np.array([float(r["isl"]) for r in dec])
        tpot = np.array([float(r["TPOT_ms"]) for r in dec])
        decode = least_squares(np.column_stack([np.ones_like(batch), batch, kv]), tpot)
    hw = hardware_for(model, system, tp)
    if hw is None:
        return GroupFit(group, prefill, quadratic, decode, None, None, None, (0, 1.0), (0, 1.0))
    prefill_ratios = [
        float(r["TTFT_ms"]) / (prefill_floor_s(hw, int(r["bs"]) * int(r["isl"])) * 1e3) for r in pre
    ]
    decode_ratios = [
        float(r["TPOT_ms"]) / (decode_step_floor_s(hw, int(r["bs"]), int(r["isl"])) * 1e3)
        for r in dec
    ]
    return GroupFit(
        group,
        prefill,
        quadratic,
        decode,
        prefill_floor_s(hw, 1) * 1e6,
        decode_step_floor_s(hw, 0, 0) * 1e3,
        (decode_step_floor_s(hw, 1, 1) - decode_step_floor_s(hw, 0, 0)) * 1e9,
        _below(prefill_ratios),
        _below(decode_ratios),
    )


def _below(ratios: list[float]) -> tuple[int, float]:
    return sum(r < 1 for r in ratios), min(ratios, default=1.0)


def fit_all(folder: Path) -> list[GroupFit]:
    groups: dict[Group, list[dict[str, str]]] = defaultdict(list)
    for row in read_rows(folder):
        if row["status"] == "ok":
            key = (row["model"], row["system"], int(row["tp"]), row["mode"])
            groups[key].append(row)
    return [fit_group(g, groups[g]) for g in sorted(groups)]


HEADER = (
    "model",
    "system",
    "tp",
    "mode",
    "prefill µs/tok",
    "+ ms",
    "err",
    "quad µs/tok",
    "+ µs/tok per 1k",
    "err",
    "floor µs/tok",
    "x floor",
    "decode a ms",
    "b µs/seq",
    "c ns/kv-tok",
    "err",
    "floor a ms",
    "floor c ns",
    "prefill < floor",
    "decode < floor",
)


def _num(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}g}"


def _coef(fit: Fit | None, index: int, scale: float) -> str:
    return "-" if fit is None else _num(fit.coef[index] * scale)


def _err(fit: Fit | None) -> str:
    return "-" if fit is None else f"{100 * fit.max_rel_err:.0f}%"


def _below_text(below: tuple[int, float], known: bool) -> str:
    """'0' when no row is below the floor; else the count and the lowest time / floor."""
    if not known:
        return "-"
    count, least = below
    return f"{count} (x{least:.2f})" if count else "0"


def table_rows(fits: list[GroupFit]) -> list[tuple[str, ...]]:
    """One row per group: the fits in µs, ms and ns as HEADER says, errors in percent."""
    out: list[tuple[str, ...]] = []
    for f in fits:
        model, system, tp, mode = f.group
        ratio = None
        if f.prefill is not None and f.prefill_floor_us is not None:
            ratio = f.prefill.coef[1] * 1e3 / f.prefill_floor_us
        out.append(
            (
                model.split("/")[-1],
                system,
                str(tp),
                mode,
                _coef(f.prefill, 1, 1e3),
                _coef(f.prefill, 0, 1),
                _err(f.prefill),
                _coef(f.prefill_quadratic, 1, 1e3),
                _coef(f.prefill_quadratic, 2, 1e6),
                _err(f.prefill_quadratic),
                _num(f.prefill_floor_us),
                _num(ratio, 2),
                _coef(f.decode, 0, 1),
                _coef(f.decode, 1, 1e3),
                _coef(f.decode, 2, 1e6),
                _err(f.decode),
                _num(f.decode_floor_a_ms),
                _num(f.decode_floor_c_ns),
                _below_text(f.below_prefill, f.prefill_floor_us is not None),
                _below_text(f.below_decode, f.prefill_floor_us is not None),
            )
        )
    return out


MOE_HEADER = (
    "model",
    "system",
    "tp",
    "mode",
    "a ms",
    "b µs/seq",
    "c ns/kv-tok",
    "d ms",
    "err",
    "err, u = min(1, bk/E)",
    "err, linear",
)


def moe_rows(folder: Path) -> list[tuple[str, ...]]:
    """Decode steps of the mixtures of experts fitted as a + b x batch + c x kv_tokens + d x u,
    u = 1 - (1 - k/E)^batch the expected share of the E experts that a batch routes to when
    each sequence picks k at random (d: the step's cost of reading every expert); beside it
    the error with u = min(1, batch x k / E), every sequence on experts of its own (what
    aiconfigurator's SOL assumes), and of the plain linear fit."""
    groups: dict[Group, list[dict[str, str]]] = defaultdict(list)
    for row in read_rows(folder):
        if row["status"] == "ok" and row["phase"] == "decode" and row["model"] in MOE_ROUTING:
            groups[(row["model"], row["system"], int(row["tp"]), row["mode"])].append(row)
    out: list[tuple[str, ...]] = []
    for group in sorted(groups):
        rows = groups[group]
        if len(rows) < 5:
            continue
        k, experts = MOE_ROUTING[group[0]]
        batch = np.array([float(r["bs"]) for r in rows])
        kv = batch * np.array([float(r["isl"]) for r in rows])
        tpot = np.array([float(r["TPOT_ms"]) for r in rows])
        base = [np.ones_like(batch), batch, kv]
        random = least_squares(np.column_stack([*base, 1 - (1 - k / experts) ** batch]), tpot)
        own = least_squares(np.column_stack([*base, np.minimum(1, batch * k / experts)]), tpot)
        linear = least_squares(np.column_stack(base), tpot)
        model, system, tp, mode = group
        out.append(
            (
                model.split("/")[-1],
                system,
                str(tp),
                mode,
                _coef(random, 0, 1),
                _coef(random, 1, 1e3),
                _coef(random, 2, 1e6),
                _coef(random, 3, 1),
                _err(random),
                _err(own),
                _err(linear),
            )
        )
    return out


def render(header: tuple[str, ...], rows: list[tuple[str, ...]], markdown: bool) -> str:
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
        return "\n".join(lines)
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return "\n".join(
        "  ".join(
            cell.rjust(w) if i > 3 else cell.ljust(w)
            for i, (cell, w) in enumerate(zip(r, widths, strict=True))
        )
        for r in [header, *rows]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=DATA, help="folder of the sweep's TSVs")
    parser.add_argument("--markdown", action="store_true", help="print a Markdown table")
    args = parser.parse_args()
    print(render(HEADER, table_rows(fit_all(args.data)), args.markdown))
    print()
    print(
        "Mixtures of experts, decode step = a + b x batch + c x kv_tokens + d x u, "
        "u = 1 - (1 - k/E)^batch:"
    )
    print(render(MOE_HEADER, moe_rows(args.data), args.markdown))


if __name__ == "__main__":
    main()
