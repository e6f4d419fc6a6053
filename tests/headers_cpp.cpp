// Every public header of ofl, included from C++ under -Wall -Wextra -Werror,
// and -Wold-style-cast -Wshadow (switched on here, as errors, so that the
// headers' macros and declarations are checked whatever flags the build
// passes): a C++ application compiling with them must not see warnings
// from ofl's headers.
#pragma GCC diagnostic error "-Wold-style-cast"
#pragma GCC diagnostic error "-Wshadow"
#include <ofl/ofl.h>
#include <ofl/ofl.hpp>

#include <cstdio>
#include <cstring>

int main() {
  // The status list is usable from C++ and every code has a description.
  int bad = 0;
#define OFL__CHECK_STATUS(name, value, text)                                   \
  if (std::strcmp(ofl_status_str(name), text) != 0) {                          \
    std::printf("status %d text mismatch\n", value);                           \
    ++bad;                                                                     \
  }
  OFL_STATUS_LIST(OFL__CHECK_STATUS)
#undef OFL__CHECK_STATUS
  // Every initializer and constant macro expands without a C-style cast.
  ofl_device_params_t params = OFL_DEVICE_PARAMS_INIT;
  ofl_pool_params_t pool = OFL_POOL_PARAMS_INIT;
  ofl_manager_params_t manager = OFL_MANAGER_PARAMS_INIT;
  ofl_comm_params_t comm = OFL_COMM_PARAMS_INIT;
  ofl_disk_params_t disk = OFL_DISK_PARAMS_INIT;
  ofl_stager_params_t stager = OFL_STAGER_PARAMS_INIT;
  (void)params;
  (void)pool;
  (void)manager;
  (void)comm;
  (void)stager;
  ofl_tag_t tag = OFL_TAG_INVALID;
  size_t sizes[] = {OFL_DISK_FROM_ENV, OFL_POOL_PAGE_BYTES,
                    OFL_POOL_BUDGET_FROM_ENV, OFL_SAFETENSORS_NAME_MAX,
                    OFL_SAFETENSORS_HEADER_MAX};
  if (tag != 0 || disk.budget_bytes != sizes[0] || sizes[1] != 4096 ||
      OFL_TIMEOUT_DEFAULT != -1 || OFL_MAX_DIMS <= 0 ||
      OFL_BYTE_TABLE_NAME_MAX <= 0) {
    std::printf("constant mismatch\n");
    ++bad;
  }
  std::printf("%s\n", bad == 0 ? "ok" : "mismatch");
  return bad == 0 ? 0 : 1;
}
