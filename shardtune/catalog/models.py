"""Known architectures as their Hugging Face config.json values, each citing its source.

`resolve_model_config(spec)` is the one way every part of shardtune turns a model name, a
config.json path or a model folder into an HF config dict. Imports no torch.
"""
from __future__ import annotations

from pathlib import Path

from shardtune.errors import UserError, read_json_object, suggest

# What the tiny MoE entries share: tiny-llama's widths, vocabulary and token ids, 4 layers, top-2 routing,
# the aux coefficient 0.02 (each entry adds its class's own keys)
_TINY_MOE = {
    "vocab_size": 264, "hidden_size": 128, "intermediate_size": 128, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "num_experts_per_tok": 2, "router_aux_loss_coef": 0.02,
    "max_position_embeddings": 512, "rope_theta": 10000.0, "tie_word_embeddings": False, "hidden_act": "silu",
    "bos_token_id": 256, "eos_token_id": 257, "pad_token_id": 258, "initializer_range": 0.02,
}

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
    # A tiny Mixtral for the MoE tests (train/core/moe.py): tiny-llama's attention and vocabulary,
    # each MLP 4 experts of intermediate 128, top-2, Mixtral's aux coefficient 0.02. About 1.1 M parameters.
    "tiny-mixtral": {
        "source": "shardtune (defined here for tests)",
        "config": {
            **_TINY_MOE,
            "architectures": ["MixtralForCausalLM"],
            "model_type": "mixtral",
            "num_local_experts": 4,
            "router_jitter_noise": 0.0,
            "rms_norm_eps": 1e-5,
            "sliding_window": None,
        },
    },
    # A tiny Qwen3-MoE (Qwen3MoeForCausalLM): tiny-mixtral's widths and vocabulary plus Qwen3's q/k
    # RMSNorms and explicit head_dim; 4 experts of moe_intermediate_size 128, top-2, renormalised top-k.
    "tiny-qwen3-moe": {
        "source": "shardtune (defined here for tests)",
        "config": {
            **_TINY_MOE,
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            "moe_intermediate_size": 128,
            "head_dim": 32,
            "num_experts": 4,
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "rms_norm_eps": 1e-6,
            "attention_bias": False,
            "sliding_window": None,
            "use_sliding_window": False,
        },
    },
    # A tiny GPT-OSS (GptOssForCausalLM): attention sinks, biases on q/k/v/o, the router and the
    # experts, experts stored transposed ([E, h, 2I]), clamped SwiGLU, alternating sliding (32) / full
    # attention, YaRN rope (factor 32 as published, over 16 positions), the published swiglu_limit 7.0
    # (at this init the clamp never acts: tests/unit/test_moe.py checks it with a limit of 0.3).
    # 4 experts of 128, top-2.
    "tiny-gpt-oss": {
        "source": "shardtune (defined here for tests)",
        "config": {
            **_TINY_MOE,
            "architectures": ["GptOssForCausalLM"],
            "model_type": "gpt_oss",
            "head_dim": 32,
            "num_local_experts": 4,
            "experts_per_token": 2,
            "swiglu_limit": 7.0,
            "sliding_window": 32,
            "layer_types": ["sliding_attention", "full_attention"] * 2,
            "initial_context_length": 512,
            "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                             "original_max_position_embeddings": 16, "truncate": False},
            "rms_norm_eps": 1e-5,
            "attention_bias": True,
        },
    },
}


def _hf(repo: str) -> str:
    return f"https://huggingface.co/{repo}/blob/main/config.json"


def _llama(hidden, inter, layers, heads, kv, vocab, max_pos, rope_theta, **extra) -> dict:
    cfg = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv, "vocab_size": vocab,
        "max_position_embeddings": max_pos, "rms_norm_eps": 1e-5, "rope_theta": rope_theta,
        "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
    }
    cfg.update(extra)
    return cfg


_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
_LLAMA2 = {"bos_token_id": 1, "eos_token_id": 2}
_LLAMA3 = {"bos_token_id": 128000, "eos_token_id": 128001}

# The architecture values of each config.json (tokenizer ids and dtype hints kept where they
# matter for building the model; nothing here affects counts but the shapes).
MODELS.update({
    "llama-2-7b": {"source": _hf("meta-llama/Llama-2-7b-hf"),
                   "config": _llama(4096, 11008, 32, 32, 32, 32000, 4096, 10000.0, **_LLAMA2)},
    "llama-2-13b": {"source": _hf("meta-llama/Llama-2-13b-hf"),
                    "config": _llama(5120, 13824, 40, 40, 40, 32000, 4096, 10000.0, **_LLAMA2)},
    "llama-2-70b": {"source": _hf("meta-llama/Llama-2-70b-hf"),
                    "config": _llama(8192, 28672, 80, 64, 8, 32000, 4096, 10000.0, **_LLAMA2)},
    "llama-3-8b": {"source": _hf("meta-llama/Meta-Llama-3-8B"),
                   "config": _llama(4096, 14336, 32, 32, 8, 128256, 8192, 500000.0, **_LLAMA3)},
    "llama-3-70b": {"source": _hf("meta-llama/Meta-Llama-3-70B"),
                    "config": _llama(8192, 28672, 80, 64, 8, 128256, 8192, 500000.0, **_LLAMA3)},
    # Llama 3.1 8B: the architecture of Llama 3 8B, RoPE scaled to 131,072 positions (long context).
    "llama-3.1-8b": {"source": _hf("meta-llama/Llama-3.1-8B"),
                     "config": _llama(4096, 14336, 32, 32, 8, 128256, 131072, 500000.0,
                                      rope_scaling=dict(_LLAMA3_ROPE), **_LLAMA3)},
    # Llama 3.1 70B: the same architecture as Llama 3 70B (same parameter count), longer RoPE.
    "llama-3.1-70b": {"source": _hf("meta-llama/Llama-3.1-70B"),
                      "config": _llama(8192, 28672, 80, 64, 8, 128256, 131072, 500000.0,
                                       rope_scaling=dict(_LLAMA3_ROPE), **_LLAMA3)},
    "llama-3.1-405b": {"source": _hf("meta-llama/Llama-3.1-405B"),
                       "config": _llama(16384, 53248, 126, 128, 8, 128256, 131072, 500000.0,
                                        rope_scaling=dict(_LLAMA3_ROPE), **_LLAMA3)},
    "mistral-7b": {"source": _hf("mistralai/Mistral-7B-v0.1"),
                   "config": _llama(4096, 14336, 32, 32, 8, 32000, 32768, 10000.0,
                                    architectures=["MistralForCausalLM"], model_type="mistral",
                                    sliding_window=4096, bos_token_id=1, eos_token_id=2)},
    "mixtral-8x7b": {"source": _hf("mistralai/Mixtral-8x7B-v0.1"),
                     "config": _llama(4096, 14336, 32, 32, 8, 32000, 32768, 1000000.0,
                                      architectures=["MixtralForCausalLM"], model_type="mixtral",
                                      num_local_experts=8, num_experts_per_tok=2,
                                      router_aux_loss_coef=0.02, sliding_window=None,
                                      bos_token_id=1, eos_token_id=2)},
    # Qwen2: q/k/v projections carry a bias (transformers' Qwen2Attention), o_proj does not.
    "qwen2.5-7b": {"source": _hf("Qwen/Qwen2.5-7B"),
                   "config": _llama(3584, 18944, 28, 28, 4, 152064, 131072, 1000000.0,
                                    architectures=["Qwen2ForCausalLM"], model_type="qwen2",
                                    rms_norm_eps=1e-6, sliding_window=131072, use_sliding_window=False,
                                    max_window_layers=28, bos_token_id=151643, eos_token_id=151643)},
    "qwen2.5-72b": {"source": _hf("Qwen/Qwen2.5-72B"),
                    "config": _llama(8192, 29568, 80, 64, 8, 152064, 131072, 1000000.0,
                                     architectures=["Qwen2ForCausalLM"], model_type="qwen2",
                                     rms_norm_eps=1e-5, sliding_window=131072, use_sliding_window=False,
                                     max_window_layers=80, bos_token_id=151643, eos_token_id=151643)},
})

# Mixtures of experts (issue 39). Architecture values of each config.json; GPT-OSS's quantization_config
# (MXFP4 experts on the Hub) is left out: the planner and trainer hold bf16 / fp32 weights.
_QWEN3_MOE = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_act": "silu",
              "attention_bias": False, "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True,
              "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8, "num_key_value_heads": 4,
              "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
              "router_aux_loss_coef": 0.001, "output_router_logits": False, "tie_word_embeddings": False,
              "sliding_window": None, "use_sliding_window": False, "vocab_size": 151936,
              "bos_token_id": 151643, "eos_token_id": 151645}
_GPT_OSS = {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "hidden_act": "silu",
            "attention_bias": True, "head_dim": 64, "hidden_size": 2880, "intermediate_size": 2880,
            "num_attention_heads": 64, "num_key_value_heads": 8, "num_experts_per_tok": 4, "experts_per_token": 4,
            "max_position_embeddings": 131072, "initial_context_length": 4096, "rms_norm_eps": 1e-5,
            "rope_theta": 150000, "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                                                   "beta_slow": 1.0, "original_max_position_embeddings": 4096,
                                                   "truncate": False},
            "sliding_window": 128, "swiglu_limit": 7.0, "router_aux_loss_coef": 0.9, "output_router_logits": False,
            "tie_word_embeddings": False, "vocab_size": 201088, "eos_token_id": 200002, "pad_token_id": 199999}
MODELS.update({
    "mixtral-8x22b": {"source": _hf("mistralai/Mixtral-8x22B-v0.1"),
                      "config": _llama(6144, 16384, 56, 48, 8, 32768, 65536, 1000000.0,
                                       architectures=["MixtralForCausalLM"], model_type="mixtral",
                                       num_local_experts=8, num_experts_per_tok=2, router_aux_loss_coef=0.001,
                                       sliding_window=None, bos_token_id=1, eos_token_id=2)},
    # Qwen3-MoE: 128 experts of intermediate 768 (moe_intermediate_size), top-8, no shared expert
    "qwen3-30b-a3b": {"source": _hf("Qwen/Qwen3-30B-A3B"),
                      "config": {**_QWEN3_MOE, "hidden_size": 2048, "intermediate_size": 6144,
                                 "moe_intermediate_size": 768, "num_hidden_layers": 48, "num_attention_heads": 32,
                                 "max_window_layers": 48}},
    "qwen3-235b-a22b": {"source": _hf("Qwen/Qwen3-235B-A22B"),
                        "config": {**_QWEN3_MOE, "hidden_size": 4096, "intermediate_size": 12288,
                                   "moe_intermediate_size": 1536, "num_hidden_layers": 94,
                                   "num_attention_heads": 64, "max_window_layers": 94}},
    # GPT-OSS: alternating sliding (128) / full attention layers, attention sinks, biases everywhere
    "gpt-oss-20b": {"source": _hf("openai/gpt-oss-20b"),
                    "config": {**_GPT_OSS, "num_hidden_layers": 24, "num_local_experts": 32,
                               "layer_types": ["sliding_attention", "full_attention"] * 12}},
    "gpt-oss-120b": {"source": _hf("openai/gpt-oss-120b"),
                     "config": {**_GPT_OSS, "num_hidden_layers": 36, "num_local_experts": 128,
                                "layer_types": ["sliding_attention", "full_attention"] * 18}},
    # DeepSeek-V3: multi-head latent attention, 3 dense layers then 58 MoE layers of 256 routed experts
    # (top-8, sigmoid scores, 8 groups, top-4 groups) + 1 shared; the multi-token-prediction module
    # (num_nextn_predict_layers, 14 B more on the Hub: 685 B) is not part of the transformers model
    "deepseek-v3": {"source": _hf("deepseek-ai/DeepSeek-V3"),
                    "config": {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
                               "hidden_act": "silu", "hidden_size": 7168, "intermediate_size": 18432,
                               "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
                               "num_key_value_heads": 128, "n_routed_experts": 256, "n_shared_experts": 1,
                               "num_experts_per_tok": 8, "first_k_dense_replace": 3, "moe_layer_freq": 1,
                               "n_group": 8, "topk_group": 4, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
                               "norm_topk_prob": True, "routed_scaling_factor": 2.5, "q_lora_rank": 1536,
                               "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
                               "v_head_dim": 128, "num_nextn_predict_layers": 1, "vocab_size": 129280,
                               "max_position_embeddings": 163840, "rms_norm_eps": 1e-6, "rope_theta": 10000,
                               "rope_scaling": {"type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1,
                                                "mscale": 1.0, "mscale_all_dim": 1.0,
                                                "original_max_position_embeddings": 4096},
                               "attention_bias": False, "tie_word_embeddings": False,
                               "bos_token_id": 0, "eos_token_id": 1}},
})
for _cfg in (MODELS["mistral-7b"]["config"], MODELS["mixtral-8x7b"]["config"],
             MODELS["qwen2.5-7b"]["config"], MODELS["qwen2.5-72b"]["config"], MODELS["mixtral-8x22b"]["config"]):
    # These config.json files carry no attention_bias / mlp_bias keys (Llama-only options).
    _cfg.pop("attention_bias"), _cfg.pop("mlp_bias")


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
        return read_json_object(path, "config.json", "give a valid HF config.json or a catalogue name")
    raise UserError(
        f"unknown model {spec!r}{suggest(spec, MODELS)}; give a catalogue name "
        f"({', '.join(sorted(MODELS))}), an HF config.json or a model folder"
    )


def safetensors_files(spec: str) -> list[Path]:
    """A model folder's *.safetensors files, sorted ([] when `spec` is no folder or has none)."""
    folder = Path(spec).expanduser()
    return sorted(folder.glob("*.safetensors")) if folder.is_dir() else []
