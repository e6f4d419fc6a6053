// Every public header of ofl, included from C++ under -Wall -Wextra -Werror.
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
  ofl_device_params_t params = OFL_DEVICE_PARAMS_INIT;
  (void)params;
  std::printf("%s\n", bad == 0 ? "ok" : "mismatch");
  return bad == 0 ? 0 : 1;
}
