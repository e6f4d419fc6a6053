/* ofl: logging. OFL_DEBUG=WARN|INFO|TRACE|NONE, OFL_DEBUG_SUBSYS=INIT,POOL,...
 * (ALL, or ^NAME to exclude), OFL_DEBUG_RANK=N (only that rank), and
 * OFL_DEBUG_FILE=path with %h host, %p pid, %r rank. */
#include <errno.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

#include "runtime/internal.h"

_Atomic int ofl__log_level_cache = -1;
_Atomic unsigned ofl__log_subsys_mask = OFL_SUBSYS_ALL;

static pthread_mutex_t log_lock = PTHREAD_MUTEX_INITIALIZER;
static ofl_log_handler_fn handler;
static void *handler_user;
static int log_rank = -1;
static int only_rank = -1;
static int level_override = -1;
static FILE *log_file;
static char *file_pattern; /* OFL_DEBUG_FILE, whole (NULL: stderr) */
static int file_rank = -2; /* rank the open file was named for */
static bool file_failed;   /* the file for file_rank could not be opened */

static const struct {
  const char *name;
  unsigned bit;
} subsys_names[] = {
    {"INIT", OFL_SUBSYS_INIT}, {"DEVICE", OFL_SUBSYS_DEVICE},
    {"POOL", OFL_SUBSYS_POOL}, {"PIPELINE", OFL_SUBSYS_PIPELINE},
    {"DISK", OFL_SUBSYS_DISK}, {"STAGING", OFL_SUBSYS_STAGING},
    {"COLL", OFL_SUBSYS_COLL}, {"CONFIG", OFL_SUBSYS_CONFIG},
    {"ALL", OFL_SUBSYS_ALL},
};

static const char *subsys_name(unsigned subsys) {
  for (size_t i = 0; i < sizeof subsys_names / sizeof subsys_names[0]; i++)
    if (subsys_names[i].bit == subsys)
      return subsys_names[i].name;
  return "OFL";
}

/* An invalid OFL_DEBUG* value is an OFL_ERR_CONFIG error of the first
 * configuration read (runtime/config.c warns about it once); until it is
 * fixed the logger falls back to what shows that warning: WARN, every
 * subsystem, every rank. */
static int parse_level(const char *s) {
  if (s == NULL)
    return OFL_LOG_WARN;
  if (strcasecmp(s, "NONE") == 0)
    return OFL_LOG_NONE;
  if (strcasecmp(s, "WARN") == 0 || strcasecmp(s, "VERSION") == 0)
    return OFL_LOG_WARN;
  if (strcasecmp(s, "INFO") == 0)
    return OFL_LOG_INFO;
  if (strcasecmp(s, "TRACE") == 0)
    return OFL_LOG_TRACE;
  return OFL_LOG_WARN;
}

bool ofl__log_parse_subsys(const char *s, unsigned *mask_out) {
  if (s == NULL || *s == '\0') {
    *mask_out = OFL_SUBSYS_ALL;
    return true;
  }
  bool exclude = s[0] == '^';
  unsigned mask = 0;
  const char *p = exclude ? s + 1 : s;
  while (*p != '\0') {
    size_t len = strcspn(p, ",");
    bool known = len == 0; /* an empty item ("A,,B", "A,") names nothing */
    for (size_t i = 0;
         !known && i < sizeof subsys_names / sizeof subsys_names[0]; i++)
      if (strlen(subsys_names[i].name) == len &&
          strncasecmp(p, subsys_names[i].name, len) == 0) {
        mask |= subsys_names[i].bit;
        known = true;
      }
    if (!known)
      return false; /* a typo must not silence every warning */
    p += len;
    if (*p == ',')
      p++;
  }
  *mask_out = exclude ? (OFL_SUBSYS_ALL & ~mask) : mask;
  return true;
}

bool ofl__log_parse_rank(const char *s, int *rank) {
  if (s == NULL || *s == '\0') {
    *rank = -1;
    return true;
  }
  long v = 0;
  for (const char *p = s; *p != '\0'; p++) {
    if (*p < '0' || *p > '9' || v >= (1L << 30) / 10)
      return false; /* atoi made "abc" rank 0 */
    v = v * 10 + (*p - '0');
  }
  *rank = (int)v;
  return true;
}

static unsigned parse_subsys(const char *s) {
  unsigned mask = OFL_SUBSYS_ALL;
  return ofl__log_parse_subsys(s, &mask) ? mask : OFL_SUBSYS_ALL;
}

static void close_file_locked(void) {
  if (log_file != NULL)
    fclose(log_file);
  log_file = NULL;
  file_rank = -2;
  file_failed = false;
}

void ofl_log_reload(void) {
  const char *rank = getenv("OFL_DEBUG_RANK");
  const char *file = getenv("OFL_DEBUG_FILE");
  int r = -1;
  if (!ofl__log_parse_rank(rank, &r))
    r = -1;
  char *pattern = file != NULL && *file != '\0' ? strdup(file) : NULL;
  pthread_mutex_lock(&log_lock);
  only_rank = r;
  close_file_locked();
  free(file_pattern);
  file_pattern = pattern;
  atomic_store(&ofl__log_subsys_mask, parse_subsys(getenv("OFL_DEBUG_SUBSYS")));
  int level =
      level_override >= 0 ? level_override : parse_level(getenv("OFL_DEBUG"));
  pthread_mutex_unlock(&log_lock);
  atomic_store(&ofl__log_level_cache, level);
}

static pthread_once_t log_once = PTHREAD_ONCE_INIT;
static void log_init_once(void) {
  if (atomic_load(&ofl__log_level_cache) < 0)
    ofl_log_reload();
}
void ofl__log_init(void) { pthread_once(&log_once, log_init_once); }

void ofl_log_set_level(ofl_log_level_t level) {
  ofl__log_init();
  pthread_mutex_lock(&log_lock);
  level_override = (int)level;
  pthread_mutex_unlock(&log_lock);
  atomic_store(&ofl__log_level_cache, (int)level);
}

ofl_log_level_t ofl_log_get_level(void) {
  ofl__log_init();
  return (ofl_log_level_t)atomic_load(&ofl__log_level_cache);
}

void ofl_log_set_rank(int rank) {
  pthread_mutex_lock(&log_lock);
  log_rank = rank;
  pthread_mutex_unlock(&log_lock);
}

int ofl_log_get_rank(void) {
  pthread_mutex_lock(&log_lock);
  int r = log_rank;
  pthread_mutex_unlock(&log_lock);
  return r;
}

ofl_log_handler_fn ofl_log_set_handler(ofl_log_handler_fn fn, void *user) {
  pthread_mutex_lock(&log_lock);
  ofl_log_handler_fn old = handler;
  handler = fn;
  handler_user = user;
  pthread_mutex_unlock(&log_lock);
  return old;
}

/* Expands %h, %p and %r of OFL_DEBUG_FILE. */
static void expand_pattern(char *out, size_t cap, int rank) {
  size_t n = 0;
  for (const char *p = file_pattern != NULL ? file_pattern : "";
       *p != '\0' && n + 1 < cap; p++) {
    char piece[256];
    piece[0] = '\0';
    if (p[0] == '%' && p[1] == 'h') {
      gethostname(piece, sizeof piece);
      piece[sizeof piece - 1] = '\0';
      p++;
    } else if (p[0] == '%' && p[1] == 'p') {
      snprintf(piece, sizeof piece, "%ld", (long)getpid());
      p++;
    } else if (p[0] == '%' && p[1] == 'r') {
      snprintf(piece, sizeof piece, "%d", rank);
      p++;
    } else {
      piece[0] = *p;
      piece[1] = '\0';
    }
    int w = snprintf(out + n, cap - n, "%s", piece);
    n += w > 0 ? (size_t)w : 0;
    if (n >= cap)
      n = cap - 1;
  }
  out[n] = '\0';
}

/* The file OFL_DEBUG_FILE names for the rank in force, else stderr. A file
 * that cannot be opened is said once (per reload and rank) on stderr, with
 * its errno, as OFL_TRACE_FILE's is: a log that silently went elsewhere
 * looks like a run that logged nothing. The line is written here, under
 * log_lock, in the format of ofl__log's lines. */
static FILE *sink_locked(void) {
  if (file_pattern == NULL)
    return stderr;
  if (file_failed && file_rank == log_rank)
    return stderr;
  if (log_file == NULL || file_rank != log_rank) {
    close_file_locked();
    char path[4096];
    expand_pattern(path, sizeof path, log_rank);
    log_file = fopen(path, "a");
    file_rank = log_rank;
    if (log_file == NULL) {
      int err = errno;
      char host[64];
      gethostname(host, sizeof host);
      host[sizeof host - 1] = '\0';
      file_failed = true;
      fprintf(stderr,
              "%s:%ld:%d ofl WARN INIT cannot open log file %s: %s (errno "
              "%d); logging to stderr: fix OFL_DEBUG_FILE or the directory\n",
              host, (long)getpid(), log_rank, path, strerror(err), err);
      return stderr;
    }
  }
  return log_file;
}

static const char *level_name(ofl_log_level_t level) {
  if ((int)level == (int)OFL__LOG_NOTE)
    return "NOTE";
  switch (level) {
  case OFL_LOG_WARN:
    return "WARN";
  case OFL_LOG_INFO:
    return "INFO";
  case OFL_LOG_TRACE:
    return "TRACE";
  default:
    return "";
  }
}

void ofl__log(ofl_log_level_t level, unsigned subsys, const char *file,
              int line, const char *fmt, ...) {
  char msg[2048];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);

  pthread_mutex_lock(&log_lock);
  if (only_rank >= 0 && log_rank >= 0 && log_rank != only_rank) {
    pthread_mutex_unlock(&log_lock);
    return;
  }
  if (handler != NULL) {
    ofl_log_handler_fn fn = handler;
    void *user = handler_user;
    pthread_mutex_unlock(&log_lock);
    /* a notice is not a warning: handlers get it as INFO (OFL_NOTE) */
    fn((int)level == (int)OFL__LOG_NOTE ? OFL_LOG_INFO : level, subsys, msg,
       user);
    return;
  }
  FILE *out = sink_locked();
  char host[64];
  gethostname(host, sizeof host);
  host[sizeof host - 1] = '\0';
  if (level == OFL_LOG_TRACE)
    fprintf(out, "%s:%ld:%d ofl %s %s %s:%d %s\n", host, (long)getpid(),
            log_rank, level_name(level), subsys_name(subsys), file, line, msg);
  else
    fprintf(out, "%s:%ld:%d ofl %s %s %s\n", host, (long)getpid(), log_rank,
            level_name(level), subsys_name(subsys), msg);
  fflush(out);
  pthread_mutex_unlock(&log_lock);
}
