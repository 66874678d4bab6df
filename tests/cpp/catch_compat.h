// Include this, not Catch2 directly: Debian 12 ships Catch2 v2, Ubuntu 24.04 v3.
#pragma once
#if __has_include(<catch2/catch_test_macros.hpp>)
#include <catch2/catch_approx.hpp>
#include <catch2/catch_test_macros.hpp>
#include <catch2/generators/catch_generators.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>
using Catch::Approx;
#else
#include <catch2/catch.hpp>
#endif

// A test case that cannot run on this machine says why and ends: Catch2 v3's
// SKIP, or on v2 (Debian 12, no SKIP) a warning and a return. Registered as its
// own ctest entry (trainstream_add_test's CASES), ctest reports it as skipped,
// with this reason in its output, on either version.
#ifdef SKIP
#define TS_SKIP(reason) SKIP("TS_SKIPPED: " << (reason))
#else
#define TS_SKIP(reason)               \
  do {                                \
    WARN("TS_SKIPPED: " << (reason)); \
    return;                           \
  } while (false)
#endif
