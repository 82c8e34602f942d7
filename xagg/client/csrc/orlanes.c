/* Bitmaps of indices (a bit each, bit i of byte j is index 8j + i, as
 * numpy's packbits with bitorder="little") and their OR over ranks carried
 * as an int32 sum (xagg/compress/collectives.py, Collectives._or, is the
 * reference): index i is lane i % lanes of word i / lanes, each lane `width`
 * bits, wide enough to count every rank's one, so the aggregator's sum
 * never carries from one lane into the next. One pass each way; a bitmap
 * of a bool an index was eight times the bytes to clear, pack and scan. */
#include <stdint.h>

static inline int bit_at(const uint8_t *bits, int64_t i)
{
    return (bits[i >> 3] >> (i & 7)) & 1;
}

/* Sets the bits of the m indices idx (each below the bitmap's 8 * bytes). */
void xagg_bits_set(const int64_t *idx, int64_t m, uint8_t *bits)
{
    for (int64_t u = 0; u < m; u++)
        bits[idx[u] >> 3] |= (uint8_t)(1u << (idx[u] & 7));
}

/* The number of set bits among the first `bytes` bytes. */
int64_t xagg_bits_count(const uint8_t *bits, int64_t bytes)
{
    int64_t n = 0, at = 0;
    for (; at + 8 <= bytes; at += 8) {
        uint64_t w;
        __builtin_memcpy(&w, bits + at, 8);
        n += __builtin_popcountll(w);
    }
    for (; at < bytes; at++)
        n += __builtin_popcount(bits[at]);
    return n;
}

/* The set bits' indices, ascending, into out (xagg_bits_count of them). */
void xagg_bits_members(const uint8_t *bits, int64_t bytes, int64_t *out)
{
    int64_t k = 0, at = 0;
    for (; at + 8 <= bytes; at += 8) {
        uint64_t w;
        __builtin_memcpy(&w, bits + at, 8);     /* little-endian: bit b of the word is index 8 * at + b */
        while (w) {
            out[k++] = at * 8 + __builtin_ctzll(w);
            w &= w - 1;
        }
    }
    for (; at < bytes; at++)
        for (uint32_t w = bits[at]; w; w &= w - 1)
            out[k++] = at * 8 + __builtin_ctz(w);
}

/* words[w] = the lanes of bits w * lanes .. (0 or 1 each), n bits in all. */
void xagg_or_pack(const uint8_t *bits, int64_t n, int width, int32_t *words)
{
    int lanes = 32 / width;
    for (int64_t at = 0, w = 0; at < n; at += lanes, w++) {
        int m = n - at < lanes ? (int)(n - at) : lanes;
        uint32_t v = 0;
        for (int j = 0; j < m; j++)
            v |= (uint32_t)bit_at(bits, at + j) << (j * width);
        words[w] = (int32_t)v;
    }
}

/* The bits (n of them; the bitmap cleared by the caller) set where a lane
 * of the summed words counted any rank's one. */
void xagg_or_unpack(const int32_t *words, int64_t n, int width, uint8_t *bits)
{
    int lanes = 32 / width;
    uint32_t mask = (1u << width) - 1;
    for (int64_t at = 0, w = 0; at < n; at += lanes, w++) {
        int m = n - at < lanes ? (int)(n - at) : lanes;
        uint32_t v = (uint32_t)words[w];
        for (int j = 0; j < m; j++)
            if ((v >> (j * width)) & mask)
                bits[(at + j) >> 3] |= (uint8_t)(1u << ((at + j) & 7));
    }
}
