// Function multi-versioning for the hot loops: GCC compiles each marked function once for
// AVX2 and once for baseline x86-64 and picks at load time, so packages run on any x86-64 CPU
// (never -march=native). Neither clone uses FMA, so both round identically.
#pragma once

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define CAI_VECTOR_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define CAI_VECTOR_CLONES
#endif

// For the per-element helpers inlined into those functions, so they take the clone's ISA.
#define CAI_INLINE_KERNEL [[gnu::always_inline]] inline
