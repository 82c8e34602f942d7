/* Peeling of the lossless method's summed table (xagg/compress/lossless.py
 * says what the table is; its ``peel_reference`` is the same result in
 * torch, round by round).
 *
 * Every union member has one cell in each third of the table. A cell that
 * holds exactly one unsolved member gives that member's value (cell sums
 * are modulo 2**32, so the arithmetic is unsigned); the value is taken out
 * of the member's other cells, which may leave them pure in turn. A queue
 * of pure cells does in one pass what rounds of whole-table counts do:
 * the solved set (peeling's stopping core is unique) and every value are
 * the same whatever the order.
 *
 * The table is larger than a core's cache and every visit to a cell is a
 * random one, so a cell's sum, its count and its members are one record:
 * one cache miss a visit, not one an array.
 */
#include <stdint.h>
#include <stdlib.h>

#include "sketch.h"

#define HASHES 3
#define AHEAD 16                /* prefetch distance, in members or queued cells */

struct cell {
    uint32_t sum;
    uint32_t load;              /* unsolved members in the cell */
    uint32_t ids;               /* XOR of their numbers: the member itself once load is 1 */
    uint32_t pad;               /* four cells to a cache line */
};

/* codes: 3 rows of m cell numbers (int32, row h's cell of member u at
 * h * m + u; the top bit ignored); table: ncells sums. val[u], solved[u]
 * for each member. Returns the number solved, or -1 when memory runs out. */
int64_t xagg_peel(const int32_t *table, int64_t ncells, const int32_t *codes, int64_t m, int32_t *val,
                  uint8_t *solved)
{
    struct cell *cell = malloc(ncells * sizeof *cell);
    int32_t *cells_of = malloc(m * HASHES * sizeof *cells_of);     /* a member's three cells together */
    uint32_t *queue = malloc(ncells * sizeof *queue);
    if (!cell || !cells_of || !queue) {
        free(cell);
        free(cells_of);
        free(queue);
        return -1;
    }
    for (int64_t c = 0; c < ncells; c++)
        cell[c] = (struct cell){(uint32_t)table[c], 0, 0, 0};
    for (int64_t u = 0; u < m; u++) {
        solved[u] = 0;
        val[u] = 0;
        for (int h = 0; h < HASHES; h++) {
            if (u + AHEAD < m)      /* the cells are known ahead: fetch them while these are added */
                __builtin_prefetch(&cell[codes[h * m + u + AHEAD] & CELL], 1);
            int32_t c = codes[h * m + u] & CELL;
            cells_of[u * HASHES + h] = c;
            cell[c].load++;
            cell[c].ids ^= (uint32_t)u;
        }
    }
    int64_t head = 0, tail = 0, done = 0;
    for (int64_t c = 0; c < ncells; c++)
        if (cell[c].load == 1)
            queue[tail++] = (uint32_t)c;
    while (head < tail) {
        /* A member's cells are three misses behind two: its pure cell, then
         * its entry in cells_of. Fetch each stage for a later queue entry. */
        if (head + AHEAD < tail)
            __builtin_prefetch(&cell[queue[head + AHEAD]]);
        if (head + AHEAD / 2 < tail) {
            const struct cell *q = &cell[queue[head + AHEAD / 2]];
            if (q->load == 1)
                __builtin_prefetch(&cells_of[(int64_t)q->ids * HASHES]);
        }
        if (head + AHEAD / 4 < tail) {
            const struct cell *q = &cell[queue[head + AHEAD / 4]];
            if (q->load == 1)
                for (int h = 0; h < HASHES; h++)
                    __builtin_prefetch(&cell[cells_of[(int64_t)q->ids * HASHES + h]], 1);
        }
        struct cell *p = &cell[queue[head++]];
        if (p->load != 1)           /* emptied since it was queued */
            continue;
        uint32_t u = p->ids, v = p->sum;
        val[u] = (int32_t)v;
        solved[u] = 1;
        done++;
        for (int h = 0; h < HASHES; h++) {
            struct cell *d = &cell[cells_of[(int64_t)u * HASHES + h]];
            d->sum -= v;
            d->ids ^= u;
            if (--d->load == 1)
                queue[tail++] = (uint32_t)(d - cell);  /* each cell reaches load 1 from above at most once */
        }
    }
    free(cell);
    free(cells_of);
    free(queue);
    return done;
}
