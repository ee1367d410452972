# The two commands of the README. Both create .venv if missing and install the project.
PY ?= python3
# The CPU wheel of torch 2.13.0 lies on this project's machines' disk; an unpinned `torch` would pull
# a multi-GB CUDA build. On a GPU machine: `make install TORCH=torch==2.x.y` (or a CUDA index URL).
TORCH ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test install clean

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

# Lint first (ruff, pyproject.toml), then every tier of tests; either failing fails `make test`.
test: $(STAMP)
	$(BIN)/ruff check shardtune tests bench
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) runs
