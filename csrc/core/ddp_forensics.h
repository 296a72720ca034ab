/* ddp_forensics.h - the store records of pyddp's forensics, declared once:
 * their keys and their fields.
 *
 * The C worker writes the incident and failure records (ddp_comm_queue.c's
 * stall_announce and failure_announce); pyddp/_forensics.py reads them, and
 * writes the reports and read counts, through the _C constants made from
 * these macros (module.c: FX_KEYS, FX_STUCK_FIELDS, FX_BROKEN_FIELDS and the
 * record formats). Every key is a user key under "/<stall prefix>/", where
 * the stall prefix is the one given to ddp_comm_set_stall_store (the world
 * group's key prefix + "/stall"):
 *
 *   stuck_n                 ADD: incidents (collective timeouts) announced
 *   stuck/<i>               incident i = 1, 2, ...: a STUCK record
 *   stuck/<i>/report/<r>    world rank r's report about incident i (JSON)
 *   stuck/read/<tag>/<seq>  ADD: ranks that read the reports of a collective
 *   broken_n                ADD: failures recorded
 *   broken/<r>              world rank r's failure: a BROKEN record
 *   broken                  the first failure of the world: a BROKEN record
 *
 * A record is "name=value" fields joined by ';', in the order of its field
 * list; the last field, `what` (a message), may itself hold ';' and '='.
 * Values: rank a decimal world rank, tag the group's tag as 16 hex digits,
 * seq the collective's number on that group in decimal. The format strings
 * and the field lists must agree (tests/test_layers.py checks that they do).
 */
#ifndef DDP_FORENSICS_H
#define DDP_FORENSICS_H

/* key names, relative to "/<stall prefix>/" */
#define DDP_FX_STUCK_N "stuck_n"
#define DDP_FX_STUCK "stuck"      /* + "/<i>" */
#define DDP_FX_REPORT "report"    /* "stuck/<i>/" + this + "/<r>" */
#define DDP_FX_READ "read"        /* "stuck/" + this + "/<tag>/<seq>" */
#define DDP_FX_BROKEN_N "broken_n"
#define DDP_FX_BROKEN "broken"    /* alone: the first; + "/<r>": rank r's */

/* STUCK: who timed out (rank), in which group (tag) and collective (seq), and why */
#define DDP_FX_STUCK_FIELDS "rank;tag;seq;what"
#define DDP_FX_STUCK_FORMAT "rank=%d;tag=%016llx;seq=%llu;what=%s"
/* BROKEN: who failed (rank) and why */
#define DDP_FX_BROKEN_FIELDS "rank;what"
#define DDP_FX_BROKEN_FORMAT "rank=%d;what=%s"

#endif
