"""sd_notify(3) with the standard library: one datagram to $NOTIFY_SOCKET.

Under ``Type=notify`` (daemon/xaggd.service) systemd counts xaggd as started
only at READY=1, which the server sends once the program is compiled and
attached and every control socket answers, so ``systemctl start`` returns
when clients can register and units ordered after xaggd find it serving.
Without $NOTIFY_SOCKET (started by hand, in a lab) nothing is sent.
"""
from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger("xaggd")


def notify(state: str) -> bool:
    """Send ``state`` ("READY=1", "STOPPING=1", "STATUS=...") to the service
    manager; whether it was sent. A failure is logged, never raised: the
    daemon serves all the same."""
    path = os.environ.get("NOTIFY_SOCKET")
    if not path:
        return False
    if path[0] == "@":                       # an abstract socket
        path = "\0" + path[1:]
    elif not path.startswith("/"):
        log.warning("NOTIFY_SOCKET=%r is neither a path nor an abstract socket: not notifying", path)
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.sendto(state.encode(), path)
    except OSError as e:
        log.warning("notifying the service manager (%s): %s", state.split("=", 1)[0], e)
        return False
    return True
