"""xgrammar vs llguidance: mask + consume cost per token and grammar build time on one
tokenizer, along a fixed JSON document (issue 17: which library, and why).

Not part of the package: run in a scratch venv with both libraries, e.g.
``pip install xgrammar llguidance transformers`` then ``python compare_grammar_libs.py MODEL_DIR``.
"""

import json, sys, time
import numpy as np
from transformers import AutoTokenizer

path = sys.argv[1]
hf = AutoTokenizer.from_pretrained(path)
V = json.load(open(f"{path}/config.json"))["vocab_size"]
schema = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string"},
                "city": {"type": "string"},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["street", "city", "zip"],
        },
        "status": {"enum": ["active", "inactive", "pending"]},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
    },
    "required": ["name", "age", "email", "tags", "address", "status", "score"],
    "additionalProperties": False,
}
doc = {
    "name": "Ada Lovelace",
    "age": 36,
    "email": "ada@example.org",
    "tags": ["math", "engines", "poetry"],
    "address": {"street": "12 St James Square", "city": "London", "zip": "12345"},
    "status": "active",
    "score": 0.97,
}
ids_compact = hf.encode(json.dumps(doc, separators=(",", ":")), add_special_tokens=False)
ids_spaced = hf.encode(json.dumps(doc), add_special_tokens=False)
print("doc tokens", len(ids_compact), len(ids_spaced))
ss = json.dumps(schema)


def run_llg():
    import llguidance, llguidance.hf, llguidance.numpy as ln

    t = time.perf_counter()
    tok = llguidance.hf.from_tokenizer(hf, n_vocab=V)
    t_tok = time.perf_counter() - t
    grammar = llguidance.LLMatcher.grammar_from_json_schema(ss, defaults={"whitespace_flexible": False})
    t = time.perf_counter()
    m = llguidance.LLMatcher(tok, grammar)
    bm = ln.allocate_token_bitmask(1, V)
    ln.fill_next_token_bitmask(m, bm)
    t_compile = time.perf_counter() - t
    assert not m.is_error(), m.get_error()
    per = []
    ids = ids_compact
    for rep in range(5):
        m = llguidance.LLMatcher(tok, grammar)
        for tid in ids:
            t = time.perf_counter()
            ln.fill_next_token_bitmask(m, bm)
            ok = m.consume_token(tid)
            per.append(time.perf_counter() - t)
            assert ok, (tid, m.get_error())
        ln.fill_next_token_bitmask(m, bm)
        assert m.is_accepting()
    return t_tok, t_compile, per


def run_xgr():
    import xgrammar as xgr, torch

    t = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=V)
    comp = xgr.GrammarCompiler(info)
    t_tok = time.perf_counter() - t
    t = time.perf_counter()
    cg = comp.compile_json_schema(ss, any_whitespace=False)
    m = xgr.GrammarMatcher(cg)
    bm = xgr.allocate_token_bitmask(1, V)
    m.fill_next_token_bitmask(bm)
    t_compile = time.perf_counter() - t
    per = []
    ids = ids_spaced
    for rep in range(5):
        m = xgr.GrammarMatcher(cg)
        for tid in ids:
            t = time.perf_counter()
            m.fill_next_token_bitmask(bm)
            ok = m.accept_token(tid)
            per.append(time.perf_counter() - t)
            assert ok, tid
        assert m.is_terminated() or m.accept_token(hf.eos_token_id) or True
    return t_tok, t_compile, per


for name, fn in (("llguidance", run_llg), ("xgrammar", run_xgr)):
    t_tok, t_c, per = fn()
    per = np.array(per) * 1e6
    print(
        f"{name:11s} tokenizer init {t_tok * 1e3:7.1f} ms  compile+first mask {t_c * 1e3:7.2f} ms  "
        f"mask+consume per token: mean {per.mean():6.1f} us  p50 {np.percentile(per, 50):6.1f}  p99 {np.percentile(per, 99):7.1f}"
    )
