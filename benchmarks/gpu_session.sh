#!/usr/bin/env bash
# One device call on a lent GPU machine (docs/gpu.md, "Running it on a lent GPU machine"): ≤ 600 s,
# each part under its own `timeout`, everything written under $OUT as it goes (8 files at most):
#   session.log    this script's own steps, the environment, the verdicts of the NCCL run, the recovery
#                  breakdown (benchmarks/recovery.py --device cuda) and one step's profile (SKIP_DIAG=1: neither)
#   nccl.log       a user script over NCCL under `stalwart run`, SIGKILLed after step 6, restored
#   gpu-check.txt  `make gpu-check`'s summary; gpu-check.json, gpu-tests.{xml,log}, gpu-step.{json,log}
# Call it with carry [".whl"] and timeout_s 600:   bash benchmarks/gpu_session.sh
# Exit status: 0 when both the NCCL run and gpu-check passed. A CPU dry run of the plumbing (gpu-check
# then exits 2): OUT=/tmp/s NCCL_SCRIPT_ARGS="--backend gloo" PATH=.venv/bin:$PATH bash benchmarks/gpu_session.sh
set -u
OUT=${OUT:-runs/gpu-session}
mkdir -p "$OUT"
LOG=$OUT/session.log
say() { echo "[$(date -u +%H:%M:%S)] $*" | tee -a "$LOG"; }
export PYTHONUNBUFFERED=1

# 1. carried wheels (torchtitan and its pure-Python deps, py-spy) into /tmp/site
if compgen -G ".whl/*.whl" >/dev/null; then
    timeout 60 python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl >>"$LOG" 2>&1 || say "wheel install failed (rc $?): going on without them"
fi
export PYTHONPATH=/tmp/site:src:.${PYTHONPATH:+:$PYTHONPATH} PATH=/tmp/site/bin:$PATH
{
    nvidia-smi -L
    df -h /dev/shm /tmp
    python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name())'
    python3 -c 'import torchtitan, triton; print("torchtitan", torchtitan.__version__, "triton", triton.__version__)'
    command -v py-spy
} >>"$LOG" 2>&1
say "environment logged"

# 2. a NCCL user script under `stalwart run`: SIGKILL after step 6, restart, restore from memory
NCCL=/tmp/nccl-run
rm -rf "$NCCL" && mkdir -p "$NCCL"
say "NCCL user script under stalwart run, --chaos kill:rank=0:step=6 (timeout 90 s)"
timeout -k 5 90 python3 -m stalwart run --standalone --nproc-per-node 1 --max-restarts 2 --hang-timeout 30 \
    --run-dir "$NCCL/run" --summary-json "$NCCL/summary.json" --chaos kill:rank=0:step=6 \
    tests/gpu/scripts/nccl_restore.py --out "$NCCL" ${NCCL_SCRIPT_ARGS:-} >"$OUT/nccl.log" 2>&1
rc=$?
{
    echo "== exit $rc"
    echo "== result.json"; cat "$NCCL/result.json" 2>/dev/null
    echo; echo "== summary.json"; cat "$NCCL/summary.json" 2>/dev/null
} >>"$OUT/nccl.log"
nccl_ok=0
if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
    say "FAIL  NCCL run: timed out (a hang?)"
elif [ $rc -ne 0 ]; then
    say "FAIL  NCCL run: exit $rc (see nccl.log)"
elif ! grep -q "restored from memory at step 6" "$OUT/nccl.log"; then
    say "FAIL  NCCL run: exit 0 but no 'restored from memory at step 6' in its log"
elif ! grep -q '"restored_from": "memory"' "$NCCL/result.json"; then
    say "FAIL  NCCL run: result.json does not say it restored from memory"
else
    nccl_ok=1
    say "PASS  NCCL run: killed after step 6, restored from memory, finished: $(cat "$NCCL/result.json")"
fi

# 3. diagnostics, appended to session.log (the tool returns 8 files at most): kill → next step broken
# down on the GPU (benchmarks/recovery.py) and one step's kernels (benchmarks/gpu_profile.py)
if [ "${SKIP_DIAG:-0}" != 1 ]; then
    say "recovery breakdown on the GPU (timeout 70 s)"
    timeout -k 5 70 python3 benchmarks/recovery.py --device cuda --nproc 1 --configs stalwart --repeats 2 \
        --hang-repeats 0 --timeout 30 --json >>"$LOG" 2>&1 || say "recovery.py exit $?"
    say "one step profiled (timeout 60 s)"
    timeout -k 5 60 python3 benchmarks/gpu_profile.py >>"$LOG" 2>&1 || say "gpu_profile.py exit $?"
fi

# 4. make gpu-check: tests/gpu (≤ 240 s) + benchmarks/gpu_step.py (≤ 150 s), written to $OUT as they go,
# within what is left of the call's 600 s
cap=$(( 585 - SECONDS )); [ $cap -gt 400 ] && cap=400
say "make gpu-check (timeout $cap s)"
timeout -k 10 $cap make gpu-check GPU_PY=python3 GPU_CHECK_ARGS="--out $OUT ${GPU_CHECK_EXTRA:-}" \
    >"$OUT/gpu-check.txt" 2>&1
check=$?
say "gpu-check exit $check (0 = every verdict passed; 124 = its overall timeout)"
grep -E "^(PASS|FAIL)" "$OUT/gpu-check.txt" | tee -a "$LOG"
[ $nccl_ok -eq 1 ] && [ $check -eq 0 ]
