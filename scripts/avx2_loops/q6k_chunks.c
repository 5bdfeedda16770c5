#include <immintrin.h>
#include <stdio.h>
#include <stdint.h>
#include <stdlib.h>

#include "now.h"
#define KEEP(v) __asm__("" : "+x"(v))
#define U _Pragma("GCC unroll 16")
/* Q6_K's chunk loop of the AVX2 kernel's shape (biased_super16): chunks of 2 units summed in 16 bits, each
 * weighed by vpmaddwd into a row's 32-bit sum. MODE 0: one half of the tile at a time (the kernel's
 * order), MODE 1: both halves from one broadcast of x. Codes as signed bytes from an L1-resident buffer:
 * G blocks x 8 units x 2 halves x 32 bytes; w16: the sub-scales, G x 2 sub-groups x 2 halves. */
#if MODE == 0 /* halves outer, MR rows */
__attribute__((noinline)) void pass(const int8_t *cb, const __m256i *w16, const uint8_t *x, long ld, long G, __m256i *out) {
  for (int h = 0; h < 2; h++) {
    __m256i is[MR];
    U for (int m = 0; m < MR; m++) is[m] = _mm256_setzero_si256();
    for (long g = 0; g < G; g++) {
      U for (int p = 0; p < 2; p++) {
        const __m256i sc = w16[4 * g + 2 * p + h];
        U for (int c = 4 * p; c < 4 * p + 4; c += 2) {
          const __m256i w0 = _mm256_load_si256((const __m256i *)(cb + g * 512 + (2 * c + h) * 32));
          const __m256i w1 = _mm256_load_si256((const __m256i *)(cb + g * 512 + (2 * c + 2 + h) * 32));
          U for (int m = 0; m < MR; m++) {
            const uint8_t *xb = x + m * ld + g * 32 + 4 * c;
            __m256i t = _mm256_maddubs_epi16(_mm256_set1_epi32(*(const int32_t *)xb), w0);
            t = _mm256_add_epi16(t, _mm256_maddubs_epi16(_mm256_set1_epi32(*(const int32_t *)(xb + 4)), w1));
            is[m] = _mm256_add_epi32(is[m], _mm256_madd_epi16(t, sc));
            KEEP(is[m]);
          }
        }
      }
    }
    U for (int m = 0; m < MR; m++) out[2 * m + h] = _mm256_add_epi32(out[2 * m + h], is[m]);
  }
}
#else /* halves inside */
__attribute__((noinline)) void pass(const int8_t *cb, const __m256i *w16, const uint8_t *x, long ld, long G, __m256i *out) {
  __m256i is[MR][2];
  U for (int m = 0; m < MR; m++) is[m][0] = is[m][1] = _mm256_setzero_si256();
  for (long g = 0; g < G; g++) {
    U for (int p = 0; p < 2; p++) {
      const __m256i *sc = w16 + 4 * g + 2 * p;
      U for (int c = 4 * p; c < 4 * p + 4; c += 2) {
        const __m256i *wc = (const __m256i *)(cb + g * 512 + 2 * c * 32);
        U for (int m = 0; m < MR; m++) {
          const uint8_t *xb = x + m * ld + g * 32 + 4 * c;
          const __m256i x0 = _mm256_set1_epi32(*(const int32_t *)xb), x1 = _mm256_set1_epi32(*(const int32_t *)(xb + 4));
          __m256i t0 = _mm256_add_epi16(_mm256_maddubs_epi16(x0, wc[0]), _mm256_maddubs_epi16(x1, wc[2]));
          __m256i t1 = _mm256_add_epi16(_mm256_maddubs_epi16(x0, wc[1]), _mm256_maddubs_epi16(x1, wc[3]));
          is[m][0] = _mm256_add_epi32(is[m][0], _mm256_madd_epi16(t0, sc[0]));
          is[m][1] = _mm256_add_epi32(is[m][1], _mm256_madd_epi16(t1, sc[1]));
          KEEP(is[m][0]); KEEP(is[m][1]);
        }
      }
    }
  }
  U for (int m = 0; m < MR; m++) { out[2 * m] = _mm256_add_epi32(out[2 * m], is[m][0]); out[2 * m + 1] = _mm256_add_epi32(out[2 * m + 1], is[m][1]); }
}
#endif
int main(){
  long G = 64, ld = 2112;
  int8_t *cb = aligned_alloc(64, G * 512); for (long i = 0; i < G * 512; i++) cb[i] = i % 64 - 32;
  __m256i *w16 = aligned_alloc(64, G * 4 * 32); for (long i = 0; i < 4*G; i++) w16[i] = _mm256_set1_epi16(3);
  uint8_t *x = aligned_alloc(64, 16 * ld); for (long i = 0; i < 16 * ld; i++) x[i] = (i * 7) % 256;
  __m256i out[32] __attribute__((aligned(64))); for (int i = 0; i < 32; i++) out[i] = _mm256_setzero_si256();
  long n = 20000; double t0 = now();
  for (long i = 0; i < n; i++) pass(cb, w16, x, ld, G, out);
  double t = now() - t0; double madds = (double)n * G * 8 * 2 * MR;
  printf("Q6_K chunks, mode %d, %d rows: %.2f G vpmaddubsw a second (%d)\n", MODE, MR, madds / t / 1e9, _mm256_extract_epi32(out[0], 0));
}
