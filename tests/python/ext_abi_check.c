/* ofl._ext declares the part of libofl's API it calls in
 * python/ofl/_ext_abi.h instead of including ofl's headers (a pip install of
 * python/ builds it alone). This file holds those declarations against the
 * real ones: it does not compile when they differ. The program itself only
 * prints what it checked. */
#include <stdio.h>

#include <ofl/ofl.h>

#define OFL_EXT_ABI_WITH_OFL_HEADERS
#include "../../python/ofl/_ext_abi.h"

/* Each function's type, with ofl's enum types in place of the ext_* ones. */
#define CHECK_FN(name, ret, params)                                            \
  _Static_assert(__builtin_types_compatible_p(__typeof__(&name), ext_##name##_fn), \
                 #name " differs from python/ofl/_ext_abi.h");
OFL_EXT_FUNCTIONS(CHECK_FN)
#undef CHECK_FN

/* Without the headers the ext_* enum types are int: ofl's enums must be
 * passed as ints. */
_Static_assert(sizeof(ofl_status_t) == sizeof(int), "ofl_status_t is not int-sized");
_Static_assert(sizeof(ofl_dtype_t) == sizeof(int), "ofl_dtype_t is not int-sized");
_Static_assert(sizeof(ofl_location_t) == sizeof(int), "ofl_location_t is not int-sized");
_Static_assert(EXT_SUCCESS == OFL_SUCCESS, "OFL_SUCCESS");
_Static_assert(EXT_ERR_NO_MEMORY == OFL_ERR_NO_MEMORY, "OFL_ERR_NO_MEMORY");
_Static_assert(EXT_DTYPE_U8 == OFL_DTYPE_U8, "OFL_DTYPE_U8");
_Static_assert(EXT_LOC_DEVICE == OFL_LOC_DEVICE, "OFL_LOC_DEVICE");
_Static_assert(EXT_WRAP_RELEASE_IN_HOST_FN == OFL_WRAP_RELEASE_IN_HOST_FN,
               "OFL_WRAP_RELEASE_IN_HOST_FN");

int main(void) {
  static const char *const names[] = {
#define NAME(name, ret, params) #name,
      OFL_EXT_FUNCTIONS(NAME)
#undef NAME
  };
  printf("1..1\nok 1 - python/ofl/_ext_abi.h matches <ofl/ofl.h> (%zu functions)\n",
         sizeof names / sizeof names[0]);
  return 0;
}
