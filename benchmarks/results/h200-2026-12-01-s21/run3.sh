#!/bin/bash
# Run 3 of the twenty-first session (one GPU), commit $1: benchmarks/unpack_asm.py, the plain
# Triton forms only (compact or row-layout LSE math, with and without the load-order
# dependency) and the two best asm order forms of run 1, at N=8 and N=4 (H=64 D=128 B=4096).
export PYTHONPATH=packages/cp-common/src:packages/cp-dcp/src:packages/cp-pcp/src:packages/cp-testing/src
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
SECONDS=0
timeout 500 python3 benchmarks/unpack_asm.py --rounds 3 --shapes 8,8,128 4,16,128 \
    --only '^triton|^ld\.v4 r(8 w4|16 w8) order' > $OUT/unpack_asm_triton-$1.txt 2>&1
echo "asm rc=$? at ${SECONDS}s"; grep -v Warning $OUT/unpack_asm_triton-$1.txt | grep -v "^check ok"
