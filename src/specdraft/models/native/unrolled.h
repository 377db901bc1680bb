// unrolled<N>(f): f(std::integral_constant<int, 0>{}) .. f(std::integral_constant<int, N - 1>{}), in order: a loop
// whose index must be a constant in its body. GCC 12 at -O3 leaves a 4-trip loop rolled, with the index tested in
// it, and an array of accumulators indexed in a rolled loop lives in memory. Shared by kernels.cpp and
// quant_kernels.cpp (kernels.py fingerprints it with them).
#pragma once

#include <utility>

namespace specdraft {

template <typename F, int... I>
inline __attribute__((always_inline)) void unrolled_over(F& f, std::integer_sequence<int, I...>) {
  (f(std::integral_constant<int, I>{}), ...);
}

template <int N, typename F>
inline __attribute__((always_inline)) void unrolled(F&& f) {
  unrolled_over(f, std::make_integer_sequence<int, N>{});
}

}  // namespace specdraft
