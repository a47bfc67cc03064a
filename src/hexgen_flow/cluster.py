"""Serving instances and clusters of them.

An instance is one model replica on a tensor-parallel group of GPUs of one type: the unit
the dispatcher chooses between. A cluster is an ordered list of instances; the first is the
paper's baseline instance b.

A cluster is written either inline, ``A100,A100,A6000,L40S`` (``A100x2`` repeats a type), or
as a YAML file::

    model: llama-3.1-70b          # optional, the default model of every instance
    calibration: aiconfigurator   # optional, where the latency numbers come from
    gpus: []                      # optional, GPUs added to the catalogue (docs/hardware.md)
    instances:
      - gpu: A100
        count: 2                  # optional, default 1
        tp: 4                     # optional, default: the model's profiled tp on that GPU
        precision: bf16           # optional, bf16 (default) or fp8
      - gpu: A6000
        kv_cache_tokens: 120000   # optional override of the derived KV-cache size
        max_batch: 128            # optional override of vLLM's max_num_seqs (256)

The latency data of a calibration (docs/hardware.md, "Calibrations"; default
``aiconfigurator``, a ``--calibration`` option overrides the file's) covers each (model, GPU)
at one tp and precision, so for now an instance must be at those: other values are refused by
name, not guessed.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from hexgen_flow.calibration import Calibration, resolve_calibration
from hexgen_flow.errors import ConfigError
from hexgen_flow.hardware import GpuCatalogue, gpu_catalogue
from hexgen_flow.latency import LatencyModel, latency_model, resolve_model

__all__ = [
    "DEFAULT_CLUSTER",
    "DEFAULT_MODEL",
    "Cluster",
    "InstanceSpec",
    "cluster_file_catalogue",
    "parse_cluster",
]

DEFAULT_MODEL = "llama-3.1-70b"
DEFAULT_CLUSTER = "A100,A100,A6000,L40S"


@dataclass(frozen=True, slots=True)
class InstanceSpec:
    """One serving instance."""

    index: int
    """Position in the cluster; 0 is the baseline instance."""
    gpu: str
    """GPU type, e.g. "A100"."""
    model: str
    """Model served, e.g. "llama-3.1-70b"."""
    kv_cache_tokens: int
    """KV-cache slots: the sum of input+output tokens of the calls running together."""
    max_batch: int
    """Most calls running together."""
    latency: LatencyModel
    """Latency model of this (model, GPU type)."""

    @property
    def name(self) -> str:
        return f"{self.gpu}#{self.index}"


@dataclass(frozen=True, slots=True)
class Cluster:
    instances: tuple[InstanceSpec, ...]
    description: str
    """How the cluster was given (inline list or file name), for reports."""
    calibration: Calibration = field(default_factory=resolve_calibration)
    """The calibration every instance's latency model comes from (default: the default)."""

    def __len__(self) -> int:
        return len(self.instances)

    @property
    def gpus(self) -> tuple[str, ...]:
        return tuple(i.gpu for i in self.instances)

    def misjudged(self, errors: Mapping[str, tuple[float, float]]) -> Cluster:
        """This cluster as a planner that misjudges some GPU types believes it: for each
        GPU type in `errors`, (prefill factor, decode factor) its instances' times are
        believed to be (e.g. ``{"L40S": (3.0, 1.0)}``: L40S prefill believed 3x slower
        than the calibration says). What `--planner-error` builds."""
        unknown = sorted(set(errors) - set(self.gpus))
        if unknown:
            raise ConfigError(
                f"no {', '.join(unknown)} in the cluster ({', '.join(sorted(set(self.gpus)))})"
            )
        instances = tuple(
            replace(inst, latency=inst.latency.rescaled(*errors[inst.gpu]))
            if inst.gpu in errors
            else inst
            for inst in self.instances
        )
        return replace(self, instances=instances)

    def with_learned(self, factors: Sequence[tuple[float, float] | None]) -> Cluster:
        """This cluster as a scheduler that learned each instance's costs believes it:
        instance i's times scaled by ``factors[i]`` = (prefill, decode) (None: as
        calibrated), as `hexgen_flow.learning.CostLearner.model` scales them."""
        if len(factors) != len(self.instances):
            raise ConfigError(
                f"{len(factors)} learned factors for a cluster of {len(self.instances)}"
            )
        instances = tuple(
            inst if f is None else replace(inst, latency=inst.latency.rescaled(*f))
            for inst, f in zip(self.instances, factors, strict=True)
        )
        return replace(self, instances=instances)

    @property
    def inline(self) -> str:
        """The GPU types as an inline `--cluster` list, whatever the cluster was built from
        (what another process needs to rebuild the latency models of the slots)."""
        return ",".join(self.gpus)

    @classmethod
    def build(
        cls,
        entries: Sequence[dict[str, Any]],
        description: str,
        catalogue: GpuCatalogue | None = None,
        calibration: str | None = None,
    ) -> Cluster:
        """Instances from entries ({"gpu", "model", "tp", "precision", "kv_cache_tokens",
        "max_batch"}; all but "gpu" optional), GPU names resolved in `catalogue` (default:
        the shipped one), latency from `calibration` (default: ``aiconfigurator``)."""
        source = resolve_calibration(calibration)
        instances: list[InstanceSpec] = []
        for entry in entries:
            model = resolve_model(str(entry.get("model", DEFAULT_MODEL))).name
            tp = entry.get("tp")
            if tp is not None and (isinstance(tp, bool) or not isinstance(tp, int) or tp < 1):
                raise ConfigError(f"instance {len(instances)}: tp must be an integer >= 1")
            precision = entry.get("precision")
            lat = latency_model(
                model,
                str(entry["gpu"]),
                tp,
                None if precision is None else str(precision),
                catalogue,
                source.argument,
            )
            where = f"instance {len(instances)} ({lat.gpu})"
            kv = _int_setting(entry, "kv_cache_tokens", lat.kv_capacity_tokens, where)
            max_batch = _int_setting(entry, "max_batch", lat.max_batch, where)
            if kv <= 0:
                raise ConfigError(
                    f"{where}: {model} leaves no memory for the "
                    "KV cache; give kv_cache_tokens or use a larger GPU"
                )
            if max_batch < 1:
                raise ConfigError(f"instance {len(instances)}: max_batch must be >= 1")
            instances.append(InstanceSpec(len(instances), lat.gpu, model, kv, max_batch, lat))
        if not instances:
            raise ConfigError("a cluster needs at least one instance")
        return cls(tuple(instances), description, source)


def _int_setting(entry: dict[str, Any], key: str, default: int, where: str) -> int:
    value = entry.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{where}: {key} must be an integer, got {value!r}")
    return value


_REPEAT = re.compile(r"^(?P<gpu>[A-Za-z0-9_-]+?)(?:[x*](?P<count>\d+))?$")


def parse_cluster(
    text: str,
    model: str = DEFAULT_MODEL,
    calibration: str | None = None,
    catalogue: GpuCatalogue | None = None,
) -> Cluster:
    """Parse ``A100,A100,A6000,L40S`` / ``A100x2,A6000`` or the path of a YAML file, with
    latency from `calibration`: None takes the file's ``calibration:``, else the default.
    An inline list's GPU names resolve in `catalogue` (default: the shipped one; a file
    brings its own ``gpus:``)."""
    path = Path(text)
    if text.endswith((".yaml", ".yml")) or path.is_file():
        return _load_yaml(path, model, calibration)
    entries: list[dict[str, Any]] = []
    for part in text.split(","):
        match = _REPEAT.match(part.strip())
        if not match:
            raise ConfigError(f"--cluster: cannot read {part!r}; write e.g. A100,A100,A6000,L40S")
        count = int(match["count"] or 1)
        if count < 1:
            raise ConfigError(f"--cluster: {part.strip()!r}: the count after x must be >= 1")
        entries.extend({"gpu": match["gpu"], "model": model} for _ in range(count))
    return Cluster.build(entries, text, catalogue, calibration=calibration)


_FILE_KEYS = frozenset({"model", "calibration", "gpus", "instances"})
_INSTANCE_KEYS = frozenset(
    {"gpu", "count", "model", "tp", "precision", "kv_cache_tokens", "max_batch"}
)


def _reject_unknown(item: dict[str, Any], known: frozenset[str], where: str) -> None:
    # A misspelt optional key (kv_cache_tokns) would otherwise be ignored without a word.
    unknown = sorted(str(k) for k in set(item) - known)
    if unknown:
        raise ConfigError(f"{where}: unknown key {unknown[0]!r} (keys: {', '.join(sorted(known))})")


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        doc = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"cluster file {path} does not exist") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"cluster file {path} is not valid YAML: {exc}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("instances"), list):
        raise ConfigError(f"cluster file {path}: expected a mapping with an 'instances' list")
    return doc


def _file_catalogue(doc: dict[str, Any], path: Path) -> GpuCatalogue:
    catalogue = gpu_catalogue()
    if "gpus" in doc:
        catalogue = catalogue.extended(doc["gpus"], f"cluster file {path}: gpus")
    return catalogue


def cluster_file_catalogue(path: str) -> GpuCatalogue:
    """The shipped GPU catalogue plus the ``gpus:`` entries of cluster file `path`: what
    a worker of such a cluster resolves its ``--gpu`` in (``--gpus-file``), so that a GPU
    type only the file defines (a CPU core serving a small model, say) names its slot."""
    file = Path(path)
    return _file_catalogue(_read_yaml(file), file)


def _load_yaml(path: Path, model: str, calibration: str | None) -> Cluster:
    doc = _read_yaml(path)
    _reject_unknown(doc, _FILE_KEYS, f"cluster file {path}")
    catalogue = _file_catalogue(doc, path)
    default_model = str(doc.get("model", model))
    named = doc.get("calibration")
    if named is not None and not isinstance(named, str):
        raise ConfigError(f"cluster file {path}: calibration must be a name, got {named!r}")
    if named is not None and named.startswith("measured:") and calibration is None:
        # A profile named in the file is found beside the file, wherever the run starts.
        profile = Path(named.removeprefix("measured:"))
        named = f"measured:{profile if profile.is_absolute() else path.parent / profile}"
    entries: list[dict[str, Any]] = []
    for n, item in enumerate(doc["instances"]):
        if not isinstance(item, dict) or "gpu" not in item:
            raise ConfigError(f"cluster file {path}: instances[{n}] needs a 'gpu' field")
        _reject_unknown(item, _INSTANCE_KEYS, f"cluster file {path}: instances[{n}]")
        count = item.get("count", 1)
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ConfigError(
                f"cluster file {path}: instances[{n}].count must be an integer >= 1, got {count!r}"
            )
        entry = {k: v for k, v in item.items() if k != "count"}
        entry.setdefault("model", default_model)
        entries.extend(dict(entry) for _ in range(count))
    return Cluster.build(entries, str(path), catalogue, calibration or named)
