/* SPDX-License-Identifier: MIT */
/* A struct's layout for its ctypes twin to check (xagg/client/native.py):
 * each C file lists sizeof and the offset of every field in a table, and
 * exports it through this copy. */
#ifndef XAGG_LAYOUT_H
#define XAGG_LAYOUT_H
#include <stdint.h>

/* Copies up to n entries of the table into out; returns how many it has. */
static inline int64_t xagg_copy_layout(const int64_t *table, int64_t have, int64_t *out, int64_t n)
{
	for (int64_t i = 0; i < n && i < have; i++)
		out[i] = table[i];
	return have;
}

#endif /* XAGG_LAYOUT_H */
