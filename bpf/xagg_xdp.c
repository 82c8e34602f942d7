/* SPDX-License-Identifier: GPL-2.0 */
/* xagg data plane: sums fixed-point gradient packets in kernel memory.
 *
 * xagg_xdp      XDP, on the aggregator's NIC. Parses Ethernet/VLAN/IPv4/UDP,
 *               passes anything that is not xagg traffic, validates the xagg
 *               header, adds the payload into the chunk's slot and, on the
 *               last contribution, turns the packet into the result: a
 *               broadcast frame (XDP_TX) or, for unicast fan-out, hands it
 *               to tc through XDP metadata.
 * xagg_tc_fanout tc ingress, same NIC. XDP cannot clone; this program
 *               clone_redirects one copy of a finished chunk per worker.
 *
 * Multi-queue safety: each slot carries a bpf_spin_lock, taken once per
 * packet around the whole add. Per-element atomics cost 20x more; a lock
 * per packet costs one uncontended cmpxchg pair, and two CPUs contend only
 * when they hold packets of the very same chunk. Built with -DXAGG_LOCK=0
 * the program is single-queue only (benchmarks compare both).
 *
 * Jumbo frames: built with -DXAGG_FRAGS=1 (and loaded with
 * BPF_F_XDP_HAS_FRAGS) the payload may run past the frame's first buffer.
 * The headers are still read in place (they always sit in the first one);
 * the payload is copied into a per-CPU buffer with bpf_xdp_load_bytes
 * before the lock, and the result written back with bpf_xdp_store_bytes.
 *
 * The XDP program runs in stages, each returning the packet's XDP action
 * or XAGG_GO_ON: xagg_admit.h up to the slot, xagg_slot.h the slot itself,
 * xagg_emit.h what leaves. Every map access is in this file, because bcc
 * rewrites `map.lookup()` only in the file it compiles: the stages use the
 * accessors below.
 */
#include <uapi/linux/bpf.h>
#include <linux/in.h>
#include <linux/pkt_cls.h>

#include "xagg_consts.h"
#include "xagg_proto.h"
#include "xagg_maps.h"
#include "xagg_parse.h"
#include "xagg_slot.h"

/* a stage's "not decided yet": the next stage runs (no XDP action is < 0) */
#define XAGG_GO_ON	(-1)

/* What the stages learn of a packet, each field set by the stage named. */
struct xagg_pkt {
	struct ethhdr *eth;		/* parse_udp */
	struct iphdr *iph;
	struct udphdr *udph;
	struct xagg_hdr *xh;
	__u32 l3_off;
	__u32 payload_off;		/* check_header */
	__s32 *vals;			/* the frame's, or after find_slot the payload
					 * wherever slot_update reads and writes it */
	__u32 job_id;			/* find_job */
	struct xagg_job *job;
	__u64 mask;			/* check_sender: the contributors it carries, */
	__u32 k;			/* as bits of this word of a slot's set, */
	__u32 n;			/* this many */
	__u32 row;			/* the sender's (see sender_row) */
	struct xagg_slot *slot;		/* find_slot */
	struct xagg_worker *sender;	/* settle: its row, after the update */
};

static __always_inline void count(__u32 verdict)
{
	__u64 *c = counters.lookup(&verdict);

	if (c)
		(*c)++;
}

static __always_inline void count_job(__u32 job_index, int outcome)
{
	struct xagg_job_stats *st = job_stats.lookup(&job_index);

	if (!st)
		return;
	switch (outcome) {
	case SLOT_ADDED:
		st->aggregated++;
		break;
	case SLOT_COMPLETED:
		st->aggregated++;
		st->completed++;
		break;
	case SLOT_DONE_RESEND:
	case SLOT_PARTIAL_RESEND:
		st->retransmits++;
		break;
	case SLOT_FINAL:
		break;
	default:
		st->dropped++;
	}
}

static __always_inline int drop(__u32 verdict)
{
	count(verdict);
	return XDP_DROP;
}

static __always_inline int pass(void)
{
	count(XAGG_V_PASSED);
	return XDP_PASS;
}

static __always_inline struct xagg_job *job_entry(struct xagg_job_key *key)
{
	return jobs.lookup(key);
}

static __always_inline struct xagg_worker *worker_at(__u32 row)
{
	return workers.lookup(&row);
}

static __always_inline struct xagg_worker *child_at(__u32 row)
{
	return children.lookup(&row);
}

static __always_inline struct xagg_slot *slot_at(__u32 key)
{
	return slots.lookup(&key);
}

/* The packet's payload where slot_combine can read it: in place in a
 * linear frame (the caller proved its bounds), or copied out of a
 * multi-buffer one whose total length the caller checked. */
static __always_inline __s32 *payload_of(struct xdp_md *ctx, __s32 *pv, __u32 payload_off)
{
#if XAGG_FRAGS
	__u32 zero = 0;
	struct xagg_payload *buf = payload_buf.lookup(&zero);

	if (!buf || bpf_xdp_load_bytes(ctx, payload_off, buf->vals, XAGG_VALS * 4))
		return NULL;
	return buf->vals;
#else
	return pv;
#endif
}

/* The sender's row, looked up again after the slot update rather than
 * kept from before it. A pointer kept live would differ between the worker
 * and the child paths (another map, another lookup), so the verifier would
 * walk the whole update once per path; a row index that nothing uses
 * precisely lets it prune the two into one. That keeps the multi-buffer
 * build, whose value loops it walks one by one, inside its budget of one
 * million instructions. */
static __always_inline struct xagg_worker *sender_row(struct xagg_hdr *xh, __u32 row)
{
	if (xh->flags & XAGG_F_PARTIAL)
		return children.lookup(&row);
	return workers.lookup(&row);
}

#include "xagg_admit.h"
#include "xagg_probe.h"
#include "xagg_emit.h"

int xagg_xdp(struct xdp_md *ctx)
{
	struct xagg_pkt p = {};
	int action;

	action = parse_udp(ctx, &p);
	if (action != XAGG_GO_ON)
		return action;
	action = answer_probe(ctx, &p);
	if (action != XAGG_GO_ON)
		return action;
	action = check_header(ctx, &p);
	if (action != XAGG_GO_ON)
		return action;
	action = find_job(&p);
	if (action != XAGG_GO_ON)
		return action;
	action = check_sender(&p);
	if (action != XAGG_GO_ON)
		return action;
	action = find_slot(ctx, &p);
	if (action != XAGG_GO_ON)
		return action;
	return emit(ctx, &p, settle(&p));
}

#define IP_DST_OFF	offsetof(struct iphdr, daddr)
#define IP_CSUM_OFF	offsetof(struct iphdr, check)
#define UDP_DPORT_OFF	offsetof(struct udphdr, dest)

/* Where the IPv4 header starts in the frame as tc sees it. Not XDP's
 * l3_off: between the two programs the stack pulls a VLAN tag out of the
 * frame into the skb (skb_vlan_untag, before tc ingress), and whether the
 * frame carried one in XDP depends on the sender's and the driver's VLAN
 * offload. Returns -1 when the frame is not IPv4 here. */
static __always_inline int tc_l3_off(struct __sk_buff *skb)
{
	__u16 proto;
	int off = offsetof(struct ethhdr, h_proto), i;

#pragma unroll
	for (i = 0; i <= XAGG_VLAN_MAX_DEPTH; i++) {
		if (bpf_skb_load_bytes(skb, off, &proto, sizeof(proto)))
			return -1;
		if (proto == htons(ETH_P_IP))
			return off + sizeof(proto);
		if (!proto_is_vlan(proto))
			return -1;
		off += sizeof(struct xagg_vlan_hdr);
	}
	return -1;
}

/* One copy of the result, as it stands, to mac/daddr:dport. */
static __always_inline void tc_send_copy(struct __sk_buff *skb, __u32 l3_off, __u32 *old_ip,
					 __u8 *mac, __u32 daddr, __u16 dport)
{
	bpf_skb_store_bytes(skb, 0, mac, ETH_ALEN, 0);
	bpf_l3_csum_replace(skb, l3_off + IP_CSUM_OFF, *old_ip, daddr, 4);
	bpf_skb_store_bytes(skb, l3_off + IP_DST_OFF, &daddr, 4, 0);
	bpf_skb_store_bytes(skb, l3_off + sizeof(struct iphdr) + UDP_DPORT_OFF, &dport, 2, 0);
	*old_ip = daddr;
	bpf_clone_redirect(skb, skb->ifindex, 0);
}

int xagg_tc_fanout(struct __sk_buff *skb)
{
	void *data = (void *)(long)skb->data;
	struct xagg_meta *meta = (void *)(long)skb->data_meta;
	struct xagg_job_key jkey = {};
	struct xagg_job *job;
	struct xagg_worker *w;
	__u32 l3_off, key, old_ip, i;
	int off;

	if ((void *)(meta + 1) > data || meta->magic != XAGG_META_MAGIC)
		return TC_ACT_OK;
	jkey.job_id = meta->job_id;
	jkey.agg_id = meta->agg_key;
	off = tc_l3_off(skb);
	if (off < 0)
		return TC_ACT_SHOT;
	l3_off = off;
	job = jobs.lookup(&jkey);
	if (!job)
		return TC_ACT_SHOT;
	if (bpf_skb_load_bytes(skb, l3_off + IP_DST_OFF, &old_ip, 4))
		return TC_ACT_SHOT;

	/* the child aggregators fan out to their own workers */
	for (i = 0; i < XAGG_MAX_CHILDREN && i < job->n_children; i++) {
		key = job->job_index * XAGG_MAX_CHILDREN + i;
		w = children.lookup(&key);
		if (!w || !w->port)
			continue;	/* no partial from it yet: nowhere known */
		tc_send_copy(skb, l3_off, &old_ip, w->mac, w->addr, w->port);
	}
	if (job->fanout == XAGG_FANOUT_BCAST) {
		/* the workers served directly share one broadcast (or group) frame */
		__u8 bcast[ETH_ALEN];

		fanout_mac(bcast, job->bcast_ip);
		tc_send_copy(skb, l3_off, &old_ip, bcast, job->bcast_ip, job->result_port);
		return TC_ACT_SHOT;
	}
	/* One copy per worker: the entry's workers are one 64-worker block
	 * (a child entry's, or a main entry of at most 64: xaggd refuses
	 * unicast beyond, which would cost a copy per worker per chunk) */
	for (i = 0; i < 64; i++) {
		if (!(job->full_set[job->up_block & (XAGG_SET_WORDS - 1)] & (1ULL << i)))
			continue;
		key = job->job_index * XAGG_MAX_WORKERS + job->up_block * 64 + i;
		w = workers.lookup(&key);
		if (!w || !w->port)
			continue;	/* never heard from (or served by a child) */
		tc_send_copy(skb, l3_off, &old_ip, w->mac, w->addr, w->port);
	}
	return TC_ACT_SHOT;
}
