/* What this build of the library was compiled for, and the one-time set-up its instructions need. */
#include <stdint.h>
#include <unistd.h>
#if defined(__linux__)
#include <sys/syscall.h>
#endif

/* The ISA extensions this library's code may execute, as the compiler saw its -m flags (checked
 * against the variant the loader asked for, so a stale or mislabelled library is never run). */
const char *orca_build_isa(void) {
    return "avx2"
#if defined(__AVX512F__) && defined(__AVX512BW__)
           "+avx512"
#endif
#if defined(__AVX512VNNI__)
           "+vnni"
#endif
#if defined(__AMX_INT8__)
           "+amx"
#endif
        ;
}

/* Linux hands out the AMX tile state only to processes that ask for it (once per process). Returns 0
 * when the tiles may be used, nonzero otherwise; a no-op in builds without AMX. */
int orca_isa_init(void) {
#if defined(__AMX_INT8__)
#if defined(__linux__)
    const long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 0 : 1;
#else
    return 1;
#endif
#else
    return 0;
#endif
}
