#!/bin/bash
# Run 4 of the twenty-first session (one GPU), commit $1: benchmarks/unpack_asm.py, the op
# with and without _UNPACK_ONE_VECTOR_MIN_N = 8 next to the plain-Triton 8-row forms with 2
# and 4 warps, in one harness (run 2's op A/B and run 3's forms disagreed), five rounds, N=8
# and N=4 (H=64 D=128 B=4096).
export PYTHONPATH=packages/cp-common/src:packages/cp-dcp/src:packages/cp-pcp/src:packages/cp-testing/src
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
SECONDS=0
timeout 300 python3 benchmarks/unpack_asm.py --rounds 5 --shapes 8,8,128 4,16,128 \
    --only '^op|^triton r8 w[24]$' > $OUT/unpack_asm_op-$1.txt 2>&1
echo "asm rc=$? at ${SECONDS}s"; grep -v Warning $OUT/unpack_asm_op-$1.txt | grep -v "^check ok"
