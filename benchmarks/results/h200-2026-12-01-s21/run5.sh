#!/bin/bash
# Run 5 of the twenty-first session (one GPU), commit $1: runs 4 and 2 again after their
# setters also clear the recorded launches (launch plans are on there: in runs 2 and 4 the
# op replayed its recorded default tile whatever _UNPACK_ONE_VECTOR_MIN_N said).
export PYTHONPATH=packages/cp-common/src:packages/cp-dcp/src:packages/cp-pcp/src:packages/cp-testing/src
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
SECONDS=0
timeout 200 python3 benchmarks/unpack_asm.py --rounds 5 --shapes 8,8,128 4,16,128 \
    --only '^op|^triton r8 w[24]$' > $OUT/unpack_asm_op-$1.txt 2>&1
echo "asm rc=$? at ${SECONDS}s"; grep -v Warning $OUT/unpack_asm_op-$1.txt | grep -v "^check ok"
timeout 300 python3 benchmarks/variants.py --ab --ab-only unpack-onevec --rounds 3 \
    > $OUT/ab_unpack_onevec-$1.txt 2>&1
echo "ab rc=$? at ${SECONDS}s"; grep -v Warning $OUT/ab_unpack_onevec-$1.txt
