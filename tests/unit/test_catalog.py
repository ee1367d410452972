"""The catalogue: every entry cites its source; GPU capacities agree with their names."""
import re

import pytest

from shardtune.catalog.gpus import GPUS, resolve_gpu
from shardtune.catalog.models import MODELS, resolve_model_config
from shardtune.errors import UserError

REQUIRED = ["llama-2-7b", "llama-2-13b", "llama-2-70b", "llama-3-8b", "llama-3-70b", "llama-3.1-70b",
            "llama-3.1-405b", "mistral-7b", "mixtral-8x7b", "qwen2.5-7b", "qwen2.5-72b", "tiny-llama"]


def test_required_models_present_with_hf_sources():
    assert set(REQUIRED) <= set(MODELS)
    for name in REQUIRED:
        if name == "tiny-llama":
            continue
        assert re.fullmatch(r"https://huggingface\.co/[\w.-]+/[\w.-]+/blob/main/config\.json", MODELS[name]["source"])


def test_resolve_returns_a_copy():
    cfg = resolve_model_config("llama-3-8b")
    cfg["hidden_size"] = 1
    assert resolve_model_config("llama-3-8b")["hidden_size"] == 4096


@pytest.mark.parametrize("name", sorted(GPUS))
def test_gpu_capacity_matches_its_name(name):
    # "80gb" in the name: the driver reports a little under 80 GiB (minus ECC / reserved memory).
    nominal = int(re.search(r"(\d+)gb$", name).group(1))
    gib = GPUS[name].memory_bytes / 2**30
    assert 0.92 * nominal <= gib <= 1.0 * nominal, (name, gib)  # L40S: ECC takes ~6 %
    assert GPUS[name].bf16_flops > 1e14 and GPUS[name].source.startswith("https://")


def test_resolve_gpu():
    assert resolve_gpu("H100-80GB").name == "h100-80gb"
    with pytest.raises(UserError, match="did you mean 'h200-141gb'"):
        resolve_gpu("h200")
