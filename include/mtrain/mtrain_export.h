/* mtrain_export.h: MTRAIN_API, the mark of what libmtrain exports.
 *
 * The library is built with hidden visibility by default: only declarations
 * marked MTRAIN_API (the functions of the installed headers) are in the
 * shared library's dynamic symbol table; the core's, the backends' and the
 * communicators' internal functions and tables are not. Included by mtrain.h,
 * so every installed header has it. tests/exported_symbols.sh checks the
 * installed library against the headers.
 */
#ifndef MTRAIN_EXPORT_H
#define MTRAIN_EXPORT_H

#if defined(__GNUC__) || defined(__clang__)
#define MTRAIN_API __attribute__((visibility("default")))
#else
#define MTRAIN_API
#endif

#endif /* MTRAIN_EXPORT_H */
