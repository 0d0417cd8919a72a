#!/usr/bin/env bash
# The whole loop measured on one GPU in one device call of at most 600 s: the trainer's RL step
# (bench/gpu/rl_step.py: Qwen3-0.6B shape, native engine, jailed REPL, fused loss, AdamW, weight
# sync), the train step's MFU at the Qwen3-0.6B shape with eager and compiled decoder layers and
# a profile of each by kind of kernel (train_step.py), one rank's memory and MFU in a
# Qwen3-4B-shaped GRPO step at 32k-token micro-batches with compiled layers (memory_budget.py),
# a 4B-shaped bf16 weight sync through the vLLM bucket path at 64 MiB and 1 GiB
# (sync_buckets.py), then `pytest -m gpu`.
#
# Budget on an H100 (nothing here has run on a GPU yet; the estimates are from the shapes and from
# run.sh's runs, bench/gpu/NOTES.md), each step under its own limit:
#   set-up  ~25 s: wheels, the checkout on the interpreter's own path (for the REPL's isolated
#           workers), the REPL jail built for the image's Python, import checks;
#   rl_step ~150 s, limit 160: start-up ~30 s (imports, BPE, two synthetic paper groups, the
#           model, the engine), step 0 with the kernels' compilation ~45 s, then 2 steps of
#           4 tasks x 8 trees x 3 turns x 128 tokens (the native engine's decode rate on a GPU is
#           unmeasured: ~25 s a step at 60 ms per decode step), the export ~5 s. Stopped at its
#           limit by SIGTERM, the trainer unwinds and the script still prints the steps it did;
#   train_step ~120 s, limit 130: the interpreter and CUDA ~10 s; per way of running the
#           layers, the model ~5 s, a first step with the kernels' compilation (~15 s eager,
#           ~45 s with the layers' two regions compiled by inductor, forward and backward), two
#           timed steps of 64 samples (132,718 tokens; 3.2 s each eager in run 4 of run.sh), one
#           profiled step and its summary (~10 s);
#   memory_budget ~110 s, limit 140: the 4B policy initialised on the CPU ~25 s (one whole
#           parameter at a time, as the trainer builds it), two steps of 2 x 32768 tokens (~5 s
#           each: 8 x 4.0e9 x 65536 FLOPs with activation checkpointing) after ~50 s of
#           compilation (the loss's kernels and the layers' regions). The whole model's states
#           are 60 GiB; on an H100's 79.6 GiB, beside the activations (~12 GiB) and AdamW's
#           foreach temporaries (one fp32 copy of the parameters, 15 GiB), they would not fit,
#           so on a card under 100 GB AdamW's moments go to host memory (--optimizer-offload,
#           30 GiB on the card): the offloaded step on CUDA measured too. Running out is
#           reported as a result, with the part that ran out;
#   sync_buckets ~40 s, limit 60: a spawned CUDA process, 2 sizes x 4 syncs of 8 GB;
#   pytest -m gpu ~90 s, limit what is left of 575 s, at most 120, skipped under 20 (run.sh's
#           test step ran its 11 files within 120 s).
# Estimates add up to about 535 s with the set-up and the limits before the tests to 490 s after
# it, so a step that hangs is cut by its own limit and the steps after it still run; the tests
# get the rest, and the whole call is cut at 600 s at worst, and returns what finished.
#
# Prepare here: `bash bench/gpu/fetch_wheels.sh` (msgspec and the PDF libraries into .whl/). Then,
# through the device tool: command `bash bench/gpu/loop.sh`, carry [".whl"], timeout_s 600.
# Logs and JSON (rl-step.{log,json}, train-step.{log,json}, memory.{log,json}, sync.{log,json},
# tests.log) are written to
# $LOGS and packed into $OUT/gpu-loop.tgz at every step, so a run cut short still returns what
# its finished steps wrote.
set -uo pipefail
cd "$(dirname "$0")/../.."
LOGS=${TMPDIR:-/tmp}/rlmtrain-gpu-loop
ARCHIVE=gpu-loop.tgz
source bench/gpu/device_setup.sh
# The REPL's zygote starts as `python -I` with a scrubbed environment, which ignores PYTHONPATH:
# for it the checkout and the wheels go on the interpreter's own path, through a .pth file.
purelib=$(python3 -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
printf '%s\n' "$PWD" "$PWD/kernels" /tmp/site >"$purelib/rlmtrain-checkout.pth"
# The REPL jail is a C extension, built for the Python it runs under (the checkout carries none).
if ! python3 -c "import rlmtrain._jail" 2>/dev/null; then
    include=$(python3 -c "import sysconfig; print(sysconfig.get_paths()['include'])")
    suffix=$(python3 -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))")
    cc -O2 -Wall -shared -fPIC -I"$include" csrc/jail.c -o "rlmtrain/_jail$suffix"
fi
python3 -c "import torch, msgspec, fpdf, pypdfium2, rlmtrain.train
print('torch', torch.__version__, torch.cuda.get_device_name())" || echo "imports failed"
env -i "$(python3 -c 'import sys; print(sys.executable)')" -I -c "import rlmtrain.rlm.worker" ||
    echo "the REPL worker cannot import the trainer: the RL step will fail"

step "RL step: Qwen3-0.6B shape, native engine, 4 tasks x 8 trees, 3 steps"
# SIGTERM, not SIGINT: the trainer unwinds on it (engine, REPLs) and the script sums up the
# steps that finished.
timeout -s TERM -k 15 160 python3 bench/gpu/rl_step.py --out "$LOGS/rl-step.json" \
    >"$LOGS/rl-step.log" 2>&1
sed -n '/^RL step/,/^{/p' "$LOGS/rl-step.log" | grep -v '^{' || tail -n 15 "$LOGS/rl-step.log"

step "train step: Qwen3-0.6B shape, 64 samples of 1-3k tokens, eager and compiled layers"
limit 130 python3 bench/gpu/train_step.py --layers eager compiled --steps 2 --profile \
    --out "$LOGS/train-step.json" >"$LOGS/train-step.log" 2>&1
grep -v '^{' "$LOGS/train-step.log" | tail -n 50

step "memory and MFU: Qwen3-4B shape, compiled layers, 2 micro-batches of 32768 tokens, one GPU"
offload=$(python3 -c "import torch
print('--optimizer-offload' if torch.cuda.get_device_properties(0).total_memory < 100e9 else '')")
limit 140 python3 bench/gpu/memory_budget.py $offload --compile-layers --out "$LOGS/memory.json" \
    >"$LOGS/memory.log" 2>&1
sed -n '/^GRPO step memory/,/^{/p' "$LOGS/memory.log" | grep -v '^{' || tail -n 15 "$LOGS/memory.log"

step "weight sync: Qwen3-4B shape, bf16, CUDA IPC into a spawned process, 64 MiB and 1 GiB"
limit 60 python3 bench/gpu/sync_buckets.py --out "$LOGS/sync.json" >"$LOGS/sync.log" 2>&1
sed -n '/^weight sync/,/^{/p' "$LOGS/sync.log" | grep -v '^{' || tail -n 15 "$LOGS/sync.log"

step "tests: pytest -m gpu"
# What the steps before left of the call, at most 120 s; the limit's 10 s of grace and the
# packing after it must end before the call's 600 s.
left=$((575 - SECONDS))
((left > 120)) && left=120
if ((left >= 20)); then
    limit $left python3 -m pytest -q -m gpu -p no:cacheprovider --continue-on-collection-errors \
        tests >"$LOGS/tests.log" 2>&1
    tail -n 15 "$LOGS/tests.log"
else
    echo "skipped: ${left} s left of the call" | tee "$LOGS/tests.log"
fi
pack
