#include <immintrin.h>
#include <stdio.h>
#include <stdint.h>
#include <stdlib.h>

#include "now.h"
#ifndef MR
#define MR 6
#endif
#define KEEP(v) __asm__("" : "+x"(v))
/* A Q4_K block loop of the AVX2 kernel's shape (int_tile_super's small-codes branch): MR rows of x, both
 * halves of a 16-row tile from one broadcast of x, 8 units a block summed in 16 bits and weighed once by
 * vpmaddwd into 32-bit sums. The codes come from an L1-resident buffer, as bytes, or with -DPACKED as
 * 4-bit codes unpacked in the loop. K 2048 (G = 64 blocks). */
__attribute__((noinline)) void pass(const uint8_t *bb, const __m256i *w16, const int8_t *x, long ld, long G, __m256i *isum) {
  for (long g = 0; g < G; g++) {
    const uint8_t *wb = bb + g * 512;
    __m256i s[MR][2];
#pragma GCC unroll 8
    for (int u = 0; u < 8; u++) {
#ifdef PACKED
      const __m256i p0 = _mm256_load_si256((const __m256i *)(wb + 64 * (u % 4))), p1 = _mm256_load_si256((const __m256i *)(wb + 64 * (u % 4) + 32));
      const __m256i mk = _mm256_set1_epi8(15);
      const __m256i w0 = _mm256_and_si256(u >= 4 ? _mm256_srli_epi16(p0, 4) : p0, mk), w1 = _mm256_and_si256(u >= 4 ? _mm256_srli_epi16(p1, 4) : p1, mk);
#else
      const __m256i w0 = _mm256_load_si256((const __m256i *)(wb + 64 * u)), w1 = _mm256_load_si256((const __m256i *)(wb + 64 * u + 32));
#endif
#pragma GCC unroll 8
      for (int m = 0; m < MR; m++) {
        const __m256i xb = _mm256_set1_epi32(*(const int32_t *)(x + m * ld + g * 32 + 4 * u));
        if (u == 0) { s[m][0] = _mm256_maddubs_epi16(w0, xb); s[m][1] = _mm256_maddubs_epi16(w1, xb); }
        else { s[m][0] = _mm256_add_epi16(s[m][0], _mm256_maddubs_epi16(w0, xb)); s[m][1] = _mm256_add_epi16(s[m][1], _mm256_maddubs_epi16(w1, xb)); }
      }
#pragma GCC unroll 8
      for (int m = 0; m < MR; m++) { KEEP(s[m][0]); KEEP(s[m][1]); }
    }
#pragma GCC unroll 2
    for (int h = 0; h < 2; h++) {
      const __m256i sc = w16[2 * g + h];
#pragma GCC unroll 8
      for (int m = 0; m < MR; m++) isum[2 * m + h] = _mm256_add_epi32(isum[2 * m + h], _mm256_madd_epi16(s[m][h], sc));
    }
  }
}
int main(){
  long G = 64, ld = 2112; /* K 2048 */
  uint8_t *bb = aligned_alloc(64, G * 512); for (long i = 0; i < G * 512; i++) bb[i] = i % 16;
  __m256i *w16 = aligned_alloc(64, G * 64); for (long i = 0; i < 2*G; i++) w16[i] = _mm256_set1_epi16(3);
  int8_t *x = aligned_alloc(64, 16 * ld); for (long i = 0; i < 16 * ld; i++) x[i] = (i * 7) % 200 - 100;
  __m256i isum[2 * MR] __attribute__((aligned(64))); for (int i = 0; i < 2*MR; i++) isum[i] = _mm256_setzero_si256();
  long n = 20000; double t0 = now();
  for (long i = 0; i < n; i++) pass(bb, w16, x, ld, G, isum);
  double t = now() - t0; double madds = (double)n * G * 8 * 2 * MR;
  printf("Q4_K block, %d rows: %.2f G vpmaddubsw a second (%d)\n", MR, madds / t / 1e9, _mm256_extract_epi32(isum[0], 0));
}
