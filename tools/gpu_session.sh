#!/usr/bin/env bash
# One GPU session's checks and figures, in stages that each end inside a 10-minute command.
#
#   bash tools/gpu_session.sh first     # ALL a 15-minute session can afford, in one command:
#                                       # build, gpu tests, then the headline figures, each step
#                                       # cut to what is left of BUDGET seconds (default 540)
#   bash tools/gpu_session.sh check     # install, the gpu tests, the GPU-path tests (~5 min)
#   bash tools/gpu_session.sh suite     # the whole suite on the GPU machine (CPU assumptions)
#   bash tools/gpu_session.sh decode    # benchmark_decode, probe-4.8g: graphs, eager, overlap
#   bash tools/gpu_session.sh offload   # benchmark_expert_offload on the DeepSeek-V2-Lite trace
#   bash tools/gpu_session.sh quant     # benchmark_quantization --speed: triton, cutlass_w4a16
#
# Everything it writes goes to $OUT (the device tool's return folder; /tmp/gpu-out elsewhere):
# logs and one JSON per benchmark, for docs/benchmarks.md. The offload stage needs the trace in
# the working tree: copy ../shared/traces/deepseek-v2-lite.npz to .traces/ (ignored) and name
# .traces in the device tool's carry. For the CUTLASS kernel, download nvidia-cutlass into .whl/
# (the device README's command, NAME==VERSION nvidia-cutlass==4.2.0.0) and carry .whl too.
set -uo pipefail
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
stage=${1:-check}
# DRY=1: print each command instead of running it (tests/tools/test_gpu_session.py).
RUN=""
[ "${DRY:-0}" = 1 ] && RUN=echo

# Stage "first": a step runs under the smaller of its own limit and what is left of the budget,
# and is skipped (and listed in $OUT/steps.txt) when under 30 s are left: a command cut short
# still returns what $OUT holds, so the steps come in order of value.
deadline=$((SECONDS + ${BUDGET:-540}))
step() {  # step LIMIT NAME CMD...: CMD's output to $OUT/NAME.log, its rc and time to steps.txt
    local want=$1 name=$2; shift 2
    local left=$((deadline - SECONDS))
    if (( left < 30 )); then echo "$name skipped: ${left}s left" >> "$OUT/steps.txt"; return 0; fi
    local t0=$SECONDS limit=$(( want < left ? want : left ))
    if [ -n "$RUN" ]; then echo timeout "$limit" "$@"; return 0; fi
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    echo "$name rc=$rc $((SECONDS - t0))s (limit ${limit}s)" >> "$OUT/steps.txt"
    tail -n 5 "$OUT/$name.log"
}

install() {
    [ -n "$RUN" ] && return 0
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
    python3 -c "import torch, triton; print('torch', torch.__version__, 'triton',
triton.__version__, 'cuda', torch.version.cuda)" | tee -a "$OUT/gpu.txt"
    # Wheels carried in .whl/ (nvidia-cutlass: the CUTLASS headers the W4A16 grouped GEMM of
    # vllm._C is built with; the machine has no network).
    if ls .whl/*.whl >/dev/null 2>&1; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
    fi
    # The tree on PYTHONPATH too: a failed or cut build must not stop the Triton path's figures.
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
    local t0=$SECONDS
    timeout "${BUILD_LIMIT:-300}" python3 -m pip install -q --no-deps --no-build-isolation -e . \
        > "$OUT/build.log" 2>&1
    echo "build rc=$? $((SECONDS - t0))s" | tee -a "$OUT/steps.txt"
    tail -n 3 "$OUT/build.log"
    python3 -c "import torch, vllm._C; print('vllm._C:', {n: hasattr(torch.ops._C, n)
for n in ('expert_gather', 'w4a16_moe_mm')})" | tee -a "$OUT/gpu.txt"
}

case "$stage" in
first)
    install
    common=(--random-model probe-4.8g --dtype bf16 --device cuda --checkpoint /tmp/probe --json)
    step 150 pytest-gpu python3 -m pytest -q -m gpu -rs -p no:cacheprovider --durations=10
    # Issue 17/26's headline: graphs, batch 1 and 32, no cache / all hits / E/4 (JSON per engine).
    step 240 decode-graphs python3 benchmarks/benchmark_decode.py "${common[@]}" --batch 1 32 \
        --moe-expert-cache-size 0 63 16 --output-len 32 --profile-steps 4 \
        --out "$OUT/decode-graphs.json"
    step 60 decode-eager python3 benchmarks/benchmark_decode.py "${common[@]}" --batch 1 \
        --moe-expert-cache-size 0 --output-len 16 --enforce-eager --profile-steps 2 \
        --out "$OUT/decode-eager.json"
    quant=(--speed --speed-reps 3 --speed-shape 2048 768 64 2 --json)
    step 120 quant python3 benchmarks/benchmark_quantization.py "${quant[@]}" \
        --schemes fp8-block w4a16-gptq --out "$OUT/quant.json"
    trace=.traces/deepseek-v2-lite.npz
    if [ -f "$trace" ] || [ -n "$RUN" ]; then
        step 120 offload python3 benchmarks/benchmark_expert_offload.py --trace "$trace" \
            --shape dsv2-lite --capacity 16 --batch 1 --layers 8 --max-tokens 100 \
            --designs resident sync-lfru uva ours ours+overlap --dtype bfloat16 \
            --device cuda --json --out "$OUT/offload.json"
    else
        echo "offload skipped: no $trace (see the header)" >> "$OUT/steps.txt"
    fi
    # GPTQ on the CUTLASS grouped GEMM (refused, with the reason, where vllm._C lacks it).
    step 90 quant-cutlass python3 benchmarks/benchmark_quantization.py "${quant[@]}" \
        --schemes w4a16-gptq --moe-backend w4a16-gptq=cutlass_w4a16 \
        --out "$OUT/quant-cutlass.json"
    ;;
check)
    install
    # The gpu tests, then the tests of the GPU path's modules (their CPU parts must pass there).
    $RUN timeout 300 python3 -m pytest -q -m gpu -rs 2>&1 | tee "$OUT/pytest-gpu.log"
    $RUN timeout 200 python3 -m pytest -q -x tests/kernels/triton tests/worker \
        tests/model_executor/layers/fused_moe/expert_cache 2>&1 | tee "$OUT/pytest-gpu-path.log"
    ;;
suite)
    install
    $RUN timeout 560 python3 -m pytest -q 2>&1 | tee "$OUT/pytest-all.log"
    ;;
decode)
    install
    common=(--random-model probe-4.8g --output-len 64 --dtype bf16 --device cuda
            --checkpoint /tmp/probe --json)
    $RUN timeout 280 python3 benchmarks/benchmark_decode.py "${common[@]}" --batch 1 32 \
        --moe-expert-cache-size 0 48 32 16 --profile-steps 8 --out "$OUT/decode-graphs.json" \
        2>"$OUT/decode-graphs.log" | tail -c 2000
    $RUN timeout 120 python3 benchmarks/benchmark_decode.py "${common[@]}" --batch 1 32 \
        --moe-expert-cache-size 0 16 --enforce-eager --profile-steps 4 \
        --out "$OUT/decode-eager.json" \
        2>"$OUT/decode-eager.log" | tail -c 2000
    $RUN timeout 120 python3 benchmarks/benchmark_decode.py "${common[@]}" --batch 1 32 \
        --moe-expert-cache-size 16 --moe-expert-overlap --out "$OUT/decode-overlap.json" \
        2>"$OUT/decode-overlap.log" | tail -c 2000
    ;;
offload)
    install
    trace=.traces/deepseek-v2-lite.npz
    [ -f "$trace" ] || [ -n "$RUN" ] || { echo "missing $trace (see the header)"; exit 2; }
    $RUN timeout 540 python3 benchmarks/benchmark_expert_offload.py --trace "$trace" \
        --shape dsv2-lite --capacity 8 16 32 --batch 1 8 --designs all --max-tokens 300 \
        --dtype bfloat16 --device cuda --repeat 3 --json --out "$OUT/offload.json" \
        2>"$OUT/offload.log" | tail -c 3000
    ;;
quant)
    install
    # Quantized experts beside bf16 at batch 1 and 32, cached and not: auto (triton), then GPTQ
    # on the CUTLASS W4A16 grouped GEMM (needs vllm._C built with nvidia-cutlass: see install).
    $RUN timeout 300 python3 benchmarks/benchmark_quantization.py --speed --speed-reps 3 \
        --schemes fp8-block w4a16-gptq --json --out "$OUT/quant-auto.json" \
        2>"$OUT/quant-auto.log" | tail -c 2000
    $RUN timeout 240 python3 benchmarks/benchmark_quantization.py --speed --speed-reps 3 \
        --schemes w4a16-gptq --moe-backend w4a16-gptq=cutlass_w4a16 --json \
        --out "$OUT/quant-cutlass.json" 2>"$OUT/quant-cutlass.log" | tail -c 2000
    ;;
*)
    echo "unknown stage $stage: first, check, suite, decode, offload or quant"; exit 2 ;;
esac
