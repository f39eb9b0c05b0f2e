// wall_clock.h: the one scale for tests' wall-clock bounds. The bounds are written for a
// normal (Release) build. In the sanitized build (tools/test.sh's second stage, compile
// definition MHAR_SANITIZE) allocation-heavy code runs far slower: planning the 1024-layer
// model took 0.056 s in Release and 2.3 s there on CI's 2 cores (41x; ASan's slow unwinder
// records every allocation's stack), so there the bounds only catch hangs.
#pragma once

namespace mhar::test {

#ifdef MHAR_SANITIZE
inline constexpr double kWallClockScale = 100.0;
#else
inline constexpr double kWallClockScale = 1.0;
#endif

// A bound of `seconds` in a normal build, scaled for the build under test.
inline constexpr double wall_clock_bound(double seconds) { return seconds * kWallClockScale; }

}  // namespace mhar::test
