/* SPDX-License-Identifier: GPL-2.0 */
/* The XDP stages before a slot: is the packet xagg's, is it well formed,
 * which job entry, may its sender send it, which slot. Each returns the
 * packet's XDP action (counted) or XAGG_GO_ON, and fills in what the next
 * stage reads of struct xagg_pkt.
 *
 * Included by xagg_xdp.c after its map accessors: bcc rewrites
 * `map.lookup()` only in the file it compiles. */
#ifndef XAGG_ADMIT_H
#define XAGG_ADMIT_H

#define XAGG_PKT_LEN (sizeof(struct udphdr) + sizeof(struct xagg_hdr) + XAGG_VALS * 4)

/* Ethernet, VLAN tags, IPv4 and UDP. Anything not for the xagg port is the
 * stack's. */
static __always_inline int parse_udp(struct xdp_md *ctx, struct xagg_pkt *p)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	struct hdr_cursor nh = { .pos = data };
	int odd = 0;

	if (parse_ethhdr(&nh, data_end, &p->eth) != htons(ETH_P_IP))
		return pass();
	p->l3_off = nh.pos - data;
	/* not UDP, no UDP header here (a non-first fragment), or another port */
	if (parse_iphdr(&nh, data_end, &p->iph, &odd) != IPPROTO_UDP ||
	    parse_udphdr(&nh, data_end, &p->udph) < 0 ||
	    p->udph->dest != htons(XAGG_PORT))
		return pass();
	if (odd)		/* IP options or a first fragment on our port */
		return drop(XAGG_V_MALFORMED);
	p->xh = nh.pos;
	return XAGG_GO_ON;
}

/* The xagg header and the payload's extent. From here on the packet is
 * addressed to xagg: anything wrong is dropped and counted, never passed
 * to the stack. */
static __always_inline int check_header(struct xdp_md *ctx, struct xagg_pkt *p)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	struct xagg_hdr *xh = p->xh;
	__s32 *pv = (__s32 *)(xh + 1);

	if ((void *)pv > data_end)
		return drop(XAGG_V_MALFORMED);
	if (xh->magic != XAGG_MAGIC || xh->version != XAGG_VERSION)
		return drop(XAGG_V_MALFORMED);
	p->payload_off = (void *)pv - data;
#if XAGG_FRAGS
	if (bpf_xdp_get_buff_len(ctx) < p->payload_off + XAGG_VALS * 4)
		return drop(XAGG_V_MALFORMED);
#else
	if ((void *)(pv + XAGG_VALS) > data_end)
		return drop(XAGG_V_MALFORMED);
#endif
	if (p->udph->len != htons(XAGG_PKT_LEN) ||
	    xh->count != XAGG_VALS || xh->op >= XAGG_NR_OPS ||
	    xh->encoding >= XAGG_NR_ENCODINGS)
		return drop(XAGG_V_MALFORMED);
	p->vals = pv;
	return XAGG_GO_ON;
}

/* The job's main entry; a packet for another aggregator's chunks may be for
 * a child entry of the job here (one map, so that `job` is one kind of
 * pointer on every path). */
static __always_inline int find_job(struct xagg_pkt *p)
{
	struct xagg_hdr *xh = p->xh;
	struct xagg_job_key jkey = { .job_id = xh->job_id, .agg_id = XAGG_AGG_MAIN };
	struct xagg_job *job;

	p->job_id = xh->job_id;
	job = job_entry(&jkey);
	if (!job || (job->n_aggs && xh->agg_id != job->agg_id)) {
		struct xagg_job *sub;

		jkey.agg_id = xh->agg_id;
		sub = job_entry(&jkey);
		if (sub)
			job = sub;
	}
	if (xh->flags & XAGG_F_RESULT) {
		/* Results go to workers, which never run on an aggregator host,
		 * except a child entry's parent's: from its address only. */
		if (!job || !job->parent_ip)
			return pass();
		if (p->iph->saddr != job->parent_ip)
			return drop(XAGG_V_BAD_WORKER);
	}
	if (!job)
		return drop(XAGG_V_UNKNOWN_JOB);
	if (xh->cookie != job->cookie)
		return drop(XAGG_V_BAD_COOKIE);
	/* Chunk i of another aggregator of the job is not this one's chunk i */
	if (job->n_aggs && (xh->agg_id != job->agg_id || xh->n_aggs != job->n_aggs))
		return drop(XAGG_V_WRONG_AGG);
	p->job = job;
	return XAGG_GO_ON;
}

#define XAGG_NO_ROW	0xffffffff

/* The row in `children` of this job's child aggregator at address ip, if it
 * may send a partial sum of mask in block k; else XAGG_NO_ROW. A wide
 * child (workers in several blocks) names block XAGG_SET_WORDS and how many
 * workers it summed, which must be its registered count: p->mask and p->n
 * become its own bit and that count. A
 * constant trip count: the verifier walks each unrolled lookup. */
static __always_inline __u32 child_row(struct xagg_pkt *p, __u32 k)
{
	struct xagg_worker *c;
	__u32 key, i;

#pragma unroll
	for (i = 0; i < XAGG_MAX_CHILDREN; i++) {
		key = p->job->job_index * XAGG_MAX_CHILDREN + i;
		c = child_at(key);
		if (!c || !c->ip || c->ip != p->iph->saddr)
			continue;
		if (c->block != k || (c->n ? p->mask != c->n : p->mask & ~c->mask))
			return XAGG_NO_ROW;
		if (c->n) {
			p->mask = c->mask;
			p->n = c->n;
		} else {
			p->n = __builtin_popcountll(p->mask);
		}
		return key;
	}
	return XAGG_NO_ROW;
}

/* The contributors the packet carries (mask, of set word k: its
 * worker_id's block; n workers) and its sender's row: a worker, its own
 * bit only, from its pinned address if it has one and not behind a wide
 * child; or, for a partial sum, a child aggregator registered at this
 * source address, for workers it serves. */
static __always_inline int check_sender(struct xagg_pkt *p)
{
	struct xagg_hdr *xh = p->xh;
	struct xagg_job *job = p->job;
	struct xagg_worker *w;
	__u64 mask;
	__u32 k;

	/* The same bound on k on every path: the verifier then meets one
	 * state at the slot (see sender_row), not one per range of k. */
	if (xh->flags & XAGG_F_RESULT) {
		/* the parent's result covers every worker of this entry */
		k = job->up_block;
		mask = ~0ULL;
	} else {
		k = xh->worker_id / 64;
		mask = xh->worker_mask;
	}
	if (k > XAGG_SET_WORDS)
		return drop(XAGG_V_BAD_WORKER);
	/* the checked k from here on: clang may not compute it again */
	asm volatile("" : "+r"(k));
	if (xh->flags & XAGG_F_RESULT)
		mask = job->full_set[k];
	p->k = k;
	p->mask = mask;
	p->n = 1;		/* a worker's; a partial's and a result's below */
	if (xh->flags & XAGG_F_PARTIAL) {
		p->row = child_row(p, k);
		if (p->row == XAGG_NO_ROW)
			return drop(XAGG_V_BAD_WORKER);
	}
	if (!p->mask || (p->mask & ~job->full_set[k]))
		return drop(XAGG_V_BAD_WORKER);
	if (xh->flags & XAGG_F_RESULT) {
		p->n = job->n_full;
		/* no sender row: nothing is learned from or resent to a parent.
		 * Shaped like a worker's row index, so the verifier sees one
		 * state where the paths meet (see sender_row). */
		p->row = job->job_index * XAGG_MAX_WORKERS + xh->worker_id % XAGG_MAX_WORKERS;
		return XAGG_GO_ON;
	}
	if (xh->flags & XAGG_F_PARTIAL)
		return XAGG_GO_ON;
	if (xh->worker_id >= XAGG_MAX_WORKERS || mask != (1ULL << (xh->worker_id % 64)))
		return drop(XAGG_V_BAD_WORKER);
	p->row = job->job_index * XAGG_MAX_WORKERS + xh->worker_id;
	w = worker_at(p->row);
	if (!w || (w->ip && w->ip != p->iph->saddr) || w->behind)
		return drop(XAGG_V_BAD_WORKER);
	return XAGG_GO_ON;
}

/* The chunk's slot for the packet's round parity, and the payload where
 * the slot update can read it. */
static __always_inline int find_slot(struct xdp_md *ctx, struct xagg_pkt *p)
{
	struct xagg_hdr *xh = p->xh;

	if (xh->chunk >= p->job->n_chunks)
		return drop(XAGG_V_BAD_CHUNK);
	p->slot = slot_at(p->job->slot_base + xh->chunk * 2 + (xh->round & 1));
	if (!p->slot)
		return drop(XAGG_V_BAD_CHUNK);
	p->vals = payload_of(ctx, p->vals, p->payload_off);
	if (!p->vals)
		return drop(XAGG_V_MALFORMED);
	return XAGG_GO_ON;
}

#endif /* XAGG_ADMIT_H */
