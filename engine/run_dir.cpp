// run_dir.cpp: write_step0_run (run_dir.h).
#include "engine/run_dir.h"

#include <filesystem>

#include "engine/checkpoint.h"
#include "engine/hf_export.h"
#include "engine/optimizer.h"

namespace fs = std::filesystem;

namespace mhar {

Step0Run write_step0_run(const std::string& out_dir, bool overwrite, const Config& cfg,
                         Model& model, const nlohmann::json& loader,
                         const std::vector<std::pair<std::string, std::string>>& files) {
  StagedDirectory out(out_dir, overwrite);
  write_new_file((fs::path(out.path()) / "config.json").string(), cfg.to_json().dump(2) + "\n");
  for (const auto& [name, text] : files) write_new_file((fs::path(out.path()) / name).string(), text);
  AdamWOptimizer opt(model, cfg.train);  // zero moments: a fresh optimizer
  opt.sync_master_from_params();
  CheckpointWrite w;
  w.run_dir = out.path();
  w.step = 0;
  w.config = &cfg;
  w.loader = loader;
  w.trainer = {{"tokens_seen", 0},
               {"total_bad_steps", 0},
               {"consecutive_bad_steps", 0},
               {"elapsed_s", 0.0}};  // state.json's trainer fields are validated strictly:
                                     // counters only (engine/checkpoint_state.cpp)
  w.keep = 0;
  const std::string written = save_checkpoint(w, model, opt);
  out.publish();
  return {out.final_path(),
          (fs::path(out.final_path()) / "checkpoints" / fs::path(written).filename()).string()};
}

}  // namespace mhar
