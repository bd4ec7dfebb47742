/* LD_PRELOAD shim for benchmarks/llm_accuracy.py: make ggml's AMX permission request (arch_prctl
 * ARCH_REQ_XCOMP_PERM) fail, so ggml takes its own "AMX is not ready" path and skips its AMX buffer type.
 * Why: llama-cpp-python built with GGML_NATIVE=ON on a CPU that reports AMX dies with SIGILL on
 * `tileloadd` in ggml's AMX matmul in this VM (Firecracker guest), although the kernel grants the
 * permission. The AVX-512 VNNI kernels and llama.cpp's weight repacking are unaffected.
 * Build: gcc -O2 -shared -fPIC llamacpp_noamx.c -o libnoamx.so -ldl */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <stdarg.h>
#include <sys/syscall.h>
long syscall(long n, ...) {
    va_list ap; va_start(ap, n);
    long a[6]; for (int i = 0; i < 6; i++) a[i] = va_arg(ap, long);
    va_end(ap);
    if (n == SYS_arch_prctl && a[0] == 0x1023) { errno = EPERM; return -1; }
    static long (*real)(long, ...) = 0;
    if (!real) real = (long (*)(long, ...))dlsym(RTLD_NEXT, "syscall");
    return real(n, a[0], a[1], a[2], a[3], a[4], a[5]);
}
