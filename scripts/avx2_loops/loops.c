/* The AVX2 int8 inner step's instruction mix, one core: 6 sums in registers, 12 products an iteration,
 * written in assembly so that the compiler can neither spill nor copy (docs/benchmarks.md, "Zen 3, a
 * third session"). Build with -DMODE=0..7 (run.sh builds them all; each mode's U below says what it
 * puts beside the vpmaddubsw). */
#include <stdio.h>

#include "now.h"
/* U(p, s): one product into ymm<p> (x in ymm0, codes in ymm8) and what the mode adds beside it. */
#if MODE == 0 /* + vpaddw into the 16-bit sum ymm<s> */
#define U(p, s) "vpmaddubsw %%ymm8, %%ymm0, %%ymm" #p "\n\t vpaddw %%ymm" #p ", %%ymm" #s ", %%ymm" #s "\n\t"
#elif MODE == 1 /* alone */
#define U(p, s) "vpmaddubsw %%ymm8, %%ymm0, %%ymm" #p "\n\t"
#elif MODE == 2 /* + vpxor */
#define U(p, s) "vpmaddubsw %%ymm8, %%ymm0, %%ymm" #p "\n\t vpxor %%ymm" #p ", %%ymm" #s ", %%ymm" #s "\n\t"
#elif MODE == 3 /* + vpand (the codes' unpacking) + vpaddw */
#define U(p, s) "vpand %%ymm9, %%ymm7, %%ymm8\n\t vpmaddubsw %%ymm8, %%ymm0, %%ymm" #p "\n\t vpaddw %%ymm" #p ", %%ymm" #s ", %%ymm" #s "\n\t"
#elif MODE == 4 /* + vpbroadcastd of x from memory + vpaddw */
#define U(p, s) "vpbroadcastd (%0), %%ymm0\n\t vpmaddubsw %%ymm8, %%ymm0, %%ymm" #p "\n\t vpaddw %%ymm" #p ", %%ymm" #s ", %%ymm" #s "\n\t"
#elif MODE == 5 /* + vpsrlw and vpand + vpaddw */
#define U(p, s) "vpsrlw $4, %%ymm7, %%ymm8\n\t vpand %%ymm9, %%ymm8, %%ymm8\n\t vpmaddubsw %%ymm8, %%ymm0, %%ymm" #p "\n\t vpaddw %%ymm" #p ", %%ymm" #s ", %%ymm" #s "\n\t"
#elif MODE == 6 /* + vpaddd */
#define U(p, s) "vpmaddubsw %%ymm8, %%ymm0, %%ymm" #p "\n\t vpaddd %%ymm" #p ", %%ymm" #s ", %%ymm" #s "\n\t"
#elif MODE == 7 /* into vpmaddwd */
#define U(p, s) "vpmaddubsw %%ymm8, %%ymm0, %%ymm" #p "\n\t vpmaddwd %%ymm" #p ", %%ymm9, %%ymm" #s "\n\t"
#endif
/* Six products (six independent sums), twice: 12 an iteration. */
#define SIX U(1, 10) U(2, 11) U(3, 12) U(4, 13) U(5, 14) U(6, 15)
int main(void) {
    long n = 100000000;
    const double t0 = now();
    for (long i = 0; i < n; i++)
        __asm__ volatile(SIX SIX::"r"(&n)
                         : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm10", "xmm11",
                           "xmm12", "xmm13", "xmm14", "xmm15", "memory");
    printf("mode %d: %.2f G vpmaddubsw a second (divide by the clock for a cycle)\n", MODE, n * 12 / (now() - t0) / 1e9);
}
