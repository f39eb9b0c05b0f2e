# eval_tasks_ref.py: the independent reference for `mhar eval --task` (data/eval_tasks.h).
# It rebuilds LAMBADA, HellaSwag and WikiText requests the way lm-evaluation-harness does
# (tasks lambada/lambada_openai.yaml, hellaswag/hellaswag.yaml + utils.py,
# wikitext/wikitext.yaml + preprocess_wikitext.py; HFLM's _encode_pair and
# loglikelihood_rolling with get_rolling_token_windows(context_len=1) and
# make_disjoint_window), encodes with the Hugging Face `tokenizers` package (not the
# engine's tokenizer), scores with the PyTorch model of mhar_ref.py in float64 loaded from
# the checkpoint's model.safetensors, and prints the harness's metrics as JSON.
#
#   python3 tools/reference/eval_tasks_ref.py --text-only tests/fixtures/eval OUT.json
#       writes the text-level expectations (pages, detokenized text, words, bytes,
#       queries, choices, contexts and targets); needs neither torch nor tokenizers.
#   python3 tools/reference/eval_tasks_ref.py --checkpoint RUN_OR_CKPT --tokenizer tok.json \
#       --task lambada FILE [--max-length L] [--compare MHAR_EVAL_JSON]
#       scores one task; with --compare, checks `mhar eval --task` output against it
#       (accuracies exactly, perplexities within 1e-5 relative) and exits 1 if not.
import argparse
import json
import math
import os
import re
import sys

# ----------------------------------------------------------------------------------
# Task conventions (written from the harness's task files; see data/eval_tasks.h).


def lambada_pair(doc):
    words = doc["text"].split(" ")
    return " ".join(words[:-1]), " " + words[-1]


def hellaswag_preprocess(text):
    text = text.strip()
    text = text.replace(" [title]", ". ")
    text = re.sub("\\[.*?\\]", "", text)
    return text.replace("  ", " ")


def hellaswag_doc(doc):
    ctx = doc["ctx_a"] + " " + doc["ctx_b"].capitalize()
    return {
        "query": hellaswag_preprocess(doc["activity_label"] + ": " + ctx),
        "choices": [hellaswag_preprocess(e) for e in doc["endings"]],
        "gold": int(doc["label"]),
    }


def wikitext_detokenize(s):
    s = s.replace("s '", "s'")
    s = re.sub(r"/' [0-9]/", r"/'[0-9]/", s)
    for a, b in ((" @-@ ", "-"), (" @,@ ", ","), (" @.@ ", "."), (" : ", ": "), (" ; ", "; "),
                 (" . ", ". "), (" ! ", "! "), (" ? ", "? "), (" , ", ", ")):
        s = s.replace(a, b)
    s = re.sub(r"\(\s*([^\)]*?)\s*\)", r"(\1)", s)
    s = re.sub(r"\[\s*([^\]]*?)\s*\]", r"[\1]", s)
    s = re.sub(r"{\s*([^}]*?)\s*}", r"{\1}", s)
    s = re.sub(r"\"\s*([^\"]*?)\s*\"", r'"\1"', s)
    s = re.sub(r"'\s*([^']*?)\s*'", r"'\1'", s)
    for a, b in (("= = = =", "===="), ("= = =", "==="), ("= =", "=="), (" " + chr(176) + " ", chr(176)),
                 (" \n", "\n"), ("\n ", "\n"), (" N ", " 1 "), (" 's", "'s")):
        s = s.replace(a, b)
    return s


def wikitext_pages(raw):
    """EleutherAI/wikitext_document_level's split of a raw file into pages."""
    pages, ret = [], []
    for line in raw.split("\n"):
        rline = line.replace("= = =", "===").replace("= =", "==").strip()
        if rline.startswith("= ") and rline.strip().endswith(" ="):
            page = "\n".join(ret)
            if page.strip():
                pages.append(page)
            ret = []
        ret.append(line)
    pages.append("\n".join(ret))
    return pages


def read_jsonl(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def read_text(path):
    with open(path, encoding="utf-8") as f:  # universal newlines, as the dataset script
        return f.read()


def text_expectations(fixture_dir):
    lam = [dict(zip(("context", "target"), lambada_pair(d)))
           for d in read_jsonl(os.path.join(fixture_dir, "lambada.jsonl"))]
    hs = [hellaswag_doc(d) for d in read_jsonl(os.path.join(fixture_dir, "hellaswag.jsonl"))]
    for d in hs:
        d["choice_chars"] = [len(c) for c in d["choices"]]
    wt = []
    for page in wikitext_pages(read_text(os.path.join(fixture_dir, "wikitext.raw"))):
        wt.append({"page": page, "detokenized": wikitext_detokenize(page),
                   "words": len(re.split(r"\s+", page)), "bytes": len(page.encode("utf-8"))})
    return {"lambada": lam, "hellaswag": hs, "wikitext": wt}


# ----------------------------------------------------------------------------------
# Requests (HFLM) and scoring.


def rolling_windows(tokens, prefix, max_len):
    """get_rolling_token_windows(context_len=1) + make_disjoint_window."""
    if not tokens:
        return []
    pred_len = max_len  # max_seq_len - context_len + 1
    first = min(max_len, len(tokens))
    windows = [([prefix] + tokens[:first - 1], tokens[:first])]
    predicted = first
    while predicted < len(tokens):
        n = min(len(tokens) - predicted, pred_len)
        end = predicted + n
        windows.append((tokens[end - max_len - 1:end - 1], tokens[end - n:end]))
        predicted += n
    return [(a[:len(a) - (len(b) - 1)], b) for a, b in windows]


class Scorer:
    def __init__(self, checkpoint, tokenizer_path, max_length):
        import torch
        from tokenizers import Tokenizer

        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import mhar_ref
        from make_golden import read_safetensors

        ckpt = checkpoint
        if os.path.isdir(os.path.join(ckpt, "checkpoints")):  # a run directory: its newest
            names = sorted(n for n in os.listdir(os.path.join(ckpt, "checkpoints")) if n.startswith("step_"))
            ckpt = os.path.join(ckpt, "checkpoints", names[-1])
        with open(os.path.join(ckpt, "state.json")) as f:
            config = json.load(f)["config"]
        arrays, _ = read_safetensors(os.path.join(ckpt, "model.safetensors"))
        self.torch = torch
        self.model = mhar_ref.MharModel(config, attn_impl="manual", dtype=torch.float64)
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                p.copy_(torch.from_numpy(arrays[name].astype("float64")))
        self.model.eval()
        self.max_length = max_length or self.model.config["model"]["context_length"]
        self.tok = Tokenizer.from_file(tokenizer_path)
        self.prefix = self.tok.token_to_id("<|endoftext|>")

    def encode(self, s):
        return self.tok.encode(s, add_special_tokens=False).ids

    def encode_pair(self, context, continuation):
        if context == "":
            return [self.prefix], self.encode(continuation)
        n_spaces = len(context) - len(context.rstrip())
        if n_spaces > 0:
            continuation = context[-n_spaces:] + continuation
            context = context[:-n_spaces]
        whole = self.encode(context + continuation)
        ctx = self.encode(context)
        return ctx, whole[len(ctx):]

    def loglikelihood(self, ctx, cont):
        """(sum log p(cont), is_greedy), one request per forward (no padding)."""
        torch = self.torch
        inp = (ctx + cont)[-(self.max_length + 1):][:-1]
        with torch.no_grad():
            logits, _ = self.model(torch.tensor([inp]))
        logp = torch.log_softmax(logits[0, len(inp) - len(cont):len(inp)], dim=-1)
        target = torch.tensor(cont)
        ll = float(logp.gather(1, target[:, None]).sum())
        greedy = bool((logp.argmax(dim=-1) == target).all())
        return ll, greedy

    def lambada(self, path):
        lls, acc = [], []
        for doc in read_jsonl(path):
            ll, g = self.loglikelihood(*self.encode_pair(*lambada_pair(doc)))
            lls.append(ll)
            acc.append(g)
        return {"acc": sum(acc) / len(acc), "perplexity": math.exp(-sum(lls) / len(lls)), "docs": len(lls)}

    def hellaswag(self, path):
        acc = acc_norm = 0
        docs = [hellaswag_doc(d) for d in read_jsonl(path)]
        for d in docs:
            lls = [self.loglikelihood(*self.encode_pair(d["query"], " " + c))[0] for c in d["choices"]]
            norm = [ll / len(c) for ll, c in zip(lls, d["choices"])]
            acc += int(max(range(len(lls)), key=lambda i: (lls[i], -i)) == d["gold"])
            acc_norm += int(max(range(len(norm)), key=lambda i: (norm[i], -i)) == d["gold"])
        return {"acc": acc / len(docs), "acc_norm": acc_norm / len(docs), "docs": len(docs)}

    def wikitext(self, path):
        ll = words = nbytes = 0
        pages = wikitext_pages(read_text(path))
        for page in pages:
            toks = self.encode(wikitext_detokenize(page))
            for ctx, cont in rolling_windows(toks, self.prefix, self.max_length):
                ll += self.loglikelihood(ctx, cont)[0]
            words += len(re.split(r"\s+", page))
            nbytes += len(page.encode("utf-8"))
        return {"word_perplexity": math.exp(-ll / words), "byte_perplexity": math.exp(-ll / nbytes),
                "bits_per_byte": -ll / nbytes / math.log(2), "loglikelihood": ll, "docs": len(pages)}


def compare(ref, got):
    ok = True
    for key, want in ref.items():
        have = got.get(key)
        if key in ("acc", "acc_norm", "docs"):
            good = have == want
        else:
            good = have is not None and abs(have - want) <= 1e-5 * max(1.0, abs(want))
        print(f"{key}: reference {want!r}  mhar {have!r}  {'ok' if good else 'MISMATCH'}")
        ok &= good
    return ok


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--text-only", nargs=2, metavar=("FIXTURE_DIR", "OUT_JSON"))
    ap.add_argument("--checkpoint")
    ap.add_argument("--tokenizer", help="tokenizer.json (the checkpoint's data.tokenizer)")
    ap.add_argument("--task", choices=("lambada", "hellaswag", "wikitext"))
    ap.add_argument("file", nargs="?")
    ap.add_argument("--max-length", type=int, default=0)
    ap.add_argument("--compare", help="a file holding `mhar eval --task` JSON output")
    a = ap.parse_args()
    if a.text_only:
        with open(a.text_only[1], "w", encoding="utf-8") as f:
            json.dump(text_expectations(a.text_only[0]), f, indent=1, ensure_ascii=False)
            f.write("\n")
        return 0
    scorer = Scorer(a.checkpoint, a.tokenizer, a.max_length)
    ref = getattr(scorer, a.task)(a.file)
    print(json.dumps(ref))
    if a.compare:
        with open(a.compare) as f:
            got = json.loads(f.read().strip().splitlines()[-1])
        return 0 if compare(ref, got) else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
