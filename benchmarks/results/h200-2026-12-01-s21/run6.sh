#!/bin/bash
# Run 6 of the twenty-first session (one GPU), commit $1: the unpack kernel computing each
# weight just before its source's sum (this commit) against the kernel before it
# (benchmarks/_ab_ref/a2a.py = `git show 22189e8:packages/cp-dcp/src/cpattn_dcp/kernels/a2a.py`,
# carried), both with and without _UNPACK_ONE_VECTOR_MIN_N = 8, through the op's own plans,
# in benchmarks/unpack_asm.py's harness; B=4096 bf16, H=64 D=128 / 256, H=128 D=512.
export PYTHONPATH=packages/cp-common/src:packages/cp-dcp/src:packages/cp-pcp/src:packages/cp-testing/src
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
SECONDS=0
timeout 240 python3 benchmarks/unpack_asm.py --ref-kernel benchmarks/_ab_ref/a2a.py --rounds 5 \
    --shapes 8,8,128 4,16,128 2,32,128 --only '^op|^ref|^triton r8 w4( eager-w)?$' \
    > $OUT/unpack_ab_d128-$1.txt 2>&1
echo "d128 rc=$? at ${SECONDS}s"; grep -v Warning $OUT/unpack_ab_d128-$1.txt | grep -v "^check ok"
timeout 300 python3 benchmarks/unpack_asm.py --ref-kernel benchmarks/_ab_ref/a2a.py --rounds 3 \
    --shapes 8,8,256 4,16,256 2,32,256 8,16,512 4,32,512 2,64,512 --only '^op|^ref' \
    > $OUT/unpack_ab_d256_d512-$1.txt 2>&1
echo "d256/512 rc=$? at ${SECONDS}s"; grep -v Warning $OUT/unpack_ab_d256_d512-$1.txt | grep -v "^check ok"
