#!/bin/bash
# Run 3 of the sixth session, on the two-GPU kind: the collectives against bare NCCL
# (benchmarks/run.py --skip-kernels: references + collectives, world size 2), then the
# end-to-end demo on 2 nccl ranks.
export PYTHONPATH=packages/cp-common/src:packages/cp-dcp/src:packages/cp-pcp/src:packages/cp-testing/src
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
timeout 360 python3 benchmarks/run.py --skip-kernels --commit "$1" --out $OUT/coll-x2.json \
    --docs-dir $OUT/docs > $OUT/coll-x2.txt 2>&1
echo "collectives rc=$?"; tail -30 $OUT/coll-x2.txt
timeout 180 python3 -m cpattn_testing.demo --backend nccl --world-size 2 > $OUT/demo-x2.txt 2>&1
echo "demo rc=$?"; tail -25 $OUT/demo-x2.txt
timeout 120 bash scripts/gpu_tests.sh -q -rs packages/cp-testing/tests/test_launcher.py > $OUT/gpu_tests_launcher_x2.txt 2>&1
echo "launcher tests rc=$?"; tail -4 $OUT/gpu_tests_launcher_x2.txt
