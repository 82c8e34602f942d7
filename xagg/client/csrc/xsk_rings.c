// SPDX-License-Identifier: MIT
/* The AF_XDP transport's rings (xsk.h): the round loop of exchange.c and
 * the retransmit rules of retransmit.c run unchanged on top, only the two
 * calls that touch the network come here.
 *
 * Send: each packet is written once, into a free TX frame, behind its
 * aggregator's prebuilt Ethernet/IPv4/UDP header (fixed for a client: same
 * addresses, same length, no IP options, UDP checksum 0), a whole run
 * reserved and submitted at once; the kernel is kicked only when the ring
 * says it needs it (copy mode always does: each sendto() moves a batch and
 * says EAGAIN while more is left). Frames come back on the completion ring.
 *
 * Receive: results are taken straight out of the RX ring's frames (the
 * codec dequantises from there), the frames handed back on the fill ring in
 * the same batch. Results that reached another queue, or came before the
 * XDP program held the socket, arrive at the client's UDP socket, which is
 * drained in the same burst: the path never depends on where a frame lands.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <poll.h>
#include <arpa/inet.h>
#include <linux/udp.h>

#include "xsk.h"

#define KICKS_MAX 256		/* sendto()s per kick before leaving the rest for later */
#define FRAME_WAIT 0.0005	/* wait for the kernel to free TX frames (s) */

static struct xagg_xsk *xsk_of(const struct xagg_exchange *x)
{
	return (struct xagg_xsk *)x->transport;
}

/* TX frames the kernel has sent, back on the free list */
static void reclaim(struct xagg_xsk *s)
{
	uint32_t idx, n = xsk_ring_cons__peek(&s->comp, XSK_TX_FRAMES, &idx);

	for (uint32_t i = 0; i < n; i++)
		s->free_tx[s->n_free++] = *xsk_ring_cons__comp_addr(&s->comp, idx + i);
	xsk_ring_cons__release(&s->comp, n);
}

static int tx_pending(struct xagg_xsk *s)
{
	return xsk_prod_nb_free(&s->tx, XSK_TX_FRAMES) < XSK_TX_FRAMES;
}

/* Have the kernel send what the TX ring holds; -1 (x->err) on a real error.
 * A zero-copy driver, once woken, sends on its own; copy mode sends a
 * batch per call. A full device queue or send buffer leaves the rest for
 * the next kick. */
static int kick(struct xagg_exchange *x, struct xagg_xsk *s)
{
	for (int i = 0; i < KICKS_MAX && tx_pending(s) && xsk_ring_prod__needs_wakeup(&s->tx); i++) {
		s->kicks++;
		if (sendto(s->fd, NULL, 0, MSG_DONTWAIT, NULL, 0) >= 0 || errno == EAGAIN || errno == EINTR) {
			if (s->zerocopy)
				return 0;
			continue;
		}
		if (errno == EBUSY || errno == ENOBUFS)
			return 0;
		x->err = errno;
		return -1;
	}
	return 0;
}

/* Lend every RX frame to the kernel (at open). */
void xagg_xsk_fill(struct xagg_xsk *s)
{
	uint32_t idx, n = xsk_ring_prod__reserve(&s->fill, XSK_RX_FRAMES, &idx);

	for (uint32_t i = 0; i < n; i++)
		*xsk_ring_prod__fill_addr(&s->fill, idx + i) = (uint64_t)i * s->frame_size;
	xsk_ring_prod__submit(&s->fill, n);
}

static uint32_t min3(int64_t a, uint32_t b, uint32_t c)
{
	uint32_t m = b < c ? b : c;

	return a < m ? (uint32_t)a : m;
}

int xagg_xsk_send_run(struct xagg_exchange *x, const uint8_t *buf, int64_t n, int64_t k)
{
	struct xagg_xsk *s = xsk_of(x);
	size_t size = x->pkt_size;
	const uint8_t *hdr = s->hdrs + k * XSK_HDR;
	uint32_t idx, got;

	for (int64_t i = 0; i < n; i += got) {
		reclaim(s);
		got = min3(n - i, s->n_free, XSK_BATCH);
		got = got ? xsk_ring_prod__reserve(&s->tx, got, &idx) : 0;
		if (!got) {		/* every frame or ring slot in flight */
			if (kick(x, s))
				return -1;
			wait_fd(s->fd, POLLOUT, FRAME_WAIT);
			continue;
		}
		for (uint32_t j = 0; j < got; j++) {
			struct xdp_desc *d = xsk_ring_prod__tx_desc(&s->tx, idx + j);
			uint8_t *f = xsk_umem__get_data(s->area, d->addr = s->free_tx[--s->n_free]);

			memcpy(f, hdr, XSK_HDR);
			memcpy(f + XSK_HDR, buf + (i + j) * size, size);
			d->len = XSK_HDR + size;
			d->options = 0;
		}
		xsk_ring_prod__submit(&s->tx, got);
		x->sent += got;
	}
	return kick(x, s);
}

/* Every result the RX ring holds, its frames lent back at once. */
static void drain_rx(struct xagg_exchange *x, struct round *rd, struct xagg_xsk *s, struct burst *b)
{
	uint32_t n, rx_at, fill_at;
	uint64_t mask = ~(uint64_t)(s->frame_size - 1);

	while ((n = xsk_ring_cons__peek(&s->rx, XSK_BATCH, &rx_at))) {
		/* as many fill slots as RX frames: this never comes up short */
		n = xsk_ring_prod__reserve(&s->fill, n, &fill_at);
		for (uint32_t i = 0; i < n; i++) {
			const struct xdp_desc *d = xsk_ring_cons__rx_desc(&s->rx, rx_at + i);
			const uint8_t *f = xsk_umem__get_data(s->area, d->addr);
			const struct udphdr *u = (const void *)(f + XSK_HDR - sizeof(*u));
			size_t len = d->len >= XSK_HDR ? ntohs(u->len) - sizeof(*u) : 0;

			if (len > d->len - XSK_HDR)	/* the XDP program checked it is IPv4/UDP, no options */
				len = 0;
			xagg_take_datagram(x, rd, f + XSK_HDR, len, b);
			*xsk_ring_prod__fill_addr(&s->fill, fill_at + i) = d->addr & mask;
		}
		xsk_ring_prod__submit(&s->fill, n);
		xsk_ring_cons__release(&s->rx, n);
		s->rx_frames += n;
	}
	if (xsk_ring_prod__needs_wakeup(&s->fill))
		recvfrom(s->fd, NULL, 0, MSG_DONTWAIT, NULL, NULL);
}

int64_t xagg_xsk_receive(struct xagg_exchange *x, struct round *rd, double wait)
{
	struct xagg_xsk *s = xsk_of(x);
	struct pollfd p[2] = { { .fd = s->fd, .events = POLLIN }, { .fd = x->fd, .events = POLLIN } };
	struct timespec ts = { .tv_sec = (time_t)wait };
	struct burst b = { .slowest = -1 };

	if (kick(x, s))			/* what a full queue left in the ring */
		return -1;
	reclaim(s);
	ts.tv_nsec = (long)((wait - ts.tv_sec) * 1e9);
	if (ppoll(p, 2, &ts, NULL) < 0)
		p[1].revents = POLLIN;	/* interrupted: look at the socket anyway */
	b.t = now();
	drain_rx(x, rd, s, &b);
	/* nearly every result comes through the ring: a recvmmsg() per burst
	 * on an empty socket would cost more than the ring itself */
	if ((p[1].revents & POLLIN) && xagg_drain_socket(x, rd, &b))
		return -1;
	return xagg_burst_end(x, &b);
}
