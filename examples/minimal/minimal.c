/* minimal.c: one pipeline stage, two microbatches, one offloaded group each.
 * Build: cc minimal.c $(pkg-config --cflags --libs ofl) -o minimal */
#include <stdio.h>

#include <ofl/ofl.h>

#define CHECK(call)                                                            \
  do {                                                                         \
    ofl_status_t st_ = (call);                                                 \
    if (st_ != OFL_SUCCESS) {                                                  \
      fprintf(stderr, "%s: %s: %s\n", #call, ofl_status_str(st_),              \
              ofl_last_error());                                               \
      return 1;                                                                \
    }                                                                          \
  } while (0)

enum { MICROBATCHES = 2, ITERATIONS = 3 };

int main(void) {
  ofl_device_t *dev; /* cuda where a GPU is, else the host backend */
  CHECK(ofl_device_open(NULL, &dev));
  ofl_pool_params_t pp = OFL_POOL_PARAMS_INIT; /* activations, reloads */
  ofl_pool_t *acts;
  CHECK(ofl_pool_create(dev, &pp, &acts));
  ofl_comm_t *comm; /* under mpirun: ofl_comm_create_mpi_handle */
  CHECK(ofl_comm_create_self(NULL, &comm));

  ofl_manager_params_t mp = OFL_MANAGER_PARAMS_INIT; /* unset: OFL_* */
  mp.device = dev;
  mp.device_pool = acts;
  mp.groups = "core_attn";        /* the group names to offload */
  mp.min_offload_bytes = 1 << 20; /* smaller tensors stay */
  mp.comm = comm;                 /* where the summary is gathered */
  mp.summary_out = stdout;        /* rank 0 prints it after the warmup */
  ofl_manager_t *m;
  CHECK(ofl_manager_create(&mp, &m));

  const int64_t shape[2] = {1024, 1024}; /* f32 [seq, hidden]: 4 MiB */
  ofl_tensor_t *q[MICROBATCHES], *k[MICROBATCHES];
  ofl_tag_t tq[MICROBATCHES], tk[MICROBATCHES];
  uint64_t before = 0;
  for (int it = 0; it < ITERATIONS; it++) { /* iteration 0: the warmup */
    /* forward of every microbatch, then their backward in reverse order,
     * as a pipeline stage does while microbatches are in flight */
    for (int mb = 0; mb < MICROBATCHES; mb++) {
      CHECK(ofl_pool_alloc(acts, shape, 2, OFL_DTYPE_F32, NULL, &q[mb]));
      CHECK(ofl_pool_alloc(acts, shape, 2, OFL_DTYPE_F32, NULL, &k[mb]));
      /* ... the compute stream writes q and k ... */
      CHECK(ofl_manager_chunk_begin(m, 1, 0)); /* vpp 1, virtual stage 0 */
      CHECK(ofl_manager_group_start(m, "core_attn"));
      CHECK(ofl_manager_tensor_push(m, q[mb], &tq[mb])); /* held until pop */
      CHECK(ofl_manager_tensor_push(m, k[mb], &tk[mb]));
      CHECK(ofl_manager_group_commit(m, "core_attn", NULL, 0, 0)); /* D2H */
    }
    for (int mb = MICROBATCHES - 1; mb >= 0; mb--) {
      CHECK(ofl_manager_group_backward_begin(m, "core_attn")); /* reload */
      CHECK(ofl_manager_tensor_pop(m, tk[mb], &k[mb])); /* device again */
      CHECK(ofl_manager_tensor_pop(m, tq[mb], &q[mb]));
      /* ... the backward reads q and k ... */
      CHECK(ofl_manager_group_backward_end(m, "core_attn")); /* prefetch */
      CHECK(ofl_tensor_destroy(k[mb]));
      CHECK(ofl_tensor_destroy(q[mb]));
    }
    CHECK(ofl_manager_reset(m)); /* end of the iteration */
    ofl_manager_stats_t st;
    ofl_manager_get_stats(m, &st);
    printf("iteration %d%s: offloaded %llu bytes\n", it,
           it == 0 ? " (warmup)" : "",
           (unsigned long long)(st.offloaded_bytes - before));
    before = st.offloaded_bytes;
  }
  ofl_manager_stats_t st;
  ofl_manager_get_stats(m, &st);
  printf("offloaded %llu bytes in %llu tensors\n",
         (unsigned long long)st.offloaded_bytes,
         (unsigned long long)st.offloaded_tensors);
  ofl_manager_destroy(m);
  ofl_comm_destroy(comm);
  ofl_pool_destroy(acts);
  ofl_device_close(dev);
  return 0;
}
