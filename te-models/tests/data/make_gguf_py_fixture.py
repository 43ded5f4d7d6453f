"""Writes gguf_py_fixture.gguf: a GGUF file built by llama.cpp's own Python package (`pip install
gguf numpy`, gguf 0.19.0), the third-party reference the te-models GGUF reader is checked against
(te-models/src/gguf/tests/fixture.rs).

For each type: `<type>.raw`, 3 rows of 256 elements of seeded random blocks (their f16 scales
overwritten with finite values), and `<type>.expected`, gguf-py's numpy dequantization of them as
F32. Plus metadata of every kind a model's tokenizer and hyper-parameters use.

Run: python3 make_gguf_py_fixture.py (from this folder).
"""
import numpy as np
from gguf import GGUFWriter, GGMLQuantizationType as T, GGML_QUANT_SIZES
from gguf.quants import dequantize

rng = np.random.default_rng(2025)
ROWS, COLS = 3, 256

# Byte offsets of the f16 scale fields inside one block (ggml-common.h).
SCALES = {
    T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2], T.Q8_0: [0],
    T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208],
}

w = GGUFWriter("gguf_py_fixture.gguf", arch="gemma3")
w.add_block_count(18)
w.add_uint32("gemma3.attention.head_count", 4)
w.add_float32("gemma3.rope.freq_base", 1e6)
w.add_float64("fixture.f64", -2.5)
w.add_int32("fixture.i32", -7)
w.add_uint64("fixture.u64", 1 << 40)
w.add_int8("fixture.i8", -3)
w.add_uint16("fixture.u16", 65535)
w.add_bool("tokenizer.ggml.add_bos_token", True)
w.add_string("tokenizer.ggml.model", "llama")
w.add_token_list(["<pad>", "<eos>", "<bos>", "▁the", "<0x0A>"])
w.add_token_scores([0.0, 0.0, 0.0, -3.25, -1000.0])
w.add_token_types([3, 3, 3, 1, 6])
w.add_bos_token_id(2)

for t in [T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K]:
    block, size = GGML_QUANT_SIZES[t]
    name = t.name.lower()
    if t in (T.F32, T.F16):
        vals = rng.uniform(-2, 2, (ROWS, COLS)).astype(np.float32 if t == T.F32 else np.float16)
        raw = vals.view(np.uint8)
    elif t == T.BF16:
        bits = (rng.uniform(-2, 2, (ROWS, COLS)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
        raw = bits.view(np.uint8)
    else:
        n_blocks = ROWS * COLS // block
        raw = rng.integers(0, 256, (n_blocks, size), dtype=np.uint8)
        for off in SCALES[t]:
            d = (rng.uniform(1e-3, 1e-1, n_blocks) * rng.choice([-1, 1], n_blocks)).astype(np.float16)
            raw[:, off:off + 2] = d.view(np.uint8).reshape(n_blocks, 2)
        raw = raw.reshape(ROWS, COLS // block * size)
    w.add_tensor(f"{name}.raw", raw, raw_dtype=t)
    w.add_tensor(f"{name}.expected", dequantize(raw, t).astype(np.float32).reshape(ROWS, COLS))

w.write_header_to_file()
w.write_kv_data_to_file()
w.write_tensors_to_file()
w.close()
