/* OFL_TRACE_FILE: a path that cannot be written is reported when the device
 * opens (with the system's reason); two devices of one process write two
 * traces; timestamps are microseconds since the Unix epoch, so that the
 * traces of several ranks line up. Host backend only: its streams are the
 * ones that write trace events. */
#include <criterion/criterion.h>
#include <fcntl.h>
#include <pthread.h>
#include "tests/support/cr_assert.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <ofl/ofl.h>

#define OK(call) cr_assert(eq(int, (call), OFL_SUCCESS), "%s", ofl_last_error())

typedef struct {
  int warnings;
  char last[1024];
} capture_t;

static void capture(ofl_log_level_t level, unsigned subsys, const char *msg,
                    void *user) {
  (void)subsys;
  capture_t *c = user;
  if (level == OFL_LOG_WARN && strstr(msg, "trace") != NULL) {
    c->warnings++;
    snprintf(c->last, sizeof c->last, "%s", msg);
  }
}

static char *slurp(const char *path) {
  FILE *f = fopen(path, "r");
  if (f == NULL)
    return NULL;
  static char buf[1 << 20];
  size_t n = fread(buf, 1, sizeof buf - 1, f);
  buf[n] = '\0';
  fclose(f);
  return buf;
}

static void make_dir(char *dir, size_t cap) {
  snprintf(dir, cap, "/tmp/ofl_trace_XXXXXX");
  cr_assert(ne(ptr, mkdtemp(dir), NULL));
}

/* OFL_TRACE_FILE set to dir/name in a new temporary dir (path: the file),
 * the configuration reloaded. */
static void trace_to(char *dir, size_t dcap, char *path, size_t pcap,
                     const char *name) {
  make_dir(dir, dcap);
  snprintf(path, pcap, "%s/%s", dir, name);
  setenv("OFL_TRACE_FILE", path, 1);
  OK(ofl_config_reload());
}

/* Opens a host-backend device (the backend whose streams write trace
 * events; the cuda backend's ranges go to NVTX), does some traced work, and
 * closes it. */
static ofl_device_t *open_host(void) {
  ofl_device_params_t dp = OFL_DEVICE_PARAMS_INIT;
  dp.backend = OFL_BACKEND_HOST;
  ofl_device_t *dev = NULL;
  OK(ofl_device_open(&dp, &dev));
  return dev;
}

static void traced_session(void) {
  ofl_device_t *dev = open_host();
  ofl_range_push(dev, "work");
  void *d = NULL;
  OK(ofl_device_malloc(dev, 4096, &d));
  OK(ofl_memset_async(d, 1, 4096, ofl_device_compute_stream(dev)));
  OK(ofl_stream_synchronize(ofl_device_compute_stream(dev),
                            OFL_TIMEOUT_DEFAULT));
  ofl_range_pop(dev);
  OK(ofl_device_free(dev, d));
  ofl_device_close(dev);
}

Test(trace, unwritable_path_is_reported_at_open_with_the_reason) {
  capture_t c = {0};
  ofl_log_set_level(OFL_LOG_WARN);
  ofl_log_set_handler(capture, &c);
  setenv("OFL_TRACE_FILE", "/nonexistent-ofl-dir/trace.json", 1);
  OK(ofl_config_reload());
  ofl_device_t *dev = open_host(); /* the device works without a trace */
  cr_assert(eq(int, c.warnings, 1), "not reported at open");
  cr_assert(ne(ptr, strstr(c.last, "/nonexistent-ofl-dir/trace.json"), NULL),
            "%s", c.last);
  cr_assert(ne(ptr, strstr(c.last, "No such file or directory"), NULL), "%s",
            c.last);
  ofl_device_close(dev);
  cr_assert(eq(int, c.warnings, 1), "reported again at close");
  ofl_log_set_handler(NULL, NULL);
}

Test(trace, two_devices_in_one_process_write_two_traces) {
  char dir[64], path[128], second[160], third[160];
  trace_to(dir, sizeof dir, path, sizeof path, "t.json");
  traced_session();
  traced_session();
  traced_session();
  snprintf(second, sizeof second, "%s/t.1.json", dir);
  snprintf(third, sizeof third, "%s/t.2.json", dir);
  const char *files[] = {path, second, third};
  for (int i = 0; i < 3; i++) {
    char *text = slurp(files[i]);
    cr_assert(ne(ptr, text, NULL), "%s not written", files[i]);
    cr_assert(ne(ptr, strstr(text, "\"traceEvents\""), NULL));
    cr_assert(ne(ptr, strstr(text, "\"work\""), NULL), "%s has no range",
              files[i]);
    unlink(files[i]);
  }
  /* %d numbers the traces of the process. */
  snprintf(path, sizeof path, "%s/d%%d.json", dir);
  setenv("OFL_TRACE_FILE", path, 1);
  OK(ofl_config_reload());
  traced_session();
  snprintf(second, sizeof second, "%s/d3.json", dir);
  cr_assert(ne(ptr, slurp(second), NULL), "%s not written", second);
  unlink(second);
  rmdir(dir);
}

Test(trace, timestamps_are_microseconds_since_the_epoch) {
  char dir[64], path[128];
  trace_to(dir, sizeof dir, path, sizeof path, "t.json");
  double before = (double)time(NULL) * 1e6;
  traced_session();
  double after = ((double)time(NULL) + 1) * 1e6;
  char *text = slurp(path);
  cr_assert(ne(ptr, text, NULL));
  int n = 0;
  for (char *p = strstr(text, "\"ts\":"); p != NULL;
       p = strstr(p + 5, "\"ts\":")) {
    double ts = strtod(p + 5, NULL);
    cr_assert(ge(dbl, ts, before), "ts %.3f before the run", ts);
    cr_assert(le(dbl, ts, after), "ts %.3f after the run", ts);
    n++;
  }
  cr_assert(gt(int, n, 0), "no timed events");
  unlink(path);
  rmdir(dir);
}

static size_t count(const char *text, const char *needle) {
  size_t n = 0;
  for (const char *p = text; (p = strstr(p, needle)) != NULL; p++)
    n++;
  return n;
}

/* ofl_device_trace_flush writes a complete document of what was recorded so
 * far; recording goes on, a later flush or the close writes it all again.
 * Without OFL_TRACE_FILE it writes nothing and succeeds. */
Test(trace, flush_writes_a_complete_trace_before_close) {
  char dir[64], path[128];
  trace_to(dir, sizeof dir, path, sizeof path, "f.json");
  ofl_device_t *dev = open_host();
  cr_assert(eq(int, ofl_device_trace_flush(NULL), OFL_ERR_INVALID_ARG));
  OK(ofl_device_trace_flush(dev)); /* nothing recorded yet */
  char *text = slurp(path);
  cr_assert(ne(ptr, text, NULL));
  cr_assert(ne(ptr, strstr(text, "{\"traceEvents\":["), NULL), "%s", text);
  cr_assert(ne(ptr, strstr(text, "\n]}\n"), NULL), "%s", text);
  cr_assert(eq(sz, count(text, "\"ph\":\"X\""), 0));
  for (int round = 1; round <= 3; round++) {
    ofl_range_push(dev, "work");
    ofl_range_pop(dev);
    OK(ofl_device_trace_flush(dev));
    text = slurp(path);
    cr_assert(eq(sz, count(text, "\"work\""), (size_t)round), "%s", text);
    size_t len = strlen(text);
    cr_assert(ge(sz, len, 4));
    cr_assert(eq(str, text + len - 4, "\n]}\n"), "not one document: %s",
              text);
  }
  ofl_range_push(dev, "last");
  ofl_range_pop(dev);
  ofl_device_close(dev);
  text = slurp(path);
  cr_assert(eq(sz, count(text, "\"work\""), 3));
  cr_assert(eq(sz, count(text, "\"last\""), 1));
  cr_assert(eq(sz, count(text, "]}"), 1), "%s", text);
  unlink(path);
  rmdir(dir);
  unsetenv("OFL_TRACE_FILE");
  OK(ofl_config_reload());
  dev = open_host();
  OK(ofl_device_trace_flush(dev));
  ofl_device_close(dev);
}

typedef struct {
  const char *path;
  char text[1 << 16];
  size_t n;
} fifo_reader_t;

static void *read_fifo(void *arg) {
  fifo_reader_t *r = arg;
  int fd = open(r->path, O_RDONLY);
  if (fd < 0)
    return NULL;
  ssize_t k;
  while (r->n < sizeof r->text - 1 &&
         (k = read(fd, r->text + r->n, sizeof r->text - 1 - r->n)) > 0)
    r->n += (size_t)k;
  r->text[r->n] = '\0';
  close(fd);
  return NULL;
}

/* A trace path that is not a regular file (here a FIFO) gets one complete
 * document, at the first flush, with the events until then; later flushes
 * and the close add nothing and report no error. */
Test(trace, a_pipe_gets_one_document_at_the_first_flush) {
  char dir[64], path[128];
  make_dir(dir, sizeof dir);
  snprintf(path, sizeof path, "%s/p.json", dir);
  cr_assert(eq(int, mkfifo(path, 0600), 0));
  static fifo_reader_t r;
  memset(&r, 0, sizeof r);
  r.path = path;
  pthread_t th;
  cr_assert(eq(int, pthread_create(&th, NULL, read_fifo, &r), 0));
  setenv("OFL_TRACE_FILE", path, 1);
  OK(ofl_config_reload());
  capture_t c = {0};
  ofl_log_set_level(OFL_LOG_WARN);
  ofl_log_set_handler(capture, &c);
  ofl_device_t *dev = open_host(); /* opens the FIFO: the reader is there */
  ofl_range_push(dev, "before");
  ofl_range_pop(dev);
  OK(ofl_device_trace_flush(dev));
  ofl_range_push(dev, "after");
  ofl_range_pop(dev);
  OK(ofl_device_trace_flush(dev));
  ofl_device_close(dev);
  pthread_join(th, NULL);
  ofl_log_set_handler(NULL, NULL);
  cr_assert(eq(int, c.warnings, 0), "%s", c.last);
  cr_assert(eq(sz, count(r.text, "{\"traceEvents\":["), 1), "%s", r.text);
  cr_assert(eq(sz, count(r.text, "\"before\""), 1), "%s", r.text);
  cr_assert(eq(sz, count(r.text, "\"after\""), 0), "%s", r.text);
  size_t len = strlen(r.text);
  cr_assert(ge(sz, len, 4));
  cr_assert(eq(str, r.text + len - 4, "\n]}\n"));
  unlink(path);
  rmdir(dir);
  unsetenv("OFL_TRACE_FILE");
  OK(ofl_config_reload());
}
