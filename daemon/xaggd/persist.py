"""Jobs kept across daemon restarts: STATE_DIR/NAME.jobs.json (--state-dir;
the run dir unless given).

Each job is saved as the register request that makes it again (its
parameters, no placement: slots are placed anew) plus its job token's
SHA-256, so its registrant keeps control of it after a restart. The file
holds cookies, so it is 0600 in the state dir (whose owner server.py checks),
written whole to a temporary file and renamed over the old one (a crash
leaves the old list or the new one, never half of either), and never opened
through a symbolic link.
"""
from __future__ import annotations

import json
import logging
import os

log = logging.getLogger("xaggd.persist")

VERSION = 1


class JobStore:
    def __init__(self, path: str):
        self.path = path

    def save(self, records: list[dict]) -> None:
        tmp = f"{self.path}.tmp"
        try:
            os.unlink(tmp)                      # one a crash left behind
        except FileNotFoundError:
            pass
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"version": VERSION, "jobs": records}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)

    def load(self) -> list[dict]:
        """The saved jobs; none when there is no file. A file we cannot use is
        logged and left for the operator (the daemon starts without jobs)."""
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            return []
        except OSError as e:
            log.error("jobs file %s: %s; starting without saved jobs", self.path, e.strerror)
            return []
        with os.fdopen(fd) as f:
            try:
                data = json.load(f)
            except ValueError as e:
                log.error("jobs file %s is not valid JSON (%s); starting without saved jobs", self.path, e)
                return []
        if not isinstance(data, dict) or data.get("version") != VERSION or not isinstance(data.get("jobs"), list):
            log.error("jobs file %s: not a version %d job list; starting without saved jobs", self.path, VERSION)
            return []
        return data["jobs"]
