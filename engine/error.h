// error.h: the one exception type the engine throws for bad input or bad state.
// Messages are written for the user: they name the file or field, the bad value, and
// what would be valid. The CLI catches Error, prints the message and exits non-zero.
#pragma once
#include <sstream>
#include <stdexcept>
#include <string>

namespace mhar {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& msg) : std::runtime_error(msg) {}
};

// Concatenates any streamable values into one message: fail("x = ", 3, " is odd").
template <class... Args>
[[noreturn]] void fail(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  throw Error(os.str());
}

}  // namespace mhar

// Internal invariant (a bug in the engine, not in the user's input).
#define MHAR_CHECK(cond, ...)                                                        \
  do {                                                                             \
    if (!(cond)) ::mhar::fail(__FILE__, ":", __LINE__, ": check failed: " #cond " ", \
                              ##__VA_ARGS__);                                      \
  } while (0)
