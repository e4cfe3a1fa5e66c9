#!/bin/bash
# Run 1 of the fifteenth session (one GPU), commit $1: the unpack-combine with TMA loads
# against the shipped op (benchmarks/unpack_tma.py), and whether Triton 3.6's JIT shares a
# binary between equal-comparing constexprs (benchmarks/constexpr_cache_probe.py).
export PYTHONPATH=packages/cp-common/src:packages/cp-dcp/src:packages/cp-pcp/src:packages/cp-testing/src
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
SECONDS=0
timeout 120 python3 benchmarks/constexpr_cache_probe.py > $OUT/constexpr_probe-$1.txt 2>&1
echo "probe rc=$? at ${SECONDS}s"; cat $OUT/constexpr_probe-$1.txt
timeout 420 python3 benchmarks/unpack_tma.py --rounds 3 > $OUT/unpack_tma-$1.txt 2>&1
echo "tma rc=$? at ${SECONDS}s"; cat $OUT/unpack_tma-$1.txt | grep -v Warning
