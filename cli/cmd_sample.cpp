// cmd_sample.cpp: `mhar sample --checkpoint DIR --prompt TEXT [--max-tokens N]
// [--temperature T] [--top-k K] [--seed S] [--device cpu|cuda|auto]` prints the prompt's
// continuation. The continuation alone goes to stdout, token by token as it is generated
// (so the output can be piped); the summary line goes to stderr.
// The device is chosen as `mhar train` chooses it (engine/backend_factory.h): --device,
// else the checkpoint's train.device, so a run trained on the CPU samples on the CPU and
// one trained with "auto" samples on the GPU when there is one. The CPU backend decodes
// in fp32, the CUDA backend in bf16 (Backend::rope_at / attention_cached); a seed repeats
// its text on one device, but the GPU's text can differ from the CPU's where bf16
// rounding reorders nearly tied logits (tests/sample_cudatest.cpp bounds the difference).
#include <chrono>
#include <cstdio>
#include <filesystem>

#include "cli/commands.h"
#include "data/tokenizer.h"
#include "engine/backend.h"
#include "engine/backend_factory.h"
#include "engine/checkpoint.h"
#include "engine/error.h"
#include "engine/sampler.h"

namespace mhar::cli {

void register_sample(CLI::App& app) {
  auto* cmd = app.add_subcommand("sample", "Generate text from a checkpoint");
  cmd->footer(
      "Prefills the prompt in one chunk, then decodes token by token with a KV cache (cost\n"
      "linear in length) until <|endoftext|>, --max-tokens or the model's context length.\n"
      "The continuation goes to stdout as it is generated, a summary line to stderr.\n"
      "Runs on --device (default: the checkpoint's train.device): cpu decodes in fp32,\n"
      "cuda in bf16, so a seed's text on the GPU can differ from its text on the CPU.");
  static std::string checkpoint, prompt, tokenizer_name, device;
  static SamplingOptions opt = [] {
    SamplingOptions o;
    o.temperature = 0.8;
    o.top_k = 50;
    return o;
  }();
  cmd->add_option("--checkpoint", checkpoint,
                  "Checkpoint directory, or a run directory (its newest checkpoint)")
      ->required();
  cmd->add_option("--prompt", prompt,
                  "Text to continue; special tokens such as <|endoftext|> are recognised. Empty:\n"
                  "start from <|endoftext|> (an unconditional sample)");
  // Ranges: max_tokens and top_k are counts of tokens (a vocabulary has at most 2^24);
  // a temperature is a plausibility bound (at 1000 sampling is all but uniform).
  add_number(cmd, "--max-tokens", opt.max_tokens, 0, 1 << 24,
             "New tokens at most (generation also stops at the model's context length)");
  add_number(cmd, "--temperature", opt.temperature, 0.0, 1000.0, "Softmax temperature; 0 = greedy");
  add_number(cmd, "--top-k", opt.top_k, 0, 1 << 24, "Sample among the K most likely tokens; 0 = all");
  add_number(cmd, "--seed", opt.seed, uint64_t(0), UINT64_MAX,
             "Random seed (0 to 2^64-1): the same seed gives the same text");
  cmd->add_option("--tokenizer", tokenizer_name,
                  "gpt2, qwen3 or a tokenizer.json path (default: the checkpoint's data.tokenizer)");
  cmd->add_option("--device", device,
                  "cpu, cuda or auto (CUDA when a GPU is present); default: the checkpoint's "
                  "train.device")
      ->check(CLI::IsMember({"cpu", "cuda", "auto"}));
  cmd->callback([] {
    validate_sampling_options(opt);
    require_directory("--checkpoint", checkpoint, "checkpoint directory or run directory");
    CheckpointInfo ckpt = open_checkpoint(checkpoint);
    const Config& cfg = ckpt.config;
    data::Tokenizer tokenizer = load_run_tokenizer(cfg, tokenizer_name);
    const int V = cfg.model.vocab_size;
    if (tokenizer.vocab_size() > V)
      fail("tokenizer ", tokenizer.origin(), " has ", tokenizer.vocab_size(),
           " tokens but the checkpoint's model.vocab_size is ", V,
           ": it is not the tokenizer this model was trained with (see --tokenizer)");
    const std::optional<int32_t> eot = tokenizer.token_id("<|endoftext|>");

    std::vector<int32_t> ids = tokenizer.encode_with_special(prompt);
    if (ids.empty()) {
      if (!eot)
        fail("--prompt is empty and tokenizer ", tokenizer.origin(),
             " has no <|endoftext|> to start an unconditional sample from; give a prompt");
      ids.push_back(*eot);
    }
    const int ctx = cfg.model.context_length;
    if (int(ids.size()) > ctx)
      fail("--prompt is ", ids.size(), " tokens, more than the model's context_length of ", ctx);

    const std::string dev = device.empty() ? cfg.train.device : device;
    std::unique_ptr<Backend> backend = [&] {
      try {
        return make_backend(dev);
      } catch (const Error& e) {
        if (!device.empty()) throw;
        fail(e.what(), "\n  (device \"", dev, "\" is the checkpoint's train.device; pass "
             "--device cpu|cuda|auto to choose another)");
      }
    }();
    Model model(cfg.model, cfg.residual, *backend, 1, int(ids.size()));
    load_model_weights(ckpt, model);
    model.enable_kv_cache(ctx);
    opt.stop_token = eot ? *eot : -1;
    opt.vocab_limit = tokenizer.vocab_size();  // never draw the embedding's padding rows

    const auto start = std::chrono::steady_clock::now();
    const Generation g = generate(model, ids, opt, [&](int32_t t) {
      const std::string& bytes = tokenizer.token_bytes(t);
      std::fwrite(bytes.data(), 1, bytes.size(), stdout);
      std::fflush(stdout);
    });
    const double secs =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::fputc('\n', stdout);
    std::fflush(stdout);
    const char* why = g.reason == StopReason::StopToken    ? "<|endoftext|>"
                      : g.reason == StopReason::ContextFull ? "context length reached"
                                                            : "--max-tokens reached";
    std::fprintf(stderr,
                 "[sample] %s (step %lld, %s): %zu prompt + %zu new tokens in %.2f s "
                 "(%.1f tokens/s, %s), stopped: %s\n",
                 ckpt.dir.c_str(), static_cast<long long>(ckpt.step),
                 residual_mode_name(cfg.residual.mode), ids.size(), g.tokens.size(), secs,
                 secs > 0 ? double(ids.size() + g.tokens.size()) / secs : 0.0,
                 backend->name().c_str(), why);
  });
}

}  // namespace mhar::cli
