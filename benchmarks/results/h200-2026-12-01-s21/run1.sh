#!/bin/bash
# Run 1 of the twenty-first session (one GPU), commit $1: the unpack-combine with PTX load
# hints and with the load-order dependency, against the shipped op (benchmarks/unpack_asm.py;
# H=64 D=128 B=4096, N = 8, 4, 2).
export PYTHONPATH=packages/cp-common/src:packages/cp-dcp/src:packages/cp-pcp/src:packages/cp-testing/src
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
SECONDS=0
timeout 540 python3 benchmarks/unpack_asm.py --rounds 3 > $OUT/unpack_asm-$1.txt 2>&1
echo "asm rc=$? at ${SECONDS}s"; grep -v Warning $OUT/unpack_asm-$1.txt
