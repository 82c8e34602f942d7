/* SPDX-License-Identifier: GPL-2.0 */
/* Cursor-style, bounds-checked header parsing (after xdp-tutorial's
 * parsing_helpers.h). Each helper checks `pos + size <= end` before it
 * touches a byte: the verifier rejects any packet access it cannot prove
 * in bounds. */
#ifndef XAGG_PARSE_H
#define XAGG_PARSE_H

#include <linux/if_ether.h>
#include <linux/ip.h>
#include <linux/udp.h>

#define XAGG_VLAN_MAX_DEPTH 2

/* frag_off bits (include/net/ip.h, which is not uapi) */
#ifndef IP_MF
#define IP_MF		0x2000
#endif
#ifndef IP_OFFSET
#define IP_OFFSET	0x1fff
#endif

struct hdr_cursor {
	void *pos;
};

struct xagg_vlan_hdr {
	__be16 tci;
	__be16 encap_proto;
};

static __always_inline int proto_is_vlan(__u16 h_proto)
{
	return h_proto == htons(ETH_P_8021Q) || h_proto == htons(ETH_P_8021AD);
}

/* Returns the EtherType after up to XAGG_VLAN_MAX_DEPTH tags (network
 * order), or -1 if the frame is too short. */
static __always_inline int parse_ethhdr(struct hdr_cursor *nh, void *end,
					struct ethhdr **ethhdr)
{
	struct ethhdr *eth = nh->pos;
	struct xagg_vlan_hdr *vlh;
	__u16 h_proto;
	int i;

	if ((void *)(eth + 1) > end)
		return -1;
	nh->pos = eth + 1;
	*ethhdr = eth;
	h_proto = eth->h_proto;

	vlh = nh->pos;
#pragma unroll
	for (i = 0; i < XAGG_VLAN_MAX_DEPTH; i++) {
		if (!proto_is_vlan(h_proto))
			break;
		if ((void *)(vlh + 1) > end)
			return -1;
		h_proto = vlh->encap_proto;
		vlh++;
	}
	nh->pos = vlh;
	return h_proto;
}

/* IPv4. Returns the L4 protocol, or -1 when there is no L4 header to read:
 * a truncated header, or a non-first fragment (its first bytes are the
 * middle of someone's datagram, whatever port they seem to name). *odd is
 * set for IP options or a first fragment (MF), which xagg senders never
 * produce; the cursor still moves past the options so the caller can see
 * the port and drop such a packet only when it is addressed to xagg. */
static __always_inline int parse_iphdr(struct hdr_cursor *nh, void *end,
				       struct iphdr **iphdr, int *odd)
{
	struct iphdr *iph = nh->pos;
	int hdrsize;

	if ((void *)(iph + 1) > end)
		return -1;
	hdrsize = iph->ihl * 4;
	if (hdrsize < (int)sizeof(*iph))
		return -1;
	/* variable offset: the verifier needs the explicit end check */
	if (nh->pos + hdrsize > end)
		return -1;
	if (iph->frag_off & htons(IP_OFFSET))
		return -1;
	*iphdr = iph;
	nh->pos += hdrsize;
	*odd = hdrsize != sizeof(*iph) || (iph->frag_off & htons(IP_MF));
	return iph->protocol;
}

static __always_inline int parse_udphdr(struct hdr_cursor *nh, void *end,
					struct udphdr **udphdr)
{
	struct udphdr *h = nh->pos;

	if ((void *)(h + 1) > end)
		return -1;
	nh->pos = h + 1;
	*udphdr = h;
	return 0;
}

/* RFC 1071 checksum of a 20-byte IPv4 header with check == 0. */
static __always_inline __u16 ipv4_csum(struct iphdr *iph)
{
	__u16 *p = (__u16 *)iph;
	__u32 sum = 0;
	int i;

#pragma unroll
	for (i = 0; i < (int)(sizeof(*iph) / 2); i++)
		sum += p[i];
	sum = (sum & 0xffff) + (sum >> 16);
	sum = (sum & 0xffff) + (sum >> 16);
	return ~sum;
}

#endif /* XAGG_PARSE_H */
