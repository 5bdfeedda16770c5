/* The AVX2 int8 inner step's instruction mix, one core: 6 sums in registers, 12 products an iteration,
 * written in assembly so that the compiler can neither spill nor copy (docs/benchmarks.md, "Zen 3, a
 * third session"). Build with -DMODE=0..7 (run.sh builds them all):
 *   0 vpmaddubsw + vpaddw into 16-bit sums (the kernels' inner step)   1 vpmaddubsw alone
 *   2 vpmaddubsw + vpxor                 3 + vpand (an unpacking)      4 + vpbroadcastd of x from memory
 *   5 + vpsrlw and vpand                 6 vpmaddubsw + vpaddd         7 vpmaddubsw into vpmaddwd */
#include <stdio.h>
#include <time.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
int main(){
  long n=100000000; double t0=now();
  for(long i=0;i<n;i++){
    __asm__ volatile(
#if MODE==0  /* madd + add, 6 sums, products into 6 temps */
#define U(p,s) "vpmaddubsw %%ymm8, %%ymm0, %%ymm" #p "\n\t vpaddw %%ymm" #p ", %%ymm" #s ", %%ymm" #s "\n\t"
      U(1,10) U(2,11) U(3,12) U(4,13) U(5,14) U(6,15)
      U(1,10) U(2,11) U(3,12) U(4,13) U(5,14) U(6,15)
#elif MODE==1 /* madd only */
#define U(p,s) "vpmaddubsw %%ymm8, %%ymm0, %%ymm" #p "\n\t"
      U(1,10) U(2,11) U(3,12) U(4,13) U(5,14) U(6,15)
      U(1,10) U(2,11) U(3,12) U(4,13) U(5,14) U(6,15)
#elif MODE==2 /* madd + xor (ALU) */
#define U(p,s) "vpmaddubsw %%ymm8, %%ymm0, %%ymm" #p "\n\t vpxor %%ymm" #p ", %%ymm" #s ", %%ymm" #s "\n\t"
      U(1,10) U(2,11) U(3,12) U(4,13) U(5,14) U(6,15)
      U(1,10) U(2,11) U(3,12) U(4,13) U(5,14) U(6,15)
#elif MODE==3 /* madd + add + and (unpack) */
#define U(p,s) "vpand %%ymm9, %%ymm7, %%ymm8\n\t vpmaddubsw %%ymm8, %%ymm0, %%ymm" #p "\n\t vpaddw %%ymm" #p ", %%ymm" #s ", %%ymm" #s "\n\t"
      U(1,10) U(2,11) U(3,12) U(4,13) U(5,14) U(6,15)
      U(1,10) U(2,11) U(3,12) U(4,13) U(5,14) U(6,15)
#elif MODE==4 /* madd with memory broadcast of x + add */
#define U(p,s) "vpbroadcastd (%0), %%ymm0\n\t vpmaddubsw %%ymm8, %%ymm0, %%ymm" #p "\n\t vpaddw %%ymm" #p ", %%ymm" #s ", %%ymm" #s "\n\t"
      U(1,10) U(2,11) U(3,12) U(4,13) U(5,14) U(6,15)
      U(1,10) U(2,11) U(3,12) U(4,13) U(5,14) U(6,15)
#elif MODE==5 /* madd + add + and + shift */
#define U(p,s) "vpsrlw $4, %%ymm7, %%ymm8\n\t vpand %%ymm9, %%ymm8, %%ymm8\n\t vpmaddubsw %%ymm8, %%ymm0, %%ymm" #p "\n\t vpaddw %%ymm" #p ", %%ymm" #s ", %%ymm" #s "\n\t"
      U(1,10) U(2,11) U(3,12) U(4,13) U(5,14) U(6,15)
      U(1,10) U(2,11) U(3,12) U(4,13) U(5,14) U(6,15)
#elif MODE==6 /* madd + vpaddd */
#define U(p,s) "vpmaddubsw %%ymm8, %%ymm0, %%ymm" #p "\n\t vpaddd %%ymm" #p ", %%ymm" #s ", %%ymm" #s "\n\t"
      U(1,10) U(2,11) U(3,12) U(4,13) U(5,14) U(6,15)
      U(1,10) U(2,11) U(3,12) U(4,13) U(5,14) U(6,15)
#elif MODE==7 /* madd + madd(wd) */
#define U(p,s) "vpmaddubsw %%ymm8, %%ymm0, %%ymm" #p "\n\t vpmaddwd %%ymm" #p ", %%ymm9, %%ymm" #s "\n\t"
      U(1,10) U(2,11) U(3,12) U(4,13) U(5,14) U(6,15)
      U(1,10) U(2,11) U(3,12) U(4,13) U(5,14) U(6,15)
#endif
      :: "r"(&n) : "xmm0","xmm1","xmm2","xmm3","xmm4","xmm5","xmm6","xmm7","xmm8","xmm10","xmm11","xmm12","xmm13","xmm14","xmm15","memory");
  }
  double t=now()-t0;
  printf("mode %d: %.2f G vpmaddubsw a second (divide by the clock for a cycle)\n", MODE, n * 12 / t / 1e9);
}
