"""xaggd: the xagg aggregator daemon.

    cli.py             the `xaggd` command (start/stop/status/stats/cleanup/check)
    cli_options.py     the flags commands share: one per setting, the config file, where the daemon is
    locate.py          finding a running daemon: its socket, a TCP address, or root's run dir
    report.py          the text `xaggd status` and `xaggd stats` print
    settings.py        every setting once: its flag, TOML key, XAGGD_* variable, default, help, check
    config.py          Config: defaults < TOML file < XAGGD_* env < flags, validated
    server.py          Server: startup, a main loop watching a flag, detach in finally; pid files
    jobs.py            JobTable: register/resize/reset/remove requests on the jobs one daemon serves
    job.py             Job: what a registrant asked for and the data plane entries it installs
    job_request.py     a request's fields, checked, each error naming its field
    placement.py       first-fit slots and job indexes, and installing jobs in the backend
    persist.py         JobStore: the job list kept in the state dir across restarts
    lease.py           job leases: a job with neither packets nor requests for a while is removed
    metrics.py         --metrics: the daemon's Prometheus collector (prometheus_client serves it)
    sdnotify.py        READY=1/STOPPING=1 to systemd (Type=notify) over $NOTIFY_SOCKET
    control_server.py  the control protocol (xagg.wire.control) served over Unix and TCP sockets
    auth.py            who may do what: admin, client and per-job tokens, the AUTH line
    loglimit.py        log lines a peer can provoke, at a bounded rate
    backends.py        Backend, the data plane contract, and its XDP and userspace implementations
    check.py           `xaggd check`: can this host run the XDP aggregator?
    dataplane/         the XDP program (compile, load, attach, test-run) and the userspace aggregator

Imports only xagg.wire of the client library: what workers and daemons say
to each other, never the client or the torch hook.
"""
