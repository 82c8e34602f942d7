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
 * where the chunk holds one, as torch's amax. */
XAGG_SIMD_CLONES void xagg_int8_bound(const float *r, const float *x, float *acc, int64_t n, int64_t chunk, float *amax)
{
	for (int64_t at = 0, c = 0; at < n; at += chunk, c++) {
		int64_t end = at + chunk < n ? at + chunk : n;
		float m = 0.0f;
		int nan = 0;
		for (int64_t i = at; i < end; i++) {
			float a = r ? r[i] + x[i] : x[i];
			acc[i] = a;
			float v = fabsf(a);
			nan |= v != v;
			m = v > m ? v : m;
		}
		amax[c] = nan ? NAN : m;
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

/* out[i] = (lane i of the summed words) * scale[i / chunk]: each lane sum
 * in [-128, 127] (the scales' head-room keeps it there), so the bias makes
 * every digit unsigned again. A chunk of whole words reads its words four
 * lanes at a time. */
XAGG_SIMD_CLONES void xagg_int8_dequantise(const int32_t *words, int64_t n, int64_t chunk, const float *scale,
					   float *out)
{
	for (int64_t at = 0, c = 0; at < n; at += chunk, c++) {
		int64_t end = at + chunk < n ? at + chunk : n;
		float s = scale[c];
		int64_t i = at;
		if (at % 4 == 0)
			for (; i + 4 <= end; i += 4) {
				uint32_t w = (uint32_t)words[i / 4] + LANE_BIAS;
				for (int j = 0; j < 4; j++)
					out[i + j] = (float)((int32_t)((w >> (8 * j)) & 0xff) - 128) * s;
			}
		for (; i < end; i++) {
			uint32_t w = (uint32_t)words[i / 4] + LANE_BIAS;
			out[i] = (float)((int32_t)((w >> (8 * (i % 4))) & 0xff) - 128) * s;
		}
	}
}
