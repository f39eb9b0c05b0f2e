// run_dir.h: a new run directory at step 0 for a model that arrives with its weights
// (`mhar import`, `mhar convert`): config.json, any extra files (a tokenizer), and a
// step-0 checkpoint with a fresh AdamW, all staged and published in one rename
// (StagedDirectory), so a failure leaves no half-written run.
#pragma once
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine/config.h"
#include "engine/model.h"

namespace mhar {

struct Step0Run {
  std::string run_dir;         // the published directory
  std::string checkpoint_dir;  // its step-0 checkpoint
};

// `out_dir` is the --out path (refused if it exists unless `overwrite`); `files` are
// (name, text) pairs written next to config.json; `loader` is the data position the
// checkpoint records (an empty object for a run that has read no data).
Step0Run write_step0_run(const std::string& out_dir, bool overwrite, const Config& cfg,
                         Model& model, const nlohmann::json& loader,
                         const std::vector<std::pair<std::string, std::string>>& files = {});

}  // namespace mhar
