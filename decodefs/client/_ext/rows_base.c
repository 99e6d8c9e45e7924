/* rows.inc for any CPU: xxh3 with the compiler's default vector code (SSE2 on x86-64). */
#include "rows.h" /* first: it says which system interfaces */
#define READ_ROWS read_rows_base
#define CHECKSUM checksum_base
#define COPY_CHECKSUM copy_checksum_base
#include "rows.inc"
