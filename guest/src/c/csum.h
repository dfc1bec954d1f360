/* The agent checksum (docs/guest.md): wrapping sum of little-endian u64
 * words, the last partial word zero-padded, folded to 32 bits as
 * low ^ high. Cheap per byte in a slow guest, yet every byte counts. It can
 * be fed in chunks whose lengths are multiples of 8 (except the last). */
#ifndef CSUM_H
#define CSUM_H
#include <stdint.h>

struct csum { uint64_t sum; };

static inline void csum_add(struct csum *c, const uint8_t *p, uint64_t len) {
  uint64_t i = 0;
  for (; i + 8 <= len; i += 8) c->sum += *(const uint64_t *)(p + i);
  uint64_t tail = 0;
  for (unsigned s = 0; i < len; i++, s += 8) tail |= (uint64_t)p[i] << s;
  c->sum += tail;
}

static inline uint32_t csum_fold(const struct csum *c) {
  return (uint32_t)c->sum ^ (uint32_t)(c->sum >> 32);
}

#endif
