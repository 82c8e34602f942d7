/* A count-sketch's codes and estimate, shared by sketch.c (insertion, the
 * query) and select.c (heavy hitters selected straight off the table).
 * A code is one 32-bit word: the cell (below 2**31) and, in the top bit, a
 * negative sign (sketch.c says how they are hashed). */
#ifndef XAGG_SKETCH_H
#define XAGG_SKETCH_H

#include <stdint.h>
#include <string.h>

#define CELL 0x7FFFFFFFu

/* v negated where the code says so, by flipping its sign bit: a branch on
 * a hash's sign is mispredicted half the time, which made the insertion
 * and the query four times slower. The same bits as -v. */
static inline float signed_by(uint32_t code, float v)
{
    uint32_t bits;
    memcpy(&bits, &v, sizeof bits);
    bits ^= code & ~CELL;
    memcpy(&v, &bits, sizeof v);
    return v;
}

/* The estimate of x_i: the mean over rows of sign * table[cell] of i's
 * codes (codes is rows x n), summed in row order. */
static inline float sketch_mean(const float *table, const uint32_t *codes, int rows, int64_t n, int64_t i)
{
    float e = signed_by(codes[i], table[codes[i] & CELL]);
    for (int r = 1; r < rows; r++) {
        uint32_t c = codes[(int64_t)r * n + i];
        e = e + signed_by(c, table[c & CELL]);
    }
    return rows == 1 ? e : e / (float)rows;     /* e / 1 is e, bit for bit */
}

#endif
