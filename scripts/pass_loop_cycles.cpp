// The pass loop of the interleaved Q4_K and Q6_K kernels timed alone, one thread, in cache: cycles per (8 rows, 256
// weights, token) for passes of 1, 8 and 16 tokens. It includes the kernels' source, so it times the code of this
// tree, or of a copy given at build time (`bash scripts/pass_loop_cycles.sh OTHER.cpp`: a version from 670f0b1 on,
// with QuantizedRows::by_block) for an A/B in turns, each binary run alone. Cycles are nanoseconds times the GHz
// given (default 3.66: the Zen 4's rate of a register-only loop of 512-bit vpdpbusd, one a cycle, 2026-12-07). The
// weights are random blocks (halves 1.0 / 0.5 for d and dmin), the activations random normals: timing only.
#include KERNEL_SOURCE

#include <ATen/Parallel.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>

template <typename F>
double cycles_per_unit(int64_t N, int64_t K, int64_t T, int calls, double ghz) {
  std::mt19937 rng(1);
  const int64_t groups = N / kRowGroup, blocks = K / F::kWeights;
  std::vector<uint8_t> weights(groups * blocks * F::kBytes);
  for (auto& byte : weights) byte = static_cast<uint8_t>(rng());
  for (int64_t i = 0; i < groups * blocks; ++i) {  // finite scales: d (and dmin) of the 8 rows as halves
    uint8_t* block = weights.data() + i * F::kBytes;
    for (int r = 0; r < 16; ++r) block[2 * r] = 0, block[2 * r + 1] = r < 8 ? 0x3c : 0x38;
  }
  std::vector<float> x(T * K);
  std::normal_distribution<float> normal;
  for (auto& v : x) v = normal(rng);
  QuantizedRows rows = quantize_rows(x.data(), T, K, F::kActBlock, block_major<F>);
#if SPECDRAFT_WIDE_K
  if constexpr (std::is_same_v<F, Q6Kx8>) add_offsets(rows);  // as qlinear_x8 does for Q6_K
#endif
  std::vector<float> out(T * N);
  double best = 1e30;
  for (int round = 0; round < 7; ++round) {
    const auto started = std::chrono::steady_clock::now();
    for (int i = 0; i < calls; ++i) qlinear_x8_impl<F>(weights.data(), N, K, rows, nullptr, out.data());
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
    best = std::min(best, seconds / calls);
  }
  return best * 1e9 * ghz / (groups * blocks * T);
}

int main(int argc, char** argv) {
  const double ghz = argc > 1 ? std::atof(argv[1]) : 3.66;
  at::set_num_threads(1);
  std::printf("512-bit K loops %d, VNNI %d; cycles at %.2f GHz per (8 rows, 256 weights, token), 128 x 1536 blocks, "
              "one thread\n", int(kWideK), int(kVnni), ghz);
  for (int64_t T : {1, 8, 16})
    std::printf("T%-3ld Q4_K %6.1f  Q6_K %6.1f\n", static_cast<long>(T),
                cycles_per_unit<Q4Kx8>(128, 1536, T, 3000, ghz), cycles_per_unit<Q6Kx8>(128, 1536, T, 3000, ghz));
}
