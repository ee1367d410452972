"""The contenders bench/throughput.py and bench/memory.py run beside shardtune, one per process
group, each through its own entry point under torchrun (gloo, CPU):

    python -m torch.distributed.run --standalone --nproc-per-node 2 bench/peer_loops.py limit SPEC.json
    python -m torch.distributed.run --standalone --nproc-per-node 2 bench/peer_loops.py hf-trainer SPEC.json
    python -m torch.distributed.run --standalone --nproc-per-node 2 bench/peer_loops.py fabric SPEC.json

limit       the FSDP2 tutorial loop: fully_shard per decoder layer + root, forward, token-mean
            cross-entropy, backward, clip at 1.0 (the same algorithm as the others), AdamW. No
            framework: the ceiling a trainer can only approach.
hf-trainer  transformers.Trainer with accelerate's FSDP2 plugin (`fsdp="full_shard"`,
            fsdp_config version 2, LlamaDecoderLayer wrapped), its own defaults otherwise
            (fused AdamW, its loss normalisation, its dataloader).
fabric      Lightning Fabric with FSDPStrategy (FSDP1, what its docs suggest for this case).
fabric-fsdp2  Lightning Fabric with ModelParallelStrategy, its FSDP2 path: the user's
            parallelize_fn does fully_shard per decoder layer + root on Fabric's mesh.

SPEC.json (written by bench/throughput.py): model config path, data and train settings identical
to the shardtune recipe of the same comparison, and `out` (a folder). Each worker writes what
shardtune's trainer writes for the same thing: rank 0 a metrics.jsonl line per step
({"step", "step_time_s", "tokens_per_s"}), flushed, so the driver can stamp its arrival the same
way for every contender; every rank its model-state bytes into memory.json.
The batches are shardtune's own loader's rows for each rank (train/data/dataset.py): the same tokens,
documents and position ids in every contender, so the packed attention masks cost the same.
"""
from __future__ import annotations

import json
import os
import resource
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

IGNORE_INDEX = -100


def storage_bytes(tensors) -> int:
    """Distinct storages behind `tensors` (DTensors by their local shard). Written here, not taken
    from shardtune.train.core.metrics, so that shardtune's own count is checked against another one."""
    seen = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            t = t.to_local() if hasattr(t, "to_local") else t
            s = t.untyped_storage()
            seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def state_bytes(params, optimizer) -> dict:
    params = list(params)
    opt_tensors = (v for st in optimizer.state.values() for v in st.values())
    return {"params_bytes": storage_bytes(params), "grads_bytes": storage_bytes(p.grad for p in params),
            "optimizer_bytes": storage_bytes(opt_tensors)}


def rank_batches(spec: dict, rank: int, world: int, steps: int) -> list[list[dict]]:
    """batches[r][s]: the micro-batch shardtune's loader gives rank r at step s."""
    from shardtune.config import DataConfig, TrainConfig
    from shardtune.train.data.dataset import build_dataset, build_tokenizer
    from shardtune.train.data.packing import PackedLoader

    dcfg = DataConfig(**spec["data"])
    tcfg = TrainConfig(micro_batch=spec["micro_batch"], seq_len=spec["seq_len"], seed=spec["seed"])
    tok = build_tokenizer(dcfg, spec["model"])
    data = build_dataset(dcfg, tcfg.seq_len, tok, tcfg.seed)
    out = []
    for r in range(world):
        loader = PackedLoader(data, tcfg.micro_batch, r, world, tcfg.seed, dcfg.shuffle, tok.pad_id)
        out.append([next(loader) for _ in range(steps)])
    return out


def build_model(spec: dict):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = json.loads(Path(spec["model"]).read_text())
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    torch.manual_seed(spec["seed"])
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    model.config.use_cache = False
    return model


class Recorder:
    """Rank 0's metrics.jsonl; every rank's memory.json (states once all exist, peak RSS at exit)."""

    def __init__(self, spec: dict, rank: int):
        self.out, self.rank, self.tokens = Path(spec["out"]), rank, spec["tokens_per_step"]
        self.mem_step = spec.get("mem_step", 3)
        self.states: dict = {}
        self.f = (self.out / "metrics.jsonl").open("w") if rank == 0 else None

    def step(self, step: int, dt: float) -> None:
        if self.f:
            self.f.write(json.dumps({"step": step, "step_time_s": dt, "tokens_per_s": self.tokens / dt}) + "\n")
            self.f.flush()

    def maybe_states(self, step: int, params, optimizer) -> None:
        if step == self.mem_step:  # after the optimizer step, before grads are dropped
            self.states = state_bytes(params, optimizer)

    def finish(self) -> None:
        rec = dict(self.states, ru_maxrss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, rec)
        if self.rank == 0:
            self.f.close()
            (self.out / "memory.json").write_text(json.dumps({"per_rank": every}, indent=1))


def bare_loop(model, opt, batches, rec: Recorder, backward, clip) -> None:
    """The tutorial step (token-mean loss, backward, clip, AdamW) with the framework's own
    backward and clip: the limit and Fabric differ only there."""
    for step, b in enumerate(batches, 1):
        t0 = time.perf_counter()
        logits = model(input_ids=b["input_ids"], position_ids=b["position_ids"]).logits
        loss = F.cross_entropy(logits.flatten(0, 1), b["labels"].flatten(), ignore_index=IGNORE_INDEX)
        del logits  # as shardtune's step: backward does not need them
        backward(loss)
        clip()
        opt.step()
        rec.maybe_states(step, model.parameters(), opt)
        opt.zero_grad()
        loss.item()  # the host waits for the step, as every contender's timer does
        rec.step(step, time.perf_counter() - t0)
    rec.finish()


def run_limit(spec: dict) -> None:
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    batches = rank_batches(spec, rank, world, spec["steps"])[rank]
    model = build_model(spec)
    model.train()
    for layer in model.model.layers:
        fully_shard(layer, reshard_after_forward=spec["strategy"] == "zero3")
    fully_shard(model, reshard_after_forward=spec["strategy"] == "zero3")
    opt = torch.optim.AdamW(model.parameters(), lr=spec["lr"], betas=(0.9, 0.95), weight_decay=0.0)
    rec = Recorder(spec, rank)
    bare_loop(model, opt, batches, rec, backward=lambda loss: loss.backward(),
              clip=lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
    model = opt = None  # dropped by rebinding: the clip lambda holds the name `model`
    dist.destroy_process_group()


def run_hf_trainer(spec: dict) -> None:
    from torch.utils.data import Dataset, SequentialSampler
    from transformers import Trainer, TrainerCallback, TrainingArguments

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    per_rank = rank_batches(spec, rank, world, spec["steps"])
    # row order such that accelerate's batch sharding (batch k → rank k % world) hands rank r at
    # step s exactly per_rank[r][s]
    rows = [{"input_ids": b["input_ids"][i], "position_ids": b["position_ids"][i],
             "labels": b["labels"][i], "shift_labels": b["labels"][i]}  # labels already shifted
            for s in range(spec["steps"]) for r in range(world)
            for b in [per_rank[r][s]] for i in range(b["input_ids"].shape[0])]

    class Rows(Dataset):
        def __len__(self):
            return len(rows)

        def __getitem__(self, i):
            return rows[i]

    class InOrder(Trainer):
        def _get_train_sampler(self, *a, **k):
            return SequentialSampler(self.train_dataset)

    class Timing(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_optimizer_step(self, args, state, control, **kw):
            opt = kw["optimizer"]
            rec.maybe_states(state.global_step + 1, kw["model"].parameters(), getattr(opt, "optimizer", opt))

        def on_step_end(self, args, state, control, **kw):
            rec.step(state.global_step, time.perf_counter() - self.t0)

    args = TrainingArguments(
        output_dir=str(Path(spec["out"]) / "hf"), per_device_train_batch_size=spec["micro_batch"],
        max_steps=spec["steps"], learning_rate=spec["lr"], adam_beta2=0.95, weight_decay=0.0,
        max_grad_norm=1.0, lr_scheduler_type="cosine", logging_steps=10**6, save_strategy="no",
        report_to="none", use_cpu=True, ddp_backend="gloo", dataloader_num_workers=0,
        remove_unused_columns=False, disable_tqdm=True, seed=spec["seed"],
        fsdp="full_shard" if spec["strategy"] == "zero3" else "shard_grad_op",
        fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]})
    rec = Recorder(spec, rank)
    trainer = InOrder(model=build_model(spec), args=args, train_dataset=Rows(), callbacks=[Timing()])
    trainer.train()
    rec.finish()
    del trainer
    dist.destroy_process_group()


def _fabric_strategy(which: str, reshard: bool):
    from lightning.fabric.strategies import FSDPStrategy, ModelParallelStrategy
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    if which == "fabric":
        return FSDPStrategy(auto_wrap_policy={LlamaDecoderLayer}, process_group_backend="gloo")

    def parallelize(model, mesh):
        from torch.distributed.fsdp import fully_shard

        dp = mesh["data_parallel"]
        for layer in model.model.layers:
            fully_shard(layer, mesh=dp, reshard_after_forward=reshard)
        return fully_shard(model, mesh=dp, reshard_after_forward=reshard)

    return ModelParallelStrategy(parallelize_fn=parallelize, data_parallel_size=int(os.environ["WORLD_SIZE"]),
                                 tensor_parallel_size=1, process_group_backend="gloo")


def run_fabric(spec: dict, which: str = "fabric") -> None:
    import lightning as L

    fabric = L.Fabric(accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]),
                      strategy=_fabric_strategy(which, spec["strategy"] == "zero3"))
    fabric.launch()
    rank, world = fabric.global_rank, fabric.world_size
    batches = rank_batches(spec, rank, world, spec["steps"])[rank]
    model = fabric.setup_module(build_model(spec))
    opt = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=spec["lr"], betas=(0.9, 0.95)))
    bare_loop(model, opt, batches, Recorder(spec, rank), backward=fabric.backward,
              clip=lambda: fabric.clip_gradients(model, opt, max_norm=1.0))


if __name__ == "__main__":
    which, spec_path = sys.argv[1], sys.argv[2]
    {"limit": run_limit, "hf-trainer": run_hf_trainer, "fabric": run_fabric,
     "fabric-fsdp2": lambda s: run_fabric(s, "fabric-fsdp2")}[which](json.loads(Path(spec_path).read_text()))
