// SPDX-License-Identifier: MIT
/* One all-reduce round of the xagg client, in C.
 *
 * The same loop as Client._exchange_py in xagg/client/allreduce.py (the reference
 * and fallback): send every chunk's packet under a per-aggregator window
 * (UDP GSO where the kernel has it), read results in recvmmsg(2) bursts,
 * keep the first valid result of each chunk, retransmit a chunk as soon as
 * results of chunks sent after it come back (a gap: it or its result was
 * lost), and what is still late once the pipeline stalls for the RFC 6298
 * timeout; give up after `timeout` seconds without progress. Python spent
 * ~2 ms of CPU per round of the demo model in this loop (numpy calls on a
 * few packets each); here it is tens of
 * microseconds plus the system calls, and ctypes drops the GIL meanwhile.
 * With the codec in the loop (src/dst set), a data chunk is quantised just
 * before its packet first goes out and its sum dequantised straight out of
 * the arriving datagram: the codec's passes hide behind the network and the
 * tensor is walked while in cache (16 MB unshaped: 92 -> 78 ms).
 *
 * The wire header comes from bpf/xagg_proto.h, the kernel program's own
 * definition; struct xagg_exchange is checked against its ctypes twin at
 * load time through xagg_exchange_layout().
 */
#define _GNU_SOURCE
#include <errno.h>
#include <poll.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <linux/types.h>

#include "xagg_consts.h"
#include "xagg_proto.h"
#include "codec.h"
#include "local.h"
#include "layout.h"

#ifndef SOL_UDP
#define SOL_UDP 17
#endif
#ifndef UDP_SEGMENT
#define UDP_SEGMENT 103
#endif
#define GSO_MAX_BYTES 65000	/* one GSO send stays under 64 KiB */
#define GSO_MAX_SEGS 64		/* and under the kernel's segment limit */
#define RX_BATCH 256		/* datagrams per recvmmsg */
#define MAX_WAIT 0.01		/* longest single poll: the loop re-checks windows */
#define GAP_ROWS 3		/* results this far past a missing one: it was lost */
#define TLP_MIN 0.002		/* shortest pause in the tail taken as a loss (s) */
#define TLP_GAPS 4		/* a tail pause is a loss past this many usual gaps between results */
#define PROBE_ROWS 2		/* chunks per aggregator a tail probe resends */
#define PROBES_MAX 10		/* tail probes back off up to 2**10 pauses (capped by rto) */
#define LOCAL_WAIT 0.0002	/* longest poll while this host's aggregator owes sums */
#define LOCAL_EVERY 0.0005	/* least time between two passes over its slots (each miss
				 * copies a whole slot out: 9 KB at MTU 9000) */
#define LOCAL_MISSES 1		/* unfinished slots looked at per pass (chunks finish in order) */

struct xagg_exchange {
	/* in */
	int32_t fd;
	int32_t n_aggs;
	const struct sockaddr_in *addrs;	/* n_aggs */
	uint8_t *pkts;			/* rows packets; aggregator k's at off[k] */
	const int64_t *off;		/* n_aggs + 1 row offsets */
	const int32_t *row_map;		/* n_aggs x width: chunk -> row, or -1 */
	int64_t width;
	uint32_t pkt_size;		/* sizeof(struct xagg_hdr) + 4 * vals */
	uint32_t vals;
	uint32_t job_id, cookie, round;
	int32_t window;			/* packets in flight per aggregator */
	double rto_floor;		/* seconds */
	double timeout;			/* seconds without progress: give up */
	/* in/out */
	int32_t gso;			/* cleared when the kernel refuses UDP GSO */
	double srtt, rttvar;		/* srtt < 0: no sample yet */
	int32_t reorder;		/* results seen this far out of send order (<= 0: none yet) */
	/* out */
	int32_t *results;		/* rows x vals */
	uint8_t *done;			/* rows */
	int64_t sent, retransmits, received;
	int32_t err;			/* errno of a failed system call */
	/* in, optional: the codec in the loop. As a data row first goes out,
	 * its chunk's exponent is read (and written into lane 0 of its meta
	 * entry, ahead of the meta rows, which go last), the chunk quantised
	 * with the send exponent; its result is dequantised into dst as it
	 * comes in (not stored in results). Each while in cache. */
	const float *src;		/* NULL: the packets are filled already */
	float *dst;			/* NULL: every result goes to results */
	int64_t n;			/* elements of src and dst */
	const int64_t *chunk_of_row;	/* rows: the chunk a data row carries, or -1 */
	const int32_t *pred;		/* per chunk: predicted exponent */
	const int64_t *own_at;		/* per chunk: byte offset in pkts of its own exponent */
	int32_t *exps;			/* out, per chunk: the exponent it was quantised with */
	int32_t headroom;		/* fixedpoint.headroom_bits(n_workers) */
	int32_t bias;			/* added to data rows' values (XAGG_OP_SUM64) */
	uint32_t unbias;		/* taken off their sums: n_workers * bias */
	/* out: how the losses were found (the rest of retransmits: gaps) */
	int64_t probe_resends;		/* resends of the tail probe */
	int64_t rto_resends;		/* resends once the pipeline stalled for rto */
	/* in, optional: the aggregator on this host (local.h); its rows are
	 * run through its program and their sums read from its slots */
	struct xagg_local *local;
};

/* sizeof and the offset of every field, in declaration order */
#define F(f) offsetof(struct xagg_exchange, f)
static const int64_t layout[] = {
	sizeof(struct xagg_exchange), sizeof(struct xagg_hdr),
	F(fd), F(n_aggs), F(addrs), F(pkts), F(off), F(row_map), F(width),
	F(pkt_size), F(vals), F(job_id), F(cookie), F(round), F(window),
	F(rto_floor), F(timeout), F(gso), F(srtt), F(rttvar), F(reorder), F(results),
	F(done), F(sent), F(retransmits), F(received), F(err), F(src), F(dst),
	F(n), F(chunk_of_row), F(pred), F(own_at), F(exps), F(headroom), F(bias), F(unbias),
	F(probe_resends), F(rto_resends), F(local),
};
#undef F

int64_t xagg_exchange_layout(int64_t *out, int64_t n)
{
	return xagg_copy_layout(layout, sizeof(layout) / sizeof(layout[0]), out, n);
}

static double now(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static double rto_of(const struct xagg_exchange *x)
{
	double r;

	if (x->srtt < 0)
		return x->rto_floor > 0.2 ? x->rto_floor : 0.2;
	r = x->srtt + 4 * x->rttvar;
	if (r < x->rto_floor)
		r = x->rto_floor;
	return r > 2.0 ? 2.0 : r;
}

/* RFC 6298 smoothing over one sample (the slowest result of a burst) */
static void rtt_sample(struct xagg_exchange *x, double r)
{
	double d;

	if (x->srtt < 0) {
		x->srtt = r;
		x->rttvar = r / 2;
		return;
	}
	d = x->srtt - r;
	x->rttvar = 0.75 * x->rttvar + 0.25 * (d < 0 ? -d : d);
	x->srtt = 0.875 * x->srtt + 0.125 * r;
}

static void wait_fd(int fd, short events, double seconds)
{
	struct pollfd p = { .fd = fd, .events = events };
	struct timespec ts = { .tv_sec = (time_t)seconds };

	ts.tv_nsec = (long)((seconds - ts.tv_sec) * 1e9);
	ppoll(&p, 1, &ts, NULL);
}

/* n consecutive packets to one aggregator: GSO batches, or one datagram
 * per call. A full send buffer (shaped link) waits for room and retries. */
static int send_run(struct xagg_exchange *x, const uint8_t *buf, int64_t n,
		    const struct sockaddr_in *to)
{
	size_t size = x->pkt_size;
	int64_t i = 0, segs;
	ssize_t r;

	while (i < n) {
		segs = GSO_MAX_BYTES / size;
		if (segs > GSO_MAX_SEGS)
			segs = GSO_MAX_SEGS;
		if (segs > n - i)
			segs = n - i;
		if (x->gso && segs > 1) {
			char cbuf[CMSG_SPACE(sizeof(uint16_t))] = { 0 };
			struct iovec iov = {
				.iov_base = (void *)(buf + i * size),
				.iov_len = segs * size,
			};
			struct msghdr mh = {
				.msg_name = (void *)to,
				.msg_namelen = sizeof(*to),
				.msg_iov = &iov,
				.msg_iovlen = 1,
				.msg_control = cbuf,
				.msg_controllen = sizeof(cbuf),
			};
			struct cmsghdr *cm = CMSG_FIRSTHDR(&mh);
			uint16_t gso_size = size;

			cm->cmsg_level = SOL_UDP;
			cm->cmsg_type = UDP_SEGMENT;
			cm->cmsg_len = CMSG_LEN(sizeof(gso_size));
			memcpy(CMSG_DATA(cm), &gso_size, sizeof(gso_size));
			r = sendmsg(x->fd, &mh, 0);
		} else {
			segs = 1;
			r = sendto(x->fd, buf + i * size, size, 0,
				   (const struct sockaddr *)to, sizeof(*to));
		}
		if (r < 0) {
			if (errno == EAGAIN || errno == EWOULDBLOCK || errno == ENOBUFS) {
				wait_fd(x->fd, POLLOUT, MAX_WAIT);
				continue;
			}
			if (errno == EINTR)
				continue;
			if (x->gso && (errno == EIO || errno == EINVAL || errno == ENOPROTOOPT)) {
				x->gso = 0;
				continue;
			}
			x->err = errno;
			return -1;
		}
		x->sent += segs;
		i += segs;
	}
	return 0;
}

/* Fast retransmit. Every worker sends an aggregator's chunks in the same
 * order and each flow stays in order, so chunks complete in the order they
 * were sent: a chunk still missing when results of GAP_ROWS chunks sent
 * after it are back was lost, on the way in (some worker's packet: every
 * worker sees the gap and resends; the aggregator drops the duplicates and
 * completes the chunk) or on the way back (the aggregator answers a
 * finished chunk's repeat with the result). "Sent after" counts sends, not
 * rows, so a retransmit that is lost again is caught the same way (by
 * first sends made after it: only those order, see receive()).
 *
 * Reordering (several receive queues on the aggregator, each on its own
 * CPU) makes chunks complete a little out of order too: the threshold is
 * the larger of GAP_ROWS and the reordering seen: on every result, how many
 * later first sends had their results back before it, and for a resend
 * that proves spurious (a chunk's result arrives twice: the aggregator
 * answered both the first send and the resend, so neither the packet nor
 * its result was lost) the count when the second answer comes: an
 * over-estimate by what came back meanwhile, so it is capped at half the
 * window (a loss is then resent that much later, still before the
 * pipeline stalls; at 1 Gbit/s and 9 KB packets 16 results are 1.2 ms).
 * It is carried from round to round (x->reorder), as srtt is. A result the
 * aggregator marks XAGG_F_RESENT was completed by some worker's resend: it
 * is late for a loss (maybe another worker's), not for reordering, and
 * neither orders nor times anything (counted, it would ratchet the
 * threshold up by a whole recovery at every loss, up to half the window,
 * and slow the next loss's detection by as much).
 *
 * struct gaps keeps this O(rows) per round: first sends are scanned once
 * (`scan` only moves forward); rows sent again wait on a short list. */
struct gaps {
	uint64_t seq;		/* sends so far this round */
	uint64_t *sent_seq;	/* rows: seq of the row's last send */
	uint64_t *first_seq;	/* rows: seq of its first send */
	uint64_t *newest;	/* per aggregator: highest sent_seq among its results */
	uint8_t *by_resend;	/* rows: the result came marked XAGG_F_RESENT */
	int64_t *scan;		/* per aggregator: rows below were looked at */
	int64_t *again;		/* rows sent more than once and not yet done */
	int64_t n_again;
};

/* Results of first sends after `row`'s that came back before its result */
static void note_order(struct xagg_exchange *x, uint64_t newest, uint64_t first_seq)
{
	int64_t d = newest > first_seq ? (int64_t)(newest - first_seq) : 0;

	if (d > x->reorder)
		x->reorder = d < x->window / 2 ? d : x->window / 2;
}

/* rows sent after a missing one whose results are back before it is resent */
static uint64_t gap_of(const struct xagg_exchange *x)
{
	return x->reorder > GAP_ROWS ? x->reorder : GAP_ROWS;
}

/* A row's sum: dequantised into dst (a data row with the codec in the
 * loop) or kept in its result row. */
static void take_result(struct xagg_exchange *x, int64_t row, const int32_t *sum)
{
	int64_t c = x->dst ? x->chunk_of_row[row] : -1;

	if (c >= 0)
		xagg_dequantise_one(sum, x->vals, c, x->exps[c], x->headroom, x->unbias, x->dst, x->n);
	else
		memcpy(x->results + row * x->vals, sum, 4 * (size_t)x->vals);
	x->done[row] = 1;
}

struct rx {
	uint8_t *buf;
	struct iovec iov[RX_BATCH];
	struct mmsghdr msgs[RX_BATCH];
};

/* Drain the socket; returns the number of chunks newly done, -1 on error.
 * Only a whole datagram whose header names this job, cookie and round and
 * one of this round's (aggregator, chunk) pairs is taken; a chunk's first
 * result wins (a retransmit may bring it twice). */
static int64_t receive(struct xagg_exchange *x, struct rx *rx, double wait,
		       int64_t *n_done, struct gaps *g, const double *sent_at,
		       const uint8_t *resent)
{
	size_t size = x->pkt_size;
	int64_t got = 0;
	double slowest = -1, t;
	int n, i;

	wait_fd(x->fd, POLLIN, wait);
	t = now();
	do {
		n = recvmmsg(x->fd, rx->msgs, RX_BATCH, MSG_DONTWAIT, NULL);
		if (n < 0) {
			if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)
				break;
			x->err = errno;
			return -1;
		}
		for (i = 0; i < n; i++) {
			const struct xagg_hdr *h = (const void *)(rx->buf + i * size);
			int32_t row;

			if (rx->msgs[i].msg_len != size || (rx->msgs[i].msg_hdr.msg_flags & MSG_TRUNC))
				continue;
			if (h->magic != XAGG_MAGIC || !(h->flags & XAGG_F_RESULT) ||
			    h->job_id != x->job_id || h->cookie != x->cookie ||
			    h->round != x->round)
				continue;
			if (h->agg_id >= x->n_aggs || h->chunk >= x->width)
				continue;
			row = x->row_map[h->agg_id * x->width + h->chunk];
			if (row < 0)
				continue;
			if (x->done[row]) {	/* a second answer: the resend was spurious */
				/* either answer marked: late for a loss (the
				 * marked completion can come after the answer
				 * to this worker's own resend) */
				if (resent[row] && !g->by_resend[row] && !(h->flags & XAGG_F_RESENT))
					note_order(x, g->newest[h->agg_id], g->first_seq[row]);
				continue;
			}
			take_result(x, row, (const int32_t *)(h + 1));
			n_done[h->agg_id]++;
			g->by_resend[row] = !!(h->flags & XAGG_F_RESENT);
			if (!resent[row] && !g->by_resend[row])
				note_order(x, g->newest[h->agg_id], g->first_seq[row]);
			/* only a first send orders: a resent row's result can
			 * overtake rows sent before the resend but still in flight */
			if (!resent[row] && g->sent_seq[row] > g->newest[h->agg_id])
				g->newest[h->agg_id] = g->sent_seq[row];
			got++;
			/* Karn: a retransmitted chunk's time is ambiguous, and
			 * one someone's resend completed timed a recovery */
			if (!resent[row] && !g->by_resend[row] && t - sent_at[row] > slowest)
				slowest = t - sent_at[row];
		}
	} while (n == RX_BATCH);
	if (slowest >= 0)
		rtt_sample(x, slowest);
	x->received += got;
	return got;
}

static int resend_row(struct xagg_exchange *x, struct gaps *g, int k, int64_t r,
		      double t, double *sent_at, uint8_t *resent)
{
	struct xagg_hdr *h = (void *)(x->pkts + r * (size_t)x->pkt_size);
	int rc;

	/* marked for this send only: the row's first send next round is not */
	h->flags |= XAGG_F_RESENT;
	rc = send_run(x, (uint8_t *)h, 1, &x->addrs[k]);
	h->flags &= ~XAGG_F_RESENT;
	if (rc)
		return -1;
	g->sent_seq[r] = ++g->seq;
	sent_at[r] = t;
	resent[r] = 1;
	x->retransmits++;
	return 0;
}

static int fast_retransmit(struct xagg_exchange *x, struct gaps *g, const int32_t *agg_of,
			   double t, double *sent_at, uint8_t *resent)
{
	int64_t i, r, keep = 0;
	int k;

	for (i = 0; i < g->n_again; i++) {		/* resent rows lost again */
		r = g->again[i];
		if (x->done[r])
			continue;
		k = agg_of[r];
		if (g->newest[k] > g->sent_seq[r] + gap_of(x) &&
		    resend_row(x, g, k, r, t, sent_at, resent))
			return -1;
		g->again[keep++] = r;
	}
	g->n_again = keep;
	for (k = 0; k < x->n_aggs; k++) {		/* first sends */
		for (r = g->scan[k]; r < x->off[k + 1] && g->sent_seq[r] &&
		     g->newest[k] > g->sent_seq[r] + gap_of(x); r++) {
			if (x->done[r] || resent[r])
				continue;
			if (resend_row(x, g, k, r, t, sent_at, resent))
				return -1;
			g->again[g->n_again++] = r;
		}
		g->scan[k] = r;
	}
	return 0;
}

/* Encode the data rows among rows [a, b): exponent and quantisation in one pass. */
static void encode_rows(struct xagg_exchange *x, int64_t a, int64_t b)
{
	for (int64_t r = a, c; r < b; r++) {
		int32_t own;

		c = x->chunk_of_row[r];
		if (c < 0)
			continue;
		x->exps[c] = xagg_encode_one(x->src, x->n, x->vals, c, x->pred[c], x->headroom,
					     x->bias, (int32_t *)(x->pkts + r * (size_t)x->pkt_size +
							 sizeof(struct xagg_hdr)), &own);
		memcpy(x->pkts + x->own_at[c], &own, sizeof(own));
	}
}

/* Resend every chunk sent more than `age` ago and not done, the oldest
 * first, at most `most` per aggregator; returns how many, -1 on error. */
static int64_t resend_late(struct xagg_exchange *x, struct gaps *g, const int64_t *nxt,
			   double t, double age, int64_t most, double *sent_at, uint8_t *resent)
{
	int64_t r, late, all = 0;

	for (int k = 0; k < x->n_aggs; k++) {
		if (x->local && k == x->local->agg)
			continue;	/* nothing of its can be lost */
		late = 0;
		for (r = x->off[k]; r < x->off[k] + nxt[k] && late < most; r++) {
			if (x->done[r] || sent_at[r] >= t - age)
				continue;
			if (!resent[r])
				g->again[g->n_again++] = r;
			if (resend_row(x, g, k, r, t, sent_at, resent))
				return -1;
			late++;
		}
		all += late;
	}
	return all;
}

/* This host's aggregator's rows, all at once (no network, no window):
 * encoded, then each run through its program. */
static int inject_local(struct xagg_exchange *x)
{
	int k = x->local->agg;

	if (x->src)
		encode_rows(x, x->off[k], x->off[k + 1]);
	for (int64_t r = x->off[k]; r < x->off[k + 1]; r++) {
		if (xagg_local_inject(x->local, x->pkts + r * (size_t)x->pkt_size, x->pkt_size)) {
			x->err = errno;
			return -1;
		}
		x->sent++;
	}
	return 0;
}

/* Sums of this host's aggregator's rows that are finished, read from its
 * slots: from the first row not done, until LOCAL_MISSES rows not finished
 * yet (the other workers send in row order, so chunks finish nearly in it).
 * Returns how many rows are newly done, -1 on error. */
static int64_t collect_local(struct xagg_exchange *x, int64_t *cursor, uint8_t *slot)
{
	struct xagg_local *l = x->local;
	int64_t r, got = 0;
	int misses = 0, rc;

	for (r = *cursor; r < x->off[l->agg + 1] && misses < LOCAL_MISSES; r++) {
		const struct xagg_hdr *h = (const void *)(x->pkts + r * (size_t)x->pkt_size);

		if (x->done[r])
			continue;
		rc = xagg_local_poll(l, h->chunk, x->round, slot);
		if (rc < 0) {
			x->err = errno;
			return -1;
		}
		if (!rc) {
			misses++;
			continue;
		}
		take_result(x, r, (const int32_t *)(slot + l->off_vals));
		got++;
	}
	while (*cursor < x->off[l->agg + 1] && x->done[*cursor])
		(*cursor)++;
	x->received += got;
	return got;
}

/* 0: every chunk done; 1: timeout (x->done says which are missing);
 * -1: a system call failed (x->err) or memory ran out. */
int xagg_exchange(struct xagg_exchange *x)
{
	int m = x->n_aggs, k, rc = -1, lk = x->local ? x->local->agg : -1;
	int64_t rows = x->off[m], remaining = rows, got, j, r, cnt, room;
	size_t size = x->pkt_size;
	double *sent_at = calloc(rows + 1, sizeof(*sent_at));
	uint8_t *resent = calloc(rows + 1, 1);
	int64_t *nxt = calloc(m, sizeof(*nxt)), *n_done = calloc(m, sizeof(*n_done));
	int32_t *agg_of = calloc(rows + 1, sizeof(*agg_of));
	struct gaps g = {
		.sent_seq = calloc(rows + 1, sizeof(uint64_t)),
		.first_seq = calloc(rows + 1, sizeof(uint64_t)),
		.newest = calloc(m, sizeof(uint64_t)),
		.by_resend = calloc(rows + 1, 1),
		.scan = calloc(m, sizeof(int64_t)),
		.again = calloc(rows + 1, sizeof(int64_t)),
	};
	struct rx *rx = calloc(1, sizeof(*rx));
	uint8_t *slot = x->local ? malloc(x->local->slot_size) : NULL;
	int64_t local_at = lk >= 0 ? x->off[lk] : 0;	/* collect_local's cursor */
	double local_last = 0;				/* and when it last ran */
	double t, last, rto, tlp, wait, gap = 0;
	int all_sent, probes = 0;
	int64_t n;

	if (!sent_at || !resent || !nxt || !n_done || !agg_of || !g.sent_seq || !g.first_seq || !g.newest || !g.by_resend ||
	    !g.scan || !g.again || !rx || !(rx->buf = malloc(RX_BATCH * size)) || (x->local && !slot)) {
		x->err = ENOMEM;
		goto out;
	}
	for (int i = 0; i < RX_BATCH; i++) {
		rx->iov[i].iov_base = rx->buf + i * size;
		rx->iov[i].iov_len = size;
		rx->msgs[i].msg_hdr.msg_iov = &rx->iov[i];
		rx->msgs[i].msg_hdr.msg_iovlen = 1;
	}
	for (k = 0; k < m; k++) {
		g.scan[k] = x->off[k];		/* rows are global: aggregator k's from off[k] */
		for (r = x->off[k]; r < x->off[k + 1]; r++)
			agg_of[r] = k;
	}
	last = now();
	rto = rto_of(x);
	while (remaining > 0) {
		t = now();
		for (k = 0; k < m; k++) {
			cnt = x->off[k + 1] - x->off[k];
			if (k == lk) {
				if (!nxt[k] && inject_local(x))
					goto out;
				nxt[k] = cnt;
				continue;
			}
			room = x->window - (nxt[k] - n_done[k]);
			if (room <= 0 || nxt[k] >= cnt)
				continue;
			j = nxt[k] + room < cnt ? nxt[k] + room : cnt;
			if (x->src)
				encode_rows(x, x->off[k] + nxt[k], x->off[k] + j);
			if (send_run(x, x->pkts + (x->off[k] + nxt[k]) * size, j - nxt[k], &x->addrs[k]))
				goto out;
			for (r = x->off[k] + nxt[k]; r < x->off[k] + j; r++) {
				sent_at[r] = t;
				g.sent_seq[r] = g.first_seq[r] = ++g.seq;
			}
			nxt[k] = j;
		}
		/* What the gaps cannot show (the last chunks, or every result
		 * lost). A tail probe: once everything has gone out and results
		 * have begun to come (before the first, a pause is as likely
		 * the slowest worker starting late), they come back-to-back
		 * until the last; a pause of a quarter srtt
		 * (but TLP_MIN at least, and TLP_GAPS times the smoothed time
		 * between results: an aggregator that completes chunks slowly
		 * is not losing them) means the rest were lost, so the oldest
		 * PROBE_ROWS of each aggregator go again (a pause with many
		 * chunks out is more likely a slow worker; the others then
		 * complete and the lost one is the next probe's), without
		 * waiting for the RFC 6298 rto (whose floor is
		 * there for queues that are still draining). A probe can be
		 * lost too (at 1% loss, 4 workers, a round's tail loses one
		 * every few rounds): while nothing comes back, probes repeat
		 * at twice the last pause, until rto. Then, at rto, whatever
		 * is late, with backoff. The wait for results ends at the
		 * next of these deadlines. */
		all_sent = 1;
		for (k = 0; k < m; k++)
			all_sent &= nxt[k] >= x->off[k + 1] - x->off[k];
		tlp = x->srtt > 0 ? x->srtt / 4 : rto;
		tlp = tlp > TLP_GAPS * gap ? tlp : TLP_GAPS * gap;	/* a slow aggregator */
		tlp = (tlp > TLP_MIN ? tlp : TLP_MIN) * (1 << probes);
		if (all_sent && x->received && tlp < rto && t - last >= tlp) {
			if ((n = resend_late(x, &g, nxt, t, tlp / (1 << probes), PROBE_ROWS, sent_at,
					     resent)) < 0)
				goto out;
			x->probe_resends += n;
			probes = probes < PROBES_MAX ? probes + 1 : probes;
			tlp *= 2;
		}
		if (t - last >= rto) {
			if ((n = resend_late(x, &g, nxt, t, rto, x->window, sent_at, resent)) < 0)
				goto out;
			x->rto_resends += n;
			rto = rto * 2 < 1.0 ? rto * 2 : 1.0;   /* no retransmit storms */
		}
		wait = last + (all_sent && x->received && tlp < rto ? tlp : rto) - t;
		wait = wait < 0 ? 0 : wait < MAX_WAIT ? wait : MAX_WAIT;
		if (lk >= 0 && n_done[lk] < x->off[lk + 1] - x->off[lk] && wait > LOCAL_WAIT)
			wait = LOCAL_WAIT;
		got = receive(x, rx, wait, n_done, &g, sent_at, resent);
		if (got >= 0 && lk >= 0 && n_done[lk] < x->off[lk + 1] - x->off[lk] &&
		    now() - local_last >= LOCAL_EVERY) {
			local_last = now();
			n = collect_local(x, &local_at, slot);
			n_done[lk] += n > 0 ? n : 0;
			got = n < 0 ? -1 : got + n;
		}
		if (got < 0)
			goto out;
		if (got) {
			if (fast_retransmit(x, &g, agg_of, now(), sent_at, resent))
				goto out;
			probes = 0;
			remaining -= got;
			t = now();
			gap = gap > 0 ? 0.875 * gap + 0.125 * (t - last) : t - last;
			last = t;
			rto = rto_of(x);
		} else if (now() - last > x->timeout) {
			rc = 1;
			goto out;
		}
	}
	rc = 0;
out:
	free(slot);
	if (rx)
		free(rx->buf);
	free(rx);
	free(g.again);
	free(g.scan);
	free(g.newest);
	free(g.by_resend);
	free(g.sent_seq);
	free(g.first_seq);
	free(agg_of);
	free(n_done);
	free(nxt);
	free(resent);
	free(sent_at);
	return rc;
}
