// SPDX-License-Identifier: MIT
/* The aggregator on the worker's own host, for the C round loop: the same
 * steps as LocalDataplane.inject and .poll in xagg/client/local.py (which
 * says why a worker there cannot use the network). */
#define _GNU_SOURCE
#include <errno.h>
#include <poll.h>
#include <stddef.h>
#include <string.h>
#include <unistd.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <linux/bpf.h>

#include "local.h"
#include "layout.h"

/* the largest frame: a 9000-byte MTU's packet behind its headers */
#define FRAME_MAX (XAGG_FRAME_HDR_MAX + 9000)

static long sys_bpf(int cmd, union bpf_attr *attr)
{
	return syscall(__NR_bpf, cmd, attr, sizeof(*attr));
}

/* One packet through the program as if it had arrived on the interface;
 * what the program transmits (XDP_TX: a result, or a partial for a parent)
 * goes out on the interface. 0, or -1 with errno. */
int xagg_local_inject(struct xagg_local *l, const uint8_t *pkt, uint32_t size)
{
	uint8_t in[FRAME_MAX], out[FRAME_MAX];
	struct xdp_md md = { 0 };
	union bpf_attr attr;
	uint32_t len = l->hdr_len + size;

	if (len > sizeof(in) || l->hdr_len > XAGG_FRAME_HDR_MAX) {
		errno = EMSGSIZE;
		return -1;
	}
	memcpy(in, l->hdr, l->hdr_len);
	memcpy(in + l->hdr_len, pkt, size);
	md.data_end = len;		/* the whole frame: the kernel splits it into fragments */
	md.ingress_ifindex = l->ifindex;
	memset(&attr, 0, sizeof(attr));
	attr.test.prog_fd = l->prog_fd;
	attr.test.data_in = (uintptr_t)in;
	attr.test.data_size_in = len;
	attr.test.data_out = (uintptr_t)out;
	attr.test.data_size_out = sizeof(out);
	attr.test.ctx_in = (uintptr_t)&md;
	attr.test.ctx_size_in = sizeof(md);
	attr.test.repeat = 1;
	if (sys_bpf(BPF_PROG_TEST_RUN, &attr))
		return -1;
	l->injected++;
	if (attr.test.retval != XDP_TX)
		return 0;	/* summed and kept (XDP_DROP), or a copy for tc: see local.py */
	while (send(l->tx_fd, out, attr.test.data_size_out, 0) < 0) {
		if (errno != EAGAIN && errno != ENOBUFS && errno != EINTR)
			return -1;
		poll(NULL, 0, 1);	/* the interface's queue is full: let it drain */
	}
	l->transmitted++;
	return 0;
}

/* Chunk `chunk`'s slot for `round` into `slot` (slot_size bytes): 1 when it
 * holds the round's finished sum (at off_vals), 0 when not yet, -1 with
 * errno. Read without the slot lock: `done` is set after the last add and
 * the lookup copies in address order, done before the values; and the
 * slot is not reused before this worker has finished the round. */
int xagg_local_poll(struct xagg_local *l, uint32_t chunk, uint32_t round, uint8_t *slot)
{
	uint32_t key = l->slot_base + chunk * 2 + (round & 1), gen, rnd, done;
	union bpf_attr attr;

	memset(&attr, 0, sizeof(attr));
	attr.map_fd = l->slots_fd;
	attr.key = (uintptr_t)&key;
	attr.value = (uintptr_t)slot;
	if (sys_bpf(BPF_MAP_LOOKUP_ELEM, &attr))
		return errno == ENOENT ? 0 : -1;
	l->polls++;
	memcpy(&gen, slot + l->off_gen, 4);
	memcpy(&rnd, slot + l->off_round, 4);
	memcpy(&done, slot + l->off_done, 4);
	return gen == l->gen && rnd == round && done;
}

/* sizeof and the offset of every field, in declaration order */
#define F(f) offsetof(struct xagg_local, f)
static const int64_t layout[] = {
	sizeof(struct xagg_local), F(agg), F(prog_fd), F(slots_fd), F(tx_fd), F(ifindex),
	F(slot_base), F(gen), F(slot_size), F(off_gen), F(off_round), F(off_done), F(off_vals),
	F(hdr_len), F(hdr), F(injected), F(transmitted), F(polls),
};
#undef F

int64_t xagg_local_layout(int64_t *out, int64_t n)
{
	return xagg_copy_layout(layout, sizeof(layout) / sizeof(layout[0]), out, n);
}
