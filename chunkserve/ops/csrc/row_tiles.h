// Row tiles for the linear kernels that keep a tile's rows in registers: each tile height is its
// own instantiation of the kernel's tile function, chosen at run time here, in one place.
#pragma once

#include <cstdint>
#include <type_traits>
#include <utility>

// f(std::integral_constant<int, R>{}) for R = min(rows, Max), rows >= 1.
template <int Max, typename F>
inline void with_row_tile(int64_t rows, F&& f) {
  if constexpr (Max == 1) {
    f(std::integral_constant<int, 1>{});
  } else if (rows >= Max) {
    f(std::integral_constant<int, Max>{});
  } else {
    with_row_tile<Max - 1>(rows, std::forward<F>(f));
  }
}

// tile(m, R) over the M rows in tiles of up to Max rows (R a std::integral_constant, m the tile's first row).
template <int Max, typename F>
inline void for_each_row_tile(int64_t M, F&& tile) {
  for (int64_t m = 0; m < M; m += Max) {
    with_row_tile<Max>(M - m, [&](auto rows) { tile(m, rows); });
  }
}
