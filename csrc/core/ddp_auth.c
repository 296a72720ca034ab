/* ddp_auth.c - the token, libcrypto loaded at run time, and the mutual
 * challenge-response over a blocking socket (contract in ddp_auth.h).
 *
 * libcrypto is opened like NCCL is (csrc/cuda/ddp_cuda_lib.c): candidate by
 * candidate, every refusal recorded, so a failure names what was tried. Only
 * three functions are needed and their prototypes are declared here, so no
 * OpenSSL header is needed at build time; HMAC() and EVP_sha256() have had
 * these signatures from OpenSSL 1.1 through 3.x.
 */
#include "ddp_auth.h"

#include <arpa/inet.h>
#include <dlfcn.h>
#include <errno.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/socket.h>

#include "ddp_settings.h"
#include "ddp_sock.h"

typedef const void *(*evp_md_fn)(void);
typedef unsigned char *(*hmac_fn)(const void *md, const void *key, int klen,
                                  const unsigned char *d, size_t n, unsigned char *out,
                                  unsigned int *outlen);
typedef int (*memcmp_fn)(const void *a, const void *b, size_t n);
typedef int (*init_fn)(uint64_t opts, const void *settings);
#define OPENSSL_INIT_NO_ATEXIT 0x00080000L

static const char *const LIBS[] = {"libcrypto.so.3", "libcrypto.so.1.1"};

static pthread_once_t g_crypto_once = PTHREAD_ONCE_INIT;
static evp_md_fn g_sha256;
static hmac_fn g_hmac;
static memcmp_fn g_memcmp;
static char g_crypto_err[1024];
/* OpenSSL frees its state in an atexit handler, while our store server
 * thread may still be answering connections: after our own handler (which
 * runs first, being registered later) has taken g_exit_mu for writing, every
 * HMAC fails cleanly instead of touching freed state. */
static pthread_rwlock_t g_exit_mu = PTHREAD_RWLOCK_INITIALIZER;
static int g_exiting;

static void crypto_atexit(void) {
    pthread_rwlock_wrlock(&g_exit_mu);
    g_exiting = 1;
    pthread_rwlock_unlock(&g_exit_mu);
}

/* Open the first libcrypto that has every symbol; else g_crypto_err says
 * what each candidate lacked. */
static void load_crypto(void) {
    size_t used = 0;
    for (size_t i = 0; i < sizeof LIBS / sizeof LIBS[0]; i++) {
        void *h = dlopen(LIBS[i], RTLD_NOW | RTLD_LOCAL);
        const char *why = NULL;
        if (h == NULL) {
            why = dlerror();
        } else {
            void *s = dlsym(h, "EVP_sha256"), *m = dlsym(h, "HMAC"),
                 *c = dlsym(h, "CRYPTO_memcmp");
            if (s && m && c) {
                memcpy(&g_sha256, &s, sizeof s);
                memcpy(&g_hmac, &m, sizeof m);
                memcpy(&g_memcmp, &c, sizeof c);
                /* Ask for no atexit cleanup (ignored if the process, e.g.
                 * CPython's hashlib, initialised OpenSSL first), run one HMAC so
                 * any handler OpenSSL registers comes before ours, then ours. */
                void *i = dlsym(h, "OPENSSL_init_crypto");
                init_fn init;
                memcpy(&init, &i, sizeof i);
                if (i) init(OPENSSL_INIT_NO_ATEXIT, NULL);
                unsigned char out[64];
                unsigned int ol = 0;
                g_hmac(g_sha256(), "k", 1, (const unsigned char *)"d", 1, out, &ol);
                atexit(crypto_atexit);
                return;   /* kept open for the life of the process */
            }
            why = !s ? "no EVP_sha256" : !m ? "no HMAC" : "no CRYPTO_memcmp";
            dlclose(h);
        }
        int k = snprintf(g_crypto_err + used, sizeof g_crypto_err - used, "%s%s: %s",
                         used ? "; " : "", LIBS[i], why ? why : "?");
        if (k > 0) used += (size_t)k < sizeof g_crypto_err - used ? (size_t)k : 0;
    }
}

static ddp_status crypto(void) {
    pthread_once(&g_crypto_once, load_crypto);
    if (g_hmac) return DDP_OK;
    return ddp_error(DDP_ERR_UNAVAILABLE, "PYDDP_AUTH_TOKEN is set but OpenSSL's libcrypto "
                     "could not be loaded (tried %s). Install OpenSSL (e.g. apt-get install "
                     "libssl3) or unset the token.", g_crypto_err);
}

ddp_status ddp_auth_hmac(const void *key, size_t klen, const void *data, size_t n,
                         unsigned char out[DDP_AUTH_MAC]) {
    ddp_status st = crypto();
    if (st != DDP_OK) return st;
    unsigned int ol = 0;
    pthread_rwlock_rdlock(&g_exit_mu);
    unsigned char *r = g_exiting ? NULL : g_hmac(g_sha256(), key, (int)klen, data, n, out, &ol);
    pthread_rwlock_unlock(&g_exit_mu);
    if (r == NULL || ol != DDP_AUTH_MAC)
        return ddp_error(DDP_ERR_UNAVAILABLE, "libcrypto's HMAC-SHA256 failed%s",
                         g_exiting ? " (the process is exiting)" : "");
    return DDP_OK;
}

int ddp_auth_equal(const void *x, const void *y, size_t n) {
    if (crypto() != DDP_OK) return 0;
    return g_memcmp(x, y, n) == 0;   /* touches no OpenSSL state: safe at exit too */
}

ddp_status ddp_auth_nonce(unsigned char out[DDP_AUTH_NONCE]) {
    size_t got = 0;
    while (got < DDP_AUTH_NONCE) {
        ssize_t k = getrandom(out + got, DDP_AUTH_NONCE - got, 0);
        if (k < 0 && errno == EINTR) continue;
        if (k < 0) return ddp_error(DDP_ERR_SYS, "getrandom: %s", strerror(errno));
        got += (size_t)k;
    }
    return DDP_OK;
}

ddp_status ddp_auth_proof(const ddp_auth *a, const char *role, const char *purpose,
                          const unsigned char ni[DDP_AUTH_NONCE],
                          const unsigned char nr[DDP_AUTH_NONCE],
                          unsigned char out[DDP_AUTH_MAC]) {
    unsigned char msg[512 + 2 * DDP_AUTH_NONCE];
    size_t rl = strlen(role) + 1, pl = strlen(purpose) + 1;
    if (rl + pl > 512) return ddp_error(DDP_ERR_INTERNAL, "authentication purpose too long");
    memcpy(msg, role, rl);
    memcpy(msg + rl, purpose, pl);
    memcpy(msg + rl + pl, ni, DDP_AUTH_NONCE);
    memcpy(msg + rl + pl + DDP_AUTH_NONCE, nr, DDP_AUTH_NONCE);
    return ddp_auth_hmac(a->key, a->len, msg, rl + pl + 2 * DDP_AUTH_NONCE, out);
}

void ddp_auth_set(ddp_auth *a, const void *key, size_t len) {
    if (len > DDP_AUTH_KEY_MAX) len = DDP_AUTH_KEY_MAX;
    memcpy(a->key, key, len);
    a->len = len;
}

/* ---- the process's token ------------------------------------------------ */

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static int g_read;                 /* under g_mu */
static ddp_status g_st;
static char g_msg[1400];
static ddp_auth g_key;
static int g_have;

/* Read the token into g_key (g_mu held). */
static ddp_status read_token(void) {
    const char *tok = ddp_setting_str("PYDDP_AUTH_TOKEN");
    if (tok != NULL) {
        if (strlen(tok) > DDP_AUTH_KEY_MAX)
            return ddp_error(DDP_ERR_INVALID, "PYDDP_AUTH_TOKEN is longer than %d bytes",
                             DDP_AUTH_KEY_MAX);
        ddp_auth_set(&g_key, tok, strlen(tok));
        g_have = 1;
        return crypto();
    }
    const char *path = ddp_setting_str("PYDDP_AUTH_TOKEN_FILE");
    if (path == NULL) return DDP_OK;
    FILE *f = fopen(path, "rb");
    if (f == NULL)
        return ddp_error(DDP_ERR_INVALID, "PYDDP_AUTH_TOKEN_FILE=%s cannot be read: %s", path,
                         strerror(errno));
    size_t n = fread(g_key.key, 1, sizeof g_key.key, f);
    int more = fgetc(f) != EOF;
    fclose(f);
    while (n > 0 && (g_key.key[n - 1] == '\n' || g_key.key[n - 1] == '\r')) n--;
    if (more) return ddp_error(DDP_ERR_INVALID, "PYDDP_AUTH_TOKEN_FILE=%s is longer than %d "
                               "bytes", path, DDP_AUTH_KEY_MAX);
    if (n == 0) return ddp_error(DDP_ERR_INVALID, "PYDDP_AUTH_TOKEN_FILE=%s is empty", path);
    g_key.len = n;
    g_have = 1;
    return crypto();
}

ddp_status ddp_auth_get(const ddp_auth **out) {
    pthread_mutex_lock(&g_mu);
    if (!g_read) {
        g_st = read_token();
        if (g_st != DDP_OK) {
            ddp_copy_error(g_msg, sizeof g_msg);
            g_have = 0;
        }
        g_read = 1;
    }
    ddp_status st = g_st;
    *out = g_have ? &g_key : NULL;
    pthread_mutex_unlock(&g_mu);
    if (st != DDP_OK) ddp_set_error_text(g_msg);
    return st;
}

void ddp_auth_reload(void) {
    pthread_mutex_lock(&g_mu);
    g_read = g_have = 0;
    memset(&g_key, 0, sizeof g_key);
    pthread_mutex_unlock(&g_mu);
}

/* ---- the handshake ------------------------------------------------------- */

/* A failure status for an exchange step: closes and garbage become
 * DDP_ERR_AUTH with the reason; timeouts and aborts stay what they are. */
static ddp_status step_fail(ddp_status st, const char *peer, const char *doing) {
    if (st == DDP_ERR_TIMEOUT || st == DDP_ERR_ABORTED || st == DDP_ERR_NOMEM ||
        st == DDP_ERR_UNAVAILABLE)
        return ddp_error_prefix(st, "authentication with %s (%s): ", peer, doing);
    char why[512];
    ddp_copy_error(why, sizeof why);
    return ddp_error(DDP_ERR_AUTH, "authentication failed with %s: the connection broke "
                     "while %s (%s). Does it have the same PYDDP_AUTH_TOKEN?", peer, doing,
                     why);
}

ddp_status ddp_auth_initiate(int fd, const ddp_auth *a, const char *purpose, ddp_wait w,
                             const char *peer) {
    unsigned char ni[DDP_AUTH_NONCE], in[DDP_AUTH_NONCE + DDP_AUTH_MAC], want[DDP_AUTH_MAC];
    ddp_status st = ddp_auth_nonce(ni);
    if (st != DDP_OK) return st;
    st = ddp_sock_send_all(fd, ni, sizeof ni, w, peer);
    if (st != DDP_OK) return step_fail(st, peer, "sending a challenge");
    st = ddp_sock_recv_all(fd, in, sizeof in, w, peer);
    if (st != DDP_OK) return step_fail(st, peer, "waiting for its proof");
    st = ddp_auth_proof(a, "responder", purpose, ni, in, want);
    if (st != DDP_OK) return st;
    if (!ddp_auth_equal(want, in + DDP_AUTH_NONCE, DDP_AUTH_MAC))
        return ddp_error(DDP_ERR_AUTH, "authentication failed with %s: its proof does not "
                         "match this rank's PYDDP_AUTH_TOKEN. Every rank and the store must "
                         "use the same token.", peer);
    st = ddp_auth_proof(a, "initiator", purpose, ni, in, want);
    if (st != DDP_OK) return st;
    st = ddp_sock_send_all(fd, want, sizeof want, w, peer);
    return st == DDP_OK ? st : step_fail(st, peer, "sending this rank's proof");
}

ddp_status ddp_auth_respond(int fd, const ddp_auth *a, const char *purpose, ddp_wait w,
                            const char *peer) {
    unsigned char ni[DDP_AUTH_NONCE], out[DDP_AUTH_NONCE + DDP_AUTH_MAC], got[DDP_AUTH_MAC],
        want[DDP_AUTH_MAC];
    ddp_status st = ddp_sock_recv_all(fd, ni, sizeof ni, w, peer);
    if (st != DDP_OK) return step_fail(st, peer, "waiting for its challenge");
    if ((st = ddp_auth_nonce(out)) != DDP_OK) return st;
    st = ddp_auth_proof(a, "responder", purpose, ni, out, out + DDP_AUTH_NONCE);
    if (st != DDP_OK) return st;
    st = ddp_sock_send_all(fd, out, sizeof out, w, peer);
    if (st != DDP_OK) return step_fail(st, peer, "sending this rank's proof");
    st = ddp_sock_recv_all(fd, got, sizeof got, w, peer);
    if (st != DDP_OK) return step_fail(st, peer, "waiting for its proof");
    st = ddp_auth_proof(a, "initiator", purpose, ni, out, want);
    if (st != DDP_OK) return st;
    if (!ddp_auth_equal(want, got, DDP_AUTH_MAC))
        return ddp_error(DDP_ERR_AUTH, "authentication failed with %s: its proof does not "
                         "match this rank's PYDDP_AUTH_TOKEN", peer);
    return DDP_OK;
}

void ddp_auth_peer_name(int fd, char *out, size_t len) {
    struct sockaddr_storage ss;
    socklen_t sl = sizeof ss;
    char ip[INET6_ADDRSTRLEN] = "";
    if (getpeername(fd, (struct sockaddr *)&ss, &sl) == 0) {
        if (ss.ss_family == AF_INET) {
            struct sockaddr_in *s4 = (struct sockaddr_in *)&ss;
            inet_ntop(AF_INET, &s4->sin_addr, ip, sizeof ip);
            ddp_sock_format_hostport(ip, ntohs(s4->sin_port), out, len);
            return;
        }
        if (ss.ss_family == AF_INET6) {
            struct sockaddr_in6 *s6 = (struct sockaddr_in6 *)&ss;
            if (IN6_IS_ADDR_V4MAPPED(&s6->sin6_addr))   /* show ::ffff:a.b.c.d as a.b.c.d */
                inet_ntop(AF_INET, &s6->sin6_addr.s6_addr[12], ip, sizeof ip);
            else
                inet_ntop(AF_INET6, &s6->sin6_addr, ip, sizeof ip);
            ddp_sock_format_hostport(ip, ntohs(s6->sin6_port), out, len);
            return;
        }
    }
    snprintf(out, len, "unknown peer");
}

#define LOGGED_MAX 256
static pthread_mutex_t g_log_mu = PTHREAD_MUTEX_INITIALIZER;
static char g_logged[LOGGED_MAX][INET6_ADDRSTRLEN + 2];
static size_t g_nlogged;
static unsigned long g_unlogged;

void ddp_auth_log_reject(const char *what, const char *addr, const char *why) {
    /* Once per host (the port part changes with every connection). */
    char host[INET6_ADDRSTRLEN + 2];
    snprintf(host, sizeof host, "%s", addr);
    char *colon = strrchr(host, ':');
    if (colon && strchr(host, ']') == NULL && strchr(host, ':') == colon) *colon = '\0';
    else if (colon && strchr(host, ']')) *strchr(host, ']') = '\0';
    pthread_mutex_lock(&g_log_mu);
    int seen = 0;
    for (size_t i = 0; i < g_nlogged && !seen; i++) seen = strcmp(g_logged[i], host) == 0;
    if (!seen && g_nlogged < LOGGED_MAX) {
        snprintf(g_logged[g_nlogged++], sizeof g_logged[0], "%s", host);
        fprintf(stderr, "pyddp: rejected %s from %s: %s (further rejections from this host "
                "are not logged)\n", what, addr, why);
    } else {
        g_unlogged++;
    }
    pthread_mutex_unlock(&g_log_mu);
}
