/* A sparse sum written into a dense result (xagg/compress/base.py: Sparse.into
 * is the reference in torch, bit for bit). Pair j puts vals[j] at position
 * idx[j] of the big layers' concatenation, which sits in the bucket at
 * idx[j] + shift[r] for the last run r whose start[r] <= idx[j] (no runs: the
 * same position). With ``add`` the values at one position are added in j's
 * order onto what ``out`` holds there (zero), as index_add_ does; without,
 * each is stored (positions do not repeat). ``divide`` > 1 divides each
 * written position's total once: ``seen`` (a bit per position, all clear,
 * and left clear) marks those already divided where positions repeat.
 * Three passes over the pairs at most, where torch takes a searchsorted,
 * an index_add_, a gather, a division and a scatter.
 *
 * Every index is checked before anything is written: an index from the
 * wire outside [0, n) returns its j and leaves ``out`` as it was. */
#include <stdint.h>

/* The bucket position of big-layer index i. ``*r`` is the run the last
 * index fell in: each rank's indices ascend, so it walks forward, and goes
 * back to the first run where a rank's list starts again (no binary search
 * to mispredict on every index). */
static inline int64_t position(int64_t i, const int64_t *start, const int64_t *shift, int64_t runs,
			       int64_t *r)
{
	if (!runs)
		return i;
	if (start[*r] > i)
		*r = 0;
	while (*r + 1 < runs && start[*r + 1] <= i)
		(*r)++;
	return i + shift[*r];
}

int64_t xagg_scatter_into(float *out, const int64_t *idx, const float *vals, int64_t m, int64_t n,
			  const int64_t *start, const int64_t *shift, int64_t runs, int add, float divide,
			  uint8_t *seen)
{
	for (int64_t j = 0; j < m; j++)
		if (idx[j] < 0 || idx[j] >= n)
			return j;
	int64_t r = 0;
	for (int64_t j = 0; j < m; j++) {
		int64_t p = position(idx[j], start, shift, runs, &r);
		if (add)
			out[p] += vals[j];
		else
			out[p] = divide == 1.0f ? vals[j] : vals[j] / divide;
	}
	if (!add || divide == 1.0f)
		return -1;
	for (int64_t j = 0; j < m; j++) {
		int64_t p = position(idx[j], start, shift, runs, &r);
		uint8_t bit = (uint8_t)(1u << (p & 7));
		if (!(seen[p >> 3] & bit)) {
			seen[p >> 3] |= bit;
			out[p] /= divide;
		}
	}
	for (int64_t j = 0; j < m; j++)
		seen[position(idx[j], start, shift, runs, &r) >> 3] = 0;
	return -1;
}
