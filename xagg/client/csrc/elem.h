/* SPDX-License-Identifier: MIT */
/* The element types of the tensors the client's C code reads and writes
 * (codec.h XAGG_ELEM_*), and their exact float32 conversions: 16-bit
 * values are widened as they are read (every bf16 and fp16 value is a
 * float32 one) and results rounded to nearest even as they are written,
 * as torch's .to() rounds. Shared by the codec (codec.c) and the host sum
 * (host_sum.c), so a 16-bit bucket is never copied to float32 whole.
 * Every helper is always inlined: each loop built for one element type
 * (BY_ELEM) gets its own copy, and vectorises. */
#ifndef XAGG_CLIENT_ELEM_H
#define XAGG_CLIENT_ELEM_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "codec.h"

#define INLINE inline __attribute__((always_inline))

#define BF16_NAN	0x7fc0		/* torch's NaN when it rounds float32 to bf16 */

static INLINE uint32_t f32_to_bits(float f)
{
	uint32_t b;

	memcpy(&b, &f, sizeof(b));
	return b;
}

static INLINE float f32_from_bits(uint32_t b)
{
	float f;

	memcpy(&f, &b, sizeof(f));
	return f;
}

/* IEEE half to float32, exactly, in integer and normal-float32 steps only
 * (vectorises; no subnormal float32 on the way, so a flush-to-zero mode
 * cannot change it): the FP16 library's fp16_ieee_to_fp32_value, which
 * torch uses. */
static INLINE float f16_to_f32(uint16_t h)
{
	uint32_t w = (uint32_t)h << 16, sign = w & 0x80000000u, two_w = w + w;
	uint32_t normal = f32_to_bits(f32_from_bits((two_w >> 4) + (0xE0u << 23)) * 0x1p-112f);
	uint32_t subnormal = f32_to_bits(f32_from_bits((two_w >> 17) | (126u << 23)) - 0.5f);
	uint32_t is_sub = -(uint32_t)(two_w < (1u << 27));	/* masks, not branches: the loops vectorise */

	return f32_from_bits(sign | (subnormal & is_sub) | (normal & ~is_sub));
}

/* float32 to IEEE half, round to nearest even, overflow to Inf, NaN to
 * NaN: the FP16 library's fp16_ieee_from_fp32_value (torch's scalar path;
 * F16C's vcvtps2ph, its vector path, rounds alike). */
static INLINE uint16_t f32_to_f16(float f)
{
	float base = (fabsf(f) * 0x1p112f) * 0x1p-110f;
	uint32_t w = f32_to_bits(f), shl1_w = w + w, sign = w & 0x80000000u;
	uint32_t bias = shl1_w & 0xFF000000u, bits, small, nan;

	small = -(uint32_t)(bias < 0x71000000u);
	bias = (bias & ~small) | (0x71000000u & small);
	base = f32_from_bits((bias >> 1) + 0x07800000u) + base;
	bits = f32_to_bits(base);
	nan = -(uint32_t)(shl1_w > 0xFF000000u);
	return (uint16_t)((sign >> 16) | (0x7E00u & nan) |
			  ((((bits >> 13) & 0x00007C00u) + (bits & 0x00000FFFu)) & ~nan));
}

/* float32 to bfloat16, round to nearest even (past the range: Inf), as
 * torch's round_to_nearest_even */
static INLINE uint16_t f32_to_bf16(float f)
{
	uint32_t u = f32_to_bits(f);

	return f != f ? BF16_NAN : (uint16_t)((u + ((u >> 16) & 1) + 0x7FFFu) >> 16);
}

/* element i of a tensor of elem's type, as float32 (exact) */
static INLINE float load(const void *restrict x, int64_t i, int elem)
{
	if (elem == XAGG_ELEM_BF16)
		return f32_from_bits((uint32_t)((const uint16_t *)x)[i] << 16);
	if (elem == XAGG_ELEM_F16)
		return f16_to_f32(((const uint16_t *)x)[i]);
	return ((const float *)x)[i];
}

/* element i of a tensor of elem's type = v, rounded to it */
static INLINE void store(void *restrict out, int64_t i, float v, int elem)
{
	if (elem == XAGG_ELEM_BF16)
		((uint16_t *)out)[i] = f32_to_bf16(v);
	else if (elem == XAGG_ELEM_F16)
		((uint16_t *)out)[i] = f32_to_f16(v);
	else
		((float *)out)[i] = v;
}

/* element lo of a tensor of elem's type, as a pointer */
static INLINE const void *at(const void *x, int64_t lo, int elem)
{
	return (const char *)x + lo * (elem == XAGG_ELEM_F32 ? 4 : 2);
}

/* Calls BODY(type) with type a constant, so each type gets its own loop. */
#define BY_ELEM(elem, BODY)				\
	switch (elem) {					\
	case XAGG_ELEM_BF16: BODY(XAGG_ELEM_BF16);	\
	case XAGG_ELEM_F16: BODY(XAGG_ELEM_F16);	\
	default: BODY(XAGG_ELEM_F32);			\
	}

#endif
