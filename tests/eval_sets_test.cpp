// eval_sets_test.cpp: `mhar data make-eval` (data/eval_sets.h): the files are the same
// byte for byte on a second run, hold only text of the held-out documents, never text
// that training documents share (a boilerplate paragraph planted in every document), and
// load as tasks of data/eval_tasks.h.
#include <gtest/gtest.h>

#include <fstream>
#include <sstream>
#include <random>

#include "data/eval_sets.h"
#include "data/eval_tasks.h"
#include "data/prepare.h"
#include "tests/data_test_util.h"

namespace mhar::test {
namespace {

std::string collapse(const std::string& s) {
  std::string out;
  bool space = false;
  for (char c : s) {
    if (c == ' ' || c == '\n' || c == '\t' || c == '\r') {
      space = !out.empty();
    } else {
      if (space) out += ' ';
      space = false;
      out += c;
    }
  }
  return out;
}

const char* kBoilerplate =
    "This book is free to copy under the terms of the licence that came with it, read the licence before "
    "you share it with anyone.";

std::string make_document(uint64_t seed) {
  static const char* vocab[] = {"the", "river", "town", "garden", "house", "walked", "slowly", "over", "bright",
                                "morning", "window", "letter", "friend", "mother", "found", "quiet", "stone",
                                "bridge", "water", "under", "light", "across", "field", "small", "black", "horse",
                                "road", "evening", "door", "opened", "looked", "again", "never", "always", "cold"};
  std::mt19937_64 rng(seed);
  std::string text = std::string(kBoilerplate) + "\n\n";
  for (int p = 0; p < 12; ++p) {
    for (int s = 0; s < 5; ++s) {
      const int n = 8 + int(rng() % 8);
      for (int w = 0; w < n; ++w) {
        std::string word = vocab[rng() % (sizeof(vocab) / sizeof(vocab[0]))];
        if (w == 0) word[0] = char(word[0] - 32);
        text += word + (w + 1 == n ? ". " : " ");
      }
    }
    text += "\n\n";
  }
  return text + kBoilerplate + "\n";
}

TEST(MakeEval, DeterministicHeldOutOnlyDecontaminatedAndLoadable) {
  MHAR_LOAD_TOKENIZER_OR_SKIP(tok, "gpt2");
  TempDir dir;
  std::vector<std::string> docs;
  {
    std::ofstream out(dir / "books.jsonl");
    for (int d = 0; d < 6; ++d) {
      docs.push_back(make_document(100 + d));
      out << nlohmann::json({{"id", "book" + std::to_string(d)}, {"text", docs.back()}}).dump() << "\n";
    }
  }
  data::PrepareOptions po;
  po.tokenizer = "gpt2";
  po.inputs = {dir / "books.jsonl"};
  po.out_dir = dir / "shards";
  po.val_docs = 2;
  po.threads = 1;
  po.progress = false;
  data::prepare(po);
  const nlohmann::json meta = nlohmann::json::parse(read_bytes(dir / "shards/prepare.json"));
  std::vector<std::string> held, trained;
  for (int d = 0; d < 6; ++d) {
    bool is_val = false;
    for (const auto& id : meta["val_document_ids"]) is_val |= id.get<std::string>() == "book" + std::to_string(d);
    (is_val ? held : trained).push_back(collapse(docs[d]));
  }
  ASSERT_EQ(held.size(), 2u);

  data::MakeEvalOptions opt;
  opt.shards_dir = dir / "shards";
  opt.out_dir = dir / "eval1";
  opt.max_items = 50;
  const data::MakeEvalSummary s1 = data::make_eval_sets(opt);
  opt.out_dir = dir / "eval2";
  const data::MakeEvalSummary s2 = data::make_eval_sets(opt);
  for (const char* f : {"lambada.jsonl", "hellaswag.jsonl", "wikitext.raw"})
    EXPECT_EQ(read_bytes(dir / (std::string("eval1/") + f)), read_bytes(dir / (std::string("eval2/") + f))) << f;
  EXPECT_GT(s1.lambada, 3);
  EXPECT_GE(s1.hellaswag, 4);
  EXPECT_GT(s1.wikitext_paragraphs, 3);
  EXPECT_GE(s1.dropped_contaminated, 2) << "the boilerplate paragraphs must have been dropped";
  EXPECT_EQ(s1.lambada, s2.lambada);

  // From a held-out document, and no run of 13 words of it occurs in a training document.
  auto from_held = [&](const std::string& text) {
    const std::string c = collapse(text);
    bool in_held = false;
    for (const auto& h : held) in_held |= h.find(c) != std::string::npos;
    std::vector<std::string> words;
    std::istringstream in(c);
    for (std::string w; in >> w;) words.push_back(w);
    for (size_t i = 0; i + 13 <= words.size(); ++i) {
      std::string run = words[i];
      for (size_t k = 1; k < 13; ++k) run += " " + words[i + k];
      for (const auto& t : trained)
        if (t.find(run) != std::string::npos) return false;
    }
    return in_held;
  };
  const evaltask::TaskData lam = evaltask::load_task(evaltask::Task::Lambada, dir / "eval1/lambada.jsonl", tok, 1024);
  EXPECT_EQ(lam.docs, s1.lambada);
  std::ifstream lin(dir / "eval1/lambada.jsonl");
  for (std::string line; std::getline(lin, line);) {
    const std::string text = nlohmann::json::parse(line)["text"];
    EXPECT_TRUE(from_held(text)) << text;
    const size_t cut = text.rfind(' ');
    const std::string target = text.substr(cut + 1);
    EXPECT_GE(target.size(), 3u);
    EXPECT_NE(text.substr(0, cut).find(target), std::string::npos) << "cloze target occurs earlier: " << text;
  }
  const evaltask::TaskData hs = evaltask::load_task(evaltask::Task::HellaSwag, dir / "eval1/hellaswag.jsonl", tok, 1024);
  EXPECT_EQ(hs.docs, s1.hellaswag);
  std::ifstream hin(dir / "eval1/hellaswag.jsonl");
  int labels[4] = {0, 0, 0, 0};
  for (std::string line; std::getline(hin, line);) {
    const nlohmann::json j = nlohmann::json::parse(line);
    const int label = j["label"];
    ++labels[label];
    ASSERT_EQ(j["endings"].size(), 4u);
    EXPECT_TRUE(from_held(j["ctx_a"].get<std::string>() + " " + j["endings"][label].get<std::string>())) << line;
    for (int e = 0; e < 4; ++e)
      if (e != label) {
        EXPECT_NE(j["endings"][e], j["endings"][label]) << line;
      }
  }
  EXPECT_GT(labels[0] + labels[1], 0);
  EXPECT_GT(labels[2] + labels[3], 0);
  const std::string raw = read_bytes(dir / "eval1/wikitext.raw");
  const std::vector<std::string> pages = evaltask::wikitext_pages(raw);
  EXPECT_EQ(pages.size(), 2u);  // one page per held-out document
  EXPECT_EQ(raw.find("licence"), std::string::npos);
  for (const std::string& page : pages) {
    std::istringstream in(page);
    std::string line;
    std::getline(in, line);  // the heading
    for (; std::getline(in, line);)
      if (line.size() > 2) {
        EXPECT_TRUE(from_held(line)) << line;
      }
  }
  evaltask::load_task(evaltask::Task::WikiText, dir / "eval1/wikitext.raw", tok, 1024);

  // The inputs changed since prepare: refused, naming prepare.json.
  {
    std::ofstream out(dir / "books.jsonl", std::ios::app);
    out << nlohmann::json({{"id", "extra"}, {"text", "more"}}).dump() << "\n";
  }
  opt.out_dir = dir / "eval3";
  EXPECT_NE(error_of([&] { data::make_eval_sets(opt); }).find("prepare.json"), std::string::npos);
  opt.shards_dir = dir / "nothing";
  EXPECT_NE(error_of([&] { data::make_eval_sets(opt); }).find("prepare.json"), std::string::npos);
}

}  // namespace
}  // namespace mhar::test
