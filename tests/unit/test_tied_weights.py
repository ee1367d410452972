"""A tied-embedding model stays tied after the ddp/zero1 build (to_empty used to untie it, so ddp
trained lm_head and embed_tokens as two copies). Runs in a subprocess: one gloo rank."""
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import os, torch, torch.distributed as dist
    from shardtune.processes import free_port
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    from transformers import AutoModelForCausalLM, LlamaConfig
    from shardtune.config import ParallelConfig
    from shardtune.parallel.mesh import build_mesh
    from shardtune.parallel.build import build_parallel_model
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    for strategy in ("ddp", "zero1", "zero3"):
        with torch.device("meta"):
            meta = AutoModelForCausalLM.from_config(cfg)
        pc = ParallelConfig(strategy=strategy, precision="fp32")
        model = build_parallel_model(meta, pc, build_mesh(pc, 1, 1, "cpu"), torch.device("cpu"), None)
        inner = getattr(model, "module", model)
        print(strategy, inner.lm_head.weight is inner.model.embed_tokens.weight)
    dist.destroy_process_group()
""")


def test_tied_embeddings_stay_one_parameter_under_every_build():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    words = [line.split() for line in out.stdout.splitlines()]
    lines = dict(w for w in words if len(w) == 2 and w[0] in ("ddp", "zero1", "zero3"))
    assert lines == {"ddp": "True", "zero1": "True", "zero3": "True"}, out.stdout
