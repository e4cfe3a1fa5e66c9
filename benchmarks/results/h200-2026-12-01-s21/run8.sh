#!/bin/bash
# Run 8 of the twenty-first session (one GPU), commit $1: the new unpack kernel (each weight
# just before its sum) under _UNPACK_ONE_VECTOR_MIN_N = 0 / 8 / 4 through the op, every page
# shape: benchmarks/variants.py --ab, switch unpack-onevec, two interleaved rounds (for the
# decode sizes: warm graph replay at B = 1, 8, 64).
export PYTHONPATH=packages/cp-common/src:packages/cp-dcp/src:packages/cp-pcp/src:packages/cp-testing/src
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
SECONDS=0
timeout 300 python3 benchmarks/variants.py --ab --ab-only unpack-onevec --rounds 2 \
    > $OUT/ab_unpack_onevec-$1.txt 2>&1
echo "ab rc=$? at ${SECONDS}s"; grep -v Warning $OUT/ab_unpack_onevec-$1.txt
