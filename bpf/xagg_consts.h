/* SPDX-License-Identifier: GPL-2.0 */
/* xagg constants shared by the XDP program and Python (xagg/proto.py parses
 * the #define lines of this file: keep one `#define NAME value` per line).
 * Sizes are #ifndef defaults so the loader can specialise the program with
 * bcc cflags (-DXAGG_VALS=128 ...). */
#ifndef XAGG_CONSTS_H
#define XAGG_CONSTS_H

#define XAGG_MAGIC	0x47474158	/* "XAGG" as little-endian bytes */
#define XAGG_VERSION	1

#ifndef XAGG_PORT
#define XAGG_PORT	9977		/* UDP port aggregators listen on */
#endif
#ifndef XAGG_VALS
#define XAGG_VALS	256		/* int32 values per packet */
#endif
#ifndef XAGG_MAX_WORKERS
#define XAGG_MAX_WORKERS 1024		/* workers per job: at most 64 x XAGG_SET_WORDS */
#endif
/* A slot's contributor set: 64-bit words, worker w at bit w % 64 of word
 * w / 64 (a power of two: a word index is masked into range), and one more
 * word, XAGG_SET_WORDS, for the child aggregators whose workers span
 * several blocks (bit i: child row i; see xagg_hdr). */
#define XAGG_SET_WORDS	16
#ifndef XAGG_MAX_JOBS
#define XAGG_MAX_JOBS	16
#endif
#ifndef XAGG_MAX_CHILDREN
#define XAGG_MAX_CHILDREN 16		/* child aggregators per job (PARTIAL senders) */
#endif
#ifndef XAGG_MAX_SLOTS
#define XAGG_MAX_SLOTS	8192		/* chunk slots, 2 per chunk (round parity) */
#endif
#ifndef XAGG_LOCK
#define XAGG_LOCK	1		/* 1: per-slot bpf_spin_lock (multi-queue safe) */
#endif
#ifndef XAGG_FRAGS
#define XAGG_FRAGS	0		/* 1: payload may span buffers (multi-buffer XDP, jumbo frames) */
#endif

/* op: how a contribution combines with the slot */
#define XAGG_OP_SUM	0		/* int32 lanes, each wrapping on its own */
#define XAGG_OP_MAX	1		/* used to agree on per-chunk exponents */
/* Lanes added two at a time as 64-bit words, so a carry out of an even lane
 * runs into the odd one: for senders that keep every lane's total over all
 * contributors in [0, 2**32) (xagg/client/fixedpoint.py biases its values
 * by 2**S). Half the instructions of XAGG_OP_SUM, whose adds they equal
 * then; the odd last lane of an odd XAGG_VALS is added alone. */
#define XAGG_OP_SUM64	2
#define XAGG_NR_OPS	3

/* flags */
#define XAGG_F_RESULT	0x01		/* aggregator -> worker: finished chunk */
#define XAGG_F_PARTIAL	0x02		/* child aggregator -> parent: mask spans workers
					 * (of one 64-worker block, see xagg_hdr) */
#define XAGG_F_RETX	0x04		/* result resent to one worker after completion */
/* Worker -> aggregator: this packet is a resend. Carried into the result (or
 * partial) it completes, so workers can tell a chunk late for someone's loss
 * from one late for reordering (the client's gap threshold learns only the
 * second). */
#define XAGG_F_RESENT	0x08
/* Client -> aggregator: a bare header asking the values per packet and
 * whether job and cookie are known; answered with XAGG_F_RESULT (xagg_probe.h). */
#define XAGG_F_PROBE	0x10

/* The agg_id half of the `jobs` key of a job's main entry (the chunks this
 * host owns, or every chunk of an unchecked job). A child entry, holding
 * another aggregator's chunk range for some of the job's workers, is keyed
 * by that aggregator's agg_id. */
#define XAGG_AGG_MAIN	0xffff

/* Rounds: a slot whose round is more than this far ahead of a packet's
 * belongs to another incarnation of the job (a run restarted with the same
 * id and cookie starts its rounds at a fresh random base), so the slot
 * restarts instead of dropping the packet as stale. Within one run a packet
 * is never this many rounds late. */
#define XAGG_ROUND_WINDOW	65536

/* payload encodings: the lanes' width. Every contribution to a chunk's
 * round must share it: a sum of 16-bit lane pairs and 32-bit lanes is
 * neither (XAGG_V_MIXED_LANES). */
#define XAGG_ENC_I32	0		/* little-endian int32, fixed point */
#define XAGG_ENC_I16X2	1		/* two 16-bit fixed-point lanes per int32 (xagg/client/fixedpoint.py) */
#define XAGG_NR_ENCODINGS 2

/* fan-out of a finished chunk */
#define XAGG_FANOUT_BCAST	0	/* one L2 broadcast frame, XDP_TX */
#define XAGG_FANOUT_UNICAST	1	/* tc clone_redirect, one copy per worker */

/* exponents a worker sends with XAGG_OP_MAX (see xagg/fixedpoint.py) */
#define XAGG_EXP_ZERO		-2147483647	/* chunk is all zeros */
#define XAGG_EXP_NONFINITE	2147483647	/* chunk holds NaN/Inf: result is NaN */

/* verdict counters, one per-CPU slot each */
#define XAGG_V_AGGREGATED	0	/* contribution summed, chunk still open */
#define XAGG_V_COMPLETED	1	/* contribution summed and chunk finished */
#define XAGG_V_DUPLICATE	2	/* contributor already in this round's mask */
#define XAGG_V_STALE		3	/* round older than the slot's */
#define XAGG_V_BAD_COOKIE	4
#define XAGG_V_UNKNOWN_JOB	5
#define XAGG_V_MALFORMED	6	/* xagg port, but not a valid xagg packet */
#define XAGG_V_PASSED		7	/* not xagg traffic (or a result): XDP_PASS */
#define XAGG_V_RETRANSMIT	8	/* finished chunk resent to one worker */
#define XAGG_V_SUPERSEDED	9	/* newer round replaced an unfinished one */
#define XAGG_V_BAD_WORKER	10	/* worker id/mask out of range, or wrong source
					 * (a PARTIAL not from a registered child) */
#define XAGG_V_BAD_CHUNK	11	/* chunk beyond the job's allocation */
#define XAGG_V_WRONG_AGG	12	/* agg_id/n_aggs name another aggregator of the job */
#define XAGG_V_PARTIAL_OVERLAP	13	/* PARTIAL overlapping this round's mask in part:
					 * dropped whole, a sum cannot be split */
#define XAGG_V_NO_META		14	/* unicast completion, but the driver has no XDP
					 * metadata to hand it to tc: xaggd refuses unicast */
#define XAGG_V_PARTIAL_SENT	15	/* a child's workers all summed: one PARTIAL to the parent */
#define XAGG_V_PARTIAL_RESENT	16	/* a worker's resend hit a child slot still waiting for the
					 * parent's result: the partial sum went up again */
#define XAGG_V_PARENT_RESULT	17	/* the parent's result stored in a child's slot and fanned
					 * out to the child's workers */
#define XAGG_V_PROBED		18	/* a client's probe answered (xagg_probe.h) */
#define XAGG_V_MIXED_LANES	19	/* lanes (encoding) of another width than the chunk's
					 * round holds: workers of one job set different
					 * --wire-bits; never summed (xagg_slot.h) */
#define XAGG_NR_VERDICTS	20

#define XAGG_META_MAGIC	0x4d474158	/* XDP -> tc metadata tag "XAGM" */

#endif /* XAGG_CONSTS_H */
