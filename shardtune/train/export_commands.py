"""`shardtune export CHECKPOINT_DIR OUT_DIR [--max-shard-size 5GB] [--dtype bf16]`: a shardtune
checkpoint → Hugging Face folder, streamed (train/durable/export.py). Imports no torch at module level."""
from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    @app.command("export")
    def export(
        checkpoint_dir: str = typer.Argument(..., help="A checkpoint folder: runs/<name>/checkpoints/step_<N>"),
        out_dir: str = typer.Argument(..., help="New (or empty) folder for the Hugging Face model"),
        max_shard_size: str = typer.Option("5GB", "--max-shard-size", help="Largest safetensors file, e.g. 5GB, "
                                           "500MB, 2GiB: also the export's memory bound.", metavar="SIZE"),
        dtype: str | None = typer.Option(None, "--dtype", metavar="[fp32|bf16|fp16]",
                                          help="Weights' dtype in the export (default: as saved)."),
        adapter_only: bool = typer.Option(False, "--adapter-only", help="LoRA runs: write the PEFT adapter folder "
                                          "(adapter_config.json + adapter_model.safetensors) instead of the merged "
                                          "model."),
    ) -> int:
        """Write a Hugging Face folder (config, safetensors shards, tokenizer) from a checkpoint."""
        from shardtune.train.durable.export import check_dtype, export_checkpoint, parse_size_bytes
        from shardtune.train.durable.export_checks import check_out_dir_given

        check_dtype(dtype)
        check_out_dir_given(out_dir)

        out = export_checkpoint(checkpoint_dir, out_dir, parse_size_bytes(max_shard_size), dtype,
                                adapter_only=adapter_only)
        loader = "PeftModel.from_pretrained(base_model, " if adapter_only else "AutoModelForCausalLM.from_pretrained("
        print(f"exported {checkpoint_dir} -> {out} ({loader}{str(out)!r}))")
        return 0
