"""What a run measures: FLOPs per token, exact bytes of model states, activation bytes, metrics.jsonl.

Memory on CPU (no allocator statistics there) is an exact count of live storages, deduplicated:
  params / grads / optimizer  the storages of this rank's local parameters (DTensor local shards
                              under FSDP), their .grad, and every tensor in the optimizer state
                              (Adam m, v and the per-tensor `step` scalar; zero1: this rank's part);
  activations                 the storages autograd saves for backward during one micro-batch's
                              forward (all alive at its end), parameters and their views
                              excluded. Not counted: transient temporaries, and the inputs a
                              non-reentrant checkpoint keeps in its closure (no saved-tensor
                              hook sees them), so this is a lower bound of the peak.
On CUDA, `peak_mem_bytes` is torch.cuda.max_memory_allocated since the previous logged step.
One CPU step (the third) also runs under torch's MemTracker (train/core/memtrack.py) → memory.json.
"""
from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes

from shardtune.catalog.gpus import resolve_gpu
from shardtune.rules.flops import matmul_params, model_flops_per_token
from shardtune.strategies import STRATEGY
from shardtune.train.core.eval_lines import eval_lines
from shardtune.train.core.memory_json import measured_memory
from shardtune.train.core.memtrack import tracked_call


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP2), or the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def storages(t: torch.Tensor) -> list[torch.UntypedStorage]:
    """The storages behind `t`: a DTensor's local shard's; a wrapper subclass without storage of
    its own (torchao's NF4 weight, 8-bit optimizer state) by the inner tensors it flattens into."""
    t = local_tensor(t)
    if isinstance(t, nn.Parameter) and type(t.data) is not torch.Tensor:
        t = t.data
    if type(t) not in (torch.Tensor, nn.Parameter) and hasattr(t, "__tensor_flatten__"):
        return [s for name in t.__tensor_flatten__()[0] for s in storages(getattr(t, name))]
    return [t.untyped_storage()]


def storage_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the distinct storages behind `tensors` (views of one storage count once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None or not isinstance(t, torch.Tensor):
            continue
        for s in storages(t):
            seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def optimizer_state_tensors(optimizer) -> Iterator[torch.Tensor]:
    """Every tensor of the optimizer's state on this rank (zero1: its local partition)."""
    inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer wraps the local one
    for state in inner.state.values():
        yield from (v for v in state.values() if isinstance(v, torch.Tensor))


def model_state_bytes(model: nn.Module, optimizer) -> dict[str, int]:
    """{params_bytes, grads_bytes, optimizer_bytes}: exact local bytes on this rank."""
    params = list(model.parameters())
    return {"params_bytes": storage_bytes(params),
            "grads_bytes": storage_bytes(p.grad for p in params),
            "optimizer_bytes": storage_bytes(optimizer_state_tensors(optimizer))}


class SavedActivations:
    """Counts the distinct storages saved for backward (parameters excluded) while active; with an
    activation offload (train/core/offload.py), the ones moved to host memory apart."""

    def __init__(self) -> None:
        self.peak_bytes = 0  # on the device
        self.peak_offloaded_bytes = 0  # in host memory (parallel.activation_offload)
        self._seen: dict[int, int] = {}
        self._off: dict[int, int] = {}

    def _count(self, t: torch.Tensor, into: dict) -> None:
        # a parameter, or a view of one (F.linear saves weight.t()), is not an activation
        if not isinstance(t, nn.Parameter) and not isinstance(t._base, nn.Parameter) and t.device.type != "meta":
            s = local_tensor(t).untyped_storage()
            try:
                into[s.data_ptr()] = s.nbytes()
            except RuntimeError:  # a frozen TP-split weight's view (LoRA under tp): storage FSDP2 swaps, no activation
                pass

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self._count(t, self._seen)
        return t

    @contextmanager
    def micro_batch(self, offload=None):
        """Wrap one micro-batch's forward: all its saved tensors are alive at the end of it."""
        self._seen, self._off = {}, {}
        if offload is None:
            hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        else:
            def pack(t):
                packed = offload.pack(t)
                if offload.moved(packed):  # its host copy (the device tensor may be freed, its address reused)
                    self._count(packed[1], self._off)
                else:
                    self._count(t, self._seen)
                return packed

            hooks = torch.autograd.graph.saved_tensors_hooks(pack, offload.unpack)
        with hooks:
            yield
        self.peak_bytes = max(self.peak_bytes, sum(self._seen.values()))
        self.peak_offloaded_bytes = max(self.peak_offloaded_bytes, sum(self._off.values()))


def flops_per_token(hf_config, num_params: int, seq_len: int) -> float:
    """PaLM appendix B training FLOPs per token, 6N + 12·L·H·Q·T (shardtune/plan/compute.py)."""
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    n = matmul_params(num_params, hf_config.vocab_size, hf_config.hidden_size,
                      bool(getattr(hf_config, "tie_word_embeddings", False)))
    return model_flops_per_token(n, hf_config.num_hidden_layers, hf_config.num_attention_heads,
                                 head_dim, seq_len)


def gpu_peak_flops(gpu_name: str) -> float | None:
    """Dense bf16 peak FLOP/s of a catalogue GPU (catalog/gpus.py), None for an unknown name."""
    try:
        return float(resolve_gpu(gpu_name).bf16_flops)
    except Exception:  # an unknown GPU name costs the MFU column, not the run
        return None


class MetricsWriter:
    """Appends one JSON object per line to <run_dir>/metrics.jsonl (rank 0 only calls it)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = self.path.open("a")

    def write(self, record: dict) -> None:
        self._f.write(json.dumps(record) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


def _fmt_mib(n: int | None) -> str:
    return "—" if n is None else f"{n / 2**20:,.2f} MiB"


COLLAPSE_MARGIN = 1.0  # a reward margin (nats of β-scaled log-ratio) this wide should sort held-out pairs


def dpo_lines(records: list[dict]) -> list[str]:
    """DPO/SimPO's summary: the reward margin first → last, the training reward accuracy, the
    held-out preference accuracy (val_pref_acc: the policy's own log-probs prefer the chosen side),
    and a warning when the margin grew past COLLAPSE_MARGIN while the held-out accuracy is at or below
    chance: the policy pulls the sides apart without learning which is preferred (e.g. every answer
    the same). [] for SFT."""
    steps = [r for r in records if r.get("reward_margin") is not None]
    if not steps:
        return []
    first, last = steps[0], steps[-1]
    line = (f"dpo: reward margin {first['reward_margin']:.3f} (step {first['step']}) → {last['reward_margin']:.3f} "
            f"(step {last['step']}), reward accuracy {last['reward_acc']:.1%}")
    held = [r for r in records if r.get("val_pref_acc") is not None]
    if not held:
        return [line + "; no held-out pairs (data.val_path) for a preference accuracy"]
    acc = held[-1]["val_pref_acc"]
    lines = [line + f"; held-out preference accuracy {acc:.1%} (step {held[-1]['step']})"]
    grew = last["reward_margin"] - first["reward_margin"]
    if grew > COLLAPSE_MARGIN and acc <= 0.5:
        lines.append(f"shardtune: warning: the reward margin grew by {grew:.2f} "
                     f"but held-out pairs are preferred at chance or worse ({acc:.1%}): the policy may have "
                     "collapsed (identical answers); lower optim.lr or raise train.dpo_beta, and read samples.jsonl")
    return lines


def print_summary(run_dir: Path, per_rank: list[dict], planned: dict | None, strategy: str) -> None:
    """One screen at the end: loss first → last, throughput, and measured vs planned memory per
    component (measured: the largest rank; MiB = 2^20 bytes)."""
    records = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if line]
    console = Console()
    records = [r for r in records if r.get("loss") is not None]  # skipped (non-finite) steps carry none
    if records:
        first, last = records[0], records[-1]
        tps = sum(r["tokens_per_s"] for r in records) / len(records)
        console.print(f"loss {first['loss']:.4f} (step {first['step']}) → {last['loss']:.4f} "
                      f"(step {last['step']}), {tps:,.0f} tokens/s mean, "
                      f"{last['tflops']:.4f} TFLOP/s per rank")
    for line in dpo_lines(records):
        console.print(line, markup=False, highlight=False)
    for line in eval_lines(run_dir):  # val_loss and the last sample answers (eval_lines.py)
        console.print(line, markup=False, highlight=False)
    plan_mem = {}
    if planned:
        plan_mem = next((s["memory"] for s in planned["strategies"] if s["name"] == strategy), {})
    table = Table(title=f"memory per rank ({strategy}; planned: shardtune.plan, plan.json)")
    for col in ("component", "measured (max rank)", "planned", "measured / planned"):
        table.add_column(col, justify="right" if col != "component" else "left")
    rows = (("params", "params_bytes", "params"), ("grads", "grads_bytes", "grads"),
            ("optimizer", "optimizer_bytes", "optimizer"),
            ("activations", "activations_bytes", "activations"), ("peak", "peak_bytes", "total"))
    measured, how = measured_memory(per_rank)
    for label, _key, pkey in rows:
        got = measured.get(pkey, 0)
        want = plan_mem.get(pkey)
        ratio = f"{got / want:.3f}" if want else "—"
        table.add_row(label, _fmt_mib(got), _fmt_mib(want), ratio)
    console.print(table)
    console.print(f"measured peak (largest rank): {_fmt_mib(measured.get('total', 0))} ({how})")
    console.print(f"run folder: {run_dir} (metrics.jsonl, memory.json, config.yaml, plan.json)")


def track_this_step(device: torch.device, step: int, total_steps: int, lora_rank: int, compile: bool = False) -> bool:
    """CPU has no allocator statistics: the third step (optimizer states exist, DDP has rebuilt
    its buckets) runs under the tracker for `report`. torch's MemTracker puts a grad hook on every
    parameter and fails on frozen ones (LoRA's base weights): LoRA runs are not tracked. Nor are
    compiled ones (train.compile): dynamo refuses a forward under the tracker's dispatch mode
    ("non-infra torch dispatch mode present"); their memory.json has the storage counts."""
    return device.type == "cpu" and step == min(3, total_steps) and not lora_rank and not compile


def optimizer_step_untracked(optimizer) -> bool:
    """torchao's optimizers (adamw-8bit under FSDP) run a torch.compile'd step, which refuses the
    tracker's dispatch mode: their step runs outside it (`tracked_step`)."""
    return type(getattr(optimizer, "optim", optimizer)).__module__.startswith("torchao")


@contextmanager
def _step_outside_tracker(optimizer):
    """optimizer.step with every dispatch mode (the tracker) off: the tracker's step hooks still
    fire, so the states stay tagged as the optimizer's, but the step's temporaries go unseen."""
    step = optimizer.step

    def outside(*args, **kwargs):
        with _disable_current_modes():
            return step(*args, **kwargs)

    optimizer.step = outside
    try:
        yield
    finally:
        del optimizer.step  # the class's own again


def tracked_step(model: nn.Module, optimizer, step_fn, strategy: str):
    """(step_fn()'s result, the tracker's bytes by category) for one step (train/core/memtrack.py).
    An optimizer whose step refuses the tracker (`optimizer_step_untracked`: torchao's compiled
    8-bit AdamW) steps outside it: its states are the tracker's "optimizer" bytes at rest (tagged
    on entry), its step's temporaries are not measured (no `optimizer_step_temp`)."""
    outside = optimizer_step_untracked(optimizer)
    with _step_outside_tracker(optimizer) if outside else nullcontext():
        result, tracked = tracked_call(model, optimizer, step_fn, STRATEGY[strategy].fsdp)
    tracked = {k: v for k, v in tracked.items() if k != "breakdown_at_peak"}
    if outside:
        del tracked["optimizer_step_temp"]
    return result, tracked


def step_peak_bytes(device: torch.device, model: nn.Module, optimizer, activations) -> tuple[int, dict]:
    """(peak bytes on this rank since the previous call, per-category bytes); CUDA resets its peak
    counter, so the loop calls this on logged steps only."""
    states = model_state_bytes(model, optimizer)
    states["activations_bytes"] = activations.peak_bytes if activations else 0
    if activations and activations.peak_offloaded_bytes:  # parallel.activation_offload, on an accelerator
        states["activations_offloaded_bytes"] = activations.peak_offloaded_bytes
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
        # what the caching allocator held: reserved - allocated is its fragmentation and cache
        states["peak_reserved_bytes"] = torch.cuda.max_memory_reserved(device)
        torch.cuda.reset_peak_memory_stats(device)
    else:
        peak = sum(states.values())
    states["peak_bytes"] = peak
    return peak, states


def write_memory_json(run_dir: Path, device: torch.device, per_rank: list[dict], effective: dict | None = None) -> None:
    """memory.json: every rank's bytes of its last step (and the tracked step's, on CPU), and what
    the run actually ran (`effective`, rank 0's; each rank's own under per_rank[i]["effective"])."""
    method = "cuda max_memory_allocated" if device.type == "cuda" else "exact storage count (train/core/metrics.py)"
    out = {"method": method, "effective": effective, "per_rank": per_rank}
    (Path(run_dir) / "memory.json").write_text(json.dumps(out, indent=1))
