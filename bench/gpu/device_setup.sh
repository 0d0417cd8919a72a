# Sourced by run.sh and loop.sh, from the repository root, with LOGS (where the logs go) and
# ARCHIVE (the name they are packed under in $OUT) set: the helpers every step uses, the card's
# line, the wheels of .whl/ installed, and the checkout on PYTHONPATH.
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/rlmtrain-gpu-out}
mkdir -p "$OUT" "$LOGS"
pack() { tar czf "$OUT/$ARCHIVE" -C "$LOGS" .; }
step() { pack; printf '\n== %s (%s)\n' "$1" "$(date +%T)"; }
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
