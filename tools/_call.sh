set -x
OP_TIMING=0 GTEST_FILTER='RoutingParity.*' bash tools/gpu_check.sh > $OUT/check.log 2>&1; tail -5 $OUT/check.log
export LD_LIBRARY_PATH=/tmp/mhar-icu/lib:$LD_LIBRARY_PATH
T="build-gpu/mhar_cuda_tests --gtest_also_run_disabled_tests --gtest_filter=OpTiming.DISABLED_DeltaRouting1B"
MHAR_OP_TIMING_REPS=10 timeout 120 $T | grep TIMING
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
echo "ncu: $NCU"
MHAR_OP_TIMING_REPS=1 timeout 300 $NCU --clock-control none --metrics gpu__time_duration.sum --csv $T > $OUT/ncu.csv 2> $OUT/ncu.err
echo "ncu rc $?"; wc -l $OUT/ncu.csv; tail -3 $OUT/ncu.err
rm -f $OUT/*.log.tmp
