"""xaggd: the xagg aggregator daemon.

    cli.py      the `xaggd` command (start/stop/status/stats/cleanup/check)
    config.py   Config: defaults < TOML file < XAGGD_* env < flags, validated
    server.py   Server: startup, a main loop watching a flag, detach in finally; pid files
    backend.py  XdpBackend (bcc program, xagg.loader) and UserspaceBackend (xagg.twin)
    jobs.py     JobTable: register/resize/reset/remove, first-fit slots, job indexes
    control.py  the NDJSON control protocol, its Unix/TCP servers, ControlClient
"""
