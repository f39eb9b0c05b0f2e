// checkpoint_state.h: a checkpoint's state.json: its schema, its own checksum, and reading
// it back field by field (DESIGN.md section 6; the directory layout is in engine/checkpoint.h).
//
// state.json is what the engine trusts about a checkpoint: the step, the config, the
// data position, the trainer's counters and the size and checksum of every other file.
// So it is checked as hard as the tensors are:
// - read only as a regular file of at most 16 MiB, through the strict JSON reader
//   (engine/json_io.h: depth limit, duplicate keys refused), never waited on;
// - covered by its own checksum, "state_fnv1a64": FNV-1a 64 of the compact dump of the
//   object without that field (nlohmann::json sorts keys and prints numbers so that they
//   read back to the same value, so the dump of what was written and of what is read back
//   are the same text);
// - every field checked for type and range (and against the config where they must
//   agree), unknown fields refused, every message naming the file, field and value;
// - every entry of "files" a plain file name in the checkpoint directory, a regular file
//   of the recorded size and checksum.
#pragma once
#include <string>

#include <nlohmann/json.hpp>

#include "engine/checkpoint.h"

namespace mhar {

// Format 2 added state_fnv1a64; format 1 checkpoints are refused (see checkpoint_state.cpp).
constexpr const char* kCheckpointFormat = "mhar-checkpoint-2";
constexpr const char* kStateChecksumField = "state_fnv1a64";

// The checksum to store under kStateChecksumField: 16 lowercase hex digits of FNV-1a 64
// over state's compact dump without that field (its value, if present, is ignored).
std::string state_checksum(const nlohmann::json& state);

// Reads DIR/state.json, validates it (see above) and verifies every file it lists. Throws
// mhar::Error naming the file, the field, the bad value and what would be valid.
CheckpointInfo read_checkpoint_dir(const std::string& dir);

}  // namespace mhar
