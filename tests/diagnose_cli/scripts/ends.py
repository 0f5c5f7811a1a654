"""A script without torch that ends in the way its arguments ask. Never imports accelport.

    ends.py raise          an exception two calls deep (exit status 1, its traceback)
    ends.py exit N         sys.exit(N)
    ends.py exit-text T    sys.exit("T"): T on stderr, status 1
    ends.py interrupt      Ctrl-C (SIGINT to itself) while it works
"""

import os
import signal
import sys
import time


def inner(value):
    raise RuntimeError(f"the script failed on its own: {value}")


def outer():
    inner(42)


print("started", sys.argv[1:])
how = sys.argv[1]
if how == "raise":
    outer()
elif how == "exit":
    sys.exit(int(sys.argv[2]))
elif how == "exit-text":
    sys.exit(sys.argv[2])
elif how == "interrupt":
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(30)  # the KeyboardInterrupt arrives here
