/* ofl: the table of every OFL_* variable (name, default, kind, doc), parsed
 * once from the environment. A params struct field set by the application
 * wins over the variable; the variable wins over the default. */
#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "runtime/internal.h"

extern char **environ;

typedef enum { K_STR, K_BOOL, K_INT, K_SIZE, K_DOUBLE, K_ENUM } kind_t;

typedef struct {
  const char *name;
  const char *def;
  kind_t kind;
  const char *words; /* K_ENUM: allowed values, '|'-separated */
  const char *doc;
} entry_t;

/* Every OFL_* variable the library reads. README.md lists the same. */
static const entry_t table[] = {
    /* runtime */
    {"OFL_BACKEND", "auto", K_ENUM, "auto|host|cuda",
     "device backend; auto picks cuda when a GPU is present"},
    {"OFL_DEBUG", "WARN", K_ENUM, "NONE|WARN|INFO|TRACE|VERSION", "log level"},
    {"OFL_DEBUG_SUBSYS", "ALL", K_STR, NULL,
     "subsystems to log: INIT,DEVICE,POOL,PIPELINE,DISK,STAGING,COLL,CONFIG or "
     "ALL; ^ excludes"},
    {"OFL_DEBUG_RANK", "", K_STR, NULL,
     "log only on this rank (empty: all ranks)"},
    {"OFL_DEBUG_FILE", "", K_STR, NULL,
     "log file instead of stderr; %h host, %p pid, %r rank"},
    {"OFL_WAIT_TIMEOUT_MS", "120000", K_INT, NULL,
     "timeout of every wait that is not given one, in ms"},
    {"OFL_TRACE_FILE", "", K_STR, NULL,
     "write a Chrome trace (JSON) of streams, copies and waits here at device "
     "close; %p pid, %r rank"},
    {"OFL_DEVICE", "", K_STR, NULL,
     "cuda device of a device opened without an index: an ordinal, or local "
     "(the launcher's local rank modulo the device count); empty: the "
     "calling thread's current device"},
    {"OFL_DEVICE_CAPACITY", "0", K_SIZE, NULL,
     "host backend: device memory capacity (0: unlimited)"},
    {"OFL_STRICT", "0", K_BOOL, NULL,
     "host backend: poison freed blocks, jitter worker streams, report frees "
     "of in-flight blocks"},
    {"OFL_JITTER_SEED", "1", K_INT, NULL,
     "host backend strict mode: seed of the stream jitter"},
    {"OFL_JITTER_MAX_US", "200", K_INT, NULL,
     "host backend strict mode: largest jitter per operation, in microseconds"},
    {"OFL_HOST_SPIN_US", "20", K_INT, NULL,
     "host backend: microseconds a worker stream polls for more work before it "
     "sleeps (0: sleep at once)"},
    {"OFL_LINK_H2D_GBPS", "0", K_DOUBLE, NULL,
     "host backend link model: H2D GB/s (0: unlimited)"},
    {"OFL_LINK_D2H_GBPS", "0", K_DOUBLE, NULL,
     "host backend link model: D2H GB/s (0: unlimited)"},
    {"OFL_LINK_TOTAL_GBPS", "0", K_DOUBLE, NULL,
     "host backend link model: both directions together, GB/s (0: their sum)"},
    /* pools */
    {"OFL_HOST_BUDGET", "0", K_SIZE, NULL,
     "pinned host pool byte budget (0: unlimited)"},
    {"OFL_DEVICE_POOL_BUDGET", "0", K_SIZE, NULL,
     "device pool byte budget (0: unlimited)"},
    /* pipeline */
    {"OFL_OFFLOAD", "1", K_BOOL, NULL,
     "master switch of activation offloading"},
    {"OFL_OFFLOAD_GROUPS", "", K_STR, NULL,
     "comma-separated group names to offload (empty: all)"},
    {"OFL_MIN_OFFLOAD_ELEMS", "1048576", K_INT, NULL,
     "smallest tensor offloaded, in elements"},
    {"OFL_MIN_OFFLOAD_BYTES", "0", K_SIZE, NULL,
     "smallest tensor offloaded, in bytes (0: use OFL_MIN_OFFLOAD_ELEMS)"},
    {"OFL_OFFLOAD_FRACTION", "1.0", K_DOUBLE, NULL,
     "fraction of groups of each name offloaded after warmup"},
    {"OFL_RANK_DELTA_BYTES", "0", K_SIZE, NULL,
     "per pipeline rank, bytes fewer offloaded than the rank before"},
    {"OFL_PREFETCH_GROUPS", "1", K_INT, NULL,
     "groups whose reloads are issued ahead of the backward pass (each holds "
     "its device buffers until its backward), 1..64"},
    {"OFL_MAX_INFLIGHT", "0", K_INT, NULL,
     "max offloads in flight per group name (0: unlimited)"},
    /* disk tier */
    {"OFL_DISK_DIR", "", K_STR, NULL,
     "directory of the disk tier file (empty: TMPDIR or /tmp); a comma "
     "list spreads the ranks of a node over several disks"},
    {"OFL_DISK_GROUPS", "", K_STR, NULL,
     "group names placed on disk rather than in host memory"},
    {"OFL_DISK_BUDGET", "0", K_SIZE, NULL,
     "disk tier byte budget (0: disk tier off unless groups are named)"},
    {"OFL_DISK_BOUNCE_BUDGET", "0", K_SIZE, NULL,
     "pinned bytes for the disk tier's bounce buffers (0: no cap); a full "
     "pool makes the tier refuse, and the data stays where it is"},
    {"OFL_DISK_KEEP", "256M", K_SIZE, NULL,
     "bounce buffers the disk tier keeps after their write, so that reloads "
     "of recent extents need no read (capped at OFL_DISK_BOUNCE_BUDGET; 0: "
     "none)"},
    {"OFL_DISK_QUEUE_DEPTH", "8", K_INT, NULL, "io_uring queue depth"},
    {"OFL_DISK_BLOCK", "4M", K_SIZE, NULL, "disk I/O block size"},
    {"OFL_DISK_PREFETCH", "2", K_INT, NULL,
     "groups read ahead of the backward pass"},
    {"OFL_DISK_CHECKSUM", "0", K_BOOL, NULL,
     "CRC32C per extent, verified on read"},
    {"OFL_DISK_DIRECT", "auto", K_ENUM, "auto|on|off",
     "O_DIRECT on the disk file"},
    /* staging */
    {"OFL_STAGING_MAX_INFLIGHT", "1", K_INT, NULL,
     "checkpoint saves in flight per stager"},
};

#define N_ENTRIES (sizeof table / sizeof table[0])

static pthread_mutex_t config_lock = PTHREAD_MUTEX_INITIALIZER;
static bool loaded;
static char *values[N_ENTRIES];
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
  for (size_t i = 0; i < N_ENTRIES; i++)
    if (strcmp(table[i].name, name) == 0) {
      if (index)
        *index = i;
      return &table[i];
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

static bool parse_int(const char *s, int64_t *out) {
  char *end = NULL;
  errno = 0;
  long long v = strtoll(s, &end, 0);
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
  double v = strtod(s, &end);
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

static const char *kind_hint(const entry_t *e) {
  switch (e->kind) {
  case K_BOOL:
    return "1/0, yes/no, on/off, true/false";
  case K_INT:
    return "an integer";
  case K_SIZE:
    return "a byte count with an optional K, M, G or T suffix";
  case K_DOUBLE:
    return "a non-negative number";
  case K_ENUM:
    return e->words;
  default:
    return "any text";
  }
}

/* Checks one value against its kind; false when invalid. */
static bool valid(const entry_t *e, const char *s) {
  bool b;
  int64_t i;
  size_t z;
  double d;
  switch (e->kind) {
  case K_BOOL:
    return parse_bool(s, &b);
  case K_INT:
    return parse_int(s, &i);
  case K_SIZE:
    return parse_size(s, &z);
  case K_DOUBLE:
    return parse_double(s, &d);
  case K_ENUM:
    return enum_index(e->words, s) >= 0;
  default:
    return true;
  }
}

static ofl_status_t load_locked(void) {
  ofl_status_t st = OFL_SUCCESS;
  for (size_t i = 0; i < N_ENTRIES; i++) {
    const char *env = getenv(table[i].name);
    const char *want = env != NULL ? env : table[i].def;
    if (values[i] == NULL || strcmp(values[i], want) != 0) {
      char *v = strdup(want);
      if (v != NULL) {
        retire(values[i]);
        values[i] = v;
      }
    }
    if (env != NULL && !valid(&table[i], env) && st == OFL_SUCCESS)
      st = ofl__error(OFL_ERR_CONFIG, OFL_SUBSYS_CONFIG,
                      "%s='%s' is invalid; it takes %s (default '%s')",
                      table[i].name, env, kind_hint(&table[i]), table[i].def);
  }
  if (!warned_unknown) {
    warned_unknown = true;
    for (char **e = environ; e != NULL && *e != NULL; e++) {
      if (strncmp(*e, "OFL_", 4) != 0)
        continue;
      char name[128];
      size_t len = strcspn(*e, "=");
      if (len >= sizeof name)
        len = sizeof name - 1;
      memcpy(name, *e, len);
      name[len] = '\0';
      /* OFL_BUILD_DIR belongs to ofl.sh, OFL_BENCH_* and OFL_DEMO_* to the
       * benches and the demo, not to the library. */
      if (find(name, NULL) == NULL && strcmp(name, "OFL_BUILD_DIR") != 0 &&
          strncmp(name, "OFL_BENCH_", 10) != 0 &&
          strncmp(name, "OFL_DEMO_", 9) != 0)
        OFL_WARN(OFL_SUBSYS_CONFIG,
                 "unknown variable %s is ignored; ofl_config_print() lists "
                 "the known ones",
                 name);
    }
  }
  loaded = true;
  return st;
}

ofl_status_t ofl_config_reload(void) {
  pthread_mutex_lock(&config_lock);
  ofl_status_t st = load_locked();
  pthread_mutex_unlock(&config_lock);
  ofl_log_reload();
  return st;
}

/* Copies the value in force into buf (values may be replaced by reload). */
static ofl_status_t value_of(const char *name, const entry_t **entry, char *buf,
                             size_t cap) {
  size_t idx = 0;
  const entry_t *e = find(name, &idx);
  if (e == NULL)
    return ofl__error(OFL_ERR_INTERNAL, OFL_SUBSYS_CONFIG,
                      "configuration variable %s is not in the table", name);
  pthread_mutex_lock(&config_lock);
  if (!loaded)
    load_locked();
  snprintf(buf, cap, "%s", values[idx] ? values[idx] : table[idx].def);
  pthread_mutex_unlock(&config_lock);
  *entry = e;
  return OFL_SUCCESS;
}

static ofl_status_t invalid(const entry_t *e, const char *s) {
  return ofl__error(OFL_ERR_CONFIG, OFL_SUBSYS_CONFIG,
                    "%s='%s' is invalid; it takes %s (default '%s')", e->name,
                    s, kind_hint(e), e->def);
}

const char *ofl_config_get(const char *name) {
  size_t idx = 0;
  if (name == NULL || find(name, &idx) == NULL)
    return NULL;
  pthread_mutex_lock(&config_lock);
  if (!loaded)
    load_locked();
  const char *v = values[idx] ? values[idx] : table[idx].def;
  pthread_mutex_unlock(&config_lock);
  return v;
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
  const char *v = ofl_config_get(name);
  if (v == NULL)
    return ofl__error(OFL_ERR_INTERNAL, OFL_SUBSYS_CONFIG,
                      "configuration variable %s is not in the table", name);
  *out = v;
  return OFL_SUCCESS;
}

#define TYPED_GETTER(fn, type, parser)                                         \
  ofl_status_t fn(const char *name, type *out) {                               \
    const entry_t *e = NULL;                                                   \
    char buf[512];                                                             \
    OFL_CHECK(value_of(name, &e, buf, sizeof buf));                            \
    type v;                                                                    \
    if (!parser(buf, &v))                                                      \
      return invalid(e, buf);                                                  \
    *out = v;                                                                  \
    return OFL_SUCCESS;                                                        \
  }

TYPED_GETTER(ofl__config_bool, bool, parse_bool)
TYPED_GETTER(ofl__config_int, int64_t, parse_int)
TYPED_GETTER(ofl__config_size, size_t, parse_size)
TYPED_GETTER(ofl__config_double, double, parse_double)

ofl_status_t ofl__config_enum(const char *name, int *out) {
  const entry_t *e = NULL;
  char buf[512];
  OFL_CHECK(value_of(name, &e, buf, sizeof buf));
  int idx = e->kind == K_ENUM ? enum_index(e->words, buf) : -1;
  if (idx < 0)
    return invalid(e, buf);
  *out = idx;
  return OFL_SUCCESS;
}

void ofl_config_print(FILE *out) {
  if (out == NULL)
    out = stdout;
  pthread_mutex_lock(&config_lock);
  if (!loaded)
    load_locked();
  for (size_t i = 0; i < N_ENTRIES; i++)
    fprintf(out, "%-26s = %-12s (default %s; %s) %s\n", table[i].name,
            values[i] && values[i][0] ? values[i] : "''",
            table[i].def[0] ? table[i].def : "''", kind_hint(&table[i]),
            table[i].doc);
  pthread_mutex_unlock(&config_lock);
}
