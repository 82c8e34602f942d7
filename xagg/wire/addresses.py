"""Addresses as people write them, "HOST:PORT": one reading for every door
(an aggregator's data address, a control endpoint, a listen address).

``split_host_port`` only splits; each caller then says what the host must
be (resolved, an IP address, anything) and words its own error.
"""
from __future__ import annotations

import socket

from xagg.wire.proto import C


def split_host_port(text, *, default_host: str | None = None,
                    default_port: int | None = None) -> tuple[str, int]:
    """(host, port) of "HOST:PORT" or "[v6]:PORT"; "HOST" alone takes
    ``default_port`` and ":PORT" or "PORT" alone ``default_host``.
    ValueError when a part is missing without a default, or the port is not
    0..65535."""
    s = str(text).strip()
    host, sep, port = s.rpartition(":")
    if not sep:
        host, port = ("", s) if s.isdigit() else (s, "")
    host = host.strip("[]") or default_host
    if not port and default_port is not None:
        port = str(default_port)
    if not host or not port.isdigit():
        raise ValueError(f"{text!r}: expected HOST:PORT")
    if not 0 <= int(port) < 65536:
        raise ValueError(f"{text!r}: port {port} is not 0..65535")
    return host, int(port)


def parse_addr(s: str, default_port: int = C.XAGG_PORT) -> tuple[str, int]:
    """An aggregator's data address, "HOST[:PORT]", as (IPv4, port); ValueError
    with a message that shows the expected form."""
    try:
        host, port = split_host_port(s, default_port=default_port)
    except ValueError as e:     # says which part is wrong: the form, or the port's range
        raise ValueError(f"bad aggregator address {e}") from None
    try:
        return socket.gethostbyname(host), port
    except (socket.gaierror, UnicodeError):
        raise ValueError(f"bad aggregator address {s!r}: host {host!r} does not resolve") from None
