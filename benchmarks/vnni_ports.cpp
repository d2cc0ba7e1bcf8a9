// How many 512-bit products a core issues a second: vpdpbusd (VNNI, 64 8-bit multiply-adds),
// vpmaddubsw and vpmaddwd (the sequence before VNNI), vpdpbusd beside that sequence (does the
// sequence run on a port vpdpbusd leaves free?), and float32 vfmadd231ps. Each loop is written in
// assembly, twelve independent accumulators in fixed registers, so that the rate is the ports'
// (a compiler's register copies between rounds took port slots of their own). For an AVX512-VNNI CPU:
//
//     g++ -O2 -march=native benchmarks/vnni_ports.cpp -o /tmp/vnni_ports && /tmp/vnni_ports
#include <immintrin.h>

#include <chrono>
#include <cstdio>

namespace {
constexpr long kRounds = 100000000;

// One round of each loop: twelve instructions (a vpdpbusd, or a pair's three), zmm4-zmm15 the
// accumulators, zmm0-zmm2 the operands: floats 1 and 0.5 in zmm0 and zmm1 (their bytes the integer
// products' operands; r * 1 + 0.5 keeps the float accumulators normal, never the microcode's slow
// denormals), 16-bit ones in zmm2.
#define TWELVE(op) op(4) op(5) op(6) op(7) op(8) op(9) op(10) op(11) op(12) op(13) op(14) op(15)
#define EIGHT_FOUR(op8, op4) op8(4) op8(5) op8(6) op8(7) op8(8) op8(9) op8(10) op8(11) op4(12) op4(13) op4(14) op4(15)
#define DPBUSD(r) "vpdpbusd %%zmm1, %%zmm0, %%zmm" #r "\n\t"
#define MADDUBSW(r) "vpmaddubsw %%zmm1, %%zmm" #r ", %%zmm" #r "\n\t"
#define MADDWD(r) "vpmaddwd %%zmm2, %%zmm" #r ", %%zmm" #r "\n\t"
#define PAIR(r) "vpmaddubsw %%zmm1, %%zmm0, %%zmm3\n\tvpmaddwd %%zmm2, %%zmm3, %%zmm3\n\tvpaddd %%zmm3, %%zmm" #r ", %%zmm" #r "\n\t"
#define FMA(r) "vfmadd213ps %%zmm1, %%zmm0, %%zmm" #r "\n\t"
#define LOOP(body)                                                                                            \
  [](long n) {                                                                                                \
    const __m512i ones = _mm512_set1_epi16(1);                                                                \
    const __m512 one = _mm512_set1_ps(1.0f), half = _mm512_set1_ps(0.5f);                                     \
    asm volatile("vmovaps %1, %%zmm0\n\tvmovaps %2, %%zmm1\n\tvmovdqa64 %3, %%zmm2\n\t"                       \
                 "vpxord %%zmm4, %%zmm4, %%zmm4\n\t" "vmovdqa64 %%zmm4, %%zmm5\n\tvmovdqa64 %%zmm4, %%zmm6\n\t" \
                 "vmovdqa64 %%zmm4, %%zmm7\n\tvmovdqa64 %%zmm4, %%zmm8\n\tvmovdqa64 %%zmm4, %%zmm9\n\t"       \
                 "vmovdqa64 %%zmm4, %%zmm10\n\tvmovdqa64 %%zmm4, %%zmm11\n\tvmovdqa64 %%zmm4, %%zmm12\n\t"    \
                 "vmovdqa64 %%zmm4, %%zmm13\n\tvmovdqa64 %%zmm4, %%zmm14\n\tvmovdqa64 %%zmm4, %%zmm15\n\t"    \
                 "%=:\n\t" body "dec %0\n\tjnz %=b\n\t"                                                       \
                 : "+r"(n)                                                                                    \
                 : "v"(one), "v"(half), "v"(ones)                                                              \
                 : "zmm0", "zmm1", "zmm2", "zmm3", "zmm4", "zmm5", "zmm6", "zmm7", "zmm8", "zmm9", "zmm10",     \
                   "zmm11", "zmm12", "zmm13", "zmm14", "zmm15", "cc");                                          \
  }

template <class Loop>
double rate(Loop loop) {  // rounds times twelve over the seconds taken, in G/s
  const auto start = std::chrono::steady_clock::now();
  loop(kRounds);
  return 12.0 * kRounds / std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / 1e9;
}
}  // namespace

int main() {
  std::printf("vpdpbusd: %.2f G/s\n", rate(LOOP(TWELVE(DPBUSD))));
  std::printf("vpmaddubsw: %.2f G/s\n", rate(LOOP(TWELVE(MADDUBSW))));
  std::printf("vpmaddwd: %.2f G/s\n", rate(LOOP(TWELVE(MADDWD))));
  std::printf("8 vpdpbusd + 4 (vpmaddubsw, vpmaddwd, vpaddd): %.2f G groups of 64 multiply-adds/s\n",
              rate(LOOP(EIGHT_FOUR(DPBUSD, PAIR))));
  std::printf("vfmadd213ps: %.2f G/s\n", rate(LOOP(TWELVE(FMA))));
}
