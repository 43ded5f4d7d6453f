//! `#[derive(Module)]` misuses fail to compile with an error spanning the misuse.

// Test code: a panic (unwrap, expect) is how a test reports a failure.
#![allow(clippy::unwrap_used, clippy::expect_used)]

#[test]
fn misuses_are_compile_errors() {
    trybuild::TestCases::new().compile_fail("tests/ui/*.rs");
}
