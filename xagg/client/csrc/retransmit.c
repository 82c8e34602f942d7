// SPDX-License-Identifier: MIT
/* Finding a round's lost chunks and sending them again.
 *
 * Fast retransmit. Every worker sends an aggregator's chunks in the same
 * order and each flow stays in order, so chunks complete in the order they
 * were sent: a chunk still missing when results of GAP_ROWS chunks sent
 * after it are back was lost, on the way in (some worker's packet: every
 * worker sees the gap and resends; the aggregator drops the duplicates and
 * completes the chunk) or on the way back (the aggregator answers a
 * finished chunk's repeat with the result). "Sent after" counts sends, not
 * rows, so a retransmit that is lost again is caught the same way (by
 * first sends made after it: only those order, see xagg_receive()).
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
 * pipeline stalls). It is carried from round to round (x->reorder), as
 * srtt is. A result the aggregator marks XAGG_F_RESENT was completed by
 * some worker's resend: it is late for a loss (maybe another worker's),
 * not for reordering, and neither orders nor times anything (counted, it
 * would ratchet the threshold up by a whole recovery at every loss, up to
 * half the window, and slow the next loss's detection by as much).
 *
 * What the gaps cannot show (the last chunks, or every result lost) is
 * probed late: the oldest chunks still out, by the tail probe and at the
 * RFC 6298 timeout (the round loop in exchange.c decides when), through
 * xagg_resend_late(). A stall is a loss or a worker that has not sent yet
 * (every chunk then waits on it, and a window resent to each aggregator
 * would only be dropped there as duplicates). The probe's answer tells:
 * marked XAGG_F_RETX (the chunk was finished: our result was lost) or
 * XAGG_F_RESENT (a resend completed it: a request was lost), it releases
 * the aggregator's other rows sent before the probe, resent at once;
 * an unmarked one completed with a first send, and no answer at all
 * means the chunk still waits: the next probe comes with backoff.
 */
#define _GNU_SOURCE
#include "exchange.h"

#define GAP_ROWS 3		/* results this far past a missing one: it was lost */

/* Results of first sends after a row's that came back before its result */
void xagg_note_order(struct xagg_exchange *x, uint64_t newest, uint64_t first_seq)
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

static int resend_row(struct xagg_exchange *x, struct round *rd, int k, int64_t r, double t, uint8_t how)
{
	struct xagg_hdr *h = (void *)(x->pkts + r * (size_t)x->pkt_size);
	int rc;

	/* marked for this send only: the row's first send next round is not */
	h->flags |= XAGG_F_RESENT;
	rc = xagg_send_run(x, (uint8_t *)h, 1, &x->addrs[k]);
	h->flags &= ~XAGG_F_RESENT;
	if (rc)
		return -1;
	rd->g.sent_seq[r] = ++rd->g.seq;
	rd->sent_at[r] = t;
	rd->resent[r] = how;
	x->retransmits++;
	return 0;
}

/* A probe's answer showed a loss: aggregator k's rows not done and last
 * sent before the probe are lost too. Resent as the gap rule resends (their
 * answers release nothing more: the rows resent here are in flight) and
 * counted with the probes, which found them. */
static int release(struct xagg_exchange *x, struct round *rd, int k, double t)
{
	double before = rd->g.release_before[k];

	rd->g.release_before[k] = 0;
	for (int64_t r = rd->g.undone[k]; r < x->off[k] + rd->nxt[k]; r++) {
		if (x->done[r] || rd->sent_at[r] >= before)
			continue;
		if (!rd->resent[r])
			rd->g.again[rd->g.n_again++] = r;
		if (resend_row(x, rd, k, r, t, RESENT_GAP))
			return -1;
		x->probe_resends++;
	}
	return 0;
}

int xagg_fast_retransmit(struct xagg_exchange *x, struct round *rd, double t)
{
	struct gaps *g = &rd->g;
	int64_t i, r, keep = 0;
	int k;

	for (i = 0; i < g->n_again; i++) {		/* resent rows lost again */
		r = g->again[i];
		if (x->done[r])
			continue;
		k = rd->agg_of[r];
		if (g->newest[k] > g->sent_seq[r] + gap_of(x) && resend_row(x, rd, k, r, t, RESENT_GAP))
			return -1;
		g->again[keep++] = r;
	}
	g->n_again = keep;
	for (k = 0; k < x->n_aggs; k++) {		/* first sends */
		for (r = g->scan[k]; r < x->off[k + 1] && g->sent_seq[r] &&
		     g->newest[k] > g->sent_seq[r] + gap_of(x); r++) {
			if (x->done[r] || rd->resent[r])
				continue;
			if (resend_row(x, rd, k, r, t, RESENT_GAP))
				return -1;
			g->again[g->n_again++] = r;
		}
		g->scan[k] = r;
		if (g->release_before[k] > 0 && release(x, rd, k, t))
			return -1;
	}
	return 0;
}

/* Probe: resend every chunk sent more than `age` ago and not done, the
 * oldest first, at most `most` per aggregator; returns how many, -1 on error. */
int64_t xagg_resend_late(struct xagg_exchange *x, struct round *rd, double t, double age, int64_t most)
{
	int64_t r, late, all = 0;

	for (int k = 0; k < x->n_aggs; k++) {
		if (x->local && k == x->local->agg)
			continue;	/* nothing of its can be lost */
		late = 0;
		/* done rows stay done in a round: skip the run of them at
		 * the front once, not at every probe */
		while (rd->g.undone[k] < x->off[k] + rd->nxt[k] && x->done[rd->g.undone[k]])
			rd->g.undone[k]++;
		for (r = rd->g.undone[k]; r < x->off[k] + rd->nxt[k] && late < most; r++) {
			if (x->done[r] || rd->sent_at[r] >= t - age)
				continue;
			if (!rd->resent[r])
				rd->g.again[rd->g.n_again++] = r;
			if (resend_row(x, rd, k, r, t, RESENT_PROBE))
				return -1;
			late++;
		}
		all += late;
	}
	return all;
}
