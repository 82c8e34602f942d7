// SPDX-License-Identifier: MIT
/* One all-reduce round of the xagg client, in C: the round loop.
 *
 * The same loop as xagg/client/exchange_numpy.py (the reference and
 * fallback): send every chunk's packet under a per-aggregator window
 * (batch.c: UDP GSO where the kernel has it), read results in recvmmsg(2)
 * bursts, keep the first valid result of each chunk, retransmit a chunk as
 * soon as results of chunks sent after it come back (retransmit.c: a gap,
 * it or its result was lost), and what is still late once the pipeline
 * stalls for the RFC 6298 timeout; give up after `timeout` seconds without
 * progress. Python spends far more CPU per round in such a loop (numpy
 * calls on a few packets each); here ctypes drops the GIL meanwhile.
 * With the codec in the loop (src/dst set), a data chunk is quantised just
 * before its packet first goes out and its sum dequantised straight out of
 * the arriving datagram: the codec's passes hide behind the network and the
 * tensor is walked while in cache.
 *
 * The wire header comes from bpf/xagg_proto.h, the kernel program's own
 * definition; struct xagg_exchange (exchange.h) is checked against its
 * ctypes twin at load time through xagg_exchange_layout().
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stddef.h>
#include <stdlib.h>

#include "exchange.h"
#include "layout.h"

#define TLP_MIN 0.002		/* shortest pause in the tail taken as a loss (s) */
#define TLP_GAPS 4		/* a tail pause is a loss past this many usual gaps between results */
#define PROBE_ROWS 2		/* chunks per aggregator a tail probe resends */
#define PROBES_MAX 10		/* tail probes back off up to 2**10 pauses (capped by rto) */
#define LOCAL_WAIT 0.0002	/* longest poll while this host's aggregator owes sums */
#define LOCAL_EVERY 0.0005	/* least time between two passes over its slots (each miss
				 * copies a whole slot out) */
#define LOCAL_MISSES 1		/* unfinished slots looked at per pass (chunks finish in order) */
#define RTO_FIRST 0.2		/* before any sample */
#define RTO_MAX 2.0
#define RTO_BACKOFF_MAX 1.0	/* the doubled timeout stops growing here */
#define EPOCH_MIN 64		/* first sends an epoch takes at least (judge_epoch): fewer tell
				 * a lossy link's chance runs from a storm too poorly */

/* sizeof and the offset of every field, in declaration order */
#define F(f) offsetof(struct xagg_exchange, f)
static const int64_t layout[] = {
	sizeof(struct xagg_exchange), sizeof(struct xagg_hdr),
	F(fd), F(n_aggs), F(addrs), F(pkts), F(off), F(row_map), F(width),
	F(pkt_size), F(vals), F(job_id), F(cookie), F(round), F(window),
	F(rto_floor), F(timeout), F(gso), F(srtt), F(rttvar), F(reorder), F(results),
	F(done), F(sent), F(retransmits), F(received), F(err), F(src), F(dst),
	F(n), F(chunk_of_row), F(pred), F(own_at), F(exps), F(headroom), F(bias), F(unbias),
	F(probe_resends), F(rto_resends), F(local), F(transport), F(lane_bits), F(res_in), F(res_out),
	F(src_elem), F(dst_elem), F(divide), F(window_min), F(storm_share),
};
#undef F

int64_t xagg_exchange_layout(int64_t *out, int64_t n)
{
	return xagg_copy_layout(layout, sizeof(layout) / sizeof(layout[0]), out, n);
}

static double rto_of(const struct xagg_exchange *x)
{
	double r;

	if (x->srtt < 0)
		return x->rto_floor > RTO_FIRST ? x->rto_floor : RTO_FIRST;
	r = x->srtt + 4 * x->rttvar;
	if (r < x->rto_floor)
		r = x->rto_floor;
	return r > RTO_MAX ? RTO_MAX : r;
}

/* RFC 6298 smoothing over one sample (the slowest result of a burst) */
void xagg_rtt_sample(struct xagg_exchange *x, double r)
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

/* Encode the data rows among rows [a, b): exponent and quantisation in one pass. */
static void encode_rows(struct xagg_exchange *x, int64_t a, int64_t b)
{
	for (int64_t r = a, c; r < b; r++) {
		int32_t own;
		uint8_t *payload = x->pkts + r * (size_t)x->pkt_size + sizeof(struct xagg_hdr);

		c = x->chunk_of_row[r];
		if (c < 0)
			continue;
		if (x->lane_bits == 16)
			x->exps[c] = xagg_encode16_one(x->src, x->src_elem, x->res_in, x->res_out, x->n,
						       2 * x->vals, c,
						       x->pred[c], x->headroom, x->bias, (uint16_t *)payload, &own);
		else
			x->exps[c] = xagg_encode_one(x->src, x->src_elem, x->n, x->vals, c, x->pred[c], x->headroom,
						     x->bias, (int32_t *)payload, &own);
		memcpy(x->pkts + x->own_at[c], &own, sizeof(own));
	}
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

static void round_end(struct round *rd)
{
	free(rd->slot);
	if (rd->rx)
		free(rd->rx->buf);
	free(rd->rx);
	free(rd->g.again);
	free(rd->g.scan);
	free(rd->g.undone);
	free(rd->g.newest);
	free(rd->g.by_resend);
	free(rd->g.sent_seq);
	free(rd->g.first_seq);
	free(rd->g.release_before);
	free(rd->agg_of);
	free(rd->n_done);
	free(rd->nxt);
	free(rd->resent);
	free(rd->sent_at);
}

/* The round's own memory, zeroed; -1 (x->err ENOMEM) if it ran out, with
 * whatever was allocated left for round_end(). */
static int round_start(struct xagg_exchange *x, struct round *rd)
{
	int m = x->n_aggs;
	int64_t rows = x->off[m], size = x->pkt_size;

	rd->sent_at = calloc(rows + 1, sizeof(*rd->sent_at));
	rd->resent = calloc(rows + 1, 1);
	rd->nxt = calloc(m, sizeof(*rd->nxt));
	rd->n_done = calloc(m, sizeof(*rd->n_done));
	rd->agg_of = calloc(rows + 1, sizeof(*rd->agg_of));
	rd->g.sent_seq = calloc(rows + 1, sizeof(uint64_t));
	rd->g.first_seq = calloc(rows + 1, sizeof(uint64_t));
	rd->g.newest = calloc(m, sizeof(uint64_t));
	rd->g.by_resend = calloc(rows + 1, 1);
	rd->g.scan = calloc(m, sizeof(int64_t));
	rd->g.undone = calloc(m, sizeof(int64_t));
	rd->g.again = calloc(rows + 1, sizeof(int64_t));
	rd->g.release_before = calloc(m, sizeof(double));
	rd->rx = calloc(1, sizeof(*rd->rx));
	rd->slot = x->local ? malloc(x->local->slot_size) : NULL;
	if (!rd->sent_at || !rd->resent || !rd->nxt || !rd->n_done || !rd->agg_of || !rd->g.sent_seq ||
	    !rd->g.first_seq || !rd->g.newest || !rd->g.by_resend || !rd->g.scan || !rd->g.undone ||
	    !rd->g.again || !rd->g.release_before || !rd->rx ||
	    !(rd->rx->buf = malloc(RX_BATCH * size)) || (x->local && !rd->slot)) {
		x->err = ENOMEM;
		return -1;
	}
	for (int i = 0; i < RX_BATCH; i++) {
		rd->rx->iov[i].iov_base = rd->rx->buf + i * size;
		rd->rx->iov[i].iov_len = size;
		rd->rx->msgs[i].msg_hdr.msg_iov = &rd->rx->iov[i];
		rd->rx->msgs[i].msg_hdr.msg_iovlen = 1;
	}
	for (int k = 0; k < m; k++) {
		rd->g.scan[k] = rd->g.undone[k] = x->off[k];	/* rows are global: aggregator k's from off[k] */
		for (int64_t r = x->off[k]; r < x->off[k + 1]; r++)
			rd->agg_of[r] = k;
	}
	rd->local_at = x->local ? x->off[x->local->agg] : 0;
	return 0;
}

/* Each aggregator's next never-sent rows, as many as its window has room
 * for (this host's aggregator's all at once, the first time). */
static int send_windows(struct xagg_exchange *x, struct round *rd, double t)
{
	int lk = x->local ? x->local->agg : -1;
	int64_t cnt, room, j, r;

	for (int k = 0; k < x->n_aggs; k++) {
		cnt = x->off[k + 1] - x->off[k];
		if (k == lk) {
			if (!rd->nxt[k]) {
				if (inject_local(x))
					return -1;
				rd->epoch_first += cnt;	/* no network send: in no epoch */
			}
			rd->nxt[k] = cnt;
			continue;
		}
		room = x->window - (rd->nxt[k] - rd->n_done[k]);
		if (room <= 0 || rd->nxt[k] >= cnt)
			continue;
		j = rd->nxt[k] + room < cnt ? rd->nxt[k] + room : cnt;
		if (x->src)
			encode_rows(x, x->off[k] + rd->nxt[k], x->off[k] + j);
		if (xagg_send_run(x, x->pkts + (x->off[k] + rd->nxt[k]) * (size_t)x->pkt_size, j - rd->nxt[k],
				  &x->addrs[k]))
			return -1;
		for (r = x->off[k] + rd->nxt[k]; r < x->off[k] + j; r++) {
			rd->sent_at[r] = t;
			rd->g.sent_seq[r] = rd->g.first_seq[r] = ++rd->g.seq;
		}
		rd->nxt[k] = j;
	}
	return 0;
}

static int local_owed(const struct xagg_exchange *x, const struct round *rd)
{
	int lk = x->local ? x->local->agg : -1;

	return lk >= 0 && rd->n_done[lk] < x->off[lk + 1] - x->off[lk];
}

/* Results from the network, then (at most every LOCAL_EVERY) sums from this
 * host's aggregator's slots: the chunks newly done, -1 on error. */
static int64_t collect(struct xagg_exchange *x, struct round *rd, double wait)
{
	int64_t got = xagg_receive(x, rd, wait), n;

	if (got >= 0 && local_owed(x, rd) && now() - rd->local_last >= LOCAL_EVERY) {
		rd->local_last = now();
		n = collect_local(x, &rd->local_at, rd->slot);
		rd->n_done[x->local->agg] += n > 0 ? n : 0;
		got = n < 0 ? -1 : got + n;
	}
	return got;
}

/* A resend storm, found within the round (xagg/client/window.py adapts the
 * window from call to call; this is what one call does, so its first call
 * does not storm to its end). A window's worth of first sends to the
 * aggregators over the network (EPOCH_MIN at least) is an epoch; one whose
 * sends were storm_share or more resends halves the window, down to
 * window_min: a queue on the path holds less than the window, so every
 * window lost its excess, and every worker resent what one lost. The epoch
 * after a cut is not judged: its resends are the losses of the larger
 * window, found late. Epochs count first sends, so the tail of a round
 * (resends only) ends none. A lossy link's few percent of resends never
 * reach storm_share. */
static void judge_epoch(struct xagg_exchange *x, struct round *rd)
{
	int64_t resent = x->retransmits - rd->epoch_resent, first = x->sent - x->retransmits - rd->epoch_first;
	int64_t len = (int64_t)x->window * (x->n_aggs - (x->local != NULL));

	if (first < (len > EPOCH_MIN ? len : EPOCH_MIN))
		return;
	if (!rd->epoch_settles && resent >= x->storm_share * (first + resent) && x->window > x->window_min) {
		x->window = x->window / 2 > x->window_min ? x->window / 2 : x->window_min;
		rd->epoch_settles = 1;
	} else {
		rd->epoch_settles = 0;
	}
	rd->epoch_first = x->sent - x->retransmits;
	rd->epoch_resent = x->retransmits;
}

/* 0: every chunk done; 1: timeout (x->done says which are missing);
 * -1: a system call failed (x->err). */
static int round_loop(struct xagg_exchange *x, struct round *rd)
{
	int64_t remaining = x->off[x->n_aggs], got, n;
	double t, last = now(), rto = rto_of(x), rto_at = last + rto, tlp, wait, gap = 0;
	int all_sent, probes = 0;

	while (remaining > 0) {
		t = now();
		judge_epoch(x, rd);
		if (send_windows(x, rd, t))
			return -1;
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
		 * lost too: while nothing comes back, probes repeat
		 * at twice the last pause, until rto. Then, at rto, the same
		 * probe, with backoff: a stall is as often a worker that has
		 * not sent yet (every chunk waits on it) as a loss, and only
		 * an answer tells them apart (retransmit.c resends the rest
		 * once one shows a loss). The wait for results ends at the
		 * next of these deadlines. */
		all_sent = 1;
		for (int k = 0; k < x->n_aggs; k++)
			all_sent &= rd->nxt[k] >= x->off[k + 1] - x->off[k];
		tlp = x->srtt > 0 ? x->srtt / 4 : rto;
		tlp = tlp > TLP_GAPS * gap ? tlp : TLP_GAPS * gap;	/* a slow aggregator */
		tlp = (tlp > TLP_MIN ? tlp : TLP_MIN) * (1 << probes);
		if (all_sent && x->received && tlp < rto && t - last >= tlp) {
			if ((n = xagg_resend_late(x, rd, t, tlp / (1 << probes), PROBE_ROWS)) < 0)
				return -1;
			x->probe_resends += n;
			probes = probes < PROBES_MAX ? probes + 1 : probes;
			tlp *= 2;
		}
		/* the timer restarts at each expiry (RFC 6298 5.5-5.6): timed
		 * from the last result instead, it expired on every pass once
		 * a stall outlasted RTO_BACKOFF_MAX (a worker starting late),
		 * and the loop spun, polling and probing, on the CPU the late
		 * worker needed */
		if (t >= rto_at) {
			if ((n = xagg_resend_late(x, rd, t, rto, PROBE_ROWS)) < 0)
				return -1;
			x->rto_resends += n;
			rto = rto * 2 < RTO_BACKOFF_MAX ? rto * 2 : RTO_BACKOFF_MAX;   /* no retransmit storms */
			rto_at = t + rto;
		}
		wait = (all_sent && x->received && tlp < rto ? last + tlp : rto_at) - t;
		wait = wait < 0 ? 0 : wait < MAX_WAIT ? wait : MAX_WAIT;
		if (local_owed(x, rd) && wait > LOCAL_WAIT)
			wait = LOCAL_WAIT;
		got = collect(x, rd, wait);
		if (got < 0)
			return -1;
		if (got) {
			if (xagg_fast_retransmit(x, rd, now()))
				return -1;
			probes = 0;
			remaining -= got;
			t = now();
			gap = gap > 0 ? 0.875 * gap + 0.125 * (t - last) : t - last;
			last = t;
			rto = rto_of(x);
			rto_at = t + rto;
		} else if (now() - last > x->timeout) {
			return 1;
		}
	}
	return 0;
}

/* 0: every chunk done; 1: timeout (x->done says which are missing);
 * -1: a system call failed (x->err) or memory ran out. */
int xagg_exchange(struct xagg_exchange *x)
{
	struct round rd = { 0 };
	int rc = round_start(x, &rd) ? -1 : round_loop(x, &rd);

	round_end(&rd);
	return rc;
}
