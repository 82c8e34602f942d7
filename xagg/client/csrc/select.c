/* Top-k selection for the compressors, fused with the residual update:
 * one pass over the bucket (xagg/compress/select.py is the reference and
 * says what the result is).
 *
 * acc = residual + gradient is written out while every element whose key
 * (|acc|, or |acc| / (|w| + c) for importance weighting) reaches a
 * threshold is kept as a candidate. The threshold comes from MSTopK's
 * sampling: the keys of a seeded random sample of positions put it a few
 * standard deviations of sampling noise below the k-th largest key, so
 * the candidates are k and a little more. The k-th largest key among the
 * candidates is then found exactly (quickselect on a copy), so the result
 * is the exact top k whatever the sample said: a sample that lied only
 * costs a second pass (too few candidates: everything is a candidate).
 *
 * Keys compare as the bits of non-negative floats (monotonic as uint32).
 * Ties at the k-th key go to the lowest indices; indices come out in
 * ascending order, so every rank that selects on the same keys gets the
 * same list.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define SAMPLE 16384                    /* positions drawn for the threshold */

static inline uint32_t key_bits(float v)
{
    uint32_t u;
    memcpy(&u, &v, sizeof u);
    return u;
}

static inline float key_of(float a, const float *w, float c, int64_t i)
{
    float m = fabsf(a);
    return w ? m / (fabsf(w[i]) + c) : m;
}

static inline uint64_t splitmix(uint64_t *s)
{
    uint64_t z = (*s += 0x9E3779B97F4A7C15ULL);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

/* The j-th largest (0-based) of a[0..m), reordering a. Hoare partition
 * splits runs of equal keys evenly, so many equal keys stay linear. */
static uint32_t nth_largest(uint32_t *a, int64_t m, int64_t j)
{
    int64_t lo = 0, hi = m - 1;
    while (lo < hi) {
        uint32_t x = a[lo], y = a[(lo + hi) / 2], z = a[hi];
        uint32_t p = x < y ? (y < z ? y : (x < z ? z : x)) : (x < z ? x : (y < z ? z : y));
        int64_t i = lo, k = hi;
        while (i <= k) {
            while (a[i] > p) i++;
            while (a[k] < p) k--;
            if (i <= k) {
                uint32_t t = a[i];
                a[i] = a[k];
                a[k] = t;
                i++;
                k--;
            }
        }
        if (j <= k) hi = k;
        else if (j >= i) lo = i;
        else return a[j];
    }
    return a[j];
}

/* Below this the key of the sample's j-th largest, j set so that k keys or
 * more reach it with overwhelming probability; 0 where sampling saves
 * nothing (small n, or k a large share of n). */
static uint32_t sampled_floor(const float *r, const float *g, const float *w, float c, int64_t n, int64_t k,
                              uint64_t seed, int64_t *cap)
{
    double exp_hits = (double)k * SAMPLE / (double)n;
    int64_t j = (int64_t)(exp_hits + 4.0 * sqrt(exp_hits) + 4.0);
    if (n < 8 * SAMPLE || j >= SAMPLE / 2) {
        *cap = n;
        return 0;
    }
    uint32_t *s = malloc(SAMPLE * sizeof *s);
    if (!s) {
        *cap = n;
        return 0;
    }
    uint64_t st = seed;
    for (int i = 0; i < SAMPLE; i++) {
        int64_t at = (int64_t)(splitmix(&st) % (uint64_t)n);
        float a = r ? r[at] + g[at] : g[at];
        s[i] = key_bits(key_of(a, w, c, at));
    }
    uint32_t floor = nth_largest(s, SAMPLE, j);
    free(s);
    /* room for the expected candidates and 8 standard deviations more */
    double want = (double)n * (j + 4.0 * sqrt((double)j) + 8.0) / SAMPLE;
    *cap = want >= (double)n ? n : (int64_t)want + 1024;
    return floor;
}

/* acc[i] = r[i] + g[i] (g[i] where r is NULL) for all n, and the exact top k of the keys
 * into idx (ascending) and val (acc at idx); with zero_sent the sent
 * entries are zeroed in acc (what stays is the new residual). k = 0: the
 * update alone. Returns k, or -1 when memory runs out. */
int64_t xagg_select_topk(const float *r, const float *g, const float *w, float c, float *acc, int64_t n,
                         int64_t k, uint64_t seed, int zero_sent, int32_t *idx, float *val)
{
    if (k <= 0) {
        for (int64_t i = 0; i < n; i++)
            acc[i] = r ? r[i] + g[i] : g[i];
        return 0;
    }
    int64_t cap;
    uint32_t floor = sampled_floor(r, g, w, c, n, k, seed, &cap);
    int32_t *cidx = malloc(cap * sizeof *cidx);
    uint32_t *ckey = malloc(cap * sizeof *ckey);
    uint32_t *work = malloc(cap * sizeof *work);
    if (!cidx || !ckey || !work) {
        free(cidx);
        free(ckey);
        free(work);
        return -1;
    }
    int64_t m = 0, reach = 0;
    for (int64_t i = 0; i < n; i++) {
        float a = r ? r[i] + g[i] : g[i];
        acc[i] = a;
        uint32_t kb = key_bits(key_of(a, w, c, i));
        if (kb >= floor) {
            if (m < cap) {
                cidx[m] = (int32_t)i;
                ckey[m] = kb;
                m++;
            }
            reach++;
        }
    }
    if (reach < k || reach > cap) {     /* the sample lied: every element is a candidate */
        free(cidx);
        free(ckey);
        free(work);
        cap = n;
        cidx = malloc(n * sizeof *cidx);
        ckey = malloc(n * sizeof *ckey);
        work = malloc(n * sizeof *work);
        if (!cidx || !ckey || !work) {
            free(cidx);
            free(ckey);
            free(work);
            return -1;
        }
        for (int64_t i = 0; i < n; i++) {
            cidx[i] = (int32_t)i;
            ckey[i] = key_bits(key_of(acc[i], w, c, i));
        }
        m = n;
    }
    memcpy(work, ckey, m * sizeof *work);
    uint32_t kth = nth_largest(work, m, k - 1);
    int64_t above = 0;
    for (int64_t t = 0; t < m; t++)
        above += ckey[t] > kth;
    int64_t ties = k - above, out = 0;
    for (int64_t t = 0; t < m && out < k; t++) {
        if (ckey[t] > kth || (ckey[t] == kth && ties-- > 0)) {
            int32_t i = cidx[t];
            idx[out] = i;
            val[out] = acc[i];
            if (zero_sent)
                acc[i] = 0.0f;
            out++;
        }
    }
    free(cidx);
    free(ckey);
    free(work);
    return out;
}
