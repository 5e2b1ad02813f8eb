#include "cpu_isa.h"

#include "simd.h"

#include <c10/util/Exception.h>

#include <atomic>

namespace {

// The compiled path without target attributes: what -march=native gave this build.
constexpr CpuIsa kCompiledIsa =
#ifdef CHUNKSERVE_AVX2
    CpuIsa::kAvx2;
#else
    CpuIsa::kPortable;
#endif

CpuIsa detected_isa() {
  static const CpuIsa isa = [] {
    __builtin_cpu_init();
    const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
                        __builtin_cpu_supports("f16c") && __builtin_cpu_supports("fma");
    return avx512 ? CpuIsa::kAvx512 : kCompiledIsa;
  }();
  return isa;
}

std::atomic<int> chosen{-1};  // -1: the detected one

}  // namespace

CpuIsa active_cpu_isa() {
  const int set = chosen.load(std::memory_order_relaxed);
  return set < 0 ? detected_isa() : static_cast<CpuIsa>(set);
}

std::string cpu_isa_name(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kAvx512: return "avx512";
    case CpuIsa::kAvx2: return "avx2";
    default: return "portable";
  }
}

std::string cpu_isa() { return cpu_isa_name(active_cpu_isa()); }

std::string set_cpu_isa(const std::string& name) {
  const std::string before = cpu_isa();
  for (CpuIsa isa : {CpuIsa::kPortable, CpuIsa::kAvx2, CpuIsa::kAvx512}) {
    if (cpu_isa_name(isa) != name) continue;
    TORCH_CHECK(isa == detected_isa() || isa == kCompiledIsa,
                "set_cpu_isa: this CPU and build run ", cpu_isa_name(detected_isa()), " or ",
                cpu_isa_name(kCompiledIsa), ", not ", name);
    chosen.store(static_cast<int>(isa), std::memory_order_relaxed);
    return before;
  }
  TORCH_CHECK(false, "set_cpu_isa: unknown instruction set ", name, " (avx512, avx2 or portable)");
}
