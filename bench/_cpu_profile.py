"""Run ``rollout-gateway`` (its argv follows) under cProfile on the main thread's CPU clock
(``time.thread_time``): SIGUSR2 starts profiling (once the gateway is up: start-up is not
the request path), SIGUSR1 writes the stats to ``$GATEWAY_CPROFILE`` and exits.

py-spy samples a thread it finds running; a thread preempted inside a socket write (which
wakes the engine or the client on a 2-core machine) still counts, so its shares overstate
the calls that wake another process. This clock counts only the gateway's own CPU.
Used by ``profile_gateway.py --profiler cprofile``."""

from __future__ import annotations

import cProfile
import os
import signal
import sys
import time


def main() -> None:
    prof = cProfile.Profile(timer=time.thread_time)

    def stop(*_: object) -> None:
        prof.disable()
        prof.dump_stats(os.environ["GATEWAY_CPROFILE"])
        os._exit(0)

    signal.signal(signal.SIGUSR1, stop)  # the gateway keeps SIGTERM for its drain
    signal.signal(signal.SIGUSR2, lambda *_: prof.enable())
    sys.argv = ["rollout-gateway", *sys.argv[1:]]
    from rollout_gateway.cli import main as gateway_main

    try:
        gateway_main()
    finally:
        stop()


if __name__ == "__main__":
    main()
