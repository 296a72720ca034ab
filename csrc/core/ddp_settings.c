/* ddp_settings.c - the declarations of every PYDDP_* environment setting and
 * the parse-once accessors the core reads them through (contract and policy
 * in ddp_settings.h).
 *
 * The doc strings are docs/env.md's lines, word for word: the page is
 * written from this table and tests/c/test_settings.c compares the two, so
 * a setting added here without its line there (or the other way round)
 * fails the tests.
 */
#include "ddp_settings.h"

#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#define KIB ((int64_t)1 << 10)
#define MIB ((int64_t)1 << 20)
#define GIB ((int64_t)1 << 30)
#define CORE DDP_SETTING_CORE
#define NOMAX INT64_MAX
#define ALL NULL   /* scope: every backend */

static const ddp_setting_decl table[] = {
    {"PYDDP_TIMEOUT", DDP_SETTING_SECONDS, "1800", 1800, 0, NOMAX, 0,
     "seconds; bounds every wait (store connection, rendezvous, each collective). pyddp's "
     "own `init_process_group(timeout=...)` wins over it; under torch's backend `\"pyddp\"` "
     "(torch's `init_process_group`, Lightning, Accelerate), which always passes a timeout "
     "of its own (30 min by default), a set `PYDDP_TIMEOUT` wins", ALL},
    {"PYDDP_EXIT_WAIT", DDP_SETTING_SECONDS, "10", 10, 0, NOMAX, 0,
     "seconds a process that exits without `destroy_process_group()` waits for collectives "
     "it still has queued or running (an `async_op=True` handle never waited for, say) "
     "before it aborts them, so that it ends and its peers fail at once instead of waiting "
     "for the timeout (see [design.md](design.md#failure-handling))", "CPU transport"},
    {"PYDDP_SOCKET_IFNAME", DDP_SETTING_STRING, NULL, 0, 0, 0, 0,
     "network interface whose address this rank advertises to its peers (e.g. `eth1`). "
     "Without it pyddp uses the local address that routes to `MASTER_ADDR`, which is right "
     "on VMs whose host name resolves to 127.0.1.1", ALL},
    {"PYDDP_PEER_DEAD_S", DDP_SETTING_INT, "15", 15, 2, 86400, CORE,
     "CPU backend (and every store connection): seconds without any answer from a peer's "
     "host (not even its kernel's TCP acknowledgements or keepalive replies) after which "
     "the peer's host, or the network to it, is reported down. A peer that is alive but "
     "stopped or slow still answers and is not affected", "CPU transport, store connections"},
    {"PYDDP_ELASTIC_SETTLE_S", DDP_SETTING_SECONDS, "1", 1, 0, NOMAX, 0,
     "in-place elastic jobs: seconds a membership change waits for a rank of the old "
     "world that has not answered and whose liveness is unknown (it published no "
     "liveness port). A rank whose liveness port still takes connections (paused, not "
     "dead) is waited for up to `PYDDP_PEER_DEAD_S`; one whose port refuses or does not "
     "answer is gone at once. The new world is closed at once when every old rank "
     "answered or is gone", "`pyddp.elastic`"},
    {"PYDDP_ELASTIC_JOIN", DDP_SETTING_STRING, NULL, 0, 0, 0, 0,
     "where a running in-place elastic job is: `host:port` of its store (the static "
     "form's `--master_addr:--master_port`), or `host:port/<rdzv id>` (a c10d launch's "
     "`--rdzv-endpoint` and `--rdzv-id`, through which the workers' store is found), or "
     "`etcd://HOST:PORT[,...]/<rdzv id>` (a job on etcd). "
     "Only pyddp's own `init_process_group` reads it (not torch's, under the backend "
     "`\"pyddp\"`): it then joins that job, admitted at its next `state.commit()`, "
     "instead of rendezvousing with its own launcher's ranks. Not needed with "
     "`--rdzv-backend=pyddp` or the static form, whose own launch line joins by itself (see "
     "[elastic.md](elastic.md#in-place))", "`pyddp.elastic`"},
    {"PYDDP_ELASTIC_CHECKPOINT_DIR", DDP_SETTING_STRING, NULL, 0, 0, 0, 0,
     "in-place elastic jobs: a directory on each node (or a shared one) where local rank 0 "
     "keeps the newest commit of `pyddp.elastic.run` (written to a temporary file, then "
     "renamed); a job started again resumes from the newest copy on any node. Unset: "
     "commits live in memory only", "`pyddp.elastic`"},
    {"PYDDP_ELASTIC_CHECKPOINT_EVERY", DDP_SETTING_INT, "1", 1, 1, NOMAX, 0,
     "in-place elastic jobs with `PYDDP_ELASTIC_CHECKPOINT_DIR`: write every k-th commit "
     "to disk", "`pyddp.elastic`"},
    {"PYDDP_RDZV_STORE", DDP_SETTING_STRING, NULL, 0, 0, 0, 0,
     "set by pyddp's torchrun rendezvous (`--rdzv-backend=pyddp`) for the workers it "
     "starts: `pyddp` says the job's store is pyddp's own in the endpoint's agent, so the "
     "workers authenticate to it with `PYDDP_AUTH_TOKEN`; `etcd://...` (the endpoint) says "
     "the job's store is that etcd cluster. Not to be set by hand", "`pyddp.elastic`"},
    {"PYDDP_ETCD_TIMEOUT", DDP_SETTING_SECONDS, "30", 30, 1, NOMAX, 0,
     "seconds an etcd request keeps trying the members (one that refuses, does not answer "
     "within 1 s, 2 s in the second round and 3 s after, or has no leader is left for the "
     "next at once) before the job's store is "
     "reported unavailable, naming etcd and its need for a majority of its members", "etcd store"},
    {"PYDDP_ETCD_CACERT", DDP_SETTING_STRING, NULL, 0, 0, 0, 0,
     "path of the CA certificate (PEM) that signed the etcd members' certificates; members "
     "named without a scheme are then `https`", "etcd store"},
    {"PYDDP_ETCD_CERT", DDP_SETTING_STRING, NULL, 0, 0, 0, 0,
     "path of this client's certificate (PEM), for members that require client "
     "certificates (`--client-cert-auth`)", "etcd store"},
    {"PYDDP_ETCD_KEY", DDP_SETTING_STRING, NULL, 0, 0, 0, 0,
     "path of the private key of `PYDDP_ETCD_CERT` (unset: the key is in that file)", "etcd store"},
    {"PYDDP_ETCD_USER", DDP_SETTING_STRING, NULL, 0, 0, 0, 0,
     "etcd user name, for a cluster with authentication enabled (`etcdctl auth enable`); "
     "needs `PYDDP_ETCD_PASSWORD` or `PYDDP_ETCD_PASSWORD_FILE`", "etcd store"},
    {"PYDDP_ETCD_PASSWORD", DDP_SETTING_STRING, NULL, 0, 0, 0, 0,
     "the password of `PYDDP_ETCD_USER`", "etcd store"},
    {"PYDDP_ETCD_PASSWORD_FILE", DDP_SETTING_STRING, NULL, 0, 0, 0, 0,
     "path of a file holding the password of `PYDDP_ETCD_USER` (a trailing newline is "
     "ignored), used when `PYDDP_ETCD_PASSWORD` is unset", "etcd store"},
    {"PYDDP_ELASTIC_STORE_LOST_S", DDP_SETTING_SECONDS, "300", 300, 1, NOMAX, 0,
     "in-place elastic jobs on etcd: seconds training goes on at a fixed world while etcd "
     "serves no request (no majority of its members, or unreachable) before the job ends "
     "with an error naming etcd; a membership change needed meanwhile ends it after "
     "`PYDDP_ETCD_TIMEOUT`", "`pyddp.elastic`"},
    {"PYDDP_PORT_RANGE", DDP_SETTING_STRING, NULL, 0, 0, 0, 0,
     "`lo-hi`: the data port each rank's process listens on (one for all its groups) is "
     "taken from this range (for firewalled VMs whose security group opens only a range; "
     "a rank of an in-place elastic job takes one more, for its liveness port). Without "
     "it, an ephemeral port", "CPU transport"},
    {"PYDDP_AUTH_TOKEN", DDP_SETTING_STRING, NULL, 0, 0, 0, CORE,
     "shared secret, the same on every node: every pyddp connection (data links, pyddp's "
     "store) then starts with a mutual HMAC-SHA256 challenge-response (see "
     "[security.md](security.md)). Set empty to silence the warning a multi-host job without "
     "it prints", ALL},
    {"PYDDP_AUTH_TOKEN_FILE", DDP_SETTING_STRING, NULL, 0, 0, 0, CORE,
     "path of a file holding the token (read once; a trailing newline is ignored), used when "
     "`PYDDP_AUTH_TOKEN` is unset or empty", ALL},
    {"PYDDP_STORE_BUFFER_BYTES", DDP_SETTING_BYTES, "268435456", 256 * MIB, 1 * MIB, NOMAX,
     CORE, "pyddp's store server: total bytes it holds for requests over 64 KiB while they "
     "arrive (smaller ones are not counted); when it runs out, the incomplete request "
     "silent longest is closed to make room, and a request larger than all of it is refused", "pyddp's store server"},
    {"PYDDP_STORE_REQUEST_TIMEOUT", DDP_SETTING_SECONDS, "30", 30, 0, NOMAX, CORE,
     "pyddp's store server: seconds a request may stay incomplete before its connection is "
     "closed (a connection's first request gets at most 5 s)", "pyddp's store server"},
    {"PYDDP_SHM_DISABLE", DDP_SETTING_BOOL, NULL, 0, 0, 1, CORE,
     "`1` forces TCP between ranks on the same host (comparison, debugging)", "CPU transport"},
    {"PYDDP_SHM_RING_BYTES", DDP_SETTING_BYTES, "1048576", MIB, 64 * KIB, 256 * MIB, CORE,
     "bytes of each direction's ring in a same-host pair's shared-memory segment (power of "
     "two, 64 KiB to 256 MiB)", "CPU transport"},
    {"PYDDP_SHM_CMA", DDP_SETTING_BOOL, NULL, 1, 0, 1, CORE,
     "`0` turns off the single-copy path (the receiver copying large sends straight out of "
     "the sender's memory with `process_vm_readv`); everything then goes through the ring", "CPU transport"},
    {"PYDDP_SHM_CMA_MIN", DDP_SETTING_BYTES, "131072", 128 * KIB, 1, NOMAX, CORE,
     "sends of at least this many bytes take the single-copy path where it is available", "CPU transport"},
    {"PYDDP_SMALL_BYTES", DDP_SETTING_BYTES, "65536", 64 * KIB, 0, GIB, CORE,
     "messages up to this size take the latency path (one exchange, no chunking)", "CPU transport"},
    {"PYDDP_CHUNK_BYTES", DDP_SETTING_BYTES, "262144", 256 * KIB, 1, GIB, CORE,
     "pipeline chunk of the bandwidth path", "CPU transport"},
    {"PYDDP_ALGO", DDP_SETTING_STRING, "auto", 0, 0, 0, CORE,
     "bandwidth-path algorithm across hosts: `auto` (hierarchical when the group spans "
     "several hosts and some host has several of its ranks, else the flat ring; a broadcast "
     "keeps the flat chain where it already enters each host once), `flat` or `hier` "
     "(forced, where the layout allows it; for tests and benchmarks), or `block` (flat, and "
     "a group on one host runs the ring's blocks one after another instead of slice by "
     "slice: the all-reduce before slices, for comparisons)", "CPU transport"},
    {"PYDDP_HIER_MIN_BYTES", DDP_SETTING_BYTES, "1048576", MIB, 0, NOMAX, CORE,
     "with `PYDDP_ALGO=auto`, messages from this size up take the hierarchical algorithms "
     "(smaller ones the flat ring, whose fewer stages cost less latency)", "CPU transport"},
    {"PYDDP_SOCKET_BUFFER_BYTES", DDP_SETTING_BYTES, NULL, 0, 0, GIB, CORE,
     "fixed `SO_SNDBUF`/`SO_RCVBUF` for data connections; unset leaves the kernel's buffer "
     "autotuning on (usually best)", "CPU transport"},
    {"PYDDP_NSOCKS_PERPEER", DDP_SETTING_INT, "1", 1, 1, 16, CORE,
     "TCP connections per pair of ranks that talk over TCP (1 to 16); each link's bytes are "
     "striped over them in 256 KiB segments. Worth 2-4 where the network caps each flow "
     "(clouds cap a single TCP flow, e.g. at 5 Gbit/s) or the NIC is faster than one "
     "connection goes; costs a little where one flow already fills the link (see "
     "[multi-vm.md](multi-vm.md)). Must be the same on every rank", "CPU transport"},
    {"PYDDP_NCCL_LIBRARY", DDP_SETTING_STRING, NULL, 0, 0, 0, 0,
     "path of `libnccl.so.2` to load for `backend=\"nccl\"` (see [gpu.md](gpu.md))", "NCCL"},
    {"PYDDP_CUDART_LIBRARY", DDP_SETTING_STRING, NULL, 0, 0, 0, DDP_SETTING_DEBUG,
     "path of the CUDA runtime (`libcudart.so.13`/`.12`) to load for `backend=\"nccl\"`", ALL},
    {"PYDDP_DUMP_ON_SIGNAL", DDP_SETTING_BOOL, NULL, 0, 0, 1, DDP_SETTING_DEBUG,
     "`1`: `SIGUSR1` prints this process's flight record (its last 64 collectives) on "
     "stderr, as `pyddp.dump_flight_record()` does", ALL},
    {"PYDDP_DOCTOR_FAKE_VERSION", DDP_SETTING_STRING, NULL, 0, 0, 0, DDP_SETTING_DEBUG,
     "`pkg=version[,pkg=version]`: the versions `python -m pyddp.doctor` reports and "
     "compares across ranks, overridden (to try the mismatch report); `9.9` alone means "
     "pyddp's", ALL},
    {"PYDDP_DEBUG_FORENSICS", DDP_SETTING_BOOL, NULL, 0, 0, 1, DDP_SETTING_DEBUG,
     "`1`: say on stderr why a straggler report or a first-failure note could not be "
     "made (the store was gone, a request failed)", ALL},
    {"PYDDP_DDP_GENERIC_PATH", DDP_SETTING_BOOL, NULL, 0, 0, 1, DDP_SETTING_DEBUG,
     "`1` makes DistributedDataParallel use its generic bucket path (copies by the array "
     "library, all-reduce through the process group) instead of the C path, as it does for "
     "GPU groups", ALL},
};
#define NSET (sizeof table / sizeof table[0])

const ddp_setting_decl *ddp_settings_table(size_t *n) {
    if (n) *n = NSET;
    return table;
}

static int index_of(const char *name) {
    for (size_t i = 0; name && i < NSET; i++)
        if (strcmp(table[i].name, name) == 0) return (int)i;
    return -1;
}

const ddp_setting_decl *ddp_setting_find(const char *name) {
    int i = index_of(name);
    return i < 0 ? NULL : &table[i];
}

/* ---- parsing ------------------------------------------------------------- */

/* text without leading and trailing white space, into buf (0 if too long). */
static int trimmed(const char *text, char *buf, size_t len) {
    while (isspace((unsigned char)*text)) text++;
    size_t n = strlen(text);
    while (n > 0 && isspace((unsigned char)text[n - 1])) n--;
    if (n >= len) return 0;
    memcpy(buf, text, n);
    buf[n] = '\0';
    return 1;
}

/* Clamp v to [lo, hi]: 1 if inside, 2 if clamped. */
static int clamp(int64_t v, int64_t lo, int64_t hi, int64_t *out) {
    *out = v < lo ? lo : v > hi ? hi : v;
    return *out == v ? 1 : 2;
}

static int parse_bytes(const ddp_setting_decl *d, const char *s, int64_t *out) {
    if (!isdigit((unsigned char)s[0])) return 0; /* no sign, no empty */
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    int too_big = errno == ERANGE;
    unsigned long long mult = 1;
    switch (*end) {
    case 'k': case 'K': mult = (unsigned long long)KIB, end++; break;
    case 'm': case 'M': mult = (unsigned long long)MIB, end++; break;
    case 'g': case 'G': mult = (unsigned long long)GIB, end++; break;
    default: break;
    }
    if (*end != '\0') return 0;
    if (too_big || v > (unsigned long long)INT64_MAX / mult) { /* valid, but huge */
        *out = d->max;
        return 2;
    }
    return clamp((int64_t)(v * mult), d->min, d->max, out);
}

static int parse_int(const ddp_setting_decl *d, const char *s, int64_t *out) {
    char *end;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (end == s || *end != '\0') return 0;
    if (errno == ERANGE) {
        *out = v < 0 ? d->min : d->max;
        return 2;
    }
    return clamp((int64_t)v, d->min, d->max, out);
}

static int parse_bool(const char *s, int64_t *out) {
    static const char *const yes[] = {"1", "true", "yes", "on"}, *const no[] = {"0", "false",
                                                                               "no", "off"};
    for (int i = 0; i < 4; i++) {
        if (strcasecmp(s, yes[i]) == 0) return (*out = 1), 1;
        if (strcasecmp(s, no[i]) == 0) return (*out = 0), 1;
    }
    return 0;
}

static int parse_seconds(const ddp_setting_decl *d, const char *s, double *out) {
    char *end;
    double v = strtod(s, &end);
    if (end == s || *end != '\0' || !isfinite(v) || v <= 0) return 0;
    *out = v < (double)d->min ? (double)d->min : v > (double)d->max ? (double)d->max : v;
    return *out == v ? 1 : 2;
}

int ddp_setting_parse(const ddp_setting_decl *d, const char *text, int64_t *out, double *secs) {
    char s[128];
    int64_t iv = 0;
    double dv = 0;
    int r = 0;
    if (!d || !text || !trimmed(text, s, sizeof s) || !s[0]) return 0;
    switch (d->kind) {
    case DDP_SETTING_INT: r = parse_int(d, s, &iv); break;
    case DDP_SETTING_BYTES: r = parse_bytes(d, s, &iv); break;
    case DDP_SETTING_BOOL: r = parse_bool(s, &iv); break;
    case DDP_SETTING_SECONDS: r = parse_seconds(d, s, &dv); break;
    case DDP_SETTING_STRING: return 0;
    }
    if (r && out) *out = iv;
    if (r && secs) *secs = dv;
    return r;
}

/* ---- the cache --------------------------------------------------------- */

typedef struct cached {
    int done;
    int64_t i;
    double secs;
    char *str;
} cached;

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static cached cache[NSET];

static const char *kind_words(ddp_setting_kind k) {
    switch (k) {
    case DDP_SETTING_INT: return "an integer";
    case DDP_SETTING_BYTES: return "a number of bytes (digits, optionally followed by K, M or G)";
    case DDP_SETTING_BOOL: return "a boolean (1/0, true/false, yes/no, on/off)";
    case DDP_SETTING_SECONDS: return "a positive number of seconds";
    default: return "text";
    }
}

/* Parse table[i] from the environment into c, warning once about a bad or
 * clamped value. Called with mu held. */
static void load(size_t i, cached *c) {
    const ddp_setting_decl *d = &table[i];
    const char *v = getenv(d->name);
    c->done = 1;
    c->i = d->dflt;
    c->secs = d->kind == DDP_SETTING_SECONDS && d->dflt_text ? strtod(d->dflt_text, NULL) : 0;
    if (d->kind == DDP_SETTING_STRING) {
        const char *s = v && *v ? v : d->dflt_text;
        c->str = s ? strdup(s) : NULL;
        return;
    }
    if (v == NULL || *v == '\0') return;
    int64_t iv;
    double sv;
    int r = ddp_setting_parse(d, v, &iv, &sv);
    if (r == 0) {
        fprintf(stderr, "pyddp: warning: ignoring %s='%.100s': not %s; using the default %s\n",
                d->name, v, kind_words(d->kind), d->dflt_text ? d->dflt_text : "(unset)");
        return;
    }
    c->i = iv;
    c->secs = sv;
    if (r == 2) {
        if (d->kind == DDP_SETTING_SECONDS)
            fprintf(stderr, "pyddp: warning: %s='%.100s' is outside its range %lld..%lld; "
                    "using %g\n", d->name, v, (long long)d->min, (long long)d->max, sv);
        else
            fprintf(stderr, "pyddp: warning: %s='%.100s' is outside its range %lld..%lld; "
                    "using %lld\n", d->name, v, (long long)d->min, (long long)d->max,
                    (long long)iv);
    }
}

/* The cached value of `name` if it is declared with one of the kinds in
 * `kinds` (a bit mask of 1 << kind); NULL (and one line on stderr) if not. */
static const cached *lookup(const char *name, unsigned kinds, cached *copy) {
    int i = index_of(name);
    if (i < 0 || !((1u << table[i].kind) & kinds)) {
        fprintf(stderr, "pyddp: internal error: no %s setting named %s\n",
                kinds == (1u << DDP_SETTING_STRING) ? "string" : "numeric",
                name ? name : "(null)");
        return NULL;
    }
    pthread_mutex_lock(&mu);
    if (!cache[i].done) load((size_t)i, &cache[i]);
    *copy = cache[i];
    pthread_mutex_unlock(&mu);
    return copy;
}

int64_t ddp_setting_int(const char *name) {
    cached c;
    const unsigned kinds = 1u << DDP_SETTING_INT | 1u << DDP_SETTING_BYTES |
                           1u << DDP_SETTING_BOOL;
    return lookup(name, kinds, &c) ? c.i : 0;
}

double ddp_setting_seconds(const char *name) {
    cached c;
    return lookup(name, 1u << DDP_SETTING_SECONDS, &c) ? c.secs : 0;
}

const char *ddp_setting_str(const char *name) {
    cached c;
    return lookup(name, 1u << DDP_SETTING_STRING, &c) ? c.str : NULL;
}

void ddp_settings_reload(void) {
    pthread_mutex_lock(&mu);
    for (size_t i = 0; i < NSET; i++) {
        free(cache[i].str);
        cache[i] = (cached){0};
    }
    pthread_mutex_unlock(&mu);
}
