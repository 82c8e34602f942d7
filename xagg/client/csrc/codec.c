// SPDX-License-Identifier: MIT
/* The client's fixed-point codec, in C: one pass over a tensor each way.
 *
 * Bit for bit the functions of xagg/client/fixedpoint.py (chunk_exponents,
 * quantise, dequantise), which stay the reference and the fallback. numpy
 * walked a 16 MB gradient about ten times per call (a padded copy, abs,
 * max, multiply, rint, astype, the copy into the packets, the copy out of
 * the results, astype, multiply, the final slice) and made a fresh
 * full-size temporary for most of them; here the exponents are one read,
 * quantising is one read and one write straight into the packet payloads,
 * and dequantising one read of the results and one write into the caller's
 * array. Nothing is allocated.
 *
 * A chunk is `vals` consecutive elements; the last one may be short (the
 * numpy reference pads it with zeros, which change no maximum and quantise
 * to 0). Exponents follow fixedpoint.py: E with max|x| < 2**E, or one of the
 * XAGG_EXP_* markers of xagg_consts.h.
 *
 * Biased rows (bias = 2**S, fixedpoint.bias): live values, and the padding
 * of a live chunk, go out plus bias (XAGG_OP_SUM64 needs every lane's total
 * in [0, 2**32)), and unbias (N * bias) comes off each sum; 0 and 0 for
 * rows summed lane by lane (XAGG_OP_SUM). A chunk sent as zeros stays zeros.
 *
 * Rounding: float32 multiply by a power of two, then round half to even,
 * as numpy's rint under the default rounding mode. rintf() would be a libm
 * call per element on baseline x86-64 (roundps needs SSE4.1), so
 * rint_f32() rounds with the 2**23 trick, which the compiler vectorises
 * with SSE2 alone. Build with -ffp-contract=off: a fused multiply-add would
 * round once where numpy rounds twice.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <linux/types.h>

#include "xagg_consts.h"
#include "xagg_proto.h"
#include "codec.h"

/* The encoding loops are also built for AVX2 and picked when the library
 * loads (an ifunc): the library is cached under ~/.cache and may be shared
 * by ranks on other CPUs, so no -march. The encode gains from it
 * (scripts/bench_codec.py measures it); the decode measured no faster, so
 * it keeps one build. The results are the same bits: every op is
 * an exact IEEE one at any vector width, and -ffp-contract=off keeps FMA out.
 * The loops' helpers are always inlined, so each clone has its own copy. */
#if defined(__x86_64__) && defined(__has_attribute)
#if __has_attribute(target_clones)
#define XAGG_SIMD_CLONES __attribute__((target_clones("avx2", "default")))
#endif
#endif
#ifndef XAGG_SIMD_CLONES
#define XAGG_SIMD_CLONES
#endif

#define F32_ABS_MASK	0x7fffffff
#define F32_INF_BITS	0x7f800000	/* |x| bits at or above: Inf or NaN */
#define F32_MANT_BITS	23
#define F32_BIAS	127
#define F32_MIN_EXP	(-126)		/* 2**e is a normal float32 for e in */
#define F32_MAX_EXP	127		/* F32_MIN_EXP..F32_MAX_EXP */
#define TWO_23		0x1p23f		/* from here on every float32 is an integer */

/* the float32 tensor read as its bits; may_alias: the caller wrote floats */
typedef int32_t __attribute__((may_alias)) f32_bits;

_Static_assert(sizeof(struct xagg_hdr) % sizeof(int32_t) == 0,
	       "payloads must stay int32-aligned behind the header");

/* The frexp() exponent of a positive finite float32 given as its bits:
 * x = m * 2**e with m in [0.5, 1), so x < 2**e. */
static int32_t frexp_exponent(uint32_t bits)
{
	if (bits >> F32_MANT_BITS)
		return (int32_t)(bits >> F32_MANT_BITS) - (F32_BIAS - 1);
	/* subnormal: bits * 2**-149, its top set bit decides */
	return (32 - __builtin_clz(bits)) - (F32_BIAS - 1 + F32_MANT_BITS);
}

/* max |x| of n floats, as bits. Non-negative floats order like their bits,
 * and NaN's bits lie above Inf's, so an integer maximum (which vectorises,
 * and needs no NaN rules) finds the largest magnitude and any non-finite. */
static inline __attribute__((always_inline))
uint32_t max_abs_bits(const f32_bits *restrict x, int64_t n)
{
	int32_t m = 0;

	for (int64_t i = 0; i < n; i++) {
		int32_t b = x[i] & F32_ABS_MASK;

		m = b > m ? b : m;
	}
	return (uint32_t)m;
}

XAGG_SIMD_CLONES int32_t xagg_exponent_one(const float *x, int64_t n, int32_t vals, int64_t c)
{
	int64_t lo = c * vals, len = n - lo < vals ? n - lo : vals;
	uint32_t m = max_abs_bits((const f32_bits *)x + lo, len);

	if (m == 0)
		return XAGG_EXP_ZERO;
	if (m >= F32_INF_BITS)
		return XAGG_EXP_NONFINITE;
	return frexp_exponent(m);
}

/* fixedpoint.chunk_exponents() of the chunks of x[0..n) */
XAGG_SIMD_CLONES void xagg_chunk_exponents(const float *x, int64_t n, int32_t vals, int32_t *exps)
{
	int64_t c, count = (n + vals - 1) / vals;

	for (c = 0; c < count; c++)
		exps[c] = xagg_exponent_one(x, n, vals, c);
}

static int is_marker(int32_t e)
{
	return e == XAGG_EXP_ZERO || e == XAGG_EXP_NONFINITE;
}

/* fixedpoint.send_exponents() of one chunk: the prediction where it holds
 * this worker's chunk, else ZERO (sent as zeros; every worker then redoes it) */
int32_t xagg_send_exponent(int32_t own, int32_t pred)
{
	int fits = !is_marker(pred) && own != XAGG_EXP_NONFINITE &&
		   (own == XAGG_EXP_ZERO || own <= pred);

	return fits ? pred : XAGG_EXP_ZERO;
}

/* 2**e as a float32, for e in F32_MIN_EXP..F32_MAX_EXP (exact) */
static float pow2_f32(int64_t e)
{
	uint32_t b = (uint32_t)(e + F32_BIAS) << F32_MANT_BITS;
	float f;

	memcpy(&f, &b, sizeof(f));
	return f;
}

static int normal_pow2(int64_t e)
{
	return e >= F32_MIN_EXP && e <= F32_MAX_EXP;
}

/* Round half to even, as rintf() in the default rounding mode. Adding 2**23
 * to |y| < 2**23 leaves no fraction bits, so the addition itself rounds
 * (to even, and the parity of |y|'s rounding is that of the sum's); larger
 * |y|, and NaN/Inf, pass through unchanged. */
static inline float rint_f32(float y)
{
	float a = fabsf(y);
	float r = copysignf((a + TWO_23) - TWO_23, y);

	return a < TWO_23 ? r : y;
}

/* An integral y as int32, plus bias modulo 2**32: a prediction that fails
 * leaves values out of range, overwritten later, so no signed overflow. */
static inline int32_t biased(float y, int32_t bias)
{
	return (int32_t)((uint32_t)(int32_t)y + (uint32_t)bias);
}

/* One chunk: q = rint(x * 2**shift) + bias. Where 2**shift is not a normal
 * float32 (values below ~2**-99) fixedpoint.quantise() goes through float64;
 * so here. */
static inline __attribute__((always_inline))
void quantise_chunk(const float *restrict x, int64_t len, int64_t shift, int32_t bias,
		    int32_t *restrict q)
{
	if (normal_pow2(shift)) {
		float s = pow2_f32(shift);

		for (int64_t i = 0; i < len; i++)
			q[i] = biased(rint_f32(x[i] * s), bias);
	} else {
		for (int64_t i = 0; i < len; i++)
			q[i] = (int32_t)((uint32_t)(int32_t)rint(ldexp((double)x[i], (int)shift)) +
					 (uint32_t)bias);
	}
}

/* q[from..vals) = v: a short last chunk's padding */
static void fill(int32_t *q, int64_t from, int32_t vals, int32_t v)
{
	if (!v) {
		memset(q + from, 0, sizeof(*q) * (vals - from));
		return;
	}
	for (int64_t i = from; i < vals; i++)
		q[i] = v;
}

/* fixedpoint.quantise() of the chunks of x[0..n) with exponents exps,
 * written into the payload of packet row_of_chunk[c] (rows pkt_size bytes
 * apart, a struct xagg_hdr ahead of each payload); a chunk whose row is
 * negative is not written. A marker exponent (ZERO, NONFINITE) sends zeros,
 * the tail of a short last chunk too. headroom: fixedpoint.headroom_bits(N),
 * passed in so its formula lives in one place. */
XAGG_SIMD_CLONES void xagg_quantise_one(const float *x, int64_t n, int32_t vals, int64_t c,
		       int32_t exp, int32_t headroom, int32_t bias, int32_t *q)
{
	int64_t lo = c * vals, len = n - lo < vals ? n - lo : vals;

	if (is_marker(exp)) {
		fill(q, 0, vals, 0);
		return;
	}
	quantise_chunk(x + lo, len, (int64_t)headroom - exp, bias, q);
	fill(q, len, vals, bias);
}

/* Exponent and quantisation of chunk c in one read of the tensor, for the
 * round loop's steady state, where the predicted exponent usually holds:
 * the chunk is quantised with `pred` while its max |x| is taken, and zeroed
 * afterwards in the rare case the prediction does not hold (own > pred, or
 * NaN/Inf), where the values just written are out of int32's range and
 * meaningless (x86 converts them to INT32_MIN; they are overwritten). The
 * same bits as xagg_exponent_one, xagg_send_exponent and xagg_quantise_one
 * in a row (tests/test_codec.py); the tensor is streamed from memory once
 * instead of twice. Returns the send exponent; *own gets the chunk's own. */
XAGG_SIMD_CLONES int32_t xagg_encode_one(const float *x, int64_t n, int32_t vals, int64_t c,
			int32_t pred, int32_t headroom, int32_t bias, int32_t *q, int32_t *own)
{
	int64_t lo = c * vals, len = n - lo < vals ? n - lo : vals;
	int64_t shift = (int64_t)headroom - pred;
	int32_t send;

	if (is_marker(pred) || !normal_pow2(shift)) {	/* no fused pass: rare */
		*own = xagg_exponent_one(x, n, vals, c);
		send = xagg_send_exponent(*own, pred);
		xagg_quantise_one(x, n, vals, c, send, headroom, bias, q);
		return send;
	}
	{
		const float *restrict xs = x + lo;
		const f32_bits *restrict xb = (const f32_bits *)xs;
		int32_t *restrict qs = q;
		float s = pow2_f32(shift);
		int32_t m = 0;

		for (int64_t i = 0; i < len; i++) {
			int32_t b = xb[i] & F32_ABS_MASK;

			m = b > m ? b : m;
			qs[i] = biased(rint_f32(xs[i] * s), bias);
		}
		*own = m == 0 ? XAGG_EXP_ZERO : (uint32_t)m >= F32_INF_BITS ? XAGG_EXP_NONFINITE
			: frexp_exponent((uint32_t)m);
	}
	send = xagg_send_exponent(*own, pred);
	if (send != pred)
		fill(q, 0, vals, 0);	/* sent as zeros: every worker redoes it */
	else
		fill(q, len, vals, bias);
	return send;
}

XAGG_SIMD_CLONES void xagg_quantise(const float *x, int64_t n, int32_t vals, const int32_t *exps,
		   int32_t headroom, int32_t bias, uint8_t *pkts, int64_t pkt_size,
		   const int64_t *row_of_chunk)
{
	int64_t c, count = (n + vals - 1) / vals;

	for (c = 0; c < count; c++) {
		if (row_of_chunk[c] < 0)
			continue;
		xagg_quantise_one(x, n, vals, c, exps[c], headroom, bias,
				  (int32_t *)(pkts + row_of_chunk[c] * pkt_size +
					      sizeof(struct xagg_hdr)));
	}
}

/* One chunk: out = float32(q - unbias) * 2**shift (q - unbias taken modulo
 * 2**32, as the sum was), through float64 where 2**shift is not a normal
 * float32 (as fixedpoint.dequantise()). */
static void dequantise_chunk(const int32_t *restrict q, int64_t len, int64_t shift,
			     uint32_t unbias, float *restrict out)
{
	if (normal_pow2(shift)) {
		float s = pow2_f32(shift);

		for (int64_t i = 0; i < len; i++)
			out[i] = (float)(int32_t)((uint32_t)q[i] - unbias) * s;
	} else {
		for (int64_t i = 0; i < len; i++)
			out[i] = (float)ldexp((double)(int32_t)((uint32_t)q[i] - unbias), (int)shift);
	}
}

/* fixedpoint.dequantise() into out[0..n) (nothing written past n): chunk c's
 * sums are row row_of_chunk[c] of rows (vals int32 each). A ZERO chunk
 * is 0 and a NONFINITE one NaN whatever its row (it is not read: an exact
 * call has no row for them); any other chunk whose row is negative is
 * left alone, its sum being in another set of rows (a second round). */
void xagg_dequantise_one(const int32_t *q, int32_t vals, int64_t c,
			 int32_t exp, int32_t headroom, uint32_t unbias, float *out, int64_t n)
{
	int64_t lo = c * vals, len = n - lo < vals ? n - lo : vals;

	if (exp == XAGG_EXP_ZERO) {
		memset(out + lo, 0, sizeof(*out) * len);
	} else if (exp == XAGG_EXP_NONFINITE) {
		for (int64_t i = 0; i < len; i++)
			out[lo + i] = __builtin_nanf("");
	} else {
		dequantise_chunk(q, len, (int64_t)exp - headroom, unbias, out + lo);
	}
}

void xagg_dequantise(const int32_t *rows, const int64_t *row_of_chunk,
		     const int32_t *exps, int32_t headroom, uint32_t unbias, int32_t vals,
		     float *out, int64_t n)
{
	int64_t c, count = (n + vals - 1) / vals;

	for (c = 0; c < count; c++) {
		if (row_of_chunk[c] < 0 && !is_marker(exps[c]))
			continue;	/* its sum is in another round's rows */
		xagg_dequantise_one(row_of_chunk[c] < 0 ? NULL : rows + row_of_chunk[c] * vals,
				    vals, c, exps[c], headroom, unbias, out, n);
	}
}

/* ---- 16-bit lanes (fixedpoint.py, bits=16) -----------------------------
 *
 * The same exponents, rounding and bias with S = 14 - ceil(log2 N), each
 * value a uint16 lane, two to an int32 word of the payload (value 2i in the
 * low half of word i: x86-64 is little-endian, as the wire). `vals` here
 * counts values per chunk: twice the packet's int32 words.
 *
 * Error feedback: with r (the caller's residual, float32 like x) the chunk
 * quantised is v = x + r, and r_out gets what the lanes leave of it,
 * v - q * 2**(E - S) (fixedpoint.feedback), in the same pass: a chunk sent
 * as zeros keeps all of v (0 if it holds NaN/Inf). r and r_out are both
 * given or both NULL; r_out must not alias r (a redone chunk is quantised
 * again from x + r). */

/* v = x + r, or x */
static inline __attribute__((always_inline))
float fb_value(const float *restrict x, const float *restrict r, int64_t i, int fb)
{
	return fb ? x[i] + r[i] : x[i];
}

static inline __attribute__((always_inline))
uint32_t max_abs_fb(const float *restrict x, const float *restrict r, int64_t n, int fb)
{
	int32_t m = 0;

	for (int64_t i = 0; i < n; i++) {
		float v = fb_value(x, r, i, fb);
		int32_t b;

		memcpy(&b, &v, sizeof(b));
		b &= F32_ABS_MASK;
		m = b > m ? b : m;
	}
	return (uint32_t)m;
}

static int32_t exponent_of(uint32_t m)
{
	if (m == 0)
		return XAGG_EXP_ZERO;
	if (m >= F32_INF_BITS)
		return XAGG_EXP_NONFINITE;
	return frexp_exponent(m);
}

/* the chunk's extent: [lo, lo + len) of x[0..n) */
#define CHUNK_SPAN(n, vals, c, lo, len) \
	int64_t lo = (c) * (vals), len = (n) - lo < (vals) ? (n) - lo : (vals)

XAGG_SIMD_CLONES int32_t xagg_exponent16_one(const float *x, const float *r, int64_t n, int32_t vals, int64_t c)
{
	CHUNK_SPAN(n, vals, c, lo, len);

	return exponent_of(r ? max_abs_fb(x + lo, r + lo, len, 1) : max_abs_fb(x + lo, NULL, len, 0));
}

XAGG_SIMD_CLONES void xagg_chunk_exponents16(const float *x, const float *r, int64_t n, int32_t vals,
					     int32_t *exps)
{
	int64_t count = (n + vals - 1) / vals;

	for (int64_t c = 0; c < count; c++)
		exps[c] = xagg_exponent16_one(x, r, n, vals, c);
}

/* A chunk sent as zeros: lanes 0, and the residual keeps v (0 if any of v
 * is NaN/Inf). */
static void zero_chunk16(const float *x, const float *r, float *r_out, int64_t len, int32_t vals,
			 uint16_t *q)
{
	memset(q, 0, sizeof(*q) * vals);
	if (!r_out)
		return;
	if (max_abs_fb(x, r, len, 1) >= F32_INF_BITS) {
		memset(r_out, 0, sizeof(*r_out) * len);
		return;
	}
	for (int64_t i = 0; i < len; i++)
		r_out[i] = x[i] + r[i];
}

/* Lanes q[0..len) = rint(v * 2**shift) + bias, and with fb the residual
 * v - rint(..) * 2**-shift; returns max |v| as bits (the fused encode's
 * exponent). Both powers normal float32: the float32 path; else float64,
 * as fixedpoint.quantise and fixedpoint.feedback. */
static inline __attribute__((always_inline))
uint32_t quantise16_span(const float *restrict x, const float *restrict r, float *restrict r_out,
			 int64_t len, int64_t shift, int32_t bias, uint16_t *restrict q, int fb)
{
	int32_t m = 0;

	if (normal_pow2(shift) && normal_pow2(-shift)) {
		float s = pow2_f32(shift), u = pow2_f32(-shift);

		for (int64_t i = 0; i < len; i++) {
			float v = fb_value(x, r, i, fb), y = rint_f32(v * s);
			int32_t b;

			memcpy(&b, &v, sizeof(b));
			b &= F32_ABS_MASK;
			m = b > m ? b : m;
			q[i] = (uint16_t)((uint32_t)(int32_t)y + (uint32_t)bias);
			if (fb)
				r_out[i] = v - y * u;
		}
		return (uint32_t)m;
	}
	for (int64_t i = 0; i < len; i++) {
		float v = fb_value(x, r, i, fb);
		double y = rint(ldexp((double)v, (int)shift));
		int32_t b;

		memcpy(&b, &v, sizeof(b));
		b &= F32_ABS_MASK;
		m = b > m ? b : m;
		q[i] = (uint16_t)((uint32_t)(int32_t)y + (uint32_t)bias);
		if (fb)
			r_out[i] = (float)((double)v - ldexp(y, -(int)shift));
	}
	return (uint32_t)m;
}

static void fill16(uint16_t *q, int64_t from, int32_t vals, int32_t v)
{
	for (int64_t i = from; i < vals; i++)
		q[i] = (uint16_t)v;
}

/* fixedpoint.quantise (bits=16) of chunk c with exponent exp into lanes
 * q[0..vals), the tail of a short chunk bias; a marker sends zeros. */
XAGG_SIMD_CLONES void xagg_quantise16_one(const float *x, const float *r, float *r_out, int64_t n,
					  int32_t vals, int64_t c, int32_t exp, int32_t headroom,
					  int32_t bias, uint16_t *q)
{
	CHUNK_SPAN(n, vals, c, lo, len);
	int64_t shift = (int64_t)headroom - exp;

	if (is_marker(exp)) {
		zero_chunk16(x + lo, r ? r + lo : NULL, r ? r_out + lo : NULL, len, vals, q);
		return;
	}
	if (r)
		quantise16_span(x + lo, r + lo, r_out + lo, len, shift, bias, q, 1);
	else
		quantise16_span(x + lo, NULL, NULL, len, shift, bias, q, 0);
	fill16(q, len, vals, bias);
}

/* xagg_exponent16_one, xagg_send_exponent and xagg_quantise16_one in one
 * read of chunk c (as xagg_encode_one): quantised with pred while the max
 * is taken; if pred does not hold, sent as zeros after all. */
XAGG_SIMD_CLONES int32_t xagg_encode16_one(const float *x, const float *r, float *r_out, int64_t n,
					   int32_t vals, int64_t c, int32_t pred, int32_t headroom,
					   int32_t bias, uint16_t *q, int32_t *own)
{
	CHUNK_SPAN(n, vals, c, lo, len);
	int64_t shift = (int64_t)headroom - pred;
	int32_t send;

	if (is_marker(pred)) {		/* no history: sent as zeros, every worker redoes it */
		*own = xagg_exponent16_one(x, r, n, vals, c);
		send = xagg_send_exponent(*own, pred);
		xagg_quantise16_one(x, r, r_out, n, vals, c, send, headroom, bias, q);
		return send;
	}
	*own = exponent_of(r ? quantise16_span(x + lo, r + lo, r_out + lo, len, shift, bias, q, 1)
			     : quantise16_span(x + lo, NULL, NULL, len, shift, bias, q, 0));
	send = xagg_send_exponent(*own, pred);
	if (send != pred)
		zero_chunk16(x + lo, r ? r + lo : NULL, r ? r_out + lo : NULL, len, vals, q);
	else
		fill16(q, len, vals, bias);
	return send;
}

XAGG_SIMD_CLONES void xagg_quantise16(const float *x, const float *r, float *r_out, int64_t n, int32_t vals,
				      const int32_t *exps, int32_t headroom, int32_t bias, uint8_t *pkts,
				      int64_t pkt_size, const int64_t *row_of_chunk)
{
	int64_t count = (n + vals - 1) / vals;

	for (int64_t c = 0; c < count; c++) {
		if (row_of_chunk[c] < 0)
			continue;
		xagg_quantise16_one(x, r, r_out, n, vals, c, exps[c], headroom, bias,
				    (uint16_t *)(pkts + row_of_chunk[c] * pkt_size + sizeof(struct xagg_hdr)));
	}
}

/* fixedpoint.dequantise (bits=16) of chunk c's lane totals q[0..vals) into
 * out[c * vals ..]: ZERO gives zeros, NONFINITE NaN, without reading q */
void xagg_dequantise16_one(const uint16_t *q, int32_t vals, int64_t c, int32_t exp, int32_t headroom,
			   uint32_t unbias, float *out, int64_t n)
{
	CHUNK_SPAN(n, vals, c, lo, len);
	int64_t shift = (int64_t)exp - headroom;

	if (exp == XAGG_EXP_ZERO) {
		memset(out + lo, 0, sizeof(*out) * len);
	} else if (exp == XAGG_EXP_NONFINITE) {
		for (int64_t i = 0; i < len; i++)
			out[lo + i] = __builtin_nanf("");
	} else if (normal_pow2(shift)) {
		float s = pow2_f32(shift);

		for (int64_t i = 0; i < len; i++)
			out[lo + i] = (float)((int32_t)q[i] - (int32_t)unbias) * s;
	} else {
		for (int64_t i = 0; i < len; i++)
			out[lo + i] = (float)ldexp((double)((int32_t)q[i] - (int32_t)unbias), (int)shift);
	}
}

/* xagg_dequantise with 16-bit lanes: rows of vals / 2 int32 words */
void xagg_dequantise16(const int32_t *rows, const int64_t *row_of_chunk, const int32_t *exps,
		       int32_t headroom, uint32_t unbias, int32_t vals, float *out, int64_t n)
{
	int64_t count = (n + vals - 1) / vals;

	for (int64_t c = 0; c < count; c++) {
		if (row_of_chunk[c] < 0 && !is_marker(exps[c]))
			continue;
		xagg_dequantise16_one(row_of_chunk[c] < 0 ? NULL
				      : (const uint16_t *)(rows + row_of_chunk[c] * (vals / 2)),
				      vals, c, exps[c], headroom, unbias, out, n);
	}
}
