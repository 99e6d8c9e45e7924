/* rows.inc again for x86-64 CPUs with AVX-512F, chosen at run time before AVX2: xxh3
 * accumulates a whole 64-byte stripe per instruction and the copy streams it in one
 * store (an array's copy and check 10-13% faster than the AVX2 build's on a Zen 5,
 * docs/benchmarks.md; measured on no other CPU: Intel's older server parts lower their
 * clock for 512-bit instructions). */
#include "rows.h"
#ifdef DECODEFS_X86_BUILDS
#pragma GCC target("avx512f,avx2")
#define READ_ROWS read_rows_avx512
#define CHECKSUM checksum_avx512
#define COPY_CHECKSUM copy_checksum_avx512
#define STREAM_BYTES 64
#include "rows.inc"
#else
typedef int decodefs_no_avx512; /* an empty file is not ISO C */
#endif
