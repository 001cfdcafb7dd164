"""A file the gateway re-reads when it changes: the API key file and the tenants file, both typically a
Kubernetes Secret that is rotated under a running gateway."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger("stepwire.gateway")

RECHECK_SECONDS = 1.0   # a file is looked at no more often than this


class WatchedFile:
    """`parse(text)` of a file, read again when its stat changes, looked at no more often than every
    RECHECK_SECONDS. The first read raises; a later one that fails (`errors`: mid-rotation, gone, broken) keeps
    what was read before and says so in the log. `changed(value)` is called after each later read that differs."""

    def __init__(self, path: str | Path, parse: Callable, what: str, errors: tuple = (OSError,),
                 changed: Callable = lambda value: None):
        self.path, self.parse, self.what, self.errors, self.changed = Path(path), parse, what, errors, changed
        self._stamp = None
        self._checked = time.monotonic()
        self.value = None
        self._reload()

    def current(self):
        now = time.monotonic()
        if now - self._checked >= RECHECK_SECONDS:
            self._checked = now
            try:
                self._reload()
            except self.errors as e:
                log.warning("cannot use the %s %s now (%s); keeping what was read before", self.what, self.path, e)
        return self.value

    def _reload(self) -> None:
        st = os.stat(self.path)   # follows the symlinks a Kubernetes Secret volume swaps on rotation
        stamp = (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)
        if stamp == self._stamp:
            return
        value = self.parse(self.path.read_text())
        first = self._stamp is None
        self.value, self._stamp = value, stamp
        if not first:
            self.changed(value)
