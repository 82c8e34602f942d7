/* Hot loops built twice, for AVX2 and for the baseline, the one to run
 * picked when the library loads (an ifunc): the library is cached under
 * ~/.cache and may be shared by ranks on other CPUs, so no -march. The
 * results are the same bits: every op is an exact IEEE one at any vector
 * width, and -ffp-contract=off keeps FMA out. */
#ifndef XAGG_SIMD_H
#define XAGG_SIMD_H

#if defined(__x86_64__) && defined(__has_attribute)
#if __has_attribute(target_clones)
#define XAGG_SIMD_CLONES __attribute__((target_clones("avx2", "default")))
#endif
#endif
#ifndef XAGG_SIMD_CLONES
#define XAGG_SIMD_CLONES
#endif

#endif
