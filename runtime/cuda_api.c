/* ofl: loading the CUDA runtime and NCCL at run time (runtime/cuda_api.h).
 * One attempt per process and library, under a lock; the outcome (tables
 * filled, or why not) is kept and answered to every later caller. */
#define OFL_CUDA_API_IMPL 1
#include "runtime/cuda_api.h"

#if OFL_HAVE_CUDA

#include <dlfcn.h>
#include <limits.h>
#include <link.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "runtime/internal.h"

ofl__cudart_api_t ofl__cu;
#if OFL_HAVE_NCCL
ofl__nccl_api_t ofl__nccl;
#endif

typedef struct lib_state {
  pthread_mutex_t lock;
  bool tried;
  ofl_status_t status;
  char why[512];
} lib_state_t;

/* Opens the first library of the override (when set) or of names that
 * dlopen finds; why lists what each attempt answered. */
static void *open_first(const char *override, const char *const *names,
                        size_t n, char *why, size_t cap, const char **used,
                        int flags) {
  const char *one[1] = {override};
  if (override != NULL && override[0] != '\0') {
    names = one;
    n = 1;
  }
  size_t len = 0;
  why[0] = '\0';
  for (size_t i = 0; i < n; i++) {
    dlerror();
    void *h = dlopen(names[i], flags);
    if (h != NULL) {
      *used = names[i];
      return h;
    }
    const char *err = dlerror();
    if (len < cap) {
      int w = snprintf(why + len, cap - len, "%s%s", len ? "; " : "",
                       err != NULL ? err : names[i]);
      len += w > 0 ? (size_t)w : 0;
    }
  }
  return NULL;
}

/* Fills one table field from h; a missing symbol ends the filling (the
 * first one missing is named). */
/* Functions a runtime may lack without making ofl unusable: the code that
 * calls them checks the table entry first. cudaStreamGetDevice came with
 * CUDA 12.8, and PyTorch wheels bring older 12.x runtimes. */
static bool optional(const char *name) {
  return strcmp(name, "cudaStreamGetDevice") == 0;
}

#define OFL__API_LOAD(name)                                                    \
  if (missing == NULL) {                                                       \
    *(void **)&t.name = dlsym(h, #name);                                       \
    if (t.name == NULL && !optional(#name))                                    \
      missing = #name;                                                         \
  }

/* The answer of a load attempt (h NULL: not found; missing: an entry point
 * the library lacks), kept for every later call. */
static bool settle(lib_state_t *s, void *h, const char *used, const char *tried,
                   const char *missing, ofl_status_t fail, const char *what,
                   const char *var) {
  if (h == NULL) {
    s->status = fail;
    snprintf(s->why, sizeof s->why,
             "%s was not found (%s); install it or set %s", what, tried, var);
  } else if (missing != NULL) {
    s->status = fail;
    snprintf(s->why, sizeof s->why,
             "%s has no %s: too old for this build of ofl", used, missing);
  } else {
    s->status = OFL_SUCCESS;
  }
  s->tried = true;
  return s->status == OFL_SUCCESS;
}

/* Unlocks s and returns its answer (the reason in why). */
static ofl_status_t answer(lib_state_t *s, char *why, size_t cap) {
  ofl_status_t st = s->status;
  if (why != NULL && cap > 0)
    snprintf(why, cap, "%s", st == OFL_SUCCESS ? "" : s->why);
  pthread_mutex_unlock(&s->lock);
  return st;
}

/* ---- the CUDA runtime: one per process ------------------------------------
 * A process holds one CUDA runtime: PyTorch's libcudart.so.12 next to a
 * libcudart.so.13 of ofl's would give two runtimes (and, on a driver older
 * than r580, a second one that sees no device). So a runtime the process has
 * loaded already is used; only when there is none does ofl load one, and a
 * libcudart.so.13 that the driver refuses gives way to a libcudart.so.12. */

static lib_state_t cudart_state = {PTHREAD_MUTEX_INITIALIZER, false,
                                   OFL_SUCCESS, ""};
/* Which runtime the table uses and why (set once, under cudart_state.lock):
 * the name it was opened by and the file that name resolved to (each a path
 * of up to PATH_MAX bytes), then how it was chosen (settle_cudart's how[]). */
#define CUDART_HOW_CAP 160
static char cudart_choice[2 * PATH_MAX + CUDART_HOW_CAP + 8];

/* Names the loader resolves to a CUDA runtime, newest first. */
static const char *const cudart_names[] = {"libcudart.so.13",
                                           "libcudart.so.12",
                                           "libcudart.so.11.0", "libcudart.so"};
#define N_CUDART_NAMES (sizeof cudart_names / sizeof cudart_names[0])

/* A loaded object whose file name starts with libcudart and has .so in it
 * (wheels that bundle a renamed copy: libcudart-1a2b3c4d.so.12). */
static int find_loaded_cudart(struct dl_phdr_info *info, size_t size,
                              void *arg) {
  (void)size;
  const char *path = info->dlpi_name;
  if (path == NULL || path[0] == '\0')
    return 0;
  const char *base = strrchr(path, '/');
  base = base != NULL ? base + 1 : path;
  if (strncmp(base, "libcudart", 9) != 0 || strstr(base, ".so") == NULL)
    return 0;
  snprintf((char *)arg, PATH_MAX, "%s", path);
  return 1;
}

/* The CUDA runtime the process has loaded already (not loading one), or
 * NULL; its name (soname or path) in name. */
static void *loaded_cudart(char *name, size_t cap) {
  for (size_t i = 0; i < N_CUDART_NAMES; i++) {
    void *h = dlopen(cudart_names[i], RTLD_NOW | RTLD_NOLOAD);
    if (h != NULL) {
      snprintf(name, cap, "%s", cudart_names[i]);
      return h;
    }
  }
  char path[PATH_MAX] = "";
  if (dl_iterate_phdr(find_loaded_cudart, path) == 0)
    return NULL;
  void *h = dlopen(path, RTLD_NOW | RTLD_NOLOAD);
  if (h != NULL)
    snprintf(name, cap, "%s", path);
  return h;
}

/* Fills t from h; the first entry point h lacks, or NULL. */
static const char *fill_cudart(void *h, ofl__cudart_api_t *t) {
  const char *missing = NULL;
  ofl__cudart_api_t z = {0};
  *t = z;
#define OFL__CUDART_FILL(name)                                                 \
  if (missing == NULL) {                                                       \
    *(void **)&t->name = dlsym(h, #name);                                      \
    if (t->name == NULL && !optional(#name))                                   \
      missing = #name;                                                         \
  }
  OFL__CUDART_FUNCS(OFL__CUDART_FILL)
#undef OFL__CUDART_FILL
  return missing;
}

/* The runtime's first call (it initialises the runtime, loading the driver)
 * and its answer; the error is not left as the thread's last error. */
static cudaError_t first_call(const ofl__cudart_api_t *t) {
  int n = 0;
  cudaError_t e = t->cudaGetDeviceCount(&n);
  if (e != cudaSuccess)
    (void)t->cudaGetLastError();
  return e;
}

/* Whether the NVIDIA driver library is there: a runtime that initialised has
 * loaded it already; else it is looked for as the runtime would (kept
 * loaded, as the runtime would keep it). */
static bool driver_library_found(void) {
  void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
  if (h == NULL)
    h = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_LOCAL);
  dlerror();
  return h != NULL;
}

static bool gpu_device_nodes(void) {
  return access("/dev/nvidiactl", F_OK) == 0 ||
         access("/dev/nvidia0", F_OK) == 0;
}

static void cuda_version(int v, char *buf, size_t cap) {
  snprintf(buf, cap, "%d.%d", v / 1000, (v % 1000) / 10);
}

/* Why runtime `name` (table t) cannot be used after its first call answered
 * e: no GPU or no driver, a driver too old, no device visible. The cause
 * comes first (callers keep about 200 characters); `extra` is appended
 * (what a fallback found). */
static void explain(const ofl__cudart_api_t *t, const char *name,
                    cudaError_t e, const char *extra, char *why, size_t cap) {
  if (e == cudaErrorInsufficientDriver && !driver_library_found()) {
    /* The runtime says "insufficient driver" when there is none at all. */
    if (gpu_device_nodes())
      snprintf(why, cap,
               "the NVIDIA driver library libcuda.so.1 is not found though "
               "/dev/nvidia* exists (a container without the driver's "
               "libraries?); %s needs it",
               name);
    else
      snprintf(why, cap,
               "no NVIDIA GPU or driver on this machine (no libcuda.so.1, no "
               "/dev/nvidia*)");
    return;
  }
  if (e == cudaErrorInsufficientDriver) {
    int dv = 0, rv = 0;
    char d[16] = "unknown", r[16] = "unknown";
    if (t->cudaDriverGetVersion(&dv) == cudaSuccess && dv > 0)
      cuda_version(dv, d, sizeof d);
    if (t->cudaRuntimeGetVersion(&rv) == cudaSuccess && rv > 0)
      cuda_version(rv, r, sizeof r);
    (void)t->cudaGetLastError();
    snprintf(why, cap,
             "the driver is too old for this CUDA runtime: driver CUDA %s, "
             "%s CUDA %s (CUDA 13 needs r580+); upgrade the driver or use a "
             "CUDA 12 runtime%s",
             d, name, r, extra);
    return;
  }
  const char *es = t->cudaGetErrorString(e);
  if (e == cudaErrorNoDevice) {
    const char *vis = getenv("CUDA_VISIBLE_DEVICES");
    if (vis != NULL)
      snprintf(why, cap,
               "no cuda device visible: CUDA_VISIBLE_DEVICES='%s' selects "
               "none of this machine's GPUs",
               vis);
    else
      snprintf(why, cap, "no cuda device: the driver reports none (%s)", es);
    return;
  }
  snprintf(why, cap, "no usable cuda driver: %s answered %s", name, es);
}

/* Loads the first of cudart_names[0..1] the loader finds (RTLD_LOCAL until
 * chosen): libcudart.so.13 unless the driver refuses it and a
 * libcudart.so.12 works (what the fallback found goes to extra). The
 * refused runtime stays mapped, local and unused: unloading a runtime that
 * began to initialise is not safe. */
static void *load_cudart(ofl__cudart_api_t *t, const char **used,
                         const char **missing, cudaError_t *first, char *how,
                         size_t how_cap, char *tried, size_t tried_cap,
                         char *extra, size_t extra_cap) {
  void *h = open_first(NULL, cudart_names, 2, tried, tried_cap, used,
                       RTLD_NOW | RTLD_LOCAL);
  if (h == NULL || (*missing = fill_cudart(h, t)) != NULL)
    return h;
  snprintf(how, how_cap, "loaded by ofl");
  *first = first_call(t);
  if (*first != cudaErrorInsufficientDriver ||
      strcmp(*used, "libcudart.so.13") != 0 || !driver_library_found())
    return h;
  char tried12[256];
  const char *used12 = NULL;
  void *h12 = open_first(NULL, cudart_names + 1, 1, tried12, sizeof tried12,
                         &used12, RTLD_NOW | RTLD_LOCAL);
  ofl__cudart_api_t t12;
  if (h12 == NULL || fill_cudart(h12, &t12) != NULL) {
    snprintf(extra, extra_cap, " (no libcudart.so.12 to fall back to: %s)",
             h12 == NULL ? tried12 : "it lacks entry points ofl needs");
    return h;
  }
  cudaError_t e12 = first_call(&t12);
  if (e12 == cudaErrorInsufficientDriver) {
    snprintf(extra, extra_cap, " (libcudart.so.12 was refused too)");
    return h;
  }
  *t = t12;
  *used = used12;
  *first = e12;
  snprintf(how, how_cap,
           "loaded by ofl: the driver refused libcudart.so.13 "
           "(cudaErrorInsufficientDriver)");
  return h12;
}

/* Ends a line that snprintf cut at cap bytes with a visible mark. */
static void mark_truncated(char *buf, size_t cap) {
  static const char mark[] = " ... (cut)";
  if (cap >= sizeof mark)
    memcpy(buf + cap - sizeof mark, mark, sizeof mark);
}

/* Fills the table: OFL_CUDART_LIBRARY when set, else a runtime the process
 * has loaded, else one ofl loads (load_cudart). Then the first call, which
 * says whether the runtime can be used at all. */
static void settle_cudart(lib_state_t *s) {
  const char *override = getenv("OFL_CUDART_LIBRARY");
  const char *used = NULL, *missing = NULL;
  char tried[400] = "", how[CUDART_HOW_CAP] = "", name[PATH_MAX] = "";
  char extra[300] = "";
  cudaError_t first = cudaSuccess;
  bool called = false;
  ofl__cudart_api_t t = {0};
  void *h = NULL;
  if (override != NULL && override[0] != '\0') {
    h = open_first(override, NULL, 0, tried, sizeof tried, &used,
                   RTLD_NOW | RTLD_GLOBAL);
    snprintf(how, sizeof how, "OFL_CUDART_LIBRARY");
  } else if ((h = loaded_cudart(name, sizeof name)) != NULL) {
    used = name;
    snprintf(how, sizeof how, "already loaded by the process");
  } else {
    h = load_cudart(&t, &used, &missing, &first, how, sizeof how, tried,
                    sizeof tried, extra, sizeof extra);
    called = h != NULL && missing == NULL;
  }
  if (h != NULL && !called) {
    missing = fill_cudart(h, &t);
    if (missing == NULL)
      first = first_call(&t);
  }
  if (!settle(s, h, used, tried, missing, OFL_ERR_NO_DEVICE,
              "the cuda runtime", "OFL_CUDART_LIBRARY")) {
    OFL_INFO(OFL_SUBSYS_DEVICE, "%s", s->why);
    return;
  }
  /* As if linked: the driver's helpers look the runtime up globally. */
  if (dlopen(used, RTLD_NOW | RTLD_NOLOAD | RTLD_GLOBAL) == NULL)
    dlerror();
  ofl__cu = t;
  const char *file = "";
  struct link_map *lm = NULL;
  if (dlinfo(h, RTLD_DI_LINKMAP, &lm) == 0 && lm != NULL && lm->l_name &&
      strcmp(lm->l_name, used) != 0)
    file = lm->l_name;
  /* OFL_CUDART_LIBRARY may name a path longer than PATH_MAX (dlopen refuses
   * it, so only a loaded one lands here): a longer line is cut and says so. */
  int n = snprintf(cudart_choice, sizeof cudart_choice, "%s%s%s%s, %s", used,
                   file[0] ? " (" : "", file, file[0] ? ")" : "", how);
  if (n < 0 || (size_t)n >= sizeof cudart_choice)
    mark_truncated(cudart_choice, sizeof cudart_choice);
  OFL_INFO(OFL_SUBSYS_DEVICE, "cuda runtime: %s", cudart_choice);
  if (first != cudaSuccess) {
    s->status = OFL_ERR_NO_DEVICE;
    explain(&t, used, first, extra, s->why, sizeof s->why);
    OFL_INFO(OFL_SUBSYS_DEVICE, "%s", s->why);
  }
}

ofl_status_t ofl__cudart_load(char *why, size_t cap) {
  lib_state_t *s = &cudart_state;
  pthread_mutex_lock(&s->lock);
  if (!s->tried)
    settle_cudart(s);
  return answer(s, why, cap);
}

void ofl__cudart_choice(char *buf, size_t cap) {
  if (buf == NULL || cap == 0)
    return;
  pthread_mutex_lock(&cudart_state.lock);
  snprintf(buf, cap, "%s", cudart_choice);
  pthread_mutex_unlock(&cudart_state.lock);
}

#if OFL_HAVE_NCCL
static lib_state_t nccl_state = {PTHREAD_MUTEX_INITIALIZER, false, OFL_SUCCESS,
                                 ""};

ofl_status_t ofl__nccl_load(char *why, size_t cap) {
  OFL_CHECK(ofl__cudart_load(why, cap));
  lib_state_t *s = &nccl_state;
  pthread_mutex_lock(&s->lock);
  if (!s->tried) {
    static const char *const libs[] = {"libnccl.so.2"};
    const char *used = NULL, *missing = NULL;
    char tried[400];
    void *h =
        open_first(getenv("OFL_NCCL_LIBRARY"), libs,
                   sizeof libs / sizeof libs[0], tried, sizeof tried, &used,
                   RTLD_NOW | RTLD_GLOBAL);
    ofl__nccl_api_t t = {0};
    if (h != NULL) {
      OFL__NCCL_FUNCS(OFL__API_LOAD)
    }
    if (settle(s, h, used, tried, missing, OFL_ERR_NCCL, "nccl",
               "OFL_NCCL_LIBRARY")) {
      ofl__nccl = t;
      OFL_INFO(OFL_SUBSYS_COLL, "nccl loaded from %s", used);
    }
  }
  return answer(s, why, cap);
}
#endif /* OFL_HAVE_NCCL */

#else
typedef int ofl__no_cuda_api; /* ISO C wants a non-empty unit */
#endif /* OFL_HAVE_CUDA */
