"""Planner figures quoted in docs/ are re-derived from the command they quote (issue 18 item 4):
a doc that goes stale fails here."""
from __future__ import annotations

import re
from pathlib import Path

from shardtune.catalog.models import resolve_model_config
from shardtune.plan import plan
from shardtune.plan.params import architecture_from_config, model_shapes

DOCS = Path(__file__).resolve().parents[2] / "docs"
GIB = 2**30


def _section(text: str, heading: str) -> str:
    start = text.index(heading)
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else None]


def test_planner_md_70b_table_and_prose_match_the_cli():
    sec = _section((DOCS / "planner.md").read_text(), "## Llama-3-70B on 8 × H100 80 GB, corrected")
    assert "`shardtune plan llama-3-70b --gpus 8 --gpu h100-80gb`" in sec
    r = plan("llama-3-70b", 8, gpu="h100-80gb")
    rows = {m.group(1): m.group(2).split() for m in re.finditer(r"^  (ddp|zero1|zero2|zero3|hsdp) +(.*)$", sec, re.M)}
    assert set(rows) == {s.name for s in r.strategies}
    for s in r.strategies:
        mem = s.memory
        want = [str(s.shard_degree)] + [f"{v / GIB:,.1f}" for v in (
            mem.params, mem.grads, mem.optimizer, mem.activations, mem.buffers, mem.optimizer_step_temp,
            mem.total)] + [f"{mem.total / 1e9:,.1f}", f"{s.headroom_bytes / GIB:,.1f}", "yes" if s.fits else "NO"]
        assert rows[s.name] == want, s.name
    z3 = r.strategy("zero3").memory.total
    assert f"peaks at\n{z3 / 1e9:,.1f} GB ({z3 / GIB:,.1f} GiB) per GPU" in sec


def test_scaling_md_psi_is_the_catalogue_count():
    text = (DOCS / "scaling.md").read_text()
    psi = sum(p.numel for p in model_shapes(architecture_from_config(resolve_model_config("llama-3-70b")), 0))
    m = re.search(r"Ψ = ([\d.]+) × 10\^9 parameters", text)
    assert m and float(m.group(1)) == round(psi / 1e9, 2)
    assert f"8Ψ = {8 * psi / 1e9:.0f} GB" in text
    assert f"(15/16) × {8 * psi / 1e9:.0f} = {15 / 16 * 8 * psi / 1e9:.0f} GB" in text


def test_planner_md_70b_prose_fits_match_the_quoted_flags():
    # each figure of the prose below the 70B table, re-planned with the flags it quotes (zero3)
    sec = " ".join(_section((DOCS / "planner.md").read_text(), "## Llama-3-70B on 8 × H100 80 GB, corrected").split())

    def zero3(**kw):
        return plan("llama-3-70b", 8, gpu="h100-80gb", strategies=["zero3"], **kw).strategy("zero3")

    off = zero3(ac="full", offload="all")
    assert off.fits and (f"`--ac full --offload all`, which fits at {off.memory.total / GIB:.1f} GiB per GPU but needs "
                         f"{off.cpu_offload_bytes_per_node / GIB:,.0f} GiB of CPU RAM") in sec
    lora = zero3(lora_rank=16, ac="full")
    assert lora.fits and f"(`--lora-rank 16 --ac full`) fits zero3 at {lora.memory.total / GIB:.1f} GiB" in sec
    bf16 = zero3(precision="bf16", ac="full", seq_len=4096, optimizer_impl="bf16-stochastic")
    assert bf16.fits and f"--optimizer-impl bf16-stochastic`) fits at {bf16.memory.total / GIB:.1f} GiB" in sec


def test_quoted_plan_comments_in_docs_are_what_the_cli_prints(capsys):
    # `shardtune plan ARGS   # fits: S, X GiB/GPU` in any doc: S fits and peaks at X GiB
    import json
    import shlex

    from shardtune.cli import main

    quoted = [(doc.name, m) for doc in sorted(DOCS.glob("*.md")) for m in re.finditer(
        r"^shardtune plan (.+?) +# fits: (\w+), ([\d.]+) GiB/GPU$", doc.read_text(), re.M)]
    assert quoted  # docs/lora.md's first line at least
    for name, m in quoted:
        assert main(["plan", *shlex.split(m.group(1)), "--json"]) == 0
        s = next(x for x in json.loads(capsys.readouterr().out)["strategies"] if x["name"] == m.group(2))
        assert s["fits"] and f"{s['memory']['total'] / GIB:.1f}" == m.group(3), (name, m.group(0))


def test_scaling_md_tables_and_no_offload_peaks_are_what_plan_prints(capsys, monkeypatch):
    import shlex

    from shardtune.cli import main

    text = (DOCS / "scaling.md").read_text()
    runs = re.findall(r"^shardtune plan (llama-3-70b .*?) \\\n +(.*?)$", text, re.M)
    assert len(runs) == 2
    tables = re.findall(r"^  strategy +step s .*\n((?:  (?:zero3|hsdp) .*\n)+)", text, re.M)
    assert len(tables) == 2  # 10 GbE, then InfiniBand, in the order of the runs
    monkeypatch.setenv("COLUMNS", "140")
    for (head, tail), table in zip(runs, tables, strict=True):
        assert main(["plan", *shlex.split(f"{head} {tail}")]) == 0
        out = capsys.readouterr().out
        for row in table.splitlines():
            assert any(ln.split() == row.split() for ln in out.splitlines()), row
    # the prose: without --offload all neither fits, at these peaks
    r = plan("llama-3-70b", 16, nodes=2, interconnect="eth-10g", strategies=["zero3", "hsdp"], seq_len=4096,
             ac="full", grad_accum=8)
    z3, hs = (r.strategy(s).memory.total / GIB for s in ("zero3", "hsdp"))
    assert not any(s.fits for s in r.strategies)
    assert f"zero3 needs {z3:.1f} GiB of the 74.7 GiB usable per GPU, hsdp {hs:.1f} GiB" in " ".join(text.split())


def test_scaling_md_fit_and_lora_paragraphs_are_what_plan_prints():
    from shardtune.plan.fit import search

    text = " ".join((DOCS / "scaling.md").read_text().split())
    cluster = dict(gpus=16, nodes=2, interconnect="eth-10g", seq_len=4096, grad_accum=8)
    kept = frozenset({"seq_len", "grad_accum"})  # what the CLI keeps of the paragraph's command line
    b = search("llama-3-70b", **cluster, fit_batch=True, keep=kept).best  # the paragraph's --fit-batch
    t = b.timing
    tokens_per_step_gpu = b.micro_batch * 8
    assert (f"picks {b.strategy}, shard {b.hsdp_shard_size}, micro-batch {b.micro_batch}, pure bf16 (2-byte "
            f"gradients), offload {b.offload} → {t['mfu'] * 100:.1f} % MFU, {t['tokens_per_s']:.0f} tokens/s per GPU "
            f"(step {t['step_time_s']:.0f} s: {t['compute_time_s']:.0f} s of compute, {t['exposed_comm_s']:.0f} s of "
            f"exposed communication") in text and b.precision == "bf16"
    assert f"and {t['optimizer_time_s']:.0f} s of CPU optimizer; the global batch is " \
           f"{16 * tokens_per_step_gpu * 4096 / 1e6:.0f} M tokens" in text
    assert f"paid once per {tokens_per_step_gpu} × 4096 tokens per GPU" in text
    pipe = search("llama-3-70b", **cluster, keep=kept)  # the pipeline bullet's --fit
    g, t = pipe.pipeline_gain, pipe.best.timing
    assert pipe.best.pp == 2 and g["pipeline"] == pipe.best.label()
    assert (f"picks zero3 × pp 2, AC full, micro-batch {pipe.best.micro_batch} × {pipe.best.grad_accum} micro-batches, "
            f"pure bf16 → {g['pipeline_tokens_per_s']:.0f} tokens/s per GPU, {g['speedup']:.2f}× the fastest layout "
            f"without a pipeline at that batch (hsdp shard 8 with offload all: {g['without_tokens_per_s']:.0f} "
            f"tokens/s per GPU); its step is {t['step_time_s']:.1f} s: {t['compute_time_s']:.1f} s of compute, "
            f"{t['bubble_time_s']:.1f} s of bubble, {t['p2p_time_s']:.1f} s of P2P") in text
    assert g["without"].startswith("hsdp shard 8, AC full, offload all") and pipe.best.strategy == "zero3"
    lora = plan("llama-3-70b", strategies=["zero3", "hsdp"], ac="full", lora_rank=16, tokens=1e9,
                **cluster).strategy("hsdp")
    assert lora.fits and (f"hsdp predicts {lora.timing['mfu'] * 100:.1f} % MFU ({lora.timing['tokens_per_s']:.0f} "
                          f"tokens/s per GPU, {lora.timing['train_time_s'] / 86400:.1f} days") in text
