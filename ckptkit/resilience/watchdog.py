"""A watchdog that turns a hung checkpoint operation into a clear error and a restart.

A rank stuck in a save or a load (a dead peer, a wedged filesystem) cannot be
interrupted from Python while it waits inside a collective. After
``timeout`` seconds the watchdog logs what hung and for how long, dumps every
thread's stack, and exits the process with :data:`EXIT_HUNG` so the launcher
(torchrun ``--max-restarts``, the cluster's requeue) restarts the job, which
then resumes from the newest valid checkpoint.
"""

from __future__ import annotations

import faulthandler
import logging
import math
import os
import sys
import threading
import time
from types import TracebackType

log = logging.getLogger("ckptkit")
EXIT_HUNG = 75


class Watchdog:
    def __init__(self, timeout: float, what: str, exit_code: int = EXIT_HUNG) -> None:
        self.timeout = timeout
        self.what = what
        self.exit_code = exit_code
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def _watch(self) -> None:
        start = time.monotonic()
        if self._done.wait(self.timeout):
            return
        message = (f"ckptkit watchdog: {self.what} made no progress for {time.monotonic() - start:.0f}s; "
                   f"exiting with code {self.exit_code} so the launcher restarts the job")
        log.critical(message)
        print(message, file=sys.stderr, flush=True)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        os._exit(self.exit_code)

    def __enter__(self) -> Watchdog:
        if not math.isfinite(self.timeout):
            return self  # no limit: no thread (Event.wait(inf) raises OverflowError in the thread)
        self._thread = threading.Thread(target=self._watch, name="ckptkit-watchdog", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, exc_type: type | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._done.set()
