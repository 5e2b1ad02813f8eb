// Which instruction set the kernels that have several run with, chosen at run time.
//
// The ops are compiled with -march=native, so the portable and AVX2 paths are whatever the
// build machine offers. Kernels written for AVX-512 are compiled with a target attribute
// instead, so that one build carries them beside the AVX2 path, they run only where the CPU
// has AVX-512, and the AVX2 path stays reachable (and tested) on an AVX-512 machine through
// `set_cpu_isa`.
#pragma once

#include <string>

enum class CpuIsa { kPortable, kAvx2, kAvx512 };

#define CHUNKSERVE_AVX512_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")))
// The same with AVX512_BF16's pair dot products; run only where bf16_dot_supported() (ops.h).
#define CHUNKSERVE_AVX512_BF16_TARGET \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c")))

// The best this CPU runs, or the one set by `set_cpu_isa`.
CpuIsa active_cpu_isa();

// "avx512", "avx2" or "portable".
std::string cpu_isa_name(CpuIsa isa);

// The ISA the kernels use from now on (never above what the CPU has: asking for more raises);
// returns the one used before, so a caller can restore it.
std::string set_cpu_isa(const std::string& name);

// The name of `active_cpu_isa()`.
std::string cpu_isa();
