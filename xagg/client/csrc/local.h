/* SPDX-License-Identifier: MIT */
/* The aggregator on the worker's own host: its XDP program run on the
 * worker's packets with BPF_PROG_TEST_RUN, its sums read from its slot map
 * (xagg/client/local.py explains why, and is the reference). */
#ifndef XAGG_LOCAL_H
#define XAGG_LOCAL_H
#include <stdint.h>

#define XAGG_FRAME_HDR_MAX 64		/* Ethernet + IPv4 + UDP, with room */

struct xagg_local {
	int32_t agg;			/* the job's aggregator on this host (its index) */
	int32_t prog_fd;		/* its XDP program, from xaggd */
	int32_t slots_fd;		/* its slot map */
	int32_t tx_fd;			/* AF_PACKET socket bound to its interface */
	int32_t ifindex;		/* that interface */
	uint32_t slot_base, gen;	/* the job's main entry there, read before each round */
	uint32_t slot_size;		/* struct xagg_slot: its size and where its fields */
	uint32_t off_gen, off_round, off_done, off_vals;	/* are (from Python's view of xagg_maps.h) */
	uint32_t hdr_len;		/* bytes of hdr put in front of each packet */
	uint8_t hdr[XAGG_FRAME_HDR_MAX];
	/* out */
	int64_t injected;		/* packets run through the program */
	int64_t transmitted;		/* frames it answered with XDP_TX, sent on the interface */
	int64_t polls;			/* slot lookups */
};

int xagg_local_inject(struct xagg_local *l, const uint8_t *pkt, uint32_t size);
int xagg_local_poll(struct xagg_local *l, uint32_t chunk, uint32_t round, uint8_t *slot);
int64_t xagg_local_layout(int64_t *out, int64_t n);

#endif /* XAGG_LOCAL_H */
