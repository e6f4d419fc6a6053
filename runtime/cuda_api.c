/* ofl: loading the CUDA runtime and NCCL at run time (runtime/cuda_api.h).
 * One attempt per process and library, under a lock; the outcome (tables
 * filled, or why not) is kept and answered to every later caller. */
#define OFL_CUDA_API_IMPL 1
#include "runtime/cuda_api.h"

#if OFL_HAVE_CUDA

#include <dlfcn.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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
                        size_t n, char *why, size_t cap, const char **used) {
  const char *one[1] = {override};
  if (override != NULL && override[0] != '\0') {
    names = one;
    n = 1;
  }
  size_t len = 0;
  why[0] = '\0';
  for (size_t i = 0; i < n; i++) {
    dlerror();
    void *h = dlopen(names[i], RTLD_NOW | RTLD_GLOBAL);
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

static lib_state_t cudart_state = {PTHREAD_MUTEX_INITIALIZER, false,
                                   OFL_SUCCESS, ""};

ofl_status_t ofl__cudart_load(char *why, size_t cap) {
  lib_state_t *s = &cudart_state;
  pthread_mutex_lock(&s->lock);
  if (!s->tried) {
    static const char *const libs[] = {"libcudart.so.13", "libcudart.so.12"};
    const char *used = NULL, *missing = NULL;
    char tried[400];
    void *h =
        open_first(getenv("OFL_CUDART_LIBRARY"), libs,
                   sizeof libs / sizeof libs[0], tried, sizeof tried, &used);
    ofl__cudart_api_t t = {0};
    if (h != NULL) {
      OFL__CUDART_FUNCS(OFL__API_LOAD)
    }
    if (settle(s, h, used, tried, missing, OFL_ERR_NO_DEVICE,
               "the cuda runtime", "OFL_CUDART_LIBRARY")) {
      ofl__cu = t;
      OFL_INFO(OFL_SUBSYS_DEVICE, "cuda runtime loaded from %s", used);
    } else {
      OFL_INFO(OFL_SUBSYS_DEVICE, "%s", s->why);
    }
  }
  return answer(s, why, cap);
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
                   sizeof libs / sizeof libs[0], tried, sizeof tried, &used);
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
