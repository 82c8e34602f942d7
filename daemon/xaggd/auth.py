"""Who may do what on the control API.

Three credentials (README, "Control API and credentials"):

    admin token   (token_file)         every op on every job, cookies included
    client token  (client_token_file)  register new jobs; status, stats, list
                                       (without cookies); a job's other ops only
                                       with that job's token
    job token     (one per job)        given back to the registrant in the
                                       register answer; lets its holder
                                       re-register, replace, resize, reset and
                                       remove that job

Over TCP the first line of a connection is ``AUTH <admin or client token>``,
checked before any JSON is parsed; the Unix socket (root and the daemon's
own user, by SO_PEERCRED) is admin. A job token travels in the request
(``job_token``). The daemon keeps only a job token's SHA-256.
"""
from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass

ADMIN, CLIENT = "admin", "client"
AUTH_MAX = 512                      # bytes read from a connection before it authenticates
JOB_TOKEN_CHARS = (16, 256)


class AuthError(ValueError):
    """A connection that did not authenticate; the message starts with "auth:"."""


@dataclass(frozen=True)
class Session:
    """One control connection: its rights and how logs name it."""
    role: str
    peer: str
    local: bool = False     # over the Unix socket: file descriptors can be handed over

    @property
    def admin(self) -> bool:
        return self.role == ADMIN


class Credentials:
    """The tokens a TCP connection may open with (the client token is optional)."""

    def __init__(self, admin: str, client: str | None = None):
        if not admin:
            raise ValueError("TCP control needs an admin token")
        self._tokens = [(admin.encode(), ADMIN)] + ([(client.encode(), CLIENT)] if client else [])

    def authenticate(self, line: bytes) -> str:
        """The role of an ``AUTH <token>`` line, or AuthError."""
        word, _, given = line.strip().partition(b" ")
        given = given.strip()
        if word != b"AUTH" or not given:
            raise AuthError("auth: the first line over TCP must be `AUTH <token>` (the admin or the "
                            "client token); requests follow it")
        role = None
        for token, r in self._tokens:        # compare with every token: no early exit to time
            if hmac.compare_digest(given, token):
                role = r
        if role is None:
            raise AuthError("auth: wrong token")
        return role


def new_job_token() -> str:
    return secrets.token_urlsafe(24)


def job_token_hash(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


def holds(token_hash: bytes | None, given: str | None) -> bool:
    """Whether ``given`` is the job token whose hash is ``token_hash``."""
    return bool(token_hash) and given is not None and hmac.compare_digest(token_hash, job_token_hash(given))
