#!/usr/bin/env bash
# throwaway driver for this session's device call (not committed)
OP_TIMING=0 GTEST_FILTER='CrossEntropy*:Modes/ModelParity*:Modes/GpuTraining*' bash tools/gpu_check.sh > $OUT/gc.txt 2>&1
grep -E "tests ran|PASSED|FAILED|built in" $OUT/gc.txt | head
export LD_LIBRARY_PATH=/tmp/mhar-icu/lib:$LD_LIBRARY_PATH
grep -E "cross_entropy.*v2|FAIL" $OUT/cuda_tests.log | head -40
build-gpu/mhar_cuda_tests --gtest_also_run_disabled_tests --gtest_filter='KernelBandwidth.DISABLED_CrossEntropyVersions' > $OUT/ce.txt 2>&1
grep -E "copy|cross_entropy|OK|FAIL" $OUT/ce.txt | head -20
