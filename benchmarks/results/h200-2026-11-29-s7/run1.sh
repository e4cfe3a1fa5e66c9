#!/bin/bash
# Run 1 of the seventh session (one GPU), commit $1: the page; correct_attn_out's lean kernel
# at f362a8e^ and fc6b3a7 against the working tree (benchmarks/_ab_ref carried) with the SASS
# of each; the split-LSE form of the unpack (unpack_variants.py --family split); the op tests.
export PYTHONPATH=packages/cp-common/src:packages/cp-dcp/src:packages/cp-pcp/src:packages/cp-testing/src
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv > $OUT/gpu.txt
SECONDS=0
timeout 170 python3 benchmarks/run.py --commit "$1" --out $OUT/bench-$1.json --docs-dir $OUT/docs \
    > $OUT/bench-$1.txt 2>&1
echo "page rc=$? at ${SECONDS}s"; grep -E 'correct_attn_out|unpack' $OUT/docs/performance.md | grep -E 'met' | head -12
timeout 120 python3 benchmarks/ab_correct_versions.py --sass $OUT/sass > $OUT/ab_correct_versions.txt 2>&1
echo "ab rc=$? at ${SECONDS}s"; cat $OUT/ab_correct_versions.txt | tail -40
timeout 130 python3 benchmarks/unpack_variants.py --family split > $OUT/unpack_split.txt 2>&1
echo "split rc=$? at ${SECONDS}s"; grep -v '^check' $OUT/unpack_split.txt | tail -8; grep -c FAIL $OUT/unpack_split.txt
timeout $((585 - SECONDS)) bash scripts/gpu_tests.sh -q -rs \
    packages/cp-dcp/tests/ops/test_correct_attn_out.py packages/cp-dcp/tests/ops/test_large_offsets.py \
    packages/cp-dcp/tests/ops/test_properties.py packages/cp-dcp/tests/ops/test_cuda_graph.py \
    packages/cp-dcp/tests/ops/test_a2a_kernels.py > $OUT/gpu_tests_ops.txt 2>&1
echo "tests rc=$? at ${SECONDS}s"; tail -3 $OUT/gpu_tests_ops.txt
