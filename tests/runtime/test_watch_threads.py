"""A watcher in a process that runs several training loops, one per thread (torch_xla's launchers with several
devices per process): the threads a worker names as running another loop leave the watched loop's count alone."""

from __future__ import annotations

import threading

from accelport.runtime.watch import Watcher


def test_a_further_device_threads_syncs_are_not_the_watched_loops() -> None:
    others: set[int] = set()
    watcher = Watcher(environ={}, other_loops=others)
    watcher._active = True  # as install() leaves it (no module of torch_xla is needed for the wrapper itself)
    inside, release = threading.Event(), threading.Event()

    def device_sync() -> None:  # stands for torch_xla.sync: blocks while the device runs the step
        if threading.get_ident() in others:
            inside.set()
            release.wait(10)

    sync = watcher._sync_wrapper(device_sync)

    def other_loop() -> None:
        others.add(threading.get_ident())  # as WatchedWorker names a further device thread before it runs
        sync()

    thread = threading.Thread(target=other_loop)
    thread.start()
    assert inside.wait(10)
    sync()  # the watched loop's own sync, while the other thread's is still running
    # Counted as it ends: not taken for a sync nested in the other thread's, which ends later.
    counted = watcher.syncs
    release.set()
    thread.join(10)
    assert counted == 1 and watcher.syncs == 1 and watcher._sync_depth == 0
