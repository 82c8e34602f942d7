/* The hashes every rank agrees on (xagg/compress/rng.py: ``mix_hash`` and
 * ``cells_at_reference`` are the reference, in torch, bit for bit), and the
 * sketch method's count-sketch over a bucket (xagg/compress/countsketch.py
 * is the reference and says what the table is).
 *
 * A hash is coded as one 32-bit word: the cell (below 2**31) and, in the top
 * bit, a negative sign. The count-sketch reads a bucket's codes from a map
 * built once per bucket layout: hashing inline costs several times the
 * memory read of the map on every pass, and there are two passes a step. The
 * sketch's additions go in the reference's order (row by row, index
 * ascending), so the tables are equal bit for bit. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "sketch.h"

#define GOLD 0x9E3779B97F4A7C15ULL
#define M1 0xBF58476D1CE4E5B9ULL
#define M2 0x94D049BB133111EBULL

/* SplitMix64's finaliser of i * GOLD + key, shifted down to 62 bits. */
static inline uint64_t mix(uint64_t i, uint64_t key)
{
    uint64_t z = i * GOLD + key;
    z = (z ^ (z >> 30)) * M1;
    z = (z ^ (z >> 27)) * M2;
    return (z ^ (z >> 31)) >> 2;
}

/* The code of hash h onto `width` cells from cell `base`: the cell scales
 * bits 30..61 onto the width by a multiply (no division); the sign is bit 0,
 * which the cell does not depend on, negative in the top bit. */
static inline uint32_t code_of(uint64_t h, uint64_t width, uint64_t base)
{
    return (uint32_t)((((h >> 30) * width) >> 32) + base) | (h & 1 ? 0 : ~CELL);
}

/* codes[r][j] (rows x m) of the indices idx[j] (NULL: j itself), row r
 * hashed with keys[r] onto [0, width) (code_of), offset by r * width so the
 * rows index one flat table. The caller keeps rows * width below 2**31. */
void xagg_hash_codes(const int64_t *idx, int64_t m, const uint64_t *keys, int rows, int64_t width, uint32_t *codes)
{
    for (int r = 0; r < rows; r++)
        for (int64_t j = 0; j < m; j++) {
            uint64_t h = mix(idx ? (uint64_t)idx[j] : (uint64_t)j, keys[r]);
            codes[(int64_t)r * m + j] = code_of(h, (uint64_t)width, (uint64_t)r * (uint64_t)width);
        }
}

/* codes[r][i] (rows x n) of every i < n in a blocked map (rng.blocked is
 * the reference): i's block b = i / run, hashed as xagg_hash_codes hashes
 * it onto a row of wb = width / blocks cells, moved to b * wb in row r's
 * width. One pass, no n-sized int64 temporaries (built at a job's first
 * steps, which wait for it). */
void xagg_hash_codes_blocked(int64_t n, const uint64_t *keys, int rows, int64_t width, int64_t blocks,
                             uint32_t *codes)
{
    int64_t run = (n + blocks - 1) / blocks, wb = width / blocks;
    for (int r = 0; r < rows; r++)
        for (int64_t i = 0; i < n; i++) {
            uint64_t h = mix((uint64_t)i, keys[r]);
            codes[(int64_t)r * n + i] = code_of(h, (uint64_t)wb,
                                                (uint64_t)(i / run) * (uint64_t)wb + (uint64_t)r * (uint64_t)width);
        }
}

/* table[cell] += sign * x[i] for every row's code of every i < n. */
void xagg_sketch_insert(const float *x, int64_t n, const uint32_t *codes, int rows, float *table)
{
    for (int r = 0; r < rows; r++) {
        const uint32_t *c = codes + (int64_t)r * n;
        for (int64_t i = 0; i < n; i++)
            table[c[i] & CELL] += signed_by(c[i], x[i]);
    }
}

/* acc[i] = r[i] + g[i] (r NULL: g[i]) for every i < n, written out and
 * inserted into table in the same pass as xagg_sketch_insert would (row 0
 * in this pass, the others after it, each in index order: the same bits);
 * returns max |acc| (NaN where any acc is NaN). One read of the gradient
 * and the residual instead of three: the accumulation, the insertion and
 * the bound were each a pass over the bucket. acc may be g itself. */
float xagg_sketch_accumulate(const float *r, const float *g, float *acc, int64_t n, const uint32_t *codes,
                             int rows, float *table)
{
    float m = 0.0f;
    int nan = 0;
    for (int64_t i = 0; i < n; i++) {
        float a = r ? r[i] + g[i] : g[i];
        float u = fabsf(a);
        acc[i] = a;
        nan |= a != a;
        m = u > m ? u : m;
        table[codes[i] & CELL] += signed_by(codes[i], a);
    }
    xagg_sketch_insert(acc, n, codes + n, rows - 1, table);     /* the other rows, from the written acc */
    return nan ? NAN : m;
}

/* est[i] = sketch_mean of i, for every i < n. */
void xagg_sketch_query_mean(const float *table, int64_t n, const uint32_t *codes, int rows, float *est)
{
    for (int64_t i = 0; i < n; i++)
        est[i] = sketch_mean(table, codes, rows, n, i);
}

/* The members of every cell of a one-row sketch (codes: n codes of a table
 * of width cells): start[c] .. start[c + 1] index the i whose cell is c in
 * members, ascending (a counting sort in index order). Built once per
 * bucket layout, as the codes are. */
void xagg_sketch_members(const uint32_t *codes, int64_t n, int64_t width, int64_t *start, int32_t *members)
{
    memset(start, 0, (width + 1) * sizeof *start);
    for (int64_t i = 0; i < n; i++)
        start[(codes[i] & CELL) + 1]++;
    for (int64_t c = 0; c < width; c++)
        start[c + 1] += start[c];
    for (int64_t i = 0; i < n; i++)     /* start[c] walks to start[c + 1] and is set back below */
        members[start[codes[i] & CELL]++] = (int32_t)i;
    for (int64_t c = width; c > 0; c--)
        start[c] = start[c - 1];
    start[0] = 0;
}
