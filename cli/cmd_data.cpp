// cmd_data.cpp: `mhar data ...`: prepare (documents -> shards), inspect (a shard's
// header and decoded text), train-tokenizer (byte-level BPE -> tokenizer.json),
// encode (ids of a text) and bench-tokenizer (encoding throughput by thread count).
// The work itself lives in data/; this file parses options and prints summaries.
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cmath>
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
#include "engine/file_io.h"
#include "engine/json_io.h"

namespace mhar::cli {
namespace {

namespace fs = std::filesystem;
using data::Tokenizer;

// Every --threads of these commands: 0 (all cores) or 1..kMaxThreads (data/tokenizer.h
// says why the bound); checked before any thread starts.
void check_threads(int n, const char* command) {
  if (n < 0 || n > data::kMaxThreads)
    fail(command, ": --threads ", n, " is out of range; valid: 0 (all cores) or 1 to ", data::kMaxThreads,
         " (more threads than cores only costs memory; the output is the same for any count)");
}

// An output folder: refused when the path is a file, created (with its parents) otherwise.
void make_output_folder(const std::string& dir, const char* command) {
  std::error_code ec;
  const auto st = fs::status(dir, ec);
  if (st.type() != fs::file_type::not_found && st.type() != fs::file_type::directory)
    fail(command, ": --out ", dir, " exists and is not a folder; give a folder for the output");
  fs::create_directories(dir, ec);
  if (ec) fail(command, ": --out ", dir, ": cannot create the folder (", ec.message(), ")");
}

// An output file: refused when the path is a folder or its folder does not exist.
void check_output_file(const std::string& path, const char* command) {
  std::error_code ec;
  if (fs::is_directory(path, ec))
    fail(command, ": --out ", path, " is a folder; give the path of the file to write (e.g. ",
         (fs::path(path) / "tokenizer.json").string(), ")");
  const fs::path parent = fs::path(path).parent_path();
  if (!parent.empty() && !fs::is_directory(parent, ec))
    fail(command, ": --out ", path, ": the folder ", parent.string(), " does not exist (or is not a folder)");
}

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
  cmd->callback([opt, quiet, vd, vf] {
    opt->progress = quiet->count() == 0;
    // Given values are checked here: prepare() reads a negative or NaN value as "not
    // given", which would silently hold out the default 1% instead.
    if (vd->count() && opt->val_docs < 0)
      fail("data prepare: --val-docs ", vd->results().front(), " is negative; give a number of documents >= 0");
    if (vf->count() && !(std::isfinite(opt->val_fraction) && opt->val_fraction >= 0 && opt->val_fraction <= 1))
      fail("data prepare: --val-fraction ", vf->results().front(), " is not a number within 0..1");
    check_threads(opt->threads, "data prepare");
    make_output_folder(opt->out_dir, "data prepare");
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
    const data::ShardReader shard(*path);
    const auto& info = shard.info();
    std::string tok_name = *tokenizer;
    const fs::path meta = fs::path(*path).parent_path() / "prepare.json";
    std::error_code ec;
    if (tok_name.empty() && fs::exists(fs::symlink_status(meta, ec))) {
      // A damaged prepare.json is an error, not a silent fallback to gpt2, which would
      // print another tokenizer's garbage for the shard.
      try {
        const auto j = read_json_file(meta.string(), "prepare.json");
        tok_name = json_to_string(json_member(j, "tokenizer_file", meta.string()), meta.string() + ": tokenizer_file");
      } catch (const Error& e) {
        fail(e.what(), "; give --tokenizer to decode the shard without it");
      }
    }
    if (tok_name.empty()) tok_name = "gpt2";
    const Tokenizer tok = Tokenizer::load(tok_name);
    std::printf("file      %s (%llu bytes)\n", info.path.c_str(), (unsigned long long)info.file_bytes);
    std::printf("header    magic %d, version %d (%s tokens), %llu tokens\n", info.magic, info.version,
                info.token_bytes == 2 ? "uint16" : "uint32", (unsigned long long)info.tokens);
    uint64_t max_id = 0, eots = 0;
    const int64_t eot = tok.token_id("<|endoftext|>").value_or(-1);
    std::vector<int32_t> chunk(static_cast<size_t>(std::min<uint64_t>(info.tokens, 1u << 20)));
    for (uint64_t start = 0; start < info.tokens; start += chunk.size()) {
      const size_t n = static_cast<size_t>(std::min<uint64_t>(chunk.size(), info.tokens - start));
      shard.copy(start, n, chunk.data());
      for (size_t i = 0; i < n; ++i) {
        const uint64_t id = static_cast<uint32_t>(chunk[i]);  // uint32 shards: ids up to 2^32-1
        max_id = std::max(max_id, id);
        eots += static_cast<int64_t>(id) == eot;
      }
    }
    std::printf("tokens    max id %llu, %llu <|endoftext|> (documents)\n", (unsigned long long)max_id,
                (unsigned long long)eots);
    std::printf("decoding  with %s\n", tok.describe().c_str());
    if (info.tokens > 0 && max_id >= static_cast<uint64_t>(tok.vocab_size()))
      std::printf("warning   ids go beyond this tokenizer's vocabulary (%d)\n", tok.vocab_size());
    if (*offset >= info.tokens) return;
    const size_t n = static_cast<size_t>(std::min<uint64_t>(*count, info.tokens - *offset));
    std::vector<int32_t> ids(n);
    shard.copy(*offset, n, ids.data());
    std::string ids_text;
    for (size_t i = 0; i < n && i < 32; ++i)
      ids_text += (i ? " " : "") + std::to_string(static_cast<uint32_t>(ids[i]));
    std::printf("ids       [%llu..%llu) %s%s\n", (unsigned long long)*offset, (unsigned long long)(*offset + n),
                ids_text.c_str(), n > 32 ? " ..." : "");
    std::string text;
    for (int32_t id : ids) text += id >= 0 && id < tok.vocab_size() ? tok.token_bytes(id) : "<?>";
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
    check_threads(opt->threads, "data train-tokenizer");
    check_output_file(opt->out, "data train-tokenizer");
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
    if (!file->empty()) input = read_regular_file(*file, "text file");
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
    for (int t : *threads) check_threads(t, "data bench-tokenizer");
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
