/* SPDX-License-Identifier: GPL-2.0 */
/* The XDP stages from the slot on: settle updates it and says what its
 * outcome means for this packet; emit makes the frame that leaves, if any
 * (the request turned into a result, a partial sum or a resend, sent back
 * out with XDP_TX or handed to tc for unicast fan-out) and returns the
 * packet's XDP action, counted.
 *
 * Included by xagg_xdp.c after its map accessors: bcc rewrites
 * `map.lookup()` only in the file it compiles. */
#ifndef XAGG_EMIT_H
#define XAGG_EMIT_H

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
				       __u16 dport, struct xagg_job *job, __u8 flags)
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
	/* Who is in the sum, as far as the header's one block can say: a
	 * partial names its entry's block (all its workers; a wide entry the
	 * block past the workers', and their count), a result the block of its
	 * worker_id (every worker there). */
	if (flags & XAGG_F_PARTIAL)
		xh->worker_id = (job->wide ? XAGG_SET_WORDS : job->up_block) * 64;
	if (flags & XAGG_F_PARTIAL && job->wide)
		xh->worker_mask = job->n_full;
	else
		xh->worker_mask = job->full_set[(xh->worker_id / 64) & (XAGG_SET_WORDS - 1)];
}

static __always_inline void make_result(struct iphdr *iph, struct udphdr *udph,
					struct xagg_hdr *xh, __u32 daddr,
					__u16 dport, struct xagg_job *job, __u8 flags)
{
	make_reply(iph, udph, xh, daddr, dport, job, XAGG_F_RESULT | flags);
}

/* A child entry's sum of its workers, to its parent: one PARTIAL naming
 * them (the header keeps job, cookie, chunk, round, agg_id and op). */
static __always_inline void make_partial(struct ethhdr *eth, struct iphdr *iph,
					 struct udphdr *udph, struct xagg_hdr *xh,
					 struct xagg_job *job)
{
	__builtin_memcpy(eth->h_source, eth->h_dest, ETH_ALEN);
	__builtin_memcpy(eth->h_dest, job->parent_mac, ETH_ALEN);
	make_reply(iph, udph, xh, job->parent_ip, job->parent_port, job,
		   XAGG_F_PARTIAL | (xh->flags & XAGG_F_RESENT));
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

/* What the slot's outcome means for this packet, with its bookkeeping:
 * counters, and where the sender's results go. */
static __always_inline int settle(struct xagg_pkt *p)
{
	struct xagg_hdr *xh = p->xh;
	struct xagg_worker *w;
	__u32 done_was = 0;
	int superseded = 0, outcome;

	outcome = slot_update(p->slot, p->job, xh, p->vals, p->k, p->mask, p->n,
			      &superseded, &done_was);
	if (superseded)
		count(XAGG_V_SUPERSEDED);
	/* What the slot's outcome means in a child entry: the parent's result
	 * stored; or a worker's resend while the parent has not answered (the
	 * partial or the result was lost), which sends the partial again: the
	 * parent answers a duplicate partial with its result. */
	if (outcome == SLOT_COMPLETED && (xh->flags & XAGG_F_RESULT))
		outcome = SLOT_FINAL;
	else if (outcome == SLOT_DONE_RESEND && done_was == 1 && p->job->parent_ip)
		outcome = SLOT_PARTIAL_RESEND;
	/* Only a packet that passed every check and was summed may say where
	 * its sender's results go: a bad-chunk or duplicate one from a pinned
	 * worker's address must not redirect them. */
	w = sender_row(xh, p->row);
	if (w && (outcome == SLOT_ADDED || outcome == SLOT_COMPLETED))
		learn(w, p->iph->saddr, p->udph->source, p->eth->h_source);
	/* A resend goes where the sender's summed packets came from, not to
	 * this packet's source (any host can write a pinned address there).
	 * A row without a port never had a packet summed: its bits came
	 * through someone else (a child's partial sum), so there is nowhere
	 * known to answer and it counts as the duplicate it is. */
	if (outcome == SLOT_DONE_RESEND && (!w || !w->port))
		outcome = SLOT_DUP;
	count_job(p->job->job_index, outcome);
	p->sender = w;
	return outcome;
}

/* The reply made, its values into the frame, and out the way it came. */
static __always_inline int transmit(struct xdp_md *ctx, struct xagg_pkt *p)
{
	if (result_out(ctx, p->vals, p->payload_off))
		return drop(XAGG_V_MALFORMED);
	return XDP_TX;
}

/* The sender missed the result: to it alone. */
static __always_inline int send_retransmit(struct xdp_md *ctx, struct xagg_pkt *p)
{
	struct xagg_worker *w = p->sender;

	if (!w)
		return drop(XAGG_V_DUPLICATE);	/* not reached: for the verifier */
	count(XAGG_V_RETRANSMIT);
	__builtin_memcpy(p->eth->h_source, p->eth->h_dest, ETH_ALEN);
	__builtin_memcpy(p->eth->h_dest, w->mac, ETH_ALEN);
	make_result(p->iph, p->udph, p->xh, w->addr, w->port, p->job, XAGG_F_RETX);
	return transmit(ctx, p);
}

static __always_inline int send_partial(struct xdp_md *ctx, struct xagg_pkt *p)
{
	make_partial(p->eth, p->iph, p->udph, p->xh, p->job);
	return transmit(ctx, p);
}

/* Unicast, or results also for child aggregators: tc clones the result to
 * each worker and child (and the broadcast copy) and fills in addresses. */
static __always_inline int hand_to_tc(struct xdp_md *ctx, struct xagg_pkt *p)
{
	struct xagg_meta *meta;

	if (result_out(ctx, p->vals, p->payload_off))
		return drop(XAGG_V_MALFORMED);
	/* -EOPNOTSUPP on a driver without metadata support: the chunk is
	 * finished (workers get it on retransmit, one RTO each), and the
	 * daemon, seeing this verdict, refuses unicast */
	if (bpf_xdp_adjust_meta(ctx, -(int)sizeof(*meta)))
		return drop(XAGG_V_NO_META);
	meta = (void *)(long)ctx->data_meta;
	if ((void *)(meta + 1) > (void *)(long)ctx->data)
		return drop(XAGG_V_MALFORMED);
	meta->magic = XAGG_META_MAGIC;
	meta->job_id = p->job_id;
	meta->l3_off = p->l3_off;
	/* the entry's key, from the entry: a key kept live on the stack from
	 * the lookup would split the verifier's walk */
	meta->agg_key = p->job->parent_ip ? p->job->agg_id : XAGG_AGG_MAIN;
	meta->pad = 0;
	return XDP_PASS;
}

/* A finished chunk (SLOT_COMPLETED, or SLOT_FINAL: the parent's result, in
 * a child entry): this packet becomes the result for the entry's workers,
 * marked RESENT when a resend (or a parent's result so marked) completed
 * it. */
static __always_inline int send_result(struct xdp_md *ctx, struct xagg_pkt *p)
{
	struct xagg_job *job = p->job;
	__u8 resent = p->xh->flags & XAGG_F_RESENT;

	__builtin_memcpy(p->eth->h_source, p->eth->h_dest, ETH_ALEN);
	if (job->fanout == XAGG_FANOUT_BCAST && !job->n_children) {
		fanout_mac(p->eth->h_dest, job->bcast_ip);
		make_result(p->iph, p->udph, p->xh, job->bcast_ip, job->result_port,
			    job, resent);
		return transmit(ctx, p);
	}
	make_result(p->iph, p->udph, p->xh, p->iph->saddr, p->udph->source,
		    job, resent);
	return hand_to_tc(ctx, p);
}

/* A finished chunk's frame: in a child entry, its workers' sum up to the
 * parent (once complete, and again on a worker's resend) until the
 * parent's result comes; everywhere else the result to the entry's workers. */
static __always_inline int send_finished(struct xdp_md *ctx, struct xagg_pkt *p, int outcome)
{
	if (outcome == SLOT_PARTIAL_RESEND || (outcome == SLOT_COMPLETED && p->job->parent_ip)) {
		count(outcome == SLOT_PARTIAL_RESEND ? XAGG_V_PARTIAL_RESENT : XAGG_V_PARTIAL_SENT);
		return send_partial(ctx, p);
	}
	if (outcome == SLOT_FINAL) {
		count(XAGG_V_PARENT_RESULT);
		/* the next hop to the parent, as its results come */
		if (!mac_equal(p->job->parent_mac, p->eth->h_source))
			__builtin_memcpy(p->job->parent_mac, p->eth->h_source, ETH_ALEN);
	} else {
		count(XAGG_V_COMPLETED);
	}
	return send_result(ctx, p);
}

static __always_inline int emit(struct xdp_md *ctx, struct xagg_pkt *p, int outcome)
{
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
	case SLOT_MIXED:
		return drop(XAGG_V_MIXED_LANES);
	case SLOT_DONE_RESEND:
		return send_retransmit(ctx, p);
	}
	return send_finished(ctx, p, outcome);
}

#endif /* XAGG_EMIT_H */
