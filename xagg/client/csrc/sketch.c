/* The sketch method's count-sketch over a bucket (xagg/compress/countsketch.py
 * is the reference, in torch, and says what the table is): no temporaries
 * the size of the bucket, and each cell's additions in the reference's order
 * (row by row, index ascending), so the tables are equal bit for bit. */
#include <stdint.h>

/* table[cells[r][i]] += x[i] * signs[r][i]; cells and signs are rows x n. */
void xagg_sketch_insert(const float *x, int64_t n, const int32_t *cells, const float *signs, int rows, float *table)
{
    for (int r = 0; r < rows; r++) {
        const int32_t *c = cells + (int64_t)r * n;
        const float *s = signs + (int64_t)r * n;
        for (int64_t i = 0; i < n; i++)
            table[c[i]] += x[i] * s[i];
    }
}

/* est[i] = the mean over rows of signs[r][i] * table[cells[r][i]]. */
void xagg_sketch_query_mean(const float *table, int64_t n, const int32_t *cells, const float *signs, int rows,
                            float *est)
{
    for (int64_t i = 0; i < n; i++) {
        float e = table[cells[i]] * signs[i];
        for (int r = 1; r < rows; r++)
            e = e + table[cells[(int64_t)r * n + i]] * signs[(int64_t)r * n + i];
        est[i] = e / (float)rows;
    }
}
