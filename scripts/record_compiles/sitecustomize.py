"""Put this folder on PYTHONPATH (scripts/gpu_suite.sh does for `tridist stress`) and every Python
process started with TRIDIST_COMPILE_LOG set logs the kernels it compiles, as the test ranks do
(tests/precompile.py): processes that `tridist run` starts too, whose code the tests' hook never
reaches. The next `python -m tests.precompile LOG` compiles them again on every core at once."""
import os
import sys

if os.environ.get("TRIDIST_COMPILE_LOG"):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    from tests.precompile import record

    record(os.environ["TRIDIST_COMPILE_LOG"])
