#!/usr/bin/env bash
# throwaway device driver (session 24, call 1)
R=$PWD
OP_TIMING=0 GTEST_FILTER='KernelVersionsEnv*:RoutingParity*' bash tools/gpu_check.sh > $OUT/check.txt 2>&1
tail -25 $OUT/check.txt
export LD_LIBRARY_PATH=/tmp/mhar-icu/lib:$LD_LIBRARY_PATH
stdbuf -oL timeout 300 build-gpu/mhar_cuda_tests --gtest_also_run_disabled_tests --gtest_filter='OpTiming.DISABLED_RoutingBackwardVersions' > $OUT/lab.txt 2>&1
echo "lab rc=$?"
grep TIMING $OUT/lab.txt
