// delta_convert.h: `mhar convert --mode delta` (DESIGN.md section 2): a trained `standard`
// checkpoint becomes a run directory whose step-0 checkpoint is the same model in mode
// `delta`: every original weight bit for bit, the delta parameters at their init (gates,
// null and queries 0, gains 1), so its logits equal the original's exactly, and a fresh
// optimizer (zero moments, step 0). Training continues from it as a new run:
// `mhar train OUT/config.json --init-from OUT --run-dir NEW_RUN` (the run's schedule from
// step 1, a fresh optimizer, as for any --init-from).
#pragma once
#include <string>

namespace mhar {

struct DeltaConvertOptions {
  std::string checkpoint;  // a standard checkpoint, or a run directory (its newest)
  std::string out_dir;     // the run directory to create; must not exist unless overwrite
  bool overwrite = false;  // replace out_dir, once the new one is complete
  int block_layers = 4;    // residual.block_layers
  int heads = 0;           // residual.heads; 0 = model.n_kv_heads
};

struct DeltaConvertResult {
  std::string source_checkpoint;  // the checkpoint that was read
  std::string run_dir, checkpoint_dir;
  int64_t parameters = 0, added_parameters = 0;
  int heads = 0, block_layers = 0;
};

// Throws mhar::Error naming the checkpoint (a mode other than standard, a damaged file),
// the option (--block-layers, --heads out of range) or --out (exists, inside the input).
DeltaConvertResult convert_to_delta(const DeltaConvertOptions& opt);

}  // namespace mhar
