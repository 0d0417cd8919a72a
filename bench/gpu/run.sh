#!/usr/bin/env bash
# Every GPU check and benchmark of the kernels in one device call, sized to fit one 600 s command
# (step limits 495 s, plus start-up and up to 10 s of grace per step):
# the card's two ceilings, the CUDA halves of the kernel and model tests, a tile sweep at the
# training shape, then bench/bench_kernels.py's CUDA part with the sweep's winners, and a table.
#
# Prepare here: `bash bench/gpu/fetch_wheels.sh` (peers and msgspec into .whl/). Then, through the
# device tool: command `bash bench/gpu/run.sh`, carry [".whl"], timeout_s 600. Logs and JSON land
# in $OUT (ceilings.json, tests.log, tiles.json, sweep.log, bench-{key,rest}.{log,json}).
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/rlmtrain-gpu}
mkdir -p "$OUT"
step() { printf '\n== %s (%s)\n' "$1" "$(date +%T)"; }
# SIGINT, not SIGTERM, at a step's limit: pytest then still prints its failures and
# pytest-benchmark still writes its JSON; -k ends a step that ignores it.
limit() { timeout -s INT -k 10 "$@"; }

step "machine"
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,driver_version --format=csv
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
# Without an install (the image has no package index) the checkout runs from the source tree:
# the trainer from the root, the kernels package from kernels/.
export PYTHONPATH=$PWD:$PWD/kernels${PYTHONPATH:+:$PYTHONPATH}
python3 -c "import torch, triton; from rlmtrain_kernels import logprob_slabs as s
print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name(),
'| addmm accumulates in fp32:', s._addmm_accumulates_in_fp32(torch.device('cuda')))" || exit 1

step "ceilings"
limit 45 python3 bench/gpu/ceilings.py "$OUT/ceilings.json"

step "tests: CUDA halves of the kernel and model tests, and the weight buckets' CUDA IPC"
limit 130 python3 -m pytest -q -m gpu -p no:cacheprovider --continue-on-collection-errors \
    tests/test_kernels_logprob.py \
    tests/test_kernels_fused.py tests/test_kernels_grpo.py tests/test_kernels_rows.py \
    tests/test_model_packed.py tests/test_weight_buckets.py >"$OUT/tests.log" 2>&1
tail -n 15 "$OUT/tests.log"

step "tile sweep at N=16384 H=2560"
limit 110 python3 bench/gpu/sweep_tiles.py --out "$OUT/tiles.json" >"$OUT/sweep.log" 2>&1
if grep -q '^tile sweep' "$OUT/sweep.log"; then
    sed -n '/^tile sweep/,$p' "$OUT/sweep.log"
else
    tail -n 8 "$OUT/sweep.log"  # cut short: tiles.json still holds the candidates it measured
fi
[ -s "$OUT/tiles.json" ] && export BENCH_TILES_JSON=$OUT/tiles.json

# The figures the targets are stated at (N = 16384, the GRPO loss alone) first, the rest after.
step "benchmarks"
bench() {  # name, seconds, -k expression
    limit "$2" python3 -m pytest -q -s -m gpu -p no:cacheprovider bench/bench_kernels.py \
        --benchmark-only --benchmark-json="$OUT/$1.json" -k "$3" >"$OUT/$1.log" 2>&1
    grep -E "passed|failed|error" "$OUT/$1.log" | tail -n 2
}
bench bench-key 130 "16384 or grpo_loss_alone"
bench bench-rest 80 "not 16384 and not grpo_loss_alone"

step "summary"
for part in bench-key bench-rest; do
    if [ -s "$OUT/$part.json" ]; then
        python3 bench/gpu/summarize.py "$OUT/$part.json"
    else
        echo "($part cut short: its printed figures)"
        grep '^\[cuda\]' "$OUT/$part.log" | cut -c1-120
    fi
done
