"""A script without torch that ends in the way its arguments ask. Never imports accelport.

    ends.py raise             an exception two calls deep (exit status 1, its traceback)
    ends.py exit N            sys.exit(N)
    ends.py exit-true         sys.exit(True)
    ends.py exit-text T       sys.exit("T"): T on stderr, status 1
    ends.py interrupt         Ctrl-C (SIGINT to itself) while it works
    ends.py terminate         SIGTERM to itself (a scheduler's kill), then "survived SIGTERM" if it lives on
    ends.py terminate-handled its own SIGTERM handler, which says so and exits with status 7, then SIGTERM
    ends.py fork              forks: the child says so and exits 3, the parent waits for it and ends
    ends.py close-streams     closes its stdout and stderr, and ends normally
    ends.py patch-builtins    replaces open() and print() by functions that raise, and ends normally
    ends.py surrogate         prints a lone surrogate, which a strict stdout cannot encode

The first line on stdout is always "started" and the arguments.
"""

import builtins
import os
import signal
import sys
import time


def inner(value):
    raise RuntimeError(f"the script failed on its own: {value}")


def outer():
    inner(42)


def refuse(*args, **kwargs):
    raise RuntimeError("this script allows no open() and no print()")


def handled(signum, frame):
    print("the script's own SIGTERM handler ran", flush=True)
    sys.exit(7)


print("started", sys.argv[1:], flush=True)
how = sys.argv[1]
if how == "raise":
    outer()
elif how == "exit":
    sys.exit(int(sys.argv[2]))
elif how == "exit-true":
    sys.exit(True)
elif how == "exit-text":
    sys.exit(sys.argv[2])
elif how == "interrupt":
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(30)  # the KeyboardInterrupt arrives here
elif how in ("terminate", "terminate-handled"):
    if how == "terminate-handled":
        signal.signal(signal.SIGTERM, handled)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.2)  # (a handler runs before this; an ignored SIGTERM lets it end)
    print("survived SIGTERM")
elif how == "fork":
    pid = os.fork()
    if pid == 0:
        print("the child ends", flush=True)
        sys.exit(3)
    _, status = os.waitpid(pid, 0)
    print("the child ended with status", os.waitstatus_to_exitcode(status))
elif how == "close-streams":
    sys.stdout.close()
    sys.stderr.close()
elif how == "patch-builtins":
    builtins.open = refuse
    builtins.print = refuse
elif how == "surrogate":
    print("\udcff")
