/* SPDX-License-Identifier: MIT */
/* The codec's one-chunk steps (codec.c), for the round loop (exchange.c),
 * which quantises a chunk as its packet first goes out and dequantises a
 * result as it arrives, while the data is still in cache. */
#ifndef XAGG_CLIENT_CODEC_H
#define XAGG_CLIENT_CODEC_H

#include <stdint.h>

/* The element type of a tensor the codec reads (x) or writes (out): each
 * pointer comes with one (fixedpoint.ELEMS). 16-bit elements are read as
 * the float32 they equal, and written rounded to nearest even. */
#define XAGG_ELEM_F32	0
#define XAGG_ELEM_F16	1
#define XAGG_ELEM_BF16	2

/* fixedpoint.chunk_exponents() of chunk c of x[0..n) (vals elements each) */
int32_t xagg_exponent_one(const void *x, int32_t elem, int64_t n, int32_t vals, int64_t c);

/* fixedpoint.send_exponents() of one chunk */
int32_t xagg_send_exponent(int32_t own, int32_t pred);

/* chunk c of x[0..n) (vals elements, the last maybe short) with exponent
 * exp into q[0..vals), plus bias (0: unbiased), the tail too; a marker
 * exponent's chunk is zeros */
void xagg_quantise_one(const void *x, int32_t elem, int64_t n, int32_t vals, int64_t c,
		       int32_t exp, int32_t headroom, int32_t bias, int32_t *q);

/* the three above in one read of chunk c: quantised with pred while its
 * max is taken, zeroed if pred does not hold; returns the send exponent,
 * the chunk's own in *own */
int32_t xagg_encode_one(const void *x, int32_t elem, int64_t n, int32_t vals, int64_t c,
			int32_t pred, int32_t headroom, int32_t bias, int32_t *q, int32_t *own);

/* sums q[] (less unbias) of chunk c, divided by divide (1: the sum), into
 * out[c * vals ..] (nothing past out[n - 1]): a ZERO exponent gives zeros,
 * NONFINITE NaN, without reading q */
void xagg_dequantise_one(const int32_t *q, int32_t vals, int64_t c, int32_t exp, int32_t headroom,
			 uint32_t unbias, float divide, void *out, int32_t elem, int64_t n);

/* 16-bit lanes (codec.c): vals values per chunk (twice the packet's int32
 * words), two uint16 lanes to a word; r (residual in) and r_out (out),
 * float32 both or neither, carry the error feedback */
int32_t xagg_encode16_one(const void *x, int32_t elem, const float *r, float *r_out, int64_t n, int32_t vals,
			  int64_t c, int32_t pred, int32_t headroom, int32_t bias, uint16_t *q, int32_t *own);
void xagg_dequantise16_one(const uint16_t *q, int32_t vals, int64_t c, int32_t exp, int32_t headroom,
			   uint32_t unbias, float divide, void *out, int32_t elem, int64_t n);

#endif
