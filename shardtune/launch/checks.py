"""Launch's checks on its own options, before anything is written: --interconnect / --link
resolved against the catalogue (plan's vocabulary), --elastic MIN:MAX, and the recipe's layout on
every node count (`check_layout`: the trainer's own Layout). Imports no torch."""
from __future__ import annotations

from shardtune.catalog.interconnects import ALIASES, INTERCONNECTS, get_interconnect
from shardtune.catalog.models import resolve_model_config
from shardtune.errors import UserError
from shardtune.launch.spec import normalize_interconnect
from shardtune.layout import Layout
from shardtune.rules.pipeline import check_pipeline


def interconnect_help() -> str:
    """The help of --interconnect, from the catalogue (plan's vocabulary), so the two cannot drift."""
    links = [n for n, v in INTERCONNECTS.items() if v.scope == "inter"]
    aliases = [a for a, n in ALIASES.items() if INTERCONNECTS[n].scope == "inter"]
    return (f"Link between nodes, as in `shardtune plan`: {', '.join(links)} (or {', '.join(aliases)}); "
            "or a transport: eth (= eth-10g), nvlink (one node). Sets NCCL/gloo's environment and the estimate.")


# transport of a catalogue link, by its name's prefix (what NCCL/gloo are told: launch/network.py)
_TRANSPORT = (("ib-", "ib"), ("roce-", "roce"), ("efa", "efa"), ("eth-", "eth"), ("nvlink-", "nvlink"),
              ("pcie-", "nvlink"))


def resolve_interconnect(name: str, link: str | None) -> tuple[str, str | None]:
    """--interconnect NAME (and --link) → (transport for the environment, catalogue link for the
    estimate). NAME is plan's vocabulary (a catalogue link or alias: ib-ndr-400, ib, roce, 10gbe,
    nvlink, ...) or a transport (eth, infiniband, tcp, ...: launch/spec.py); --link, when given,
    is the estimate's link."""
    key = ALIASES.get(str(name).strip().lower(), str(name).strip().lower())
    if key in INTERCONNECTS:
        transport = next(t for prefix, t in _TRANSPORT if key.startswith(prefix))
        named = key if INTERCONNECTS[key].scope == "inter" else None
    else:
        try:
            transport, named = normalize_interconnect(name), None
        except UserError:
            get_interconnect(name)  # the catalogue's error: names every link
            raise
    if link:
        get_interconnect(link, scope="inter")  # a mistyped --link is an error, not a missing estimate
    return transport, link or named


def parse_elastic(value: str | None) -> tuple[int, int] | None:
    if not value:
        return None
    lo, sep, hi = value.partition(":")
    if not sep or not lo.isdigit() or not hi.isdigit():
        raise UserError(f"--elastic {value!r} is not MIN:MAX nodes (e.g. 2:4)")
    return int(lo), int(hi)


def check_layout(cfg, nodes: int, gpus_per_node: int) -> Layout:
    """The trainer's layout on `nodes` nodes (`Layout.of_config`: the degrees and the placement rules,
    a tp group inside one node, pipeline stages of whole nodes or a node's share), the pipeline
    schedule's micro-batches, and what tp and cp split of the model (heads, vocabulary, sequence)
    as the trainer's preflight checks it (`Layout.check_model`)."""
    layout = Layout.of_config(cfg.parallel, nodes * gpus_per_node, gpus_per_node)
    check_pipeline(cfg)  # the schedule's micro-batches were checked with the recipe; what the trainer runs
    try:
        hf = resolve_model_config(cfg.model.plan_name())
    except UserError:  # a folder not on this machine and no model.architecture: the nodes' preflight checks
        return layout
    layout.check_model(hf, cfg.train.seq_len, trains=True, compile=cfg.train.compile)
    return layout
