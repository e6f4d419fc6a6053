/* ofl: CRC32C (Castagnoli) per disk extent. SSE4.2 crc32 instructions when
 * the CPU has them (checked once at run time), else a slicing-by-8 table. */
#include "disk/disk_internal.h"

#include <stdatomic.h>
#include <string.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define OFL__CRC_X86 1
#include <cpuid.h>
#include <nmmintrin.h>
#else
#define OFL__CRC_X86 0
#endif

#define POLY 0x82F63B78u /* reflected Castagnoli polynomial */

static uint32_t table[8][256];
static pthread_once_t table_once = PTHREAD_ONCE_INIT;

static void table_init(void) {
  for (uint32_t i = 0; i < 256; i++) {
    uint32_t c = i;
    for (int k = 0; k < 8; k++)
      c = (c & 1) ? (c >> 1) ^ POLY : c >> 1;
    table[0][i] = c;
  }
  for (uint32_t i = 0; i < 256; i++)
    for (int t = 1; t < 8; t++)
      table[t][i] = (table[t - 1][i] >> 8) ^ table[0][table[t - 1][i] & 0xff];
}

uint32_t ofl__crc32c_sw(uint32_t crc, const void *data, size_t bytes) {
  pthread_once(&table_once, table_init);
  const unsigned char *p = data;
  uint32_t c = ~crc;
  while (bytes >= 8) {
    uint64_t w;
    memcpy(&w, p, 8); /* little endian assumed (x86-64, aarch64 linux) */
    w ^= c;
    c = table[7][w & 0xff] ^ table[6][(w >> 8) & 0xff] ^
        table[5][(w >> 16) & 0xff] ^ table[4][(w >> 24) & 0xff] ^
        table[3][(w >> 32) & 0xff] ^ table[2][(w >> 40) & 0xff] ^
        table[1][(w >> 48) & 0xff] ^ table[0][w >> 56];
    p += 8;
    bytes -= 8;
  }
  while (bytes--)
    c = (c >> 8) ^ table[0][(c ^ *p++) & 0xff];
  return ~c;
}

#if OFL__CRC_X86
__attribute__((target("sse4.2"))) static uint32_t
crc_hw(uint32_t crc, const void *data, size_t bytes) {
  const unsigned char *p = data;
  uint64_t c = ~crc;
  while (bytes > 0 && ((uintptr_t)p & 7) != 0) {
    c = _mm_crc32_u8((uint32_t)c, *p++);
    bytes--;
  }
  while (bytes >= 8) {
    uint64_t w;
    memcpy(&w, p, 8);
    c = _mm_crc32_u64(c, w);
    p += 8;
    bytes -= 8;
  }
  while (bytes--)
    c = _mm_crc32_u8((uint32_t)c, *p++);
  return ~(uint32_t)c;
}

static int hw_probe(void) {
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d))
    return 0;
  return (c & bit_SSE4_2) != 0;
}
#endif

static _Atomic int hw_state = -1; /* -1 unknown, 0 no, 1 yes */

int ofl__crc32c_hw_available(void) {
  int s = atomic_load_explicit(&hw_state, memory_order_relaxed);
  if (s < 0) {
#if OFL__CRC_X86
    s = hw_probe();
#else
    s = 0;
#endif
    atomic_store_explicit(&hw_state, s, memory_order_relaxed);
  }
  return s;
}

uint32_t ofl__crc32c(uint32_t crc, const void *data, size_t bytes) {
#if OFL__CRC_X86
  if (ofl__crc32c_hw_available())
    return crc_hw(crc, data, bytes);
#endif
  return ofl__crc32c_sw(crc, data, bytes);
}
