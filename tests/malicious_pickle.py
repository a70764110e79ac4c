"""What a malicious checkpoint holds: an object whose unpickling runs a shell command (``touch marker``).

The allow-list unpicklers must refuse it before it runs; a test checks that the marker file was never made.
"""

from __future__ import annotations

import os


class RunsOnLoad:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):  # a call to run on load
        return (os.system, (f"touch {self.marker}",))
