//! Tests of the GGUF reader, dequantizers and writer.
