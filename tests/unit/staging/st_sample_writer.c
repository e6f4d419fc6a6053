/* Writes a safetensors file with one tensor of every dtype holding values a
 * reader can recompute (see check_safetensors.py, which parses it with the
 * Python standard library only).
 * Usage: st_sample_writer PATH            (ofl_safetensors_write)
 *        st_sample_writer PATH --stager   (device tensors staged by an
 *                                          async cached stager, saved in the
 *                                          background) */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <ofl/ofl.h>

/* The value rule check_safetensors.py recomputes for element j. */
static void fill(ofl_dtype_t dt, void *p, size_t n) {
  for (size_t j = 0; j < n; j++) {
    float f = ((float)j - 3.0f) * 0.25f;
    switch (dt) {
    case OFL_DTYPE_F32: memcpy((char *)p + 4 * j, &f, 4); break;
    case OFL_DTYPE_F16: {
      /* (j - 3) / 4 for small j is exact in binary16: build it by hand */
      uint16_t h = 0;
      if (f != 0.0f) {
        float a = f < 0 ? -f : f;
        int e = 0;
        while (a >= 2.0f) a /= 2.0f, e++;
        while (a < 1.0f) a *= 2.0f, e--;
        uint16_t mant = (uint16_t)((a - 1.0f) * 1024.0f);
        h = (uint16_t)((f < 0 ? 0x8000 : 0) | ((e + 15) << 10) | mant);
      }
      memcpy((char *)p + 2 * j, &h, 2);
      break;
    }
    case OFL_DTYPE_BF16: {
      uint32_t bits;
      memcpy(&bits, &f, 4);
      uint16_t b = (uint16_t)(bits >> 16);
      memcpy((char *)p + 2 * j, &b, 2);
      break;
    }
    case OFL_DTYPE_I64: {
      int64_t v = (int64_t)j * 1000000000000LL - 5;
      memcpy((char *)p + 8 * j, &v, 8);
      break;
    }
    case OFL_DTYPE_I32: {
      int32_t v = (int32_t)j * 100000 - 7;
      memcpy((char *)p + 4 * j, &v, 4);
      break;
    }
    case OFL_DTYPE_I16: {
      int16_t v = (int16_t)((int)j * 1000 - 30000);
      memcpy((char *)p + 2 * j, &v, 2);
      break;
    }
    case OFL_DTYPE_BOOL: ((uint8_t *)p)[j] = j % 3 == 0; break;
    case OFL_DTYPE_F64: {
      double v = f;
      memcpy((char *)p + 8 * j, &v, 8);
      break;
    }
    /* the unsigned values use the top bit: a signed reader would differ */
    case OFL_DTYPE_U16: {
      uint16_t v = (uint16_t)(65535u - (unsigned)j * 1000u);
      memcpy((char *)p + 2 * j, &v, 2);
      break;
    }
    case OFL_DTYPE_U32: {
      uint32_t v = 4000000000u - (uint32_t)j * 100000u;
      memcpy((char *)p + 4 * j, &v, 4);
      break;
    }
    case OFL_DTYPE_U64: {
      uint64_t v = 18000000000000000000ull - (uint64_t)j * 1000000000000ull;
      memcpy((char *)p + 8 * j, &v, 8);
      break;
    }
    default: ((uint8_t *)p)[j] = (uint8_t)((j * 7 + 1) & 0xff); break;
    }
  }
}

/* Copies the entries into device tensors, stages them twice (async, cached:
 * the second stage reuses the pinned copy) and saves the second. */
static ofl_status_t save_through_stager(const char *path,
                                        const ofl_safetensors_entry_t *e,
                                        const ofl_safetensors_kv_t *meta) {
  ofl_device_t *dev = NULL;
  ofl_stager_t *s = NULL;
  ofl_tensor_t *t[OFL_DTYPE_COUNT] = {0};
  ofl_named_tensor_t nt[OFL_DTYPE_COUNT];
  ofl_staged_t *set = NULL;
  ofl_save_future_t *f = NULL;
  ofl_status_t st = ofl_device_open(NULL, &dev);
  ofl_stager_params_t p = OFL_STAGER_PARAMS_INIT;
  p.cache_staged = 1;
  p.async_staging = 1;
  if (st == OFL_SUCCESS)
    st = ofl_stager_create(dev, &p, &s);
  for (int d = 0; d < OFL_DTYPE_COUNT && st == OFL_SUCCESS; d++) {
    void *mem = NULL;
    st = ofl_device_malloc(dev, e[d].bytes, &mem);
    if (st == OFL_SUCCESS)
      st = ofl_tensor_wrap(mem, e[d].shape, e[d].ndim, e[d].dtype,
                           OFL_LOC_DEVICE, NULL, NULL, &t[d]);
    if (st == OFL_SUCCESS)
      st = ofl_memcpy_async(mem, e[d].data, e[d].bytes, OFL_COPY_H2D,
                            ofl_device_compute_stream(dev));
    nt[d] = (ofl_named_tensor_t){e[d].name, t[d]};
  }
  for (int round = 0; round < 2 && st == OFL_SUCCESS; round++) {
    ofl_staged_release(set);
    set = NULL;
    st = ofl_stager_stage(s, nt, OFL_DTYPE_COUNT, &set);
    if (st == OFL_SUCCESS)
      st = ofl_stager_synchronize(s, -1);
  }
  if (st == OFL_SUCCESS)
    st = ofl_stager_save(s, set, path, meta, 1, &f);
  if (st == OFL_SUCCESS)
    st = ofl_save_wait(f, -1);
  ofl_save_release(f);
  ofl_staged_release(set);
  ofl_stager_destroy(s);
  for (int d = 0; d < OFL_DTYPE_COUNT; d++) {
    if (t[d] != NULL) {
      void *mem = ofl_tensor_data(t[d]);
      ofl_tensor_destroy(t[d]);
      ofl_device_free(dev, mem);
    }
  }
  ofl_device_close(dev);
  return st;
}

int main(int argc, char **argv) {
  int stager_mode = argc == 3 && strcmp(argv[2], "--stager") == 0;
  if (argc != 2 && !stager_mode) {
    fprintf(stderr, "usage: %s PATH [--stager]\n", argv[0]);
    return 2;
  }
  ofl_safetensors_entry_t e[OFL_DTYPE_COUNT];
  char names[OFL_DTYPE_COUNT][48];
  void *bufs[OFL_DTYPE_COUNT];
  for (int d = 0; d < OFL_DTYPE_COUNT; d++) {
    const char *dn = ofl_safetensors_dtype_name((ofl_dtype_t)d);
    /* names with characters JSON must escape */
    snprintf(names[d], sizeof names[d], "model.\"%s\"\\w\t%d", dn, d);
    int64_t rows = 3 + d % 4, cols = 5;
    size_t elem = ofl_dtype_size((ofl_dtype_t)d);
    size_t n = (size_t)(rows * cols);
    bufs[d] = malloc(n * elem);
    fill((ofl_dtype_t)d, bufs[d], n);
    e[d] = (ofl_safetensors_entry_t){.name = names[d], .dtype = (ofl_dtype_t)d,
                                     .ndim = 2, .shape = {rows, cols},
                                     .data = bufs[d], .bytes = n * elem};
  }
  ofl_safetensors_kv_t meta[2] = {{"format", "pt"}, {"writer", "ofl"}};
  ofl_status_t st;
  if (stager_mode)
    st = save_through_stager(argv[1], e, meta + 1);
  else
    st = ofl_safetensors_write(argv[1], e, OFL_DTYPE_COUNT, meta, 2);
  for (int d = 0; d < OFL_DTYPE_COUNT; d++)
    free(bufs[d]);
  if (st != OFL_SUCCESS) {
    fprintf(stderr, "write failed: %s: %s\n", ofl_status_str(st),
            ofl_last_error());
    return 1;
  }
  return 0;
}
