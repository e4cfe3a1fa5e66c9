#!/bin/bash
# Run 3 of the seventh session (one GPU): the split-LSE forms of the unpack again, three
# interleaved rounds with a 100 µs GPU wait before each timed call (run 1's single round had
# the shipped op at 0.53 for N=2, against 0.87 on the page of the same call: host time in the
# samples); the SASS of run 1's A/B as one archive; the time_cold guard test.
export PYTHONPATH=packages/cp-common/src:packages/cp-dcp/src:packages/cp-pcp/src:packages/cp-testing/src
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
SECONDS=0
timeout 240 python3 benchmarks/unpack_variants.py --family split --rounds 3 --host-guard-us 100 \
    > $OUT/unpack_split_guard.txt 2>&1
echo "split rc=$? at ${SECONDS}s"; grep -v '^check' $OUT/unpack_split_guard.txt | tail -8
grep -c FAIL $OUT/unpack_split_guard.txt
timeout 60 python3 benchmarks/ab_correct_versions.py --sass $OUT/sass --sass-only > $OUT/ab_sass.txt 2>&1
echo "sass rc=$? at ${SECONDS}s"; head -12 $OUT/ab_sass.txt
tar -C $OUT -czf $OUT/sass.tar.gz sass && rm -rf $OUT/sass
timeout 60 bash scripts/gpu_tests.sh -q -rs packages/cp-testing/tests/test_bench.py > $OUT/gpu_tests_bench.txt 2>&1
echo "bench tests rc=$?"; tail -2 $OUT/gpu_tests_bench.txt
