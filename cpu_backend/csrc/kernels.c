/* kernels.c: the CPU backend's C, compiled by cpu_backend/kernels.py's `build` into one shared library.

   A unity build: this file includes the parts, in the order of their dependencies, as one translation unit. So the
   functions one part calls in another stay static (declared once in kernels.h): the compiler inlines across the
   parts as it did when they were one file, the library exports only the functions ctypes calls, and the machine
   code is what the single file gave. A part is not compiled alone.

   - common.h: vector types and inline arithmetic, NB / RMAX, the feature tests (Q4_OK, AMX_OK, VQ_OK,
     SCREEN_PAIRS, SCREEN_TILES), the weight layouts and address tags, shared helpers;
   - kernels.h: what the parts offer each other, and the library's functions;
   - codes.c: GGUF codes decoded to float32 in registers (AVX-512, or AVX2 with F16C);
   - byte_products.c: the codes by AVX512-VNNI byte products;
   - amx.c: the codes and bfloat16 weights on AMX tiles;
   - products.c: packed float32 products, and the block loops that pick a path per weight (rows_linear, rows_gated);
   - attention.c: attend, rope, kv_compact;
   - layers.c: rms_norm, attention_block, decoder_layer, decoder_stack;
   - screen.c: screen_argmax and its int8 tile products;
   - int8.c: int8 draft weights, on the screen's tile products. */
#include "common.h"
#include "kernels.h"
#include "codes.c"
#include "byte_products.c"
#include "amx.c"
#include "products.c"
#include "attention.c"
#include "layers.c"
#include "screen.c"
#include "int8.c"
