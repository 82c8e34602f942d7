/* SPDX-License-Identifier: MIT */
/* One all-reduce round of the xagg client in C: its state, shared by the
 * round loop (exchange.c), sending and receiving in batches (batch.c) and
 * finding and resending lost chunks (retransmit.c).
 *
 * struct xagg_exchange is what Python hands over (native.Exchange, checked
 * against this one at load time through xagg_exchange_layout()); struct
 * round is what one call allocates for itself.
 */
#ifndef XAGG_EXCHANGE_H
#define XAGG_EXCHANGE_H

#include <poll.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <linux/types.h>

#include "xagg_consts.h"
#include "xagg_proto.h"
#include "codec.h"
#include "local.h"

#define RX_BATCH 256		/* datagrams per recvmmsg */
#define MAX_WAIT 0.01		/* longest single poll: the loop re-checks windows */

struct xagg_exchange;
struct round;

/* Where a round's packets leave and its results arrive other than through
 * the UDP socket fd: an AF_XDP socket (csrc/xsk.c), in the AF_XDP build of
 * the library only. send_run sends n packets of buf to aggregator k (NULL:
 * through fd, with UDP GSO). */
struct xagg_transport {
	int (*send_run)(struct xagg_exchange *x, const uint8_t *buf, int64_t n, int64_t k);
	int64_t (*receive)(struct xagg_exchange *x, struct round *rd, double wait);
};

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
	const void *src;		/* NULL: the packets are filled already */
	void *dst;			/* NULL: every result goes to results */
	int64_t n;			/* elements of src and dst */
	const int64_t *chunk_of_row;	/* rows: the chunk a data row carries, or -1 */
	const int32_t *pred;		/* per chunk: predicted exponent */
	const int64_t *own_at;		/* per chunk: byte offset in pkts of its own exponent */
	int32_t *exps;			/* out, per chunk: the exponent it was quantised with */
	int32_t headroom;		/* fixedpoint.headroom_bits(n_workers) */
	int32_t bias;			/* added to data rows' values (XAGG_OP_SUM64) */
	uint32_t unbias;		/* taken off their sums: n_workers * bias */
	/* out: how the losses were found (the rest of retransmits: gaps) */
	int64_t probe_resends;		/* resends of the tail probe, and what a probe's answer released */
	int64_t rto_resends;		/* resends once the pipeline stalled for rto */
	/* in, optional: the aggregator on this host (local.h); its rows are
	 * run through its program and their sums read from its slots */
	struct xagg_local *local;
	/* in, optional: NULL sends and receives through fd */
	struct xagg_transport *transport;
	/* in, the codec in the loop: 32, or 16 (two values a word, a chunk
	 * 2 * vals values), with error feedback where res_in is set (codec.h) */
	int32_t lane_bits;
	const float *res_in;
	float *res_out;
	/* in, the codec in the loop: src's and dst's element types
	 * (XAGG_ELEM_*), and what each sum is divided by in dst (1: none) */
	int32_t src_elem, dst_elem;
	float divide;
	/* in: the window is halved within a round, down to window_min, after
	 * a window's worth of sends of which storm_share or more were resends
	 * (exchange.c, judge_epoch); x->window says where it ended */
	int32_t window_min;
	float storm_share;
};

/* The order results come back in, kept O(rows) per round (retransmit.c
 * explains the rule): first sends are scanned once (`scan` only moves
 * forward); rows sent again wait on a short list. */
struct gaps {
	uint64_t seq;		/* sends so far this round */
	uint64_t *sent_seq;	/* rows: seq of the row's last send */
	uint64_t *first_seq;	/* rows: seq of its first send */
	uint64_t *newest;	/* per aggregator: highest sent_seq among its results */
	uint8_t *by_resend;	/* rows: the result came marked XAGG_F_RESENT */
	int64_t *scan;		/* per aggregator: rows below were looked at */
	int64_t *again;		/* rows sent more than once and not yet done */
	int64_t *undone;	/* per aggregator: rows below are all done (a probe's scan starts here) */
	int64_t n_again;
	double *release_before;	/* per aggregator: a probe's answer showed a loss, so its
				 * rows last sent before this are resent (0: none) */
};

enum { RESENT_GAP = 1, RESENT_PROBE = 2 };

struct rx {
	uint8_t *buf;
	struct iovec iov[RX_BATCH];
	struct mmsghdr msgs[RX_BATCH];
};

struct round {
	double *sent_at;	/* rows: when last sent */
	uint8_t *resent;	/* rows: sent more than once, last by the gap rule
				 * (RESENT_GAP) or a probe (RESENT_PROBE) */
	int64_t *nxt;		/* per aggregator: its next row never sent, from off[k] */
	int64_t *n_done;	/* per aggregator: results in */
	int32_t *agg_of;	/* rows: whose */
	struct gaps g;
	struct rx *rx;
	uint8_t *slot;		/* one slot of this host's aggregator, read into */
	int64_t local_at;	/* collect_local's cursor */
	double local_last;	/* and when it last ran */
	int64_t epoch_first;	/* first sends (x->sent less resends) when the epoch began */
	int64_t epoch_resent;	/* x->retransmits then */
	int epoch_settles;	/* the epoch after a cut: not judged */
};

static inline double now(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static inline void wait_fd(int fd, short events, double seconds)
{
	struct pollfd p = { .fd = fd, .events = events };
	struct timespec ts = { .tv_sec = (time_t)seconds };

	ts.tv_nsec = (long)((seconds - ts.tv_sec) * 1e9);
	ppoll(&p, 1, &ts, NULL);
}

/* A row's sum: dequantised into dst (a data row with the codec in the
 * loop) or kept in its result row. */
static inline void take_result(struct xagg_exchange *x, int64_t row, const int32_t *sum)
{
	int64_t c = x->dst ? x->chunk_of_row[row] : -1;

	if (c >= 0 && x->lane_bits == 16)
		xagg_dequantise16_one((const uint16_t *)sum, 2 * x->vals, c, x->exps[c], x->headroom, x->unbias,
				      x->divide, x->dst, x->dst_elem, x->n);
	else if (c >= 0)
		xagg_dequantise_one(sum, x->vals, c, x->exps[c], x->headroom, x->unbias, x->divide, x->dst,
				    x->dst_elem, x->n);
	else
		memcpy(x->results + row * x->vals, sum, 4 * (size_t)x->vals);
	x->done[row] = 1;
}

/* Results read in one go: when (one clock reading for all), the slowest
 * first-send result among them, how many chunks they completed */
struct burst {
	double t, slowest;
	int64_t got;
};

/* batch.c */
int xagg_send_run(struct xagg_exchange *x, const uint8_t *buf, int64_t n, const struct sockaddr_in *to);
int64_t xagg_receive(struct xagg_exchange *x, struct round *rd, double wait);
void xagg_take_datagram(struct xagg_exchange *x, struct round *rd, const uint8_t *d, size_t len,
			struct burst *b);
int xagg_drain_socket(struct xagg_exchange *x, struct round *rd, struct burst *b);
int64_t xagg_burst_end(struct xagg_exchange *x, const struct burst *b);

/* retransmit.c */
void xagg_note_order(struct xagg_exchange *x, uint64_t newest, uint64_t first_seq);
int xagg_fast_retransmit(struct xagg_exchange *x, struct round *rd, double t);
int64_t xagg_resend_late(struct xagg_exchange *x, struct round *rd, double t, double age, int64_t most);

/* exchange.c */
void xagg_rtt_sample(struct xagg_exchange *x, double r);

#endif /* XAGG_EXCHANGE_H */
