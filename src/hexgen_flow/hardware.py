"""The GPU and model catalogues: hardware and architectures as data.

The entries live in ``data/hardware/gpus.yaml`` and ``data/hardware/models.yaml``; this module
reads them into frozen dataclasses and checks every field. A cluster file may add GPUs of the
same schema (`GpuCatalogue.extended`). An instance of a model is `InstanceHardware`: the model
on a tensor-parallel group of one GPU type at one weight precision; its weight and KV-cache
bytes follow from the catalogues (docs/hardware.md).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Literal, cast

import yaml

from hexgen_flow.catalogue_fields import EntryFields
from hexgen_flow.errors import ConfigError, UnknownNameError

__all__ = [
    "BYTES_PER_PARAMETER",
    "GPU_MEMORY_UTILIZATION",
    "KV_BYTES_PER_VALUE",
    "PRECISIONS",
    "FormFactor",
    "GpuCatalogue",
    "GpuSpec",
    "InstanceHardware",
    "Interconnect",
    "ModelSpec",
    "Precision",
    "default_tensor_parallel",
    "gpu_catalogue",
    "known_models",
    "model_catalogue",
    "parse_precision",
    "profiled_tensor_parallel",
    "read_gpu_file",
    "resolve_model",
]

Precision = Literal["bf16", "fp8"]
PRECISIONS: tuple[Precision, ...] = ("bf16", "fp8")
BYTES_PER_PARAMETER: dict[Precision, int] = {"bf16": 2, "fp8": 1}
# The KV cache stays bf16 whatever the weights are (vLLM's default --kv-cache-dtype auto).
KV_BYTES_PER_VALUE = 2
# vLLM's default --gpu-memory-utilization: the share of device memory for weights and KV cache.
GPU_MEMORY_UTILIZATION = 0.9

Interconnect = Literal["nvlink", "pcie"]
FormFactor = Literal["sxm", "pcie"]
_INTERCONNECTS: tuple[Interconnect, ...] = ("nvlink", "pcie")
_FORM_FACTORS: tuple[FormFactor, ...] = ("sxm", "pcie")


@dataclass(frozen=True, slots=True)
class GpuSpec:
    """One GPU part, as capacity planning and the physical floors need it."""

    name: str
    """Catalogue name, e.g. "A100-80GB-SXM"."""
    aliases: tuple[str, ...]
    """Other names it answers to (case-insensitive), e.g. "A100"."""
    memory_gib: float
    """Device memory of one GPU: the data sheet's nominal figure, read as GiB."""
    hbm_bandwidth_tb_s: float
    """Peak device-memory bandwidth, TB/s (GDDR on the PCIe workstation cards)."""
    dense_bf16_tflop_s: float
    """Peak dense bf16 tensor-core TFLOP/s (data sheets quote twice this with sparsity)."""
    dense_fp8_tflop_s: float | None
    """Peak dense fp8 tensor-core TFLOP/s; None on GPUs without fp8 (Ampere)."""
    interconnect: Interconnect
    """How GPUs of a tensor-parallel group talk to each other."""
    interconnect_gb_s: float
    """Bidirectional bandwidth of that link per GPU, GB/s."""
    form_factor: FormFactor
    """SXM module on an NVLink board, or PCIe card."""
    aiconfigurator_system: str | None
    """Name of this GPU in NVIDIA aiconfigurator's tables; None when it is not there."""
    aiconfigurator_stand_in: str | None = None
    """For a GPU aiconfigurator does not model: the catalogued GPU of the same link class
    whose rows it is derived from (the stand-in's time plus the roofline difference between
    the two parts, docs/hardware.md "Derived GPUs"); None when it has its own rows."""

    def flop_s(self, precision: Precision) -> float:
        """Peak dense FLOP/s at `precision`; a GPU without fp8 cannot run fp8."""
        if precision == "bf16":
            return self.dense_bf16_tflop_s * 1e12
        if self.dense_fp8_tflop_s is None:
            raise ConfigError(f"GPU {self.name} has no fp8 tensor cores; use precision bf16")
        return self.dense_fp8_tflop_s * 1e12

    @property
    def memory_bytes_per_s(self) -> float:
        return self.hbm_bandwidth_tb_s * 1e12


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """An LLM, as weight bytes, KV-cache bytes, the floors and its latency data need it."""

    name: str
    """Catalogue name, e.g. "llama-3.1-70b"."""
    aliases: tuple[str, ...]
    """Other names it answers to (case-insensitive), e.g. Hugging Face ids, lower-cased."""
    parameters: int
    """All parameters: what the weights take in memory."""
    active_parameters: int
    """Parameters one token passes through (a mixture of experts routes to a few)."""
    layers: int
    kv_heads: int
    """Key/value heads per layer (grouped-query attention)."""
    head_dim: int
    hidden_size: int
    vocab_size: int
    tied_embeddings: bool
    """Whether the output head is the input embedding matrix (one table, not two)."""
    tensor_parallel: tuple[tuple[str, int], ...]
    """(GPU name, tp) for each GPU type the model has latency data for, at the degree the
    data was taken at: also an instance's default tp. Empty: no latency data."""
    measured_profile: str | None
    """Folder of measured vLLM tables under data/profiles/, when there is one."""
    aiconfigurator_model: str | None
    """Model name in the aiconfigurator table."""
    aiconfigurator_table: str | None
    """File of aiconfigurator rows under data/profiles/."""
    context_tokens: int | None = None
    """Longest sequence the model takes, prompt and output together (its config's
    ``max_position_embeddings``); None: not known. A coordinator caps a call's output
    tokens at the longest of its cluster's models' (``--max-output-tokens``)."""

    @property
    def kv_bytes_per_token(self) -> int:
        """2 (K and V) x layers x KV heads x head dim x 2 bytes (bf16)."""
        return 2 * self.layers * self.kv_heads * self.head_dim * KV_BYTES_PER_VALUE

    def weight_bytes(self, precision: Precision) -> int:
        return self.parameters * BYTES_PER_PARAMETER[precision]

    @property
    def embedding_parameters(self) -> int:
        """One embedding table: vocabulary x hidden size."""
        return self.vocab_size * self.hidden_size

    @property
    def prompt_token_parameters(self) -> int:
        """The parameters every prompt token is multiplied through in a prefill: the active
        ones less the input embedding (a lookup, no multiply) and the output head (vLLM
        computes logits for a prompt's last token only); tied, they are one matrix."""
        return self.active_parameters - (1 if self.tied_embeddings else 2) * (
            self.embedding_parameters
        )

    def decode_read_bytes(self, precision: Precision) -> int:
        """The weights one decode step reads whole: the active ones less the input
        embedding table, of which a step reads only its sequences' rows (tied, the output
        head reads that matrix whole anyway)."""
        untied_input = 0 if self.tied_embeddings else self.embedding_parameters
        return (self.active_parameters - untied_input) * BYTES_PER_PARAMETER[precision]


@dataclass(frozen=True, slots=True)
class InstanceHardware:
    """What one serving instance is made of: a model on `tensor_parallel` GPUs of one type,
    its weights at `precision`."""

    model: ModelSpec
    gpu: GpuSpec
    tensor_parallel: int
    precision: Precision

    def __post_init__(self) -> None:
        if self.tensor_parallel < 1:
            raise ConfigError(f"tp must be >= 1, got {self.tensor_parallel}")
        self.gpu.flop_s(self.precision)  # refuses fp8 on a GPU without it

    @property
    def weight_bytes(self) -> int:
        return self.model.weight_bytes(self.precision)

    @property
    def kv_capacity_tokens(self) -> int:
        """KV-cache slots of the instance: what vLLM leaves at its default memory share."""
        usable = (
            self.tensor_parallel * self.gpu.memory_gib * 2**30 * GPU_MEMORY_UTILIZATION
            - self.weight_bytes
        )
        return max(int(usable / self.model.kv_bytes_per_token), 0)


# --------------------------------------------------------------------------- reading entries


_GPU_FIELDS = (
    "name",
    "aliases",
    "memory_gib",
    "hbm_bandwidth_tb_s",
    "dense_bf16_tflop_s",
    "dense_fp8_tflop_s",
    "interconnect",
    "interconnect_gb_s",
    "form_factor",
    "aiconfigurator_system",
    "aiconfigurator_stand_in",
)


def _parse_gpu(doc: object, where: str) -> GpuSpec:
    fields = EntryFields(doc, where, _GPU_FIELDS)
    return GpuSpec(
        name=fields.text("name"),
        aliases=fields.names("aliases"),
        memory_gib=fields.number("memory_gib"),
        hbm_bandwidth_tb_s=fields.number("hbm_bandwidth_tb_s"),
        dense_bf16_tflop_s=fields.number("dense_bf16_tflop_s"),
        dense_fp8_tflop_s=fields.optional_number("dense_fp8_tflop_s"),
        interconnect=cast(Interconnect, fields.choice("interconnect", _INTERCONNECTS)),
        interconnect_gb_s=fields.number("interconnect_gb_s"),
        form_factor=cast(FormFactor, fields.choice("form_factor", _FORM_FACTORS)),
        aiconfigurator_system=fields.optional_text("aiconfigurator_system"),
        aiconfigurator_stand_in=fields.optional_text("aiconfigurator_stand_in"),
    )


def parse_precision(value: object, where: str) -> Precision:
    if value not in PRECISIONS:
        raise ConfigError(
            f"{where}: precision must be one of {', '.join(PRECISIONS)}, got {value!r}"
        )
    return value


# --------------------------------------------------------------------------- GPU catalogue


def _spellings(gpu: GpuSpec) -> tuple[str, ...]:
    return (gpu.name, *gpu.aliases)


@dataclass(frozen=True, slots=True)
class GpuCatalogue:
    """The GPUs a name can resolve to: the shipped ones, plus any a cluster file adds."""

    gpus: tuple[GpuSpec, ...]

    def names(self) -> list[str]:
        """Every name and alias, sorted."""
        return sorted(s for gpu in self.gpus for s in _spellings(gpu))

    def lookup(self, name: str) -> tuple[GpuSpec, str]:
        """The GPU `name` means and the catalogue's spelling of that name (any case, either
        its name or an alias); unknown names list the known ones."""
        key = name.strip().lower()
        for gpu in self.gpus:
            for spelling in _spellings(gpu):
                if spelling.lower() == key:
                    return gpu, spelling
        raise UnknownNameError("GPU type", name, self.names())

    def resolve(self, name: str) -> GpuSpec:
        return self.lookup(name)[0]

    def extended(self, entries: object, where: str) -> GpuCatalogue:
        """This catalogue plus `entries` (a list of GPU entries, as in gpus.yaml). A new
        entry may not reuse a name or alias: a GPU means one thing in a run."""
        if not isinstance(entries, list):
            raise ConfigError(f"{where}: expected a list of GPU entries, got {entries!r}")
        gpus = list(self.gpus)
        for n, doc in enumerate(entries):
            gpu = _parse_gpu(doc, f"{where}[{n}]")
            taken = {s.lower(): g.name for g in gpus for s in _spellings(g)}
            for spelling in _spellings(gpu):
                if spelling.lower() in taken:
                    raise ConfigError(
                        f"{where}[{n}] ({gpu.name}): the name {spelling!r} is already "
                        f"GPU {taken[spelling.lower()]}; give the new GPU a name of its own"
                    )
            gpus.append(gpu)
        return GpuCatalogue(tuple(gpus))


def _data_yaml(name: str) -> object:
    text = resources.files("hexgen_flow").joinpath("data", "hardware", name).read_text()
    return yaml.safe_load(text)


@functools.cache
def gpu_catalogue() -> GpuCatalogue:
    """The shipped GPU catalogue (data/hardware/gpus.yaml)."""
    return GpuCatalogue(()).extended(_data_yaml("gpus.yaml"), "gpus.yaml")


def read_gpu_file(path: Path) -> GpuCatalogue:
    """The shipped catalogue extended by a file's GPUs: a list of entries, or a mapping
    with a `gpus:` list (a cluster file)."""
    try:
        doc = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"GPU file {path} does not exist") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"GPU file {path} is not valid YAML: {exc}") from None
    entries = doc.get("gpus", []) if isinstance(doc, dict) else doc
    return gpu_catalogue().extended(entries, f"{path}: gpus")


# --------------------------------------------------------------------------- model catalogue

_MODEL_FIELDS = (
    "name",
    "aliases",
    "parameters",
    "active_parameters",
    "layers",
    "kv_heads",
    "head_dim",
    "hidden_size",
    "vocab_size",
    "tied_embeddings",
    "tensor_parallel",
    "measured_profile",
    "aiconfigurator_model",
    "aiconfigurator_table",
    "context_tokens",
)


def _parse_model(doc: object, where: str) -> ModelSpec:
    fields = EntryFields(doc, where, _MODEL_FIELDS)
    model = ModelSpec(
        name=fields.text("name").lower(),
        aliases=tuple(a.lower() for a in fields.names("aliases")),
        parameters=fields.count("parameters"),
        active_parameters=fields.count("active_parameters"),
        layers=fields.count("layers"),
        kv_heads=fields.count("kv_heads"),
        head_dim=fields.count("head_dim"),
        hidden_size=fields.count("hidden_size"),
        vocab_size=fields.count("vocab_size"),
        tied_embeddings=fields.flag("tied_embeddings"),
        tensor_parallel=fields.counts_by_name("tensor_parallel"),
        measured_profile=fields.optional_text("measured_profile"),
        aiconfigurator_model=fields.optional_text("aiconfigurator_model"),
        aiconfigurator_table=fields.optional_text("aiconfigurator_table"),
        context_tokens=fields.count("context_tokens") if "context_tokens" in fields.doc else None,
    )
    if model.active_parameters > model.parameters:
        raise ConfigError(f"{fields.where}: active_parameters exceeds parameters")
    if model.prompt_token_parameters < 1:
        raise ConfigError(
            f"{fields.where}: the embedding tables (vocab_size x hidden_size"
            f"{'' if model.tied_embeddings else ' x 2, untied'}) exceed active_parameters"
        )
    for gpu, _ in model.tensor_parallel:
        gpu_catalogue().resolve(gpu)  # a typo in the table fails here, listing the GPUs
    # Every GPU with latency data takes its batch slowdown from aiconfigurator (latency.py).
    if model.tensor_parallel and not (model.aiconfigurator_model and model.aiconfigurator_table):
        raise ConfigError(
            f"{fields.where}: a model with tensor_parallel (latency data) needs "
            "aiconfigurator_model and aiconfigurator_table"
        )
    return model


@functools.cache
def model_catalogue() -> tuple[ModelSpec, ...]:
    """The shipped model catalogue (data/hardware/models.yaml)."""
    entries = _data_yaml("models.yaml")
    if not isinstance(entries, list):
        raise ConfigError("models.yaml: expected a list of model entries")
    return tuple(_parse_model(doc, f"models.yaml[{n}]") for n, doc in enumerate(entries))


def known_models() -> list[str]:
    return sorted(m.name for m in model_catalogue())


def resolve_model(name: str) -> ModelSpec:
    key = name.strip().lower()
    for spec in model_catalogue():
        if key == spec.name or key in spec.aliases:
            return spec
    raise UnknownNameError("model", name, known_models())


def profiled_tensor_parallel(model: ModelSpec, gpu: GpuSpec) -> int | None:
    """The tp `model`'s latency data on `gpu` was taken at; None when there is none."""
    for name, tp in model.tensor_parallel:
        if gpu_catalogue().resolve(name) == gpu:
            return tp
    return None


def default_tensor_parallel(model: ModelSpec, gpu: GpuSpec, precision: Precision) -> int:
    """The tp of the model's latency data on `gpu`; for a pair without data, the smallest
    power of two whose memory holds the weights with room left for a KV cache."""
    profiled = profiled_tensor_parallel(model, gpu)
    if profiled is not None:
        return profiled
    tp = 1
    while InstanceHardware(model, gpu, tp, precision).kv_capacity_tokens <= 0 and tp < 64:
        tp *= 2
    return tp
