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
 */
#include <uapi/linux/bpf.h>
#include <linux/in.h>
#include <linux/pkt_cls.h>

#include "xagg_consts.h"
#include "xagg_proto.h"
#include "xagg_maps.h"
#include "xagg_parse.h"
#include "xagg_slot.h"

#define XAGG_PKT_LEN (sizeof(struct udphdr) + sizeof(struct xagg_hdr) + XAGG_VALS * 4)

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

/* The result slot_update copied into vals, into the packet: already
 * there in a linear frame, stored into the fragments of a multi-buffer one
 * (a helper call, so after the lock). */
static __always_inline int result_out(struct xdp_md *ctx, __s32 *vals, __u32 payload_off)
{
#if XAGG_FRAGS
	return bpf_xdp_store_bytes(ctx, payload_off, vals, XAGG_VALS * 4);
#else
	return 0;
#endif
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

/* The L2 destination of a fan-out to ip (network order): the group's MAC
 * for an IPv4 multicast group (RFC 1112: 01:00:5e + its low 23 bits), so a
 * snooping switch delivers it to the members alone; else broadcast. */
static __always_inline void fanout_mac(__u8 *mac, __u32 ip)
{
	const __u8 *b = (const __u8 *)&ip;

	if ((b[0] & 0xf0) == 0xe0) {
		mac[0] = 0x01;
		mac[1] = 0x00;
		mac[2] = 0x5e;
		mac[3] = b[1] & 0x7f;
		mac[4] = b[2];
		mac[5] = b[3];
	} else {
		__builtin_memset(mac, 0xff, ETH_ALEN);
	}
}

/* memcmp is a libcall BPF does not have: compare as 4 + 2 bytes */
static __always_inline int mac_equal(const __u8 *a, const __u8 *b)
{
	return *(__u32 *)a == *(__u32 *)b &&
	       *(__u16 *)(a + 4) == *(__u16 *)(b + 4);
}

#define XAGG_NO_ROW	0xffffffff

/* The row in `children` of this job's child aggregator at address ip, if it
 * may send a partial sum of mask; else XAGG_NO_ROW. A constant trip count:
 * the verifier walks each unrolled lookup. */
static __always_inline __u32 child_row(struct xagg_job *job, __u32 ip, __u64 mask)
{
	struct xagg_worker *c;
	__u32 key, i;

#pragma unroll
	for (i = 0; i < XAGG_MAX_CHILDREN; i++) {
		key = job->job_index * XAGG_MAX_CHILDREN + i;
		c = children.lookup(&key);
		if (c && c->ip && c->ip == ip)
			return (mask & ~c->mask) ? XAGG_NO_ROW : key;
	}
	return XAGG_NO_ROW;
}

/* The sender's row, looked up again after the slot update rather than
 * kept from before it. A pointer kept live would differ between the worker
 * and the child paths (another map, another lookup), so the verifier would
 * walk the whole update once per path; a row index that nothing uses
 * precisely lets it prune the two into one. That keeps the multi-buffer
 * build, whose value loops it walks one by one, inside its budget of one
 * million instructions (578k processed, 515k before partial sums had rows). */
static __always_inline struct xagg_worker *sender_row(struct xagg_hdr *xh, __u32 row)
{
	if (xh->flags & XAGG_F_PARTIAL)
		return children.lookup(&row);
	return workers.lookup(&row);
}

/* Where a contributor's results go, from a packet of its that was summed.
 * A pinned contributor's address is its registered one, never learned.
 * Written only on change so the hot path does not bounce the cache line. */
static __always_inline void learn(struct xagg_worker *w, __u32 saddr, __u16 sport,
				  const __u8 *mac)
{
	if ((w->ip || w->addr == saddr) && w->port == sport && mac_equal(w->mac, mac))
		return;
	if (!w->ip)
		w->addr = saddr;
	w->port = sport;
	__builtin_memcpy(w->mac, mac, ETH_ALEN);
}

/* Turn the request into a result leaving from this host: source becomes
 * our address, the result goes to daddr:dport. UDP checksum 0 (allowed in
 * IPv4): recomputing it over 1 KB per packet would double the cost. */
static __always_inline void make_reply(struct iphdr *iph, struct udphdr *udph,
				       struct xagg_hdr *xh, __u32 daddr,
				       __u16 dport, __u64 full_mask, __u8 flags)
{
	iph->saddr = iph->daddr;
	iph->daddr = daddr;
	iph->ttl = 64;
	iph->check = 0;
	iph->check = ipv4_csum(iph);
	udph->source = htons(XAGG_PORT);
	udph->dest = dport;
	udph->check = 0;
	xh->flags = flags;
	xh->worker_mask = full_mask;
}

static __always_inline void make_result(struct iphdr *iph, struct udphdr *udph,
					struct xagg_hdr *xh, __u32 daddr,
					__u16 dport, __u64 full_mask, __u8 flags)
{
	make_reply(iph, udph, xh, daddr, dport, full_mask, XAGG_F_RESULT | flags);
}

/* A child entry's sum of its workers, to its parent: one PARTIAL naming
 * them (the header keeps job, cookie, chunk, round, agg_id and op). */
static __always_inline void make_partial(struct ethhdr *eth, struct iphdr *iph,
					 struct udphdr *udph, struct xagg_hdr *xh,
					 struct xagg_job *job)
{
	__builtin_memcpy(eth->h_source, eth->h_dest, ETH_ALEN);
	__builtin_memcpy(eth->h_dest, job->parent_mac, ETH_ALEN);
	make_reply(iph, udph, xh, job->parent_ip, job->parent_port, job->full_mask,
		   XAGG_F_PARTIAL | (xh->flags & XAGG_F_RESENT));
}

int xagg_xdp(struct xdp_md *ctx)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	struct hdr_cursor nh = { .pos = data };
	struct ethhdr *eth;
	struct iphdr *iph;
	struct udphdr *udph;
	struct xagg_hdr *xh;
	struct xagg_job_key jkey;
	struct xagg_job *job;
	struct xagg_worker *w;
	struct xagg_slot *s;
	__s32 *pv, *vals;
	__u32 key, row, l3_off, payload_off, job_id;	/* row: the sender's */
	__u64 mask;
	__u32 done_was = 0;
	int superseded = 0, outcome, odd = 0;

	if (parse_ethhdr(&nh, data_end, &eth) != htons(ETH_P_IP))
		goto pass;
	l3_off = nh.pos - data;
	/* not UDP, or no UDP header here (a non-first fragment): not ours */
	if (parse_iphdr(&nh, data_end, &iph, &odd) != IPPROTO_UDP)
		goto pass;
	if (parse_udphdr(&nh, data_end, &udph) < 0)
		goto pass;
	if (udph->dest != htons(XAGG_PORT))
		goto pass;
	if (odd)		/* IP options or a first fragment on our port */
		return drop(XAGG_V_MALFORMED);

	/* From here on the packet is addressed to xagg: anything wrong is
	 * dropped and counted, never passed to the stack. */
	xh = nh.pos;
	if ((void *)(xh + 1) > data_end)
		return drop(XAGG_V_MALFORMED);
	if (xh->magic != XAGG_MAGIC || xh->version != XAGG_VERSION)
		return drop(XAGG_V_MALFORMED);
	pv = (__s32 *)(xh + 1);
	payload_off = (void *)pv - data;
#if XAGG_FRAGS
	if (bpf_xdp_get_buff_len(ctx) < payload_off + XAGG_VALS * 4)
		return drop(XAGG_V_MALFORMED);
#else
	if ((void *)(pv + XAGG_VALS) > data_end)
		return drop(XAGG_V_MALFORMED);
#endif
	if (udph->len != htons(XAGG_PKT_LEN) ||
	    xh->count != XAGG_VALS || xh->op >= XAGG_NR_OPS ||
	    xh->encoding != XAGG_ENC_I32)
		return drop(XAGG_V_MALFORMED);

	/* The job's main entry; a packet for another aggregator's chunks may
	 * be for a child entry of the job here (one map, so that `job` is one
	 * kind of pointer on every path). */
	job_id = xh->job_id;
	jkey.job_id = job_id;
	jkey.agg_id = XAGG_AGG_MAIN;
	jkey.pad = 0;
	job = jobs.lookup(&jkey);
	if (!job || (job->n_aggs && xh->agg_id != job->agg_id)) {
		struct xagg_job *sub;

		jkey.agg_id = xh->agg_id;
		sub = jobs.lookup(&jkey);
		if (sub)
			job = sub;
	}
	if (xh->flags & XAGG_F_RESULT) {
		/* Results go to workers, which never run on an aggregator host,
		 * except a child entry's parent's: from its address only. */
		if (!job || !job->parent_ip)
			goto pass;
		if (iph->saddr != job->parent_ip)
			return drop(XAGG_V_BAD_WORKER);
	}
	if (!job)
		return drop(XAGG_V_UNKNOWN_JOB);
	if (xh->cookie != job->cookie)
		return drop(XAGG_V_BAD_COOKIE);

	/* Chunk i of another aggregator of the job is not this one's chunk i */
	if (job->n_aggs && (xh->agg_id != job->agg_id || xh->n_aggs != job->n_aggs))
		return drop(XAGG_V_WRONG_AGG);

	/* The sender's row: a worker, its own bit only and from its pinned
	 * address if it has one; or, for a partial sum, a child aggregator
	 * registered at this source address, for workers it serves. */
	/* the parent's result covers every worker of this entry */
	mask = (xh->flags & XAGG_F_RESULT) ? job->full_mask : xh->worker_mask;
	if (!mask || (mask & ~job->full_mask))
		return drop(XAGG_V_BAD_WORKER);
	if (xh->flags & XAGG_F_RESULT) {
		/* no sender row: nothing is learned from or resent to a parent.
		 * Shaped like a worker's row index, so the verifier sees one
		 * state where the paths meet (see sender_row). */
		row = job->job_index * XAGG_MAX_WORKERS + (xh->worker_id & (XAGG_MAX_WORKERS - 1));
	} else if (xh->flags & XAGG_F_PARTIAL) {
		row = child_row(job, iph->saddr, mask);
		if (row == XAGG_NO_ROW)
			return drop(XAGG_V_BAD_WORKER);
	} else {
		if (xh->worker_id >= XAGG_MAX_WORKERS || mask != (1ULL << xh->worker_id))
			return drop(XAGG_V_BAD_WORKER);
		row = job->job_index * XAGG_MAX_WORKERS + xh->worker_id;
		w = workers.lookup(&row);
		if (!w || (w->ip && w->ip != iph->saddr))
			return drop(XAGG_V_BAD_WORKER);
	}

	if (xh->chunk >= job->n_chunks)
		return drop(XAGG_V_BAD_CHUNK);
	key = job->slot_base + xh->chunk * 2 + (xh->round & 1);
	s = slots.lookup(&key);
	if (!s)
		return drop(XAGG_V_BAD_CHUNK);

	vals = payload_of(ctx, pv, payload_off);
	if (!vals)
		return drop(XAGG_V_MALFORMED);
	outcome = slot_update(s, job, xh, vals, mask, &superseded, &done_was);
	if (superseded)
		count(XAGG_V_SUPERSEDED);
	/* What the slot's outcome means in a child entry: the parent's result
	 * stored; or a worker's resend while the parent has not answered (the
	 * partial or the result was lost), which sends the partial again: the
	 * parent answers a duplicate partial with its result. */
	if (outcome == SLOT_COMPLETED && (xh->flags & XAGG_F_RESULT))
		outcome = SLOT_FINAL;
	else if (outcome == SLOT_DONE_RESEND && done_was == 1 && job->parent_ip)
		outcome = SLOT_PARTIAL_RESEND;
	/* Only a packet that passed every check and was summed may say where
	 * its sender's results go: a bad-chunk or duplicate one from a pinned
	 * worker's address must not redirect them. */
	w = sender_row(xh, row);
	if (w && (outcome == SLOT_ADDED || outcome == SLOT_COMPLETED))
		learn(w, iph->saddr, udph->source, eth->h_source);
	/* A resend goes where the sender's summed packets came from, not to
	 * this packet's source (any host can write a pinned address there).
	 * A row without a port never had a packet summed: its bits came
	 * through someone else (a child's partial sum), so there is nowhere
	 * known to answer and it counts as the duplicate it is. */
	if (outcome == SLOT_DONE_RESEND && (!w || !w->port))
		outcome = SLOT_DUP;
	count_job(job->job_index, outcome);

	switch (outcome) {
	case SLOT_ADDED:
		count(XAGG_V_AGGREGATED);
		return XDP_DROP;	/* consumed: its values live in the slot */
	case SLOT_DUP:
		return drop(XAGG_V_DUPLICATE);
	case SLOT_STALE:
		return drop(XAGG_V_STALE);
	case SLOT_OVERLAP:
		return drop(XAGG_V_PARTIAL_OVERLAP);
	case SLOT_PARTIAL_RESEND:
		count(XAGG_V_PARTIAL_RESENT);
		goto partial;
	case SLOT_DONE_RESEND:
		/* the sender missed the result: to it alone */
		if (!w)
			return drop(XAGG_V_DUPLICATE);	/* not reached: for the verifier */
		count(XAGG_V_RETRANSMIT);
		__builtin_memcpy(eth->h_source, eth->h_dest, ETH_ALEN);
		__builtin_memcpy(eth->h_dest, w->mac, ETH_ALEN);
		make_result(iph, udph, xh, w->addr, w->port, job->full_mask, XAGG_F_RETX);
		if (result_out(ctx, vals, payload_off))
			return drop(XAGG_V_MALFORMED);
		return XDP_TX;
	}

	if (outcome == SLOT_COMPLETED && job->parent_ip) {
		/* a child entry's workers are all in: one partial up */
		count(XAGG_V_PARTIAL_SENT);
partial:
		make_partial(eth, iph, udph, xh, job);
		if (result_out(ctx, vals, payload_off))
			return drop(XAGG_V_MALFORMED);
		return XDP_TX;
	}

	/* SLOT_COMPLETED (or SLOT_FINAL: the parent's result, in a child
	 * entry): this packet becomes the result for the entry's workers,
	 * marked RESENT when a resend (or a parent's result so marked)
	 * completed it */
	if (outcome == SLOT_FINAL) {
		count(XAGG_V_PARENT_RESULT);
		/* the next hop to the parent, as its results come */
		if (!mac_equal(job->parent_mac, eth->h_source))
			__builtin_memcpy(job->parent_mac, eth->h_source, ETH_ALEN);
	} else {
		count(XAGG_V_COMPLETED);
	}
	if (job->fanout == XAGG_FANOUT_BCAST && !job->n_children) {
		__builtin_memcpy(eth->h_source, eth->h_dest, ETH_ALEN);
		fanout_mac(eth->h_dest, job->bcast_ip);
		make_result(iph, udph, xh, job->bcast_ip, job->result_port,
			    job->full_mask, xh->flags & XAGG_F_RESENT);
		if (result_out(ctx, vals, payload_off))
			return drop(XAGG_V_MALFORMED);
		return XDP_TX;
	}
	/* unicast, or results also for child aggregators: tc clones it to each
	 * worker and child (and the broadcast copy); addresses are filled there */
	__builtin_memcpy(eth->h_source, eth->h_dest, ETH_ALEN);
	make_result(iph, udph, xh, iph->saddr, udph->source, job->full_mask,
		    xh->flags & XAGG_F_RESENT);
	if (result_out(ctx, vals, payload_off))
		return drop(XAGG_V_MALFORMED);
	{
		struct xagg_meta *meta;

		/* -EOPNOTSUPP on a driver without metadata support: the
		 * chunk is finished (workers get it on retransmit, one RTO
		 * each), and the daemon, seeing this verdict, refuses unicast */
		if (bpf_xdp_adjust_meta(ctx, -(int)sizeof(*meta)))
			return drop(XAGG_V_NO_META);
		meta = (void *)(long)ctx->data_meta;
		if ((void *)(meta + 1) > (void *)(long)ctx->data)
			return drop(XAGG_V_MALFORMED);
		meta->magic = XAGG_META_MAGIC;
		meta->job_id = job_id;
		meta->l3_off = l3_off;
		/* the entry's key, from the entry: a key kept live on the
		 * stack from the lookup would split the verifier's walk */
		meta->agg_key = job->parent_ip ? job->agg_id : XAGG_AGG_MAIN;
		meta->pad = 0;
	}
	return XDP_PASS;

pass:
	count(XAGG_V_PASSED);
	return XDP_PASS;
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
	__u64 full_mask;
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
	full_mask = job->full_mask;
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
	for (i = 0; i < XAGG_MAX_WORKERS; i++) {
		if (!(full_mask & (1ULL << i)))
			continue;
		key = job->job_index * XAGG_MAX_WORKERS + i;
		w = workers.lookup(&key);
		if (!w || !w->port)
			continue;	/* never heard from (or served by a child) */
		tc_send_copy(skb, l3_off, &old_ip, w->mac, w->addr, w->port);
	}
	return TC_ACT_SHOT;
}
