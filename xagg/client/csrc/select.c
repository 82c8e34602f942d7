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
 * The values may also be a count-sketch's estimates, read straight off its
 * table (xagg_sketch_select): the sketch method's heavy hitters without
 * writing every estimate out and reading it back.
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

#include "sketch.h"

#define SAMPLE 16384                    /* positions drawn for the threshold */

static inline uint32_t key_bits(float v)
{
    uint32_t u;
    memcpy(&u, &v, sizeof u);
    return u;
}

/* Where a pass reads its values: residual + gradient (r NULL: the
 * gradient), or a count-sketch's mean estimates where table is set. */
struct source {
    const float *r, *g, *w;      /* w: importance weights (NULL: none), key |v| / (|w| + c) */
    float c;
    const float *table;
    const uint32_t *codes;
    int rows;
    int64_t n;
};

static inline float value_at(const struct source *s, int64_t i)
{
    if (s->table)
        return sketch_mean(s->table, s->codes, s->rows, s->n, i);
    return s->r ? s->r[i] + s->g[i] : s->g[i];
}

static inline uint32_t key_at(const struct source *s, float v, int64_t i)
{
    float m = fabsf(v);
    return key_bits(s->w ? m / (fabsf(s->w[i]) + s->c) : m);
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
static uint32_t sampled_floor(const struct source *src, int64_t k, uint64_t seed, int64_t *cap)
{
    int64_t n = src->n;
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
        s[i] = key_at(src, value_at(src, at), at);
    }
    uint32_t floor = nth_largest(s, SAMPLE, j);
    free(s);
    /* room for the expected candidates and 8 standard deviations more */
    double want = (double)n * (j + 4.0 * sqrt((double)j) + 8.0) / SAMPLE;
    *cap = want >= (double)n ? n : (int64_t)want + 1024;
    return floor;
}

/* What a source's values are, as constants: scan_kind() is compiled once
 * per kind into a straight loop (no per-element test of what the source
 * is, the struct's fields read once). DENSE_HITS: store every element's
 * candidate entry and advance only past those that reach the floor, with
 * no branch to mispredict on them. */
enum { SKETCH = 1, RESIDUAL = 2, WEIGHT = 4, DENSE_HITS = 8 };

static inline __attribute__((always_inline)) int64_t scan_kind(const struct source *src, const int kind, float *acc,
                                                               uint32_t floor, int64_t cap, int32_t *cidx,
                                                               uint32_t *ckey, float *cval)
{
    const float *r = src->r, *g = src->g, *w = src->w, *table = src->table, c = src->c;
    const uint32_t *codes = src->codes;
    const int rows = src->rows;
    const int64_t n = src->n;
    int64_t reach = 0;
    for (int64_t i = 0; i < n; i++) {
        float a = kind & SKETCH ? sketch_mean(table, codes, rows, n, i) : kind & RESIDUAL ? r[i] + g[i] : g[i];
        if (acc)
            acc[i] = a;
        float mag = fabsf(a);
        uint32_t kb = key_bits(kind & WEIGHT ? mag / (fabsf(w[i]) + c) : mag);
        if (kind & DENSE_HITS) {
            int64_t at = reach < cap ? reach : cap;     /* slot cap is spare: what does not fit lands there */
            cidx[at] = (int32_t)i;
            ckey[at] = kb;
            cval[at] = a;
            reach += kb >= floor;
        } else if (kb >= floor) {
            if (reach < cap) {
                cidx[reach] = (int32_t)i;
                ckey[reach] = kb;
                cval[reach] = a;
            }
            reach++;
        }
    }
    return reach;
}

/* The candidates of src (every i whose key reaches floor: index, key and
 * value, the first cap of them, in cidx, ckey, cval of cap + 1 entries),
 * every value written into acc where set. Returns how many reached floor.
 * Where they are expected to be more than one in 32 (the sketch's 5%), the
 * branch on each costs more than storing every element's entry; fewer
 * (top-k's 1%), the stores cost more. */
static int64_t scan(const struct source *src, float *acc, uint32_t floor, int64_t cap, int32_t *cidx, uint32_t *ckey,
                    float *cval)
{
    int dense = cap > src->n / 32;
#define SCAN(kind)                                                                                         \
    (dense ? scan_kind(src, (kind) | DENSE_HITS, acc, floor, cap, cidx, ckey, cval)                         \
           : scan_kind(src, (kind), acc, floor, cap, cidx, ckey, cval))
    if (src->table)
        return SCAN(SKETCH);
    switch ((src->r ? RESIDUAL : 0) | (src->w ? WEIGHT : 0)) {
    case 0:
        return SCAN(0);
    case RESIDUAL:
        return SCAN(RESIDUAL);
    case WEIGHT:
        return SCAN(WEIGHT);
    default:
        return SCAN(RESIDUAL | WEIGHT);
    }
#undef SCAN
}

/* The exact top k of src's keys into idx (ascending) and, where val is
 * set, their values into val; every value is written into acc where set.
 * zero_at, where set, gets 0 at the selected indices (what stays of acc is
 * the new residual). Returns k, or -1 when memory runs out. */
static int64_t top_k(const struct source *src, float *acc, int64_t k, uint64_t seed, float *zero_at, int32_t *idx,
                     float *val)
{
    int64_t n = src->n, cap;
    uint32_t floor = sampled_floor(src, k, seed, &cap);
    /* a candidate's value is kept with it: read again at its index, the
     * selected values cost a cache miss each */
    int32_t *cidx = malloc((cap + 1) * sizeof *cidx);
    uint32_t *ckey = malloc((cap + 1) * sizeof *ckey);
    uint32_t *work = malloc(cap * sizeof *work);
    float *cval = malloc((cap + 1) * sizeof *cval);
    if (!cidx || !ckey || !work || !cval) {
        free(cidx);
        free(ckey);
        free(work);
        free(cval);
        return -1;
    }
    int64_t reach = scan(src, acc, floor, cap, cidx, ckey, cval), m = reach < cap ? reach : cap;
    if (reach < k || reach > cap) {     /* the sample lied: every element is a candidate */
        free(cidx);
        free(ckey);
        free(work);
        free(cval);
        cap = n;
        cidx = malloc(n * sizeof *cidx);
        ckey = malloc(n * sizeof *ckey);
        work = malloc(n * sizeof *work);
        cval = malloc(n * sizeof *cval);
        if (!cidx || !ckey || !work || !cval) {
            free(cidx);
            free(ckey);
            free(work);
            free(cval);
            return -1;
        }
        for (int64_t i = 0; i < n; i++) {
            cidx[i] = (int32_t)i;
            cval[i] = value_at(src, i);
            ckey[i] = key_at(src, cval[i], i);
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
            if (val)
                val[out] = cval[t];
            if (zero_at)
                zero_at[i] = 0.0f;
            out++;
        }
    }
    free(cidx);
    free(ckey);
    free(work);
    free(cval);
    return out;
}

/* acc[i] = r[i] + g[i] (g[i] where r is NULL) for all n, and the exact top k of the keys
 * into idx (ascending) and val (acc at idx); with zero_sent the sent
 * entries are zeroed in acc (what stays is the new residual). k = 0: the
 * update alone. acc may be g itself where r is NULL: then it is not
 * written (each value is g's own) unless to zero. Returns k, or -1 when
 * memory runs out. */
int64_t xagg_select_topk(const float *r, const float *g, const float *w, float c, float *acc, int64_t n,
                         int64_t k, uint64_t seed, int zero_sent, int32_t *idx, float *val)
{
    if (k <= 0) {
        for (int64_t i = 0; i < n; i++)
            acc[i] = r ? r[i] + g[i] : g[i];
        return 0;
    }
    struct source src = {.r = r, .g = g, .w = w, .c = c, .n = n};
    return top_k(&src, !r && acc == g ? NULL : acc, k, seed, zero_sent ? acc : NULL, idx, val);
}

/* The exact top k (1 <= k <= n) of the mean estimates |est_i| of a count-sketch's table
 * (codes: rows x n, as xagg_sketch_query_mean reads them) into idx,
 * ascending: the same indices as selecting on that query's output, without
 * writing it. Returns k, or -1 when memory runs out. */
int64_t xagg_sketch_select(const float *table, int64_t n, const uint32_t *codes, int rows, int64_t k,
                           uint64_t seed, int32_t *idx)
{
    struct source src = {.table = table, .codes = codes, .rows = rows, .n = n};
    return top_k(&src, NULL, k, seed, NULL, idx, NULL);
}

/* The k-th largest key (1 <= k <= the members' total) of keys[c] counted
 * start[c + 1] - start[c] times into *kth: a radix select, the top 16 bits'
 * weighted histogram, then the low 16 bits' among the cells in the bin k
 * lands in. *above: how many members have a larger key. -1 when memory
 * runs out. */
static int kth_weighted(const uint32_t *keys, const int64_t *start, int64_t width, int64_t k, uint32_t *kth,
                        int64_t *above)
{
    int64_t *hist = calloc(1 << 16, sizeof *hist);
    if (!hist)
        return -1;
    for (int64_t c = 0; c < width; c++)
        hist[keys[c] >> 16] += start[c + 1] - start[c];
    int64_t got = 0;
    uint32_t hi = 0xFFFF;
    while (got + hist[hi] < k)
        got += hist[hi--];
    memset(hist, 0, (1 << 16) * sizeof *hist);
    for (int64_t c = 0; c < width; c++)
        if (keys[c] >> 16 == hi)
            hist[keys[c] & 0xFFFF] += start[c + 1] - start[c];
    uint32_t lo = 0xFFFF;
    while (got + hist[lo] < k)
        got += hist[lo--];
    free(hist);
    *above = got;
    *kth = hi << 16 | lo;
    return 0;
}

/* The exact top k (1 <= k <= n) of a one-row count-sketch's estimates
 * |est_i| = |table[cell of i]| into idx, ascending: the same indices as
 * xagg_sketch_select with rows 1, without reading n random cells. Every
 * member of a cell has the cell's key, so the k-th key is found over the
 * width cells, each weighted by its members (xagg_sketch_members), and
 * only the k selected members are touched: a bitmap of them, read in index
 * order, gives them ascending and the ties at the k-th key to the lowest
 * indices. Returns k, or -1 when memory runs out. */
int64_t xagg_sketch_select_cells(const float *table, int64_t width, int64_t n, const int64_t *start,
                                 const int32_t *members, int64_t k, int32_t *idx)
{
    int64_t words = (n + 63) / 64, above = 0;
    uint32_t *keys = malloc(width * sizeof *keys), kth = 0;
    uint64_t *sel = calloc(words, sizeof *sel), *tie = calloc(words, sizeof *tie);
    if (keys)
        for (int64_t c = 0; c < width; c++)
            keys[c] = key_bits(fabsf(table[c]));
    if (!keys || !sel || !tie || kth_weighted(keys, start, width, k, &kth, &above) < 0) {
        free(keys);
        free(sel);
        free(tie);
        return -1;
    }
    for (int64_t c = 0; c < width; c++) {
        uint64_t *bits = keys[c] > kth ? sel : keys[c] == kth ? tie : NULL;
        if (bits)
            for (int64_t m = start[c]; m < start[c + 1]; m++)
                bits[members[m] >> 6] |= 1ULL << (members[m] & 63);
    }
    int64_t ties = k - above, out = 0;
    for (int64_t w = 0; w < words; w++) {
        uint64_t b = sel[w], t = tie[w];
        for (; t && ties > 0; ties--) {     /* the lowest tied indices first */
            b |= t & -t;
            t &= t - 1;
        }
        for (; b; b &= b - 1)
            idx[out++] = (int32_t)(w * 64 + __builtin_ctzll(b));
    }
    free(keys);
    free(sel);
    free(tie);
    return out;
}
