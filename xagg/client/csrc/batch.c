// SPDX-License-Identifier: MIT
/* Sending and receiving a round's packets in batches: a run of packets to
 * one aggregator in UDP GSO sends where the kernel has them, results read
 * in recvmmsg(2) bursts. One system call for dozens of datagrams is what
 * lets one core keep up with the link.
 */
#define _GNU_SOURCE
#include <errno.h>

#include "exchange.h"

#ifndef SOL_UDP
#define SOL_UDP 17
#endif
#ifndef UDP_SEGMENT
#define UDP_SEGMENT 103
#endif
#define GSO_MAX_BYTES 65000	/* one GSO send stays under 64 KiB */
#define GSO_MAX_SEGS 64		/* and under the kernel's segment limit */

/* One GSO send of segs packets of size bytes from buf. */
static ssize_t send_gso(int fd, const uint8_t *buf, size_t size, int64_t segs, const struct sockaddr_in *to)
{
	char cbuf[CMSG_SPACE(sizeof(uint16_t))] = { 0 };
	struct iovec iov = {
		.iov_base = (void *)buf,
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
	return sendmsg(fd, &mh, 0);
}

/* n consecutive packets to one aggregator: GSO batches, or one datagram
 * per call. A full send buffer (shaped link) waits for room and retries. */
int xagg_send_run(struct xagg_exchange *x, const uint8_t *buf, int64_t n, const struct sockaddr_in *to)
{
	size_t size = x->pkt_size;
	int64_t i = 0, segs;
	ssize_t r;

	if (x->transport && x->transport->send_run)
		return x->transport->send_run(x, buf, n, to - x->addrs);
	while (i < n) {
		segs = GSO_MAX_BYTES / size;
		if (segs > GSO_MAX_SEGS)
			segs = GSO_MAX_SEGS;
		if (segs > n - i)
			segs = n - i;
		if (x->gso && segs > 1) {
			r = send_gso(x->fd, buf + i * size, size, segs, to);
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

/* The row of a whole datagram (len bytes at h) whose header names this
 * job, cookie and round and one of this round's (aggregator, chunk) pairs;
 * -1 for any other. */
static int32_t row_of(const struct xagg_exchange *x, size_t len, const struct xagg_hdr *h)
{
	if (len != x->pkt_size)
		return -1;
	if (h->magic != XAGG_MAGIC || !(h->flags & XAGG_F_RESULT) ||
	    h->job_id != x->job_id || h->cookie != x->cookie ||
	    h->round != x->round)
		return -1;
	if (h->agg_id >= x->n_aggs || h->chunk >= x->width)
		return -1;
	return x->row_map[h->agg_id * x->width + h->chunk];
}

/* One datagram of a burst, wherever it was read (this socket, or an AF_XDP
 * ring: csrc/xsk.c). A chunk's first result wins (a retransmit may bring
 * it twice). Each result also tells retransmit.c how far results run out
 * of send order, and the slowest first-send result of the burst is one RTT
 * sample (xagg_burst_end). */
void xagg_take_datagram(struct xagg_exchange *x, struct round *rd, const uint8_t *d, size_t len,
			struct burst *b)
{
	struct gaps *g = &rd->g;
	const struct xagg_hdr *h = (const void *)d;
	int32_t row = row_of(x, len, h);
	int first;

	if (row < 0)
		return;
	if (x->done[row]) {	/* a second answer: the resend was spurious */
		/* either answer marked: late for a loss (the marked completion
		 * can come after the answer to this worker's own resend) */
		if (rd->resent[row] && !g->by_resend[row] && !(h->flags & XAGG_F_RESENT))
			xagg_note_order(x, g->newest[h->agg_id], g->first_seq[row]);
		return;
	}
	take_result(x, row, (const int32_t *)(h + 1));
	rd->n_done[h->agg_id]++;
	g->by_resend[row] = !!(h->flags & XAGG_F_RESENT);
	/* a probe's answer that shows a loss (retransmit.c): what was sent
	 * before the probe is lost as well */
	if (rd->resent[row] == RESENT_PROBE && (h->flags & (XAGG_F_RETX | XAGG_F_RESENT)) &&
	    rd->sent_at[row] > g->release_before[h->agg_id])
		g->release_before[h->agg_id] = rd->sent_at[row];
	first = !rd->resent[row];
	if (first && !g->by_resend[row])
		xagg_note_order(x, g->newest[h->agg_id], g->first_seq[row]);
	/* only a first send orders: a resent row's result can overtake rows
	 * sent before the resend but still in flight */
	if (first && g->sent_seq[row] > g->newest[h->agg_id])
		g->newest[h->agg_id] = g->sent_seq[row];
	b->got++;
	/* Karn: a retransmitted chunk's time is ambiguous, and one someone's
	 * resend completed timed a recovery */
	if (first && !g->by_resend[row] && b->t - rd->sent_at[row] > b->slowest)
		b->slowest = b->t - rd->sent_at[row];
}

/* The burst's RTT sample and count; returns the chunks newly done. */
int64_t xagg_burst_end(struct xagg_exchange *x, const struct burst *b)
{
	if (b->slowest >= 0)
		xagg_rtt_sample(x, b->slowest);
	x->received += b->got;
	return b->got;
}

/* Drain the UDP socket into the burst; -1 on error. */
int xagg_drain_socket(struct xagg_exchange *x, struct round *rd, struct burst *b)
{
	struct rx *rx = rd->rx;
	size_t size = x->pkt_size;
	int n, i;

	do {
		n = recvmmsg(x->fd, rx->msgs, RX_BATCH, MSG_DONTWAIT, NULL);
		if (n < 0) {
			if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)
				break;
			x->err = errno;
			return -1;
		}
		for (i = 0; i < n; i++)
			xagg_take_datagram(x, rd, rx->buf + i * size, (rx->msgs[i].msg_hdr.msg_flags & MSG_TRUNC) ?
					   0 : rx->msgs[i].msg_len, b);
	} while (n == RX_BATCH);
	return 0;
}

/* Wait up to `wait` for results and take what came; returns the number
 * of chunks newly done, -1 on error. */
int64_t xagg_receive(struct xagg_exchange *x, struct round *rd, double wait)
{
	struct burst b = { .slowest = -1 };

	if (x->transport)
		return x->transport->receive(x, rd, wait);
	wait_fd(x->fd, POLLIN, wait);
	b.t = now();
	if (xagg_drain_socket(x, rd, &b))
		return -1;
	return xagg_burst_end(x, &b);
}
