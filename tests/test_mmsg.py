"""recvmmsg batches on a real loopback UDP socket."""
import socket

import numpy as np

from xagg.client import mmsg


def test_a_burst_arrives_in_one_call_and_odd_sizes_are_skipped():
    rx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    rx.bind(("127.0.0.1", 0))
    rx.setblocking(False)
    tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    rows = np.zeros(8, dtype=np.dtype([("n", "<u4"), ("pad", "<u4", (3,))]))   # 16-byte datagrams
    r = mmsg.BatchReceiver(rx, rows)
    try:
        assert r.receive() == 0                              # nothing waiting: no block, no error
        for i in range(5):
            tx.sendto(np.array([(i, (i, i, i))], dtype=rows.dtype).tobytes(), rx.getsockname())
            if i == 2:
                tx.sendto(b"short", rx.getsockname())          # too small: skipped
                tx.sendto(b"x" * 40, rx.getsockname())         # too big (truncated): skipped
        assert mmsg._recvmmsg is not None                    # glibc has it: the batched path ran
        got = r.receive()
        assert got == 5 and list(rows["n"][:5]) == [0, 1, 2, 3, 4]
        assert (rows["pad"][:5] == np.arange(5)[:, None]).all()
        assert r.receive() == 0
        for i in range(11):                                  # more than the rows: the rest stays queued
            tx.sendto(np.array([(100 + i, (0, 0, 0))], dtype=rows.dtype).tobytes(), rx.getsockname())
        assert r.receive() == 8 and rows["n"][7] == 107
        assert r.receive() == 3 and list(rows["n"][:3]) == [108, 109, 110]
    finally:
        rx.close()
        tx.close()
