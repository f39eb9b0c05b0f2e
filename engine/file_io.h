// file_io.h: every file the engine reads or writes goes through here.
//
// Reading: only regular files are opened (a FIFO, a device such as /dev/zero, a
// directory or a symlink to one is refused with a message, never read or waited on), and
// the size is capped by the caller, so a hostile path can neither hang nor exhaust memory.
//
// Writing: a file is published whole or not at all. `write_file_atomic` (and
// `CheckedFile` + `publish`) write into a temporary name beside the target, check every
// write(2), fsync the data, rename over the target and fsync the directory. A failure at
// any point (a full disk, an I/O error) removes the temporary file and leaves the old
// target untouched. Nothing is ever rewritten in place with truncation.
//
// Appending (metrics.jsonl): `AppendFile` adds whole records with checked writes; a record
// that cannot be written whole is cut off again, so the file never loses what it had.
//
// Simulated full disk (documented in the README): with MHAR_SIMULATE_DISK_FULL_AFTER_BYTES=N
// in the environment, writes through this module fail with "No space left on device" once
// the process has written N bytes through it (counted from the first write that sees this
// value; a changed or removed value starts the count again, so a test can set it in
// process between runs). Tests use it where no real small filesystem can be mounted.
#pragma once
#include <sys/types.h>

#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

namespace mhar {

// What a stat mode is, for messages: "a directory", "a FIFO (named pipe)", ...
const char* file_type_name(mode_t mode);

// Throws mhar::Error unless `path` exists and is a regular file (after following
// symlinks). `what` says what the file was meant to be ("config file", "shard", ...).
void require_regular_file(const std::string& path, const char* what);

// Reads a whole regular file. Refuses non-regular files (see above) and files larger than
// `max_bytes`, naming the path, the size and the limit.
std::string read_regular_file(const std::string& path, const char* what,
                              uint64_t max_bytes = uint64_t(1) << 30);

// FNV-1a 64-bit, the checksum recorded for checkpoint files and state.json.
constexpr uint64_t kFnv1aOffset = 1469598103934665603ULL;
uint64_t fnv1a64(uint64_t h, const void* data, size_t n);
std::string hex64(uint64_t v);

// A file written through write(2) with every byte counted, hashed (FNV-1a) and checked.
// close() fsyncs. The destructor of an unclosed file closes the descriptor and removes
// the file: a CheckedFile that did not reach close() leaves nothing behind.
class CheckedFile {
 public:
  explicit CheckedFile(const std::string& path);
  ~CheckedFile();
  CheckedFile(const CheckedFile&) = delete;
  CheckedFile& operator=(const CheckedFile&) = delete;
  void write(const void* data, size_t n);
  void write(const std::string& s) { write(s.data(), s.size()); }
  void close();  // fsync + close; throws on failure
  bool is_open() const { return fd_ >= 0; }
  uint64_t bytes() const { return bytes_; }
  uint64_t hash() const { return hash_; }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  int fd_ = -1;
  uint64_t bytes_ = 0, hash_ = kFnv1aOffset;
};

// Publishes `f` (written under a temporary name, e.g. temp_path_for(target)): closes it
// if still open (fsync), renames it over `target` and fsyncs the directory. On failure the
// temporary file is removed and `target` is untouched; the error names `target`.
void publish(CheckedFile& f, const std::string& target);

// An existing regular file extended by whole records (O_APPEND; one writer at a time, which
// the run lock guarantees for metrics.jsonl). Every write is checked and counted for the
// simulated full disk; a record that fails part-way (ENOSPC, EIO) is truncated off again
// and the error names the file and the cause, so the file holds exactly the records that
// were appended whole.
class AppendFile {
 public:
  explicit AppendFile(const std::string& path);
  ~AppendFile();
  AppendFile(const AppendFile&) = delete;
  AppendFile& operator=(const AppendFile&) = delete;
  void append(const std::string& record);
  void sync();  // fdatasync: every record appended so far is durable; throws on failure
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  int fd_ = -1;
};

// Writes `contents` to `path` atomically (temporary file in the same directory, checked
// writes, fsync, rename, directory fsync). On failure the old `path` is untouched and no
// temporary file remains; the error names `path` and the cause.
void write_file_atomic(const std::string& path, const std::string& contents);

// The name write_file_atomic uses beside `path` for its temporary file; unique per
// process, hidden, and recognisable so stale ones from killed writers can be found.
std::string temp_path_for(const std::string& path);

// fsync of a directory, so that renames and creations inside it are durable.
void fsync_dir(const std::string& dir);

}  // namespace mhar
