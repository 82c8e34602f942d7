// SPDX-License-Identifier: MIT
/* Setting up and tearing down one client's AF_XDP socket (xsk.h): a UMEM
 * whose first half lends frames to the kernel for results and whose second
 * half holds requests being sent; the XSK bound to one queue of the
 * interface (zero-copy where the driver has it, copy mode otherwise, with
 * need_wakeup so a zero-copy driver is not woken for nothing); and the
 * worker's XDP program (bpf/xsk_redirect.c), attached for the life of the
 * process, told the client's port and given the socket. Every failure comes back as a sentence: the client then runs its
 * UDP path and says why.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>
#include <linux/if_xdp.h>
#include <bpf/bpf.h>
#include <bpf/libbpf.h>
#include <xdp/libxdp.h>

#include "xsk.h"

#ifndef SO_SNDBUFFORCE
#define SO_SNDBUFFORCE 32
#endif
/* Copy mode turns each request into an skb charged to the socket's send
 * buffer until the far end frees it: a default buffer would cap requests in
 * flight far below the window. */
#define XSK_SNDBUF (16 << 20)
#ifndef XDP_MAX_TX_SKB_BUDGET
#define XDP_MAX_TX_SKB_BUDGET 9
#endif

static __thread char lib_msg[200];	/* libxdp's or libbpf's last complaint, for the reason */

static int keep_msg(const char *fmt, va_list ap)
{
	int n = vsnprintf(lib_msg, sizeof(lib_msg), fmt, ap);

	while (n > 0 && n < (int)sizeof(lib_msg) && lib_msg[n - 1] == '\n')
		lib_msg[--n] = 0;
	return 0;
}

static int xdp_msg(enum libxdp_print_level level, const char *fmt, va_list ap)
{
	return level <= LIBXDP_WARN ? keep_msg(fmt, ap) : 0;
}

static int bpf_msg(enum libbpf_print_level level, const char *fmt, va_list ap)
{
	return level <= LIBBPF_WARN ? keep_msg(fmt, ap) : 0;
}

static void *fail(char *err, size_t len, const char *what, int e)
{
	snprintf(err, len, "%s: %s%s%s", what, strerror(e < 0 ? -e : e), lib_msg[0] ? " (" : "",
		 lib_msg[0] ? lib_msg : "");
	if (lib_msg[0])
		strncat(err, ")", len - strlen(err) - 1);
	return NULL;
}

static int make_umem(struct xagg_xsk *s, uint32_t frame_size)
{
	struct xsk_umem_config cfg = {
		.fill_size = XSK_RX_FRAMES,
		.comp_size = XSK_TX_FRAMES,
		.frame_size = frame_size,
	};
	size_t size = (size_t)(XSK_RX_FRAMES + XSK_TX_FRAMES) * frame_size;

	s->frame_size = frame_size;
	s->area = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	if (s->area == MAP_FAILED) {
		s->area = NULL;
		return -errno;
	}
	s->free_tx = calloc(XSK_TX_FRAMES, sizeof(*s->free_tx));
	if (!s->free_tx)
		return -ENOMEM;
	for (uint32_t i = 0; i < XSK_TX_FRAMES; i++)
		s->free_tx[s->n_free++] = (uint64_t)(XSK_RX_FRAMES + i) * frame_size;
	return xsk_umem__create(&s->umem, s->area, size, &s->fill, &s->comp, &cfg);
}

static int make_socket(struct xagg_xsk *s, const char *ifname)
{
	struct xsk_socket_config cfg = {
		.rx_size = XSK_RX_FRAMES,
		.tx_size = XSK_TX_FRAMES,
		.libxdp_flags = XSK_LIBXDP_FLAGS__INHIBIT_PROG_LOAD,	/* ours is bpf/xsk_redirect.c */
		.bind_flags = XDP_USE_NEED_WAKEUP,	/* neither COPY nor ZEROCOPY: the kernel picks */
	};
	struct xdp_options opts = { 0 };
	socklen_t len = sizeof(opts);
	int rc, buf = XSK_SNDBUF, budget = XSK_BATCH;

	rc = xsk_socket__create(&s->xsk, ifname, s->queue, s->umem, &s->rx, &s->tx, &cfg);
	if (rc)
		return rc;
	s->fd = xsk_socket__fd(s->xsk);
	if (setsockopt(s->fd, SOL_SOCKET, SO_SNDBUFFORCE, &buf, sizeof(buf)))
		setsockopt(s->fd, SOL_SOCKET, SO_SNDBUF, &buf, sizeof(buf));
	/* copy mode sends at most this many frames per sendto() (kernels since
	 * 6.17 let it be raised; older ones keep 32) */
	setsockopt(s->fd, SOL_XDP, XDP_MAX_TX_SKB_BUDGET, &budget, sizeof(budget));
	if (!getsockopt(s->fd, SOL_XDP, XDP_OPTIONS, &opts, &len))
		s->zerocopy = !!(opts.flags & XDP_OPTIONS_ZEROCOPY);
	return 0;
}

/* Attached through a BPF link, not netlink: the link dies with the process,
 * so a client killed mid-round leaves no program behind to refuse the next
 * one. The kernel attaches in driver mode where the driver has XDP, else
 * generic; an interface that already runs another XDP program refuses
 * (EBUSY), and the client stays on UDP. */
static int attach_prog(struct xagg_xsk *s, const char *obj, uint16_t port_be)
{
	LIBBPF_OPTS(bpf_xdp_query_opts, q);
	struct bpf_program *prog;
	uint32_t zero = 0, port = port_be;
	int rc, fd;

	s->obj = bpf_object__open_file(obj, NULL);
	if ((rc = (int)libbpf_get_error(s->obj))) {
		s->obj = NULL;
		return rc;
	}
	if ((rc = bpf_object__load(s->obj)))
		return rc;
	prog = bpf_object__find_program_by_name(s->obj, "xagg_xsk");
	if (!prog)
		return -ENOENT;
	s->link = bpf_program__attach_xdp(prog, s->ifindex);
	if ((rc = (int)libbpf_get_error(s->link))) {
		s->link = NULL;
		return rc;
	}
	if (!bpf_xdp_query(s->ifindex, 0, &q))
		s->mode = q.attach_mode;
	fd = bpf_object__find_map_fd_by_name(s->obj, "port");
	if (fd < 0 || bpf_map_update_elem(fd, &zero, &port, 0))
		return fd < 0 ? fd : -errno;
	fd = bpf_object__find_map_fd_by_name(s->obj, "xsks");
	return fd < 0 ? fd : xsk_socket__update_xskmap(s->xsk, fd);
}

void xagg_xsk_close(struct xagg_xsk *s)
{
	if (!s)
		return;
	bpf_link__destroy(s->link);
	bpf_object__close(s->obj);
	if (s->xsk)
		xsk_socket__delete(s->xsk);
	if (s->umem)
		xsk_umem__delete(s->umem);
	if (s->area)
		munmap(s->area, (size_t)(XSK_RX_FRAMES + XSK_TX_FRAMES) * s->frame_size);
	free(s->free_tx);
	free(s->hdrs);
	free(s);
}

/* An XSK on (ifname, queue) for a client whose results come to UDP port
 * port_be (network order), sending to n_aggs aggregators whose frames begin
 * with hdrs (XSK_HDR bytes each) through its TX ring where tx_ring says
 * (-1: where zero-copy). NULL with the reason in err if any step
 * fails (nothing is left behind then). */
struct xagg_xsk *xagg_xsk_open(const char *ifname, int ifindex, uint32_t queue, const char *obj, uint16_t port_be,
			       const uint8_t *hdrs, int64_t n_aggs, uint32_t frame_size, int tx_ring, char *err,
			       size_t errlen)
{
	struct xagg_xsk *s = calloc(1, sizeof(*s));
	int rc;

	libxdp_set_print(xdp_msg);
	libbpf_set_print(bpf_msg);
	lib_msg[0] = 0;
	if (!s || !(s->hdrs = malloc(n_aggs * XSK_HDR))) {
		free(s);
		return fail(err, errlen, "memory", ENOMEM);
	}
	memcpy(s->hdrs, hdrs, n_aggs * XSK_HDR);
	s->n_aggs = n_aggs;
	s->ifindex = ifindex;
	s->queue = queue;
	s->fd = -1;
	s->ops.send_run = xagg_xsk_send_run;
	s->ops.receive = xagg_xsk_receive;
	if ((rc = make_umem(s, frame_size))) {
		xagg_xsk_close(s);
		return fail(err, errlen, "UMEM", rc);
	}
	if ((rc = make_socket(s, ifname))) {
		xagg_xsk_close(s);
		return fail(err, errlen, "XSK socket", rc);
	}
	if ((rc = attach_prog(s, obj, port_be))) {
		xagg_xsk_close(s);
		return fail(err, errlen, "XDP program", rc);
	}
	/* Copy mode builds an skb per request on the TX ring, each crossing the
	 * device, bridge and firewall hooks alone: UDP GSO crosses them once per
	 * 64 datagrams and is cheaper. The ring sends only where it is
	 * zero-copy, unless tx_ring (1: the ring, 0: the socket) says. */
	s->tx_ring = tx_ring < 0 ? s->zerocopy : tx_ring;
	if (!s->tx_ring)
		s->ops.send_run = NULL;
	xagg_xsk_fill(s);
	return s;
}

/* What the socket is and did: zero-copy, XDP attach mode (XDP_ATTACHED_*), sendto()s that
 * had the kernel transmit, results read, then the kernel's XDP_STATISTICS
 * (rx_dropped, rx_invalid_descs, tx_invalid_descs, rx_ring_full,
 * rx_fill_ring_empty_descs, tx_ring_empty_descs), requests sent from the
 * TX ring (else the UDP socket). Returns how many of
 * out's n it filled. */
int64_t xagg_xsk_info(const struct xagg_xsk *s, int64_t *out, int64_t n)
{
	struct xdp_statistics st = { 0 };
	socklen_t len = sizeof(st);
	int64_t v[11];

	getsockopt(s->fd, SOL_XDP, XDP_STATISTICS, &st, &len);
	v[0] = s->zerocopy, v[1] = s->mode, v[2] = s->kicks, v[3] = s->rx_frames;
	v[4] = st.rx_dropped, v[5] = st.rx_invalid_descs, v[6] = st.tx_invalid_descs;
	v[7] = st.rx_ring_full, v[8] = st.rx_fill_ring_empty_descs, v[9] = st.tx_ring_empty_descs;
	v[10] = s->tx_ring;
	n = n < 11 ? n : 11;
	memcpy(out, v, n * sizeof(*v));
	return n;
}
