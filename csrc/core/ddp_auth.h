/* ddp_auth.h - the shared-secret authentication of every pyddp connection
 * (docs/security.md).
 *
 * PYDDP_AUTH_TOKEN (or the contents of PYDDP_AUTH_TOKEN_FILE) is read once
 * per process. When it is set, every data link, and the store when both ends
 * are pyddp's, starts with a mutual challenge-response: each side sends a
 * fresh 32-byte nonce and proves knowledge of the token with
 * HMAC-SHA256(token, role || purpose || initiator nonce || responder nonce),
 * where role differs per direction (so a proof cannot be reflected back) and
 * purpose names the connection (so a proof for one link cannot be replayed
 * on another). Digests are compared in constant time; the token itself never
 * travels.
 *
 * The primitives come from OpenSSL's libcrypto, loaded with dlopen at first
 * use (libcrypto.so.3, then libcrypto.so.1.1) so the build needs no OpenSSL
 * headers; nonces come from getrandom(2).
 */
#ifndef DDP_AUTH_H
#define DDP_AUTH_H

#include <stddef.h>

#include "ddp_clock.h"
#include "ddp_status.h"

#define DDP_AUTH_NONCE 32
#define DDP_AUTH_MAC 32
#define DDP_AUTH_KEY_MAX 4096

/* A key (the token's bytes). Tests build their own; the process's comes
 * from ddp_auth_get. */
typedef struct ddp_auth {
    unsigned char key[DDP_AUTH_KEY_MAX];
    size_t len;
} ddp_auth;

/* Read the token settings and, if a token is set, load libcrypto (once per
 * process). DDP_OK with *out = the key, or NULL when no token is set;
 * DDP_ERR_INVALID if PYDDP_AUTH_TOKEN_FILE cannot be read or is empty or
 * too long; DDP_ERR_UNAVAILABLE naming every library tried if libcrypto
 * cannot be loaded. The same answer (and message) on every call. */
ddp_status ddp_auth_get(const ddp_auth **out);

/* Fill key from text (for tests and for the settings). */
void ddp_auth_set(ddp_auth *a, const void *key, size_t len);

/* Forget the cached token so the next ddp_auth_get reads the environment
 * again (tests only; not while other threads use the key). */
void ddp_auth_reload(void);

/* Raw HMAC-SHA256 of data under key (loads libcrypto). DDP_OK or
 * DDP_ERR_UNAVAILABLE. Exposed for the known-answer test. */
ddp_status ddp_auth_hmac(const void *key, size_t klen, const void *data, size_t n,
                         unsigned char out[DDP_AUTH_MAC]);

/* 32 fresh random bytes (getrandom). DDP_OK or DDP_ERR_SYS. */
ddp_status ddp_auth_nonce(unsigned char out[DDP_AUTH_NONCE]);

/* The proof of role ("initiator"/"responder") for purpose over the two
 * nonces: HMAC(key, role NUL purpose NUL ni nr). */
ddp_status ddp_auth_proof(const ddp_auth *a, const char *role, const char *purpose,
                          const unsigned char ni[DDP_AUTH_NONCE],
                          const unsigned char nr[DDP_AUTH_NONCE],
                          unsigned char out[DDP_AUTH_MAC]);

/* 1 if the n bytes at x and y are equal, compared in constant time
 * (CRYPTO_memcmp). */
int ddp_auth_equal(const void *x, const void *y, size_t n);

/* The initiator's half of the handshake on a connected socket: send ni,
 * read nr and the responder's proof, check it, send its own proof. The
 * caller has already sent whatever framing precedes it. DDP_OK, or
 * DDP_ERR_AUTH ("authentication failed with <peer>: ...") when the proof is
 * wrong or the peer closed during the exchange; timeouts and aborts keep
 * their status. Nothing is read beyond the handshake. */
ddp_status ddp_auth_initiate(int fd, const ddp_auth *a, const char *purpose, ddp_wait w,
                             const char *peer);

/* The responder's half: read ni, send nr and its proof, read and check the
 * initiator's proof. Same statuses; a failed or silent peer gives
 * DDP_ERR_AUTH and the caller drops it. */
ddp_status ddp_auth_respond(int fd, const ddp_auth *a, const char *purpose, ddp_wait w,
                            const char *peer);

/* "ip:port" of the connected socket's peer (or "unknown peer"). */
void ddp_auth_peer_name(int fd, char *out, size_t len);

/* One line on stderr: "pyddp: rejected <what> from <addr>: <why>", printed
 * once per address (a scanner cannot flood the log); later rejections from
 * an address already named are only counted. */
void ddp_auth_log_reject(const char *what, const char *addr, const char *why);

#endif
