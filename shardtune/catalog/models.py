"""Known architectures as their Hugging Face config.json values, each citing its source.

`resolve_model_config(spec)` is the one way every part of shardtune turns a model name, a
config.json path or a model folder into an HF config dict. Imports no torch.
"""
from __future__ import annotations

import json
from pathlib import Path

from shardtune.errors import UserError, suggest

# Each entry: {"source": URL of the config.json the values were copied from, "config": {...}}.
MODELS: dict[str, dict] = {
    # A tiny Llama for tests and the demo: byte-level vocabulary (256 bytes + bos/eos/pad, padded
    # to a multiple of 8), GQA (4 heads, 2 KV heads), untied embeddings. About 0.8 M parameters.
    "tiny-llama": {
        "source": "shardtune (defined here for tests and the demo)",
        "config": {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": 264,
            "hidden_size": 128,
            "intermediate_size": 344,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 512,
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "tie_word_embeddings": False,
            "attention_bias": False,
            "mlp_bias": False,
            "hidden_act": "silu",
            "bos_token_id": 256,
            "eos_token_id": 257,
            "pad_token_id": 258,
            "initializer_range": 0.02,
        },
    },
}


def resolve_model_config(spec: str) -> dict:
    """HF config dict for a catalogue name, a config.json file, or a model folder holding one."""
    if spec in MODELS:
        return dict(MODELS[spec]["config"])
    path = Path(spec).expanduser()
    if path.is_dir():
        path = path / "config.json"
        if not path.is_file():
            raise UserError(f"model folder {spec!r} has no config.json; give an HF model folder or a catalogue name")
    if path.suffix == ".json" or path.is_file():
        if not path.is_file():
            raise UserError(f"model config {spec!r} does not exist")
        try:
            cfg = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise UserError(f"malformed config.json {str(path)!r}: {e}; give a valid HF config.json") from None
        if not isinstance(cfg, dict):
            raise UserError(f"malformed config.json {str(path)!r}: not a JSON object")
        return cfg
    raise UserError(
        f"unknown model {spec!r}{suggest(spec, MODELS)}; give a catalogue name "
        f"({', '.join(sorted(MODELS))}), an HF config.json or a model folder"
    )
