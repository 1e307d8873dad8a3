#!/usr/bin/env bash
# Run the Ascend image on one NPU with the davinci devices and the driver mounted.
#   deploy/docker/run_ascend.sh /models/DeepSeek-V3 [DEVICE_INDEX] [extra xllm flags...]
set -euo pipefail
MODEL_DIR="${1:?usage: run_ascend.sh MODEL_DIR [DEVICE_INDEX] [xllm flags...]}"
DEVICE="${2:-0}"
shift $(( $# >= 2 ? 2 : 1 ))
IMAGE="${IMAGE:-xllm-py:ascend}"
PORT="${PORT:-8000}"
exec docker run --rm -p "${PORT}:8000" \
  --device "/dev/davinci${DEVICE}" \
  --device /dev/davinci_manager \
  --device /dev/devmm_svm \
  --device /dev/hisi_hdc \
  -v /usr/local/Ascend/driver:/usr/local/Ascend/driver:ro \
  -v /usr/local/dcmi:/usr/local/dcmi:ro \
  -v /usr/local/bin/npu-smi:/usr/local/bin/npu-smi:ro \
  -v "${MODEL_DIR}:/models/model:ro" \
  -e ASCEND_RT_VISIBLE_DEVICES=0 \
  "${IMAGE}" --model /models/model --devices npu:0 --host 0.0.0.0 --port 8000 "$@"
