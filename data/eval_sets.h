// eval_sets.h: `mhar data make-eval`: evaluation files in the formats of
// data/eval_tasks.h, built from the documents that `mhar data prepare` held out for
// validation, so the training shards never saw them.
//
// Which documents: prepare.json of the shard folder gives the inputs, the document
// counts and the held-out document ids; the documents are re-read and selected by
// prepare's own rule (document i of D is held out iff floor((i+1)n/D) > floor(i n/D)),
// and their ids must equal the recorded ones (else the inputs changed since prepare).
// Decontamination: a candidate item is dropped when any of its 13-word n-grams (the
// GPT-3 paper's contamination unit) occurs in a training document, which removes the
// boilerplate that books share (licence headers and footers).
//
//   lambada.jsonl    {"text"}: passages of 40..120 words of running text ending in a
//                    word of >= 3 letters that occurs earlier in the passage (the cloze
//                    target: LAMBADA's construction without its human filtering).
//   hellaswag.jsonl  {"ind","activity_label","ctx_a","ctx_b","endings","label"}: 45
//                    words of context, the true next 15 words among 4 endings, the other
//                    3 being the endings of other items; the label's position is fixed by
//                    a hash of the item index and the seed.
//   wikitext.raw     one page per held-out document (" = <id> = " heading, then the
//                    document's paragraphs as " <paragraph> " lines separated by " "
//                    lines), as in wiki.*.raw.
// Everything is a function of the inputs and the seed: the same files byte for byte.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace mhar::data {

struct MakeEvalOptions {
  std::string shards_dir;  // holds prepare.json
  std::string out_dir;
  int64_t max_items = 1000;  // per task (passages, items, paragraphs)
  uint64_t seed = 1234;
};

struct MakeEvalSummary {
  int64_t held_out_documents = 0;
  int64_t lambada = 0, hellaswag = 0, wikitext_paragraphs = 0;
  int64_t dropped_contaminated = 0;  // candidates sharing a 13-gram with training text
  std::string lambada_path, hellaswag_path, wikitext_path;
};

MakeEvalSummary make_eval_sets(const MakeEvalOptions& options);

// The 13-word n-gram hashes of a text's whitespace-separated words (sorted, unique).
std::vector<uint64_t> ngram_hashes(const std::string& text, int n = 13);

}  // namespace mhar::data
