/* The core's clock: four dependent adds an iteration run one a cycle, so iterations x 4 / seconds. */
#include <stdio.h>

#include "now.h"
int main(void) {
    long n = 1000000000, a = 1;
    const double t0 = now();
    for (long i = 0; i < n; i++) __asm__ volatile("add $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\tadd $1, %0" : "+r"(a));
    printf("clock: %.2f GHz (%ld)\n", 4.0 * n / (now() - t0) / 1e9, a);
}
