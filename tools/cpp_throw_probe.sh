#!/usr/bin/env bash
# Why a C++ exception thrown from vllm._C crashed the process on the H100 image (2026-11-26:
# SIGSEGV on every TORCH_CHECK failure, e.g. a bad argument to expert_gather). Prints what a
# diagnosis needs, in about 20 s: the compilers, the runtime libraries the extension and a torch
# process load, whether torch's own C++ exceptions reach Python, then our throw under gdb (its
# backtrace; a crash in libgcc's unwinder, e.g. linear_search_fdes, points to a libgcc mismatch
# between the compiler that built vllm._C and the process's libgcc_s).
set -uo pipefail
PY=$(python3 -c 'import sys; print(sys.executable)')
echo "== compilers"; for c in g++ /usr/bin/g++ "${CXX:-}"; do
    [ -n "$c" ] && command -v "$c" >/dev/null && echo "$c: $("$c" --version | head -n 1)"; done
so=$(ls vllm/_C*.so 2>/dev/null | head -n 1)
echo "== ldd $so"; [ -n "$so" ] && ldd "$so" | grep -E "libgcc|libstdc|libc10\.|libtorch\.|cudart"
echo "== libraries a torch process maps"
"$PY" -c "import torch; print(''.join(sorted({l.split()[-1] + chr(10) for l in
open('/proc/self/maps') if 'libgcc' in l or 'libstdc' in l})))"
echo "== torch's own exception"
"$PY" -c "import torch
try:
    torch.ones(2).view(3)
except RuntimeError as e:
    print('reached Python:', str(e).splitlines()[0])"
echo "rc=$?"
echo "== vllm._C's exception (try_empty_pinned's size check)"
"$PY" -c "import torch, vllm._C
try:
    torch.ops._C.try_empty_pinned([-1], torch.float32)
except RuntimeError as e:
    print('reached Python:', str(e).splitlines()[0])"
rc=$?
echo "rc=$rc"
if [ "$rc" -ne 0 ] && command -v gdb >/dev/null; then
    gdb -q -batch -ex run -ex bt --args "$PY" -c \
        "import torch, vllm._C; torch.ops._C.try_empty_pinned([-1], torch.float32)" 2>&1 \
        | grep -v "^\[" | tail -n 40
fi
