#!/usr/bin/env bash
# Issue 17 in one device call (nvidia-h200): our Triton kernels against fla and the memory floor.
#
#   carry [".whl", ".whl-triton/triton371-slim.tar.xz"], timeout_s 600, command:
#   bash bench/triton_floor_run.sh
#
# Every part has a time cap, taken from what is left of BUDGET (seconds after the environment is set
# up, default 440: with about 40 s of set-up, 8 minutes), so a hang or a slow compile costs its own part
# and nothing after it. In order:
#   1. nothing timed, in parallel processes (compiling is CPU work): a) fla at the bench shape once (it
#      autotunes into the cache, with nothing heavy beside it on the GPU), ours once, every conv and norm
#      preset compiled; b) tests/triton/test_gpu.py (compiled kernels against float64 at the 4B/9B
#      widths) and the GDN transposes presets compiled
#   2. the conv and norm preset sweep under Triton 3.7.1 (bench/triton_tuning.py --sweep)
#   3. bench/triton_kernels.py, ours vs fla vs the floor, GPU and host ms, Triton 3.7.1
#   4. torch.profiler per-kernel times and bandwidth (bench/triton_profile.py), ours and fla, 3.7.1
#   5. our GDN with the backward's transposes designs (bench/triton_tuning.py --sweep --only transposes), 3.7.1
#   6. Nsight Compute (ncu) of ours and fla, one forward + backward per op, 3.7.1
#   7. under the image's Triton 3.6.0, as long as the budget lasts: the sweep, then the bench (ours)
# Everything lands in $OUT/r/, packed into $OUT/triton_floor.tar.gz after each part (what comes back
# is at most 8 files); $OUT/steps.txt says what each part returned and how long it took.
set -u
: "${OUT:?set OUT to the folder whose files come back}"
BUDGET=${BUDGET:-440}
RESERVE=${RESERVE:-8}  # kept for the last pack
R=$OUT/r
mkdir -p "$R"
START=$SECONDS

GPU_ENV=${GPU_ENV:-bench/gpu_env.sh}  # tests/bench put a stub here
. "$GPU_ENV" > "$R/env.log" 2>&1 || { cat "$R/env.log"; echo "$GPU_ENV failed" | tee "$OUT/steps.txt"; exit 1; }
cat "$R/env.log"
export TRITON_CACHE_AUTOTUNING=1 PYTHONUNBUFFERED=1
P360=$PYTHONPATH
P371=$T371:$PYTHONPATH
T0=$SECONDS
echo "environment ready in $((T0 - START)) s; budget $BUDGET s from here" | tee "$OUT/steps.txt"

PACK=triton_floor.tar.gz
. bench/parts.sh

NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
echo "ncu: ${NCU:-not found}" | tee -a "$OUT/steps.txt"
python -c "import triton, os; print('3.6.0 proton:', os.path.exists(os.path.join(os.path.dirname(triton.__file__), '_C', 'libproton.so')))" \
  | tee -a "$OUT/steps.txt"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,power.draw,temperature.gpu --format=csv >> "$OUT/steps.txt" 2>&1

# 1a. compiling (CPU work, in parallel) while fla autotunes: the processes beside fla's run only small
#     checks and single calls on the GPU, so that its autotuning times its configurations undisturbed
part warm-fla-371 120 env PYTHONPATH=$P371 python bench/triton_kernels.py --arms fla --repeats 1 --warmup 1 \
  --host-calls 5 --csv "$R/warm_fla_371.csv" > "$R/warm_fla_371.log" 2>&1 &
part warm-ours-371 120 env PYTHONPATH=$P371 python bench/triton_kernels.py --arms ours --repeats 1 --warmup 1 \
  --host-calls 5 --csv "$R/warm_ours_371.csv" > "$R/warm_ours_371.log" 2>&1 &
part warm-presets-371 120 env PYTHONPATH=$P371 python bench/triton_tuning.py --sweep --compile-only --only conv,norm \
  --jobs 6 > "$R/warm_presets_371.log" 2>&1 &
wait
# 1b. the GPU correctness tests (compiled kernels against float64 at the 4B/9B widths, both transposes
#     designs, bf16 and fp32) beside the compile of the transposes presets
part gpu-tests-371 120 env PYTHONPATH=$P371 python -P -m pytest -q -s -rs -p no:cacheprovider tests/triton/test_gpu.py \
  tests/bench/test_triton_bench.py::test_the_fla_norm_arm_differentiates_the_weight_it_is_given \
  > "$R/gpu_tests_triton371.txt" 2>&1 &
part warm-transposes-371 120 env PYTHONPATH=$P371 python bench/triton_tuning.py --sweep --only transposes --jobs 1 \
  --repeats 1 > "$R/warm_transposes_371.log" 2>&1 &
wait
pack

# 2. preset sweep, 3.7.1
part sweep-371 90 env PYTHONPATH=$P371 python bench/triton_tuning.py --sweep --only conv,norm --jobs 1 --repeats 20 \
  --csv "$R/sweep_triton371.csv" --tuning "$R/tuning_triton371.json" > "$R/sweep_triton371.txt" 2>&1
pack

# 3. the bench, 3.7.1 (committed defaults: the tuning table)
part bench-371 100 env PYTHONPATH=$P371 python bench/triton_kernels.py --arms ours,fla --repeats 30 \
  --csv "$R/triton_kernels_triton371.csv" > "$R/triton_kernels_triton371.txt" 2>&1
pack

# 4. per-kernel times and bandwidth, 3.7.1
part profile-371 60 env PYTHONPATH=$P371 python bench/triton_profile.py --arms ours,fla \
  --csv "$R/profile_triton371.csv" > "$R/profile_triton371.txt" 2>&1
pack

# 5. the GDN backward's transposes designs (loaded, trans-wy, trans), our GDN fwd+bwd with and without h0
part transposes-371 60 env PYTHONPATH=$P371 python bench/triton_tuning.py --sweep --only transposes --jobs 1 \
  --repeats 20 --tuning "$R/tuning_transposes_triton371.json" > "$R/transposes_triton371.txt" 2>&1
pack

# 6. Nsight Compute, 3.7.1: ours, then fla's GDN
if [ -n "$NCU" ]; then
  NCU_ARGS=(--clock-control none --profile-from-start off --section SpeedOfLight --section LaunchStats
            --section Occupancy --section MemoryWorkloadAnalysis --section WarpStateStats --section ComputeWorkloadAnalysis)
  part ncu-ours-371 100 env PYTHONPATH=$P371 "$NCU" "${NCU_ARGS[@]}" python bench/triton_profile.py --ncu-target \
    --arms ours --ops causal_conv1d,rms_norm_gated,gated_delta_rule > "$R/ncu_ours_triton371.txt" 2>&1
  pack
  part ncu-fla-gdn-371 60 env PYTHONPATH=$P371 "$NCU" "${NCU_ARGS[@]}" python bench/triton_profile.py --ncu-target \
    --arms fla --ops gated_delta_rule > "$R/ncu_fla_gdn_triton371.txt" 2>&1
  pack
fi

# 7. Triton 3.6.0 while the budget lasts (fla's GDN backward refuses 3.6 on Hopper: ours only); the
#    sweep compiles its presets first in 8 processes
part sweep-360 90 env PYTHONPATH=$P360 python bench/triton_tuning.py --sweep --only conv,norm --jobs 8 --repeats 10 \
  --csv "$R/sweep_triton360.csv" --tuning "$R/tuning_triton360.json" > "$R/sweep_triton360.txt" 2>&1
pack
part bench-360 60 env PYTHONPATH=$P360 python bench/triton_kernels.py --arms ours --repeats 20 \
  --csv "$R/triton_kernels_triton360.csv" > "$R/triton_kernels_triton360.txt" 2>&1

save_fla_configs
cp "$OUT/steps.txt" "$R/steps.txt"
echo "done in $((SECONDS - START)) s" | tee -a "$R/steps.txt"
pack && rm -rf "$R"
cd "$OUT" && tar -xzf triton_floor.tar.gz r/steps.txt r/triton_kernels_triton371.txt r/sweep_triton371.txt 2>/dev/null
tar -xzf triton_floor.tar.gz r/transposes_triton371.txt 2>/dev/null
tar -xzf triton_floor.tar.gz r/gpu_tests_triton371.txt 2>/dev/null
grep -h -E "default becomes|^(causal|rms|gated)|transposes|passed|failed|^E " \
  r/sweep_triton371.txt r/triton_kernels_triton371.txt r/transposes_triton371.txt r/gpu_tests_triton371.txt 2>/dev/null \
  | tail -60
rm -rf "$OUT/r"
