#!/usr/bin/env bash
# The prepared GPU check, one command for a GPU lent for minutes (`make gpu-check OUT=DIR`):
#   1. the tests marked `gpu` (graph mode on CUDA, the Triton kernels, lossless decoding),
#      each named with its verdict as it ends (gpu-tests.log; gpu-tests.xml when pytest ends);
#   2. perf/gpu_report.py eager, then in graph mode (report-eager/report-graph .json and .log;
#      each JSON written again after every row, so a report cut off keeps what it measured).
# Each part runs under its own time limit, so the whole fits about 9 minutes on an H100 or
# H200 (GPU_TESTS_S, GPU_EAGER_S, GPU_GRAPH_S override them; GPU_REPORT_ARGS adds flags to
# both reports). The Python used is $GPU_PY (python3: on a GPU machine the one with a CUDA
# build of torch). Packages it lacks and the daemon needs can come as wheels in .whl/
# (`make gpu-wheels`, on a machine with pip's registry): they are installed into a folder
# of their own, put first on the path.
set -u
out=${1:?usage: scripts/gpu_check.sh OUT_DIR}
py=${GPU_PY:-python3}
mkdir -p "$out" && out=$(cd "$out" && pwd) || exit 1
cd "$(dirname "$0")/.." || exit 1
if compgen -G ".whl/*.whl" >/dev/null; then
    site=${TMPDIR:-/tmp}/xllm-gpu-site
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$site" .whl/*.whl || exit 1
    export PYTHONPATH=$site
fi
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
start=$SECONDS
"$py" -c 'import torch, triton; print(torch.__version__, "triton", triton.__version__,
          torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device")' \
    2>&1 | tee "$out/env.txt"

timeout "${GPU_TESTS_S:-240}" "$py" -m pytest -m gpu -v -rs tests -p no:cacheprovider \
    --junitxml="$out/gpu-tests.xml" 2>&1 | tee "$out/gpu-tests.log"
tests_rc=${PIPESTATUS[0]}

report=(--formats bf16 fp8 --batch-sizes 1 8 32 --k 1 3 --new-tokens 48
        --work-dir "${TMPDIR:-/tmp}/xllm-gpu-checkpoints")
read -ra extra <<< "${GPU_REPORT_ARGS:-}"  # e.g. "--preset tiny --device cpu": a dry run
report+=("${extra[@]}")
timeout "${GPU_EAGER_S:-150}" "$py" -m perf.gpu_report "${report[@]}" \
    --output "$out/report-eager.json" 2>&1 | tee "$out/report-eager.log"
eager_rc=${PIPESTATUS[0]}
timeout "${GPU_GRAPH_S:-150}" "$py" -m perf.gpu_report "${report[@]}" --enable-graph \
    --output "$out/report-graph.json" 2>&1 | tee "$out/report-graph.log"
graph_rc=${PIPESTATUS[0]}

echo "gpu-check: $((SECONDS - start)) s; exit status of the tests $tests_rc, eager report" \
     "$eager_rc, graph report $graph_rc (124: cut off at its time limit)" | tee -a "$out/env.txt"
[ "$tests_rc" = 0 ] && [ "$eager_rc" = 0 ] && [ "$graph_rc" = 0 ]
