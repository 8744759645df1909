#!/usr/bin/env bash
# One device run (issues 39, 70, 71), in order of what matters: correctness on the GPU (pytest),
# then op timings (anchored and exact kernels at both dot precisions and SDPA at every shape, then
# fla's, then the goal ratios), decode (eager and with CUDA graphs, against a Llama eager and
# compiled), where the time goes (profiles of the op and a decode step), then kernel variants
# (dot precisions, warps, the exact kernels' chunk: time and error).
# Shares from the first run (H200, 2026-11-26): pytest took 102 s, decode 70 s eagerly (the
# compiled Llama adds a compile per context); fla's first calls compile and autotune for
# minutes: beside the tests, three processes compile what the op phase runs (bench_gpu.py
# --warm; fla's autotuning choices are not kept, so the op phase still makes its own), for as
# long as the tests take (what they leave uncompiled, the op phase compiles).
# Every phase has its own time limit and writes its log under $OUT; a phase that fails or
# runs out of time does not stop the next.
#
#   bash benchmarks/gpu_run.sh [SECONDS] [PHASES]
#     SECONDS: the whole run's budget (default 560); PHASES: a comma-separated subset of
#     pytest,bench_decode,bench_op,profile,tune (default: all), e.g. a second call's
#     "bash benchmarks/gpu_run.sh 250 profile,tune" for what the first one's budget left out
#     (on the same machine, while it is still held: the Triton cache is in the working tree).
# At most 8 files come back from $OUT: the run writes 7 (summary, warm and one per phase).
#
# Runs from the repository root with the machine's own python3 (torch, triton, transformers
# there); peers (flash-linear-attention, fla-core) come as wheels in .whl/ when present: before
# the device call, `pip download --no-deps -d .whl fla-core flash-linear-attention` here (pure
# Python, 1.5 MB; .whl/ is ignored by git) and name .whl in the call's carry.
set -u
budget=${1:-560}
phases=",${2:-pytest,bench_decode,bench_op,profile,tune},"
start=$(date +%s)
out=${OUT:-/tmp/gpu-run}
mkdir -p "$out"
export PYTHONPATH="$PWD/src" PYTHONUNBUFFERED=1 TRITON_CACHE_DIR="$PWD/.triton-cache"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi

left() { echo $(( budget - ($(date +%s) - start) )); }

# phase NAME SHARE COMMAND...: run COMMAND with at most SHARE seconds (fewer if the budget is short).
phase() {
    local name=$1 share=$2
    shift 2
    [[ $phases == *",$name,"* ]] || return 0
    local limit
    limit=$(( $(left) < share ? $(left) : share ))
    if (( limit < 20 )); then
        echo "== $name: not run ($(left) s left)" | tee -a "$out/summary.log"
        return
    fi
    echo "== $name (limit ${limit} s)" | tee -a "$out/summary.log"
    local t0
    t0=$(date +%s)
    timeout --signal=INT --kill-after=10 "$limit" "$@" > "$out/$name.log" 2>&1
    echo "== $name: exit $? after $(( $(date +%s) - t0 )) s" | tee -a "$out/summary.log"
}

{
    date -u
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
    python3 -c "import sys, torch, triton, transformers; print(sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
    python3 -c "import fla; print('fla', fla.__version__)" 2>&1 | tail -1
} > "$out/summary.log" 2>&1
cat "$out/summary.log"

# show NAME COMMAND...: what a phase's log says, when it ran.
show() {
    local log="$out/$1.log"
    shift
    [[ -f $log ]] && "$@" "$log"
}

# Compiles are CPU work and the tests time nothing: warm the Triton cache (our kernels at the
# benchmark's settings, fla's) beside the tests, so that the timed phases compile little.
warm=()
if [[ $phases == *",pytest,"* ]]; then
    for what in trellis fla_gsa fla_gdn; do
        timeout 150 python3 benchmarks/bench_gpu.py --warm "$what" > "$out/warm_$what.log" 2>&1 &
        warm+=($!)
    done
fi
phase pytest 150 python3 -m pytest -q -n 8 -p no:cacheprovider --timeout 120 -rfE \
    tests/test_triton.py tests/test_on_cuda.py -k "not compile_for_sm90"
show pytest tail -25
if (( ${#warm[@]} )); then
    wait "${warm[@]}"
    echo "== warm: done after $(( $(date +%s) - start )) s" | tee -a "$out/summary.log"
    for what in trellis fla_gsa fla_gdn; do
        { echo "### $what"; cat "$out/warm_$what.log"; } >> "$out/warm.log" && rm "$out/warm_$what.log"
    done
    grep -E "warm .*: [0-9]+ s|failed" "$out/warm.log"
fi
phase bench_op 280 python3 benchmarks/bench_gpu.py --only op
show bench_op sed -n '/# summary/,$p'
phase bench_decode 260 python3 benchmarks/bench_gpu.py --only decode
show bench_decode tail -8
phase profile 70 python3 benchmarks/bench_gpu.py --only profile
show profile grep -E "wall|failed"
phase tune 130 python3 benchmarks/bench_gpu.py --only tune
show tune tail -8
cat "$out/summary.log"
