/* Criterion's new/assert.h for the unit tests, with gt() made strict:
 * Criterion 2.4.1 defines gt(Tag, a, b) in C as !(a < b), that is a >= b
 * (its CRI_BINOP_T_GT lacks the equality test), so gt(sz, n, 0) passed for
 * n == 0. Every Criterion test includes this instead of new/assert.h. */
#ifndef OFL_TESTS_CR_ASSERT_H
#define OFL_TESTS_CR_ASSERT_H

#include <criterion/new/assert.h>

#undef gt
#define gt(Tag, Actual, Reference) not(le(Tag, Actual, Reference))

#endif
