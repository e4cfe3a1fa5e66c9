#!/bin/bash
# Run 2 of the twenty-fifth session, on the two-GPU kind, commit $1: every one-GPU test after
# the device guard (a check in every launcher) and the launch review fixes (no replay while a
# recording runs, in the native module): cp-dcp on GPU 0 and the other packages on GPU 1, in
# two pytest processes; then with both GPUs the files this session changed that have
# multi-GPU or native-module tests (CPGroup's complex reduce_scatter, the device guard, launch
# plans, the gpu_tests script); then the guard's check timed against a plain add_.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
unset CPATTN_LAUNCH_PLANS
SECONDS=0
CUDA_VISIBLE_DEVICES=0 timeout 420 bash scripts/gpu_tests.sh -q -rfE packages/cp-dcp/tests \
    > $OUT/gpu_tests-dcp-$1.txt 2>&1 &
A=$!
CUDA_VISIBLE_DEVICES=1 timeout 420 bash scripts/gpu_tests.sh -q -rfE packages/cp-common/tests \
    packages/cp-pcp/tests packages/cp-testing/tests > $OUT/gpu_tests-rest-$1.txt 2>&1 &
B=$!
wait $A; echo "cp-dcp one-GPU rc=$? at ${SECONDS}s"; tail -n 1 $OUT/gpu_tests-dcp-$1.txt
wait $B; echo "rest one-GPU rc=$? at ${SECONDS}s"; tail -n 1 $OUT/gpu_tests-rest-$1.txt
grep -hE "^(FAILED|ERROR)" $OUT/gpu_tests-*-$1.txt | head -30
timeout $((560 - SECONDS)) bash scripts/gpu_tests.sh -q -rsfE packages/cp-common/tests/test_group.py \
    packages/cp-common/tests/test_device.py packages/cp-common/tests/test_launch_plans.py \
    packages/cp-dcp/tests/ops/test_foreign_device.py packages/cp-dcp/tests/ops/test_launch_plans_ops.py \
    "packages/cp-dcp/tests/direct/test_direct_gpu.py::test_direct_workspaces_run_on_their_device" \
    tests/test_gpu_tests_script.py > $OUT/gpu_tests_x2-$1.txt 2>&1
echo "two-GPU files rc=$? at ${SECONDS}s"; tail -n 1 $OUT/gpu_tests_x2-$1.txt
grep -hE "^(FAILED|ERROR)" $OUT/gpu_tests_x2-$1.txt | head
PYTHONPATH=packages/cp-common/src timeout 60 python3 - > $OUT/guard_cost-$1.txt 2>&1 <<'PY'
import time, torch
from cpattn_common.device import foreign_cuda_device
x = torch.zeros(1024, device="cuda:0")
def per_call_ns(fn, calls=200000):
    for _ in range(1000):
        fn()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls * 1e9)
    torch.cuda.synchronize()
    return best
print(f"foreign_cuda_device(cuda:0 tensor, cuda:0 current): {per_call_ns(lambda: foreign_cuda_device(x)):.0f} ns/call")
print(f"x.is_cuda:                                          {per_call_ns(lambda: x.is_cuda):.0f} ns/call")
print(f"x.add_(1.0):                                        {per_call_ns(lambda: x.add_(1.0), 20000):.0f} ns/call")
PY
echo "guard cost rc=$? at ${SECONDS}s"; cat $OUT/guard_cost-$1.txt
