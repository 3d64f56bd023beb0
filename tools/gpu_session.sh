#!/usr/bin/env bash
# One GPU session's checks and figures, in stages that each end inside a 10-minute command.
#
#   bash tools/gpu_session.sh first     # ALL a 15-minute session can afford, in one command:
#                                       # build, every gpu test (-n 8), the decode headline
#                                       # (and with async scheduling), one cached layer's
#                                       # graph cost by kernel (16 and 63 slots), a short
#                                       # offload run (copy speed by plan entries), the
#                                       # quantized figures, decode with exp12 misses, eager
#                                       # decode (the C++-exception probe under gdb passed on
#                                       # 2026-11-27: retry keeps it)
#   bash tools/gpu_session.sh retry     # after fixes: build, probe, gpu tests, quantized figures
#   bash tools/gpu_session.sh check     # install, the gpu tests, the GPU-path tests
#   bash tools/gpu_session.sh suite     # the whole suite on the GPU machine (CPU assumptions)
#   bash tools/gpu_session.sh decode    # benchmark_decode, probe-4.8g: graphs, eager, overlap,
#                                       # misses on the CPU
#   bash tools/gpu_session.sh offload   # benchmark_expert_offload on the DeepSeek-V2-Lite trace
#   bash tools/gpu_session.sh quant     # benchmark_quantization --speed: triton, cutlass_w4a16
#   bash tools/gpu_session.sh tune      # tools/tune_fused_moe.py at the probe shape: a table for
#                                       # this GPU (copy $OUT/fused_moe_table.json to configs/)
#   bash tools/gpu_session.sh flashinfer
#                                       # FlashInfer paged attention: its gpu tests (bf16 and
#                                       # the graph test), decode beside triton_paged. Carry in
#                                       # .whl the slim wheel (tools/slim_flashinfer.py) and
#                                       # apache-tvm-ffi; its JIT compiles the kernels there
#
# Every step runs under the smaller of its own limit and what is left of BUDGET seconds (default
# 540, from the start of the command), and is skipped when under 30 s are left, so the steps of
# a stage come in order of value and a command cut short still returns what $OUT holds. The
# build (BUILD_LIMIT, default 300 s) leaves 60 s of BUDGET; SKIP_BUILD=1 skips it (a second
# command on the same warm machine).
#
# $OUT (the device tool's return folder; /tmp/gpu-out elsewhere) gets at most 8 files, the
# tool's limit: summary.txt (the GPU, the build's key lines, each step's rc and time), one JSON
# per benchmark (a few into $LOGS instead), and logs.tgz (every log, re-packed after each step). The offload steps need the
# trace in the working tree: copy ../shared/traces/deepseek-v2-lite.npz to .traces/ (ignored)
# and name .traces in the device tool's carry. For the CUTLASS kernel, download nvidia-cutlass
# into .whl/ (the device README's command, NAME==VERSION nvidia-cutlass==4.2.0.0), carry .whl.
set -uo pipefail
OUT=${OUT:-/tmp/gpu-out}
LOGS=${LOGS:-/tmp/gpu-logs}
mkdir -p "$OUT" "$LOGS"
SUMMARY="$OUT/summary.txt"
export PYTHONUNBUFFERED=1
stage=${1:-check}
# DRY=1: print each command instead of running it (tests/tools/test_gpu_session.py).
RUN=""
[ "${DRY:-0}" = 1 ] && RUN=echo
deadline=$((SECONDS + ${BUDGET:-540}))

pack() { [ -n "$RUN" ] || tar -czf "$OUT/logs.tgz" -C "$LOGS" . 2>/dev/null; }

step() {  # step LIMIT NAME CMD...: output to $LOGS/NAME.log; rc and seconds to the summary
    local want=$1 name=$2; shift 2
    local left=$((deadline - SECONDS))
    if (( left < 30 )); then echo "$name skipped: ${left}s left" >> "$SUMMARY"; return 0; fi
    local t0=$SECONDS limit=$(( want < left ? want : left ))
    if [ -n "$RUN" ]; then echo timeout "$limit" "$@"; return 0; fi
    # SIGINT first: pytest prints its summary (the failing tests' names) and Python runs its
    # finally blocks; a KILL 15 s later if that hangs.
    timeout -s INT -k 15 "$limit" "$@" > "$LOGS/$name.log" 2>&1
    local rc=$?
    echo "$name rc=$rc $((SECONDS - t0))s (limit ${limit}s)" >> "$SUMMARY"
    tail -n 5 "$LOGS/$name.log"
    pack
}

install() {
    [ -n "$RUN" ] && return 0
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee -a "$SUMMARY"
    # The host CPU: on 2026-11-27 the CPU's miss from exp12 planes took 13.9 ms there against
    # about 1 ms on the development machine's 2 cores (does it have AVX-512 VBMI?).
    { grep -m1 "model name" /proc/cpuinfo; nproc; grep -m1 -o -w "avx512_vbmi" /proc/cpuinfo \
        || echo "no avx512_vbmi"; } | tee -a "$SUMMARY"
    python3 -c "import torch, triton; print('torch', torch.__version__, 'triton',
triton.__version__, 'cuda', torch.version.cuda)" | tee -a "$SUMMARY"
    # Wheels carried in .whl/ (nvidia-cutlass: the CUTLASS headers the W4A16 grouped GEMM of
    # vllm._C is built with; the machine has no network).
    if ls .whl/*.whl >/dev/null 2>&1; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
    fi
    # The tree on PYTHONPATH too: a failed or cut build must not stop the Triton path's figures.
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
    # Only sm_90a: no -gencode list from torch (CMakeLists.txt strips it anyway), and torch's old
    # FindCUDA looks for the toolkit where CUDA_PATH says, not beside PATH's first nvcc.
    export TORCH_CUDA_ARCH_LIST=9.0a
    if [ -z "${CUDA_PATH:-}" ] && [ -x /usr/local/cuda/bin/nvcc ]; then
        export CUDA_PATH=/usr/local/cuda
        export PATH="/usr/local/cuda/bin:$PATH"
    fi
    # setup.py looks for nvcc itself; without it on PATH it would quietly build for the CPU.
    export VLLM_TARGET_DEVICE=cuda
    # SKIP_BUILD=1: a later command on the same warm machine keeps the build it has. The build
    # leaves at least 60 s of BUDGET to the steps.
    local t0=$SECONDS limit=$(( deadline - SECONDS - 60 ))
    (( limit > ${BUILD_LIMIT:-300} )) && limit=${BUILD_LIMIT:-300}
    if [ "${SKIP_BUILD:-0}" = 1 ]; then
        echo "build skipped (SKIP_BUILD=1)" | tee -a "$SUMMARY"
    elif (( limit < 30 )); then
        echo "build skipped: ${limit}s left for it" | tee -a "$SUMMARY"
    else
        timeout -s INT -k 15 "$limit" python3 -m pip install -v --no-deps --no-build-isolation \
            -e . > "$LOGS/build.log" 2>&1
        echo "build rc=$? $((SECONDS - t0))s (limit ${limit}s)" | tee -a "$SUMMARY"
    fi
    grep -E "CUDA architectures|W4A16 grouped GEMM|error:|Error" "$LOGS/build.log" | tail -n 20 \
        | tee -a "$SUMMARY"
    python3 -c "import torch, vllm._C; print('vllm._C:', {n: hasattr(torch.ops._C, n)
for n in ('expert_gather', 'expert_gather_many', 'try_empty_pinned', 'w4a16_moe_mm')})" 2>&1 \
        | tail -n 1 | tee -a "$SUMMARY"
    pack
}

# The image lacks the server's packages (fastapi, openai, jsonschema): their test modules fail
# to import, which must not stop the others.
# -v: a run cut short still shows in its log which tests ran and how they ended. -n 8, tests
# dealt one by one (not a file per process: on the H100 the residency step's file alone took
# 110 s, its five policies ~20 s each, mostly Triton compiles): the compiles run side by side,
# and a crash takes one worker, not the step (xdist is on the image).
PYTEST=(python3 -m pytest -v -rfEs -p no:cacheprovider --continue-on-collection-errors)
PARALLEL=(-n 8 --dist load)
# FlashInfer's tests JIT-compile a module per variant (a minute each): only its own stage runs
# them, should .whl carry the slim wheel to the other stages.
NOT_FI=(-k "not flashinfer")
# Why a C++ exception from vllm._C crashed the process on the H100 image (2026-11-26): the
# compilers, the loaded runtime libraries, and the throw's backtrace under gdb.
throw_probe() { step 40 throw-probe bash tools/cpp_throw_probe.sh; }
# --unrouted-experts 1: expert 63 is never routed, so N = 63 is the cache's all-hits cost (on
# fully random routing N = 63 of 64 misses about once a step: the H100's first figures).
DECODE=(python3 benchmarks/benchmark_decode.py --random-model probe-4.8g --dtype bf16
        --device cuda --checkpoint /tmp/probe --unrouted-experts 1 --json)
# One --work for every quant step: the bf16 and quantized checkpoints are built once.
QUANT=(python3 benchmarks/benchmark_quantization.py --speed --speed-reps 3 --json
       --work /tmp/quant-work)
# One probe-shaped MoE layer replayed from its CUDA graph, uncached and cached at 16 and at 63
# of 64 slots, its all-hits rows routed among the first N experts only: is the cache's device
# cost per layer N-dependent (all hits at both counts, so no copy moves a byte), beside the
# random rows' misses; and its kernels by time.
MOE_LAYER=(python3 benchmarks/benchmark_moe_layer.py --num-experts 64 --top-k 8 --hidden 2048
           --inter 768 --slots 16 63 --tokens 1 32 --iters 50 --dtype bfloat16 --device cuda
           --graphs --profile-iters 5 --json)
OFFLOAD=(python3 benchmarks/benchmark_expert_offload.py --trace .traces/deepseek-v2-lite.npz
         --shape dsv2-lite --dtype bfloat16 --device cuda --json)

offload() {  # offload LIMIT ARGS...: the trace-driven benchmark, if the trace was carried
    local limit=$1; shift
    if [ -f .traces/deepseek-v2-lite.npz ] || [ -n "$RUN" ]; then
        step "$limit" offload "${OFFLOAD[@]}" "$@" --out "$OUT/offload.json"
    else
        echo "offload skipped: no .traces/deepseek-v2-lite.npz (see the header)" >> "$SUMMARY"
    fi
}

quant_steps() {  # quant_steps LIMIT LIMIT: the quantized figures, triton then CUTLASS
    # fp8-block runs W8A8 here (its checkpoint declares 1 x 128 input groups); the quant
    # stage also times it weight-only, which this step's budget leaves out.
    step "$1" quant "${QUANT[@]}" --speed-shape 2048 768 32 2 --schemes fp8-block w4a16-gptq \
        --out "$OUT/quant.json"
    # GPTQ on the CUTLASS grouped GEMM (refused, with the reason, where vllm._C lacks it).
    step "$2" quant-cutlass "${QUANT[@]}" --speed-shape 2048 768 32 2 --schemes w4a16-gptq \
        --moe-backend w4a16-gptq=cutlass_w4a16 --out "$OUT/quant-cutlass.json"
}

case "$stage" in
first)
    install
    # Every gpu test first (the never-run core's correctness), then issue 17/26's headline (it
    # also checks that every cache size gives the same tokens): graphs, batch 1 and 32, no
    # cache / E/4 / 63 of 64 (at batch 32 the 256 pairs can need all 64 experts: two waves).
    step 200 pytest-gpu "${PYTEST[@]}" -m gpu "${NOT_FI[@]}" "${PARALLEL[@]}" --durations=10
    # The Chrome traces of the profiled steps go into logs.tgz: where the cache's host time goes
    # (at 63 of 64 slots the H100's step took 0.89 ms more, the GPU busy 0.23 ms more); each
    # row's profile has gpu_gaps (idle time and its longest gaps, named) and gather_gbps.
    step 150 decode-graphs "${DECODE[@]}" --batch 1 32 --moe-expert-cache-size 0 16 63 \
        --output-len 32 --profile-steps 4 --profile-trace-dir "$LOGS/traces" \
        --out "$OUT/decode-graphs.json"
    # Async scheduling: the host's work between steps (0.5 ms at batch 1, 1.1 at batch 32 in
    # the 2026-11-27 rows above) beside the device's instead of before it; same sizes.
    step 70 decode-async "${DECODE[@]}" --batch 1 32 --moe-expert-cache-size 0 63 \
        --output-len 32 --async-scheduling --out "$LOGS/decode-async.json"
    step 60 moe-layer "${MOE_LAYER[@]}" --out "$OUT/moe-layer.json"
    # Before the quantized rows (measured once already): its header times the copy engine on
    # plans of 1, 2, 4, 8 and E valid entries (does one miss copy at the link's speed?), and
    # ours+cpu computes misses on the machine's 16 cores where cheaper than a copy, and the
    # least used ones beside the copies while that shortens the step.
    # --graphs: each design's steps replay CUDA graphs as the engine's do (sync-lfru cannot:
    # eager); the 2026-11-26 figures were eager, each layer's ~20 launches from Python.
    # ours+exp12: misses move as 12-bit planes, decoded exactly into the slots (3/4 the bytes);
    # +prefetch+exp12 and +cpu+exp12 add it to the designs that hide or avoid copies.
    offload 90 --capacity 16 --batch 1 --layers 8 --max-tokens 100 --threads 16 --graphs \
        --designs resident sync-lfru uva ours ours+exp12 ours+prefetch+exp12 ours+cpu+exp12 \
        ours+prefetch ours+cpu ours+overlap
    quant_steps 70 50
    # The same N = 16 rows with misses moved as exp12 (3/4 of the bytes); its JSON goes into
    # logs.tgz ($OUT holds 8 files at most).
    step 50 decode-exp12 "${DECODE[@]}" --batch 1 32 --moe-expert-cache-size 16 \
        --output-len 32 --moe-expert-link-compression exp12 --out "$LOGS/decode-exp12.json"
    step 40 decode-eager "${DECODE[@]}" --batch 1 --moe-expert-cache-size 0 --output-len 16 \
        --enforce-eager --profile-steps 2 --out "$OUT/decode-eager.json"
    ;;
retry)
    # A second, shorter session after fixes: every gpu test, then the quantized figures.
    install
    throw_probe
    step 200 pytest-gpu "${PYTEST[@]}" -m gpu "${NOT_FI[@]}" "${PARALLEL[@]}" --durations=10
    quant_steps 70 50
    ;;
check)
    install
    # The gpu tests, then the tests of the GPU path's modules (their CPU parts must pass there).
    step 240 pytest-gpu "${PYTEST[@]}" -m gpu "${NOT_FI[@]}" "${PARALLEL[@]}" --durations=10
    step 150 pytest-gpu-path "${PYTEST[@]}" "${PARALLEL[@]}" tests/kernels/triton tests/worker \
        tests/model_executor/layers/fused_moe/expert_cache
    ;;
suite)
    install
    step 400 pytest-all "${PYTEST[@]}" "${PARALLEL[@]}"
    ;;
decode)
    install
    step 280 decode-graphs "${DECODE[@]}" --batch 1 32 --moe-expert-cache-size 0 48 32 16 \
        --output-len 64 --profile-steps 8 --out "$OUT/decode-graphs.json"
    step 120 decode-eager "${DECODE[@]}" --batch 1 32 --moe-expert-cache-size 0 16 \
        --output-len 64 --enforce-eager --profile-steps 4 --out "$OUT/decode-eager.json"
    step 120 decode-overlap "${DECODE[@]}" --batch 1 32 --moe-expert-cache-size 16 \
        --output-len 64 --moe-expert-overlap --out "$OUT/decode-overlap.json"
    # Misses computed on the CPU where the load-time cost model says so (each layer's host
    # read and CPU pairs run between the pieces of the decode graphs: graph_break).
    step 120 decode-cpu "${DECODE[@]}" --batch 1 --moe-expert-cache-size 16 --output-len 32 \
        --moe-expert-cpu-compute auto --out "$OUT/decode-cpu.json"
    ;;
offload)
    install
    offload 540 --capacity 8 16 32 --batch 1 8 --designs all --max-tokens 300 --repeat 3 \
        --threads 16 --graphs
    ;;
quant)
    install
    # Quantized experts beside bf16 at batch 1 and 32, cached and not: auto (triton), then GPTQ
    # on the CUTLASS W4A16 grouped GEMM (needs vllm._C built with nvidia-cutlass: see install).
    step 300 quant "${QUANT[@]}" --speed-shape 2048 768 64 4 --schemes fp8-block w4a16-gptq \
        --fp8-weight-only-too \
        --out "$OUT/quant.json"
    step 240 quant-cutlass "${QUANT[@]}" --speed-shape 2048 768 64 4 --schemes w4a16-gptq \
        --moe-backend w4a16-gptq=cutlass_w4a16 --out "$OUT/quant-cutlass.json"
    ;;
flashinfer)
    install
    # The JIT builds each (dtype, head dim, variant) module on first use: about a minute each
    # on 16 cores, so the tests are cut to bf16 and the decode graph test.
    step 30 fi-import python3 -c "import flashinfer; print(flashinfer.__version__)"
    step 300 pytest-flashinfer "${PYTEST[@]}" -m gpu -k "bf16 or graph" \
        tests/model_executor/layers/attention/test_flashinfer_paged.py
    step 150 decode-flashinfer "${DECODE[@]}" --batch 1 32 --moe-expert-cache-size 0 \
        --output-len 32 --attention-backend flashinfer_paged --out "$OUT/decode-flashinfer.json"
    step 60 decode-triton-attn "${DECODE[@]}" --batch 1 32 --moe-expert-cache-size 0 \
        --output-len 32 --out "$OUT/decode-triton-attn.json"
    ;;
tune)
    install
    step 500 tune python3 tools/tune_fused_moe.py --hidden 2048 --intermediate 768 \
        --experts 64 --top-k 8 --dtype bf16 --search quick --out "$OUT/fused_moe_table.json"
    ;;
*)
    echo "unknown stage $stage: first, retry, check, suite, decode, offload, quant, tune or" \
        "flashinfer"
    exit 2 ;;
esac
pack
