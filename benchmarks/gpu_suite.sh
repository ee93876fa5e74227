#!/usr/bin/env bash
# Every check that needs a GPU, in one go: the CUDA tests and the benchmarks' GPU runs, each
# writing its log and JSON into one folder, so a machine with a GPU for a short while fills
# benchmarks/RESULTS.md's GPU sections in a few commands.
#
#   benchmarks/gpu_suite.sh OUT_DIR [PART ...]
#
# PART: tests fuse fuse-clip offload-b4 offload-b12 ring zero (default: all, in that order; the
# offload runs are the long ones, ~5-10 min each on an H100). Each part is capped by
# PART_TIMEOUT seconds (default 570). With WHEELS=DIR, torchao and deepspeed are installed
# from the wheels in DIR first (offline), for the offload baselines.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: benchmarks/gpu_suite.sh OUT_DIR [PART ...]}
shift
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(tests fuse fuse-clip offload-b4 offload-b12 ring zero)
limit=${PART_TIMEOUT:-570}
mkdir -p "$out"

python -c "import graphoffload" 2>/dev/null || pip install -q --no-build-isolation --no-deps -e . || exit 1
if [ -n "${WHEELS:-}" ]; then
    pip install -q --no-index --find-links "$WHEELS" torchao deepspeed >"$out/wheels.log" 2>&1 \
        || echo "baseline wheels did not install: see $out/wheels.log"
fi
python -c "import torch; assert torch.cuda.is_available(); print(torch.__version__, torch.version.cuda,
torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0))" >"$out/device.txt" 2>&1 \
    || { echo "no CUDA device here: nothing to run"; exit 1; }
cat "$out/device.txt"

run() {   # name, command...
    local name=$1
    shift
    local start=$SECONDS
    timeout "$limit" "$@" >"$out/$name.log" 2>&1
    local rc=$?
    echo "$name: exit $rc in $((SECONDS - start)) s (log: $out/$name.log)"
    tail -n 15 "$out/$name.log"
}

for part in "${parts[@]}"; do
    case $part in
        tests) run tests python -m pytest -q -m cuda tests ;;
        fuse) run fuse python benchmarks/fuse_optimizer.py --out "$out/fuse_optimizer.json" ;;
        fuse-clip) run fuse-clip python benchmarks/fuse_optimizer.py --clip 1.0 --out "$out/fuse_optimizer_clip.json" ;;
        offload-b4) run offload-b4 python benchmarks/offload.py --batch 4 --out "$out/offload_b4.json" ;;
        offload-b12) run offload-b12 python benchmarks/offload.py --batch 12 --out "$out/offload_b12.json" ;;
        ring) run ring python benchmarks/ring_attention.py --gpu --out "$out/ring_attention_gpu.json" ;;
        zero) run zero python benchmarks/zero.py --device cuda --out "$out/zero_cuda.json" ;;   # N up to the GPUs present
        *) echo "unknown part $part (tests fuse fuse-clip offload-b4 offload-b12 ring zero)" ;;
    esac
done
