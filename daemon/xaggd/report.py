"""What `xaggd status` and `xaggd stats` print: the daemon's answers
(``Server.status()``, ``Server.stats()``) as text for a terminal."""
from __future__ import annotations

from xaggd.config import who
from xaggd.settings import format_size


def duration(s: float) -> str:
    s = int(s)
    d, s = divmod(s, 86400)
    h, s = divmod(s, 3600)
    m, s = divmod(s, 60)
    return (f"{d}d" if d else "") + (f"{h}h" if h or d else "") + (f"{m}m" if m or h or d else "") + f"{s}s"


def table(rows: list[dict], cols: list[str], indent: str = "  ") -> str:
    widths = {c: max([len(c)] + [len(str(r.get(c, ""))) for r in rows]) for c in cols}
    lines = ["  ".join(c.upper().ljust(widths[c]) for c in cols)]
    lines += ["  ".join((str(r.get(c, "")).ljust if i == 0 else str(r.get(c, "")).rjust)(widths[c])
                        for i, c in enumerate(cols)) for r in rows]
    return "\n".join(indent + line.rstrip() for line in lines)


def status_text(st: dict) -> str:
    mem = st["memory"]
    plane = (f"userspace aggregator on UDP {st.get('bind')}:{st['port']}" if st["backend"] == "userspace"
             else f"XDP on {st['iface']}" + (f" (netns {st['netns']})" if st.get("netns") else "")
             + f", {st['mode']} mode, {'attached' if st['attached'] else 'NOT attached'}, UDP port {st['port']}")
    frames = f" in {st['frames']} frames" if st.get("frames") else ""
    lines = [f"{who(st['name'])}: running (pid {st['pid']}), up {duration(st['uptime_s'])}",
             f"  data plane: {plane}, {st['vals']} values/packet{frames}"]
    if st.get("slot_lock"):
        lines.append(f"  slot lock:  {st['slot_lock']}")
    if st.get("pps_per_queue"):
        lines.append(f"  packets:    {st['pps_per_queue'] / 1e6:.2f} Mpps per core (measured at start) x "
                     f"{st.get('rx_queues') or 1} RX queue(s): the planner's packet capacity of this host")
    lines.append(f"  memory:     {format_size(mem['memory_bytes'])} = {mem['max_slots']} slots; "
                 f"{mem['used_slots']} used, {mem['free_slots']} free ({format_size(mem['free_bytes'])})")
    tcp = f", tcp {st['listen']} ({'TLS' if st.get('tls') else 'in clear'})" if st.get("listen") else ""
    lines.append(f"  control:    {st['control']}{tcp}")
    if st.get("health"):
        lines.append(f"  PROBLEM:    {st['health']}")
    lines.append(f"  jobs:       {len(st['jobs'])} of {mem['max_jobs']}; {lease_text(st)}")
    if st["jobs"]:
        rows = [{**j, "idle": duration(j["idle_s"])} for j in st["jobs"]]
        lines.append(table(rows, ["job_id", "n_workers", "max_elements", "n_chunks", "slot_base",
                                  "n_slots", "fanout", "idle"], indent="    "))
    return "\n".join(lines)


def lease_text(st: dict) -> str:
    """The lease, and the slots held by jobs idle for a while (``st["idle"]``)."""
    lease = st.get("lease_s") or 0
    text = f"job lease {duration(lease)}" if lease else "no job lease (jobs stay until removed)"
    idle = st.get("idle") or {}
    if idle.get("jobs"):
        text += (f"; {idle['slots']} slots held by {len(idle['jobs'])} job(s) idle over "
                 f"{duration(idle['after_s'])}: {', '.join(map(str, idle['jobs']))}")
    return text


def rates(a: dict, b: dict) -> dict:
    """Per-second rates between two ``stats`` samples, ``a`` then ``b``."""
    dt = max(b["time"] - a["time"], 1e-9)
    out = {"interval_s": round(dt, 3),
           "counters_per_s": {k: (v - a["counters"].get(k, 0)) / dt for k, v in b["counters"].items()},
           "packets_per_s": (b["packets"] - a["packets"]) / dt,
           "bytes_aggregated_per_s": (b["bytes_aggregated"] - a["bytes_aggregated"]) / dt,
           "jobs": {}}
    for j, st in b["jobs"].items():
        prev = a["jobs"].get(j, {})
        out["jobs"][j] = {f"{k}_per_s": (v - prev.get(k, 0)) / dt for k, v in st.items()}
    return out


def stats_text(b: dict, r: dict, name: str) -> str:
    """Sample ``b`` and its rates ``r`` (``rates``) of instance ``name``."""
    rows = [{"verdict": k, "total": v, "per_s": f"{r['counters_per_s'][k]:.0f}"}
            for k, v in b["counters"].items()]
    lines = [f"{who(name)} ({b['backend']}), up {duration(b['uptime_s'])}, rates over {r['interval_s']:.1f}s:",
             table(rows, ["verdict", "total", "per_s"]),
             f"  xagg packets: {b['packets']} ({r['packets_per_s']:.0f}/s); aggregated: "
             f"{format_size(b['bytes_aggregated'])} ({r['bytes_aggregated_per_s'] / 1e6:.1f} MB/s)"]
    if b["jobs"]:
        rows = []
        for j, st in b["jobs"].items():
            jr = r["jobs"][j]
            rows.append({"job": j, "aggregated": st["aggregated"], "completed": st["completed"],
                         "retransmits": st["retransmits"], "dropped": st["dropped"],
                         "bytes": format_size(st["bytes_aggregated"]),
                         "pkts/s": f"{jr['aggregated_per_s']:.0f}",
                         "MB/s": f"{jr['bytes_aggregated_per_s'] / 1e6:.1f}"})
        lines.append(table(rows, ["job", "aggregated", "completed", "retransmits", "dropped", "bytes",
                                  "pkts/s", "MB/s"]))
    return "\n".join(lines)
