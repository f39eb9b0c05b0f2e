// commands.h: one register function per subcommand; each lives in cli/cmd_<name>.cpp,
// adds its CLI11 subcommand with its options and --help text, and sets its callback.
// Callbacks throw mhar::Error for user errors; main() prints them and exits 1.
//
// Also the checks every subcommand shares for what a user types:
// - numbers: CLI11 2.1 turns "-1" into 2^64-1 for an unsigned option and takes "" as 0,
//   so numeric options are registered through add_number(), which reads the whole text
//   strictly and checks the option's range, naming the option, the text and the range;
// - paths: a checkpoint argument that is not a directory, and a shard "glob" that is a
//   directory, get a message saying what the path is and what was expected.
#pragma once
#include <sys/stat.h>

#include <CLI/CLI.hpp>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <limits>
#include <sstream>
#include <string>
#include <type_traits>

#include "engine/config.h"
#include "engine/error.h"
#include "engine/file_io.h"

namespace mhar::data {
class Tokenizer;
}

namespace mhar::cli {

void register_config(CLI::App& app);
void register_train(CLI::App& app);
void register_eval(CLI::App& app);
void register_data(CLI::App& app);
void register_sample(CLI::App& app);
void register_report(CLI::App& app);
void register_bench_command(CLI::App& app);  // `mhar bench` (cmd_bench.cpp)
void register_probe(CLI::App& app);          // `mhar probe` (cmd_probe.cpp)
void register_export(CLI::App& app);         // `mhar export` (cmd_export.cpp)
void register_import(CLI::App& app);         // `mhar import` (cmd_import.cpp)
void register_convert(CLI::App& app);        // `mhar convert` (cmd_convert.cpp)

// The checkpoint's data.tokenizer, or the one `tokenizer_option` (--tokenizer) names
// when given (run_tokenizer.cpp).
data::Tokenizer load_run_tokenizer(const Config& cfg, const std::string& tokenizer_option);

// ---------------------------------------------------------------- numbers

namespace detail {
inline std::string quoted(const std::string& text) {
  std::string q = "'";
  for (const char c : text.substr(0, 64))
    q += (static_cast<unsigned char>(c) < 0x20 || static_cast<unsigned char>(c) >= 0x7f) ? '?' : c;
  return q + (text.size() > 64 ? "...'" : "'");
}
}  // namespace detail

// The whole of `text` as an integer of type T in [lo, hi]; else mhar::Error naming
// `option`, the text as typed and the valid range.
template <class T>
T parse_integer_arg(const std::string& option, const std::string& text, T lo, T hi) {
  static_assert(std::is_integral<T>::value, "integers only");
  auto bad = [&](const char* why) {
    fail(option, " ", detail::quoted(text), ": ", why, "; valid: a whole number from ", lo,
         " to ", hi);
  };
  const char* b = text.data();
  const char* e = b + text.size();
  if (b != e && *b == '+') ++b;  // from_chars takes no sign but '-'
  if (std::is_unsigned<T>::value && b != e && *b == '-') {
    // A negative number for an unsigned option: say so rather than "not a number".
    long long neg = 0;
    const auto r = std::from_chars(b, e, neg);
    if (r.ec == std::errc() && r.ptr == e && neg != 0) bad("is negative");
    if (r.ec == std::errc::result_out_of_range && r.ptr == e) bad("is negative");
    if (r.ec == std::errc() && r.ptr == e) return T(0);  // "-0"
  }
  T v{};
  const auto r = std::from_chars(b, e, v);
  if (text.empty()) bad("is empty");
  if (r.ec == std::errc::result_out_of_range) bad("is out of range");
  if (r.ec != std::errc() || r.ptr != e || b == e) bad("is not a whole number");
  if (v < lo || v > hi) bad("is out of range");
  return v;
}

// The whole of `text` as a finite double in [lo, hi].
inline double parse_real_arg(const std::string& option, const std::string& text, double lo,
                             double hi) {
  auto bad = [&](const char* why) {
    fail(option, " ", detail::quoted(text), ": ", why, "; valid: a number from ", lo, " to ", hi);
  };
  if (text.empty()) bad("is empty");
  if (std::isspace(static_cast<unsigned char>(text[0]))) bad("is not a number");
  char* end = nullptr;
  errno = 0;
  const double v = std::strtod(text.c_str(), &end);
  if (end == text.c_str() || *end != '\0' || text.find('\0') != std::string::npos)
    bad("is not a number");
  if (errno == ERANGE && (v == HUGE_VAL || v == -HUGE_VAL)) bad("is out of the range of a number");
  if (!std::isfinite(v)) bad("is not a finite number");
  if (v < lo || v > hi) bad("is out of range");
  return v == 0 ? 0.0 : v;  // no -0 downstream
}

// Registers a numeric option whose text is parsed by parse_integer_arg / parse_real_arg
// when the command line is processed (before any callback), with the default shown in
// --help.
template <class T>
CLI::Option* add_number(CLI::App* cmd, const std::string& name, T& target, T lo, T hi,
                        const std::string& help) {
  const std::string option = name.substr(0, name.find(','));
  CLI::Option* o = cmd->add_option_function<std::string>(
      name,
      [&target, option, lo, hi](const std::string& text) {
        if constexpr (std::is_floating_point<T>::value)
          target = parse_real_arg(option, text, lo, hi);
        else
          target = parse_integer_arg<T>(option, text, lo, hi);
      },
      help);
  o->type_name(std::is_floating_point<T>::value ? "FLOAT" : "INT");
  std::ostringstream def;
  def << target;
  o->default_str(def.str());
  return o;
}

// ---------------------------------------------------------------- batch shapes

// The batch a command that runs a checkpoint's model (eval, probe, eval --task) uses:
// --batch-size (0: the checkpoint's train.micro_batch) windows of --seq-len tokens (0:
// `default_seq_len`), checked against the model's context and the engine's memory caps
// (check_footprint) before anything is allocated; `command` names it in the messages.
struct BatchShape {
  int batch = 0, seq_len = 0;
};
inline BatchShape checkpoint_batch_shape(const Config& cfg, int batch_size, int seq_len, int default_seq_len,
                                         const std::string& command) {
  const BatchShape s{batch_size > 0 ? batch_size : cfg.train.micro_batch, seq_len > 0 ? seq_len : default_seq_len};
  if (s.seq_len > cfg.model.context_length)
    fail("--seq-len ", s.seq_len, " exceeds the model's context_length ", cfg.model.context_length);
  check_footprint(cfg.model, cfg.residual, s.batch, s.seq_len,
                  command + " with --batch-size " + std::to_string(s.batch) + " and --seq-len " +
                      std::to_string(s.seq_len));
  return s;
}

// ---------------------------------------------------------------- paths

// `path` must be an existing directory: a checkpoint or run directory. `noun` names what
// was expected ("run directory"), for the message.
inline void require_directory(const std::string& option, const std::string& path,
                              const std::string& noun) {
  if (path.empty()) fail(option, " is empty; give a ", noun);
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    const int err = errno;
    if (err == ENOENT) fail(option, " ", path, ": no such ", noun);
    fail(option, " ", path, ": cannot open (", std::strerror(err), "); give a ", noun);
  }
  if (!S_ISDIR(st.st_mode))
    fail(option, " ", path, " is ", file_type_name(st.st_mode), ", not a ", noun);
}

// A shard pattern without wildcards names one file: say what it is when it is a
// directory (the loader would report "no such file"; the message suggests the pattern
// probably meant), another kind of file, or cannot be looked at (a symlink loop, no
// permission). A missing file is left to the loader's message.
inline void check_shard_pattern(const std::string& what, const std::string& pattern,
                                const char* example_name) {
  if (pattern.empty() || pattern.find_first_of("*?[") != std::string::npos) return;
  struct stat st {};
  if (::stat(pattern.c_str(), &st) != 0) {
    const int err = errno;
    if (err == ENOENT) return;
    fail(what, " = ", pattern, ": cannot open (", std::strerror(err), ")");
  }
  if (S_ISDIR(st.st_mode))
    fail(what, " = ", pattern, " is a directory, not a shard file or glob; give the shards in it, "
         "e.g. \"", (std::filesystem::path(pattern) / example_name).string(), "\"");
  if (!S_ISREG(st.st_mode))
    fail(what, " = ", pattern, " is ", file_type_name(st.st_mode), ", not a shard file");
}

}  // namespace mhar::cli
