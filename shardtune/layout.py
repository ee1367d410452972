"""How a run's ranks are laid out: every parallel degree in one record, validated once.

`Layout` (alias `ParallelDims`, after torchtitan's `distributed/parallel_dims.py`) holds the degrees
pp × dp_replicate × dp_shard × cp × tp = world (ep borrows data-parallel ranks: it divides
dp_shard × cp), the derived quantities every caller asks for (data-parallel degree, global-batch
and sequence divisors, the gradient divide factor, FSDP's shard degree) and the one placement rule
(`check_placement`: a tp group stays inside one node unless allowed). Planner, config, launcher,
preflight and ranks all build it with `Layout.build` / `Layout.of_config`, so they answer alike
(tests/unit/test_layout_agreement.py). Imports no torch.
"""
from __future__ import annotations

from dataclasses import dataclass

from shardtune.errors import UserError
from shardtune.rules.combination import check_cp_strategy
from shardtune.rules.cp import check_cp
from shardtune.rules.ep import check_ep_model, check_trainable_moe
from shardtune.rules.tp import check_tp_model
from shardtune.strategies import FSDP_STRATEGIES, Strategy, strategy

# The mesh's named dimensions, outermost first (torchtitan's parallel_dims order), size-1 dimensions
# kept: one mesh shape for every strategy and degree. Consecutive ranks vary the innermost (tp)
# fastest, so a tp group is tp consecutive ranks: one node's when tp divides the processes per node.
MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
# degrees whose groups may span nodes without being asked (tp: only with tp_across_nodes); an ep group
# is ep consecutive data ranks, inside a node while ep <= its ranks, else across (plan prices it on the NICs)
SPANS_NODES = ("pp", "dp_replicate", "dp_shard", "cp", "ep")


def _positive(value, what: str, key: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UserError(f"{what} {value!r} is not a positive integer ({key})")


def check_placement(tp: int, per_node: int, across_nodes: bool = False) -> None:
    """The one placement rule: torchrun numbers ranks node by node and a tp group is tp consecutive
    ranks (the innermost mesh dim), so it lies inside one node exactly when tp divides the processes
    per node; a tp larger than a node only with parallel.tp_across_nodes, and then whole nodes.
    plan (plan/validate.py), launch and the trainer's preflight all call this, through `Layout.build`."""
    if tp <= 1:
        return
    if tp <= per_node and per_node % tp:
        raise UserError(f"parallel.tp {tp} does not divide the {per_node} GPUs of a node (processes per node: "
                        "--gpus-per-node): a tensor-parallel group (consecutive ranks, numbered node by node) would "
                        f"straddle two nodes; choose a tp that divides {per_node}")
    if tp > per_node and not across_nodes:
        raise UserError(f"parallel.tp {tp} exceeds the {per_node} GPUs of a node (processes per node: "
                        "--gpus-per-node): TP's per-layer collectives want the intra-node links; lower "
                        "parallel.tp / --tp, or set parallel.tp_across_nodes=true (--tp-across-nodes) to insist")
    if tp > per_node and tp % per_node:
        raise UserError(f"parallel.tp {tp} across nodes is not a multiple of the {per_node} GPUs of a node "
                        "(--gpus-per-node): a tensor-parallel group would hold part of a node; give whole "
                        "nodes per group")


def check_pp_placement(pp: int, world_size: int, per_node: int) -> None:
    """Pipeline stages across nodes, tp inside: pp is the outermost mesh dim, so stage s is ranks
    [s·w/pp, (s+1)·w/pp); a stage is whole nodes or a whole share of one, never part of two (its
    FSDP and TP groups would straddle a node boundary while the P2P stays inside one)."""
    stage = world_size // pp
    if pp > 1 and stage % per_node and per_node % stage:
        raise UserError(f"pp {pp}: a stage of {stage} ranks would hold part of a node of {per_node} processes and "
                        "part of another; give a pp whose stages are whole nodes or divide one (parallel.pp / --pp)")


@dataclass(frozen=True)
class Layout:
    """A strategy on `world_size` ranks, `gpus_per_node` per node; the mesh degrees multiply to
    the world: pp × dp_replicate × dp_shard × cp × tp. dp_replicate × dp_shard is the data-parallel
    degree: FSDP strategies shard over dp_shard (hsdp: its shard group; zero2/zero3: every data
    rank) and replicate over dp_replicate; ddp/zero1 replicate over all of it (dp_shard 1).
    hsdp's shard group defaults to one node's data ranks, so reduce-scatter and all-gather stay on
    the fast intra-node links (FSDP2 HSDP)."""

    strategy: Strategy
    world_size: int
    gpus_per_node: int
    dp_replicate: int
    dp_shard: int
    cp: int = 1  # context-parallel degree: ranks one sequence is split over (rules/cp.py)
    tp: int = 1  # tensor-parallel degree: ranks one layer's matmuls are split over, innermost
    sequence_parallel: bool = False  # with tp > 1: norms and residuals on sequence shards
    tp_across_nodes: bool = False  # a tp group may span whole nodes (parallel.tp_across_nodes)
    ep: int = 1  # expert-parallel degree: borrows data-parallel ranks (divides dp_shard × cp)
    pp: int = 1  # pipeline-parallel degree: outermost

    @property
    def num_nodes(self) -> int:
        return max(1, self.world_size // self.gpus_per_node)

    @property
    def dp(self) -> int:
        """The data-parallel degree: ranks that read different rows (world / (pp × cp × tp))."""
        return self.dp_replicate * self.dp_shard

    @property
    def batch_divisor(self) -> int:
        """What the global batch is a multiple of: micro_batch × grad_accum × dp rows per step."""
        return self.dp

    @property
    def seq_divisor(self) -> int:
        """What train.seq_len must be a multiple of: cp, × tp with sequence parallelism."""
        return self.cp * (self.tp if self.sequence_parallel else 1)

    @property
    def grad_divide_factor(self) -> int:
        """Ranks a gradient is averaged over (FSDP reduces over dp × cp; tp ranks hold parts)."""
        return self.dp * self.cp

    @property
    def shard_degree(self) -> int:
        """Ranks one sharded state is split over: ddp 1, zero1 (its optimizer) and zero2/3 every
        data rank, hsdp its shard group (without cp: FSDP's shard degree is `fsdp_shard_degree`)."""
        return self.dp if self.strategy.partitions_optimizer else self.dp_shard

    @property
    def replicate_degree(self) -> int:
        """Copies of each parameter: ddp/zero1 every data rank, zero2/zero3 1, hsdp dp / shard."""
        return self.dp_replicate

    @property
    def expert_fsdp_degree(self) -> int:
        """Ranks one expert's states are FSDP-sharded over: dp_shard × cp / ep (torchtitan's dp2ep)."""
        return self.dp_shard * self.cp // self.ep

    @property
    def fsdp_shard_degree(self) -> int:
        """Ranks FSDP splits one state over: dp_shard × cp (FSDP shards over both, as torchtitan)."""
        return self.dp_shard * self.cp

    def degree(self, dim: str) -> int:
        """The size of mesh dimension `dim` (MESH_DIMS)."""
        return getattr(self, dim)

    def may_span_nodes(self, dim: str) -> bool:
        """Whether `dim`'s groups may cross a node boundary: the data, context and pipeline dims
        and expert ones always; tp only with its tp_across_nodes permission."""
        return dim in SPANS_NODES or (dim == "tp" and self.tp_across_nodes)

    @property
    def dims(self) -> dict[str, int]:
        """Every mesh dimension by name, outermost first, size-1 dimensions kept."""
        return {d: self.degree(d) for d in MESH_DIMS}

    @property
    def mesh_axes(self) -> tuple[str, ...]:
        """The device mesh's dimension names, always MESH_DIMS (size-1 dimensions kept);
        parallel/mesh.py looks its sub-meshes up by these names."""
        return MESH_DIMS

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        """The device mesh's shape along `mesh_axes`: (pp, dp_replicate, dp_shard, cp, tp)."""
        return tuple(self.degree(d) for d in MESH_DIMS)

    def check_model(self, hf: dict, seq_len: int | None = None, trains: bool = False, compile: bool = False) -> None:
        """What tp and cp split of the model (`hf`: its config.json values) divides evenly: heads, KV
        heads, MLP width, vocabulary (rules.tp.check_tp_model), cp's query heads per tp rank and the
        sequence (rules.cp.check_cp). launch and the trainer's preflight call it after `build`, with
        `trains`: also a mixture of experts whose router the trainer reproduces (rules.ep)."""
        check_tp_model(self.tp, hf, seq_len, self.sequence_parallel)
        check_cp(self.cp, tp=self.tp, seq_len=seq_len, sequence_parallel=self.sequence_parallel, hf=hf, compile=compile)
        check_ep_model(self.ep, hf, self.tp, seq_len, self.sequence_parallel, cp=self.cp)
        if trains:
            check_trainable_moe(hf)

    @classmethod
    def of_config(cls, par, world_size: int, gpus_per_node: int | None = None, strategy_name: str | None = None,
                  hsdp_shard_size: int | None = None) -> Layout:
        """`build` from a recipe's `parallel:` section (config.ParallelConfig; read by name, so this
        module imports no config): the one call of the trainer, its preflight and the launcher."""
        return cls.build(strategy_name or par.strategy, world_size, gpus_per_node,
                         hsdp_shard_size or par.hsdp_shard_size, tp=par.tp, sequence_parallel=par.sequence_parallel,
                         tp_across_nodes=par.tp_across_nodes, cp=par.cp, ep=par.ep, pp=par.pp)

    @classmethod
    def build(cls, strategy_name: str | Strategy, world_size: int, gpus_per_node: int | None = None,
              hsdp_shard_size: int | None = None, tp: int = 1, sequence_parallel: bool = True,
              tp_across_nodes: bool = False, cp: int = 1, ep: int = 1, pp: int = 1) -> Layout:
        """Validated layout; a bad world, a tp that does not divide it or leaves a node
        (`check_placement`), a cp that does not divide world / tp (`check_cp`), an hsdp shard size
        that does not divide world / (tp × cp), a pp or ep that does not fit is a UserError."""
        s = strategy_name if isinstance(strategy_name, Strategy) else strategy(strategy_name)
        if not isinstance(world_size, int) or world_size < 1:
            raise UserError(f"world size {world_size!r} is not positive; start at least one process")
        per_node = world_size if gpus_per_node is None else gpus_per_node
        if not isinstance(per_node, int) or per_node < 1:
            raise UserError(f"processes per node {per_node!r} is not positive")
        _positive(tp, "tensor-parallel degree", "parallel.tp / --tp")
        _positive(pp, "pipeline-parallel degree", "pp")
        _positive(ep, "expert-parallel degree", "ep")
        if world_size % tp:
            raise UserError(f"tp {tp} does not divide the world size {world_size} (world = dp x tp); "
                            f"start a multiple of {tp} processes or lower parallel.tp / --tp")
        if tp > 1 and not s.fsdp:
            raise UserError(f"tp {tp} composes with FSDP2 strategies ({', '.join(FSDP_STRATEGIES)}), not "
                            f"{s.name!r} (DDP/ZeroRedundancyOptimizer take no DTensor params): parallel.strategy "
                            "/ --strategy")
        check_placement(tp, per_node, tp_across_nodes)
        check_cp_strategy(s, cp)
        check_cp(cp, world_size=world_size, tp=tp)
        if (world_size // (tp * cp)) % pp:
            raise UserError(f"pp {pp} does not divide world / (tp x cp) = {world_size // (tp * cp)} "
                            "(world = pp x dp x cp x tp)")
        check_pp_placement(pp, world_size, per_node)
        dp = world_size // (pp * tp * cp)
        sp = bool(sequence_parallel) and tp > 1
        if s.hybrid:
            shard = hsdp_shard_size if hsdp_shard_size is not None else min(max(1, per_node // (tp * cp)), dp)
            if shard < 1 or shard > dp or dp % shard:
                what = (f"the world size {world_size}" if tp * cp == 1
                        else f"the data-parallel degree {dp} (world / (tp x cp))")
                raise UserError(f"hsdp shard size {shard} does not divide {what}; "
                                f"set parallel.hsdp_shard_size (plan: --hsdp-shard-size) to a divisor of {dp}")
        else:
            shard = dp if s.shards_params else 1
        if ep > 1 and (ep % cp or (shard * cp) % ep):
            raise UserError(f"parallel.ep {ep} must divide dp_shard x cp = {shard * cp} ({s.name} on {world_size} "
                            f"ranks) and be a multiple of cp {cp}: expert parallelism borrows the data-parallel "
                            "ranks (parallel.ep / --ep)")
        return cls(s, world_size, per_node, dp // shard, shard, cp, tp, sp, bool(tp_across_nodes), ep, pp)


ParallelDims = Layout  # torchtitan's name for the same record
