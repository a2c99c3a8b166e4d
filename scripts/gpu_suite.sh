#!/usr/bin/env bash
# The whole GPU test suite and the benchmarks in one command, for a lent multi-GPU machine:
#   bash scripts/gpu_suite.sh [tests|bench|stress|all, or several: tests,stress] [pytest args: default "tests"]
#   BENCHES="gemm ag_gemm" BENCH_ARGS=--tune bash scripts/gpu_suite.sh bench   (default: every benchmark)
#   NPROC=2 bash scripts/gpu_suite.sh bench   (benchmark ranks; default: every GPU of the machine)
#   TRIDIST_TEST_WORLDS=4,2x2 bash scripts/gpu_suite.sh tests   (test worlds; see tests/harness.py)
#   RANKS_PER_GPU=4 bash scripts/gpu_suite.sh tests   (4 ranks share each GPU, so one GPU runs worlds 2, 2x1,
#     4 and 2x2 with peers: a CUDA MPS daemon is started for the run and quit however it ends; the
#     benchmarks then check results only: see docs/guide/one-gpu.md)
#   STRESS="2:10000 4:2000" bash scripts/gpu_suite.sh stress   (`tridist stress` runs of N ranks and C calls,
#     N:C:S with a seed other than 0, N:C:S:F for calls F to C - 1 of the seed's plan (--first-call),
#     with TRIDIST_DEBUG=1 unless STRESS_DEBUG=0, each job stopped after STRESS_TIME_LIMIT seconds (default
#     400); their figures go to benchmarks/results. With RANKS_PER_GPU > 1 and a GPU for each job, the
#     jobs run at once, job i on GPU i with all its ranks; else one after the other. Runs joined by +
#     (4:145:2:144+2:3000:3:1500) are one job: one after the other on its GPU)
#   PARALLEL=4 RANKS_PER_GPU=4 bash scripts/gpu_suite.sh tests   (4 pytest-xdist workers, each with a GPU
#     of its own whose ranks share it: the suite with peers on 4 GPUs at once, 4 kernels compiling at a time)
# torch_fused (PyTorch's fused ops, in processes without tridist) runs first whenever ag_gemm or
# gemm_rs is asked for: they read its JSON for their "torch fused us" column.
# Runs from the repository without installing it (that machine has no network; its image has
# torch, triton and the NVSHMEM wheel). Logs and results are written to $OUT (default out/: a dozen
# files; under the device tool, which returns at most 8, give it another folder and copy back what
# is needed). Kernels with NVSHMEM linked take seconds each to compile: the test and stress ranks log
# each kernel they compile (TRIDIST_COMPILE_LOG=.triton-cache/compile-log.jsonl), and a run first
# compiles the logged kernels on every core at once (`tridist precompile`), so that they do not compile
# one by one in the middle of the tests.
set -uo pipefail
cd "$(dirname "$0")/.."
what=${1:-all}; shift || true
wants() { [ "$what" = all ] || [[ ",$what," == *",$1,"* ]]; }
OUT=${OUT:-out}
mkdir -p "$OUT" benchmarks/results
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
# NVLink multicast must stay off on the lent machines even if Python fails before tridist sets it:
# the same values as SAFE_ENVIRONMENT in tridist/runtime/nvshmem.py (tests/test_bench.py checks).
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export TRITON_CACHE_DIR=$PWD/.triton-cache
mkdir -p .triton-cache
export TRIDIST_COMPILE_LOG=$PWD/.triton-cache/compile-log.jsonl
# The kernels the suite and the stress runs compiled on 2026-11-26 (one H100 and 4 x H100, worlds 2
# to 2x2, with and without TRIDIST_DEBUG), so that a bare machine precompiles them on every core at
# once. Refresh it from a returned cache (entries repeat in a log; precompile reads each once):
#   gzip -9 -c .triton-cache/compile-log.jsonl > tests/gpu-compile-log.jsonl.gz
gunzip -c tests/gpu-compile-log.jsonl.gz >> "$TRIDIST_COMPILE_LOG"  # precompile reads each entry once
status=0
if [ -f "$TRIDIST_COMPILE_LOG" ]; then
  # Before MPS starts: the compiling processes need no GPU share. Each mode the run needs, once:
  # the tests' (TRIDIST_DEBUG as set) and the stress runs' (TRIDIST_DEBUG=STRESS_DEBUG).
  modes=()
  wants tests && modes+=("${TRIDIST_DEBUG:-0}")
  wants stress && [[ " ${modes[*]} " != *" ${STRESS_DEBUG:-1} "* ]] && modes+=("${STRESS_DEBUG:-1}")
  for mode in "${modes[@]}"; do
    TRIDIST_DEBUG=$mode timeout ${PRECOMPILE_TIMEOUT:-240} python -m tridist precompile "$TRIDIST_COMPILE_LOG" 2>&1 \
      | tail -n 20 | tee -a "$OUT/precompile.log"
  done
fi
gpus=$(nvidia-smi -L | wc -l)
[ -n "${CUDA_VISIBLE_DEVICES:-}" ] && gpus=$(tr , '\n' <<< "$CUDA_VISIBLE_DEVICES" | grep -c .)
if [ "${RANKS_PER_GPU:-1}" != 1 ]; then
  export TRIDIST_RANKS_PER_GPU=$RANKS_PER_GPU
  mps=$(mktemp -d /tmp/tridist-mps-XXXXXX)
  export CUDA_MPS_PIPE_DIRECTORY=$mps/pipe CUDA_MPS_LOG_DIRECTORY=$mps/log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  quit_mps() {
    echo quit | timeout 30 nvidia-cuda-mps-control || echo "the MPS control daemon in $CUDA_MPS_PIPE_DIRECTORY did not quit"
    cp -r "$CUDA_MPS_LOG_DIRECTORY" "$OUT/mps-log" 2>/dev/null
    rm -rf "$mps"
  }
  trap quit_mps EXIT
  trap 'exit 130' INT; trap 'exit 143' TERM; trap 'exit 129' HUP  # through the EXIT trap
  nvidia-cuda-mps-control -d || { echo "could not start the MPS control daemon"; exit 1; }
  # One client first, alone, to start the MPS server. Twice on 2026-11-26 (4 test workers, a GPU
  # each, TRIDIST_DEBUG=1) the first world on GPU 0 lost a rank in NVSHMEM's init (an illegal address
  # in its barrier) and every later world there started; whether a new server was the cause is a guess.
  python -c "import torch; [torch.ones(1, device=i).item() for i in range(torch.cuda.device_count())]" \
    || echo "no CUDA client could start through the MPS daemon"
fi
nproc=${NPROC:-$((gpus * ${RANKS_PER_GPU:-1}))}
python -m tridist info 2>&1 | tee "$OUT/info.txt"
nvidia-smi topo -m 2>&1 | tee -a "$OUT/info.txt"
if wants tests; then
  targets=("$@"); [ ${#targets[@]} -eq 0 ] && targets=(tests)
  # -v: when the call's time runs out, the log still says which tests passed, and each one's time
  # (2026-11-26: three phases ran out inside one test, slow or hung, not known)
  parallel=()
  if [ "${PARALLEL:-1}" != 1 ]; then  # a GPU per worker (tests/harness.py, pin_worker_gpu)
    [ "${RANKS_PER_GPU:-1}" = 1 ] && { echo "PARALLEL needs RANKS_PER_GPU > 1: each worker has one GPU"; exit 2; }
    parallel=(-p xdist -n "$PARALLEL" --dist load)
    # A client of MPS counts the GPUs its daemon sees (started above with this environment): 0, 1, ...
    export CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((gpus - 1)))
  fi
  # With ranks sharing GPUs, test_launcher.py runs alone afterwards: its jobs kill ranks and trap
  # kernels on purpose, and a fault in one MPS client ends every client of that GPU (2026-11-26: the
  # test workers' ranks on the same GPU died with it).
  alone=() ignored=()
  if [ "${RANKS_PER_GPU:-1}" != 1 ]; then
    ignored=(--ignore=tests/test_launcher.py)
    [[ " ${targets[*]} " == *" tests "* || " ${targets[*]} " == *test_launcher* ]] && alone=(tests/test_launcher.py)
    kept=(); for t in "${targets[@]}"; do [[ $t == *test_launcher* ]] || kept+=("$t"); done; targets=("${kept[@]}")
  fi
  if [ ${#targets[@]} -gt 0 ]; then
    # SIGINT first: pytest then still prints the failures' tracebacks, which a kill loses.
    timeout -s INT -k 30 ${TESTS_TIMEOUT:-330} python -m pytest -v -o console_output_style=times \
      --ignore=tests/test_gpu_compile.py "${ignored[@]}" "${parallel[@]}" "${targets[@]}" 2>&1 \
      | tee "$OUT/tests.log"
    status=$((status | ${PIPESTATUS[0]}))
  fi
  if [ ${#alone[@]} -gt 0 ]; then
    CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0} timeout -s INT -k 30 ${LAUNCHER_TIMEOUT:-150} \
      python -m pytest -v "${alone[@]}" 2>&1 | tee -a "$OUT/tests.log"
    status=$((status | ${PIPESTATUS[0]}))
  fi
fi
if wants bench; then
  benches=" ${BENCHES:-torch_fused primitives allgather reducescatter allreduce gemm ag_gemm gemm_rs gemm_ar} "
  if [[ $benches == *" ag_gemm "* || $benches == *" gemm_rs "* || $benches == *" torch_fused "* ]]; then
    benches="torch_fused ${benches// torch_fused / }"
  fi
  for bench in $benches; do
    # torch_fused measures the ag_gemm/gemm_rs default shapes and takes none of BENCH_ARGS (e.g. --tune)
    args=${BENCH_ARGS:-}; [ "$bench" = torch_fused ] && args=
    timeout ${BENCH_TIMEOUT:-240} python -m tridist bench $bench -n $nproc --out benchmarks/results $args 2>&1 | tee -a "$OUT/bench.log"
    status=$((status | ${PIPESTATUS[0]}))
  done
  tar czf "$OUT/results.tar.gz" benchmarks/results
fi
stress_job() {  # index ranks:calls[:seed[:first]][+ranks:calls...] [one-gpu: all of a run's ranks on one GPU]
  local run ranks calls seed first per_gpu left code=0 deadline=$((SECONDS + ${STRESS_TIME_LIMIT:-400}))
  for run in ${2//+/ }; do
    IFS=: read -r ranks calls seed first <<< "$run"
    if [ "${3:-}" = one-gpu ]; then per_gpu=$ranks
    elif [ "${RANKS_PER_GPU:-1}" = 1 ]; then per_gpu=1
    else per_gpu=$(( (ranks + gpus - 1) / gpus ))  # sharing: as many ranks per GPU as the run needs
    fi
    left=$((deadline - SECONDS))
    [ "$left" -gt 0 ] || { echo "no time left for stress run $run" >> "$OUT/stress-$1.log"; break; }
    # The stress ranks log their compiles too (TRIDIST_COMPILE_LOG), for the next run's precompile.
    TRIDIST_DEBUG=${STRESS_DEBUG:-1} \
      timeout $((left + 150)) python -m tridist stress -n "$ranks" --calls "$calls" \
      --seed "${seed:-0}" --first-call "${first:-0}" --ranks-per-gpu "$per_gpu" \
      --time-limit "$left" --out benchmarks/results >> "$OUT/stress-$1.log" 2>&1
    code=$((code | $?))
  done
  return $code
}
if wants stress; then
  stress_jobs=(${STRESS:-2:1000})
  if [ "${RANKS_PER_GPU:-1}" != 1 ] && [ "$gpus" -ge ${#stress_jobs[@]} ]; then
    # A GPU for each job, all of its ranks sharing it, the jobs at once (never two on one GPU).
    pids=()
    for i in "${!stress_jobs[@]}"; do
      job=${stress_jobs[$i]}
      CUDA_VISIBLE_DEVICES=$i stress_job "$i" "$job" one-gpu & pids+=($!)
    done
    for pid in "${pids[@]}"; do wait "$pid"; status=$((status | $?)); done
  else
    for i in "${!stress_jobs[@]}"; do stress_job "$i" "${stress_jobs[$i]}"; status=$((status | $?)); done
  fi
  for i in "${!stress_jobs[@]}"; do grep -v '^\[rank' "$OUT/stress-$i.log" | tail -n 20; done
  tar czf "$OUT/stress-results.tar.gz" benchmarks/results/stress-*
fi
exit $status
