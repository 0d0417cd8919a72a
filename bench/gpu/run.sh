#!/usr/bin/env bash
# Every GPU check and benchmark of the kernels in one device call of at most 600 s: a run takes
# about 400 s (run 4: 386 s, with two steps cut at their limits, since raised); the step limits
# add up to 635 s, so a run that goes wrong everywhere is cut by the call's own limit, and still
# returns what its finished steps wrote. In order: the card's two ceilings, the CUDA halves of
# the kernel and model tests, a tile sweep at the training shape, then bench/bench_kernels.py's
# CUDA part with the sweep's winners (the key shapes first), the fused GRPO loss's and the
# log-prob op's variants, kernel profiles and host gaps (bench/gpu/profile_head.py), a table,
# the Qwen3-0.6B-shaped model's packed forward+backward rate (bench/bench_model.py), and last
# the trainer's GRPO step on that model on the one GPU (bench/gpu/train_step.py).
#
# Prepare here: `bash bench/gpu/fetch_wheels.sh` (peers and msgspec into .whl/). Then, through the
# device tool: command `bash bench/gpu/run.sh`, carry [".whl"], timeout_s 600. Logs and JSON
# (ceilings.json, tests.log, tiles.json, sweep.log, bench-{key,rest}.{log,json},
# profile-{grpo,logprob}.{log,json,trace.json}, model.{log,json}, train-step.log)
# are written to $LOGS and packed into $OUT/gpu-run.tgz at every step, so a run cut short still
# returns what its finished steps wrote, as one file (the device returns at most 8).
set -uo pipefail
cd "$(dirname "$0")/../.."
LOGS=${TMPDIR:-/tmp}/rlmtrain-gpu
ARCHIVE=gpu-run.tgz
source bench/gpu/device_setup.sh
python3 -c "import torch, triton; from rlmtrain_kernels import logprob_slabs as s
print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name(),
'| addmm accumulates in fp32:', s._addmm_accumulates_in_fp32(torch.device('cuda')))" || exit 1

step "ceilings"
limit 45 python3 bench/gpu/ceilings.py "$LOGS/ceilings.json"
# The benchmarks' "% of measured" columns then divide by this card's figures, not an earlier one's.
[ -s "$LOGS/ceilings.json" ] && export BENCH_CEILINGS_JSON=$LOGS/ceilings.json

step "tests: CUDA halves of the kernel and model tests, and the weight buckets' CUDA IPC"
limit 120 python3 -m pytest -q -m gpu -p no:cacheprovider --continue-on-collection-errors \
    tests/test_kernels_logprob.py \
    tests/test_kernels_fused.py tests/test_kernels_grpo.py tests/test_kernels_rows.py \
    tests/test_model_packed.py tests/test_weight_buckets.py tests/test_kernels_old_logp_none.py \
    tests/test_shared_prefix.py tests/test_kernels_logit_slabs.py tests/test_kernels_kept_logits.py \
    >"$LOGS/tests.log" 2>&1
tail -n 15 "$LOGS/tests.log"

step "tile sweep at N=16384 H=2560"
limit 60 python3 bench/gpu/sweep_tiles.py --out "$LOGS/tiles.json" >"$LOGS/sweep.log" 2>&1
if grep -q '^tile sweep' "$LOGS/sweep.log"; then
    sed -n '/^tile sweep/,$p' "$LOGS/sweep.log"
else
    tail -n 8 "$LOGS/sweep.log"  # cut short: tiles.json still holds the candidates it measured
fi
[ -s "$LOGS/tiles.json" ] && export BENCH_TILES_JSON=$LOGS/tiles.json

# The figures the targets are stated at (N = 16384, the GRPO loss alone) first, the rest after.
step "benchmarks"
bench() {  # name, seconds, -k expression
    limit "$2" python3 -m pytest -q -s -m gpu -p no:cacheprovider bench/bench_kernels.py \
        --benchmark-only --benchmark-json="$LOGS/$1.json" -k "$3" >"$LOGS/$1.log" 2>&1
    grep -E "passed|failed|error" "$LOGS/$1.log" | tail -n 2
}
bench bench-key 120 "16384 or grpo_loss_alone"

step "fused GRPO loss and log-prob op: variants, slab sizes, kernels"
for op in grpo logprob; do
    limit 45 python3 bench/gpu/profile_head.py --op $op --out "$LOGS/profile-$op.json" \
        >"$LOGS/profile-$op.log" 2>&1
    grep -E "^(grpo|logprob|kernels)|Error" "$LOGS/profile-$op.log"
    sed -n '/^---/,$p' "$LOGS/profile-$op.log" | cut -c1-150 | head -n 20
done

step "benchmarks at the other shapes"
bench bench-rest 60 "not 16384 and not grpo_loss_alone"

step "summary"
for part in bench-key bench-rest; do
    if [ -s "$LOGS/$part.json" ]; then
        python3 bench/gpu/summarize.py "$LOGS/$part.json"
    else
        echo "($part cut short: its printed figures)"
        grep '^\[cuda\]' "$LOGS/$part.log" | cut -c1-120
    fi
done

step "model: Qwen3-0.6B shape, packed T=2048, bf16"
limit 60 python3 -m pytest -q -s -p no:cacheprovider bench/bench_model.py --benchmark-only \
    --benchmark-json="$LOGS/model.json" -k "qwen3" >"$LOGS/model.log" 2>&1
grep -E "tokens/s|passed|failed|error" "$LOGS/model.log" | tail -n 8

step "train step: GRPO on the Qwen3-0.6B shape, one GPU, 64 samples of 1-3k tokens"
limit 80 python3 bench/gpu/train_step.py --preset qwen3-0.6b >"$LOGS/train-step.log" 2>&1
tail -n 3 "$LOGS/train-step.log"
pack
