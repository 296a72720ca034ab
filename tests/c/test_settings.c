/* test_settings.c - the settings table and its parser: every kind's syntax
 * (bytes with K/M/G, integers, booleans, seconds), white space, empty and
 * garbage values, bounds (clamped), the accessors' parse-once cache with its
 * single warning line naming the variable, undeclared names, concurrent
 * readers, and that docs/env.md lists exactly the table's variables with the
 * same defaults and doc lines. */
#include <fcntl.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ddp_link_shm.h"
#include "ddp_settings.h"
#include "testutil.h"

/* ---- stderr capture ---------------------------------------------------- */

static int cap_saved = -1;
static char cap_path[64];

static void cap_begin(void) {
    snprintf(cap_path, sizeof cap_path, "/tmp/pyddp-test-settings-%ld", (long)getpid());
    int fd = open(cap_path, O_RDWR | O_CREAT | O_TRUNC, 0600);
    T_ASSERT(fd >= 0);
    fflush(stderr);
    cap_saved = dup(2);
    T_ASSERT(cap_saved >= 0 && dup2(fd, 2) == 2);
    close(fd);
}

/* What was written to stderr since cap_begin (caller frees). */
static char *cap_end(void) {
    fflush(stderr);
    T_ASSERT(dup2(cap_saved, 2) == 2);
    close(cap_saved);
    FILE *f = fopen(cap_path, "r");
    T_ASSERT(f);
    char *buf = calloc(1, 8192);
    T_ASSERT(buf);
    size_t n = fread(buf, 1, 8191, f);
    buf[n] = '\0';
    fclose(f);
    unlink(cap_path);
    return buf;
}

static int count_lines(const char *s) {
    int n = 0;
    for (; *s; s++) n += *s == '\n';
    return n;
}

/* ---- the parser ---------------------------------------------------------- */

static void expect_parse(const ddp_setting_decl *d, const char *text, int want_r, int64_t want) {
    int64_t v = -12345;
    int r = ddp_setting_parse(d, text, &v, NULL);
    if (r != want_r || (r && v != want)) {
        fprintf(stderr, "parse(%s, '%s') = %d, %lld; expected %d, %lld\n", d->name, text, r,
                (long long)v, want_r, (long long)want);
        exit(1);
    }
}

static void test_parser(void) {
    const ddp_setting_decl *ring = ddp_setting_find("PYDDP_SHM_RING_BYTES");
    T_ASSERT(ring && ring->kind == DDP_SETTING_BYTES);
    expect_parse(ring, "1048576", 1, 1048576);
    expect_parse(ring, "  131072\t", 1, 131072);
    expect_parse(ring, "64K", 1, 65536);
    expect_parse(ring, "2m", 1, 2 << 20);
    expect_parse(ring, "1G", 2, 256 << 20);       /* above the maximum: clamped */
    expect_parse(ring, "1", 2, 64 << 10);         /* below the minimum: clamped */
    expect_parse(ring, "0", 2, 64 << 10);
    expect_parse(ring, "99999999999999999999999", 2, 256 << 20); /* overflows: the maximum */
    expect_parse(ring, "17179869184G", 2, 256 << 20); /* the suffix overflows */
    static const char *const bad_bytes[] = {"", "   ", "junk", "-1", "+5", "1.5", "12abc",
                                            "1KB", "K", "0x100", "1 2"};
    for (size_t i = 0; i < sizeof bad_bytes / sizeof *bad_bytes; i++)
        expect_parse(ring, bad_bytes[i], 0, 0);
    T_ASSERT(ddp_setting_parse(ring, NULL, NULL, NULL) == 0);

    /* integers (no INT setting is declared today: a local declaration) */
    const ddp_setting_decl in = {"PYDDP_TEST_INT", DDP_SETTING_INT, "0", 0, -5, 5, 0, "test", NULL};
    expect_parse(&in, "-5", 1, -5);
    expect_parse(&in, "+3", 1, 3);
    expect_parse(&in, "-6", 2, -5);
    expect_parse(&in, "-99999999999999999999", 2, -5);
    expect_parse(&in, "6", 2, 5);
    expect_parse(&in, "3x", 0, 0);
    expect_parse(&in, "", 0, 0);

    const ddp_setting_decl *b = ddp_setting_find("PYDDP_SHM_DISABLE");
    T_ASSERT(b && b->kind == DDP_SETTING_BOOL);
    static const char *const yes[] = {"1", "true", "TRUE", "yes", "On", " on "};
    static const char *const no[] = {"0", "false", "No", "OFF"};
    for (size_t i = 0; i < sizeof yes / sizeof *yes; i++) expect_parse(b, yes[i], 1, 1);
    for (size_t i = 0; i < sizeof no / sizeof *no; i++) expect_parse(b, no[i], 1, 0);
    expect_parse(b, "2", 0, 0);
    expect_parse(b, "maybe", 0, 0);
    expect_parse(b, "", 0, 0);

    const ddp_setting_decl *t = ddp_setting_find("PYDDP_TIMEOUT");
    T_ASSERT(t && t->kind == DDP_SETTING_SECONDS);
    double s = 0;
    T_ASSERT(ddp_setting_parse(t, "2.5", NULL, &s) == 1 && s == 2.5);
    T_ASSERT(ddp_setting_parse(t, "1e3", NULL, &s) == 1 && s == 1000.0);
    static const char *const bad_secs[] = {"0", "-1", "inf", "nan", "1s", "", "x"};
    for (size_t i = 0; i < sizeof bad_secs / sizeof *bad_secs; i++)
        T_ASSERT(ddp_setting_parse(t, bad_secs[i], NULL, &s) == 0);

    const ddp_setting_decl *str = ddp_setting_find("PYDDP_PORT_RANGE");
    T_ASSERT(str && ddp_setting_parse(str, "1-2", NULL, NULL) == 0); /* strings: not parsed */
    printf("parser: ok\n");
}

/* ---- the table ------------------------------------------------------------- */

static void test_table(void) {
    size_t n = 0;
    const ddp_setting_decl *tab = ddp_settings_table(&n);
    T_ASSERT(tab && n >= 13);
    for (size_t i = 0; i < n; i++) {
        const ddp_setting_decl *d = &tab[i];
        T_ASSERT(strncmp(d->name, "PYDDP_", 6) == 0 && d->doc && d->doc[0]);
        T_ASSERT(ddp_setting_find(d->name) == d); /* names are unique */
        if (d->kind == DDP_SETTING_STRING) continue;
        if (d->kind == DDP_SETTING_BOOL) T_ASSERT(d->min == 0 && d->max == 1);
        T_ASSERT(d->min <= d->max);
        if (d->kind == DDP_SETTING_SECONDS) {
            double s = 0;
            T_ASSERT(d->dflt_text && ddp_setting_parse(d, d->dflt_text, NULL, &s) == 1);
            continue;
        }
        T_ASSERT(d->dflt >= d->min && d->dflt <= d->max);
        int64_t v = -1;
        if (d->dflt_text) /* the documented default is the value used */
            T_ASSERT(ddp_setting_parse(d, d->dflt_text, &v, NULL) == 1 && v == d->dflt);
    }
    T_ASSERT(ddp_setting_find("PYDDP_NO_SUCH_SETTING") == NULL && ddp_setting_find(NULL) == NULL);
    T_ASSERT(ddp_setting_find("PYDDP_SHM_RING_BYTES")->dflt == DDP_SHM_RING_DEFAULT);
    /* the core's own settings, and PYDDP_SMALL_BYTES / PYDDP_CHUNK_BYTES for ddp_comm.c */
    static const char *const core[] = {"PYDDP_SHM_DISABLE", "PYDDP_SHM_RING_BYTES",
                                       "PYDDP_SHM_CMA", "PYDDP_SHM_CMA_MIN",
                                       "PYDDP_SMALL_BYTES", "PYDDP_CHUNK_BYTES",
                                       "PYDDP_SOCKET_BUFFER_BYTES"};
    for (size_t i = 0; i < sizeof core / sizeof *core; i++)
        T_ASSERT(ddp_setting_find(core[i])->flags & DDP_SETTING_CORE);
    printf("table: ok\n");
}

/* docs/env.md's rows for PYDDP_* variables are exactly the table's: same
 * default ("unset" for none) and the same doc line, in the same section. */
static void test_doc_matches(void) {
    FILE *f = fopen("../../docs/env.md", "r"); /* make runs the tests in tests/c */
    T_ASSERT(f != NULL);
    size_t n;
    const ddp_setting_decl *tab = ddp_settings_table(&n);
    int seen[64] = {0}, debug_section = 0, rows = 0;
    T_ASSERT(n <= 64);
    char line[2048];
    while (fgets(line, sizeof line, f)) {
        line[strcspn(line, "\n")] = '\0';
        if (strncmp(line, "## ", 3) == 0) debug_section = strstr(line, "debugging") != NULL;
        if (strncmp(line, "| `PYDDP_", 9) != 0) continue;
        char name[64];
        size_t k = strcspn(line + 3, "`");
        T_ASSERT(k < sizeof name);
        memcpy(name, line + 3, k);
        name[k] = '\0';
        const ddp_setting_decl *d = ddp_setting_find(name);
        if (!d) {
            fprintf(stderr, "docs/env.md lists %s, which ddp_settings.c does not declare\n", name);
            exit(1);
        }
        char want[2048];
        if (d->flags & DDP_SETTING_DEBUG)
            snprintf(want, sizeof want, "| `%s` | %s |", d->name, d->doc);
        else
            snprintf(want, sizeof want, "| `%s` | %s | %s | %s |", d->name,
                     d->dflt_text ? d->dflt_text : "unset",
                     d->scope ? d->scope : "every backend", d->doc);
        if (strcmp(line, want) != 0 || debug_section != !!(d->flags & DDP_SETTING_DEBUG)) {
            fprintf(stderr, "docs/env.md's row differs from the table:\n  doc:   %s\n  table: %s\n",
                    line, want);
            exit(1);
        }
        seen[d - tab]++;
        rows++;
    }
    fclose(f);
    for (size_t i = 0; i < n; i++)
        if (seen[i] != 1) {
            fprintf(stderr, "docs/env.md lists %s %d times (want once)\n", tab[i].name, seen[i]);
            exit(1);
        }
    T_ASSERT((size_t)rows == n);
    printf("docs/env.md matches the table: ok\n");
}

/* ---- the accessors ----------------------------------------------------------- */

static void test_accessors(void) {
    unsetenv("PYDDP_SMALL_BYTES");
    unsetenv("PYDDP_PORT_RANGE");
    unsetenv("PYDDP_TIMEOUT");
    unsetenv("PYDDP_SHM_CMA");
    ddp_settings_reload();
    cap_begin();
    T_ASSERT(ddp_setting_int("PYDDP_SMALL_BYTES") == 65536); /* unset: default */
    T_ASSERT(ddp_setting_int("PYDDP_SHM_CMA") == 1);         /* unset bool: its default */
    T_ASSERT(ddp_setting_str("PYDDP_PORT_RANGE") == NULL);
    T_ASSERT(ddp_setting_seconds("PYDDP_TIMEOUT") == 1800.0);
    char *out = cap_end();
    T_ASSERT(out[0] == '\0'); /* defaults are silent */
    free(out);

    /* garbage: the default and one warning naming the variable, once */
    setenv("PYDDP_SMALL_BYTES", "lots", 1);
    setenv("PYDDP_SHM_CMA", "", 1);
    setenv("PYDDP_PORT_RANGE", "40000-40100", 1);
    setenv("PYDDP_TIMEOUT", "2.5", 1);
    ddp_settings_reload();
    cap_begin();
    for (int i = 0; i < 3; i++) T_ASSERT(ddp_setting_int("PYDDP_SMALL_BYTES") == 65536);
    T_ASSERT(ddp_setting_int("PYDDP_SHM_CMA") == 1); /* empty: unset, silent */
    T_ASSERT(strcmp(ddp_setting_str("PYDDP_PORT_RANGE"), "40000-40100") == 0);
    T_ASSERT(ddp_setting_seconds("PYDDP_TIMEOUT") == 2.5);
    out = cap_end();
    T_ASSERT(count_lines(out) == 1 && strstr(out, "PYDDP_SMALL_BYTES='lots'") &&
             strstr(out, "65536"));
    free(out);

    /* parsed once: a later change is not seen until reload */
    setenv("PYDDP_SMALL_BYTES", "4K", 1);
    T_ASSERT(ddp_setting_int("PYDDP_SMALL_BYTES") == 65536);
    ddp_settings_reload();
    T_ASSERT(ddp_setting_int("PYDDP_SMALL_BYTES") == 4096);

    /* out of range: clamped, one warning */
    setenv("PYDDP_CHUNK_BYTES", "0", 1);
    ddp_settings_reload();
    cap_begin();
    T_ASSERT(ddp_setting_int("PYDDP_CHUNK_BYTES") == 1);
    T_ASSERT(ddp_setting_int("PYDDP_CHUNK_BYTES") == 1);
    out = cap_end();
    T_ASSERT(count_lines(out) == 1 && strstr(out, "PYDDP_CHUNK_BYTES") && strstr(out, "range"));
    free(out);

    /* undeclared names and wrong kinds: a bug, reported, neutral value */
    cap_begin();
    T_ASSERT(ddp_setting_int("PYDDP_NO_SUCH") == 0);
    T_ASSERT(ddp_setting_int("PYDDP_PORT_RANGE") == 0);
    T_ASSERT(ddp_setting_str("PYDDP_SMALL_BYTES") == NULL);
    T_ASSERT(ddp_setting_seconds("PYDDP_SMALL_BYTES") == 0);
    out = cap_end();
    T_ASSERT(count_lines(out) == 4 && strstr(out, "PYDDP_NO_SUCH"));
    free(out);

    unsetenv("PYDDP_SMALL_BYTES");
    unsetenv("PYDDP_CHUNK_BYTES");
    unsetenv("PYDDP_PORT_RANGE");
    unsetenv("PYDDP_TIMEOUT");
    unsetenv("PYDDP_SHM_CMA");
    ddp_settings_reload();
    printf("accessors: ok\n");
}

/* Many threads reading at once see one value (and ThreadSanitizer sees the
 * cache's locking). */
static void *reader(void *arg) {
    int64_t *out = arg;
    for (int i = 0; i < 1000; i++) out[i % 4] = ddp_setting_int("PYDDP_SHM_RING_BYTES");
    return NULL;
}

static void test_threads(void) {
    setenv("PYDDP_SHM_RING_BYTES", "2M", 1);
    ddp_settings_reload();
    pthread_t t[4];
    int64_t got[4][4];
    for (int i = 0; i < 4; i++) T_ASSERT(pthread_create(&t[i], NULL, reader, got[i]) == 0);
    for (int i = 0; i < 4; i++) T_ASSERT(pthread_join(t[i], NULL) == 0);
    for (int i = 0; i < 4; i++)
        for (int k = 0; k < 4; k++) T_ASSERT(got[i][k] == 2 << 20);
    unsetenv("PYDDP_SHM_RING_BYTES");
    ddp_settings_reload();
    printf("concurrent readers: ok\n");
}

int main(void) {
    test_parser();
    test_table();
    test_doc_matches();
    test_accessors();
    test_threads();
    printf("test_settings: ok\n");
    return 0;
}
