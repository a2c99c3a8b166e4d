#!/usr/bin/env bash
# The whole GPU test suite and the benchmarks in one command, for a lent multi-GPU machine:
#   bash scripts/gpu_suite.sh [tests|bench|stress|all, or several: tests,stress] [pytest args: default "tests"]
#   BENCHES="gemm ag_gemm" BENCH_ARGS=--tune bash scripts/gpu_suite.sh bench   (default: every benchmark)
#   NPROC=2 bash scripts/gpu_suite.sh bench   (benchmark ranks; default: every GPU of the machine)
#   TRIDIST_TEST_WORLDS=4,2x2 bash scripts/gpu_suite.sh tests   (test worlds; see tests/harness.py)
#   RANKS_PER_GPU=4 bash scripts/gpu_suite.sh tests   (4 ranks share each GPU, so one GPU runs worlds 2, 2x1,
#     4 and 2x2 with peers: a CUDA MPS daemon is started for the run and quit however it ends; the
#     benchmarks then check results only: see docs/guide/one-gpu.md)
#   STRESS="debug=2:10000 plain=2:3000" STRESS_PLACES="gpus shared" bash scripts/gpu_suite.sh stress
#     (`tridist stress` jobs, MODE=N:C[:S[:F]]: N ranks, C calls of seed S's plan (default 0), from call F
#     (--first-call); MODE debug (TRIDIST_DEBUG=1) or plain (without), no MODE: debug unless STRESS_DEBUG=0.
#     Runs joined by + (4:145:2:144+2:3000:3:1500) are one job, one after the other. Default: those above
#     where the machine has 2 GPUs or more, else 2:1000. Each job runs in every place of STRESS_PLACES:
#     gpus, one rank per GPU (NVLink and copy engines between GPUs; the jobs one after the other), and
#     shared, all of a job's ranks on one GPU through CUDA MPS (a GPU per job, at once where there are
#     enough); default both with 2 GPUs or more, else shared; only shared with RANKS_PER_GPU > 1. All the
#     runs of one call end within STRESS_TIME_LIMIT seconds of the stress phase's start (default 480, for
#     a 10-minute device call), split evenly among the runs that take turns. A run stopped by it fails
#     and says `stopped early: C of N calls`; this script then prints the STRESS and STRESS_PLACES that
#     continue it. The figures go to benchmarks/results, a file per part)
#   STRESS_AT_ONCE=8 STRESS="debug=2:1000:0:0 debug=2:2000:0:1000 ..." bash scripts/gpu_suite.sh stress
#     (the gpus place runs up to 8 jobs at once, job i on the (i mod groups)-th group of N GPUs, so
#     several jobs share each GPU, each with one rank per GPU: a stress run across GPUs spends most
#     of its time compiling a kernel for each call's new sizes on one core, so jobs at once go about
#     as many times faster; 16 at once on 4 GPUs left some jobs idle, 8 is the tried maximum)
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
# The kernels the suite and the stress runs compiled (2026-11-26 on H100s, with and without
# TRIDIST_DEBUG, carried over to the layout of 2026-11-28; then the suite on 4 x H200 at worlds 2,
# 2x1, 4 and 2x2 on 2026-11-28: 2367 distinct entries), so that a bare machine precompiles them on
# every core at once. Refresh it from a returned cache (entries repeat; precompile reads each once):
#   awk '!seen[$0]++' .triton-cache/compile-log.jsonl | gzip -9 > tests/gpu-compile-log.jsonl.gz
# The stress runs' own kernels (seed 0's plans at 2 ranks on 4 x H200, 2026-11-28: about 4,000
# entries beyond the suite's, each call of a plan drawing new sizes) are precompiled only for stress.
gunzip -c tests/gpu-compile-log.jsonl.gz >> "$TRIDIST_COMPILE_LOG"  # precompile reads each entry once
wants stress && gunzip -c tests/gpu-compile-log-stress.jsonl.gz >> "$TRIDIST_COMPILE_LOG"
gpus=$(nvidia-smi -L | wc -l)
[ -n "${CUDA_VISIBLE_DEVICES:-}" ] && gpus=$(tr , '\n' <<< "$CUDA_VISIBLE_DEVICES" | grep -c .)
if [ "$gpus" -ge 2 ]; then stress_jobs=(${STRESS:-debug=2:10000 plain=2:3000}); else stress_jobs=(${STRESS:-2:1000}); fi
if [ "${RANKS_PER_GPU:-1}" != 1 ] || [ "$gpus" -lt 2 ]; then places=${STRESS_PLACES:-shared}
else places=${STRESS_PLACES:-gpus shared}; fi
stress_mode() {  # TRIDIST_DEBUG of a job: debug=... 1, plain=... 0, else STRESS_DEBUG (default 1)
  case $1 in debug=*) echo 1 ;; plain=*) echo 0 ;; *) echo "${STRESS_DEBUG:-1}" ;; esac
}
status=0
if [ -f "$TRIDIST_COMPILE_LOG" ]; then
  # Before MPS starts: the compiling processes need no GPU share. Each mode the run needs, once:
  # the tests' (TRIDIST_DEBUG as set) and the stress jobs'.
  modes=()
  wants tests && modes+=("${TRIDIST_DEBUG:-0}")
  if wants stress; then
    for job in "${stress_jobs[@]}"; do
      mode=$(stress_mode "$job"); [[ " ${modes[*]} " != *" $mode "* ]] && modes+=("$mode")
    done
  fi
  for mode in "${modes[@]}"; do
    TRIDIST_DEBUG=$mode timeout ${PRECOMPILE_TIMEOUT:-240} python -m tridist precompile "$TRIDIST_COMPILE_LOG" 2>&1 \
      | tail -n 20 | tee -a "$OUT/precompile.log"
  done
fi
start_mps() {  # a CUDA MPS daemon for the rest of the run, quit however the run ends
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
  mps_started=1
  # One client first, alone, to start the MPS server. Twice on 2026-11-26 (4 test workers, a GPU
  # each, TRIDIST_DEBUG=1) the first world on GPU 0 lost a rank in NVSHMEM's init (an illegal address
  # in its barrier) and every later world there started; whether a new server was the cause is a guess.
  python -c "import torch; [torch.ones(1, device=i).item() for i in range(torch.cuda.device_count())]" \
    || echo "no CUDA client could start through the MPS daemon"
}
if [ "${RANKS_PER_GPU:-1}" != 1 ]; then
  export TRIDIST_RANKS_PER_GPU=$RANKS_PER_GPU
  start_mps
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
  # One id for this run's benchmarks: ag_gemm and gemm_rs read only the torch_fused JSON of the same run.
  export TRIDIST_BENCH_RUN=${TRIDIST_BENCH_RUN:-$(date -u +%Y%m%dT%H%M%S)-$$}
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
job_gpus() {  # slot job: the GPUs of a job run at once with others, a group of as many as its most ranks
  local most=1 run ranks devices first
  for run in ${2//+/ }; do run=${run#*=}; ranks=${run%%:*}; [ "$ranks" -gt $most ] && most=$ranks; done
  IFS=, read -r -a devices <<< "${CUDA_VISIBLE_DEVICES:-$(seq -s, 0 $((gpus - 1)))}"
  first=$(( ($1 % (gpus / most > 0 ? gpus / most : 1)) * most ))
  local IFS=,; echo "${devices[*]:$first:$most}"
}
stress_job() {  # place index job; place gpus (a rank per GPU) or shared (all of a run's ranks on one GPU)
  local run ranks calls seed first per_gpu left code=0 log=$OUT/stress-$1-$2.log mode stopped
  mode=$(stress_mode "$3")
  for run in ${3//+/ }; do
    run=${run#*=}
    IFS=: read -r ranks calls seed first <<< "$run"
    if [ "$1" = shared ]; then per_gpu=$ranks; else per_gpu=1; fi
    left=$((stress_deadline - SECONDS))
    [ "$left" -gt 0 ] || { echo "no time left for stress run $run" | tee -a "$log"; code=$((code | 5)); continue; }
    echo "== stress $1 $run, TRIDIST_DEBUG=$mode, --time-limit $left" >> "$log"
    # The stress ranks log their compiles too (TRIDIST_COMPILE_LOG), for the next run's precompile.
    TRIDIST_DEBUG=$mode \
      timeout $((left + 150)) python -m tridist stress -n "$ranks" --calls "$calls" \
      --seed "${seed:-0}" --first-call "${first:-0}" --ranks-per-gpu "$per_gpu" \
      --time-limit "$left" --out benchmarks/results > "$log.run" 2>&1
    code=$((code | $?))
    cat "$log.run" >> "$log"
    stopped=$(sed -n 's/^stopped early: \([0-9]*\) of .*/\1/p' "$log.run")
    rm -f "$log.run"
    if [ -n "$stopped" ]; then
      echo "stress $1 $run stopped early; continue it with: STRESS=$([ "$mode" = 1 ] && echo debug || echo plain)=$ranks:$calls:${seed:-0}:$((${first:-0} + stopped)) STRESS_PLACES=$1" \
        | tee -a "$log" "$OUT/stress-continue.txt"
    fi
  done
  return $code
}
if wants stress; then
  rm -f "$OUT/stress-continue.txt"
  at_once=0  # shared jobs run at once, a GPU each, where there are enough
  [ "$gpus" -ge ${#stress_jobs[@]} ] && at_once=1
  turns=0 batch=${STRESS_AT_ONCE:-1}
  for place in $places; do
    if [ "$place" = shared ] && [ $at_once = 1 ]; then turns=$((turns + 1))
    elif [ "$place" = gpus ]; then turns=$((turns + (${#stress_jobs[@]} + batch - 1) / batch))
    else turns=$((turns + ${#stress_jobs[@]})); fi
  done
  per_turn=$((${STRESS_TIME_LIMIT:-480} / (turns > 0 ? turns : 1)))
  for place in $places; do
    case $place in
      gpus)
        if [ "${mps_started:-0}" = 1 ]; then
          echo "stress across GPUs: not while MPS runs (RANKS_PER_GPU > 1, or shared before gpus in STRESS_PLACES)"
          status=2; continue
        fi
        for ((start = 0; start < ${#stress_jobs[@]}; start += batch)); do
          pids=(); stress_deadline=$((SECONDS + per_turn))
          for ((i = start; i < start + batch && i < ${#stress_jobs[@]}; i++)); do
            CUDA_VISIBLE_DEVICES=$(job_gpus $((i - start)) "${stress_jobs[$i]}") \
              stress_job gpus "$i" "${stress_jobs[$i]}" & pids+=($!)
          done
          for pid in "${pids[@]}"; do wait "$pid"; status=$((status | $?)); done
        done ;;
      shared)
        [ "${mps_started:-0}" = 1 ] || start_mps
        if [ $at_once = 1 ]; then
          pids=(); stress_deadline=$((SECONDS + per_turn))
          for i in "${!stress_jobs[@]}"; do
            CUDA_VISIBLE_DEVICES=$i stress_job shared "$i" "${stress_jobs[$i]}" & pids+=($!)
          done
          for pid in "${pids[@]}"; do wait "$pid"; status=$((status | $?)); done
        else
          for i in "${!stress_jobs[@]}"; do
            stress_deadline=$((SECONDS + per_turn)); stress_job shared "$i" "${stress_jobs[$i]}"; status=$((status | $?))
          done
        fi ;;
      *) echo "STRESS_PLACES takes gpus and shared, not $place"; status=2 ;;
    esac
  done
  for log in "$OUT"/stress-*.log; do echo "== $log"; grep -v '^\[rank' "$log" | tail -n 20; done
  [ -f "$OUT/stress-continue.txt" ] && { echo "== stress runs to continue:"; cat "$OUT/stress-continue.txt"; }
  tar czf "$OUT/stress-results.tar.gz" benchmarks/results/stress-*
fi
exit $status
