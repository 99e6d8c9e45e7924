/* rows.inc again for x86-64 CPUs with AVX2 (xxh3 twice as fast), chosen at run time. */
#include "rows.h"
#ifdef DECODEFS_X86_BUILDS
#pragma GCC target("avx2")
#define READ_ROWS read_rows_avx2
#define CHECKSUM checksum_avx2
#define COPY_CHECKSUM copy_checksum_avx2
#define STREAM_BYTES 32
#include "rows.inc"
#else
typedef int decodefs_no_avx2; /* an empty file is not ISO C */
#endif
