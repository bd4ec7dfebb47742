// Winograd F(2x2, 3x3) per-tile kernels (see winograd.h), included twice by winograd.h: once for
// the AVX-512 / AVX2 / baseline clones, once compiled for AVX512_BF16 (GML_WINO_NATIVE_BF16: its
// one-instruction fp32 -> bf16 conversion, where the portable rounding takes ten). No include
// guard, by design; only winograd.h includes it, inside its namespaces.

inline __attribute__((always_inline)) f32x16 load16(const float* p) {
  f32x16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline __attribute__((always_inline)) f32x16 load16(const uint16_t* p) {
  u16x16 h;
  std::memcpy(&h, p, sizeof h);
  const u32x16 u = __builtin_convertvector(h, u32x16) << 16;
  return (f32x16)u;  // a GCC vector cast: the same bits
}
inline __attribute__((always_inline)) void store16(float* p, f32x16 x) { std::memcpy(p, &x, sizeof x); }
#ifdef GML_WINO_NATIVE_BF16
// AVX512_BF16's conversion: round to nearest even, NaN kept (and inputs below 2^-126 read as zero)
inline __attribute__((always_inline)) void store16(uint16_t* p, f32x16 x) {
  const __m256bh h = _mm512_cvtneps_pbh(reinterpret_cast<__m512>(x));
  std::memcpy(p, &h, sizeof h);
}
#else
inline __attribute__((always_inline)) void store16(uint16_t* p, f32x16 x) {  // as store(uint16_t*, float)
  const u32x16 u = (u32x16)x;
  const u32x16 rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const u32x16 nan = (u32x16)((u & 0x7fffffffu) > 0x7f800000u);  // all ones where NaN
  const u32x16 r = (nan & ((u >> 16) | 0x40u)) | (~nan & rounded);
  const u16x16 h = __builtin_convertvector(r, u16x16);
  std::memcpy(p, &h, sizeof h);
}
#endif
inline __attribute__((always_inline)) f32x16 select16(i32x16 mask, f32x16 a, f32x16 b) {
  const u32x16 m = (u32x16)mask;
  return (f32x16)((m & (u32x16)a) | (~m & (u32x16)b));
}

// One tile's input transform, for all C channels: p[16] point at the 4x4 patch's pixels
// (row-major; a pixel outside the image points at a row of zeros); V[xi] of channel c goes to
// v[xi * vs + c]. ``F``: f32x16 or float, ``T``: the element type.
template <typename F, typename T>
inline __attribute__((always_inline)) void input_at(const T* const* q, T* v, int64_t vs, int64_t c) {
  F d[16], t[16];
  for (int k = 0; k < 16; ++k) {
    if constexpr (std::is_same_v<F, float>) d[k] = to_f32(q[k][c]);
    else d[k] = load16(q[k] + c);
  }
  for (int j = 0; j < 4; ++j) {  // t = B^T d
    t[0 + j] = d[0 + j] - d[8 + j];
    t[4 + j] = d[4 + j] + d[8 + j];
    t[8 + j] = d[8 + j] - d[4 + j];
    t[12 + j] = d[4 + j] - d[12 + j];
  }
  for (int r = 0; r < 4; ++r) {  // V = t B
    const F out[4] = {t[r * 4 + 0] - t[r * 4 + 2], t[r * 4 + 1] + t[r * 4 + 2], t[r * 4 + 2] - t[r * 4 + 1],
                      t[r * 4 + 1] - t[r * 4 + 3]};
    for (int j = 0; j < 4; ++j) {
      if constexpr (std::is_same_v<F, float>) store(v + (r * 4 + j) * vs + c, out[j]);
      else store16(v + (r * 4 + j) * vs + c, out[j]);
    }
  }
}

template <typename T>
inline __attribute__((always_inline)) void input_tile(const T* const* p, T* v, int64_t vs, int64_t C) {
  int64_t c = 0;
  for (; c + 16 <= C; c += 16) input_at<f32x16>(p, v, vs, c);
  for (; c < C; ++c) input_at<float>(p, v, vs, c);
}

// The post-ops of Epilogue after the sum, on a float or an f32x16.
template <typename F>
inline __attribute__((always_inline)) F epilogue(F y, const Epilogue& e) {
  y = e.lin_a * y + e.lin_b;
  if constexpr (std::is_same_v<F, float>) {
    y = y >= 0.0f ? y : e.slope * y;
    return std::min(std::max(y, e.lo), e.hi);
  } else {
    y = select16(y >= 0.0f, y, e.slope * y);
    y = select16(y < e.lo, F{} + e.lo, y);
    return select16(y > e.hi, F{} + e.hi, y);
  }
}

// One tile's output transform for all K output channels: m[xi * ms + c] -> the 2x2 outputs
// o[0..3] (row-major; o[1] / o[2] / o[3] exist when kRight / kBottom / both).
template <typename F, typename T, bool kRight, bool kBottom, bool kSum>
inline __attribute__((always_inline)) void output_at(const float* m, int64_t ms, T* const* o, const float* bias,
                                                     const Epilogue& e, int64_t c) {
  F a[16], s[8];
  for (int k = 0; k < 16; ++k) {
    if constexpr (std::is_same_v<F, float>) a[k] = m[k * ms + c];
    else a[k] = load16(m + k * ms + c);
  }
  for (int j = 0; j < 4; ++j) {  // s = A^T m
    s[j] = a[j] + a[4 + j] + a[8 + j];
    s[4 + j] = a[4 + j] - a[8 + j] - a[12 + j];
  }
  F b;
  if constexpr (std::is_same_v<F, float>) b = bias[c];
  else b = load16(bias + c);
  F y[4] = {s[0] + s[1] + s[2] + b, s[1] - s[2] - s[3] + b, s[4] + s[5] + s[6] + b, s[5] - s[6] - s[7] + b};
  const bool exists[4] = {true, kRight, kBottom, kRight && kBottom};
  for (int i = 0; i < 4; ++i) {
    if (!exists[i]) continue;
    if constexpr (std::is_same_v<F, float>) {
      if (kSum) y[i] += e.sum_scale * to_f32(o[i][c]);
      store(o[i] + c, epilogue(y[i], e));
    } else {
      if (kSum) y[i] += e.sum_scale * load16(o[i] + c);
      store16(o[i] + c, epilogue(y[i], e));
    }
  }
}

template <typename T, bool kRight, bool kBottom, bool kSum>
inline __attribute__((always_inline)) void output_tile(const float* m, int64_t ms, T* const* o, const float* bias,
                                                       const Epilogue& e, int64_t K) {
  int64_t c = 0;
  for (; c + 16 <= K; c += 16) output_at<f32x16, T, kRight, kBottom, kSum>(m, ms, o, bias, e, c);
  for (; c < K; ++c) output_at<float, T, kRight, kBottom, kSum>(m, ms, o, bias, e, c);
}

// The per-tile entry points (GML_WINO_ENTRY: their target attribute).

GML_WINO_ENTRY inline void input_tile_f32(const float* const* p, float* v, int64_t vs, int64_t C) {
  input_tile<float>(p, v, vs, C);
}
GML_WINO_ENTRY inline void input_tile_bf16(const uint16_t* const* p, uint16_t* v, int64_t vs, int64_t C) {
  input_tile<uint16_t>(p, v, vs, C);
}

template <typename T, bool kSum>
inline __attribute__((always_inline)) void output_tile_any(const float* m, int64_t ms, T* const* o, bool right,
                                                           bool bottom, const float* bias, const Epilogue& e,
                                                           int64_t K) {
  if (right && bottom) output_tile<T, true, true, kSum>(m, ms, o, bias, e, K);
  else if (right) output_tile<T, true, false, kSum>(m, ms, o, bias, e, K);
  else if (bottom) output_tile<T, false, true, kSum>(m, ms, o, bias, e, K);
  else output_tile<T, false, false, kSum>(m, ms, o, bias, e, K);
}

GML_WINO_ENTRY inline void output_tile_f32(const float* m, int64_t ms, float* const* o, bool right, bool bottom,
                                            const float* bias, const Epilogue& e, int64_t K) {
  if (e.sum) output_tile_any<float, true>(m, ms, o, right, bottom, bias, e, K);
  else output_tile_any<float, false>(m, ms, o, right, bottom, bias, e, K);
}
GML_WINO_ENTRY inline void output_tile_bf16(const float* m, int64_t ms, uint16_t* const* o, bool right, bool bottom,
                                             const float* bias, const Epilogue& e, int64_t K) {
  if (e.sum) output_tile_any<uint16_t, true>(m, ms, o, right, bottom, bias, e, K);
  else output_tile_any<uint16_t, false>(m, ms, o, right, bottom, bias, e, K);
}

