"""The planned model: its parameter shapes (plan/params.py), with LoRA or QLoRA, and each
tensor's shape on one tensor-parallel rank (plan/tp.py). Imports no torch."""
from __future__ import annotations

from dataclasses import dataclass, field

from shardtune.catalog.models import MODELS, resolve_model_config
from shardtune.errors import UserError
from shardtune.plan.params import ParamShape, architecture_from_config, count_active_params, model_shapes
from shardtune.plan.tp import tp_local_shapes
from shardtune.strategies import LORA_TARGETS


@dataclass
class _Model:
    name: str
    source: str
    num_params: int
    trainable: int
    shapes: list[ParamShape] | None
    arch: object | None
    active: int
    buffer_cache: dict = field(default_factory=dict)
    config: dict = field(default_factory=dict)  # the HF config.json values (None: --params)
    stage: dict | None = None  # a pipeline stage (plan/pipeline.py): in_flight, head_in_flight, first, last

    def local_shapes(self, tp: int) -> list[ParamShape] | None:
        """Each tensor's shape on one tensor-parallel rank (plan/tp.py), before FSDP shards it."""
        if self.shapes is None:
            return None
        key = ("tp", tp)
        if key not in self.buffer_cache:
            self.buffer_cache[key] = tp_local_shapes(self.shapes, tp)
        return self.buffer_cache[key]


def _load_model(model, params: float | None, lora_rank: int, quantize_base: str = "none",
                target_parameters: list[str] | None = None, target_modules: list[str] | None = None) -> _Model:
    if params is not None:
        n = int(params)
        return _Model(f"{params:g} parameters", "--params (model states only)", n, n, None, None, n)
    cfg = model if isinstance(model, dict) else resolve_model_config(model)
    arch = architecture_from_config(cfg)
    if lora_rank > arch.hidden_size:
        raise UserError(f"--lora-rank {lora_rank} exceeds the hidden size {arch.hidden_size}; use a rank such as 8-64")
    targets = target_modules or LORA_TARGETS
    shapes = model_shapes(arch, lora_rank, quantize_base, target_parameters or (), targets)
    if lora_rank and not any(s.trainable for s in shapes):  # PEFT: "Target modules ... not found in the base model"
        raise UserError(f"lora.target_modules {list(targets)} name no nn.Linear of the model "
                        "(and lora.target_parameters no expert weight): nothing would train")
    adapted = {s.name.split(".lora_")[0] for s in shapes if s.name.endswith("lora_A.default.weight")}
    for t in target_parameters or []:
        if not any(a.endswith(f".{t}") for a in adapted):
            raise UserError(f"lora.target_parameters {t!r} names no 3-D expert weight of the model; give a suffix "
                            "such as experts.gate_up_proj or experts.down_proj")
    name = model if isinstance(model, str) else "config"
    source = MODELS[name]["source"] if name in MODELS else name
    total = sum(p.numel for p in shapes)  # with LoRA: the frozen base and the adapters
    trainable = sum(p.numel for p in shapes if p.trainable)
    return _Model(name, source, total, trainable, shapes, arch, count_active_params(arch), config=cfg)
