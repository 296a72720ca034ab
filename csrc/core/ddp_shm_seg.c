/* ddp_shm_seg.c - shared-memory segments for the shared-memory link:
 * creating one under a unique name with its memory reserved up front,
 * mapping a peer's by name with its header checked, and removing names
 * (contract in ddp_link_shm.h; layout in ddp_link_shm_int.h).
 */
#include "ddp_link_shm_int.h"
#include "ddp_settings.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

/* Read by the peer through process_vm_readv to learn whether it may copy
 * straight out of this process's memory. */
static const volatile uint64_t cma_probe = SHM_PROBE;

/* Record this process as side `side` (pid and probe address, for CMA). */
static void seg_register(ddp_shm_seg *s, int side) {
    ddp_le_put64(s->hdr->pid[side], (uint64_t)(int64_t)getpid());
    ddp_le_put64(s->hdr->probe[side], (uint64_t)(uintptr_t)&cma_probe);
}

/* The setting is bounded to [RING_MIN, RING_MAX] by its declaration; the
 * ring indexes with a mask, so round up to a power of two. */
size_t ddp_shm_ring_bytes(void) {
    const uint64_t x = (uint64_t)ddp_setting_int("PYDDP_SHM_RING_BYTES");
    size_t r = RING_MIN;
    while (r < x && r < RING_MAX) r <<= 1;
    return r;
}

static size_t seg_len(size_t ring_bytes) { return DATA_OFFSET + 2 * ring_bytes; }

/* Unique per process and call: pid, a counter and clock bits. */
static void make_name(char out[DDP_SHM_NAME_MAX]) {
    static atomic_uint counter;
    unsigned n = atomic_fetch_add(&counter, 1u);
    snprintf(out, DDP_SHM_NAME_MAX, "/pyddp-%ld-%u-%llx", (long)getpid(), n,
             (unsigned long long)ddp_now_us());
}

ddp_status ddp_shm_seg_create(size_t ring_bytes, char name_out[DDP_SHM_NAME_MAX],
                              ddp_shm_seg **out) {
    *out = NULL;
    if (ring_bytes < RING_MIN || (ring_bytes & (ring_bytes - 1)) != 0)
        return ddp_error(DDP_ERR_INVALID, "shared-memory ring size %zu is not a power of two "
                         ">= %u", ring_bytes, RING_MIN);
    int fd = -1;
    for (int tries = 0; fd < 0 && tries < 8; tries++) {
        make_name(name_out);
        fd = shm_open(name_out, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
        if (fd < 0 && errno != EEXIST) break;
    }
    if (fd < 0)
        return ddp_error(DDP_ERR_SYS, "shm_open(%s) failed: %s; check that /dev/shm is "
                         "mounted and writable, or set PYDDP_SHM_DISABLE=1", name_out,
                         strerror(errno));
    size_t len = seg_len(ring_bytes);
    ddp_status st = DDP_OK;
    int err = 0;
    /* Reserve the pages now: a full tmpfs must fail here, not SIGBUS later. */
    if (ftruncate(fd, (off_t)len) != 0) err = errno;
    else err = posix_fallocate(fd, 0, (off_t)len);
    void *p = MAP_FAILED;
    if (err == 0) {
        p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (p == MAP_FAILED) err = errno;
    }
    close(fd);
    if (err != 0) {
        shm_unlink(name_out);
        st = ddp_error(err == ENOSPC ? DDP_ERR_NOMEM : DDP_ERR_SYS,
                       "could not allocate a %zu-byte shared-memory segment in /dev/shm: %s; "
                       "enlarge /dev/shm (docker --shm-size), lower PYDDP_SHM_RING_BYTES, or "
                       "set PYDDP_SHM_DISABLE=1", len, strerror(err));
        return st;
    }
    ddp_shm_seg *s = malloc(sizeof *s);
    if (s == NULL) {
        munmap(p, len);
        shm_unlink(name_out);
        return ddp_error(DDP_ERR_NOMEM, "out of memory");
    }
    s->hdr = p;
    s->map_len = len;
    s->ring_bytes = ring_bytes;
    /* Fresh tmpfs pages are zero: counters and flags start at 0. */
    ddp_le_put64(s->hdr->ring_bytes, ring_bytes);
    ddp_le_put64(s->hdr->total_bytes, len);
    seg_register(s, 0);
    ddp_le_put32(s->hdr->version, SHM_VERSION);
    atomic_thread_fence(memory_order_release);
    ddp_le_put32(s->hdr->magic, SHM_MAGIC);
    *out = s;
    return DDP_OK;
}

ddp_status ddp_shm_seg_open(const char *name, ddp_shm_seg **out) {
    *out = NULL;
    int fd = shm_open(name, O_RDWR | O_CLOEXEC, 0);
    if (fd < 0)
        return ddp_error(DDP_ERR_SYS, "shm_open(%s) of the peer's segment failed: %s "
                         "(does the peer see the same /dev/shm?)", name, strerror(errno));
    struct stat sb;
    if (fstat(fd, &sb) != 0 || (size_t)sb.st_size < DATA_OFFSET) {
        close(fd);
        return ddp_error(DDP_ERR_PROTOCOL, "shared-memory segment %s is too small", name);
    }
    size_t len = (size_t)sb.st_size;
    void *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    int err = errno;
    close(fd);
    if (p == MAP_FAILED)
        return ddp_error(DDP_ERR_SYS, "mmap of shared-memory segment %s failed: %s", name,
                         strerror(err));
    shm_hdr *h = p;
    const uint32_t magic = ddp_le_get32(h->magic), version = ddp_le_get32(h->version);
    const uint64_t ring = ddp_le_get64(h->ring_bytes), total = ddp_le_get64(h->total_bytes);
    if (magic != SHM_MAGIC || version != SHM_VERSION || total != len || ring < RING_MIN ||
        ring > RING_MAX || (ring & (ring - 1)) != 0 || seg_len((size_t)ring) != len) {
        munmap(p, len);
        return ddp_error(DDP_ERR_PROTOCOL, "shared-memory segment %s has a bad header "
                         "(magic %#x, version %u)", name, (unsigned)magic, (unsigned)version);
    }
    ddp_shm_seg *s = malloc(sizeof *s);
    if (s == NULL) {
        munmap(p, len);
        return ddp_error(DDP_ERR_NOMEM, "out of memory");
    }
    s->hdr = h;
    s->map_len = len;
    s->ring_bytes = (len - DATA_OFFSET) / 2; /* == ring, checked above via seg_len */
    seg_register(s, 1);
    *out = s;
    return DDP_OK;
}

void ddp_shm_unlink(const char *name) {
    if (name && name[0]) shm_unlink(name);
}

void ddp_shm_seg_close(ddp_shm_seg *s) {
    if (s == NULL) return;
    munmap(s->hdr, s->map_len);
    free(s);
}
