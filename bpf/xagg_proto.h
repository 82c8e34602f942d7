/* SPDX-License-Identifier: GPL-2.0 */
/* The xagg wire header: the one source of truth. UDP payload = header +
 * count little-endian int32 values. All fields are little-endian (the byte
 * order of every host we target), so the hot path needs no byte swaps.
 * xagg/proto.py derives its numpy dtype from this struct; a test asserts
 * it matches the layout bcc generates. */
#ifndef XAGG_PROTO_H
#define XAGG_PROTO_H

struct xagg_hdr {
	__u32 magic;		/* XAGG_MAGIC */
	__u8  version;		/* XAGG_VERSION */
	__u8  op;		/* XAGG_OP_* */
	__u8  flags;		/* XAGG_F_* */
	__u8  encoding;		/* XAGG_ENC_* */
	__u32 job_id;
	__u32 cookie;		/* per-job secret: wrong cookie, packet dropped */
	__u32 chunk;		/* chunk index at this aggregator */
	__u32 round;		/* allreduce call number; parity picks the slot copy */
	__u16 worker_id;	/* the sender; its block (worker_id / 64) is the
				 * one worker_mask describes */
	__u16 count;		/* payload values: must equal XAGG_VALS */
	__u16 agg_id;		/* which of the job's aggregators owns the chunk */
	__u16 n_aggs;		/* how many aggregators the job spans */
	__u64 worker_mask;	/* contributors already summed into this payload,
				 * bit i = worker (worker_id & ~63) + i: one bit
				 * from a worker, several in a partial sum from a
				 * child aggregator whose workers lie in one block.
				 * A child whose workers span blocks names block
				 * XAGG_SET_WORDS and their count: the parent takes
				 * the workers it registered for that child (as
				 * many, or the partial is refused). A fixed 8
				 * bytes rather than a set as wide as the job:
				 * every packet carries it, a worker's needs one
				 * bit. */
};

/* XDP -> tc metadata for unicast fan-out (see xagg_tc_fanout). */
struct xagg_meta {
	__u32 magic;		/* XAGG_META_MAGIC */
	__u32 job_id;
	__u16 l3_off;		/* IPv4 header offset as XDP saw it; tc finds its
				 * own (a VLAN tag may be pulled out in between) */
	__u16 agg_key;		/* the job entry's agg_id key (XAGG_AGG_MAIN ...) */
	__u32 pad;
};

#endif /* XAGG_PROTO_H */
