/* SPDX-License-Identifier: GPL-2.0 */
/* A chunk's slot as a state machine: one packet's values combined into it
 * under its lock, and the outcome decided there. No map access and no
 * helper call but the lock (none is allowed while it is held). */
#ifndef XAGG_SLOT_H
#define XAGG_SLOT_H

#include "xagg_consts.h"
#include "xagg_proto.h"
#include "xagg_maps.h"

/* slot outcome, decided under the lock, acted on after it */
enum { SLOT_ADDED, SLOT_COMPLETED, SLOT_DUP, SLOT_DONE_RESEND, SLOT_STALE, SLOT_OVERLAP,
       SLOT_MIXED,		/* lanes of another width than the round's: never summed */
       /* decided after the lock, from what slot_update reports: */
       SLOT_PARTIAL_RESEND,	/* child slot: partial sent, parent's result not yet here */
       SLOT_FINAL };		/* child slot: the parent's result stored */

/* Loops over a packet's values. A linear frame's are unrolled: each access
 * is at a constant offset from the packet pointer, whose whole range the
 * caller proved against data_end. A multi-buffer build reads map memory
 * (the per-CPU copy), where a bounded loop verifies as well and keeps the
 * JIT'd code small enough for the I-cache at 2,000+ values. */
#ifndef XAGG_UNROLL
#if XAGG_FRAGS
#define XAGG_UNROLL	8
#else
#define XAGG_UNROLL	XAGG_VALS
#endif
#endif
#define XAGG_STR(x) #x
#define XAGG_PRAGMA(x) _Pragma(XAGG_STR(x))
#define VALS_LOOP XAGG_PRAGMA(clang loop unroll_count(XAGG_UNROLL))

/* Values as 64-bit words: copies, and XAGG_OP_SUM64's adds, move two per
 * instruction (the JIT has no SIMD; the loops are most of the program's time
 * on a jumbo frame). The slot's and the per-CPU buffer's values are 8-byte
 * aligned (asserted below); a linear frame's may not be, which x86 and
 * arm64 load and store unaligned at no cost. */
#define XAGG_WORDS	(XAGG_VALS / 2)
#define XAGG_ODD	(XAGG_VALS & 1)
_Static_assert(__builtin_offsetof(struct xagg_slot, vals) % 8 == 0,
	       "slot values must be 8-byte aligned for the 64-bit loops");
_Static_assert(__builtin_offsetof(struct xagg_payload, vals) % 8 == 0,
	       "buffer values must be 8-byte aligned for the 64-bit loops");

static __always_inline void vals_copy(__s32 *dst, const __s32 *src)
{
	__u64 *d = (__u64 *)dst;
	const __u64 *w = (const __u64 *)src;
	int i;

VALS_LOOP
	for (i = 0; i < XAGG_WORDS; i++)
		d[i] = w[i];
	if (XAGG_ODD)
		dst[XAGG_VALS - 1] = src[XAGG_VALS - 1];
}

/* Combine one packet into the slot; the caller holds the slot lock. */
static __always_inline void slot_combine(struct xagg_slot *s, __s32 *pv,
					 int first, __u8 op)
{
	int i;

	if (first) {
		vals_copy(s->vals, pv);
	} else if (op == XAGG_OP_SUM64) {
		__u64 *sw = (__u64 *)s->vals, *pw = (__u64 *)pv;

VALS_LOOP
		for (i = 0; i < XAGG_WORDS; i++)
			sw[i] += pw[i];
		if (XAGG_ODD)
			s->vals[XAGG_VALS - 1] += pv[XAGG_VALS - 1];
	} else if (op == XAGG_OP_SUM) {
VALS_LOOP
		for (i = 0; i < XAGG_VALS; i++)
			s->vals[i] += pv[i];
	} else {
VALS_LOOP
		for (i = 0; i < XAGG_VALS; i++)
			if (pv[i] > s->vals[i])
				s->vals[i] = pv[i];
	}
}

/* A finished chunk's values into the outgoing payload; the caller holds
 * the slot lock. */
static __always_inline void slot_copy_out(struct xagg_slot *s, __s32 *out)
{
	vals_copy(out, s->vals);
}

_Static_assert((XAGG_SET_WORDS & (XAGG_SET_WORDS - 1)) == 0,
	       "a set word index is masked into range: XAGG_SET_WORDS must be a power of two");
_Static_assert(XAGG_MAX_WORKERS <= 64 * XAGG_SET_WORDS,
	       "a slot's contributor set must hold XAGG_MAX_WORKERS workers");

/* A new round (or generation) on the slot: nobody summed yet. */
static __always_inline void slot_clear(struct xagg_slot *s)
{
	int i;

#pragma unroll
	for (i = 0; i <= XAGG_SET_WORDS; i++)
		s->set[i] = 0;
	s->count = 0;
	s->done = 0;
}

/* The outcome of one packet (values pv, contributors mask in set word k,
 * n workers) for the slot, the slot updated to match; the caller holds the
 * slot lock. */
static __always_inline int slot_step(struct xagg_slot *s, struct xagg_job *job,
				     struct xagg_hdr *xh, __s32 *pv, __u32 k, __u64 mask,
				     __u32 n, int *superseded, __u32 *done_was)
{
	__u32 round = xh->round;
	/* 1 for the parent's result to a child slot (the caller checked its
	 * source and made mask the entry's whole set, word k), else 0. Used
	 * without a branch: every branch here is another walk of the value
	 * loops for the verifier, and the multi-buffer build has no room for
	 * one. */
	__u64 final = xh->flags & XAGG_F_RESULT;
	__u64 had;
	__s32 d;

	if (s->gen != job->gen) {
		/* First use since the job was (re)registered: whatever the slot
		 * holds is another job's. A round two behind (the same parity)
		 * makes the reset below clear it, and done keeps it from
		 * counting as superseded. */
		s->gen = job->gen;
		s->round = round - 2;
		s->done = 1;
	}
	d = (__s32)(round - s->round);
	if (d < 0 && d >= -XAGG_ROUND_WINDOW)
		return SLOT_STALE;
	if (d != 0) {
		/* The previous round on this parity is over: every worker got
		 * it before any could start this one. An unfinished one was
		 * abandoned (a worker gave up on it), so the newer round wins.
		 * A round far behind is a new incarnation of the job (see
		 * XAGG_ROUND_WINDOW): the old run's sum goes the same way.
		 * One branch for both keeps the verifier's walk of the
		 * combine below to the two paths it had (d == 0, d != 0). */
		*superseded = !s->done && s->count;
		s->round = round;
		slot_clear(s);
	}
	/* The parent's result is stored over whatever the slot holds (the
	 * root summed every worker, so it is the round's sum even where this
	 * child's own is incomplete, its slot reset meanwhile): as the first
	 * contribution to an empty slot, whose count it fills (n is all the
	 * entry's workers). Word k (its first block) is emptied so that its
	 * bits go in; the other words do not matter once the slot is done. */
	s->set[k] &= final - 1;
	s->count &= final - 1;
	*done_was = s->done;
	/* The round's first contribution set its lanes' width: a sum of
	 * 16-bit lane pairs and 32-bit lanes is neither, and a finished one
	 * is no answer to the other width (checked before the resend). */
	if (s->count && xh->encoding != s->encoding)
		return SLOT_MIXED;
	/* every contributor of a finished chunk is in it */
	if (s->done && !final)
		return SLOT_DONE_RESEND;
	had = s->set[k];
	if (had & mask) {
		/* A worker's mask is one bit, so only a partial sum can overlap
		 * in part. It is dropped whole: a sum cannot be taken apart
		 * into the workers the slot has and those it lacks. */
		if (mask & ~had)
			return SLOT_OVERLAP;
		return SLOT_DUP;
	}
	slot_combine(s, pv, s->count == 0, xh->op);
	s->encoding = xh->encoding;	/* the first's; every later one equals it */
	s->set[k] = had | mask;
	s->count += n;
	if (s->count != job->n_full)
		return SLOT_ADDED;
	s->done = 1 + final;	/* a child's: 1 partial sent, 2 result stored */
	return SLOT_COMPLETED;
}

/* slot_step under the slot lock. On SLOT_COMPLETED and SLOT_DONE_RESEND
 * the result is copied into pv before the lock is dropped: from then on a
 * round r+2 packet on this parity may reset and refill the slot, and a copy
 * taken after the unlock could mix the two rounds. pv is the packet itself
 * in a linear frame (no helper call happens under the lock), the per-CPU
 * copy in a multi-buffer one. */
static __always_inline int slot_update(struct xagg_slot *s, struct xagg_job *job,
				       struct xagg_hdr *xh, __s32 *pv, __u32 k, __u64 mask,
				       __u32 n, int *superseded, __u32 *done_was)
{
	int outcome;

#if XAGG_LOCK
	bpf_spin_lock(&s->lock);
#endif
	outcome = slot_step(s, job, xh, pv, k, mask, n, superseded, done_was);
	if (outcome == SLOT_COMPLETED || outcome == SLOT_DONE_RESEND)
		slot_copy_out(s, pv);
#if XAGG_LOCK
	bpf_spin_unlock(&s->lock);
#endif
	return outcome;
}

#endif /* XAGG_SLOT_H */
