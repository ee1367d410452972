#!/usr/bin/env bash
# Activation offload on one GPU (docs/long-context.md): the same 3 steps with and without
# parallel.activation_offload, AC full, on the 4-layer SmolLM2 cut at seq_len 2048, bf16-mixed.
# Prints each run's losses, memory.json's device activation bytes, the bytes moved to host memory,
# and CUDA's peak. Expect: equal losses; activations_bytes near 0 with offload (the head's and loss's
# saved tensors are offloaded too); activations_offloaded_bytes about the run without offload's
# activations_bytes; a lower peak. Usage: bash bench/activation_offload_gpu.sh OUTDIR
# shardtune runs from this tree (PYTHONPATH); PYTHON picks the interpreter (default: the repo's
# .venv if there is one, else python3; on the GPU box the one bench/gpu.sh set up).
set -euo pipefail
out=${1:?usage: bash bench/activation_offload_gpu.sh OUTDIR}
mkdir -p "$out"
out="$(cd "$out" && pwd)"
REPO="$(cd "$(dirname "$0")/.." && pwd)"
cd "$REPO"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python3}"
[[ -z "${PYTHON:-}" && -x "$REPO/.venv/bin/python" ]] && PY="$REPO/.venv/bin/python"
common=(recipes/smollm2-dates.yaml --nproc 1 --max-steps 3 model.name=.cache/smollm2/SmolLM2-135M-Instruct-4L
        train.seq_len=2048 train.micro_batch=4 data.packing=true parallel.precision=bf16-mixed
        parallel.activation_checkpointing=full train.sample_prompts=[] train.eval_every=0
        checkpoint.export_hf=false checkpoint.save_final=false)
for mode in false true; do
  "$PY" -m shardtune.cli train "${common[@]}" parallel.activation_offload=$mode --output-dir "$out/offload-$mode"
done
"$PY" - "$out" <<'PY'
import json, sys
from pathlib import Path
for mode in ("false", "true"):
    run = Path(sys.argv[1]) / f"offload-{mode}"
    losses = [json.loads(l)["loss"] for l in (run / "metrics.jsonl").read_text().splitlines() if '"loss"' in l]
    r = json.loads((run / "memory.json").read_text())["per_rank"][0]
    print(f"activation_offload {mode}: losses {[round(x, 5) for x in losses]}, activations "
          f"{r['activations_bytes'] / 2**20:.1f} MiB, offloaded {r.get('activations_offloaded_bytes', 0) / 2**20:.1f} MiB, "
          f"peak {r['peak_bytes'] / 2**20:.1f} MiB")
PY
