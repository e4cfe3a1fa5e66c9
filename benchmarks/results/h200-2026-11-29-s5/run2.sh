#!/bin/bash
# Run 2 of the fifth session: unpack cache-modifier forms, the page (bench; host rows now
# alternate with add_), the cp-testing GPU tests. $1: the commit stamped on the page.
export PYTHONPATH=packages/cp-common/src:packages/cp-dcp/src:packages/cp-pcp/src:packages/cp-testing/src
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
uptime
timeout 200 python3 benchmarks/unpack_variants.py --family cache > $OUT/unpack_cache.txt 2>&1
echo "unpack rc=$?"; grep -v "^check" $OUT/unpack_cache.txt; grep -c FAIL $OUT/unpack_cache.txt
timeout 240 python3 benchmarks/run.py --commit "$1" --out $OUT/bench-h200.json --docs-dir $OUT/docs > $OUT/bench.txt 2>&1
echo "bench rc=$?"; tail -25 $OUT/bench.txt
timeout 120 bash scripts/gpu_tests.sh -q -rs packages/cp-testing/tests packages/cp-common/tests/test_launch.py > $OUT/gpu_tests.txt 2>&1
echo "gpu tests rc=$?"; tail -5 $OUT/gpu_tests.txt
