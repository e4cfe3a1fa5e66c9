#!/bin/bash
# Run 8 of the seventh session (one GPU), commit $1: the page with the unpack's decode-grid
# warps on (_UNPACK_SMALL_GRID_LANES = 2), then the A2A kernel tests on the GPU.
export PYTHONPATH=packages/cp-common/src:packages/cp-dcp/src:packages/cp-pcp/src:packages/cp-testing/src
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
SECONDS=0
timeout 200 python3 benchmarks/run.py --commit "$1" --out $OUT/bench-$1.json --docs-dir $OUT/docs \
    > $OUT/bench-$1.txt 2>&1
echo "page rc=$? at ${SECONDS}s"; grep -E '^\| `a2a_unpack' $OUT/docs/performance.md | head -8
timeout $((330 - SECONDS)) bash scripts/gpu_tests.sh -q -rs packages/cp-dcp/tests/ops/test_a2a_kernels.py \
    packages/cp-dcp/tests/ops/test_a2a_layouts.py packages/cp-dcp/tests/ops/test_cuda_graph.py \
    > $OUT/gpu_tests_a2a-$1.txt 2>&1
echo "tests rc=$? at ${SECONDS}s"; tail -2 $OUT/gpu_tests_a2a-$1.txt
