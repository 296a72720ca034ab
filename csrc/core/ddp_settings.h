/* ddp_settings.h - the one list of pyddp's environment settings, and the
 * accessors the core reads them through.
 *
 * Every PYDDP_* variable that pyddp reads, in C or in Python, is declared
 * once in ddp_settings.c with its kind, default, bounds and the one-line doc
 * that docs/env.md shows (tests/c/test_settings.c checks that the page
 * matches the table). The C core reads its settings only through the
 * accessors here; Python lists the table (ddp_settings_table), reads the
 * core's values through them (_C.setting) and parses its own few
 * (PYDDP_TIMEOUT, PYDDP_PORT_RANGE, ...) itself from their text
 * (_C.setting_text, declared names only), raising DistValueError on bad
 * values, since they are checked before anything runs.
 *
 * Policy of the accessors (what the core does with a bad value: it never
 * fails a job over a tuning knob, and never ignores one silently):
 *   - unset or empty: the default;
 *   - unparsable: the default, and one warning line on stderr naming the
 *     variable, its value and the default used;
 *   - outside [min, max]: clamped to the bound, with one warning line.
 * Each variable is parsed once per process, on first use, and the value is
 * kept (ddp_settings_reload forgets them, for tests). Thread-safe.
 */
#ifndef DDP_SETTINGS_H
#define DDP_SETTINGS_H

#include <stddef.h>
#include <stdint.h>

typedef enum ddp_setting_kind {
    DDP_SETTING_INT,     /* a decimal integer */
    DDP_SETTING_BYTES,   /* a size: digits, optionally K, M or G (KiB, MiB, GiB) */
    DDP_SETTING_BOOL,    /* 1/0, true/false, yes/no, on/off (any case) */
    DDP_SETTING_SECONDS, /* a positive decimal number of seconds, e.g. 2.5 */
    DDP_SETTING_STRING   /* text, parsed (if at all) by whoever reads it */
} ddp_setting_kind;

/* Flags of a declaration. */
#define DDP_SETTING_CORE 1u  /* read by the C core (else by Python) */
#define DDP_SETTING_DEBUG 2u /* listed under "For debugging and tests" */

typedef struct ddp_setting_decl {
    const char *name;
    ddp_setting_kind kind;
    const char *dflt_text; /* the default as docs/env.md shows it; NULL: "unset" */
    int64_t dflt;          /* INT/BYTES/BOOL: the value used when unset or invalid */
    int64_t min, max;      /* INT/BYTES/SECONDS: bounds, inclusive (seconds: whole) */
    unsigned flags;
    const char *doc;       /* one line, Markdown, as in docs/env.md */
    const char *scope;     /* where it applies, docs/env.md's column: "CPU transport",
                            * "NCCL", ...; NULL: every backend (not shown for debug ones) */
} ddp_setting_decl;

/* The whole table, in the order docs/env.md lists it; *n = its length. */
const ddp_setting_decl *ddp_settings_table(size_t *n);

/* The declaration of a variable, or NULL if there is none. */
const ddp_setting_decl *ddp_setting_find(const char *name);

/* Value of an INT, BYTES or BOOL setting (bool: 0 or 1), after the policy
 * above. A name that is not declared, or of another kind, is a bug: it
 * prints one line on stderr and returns 0. */
int64_t ddp_setting_int(const char *name);

/* Value of a SECONDS setting (its default parsed when unset or invalid);
 * 0 for an undeclared name or another kind, with one line on stderr. */
double ddp_setting_seconds(const char *name);

/* Value of a STRING setting, or its default text (NULL when the default is
 * "unset"); an empty value counts as unset. The string stays valid until
 * ddp_settings_reload. NULL for an undeclared name or another kind. */
const char *ddp_setting_str(const char *name);

/* Forget every parsed value, so the next read sees the environment again
 * (and warns again). For tests; not safe while other threads still use a
 * string returned by ddp_setting_str. */
void ddp_settings_reload(void);

/* Parse text as a setting of decl's kind, without caching or warnings:
 * 1 and *out (bytes/int/bool) or *secs (seconds) if valid and inside the
 * bounds; 2 if valid but clamped to a bound (*out or *secs is the bound);
 * 0 if it does not parse. Exposed for the parser's tests. */
int ddp_setting_parse(const ddp_setting_decl *decl, const char *text, int64_t *out,
                      double *secs);

#endif
