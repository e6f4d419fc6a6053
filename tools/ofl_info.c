/* ofl-info: what this ofl installation can do on this machine, like
 * ucx_info: version and build features, the backends and why one is not
 * available, the devices and their memory, the pinned-memory limit, the
 * disk tier (directory, O_DIRECT, io_uring) and every OFL_* variable with
 * the value in force, its default and where it came from.
 *
 *   ofl-info           text for people
 *   ofl-info --json    one JSON object for scripts
 *   ofl-info -v        also show the library's log lines while probing
 *   ofl-info --markdown  the table of every OFL_* variable (default, what
 *                      it takes, what it does) as markdown, for the docs;
 *                      the same whatever this shell sets
 *
 * It is a check too: it exits 1, after saying why on stderr before the
 * report, when an OFL_* value is invalid (the library's own rules,
 * ofl_config_check), an OFL_* variable is unknown (with the closest known
 * name), or the backend OFL_BACKEND asks for cannot be used here. */
#include <dlfcn.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/resource.h>

#include <ofl/ofl.h>

#define MAX_DEVICES 64
#define MAX_VARS 128
#define MAX_PROBLEMS 64

typedef struct backend_info {
  const char *name;
  bool available;
  int count;
  char why[512];
} backend_info_t;

typedef struct device_info {
  char name[32];
  size_t capacity_bytes; /* 0: unknown / unlimited */
  bool opened;
  char why[512];
} device_info_t;

typedef struct disk_info {
  bool opened;
  char dir[1024];
  int direct;
  int uring;
  char why[512];       /* why the store could not be opened */
  char uring_why[512]; /* why io_uring was refused */
} disk_info_t;

typedef struct var_info {
  char name[64];
  const char *value;
  char def[256];
  char takes[256]; /* the values it takes, in the library's words */
  char doc[512];   /* its one-line doc */
  const char *source;
  bool invalid; /* set in the environment and refused by the library */
} var_info_t;

typedef struct info {
  backend_info_t backends[2];
  device_info_t devices[MAX_DEVICES + 1];
  int ndevices;
  char default_backend[16];
  char default_reason[512];
  char cudart[512]; /* which CUDA runtime ofl uses and why ("": none) */
  bool nccl_found;
  char nccl_why[512];
  struct rlimit memlock;
  bool memlock_ok;
  disk_info_t disk;
  var_info_t vars[MAX_VARS];
  int nvars;
  char problems[MAX_PROBLEMS][768]; /* why the configuration is not usable */
  int nproblems;
} info_t;

static void quiet_log(ofl_log_level_t level, unsigned subsys,
                      const char *message, void *user) {
  (void)level;
  (void)subsys;
  (void)message;
  (void)user;
}

static void copy_str(char *dst, size_t cap, const char *src) {
  snprintf(dst, cap, "%s", src != NULL ? src : "");
}

static void add_problem(info_t *in, const char *text) {
  if (in->nproblems < MAX_PROBLEMS)
    copy_str(in->problems[in->nproblems++], sizeof in->problems[0], text);
}

/* Invalid values and unknown names, in the library's words (one line
 * each). */
static void check_config(info_t *in) {
  char *text = NULL;
  size_t len = 0;
  FILE *f = open_memstream(&text, &len);
  if (f == NULL) {
    if (ofl_config_check(NULL) > 0)
      add_problem(in, "the OFL_* configuration has errors");
    return;
  }
  ofl_config_check(f);
  fclose(f);
  char *save = NULL;
  for (char *line = strtok_r(text, "\n", &save); line != NULL;
       line = strtok_r(NULL, "\n", &save))
    add_problem(in, line);
  free(text);
}

/* A backend asked for by name that cannot be used, and a default open
 * that fails: what a program would meet at its first ofl_device_open. */
static void check_backend(info_t *in) {
  const char *want = getenv("OFL_BACKEND");
  char msg[768];
  for (int i = 0; i < 2; i++) {
    const backend_info_t *b = &in->backends[i];
    if (want != NULL && strcasecmp(want, b->name) == 0 && !b->available) {
      snprintf(msg, sizeof msg,
               "OFL_BACKEND=%s but the %s backend is not available: %s", want,
               b->name, b->why[0] ? b->why : "no reason given");
      add_problem(in, msg);
      return;
    }
  }
  /* An invalid value already said why the open fails. */
  if (strcmp(in->default_backend, "none") == 0 && in->nproblems == 0) {
    snprintf(msg, sizeof msg, "a device cannot be opened: %s",
             in->default_reason);
    add_problem(in, msg);
  }
}

/* The library names the CUDA runtime it uses, and why that one, in its
 * "cuda runtime: ..." INFO line at the first load: caught here while the
 * backends are probed (at INFO for that moment); with -v the lines the
 * level in force lets through are shown as usual. */
typedef struct probe_log {
  bool verbose;
  ofl_log_level_t shown;
  char *cudart;
  size_t cudart_bytes;
} probe_log_t;

static void catch_cudart(ofl_log_level_t level, unsigned subsys,
                         const char *message, void *user) {
  (void)subsys;
  probe_log_t *p = user;
  static const char tag[] = "cuda runtime: ";
  if (strncmp(message, tag, sizeof tag - 1) == 0)
    copy_str(p->cudart, p->cudart_bytes, message + sizeof tag - 1);
  if (p->verbose && level <= p->shown)
    fprintf(stderr, "ofl %s: %s\n", level == OFL_LOG_WARN ? "WARN" : "INFO",
            message);
}

static void probe_backends(info_t *in, bool verbose) {
  probe_log_t pl = {verbose, ofl_log_get_level(), in->cudart,
                    sizeof in->cudart};
  ofl_log_handler_fn old = ofl_log_set_handler(catch_cudart, &pl);
  ofl_log_set_level(OFL_LOG_INFO);
  backend_info_t *host = &in->backends[0];
  backend_info_t *cuda = &in->backends[1];
  host->name = "host";
  host->available = ofl_backend_probe(OFL_BACKEND_HOST, &host->count,
                                      host->why, sizeof host->why) ==
                    OFL_SUCCESS;
  cuda->name = "cuda";
  cuda->available = ofl_backend_probe(OFL_BACKEND_CUDA, &cuda->count,
                                      cuda->why, sizeof cuda->why) ==
                    OFL_SUCCESS;
  ofl_log_set_level(pl.shown);
  ofl_log_set_handler(old, NULL); /* quiet_log or the default sink */
}

/* One device per cuda ordinal, then the host backend's "device". */
static void probe_devices(info_t *in) {
  const backend_info_t *cuda = &in->backends[1];
  int n = cuda->available ? cuda->count : 0;
  if (n > MAX_DEVICES)
    n = MAX_DEVICES;
  for (int i = 0; i <= n; i++) {
    device_info_t *d = &in->devices[in->ndevices++];
    ofl_device_params_t p = OFL_DEVICE_PARAMS_INIT;
    if (i < n) {
      p.backend = OFL_BACKEND_CUDA;
      p.device_index = i;
      snprintf(d->name, sizeof d->name, "cuda:%d", i);
    } else {
      p.backend = OFL_BACKEND_HOST;
      snprintf(d->name, sizeof d->name, "host");
    }
    ofl_device_t *dev = NULL;
    if (ofl_device_open(&p, &dev) != OFL_SUCCESS) {
      copy_str(d->why, sizeof d->why, ofl_last_error());
      continue;
    }
    ofl_device_stats_t s;
    ofl_device_get_stats(dev, &s);
    d->capacity_bytes = s.device_capacity_bytes;
    d->opened = true;
    ofl_device_close(dev);
  }
  /* What a default open picks (OFL_BACKEND, auto: cuda when usable). */
  ofl_device_t *dev = NULL;
  if (ofl_device_open(NULL, &dev) == OFL_SUCCESS) {
    copy_str(in->default_backend, sizeof in->default_backend,
             ofl_backend_name(ofl_device_backend(dev)));
    copy_str(in->default_reason, sizeof in->default_reason,
             ofl_device_selection_reason(dev));
    ofl_device_close(dev);
  } else {
    copy_str(in->default_backend, sizeof in->default_backend, "none");
    copy_str(in->default_reason, sizeof in->default_reason, ofl_last_error());
  }
}

/* NCCL is loaded when a comm is created; here only whether it would be
 * found (the same names the library tries). */
static void probe_nccl(info_t *in) {
  if (!OFL_HAVE_NCCL) {
    copy_str(in->nccl_why, sizeof in->nccl_why, "not in this build");
    return;
  }
  const char *lib = getenv("OFL_NCCL_LIBRARY");
  if (lib == NULL || lib[0] == '\0')
    lib = "libnccl.so.2";
  void *h = dlopen(lib, RTLD_NOW | RTLD_LOCAL);
  if (h == NULL) {
    const char *e = dlerror();
    copy_str(in->nccl_why, sizeof in->nccl_why, e != NULL ? e : lib);
    return;
  }
  in->nccl_found = true;
  snprintf(in->nccl_why, sizeof in->nccl_why, "%s", lib);
  dlclose(h);
}

/* The disk tier as a store would open it (OFL_DISK_* in force), on the
 * host backend (the bounce buffers are not used), then io_uring demanded. */
static void probe_disk(info_t *in) {
  disk_info_t *dk = &in->disk;
  ofl_device_params_t p = OFL_DEVICE_PARAMS_INIT;
  p.backend = OFL_BACKEND_HOST;
  ofl_device_t *dev = NULL;
  if (ofl_device_open(&p, &dev) != OFL_SUCCESS) {
    copy_str(dk->why, sizeof dk->why, ofl_last_error());
    return;
  }
  ofl_disk_params_t dp = OFL_DISK_PARAMS_INIT;
  dp.dev = dev;
  dp.bounce_budget_bytes = 1u << 20;
  dp.keep_bytes = 0;
  ofl_disk_t *disk = NULL;
  if (ofl_disk_open(&dp, &disk) != OFL_SUCCESS) {
    copy_str(dk->why, sizeof dk->why, ofl_last_error());
    ofl_device_close(dev);
    return;
  }
  ofl_disk_stats_t s;
  ofl_disk_get_stats(disk, &s);
  dk->opened = true;
  dk->direct = s.direct;
  dk->uring = s.uring;
  copy_str(dk->dir, sizeof dk->dir, ofl_disk_dir(disk));
  ofl_disk_close(disk);
  if (!dk->uring) {
    /* auto takes io_uring only with O_DIRECT: ask for it explicitly. */
    dp.engine = OFL_DISK_ENGINE_URING;
    if (ofl_disk_open(&dp, &disk) == OFL_SUCCESS) {
      ofl_disk_get_stats(disk, &s);
      dk->uring = s.uring;
      ofl_disk_close(disk);
    } else {
      copy_str(dk->uring_why, sizeof dk->uring_why, ofl_last_error());
    }
  }
  ofl_device_close(dev);
}

/* After a line's default: "; takes T) doc", where T may hold balanced
 * parentheses of its own. */
static void parse_takes_doc(var_info_t *v, const char *p) {
  const char *t = strstr(p, "; takes ");
  if (t == NULL)
    return;
  t += strlen("; takes ");
  int depth = 1;
  const char *e = t;
  for (; *e != '\0'; e++) {
    if (*e == '(')
      depth++;
    else if (*e == ')' && --depth == 0)
      break;
  }
  snprintf(v->takes, sizeof v->takes, "%.*s", (int)(e - t), t);
  if (*e == ')')
    copy_str(v->doc, sizeof v->doc, e[1] == ' ' ? e + 2 : e + 1);
}

/* Every variable of the library's table, from ofl_config_print's lines
 * ("NAME = value (SOURCE; default D; takes T) doc", T may hold parentheses);
 * the value in force from ofl_config_get, the source from the
 * environment. */
static void probe_config(info_t *in) {
  char *text = NULL;
  size_t len = 0;
  FILE *f = open_memstream(&text, &len);
  if (f == NULL)
    return;
  ofl_config_print(f);
  fclose(f);
  char *save = NULL;
  for (char *line = strtok_r(text, "\n", &save);
       line != NULL && in->nvars < MAX_VARS;
       line = strtok_r(NULL, "\n", &save)) {
    char name[64];
    if (sscanf(line, "%63s", name) != 1 || strncmp(name, "OFL_", 4) != 0)
      continue;
    var_info_t *v = &in->vars[in->nvars++];
    copy_str(v->name, sizeof v->name, name);
    v->value = ofl_config_get(name);
    if (v->value == NULL)
      v->value = "";
    /* An empty value counts as unset (include/ofl/config.h). */
    const char *env = getenv(name);
    v->source = env == NULL       ? "default"
                : env[0] == '\0' ? "default (empty in the environment)"
                                  : "environment";
    v->invalid = strstr(line, ", INVALID;") != NULL;
    /* "(default D; ...)" or "(SOURCE; default D; ...)" */
    const char *rest = line + strlen(name);
    const char *d = strstr(rest, "; default ");
    if (d != NULL)
      d += strlen("; default ");
    else if ((d = strstr(rest, "(default ")) != NULL)
      d += strlen("(default ");
    if (d != NULL) {
      size_t n = strcspn(d, ";)");
      if (n == 2 && strncmp(d, "''", 2) == 0)
        n = 0;
      snprintf(v->def, sizeof v->def, "%.*s", (int)n, d);
      parse_takes_doc(v, d + n);
    }
  }
  free(text);
}

/* ---- text -------------------------------------------------------------- */

static void print_bytes(FILE *out, size_t b) {
  if (b == 0)
    fprintf(out, "unknown/unlimited");
  else if (b >= (1ull << 30))
    fprintf(out, "%.2f GiB (%zu bytes)", (double)b / (1ull << 30), b);
  else
    fprintf(out, "%.2f MiB (%zu bytes)", (double)b / (1ull << 20), b);
}

static void print_rlim(FILE *out, rlim_t v) {
  if (v == RLIM_INFINITY)
    fprintf(out, "unlimited");
  else
    fprintf(out, "%llu bytes", (unsigned long long)v);
}

static void print_text(const info_t *in, FILE *out) {
  fprintf(out, "# ofl %s (libofl.so.%d)\n", OFL_VERSION_STRING,
          OFL_VERSION_MAJOR);
  fprintf(out, "# build: cuda %s, nccl %s, mpi %s, io_uring %s\n",
          OFL_HAVE_CUDA ? "yes" : "no", OFL_HAVE_NCCL ? "yes" : "no",
          OFL_HAVE_MPI ? "yes" : "no", OFL_HAVE_LIBURING ? "yes" : "no");
  if (OFL_HAVE_CUDA)
    fprintf(out, "# the cuda runtime and nccl are loaded at run time\n");
  fprintf(out, "\nbackends\n");
  for (int i = 0; i < 2; i++) {
    const backend_info_t *b = &in->backends[i];
    if (b->available)
      fprintf(out, "  %-5s available, %d device(s)\n", b->name, b->count);
    else
      fprintf(out, "  %-5s not available: %s\n", b->name, b->why);
  }
  if (in->cudart[0])
    fprintf(out, "  cuda runtime: %s\n", in->cudart);
  fprintf(out, "  default: %s (%s)\n", in->default_backend,
          in->default_reason[0] ? in->default_reason : "OFL_BACKEND");
  fprintf(out, "  nccl: %s%s\n", in->nccl_found ? "found, " : "not found: ",
          in->nccl_why);
  fprintf(out, "\ndevices\n");
  for (int i = 0; i < in->ndevices; i++) {
    const device_info_t *d = &in->devices[i];
    fprintf(out, "  %-8s ", d->name);
    if (!d->opened) {
      fprintf(out, "cannot be opened: %s\n", d->why);
      continue;
    }
    fprintf(out, "memory ");
    print_bytes(out, d->capacity_bytes);
    fprintf(out, "\n");
  }
  fprintf(out, "\npinned memory\n  RLIMIT_MEMLOCK soft ");
  if (in->memlock_ok) {
    print_rlim(out, in->memlock.rlim_cur);
    fprintf(out, ", hard ");
    print_rlim(out, in->memlock.rlim_max);
  } else {
    fprintf(out, "unknown");
  }
  fprintf(out, "\n\ndisk tier\n");
  if (in->disk.opened) {
    fprintf(out, "  dir      %s\n", in->disk.dir);
    fprintf(out, "  O_DIRECT %s\n", in->disk.direct ? "yes" : "no");
    fprintf(out, "  io_uring %s%s%s\n", in->disk.uring ? "yes" : "no",
            in->disk.uring_why[0] ? ": " : "", in->disk.uring_why);
  } else {
    fprintf(out, "  cannot open a store: %s\n", in->disk.why);
  }
  fprintf(out, "\nconfiguration (value, default, source)\n");
  for (int i = 0; i < in->nvars; i++) {
    const var_info_t *v = &in->vars[i];
    fprintf(out, "  %-26s = %-14s default %-10s %s%s\n", v->name,
            v->value[0] ? v->value : "''", v->def[0] ? v->def : "''",
            v->source, v->invalid ? ", INVALID" : "");
  }
}

/* ---- json -------------------------------------------------------------- */

static void json_str(FILE *out, const char *s) {
  fputc('"', out);
  for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
    if (*p == '"' || *p == '\\')
      fprintf(out, "\\%c", *p);
    else if (*p == '\n')
      fputs("\\n", out);
    else if (*p == '\t')
      fputs("\\t", out);
    else if (*p < 0x20)
      fprintf(out, "\\u%04x", *p);
    else
      fputc(*p, out);
  }
  fputc('"', out);
}

static void json_rlim(FILE *out, rlim_t v) {
  if (v == RLIM_INFINITY)
    fputs("null", out);
  else
    fprintf(out, "%llu", (unsigned long long)v);
}

static void print_json(const info_t *in, FILE *out) {
  fprintf(out, "{\n  \"version\": ");
  json_str(out, OFL_VERSION_STRING);
  fprintf(out, ",\n  \"soname\": \"libofl.so.%d\",\n", OFL_VERSION_MAJOR);
  fprintf(out,
          "  \"features\": {\"cuda\": %s, \"nccl\": %s, \"mpi\": %s, "
          "\"liburing\": %s, \"cuda_loaded_at_run_time\": %s},\n",
          OFL_HAVE_CUDA ? "true" : "false", OFL_HAVE_NCCL ? "true" : "false",
          OFL_HAVE_MPI ? "true" : "false",
          OFL_HAVE_LIBURING ? "true" : "false",
          OFL_HAVE_CUDA ? "true" : "false");
  fprintf(out, "  \"backends\": {");
  for (int i = 0; i < 2; i++) {
    const backend_info_t *b = &in->backends[i];
    fprintf(out, "%s\n    ", i ? "," : "");
    json_str(out, b->name);
    fprintf(out, ": {\"available\": %s, \"devices\": %d, \"reason\": ",
            b->available ? "true" : "false", b->count);
    json_str(out, b->why);
    fprintf(out, "}");
  }
  fprintf(out, "\n  },\n  \"cuda_runtime\": ");
  json_str(out, in->cudart);
  fprintf(out, ",\n  \"default_backend\": ");
  json_str(out, in->default_backend);
  fprintf(out, ",\n  \"default_reason\": ");
  json_str(out, in->default_reason);
  fprintf(out, ",\n  \"nccl\": {\"found\": %s, \"detail\": ",
          in->nccl_found ? "true" : "false");
  json_str(out, in->nccl_why);
  fprintf(out, "},\n  \"devices\": [");
  for (int i = 0; i < in->ndevices; i++) {
    const device_info_t *d = &in->devices[i];
    fprintf(out, "%s\n    {\"name\": ", i ? "," : "");
    json_str(out, d->name);
    fprintf(out, ", \"opened\": %s, \"capacity_bytes\": %zu, \"error\": ",
            d->opened ? "true" : "false", d->capacity_bytes);
    json_str(out, d->why);
    fprintf(out, "}");
  }
  fprintf(out, "\n  ],\n  \"pinned\": {\"memlock_soft_bytes\": ");
  if (in->memlock_ok)
    json_rlim(out, in->memlock.rlim_cur);
  else
    fputs("null", out);
  fprintf(out, ", \"memlock_hard_bytes\": ");
  if (in->memlock_ok)
    json_rlim(out, in->memlock.rlim_max);
  else
    fputs("null", out);
  fprintf(out, "},\n  \"disk\": {\"opened\": %s, \"dir\": ",
          in->disk.opened ? "true" : "false");
  json_str(out, in->disk.dir);
  fprintf(out, ", \"o_direct\": %s, \"io_uring\": %s, \"error\": ",
          in->disk.direct ? "true" : "false",
          in->disk.uring ? "true" : "false");
  json_str(out, in->disk.opened ? in->disk.uring_why : in->disk.why);
  fprintf(out, "},\n  \"config\": [");
  for (int i = 0; i < in->nvars; i++) {
    const var_info_t *v = &in->vars[i];
    fprintf(out, "%s\n    {\"name\": ", i ? "," : "");
    json_str(out, v->name);
    fprintf(out, ", \"value\": ");
    json_str(out, v->value);
    fprintf(out, ", \"default\": ");
    json_str(out, v->def);
    fprintf(out, ", \"source\": ");
    json_str(out, v->source);
    fprintf(out, ", \"valid\": %s}", v->invalid ? "false" : "true");
  }
  fprintf(out, "\n  ],\n  \"problems\": [");
  for (int i = 0; i < in->nproblems; i++) {
    fprintf(out, "%s\n    ", i ? "," : "");
    json_str(out, in->problems[i]);
  }
  fprintf(out, "%s]\n}\n", in->nproblems ? "\n  " : "");
}

/* ---- markdown ---------------------------------------------------------- */

/* A table cell: '|' escaped, so that a value list stays one cell. */
static void md_cell(FILE *out, const char *s) {
  for (; *s != '\0'; s++) {
    if (*s == '|')
      fputc('\\', out);
    fputc(*s, out);
  }
}

/* The library's table as markdown (docs/configuration.md is this output
 * below its marker line; a test compares the two). */
static void print_markdown(const info_t *in, FILE *out) {
  fprintf(out,
          "Every `OFL_*` variable libofl reads, from its own table "
          "(`ofl-info --markdown`).\n"
          "An empty value (`NAME=` in the environment) is the same as an "
          "unset one: the default applies.\n\n");
  fprintf(out, "| variable | default | takes | what it does |\n"
               "|---|---|---|---|\n");
  for (int i = 0; i < in->nvars; i++) {
    const var_info_t *v = &in->vars[i];
    fprintf(out, "| `%s` | ", v->name);
    if (v->def[0] != '\0') {
      fputc('`', out);
      md_cell(out, v->def);
      fputc('`', out);
    } else {
      fputs("(empty)", out);
    }
    fputs(" | ", out);
    md_cell(out, v->takes);
    fputs(" | ", out);
    md_cell(out, v->doc);
    fputs(" |\n", out);
  }
}

/* The page documents the defaults, not this shell's settings: every OFL_*
 * variable is dropped before the library reads the table. */
extern char **environ;

static void clear_ofl_env(void) {
  for (;;) {
    char name[256] = "";
    for (char **e = environ; e != NULL && *e != NULL; e++) {
      if (strncmp(*e, "OFL_", 4) == 0) {
        size_t n = strcspn(*e, "=");
        if (n < sizeof name)
          snprintf(name, sizeof name, "%.*s", (int)n, *e);
        break;
      }
    }
    if (name[0] == '\0' || unsetenv(name) != 0)
      return;
  }
}

static void usage(FILE *out) {
  fprintf(out, "usage: ofl-info [--json] [--markdown] [-v|--verbose] "
               "[--version]\n"
               "  version, build features, backends, devices, pinned-memory "
               "limit,\n  disk tier and OFL_* settings of this ofl "
               "installation;\n  exits 1 when an OFL_* value is invalid, "
               "an OFL_* variable unknown\n  or the backend OFL_BACKEND "
               "names is not available\n"
               "  --markdown: only the table of every OFL_* variable, as "
               "markdown\n");
}

int main(int argc, char **argv) {
  bool json = false, markdown = false, verbose = false;
  for (int i = 1; i < argc; i++) {
    if (strcmp(argv[i], "--json") == 0) {
      json = true;
    } else if (strcmp(argv[i], "--markdown") == 0) {
      markdown = true;
    } else if (strcmp(argv[i], "-v") == 0 || strcmp(argv[i], "--verbose") == 0) {
      verbose = true;
    } else if (strcmp(argv[i], "--version") == 0) {
      printf("ofl-info %s\n", OFL_VERSION_STRING);
      return 0;
    } else if (strcmp(argv[i], "-h") == 0 || strcmp(argv[i], "--help") == 0) {
      usage(stdout);
      return 0;
    } else {
      usage(stderr);
      return 2;
    }
  }
  static info_t in;
  if (markdown) {
    clear_ofl_env();
    ofl_log_set_handler(quiet_log, NULL);
    probe_config(&in);
    print_markdown(&in, stdout);
    return ferror(stdout) || in.nvars == 0 ? 1 : 0;
  }
  /* The probes expect refusals (no GPU, no io_uring): their WARN lines are
   * the answers printed below, so the log stays quiet unless -v. */
  if (!verbose)
    ofl_log_set_handler(quiet_log, NULL);
  check_config(&in);
  probe_config(&in);
  probe_backends(&in, verbose);
  probe_devices(&in);
  probe_nccl(&in);
  in.memlock_ok = getrlimit(RLIMIT_MEMLOCK, &in.memlock) == 0;
  probe_disk(&in);
  check_backend(&in);
  if (!verbose)
    ofl_log_set_handler(NULL, NULL);
  /* The verdict first, on stderr, so that a check reads it at the top. */
  for (int i = 0; i < in.nproblems; i++)
    fprintf(stderr, "ofl-info: error: %s\n", in.problems[i]);
  if (in.nproblems > 0)
    fprintf(stderr,
            "ofl-info: %d problem(s) with this configuration (exit 1); the "
            "report follows\n",
            in.nproblems);
  fflush(stderr);
  if (json)
    print_json(&in, stdout);
  else
    print_text(&in, stdout);
  return ferror(stdout) || in.nproblems > 0 ? 1 : 0;
}
