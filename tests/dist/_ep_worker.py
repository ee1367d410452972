"""One rank of the expert-parallel test (tests/dist/test_ep.py): tiny-mixtral with its experts split
over the ranks (parallel/ep.py `apply_ep`, ep = world) against the whole model in one process (the
same rank, the whole global batch, transformers' own loss with its aux loss), fp32, AdamW, a few steps.

Each rank takes its rows of the global batch; its loss part is its token-loss sum / the global
tokens plus the trainer's aux-loss part (train/core/moe.py `MoeTerms`, counts summed over the
ranks); the replicated (non-expert) gradients are summed over the ranks, the experts' are whole
already (their rows came from every rank). `forced`: every router sends every token to expert 0
(weight ~1; expert 1 the second slot, weight ~e^-50), so rank 1 receives no token at all.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from shardtune.config import ModelConfig
from shardtune.parallel.ep import apply_ep, expert_modules, whole_model_params
from shardtune.train.core.model import build_meta_model, init_model_weights
from shardtune.train.core.moe import MoeTerms, routers


def _model(forced: bool):
    model = build_meta_model(ModelConfig(name="tiny-mixtral"))
    model.to_empty(device="cpu")
    init_model_weights(model, ModelConfig(name="tiny-mixtral"), seed=0)
    if forced:  # logits + (100, 50, 0, 0): every token's top-2 are experts 0 and 1 (rank 0's), weight ~1 on 0
        for r in routers(model):
            r.forward = lambda hidden, r=r: _forced(r, hidden)
    return model


def _forced(router, hidden):
    """The router's forward (train/core/moe.py's fp32 one) with a fixed bias on the logits, so that
    transformers' aux loss (top-k of the logits) sees the routing the experts get."""
    logits = F.linear(hidden.reshape(-1, router.hidden_dim).float(), router.weight.float())
    logits = logits + torch.tensor([100.0, 50.0, 0.0, 0.0])
    top, index = torch.topk(torch.softmax(logits, dim=-1), router.top_k, dim=-1)
    return logits, top / top.sum(dim=-1, keepdim=True), index


def _adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)


def _meta_fill_diff() -> float:
    """The trainer's order (meta build → apply_ep → to_empty → init_model_weights): each rank's
    experts are its rows of the full seeded tensors, every other weight the full model's."""
    meta = build_meta_model(ModelConfig(name="tiny-mixtral"))
    apply_ep(meta, dist.group.WORLD)
    meta.to_empty(device="cpu")
    init_model_weights(meta, ModelConfig(name="tiny-mixtral"), seed=0)
    full, experts = dict(_model(False).named_parameters()), expert_modules(meta)[0]
    mine = slice(experts.ep_offset, experts.ep_offset + experts.num_experts)
    return max(float((p.detach() - full[n].detach()[mine if ".experts." in n else slice(None)]).abs().max())
               for n, p in meta.named_parameters())


def _fsdp_ep_model(world: int):
    """zero3 with ep = world, as docs/moe.md's wiring says: apply_ep on meta, each layer's experts
    `fully_shard` on their own expert-FSDP mesh (here 1 rank: dp_shard / ep) with the gradient
    divided by the whole dp degree, then the layer and the root on the dp mesh; to_empty, fill."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from shardtune.parallel.layers import decoder_layers

    model = build_meta_model(ModelConfig(name="tiny-mixtral"))
    apply_ep(model, dist.group.WORLD)
    dp_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
    expert_mesh = DeviceMesh("cpu", [[r] for r in range(world)], mesh_dim_names=("ep", "efsdp"))["efsdp"]
    for layer in decoder_layers(model):
        fully_shard(layer.mlp.experts, mesh=expert_mesh)
        layer.mlp.experts.set_gradient_divide_factor(float(world))
        fully_shard(layer, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    model.to_empty(device="cpu")
    init_model_weights(model, ModelConfig(name="tiny-mixtral"), seed=0)
    return model


def _fsdp_case(case: dict, rank: int, world: int) -> dict:
    """The trainer's own `train_step` (train/core/step.py: token loss + aux part, loss x dp_size,
    FSDP's average undone, clip 1.0 through parallel/ep.py's per-mesh norm) on the ep x zero3
    model, against the whole model in one process (clip_grad_norm_ 1.0)."""
    from shardtune.train.core.step import StepOptions, global_loss, train_step

    rows, seq = case["rows"], case["seq_len"]
    ref, model = _model(False), _fsdp_ep_model(world)
    ref_opt, opt = _adamw(ref), _adamw(model)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    opts = StepOptions(loss_chunks=1, grad_clip=1.0)
    gen = torch.Generator().manual_seed(1)
    out = {"ref_loss": [], "ep_loss": [], "ref_aux": [], "ep_aux": [], "ref_norm": [], "ep_norm": []}
    for _ in range(case["steps"]):
        ids = torch.randint(0, 256, (rows, seq), generator=gen)
        res = ref(input_ids=ids, labels=ids, output_router_logits=True)
        res.loss.backward()
        out["ref_norm"].append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)))
        ref_opt.step()
        ref_opt.zero_grad()
        mine = ids.chunk(world)[rank]
        labels = torch.cat([mine[:, 1:], torch.full((mine.shape[0], 1), -100)], dim=1)
        mb = {"input_ids": mine, "position_ids": torch.arange(seq).expand(mine.shape[0], -1), "labels": labels}
        r = train_step(model, opt, sched, [mb], opts, dp_group=dist.group.WORLD, dp_size=world)
        aux = r.parts["aux_loss"].clone()
        dist.all_reduce(aux)
        coef = ref.config.router_aux_loss_coef
        out["ref_loss"].append(float(res.loss))
        out["ref_aux"].append(float(res.aux_loss))
        out["ep_loss"].append(global_loss(r) + coef * float(aux))  # the trainer logs them apart
        out["ep_aux"].append(float(aux))
        out["ep_norm"].append(float(r.grad_norm))
    return out


def _refusals() -> list[str]:
    """apply_ep's one-line refusals: ep 2 on 3 experts a layer, ep on a dense model."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from shardtune.errors import UserError

    three = AutoConfig.for_model("mixtral", vocab_size=64, hidden_size=16, intermediate_size=8, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1, num_local_experts=3)
    out = []
    for model in (AutoModelForCausalLM.from_config(three), build_meta_model(ModelConfig(name="tiny-llama"))):
        try:
            apply_ep(model, dist.group.WORLD)
            out.append("")
        except UserError as e:
            out.append(str(e))
    return out


def _a2a_bytes(case: dict, rank: int, world: int) -> dict:
    """Bytes each rank hands to the dispatch and combine all-to-alls (parallel/ep.py `_all_to_all`:
    its send buffers, forward and backward) in one step on `rows` x `seq_len` tokens of its own."""
    import shardtune.parallel.ep as ep_mod

    model, sent = _model(False), []
    apply_ep(model, dist.group.WORLD)
    inner = ep_mod._all_to_all

    def counting(x, out_splits, in_splits, group):
        sent.append(x.numel() * x.element_size())
        return inner(x, out_splits, in_splits, group)

    ep_mod._all_to_all = counting
    try:
        ids = torch.randint(0, 256, (case["rows"], case["seq_len"]), generator=torch.Generator().manual_seed(rank))
        model(input_ids=ids, labels=ids).loss.backward()
    finally:
        ep_mod._all_to_all = inner
    return {"a2a_bytes": sum(sent), "a2a_calls": len(sent)}


def run_case(case: dict, rank: int, world: int) -> dict:
    if case.get("a2a"):
        return _a2a_bytes(case, rank, world)
    if case.get("meta_fill"):
        return {"meta_fill_diff": _meta_fill_diff(), "refusals": _refusals()}
    if case.get("fsdp"):
        return _fsdp_case(case, rank, world)
    torch.manual_seed(0)
    rows, seq, steps = case["rows"], case["seq_len"], case["steps"]
    ref, ep = _model(case["forced"]), _model(case["forced"])
    apply_ep(ep, dist.group.WORLD)
    ref_opt, ep_opt = _adamw(ref), _adamw(ep)
    expert_names = {n for n, _ in ep.named_parameters() if ".experts." in n}
    gen = torch.Generator().manual_seed(1)
    out = {"ref_loss": [], "ep_loss": [], "ref_aux": [], "ep_aux": [], "received": []}
    for _ in range(steps):
        ids = torch.randint(0, 256, (rows, seq), generator=gen)
        res = ref(input_ids=ids, labels=ids, output_router_logits=True)  # mean CE + coef x aux (transformers)
        res.loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        out["ref_loss"].append(float(res.loss))
        out["ref_aux"].append(float(res.aux_loss))

        mine = ids.chunk(world)[rank]
        terms = MoeTerms(ep, num_micro_batches=1, group=dist.group.WORLD)
        with terms.routing() as seen:
            logits = ep(input_ids=mine).logits
        ce = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), mine[:, 1:].flatten(), reduction="sum")
        part = terms.add_objective(ce / (rows * (seq - 1)), seen, dp_size=1)
        part.backward()
        for name, p in ep.named_parameters():
            if name not in expert_names:
                dist.all_reduce(p.grad)  # the replicated weights: the sum of the ranks' parts
        ep_opt.step()
        ep_opt.zero_grad()
        total = part.detach().clone()
        dist.all_reduce(total)
        out["ep_loss"].append(float(total))
        aux = terms.aux.clone()
        dist.all_reduce(aux)  # the ranks' parts: the global batch's aux loss
        out["ep_aux"].append(float(aux))
        first = expert_modules(ep)[0]
        mine = slice(first.ep_offset, first.ep_offset + first.num_experts)
        out["received"].append(int(terms.counts[:, mine].sum()))  # rows this rank's experts got, all layers
    full = dict(ref.named_parameters())
    out["local_experts"] = int(first.num_experts)
    out["whole_params"] = (whole_model_params(ep), sum(p.numel() for p in ref.parameters()))  # the start-up count
    out["expert_weight_diff"] = max(
        float((p.detach() - full[name].detach()[mine]).abs().max()) for name, p in ep.named_parameters()
        if name in expert_names)
    out["other_weight_diff"] = max(
        float((p.detach() - full[name].detach()).abs().max()) for name, p in ep.named_parameters()
        if name not in expert_names)
    return out
