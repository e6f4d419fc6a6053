/* ofl: the OFL_* variables (the table: runtime/config_table.c), loaded
 * once from the environment, read by type and printed. A params struct
 * field set by the application wins over the variable; the variable wins
 * over the default.
 * Every value is checked when the table is loaded: one invalid value makes
 * every typed read fail with OFL_ERR_CONFIG naming it, so that the first
 * call that reads the configuration (a device open, a manager create) says
 * so, whichever variable it reads itself. */
#include <ctype.h>
#include <errno.h>
#include <float.h>
#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "runtime/config_table.h"
#include "runtime/internal.h"

extern char **environ;

static pthread_mutex_t config_lock = PTHREAD_MUTEX_INITIALIZER;
static bool loaded;
/* Bumped by every load: readers that cache a parsed value compare it. */
static atomic_uint generation;
static char *values[OFL__CONFIG_ENTRIES];
/* The value in force came from the environment; the environment sets the
 * variable to the empty string. */
static bool from_env[OFL__CONFIG_ENTRIES];
static bool empty_env[OFL__CONFIG_ENTRIES];
/* The value last warned about per entry: an invalid value is warned about
 * once (at the load that finds it), not again by every read. */
static char *warned[OFL__CONFIG_ENTRIES];
/* The first invalid entry of the last load (-1: none), and its message. */
static int bad_entry = -1;
static char bad_msg[1024];

/* Values replaced by a reload are kept, not freed: ofl_config_get handed out
 * pointers to them that another thread may still read. Reloads are rare (tests,
 * programs that setenv), so the list stays short. */
typedef struct retired {
  char *value;
  struct retired *next;
} retired_t;
static retired_t *retired;

static void retire(char *value) {
  if (value == NULL)
    return;
  retired_t *r = malloc(sizeof *r);
  if (r == NULL)
    return; /* keeping the string reachable matters more than the node */
  r->value = value;
  r->next = retired;
  retired = r;
}
static bool warned_unknown;

static const entry_t *find(const char *name, size_t *index) {
  for (size_t i = 0; i < OFL__CONFIG_ENTRIES; i++)
    if (strcmp(ofl__config_table[i].name, name) == 0) {
      if (index)
        *index = i;
      return &ofl__config_table[i];
    }
  return NULL;
}

static bool parse_bool(const char *s, bool *out) {
  static const char *yes[] = {"1", "y", "yes", "on", "true"};
  static const char *no[] = {"0", "n", "no", "off", "false"};
  for (size_t i = 0; i < 5; i++) {
    if (strcasecmp(s, yes[i]) == 0) {
      *out = true;
      return true;
    }
    if (strcasecmp(s, no[i]) == 0) {
      *out = false;
      return true;
    }
  }
  return false;
}

/* Decimal only ("010" is ten, not octal eight), an optional '-' and digits,
 * nothing else: strtoll would also take blanks, '+', and 0x or 0 prefixes. */
static bool parse_int(const char *s, int64_t *out) {
  const char *d = s[0] == '-' ? s + 1 : s;
  if (!isdigit((unsigned char)*d))
    return false;
  char *end = NULL;
  errno = 0;
  long long v = strtoll(s, &end, 10);
  if (errno != 0 || end == s || *end != '\0')
    return false;
  *out = v;
  return true;
}

static bool parse_size(const char *s, size_t *out) {
  char *end = NULL;
  errno = 0;
  /* strtoull skips blanks and accepts a sign, and wraps "-1" to the largest
   * value: a size must start with a digit. */
  if (!isdigit((unsigned char)*s))
    return false;
  unsigned long long v = strtoull(s, &end, 10);
  if (errno != 0 || end == s)
    return false;
  unsigned long long mult = 1;
  switch (toupper((unsigned char)*end)) {
  case '\0':
    break;
  case 'K':
    mult = 1ull << 10;
    end++;
    break;
  case 'M':
    mult = 1ull << 20;
    end++;
    break;
  case 'G':
    mult = 1ull << 30;
    end++;
    break;
  case 'T':
    mult = 1ull << 40;
    end++;
    break;
  default:
    return false;
  }
  if (mult > 1 && (*end == 'B' || *end == 'b'))
    end++;
  if (*end != '\0' || (v != 0 && mult > UINT64_MAX / v))
    return false;
  *out = (size_t)(v * mult);
  return true;
}

static bool parse_double(const char *s, double *out) {
  char *end = NULL;
  errno = 0;
  if (isspace((unsigned char)*s))
    return false;
  double v = strtod(s, &end);
  /* ERANGE on underflow too (1e-400): such a value is no rate either. */
  if (errno != 0 || end == s || *end != '\0' || !isfinite(v) || v < 0)
    return false;
  *out = v;
  return true;
}

static int enum_index(const char *words, const char *s) {
  int idx = 0;
  const char *p = words;
  size_t n = strlen(s);
  while (*p != '\0') {
    const char *bar = strchr(p, '|');
    size_t len = bar ? (size_t)(bar - p) : strlen(p);
    if (len == n && strncasecmp(p, s, n) == 0)
      return idx;
    idx++;
    if (bar == NULL)
      break;
    p = bar + 1;
  }
  return -1;
}

static bool int_ranged(const entry_t *e) { return e->lo != 0 || e->hi != 0; }

/* What the entry accepts, in words (for the error message). */
static const char *kind_hint(const entry_t *e, char *buf, size_t cap) {
  if (e->hint != NULL)
    return e->hint;
  switch (e->kind) {
  case K_BOOL:
    return "1/0, yes/no, on/off, true/false";
  case K_INT:
    if (!int_ranged(e))
      return "a decimal integer";
    snprintf(buf, cap, "a decimal integer in %" PRId64 "..%" PRId64, e->lo,
             e->hi);
    return buf;
  case K_SIZE:
    if (e->hi == 0)
      return "a byte count with an optional K, M, G or T suffix";
    snprintf(buf, cap,
             "a byte count of %" PRId64 " to %" PRId64
             " with an optional K, M, G or T suffix",
             e->lo, e->hi);
    return buf;
  case K_DOUBLE:
    if (e->dhi == 0)
      return "a non-negative number";
    snprintf(buf, cap, "a number in [%g, %g]", e->dlo, e->dhi);
    return buf;
  case K_ENUM:
    return e->words;
  default:
    return "any text";
  }
}

/* Checks one value against its kind and range; false when invalid. */
static bool valid(const entry_t *e, const char *s) {
  bool b;
  int64_t i;
  size_t z;
  double d;
  switch (e->kind) {
  case K_BOOL:
    return parse_bool(s, &b);
  case K_INT:
    return parse_int(s, &i) && (!int_ranged(e) || (i >= e->lo && i <= e->hi));
  case K_SIZE:
    return parse_size(s, &z) && z >= (uint64_t)e->lo &&
           (e->hi == 0 || z <= (uint64_t)e->hi);
  case K_DOUBLE:
    return parse_double(s, &d) && d >= e->dlo && (e->dhi == 0 || d <= e->dhi) &&
           (e->check == NULL || e->check(s));
  case K_ENUM:
    return enum_index(e->words, s) >= 0;
  default:
    return e->check == NULL || e->check(s);
  }
}

static void format_invalid(const entry_t *e, const char *s, char *msg,
                           size_t cap) {
  char hint[160];
  snprintf(msg, cap, "%s='%.200s%s' is invalid; it takes %s (default '%s')",
           e->name, s, strlen(s) > 200 ? "..." : "",
           kind_hint(e, hint, sizeof hint), e->def);
}

/* OFL_* names that belong to the tools around the library, not to it:
 * ofl.sh (OFL_BUILD_DIR, OFL_NO_TORCH_INSTALL), the Python package (which
 * libofl it loads, whether its hooks run in C and import through DLPack,
 * the library it bundles at build time), its tests (OFL_EXPECT_EXT,
 * OFL_TEST_*, OFL_STAGER_UNDER_TEST), ./ofl.sh soak's draws and sweeps
 * (OFL_SOAK_*, OFL_SWEEP_*), the benches and the demo. */
static bool foreign_name(const char *name) {
  static const char *const names[] = {
      "OFL_BUILD_DIR",      "OFL_NO_TORCH_INSTALL", "OFL_LIBRARY",
      "OFL_PYTHON_EXT",     "OFL_EXT_DLPACK",       "OFL_BUNDLE_LIBRARY",
      "OFL_EXPECT_EXT",     "OFL_STAGER_UNDER_TEST"};
  static const char *const prefixes[] = {"OFL_BENCH_", "OFL_DEMO_",
                                         "OFL_TEST_",  "OFL_SOAK_",
                                         "OFL_SWEEP_"};
  for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
    if (strcmp(name, names[i]) == 0)
      return true;
  for (size_t i = 0; i < sizeof prefixes / sizeof prefixes[0]; i++)
    if (strncmp(name, prefixes[i], strlen(prefixes[i])) == 0)
      return true;
  return false;
}

/* The name of an environment entry ("NAME=value") when it is an OFL_*
 * variable neither the library nor its tools know. */
static bool unknown_name(const char *entry, char *name, size_t cap) {
  if (strncmp(entry, "OFL_", 4) != 0)
    return false;
  size_t len = strcspn(entry, "=");
  if (len >= cap)
    len = cap - 1;
  memcpy(name, entry, len);
  name[len] = '\0';
  return find(name, NULL) == NULL && !foreign_name(name);
}

/* Levenshtein distance, case-insensitive; names are under 64 characters
 * (longer ones are cut: they are no near miss anyway). Also the pipeline's
 * did-you-mean for group names. */
size_t ofl__edit_distance(const char *a, const char *b) {
  enum { MAXLEN = 64 };
  size_t la = strlen(a) < MAXLEN ? strlen(a) : MAXLEN;
  size_t lb = strlen(b) < MAXLEN ? strlen(b) : MAXLEN;
  size_t row[MAXLEN + 1];
  for (size_t j = 0; j <= lb; j++)
    row[j] = j;
  for (size_t i = 1; i <= la; i++) {
    size_t diag = row[0];
    row[0] = i;
    for (size_t j = 1; j <= lb; j++) {
      size_t up = row[j];
      size_t cost = toupper((unsigned char)a[i - 1]) ==
                            toupper((unsigned char)b[j - 1])
                        ? 0
                        : 1;
      size_t best = diag + cost;
      if (row[j] + 1 < best)
        best = row[j] + 1;
      if (row[j - 1] + 1 < best)
        best = row[j - 1] + 1;
      row[j] = best;
      diag = up;
    }
  }
  return row[lb];
}

/* " (did you mean OFL_X?)" for the known name closest to an unknown one,
 * when it is a near miss (a third of the name's length after OFL_ or less,
 * at least 2 edits allowed); "" otherwise. */
static const char *did_you_mean(const char *name, char *buf, size_t cap) {
  size_t best = SIZE_MAX;
  const char *closest = NULL;
  for (size_t i = 0; i < OFL__CONFIG_ENTRIES; i++) {
    size_t d = ofl__edit_distance(name, ofl__config_table[i].name);
    if (d < best) {
      best = d;
      closest = ofl__config_table[i].name;
    }
  }
  size_t allowed = (strlen(name) > 4 ? strlen(name) - 4 : 0) / 3;
  if (allowed < 2)
    allowed = 2;
  if (closest == NULL || best > allowed)
    return "";
  snprintf(buf, cap, " (did you mean %s?)", closest);
  return buf;
}

/* The environment's value of a variable, NULL when it is unset or empty: an
 * empty value (NAME=, as a launcher's template leaves it) is the default,
 * for every variable (the loaders of the log and the libraries, which read
 * their variables themselves, treat it the same way). */
static const char *env_value(const entry_t *e) {
  const char *env = getenv(e->name);
  return env != NULL && env[0] != '\0' ? env : NULL;
}

static ofl_status_t load_locked(void) {
  bad_entry = -1;
  bad_msg[0] = '\0';
  for (size_t i = 0; i < OFL__CONFIG_ENTRIES; i++) {
    const char *env = env_value(&ofl__config_table[i]);
    const char *want = env != NULL ? env : ofl__config_table[i].def;
    if (values[i] == NULL || strcmp(values[i], want) != 0) {
      char *v = strdup(want);
      if (v != NULL) {
        retire(values[i]);
        values[i] = v;
      }
    }
    from_env[i] = env != NULL;
    empty_env[i] = env == NULL && getenv(ofl__config_table[i].name) != NULL;
    if (env == NULL || valid(&ofl__config_table[i], env))
      continue;
    char msg[1024];
    format_invalid(&ofl__config_table[i], env, msg, sizeof msg);
    if (bad_entry < 0) {
      bad_entry = (int)i;
      snprintf(bad_msg, sizeof bad_msg, "%s", msg);
    }
    /* Warned once per value: the reads that fail on it stay quiet. */
    if (warned[i] == NULL || strcmp(warned[i], env) != 0) {
      free(warned[i]);
      warned[i] = strdup(env);
      OFL_WARN(OFL_SUBSYS_CONFIG, "%s: %s", ofl_status_str(OFL_ERR_CONFIG),
               msg);
    }
  }
  if (!warned_unknown) {
    warned_unknown = true;
    for (char **e = environ; e != NULL && *e != NULL; e++) {
      char name[128];
      if (!unknown_name(*e, name, sizeof name))
        continue;
      char hint[192];
      OFL_WARN(OFL_SUBSYS_CONFIG,
               "unknown variable %s is ignored%s; `ofl-info` lists the known "
               "ones (and fails while one is unknown)",
               name, did_you_mean(name, hint, sizeof hint));
    }
  }
  loaded = true;
  atomic_fetch_add(&generation, 1);
  if (bad_entry >= 0)
    return ofl__error_quiet(OFL_ERR_CONFIG, "%s", bad_msg);
  return OFL_SUCCESS;
}

unsigned ofl__config_generation(void) { return atomic_load(&generation); }

ofl_status_t ofl_config_reload(void) {
  pthread_mutex_lock(&config_lock);
  ofl_status_t st = load_locked();
  pthread_mutex_unlock(&config_lock);
  /* The logger reads OFL_DEBUG* itself (it may not call back in here: the
   * load above logs under config_lock). */
  ofl_log_reload();
  if (st != OFL_SUCCESS)
    ofl__error_quiet(st, "%s", bad_msg); /* the log reload may log */
  return st;
}

/* The value in force (values replaced by a reload are kept, so the pointer
 * stays valid), and the load's verdict on the whole table: a read fails
 * while any variable is invalid, with the message naming that variable. */
static ofl_status_t value_of(const char *name, const entry_t **entry,
                             const char **value) {
  size_t idx = 0;
  const entry_t *e = find(name, &idx);
  if (e == NULL)
    return ofl__error(OFL_ERR_INTERNAL, OFL_SUBSYS_CONFIG,
                      "configuration variable %s is not in the table", name);
  pthread_mutex_lock(&config_lock);
  if (!loaded)
    load_locked();
  const char *v = values[idx] ? values[idx] : ofl__config_table[idx].def;
  int bad = bad_entry;
  char msg[1024];
  if (bad >= 0)
    snprintf(msg, sizeof msg, "%s", bad_msg);
  pthread_mutex_unlock(&config_lock);
  if (bad >= 0)
    return ofl__error_quiet(OFL_ERR_CONFIG, "%s", msg);
  *entry = e;
  *value = v;
  return OFL_SUCCESS;
}

/* A value that the load accepted but the getter's kind does not take (a
 * caller reading an entry with the wrong getter). */
static ofl_status_t invalid(const entry_t *e, const char *s) {
  char msg[1024];
  format_invalid(e, s, msg, sizeof msg);
  return ofl__error(OFL_ERR_CONFIG, OFL_SUBSYS_CONFIG, "%s", msg);
}

const char *ofl_config_get(const char *name) {
  size_t idx = 0;
  if (name == NULL || find(name, &idx) == NULL)
    return NULL;
  pthread_mutex_lock(&config_lock);
  if (!loaded)
    load_locked();
  const char *v = values[idx] ? values[idx] : ofl__config_table[idx].def;
  pthread_mutex_unlock(&config_lock);
  return v;
}

const char *ofl__config_source(const char *name) {
  size_t idx = 0;
  if (name == NULL || find(name, &idx) == NULL)
    return "default";
  pthread_mutex_lock(&config_lock);
  if (!loaded)
    load_locked();
  bool env = from_env[idx], empty = empty_env[idx];
  pthread_mutex_unlock(&config_lock);
  return env ? "environment" : empty ? "default, empty in the environment"
                                     : "default";
}

void ofl__config_print_value(FILE *f, const char *name, const char *value,
                             const char *source) {
  if (f == NULL)
    f = stdout;
  fprintf(f, "%-26s = %-12s (%s)\n", name,
          value != NULL && value[0] != '\0' ? value : "''",
          source != NULL ? source : "default");
}

int ofl__local_rank(int fallback) {
  static const char *const vars[] = {"OMPI_COMM_WORLD_LOCAL_RANK",
                                     "MPI_LOCALRANKID", "SLURM_LOCALID",
                                     "LOCAL_RANK"};
  for (size_t i = 0; i < sizeof vars / sizeof vars[0]; i++) {
    const char *v = getenv(vars[i]);
    char *end = NULL;
    long r = v != NULL && v[0] != '\0' ? strtol(v, &end, 10) : -1;
    if (end != NULL && *end == '\0' && r >= 0 && r < (1L << 30))
      return (int)r;
  }
  return fallback > 0 ? fallback : 0;
}

ofl_status_t ofl__config_str(const char *name, const char **out) {
  const entry_t *e = NULL;
  const char *v = NULL;
  OFL_CHECK(value_of(name, &e, &v));
  *out = v;
  return OFL_SUCCESS;
}

/* The load checked kind and range; the getter parses again (and refuses a
 * value of another kind: a read through the wrong getter). */
#define TYPED_GETTER(fn, type, parser)                                         \
  ofl_status_t fn(const char *name, type *out) {                               \
    const entry_t *e = NULL;                                                   \
    const char *s = NULL;                                                      \
    OFL_CHECK(value_of(name, &e, &s));                                         \
    type v;                                                                    \
    if (!parser(s, &v) || !valid(e, s))                                        \
      return invalid(e, s);                                                    \
    *out = v;                                                                  \
    return OFL_SUCCESS;                                                        \
  }

TYPED_GETTER(ofl__config_bool, bool, parse_bool)
TYPED_GETTER(ofl__config_int, int64_t, parse_int)
TYPED_GETTER(ofl__config_size, size_t, parse_size)
TYPED_GETTER(ofl__config_double, double, parse_double)

ofl_status_t ofl__config_enum(const char *name, int *out) {
  const entry_t *e = NULL;
  const char *s = NULL;
  OFL_CHECK(value_of(name, &e, &s));
  int idx = e->kind == K_ENUM ? enum_index(e->words, s) : -1;
  if (idx < 0)
    return invalid(e, s);
  *out = idx;
  return OFL_SUCCESS;
}

size_t ofl_config_check(FILE *out) {
  size_t problems = 0;
  pthread_mutex_lock(&config_lock);
  load_locked();
  for (size_t i = 0; i < OFL__CONFIG_ENTRIES; i++) {
    const char *env = env_value(&ofl__config_table[i]);
    if (env == NULL || valid(&ofl__config_table[i], env))
      continue;
    char msg[1024];
    format_invalid(&ofl__config_table[i], env, msg, sizeof msg);
    if (out != NULL)
      fprintf(out, "%s\n", msg);
    problems++;
  }
  for (char **e = environ; e != NULL && *e != NULL; e++) {
    char name[128], hint[192];
    if (!unknown_name(*e, name, sizeof name))
      continue;
    if (out != NULL)
      fprintf(out, "unknown variable %s%s\n", name,
              did_you_mean(name, hint, sizeof hint));
    problems++;
  }
  pthread_mutex_unlock(&config_lock);
  return problems;
}

/* Each variable with the value in force for the library (the environment's
 * or the default) and where it came from; a params field set by the
 * application wins over both (ofl_manager_config_print shows those). */
void ofl_config_print(FILE *out) {
  if (out == NULL)
    out = stdout;
  pthread_mutex_lock(&config_lock);
  if (!loaded)
    load_locked();
  for (size_t i = 0; i < OFL__CONFIG_ENTRIES; i++) {
    char hint[160];
    const char *v = values[i] ? values[i] : ofl__config_table[i].def;
    bool bad = from_env[i] && !valid(&ofl__config_table[i], v);
    fprintf(out, "%-26s = %-12s (%s%s; default %s; takes %s) %s\n",
            ofl__config_table[i].name, v[0] ? v : "''",
            from_env[i]    ? "environment"
            : empty_env[i] ? "default, empty in the environment"
                           : "default",
            bad ? ", INVALID" : "",
            ofl__config_table[i].def[0] ? ofl__config_table[i].def : "''",
            kind_hint(&ofl__config_table[i], hint, sizeof hint), ofl__config_table[i].doc);
  }
  pthread_mutex_unlock(&config_lock);
}
