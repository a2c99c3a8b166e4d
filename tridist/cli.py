"""The `tridist` command: `run`, `precompile`, `info`, `bench` and `stress`."""
import argparse
import os
import sys


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:
        # `bench` reads its own arguments (`tridist bench -h` included): argparse's REMAINDER would
        # refuse any that start with a dash before the benchmark's name.
        from .bench.cli import main as bench_main

        return bench_main(argv[1:])
    parser = argparse.ArgumentParser(prog="tridist",
                                     description="Distributed Triton kernels on GPUs or the CPU emulator")
    commands = parser.add_subparsers(dest="command", required=True)

    run = commands.add_parser("run", help="start N ranks of a Python script")
    run.add_argument("-n", "--nproc", type=int, required=True, help="number of ranks")
    run.add_argument("--nnodes", type=int, default=None, help="split the ranks into this many virtual nodes")
    run.add_argument("--backend", choices=["nvshmem", "emulator"], default=None,
                     help="default: nvshmem where CUDA GPUs are present, emulator elsewhere")
    run.add_argument("--ranks-per-gpu", type=int, default=None, metavar="K",
                     help="K ranks share each GPU (default TRIDIST_RANKS_PER_GPU, else 1), each with 100/K %% of "
                          "the SMs, through CUDA MPS: to check and debug multi-rank code on fewer GPUs, not to "
                          "measure speed; the emulator accepts it and changes nothing")
    run.add_argument("--start-mps", action="store_true",
                     help="with --ranks-per-gpu: start a CUDA MPS control daemon for this job if none answers, "
                          "and quit it when the job ends (ignored by the emulator)")
    run.add_argument("--no-prefix", action="store_true",
                     help="let the ranks write to the terminal directly, without the '[rank N] ' in front of "
                          "each line")
    run.add_argument("-m", "--module", action="store_true",
                     help="run a module of the Python path, as `python -m`: tridist run -n 2 -m package.module [args]")
    run.add_argument("--record-compiles", metavar="FILE", default=None,
                     help="on GPUs, every rank logs each kernel it compiles to FILE (TRIDIST_COMPILE_LOG), for "
                          "`tridist precompile FILE`")
    run.add_argument("script", nargs=argparse.REMAINDER, help="script.py [args], or with -m: module [args]")

    precompile = commands.add_parser(
        "precompile", help="compile on every core the GPU kernels a recorded job compiled",
        description="Compiles into Triton's cache, a process per core, the kernels that jobs logged to LOG "
                    "(tridist run --record-compiles LOG, or TRIDIST_COMPILE_LOG=LOG), in this process's "
                    "TRIDIST_DEBUG and TRIDIST_WAIT_TIMEOUT: the next runs find them there.")
    precompile.add_argument("log", metavar="LOG", help="the compile log")
    precompile.add_argument("-j", "--jobs", type=int, default=None, help="processes (default: one per core)")

    commands.add_parser("info", help="backend, devices, peer access, NVSHMEM device library, CUDA MPS and GPU "
                                     "sharing, versions")

    commands.add_parser("bench", help="benchmarks (see `tridist bench -h`)")  # listed here, parsed above

    from . import stress

    stress.add_arguments(commands.add_parser(
        "stress", help="a seeded random sequence of calls of every op, every result checked, hangs caught",
        description=stress.description(), formatter_class=argparse.RawDescriptionHelpFormatter))

    args = parser.parse_args(argv)
    if args.command == "run":
        if args.record_compiles:
            os.environ["TRIDIST_COMPILE_LOG"] = os.path.abspath(args.record_compiles)
        if not args.script:
            parser.error("tridist run needs a script: tridist run -n 2 script.py [args], or -m package.module [args]")
        from .runtime.launcher import run as launch

        return launch(args.nproc, args.script, nnodes=args.nnodes, backend=args.backend,
                      ranks_per_gpu=args.ranks_per_gpu, start_mps=args.start_mps, prefix=not args.no_prefix,
                      module=args.module)
    if args.command == "stress":
        return stress.main(args)
    if args.command == "precompile":
        return _precompile(args.log, args.jobs)
    from .runtime.info import report

    print(report())
    return 0


def _precompile(log: str, jobs: int | None) -> int:
    import time

    from .runtime import backend, compiles

    if backend.is_emulator():
        print("tridist precompile: compiles for GPUs, and this process runs the emulator (no CUDA GPU, or "
              "TRIDIST_BACKEND=emulator); the emulator compiles nothing", file=sys.stderr)
        return 2
    if not os.path.exists(log):
        print(f"tridist precompile: no compile log {log}; record one with tridist run --record-compiles {log}",
              file=sys.stderr)
        return 2
    started = time.monotonic()
    compiled, failures = compiles.precompile(log, jobs)
    for failure in failures:
        print(f"dropped {failure}")
    print(f"precompiled {compiled} kernel specialisations on {jobs or os.cpu_count()} processes in "
          f"{time.monotonic() - started:.0f} s ({compiles.mode()}; {len(failures)} dropped)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
