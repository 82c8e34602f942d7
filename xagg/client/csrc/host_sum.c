// SPDX-License-Identifier: MIT
/* The ranks of one host summing in shared memory (xagg/torch/local_reduce.py
 * explains the segment; xagg/client/host_sum.py binds these and keeps the
 * numpy reference, equal to the bit). */
#define _GNU_SOURCE
#include <errno.h>
#include <limits.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <linux/futex.h>
#include <sys/syscall.h>

#include "elem.h"

#define LINE_WORDS 8		/* int64 counters per rank: one cache line each */
#define BLOCK 2048		/* elements summed per pass: the block stays in L1 while L inputs add to it */

/* out[b..b+m) = (src[0] + src[1] + ... + src[L-1]) / divide there, added
 * in that order in float32 (numpy's np.add chain on the widened slices,
 * then np.divide); src of elem's type, widened as read (elem.h). */
static INLINE void sum_block(const void *const *src, int32_t L, int64_t b, int64_t m, float divide,
			     float *restrict o, int elem)
{
	const void *s0 = at(src[0], b, elem);

	if (L == 1) {
		for (int64_t i = 0; i < m; i++)
			o[i] = load(s0, i, elem);
	} else {
		const void *s1 = at(src[1], b, elem);

		for (int64_t i = 0; i < m; i++)
			o[i] = load(s0, i, elem) + load(s1, i, elem);
	}
	for (int32_t j = 2; j < L; j++) {
		const void *s = at(src[j], b, elem);

		for (int64_t i = 0; i < m; i++)
			o[i] += load(s, i, elem);
	}
	if (divide != 1.0f)
		for (int64_t i = 0; i < m; i++)
			o[i] /= divide;
}

/* out[i] = (src[0][i] + ... + src[L-1][i]) / divide, float32, of L slices
 * of elem's type: a 16-bit bucket's slices are summed as they are, with no
 * float32 copy of them. Block by block, so the partial sum stays in cache:
 * one pass over the inputs, one write. */
static INLINE void sum_blocks(const void *const *src, int32_t L, int64_t n, float divide, float *out, int elem)
{
	for (int64_t b = 0; b < n; b += BLOCK)
		sum_block(src, L, b, n - b < BLOCK ? n - b : BLOCK, divide, out + b, elem);
}

void xagg_host_sum(const void *const *src, int32_t elem, int32_t L, int64_t n, float divide, float *out)
{
#define SUM(E) sum_blocks(src, L, n, divide, out, E); break
	BY_ELEM(elem, SUM)
#undef SUM
}

static long futex(uint32_t *word, int op, uint32_t val, const struct timespec *ts)
{
	return syscall(SYS_futex, word, op, val, ts, NULL, 0);
}

/* Rank ``me`` of ``L`` arrives at barrier ``seq``: counters[j * LINE_WORDS]
 * is rank j's last barrier; *gen the last one every rank reached (its low
 * 32 bits), a futex. Whoever sees every rank there raises gen and wakes
 * the others; the rest sleep on gen, not spin: a host's ranks may share
 * fewer cores than there are ranks. gen is read before the counters are,
 * so an arrival between the two changes gen and the futex does not sleep.
 * 0: every rank is there; 1: ``timeout_ms`` passed first (the caller looks
 * whether its peers are alive, then calls again). */
int xagg_host_wait(int64_t *counters, uint32_t *gen, int32_t L, int32_t me, int64_t seq, int32_t timeout_ms)
{
	struct timespec ts = { timeout_ms / 1000, (long)(timeout_ms % 1000) * 1000000L };

	__atomic_store_n(&counters[me * LINE_WORDS], seq, __ATOMIC_SEQ_CST);
	for (;;) {
		uint32_t g = __atomic_load_n(gen, __ATOMIC_SEQ_CST);
		int32_t j;

		if ((int32_t)(g - (uint32_t)seq) >= 0)
			return 0;
		for (j = 0; j < L; j++)
			if (__atomic_load_n(&counters[j * LINE_WORDS], __ATOMIC_SEQ_CST) < seq)
				break;
		if (j == L) {
			__atomic_store_n(gen, (uint32_t)seq, __ATOMIC_SEQ_CST);
			futex(gen, FUTEX_WAKE, INT_MAX, NULL);
			return 0;
		}
		if (futex(gen, FUTEX_WAIT, g, &ts) && errno == ETIMEDOUT)
			return 1;
	}
}
