/* SPDX-License-Identifier: GPL-2.0 */
/* Aggregator state, created by bcc and owned by xaggd.
 *
 * Every job gets a contiguous range of `slots`: two per chunk (round
 * parity, SwitchML's shadow copy), sized for the whole gradient (XAgg), so
 * a slow worker never stalls the others on a small slot pool. A slot is
 * reset lazily when its generation differs from the job's, so registering
 * or resetting a job costs O(1) map writes. */
#ifndef XAGG_MAPS_H
#define XAGG_MAPS_H

struct xagg_job_key {
	__u32 job_id;
	__u16 agg_id;		/* XAGG_AGG_MAIN, or the root whose range a child entry sums */
	__u16 pad;
};

/* A job's entry on this host. A child entry (parent_ip != 0) sums some of
 * the job's workers (full_set) for another aggregator's chunk range and
 * sends their sum up as one PARTIAL; its slot's done is 1 once that
 * partial went up and 2 once the parent's result is stored there. */
struct xagg_job {
	__u32 cookie;
	__u32 gen;		/* bumped on (re)registration: stale slots reset */
	__u32 slot_base;	/* first slot of this job */
	__u32 n_chunks;		/* chunks this aggregator holds for the job */
	__u64 full_set[XAGG_SET_WORDS + 1];	/* one bit per worker (and wide child) a chunk needs */
	__u32 n_full;		/* workers: a chunk is done when its slot counts this many */
	__u32 job_index;	/* row of this job in `workers` and `job_stats` */
	__u32 bcast_ip;		/* broadcast fan-out destination (network order) */
	__u16 result_port;	/* broadcast fan-out UDP port (network order) */
	__u8  fanout;		/* XAGG_FANOUT_* */
	__u8  n_children;	/* registered child aggregators: results go to them too (tc) */
	__u16 n_workers;
	__u16 agg_id;		/* which of the job's aggregators this is ... */
	__u16 n_aggs;		/* ... of how many; 0 = not checked */
	__u16 up_block;		/* child entry: the (first) 64-worker block of its workers */
	__u32 parent_ip;	/* child entry: the root's address (network order), else 0 */
	__u16 parent_port;	/* the root's UDP port (network order) */
	__u8  parent_mac[6];	/* next hop to the root: registered, refreshed from its results */
	__u8  wide;		/* child entry: its workers span blocks (see xagg_hdr) */
	__u8  pad[3];
};

/* A contributor: a worker (row job_index * XAGG_MAX_WORKERS + worker_id of
 * `workers`) or a child aggregator sending partial sums (row job_index *
 * XAGG_MAX_CHILDREN + i of `children`, unused while ip == 0). addr, port
 * and mac are learned only from its packets that were summed; a pinned
 * contributor's addr is its registered ip and never learned. */
struct xagg_worker {
	__u32 ip;		/* registered source address, 0 = any (network order) */
	__u32 addr;		/* where results go (learned unless pinned) */
	__u16 port;		/* learned UDP source port (network order) */
	__u8  mac[6];		/* learned source MAC (next hop when routed) */
	__u64 mask;		/* a child's workers whose sums it may send, as bits of ... */
	__u16 block;		/* ... this block; XAGG_SET_WORDS: a wide child, mask its own bit */
	__u16 n;		/* a wide child: how many workers its sums hold */
	__u8  behind;		/* a worker a wide child sums: its own packets are refused */
	__u8  pad[3];
};

/* A chunk's sum for one round parity. Completion counts contributors
 * instead of comparing a set as wide as the job: a packet touches one word
 * of the set (its sender's block) and one counter. */
struct xagg_slot {
	struct bpf_spin_lock lock;	/* taken only when XAGG_LOCK */
	__u32 gen;
	__u32 round;
	__u32 done;		/* 1 once count == the job's n_full */
	__u32 count;		/* workers summed this round */
	__u8  encoding;		/* XAGG_ENC_* of this round's first contribution */
	__u8  pad[3];
	__u64 set[XAGG_SET_WORDS + 1];	/* contributors summed this round */
	__s32 vals[XAGG_VALS];
};

/* The payload of one packet, copied out of a multi-buffer frame: the
 * program cannot index a fragment directly, and a helper call (the copy)
 * is not allowed while the slot lock is held. */
struct xagg_payload {
	__s32 vals[XAGG_VALS];
};

struct xagg_job_stats {
	__u64 aggregated;	/* contributions summed */
	__u64 completed;	/* chunks finished */
	__u64 retransmits;	/* results resent to one worker */
	__u64 dropped;		/* duplicate, stale, partial overlap (what reached a slot) */
};

BPF_HASH(jobs, struct xagg_job_key, struct xagg_job, XAGG_MAX_JOBS);
BPF_ARRAY(workers, struct xagg_worker, XAGG_MAX_JOBS * XAGG_MAX_WORKERS);
BPF_ARRAY(children, struct xagg_worker, XAGG_MAX_JOBS * XAGG_MAX_CHILDREN);
BPF_ARRAY(slots, struct xagg_slot, XAGG_MAX_SLOTS);
BPF_PERCPU_ARRAY(counters, __u64, XAGG_NR_VERDICTS);
BPF_PERCPU_ARRAY(job_stats, struct xagg_job_stats, XAGG_MAX_JOBS);
#if XAGG_FRAGS
BPF_PERCPU_ARRAY(payload_buf, struct xagg_payload, 1);
#endif
/* Never used at run time: makes bcc emit the wire header's layout so Python
 * can check its own view of it. */
BPF_ARRAY(layout_hdr, struct xagg_hdr, 1);
BPF_ARRAY(layout_meta, struct xagg_meta, 1);

#endif /* XAGG_MAPS_H */
