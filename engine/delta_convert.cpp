// delta_convert.cpp: the conversion of a `standard` checkpoint into a `delta` run
// directory (delta_convert.h). The weights go through a standard CPU fp32 model (which
// validates the file: exact names and shapes, F32, finite) into a delta model of the
// same shapes whose own parameters keep their init, then out as a step-0 run directory
// (run_dir.h, as `mhar import` writes one): F32 to F32 through double is exact, so every
// original weight is written bit for bit.
#include "engine/delta_convert.h"

#include "engine/backend.h"
#include "engine/checkpoint.h"
#include "engine/error.h"
#include "engine/hf_export.h"
#include "engine/model.h"
#include "engine/run_dir.h"

namespace mhar {

DeltaConvertResult convert_to_delta(const DeltaConvertOptions& opt) {
  if (opt.out_dir.empty()) fail("--out is empty; give the run directory to create");
  const CheckpointInfo ckpt = open_checkpoint(opt.checkpoint);
  const Config& from = ckpt.config;
  if (from.residual.mode != ResidualMode::Standard)
    fail(ckpt.dir, ": residual.mode is \"", residual_mode_name(from.residual.mode),
         "\", but --mode delta converts a \"standard\" model only (the delta mode adds its routed "
         "term to the standard residual stream)");
  const ModelConfig& m = from.model;
  if (opt.block_layers < 1 || opt.block_layers > m.n_layers)
    fail("--block-layers ", opt.block_layers, " is out of range for ", ckpt.dir,
         "'s model of model.n_layers = ", m.n_layers, "; valid: 1..", m.n_layers);
  const int heads = opt.heads == 0 ? m.n_kv_heads : opt.heads;
  if (heads < 1 || m.d_model % heads)
    fail("--heads ", opt.heads, " does not divide ", ckpt.dir, "'s model.d_model = ", m.d_model,
         "; valid: a divisor of ", m.d_model, " (default: model.n_kv_heads = ", m.n_kv_heads, ")");
  if (path_within(ckpt.dir, opt.out_dir) || path_within(opt.out_dir, ckpt.dir))
    fail("--out ", opt.out_dir, " overlaps the checkpoint being converted (", ckpt.dir,
         "); choose another directory");

  // The delta config: the run's own sections, the residual section replaced, validated
  // as any config file is.
  nlohmann::json j = from.to_json();
  j["residual"] = {{"mode", "delta"}, {"heads", heads}, {"block_layers", opt.block_layers}};
  const Config cfg = config_from_json(j, ckpt.dir + " converted to delta");

  auto backend = make_cpu_backend(DType::F32);
  Model standard(from.model, from.residual, *backend, 1, 1);
  load_model_weights(ckpt, standard);
  Model delta(cfg.model, cfg.residual, *backend, 1, 1);
  delta.init_weights(cfg.train.seed);  // the delta parameters' init; the rest is replaced
  DeltaConvertResult result;
  std::vector<double> v;
  for (const Parameter& p : standard.parameters()) {
    const Parameter& q = delta.parameter(p.name);
    MHAR_CHECK(q.value.numel() == p.value.numel(), "shape of ", p.name);
    v.resize(size_t(p.value.numel()));
    backend->download(v.data(), p.value);
    backend->upload(q.value, v.data());
  }
  for (const Parameter& q : delta.parameters()) {
    result.parameters += q.value.numel();
    if (q.name.rfind("model.delta.", 0) == 0) result.added_parameters += q.value.numel();
  }
  MHAR_CHECK(result.parameters - result.added_parameters == standard.num_parameters(),
             "every parameter of the delta model is a standard one or model.delta.*");

  const Step0Run run = write_step0_run(opt.out_dir, opt.overwrite, cfg, delta,
                                       nlohmann::json::object());  // a new run: no data position
  result.source_checkpoint = ckpt.dir;
  result.run_dir = run.run_dir;
  result.checkpoint_dir = run.checkpoint_dir;
  result.heads = heads;
  result.block_layers = opt.block_layers;
  return result;
}

}  // namespace mhar
