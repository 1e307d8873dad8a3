# xllm-py: two commands on a fresh machine, `make serve` and `make test`.
# `setup` creates .venv once; torch is pinned to the local CPU build (2.13.0)
# when no CUDA is visible, so pip never pulls gigabytes of CUDA wheels here; TORCH_SPEC
# overrides that choice (the container images: no GPU is visible while they build).
PY      ?= python3
VENV    ?= .venv
VPY     := $(VENV)/bin/python
STAMP   := $(VENV)/.installed

.PHONY: setup test test-slow test-gpu gpu-report serve lint clean proto mutation

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	if [ -n "$(TORCH_SPEC)" ]; then \
	    $(VPY) -m pip install -q "$(TORCH_SPEC)"; \
	elif command -v nvidia-smi >/dev/null 2>&1; then \
	    $(VPY) -m pip install -q "torch>=2.4"; \
	else \
	    $(VPY) -m pip install -q torch==2.13.0; \
	fi
	$(VPY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

# Two pytest-xdist workers, a test file each at a time (module-scoped servers are started
# once); PYTEST_WORKERS=0 runs the suite in this process, one test after another.
PYTEST_WORKERS ?= 2
# The tests marked `slow` (graph exactness at scale and 2-rank TP in graph mode, about 35 minutes)
# are left out: `make test-slow`.
test: setup
	$(VPY) -m pytest tests -m "not slow" $(if $(filter 0,$(PYTEST_WORKERS)),,-n $(PYTEST_WORKERS) --dist loadfile)

test-slow: setup
	$(VPY) -m pytest -m slow tests

# The tests marked `gpu` (a CUDA device); without one they are skipped and this says so.
test-gpu: setup
	@$(VPY) -c "import torch; torch.cuda.is_available() or print('make test-gpu: no CUDA device here, every GPU test is skipped')"
	$(VPY) -m pytest -m gpu -rs tests

# GPU decode report (perf/README.md): a random ~2.6B DeepSeek-V3-shaped checkpoint with MTP,
# bf16 and FP8, -> perf/results/gpu/<device>.json. Without CUDA it runs the tiny preset on CPU.
gpu-report: setup
	$(VPY) -m perf.gpu_report $(ARGS)

serve: setup
	$(VPY) -m xllm_py --num_speculative_tokens=1 $(ARGS)

# Mutation check of the sampling and speculative-decoding modules (docs/testing.md);
# about two hours on 2 cores. Survivors: `$(VPY) -m mutmut results`.
mutation: setup
	$(VPY) -m pip install -q -e ".[mutation]"
	$(VPY) -m mutmut run --max-children 2
	$(VPY) -m mutmut results

lint: setup
	$(VPY) -m ruff check xllm_py tests perf tools

# The cluster protocol's Python modules (committed). Run from the repository root so the
# generated imports read `from xllm_py.cluster import cluster_pb2`.
proto: setup
	$(VPY) -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. \
	    xllm_py/cluster/cluster.proto

clean:
	rm -rf $(VENV) build *.egg-info
