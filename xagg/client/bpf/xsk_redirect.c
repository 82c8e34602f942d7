// SPDX-License-Identifier: GPL-2.0
/* The worker side of the AF_XDP path: results for one client (UDP to its
 * port) go to its XSK socket, everything else on to the stack untouched.
 *
 * One copy is loaded per client socket (csrc/xsk.c): its `port` map names
 * the client's UDP port, its `xsks` map holds the socket at the
 * queue it is bound to. A result arriving on another queue finds no socket
 * there and bpf_redirect_map's fallback passes it, so the client's bound
 * UDP socket still receives it: nothing depends on which queue a frame hits.
 * Built with clang -target bpf by native.py.
 */
#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/in.h>
#include <linux/ip.h>
#include <linux/udp.h>
#include <bpf/bpf_endian.h>
#include <bpf/bpf_helpers.h>

struct {
	__uint(type, BPF_MAP_TYPE_XSKMAP);
	__uint(max_entries, 64);
	__type(key, __u32);
	__type(value, __u32);
} xsks SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u32);	/* the client's UDP port, network byte order */
} port SEC(".maps");

SEC("xdp")
int xagg_xsk(struct xdp_md *ctx)
{
	void *data = (void *)(long)ctx->data, *end = (void *)(long)ctx->data_end;
	struct ethhdr *eth = data;
	struct iphdr *ip = (void *)(eth + 1);
	struct udphdr *udp;
	__u32 zero = 0, *want;

	if ((void *)(ip + 1) > end || eth->h_proto != bpf_htons(ETH_P_IP) ||
	    ip->protocol != IPPROTO_UDP || ip->ihl != 5 || (ip->frag_off & bpf_htons(0x3fff)))
		return XDP_PASS;
	udp = (void *)(ip + 1);
	if ((void *)(udp + 1) > end)
		return XDP_PASS;
	want = bpf_map_lookup_elem(&port, &zero);
	if (!want || udp->dest != (__u16)*want)
		return XDP_PASS;
	return bpf_redirect_map(&xsks, ctx->rx_queue_index, XDP_PASS);
}

char _license[] SEC("license") = "GPL";
