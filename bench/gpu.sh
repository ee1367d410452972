#!/usr/bin/env bash
# One prepared GPU check: zero3 at world size 1 (nccl) through the real trainer, Llama-3-8B widths
# cut to 8 layers, seq 4096, bf16-mixed, micro-batch 1, AC none, full and op (and AC none with the full
# fp32 logits, loss_chunks 1; with train.compile; with adamw-8bit), 20 steps each; tokens/s,
# MFU and torch.cuda.max_memory_allocated against `shardtune plan` of the same recipe, all in
# OUTDIR/gpu_check.json (bench/gpu_run.py). Under 6 minutes on one H200 with the first four runs; the
# compile and 8-bit runs (issue 26) add their compile time (not yet run on a GPU). Then one MoE row
# (bench/gpu_moe.py): Qwen3-30B-A3B's widths cut to 4 layers through the trainer (grouped_mm experts),
# and one MoE block timed with transformers' grouped_mm and eager experts: tokens/s and model TFLOP/s
# in gpu_check.json "moe" (not yet run on a GPU).
#
#   bash bench/gpu.sh --fetch-wheels     here, with PyPI: the missing-package wheels -> bench/wheels/
#   bash bench/gpu.sh --dry-run OUTDIR   here, CPU: the same pipeline on a tiny cut (gloo, fp32, 3 steps)
#   bash bench/gpu.sh OUTDIR             on the GPU machine (no network; carry bench/wheels)
#
# The GPU machine's torch, transformers and accelerate are used as they are: anything missing is
# installed from bench/wheels into OUTDIR/venv, layered over the interpreter's own site dirs, with
# pip constrained to the installed torch, so its CUDA build is never replaced. shardtune itself runs
# from this tree (PYTHONPATH). PYTHON picks the interpreter (default python3).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WHEELS="$REPO/bench/wheels"
RUN_TIMEOUT_S="${RUN_TIMEOUT_S:-150}"
MODE=gpu
case "${1:-}" in
  --fetch-wheels) MODE=fetch ;;
  --dry-run) MODE=dry-run; shift ;;
  ""|-h|--help) sed -n '2,19p' "${BASH_SOURCE[0]}"; exit 2 ;;
esac
# here (fetch, dry run) the project venv is the tested set; the GPU box has its own python3
if [[ "$MODE" != gpu && -z "${PYTHON:-}" && -x "$REPO/.venv/bin/python" ]]; then
  PYTHON="$REPO/.venv/bin/python"
fi
PY="${PYTHON:-python3}"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"

PLATFORMS=(--implementation cp --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64
           --platform manylinux_2_28_x86_64)

fetch_wheels() {
  # the tested venv's versions with --no-deps; binary ones for every CPython the GPU box might
  # have; where a pin needs a newer Python (typer 0.29: 3.11), one resolving download for that one
  local specs kind spec v
  specs="$("$PY" "$REPO/bench/gpu_run.py" wheel-specs)"
  mkdir -p "$WHEELS"
  while read -r kind spec; do
    case "$kind" in
      pure) timeout 300 "$PY" -m pip download --quiet --no-deps --only-binary=:all: -d "$WHEELS" "$spec" ;;
      binary)
        for v in 3.10 3.11 3.12; do
          timeout 300 "$PY" -m pip download --quiet --no-deps --only-binary=:all: -d "$WHEELS" \
            --python-version "$v" "${PLATFORMS[@]}" "$spec"
        done ;;
      resolve-*)
        # shellcheck disable=SC2086  # one requirement per word
        timeout 300 "$PY" -m pip download --quiet --only-binary=:all: -d "$WHEELS" \
          --python-version "${kind#resolve-}" "${PLATFORMS[@]}" $spec ;;
    esac
  done <<< "$specs"
  ls -l "$WHEELS"
}

install_missing() {
  local outdir="$1" missing venv pip
  missing="$("$PY" "$REPO/bench/gpu_run.py" missing)"
  [[ -z "$missing" ]] && return 0
  echo "gpu.sh: installing from $WHEELS: $(echo "$missing" | tr '\n' ' ')"
  [[ -d "$WHEELS" ]] || { echo "gpu.sh: $WHEELS is absent; run 'bash bench/gpu.sh --fetch-wheels' and carry it" >&2; exit 2; }
  venv="$outdir/venv"
  pip=("$venv/bin/python" -m pip)
  if ! "$PY" -m venv "$venv"; then  # no ensurepip (Debian without python3-venv): pip >= 22.3 drives it
    "$PY" -m venv --without-pip "$venv"
    pip=("$PY" -m pip --python "$venv/bin/python")
  fi
  # A .pth of the interpreter's own site dirs, not --system-site-packages: that flag exposes the
  # base interpreter's, which misses torch when PYTHON is itself a venv or conda env. Appended
  # after the venv's site-packages, so what pip installs here shadows an older copy there.
  "$PY" -c 'import site; print("\n".join(site.getsitepackages() + [site.getusersitepackages()]))' \
    > "$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/gpu_box.pth"
  "$PY" -c 'import torch, transformers, accelerate as a
print(f"torch=={torch.__version__}\ntransformers=={transformers.__version__}\naccelerate=={a.__version__}")' \
    > "$outdir/constraints.txt"
  # shellcheck disable=SC2086  # one requirement per word
  timeout 300 "${pip[@]}" install --no-index --find-links "$WHEELS" -c "$outdir/constraints.txt" $missing
  PY="$venv/bin/python"
  "$PY" -c 'import torch, pydantic, typer, rich, yaml, safetensors; print("gpu.sh: torch", torch.__version__, "from", torch.__file__)'
}

if [[ "$MODE" == fetch ]]; then
  fetch_wheels
  exit 0
fi
OUTDIR="${1:?usage: bash bench/gpu.sh [--dry-run] OUTDIR}"
mkdir -p "$OUTDIR"
OUTDIR="$(cd "$OUTDIR" && pwd)"
cd "$REPO"
install_missing "$OUTDIR"
PREP_ARGS=()
[[ "$MODE" == dry-run ]] && PREP_ARGS=(--dry-run)
AC_MODES="$("$PY" bench/gpu_run.py prepare "$OUTDIR" ${PREP_ARGS[@]+"${PREP_ARGS[@]}"})"
# the MoE row (bench/gpu_moe.py): a Qwen3-30B-A3B cut through the trainer (run "moe", grouped_mm) and
# its experts block timed grouped_mm vs eager
"$PY" bench/gpu_moe.py prepare "$OUTDIR" ${PREP_ARGS[@]+"${PREP_ARGS[@]}"}

failed=0
for ac in $AC_MODES moe; do
  recipe="$OUTDIR/recipe-ac-$ac.yaml"
  timeout 60 "$PY" -m shardtune.cli plan "$recipe" --gpus 1 --strategy zero3 --json > "$OUTDIR/plan-ac-$ac.json"
  rm -rf "$OUTDIR/run-ac-$ac"
  echo "gpu.sh: ac=$ac: torchrun, timeout ${RUN_TIMEOUT_S} s"
  # a failed run (OOM, timeout) is reported by collect; the other mode still runs
  if ! timeout --kill-after=15 "$RUN_TIMEOUT_S" "$PY" -m torch.distributed.run --standalone \
      --nproc-per-node 1 -m shardtune.train "$recipe" 2>&1 | tee "$OUTDIR/train-ac-$ac.log"; then
    echo "gpu.sh: ac=$ac failed; see $OUTDIR/train-ac-$ac.log" >&2
    failed=1
  fi
done
if ! timeout --kill-after=15 "$RUN_TIMEOUT_S" "$PY" bench/gpu_moe.py layer "$OUTDIR" ${PREP_ARGS[@]+"${PREP_ARGS[@]}"}; then
  echo "gpu.sh: the MoE experts timing failed; see $OUTDIR/moe_layer.json" >&2
  failed=1
fi
timeout 60 "$PY" bench/gpu_run.py collect "$OUTDIR" || failed=1
exit "$failed"
