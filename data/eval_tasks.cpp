// eval_tasks.cpp: the harness's conventions for LAMBADA, HellaSwag and WikiText (see
// eval_tasks.h for each one and the harness file it comes from), the batched scorer, and
// the metrics.
#include "data/eval_tasks.h"

#include <unicode/uchar.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "data/unicode.h"
#include "engine/error.h"
#include "engine/file_io.h"
#include "engine/json_io.h"

namespace mhar::evaltask {

// ---------------------------------------------------------------- Python semantics

// str.isspace: bidirectional class WS, B or S, or category Zs (the list Python documents
// for \s in str patterns and str.split()).
bool py_isspace(char32_t c) {
  if (c >= 0x09 && c <= 0x0D) return true;
  if (c >= 0x1C && c <= 0x20) return true;
  if (c == 0x85 || c == 0xA0 || c == 0x1680) return true;
  if (c >= 0x2000 && c <= 0x200A) return true;
  return c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

namespace {

void append_utf8(std::string& out, char32_t c) {
  if (c < 0x80) {
    out += char(c);
  } else if (c < 0x800) {
    out += char(0xC0 | (c >> 6));
    out += char(0x80 | (c & 0x3F));
  } else if (c < 0x10000) {
    out += char(0xE0 | (c >> 12));
    out += char(0x80 | ((c >> 6) & 0x3F));
    out += char(0x80 | (c & 0x3F));
  } else {
    out += char(0xF0 | (c >> 18));
    out += char(0x80 | ((c >> 12) & 0x3F));
    out += char(0x80 | ((c >> 6) & 0x3F));
    out += char(0x80 | (c & 0x3F));
  }
}

// Length of the whitespace character at s[i], 0 if none.
size_t space_at(std::string_view s, size_t i) {
  const data::DecodedChar d = data::decode_utf8(s, i);
  return d.code != data::kInvalidByte && py_isspace(d.code) ? d.length : 0;
}

std::string replace_all(std::string s, std::string_view from, std::string_view to) {
  std::string out;
  size_t pos = 0;
  for (;;) {
    const size_t hit = s.find(from, pos);
    if (hit == std::string::npos) break;
    out.append(s, pos, hit - pos);
    out += to;
    pos = hit + from.size();
  }
  out.append(s, pos, std::string::npos);
  return out;
}

// re.sub(r"O\s*([^C]*?)\s*C", r"O\1C", s) for one bracket pair: a match runs from an
// opening character to the next closing one, and the group is what lies between,
// stripped of whitespace on both sides (greedy \s* before a lazy group before \s*).
std::string tighten_brackets(std::string_view s, char open, char close) {
  std::string out;
  size_t i = 0;
  while (i < s.size()) {
    if (s[i] != open) {
      out += s[i++];
      continue;
    }
    const size_t j = s.find(close, i + 1);
    if (j == std::string_view::npos) {  // no match here, nor at any later opening
      out.append(s.substr(i));
      break;
    }
    out += open;
    out += py_strip(s.substr(i + 1, j - i - 1));
    out += close;
    i = j + 1;
  }
  return out;
}

}  // namespace

std::string py_strip(std::string_view s) {
  size_t b = 0;
  while (b < s.size()) {
    const size_t n = space_at(s, b);
    if (!n) break;
    b += n;
  }
  // Trailing: walk forward remembering where the last non-space character ended.
  size_t end = b;
  for (size_t i = b; i < s.size();) {
    const size_t n = space_at(s, i);
    if (n) {
      i += n;
    } else {
      i += data::decode_utf8(s, i).length;
      end = i;
    }
  }
  return std::string(s.substr(b, end - b));
}

std::string py_capitalize(std::string_view s) {
  std::string out;
  bool first = true;
  for (size_t i = 0; i < s.size();) {
    const data::DecodedChar d = data::decode_utf8(s, i);
    if (d.code == data::kInvalidByte) {
      out += s[i];
    } else {
      const UChar32 c = static_cast<UChar32>(d.code);
      append_utf8(out, static_cast<char32_t>(first ? u_totitle(c) : u_tolower(c)));
    }
    first = false;
    i += d.length;
  }
  return out;
}

size_t py_len(std::string_view s) {
  size_t n = 0;
  for (size_t i = 0; i < s.size(); i += data::decode_utf8(s, i).length) ++n;
  return n;
}

size_t py_whitespace_split_count(std::string_view s) {
  size_t pieces = 1;
  for (size_t i = 0; i < s.size();) {
    size_t n = space_at(s, i);
    if (!n) {
      i += data::decode_utf8(s, i).length;
      continue;
    }
    ++pieces;  // one separator per maximal run of whitespace
    while (n) {
      i += n;
      n = i < s.size() ? space_at(s, i) : 0;
    }
  }
  return pieces;
}

// ---------------------------------------------------------------- preprocessing

std::string hellaswag_preprocess(std::string_view text) {
  std::string s = py_strip(text);
  s = replace_all(s, " [title]", ". ");
  // re.sub("\\[.*?\\]", "", s): '.' does not match a newline, so a bracket closes only
  // on its own line.
  std::string out;
  for (size_t i = 0; i < s.size();) {
    if (s[i] == '[') {
      size_t j = i + 1;
      while (j < s.size() && s[j] != ']' && s[j] != '\n') ++j;
      if (j < s.size() && s[j] == ']') {
        i = j + 1;
        continue;
      }
    }
    out += s[i++];
  }
  return replace_all(out, "  ", " ");
}

std::string wikitext_detokenize(std::string_view page) {
  std::string s(page);
  s = replace_all(s, "s '", "s'");
  // re.sub(r"/' [0-9]/", r"/'[0-9]/", s): the harness replaces the match by the literal
  // text "/'[0-9]/"; kept as it is, since that is what the scores were computed with.
  {
    std::string out;
    size_t i = 0;
    while (i < s.size()) {
      if (i + 5 <= s.size() && s.compare(i, 3, "/' ") == 0 && s[i + 3] >= '0' && s[i + 3] <= '9' &&
          s[i + 4] == '/') {
        out += "/'[0-9]/";
        i += 5;
      } else {
        out += s[i++];
      }
    }
    s = out;
  }
  s = replace_all(s, " @-@ ", "-");
  s = replace_all(s, " @,@ ", ",");
  s = replace_all(s, " @.@ ", ".");
  s = replace_all(s, " : ", ": ");
  s = replace_all(s, " ; ", "; ");
  s = replace_all(s, " . ", ". ");
  s = replace_all(s, " ! ", "! ");
  s = replace_all(s, " ? ", "? ");
  s = replace_all(s, " , ", ", ");
  s = tighten_brackets(s, '(', ')');
  s = tighten_brackets(s, '[', ']');
  s = tighten_brackets(s, '{', '}');
  s = tighten_brackets(s, '"', '"');
  s = tighten_brackets(s, '\'', '\'');
  s = replace_all(s, "= = = =", "====");
  s = replace_all(s, "= = =", "===");
  s = replace_all(s, "= =", "==");
  s = replace_all(s, " \xC2\xB0 ", "\xC2\xB0");  // chr(176)
  s = replace_all(s, " \n", "\n");
  s = replace_all(s, "\n ", "\n");
  s = replace_all(s, " N ", " 1 ");
  s = replace_all(s, " 's", "'s");
  return s;
}

std::vector<std::string> wikitext_pages(std::string_view raw) {
  std::vector<std::string> pages;
  std::string page;
  bool have_lines = false;
  size_t pos = 0;
  for (;;) {
    const size_t nl = raw.find('\n', pos);
    const std::string_view line = raw.substr(pos, nl == std::string_view::npos ? raw.npos : nl - pos);
    std::string r = py_strip(replace_all(replace_all(std::string(line), "= = =", "==="), "= =", "=="));
    const bool heading = r.size() >= 3 && r.compare(0, 2, "= ") == 0 &&
                         r.compare(r.size() - 2, 2, " =") == 0;
    if (heading) {
      if (!py_strip(page).empty()) pages.push_back(page);
      page.clear();
      have_lines = false;
    }
    if (have_lines) page += '\n';
    page.append(line);
    have_lines = true;
    if (nl == std::string_view::npos) break;
    pos = nl + 1;
  }
  pages.push_back(page);  // the last page is kept even when blank, as the dataset does
  return pages;
}

// ---------------------------------------------------------------- requests

Request encode_pair(const data::Tokenizer& tok, std::string context, std::string continuation,
                    int32_t prefix_token) {
  Request r;
  if (context.empty()) {
    r.tokens.push_back(prefix_token);
    const std::vector<int32_t> cont = tok.encode_with_special(continuation);
    r.tokens.insert(r.tokens.end(), cont.begin(), cont.end());
    r.continuation = int(cont.size());
    return r;
  }
  // HFLM._encode_pair: trailing whitespace of the context (str.rstrip) joins the
  // continuation.
  size_t keep = 0;  // the context up to the end of its last non-space character
  for (size_t i = 0; i < context.size();) {
    const size_t n = space_at(context, i);
    i += n ? n : data::decode_utf8(context, i).length;
    if (!n) keep = i;
  }
  continuation = context.substr(keep) + continuation;
  context.resize(keep);
  r.tokens = tok.encode_with_special(context + continuation);
  const size_t ctx_len = tok.encode_with_special(context).size();
  r.continuation = int(r.tokens.size() > ctx_len ? r.tokens.size() - ctx_len : 0);
  return r;
}

std::vector<Request> rolling_requests(const std::vector<int32_t>& tokens, int32_t prefix_token,
                                      int max_len) {
  MHAR_CHECK(max_len >= 1, "max_len ", max_len);
  std::vector<Request> out;
  const int64_t n = int64_t(tokens.size());
  if (n == 0) return out;
  // First window: [prefix] + tokens[:first-1] predicting tokens[:first]; as a disjoint
  // pair its context is [prefix] alone.
  const int64_t first = std::min<int64_t>(max_len, n);
  Request r0;
  r0.tokens.push_back(prefix_token);
  r0.tokens.insert(r0.tokens.end(), tokens.begin(), tokens.begin() + first);
  r0.continuation = int(first);
  out.push_back(std::move(r0));
  int64_t predicted = first;
  while (predicted < n) {
    const int64_t pred = std::min<int64_t>(n - predicted, max_len);  // pred_len = L - 1 + 1
    const int64_t end = predicted + pred;
    // Input tokens[end-L-1 : end-1] predicting tokens[end-pred : end]; context + the
    // continuation is tokens[end-L-1 : end].
    Request r;
    r.tokens.assign(tokens.begin() + (end - max_len - 1), tokens.begin() + end);
    r.continuation = int(pred);
    out.push_back(std::move(r));
    predicted = end;
  }
  return out;
}

int request_input_length(const Request& r, int max_len) {
  return int(std::min<int64_t>(int64_t(r.tokens.size()), int64_t(max_len) + 1)) - 1;
}

// ---------------------------------------------------------------- progress

Progress::Progress(std::string label, int64_t total, bool enabled)
    : label_(std::move(label)), total_(total), enabled_(enabled && total > 0),
      tty_(isatty(2) != 0) {}

void Progress::advance(int64_t n) {
  done_ += n;
  if (!enabled_) return;
  const double f = double(done_) / double(total_);
  if (tty_) {
    const int width = 30, filled = int(f * width);
    std::fprintf(stderr, "\r%s [%s%s] %lld/%lld", label_.c_str(), std::string(filled, '#').c_str(),
                 std::string(width - filled, '.').c_str(), (long long)done_, (long long)total_);
    std::fflush(stderr);
  } else if (int(f * 10) > last_decile_) {
    last_decile_ = int(f * 10);
    std::fprintf(stderr, "%s %lld/%lld (%d%%)\n", label_.c_str(), (long long)done_,
                 (long long)total_, int(f * 100));
  }
}

void Progress::finish() {
  if (enabled_ && tty_) std::fprintf(stderr, "\n");
}

// ---------------------------------------------------------------- scoring

std::vector<Score> score_requests(Model& model, const std::vector<Request>& requests, int max_len,
                                  bool need_greedy, Progress* progress) {
  Backend& be = model.backend();
  const int B = model.batch(), T = model.seq_len();
  const int64_t N = int64_t(B) * T;
  const int V = model.config().vocab_size;
  for (size_t i = 0; i < requests.size(); ++i) {
    const Request& r = requests[i];
    const int n = request_input_length(r, max_len);
    if (n > T) fail("evaluation request ", i, " needs ", n, " input tokens; the model was built for ", T);
    if (r.continuation > n)
      fail("evaluation request ", i, ": its continuation of ", r.continuation,
           " tokens does not fit in the maximum length ", max_len, " (use a larger --seq-len)");
    for (int32_t t : r.tokens)
      if (t < 0 || t >= V)
        fail("evaluation request ", i, ": token id ", t, " is outside the model's vocabulary of ", V,
             " (the tokenizer does not match the checkpoint; pass the one it was trained with)");
  }
  std::vector<Score> scores(requests.size());
  std::vector<int32_t> tokens(static_cast<size_t>(N)), targets(static_cast<size_t>(N));
  std::vector<double> losses(static_cast<size_t>(N)), row(static_cast<size_t>(V));
  for (size_t start = 0; start < requests.size(); start += size_t(B)) {
    const size_t count = std::min(requests.size() - start, size_t(B));
    std::fill(tokens.begin(), tokens.end(), 0);
    std::fill(targets.begin(), targets.end(), 0);
    for (size_t b = 0; b < count; ++b) {
      const Request& r = requests[start + b];
      const int n = request_input_length(r, max_len);
      const int32_t* w = r.tokens.data() + (r.tokens.size() - size_t(n) - 1);  // last n+1 tokens
      for (int t = 0; t < n; ++t) {
        tokens[b * T + t] = w[t];
        targets[b * T + t] = w[t + 1];
      }
    }
    model.forward(tokens.data(), targets.data(), 0.0);
    be.download(losses.data(), model.losses());  // per token; forward returns their mean
    for (size_t b = 0; b < count; ++b) {
      const Request& r = requests[start + b];
      const int n = request_input_length(r, max_len);
      Score& s = scores[start + b];
      s.greedy = true;
      for (int t = n - r.continuation; t < n; ++t) {
        const int64_t idx = int64_t(b) * T + t;
        s.logprob -= losses[size_t(idx)];
        if (need_greedy && s.greedy) {
          // The head's chunk holding the row (computed once, then read from its buffer).
          const int64_t chunk = model.logits_chunk(), page = idx / chunk * chunk;
          be.download(row.data(), model.logits(page, std::min(chunk, N - page))[idx - page]);
          const int best = int(std::max_element(row.begin(), row.end()) - row.begin());  // first max
          s.greedy = best == targets[size_t(idx)];
        }
      }
      if (!need_greedy) s.greedy = false;
    }
    if (progress) progress->advance(int64_t(count));
  }
  if (progress) progress->finish();
  return scores;
}

// ---------------------------------------------------------------- tasks

Task parse_task(const std::string& name) {
  if (name == "lambada") return Task::Lambada;
  if (name == "hellaswag") return Task::HellaSwag;
  if (name == "wikitext") return Task::WikiText;
  fail("--task '", name, "' is not a task; valid: lambada, hellaswag, wikitext");
}

const char* task_name(Task t) {
  switch (t) {
    case Task::Lambada: return "lambada";
    case Task::HellaSwag: return "hellaswag";
    case Task::WikiText: return "wikitext";
  }
  return "?";
}

namespace {

// Python's text-mode reading (universal newlines): "\r\n" and a lone "\r" become "\n".
std::string universal_newlines(const std::string& s) {
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '\r') {
      out += '\n';
      if (i + 1 < s.size() && s[i + 1] == '\n') ++i;
    } else {
      out += s[i];
    }
  }
  return out;
}

void require_utf8(const std::string& text, const std::string& path) {
  int64_t line = 1;
  for (size_t i = 0; i < text.size();) {
    const data::DecodedChar d = data::decode_utf8(text, i);
    if (d.code == data::kInvalidByte) {
      char byte[8];
      std::snprintf(byte, sizeof byte, "0x%02X", unsigned(static_cast<uint8_t>(text[i])));
      fail(path, ": line ", line, ", byte offset ", i, ": invalid UTF-8 (byte ", byte, "); task files are UTF-8 text");
    }
    if (text[i] == '\n') ++line;
    i += d.length;
  }
}

// Non-blank lines of a jsonl file, each parsed strictly; blank lines are skipped.
template <class F>
void for_each_jsonl(const std::string& text, const std::string& path, F&& f) {
  size_t pos = 0;
  int64_t line_no = 0;
  while (pos <= text.size()) {
    const size_t nl = text.find('\n', pos);
    const std::string line = text.substr(pos, nl == std::string::npos ? std::string::npos : nl - pos);
    ++line_no;
    if (!py_strip(line).empty()) {
      const std::string where = path + ":" + std::to_string(line_no);
      nlohmann::json j = parse_json_strict(line, where);
      if (!j.is_object()) fail(where, ": expected a JSON object per line, got ", json_excerpt(j));
      f(j, where);
    }
    if (nl == std::string::npos) break;
    pos = nl + 1;
  }
}

}  // namespace

TaskData load_task(Task task, const std::string& path, const data::Tokenizer& tok, int max_len) {
  TaskData d;
  d.task = task;
  d.path = path;
  const std::string text = universal_newlines(read_regular_file(path, "evaluation task file"));
  require_utf8(text, path);
  const int32_t prefix = tok.eot_id();
  auto begin_doc = [&] {
    d.first.push_back(int64_t(d.requests.size()));
    ++d.docs;
  };
  switch (task) {
    case Task::Lambada:
      for_each_jsonl(text, path, [&](const nlohmann::json& j, const std::string& where) {
        const std::string t = json_to_string(json_member(j, "text", where), where + ": text");
        // text.split(' ')[:-1] joined by ' ' is everything before the last ' '.
        const size_t cut = t.rfind(' ');
        const std::string ctx = cut == std::string::npos ? "" : t.substr(0, cut);
        const std::string target = " " + (cut == std::string::npos ? t : t.substr(cut + 1));
        begin_doc();
        d.requests.push_back(encode_pair(tok, ctx, target, prefix));
      });
      break;
    case Task::HellaSwag:
      for_each_jsonl(text, path, [&](const nlohmann::json& j, const std::string& where) {
        const std::string label_s = json_to_string(json_member(j, "activity_label", where), where + ": activity_label");
        const std::string a = json_to_string(json_member(j, "ctx_a", where), where + ": ctx_a");
        const std::string b = json_to_string(json_member(j, "ctx_b", where), where + ": ctx_b");
        const nlohmann::json& endings = json_member(j, "endings", where);
        if (!endings.is_array() || endings.empty())
          fail(where, ": endings must be a non-empty array of strings, got ", json_excerpt(endings));
        const nlohmann::json& lab = json_member(j, "label", where);
        int64_t label = -1;
        const int64_t hi = int64_t(endings.size()) - 1;
        if (lab.is_string()) {  // the Hugging Face copy stores "0".."3"
          const std::string s = lab.get<std::string>();
          if (s.empty() || s.size() > 9 || s.find_first_not_of("0123456789") != std::string::npos ||
              std::stoll(s) > hi)
            fail(where, ": label ", json_excerpt(lab), " is not an index of endings (0..", hi, ")");
          label = std::stoll(s);
        } else {
          label = json_to_int(lab, where + ": label", 0, hi);
        }
        const std::string query = hellaswag_preprocess(label_s + ": " + a + " " + py_capitalize(b));
        begin_doc();
        d.label.push_back(int(label));
        for (size_t e = 0; e < endings.size(); ++e) {
          const std::string ew = where + ": endings[" + std::to_string(e) + "]";
          const std::string choice = hellaswag_preprocess(json_to_string(endings[e], ew));
          if (choice.empty()) fail(ew, " is empty after preprocessing; acc_norm divides by its length");
          d.requests.push_back(encode_pair(tok, query, " " + choice, prefix));
          d.choice_chars.push_back(double(py_len(choice)));
        }
      });
      break;
    case Task::WikiText: {
      for (const std::string& page : wikitext_pages(text)) {
        begin_doc();
        d.words.push_back(int64_t(py_whitespace_split_count(page)));
        d.bytes.push_back(int64_t(page.size()));
        const std::vector<int32_t> toks = tok.encode_with_special(wikitext_detokenize(page));
        for (Request& r : rolling_requests(toks, prefix, max_len)) d.requests.push_back(std::move(r));
      }
      int64_t bytes = 0;
      for (int64_t b : d.bytes) bytes += b;
      if (bytes == 0) fail(path, ": no text to score (the file is empty or blank)");
      break;
    }
  }
  if (d.docs == 0) fail(path, ": no documents (expected one JSON object per line)");
  d.first.push_back(int64_t(d.requests.size()));
  return d;
}

int longest_input(const TaskData& data, int max_len) {
  int n = 1;
  for (const Request& r : data.requests) n = std::max(n, request_input_length(r, max_len));
  return n;
}

nlohmann::json task_metrics(const TaskData& d, const std::vector<Score>& scores) {
  MHAR_CHECK(scores.size() == d.requests.size(), "one score per request");
  nlohmann::json out = {{"task", task_name(d.task)}, {"file", d.path}, {"docs", d.docs},
                        {"requests", d.requests.size()}};
  switch (d.task) {
    case Task::Lambada: {
      double ll = 0, acc = 0;
      for (const Score& s : scores) {
        ll += s.logprob;
        acc += s.greedy ? 1 : 0;
      }
      out["acc"] = acc / double(d.docs);
      out["perplexity"] = std::exp(-ll / double(d.docs));
      break;
    }
    case Task::HellaSwag: {
      double acc = 0, acc_norm = 0;
      for (int64_t doc = 0; doc < d.docs; ++doc) {
        int64_t best = d.first[doc], best_norm = d.first[doc];
        for (int64_t r = d.first[doc]; r < d.first[doc + 1]; ++r) {
          if (scores[r].logprob > scores[best].logprob) best = r;
          if (scores[r].logprob / d.choice_chars[r] > scores[best_norm].logprob / d.choice_chars[best_norm])
            best_norm = r;
        }
        acc += best - d.first[doc] == d.label[doc] ? 1 : 0;
        acc_norm += best_norm - d.first[doc] == d.label[doc] ? 1 : 0;
      }
      out["acc"] = acc / double(d.docs);
      out["acc_norm"] = acc_norm / double(d.docs);
      break;
    }
    case Task::WikiText: {
      double ll = 0;
      int64_t words = 0, bytes = 0, tokens = 0;
      for (int64_t doc = 0; doc < d.docs; ++doc) {
        words += d.words[doc];
        bytes += d.bytes[doc];
      }
      for (size_t r = 0; r < scores.size(); ++r) {
        ll += scores[r].logprob;
        tokens += d.requests[r].continuation;
      }
      out["loglikelihood"] = ll;
      out["words"] = words;
      out["bytes"] = bytes;
      out["tokens"] = tokens;
      out["word_perplexity"] = std::exp(-ll / double(words));
      out["byte_perplexity"] = std::exp(-ll / double(bytes));
      out["bits_per_byte"] = -ll / double(bytes) / std::log(2.0);
      break;
    }
  }
  return out;
}

}  // namespace mhar::evaltask
