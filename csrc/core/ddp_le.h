/* ddp_le.h - explicit little-endian encoding of integers, byte by byte.
 *
 * Everything pyddp sends between processes that is not the user's data (the
 * collective header, the hello, the shared-memory offer and ack, the
 * identity fields of a shared-memory segment, all_to_all's count tables) is
 * written with these, so the bytes do not depend on the host's byte order or
 * on struct padding: each wire format is a fixed list of offsets, with a
 * _Static_assert on its total size next to its codec. Compilers turn these
 * loops into single loads and stores on little-endian hosts.
 */
#ifndef DDP_LE_H
#define DDP_LE_H

#include <stdint.h>

static inline void ddp_le_put16(unsigned char *p, uint16_t v) {
    p[0] = (unsigned char)v;
    p[1] = (unsigned char)(v >> 8);
}

static inline void ddp_le_put32(unsigned char *p, uint32_t v) {
    for (int i = 0; i < 4; i++) p[i] = (unsigned char)(v >> (8 * i));
}

static inline void ddp_le_put64(unsigned char *p, uint64_t v) {
    for (int i = 0; i < 8; i++) p[i] = (unsigned char)(v >> (8 * i));
}

static inline uint16_t ddp_le_get16(const unsigned char *p) {
    return (uint16_t)(p[0] | (uint16_t)p[1] << 8);
}

static inline uint32_t ddp_le_get32(const unsigned char *p) {
    uint32_t v = 0;
    for (int i = 0; i < 4; i++) v |= (uint32_t)p[i] << (8 * i);
    return v;
}

static inline uint64_t ddp_le_get64(const unsigned char *p) {
    uint64_t v = 0;
    for (int i = 0; i < 8; i++) v |= (uint64_t)p[i] << (8 * i);
    return v;
}

#endif
