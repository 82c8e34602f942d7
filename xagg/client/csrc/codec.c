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
 * Element types (codec.h XAGG_ELEM_*): a tensor read or written may hold
 * float32, float16 or bfloat16 elements. 16-bit ones are widened to float32
 * as they are read (exactly: every bf16 and fp16 value is a float32 one),
 * so their exponents and quantised values are the float32 path's for the
 * same values, and no float32 copy of the tensor is ever made. A result
 * written to a 16-bit tensor is the float32 result (divided first by the
 * caller's divisor, the average a bucket needs: an fp16 sum may overflow
 * where the average does not) rounded to nearest even, as torch's .to()
 * rounds; NaN/Inf stay NaN/Inf, a finite value past the type's range
 * becomes Inf of its sign. Each exported function switches on the type
 * once and runs a loop built for it (the always-inline bodies below).
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
#include "elem.h"
#include "simd.h"

/* The one-chunk loops are also built for AVX2 (simd.h). The encode gains
 * from it (scripts/bench_codec.py measures it), and so does the decode into
 * fp16 (its rounding is many integer steps, which SSE2 lacks some of).
 * The loops' helpers are always inlined, so each clone has its own copy. */

#define F32_ABS_MASK	0x7fffffff
#define F32_INF_BITS	0x7f800000	/* |x| bits at or above: Inf or NaN */
#define F32_MANT_BITS	23
#define F32_BIAS	127
#define F32_MIN_EXP	(-126)		/* 2**e is a normal float32 for e in */
#define F32_MAX_EXP	127		/* F32_MIN_EXP..F32_MAX_EXP */
#define TWO_23		0x1p23f		/* from here on every float32 is an integer */

_Static_assert(sizeof(struct xagg_hdr) % sizeof(int32_t) == 0,
	       "payloads must stay int32-aligned behind the header");

/* |v| as bits: non-negative floats order like their bits, and NaN's bits
 * lie above Inf's, so an integer maximum (which vectorises, and needs no
 * NaN rules) finds the largest magnitude and any non-finite. */
static INLINE int32_t abs_bits(float v)
{
	return (int32_t)(f32_to_bits(v) & F32_ABS_MASK);
}

/* The frexp() exponent of a positive finite float32 given as its bits:
 * x = m * 2**e with m in [0.5, 1), so x < 2**e. */
static int32_t frexp_exponent(uint32_t bits)
{
	if (bits >> F32_MANT_BITS)
		return (int32_t)(bits >> F32_MANT_BITS) - (F32_BIAS - 1);
	/* subnormal: bits * 2**-149, its top set bit decides */
	return (32 - __builtin_clz(bits)) - (F32_BIAS - 1 + F32_MANT_BITS);
}

static int32_t exponent_of(uint32_t m)
{
	if (m == 0)
		return XAGG_EXP_ZERO;
	if (m >= F32_INF_BITS)
		return XAGG_EXP_NONFINITE;
	return frexp_exponent(m);
}

/* max |x| of n elements, as float32 bits. 16-bit magnitudes order like
 * their bits too (NaN above Inf): the max is taken on them, and only it
 * widened. */
static INLINE uint32_t max_abs_bits(const void *restrict x, int64_t n, int elem)
{
	int32_t m = 0;

	if (elem != XAGG_ELEM_F32) {
		uint16_t h = 0;

		for (int64_t i = 0; i < n; i++) {
			uint16_t b = ((const uint16_t *)x)[i] & 0x7fff;

			h = b > h ? b : h;
		}
		return (uint32_t)abs_bits(load(&h, 0, elem));
	}
	for (int64_t i = 0; i < n; i++) {
		int32_t b = abs_bits(load(x, i, elem));

		m = b > m ? b : m;
	}
	return (uint32_t)m;
}

/* the chunk's extent: [lo, lo + len) of x[0..n) */
#define CHUNK_SPAN(n, vals, c, lo, len) \
	int64_t lo = (c) * (vals), len = (n) - lo < (vals) ? (n) - lo : (vals)

XAGG_SIMD_CLONES int32_t xagg_exponent_one(const void *x, int32_t elem, int64_t n, int32_t vals, int64_t c)
{
	CHUNK_SPAN(n, vals, c, lo, len);
#define EXPONENT(E) return exponent_of(max_abs_bits(at(x, lo, E), len, E))
	BY_ELEM(elem, EXPONENT)
#undef EXPONENT
}

/* fixedpoint.chunk_exponents() of the chunks of x[0..n) */
void xagg_chunk_exponents(const void *x, int32_t elem, int64_t n, int32_t vals, int32_t *exps)
{
	int64_t c, count = (n + vals - 1) / vals;

	for (c = 0; c < count; c++)
		exps[c] = xagg_exponent_one(x, elem, n, vals, c);
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
	return f32_from_bits((uint32_t)(e + F32_BIAS) << F32_MANT_BITS);
}

static int normal_pow2(int64_t e)
{
	return e >= F32_MIN_EXP && e <= F32_MAX_EXP;
}

/* Round half to even, as rintf() in the default rounding mode. Adding 2**23
 * to |y| < 2**23 leaves no fraction bits, so the addition itself rounds
 * (to even, and the parity of |y|'s rounding is that of the sum's); larger
 * |y|, and NaN/Inf, pass through unchanged. */
static INLINE float rint_f32(float y)
{
	float a = fabsf(y);
	float r = copysignf((a + TWO_23) - TWO_23, y);

	return a < TWO_23 ? r : y;
}

/* An integral y as int32, plus bias modulo 2**32: a prediction that fails
 * leaves values out of range, overwritten later, so no signed overflow. */
static INLINE int32_t biased(float y, int32_t bias)
{
	return (int32_t)((uint32_t)(int32_t)y + (uint32_t)bias);
}

/* One chunk: q = rint(x * 2**shift) + bias; returns max |x| as bits (the
 * fused encode's exponent). Where 2**shift is not a normal float32 (values
 * below ~2**-99) fixedpoint.quantise() goes through float64; so here. */
static INLINE uint32_t quantise_span(const void *restrict x, int64_t len, int64_t shift, int32_t bias,
				     int32_t *restrict q, int elem)
{
	int32_t m = 0;

	if (normal_pow2(shift)) {
		float s = pow2_f32(shift);

		for (int64_t i = 0; i < len; i++) {
			float v = load(x, i, elem);
			int32_t b = abs_bits(v);

			m = b > m ? b : m;
			q[i] = biased(rint_f32(v * s), bias);
		}
	} else {
		for (int64_t i = 0; i < len; i++) {
			float v = load(x, i, elem);
			int32_t b = abs_bits(v);

			m = b > m ? b : m;
			q[i] = (int32_t)((uint32_t)(int32_t)rint(ldexp((double)v, (int)shift)) + (uint32_t)bias);
		}
	}
	return (uint32_t)m;
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

/* fixedpoint.quantise() of chunk c of x[0..n) with exponent exp into
 * q[0..vals) (the payload of its packet), plus bias (0: unbiased); a marker
 * exponent (ZERO, NONFINITE) sends zeros, the tail of a short last chunk
 * bias. headroom: fixedpoint.headroom_bits(N), passed in so its formula
 * lives in one place. */
XAGG_SIMD_CLONES void xagg_quantise_one(const void *x, int32_t elem, int64_t n, int32_t vals, int64_t c,
					int32_t exp, int32_t headroom, int32_t bias, int32_t *q)
{
	CHUNK_SPAN(n, vals, c, lo, len);

	if (is_marker(exp)) {
		fill(q, 0, vals, 0);
		return;
	}
#define QUANTISE(E) quantise_span(at(x, lo, E), len, (int64_t)headroom - exp, bias, q, E); break
	BY_ELEM(elem, QUANTISE)
#undef QUANTISE
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
XAGG_SIMD_CLONES int32_t xagg_encode_one(const void *x, int32_t elem, int64_t n, int32_t vals, int64_t c,
					 int32_t pred, int32_t headroom, int32_t bias, int32_t *q, int32_t *own)
{
	CHUNK_SPAN(n, vals, c, lo, len);
	int64_t shift = (int64_t)headroom - pred;
	int32_t send;

	if (is_marker(pred) || !normal_pow2(shift)) {	/* no fused pass: rare */
		*own = xagg_exponent_one(x, elem, n, vals, c);
		send = xagg_send_exponent(*own, pred);
		xagg_quantise_one(x, elem, n, vals, c, send, headroom, bias, q);
		return send;
	}
#define ENCODE(E) *own = exponent_of(quantise_span(at(x, lo, E), len, shift, bias, q, E)); break
	BY_ELEM(elem, ENCODE)
#undef ENCODE
	send = xagg_send_exponent(*own, pred);
	if (send != pred)
		fill(q, 0, vals, 0);	/* sent as zeros: every worker redoes it */
	else
		fill(q, len, vals, bias);
	return send;
}

/* xagg_quantise_one of every chunk c, written into the payload of packet
 * row_of_chunk[c] (rows pkt_size bytes apart, a struct xagg_hdr ahead of
 * each payload); a chunk whose row is negative is not written. */
void xagg_quantise(const void *x, int32_t elem, int64_t n, int32_t vals, const int32_t *exps,
		   int32_t headroom, int32_t bias, uint8_t *pkts, int64_t pkt_size,
		   const int64_t *row_of_chunk)
{
	int64_t c, count = (n + vals - 1) / vals;

	for (c = 0; c < count; c++) {
		if (row_of_chunk[c] < 0)
			continue;
		xagg_quantise_one(x, elem, n, vals, c, exps[c], headroom, bias,
				  (int32_t *)(pkts + row_of_chunk[c] * pkt_size + sizeof(struct xagg_hdr)));
	}
}

/* out[0..len) = a marker's result: 0 for ZERO, NaN for NONFINITE */
static INLINE void marker_span(void *restrict out, int64_t len, int32_t exp, int elem)
{
	float v = exp == XAGG_EXP_ZERO ? 0.0f : __builtin_nanf("");

	for (int64_t i = 0; i < len; i++)
		store(out, i, v, elem);
}

/* a marker chunk's result over out[lo..lo+len), in out's element type */
static INLINE void marker_chunk(void *out, int64_t lo, int64_t len, int32_t exp, int elem)
{
#define MARKER(E) marker_span((void *)at(out, lo, E), len, exp, E); return
	BY_ELEM(elem, MARKER)
#undef MARKER
}

/* out[i] = float32(sum_i) * 2**shift / divide, rounded to out's type, for
 * sum_i = q[i] - unbias (modulo 2**32, as the sum was) read by SUM (the
 * 32- or 16-bit lanes); through float64 where 2**shift is not a normal
 * float32 (as fixedpoint.dequantise()). divide 1: none (exact, skipped). */
#define DEQUANTISE_SPAN(SUM)								\
	do {										\
		if (normal_pow2(shift)) {						\
			float s = pow2_f32(shift);					\
			if (divide == 1.0f)						\
				for (int64_t i = 0; i < len; i++)			\
					store(out, i, (float)(SUM) * s, elem);		\
			else								\
				for (int64_t i = 0; i < len; i++)			\
					store(out, i, (float)(SUM) * s / divide, elem);	\
		} else {								\
			for (int64_t i = 0; i < len; i++)				\
				store(out, i, (float)ldexp((double)(SUM), (int)shift) / divide, elem); \
		}									\
	} while (0)

static INLINE void dequantise_span(const int32_t *restrict q, int64_t len, int64_t shift, uint32_t unbias,
				   float divide, void *restrict out, int elem)
{
	DEQUANTISE_SPAN((int32_t)((uint32_t)q[i] - unbias));
}

/* fixedpoint.dequantise() of chunk c's sums q[0..vals) into out[c * vals ..]
 * (nothing past out[n - 1]), divided by divide and rounded to out's type: a
 * ZERO exponent gives zeros, NONFINITE NaN, without reading q. */
XAGG_SIMD_CLONES void xagg_dequantise_one(const int32_t *q, int32_t vals, int64_t c, int32_t exp,
					  int32_t headroom, uint32_t unbias, float divide,
					  void *out, int32_t elem, int64_t n)
{
	CHUNK_SPAN(n, vals, c, lo, len);
	int64_t shift = (int64_t)exp - headroom;

	if (is_marker(exp)) {
		marker_chunk(out, lo, len, exp, elem);
		return;
	}
#define DEQUANTISE(E) dequantise_span(q, len, shift, unbias, divide, (void *)at(out, lo, E), E); return
	BY_ELEM(elem, DEQUANTISE)
#undef DEQUANTISE
}

/* xagg_dequantise_one of every chunk c from row row_of_chunk[c] of rows
 * (vals int32 each). A ZERO or NONFINITE chunk is written whatever its row
 * (it is not read: an exact call has no row for them); any other chunk
 * whose row is negative is left alone, its sum being in another set of
 * rows (a second round). */
void xagg_dequantise(const int32_t *rows, const int64_t *row_of_chunk, const int32_t *exps,
		     int32_t headroom, uint32_t unbias, int32_t vals, float divide,
		     void *out, int32_t elem, int64_t n)
{
	int64_t c, count = (n + vals - 1) / vals;

	for (c = 0; c < count; c++) {
		if (row_of_chunk[c] < 0 && !is_marker(exps[c]))
			continue;	/* its sum is in another round's rows */
		xagg_dequantise_one(row_of_chunk[c] < 0 ? NULL : rows + row_of_chunk[c] * vals,
				    vals, c, exps[c], headroom, unbias, divide, out, elem, n);
	}
}

/* ---- 16-bit lanes (fixedpoint.py, bits=16) -----------------------------
 *
 * The same exponents, rounding and bias with S = 14 - ceil(log2 N), each
 * value a uint16 lane, two to an int32 word of the payload (value 2i in the
 * low half of word i: x86-64 is little-endian, as the wire). `vals` here
 * counts values per chunk: twice the packet's int32 words.
 *
 * Error feedback: with r (the caller's residual, float32 whatever x's type)
 * the chunk quantised is v = x + r, and r_out gets what the lanes leave of
 * it, v - q * 2**(E - S) (fixedpoint.feedback), in the same pass: a chunk
 * sent as zeros keeps all of v (0 if it holds NaN/Inf). r and r_out are
 * both given or both NULL; r_out must not alias r (a redone chunk is
 * quantised again from x + r). */

/* v = x + r, or x */
static INLINE float fb_value(const void *restrict x, const float *restrict r, int64_t i, int fb, int elem)
{
	return fb ? load(x, i, elem) + r[i] : load(x, i, elem);
}

static INLINE uint32_t max_abs_fb(const void *restrict x, const float *restrict r, int64_t n, int fb, int elem)
{
	int32_t m = 0;

	for (int64_t i = 0; i < n; i++) {
		int32_t b = abs_bits(fb_value(x, r, i, fb, elem));

		m = b > m ? b : m;
	}
	return (uint32_t)m;
}

XAGG_SIMD_CLONES int32_t xagg_exponent16_one(const void *x, int32_t elem, const float *r, int64_t n,
					     int32_t vals, int64_t c)
{
	CHUNK_SPAN(n, vals, c, lo, len);
#define EXPONENT16(E) return exponent_of(r ? max_abs_fb(at(x, lo, E), r + lo, len, 1, E)	\
					   : max_abs_fb(at(x, lo, E), NULL, len, 0, E))
	BY_ELEM(elem, EXPONENT16)
#undef EXPONENT16
}

void xagg_chunk_exponents16(const void *x, int32_t elem, const float *r, int64_t n, int32_t vals,
			    int32_t *exps)
{
	int64_t count = (n + vals - 1) / vals;

	for (int64_t c = 0; c < count; c++)
		exps[c] = xagg_exponent16_one(x, elem, r, n, vals, c);
}

/* A chunk sent as zeros: lanes 0, and the residual keeps v (0 if any of v
 * is NaN/Inf). */
static INLINE void zero_chunk16(const void *x, const float *r, float *r_out, int64_t len, int32_t vals,
				uint16_t *q, int elem)
{
	memset(q, 0, sizeof(*q) * vals);
	if (!r_out)
		return;
	if (max_abs_fb(x, r, len, 1, elem) >= F32_INF_BITS) {
		memset(r_out, 0, sizeof(*r_out) * len);
		return;
	}
	for (int64_t i = 0; i < len; i++)
		r_out[i] = load(x, i, elem) + r[i];
}

/* Lanes q[0..len) = rint(v * 2**shift) + bias, and with fb the residual
 * v - rint(..) * 2**-shift; returns max |v| as bits (the fused encode's
 * exponent). Both powers normal float32: the float32 path; else float64,
 * as fixedpoint.quantise and fixedpoint.feedback. */
static INLINE uint32_t quantise16_span(const void *restrict x, const float *restrict r, float *restrict r_out,
				       int64_t len, int64_t shift, int32_t bias, uint16_t *restrict q, int fb,
				       int elem)
{
	int32_t m = 0;

	if (normal_pow2(shift) && normal_pow2(-shift)) {
		float s = pow2_f32(shift), u = pow2_f32(-shift);

		for (int64_t i = 0; i < len; i++) {
			float v = fb_value(x, r, i, fb, elem), y = rint_f32(v * s);
			int32_t b = abs_bits(v);

			m = b > m ? b : m;
			q[i] = (uint16_t)((uint32_t)(int32_t)y + (uint32_t)bias);
			if (fb)
				r_out[i] = v - y * u;
		}
		return (uint32_t)m;
	}
	for (int64_t i = 0; i < len; i++) {
		float v = fb_value(x, r, i, fb, elem);
		double y = rint(ldexp((double)v, (int)shift));
		int32_t b = abs_bits(v);

		m = b > m ? b : m;
		q[i] = (uint16_t)((uint32_t)(int32_t)y + (uint32_t)bias);
		if (fb)
			r_out[i] = (float)((double)v - ldexp(y, -(int)shift));
	}
	return (uint32_t)m;
}

/* quantise16_span with and without feedback, for the type E */
#define QUANTISE16(E)										\
	m = r ? quantise16_span(at(x, lo, E), r + lo, r_out + lo, len, shift, bias, q, 1, E)	\
	      : quantise16_span(at(x, lo, E), NULL, NULL, len, shift, bias, q, 0, E);		\
	break
#define ZERO16(E) zero_chunk16(at(x, lo, E), r ? r + lo : NULL, r ? r_out + lo : NULL, len, vals, q, E); break

static void fill16(uint16_t *q, int64_t from, int32_t vals, int32_t v)
{
	for (int64_t i = from; i < vals; i++)
		q[i] = (uint16_t)v;
}

/* fixedpoint.quantise (bits=16) of chunk c with exponent exp into lanes
 * q[0..vals), the tail of a short chunk bias; a marker sends zeros. */
XAGG_SIMD_CLONES void xagg_quantise16_one(const void *x, int32_t elem, const float *r, float *r_out, int64_t n,
					  int32_t vals, int64_t c, int32_t exp, int32_t headroom,
					  int32_t bias, uint16_t *q)
{
	CHUNK_SPAN(n, vals, c, lo, len);
	int64_t shift = (int64_t)headroom - exp;
	uint32_t m;

	if (is_marker(exp)) {
		BY_ELEM(elem, ZERO16)
		return;
	}
	BY_ELEM(elem, QUANTISE16)
	(void)m;
	fill16(q, len, vals, bias);
}

/* xagg_exponent16_one, xagg_send_exponent and xagg_quantise16_one in one
 * read of chunk c (as xagg_encode_one): quantised with pred while the max
 * is taken; if pred does not hold, sent as zeros after all. */
XAGG_SIMD_CLONES int32_t xagg_encode16_one(const void *x, int32_t elem, const float *r, float *r_out, int64_t n,
					   int32_t vals, int64_t c, int32_t pred, int32_t headroom,
					   int32_t bias, uint16_t *q, int32_t *own)
{
	CHUNK_SPAN(n, vals, c, lo, len);
	int64_t shift = (int64_t)headroom - pred;
	int32_t send;
	uint32_t m;

	if (is_marker(pred)) {		/* no history: sent as zeros, every worker redoes it */
		*own = xagg_exponent16_one(x, elem, r, n, vals, c);
		send = xagg_send_exponent(*own, pred);
		xagg_quantise16_one(x, elem, r, r_out, n, vals, c, send, headroom, bias, q);
		return send;
	}
	BY_ELEM(elem, QUANTISE16)
	*own = exponent_of(m);
	send = xagg_send_exponent(*own, pred);
	if (send != pred) {
		BY_ELEM(elem, ZERO16)
	} else {
		fill16(q, len, vals, bias);
	}
	return send;
}
#undef QUANTISE16
#undef ZERO16

void xagg_quantise16(const void *x, int32_t elem, const float *r, float *r_out, int64_t n, int32_t vals,
		     const int32_t *exps, int32_t headroom, int32_t bias, uint8_t *pkts,
		     int64_t pkt_size, const int64_t *row_of_chunk)
{
	int64_t count = (n + vals - 1) / vals;

	for (int64_t c = 0; c < count; c++) {
		if (row_of_chunk[c] < 0)
			continue;
		xagg_quantise16_one(x, elem, r, r_out, n, vals, c, exps[c], headroom, bias,
				    (uint16_t *)(pkts + row_of_chunk[c] * pkt_size + sizeof(struct xagg_hdr)));
	}
}

static INLINE void dequantise16_span(const uint16_t *restrict q, int64_t len, int64_t shift, uint32_t unbias,
				     float divide, void *restrict out, int elem)
{
	DEQUANTISE_SPAN((int32_t)q[i] - (int32_t)unbias);
}

/* fixedpoint.dequantise (bits=16) of chunk c's lane totals q[0..vals) into
 * out[c * vals ..], divided and rounded as xagg_dequantise_one */
XAGG_SIMD_CLONES void xagg_dequantise16_one(const uint16_t *q, int32_t vals, int64_t c, int32_t exp,
					    int32_t headroom, uint32_t unbias, float divide,
					    void *out, int32_t elem, int64_t n)
{
	CHUNK_SPAN(n, vals, c, lo, len);
	int64_t shift = (int64_t)exp - headroom;

	if (is_marker(exp)) {
		marker_chunk(out, lo, len, exp, elem);
		return;
	}
#define DEQUANTISE16(E) dequantise16_span(q, len, shift, unbias, divide, (void *)at(out, lo, E), E); return
	BY_ELEM(elem, DEQUANTISE16)
#undef DEQUANTISE16
}

/* xagg_dequantise with 16-bit lanes: rows of vals / 2 int32 words */
void xagg_dequantise16(const int32_t *rows, const int64_t *row_of_chunk, const int32_t *exps,
		       int32_t headroom, uint32_t unbias, int32_t vals, float divide,
		       void *out, int32_t elem, int64_t n)
{
	int64_t count = (n + vals - 1) / vals;

	for (int64_t c = 0; c < count; c++) {
		if (row_of_chunk[c] < 0 && !is_marker(exps[c]))
			continue;
		xagg_dequantise16_one(row_of_chunk[c] < 0 ? NULL
				      : (const uint16_t *)(rows + row_of_chunk[c] * (vals / 2)),
				      vals, c, exps[c], headroom, unbias, divide, out, elem, n);
	}
}
