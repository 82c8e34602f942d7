/* What a compressor sends at chosen indices, quantised, taken out of its
 * residual in the same pass (xagg/compress/intsum.py: ``send_from`` is the
 * reference in torch, bit for bit): for each j, v = acc[idx[j]],
 * q[j] = round(v / scale[j]) to even, clamped to [-L, L], and acc[idx[j]]
 * = v - q[j] * scale[j], the rounding and what the clamp cut off. One
 * gather and one scatter at the indices, where torch's indexing takes a
 * gather, four passes over the values and a scatter. Builds with
 * -ffp-contract=off: v - q * scale rounds twice, as torch's does. */
#include <math.h>
#include <stdint.h>

void xagg_send_from(float *acc, const int64_t *idx, int64_t k, const float *scale, float L, float *q)
{
    for (int64_t j = 0; j < k; j++) {
        float v = acc[idx[j]];
        float r = nearbyintf(v / scale[j]);     /* the default rounding mode: to nearest, ties to even */
        r = r < -L ? -L : (r > L ? L : r);
        q[j] = r;
        acc[idx[j]] = v - r * scale[j];
    }
}
