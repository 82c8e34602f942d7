/* OR over ranks carried as an int32 sum (xagg/compress/collectives.py,
 * Collectives._or, is the reference): index i is lane i % lanes of word
 * i / lanes, each lane `width` bits, wide enough to count every rank's one,
 * so the aggregator's sum never carries from one lane into the next. One
 * pass each way; in torch the same packing went through int64 temporaries
 * eight times the bitmap, page-faulted anew every step. */
#include <stdint.h>

/* words[w] = the lanes of bits[w * lanes ..] (0 or 1 each), n bits in all. */
void xagg_or_pack(const uint8_t *bits, int64_t n, int width, int32_t *words)
{
    int lanes = 32 / width;
    for (int64_t at = 0, w = 0; at < n; at += lanes, w++) {
        int m = n - at < lanes ? (int)(n - at) : lanes;
        uint32_t v = 0;
        for (int j = 0; j < m; j++)
            v |= (uint32_t)(bits[at + j] != 0) << (j * width);
        words[w] = (int32_t)v;
    }
}

/* bits[i] = 1 where lane i of the summed words counted any rank's one. */
void xagg_or_unpack(const int32_t *words, int64_t n, int width, uint8_t *bits)
{
    int lanes = 32 / width;
    uint32_t mask = (1u << width) - 1;
    for (int64_t at = 0, w = 0; at < n; at += lanes, w++) {
        int m = n - at < lanes ? (int)(n - at) : lanes;
        uint32_t v = (uint32_t)words[w];
        for (int j = 0; j < m; j++)
            bits[at + j] = ((v >> (j * width)) & mask) != 0;
    }
}
