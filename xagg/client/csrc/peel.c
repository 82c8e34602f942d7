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
 */
#include <stdint.h>
#include <stdlib.h>

#define HASHES 3

/* cells_of: m x 3 cell numbers (int32, row-major); table: ncells sums.
 * val[u], solved[u] for each member. Returns the number solved, or -1
 * when memory runs out. */
int64_t xagg_peel(const int32_t *table, int64_t ncells, const int32_t *cells_of, int64_t m, int32_t *val,
                  uint8_t *solved)
{
    uint32_t *t = malloc(ncells * sizeof *t);
    int32_t *load = calloc(ncells, sizeof *load);
    int64_t *ids = calloc(ncells, sizeof *ids);         /* sum of the unsolved members' numbers */
    int64_t *queue = malloc(ncells * sizeof *queue);
    if (!t || !load || !ids || !queue) {
        free(t);
        free(load);
        free(ids);
        free(queue);
        return -1;
    }
    for (int64_t c = 0; c < ncells; c++)
        t[c] = (uint32_t)table[c];
    for (int64_t u = 0; u < m; u++) {
        solved[u] = 0;
        val[u] = 0;
        for (int h = 0; h < HASHES; h++) {
            int32_t c = cells_of[u * HASHES + h];
            load[c]++;
            ids[c] += u;
        }
    }
    int64_t head = 0, tail = 0, done = 0;
    for (int64_t c = 0; c < ncells; c++)
        if (load[c] == 1)
            queue[tail++] = c;
    while (head < tail) {
        int64_t c = queue[head++];
        if (load[c] != 1)           /* emptied since it was queued */
            continue;
        int64_t u = ids[c];
        uint32_t v = t[c];
        val[u] = (int32_t)v;
        solved[u] = 1;
        done++;
        for (int h = 0; h < HASHES; h++) {
            int32_t d = cells_of[u * HASHES + h];
            t[d] -= v;
            ids[d] -= u;
            if (--load[d] == 1)
                queue[tail++] = d;  /* each cell reaches load 1 from above at most once */
        }
    }
    free(t);
    free(load);
    free(ids);
    free(queue);
    return done;
}
