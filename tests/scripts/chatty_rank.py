"""A rank without tridist, for the launcher's own tests: prints LINES long lines, alternately on stdout
and stderr, then a last one without its newline; or, with SLEEP_RANK / KILL_RANK, sleeps, or kills
itself with SIGKILL once every rank is up (SLEEP_RANK=all: every rank sleeps). Each rank writes its pid into the folder PIDS, if given."""
import os
import signal
import sys
import time

rank = int(os.environ["RANK"])
pids = os.environ.get("PIDS")
if pids:
    with open(os.path.join(pids, str(rank)), "w") as f:
        f.write(str(os.getpid()))
if os.environ.get("SLEEP_RANK") in (str(rank), "all"):
    time.sleep(600)
if os.environ.get("KILL_RANK") == str(rank):  # once every rank is up, so that each wrote its pid
    while not all(os.path.exists(os.path.join(pids, str(r))) for r in range(int(os.environ["WORLD_SIZE"]))):
        time.sleep(0.01)
    os.kill(os.getpid(), signal.SIGKILL)
for i in range(int(os.environ.get("LINES", "0"))):
    stream = sys.stdout if i % 2 else sys.stderr
    stream.write(f"rank {rank} line {i} " + str(rank) * 5000 + "\n")
sys.stdout.write(f"rank {rank} last words")
sys.stdout.flush()
