/* SPDX-License-Identifier: MIT */
/* One client's AF_XDP socket: the transport (exchange.h) the round loop
 * sends and receives through instead of its UDP socket, set up and torn
 * down by xsk.c, its rings driven by xsk_rings.c. Only the AF_XDP build of
 * the library (native.py, linked with libxdp) has these.
 */
#ifndef XAGG_XSK_H
#define XAGG_XSK_H

#include <stdint.h>
#include <xdp/xsk.h>

#include "exchange.h"

#define XSK_HDR 42		/* Ethernet + IPv4 (no options) + UDP */
#define XSK_RX_FRAMES 4096	/* fill ring and the frames it lends the kernel */
#define XSK_TX_FRAMES 4096	/* TX ring and the frames requests are written into */
#define XSK_BATCH 256		/* ring entries handled per reserve/peek */

struct xagg_xsk {
	struct xagg_transport ops;	/* first: the exchange's transport points here */
	struct xsk_umem *umem;
	struct xsk_socket *xsk;
	struct xsk_ring_prod fill, tx;
	struct xsk_ring_cons comp, rx;
	uint8_t *area;			/* the UMEM: RX frames, then TX frames */
	uint32_t frame_size;
	uint64_t *free_tx;		/* TX frames not in the kernel's hands */
	uint32_t n_free;
	int fd;				/* the XSK's */
	int ifindex;
	uint32_t queue;
	int zerocopy;
	int tx_ring;			/* requests leave from the TX ring (else the UDP socket) */
	int mode;			/* how the XDP program runs: XDP_ATTACHED_DRV, _SKB, _HW */
	struct bpf_object *obj;		/* bpf/xsk_redirect.c */
	struct bpf_link *link;		/* its attachment */
	uint8_t *hdrs;			/* per aggregator: the frame's first XSK_HDR bytes */
	int64_t n_aggs;
	int64_t kicks;			/* sendto()s that had the kernel transmit */
	int64_t rx_frames;		/* results read from the RX ring */
};

/* xsk_rings.c */
int xagg_xsk_send_run(struct xagg_exchange *x, const uint8_t *buf, int64_t n, int64_t k);
int64_t xagg_xsk_receive(struct xagg_exchange *x, struct round *rd, double wait);
void xagg_xsk_fill(struct xagg_xsk *s);

#endif /* XAGG_XSK_H */
