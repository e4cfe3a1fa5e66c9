#!/bin/bash
# Run 7 of the twenty-first session (one GPU), commit $1: as run 6 at N = 5, 6, 7 (H_r = 8,
# D=128 and 256, B=4096): the new unpack kernel with _UNPACK_ONE_VECTOR_MIN_N = 0 / 8 / 5
# against the kernel before it (benchmarks/_ab_ref/a2a.py, carried), to pick the default.
export PYTHONPATH=packages/cp-common/src:packages/cp-dcp/src:packages/cp-pcp/src:packages/cp-testing/src
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
SECONDS=0
timeout 300 python3 benchmarks/unpack_asm.py --ref-kernel benchmarks/_ab_ref/a2a.py --rounds 3 \
    --shapes 5,8,128 6,8,128 7,8,128 6,8,256 --only '^op|^ref kernel$' \
    > $OUT/unpack_ab_n567-$1.txt 2>&1
echo "n567 rc=$? at ${SECONDS}s"; grep -v Warning $OUT/unpack_ab_n567-$1.txt | grep -v "^check ok"
