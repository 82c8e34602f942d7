/* SPDX-License-Identifier: GPL-2.0 */
/* A client's probe: a bare xagg header with XAGG_F_PROBE asks this
 * aggregator how many values its packets carry and whether it knows the
 * header's job and cookie, so a client learns a mismatch in one round trip
 * instead of seeing every packet dropped as malformed. Answered in place,
 * back the way it came (XDP_TX): the answer is the question's size, so it
 * amplifies nothing a forged source address could aim at.
 *
 * The answer: version and count are this program's, chunk is the verdict
 * on the job (XAGG_V_PROBED: known, cookie right; XAGG_V_UNKNOWN_JOB;
 * XAGG_V_BAD_COOKIE; XAGG_V_MALFORMED: the client speaks another wire
 * version, whose header this program cannot read further).
 *
 * Included by xagg_xdp.c after its map accessors (see xagg_admit.h). */
#ifndef XAGG_PROBE_H
#define XAGG_PROBE_H

#define XAGG_PROBE_LEN (sizeof(struct udphdr) + sizeof(struct xagg_hdr))

static __always_inline void swap_mac(struct ethhdr *eth)
{
	__u8 mac[ETH_ALEN];

	__builtin_memcpy(mac, eth->h_source, ETH_ALEN);
	__builtin_memcpy(eth->h_source, eth->h_dest, ETH_ALEN);
	__builtin_memcpy(eth->h_dest, mac, ETH_ALEN);
}

/* XAGG_GO_ON for anything but a probe. */
static __always_inline int answer_probe(struct xdp_md *ctx, struct xagg_pkt *p)
{
	void *data_end = (void *)(long)ctx->data_end;
	struct xagg_hdr *xh = p->xh;
	struct xagg_job_key jkey = { .agg_id = XAGG_AGG_MAIN };
	struct xagg_job *job;
	__u32 ip;
	__u16 port;

	if ((void *)(xh + 1) > data_end || xh->magic != XAGG_MAGIC || !(xh->flags & XAGG_F_PROBE))
		return XAGG_GO_ON;
	if (p->udph->len != htons(XAGG_PROBE_LEN) || (xh->flags & XAGG_F_RESULT))
		return drop(XAGG_V_MALFORMED);
	if (xh->version != XAGG_VERSION) {
		xh->chunk = XAGG_V_MALFORMED;
	} else {
		jkey.job_id = xh->job_id;
		job = job_entry(&jkey);
		xh->chunk = !job ? XAGG_V_UNKNOWN_JOB :
			    xh->cookie != job->cookie ? XAGG_V_BAD_COOKIE : XAGG_V_PROBED;
	}
	xh->version = XAGG_VERSION;
	xh->count = XAGG_VALS;
	xh->flags = XAGG_F_PROBE | XAGG_F_RESULT;
	swap_mac(p->eth);
	/* swapped addresses leave the IPv4 checksum as it was */
	ip = p->iph->saddr;
	p->iph->saddr = p->iph->daddr;
	p->iph->daddr = ip;
	port = p->udph->source;
	p->udph->source = p->udph->dest;
	p->udph->dest = port;
	p->udph->check = 0;
	count(XAGG_V_PROBED);
	return XDP_TX;
}

#endif /* XAGG_PROBE_H */
