// cpu_mask.so: an LD_PRELOAD library under which a process, and every library in it, sees a lower
// x86 tier through CPUID: AVX2 (no AVX-512, VNNI, AVX-VNNI, bf16 or AMX: AMD Zen 2/3, Intel client
// CPUs before Alder Lake), AVX512_CORE (AVX-512 without VNNI: Skylake-SP) or AVX512_CORE_VNNI (no
// bf16, no AMX: Cascade Lake / Ice Lake).
//
// Why. ONEDNN_MAX_CPU_ISA caps only oneDNN (torch's copy and GML's). ONNX Runtime's MLAS, fbgemm,
// ATen's own vector kernels and OpenVINO's non-oneDNN paths dispatch on CPUID and ignore it, so a
// peer compared "under the cap" may still run AVX-512 / VNNI / AMX kernels (issue #23). With CPUID
// masked every library picks the kernels it would pick on the lower CPU, and runs them on this core.
//
// How. Linux's CPUID faulting (arch_prctl ARCH_SET_CPUID 0; the cpuid_fault flag of
// /proc/cpuinfo, Intel since Ivy Bridge, KVM guests included) makes a CPUID instruction raise
// SIGSEGV. The handler executes the real CPUID (faulting off for that one instruction), clears the
// feature bits of the higher tiers, writes EAX..EDX into the interrupted context and steps over the
// 2-byte instruction. The setting is per thread and inherited by threads and children; execve
// resets it, and the library's constructor sets it again in every new program (LD_PRELOAD is
// inherited through the environment).
//
// A SIGSEGV handler the program installs later (Python's faulthandler, ...) is kept behind ours:
// sigaction(SIGSEGV) is intercepted, and a fault that is not a CPUID goes to that handler, or to the
// default action. (A handler installed with signal() or a raw system call replaces ours: the next
// CPUID then reaches it as a crash.) What it cannot change: XGETBV still reports the AVX-512 register state enabled
// (libraries check CPUID first), and glibc resolved its string functions before the constructor ran
// (benchmarks/cpu_mask.py sets GLIBC_TUNABLES for those).
//
// Tier from GML_CPU_MASK (AVX2 | AVX512_CORE | AVX512_CORE_VNNI); unset or unknown: nothing masked.
#define _GNU_SOURCE
#include <asm/prctl.h>
#include <cpuid.h>
#include <dlfcn.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <ucontext.h>
#include <unistd.h>

enum { kNone = 0, kAvx2 = 1, kAvx512Core = 2, kAvx512CoreVnni = 3 };
static int tier = kNone;
static struct sigaction chained;  // the program's own SIGSEGV disposition
static pid_t owner;               // the process whose state this is (see sigaction below)
typedef int (*sigaction_fn)(int, const struct sigaction*, struct sigaction*);
static sigaction_fn real_sigaction;

#define BIT(n) (1u << (n))

// Clears in r (EAX, EBX, ECX, EDX of leaf / subleaf) what the tier does not have (Intel SDM vol. 2A,
// CPUID; the names are Linux's /proc/cpuinfo flags).
static void mask(uint32_t leaf, uint32_t sub, uint32_t r[4]) {
  if (leaf == 7 && sub == 0) {
    uint32_t b = 0, c = 0, d = 0;
    if (tier <= kAvx2) {
      // avx512f dq ifma pf er cd bw vl
      b |= BIT(16) | BIT(17) | BIT(21) | BIT(26) | BIT(27) | BIT(28) | BIT(30) | BIT(31);
      c |= BIT(1) | BIT(6) | BIT(12) | BIT(14);       // avx512vbmi vbmi2 bitalg vpopcntdq
      d |= BIT(2) | BIT(3) | BIT(8) | BIT(23);        // avx512_4vnniw 4fmaps vp2intersect fp16
    }
    if (tier <= kAvx512Core) c |= BIT(11);             // avx512_vnni
    d |= BIT(22) | BIT(24) | BIT(25);                  // amx_bf16 amx_tile amx_int8
    r[1] &= ~b;
    r[2] &= ~c;
    r[3] &= ~d;
  } else if (leaf == 7 && sub == 1) {
    r[0] &= ~(BIT(4) | BIT(5) | BIT(21) | BIT(23));    // avx_vnni avx512_bf16 amx_fp16 avx_ifma
    r[3] &= ~(BIT(4) | BIT(5) | BIT(10) | BIT(19));    // avx_vnni_int8 avx_ne_convert avx_vnni_int16 avx10
  } else if (leaf == 0xd && sub == 0) {
    uint32_t x = BIT(17) | BIT(18);                    // AMX tile state
    if (tier <= kAvx2) x |= BIT(5) | BIT(6) | BIT(7);  // opmask and zmm state
    r[0] &= ~x;
  }
}

static void on_segv(int sig, siginfo_t* info, void* ctx) {
  greg_t* g = ((ucontext_t*)ctx)->uc_mcontext.gregs;
  const uint8_t* ip = (const uint8_t*)g[REG_RIP];
  if (info->si_code == SI_KERNEL && ip[0] == 0x0f && ip[1] == 0xa2) {  // a faulted CPUID
    uint32_t r[4];
    const uint32_t leaf = (uint32_t)g[REG_RAX], sub = (uint32_t)g[REG_RCX];
    syscall(SYS_arch_prctl, ARCH_SET_CPUID, 1);
    __cpuid_count(leaf, sub, r[0], r[1], r[2], r[3]);
    syscall(SYS_arch_prctl, ARCH_SET_CPUID, 0);
    mask(leaf, sub, r);
    g[REG_RAX] = r[0];
    g[REG_RBX] = r[1];
    g[REG_RCX] = r[2];
    g[REG_RDX] = r[3];
    g[REG_RIP] += 2;
    return;
  }
  if (chained.sa_flags & SA_SIGINFO) {
    chained.sa_sigaction(sig, info, ctx);
  } else if (chained.sa_handler != SIG_DFL && chained.sa_handler != SIG_IGN) {
    chained.sa_handler(sig);
  } else {  // back to the default action: the faulting instruction runs again and ends the process
    struct sigaction dfl;
    memset(&dfl, 0, sizeof dfl);
    dfl.sa_handler = SIG_DFL;
    real_sigaction(SIGSEGV, &dfl, NULL);
  }
}

// A vfork child shares this memory until it execs, and Python's subprocess resets every handler
// there: its calls go to the kernel (its own signal table), never into ``chained`` of the parent.
int sigaction(int sig, const struct sigaction* act, struct sigaction* old) {
  if (!real_sigaction) real_sigaction = (sigaction_fn)dlsym(RTLD_NEXT, "sigaction");
  if (sig != SIGSEGV || tier == kNone || getpid() != owner) return real_sigaction(sig, act, old);
  if (old) *old = chained;
  if (act) chained = *act;
  return 0;
}

static void after_fork(void) { owner = getpid(); }  // a forked child keeps the mask (and its own copy)

__attribute__((constructor)) static void init(void) {
  real_sigaction = (sigaction_fn)dlsym(RTLD_NEXT, "sigaction");
  const char* t = getenv("GML_CPU_MASK");
  if (!t) return;
  int want = kNone;
  if (!strcmp(t, "AVX2")) want = kAvx2;
  else if (!strcmp(t, "AVX512_CORE")) want = kAvx512Core;
  else if (!strcmp(t, "AVX512_CORE_VNNI")) want = kAvx512CoreVnni;
  if (want == kNone) return;
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_sigaction = on_segv;
  sa.sa_flags = SA_SIGINFO | SA_NODEFER;
  sigemptyset(&sa.sa_mask);
  real_sigaction(SIGSEGV, &sa, &chained);
  if (syscall(SYS_arch_prctl, ARCH_SET_CPUID, 0) != 0) {  // no CPUID faulting: leave the process as it was
    real_sigaction(SIGSEGV, &chained, NULL);
    return;
  }
  owner = getpid();
  pthread_atfork(NULL, NULL, after_fork);
  tier = want;
}
