// cmd_data.cpp: `mhar data ...`: prepare (documents -> shards), inspect (a shard's
// header and decoded text), train-tokenizer (byte-level BPE -> tokenizer.json),
// encode (ids of a text) and bench-tokenizer (encoding throughput by thread count).
// The work itself lives in data/; this file parses options and prints summaries.
#include <sys/resource.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "cli/commands.h"
#include "data/bpe_trainer.h"
#include "data/corpus.h"
#include "data/eval_sets.h"
#include "data/prepare.h"
#include "data/shard.h"
#include "data/tokenizer.h"
#include "engine/error.h"

namespace mhar::cli {
namespace {

namespace fs = std::filesystem;
using data::Tokenizer;

void register_prepare(CLI::App& data) {
  auto opt = std::make_shared<data::PrepareOptions>();
  auto* cmd = data.add_subcommand(
      "prepare",
      "Tokenize documents into llm.c shards (train_*.bin, val_*.bin) with whole documents held out "
      "for validation; each document starts with <|endoftext|>.");
  cmd->add_option("--tokenizer", opt->tokenizer, "gpt2, qwen3, or a path to a tokenizer.json")->capture_default_str();
  cmd->add_option("--input", opt->inputs, ".jsonl / .txt files or folders of them (documents in input order)")
      ->required();
  cmd->add_option("--out", opt->out_dir, "Output folder")->required();
  auto* vd = cmd->add_option("--val-docs", opt->val_docs, "Exact number of validation documents");
  auto* vf = cmd->add_option("--val-fraction", opt->val_fraction,
                             "Fraction of documents held out for validation (default 0.01)");
  vd->excludes(vf);
  cmd->add_option("--shard-tokens", opt->shard_tokens, "Tokens per shard")->capture_default_str();
  cmd->add_option("--threads", opt->threads, "Encoding threads (0: all cores)")->capture_default_str();
  auto* quiet = cmd->add_flag("--no-progress", "No progress bar");
  cmd->callback([opt, quiet] {
    opt->progress = quiet->count() == 0;
    const data::PrepareSummary s = data::prepare(*opt);
    const uint64_t tokens = s.train_tokens + s.val_tokens;
    const uint64_t separators = s.documents;
    std::printf("tokenizer      %s (vocab %d)\n", s.tokenizer.c_str(), s.vocab_size);
    std::printf("documents      %llu (train %llu, val %llu)\n", (unsigned long long)s.documents,
                (unsigned long long)s.train_documents, (unsigned long long)s.val_documents);
    std::printf("tokens         %llu (train %llu in %zu shard(s), val %llu in %zu shard(s))\n",
                (unsigned long long)tokens, (unsigned long long)s.train_tokens, s.train_shards.size(),
                (unsigned long long)s.val_tokens, s.val_shards.size());
    std::printf("text           %.1f MB, %.3f bytes per token (separators excluded)\n", s.text_bytes / 1e6,
                tokens > separators ? double(s.text_bytes) / (tokens - separators) : 0.0);
    std::printf("time           %.1f s (%.1f MB/s)\n", s.seconds, s.seconds > 0 ? s.text_bytes / 1e6 / s.seconds : 0);
    std::printf("output         %s\n", opt->out_dir.c_str());
  });
}

void register_inspect(CLI::App& data) {
  auto path = std::make_shared<std::string>();
  auto tokenizer = std::make_shared<std::string>();
  auto offset = std::make_shared<uint64_t>(0);
  auto count = std::make_shared<size_t>(64);
  auto* cmd = data.add_subcommand("inspect", "Print a shard's header, token statistics and a decoded excerpt");
  cmd->add_option("shard", *path, "Shard file")->required();
  cmd->add_option("--tokenizer", *tokenizer,
                  "Tokenizer for decoding (default: the one in the folder's prepare.json, else gpt2)");
  cmd->add_option("--offset", *offset, "First token of the excerpt")->capture_default_str();
  cmd->add_option("--count", *count, "Tokens in the excerpt")->capture_default_str();
  cmd->callback([=] {
    data::MappedShard shard(*path);
    const auto& info = shard.info();
    std::string tok_name = *tokenizer;
    const fs::path meta = fs::path(*path).parent_path() / "prepare.json";
    if (tok_name.empty() && fs::exists(meta)) {
      std::ifstream in(meta);
      try {
        tok_name = nlohmann::json::parse(in).value("tokenizer_file", "");
      } catch (const nlohmann::json::exception&) {
      }
    }
    if (tok_name.empty()) tok_name = "gpt2";
    const Tokenizer tok = Tokenizer::load(tok_name);
    std::printf("file      %s (%llu bytes)\n", info.path.c_str(), (unsigned long long)info.file_bytes);
    std::printf("header    magic %d, version %d (%s tokens), %llu tokens\n", info.magic, info.version,
                info.token_bytes == 2 ? "uint16" : "uint32", (unsigned long long)info.tokens);
    uint64_t max_id = 0, eots = 0;
    const int32_t eot = tok.token_id("<|endoftext|>").value_or(-1);
    for (uint64_t i = 0; i < info.tokens; ++i) {
      const int32_t id = shard.at(i);
      max_id = std::max<uint64_t>(max_id, static_cast<uint64_t>(id));
      eots += id == eot;
    }
    std::printf("tokens    max id %llu, %llu <|endoftext|> (documents)\n", (unsigned long long)max_id,
                (unsigned long long)eots);
    std::printf("decoding  with %s\n", tok.describe().c_str());
    if (max_id >= static_cast<uint64_t>(tok.vocab_size()))
      std::printf("warning   ids go beyond this tokenizer's vocabulary (%d)\n", tok.vocab_size());
    if (*offset >= info.tokens) return;
    const size_t n = static_cast<size_t>(std::min<uint64_t>(*count, info.tokens - *offset));
    std::vector<int32_t> ids(n);
    shard.copy(*offset, n, ids.data());
    std::string ids_text;
    for (size_t i = 0; i < n && i < 32; ++i) ids_text += (i ? " " : "") + std::to_string(ids[i]);
    std::printf("ids       [%llu..%llu) %s%s\n", (unsigned long long)*offset, (unsigned long long)(*offset + n),
                ids_text.c_str(), n > 32 ? " ..." : "");
    std::string text;
    for (int32_t id : ids) text += id < tok.vocab_size() ? tok.token_bytes(id) : "<?>";
    std::printf("text      %s\n", text.c_str());
  });
}

void register_train_tokenizer(CLI::App& data) {
  auto opt = std::make_shared<data::TrainTokenizerOptions>();
  auto* cmd = data.add_subcommand(
      "train-tokenizer",
      "Train a byte-level BPE tokenizer (GPT-2 pre-tokenization) and write a Hugging Face tokenizer.json");
  cmd->add_option("--vocab", opt->vocab_size, "Vocabulary size, including 256 bytes and <|endoftext|>")
      ->capture_default_str();
  cmd->add_option("--input", opt->inputs, ".jsonl / .txt files or folders of them")->required();
  cmd->add_option("--out", opt->out, "Output tokenizer.json")->required();
  cmd->add_option("--min-frequency", opt->min_frequency, "Stop when the best pair is rarer than this")
      ->capture_default_str();
  cmd->add_option("--max-bytes", opt->max_bytes, "Read at most this many bytes of text (0: all)")
      ->capture_default_str();
  cmd->add_option("--threads", opt->threads, "Counting threads (0: all cores)")->capture_default_str();
  cmd->callback([opt] {
    const auto s = data::train_tokenizer(*opt);
    std::printf("read        %llu documents, %.1f MB, %llu distinct pieces (%.1f s)\n",
                (unsigned long long)s.documents, s.text_bytes / 1e6, (unsigned long long)s.unique_pieces,
                s.count_seconds);
    std::printf("trained     %d merges, vocab %d (<|endoftext|> = %d)\n", s.merges, s.vocab_size, s.vocab_size - 1);
    std::printf("time        %.1f s\n", s.seconds);
    std::printf("output      %s\n", opt->out.c_str());
  });
}

void register_encode(CLI::App& data) {
  auto tokenizer = std::make_shared<std::string>("gpt2");
  auto text = std::make_shared<std::string>();
  auto file = std::make_shared<std::string>();
  auto* cmd = data.add_subcommand("encode", "Print the token ids of a text (plain text unless --special)");
  cmd->add_option("--tokenizer", *tokenizer, "gpt2, qwen3, or a path to a tokenizer.json")->capture_default_str();
  auto* t = cmd->add_option("--text", *text, "The text");
  auto* f = cmd->add_option("--file", *file, "Read the text from a file");
  t->excludes(f);
  auto* special = cmd->add_flag("--special", "Match added tokens such as <|endoftext|> in the text");
  cmd->callback([=] {
    const Tokenizer tok = Tokenizer::load(*tokenizer);
    std::string input = *text;
    if (!file->empty()) {
      std::ifstream in(*file, std::ios::binary);
      if (!in) fail(*file, ": cannot open");
      std::ostringstream ss;
      ss << in.rdbuf();
      input = ss.str();
    }
    const auto ids = special->count() ? tok.encode_with_special(input) : tok.encode(input);
    std::string out;
    for (size_t i = 0; i < ids.size(); ++i) out += (i ? " " : "") + std::to_string(ids[i]);
    std::printf("%s\n", out.c_str());
  });
}

void register_bench(CLI::App& data) {
  auto tokenizer = std::make_shared<std::string>("gpt2");
  auto inputs = std::make_shared<std::vector<std::string>>();
  auto threads = std::make_shared<std::vector<int>>(std::vector<int>{1});
  auto max_bytes = std::make_shared<uint64_t>(0);
  auto repeat = std::make_shared<int>(1);
  auto* cmd = data.add_subcommand("bench-tokenizer",
                                  "Measure plain-text encoding throughput (MB/s) on documents, per thread count");
  cmd->add_option("--tokenizer", *tokenizer, "gpt2, qwen3, or a path to a tokenizer.json")->capture_default_str();
  cmd->add_option("--input", *inputs, ".jsonl / .txt files or folders")->required();
  cmd->add_option("--threads", *threads, "Thread counts to measure, e.g. --threads 1 2")->capture_default_str();
  cmd->add_option("--max-bytes", *max_bytes, "Use at most this many bytes of text (0: all)")->capture_default_str();
  cmd->add_option("--repeat", *repeat, "Runs per thread count (the best is reported)")->capture_default_str();
  cmd->callback([=] {
    const Tokenizer first = Tokenizer::load(*tokenizer);
    data::DocumentReader reader(*inputs);
    std::vector<std::string> docs;
    uint64_t bytes = 0;
    data::Document d;
    while ((*max_bytes == 0 || bytes < *max_bytes) && reader.next(d)) {
      bytes += d.text.size();
      docs.push_back(std::move(d.text));
    }
    std::printf("%s\n%zu documents, %.2f MB\n", first.describe().c_str(), docs.size(), bytes / 1e6);
    // CPU seconds (all threads) next to wall seconds: MB per CPU-second stays flat when
    // the threads share nothing, even on a machine that other work keeps busy.
    auto cpu_seconds = [] {
      rusage u;
      getrusage(RUSAGE_SELF, &u);
      return u.ru_utime.tv_sec + u.ru_stime.tv_sec + 1e-6 * (u.ru_utime.tv_usec + u.ru_stime.tv_usec);
    };
    double single = 0;
    for (int t : *threads) {
      double best = 1e30, best_cpu = 0;
      uint64_t tokens = 0;
      for (int r = 0; r < std::max(1, *repeat); ++r) {
        // A fresh load per run: no run starts with pieces another run already merged.
        const Tokenizer tok = Tokenizer::load(*tokenizer);
        const double c0 = cpu_seconds();
        const auto t0 = std::chrono::steady_clock::now();
        const auto out = tok.encode_batch(docs, t);
        const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        if (wall < best) best = wall, best_cpu = cpu_seconds() - c0;
        tokens = 0;
        for (const auto& o : out) tokens += o.size();
      }
      const double mbps = bytes / 1e6 / best;
      if (t == (*threads)[0]) single = mbps;
      std::printf("threads %2d: %7.3f s wall  %7.2f MB/s  %6.2f M tokens/s  x%.2f vs %d thread(s)  | %7.3f CPU s, "
                  "%6.2f MB per CPU s  (%llu tokens)\n",
                  t, best, mbps, tokens / 1e6 / best, mbps / single, (*threads)[0], best_cpu,
                  best_cpu > 0 ? bytes / 1e6 / best_cpu : 0.0, (unsigned long long)tokens);
    }
  });
}

// data/eval_sets.h
void register_make_eval(CLI::App& data) {
  auto opt = std::make_shared<data::MakeEvalOptions>();
  auto* cmd = data.add_subcommand(
      "make-eval",
      "Write LAMBADA-, HellaSwag- and WikiText-format files (for `mhar eval --task`) from the documents "
      "that `data prepare` held out, without any passage that shares a 13-word run with training text");
  cmd->add_option("--shards", opt->shards_dir, "The folder `data prepare` wrote (its prepare.json)")->required();
  cmd->add_option("--out", opt->out_dir, "Output folder")->required();
  cmd->add_option("--items", opt->max_items, "At most this many items per task")->capture_default_str();
  cmd->add_option("--seed", opt->seed, "Seed of the HellaSwag answer positions")->capture_default_str();
  cmd->callback([opt] {
    const data::MakeEvalSummary s = data::make_eval_sets(*opt);
    std::printf("held-out documents %lld; dropped %lld candidates sharing a 13-gram with training text\n",
                (long long)s.held_out_documents, (long long)s.dropped_contaminated);
    std::printf("lambada    %lld passages    %s\n", (long long)s.lambada, s.lambada_path.c_str());
    std::printf("hellaswag  %lld items       %s\n", (long long)s.hellaswag, s.hellaswag_path.c_str());
    std::printf("wikitext   %lld paragraphs  %s\n", (long long)s.wikitext_paragraphs, s.wikitext_path.c_str());
  });
}

}  // namespace

void register_data(CLI::App& app) {
  auto* data = app.add_subcommand("data", "Tokenizers, token shards and the corpus");
  data->require_subcommand(1);
  register_prepare(*data);
  register_inspect(*data);
  register_train_tokenizer(*data);
  register_encode(*data);
  register_bench(*data);
  register_make_eval(*data);
}

}  // namespace mhar::cli
