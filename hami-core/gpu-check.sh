#!/usr/bin/env bash
# Real-GPU check for libvgpu.so: builds it, then with a limit verifies that allocations
# past the limit fail, that nvidia-smi shows the limit and (if PyTorch is installed) that
# torch.cuda.mem_get_info() agrees; then the enforcer's check: NVML's per-process view (by host
# PID) sees a raw-ELF-lookup bypass past the limit that the library cannot, and the memory the
# driver reserves per context (the enforcer's --breach-tolerance-mib) is printed.
# Usage: hami-core/gpu-check.sh [LIMIT_MIB]  (default 1024)
set -u
cd "$(dirname "$0")"
CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
LIMIT_MIB=${1:-1024}
LIMIT_BYTES=$((LIMIT_MIB * 1024 * 1024))
LIB=$PWD/build/libvgpu.so
PROBE=$PWD/build/gpu/cuprobe
failures=0

check() { # check NAME EXPECTED ACTUAL
    if [ "$2" = "$3" ]; then echo "PASS $1: $3"; else echo "FAIL $1: expected $2, got $3"; failures=$((failures + 1)); fi
}

make -s build/libvgpu.so || exit 1
mkdir -p build/gpu
gcc -O2 -I"$CUDA_HOME/include" -Iinclude -Ifake -o "$PROBE" tests/cuprobe.c \
    -L"$CUDA_HOME/lib64/stubs" -lcuda -ldl -lpthread || exit 1
nvidia-smi -L || { echo "FAIL no GPU visible"; exit 1; }

export CUDA_DEVICE_MEMORY_LIMIT=${LIMIT_MIB}m
out=$(LD_PRELOAD=$LIB "$PROBE" --path=link init ctx 0 totalmem 0 info alloc "$LIMIT_BYTES" alloc 1 free 0 alloc 1)
echo "$out"
check "cuDeviceTotalMem_v2" "bytes=$LIMIT_BYTES" "$(echo "$out" | grep -o 'totalmem rc=0 bytes=[0-9]*' | cut -d' ' -f3)"
check "cuMemGetInfo_v2 total" "total=$LIMIT_BYTES" "$(echo "$out" | grep -o 'total=[0-9]*' | head -1)"
check "alloc rcs (limit fits, +1 fails, after free fits)" "0 2 0" \
    "$(echo "$out" | grep '^alloc' | sed 's/.*rc=\([0-9-]*\).*/\1/' | xargs)"

out=$(LD_PRELOAD=$LIB "$PROBE" --path=procaddr init ctx 0 alloc "$LIMIT_BYTES" alloc 1)
check "cuGetProcAddress path alloc rcs" "0 2" "$(echo "$out" | grep '^alloc' | sed 's/.*rc=\([0-9-]*\).*/\1/' | xargs)"

smi=$(LD_PRELOAD=$LIB nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits -i 0 | tr -d ' ')
check "nvidia-smi memory.total (MiB)" "$LIMIT_MIB" "$smi"
LD_PRELOAD=$LIB nvidia-smi | grep -m1 MiB

if python3 -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    torch_out=$(LD_PRELOAD=$LIB python3 - "$LIMIT_BYTES" <<'PY'
import sys, torch
limit = int(sys.argv[1])
free, total = torch.cuda.mem_get_info()
print(f"total={total}")
try:
    torch.empty(limit + (256 << 20), dtype=torch.uint8, device="cuda")
    print("oversize=allocated")
except torch.OutOfMemoryError:
    print("oversize=oom")
PY
)
    echo "$torch_out"
    check "torch.cuda.mem_get_info total" "total=$LIMIT_BYTES" "$(echo "$torch_out" | grep -o 'total=[0-9]*')"
    check "torch allocation past the limit" "oversize=oom" "$(echo "$torch_out" | grep -o 'oversize=[a-z]*')"
else
    echo "SKIP PyTorch not installed"
fi

# The enforcer's view on the real driver: a process that bypasses the library (raw ELF lookup of
# cuMemAlloc_v2) holds past the limit, and NVML's per-process figure shows it; the node agent's
# reader (services/nodeagent/nvml.py) reads the same entry points with nvml.h's struct layouts.
RAW=$PWD/build/gpu/rawelf
gcc -O2 -I"$CUDA_HOME/include" -o "$RAW" tests/rawelf.c -L"$CUDA_HOME/lib64/stubs" -lcuda || exit 1
REPO=$(cd .. && pwd)
PY=${PYTHON:-$REPO/.venv/bin/python}
[ -x "$PY" ] || PY=python3
LD_PRELOAD=$LIB "$PROBE" --path=link init ctx 0 hold 4000 > /dev/null &
idle_pid=$!
sleep 2
idle_out=$("$PY" - "$idle_pid" <<'PY'
import sys
from kai_isolator.services.nodeagent.nvml import Nvml
pid = int(sys.argv[1])
held = [p.used_bytes for p in Nvml().snapshot().processes if p.pid == pid]
print(f"context_bytes={held[0] if held else 'unseen'}")
PY
)
wait "$idle_pid"
echo "$idle_out (what the driver reserves for one bare context: size --breach-tolerance-mib by it)"
past=$((LIMIT_BYTES + 512 * 1024 * 1024))
LD_PRELOAD=$LIB "$RAW" "$past" 5000 > build/gpu/rawelf.out &
raw_pid=$!
sleep 2
seen=$("$PY" - "$raw_pid" <<'PY'
import sys
from kai_isolator.services.nodeagent.nvml import Nvml
pid = int(sys.argv[1])
snap = Nvml().snapshot()
held = [p.used_bytes for p in snap.processes if p.pid == pid]
print(f"api={snap.api} held={held[0] if held else 0}")
PY
)
wait "$raw_pid"
echo "rawelf: $(head -1 build/gpu/rawelf.out); NVML: $seen"
check "raw-ELF bypass gets past the library (the enforcer's job)" "rc=0" "$(grep -o 'rc=[0-9]*' build/gpu/rawelf.out | head -1)"
held=$(echo "$seen" | sed 's/.*held=\([0-9]*\).*/\1/')
check "NVML shows the bypass above the limit by host PID" "yes" "$([ "${held:-0}" -gt "$LIMIT_BYTES" ] && echo yes || echo "no ($seen)")"

echo "failures=$failures"
[ "$failures" -eq 0 ]
