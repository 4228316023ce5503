"""`calc.Serving`: validation names the field and the allowed range; versions parse."""

from __future__ import annotations

import pytest

import calc
from calc.config.serving import parse_version


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"gpu_memory_utilization": 0.0}, "gpu_memory_utilization=0.0"),
        ({"gpu_memory_utilization": 1.2}, "gpu_memory_utilization=1.2"),
        ({"gpu_memory_utilization": True}, "gpu_memory_utilization=True"),
        ({"max_model_len": 0}, "max_model_len=0"),
        ({"max_num_seqs": -1}, "max_num_seqs=-1"),
        ({"tensor_parallel": 0}, "tensor_parallel=0"),
        ({"block_size": 12}, "block_size=12"),
        ({"kv_cache_dtype": "int8"}, "kv_cache_dtype='int8'"),
        ({"quant": "awq4"}, "quant='awq4'"),
        ({"dtype": "bfloat16"}, "dtype='bfloat16'"),
        ({"engine": "sglang"}, "engine='sglang'"),
        ({"vllm_version": "0.5.0"}, "vllm_version='0.5.0'"),
        ({"vllm_version": "latest"}, "vllm_version='latest'"),
        ({"enforce_eager": 1}, "enforce_eager=1"),
        ({"entrypoint": "grpc"}, "entrypoint='grpc'"),
    ],
)
def test_invalid_fields_are_named(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(".", r"\.")):
        calc.Serving(**fields)  # type: ignore[arg-type]


def test_versions_parse_with_suffixes() -> None:
    assert parse_version("0.10.1.1") == (0, 10, 1)
    assert parse_version("0.6.4.post1") == (0, 6, 4)
    assert parse_version("0.19") == (0, 19, 0)
    assert calc.Serving(vllm_version="0.8.5").version == (0, 8, 5)


def test_serving_is_frozen() -> None:
    serving = calc.Serving()
    with pytest.raises(AttributeError):
        serving.block_size = 32  # type: ignore[misc]
