/* LD_PRELOAD shim: the process sees an AVX2-only x86-64 CPU, as an AMD EPYC of the Zen 2/3
 * generations is (AVX2, FMA, F16C, BMI2; no AVX-512, AVX-VNNI or AMX).
 *
 * Linux's CPUID faulting (arch_prctl ARCH_SET_CPUID, where the CPU and hypervisor offer it) makes
 * every CPUID instruction trap; the SIGSEGV handler here runs the real CPUID with faulting off,
 * clears the feature bits an AVX2-only CPU lacks and resumes after the instruction. Libraries that
 * pick their kernels by CPUID at run time (ONNX Runtime's MLAS, numpy, torch, MKL) then choose the
 * kernels they run on such a CPU, at native speed. AVX2ONLY_VENDOR=AMD also makes leaf 0 say
 * AuthenticAMD (MKL takes other code paths on AMD). The program's own SIGSEGV handlers (Python's
 * faulthandler) are kept and called for every other fault. The setting is inherited by threads and
 * forks and reset by execve, so a child process needs LD_PRELOAD in its environment as well.
 * Built and used by tests/cpu_family.py. */
#define _GNU_SOURCE
#include <asm/prctl.h>
#include <cpuid.h>
#include <dlfcn.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <ucontext.h>
#include <unistd.h>

static struct sigaction chained; /* the SIGSEGV handler the program asked for */
static int (*real_sigaction)(int, const struct sigaction *, struct sigaction *);
static int amd_vendor;

static void set_faulting(int on) { syscall(SYS_arch_prctl, ARCH_SET_CPUID, on ? 0 : 1); }

static void hide_features(unsigned leaf, unsigned sub, unsigned r[4]) {
    if (leaf == 0 && amd_vendor) {
        memcpy(&r[1], "Auth", 4);
        memcpy(&r[3], "enti", 4);
        memcpy(&r[2], "cAMD", 4);
    } else if (leaf == 7 && sub == 0) {
        /* EBX: AVX512F, DQ, IFMA, PF, ER, CD, BW, VL */
        r[1] &= ~((1u << 16) | (1u << 17) | (1u << 21) | (1u << 26) | (1u << 27) | (1u << 28) | (1u << 30) | (1u << 31));
        /* ECX: AVX512_VBMI, VBMI2, VNNI, BITALG, VPOPCNTDQ */
        r[2] &= ~((1u << 1) | (1u << 6) | (1u << 11) | (1u << 12) | (1u << 14));
        /* EDX: AVX512_4VNNIW, 4FMAPS, VP2INTERSECT, AMX_BF16, AVX512_FP16, AMX_TILE, AMX_INT8 */
        r[3] &= ~((1u << 2) | (1u << 3) | (1u << 8) | (1u << 22) | (1u << 23) | (1u << 24) | (1u << 25));
    } else if (leaf == 7 && sub == 1) {
        r[0] = r[1] = r[2] = r[3] = 0; /* AVX-VNNI, AVX512_BF16, AVX-IFMA, AVX-VNNI-INT8, AMX-FP16, ... */
    }
}

static void on_segv(int sig, siginfo_t *info, void *context) {
    greg_t *reg = ((ucontext_t *)context)->uc_mcontext.gregs;
    const unsigned char *ip = (const unsigned char *)reg[REG_RIP];
    if (ip[0] == 0x0F && ip[1] == 0xA2) { /* CPUID */
        unsigned leaf = (unsigned)reg[REG_RAX], sub = (unsigned)reg[REG_RCX], r[4];
        set_faulting(0);
        __cpuid_count(leaf, sub, r[0], r[1], r[2], r[3]);
        set_faulting(1);
        hide_features(leaf, sub, r);
        reg[REG_RAX] = r[0];
        reg[REG_RBX] = r[1];
        reg[REG_RCX] = r[2];
        reg[REG_RDX] = r[3];
        reg[REG_RIP] += 2;
        return;
    }
    if (chained.sa_flags & SA_SIGINFO) {
        chained.sa_sigaction(sig, info, context);
    } else if (chained.sa_handler != SIG_DFL && chained.sa_handler != SIG_IGN) {
        chained.sa_handler(sig);
    } else { /* a real fault: returning re-runs the instruction under the default action */
        struct sigaction default_action = {0};
        default_action.sa_handler = SIG_DFL;
        real_sigaction(SIGSEGV, &default_action, NULL);
    }
}

int sigaction(int sig, const struct sigaction *act, struct sigaction *old) {
    if (!real_sigaction) real_sigaction = dlsym(RTLD_NEXT, "sigaction");
    if (sig != SIGSEGV) return real_sigaction(sig, act, old);
    if (old) *old = chained;
    if (act) chained = *act;
    return 0;
}

sighandler_t signal(int sig, sighandler_t handler) {
    struct sigaction act = {0}, old;
    act.sa_handler = handler;
    sigemptyset(&act.sa_mask);
    act.sa_flags = SA_RESTART;
    return sigaction(sig, &act, &old) == 0 ? old.sa_handler : SIG_ERR;
}

__attribute__((constructor)) static void start(void) {
    if (!real_sigaction) real_sigaction = dlsym(RTLD_NEXT, "sigaction");
    const char *vendor = getenv("AVX2ONLY_VENDOR");
    amd_vendor = vendor && strcmp(vendor, "AMD") == 0;
    chained.sa_handler = SIG_DFL;
    struct sigaction act = {0};
    act.sa_sigaction = on_segv;
    act.sa_flags = SA_SIGINFO | SA_NODEFER | SA_ONSTACK;
    sigemptyset(&act.sa_mask);
    real_sigaction(SIGSEGV, &act, NULL);
    set_faulting(1);
}
