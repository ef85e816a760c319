/* Per-job tokens (--tokens-file), checked by agents and the coordinator alike. */
#ifndef PS_AUTH_H
#define PS_AUTH_H

#include "rpc/rpc.h"

typedef struct ps__tokens ps__tokens_t;

/** Reads 'JOB TOKEN' lines ('#' comments; '*' as JOB for any other job).
 * 0 with *out set, or PS_EINVAL (unreadable, empty) / PS_ENOMEM. Tokens are
 * never logged. */
int ps__tokens_load(const char *path, ps__tokens_t **out);

/** Frees the table. Accepts NULL. */
void ps__tokens_free(ps__tokens_t *t);

/** The token job must show (its own line, else '*'), or NULL. */
const char *ps__tokens_for(const ps__tokens_t *t, const char *job);

/** 0 when call carries "authorization: Bearer <job's token>" or tokens is
 * NULL (no authentication); otherwise ends the call with UNAUTHENTICATED —
 * the same answer whether or not the job exists — and returns -1. */
int ps__auth_check(const ps__tokens_t *tokens, ps__rpc_call_t *call, const char *job);

#endif
