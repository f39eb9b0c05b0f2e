// eval_tasks.h (data/): zero-shot evaluation tasks read in their published file formats and
// scored the way EleutherAI's lm-evaluation-harness scores them (`mhar eval --task`).
//
//   lambada   OpenAI LAMBADA jsonl, one {"text": ...} per line. Harness task
//             lm_eval/tasks/lambada/lambada_openai.yaml: context = the text's words
//             split on ' ' without the last, joined by ' '; target = ' ' + last word;
//             output_type loglikelihood. acc = mean over documents of "every target
//             token is the argmax" (is_greedy); perplexity = exp(-mean log-likelihood of
//             the target), the harness's `perplexity` aggregation.
//   hellaswag HellaSwag jsonl ({"activity_label","ctx_a","ctx_b","endings","label"}).
//             lm_eval/tasks/hellaswag/hellaswag.yaml + utils.py process_docs: query =
//             preprocess(activity_label + ": " + ctx_a + " " + ctx_b.capitalize()),
//             choices = preprocess(ending); output_type multiple_choice with the default
//             target_delimiter " " (continuation = " " + choice). acc = argmax of the
//             summed log-likelihood == label; acc_norm = argmax of log-likelihood / len(choice)
//             in characters (the harness's completion_len). Ties take the first choice
//             (numpy argmax).
//   wikitext  WikiText raw file (wiki.test.raw). Pages are split as the harness's
//             dataset EleutherAI/wikitext_document_level does (a line that, after
//             "= = =" -> "===" and "= =" -> "==" and strip, starts with "= " and ends
//             with " =", opens a page; blank pages are dropped except the last).
//             lm_eval/tasks/wikitext/wikitext.yaml + preprocess_wikitext.py: the scored
//             text is wikitext_detokenizer(page); output_type loglikelihood_rolling;
//             words = len(re.split(r"\s+", page)) and bytes = len(page.encode()) of the
//             page BEFORE detokenization. word_perplexity = exp(-sum ll / sum words),
//             byte_perplexity = exp(-sum ll / sum bytes), bits_per_byte =
//             -sum ll / sum bytes / ln 2 (weighted_perplexity and bits_per_byte in
//             lm_eval/api/metrics.py).
//
// Requests follow the harness's HFLM: a (context, continuation) pair moves trailing
// spaces of the context onto the continuation, encodes context + continuation and the
// context alone, and scores the tokens of the whole beyond the context's; an empty
// context becomes the prefix token (<|endoftext|>). The model reads
// (context + continuation)[-(L+1):][:-1] with L the maximum length. Rolling
// log-likelihood uses lm_eval.utils.get_rolling_token_windows with context_len 1 and
// make_disjoint_window: disjoint windows of L predicted tokens, the first conditioned on
// the prefix token, the last on the L tokens before its predictions.
// Text is encoded as Hugging Face's tokenizer.encode(add_special_tokens=False) does
// (added tokens such as "<|endoftext|>" in the text are matched).
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "data/tokenizer.h"
#include "engine/model.h"

namespace mhar::evaltask {

// ---- Python string semantics the harness's conventions depend on (UTF-8 text).
bool py_isspace(char32_t c);                         // str.isspace of one character
std::string py_strip(std::string_view s);            // str.strip()
std::string py_capitalize(std::string_view s);       // str.capitalize() (ICU simple case mapping)
size_t py_len(std::string_view s);                   // len(str): code points
size_t py_whitespace_split_count(std::string_view s);  // len(re.split(r"\s+", s))

// ---- The harness's text preprocessing.
std::string hellaswag_preprocess(std::string_view text);  // hellaswag/utils.py preprocess
std::string wikitext_detokenize(std::string_view page);   // preprocess_wikitext.py
std::vector<std::string> wikitext_pages(std::string_view raw);  // document-level split

// ---- Requests.
// One log-likelihood request: `tokens` = context + continuation, the last `continuation`
// of which are scored.
struct Request {
  std::vector<int32_t> tokens;
  int continuation = 0;
};
Request encode_pair(const data::Tokenizer& tok, std::string context, std::string continuation,
                    int32_t prefix_token);
// get_rolling_token_windows(tokens, prefix, max_len, context_len=1) followed by
// make_disjoint_window, as requests.
std::vector<Request> rolling_requests(const std::vector<int32_t>& tokens, int32_t prefix_token,
                                      int max_len);
// Length of the model input of a request: min(tokens, L + 1) - 1.
int request_input_length(const Request& r, int max_len);

struct Score {
  double logprob = 0;  // sum of log p(continuation token | prefix)
  bool greedy = false;  // every continuation token is the argmax (only when asked)
};

// Progress on stderr: a bar redrawn in place on a terminal, a line per 10% otherwise.
class Progress {
 public:
  Progress(std::string label, int64_t total, bool enabled);
  void advance(int64_t n);
  void finish();

 private:
  std::string label_;
  int64_t total_, done_ = 0;
  int last_decile_ = -1;
  bool enabled_, tty_;
};

// Scores requests in batches of model.batch() rows of model.seq_len() tokens (every
// request's input must fit: request_input_length <= seq_len). Padding follows each
// input; causality keeps it out of the scored positions.
std::vector<Score> score_requests(Model& model, const std::vector<Request>& requests, int max_len,
                                  bool need_greedy, Progress* progress = nullptr);

// ---- Tasks.
enum class Task { Lambada, HellaSwag, WikiText };
Task parse_task(const std::string& name);  // "lambada", "hellaswag", "wikitext"
const char* task_name(Task t);

struct TaskData {
  Task task;
  std::string path;
  int64_t docs = 0;
  std::vector<Request> requests;
  // Per document: its requests are [first[d], first[d+1]).
  std::vector<int64_t> first;
  std::vector<int> label;            // hellaswag
  std::vector<double> choice_chars;  // hellaswag: len(choice) per request
  std::vector<int64_t> words, bytes;  // wikitext, per document
};
// Reads and encodes a task file; errors name the file, line and field.
TaskData load_task(Task task, const std::string& path, const data::Tokenizer& tok, int max_len);
// The longest model input over the task's requests (at least 1).
int longest_input(const TaskData& data, int max_len);
// The harness's metrics from the scores of data.requests.
nlohmann::json task_metrics(const TaskData& data, const std::vector<Score>& scores);

}  // namespace mhar::evaltask
