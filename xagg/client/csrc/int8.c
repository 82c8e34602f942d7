/* The int8 method's passes over a bucket (xagg/compress/intsum.py holds the
 * torch reference of each, bit for bit: accumulate_amax, quantise_packed,
 * unpack_scaled), one pass each where torch takes a temporary the bucket's
 * size per step of the expression: residual + gradient with each chunk's
 * max |value|; the values quantised with their chunk's agreed scale, the
 * rounding left in the residual and the integers packed four to an int32
 * word; the summed words read back as lanes times their chunk's scale.
 * Builds with -ffp-contract=off: acc - q * scale rounds twice, as torch's
 * does. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "simd.h"

#define LANE_BIAS 0x80808080u	/* 128 in each byte: an unsigned digit is a signed lane + 128 */

/* acc = r + x (x where r is NULL; acc may be x then) and amax[c] = the max
 * |acc| over chunk c of ``chunk`` elements (the last may be short), NaN
 * where the chunk holds one, as torch's amax. The max is taken over the
 * bit patterns of |acc|: a non-negative float orders as its bits do, every
 * NaN above inf, and an integer max vectorises where a float one (whose
 * order of NaN compares the compiler must keep) would not. */
static inline uint32_t abs_bits(float a)
{
	uint32_t b;
	memcpy(&b, &a, sizeof b);
	return b & 0x7fffffffu;
}

XAGG_SIMD_CLONES void xagg_int8_bound(const float *r, const float *x, float *acc, int64_t n, int64_t chunk, float *amax)
{
	for (int64_t at = 0, c = 0; at < n; at += chunk, c++) {
		int64_t end = at + chunk < n ? at + chunk : n;
		uint32_t m = 0;
		if (r)
			for (int64_t i = at; i < end; i++) {
				float a = r[i] + x[i];
				uint32_t b = abs_bits(a);
				acc[i] = a;
				m = b > m ? b : m;
			}
		else
			for (int64_t i = at; i < end; i++) {
				uint32_t b = abs_bits(x[i]);
				acc[i] = x[i];
				m = b > m ? b : m;
			}
		float top;
		memcpy(&top, &m, sizeof top);
		amax[c] = m > 0x7f800000u ? NAN : top;
	}
}

/* round(v) to the nearest integer, ties to even, with v's sign (-0 for
 * v in (-0.5, 0]), as nearbyintf in the default rounding mode, for
 * |v| < 2**22; beyond, a value as far from 0 (the callers clamp it to at
 * most 127). No libm call: SSE2 has no rounding instruction, so
 * nearbyintf would not vectorise. */
static inline float round_even(float v)
{
	const float magic = 12582912.0f;	/* 1.5 * 2**23: the sum's ulp is 1 */
	return copysignf(v >= 0.0f ? (v + magic) - magic : (v - magic) + magic, v);
}

/* q = round(acc / scale[c]) to even, clamped to [-L, L]; acc -= q * scale[c]
 * (what is not sent stays); the q packed as signed base-256 digits of int32
 * words, four a word, the last word's spare lanes 0. */
XAGG_SIMD_CLONES void xagg_int8_quantise(float *acc, int64_t n, int64_t chunk, const float *scale, float L,
					 int32_t *words)
{
	uint8_t *digit = (uint8_t *)words;
	for (int64_t at = 0, c = 0; at < n; at += chunk, c++) {
		int64_t end = at + chunk < n ? at + chunk : n;
		float s = scale[c];
		for (int64_t i = at; i < end; i++) {
			float q = round_even(acc[i] / s);
			q = q < -L ? -L : (q > L ? L : q);
			acc[i] = acc[i] - q * s;
			digit[i] = (uint8_t)((int32_t)q + 128);
		}
	}
	int64_t nw = (n + 3) / 4;
	for (int64_t i = n; i < 4 * nw; i++)
		digit[i] = 128;
	for (int64_t w = 0; w < nw; w++)
		words[w] = (int32_t)((uint32_t)words[w] - LANE_BIAS);
}

#define DEQUANTISE_BLOCK 1024	/* lanes read back at a time, through a biased copy of their words */

/* out[i] = (lane from + i of the summed words) * scale[(from + i) / chunk]
 * / divide, for i < count: each lane sum in [-128, 127] (the scales'
 * head-room keeps it there), so adding the bias to a word makes every
 * digit unsigned again. The words of a block are biased into a copy first
 * and its bytes then read as the digits: two loops that vectorise, where
 * one word's four lanes at a time did not. ``from`` lets a caller write a
 * run of the lanes straight where it belongs in a larger result. */
XAGG_SIMD_CLONES void xagg_int8_dequantise(const int32_t *words, int64_t from, int64_t count, int64_t chunk,
					   const float *scale, float divide, float *out)
{
	uint32_t biased[DEQUANTISE_BLOCK / 4 + 1];
	for (int64_t i = 0; i < count;) {
		int64_t at = from + i, c = at / chunk;
		int64_t end = (c + 1) * chunk - from;	/* this chunk's end, or the block's, or count */
		end = end < count ? end : count;
		end = end < i + DEQUANTISE_BLOCK ? end : i + DEQUANTISE_BLOCK;
		int64_t w0 = at / 4, w1 = (from + end + 3) / 4;
		for (int64_t w = w0; w < w1; w++)
			biased[w - w0] = (uint32_t)words[w] + LANE_BIAS;
		const uint8_t *digit = (const uint8_t *)biased + (at - 4 * w0);
		float s = scale[c];
		for (int64_t j = 0; j < end - i; j++)
			out[i + j] = (float)((int32_t)digit[j] - 128) * s / divide;
		i = end;
	}
}
