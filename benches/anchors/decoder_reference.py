"""Reference results of a decoder LLM from Hugging Face transformers (eager attention), for
benches/anchors/compare_logits.py to set beside ours: teacher-forced logits, perplexity and
greedy continuations of token ids that our Rust tokenizer wrote (transformers' own GGUF tokenizer
conversion of Gemma 3 is wrong, so no tokenizer is used here: `input_ids` only).

  python3 benches/anchors/decoder_reference.py --model /tmp/gemma/gemma-3-270m-q4_k_m.gguf \
      --ids ids.json --out DIR [--dtype bf16|f32] [--new-tokens 64] [--max-length 512 --stride 256]

--model is a .gguf file, a directory with --gguf-file NAME, or a Hugging Face directory
(config.json + safetensors). GGUF needs the `gguf` package (the wheel in .whl/; numpy, pyyaml
and tqdm are on the GPU machine). ids.json:
  {"texts": [{"name": str, "ids": [int, ...]}], "prompts": [{"name": str, "ids": [...]}]}
Names are [A-Za-z0-9._-]. Writes under DIR, in the format compare_logits.py documents:
  logits_<text>.npy  float32 C-order [T, vocab]: the logits of every position of the text (its
                     first --max-length tokens), one forward from position 0;
  result.json        {"perplexity": {text: {"mean_nll", "perplexity", "tokens"}},
                      "greedy": {prompt: [new ids]}, ...} plus the config, versions, settings,
                     `greedy_generate` (model.generate's continuation, a cross-check) and, for a
                     Gemma 3 GGUF, `weight_check` (the loaded weights against gguf's own
                     dequantization: a wrong conversion shows here, not as a mystery later).
Perplexity is transformers' sliding-window recipe ("Perplexity of fixed-length models"): windows
of --max-length tokens every --stride tokens, each token scored once by the first window that
holds it with context (labels of tokens already scored are -100), the first token never; the
tokens are counted exactly (log-softmax in f32, sums in f64), as te_models' `perplexity` does.
Greedy: argmax at every step over the KV cache, --new-tokens tokens, no EOS stop (an EOS id is
kept like any other token). Prints one JSON line per text, per prompt and at the end.
"""

import argparse
import json
import os
import re
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is fetched: the model is local

import numpy as np
import torch

NAME = re.compile(r"^[A-Za-z0-9._-]+$")
DTYPES = {"bf16": torch.bfloat16, "f32": torch.float32}
# Gemma 3 GGUF tensor -> (transformers parameter under model.layers.N, stored as 1 + gamma).
GEMMA3_GGUF = {
    "attn_norm": ("input_layernorm", True),
    "post_attention_norm": ("post_attention_layernorm", True),
    "ffn_norm": ("pre_feedforward_layernorm", True),
    "post_ffw_norm": ("post_feedforward_layernorm", True),
    "attn_q_norm": ("self_attn.q_norm", True),
    "attn_k_norm": ("self_attn.k_norm", True),
    "attn_q": ("self_attn.q_proj", False),
    "attn_k": ("self_attn.k_proj", False),
    "attn_v": ("self_attn.v_proj", False),
    "attn_output": ("self_attn.o_proj", False),
    "ffn_gate": ("mlp.gate_proj", False),
    "ffn_up": ("mlp.up_proj", False),
    "ffn_down": ("mlp.down_proj", False),
}


def load_model(model, gguf_file, dtype):
    """The model on CUDA with eager attention (transformers' advice for Gemma 3), and the GGUF
    path or None."""
    from transformers import AutoModelForCausalLM

    if gguf_file is None and model.endswith(".gguf"):
        model, gguf_file = os.path.split(os.path.abspath(model))
    kw = {"gguf_file": gguf_file} if gguf_file else {}
    m = AutoModelForCausalLM.from_pretrained(model, dtype=dtype, attn_implementation="eager", **kw)
    return m.to("cuda").eval(), (os.path.join(model, gguf_file) if gguf_file else None)


def config_summary(cfg):
    keys = ["model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "head_dim", "sliding_window", "layer_types",
            "query_pre_attn_scalar", "final_logit_softcapping", "attn_logit_softcapping", "rms_norm_eps",
            "rope_parameters", "tie_word_embeddings", "bos_token_id", "eos_token_id"]
    return json.loads(json.dumps({k: getattr(cfg, k) for k in keys if hasattr(cfg, k)}, default=str))


def weight_check(model, gguf_path, layers=(0,)):
    """max |loaded − gguf dequantized (rounded to the model's dtype)| ÷ max |gguf| for the
    embedding, the final norm and every tensor of `layers` (Gemma 3 only; norms less 1)."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    params = dict(model.named_parameters())
    out = {}
    for t in GGUFReader(gguf_path).tensors:
        m = re.match(r"blk\.(\d+)\.(\w+)\.weight$", t.name)
        if t.name == "token_embd.weight":
            hf, one = "model.embed_tokens.weight", False
        elif t.name == "output_norm.weight":
            hf, one = "model.norm.weight", True
        elif m and int(m[1]) in layers and m[2] in GEMMA3_GGUF:
            sub, one = GEMMA3_GGUF[m[2]]
            hf = f"model.layers.{m[1]}.{sub}.weight"
        else:
            continue
        want = torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32))
        want = want - 1.0 if one else want
        got = params.get(hf)
        if got is None or got.numel() != want.numel():
            out[t.name] = f"{hf}: missing or {None if got is None else tuple(got.shape)} vs {tuple(want.shape)}"
            continue
        got = got.detach().float().cpu()
        want = want.reshape(got.shape).to(params[hf].dtype).float()
        out[t.name] = float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))
    return out


@torch.inference_mode()
def logits_of(model, ids):
    x = torch.tensor([ids], device="cuda")
    return model(input_ids=x).logits[0].float()


@torch.inference_mode()
def perplexity(model, ids, max_length, stride):
    """transformers' sliding-window perplexity with exact token counts (see the module docs)."""
    if len(ids) < 2 or max_length < 2 or not 1 <= stride <= max_length:
        raise ValueError(f"perplexity needs ≥ 2 tokens and 1 ≤ stride ≤ max_length ({len(ids)}, {max_length}, {stride})")
    total, scored, prev_end, begin = 0.0, 0, 1, 0
    while True:
        end = min(begin + max_length, len(ids))
        logits = logits_of(model, ids[begin:end])
        # Row r predicts token begin + r + 1; score tokens prev_end..end-1 that have context here.
        first = max(prev_end, begin + 1) - begin - 1
        targets = torch.tensor(ids[begin + first + 1:end], device="cuda")
        logp = torch.log_softmax(logits[first:end - begin - 1], dim=-1)
        total -= logp.gather(1, targets[:, None]).double().sum().item()
        scored += len(targets)
        prev_end = end
        if end == len(ids):
            break
        begin += stride
    mean = total / scored
    return {"mean_nll": mean, "perplexity": float(np.exp(mean)), "tokens": scored}


@torch.inference_mode()
def greedy(model, ids, new_tokens):
    """Argmax at every step over transformers' KV cache, no EOS stop."""
    out = model(input_ids=torch.tensor([ids], device="cuda"), use_cache=True)
    toks = []
    for _ in range(new_tokens):
        nxt = out.logits[0, -1].float().argmax()
        toks.append(int(nxt))
        if len(toks) == new_tokens:
            break
        out = model(input_ids=nxt.view(1, 1), past_key_values=out.past_key_values, use_cache=True)
    return toks


@torch.inference_mode()
def hf_generate(model, ids, new_tokens):
    """model.generate's greedy continuation (min_new_tokens = max: EOS is masked, not stopped at),
    kept as a cross-check of `greedy`; they differ only where greedy picked an EOS id."""
    x = torch.tensor([ids], device="cuda")
    out = model.generate(input_ids=x, attention_mask=torch.ones_like(x), do_sample=False,
                         max_new_tokens=new_tokens, min_new_tokens=new_tokens)
    return out[0, len(ids):].tolist()


def read_ids(path, vocab):
    with open(path) as f:
        doc = json.load(f)
    lists = {k: doc.get(k, []) for k in ("texts", "prompts")}
    for kind, items in lists.items():
        for it in items:
            if not NAME.match(it["name"]):
                sys.exit(f"{kind} name {it['name']!r}: use letters, digits, '.', '_' and '-' only")
            if not it["ids"] or min(it["ids"]) < 0 or max(it["ids"]) >= vocab:
                sys.exit(f"{kind} {it['name']}: empty, or an id outside [0, {vocab})")
    return lists["texts"], lists["prompts"]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a .gguf file, or a directory")
    p.add_argument("--gguf-file", help="the GGUF file's name inside --model (a directory)")
    p.add_argument("--ids", required=True, help="ids.json written by our tokenizer")
    p.add_argument("--out", required=True)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--max-length", type=int, default=512)
    p.add_argument("--stride", type=int, default=256)
    args = p.parse_args()
    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = False  # f32 means f32
    torch.backends.cudnn.allow_tf32 = False
    os.makedirs(args.out, exist_ok=True)

    import transformers

    model, gguf_path = load_model(args.model, args.gguf_file, DTYPES[args.dtype])
    cfg = config_summary(model.config)
    texts, prompts = read_ids(args.ids, model.config.vocab_size)
    result = {
        "side": "transformers",
        "model": os.path.abspath(gguf_path or args.model),
        "dtype": args.dtype,
        "attn_implementation": "eager",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": torch.cuda.get_device_name(),
        "max_length": args.max_length,
        "stride": args.stride,
        "new_tokens": args.new_tokens,
        "config": cfg,
        "weight_check": None,
        "logits": {},
        "perplexity": {},
        "greedy": {},
        "greedy_generate": {},
    }
    print(json.dumps({"config": cfg}), flush=True)
    if gguf_path and str(cfg.get("model_type", "")).startswith("gemma3"):
        check = result["weight_check"] = weight_check(model, gguf_path)
        bad = {k: v for k, v in check.items() if not isinstance(v, float) or v > 1e-2}
        print(json.dumps({"weight_check": check, "suspect": sorted(bad)}), flush=True)

    for t in texts:
        name, ids = t["name"], t["ids"]
        logits = logits_of(model, ids[:args.max_length]).cpu().numpy()
        np.save(os.path.join(args.out, f"logits_{name}.npy"), np.ascontiguousarray(logits, dtype=np.float32))
        result["logits"][name] = {"file": f"logits_{name}.npy", "tokens": int(logits.shape[0])}
        ppl = result["perplexity"][name] = perplexity(model, ids, args.max_length, args.stride)
        print(json.dumps({"text": name, "length": len(ids), "logits_rows": int(logits.shape[0]), **ppl}), flush=True)
        del logits
        torch.cuda.empty_cache()

    for pr in prompts:
        name, ids = pr["name"], pr["ids"]
        g = result["greedy"][name] = greedy(model, ids, args.new_tokens)
        h = result["greedy_generate"][name] = hf_generate(model, ids, args.new_tokens)
        print(json.dumps({"prompt": name, "greedy": g, "generate_agrees": g == h}), flush=True)

    path = os.path.join(args.out, "result.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({"result": path, "texts": len(texts), "prompts": len(prompts)}), flush=True)


if __name__ == "__main__":
    main()
