"""Cluster parsing: inline lists, YAML files, and the messages for bad input."""

from __future__ import annotations

from pathlib import Path

import pytest

from hexgen_flow.cluster import DEFAULT_CLUSTER, Cluster, parse_cluster
from hexgen_flow.errors import ConfigError, UnknownNameError
from hexgen_flow.latency import latency_model


def _yaml(tmp_path: Path, text: str, name: str = "cluster.yaml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


# --------------------------------------------------------------------------- inline


def test_paper_cluster_inline() -> None:
    cluster = parse_cluster("A100,A100,A6000,L40S")
    assert len(cluster) == 4
    assert cluster.gpus == ("A100", "A100", "A6000", "L40S")
    assert [i.index for i in cluster.instances] == [0, 1, 2, 3]
    assert [i.name for i in cluster.instances] == ["A100#0", "A100#1", "A6000#2", "L40S#3"]
    assert {i.model for i in cluster.instances} == {"llama-3.1-70b"}
    assert cluster.description == "A100,A100,A6000,L40S"
    for inst in cluster.instances:
        # Defaults come from the latency model of the instance's GPU type.
        assert inst.latency.gpu == inst.gpu
        assert inst.kv_cache_tokens == inst.latency.kv_capacity_tokens > 0
        assert inst.max_batch == 256
    assert cluster.instances[0].kv_cache_tokens > cluster.instances[2].kv_cache_tokens


def test_default_cluster_is_the_papers() -> None:
    assert parse_cluster(DEFAULT_CLUSTER).gpus == ("A100", "A100", "A6000", "L40S")


@pytest.mark.parametrize(
    ("text", "gpus"),
    [
        ("A100x2,L40S", ("A100", "A100", "L40S")),
        ("A100*3", ("A100", "A100", "A100")),
        ("L40S,A6000x2", ("L40S", "A6000", "A6000")),
        (" a100 , l40s ", ("A100", "L40S")),
        ("H100x2,H200", ("H100", "H100", "H200")),
    ],
)
def test_inline_repeats_and_spelling(text: str, gpus: tuple[str, ...]) -> None:
    cluster = parse_cluster(text)
    assert cluster.gpus == gpus
    assert [i.index for i in cluster.instances] == list(range(len(gpus)))


def test_inline_cluster_of_another_model() -> None:
    cluster = parse_cluster("H100,A100", model="Qwen/Qwen3-30B-A3B")
    assert {i.model for i in cluster.instances} == {"qwen3-30b-a3b"}
    assert cluster.instances[0].latency is latency_model("qwen3-30b-a3b", "H100")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "cannot read ''"),
        ("A100,,L40S", "cannot read ''"),
        ("A100,", "cannot read ''"),
        ("A100 x2", "cannot read 'A100 x2'"),
        ("A100x0", "A100x0"),
        ("A100x0,L40S", "A100x0"),
    ],
)
def test_inline_syntax_errors(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_cluster(text)


def test_inline_unknown_gpu_lists_the_known_ones() -> None:
    with pytest.raises(UnknownNameError) as err:
        parse_cluster("A100,V100")
    for name in ("V100", "A100", "A6000", "L40S", "H100", "H200"):
        assert name in str(err.value)


def test_inline_gpu_the_model_was_not_profiled_on() -> None:
    with pytest.raises(UnknownNameError, match="A100-80GB-PCIe"):
        parse_cluster("A100-80GB-PCIe", model="qwen3-30b-a3b")


def test_inline_unknown_model() -> None:
    with pytest.raises(UnknownNameError, match=r"llama-3\.1-70b"):
        parse_cluster("A100", model="mystery-7b")


# --------------------------------------------------------------------------- YAML


def test_yaml_with_counts_overrides_and_models(tmp_path: Path) -> None:
    path = _yaml(
        tmp_path,
        """\
model: llama-3.1-70b
instances:
  - gpu: A100
    count: 2
  - gpu: A6000
    kv_cache_tokens: 120000
    max_batch: 128
  - gpu: H100
    model: qwen3-30b-a3b
""",
    )
    cluster = parse_cluster(path)
    assert cluster.gpus == ("A100", "A100", "A6000", "H100")
    assert cluster.description == path
    a, b, c, d = cluster.instances
    assert [i.index for i in cluster.instances] == [0, 1, 2, 3]
    assert (a.model, b.model, c.model, d.model) == (
        "llama-3.1-70b",
        "llama-3.1-70b",
        "llama-3.1-70b",
        "qwen3-30b-a3b",
    )
    assert (
        a.kv_cache_tokens
        == b.kv_cache_tokens
        == latency_model("llama-3.1-70b", "A100").kv_capacity_tokens
    )
    assert (c.kv_cache_tokens, c.max_batch) == (120000, 128)
    assert a.max_batch == 256
    assert d.latency is latency_model("qwen3-30b-a3b", "H100")


def test_yaml_without_model_uses_the_callers(tmp_path: Path) -> None:
    path = _yaml(tmp_path, "instances:\n  - gpu: L40S\n", name="c.yml")
    assert parse_cluster(path, model="qwen3-30b-a3b").instances[0].model == "qwen3-30b-a3b"
    assert parse_cluster(path).instances[0].model == "llama-3.1-70b"


def test_existing_file_without_yaml_suffix_is_read_as_yaml(tmp_path: Path) -> None:
    path = _yaml(tmp_path, "instances:\n  - gpu: A100\n    count: 3\n", name="cluster.conf")
    assert parse_cluster(path).gpus == ("A100", "A100", "A100")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("instances: [\n", "not valid YAML"),
        ("- gpu: A100\n", "expected a mapping with an 'instances' list"),
        ("instances: A100\n", "expected a mapping with an 'instances' list"),
        ("gpus: [A100]\n", "expected a mapping with an 'instances' list"),
        ("instances: []\n", "at least one instance"),
        ("instances:\n  - count: 2\n", r"instances\[0\] needs a 'gpu' field"),
        ("instances:\n  - A100\n", r"instances\[0\] needs a 'gpu' field"),
        (
            "instances:\n  - gpu: A100\n  - gpu: L40S\n    count: 0\n",
            r"instances\[1\]\.count must be an integer >= 1",
        ),
        ("instances:\n  - gpu: A100\n    count: two\n", r"instances\[0\]\.count"),
        ("instances:\n  - gpu: A100\n    count: 1.5\n", r"instances\[0\]\.count"),
        ("instances:\n  - gpu: A100\n    kv_cache_tokens: 0\n", "no memory for the KV cache"),
        (
            "instances:\n  - gpu: A100\n    kv_cache_tokens: lots\n",
            "kv_cache_tokens must be an integer",
        ),
        ("instances:\n  - gpu: A100\n    max_batch: 0\n", "max_batch must be >= 1"),
        ("instances:\n  - gpu: A100\n    max_batch: many\n", "max_batch must be an integer"),
        (
            "instances:\n  - gpu: A100\n    kv_cache_tokns: 5\n",
            r"instances\[0\]: unknown key 'kv_cache_tokns'",
        ),
        ("modle: qwen3-30b-a3b\ninstances:\n  - gpu: A100\n", "unknown key 'modle'"),
    ],
)
def test_yaml_errors(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_cluster(_yaml(tmp_path, text))


def test_yaml_errors_name_the_file(tmp_path: Path) -> None:
    path = _yaml(tmp_path, "instances:\n  - count: 2\n")
    with pytest.raises(ConfigError, match=f"cluster file {path}"):
        parse_cluster(path)


def test_yaml_unknown_gpu_and_model(tmp_path: Path) -> None:
    with pytest.raises(UnknownNameError, match="V100"):
        parse_cluster(_yaml(tmp_path, "instances:\n  - gpu: V100\n"))
    with pytest.raises(UnknownNameError, match="qwen3-30b-a3b"):
        parse_cluster(_yaml(tmp_path, "model: mystery\ninstances:\n  - gpu: A100\n"))


def test_missing_yaml_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match=f"cluster file {missing} does not exist"):
        parse_cluster(str(missing))


def test_build_directly_needs_an_instance() -> None:
    with pytest.raises(ConfigError, match="at least one instance"):
        Cluster.build([], "empty")
