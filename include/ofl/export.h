/* ofl: export macro for the public API. */
#ifndef OFL_EXPORT_H
#define OFL_EXPORT_H

#if defined(OFL_BUILDING) && defined(__GNUC__)
#define OFL_API __attribute__((visibility("default")))
#else
#define OFL_API
#endif

/* A size_t constant in a public macro, without a C-style cast in C++
 * (headers compile cleanly under -Wold-style-cast). */
#ifdef __cplusplus
#define OFL__SIZE_C(x) (static_cast<size_t>(x))
#else
#define OFL__SIZE_C(x) ((size_t)(x))
#endif

#ifdef __cplusplus
#define OFL_EXTERN_C_BEGIN extern "C" {
#define OFL_EXTERN_C_END }
#else
#define OFL_EXTERN_C_BEGIN
#define OFL_EXTERN_C_END
#endif

#endif /* OFL_EXPORT_H */
