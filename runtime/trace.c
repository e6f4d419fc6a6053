/* ofl: Chrome trace-event output (OFL_TRACE_FILE). Events are kept in memory
 * and written as JSON when the device closes; Perfetto and chrome://tracing
 * open the file. One process per rank, one track (thread) per stream. */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/stat.h>
#include <unistd.h>

#include "runtime/backend.h"

typedef struct {
  char name[48];
  char cat[16];
  int track;
  uint64_t start_ns, end_ns;
  char args[96];
} trace_ev_t;

typedef struct {
  int id;
  char name[32];
} track_t;

struct ofl__trace {
  pthread_mutex_t lock;
  char path[1024];
  FILE *file; /* opened at device open, so a bad path is reported then */
  /* Clock origin: CLOCK_MONOTONIC and CLOCK_REALTIME read together at
   * open. Timestamps are realtime at open plus the monotonic time since,
   * i.e. microseconds since the Unix epoch: the traces of several ranks
   * (or hosts with synchronised clocks) line up when loaded together, and
   * a clock step during the run does not bend one trace. */
  uint64_t t0;
  uint64_t t0_epoch_ns;
  trace_ev_t *evs;
  size_t n, cap;
  track_t tracks[64];
  int ntracks;
  bool full_warned;
  /* The file is not a regular one (a pipe, a terminal, /dev/stdout): it
   * cannot be rewritten, so it gets one document, at the first flush or at
   * close, and later events are not written. */
  bool once;
  bool written;
};

#define TRACE_MAX_EVENTS (4u << 20)

/* Length of the valid UTF-8 sequence at p (1 to 4), 0 when p does not
 * start one (a stray continuation byte, an overlong form, a surrogate, a
 * sequence cut short, as when a caller's name was cut to a buffer). */
static size_t utf8_len(const unsigned char *p) {
  size_t n;
  unsigned cp;
  if (p[0] < 0x80)
    return 1;
  if (p[0] >= 0xC2 && p[0] <= 0xDF) {
    n = 2;
    cp = p[0] & 0x1Fu;
  } else if (p[0] >= 0xE0 && p[0] <= 0xEF) {
    n = 3;
    cp = p[0] & 0x0Fu;
  } else if (p[0] >= 0xF0 && p[0] <= 0xF4) {
    n = 4;
    cp = p[0] & 0x07u;
  } else {
    return 0;
  }
  for (size_t i = 1; i < n; i++) {
    if ((p[i] & 0xC0) != 0x80) /* also stops at the terminating NUL */
      return 0;
    cp = (cp << 6) | (p[i] & 0x3Fu);
  }
  if ((n == 3 && cp < 0x800) || (n == 4 && (cp < 0x10000 || cp > 0x10FFFF)) ||
      (cp >= 0xD800 && cp <= 0xDFFF))
    return 0;
  return n;
}

/* Copies src into dst as the inside of a JSON string: names come from the
 * application (stream names, range and group names) and may hold quotes,
 * backslashes, control characters or bytes that are not UTF-8 (written as
 * U+FFFD, as JSON must be UTF-8). Truncates on a character boundary of the
 * escaped form, never inside a multi-byte character. */
static void json_escape(char *dst, size_t cap, const char *src) {
  size_t o = 0;
  const unsigned char *p = (const unsigned char *)src;
  while (*p) {
    char tmp[8];
    size_t n, used = 1;
    if (*p == '"' || *p == '\\') {
      tmp[0] = '\\';
      tmp[1] = (char)*p;
      n = 2;
    } else if (*p < 0x20) {
      n = (size_t)snprintf(tmp, sizeof tmp, "\\u%04x", *p);
    } else if ((used = utf8_len(p)) == 0) {
      memcpy(tmp, "\xEF\xBF\xBD", 3); /* U+FFFD */
      n = 3;
      used = 1;
    } else {
      memcpy(tmp, p, used);
      n = used;
    }
    if (o + n >= cap)
      break;
    memcpy(dst + o, tmp, n);
    o += n;
    p += used;
  }
  dst[o] = '\0';
}

void ofl__utf8_copy(char *dst, size_t cap, const char *src) {
  size_t o = 0;
  const unsigned char *p = (const unsigned char *)src;
  while (*p) {
    size_t n = utf8_len(p);
    if (n == 0)
      n = 1; /* not UTF-8: copied as it is, the escape replaces it */
    if (o + n >= cap)
      break;
    memcpy(dst + o, p, n);
    o += n;
    p += n;
  }
  if (cap > 0)
    dst[o] = '\0';
}

void ofl__trace_json_escape(char *dst, size_t cap, const char *src) {
  json_escape(dst, cap, src);
}

/* Paths this process has written traces to: a second device opened with
 * the same OFL_TRACE_FILE (the demo's two runs, a test opening two
 * devices) must not overwrite the first one's trace. */
static pthread_mutex_t paths_lock = PTHREAD_MUTEX_INITIALIZER;
static char **paths_used;
static size_t n_paths_used;
static unsigned trace_seq; /* %d: traces opened in this process */

/* How often path was used before (paths_lock held); records this use. */
static size_t path_uses_locked(const char *path) {
  size_t uses = 0;
  for (size_t i = 0; i < n_paths_used; i++)
    uses += strcmp(paths_used[i], path) == 0;
  char **np = realloc(paths_used, (n_paths_used + 1) * sizeof *np);
  char *dup = strdup(path);
  if (np != NULL)
    paths_used = np;
  if (np != NULL && dup != NULL)
    paths_used[n_paths_used++] = dup;
  else
    free(dup);
  return uses;
}

/* Expands %p pid, %r rank (as in OFL_DEBUG_FILE) and %d, the number of the
 * trace in this process (0 for the first device opened with tracing); a
 * path already used gets .N before its .json (or at its end). */
static void expand_path(char *out, size_t cap, const char *path, unsigned seq) {
  size_t o = 0;
  for (const char *p = path; *p && o + 24 < cap; p++) {
    if (p[0] == '%' && (p[1] == 'p' || p[1] == 'r' || p[1] == 'd')) {
      long v = p[1] == 'p'   ? (long)getpid()
               : p[1] == 'r' ? (long)ofl_log_get_rank()
                             : (long)seq;
      o += (size_t)snprintf(out + o, cap - o, "%ld", v);
      p++;
    } else {
      out[o++] = *p;
    }
  }
  out[o] = '\0';
  pthread_mutex_lock(&paths_lock);
  size_t uses = path_uses_locked(out);
  pthread_mutex_unlock(&paths_lock);
  if (uses == 0)
    return;
  char base[1024];
  snprintf(base, sizeof base, "%s", out);
  size_t len = strlen(base);
  const char *ext =
      len >= 5 && strcmp(base + len - 5, ".json") == 0 ? ".json" : "";
  base[len - strlen(ext)] = '\0';
  snprintf(out, cap, "%s.%zu%s", base, uses, ext);
}

ofl_status_t ofl__trace_open(ofl_device_t *dev, const char *path) {
  ofl__trace_t *t = calloc(1, sizeof *t);
  if (t == NULL)
    return ofl__error(OFL_ERR_NO_MEMORY, OFL_SUBSYS_DEVICE,
                      "cannot allocate the trace buffer");
  pthread_mutex_lock(&paths_lock);
  unsigned seq = trace_seq++;
  pthread_mutex_unlock(&paths_lock);
  expand_path(t->path, sizeof t->path, path, seq);
  /* Opened now, written at close: a path that cannot be written is
   * reported while the program starts, not after the run. */
  t->file = fopen(t->path, "w");
  if (t->file == NULL) {
    int err = errno;
    ofl_status_t st =
        ofl__error(OFL_ERR_IO, OFL_SUBSYS_DEVICE,
                   "cannot open trace file %s: %s (errno %d); this device "
                   "writes no trace: fix OFL_TRACE_FILE or the directory",
                   t->path, strerror(err), err);
    free(t);
    return st;
  }
  struct stat sb;
  t->once = fstat(fileno(t->file), &sb) != 0 || !S_ISREG(sb.st_mode);
  pthread_mutex_init(&t->lock, NULL);
  struct timespec rt;
  t->t0 = ofl__now_ns();
  clock_gettime(CLOCK_REALTIME, &rt);
  t->t0_epoch_ns = (uint64_t)rt.tv_sec * 1000000000ull + (uint64_t)rt.tv_nsec;
  OFL_INFO(OFL_SUBSYS_DEVICE, "trace of this device goes to %s at close",
           t->path);
  dev->trace = t;
  return OFL_SUCCESS;
}

void ofl__trace_name_track(ofl_device_t *dev, int track, const char *name) {
  ofl__trace_t *t = dev ? dev->trace : NULL;
  if (t == NULL)
    return;
  pthread_mutex_lock(&t->lock);
  if (t->ntracks < 64) {
    t->tracks[t->ntracks].id = track;
    json_escape(t->tracks[t->ntracks].name, sizeof t->tracks[0].name, name);
    t->ntracks++;
  }
  pthread_mutex_unlock(&t->lock);
}

void ofl__trace_complete(ofl_device_t *dev, int track, const char *name,
                         const char *cat, uint64_t start_ns, uint64_t end_ns,
                         const char *args_json) {
  ofl__trace_t *t = dev ? dev->trace : NULL;
  if (t == NULL)
    return;
  pthread_mutex_lock(&t->lock);
  if (t->n == t->cap) {
    size_t ncap = t->cap ? t->cap * 2 : 4096;
    trace_ev_t *ne =
        ncap <= TRACE_MAX_EVENTS ? realloc(t->evs, ncap * sizeof *ne) : NULL;
    if (ne == NULL) {
      if (!t->full_warned)
        OFL_WARN(OFL_SUBSYS_DEVICE,
                 "trace buffer full at %zu events; later "
                 "events are dropped from %s",
                 t->n, t->path);
      t->full_warned = true;
      pthread_mutex_unlock(&t->lock);
      return;
    }
    t->evs = ne;
    t->cap = ncap;
  }
  trace_ev_t *e = &t->evs[t->n++];
  json_escape(e->name, sizeof e->name, name);
  json_escape(e->cat, sizeof e->cat, cat);
  e->track = track;
  e->start_ns = start_ns;
  e->end_ns = end_ns;
  snprintf(e->args, sizeof e->args, "%s", args_json ? args_json : "");
  pthread_mutex_unlock(&t->lock);
}

/* Writes every event so far to the file, from its start: a complete JSON
 * document after each write (t->lock held). 0, or the errno of the write
 * that failed. */
static int write_locked(ofl__trace_t *t) {
  FILE *f = t->file;
  if (t->once && t->written)
    return 0;
  errno = 0;
  if (!t->once)
    rewind(f);
  int pid = ofl_log_get_rank() >= 0 ? ofl_log_get_rank() : 0;
  fprintf(f, "{\"traceEvents\":[\n");
  fprintf(f,
          "{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":%d,"
          "\"args\":{\"name\":\"rank %d\"}}",
          pid, pid);
  for (int i = 0; i < t->ntracks; i++)
    fprintf(f,
            ",\n{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":%d,"
            "\"tid\":%d,\"args\":{\"name\":\"%s\"}}",
            pid, t->tracks[i].id, t->tracks[i].name);
  for (size_t i = 0; i < t->n; i++) {
    const trace_ev_t *e = &t->evs[i];
    /* Integer arithmetic: epoch microseconds (about 2^51) keep their
     * nanosecond digits, which a double would round away. */
    uint64_t s =
        t->t0_epoch_ns + (e->start_ns > t->t0 ? e->start_ns - t->t0 : 0);
    uint64_t d = e->end_ns > e->start_ns ? e->end_ns - e->start_ns : 0;
    fprintf(f,
            ",\n{\"name\":\"%s\",\"cat\":\"%s\",\"ph\":\"X\",\"pid\":%d,"
            "\"tid\":%d,\"ts\":%" PRIu64 ".%03u,\"dur\":%" PRIu64
            ".%03u,\"args\":{%s}}",
            e->name, e->cat, pid, e->track, s / 1000, (unsigned)(s % 1000),
            d / 1000, (unsigned)(d % 1000), e->args);
  }
  fprintf(f, "\n]}\n");
  t->written = true;
  if (fflush(f) != 0 || ferror(f))
    return errno != 0 ? errno : EIO;
  if (t->once)
    return 0;
  /* A shorter document than an earlier write's: cut what is left of it. */
  long end = ftell(f);
  if (end < 0 || ftruncate(fileno(f), (off_t)end) != 0)
    return errno != 0 ? errno : EIO;
  return 0;
}

ofl_status_t ofl_device_trace_flush(ofl_device_t *dev) {
  if (dev == NULL)
    return ofl__error(OFL_ERR_INVALID_ARG, OFL_SUBSYS_DEVICE,
                      "ofl_device_trace_flush: device is NULL");
  ofl__trace_t *t = dev->trace;
  if (t == NULL)
    return OFL_SUCCESS; /* no OFL_TRACE_FILE: nothing to write */
  pthread_mutex_lock(&t->lock);
  int err = write_locked(t);
  pthread_mutex_unlock(&t->lock);
  if (err != 0)
    return ofl__error(OFL_ERR_IO, OFL_SUBSYS_DEVICE,
                      "cannot write trace file %s: %s; check the space left "
                      "on its file system",
                      t->path, strerror(err));
  return OFL_SUCCESS;
}

void ofl__trace_close(ofl_device_t *dev) {
  ofl__trace_t *t = dev ? dev->trace : NULL;
  if (t == NULL)
    return;
  bool flushed_once = t->once && t->written;
  int err = write_locked(t);
  if (fclose(t->file) != 0 && err == 0)
    err = errno;
  if (err != 0)
    OFL_WARN(OFL_SUBSYS_DEVICE,
             "trace file %s may be incomplete: %s; check the space left "
             "on its file system",
             t->path, strerror(err));
  else if (flushed_once && t->n > 0)
    OFL_INFO(OFL_SUBSYS_DEVICE,
             "trace file %s is not a regular file: it holds the events up "
             "to its flush, not the %zu recorded in all",
             t->path, t->n);
  free(t->evs);
  pthread_mutex_destroy(&t->lock);
  free(t);
  dev->trace = NULL;
}
